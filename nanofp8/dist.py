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
Every collective here adds to the module-level counter COMM (read and reset it with
comm_stats()):
    bytes_in    the bytes this rank hands to collectives: payload + scales (+ padding);
    bytes_sent  the bytes this rank puts on the wire under the bandwidth-optimal algorithm:
                all_to_all (W-1)/W of its input (the part addressed to others), all_gather
                (W-1) x its input (a ring forwards every other rank's piece once), all_reduce
                2(W-1)/W, reduce_scatter (W-1)/W, broadcast: the root sends its input once.
                This is the number to compare: an FP8 all-reduce sends 0.5x the bytes of a
                BF16 all-reduce, plus 4 bytes per scale (and the padding of the last chunk).
    by_dtype    bytes_sent split by what the bytes are: "float8_e4m3fn" / "float8_e5m2"
                payloads, their "float32" scales, "bfloat16" / "float32" baselines. Tests read
                it to check that a precision level sends exactly what its name says.

4. Data parallelism
-------------------
Fp8DataParallel wraps a model, broadcasts rank 0's parameters, and all-reduces (averages) the
gradients. Only the weight gradients of the FP8 layers travel in FP8 (E4M3 by default), with a
scale per 128 values of one parameter: every parameter is padded to whole blocks in the flat
bucket, so no scale covers two parameters. Every other gradient (embeddings, LM head, norms,
biases: the parameters that keep fp32 master weights because they are touchy) travels as the
baseline does, fp32 by default (`rest=torch.bfloat16` halves those bytes). Gradients are
flattened into buckets of about `bucket_mb` MB, FP8 and baseline apart, one all-reduce per
bucket. With overlap=True a hook on each parameter notices when its gradient is final; when a
whole bucket is ready, its reduce-scatter is launched asynchronously while backward goes on
computing earlier layers. sync_gradients() then sums each bucket and starts all the all-gathers
before waiting for any. The buckets are launched in one fixed order, and a parameter without a
gradient is sent as zeros: the sequence of collectives depends on the model, never on the data.

O2 and O3 keep the FP8 layers' weight gradients outside .grad, on the weight (optim.fp8_grad),
where autograd's hooks never see them. With wgrads="all_reduce" (O2) or "reduce_scatter" (O3) the
wrapper buckets them too, and each weight's "weight gradient ready" hook (optim.fp8_grad_hook,
called by O2Linear.take_wgrad) marks its gradient final: a full bucket's reduce-scatter (the FP8
bytes as they are, with their scales, one per 128 values: optim.quantize_wgrad; one all_to_all
per bucket) leaves while backward goes on. Only the last micro-step's backward launches
(no_sync() before it), so reading fp8_grad there ends the fp16 sum of the micro-steps with the
very E4M3 cast a read after backward would make. sync_gradients() then finishes: O2 all-gathers
the averages, each rank's shard cast with its own block scales (the gradient is FP8 again, the
same on every rank, and its finiteness is in the verdict; shards hold whole blocks,
held_shard_len, so no scale spans two ranks); O3 leaves each rank its fp32 shards
(take_wgrad_shards()) for ZeroFp8AdamW.step, which clips by the global norm and agrees on
finiteness with one flag. Every chunk is summed as if it travelled alone, so the result is
bit-identical to reducing after backward (sync_fp8_wgrads, or the optimizer's own reduce-scatter).

Non-finite gradients: quantize() turns inf and NaN into NaN, the fp32 sum keeps it, the re-
quantized chunk keeps it, and all_gather hands the very same bytes to every rank. So a NaN on any
rank reaches every rank through the sum itself, and every rank holds bit-identical gradients;
sync_gradients() then checks isfinite locally and all ranks get the same answer with no extra
collective. (A reduce-scatter alone, as in ZeRO, only shows the NaN to the chunk's owner: use
any_nonfinite(), a 1-element MAX all-reduce, there.)
"""

import math
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .emulate import fp8_to_float
from .fp8 import BLOCK, E4M3, E5M2, Fp8Format, Fp8Tensor, compute_scale, dequantize, quantize
from .optim import (Fp8AdamW, O2Linear, convert_to_o2, dequantize_stored_all, fp8_grad, fp8_grad_hook,
                    holds_fp8_grad, quantize_wgrad, set_fp8_grad, state_block, step_chunks, stored, to_fp16_scaled,
                    to_fp16_scaled_all)

# torch renamed the tensor-in/tensor-out collectives (2.13 warns on the old names, older
# versions lack the new ones). Same semantics.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# -----------------------------------------------------------------------------
# 1. The byte counter


@dataclass
class CommCounter:
    calls: int = 0
    bytes_in: int = 0  # handed to collectives by this rank (payload + scales + padding)
    bytes_sent: int = 0  # put on the wire by this rank (bandwidth-optimal algorithm)
    by_op: dict = field(default_factory=dict)  # op name -> {"calls", "bytes_in", "bytes_sent"}
    by_dtype: dict = field(default_factory=dict)  # dtype name -> bytes_sent

    def add(self, op, bytes_in, bytes_sent, dtype=torch.float32, scale_bytes=0):
        """Count one collective. dtype: what its payload is; scale_bytes: how many of bytes_in
        are fp32 scales riding along (an FP8 buffer), counted as float32."""
        bytes_sent = int(round(bytes_sent))
        scales = int(round(bytes_sent * scale_bytes / bytes_in)) if bytes_in else 0
        for name, n in ((str(dtype).split(".")[-1], bytes_sent - scales), ("float32", scales)):
            if n:
                self.by_dtype[name] = self.by_dtype.get(name, 0) + n
        self.calls += 1
        self.bytes_in += bytes_in
        self.bytes_sent += bytes_sent
        entry = self.by_op.setdefault(op, {"calls": 0, "bytes_in": 0, "bytes_sent": 0})
        entry["calls"] += 1
        entry["bytes_in"] += bytes_in
        entry["bytes_sent"] += bytes_sent

    def reset(self):
        self.calls = self.bytes_in = self.bytes_sent = 0
        self.by_op, self.by_dtype = {}, {}


COMM = CommCounter()


def comm_stats(reset=False):
    """A snapshot of COMM as a dict (calls, bytes_in, bytes_sent, by_op); reset=True zeroes it."""
    snap = {"calls": COMM.calls, "bytes_in": COMM.bytes_in, "bytes_sent": COMM.bytes_sent,
            "by_op": {k: dict(v) for k, v in COMM.by_op.items()}, "by_dtype": dict(COMM.by_dtype)}
    if reset:
        COMM.reset()
    return snap


def _nbytes(t):
    return t.numel() * t.element_size()


# -----------------------------------------------------------------------------
# 2. FP8 rows: the unit that travels


@dataclass
class Fp8Rows:
    """A flat tensor in FP8, cut in rows (one row per destination or source rank).

    data  (R, C) FP8; the values of a row past `cols` are padding up to a multiple of `block`
    scale (R, C // block) fp32, multiply-before-cast: one per `block` values of a row
    """

    data: torch.Tensor
    scale: torch.Tensor
    cols: int

    def dequantize(self, dtype=torch.float32):
        """(R, cols) in `dtype`: every value times the inverse of its block's scale."""
        rows, c = self.data.shape
        nb = self.scale.shape[1]
        x = self.data.float().reshape(rows, nb, c // nb) * self.scale.reciprocal().view(rows, nb, 1)
        return x.view(rows, c)[:, : self.cols].to(dtype)


def quantize_rows(x2, fmt, block=None):
    """Quantize each row of x2 (R, n) with its own scale (block=None) or one scale per `block`
    values (the row is zero-padded to a multiple of `block`). Uses fp8.quantize, so scales are
    computed in float64, casts saturate, and inf/NaN become NaN."""
    rows, n = x2.shape
    b = n if block is None else block
    c = -(-n // b) * b
    x2 = F.pad(x2, (0, c - n))
    q = quantize(x2.reshape(-1, b), fmt, granularity="row")
    return Fp8Rows(q.data.view(rows, c), q.scale.view(rows, c // b), n)


def pack_rows(q):
    """Fp8Rows -> one uint8 buffer (R, C + 4 * scales per row): each row's FP8 bytes followed by
    the raw bytes of its fp32 scales, so payload and scales travel in a single collective."""
    return torch.cat([q.data.view(torch.uint8), q.scale.contiguous().view(torch.uint8)], dim=1)


def unpack_rows(buf, c, cols, dtype):
    """The inverse of pack_rows for a buffer whose rows hold c FP8 bytes, then the scales."""
    return Fp8Rows(buf[:, :c].view(dtype), buf[:, c:].contiguous().view(torch.float32), cols)


def shard_len(numel, world, block=None):
    """Length of each rank's chunk when a flat tensor of `numel` values is reduce-scattered:
    ceil(numel / world), rounded up to a multiple of `block`. The flat tensor is zero-padded
    to world * shard_len; rank r owns values [r * shard_len, (r + 1) * shard_len)."""
    c = -(-numel // world)
    return c if block is None else -(-c // block) * block


# -----------------------------------------------------------------------------
# 3. Handles for work in flight


class Pending:
    """A collective in flight. wait() blocks until it is done and returns the result.

    A stage is (work, finish): once `work` completes, finish() computes the result, or launches
    the next collective and returns its Pending (an all-reduce is a reduce-scatter, then an
    all-gather). advance() completes one stage without waiting for the next, so a caller can
    start the all-gathers of many buckets before waiting for any of them."""

    def __init__(self, work, finish):
        self.work, self.finish = work, finish
        self.done, self.result = False, None

    def advance(self):
        if not self.done:
            if self.work is not None:
                self.work.wait()
            out = self.finish()
            if isinstance(out, Pending):
                self.work, self.finish = out.work, out.finish  # wait for it on the next call
                self.done, self.result = out.done, out.result
            else:
                self.done, self.result = True, out
        return self

    def wait(self):
        while not self.done:
            self.advance()
        return self.result


def _finish(pending, async_op):
    return pending if async_op else pending.wait()


def _world(group):
    return dist.get_world_size(group)


def _check(x, op="sum"):
    if op not in ("sum", "mean"):
        raise ValueError(f"op must be 'sum' or 'mean', not {op!r}")
    if x.numel() == 0:
        raise ValueError("cannot communicate an empty tensor")
    if x.dtype.is_floating_point and x.element_size() == 1:
        raise ValueError("pass a high-precision tensor (or Fp8Rows): FP8 input would be re-quantized")


# -----------------------------------------------------------------------------
# 4. FP8 collectives


def reduce_scatter_fp8(x, group=None, fmt=E5M2, block=None, op="sum", out_dtype=None,
                       async_op=False):
    """Sum (op="sum") or average (op="mean") x over the ranks of `group`; return this rank's
    chunk of the flattened result: shard_len(x.numel(), W, block) values (the zero padding of
    the last chunks included), in out_dtype (default x.dtype).

    Each rank quantizes every destination chunk with its own scale(s), one all_to_all_single
    moves the FP8 bytes and scales, and each rank sums the W dequantized versions of its chunk
    in fp32. async_op=True returns a Pending.

    x may already be quantized: an Fp8Rows with one row per rank (e.g. an FP8 gradient kept
    with one tensor scale, repeated per row). Its bytes are sent as they are (fp32 result)."""
    world = _world(group)
    if isinstance(x, Fp8Rows):
        if x.data.shape[0] != world or op not in ("sum", "mean"):
            raise ValueError(f"need one row per rank ({world}) and op 'sum' or 'mean'")
        q, c, out_dtype = x, x.data.shape[1], out_dtype or torch.float32
    else:
        _check(x, op)
        n = x.numel()
        c = shard_len(n, world, block)
        flat = F.pad(x.detach().reshape(-1), (0, world * c - n))
        q = quantize_rows(flat.view(world, c), fmt, block)  # row r: the chunk for rank r
    send = pack_rows(q)
    recv = torch.empty_like(send)  # row r: my chunk, as rank r quantized it
    work = dist.all_to_all_single(recv, send, group=group, async_op=True)
    COMM.add("reduce_scatter_fp8", _nbytes(send), _nbytes(send) * (world - 1) / world,
             q.data.dtype, _nbytes(q.scale))

    def finish():
        total = unpack_rows(recv, c, q.cols, q.data.dtype).dequantize().sum(0)  # the fp32 sum
        if op == "mean":
            total = total / world
        return total.to(out_dtype or x.dtype)

    return _finish(Pending(work, finish), async_op)


def reduce_scatter_fp8_rows(rows, group=None, op="sum", async_op=False):
    """reduce_scatter_fp8 of several tensors already in FP8 (a list of Fp8Rows of one dtype, one
    row per rank: the held FP8 weight gradients of a bucket of layers) in ONE all_to_all: row r
    of the send buffer holds, tensor after tensor, the bytes and scales addressed to rank r.
    Returns the list of this rank's fp32 chunks, each computed exactly as reduce_scatter_fp8
    computes it for that tensor alone (the same bits: a bucket changes the launches, not the sum).
    async_op=True returns a Pending."""
    world = _world(group)
    if not rows or any(q.data.shape[0] != world or q.data.dtype != rows[0].data.dtype for q in rows):
        raise ValueError(f"need Fp8Rows of one dtype with one row per rank ({world})")
    if op not in ("sum", "mean"):
        raise ValueError(f"op must be 'sum' or 'mean', not {op!r}")
    packed = [pack_rows(q) for q in rows]
    send = torch.cat(packed, dim=1)
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv, send, group=group, async_op=True)
    COMM.add("reduce_scatter_fp8", _nbytes(send), _nbytes(send) * (world - 1) / world,
             rows[0].data.dtype, sum(_nbytes(q.scale) for q in rows))

    def finish():
        out, lo = [], 0
        for q, b in zip(rows, packed):
            piece = recv[:, lo : lo + b.shape[1]].contiguous()
            lo += b.shape[1]
            total = unpack_rows(piece, q.data.shape[1], q.cols, q.data.dtype).dequantize().sum(0)
            out.append((total / world if op == "mean" else total).to(torch.float32))
        return out

    return _finish(Pending(work, finish), async_op)


def all_gather_fp8(x, group=None, fmt=E4M3, block=None, numel=None, shape=None, out_dtype=None,
                   keep_fp8=False, async_op=False):
    """Gather every rank's x (same numel everywhere) and return them concatenated, flat,
    dequantized to out_dtype (default x.dtype, or fp32 for Fp8Rows input); cut to the first
    `numel` values and reshaped to `shape` if given.

    x may already be quantized (an Fp8Rows): its bytes are sent as they are, so a weight kept in
    FP8 is gathered without a second rounding. keep_fp8=True returns the gathered Fp8Rows (one
    row per rank) instead, for callers that want to use the FP8 values without dequantizing."""
    if isinstance(x, Fp8Rows):
        q, dtype = x, out_dtype or torch.float32
    else:
        _check(x)
        q, dtype = quantize_rows(x.detach().reshape(1, -1), fmt, block), out_dtype or x.dtype
    world = _world(group)
    send = pack_rows(q)
    recv = send.new_empty((world * send.shape[0], send.shape[1]))
    work = _all_gather(recv, send, group=group, async_op=True)
    COMM.add("all_gather_fp8", _nbytes(send), _nbytes(send) * (world - 1), q.data.dtype,
             _nbytes(q.scale))

    def finish():
        got = unpack_rows(recv, q.data.shape[1], q.cols, q.data.dtype)
        if keep_fp8:
            return got
        out = got.dequantize(dtype).reshape(-1)[:numel]
        return out if shape is None else out.view(shape)

    return _finish(Pending(work, finish), async_op)


def all_reduce_fp8(x, group=None, fmt=E5M2, block=None, op="sum", out_dtype=None,
                   async_op=False):
    """Sum or average x over the ranks (op "sum" | "mean"), communicating in FP8: reduce-scatter,
    re-quantize the reduced chunk, all-gather. Every rank gets the same bits, of x's shape and
    out_dtype (default x.dtype). async_op=True returns a Pending (two stages)."""
    rs = reduce_scatter_fp8(x, group, fmt, block, op, torch.float32, async_op=True)

    def gather():
        # All ranks, the owner included, use the dequantized gathered chunk: keeping the owner's
        # fp32 sum would make its copy differ from everyone else's.
        shard = quantize_rows(rs.wait().view(1, -1), fmt, block)
        return all_gather_fp8(shard, group, numel=x.numel(), shape=x.shape,
                              out_dtype=out_dtype or x.dtype, async_op=True)

    return _finish(Pending(None, gather), async_op)


# -----------------------------------------------------------------------------
# 5. Plain baselines (same counter), and small helpers


def all_reduce_plain(x, group=None, dtype=torch.bfloat16, op="sum", out_dtype=None,
                     async_op=False):
    """The baseline: x cast to `dtype` (bf16 or fp32) and summed by dist.all_reduce."""
    _check(x, op)
    world = _world(group)
    buf = x.detach().to(dtype, copy=True)  # never reduce into the caller's tensor
    work = dist.all_reduce(buf, group=group, async_op=True)
    COMM.add(f"all_reduce_{str(dtype).split('.')[-1]}", _nbytes(buf),
             _nbytes(buf) * 2 * (world - 1) / world, dtype)

    def finish():
        out = buf.float() / world if op == "mean" else buf
        return out.to(out_dtype or x.dtype)

    return _finish(Pending(work, finish), async_op)


def reduce_scatter_plain(x, group=None, dtype=torch.bfloat16, op="sum", out_dtype=None,
                         async_op=False):
    """The baseline reduce-scatter, with the chunking of reduce_scatter_fp8 (block=None)."""
    _check(x, op)
    world, n = _world(group), x.numel()
    c = shard_len(n, world)
    buf = F.pad(x.detach().reshape(-1).to(dtype), (0, world * c - n))
    out = buf.new_empty(c)
    work = _reduce_scatter(out, buf, group=group, async_op=True)
    COMM.add(f"reduce_scatter_{str(dtype).split('.')[-1]}", _nbytes(buf),
             _nbytes(buf) * (world - 1) / world, dtype)

    def finish():
        res = out.float() / world if op == "mean" else out
        return res.to(out_dtype or x.dtype)

    return _finish(Pending(work, finish), async_op)


def all_gather_plain(x, group=None, dtype=torch.bfloat16, numel=None, shape=None, out_dtype=None,
                     async_op=False):
    """The baseline all-gather: x cast to `dtype`, concatenated over ranks, flat."""
    world = _world(group)
    buf = x.detach().reshape(-1).to(dtype)
    out = buf.new_empty(world * buf.numel())
    work = _all_gather(out, buf, group=group, async_op=True)
    COMM.add(f"all_gather_{str(dtype).split('.')[-1]}", _nbytes(buf), _nbytes(buf) * (world - 1), dtype)

    def finish():
        res = out[:numel].to(out_dtype or x.dtype)
        return res if shape is None else res.view(shape)

    return _finish(Pending(work, finish), async_op)


def any_nonfinite(tensors, group=None):
    """True on every rank if any rank has an inf or NaN in `tensors` (one 4-byte MAX all-reduce).
    Needed where ranks hold different data after communication (ZeRO's reduce-scatter)."""
    return bool(nonfinite_flag(tensors, group).item())


def nonfinite_flag(tensors, group=None):
    """any_nonfinite as a 1-element device tensor (1.0 or 0.0), not read: no device sync."""
    tensors = list(tensors)
    flag = torch.zeros((), device=tensors[0].device if tensors else "cpu")
    for t in tensors:
        flag = torch.maximum(flag, (~torch.isfinite(t)).any().float())
    flag = flag.reshape(1)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    COMM.add("any_nonfinite", 4, 4 * 2 * (_world(group) - 1) / _world(group))
    return flag


def broadcast_parameters(module, group=None, src=0):
    """Copy the parameters and buffers of group rank `src` to every rank of the group."""
    root = dist.get_global_rank(group or dist.group.WORLD, src)
    me = dist.get_rank(group)
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            data = t.data.view(torch.uint8) if t.dtype in FP8_DTYPES else t.data  # (no FP8 in c10d)
            dist.broadcast(data, src=root, group=group)
            COMM.add("broadcast", _nbytes(t), _nbytes(t) if me == src else 0, t.dtype)


# -----------------------------------------------------------------------------
# 6. Data parallelism with FP8 gradient all-reduce


class _Bucket:
    def __init__(self, params, fmt, block, held=False):
        self.params, self.fmt, self.block = params, fmt, block
        # FP8 buckets pad every parameter to a multiple of `block`: a block of values (and so a
        # scale) never spans two parameters, whose gradients can be orders of magnitude apart.
        pad = block if isinstance(fmt, Fp8Format) else 1
        self.spans = [-(-p.numel() // pad) * pad for p in params]
        self.held = held  # whether it carries held FP8 gradients (fp8_grad) instead of .grad
        self.ready = set()  # ids of the parameters whose gradient is final for this step
        self.pending = None  # the reduction in flight, once launched


def make_buckets(params, bucket_bytes):
    """Group parameters into lists of about bucket_bytes (of fp32 gradient) each, in the given
    order; a parameter larger than a bucket gets one of its own."""
    buckets, cur, size = [], [], 0
    for p in params:
        if cur and size + 4 * p.numel() > bucket_bytes:
            buckets.append(cur)
            cur, size = [], 0
        cur.append(p)
        size += 4 * p.numel()
    return buckets + ([cur] if cur else [])


def fp8_weights(module):
    """The weights whose gradients come out of an FP8 GEMM (the Fp8Linear layers of `module`):
    the only gradients that Fp8DataParallel sends in FP8."""
    from .fp8 import Fp8Linear

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
    (default: fp8_weights(module), the weights of its Fp8Linear layers).
    rest: torch.float32 | torch.bfloat16, for every other gradient: embeddings, LM head, norms
    and biases keep fp32 master weights because they are sensitive; their gradients are too.
    block: values per scale in the FP8 buckets (each parameter is padded to a multiple of it).
    overlap: launch each bucket's communication from a gradient hook as soon as its gradients
    are final, during backward. The gradients are then read during backward: change them
    (clipping, ...) only after sync_gradients(), or pass overlap=False. For gradient
    accumulation, run all backwards but the last in no_sync().
    wgrads: what to do with the FP8 weight gradients that O2/O3 weights hold outside .grad
    (optim.fp8_grad). None: nothing (those weights must not be in `params`; the caller reduces
    them, with sync_fp8_wgrads or in ZeroFp8AdamW.step). "all_reduce" (O2): average them; after
    sync_gradients() every weight's fp8_grad is the same FP8 tensor on every rank. "reduce_scatter"
    (O3): reduce-scatter them to the ranks that own the shards; after sync_gradients(),
    take_wgrad_shards() hands over {weight: this rank's averaged fp32 shard} for
    ZeroFp8AdamW.step(shards=...).
    Either way the FP8 bytes travel as they are, bucketed, and with overlap=True a bucket is
    launched from the weights' "weight gradient ready" hook (optim.fp8_grad_hook) during backward.
    Results are bit-identical to the non-overlapped run and to sync_fp8_wgrads /
    ZeroFp8AdamW.step reducing them after backward (tests/test_comm.py).
    late: parameters whose gradient is still changed between backward and sync_gradients()
    (model parallelism sums some over the tensor group or between pipeline stages first): no
    hook, buckets of their own, launched last, by sync_gradients().

    Why E4M3 by default: with a scale per 128 values from the block's own amax, range is no
    longer the constraint (a block rarely spans more than E4M3's 18 binades), and the sum is fp32;
    E4M3's extra mantissa bit is worth about 6 dB on a small GPT's gradients (tests/test_comm.py
    measures both and holds E4M3 at least 3 dB ahead).
    """

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
        # Backward produces gradients roughly in reverse order of the forward pass, which is
        # roughly reverse registration order: bucket in that order so buckets fill early. FP8,
        # baseline and held FP8 gradients go to separate buckets; the buckets are launched in the
        # order in which their last parameter comes (the order is fixed: the same on every rank).
        order = params[::-1]
        if self.held:  # place the held weights among the others by registration order
            reg = {id(p): i for i, p in enumerate(module.parameters())}
            order = sorted(params + self.held, key=lambda p: -reg[id(p)])
        late = {id(p) for p in late}
        pos = {id(p): i + (len(order) if id(p) in late else 0) for i, p in enumerate(order)}

        def family(p):  # which buckets a gradient goes to: (what it travels in, launched late)
            return ("held" if id(p) in held else "fp8" if id(p) in fp8 else "rest", id(p) in late)

        buckets = []
        for fam in sorted({family(p) for p in order}):
            for ps in make_buckets([p for p in order if family(p) == fam], bucket_mb * 2**20):
                buckets.append(_Bucket(ps, {"held": E4M3, "fp8": fmt, "rest": rest}[fam[0]], block,
                                       fam[0] == "held"))
        self.buckets = sorted(buckets, key=lambda b: pos[id(b.params[-1])])
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._next = 0  # index of the next bucket to launch
        self._sync = True
        self.on_launch = None  # a callable(bucket index), for tests that record the event order
        if overlap:
            for p in params:
                if id(p) not in late:
                    p.register_post_accumulate_grad_hook(self._grad_ready)
            for p in self.held:
                fp8_grad_hook(p, self._grad_ready)
        if broadcast:
            self.broadcast_parameters()

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def broadcast_parameters(self, src=0):
        broadcast_parameters(self.module, self.group, src)

    @contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients locally, launching no communication."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def _grad_ready(self, p):  # (.grad and fp8_grad alike: p's gradient for this micro-step is in)
        if not self._sync:
            return
        bucket = self._bucket_of[id(p)]
        if bucket.pending is not None:
            raise RuntimeError("a gradient changed after its bucket was sent: call "
                               "sync_gradients() after each backward, or accumulate in no_sync()")
        bucket.ready.add(id(p))
        # Launch strictly in bucket order, so every rank issues its collectives in the same
        # order even if gradients become ready in a different order on different ranks. (A
        # parameter without a gradient this step holds its bucket, and all later ones, back
        # until sync_gradients().)
        while self._next < len(self.buckets):
            b = self.buckets[self._next]
            if len(b.ready) < len(b.params):
                break
            self._launch(b)

    @torch.no_grad()
    def _launch(self, bucket):
        if self.on_launch is not None:
            self.on_launch(self._next)
        if bucket.held:
            # Held FP8 gradients: their bytes go out as they are (reading fp8_grad ends an fp16
            # accumulation of micro-steps with its one E4M3 cast), reduce-scattered to the owner
            # of each shard; O2 all-gathers the averages in sync_gradients().
            rows = [_held_rows(p, _world(self.group)) for p in bucket.params]
            bucket.pending = reduce_scatter_fp8_rows(rows, self.group, op="mean", async_op=True)
            self._next += 1
            return
        # A missing gradient counts as zero: the bytes sent never depend on local data.
        flat = torch.cat([F.pad((p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float(),
                                (0, n - p.numel())) for p, n in zip(bucket.params, bucket.spans)])
        if isinstance(bucket.fmt, Fp8Format):
            bucket.pending = all_reduce_fp8(flat, self.group, bucket.fmt, bucket.block, op="mean",
                                            async_op=True)
        else:
            bucket.pending = all_reduce_plain(flat, self.group, bucket.fmt, op="mean", async_op=True)
        self._next += 1

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
        now). Returns True if every gradient is finite; the same on every rank (see the module
        docstring). A parameter without a gradient counts as zero and gets the average.
        wgrads="reduce_scatter": the held shards are not judged here (a rank sees only its own):
        ZeroFp8AdamW.step asks every rank with one flag."""
        return bool(self.sync_gradients_flag())

    def sync_gradients_flag(self):
        """sync_gradients() without reading the verdict: a 0-dim bool tensor on the device, for a
        caller that reads it together with other values in one device-to-host copy."""
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
        for b in self.buckets:  # finish every reduce-scatter, start every all-gather...
            b.pending.advance()
        finite = []
        shards = {id(p): s for b in self.buckets if b.held for p, s in zip(b.params, b.pending.wait())}
        if self.wgrads == "all_reduce":  # (one MAX all-reduce of amaxes, then the all-gathers)
            _gather_wgrads(self.held, [shards[id(p)] for p in self.held], self.group)
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
            b.ready, b.pending = set(), None
        self._next = 0
        return torch.stack(finite).all() if finite else torch.ones((), dtype=torch.bool)


# -----------------------------------------------------------------------------
# 7. ZeRO in FP8 (level O3)
#
# O2 (nanofp8/optim.py) still keeps every optimizer state on every data-parallel rank. O3 shards
# the part that is only needed by the update, and keeps only what the GEMMs need everywhere:
#
#   per block-Linear parameter, per rank      bytes
#   FP8 weight (E4M3 + one tensor scale)      1        replicated: forward and backward read it
#   weight gradient, summed in fp16 (+ scale) 2        full, until the step casts it to FP8 (1 B,
#                                                      or 1 B throughout with grad_accum="fp8")
#   fp16 master weight (+ scale)              2 / N    sharded: only the update reads it
#   Adam m (E4M3 + a scale per 128 values)    1 / N    sharded
#   Adam v (fp16 + a scale per 128 values)    2 / N    sharded
#                                    total:   3 + 5/N between backward and step (2 + 5/N), plus
#                                             the scales of the FP8 gradient, m and v (1/32 B each)
#
# The update is O2's (nanofp8/optim.py): the same bound on m, and stochastic rounding into the
# fp16 master shard and the moments, seeded by (step, parameter, rank).
#
# One step: reduce-scatter the FP8 gradients (their bytes go out as they are, with their block
# scales: 1 + 1/32 B per parameter on the wire, and the receiver sums in fp32), run AdamW on the
# local shard in fp32, then all-gather the updated shards in FP8 (1 B per parameter). For the
# gathered bytes to form one valid per-tensor FP8 weight, every rank must quantize its shard with
# the same scale: the ranks agree on it with one small MAX all-reduce of the shard amaxes (4
# bytes per weight tensor).
#
# Shards are cut from each weight flattened: rank r owns values [r*C, (r+1)*C) with
# C = held_shard_len(p, N) (whole blocks of 128 values), the tail zero-padded. Checkpoints hold
# each rank's own shard, so a run resumes at the same world size; at another size the shards do
# not line up and loading stops with an error (re-shard by gathering the fp16 masters, which is
# not done here).


class O3Linear(O2Linear):
    """Fp8Linear whose `.weight` is the full FP8 (E4M3) weight, stored in the layout the recipe's
    forward GEMM reads: `.weight_scale` is its scale grid (tensor: one scale, row: one per output
    row, block: one per 128x128 tile). The forward GEMM takes it as it is: the weight is rounded
    to FP8 once, from the fp32 update (re-quantizing a per-tensor FP8 weight with row or block
    scales would round it twice). The dgrad GEMM needs W^T quantized along the output rows: a
    tensor scale and square tiles transpose with the data; row scales do not, so under "row" W^T
    is re-quantized from the FP8 weight (a second rounding of the dgrad operand only). The fp16
    master lives, sharded, in ZeroFp8AdamW. The gradient is kept in FP8 on the weight
    (optim.fp8_grad), as for O2."""

    @classmethod
    def from_fp8_linear(cls, lin):
        new = super().from_fp8_linear(lin)
        q = quantize(lin.weight.detach(), E4M3, lin.recipe.granularity, (BLOCK, BLOCK))
        new.weight = nn.Parameter(q.data.view(lin.weight.shape))
        new.weight_scale = q.scale.clone()  # (the buffer O2 registered, now the recipe's grid)
        new.init_master = lin.weight.detach().float()  # taken (and dropped) by the optimizer
        new.ensure_grad_hook()  # the new weight holds the FP8 gradient
        # The casts O2 made were of the fp16 weight: a compiled forward reads them as they are
        # (eager code would notice the new weight and cast again).
        new.refresh_fp8_weight(record=False)
        return new

    def weight_layout(self):
        """(shape, granularity) of the stored FP8 weight: what gather_shared_scale produces."""
        return self.weight.shape, self.recipe.granularity

    def fp8_weight(self):
        """The stored weight as an Fp8Tensor (no copy, no rounding)."""
        g = self.recipe.granularity
        return Fp8Tensor(self.weight.detach(), self.weight_scale, E4M3, g,
                         (BLOCK, BLOCK) if g == "block" else (1, self.weight.shape[1]),
                         self.weight.shape, torch.float32)

    def hp_weight(self):
        return dequantize(self.fp8_weight(), torch.float32)

    def cast_weight(self):
        qw = self.fp8_weight()
        if qw.granularity == "row":
            return qw, quantize(self.hp_weight().t(), E4M3, "row")
        return qw, qw.t()

    @torch.no_grad()
    def set_fp8_weight(self, data, scale):
        self.weight.copy_(data.view(self.weight.shape))
        self.weight_scale.copy_(scale)
        self.weight_changed()


def convert_to_o3(model):
    """Swap every Fp8Linear of the model for an O3Linear."""
    return convert_to_o2(model, O3Linear)


def held_shard_len(p, world):
    """Values per rank of the shards of weight p's held FP8 gradient and of its O3 state: the
    shard length (shard_len) rounded up to whole blocks of the gradient's scales (optim.state_block),
    so that every block, and its scale, lies in one rank's shard."""
    return shard_len(p.numel(), world, state_block(p.numel()))


def _fp8_rows(q, world, c):
    """An FP8 gradient (optim.quantize_wgrad's: one scale per block; or one tensor scale) as
    Fp8Rows with one row of c values per rank (c a multiple of the block), without re-quantizing:
    its bytes, zero-padded, and its block scales (padded with ones), or its scale per row."""
    flat = q.data.reshape(-1).view(torch.uint8)
    n = flat.numel()
    flat = F.pad(flat, (0, world * c - n)).view(q.data.dtype)
    if q.scale.numel() == 1:
        return Fp8Rows(flat.view(world, c), q.scale.reshape(1, 1).expand(world, 1).contiguous(), c)
    b = n // q.scale.numel()
    scale = F.pad(q.scale.reshape(-1), (0, world * c // b - q.scale.numel()), value=1.0)
    return Fp8Rows(flat.view(world, c), scale.view(world, c // b), c)


class ZeroFp8AdamW(Fp8AdamW):
    """AdamW for level O3 over a model converted with convert_to_o3: O3Linear weights sharded as
    above, every other parameter replicated with fp32 AdamW state (average their .grad first,
    e.g. with Fp8DataParallel(model, params=other_params(model))).

        loss.backward()
        ok = dp.sync_gradients()          # the replicated parameters
        opt.step(grads_finite=ok)         # reduce-scatter, update shards, all-gather FP8 weights
        opt.zero_grad()

    With dp = Fp8DataParallel(model, wgrads="reduce_scatter") the reduce-scatter runs during
    backward instead: opt.step(grads_finite=ok, shards=dp.take_wgrad_shards()) (the same bits).
    """

    _prepared = None  # (gradient shards, replicated gradients, clipping factor) of prepare_step

    def __init__(self, params, model, group=None, v_format="fp16", **kw):
        self.group, self.world = group, _world(group)
        self.rank = dist.get_rank(group)
        super().__init__(params, model, v_format=v_format, **kw)
        self.o2 = {m.weight: m for m in model.modules() if isinstance(m, O3Linear)}
        for p, m in self.o2.items():  # each rank builds its master shard from the fp32 weight
            c = held_shard_len(p, self.world)
            full = F.pad(m.__dict__.pop("init_master").to(p.device).reshape(-1), (0, self.world * c - p.numel()))
            st = self.state[p]
            st["step"] = torch.zeros((), dtype=torch.float32)
            st["master"], st["master_scale"] = to_fp16_scaled(full[self.rank * c : (self.rank + 1) * c])
            zeros = torch.zeros(c, device=p.device)
            st["exp_avg"], st["exp_avg_scale"] = stored(zeros, "fp8")
            st["exp_avg_sq"], st["exp_avg_sq_scale"] = stored(zeros, self.v_format)

    def state_dict(self):
        sd = super().state_dict()
        sd["zero"] = {"world_size": self.world, "rank": self.rank}
        return sd

    def load_state_dict(self, state_dict):
        zero = state_dict.get("zero", {})
        if zero.get("world_size") != self.world or zero.get("rank") != self.rank:
            raise ValueError(f"this optimizer state is the shard of rank {zero.get('rank')} of "
                             f"{zero.get('world_size')}; this is rank {self.rank} of {self.world}. "
                             "O3 state resumes only at the world size it was saved with.")
        params = [p for g in self.param_groups for p in g["params"]]
        for i, st in state_dict["state"].items():
            p = params[i]
            if p in self.o2 and "master" in st and st["master"].numel() != held_shard_len(p, self.world):
                raise ValueError(f"this O3 state holds shards of {st['master'].numel()} values of a weight "
                                 f"of {p.numel()}; this version cuts it into shards of whole blocks of "
                                 f"{state_block(p.numel())} values ({held_shard_len(p, self.world)}); its "
                                 "weights still load (train.py init_from=<its out_dir> gathers the masters)")
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "zero"})

    @torch.no_grad()
    def step(self, closure=None, grads_finite=True, max_norm=float("inf"), shards=None, verdict=None):
        """One O3 step; returns whether it was taken. grads_finite: the verdict on the replicated
        parameters' gradients (from Fp8DataParallel.sync_gradients; a bool, or a device tensor
        1.0/0.0). max_norm: clip the global gradient norm (kept in self.grad_norm), computed from
        the reduced shards. shards: the averaged fp32 gradient shards, {weight: shard}, where the
        data-parallel wrapper already reduce-scattered them during backward
        (Fp8DataParallel(wgrads="reduce_scatter").take_wgrad_shards()); None: reduce-scatter the
        FP8 gradients here (the same bits).

        The step needs one device sync, to read whether every rank's gradients are finite. A
        caller with values of its own to read (train.py: the norm, the weights' check) calls
        prepare_step(...) first, reads its flag with them in one copy, and passes what it read
        as `verdict` (then the other arguments are not used)."""
        if verdict is None:
            verdict = bool(self.prepare_step(grads_finite, max_norm, shards))
        shards, others, coef = self._prepared
        self._prepared = None
        if not verdict:
            self.skipped_steps += 1
            return False
        for t in shards + others:
            t.mul_(coef.to(t.dtype))
        return self._update(shards)

    @torch.no_grad()
    def prepare_step(self, grads_finite=True, max_norm=float("inf"), shards=None):
        """The half of step() before its decision: every collective, no device sync. Returns the
        flag, the same on every rank: a 0-dim device tensor, 1.0 to step, 0.0 to skip."""
        held, reduced = list(self.o2), shards  # the O3 weights, whose gradients are fp8_grad
        # 1. reduce-scatter the FP8 gradients, all launched before any is waited for
        pending = [reduce_scatter_fp8(_held_rows(p, self.world), self.group, op="mean",
                                      out_dtype=torch.float32, async_op=True)
                   for p in (held if reduced is None else ())]
        shards = [pd.wait() for pd in pending] if reduced is None else [reduced[p] for p in held]
        # A reduce-scatter shows a NaN only to the shard's owner: ask every rank (one flag).
        others = [p.grad for g in self.param_groups for p in g["params"] if p not in self.o2 and p.grad is not None]
        # The global norm: the shards' squares summed over the ranks (one all-reduce), plus the
        # replicated gradients (already averaged, the same on every rank: counted once).
        sq = torch.stack([s.square().sum() for s in shards] + [torch.zeros((), device=shards[0].device if shards else None)]).sum()
        if self.world > 1:
            dist.all_reduce(sq, group=self.group)
            COMM.add("grad_norm", _nbytes(sq), _nbytes(sq) * 2 * (self.world - 1) / self.world)
        sq = sq + sum((g.float().square().sum() for g in others), torch.zeros((), device=sq.device))
        self.grad_norm = sq.sqrt()
        # Every rank asks (the same collectives on every rank, whatever its local verdict), and
        # the caller's verdict and the norm are folded into the one flag, so all ranks skip or
        # step together.
        mine = torch.as_tensor(grads_finite, dtype=torch.float32, device=self.grad_norm.device)
        flags = shards + others + [torch.where(mine > 0, self.grad_norm, torch.nan)]
        self._prepared = (shards, others, torch.clamp(max_norm / (self.grad_norm + 1e-6), max=1.0))
        return 1.0 - nonfinite_flag(flags, self.group).reshape(())

    def _update(self, shards):
        index = {p: i for i, p in enumerate(self.o2)}
        # 2. AdamW on the local shards (fp32 math; fp16 master, FP8 m, fp16 v), the O2 update,
        # foreach over all shards of a param group (and over its replicated parameters)
        new = []
        number = {p: i for i, p in enumerate(p for group in self.param_groups for p in group["params"])}
        for group in self.param_groups:
            mine = [p for p in group["params"] if p in self.o2]
            plain = [p for p in group["params"] if p not in self.o2 and p.grad is not None]
            for p in plain:
                if not self.state[p]:
                    self._init_state(p)
            if plain:
                self._fp32_update(plain, [p.grad for p in plain], group)
            for i, j in step_chunks([shards[index[p]] for p in mine]):  # (runs that bound the temporaries)
                part = mine[i:j]
                sts = [self.state[p] for p in part]
                ts = self._count_steps(sts)
                gs = [shards[index[p]] for p in part]
                noises = [self.rounding_noise(number[p], t, g) for p, t, g in zip(part, ts, gs)]
                ws = dequantize_stored_all([st["master"] for st in sts], [st["master_scale"] for st in sts])
                ws = self._decoupled_update(sts, ws, gs, group, ts, noises)
                for st, (master, scale) in zip(sts, to_fp16_scaled_all(ws, [n[0] for n in noises])):
                    st["master"], st["master_scale"] = master, scale
                new += list(zip(part, ws))
        # 3. all-gather the new weights in FP8, under one scale per weight
        layouts = [self.o2[p].weight_layout() for p, _ in new]
        gathered = gather_shared_scale([w for _, w in new], self.group, layouts=layouts)
        for (p, _), (data, s) in zip(new, gathered):
            self.o2[p].set_fp8_weight(data[: p.numel()], s)
        return True


def _scale_cells(shape, granularity, lo, hi, device):
    """For the flat elements [lo, hi) of a matrix of `shape` (N, K): the index of the scale that
    covers each one (tensor: 0; row: its row; block: its 128x128 tile, row-major) and the grid's
    shape. Elements past N * K (a shard's zero padding) get the index just past the grid."""
    (N, K), i = shape, torch.arange(lo, hi, device=device)
    row, col = i // K, i % K
    if granularity == "tensor":
        cell, grid = torch.zeros_like(i), ()
    elif granularity == "row":
        cell, grid = row, (N, 1)
    else:
        cols = -(-K // BLOCK)
        cell, grid = (row // BLOCK) * cols + col // BLOCK, (-(-N // BLOCK), cols)
    return torch.where(i < N * K, cell, math.prod(grid)), grid


def gather_shared_scale(shards, group=None, fmt=E4M3, layouts=None):
    """All-gather flat fp32 shards (one per tensor, this rank's part of the tensor flattened and
    zero-padded to world * shard length) as FP8 under scales every rank agrees on: one MAX
    all-reduce of the amaxes of every scale's values (each rank contributes its part), then each
    rank quantizes its shard with the common scales and the bytes are gathered. The result is a
    valid FP8 tensor on every rank, bit-identical everywhere, and bit-identical to quantizing the
    whole tensor at once (tests/test_comm.py).
    layouts: per shard, (shape, granularity) of the whole tensor: "tensor" (one scale), "row"
    (one per row) or "block" (one per 128x128 tile); None: one scale per tensor.
    Returns [(flat FP8 data of world * shard length, fp32 scale grid)]."""
    if not shards:
        return []
    world, rank = _world(group), dist.get_rank(group)
    cells, amaxes = [], []
    for w, lay in zip(shards, layouts or [None] * len(shards)):
        c = w.numel()
        cell, grid = ((torch.zeros(c, dtype=torch.long, device=w.device), ()) if lay is None else
                      _scale_cells(lay[0], lay[1], rank * c, (rank + 1) * c, w.device))
        n = math.prod(grid)
        w = w.reshape(-1)
        amax = torch.zeros(n + 1, device=w.device).scatter_reduce(0, cell, w.detach().abs().float(), "amax")
        cells.append((cell, grid))
        amaxes.append(amax[:n])
    amax = torch.cat(amaxes)
    if world > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        COMM.add("all_reduce_amax", _nbytes(amax), _nbytes(amax) * 2 * (world - 1) / world)
    scales = compute_scale(amax, fmt).split([math.prod(g) for _, g in cells])
    pending = []
    for w, (cell, grid), s in zip(shards, cells, scales):
        per_value = torch.cat([s, s.new_ones(1)])[cell]  # (padding: scale 1, its values are 0)
        q = quantize(w.view(1, -1), fmt, scale=per_value.view(1, -1))
        pending.append(all_gather_fp8(Fp8Rows(q.data, s.new_ones(1, 1), w.numel()),
                                      group, keep_fp8=True, async_op=True))
    return [(pd.wait().data.reshape(-1), s.view(grid)) for pd, s, (_, grid) in zip(pending, scales, cells)]


def _held_rows(p, world):
    """The FP8 gradient weight p holds (zeros where this rank has none, so that every rank sends
    the same bytes count) as Fp8Rows of one shard per rank, for reduce_scatter_fp8."""
    q = fp8_grad(p)
    if q is None:
        q = quantize_wgrad(torch.zeros(p.shape, device=p.device))
    return _fp8_rows(q, world, held_shard_len(p, world))


def _gather_wgrads(params, shards, group):
    """O2's second half: each rank casts its averaged fp32 shard to E4M3 with one scale per
    block (blocks lie within shards: held_shard_len), and the bytes and scales are all-gathered;
    each weight's fp8_grad becomes the same FP8 tensor on every rank, the very one quantize_wgrad
    makes of the whole average."""
    pending = [all_gather_fp8(quantize_rows(s.view(1, -1), E4M3, state_block(p.numel())), group,
                              keep_fp8=True, async_op=True) for p, s in zip(params, shards)]
    for p, pd in zip(params, pending):
        got, b = pd.wait(), state_block(p.numel())
        data = got.data.reshape(-1)[: p.numel()].view(-1, b)
        scale = got.scale.reshape(-1)[: len(data)].reshape(-1, 1)
        amax = fp8_to_float(data).abs().amax(1, keepdim=True) / scale  # NaN where a NaN came through
        set_fp8_grad(p, Fp8Tensor(data, scale, E4M3, "row", (1, b), p.shape, torch.float32, amax))


@torch.no_grad()
def sync_fp8_wgrads(params, group=None):
    """Data parallelism for O2, after backward: average the FP8 weight gradients that the O2
    weights among `params` hold outside autograd (fp8_grad; Fp8DataParallel(params=...) handles the rest;
    Fp8DataParallel(wgrads="all_reduce") does this too, overlapped with backward, to the same
    bits). Reduce-scatter the FP8 bytes as they are (1 B per parameter out, and a scale per 128
    values), sum in fp32, all-gather the averaged shards in FP8 with a scale per 128 values (1 B
    per parameter back, and the scales): each weight's fp8_grad becomes the same FP8 tensor on
    every rank. A NaN anywhere reaches every rank
    through the sum and the gather. A weight without a gradient on some rank counts as zero there
    (and gets the average everywhere)."""
    world = _world(group)
    # Every weight, with or without a gradient on this rank: a rank that skipped a layer must
    # still issue the same collectives as the others (it sends zeros), or the ranks deadlock.
    params = [p for p in params if holds_fp8_grad(p)]
    pending = [reduce_scatter_fp8(_held_rows(p, world), group, op="mean", out_dtype=torch.float32,
                                  async_op=True) for p in params]
    _gather_wgrads(params, [pd.wait() for pd in pending], group)
