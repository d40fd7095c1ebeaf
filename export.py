"""
Export a model out of nanofp8: plain tensors, no pickle.

    python export.py --out_dir=out-shakespeare-char-fp8 --to=exported-shakespeare-char
    python export.py --out_dir=out-gpt2-fp8 --to=gpt2-hf --format=hf     # loads in transformers

out_dir is anything sample.py reads: a training run of any level (bf16, O1, O2, O3) and any layout
(tensor/pipeline parallel: one file per rank), an earlier export, or a Hugging Face GPT-2.

--format=fp8 (the default) writes the portable format of nanofp8/interop.py: config.json and
model.safetensors with the block Linear weights as float8_e4m3fn plus one fp32 scale per output
row (w = weight.float() * weight_scale), everything else fp32. About 1 byte per block weight:
what an FP8 inference engine or a frozen RLHF reference model needs. --format=fp32 keeps every
tensor fp32 (lossless, for further training). --format=hf writes the Hugging Face GPT-2 layout
(arch=gpt2 only): transformers.GPT2LMHeadModel.from_pretrained(DIR) computes the same logits.

Fine-tune from an export with train.py init_from=DIR (config/finetune_shakespeare.py).
"""

import os
import sys

from nanofp8.checkpoint import read_any
from nanofp8.configurator import ConfigError, check_choice, configure, defaults_of
from nanofp8.interop import export_hf_gpt2, export_portable
from nanofp8.model import CheckpointError

# -----------------------------------------------------------------------------
out_dir = "out"  # the model to export (see above)
to = ""  # the directory to write (created)
format = "fp8"  # "fp8" | "fp32" | "hf"
DEFAULTS = defaults_of(globals())
# -----------------------------------------------------------------------------


def main(argv=None):
    cfg = configure(DEFAULTS, sys.argv[1:] if argv is None else argv)
    check_choice(cfg, "format", ("fp8", "fp32", "hf"))
    if not cfg["to"]:
        raise ConfigError("say where to write the export: --to=DIR")
    if os.path.abspath(cfg["to"]) == os.path.abspath(cfg["out_dir"]):
        raise ConfigError("--to must be another directory than --out_dir (it would overwrite the source)")
    state, info = read_any(cfg["out_dir"])
    for note in info["notes"]:
        print(f"note: {note}")
    if cfg["format"] == "hf":
        export_hf_gpt2(state, info["model_args"], cfg["to"])
    else:
        train_cfg = info["config"]
        # What sample.py needs to find the tokenizer and validation data again.
        keep = {k: train_cfg[k] for k in ("dataset", "precision", "batch_size", "block_size") if k in train_cfg}
        export_portable(state, info["model_args"], cfg["to"], fp8=cfg["format"] == "fp8",
                        extra={"config": keep, "iter_num": info["iter_num"]})
    size = sum(os.path.getsize(os.path.join(cfg["to"], f)) for f in os.listdir(cfg["to"]))
    print(f"exported {info['source']} to {cfg['to']} ({cfg['format']}, {size / 2**20:.2f} MB)")


if __name__ == "__main__":
    try:
        main()
    except (ConfigError, CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
