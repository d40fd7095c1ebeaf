"""
Train a GPT in bf16 or in FP8 (level O1), on a CPU, one GPU, or many GPUs with torchrun.

    python train.py config/shakespeare_char_fp8.py                    # the baby model, minutes on a CPU
    python train.py config/shakespeare_char_fp8.py --max_iters=100    # key=value overrides the file
    torchrun --standalone --nproc_per_node=8 train.py config/gpt2_fp8.py

Precision levels (`precision=...`):

    bf16  fp32 master weights and optimizer state, every matmul in bf16 under autocast.
    O1    as bf16, but the Linears inside the transformer blocks run their three GEMMs (forward,
          dgrad, wgrad) in FP8 and keep FP8 copies of their input and weight for the backward
          pass (nanofp8/fp8.py). Embeddings, norms, attention and the LM head stay bf16/fp32.
    O2    as O1, plus precision decoupling for those Linears (nanofp8/optim.py): fp16 master
          weights with a scale, FP8 weight gradients, FP8 Adam m, fp16 Adam v: 6 instead of 16
          bytes per parameter (o2_v_format='fp8': 5).
    O3    as O2, with the master weights and moments sharded over the data-parallel ranks
          (ZeRO, nanofp8/dist.py): 2 + 5/N bytes per parameter. Needs torchrun.

Under torchrun, bf16 all-reduces fp32 gradients with torch's DDP (nanoGPT's baseline). The FP8
levels send the weight gradients of the FP8 layers in FP8 (grad_comm: E4M3 by default, a scale per
128 values of one parameter) and every other gradient as the baseline does (grad_comm_rest: fp32),
with nanofp8.dist.Fp8DataParallel, overlapped with backward like DDP (O2/O3 send the FP8 weight
gradients they keep outside .grad after backward).

Model parallelism (nanofp8/parallel.py), bf16 and O1, under torchrun: the N processes form
N / (tensor_parallel * pipeline_parallel) data-parallel replicas of a model whose block matrices
are cut over tensor_parallel ranks (sequence_parallel=True also cuts the sequence between them)
and whose blocks are cut into pipeline_parallel stages, run as a GPipe schedule over the
micro-batches. What crosses between ranks there is mp_comm: bf16 sends only bf16 (and fp32);
O1 sends the tensor-parallel payloads and the activations and gradients between stages in
mp_comm (auto: FP8; see MP_COMM_AUTO for the evidence behind the default).

    torchrun --nproc_per_node=8 train.py config/gpt2_fp8.py tensor_parallel=2 sequence_parallel=True \
        pipeline_parallel=2                     # 2 replicas x 2 tensor x 2 pipeline ranks

Seeing the numerics (nanofp8/stats.py): at start-up every FP8 level prints a table of the Linears
(FP8 or not, and why not), and at the end the number of GEMMs that fell back to high precision
(fp8_strict=True makes a fallback an error). fp8_stats_interval=N records every FP8 cast's
underflow, saturation, subnormals, SQNR and scales every N iterations to out_dir/fp8_stats.jsonl,
logs a one-line summary and alarms, and leaves the training step bit-identical; 0 turns it off.

Where the precision level touches the training loop there is one small function each:
setup_precision (what the model's layers compute in), build_optimizer (what holds the master
weights and moments), optimizer_step (how gradients become an update) and wrap_data_parallel (how
gradients are summed across ranks). Levels O2 (FP8 optimizer state) and O3 (sharded state) are
meant to replace exactly these functions and nothing else.

The loop itself is flat and runs top to bottom: evaluate every eval_interval iterations (and
checkpoint), then forward/backward over gradient_accumulation_steps micro-batches, clip, step.

Reproducibility: the batch of iteration i is drawn with a generator seeded from (seed, i, micro
step, rank), never from a global RNG. The data "position" is then simply the iteration number, so
a run that is stopped and resumed from its checkpoint (init_from='resume') sees the same batches
as one that never stopped, and on CPU it reproduces the same losses bit for bit.
"""

import io
import math
import os
import re
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import fields
from datetime import timedelta

import numpy as np
import torch

from nanofp8 import fp8, parallel
from nanofp8.checkpoint import initial_weights, load_moments
from nanofp8.configurator import ConfigError, check_choice, configure, defaults_of, read_dataset_meta
from nanofp8.dist import Fp8DataParallel, ZeroFp8AdamW, convert_to_o3, sync_fp8_wgrads
from nanofp8.fp8 import E4M3, E5M2
from nanofp8.model import (GPT, CheckpointError, GPTConfig, apply_fp8, load_checkpoint,
                           load_model_state, save_checkpoint)
from nanofp8.optim import Fp8AdamW, O2Linear, clip_grad_norm, convert_to_o2
from nanofp8.stats import Alarms, Fp8Stats, fallback_line, format_linear_table, linear_table

# -----------------------------------------------------------------------------
# Defaults: GPT-2 small (124M) on OpenWebText. Config files and key=value override them.
# I/O
out_dir = "out"
eval_interval = 2000  # evaluate (and checkpoint) every this many iterations, and at the end
log_interval = 10
eval_iters = 200  # batches per split per evaluation
eval_only = False  # evaluate once and exit
always_save_checkpoint = True  # else only when the validation loss improves
init_from = "scratch"  # "scratch" | "resume" (from out_dir, any level/layout) | a directory: an
#                       export, a Hugging Face GPT-2 or another run's out_dir (nanofp8/checkpoint.py)
# data
dataset = "openwebtext"
gradient_accumulation_steps = 40  # micro-batches per optimizer step, summed over all ranks
batch_size = 12  # sequences per micro-batch
block_size = 1024
# model (see nanofp8/model.py: GPTConfig)
arch = "gpt2"  # "gpt2" | "llama"
n_layer = 12
n_head = 12
n_embd = 768
dropout = 0.0
bias = True
tie_embeddings = True
mlp_hidden = 0  # 0 = the architecture's default width
rope_theta = 10000.0
norm_eps = 1e-5
vocab_size = 50304  # GPT-2 BPE (50257, padded); a dataset's meta.json sets it unless given larger
# AdamW
learning_rate = 6e-4
max_iters = 600000
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0  # clip the global gradient norm to this (0 = no clipping)
max_skipped_steps = 10  # stop after this many steps in a row skipped for non-finite gradients (0 = never)
# learning rate schedule: linear warmup, then cosine decay to min_lr at lr_decay_iters
decay_lr = True
warmup_iters = 2000
lr_decay_iters = 600000
min_lr = 6e-5
# precision
precision = "bf16"  # "bf16" | "O1" | "O2" | "O3"
o2_v_format = "fp16"  # O2/O3: Adam v in "fp16" (FP8-LM) or "fp8" (sqrt(v) in E4M3)
grad_comm = "auto"  # data parallel, weight gradients of the FP8 layers: "auto" (e4m3 at FP8 levels)
#                     | "e4m3" | "e5m2" | "bf16" | "fp32"; at bf16 (no FP8 layers): every gradient,
#                     "auto" = fp32 with torch's DDP
grad_comm_rest = "fp32"  # data parallel, every other gradient (FP8 levels): "fp32" | "bf16"
mp_comm = "auto"  # tensor/sequence/pipeline payloads: "auto" | "fp8" | "bf16" | "fp32" (bf16 level:
#                   not "fp8"; auto = bf16 there, see mp_comm_format for the FP8 levels)
fp8_scaling = "current"  # "current" | "delayed"
fp8_granularity = "tensor"  # "tensor" | "row" | "block"
fp8_formats = "hybrid"  # "hybrid" (E4M3 forward, E5M2 gradients) | "e4m3"
fp8_backend = None  # "torch" | "emulate" | "triton"; None = torch._scaled_mm on CUDA, emulate on CPU
fp8_history_len = 16  # delayed scaling: amax history length
fp8_amax_algo = "max"  # delayed scaling: "max" | "most_recent"
fp8_margin = 0  # scales are divided by 2^margin (0 to 8: see check_values)
fp8_lm_head = False  # also run the LM head in FP8
# seeing the numerics (nanofp8/stats.py)
fp8_stats_interval = 0  # every this many iterations: per-layer FP8 cast statistics (0 = off)
fp8_strict = False  # a GEMM that cannot run in FP8 is an error, not a high-precision fallback
fp8_alarm_saturation = 1e-4  # alarm: fraction of an operand's values clipped at the FP8 max ...
fp8_alarm_underflow = 0.05  # ... fraction of its non-zero values flushed to zero ...
fp8_alarm_sqnr_db = 15.0  # ... SQNR of its FP8 copy below this ...
fp8_alarm_intervals = 3  # ... for this many statistics steps in a row
fp8_alarm_amax_growth = 10.0  # alarm: an activation's or weight's amax grew this many times
# model parallelism (torchrun; see nanofp8/parallel.py). Processes = data x tensor x pipeline.
tensor_parallel = 1  # cut every block's matrices over this many ranks (heads, MLP units)
sequence_parallel = False  # with tensor_parallel > 1: cut the sequence too, between the matmuls
pipeline_parallel = 1  # cut the blocks into this many stages, fed micro-batches (GPipe)
# system
device = "auto"  # "auto" (cuda if available, else cpu) | "cpu" | "cuda" | "cuda:1" ...
compile = None  # torch.compile the model; None = on for CUDA, off for CPU
peak_flops = 0.0  # hardware peak for MFU; 0 = look the GPU up (no MFU when unknown, e.g. CPU)
dist_timeout = 600.0  # torchrun: seconds a collective may wait for the other ranks before the job stops
seed = 1337
DEFAULTS = defaults_of(globals())
# -----------------------------------------------------------------------------

PRECISIONS = ("bf16", "O1", "O2", "O3")
MODEL_KEYS = [f.name for f in fields(GPTConfig)]
REPO = os.path.dirname(os.path.abspath(__file__))
PREPARED_ON_DEMAND = ("shakespeare_char",)  # small enough to prepare inside train.py
# Dense tensor-core peak per GPU (SXM parts), bf16 and FP8, for MFU. FP8 runs are measured against
# the FP8 peak: "50% MFU" then means the same thing, half of what the hardware could do.
PEAK_FLOPS = {"H100": (989e12, 1979e12), "H200": (989e12, 1979e12), "H800": (989e12, 1979e12),
              "A100": (312e12, None)}


def load_config(argv):
    """Defaults + config files + key=value -> a dict, validated. Raises ConfigError."""
    cfg = configure(DEFAULTS, argv)
    check_choice(cfg, "precision", PRECISIONS)
    check_choice(cfg, "o2_v_format", ("fp16", "fp8"))
    check_choice(cfg, "grad_comm", ("auto", "fp32", "bf16", "e5m2", "e4m3"))
    check_choice(cfg, "grad_comm_rest", ("fp32", "bf16"))
    check_choice(cfg, "mp_comm", ("auto", "fp8", "bf16", "fp32"))
    if cfg["precision"] == "bf16" and (cfg["grad_comm"] in ("e4m3", "e5m2") or cfg["mp_comm"] == "fp8"):
        raise ConfigError("precision=bf16 has no FP8 layers and sends no FP8: grad_comm must be "
                          "auto/fp32/bf16 and mp_comm auto/bf16/fp32")
    if cfg["init_from"] not in ("scratch", "resume") and not os.path.isdir(cfg["init_from"]):
        raise ConfigError(f"config key 'init_from' must be 'scratch', 'resume' or a directory with "
                          f"exported or Hugging Face GPT-2 weights, got {cfg['init_from']!r}")
    check_choice(cfg, "arch", ("gpt2", "llama"))
    check_choice(cfg, "fp8_scaling", ("current", "delayed"))
    check_choice(cfg, "fp8_granularity", ("tensor", "row", "block"))
    check_choice(cfg, "fp8_formats", ("hybrid", "e4m3"))
    check_choice(cfg, "fp8_backend", (None, "torch", "emulate", "triton"))
    check_choice(cfg, "fp8_amax_algo", ("max", "most_recent"))
    check_choice(cfg, "compile", (None, True, False))
    for key in ("max_iters", "eval_iters", "batch_size", "block_size", "gradient_accumulation_steps",
                "eval_interval", "log_interval", "tensor_parallel", "pipeline_parallel"):
        if cfg[key] < (0 if key == "max_iters" else 1):
            raise ConfigError(f"config key '{key}' must be positive, got {cfg[key]}")
    if not (cfg["device"] == "auto" or cfg["device"].split(":")[0] in ("cpu", "cuda", "mps")):
        raise ConfigError(f"config key 'device' must be 'auto', 'cpu' or 'cuda[:N]', got {cfg['device']!r}")
    check_values(cfg)
    check_model_parallel(cfg)
    check_stats(cfg)
    return cfg


def check_stats(cfg):
    if cfg["fp8_stats_interval"] < 0:
        raise ConfigError(f"config key 'fp8_stats_interval' must be >= 0 (0 = off), got {cfg['fp8_stats_interval']}")
    try:
        stats_alarms(cfg)
    except ValueError as e:
        raise ConfigError(f"fp8_alarm_* keys: {e}") from None
    if not cfg["fp8_stats_interval"]:
        return
    if cfg["tensor_parallel"] * cfg["pipeline_parallel"] > 1:
        raise ConfigError("fp8_stats_interval > 0 with tensor or pipeline parallelism: the statistics "
                          "observe Fp8Linear, not nanofp8/parallel.py's layers; set fp8_stats_interval=0")
    if cfg["compile"]:
        raise ConfigError("fp8_stats_interval > 0 with compile=True: statistics are collected in eager "
                          "mode; set compile=False (or leave compile unset: it is then off)")


def stats_alarms(cfg):
    return Alarms(saturation=cfg["fp8_alarm_saturation"], underflow=cfg["fp8_alarm_underflow"],
                  sqnr_db=cfg["fp8_alarm_sqnr_db"], intervals=cfg["fp8_alarm_intervals"],
                  amax_growth=cfg["fp8_alarm_amax_growth"])


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
    for key in ("learning_rate", "min_lr", "weight_decay", "grad_clip", "peak_flops", "norm_eps"):
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
    if cfg["device"].startswith("cuda"):
        index = cfg["device"].partition(":")[2] or "0"
        if not index.isdigit() or not torch.cuda.is_available() or int(index) >= torch.cuda.device_count():
            raise ConfigError(f"config key 'device' is {cfg['device']!r}, but this machine has "
                              f"{torch.cuda.device_count()} CUDA devices: use device=cpu (or auto)")
    try:  # the architecture's own rules (divisibility, RoPE's even head dim)
        GPTConfig(**{k: cfg[k] for k in MODEL_KEYS})
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_model_parallel(cfg):
    """The model-parallel settings that can be judged before any process starts."""
    tp, pp, sp = cfg["tensor_parallel"], cfg["pipeline_parallel"], cfg["sequence_parallel"]
    if sp and tp == 1:
        raise ConfigError("sequence_parallel=True needs tensor_parallel > 1: it cuts the sequence "
                          "over the tensor-parallel ranks")
    if sp and cfg["block_size"] % tp:
        raise ConfigError(f"sequence_parallel=True needs block_size ({cfg['block_size']}) divisible "
                          f"by tensor_parallel ({tp}): every rank holds block_size/tensor_parallel tokens")
    if tp * pp == 1:
        return
    if cfg["precision"] in ("O2", "O3"):
        raise ConfigError(f"precision={cfg['precision']} with tensor_parallel={tp}, pipeline_parallel={pp}: "
                          "nanofp8/parallel.py has no O2/O3 layers (fp16 master weights, FP8 optimizer "
                          "state); use precision=O1 or bf16, or tensor_parallel=1 pipeline_parallel=1")
    if cfg["compile"]:
        raise ConfigError(f"compile=True with tensor_parallel={tp}, pipeline_parallel={pp}: the parallel "
                          "layers run eagerly (their collectives are not compiled); set compile=False")


def check_accumulation(cfg, dp_size, what):
    """gradient_accumulation_steps counts the micro-batches of the whole step, over all replicas."""
    gas = cfg["gradient_accumulation_steps"]
    if gas % dp_size:
        low, high = gas // dp_size * dp_size, (gas // dp_size + 1) * dp_size
        options = f"{low} or {high}" if low else f"{high}"
        raise ConfigError(f"gradient_accumulation_steps={gas} must be divisible by the number of "
                          f"data-parallel {what} ({dp_size}; each runs gradient_accumulation_steps / "
                          f"{dp_size} micro-batches): pass gradient_accumulation_steps={options}")


# -----------------------------------------------------------------------------
# Faults under torchrun: a collective that never completes
#
# A rank that hangs (deadlocked, stopped, swapping, lost its GPU) leaves the others waiting inside
# a collective. The process group gets a timeout (dist_timeout) after which the waiting collective
# raises, and a second, gloo-only group is kept aside to find out who is missing: a
# monitored_barrier on it reports the ranks that do not answer (a fresh group, because the one
# whose collective timed out may be left half-way through a message). With NCCL, torch's watchdog
# may abort the process at the same timeout with its own message instead.

_monitor_group, _dist_timeout = None, None


def init_distributed(cfg):
    global _monitor_group, _dist_timeout
    _dist_timeout = cfg["dist_timeout"]
    timeout = timedelta(seconds=cfg["dist_timeout"])
    backend = "nccl" if cfg["device"].startswith("cuda") else "gloo"
    torch.distributed.init_process_group(backend=backend, timeout=timeout)
    _monitor_group = torch.distributed.new_group(backend="gloo", timeout=timeout)


def is_collective_failure(error):
    """A collective that timed out or lost its peer. gloo raises a plain RuntimeError from inside
    DDP's backward or from `work.wait()` ("Timed out waiting ...", "Application timeout caused
    pair closure", "Connection reset by peer"), a DistError elsewhere."""
    signs = ("timed out", "timeout", "connection reset", "connection closed", "broken pipe", "pair closure")
    return torch.distributed.is_initialized() and (
        isinstance(error, torch.distributed.DistError) or any(s in str(error).lower() for s in signs))


def report_collective_failure(error):
    """Called when a collective failed: name the ranks that do not answer (rank 0 finds out,
    with a short monitored barrier), print one line and leave without waiting on anyone."""
    rank = torch.distributed.get_rank()
    who = "rank 0 names the ranks that do not answer"
    try:
        torch.distributed.monitored_barrier(_monitor_group, timeout=timedelta(seconds=min(10.0, _dist_timeout)),
                                           wait_all_ranks=True)
        who = "all ranks answer now"
    except Exception as e:  # rank 0: "Ranks 1, 3 failed to pass monitoredBarrier in 10000 ms"
        found = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", str(e))
        if found:
            ranks = found.group(1).strip()
            who = f"rank{'s' if ',' in ranks else ''} {ranks} not answering: stopped, hung or dead"
    first = (str(error).strip().splitlines() or [type(error).__name__])[0].split("] ")[-1][:160]
    print(f"error: rank {rank}: a collective did not complete within dist_timeout={_dist_timeout:g}s; "
          f"{who} ({first})", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(3)  # not sys.exit: tearing the process group down would wait for the missing ranks


# -----------------------------------------------------------------------------
# Data


def check_dataset(dataset):
    """ConfigError unless the dataset is prepared or can be prepared here. Returns whether it
    must be prepared first. Every rank calls it before the process group exists, so a typo in
    `dataset` stops all of them at once instead of leaving the others waiting for rank 0."""
    data_dir = os.path.join(REPO, "data", dataset)
    wanted = [os.path.join(data_dir, f) for f in ("train.bin", "val.bin")]
    if all(os.path.exists(p) for p in wanted):
        return False
    script = os.path.join(data_dir, "prepare.py")
    shown = os.path.relpath(script) if not os.path.relpath(script).startswith("..") else script
    if not os.path.exists(script):
        known = sorted(d for d in os.listdir(os.path.join(REPO, "data"))
                       if os.path.exists(os.path.join(REPO, "data", d, "prepare.py")))
        raise ConfigError(f"config key 'dataset': unknown dataset {dataset!r} (no {shown}); "
                          f"the datasets are {known}")
    if dataset not in PREPARED_ON_DEMAND:
        raise ConfigError(f"dataset '{dataset}' is not prepared ({wanted[0]} is missing). "
                          f"Prepare it first with:\n    python {shown}")
    return True


def ensure_dataset(dataset):
    """The dataset's directory, preparing it first if it is small enough to do so here."""
    data_dir = os.path.join(REPO, "data", dataset)
    if not check_dataset(dataset):
        return data_dir
    script = os.path.join(data_dir, "prepare.py")
    shown = os.path.relpath(script) if not os.path.relpath(script).startswith("..") else script
    print(f"dataset '{dataset}' is not prepared yet: running {shown}")
    if subprocess.run([sys.executable, script]).returncode != 0:
        sys.exit(f"error: preparing dataset '{dataset}' failed (see above)")
    return data_dir


def check_data(data, cfg, data_dir):
    """Each split must hold at least one window of block_size + 1 tokens (a shorter one would
    crash inside torch.randint, a far longer block_size than the text makes no sense)."""
    for split, tokens in data.items():
        if len(tokens) < cfg["block_size"] + 1:
            raise ConfigError(f"block_size={cfg['block_size']} is too long for {os.path.join(data_dir, split)}"
                              f".bin: it holds {len(tokens):,} tokens, and a batch needs windows of "
                              f"block_size + 1; use block_size <= {len(tokens) - 1}")


def vocab_from_meta(meta, cfg, log):
    """The vocabulary size to build: the dataset's (meta.json), or vocab_size when it is given
    explicitly and is at least as large (padding, e.g. to a multiple of 16 for an FP8 LM head)."""
    if meta is None:
        return cfg["vocab_size"]
    need = meta["vocab_size"]
    if cfg["vocab_size"] == DEFAULTS["vocab_size"]:
        return need
    if cfg["vocab_size"] < need:
        raise ConfigError(f"config key 'vocab_size' is {cfg['vocab_size']}, but dataset '{cfg['dataset']}' "
                          f"has {need} tokens: leave vocab_size out (or give one >= {need})")
    if cfg["vocab_size"] != need:
        log(f"note: vocab_size={cfg['vocab_size']} (the dataset's {need} tokens, padded; the extra "
            f"ids never occur)")
    return cfg["vocab_size"]


TRAIN_STREAM, EVAL_STREAMS = 0, {"train": 1, "val": 2}


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


# -----------------------------------------------------------------------------
# The precision level: the four functions that O2/O3 will replace


def fp8_recipe(cfg, device_type):
    from nanofp8.fp8 import Recipe

    backend = cfg["fp8_backend"] or ("torch" if device_type == "cuda" else "emulate")
    return Recipe(scaling=cfg["fp8_scaling"], granularity=cfg["fp8_granularity"],
                  formats=cfg["fp8_formats"], history_len=cfg["fp8_history_len"],
                  amax_algo=cfg["fp8_amax_algo"], margin=cfg["fp8_margin"], backend=backend)


def setup_precision(model, cfg, device_type):
    """What the layers compute in. Returns a description for the log.

    bf16: nothing to change in the model; the fp32 parameters are the master weights and the
    autocast context around forward casts matmul inputs to bf16 on the fly.
    O1:   swap the block Linears for Fp8Linear (same parameters, plus FP8 scaling buffers).
    O2:   then make them O2Linear: fp16 master weight + scale, FP8 gradient kept outside .grad.
    O3:   or O3Linear: the full weight in FP8; its fp16 master lives sharded in the optimizer."""
    if cfg["precision"] == "bf16":
        return "bf16 autocast, fp32 master weights"
    recipe = fp8_recipe(cfg, device_type)
    names = apply_fp8(model, recipe, cfg["fp8_lm_head"])
    if not names:  # FP8 GEMMs need both dims % 16: an "FP8" run with none would be bf16 in disguise
        raise ConfigError(f"precision={cfg['precision']}: no block Linear can run in FP8: their widths "
                          f"(n_embd={cfg['n_embd']}, MLP {model.config.hidden}) must be multiples of 16")
    level = cfg["precision"]
    if level == "O2":
        convert_to_o2(model)
    elif level == "O3":
        convert_to_o3(model)
    state = {"O1": "fp32 master, fp32 Adam", "O2": f"fp16 master, FP8 grads, FP8 m, {cfg['o2_v_format']} v",
             "O3": f"FP8 weights, FP8 grads, sharded fp16 master / FP8 m / {cfg['o2_v_format']} v"}[level]
    desc = (f"{level}: {len(names)} Linears in FP8 ({recipe.scaling} scaling, {recipe.granularity}, "
            f"{recipe.formats}, backend={recipe.backend}; {state}), the rest bf16 autocast")
    if cfg["fp8_lm_head"] and "lm_head" not in names:
        if cfg["fp8_strict"]:
            raise ConfigError(f"fp8_lm_head=True, fp8_strict=True: the LM head cannot run in FP8 "
                              f"(vocab_size={model.config.vocab_size} is not a multiple of 16)")
        desc += f" (LM head kept bf16: vocab_size={model.config.vocab_size} is not a multiple of 16)"
    return desc


def build_optimizer(model, cfg, device_type):
    """AdamW on fp32 master weights. Matrices (Linear weights, embeddings) get weight decay;
    biases and norm gains do not: shrinking them towards 0 only fights the normalization."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg["weight_decay"]},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    kw = dict(lr=cfg["learning_rate"], betas=(cfg["beta1"], cfg["beta2"]))
    if cfg["precision"] == "O2":
        return Fp8AdamW(groups, model, v_format=cfg["o2_v_format"], **kw)
    if cfg["precision"] == "O3":
        return ZeroFp8AdamW(groups, model, v_format=cfg["o2_v_format"], **kw)
    # The fused CUDA kernel updates all parameters in a few launches instead of several per tensor.
    extra = {"fused": True} if device_type == "cuda" else {}
    return torch.optim.AdamW(groups, **kw, **extra)


def optimizer_step(model, optimizer, cfg):
    """Clip, step, clear. Returns (gradient norm, whether the step was taken, whether the weights
    the step started from were finite).

    A non-finite gradient norm means some gradient overflowed or a NaN came through (FP8 casts
    turn non-finite inputs into NaN on purpose, so they are seen here and not hidden): skip the
    step rather than write NaN into every weight. Deciding that costs one device sync per step,
    and it is the only one (tests/test_syncs.py): the same read brings the norm and the check of
    the weights that the previous update left (check_step acts on it, one step later than the
    update; a checkpoint is never written before that check, see main)."""
    max_norm = cfg["grad_clip"] if cfg["grad_clip"] > 0 else float("inf")
    finite = True
    if isinstance(model, Fp8DataParallel):  # FP8 gradient communication (see wrap_data_parallel)
        finite = model.sync_gradients()  # the same verdict on every rank
        if cfg["precision"] == "O2":
            sync_fp8_wgrads([m for m in model.modules() if isinstance(m, O2Linear)], model.group)
    weights_ok = weights_finite_flag(model)
    if cfg["precision"] == "O3":  # reduce-scatter, clip by the global norm, step the shards
        weights_ok = bool(weights_ok)
        stepped = optimizer.step(grads_finite=finite, max_norm=max_norm)
        norm = optimizer.grad_norm.item()
    else:
        norm = clip_grad_norm(model, max_norm)  # sees O2's FP8 gradients too
        # The one sync: a device-to-host copy of both values (copy=True makes it a copy on a CPU
        # run too, where tests/test_syncs.py counts it).
        norm, weights_ok = torch.stack([norm.float(), weights_ok.float()]).to("cpu", copy=True).tolist()
        stepped = finite and math.isfinite(norm)
        if stepped and isinstance(optimizer, Fp8AdamW):
            optimizer.step(grads_finite=True)  # a finite norm: every gradient is finite
        elif stepped:
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm, stepped, weights_ok == 1


def wrap_data_parallel(model, device, cfg):
    """bf16 (grad_comm auto/fp32): plain DDP, gradients all-reduced in fp32, bucketed and
    overlapped with backward; DDP also broadcasts rank 0's buffers before every forward.
    FP8 levels: Fp8DataParallel, whose all-reduce sends the FP8 layers' weight gradients in FP8
    (each rank's own scales, one per 128 values of one parameter, summed in fp32) and the rest in
    grad_comm_rest (nanofp8/dist.py), overlapped with backward by hooks, as DDP: the loop runs
    every micro-step but the last in no_sync() and clips after sync_gradients(). The FP8
    gradients of O2/O3 weights live outside .grad: O2 averages them in optimizer_step, O3
    reduce-scatters them in its optimizer step; the wrapper handles every other parameter."""
    fmt, rest = grad_comm_format(cfg)
    if cfg["precision"] == "bf16" and fmt == torch.float32:
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=[torch.device(device).index] if device.startswith("cuda") else None)
    fp8_held = {m.weight for m in model.modules() if isinstance(m, O2Linear)}
    return Fp8DataParallel(model, fmt=fmt, rest=rest, overlap=True,
                           params=[p for p in model.parameters() if p not in fp8_held])


GRAD_COMM = {"fp32": torch.float32, "bf16": torch.bfloat16, "e5m2": E5M2, "e4m3": E4M3}


def grad_comm_format(cfg):
    """(what the FP8 layers' weight gradients travel in, what every other gradient travels in).
    bf16 level: grad_comm for both ("auto": fp32, as DDP). FP8 levels: grad_comm ("auto": E4M3:
    with a scale per 128 values range is not the constraint, and E4M3 keeps the gradient ~6 dB
    closer, tests/test_comm.py) and grad_comm_rest."""
    comm = cfg["grad_comm"]
    if cfg["precision"] == "bf16":
        fmt = GRAD_COMM["fp32" if comm == "auto" else comm]
        return fmt, fmt
    return GRAD_COMM["e4m3" if comm == "auto" else comm], GRAD_COMM[cfg["grad_comm_rest"]]


def mp_comm_format(cfg):
    """What tensor/sequence-parallel payloads and pipeline-stage activations travel in: "fp8",
    "bf16" or "fp32". bf16 level: bf16 ("auto"). FP8 levels ("auto"): MP_COMM_AUTO."""
    if cfg["mp_comm"] != "auto":
        return cfg["mp_comm"]
    return "bf16" if cfg["precision"] == "bf16" else MP_COMM_AUTO


# The FP8 levels' default for model-parallel payloads. Judged by the validation-loss gap against
# one process at equal steps: FP8 at the stage boundaries and in the TP partial sums came out no
# further from it than bf16 (both within the run-to-run divergence of a few tenths of a percent),
# at half the bytes. tests/test_train_parallel.py holds the default to 0.3% of one process;
# mp_comm=bf16 is the other choice.
MP_COMM_AUTO = "fp8"


def pipeline_formats(cfg):
    """(activation, gradient) formats between pipeline stages, from mp_comm_format."""
    comm = mp_comm_format(cfg)
    return (E4M3, E5M2) if comm == "fp8" else (parallel.PLAIN[comm],) * 2


def optimizer_state_for_checkpoint(optimizer, cfg, master):
    """The optimizer state to save. O3: every rank holds its own shard; they are gathered to rank
    0 (called on every rank) and saved side by side in the one checkpoint file."""
    state = optimizer.state_dict()
    if cfg["precision"] != "O3":
        return state
    # Pickling collectives cannot carry FP8 tensors: serialize each shard with torch.save and
    # gather the bytes (padded to the longest) as uint8.
    dev = next(iter(optimizer.o2)).device
    buf = io.BytesIO()
    torch.save(state, buf)
    mine = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8).to(dev)
    world = torch.distributed.get_world_size()
    sizes = [torch.zeros(1, dtype=torch.long, device=dev) for _ in range(world)]
    torch.distributed.all_gather(sizes, torch.tensor([mine.numel()], device=dev))
    longest = max(int(n) for n in sizes)
    got = [torch.empty(longest, dtype=torch.uint8, device=dev) for _ in range(world)]
    torch.distributed.all_gather(got, torch.nn.functional.pad(mine, (0, longest - mine.numel())))
    if not master:
        return None
    return {"zero_shards": [torch.load(io.BytesIO(g[: int(n)].cpu().numpy().tobytes()), map_location="cpu",
                                       weights_only=True) for g, n in zip(got, sizes)]}


def load_optimizer_state(optimizer, state, path, rank, world_size):
    if "zero_shards" in state:
        if len(state["zero_shards"]) != world_size:
            raise CheckpointError(f"{path} holds O3 optimizer shards for {len(state['zero_shards'])} "
                                  f"ranks; resume it with the same number of processes, not {world_size}")
        state = state["zero_shards"][rank]
    optimizer.load_state_dict(state)


# -----------------------------------------------------------------------------
# Model parallelism: the small functions that follow nanofp8/parallel.py's call contract


def make_parallel_groups(cfg, ddp, world_size):
    """This rank's place in the data x tensor x pipeline arrangement, and its process groups."""
    tp, pp = cfg["tensor_parallel"], cfg["pipeline_parallel"]
    if not ddp:
        raise ConfigError(f"tensor_parallel={tp}, pipeline_parallel={pp} split the model over "
                          f"processes: launch with torchrun --nproc_per_node=N, N a multiple of {tp * pp}")
    if world_size % (tp * pp):
        raise ConfigError(f"world size {world_size} is not divisible by tensor_parallel * "
                          f"pipeline_parallel = {tp} * {pp}")
    return parallel.make_groups(tp=tp, pp=pp)


def setup_model_parallel(model, cfg, groups):
    """Cut the (identically initialized, precision already set up) GPT into this rank's share:
    its stage's blocks, their matrices cut over the tensor-parallel group. Returns the stage, the
    module that is trained and checkpointed from here on; the rest of `model` is dropped."""
    c, tp, pp = model.config, groups.tp, groups.pp
    # parallel.py would raise ValueErrors; say which keys to change instead
    if c.n_head % tp or c.hidden % tp:
        raise ConfigError(f"tensor_parallel={tp} must divide n_head ({c.n_head}) and the MLP width "
                          f"({c.hidden}, mlp_hidden=0: the architecture's default)")
    if c.n_layer < pp:
        raise ConfigError(f"pipeline_parallel={pp} stages need n_layer >= {pp}, got {c.n_layer}")
    # FP8 levels: TPLinear (FP8 GEMMs, partial sums and SP gathers sent in mp_comm). bf16: the
    # same cut with bf16 GEMMs and bf16 collectives, the baseline that Megatron-LM runs.
    parallel.parallelize(model, groups.tp_group, sp=cfg["sequence_parallel"], comm=mp_comm_format(cfg))
    return parallel.PipelineStage(model, groups)


def model_parallel_batches(data, cfg, groups, iter_num, accum, device):
    """This replica's micro-batches, the same on every rank of its tensor and pipeline groups.
    Micro-batch m of replica d is drawn as a single process draws its micro-step d * accum + m:
    an iteration sees the same tokens at any layout, so its loss compares with one device's."""
    return [get_batch(data, cfg["batch_size"], cfg["block_size"],
                      batch_generator(cfg["seed"], TRAIN_STREAM, iter_num, groups.dp_rank * accum + m, 0),
                      device) for m in range(accum)]


def model_parallel_step(stage, replicas, optimizer, groups, cfg):
    """optimizer_step for a model cut over ranks. Returns (gradient norm, whether stepped).

    A parameter's gradient can be spread over several ranks: the token slices of sequence
    parallelism, the two copies of a tied embedding (first and last stage), the data-parallel
    replicas. They are summed in that order, and the norm is the whole model's, the same on every
    rank, so every rank takes the same clip and skip decision (a NaN anywhere is seen everywhere)."""
    parallel.sync_model_parallel_grads(stage, groups)
    finite = replicas.sync_gradients() if replicas else True
    max_norm = cfg["grad_clip"] if cfg["grad_clip"] > 0 else float("inf")
    norm = parallel.clip_grad_norm_(stage, max_norm, groups)
    stepped = finite and bool(torch.isfinite(norm))
    if stepped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm.item(), stepped


@torch.no_grad()
def check_replicas(stage, groups):
    """Raise if a tensor that several ranks hold has come apart: every parameter over the
    data-parallel replicas, the unsharded ones over the tensor group, the tied embedding copies
    between first and last stage. Each rank all-gathers one checksum of the bits per tensor;
    parallel.py's design makes them bit-identical, and silent drift would train a different model
    on every rank (checked at every evaluation: a few bytes and one pass over the weights)."""
    named = list(stage.named_parameters())
    checks = (("data-parallel replicas", groups.dp_group, groups.dp, lambda p: True),
              ("tensor-parallel ranks", groups.tp_group, groups.tp,
               lambda p: not getattr(p, "tp_sharded", False)),
              ("tied embedding copies", groups.embed_group, 2 if groups.pp > 1 else 1,
               lambda p: getattr(p, "pp_tied", False)))
    for what, group, n, keep in checks:
        ps = [(k, p) for k, p in named if keep(p)]
        if n == 1 or not ps or group is None:
            continue
        mine = torch.stack([p.detach().float().view(torch.int32).sum(dtype=torch.int64) for _, p in ps])
        got = [torch.empty_like(mine) for _ in range(n)]
        torch.distributed.all_gather(got, mine, group=group)
        bad = [k for i, (k, _) in enumerate(ps) if any(g[i] != mine[i] for g in got)]
        if bad:
            raise RuntimeError(f"{what} hold different values of {bad[:5]}: the replicas diverged")


class TrainingStopped(RuntimeError):
    """The run cannot go on usefully (its weights or gradients stay non-finite)."""


# What a resumed run must share with the run that wrote the checkpoint, and what changing it would
# do. The model's architecture is not here: it is taken from the checkpoint.
RESUME_KEYS = {
    "o2_v_format": "read the saved Adam v in the wrong format (fp16 v as E4M3 sqrt(v), or the reverse)",
    "dataset": "continue the run on other data",
    "seed": "draw other batches and dropout masks than the run it continues (the batch of "
            "iteration i is a function of seed and i)",
}


def check_resume_config(saved, cfg, path, converted=False):
    """Refuse to resume with a setting that would silently make a different run, naming both values.
    saved: the checkpoint's config. converted: the checkpoint is converted to another level or
    layout, whose optimizer state is stored anew, so only the data-defining keys must match."""
    for key, why in RESUME_KEYS.items():
        if key == "o2_v_format" and (converted or cfg["precision"] not in ("O2", "O3")):
            continue
        if key in saved and saved[key] != cfg[key]:
            raise CheckpointError(f"{path} was written with {key}={saved[key]!r}; resuming with "
                                  f"{key}={cfg[key]!r} would {why}. Pass {key}={saved[key]}, or "
                                  f"start a new run (init_from=scratch, another out_dir)")


@torch.no_grad()
def nonfinite_tensors(model):
    """Names of the floating-point parameters and buffers holding a NaN or an Inf, with one
    device sync for the whole model (FP8 tensors are widened: isfinite has no FP8 kernel)."""
    named = [(k, t) for k, t in (*model.named_parameters(), *model.named_buffers()) if t.is_floating_point()]
    if not named:
        return []
    ok = torch.stack([torch.isfinite(t if t.element_size() > 1 else t.float()).all() for _, t in named])
    if bool(ok.all()):
        return []
    return [k for (k, _), good in zip(named, ok.tolist()) if not good]


def weights_finite(model, group_size):
    """Whether every rank's weights are finite (one small all-reduce under torchrun, so that all
    ranks stop together even if only one of them went bad)."""
    ok = torch.tensor([0.0 if nonfinite_tensors(model) else 1.0], device=next(model.parameters()).device)
    if group_size > 1:
        torch.distributed.all_reduce(ok, op=torch.distributed.ReduceOp.MIN)
    return bool(ok.item())


@torch.no_grad()
def weights_finite_flag(model):
    """weights_finite as a device tensor (1.0 or 0.0), without the sync: the largest magnitude of
    every floating-point parameter and buffer, one foreach reduction per dtype (NaN propagates
    through it, an inf is its own maximum). Under torchrun the ranks agree by a MIN all-reduce."""
    by_dtype = {}
    for t in (*model.parameters(), *model.buffers()):
        if t.is_floating_point():
            t = t.detach() if t.element_size() > 1 else t.detach().float()  # no FP8 kernels
            by_dtype.setdefault(t.dtype, []).append(t)
    amax = [a.float() for ts in by_dtype.values() for a in torch._foreach_norm(ts, float("inf"))]
    ok = torch.isfinite(torch.stack(amax)).all().float()
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(ok, op=torch.distributed.ReduceOp.MIN)
    return ok


def rng_state_for_checkpoint(device_type, device, group, group_size, writer):
    """The dropout RNG of every data-parallel rank (called on all of them), for the writer to save.
    Each rank draws its own masks, so each one's stream has to be saved for a bit-exact resume."""
    rng = {"cpu": torch.get_rng_state()}
    if device_type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state()
    if group_size > 1:
        mine = torch.cat([rng["cpu"]] + ([rng["cuda"]] if "cuda" in rng else [])).to(device)
        got = [torch.empty_like(mine) for _ in range(group_size)]
        torch.distributed.all_gather(got, mine, group=group)
        rng["ranks"] = [g.cpu() for g in got]
    return rng if writer else None


def restore_rng(rng, device_type, rank_in_group, group_size):
    """Continue this rank's saved dropout stream. Returns False when the checkpoint has none for it
    (written at another world size, or by an older version): the caller reseeds."""
    if group_size > 1:
        if len(rng.get("ranks", [])) != group_size:
            return False
        state = rng["ranks"][rank_in_group].cpu()
        n_cpu = rng["cpu"].numel()
        torch.set_rng_state(state[:n_cpu])
        if device_type == "cuda" and state.numel() > n_cpu:
            torch.cuda.set_rng_state(state[n_cpu:])
        return True
    torch.set_rng_state(rng["cpu"].cpu())
    if device_type == "cuda" and "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"].cpu())
    return True


def checkpoint_path(cfg, groups):
    """out_dir/ckpt.pt; under model parallelism one file per (tensor, pipeline) rank, written by
    data-parallel rank 0: that rank's shards (the GPT's keys) and its optimizer state."""
    name = "ckpt.pt" if groups is None else f"ckpt-{parallel.checkpoint_suffix(groups)}.pt"
    return os.path.join(cfg["out_dir"], name)


def check_resume_layout(ckpt, cfg, path, device):
    """A model-parallel checkpoint holds one rank's shards: resume at the layout that wrote it
    (the data-parallel size may change: batches do not depend on it). All ranks must have read
    files of the same iteration (a crash between two ranks' writes leaves mixed files)."""
    for key in ("tensor_parallel", "pipeline_parallel"):
        saved = ckpt["config"].get(key, 1)
        if saved != cfg[key]:
            raise CheckpointError(f"{path} was written with {key}={saved}: resume with the same "
                                  f"layout, not {key}={cfg[key]}")
    it = torch.tensor([ckpt["iter_num"], -ckpt["iter_num"]], device=device)
    torch.distributed.all_reduce(it, op=torch.distributed.ReduceOp.MAX)
    if it[0] != -it[1]:
        raise CheckpointError(f"the checkpoints in {cfg['out_dir']} are from different iterations "
                              f"({-int(it[1])} to {int(it[0])}): not one consistent model")


# -----------------------------------------------------------------------------
# Helpers


def check_step(model, stepped, skipped_in_a_row, grad_norm, iter_num, lr, cfg, world_size, ckpt_path, log,
               weights_ok=None):
    """After each optimizer step: stop when the weights went non-finite, or when steps keep being
    skipped for non-finite gradients (a run that only skips learns nothing and would keep writing
    checkpoints). Returns the new count of skipped steps in a row. weights_ok: optimizer_step's
    verdict on the weights this step started from, i.e. on the previous iteration's update (None:
    check this iteration's update here, with a sync of its own)."""
    if weights_ok is None:  # model parallel: this iteration's update, checked now (a sync of its own)
        weights_ok = not stepped or weights_finite(model, world_size)
    else:
        iter_num, lr = iter_num - 1, lr_at(iter_num - 1, cfg)
    if not weights_ok:
        bad = nonfinite_tensors(model)
        raise TrainingStopped(f"the update of iteration {iter_num} (learning rate {lr:g}) made weights "
                              f"non-finite{' (' + ', '.join(bad[:3]) + ')' if bad else ' on another rank'}: "
                              f"stopped; {ckpt_path} is untouched: resume from it with a lower learning_rate")
    if stepped:
        return 0
    skipped_in_a_row += 1
    log(f"iter {iter_num}: step SKIPPED (grad norm {grad_norm}), {skipped_in_a_row} in a row")
    if 0 < cfg["max_skipped_steps"] <= skipped_in_a_row:
        raise TrainingStopped(f"{skipped_in_a_row} steps in a row skipped for non-finite gradients "
                              f"(max_skipped_steps={cfg['max_skipped_steps']}), the last at iteration {iter_num}: "
                              f"stopped; {ckpt_path} holds the last good state: resume from it with a lower "
                              f"learning_rate, or look for bad data")
    return skipped_in_a_row


def read_losses(losses):
    """The training losses are kept as device tensors until a logging iteration reads them (one
    sync for all of them): replace the unread ones, at the end of the list, by floats. Returns
    the last loss."""
    start = len(losses)
    while start > 0 and torch.is_tensor(losses[start - 1][1]):
        start -= 1
    if start < len(losses):
        values = torch.stack([l for _, l in losses[start:]]).tolist()
        losses[start:] = [(it, v) for (it, _), v in zip(losses[start:], values)]
    return losses[-1][1] if losses else float("nan")


def lr_at(it, cfg):
    """Linear warmup from ~0 to learning_rate, cosine decay to min_lr at lr_decay_iters, flat after."""
    lr, warmup, decay_end = cfg["learning_rate"], cfg["warmup_iters"], cfg["lr_decay_iters"]
    if not cfg["decay_lr"]:
        return lr
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    if it >= decay_end:
        return cfg["min_lr"]
    progress = (it - warmup) / max(1, decay_end - warmup)
    return cfg["min_lr"] + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - cfg["min_lr"])


def peak_flops_for(cfg, device_type):
    if cfg["peak_flops"] > 0:
        return cfg["peak_flops"]
    if device_type != "cuda":
        return None  # no meaningful single peak for a CPU
    name = torch.cuda.get_device_name()
    for key, (bf16_peak, fp8_peak) in PEAK_FLOPS.items():
        if key in name:
            return fp8_peak if cfg["precision"] != "bf16" else bf16_peak
    return None


@torch.no_grad()
def estimate_loss(model, data, cfg, autocast, device, rank, world_size, show_progress, groups=None):
    """Mean loss over eval_iters batches per split. The batches are the same at every evaluation
    (seeded by split and index only), so the curve measures the model, not the sampling noise,
    and a bf16 and an FP8 run are compared on exactly the same text.

    Model parallel (groups): `model` is this rank's pipeline stage, rank / world_size are the
    data-parallel rank and size: the ranks of one replica evaluate the same batches together."""
    from tqdm import tqdm

    model.eval()
    out = {}
    for split in ("train", "val"):
        total = torch.zeros((), device=device)
        # A progress bar that erases itself (leave=False), and only on a terminal (disable=None):
        # logs redirected to a file stay clean.
        batches = tqdm(range(cfg["eval_iters"]), desc=f"eval {split}", leave=False,
                       disable=None if show_progress else True, file=sys.stdout)
        for k in batches:
            gen = batch_generator(cfg["seed"], EVAL_STREAMS[split], 0, k, rank)
            x, y = get_batch(data[split], cfg["batch_size"], cfg["block_size"], gen, device)
            if groups is None:
                with autocast:
                    _, loss = model(x, y)
            else:  # the last stage computes the loss and hands it to every rank of the pipeline
                act, grad = pipeline_formats(cfg)
                loss = parallel.pipeline_step(model, [(x, y)], groups, autocast=autocast, train=False,
                                              act_fmt=act, grad_fmt=grad)
            total += loss.float()
        if world_size > 1:
            torch.distributed.all_reduce(total, group=None if groups is None else groups.dp_group)
        out[split] = total.item() / (cfg["eval_iters"] * world_size)
    model.train()
    return out


# -----------------------------------------------------------------------------


def main(argv=None):
    """Train; returns {'losses': [(iter, loss)], 'evals': [(iter, train, val)]} (for tests)."""
    cfg = load_config(sys.argv[1:] if argv is None else argv)

    # ---- processes and devices
    ddp = int(os.environ.get("RANK", -1)) != -1  # launched by torchrun?
    if cfg["device"] == "auto":
        cfg["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    check_dataset(cfg["dataset"])  # every rank, before one of them waits for another
    if ddp:
        rank, local_rank, world_size = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
        tp_pp = cfg["tensor_parallel"] * cfg["pipeline_parallel"]
        if world_size % tp_pp == 0:  # (else make_parallel_groups says what is wrong)
            check_accumulation(cfg, world_size // tp_pp, "processes" if tp_pp == 1 else "replicas")
        if cfg["device"].startswith("cuda"):
            cfg["device"] = f"cuda:{local_rank}"
            torch.cuda.set_device(cfg["device"])
        init_distributed(cfg)
    else:
        rank, local_rank, world_size = 0, 0, 1
    master = rank == 0
    if cfg["precision"] == "O3" and not ddp:
        raise ConfigError("precision=O3 shards the optimizer state over data-parallel ranks: launch "
                          "it with torchrun (torchrun --nproc_per_node=N train.py ..., N >= 1)")
    # Model parallelism: the processes form dp_size replicas of a model cut over tp * pp ranks.
    model_parallel = cfg["tensor_parallel"] * cfg["pipeline_parallel"] > 1
    groups = make_parallel_groups(cfg, ddp, world_size) if model_parallel else None
    dp_size = world_size if groups is None else groups.dp
    data_rank = rank if groups is None else groups.dp_rank  # the ranks of a replica share batches
    writer = master if groups is None else groups.dp_rank == 0  # writes a checkpoint file
    dropout_stream = rank if groups is None else (groups.dp_rank, groups.pp_rank)  # shared by a TP group
    log = print if master else (lambda *a, **k: None)
    device = cfg["device"]
    device_type = device.split(":")[0]
    if cfg["compile"] is None:
        cfg["compile"] = device_type == "cuda" and not model_parallel and not cfg["fp8_stats_interval"]
    check_accumulation(cfg, dp_size, "processes" if groups is None else "replicas")
    accum = cfg["gradient_accumulation_steps"] // dp_size  # micro-steps per rank
    tokens_per_iter = cfg["gradient_accumulation_steps"] * cfg["batch_size"] * cfg["block_size"]
    if device_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls outside autocast: use TF32
        torch.backends.cudnn.allow_tf32 = True
    autocast = torch.autocast(device_type, dtype=torch.bfloat16)

    # ---- data
    if master:
        ensure_dataset(cfg["dataset"])
    if ddp:
        torch.distributed.barrier()  # the others wait until rank 0 has prepared the data
    data_dir = os.path.join(REPO, "data", cfg["dataset"])
    data = {s: np.memmap(os.path.join(data_dir, f"{s}.bin"), dtype=np.uint16, mode="r") for s in ("train", "val")}
    check_data(data, cfg, data_dir)
    cfg["vocab_size"] = vocab_from_meta(read_dataset_meta(data_dir), cfg, log)

    # ---- model, from scratch or from the checkpoint
    ckpt_path = checkpoint_path(cfg, groups)
    ckpt = None
    # Another level or layout, or pretrained weights: fp32 weights, converted (nanofp8/checkpoint.py)
    converted = initial_weights(cfg, world_size)
    if converted is not None:
        if cfg["init_from"] == "resume":
            check_resume_config(converted["config"], cfg, ckpt_path, converted=True)
        log(f"note: {converted['note']}")
    elif cfg["init_from"] == "resume":
        ckpt = load_checkpoint(ckpt_path, map_location=device)
        check_resume_config(ckpt["config"], cfg, ckpt_path)
        if groups is not None:
            check_resume_layout(ckpt, cfg, ckpt_path, device)
    if ckpt is not None or converted is not None:
        for k in MODEL_KEYS:  # the architecture is the checkpoint's, whatever the config says
            saved = (ckpt or converted)["model_args"][k]
            if cfg[k] != saved:
                log(f"note: {k}={saved} from the checkpoint overrides {cfg[k]!r}")
            cfg[k] = saved
    model_args = {k: cfg[k] for k in MODEL_KEYS}
    torch.manual_seed(cfg["seed"])  # same initial weights on every rank
    model = GPT(GPTConfig(**model_args))
    if converted is not None:  # before setup_precision: it builds each level's storage from fp32
        load_model_state(model, converted["model"], cfg["init_from"])
        converted = {k: converted[k] for k in ("iter_num", "best_val_loss", "moments")}  # frees the weights
    precision_desc = setup_precision(model, cfg, device_type)
    n_params, flops_per_token = model.num_params(), model.flops_per_token()  # the whole model's
    if groups is not None:
        model = setup_model_parallel(model, cfg, groups)  # from here on: this rank's stage
    if ckpt is not None:
        load_model_state(model, ckpt["model"], ckpt_path)
        bad = nonfinite_tensors(model)
        if bad:
            raise CheckpointError(f"{ckpt_path} holds non-finite values in {bad[:5]}: the run that wrote "
                                  f"it had diverged; resume from an earlier checkpoint")
    model.to(device)
    if cfg["precision"] != "bf16":  # what really runs in FP8, and no silent fallback under strict
        fp8.strict, rows = cfg["fp8_strict"], linear_table(model)
        fp8.fallbacks.clear()
        log(format_linear_table(rows))
        if cfg["fp8_strict"] and any(r["fallback"] for r in rows):
            raise ConfigError(f"fp8_strict=True: {[r['layer'] for r in rows if r['fallback']]} cannot run "
                              "their GEMMs in FP8 on this device (see the table above)")
    optimizer = build_optimizer(model, cfg, device_type)
    iter_num, best_val_loss = 0, float("inf")
    if converted is not None:
        iter_num, best_val_loss = converted["iter_num"], converted["best_val_loss"]
        if converted["moments"]:  # in the new level's formats (nanofp8/checkpoint.py)
            load_moments(optimizer, model, converted["moments"])
    # The global RNG now only drives dropout. Each rank gets its own stream (a tensor-parallel
    # group shares one: its replicated activations must drop the same units); a resumed run
    # continues each data-parallel rank's saved stream (one reseeds only if the checkpoint has
    # none for it, e.g. written at another world size: then the resume is not bit-exact).
    torch.manual_seed(hash((cfg["seed"], dropout_stream)) & (2**63 - 1))
    rng_group = None if groups is None else groups.dp_group  # the ranks whose streams a file holds
    if ckpt is not None:
        load_optimizer_state(optimizer, ckpt["optimizer"], ckpt_path, rank, world_size)
        iter_num, best_val_loss = ckpt["iter_num"], ckpt["best_val_loss"]
        if not ("rng" in ckpt and restore_rng(ckpt["rng"], device_type, data_rank, dp_size)):
            log("note: the checkpoint has no dropout RNG state for this world size: reseeded, so "
                "with dropout > 0 the resumed run differs from an uninterrupted one")
            torch.manual_seed(hash((cfg["seed"], dropout_stream, iter_num)) & (2**63 - 1))
        ckpt = None  # free the loaded tensors
    start_iter = iter_num
    raw_model = model  # the module whose state_dict is saved (no compile or DDP wrappers)
    stats = None  # FP8 statistics: rank 0's casts, every fp8_stats_interval iterations
    if cfg["fp8_stats_interval"] and cfg["precision"] != "bf16" and master:
        stats = Fp8Stats(raw_model, cfg["fp8_stats_interval"], cfg["out_dir"], stats_alarms(cfg),
                         append=start_iter > 0)
    if cfg["compile"]:
        log("compiling the model (takes a minute) ...")
        model = torch.compile(model)
    dp_sync = None  # model parallel: what averages gradients over the replicas
    if ddp and groups is None:
        model = wrap_data_parallel(model, device, cfg)
    elif groups is not None and groups.dp > 1:  # (broadcasts replica 0's weights)
        fmt, rest = grad_comm_format(cfg)
        dp_sync = parallel.TPDataParallel(model, groups, fmt=fmt, rest=rest)
    peak = peak_flops_for(cfg, device_type)

    log(f"{n_params / 1e6:.2f}M parameters ({cfg['arch']}, {cfg['n_layer']} layers, "
        f"d={cfg['n_embd']}), {precision_desc}")
    layout = "" if groups is None else (
        f" = {groups.dp} data x {groups.tp} tensor{' (+sequence)' if cfg['sequence_parallel'] else ''} "
        f"x {groups.pp} pipeline parallel, {accum} micro-batches per replica")
    log(f"device {device} x {world_size}{layout}, compile={cfg['compile']}, {tokens_per_iter:,} tokens per "
        f"iteration, {'resuming at iter ' + str(iter_num) if start_iter else 'from scratch'}")
    if writer:
        os.makedirs(cfg["out_dir"], exist_ok=True)

    # ---- the training loop
    history = {"losses": [], "evals": []}
    t_last, step_time, step_count = time.time(), 0.0, 0
    skipped_in_a_row = 0
    while True:
        lr = lr_at(iter_num, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr

        # Evaluate and checkpoint. A resumed run skips the evaluation at its first iteration: the
        # run that wrote the checkpoint did it just before saving.
        due = iter_num % cfg["eval_interval"] == 0 or iter_num == cfg["max_iters"]
        just_resumed = start_iter > 0 and iter_num == start_iter
        if cfg["eval_only"] or (due and not just_resumed):
            losses = estimate_loss(model, data, cfg, autocast, device, data_rank, dp_size, master, groups)
            if groups is not None:
                check_replicas(raw_model, groups)
            log(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            history["evals"].append((iter_num, losses["train"], losses["val"]))
            improved = losses["val"] < best_val_loss
            best_val_loss = min(best_val_loss, losses["val"])
            save = iter_num > 0 and not cfg["eval_only"] and (improved or cfg["always_save_checkpoint"])
            if save and not math.isfinite(losses["val"]):  # never replace a good checkpoint by this
                log(f"not saving a checkpoint: the val loss is {losses['val']}")
                save = False
            if save and not weights_finite(raw_model, world_size):  # the next step's check comes too late
                log("not saving a checkpoint: the last update left non-finite weights")
                save = False
            opt_state = optimizer_state_for_checkpoint(optimizer, cfg, writer) if save else None
            rng = rng_state_for_checkpoint(device_type, device, rng_group, dp_size, writer) if save else None
            if writer and save:
                save_checkpoint({
                    "model": raw_model.state_dict(),  # includes the FP8 scaling state (buffers)
                    "optimizer": opt_state,
                    "model_args": model_args,
                    "config": dict(cfg),
                    "iter_num": iter_num,
                    "best_val_loss": best_val_loss,
                    "rng": rng,
                    # Batches are a function of (seed, iteration): the iteration is the position.
                    "data": {"dataset": cfg["dataset"], "seed": cfg["seed"], "iter": iter_num,
                             "tokens_seen": iter_num * tokens_per_iter},
                }, ckpt_path)
                log(f"saved checkpoint to {ckpt_path}" + ("" if groups is None else " (each tensor "
                    "and pipeline rank its own ckpt-tp*-pp*.pt)"))
            t_last = time.time()  # do not bill the evaluation to the next iteration
        if cfg["eval_only"] or iter_num >= cfg["max_iters"]:
            break

        if stats is not None and stats.due(iter_num):
            stats.start()
        if groups is None:
            # Forward and backward over the micro-batches; gradients add up in .grad. Under DDP
            # only the last micro-batch all-reduces (no_sync on the others).
            loss_sum = torch.zeros((), device=device)
            for micro in range(accum):
                gen = batch_generator(cfg["seed"], TRAIN_STREAM, iter_num, micro, rank)
                x, y = get_batch(data["train"], cfg["batch_size"], cfg["block_size"], gen, device)
                sync = nullcontext() if not ddp or micro == accum - 1 else model.no_sync()
                with sync:
                    with autocast:
                        _, loss = model(x, y)
                    (loss / accum).backward()
                loss_sum += loss.detach().float()
            grad_norm, stepped, weights_ok = optimizer_step(model, optimizer, cfg)
            loss_value = loss_sum / accum  # read at logging iterations: no sync of its own here
        else:
            # Model parallel: GPipe runs the replica's micro-batches forward through the stages,
            # then backward; the mean loss comes back on every rank (nanofp8/parallel.py).
            micro_batches = model_parallel_batches(data["train"], cfg, groups, iter_num, accum, device)
            act, grad = pipeline_formats(cfg)
            loss = parallel.pipeline_step(model, micro_batches, groups, autocast=autocast,
                                          act_fmt=act, grad_fmt=grad)
            grad_norm, stepped = model_parallel_step(model, dp_sync, optimizer, groups, cfg)
            weights_ok = None  # check_step checks this update itself
            if groups.dp > 1:  # log the whole batch's loss, comparable with one device's
                torch.distributed.all_reduce(loss, group=groups.dp_group)
            loss_value = loss.item() / groups.dp
        skipped_in_a_row = check_step(raw_model, stepped, skipped_in_a_row, grad_norm, iter_num, lr,
                                      cfg, world_size, ckpt_path, log, weights_ok)
        history["losses"].append((iter_num, loss_value))
        for line in stats.finish(iter_num, optimizer) if stats is not None else ():
            log(line)  # the step's summary (worst layer by SQNR, saturation), and alarms
        now = time.time()
        step_time, step_count, t_last = step_time + now - t_last, step_count + 1, now
        if iter_num % cfg["log_interval"] == 0:
            dt, step_time, step_count = step_time / step_count, 0.0, 0  # mean since the last log line
            tok_per_s = tokens_per_iter / dt
            loss_value = read_losses(history["losses"])
            line = f"iter {iter_num}: loss {loss_value:.4f}, time {dt * 1000:.2f}ms, {tok_per_s:,.0f} tok/s"
            if peak and iter_num > start_iter + 2:  # the first iterations include compilation
                # MFU is per GPU: the world's tokens are shared by world_size GPUs. (Model parallel:
                # a stage's FLOPs are not the model's, so use the whole model's FLOPs per token.)
                mfu = (raw_model.estimate_mfu(tok_per_s / world_size, peak) if groups is None
                       else flops_per_token * tok_per_s / world_size / peak)
                line += f", mfu {100 * mfu:.2f}%"
            if not stepped:
                line += f", SKIPPED (grad norm {grad_norm})"
            log(line)
        iter_num += 1

    read_losses(history["losses"])
    if cfg["precision"] != "bf16":
        log(fallback_line())
    if ddp:
        torch.distributed.destroy_process_group()
    return history


def cli(argv=None):
    """main() as a command: one line on stderr per failure, and the exit status says which kind:
    2 a bad config, checkpoint or dataset; 1 a run that stopped on non-finite weights or gradients.
    Under torchrun, a collective that times out makes its rank name the ranks not answering."""
    try:
        main(argv)
    except ConfigError as e:  # decided alike on every rank: say it once
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except CheckpointError as e:
        rank = f"rank {os.environ['RANK']}: " if "RANK" in os.environ else ""
        print(f"error: {rank}{e}", file=sys.stderr)
        sys.exit(2)
    except TrainingStopped as e:  # diverged: every rank reaches the same verdict
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except RuntimeError as e:
        if not is_collective_failure(e):
            raise
        report_collective_failure(e)


if __name__ == "__main__":
    cli()
