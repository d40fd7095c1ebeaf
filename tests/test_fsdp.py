"""Tests of nanofp8/fsdp.py: FSDP2 all-gathers the FP8 layers' weights in FP8, with one scale
(or grid of scales) all ranks agree on, and trains bit-exactly as one process does.

One spawn of 2 gloo ranks runs every distributed case and saves what it saw; this process,
which can rebuild every model and batch, runs the same FP8 math unsharded and judges.

Why bit-exact is the bar: every rank is fed the same batch, so the reduce-scattered gradient
is (g + g) / 2 = g exactly; the amax of the whole weight is the max of the pieces' amaxes
(a max rounds nothing); the cast is elementwise, so each rank's bytes are the bytes the one
process casts for those rows. clip_grad_norm_ sums the squares in another order under FSDP2,
so its norm is compared to 1e-6 relative, and the encoder and MLP runs set max_norm above it (a
clip coefficient of exactly 1); the GPT's run does clip, at norms both orders round alike.
The ranks run on one intra-op thread (conftest.spawn), and so does the reference here: the
order of a CPU reduction (LayerNorm's backward, for one) depends on the thread count."""

import os
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from conftest import spawn
from nanofp8 import fsdp as F8
from nanofp8.counter import comm_stats
from nanofp8.fp8 import Fp8Linear, Recipe, convert_to_fp8, dequantize, sqnr
from nanofp8.optim import O2Linear

STEPS, LR, CLIP = 4, 1e-2, 1e9
RECIPES = {"tensor": Recipe(backend="cpu"), "row": Recipe.from_name("rowwise", backend="cpu"),
           "block": Recipe.from_name("blockwise", backend="cpu")}
EVERY_RECIPE = {**RECIPES, "mxfp8": Recipe.from_name("mxfp8", backend="cpu")}  # (MX keeps fp32 gathers)


def encoder(seed=0):
    """Not the project's GPT: two torch TransformerEncoder layers and a 10-way head."""
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(32, 2, dim_feedforward=64, dropout=0.0, batch_first=True)
    return nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), nn.Linear(32, 10))


def ffn_only(fqn, linear):
    """MultiheadAttention's out_proj is read raw by F.multi_head_attention_forward: never FP8.
    (convert_to_fp8 swaps only exact nn.Linear, which out_proj's class is not; said anyway.)"""
    return "out_proj" not in fqn


def mlp(seed=0):
    """An MLP whose first weight has rank 0's rows 1e3 times rank 1's (a scale of each rank's
    own would differ 1000x), and whose last layer has 17 rows: FSDP2 pads a piece (9 + 8 rows)."""
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 17))
    with torch.no_grad():
        m[0].weight[:32] *= 1e3
    return m


def batches(d_in, d_out, seq=None, n=STEPS):
    g = torch.Generator().manual_seed(7)
    shape = (4, seq, d_in) if seq else (8, d_in)
    return [(torch.randn(*shape, generator=g), torch.randn(*shape[:-1], d_out, generator=g)) for _ in range(n)]


def train(model, opt, data):
    """Plain training steps: (losses, clip norms)."""
    losses, norms = [], []
    for x, y in data:
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        norms.append(float(norm.full_tensor() if isinstance(norm, DTensor) else norm))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms


def full_state(model):
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone()
            for k, v in model.state_dict().items()}


# -- what every rank runs ------------------------------------------------------------


def shard(model, mesh, units):
    from torch.distributed.fsdp import fully_shard

    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def record_all_gathers(model, seen):
    """Put a test-only all-gather on every FSDP2 unit that records the dtype and size it sends."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    class Recorder(AllGather):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            seen.append((str(input_tensor.dtype), input_tensor.numel()))
            return gather(output_tensor, input_tensor, group=group, async_op=async_op)

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_custom_all_gather(Recorder())


def run_encoder(mesh):
    model = F8.convert(encoder(), RECIPES["tensor"], lambda module, fqn: ffn_only(fqn, module))
    for m in model.modules():
        m.cache_weight = True  # (train.py's O1 setting: it must not serve a stale cast)
    shard(model, mesh, model[0].layers)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)  # (the default on GPUs)
    losses, norms = train(model, opt, batches(32, 10, seq=6))
    return {"losses": losses, "norms": norms, "state": full_state(model),
            "types": {n: type(m).__name__ for n, m in model.named_modules()}}


def run_mlp(mesh, recipe, fp8_gather=True, agreed=False):
    model = convert_to_fp8(mlp(), recipe)
    if fp8_gather:
        F8.fp8_all_gather(model)
    shard(model, mesh, [model[0], model[2], model[4]])
    seen, operands = [], {}
    record_all_gathers(model, seen)

    def first_operands(m, args):  # the first forward's gathered weight (FSDP2 unshards before)
        if isinstance(m.weight, F8.GatheredFp8Weight) and m.fqn not in operands:
            operands[m.fqn] = [(q.data.clone(), q.scale.clone()) for q in F8.gathered_operands(m.weight)]

    for i in (0, 2, 4):
        model[i].register_forward_pre_hook(first_operands)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    comm_stats(reset=True)
    if agreed:
        F8.agree_after_steps(opt, model)
    losses, _ = train(model, opt, batches(32, 17, n=1))
    return {"losses": losses, "state": full_state(model), "seen": seen, "operands": operands,
            "comm": comm_stats()["by_op"], "left": getattr(model, "fp8_all_gather_left", None)}


def run_dcp(mesh, ckpt):
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def fresh():
        model = shard(F8.convert(mlp(), RECIPES["tensor"]), mesh, [])
        return model, torch.optim.AdamW(model.parameters(), lr=LR)

    data = batches(32, 17, n=4)
    model, opt = fresh()
    train(model, opt, data[:2])
    msd, osd = get_state_dict(model, opt)
    plain = all(type(v._local_tensor) is torch.Tensor for v in msd.values()
                if isinstance(v, DTensor))
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    F8.agree_amaxes(model)
    model.load_state_dict(model.state_dict())  # a plain round trip changes nothing
    forgot = [m.agreed_amaxes is None for m in model.modules() if isinstance(m, F8.Fp8AllGatherLinear)]
    ahead = train(model, opt, data[2:])[0], full_state(model)
    model2, opt2 = fresh()
    msd2, osd2 = get_state_dict(model2, opt2)
    dcp.load({"model": msd2, "optim": osd2}, checkpoint_id=ckpt)
    set_state_dict(model2, opt2, model_state_dict=msd2, optim_state_dict=osd2)
    resumed = train(model2, opt2, data[2:])[0], full_state(model2)
    return {"plain": plain, "ahead": ahead, "resumed": resumed, "forgot": forgot}


def gpt(fp8_lm_head=False):
    from nanofp8.model import GPT, GPTConfig, apply_fp8

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=16, vocab_size=96))
    apply_fp8(model, RECIPES["tensor"], fp8_lm_head=fp8_lm_head)
    return model


def train_gpt(model, opt):
    """The project's GPT as train.py runs it: bf16 autocast, clipping at 1.0 (it clips here)."""
    g, losses = torch.Generator().manual_seed(3), []
    for _ in range(2):
        x, y = torch.randint(0, 96, (4, 16), generator=g), torch.randint(0, 96, (4, 16), generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def run_gpt(mesh, compiled=None, agreed=False, fp8_lm_head=False):
    """compiled: None (eager), "block" (each block compiled in place before fully_shard, as
    torchtitan does) or "model" (the sharded model, as train.py does), with aot_eager: dynamo and
    AOTAutograd, where the FP8 weights once lost their gradients. agreed: the amaxes agreed once
    per step, after it (agree_after_steps), not in every all-gather."""
    model = F8.fp8_all_gather(gpt(fp8_lm_head))  # as engine=torch uses it: after model.apply_fp8
    if compiled == "block":
        for block in model.blocks:
            block.compile(backend="aot_eager")
    shard(model, mesh, model.blocks)
    run = torch.compile(model, backend="aot_eager") if compiled == "model" else model
    comm_stats(reset=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if agreed:
        F8.agree_after_steps(opt, model)
    return {"losses": train_gpt(run, opt), "left": model.fp8_all_gather_left, "comm": comm_stats()["by_op"],
            "state": full_state(model)}


def run_other_layouts(mesh):
    """FSDP2 sharding weights along dim 1 (refused, one line on every rank), and bf16 mixed
    precision (the gathered weight reports bf16; its FP8 bytes are cast from the fp32 piece)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard

    model = F8.fp8_all_gather(convert_to_fp8(mlp(), RECIPES["tensor"]))
    fully_shard(model, mesh=mesh, shard_placement_fn=lambda p: Shard(p.dim() - 1))
    try:
        model(torch.randn(8, 32))
        refused = None
    except ValueError as e:
        refused = str(e)
    model = F8.fp8_all_gather(convert_to_fp8(mlp(), RECIPES["tensor"]))
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    seen = {}

    def first(m, args):
        ops = F8.gathered_operands(m.weight)
        seen.setdefault("w", (m.weight.dtype, [(q.data.clone(), q.scale.clone()) for q in ops]))

    model[0].register_forward_pre_hook(first)
    model(torch.randn(8, 32))
    return {"refused": refused, "bf16": seen["w"]}


def worker(rank, world, outdir):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    out = {"encoder": run_encoder(mesh), "dcp": run_dcp(mesh, os.path.join(outdir, "ckpt")),
           "gpt": run_gpt(mesh), "gpt_block": run_gpt(mesh, "block"), "gpt_model": run_gpt(mesh, "model"),
           "gpt_agreed": run_gpt(mesh, agreed=True), "gpt_agreed_compiled": run_gpt(mesh, "model", agreed=True),
           "gpt_fp8_head": run_gpt(mesh, fp8_lm_head=True),
           "layouts": run_other_layouts(mesh)}
    for name, recipe in EVERY_RECIPE.items():
        out[name] = run_mlp(mesh, recipe)
    for name, recipe in RECIPES.items():
        out[name + "_agreed"] = run_mlp(mesh, recipe, agreed=True)
    out["fp32"] = run_mlp(mesh, RECIPES["tensor"], fp8_gather=False)
    late = shard(convert_to_fp8(mlp(), RECIPES["tensor"]), mesh, [])  # sharded first, then asked
    out["late"] = F8.fp8_all_gather(late).fp8_all_gather_left
    torch.save(out, os.path.join(outdir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    outdir = str(tmp_path_factory.mktemp("fsdp"))
    spawn(worker, 2, outdir)
    return [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False) for r in range(2)]


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def assert_same_state(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# -- judging -------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.dist
def test_encoder_trains_as_one_process(ranks):
    """convert() on a torch TransformerEncoder (FFN Linears in FP8, out_proj and the 10-way head
    left alone), fully_shard per layer then the model, AdamW (foreach) and clip_grad_norm_:
    the losses and final weights of the one-process FP8 run, bit for bit, on both ranks."""
    ref = convert_to_fp8(encoder(), RECIPES["tensor"], lambda f, l: ffn_only(f, l) and F8.multiple_of_16(f, l))
    for m in ref.modules():
        m.cache_weight = True
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, foreach=True)
    losses, ref_norms = train(ref, opt, batches(32, 10, seq=6))
    norms = []
    for r in ranks:
        got = r["encoder"]
        assert got["types"]["0.layers.0.linear1"] == "Fp8AllGatherLinear"
        assert got["types"]["0.layers.0.self_attn.out_proj"] == "NonDynamicallyQuantizableLinear"
        assert got["types"]["1"] == "Linear"  # 10 outputs: not a multiple of 16
        assert got["losses"] == losses
        assert_same_state(got["state"], ref.state_dict())
        norms.append(got["norms"])
    assert norms[0] == norms[1] and all(0 < n < CLIP for n in norms[0])
    assert all(abs(a - b) <= 1e-6 * b for a, b in zip(norms[0], ref_norms))


@pytest.mark.slow
@pytest.mark.dist
def test_the_projects_gpt_trains_as_one_process(ranks):
    """apply_fp8 then fp8_all_gather, fully_shard per block then the model: the one-process
    losses, bit for bit (clip_grad_norm_ clips here: the norm is about 2.2); every
    block Linear travels in FP8 (2 blocks x 4 Linears, forward and backward all-gathers)."""
    ref = gpt()
    losses = train_gpt(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3))
    for r in ranks:
        assert r["gpt"]["losses"] == losses and r["gpt"]["left"] == {}
        assert r["gpt"]["comm"]["fsdp_all_gather_fp8"]["calls"] == 2 * 2 * 4 * 2


@pytest.mark.slow
@pytest.mark.dist
def test_a_tied_fp8_lm_head_stays_tied(ranks):
    """The GPT's LM head in FP8 shares its weight with the token embedding (tied): a weight of its
    own for the FP8 all-gather would untie the two, and the embedding's and the head's gradients
    would train two matrices (the second step's loss was 4.6036, one process's 4.6053). The head
    keeps the fp32 all-gather, and says why; the one-process losses, bit for bit."""
    ref = gpt(fp8_lm_head=True)
    losses = train_gpt(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3))
    for r in ranks:
        assert r["gpt_fp8_head"]["losses"] == losses
        assert list(r["gpt_fp8_head"]["left"]) == ["lm_head"] and "tok_emb's (tied)" in r["gpt_fp8_head"]["left"]["lm_head"]


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("compiled", ["block", "model"])
def test_compiled_it_trains_as_eager(ranks, compiled):
    """torch.compile per block (before fully_shard) or of the whole sharded model: the losses and
    weights of the eager run, bit for bit, on both ranks, and so those of one process. Compiled,
    the FP8 weights once got no gradient at all (the gathered weight was no input of the graph:
    GatheredFp8Weight's docstring); their loss after the first step was then another."""
    ref = gpt()
    losses = train_gpt(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3))
    for r in ranks:
        got = r[f"gpt_{compiled}"]
        assert got["losses"] == r["gpt"]["losses"] == losses
        assert_same_state(got["state"], r["gpt"]["state"])
        assert got["comm"]["fsdp_all_gather_fp8"]["calls"] == r["gpt"]["comm"]["fsdp_all_gather_fp8"]["calls"]


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("run", ["gpt_agreed", "gpt_agreed_compiled"])
def test_one_amax_all_reduce_per_step(ranks, run):
    """agree_after_steps: the amaxes of all 8 FP8 weights agreed by one all-reduce after each
    optimizer step (and one before the first), where each all-gather agreed its own (2 blocks x 4
    Linears x forward and backward x 2 steps = 32): the same losses and weights, bit for bit
    (eager and compiled), and the same FP8 payload."""
    for r in ranks:
        got, each = r[run], r["gpt"]
        assert each["comm"]["fsdp_amax_all_reduce"]["calls"] == 2 * 4 * 2 * 2
        assert got["comm"]["fsdp_amax_all_reduce"]["calls"] == 1 + 2  # (before the first step, after each)
        assert got["comm"]["fsdp_amax_all_reduce"]["bytes_in"] == 3 * 8 * 4  # one fp32 amax per weight
        assert got["comm"]["fsdp_all_gather_fp8"] == each["comm"]["fsdp_all_gather_fp8"]
        assert got["losses"] == each["losses"]
        assert_same_state(got["state"], each["state"])


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("name", list(RECIPES))
def test_amaxes_agreed_after_the_step_are_those_of_the_all_gather(ranks, name):
    """Each recipe (tensor, row: two grids, block: tiles across the ranks' rows), amaxes agreed by
    agree_after_steps: the gathered bytes and scales, losses and weights of the all-gathers that
    agree their own, bit for bit; one all-reduce for the 3 weights (before the step, and after)."""
    for r in ranks:
        got, each = r[name + "_agreed"], r[name]
        assert got["comm"]["fsdp_amax_all_reduce"]["calls"] == 2
        assert got["losses"] == each["losses"]
        assert_same_state(got["state"], each["state"])
        for fqn, ops in each["operands"].items():
            for (d0, s0), (d1, s1) in zip(ops, got["operands"][fqn], strict=True):
                assert torch.equal(d0.view(torch.uint8), d1.view(torch.uint8)) and torch.equal(s0, s1), fqn


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("name", list(RECIPES))
def test_weights_travel_in_fp8_with_one_agreed_scale(ranks, name):
    """Each recipe: the gathered FP8 weight of the first forward is, on both ranks, the very
    bytes and scales of quantizing the whole weight in one process (rank 0's rows 1e3 times rank
    1's: a scale of each rank's own would differ); the training step matches one process."""
    assert_as_one_process([r[name] for r in ranks], RECIPES[name])


def assert_as_one_process(got, recipe, gathered=True):
    """Every rank's run_mlp results (got) against the one-process FP8 MLP: the gathered bytes and
    scales of each weight (gathered), the losses, the weights after the step."""
    ref = convert_to_fp8(mlp(), recipe)
    for i in (0, 2, 4) if gathered else ():
        ops = ref[i].cast_weight()
        for r in got:
            for (data, scale), q in zip(r["operands"][str(i)], ops, strict=True):
                assert torch.equal(scale, q.scale), (i, "scale")
                assert torch.equal(data.view(torch.uint8), q.data.contiguous().view(torch.uint8)), (i, "bytes")
    losses, _ = train(ref, torch.optim.AdamW(ref.parameters(), lr=LR), batches(32, 17, n=1))
    for r in got:
        assert r["losses"] == losses
        if len(got) % 3:
            assert_same_state(r["state"], ref.state_dict())
        else:  # the mean of 3 equal gradients is not theirs to the bit, (g + g + g) / 3 rounds:
            for k, v in ref.state_dict().items():  # within 100 dB (observed >= 154 dB)
                assert sqnr(v, r["state"][k]) > 100, k


def recipes_worker(rank, world, outdir):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    out = {name: run_mlp(mesh, recipe) for name, recipe in EVERY_RECIPE.items()}
    torch.save(out, os.path.join(outdir, f"rank{rank}.pt"))


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_recipe_on_one_to_three_ranks(tmp_path, world, request):
    """As above at 1 and 3 ranks, and for MXFP8 (its 2 ranks here too). On one rank FSDP2
    copies only the first tensor a weight sends: row scaling's two copies (W along K, W along N
    for W^T) crashed there with an IndexError before they travelled as one. 3 ranks: the 17-row
    weight is cut 6 + 6 + 5, the 64-row one puts rank 0's large rows on ranks 0 and 1. MXFP8's
    1x32 tiles do not transpose (W^T needs 1x32 tiles along N): its weights keep the fp32
    all-gather, with the reason, and train as one process does; before, they travelled in FP8
    and the dgrad took W^T with 32x1 tiles (its scales were not those of the one-process cast)."""
    if world == 2:  # (the module's 2-rank run has them all)
        got = request.getfixturevalue("ranks")
    else:
        spawn(recipes_worker, world, str(tmp_path))
        got = [torch.load(os.path.join(tmp_path, f"rank{r}.pt"), weights_only=False) for r in range(world)]
    for name, recipe in EVERY_RECIPE.items():
        fp8 = name != "mxfp8"
        assert all(("fsdp_all_gather_fp8" in r[name]["comm"]) == fp8 for r in got), name  # (in FP8)
        assert all(bool(r[name]["left"]) != fp8 for r in got), name
        assert_as_one_process([r[name] for r in got], recipe, gathered=fp8)


@pytest.mark.slow
@pytest.mark.dist
def test_the_bytes_on_the_wire(ranks):
    """What FSDP2 hands its all-gather, per unit: FP8 weights at 1 byte a value (2 for row
    scaling's two copies) beside the fp32 biases, against 4 bytes with the fp32 all-gather; and
    COMM counts the FP8 payload and the 4-byte amax all-reduces."""
    sizes = [(64, 32), (256, 64), (17, 256)]  # weights (N, K); piece: ceil(N / 2) rows
    pieces = [-(-n // 2) * k for n, k in sizes]
    biases = [-(-n // 2) for n, _ in sizes]
    for r in ranks:
        # one all-gather per unit in forward, and again in backward (the root unit excepted)
        fp32 = [n for _, n in r["fp32"]["seen"]]
        assert {d for d, _ in r["fp32"]["seen"]} == {"torch.float32"}
        assert sorted(set(fp32)) == sorted({p + b for p, b in zip(pieces, biases)})
        for name, copies in (("tensor", 1), ("block", 1), ("row", 2)):
            seen = r[name]["seen"]
            assert {d for d, _ in seen} == {"torch.uint8"}  # FP8 bytes beside fp32 biases
            assert sorted({n for _, n in seen}) == sorted({copies * p + 4 * b for p, b in zip(pieces, biases)})
            assert len(seen) == len(fp32)
            comm = r[name]["comm"]
            assert comm["fsdp_all_gather_fp8"]["bytes_in"] == copies * sum(pieces) * 2  # forward + backward
            assert comm["fsdp_amax_all_reduce"]["calls"] == 3 * 2


@pytest.mark.slow
@pytest.mark.dist
def test_dcp_resume_is_exact(ranks):
    """get_state_dict + dcp.save after 2 steps, dcp.load + set_state_dict into a fresh sharded
    model: the next 2 steps are bit-identical. The state dict holds plain fp32 tensors (no
    subclass is ever saved), and model.load_state_dict(model.state_dict()) changes nothing but
    the amaxes agree_amaxes kept on the layers, which it forgets."""
    for r in ranks:
        got = r["dcp"]
        assert got["plain"]
        assert got["forgot"] and all(got["forgot"])  # a load forgets the amaxes agree_amaxes agreed
        assert got["ahead"][0] == got["resumed"][0]
        assert_same_state(got["ahead"][1], got["resumed"][1])


def test_convert_calls_the_filter_as_torchao_does():
    """convert's module_filter_fn is torchao's: (module, fqn), returning a bool. A filter written
    for (fqn, module), of another arity, or returning something else is an error naming the
    convention; before, convert called it as (fqn, module), so a torchao filter converted every
    Linear or none without a word."""
    def model():
        return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 32)))

    def fp8_layers(m):
        return sorted(n for n, c in m.named_modules() if isinstance(c, Fp8Linear))

    kept = F8.convert(model(), module_filter_fn=lambda module, fqn: fqn.startswith("2.") and module.out_features == 64)
    assert fp8_layers(kept) == ["2.0"]
    assert fp8_layers(F8.convert(model())) == ["0", "2.0", "2.1"]
    for wrong, says in [(lambda fqn, module: fqn.startswith("2."), "module first"),  # (fqn, module)
                        (lambda fqn, module: module.out_features == 64, "module first"),
                        (lambda module, fqn: fqn, "must return True or False"),
                        (lambda module: True, "two arguments, (module, fqn)"),
                        (lambda module, fqn, extra: True, "two arguments, (module, fqn)")]:
        with pytest.raises(TypeError, match=re.escape(says)):
            F8.convert(model(), module_filter_fn=wrong)


@pytest.mark.slow
@pytest.mark.dist
def test_a_sharded_weight_is_left_with_a_reason(ranks):
    left = ranks[0]["late"]
    assert set(left) == {"0", "2", "4"} and "before fully_shard" in left["0"]


@pytest.mark.slow
@pytest.mark.dist
def test_other_layouts(ranks):
    """A weight sharded along dim 1 is refused with one line naming the fix, on both ranks; under
    bf16 mixed precision the gathered weight is bf16 to its users, and its FP8 bytes and scale
    are the cast of the fp32 weight (not of a bf16 rounding of it)."""
    ref = convert_to_fp8(mlp(), RECIPES["tensor"])[0].cast_weight()
    for r in ranks:
        got = r["layouts"]
        assert "shard weights along dim 0" in got["refused"] and "shard_placement_fn" in got["refused"]
        dtype, operands = got["bf16"]
        assert dtype == torch.bfloat16
        for (data, scale), q in zip(operands, ref):
            assert torch.equal(scale, q.scale)
            assert torch.equal(data.view(torch.uint8), q.data.contiguous().view(torch.uint8))


def test_what_is_left_at_fp32_and_why():
    """Delayed scaling and O2 layers keep the fp32 all-gather, named with the reason; the rest
    go FP8. Layers dims not multiples of 16 are not converted at all."""
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 10))
    convert_to_fp8(model, Recipe(), lambda fqn, lin: fqn == "0")
    model[1] = Fp8Linear.from_linear(model[1], Recipe.from_name("delayed"), "1")
    model[2] = O2Linear.from_linear(model[2], Recipe(), "2")
    F8.fp8_all_gather(model)
    assert type(model[0]) is F8.Fp8AllGatherLinear and isinstance(model[0].weight, F8.Fp8AllGatherWeight)
    assert set(model.fp8_all_gather_left) == {"1", "2"}
    assert "delayed" in model.fp8_all_gather_left["1"] and "O2" in model.fp8_all_gather_left["2"]
    assert type(model[1].weight) is nn.Parameter
    converted = F8.convert(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 10)))
    assert type(converted[0]) is F8.Fp8AllGatherLinear and type(converted[1]) is nn.Linear
    assert type(F8.convert(nn.Linear(32, 32))) is F8.Fp8AllGatherLinear  # a bare Linear, returned
    bare = F8.convert(nn.Linear(32, 32), Recipe.from_name("delayed"))
    assert type(bare) is Fp8Linear and "delayed" in bare.fp8_all_gather_left["linear"]


@pytest.mark.parametrize("name", list(RECIPES))
def test_the_gathered_weight_reads_as_its_fp8_values(name):
    """A GatheredFp8Weight used by anything but its layer (FSDP2's zeros_like for a parameter
    without a gradient, a print) is the dequantized FP8 weight, of the parameter's dtype."""
    recipe, w = RECIPES[name], torch.randn(48, 256)
    layer = F8.Fp8AllGatherLinear(256, 48, recipe=recipe)
    with torch.no_grad():
        layer.weight.copy_(w)
    (qw, _) = layer.cast_weight()
    u8 = qw.data.view(torch.uint8)
    t = {"wt_u8": u8, "scale_t": qw.scale, "amax_t": qw.amax} if name == "row" else {}
    gathered = F8.GatheredFp8Weight(recipe, w.shape, torch.float32, u8, qw.scale, qw.amax, **t)
    assert torch.equal(gathered + 0, dequantize(qw))
    assert torch.equal(torch.zeros_like(gathered), torch.zeros(48, 256))


@pytest.mark.parametrize("name", list(RECIPES))
def test_the_gathered_weight_compiles_into_one_graph_with_its_gradient(name):
    """A layer whose weight is a GatheredFp8Weight (what FSDP2 puts there before its forward),
    under torch.compile: one graph, no break (the GEMMs read the weight's bytes in the graph),
    and the output and the weight's gradient of eager mode, bit for bit (a plain subclass was no
    input of the graph, and its gradient was dropped)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    recipe, x = RECIPES[name], torch.randn(8, 256)
    torch._dynamo.reset()
    layers = []
    for _ in range(2):
        torch.manual_seed(0)
        layer = F8.fp8_all_gather(convert_to_fp8(nn.Linear(256, 48), recipe))
        qw, qwt = Fp8Linear.cast_weight(layer)
        u8 = qw.data.view(torch.uint8)
        t = {"wt_u8": qwt.data.t().contiguous().view(torch.uint8), "scale_t": qwt.scale,
             "amax_t": qwt.amax} if name == "row" else {}
        layer.weight = nn.Parameter(F8.GatheredFp8Weight(recipe, (48, 256), torch.float32, u8, qw.scale, qw.amax, **t))
        layers.append(layer)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layers[1], backend=counter)
    ys = [layers[0](x), compiled(x)]
    for y in ys:
        y.square().sum().backward()
    assert counter.frame_count == 1
    assert torch.equal(ys[0], ys[1])
    assert layers[1].weight.grad is not None and torch.equal(layers[0].weight.grad, layers[1].weight.grad)
    # A later all-gather refills the bytes and hands over new scales (fsdp_post_all_gather's
    # `out`): the graph reads them, without tracing again
    for layer in layers:
        w = layer.weight
        w.w_u8.copy_(torch.flip(w.w_u8, [1]))
        w.set_scales([2 * w.scale] + ([2 * w.scale_t] if name == "row" else []),
                     [w.amax / 2] + ([w.amax_t / 2] if name == "row" else []))
    assert torch.equal(compiled(x), layers[0](x)) and counter.frame_count == 1
    assert not torch.equal(compiled(x), ys[0])


def test_unsharded_it_is_the_fp8_linear():
    """Before fully_shard (or in one process), an Fp8AllGatherLinear casts its own weight:
    forward, gradients and state_dict of the Fp8Linear it replaced, bit for bit."""
    x = torch.randn(4, 32)
    outs = []
    for gather in (False, True):
        torch.manual_seed(0)
        m = convert_to_fp8(nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 16)), Recipe())
        if gather:
            F8.fp8_all_gather(m)
        y = m(x)
        y.square().sum().backward()
        sd = m.state_dict()
        assert all(type(v) is torch.Tensor for v in sd.values())
        outs.append((y, [p.grad for p in m.parameters()], sd))
    assert torch.equal(outs[0][0], outs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(outs[0][1], outs[1][1]))
    assert_same_state(outs[0][2], outs[1][2])
