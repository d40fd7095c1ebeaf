"""
Token data for train.py and sample.py: data/<name>/{train,val}.bin, uint16 token ids, memory-mapped.

Reproducibility: a batch is drawn with a generator seeded from (seed, stream, iteration, index,
rank), never from a global RNG. The data "position" of a run is then simply its iteration number,
so a run that is stopped and resumed from its checkpoint sees the same batches as one that never
stopped.
"""

import os
import subprocess
import sys

import numpy as np
import torch

from .configurator import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREPARED_ON_DEMAND = ("shakespeare_char",)  # small enough to prepare inside train.py
TRAIN_STREAM, EVAL_STREAMS = 0, {"train": 1, "val": 2}


def data_dir(dataset):
    return os.path.join(REPO, "data", dataset)


def _shown(path):
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def check_dataset(dataset):
    """ConfigError unless the dataset is prepared or can be prepared here. Returns whether it
    must be prepared first. Every rank calls it before the process group exists, so a typo in
    `dataset` stops all of them at once instead of leaving the others waiting for rank 0."""
    wanted = [os.path.join(data_dir(dataset), f) for f in ("train.bin", "val.bin")]
    if all(os.path.exists(p) for p in wanted):
        return False
    script = os.path.join(data_dir(dataset), "prepare.py")
    if not os.path.exists(script):
        known = sorted(d for d in os.listdir(os.path.join(REPO, "data"))
                       if os.path.exists(os.path.join(REPO, "data", d, "prepare.py")))
        raise ConfigError(f"config key 'dataset': unknown dataset {dataset!r} (no {_shown(script)}); "
                          f"the datasets are {known}")
    if dataset not in PREPARED_ON_DEMAND:
        raise ConfigError(f"dataset '{dataset}' is not prepared ({wanted[0]} is missing). "
                          f"Prepare it first with:\n    python {_shown(script)}")
    return True


def ensure_dataset(dataset):
    """Prepare the dataset first if it is missing and small enough to do so here."""
    if not check_dataset(dataset):
        return
    script = os.path.join(data_dir(dataset), "prepare.py")
    print(f"dataset '{dataset}' is not prepared yet: running {_shown(script)}")
    if subprocess.run([sys.executable, script]).returncode != 0:
        sys.exit(f"error: preparing dataset '{dataset}' failed (see above)")


def open_splits(dataset, block_size, layout):
    """{'train': tokens, 'val': tokens}, memory-mapped; rank 0 prepares a missing dataset first
    while the others wait. Each split must hold at least one window of block_size + 1 tokens (a
    shorter one would crash inside torch.randint)."""
    if layout.master:
        ensure_dataset(dataset)
    layout.barrier()
    data = {s: np.memmap(os.path.join(data_dir(dataset), f"{s}.bin"), dtype=np.uint16, mode="r")
            for s in ("train", "val")}
    for split, tokens in data.items():
        if len(tokens) < block_size + 1:
            raise ConfigError(f"block_size={block_size} is too long for {os.path.join(data_dir(dataset), split)}"
                              f".bin: it holds {len(tokens):,} tokens, and a batch needs windows of "
                              f"block_size + 1; use block_size <= {len(tokens) - 1}")
    return data


def vocab_size_for(meta, asked, default, dataset, log):
    """The vocabulary size to build: the dataset's (meta.json), or `asked` when it is given
    explicitly (not the default) and is at least as large (padding, e.g. to a multiple of 16 for
    an FP8 LM head)."""
    if meta is None:
        return asked
    need = meta["vocab_size"]
    if asked == default:
        return need
    if asked < need:
        raise ConfigError(f"config key 'vocab_size' is {asked}, but dataset '{dataset}' "
                          f"has {need} tokens: leave vocab_size out (or give one >= {need})")
    if asked != need:
        log(f"note: vocab_size={asked} (the dataset's {need} tokens, padded; the extra ids never occur)")
    return asked


def batch_generator(seed, stream, i, j, rank):
    """A fresh generator for one batch: training batch (i=iteration, j=micro step) or evaluation
    batch (j=index), seeded by the tuple. Python's hash of a tuple of non-negative ints is the
    same in every process and every run (only str/bytes hashing is salted), so a restarted run
    draws exactly the batches the uninterrupted one would have."""
    return torch.Generator().manual_seed(hash((seed, stream, i, j, rank)) & (2**63 - 1))


def get_batch(data, batch_size, block_size, gen, device):
    """batch_size random windows of block_size + 1 tokens: inputs, and the same shifted by one."""
    ix = torch.randint(len(data) - block_size, (batch_size,), generator=gen).tolist()
    window = np.stack([data[i : i + block_size + 1] for i in ix]).astype(np.int64)
    xy = torch.from_numpy(window)
    if device.startswith("cuda"):
        xy = xy.pin_memory().to(device, non_blocking=True)  # the copy overlaps the GPU's work
    else:
        xy = xy.to(device)
    return xy[:, :-1].contiguous(), xy[:, 1:].contiguous()
