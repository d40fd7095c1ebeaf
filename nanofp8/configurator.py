"""
The one config mechanism shared by train.py and sample.py.

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
import os
import pickle
import types


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


def _run_config_file(path):
    """Execute a config file and return the settings it assigns (names without a leading
    underscore; modules and functions it imports or defines for itself are not settings)."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    namespace = {}
    with open(path) as f:
        source = f.read()
    try:
        exec(compile(source, path, "exec"), namespace)
    except Exception as e:  # a config file is code; report which one broke and how
        raise ConfigError(f"error while executing config file {path}: {type(e).__name__}: {e}") from None
    return {k: v for k, v in namespace.items()
            if not k.startswith("_") and not isinstance(v, (types.ModuleType, types.FunctionType, type))}


def configure(defaults, argv):
    """Apply config files and key=value overrides from `argv` to a dict of defaults.

    Returns a new dict (the defaults are not modified) and never adds keys."""
    config = dict(defaults)
    for arg in argv:
        if "=" not in arg:
            if arg.startswith("-"):
                raise ConfigError(f"cannot parse argument '{arg}': use --key=value")
            for key, value in _run_config_file(arg).items():
                config[key] = _check(defaults, key, value, f"config file {arg}")
            continue
        key, text = arg.split("=", 1)
        key = key.lstrip("-")
        if not key.isidentifier():
            raise ConfigError(f"cannot parse argument '{arg}': use --key=value")
        config[key] = _check(defaults, key, parse_value(text, defaults.get(key)), f"argument '{arg}'")
    return config


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
# Dataset metadata: the one setting a dataset supplies (its vocabulary)
#
# data/<name>/prepare.py writes meta.json: {"vocab_size": int, "itos": [the token of id 0, of id
# 1, ...]} (itos only for character-level data; GPT-2 BPE datasets have no meta file). JSON, and
# not a pickle, because a pickle runs code when it is loaded and a dataset directory is something
# people download. Directories prepared by older versions hold meta.pkl instead; it is still read,
# but only through _PlainDataUnpickler, which refuses every pickle that names a Python object
# (os.system, a class, a function): what is left can build only dicts, lists, strings and numbers.


class _PlainDataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"it refers to the Python object {module}.{name}, and only plain "
                                     f"dicts, strings and ints are accepted")


def read_dataset_meta(data_dir):
    """{'vocab_size': int, 'itos': list of str or None} from data_dir/meta.json (or an old
    meta.pkl, read safely); None when the dataset has neither (GPT-2 BPE). A damaged or foreign
    file is a ConfigError naming it."""
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
    return {"vocab_size": vocab, "itos": itos}
