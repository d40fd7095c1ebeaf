"""
The O2 step of a whole param group in three Triton launches: Fp8AdamW(fused=True) on a GPU.
(And, with the same kernels, the other per-weight work of a step: O1's weight casts, the gradients'.)

nanofp8/optim.py's loop (foreach=False) is the lesson and the reference: per O2 weight it
dequantizes the FP8 gradient, m, v and the fp16 master, runs AdamW in fp32, rounds the new m, v
(a scale per block of 128 values) and the master (a scale for the tensor) back stochastically,
then casts the new weight to FP8 for the next forward (W, W^T). Its compiled twin
(nanofp8/optim_fused.py) fuses one weight's update into about 5 kernels and the cast into 4 more:
9 launches per weight, 430 for GPT-2's 48 O2 weights, each too small to fill a GPU, and 56 B moved
per value. Here every weight of the group is one launch's work (multi-tensor: a table of each
weight's tensors' addresses, and of which weight each program works on), and each launch reads
the state once:

    1. _adam_amax_kernel   per program 8 blocks of 128 values of one weight: the new fp32 weight
                           (AdamW from g, m, v and the master), and the largest |value| of each
                           weight (an atomic max per program: the same value in any order).
                           Reads g 1 B, m 1 B, v 2 B (1 B as sqrt(v) in E4M3), the master 2 B.
    2. _adam_store_kernel  the same update again (recomputing costs the 6 B read; keeping the
                           fp32 weight between launches would cost 8: write 4, read 4), now with
                           the master's scale, which needed the whole tensor's amax (launch 1).
                           Rounds m and v per block and the master per tensor, stochastically, and
                           stores them in place (each value is read and written by one program).
                           Writes 5 B, and the new master's amax (atomic max).
    3. _cast_weight_kernel the FP8 W (and W^T where the layer keeps a copy of its own) of the new
                           master, under its tensor scale, tile by tile (a tile transposed in
                           registers: W^T costs no second read). Reads 2 B, writes 1 B per copy.

About 20 B per value, 3 launches (and a copy of the table, and a zeroed buffer for the maxima)
for all weights. The rounding noise is the same counter hash (optim.counter_noise) computed where
it is used, in uint32 arithmetic (the reference's int64 products masked to 32 bits are products mod
2^32, which uint32's wrap is): the same bits, no tensor of noise. Beside the step, on a GPU: the
summed gradients' casts with their norms for clipping measured in the same pass (cast_sums: two
launches for all weights, the sums of squares added in a fixed order; optim_foreach.fp8_grads,
fp8_norms; norms measures a gradient whose scale changed since), and O1's FP8 weight casts after
its optimizer's step (cast_weights: each fp32 weight's amax, then launch 3;
o2_compile.cast_for_step), where compiled code launched four kernels per weight.

Numerics. Each operation is the reference's, in its order, rounded as IEEE fp32 rounds it: the
divisions and square roots correctly rounded (div_rn, sqrt_rn: Triton's default `/` and sqrt are
approximate on a GPU), the scales by the reference's rules (kernels._scale_from_amax for E4M3;
_pow2_scale, from exponent bits, for the fp16 formats), the final casts round to nearest even.
Where a compiler fuses a multiply and an add (nvcc in torch's CUDA kernels, LLVM in Triton's, AVX2
in torch's CPU lerp), or a library's square root is not correctly rounded (this CPU's torch.sqrt,
now and then), an fp32 intermediate differs by an ulp, and a value that lands on the other side of
its stochastic rounding's threshold is stored one code away. tests/test_optim_triton.py runs the
kernels in Triton's interpreter: their building blocks bit-equal to optim.py's functions, the step
within test_fused_step_matches_the_loop's bounds of the fused step's code; tests/test_sm90_compile.py
compiles them for sm_90 (correctly rounded, no flush of subnormals, no spills).

What it takes (steps() says it per weight; the others take optim_fused's compiled step): O2
weights unsharded, 2-D, in blocks of 128 values, their state contiguous. Launch 3 makes the
recipe's cast where it is current scaling with one scale for the tensor and W^T its transpose
(casts_weights); else o2_compile.refresh_all casts after launch 2.

O3 (nanofp8/zero.py) takes launches 1 and 2 for its shards (update_shards; steps_shard says which):
the gradient is the reduce-scattered fp32 shard, times the clipping factor as it is read, and
launch 2 also casts the shard's new fp32 weight to E4M3 under the scale of the whole weight's amax
(launch 1's, a MAX over the ranks between the launches), the bytes the ranks then all-gather;
_place_kernel puts the gathered bytes into the weights. The master's scale is the shard's own.
"""

import struct
import warnings

import torch
import triton
import triton.language as tl

from kernels import FLT_MAX, FP8_FORMATS, _abs_for_amax, _scale_from_amax, _store_fp8, cdiv
from nanofp8.fp8 import compute_scale
from nanofp8.optim import E4M3, FP16, STATE_BLOCK, noise_bits, noise_key
from nanofp8.optim_foreach import host_to_device

ROWS = 8  # blocks of STATE_BLOCK values per program of launches 1 and 2 (1024 values)
TILE = 64  # launch 3's tiles: TILE x TILE values of W
# the tensors of a weight, in the order of its row of the address table
SLOTS = ("g", "g_scale", "w", "w_scale", "m", "m_scale", "v", "v_scale",
         "qw", "qw_scale", "qw_inv", "qwt", "qwt_scale", "qwt_inv")
NSLOT = len(SLOTS)
# a weight's row of the int64 table of numbers: its blocks, rows and columns, the number of its first
# element (O3: its shard's), its first program in launches 1-2 and in launch 3, the noise keys
META = ("blocks", "rows", "cols", "start", "first_program", "first_tile", "key_master", "key_m", "key_v")
NMETA = len(META)


# -----------------------------------------------------------------------------
# Building blocks: the reference's functions, value by value


@triton.jit
def _mix32(x):
    """optim.mix32 on uint32 values (its products mod 2^32 are uint32's wrapping multiply)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _noise(key, element, BITS: tl.constexpr):
    """optim.counter_noise(key, element, BITS): int32 in [-2^(BITS-1), 2^(BITS-1))."""
    k = key.to(tl.uint32)
    lo = (element & 0xFFFFFFFF).to(tl.uint32)
    hi = (element >> 32).to(tl.uint32)
    h = _mix32(_mix32(lo ^ k) + k + hi)
    return (h >> (32 - BITS)).to(tl.int32) - (1 << (BITS - 1))


@triton.jit
def _round_stochastic(y, noise, MAX: tl.constexpr, AT_LEAST: tl.constexpr):
    """optim.round_stochastic before its final cast (AT_LEAST = 1.5 x the format's smallest
    normal): |y| dithered by the noise at its own exponent, the sign put back, clamped."""
    mag = tl.abs(y)
    at = tl.maximum(mag, AT_LEAST)
    dither = (at.to(tl.int32, bitcast=True) + noise).to(tl.float32, bitcast=True) - at
    sign = tl.where(y > 0, 1.0, tl.where(y < 0, -1.0, 0.0))  # torch.sign: +0 for +-0
    return tl.minimum(tl.maximum((mag + dither) * sign, -MAX), MAX)


@triton.jit
def _pow2_scale(amax, TARGET: tl.constexpr, TARGET_EXP: tl.constexpr):
    """optim.fp16_scale(amax, TARGET): 2^k for the largest k with amax * 2^k <= TARGET
    (TARGET_EXP = floor(log2 TARGET)), k within +-126; 1.0 for an amax of 0 or not finite.
    From the exponent bits, where the reference takes a float64 log2: the same k."""
    bits = amax.to(tl.int32, bitcast=True)
    k = TARGET_EXP - (((bits >> 23) & 0xFF) - 127)
    mantissa = ((bits & 0x7FFFFF) | (127 << 23)).to(tl.float32, bitcast=True)  # in [1, 2)
    k = tl.where(mantissa * (2.0**TARGET_EXP) <= TARGET, k, k - 1)  # (a subnormal amax: clamped)
    k = tl.minimum(tl.maximum(k, -126), 126)
    good = (amax > 0) & (amax <= FLT_MAX)
    return tl.where(good, ((k + 127) << 23).to(tl.float32, bitcast=True), 1.0)


NSLOT_C = tl.constexpr(NSLOT)
NMETA_C = tl.constexpr(NMETA)
ROW_C = tl.constexpr(NSLOT + NMETA + 8)  # a weight's row of the table: addresses, META, NUMBERS


@triton.jit
def _addr(table, w, slot: tl.constexpr, TY: tl.constexpr):
    """The address of weight w's tensor SLOTS[slot], typed."""
    return tl.load(table + w * ROW_C + slot).to(tl.pointer_type(TY))


@triton.jit
def _fp8_addr(table, w, slot: tl.constexpr, E5M2: tl.constexpr):
    """_addr of an FP8 tensor: E5M2 or E4M3."""
    if E5M2:
        return _addr(table, w, slot, tl.float8e5)
    else:
        return _addr(table, w, slot, tl.float8e4nv)


@triton.jit
def _meta(table, w, field: tl.constexpr):
    """META[field] of weight w (int64)."""
    return tl.load(table + w * ROW_C + NSLOT_C + field)


@triton.jit
def _number(table, w, k: tl.constexpr):
    """optim_fused.NUMBERS[k] of weight w: the fp32 number, stored as its bits."""
    return tl.load(table + w * ROW_C + NSLOT_C + NMETA_C + k).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _tile(table, tile_weight, TILE_: tl.constexpr):
    """This program's tile of a weight (R, C): (weight number, R, C, the tile's number in its
    weight, its rows, its columns, its mask)."""
    wi = tl.load(tile_weight + tl.program_id(0))
    R, C = _meta(table, wi, 1), _meta(table, wi, 2)
    t = tl.program_id(0) - _meta(table, wi, 5)
    n_col_tiles = tl.cdiv(C, TILE_)
    rows = (t // n_col_tiles) * TILE_ + tl.arange(0, TILE_)
    cols = (t % n_col_tiles) * TILE_ + tl.arange(0, TILE_)
    return wi, R, C, t, rows, cols, (rows[:, None] < R) & (cols[None, :] < C)


@triton.jit
def _dequantize(ptr, scale_ptr, offs, rows, mask, rmask, TY: tl.constexpr):
    """optim.dequantize_blocks: data (fp32) times the reciprocal of its block's scale."""
    inv = tl.div_rn(1.0, tl.load(scale_ptr + rows, mask=rmask, other=1.0))
    if TY == tl.float8e4nv:  # (E4M3's NaN, 0x7F or 0xFF, put back: Triton's interpreter decodes it as 480)
        bits = tl.load(ptr.to(tl.pointer_type(tl.uint8)) + offs, mask=mask, other=0)
        x = tl.where((bits & 0x7F) == 0x7F, float("nan"), bits.to(tl.float8e4nv, bitcast=True).to(tl.float32))
    else:
        x = tl.load(ptr.to(tl.pointer_type(TY)) + offs, mask=mask, other=0.0).to(tl.float32)
    return x * inv[:, None]


@triton.jit
def _adam_tile(table, prog_weight, V_FP8: tl.constexpr, ROWS_: tl.constexpr, B: tl.constexpr,
               G_FP32: tl.constexpr):
    """This program's blocks of Fp8AdamW.update (optim_fused.update_one's operations, in its
    order): (weight number, block numbers, element offsets, masks, new fp32 weight, m, v).
    G_FP32: the gradient is an fp32 shard (O3), times its clipping factor (slot g_scale)."""
    p = tl.program_id(0)
    wi = tl.load(prog_weight + p)
    rows = (p - _meta(table, wi, 4)) * ROWS_ + tl.arange(0, ROWS_)
    rmask = rows < _meta(table, wi, 0)
    offs = rows[:, None] * B + tl.arange(0, B)[None, :]
    mask = rmask[:, None] & (offs >= 0)
    if G_FP32:  # (zero.py multiplies the shard by the factor before its update: the same product)
        g = tl.load(_addr(table, wi, 0, tl.float32) + offs, mask=mask, other=0.0) * tl.load(
            _addr(table, wi, 1, tl.float32))
    else:
        g = _dequantize(_addr(table, wi, 0, tl.float8e4nv), _addr(table, wi, 1, tl.float32), offs, rows, mask,
                        rmask, tl.float8e4nv)
    w_inv = tl.div_rn(1.0, tl.load(_addr(table, wi, 3, tl.float32)))  # (one scale for the master)
    w = tl.load(_addr(table, wi, 2, tl.float16) + offs, mask=mask, other=0.0).to(tl.float32) * w_inv
    m = _dequantize(_addr(table, wi, 4, tl.float8e4nv), _addr(table, wi, 5, tl.float32), offs, rows, mask, rmask,
                    tl.float8e4nv)
    if V_FP8:  # sqrt(v) in E4M3
        v = _dequantize(_addr(table, wi, 6, tl.float8e4nv), _addr(table, wi, 7, tl.float32), offs, rows, mask,
                        rmask, tl.float8e4nv)
        v = v * v
    else:
        v = _dequantize(_addr(table, wi, 6, tl.float16), _addr(table, wi, 7, tl.float32), offs, rows, mask,
                        rmask, tl.float16)
    one_b1, b2, one_b2 = _number(table, wi, 0), _number(table, wi, 1), _number(table, wi, 2)
    m = m + one_b1 * (g - m)  # torch.lerp with a weight below 1/2
    v = v * b2 + one_b2 * g * g
    root = tl.sqrt_rn(v)
    lim = root * _number(table, wi, 3)
    m = tl.maximum(tl.minimum(m, lim), lim * -1.0)
    w = w * _number(table, wi, 4)
    denom = tl.div_rn(root, _number(table, wi, 5)) + _number(table, wi, 7)
    w = w + tl.div_rn(_number(table, wi, 6) * m, denom)
    return wi, rows, offs, mask, rmask, w, m, v


# -----------------------------------------------------------------------------
# The three launches


@triton.jit
def _adam_amax_kernel(table, prog_weight, amax_w, V_FP8: tl.constexpr, ROWS_: tl.constexpr, B: tl.constexpr,
                      G_FP32: tl.constexpr = False):
    """Launch 1: max |new weight| of each weight (an atomic max: the same value in any order)."""
    wi, rows, offs, mask, rmask, w, m, v = _adam_tile(table, prog_weight, V_FP8, ROWS_, B, G_FP32)
    tl.atomic_max(amax_w + wi, tl.max(tl.max(tl.where(mask, tl.abs(w), 0.0), axis=1), axis=0))


@triton.jit
def _store_e4m3(ptr, scale_ptr, x, noise, offs, rows, mask, rmask):
    """optim.quantize_blocks(x, E4M3, noise): a scale per block (row), stored in place."""
    scale = _scale_from_amax(tl.max(tl.where(mask, tl.abs(x), 0.0), axis=1), 448.0, 1.0, False)
    y = _round_stochastic(x * scale[:, None], noise, 448.0, 1.5 * 2.0**-6)
    _store_fp8(ptr.to(tl.pointer_type(tl.float8e4nv)) + offs, y, 1.0, mask, 448.0, 3, -6)
    tl.store(scale_ptr + rows, scale, mask=rmask)


@triton.jit
def _adam_store_kernel(table, prog_weight, amax_w, amax_q, s_new, V_FP8: tl.constexpr, ROWS_: tl.constexpr,
                       B: tl.constexpr, BITS16: tl.constexpr, BITS8: tl.constexpr, SHARD: tl.constexpr = False):
    """Launch 2: the same update, then the master, m and v rounded into their formats.
    SHARD (O3: fp32 gradient shards): also this rank's part of the FP8 weight, cast from the new
    fp32 weight under the scale of the whole weight's amax (amax_q: launch 1's maxima of every
    rank, all-reduced), into slot qw, and that scale and its inverse into the slots after it."""
    wi, rows, offs, mask, rmask, w, m, v = _adam_tile(table, prog_weight, V_FP8, ROWS_, B, SHARD)
    p = tl.program_id(0)
    if SHARD:  # (gather_shared_scale's quantize, under compute_scale(amax, E4M3))
        scale = _scale_from_amax(tl.load(amax_q + wi), 448.0, 1.0, False)
        _store_fp8(_addr(table, wi, 8, tl.float8e4nv) + offs, w, scale, mask, 448.0, 3, -6)
        if p == _meta(table, wi, 4):
            for slot in tl.static_range(9, 14, 3):
                if tl.load(table + wi * ROW_C + slot) != 0:
                    tl.store(_addr(table, wi, slot, tl.float32), scale)
                    tl.store(_addr(table, wi, slot + 1, tl.float32), tl.div_rn(1.0, scale))
    element = _meta(table, wi, 3) + offs  # (the noise's counter: the element's number in its weight)
    # the master: fp16 under the tensor's power-of-two scale (optim.to_fp16_scaled)
    s = _pow2_scale(tl.load(amax_w + wi), 4096.0, 12)
    if p == _meta(table, wi, 4):
        tl.store(s_new + wi, s)
    master = _round_stochastic(w * s, _noise(_meta(table, wi, 6), element, BITS16), 65504.0, 1.5 * 2.0**-14)
    master = master.to(tl.float16)
    tl.store(_addr(table, wi, 2, tl.float16) + offs, master, mask=mask)
    if not SHARD:  # (launch 3's amax)
        tl.atomic_max(amax_q + wi, tl.max(tl.max(tl.where(mask, tl.abs(master.to(tl.float32)), 0.0), axis=1),
                                          axis=0))
    _store_e4m3(_addr(table, wi, 4, tl.uint8), _addr(table, wi, 5, tl.float32), m,
                _noise(_meta(table, wi, 7), element, BITS8), offs, rows, mask, rmask)
    if V_FP8:
        _store_e4m3(_addr(table, wi, 6, tl.uint8), _addr(table, wi, 7, tl.float32), tl.sqrt_rn(v),
                    _noise(_meta(table, wi, 8), element, BITS8), offs, rows, mask, rmask)
    else:  # fp16 under a power-of-two scale per block (optim.quantize_blocks with FP16)
        scale = _pow2_scale(tl.max(tl.where(mask, tl.abs(v), 0.0), axis=1), 16376.0, 13)
        y = _round_stochastic(v * scale[:, None], _noise(_meta(table, wi, 8), element, BITS16), 65504.0,
                              1.5 * 2.0**-14)
        tl.store(_addr(table, wi, 6, tl.float16) + offs, y.to(tl.float16), mask=mask)
        tl.store(_addr(table, wi, 7, tl.float32) + rows, scale, mask=rmask)


@triton.jit
def _cast_weight_kernel(table, tile_weight, amax_q, s_new, FP8_MAX: tl.constexpr, MBITS: tl.constexpr,
                        EMIN: tl.constexpr, MARGIN_MUL: tl.constexpr, POW2: tl.constexpr, E5M2: tl.constexpr,
                        TILE_: tl.constexpr, MASTER: tl.constexpr = True):
    """Launch 3: the FP8 cast of each new weight (fp8.quantize, one scale for the tensor: its amax
    from launch 2's atomic max), W and W^T, and the master's new scale. MASTER=False: O1's fp32
    weights (cast_weights), their amaxes from _weights_amax_kernel."""
    wi, R, C, t, rows, cols, mask = _tile(table, tile_weight, TILE_)
    if MASTER:
        s = tl.load(s_new + wi)
        inv = tl.div_rn(1.0, s)  # (a power of two: hp_weight = master * inv is exact, and so is its amax)
        scale = _scale_from_amax(tl.load(amax_q + wi) * inv, FP8_MAX, MARGIN_MUL, POW2)
        x = tl.load(_addr(table, wi, 2, tl.float16) + rows[:, None] * C + cols[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32) * inv
    else:
        scale = _scale_from_amax(tl.load(amax_q + wi), FP8_MAX, MARGIN_MUL, POW2)
        x = tl.load(_addr(table, wi, 2, tl.float32) + rows[:, None] * C + cols[None, :], mask=mask, other=0.0)
    _store_fp8(_fp8_addr(table, wi, 8, E5M2) + rows[:, None] * C + cols[None, :], x, scale, mask, FP8_MAX, MBITS, EMIN)
    if tl.load(table + wi * ROW_C + 11) != 0:  # the layer keeps W^T apart (else a view of W)
        _store_fp8(_fp8_addr(table, wi, 11, E5M2) + cols[:, None] * R + rows[None, :], tl.trans(x), scale,
                   tl.trans(mask), FP8_MAX, MBITS, EMIN)
    if t == 0:
        q_inv = tl.div_rn(1.0, scale)
        for slot in tl.static_range(9, 14, 3):
            tl.store(_addr(table, wi, slot, tl.float32), scale)
            tl.store(_addr(table, wi, slot + 1, tl.float32), q_inv)
        if MASTER:
            tl.store(_addr(table, wi, 3, tl.float32), s)


@triton.jit
def _place_kernel(table, prog_weight, recv, row_len, ROWS_: tl.constexpr, B: tl.constexpr):
    """O3's FP8 weights from the all-gathered shards: row r of recv holds rank r's shard of every
    weight, one after another (row_len bytes). table rows: the weight, its values, its shard's
    length, the shard's offset in a row, its first program."""
    p = tl.program_id(0)
    wi = tl.load(prog_weight + p)
    n, c, off = tl.load(table + wi * 5 + 1), tl.load(table + wi * 5 + 2), tl.load(table + wi * 5 + 3)
    e = (p - tl.load(table + wi * 5 + 4)) * (ROWS_ * B) + tl.arange(0, ROWS_ * B)
    x = tl.load(recv + (e // c) * row_len + off + e % c, mask=e < n)
    tl.store(tl.load(table + wi * 5).to(tl.pointer_type(tl.uint8)) + e, x, mask=e < n)


@triton.jit
def _weights_amax_kernel(table, tile_weight, amax, TILE_: tl.constexpr):
    """max |W| of each fp32 weight (cast_weights), tile by tile, an atomic max per tile (a NaN's
    as inf: the cast's scale falls back to 1.0 for either)."""
    wi, R, C, t, rows, cols, mask = _tile(table, tile_weight, TILE_)
    x = tl.load(_addr(table, wi, 2, tl.float32) + rows[:, None] * C + cols[None, :], mask=mask, other=0.0)
    tl.atomic_max(amax + wi, tl.max(tl.max(_abs_for_amax(x), axis=1), axis=0))


@triton.jit
def _cast_sums_kernel(table, prog_weight, partial, ROWS_: tl.constexpr, B: tl.constexpr):
    """The FP8 gradients of the summed micro-steps (optim_foreach._cast_sums): each weight's fp16
    sum (one power-of-two scale) dequantized and cast to E4M3 with a scale per block of B values
    (optim.quantize_wgrad), its block amaxes kept (a NaN's as inf: non-finite all the same), and
    the sum of squares of this program's dequantized FP8 values (their norm: _norms_kernel).
    table rows: the sum, its scale, the E4M3 data, its scales, its amaxes; blocks; first program."""
    p = tl.program_id(0)
    wi = tl.load(prog_weight + p)
    rows = (p - tl.load(table + wi * 7 + 6)) * ROWS_ + tl.arange(0, ROWS_)
    rmask = rows < tl.load(table + wi * 7 + 5)
    offs = rows[:, None] * B + tl.arange(0, B)[None, :]
    mask = rmask[:, None] & (offs >= 0)
    inv = tl.div_rn(1.0, tl.load(tl.load(table + wi * 7 + 1).to(tl.pointer_type(tl.float32))))
    x = tl.load(tl.load(table + wi * 7).to(tl.pointer_type(tl.float16)) + offs, mask=mask, other=0.0)
    x = x.to(tl.float32) * inv
    amax = tl.max(_abs_for_amax(x), axis=1)
    scale = _scale_from_amax(amax, 448.0, 1.0, False)
    r = _store_fp8(tl.load(table + wi * 7 + 2).to(tl.pointer_type(tl.float8e4nv)) + offs, x, scale[:, None], mask,
                   448.0, 3, -6)
    d = tl.where(tl.abs(x) <= FLT_MAX, r, float("nan")) * tl.div_rn(1.0, scale)[:, None]  # (dequantize_blocks)
    tl.store(partial + p, tl.sum(tl.sum(d * d, axis=1), axis=0))
    tl.store(tl.load(table + wi * 7 + 3).to(tl.pointer_type(tl.float32)) + rows, scale, mask=rmask)
    tl.store(tl.load(table + wi * 7 + 4).to(tl.pointer_type(tl.float32)) + rows, amax, mask=rmask)


@triton.jit
def _square_sums_kernel(table, prog_weight, partial, ROWS_: tl.constexpr, B: tl.constexpr):
    """The sum of squares of each program's values of the dequantized FP8 gradients (for their
    norms). table rows: data, block scales, blocks, first program."""
    p = tl.program_id(0)
    wi = tl.load(prog_weight + p)
    rows = (p - tl.load(table + wi * 4 + 3)) * ROWS_ + tl.arange(0, ROWS_)
    rmask = rows < tl.load(table + wi * 4 + 2)
    offs = rows[:, None] * B + tl.arange(0, B)[None, :]
    x = _dequantize(tl.load(table + wi * 4).to(tl.pointer_type(tl.float8e4nv)),
                    tl.load(table + wi * 4 + 1).to(tl.pointer_type(tl.float32)), offs, rows,
                    rmask[:, None] & (offs >= 0), rmask, tl.float8e4nv)
    tl.store(partial + p, tl.sum(tl.sum(x * x, axis=1), axis=0))


@triton.jit
def _norms_kernel(table, partial, norms, ROW: tl.constexpr, BLOCKS_AT: tl.constexpr, P_BLOCK: tl.constexpr,
                  ROWS_: tl.constexpr):
    """Each weight's norm: the root of the sum of its programs' sums, added in order (the same
    bits on every run, where atomic adds would not be). A weight's row of the table (ROW numbers)
    holds its blocks at BLOCKS_AT and its first program after them."""
    wi = tl.program_id(0)
    first, count = tl.load(table + wi * ROW + BLOCKS_AT + 1), tl.cdiv(tl.load(table + wi * ROW + BLOCKS_AT), ROWS_)
    acc = tl.zeros([P_BLOCK], tl.float32)
    for c in range(0, count, P_BLOCK):
        i = c + tl.arange(0, P_BLOCK)
        acc += tl.load(partial + first + i, mask=i < count, other=0.0)
    tl.store(norms + wi, tl.sqrt_rn(tl.sum(acc, axis=0)))


# -----------------------------------------------------------------------------
# The host side: tables, launches


def steps(opt, mod, q):
    """Whether the O2 weight of layer `mod` (FP8 gradient q) of an Fp8AdamW steps here: unsharded,
    2-D, in blocks of STATE_BLOCK values, every stored tensor contiguous."""
    if opt.sharded or opt.moments["m"].fmt is not E4M3 or opt.moments["v"].fmt not in (E4M3, FP16):
        return False
    w, st = mod.weight, opt.state[mod.weight]
    return (w.dim() == 2 and w.numel() % STATE_BLOCK == 0 and q.data.dtype == E4M3.dtype
            and q.data.shape == (w.numel() // STATE_BLOCK, STATE_BLOCK)
            and all(t.is_contiguous() for t in (w, q.data, q.scale, *st.values())))


def casts_weights(mods):
    """Whether launch 3 makes these layers' FP8 weights as their own cast would (Fp8Linear.cast_weight:
    current scaling, one scale per tensor, W^T its transpose, fp8.compute_scale), all alike."""
    kinds = set()
    for mod in mods:
        r, how = mod.recipe, mod.recipe.casts["w"]
        if (r.scaling != "current" or how is None or how[1] != "tensor" or "w_t" not in r.transposes
                or r.scale_rule is not compute_scale or how[0].dtype not in FP8_FORMATS
                or getattr(mod, "_fp8_meta", None) is None or not mod.fp8_w.is_contiguous()):
            return False
        kinds.add((how[0].dtype, r.margin, r.power_of_two))
    return len(kinds) == 1


def _own_wt(mod):
    """Does the layer keep W^T in a buffer of its own (kernels.py's casts write one), or as a view of
    W (torch's cast: W^T is W's bytes, read transposed)?"""
    return mod.fp8_wt._base is None and mod.fp8_wt.is_contiguous()


def _programs(blocks, device, per=ROWS):
    """(which weight each program works on, each weight's first program) for weights of these
    numbers of blocks (or tiles), `per` a program: made once per list of sizes (kept here)."""
    key = (tuple(blocks), str(device), per)
    if key not in _PROGRAMS:
        progs = [cdiv(b, per) for b in blocks]
        pw = torch.repeat_interleave(torch.arange(len(blocks), dtype=torch.int32), torch.tensor(progs))
        _PROGRAMS[key] = pw.to(device), [sum(progs[:i]) for i in range(len(blocks))]
    return _PROGRAMS[key]


_PROGRAMS = {}  # (_programs' tables, by sizes and device)


def _layout(mods):
    """Which weight each program works on in launches 1-2 and in launch 3, on the device, and
    where each weight's begin: (pw, tw, blocks, (first programs, first tiles))."""
    shapes = [tuple(m.weight.shape) for m in mods]
    blocks = [r * c // STATE_BLOCK for r, c in shapes]
    pw, first_prog = _programs(blocks, mods[0].weight.device)
    tw, first_tile = _programs([cdiv(r, TILE) * cdiv(c, TILE) for r, c in shapes], mods[0].weight.device, 1)
    return pw, tw, blocks, (first_prog, first_tile)


def step_group(opt, group, o2, grads, ts, numbers, step_numbers):
    """Fp8AdamW's update of a group's O2 weights o2 (FP8 gradients grads, step counts ts, parameter
    numbers `numbers`), in three launches; then their FP8 casts for the next forward (launch 3, or
    o2_compile.refresh_all where launch 3 does not make the recipe's cast)."""
    from nanofp8.o2_compile import refresh_all

    mods = [opt.o2[p] for p in o2]
    sts = [opt.state[p] for p in o2]
    M, V = opt.moments["m"], opt.moments["v"]
    pw, tw, blocks, (first_prog, first_tile) = _layout(mods)
    cast = casts_weights(mods)
    rows = []
    for i, (mod, q, st, t, n) in enumerate(zip(mods, grads, sts, ts, numbers)):
        slots = [q.data, q.scale, mod.weight, mod.weight_scale, st[M.key], st[M.key + "_scale"], st[V.key],
                 st[V.key + "_scale"]]
        if cast:
            slots += [mod.fp8_w, mod.fp8_w_scale, mod.fp8_w_inv, mod.fp8_wt if _own_wt(mod) else None,
                      mod.fp8_wt_scale, mod.fp8_wt_inv]
        else:
            slots += [None] * 6
        keys = [noise_key(opt.seed, t, n, k) for k in range(3)]
        meta = [blocks[i], *mod.weight.shape, opt.shard_start(o2[i]), first_prog[i], first_tile[i], *keys]
        bits = struct.unpack("8i", struct.pack("8f", *step_numbers(t, group)))  # (each fp32 number's bits)
        rows.append([0 if s is None else s.data_ptr() for s in slots] + meta + list(bits))
    device = o2[0].device
    table = host_to_device(rows, torch.int64, device)
    n = len(o2)
    scratch = torch.zeros(3 * n, dtype=torch.float32, device=device)  # (the atomic maxima start at 0)
    amax_w, amax_q, s_new = scratch[:n], scratch[n:2 * n], scratch[2 * n:]
    v_fp8 = V.fmt is E4M3
    _adam_amax_kernel[(pw.numel(),)](table, pw, amax_w, V_FP8=v_fp8, ROWS_=ROWS, B=STATE_BLOCK)
    _adam_store_kernel[(pw.numel(),)](table, pw, amax_w, amax_q, s_new, V_FP8=v_fp8, ROWS_=ROWS, B=STATE_BLOCK,
                                      BITS16=noise_bits(FP16), BITS8=noise_bits(E4M3))
    # (a failure above, a compile's, has written no state: the caller steps these weights its own way)
    if cast:
        r = mods[0].recipe
        fmt_max, mbits, emin = FP8_FORMATS[r.casts["w"][0].dtype]
        try:
            _cast_weight_kernel[(tw.numel(),)](table, tw, amax_q, s_new, FP8_MAX=fmt_max, MBITS=mbits, EMIN=emin,
                                               MARGIN_MUL=2.0**-r.margin, POW2=r.power_of_two,
                                               E5M2=r.casts["w"][0].dtype == torch.float8_e5m2, TILE_=TILE)
        except Exception as e:  # (the state is written: the casts are made the recipe's way)
            warnings.warn(f"nanofp8: the O2 step's FP8 weight cast kernel failed ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}); the layers cast their weights")
            cast = False
    if not cast:  # the masters' new scales, then the recipe's own casts
        torch._foreach_copy_([m.weight_scale for m in mods], list(s_new.unbind()))
    # written where autograd does not see it: the weights, and the kept casts (a graph that saved one
    # for a backward still to run must fail as after the layer's own write)
    kept = [t for m in mods if cast for t in (m.fp8_w, m.fp8_w_scale, m.fp8_w_inv, m.fp8_wt_scale, m.fp8_wt_inv)]
    torch.autograd.graph.increment_version([m.weight for m in mods] + kept)
    if cast:
        for m in mods:
            m.mark_cast()
    else:
        refresh_all(mods)


def steps_shard(opt, mod, shard):
    """Whether O3's weight of layer `mod` (this rank's fp32 gradient shard) steps on update_shards:
    2-D, in blocks of STATE_BLOCK values, its FP8 weight under one E4M3 scale by fp8.compute_scale
    (the scale gather_shared_scale gives it), every stored tensor contiguous."""
    shape, granularity, _, rule = mod.weight_layout()
    st = opt.state[mod.weight]
    return (opt.moments["m"].fmt is E4M3 and opt.moments["v"].fmt in (E4M3, FP16) and len(shape) == 2
            and granularity == "tensor" and rule is compute_scale and mod.weight.dtype == E4M3.dtype
            and shard.dtype == torch.float32 and shard.dim() == 1 and shard.numel() % STATE_BLOCK == 0
            and st["master"].numel() == shard.numel() and mod.weight.is_contiguous()
            and all(t.is_contiguous() for t in (shard, *st.values())))


def _casts_are_views(mod):
    """Are an O3 layer's kept FP8 W and W^T (o2_compile.keep_cast) its weight's own bytes (a
    tensor scale: W as it is, W^T its transpose), so that writing the weight and the kept scales
    renews them?"""
    w = mod.weight
    return (getattr(mod, "_fp8_meta", None) is not None and "w_t" in mod.recipe.transposes
            and mod.fp8_w.data_ptr() == w.data_ptr() and mod.fp8_w.shape == w.shape
            and mod.fp8_wt.data_ptr() == w.data_ptr() and mod.fp8_wt.shape == w.shape[::-1]
            and mod.fp8_w_scale is not mod.weight_scale)


def update_shards(opt, group, ps, shards, coef, ts, numbers, step_numbers, share_amax):
    """ZeroFp8AdamW's update (nanofp8/zero.py) of a group's O3 weights ps, from this rank's fp32
    gradient shards times the clipping factor `coef` (a 0-d tensor), step counts ts and parameter
    numbers: launch 1 (each shard's new amax), share_amax (zero.py: the MAX over the ranks, in
    place), launch 2 (m, v and the master shard stored; the shard's FP8 weight under the shared
    scale, into one buffer for all weights). Returns (that buffer, place): zero.py gathers every
    rank's buffer (one row each) and gives it to place, which puts the bytes into the weights (one
    launch) and then the scales: the masters' (launch 2's), the FP8 weights' (and their kept
    casts', where those are the weight's own bytes; else the layers cast again)."""
    mods, sts = [opt.o2[p] for p in ps], [opt.state[p] for p in ps]
    M, V, device, n = opt.moments["m"], opt.moments["v"], ps[0].device, len(ps)
    lens = [s.numel() for s in shards]
    offsets = [sum(lens[:i]) for i in range(n)]
    send = torch.empty(sum(lens), dtype=E4M3.dtype, device=device)
    pw, first_prog = _programs([c // STATE_BLOCK for c in lens], device)
    scratch = torch.zeros(5 * n, dtype=torch.float32, device=device)  # (the atomic maxima start at 0)
    amax_w, s_new, scale, inv = scratch[:n], scratch[n:2 * n], scratch[2 * n:3 * n], scratch[3 * n:4 * n]
    views = [_casts_are_views(m) for m in mods]
    rows = []
    for i, (mod, st, t, k) in enumerate(zip(mods, sts, ts, numbers)):
        kept = [mod.fp8_w_scale, mod.fp8_w_inv, None, mod.fp8_wt_scale, mod.fp8_wt_inv] if views[i] else \
            [scale[i], inv[i], None, None, None]
        slots = [shards[i], coef, st["master"], st["master_scale"], st[M.key], st[M.key + "_scale"], st[V.key],
                 st[V.key + "_scale"], send[offsets[i]:], *kept]
        keys = [noise_key(opt.seed, t, k, j) for j in range(3)]
        meta = [lens[i] // STATE_BLOCK, 1, lens[i], opt.shard_start(ps[i]), first_prog[i], 0, *keys]
        bits = struct.unpack("8i", struct.pack("8f", *step_numbers(t, group)))
        rows.append([0 if x is None else x.data_ptr() for x in slots] + meta + list(bits))
    table = host_to_device(rows, torch.int64, device)
    v_fp8 = V.fmt is E4M3
    _adam_amax_kernel[(pw.numel(),)](table, pw, amax_w, V_FP8=v_fp8, ROWS_=ROWS, B=STATE_BLOCK, G_FP32=True)
    shared = share_amax(scratch[4 * n:].copy_(amax_w))
    _adam_store_kernel[(pw.numel(),)](table, pw, amax_w, shared, s_new, V_FP8=v_fp8, ROWS_=ROWS, B=STATE_BLOCK,
                                      BITS16=noise_bits(FP16), BITS8=noise_bits(E4M3), SHARD=True)

    def place(recv):
        from nanofp8.o2_compile import refresh_all

        weights = [m.weight for m in mods]
        pw, first = _programs([cdiv(w.numel(), STATE_BLOCK) for w in weights], device)
        rows = [[w.data_ptr(), w.numel(), c, o, f] for w, c, o, f in zip(weights, lens, offsets, first)]
        table = host_to_device(rows, torch.int64, device)
        _place_kernel[(pw.numel(),)](table, pw, recv, recv.shape[1], ROWS_=ROWS, B=STATE_BLOCK)
        fp8_scales = [m.fp8_w_scale if v else scale[i] for i, (m, v) in enumerate(zip(mods, views))]
        torch._foreach_copy_([st["master_scale"] for st in sts] + [m.weight_scale for m in mods],
                             [s.view(st["master_scale"].shape) for s, st in zip(s_new.unbind(), sts)]
                             + [s.view(m.weight_scale.shape) for s, m in zip(fp8_scales, mods)])
        torch.autograd.graph.increment_version(weights + [t for m, v in zip(mods, views) if v for t in (
            m.fp8_w_scale, m.fp8_w_inv, m.fp8_wt_scale, m.fp8_wt_inv)])
        for m, v in zip(mods, views):
            if v:
                m.mark_cast()
        refresh_all([m for m, v in zip(mods, views) if not v])

    return send.view(torch.uint8), place


def traffic(opt, o2, grads):
    """(launches, bytes) of step_group for these weights, as its kernels load and store them: the
    table's copy to the device and the zeroed maxima, launches 1 and 2 (each reads the gradient, m,
    v and the master with their scales; launch 2 writes m, v and the master with theirs), launch 3
    (reads the master, writes W, and W^T where the layer keeps its own); with the per-program
    tables and the atomic maxima. nanofp8/schedule.py counts a step with it (no GPU there)."""
    mods = [opt.o2[p] for p in o2]
    M, V = opt.moments["m"], opt.moments["v"]
    cast = casts_weights(mods)
    total = len(o2) * (NSLOT + NMETA + 8) * 8 + len(o2) * 12  # the table, the zeroed maxima
    for mod, q in zip(mods, grads):
        st = opt.state[mod.weight]
        state = [mod.weight, mod.weight_scale, st[M.key], st[M.key + "_scale"], st[V.key], st[V.key + "_scale"]]
        read = sum(t.numel() * t.element_size() for t in [q.data, q.scale, *state])
        written = sum(t.numel() * t.element_size() for t in state)
        programs = cdiv(mod.weight.numel() // STATE_BLOCK, ROWS)
        total += 2 * read + written + programs * 2 * (4 + 4)  # (+ each program's weight number, its max)
        if cast:
            tiles = cdiv(mod.weight.shape[0], TILE) * cdiv(mod.weight.shape[1], TILE)
            total += mod.weight.numel() * (mod.weight.element_size() + (2 if _own_wt(mod) else 1)) + tiles * 4
    return (5 if cast else 4), total


def takes_weights(layers):
    """Whether cast_weights takes these layers: fp32 weights, 2-D, contiguous, cast as launch 3 casts."""
    return casts_weights(layers) and all(m.weight.dtype == torch.float32 and m.weight.dim() == 2
                                         and m.weight.is_contiguous() for m in layers)


def weights_table(layers, head=lambda m: (None, None)):
    """(which weight each tile program casts, the table) of the launches that cast these layers'
    fp32 weights into their kept casts (W^T where the layer keeps its own): each layer's row holds
    its weight, the casts and their scales, and head(layer) in its first two slots."""
    shapes = [tuple(m.weight.shape) for m in layers]
    tw, first_tile = _programs([cdiv(r, TILE) * cdiv(c, TILE) for r, c in shapes], layers[0].weight.device, 1)
    rows = []
    for m, (r, c), f in zip(layers, shapes, first_tile):
        slots = [*head(m), m.weight, None, None, None, None, None, m.fp8_w, m.fp8_w_scale, m.fp8_w_inv,
                 m.fp8_wt if _own_wt(m) else None, m.fp8_wt_scale, m.fp8_wt_inv]
        rows.append([0 if t is None else t.data_ptr() for t in slots] + [0, r, c, 0, 0, f, 0, 0, 0] + [0] * 8)
    return tw, host_to_device(rows, torch.int64, layers[0].weight.device)


def cast_weights(layers):
    """O1's FP8 weight casts for the next forward (o2_compile.cast_for_step) in two launches for
    all layers (each weight's amax, then W and W^T as launch 3 makes them): the bytes and scales
    of the layer's own cast (cast_now). None where the kernels do not take these layers
    (takes_weights)."""
    if not takes_weights(layers):
        return None
    device = layers[0].weight.device
    tw, table = weights_table(layers)
    amax = torch.zeros(len(layers), dtype=torch.float32, device=device)
    fmt = layers[0].recipe.casts["w"][0].dtype
    _weights_amax_kernel[(tw.numel(),)](table, tw, amax, TILE_=TILE)
    fmt_max, mbits, emin = FP8_FORMATS[fmt]
    r = layers[0].recipe
    _cast_weight_kernel[(tw.numel(),)](table, tw, amax, amax, FP8_MAX=fmt_max, MBITS=mbits, EMIN=emin,
                                       MARGIN_MUL=2.0**-r.margin, POW2=r.power_of_two,
                                       E5M2=fmt == torch.float8_e5m2, TILE_=TILE, MASTER=False)
    torch.autograd.graph.increment_version([t for m in layers for t in (m.fp8_w, m.fp8_w_scale, m.fp8_w_inv,
                                                                          m.fp8_wt_scale, m.fp8_wt_inv)])
    return True


def traffic_casts(layers):
    """(launches, bytes) of cast_weights: the table's copy, the zeroed maxima, two launches (the
    amaxes read each weight, the casts read it again and write W, and W^T where kept apart)."""
    total = len(layers) * ((NSLOT + NMETA + 8) * 8 + 4)
    for m in layers:
        tiles = cdiv(m.weight.shape[0], TILE) * cdiv(m.weight.shape[1], TILE)
        total += m.weight.numel() * (2 * m.weight.element_size() + (2 if _own_wt(m) else 1)) + tiles * 8
    return 4, total


def takes_sums(accs):
    """Whether cast_sums takes these fp16 sums (data, scale): 2-D, in blocks of STATE_BLOCK values,
    contiguous, under one scale."""
    return all(d.dtype == torch.float16 and d.dim() == 2 and d.numel() % STATE_BLOCK == 0 and d.is_contiguous()
               and s.dim() == 0 and s.dtype == torch.float32 for d, s in accs)


def cast_sums(accs):
    """optim_foreach._cast_sums, and the norm of each FP8 gradient from the same pass, in two
    launches: [(E4M3 data (blocks, STATE_BLOCK), scales, amaxes, norm)]."""
    device = accs[0][0].device
    blocks = [d.numel() // STATE_BLOCK for d, _ in accs]
    pw, first = _programs(blocks, device)
    out = [(torch.empty(b, STATE_BLOCK, dtype=E4M3.dtype, device=device), torch.empty(b, 1, device=device),
            torch.empty(b, 1, device=device)) for b in blocks]
    table = host_to_device([[d.data_ptr(), s.data_ptr(), *(t.data_ptr() for t in o), b, f]
                            for (d, s), o, b, f in zip(accs, out, blocks, first)], torch.int64, device)
    partial, norms = torch.empty(pw.numel(), device=device), torch.empty(len(accs), device=device)
    _cast_sums_kernel[(pw.numel(),)](table, pw, partial, ROWS_=ROWS, B=STATE_BLOCK)
    _norms_kernel[(len(accs),)](table, partial, norms, ROW=7, BLOCKS_AT=5, P_BLOCK=256, ROWS_=ROWS)
    return [(*o, n) for o, n in zip(out, norms.unbind())]


def traffic_sums(accs):
    """(launches, bytes) of cast_sums: the table's copy and two launches (the cast reads each sum,
    writes the E4M3 data, a scale and an amax per block and a sum of squares per program; the
    norms read those sums)."""
    total = len(accs) * (7 * 8 + 4)
    for d, _ in accs:
        blocks = d.numel() // STATE_BLOCK
        total += d.numel() * (d.element_size() + 1) + blocks * 8 + cdiv(blocks, ROWS) * (4 + 4 + 4) + 4
    return 3, total


def takes_grads(qs):
    """Whether norms takes these FP8 gradients: E4M3 (blocks, STATE_BLOCK) with a scale per block."""
    return all(q.data.dtype == E4M3.dtype and q.data.dim() == 2 and q.data.shape[1] == STATE_BLOCK
               and q.data.is_contiguous() and q.scale.shape == (q.data.shape[0], 1) and q.scale.is_contiguous()
               for q in qs)


def norms(qs):
    """The 2-norm of each dequantized FP8 gradient, in two launches: a tensor of len(qs)."""
    device = qs[0].data.device
    blocks = [q.data.shape[0] for q in qs]
    pw, first = _programs(blocks, device)
    table = host_to_device([[q.data.data_ptr(), q.scale.data_ptr(), b, f] for q, b, f in zip(qs, blocks, first)],
                      torch.int64, device)
    partial = torch.empty(pw.numel(), device=device)
    out = torch.empty(len(qs), device=device)
    _square_sums_kernel[(pw.numel(),)](table, pw, partial, ROWS_=ROWS, B=STATE_BLOCK)
    _norms_kernel[(len(qs),)](table, partial, out, ROW=4, BLOCKS_AT=2, P_BLOCK=256, ROWS_=ROWS)
    return out


def traffic_norms(qs):
    """(launches, bytes) of norms: the table's copy and two launches (the sums of squares read the
    data and its scales; the norms read the sums)."""
    total = len(qs) * (4 * 8 + 4)
    for q in qs:
        programs = cdiv(q.data.shape[0], ROWS)
        total += q.data.numel() + q.scale.numel() * 4 + programs * (4 + 4 + 4)
    return 3, total
