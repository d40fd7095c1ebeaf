"""
OpenWebText, GPT-2 BPE tokens: the dataset of the GPT-2 and LLaMA configs (GPU-scale runs).

    pip install tiktoken datasets
    python data/openwebtext/prepare.py

Downloads the corpus from the Hugging Face Hub (~55 GB of cache during preparation), tokenizes
it with GPT-2's byte-pair encoding (tiktoken) and writes, next to this file:

    train.bin   ~9B tokens (~17 GB), uint16 (the 50257 GPT-2 ids fit in 16 bits)
    val.bin     ~4M tokens, a 0.05% random slice of the documents

Every document is followed by the end-of-text token (50256), so the model sees where one ends.
train.py draws random windows from these files through np.memmap, without reading them whole.

Needs a network connection: offline, it stops with a message saying what is missing. Expect
tens of minutes with many cores (num_proc), hours with few.
"""

import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
NUM_PROC = max(1, (os.cpu_count() or 2) // 2)  # tokenization workers
VAL_FRACTION = 0.0005
SEED = 2357
HF_DATASET = "Skylion007/openwebtext"  # the Hub's copy of Gokaslan & Cohen's corpus (2019)
SHARDS = 1024  # written in shards, so no more than 1/SHARDS of the tokens is in memory at once


def fail(msg):
    print(f"prepare openwebtext: {msg}", file=sys.stderr)
    sys.exit(1)


def main():
    try:
        import tiktoken
        from datasets import load_dataset
        from tqdm import tqdm
    except ImportError as e:
        fail(f"missing package ({e.name}). Install the preparation dependencies with:\n"
             f"    pip install tiktoken datasets tqdm")

    try:
        enc = tiktoken.get_encoding("gpt2")  # downloads the BPE tables once, then cached
    except Exception as e:
        fail(f"could not load the GPT-2 tokenizer (offline? tiktoken fetches its tables on first "
             f"use): {type(e).__name__}: {e}")
    if enc.n_vocab > 1 << 16:  # never: GPT-2 has 50,257. A larger vocabulary would wrap in uint16
        fail(f"the tokenizer has {enc.n_vocab:,} ids, more than uint16 holds: its token files need uint32 "
             f"and a meta.json that says so (as data/shakespeare_char/prepare.py writes)")
    try:
        dataset = load_dataset(HF_DATASET, num_proc=NUM_PROC)
    except Exception as e:
        fail(f"could not download OpenWebText from the Hugging Face Hub (offline?): "
             f"{type(e).__name__}: {e}")

    split = dataset["train"].train_test_split(test_size=VAL_FRACTION, seed=SEED, shuffle=True)
    split["val"] = split.pop("test")

    def tokenize(example):
        ids = enc.encode_ordinary(example["text"])  # ordinary: a literal "<|endoftext|>" is text
        ids.append(enc.eot_token)
        return {"ids": ids, "len": len(ids)}

    tokenized = split.map(tokenize, remove_columns=["text"], desc="tokenizing", num_proc=NUM_PROC)

    for name, docs in tokenized.items():
        n_tokens = int(np.sum(docs["len"], dtype=np.uint64))
        path = os.path.join(HERE, f"{name}.bin")
        tmp = path + ".tmp"
        out = np.memmap(tmp, dtype=np.uint16, mode="w+", shape=(n_tokens,))
        shards = min(SHARDS, len(docs))
        pos = 0
        for i in tqdm(range(shards), desc=f"writing {name}.bin ({n_tokens:,} tokens)"):
            part = docs.shard(num_shards=shards, index=i, contiguous=True).with_format("numpy")
            ids = np.concatenate(part["ids"]).astype(np.uint16)
            out[pos : pos + len(ids)] = ids
            pos += len(ids)
        out.flush()
        del out
        os.replace(tmp, path)  # only a complete file gets the final name


if __name__ == "__main__":
    main()
