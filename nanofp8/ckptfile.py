"""
The checkpoint file: what one file holds, how it is written so that no fault leaves a torn file
behind, and how it is read back with a clear error instead of a traceback.

A checkpoint file is a dict of tensors, plain Python values and nested dicts/lists of those, so it
loads with torch.load(weights_only=True): unpickling an arbitrary object can run arbitrary code,
a tensor cannot. Checkpoint sets (several files and their manifest) are nanofp8/outdir.py's;
converting between levels and layouts is nanofp8/checkpoint.py's.
"""

import glob
import hashlib
import os
import re
import zlib

import torch

# -----------------------------------------------------------------------------
# Checkpoints
#
# Keys: format, model (state_dict, FP8 scaling state included), optimizer,
# model_args (GPTConfig fields), config (the run's settings), iter_num, best_val_loss, rng,
# fp8_ranks (every data-parallel rank's FP8 scaling state, nanofp8/run.py's scaling_state), and
# checksums: a CRC-32 of every tensor's bytes, by its path in the dict ("model/tok_emb.weight",
# "optimizer/state/3/step"), so that a damaged file is reported by the tensor that is damaged.
# At O3 the optimizer entry only names the files of the shards, {"zero_shard_files": [rank 0's,
# ...]}; each of those holds format, optimizer (that rank's state_dict), iter_num and checksums.
# A training run writes its files in checkpoint sets whose manifest also holds each file's size
# and sha256 (nanofp8/outdir.py); load_checkpoint checks the file against it when given one.

CKPT_FORMAT = "nanofp8-ckpt-1"


class CheckpointError(RuntimeError):
    pass


class WriteError(RuntimeError):
    """A file could not be written (disk full, read-only file system). Nothing half-written is left
    behind; the scripts exit with status 4."""


def is_newer_format(found, current):
    """Whether `found` names a later version of the format `current` ("nanofp8-ckpt-2" against
    "nanofp8-ckpt-1"): a file of a newer nanofp8, to be refused with "update", not "not ours"."""
    name, _, version = current.rpartition("-")
    later = re.fullmatch(re.escape(name) + r"-(\d+)", str(found))
    return bool(later) and int(later[1]) > int(version)


def tensor_checksums(obj, prefix=""):
    """{path of every tensor in a nested dict/list: CRC-32 of its bytes}."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    out = {}
    for key, value in items:
        name = f"{prefix}{key}"
        if torch.is_tensor(value):
            raw = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            out[name] = zlib.crc32(raw.numpy())
        elif isinstance(value, (dict, list, tuple)):
            out.update(tensor_checksums(value, name + "/"))
    return out


def check_checksums(saved, obj, path, advice):
    """CheckpointError naming the first tensor of `obj` whose CRC-32 is not its `saved` one (or
    that is missing on either side): `path` is damaged."""
    now = tensor_checksums(obj)
    bad = sorted(set(now) ^ set(saved)) + [k for k in now if k in saved and saved[k] != now[k]]
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise CheckpointError(f"{path} is damaged: tensor {bad[0]}{more} does not match its checksum; {advice}")


class _HashingWriter:
    """A file object for torch.save that also counts and hashes what goes through it."""

    def __init__(self, f):
        self.f, self.sha256, self.size = f, hashlib.sha256(), 0

    def write(self, data):
        self.sha256.update(data)
        self.size += len(data)
        return self.f.write(data)

    def flush(self):
        self.f.flush()


def file_sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def root_cause(error):
    """The KeyboardInterrupt or OSError behind an exception, if any. torch.save reports a failed
    write or a Ctrl-C inside it as a RuntimeError about its zip writer ("unexpected pos"); the
    cause is in the chain of __context__s."""
    while error is not None and not isinstance(error, (KeyboardInterrupt, OSError)):
        error = error.__cause__ or error.__context__
    return error


def fsync_dir(path):
    """Make a rename inside `path` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def make_dir(path):
    """os.makedirs(path, exist_ok=True), a failure (read-only parent, disk full) a WriteError."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise WriteError(f"cannot make {path}: {e.strerror or e}") from None


def write_file(path, data):
    """Write bytes to path whole or not at all: a temp file beside it, flushed to disk, renamed
    into place. A failed write (disk full, read-only) is a WriteError and leaves no temp file."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(path) or ".")
    except OSError as e:
        raise WriteError(f"cannot write {path}: {e.strerror or e}") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def save_checkpoint(ckpt, path):
    """Write atomically: to a temp file in the same directory, flushed to disk, then renamed over
    the target. A crash mid-write leaves the previous checkpoint intact, never half a file. The
    temp files a killed writer left behind (path.tmp.<pid>, as large as a checkpoint) are removed
    first, unless their process still runs (another job writing to the same directory).
    Returns {"bytes": size, "sha256": hex digest} of the file (for a set's manifest).

    A write that fails (disk full, read-only) is a WriteError, and Ctrl-C stays a
    KeyboardInterrupt: torch would report either as its zip writer's "unexpected pos". The temp
    file is removed in every case."""
    ckpt = {"format": CKPT_FORMAT, **{k: v for k, v in ckpt.items() if k not in ("format", "checksums")}}
    ckpt["checksums"] = tensor_checksums(ckpt)
    for stale in glob.glob(glob.escape(path) + ".tmp.*"):
        pid = stale.rsplit(".", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not process_alive(int(pid)):
            os.remove(stale)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            out = _HashingWriter(f)
            torch.save(ckpt, out)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic on POSIX and Windows
        fsync_dir(os.path.dirname(path) or ".")
    except BaseException as e:
        cause = root_cause(e)
        if isinstance(cause, KeyboardInterrupt):
            raise KeyboardInterrupt from None
        if isinstance(cause, OSError):
            raise WriteError(f"cannot write {path}: {cause.strerror or cause}") from None
        raise
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return {"bytes": out.size, "sha256": out.sha256.hexdigest()}


def process_alive(pid):
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


CKPT_KEYS = ("model", "model_args", "config", "iter_num")  # what a model file holds at least


def load_checkpoint(path, map_location="cpu", expect=None, keys=CKPT_KEYS):
    """Load and sanity-check a checkpoint; every failure is a CheckpointError naming the file.
    expect: the file's entry in its set's manifest ({"bytes", "sha256"}): a file of another size or
    another sha256 is damaged, and the error names the first tensor whose CRC-32 differs. Without
    one (a file outside a set) the tensors' CRC-32s are checked. keys: the entries the file must
    have (an O3 optimizer shard's file: "optimizer" and "iter_num")."""
    if not os.path.isfile(path):
        raise CheckpointError(f"no checkpoint at {path}")
    intact = None
    if expect is not None:
        size = os.path.getsize(path)
        if size != expect["bytes"]:
            raise CheckpointError(f"{path} is damaged: it has {size:,} bytes, its manifest says "
                                  f"{expect['bytes']:,} (cut short or overwritten)")
        intact = file_sha256(path) == expect["sha256"]
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # truncated zip, random bytes, a pickle with forbidden objects, ...
        # Not torch's message: for a pickle holding objects it advises retrying with
        # weights_only=False, which is exactly how such a file would run its code.
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        if intact is False:
            why = "damaged: its sha256 differs from its manifest's and it cannot be read"
        elif found:
            why = f"not a nanofp8 checkpoint: it holds Python objects ({found.group(1)}), not only tensors and plain values"
        else:
            why = "not a nanofp8 checkpoint: truncated or corrupt (not the zip archive torch.save writes)"
        raise CheckpointError(f"{path} is {why}") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != CKPT_FORMAT:
        found = ckpt.get("format") if isinstance(ckpt, dict) else type(ckpt).__name__
        if is_newer_format(found, CKPT_FORMAT):
            raise CheckpointError(f"{path} was written by a newer nanofp8 (format {found!r}; this version "
                                  f"reads {CKPT_FORMAT!r}): update nanofp8 to read it")
        raise CheckpointError(f"{path} is not a nanofp8 checkpoint (expected format "
                              f"{CKPT_FORMAT!r}, found {found!r})")
    if not intact:  # no manifest, or one that disagrees: find the damaged tensor
        if "checksums" in ckpt:  # (files of nanofp8 versions before checksums have none)
            check_checksums(ckpt["checksums"], {k: v for k, v in ckpt.items() if k != "checksums"}, path,
                            "restore the file from a copy or use another checkpoint")
        if intact is False:
            raise CheckpointError(f"{path} is damaged: its sha256 differs from its manifest's, outside "
                                  f"its tensors (the iteration or the settings); restore the file from "
                                  f"a copy or use another checkpoint")
    for key in keys:
        if key not in ckpt and not (key == "model" and "dcp" in ckpt):  # (engine=torch: the shards in dcp/)
            raise CheckpointError(f"checkpoint {path} has no '{key}' entry")
    return ckpt


# -----------------------------------------------------------------------------
# Loading a model's state

# The buffers Fp8Linear adds to a Linear: FP8 scaling state, not weights. A bf16 model can ignore
# them in an FP8 checkpoint, and an FP8 model starts them fresh when loading a bf16 checkpoint.
FP8_STATE_KEYS = ("amax_history", "history_count", "scale", "nonfinite", "clipped")


def load_model_state(model, state, source="checkpoint"):
    """model.load_state_dict that tolerates exactly one difference: FP8 scaling state present in
    one of (model, state) and not the other. Anything else missing or extra is an error."""
    state = {k.removeprefix("_orig_mod."): v for k, v in state.items()}  # saved from a compiled model
    own = model.state_dict()
    is_fp8_state = lambda k: k.rsplit(".", 1)[-1] in FP8_STATE_KEYS  # noqa: E731
    state = {k: v for k, v in state.items() if k in own or not is_fp8_state(k)}
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # shape mismatches: a different model size or fp8_history_len
        raise CheckpointError(f"{source} does not fit this model: {e}") from None
    missing = [k for k in missing if not is_fp8_state(k)]
    if missing or unexpected:
        raise CheckpointError(f"{source} does not fit this model: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}")
