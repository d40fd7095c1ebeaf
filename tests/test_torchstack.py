"""engine=torch (nanofp8/torchstack.py): the GPT and its FP8 layers on FSDP2, DTensor tensor
parallelism and DCP checkpoints, on CPU (gloo), checked against the hand-written engine.

What is checked:
  * DTensor TP + SP at O1 trains to the very weights of the hand-written engine's TP + SP (bit
    for bit after 8 steps: the same GEMMs and FP8 collectives on the local shards), and the
    fused q/k/v bias is not weight-decayed although engine=torch holds it as a matrix; so does
    it with grouped-query attention (q/k/v held grouped by key/value head, read back as rows);
  * FSDP2 at O1 logs the losses of the hand-written engine's data parallelism (grad_comm=fp32)
    and ends within 60 dB of its weights (the gradient mean rounds in another order);
  * DCP: stopping and resuming FSDP2 x TP + SP (4 ranks) reproduces the run that never stopped,
    bit for bit; the same checkpoint resumes exactly at another data-parallel size (no
    conversion), and at another tensor_parallel through the conversion, which says so and carries
    the Adam moments (DCP holds them whole); DCP
    re-cuts the shards of weights and Adam moments for 1 and 3 ranks (uneven shards), bit for bit;
    both with grouped-query attention (4 query heads, 2 key/value heads);
  * FSDP2 with delayed scaling resumes exactly too: ckpt.pt holds each rank's amax histories;
  * sample.py and export.py read a DCP set in one process;
  * a checkpoint of either engine resumed by the other, at 1 and 2 ranks, holds the source's Adam
    moments bit for bit (FSDP2: its DTensor shard of each);
  * what engine=torch does not run is refused in one line naming the key.
"""

import os
import shutil

import pytest
import torch

import conftest
import export
import train
from conftest import logged_losses, spawn
from nanofp8 import torchstack
from nanofp8.checkpoint import find_checkpoint, read_any
from nanofp8.ckptfile import load_checkpoint
from nanofp8.configurator import ConfigError
from nanofp8.fp8 import Recipe, sqnr
from nanofp8.interop import load_portable
from nanofp8.model import GPT, GPTConfig, apply_fp8

pytestmark = pytest.mark.usefixtures("shakespeare")

TINY = conftest.TINY + ["gradient_accumulation_steps=2", "max_iters=8", "lr_decay_iters=8", "eval_interval=4"]
TP2, SP, O1, TORCH = "tensor_parallel=2", "sequence_parallel=True", "precision=O1", "engine=torch"
GQA = ("n_head=4", "n_kv_head=2")  # grouped-query attention: 2 query heads per key/value head


def torchrun(nproc, *args):
    return conftest.torchrun(nproc, *TINY, *args)


def weights(out_dir):
    return read_any(str(out_dir))[0]


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("model", [(), GQA], ids=["mha", "gqa"])
def test_dtensor_tp_is_the_hand_written_tp_bit_for_bit(tmp_path, model):
    """Both engines run parallel.py's TPLinear GEMMs and FP8 collectives on the same shards; the
    optimizer and the clipping see DTensors on one side, plain shards on the other, with the same
    arithmetic. A fused bias held as (3, n_embd) once got weight decay (matrices do): 20 dB apart.
    With grouped-query attention the q/k/v weight and bias are held grouped by key/value head."""
    ours = torchrun(2, O1, TP2, SP, TORCH, *model, f"out_dir={tmp_path / 'torch'}")
    ref = torchrun(2, O1, TP2, SP, *model, f"out_dir={tmp_path / 'ref'}")
    assert logged_losses(ours.stdout) == logged_losses(ref.stdout) and len(logged_losses(ref.stdout)) == 8
    a, b = weights(tmp_path / "torch"), weights(tmp_path / "ref")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.slow
@pytest.mark.dist
def test_fsdp2_trains_as_the_hand_written_data_parallelism(tmp_path):
    """FSDP2 (2 ranks, O1) against Fp8DataParallel with fp32 gradients: the same logged losses at
    every step; the weights after 8 steps within 60 dB (observed >= 68 dB: the gradient mean is
    rounded in another order). c_attn.bias is left out: the key part of it has a zero gradient
    (softmax ignores a constant added to all keys), so AdamW steps it by the rounding noise alone
    (observed 46 dB)."""
    ours = torchrun(2, O1, TORCH, f"out_dir={tmp_path / 'torch'}")
    ref = torchrun(2, O1, "grad_comm=fp32", f"out_dir={tmp_path / 'ref'}")
    assert logged_losses(ours.stdout) == logged_losses(ref.stdout) and len(logged_losses(ref.stdout)) == 8
    a, b = weights(tmp_path / "torch"), weights(tmp_path / "ref")
    assert a.keys() == b.keys()
    for k in a:
        if a[k].is_floating_point() and b[k].abs().sum() > 0 and not k.endswith("c_attn.bias"):
            assert sqnr(b[k].double(), a[k].double()) > 60, (k, sqnr(b[k].double(), a[k].double()))


@pytest.mark.slow
@pytest.mark.dist
def test_dcp_resume_is_exact_at_any_data_parallel_size(tmp_path):
    """FSDP2 x TP + SP (2 x 2 ranks, O1, dropout): resume from the checkpoint of step 4
    (conftest.stopped_at): the losses and weights of never stopping, bit for bit (every rank's shards, Adam's moments and
    the dropout streams restored). The same checkpoint on 2 ranks (TP only): loaded as it is, no
    conversion; on 1 process (another TP): converted, and the log says so. sample.py reads it.
    The model has grouped-query attention: its q/k/v held grouped by key/value head under TP, cut
    again by FSDP2, read back as rows by export.py and by the conversion."""
    common = [O1, TP2, SP, TORCH, "dropout=0.1", *GQA]
    full = torchrun(4, *common, f"out_dir={tmp_path / 'full'}")
    conftest.stopped_at(tmp_path / "full", tmp_path / "stopped", 4)
    rest = torchrun(4, *common, "init_from=resume", f"out_dir={tmp_path / 'stopped'}")
    assert "resuming at iter 4" in rest.stdout and "converting" not in rest.stdout
    assert logged_losses(rest.stdout) == logged_losses(full.stdout)[4:] and len(logged_losses(rest.stdout)) == 4
    a, b = weights(tmp_path / "full"), weights(tmp_path / "stopped")
    assert all(torch.equal(a[k], b[k]) for k in a)
    found = find_checkpoint(str(tmp_path / "stopped"))[0]
    assert found.layout()["engine"] == "torch" and sum(f.endswith(".distcp") for f in found.files) == 4

    narrower = torchrun(2, *common, "max_iters=10", "init_from=resume", f"out_dir={tmp_path / 'stopped'}")
    assert "resuming at iter 8" in narrower.stdout and "converting" not in narrower.stdout
    assert len(logged_losses(narrower.stdout)) == 2
    # export.py reads the TP set in one process: the grouped q/k/v as rows again (4 + 2 + 2 heads of 8)
    export.main([f"--out_dir={tmp_path / 'stopped'}", f"--to={tmp_path / 'fp32'}", "--format=fp32"])
    exported, state = load_portable(str(tmp_path / "fp32"))[0], weights(tmp_path / "stopped")
    assert state["blocks.0.attn.c_attn.weight"].shape == (64, 32) and state["blocks.0.attn.c_attn.bias"].shape == (64,)
    assert exported.keys() <= state.keys() and all(torch.equal(v, state[k]) for k, v in exported.items())
    one = conftest.run("train.py", *TINY, O1, TORCH, "max_iters=12", "init_from=resume",
                       f"out_dir={tmp_path / 'stopped'}")
    assert one.returncode == 0, one.stderr[-2000:]
    assert ("converting the checkpoint of iter 10 (precision=O1 (tensor_parallel=2)) to precision=O1: carried over: "
            "weights exactly (fp32), Adam moments" in one.stdout)  # (DCP holds the TP-cut moments whole)
    sample = conftest.run("sample.py", f"--out_dir={tmp_path / 'stopped'}", "--num_samples=1", "--max_new_tokens=8")
    assert sample.returncode == 0 and "iter 12" in sample.stdout, sample.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.dist
def test_hsdp_trains_as_fsdp2_and_checkpoints_resume_across_them(tmp_path):
    """data_parallel_replicate=2 on 4 ranks: FSDP2's HSDP, each parameter sharded over 2 ranks
    and replicated twice. Plain FSDP2 over the 4 ranks is the same step, its gradient sum taken
    in another order (HSDP: reduce-scatter within a replica, then all-reduce across them). HSDP's
    checkpoint of step 4 (conftest.stopped_at) resumed by plain FSDP2 for 2 steps, whose
    checkpoint HSDP resumes for the last 2: both sets load as they are (no conversion), and the
    losses agree with the HSDP run that never stopped within 2e-4 (they are printed to 1e-4;
    observed equal), the final weights within 80 dB (observed >= 142 dB; c_attn.bias aside, see
    above: observed 88 dB; from scratch, 8 steps of each apart: >= 98 dB and 62 dB)."""
    common = [O1, TORCH, "gradient_accumulation_steps=4"]
    hsdp = torchrun(4, *common, "data_parallel_replicate=2", f"out_dir={tmp_path / 'hsdp'}")
    assert "4 processes (HSDP: 2 replicas, each sharded over 2 ranks)" in hsdp.stdout
    conftest.stopped_at(tmp_path / "hsdp", tmp_path / "stopped", 4)
    as_fsdp = torchrun(4, *common, "max_iters=6", "init_from=resume", f"out_dir={tmp_path / 'stopped'}")
    as_hsdp = torchrun(4, *common, "data_parallel_replicate=2", "init_from=resume", f"out_dir={tmp_path / 'stopped'}")
    want = logged_losses(hsdp.stdout)
    assert len(want) == 8
    for out, first in ((as_fsdp, 4), (as_hsdp, 6)):
        got = logged_losses(out.stdout)
        assert len(got) == 2 and all(abs(a - b) <= 2e-4 for a, b in zip(got, want[first:])), (got, want)
        assert f"resuming at iter {first}" in out.stdout and "converting" not in out.stdout
    assert "HSDP" not in as_fsdp.stdout and "HSDP" in as_hsdp.stdout
    a, b = weights(tmp_path / "hsdp"), weights(tmp_path / "stopped")
    assert a.keys() == b.keys()
    for k in a:
        if a[k].is_floating_point() and not k.endswith("c_attn.bias"):
            assert sqnr(a[k].double(), b[k].double()) > 80, (k, sqnr(a[k].double(), b[k].double()))


# -------------------------------------------------------------------- DCP re-cuts the shards

ARGS = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, bias=True)


def _model():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**ARGS))
    apply_fp8(model, Recipe(backend="cpu"))
    return model


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)


def _fsdp(world, param_dtype="fp32"):
    from nanofp8.layout import make_layout

    layout = make_layout(device="cpu", engine="torch")
    cfg = {"precision": "O1", "sequence_parallel": False, "fsdp_param_dtype": param_dtype}
    model = torchstack.shard_model(_model(), cfg, layout, "fp8")
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), layout


def _full(model, optimizer):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _train_and_save(rank, world, out):
    """Two steps on 2 ranks, then a DCP save and the whole state for comparison. Both ranks take the
    same batch: the mean of their gradients is one process's, exactly."""
    model, opt, layout = _fsdp(world)
    for step in range(2):
        _, loss = model(*_batch(10 * step))
        loss.backward()
        opt.step()
        opt.zero_grad()
    torchstack.write_dcp(model, opt, out, layout)
    full = _full(model, opt)
    if rank == 0:
        torch.save(full, os.path.join(out, "full.pt"))


def _load_and_compare(rank, world, out):
    model, opt, _ = _fsdp(world)
    torchstack.load_dcp(model, opt, {"dcp": os.path.join(out, torchstack.DCP_DIR)})
    got = _full(model, opt)
    if rank == 0:
        torch.save(got, os.path.join(out, f"got{world}.pt"))


def _same(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return torch.equal(a, b) if torch.is_tensor(a) else a == b


@pytest.mark.dist
def test_dcp_recuts_weights_and_moments_for_another_world_size(tmp_path):
    """An FSDP2 checkpoint of 2 ranks, read by 3 ranks (uneven shards of every parameter) and by
    one process without a process group: weights and Adam's moments, bit for bit the state the 2
    ranks held. FSDP2 (its FP8 all-gather included) of this grouped-query model trains to the
    weights of one process, bit for bit."""
    out = str(tmp_path)
    spawn(_train_and_save, 2, out)
    saved = torch.load(os.path.join(out, "full.pt"), weights_only=False)
    one = _model()
    opt = torch.optim.AdamW(one.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(2):
        one(*_batch(10 * step))[1].backward()
        opt.step()
        opt.zero_grad()
    assert all(torch.equal(p, saved[0][k]) for k, p in one.named_parameters())
    spawn(_load_and_compare, 3, out)
    assert _same(torch.load(os.path.join(out, "got3.pt"), weights_only=False), saved)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    torchstack.load_dcp(model, opt, {"dcp": os.path.join(out, torchstack.DCP_DIR)})
    assert _same(_full(model, opt), saved)
    assert saved[1]["state"]  # (the moments exist: two steps were taken)


# -------------------------------------------------------------------- FSDP2's MixedPrecisionPolicy


def _gathered_dtypes(model):
    """{parameter: the dtype each leaf module computes with, "fp8" for an FP8-gathered weight},
    recorded by forward hooks, which run once FSDP2 has all-gathered the module's parameters."""
    from nanofp8.fsdp import GatheredFp8Weight

    seen = {}

    def record(mod, args, out, prefix):
        for name, p in mod.named_parameters(recurse=False):
            seen[f"{prefix}.{name}"] = "fp8" if isinstance(p, GatheredFp8Weight) else p.dtype

    for prefix, mod in model.named_modules():
        if not list(mod.children()):
            mod.register_forward_hook(lambda m, a, o, prefix=prefix: record(m, a, o, prefix))
    return seen


def _train_policy(rank, world, out):
    """Three O1 steps on 2 ranks under each fsdp_param_dtype (the same batches, bf16 autocast as
    train.py): the losses and the dtypes the layers computed with."""
    got = {}
    for policy in ("fp32", "bf16"):
        model, opt, layout = _fsdp(world, policy)
        seen, losses = _gathered_dtypes(model), []
        for step in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, loss = model(*_batch(10 * step + rank))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        got[policy] = {"dtypes": dict(seen), "losses": losses}
    if rank == 0:
        torch.save(got, os.path.join(out, "policy.pt"))


@pytest.mark.slow
@pytest.mark.dist
def test_fsdp_param_dtype_bf16_gathers_the_rest_in_bf16(tmp_path):
    """fsdp_param_dtype=bf16 (FSDP2's MixedPrecisionPolicy): every parameter that FSDP2 does not
    gather in FP8 (embeddings, norms, biases, the LM head) reaches its layer as bf16, the FP8
    layers' weights still as FP8 bytes; fp32 gathers them as stored. The losses of three O1
    steps stay within bf16's rounding of fp32's: relative difference below 2^-7 (a bf16 value
    carries 8 significant bits; observed 1.4e-3)."""
    spawn(_train_policy, 2, str(tmp_path))
    got = torch.load(tmp_path / "policy.pt")
    fp32, bf16 = got["fp32"]["dtypes"], got["bf16"]["dtypes"]
    assert fp32.keys() == bf16.keys() and "tok_emb.weight" in fp32 and "blocks.0.norm_1.weight" in fp32
    fp8 = {k for k, v in fp32.items() if v == "fp8"}
    assert fp8 == {f"blocks.{i}.{m}.weight" for i in range(2) for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
    assert all(bf16[k] == "fp8" for k in fp8)
    assert all(fp32[k] == torch.float32 and bf16[k] == torch.bfloat16 for k in fp32.keys() - fp8), bf16
    a, b = torch.tensor(got["fp32"]["losses"]), torch.tensor(got["bf16"]["losses"])
    rel = ((a - b).abs() / a).max().item()
    assert 0 < rel < 2 ** -7, (a, b)


def _train_recomputed(rank, world, out):
    """Three O1 steps with dropout on 2 ranks, FP8 all-gathers, each block recomputed or not."""
    from nanofp8.layout import make_layout
    from nanofp8.model import checkpoint_blocks

    layout, got = make_layout(device="cpu", engine="torch"), {}
    for recompute in (False, True):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**ARGS, dropout=0.1))
        apply_fp8(model, Recipe(backend="cpu"))
        if recompute:
            checkpoint_blocks(model)
        cfg = {"precision": "O1", "sequence_parallel": False, "fsdp_param_dtype": "fp32"}
        model = torchstack.shard_model(model, cfg, layout, "fp8")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        torch.manual_seed(1 + rank)  # (dropout's masks: each rank its own)
        losses, calls = [], []
        model.blocks[0].register_forward_pre_hook(lambda *a: calls.append(1))  # (pre: a recomputation stops early)
        for step in range(3):
            _, loss = model(*_batch(10 * step + rank))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        got[recompute] = (losses, _full(model, opt), len(calls))
    if rank == 0:
        torch.save(got, os.path.join(out, "recompute.pt"))


@pytest.mark.slow
@pytest.mark.dist
def test_activation_checkpointing_under_fsdp2_is_bit_for_bit(tmp_path):
    """Recomputed under FSDP2 (model.checkpoint_blocks; FSDP2 gathers a block's FP8 weights again
    for its recomputation, checkpoint replays dropout's RNG): the losses, weights and Adam moments
    of three steps on 2 ranks are bit for bit those of the run that keeps every activation,
    which runs each block's forward half as often."""
    spawn(_train_recomputed, 2, str(tmp_path))
    got = torch.load(tmp_path / "recompute.pt", weights_only=False)
    assert (got[False][2], got[True][2]) == (3, 6)
    assert got[True][0] == got[False][0] and _same(got[True][1], got[False][1])
    assert got[True][1][1]["state"]


# -------------------------------------------------------------------- what engine=torch refuses


def test_what_engine_torch_does_not_run_is_refused_in_one_line():
    load = train.load_config
    for args, says in (([TORCH, "pipeline_parallel=2"], "engine=torch has no pipeline parallelism"),
                       ([TORCH, "precision=O2"], "precision=O2 does not run on engine=torch: its FP8 weight gradients"),
                       ([TORCH, "precision=O3"], "precision=O3 does not run on engine=torch"),
                       ([TORCH, TP2, "fp8_scaling=delayed", O1], "each TP rank keeps its own amax history"),
                       ([TORCH, TP2, "fp8_lm_head=True", O1], "fp8_lm_head=True with engine=torch"),
                       ([TORCH, "fp8_stats_interval=5", O1], "fp8_stats_interval=5 with engine=torch"),
                       ([TORCH, "fsdp_param_dtype=fp16"], "'fsdp_param_dtype' must be one of ['auto', 'bf16', 'fp32']"),
                       (["fsdp_param_dtype=bf16"], "the hand-written engine gathers no parameters"),
                       (["data_parallel_replicate=2"], "data_parallel_replicate=2 is FSDP2's HSDP (engine=torch)"),
                       ([TORCH, "data_parallel_replicate=0"], "'data_parallel_replicate' must be positive"),
                       (["engine=jax"], "engine")):
        with pytest.raises(ConfigError, match=None) as e:
            load(args)
        assert says in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert load([TORCH, O1, TP2, SP])["engine"] == "torch"
    from nanofp8.layout import check_layout

    with pytest.raises(ConfigError, match="data_parallel_replicate=2 must divide the 3 data-parallel ranks"):
        check_layout(load([TORCH, "data_parallel_replicate=2"]), True, 3)

    assert load([TORCH, O1, "compile=True"])["compile"]  # FSDP2's FP8 all-gather compiles (tests/test_fsdp.py)


def test_one_process_engine_torch_trains_and_checkpoints(tmp_path):
    """Without torchrun: no FSDP2, no TP; a DCP set all the same, which resumes exactly."""
    args = [*conftest.TINY, O1, TORCH, "eval_interval=2", "max_iters=4", "lr_decay_iters=4"]
    full = conftest.run("train.py", *args, f"out_dir={tmp_path / 'full'}")
    first = conftest.run("train.py", *args, "max_iters=2", f"out_dir={tmp_path / 'stop'}")
    rest = conftest.run("train.py", *args, "init_from=resume", f"out_dir={tmp_path / 'stop'}")
    for out in (full, first, rest):
        assert out.returncode == 0, out.stderr[-2000:]
    assert logged_losses(first.stdout) + logged_losses(rest.stdout) == logged_losses(full.stdout)
    a, b = weights(tmp_path / "full"), weights(tmp_path / "stop")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert find_checkpoint(str(tmp_path / "stop"))[0].files == ["ckpt.pt", "dcp/__0_0.distcp", "dcp/.metadata"]


def test_compile_is_on_for_cuda_where_fsdp2_gathers_fp8_weights():
    """compile=None turns compile on for CUDA under FSDP2's FP8 all-gather (engine=torch, O1, data
    parallel: compiled, it trains as eager, tests/test_fsdp.py), and keeps it off under TP, whose
    collectives run eagerly, and on CPU."""
    from nanofp8.layout import Layout
    from nanofp8.configurator import compile_choice

    cfg = {"precision": "O1", "compile": None, "fp8_stats_interval": 0}
    cuda = dict(device="cuda:0", world=2)
    assert compile_choice(cfg, Layout(dp=2, engine="torch", **cuda))  # FSDP2 gathers FP8 weights
    assert compile_choice(cfg, Layout(dp=2, **cuda))  # the hand-written engine
    assert compile_choice({**cfg, "precision": "bf16"}, Layout(dp=2, engine="torch", **cuda))  # fp32 gathers
    assert compile_choice(cfg, Layout(engine="torch", device="cuda:0"))  # one process: nothing gathered
    assert not compile_choice(cfg, Layout(dp=1, tp=2, engine="torch", **cuda))  # TP: eager collectives
    assert not compile_choice(cfg, Layout(dp=2, world=2))  # CPU
    assert compile_choice({**cfg, "compile": True}, Layout(dp=2, world=2))


@pytest.mark.slow
@pytest.mark.dist
def test_delayed_scaling_resumes_exactly_under_fsdp2(tmp_path):
    """FSDP2 over 2 ranks with delayed scaling: each rank casts its own activations and gradients,
    so each keeps its own amax histories, plain buffers that DCP saves once. Resume from
    the checkpoint of step 4 (conftest.stopped_at): the losses and weights of never stopping, bit for bit (ckpt.pt
    holds every rank's scaling state, and each rank gets its own back)."""
    common = [O1, TORCH, "fp8_recipe=delayed"]
    full = torchrun(2, *common, f"out_dir={tmp_path / 'full'}")
    conftest.stopped_at(tmp_path / "full", tmp_path / "stopped", 4)
    rest = torchrun(2, *common, "init_from=resume", f"out_dir={tmp_path / 'stopped'}")
    assert "resuming at iter 4" in rest.stdout
    assert logged_losses(rest.stdout) == logged_losses(full.stdout)[4:] and len(logged_losses(rest.stdout)) == 4
    a, b = weights(tmp_path / "full"), weights(tmp_path / "stopped")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    a, b = (load_checkpoint(conftest.newest_checkpoint(tmp_path / d))["fp8_ranks"] for d in ("full", "stopped"))
    assert len(a) == 2 and all(torch.equal(v, b[r][k]) for r in range(2) for k, v in a[r].items())


# ---------------------------------------------------------------- conversions between the engines

DUMP_MOMENTS = """
import os, sys
sys.path.insert(0, {repo!r})
import torch, train
from torch.distributed.tensor import DTensor
restore = train.restore_state


def restore_and_dump(model, optimizer, *a, **k):  # the moments right after the conversion, whole
    out = restore(model, optimizer, *a, **k)
    names = {{p: n for n, p in model.named_parameters()}}
    got = {{names[p]: {{k: (v.full_tensor() if isinstance(v, DTensor) else v).cpu() for k, v in st.items()
                      if k in ("exp_avg", "exp_avg_sq")}} for p, st in optimizer.state.items()}}
    if os.environ.get("RANK", "0") == "0":
        torch.save(got, {dump!r})
    return out


train.restore_state = restore_and_dump
train.cli({args!r})
"""


def converted_moments(tmp_path, nproc, args):
    """The Adam moments a resume by train.py holds right after restore_state, on `nproc` ranks."""
    dump, worker = tmp_path / f"moments-{nproc}.pt", tmp_path / f"dump-{nproc}.py"
    worker.write_text(DUMP_MOMENTS.format(repo=conftest.REPO, dump=str(dump), args=args))
    if nproc == 1:
        out = conftest.run(str(worker))
        assert out.returncode == 0, out.stderr[-3000:]
    else:
        out = conftest.torchrun(nproc, script=str(worker))
    return torch.load(dump), out.stdout


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("source", ["nanofp8", "torch"])
def test_conversions_between_the_engines_carry_the_moments(source, tmp_path):
    """A checkpoint of one engine resumed by the other (through checkpoint.resume_from) at 1 and 2
    ranks holds the source's Adam moments, bit for bit: the hand-written engine's into FSDP2's
    DTensor shards (plain tensors there once failed at the first step: "aten.lerp_.Scalar got mixed
    torch.Tensor and DTensor"), engine=torch's DCP moments into the hand-written engine's optimizer
    (they once restarted from zero). The log says they carried over; the resumed run trains on."""
    from nanofp8.checkpoint import fp32_moments, load_checkpoint
    from nanofp8.torchstack import read_dcp_moments

    out = tmp_path / "out"
    common = [*conftest.TINY, O1, "gradient_accumulation_steps=2", "max_iters=4", "eval_interval=2", "lr_decay_iters=8"]
    train.main(common + [f"engine={source}", f"out_dir={out}"])
    found = find_checkpoint(str(out))[0]
    want = read_dcp_moments(found) if source == "torch" else fp32_moments(load_checkpoint(found.file("ckpt.pt")))
    target = "nanofp8" if source == "torch" else "torch"
    for nproc in (1, 2):
        args = common + [f"engine={target}", "max_iters=6", "init_from=resume", f"out_dir={out}"]
        got, stdout = converted_moments(tmp_path, nproc, args)
        assert "carried over: weights exactly (fp32), Adam moments" in stdout, stdout[-2000:]
        assert got.keys() == want.keys()
        for name in want:
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(got[name][k], want[name][k]), (nproc, name, k)
        assert logged_losses(stdout)[-1] > 0 and "iter 5:" in stdout
        shutil.rmtree(out)  # the next resume converts the same source again
        train.main(common + [f"engine={source}", f"out_dir={out}"])


def _agree_worker(rank, world, out_dir):
    """train.py's engine=torch O1 model, optimizer and restore_state on 2 gloo ranks, then two
    steps of 2 micro-steps each: the amax all-reduces (nanofp8.counter's COMM) of each step."""
    from nanofp8.counter import comm_stats
    from nanofp8.layout import make_layout
    from nanofp8.run import restore_state

    cfg = train.load_config(["device=cpu", O1, TORCH, "compile=False", "batch_size=2", "block_size=16",
                             "gradient_accumulation_steps=4", "n_layer=2", "n_head=2", "n_embd=32"])
    layout = make_layout(engine="torch")
    args = dict(arch="gpt2", n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64)
    model = train.build_model(cfg, layout, args, None, None, lambda *a: None)[0]
    opt = train.build_optimizer(model, cfg, "cpu")
    restore_state(model, opt, None, None, cfg, layout, lambda *a: None)
    g, calls = torch.Generator().manual_seed(rank), []
    for _ in range(2):
        comm_stats(reset=True)
        batches = [(t[:, :-1], t[:, 1:]) for t in torch.randint(0, 64, (2, 2, 17), generator=g)]
        torchstack.forward_backward(model, batches, layout, torch.autocast("cpu", dtype=torch.bfloat16))
        opt.step()
        opt.zero_grad()
        calls.append(comm_stats()["by_op"].get("fsdp_amax_all_reduce", {}).get("calls"))
    torch.save(calls, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.slow
@pytest.mark.dist
def test_train_py_agrees_the_amaxes_once_per_step(tmp_path):
    """engine=torch at O1 (FSDP2, FP8 all-gathers of the 8 block Linears): one amax all-reduce per
    optimizer step, after it, where each all-gather agreed its own (8 weights x forward and
    backward x 2 micro-steps = 32 per step)."""
    spawn(_agree_worker, 2, str(tmp_path))
    for rank in range(2):
        assert torch.load(tmp_path / f"rank{rank}.pt") == [1, 1]
