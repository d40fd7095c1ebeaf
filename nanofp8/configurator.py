"""
The one config mechanism shared by train.py and sample.py, and train.py's validation.

A script declares its settings as plain module-level variables with sensible defaults. Then,
in the order they appear on the command line:

    python train.py config/shakespeare_char_fp8.py      a Python file: executed, and every
                                                        top-level name it assigns is an override
    python train.py --max_iters=500 precision=O1        key=value, with or without the dashes

Values are parsed as Python literals (`500`, `3e-4`, `True`, `'x'`, `None`) and fall back to a
plain string (`precision=O1`). Every override is checked against the defaults: a key the script
does not have, or a value of the wrong type, is an error that names the key. Silently ignoring
`--learning_rat=1e-3` would waste a training run, which is exactly what this file is here to
prevent.

Type rules: the new value must have the default's type, with two conveniences: an int where a
float is expected (`--learning_rate=1` is 1.0) and anything where the default is None (None
means "decided later", e.g. compile=None -> on for CUDA). Bools are strict: `--compile=1` is an
error, because 1 and True are easy to confuse in a config and the mistake would pass silently.
"""

import ast
import io
import json
import math
import os
import pickle
import types
from dataclasses import fields

import torch

from .fp8 import BACKENDS, GRANULARITIES, RECIPES
from .model import GPTConfig
from .stats import Alarms


class ConfigError(ValueError):
    """A bad command line or config file. The scripts print it and exit with status 2."""


def parse_value(text, default=None):
    """'3e-4' -> 3e-4, 'True' -> True, 'O1' -> 'O1' (not a literal, so a plain string).
    Where the default is a string the text is taken as it is (--out_dir=2024 is the directory
    '2024', not the int 2024), unless it is a quoted Python string (--start="'\\n'")."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text
    if isinstance(default, str) and not isinstance(value, str):
        return text
    return value


def _check(defaults, key, value, origin):
    if key not in defaults:
        close = [k for k in defaults if k.split("_")[0] == key.split("_")[0]][:5]
        hint = f" (similar: {', '.join(close)})" if close else ""
        raise ConfigError(f"unknown config key '{key}' from {origin}{hint}")
    default = defaults[key]
    if default is None:
        return value
    if isinstance(default, bool) or isinstance(value, bool):
        ok = isinstance(default, bool) and isinstance(value, bool)
    elif isinstance(default, float) and isinstance(value, int):
        value, ok = float(value), True
    else:
        ok = isinstance(value, type(default))
    if not ok:
        raise ConfigError(f"config key '{key}' from {origin} expects {type(default).__name__} "
                          f"(default {default!r}), got {type(value).__name__} {value!r}")
    return value


def read_config_file(path):
    """Execute a config file and return the settings it assigns (names without a leading
    underscore; modules and functions it imports or defines for itself are not settings)."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    namespace = {"__file__": os.path.abspath(path)}  # a config may read another: see config/*_fp8.py
    with open(path) as f:
        source = f.read()
    try:
        exec(compile(source, path, "exec"), namespace)
    except Exception as e:  # a config file is code; report which one broke and how
        raise ConfigError(f"error while executing config file {path}: {type(e).__name__}: {e}") from None
    return {k: v for k, v in namespace.items()
            if not k.startswith("_") and not isinstance(v, (types.ModuleType, types.FunctionType, type))}


def configure(defaults, argv, given=None):
    """Apply config files and key=value overrides from `argv` to a dict of defaults.

    Returns a new dict (the defaults are not modified) and never adds keys. `given`, a set if
    passed, receives the keys that a file or an argument set."""
    config = dict(defaults)
    given = set() if given is None else given
    for arg in argv:
        if "=" not in arg:
            if arg.startswith("-"):
                raise ConfigError(f"cannot parse argument '{arg}': use --key=value")
            for key, value in read_config_file(arg).items():
                config[key] = _check(defaults, key, value, f"config file {arg}")
                given.add(key)
            continue
        key, text = arg.split("=", 1)
        key = key.lstrip("-")
        if not key.isidentifier():
            raise ConfigError(f"cannot parse argument '{arg}': use --key=value")
        config[key] = _check(defaults, key, parse_value(text, defaults.get(key)), f"argument '{arg}'")
        given.add(key)
    return config


# The config keys of the FP8 recipe, and the Recipe field each one sets
RECIPE_KEYS = {"fp8_scaling": "scaling", "fp8_granularity": "granularity", "fp8_formats": "formats",
               "fp8_history_len": "history_len", "fp8_amax_algo": "amax_algo", "fp8_margin": "margin"}


def apply_recipe_preset(config, given):
    """fp8_recipe=NAME (a preset of fp8.RECIPES) sets every fp8_* recipe key that no file or
    argument set (`given`): a key set by hand overrides the preset, whatever its value. The
    config then holds the recipe as it runs, and everything downstream reads the keys alone."""
    name = config.get("fp8_recipe")
    if name is None:
        return config
    check_choice(config, "fp8_recipe", (None, *RECIPES))
    preset = RECIPES[name]
    return {**config, **{key: getattr(preset, field) for key, field in RECIPE_KEYS.items() if key not in given}}


def check_choice(config, key, choices):
    """Enumerated settings: fail early, naming the key, instead of deep inside training.
    Compared by type and value, so that 1 does not pass for True (1 == True in Python)."""
    value = config[key]
    if not any(type(value) is type(c) and value == c for c in choices):
        raise ConfigError(f"config key '{key}' must be one of {list(choices)}, got {config[key]!r}")


def defaults_of(namespace):
    """The settings of a script: its module-level names of plain types (bool, int, float,
    str, None), in definition order. train.py and sample.py call it on their own globals()."""
    return {k: v for k, v in namespace.items()
            if not k.startswith("_") and (v is None or isinstance(v, (bool, int, float, str)))}


# -----------------------------------------------------------------------------
# train.py's settings: what can be judged before anything starts

PRECISIONS = ("bf16", "O1", "O2", "O3")


def check_train_config(cfg):
    """train.py's settings, each mistake a ConfigError naming the key, before any process group or
    model exists. Returns the config read-only: what a run derives from it (the device, the
    vocabulary, the architecture of a checkpoint) is kept apart, so a checkpoint's "config" is
    what was asked for."""
    check_choice(cfg, "precision", PRECISIONS)
    check_choice(cfg, "o2_v_format", ("fp16", "fp8"))
    check_choice(cfg, "o2_grad_accum", ("fp16", "fp8"))
    if cfg["o2_fused"] and cfg["precision"] != "O2":
        raise ConfigError(f"o2_fused=True compiles O2's optimizer step; precision={cfg['precision']} has no "
                          "such step (O3 steps its shards on the foreach path): set o2_fused=False")
    check_choice(cfg, "grad_comm", ("auto", "fp32", "bf16", "e5m2", "e4m3"))
    check_choice(cfg, "grad_comm_rest", ("fp32", "bf16"))
    check_choice(cfg, "mp_comm", ("auto", "fp8", "bf16", "fp32"))
    if cfg["precision"] == "bf16" and (cfg["grad_comm"] in ("e4m3", "e5m2") or cfg["mp_comm"] == "fp8"):
        raise ConfigError("precision=bf16 has no FP8 layers and sends no FP8: grad_comm must be "
                          "auto/fp32/bf16 and mp_comm auto/bf16/fp32")
    if cfg["init_from"] not in ("scratch", "resume"):
        if not os.path.isdir(cfg["init_from"]):
            raise ConfigError(f"config key 'init_from' must be 'scratch', 'resume' or a directory with "
                              f"exported or Hugging Face GPT-2 or LLaMA weights, got {cfg['init_from']!r}")
        src, dst = os.path.realpath(cfg["init_from"]), os.path.realpath(cfg["out_dir"])
        if src == dst or src.startswith(dst + os.sep) or dst.startswith(src + os.sep):
            raise ConfigError(f"init_from={cfg['init_from']} and out_dir={cfg['out_dir']} overlap, and a run "
                              f"never writes into the directory it starts from: pick another out_dir (or "
                              f"init_from=resume to continue the run in out_dir)")
    check_choice(cfg, "arch", ("gpt2", "llama"))
    check_choice(cfg, "fp8_scaling", ("current", "delayed"))
    check_choice(cfg, "fp8_granularity", GRANULARITIES)
    check_choice(cfg, "fp8_recipe", (None, *RECIPES))  # (applied already: apply_recipe_preset)
    check_mx(cfg)
    if cfg["fp8_scaling"] == "delayed" and cfg["fp8_granularity"] != "tensor":
        raise ConfigError(f"fp8_scaling='delayed' needs fp8_granularity='tensor', got "
                          f"{cfg['fp8_granularity']!r}: an activation's per-row or per-tile amax history "
                          "says nothing about the next step's rows (use fp8_scaling='current')")
    check_choice(cfg, "fp8_formats", ("hybrid", "e4m3"))
    check_choice(cfg, "fp8_backend", (None, *BACKENDS))
    check_triton(cfg)
    check_choice(cfg, "fp8_amax_algo", ("max", "most_recent"))
    check_choice(cfg, "compile", (None, True, False))
    for key in ("max_iters", "eval_iters", "batch_size", "block_size", "gradient_accumulation_steps",
                "eval_interval", "log_interval", "tensor_parallel", "pipeline_parallel", "data_parallel_replicate"):
        if cfg[key] < (0 if key == "max_iters" else 1):
            raise ConfigError(f"config key '{key}' must be positive, got {cfg[key]}")
    if not (cfg["device"] == "auto" or cfg["device"].split(":")[0] in ("cpu", "cuda", "mps")):
        raise ConfigError(f"config key 'device' must be 'auto', 'cpu' or 'cuda[:N]', got {cfg['device']!r}")
    check_values(cfg)
    check_model_parallel(cfg)
    check_engine(cfg)
    check_stats(cfg)
    check_fp8_attention(cfg)
    check_fp8_at_bf16(cfg)
    check_activation_checkpointing(cfg)
    return types.MappingProxyType(dict(cfg))


def check_activation_checkpointing(cfg):
    """activation_checkpointing="block" runs each block's forward twice (model.checkpoint_blocks):
    what records something at every forward cast would record it twice."""
    check_choice(cfg, "activation_checkpointing", ("off", "block"))
    if cfg["activation_checkpointing"] == "off" or cfg["precision"] == "bf16":
        return
    if cfg["fp8_scaling"] == "delayed":
        raise ConfigError("activation_checkpointing=block with fp8_scaling=delayed: the recomputed forward would push "
                          "every amax into the history a second time and cast with the scale the first push moved; "
                          "use fp8_scaling=current, or activation_checkpointing=off")
    if cfg["fp8_stats_interval"]:
        raise ConfigError(f"activation_checkpointing=block with fp8_stats_interval={cfg['fp8_stats_interval']}: the "
                          f"statistics would count every forward cast twice; set fp8_stats_interval=0, or "
                          f"activation_checkpointing=off")


def check_mx(cfg):
    """An MX recipe (fp8_recipe=mxfp8: nanofp8/mx.py) runs with its own tiles and current scaling.
    Another fp8_granularity or fp8_scaling would give its E8M0 rule to whole tensors or rows, or to
    an amax history: that is not MX, and the log would still say "mx"."""
    name = cfg["fp8_recipe"]
    if name is None or RECIPES[name].grid != "mx":
        return
    preset, off, why = RECIPES[name], [], []
    if cfg["fp8_granularity"] != preset.granularity:
        off.append("fp8_granularity")
        g = cfg["fp8_granularity"]
        why.append(f"fp8_granularity={g} would give one such scale to a whole {g}")
    if cfg["fp8_scaling"] != preset.scaling:
        off.append("fp8_scaling")
        why.append(f"fp8_scaling={cfg['fp8_scaling']} would take it from an amax history")
    if not off:
        return
    other = "delayed" if "fp8_scaling" in off else {"tensor": "tensorwise", "row": "rowwise"}[cfg["fp8_granularity"]]
    tile = "x".join(map(str, preset.act_tile))
    raise ConfigError(f"fp8_recipe={name} runs OCP MX's scales, one E8M0 power of two per {tile} tile from that "
                      f"tile's own amax, and {' and '.join(why)}: drop {' and '.join(off)}, or use "
                      f"fp8_recipe={other}")


def check_fp8_at_bf16(cfg):
    """precision=bf16 has no FP8 layers, so a setting of them (the recipe, the LM head, strictness,
    statistics) would change nothing: refused, naming the keys, as fp8_attention=True is. A recipe
    key counts where it differs from its preset (fp8_recipe's, else tensorwise, whose values are
    train.py's defaults). fp8_backend passes: bench.py builds every level, bf16 too, with one."""
    if cfg["precision"] != "bf16":
        return
    preset = RECIPES[cfg["fp8_recipe"] or "tensorwise"]
    keys = ["fp8_recipe"] * (cfg["fp8_recipe"] is not None)
    keys += [key for key, field in RECIPE_KEYS.items() if cfg[key] != getattr(preset, field)]
    keys += [key for key in ("fp8_lm_head", "fp8_strict", "fp8_stats_interval") if cfg[key]]
    if keys:
        raise ConfigError(f"precision=bf16 has no FP8 layers, which {', '.join(f'{k}={cfg[k]}' for k in keys)} "
                          f"would set: use precision=O1, O2 or O3, or drop {' and '.join(keys)}")


def check_fp8_attention(cfg):
    """fp8_attention=True (nanofp8/attention.py): at the FP8 levels, without attention dropout. Any
    layout and engine: tensor parallelism keeps whole heads on each rank, and attention reads its
    heads from its tensors."""
    if not cfg["fp8_attention"]:
        return
    if cfg["precision"] == "bf16":
        raise ConfigError("fp8_attention=True runs attention with the FP8 recipe of the FP8 levels: "
                          "use precision=O1, O2 or O3, or fp8_attention=False")
    if cfg["dropout"] > 0:
        raise ConfigError(f"fp8_attention=True has no attention dropout (dropout={cfg['dropout']}): "
                          "set dropout=0, or fp8_attention=False")


def check_stats(cfg):
    if cfg["fp8_stats_interval"] < 0:
        raise ConfigError(f"config key 'fp8_stats_interval' must be >= 0 (0 = off), got {cfg['fp8_stats_interval']}")
    try:
        stats_alarms(cfg)
    except ValueError as e:
        raise ConfigError(f"fp8_alarm_* keys: {e}") from None
    if not cfg["fp8_stats_interval"]:
        return
    if cfg["compile"]:
        raise ConfigError("fp8_stats_interval > 0 with compile=True: statistics are collected in eager "
                          "mode; set compile=False (or leave compile unset: it is then off)")


def stats_alarms(cfg):
    return Alarms(saturation=cfg["fp8_alarm_saturation"], underflow=cfg["fp8_alarm_underflow"],
                  sqnr_db=cfg["fp8_alarm_sqnr_db"], intervals=cfg["fp8_alarm_intervals"],
                  amax_growth=cfg["fp8_alarm_amax_growth"], saturation_severe=cfg["fp8_alarm_saturation_severe"])


# The largest fp8_margin allowed. A margin m maps the amax to fp8_max / 2^m, so the top m binades of
# the format stay empty and everything more than (dynamic range - m) binades below the amax
# flushes to zero. E4M3 spans ~17.8 binades (2^-9 to 448): at m = 8 about 10 are left; at m >= 18
# every value flushes, the blocks output nothing and training quietly learns a worse model.
MAX_FP8_MARGIN = 8


def check_values(cfg):
    """Ranges of the numeric settings and what the machine and file system must provide: each
    mistake is a ConfigError naming the key, before any process group or model exists."""
    def need(ok, key, what):
        if not ok:
            raise ConfigError(f"config key '{key}' must be {what}, got {cfg[key]!r}")

    for key in ("n_layer", "n_head", "n_embd", "vocab_size", "fp8_history_len"):
        need(cfg[key] >= 1, key, ">= 1")
    for key in ("mlp_hidden", "warmup_iters", "lr_decay_iters", "max_skipped_steps"):
        need(cfg[key] >= 0, key, ">= 0")
    need(cfg["keep_checkpoints"] >= 1, "keep_checkpoints", ">= 1")
    for key in ("learning_rate", "min_lr", "weight_decay", "grad_clip", "peak_flops", "norm_eps", "max_loss_rise"):
        need(math.isfinite(cfg[key]) and cfg[key] >= 0, key, "finite and >= 0")
    need(0 <= cfg["dropout"] < 1, "dropout", "in [0, 1)")
    for key in ("beta1", "beta2"):
        need(0 <= cfg[key] < 1, key, "in [0, 1) (beta = 1 would never update the moment)")
    need(0 <= cfg["fp8_margin"] <= MAX_FP8_MARGIN, "fp8_margin",
         f"in [0, {MAX_FP8_MARGIN}] (m empties the top m of E4M3's ~18 binades; from ~18 on, "
         "every value flushes to zero)")
    need(math.isfinite(cfg["dist_timeout"]) and cfg["dist_timeout"] > 0, "dist_timeout", "> 0 seconds")
    need(cfg["out_dir"].strip() != "", "out_dir", "a directory name")
    need(not os.path.exists(cfg["out_dir"]) or os.path.isdir(cfg["out_dir"]), "out_dir",
         "a directory (it is an existing file)")
    check_device(cfg["device"])
    try:  # the architecture's own rules (divisibility, RoPE's even head dim)
        GPTConfig(**{f.name: cfg[f.name] for f in fields(GPTConfig)})
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_triton(cfg):
    """fp8_backend='triton' runs kernels.py's Triton kernels: on a CUDA GPU, or on a CPU only in
    Triton's interpreter (TRITON_INTERPRET=1, as the tests run them), not at the first forward."""
    if cfg["fp8_backend"] != "triton" or cfg["precision"] == "bf16":
        return
    device = cfg["device"]
    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        return
    try:
        import kernels  # the repo root's Triton kernels (they read TRITON_INTERPRET once, on import)
        interpreted = kernels.INTERPRET
    except ImportError:
        interpreted = False
    if not interpreted:
        raise ConfigError(f"fp8_backend='triton' runs Triton kernels, which need a CUDA GPU, and this run's "
                          f"device is {'cpu' if device == 'auto' else device}: use fp8_backend=emulate (or leave "
                          f"it unset), or set TRITON_INTERPRET=1 to run them in Triton's interpreter (slow)")


def config_notes(cfg, start_iter):
    """What a run should know about settings that are allowed but may not be meant: log lines."""
    notes = []
    warmup, end = cfg["warmup_iters"], cfg["max_iters"]
    if cfg["decay_lr"] and not cfg["eval_only"] and start_iter < end < warmup:
        notes.append(f"note: warmup_iters={warmup} is more than max_iters={end}: the run ends during the "
                     f"warmup, its learning rate reaching {end / (warmup + 1):.0%} of learning_rate="
                     f"{cfg['learning_rate']:g} (a later resume with a larger max_iters goes on warming up)")
    return notes


def check_device(device):
    """A CUDA device that this machine has (train.py and sample.py): ConfigError, not an assertion
    deep inside torch."""
    if device.startswith("cuda"):
        index = device.partition(":")[2] or "0"
        if not index.isdigit() or not torch.cuda.is_available() or int(index) >= torch.cuda.device_count():
            raise ConfigError(f"config key 'device' is {device!r}, but this machine has "
                              f"{torch.cuda.device_count()} CUDA devices: use device=cpu (or auto)")


def check_model_parallel(cfg):
    """The model-parallel settings that can be judged before any process starts."""
    tp, pp, sp = cfg["tensor_parallel"], cfg["pipeline_parallel"], cfg["sequence_parallel"]
    if sp and tp == 1:
        raise ConfigError("sequence_parallel=True needs tensor_parallel > 1: it cuts the sequence "
                          "over the tensor-parallel ranks")
    if sp and cfg["block_size"] % tp:
        raise ConfigError(f"sequence_parallel=True needs block_size ({cfg['block_size']}) divisible "
                          f"by tensor_parallel ({tp}): every rank holds block_size/tensor_parallel tokens")
    hp = [op for op, g, _ in RECIPES[cfg["fp8_recipe"] or "tensorwise"].operands if g is None]
    if sp and hp and cfg["mp_comm"] in ("auto", "fp8"):  # (auto: fp8 at the FP8 levels)
        hp = " and ".join(op.replace("_t", "^T") for op in hp)
        raise ConfigError(f"fp8_recipe={cfg['fp8_recipe']} keeps {hp} in high precision, and "
                          f"sequence_parallel=True gathers x and dy in FP8 (mp_comm={cfg['mp_comm']}): set "
                          f"mp_comm=bf16, or sequence_parallel=False, or fp8_recipe=rowwise")
    if tp * pp == 1:
        return
    if cfg["precision"] in ("O2", "O3"):
        raise ConfigError(f"precision={cfg['precision']} with tensor_parallel={tp}, pipeline_parallel={pp}: "
                          "nanofp8/parallel.py has no O2/O3 layers (fp16 master weights, FP8 optimizer "
                          "state); use precision=O1 or bf16, or tensor_parallel=1 pipeline_parallel=1")
    if cfg["compile"]:
        why = ("torch.compile breaks the graph at every tensor-parallel layer (the collectives and byte counts "
               "inside its autograd Functions) and fails under sequence parallelism") if tp > 1 else \
            "the pipeline stages run eagerly (their sends and receives are not compiled)"
        raise ConfigError(f"compile=True with tensor_parallel={tp}, pipeline_parallel={pp}: {why}; set compile=False")


def check_engine(cfg):
    """engine=torch (nanofp8/torchstack.py): what torch's stack does not run here, refused by name."""
    check_choice(cfg, "engine", ("nanofp8", "torch"))
    check_choice(cfg, "fsdp_param_dtype", ("auto", "bf16", "fp32"))
    if cfg["engine"] == "nanofp8":
        if cfg["fsdp_param_dtype"] != "auto":
            raise ConfigError(f"fsdp_param_dtype={cfg['fsdp_param_dtype']} sets what FSDP2 gathers under engine=torch; "
                              f"the hand-written engine gathers no parameters (its gradients travel as grad_comm "
                              f"says): drop fsdp_param_dtype, or use engine=torch")
        if cfg["data_parallel_replicate"] > 1:
            raise ConfigError(f"data_parallel_replicate={cfg['data_parallel_replicate']} is FSDP2's HSDP (engine=torch); "
                              f"the hand-written engine keeps whole replicas (O3 shards its optimizer over every "
                              f"rank): drop data_parallel_replicate, or use engine=torch")
        return
    tp, use = cfg["tensor_parallel"], "use engine=nanofp8 (the hand-written engine) for it"
    if cfg["pipeline_parallel"] > 1:
        raise ConfigError(f"engine=torch has no pipeline parallelism (pipeline_parallel={cfg['pipeline_parallel']}): {use}")
    if cfg["precision"] in ("O2", "O3"):
        raise ConfigError(f"precision={cfg['precision']} does not run on engine=torch: its FP8 weight gradients live "
                          f"outside .grad, and FSDP2 reduce-scatters only .grad; its moments carry a scale per 128 "
                          f"values of a shard, which DCP cannot re-cut for another world size (docs/distributed.md: "
                          f"'Scaling beyond one machine'); {use}, or precision=O1 on engine=torch")
    if tp > 1 and cfg["fp8_scaling"] == "delayed":
        raise ConfigError(f"fp8_scaling=delayed with engine=torch and tensor_parallel={tp}: each TP rank keeps its own "
                          f"amax history, which a DCP checkpoint would save as one; use fp8_scaling=current, or {use}")
    if tp > 1 and cfg["fp8_lm_head"]:
        raise ConfigError(f"fp8_lm_head=True with engine=torch and tensor_parallel={tp}: the replicated LM head runs "
                          f"bf16 there; set fp8_lm_head=False, or {use}")
    if cfg["fp8_stats_interval"]:
        raise ConfigError(f"fp8_stats_interval={cfg['fp8_stats_interval']} with engine=torch: the FP8 statistics "
                          f"are collected by the hand-written engine only; set fp8_stats_interval=0, or {use}")


def compile_choice(cfg, layout):
    """Whether train.py torch.compiles the model, at this layout (nanofp8/layout.py): compile=True/False as given; None: on for CUDA, except
    where the model is cut over ranks (its collectives run eagerly) and where FP8 statistics observe
    every cast. Data parallelism compiles, FSDP2's FP8 all-gather (engine=torch, nanofp8/fsdp.py)
    included: its hooks run between the compiled graphs, which read the gathered FP8 weight."""
    if cfg["compile"] is not None:
        return cfg["compile"]
    return layout.device_type == "cuda" and not (layout.model_parallel or cfg["fp8_stats_interval"])


def check_accumulation(cfg, dp_size):
    """gradient_accumulation_steps counts the micro-batches of the whole step, over all replicas."""
    gas = cfg["gradient_accumulation_steps"]
    what = "replicas" if cfg["tensor_parallel"] * cfg["pipeline_parallel"] > 1 else "processes"
    if gas % dp_size:
        low, high = gas // dp_size * dp_size, (gas // dp_size + 1) * dp_size
        options = f"{low} or {high}" if low else f"{high}"
        raise ConfigError(f"gradient_accumulation_steps={gas} must be divisible by the number of "
                          f"data-parallel {what} ({dp_size}; each runs gradient_accumulation_steps / "
                          f"{dp_size} micro-batches): pass gradient_accumulation_steps={options}")


# -----------------------------------------------------------------------------
# Dataset metadata: the one setting a dataset supplies (its vocabulary)
#
# data/<name>/prepare.py writes meta.json: {"vocab_size": int, "itos": [the token of id 0, of id
# 1, ...], "dtype": "uint16" or "uint32"} (itos only for character-level data; GPT-2 BPE datasets
# have no meta file). dtype is the integer type of the token files: uint16 holds the ids of a
# vocabulary of up to 65,536 tokens, a larger one needs uint32 (a uint16 file would wrap its ids
# around, silently, into other tokens). Files from before the key read as uint16. JSON, and
# not a pickle, because a pickle runs code when it is loaded and a dataset directory is something
# people download. Directories prepared by older versions hold meta.pkl instead; it is still read,
# but only through _PlainDataUnpickler, which refuses every pickle that names a Python object
# (os.system, a class, a function): what is left can build only dicts, lists, strings and numbers.


# The token file types: {name in meta.json: how many token ids it holds}.
TOKEN_DTYPES = {"uint16": 1 << 16, "uint32": 1 << 32}


class _PlainDataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"it refers to the Python object {module}.{name}, and only plain "
                                     f"dicts, strings and ints are accepted")


def read_dataset_meta(data_dir):
    """{'vocab_size': int, 'itos': list of str or None, 'dtype': 'uint16' or 'uint32'} from
    data_dir/meta.json (or an old meta.pkl, read safely); None when the dataset has neither (GPT-2
    BPE). dtype is "uint16" where the file has none. A damaged or foreign file, or a dtype too small
    for the vocabulary, is a ConfigError naming it."""
    json_path, pkl_path = os.path.join(data_dir, "meta.json"), os.path.join(data_dir, "meta.pkl")
    if os.path.exists(json_path):
        path = json_path
        try:
            with open(path, encoding="utf-8") as f:
                meta = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read dataset metadata {path} ({type(e).__name__}: {e}): run the "
                              f"dataset's prepare.py again") from None
    elif os.path.exists(pkl_path):
        path = pkl_path
        try:
            with open(path, "rb") as f:
                meta = _PlainDataUnpickler(io.BytesIO(f.read())).load()
        except Exception as e:  # truncated (EOFError), garbage (UnpicklingError), a code payload, ...
            raise ConfigError(f"cannot read dataset metadata {path} ({type(e).__name__}: {e}): run the "
                              f"dataset's prepare.py again (it writes meta.json)") from None
        if isinstance(meta, dict) and isinstance(meta.get("itos"), dict):  # old layout: {id: char}
            meta = {**meta, "itos": [meta["itos"].get(i) for i in range(len(meta["itos"]))]}
    else:
        return None
    vocab = meta.get("vocab_size") if isinstance(meta, dict) else None
    itos = meta.get("itos") if isinstance(meta, dict) else None
    if type(vocab) is not int or vocab < 1:
        raise ConfigError(f"dataset metadata {path} has no valid 'vocab_size' (got {vocab!r})")
    if itos is not None and not (isinstance(itos, list) and len(itos) == vocab
                                 and all(isinstance(c, str) for c in itos)):
        raise ConfigError(f"dataset metadata {path}: 'itos' must list one string per token id "
                          f"(vocab_size={vocab})")
    dtype = meta.get("dtype", "uint16")
    if dtype not in TOKEN_DTYPES:
        raise ConfigError(f"dataset metadata {path}: 'dtype' is {dtype!r}; the token files are one of "
                          f"{list(TOKEN_DTYPES)}")
    if vocab > TOKEN_DTYPES[dtype]:
        raise ConfigError(f"dataset metadata {path}: vocab_size={vocab} does not fit {dtype} token files "
                          f"(ids up to {TOKEN_DTYPES[dtype] - 1:,}); prepare the dataset again with uint32")
    return {"vocab_size": vocab, "itos": itos, "dtype": dtype}
