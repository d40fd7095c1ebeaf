"""
Generate text from a checkpoint written by train.py.

    python sample.py --out_dir=out-shakespeare-char-fp8
    python sample.py --out_dir=out-shakespeare-char-fp8 --start="ROMEO." --num_samples=2
    python sample.py --out_dir=out-shakespeare-char-fp8 --start=FILE:prompt.txt
    python sample.py --out_dir=out-shakespeare-char-fp8 --fp8_weights=True

The model runs its matmuls in bf16 (autocast), whatever precision it was trained in: an O1
checkpoint holds the same fp32 weights as a bf16 one, plus FP8 scaling state that only training
needs (and that is ignored here).

fp8_weights=True is weight-only FP8 for inference: every Linear inside the blocks keeps its weight
as E4M3 (1 byte per weight, plus an fp32 scale per row, per 128x128 block or per tensor) instead
of fp32, and dequantizes it on the fly for each matmul. That is how an FP8 checkpoint shrinks a
model's memory at serving time, and the script measures what it costs: the validation loss with
the original weights and with the FP8 ones, on the same batches, and the bytes saved.
"""

import math
import os
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from nanofp8.configurator import ConfigError, check_choice, configure, defaults_of, read_dataset_meta
from nanofp8.model import GPT, CheckpointError, GPTConfig, load_checkpoint, load_model_state

# -----------------------------------------------------------------------------
out_dir = "out"  # where train.py wrote ckpt.pt
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

REPO = os.path.dirname(os.path.abspath(__file__))


class Fp8WeightLinear(nn.Module):
    """A Linear whose weight lives in FP8: the E4M3 bytes and their scales, nothing else.
    Each forward dequantizes it (one fp8 -> bf16 pass over the weight) and runs a bf16 matmul.
    On an FP8 GPU one would hand the bytes to torch._scaled_mm instead and never dequantize;
    dequantizing keeps this portable and isolates the one thing measured here: what the
    rounding of the weights to 3 mantissa bits does to the model."""

    def __init__(self, linear, granularity):
        super().__init__()
        from nanofp8.fp8 import E4M3, quantize

        # quantize() contracts over the last dim, which for a (out, in) weight is the GEMM's K:
        # "row" gives one scale per output channel, "block" one per 128x128 tile.
        self.q = quantize(linear.weight.detach(), E4M3, granularity, block=(128, 128))
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x):
        from nanofp8.fp8 import dequantize

        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        return F.linear(x, dequantize(self.q, dtype), self.bias)

    def nbytes(self):
        return self.q.data.numel() * self.q.data.element_size() + self.q.scale.numel() * self.q.scale.element_size()


def model_bytes(model):
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def to_fp8_weights(model, granularity):
    """Swap the block Linears for Fp8WeightLinear. Returns (weights, bytes before, bytes after)."""
    n_weights, before, after = 0, 0, 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            fqn = f"{name}.{child_name}" if name else child_name
            if isinstance(child, nn.Linear) and fqn.startswith("blocks."):
                n_weights += child.weight.numel()
                before += child.weight.numel() * child.weight.element_size()
                new = Fp8WeightLinear(child, granularity)
                after += new.nbytes()
                setattr(module, child_name, new)  # the fp32 weight is now unreferenced: freed
    return n_weights, before, after


@torch.no_grad()
def val_loss(model, val_data, batch_size, block_size, iters, autocast, device):
    """Mean loss on `iters` fixed validation batches (the same ones on every call)."""
    gen = torch.Generator().manual_seed(seed)
    total = 0.0
    for _ in range(iters):
        ix = torch.randint(len(val_data) - block_size, (batch_size,), generator=gen).tolist()
        xy = torch.from_numpy(np.stack([val_data[i : i + block_size + 1] for i in ix]).astype(np.int64)).to(device)
        with autocast:
            _, loss = model(xy[:, :-1].contiguous(), xy[:, 1:].contiguous())
        total += loss.item()
    return total / iters


def check_args(cfg):
    """The settings' ranges, checked before the checkpoint is read; each mistake names its key."""
    check_choice(cfg, "fp8_weight_granularity", ("tensor", "row", "block"))
    for key, low in (("num_samples", 1), ("max_new_tokens", 1), ("top_k", 0), ("fp8_eval_iters", 1)):
        if cfg[key] < low:
            raise ConfigError(f"config key '{key}' must be >= {low}, got {cfg[key]}")
    # A negative temperature flips the distribution: it would sample the least likely tokens.
    if not (math.isfinite(cfg["temperature"]) and cfg["temperature"] >= 0):
        raise ConfigError(f"config key 'temperature' must be >= 0 (0 = always the top token), "
                          f"got {cfg['temperature']}")
    if cfg["start"].startswith("FILE:") and not os.path.isfile(cfg["start"][5:]):
        raise ConfigError(f"config key 'start': no prompt file {cfg['start'][5:]!r}")


def load_tokenizer(dataset, vocab_size):
    """(encode, decode): the character tables of the dataset's meta.json if it has one, else
    GPT-2 BPE (whose 50257 tokens a model of a smaller vocabulary cannot have been trained on)."""
    data_dir = os.path.join(REPO, "data", dataset)
    meta = read_dataset_meta(data_dir)
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
    globals().update(cfg)  # the settings become this module's globals, as in a plain script
    dev = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    autocast = torch.autocast(dev.split(":")[0], dtype=torch.bfloat16)

    ckpt_path = os.path.join(out_dir, "ckpt.pt")
    ckpt = load_checkpoint(ckpt_path, map_location="cpu")
    model = GPT(GPTConfig(**ckpt["model_args"]))
    load_model_state(model, ckpt["model"], ckpt_path)
    model.eval().to(dev)
    train_cfg = ckpt["config"]
    print(f"loaded {ckpt_path}: iter {ckpt['iter_num']}, {model.num_params() / 1e6:.2f}M parameters, "
          f"trained with precision={train_cfg['precision']}")
    del ckpt

    if fp8_weights:
        val_path = os.path.join(REPO, "data", train_cfg["dataset"], "val.bin")
        val_data = np.memmap(val_path, dtype=np.uint16, mode="r") if os.path.exists(val_path) else None
        args = (train_cfg["batch_size"], train_cfg["block_size"], fp8_eval_iters, autocast, dev)
        ref = val_loss(model, val_data, *args) if val_data is not None else None
        total_before = model_bytes(model)
        on_gpu = dev.startswith("cuda")
        allocated = torch.cuda.memory_allocated() if on_gpu else 0
        n, before, after = to_fp8_weights(model, fp8_weight_granularity)
        total_after = model_bytes(model) + after  # the FP8 bytes are plain attributes, not buffers
        mb = lambda b: f"{b / 2**20:.2f} MB"  # noqa: E731
        print(f"FP8 weights ({fp8_weight_granularity} scales): {n:,} block Linear weights "
              f"{mb(before)} (fp32) -> {mb(after)} (E4M3 + scales); saved {mb(before - after)} "
              f"({100 * (1 - after / before):.1f}%, and {mb(before // 2 - after)} vs bf16); "
              f"whole model {mb(total_before)} -> {mb(total_after)}")
        if on_gpu:  # what the allocator really gave back, not just the arithmetic above
            print(f"GPU memory allocated: {mb(allocated)} -> {mb(torch.cuda.memory_allocated())}")
        if val_data is not None:
            loss8 = val_loss(model, val_data, *args)
            print(f"val loss over {fp8_eval_iters} batches: {ref:.4f} with the original weights, "
                  f"{loss8:.4f} with FP8 weights ({loss8 - ref:+.4f}, {100 * (loss8 - ref) / ref:+.2f}%)")
        else:
            print(f"(no {val_path}: cannot compare validation losses)")

    encode, decode = load_tokenizer(train_cfg["dataset"], model.config.vocab_size)
    prompt = start
    if prompt.startswith("FILE:"):
        with open(prompt[5:], encoding="utf-8") as f:
            prompt = f.read()
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
