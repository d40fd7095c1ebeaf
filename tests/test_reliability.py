"""Bad input and faults: every mistake is a clear error naming the key or file, nothing wrong
passes silently, nothing hangs, no good checkpoint is lost.

Each test is one case of issue #14 (the numbers in the comments), checked the cheapest way that
still goes through the code a user runs: load_config / main() in-process for the config and resume
rules, cli() for exit statuses, one subprocess per script for the command line itself, and one
torchrun launch (gloo, 2 ranks, hard timeout) for what only several processes can show: each
rank's dropout stream surviving a resume, and a frozen rank stopping the job with its name."""

import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import types

import numpy as np
import pytest
import torch

import sample
import train
from conftest import REPO, TINY, newest_checkpoint, run
from nanofp8 import data as data_module
from nanofp8.configurator import RECIPE_KEYS, ConfigError, read_dataset_meta
from nanofp8.ckptfile import CheckpointError, load_checkpoint, save_checkpoint
from nanofp8.fp8 import RECIPES
from nanofp8.outdir import begin_set, commit_set

from nanofp8.layout import is_collective_failure
from nanofp8.run import MODEL_KEYS, TrainingStopped

pytestmark = pytest.mark.usefixtures("shakespeare")

SHAKESPEARE = os.path.join(REPO, "data", "shakespeare_char")


@pytest.fixture(scope="module")
def o2_run(tmp_path_factory):
    """A good O2 checkpoint at iteration 2 (fp16 v), to resume from in several ways."""
    out = tmp_path_factory.mktemp("o2") / "out"
    train.main(TINY + ["precision=O2", "max_iters=2", "eval_interval=2", f"out_dir={out}"])
    return out


def copy_run(src, dst, edit=None):
    """out_dir with (a complete checkpoint set of) src's newest checkpoint, changed by edit(ckpt) first."""
    ckpt = load_checkpoint(newest_checkpoint(src))
    if edit:
        edit(ckpt)
    write_set(dst, ckpt)
    return dst


def write_set(out_dir, ckpt, name="ckpt.pt"):
    """A complete one-file checkpoint set of `ckpt` in out_dir, as train.py writes one."""
    path = begin_set(str(out_dir), ckpt["iter_num"])
    record = save_checkpoint(ckpt, os.path.join(path, name))
    layout = {"precision": ckpt["config"]["precision"], "tensor_parallel": 1, "pipeline_parallel": 1,
              "zero_world": None, "world_size": 1}
    return commit_set(path, ckpt["iter_num"], {name: record}, layout, config=ckpt["config"])


# ---------------------------------------------------------------- 1, 4, 11: what a resume must keep


def test_o2_v_format_is_recorded_and_checked(o2_run):
    """1: v saved as fp16 is never read as E4M3 sqrt(v): the optimizer state says its format,
    and train.py refuses the other one naming both."""
    state = load_checkpoint(newest_checkpoint(o2_run))["optimizer"]
    assert state["v_format"] == "fp16"
    cfg = train.load_config(TINY + ["precision=O2", "o2_v_format=fp8"])
    from nanofp8.model import GPT, GPTConfig

    model = GPT(GPTConfig(**{k: cfg[k] for k in MODEL_KEYS}))
    train.setup_precision(model, cfg, "cpu")
    opt = train.build_optimizer(model, cfg, "cpu")
    with pytest.raises(ValueError, match="v_format='fp16'.*v_format='fp8'"):
        opt.load_state_dict(state)
    with pytest.raises(CheckpointError, match="o2_v_format='fp16'; resuming with o2_v_format='fp8'"):
        train.main(TINY + ["precision=O2", "o2_v_format=fp8", "max_iters=4", "init_from=resume",
                           f"out_dir={o2_run}"])


def test_resume_refuses_another_seed(o2_run):
    """4: the batch of iteration i is a function of seed and i: another seed is another run."""
    args = TINY + ["precision=O2", "max_iters=4", "init_from=resume", f"out_dir={o2_run}"]
    with pytest.raises(CheckpointError, match="written with seed=1337; resuming with seed=7"):
        train.main(args + ["seed=7"])


def test_resume_at_another_precision_names_both(o2_run, tmp_path, capsys):
    """11: not "missing keys": another precision is converted (nanofp8/checkpoint.py), and the
    log line names both levels and what restarts."""
    out = copy_run(o2_run, tmp_path / "o1", lambda c: None)
    train.main(TINY + ["precision=O1", "max_iters=4", "init_from=resume", f"out_dir={out}"])
    log = capsys.readouterr().out
    assert "note: converting the checkpoint" in log and "precision=O2" in log and "precision=O1" in log
    with pytest.raises(CheckpointError, match="written with seed=1337; resuming with seed=7"):
        train.main(TINY + ["precision=bf16", "max_iters=4", "init_from=resume", f"out_dir={out}", "seed=7"])


def test_resume_refuses_another_dataset(o2_run, tmp_path):
    """4: a checkpoint of another dataset does not continue on this one."""
    out = copy_run(o2_run, tmp_path / "other", lambda c: c["config"].update(dataset="openwebtext"))
    with pytest.raises(CheckpointError, match="dataset='openwebtext'; resuming with dataset='shakespeare_char'"):
        train.main(TINY + ["precision=O2", "max_iters=4", "init_from=resume", f"out_dir={out}"])


# ---------------------------------------------------------------- 7: non-finite weights, skipped steps


def test_nonfinite_checkpoint_is_refused(o2_run, tmp_path):
    def plant_inf(ckpt):
        ckpt["model"]["tok_emb.weight"][3, 5] = float("inf")

    out = copy_run(o2_run, tmp_path / "inf", plant_inf)
    with pytest.raises(CheckpointError, match=r"non-finite values in \['tok_emb.weight'\]"):
        train.main(TINY + ["precision=O2", "max_iters=4", "init_from=resume", f"out_dir={out}"])


def test_update_to_nonfinite_weights_stops_and_keeps_checkpoint(o2_run, tmp_path, monkeypatch):
    """An update that leaves a weight non-finite (a stand-in optimizer step writes an inf, as a
    bit flip or an optimizer bug would) stops the run at once; ckpt.pt stays the good one."""
    out = copy_run(o2_run, tmp_path / "bad")
    real_step = train.optimizer_step

    def step_then_corrupt(model, optimizer, cfg, layout, *rest):
        result = real_step(model, optimizer, cfg, layout, *rest)
        with torch.no_grad():
            model.blocks[1].mlp.c_proj.bias[7] = float("nan")
        return result

    monkeypatch.setattr(train, "optimizer_step", step_then_corrupt)
    with pytest.raises(TrainingStopped, match=r"update of iteration 2 \(learning rate .*\) made weights "
                       r"non-finite \(blocks.1.mlp.c_proj.bias\).*the last good checkpoint is .*ckpt-00000002 "
                       r"\(iter 2\)"):
        train.main(TINY + ["precision=O2", "max_iters=8", "eval_interval=2", "init_from=resume", f"out_dir={out}"])
    assert load_checkpoint(newest_checkpoint(out))["iter_num"] == 2


def test_skipped_steps_stop_the_run_and_never_save(tmp_path, capsys):
    """bf16 with lr 1e30: the weights stay finite (fp32 holds 1e30) but every forward overflows,
    so every gradient is NaN and every step is skipped. The run stops after max_skipped_steps and
    the evaluation with a NaN loss does not replace the last good checkpoint."""
    out = tmp_path / "out"
    common = TINY + ["precision=bf16", "eval_interval=2", "decay_lr=False", f"out_dir={out}"]
    train.main(common + ["max_iters=2"])
    with pytest.raises(TrainingStopped, match=r"3 steps in a row skipped .*max_skipped_steps=3"):
        train.main(common + ["max_iters=40", "init_from=resume", "learning_rate=1e30", "max_skipped_steps=3"])
    assert "not saving a checkpoint: the val loss is nan" in capsys.readouterr().out
    assert load_checkpoint(newest_checkpoint(out))["iter_num"] == 2
    with pytest.raises(SystemExit) as e:  # as a command: exit status 1, one line
        train.cli(common + ["max_iters=40", "init_from=resume", "learning_rate=1e30", "max_skipped_steps=1"])
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.startswith("error: 1 steps in a row skipped") and err.count("\n") == 1
    with pytest.raises(ConfigError, match="'learning_rate' must be finite"):
        train.load_config(["learning_rate=1e400"])


# ---------------------------------------------------------------- 2, 4, 6, 9: config values


@pytest.mark.parametrize("args, match", [
    (["fp8_margin=24"], "'fp8_margin' must be in \\[0, 8\\]"),  # 2
    (["fp8_margin=-1"], "'fp8_margin' must be in \\[0, 8\\]"),
    (["n_layer=0"], "'n_layer' must be >= 1, got 0"),  # 4
    (["n_head=0"], "'n_head' must be >= 1, got 0"),  # 9
    (["n_embd=-8"], "'n_embd' must be >= 1"),
    (["batch_size=-1"], "'batch_size' must be positive"),
    (["n_embd=30", "n_head=4"], "n_embd=30 is not divisible by n_head=4"),
    (["dropout=1.0"], "'dropout' must be in \\[0, 1\\)"),
    (["dropout=-0.1"], "'dropout' must be in \\[0, 1\\)"),
    (["learning_rate=-1e-3"], "'learning_rate' must be finite and >= 0"),
    (["beta2=1.0"], "'beta2' must be in \\[0, 1\\)"),
    (["fp8_history_len=0"], "'fp8_history_len' must be >= 1"),
    (["dist_timeout=0"], "'dist_timeout' must be > 0"),
    (["out_dir="], "'out_dir' must be a directory name"),
    (["out_dir=README.md"], "'out_dir' must be a directory \\(it is an existing file\\)"),
    (["precision=O3", "o2_fused=True"], "o2_fused=True compiles O2's optimizer step; precision=O3 has no such "
                                        "step .*: set o2_fused=False"),
])
def test_config_values(args, match):
    with pytest.raises(ConfigError, match=match):
        train.load_config(TINY + args)
    train.load_config(TINY + ["precision=O1", "fp8_margin=8", "dropout=0.5", "beta2=0.999"])  # the edges that are fine


@pytest.mark.parametrize("args, says", [
    (["fp8_recipe=mxfp8"], "precision=bf16 has no FP8 layers, which fp8_recipe=mxfp8 would set: use "
                           "precision=O1, O2 or O3, or drop fp8_recipe"),  # (not the preset's keys)
    (["fp8_margin=2"], "precision=bf16 has no FP8 layers, which fp8_margin=2 would set: use "
                       "precision=O1, O2 or O3, or drop fp8_margin"),
    (["fp8_recipe=rowwise", "fp8_scaling=current", "fp8_formats=hybrid"],  # against the preset: current is rowwise's
     "which fp8_recipe=rowwise, fp8_formats=hybrid would set: use precision=O1, O2 or O3, or drop fp8_recipe "
     "and fp8_formats"),
    (["fp8_scaling=delayed"], "or drop fp8_scaling"),
    (["fp8_lm_head=True"], "or drop fp8_lm_head"),
    (["fp8_strict=True"], "or drop fp8_strict"),
    (["fp8_stats_interval=5"], "or drop fp8_stats_interval"),
])
def test_fp8_keys_at_bf16_are_refused(args, says):
    """#41: at bf16 an FP8 setting changes nothing, and is refused, as fp8_attention=True is. What
    every level takes (fp8_backend: bench.py builds each level with one) and the recipe's own values
    set by hand pass."""
    with pytest.raises(ConfigError) as e:
        train.load_config(TINY + args)
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)
    train.load_config(TINY + ["fp8_backend=emulate", "fp8_scaling=current", "fp8_granularity=tensor"])
    tensorwise = RECIPES["tensorwise"]  # the preset a bf16 run's recipe keys are held to: train.py's defaults
    assert all(train.DEFAULTS[key] == getattr(tensorwise, field) for key, field in RECIPE_KEYS.items())
    train.load_config(TINY + ["precision=O1"] + args)


@pytest.mark.parametrize("args, says", [
    (["fp8_granularity=tensor"], "fp8_granularity=tensor would give one such scale to a whole tensor: "
                                 "drop fp8_granularity, or use fp8_recipe=tensorwise"),
    (["fp8_granularity=row"], "fp8_granularity=row would give one such scale to a whole row: "
                              "drop fp8_granularity, or use fp8_recipe=rowwise"),
    (["fp8_scaling=delayed"], "fp8_scaling=delayed would take it from an amax history: drop fp8_scaling, "
                              "or use fp8_recipe=delayed"),
    (["fp8_scaling=delayed", "fp8_granularity=tensor"], "drop fp8_granularity and fp8_scaling"),
])
def test_mx_with_another_granularity_or_scaling_is_refused(args, says, capsys):
    """#41: fp8_recipe=mxfp8 is OCP MX's rule on 1x32 tiles; its E8M0 scale per tensor or row, or
    from an amax history, is not MX (the log said "mx" all the same): refused in one line naming
    both keys, with exit status 2."""
    mx = "fp8_recipe=mxfp8 runs OCP MX's scales, one E8M0 power of two per 1x32 tile from that tile's own amax"
    with pytest.raises(ConfigError) as e:
        train.load_config(TINY + ["precision=O1", "fp8_recipe=mxfp8"] + args)
    assert str(e.value).startswith(mx) and says in str(e.value) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(SystemExit) as e:
        train.cli(TINY + ["precision=O1", "fp8_recipe=mxfp8", "max_iters=0"] + args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"error: {mx}") and err.count("\n") == 1, err
    # MX's own granularity, and the keys MX takes, pass
    cfg = train.load_config(TINY + ["precision=O1", "fp8_recipe=mxfp8", "fp8_granularity=block",
                                    "fp8_scaling=current", "fp8_formats=hybrid", "fp8_margin=1"])
    assert train.build_recipe(cfg, "cpu").grid == "mx"


def test_cuda_without_cuda(monkeypatch):
    """9: a stand-in for a machine without CUDA (the test machine may have one)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ConfigError, match="'device' is 'cuda:1', but this machine has 0 CUDA devices"):
        train.load_config(TINY + ["device=cuda:1"])


def test_fp8_with_no_fp8_linear(tmp_path):
    """4: widths that are not multiples of 16 leave no Linear in FP8: an error, not an "FP8" run
    that is bf16 throughout."""
    with pytest.raises(ConfigError, match="no block Linear can run in FP8.*n_embd=40.*multiples of 16"):
        train.main(TINY + ["n_embd=40", "n_head=2", "precision=O1", "fp8_backend=torch", "max_iters=2",
                           f"out_dir={tmp_path}"])


def test_vocab_size_against_the_dataset(tmp_path, capsys):
    """4: vocab_size is not silently replaced by the dataset's: too small is an error, larger pads."""
    with pytest.raises(ConfigError, match="'vocab_size' is 50, but dataset 'shakespeare_char' has 84 tokens"):
        train.main(TINY + ["vocab_size=50", "max_iters=2", f"out_dir={tmp_path}"])
    train.main(TINY + ["vocab_size=96", "max_iters=2", "eval_interval=2", f"out_dir={tmp_path}"])
    assert "note: vocab_size=96 (the dataset's 84 tokens, padded" in capsys.readouterr().out
    assert load_checkpoint(newest_checkpoint(tmp_path))["model_args"]["vocab_size"] == 96


def test_block_size_against_the_dataset(tmp_path):
    """6: a window longer than a split is an error naming the file, before any model is built."""
    with pytest.raises(ConfigError, match=r"block_size=600000 is too long for .*val.bin: it holds 504,863"):
        train.main(TINY + ["block_size=600000", "max_iters=0", "eval_iters=1", f"out_dir={tmp_path}"])


def test_gradient_accumulation_says_what_to_pass(monkeypatch, capsys):
    """10: under torchrun (2 processes, checked before the process group exists) the error says
    which values divide, and only rank 0 prints it."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="processes \\(2; .*pass gradient_accumulation_steps=4 or 6"):
        train.main(TINY + ["gradient_accumulation_steps=5", "max_iters=2"])
    with pytest.raises(ConfigError, match="pass gradient_accumulation_steps=2$"):
        train.main(TINY + ["gradient_accumulation_steps=1", "max_iters=2"])
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")  # rank 1 on rank 0's node (the first rank of another node says its own)
    with pytest.raises(SystemExit) as e:
        train.cli(TINY + ["gradient_accumulation_steps=5", "max_iters=2"])
    assert e.value.code == 2 and capsys.readouterr().err == ""


@pytest.mark.slow
def test_exit_statuses(tmp_path, capsys):
    """11: an unknown dataset is a config error (2) like the others, in one line naming it."""
    with pytest.raises(SystemExit) as e:
        train.cli(TINY + ["dataset=shakespeare", "max_iters=2", f"out_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: config key 'dataset': unknown dataset 'shakespeare'")
    assert "'shakespeare_char'" in err and err.count("\n") == 1
    r = run("train.py", *TINY, "n_layer=0")  # and through the real command line
    assert r.returncode == 2 and r.stderr.strip() == "error: config key 'n_layer' must be >= 1, got 0"


# ---------------------------------------------------------------- 3, 9, 11: sample.py


@pytest.mark.parametrize("arg, match", [
    ("--temperature=-0.5", "'temperature' must be >= 0"),
    ("--max_new_tokens=-5", "'max_new_tokens' must be >= 1"),
    ("--top_k=-5", "'top_k' must be >= 0"),
    ("--start=FILE:/nonexistent/prompt.txt", "'start': no prompt file '/nonexistent/prompt.txt'"),
])
def test_sample_arguments(arg, match, tmp_path):
    """Checked before the checkpoint is read (out_dir here has none)."""
    with pytest.raises(ConfigError, match=match):
        sample.main([f"--out_dir={tmp_path}", arg])


@pytest.mark.slow
def test_sample_command_line_and_tokenizer():
    r = run("sample.py", "--temperature=-0.5")
    assert r.returncode == 2 and "'temperature' must be >= 0" in r.stderr
    # No tables for a character model: say how to recreate them, not "install tiktoken".
    with pytest.raises(ConfigError, match="meta.json is missing and a vocabulary of 84 tokens is not GPT-2 BPE"):
        sample.load_tokenizer("no_such_dataset", 84)
    encode, decode = sample.load_tokenizer("shakespeare_char", 84)
    assert decode(encode("ROMEO: hi")) == "ROMEO: hi"


# ---------------------------------------------------------------- 9, 13: dataset metadata


def test_dataset_meta_is_json_and_old_pickles_are_read_safely(tmp_path):
    meta = read_dataset_meta(SHAKESPEARE)  # written by prepare.py
    assert meta["vocab_size"] == 84 and len(meta["itos"]) == 84 and meta["itos"][0] == "\n"
    assert os.path.exists(os.path.join(SHAKESPEARE, "meta.json"))
    assert not os.path.exists(os.path.join(SHAKESPEARE, "meta.pkl"))

    # An old meta.pkl of plain dicts still loads, in the new layout (its token files uint16).
    old = {"vocab_size": 3, "itos": {0: "a", 1: "b", 2: "c"}, "stoi": {"a": 0, "b": 1, "c": 2}}
    (tmp_path / "meta.pkl").write_bytes(pickle.dumps(old))
    assert read_dataset_meta(str(tmp_path)) == {"vocab_size": 3, "itos": ["a", "b", "c"], "dtype": "uint16"}

    # A planted one does not run its code.
    planted = tmp_path / "planted"

    class Payload:
        def __reduce__(self):
            return (open, (str(planted), "w"))

    (tmp_path / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 3, "x": Payload()}))
    with pytest.raises(ConfigError, match=r"meta.pkl .*it refers to the Python object \S*open"):
        read_dataset_meta(str(tmp_path))
    assert not planted.exists()

    # Truncated, corrupt: errors naming the file.
    (tmp_path / "meta.pkl").write_bytes(pickle.dumps(old)[:20])
    with pytest.raises(ConfigError, match=f"cannot read dataset metadata {tmp_path}/meta.pkl"):
        read_dataset_meta(str(tmp_path))
    (tmp_path / "meta.json").write_text('{"vocab_size": 3, "itos": ["a", "b"')
    with pytest.raises(ConfigError, match=f"cannot read dataset metadata {tmp_path}/meta.json"):
        read_dataset_meta(str(tmp_path))
    (tmp_path / "meta.json").write_text('{"vocab_size": 3, "itos": ["a", "b"]}')
    with pytest.raises(ConfigError, match="'itos' must list one string per token id"):
        read_dataset_meta(str(tmp_path))


def _write_dataset(root, name, ids, meta):
    folder = root / "data" / name
    folder.mkdir(parents=True)
    for split in ("train", "val"):
        ids.tofile(folder / f"{split}.bin")
    (folder / "meta.json").write_text(json.dumps(meta))


def _batch_of_whole_file(dataset, ids, vocab_size):
    """open_splits, check_tokens and get_batch on a split of block_size + 1 tokens, whose one
    window is the whole file: (inputs, targets) as lists."""
    layout = types.SimpleNamespace(master=True, barrier=lambda: None)
    data = data_module.open_splits(dataset, len(ids) - 1, layout)
    data_module.check_tokens(data, vocab_size)
    x, y = data_module.get_batch(data["train"], 1, len(ids) - 1, torch.Generator().manual_seed(0), "cpu")
    return x[0].tolist(), y[0].tolist()


def test_token_files_in_uint32_above_65536_tokens_and_uint16_without_the_key(tmp_path, monkeypatch):
    """A vocabulary of 70,000 tokens: uint32 files (meta.json "dtype": "uint32"), whose batches are
    the ids written; the same vocabulary declared uint16 is refused (its ids would wrap); a
    meta.json without "dtype" (files from before it) reads uint16."""
    monkeypatch.setattr(data_module, "REPO", str(tmp_path))
    big = np.array([0, 65535, 65536, 69999, 12, 65537, 3, 69998, 1], dtype=np.uint32)
    _write_dataset(tmp_path, "big", big, {"vocab_size": 70000, "dtype": "uint32"})
    x, y = _batch_of_whole_file("big", big, 70000)
    assert x == big[:-1].tolist() and y == big[1:].tolist()

    (tmp_path / "data" / "big" / "meta.json").write_text(json.dumps({"vocab_size": 70000, "dtype": "uint16"}))
    with pytest.raises(ConfigError, match="vocab_size=70000 does not fit uint16"):
        data_module.open_splits("big", len(big) - 1, types.SimpleNamespace(master=True, barrier=lambda: None))
    (tmp_path / "data" / "big" / "meta.json").write_text(json.dumps({"vocab_size": 70000, "dtype": "int8"}))
    with pytest.raises(ConfigError, match="'dtype' is 'int8'"):
        read_dataset_meta(str(tmp_path / "data" / "big"))

    small = np.array([5, 0, 65535, 7, 1, 2], dtype=np.uint16)
    _write_dataset(tmp_path, "old", small, {"vocab_size": 65536})
    x, y = _batch_of_whole_file("old", small, 65536)
    assert x == small[:-1].tolist() and y == small[1:].tolist()

    # A uint32 file of a whole number of uint16 ids but not of uint32 ones: cut short.
    _write_dataset(tmp_path, "cut", np.arange(3, dtype=np.uint16), {"vocab_size": 70000, "dtype": "uint32"})
    with pytest.raises(ConfigError, match="not a whole number of uint32 token ids"):
        data_module.check_dataset("cut")


def test_checkpoints_keep_rope_scaling_and_old_ones_without_it_load(tmp_path, capsys):
    """model_args holds rope_scaling: a resume builds the checkpoint's RoPE whatever the command
    line says, and a checkpoint from before the field (no rope_scaling in model_args or config)
    resumes and loads for inference as plain RoPE."""
    from nanofp8.checkpoint import load_for_inference

    scaling = {"rope_type": "llama3", "factor": 2.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
    llama = TINY + ["arch=llama", "eval_interval=2"]
    out = tmp_path / "scaled"
    train.main(llama + ["max_iters=2", f"out_dir={out}", f"rope_scaling={scaling}"])
    assert load_checkpoint(newest_checkpoint(out))["model_args"]["rope_scaling"] == scaling
    train.main(llama + ["max_iters=4", f"out_dir={out}", "init_from=resume"])
    assert "rope_scaling=" in capsys.readouterr().out  # the checkpoint's, over the default None
    ckpt = load_checkpoint(newest_checkpoint(out))
    assert ckpt["iter_num"] == 4 and ckpt["model_args"]["rope_scaling"] == scaling
    model, _ = load_for_inference(str(out), "cpu")
    assert model.config.rope_scaling == scaling

    def before_the_field(ckpt):
        del ckpt["model_args"]["rope_scaling"], ckpt["config"]["rope_scaling"]

    old = copy_run(out, tmp_path / "old", before_the_field)
    train.main(llama + ["max_iters=6", f"out_dir={old}", "init_from=resume"])
    assert load_checkpoint(newest_checkpoint(old))["model_args"]["rope_scaling"] is None
    copy_run(out, tmp_path / "old2", before_the_field)
    model, _ = load_for_inference(str(tmp_path / "old2"), "cpu")
    assert model.config.rope_scaling is None


@pytest.mark.slow
def test_checkpoints_keep_n_kv_head_and_old_ones_without_it_load(tmp_path, capsys):
    """model_args holds n_kv_head: a resume builds the checkpoint's grouped-query attention whatever
    the command line says (with a note, as for every model key), and so does sample.py's loader; a
    checkpoint from before the field (no n_kv_head in model_args or config) resumes and loads as
    multi-head attention, one key/value head per query head."""
    from nanofp8.checkpoint import load_for_inference

    llama = TINY + ["arch=llama", "eval_interval=2"]  # n_head=2
    with pytest.raises(ConfigError, match=r"^n_kv_head=3 must divide n_head=2 \(0: n_head key/value heads"):
        train.load_config(llama + ["n_kv_head=3"])
    out = tmp_path / "gqa"
    train.main(llama + ["max_iters=2", f"out_dir={out}", "n_kv_head=1"])
    assert load_checkpoint(newest_checkpoint(out))["model_args"]["n_kv_head"] == 1
    train.main(llama + ["max_iters=4", f"out_dir={out}", "init_from=resume"])
    assert "note: n_kv_head=1 from the checkpoint overrides 0" in capsys.readouterr().out
    ckpt = load_checkpoint(newest_checkpoint(out))
    assert ckpt["iter_num"] == 4 and ckpt["model_args"]["n_kv_head"] == 1
    model, _ = load_for_inference(str(out), "cpu")
    assert model.config.kv_heads == 1 and model.blocks[0].attn.c_attn.weight.shape == (64, 32)  # 2 + 1 + 1 heads

    def before_the_field(ckpt):
        del ckpt["model_args"]["n_kv_head"], ckpt["config"]["n_kv_head"]

    train.main(llama + ["max_iters=2", f"out_dir={tmp_path / 'mha'}"])
    old = copy_run(tmp_path / "mha", tmp_path / "old", before_the_field)
    train.main(llama + ["max_iters=4", f"out_dir={old}", "init_from=resume"])
    assert load_checkpoint(newest_checkpoint(old))["model_args"]["n_kv_head"] == 0
    copy_run(tmp_path / "mha", tmp_path / "old2", before_the_field)
    model, _ = load_for_inference(str(tmp_path / "old2"), "cpu")
    assert model.config.kv_heads == 2 and model.blocks[0].attn.c_attn.weight.shape == (96, 32)


# ---------------------------------------------------------------- 11, 12: checkpoint files


def test_checkpoint_errors_do_not_advise_weights_only_false(tmp_path):
    path = tmp_path / "ckpt.pt"
    path.write_bytes(os.urandom(4000))
    with pytest.raises(CheckpointError, match="is not a nanofp8 checkpoint: truncated or corrupt") as e:
        load_checkpoint(str(path))
    assert "weights_only" not in str(e.value)

    class Payload:
        def __reduce__(self):
            return (print, ("payload ran",))

    torch.save({"format": "nanofp8-ckpt-1", "x": Payload()}, str(path))
    with pytest.raises(CheckpointError, match=r"not a nanofp8 checkpoint: it holds Python objects \(print\)") as e:
        load_checkpoint(str(path))
    assert "weights_only" not in str(e.value)


def test_stale_temp_files_are_removed(tmp_path):
    """12: what a killed writer left is removed at the next save; a live writer's file is not."""
    path = str(tmp_path / "ckpt.pt")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = os.getppid()  # the process that started pytest: running
    for pid in (dead.pid, live):
        open(f"{path}.tmp.{pid}", "wb").write(b"half a checkpoint")
    save_checkpoint({"model": {}, "model_args": {}, "config": {}, "iter_num": 1}, path)
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt.pt", f"ckpt.pt.tmp.{live}"])


# ---------------------------------------------------------------- 5, 8: torchrun (gloo, 2 ranks)

WORKER = """
import json, os, signal, socket, sys
from datetime import timedelta
sys.path.insert(0, {repo!r})
import torch, train
from nanofp8.checkpoint import find_checkpoint
from nanofp8.ckptfile import load_checkpoint

out, tiny = {out!r}, {tiny!r}
rank = int(os.environ["RANK"])
open(os.path.join(out, f"pid{{rank}}"), "w").write(str(os.getpid()))
# Several train.main() in one process: each needs a fresh rendezvous store, or the second process
# group would meet the first one's keys (torch names groups from 0 again after a destroy). Rank 0
# picks a free port for each run and passes it on through torchrun's own store.
agent = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                   is_master=False, timeout=timedelta(seconds=120))
runs = iter(range(100))


def fresh_store():
    key = f"nanofp8_test_port_{{next(runs)}}"
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            agent.set(key, str(s.getsockname()[1]))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=agent.get(key).decode(),
                      TORCHELASTIC_USE_AGENT_STORE="False")


# 8: O3 with dropout, stopped at iteration 2 and resumed: every rank as if it never stopped.
common = tiny + ["precision=O3", "dropout=0.1", "gradient_accumulation_steps=2", "eval_interval=2",
                 "lr_decay_iters=4", "log_interval=100"]
fresh_store()
full = train.main(common + ["max_iters=4", f"out_dir={{out}}/full"])
fresh_store()
first = train.main(common + ["max_iters=2", f"out_dir={{out}}/stopped"])
fresh_store()
rest = train.main(common + ["max_iters=4", f"out_dir={{out}}/stopped", "init_from=resume"])
a = load_checkpoint(find_checkpoint(f"{{out}}/full")[0].file("ckpt.pt"))["model"]
b = load_checkpoint(find_checkpoint(f"{{out}}/stopped")[0].file("ckpt.pt"))["model"]
same = all(torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)) for k in a)
json.dump(dict(full=full["losses"], resumed=first["losses"] + rest["losses"],
               evals=[full["evals"], rest["evals"]],
               same_weights=same), open(f"{{out}}/rank{{rank}}.json", "w"))
# 5: rank 1 freezes in the middle of training (at its 8th batch); rank 0 must give up and name it.
if rank == 1:
    draw, draws = train.get_batch, [0]

    def get_batch(*a, **k):
        draws[0] += 1
        if draws[0] == 8:
            os.kill(os.getpid(), signal.SIGSTOP)
        return draw(*a, **k)

    train.get_batch = get_batch
fresh_store()
train.cli(tiny + ["precision=O1", "gradient_accumulation_steps=2", "max_iters=1000", "eval_interval=1000",
                  "dist_timeout=4", f"out_dir={{out}}/hang"])
"""


@pytest.mark.slow
@pytest.mark.dist
def test_torchrun_dropout_resume_and_frozen_rank(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(repo=REPO, out=str(tmp_path), tiny=TINY))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    lines = []

    def read():
        for line in proc.stdout:
            lines.append(line)

    threading.Thread(target=read, daemon=True).start()
    deadline = time.time() + 300  # the hard limit (about 60 s on 2 idle cores)
    wanted = "a collective did not complete"
    try:
        while time.time() < deadline and proc.poll() is None and not any(wanted in ln for ln in lines):
            time.sleep(0.2)
    finally:
        for rank in (0, 1):  # rank 1 is stopped: torchrun would wait 30 s before its SIGKILL
            pid_file = tmp_path / f"pid{rank}"
            if pid_file.exists():
                try:
                    os.kill(int(pid_file.read_text()), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        proc.kill()
        proc.wait(timeout=60)
    log = "".join(lines)[-4000:]
    error = next((ln for ln in lines if wanted in ln), None)
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}.json").exists(), log
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["resumed"] == got["full"], f"rank {rank}: {got}"  # each rank's local losses
        assert got["evals"][1] == got["evals"][0][2:] and got["same_weights"], f"rank {rank}"
    assert error is not None, log
    assert error.startswith("error: rank 0: a collective did not complete within dist_timeout=4s; "
                            "rank 1 not answering: stopped, hung or dead"), error


@pytest.mark.parametrize("message", [
    "Timed out waiting 4000ms for recv operation to complete",  # gloo, in a collective
    "Application timeout caused pair closure",  # gloo, the peer's pair closed at the timeout (seen in CI)
    "Connection reset by peer", "Connection closed by peer [127.0.0.1]:1234", "Broken pipe"])
def test_every_gloo_timeout_message_is_a_collective_failure(message, monkeypatch):
    """5: whichever way gloo words it, a collective that timed out is named as one, not a crash."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    assert is_collective_failure(RuntimeError(message))
    assert not is_collective_failure(RuntimeError("shape mismatch in mm"))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    assert not is_collective_failure(RuntimeError(message))
