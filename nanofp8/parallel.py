"""
Model parallelism in FP8: tensor (TP), sequence (SP) and pipeline (PP) parallelism.

Meant to be read top to bottom, after fp8.py (the FP8 GEMMs used here) and dist.py (the uint8
collectives used here, and the byte counter COMM that every collective below feeds).

1. Tensor parallelism: cut the matrices, not the batch
------------------------------------------------------
A block is two pairs of GEMMs: (qkv, attention output) and (MLP in, MLP out). Cut the first of a
pair by output features ("column-parallel") and the second by input features ("row-parallel"):
the first reads the full input and writes a slice of the features (whole heads, a slice of the
MLP units), the second reads that slice and writes a *partial sum* of the full output. One
collective per pair, mirrored in backward:

    column-parallel  forward: x replicated, nothing to do    backward: all-reduce partial dx
    row-parallel     forward: all-reduce partial y           backward: dy replicated, nothing to do

The fused qkv weight has rows [q | k | v]: a rank takes its heads from each of the three, not a
contiguous third. With grouped-query attention k and v hold fewer heads than q; a rank takes
n_kv_head / tp of them and the query heads that read them (tp must divide n_kv_head). LLaMA's
fused [gate | up] is cut the same way, so gate i and up i share a rank.
Nothing else in a block changes: attention reads its number of heads from the width its qkv shard
writes, so tensor parallelism only swaps Linears, as the plan of section 4 (tp_plan) says.

2. Which FP8 scales must the ranks agree on?
--------------------------------------------
Each rank runs fp8.py's GEMMs on its shard, with the recipe's formats and granularity. A scale
covers some values; the ranks only need to agree on it if those values live on several ranks.
  * A replicated operand (column-parallel x, row-parallel dy) has the same bits everywhere, and
    current scaling is a deterministic function of the bits (delayed scaling: of identical
    histories): identical scales, no communication. This keeps the replicated residual stream
    bit-identical across ranks.
  * A sharded operand (W, column-parallel dy, row-parallel x) is only contracted inside its own
    rank's GEMM; the partial results are dequantized and summed in fp32 afterwards. So a per-rank
    scale is valid: it never multiplies another rank's values.
  * "tensor" granularity means one scale for the logical tensor, so for a sharded tensor the
    ranks agree on it with a MAX all-reduce of the amax (4 bytes; current scaling only, delayed
    scaling keeps one history per rank). That is the very scale of the
    single-device layer, and a TP layer then reproduces its single-device twin up to fp32
    summation order. Row and block scales are per row / tile of the shard: finer than the twin's
    (row scales along a cut dimension) or equal to them (block scales of 128-aligned shards).

3. Sequence parallelism: shard what TP leaves replicated
--------------------------------------------------------
Between a row-parallel output and the next column-parallel input, TP leaves norms, dropout and
residual adds replicated. SP gives each rank 1/W of the sequence there: the all-reduce becomes a
reduce-scatter (each rank keeps the sum for its own tokens) and the column-parallel layer starts
with an all-gather of the token slices; in backward each becomes the other. Same bytes as the
all-reduce (itself a reduce-scatter plus an all-gather), W times less activation memory.

The FP8 all-gather has a property worth exploiting: with row or block scales each token carries
its own scales, which do not depend on who quantized it. The gathered bytes and scales therefore
*are* the quantized full input, bit for bit, and go into the GEMM as they arrive. With tensor
scaling the ranks agree on the scale first (the max of the slices' amaxes is the whole's amax),
and the same holds. (The wgrad GEMM contracts over tokens and needs x^T re-quantized along them;
with row/block scales it is re-quantized from the gathered FP8 values: one extra rounding, or
none with power-of-two scales, since an FP8 value times 2^k is again an FP8 value (subnormals
aside).)

The reduce-scatter sends each rank's partial sums in FP8 with one scale per token (an outlier
token does not squeeze the others) and sums the W dequantized copies in fp32 (dist.py). FP8-LM
keeps this one in BF16; here it is FP8 as well, at the price of one FP8 rounding of the partial
sums, which tests/test_parallel.py measures. comm="bf16" is the baseline. Only the block stack is
sequence-parallel: the first block slices its input, the last gathers its output (in fp32, so
embedding and LM head see exact, replicated values).

4. Pipeline parallelism
-----------------------
The blocks are cut into P consecutive stages; the embedding goes with the first, final norm,
LM head and loss with the last. pipeline_step runs GPipe: all micro-batch forwards, then all
backwards. pipeline_step's act_fmt / grad_fmt say what crosses a stage boundary: E4M3 with one
scale per token for activations and E5M2 for gradients (uint8 payload with the fp32 scales
appended: one send each), or a plain dtype. train.py passes its mp_comm choice (bf16 at the bf16
level, so that a bf16 run sends nothing in FP8; tests/test_comm.py reads the wire dtypes). Tied embeddings: the last stage holds a copy of
the embedding matrix as its LM head; the two gradients are summed between first and last stage,
so both copies take the same optimizer step and stay equal.

5. Call contract for train.py
-----------------------------
    groups = make_groups(tp=T, pp=P)                 # after init_process_group; dp = world/(T*P)
    torch.manual_seed(seed)                          # SAME initial weights on every rank
    model = GPT(cfg); apply_fp8(model, recipe)       # a single-device checkpoint loads here
    parallelize(model, groups.tp_group, sp=SP)       # no-op if T == 1; bf16 (no apply_fp8):
                                                     # comm="bf16", TPLinearPlain layers
    stage = PipelineStage(model, groups).to(device)  # also for P == 1; then drop `model`
    torch.manual_seed(hash((seed, groups.dp_rank, groups.pp_rank)))  # dropout: the same RNG on
                                                     # a TP group (replicated regions must match)
    dp = TPDataParallel(stage, groups, overlap=True) # if groups.dp > 1 (broadcasts dp rank 0)
    opt = AdamW(stage.parameters(), ...)
    each iteration (no torch.compile, no autocast around the call):
        loss = pipeline_step(stage, micro_batches, groups, autocast=autocast, dp=dp)
            # micro_batches: [(x, y)] * gradient-accumulation steps of this DP rank, the same on
            # every rank of the pipeline; loss: their mean, on every rank (this DP replica's);
            # dp (or None): its buckets leave during the last micro-batch's backward
        sync_model_parallel_grads(stage, groups)     # SP-partial and tied grads: before DP ...
        finite = dp.sync_gradients()                 # ... then the DP average
        norm = clip_grad_norm_(stage, max_norm, groups)   # global norm, identical everywhere
        if finite and torch.isfinite(norm): opt.step()
        opt.zero_grad()
    evaluation: pipeline_step(stage, batches, groups, train=False); average over dp_group only.
    checkpoints: ranks with dp_rank == 0 save stage.state_dict() (the GPT's keys, this rank's
    shards) and the optimizer state under checkpoint_suffix(groups); a resumed run builds the
    same layout and loads its own file after PipelineStage(). merge_tp_state_dicts() rebuilds
    full tensors from a stage's TP shards (stages' dicts union) for a single-device GPT.
    MFU: use the unsharded model's flops_per_token (a shard's parameter count is smaller).

Limits: SP needs the sequence length divisible by tp (sample from a merged checkpoint on one
device); a bf16 model (no recipe) gets TPLinearPlain, bf16 GEMMs with plain collectives. Not done:
vocabulary-parallel embedding / LM head (replicated under TP), 1F1B or interleaved schedules,
torch.compile of the parallel layers, O2 (fp16 master) TP layers.
"""

import math
import re
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from . import dist as D
from .dist import COMM, Fp8Chunks
from .fp8 import E4M3, E5M2, INPUT, OPERANDS, WEIGHT, Fp8Format, Fp8Linear, Fp8LinearFunction, Fp8Tensor, quantize
from .layout import Layout, make_layout
from .model import GPT

PLAIN = {"bf16": torch.bfloat16, "fp32": torch.float32}  # the baseline communication dtypes

# -----------------------------------------------------------------------------
# 1. Process groups


# nanofp8/layout.py's Layout is this rank's place in the pp x dp x tp arrangement (DeviceMesh,
# row-major: global rank = (pp_rank * dp + dp_rank) * tp + tp_rank, TP ranks neighbours) and
# the groups it belongs to; make_groups(tp, pp) builds it for an initialized process group.
ParallelGroups, make_groups = Layout, make_layout


# -----------------------------------------------------------------------------
# 2. The collectives of TP and SP, on (batch, sequence, features) activations
#
# Under SP rank r holds tokens [r*Tl, (r+1)*Tl) of every sequence. A gather concatenates whole
# buffers rank after rank, i.e. in (rank, batch, token) order; the model wants (batch, rank,
# token). _slices_to_seq / _seq_to_slices convert between the two (a copy of 1-byte values for
# the FP8 gathers). Summed payloads carry one scale per token (block = row length): they are
# dequantized before use, so their scales are free to choose, and per token is what keeps an
# outlier token from flushing its neighbours.


def _slices_to_seq(t, W, B, Tl):
    return t.reshape(W, B, Tl, -1).transpose(0, 1).reshape(B * W * Tl, -1)


def _seq_to_slices(y, W):
    B, T, N = y.shape
    return y.reshape(B, W, T // W, N).transpose(0, 1).contiguous()


def _shared_scale(x2, mod, fmt):
    """The scale of a tensor sharded over the TP group: from the max of the ranks' amaxes."""
    amax = x2.detach().abs().amax().float().reshape(1)
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=mod.group)
    COMM.add("amax_max", 4, 8 * (mod.tp - 1) / mod.tp)
    return mod.recipe.scale_rule(amax[0], fmt, mod.recipe.margin, mod.recipe.power_of_two)


def _gather_operand(x, mod, fmt, operand):
    """All-gather the sequence slices x (B, Tl, K) into the whole sequence (B, T, K): in FP8, the
    GEMM operand (B*T, K) quantized along K (an Fp8Tensor); baseline comm, in bf16/fp32 (fp32).
    A statistics step records the FP8 cast of this rank's slice as mod's `operand`."""
    W, (B, Tl, K) = mod.tp, x.shape
    x2 = x.reshape(-1, K)
    if mod.comm != "fp8":  # the fp8.py Function quantizes the (replicated) whole: no scale to agree on
        flat = D.all_gather_plain(x2, mod.group, dtype=PLAIN[mod.comm], out_dtype=torch.float32)
        return _slices_to_seq(flat, W, B, Tl).view(B, W * Tl, K)
    r = mod.recipe
    if r.granularity == "tensor":  # one agreed scale; the slice travels as one row
        q = quantize(x2, fmt, "tensor", scale=_shared_scale(x2, mod, fmt))
        rows = Fp8Chunks(q.data.view(1, -1), q.scale.view(1, 1), x2.numel())
    else:  # row / block: each token's own scales, computed exactly as on one device
        q = quantize(x2, fmt, r.granularity, r.act_tile, margin=r.margin, power_of_two=r.power_of_two,
                     scale_rule=r.scale_rule)
        rows = Fp8Chunks(q.data, q.scale.view(B * Tl, -1), K)
    see = D.observed(mod, operand)
    if see is not None:  # a statistics step: this rank's cast of its slice
        see(x2, q)
    got = D.all_gather_fp8(rows, mod.group, keep_fp8=True)  # payload and scales in one buffer
    data = _slices_to_seq(got.data, W, B, Tl)
    scale = got.scale[0, 0] if r.granularity == "tensor" else _slices_to_seq(got.scale, W, B, Tl)
    return Fp8Tensor(data, scale, fmt, q.granularity, q.block, data.shape, x.dtype)


def _reduce_scatter_seq(y, mod, fmt, operand=None):
    """Sum the ranks' partial y (B, T, N) and keep this rank's sequence slice (B, T/W, N), fp32.
    A statistics step records the FP8 cast of this rank's partial sums as mod's `operand`."""
    B, T, N = y.shape
    chunks = _seq_to_slices(y, mod.tp)  # chunk r: the tokens rank r keeps
    if mod.comm == "fp8":
        out = D.reduce_scatter_fp8(chunks, mod.group, fmt, block=N, out_dtype=torch.float32,
                                   observe=D.observed(mod, operand))
    else:
        out = D.reduce_scatter_plain(chunks, mod.group, PLAIN[mod.comm], out_dtype=torch.float32)
    return out.view(B, T // mod.tp, N)


def _all_reduce(y, mod, fmt, operand=None):
    """Sum the ranks' partial y over the TP group; every rank gets the same bits, fp32. (Statistics:
    as _reduce_scatter_seq, of the first of the two FP8 casts.)"""
    if mod.comm == "fp8":
        return D.all_reduce_fp8(y, mod.group, fmt, block=y.shape[-1], out_dtype=torch.float32,
                                observe=D.observed(mod, operand))
    return D.all_reduce_plain(y, mod.group, PLAIN[mod.comm], out_dtype=torch.float32)


# -----------------------------------------------------------------------------
# 3. The tensor-parallel FP8 linear layer
#
# fp8.py's Function multiplies what it is given. A shard wraps it in the collectives of section 2,
# one autograd Function on each side, each the mirror of itself in backward (the wgrad GEMM needs
# none: a shard's weight gradient is its own):
#
#                 into the shard (_ShardInput)              out of it (_ShardOutput)
#     column      forward: SP: all-gather x (FP8)           -
#                 backward: all-reduce dx (SP: r-scatter)
#     row         -                                         forward: all-reduce y (SP: r-scatter)
#                                                           backward: SP: all-gather dy (FP8)
#
# What is gathered in FP8 is the GEMM operand itself, handed to the Function already cast, in a
# Gathered (x in forward, dy in backward); autograd then carries a stand-in of its shape: a
# zero-size expand, never read (x never exists whole in high precision). TPLinearPlain, the bf16
# baseline, communicates at the same points, in bf16 or fp32, around autocast's F.linear.


@dataclass
class Gathered:
    """FP8 operands gathered already: x for the forward GEMM, dy for the backward ones."""
    x: Fp8Tensor = None
    dy: Fp8Tensor = None


def _stand_in(t, rows, dtype):
    """What autograd carries in place of a gathered operand: t's shape with `rows` tokens per
    sequence, no memory."""
    return t.new_zeros((), dtype=dtype).expand(t.shape[0], rows, t.shape[-1])


class _ShardInput(torch.autograd.Function):
    """x into a column shard, in fp32 so that the partial dx are summed from fp32: under SP the
    whole sequence, gathered (given.x in FP8); backward: the ranks' partial dx summed (SP: each
    rank keeps its tokens')."""

    @staticmethod
    def forward(ctx, x, mod, given):
        ctx.mod, ctx.dtype = mod, x.dtype
        if not mod.sp:
            return x.float()
        got = _gather_operand(x, mod, mod.recipe.fwd_fmt, "x")
        if isinstance(got, Fp8Tensor):
            given.x, got = got, _stand_in(x, x.shape[1] * mod.tp, torch.float32)
        return got

    @staticmethod
    def backward(ctx, dx):
        mod, fmt = ctx.mod, ctx.mod.comm_fmts[1]
        dx = _reduce_scatter_seq(dx, mod, fmt, "dx_partial") if mod.sp else _all_reduce(dx, mod, fmt, "dx_partial")
        return dx.to(ctx.dtype), None, None


class _ShardOutput(torch.autograd.Function):
    """A row shard's partial y, summed over the ranks (SP: each keeps its tokens'); backward: dy
    of the whole sequence under SP, gathered (given.dy in FP8), else replicated already."""

    @staticmethod
    def forward(ctx, y, mod, given):
        ctx.mod, ctx.given, ctx.dtype = mod, given, y.dtype
        fmt = mod.comm_fmts[0]
        y = _reduce_scatter_seq(y, mod, fmt, "y_partial") if mod.sp else _all_reduce(y, mod, fmt, "y_partial")
        return y.to(ctx.dtype)

    @staticmethod
    def backward(ctx, dy):
        mod = ctx.mod
        if not mod.sp:
            return dy, None, None
        got = _gather_operand(dy, mod, mod.recipe.bwd_fmt, "dy")
        if isinstance(got, Fp8Tensor):
            ctx.given.dy, got = got, _stand_in(dy, dy.shape[1] * mod.tp, ctx.dtype)
        return got.to(ctx.dtype), None, None


def _hold_shard(mod, weight, bias, parallel, group, sp, comm):
    """What both TP layers hold: their own copy of the shard, its place, and the tags that the
    gradient utilities of section 5 read."""
    # contiguous copies: a column slice is strided, and the FP8 GEMMs want row-major operands
    mod.weight = nn.Parameter(weight.detach().clone(memory_format=torch.contiguous_format))
    mod.bias = None if bias is None else nn.Parameter(bias.detach().clone())
    mod.parallel, mod.group, mod.sp, mod.comm = parallel, group, sp, comm
    mod.tp, mod.tp_rank = dist.get_world_size(group), dist.get_rank(group)
    mod.weight.tp_sharded = True
    if mod.bias is not None:
        mod.bias.tp_sharded = parallel == "column"
        mod.bias.sp_partial = parallel == "row" and sp


class TPLinear(Fp8Linear):
    """One rank's shard of a Linear, parallel="column" (weight rows = output features) or "row"
    (weight columns = input features). An Fp8Linear in everything else: the same Function, recipe
    knobs and delayed-scaling buffers. Delayed scaling keeps one history per rank (valid by
    section 2; tensor scales of shards then differ from the twin's), except for an input that SP
    gathers in FP8: it is quantized before it exists whole, so it gets current scaling.

    column: y_r = x @ W_r^T (+ b_r)     row: y = sum_r x_r @ W_r^T (+ b, added once after the sum)

    Parameters are tagged for the gradient utilities of section 5: `tp_sharded` (a different
    tensor on every TP rank) and `sp_partial` (replicated, but under SP each rank only sees the
    gradient from its own tokens: must be summed over the TP group)."""

    def __init__(self, weight, bias, parallel, group, sp=False, recipe=None, comm="fp8", fqn="",
                 comm_fmts=None):
        out_f, in_f = weight.shape
        super().__init__(in_f, out_f, bias is not None, device="meta", recipe=recipe, fqn=fqn)
        if parallel not in ("column", "row") or comm not in ("fp8", *PLAIN):
            raise ValueError(f"parallel={parallel!r} / comm={comm!r}")
        _hold_shard(self, weight, bias, parallel, group, sp, comm)
        self._init_scaling_state(weight.device)
        self.comm_fmts = comm_fmts or (self.recipe.fwd_fmt, self.recipe.bwd_fmt)

    def quantize_operand(self, operand, x2):
        """fp8.py's quantization, plus the agreed tensor scale (section 2) for an operand whose
        values are spread over the ranks: the weight, a row-parallel input, a column-parallel
        gradient. (The weight is cast at every forward: Fp8Linear does not cache it, so the amax
        all-reduce stays matched across ranks.) Delayed scaling keeps each rank's own history."""
        r, how, role = self.recipe, self.recipe.casts[operand], OPERANDS[operand]
        spread = role == WEIGHT or (role == INPUT) == (self.parallel == "row")
        if spread and r.scaling == "current" and how and how[1] == "tensor" and self.tp > 1:
            return quantize(x2, how[0], "tensor", scale=_shared_scale(x2, self, how[0]))
        return super().quantize_operand(operand, x2)

    def shard(self):
        """(weight, bias) as this rank's GEMM reads them: its own tensors here; engine=torch's
        layer holds DTensors and hands over their local shards (nanofp8/torchstack.py)."""
        return self.weight, self.bias

    def forward(self, x):
        dev, given = x.device.type, Gathered()
        out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        w, b = self.shard()
        if self.parallel == "column":
            x = _ShardInput.apply(x, self, given)
            return Fp8LinearFunction.apply(x, w, b, self, out_dtype, given)
        y = Fp8LinearFunction.apply(x, w, None, self, out_dtype, given)
        y = _ShardOutput.apply(y, self, given)
        return y if b is None else y + b.to(y.dtype)  # the bias once, after the sum

    def extra_repr(self):
        return (f"{super().extra_repr()}, {self.parallel}-parallel x{self.tp}, sp={self.sp}, "
                f"comm={self.comm}")


class _PlainRegion(torch.autograd.Function):
    """One collective of TPLinearPlain, forward, and its mirror, backward (sections 1 and 3):
        "copy"     column input, x replicated     fwd: nothing              bwd: all-reduce dx
        "reduce"   row output, partial sums       fwd: all-reduce           bwd: nothing
        "gather"   column input under SP          fwd: all-gather tokens    bwd: reduce-scatter dx
        "scatter"  row output under SP            fwd: reduce-scatter       bwd: all-gather dy"""

    MIRROR = {"copy": "reduce", "reduce": "copy", "gather": "scatter", "scatter": "gather"}

    @staticmethod
    def forward(ctx, x, kind, mod):
        ctx.kind, ctx.mod = kind, mod
        return _plain_collective(x, kind, mod)

    @staticmethod
    def backward(ctx, g):
        return _plain_collective(g, _PlainRegion.MIRROR[ctx.kind], ctx.mod), None, None


def _plain_collective(x, kind, mod):
    if kind == "copy":
        return x.view_as(x)
    if kind == "reduce":
        return D.all_reduce_plain(x, mod.group, PLAIN[mod.comm], out_dtype=x.dtype)
    if kind == "scatter":
        return _reduce_scatter_seq(x, mod, None).to(x.dtype)
    W, (B, Tl, K) = mod.tp, x.shape
    flat = D.all_gather_plain(x, mod.group, dtype=PLAIN[mod.comm], out_dtype=x.dtype)
    return _slices_to_seq(flat, W, B, Tl).view(B, W * Tl, K)


class TPLinearPlain(nn.Module):
    """TPLinear's high-precision twin, for a bf16 run: the same shards, tags and collectives, but
    the GEMMs are whatever autocast makes of F.linear (bf16) and the collectives plain bf16/fp32
    (what Megatron-LM does). Without it a bf16 run under TP would silently compute in FP8."""

    def __init__(self, weight, bias, parallel, group, sp=False, comm="bf16"):
        super().__init__()
        if parallel not in ("column", "row") or comm not in PLAIN:
            raise ValueError(f"parallel={parallel!r} / comm={comm!r} (bf16 layers: 'bf16' or 'fp32')")
        self.out_features, self.in_features = weight.shape
        _hold_shard(self, weight, bias, parallel, group, sp, comm)

    shard = TPLinear.shard

    def forward(self, x):
        w, b = self.shard()
        if self.parallel == "column":
            x = _PlainRegion.apply(x, "gather" if self.sp else "copy", self)
            return F.linear(x, w, b)
        y = _PlainRegion.apply(F.linear(x, w), "scatter" if self.sp else "reduce", self)
        return y if b is None else y + b.to(y.dtype)  # added once, after the sum

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{self.parallel}-parallel x{self.tp}, sp={self.sp}, comm={self.comm}")


# -----------------------------------------------------------------------------
# 4. Converting a GPT (nanofp8.model) in place
#
# model.py's attention and MLP read their sizes from the tensors they get (heads = width /
# head_dim), so a block runs unchanged on a shard: tensor parallelism only swaps its Linears.
# Which ones, and how, is data: the plan below, read by parallelize (to cut) and by
# merge_tp_state_dicts (section 7, to glue back).


def tp_plan(config):
    """Block submodule -> (cut, pieces). "column": output features, i.e. the weight's rows and
    the bias; "row": input features, the weight's columns (its bias is whole, added after the
    sum). pieces: (name, rows) of the matrices stacked in a fused weight; each is cut on its own,
    so that a rank holds the same heads of q, k and v (section 1), and the same units of gate and up."""
    q, k, v = config.qkv_rows
    return {"attn.c_attn": ("column", (("q", q), ("k", k), ("v", v))),
            "attn.c_proj": ("row", ()),
            "mlp.c_fc": ("column", (("gate", config.hidden), ("up", config.hidden)) if config.arch == "llama"
                         else (("fc", config.hidden),)),
            "mlp.c_proj": ("row", ())}


def _shard_rows(t, pieces, rank, tp):
    """Rows of the fused matrix t = [piece_0 | piece_1 | ...]: this rank's share of each piece."""
    return torch.cat([p.chunk(tp, dim=0)[rank] for p in t.split([rows for _, rows in pieces], dim=0)], dim=0)


def _merge_rows(shards, pieces):
    """The inverse of _shard_rows, given every rank's share."""
    cut = [s.split([rows // len(shards) for _, rows in pieces], dim=0) for s in shards]
    return torch.cat([torch.cat([c[i] for c in cut], dim=0) for i in range(len(pieces))], dim=0)


def shard_linears(block, plan, rank, tp, make):
    """Replace the block's Linears named in the plan by this rank's shards:
    make(weight shard, bias shard or None, "column" | "row", submodule name) -> module."""
    for name, (cut, pieces) in plan.items():
        parent, attr = name.rsplit(".", 1)
        lin = block.get_submodule(name)
        if cut == "column":
            w = _shard_rows(lin.weight, pieces, rank, tp)
            b = None if lin.bias is None else _shard_rows(lin.bias, pieces, rank, tp)
        else:
            w, b = lin.weight.chunk(tp, dim=1)[rank], lin.bias
        setattr(block.get_submodule(parent), attr, make(w, b, cut, name))


class _SeqScatter(torch.autograd.Function):
    """Enter the SP region: keep this rank's slice of the (replicated) sequence."""

    @staticmethod
    def forward(ctx, x, group):
        W, r = dist.get_world_size(group), dist.get_rank(group)
        if x.shape[1] % W:
            raise ValueError(f"sequence parallelism: length {x.shape[1]} not divisible by {W}")
        ctx.group, Tl = group, x.shape[1] // W
        return x[:, r * Tl : (r + 1) * Tl].contiguous()

    @staticmethod
    def backward(ctx, g):
        return _gather_seq_plain(g, ctx.group), None


class _SeqGather(torch.autograd.Function):
    """Leave the SP region: gather the whole sequence (replicated again)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.Tl = group, x.shape[1]
        return _gather_seq_plain(x, group)

    @staticmethod
    def backward(ctx, g):
        r = dist.get_rank(ctx.group)
        return g[:, r * ctx.Tl : (r + 1) * ctx.Tl].contiguous(), None


def _gather_seq_plain(x, group):
    # At the edges of the SP region the residual stream (and its gradient) is gathered in its own
    # precision: once per forward, not per layer, and what leaves it feeds the LM head / embedding.
    W, (B, Tl, C) = dist.get_world_size(group), x.shape
    flat = D.all_gather_plain(x, group, dtype=x.dtype)
    return _slices_to_seq(flat, W, B, Tl).view(B, W * Tl, C)


def parallelize(model, tp_group, sp=False, recipe=None, comm="fp8", comm_fmts=None):
    """Convert a nanofp8.model.GPT in place to tensor parallelism over tp_group (and sequence
    parallelism if sp). Every rank must hold the same weights when it is called. The block
    Linears named in tp_plan become TPLinear shards (recipe: the given one, else the one apply_fp8 already put on
    them), or, in a model without FP8 recipe and with comm "bf16" / "fp32", TPLinearPlain shards
    (bf16 autocast GEMMs); embeddings, norms and LM head stay replicated. Returns the model.

    comm: "fp8" | "bf16" | "fp32": how partial sums and SP gathers travel.
    comm_fmts: (forward, backward) FP8 formats of the *summed* payloads (the all-reduce /
    reduce-scatter of partial sums); default the recipe's (E4M3, E5M2 for "hybrid"). They carry
    one scale per token, which is fine-grained enough for (E4M3, E4M3): +6 dB on the gradient.
    (The FP8 gathers feed the GEMMs and always use the recipe's formats.)"""
    tp, rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    if tp == 1:
        return model
    cfg = model.config
    if cfg.n_head % tp or cfg.kv_heads % tp or cfg.hidden % tp:
        raise ValueError(f"n_head={cfg.n_head}, n_kv_head={cfg.kv_heads} and MLP width {cfg.hidden} must "
                         f"divide by tp={tp}")
    plan = tp_plan(cfg)
    for i, blk in enumerate(model.blocks):
        rec = recipe or getattr(blk.attn.c_attn, "recipe", None)
        if rec is None and comm == "fp8":
            raise ValueError("parallelize needs an FP8 recipe (pass recipe= or apply_fp8 first), "
                             "or comm='bf16' / 'fp32' for bf16 layers")

        def make(w, b, cut, name, rec=rec, i=i):
            if rec is None:
                return TPLinearPlain(w, b, cut, tp_group, sp, comm)
            return TPLinear(w, b, cut, tp_group, sp, rec, comm, f"blocks.{i}.{name}", comm_fmts)

        shard_linears(blk, plan, rank, tp, make)
        if sp:  # the norms see only this rank's tokens: their gradients are partial
            for p in list(blk.norm_1.parameters()) + list(blk.norm_2.parameters()):
                p.sp_partial = True
    if sp:  # hooks, not wrappers: the state_dict keys stay those of the single-device model
        model.blocks[0].register_forward_pre_hook(
            lambda m, args: (_SeqScatter.apply(args[0], tp_group), *args[1:]))
        model.blocks[-1].register_forward_hook(lambda m, args, out: _SeqGather.apply(out, tp_group))
    model.tp_group, model.sp, model.tp = tp_group, sp, tp
    return model


# -----------------------------------------------------------------------------
# 5. Gradients across model-parallel ranks


@torch.no_grad()
def sync_model_parallel_grads(module, groups):
    """Call after backward, before DP averaging and clipping. Sums (1) the SP-partial
    gradients (norm gains, row-parallel biases) over the TP group and (2) the gradients of the two
    copies of a tied embedding between the first and last pipeline stage. fp32, one collective
    each; the sums come back identical on every rank, so the replicas take identical steps."""
    params = [p for p in module.parameters() if p.grad is not None]
    for flags, group, n in (("sp_partial", groups.tp_group, groups.tp),
                            ("pp_tied", groups.embed_group, 2 if groups.pp > 1 else 1)):
        ps = [p for p in params if getattr(p, flags, False)]
        if n == 1 or not ps:
            continue
        flat = D.all_reduce_plain(torch.cat([p.grad.reshape(-1).float() for p in ps]), group,
                                  torch.float32)
        for p, g in zip(ps, flat.split([p.numel() for p in ps])):
            p.grad.copy_(g.view_as(p))


class TPDataParallel(D.Fp8DataParallel):
    """Data parallelism (dist.py's Fp8DataParallel over groups.dp_group) for a TP/PP model: the
    weight gradients of the FP8 shards (TPLinear) travel in `fmt`, every other gradient in `rest`.

    One wrapper is enough although a TP shard has a different amax on every TP rank: a scale
    covers 128 values of one parameter, never a neighbour's, so a replicated gradient is rounded
    the same wherever it is (the replicas stay bit-identical). Call after
    sync_model_parallel_grads.

    overlap=True (train.py's choice; off by default, since every backward must then go through
    pipeline_step(dp=...)): a gradient's bucket leaves during the backward of the last
    micro-batch (pipeline_step runs the earlier backwards in this wrapper's no_sync()). The
    gradients that sync_model_parallel_grads still sums after backward (SP-partial, tied
    embedding copies) are `late`: reduced by sync_gradients(), after it. The same bits as
    overlap=False (tests/test_comm.py)."""

    def __init__(self, module, groups, overlap=False, **kwargs):
        late = [p for p in module.parameters()
                if getattr(p, "sp_partial", False) or getattr(p, "pp_tied", False)]
        super().__init__(module, groups.dp_group, overlap=overlap, late=late, **kwargs)


@torch.no_grad()
def clip_grad_norm_(module, max_norm, groups):
    """Clip by the norm of the whole model's gradient, which no single rank holds: a shard counts
    on every TP rank, a replicated parameter on TP rank 0 only, stages add up, the tied copy on
    the last stage is left out. Returns the norm (the same on every rank: the clip factor, and a
    skip decision taken on isfinite(norm), agree everywhere)."""
    params = [p for p in module.parameters() if p.grad is not None]
    dev = params[0].grad.device if params else "cpu"
    sq = torch.zeros(1, device=dev, dtype=torch.float64)
    for p in params:
        if getattr(p, "pp_tied", False) and groups.pp_rank > 0:
            continue
        if getattr(p, "tp_sharded", False) or groups.tp_rank == 0:
            sq += p.grad.double().pow(2).sum()
    for group, n in ((groups.tp_group, groups.tp), (groups.pp_group, groups.pp)):
        if n > 1:
            dist.all_reduce(sq, group=group)
            COMM.add("grad_norm", 8, 16 * (n - 1) / n, torch.float64)
    norm = sq.sqrt().float()[0]
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        p.grad.mul_(coef.to(p.grad.dtype))
    return norm


# -----------------------------------------------------------------------------
# 6. Pipeline parallelism


def stage_layers(n_layer, pp, stage):
    """Blocks [lo, hi) of a stage: as even as possible, the first stages taking the remainder."""
    if n_layer < pp:
        raise ValueError(f"{n_layer} layers cannot fill {pp} pipeline stages")
    sizes = [n_layer // pp + (s < n_layer % pp) for s in range(pp)]
    return sum(sizes[:stage]), sum(sizes[: stage + 1])


class PipelineStage(nn.Module):
    """One pipeline stage of a GPT, sharing (not copying) its modules. state_dict keys are those
    of the GPT (blocks keep their global index), so stages' dicts union into a full one.

    forward(inp, targets, seq_len): the first stage takes token ids, the others the previous
    stage's output; the last stage returns the loss, the others their output activation. Its
    `observer` slot lets FP8 statistics see what it sends (pipeline_step)."""

    observer = None

    def __init__(self, model, groups):
        super().__init__()
        cfg, s, P = model.config, groups.pp_rank, groups.pp
        self.config, self.first, self.last = cfg, s == 0, s == P - 1
        self.fqn = f"pipeline.stage{s}"
        self.seq_div = model.tp if getattr(model, "sp", False) else 1  # SP: slices between stages
        if self.first:
            self.tok_emb, self.pos_emb, self.drop = model.tok_emb, model.pos_emb, model.drop
        lo, hi = stage_layers(cfg.n_layer, P, s)
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(lo, hi)})
        if self.last:
            self.norm_f, self.lm_head = model.norm_f, model.lm_head
        if cfg.tie_embeddings and P > 1 and (self.first or self.last):
            if self.last:  # untie: the last stage gets its own copy, kept equal by summed grads
                self.lm_head.weight = nn.Parameter(model.tok_emb.weight.detach().clone())
            (self.tok_emb if self.first else self.lm_head).weight.pp_tied = True
        if cfg.arch == "llama":
            self.register_buffer("rope_cos", model.rope_cos, persistent=False)
            self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    def act_shape(self, B, T):
        return (B, T // self.seq_div, self.config.n_embd)

    # GPT.forward's three parts, the same functions, run on the modules this stage holds
    embed, run_blocks, head = GPT.embed, GPT.run_blocks, GPT.head

    def forward(self, inp, targets=None, seq_len=None):
        x = self.embed(inp) if self.first else inp
        x = self.run_blocks(x, self.blocks.values(), seq_len or inp.shape[1])
        return self.head(x, targets)[1] if self.last else x


def _send(x, dst, group, fmt, observe=None):
    """Send an activation or gradient: FP8 with one fp32 scale per token appended to its row
    (one message), or plainly in a baseline dtype. observe: see dist.quantize_chunks."""
    if isinstance(fmt, Fp8Format):
        buf = D.quantize_chunks(x.detach().reshape(-1, x.shape[-1]), fmt, observe=observe).to_bytes()
    else:
        buf = x.detach().to(fmt).contiguous()
    dist.send(buf, dst, group=group)
    n = buf.numel() * buf.element_size()
    fp8 = isinstance(fmt, Fp8Format)
    COMM.add(f"pp_send_{fmt.name if fp8 else str(fmt).split('.')[-1]}", n, n,
             fmt.dtype if fp8 else fmt, 4 * buf.shape[0] if fp8 else 0)


def _recv(shape, src, group, fmt, device):
    rows, C = math.prod(shape[:-1]), shape[-1]
    if isinstance(fmt, Fp8Format):
        buf = torch.empty(rows, C + 4, dtype=torch.uint8, device=device)
        dist.recv(buf, src, group=group)
        return D.Fp8Chunks.from_bytes(buf, C, C, fmt.dtype).dequantize(torch.float32).view(shape)
    buf = torch.empty(shape, dtype=fmt, device=device)
    dist.recv(buf, src, group=group)
    return buf.float()


def pipeline_step(stage, micro_batches, groups, autocast=None, act_fmt=E4M3, grad_fmt=E5M2,
                  train=True, dp=None):
    """GPipe over the pipeline group: the forwards of all micro-batches, then their backwards
    (gradients accumulate in .grad, each micro-batch's loss weighted 1/n). Every rank of the
    pipeline passes the same list of (tokens, targets) (only the first stage reads the tokens and
    only the last the targets). Returns the mean loss over the micro-batches, on every rank.

    act_fmt / grad_fmt: E4M3 / E5M2 (FP8 between stages), or torch.bfloat16 / float32.
    train=False: forwards only, without autograd (evaluation).
    dp: the data-parallel wrapper (TPDataParallel) whose hooks reduce gradients during backward:
    every backward but the last micro-batch's runs in its no_sync()."""
    s, n = groups.pp_rank, len(micro_batches)
    # statistics of the FP8 sends (under TP without SP the group's ranks send the same: one counts)
    counted = groups.tp_rank == 0 or stage.seq_div > 1
    act_seen, grad_seen = (D.observed(stage, "act"), D.observed(stage, "grad")) if counted else (None, None)
    prev = groups.pp_ranks[s - 1] if s > 0 else None
    nxt = groups.pp_ranks[s + 1] if s < groups.pp - 1 else None
    device = next(stage.parameters()).device
    ins, outs, losses = [], [], []
    with torch.set_grad_enabled(train):
        for idx, targets in micro_batches:
            B, T = idx.shape
            inp = idx if stage.first else _recv(stage.act_shape(B, T), prev, groups.pp_group,
                                                act_fmt, device)
            if train and not stage.first:
                inp.requires_grad_()
            with autocast or nullcontext():
                out = stage(inp, targets if stage.last else None, T)
            if stage.last:
                losses.append(out.detach().float())
            else:
                _send(out, nxt, groups.pp_group, act_fmt, act_seen)
            ins.append(inp)
            outs.append(out)
    if train:  # backwards in the order of the forwards: every send meets the recv waiting for it
        for m in range(n):
            with dp.no_sync() if dp is not None and m < n - 1 else nullcontext():
                if stage.last:
                    (outs[m] / n).backward()
                else:
                    outs[m].backward(_recv(outs[m].shape, nxt, groups.pp_group, grad_fmt, device))
            if not stage.first:
                _send(ins[m].grad, prev, groups.pp_group, grad_fmt, grad_seen)
            ins[m] = outs[m] = None  # free this micro-batch's activations
    loss = torch.stack(losses).mean() if stage.last else torch.zeros((), device=device)
    if groups.pp > 1:
        dist.broadcast(loss, groups.pp_ranks[-1], group=groups.pp_group)
        COMM.add("loss_broadcast", 4, 4 if stage.last else 0)
    return loss


# -----------------------------------------------------------------------------
# 7. Checkpoints


def checkpoint_suffix(groups):
    """Per-rank file tag: ranks that differ only in dp_rank hold the same tensors."""
    return f"tp{groups.tp_rank}-pp{groups.pp_rank}"


def tp_cut(key, plan):
    """How the state_dict entry `key` is cut across the TP ranks, as `plan` (tp_plan) says:
    (cut, pieces) with cut "column" (a weight's rows, or its bias) or "row" (a weight's columns),
    or (None, ()) for what every rank holds whole: a row-parallel layer's bias (added after the
    sum), norms, embeddings, the LM head, scaling buffers."""
    m = re.fullmatch(r"blocks\.\d+\.(.+)\.(weight|bias)", key)
    cut, pieces = plan.get(m[1], (None, ())) if m else (None, ())
    return (None, ()) if cut == "row" and m[2] == "bias" else (cut, pieces)


def merge_tp_state_dicts(states, config):
    """The TP ranks' state_dicts of one model (or stage) -> one state_dict with full tensors, cut
    back together as tp_plan says. FP8 scaling buffers (per shard) are taken from rank 0: a
    single-device model starts from them as from any other estimate."""
    plan, out = tp_plan(config), {}
    for k, v in states[0].items():
        cut, pieces = tp_cut(k, plan)
        shards = [s[k] for s in states]
        if cut == "column":
            out[k] = _merge_rows(shards, pieces)
        elif cut == "row":
            out[k] = torch.cat(shards, dim=1)
        else:
            out[k] = v
    return out
