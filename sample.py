"""
Generate text from a model: a training run's out_dir (bf16, O1, O2, O3, tensor or pipeline
parallel: nanofp8/checkpoint.py resolves O2's scaled fp16 masters, O3's sharded masters and the
model-parallel shards into one single-device model), a portable export (export.py), or a
Hugging Face GPT-2 or LLaMA directory.

    python sample.py --out_dir=out-shakespeare-char-fp8
    python sample.py --out_dir=out-shakespeare-char-fp8 --start="ROMEO." --num_samples=2
    python sample.py --out_dir=out-shakespeare-char-fp8 --start=FILE:prompt.txt
    python sample.py --out_dir=out-shakespeare-char-fp8 --fp8_weights=True

    python sample.py --out_dir=exported-shakespeare-char      # written by export.py

The model runs its matmuls in bf16 (autocast), whatever precision it was trained in: every level
comes back as fp32 weights (exactly the trained ones: O2's master is w * scale in fp16, O3's the
same cut into shards); FP8 scaling state is training state and is ignored here.

fp8_weights=True is weight-only FP8 for inference (nanofp8.checkpoint.freeze_fp8, from any level):
every Linear inside the blocks keeps its weight as E4M3 (1 byte per weight, plus an fp32 scale
per row, per 128x128 block or per tensor) instead of fp32, and dequantizes it on the fly for each matmul. That is how an FP8 checkpoint shrinks a
model's memory at serving time, and the script measures what it costs: the validation loss with
the original weights and with the FP8 ones, on the same batches, and the bytes saved.
"""

import math
import os
import sys

import torch

from nanofp8.checkpoint import freeze_fp8, load_for_inference, weight_bytes
from nanofp8.configurator import ConfigError, check_choice, check_device, configure, defaults_of, read_dataset_meta
from nanofp8.data import EVAL_STREAMS, Tokens, batch_generator, data_dir, get_batch, token_dtype
from nanofp8.ckptfile import CheckpointError
from nanofp8.fp8 import GRANULARITIES

# -----------------------------------------------------------------------------
out_dir = "out"  # a training run's out_dir (its newest checkpoint set), one set (out/ckpt-00000020), an export
start = "\n"  # the prompt, or "FILE:path" to read it from a file
num_samples = 3
max_new_tokens = 500
temperature = 0.8  # < 1 sharpens the distribution, > 1 flattens it; 0 = always the top token
top_k = 200  # sample only among the k most likely tokens (0 = all)
seed = 1337
device = "auto"  # "auto" | "cpu" | "cuda" ...
fp8_weights = False  # hold the block Linear weights in FP8 (E4M3) and report the cost
fp8_weight_granularity = "row"  # "tensor" | "row" (per output channel) | "block" (128x128)
fp8_eval_iters = 20  # validation batches for the full-precision vs FP8-weights comparison
DEFAULTS = defaults_of(globals())
# -----------------------------------------------------------------------------


@torch.no_grad()
def val_loss(model, val_data, batch_size, block_size, iters, autocast, device):
    """Mean loss on `iters` validation batches: train.py's own (nanofp8/data.py, seeded by index),
    the same ones on every call."""
    total = 0.0
    for k in range(iters):
        gen = batch_generator(seed, EVAL_STREAMS["val"], 0, k, 0)
        x, y = get_batch(val_data, batch_size, block_size, gen, device)
        with autocast:
            _, loss = model(x, y)
        total += loss.item()
    return total / iters


def check_args(cfg):
    """The settings' ranges, checked before the checkpoint is read; each mistake names its key."""
    check_choice(cfg, "fp8_weight_granularity", GRANULARITIES)
    for key, low in (("num_samples", 1), ("max_new_tokens", 1), ("top_k", 0), ("fp8_eval_iters", 1)):
        if cfg[key] < low:
            raise ConfigError(f"config key '{key}' must be >= {low}, got {cfg[key]}")
    # A negative temperature flips the distribution: it would sample the least likely tokens.
    if not (math.isfinite(cfg["temperature"]) and cfg["temperature"] >= 0):
        raise ConfigError(f"config key 'temperature' must be >= 0 (0 = always the top token), "
                          f"got {cfg['temperature']}")
    if cfg["start"].startswith("FILE:") and not os.path.isfile(cfg["start"][5:]):
        raise ConfigError(f"config key 'start': no prompt file {cfg['start'][5:]!r}")
    check_device(cfg["device"])


def read_prompt(start):
    """The prompt: `start` itself, or the text of the file it names (FILE:path), which must be UTF-8."""
    if not start.startswith("FILE:"):
        return start
    try:
        with open(start[5:], encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise ConfigError(f"config key 'start': {start[5:]} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at "
                          f"offset {e.start}): give a text file as the prompt") from None


def load_tokenizer(dataset, vocab_size):
    """(encode, decode): the character tables of the dataset's meta.json if it has one, else
    GPT-2 BPE (whose 50257 tokens a model of a smaller vocabulary cannot have been trained on)."""
    meta = read_dataset_meta(data_dir(dataset))
    if meta is not None and meta["itos"] is None:
        meta = None  # a vocabulary size only: the tokens are GPT-2 BPE
    if meta is not None:
        itos = meta["itos"]
        stoi = {c: i for i, c in enumerate(itos)}

        def encode(s):
            unknown = sorted(set(s) - set(stoi))
            if unknown:
                raise ConfigError(f"the prompt has characters the model has never seen: {unknown}")
            return [stoi[c] for c in s]

        # ids beyond the tables: a vocabulary padded past the dataset's (never trained to appear)
        return encode, lambda ids: "".join(itos[i] if i < len(itos) else "\ufffd" for i in ids)
    if vocab_size < 50257:
        raise ConfigError(f"no tokenizer for this model: data/{dataset}/meta.json is missing and a "
                          f"vocabulary of {vocab_size} tokens is not GPT-2 BPE; recreate the tables "
                          f"with: python data/{dataset}/prepare.py")
    try:
        import tiktoken
    except ImportError:
        raise ConfigError(f"dataset '{dataset}' uses GPT-2 BPE (no data/{dataset}/meta.json), which "
                          f"needs tiktoken: pip install tiktoken") from None
    enc = tiktoken.get_encoding("gpt2")
    return (lambda s: enc.encode(s, allowed_special={"<|endoftext|>"})), enc.decode


def main(argv=None):
    cfg = configure(DEFAULTS, sys.argv[1:] if argv is None else argv)
    check_args(cfg)
    prompt = read_prompt(cfg["start"])
    globals().update(cfg)  # the settings become this module's globals, as in a plain script
    dev = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    autocast = torch.autocast(dev.split(":")[0], dtype=torch.bfloat16)

    # Any level (O2/O3 masters resolved), any layout (TP/PP shards merged), or an exported model.
    model, info = load_for_inference(out_dir, dev)
    train_cfg = info["config"]
    print(f"loaded {info['source']}: iter {info['iter_num']}, {model.num_params() / 1e6:.2f}M parameters")
    for note in info["notes"]:
        print(f"note: {note}")

    if fp8_weights:
        val_path = os.path.join(data_dir(train_cfg.get("dataset", "?")), "val.bin")
        val_data = Tokens(val_path, token_dtype(train_cfg.get("dataset", "?"))) if os.path.exists(val_path) else None
        args = (train_cfg.get("batch_size", 8), model.config.block_size, fp8_eval_iters, autocast, dev)
        ref = val_loss(model, val_data, *args) if val_data is not None else None
        total_before = weight_bytes(model)
        on_gpu = dev.startswith("cuda")
        allocated = torch.cuda.memory_allocated() if on_gpu else 0
        model, st = freeze_fp8(model, fp8_weight_granularity)  # nanofp8/checkpoint.py
        before, after = st["fp32"], st["fp8"]
        mb = lambda b: f"{b / 2**20:.2f} MB"  # noqa: E731
        print(f"FP8 weights ({fp8_weight_granularity} scales): {st['weights']:,} block Linear weights "
              f"{mb(before)} (fp32) -> {mb(after)} (E4M3 + scales); saved {mb(before - after)} "
              f"({100 * (1 - after / before):.1f}%, and {mb(st['bf16'] - after)} vs bf16: "
              f"{100 * (1 - after / st['bf16']):.1f}%); whole model {mb(total_before)} -> {mb(weight_bytes(model))}")
        if on_gpu:  # what the allocator really gave back, not just the arithmetic above
            print(f"GPU memory allocated: {mb(allocated)} -> {mb(torch.cuda.memory_allocated())}")
        if val_data is not None:
            loss8 = val_loss(model, val_data, *args)
            print(f"val loss over {fp8_eval_iters} batches: {ref:.4f} with the original weights, "
                  f"{loss8:.4f} with FP8 weights ({loss8 - ref:+.4f}, {100 * (loss8 - ref) / ref:+.2f}%)")
        else:
            print(f"(no {val_path}: cannot compare validation losses)")

    # no dataset (a Hugging Face GPT-2, say): GPT-2 BPE
    encode, decode = load_tokenizer(train_cfg.get("dataset", "openwebtext"), model.config.vocab_size)
    ids = torch.tensor([encode(prompt) or encode("\n")], dtype=torch.long, device=dev)
    gen = torch.Generator(device=dev).manual_seed(seed)
    for _ in range(num_samples):
        with autocast:
            out = model.generate(ids, max_new_tokens, temperature=temperature, top_k=top_k or None, generator=gen)
        print(decode(out[0].tolist()))
        print("---------------")


if __name__ == "__main__":
    try:
        main()
    except (ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
