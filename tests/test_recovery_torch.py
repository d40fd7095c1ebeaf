"""engine=torch's checkpoints (DCP sets, nanofp8/torchstack.py) held to the hand-written engine's
standard (tests/test_recovery.py): every fault is one line and an exit status, and no fault or
mistake costs the last good set.

What is checked, in one process where one process shows it (train.cli, sample.py's and
export.py's __main__ in-process) and under torchrun where only that does:
  * every DCP file is checked against the manifest's size and sha256 before it is read: a
    flipped weight or Adam moment, a shard cut short, a damaged .metadata, another set's dcp/,
    a shard missing together with its manifest entry are refused in one line naming the file,
    by a resume, sample.py and export.py, and the good set before it is not pruned;
  * a manifest that lacks its layout's engine is still read as the DCP set it is;
  * a full disk during the DCP save exits 4, a Ctrl-C or SIGTERM during it 130 or 143, and
    none leaves a partial set;
  * readers (sample.py, export.py) whose set is pruned while they read it read the newer one;
  * a lock file of JSON that is not an object, an export under a read-only parent: one line;
  * a rank that dies during a DCP save is named as dead, with the set it was writing and the
    last good one.
"""

import errno
import json
import os
import shutil
import signal
import sys

import pytest
import torch.distributed.checkpoint.filesystem as dcp_fs

import train
from conftest import REPO, TINY, torchrun
from nanofp8 import torchstack
from nanofp8.checkpoint import read_any
from nanofp8.outdir import LOCK, MANIFEST, discard_set
from test_recovery import cli, one_line, read_only, script, sets  # noqa: F401 (read_only: a fixture)

pytestmark = pytest.mark.usefixtures("shakespeare")

RUN = TINY + ["precision=O1", "engine=torch", "max_iters=4", "eval_interval=2"]  # sets at 2 and 4
RESUME = RUN + ["max_iters=6", "init_from=resume"]


@pytest.fixture(scope="module")
def torch_run(tmp_path_factory):
    """A one-process engine=torch run with its two DCP sets (iterations 2 and 4), to copy."""
    out = tmp_path_factory.mktemp("torch") / "out"
    train.main(RUN + [f"out_dir={out}"])
    return out


@pytest.fixture
def run_dir(torch_run, tmp_path):
    return shutil.copytree(torch_run, tmp_path / "out")


def damage(path, at, data):
    blob = bytearray(open(path, "rb").read())
    blob[at : at + len(data)] = data
    open(path, "wb").write(bytes(blob))


def readers_refuse(run_dir, line, capsys):
    """A resume, sample.py and export.py all refuse the set with `line` (exit 2), and the resume
    keeps both sets."""
    code, err = cli(RESUME + [f"out_dir={run_dir}"], capsys)
    assert code == 2 and one_line(err) == line
    assert sets(run_dir) == ["ckpt-00000002", "ckpt-00000004"]
    assert not os.path.exists(run_dir / "ckpt-00000006")
    code, err = script("sample.py", [f"--out_dir={run_dir}", "--max_new_tokens=4"], capsys)
    assert code == 2 and one_line(err) == line
    code, err = script("export.py", [f"--out_dir={run_dir}", f"--to={run_dir.parent / 'exp'}"], capsys)
    assert code == 2 and one_line(err) == line


def test_a_damaged_dcp_shard_is_refused_and_the_good_set_kept(run_dir, capsys):
    """4 bytes of a weight changed in the newest set's shard: a resume once loaded them, trained on
    and pruned the intact set before it; sample.py and export.py used them. Now each refuses the
    file, and both sets stay."""
    shard = run_dir / "ckpt-00000004" / "dcp" / "__0_0.distcp"
    state, _ = read_any(str(run_dir))
    w = state["blocks.0.mlp.c_fc.weight"].numpy().tobytes()
    damage(shard, open(shard, "rb").read().find(w[:64]) + 8, b"\xff\xff\x7f\x47")
    advice = f"restore it from a copy, or move {run_dir}/ckpt-00000004 out of the way to use the set before it"
    readers_refuse(run_dir, f"error: {shard} is damaged: its sha256 differs from its manifest's (changed or "
                            f"replaced); {advice}", capsys)


def test_dcp_files_cut_short_replaced_or_missing(run_dir, capsys):
    """Each once a traceback (CheckpointException, an unpickling error, FileNotFoundError) or, for
    another set's dcp/ put in place, a silent resume of other weights."""
    new, old = run_dir / "ckpt-00000004", run_dir / "ckpt-00000002"
    shard, meta = new / "dcp" / "__0_0.distcp", new / "dcp" / ".metadata"
    good = open(shard, "rb").read()
    open(shard, "wb").write(good[: len(good) // 2])
    advice = f"restore it from a copy, or move {new} out of the way to use the set before it"
    readers_refuse(run_dir, f"error: {shard} is damaged: it has {len(good) // 2:,} bytes, its manifest says "
                            f"{len(good):,} (cut short or overwritten); {advice}", capsys)
    open(shard, "wb").write(good)
    damage(meta, 100, b"\x00\x01\x02\x03")
    readers_refuse(run_dir, f"error: {meta} is damaged: its sha256 differs from its manifest's (changed or "
                            f"replaced); {advice}", capsys)
    shutil.rmtree(new / "dcp")
    shutil.copytree(old / "dcp", new / "dcp")  # a whole dcp/ of the same shape, other values
    code, err = cli(RESUME + [f"out_dir={run_dir}"], capsys)  # (its .metadata may be the same bytes)
    assert code == 2 and one_line(err) in [f"error: {f} is damaged: its sha256 differs from its manifest's (changed "
                                           f"or replaced); {advice}" for f in (meta, shard)]
    os.remove(shard)  # the shard, and its entry in the manifest
    manifest = json.loads(open(new / MANIFEST).read())
    del manifest["files"]["dcp/__0_0.distcp"]
    open(new / MANIFEST, "w").write(json.dumps(manifest))
    manifest["files"]["dcp/.metadata"] = torchstack._digest(meta)
    open(new / MANIFEST, "w").write(json.dumps(manifest))
    readers_refuse(run_dir, f"error: {meta} names dcp/__0_0.distcp, which {new}'s manifest does not list: the "
                            f"set is damaged; move {new} out of the way to use the set before it", capsys)


def test_a_manifest_without_its_engine_is_still_a_dcp_set(run_dir, capsys):
    """layout.engine missing from the manifest (KeyError: 'model' once): the files say the set is
    DCP's; the resume is exact (no conversion), sample.py reads it."""
    path = run_dir / "ckpt-00000004" / MANIFEST
    manifest = json.loads(open(path).read())
    del manifest["layout"]["engine"]
    open(path, "w").write(json.dumps(manifest))
    code, err = cli(RESUME + [f"out_dir={run_dir}"], capsys)
    assert code == 0 and "convert" not in cli.out and "ckpt-00000006" in cli.out, err
    code, err = script("sample.py", [f"--out_dir={run_dir / 'ckpt-00000004'}", "--max_new_tokens=4"], capsys)
    assert code == 0, err


def test_a_resume_keeps_its_recipe(run_dir, capsys):
    """The recipe is not among what a resume may change silently (another recipe once continued
    the run): refused in one line naming the key, for the preset's name and for a key of it."""
    path = run_dir / "ckpt-00000004" / "ckpt.pt"
    for key, was, now in (("fp8_recipe", "tensorwise", "rowwise"), ("fp8_margin", 0, 1)):
        code, err = cli(RESUME + [f"{key}={now}", f"out_dir={run_dir}"], capsys)
        assert code == 2 and one_line(err) == (
            f"error: {path} was written with {key}={was}; resuming with {key}={now} would cast the FP8 operands "
            f"by another recipe than the one the run trained with, silently. Pass {key}={was}, or start a new "
            f"run (init_from={run_dir / 'ckpt-00000004'}, another out_dir)")
    code, err = cli(RESUME + ["fp8_recipe=tensorwise", f"out_dir={run_dir}"], capsys)  # (the same keys)
    assert code == 0, err


def test_faults_during_a_dcp_save(run_dir, monkeypatch, capsys):
    """A full disk (exit 1 with a traceback and a partial set once), Ctrl-C and SIGTERM (the partial
    set stayed while the line said nothing was kept) inside DCP's write of the set of iteration 6:
    one line naming the last good set, the status of docs/checkpoints.md's table, no partial set."""
    real = dcp_fs._write_item
    last = f"the last good checkpoint is {run_dir}/ckpt-00000004 (iter 4)"
    for fault, status, line in (
            (lambda: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device")), 4,
             f"error: cannot write {run_dir}/ckpt-00000006/dcp: No space left on device; nothing half-written "
             f"is kept, and {last}"),
            (lambda: (_ for _ in ()).throw(KeyboardInterrupt()), 130,
             f"interrupted (Ctrl-C): nothing half-written is kept; {last}"),
            (lambda: os.kill(os.getpid(), signal.SIGTERM), 143,
             f"interrupted (SIGTERM): nothing half-written is kept; {last}")):
        def failing(*a, fault=fault, **k):
            fault()
            return real(*a, **k)

        monkeypatch.setattr(dcp_fs, "_write_item", failing)
        code, err = cli(RESUME + [f"out_dir={run_dir}"], capsys)
        monkeypatch.undo()
        assert code == status and one_line(err) == line
        assert sets(run_dir) == ["ckpt-00000002", "ckpt-00000004"]


def test_no_set_is_pruned_before_the_new_one_is_whole_on_disk(run_dir, monkeypatch, capsys):
    """A shard its rank wrote that rank 0 does not see (an out_dir that is not shared between
    nodes; here removed right after it was written): the save fails with exit 4 and one line,
    and keep_checkpoints=1 prunes nothing."""
    real = torchstack.write_dcp

    def written_elsewhere(*a, **k):
        records = real(*a, **k)
        os.remove(run_dir / "ckpt-00000006" / "dcp" / "__0_0.distcp")
        return records

    monkeypatch.setattr(torchstack, "write_dcp", written_elsewhere)
    code, err = cli(RESUME + ["keep_checkpoints=1", f"out_dir={run_dir}"], capsys)
    assert code == 4 and one_line(err) == (
        f"error: {run_dir}/ckpt-00000006/dcp/__0_0.distcp is not in {run_dir}/ckpt-00000006 as rank 0 sees it, "
        f"though its rank wrote it: out_dir must be one directory that every node shares; nothing half-written is "
        f"kept, and the last good checkpoint is {run_dir}/ckpt-00000004 (iter 4)")
    assert sets(run_dir) == ["ckpt-00000002", "ckpt-00000004"]


def test_readers_of_a_set_pruned_while_they_read_it(run_dir, monkeypatch, capsys):
    """sample.py or export.py beside a run that saves with keep_checkpoints=1: the set they picked
    is removed under them (a FileNotFoundError traceback, or "no checkpoint at ..." once); they read
    the newest set there is then."""
    real = torchstack.read_dcp_set
    pruned = []

    def read_while_pruned(found):
        if not pruned:  # the run saves a newer set and prunes this one
            shutil.copytree(run_dir / "ckpt-00000002", run_dir / "ckpt-00000006")
            manifest = json.loads(open(run_dir / "ckpt-00000006" / MANIFEST).read())
            manifest["sequence"] = 3
            open(run_dir / "ckpt-00000006" / MANIFEST, "w").write(json.dumps(manifest))
            discard_set(found.path)
            pruned.append(found.path)
        return real(found)

    monkeypatch.setattr(torchstack, "read_dcp_set", read_while_pruned)
    code, err = script("sample.py", [f"--out_dir={run_dir}", "--max_new_tokens=4"], capsys)
    assert code == 0 and pruned == [str(run_dir / "ckpt-00000004")], err
    assert "ckpt-00000006/ckpt.pt" in script.out


def test_a_lock_of_other_json_and_an_export_under_a_read_only_parent(run_dir, tmp_path, read_only, capsys):
    """train.lock holding JSON that is not an object (AttributeError once) is a stale lock; an
    export whose --to cannot be made (OSError once) exits 4 with one line."""
    lock = run_dir / LOCK
    lock.write_text("[1, 2]")
    os.utime(lock, (0, 0))  # not a lock being written right now
    code, err = cli(RESUME + [f"out_dir={run_dir}"], capsys)
    assert code == 0 and f"note: removed a stale lock {lock} (unreadable)" in cli.out, err
    parent = read_only(tmp_path / "ro")
    code, err = script("export.py", [f"--out_dir={run_dir}", f"--to={parent / 'exp'}"], capsys)
    assert code == 4 and one_line(err) == (f"error: cannot make {parent / 'exp'}: Read-only file system; nothing "
                                           f"half-written is left")


RANK_DIES_IN_A_DCP_SAVE = """
import os, sys
sys.path.insert(0, {repo!r})
import torch.distributed.checkpoint.filesystem as fs
import train
from nanofp8 import torchstack
if os.environ["RANK"] == "1":  # dies as it writes its shard of the second set (iteration 4)
    saves, write_dcp, write_item = [], torchstack.write_dcp, fs._write_item
    torchstack.write_dcp = lambda *a, **k: saves.append(1) or write_dcp(*a, **k)
    fs._write_item = lambda *a, **k: os._exit(9) if len(saves) == 2 else write_item(*a, **k)
train.cli({tiny!r} + ["precision=O1", "engine=torch", "gradient_accumulation_steps=2", "max_iters=4",
                      "eval_interval=2", "out_dir={out}"])
"""


@pytest.mark.slow
@pytest.mark.dist
def test_a_rank_that_dies_in_a_dcp_save_is_named(tmp_path):
    """Once: "a collective did not complete within dist_timeout=600s; rank 0 names the ranks that
    do not answer (...Connection reset...)" at once, no rank named, no set pointed to."""
    out = tmp_path / "out"
    worker = tmp_path / "worker.py"
    worker.write_text(RANK_DIES_IN_A_DCP_SAVE.format(repo=REPO, tiny=TINY, out=out))
    # torchrun stops the other ranks (SIGTERM) once it sees one die, by default within 0.1 s: rank 0
    # then says it was interrupted, which a loaded machine made it do before it saw the death
    r = torchrun(2, script=str(worker), check=False, timeout=300, launcher=["--monitor-interval=3"])
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert lines == [f"error: rank 0: rank 1 died (the process exited) while saving {out}/ckpt-00000004, so the run "
                     f"stopped; the last good checkpoint is {out}/ckpt-00000002 (iter 2): resume from it with "
                     f"init_from=resume"], r.stderr[-3000:]
    assert not os.path.exists(out / "ckpt-00000004" / MANIFEST)
    assert read_any(str(out))[1]["iter_num"] == 2
