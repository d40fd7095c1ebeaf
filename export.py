"""
Export a model out of nanofp8: plain tensors, no pickle.

    python export.py --out_dir=out-shakespeare-char-fp8 --to=exported-shakespeare-char
    python export.py --out_dir=out-gpt2-fp8 --to=gpt2-hf --format=hf     # loads in transformers
    python export.py --out_dir=out-llama-fp8 --to=llama-fp8 --format=hf-fp8   # vLLM, SGLang, transformers

out_dir is anything sample.py reads: a training run of any level (bf16, O1, O2, O3) and any layout
(tensor/pipeline parallel: one file per rank), an earlier export, or a Hugging Face GPT-2 or LLaMA.

--format=fp8 (the default) writes the portable format of nanofp8/interop.py: config.json and
model.safetensors with the block Linear weights as float8_e4m3fn plus one fp32 scale per output
row (w = weight.float() * weight_scale), everything else fp32. About 1 byte per block weight:
what an FP8 inference engine or a frozen RLHF reference model needs. --format=fp32 keeps every
tensor fp32 (lossless, for further training). --format=hf writes the Hugging Face layout of the
model's arch, fp32: transformers' GPT2LMHeadModel (gpt2) or LlamaForCausalLM (llama)
.from_pretrained(DIR) computes the same logits.

--format=hf-fp8 (llama only) writes LlamaForCausalLM with the block Linears in E4M3, the bytes the
run's FP8 GEMMs read, in a format that transformers loads as FP8 (nanofp8/interop.py HF_FP8): a
run trained with 128x128 weight tiles (fp8_recipe=blockwise) as transformers' "fp8" with
weight_block_size [128, 128]; every other as compressed-tensors' "float-quantized", one scale per
output channel. A run whose weights were not cast per row (tensorwise, delayed, mxfp8, bf16) gets
its weights cast per row here, and the export says so. GPT-2 has no FP8 layout here: its Conv1D
matrices are stored transposed, (in, out), so a scale per row of W would be a scale per column of
the stored tensor, which no loader of that format reads.

Fine-tune from an export with train.py init_from=DIR (config/finetune_shakespeare.py).

--to must be a new or empty directory, or (with --force) an earlier export to replace; never a
training run's out_dir, whose checkpoints would hide the export from every reader. Each file is
written whole or not at all. Exit status: 0 done, 2 a bad argument or an unreadable model, 4 a
write that failed (disk full), 130 Ctrl-C; nothing half-written is left.
"""

import os
import sys

from nanofp8.checkpoint import read_any
from nanofp8.configurator import RECIPE_KEYS, ConfigError, check_choice, configure, defaults_of
from nanofp8.fp8 import BLOCK, E4M3, Recipe
from nanofp8.interop import export_hf_gpt2, export_hf_llama, export_portable
from nanofp8.ckptfile import CheckpointError, WriteError
from nanofp8.outdir import LOCK, MANIFEST, SET_NAME, legacy_files

# -----------------------------------------------------------------------------
out_dir = "out"  # the model to export (see above)
to = ""  # the directory to write (created)
format = "fp8"  # "fp8" | "fp32" | "hf" | "hf-fp8"
force = False  # replace an earlier export in `to`
DEFAULTS = defaults_of(globals())
# -----------------------------------------------------------------------------


def main(argv=None):
    cfg = configure(DEFAULTS, sys.argv[1:] if argv is None else argv)
    check_choice(cfg, "format", ("fp8", "fp32", "hf", "hf-fp8"))
    if not cfg["to"]:
        raise ConfigError("say where to write the export: --to=DIR")
    if os.path.abspath(cfg["to"]) == os.path.abspath(cfg["out_dir"]):
        raise ConfigError("--to must be another directory than --out_dir (it would overwrite the source)")
    check_target(cfg["to"], cfg["force"])
    state, info = read_any(cfg["out_dir"])
    for note in info["notes"]:
        print(f"note: {note}")
    if cfg["format"] == "hf-fp8":
        if info["model_args"]["arch"] != "llama":
            raise ConfigError("--format=hf-fp8 needs arch=llama: GPT-2's Conv1D stores each matrix transposed, "
                              "(in, out), so a scale per row of W would be per column of the stored tensor, which "
                              "no GPT-2 loader reads; use --format=hf (fp32) or --format=fp8 (portable)")
        granularity, margin, note = hf_fp8_cast(info["config"])
        if note:
            print(f"note: {note}")
        written = export_hf_llama(state, info["model_args"], cfg["to"], fp8=granularity, margin=margin)
    elif cfg["format"] == "hf":
        hf_export = export_hf_llama if info["model_args"]["arch"] == "llama" else export_hf_gpt2
        written = hf_export(state, info["model_args"], cfg["to"])
    else:
        train_cfg = info["config"]
        # What sample.py needs to find the tokenizer and validation data again.
        keep = {k: train_cfg[k] for k in ("dataset", "precision", "batch_size", "block_size") if k in train_cfg}
        written = export_portable(state, info["model_args"], cfg["to"], fp8=cfg["format"] == "fp8",
                                  extra={"config": keep, "iter_num": info["iter_num"]})
    size = sum(os.path.getsize(f) for f in written)
    print(f"exported {info['source']} to {cfg['to']} ({cfg['format']}, {size / 2**20:.2f} MB)")


def hf_fp8_cast(train_cfg):
    """(granularity, margin, note) of the weight cast that --format=hf-fp8 writes for a run of these
    settings: the run's own where an HF format stores it (E4M3 per row, or per 128x128 tile), else
    "row" and a note saying that these bytes are cast now, not the ones the run's GEMMs read."""
    how = f"precision={train_cfg['precision']}" if "precision" in train_cfg else "no FP8 recipe recorded"
    if train_cfg.get("precision") in ("O1", "O2", "O3") and "fp8_granularity" in train_cfg:
        keys = {field: train_cfg[key] for key, field in RECIPE_KEYS.items() if key in train_cfg}
        recipe = Recipe.from_name(train_cfg.get("fp8_recipe") or "tensorwise", **keys)
        fmt, granularity, tile = recipe.casts["w"]
        if fmt is E4M3 and recipe.scaling == "current" and not recipe.power_of_two and recipe.grid != "mx" and (
                granularity == "row" or granularity == "block" and tile == (BLOCK, BLOCK)):
            return granularity, recipe.margin, None
        how = recipe.describe()
    return "row", 0, (f"the run's weights were not cast as an HF FP8 format stores them ({how}): written "
                      "with one scale per output row, cast now")


def check_target(to, force):
    """ConfigError unless `to` may take the export: new, empty, or (force) an earlier export; never
    a training run's out_dir (readers would take its checkpoints, not the export)."""
    if not os.path.exists(to):
        return
    if not os.path.isdir(to):
        raise ConfigError(f"--to={to} is a file, not a directory")
    entries = os.listdir(to)
    if legacy_files(to) or MANIFEST in entries or LOCK in entries or any(SET_NAME.fullmatch(e) for e in entries):
        raise ConfigError(f"--to={to} is a training run's out_dir: its checkpoints would hide the export "
                          f"from sample.py, export.py and init_from; export into a new or empty directory")
    if entries and not force:
        what = "an earlier export" if "config.json" in entries else f"{len(entries)} entries ({', '.join(sorted(entries)[:3])})"
        raise ConfigError(f"--to={to} already holds {what}: pass --force=True to replace it, or export into a "
                          f"new or empty directory")


if __name__ == "__main__":
    try:
        main()
    except (ConfigError, CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except WriteError as e:
        print(f"error: {e}; nothing half-written is left", file=sys.stderr)
        sys.exit(4)
    except KeyboardInterrupt:
        print("interrupted (Ctrl-C): nothing half-written is left", file=sys.stderr)
        sys.exit(130)
