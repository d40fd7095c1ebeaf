"""Level O3 (ZeRO in FP8, nanofp8/zero.py) on 2 and 4 gloo ranks against single-process O2:
losses, bit-identical weights on every rank, per-rank bytes, NaN skips and sharded checkpoints."""

import copy
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from conftest import REPO, TINY, spawn, torchrun

from nanofp8 import optim_foreach
from nanofp8.dist import Fp8DataParallel, comm_stats
from nanofp8.zero import O3Linear, ZeroFp8AdamW, convert_to_o3
from nanofp8.fp8 import E4M3, Recipe, convert_to_fp8
from nanofp8.memory import training_state_bytes
from nanofp8.optim import Fp8AdamW, convert_to_o2, holds_fp8_grad

STEPS, BATCH, LR = 12, 64, 2e-3


def base_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 96), nn.GELU(), nn.Linear(96, 1))


def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS, BATCH, 32, generator=g)
    return x, x[..., :4].sum(-1, keepdim=True).sin()


def fp8_filter(fqn, m):
    return fqn != "4"  # the head stays high precision


def single_process_o2():
    model = convert_to_o2(convert_to_fp8(base_model(), Recipe(), module_filter=fp8_filter))
    opt = Fp8AdamW(model.parameters(), model, lr=LR, weight_decay=0.1)
    x, y = data()
    losses = []
    for i in range(STEPS):
        loss = nn.functional.mse_loss(model(x[i]), y[i])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def build_o3(world, group=None):
    model = convert_to_o3(convert_to_fp8(base_model(), Recipe(), module_filter=fp8_filter))
    others = [p for p in model.parameters() if not holds_fp8_grad(p)]  # (the O3 weights hold theirs)
    dp = Fp8DataParallel(model, group, params=others, overlap=False)
    opt = ZeroFp8AdamW(model.parameters(), model, group, lr=LR, weight_decay=0.1)
    return model, dp, opt


def o3_step(model, dp, opt, x, y, rank, world):
    n = x.shape[0] // world
    loss = nn.functional.mse_loss(model(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n])
    loss.backward()
    ok = opt.step(grads_finite=dp.sync_gradients())
    opt.zero_grad()
    t = loss.detach().clone()
    dist.all_reduce(t)
    return t.item() / world, ok


def worker(rank, world, outdir):  # run by conftest.spawn: the process group is up
    torch.manual_seed(100 + rank)  # ranks start different: the broadcast must fix that
    model, dp, opt = build_o3(world)
    x, y = data()
    losses, same = [], []
    comm_stats(reset=True)
    for i in range(STEPS):
        loss, ok = o3_step(model, dp, opt, x[i], y[i], rank, world)
        assert ok
        losses.append(loss)
        # every rank must hold bit-identical FP8 weights (and replicated params) after each step
        flat = torch.cat([t.detach().reshape(-1).view(torch.uint8) if t.dtype.itemsize == 1
                          else t.detach().float().reshape(-1).view(torch.uint8)
                          for t in model.state_dict().values()])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        same.append(all(torch.equal(gathered[0], t) for t in gathered))
    stats = comm_stats()
    # per-rank bytes, measured after a backward (gradients present)
    n = BATCH // world
    nn.functional.mse_loss(model(x[0][rank * n : (rank + 1) * n]), y[0][rank * n : (rank + 1) * n]).backward()
    acc = training_state_bytes(model, opt, is_block_linear=lambda fqn, m: isinstance(m, O3Linear))
    opt.zero_grad()
    # a NaN gradient on one rank only: every rank skips, nothing changes
    before = {k: v.clone() for k, v in model.state_dict().items()}
    xb = x[0].clone()
    if rank == world - 1:
        xb[:, 0] = float("nan")
    _, ok = o3_step(model, dp, opt, xb, y[0], rank, world)
    skipped = (not ok) and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    # sharded checkpoint: save, run 2 steps, reload into a fresh model/optimizer, run them again
    ckpt = {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict())}
    path = os.path.join(outdir, f"o3-rank{rank}.pt")
    torch.save(ckpt, path)
    cont = [o3_step(model, dp, opt, x[i], y[i], rank, world)[0] for i in (1, 2)]
    ckpt = torch.load(path, weights_only=True)
    model2, dp2, opt2 = build_o3(world)
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    # the resumed run updates each weight's shard in a run of its own (optim_foreach.step_chunks): the same bits
    chunk, optim_foreach.STEP_CHUNK = optim_foreach.STEP_CHUNK, 1
    resumed = [o3_step(model2, dp2, opt2, x[i], y[i], rank, world)[0] for i in (1, 2)]
    optim_foreach.STEP_CHUNK = chunk
    resumed_same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))
    if rank == 0:
        torch.save(dict(losses=losses, same=same, stats=stats, acc=acc, skipped=skipped,
                        cont=cont, resumed=resumed, resumed_same=resumed_same), os.path.join(outdir, f"result{world}.pt"))


@pytest.fixture(scope="module")
def reference():
    return single_process_o2()


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_o3_matches_single_process_o2(world, reference, tmp_path):
    spawn(worker, world, str(tmp_path))
    r = torch.load(tmp_path / f"result{world}.pt", weights_only=False)
    gaps = [abs(a - b) / b for a, b in zip(r["losses"], reference)]
    # Splitting the batch changes activation scales, and the gradients travel and are summed in
    # FP8/fp32 instead of being computed at once: small differences, no drift. Observed max gap
    # over 12 steps: 0.48% (2 ranks), 0.22% (4 ranks); final gap 0.03% / 0.09%. Block-Linear
    # state per rank after a backward: 5.533 B/param (2 ranks), 4.268 (4 ranks) = 3 + 5/N plus
    # the scales.
    print(f"O3 x{world}: max loss gap {max(gaps):.4f}, final {gaps[-1]:.4f}, "
          f"block-Linear bytes/param {r['acc']['linear']['per_param']:.4f}")
    assert max(gaps) < 0.02 and gaps[-1] < 0.01, gaps
    assert all(r["same"])  # bit-identical weights on every rank after every step
    lin = r["acc"]["linear"]
    # measured after a backward: 1 B FP8 weight + 2 B fp16 gradient sum (cast to FP8 when the step
    # reads it) + (2 + 1 + 2) / N sharded, + the sharded m and v's scales (4 B per 128 values
    # each: 2/32 / N) + the other scales and padding
    assert lin["per_param"] <= 3 + (5 + 2 / 32) / world + 0.01, lin
    assert r["skipped"]  # a NaN on one rank makes every rank skip, and nothing changes
    assert r["resumed"] == r["cont"] and r["resumed_same"]  # the sharded checkpoint resumes exactly
    by_op = r["stats"]["by_op"]
    assert "reduce_scatter_fp8" in by_op and "all_gather_fp8" in by_op


def one_update_worker(rank, world, outdir):
    """One O3 step with foreach=False under an update that records each call and returns zeros."""
    from nanofp8.dist import held_shard_len

    class Zeroing(ZeroFp8AdamW):
        def update(self, w, g, st, group, noise=None):
            calls.append((tuple(w.shape), noise is not None))
            return torch.zeros_like(super().update(w, g, st, group, noise))

    calls = []
    model = convert_to_o3(convert_to_fp8(base_model(), Recipe(), module_filter=fp8_filter))
    dp = Fp8DataParallel(model, params=[p for p in model.parameters() if not holds_fp8_grad(p)], overlap=False)
    opt = Zeroing(model.parameters(), model, lr=LR, weight_decay=0.1, foreach=False)
    x, y = data()
    assert o3_step(model, dp, opt, x[0], y[0], rank, world)[1]
    if rank == 0:
        torch.save(dict(calls=calls, shards=[held_shard_len(p, world) for p in opt.o2],
                        others=[tuple(p.shape) for p in model.parameters() if p not in opt.o2],
                        zero=all(not t.float().any() for t in model.state_dict().values() if t.dtype == E4M3.dtype)),
                   os.path.join(outdir, "calls.pt"))


@pytest.mark.dist
def test_o3_and_o2_run_one_update(tmp_path):
    """O2 and O3 step through one per-parameter update, Fp8AdamW.update (foreach=False; its
    foreach twin otherwise, held bit-equal by tests/test_optim.py): an update changed in that one
    place changes both. O3 runs it on each rank's shard of every O3 weight (with the rounding
    noise of the decoupled state) and on every replicated parameter (fp32 state), and gathers the
    weights it returns."""
    calls = []

    class Zeroing(Fp8AdamW):
        def update(self, w, g, st, group, noise=None):
            calls.append((tuple(w.shape), noise is not None))
            return torch.zeros_like(super().update(w, g, st, group, noise))

    model = convert_to_o2(convert_to_fp8(base_model(), Recipe(), module_filter=fp8_filter))
    opt = Zeroing(model.parameters(), model, lr=LR, foreach=False)
    x, y = data()
    nn.functional.mse_loss(model(x[0]), y[0]).backward()
    assert opt.step()
    assert sorted(calls) == sorted((tuple(p.shape), p in opt.o2) for p in model.parameters())
    assert all(not p.float().any() for p in model.parameters())
    spawn(one_update_worker, 2, str(tmp_path))
    r = torch.load(tmp_path / "calls.pt", weights_only=False)
    assert sorted(r["calls"]) == sorted([((c,), True) for c in r["shards"]] + [(s, False) for s in r["others"]])
    assert r["zero"]  # the gathered FP8 weights are what the update returned


def test_o3_refuses_state_of_another_world_size():
    opt = Fp8AdamW([nn.Parameter(torch.zeros(2))], nn.Linear(1, 1))
    sd = opt.state_dict()
    sd["zero"] = {"world_size": 4, "rank": 1}

    class Fake(ZeroFp8AdamW):
        def __init__(self):  # no process group needed to check the guard
            self.world, self.rank = 2, 1

    with pytest.raises(ValueError, match="resumes only at the world size it was saved with"):
        Fake().load_state_dict(sd)


def test_o3_refuses_the_fused_step():
    """fused=True is O2's compiled step; O3 refuses it in one line (before any process group)."""
    with pytest.raises(ValueError, match="^fused=True compiles O2's step; O3 steps its shards on the foreach path"):
        ZeroFp8AdamW([nn.Parameter(torch.zeros(2))], nn.Linear(1, 1), fused=True)


def o2_dp_worker(rank, world, outdir):
    from nanofp8.zero import sync_fp8_wgrads

    torch.manual_seed(100 + rank)
    model = convert_to_o2(convert_to_fp8(base_model(), Recipe(), module_filter=fp8_filter))
    o2 = [p for p in model.parameters() if holds_fp8_grad(p)]
    dp = Fp8DataParallel(model, params=[p for p in model.parameters() if not holds_fp8_grad(p)],
                         overlap=False)
    opt = Fp8AdamW(model.parameters(), model, lr=LR, weight_decay=0.1)
    x, y = data()
    n = BATCH // world
    losses, same = [], []
    for i in range(STEPS):
        loss = nn.functional.mse_loss(model(x[i][rank * n : (rank + 1) * n]), y[i][rank * n : (rank + 1) * n])
        loss.backward()
        ok = dp.sync_gradients()
        sync_fp8_wgrads(o2)
        assert opt.step() and ok
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
        flat = torch.cat([v.detach().float().reshape(-1) for v in model.state_dict().values()])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        same.append(all(torch.equal(gathered[0], g) for g in gathered))
    # a NaN on the last rank: the sync carries it everywhere and every rank skips
    xb = x[0][rank * n : (rank + 1) * n].clone()
    if rank == world - 1:
        xb[:, 1] = float("nan")
    nn.functional.mse_loss(model(xb), y[0][:n]).backward()
    dp.sync_gradients()
    sync_fp8_wgrads(o2)
    skipped = opt.step() is False
    if rank == 0:
        torch.save(dict(losses=losses, same=same, skipped=skipped), os.path.join(outdir, "o2dp.pt"))


@pytest.mark.slow
@pytest.mark.dist
def test_o2_data_parallel_matches_single_process(reference, tmp_path):
    spawn(o2_dp_worker, 2, str(tmp_path))
    r = torch.load(tmp_path / "o2dp.pt", weights_only=False)
    gaps = [abs(a - b) / b for a, b in zip(r["losses"], reference)]
    print(f"O2 data-parallel x2: max loss gap {max(gaps):.4f}")
    assert max(gaps) < 0.02 and gaps[-1] < 0.01, gaps
    assert all(r["same"]) and r["skipped"]


# ---------------------------------------------------------------- train.py's O3 checkpoint: no rank gathers

# Run under torchrun by the test below (one script, two modes). "save": train 2 iterations at O3
# and checkpoint; while save_unless_diverged runs, count the bytes that every collective hands
# this rank, and keep a copy of this rank's optimizer.state_dict() as it was when saved. "resume":
# continue the run, and note every file this rank reads with torch.load.
O3_SAVE_WORKER = """
import copy, json, os, pickle, sys
sys.path.insert(0, {repo!r})
import torch, torch.distributed as dist
import train

out, args, mode = {out!r}, {args!r}, {mode!r}
rank = int(os.environ["RANK"])
seen = dict(received=0, loaded=[])
saving = [False]


def size(x):
    if torch.is_tensor(x):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(size(v) for v in x)
    return len(pickle.dumps(x))


def counted(collective):  # every tensor or object it is given or fills, counted once it returns
    def wrapped(*a, **k):
        result = collective(*a, **k)
        if saving[0]:
            seen["received"] += sum(size(v) for v in (*a, *k.values()) if v is not None
                                    and not isinstance(v, (int, str, dist.ProcessGroup, dist.ReduceOp)))
        return result
    return wrapped


for name in ("all_gather", "all_gather_object", "all_gather_into_tensor", "all_reduce", "broadcast",
             "broadcast_object_list", "gather", "gather_object", "reduce_scatter_tensor", "all_to_all_single"):
    setattr(dist, name, counted(getattr(dist, name)))
save = train.save_unless_diverged


def saved(raw_model, optimizer, *a, **k):
    torch.save(copy.deepcopy(optimizer.state_dict()), os.path.join(out, f"{{mode}}-in-memory-rank{{rank}}.pt"))
    saving[0] = True
    try:
        return save(raw_model, optimizer, *a, **k)
    finally:
        saving[0] = False


train.save_unless_diverged = saved
load = torch.load


def loaded(f, *a, **k):
    if isinstance(f, str):
        seen["loaded"].append(os.path.basename(f))
    return load(f, *a, **k)


torch.load = loaded
train.main(args)
json.dump(seen, open(os.path.join(out, f"{{mode}}-rank{{rank}}.json"), "w"))
"""


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.usefixtures("shakespeare")
def test_o3_checkpoint_is_saved_without_gathering(tmp_path):
    """train.py at O3 on 2 ranks: each rank writes its own optimizer shard into the checkpoint set,
    and no rank receives another's. While the checkpoint is saved, the collectives hand a rank fewer
    bytes than its own shard (the flags and RNG streams a save agrees on: an all-gather of the shards
    would be twice a shard); rank r's file holds exactly its optimizer.state_dict() at that moment;
    the model file names the shard files and holds no optimizer tensor; the manifest lists every
    file with its size and sha256. An exact resume reads the model file and its own shard, nothing
    else."""
    from nanofp8.checkpoint import find_checkpoint
    from nanofp8.ckptfile import load_checkpoint

    out = tmp_path / "run"
    args = TINY + ["precision=O3", "gradient_accumulation_steps=2", "eval_interval=2", "lr_decay_iters=4",
                   f"out_dir={out}"]
    for mode, more in (("save", ["max_iters=2"]), ("resume", ["max_iters=3", "init_from=resume"])):
        script = tmp_path / f"{mode}.py"
        script.write_text(O3_SAVE_WORKER.format(repo=REPO, out=str(tmp_path), mode=mode, args=args + more))
        torchrun(2, script=str(script), timeout=300)
    found, _ = find_checkpoint(str(out / "ckpt-00000002"))
    for r in range(2):
        seen = json.loads((tmp_path / f"save-rank{r}.json").read_text())
        mine = torch.load(tmp_path / f"save-in-memory-rank{r}.pt", weights_only=True)
        own = sum(t.numel() * t.element_size() for t in _tensors(mine).values())
        print(f"rank {r}: a save's collectives handed it {seen['received']:,} B; its own shard is {own:,} B")
        assert seen["received"] < own, (r, seen["received"], own)
        name = f"optimizer-rank{r}.pt"
        shard = load_checkpoint(found.file(name), expect=found.expected(name), keys=("optimizer", "iter_num"))
        assert shard["iter_num"] == 2 and shard["optimizer"]["zero"] == {"world_size": 2, "rank": r}
        got, want = _tensors(shard["optimizer"]), _tensors(mine)
        assert got.keys() == want.keys() and all(_bits(got[k]) == _bits(want[k]) for k in want)
        assert shard["optimizer"]["param_groups"] == mine["param_groups"]
        resumed = json.loads((tmp_path / f"resume-rank{r}.json").read_text())
        assert sorted(resumed["loaded"]) == ["ckpt.pt", name], resumed
    assert found.files == ["ckpt.pt", "optimizer-rank0.pt", "optimizer-rank1.pt"]
    model_file = load_checkpoint(found.file("ckpt.pt"), expect=found.expected("ckpt.pt"))
    assert model_file["optimizer"] == {"zero_shard_files": ["optimizer-rank0.pt", "optimizer-rank1.pt"]}


def _tensors(obj, path=""):
    """{path: tensor} of every tensor in a nested dict/list."""
    if torch.is_tensor(obj):
        return {path: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    return {k: t for key, v in items for k, t in _tensors(v, f"{path}/{key}").items()}


def _bits(t):
    return (t.dtype, t.shape, t.detach().contiguous().reshape(-1).view(torch.uint8).tolist())
