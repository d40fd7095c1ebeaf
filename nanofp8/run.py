"""
A training run across ranks: what train.py's loop calls where the layout (nanofp8/layout.py)
makes a difference, so that the loop itself is the same for one process, data parallelism and a
model cut over tensor and pipeline ranks.

    model = shard_model(model, cfg, layout)       # this rank's pipeline stage (or the model)
    model = wrap_data_parallel(model, cfg, layout)  # how the replicas sum gradients
    loss = pipeline_loss(model, batches, layout, autocast, cfg)  # model parallel: GPipe's step
    finite = sync_gradients(model, layout); norm = clip(model, max_norm, layout)
    check_replicas(model, layout)                 # at every evaluation
    save_unless_diverged(...)                     # a checkpoint set: a file per O3 shard, RNG streams,
                                                  # every replica's FP8 scaling state

Where the answers differ, they differ for a reason written next to them: a pipeline runs all
micro-batches at once (GPipe), a model-parallel gradient is spread over ranks before it is
averaged over replicas, O3's optimizer state is a shard per rank. The rest of the module is what
a run checks about itself: non-finite weights, skipped steps, a diverged state that must not be
saved, replicas drifting apart, a resume that would silently make another run, an out_dir that
cannot take a checkpoint; how the ranks write one checkpoint set (nanofp8/outdir.py); and the
command's one line and exit status per kind of failure.

engine=torch (layout.engine): where its answer differs (FSDP2 and DTensor instead of the wrappers
above, DCP shards in the checkpoint set), the function hands over to nanofp8/torchstack.py.
"""

import math
import os
import signal
import sys
import threading
import time
from dataclasses import fields

import torch
import torch.distributed as dist

from . import device, emulate, parallel, torchstack
from .checkpoint import find_checkpoint, initial_weights, load_moments, load_shard
from .configurator import RECIPE_KEYS, ConfigError
from .data import DataError
from .dist import Fp8DataParallel
from .fp8 import E4M3, E5M2, Recipe
from .fsdp import agree_after_steps
from .layout import GroupError, is_collective_failure, leave_process, report_collective_failure, stop
from .model import GPTConfig
from .o2_compile import cast_for_step
from .ckptfile import (FP8_STATE_KEYS, CheckpointError, WriteError, load_checkpoint, load_model_state, make_dir,
                       root_cause, save_checkpoint)
from .outdir import (acquire_lock, begin_set, check_writable, commit_set, discard_set, last_good, legacy_files,
                     prune, release_lock, release_locks, room_for, scan, set_name, shard_file, unwritten)
from .optim import clip_grad_norm
from .stats import format_linear_table, linear_table

# -----------------------------------------------------------------------------
# What gradients and model-parallel payloads travel in

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


# The FP8 levels' default for model-parallel payloads. Judged by the validation-loss gap against
# one process at equal steps: FP8 at the stage boundaries and in the TP partial sums came out no
# further from it than bf16 (both within the run-to-run divergence of a few tenths of a percent),
# at half the bytes. tests/test_train_parallel.py holds the default to 0.3% of one process;
# mp_comm=bf16 is the other choice.
MP_COMM_AUTO = "fp8"


def mp_comm_format(cfg):
    """What tensor/sequence-parallel payloads and pipeline-stage activations travel in: "fp8",
    "bf16" or "fp32". bf16 level: bf16 ("auto"). FP8 levels ("auto"): MP_COMM_AUTO."""
    if cfg["mp_comm"] != "auto":
        return cfg["mp_comm"]
    return "bf16" if cfg["precision"] == "bf16" else MP_COMM_AUTO


def pipeline_formats(cfg):
    """(activation, gradient) formats between pipeline stages, from mp_comm_format."""
    comm = mp_comm_format(cfg)
    return (E4M3, E5M2) if comm == "fp8" else (parallel.PLAIN[comm],) * 2


# -----------------------------------------------------------------------------
# The model, its batches and its step at any layout


def shard_model(model, cfg, layout):
    """Cut the (identically initialized, precision already set up) GPT into this rank's share:
    its stage's blocks, their matrices cut over the tensor-parallel group. Returns the stage, the
    module that is trained and checkpointed from here on (the model itself for one process or
    plain data parallelism)."""
    c, tp, pp = model.config, layout.tp, layout.pp
    if tp * pp == 1 and layout.engine == "nanofp8":
        return model
    # parallel.py would raise ValueErrors; say which keys to change instead
    if c.n_head % tp or c.hidden % tp:
        raise ConfigError(f"tensor_parallel={tp} must divide n_head ({c.n_head}) and the MLP width "
                          f"({c.hidden}, mlp_hidden=0: the architecture's default)")
    if c.kv_heads % tp:  # a rank holds whole key/value heads, each with the query heads that read it
        raise ConfigError(f"tensor_parallel={tp} must divide n_kv_head ({c.kv_heads}, the key/value heads); "
                          f"set tensor_parallel to a divisor of it")
    if c.n_layer < pp:
        raise ConfigError(f"pipeline_parallel={pp} stages need n_layer >= {pp}, got {c.n_layer}")
    if layout.engine == "torch":  # DTensor TP, FSDP2 (nanofp8/torchstack.py)
        return torchstack.shard_model(model, cfg, layout, mp_comm_format(cfg))
    # FP8 levels: TPLinear (FP8 GEMMs, partial sums and SP gathers sent in mp_comm). bf16: the
    # same cut with bf16 GEMMs and bf16 collectives, the baseline that Megatron-LM runs.
    parallel.parallelize(model, layout.tp_group, sp=cfg["sequence_parallel"], comm=mp_comm_format(cfg))
    return parallel.PipelineStage(model, layout)


def _stage(model):
    return model.module if isinstance(model, Fp8DataParallel) else model


def pipeline_loss(model, batches, layout, autocast, cfg, train=True):
    """The model-parallel forward and backward of this rank's micro-batches [(x, y)]: the GPipe
    schedule (nanofp8/parallel.py) runs every micro-batch forward through the stages, then every
    backward (each loss weighted 1 / len(batches)), so it owns loss.backward(); gradients add up
    in .grad as in train.py's own micro-step loop. Returns the mean loss as a device tensor,
    averaged over the replicas so that it compares with one device's. train=False: the loss of
    an evaluation batch, forwards only (the last stage computes it and hands it to every rank of
    the pipeline; the caller averages over the replicas)."""
    if layout.engine == "torch":  # no pipeline there: the TP ranks run the micro-steps together
        return torchstack.forward_backward(model, batches, layout, autocast, train)
    act_fmt, grad_fmt = pipeline_formats(cfg)
    if not train:
        return parallel.pipeline_step(_stage(model), batches, layout, autocast=autocast, train=False,
                                      act_fmt=act_fmt, grad_fmt=grad_fmt)
    replicas = model if isinstance(model, Fp8DataParallel) else None  # reduces during backward
    loss = parallel.pipeline_step(_stage(model), batches, layout, autocast=autocast,
                                  act_fmt=act_fmt, grad_fmt=grad_fmt, dp=replicas)
    if layout.dp > 1:
        dist.all_reduce(loss, group=layout.dp_group)
    return loss / layout.dp


def sync_gradients(model, layout):
    """Sum the pieces of each gradient that several ranks hold, then average over the replicas.
    Returns whether every gradient is finite, the same on every rank, as a device tensor (1.0 or
    0.0; optimizer_step reads it in the step's one device-to-host copy).

    Model parallel first: the token slices of sequence parallelism, the two copies of a tied
    embedding (first and last stage). Then the replicas: torch's DDP has averaged during
    backward; Fp8DataParallel has launched its buckets during backward and finishes them here
    (O2: also the FP8 weight gradients kept outside .grad; O3's are reduce-scattered shards that
    optimizer_step hands to the optimizer). engine=torch: torchstack.sync_gradients."""
    if layout.engine == "torch":
        return torchstack.sync_gradients(model, layout)
    if layout.model_parallel:
        parallel.sync_model_parallel_grads(_stage(model), layout)
    if not isinstance(model, Fp8DataParallel):
        return torch.ones((), device=layout.device)  # DDP: a NaN reaches the norm, checked there
    return model.sync_gradients().to(layout.device, torch.float32)


def wrap_data_parallel(model, cfg, layout):
    """How the replicas sum their gradients (one replica: nothing to do).
    bf16 (grad_comm auto/fp32): torch's DDP, fp32 all-reduce overlapped with backward.
    FP8 levels: Fp8DataParallel sends the FP8 layers' weight gradients in FP8 (a scale per 128
    values of one parameter, summed in fp32) and the rest in grad_comm_rest (nanofp8/dist.py),
    overlapped with backward by hooks, as DDP; O2/O3's FP8 gradients (outside .grad) leave from
    each layer's "weight gradient ready" hook: O2 all-reduces them, O3 reduce-scatters them.
    Model parallel: TPDataParallel over the replicas (it broadcasts replica 0's weights)."""
    fmt, rest = grad_comm_format(cfg)
    if layout.dp == 1 or layout.engine == "torch":  # (engine=torch: FSDP2, applied by shard_model)
        return model
    if layout.model_parallel:
        return parallel.TPDataParallel(model, layout, fmt=fmt, rest=rest, overlap=True)
    if cfg["precision"] == "bf16" and fmt == torch.float32:
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=[torch.device(layout.device).index] if layout.device_type == "cuda" else None)
    wgrads = {"O2": "all_reduce", "O3": "reduce_scatter"}.get(cfg["precision"])
    return Fp8DataParallel(model, fmt=fmt, rest=rest, overlap=True, wgrads=wgrads)


def clip(model, max_norm, layout):
    """Clip by the whole model's gradient norm, the same on every rank (model parallel: no rank
    holds the whole gradient; parallel.clip_grad_norm_ adds up the pieces). Returns the norm."""
    if layout.engine == "torch":
        return torchstack.clip(model, max_norm, layout)
    if layout.model_parallel:
        return parallel.clip_grad_norm_(_stage(model), max_norm, layout)
    return clip_grad_norm(model, max_norm)  # sees O2's FP8 gradients too


@torch.no_grad()
def check_replicas(stage, layout):
    """Raise if a tensor that several ranks hold has come apart: every parameter over the
    data-parallel replicas, the unsharded ones over the tensor group, the tied embedding copies
    between first and last stage. Each rank all-gathers one checksum of the bits per tensor;
    parallel.py's design makes them bit-identical, and silent drift would train a different model
    on every rank (checked at every evaluation: a few bytes and one pass over the weights).
    engine=torch: its replicated DTensors, over all ranks (FSDP2's shards differ by design)."""
    named = list(stage.named_parameters())
    checks = (("data-parallel replicas", layout.dp_group, layout.dp, lambda p: True),
              ("tensor-parallel ranks", layout.tp_group, layout.tp,
               lambda p: not getattr(p, "tp_sharded", False)),
              ("tied embedding copies", layout.embed_group, 2 if layout.pp > 1 else 1,
               lambda p: getattr(p, "pp_tied", False)))
    if layout.engine == "torch":
        checks = (("ranks", dist.group.WORLD, layout.world, torchstack.replicated),)
    for what, group, n, keep in checks:
        ps = [(k, torchstack.local(p)) for k, p in named if keep(p)]
        if n == 1 or not ps or group is None:
            continue
        mine = torch.stack([p.detach().float().view(torch.int32).sum(dtype=torch.int64) for _, p in ps])
        got = [torch.empty_like(mine) for _ in range(n)]
        dist.all_gather(got, mine, group=group)
        bad = [k for i, (k, _) in enumerate(ps) if any(g[i] != mine[i] for g in got)]
        if bad:
            raise TrainingStopped(f"{what} hold different values of {bad[:5]}: the replicas diverged "
                                  f"(ranks that compute differently: another setting, library or device); "
                                  f"stopped; {last_good(current_out_dir) if current_out_dir else 'nothing saved'}")


def load_resumed(stage, ckpt):
    """Load the resumed checkpoint's weights into this rank's stage; refuse a checkpoint that
    holds non-finite values (the run that wrote it had diverged). (engine=torch: restore_state.)"""
    if "dcp" in ckpt:
        return
    load_model_state(stage, ckpt["model"], ckpt["path"])
    refuse_nonfinite(stage, ckpt["path"])


def refuse_nonfinite(stage, source):
    bad = nonfinite_tensors(stage)
    if bad:
        raise CheckpointError(f"{source} holds non-finite values in {bad[:5]}: the run that wrote "
                              f"it had diverged; resume from an earlier checkpoint")


def show_fp8_layers(model, strict, log):
    """Log which Linears run in FP8 and which do not, and why (nanofp8/stats.py); under
    fp8_strict a GEMM that would fall back to high precision is a ConfigError, not a surprise.
    Starts the count of run-time fallbacks that the end of the run reports."""
    device.strict, rows = strict, linear_table(model)
    device.fallbacks.clear()
    log(format_linear_table(rows))
    if strict and any(r["fallback"] for r in rows):
        raise ConfigError(f"fp8_strict=True: {[r['layer'] for r in rows if r['fallback']]} cannot run "
                          "their GEMMs in FP8 on this device (see the table above)")


# -----------------------------------------------------------------------------
# A run that goes bad


class TrainingStopped(RuntimeError):
    """The run cannot go on usefully (its weights or gradients stay non-finite)."""


@torch.no_grad()
def nonfinite_tensors(model):
    """Names of the floating-point parameters and buffers holding a NaN or an Inf, with one
    device sync for the whole model (FP8 tensors are widened: isfinite has no FP8 kernel)."""
    named = [(k, torchstack.local(t)) for k, t in (*model.named_parameters(), *model.named_buffers())
             if t.is_floating_point()]
    if not named:
        return []
    ok = torch.stack([torch.isfinite(t if t.element_size() > 1 else t.float()).all() for _, t in named])
    if bool(ok.all()):
        return []
    return [k for (k, _), good in zip(named, ok.tolist()) if not good]


@torch.no_grad()
def weights_finite(model, layout):
    """Whether every rank's weights are finite, as a device tensor (1.0 or 0.0): all ranks stop
    together even if only one of them went bad. The training step reads it in its one sync. It is
    the largest magnitude of every floating-point parameter and buffer (emulate.amax_each: NaN
    propagates through it, an inf is its own maximum); the ranks agree by a MIN."""
    by_dtype = {}
    # Not delayed scaling's cast_log: a cast's non-finite amax waiting there is the step's news,
    # judged by the gradients, not a bad weight. Not the kept casts either: they are copies of
    # what is checked here (the FP8 W and W^T, the bf16 bias, made by the step), non-finite only
    # where a weight is, and reading the FP8 ones would cost more than the weights (no FP8
    # kernels: a float copy each).
    buffers = (b for name, b in model.named_buffers()
               if not name.endswith(("cast_log", "gemm_bias_kept")) and b.element_size() > 1)
    for t in (*model.parameters(), *buffers):
        if t.is_floating_point():
            t = torchstack.local(t.detach())
            if t.element_size() == 1:  # (an FP8 parameter: O3's stored weight)
                t = emulate.fp8_to_float(t)  # no FP8 kernels
            by_dtype.setdefault(t.dtype, []).append(t)
    amax = [torch.stack(emulate.amax_each(ts)).float() for ts in by_dtype.values()]
    # (the largest of them is finite iff all are: a max keeps a NaN; two launches, where isfinite
    # and all took five)
    ok = ((amax[0] if len(amax) == 1 else torch.cat(amax)).amax() <= torch.finfo(torch.float32).max).float()
    if layout.world > 1:
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return ok


def diverged(model, cfg, layout, val_loss, best_val_loss, skipped_in_a_row):
    """Why the state after an evaluation must not become a checkpoint (None if it may): it would
    push out the last good one with a state that cannot be resumed usefully. A non-finite val
    loss or weight; a val loss more than max_loss_rise above the best so far (a divergence that
    is still finite, e.g. 3e9); or a last step skipped for non-finite gradients (weights whose
    forward pass overflows: resumed, they skip again). Every rank reaches the same verdict."""
    if not math.isfinite(val_loss):
        return f"the val loss is {val_loss}"
    if not bool(weights_finite(model, layout)):
        return "the last update left non-finite weights"
    rise = cfg["max_loss_rise"]
    if rise > 0 and val_loss > best_val_loss + rise:
        return (f"the val loss {val_loss:.4g} is more than max_loss_rise={rise:g} above the best so far "
                f"({best_val_loss:.4f}): the run diverged")
    if skipped_in_a_row:
        return (f"the last {skipped_in_a_row} step{'s were' if skipped_in_a_row > 1 else ' was'} skipped for "
                f"non-finite gradients")
    return None


def check_step(model, stepped, skipped_in_a_row, grad_norm, iter_num, weights_ok, prev_lr, cfg, layout, log):
    """After each optimizer step: stop when the weights went non-finite, or when steps keep being
    skipped for non-finite gradients (a run that only skips learns nothing and would keep writing
    checkpoints). Returns the new count of skipped steps in a row. weights_ok: optimizer_step's
    verdict on the weights its step started from, i.e. on the update of iteration iter_num - 1,
    made with learning rate prev_lr (read in the step's one sync; a checkpoint is never written
    between that update and this check: save_unless_diverged checks the weights itself)."""
    if not weights_ok:
        bad = nonfinite_tensors(model)
        raise TrainingStopped(f"the update of iteration {iter_num - 1} (learning rate {prev_lr:g}) made weights "
                              f"non-finite{' (' + ', '.join(bad[:3]) + ')' if bad else ' on another rank'}: "
                              f"stopped; {last_good(cfg['out_dir'])}: resume from it with a lower learning_rate")
    if stepped:
        return 0
    skipped_in_a_row += 1
    log(f"iter {iter_num}: step SKIPPED (grad norm {grad_norm}), {skipped_in_a_row} in a row")
    if 0 < cfg["max_skipped_steps"] <= skipped_in_a_row:
        raise TrainingStopped(f"{skipped_in_a_row} steps in a row skipped for non-finite gradients "
                              f"(max_skipped_steps={cfg['max_skipped_steps']}), the last at iteration {iter_num}: "
                              f"stopped; {last_good(cfg['out_dir'])}: resume from it with a lower "
                              f"learning_rate, or look for bad data")
    return skipped_in_a_row


# -----------------------------------------------------------------------------
# Checkpoints: a set per save (nanofp8/outdir.py) with one file per (tensor, pipeline) rank, each
# written by that position's data-parallel rank 0; at O3 also one optimizer shard per rank, each
# written by its own rank


def checkpoint_name(layout):
    """This rank's file in a checkpoint set: ckpt.pt; under model parallelism one file per (tensor,
    pipeline) rank: that rank's shards (the GPT's keys) and its optimizer state
    (engine=torch: ckpt.pt, rank 0's, beside the shards in dcp/: nanofp8/torchstack.py)"""
    if layout.model_parallel and layout.engine == "nanofp8":
        return f"ckpt-{parallel.checkpoint_suffix(layout)}.pt"
    return "ckpt.pt"


def agree(layout, problem):
    """Every rank's problem (a message or None) -> the first one, the same on every rank (an object
    all-gather, which is also a barrier): a check that some ranks make stops all of them alike."""
    if layout.world == 1:
        return problem
    got = [None] * layout.world
    dist.all_gather_object(got, problem)
    return next((p for p in got if p), None)


current_out_dir = None  # the run's out_dir: the last line of a run that stops names its checkpoint
saving = None  # the set being written, while it is: the line of a rank lost during a save names it


def prepare_out_dir(cfg, layout, log):
    """Before anything is loaded or trained, on every rank: each rank that writes can write in
    out_dir; rank 0 takes its lock (another run writing there is refused); and a run that did not
    resume from out_dir's checkpoint refuses to replace it, unless overwrite_checkpoints=True.
    ConfigError on every rank alike. A run that only evaluates (eval_only) writes nothing."""
    global current_out_dir
    current_out_dir = out_dir = cfg["out_dir"]
    if cfg["eval_only"]:
        return
    writes = layout.writer or cfg["precision"] == "O3"  # (O3: every rank writes its optimizer shard)
    problem = check_writable(out_dir) if writes else None
    if layout.master and problem is None:
        try:
            note = acquire_lock(out_dir)
            if note:
                log(f"note: {note}")
            problem = replaces_work(cfg)
        except (ConfigError, CheckpointError) as e:
            problem = str(e)
    problem = agree(layout, problem)
    if problem:
        release_lock(out_dir)
        raise ConfigError(problem)


def replaces_work(cfg):
    """Why this run must not write into out_dir (None if it may): out_dir holds a checkpoint the
    run does not continue."""
    if cfg["init_from"] == "resume" or cfg["overwrite_checkpoints"]:
        return None
    complete, _ = scan(cfg["out_dir"])
    found = complete[0] if complete else ", ".join(legacy_files(cfg["out_dir"]))
    if not found:
        return None
    start = "from scratch" if cfg["init_from"] == "scratch" else f"from init_from={cfg['init_from']}"
    return (f"out_dir {cfg['out_dir']} holds the checkpoint {found} of an earlier run, and this run starts "
            f"{start}: pass init_from=resume to continue it, or overwrite_checkpoints=True to replace it "
            f"(or use another out_dir)")


def checkpoint_bytes(model):
    """About how large this rank's checkpoint file gets, before the first step makes the optimizer
    state: the model's state as it is, plus 8 bytes per trained value for Adam's moments (fp32 m
    and v: the most any level stores; O2 and O3 store less, O3's masters included), plus 1 MiB
    for the rest (settings, RNG streams, checksums, the archive's headers)."""
    state = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return state + 8 * sum(p.numel() for p in model.parameters() if p.requires_grad) + 2**20


def check_room(model, cfg, layout, log):
    """Refuse to train when out_dir has no room for one more checkpoint (older sets are removed
    only after a new one is complete); say how large one is. ConfigError on every rank alike."""
    if cfg["eval_only"]:
        return
    need = checkpoint_bytes(model) if layout.writer else 0
    free, problem = room_for(cfg["out_dir"], need) if layout.writer else (0, None)
    problem = agree(layout, problem)
    if problem:
        raise ConfigError(problem)
    log(f"checkpoints: about {need / 2**20:,.1f} MiB{' per file' if layout.model_parallel else ''}, the newest "
        f"{cfg['keep_checkpoints']} kept in {cfg['out_dir']} ({free / 2**30:,.1f} GiB free)")


def save_checkpoint_set(files, cfg, layout, iter_num, write=None, **extra):
    """Write one checkpoint set (nanofp8/outdir.py), on every rank: rank 0 makes its directory,
    every rank saves its files into it (files: {name: contents}, empty on a rank that writes
    none), and once all of them have, rank 0 writes the manifest that makes the set complete,
    then, once it sees every file of the set on disk (outdir.unwritten), removes the sets beyond
    keep_checkpoints. A write that fails on any rank is a WriteError on every rank, and the
    partial set is removed; so is the set of a save that Ctrl-C or SIGTERM interrupts, by rank 0
    (under torchrun what another rank still writes after that is a set without manifest: readers
    ignore it, the next save removes it). Returns the set
    (on rank 0; None elsewhere). write(set directory), if given, writes on every rank after its
    files and returns [(file, record)] (engine=torch: its DCP shards, torchstack.write_dcp)."""
    global saving
    out_dir = cfg["out_dir"]
    saving = path = os.path.join(out_dir, set_name(iter_num))
    try:
        problem = None
        if layout.master:
            try:
                begin_set(out_dir, iter_num)
            except WriteError as e:
                problem = str(e)
        problem = agree(layout, problem)  # the directory exists before anyone writes into it
        record = []
        if problem is None and (files or write):
            try:
                make_dir(path)  # (an out_dir that is not shared between nodes)
                record = [(name, save_checkpoint(state, os.path.join(path, name))) for name, state in files.items()]
                record += write(path) if write else []
            except WriteError as e:
                problem = str(e)
        records = [(record, problem)] if layout.world == 1 else [None] * layout.world
        if layout.world > 1:
            dist.all_gather_object(records, (record, problem))
        problem = next((p for _, p in records if p), None)
        done = None
        if problem is None and layout.master:
            written = dict(r for rs, _ in records for r in rs)  # in rank order: rank 0's model file first
            info = {"precision": cfg["precision"], "tensor_parallel": layout.tp, "pipeline_parallel": layout.pp,
                    "zero_world": layout.world if cfg["precision"] == "O3" else None, "world_size": layout.world,
                    **({"engine": "torch"} if layout.engine == "torch" else {})}
            try:
                done = commit_set(path, iter_num, written, info, config=dict(cfg), **extra)
                lost = unwritten(done)  # no older set goes before the new one is whole on disk
                if lost:
                    raise WriteError(f"{lost} is not in {path} as rank 0 sees it, though its rank wrote it: "
                                     f"out_dir must be one directory that every node shares")
                prune(out_dir, cfg["keep_checkpoints"])
            except WriteError as e:
                problem = str(e)
        problem = agree(layout, problem)
        if problem:
            if layout.master:
                discard_set(path)
            raise WriteError(f"{problem}; nothing half-written is kept, and {last_good(out_dir)}")
    except KeyboardInterrupt:
        if layout.master:  # (under torchrun the other ranks are stopping too; what they still write is
            discard_set(path)  # a set without manifest: readers skip it, the next save removes it)
        raise
    saving = None
    return done


def save_unless_diverged(raw_model, optimizer, cfg, layout, iter_num, val_loss, best_val_loss, skipped_in_a_row,
                         derived, log):
    """Checkpoint after an evaluation, as a new set (the older ones kept up to keep_checkpoints),
    but never a state that has diverged (diverged()): it would push the last good one out. A final
    evaluation that has diverged stops the run. Called on every rank (the RNG streams are
    gathered; at O3 each rank writes its own optimizer shard). Saves the config as it was asked
    for and, apart, what the run derived (derived: its model_args, device, tokens per
    iteration, ...)."""
    why = diverged(raw_model, cfg, layout, val_loss, best_val_loss, skipped_in_a_row)
    if why:
        log(f"not saving a checkpoint: {why}; {last_good(cfg['out_dir'])}")
        if iter_num >= cfg["max_iters"]:
            raise TrainingStopped(f"the run ended diverged ({why}), so its final state is not saved; "
                                  f"{last_good(cfg['out_dir'])}: resume from it with a lower learning_rate")
        return
    best = min(best_val_loss, val_loss)
    dcp = layout.engine == "torch"  # model and optimizer: every rank's shards in dcp/
    state = {
        **({"dcp": torchstack.DCP_DIR} if dcp else {"model": raw_model.state_dict(),  # with FP8 scaling state
                                                    "optimizer": optimizer_state(optimizer)}),
        "model_args": derived["model_args"],
        "config": dict(cfg),
        "derived": {k: v for k, v in derived.items() if k != "model_args"},
        "iter_num": iter_num, "best_val_loss": best,
        "rng": rng_state(layout),
        "fp8_ranks": scaling_state(raw_model, layout),
        # Batches are a function of (seed, iteration): the iteration is the position.
        "data": {"dataset": cfg["dataset"], "seed": cfg["seed"], "iter": iter_num,
                 "tokens_seen": iter_num * derived["tokens_per_iter"]},
    }
    files = {checkpoint_name(layout): state} if layout.writer else {}
    sharded = getattr(optimizer, "sharded", False)
    if sharded:  # O3: every rank writes its own shard, and only that
        files[shard_file(optimizer.rank)] = {"optimizer": optimizer.state_dict(), "iter_num": iter_num}
    write = (lambda path: torchstack.write_dcp(raw_model, optimizer, path, layout)) if dcp else None
    done = save_checkpoint_set(files, cfg, layout, iter_num, write, val_loss=val_loss, best_val_loss=best)
    if done is not None:
        log(f"saved checkpoint to {done.path}" + (f" ({len(done.files) - 1} DCP files)" if dcp else f" ("
            f"{len(done.files)} files: one per tensor and pipeline rank)" if layout.model_parallel else "")
            + (f" (the model, and the optimizer in {optimizer.world} shards: a file per rank)"
               if sharded else ""))


def say(line):
    """Print one line in one write: the ranks of a torchrun share one stdout, and print() writes a
    line's text and its newline apart when Python runs unbuffered, so another rank's line could
    land inside this one (and a log reader would miss both)."""
    sys.stdout.write(f"{line}\n")
    sys.stdout.flush()


def finish(cfg, layout):
    """The end of a run: its lock released, its process group torn down."""
    if layout.master:
        release_lock(cfg["out_dir"])
    stop(layout)


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
    if converted or cfg["precision"] == "bf16":  # (a conversion starts the FP8 scaling state anew)
        return
    # the recipe as it ran: its name (none: tensorwise's keys), its keys, and which GEMMs it casts.
    # Two names for the same casts pass: a preset, and its keys given one by one.
    same_casts = _recipe_of(saved) == _recipe_of(cfg)
    for key in ("fp8_recipe", *RECIPE_KEYS, "fp8_lm_head", "fp8_attention"):
        was, now = saved.get(key), cfg[key]
        if key == "fp8_recipe":
            was, now = was or "tensorwise", now or "tensorwise"
            if same_casts:
                continue
        if key in saved and was != now:
            what = "run other GEMMs in FP8 than" if key in ("fp8_lm_head", "fp8_attention") else \
                "cast the FP8 operands by another recipe than"
            raise CheckpointError(f"{path} was written with {key}={was}; resuming with {key}={now} would {what} "
                                  f"the one the run trained with, silently. Pass {key}={was}, or start a new run "
                                  f"(init_from={os.path.dirname(path)}, another out_dir)")


def _recipe_of(cfg):
    """The Recipe a run's config casts by, the backend aside: its preset (fp8_recipe, else
    tensorwise) with the fp8_* keys over it (a key that a config saved before it existed lacks: the
    preset's value), as train.build_recipe builds it."""
    keys = {field: cfg[key] for key, field in RECIPE_KEYS.items() if key in cfg}
    return Recipe.from_name(cfg.get("fp8_recipe") or "tensorwise", **keys)


def check_resume_layout(ckpt, cfg, path, layout):
    """A model-parallel checkpoint holds one rank's shards: resume at the layout that wrote it
    (the data-parallel size may change: batches do not depend on it). All ranks must have read
    files of the same iteration (a crash between two ranks' writes leaves mixed files)."""
    if not layout.model_parallel:
        return
    for key in ("tensor_parallel", "pipeline_parallel"):
        saved = ckpt["config"].get(key, 1)
        if saved != cfg[key]:
            raise CheckpointError(f"{path} was written with {key}={saved}: resume with the same "
                                  f"layout, not {key}={cfg[key]}")
    it = torch.tensor([ckpt["iter_num"], -ckpt["iter_num"]], device=layout.device)
    dist.all_reduce(it, op=dist.ReduceOp.MAX)
    if it[0] != -it[1]:
        raise CheckpointError(f"the checkpoints in {cfg['out_dir']} are from different iterations "
                              f"({-int(it[1])} to {int(it[0])}): not one consistent model")


def optimizer_state(optimizer):
    """What the model file holds of the optimizer. O3: only the names of the files that hold it,
    one per rank, each written by the rank whose shard it is (save_unless_diverged): no rank ever
    holds another rank's shard, neither when saving nor when resuming."""
    if not getattr(optimizer, "sharded", False):
        return optimizer.state_dict()
    return {"zero_shard_files": [shard_file(r) for r in range(optimizer.world)]}


def load_optimizer_state(optimizer, state, path, layout):
    """Load the resumed optimizer state: this rank's own shard at O3 (resume_point read it from its
    file; a file of an older nanofp8 holds every rank's, "zero_shards")."""
    if "zero_shards" in state:
        if len(state["zero_shards"]) != layout.world:
            raise CheckpointError(f"{path} holds O3 optimizer shards for {len(state['zero_shards'])} "
                                  f"ranks; resume it with the same number of processes, not {layout.world}")
        state = state["zero_shards"][layout.rank]
    optimizer.load_state_dict(state)


def rng_state(layout):
    """The dropout RNG of every data-parallel rank (called on all of them), for the writer to save.
    Each rank draws its own masks, so each one's stream has to be saved for a bit-exact resume."""
    rng = {"cpu": torch.get_rng_state()}
    if layout.device_type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state()
    if layout.dp > 1:
        mine = torch.cat([rng["cpu"]] + ([rng["cuda"]] if "cuda" in rng else [])).to(layout.device)
        got = [torch.empty_like(mine) for _ in range(layout.dp)]
        dist.all_gather(got, mine, group=layout.dp_group)
        rng["ranks"] = [g.cpu() for g in got]
    return rng if layout.writer else None


def scaling_buffers(model):
    """{name: buffer} of the model's FP8 scaling state (amax histories, counts, scales)."""
    return {k: b for k, b in model.named_buffers() if k.rsplit(".", 1)[-1] in FP8_STATE_KEYS}


def scaling_state(model, layout):
    """The FP8 scaling state of every data-parallel rank (called on all of them), for the writer to
    save; None in one replica. Each replica casts its own activations and gradients, so under
    delayed scaling each keeps its own amax histories, while the model's state (and DCP, which
    saves a plain buffer once) holds one rank's: each one's has to be saved for a bit-exact resume."""
    mine = {k: b.cpu() for k, b in scaling_buffers(model).items()}
    if layout.dp == 1 or not mine:
        return None
    got = [None] * layout.dp
    dist.all_gather_object(got, mine, group=layout.dp_group)
    return got if layout.writer else None


@torch.no_grad()
def restore_scaling(model, saved, layout):
    """Give this rank its own saved FP8 scaling state (saved: scaling_state's list, or None).
    Returns False when the checkpoint holds none for this data-parallel size: every rank keeps
    the state the model loaded, data-parallel rank 0's."""
    mine = scaling_buffers(model)
    if not mine or saved is None and layout.dp == 1:
        return True
    if saved is None or len(saved) != layout.dp:
        return False
    for k, v in saved[layout.dp_rank].items():
        mine[k].copy_(v)
    return True


def restore_rng(rng, layout):
    """Continue this rank's saved dropout stream. Returns False when the checkpoint has none for it
    (written at another world size, or by an older version): the caller reseeds."""
    cuda = layout.device_type == "cuda"
    if layout.dp > 1:
        if len(rng.get("ranks", [])) != layout.dp:
            return False
        state = rng["ranks"][layout.dp_rank].cpu()
        n_cpu = rng["cpu"].numel()
        torch.set_rng_state(state[:n_cpu])
        if cuda and state.numel() > n_cpu:
            torch.cuda.set_rng_state(state[n_cpu:])
        return True
    torch.set_rng_state(rng["cpu"].cpu())
    if cuda and "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"].cpu())
    return True


# -----------------------------------------------------------------------------
# Where a run starts: from scratch, from this run's checkpoint, or from converted weights

MODEL_KEYS = [f.name for f in fields(GPTConfig)]
# What a checkpoint written before a field of GPTConfig existed means by its absence: the default.
MODEL_DEFAULTS = {f.name: f.default for f in fields(GPTConfig)}

def resume_point(cfg, layout, vocab_size, log):
    """(the checkpoint of an exact resume, converted weights, model_args). Converted: another
    level or layout, or pretrained weights, as fp32 (nanofp8/checkpoint.py). The architecture is
    the checkpoint's, whatever the config says."""
    ckpt, converted = None, initial_weights(cfg, layout.world)
    if converted is not None:
        if cfg["init_from"] == "resume":
            check_resume_config(converted["config"], cfg, cfg["out_dir"], converted=True)
        log(f"note: {converted['note']}")
    elif cfg["init_from"] == "resume":
        found, notes = find_checkpoint(cfg["out_dir"])
        for note in notes:
            log(f"note: {note}")
        name = checkpoint_name(layout)
        path = found.file(name)
        ckpt = load_checkpoint(path, map_location=layout.device, expect=found.expected(name))
        if "dcp" in ckpt:  # engine=torch: the shards are read once the optimizer exists (restore_state)
            problem = agree(layout, torchstack.check_dcp(found, layout.rank, layout.world))  # first, their hashes
            if problem:
                raise CheckpointError(problem)
            ckpt["dcp"] = found.file(ckpt["dcp"])
        elif "optimizer" not in ckpt:
            raise CheckpointError(f"{path} has no 'optimizer' entry (Adam's state), so the run cannot go on "
                                  f"exactly from it: fine-tune from its weights instead, with init_from="
                                  f"{found.path} and another out_dir (from iteration 0, with a fresh optimizer)")
        ckpt["path"] = path
        check_resume_config(ckpt["config"], cfg, path)
        check_resume_layout(ckpt, cfg, path, layout)
        shards = None if "dcp" in ckpt else ckpt["optimizer"].get("zero_shard_files")
        if shards is not None:  # O3: this rank's own shard, from its own file
            if len(shards) != layout.world:
                raise CheckpointError(f"{found} holds O3 optimizer shards for {len(shards)} ranks; resume it "
                                      f"with the same number of processes, not {layout.world}")
            ckpt["optimizer"] = load_shard(found, shards[layout.rank], ckpt["iter_num"], layout.device)
    model_args = {k: cfg[k] for k in MODEL_KEYS} | {"vocab_size": vocab_size}
    for k in MODEL_KEYS if (ckpt or converted) else ():
        saved = (ckpt or converted)["model_args"].get(k, MODEL_DEFAULTS[k])
        if model_args[k] != saved:
            log(f"note: {k}={saved} from the checkpoint overrides {model_args[k]!r}")
        model_args[k] = saved
    return ckpt, converted, model_args


def restore_state(model, optimizer, ckpt, converted, cfg, layout, log):
    """Optimizer state, position, dropout RNG and this rank's FP8 scaling state, then the FP8 weights
    of the first step (O1: o2_compile.cast_for_step, with the restored scales; engine=torch: the
    amaxes of FSDP2's FP8 all-gathers, agreed now and after every step in one all-reduce,
    fsdp.agree_after_steps). Returns (iter_num, best_val_loss). Called after wrap_data_parallel,
    whose wrappers broadcast replica 0's buffers."""
    restored = _restore_state(model, optimizer, ckpt, converted, cfg, layout, log)
    cast_for_step(model, record=False)
    if layout.engine == "torch" and cfg["precision"] == "O1":
        agree_after_steps(optimizer, model)
    return restored


def _restore_state(model, optimizer, ckpt, converted, cfg, layout, log):
    """restore_state's restoring.

    The global RNG only drives dropout. Each rank gets its own stream (layout.dropout_stream); a
    resumed run continues each data-parallel rank's saved stream (one reseeds only if the
    checkpoint has none for it, e.g. written at another world size: the resume is not bit-exact)."""
    torch.manual_seed(hash((cfg["seed"], layout.dropout_stream)) & (2**63 - 1))
    if converted is not None:
        if converted["moments"]:  # in the new level's formats (nanofp8/checkpoint.py)
            load_moments(optimizer, model, converted["moments"])
        return converted["iter_num"], converted["best_val_loss"]
    if ckpt is None:
        return 0, float("inf")
    if "dcp" in ckpt:
        torchstack.load_dcp(model, optimizer, ckpt)  # weights and optimizer state, at any dp size
        refuse_nonfinite(model, ckpt["dcp"])
    else:
        load_optimizer_state(optimizer, ckpt["optimizer"], ckpt["path"], layout)
    if not ("rng" in ckpt and restore_rng(ckpt["rng"], layout)):
        log("note: the checkpoint has no dropout RNG state for this world size: reseeded, so "
            "with dropout > 0 the resumed run differs from an uninterrupted one")
        torch.manual_seed(hash((cfg["seed"], layout.dropout_stream, ckpt["iter_num"])) & (2**63 - 1))
    if not restore_scaling(model, ckpt.get("fp8_ranks"), layout) and cfg["fp8_scaling"] == "delayed":
        log("note: the checkpoint has no FP8 scaling state for this data-parallel size: every rank goes on "
            "from data-parallel rank 0's amax histories, so the resumed run differs from an uninterrupted one")
    return ckpt["iter_num"], ckpt.get("best_val_loss", float("inf"))


def nothing_to_do(cfg, start_iter, log):
    """Whether a resumed run has no iteration left to train (it says so; the command exits 0). A
    checkpoint past max_iters is a ConfigError: a max_iters too small, or an iteration that is
    not this run's."""
    if cfg["eval_only"] or cfg["init_from"] != "resume" or start_iter < cfg["max_iters"]:
        return False
    if start_iter > cfg["max_iters"]:
        raise ConfigError(f"the checkpoint in {cfg['out_dir']} is at iter {start_iter}, past max_iters="
                          f"{cfg['max_iters']}: nothing to train; pass max_iters > {start_iter} to train on")
    log(f"nothing to do: the checkpoint in {cfg['out_dir']} is at iter {start_iter} = max_iters; pass a larger "
        f"max_iters to train on")
    return True


# -----------------------------------------------------------------------------
# Speed, and the command's exit status

# Dense tensor-core peak per GPU (SXM parts), bf16 and FP8, for MFU. FP8 runs are measured against
# the FP8 peak: "50% MFU" then means the same thing, half of what the hardware could do.
PEAK_FLOPS = {"H100": (989e12, 1979e12), "H200": (989e12, 1979e12), "H800": (989e12, 1979e12),
              "A100": (312e12, None)}


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


class Clock:
    """Step time, throughput and MFU (against peak_flops_for), averaged over the steps since the
    last log line; on a GPU also the peak memory allocated so far (what decides the batch that
    fits, and what FP8 is meant to lower)."""

    def __init__(self, cfg, layout, tokens_per_iter, flops_per_token):
        self.tokens, self.flops, self.world = tokens_per_iter, flops_per_token, layout.world
        self.peak = peak_flops_for(cfg, layout.device_type)
        self.cuda = layout.device_type == "cuda"
        self.t_last, self.step_time, self.steps = time.time(), 0.0, 0

    def restart(self):
        self.t_last = time.time()

    def tick(self):
        now = time.time()
        self.step_time, self.steps, self.t_last = self.step_time + now - self.t_last, self.steps + 1, now

    def report(self, steps_done):
        dt, self.step_time, self.steps = self.step_time / self.steps, 0.0, 0
        tok_per_s = self.tokens / dt
        line = f"time {dt * 1000:.2f}ms, {tok_per_s:,.0f} tok/s"
        if self.peak and steps_done > 2:  # the first iterations include compilation
            # MFU per GPU: the world's tokens are shared by its GPUs; the whole model's FLOPs per
            # token (a pipeline stage's parameters are not the model's)
            line += f", mfu {100 * self.flops * tok_per_s / self.world / self.peak:.2f}%"
        if self.cuda:
            line += f", peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB"
        return line


# The exit statuses of train.py (docs/checkpoints.md: "Exit statuses").
EXIT_DIVERGED, EXIT_REFUSED, EXIT_LOST_RANKS, EXIT_WRITE_FAILED = 1, 2, 3, 4
_signal = None  # the signal that stopped the run (SIGINT: Ctrl-C, SIGTERM: a scheduler), if any


def _stop_on_signal(signum, frame):
    global _signal
    _signal = _signal or signum
    raise KeyboardInterrupt


def command(main, argv=None):
    """train.main() as a command: one line on stderr per failure, and an exit status per kind:
    2 a bad config, dataset, checkpoint or out_dir, found before training (DataError: during it);
    1 a run that stopped because it diverged (non-finite weights, skipped steps, a loss far above
    its best, replicas that differ); 3 ranks that lost each other under torchrun (a collective
    that timed out, a process group that did not form); 4 a checkpoint that could not be written
    (disk full, read-only); 128 + the signal (130 for Ctrl-C, 143 for SIGTERM) for a run
    stopped by one. A line about a stopped run names the last good checkpoint."""
    global _signal, current_out_dir, saving
    _signal, current_out_dir, saving = None, None, None
    handlers = {}
    if threading.current_thread() is threading.main_thread():  # (signals reach only the main thread)
        # a signal ignored when the run started (a script's background job ignores SIGINT) stays ignored
        handlers = {sig: signal.signal(sig, _stop_on_signal) for sig in (signal.SIGINT, signal.SIGTERM)
                    if signal.getsignal(sig) is not signal.SIG_IGN}
    try:
        main(argv)
    except SystemExit:
        raise
    except BaseException as e:
        try:
            code = _report(e)
        except KeyboardInterrupt:  # the signal arrived while another failure was being reported
            code = _report(KeyboardInterrupt())
        sys.exit(code)
    finally:
        release_locks()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def as_rank(cli):
    """Run cli() in a torchrun rank, then leave the process with cli's exit status without
    tearing torch.distributed down at interpreter exit (layout.leave_process: that teardown
    aborted a finished run now and then, and torchrun reported it as failed)."""
    code = 0
    try:
        cli()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    leave_process(code)


def _report(error):
    """Print the one line of a failure (on rank 0 only where every rank reached the same verdict)
    and return the exit status; raise it again if it is not one of those kinds (a bug: traceback)."""
    rank = int(os.environ.get("RANK", 0))
    everyone = f"rank {rank}: " if "RANK" in os.environ else ""

    def say(line, all_ranks=False):
        if all_ranks or rank == 0:
            print(line, file=sys.stderr, flush=True)

    if _signal is not None or isinstance(root_cause(error), KeyboardInterrupt):
        sig = _signal or signal.SIGINT
        what = "Ctrl-C" if sig == signal.SIGINT else signal.Signals(sig).name
        where = last_good(current_out_dir) if current_out_dir else "no checkpoint was being written"
        left = saving if saving and os.path.isdir(saving) else None  # (a rank's writes after rank 0 removed it)
        kept = f"{left} is left partial (readers skip it; the next save removes it)" if left else \
            "nothing half-written is kept"
        say(f"interrupted ({what}): {kept}; {where}")
        return 128 + sig
    if isinstance(error, DataError):  # found by one rank, in its own batch
        say(f"error: {everyone}{error}", all_ranks=True)
        return EXIT_REFUSED
    if isinstance(error, ConfigError):
        # Once the process group exists, every rank reached it alike (agree): rank 0 says it. Before,
        # each node read its own files and environment, and its first rank says what it found (the
        # rank 0 it never joined can only say that the group did not form).
        if rank != 0 and not dist.is_initialized() and os.environ.get("LOCAL_RANK") == "0":
            say(f"error: {everyone}{error}", all_ranks=True)
        else:
            say(f"error: {error}")
        return EXIT_REFUSED
    if isinstance(error, CheckpointError):
        say(f"error: {everyone}{error}", all_ranks=True)
        return EXIT_REFUSED
    if isinstance(error, TrainingStopped):  # diverged: every rank reaches the same verdict
        say(f"error: {error}")
        return EXIT_DIVERGED
    if isinstance(error, WriteError):  # agreed by every rank (save_checkpoint_set)
        say(f"error: {error}")
        return EXIT_WRITE_FAILED
    if isinstance(error, GroupError):
        say(f"error: {everyone}{error}", all_ranks=True)
        return EXIT_LOST_RANKS
    if isinstance(error, RuntimeError) and is_collective_failure(error):
        report_collective_failure(error, f"saving {saving}" if saving else "",
                                  last_good(current_out_dir) if current_out_dir else "")  # exits
    raise error
