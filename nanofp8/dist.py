"""
FP8 gradient communication, and data parallelism built on it.

Like fp8.py, this file is meant to be read top to bottom.

1. Why communicate in FP8
-------------------------
Data-parallel training sums every gradient over all W ranks once per step. A bandwidth-optimal
all-reduce (a ring: reduce-scatter, then all-gather) makes each rank send 2(W-1)/W * N values,
so the bytes on the wire are set by the bytes per value: 2 for BF16, 1 for FP8. Halving them
pays where bandwidth is scarce (between nodes). Inside a node, NVLink is fast enough that the
extra quantize/dequantize passes can cost more than they save; measure before you switch.

2. The catch: nobody can add FP8 numbers for you
------------------------------------------------
Stock NCCL (and gloo) have no FP8 reduction, and no collective even accepts float8 dtypes. So
FP8 payloads travel as raw bytes (tensor.view(torch.uint8)) through collectives that only move
data, never add it: all_to_all and all_gather. The adding is done by us, in fp32:

    reduce-scatter:  split the flat tensor into W chunks (chunk r belongs to rank r), quantize
                     every chunk with ITS OWN scale, all_to_all the FP8 bytes (+ the scales), and
                     let each rank dequantize the W versions of its chunk and sum them in fp32.
    all-gather:      quantize this rank's piece, all_gather bytes + scales, dequantize.
    all-reduce:      reduce-scatter, re-quantize the reduced chunk (with a scale from the amax of
                     the actual sum), all-gather it.

The scales (fp32, 4 bytes each) ride inside the same byte buffer as the payload, appended to
each chunk, so one collective carries both: one launch latency instead of two.

Because no FP8 addition ever happens, the sum cannot overflow the FP8 range, and a rank whose
gradients are tiny is measured against its own amax, not drowned by a big rank's scale. The
option `block` gives a chunk several scales (one per `block` elements, 4/block bytes of overhead
per value), so one outlier only costs precision to its own block.

MS-AMP takes the other road: one scale shared by all ranks (the min of their scales, i.e. from
the largest amax) and a patched NCCL that sums FP8 values. A shared scale pushes a small-range
rank's values into FP8's underflow, and a sum of W FP8 values can exceed the FP8 max. That is why
the FP8-LM paper needs "automatic gradient scaling": multiply gradients by a factor that is halved
whenever more than 0.001% of the values saturate (and slowly grown otherwise; MS-AMP's code never
shipped it). This design does not need it, and does not implement it: scales are per rank and
per chunk (nothing is quantized against another rank's range), the sum is fp32 (nothing
saturates while adding), and the reduced chunk is re-quantized with the amax of the sum itself
(so it cannot saturate either).

One limit remains, and no scheme escapes it: the all-reduce's output is FP8 again, so the summed
chunk must fit one format under one scale (per block). A chunk holding gradients 2^20 apart fits
E5M2 (32 binades) but not E4M3 (18): its small values flush to zero there. That is why
Fp8DataParallel gives every 128 values of one parameter their own scale: a block that small
rarely spans 18 binades, and E4M3's extra mantissa bit then wins (section 4). A reduce-scatter
alone (ZeRO) keeps the fp32 sum and loses nothing.

3. Counting bytes
-----------------
Every collective here adds what it hands over and what it puts on the wire to the counter COMM
(nanofp8/counter.py; read and reset it with comm_stats()): an FP8 all-reduce sends 0.5x the bytes
of a BF16 all-reduce, plus 4 bytes per scale (and the padding of the last chunk).

4. Data parallelism
-------------------
Fp8DataParallel wraps a model, broadcasts rank 0's parameters, and averages the gradients. Only
the weight gradients of the FP8 layers travel in FP8 (E4M3 by default), with a scale per 128
values of one parameter: every parameter is padded to whole blocks in the flat bucket, so no
scale covers two parameters. Every other gradient (embeddings, LM head, norms, biases: the
parameters that keep fp32 master weights because they are touchy) travels as the baseline does,
fp32 by default (`rest=torch.bfloat16` halves those bytes). Gradients go in buckets of about
`bucket_mb` MB, FP8 and baseline apart, one all-reduce per bucket; with overlap=True each bucket's
reduce-scatter starts during backward, as soon as its gradients are final (nanofp8/overlap.py),
and sync_gradients() sums each bucket and starts all the all-gathers before waiting for any. A
parameter without a gradient is sent as zeros: the collectives depend on the model, never on the
data.

O2 and O3 keep the FP8 layers' weight gradients outside .grad, on the weight (optim.fp8_grad).
With wgrads="all_reduce" (O2) or "reduce_scatter" (O3) the wrapper buckets them too: their FP8
bytes go out as they are, with their scales (one per 128 values: optim.quantize_wgrad), one
all_to_all per bucket. O2 then all-gathers the averages, each rank's shard cast with its own block
scales (shards hold whole blocks, held_shard_len, so no scale spans two ranks): every weight's
fp8_grad becomes the same FP8 tensor on every rank. O3 leaves each rank its fp32 shards
(take_wgrad_shards()) for ZeroFp8AdamW.step (nanofp8/zero.py). Every chunk is summed as if it
travelled alone, so the result is bit-identical to reducing after backward.

Non-finite gradients: quantize() turns inf and NaN into NaN, the fp32 sum keeps it, the re-
quantized chunk keeps it, and all_gather hands the very same bytes to every rank. So a NaN on any
rank reaches every rank through the sum itself, and every rank holds bit-identical gradients;
sync_gradients() then checks isfinite locally and all ranks get the same answer with no extra
collective. (A reduce-scatter alone, as in ZeRO, only shows the NaN to the chunk's owner: use
any_nonfinite(), a 1-element MAX all-reduce, there.)
"""

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .counter import COMM, comm_stats  # noqa: F401 (comm_stats: part of this module's interface)
from .emulate import fp8_to_float
from .fp8 import E4M3, E5M2, Fp8Format, Fp8Linear, Fp8Tensor, quantize
from .optim import fp8_grad, fp8_grad_hook, holds_fp8_grad, quantize_wgrad, set_fp8_grad, state_block
from .overlap import InOrder, Pending, plan_buckets

# torch renamed the tensor-in/tensor-out collectives (2.13 warns on the old names, older
# versions lack the new ones). Same semantics.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu)  # (E8M0: MX scales)

# -----------------------------------------------------------------------------
# 1. FP8 chunks: the unit that travels


@dataclass
class Fp8Chunks:
    """A flat tensor in FP8, cut in rows (chunks: one per destination or source rank), each row
    with its scales: what one collective moves.

    data  (R, C) FP8; the values of a row past `cols` are padding up to a multiple of the block
    scale (R, C // block) fp32 (or E8M0: MX's scales), multiply-before-cast: one per `block` values of a row
    """

    data: torch.Tensor
    scale: torch.Tensor
    cols: int

    def dequantize(self, dtype=torch.float32):
        """(R, cols) in `dtype`: every value times the inverse of its block's scale."""
        rows, c = self.data.shape
        nb = self.scale.shape[1]
        x = self.data.float().reshape(rows, nb, c // nb) * self.scale.float().reciprocal().view(rows, nb, 1)
        return x.view(rows, c)[:, : self.cols].to(dtype)

    def to_bytes(self):
        """One uint8 buffer (R, C + 4 * scales per row; 1 * for E8M0): each row's FP8 bytes followed
        by the raw bytes of its scales, so payload and scales travel in a single collective."""
        return torch.cat([self.data.view(torch.uint8), self.scale.contiguous().view(torch.uint8)], dim=1)

    @staticmethod
    def from_bytes(buf, c, cols, dtype, scale_dtype=torch.float32):
        """The inverse of to_bytes, for a buffer whose rows hold c FP8 bytes, then the scales."""
        return Fp8Chunks(buf[:, :c].view(dtype), buf[:, c:].contiguous().view(scale_dtype), cols)


def quantize_chunks(x2, fmt, block=None, observe=None):
    """Quantize each row of x2 (R, n) with its own scale (block=None) or one scale per `block`
    values (the row is zero-padded to a multiple of `block`). Uses fp8.quantize, so scales are
    computed in float64, casts saturate, and inf/NaN become NaN. observe(source, Fp8Tensor), if
    given, sees the cast (a statistics step: nanofp8/stats.py)."""
    rows, n = x2.shape
    b = n if block is None else block
    c = -(-n // b) * b
    src = F.pad(x2, (0, c - n)).reshape(-1, b)
    q = quantize(src, fmt, granularity="row")
    if observe is not None:
        observe(src, q)
    return Fp8Chunks(q.data.view(rows, c), q.scale.view(rows, c // b), n)


def observed(mod, operand):
    """An observe for quantize_chunks: on a statistics step (mod.observer set, nanofp8/stats.py)
    it records the cast as mod's `operand`; otherwise None."""
    observer = getattr(mod, "observer", None)
    return None if observer is None else (lambda src, q: observer.observe(mod, operand, src, q))


def shard_len(numel, world, block=None):
    """Length of each rank's chunk when a flat tensor of `numel` values is reduce-scattered:
    ceil(numel / world), rounded up to a multiple of `block`. The flat tensor is zero-padded
    to world * shard_len; rank r owns values [r * shard_len, (r + 1) * shard_len)."""
    c = -(-numel // world)
    return c if block is None else -(-c // block) * block


def _check(x, op="sum"):
    if op not in ("sum", "mean"):
        raise ValueError(f"op must be 'sum' or 'mean', not {op!r}")
    if x.numel() == 0:
        raise ValueError("cannot communicate an empty tensor")
    if x.dtype.is_floating_point and x.element_size() == 1:
        raise ValueError("pass a high-precision tensor (or Fp8Chunks): FP8 input would be re-quantized")


# -----------------------------------------------------------------------------
# 2. FP8 collectives


def reduce_scatter_fp8(x, group=None, fmt=E5M2, block=None, op="sum", out_dtype=None,
                       async_op=False, observe=None):
    """Sum (op="sum") or average (op="mean") x over the ranks of `group`; return this rank's
    chunk of the flattened result: shard_len(x.numel(), W, block) values (the zero padding of
    the last chunks included), in out_dtype (default x.dtype).

    Each rank quantizes every destination chunk with its own scale(s), one all_to_all_single
    moves the FP8 bytes and scales, and each rank sums the W dequantized versions of its chunk
    in fp32. async_op=True returns a Pending. observe: see quantize_chunks.

    x may already be quantized: Fp8Chunks with one row per rank (e.g. an FP8 gradient kept with
    its block scales), sent as they are (fp32 result); or a list of them (of one dtype: the held
    FP8 gradients of a bucket of layers), all in ONE all_to_all (row r of the send buffer holds,
    tensor after tensor, the bytes and scales addressed to rank r), returning the list of this
    rank's chunks, each the same bits as if it travelled alone."""
    world = dist.get_world_size(group)
    if op not in ("sum", "mean"):
        raise ValueError(f"op must be 'sum' or 'mean', not {op!r}")
    many = isinstance(x, list)
    if many or isinstance(x, Fp8Chunks):
        qs, out_dtype = (x if many else [x]), out_dtype or torch.float32
        if not qs or any(q.data.shape[0] != world or q.data.dtype != qs[0].data.dtype for q in qs):
            raise ValueError(f"need Fp8Chunks of one dtype with one row per rank ({world})")
    else:
        _check(x, op)
        n = x.numel()
        c = shard_len(n, world, block)
        qs = [quantize_chunks(F.pad(x.detach().reshape(-1), (0, world * c - n)).view(world, c), fmt, block, observe)]
    packed = [q.to_bytes() for q in qs]
    send = torch.cat(packed, dim=1) if many else packed[0]  # row r: the chunks for rank r
    recv = torch.empty_like(send)  # row r: my chunks, as rank r quantized them
    work = dist.all_to_all_single(recv, send, group=group, async_op=async_op)
    COMM.add("reduce_scatter_fp8", send.nbytes, send.nbytes * (world - 1) / world, qs[0].data.dtype,
             sum(q.scale.nbytes for q in qs))

    def finish():
        out, lo = [], 0
        for q, b in zip(qs, packed):
            piece = recv[:, lo : lo + b.shape[1]].contiguous() if many else recv
            lo += b.shape[1]
            piece = Fp8Chunks.from_bytes(piece, q.data.shape[1], q.cols, q.data.dtype, q.scale.dtype)
            total = piece.dequantize().sum(0)
            out.append((total / world if op == "mean" else total).to(out_dtype or x.dtype))
        return out if many else out[0]

    return Pending(work, finish) if async_op else finish()


def all_gather_fp8(x, group=None, fmt=E4M3, block=None, numel=None, shape=None, out_dtype=None,
                   keep_fp8=False, async_op=False):
    """Gather every rank's x (same numel everywhere) and return them concatenated, flat,
    dequantized to out_dtype (default x.dtype, or fp32 for Fp8Chunks input); cut to the first
    `numel` values and reshaped to `shape` if given.

    x may already be quantized (Fp8Chunks): its bytes are sent as they are, so a weight kept in
    FP8 is gathered without a second rounding. keep_fp8=True returns the gathered Fp8Chunks (one
    row per rank) instead, for callers that want to use the FP8 values without dequantizing."""
    if isinstance(x, Fp8Chunks):
        q, dtype = x, out_dtype or torch.float32
    else:
        _check(x)
        q, dtype = quantize_chunks(x.detach().reshape(1, -1), fmt, block), out_dtype or x.dtype
    world = dist.get_world_size(group)
    send = q.to_bytes()
    recv = send.new_empty((world * send.shape[0], send.shape[1]))
    work = _all_gather(recv, send, group=group, async_op=async_op)
    COMM.add("all_gather_fp8", send.nbytes, send.nbytes * (world - 1), q.data.dtype, q.scale.nbytes)

    def finish():
        got = Fp8Chunks.from_bytes(recv, q.data.shape[1], q.cols, q.data.dtype, q.scale.dtype)
        if keep_fp8:
            return got
        out = got.dequantize(dtype).reshape(-1)[:numel]
        return out if shape is None else out.view(shape)

    return Pending(work, finish) if async_op else finish()


def all_reduce_fp8(x, group=None, fmt=E5M2, block=None, op="sum", out_dtype=None,
                   async_op=False, observe=None):
    """Sum or average x over the ranks (op "sum" | "mean"), communicating in FP8: reduce-scatter,
    re-quantize the reduced chunk, all-gather. Every rank gets the same bits, of x's shape and
    out_dtype (default x.dtype). async_op=True returns a Pending (two stages). observe: sees
    the first cast (quantize_chunks)."""
    rs = reduce_scatter_fp8(x, group, fmt, block, op, torch.float32, async_op=async_op, observe=observe)

    def gather(shard):
        # All ranks, the owner included, use the dequantized gathered chunk: keeping the owner's
        # fp32 sum would make its copy differ from everyone else's.
        return all_gather_fp8(quantize_chunks(shard.view(1, -1), fmt, block), group, numel=x.numel(),
                              shape=x.shape, out_dtype=out_dtype or x.dtype, async_op=async_op)

    return Pending(None, lambda: gather(rs.wait())) if async_op else gather(rs)


# -----------------------------------------------------------------------------
# 3. Plain baselines (same counter), and small helpers


def all_reduce_plain(x, group=None, dtype=torch.bfloat16, op="sum", out_dtype=None,
                     async_op=False):
    """The baseline: x cast to `dtype` (bf16 or fp32) and summed by dist.all_reduce."""
    _check(x, op)
    world = dist.get_world_size(group)
    buf = x.detach().to(dtype, copy=True)  # never reduce into the caller's tensor
    work = dist.all_reduce(buf, group=group, async_op=async_op)
    COMM.add(f"all_reduce_{str(dtype).split('.')[-1]}", buf.nbytes, buf.nbytes * 2 * (world - 1) / world, dtype)

    def finish():
        out = buf.float() / world if op == "mean" else buf
        return out.to(out_dtype or x.dtype)

    return Pending(work, finish) if async_op else finish()


def reduce_scatter_plain(x, group=None, dtype=torch.bfloat16, op="sum", out_dtype=None,
                         async_op=False):
    """The baseline reduce-scatter, with the chunking of reduce_scatter_fp8 (block=None)."""
    _check(x, op)
    world, n = dist.get_world_size(group), x.numel()
    c = shard_len(n, world)
    buf = F.pad(x.detach().reshape(-1).to(dtype), (0, world * c - n))
    out = buf.new_empty(c)
    work = _reduce_scatter(out, buf, group=group, async_op=async_op)
    COMM.add(f"reduce_scatter_{str(dtype).split('.')[-1]}", buf.nbytes, buf.nbytes * (world - 1) / world, dtype)

    def finish():
        res = out.float() / world if op == "mean" else out
        return res.to(out_dtype or x.dtype)

    return Pending(work, finish) if async_op else finish()


def all_gather_plain(x, group=None, dtype=torch.bfloat16, numel=None, shape=None, out_dtype=None,
                     async_op=False):
    """The baseline all-gather: x cast to `dtype`, concatenated over ranks, flat."""
    world = dist.get_world_size(group)
    buf = x.detach().reshape(-1).to(dtype)
    out = buf.new_empty(world * buf.numel())
    work = _all_gather(out, buf, group=group, async_op=async_op)
    COMM.add(f"all_gather_{str(dtype).split('.')[-1]}", buf.nbytes, buf.nbytes * (world - 1), dtype)

    def finish():
        res = out[:numel].to(out_dtype or x.dtype)
        return res if shape is None else res.view(shape)

    return Pending(work, finish) if async_op else finish()


def any_nonfinite(tensors, group=None):
    """1.0 on every rank if any rank has an inf or NaN in `tensors`, else 0.0: a 0-dim device
    tensor (not read: no device sync), from one 4-byte MAX all-reduce. Needed where ranks hold
    different data after communication (ZeRO's reduce-scatter)."""
    tensors = list(tensors)
    flag = torch.zeros((), device=tensors[0].device if tensors else "cpu")
    for t in tensors:
        flag = torch.maximum(flag, (~torch.isfinite(t)).any().float())
    flag = flag.reshape(1)
    world = dist.get_world_size(group)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    COMM.add("any_nonfinite", 4, 4 * 2 * (world - 1) / world)
    return flag.reshape(())


def broadcast_parameters(module, group=None, src=0):
    """Copy the parameters and buffers of group rank `src` to every rank of the group."""
    root = dist.get_global_rank(group or dist.group.WORLD, src)
    me = dist.get_rank(group)
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            data = t.data.view(torch.uint8) if t.dtype in FP8_DTYPES else t.data  # (no FP8 in c10d)
            dist.broadcast(data, src=root, group=group)
            COMM.add("broadcast", t.nbytes, t.nbytes if me == src else 0, t.dtype)


# -----------------------------------------------------------------------------
# 4. The FP8 gradients that O2/O3 weights hold outside .grad


def held_shard_len(p, world):
    """Values per rank of the shards of weight p's held FP8 gradient and of its O3 state: the
    shard length (shard_len) rounded up to whole blocks of the gradient's scales (optim.state_block),
    so that every block, and its scale, lies in one rank's shard."""
    return shard_len(p.numel(), world, state_block(p.numel()))


def held_grad_chunks(p, world):
    """The FP8 gradient weight p holds (optim.quantize_wgrad's form: one scale per block; or one
    tensor scale), or zeros where this rank has none (every rank sends the same bytes), as
    Fp8Chunks of one shard of held_shard_len values per rank, without re-quantizing: its bytes,
    zero-padded, and its block scales (padded with ones), or its scale repeated per row."""
    q = fp8_grad(p)
    if q is None:
        q = quantize_wgrad(torch.zeros(p.shape, device=p.device))
    c = held_shard_len(p, world)
    flat = q.data.reshape(-1).view(torch.uint8)
    n = flat.numel()
    flat = F.pad(flat, (0, world * c - n)).view(q.data.dtype).view(world, c)
    if q.scale.numel() == 1:
        return Fp8Chunks(flat, q.scale.reshape(1, 1).expand(world, 1).contiguous(), c)
    b = n // q.scale.numel()
    scale = F.pad(q.scale.reshape(-1), (0, world * c // b - q.scale.numel()), value=1.0)
    return Fp8Chunks(flat, scale.view(world, c // b), c)


def gather_wgrads(params, shards, group=None):
    """O2's second half: each rank casts its averaged fp32 shard to E4M3 with one scale per
    block (blocks lie within shards: held_shard_len), and the bytes and scales are all-gathered;
    each weight's fp8_grad becomes the same FP8 tensor on every rank, the very one quantize_wgrad
    makes of the whole average."""
    pending = [all_gather_fp8(quantize_chunks(s.view(1, -1), E4M3, state_block(p.numel())), group,
                              keep_fp8=True, async_op=True) for p, s in zip(params, shards)]
    for p, pd in zip(params, pending):
        got, b = pd.wait(), state_block(p.numel())
        data = got.data.reshape(-1)[: p.numel()].view(-1, b)
        scale = got.scale.reshape(-1)[: len(data)].reshape(-1, 1)
        amax = fp8_to_float(data).abs().amax(1, keepdim=True) / scale  # NaN where a NaN came through
        set_fp8_grad(p, Fp8Tensor(data, scale, E4M3, "row", (1, b), p.shape, torch.float32, amax))


# -----------------------------------------------------------------------------
# 5. Data parallelism with FP8 gradient all-reduce


def fp8_weights(module):
    """The weights whose gradients come out of an FP8 GEMM (the Fp8Linear layers of `module`):
    the only gradients that Fp8DataParallel sends in FP8."""
    return [m.weight for m in module.modules() if isinstance(m, Fp8Linear)]


WGRADS = (None, "all_reduce", "reduce_scatter")


class Fp8DataParallel(nn.Module):
    """Data parallelism whose all-reduce sends the weight gradients of FP8 layers in FP8 (per-rank
    scales, one per `block` values of one parameter) and every other gradient as the baseline.

        model = Fp8DataParallel(model)            # broadcasts rank 0's parameters
        loss = loss_fn(model(x), y); loss.backward()
        if model.sync_gradients():                # averages gradients; False if any is inf/NaN
            opt.step()                            # (the same answer on every rank)
        opt.zero_grad()

    fmt: E4M3 | E5M2 | torch.bfloat16 | torch.float32, for the gradients of `fp8_params`
    (default: fp8_weights(module)); rest: torch.float32 | torch.bfloat16, for every other
    gradient (embeddings, LM head, norms and biases are sensitive: fp32 master weights, and
    gradients). block: values per scale in the FP8 buckets (each parameter padded to a multiple).
    overlap: launch each bucket from gradient hooks during backward (nanofp8/overlap.py): change
    gradients (clipping, ...) only after sync_gradients(); accumulate in no_sync().
    wgrads: the FP8 weight gradients that O2/O3 weights hold outside .grad (module docstring,
    section 4). None: the caller reduces them (zero.sync_fp8_wgrads, ZeroFp8AdamW.step);
    "all_reduce" (O2): every weight's fp8_grad ends the same FP8 average on every rank;
    "reduce_scatter" (O3): take_wgrad_shards() then hands over {weight: averaged fp32 shard} for
    ZeroFp8AdamW.step(shards=...). Bit-identical to reducing after backward (tests/test_comm.py).
    late: parameters whose gradient still changes between backward and sync_gradients() (model
    parallelism sums some first): no hook, buckets of their own, launched by sync_gradients().
    observer: FP8 statistics (nanofp8/stats.py) see each bucket's cast, as operand "grad".

    Why E4M3 by default: with a scale per 128 values from the block's own amax, range is no
    longer the constraint (a block rarely spans more than E4M3's 18 binades), and the sum is fp32;
    E4M3's extra mantissa bit is worth about 6 dB on a small GPT's gradients (tests/test_comm.py
    measures both and holds E4M3 at least 3 dB ahead).
    """

    observer, fqn = None, "data_parallel"

    def __init__(self, module, group=None, fmt=E4M3, bucket_mb=25.0, block=128, overlap=True,
                 broadcast=True, params=None, rest=torch.float32, fp8_params=None, wgrads=None,
                 late=()):
        super().__init__()
        if not isinstance(fmt, Fp8Format) and fmt not in (torch.bfloat16, torch.float32):
            raise ValueError(f"fmt must be E4M3, E5M2, torch.bfloat16 or torch.float32, not {fmt}")
        if rest not in (torch.bfloat16, torch.float32):
            raise ValueError(f"rest must be torch.float32 or torch.bfloat16, not {rest}")
        if block is None or block < 1:
            raise ValueError(f"block must be a positive number of values per scale, not {block}")
        if wgrads not in WGRADS:
            raise ValueError(f"wgrads must be one of {WGRADS}, not {wgrads!r}")
        self.module, self.group, self.fmt, self.rest, self.block = module, group, fmt, rest, block
        self.wgrads, self.wgrad_shards = wgrads, {}
        # The weights whose FP8 gradient is held outside .grad, if this wrapper reduces them.
        self.held = [p for p in module.parameters() if holds_fp8_grad(p)] if wgrads else []
        if wgrads and not self.held:
            raise ValueError(f"wgrads={wgrads!r}, but the module has no O2/O3 layer (convert_to_o2/o3)")
        o3 = [p.element_size() == 1 for p in self.held]  # O3 stores the weight itself in FP8
        if wgrads == "reduce_scatter" and not all(o3) or wgrads == "all_reduce" and any(o3):
            raise ValueError(f"wgrads={wgrads!r} does not fit these layers: 'all_reduce' is for "
                             "O2Linear (O2), 'reduce_scatter' for O3Linear (O3, ZeroFp8AdamW)")
        held = {id(p) for p in self.held}
        # params: the parameters whose .grad this wrapper averages (default: all that need a
        # gradient). O2/O3 weights keep their gradient in FP8 outside .grad and are excluded.
        if params is None:
            params = [p for p in module.parameters() if id(p) not in held]
        elif any(id(p) in held for p in params):
            raise ValueError("params holds the weight of an O2/O3 layer, whose gradient is not in "
                             ".grad: leave it out (wgrads= reduces it)")
        params = [p for p in params if p.requires_grad]
        fp8 = {id(p) for p in (fp8_params if fp8_params is not None else fp8_weights(module))}
        late = {id(p) for p in late}
        self.buckets = plan_buckets(module, params, self.held, fp8, late,
                                    {"held": E4M3, "fp8": fmt, "rest": rest}, block, bucket_mb * 2**20)
        self.launcher = InOrder(self.buckets, self._launch)
        self.on_launch = None  # a callable(bucket index), for tests that record the event order
        if overlap:
            for p in params:
                if id(p) not in late:
                    p.register_post_accumulate_grad_hook(self.launcher.ready)
            for p in self.held:
                fp8_grad_hook(p, self.launcher.ready)
        if broadcast:
            self.broadcast_parameters()

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def broadcast_parameters(self, src=0):
        broadcast_parameters(self.module, self.group, src)

    @contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients locally, launching no communication."""
        self.launcher.enabled = False
        try:
            yield
        finally:
            self.launcher.enabled = True

    @torch.no_grad()
    def _launch(self, index, bucket):
        """Start the reduction of one bucket: what travels, and how."""
        if self.on_launch is not None:
            self.on_launch(index)
        world = dist.get_world_size(self.group)
        if bucket.held:
            # Held FP8 gradients: their bytes go out as they are (reading fp8_grad ends an fp16
            # accumulation of micro-steps with its one E4M3 cast), reduce-scattered to the owner
            # of each shard; O2 all-gathers the averages in sync_gradients().
            chunks = [held_grad_chunks(p, world) for p in bucket.params]
            bucket.pending = reduce_scatter_fp8(chunks, self.group, op="mean", async_op=True)
            return
        # A missing gradient counts as zero: the bytes sent never depend on local data.
        flat = torch.cat([F.pad((p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float(),
                                (0, n - p.numel())) for p, n in zip(bucket.params, bucket.spans)])
        if isinstance(bucket.fmt, Fp8Format):
            bucket.pending = all_reduce_fp8(flat, self.group, bucket.fmt, bucket.block, op="mean", async_op=True,
                                            observe=observed(self, "grad"))
        else:
            bucket.pending = all_reduce_plain(flat, self.group, bucket.fmt, op="mean", async_op=True)

    def take_wgrad_shards(self):
        """wgrads="reduce_scatter": this rank's averaged shards of the held FP8 gradients from the
        last sync_gradients(), {weight: fp32 shard}, handed over once (the wrapper keeps no
        reference, so they are freed with the optimizer step that reads them)."""
        if self.wgrads != "reduce_scatter" or not self.wgrad_shards:
            raise RuntimeError("no gradient shards to hand over: they come from sync_gradients() "
                               "of a wrapper with wgrads='reduce_scatter', once per step")
        shards, self.wgrad_shards = self.wgrad_shards, {}
        return shards

    @torch.no_grad()
    def sync_gradients(self):
        """Average the gradients over the ranks (what the hooks did not launch yet is launched
        now). Returns whether every gradient is finite, the same on every rank (see the module
        docstring), as a 0-dim bool tensor on the device: not read here, so a caller can read it
        together with other values in one device-to-host copy. A parameter without a gradient
        counts as zero and gets the average. wgrads="reduce_scatter": the held shards are not
        judged here (a rank sees only its own): ZeroFp8AdamW.step asks every rank with one flag."""
        self.launcher.launch_rest()
        for b in self.buckets:  # finish every reduce-scatter, start every all-gather...
            b.pending.advance()
        finite = []
        shards = {id(p): s for b in self.buckets if b.held for p, s in zip(b.params, b.pending.wait())}
        if self.wgrads == "all_reduce":  # (the all-gathers of the held gradients' averages)
            gather_wgrads(self.held, [shards[id(p)] for p in self.held], self.group)
            finite += [torch.isfinite(fp8_grad(p).amax).all() for p in self.held]
        if self.wgrads == "reduce_scatter":
            self.wgrad_shards = {p: shards[id(p)] for p in self.held}
        for b in self.buckets:  # ...then wait for them
            if not b.held:
                flat, offset = b.pending.wait(), 0
                finite.append(torch.isfinite(flat).all())
                for p, n in zip(b.params, b.spans):
                    g = flat[offset : offset + p.numel()].view_as(p)
                    offset += n
                    if p.grad is None:
                        p.grad = g.to(p.dtype, copy=True)
                    else:
                        p.grad.copy_(g)
        self.launcher.reset()
        return torch.stack(finite).all() if finite else torch.ones((), dtype=torch.bool)
