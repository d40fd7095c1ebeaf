"""Tests of nanofp8/parallel.py: FP8 tensor, sequence and pipeline parallelism (gloo, CPU).

Starting processes is the slow part, so two groups are spawned, once each: 2 ranks (the layer
checks, the SP collectives, the byte counts, and TP=2, TP=2+SP and PP=2 training) and 4 ranks
(DP=2 x TP=2 without and with SP, DP=2 x PP=2, PP=2 x TP=2 with SP). Each rank saves what it
measured; this process judges.

What "right" means here:
  * a TP layer against its single-device FP8 twin (an Fp8Linear with the same weights): with
    fp32 communication the shards must reproduce the twin wherever they quantize the same values
    with the same scales (tensor scales are agreed over the group; block scales of 128-aligned
    shards coincide), and be as accurate against exact fp64 math where they use finer ones (row
    scales of a shard). With FP8 communication every payload that carries partial sums adds one
    FP8 rounding: that cost is measured, and bounded; FP8 traffic is ~0.5x that of BF16;
  * training: at equal steps, the loss within 1% of the single-device FP8 model, the global
    gradient norm of the first step within 1%, every replicated tensor (tied embedding copies
    included) bit-identical on the ranks that hold it, and merged shards loadable on one device.
"""

import copy
import functools
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from conftest import spawn
from nanofp8 import dist as D
from nanofp8 import parallel as P
from nanofp8.fp8 import E4M3, E5M2, GRANULARITIES, Fp8Linear, Recipe, dequantize, sqnr
from nanofp8.model import GPT, GPTConfig, apply_fp8
from nanofp8.ckptfile import load_model_state

K = N = 256  # shards of 128: block scales of a shard coincide with the single device's
B, T = 2, 16
STEPS, BATCH, SEQ, LR = 12, 8, 32, 3e-3
GRANS = GRANULARITIES

# training configurations: (arch, granularity, tp, sp, pp, micro-batches)
RUNS = {"tp2": ("gpt2", "tensor", 2, False, 1, 1), "tp2_sp": ("llama", "row", 2, True, 1, 1),
        "pp2": ("gpt2", "block", 1, False, 2, 2),  # 2 ranks; 4 ranks:
        "dp2_tp2": ("llama", "tensor", 2, False, 1, 1), "dp2_tp2_sp": ("gpt2", "block", 2, True, 1, 1),
        "dp2_pp2": ("gpt2", "tensor", 1, False, 2, 2), "pp2_tp2_sp": ("gpt2", "row", 2, True, 2, 2)}


def recipe(gran, pot=False, scaling="current"):
    return Recipe(scaling=scaling, granularity=gran, backend="emulate", power_of_two=pot)


def make_model(arch, gran):
    torch.manual_seed(0)
    cfg = GPTConfig(arch=arch, n_layer=2, n_head=4, n_embd=128, block_size=SEQ, vocab_size=128,
                    dropout=0.0, mlp_hidden=512 if arch == "gpt2" else 256)
    model = GPT(cfg)
    apply_fp8(model, recipe(gran))
    return model


def batch(step):
    """Sequences drawn from a pool of 24 fixed random ones: memorizable, so the loss falls."""
    pool = torch.randint(0, 128, (24, SEQ + 1), generator=torch.Generator().manual_seed(7))
    rows = torch.randperm(24, generator=torch.Generator().manual_seed(step))[:BATCH]
    return pool[rows, :-1], pool[rows, 1:]


# -- what the ranks run ------------------------------------------------------------------


def gather(t, dim, group):
    ts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(ts, t.contiguous(), group=group)
    return torch.cat(ts, dim)


def layer_check(groups, gran, kind, sp, comm, pot=False, comm_fmts=None, scaling="current"):
    """One TP layer against its twin. Returns SQNRs (dB) of y, dx, dW, db vs the twin, and of
    y, dx, dW vs fp64 for the twin and for the parallel layer. Delayed scaling: the third step
    (the first two fill the amax histories)."""
    g, W, r = groups.tp_group, groups.tp, groups.tp_rank
    torch.manual_seed(1)
    w, b = torch.randn(N, K) * 0.05, torch.randn(N) * 0.1
    x, dy = torch.randn(B, T, K), torch.randn(B, T, N)
    twin = Fp8Linear(K, N, recipe=recipe(gran, pot, scaling))
    with torch.no_grad():
        twin.weight.copy_(w), twin.bias.copy_(b)
    steps = 3 if scaling == "delayed" else 1
    for _ in range(steps):
        twin.zero_grad()
        xt = x.clone().requires_grad_()
        yt = twin(xt)
        yt.backward(dy)
    seq, fk, fn = (slice(r * n // W, (r + 1) * n // W) for n in (T, K, N))
    if kind == "column":
        ws, bs, xin, dyl = w[fn], b[fn], x[:, seq] if sp else x, dy[..., fn]
    else:
        ws, bs, xin, dyl = w[:, fk], b, x[..., fk], dy[:, seq] if sp else dy
    lay = P.TPLinear(ws, bs, kind, g, sp, recipe(gran, pot, scaling), comm, comm_fmts=comm_fmts)
    for _ in range(steps):
        lay.zero_grad()
        xi = xin.clone().requires_grad_()
        lay(xi).backward(dyl)
    lay.eval()  # (so the extra forward below leaves the delayed-scaling state alone)
    y = lay(xin.clone())  # forward again: the cached weight cast must give the same result
    if kind == "column":
        yf, dwf, dbf = gather(y, 2, g), gather(lay.weight.grad, 0, g), gather(lay.bias.grad, 0, g)
        dxf = gather(xi.grad, 1, g) if sp else xi.grad
    else:
        yf, dbf = gather(y, 1, g) if sp else y, lay.bias.grad
        dxf, dwf = gather(xi.grad, 2, g), gather(lay.weight.grad, 1, g)
        if sp:  # the bias gradient is partial under SP (what sync_model_parallel_grads sums)
            dbf = D.all_reduce_plain(dbf, g, torch.float32)
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    F.linear(xd, wd, b.double()).backward(dy.double())
    yd = F.linear(x.double(), w.double(), b.double())
    return {"twin": [sqnr(a, c) for a, c in zip((yt, xt.grad, twin.weight.grad, twin.bias.grad),
                                                   (yf, dxf, dwf, dbf))],
            "fp64_twin": [sqnr(yd, yt), sqnr(xd.grad, xt.grad), sqnr(wd.grad, twin.weight.grad)],
            "fp64_par": [sqnr(yd, yf), sqnr(xd.grad, dxf), sqnr(wd.grad, dwf)]}


def adversarial(kind, r, W):
    """This rank's slice (B, T/W, N) of an activation with: one outlier token (2^20 larger),
    a sequence slice 2^20 smaller than the other (rank 1's), a token of zeros."""
    x = torch.randn(B, T, N, generator=torch.Generator().manual_seed(3))
    if kind == "outlier":
        x[0, 5] *= 2.0**20
    elif kind == "range":
        x[:, T // W :] *= 2.0**-20
    elif kind == "zeros":
        x[1, T - 2] = 0.0
        x[0, : T // W] = 0.0
    return x, x[:, r * T // W : (r + 1) * T // W]


def token_sqnr(ref, got):
    """The worst per-token SQNR (all-zero tokens must come back as exact zeros: +inf)."""
    ref, got = ref.reshape(-1, ref.shape[-1]), got.reshape(-1, got.shape[-1])
    return min(sqnr(a, b) if a.abs().max() > 0 else (float("inf") if torch.all(b == 0) else -1.0)
               for a, b in zip(ref, got))


def sp_collectives(groups):
    out, g, W, r = {}, groups.tp_group, groups.tp, groups.tp_rank
    for gran in GRANS:
        lay = P.TPLinear(torch.zeros(N // W, K), None, "column", g, True, recipe(gran))
        for kind in ("outlier", "range", "zeros"):
            full, mine = adversarial(kind, r, W)
            q = P._gather_operand(mine, lay, E4M3, "x")
            back = dequantize(q).view(B, T, N)
            out[f"gather/{gran}/{kind}"] = token_sqnr(full, back)
            # round trip: every rank holds the gathered tensor / W; the reduce-scatter of those
            # W copies is this rank's slice again (one more FP8 rounding, per-token scales)
            rt = P._reduce_scatter_seq(back / W, lay, E4M3)
            out[f"roundtrip/{gran}/{kind}"] = token_sqnr(mine, rt)
            out[f"finite/{gran}/{kind}"] = bool(torch.isfinite(back).all() & torch.isfinite(rt).all())
    return out


def sp_bytes(groups, gran):
    """Bytes sent by one rank for forward + backward of a column -> row SP pair (an MLP)."""
    res = {}
    for comm in ("fp8", "bf16"):
        torch.manual_seed(2)
        col, row = (P.TPLinear(torch.randn(shape) * 0.05, None, kind, groups.tp_group, True,
                               recipe(gran), comm) for shape, kind in [((N // 2, K), "column"),
                                                                       ((K, N // 2), "row")])
        x = torch.randn(B, T // 2, K, requires_grad=True)
        D.comm_stats(reset=True)
        row(F.gelu(col(x))).sum().backward()
        res[comm] = D.comm_stats(reset=True)
    return res


def train(name, groups):
    arch, gran, tp, sp, pp, n_micro = RUNS[name]
    model = make_model(arch, gran)
    P.parallelize(model, groups.tp_group, sp=sp)
    stage = P.PipelineStage(model, groups)
    dp = P.TPDataParallel(stage, groups) if groups.dp > 1 else None
    opt = torch.optim.AdamW(stage.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = batch(step)
        part = slice(groups.dp_rank * BATCH // groups.dp, (groups.dp_rank + 1) * BATCH // groups.dp)
        micro = list(zip(x[part].chunk(n_micro), y[part].chunk(n_micro)))
        loss = P.pipeline_step(stage, micro, groups)
        P.sync_model_parallel_grads(stage, groups)
        if dp:
            assert dp.sync_gradients()
        norms.append(P.clip_grad_norm_(stage, 1.0, groups).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    x, y = batch(-1)
    ev = P.pipeline_step(stage, [(x, y)], groups, train=False).item()
    # bytes between pipeline stages for one step, FP8 and the BF16 baseline
    pp_bytes = {}
    for name, fmts in (("fp8", (E4M3, E5M2)), ("bf16", (torch.bfloat16, torch.bfloat16))):
        D.comm_stats(reset=True)
        P.pipeline_step(stage, micro, groups, act_fmt=fmts[0], grad_fmt=fmts[1])
        pp_bytes[name] = sum(v["bytes_sent"] for k, v in D.comm_stats(reset=True)["by_op"].items()
                             if k.startswith("pp_send"))
        opt.zero_grad()
    sharded = [k for k, p in stage.named_parameters() if getattr(p, "tp_sharded", False)]
    return {"losses": losses, "norms": norms, "eval": ev, "state": stage.state_dict(),
            "sharded": sharded, "groups": (groups.dp_rank, groups.tp_rank, groups.pp_rank),
            "pp_bytes": pp_bytes}


def worker(rank, world, outdir):  # run by conftest.spawn: the process group is up
    out = {}
    if world == 2:
        groups = P.make_groups(tp=2)
        for gran in GRANS:
            for kind in ("column", "row"):
                for sp in (False, True):
                    for comm in ("fp32", "fp8"):
                        out[f"layer/{gran}/{kind}/{sp}/{comm}"] = layer_check(
                            groups, gran, kind, sp, comm)
                    out[f"layer/{gran}/{kind}/{sp}/fp8_pot"] = layer_check(
                        groups, gran, kind, sp, "fp8", pot=True)
                    out[f"layer/{gran}/{kind}/{sp}/fp8_e4m3"] = layer_check(
                        groups, gran, kind, sp, "fp8", comm_fmts=(E4M3, E4M3))
                    if gran == "tensor":
                        for comm in ("fp32", "fp8"):
                            out[f"layer/{gran}/{kind}/{sp}/delayed_{comm}"] = layer_check(
                                groups, gran, kind, sp, comm, scaling="delayed")
        out["sp"] = sp_collectives(groups)
        out["bytes"] = {gran: sp_bytes(groups, gran) for gran in ("tensor", "row")}
        for name in ("tp2", "tp2_sp"):
            out[name] = train(name, groups)
        out["pp2"] = train("pp2", P.make_groups(pp=2))
    else:
        dp_tp = P.make_groups(tp=2)
        out["dp2_tp2"], out["dp2_tp2_sp"] = train("dp2_tp2", dp_tp), train("dp2_tp2_sp", dp_tp)
        out["dp2_pp2"] = train("dp2_pp2", P.make_groups(pp=2))
        out["pp2_tp2_sp"] = train("pp2_tp2_sp", P.make_groups(tp=2, pp=2))
    torch.save(out, os.path.join(outdir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """{world: [what each rank saved]} for the 2-rank and the 4-rank group."""
    res = {}
    for world in (2, 4):
        outdir = str(tmp_path_factory.mktemp(f"parallel{world}"))
        spawn(worker, world, outdir)
        res[world] = [torch.load(os.path.join(outdir, f"rank{r}.pt")) for r in range(world)]
    return res


# -- judging the layers ------------------------------------------------------------------


def layers(ranks):
    return {k.split("/", 1)[1]: v for k, v in ranks[2][0].items() if k.startswith("layer/")}


def own_scales(gran, kind, comm, i):
    """Whether output i (y, dx, dW, db) comes from a GEMM in which the TP layer uses scales of its
    own rather than the twin's: delayed scaling (each rank's history of its shard: y, dx, dW) and
    row scales cut by the shard (column dgrad: rows of dy and W^T; row forward: rows of x and W).
    Not the twin's bits there, but no less accurate."""
    cut_rows = gran == "row" and i == (1 if kind == "column" else 0)
    return (comm.startswith("delayed") and i < 3) or cut_rows


@pytest.mark.slow
@pytest.mark.dist
def test_layers_reproduce_their_single_device_twin(ranks):
    """fp32 communication isolates what sharding does to the FP8 GEMMs: where the shard uses the
    twin's scales (tensor scales agreed over the group, block scales of 128-aligned shards, row
    scales along uncut rows) the result is the twin's, up to fp32 summation order."""
    for key, m in layers(ranks).items():
        gran, kind, sp, comm = key.split("/")
        t, a, b = m["twin"], m["fp64_twin"], m["fp64_par"]
        print(f"{key:34s} vs twin: y {t[0]:6.1f} dx {t[1]:6.1f} dW {t[2]:6.1f} db {t[3]:6.1f} | "
              f"vs fp64, twin/TP: y {a[0]:.1f}/{b[0]:.1f} dx {a[1]:.1f}/{b[1]:.1f} dW {a[2]:.1f}/{b[2]:.1f}")
        if comm not in ("fp32", "delayed_fp32"):
            continue
        for i, s in enumerate(m["twin"]):
            if own_scales(gran, kind, comm, i):
                assert m["fp64_par"][i] >= m["fp64_twin"][i] - 0.5, (key, i)
            else:
                assert s >= 60, (key, i, s)


@pytest.mark.slow
@pytest.mark.dist
def test_fp8_communication_costs_one_rounding(ranks):
    """FP8 payloads that carry partial sums (row-parallel y, column-parallel dx) add one FP8
    rounding of the partial sums (the all-reduce two: it re-quantizes the sum to gather it).
    Judged against exact fp64 math: the TP layer may lose at most 3.5 dB (E4M3 payload) or 4.5 dB
    (E5M2) to the twin there. GEMM inputs gathered in FP8 (SP) lose nothing: their scales are the
    twin's. Only the SP wgrad operand with row/block scales is re-quantized from the gathered FP8
    values (one more rounding; exact when scales are powers of two, whose grids nest)."""
    for key, m in layers(ranks).items():
        gran, kind, sp, comm = key.split("/")
        if comm in ("fp32", "delayed_fp32"):
            continue
        moved = 0 if kind == "row" else 1  # the output whose partial sums travel
        e5m2 = moved == 1 and comm != "fp8_e4m3"
        assert m["twin"][moved] >= 18, (key, m["twin"])
        assert m["fp64_par"][moved] >= m["fp64_twin"][moved] - (4.5 if e5m2 else 3.5), key
        for i in set(range(4)) - {moved}:
            if own_scales(gran, kind, comm, i):
                assert m["fp64_par"][i] >= m["fp64_twin"][i] - 0.5, (key, i)
            elif sp == "True" and i == 2 and gran != "tensor" and comm != "fp8_pot":
                assert m["twin"][i] >= 20 and m["fp64_par"][i] >= m["fp64_twin"][i] - 3.5, key
            else:
                assert m["twin"][i] >= 60, (key, i, m["twin"][i])
    e5, e4 = layers(ranks)["tensor/column/True/fp8"], layers(ranks)["tensor/column/True/fp8_e4m3"]
    print(f"column dgrad reduce-scatter vs twin: E5M2 {e5['twin'][1]:.1f} dB, "
          f"E4M3 {e4['twin'][1]:.1f} dB")
    assert e4["twin"][1] > e5["twin"][1] + 3


@pytest.mark.slow
@pytest.mark.dist
def test_sp_gather_and_scatter_on_adversarial_activations(ranks):
    sp = ranks[2][0]["sp"]
    for k, v in sp.items():
        print(f"{k}: {v}")
    for gran in GRANS:
        for kind in ("outlier", "range", "zeros"):
            assert sp[f"finite/{gran}/{kind}"]
            g, rt = sp[f"gather/{gran}/{kind}"], sp[f"roundtrip/{gran}/{kind}"]
            if gran == "tensor" and kind != "zeros":
                # one scale for the whole tensor: tokens 2^20 below the amax fall under E4M3's
                # smallest subnormal, exactly as on one device. Per-token scales are the cure.
                assert g < 10
            else:
                assert g >= 28 and rt >= 25, (gran, kind, g, rt)


@pytest.mark.slow
@pytest.mark.dist
def test_sp_traffic_is_about_half_of_bf16(ranks):
    for gran, res in ranks[2][0]["bytes"].items():
        fp8, bf16 = res["fp8"]["bytes_sent"], res["bf16"]["bytes_sent"]
        tokens = B * T  # one MLP = one column + one row layer: "per layer" is half of it
        print(f"SP {gran}: FP8 {fp8 / tokens / 2:.1f} B/token/layer, BF16 {bf16 / tokens / 2:.1f}, "
              f"ratio {fp8 / bf16:.4f}; ops {sorted(res['fp8']['by_op'])}")
        assert fp8 / bf16 <= 0.55
        assert {"all_gather_fp8", "reduce_scatter_fp8"} <= res["fp8"]["by_op"].keys()


# -- judging training ----------------------------------------------------------------------


@functools.lru_cache
def reference(arch, gran):
    """The single-device FP8 model on the whole batch: losses and gradient norms per step."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = make_model(arch, gran)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        losses, norms = [], []
        for step in range(STEPS):
            x, y = batch(step)
            _, loss = model(x, y)
            loss.backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, norms, model
    finally:
        torch.set_num_threads(threads)


def runs(ranks, name):
    world = 2 if name in ("tp2", "tp2_sp", "pp2") else 4
    return [o[name] for o in ranks[world]]


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("name", list(RUNS))
def test_training_matches_single_device(ranks, name):
    arch, gran = RUNS[name][:2]
    ref_losses, ref_norms, _ = reference(arch, gran)
    rs = runs(ranks, name)
    dps = sorted({r["groups"][0] for r in rs})
    losses = [sum(next(r for r in rs if r["groups"][0] == d)["losses"][s] for d in dps) / len(dps)
              for s in range(STEPS)]  # the DP replicas' mean = the loss of the whole batch
    gap = max(abs(a - b) / b for a, b in zip(losses, ref_losses))
    # the global gradient norm at step 0 (same weights; later the FP8 trajectories drift apart)
    ngap = abs(rs[0]["norms"][0] - ref_norms[0]) / ref_norms[0]
    print(f"{name}: loss {ref_losses[0]:.4f} -> {losses[-1]:.4f} (single device {ref_losses[-1]:.4f}); "
          f"max loss gap {gap:.3%}, grad-norm gap at step 0 {ngap:.3%}")
    assert ref_losses[-1] < 0.85 * ref_losses[0], "the model should learn something"
    assert gap < 0.01 and ngap < 0.01
    # every rank reports the same loss and norm; eval loss too
    for r in rs:
        assert r["norms"] == rs[0]["norms"] and r["eval"] == rs[0]["eval"]
    # replicated tensors: bit-identical wherever they are held
    for a in rs:
        for b in rs:
            da, ta, pa = a["groups"]
            db, tb, pb = b["groups"]
            if pa != pb:
                continue
            for k, v in a["state"].items():
                if ta == tb or k not in a["sharded"]:
                    assert torch.equal(v, b["state"][k]), (name, a["groups"], b["groups"], k)
    # tied embeddings under PP: the last stage's copy is still the first stage's matrix
    if RUNS[name][4] > 1:
        for a in rs:
            for b in rs:
                if a["groups"][:2] == b["groups"][:2] and a["groups"][2] == 0 and b["groups"][2] == 1:
                    assert torch.equal(a["state"]["tok_emb.weight"], b["state"]["lm_head.weight"])


@pytest.mark.slow
@pytest.mark.dist
def test_pipeline_traffic_is_about_half_of_bf16(ranks):
    """Activations (E4M3) and gradients (E5M2) between stages: 1 byte per value + 4 per token."""
    for name in ("pp2", "pp2_tp2_sp"):
        for r in runs(ranks, name):
            b = r["pp_bytes"]
            print(f"{name} rank {r['groups']}: sent FP8 {b['fp8']} B, BF16 {b['bf16']} B, "
                  f"ratio {b['fp8'] / b['bf16']:.4f}")
            assert 0 < b["fp8"] <= 0.52 * b["bf16"]


@pytest.mark.slow
@pytest.mark.dist
def test_merged_checkpoint_loads_on_one_device(ranks):
    """The TP shards (and PP stages) of a run merge into a single-device state dict that
    evaluates to the loss the parallel model reported."""
    for name in ("tp2", "dp2_pp2", "pp2_tp2_sp"):
        arch, gran, tp, sp, pp, _ = RUNS[name]
        rs = [r for r in runs(ranks, name) if r["groups"][0] == 0]
        full = {}
        for s in range(pp):
            shards = [r["state"] for r in sorted(rs, key=lambda r: r["groups"][1]) if r["groups"][2] == s]
            full.update(P.merge_tp_state_dicts(shards, make_model(arch, gran).config))
        model = make_model(arch, gran)
        load_model_state(model, full)
        x, y = batch(-1)
        with torch.no_grad():
            loss = model(x, y)[1].item()
        print(f"{name}: merged single-device eval loss {loss:.4f}, parallel {rs[0]['eval']:.4f}")
        assert abs(loss - rs[0]["eval"]) / loss < 0.01


@pytest.mark.slow
@pytest.mark.dist
def test_groups_layout(ranks):
    """tp varies fastest, then dp, then pp: (dp_rank, tp_rank, pp_rank) of global ranks 0..3."""
    assert [o["dp2_tp2"]["groups"] for o in ranks[4]] == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]
    assert [o["pp2_tp2_sp"]["groups"] for o in ranks[4]] == [(0, 0, 0), (0, 1, 0), (0, 0, 1), (0, 1, 1)]
    assert [o["dp2_pp2"]["groups"] for o in ranks[4]] == [(0, 0, 0), (1, 0, 0), (0, 0, 1), (1, 0, 1)]
    assert [o["pp2"]["groups"] for o in ranks[2]] == [(0, 0, 0), (0, 0, 1)]
    assert P.stage_layers(5, 2, 0) == (0, 3) and P.stage_layers(5, 2, 1) == (3, 5)
    with pytest.raises(ValueError):
        P.stage_layers(1, 2, 0)


# -- in-process checks of the plan and the stages (no ranks) ------------------------------


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_plan_cuts_and_the_merge_glues_back(arch):
    """shard_linears (what parallelize does) and merge_tp_state_dicts read the one plan: the
    ranks' state_dicts merge back into the model's own, bit for bit, fused q|k|v and gate|up
    included (a plain concatenation of those shards would interleave the pieces)."""
    torch.manual_seed(0)
    model = GPT(make_model(arch, "tensor").config)
    want = model.state_dict()

    def linear(w, b, cut, name):
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=b is not None)
        lin.weight = torch.nn.Parameter(w.detach().clone())
        lin.bias = None if b is None else torch.nn.Parameter(b.detach().clone())
        return lin

    for tp in (2, 4):
        states = []
        for rank in range(tp):
            shard = copy.deepcopy(model)
            for blk in shard.blocks:
                P.shard_linears(blk, P.tp_plan(model.config), rank, tp, linear)
            assert shard.blocks[0].attn.c_attn.weight.shape[0] == 3 * 128 // tp
            states.append(shard.state_dict())
        merged = P.merge_tp_state_dicts(states, model.config)
        assert merged.keys() == want.keys()
        assert all(torch.equal(merged[k], want[k]) for k in want), (arch, tp)
        k = "blocks.0.attn.c_attn.weight"
        assert not torch.equal(torch.cat([s[k] for s in states]), want[k])


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_pipeline_stages_run_the_models_forward(arch):
    """A PipelineStage runs GPT.forward's own parts (embed, run_blocks, head) on its share of the
    model: two stages in a row give the single model's loss bit for bit."""
    x, y = batch(0)
    want = make_model(arch, "row")(x, y)[1]
    first, last = (P.PipelineStage(make_model(arch, "row"), SimpleNamespace(pp_rank=s, pp=2))
                   for s in range(2))
    assert list(first.blocks) == ["0"] and list(last.blocks) == ["1"]
    assert torch.equal(last(first(x), y, x.shape[1]), want)
