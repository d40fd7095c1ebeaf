"""Tests of train.py's model parallelism (tensor_parallel, sequence_parallel, pipeline_parallel) on
CPU: gloo, through torchrun, as a user runs it.

What is checked:
  * each layout (TP=2, TP=2 + SP, PP=2, DP=2 x TP=2) trains to the single-device losses within
    1% at every step and (without data parallelism: replicas draw their own evaluation batches)
    to its validation losses within 0.3% at every evaluation, on the same
    batches (a step's batches do not depend on the layout), in bf16 and in O1 (TP=2 + SP and
    PP=2 at both levels, with train.py's default mp_comm); TP=2 + SP at O1 with grouped-query
    attention (4 query heads, 2 key/value heads: one of each per rank, the query heads with theirs);
  * replicated tensors are bit-identical where several ranks hold them: in the checkpoints (the
    TP ranks' unsharded tensors, the two copies of the tied embedding under PP) and, for the
    data-parallel replicas, by train.py's own check at every evaluation (which is shown to fire);
  * stopping at a checkpoint and resuming at the same layout (TP=2 + SP + PP=2, with dropout and
    delayed scaling) reproduces the uninterrupted run exactly, and a different layout is converted
    (tests/test_export.py tests the conversions), with a note;
  * so does it under data parallelism with delayed scaling (2 replicas: each rank's amax histories
    saved, and its own restored); one process resuming it goes on from rank 0's, with a note;
  * configuration errors name the keys to change.
"""

import functools
import os
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import conftest
import train
from conftest import newest_checkpoint, spawn
from nanofp8 import parallel
from nanofp8.configurator import ConfigError
from nanofp8.model import GPT, GPTConfig
from nanofp8.ckptfile import load_checkpoint, load_model_state

from nanofp8.layout import check_layout
from nanofp8.stats import read_records
from nanofp8.run import TrainingStopped, check_replicas, shard_model

pytestmark = pytest.mark.usefixtures("shakespeare")

# conftest's tiny model, 2 micro-batches per step (so PP has a pipeline to fill and DP=2 has one
# micro-batch per replica), 8 steps, checkpoints at 4 and 8.
TINY = conftest.TINY + ["gradient_accumulation_steps=2", "max_iters=8", "lr_decay_iters=8", "eval_interval=4"]
TP2, SP, PP2 = "tensor_parallel=2", "sequence_parallel=True", "pipeline_parallel=2"

GQA = ("n_head=4", "n_kv_head=2")  # grouped-query attention: 2 query heads per key/value head

# name: (processes, layout, precision); a layout's model keys (GQA) go to its single-device run too
LAYOUTS = {
    "tp2": (2, [TP2], "bf16"),
    "tp2_sp": (2, [TP2, SP, *GQA], "O1"),
    "tp2_sp_bf16": (2, [TP2, SP], "bf16"),
    "pp2": (2, [PP2], "bf16"),
    "pp2_o1": (2, [PP2], "O1"),
    "dp2_tp2": (4, [TP2], "O1"),
}


def torchrun(nproc, *args):
    return conftest.torchrun(nproc, *TINY, *args)


def logged_losses(out):
    return conftest.logged_losses(out.stdout)


def logged_val_losses(out):
    return [float(line.split("val loss ")[1]) for line in out.stdout.splitlines()
            if line.startswith("step ") and "val loss" in line]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """run(name) -> (losses, out_dir) of that layout; each layout is launched once."""

    @functools.cache
    def launch(name):
        nproc, layout, precision = LAYOUTS[name]
        out_dir = tmp_path_factory.mktemp(name)
        out = torchrun(nproc, *layout, f"precision={precision}", f"out_dir={out_dir}")
        launch.val[name] = logged_val_losses(out)
        return logged_losses(out), out_dir

    launch.val = {}

    return launch


@functools.cache
def single_device_run(precision, model=()):
    """The same config on one process: the reference history (unrounded losses)."""
    import tempfile

    return train.main(TINY + [*model, f"precision={precision}", f"out_dir={tempfile.mkdtemp()}"])


def single_device(precision, model=()):
    return [loss for _, loss in single_device_run(precision, model)["losses"]]


def model_keys(name):
    """The model keys a layout sets (its single-device run sets them too)."""
    return tuple(arg for arg in LAYOUTS[name][1] if arg in GQA)


# ---------------------------------------------------------------- the layouts against one device


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_device(run, name):
    losses, out_dir = run(name)
    ref = single_device(LAYOUTS[name][2], model_keys(name))
    assert len(losses) == len(ref) == 8
    gaps = [abs(a - b) / b for a, b in zip(losses, ref)]
    print(f"{name} ({LAYOUTS[name][2]}): loss {losses[0]:.4f} -> {losses[-1]:.4f}, single device "
          f"{ref[0]:.4f} -> {ref[-1]:.4f}, largest gap {max(gaps):.4%}")
    assert ref[-1] < ref[0] - 0.2, "the model should learn something"
    assert max(gaps) < 0.01
    # one checkpoint file per (tensor, pipeline) rank, written by data-parallel rank 0
    nproc, layout = LAYOUTS[name][:2]
    tp, pp = (2 if TP2 in layout else 1), (2 if PP2 in layout else 1)
    newest = os.path.dirname(newest_checkpoint(out_dir, "manifest.json"))
    assert sorted(os.listdir(newest)) == sorted([f"ckpt-tp{t}-pp{p}.pt" for t in range(tp) for p in range(pp)]
                                                + ["manifest.json"])
    if nproc > tp * pp:
        return  # data-parallel replicas evaluate other batches (seeded by replica): not comparable
    ref_val = [v for _, _, v in single_device_run(LAYOUTS[name][2], model_keys(name))["evals"]]
    val = run.val[name]
    assert len(val) == len(ref_val) == 3  # steps 0, 4, 8 (the log rounds to 4 decimals)
    val_gaps = [abs(a - b) / b for a, b in zip(val, ref_val)]
    print(f"{name}: val loss gaps {[f'{g:.4%}' for g in val_gaps]}")
    assert max(val_gaps) < 0.003


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("name", ["tp2", "tp2_sp", "dp2_tp2"])
def test_tp_checkpoints_replicate_what_is_not_sharded(run, name):
    """The two TP ranks' files: unsharded tensors bit-identical, shards of the same shape and
    different, and together a whole single-device model."""
    _, out_dir = run(name)
    a, b = (load_checkpoint(newest_checkpoint(out_dir, f"ckpt-tp{t}-pp0.pt"))["model"] for t in (0, 1))
    assert a.keys() == b.keys()
    config = GPTConfig(**load_checkpoint(newest_checkpoint(out_dir, "ckpt-tp0-pp0.pt"))["model_args"])
    sharded = [k for k in a if parallel.tp_cut(k, parallel.tp_plan(config))[0] is not None]
    assert len(sharded) == 2 * 6  # per block: c_attn w+b, attn.c_proj w, c_fc w+b, mlp.c_proj w
    for k in a:
        if k in sharded:
            assert a[k].shape == b[k].shape and not torch.equal(a[k], b[k]), k
        else:
            assert torch.equal(a[k], b[k]), k
    load_model_state(GPT(config), parallel.merge_tp_state_dicts([a, b], config))  # strict: all keys


@pytest.mark.slow
@pytest.mark.dist
def test_pp_tied_embedding_copies_agree(run):
    """The last stage's LM head is a copy of the first stage's embedding (tie_embeddings): their
    gradients are summed, so after 8 steps they are still the same bits."""
    _, out_dir = run("pp2")
    first, last = (load_checkpoint(newest_checkpoint(out_dir, f"ckpt-tp0-pp{p}.pt"))["model"] for p in (0, 1))
    assert "blocks.0.attn.c_attn.weight" in first and "blocks.1.attn.c_attn.weight" in last
    assert "blocks.1.attn.c_attn.weight" not in first and "blocks.0.attn.c_attn.weight" not in last
    assert torch.equal(first["tok_emb.weight"], last["lm_head.weight"])


@pytest.mark.slow
@pytest.mark.dist
def test_a_later_run_of_another_layout_wins(run, tmp_path, capsys):
    """A tensor-parallel run's sets (iterations 4 and 8) and then, with overwrite_checkpoints=True,
    a one-process run in the same out_dir (iteration 2): readers take the set written last, not
    the highest iteration of another layout."""
    import shutil

    from nanofp8.checkpoint import read_any

    out = shutil.copytree(run("tp2")[1], tmp_path / "out")
    train.main(TINY + ["max_iters=2", "eval_interval=2", f"out_dir={out}", "overwrite_checkpoints=True"])
    state, info = read_any(str(out))
    assert info["iter_num"] == 2 and info["files"] == [str(out / "ckpt-00000002" / "ckpt.pt")]
    resumed = train.main(TINY + ["max_iters=3", "eval_interval=2", f"out_dir={out}", "init_from=resume"])
    assert "resuming at iter 2" in capsys.readouterr().out and [it for it, _ in resumed["losses"]] == [2]


# ---------------------------------------------------------------- train.py's replica check


def _replica_worker(rank, world, out):  # run by conftest.spawn: the process group is up
    groups = parallel.make_groups(tp=1, pp=1)  # 2 data-parallel replicas
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    check_replicas(net, groups)  # identical: passes
    if rank == 1:  # one ulp of one weight
        with torch.no_grad():
            w = net[0].weight
            w[3, 5] = torch.nextafter(w[3, 5], torch.tensor(1.0))
    try:
        check_replicas(net, groups)
        result = "passed"
    except TrainingStopped as e:  # the run stops with one line and exit status 1, not a traceback
        result = f"stopped: {e}"
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))


@pytest.mark.slow
@pytest.mark.dist
def test_replica_check_sees_one_ulp(tmp_path):
    spawn(_replica_worker, 2, str(tmp_path))
    for r in range(2):
        msg = torch.load(tmp_path / f"rank{r}.pt")
        assert msg.startswith("stopped: data-parallel replicas hold different values of ['0.weight']"), msg


# ---------------------------------------------------------------- resume


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("layout", [[TP2, SP, PP2, "mp_comm=fp32"], [TP2], [PP2]], ids=["tp2-sp-pp2-fp32", "tp2", "pp2"])
def test_statistics_of_a_cut_model_are_those_of_the_whole(tmp_path, layout):
    """FP8 statistics under tensor, sequence and pipeline parallelism: every rank observes its own
    casts (a shard's slice of a sharded or SP-gathered operand, a replicated one on one rank of its
    group only, each stage its own layers), and rank 0 merges them. With tensor scales (one scale
    the ranks agree on) the records of step 0 are those of the uncut model: the same layers and
    operands, the same value counts, the same SQNR up to fp32 summation order (mp_comm=fp32), or
    up to the FP8 rounding of what crosses the ranks, which is then recorded too: TP's partial sums,
    the activations and gradients between pipeline stages."""
    common = ["precision=O1", "max_iters=1", "fp8_stats_interval=1"]
    train.main(conftest.TINY + ["gradient_accumulation_steps=2", *common, f"out_dir={tmp_path / 'one'}"])
    torchrun(4 if TP2 in layout and PP2 in layout else 2, *layout, *common, f"out_dir={tmp_path / 'cut'}")
    one, cut = ({(r["layer"], r["operand"]): r for r in read_records(tmp_path / d / "fp8_stats.jsonl") if r["iter"] == 0}
                for d in ("one", "cut"))
    assert len(one) == 4 * 2 * 3  # 4 Linears x 2 blocks x (x, w, dy)
    sent = {(layer, "y_partial" if layer.endswith("c_proj") else "dx_partial") for layer, _ in one} if TP2 in layout \
        else {("pipeline.stage0", "act"), ("pipeline.stage1", "grad")}
    assert set(cut) == set(one) | (sent if "mp_comm=fp32" not in layout else set())
    for key in set(cut) - set(one):  # cast per token: E4M3 forward (y, act), E5M2 backward (dx, grad)
        assert cut[key]["n"] > 0 and cut[key]["sqnr_db"] > (28 if key[1] in ("y_partial", "act") else 23), cut[key]
    for key, r in one.items():
        c = cut[key]
        assert c["n"] == r["n"] and c["format"] == r["format"], key  # no shard lost, none counted twice
        if key[1] == "w" or key == ("blocks.0.attn.c_attn", "x"):  # the same values, cut: the same record
            assert c["amax"] == r["amax"] and c["scale"] == r["scale"], key
            assert c["sqnr_db"] == pytest.approx(r["sqnr_db"], rel=1e-9), key
            assert c["underflow_count"] == r["underflow_count"] and c["subnormal"] == pytest.approx(r["subnormal"]), key
        else:  # differences (fp32 order; FP8 on the wire: up to 0.26 dB seen) flip a few FP8 roundings
            assert abs(c["sqnr_db"] - r["sqnr_db"]) < (0.25 if "mp_comm=fp32" in layout else 1.0), (key, c, r)
            assert abs(c["underflow"] - r["underflow"]) < 0.01 and abs(c["subnormal"] - r["subnormal"]) < 0.01, key


@pytest.mark.slow
@pytest.mark.dist
def test_statistics_see_the_data_parallel_gradients_sent_in_fp8(tmp_path):
    """DP=2 at O1: rank 0's records include the FP8 cast of the weight gradients its replica sends
    (layer data_parallel, operand grad): every FP8 layer's gradient values, E4M3 with one scale per
    128 values, next to the layers' own operands."""
    torchrun(2, "precision=O1", "max_iters=1", "fp8_stats_interval=1", f"out_dir={tmp_path}")
    recs = {(r["layer"], r["operand"]): r for r in read_records(tmp_path / "fp8_stats.jsonl") if r["iter"] == 0}
    d = 32  # TINY's n_embd: per block c_attn (3d x d), attn.c_proj (d x d), c_fc (4d x d), mlp.c_proj (d x 4d)
    assert recs[("data_parallel", "grad")]["n"] == 2 * (3 + 1 + 4 + 4) * d * d  # (each a multiple of 128)
    assert recs[("data_parallel", "grad")]["format"] == "e4m3" and recs[("data_parallel", "grad")]["sqnr_db"] > 28
    assert len(recs) == 1 + 4 * 2 * 3


def two_node_run(*args):
    """train.py on two "nodes" of one process each, as on two machines: two torchrun launchers
    meeting at a c10d rendezvous on this machine (each rank then has LOCAL_RANK 0). Returns the
    launchers' outputs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
           "--rdzv_backend=c10d", f"--rdzv_endpoint=localhost:{port}", os.path.join(conftest.REPO, "train.py"),
           *TINY, *args]
    env = conftest.rank_env()
    nodes = [subprocess.Popen(cmd, cwd=conftest.REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [SimpleNamespace(stdout=o, stderr=e, returncode=n.returncode)
            for n, (o, e) in ((n, n.communicate(timeout=600)) for n in nodes)]
    assert all(o.returncode == 0 for o in outs), [o.stderr[-2000:] + conftest.crash_site(o.stderr) for o in outs]
    return outs


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("layout", [["precision=O1"], ["precision=O1", TP2, SP], ["precision=O1", "engine=torch"],
                                    ["precision=O1", TP2, SP, "engine=torch"]],
                         ids=["dp2", "tp2-sp", "torch-fsdp2", "torch-tp2-sp"])
def test_two_nodes_train_as_one(tmp_path, layout):
    """Two machines of one process each (local rank 0 on both) train as one machine with two
    processes: the same losses and the same final weights, bit for bit (data shards, devices and
    file writers follow the global rank); one node logs, and each rank's checkpoint file is
    written once. Both engines (engine=torch: FSDP2 or DTensor TP, DCP shards)."""
    one = torchrun(2, *layout, "max_iters=4", f"out_dir={tmp_path / 'one'}")
    nodes = two_node_run(*layout, "max_iters=4", f"out_dir={tmp_path / 'two'}")
    logs = [n for n in nodes if logged_losses(n)]
    assert len(logs) == 1 and logged_losses(logs[0]) == logged_losses(one) and len(logged_losses(one)) == 4
    if "engine=torch" in layout:
        from nanofp8.checkpoint import find_checkpoint, read_any

        a, b = read_any(str(tmp_path / "one"))[0], read_any(str(tmp_path / "two"))[0]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        found = find_checkpoint(str(tmp_path / "two"))[0]
        assert found.iter_num == 4 and sorted(found.files) == ["ckpt.pt", "dcp/.metadata", "dcp/__0_0.distcp",
                                                               "dcp/__1_0.distcp"]
        return
    for name in (["ckpt.pt"] if TP2 not in layout else ["ckpt-tp0-pp0.pt", "ckpt-tp1-pp0.pt"]):
        a = load_checkpoint(newest_checkpoint(tmp_path / "one", name))
        b = load_checkpoint(newest_checkpoint(tmp_path / "two", name))
        assert a["iter_num"] == b["iter_num"] == 4
        assert a["model"].keys() == b["model"].keys() and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


@pytest.mark.slow
@pytest.mark.dist
def test_resume_at_the_same_layout_is_exact(tmp_path):
    """TP=2 + SP + PP=2 on 4 processes, with what has state beyond the weights: dropout (one RNG
    stream per stage, shared by a TP group, saved in each rank's file), FP8 delayed scaling (amax
    histories per shard), AdamW moments, 2 micro-batches. Resume from the checkpoint of step 4
    (conftest.stopped_at): the same losses and the same final weights as never stopping, bit for bit (the CPU
    kernels and gloo's 2-rank sums are deterministic, and every state is restored). Another
    layout converts the files, saying so."""
    common = [TP2, SP, PP2, "precision=O1", "dropout=0.1", "fp8_scaling=delayed"]
    full = torchrun(4, *common, f"out_dir={tmp_path / 'full'}")
    conftest.stopped_at(tmp_path / "full", tmp_path / "stopped", 4)
    rest = torchrun(4, *common, "init_from=resume", f"out_dir={tmp_path / 'stopped'}")
    assert "resuming at iter 4" in rest.stdout
    assert logged_losses(rest) == logged_losses(full)[4:] and len(logged_losses(rest)) == 4
    evals = lambda out: [line for line in out.stdout.splitlines() if line.startswith("step ")]  # noqa: E731
    assert evals(rest) == evals(full)[2:]  # the evaluation at 8 agrees too
    for t in range(2):
        for p in range(2):
            a, b = (load_checkpoint(newest_checkpoint(tmp_path / d, f"ckpt-tp{t}-pp{p}.pt")) for d in ("full", "stopped"))
            assert a["iter_num"] == b["iter_num"] == 8
            assert a["model"].keys() == b["model"].keys()
            assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]), (t, p)
    # the same files under another layout: converted (nanofp8/checkpoint.py), and the log says so
    out = torchrun(2, TP2, "precision=O1", "init_from=resume", f"out_dir={tmp_path / 'stopped'}")
    assert ("converting the checkpoint of iter 8 (precision=O1 (tensor_parallel=2, pipeline_parallel=2)) "
            "to precision=O1 (tensor_parallel=2)") in out.stdout, out.stdout[-2000:]


# ---------------------------------------------------------------- configuration errors


def test_config_errors(tmp_path):
    load = train.load_config
    with pytest.raises(ConfigError, match=r"sequence_parallel=True needs tensor_parallel > 1"):
        load(["sequence_parallel=True"])
    with pytest.raises(ConfigError, match=r"sequence_parallel=True needs block_size \(33\) divisible by "
                                          r"tensor_parallel \(2\)"):
        load([TP2, SP, "block_size=33"])
    for precision, layout in (("O2", TP2), ("O3", PP2)):
        with pytest.raises(ConfigError, match=rf"precision={precision} with tensor_parallel=\d, "
                                              r"pipeline_parallel=\d: nanofp8/parallel.py has no O2/O3"):
            load([layout, f"precision={precision}"])
    with pytest.raises(ConfigError, match="compile=True with tensor_parallel=2, pipeline_parallel=1: torch.compile "
                                          "breaks the graph at every tensor-parallel layer"):
        load([TP2, "compile=True", "engine=torch"])
    with pytest.raises(ConfigError, match="'pipeline_parallel' must be positive"):
        load(["pipeline_parallel=0"])
    cfg = load([TP2, SP, "block_size=32", "precision=O1"])  # and what is fine
    assert (cfg["tensor_parallel"], cfg["sequence_parallel"], cfg["pipeline_parallel"]) == (2, True, 1)
    # layouts that need the processes (or the model) to be judged
    with pytest.raises(ConfigError, match="launch with torchrun"):
        train.main(TINY + [TP2, f"out_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"world size 6 is not divisible by tensor_parallel \* "
                                          r"pipeline_parallel = 2 \* 2"):
        check_layout(load([TP2, PP2]), True, 6)
    cfg = load(TINY + ["n_head=2", "tensor_parallel=4", "precision=O1"])
    with pytest.raises(ConfigError, match=r"tensor_parallel=4 must divide n_head \(2\)"):
        shard_model(GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32)), cfg,
                    SimpleNamespace(tp=4, pp=1))
    with pytest.raises(ConfigError, match=r"tensor_parallel=4 must divide n_kv_head \(2, the key/value heads\)"):
        shard_model(GPT(GPTConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32)), cfg,
                    SimpleNamespace(tp=4, pp=1))
    with pytest.raises(ConfigError, match=r"pipeline_parallel=3 stages need n_layer >= 3, got 2"):
        shard_model(GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32)), cfg,
                    SimpleNamespace(tp=1, pp=3))


@pytest.mark.slow
@pytest.mark.dist
def test_delayed_scaling_resumes_exactly_on_two_replicas(tmp_path):
    """Data parallelism over 2 ranks with delayed scaling: each replica casts its own activations
    and gradients, so each keeps its own amax histories. Resume from the checkpoint of step 4
    (conftest.stopped_at): the losses and weights of never stopping, bit for bit, and both ranks' scaling state
    of step 8 as never stopping (every data-parallel rank's is saved, and each gets its own back)."""
    common = ["precision=O1", "fp8_recipe=delayed"]
    full = torchrun(2, *common, f"out_dir={tmp_path / 'full'}")
    conftest.stopped_at(tmp_path / "full", tmp_path / "stopped", 4)
    rest = torchrun(2, *common, "init_from=resume", f"out_dir={tmp_path / 'stopped'}")
    assert "resuming at iter 4" in rest.stdout
    assert logged_losses(rest) == logged_losses(full)[4:] and len(logged_losses(rest)) == 4
    a, b = (load_checkpoint(newest_checkpoint(tmp_path / d)) for d in ("full", "stopped"))
    assert a["iter_num"] == b["iter_num"] == 8
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    a, b = a["fp8_ranks"], b["fp8_ranks"]
    assert len(a) == 2 and not all(torch.equal(v, a[1][k]) for k, v in a[0].items())  # histories of their own
    assert all(torch.equal(v, b[r][k]) for r in range(2) for k, v in a[r].items())
    # one process goes on from rank 0's histories, and says so
    one = conftest.run("train.py", *TINY, *common, "max_iters=9", "init_from=resume", f"out_dir={tmp_path / 'stopped'}")
    assert one.returncode == 0 and "resuming at iter 8" in one.stdout, one.stderr[-2000:]
    assert "from data-parallel rank 0's amax histories" in one.stdout
