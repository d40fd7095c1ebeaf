"""
Delayed scaling's per-step work on a GPU: every layer's amax history pushed in one Triton launch,
and O1's weight casts in one more.

Under delayed scaling (nanofp8/fp8.py, Fp8Linear.delayed_quantize) each cast takes its scale from
the amaxes of earlier casts and records its own amax in the layer's cast_log; a compiled graph
leaves the histories to o2_compile.push_amaxes, which train.py calls after each backward, and the
O1 step after its weight casts. Fp8Linear.push_history is the readable reference: per layer, put
each role's recorded amax at the front of its history (a finite one only), add up the counters,
zero the log, and make each role's next scale and its inverse from the history. Those are about
fifteen tiny operators per layer: compiled for all layers, inductor still made about ten kernels
of each layer's (bench.py kernels' step count), some 480 launches per push at GPT-2's 48 layers,
after every micro-step; the O1 step's weight casts (cast_now, compiled) nine more per layer.

Here one program does one layer's push, all three roles at once, reading a table of the layer's
buffers' addresses: one launch for the whole model, its bytes a few hundred per layer. The
arithmetic is the reference's: the float64 log's amax rounded to fp32, the scales by
kernels._scale_from_amax (fp8.compute_scale's float64 division), their inverses a correctly
rounded division (torch's reciprocal), counts converted from float64 by truncation (torch's
.long()). The O1 step's casts (cast_weights) take one launch before it: each weight tile by tile
under its layer's next scale, its amax and its count of clipped values as atomics, which the push
then logs as delayed_quantize does (fp8._logged). tests/test_history_triton.py holds every buffer
bit-equal to the layers' own pushes and casts over adversarial logs and weights (NaN and inf
amaxes, zero counts, a history that wraps, values the cast clips), in Triton's interpreter;
tests/test_sm90_compile.py compiles both kernels for sm_90.

What it takes (takes_layers, takes_weights): layers in training under delayed scaling, the scale
rule fp8.compute_scale, one recipe's numbers (history length, amax algorithm, formats, margin,
power of two) for all, their buffers contiguous; for the casts, every role's history warm (a
layer's first casts make their scales from their own amaxes: the compiled code does those), the
weight cast per tensor and W^T its transpose.
"""

import torch
import triton
import triton.language as tl

from kernels import FLT_MAX, FP8_FORMATS, _abs_for_amax, _scale_from_amax, _store_fp8, cdiv
from nanofp8.fp8 import CAST_LOG, clip_edge, compute_scale
from nanofp8.optim_foreach import host_to_device
from nanofp8.optim_triton import NMETA, NSLOT, ROW_C, TILE, _addr, _fp8_addr, _own_wt, _tile, weights_table

# a layer's row of the table: the addresses of its buffers, in this order
BUFFERS = ("cast_log", "amax_history", "history_count", "nonfinite", "cast_values", "clipped", "scale",
           "next_scale_0", "next_scale_1", "next_scale_2", "next_inv_0", "next_inv_1", "next_inv_2")
NB = tl.constexpr(len(BUFFERS))
NBUF = tl.constexpr(len(BUFFERS) + 3)  # (and the weight's cast: its amax, its clipped count, its values)
NLOG = tl.constexpr(len(CAST_LOG))  # (amax, nonfinite, values, clipped, scale)


@triton.jit
def _buf(table, slot: tl.constexpr, TY: tl.constexpr):
    """This program's layer's buffer BUFFERS[slot], typed."""
    return tl.load(table + tl.program_id(0) * NBUF + slot).to(tl.pointer_type(TY))


@triton.jit
def _push_kernel(table, H: tl.constexpr, HP: tl.constexpr, MOST_RECENT: tl.constexpr, FWD_MAX: tl.constexpr,
                 BWD_MAX: tl.constexpr, MARGIN_MUL: tl.constexpr, POW2: tl.constexpr, HAS_CAST: tl.constexpr):
    """Fp8Linear.push_history of one layer per program (H: the history's length, HP: a power of two
    at least H; the roles INPUT, WEIGHT, GRAD_OUTPUT are rows 0-2 of 4). HAS_CAST: first the
    weight's cast of _delayed_cast_kernel into the log's WEIGHT row, as delayed_quantize logs it
    (fp8._logged)."""
    r = tl.arange(0, 4)
    rm = r < 3
    log = _buf(table, 0, tl.float64) + r * NLOG
    amax64 = tl.load(log, mask=rm, other=0.0)
    values = tl.load(log + 2, mask=rm, other=0.0)
    if HAS_CAST:
        row = table + tl.program_id(0) * NBUF
        a = tl.load(tl.load(row + NB).to(tl.pointer_type(tl.float32)))  # (its amax: inf for a NaN)
        finite = a <= FLT_MAX
        over = tl.load(tl.load(row + NB + 1).to(tl.pointer_type(tl.int32))).to(tl.float64)
        w = r == 1
        nonfinite, clipped = tl.load(log + 1, mask=rm, other=0.0), tl.load(log + 3, mask=rm, other=0.0)
        used = tl.load(log + 4, mask=rm, other=0.0)
        tl.store(log, tl.where(w, tl.maximum(amax64, a.to(tl.float64), propagate_nan=tl.PropagateNan.ALL), amax64),
                 mask=rm)
        tl.store(log + 1, nonfinite + tl.where(w, tl.where(finite, 0.0, 1.0), 0.0), mask=rm)
        tl.store(log + 2, tl.where(w, values + tl.load(row + NB + 2).to(tl.float64), values), mask=rm)
        tl.store(log + 3, clipped + tl.where(w, tl.where(finite, over, 0.0), 0.0), mask=rm)
        tl.store(log + 4, tl.where(w, tl.load(_buf(table, 8, tl.float32)).to(tl.float64), used), mask=rm)
        tl.debug_barrier()  # (the push below reads the log)
        amax64, values = tl.load(log, mask=rm, other=0.0), tl.load(log + 2, mask=rm, other=0.0)
    amax = amax64.to(tl.float32)
    cast = values > 0
    new = cast & (tl.abs(amax) <= FLT_MAX)  # (a cast, and its amax finite: not NaN, not inf)
    # the history, newest first: the new amax in front, the others one place back
    h = tl.arange(0, HP)
    hm = rm[:, None] & (h < H)[None, :]
    hist_ptr = _buf(table, 1, tl.float32) + r[:, None] * H + h[None, :]
    hist = tl.load(hist_ptr, mask=hm, other=0.0)
    back = tl.load(hist_ptr - 1, mask=hm & (h >= 1)[None, :], other=0.0)
    hist = tl.where(new[:, None], tl.where((h == 0)[None, :], amax[:, None], back), hist)
    tl.debug_barrier()  # (every load of the history before any store)
    tl.store(hist_ptr, hist, mask=hm)
    count_ptr = _buf(table, 2, tl.int64) + r
    count = tl.load(count_ptr, mask=rm, other=0)
    tl.store(count_ptr, tl.where(new, tl.minimum(count + 1, H), count), mask=rm)
    _add_counts(table, log, r, rm)
    scale_ptr = _buf(table, 6, tl.float32) + r
    scale = tl.where(cast, tl.load(log + 4, mask=rm, other=1.0).to(tl.float32), tl.load(scale_ptr, mask=rm, other=1.0))
    tl.store(scale_ptr, scale, mask=rm)
    for col in tl.static_range(0, NLOG):
        tl.store(log + col, tl.zeros([4], tl.float64), mask=rm)
    # each role's next scale: from its history's max (or newest) amax, by the role's format
    if MOST_RECENT:
        past = tl.sum(tl.where((h == 0)[None, :] & hm, hist, 0.0), axis=1)
    else:
        past = tl.max(tl.where(hm, hist, 0.0), axis=1)
    nxt = tl.where(r < 2, _scale_from_amax(past, FWD_MAX, MARGIN_MUL, POW2),
                   _scale_from_amax(past, BWD_MAX, MARGIN_MUL, POW2))
    nxt = tl.where(tl.abs(past) <= FLT_MAX, nxt, scale)  # (the scale last used where the history gives none)
    row = table + tl.program_id(0) * NBUF
    tl.store(tl.load(row + 7 + r, mask=rm, other=0).to(tl.pointer_type(tl.float32)), nxt, mask=rm)
    tl.store(tl.load(row + 10 + r, mask=rm, other=0).to(tl.pointer_type(tl.float32)), tl.div_rn(1.0, nxt), mask=rm)


@triton.jit
def _add_counts(table, log, r, rm):
    """nonfinite, cast_values, clipped += the log's counts (float64, truncated as torch's .long())."""
    for k in tl.static_range(0, 3):
        ptr = _buf(table, 3 + k, tl.int64) + r
        tl.store(ptr, tl.load(ptr, mask=rm, other=0) + tl.load(log + 1 + k, mask=rm, other=0.0).to(tl.int64),
                 mask=rm)


@triton.jit
def _delayed_cast_kernel(table, tile_weight, amax, over, FP8_MAX: tl.constexpr, MBITS: tl.constexpr,
                         EMIN: tl.constexpr, E5M2: tl.constexpr, CLIP_EDGE: tl.constexpr, TILE_: tl.constexpr):
    """O1's weight casts under delayed scaling (Fp8Linear.delayed_quantize of the weight), tile by
    tile: W (and W^T where the layer keeps its own) under the layer's next weight scale; each
    weight's amax (an atomic max, a NaN's as inf) and count of values beyond the format's rounding
    edge (fp8.clip_edge, an atomic add); the kept casts' scales and inverses. optim_triton's table:
    slot g the next scale, g_scale its inverse, w the fp32 weight, qw... the kept casts."""
    wi, R, C, t, rows, cols, mask = _tile(table, tile_weight, TILE_)
    scale = tl.load(_addr(table, wi, 0, tl.float32))
    x = tl.load(_addr(table, wi, 2, tl.float32) + rows[:, None] * C + cols[None, :], mask=mask, other=0.0)
    _store_fp8(_fp8_addr(table, wi, 8, E5M2) + rows[:, None] * C + cols[None, :], x, scale, mask, FP8_MAX, MBITS, EMIN)
    if tl.load(table + wi * ROW_C + 11) != 0:  # the layer keeps W^T apart (else a view of W)
        _store_fp8(_fp8_addr(table, wi, 11, E5M2) + cols[:, None] * R + rows[None, :], tl.trans(x), scale,
                   tl.trans(mask), FP8_MAX, MBITS, EMIN)
    tl.atomic_max(amax + wi, tl.max(tl.max(_abs_for_amax(x), axis=1), axis=0))
    tl.atomic_add(over + wi, tl.sum(tl.sum(tl.where(mask & (tl.abs(x * scale) > CLIP_EDGE), 1, 0), axis=1), axis=0))
    if t == 0:
        inv = tl.load(_addr(table, wi, 1, tl.float32))
        for slot in tl.static_range(9, 14, 3):
            tl.store(_addr(table, wi, slot, tl.float32), scale)
            tl.store(_addr(table, wi, slot + 1, tl.float32), inv)


def takes_layers(layers):
    """Whether push_histories takes these Fp8Linear layers (see the docstring above)."""
    if not layers:
        return False
    kinds = {(m.recipe.history_len, m.recipe.amax_algo, m.recipe.fwd_fmt.dtype, m.recipe.bwd_fmt.dtype,
              m.recipe.margin, m.recipe.power_of_two) for m in layers}
    return (len(kinds) == 1 and all(m.recipe.scaling == "delayed" and m.recipe.scale_rule is compute_scale
                                    for m in layers)
            and all(getattr(m, name).is_contiguous() for m in layers for name in BUFFERS))


def push_histories(layers, cast=None):
    """Fp8Linear.push_history of every layer, in one launch (takes_layers: None where it does not
    take them). cast: (amaxes, clipped counts) of cast_weights' kernel, logged first."""
    if not takes_layers(layers):
        return None
    r = layers[0].recipe
    pending = [[0, 0, 0]] * len(layers) if cast is None else \
        [[cast[0][i].data_ptr(), cast[1][i].data_ptr(), m.weight.numel()] for i, m in enumerate(layers)]
    table = host_to_device([[getattr(m, name).data_ptr() for name in BUFFERS] + p for m, p in zip(layers, pending)],
                           torch.int64, layers[0].amax_history.device)
    H = r.history_len
    _push_kernel[(len(layers),)](table, H=H, HP=triton.next_power_of_2(H), MOST_RECENT=r.amax_algo == "most_recent",
                                 FWD_MAX=FP8_FORMATS[r.fwd_fmt.dtype][0], BWD_MAX=FP8_FORMATS[r.bwd_fmt.dtype][0],
                                 MARGIN_MUL=2.0**-r.margin, POW2=r.power_of_two, HAS_CAST=cast is not None)
    torch.autograd.graph.increment_version([getattr(m, name) for m in layers for name in BUFFERS])
    return True


def takes_weights(layers):
    """Whether cast_weights takes these O1 layers: pushes it takes (takes_layers), every role's
    history warm (the scale comes from it: the layers' first casts take the compiled code), the
    weight cast per tensor, W^T its transpose, fp32 weights 2-D and contiguous, the casts kept."""
    return (takes_layers(layers) and all(all(m.history_warm) and m.training for m in layers)
            and all(m.recipe.casts["w"] is not None and m.recipe.casts["w"][1] == "tensor"
                    and "w_t" in m.recipe.transposes and m.recipe.casts["w"][0].dtype in FP8_FORMATS
                    and m.weight.dtype == torch.float32 and m.weight.dim() == 2 and m.weight.is_contiguous()
                    and getattr(m, "_fp8_meta", None) is not None and m.fp8_w.is_contiguous() for m in layers)
            and len({m.recipe.casts["w"][0].dtype for m in layers}) == 1)


def cast_weights(layers):
    """O1's FP8 weight casts for the next forward under delayed scaling (o2_compile.cast_for_step:
    each layer's cast_now, then push_amaxes) in two launches for all layers: the casts
    (_delayed_cast_kernel), then the pushes with the casts logged. The bytes, scales and state of
    the layers' own casts and pushes. None where the kernels do not take these layers."""
    if not takes_weights(layers):
        return None
    device = layers[0].weight.device
    tw, table = weights_table(layers, lambda m: (m.next_scale_1, m.next_inv_1))  # (the weight role's scale)
    scratch = torch.zeros(2 * len(layers), dtype=torch.int32, device=device)  # (the maxima and counts start at 0)
    amax, over = scratch[:len(layers)].view(torch.float32), scratch[len(layers):]
    fmt = layers[0].recipe.casts["w"][0]
    fmt_max, mbits, emin = FP8_FORMATS[fmt.dtype]
    _delayed_cast_kernel[(tw.numel(),)](table, tw, amax, over, FP8_MAX=fmt_max, MBITS=mbits, EMIN=emin,
                                        E5M2=fmt.dtype == torch.float8_e5m2, CLIP_EDGE=clip_edge(fmt), TILE_=TILE)
    torch.autograd.graph.increment_version([t for m in layers for t in (m.fp8_w, m.fp8_w_scale, m.fp8_w_inv,
                                                                          m.fp8_wt_scale, m.fp8_wt_inv)])
    return push_histories(layers, (amax.unbind(), over.unbind()))


def traffic(layers):
    """(launches, bytes) of push_histories: the table's copy and one launch, reading and writing
    each layer's buffers (nanofp8/schedule.py counts a step with it)."""
    total = 0
    for m in layers:
        total += (len(BUFFERS) + 3) * 8 + sum(2 * getattr(m, name).nbytes for name in BUFFERS)
    return 2, total


def traffic_casts(layers):
    """(launches, bytes) of cast_weights: the table's copy, the zeroed scratch, the casts (each
    weight read once, W written, and W^T where kept apart), and push_histories'."""
    total = len(layers) * ((NSLOT + NMETA + 8) * 8 + 8)
    for m in layers:
        tiles = cdiv(m.weight.shape[0], TILE) * cdiv(m.weight.shape[1], TILE)
        total += m.weight.numel() * (m.weight.element_size() + (2 if _own_wt(m) else 1)) + tiles * 12
    launches, pushed = traffic(layers)
    return 3 + launches, total + pushed
