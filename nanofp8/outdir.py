"""
What a training run keeps in its out_dir, and how it keeps it safe: checkpoint sets, a lock, and
the checks that out_dir can take a checkpoint before any training starts.

    out/
      ckpt-00000020/        the newest checkpoint set: the state after iteration 20
        ckpt.pt             one file per (tensor, pipeline) rank: ckpt-tp0-pp0.pt, ckpt-tp1-pp0.pt
        optimizer-rank0.pt  O3 only: each rank's shard of the optimizer state, written by that rank
        optimizer-rank1.pt
        manifest.json       written last: the set is complete once it exists
      ckpt-00000010/        the set before it (keep_checkpoints=2)
      train.lock            the run writing here (pid, host, start); removed when it ends
      fp8_stats.jsonl       the FP8 statistics (nanofp8/stats.py trims it on resume)

Writing a set takes two steps. Every rank that writes saves its files into the set's directory,
atomically (a temp file renamed into place, nanofp8/ckptfile.py): data-parallel rank 0 of each
(tensor, pipeline) position its model file, and at O3 every rank its own optimizer shard, which
no other rank ever receives. When all of them have, rank 0 writes manifest.json the same way,
so it appears whole or not at all. The manifest names the iteration, the layout that wrote the
set, and every file with its size and sha256. A set without a manifest is partial (its save
was interrupted or failed); a set whose manifest names a missing file is broken. Readers
(resume, sample.py, export.py, init_from=DIR) take the newest complete set, by `sequence` (a
count of the saves in this out_dir: the order of writing, not of iterations), and list the sets
they ignore and why. A set is removed only once `keep` newer complete sets exist (prune), so at
every moment the last good set is on disk.

Checkpoint files written before sets existed (out_dir/ckpt.pt, ckpt-tp*-pp*.pt, no manifest)
are still read when no set exists (nanofp8/checkpoint.py: find_checkpoint), and count as the
oldest set when pruning.

The lock: train.lock holds the pid, host and process start time of the run writing into
out_dir. Another run refuses to start. A lock whose process is gone (killed, or the machine
restarted) is stale and is taken over, with a note.
"""

import atexit
import json
import os
import re
import shutil
import socket
import sys
import time
from dataclasses import dataclass

from .configurator import ConfigError
from .ckptfile import CheckpointError, is_newer_format, make_dir, process_alive, write_file

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "nanofp8-set-1"
LOCK = "train.lock"
SET_NAME = re.compile(r"ckpt-(\d{8,})")
SHARD_FILE = re.compile(r"optimizer-rank(\d+)\.pt")  # (shard_file's names)


def set_name(iter_num):
    return f"ckpt-{iter_num:08d}"


def shard_file(rank):
    """The file of a set that holds O3's optimizer shard of data-parallel rank `rank`."""
    return f"optimizer-rank{rank}.pt"


@dataclass
class CheckpointSet:
    """A checkpoint on disk: a set's directory and its manifest, or (manifest None) the files an
    older nanofp8 wrote straight into out_dir."""

    path: str  # the directory holding the files
    files: list  # their names, rank 0's first
    iter_num: int = None
    sequence: int = 0  # 0: files of an older nanofp8
    manifest: dict = None

    def file(self, name):
        return os.path.join(self.path, name)

    def expected(self, name):
        """The manifest's {"bytes", "sha256"} of a file (None without a manifest)."""
        return self.manifest["files"].get(name) if self.manifest else None

    @property
    def dcp(self):
        """Whether engine=torch wrote the set: its files include DCP shards (in dcp/, torchstack.DCP_DIR)."""
        return any(f.startswith("dcp/") for f in self.files)

    def layout(self):
        """The layout that wrote the set; its engine read off the files (self.dcp), which the
        manifest's hashes vouch for, rather than trusted to a key of its own."""
        if not self.manifest:
            return None
        return {**self.manifest["layout"], "engine": "torch" if self.dcp else "nanofp8"}

    def __str__(self):
        if self.manifest is None:
            return ", ".join(self.file(f) for f in self.files)
        return f"{self.path} (iter {self.iter_num})"


def read_manifest(set_dir):
    """The manifest of a set directory, None if it has none (a partial set). CheckpointError for
    one that cannot be read, or that a newer nanofp8 wrote."""
    path = os.path.join(set_dir, MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} cannot be read ({type(e).__name__}: {e}): move {set_dir} "
                              f"out of the way to use the sets before it") from None
    found = manifest.get("format") if isinstance(manifest, dict) else None
    if found != MANIFEST_FORMAT:
        if is_newer_format(found, MANIFEST_FORMAT):
            raise CheckpointError(f"{set_dir} was written by a newer nanofp8 (manifest format {found!r}; "
                                  f"this version reads {MANIFEST_FORMAT!r}): update nanofp8 to read it")
        raise CheckpointError(f"{path} is not a nanofp8 manifest (format {found!r}, expected "
                              f"{MANIFEST_FORMAT!r})")
    if not (isinstance(manifest.get("files"), dict) and isinstance(manifest.get("iter_num"), int)
            and isinstance(manifest.get("sequence"), int) and isinstance(manifest.get("layout"), dict)):
        raise CheckpointError(f"{path} is damaged: it lacks its files, iteration, sequence or layout; move "
                              f"{set_dir} out of the way to use the sets before it")
    return manifest


def read_set(path):
    """(the complete set in directory `path`, None), or (None, why it is not complete)."""
    manifest = read_manifest(path)
    if manifest is None:
        return None, "partial: no manifest.json (its save was interrupted or failed)"
    missing = [f for f in manifest["files"] if not os.path.isfile(os.path.join(path, f))]
    if missing:
        return None, f"broken: its manifest names {missing[0]}, which is missing"
    return CheckpointSet(path, list(manifest["files"]), manifest["iter_num"], manifest["sequence"], manifest), None


def scan(out_dir, strict=True):
    """(complete sets, newest first; [(set directory, why it is not complete)]). A manifest that
    cannot be read, or that a newer nanofp8 wrote, is a CheckpointError; with strict=False (the
    writer's view) its set is left out of both lists, and so left alone."""
    complete, incomplete = [], []
    names = sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []
    for name in names:
        path = os.path.join(out_dir, name)
        if not (SET_NAME.fullmatch(name) and os.path.isdir(path)):
            continue
        try:
            found, why = read_set(path)
        except CheckpointError:
            if strict:
                raise
            continue
        if found is None:
            incomplete.append((path, why))
        else:
            complete.append(found)
    complete.sort(key=lambda s: s.sequence, reverse=True)
    return complete, incomplete


def legacy_files(out_dir):
    """Checkpoint files of nanofp8 versions before sets, straight in out_dir."""
    if not os.path.isdir(out_dir):
        return []
    return sorted(f for f in os.listdir(out_dir) if re.fullmatch(r"ckpt(-tp\d+-pp\d+)?\.pt", f))


def newest_set(out_dir):
    """(the newest complete set or None, notes on what is ignored and why)."""
    complete, incomplete = scan(out_dir)
    notes = [f"ignoring {path}: {why}" for path, why in incomplete]
    if complete:
        notes += [f"ignoring {os.path.join(out_dir, f)}: written by an older nanofp8, before the sets "
                  f"(removed once {out_dir} holds newer ones)" for f in legacy_files(out_dir)]
    return (complete[0] if complete else None), notes


def nothing_found(out_dir):
    """Why out_dir has no checkpoint to read, for the error message."""
    if not os.path.isdir(out_dir):
        return f"{out_dir} does not exist"
    entries = sorted(os.listdir(out_dir))
    if not entries:
        return f"{out_dir} is empty"
    _, incomplete = scan(out_dir)
    temps = [e for e in entries if ".tmp." in e]
    if incomplete:
        return "; ".join(f"{path} is {why}" for path, why in incomplete)
    if temps:
        return f"{out_dir} holds only unfinished writes ({', '.join(temps[:3])}): the run stopped during its first save"
    return f"{out_dir} holds no checkpoint set (ckpt-NNNNNNNN/manifest.json) and no ckpt.pt"


def last_good(out_dir):
    """What to tell a user whose run stops: the checkpoint to resume from."""
    try:
        found, _ = newest_set(out_dir)
    except CheckpointError:
        found = None
    if found is not None:
        return f"the last good checkpoint is {found}"
    if legacy_files(out_dir):
        return f"the last good checkpoint is {os.path.join(out_dir, legacy_files(out_dir)[0])}"
    return f"{out_dir} holds no checkpoint yet"


# -----------------------------------------------------------------------------
# Writing a set (rank 0 begins and commits; every writing rank saves its file in between)


def begin_set(out_dir, iter_num):
    """Make the directory of the set of iter_num, removing what a failed save or a replaced run
    left under that name (its manifest first, so that it is never complete with mixed files)."""
    path = os.path.join(out_dir, set_name(iter_num))
    discard_set(path)
    make_dir(path)
    return path


def commit_set(path, iter_num, files, layout, **extra):
    """Write the manifest that makes the set at `path` complete. files: {name: {"bytes", "sha256"}}
    with rank 0's file first. Returns the set."""
    complete, _ = scan(os.path.dirname(path), strict=False)
    sequence = 1 + max([s.sequence for s in complete], default=0)
    manifest = {"format": MANIFEST_FORMAT, "iter_num": iter_num, "sequence": sequence,
                "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "layout": layout, "files": files, **extra}
    write_file(os.path.join(path, MANIFEST), json.dumps(manifest, indent=1).encode())
    return CheckpointSet(path, list(files), iter_num, sequence, manifest)


def unwritten(found):
    """The first file of a just-committed set that is not on disk at its manifest's size, as this
    process sees it (None if all are): the check before any older set is pruned. A file written on
    another node into an out_dir that is not shared is not there."""
    for name, record in found.manifest["files"].items():
        path = found.file(name)
        if not os.path.isfile(path) or os.path.getsize(path) != record["bytes"]:
            return path
    return None


def prune(out_dir, keep):
    """Keep the newest `keep` complete sets (the files of an older nanofp8 count as the oldest);
    remove the rest, and every partial or broken set (a set whose manifest cannot be read, or
    that a newer nanofp8 wrote, is left alone). Returns what was removed."""
    complete, incomplete = scan(out_dir, strict=False)
    removed = [path for path, _ in incomplete] + [s.path for s in complete[keep:]]
    for path in removed:
        discard_set(path)
    if len(complete) >= keep:
        for f in legacy_files(out_dir):
            os.remove(os.path.join(out_dir, f))
            removed.append(os.path.join(out_dir, f))
    return removed


def discard_set(path):
    """Remove a set directory (if there is one), its manifest first: a set is never complete with
    some of its files gone."""
    try:
        os.remove(os.path.join(path, MANIFEST))
    except OSError:
        pass
    shutil.rmtree(path, ignore_errors=True)


# -----------------------------------------------------------------------------
# Before training: can out_dir take a checkpoint?


def check_writable(out_dir):
    """None if out_dir can be created and written, else why not (one line)."""
    probe = os.path.join(out_dir, f".write-test.{os.getpid()}")
    try:
        os.makedirs(out_dir, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"nanofp8")
        os.remove(probe)
    except OSError as e:
        return (f"cannot write in out_dir {out_dir} ({e.strerror or e}): no checkpoint could be "
                f"saved; make it writable or pick another out_dir")
    return None


def room_for(out_dir, need):
    """(free bytes, None if a checkpoint of `need` bytes fits, else why not)."""
    free = shutil.disk_usage(out_dir).free
    if free >= need:
        return free, None
    return free, (f"out_dir {out_dir} has {free / 2**20:,.1f} MiB free, and one checkpoint takes about "
                  f"{need / 2**20:,.1f} MiB: free some space or pick another out_dir")


# -----------------------------------------------------------------------------
# The lock


def _process_start(pid):
    """The process's start time since boot (Linux: /proc), to tell a reused pid from its first owner."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _holder_running(holder):
    """Whether the process that wrote a lock still runs. Another host's process cannot be
    checked: it counts as running."""
    if holder.get("host") != socket.gethostname():
        return True
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid == os.getpid():  # this process: left by an earlier run in it
        return False
    if not process_alive(pid):
        return False
    start = _process_start(pid)
    return holder.get("start") is None or start is None or start == holder["start"]


_held = set()  # the lock files this process holds (released at exit at the latest)


def acquire_lock(out_dir):
    """Take out_dir's lock. Returns a note when a stale lock was taken over (else None); raises
    ConfigError when another run holds it."""
    path = os.path.join(out_dir, LOCK)
    me = {"pid": os.getpid(), "host": socket.gethostname(), "start": _process_start(os.getpid()),
          "since": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)[:500]}
    note = None
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                with open(path) as f:
                    holder = json.load(f)
                if not isinstance(holder, dict):  # valid JSON, but not what a run writes
                    raise ValueError
            except (OSError, ValueError):  # being written, cut short by a crash, or not ours
                if time.time() - os.path.getmtime(path) < 10:
                    raise ConfigError(f"out_dir {out_dir} is being locked by another run starting now "
                                      f"({path}): wait for it, or use another out_dir") from None
                holder = {}
            if holder and _holder_running(holder):
                raise ConfigError(f"out_dir {out_dir} is in use by another run (pid {holder.get('pid')} on "
                                  f"{holder.get('host')}, since {holder.get('since')}): wait for it to end, "
                                  f"or use another out_dir; if that run is gone, delete {path}") from None
            note = (f"removed a stale lock {path}" + (f" of pid {holder['pid']} (no longer running)"
                                                      if holder.get("pid") else " (unreadable)"))
            os.remove(path)
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        if not _held:
            atexit.register(release_locks)
        _held.add(path)
        return note
    raise ConfigError(f"could not take the lock {path}: another run keeps taking it")


def release_lock(out_dir):
    path = os.path.join(out_dir, LOCK)
    if path in _held:
        _held.discard(path)
        try:
            with open(path) as f:
                mine = json.load(f).get("pid") == os.getpid()
        except (OSError, ValueError):
            mine = False
        if mine:
            os.remove(path)


def release_locks():
    for path in list(_held):
        release_lock(os.path.dirname(path))
