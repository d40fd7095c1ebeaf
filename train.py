"""
Train a GPT in bf16 or in FP8 (levels O1, O2, O3), on a CPU, one GPU, or many GPUs with torchrun.

    python train.py config/shakespeare_char_fp8.py                 # the baby model in FP8, minutes on a CPU
    python train.py config/shakespeare_char.py precision=O2        # the level is a command-line choice
    python train.py config/shakespeare_char_fp8.py --max_iters=100 # key=value overrides the file
    torchrun --standalone --nproc_per_node=8 train.py config/gpt2_fp8.py

Precision levels (`precision=...`):

    bf16  fp32 master weights and optimizer state, every matmul in bf16 under autocast.
    O1    as bf16, but the Linears inside the transformer blocks run their three GEMMs (forward,
          dgrad, wgrad) in FP8 and keep FP8 copies of their input and weight for the backward
          pass (nanofp8/fp8.py). Embeddings, norms, attention and the LM head stay bf16/fp32.
    O2    as O1, plus precision decoupling for those Linears (nanofp8/optim.py): fp16 master
          weights with a scale, FP8 weight gradients, FP8 Adam m, fp16 Adam v (a scale per 128
          values of each of the last three): 6.09 instead of 16 bytes per parameter
          (o2_v_format='fp8': 5.09).
    O3    as O2, with the master weights and moments sharded over the data-parallel ranks
          (ZeRO, nanofp8/zero.py): 2 + 5/N bytes per parameter. Needs torchrun.

The level touches the loop in setup_precision (what the layers compute in), build_optimizer (what
holds the master weights and moments), optimizer_step (how gradients become an update) and
run.wrap_data_parallel (how the replicas sum gradients: torch's DDP in fp32 at bf16; at the FP8
levels nanofp8.dist.Fp8DataParallel sends the FP8 layers' weight gradients in FP8, grad_comm).

Model parallelism (nanofp8/parallel.py), bf16 and O1, under torchrun: the N processes form
N / (tensor_parallel * pipeline_parallel) data-parallel replicas of a model whose block matrices
are cut over tensor_parallel ranks (sequence_parallel=True also cuts the sequence) and whose
blocks are cut into pipeline_parallel stages (GPipe); what crosses between them is mp_comm.

    torchrun --nproc_per_node=8 train.py config/gpt2_fp8.py tensor_parallel=2 sequence_parallel=True \
        pipeline_parallel=2                     # 2 replicas x 2 tensor x 2 pipeline ranks

The loop in main() is flat, as nanoGPT's: evaluate (and checkpoint) every eval_interval
iterations, forward and backward over the micro-batches, optimizer_step. What differs between
layouts (nanofp8/layout.py: one object, of sizes 1 for one process) is in nanofp8/run.py: a
pipeline's schedule (pipeline_loss, which owns backward), gradients spread over ranks
(sync_gradients, clip), O3's sharded state and per-rank checkpoint files (save_unless_diverged).

Checkpoints (nanofp8/outdir.py): each is a set, out_dir/ckpt-<iter>/, complete once its
manifest is written; the newest keep_checkpoints are kept, a diverged state is never saved, and
a run refuses to start where it would lose work. Every failure is one line and an exit status
(docs/checkpoints.md). Seeing the numerics (nanofp8/stats.py): a table of the
Linears, a count of GEMMs that fell back to high precision, fp8_stats_interval=N's statistics.

Reproducibility: the batch of iteration i is seeded with (seed, i, micro step, rank): a resumed run
reproduces one that never stopped, on CPU bit for bit. The config is read-only once validated.
"""

import inspect
import math
import os
import sys
from contextlib import nullcontext

import torch

from nanofp8 import fp8
from nanofp8.configurator import (RECIPE_KEYS, ConfigError, apply_recipe_preset, check_accumulation, check_train_config,
                                  compile_choice, config_notes, configure, defaults_of, read_dataset_meta, stats_alarms)
from nanofp8.data import (EVAL_STREAMS, TRAIN_STREAM, batch_generator, check_dataset, check_tokens, data_dir,
                          get_batch, open_splits, vocab_size_for)
from nanofp8.dist import Fp8DataParallel
from nanofp8.layout import Layout, start
from nanofp8.model import GPT, GPTConfig, apply_fp8, checkpoint_blocks
from nanofp8.ckptfile import load_model_state
from nanofp8.o2_compile import bump_if_fused, cast_after_steps, cast_once_per_step, push_amaxes
from nanofp8.optim import Fp8AdamW, convert_to_o2
from nanofp8.run import (Clock, as_rank, check_replicas, check_room, check_step, clip, command, finish,
                         load_resumed, nothing_to_do, pipeline_loss, prepare_out_dir, restore_state, resume_point,
                         save_unless_diverged, say, shard_model, show_fp8_layers, sync_gradients, weights_finite,
                         wrap_data_parallel)
from nanofp8.stats import ClipLog, Fp8Stats, fallback_line
from nanofp8.zero import ZeroFp8AdamW, convert_to_o3

# -----------------------------------------------------------------------------
# Defaults: GPT-2 small (124M) on OpenWebText. Config files and key=value override them.
# I/O
out_dir = "out"
eval_interval = 2000  # evaluate (and checkpoint) every this many iterations, and at the end
log_interval = 10
eval_iters = 200  # batches per split per evaluation
eval_only = False  # evaluate once and exit
always_save_checkpoint = True  # else only when the validation loss improves
keep_checkpoints = 2  # checkpoint sets kept in out_dir, the newest ones (nanofp8/outdir.py)
overwrite_checkpoints = False  # may a run that does not resume replace out_dir's checkpoint?
init_from = "scratch"  # "scratch" | "resume" (from out_dir, any level/layout) | a directory: an
#                       export, a Hugging Face GPT-2 or LLaMA, or another run's out_dir (nanofp8/checkpoint.py)
# data
dataset = "openwebtext"
gradient_accumulation_steps = 40  # micro-batches per optimizer step, summed over all ranks
batch_size = 12  # sequences per micro-batch
block_size = 1024
# model (see nanofp8/model.py: GPTConfig)
arch = "gpt2"  # "gpt2" | "llama"
n_layer = 12
n_head = 12
n_kv_head = 0  # key/value heads: 0 = n_head; fewer (dividing n_head) = grouped-query attention
n_embd = 768
dropout = 0.0
bias = True
tie_embeddings = True
mlp_hidden = 0  # 0 = the architecture's default width
rope_theta = 10000.0
rope_scaling = None  # llama: Llama 3.1's long-context RoPE, the Hugging Face dict (nanofp8/model.py: GPTConfig)
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
max_loss_rise = 1.0  # a val loss this far (nats) above the best so far is a divergence: not saved (0 = off)
# learning rate schedule: linear warmup, then cosine decay to min_lr at lr_decay_iters
decay_lr = True
warmup_iters = 2000
lr_decay_iters = 600000
min_lr = 6e-5
# precision
precision = "bf16"  # "bf16" | "O1" | "O2" | "O3"
o2_v_format = "fp16"  # O2/O3: Adam v in "fp16" (FP8-LM) or "fp8" (sqrt(v) in E4M3)
o2_grad_accum = "fp16"  # O2: micro-steps' FP8 weight gradients summed in "fp16" (scaled) or "fp8"
o2_fused = None  # O2: the step's O2 update in a few kernels (nanofp8/optim_fused.py; on CUDA Triton's);
#                  None = where the model is compiled on CUDA (compile=None or True), else the foreach step
grad_comm = "auto"  # data parallel, weight gradients of the FP8 layers: "auto" (e4m3 at FP8 levels)
#                     | "e4m3" | "e5m2" | "bf16" | "fp32"; at bf16 (no FP8 layers): every gradient,
#                     "auto" = fp32 with torch's DDP
grad_comm_rest = "fp32"  # data parallel, every other gradient (FP8 levels): "fp32" | "bf16"
mp_comm = "auto"  # tensor/sequence/pipeline payloads: "auto" | "fp8" | "bf16" | "fp32" (bf16 level:
#                   not "fp8"; auto = bf16 there, see mp_comm_format for the FP8 levels)
fp8_recipe = None  # a preset (fp8.RECIPES: tensorwise, rowwise, blockwise, delayed, mxfp8, rowwise_with_gw_hp) setting the keys below
fp8_scaling = "current"  # "current" | "delayed"
fp8_granularity = "tensor"  # "tensor" | "row" | "block"
fp8_formats = "hybrid"  # "hybrid" (E4M3 forward, E5M2 gradients) | "e4m3"
fp8_backend = None  # "torch" | "emulate" | "cpu" | "triton"; None = torch._scaled_mm on CUDA, cpu on a CPU
fp8_history_len = 16  # delayed scaling: amax history length
fp8_amax_algo = "max"  # delayed scaling: "max" | "most_recent"
fp8_margin = 0  # scales are divided by 2^margin (0 to 8: see check_values)
fp8_lm_head = False  # also run the LM head in FP8
fp8_attention = False  # also attention's Q K^T and P V in FP8, by that recipe (nanofp8/attention.py)
# seeing the numerics (nanofp8/stats.py)
fp8_stats_interval = 0  # every this many iterations: per-layer FP8 cast statistics (0 = off)
fp8_strict = False  # a GEMM that cannot run in FP8 is an error, not a high-precision fallback
fp8_alarm_saturation = 1e-4  # alarm: fraction of an operand's values clipped at the FP8 max ...
fp8_alarm_underflow = 0.05  # ... fraction of its non-zero values flushed to zero ...
fp8_alarm_sqnr_db = 15.0  # ... SQNR of its FP8 copy below this ...
fp8_alarm_intervals = 3  # ... for this many statistics steps in a row
fp8_alarm_amax_growth = 10.0  # alarm: an activation's or weight's amax grew this many times
fp8_alarm_saturation_severe = 0.01  # alarm at once: this fraction of an operand clipped in one step
activation_checkpointing = "off"  # "off" | "block": each block keeps only its input and recomputes the rest in
#                                   backward (less activation memory, one more forward; nanofp8/model.py)
# model parallelism (torchrun; see nanofp8/parallel.py). Processes = data x tensor x pipeline.
tensor_parallel = 1  # cut every block's matrices over this many ranks (heads, MLP units)
sequence_parallel = False  # with tensor_parallel > 1: cut the sequence too, between the matmuls
pipeline_parallel = 1  # cut the blocks into this many stages, fed micro-batches (GPipe)
engine = "nanofp8"  # "nanofp8": the hand-written engine above | "torch": FSDP2, DTensor TP, DCP (nanofp8/torchstack.py)
data_parallel_replicate = 1  # engine=torch: the data-parallel ranks as this many replicas, each sharding every
#                              parameter over its dp / data_parallel_replicate ranks (HSDP; 1 = plain FSDP2)
fsdp_param_dtype = "auto"  # engine=torch: FSDP2 gathers and computes with the parameters it does not gather in
#                            FP8 in "bf16" (gradients reduced in fp32) | "fp32"; "auto" = bf16 on CUDA, fp32 on CPU
# system
device = "auto"  # "auto" (cuda if available, else cpu) | "cpu" | "cuda" | "cuda:1" ...
compile = None  # torch.compile the model; None = on for CUDA, off for CPU
peak_flops = 0.0  # hardware peak for MFU; 0 = look the GPU up (no MFU when unknown, e.g. CPU)
dist_timeout = 600.0  # torchrun: seconds a collective may wait for the other ranks before the job stops
seed = 1337
DEFAULTS = defaults_of(globals())
# -----------------------------------------------------------------------------


def load_config(argv):
    """Defaults + config files + key=value -> a read-only mapping, validated. Raises ConfigError."""
    given = set()
    cfg = configure(DEFAULTS, argv, given)
    return check_train_config(apply_recipe_preset(cfg, given))


# -----------------------------------------------------------------------------
# The precision level: the four functions where it touches the training loop


def build_recipe(cfg, device_type):
    """The FP8 layers' Recipe: the fp8_recipe preset (its tiles and scale rule: mxfp8's), the fp8_* keys
    over it. The backend: torch._scaled_mm on CUDA, the fp32 reference's fast CPU twin on a CPU."""
    backend = cfg["fp8_backend"] or ("torch" if device_type == "cuda" else "cpu")
    keys = {field: cfg[key] for key, field in RECIPE_KEYS.items()}
    return fp8.Recipe.from_name(cfg["fp8_recipe"] or "tensorwise", **keys, backend=backend)


def setup_precision(model, cfg, device_type):
    """What the layers compute in. Returns a description for the log.

    bf16: nothing to change in the model; the fp32 parameters are the master weights and the
    autocast context around forward casts matmul inputs to bf16 on the fly.
    O1:   swap the block Linears for Fp8Linear (same parameters, plus FP8 scaling buffers).
    O2:   then make them O2Linear: fp16 master weight + scale, FP8 gradient kept outside .grad.
    O3:   or O3Linear: the full weight in FP8; its fp16 master lives sharded in the optimizer."""
    level = cfg["precision"]
    if level == "bf16":
        return "bf16 autocast, fp32 master weights"
    recipe = build_recipe(cfg, device_type)
    names = apply_fp8(model, recipe, cfg["fp8_lm_head"], cfg["fp8_attention"])
    if not names:  # FP8 GEMMs need both dims % 16: an "FP8" run with none would be bf16 in disguise
        raise ConfigError(f"precision={level}: no block Linear can run in FP8: their widths "
                          f"(n_embd={model.config.n_embd}, MLP {model.config.hidden}) must be multiples of 16")
    if level == "O1":  # each weight cast to FP8 once per step, right after it, not per micro-step
        cast_once_per_step(model)  # (build_optimizer's AdamW makes the casts: nanofp8/o2_compile.py)
    elif level == "O2":
        convert_to_o2(model, grad_accum=cfg["o2_grad_accum"])
    elif level == "O3":
        convert_to_o3(model)
    state = {"O1": "fp32 master, fp32 Adam", "O2": f"fp16 master, FP8 grads, FP8 m, {cfg['o2_v_format']} v",
             "O3": f"FP8 weights, FP8 grads, sharded fp16 master / FP8 m / {cfg['o2_v_format']} v"}[level]
    desc = (f"{level}: {len(names)} Linears{' and attention' * cfg['fp8_attention']} in FP8 ({recipe.describe()}, "
            f"backend={recipe.backend}; {state}), the rest bf16 autocast")
    if cfg["fp8_lm_head"] and "lm_head" not in names:
        if cfg["fp8_strict"]:
            raise ConfigError(f"fp8_lm_head=True, fp8_strict=True: the LM head cannot run in FP8 "
                              f"(vocab_size={model.config.vocab_size} is not a multiple of 16)")
        desc += f" (LM head kept bf16: vocab_size={model.config.vocab_size} is not a multiple of 16)"
    return desc


def build_optimizer(model, cfg, device_type):
    """AdamW on fp32 master weights. Matrices (Linear weights, embeddings) get weight decay;
    biases and norm gains do not (named: engine=torch holds a fused bias as (3, n_embd)).
    Shrinking those towards 0 only fights the normalization."""
    named = [(p, p.dim() >= 2 and not n.endswith("bias")) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for p, matrix in named if matrix], "weight_decay": cfg["weight_decay"]},
              {"params": [p for p, matrix in named if not matrix], "weight_decay": 0.0}]
    kw = dict(lr=cfg["learning_rate"], betas=(cfg["beta1"], cfg["beta2"]))
    if cfg["precision"] == "O2":
        fused = cfg["o2_fused"]
        if fused is None:  # the fast step where a run compiles anyway (its compile, ~40 s, is a CPU's loss)
            fused = device_type == "cuda" and cfg["compile"] is not False
        return Fp8AdamW(groups, model, v_format=cfg["o2_v_format"], fused=fused, **kw)
    if cfg["precision"] == "O3":
        return ZeroFp8AdamW(groups, model, v_format=cfg["o2_v_format"], **kw)
    # The fused CUDA kernel updates all parameters in a few launches instead of several per tensor.
    extra = {"fused": True} if device_type == "cuda" else {}
    opt = torch.optim.AdamW(groups, **kw, **extra)
    return cast_after_steps(opt, model) if cfg["precision"] == "O1" else opt  # O1: FP8 weights cast per step


def optimizer_step(model, optimizer, cfg, layout=None, clips=None):
    """Sum gradients over ranks, clip, step, clear. Returns (norm, stepped, weights were finite).
    layout: this rank's (default: one process, on the device of the model's parameters).

    A non-finite gradient norm (an overflow, or a NaN that FP8 casts let through on purpose): skip
    the step rather than write NaN into every weight. Deciding that is the step's one device sync
    (a copy to the host, also on CPU where tests/test_syncs.py counts it), which also reads the
    check of the weights that the last update left, and the flag of clips (a stats.ClipLog:
    whether delayed scaling clipped values in this step), kept in clips.clipped_now."""
    max_norm = cfg["grad_clip"] if cfg["grad_clip"] > 0 else float("inf")
    layout = layout or Layout(device=str(next(model.parameters()).device))  # the flags live there
    finite = sync_gradients(model, layout)  # the same verdict on every rank
    weights_ok = weights_finite(model, layout)
    clipped = [] if clips is None else [clips.flag().to(weights_ok.device)]
    if cfg["precision"] == "O3":  # the FP8 gradient shards came from backward: clip, step
        shards = model.take_wgrad_shards() if isinstance(model, Fp8DataParallel) else None
        go = optimizer.prepare_step(grads_finite=finite, max_norm=max_norm, shards=shards)
        norm, weights_ok, go, *clipped = torch.stack([optimizer.grad_norm.float(), weights_ok, go, *clipped]).to(
            "cpu", copy=True).tolist()
        stepped = optimizer.step(verdict=go == 1)
    else:
        norm = clip(model, max_norm, layout)  # the whole model's norm, the same on every rank
        norm, weights_ok, finite, *clipped = torch.stack([norm.float(), weights_ok, finite, *clipped]).to(
            "cpu", copy=True).tolist()
        stepped = finite == 1 and math.isfinite(norm)
        if stepped:  # (a finite norm means every gradient is finite: an optimizer that checks them need not)
            takes_verdict = "grads_finite" in inspect.signature(optimizer.step).parameters
            optimizer.step(**({"grads_finite": True} if takes_verdict else {}))
            bump_if_fused(optimizer)  # (a fused AdamW writes the weights without telling autograd)
    optimizer.zero_grad(set_to_none=True)
    if clips is not None:
        clips.clipped_now = clipped[0] == 1
    return norm, stepped, weights_ok == 1


# -----------------------------------------------------------------------------


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


def read_losses(losses):
    """The training losses [(iter, loss)] stay device tensors until a log line reads them, all
    the unread ones with one sync: they are replaced by floats in place. Returns the last one."""
    start = len(losses)
    while start > 0 and torch.is_tensor(losses[start - 1][1]):
        start -= 1
    if start < len(losses):
        values = torch.stack([loss for _, loss in losses[start:]]).tolist()
        losses[start:] = [(it, v) for (it, _), v in zip(losses[start:], values)]
    return losses[-1][1] if losses else float("nan")


@torch.no_grad()
def estimate_loss(model, data, cfg, autocast, layout):
    """Mean loss over eval_iters batches per split. The batches are the same at every evaluation
    (seeded by split and index only), so the curve measures the model, not the sampling noise,
    and a bf16 and an FP8 run are compared on exactly the same text. The ranks of one replica
    evaluate the same batches together; the replicas average theirs."""
    from tqdm import tqdm

    model.eval()
    out = {}
    for split in ("train", "val"):
        total = torch.zeros((), device=layout.device)
        # A progress bar that erases itself (leave=False), and only on a terminal (disable=None):
        # logs redirected to a file stay clean.
        batches = tqdm(range(cfg["eval_iters"]), desc=f"eval {split}", leave=False,
                       disable=None if layout.master else True, file=sys.stdout)
        for k in batches:
            gen = batch_generator(cfg["seed"], EVAL_STREAMS[split], 0, k, layout.dp_rank)
            x, y = get_batch(data[split], cfg["batch_size"], cfg["block_size"], gen, layout.device)
            if layout.model_parallel:  # the pipeline's last stage computes the loss
                loss = pipeline_loss(model, [(x, y)], layout, autocast, cfg, train=False)
            else:
                with autocast:
                    loss = model(x, y)[1]  # (the logits, unheld, are freed at once)
            total += loss.float()
        if layout.dp > 1:
            torch.distributed.all_reduce(total, group=layout.dp_group)
        out[split] = total.item() / (cfg["eval_iters"] * layout.dp)
    model.train()
    return out


def build_model(cfg, layout, model_args, ckpt, converted, log):
    """This rank's model at the level and layout of the run, with its weights. Returns (model,
    description, the whole model's parameters and FLOPs per token)."""
    torch.manual_seed(cfg["seed"])  # same initial weights on every rank
    model = GPT(GPTConfig(**model_args))
    if converted is not None:  # before setup_precision: it builds each level's storage from fp32
        load_model_state(model, converted["model"], cfg["init_from"])
    desc = setup_precision(model, cfg, layout.device_type)
    if cfg["activation_checkpointing"] == "block":
        checkpoint_blocks(model)
    n_params, flops_per_token = model.num_params(), model.flops_per_token()
    model = shard_model(model, cfg, layout)  # from here on: this rank's stage
    if ckpt is not None:
        load_resumed(model, ckpt)
    model.to(layout.device)
    if cfg["precision"] != "bf16":
        show_fp8_layers(model, cfg["fp8_strict"], log)  # what really runs in FP8
    return model, desc, n_params, flops_per_token


# -----------------------------------------------------------------------------


def main(argv=None):
    """Train; returns {'losses': [(iter, loss)], 'evals': [(iter, train, val)]} (for tests)."""
    cfg = load_config(sys.argv[1:] if argv is None else argv)
    check_dataset(cfg["dataset"])  # every rank, before one of them waits for another
    layout = start(cfg, check=lambda dp_size: check_accumulation(cfg, dp_size))
    # flushed line by line: torchrun's ranks share one stdout pipe, where half a line gets split
    log = say if layout.master else (lambda *a, **k: None)
    prepare_out_dir(cfg, layout, log)  # writable, not in use by another run, not another run's work
    autocast = torch.autocast(layout.device_type, dtype=torch.bfloat16)
    accum = cfg["gradient_accumulation_steps"] // layout.dp  # micro-steps per replica
    data = open_splits(cfg["dataset"], cfg["block_size"], layout)  # rank 0 prepares it if need be
    vocab_size = vocab_size_for(read_dataset_meta(data_dir(cfg["dataset"])), cfg["vocab_size"],
                                DEFAULTS["vocab_size"], cfg["dataset"], log)
    compile_model = compile_choice(cfg, layout)  # (compile=None: on for CUDA, where it is right)
    ckpt, converted, model_args = resume_point(cfg, layout, vocab_size, log)
    if nothing_to_do(cfg, (ckpt or converted or {}).get("iter_num", 0), log):
        finish(cfg, layout)
        return {"losses": [], "evals": []}
    check_tokens(data, model_args["vocab_size"])
    model, precision_desc, n_params, flops_per_token = build_model(cfg, layout, model_args, ckpt, converted, log)
    optimizer = build_optimizer(model, cfg, layout.device_type)
    check_room(model, cfg, layout, log)
    raw_model = model  # whose state_dict is saved (no wrappers)
    tokens_per_iter = cfg["gradient_accumulation_steps"] * cfg["batch_size"] * cfg["block_size"]
    derived = {"model_args": model_args, "device": layout.device, "compile": compile_model,
               "world_size": layout.world, "tokens_per_iter": tokens_per_iter}  # saved beside the config
    # Delayed scaling can clip: each rank logs what its own casts clipped, on the step it happens
    clips = ClipLog(raw_model) if cfg["precision"] != "bf16" and cfg["fp8_scaling"] == "delayed" else None
    if compile_model:
        log("compiling the model (takes a minute) ...")
        model = torch.compile(model)
    model = wrap_data_parallel(model, cfg, layout)  # (broadcasts replica 0's weights and buffers, so:)
    iter_num, best_val_loss = restore_state(raw_model, optimizer, ckpt, converted, cfg, layout, log)  # each its own
    ckpt = converted = None; start_iter = iter_num  # free the loaded tensors
    stats = None  # FP8 statistics: rank 0's; of a model cut over ranks, one replica's ranks', merged on rank 0
    if cfg["fp8_stats_interval"] and cfg["precision"] != "bf16" and (layout.master or layout.model_parallel):
        stats = Fp8Stats(model, cfg["fp8_stats_interval"], cfg["out_dir"] if layout.master else None,
                         stats_alarms(cfg), start_iter, gather=layout.model_parallel, active=layout.dp_rank == 0)
        if stats.note:  # the records after the checkpoint's iteration went: this run writes them again
            log(f"note: {stats.note}")
    log(f"{n_params / 1e6:.2f}M parameters ({model_args['arch']}, {model_args['n_layer']} layers, "
        f"d={model_args['n_embd']}), {precision_desc}\ndevice {layout.device} x {layout.world} = "
        f"{layout.describe(cfg['sequence_parallel'])}, {accum} micro-batches per replica, compile="
        f"{compile_model}, {tokens_per_iter:,} tokens per iteration, "
        f"{'resuming at iter ' + str(iter_num) if start_iter else 'from scratch'}")
    for note in config_notes(cfg, start_iter):
        log(note)

    # ---- the training loop
    history, skipped_in_a_row = {"losses": [], "evals": []}, 0

    def train_batches(it):  # iteration it's micro-batches: a function of (seed, it) alone
        return [get_batch(data["train"], cfg["batch_size"], cfg["block_size"],
                          batch_generator(cfg["seed"], TRAIN_STREAM, it, j, rank), layout.device)
                for j, rank in layout.micro_batch_keys(accum)]

    batches, batches_of = None, None
    clock = Clock(cfg, layout, tokens_per_iter, flops_per_token)
    while True:
        lr = lr_at(iter_num, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr

        # Evaluate and checkpoint. A resumed run skips the evaluation at its first iteration: the
        # run that wrote the checkpoint did it just before saving.
        due = iter_num % cfg["eval_interval"] == 0 or iter_num == cfg["max_iters"]
        if cfg["eval_only"] or (due and not (start_iter > 0 and iter_num == start_iter)):
            losses = estimate_loss(model, data, cfg, autocast, layout)
            check_replicas(raw_model, layout)
            log(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            history["evals"].append((iter_num, losses["train"], losses["val"]))
            improved = losses["val"] < best_val_loss
            if iter_num > 0 and not cfg["eval_only"] and (improved or cfg["always_save_checkpoint"]):
                save_unless_diverged(raw_model, optimizer, cfg, layout, iter_num, losses["val"], best_val_loss,
                                     skipped_in_a_row, derived, log)
            best_val_loss = min(best_val_loss, losses["val"])
            clock.restart()  # do not bill the evaluation to the next iteration
        if cfg["eval_only"] or iter_num >= cfg["max_iters"]:
            break

        if stats is not None and stats.due(iter_num):
            stats.start()
        batches = batches if batches_of == iter_num else train_batches(iter_num)
        # Forward and backward over the micro-batches; the gradients add up in .grad.
        if layout.model_parallel:
            # GPipe's schedule owns backward: every micro-batch forward through the stages, then
            # every backward, each loss / accum (nanofp8/parallel.py: pipeline_step)
            loss = pipeline_loss(model, batches, layout, autocast, cfg)
            if compile_model:  # (delayed scaling: one amax per role for all the micro-batches)
                push_amaxes(raw_model)
        else:
            loss = torch.zeros((), device=layout.device)  # the mean over the micro-batches, for the log
            for micro_step, (x, y) in enumerate(batches):
                # The replicas sum gradients during the last micro-step's backward only (FSDP2: every one).
                with model.no_sync() if hasattr(model, "no_sync") and micro_step < accum - 1 else nullcontext():
                    with autocast:
                        # the loss only: logits held in a name would outlive this backward and
                        # sit beside the next micro-step's (GPT-2: 2 B x tokens x 50,304 each)
                        micro_loss = model(x, y)[1]
                    (micro_loss / accum).backward()  # the step's gradient: the mean over micro-steps
                if compile_model:  # delayed scaling: the amaxes the graphs recorded, into the histories
                    push_amaxes(raw_model)
                loss += micro_loss.detach().float()
            loss = loss / accum
        # The next iteration's batches now, while the GPU still runs this backward: the step's one
        # sync (in optimizer_step) waits for the backward to finish, and from then on the GPU
        # waits for the host only until the optimizer's first kernel is launched.
        batches, batches_of = train_batches(iter_num + 1), iter_num + 1
        grad_norm, stepped, weights_ok = optimizer_step(model, optimizer, cfg, layout, clips)
        skipped_in_a_row = check_step(raw_model, stepped, skipped_in_a_row, grad_norm, iter_num, weights_ok,
                                      lr_at(iter_num - 1, cfg), cfg, layout, log)
        history["losses"].append((iter_num, loss))  # a device tensor until a log line reads it
        for line in clips.lines(iter_num, clips.clipped_now) if clips is not None else ():
            say(line if layout.world == 1 else f"rank {layout.rank}: {line}")
        for line in stats.finish(iter_num, optimizer) if stats is not None else ():
            log(line)  # the step's summary (worst layer by SQNR, saturation), and alarms
        clock.tick()
        if iter_num % cfg["log_interval"] == 0:
            log(f"iter {iter_num}: loss {read_losses(history['losses']):.4f}, {clock.report(iter_num - start_iter)}"
                + ("" if stepped else f", SKIPPED (grad norm {grad_norm})"))
        iter_num += 1

    read_losses(history["losses"])
    if cfg["precision"] != "bf16":
        log(fallback_line())
    finish(cfg, layout)
    return history


def cli(argv=None):
    """main() as a command: one line on stderr per failure, and an exit status per kind (run.command)."""
    command(main, argv)


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:  # a torchrun rank: it ends without the interpreter's teardown
        as_rank(cli)
    else:
        cli()
