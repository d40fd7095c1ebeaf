"""Tests of train.py and sample.py on CPU, with tiny models on the Shakespeare data.

What is checked: both precision levels train and sample end to end through the real command
line; bad configs fail with a message naming the key; checkpoints are written atomically and a
damaged one is reported, not half-loaded; a stopped-and-resumed run reproduces the uninterrupted
one bit for bit (FP8 delayed-scaling state and dropout RNG included); and FP8 (O1) training
lands within 2% of bf16 on the same data.

The tiny model (conftest.TINY) trains on the Shakespeare data (conftest.shakespeare)."""

import io
import math
import os
import sys

import pytest
import torch

import conftest
import train
from conftest import REPO, TINY, logged_losses, newest_checkpoint, run
from nanofp8.configurator import ConfigError, read_config_file, read_dataset_meta
from nanofp8.fp8 import Recipe, convert_to_fp8
from nanofp8.ckptfile import CheckpointError, load_checkpoint, save_checkpoint

from nanofp8.run import MODEL_KEYS

pytestmark = pytest.mark.usefixtures("shakespeare")


# ---------------------------------------------------------------- end to end, through the CLI


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "O1"])
def test_train_then_sample(tmp_path, precision):
    out = str(tmp_path / "out")
    r = run("train.py", *TINY, f"precision={precision}", "max_iters=6", "eval_interval=3",
            "lr_decay_iters=6", f"--out_dir={out}")
    assert r.returncode == 0, r.stderr
    assert "iter 5: loss" in r.stdout and "step 6: train loss" in r.stdout
    assert ("FP8" in r.stdout) == (precision == "O1")
    ckpt = load_checkpoint(newest_checkpoint(out))
    assert ckpt["iter_num"] == 6 and ckpt["config"]["precision"] == precision
    has_fp8_state = any(k.endswith("amax_history") for k in ckpt["model"])
    assert has_fp8_state == (precision == "O1")

    r = run("sample.py", f"--out_dir={out}", "--max_new_tokens=20", "--num_samples=2", "--start=ROMEO")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("ROMEO") == 2
    if precision == "O1":
        r = run("sample.py", f"--out_dir={out}", "--max_new_tokens=5", "--num_samples=1",
                "fp8_weights=True", "fp8_eval_iters=2")
        assert r.returncode == 0, r.stderr
        assert "E4M3 + scales" in r.stdout and "with FP8 weights" in r.stdout


# ---------------------------------------------------------------- configuration errors


@pytest.mark.slow
def test_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="unknown config key 'max_iter'"):
        train.load_config(["--max_iter=5"])
    with pytest.raises(ConfigError, match="'max_iters'.*expects int"):
        train.load_config(["--max_iters=five"])
    with pytest.raises(ConfigError, match="'compile'"):
        train.load_config(["--compile=1"])  # bools are strict: 1 is not True
    with pytest.raises(ConfigError, match="'precision'"):
        train.load_config(["precision=fp4"])
    with pytest.raises(ConfigError, match="'o2_v_format'"):
        train.load_config(["precision=O2", "o2_v_format=fp4"])
    with pytest.raises(ConfigError, match="precision=O3 shards the optimizer state"):
        train.main(TINY + ["precision=O3", f"out_dir={tmp_path}"])  # needs torchrun
    with pytest.raises(ConfigError, match="'fp8_granularity'"):
        train.load_config(["fp8_granularity=tile"])
    for g in ("row", "block"):  # before the model is built, naming both keys
        with pytest.raises(ConfigError, match=f"fp8_scaling='delayed' needs fp8_granularity='tensor', got '{g}'"):
            train.load_config(["precision=O1", "fp8_scaling=delayed", f"fp8_granularity={g}"])
    bad = tmp_path / "bad.py"
    bad.write_text("n_layers = 4\n")
    with pytest.raises(ConfigError, match=f"unknown config key 'n_layers' from config file {bad}"):
        train.load_config([str(bad)])
    # what works: a file, then overrides, plain key=value and ints for floats
    good = tmp_path / "good.py"
    good.write_text("import math\nn_layer = 3\nlearning_rate = 1e-3\n")
    cfg = train.load_config([str(good), "n_layer=5", "--learning_rate=1", "precision=O1"])
    assert cfg["n_layer"] == 5 and cfg["learning_rate"] == 1.0 and cfg["precision"] == "O1"
    # and through the command line: exit status 2, the key named on stderr
    r = run("train.py", "--n_layr=4")
    assert r.returncode == 2 and "unknown config key 'n_layr'" in r.stderr
    r = run("sample.py", "--top_k=many")
    assert r.returncode == 2 and "'top_k'" in r.stderr


def test_configs_hold_only_what_differs():
    """A base config sets only values that differ from train.py's defaults; each *_fp8.py and
    *_bf16.py is its base file with the level and out_dir set, and the README's commands parse."""
    cfg_dir = os.path.join(REPO, "config")
    bases = [f for f in os.listdir(cfg_dir) if f.endswith(".py") and not f.endswith(("_fp8.py", "_bf16.py"))]
    assert {"gpt2.py", "llama.py", "shakespeare_char.py"} <= set(bases)
    for name in bases:
        restated = {k: v for k, v in read_config_file(os.path.join(cfg_dir, name)).items()
                    if train.DEFAULTS[k] == v}
        assert not restated, (name, restated)
    for base in ("gpt2", "llama", "shakespeare_char"):
        settings = read_config_file(os.path.join(cfg_dir, f"{base}.py"))
        fp8 = read_config_file(os.path.join(cfg_dir, f"{base}_fp8.py"))
        bf16 = read_config_file(os.path.join(cfg_dir, f"{base}_bf16.py"))
        assert fp8 == {**settings, "precision": "O1", "out_dir": f"out-{base.replace('_', '-')}-fp8"}
        assert bf16 == {**settings, "out_dir": f"out-{base.replace('_', '-')}-bf16"}
    cfg = train.load_config([os.path.join(cfg_dir, "gpt2.py"), "precision=O2"])
    assert cfg["precision"] == "O2" and cfg["n_embd"] == 768 and cfg["gradient_accumulation_steps"] == 40
    with pytest.raises(TypeError):  # read-only once validated
        cfg["precision"] = "O1"


@pytest.mark.parametrize("change", ["fp8_recipe=rowwise", "fp8_scaling=delayed", "fp8_granularity=row",
                                    "fp8_formats=e4m3", "fp8_history_len=8", "fp8_amax_algo=most_recent",
                                    "fp8_margin=1", "fp8_attention=True", "fp8_lm_head=True"])
def test_resume_refuses_another_recipe_in_one_line(change):
    """Every fp8_* key that changes what the FP8 layers compute (the preset, each knob, which
    GEMMs run in FP8) is held to the checkpoint's value on resume: one line naming it."""
    from nanofp8.run import check_resume_config

    saved = dict(train.load_config(TINY + ["precision=O1"]))
    cfg = train.load_config(TINY + ["precision=O1", change])
    key, now = change.split("=")
    was = "tensorwise" if key == "fp8_recipe" else saved[key]
    what = "run other GEMMs in FP8 than" if key in ("fp8_attention", "fp8_lm_head") else \
        "cast the FP8 operands by another recipe than"
    with pytest.raises(CheckpointError) as e:
        check_resume_config(saved, cfg, "out/ckpt.pt")
    assert str(e.value) == (f"out/ckpt.pt was written with {key}={was}; resuming with {key}={now} would {what} "
                            f"the one the run trained with, silently. Pass {key}={was}, or start a new run "
                            f"(init_from=out, another out_dir)")
    check_resume_config(saved, train.load_config(TINY + ["precision=O1", "fp8_backend=emulate"]), "out/ckpt.pt")


def test_resume_takes_a_preset_by_name_or_by_its_keys():
    """A recipe is what it casts: a run started with fp8_recipe=rowwise resumes with rowwise's keys
    given one by one and no name, and the other way round (the names differ, the casts do not); a
    preset that differs only in what its keys cannot say (rowwise_with_gw_hp keeps dW's operands in
    high precision) is still refused, naming fp8_recipe."""
    from nanofp8.run import check_resume_config

    by_name = dict(train.load_config(TINY + ["precision=O1", "fp8_recipe=rowwise"]))
    by_keys = train.load_config(TINY + ["precision=O1", "fp8_granularity=row", "fp8_formats=e4m3"])
    check_resume_config(by_name, by_keys, "out/ckpt.pt")
    check_resume_config(dict(by_keys), train.load_config(TINY + ["precision=O1", "fp8_recipe=rowwise"]), "out/ckpt.pt")
    hp = train.load_config(TINY + ["precision=O1", "fp8_recipe=rowwise_with_gw_hp"])
    for saved in (by_name, dict(by_keys)):
        with pytest.raises(CheckpointError, match="fp8_recipe=rowwise_with_gw_hp would cast the FP8 operands by "
                                                  "another recipe"):
            check_resume_config(saved, hp, "out/ckpt.pt")


def test_checkpoint_saves_config_and_derived_values_apart(tmp_path):
    """The checkpoint's config is what was asked for; the device, the dataset's vocabulary and the
    rest of what the run derived are saved apart (model_args, derived)."""
    train.main(TINY + ["device=auto", "max_iters=1", "eval_interval=1", f"out_dir={tmp_path}"])
    ckpt = load_checkpoint(newest_checkpoint(tmp_path))
    assert ckpt["config"]["device"] == "auto" and ckpt["config"]["vocab_size"] == train.DEFAULTS["vocab_size"]
    assert ckpt["derived"]["device"] == "cpu" and ckpt["derived"]["compile"] is False
    meta = read_dataset_meta(os.path.join(REPO, "data", "shakespeare_char"))
    assert ckpt["model_args"]["vocab_size"] == meta["vocab_size"] != train.DEFAULTS["vocab_size"]


def test_a_gpus_log_line_gives_its_peak_memory(monkeypatch):
    """On a GPU each iteration's log line ends with the peak memory allocated (what bench.py
    throughput and scripts/gpu_engine_torch.py read); a CPU's line has none to give."""
    from types import SimpleNamespace

    from nanofp8.run import Clock

    cfg = {**train.load_config(TINY), "peak_flops": 1e12}  # (else a GPU's name is asked)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 3 * 2**29)
    for device_type, tail in (("cuda", ", peak 1.50 GiB"), ("cpu", " tok/s")):
        clock = Clock(cfg, SimpleNamespace(world=1, device_type=device_type), 1024, 1e6)
        clock.tick()
        line = clock.report(1)
        assert line.endswith(tail) and line.count("GiB") == (device_type == "cuda"), line


def test_each_log_line_reaches_the_pipe_whole(tmp_path, monkeypatch):
    """stdout to a pipe or a file is block-buffered: unflushed, a buffer boundary can fall inside a
    line, and under torchrun another rank's write then splits it, so that a log reader loses the
    line. Every message train.py logs is written whole, as it is printed."""
    class Pipe(io.RawIOBase):  # records each write that reaches the "pipe"
        writes = []

        def writable(self):
            return True

        def write(self, b):
            self.writes.append(bytes(b).decode())
            return len(b)

    pipe = Pipe()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.BufferedWriter(pipe, buffer_size=1 << 16)))
    train.main(TINY + ["max_iters=3", "eval_interval=2", f"out_dir={tmp_path}"])
    written = list(pipe.writes)  # before anything flushes the rest
    assert sum(w.startswith("iter ") for w in written) == 3, written
    assert all(w.endswith("\n") for w in written), written  # whole lines only


# ---------------------------------------------------------------- checkpoints


@pytest.mark.slow
def test_checkpoint_atomic_and_damaged(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt.pt")
    state = {"model": {"w": torch.randn(64, 64)}, "model_args": {}, "config": {"a": 1}, "iter_num": 3}
    save_checkpoint(state, path)
    assert os.listdir(tmp_path) == ["ckpt.pt"]  # no temp file left behind
    assert load_checkpoint(path)["iter_num"] == 3

    # A crash in the middle of writing leaves the old checkpoint untouched.
    def crash(obj, f, *a, **k):
        f.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint({**state, "iter_num": 4}, path)
    monkeypatch.undo()
    assert load_checkpoint(path)["iter_num"] == 3 and os.listdir(tmp_path) == ["ckpt.pt"]

    # Truncated, random bytes, a foreign file, a missing file: clear errors naming the file.
    blob = open(path, "rb").read()
    bad = str(tmp_path / "truncated.pt")
    open(bad, "wb").write(blob[: len(blob) // 2])
    with pytest.raises(CheckpointError, match="truncated.pt"):
        load_checkpoint(bad)
    open(bad, "wb").write(os.urandom(1000))
    with pytest.raises(CheckpointError, match="truncated.pt"):
        load_checkpoint(bad)
    foreign = str(tmp_path / "foreign.pt")
    torch.save({"state_dict": {}}, foreign)
    with pytest.raises(CheckpointError, match="foreign.pt is not a nanofp8 checkpoint"):
        load_checkpoint(foreign)
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        load_checkpoint(str(tmp_path / "missing.pt"))

    # ... and train.py turns it into exit status 2 with the file's name.
    out = tmp_path / "out"
    out.mkdir()
    open(out / "ckpt.pt", "wb").write(blob[:100])
    r = run("train.py", *TINY, "init_from=resume", f"out_dir={out}", "max_iters=2")
    assert r.returncode == 2 and str(out / "ckpt.pt") in r.stderr, r.stderr


@pytest.mark.parametrize("precision", ["O1", "O2"])
def test_rowwise_with_gw_hp_trains(tmp_path, capsys, precision):
    """fp8_recipe=rowwise_with_gw_hp from train.py: its name in the start-up line, and the loss
    falls. O2 keeps the high-precision weight gradient in FP8 afterwards (take_wgrad); an O3 layer
    (torchrun: test_torchrun_fp8_data_parallel_and_o3_resume's kind) casts W^T by the preset's rule."""
    from nanofp8.zero import convert_to_o3

    o3 = convert_to_o3(convert_to_fp8(torch.nn.Sequential(torch.nn.Linear(64, 32)),
                                      Recipe.from_name("rowwise_with_gw_hp", backend="cpu")))
    assert [q.granularity for q in o3[0].cast_weight()] == ["row", "tensor"]
    from nanofp8.fsdp import fp8_all_gather  # FSDP2's FP8 all-gather sends W's cast only: fp32 there

    left = fp8_all_gather(convert_to_fp8(torch.nn.Sequential(torch.nn.Linear(64, 32)),
                                         Recipe.from_name("rowwise_with_gw_hp", backend="cpu"))).fp8_all_gather_left
    assert "casts W or W^T by a rule of its own" in left["0"]
    got = train.main(TINY + [f"precision={precision}", "fp8_recipe=rowwise_with_gw_hp", "max_iters=12",
                             "lr_decay_iters=12", "eval_interval=12", f"out_dir={tmp_path}"])
    out = capsys.readouterr().out
    assert "in FP8 (rowwise_with_gw_hp (current/row/e4m3, w_t tensor, x_t hp, dy_t hp), backend=cpu;" in out
    losses = [loss for _, loss in got["losses"]]
    assert all(map(math.isfinite, losses)) and sum(losses[-3:]) < sum(losses[:3]) - 0.3, losses


def test_rowwise_with_gw_hp_is_refused_where_x_and_dy_arrive_in_fp8():
    """Sequence parallelism gathers x and dy in FP8 (mp_comm=fp8): the weight gradient could then
    not be made from them in high precision. One line, naming the way out."""
    with pytest.raises(ConfigError) as e:
        train.load_config(TINY + ["precision=O1", "fp8_recipe=rowwise_with_gw_hp", "tensor_parallel=2",
                                  "sequence_parallel=True"])
    assert str(e.value) == ("fp8_recipe=rowwise_with_gw_hp keeps x^T and dy^T in high precision, and "
                            "sequence_parallel=True gathers x and dy in FP8 (mp_comm=auto): set mp_comm=bf16, "
                            "or sequence_parallel=False, or fp8_recipe=rowwise")
    train.load_config(TINY + ["precision=O1", "fp8_recipe=rowwise_with_gw_hp", "tensor_parallel=2",
                              "sequence_parallel=True", "mp_comm=bf16"])


# ---------------------------------------------------------------- resume


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["O1", "O2"])
def test_resume_is_exact(tmp_path, precision):
    """Stopping at a checkpoint and resuming gives bit-identical losses to never stopping.
    Uses what has state beyond the weights: FP8 delayed scaling (amax histories in buffers),
    dropout (the RNG), AdamW moments (O2: FP8 m, fp16 v, fp16 master with scales), gradient
    accumulation and the LR schedule."""
    common = TINY + [f"precision={precision}", "fp8_scaling=delayed", "dropout=0.1", "gradient_accumulation_steps=2",
                     "eval_interval=4", "lr_decay_iters=12", "log_interval=100"]
    full = train.main(common + ["max_iters=12", f"out_dir={tmp_path / 'full'}"])
    first = train.main(common + ["max_iters=4", f"out_dir={tmp_path / 'stopped'}"])
    rest = train.main(common + ["max_iters=12", f"out_dir={tmp_path / 'stopped'}", "init_from=resume"])
    assert [it for it, _ in rest["losses"]] == list(range(4, 12))
    assert first["losses"] + rest["losses"] == full["losses"]  # exact float equality
    assert rest["evals"] == full["evals"][2:]  # evaluations at 8 and 12 agree too
    a = load_checkpoint(newest_checkpoint(tmp_path / "full"))["model"]
    b = load_checkpoint(newest_checkpoint(tmp_path / "stopped"))["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- FP8 vs bf16


@pytest.mark.slow
def test_fp8_matches_bf16(tmp_path):
    """Same model, data and seed: O1 (FP8 GEMMs in all block Linears) ends within 2% of bf16."""
    common = TINY + ["n_embd=64", "n_head=4", "block_size=64", "batch_size=8", "max_iters=300",
                     "lr_decay_iters=300", "warmup_iters=20", "eval_interval=300", "eval_iters=20",
                     "log_interval=1000"]
    bf16 = train.main(common + ["precision=bf16", f"out_dir={tmp_path / 'bf16'}"])["evals"][-1][2]
    fp8 = train.main(common + ["precision=O1", f"out_dir={tmp_path / 'fp8'}"])["evals"][-1][2]
    assert bf16 < 2.6, f"the bf16 baseline did not learn (val loss {bf16:.3f})"
    assert abs(fp8 - bf16) / bf16 < 0.02, f"val loss: bf16 {bf16:.4f}, O1 {fp8:.4f}"


def test_optimizer_step_refreshes_fp8_weights():
    """The fused AdamW kernel (used on CUDA) updates weights without bumping their version
    counter, which is what Fp8Linear's FP8 weight cache watches: optimizer_step must drop the
    cache, or every later forward would run on the FP8 copy of the initial weights."""
    from nanofp8.model import GPT, GPTConfig

    cfg = train.load_config(TINY + ["precision=O1"])
    model = GPT(GPTConfig(**{k: cfg[k] for k in MODEL_KEYS}))
    train.setup_precision(model, cfg, "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    x = torch.randint(0, 64, (2, 32))
    lin = model.blocks[0].mlp.c_fc
    old = lin.weight.detach().clone()
    model(x, x)[1].backward()
    train.optimizer_step(model, opt, cfg)
    h = torch.randn(5, lin.in_features)
    y = lin(h)
    err_new = (y - torch.nn.functional.linear(h, lin.weight, lin.bias)).norm()
    err_old = (y - torch.nn.functional.linear(h, old, lin.bias)).norm()
    assert err_new < err_old / 4, "Fp8Linear computed with the weights from before the step"


@pytest.mark.parametrize("precision", ["bf16", "O1"])
def test_optimizer_step_makes_its_flags_on_the_model_device(precision):
    """Called without a layout (bench.py throughput, a user's own loop), optimizer_step makes the
    flags of its one sync on the device of the model's parameters. Made on the CPU beside a CUDA
    norm, they crashed the first step on an H200 (torch.stack across devices). The meta device
    stands in for a device that is not the CPU: with every flag made there, the one copy to the
    host is what fails (meta tensors have no data), not the stack before it."""
    from nanofp8.model import GPT, GPTConfig

    cfg = train.load_config(TINY + [f"precision={precision}"])
    with torch.device("meta"):
        model = GPT(GPTConfig(**{k: cfg[k] for k in MODEL_KEYS}))
    train.setup_precision(model, cfg, "cpu")
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(NotImplementedError, match="meta"):
        train.optimizer_step(model, opt, cfg)


# ---------------------------------------------------------------- torchrun (gloo, 2 ranks)


def torchrun(*args):
    """The training losses of a run on 2 processes."""
    return logged_losses(conftest.torchrun(2, *TINY, "log_interval=1", "eval_iters=2", *args).stdout)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("precision", ["O1", "O3"])
def test_torchrun_fp8_data_parallel_and_o3_resume(tmp_path, precision):
    """FP8 gradient communication (O1) and ZeRO-sharded O3 under torchrun on CPU (gloo). O3:
    resume from the checkpoint of step 3 at the same world size: the same losses as never stopping."""
    common = [f"precision={precision}", "gradient_accumulation_steps=2", "eval_interval=3",
              "lr_decay_iters=6", "max_iters=6"]
    full = torchrun(*common, f"out_dir={tmp_path / 'full'}")
    assert len(full) == 6 and full[-1] < full[0]
    if precision == "O3":
        conftest.stopped_at(tmp_path / "full", tmp_path / "stopped", 3)
        rest = torchrun(*common, f"out_dir={tmp_path / 'stopped'}", "init_from=resume")
        assert rest == full[3:] and len(rest) == 3


# ---------------------------------------------------------------- the loop a reader follows


def test_the_loop_is_in_view():
    """train.py reads like nanoGPT's: main() holds the micro-step loop with its autocast forward and
    loss.backward(). (Its length and how many names it takes from run.py: `python bench.py design`.)"""
    import ast

    src = open(os.path.join(REPO, "train.py")).read()
    tree = ast.parse(src)
    main = next(f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "main")
    calls = [n.func.attr for n in ast.walk(main) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
    assert "backward" in calls and "no_sync" in calls
    assert any(isinstance(n, ast.With) and any(getattr(i.context_expr, "id", None) == "autocast" for i in n.items)
               for n in ast.walk(main))



# ---------------------------------------------------------------- activation checkpointing


def _steps_and_saved_bytes(args):
    """A model as train.py builds it (one process, fp32, no autocast), trained 3 steps on fixed
    batches: (losses, final weights, bytes that the first forward saved for backward outside
    torch.utils.checkpoint, counted by a saved_tensors_hooks pair)."""
    from nanofp8.layout import Layout

    cfg = train.load_config([*TINY, "dropout=0.1", *args])
    model_args = {k: cfg[k] for k in MODEL_KEYS if k != "vocab_size"} | {"vocab_size": 65}
    model = train.build_model(cfg, Layout(), model_args, None, None, lambda *a: None)[0]
    optimizer = train.build_optimizer(model, cfg, "cpu")
    g, saved, losses = torch.Generator().manual_seed(0), [], []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    torch.manual_seed(1)  # dropout's masks
    for step in range(3):
        x = torch.randint(0, 65, (4, 32), generator=g)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            _, loss = model(x, x.roll(-1, 1))
        loss.backward()
        train.optimizer_step(model, optimizer, cfg)
        losses.append(loss.item())
        first = saved[:] if step == 0 else first
    return losses, {k: v.clone() for k, v in model.state_dict().items()}, sum(first)


@pytest.mark.parametrize("args", [["precision=bf16"], ["precision=O1"], ["precision=O1", "arch=llama"],
                                  ["precision=O2"]], ids=["bf16", "O1", "O1-llama", "O2"])
def test_activation_checkpointing_trains_bit_for_bit_and_saves_less(args):
    """activation_checkpointing=block recomputes each block in backward: with dropout, three steps
    give the very losses and weights of "off" (the recomputation redraws the same masks and makes
    the same FP8 casts), and the first forward saves under 30% of the bytes for backward (the
    blocks' activations are gone, the embeddings' and the head's remain; each block's input is
    kept by checkpoint itself, outside the count; observed 12-21% with 2 blocks)."""
    off, on = (_steps_and_saved_bytes([*args, f"activation_checkpointing={ac}"]) for ac in ("off", "block"))
    assert on[0] == off[0]
    assert on[1].keys() == off[1].keys() and all(torch.equal(on[1][k], off[1][k]) for k in off[1])
    assert on[2] < 0.3 * off[2], (on[2], off[2])


def test_activation_checkpointing_refuses_what_records_every_forward_cast():
    """Delayed scaling records each cast's amax in its forward: recomputed under checkpoint, a
    layer pushes its input's and weight's amaxes twice per step (the gradient's once). The config
    check refuses the pair, and the FP8 statistics, in one line naming the keys."""
    from torch.utils.checkpoint import checkpoint

    from nanofp8.fp8 import Fp8Linear

    counts = []
    for recompute in (False, True):
        torch.manual_seed(0)
        lin = Fp8Linear(32, 32, recipe=Recipe(scaling="delayed", backend="cpu"))
        x = torch.randn(4, 32, requires_grad=True)
        (checkpoint(lin, x, use_reentrant=False) if recompute else lin(x)).sum().backward()
        counts.append(lin.history_count.tolist())
    assert counts == [[1, 1, 1], [2, 2, 1]]
    for args, says in ((["fp8_recipe=delayed"], "push every amax into the history a second time"),
                       (["fp8_stats_interval=5"], "count every forward cast twice"),
                       (["activation_checkpointing=layer"], "'activation_checkpointing' must be one of ['off', 'block']")):
        with pytest.raises(ConfigError) as e:
            train.load_config([*TINY, "precision=O1", "activation_checkpointing=block", *args])
        assert says in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert train.load_config([*TINY, "activation_checkpointing=block", "fp8_recipe=delayed", "precision=O1",
                              "activation_checkpointing=off"])["activation_checkpointing"] == "off"


def test_no_logits_outlive_their_micro_step(tmp_path, monkeypatch):
    """train.py keeps the loss of a micro-step, never its logits (2 B x tokens x vocab: 0.77 GiB at
    GPT-2 124M's 8 x 1024 tokens): a logits tensor still referenced when the next forward starts
    (the next micro-step's, or an evaluation batch's) would sit beside the new one at the peak."""
    import weakref

    from nanofp8.model import GPT

    forward, alive = GPT.forward, []

    def watched(self, idx, targets=None):
        held = [r for r in alive if r() is not None]
        assert not held, f"{len(held)} logits of an earlier forward still referenced"
        logits, loss = forward(self, idx, targets)
        alive.append(weakref.ref(logits))
        return logits, loss

    monkeypatch.setattr(GPT, "forward", watched)
    train.main(TINY + ["gradient_accumulation_steps=3", "max_iters=2", "eval_interval=2",
                       f"out_dir={tmp_path}"])
    assert len(alive) >= 3 * 2 + 2 * 2  # every micro-step and evaluation batch was watched


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_the_weight_check_reads_the_weights_not_their_fp8_casts(level):
    """run.weights_finite (every step) reads the weights and scales, not the FP8 W and W^T the
    step cast from them (a float copy each, more bytes than the weights) nor the kept bf16 copies
    of the biases (a launch each): a non-finite weight (NaN, -inf) is still seen, in any parameter."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import bench
    from nanofp8.layout import Layout
    from nanofp8.model import GPTConfig
    from nanofp8.run import weights_finite

    model, opt, _ = bench.build(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=64), level)
    assert any(b.element_size() == 1 for b in model.buffers())  # the kept casts exist

    class Fp8Reads(TorchDispatchMode):
        n, seen = 0, set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            leaves = torch.utils._pytree.tree_leaves((args, kwargs))
            self.n += any(isinstance(t, torch.Tensor) and t.is_floating_point() and t.element_size() == 1
                          for t in leaves)
            self.seen |= {id(t) for t in leaves if isinstance(t, torch.Tensor)}
            return func(*args, **(kwargs or {}))

    layout = Layout(device="cpu")
    with Fp8Reads() as reads:
        assert weights_finite(model, layout).item() == 1.0
    assert reads.n == 0
    kept = [b for name, b in model.named_buffers() if name.endswith("gemm_bias_kept")]
    assert kept and not {id(b) for b in kept} & reads.seen
    for p in model.parameters():
        with torch.no_grad():
            keep = p.view(-1)[0].clone()
            for bad in (float("nan"), float("-inf")):
                p.view(-1)[0] = bad
                assert weights_finite(model, layout).item() == 0.0, (p.shape, bad)
            p.view(-1)[0] = keep
    assert weights_finite(model, layout).item() == 1.0
