"""
Token data for train.py and sample.py: data/<name>/{train,val}.bin, token ids memory-mapped, uint16
or, where meta.json says "dtype": "uint32", uint32 (a vocabulary above 65,536 tokens).

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

from .configurator import ConfigError, read_dataset_meta

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout, when run from one
DATA_ENV = "NANOFP8_DATA"  # a folder of datasets elsewhere: data/<dataset>/ lives at $NANOFP8_DATA/<dataset>/
PREPARED_ON_DEMAND = ("shakespeare_char",)  # small enough to prepare inside train.py
# Datasets whose prepare.py writes meta.json (their vocabulary), last: without it the
# preparation did not finish, and without the vocabulary a model would get GPT-2's.
WITH_META = ("shakespeare_char",)
TRAIN_STREAM, EVAL_STREAMS = 0, {"train": 1, "val": 2}
SPLITS = ("train", "val")


class DataError(ConfigError):
    """A batch holds a token id the model has no embedding for: found by the rank that drew it,
    during training (the run's own checks at start sample the files)."""


def data_root():
    """The folder that holds one folder per dataset. $NANOFP8_DATA where set; else the checkout's
    data/ (the package beside it: a clone, or an editable install); else data/ under the current
    directory, as nanoGPT reads it: after `pip install .` the package sits in site-packages, where
    there is no data/, and a user runs train.py from the checkout that has one."""
    if os.environ.get(DATA_ENV):
        return os.path.abspath(os.environ[DATA_ENV])
    checkout = os.path.join(REPO, "data")
    return checkout if os.path.isdir(checkout) else os.path.abspath("data")


def data_dir(dataset):
    return os.path.join(data_root(), dataset)


def _shown(path):
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def check_dataset(dataset):
    """ConfigError unless the dataset is prepared or can be prepared here. Returns whether it
    must be prepared first. Every rank calls it before the process group exists, so a typo in
    `dataset` stops all of them at once instead of leaving the others waiting for rank 0.
    Prepared means: train.bin and val.bin, whole token ids of the dataset's type (token_dtype), and
    meta.json where the dataset's prepare.py writes one (WITH_META)."""
    folder = data_dir(dataset)
    wanted = [f"{s}.bin" for s in SPLITS] + (["meta.json"] if dataset in WITH_META else [])
    missing = [f for f in wanted if not os.path.exists(os.path.join(folder, f))]
    script = os.path.join(folder, "prepare.py")
    if not missing:
        dtype = token_dtype(dataset)
        for split in SPLITS:
            path = os.path.join(folder, f"{split}.bin")
            size = os.path.getsize(path)
            if size % dtype.itemsize or size == 0:
                what = "is empty" if size == 0 else f"has {size:,} bytes, not a whole number of {dtype} token ids"
                raise ConfigError(f"{_shown(path)} {what} (cut short or not written by prepare.py): prepare the "
                                  f"dataset again with python {_shown(script)}")
        return False
    if not os.path.exists(script):
        if os.path.isdir(folder) and len(missing) < len(wanted):  # a dataset of one's own, half there
            raise ConfigError(f"dataset '{dataset}' is incomplete: {_shown(os.path.join(folder, missing[0]))} "
                              f"is missing (the dataset needs {', '.join(wanted)})")
        root = data_root()
        known = sorted(d for d in (os.listdir(root) if os.path.isdir(root) else [])
                       if os.path.exists(os.path.join(root, d, "prepare.py")))
        where = f"the datasets are {known}" if known else (f"{_shown(root)} holds no dataset: run from the nanofp8 "
                                                          f"checkout, or set {DATA_ENV} to its data/ folder")
        raise ConfigError(f"config key 'dataset': unknown dataset {dataset!r} (no {_shown(script)}); {where}")
    if dataset not in PREPARED_ON_DEMAND:
        raise ConfigError(f"dataset '{dataset}' is not prepared ({_shown(os.path.join(folder, missing[0]))} is "
                          f"missing). Prepare it first with:\n    python {_shown(script)}")
    return True


def ensure_dataset(dataset):
    """Prepare the dataset first if it is missing and small enough to do so here."""
    if not check_dataset(dataset):
        return
    script = os.path.join(data_dir(dataset), "prepare.py")
    print(f"dataset '{dataset}' is not prepared yet: running {_shown(script)}")
    if subprocess.run([sys.executable, script]).returncode != 0:
        raise ConfigError(f"preparing dataset '{dataset}' failed (see above)")
    check_dataset(dataset)  # what it wrote must be whole


def token_dtype(dataset):
    """The numpy type of the dataset's token files: meta.json's "dtype" (read_dataset_meta checks
    that the vocabulary fits it), uint16 for a dataset without meta.json or without the key."""
    meta = read_dataset_meta(data_dir(dataset))
    return np.dtype(meta["dtype"] if meta else "uint16")


class Tokens:
    """One split's token ids (uint16 or uint32), memory-mapped (never read whole), and the vocabulary
    they must fit (set by check_tokens): get_batch refuses a window holding an id beyond it."""

    def __init__(self, path, dtype=np.uint16):
        self.path, self.ids, self.vocab_size = path, np.memmap(path, dtype=dtype, mode="r"), None

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return self.ids[index]


def open_splits(dataset, block_size, layout):
    """{'train': Tokens, 'val': Tokens}; rank 0 prepares a missing dataset first while the others
    wait. Each split must hold at least one window of block_size + 1 tokens (a shorter one would
    crash inside torch.randint)."""
    if layout.master:
        ensure_dataset(dataset)
    layout.barrier()
    dtype = token_dtype(dataset)
    data = {s: Tokens(os.path.join(data_dir(dataset), f"{s}.bin"), dtype) for s in SPLITS}
    for split, tokens in data.items():
        if len(tokens) < block_size + 1:
            raise ConfigError(f"block_size={block_size} is too long for {tokens.path}: it holds {len(tokens):,} "
                              f"tokens, and a batch needs windows of block_size + 1; use block_size <= "
                              f"{len(tokens) - 1}")
    return data


# Files up to CHECK_WHOLE tokens (64 MB) are checked whole at start; larger ones (an OpenWebText
# train.bin holds ~9B tokens, 17 GB) in SAMPLES evenly spread windows of SAMPLE_WIDTH tokens
# (8 MB read in all), and from then on get_batch checks every window it draws.
CHECK_WHOLE, SAMPLES, SAMPLE_WIDTH = 1 << 25, 64, 1 << 16


def check_tokens(data, vocab_size):
    """Before training: the token ids of every split fit the model's vocabulary (the whole file,
    or evenly spread samples of a large one); from then on get_batch checks each window it draws.
    A ConfigError names the file, the id and its position."""
    for tokens in data.values():
        n = len(tokens)
        if n <= CHECK_WHOLE:
            starts, width = [0], n
        else:
            starts, width = np.linspace(0, n - SAMPLE_WIDTH, SAMPLES).astype(np.int64).tolist(), SAMPLE_WIDTH
        for start in starts:
            window = tokens.ids[start : start + width]
            top = int(window.max())
            if top >= vocab_size:
                where = start + int(np.argmax(window >= vocab_size))
                raise ConfigError(_beyond(tokens.path, top, where, vocab_size))
        tokens.vocab_size = vocab_size


def _beyond(path, token, position, vocab_size):
    return (f"{_shown(path)} holds token id {token} at position {position:,}, beyond the model's vocabulary "
            f"({vocab_size} ids): the file is damaged or was made for another vocabulary; prepare the "
            f"dataset again")


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
    bound = getattr(data, "vocab_size", None)
    if bound is not None and window.max() >= bound:  # a stray id: an IndexError, or a CUDA assert
        row, col = np.argwhere(window >= bound)[0]
        raise DataError(_beyond(data.path, int(window[row, col]), ix[row] + int(col), bound))
    xy = torch.from_numpy(window)
    if device.startswith("cuda"):
        xy = xy.pin_memory().to(device, non_blocking=True)  # the copy overlaps the GPU's work
    else:
        xy = xy.to(device)
    return xy[:, :-1].contiguous(), xy[:, 1:].contiguous()
