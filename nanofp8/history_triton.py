"""
Delayed scaling's amax histories, every layer's in one Triton launch (on a GPU).

Under delayed scaling (nanofp8/fp8.py, Fp8Linear.delayed_quantize) each cast takes its scale from
the amaxes of earlier casts and records its own amax in the layer's cast_log; a compiled graph
leaves the histories to o2_compile.push_amaxes, which train.py calls after each backward, and the
O1 step after its weight casts. Fp8Linear.push_history is the readable reference: per layer, put
each role's recorded amax at the front of its history (a finite one only), add up the counters,
zero the log, and make each role's next scale and its inverse from the history. Those are about
fifteen tiny operators per layer: compiled for all layers, inductor still made about twelve
kernels of each layer's, some 600 launches per push at GPT-2's 48 layers, after every micro-step.

Here one program does one layer's push, all three roles at once, reading a table of the layer's
buffers' addresses: one launch for the whole model, its bytes a few hundred per layer. The
arithmetic is the reference's: the float64 log's amax rounded to fp32, the scales by
kernels._scale_from_amax (fp8.compute_scale's float64 division), their inverses a correctly
rounded division (torch's reciprocal), counts converted from float64 by truncation (torch's
.long()). tests/test_history_triton.py holds every buffer bit-equal to push_history's over
adversarial logs (NaN and inf amaxes, zero counts, a history that wraps), in Triton's interpreter;
tests/test_sm90_compile.py compiles it for sm_90.

What it takes (takes_layers): layers in training under delayed scaling, the scale rule
fp8.compute_scale, one recipe's numbers (history length, amax algorithm, formats, margin, power of
two) for all, their buffers contiguous.
"""

import torch
import triton
import triton.language as tl

from kernels import FLT_MAX, FP8_FORMATS, _scale_from_amax
from nanofp8.fp8 import CAST_LOG, compute_scale
from nanofp8.optim_foreach import host_to_device

# a layer's row of the table: the addresses of its buffers, in this order
BUFFERS = ("cast_log", "amax_history", "history_count", "nonfinite", "cast_values", "clipped", "scale",
           "next_scale_0", "next_scale_1", "next_scale_2", "next_inv_0", "next_inv_1", "next_inv_2")
NBUF = tl.constexpr(len(BUFFERS))
NLOG = tl.constexpr(len(CAST_LOG))  # (amax, nonfinite, values, clipped, scale)


@triton.jit
def _buf(table, slot: tl.constexpr, TY: tl.constexpr):
    """This program's layer's buffer BUFFERS[slot], typed."""
    return tl.load(table + tl.program_id(0) * NBUF + slot).to(tl.pointer_type(TY))


@triton.jit
def _push_kernel(table, H: tl.constexpr, HP: tl.constexpr, MOST_RECENT: tl.constexpr, FWD_MAX: tl.constexpr,
                 BWD_MAX: tl.constexpr, MARGIN_MUL: tl.constexpr, POW2: tl.constexpr):
    """Fp8Linear.push_history of one layer per program (H: the history's length, HP: a power of two
    at least H; the roles INPUT, WEIGHT, GRAD_OUTPUT are rows 0-2 of 4)."""
    r = tl.arange(0, 4)
    rm = r < 3
    log = _buf(table, 0, tl.float64) + r * NLOG
    amax = tl.load(log, mask=rm, other=0.0).to(tl.float32)
    values = tl.load(log + 2, mask=rm, other=0.0)
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


def takes_layers(layers):
    """Whether push_histories takes these Fp8Linear layers (see the docstring above)."""
    if not layers:
        return False
    kinds = {(m.recipe.history_len, m.recipe.amax_algo, m.recipe.fwd_fmt.dtype, m.recipe.bwd_fmt.dtype,
              m.recipe.margin, m.recipe.power_of_two) for m in layers}
    return (len(kinds) == 1 and all(m.recipe.scaling == "delayed" and m.recipe.scale_rule is compute_scale
                                    for m in layers)
            and all(getattr(m, name).is_contiguous() for m in layers for name in BUFFERS))


def push_histories(layers):
    """Fp8Linear.push_history of every layer, in one launch (takes_layers: None where it does not
    take them)."""
    if not takes_layers(layers):
        return None
    r = layers[0].recipe
    table = host_to_device([[getattr(m, name).data_ptr() for name in BUFFERS] for m in layers], torch.int64,
                           layers[0].amax_history.device)
    H = r.history_len
    _push_kernel[(len(layers),)](table, H=H, HP=triton.next_power_of_2(H), MOST_RECENT=r.amax_algo == "most_recent",
                                 FWD_MAX=FP8_FORMATS[r.fwd_fmt.dtype][0], BWD_MAX=FP8_FORMATS[r.bwd_fmt.dtype][0],
                                 MARGIN_MUL=2.0**-r.margin, POW2=r.power_of_two)
    torch.autograd.graph.increment_version([getattr(m, name) for m in layers for name in BUFFERS])
    return True


def traffic(layers):
    """(launches, bytes) of push_histories: the table's copy and one launch, reading and writing
    each layer's buffers (nanofp8/schedule.py counts a step with it)."""
    total = 0
    for m in layers:
        total += len(BUFFERS) * 8 + sum(2 * getattr(m, name).nbytes for name in BUFFERS)
    return 2, total
