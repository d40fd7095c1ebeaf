"""Checkpoints a user can trust with days of work: every fault around a checkpoint is one clear
line and an exit status, and no fault or mistake loses the last good checkpoint.

What is checked, each the cheapest way that still goes through the code a user runs (train.main
or train.cli in-process on the tiny model, a subprocess or a torchrun launch where only those
show it):
  * checkpoint sets: a manifest written last, the newest complete set read, partial, broken and
    stale sets ignored with a note, older sets pruned; files of older versions still read;
  * a save never writes a diverged state, and the stop line names the set that is good;
  * no run replaces work it did not start from: the refusal without init_from=resume, the lock
    (held, stale), init_from=DIR never writing into DIR;
  * integrity: a flipped bit in a checkpoint or an export is found and named;
  * what is checked before training: out_dir writable with room, data files, meta.json;
  * the remaining faults: Ctrl-C and SIGTERM (in training, in a save or an export, under
    torchrun), a full disk, a rank that never joins, a config error on another node, ranks with
    different settings, a damaged fp8_stats.jsonl, resumes with nothing to do, sample.py's and
    export.py's misuses."""

import builtins
import errno
import json
import os
import runpy
import shutil
import signal
import socket
import stat
import subprocess
import sys

import numpy as np
import pytest
import torch

import export
import sample
import train
from conftest import REPO, TINY, newest_checkpoint, torchrun
from nanofp8 import data as data_module
from nanofp8.checkpoint import read_any
from nanofp8.configurator import ConfigError
from nanofp8.interop import load_portable
from nanofp8.ckptfile import CheckpointError, load_checkpoint, save_checkpoint
from nanofp8.outdir import LOCK, MANIFEST, acquire_lock, begin_set, commit_set, release_lock
from nanofp8.stats import trim_jsonl
from nanofp8.stats import read_records

pytestmark = pytest.mark.usefixtures("shakespeare")

RUN = TINY + ["max_iters=4", "eval_interval=2"]  # sets at iterations 2 and 4


@pytest.fixture(scope="module")
def good_run(tmp_path_factory):
    """A bf16 run with its two sets (iterations 2 and 4), to copy."""
    out = tmp_path_factory.mktemp("good") / "out"
    train.main(RUN + [f"out_dir={out}"])
    return out


@pytest.fixture
def run_dir(good_run, tmp_path):
    """A copy of good_run's out_dir, for a test to damage."""
    return shutil.copytree(good_run, tmp_path / "out")


def cli(args, capsys):
    """train.py as a command, in-process: (exit status, stderr); stdout is in cli.out."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        train.cli(args)
        raise SystemExit(0)
    printed = capsys.readouterr()
    cli.out = printed.out
    return e.value.code, printed.err


def script(name, args, capsys):
    """sample.py or export.py as a command, in-process (their __main__ block): (exit status, stderr)."""
    capsys.readouterr()
    argv = sys.argv
    sys.argv = [name, *args]
    try:
        with pytest.raises(SystemExit) as e:
            runpy.run_path(os.path.join(REPO, name), run_name="__main__")
            raise SystemExit(0)
    finally:
        sys.argv = argv
    printed = capsys.readouterr()
    script.out = printed.out
    return e.value.code, printed.err


def failing_save(monkeypatch, error):
    """torch.save into a file that takes 20 kB and then raises `error` (OSError(ENOSPC): a full
    disk; KeyboardInterrupt: Ctrl-C in the middle of a save)."""
    real = torch.save

    class Cut:
        def __init__(self, f):
            self.f, self.size = f, 0

        def write(self, data):
            self.size += len(data)
            if self.size > 20000:
                raise error
            return self.f.write(data)

        def flush(self):
            self.f.flush()

    monkeypatch.setattr(torch, "save", lambda obj, f, *a, **k: real(obj, Cut(f), *a, **k))


def one_line(err):
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


def sets(out):
    return sorted(f for f in os.listdir(out) if f.startswith("ckpt-"))


def flip_bit(path, needle, bit=6, at=0):
    """Flip one bit of a file where the bytes `needle` (a tensor's) start, plus `at`."""
    blob = bytearray(open(path, "rb").read())
    i = blob.find(needle)
    assert i >= 0 and blob.find(needle, i + 1) == -1
    blob[i + at] ^= 1 << bit
    open(path, "wb").write(bytes(blob))


# ---------------------------------------------------------------- checkpoint sets


def test_sets_manifest_and_pruning(good_run, tmp_path, capsys):
    """Each save is a set; its manifest (written last) names the iteration, the layout and every
    file with its size and sha256; keep_checkpoints=2 keeps the newest two; a partial set left by
    an interrupted save is ignored, said so, and removed by the next save."""
    assert sets(good_run) == ["ckpt-00000002", "ckpt-00000004"]
    manifest = json.load(open(good_run / "ckpt-00000004" / MANIFEST))
    assert manifest["iter_num"] == 4 and manifest["layout"]["precision"] == "bf16"
    assert manifest["layout"]["tensor_parallel"] == manifest["layout"]["pipeline_parallel"] == 1
    f = manifest["files"]["ckpt.pt"]
    assert f["bytes"] == os.path.getsize(good_run / "ckpt-00000004" / "ckpt.pt") and len(f["sha256"]) == 64
    out = shutil.copytree(good_run, tmp_path / "out")
    (out / "ckpt-00000006").mkdir()  # a save interrupted after its file, before its manifest
    shutil.copy(out / "ckpt-00000004" / "ckpt.pt", out / "ckpt-00000006" / "ckpt.pt")
    state, info = read_any(str(out))
    assert info["iter_num"] == 4 and "ckpt-00000006: partial: no manifest.json" in " ".join(info["notes"])
    train.main(RUN + ["max_iters=8", "init_from=resume", f"out_dir={out}"])
    assert "ignoring " + str(out / "ckpt-00000006") in capsys.readouterr().out
    assert sets(out) == ["ckpt-00000006", "ckpt-00000008"]  # the partial one replaced, 2 and 4 pruned
    assert not os.path.exists(out / LOCK)


def test_manifest_names_a_missing_file(run_dir, capsys):
    """A set whose manifest names a file that is gone is broken: the set before it is used, and
    the note says why; with no complete set left, one line says what is wrong."""
    os.remove(run_dir / "ckpt-00000004" / "ckpt.pt")
    _, info = read_any(str(run_dir))
    assert info["iter_num"] == 2
    assert "ckpt-00000004: broken: its manifest names ckpt.pt, which is missing" in " ".join(info["notes"])
    shutil.rmtree(run_dir / "ckpt-00000002")
    code, err = cli(RUN + ["max_iters=6", "init_from=resume", f"out_dir={run_dir}"], capsys)
    assert code == 2 and "no checkpoint in" in one_line(err) and "which is missing" in err


def test_newer_format_versions(run_dir):
    """A set or a file written by a newer nanofp8 is refused with one line saying to update."""
    manifest = json.load(open(run_dir / "ckpt-00000004" / MANIFEST))
    json.dump({**manifest, "format": "nanofp8-set-2"}, open(run_dir / "ckpt-00000004" / MANIFEST, "w"))
    with pytest.raises(CheckpointError, match=r"ckpt-00000004 was written by a newer nanofp8 \(manifest format "
                                              r"'nanofp8-set-2'; this version reads 'nanofp8-set-1'\): update"):
        read_any(str(run_dir))
    ckpt = torch.load(run_dir / "ckpt-00000002" / "ckpt.pt", weights_only=True)
    torch.save({**ckpt, "format": "nanofp8-ckpt-2"}, run_dir / "newer.pt")
    with pytest.raises(CheckpointError, match=r"newer.pt was written by a newer nanofp8 \(format 'nanofp8-ckpt-2'"):
        load_checkpoint(str(run_dir / "newer.pt"))
    exp = run_dir.parent / "exp"  # (exported from one set, named directly)
    export.main([f"--out_dir={run_dir}/ckpt-00000002", f"--to={exp}"])
    meta = json.load(open(exp / "config.json"))
    json.dump({**meta, "format": "nanofp8-export-2"}, open(exp / "config.json", "w"))
    with pytest.raises(CheckpointError, match=r"exp was written by a newer nanofp8 \(format 'nanofp8-export-2'"):
        load_portable(str(exp))


def test_files_of_older_versions(good_run, tmp_path, capsys):
    """A ckpt.pt straight in out_dir (as nanofp8 wrote before sets) is read, and resumed; once
    sets exist it is ignored with a note, and removed when keep_checkpoints newer sets exist."""
    out = tmp_path / "old"
    out.mkdir()
    ckpt = torch.load(good_run / "ckpt-00000002" / "ckpt.pt", weights_only=True)
    ckpt.pop("checksums")  # older files have none
    torch.save(ckpt, out / "ckpt.pt")
    assert read_any(str(out))[1]["iter_num"] == 2
    train.main(RUN + ["max_iters=6", "init_from=resume", f"out_dir={out}"])
    assert "resuming at iter 2" in capsys.readouterr().out
    assert sets(out) == ["ckpt-00000004", "ckpt-00000006"] and not os.path.exists(out / "ckpt.pt")
    out2 = tmp_path / "old2"
    out2.mkdir()
    torch.save(ckpt, out2 / "ckpt.pt")
    train.main(RUN + ["max_iters=4", "init_from=resume", f"out_dir={out2}"])
    _, info = read_any(str(out2))
    assert info["iter_num"] == 4 and "ckpt.pt: written by an older nanofp8" in " ".join(info["notes"])


def test_stale_files_of_another_layout(good_run, tmp_path, capsys):
    """Model-parallel files of a later iteration lying in out_dir (an older version's, or an
    earlier run's) no longer win over the run that wrote last: a fresh run there is refused, and
    when allowed to replace them, readers take its set."""
    out = tmp_path / "out"
    out.mkdir()
    ckpt = torch.load(newest_checkpoint(good_run), weights_only=True)
    for t in (0, 1):  # stand-ins for TP files of iteration 20
        torch.save({**ckpt, "iter_num": 20, "config": {**ckpt["config"], "tensor_parallel": 2}},
                   out / f"ckpt-tp{t}-pp0.pt")
    with pytest.raises(ConfigError, match="holds the checkpoint .*ckpt-tp0-pp0.pt.* of an earlier run"):
        train.main(TINY + ["max_iters=2", "eval_interval=2", f"out_dir={out}"])
    train.main(TINY + ["max_iters=2", "eval_interval=2", f"out_dir={out}", "overwrite_checkpoints=True"])
    capsys.readouterr()
    sample.main([f"--out_dir={out}", "--max_new_tokens=4", "--num_samples=1"])
    printed = capsys.readouterr().out
    assert "ckpt-00000002/ckpt.pt" in printed and "iter 2," in printed
    assert "ignoring " + str(out / "ckpt-tp0-pp0.pt") in printed


# ---------------------------------------------------------------- a diverged run never replaces the good one


@pytest.mark.slow
def test_diverged_resume_keeps_the_good_checkpoint(run_dir, capsys):
    """The issue's reproduction: resume a trained run with learning_rate=1e4 and no warmup. No set
    is written from the diverged run, the stop line names the good set, and resuming from it with
    a sane learning rate works."""
    code, err = cli(TINY + ["max_iters=40", "eval_interval=2", "init_from=resume", "learning_rate=1e4",
                            "warmup_iters=0", "max_skipped_steps=3", f"out_dir={run_dir}"], capsys)
    assert code == 1 and one_line(err).endswith(f"stopped; the last good checkpoint is {run_dir}/ckpt-00000004 "
                                                "(iter 4): resume from it with a lower learning_rate, or look for bad data")
    assert sets(run_dir) == ["ckpt-00000002", "ckpt-00000004"]
    hist = train.main(RUN + ["max_iters=6", "init_from=resume", f"out_dir={run_dir}"])
    assert [it for it, _ in hist["losses"]] == [4, 5] and hist["evals"][-1][2] < 4.2


def test_a_finite_loss_far_above_the_best_is_not_saved(run_dir, monkeypatch, capsys):
    """A finite val loss more than max_loss_rise above the best so far (3.3e9 in the report) is
    a divergence: not saved, and a run that ends so exits 1 naming the good set."""
    real = train.estimate_loss
    monkeypatch.setattr(train, "estimate_loss", lambda *a: {"train": 3.3e9, "val": 3.3e9})
    code, err = cli(RUN + ["max_iters=8", "init_from=resume", f"out_dir={run_dir}"], capsys)
    assert code == 1 and one_line(err).startswith("error: the run ended diverged (the val loss 3.3e+09 is more "
                                                  "than max_loss_rise=1 above the best so far (4.1")
    assert f"the last good checkpoint is {run_dir}/ckpt-00000004 (iter 4)" in err
    assert sets(run_dir) == ["ckpt-00000002", "ckpt-00000004"]
    monkeypatch.setattr(train, "estimate_loss", real)
    train.main(RUN + ["max_iters=6", "init_from=resume", f"out_dir={run_dir}", "max_loss_rise=0"])
    assert sets(run_dir)[-1] == "ckpt-00000006"


def test_a_save_right_after_a_skipped_step_is_not_written(run_dir, monkeypatch, capsys):
    """Weights whose last step was skipped for non-finite gradients would skip again when
    resumed: the evaluation after it writes no set."""
    real = train.optimizer_step
    calls = []

    def skip_the_second(*a, **k):
        calls.append(1)
        norm, stepped, ok = real(*a, **k)
        return (float("nan"), False, ok) if len(calls) == 2 else (norm, stepped, ok)

    monkeypatch.setattr(train, "optimizer_step", skip_the_second)
    train.main(RUN + ["max_iters=8", "init_from=resume", f"out_dir={run_dir}"])
    assert "not saving a checkpoint: the last 1 step was skipped for non-finite gradients" in capsys.readouterr().out
    assert sets(run_dir) == ["ckpt-00000004", "ckpt-00000008"]  # no set of iteration 6


# ---------------------------------------------------------------- never overwrite work by accident


def test_a_fresh_run_refuses_to_replace_a_checkpoint(run_dir, capsys):
    code, err = cli(RUN + ["max_iters=2", f"out_dir={run_dir}"], capsys)
    assert code == 2 and one_line(err) == (
        f"error: out_dir {run_dir} holds the checkpoint {run_dir}/ckpt-00000004 (iter 4) of an earlier run, "
        f"and this run starts from scratch: pass init_from=resume to continue it, or overwrite_checkpoints=True "
        f"to replace it (or use another out_dir)")
    assert sets(run_dir) == ["ckpt-00000002", "ckpt-00000004"]
    train.main(RUN + ["max_iters=2", f"out_dir={run_dir}", "overwrite_checkpoints=True"])
    assert read_any(str(run_dir))[1]["iter_num"] == 2  # the new run's set is the newest


def test_the_lock(run_dir, tmp_path, capsys):
    """Another live run's lock stops a second writer; the lock of a killed process is stale and
    taken over, with a note; a run removes its lock when it ends."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = int(open(f"/proc/{sleeper.pid}/stat").read().rsplit(")", 1)[1].split()[19])
        holder = {"pid": sleeper.pid, "host": socket.gethostname(), "start": start, "since": "now"}
        (run_dir / LOCK).write_text(json.dumps(holder))
        code, err = cli(RUN + ["max_iters=6", "init_from=resume", f"out_dir={run_dir}"], capsys)
        assert code == 2 and one_line(err).startswith(f"error: out_dir {run_dir} is in use by another run "
                                                      f"(pid {sleeper.pid} on {socket.gethostname()}")
    finally:
        sleeper.kill()
        sleeper.wait()
    # a lock left by a killed writer
    dead = os.fork()
    if dead == 0:  # the child takes the lock and is killed
        try:
            acquire_lock(str(run_dir))
        finally:
            os.kill(os.getpid(), signal.SIGKILL)
    assert os.waitpid(dead, 0)[1] == signal.SIGKILL and json.loads((run_dir / LOCK).read_text())["pid"] == dead
    train.main(RUN + ["max_iters=6", "init_from=resume", f"out_dir={run_dir}"])
    assert f"note: removed a stale lock {run_dir / LOCK} of pid {dead} (no longer running)" in capsys.readouterr().out
    assert not (run_dir / LOCK).exists() and sets(run_dir)[-1] == "ckpt-00000006"
    assert acquire_lock(str(tmp_path)) is None and (tmp_path / LOCK).exists()
    release_lock(str(tmp_path))
    assert not (tmp_path / LOCK).exists()


def test_init_from_dir_never_writes_into_it(run_dir, tmp_path, capsys):
    """init_from=DIR with out_dir=DIR (or one inside the other) is refused; a set of an out_dir is
    a starting point (the way to go back to an older set), and its out_dir stays untouched."""
    with pytest.raises(ConfigError, match="and out_dir=.* overlap, and a run never writes into the directory"):
        train.load_config(TINY + [f"init_from={run_dir}", f"out_dir={run_dir}"])
    with pytest.raises(ConfigError, match="overlap"):
        train.load_config(TINY + [f"init_from={run_dir}/ckpt-00000002", f"out_dir={run_dir}"])
    before = {f: os.path.getmtime(run_dir / f) for f in sets(run_dir)}
    hist = train.main(TINY + ["max_iters=2", "eval_interval=2", f"init_from={run_dir}/ckpt-00000002",
                              f"out_dir={tmp_path / 'ft'}"])
    assert hist["evals"][0][2] < 4.35 and f"fine-tuning the weights of {run_dir}/ckpt-00000002" in capsys.readouterr().out
    assert before == {f: os.path.getmtime(run_dir / f) for f in sets(run_dir)}


# ---------------------------------------------------------------- integrity


def test_flipped_bits_are_found_and_named(run_dir, capsys):
    """A flipped bit in Adam's state, an exponent flip in a weight, 4 KB of garbage: resume,
    sample.py and export.py refuse the file with one line naming it and the damaged tensor."""
    path = newest_checkpoint(run_dir)
    ckpt = load_checkpoint(path)
    good = open(path, "rb").read()
    m = ckpt["optimizer"]["state"][2]["exp_avg"].numpy().tobytes()  # blocks.0.attn.c_attn.weight's
    flip_bit(path, m[len(m) // 2: len(m) // 2 + 64], bit=3)
    code, err = cli(RUN + ["max_iters=6", "init_from=resume", f"out_dir={run_dir}"], capsys)
    assert code == 2 and one_line(err) == (f"error: {path} is damaged: tensor optimizer/state/2/exp_avg does not "
                                           f"match its checksum; restore the file from a copy or use another checkpoint")
    open(path, "wb").write(good)
    w = ckpt["model"]["blocks.1.attn.c_proj.weight"]
    flip_bit(path, w.numpy().tobytes()[:64], bit=6, at=3)  # the top exponent bit of the first weight: ~1e37
    code, err = script("sample.py", [f"--out_dir={run_dir}", "--max_new_tokens=4"], capsys)
    assert code == 2 and one_line(err) == (f"error: {path} is damaged: tensor model/blocks.1.attn.c_proj.weight "
                                           f"does not match its checksum; restore the file from a copy or use "
                                           f"another checkpoint")
    with pytest.raises(CheckpointError, match="blocks.1.attn.c_proj.weight does not match its checksum"):
        export.main([f"--out_dir={run_dir}", f"--to={run_dir.parent / 'exp'}"])
    blob = bytearray(good)
    blob[len(blob) // 2: len(blob) // 2 + 4096] = os.urandom(4096)
    open(path, "wb").write(bytes(blob))
    with pytest.raises(CheckpointError, match=f"{path} is damaged"):
        read_any(str(run_dir))


def test_export_checksums(good_run, tmp_path):
    """A flipped bit in an exported model.safetensors is found on import, naming the tensor."""
    exp = tmp_path / "exp"
    export.main([f"--out_dir={good_run}", f"--to={exp}", "--format=fp32"])
    state, _ = load_portable(str(exp))
    flip_bit(exp / "model.safetensors", state["norm_f.weight"].numpy().tobytes(), bit=1)
    with pytest.raises(CheckpointError, match=r"model.safetensors is damaged: tensor norm_f.weight does not match"):
        load_portable(str(exp))


# ---------------------------------------------------------------- checked before training


@pytest.fixture
def read_only(monkeypatch):
    """read_only(path): a read-only directory. chmod makes it one for a normal user; root ignores
    permissions, so creating files or directories under it also fails at Python's os level, with
    the error a read-only file system gives (EROFS)."""
    roots = []
    real_open, real_os_open, real_mkdir = builtins.open, os.open, os.mkdir

    def inside(p):
        p = os.path.abspath(os.fsdecode(p))
        return any(p == r or p.startswith(r + os.sep) for r in roots)

    def refuse(p):
        raise OSError(errno.EROFS, "Read-only file system", os.fsdecode(p))

    def fake_open(file, mode="r", *a, **k):
        if isinstance(file, (str, bytes, os.PathLike)) and any(c in mode for c in "wax+") and inside(file):
            refuse(file)
        return real_open(file, mode, *a, **k)

    def fake_os_open(path, flags, *a, **k):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) and inside(path):
            refuse(path)
        return real_os_open(path, flags, *a, **k)

    def fake_mkdir(path, *a, **k):
        if inside(path):
            refuse(path)
        return real_mkdir(path, *a, **k)

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(os, "open", fake_os_open)
    monkeypatch.setattr(os, "mkdir", fake_mkdir)

    def make(path):
        os.makedirs(path, exist_ok=True)
        os.chmod(path, 0o555)
        roots.append(os.path.abspath(path))
        return path

    yield make
    for r in roots:
        os.chmod(r, 0o755)


def test_read_only_out_dir_fails_before_training(run_dir, tmp_path, read_only, capsys):
    """A new run and a resume into a read-only out_dir stop before the first iteration."""
    new = read_only(tmp_path / "new")
    code, err = cli(RUN + [f"out_dir={new}"], capsys)
    assert code == 2 and one_line(err).startswith(f"error: cannot write in out_dir {new} (Read-only file system)")
    read_only(run_dir)
    code, err = cli(RUN + ["max_iters=6", "init_from=resume", f"out_dir={run_dir}"], capsys)
    assert code == 2 and "cannot write in out_dir" in one_line(err)
    assert "iter 4" not in capsys.readouterr().out


def test_room_for_a_checkpoint(tmp_path, monkeypatch, capsys):
    """The run says how large a checkpoint is and refuses to start without room for one; the
    estimate is not below the real size."""
    out = tmp_path / "O1"  # fp32 weights and moments, and FP8 scaling state: the largest file per value
    train.main(TINY + ["precision=O1", "max_iters=1", "eval_interval=1", f"out_dir={out}"])
    said = float(capsys.readouterr().out.split("checkpoints: about ")[1].split(" MiB")[0])
    assert os.path.getsize(newest_checkpoint(out)) <= said * 2**20
    from types import SimpleNamespace

    from nanofp8 import outdir

    monkeypatch.setattr(outdir.shutil, "disk_usage", lambda p: SimpleNamespace(free=2**19))
    code, err = cli(RUN + [f"out_dir={tmp_path / 'full'}"], capsys)
    assert code == 2 and one_line(err).startswith(f"error: out_dir {tmp_path / 'full'} has 0.5 MiB free, and one "
                                                  f"checkpoint takes about 1.3 MiB")


@pytest.fixture
def repo_data(tmp_path, monkeypatch):
    """data(name, **files): a dataset directory in a stand-in repo (nanofp8.data.REPO), with the
    real Shakespeare files cut short (train: 20k tokens, val: 5k), unless files says otherwise."""
    monkeypatch.setattr(data_module, "REPO", str(tmp_path / "repo"))
    real = os.path.join(REPO, "data", "shakespeare_char")
    tokens = np.fromfile(os.path.join(real, "train.bin"), dtype=np.uint16)

    def make(name, **files):
        d = tmp_path / "repo" / "data" / name
        d.mkdir(parents=True, exist_ok=True)
        default = {"train.bin": tokens[:20000].tobytes(), "val.bin": tokens[-5000:].tobytes(),
                   "meta.json": open(os.path.join(real, "meta.json"), "rb").read()}
        for f, content in {**default, **files}.items():
            if content is not None:
                (d / f).write_bytes(content)
        return d

    return make


def test_data_files_are_checked_before_training(repo_data, tmp_path, capsys):
    args = TINY + ["max_iters=2", f"out_dir={tmp_path / 'out'}"]
    d = repo_data("shakespeare_char", **{"train.bin": b"\x01\x00" * 5000 + b"\x01"})
    code, err = cli(args, capsys)
    assert code == 2 and one_line(err) == (f"error: {d}/train.bin has 10,001 bytes, not a whole number of uint16 "
                                           f"token ids (cut short or not written by prepare.py): prepare the "
                                           f"dataset again with python {d}/prepare.py")
    bad = np.fromfile(os.path.join(REPO, "data", "shakespeare_char", "train.bin"), dtype=np.uint16)[:20000].copy()
    bad[12345] = 90  # the vocabulary has 84 ids
    repo_data("shakespeare_char", **{"train.bin": bad.tobytes()})
    code, err = cli(args, capsys)
    assert code == 2 and one_line(err) == (f"error: {d}/train.bin holds token id 90 at position 12,345, beyond the "
                                           f"model's vocabulary (84 ids): the file is damaged or was made for "
                                           f"another vocabulary; prepare the dataset again")
    os.remove(d / "val.bin")  # a dataset of one's own (no prepare.py), half there
    code, err = cli(args, capsys)
    assert code == 2 and one_line(err) == f"error: dataset 'shakespeare_char' is incomplete: {d}/val.bin is missing " \
                                          f"(the dataset needs train.bin, val.bin, meta.json)"
    o = repo_data("openwebtext", **{"val.bin": None, "meta.json": None})
    (o / "prepare.py").write_text("")
    code, err = cli(args + ["dataset=openwebtext"], capsys)
    assert code == 2 and err.startswith(f"error: dataset 'openwebtext' is not prepared ({o}/val.bin is missing)")


def test_token_ids_of_large_files(repo_data, monkeypatch):
    """A file too large to read whole at start is sampled; a bad id the samples miss is found in
    the first batch that holds it, naming the file and the position."""
    tokens = np.zeros(4096, dtype=np.uint16)
    tokens[100] = 99
    d = repo_data("big", **{"train.bin": tokens.tobytes(), "val.bin": tokens.tobytes()})
    monkeypatch.setattr(data_module, "CHECK_WHOLE", 1000)
    monkeypatch.setattr(data_module, "SAMPLES", 2)
    monkeypatch.setattr(data_module, "SAMPLE_WIDTH", 64)
    split = {"train": data_module.Tokens(str(d / "train.bin"))}
    data_module.check_tokens(split, 84)  # samples [0, 64) and [4032, 4096): the bad id is missed
    tokens[4050] = 99
    (d / "train.bin").write_bytes(tokens.tobytes())
    split = {"train": data_module.Tokens(str(d / "train.bin"))}
    with pytest.raises(ConfigError, match="train.bin holds token id 99 at position 4,050"):
        data_module.check_tokens(split, 84)
    tokens[4050] = 0
    (d / "train.bin").write_bytes(tokens.tobytes())
    split = {"train": data_module.Tokens(str(d / "train.bin"))}
    data_module.check_tokens(split, 84)
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(data_module.DataError, match="train.bin holds token id 99 at position 100,"):
        for _ in range(200):
            data_module.get_batch(split["train"], 8, 32, gen, "cpu")


def test_missing_meta_json_is_not_gpt2(repo_data, tmp_path, capsys):
    """shakespeare_char without meta.json (an interrupted prepare.py) is prepared again, not
    trained with GPT-2's vocabulary."""
    d = repo_data("shakespeare_char", **{"meta.json": None})
    meta = open(os.path.join(REPO, "data", "shakespeare_char", "meta.json")).read()
    (d / "prepare.py").write_text(f"import os\nopen(os.path.join(os.path.dirname(__file__), 'meta.json'), 'w')"
                                  f".write({meta!r})\n")
    train.main(TINY + ["max_iters=1", "eval_interval=1", f"out_dir={tmp_path / 'out'}"])
    printed = capsys.readouterr().out
    assert "dataset 'shakespeare_char' is not prepared yet: running" in printed
    assert load_checkpoint(newest_checkpoint(tmp_path / "out"))["model_args"]["vocab_size"] == 84
    os.remove(d / "meta.json")
    (d / "prepare.py").write_text("raise SystemExit(1)\n")
    code, err = cli(TINY + ["max_iters=1", f"out_dir={tmp_path / 'out2'}"], capsys)
    assert code == 2 and one_line(err) == "error: preparing dataset 'shakespeare_char' failed (see above)"


# ---------------------------------------------------------------- the other faults, one line each


def test_triton_backend_on_a_cpu(monkeypatch):
    import kernels

    monkeypatch.setattr(kernels, "INTERPRET", False)
    with pytest.raises(ConfigError, match="fp8_backend='triton' runs Triton kernels, which need a CUDA GPU, and "
                                          "this run's device is cpu: use fp8_backend=emulate"):
        train.load_config(TINY + ["precision=O1", "fp8_backend=triton"])
    monkeypatch.setattr(kernels, "INTERPRET", True)  # the interpreter runs them (slowly)
    train.load_config(TINY + ["precision=O1", "fp8_backend=triton"])


def test_checkpoint_without_optimizer(run_dir, capsys):
    ckpt = load_checkpoint(str(run_dir / "ckpt-00000004" / "ckpt.pt"))
    ckpt.pop("optimizer")
    shutil.rmtree(run_dir / "ckpt-00000004")
    path = begin_set(str(run_dir), 4)
    record = save_checkpoint(ckpt, os.path.join(path, "ckpt.pt"))
    commit_set(path, 4, {"ckpt.pt": record}, {"precision": "bf16", "tensor_parallel": 1, "pipeline_parallel": 1,
                                              "zero_world": None, "world_size": 1}, config=ckpt["config"])
    code, err = cli(RUN + ["max_iters=6", "init_from=resume", f"out_dir={run_dir}"], capsys)
    assert code == 2 and one_line(err) == (f"error: {path}/ckpt.pt has no 'optimizer' entry (Adam's state), so the "
                                           f"run cannot go on exactly from it: fine-tune from its weights instead, "
                                           f"with init_from={path} and another out_dir (from iteration 0, with a "
                                           f"fresh optimizer)")


def test_sample_misuses(good_run, tmp_path, monkeypatch):
    binary = tmp_path / "prompt.bin"
    binary.write_bytes(b"ROMEO\xff\xfe\x00")
    with pytest.raises(ConfigError, match=rf"'start': {binary} is not UTF-8 text \(byte 0xff at offset 5\)"):
        sample.main([f"--out_dir={good_run}", f"--start=FILE:{binary}"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ConfigError, match="'device' is 'cuda', but this machine has 0 CUDA devices"):
        sample.main([f"--out_dir={good_run}", "--device=cuda"])


def test_empty_dir_or_only_temp_files(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code, err = script("sample.py", [f"--out_dir={tmp_path / 'empty'}"], capsys)
    assert code == 2 and one_line(err) == (
        f"error: {tmp_path / 'empty'} holds no model ({tmp_path / 'empty'} is empty): expected a training run's "
        f"out_dir or one of its checkpoint sets, an export, or a Hugging Face GPT-2 or LLaMA (config.json + "
        "model.safetensors)")
    (tmp_path / "empty" / "ckpt.pt.tmp.4242").write_bytes(b"half")
    with pytest.raises(CheckpointError, match=r"holds only unfinished writes \(ckpt.pt.tmp.4242\): the run stopped "
                                              "during its first save"):
        export.main([f"--out_dir={tmp_path / 'empty'}", f"--to={tmp_path / 'exp'}"])


def test_resumes_with_nothing_to_do(run_dir, capsys):
    """At max_iters: said, exit 0. Past it (a max_iters too small): exit 2. An iteration edited
    into a file: its set's checksum refuses it."""
    code, err = cli(RUN + ["init_from=resume", f"out_dir={run_dir}"], capsys)
    assert code == 0 and err == ""
    assert f"nothing to do: the checkpoint in {run_dir} is at iter 4 = max_iters" in cli.out
    assert train.main(RUN + ["init_from=resume", f"out_dir={run_dir}"]) == {"losses": [], "evals": []}
    code, err = cli(RUN + ["max_iters=3", "init_from=resume", f"out_dir={run_dir}"], capsys)
    assert code == 2 and one_line(err) == (f"error: the checkpoint in {run_dir} is at iter 4, past max_iters=3: "
                                           f"nothing to train; pass max_iters > 4 to train on")
    path = run_dir / "ckpt-00000004" / "ckpt.pt"
    good = path.read_bytes()
    ckpt = torch.load(path, weights_only=True)
    torch.save({**ckpt, "iter_num": 10**9}, path)  # edited in Python
    code, err = cli(RUN + ["max_iters=6", "init_from=resume", f"out_dir={run_dir}"], capsys)
    assert code == 2 and "ckpt.pt is damaged: it has" in one_line(err) and "(cut short or overwritten)" in err
    blob = bytearray(good)  # edited in place: the same size, the same tensors
    i = blob.find(b"K\x04", blob.find(b"iter_num"))  # the pickled int 4 that follows the key
    blob[i + 1] = 99
    path.write_bytes(bytes(blob))
    assert torch.load(path, weights_only=True)["iter_num"] == 99  # torch reads it without a word
    code, err = cli(RUN + ["max_iters=100", "init_from=resume", f"out_dir={run_dir}"], capsys)
    assert code == 2 and one_line(err).endswith("is damaged: its sha256 differs from its manifest's, outside its "
                                                "tensors (the iteration or the settings); restore the file from a "
                                                "copy or use another checkpoint")


def test_warmup_longer_than_the_run(tmp_path, capsys):
    train.main(TINY + ["max_iters=2", "eval_interval=2", "warmup_iters=100", f"out_dir={tmp_path}"])
    assert ("note: warmup_iters=100 is more than max_iters=2: the run ends during the warmup, its learning "
            "rate reaching 2% of learning_rate=0.003") in capsys.readouterr().out


def test_export_target_rules(good_run, tmp_path, capsys):
    """Not into a run's out_dir (its checkpoints would hide the export); not over an earlier
    export without --force; the size printed is the export's; files get the umask's mode."""
    run2 = shutil.copytree(good_run, tmp_path / "run2")
    code, err = script("export.py", [f"--out_dir={good_run}", f"--to={run2}"], capsys)
    assert code == 2 and one_line(err) == (
        f"error: --to={run2} is a training run's out_dir: its checkpoints would hide the export from sample.py, "
        f"export.py and init_from; export into a new or empty directory")
    exp = tmp_path / "exp"
    old = os.umask(0o022)
    try:
        export.main([f"--out_dir={good_run}", f"--to={exp}"])
        with pytest.raises(ConfigError, match=r"already holds an earlier export: pass --force=True to replace it"):
            export.main([f"--out_dir={good_run}", f"--to={exp}"])
        export.main([f"--out_dir={good_run}", f"--to={exp}", "--force=True", "--format=fp32"])
    finally:
        os.umask(old)
    assert sorted(os.listdir(exp)) == ["config.json", "model.safetensors"]
    for f in os.listdir(exp):
        assert stat.S_IMODE(os.stat(exp / f).st_mode) == 0o644, f
    (exp / "notes.txt").write_bytes(b"x" * 3 * 2**20)  # not the export's: not counted
    code, err = script("export.py", [f"--out_dir={good_run}", f"--to={exp}", "--force=True"], capsys)
    size = sum(os.path.getsize(exp / f) for f in ("config.json", "model.safetensors"))
    assert code == 0 and f"(fp8, {size / 2**20:.2f} MB)" in script.out, script.out


def test_disk_full(run_dir, tmp_path, monkeypatch, capsys):
    """A save that fails for want of space: one line naming the good set, exit 4, no partial set
    and no temp file. An export likewise (exit 4), and Ctrl-C in an export's write exits 130;
    neither leaves a file behind."""
    failing_save(monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
    code, err = cli(RUN + ["max_iters=6", "init_from=resume", f"out_dir={run_dir}"], capsys)
    assert code == 4 and one_line(err) == (f"error: cannot write {run_dir}/ckpt-00000006/ckpt.pt: No space left on "
                                           f"device; nothing half-written is kept, and the last good checkpoint is "
                                           f"{run_dir}/ckpt-00000004 (iter 4)")
    assert sorted(os.listdir(run_dir)) == ["ckpt-00000002", "ckpt-00000004"]
    monkeypatch.undo()
    exp = tmp_path / "exp"
    real_open = builtins.open

    class Refused:  # a file under exp whose writes fail with `error`
        def __init__(self, f, error):
            self.f, self.error = f, error

        def write(self, data):
            raise self.error

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    for error, status, line in ((OSError(errno.ENOSPC, "No space left on device"), 4,
                                 f"error: cannot write {exp}/model.safetensors: No space left on device; nothing "
                                 f"half-written is left"),
                                (KeyboardInterrupt(), 130, "interrupted (Ctrl-C): nothing half-written is left")):
        def refusing_open(file, mode="r", *a, **k):
            f = real_open(file, mode, *a, **k)
            inside = isinstance(file, (str, os.PathLike)) and os.fspath(file).startswith(str(exp) + os.sep)
            return Refused(f, error) if inside and "w" in mode else f

        monkeypatch.setattr(builtins, "open", refusing_open)
        code, err = script("export.py", [f"--out_dir={run_dir}", f"--to={exp}"], capsys)
        monkeypatch.undo()
        assert code == status and one_line(err) == line
        assert os.listdir(exp) == []


def test_ctrl_c_in_training_and_in_a_save(run_dir, monkeypatch, capsys):
    """Ctrl-C during training, and during the write of a checkpoint: one line naming the last
    good set, exit 130, nothing half-written, the lock released."""
    real = train.get_batch
    draws = []

    def interrupted(*a, **k):
        draws.append(1)
        if len(draws) == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(train, "get_batch", interrupted)
    code, err = cli(RUN + ["max_iters=8", "init_from=resume", f"out_dir={run_dir}"], capsys)
    assert code == 130 and one_line(err) == (f"interrupted (Ctrl-C): nothing half-written is kept; the last good "
                                             f"checkpoint is {run_dir}/ckpt-00000004 (iter 4)")
    monkeypatch.undo()
    assert sorted(os.listdir(run_dir)) == ["ckpt-00000002", "ckpt-00000004"]  # no lock left
    failing_save(monkeypatch, KeyboardInterrupt())
    code, err = cli(RUN + ["max_iters=8", "init_from=resume", f"out_dir={run_dir}"], capsys)
    assert code == 130 and one_line(err).endswith(f"the last good checkpoint is {run_dir}/ckpt-00000004 (iter 4)")
    assert sorted(os.listdir(run_dir)) == ["ckpt-00000002", "ckpt-00000004"]


def test_signals_in_training(run_dir, monkeypatch, capsys):
    """A real SIGINT (Ctrl-C) and SIGTERM (a scheduler's stop), delivered to this process during
    training, go through train.py's own handler: one line naming the last good set, exit 130 and
    143, the lock released. A signal ignored when the run started stays ignored. (Under torchrun,
    test_ctrl_c_under_torchrun sends SIGINT to real ranks.)"""
    real = train.get_batch

    def send_at_the_third_batch(sig):
        draws = []

        def signalled(*a, **k):
            draws.append(1)
            if len(draws) == 3:
                os.kill(os.getpid(), sig)
            return real(*a, **k)

        monkeypatch.setattr(train, "get_batch", signalled)

    def run_with(sig, handler, max_iters):
        previous = signal.signal(sig, handler)
        try:
            return cli(RUN + [f"max_iters={max_iters}", "init_from=resume", f"out_dir={run_dir}"], capsys)
        finally:
            signal.signal(sig, previous)

    for sig, name in ((signal.SIGINT, "Ctrl-C"), (signal.SIGTERM, "SIGTERM")):
        send_at_the_third_batch(sig)
        # the handler train.py must replace: without one of its own, the signal fails the test (and
        # SIGTERM does not kill pytest)
        code, err = run_with(sig, lambda *a: pytest.fail(f"{name} reached no handler of train.py"), 8)
        assert code == 128 + sig and one_line(err) == (f"interrupted ({name}): nothing half-written is kept; the "
                                                       f"last good checkpoint is {run_dir}/ckpt-00000004 (iter 4)")
        assert sorted(os.listdir(run_dir)) == ["ckpt-00000002", "ckpt-00000004"]  # no lock left
    send_at_the_third_batch(signal.SIGINT)  # ignored, as in a script's background job: the run goes on
    code, err = run_with(signal.SIGINT, signal.SIG_IGN, 6)
    assert code == 0 and err == "" and sets(run_dir)[-1] == "ckpt-00000006"


def test_a_rank_that_never_joins(tmp_path, monkeypatch, capsys):
    """Rank 0 of 2 whose partner stopped before the process group existed: one line, exit 3. Run
    as rank 0 in this process (the rank's own code path, without a second interpreter to start)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # USE_LIBUV=0: rank 0 hosts the rendezvous store here (torchrun's agent would); torch's libuv
    # store can abort at exit when nobody ever joined it (tests/conftest.py)
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(port), "USE_LIBUV": "0"}.items():
        monkeypatch.setenv(k, v)
    code, err = cli(TINY + ["gradient_accumulation_steps=2", "dist_timeout=2", f"out_dir={tmp_path}"], capsys)
    assert code == 3 and one_line(err).startswith("error: rank 0: the process group did not form within "
                                                  "dist_timeout=2s (DistStoreError:"), err
    assert err.strip().endswith("a rank stopped or failed before joining; see its own error")
    assert not torch.distributed.is_initialized()


def test_the_error_of_a_rank_on_another_node(tmp_path, monkeypatch, capsys):
    """A rank that stops before the process group exists says why: rank 0 prints only that the
    group did not form ("see its own error"), so the first rank of every node prints its own
    config error (a dataset missing on that node); the other ranks of a node leave it to that one."""
    monkeypatch.setenv("RANK", "8")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "16")
    args = TINY + ["dataset=not_on_this_node", f"out_dir={tmp_path}"]
    code, err = cli(args, capsys)
    assert code == 2 and one_line(err).startswith("error: rank 8: ") and "not_on_this_node" in err
    monkeypatch.setenv("RANK", "9")
    monkeypatch.setenv("LOCAL_RANK", "1")
    code, err = cli(args, capsys)
    assert code == 2 and err == ""


def test_fp8_stats_cut_mid_line(tmp_path, capsys):
    """A line cut short by a crash: read_records names it; a resume drops it and the records
    after the checkpoint's iteration (it writes them again), with a note."""
    out = tmp_path / "out"
    args = TINY + ["precision=O1", "fp8_stats_interval=1", "eval_interval=2", "eval_iters=1", f"out_dir={out}"]
    train.main(args + ["max_iters=2"])
    path = out / "fp8_stats.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines + [lines[0].replace('"iter": 0', '"iter": 2')]) + "\n" + lines[0][:40])
    with pytest.raises(ValueError, match=rf"{path}, line {len(lines) + 2}: not a JSON record"):
        read_records(path)
    train.main(args + ["max_iters=3", "init_from=resume"])
    assert (f"note: {path}: dropped 1 damaged line (cut short by a crash) and 1 record of iterations >= 2 "
            f"(written again now)") in capsys.readouterr().out
    recs = read_records(path)
    assert sorted({r["iter"] for r in recs}) == [0, 1, 2] and len(recs) == 3 * len(lines) // 2
    assert trim_jsonl(str(path), 3) is None  # nothing to drop


# ---------------------------------------------------------------- under torchrun (gloo, 2 ranks)

DIFFERENT_SETTINGS = """
import os, sys
sys.path.insert(0, {repo!r})
import train
rank = int(os.environ["RANK"])
train.cli({tiny!r} + ["gradient_accumulation_steps=2", f"n_layer={{2 + rank}}", "out_dir={out}"])
"""


@pytest.mark.slow
@pytest.mark.dist
def test_ranks_with_different_settings(tmp_path):
    """A per-rank difference (here n_layer) is one line before any model is built, not a timeout
    that never happened."""
    script = tmp_path / "worker.py"
    script.write_text(DIFFERENT_SETTINGS.format(repo=REPO, tiny=TINY, out=tmp_path / "out"))
    r = torchrun(2, script=str(script), check=False, timeout=300)
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert lines == ["error: the ranks were started with different settings: rank 1 has n_layer=3, rank 0 "
                     "n_layer=2: give every rank the same command line and config files"], r.stderr[-3000:]
    assert "[rank0]: Traceback" not in r.stderr and "[rank1]: Traceback" not in r.stderr


RANK_DIES_IN_A_SAVE = """
import os, sys
sys.path.insert(0, {repo!r})
import torch, train
if os.environ["RANK"] == "1":  # dies as it starts writing its file of the checkpoint of iteration 4
    write = torch.save
    torch.save = lambda obj, f, *a, **k: os._exit(9) if obj.get("iter_num") == 4 else write(obj, f, *a, **k)
train.cli({tiny!r} + ["gradient_accumulation_steps=2", "tensor_parallel=2", "max_iters=4", "eval_interval=2",
                      "out_dir={out}"])
"""


@pytest.mark.slow
@pytest.mark.dist
def test_a_rank_dies_during_a_save(tmp_path, capsys):
    """Tensor-parallel ranks write one set: a rank that dies between its partner's write and its
    own leaves a set without manifest, which readers ignore; the set before it stays whole."""
    out = tmp_path / "out"
    script = tmp_path / "worker.py"
    script.write_text(RANK_DIES_IN_A_SAVE.format(repo=REPO, tiny=TINY, out=out))
    r = torchrun(2, script=str(script), check=False, timeout=300)
    assert r.returncode != 0 and not os.path.exists(out / "ckpt-00000004" / MANIFEST), r.stderr[-3000:]
    state, info = read_any(str(out))
    assert info["iter_num"] == 2 and len(info["files"]) == 2
    assert f"ignoring {out / 'ckpt-00000004'}: partial" in " ".join(info["notes"])
    sample.main([f"--out_dir={out}", "--max_new_tokens=4", "--num_samples=1"])
    assert "ckpt-00000002/ckpt-tp0-pp0.pt" in capsys.readouterr().out


O3_SHARD_WRITE_FAILS = """
import errno, os, sys
sys.path.insert(0, {repo!r})
import torch, train
if os.environ["RANK"] == "1":  # its own file of the checkpoint of iteration 4 finds the disk full
    write = torch.save

    def save(obj, f, *a, **k):
        if isinstance(obj, dict) and obj.get("iter_num") == 4:
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(obj, f, *a, **k)

    torch.save = save
train.cli({tiny!r} + ["precision=O3", "gradient_accumulation_steps=2", "max_iters=4", "eval_interval=2",
                      "out_dir={out}"])
"""


@pytest.mark.slow
@pytest.mark.dist
def test_an_o3_shard_that_cannot_be_written(tmp_path):
    """At O3 every rank writes its own optimizer shard into the set: a write that fails on rank 1
    only (the disk full) stops every rank with exit status 4 and one line (rank 0's) naming the
    file and the last good set; the set of that save is removed, the one before stays whole."""
    out = tmp_path / "out"
    script = tmp_path / "worker.py"
    script.write_text(O3_SHARD_WRITE_FAILS.format(repo=REPO, tiny=TINY, out=out))
    r = torchrun(2, script=str(script), check=False, timeout=300)
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert lines == [f"error: cannot write {out}/ckpt-00000004/optimizer-rank1.pt: No space left on device; "
                     f"nothing half-written is kept, and the last good checkpoint is {out}/ckpt-00000002 "
                     f"(iter 2)"], r.stderr[-3000:]
    assert "exitcode  : 4" in r.stderr and "[rank0]: Traceback" not in r.stderr, r.stderr[-3000:]
    assert sorted(f for f in os.listdir(out) if f.startswith("ckpt")) == ["ckpt-00000002"]
    assert sorted(os.listdir(out / "ckpt-00000002")) == ["ckpt.pt", MANIFEST, "optimizer-rank0.pt",
                                                         "optimizer-rank1.pt"]
    _, info = read_any(str(out))
    assert info["iter_num"] == 2 and info["layout"]["zero_world"] == 2


@pytest.mark.slow
@pytest.mark.dist
def test_ctrl_c_under_torchrun(tmp_path):
    """Ctrl-C (SIGINT to the whole job): the ranks exit 130 with one line, from rank 0, naming the
    last good set; no rank prints a traceback (torchrun itself still reports the signal)."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py", *TINY,
           "gradient_accumulation_steps=2", "max_iters=100000", "eval_interval=3", f"out_dir={out}"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    try:
        for line in proc.stdout:
            if line.startswith("iter 4:"):  # the set of iteration 3 is complete
                os.killpg(proc.pid, signal.SIGINT)
                break
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    _, info = read_any(str(out))  # the newest complete set: 3, or a later one if the ranks ran ahead of the reader
    newest = os.path.dirname(info["files"][0])
    ours = [ln for ln in err.splitlines() if ln.startswith(("interrupted", "error:", "[rank"))]
    assert ours == [f"interrupted (Ctrl-C): nothing half-written is kept; the last good checkpoint is "
                    f"{newest} (iter {info['iter_num']})"], err[-3000:]
    assert info["iter_num"] >= 3 and newest == str(out / f"ckpt-{info['iter_num']:08d}")
