"""
FP8 kernels in Triton: a persistent scaled GEMM and the quantizers that feed it
===============================================================================

nanofp8/fp8.py describes FP8 training in PyTorch; this file is the fast path underneath it.
It holds the two kinds of kernel an FP8 linear layer needs, written to be read top to bottom:

1. `quantize`: x (bf16/fp32) -> (fp8 data, fp32 scale), per tensor, per row, or per tile
   (1x128 for activations and gradients, 128x128 for weights, as in DeepSeek-V3), and
   `quantize_transpose`, which also writes the transposed copy that backward GEMMs read.
2. `fp8_gemm`: out = (a * a_inv) @ (b * b_inv)^T (+ bias), fp8 operands, fp32 accumulation.
3. `gemm_mx`: the same product for MXFP8 operands (E4M3 data, one E8M0 scale per 32 values of
   K), on `tl.dot_scaled`: Blackwell's block-scaled MMA on sm_100 (see its section below).

The GEMM
--------
Start from the grouped, tiled matmul of Triton's tutorial 03 and the persistent kernel of
tutorial 09. Each program owns a BLOCK_M x BLOCK_N tile of the output and walks K in steps of
BLOCK_K = 128, multiplying fp8 tiles on the tensor cores into an fp32 accumulator. On Hopper:

* Operand layout. FP8 wgmma only reads K-major operands: A as (M, K) row-major and B as
  (N, K) row-major (i.e. B^T column-major, the layout torch._scaled_mm asks for too). That is
  why every GEMM of the layer is written as A @ B^T with both operands quantized along K.
* TMA. The Tensor Memory Accelerator copies a whole 2-D tile from global to shared memory from
  one descriptor (base, shape, strides, box), zero-filling what falls outside the tensor, so
  ragged edges need no masks. We build descriptors on the device (`tl.make_tensor_descriptor`),
  which needs a little global scratch per program (hence `triton.set_allocator`) and 16-byte
  aligned rows: K % 16 == 0 for fp8 operands. Other shapes take a masked pointer path.
* Persistent schedule. We launch one program per SM and let each loop over output tiles
  (tile, tile + NUM_SMS, ...), so there is no second wave of launches and the compiler can
  overlap the epilogue of one tile with the loads of the next.
* Grouped order. Tiles are visited GROUP_M rows of tiles at a time, column by column, so the
  programs running together share A rows and B columns and mostly hit in L2.
* Accumulation. Hopper's FP8 MMA accumulates with fewer bits than fp32 (DeepSeek-V3 measured
  ~14, up to 2% relative error at K = 4096). Triton's `max_num_imprecise_acc` makes the compiler
  add the tensor-core partial sum into a true fp32 accumulator every that many elements of K;
  we use 128 unless `fast_accum=True` (the imprecise, faster mode used for forward GEMMs).
* Scales. A per-tensor or per-row scale is constant along K, so it factors out of the dot
  product and is applied once, in the epilogue. A block scale changes every 128 elements of K,
  so each 128-wide partial product is scaled as it is added to the fp32 accumulator: the
  "promote to fp32 every 128 of K" of DeepSeek-V3 comes for free.
* Launch plan. `gemm_plan(M, N, K, SMs)` picks the tile from the shape: the biggest tile whose
  work items keep >= 80% of the SMs busy over all rounds of the persistent loop (GPT-2's
  8192 x 768 projection gets 128x128: 384 tiles, 2.9 rounds of 132 SMs; 128x256 would make 192,
  1.45 rounds, 27% of the SM time idle). Where no tile fills the GPU (a 768 x 768 weight gradient
  summed over K = 8192 tokens: 36 tiles of 128x128) it splits K (below). A plan holds at most two
  configs of one tile size; the first call of a new shape times both (about 25 ms each after
  compiling) and keeps the faster.
* Split-K. With split_k = S each tile's K-blocks are cut into S runs, each summed by its own
  work item into an fp32 workspace; `_split_k_reduce_kernel` adds the S sums in order and runs
  the epilogue. Only the fp32 summation order changes: each output is still a sum of the same
  per-128 slice sums (each product of fp8 values exact in fp32), now grouped in S runs. Where all
  partial sums are exact (small integers, power-of-two scales) the result is bit-identical; in
  general both it and the unsplit sum lie within gamma(127 + n_k - 1) * sum|a_k b_k| of the
  exact product (gamma(j) = j u / (1 - j u), u = 2^-24, n_k = ceil(K/128); tests/test_kernels.py
  checks this in the interpreter, whose slice sums are fp32). On Hopper with fast_accum=True
  the tensor core accumulates a whole run in its reduced precision, so split-K shortens those
  runs and adds them in fp32: no less accurate than unsplit, and not bit-equal to it. The split
  is part of the plan, a function of the shape and SM count only, never timed: every rank and
  every step sums in the same order. The pointer path never splits.

The quantizers
--------------
scale = fp8_max / max(amax, 1e-12), computed in float64 and rounded once to fp32 (so Triton,
eager and compiled torch agree bit for bit), optionally rounded down to a power of two and
divided by 2^margin; a NaN/inf amax gives scale 1.0. Then data = saturate(x * scale): clamp to
+-fp8_max, round to nearest even, and non-finite inputs become NaN (never a silent 448).
Row and tile scales need only the values a program has in hand: one pass over memory. A
tensor scale needs the amax of the whole tensor before the first element can be cast, so it
takes two passes: partial maxima (one per program, no atomics, deterministic), then a cast
kernel in which every program reduces those partials to the same scale itself.

We round onto the fp8 grid ourselves before the final cast. The cast of an already
representable value is exact on every backend, so the bytes match torch's cast on the GPU and
in the CPU interpreter (TRITON_INTERPRET=1), whose own float->fp8/bf16 casts round differently.

Who calls them: nanofp8/fp8.py's backend="triton" (Recipe(backend="triton"), fp8_backend=triton
in train.py) runs every GEMM of an FP8 Linear on fp8_gemm and, with current scaling, every cast on
these quantizers; a tensor-scaled cast writes its transpose in the same pass (quantize_transpose),
so the backward GEMMs' x^T, W^T and dy^T cost no second read of the tensor.

This file imports torch and triton only (nanofp8 imports it, never the other way round), so it
runs from anywhere on its own: `python kernels.py` is a correctness check against the contract
written in plain torch at the bottom (CPU: interpreter, no timings) and, on a CUDA GPU, a
benchmark against torch._scaled_mm and bf16 torch.matmul (`--json PATH` saves it). It keeps its
own copies of the format maxima, the amax floor, the block size and sqnr for that reason;
tests/test_kernels.py checks that they equal nanofp8.fp8's and that the kernels are bit-exact
with nanofp8.fp8.quantize.
"""

import os
import sys
from typing import List, NamedTuple, Optional

import torch
import torch.nn.functional as F

if __name__ == "__main__" and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # no GPU: run the kernels in the interpreter

try:
    import triton
    import triton.language as tl
except ImportError as e:  # keep the failure readable: nanofp8 works without Triton (backend="torch")
    raise ImportError("kernels.py needs the `triton` package (and a CUDA GPU, or "
                      "TRITON_INTERPRET=1 on CPU); use backend='torch' without it") from e

# Triton reads this variable when a kernel is decorated, so it must be set before this import.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")

# torch dtype -> (largest finite value, mantissa bits, exponent of the smallest normal)
# (the values of nanofp8.fp8.E4M3 and E5M2; tests/test_kernels.py checks they agree)
FP8_FORMATS = {torch.float8_e4m3fn: (448.0, 3, -6), torch.float8_e5m2: (57344.0, 2, -14)}
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
KBLOCK = 128  # K step of the GEMM = width of a scaling tile (DeepSeek-V3): nanofp8.fp8.BLOCK
AMAX_EPS = tl.constexpr(1e-12)  # amax floor: an all-zero tensor gets a large finite scale (ditto)
FLT_MAX = tl.constexpr(3.4028234663852886e38)  # |v| <= FLT_MAX  <=>  v is finite (NaN fails)
NAN_BYTE = tl.constexpr(0x7F)  # torch's positive NaN in both E4M3FN and E5M2


def cdiv(x, y):
    """ceil(x / y) for ints >= 0. (triton.cdiv is a constexpr function: from Python each call costs
    microseconds of host time, and a small GEMM's launch is host-bound.)"""
    return -(-x // y)


# -----------------------------------------------------------------------------
# Shared building blocks: scale from amax, and the saturating, correctly rounded cast


@triton.jit
def _scale_from_amax(amax, FP8_MAX: tl.constexpr, MARGIN_MUL: tl.constexpr, POW2: tl.constexpr):
    """fp32 scale from an fp32 amax (any shape), exactly as nanofp8.fp8.compute_scale."""
    a64 = amax.to(tl.float64)
    # tl.full keeps 1e-12 a float64 constant (a bare literal would be rounded to fp32 first)
    s64 = FP8_MAX / tl.maximum(a64, tl.full(a64.shape, AMAX_EPS, tl.float64))
    if POW2:  # 2^floor(log2 s): clear the 52 mantissa bits of the (positive) float64
        s64 = ((s64.to(tl.int64, bitcast=True) >> 52) << 52).to(tl.float64, bitcast=True)
    scale = (s64 * MARGIN_MUL).to(tl.float32)  # MARGIN_MUL = 2^-margin: exact
    return tl.where(amax <= FLT_MAX, scale, 1.0)  # NaN or inf amax: fall back to 1.0


@triton.jit
def _abs_for_amax(x):
    """|x| in fp32 with NaN mapped to inf, so that a max over it is non-finite iff any x is."""
    ax = tl.abs(x.to(tl.float32))
    return tl.where(ax == ax, ax, float("inf"))


@triton.jit
def _store_fp8(q_ptrs, x, scale, mask, FP8_MAX: tl.constexpr, MBITS: tl.constexpr,
               EMIN: tl.constexpr):
    """Store saturate(x * scale) as fp8: clamp, round to nearest even on the fp8 grid, cast.
    Returns the value stored, in fp32 (a non-finite x's: the clamped one, stored as NaN)."""
    x = x.to(tl.float32)  # before any comparison: FLT_MAX would round to inf in bf16/fp16
    y = tl.minimum(tl.maximum(x * scale, -FP8_MAX), FP8_MAX)
    # The fp8 grid spacing near y is 2^(e - MBITS), e = exponent of y, floored at the
    # smallest normal exponent (below it the spacing is constant: the subnormals).
    bits = y.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, EMIN)
    up = ((127 + MBITS - e) << 23).to(tl.float32, bitcast=True)  # 2^(MBITS - e)
    down = ((127 - MBITS + e) << 23).to(tl.float32, bitcast=True)  # 2^(e - MBITS)
    t = y * up  # exact: |t| < 2^(MBITS + 1), an integer count of grid steps plus a fraction
    t = (t + 12582912.0) - 12582912.0  # adding 1.5 * 2^23 leaves no fraction bits: RNE
    r = t * down
    # keep the sign of values that round to 0. Not `-tl.abs(r)`: triton 3.6 compiles a float
    # negation as `0 - x`, which turns -0.0 into +0.0 (0x00, not 0x80); a product by -1 keeps it.
    r = tl.where(bits < 0, tl.abs(r) * -1.0, tl.abs(r))
    q = r.to(q_ptrs.dtype.element_ty).to(tl.uint8, bitcast=True)  # exact: r is on the grid
    q = tl.where(tl.abs(x) <= FLT_MAX, q, NAN_BYTE)  # inf/NaN input -> NaN, never +-max
    tl.store(q_ptrs, q.to(q_ptrs.dtype.element_ty, bitcast=True), mask=mask)
    return r


# -----------------------------------------------------------------------------
# Quantization kernels


@triton.jit
def _amax_partial_kernel(x_ptr, partial_ptr, n, BLOCK: tl.constexpr):
    """Pass 1 of tensor scaling: program p writes max |x| over its grid-strided chunks."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(pid * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc = tl.maximum(acc, _abs_for_amax(tl.load(x_ptr + offs, mask=offs < n, other=0.0)))
    tl.store(partial_ptr + pid, tl.max(acc, axis=0))


@triton.jit
def _cast_tensor_kernel(x_ptr, q_ptr, qt_ptr, partial_ptr, scale_ptr, R, C, P,
                        FP8_MAX: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr,
                        MARGIN_MUL: tl.constexpr, POW2: tl.constexpr, WRITE_T: tl.constexpr,
                        P_BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Pass 2 of tensor scaling. Each program reduces the partial maxima (a few KB, from L2)
    to the scale once, then casts (BLOCK_R, BLOCK_C) tiles t = pid, pid + programs, ...;
    with WRITE_T it also writes every tile transposed into qt (C, R)."""
    p = tl.arange(0, P_BLOCK)
    amax = tl.max(tl.load(partial_ptr + p, mask=p < P, other=0.0), axis=0)
    scale = _scale_from_amax(amax, FP8_MAX, MARGIN_MUL, POW2)
    if tl.program_id(0) == 0:
        tl.store(scale_ptr, scale)
    n_col_tiles = tl.cdiv(C, BLOCK_C)
    for t in range(tl.program_id(0), tl.cdiv(R, BLOCK_R) * n_col_tiles, tl.num_programs(0)):
        rows = (t // n_col_tiles) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = (t % n_col_tiles) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = (rows[:, None] < R) & (cols[None, :] < C)
        x = tl.load(x_ptr + rows[:, None] * C + cols[None, :], mask=mask, other=0.0)
        _store_fp8(q_ptr + rows[:, None] * C + cols[None, :], x, scale, mask, FP8_MAX, MBITS, EMIN)
        if WRITE_T:  # cast + transpose: the (C, R) copy that the backward GEMMs read K-major
            _store_fp8(qt_ptr + cols[:, None] * R + rows[None, :], tl.trans(x), scale,
                       tl.trans(mask), FP8_MAX, MBITS, EMIN)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, R, C,
                          FP8_MAX: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr,
                          MARGIN_MUL: tl.constexpr, POW2: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """One scale per row. Sweep 1 finds the amax of BLOCK_R rows, sweep 2 casts them; the
    second read of the same rows usually comes from L2, so HBM sees the tensor about once."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    amax = tl.zeros([BLOCK_R], tl.float32)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = (rows[:, None] < R) & (cols[None, :] < C)
        x = tl.load(x_ptr + rows[:, None] * C + cols[None, :], mask=mask, other=0.0)
        amax = tl.maximum(amax, tl.max(_abs_for_amax(x), axis=1))
    scale = _scale_from_amax(amax, FP8_MAX, MARGIN_MUL, POW2)
    tl.store(scale_ptr + rows, scale, mask=rows < R)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = (rows[:, None] < R) & (cols[None, :] < C)
        x = tl.load(x_ptr + rows[:, None] * C + cols[None, :], mask=mask, other=0.0)
        _store_fp8(q_ptr + rows[:, None] * C + cols[None, :], x, scale[:, None], mask,
                   FP8_MAX, MBITS, EMIN)


@triton.jit
def _quantize_tiles_kernel(x_ptr, q_ptr, scale_ptr, R, C, n_col_tiles,
                           FP8_MAX: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr,
                           MARGIN_MUL: tl.constexpr, POW2: tl.constexpr,
                           TILE_R: tl.constexpr, TILE_C: tl.constexpr, BLOCK_R: tl.constexpr):
    """One scale per (TILE_R, TILE_C) tile, in a single pass. A program holds BLOCK_R rows by
    TILE_C columns: one tile when TILE_R > 1 (BLOCK_R == TILE_R), or BLOCK_R 1-row tiles."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * TILE_C + tl.arange(0, TILE_C)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    x = tl.load(x_ptr + rows[:, None] * C + cols[None, :], mask=mask, other=0.0)
    amax = tl.max(_abs_for_amax(x), axis=1)  # per row; padding reads 0 and cannot win
    if TILE_R == 1:
        scale = _scale_from_amax(amax, FP8_MAX, MARGIN_MUL, POW2)
        tl.store(scale_ptr + rows * n_col_tiles + tl.program_id(1), scale, mask=rows < R)
        scale = scale[:, None]
    else:
        scale = _scale_from_amax(tl.max(amax, axis=0), FP8_MAX, MARGIN_MUL, POW2)
        tl.store(scale_ptr + tl.program_id(0) * n_col_tiles + tl.program_id(1), scale)
    _store_fp8(q_ptr + rows[:, None] * C + cols[None, :], x, scale, mask, FP8_MAX, MBITS, EMIN)


# -----------------------------------------------------------------------------
# The persistent FP8 GEMM


# Tile configs for Hopper, (BLOCK_M, BLOCK_N, num_stages, num_warps), chosen per variant.
# BLOCK_K = 128 bytes of fp8 fills a 128-byte swizzled shared-memory row, and it must equal the
# scaling tile width anyway. Shared memory per block = stages x (BLOCK_M + BLOCK_N) x 128 B of
# operand tiles + the BLOCK_M x BLOCK_N output tile the TMA store is staged from (2 or 4 bytes
# per value) + barriers; an H100 block gets at most 232,448 B. So an fp32 output (the wgrad
# GEMM, and every split-K GEMM, whose partial sums are fp32) gets 2 stages at 128x256
# (230,416 B), not 3 (279,576 B).
# Registers (255 per thread at most): promotion keeps a second fp32 accumulator live next to the
# wgmma one, and block scaling also keeps each stage's scales, so 128x256 spills with either,
# 256x128 with block scales (216-264 B), and 128x128 when both operands have 1x128 scales
# (568 B). The pointer path (rows not 16-byte aligned) holds its operands in registers: only
# 64x64 does not spill. tests/test_sm90_compile.py compiles every entry for sm_90 and checks
# shared memory, spills and the instructions used (figures above: triton 3.9, ptxas -v).
_TILES_16BIT = [(128, 256, 3, 8), (256, 128, 3, 8), (128, 128, 4, 8), (64, 128, 4, 4)]
_TILES_FP32 = [(128, 256, 2, 8), (256, 128, 2, 8), (128, 128, 4, 8), (64, 128, 4, 4)]
_TILES_POINTER = [(64, 64, 5, 4)]


def hopper_gemm_tiles(out_bytes, use_tma, fast_accum, blockwise, both_1x128=False):
    """The (BLOCK_M, BLOCK_N, num_stages, num_warps) configs that compile without spills on
    Hopper for one GEMM variant: output element size (2 or 4; 4 for split-K), TMA or pointer
    path, accumulation mode, and for block scales whether both operands have 1x128 scales
    (wgrad) or one is 128x128."""
    if not use_tma:
        return _TILES_POINTER
    tiles = _TILES_FP32 if out_bytes == 4 else _TILES_16BIT
    if blockwise or not fast_accum:
        tiles = [t for t in tiles if t[:2] != (128, 256)]
    if blockwise:
        tiles = [t for t in tiles if t[:2] != (256, 128) and not (both_1x128 and t[:2] == (128, 128))]
    return tiles


class GemmConfig(NamedTuple):
    """One launch of the FP8 GEMM: output tile, pipeline depth, warps, and how many slices K is
    cut into (split_k > 1: each slice is summed by its own program into an fp32 workspace)."""
    block_m: int
    block_n: int
    stages: int
    warps: int
    split_k: int = 1


# The launch heuristic. A persistent kernel runs min(SMs, work items) programs; when the work
# items (output tiles x K slices) do not divide evenly the last round leaves SMs idle, so the
# fraction of SM time doing work is  items / (SMs x ceil(items / SMs)). Big tiles do the most
# work per byte loaded, so the heuristic takes the biggest tiles that keep this fraction at
# FILL or above. When no tile does, the grid is too small for the GPU (few rows and columns,
# as in a weight-gradient GEMM, where K is the token count): then K is split in S slices of at
# least MIN_K_TILES steps of 128 each, with the smallest S that fills the SMs.
FILL = 0.8
MIN_K_TILES = 4  # K steps per slice: fewer leave the software pipeline (3-4 stages) no steady state


def sm_fill(items, num_sms):
    """Fraction of SM time spent on work when a persistent kernel runs `items` equal work items."""
    return items / (num_sms * cdiv(items, num_sms))


def gemm_plan(M, N, K, num_sms, out_bytes=2, use_tma=True, fast_accum=False, blockwise=False,
              both_1x128=False):
    """The configs fp8_gemm may run for this shape and variant on a GPU with num_sms SMs, best
    guess first: one or two tiles of one size (128x256 and 256x128 where both compile), all with
    one split_k. A pure function of its arguments, so every rank and every step of a run splits
    K the same way; only the choice between the two tiles is timed."""
    k_tiles = cdiv(K, KBLOCK)
    for split in range(1, (max(1, k_tiles // MIN_K_TILES) if use_tma else 1) + 1):
        tiles = hopper_gemm_tiles(4 if split > 1 else out_bytes, use_tma, fast_accum, blockwise, both_1x128)
        full = [t for t in tiles
                if sm_fill(cdiv(M, t[0]) * cdiv(N, t[1]) * split, num_sms) >= FILL]
        if full:
            area = max(bm * bn for bm, bn, _, _ in full)
            return [GemmConfig(*t, split) for t in full if t[0] * t[1] == area]
    # nothing fills the SMs (tiny K, or tiny M x N): the tile that keeps most of them busy
    tiles = hopper_gemm_tiles(out_bytes, use_tma, fast_accum, blockwise, both_1x128)
    return [GemmConfig(*max(tiles, key=lambda t: sm_fill(cdiv(M, t[0]) * cdiv(N, t[1]), num_sms)))]


@triton.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped ordering: walk GROUP_M rows of tiles column by column (L2 reuse of A and B)."""
    tiles_per_group = GROUP_M * num_pid_n
    first_m = (tile_id // tiles_per_group) * GROUP_M
    group_rows = min(num_pid_m - first_m, GROUP_M)  # the last group may be shorter
    pid_m = first_m + (tile_id % tiles_per_group) % group_rows
    pid_n = (tile_id % tiles_per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def _round_to_bf16_grid(x):
    """Round fp32 to the nearest-even bf16 value, kept in fp32. Only the CPU interpreter needs
    this (its bf16 cast truncates); on the GPU the cast itself rounds to nearest even."""
    bits = x.to(tl.uint32, bitcast=True)
    r = (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(x) <= FLT_MAX, r, x)


@triton.jit
def _k_block_scales(ptr, safe_offs, start, ki, stride_r, stride_k, ROWS: tl.constexpr,
                    BLOCK: tl.constexpr):
    """The BLOCK scales of one operand's tile rows at K-block ki. When the tile lies inside one
    group of ROWS rows (a 128x128 weight block) they are all one value: load it once, so the
    software pipeline carries one register per stage instead of a vector (no spills)."""
    if ROWS % BLOCK == 0:
        return tl.zeros([BLOCK], tl.float32) + tl.load(ptr + (start // ROWS) * stride_r + ki * stride_k)
    else:
        return tl.load(ptr + (safe_offs // ROWS) * stride_r + ki * stride_k)


@triton.jit
def _gemm_epilogue(acc, a_scale_ptr, b_scale_ptr, bias_ptr, safe_m, safe_n, stride_sam, stride_sbn,
                   A_SCALE_ROWS: tl.constexpr, B_SCALE_ROWS: tl.constexpr, BLOCKWISE: tl.constexpr,
                   HAS_BIAS: tl.constexpr, ROUND_BF16: tl.constexpr):
    """What follows the sum over K: scales that are constant along K, bias, bf16 rounding."""
    if not BLOCKWISE:
        sa = tl.load(a_scale_ptr + (safe_m // A_SCALE_ROWS) * stride_sam)
        sb = tl.load(b_scale_ptr + (safe_n // B_SCALE_ROWS) * stride_sbn)
        acc = acc * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + safe_n).to(tl.float32)[None, :]
    if ROUND_BF16:
        acc = _round_to_bf16_grid(acc)
    return acc


@triton.jit
def _fp8_gemm_kernel(a_ptr, b_ptr, c_ptr, ws_ptr, a_scale_ptr, b_scale_ptr, bias_ptr, M, N, K, MP,
                     stride_sam, stride_sak, stride_sbn, stride_sbk,
                     A_SCALE_ROWS: tl.constexpr, B_SCALE_ROWS: tl.constexpr,
                     BLOCKWISE: tl.constexpr, FAST_ACCUM: tl.constexpr, USE_TMA: tl.constexpr,
                     HAS_BIAS: tl.constexpr, ROUND_BF16: tl.constexpr, NUM_SMS: tl.constexpr,
                     SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """c (M, N) = (a * sa) @ (b * sb)^T (+ bias). a: (M, K) fp8, b: (N, K) fp8, contiguous.
    Scale of a at row m, K-block kb: a_scale[(m // A_SCALE_ROWS) * stride_sam + kb * stride_sak]
    (stride 0 = constant along that axis: per-tensor scales have both strides 0). BLOCKWISE:
    scales vary along K, so they are applied to every BLOCK_K (= 128) partial product.
    SPLIT_K > 1: work item (tile, s) sums the s-th of SPLIT_K equal runs of K-blocks and stores
    its fp32 sum, before the epilogue, at rows s * MP + m of ws (SPLIT_K * MP, N), MP = M
    rounded up to BLOCK_M; _split_k_reduce_kernel then adds them up and runs the epilogue."""
    # (split-K runs on TMA only: on the pointer path its slices spill registers on sm_90)
    tl.static_assert(USE_TMA or SPLIT_K == 1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    k_per_split = tl.cdiv(k_tiles, SPLIT_K)
    if USE_TMA:  # descriptors are built once per program and reused for all of its tiles
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1],
                                           block_shape=[BLOCK_M, BLOCK_K])
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1],
                                           block_shape=[BLOCK_N, BLOCK_K])
        if SPLIT_K == 1:
            c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[N, 1],
                                               block_shape=[BLOCK_M, BLOCK_N])
        else:  # rows past M of slice s land in its padding, never in slice s + 1
            c_desc = tl.make_tensor_descriptor(ws_ptr, shape=[SPLIT_K * MP, N], strides=[N, 1],
                                               block_shape=[BLOCK_M, BLOCK_N])
    offs_k = tl.arange(0, BLOCK_K)
    # persistent loop: this program takes work items pid, pid + NUM_SMS, ... (flatten=True lets
    # the software pipeliner treat the tile and K loops as one, prefetching across tiles). The
    # K slice is the outer index, so programs running together share a K range (L2 reuse).
    for work in tl.range(tl.program_id(0), num_tiles * SPLIT_K, NUM_SMS, flatten=True):
        split = work // num_tiles
        pid_m, pid_n = _tile_coords(work % num_tiles, num_pid_m, num_pid_n, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # rows past the edge read row 0 (in bounds, so no row mask) and are never stored
        safe_m = tl.where(offs_m < M, offs_m, 0)
        safe_n = tl.where(offs_n < N, offs_n, 0)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if SPLIT_K == 1:
            k_lo, k_hi = 0, k_tiles
        else:
            k_lo = split * k_per_split
            k_hi = min(k_lo + k_per_split, k_tiles)
        for ki in range(k_lo, k_hi):
            k0 = ki * BLOCK_K
            if USE_TMA:  # out-of-bounds parts of the box arrive as zeros
                a = a_desc.load([pid_m * BLOCK_M, k0])
                b = b_desc.load([pid_n * BLOCK_N, k0])
            else:  # zero the K tail by masking, so it adds nothing to the dot product
                k_ok = offs_k[None, :] < K - k0
                a = tl.load(a_ptr + safe_m[:, None] * K + (k0 + offs_k)[None, :], mask=k_ok, other=0.0)
                b = tl.load(b_ptr + safe_n[:, None] * K + (k0 + offs_k)[None, :], mask=k_ok, other=0.0)
            if BLOCKWISE:
                # a fresh tensor-core sum over these 128 of K, scaled, then added in fp32
                sa = _k_block_scales(a_scale_ptr, safe_m, pid_m * BLOCK_M, ki, stride_sam,
                                     stride_sak, A_SCALE_ROWS, BLOCK_M)
                sb = _k_block_scales(b_scale_ptr, safe_n, pid_n * BLOCK_N, ki, stride_sbn,
                                     stride_sbk, B_SCALE_ROWS, BLOCK_N)
                acc += tl.dot(a, b.T) * sa[:, None] * sb[None, :]
            elif FAST_ACCUM:  # Hopper's default for fp8: limited-precision accumulation
                acc = tl.dot(a, b.T, acc)
            else:  # promote the tensor-core partial sum into fp32 every BLOCK_K of K
                acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=BLOCK_K)
        if SPLIT_K == 1:  # epilogue: scales constant along K, bias, output cast, store
            c = _gemm_epilogue(acc, a_scale_ptr, b_scale_ptr, bias_ptr, safe_m, safe_n, stride_sam,
                               stride_sbn, A_SCALE_ROWS, B_SCALE_ROWS, BLOCKWISE, HAS_BIAS,
                               ROUND_BF16).to(c_ptr.dtype.element_ty)
            if USE_TMA:  # the store is clipped to the tensor's bounds by the hardware
                c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], c)
            else:
                c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
                tl.store(c_ptr + offs_m[:, None] * N + offs_n[None, :], c, mask=c_mask)
        else:  # this slice's fp32 sum, for _split_k_reduce_kernel
            c_desc.store([split * MP + pid_m * BLOCK_M, pid_n * BLOCK_N], acc)


@triton.jit
def _split_k_reduce_kernel(ws_ptr, c_ptr, a_scale_ptr, b_scale_ptr, bias_ptr, M, N, MP,
                           stride_sam, stride_sbn, A_SCALE_ROWS: tl.constexpr,
                           B_SCALE_ROWS: tl.constexpr, BLOCKWISE: tl.constexpr,
                           HAS_BIAS: tl.constexpr, ROUND_BF16: tl.constexpr, SPLIT_K: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """c = epilogue(ws[0] + ws[1] + ... + ws[SPLIT_K - 1]), added in that order in fp32."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    acc = tl.load(ws_ptr + offs_m[:, None] * N + offs_n[None, :], mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(ws_ptr + (s * MP + offs_m)[:, None] * N + offs_n[None, :], mask=mask, other=0.0)
    acc = _gemm_epilogue(acc, a_scale_ptr, b_scale_ptr, bias_ptr, tl.where(offs_m < M, offs_m, 0),
                         tl.where(offs_n < N, offs_n, 0), stride_sam, stride_sbn, A_SCALE_ROWS,
                         B_SCALE_ROWS, BLOCKWISE, HAS_BIAS, ROUND_BF16)
    tl.store(c_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(c_ptr.dtype.element_ty), mask=mask)


# -----------------------------------------------------------------------------
# Python entry points


def tma_scratch(size, align, stream):
    """Triton's allocator for the TMA descriptors the GEMM builds on the device: a little global
    scratch memory per program, on the current CUDA device (torchrun sets it per rank)."""
    return torch.empty(size, device="cuda", dtype=torch.int8)


# Triton keeps its allocator in a context variable: per thread, and autograd runs the backward
# GEMMs in a thread of its own. So _launch_fp8_gemm sets it at every launch, to this function.


def _check_device(*tensors):
    dev = tensors[0].device
    if any(t.device != dev for t in tensors):
        raise ValueError(f"all tensors must be on one device, got {[str(t.device) for t in tensors]}")
    if dev.type != "cuda" and not INTERPRET:
        raise ValueError(f"Triton kernels need CUDA tensors (got {dev}), or TRITON_INTERPRET=1 "
                         "set before `import kernels` to run them on CPU")


def _num_sms(device):
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: a few programs, so the persistent loop really loops


def _scale_layout(s, rows, K, name):
    """How an inverse-scale tensor maps onto its operand (rows, K):
    (tensor, rows per scale, row stride, K-block stride, varies along K)."""
    kb = cdiv(K, KBLOCK)
    if not torch.is_tensor(s) or not s.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {s!r}")
    s = s.float().contiguous()
    if s.numel() == 1 and s.dim() <= 2:  # one scale for the whole operand
        return s.reshape(1), 1, 0, 0, False
    if s.dim() == 2 and tuple(s.shape) == (rows, 1):  # row-wise
        return s, 1, 1, 0, False
    for rows_per_scale in (1, KBLOCK):  # 1x128 tiles, 128x128 blocks
        if s.dim() == 2 and tuple(s.shape) == (cdiv(rows, rows_per_scale), kb):
            return s, rows_per_scale, kb, 1, kb > 1
    raise ValueError(f"{name} has shape {tuple(s.shape)}; for an operand of shape ({rows}, {K}) "
                     f"expected () (tensor), ({rows}, 1) (row), ({rows}, {kb}) (1x128 tiles) "
                     f"or ({cdiv(rows, KBLOCK)}, {kb}) (128x128 blocks)")


def fp8_gemm(a, b, a_inv_scale, b_inv_scale, out_dtype=torch.bfloat16, bias=None, *,
             fast_accum=False, use_tma=None, config=None):
    """out (M, N) = (a * a_inv_scale) @ (b * b_inv_scale)^T (+ bias), accumulated in fp32.

    a: (M, K) and b: (N, K) fp8 (E4M3 or E5M2, any pair), row-major. Inverse scales (the
    dequantization multipliers, fp32), each one of: a scalar; a row scale (M, 1) / (N, 1);
    1x128 tiles (rows, ceil(K/128)); 128x128 blocks (ceil(rows/128), ceil(K/128)). Scales that
    vary along K are applied to each 128-wide slice of K before it joins the fp32 sum.
    fast_accum: let Hopper accumulate whole tiles in its reduced precision (faster).
    use_tma: None picks TMA descriptors on Hopper when rows are 16-byte aligned; False forces
    the pointer path; True requires TMA (ValueError if the shapes cannot use it).
    config: a GemmConfig to run instead of gemm_plan's choice (tests, benchmarks). With
    split_k = S > 1 each output's K-blocks are summed in S runs whose fp32 sums are then added
    in order: a different fp32 summation order from S = 1 (see "Split-K" above)."""
    for name, t in (("a", a), ("b", b)):
        if not torch.is_tensor(t) or t.dtype not in FP8_FORMATS or t.dim() != 2:
            raise ValueError(f"{name} must be a 2-D float8_e4m3fn or float8_e5m2 tensor, got "
                             f"{getattr(t, 'dtype', type(t))} of shape {tuple(getattr(t, 'shape', ()))}")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"contraction dims differ: a is {tuple(a.shape)}, b is {tuple(b.shape)} "
                         "(b must be (N, K), i.e. B^T)")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    (M, K), N = a.shape, b.shape[0]
    if bias is not None and (not torch.is_tensor(bias) or tuple(bias.shape) != (N,)):
        raise ValueError(f"bias must be a tensor of shape ({N},), got {getattr(bias, 'shape', bias)}")
    if max(M * K, N * K, M * N) >= 2**31:
        raise ValueError(f"M, N, K = {M}, {N}, {K}: operands or output of 2^31 or more elements "
                         "are not supported (int32 offsets)")
    _check_device(a, b, *([bias] if bias is not None else []))
    if torch.compiler.is_compiling():  # one opaque op in the graph (why: above fp8_gemm_op)
        return fp8_gemm_op(a, b, a_inv_scale, b_inv_scale, out_dtype, bias, bool(fast_accum), use_tma,
                           None if config is None else list(config))
    return _launch_fp8_gemm(a, b, a_inv_scale, b_inv_scale, out_dtype, bias, fast_accum, use_tma, config)


def _launch_fp8_gemm(a, b, a_inv_scale, b_inv_scale, out_dtype, bias, fast_accum, use_tma, config=None):
    (M, K), N = a.shape, b.shape[0]
    a, b = a.contiguous(), b.contiguous()
    sa, a_rows, sam, sak, a_per_k = _scale_layout(a_inv_scale, M, K, "a_inv_scale")
    sb, b_rows, sbn, sbk, b_per_k = _scale_layout(b_inv_scale, N, K, "b_inv_scale")
    sa, sb = sa.to(a.device), sb.to(a.device)
    if M == 0 or N == 0 or K == 0:
        out = torch.zeros((M, N), device=a.device, dtype=torch.float32)
        return (out if bias is None else out + bias.float()).to(out_dtype)
    c = torch.empty((M, N), device=a.device, dtype=out_dtype)
    cuda = a.device.type == "cuda"
    tma_ok = (K % 16 == 0 and (N * c.element_size()) % 16 == 0
              and all(t.data_ptr() % 16 == 0 for t in (a, b, c))
              and (INTERPRET or (cuda and torch.cuda.get_device_capability(a.device)[0] >= 9)))
    if use_tma and not tma_ok:
        raise ValueError(f"use_tma=True needs K % 16 == 0 (K={K}), 16-byte output rows (N={N}, "
                         f"{out_dtype}) and a Hopper GPU or the interpreter")
    use_tma = tma_ok if use_tma is None else bool(use_tma)
    if use_tma and cuda:
        triton.set_allocator(tma_scratch)
    num_sms = _num_sms(a.device)
    blockwise = a_per_k or b_per_k
    args = dict(A_SCALE_ROWS=a_rows, B_SCALE_ROWS=b_rows, BLOCKWISE=blockwise, HAS_BIAS=bias is not None,
                ROUND_BF16=INTERPRET and out_dtype == torch.bfloat16)
    bias_arg = bias.contiguous() if bias is not None else sa

    def launch(cfg):
        mp = cdiv(M, cfg.block_m) * cfg.block_m
        # fp32 partial sums of the K slices (rows s * mp + m); split_k == 1 writes c directly
        ws = torch.empty((cfg.split_k * mp, N), device=a.device, dtype=torch.float32) if cfg.split_k > 1 else c
        items = cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n) * cfg.split_k
        _fp8_gemm_kernel[(min(num_sms, items),)](
            a, b, c, ws, sa, sb, bias_arg, M, N, K, mp, sam, sak, sbn, sbk, **args,
            FAST_ACCUM=bool(fast_accum), USE_TMA=use_tma, NUM_SMS=num_sms, SPLIT_K=cfg.split_k,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=KBLOCK, GROUP_M=8,
            num_stages=cfg.stages, num_warps=cfg.warps)
        if cfg.split_k > 1:
            _split_k_reduce_kernel[(cdiv(M, 64), cdiv(N, 64))](
                ws, c, sa, sb, bias_arg, M, N, mp, sam, sbn, **args, SPLIT_K=cfg.split_k,
                BLOCK_M=64, BLOCK_N=64)

    if config is not None and GemmConfig(*config).split_k > 1 and not use_tma:
        raise ValueError(f"config {tuple(config)}: split_k > 1 needs the TMA path (K % 16 == 0, "
                         "16-byte aligned rows, use_tma not False); use split_k=1")
    if config is None:
        key = (M, N, K, a.dtype, b.dtype, out_dtype, use_tma, bool(fast_accum), blockwise, a_rows, b_rows,
               bias is not None, str(a.device))
        config = _CHOSEN_CONFIGS.get(key) or _choose_config(key, launch, cuda, gemm_plan(
            M, N, K, num_sms, c.element_size(), use_tma, bool(fast_accum), blockwise, a_rows == 1 and b_rows == 1))
    launch(GemmConfig(*config))
    return c


# The config fp8_gemm runs, per shape and variant: planned (and timed) at its first call only, as
# planning costs more host time than a small GEMM's kernel.
_CHOSEN_CONFIGS = {}


def _choose_config(key, launch, timed, candidates):
    """The fastest of gemm_plan's candidates (at most two, of one tile size and one split_k), timed
    on the GPU (timed=True). The first call of a new shape pays each candidate's compile (seconds,
    then cached on disk by Triton) and about 25 ms of timing each."""
    best = candidates[0]
    if timed and len(candidates) > 1:
        from triton.testing import do_bench
        times = [do_bench(lambda: launch(cfg), warmup=5, rep=20) for cfg in candidates]
        best = candidates[times.index(min(times))]
    _CHOSEN_CONFIGS[key] = best
    return best


# Under torch.compile the GEMM is one custom op: dynamo sees its output's shape (the fake below)
# and never traces the launch. torch 2.11's dynamo breaks the graph at every triton.set_allocator
# and cannot trace the timing of the first call. The op runs the launch at run time, in whichever
# thread runs the graph, so the allocator is set there too.
@torch.library.custom_op("nanofp8::fp8_gemm", mutates_args=())
def fp8_gemm_op(a: torch.Tensor, b: torch.Tensor, a_inv_scale: torch.Tensor, b_inv_scale: torch.Tensor,
                out_dtype: torch.dtype, bias: Optional[torch.Tensor], fast_accum: bool,
                use_tma: Optional[bool], config: Optional[List[int]] = None) -> torch.Tensor:
    return _launch_fp8_gemm(a, b, a_inv_scale, b_inv_scale, out_dtype, bias, fast_accum, use_tma, config)


@fp8_gemm_op.register_fake
def _(a, b, a_inv_scale, b_inv_scale, out_dtype, bias, fast_accum, use_tma, config=None):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


def _check_quantize_args(x, fmt_dtype, granularity, block):
    if fmt_dtype not in FP8_FORMATS:
        raise ValueError(f"fmt_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fmt_dtype}")
    if granularity not in ("tensor", "row", "block"):
        raise ValueError(f"unknown granularity {granularity!r}; expected 'tensor', 'row' or 'block'")
    if not torch.is_tensor(x) or x.dtype not in OUT_DTYPES:
        raise ValueError(f"x must be a float32/bfloat16/float16 tensor, got {getattr(x, 'dtype', type(x))}")
    if x.dim() < 1 or x.numel() == 0:
        raise ValueError(f"cannot quantize a tensor of shape {tuple(x.shape)}")
    if x.numel() >= 2**31:
        raise ValueError(f"{x.numel()} elements: 2^31 or more are not supported (int32 offsets)")
    br, bc = block
    pow2 = lambda v: isinstance(v, int) and v > 0 and v & (v - 1) == 0
    if granularity == "block" and not (pow2(br) and pow2(bc) and 16 <= bc <= 1024 and br * bc <= 16384):
        raise ValueError(f"block {tuple(block)} is not supported: rows and columns must be powers "
                         "of two, columns in [16, 1024], at most 16384 elements, e.g. (1, 128), (128, 128)")
    _check_device(x)


def _fmt_args(fmt_dtype, margin, power_of_two):
    fp8_max, mbits, emin = FP8_FORMATS[fmt_dtype]
    return dict(FP8_MAX=fp8_max, MBITS=mbits, EMIN=emin, MARGIN_MUL=2.0 ** -margin,
                POW2=bool(power_of_two))


def _quantize_tensor(x2, fmt_dtype, margin, power_of_two, transpose):
    R, C = x2.shape
    n = R * C
    block = 1024 if INTERPRET else 4096
    # number of partial maxima = pass-1 programs (few in the interpreter, so that its loop runs)
    P = min(cdiv(n, block), 64 if INTERPRET else 1024)
    partial = torch.empty(P, device=x2.device, dtype=torch.float32)
    _amax_partial_kernel[(P,)](x2, partial, n, BLOCK=block)
    data = torch.empty((R, C), device=x2.device, dtype=fmt_dtype)
    data_t = torch.empty((C, R), device=x2.device, dtype=fmt_dtype) if transpose else data
    scale = torch.empty((), device=x2.device, dtype=torch.float32)
    br, bc = (64, 64) if transpose else (16, 256)
    tiles = cdiv(R, br) * cdiv(C, bc)
    programs = min(tiles, 8 * _num_sms(x2.device))  # few enough that reducing P is cheap
    _cast_tensor_kernel[(programs,)](
        x2, data, data_t, partial, scale, R, C, P, **_fmt_args(fmt_dtype, margin, power_of_two),
        WRITE_T=transpose, P_BLOCK=triton.next_power_of_2(P), BLOCK_R=br, BLOCK_C=bc)
    return data, data_t, scale


def quantize(x, fmt_dtype, granularity="tensor", block=(1, KBLOCK), margin=0, power_of_two=False):
    """(data, scale) with data = saturate(x * scale) in fmt_dtype, bit-exact with
    nanofp8.fp8.quantize. x is flattened to (rows, cols) = (-1, x.shape[-1]); scale is fp32 of
    shape () for "tensor", (rows, 1) for "row", (ceil(rows/br), ceil(cols/bc)) for "block"."""
    block = tuple(block)
    _check_quantize_args(x, fmt_dtype, granularity, block)
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    R, C = x2.shape
    fmt = _fmt_args(fmt_dtype, margin, power_of_two)
    if granularity == "tensor":
        data, _, scale = _quantize_tensor(x2, fmt_dtype, margin, power_of_two, transpose=False)
        return data, scale
    data = torch.empty((R, C), device=x.device, dtype=fmt_dtype)
    if granularity == "row":
        scale = torch.empty((R, 1), device=x.device, dtype=torch.float32)
        bc = min(triton.next_power_of_2(C), 1024)
        br = max(1, min(4096 // bc, 64))
        _quantize_rows_kernel[(cdiv(R, br),)](x2, data, scale, R, C, **fmt,
                                                    BLOCK_R=br, BLOCK_C=bc)
        return data, scale
    tr, tc = block
    scale = torch.empty((cdiv(R, tr), cdiv(C, tc)), device=x.device, dtype=torch.float32)
    rows_per_prog = tr if tr > 1 else max(1, min(4096 // tc, 32))
    _quantize_tiles_kernel[(cdiv(R, rows_per_prog), cdiv(C, tc))](
        x2, data, scale, R, C, scale.shape[1], **fmt, TILE_R=tr, TILE_C=tc, BLOCK_R=rows_per_prog,
        num_warps=tile_warps(rows_per_prog * tc))
    return data, scale


def tile_warps(values):
    """Warps for a program that holds `values` elements. A 128x128 tile (16K values) at 8 warps
    is 64 values a thread and spills 8-16 bytes on sm_90; 16 warps would cap registers at 128 a
    thread and spill 40. It stays at 8: this kernel casts weights, once per optimizer step, and
    is bound by memory (tests/test_sm90_compile.py allows this one exception)."""
    return 8 if values >= 8192 else 4


def quantize_transpose(x, fmt_dtype, margin=0, power_of_two=False):
    """Tensor-scaled cast + transpose in one pass 2: (data (R, C), data_t (C, R), scale).
    data_t is what the backward GEMMs need: the same FP8 values, K-major along the other dim."""
    _check_quantize_args(x, fmt_dtype, "tensor", (1, KBLOCK))
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    return _quantize_tensor(x2, fmt_dtype, margin, power_of_two, transpose=True)


# -----------------------------------------------------------------------------
# The MX GEMM: MXFP8, the block-scaled format of Blackwell's tensor cores
#
# An MX operand (OCP Microscaling) is fp8 data with one E8M0 scale per 32 values along K: a byte
# that is a bare exponent, 2^(byte - 127), so multiplying by it is exact. tl.dot_scaled takes the
# data and those bytes as they are. On sm_100 Triton lowers it to the block-scaled MMA
# (tcgen05.mma ... kind::mxf8f6f4.block_scale): the tensor core applies the scales itself, with
# fp32 accumulation in tensor memory. Hopper has no MX instruction: there Triton upcasts each fp8
# tile to bf16, multiplies it by its scales in bf16 and runs a bf16 wgmma. Measured on an H200
# (triton 3.6, scripts/gpu_check_mx.py): 108-114 dB against the fp32 reference, exact on the
# adversarial cases except that the scale 2^-127 (byte 0, a bf16 subnormal) reads as zero, and
# 120 TFLOPS at 4096-8192^3. So gemm_mx runs its own Hopper kernel on sm_90 (_mx_gemm_bf16_kernel,
# below: scales applied in fp32 while loading, every byte exact). The interpreter (triton >= 3.9)
# dequantizes to fp32 and multiplies in fp32, as the reference does. tests/test_mx_compile.py
# compiles the dot_scaled kernel for sm_100 and the bf16 one for sm_90 and records what they
# became (results/kernels_sm100.json).

MX_BLOCK = 32  # values per E8M0 scale along K (nanofp8.mx.MX_BLOCK)
MX_FORMATS = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}  # tl.dot_scaled's names

# (BLOCK_M, BLOCK_N, num_stages, num_warps). sm_100: the block-scaled MMA is 128 rows tall and
# its accumulator lives in tensor memory. Hopper: the bf16 upcast goes through registers, so
# 128x128 needs 8 warps (about 240 registers a thread; 4 warps spill). Other generations (sm_120
# has less shared memory) get Hopper's smaller tiles, untested. tests/test_mx_compile.py
# compiles each list for its target and checks shared memory and spills.
_MX_TILES_SM100 = [(128, 256, 3, 8), (128, 128, 4, 8), (128, 128, 3, 4)]
_MX_TILES_SM90 = [(128, 128, 3, 8), (64, 128, 4, 4)]
# Hopper's own MX GEMM (_mx_gemm_bf16_kernel): 128x256 fits (254 registers, no spills), as in
# bf16 GEMMs, where it is the fastest tile
_MX_TILES_BF16 = [(128, 256, 3, 8), (128, 128, 4, 8), (64, 128, 4, 4)]


def mx_gemm_tiles(major):
    """The (BLOCK_M, BLOCK_N, num_stages, num_warps) configs tried on a GPU of this major version."""
    return _MX_TILES_SM100 if major == 10 else _MX_TILES_SM90


def _mx_gemm_configs():
    if INTERPRET or not torch.cuda.is_available():
        return [triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": KBLOCK, "GROUP_M": 8})]
    return mx_gemm_configs()


def mx_gemm_configs():
    """Every config of either generation; _prune_mx_configs keeps the GPU's own."""
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": KBLOCK, "GROUP_M": 8},
                          num_stages=s, num_warps=w)
            for bm, bn, s, w in sorted(set(_MX_TILES_SM100 + _MX_TILES_SM90))]


def _prune_mx_configs(configs, named_args, **kwargs):
    """Keep the configs of this GPU's generation."""
    if len(configs) == 1:
        return configs
    want = set(mx_gemm_tiles(torch.cuda.get_device_capability(named_args["c_ptr"].device)[0]))
    return [c for c in configs if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_stages,
                                   c.num_warps) in want]


@triton.autotune(configs=_mx_gemm_configs(), key=["M", "N", "K", "A_FMT", "B_FMT", "HAS_BIAS"],
                 prune_configs_by={"early_config_prune": _prune_mx_configs})
@triton.jit
def _mx_gemm_kernel(a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, bias_ptr, M, N, K,
                    A_FMT: tl.constexpr, B_FMT: tl.constexpr, HAS_BIAS: tl.constexpr,
                    ROUND_BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """c (M, N) = (a * 2^ea) @ (b * 2^eb)^T (+ bias). a: (M, K), b: (N, K) fp8, contiguous,
    K % 32 == 0; a_scale (M, K/32), b_scale (N, K/32): E8M0 bytes (uint8), contiguous.
    One program per output tile, in grouped order (tutorial 03); A and B tiles arrive by TMA."""
    pid_m, pid_n = _tile_coords(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    safe_m = tl.where(offs_m < M, offs_m, 0)  # rows past the edge read row 0, never stored
    safe_n = tl.where(offs_n < N, offs_n, 0)
    KS = K // 32  # scales per row
    offs_s = tl.arange(0, BLOCK_K // 32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(tl.cdiv(K, BLOCK_K)):
        a = a_desc.load([pid_m * BLOCK_M, ki * BLOCK_K])  # past K: zeros (TMA fills them)
        b = b_desc.load([pid_n * BLOCK_N, ki * BLOCK_K])
        # the scales of these BLOCK_K columns; past K: 127 (2^0, a finite factor for the zeros)
        s_cols = ki * (BLOCK_K // 32) + offs_s
        s_ok = s_cols[None, :] < KS
        sa = tl.load(a_scale_ptr + safe_m[:, None] * KS + s_cols[None, :], mask=s_ok, other=127)
        sb = tl.load(b_scale_ptr + safe_n[:, None] * KS + s_cols[None, :], mask=s_ok, other=127)
        acc = tl.dot_scaled(a, sa, A_FMT, b.T, sb, B_FMT, acc)  # b's scales stay (N, K/32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + safe_n).to(tl.float32)[None, :]
    if ROUND_BF16:
        acc = _round_to_bf16_grid(acc)
    c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(c_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(c_ptr.dtype.element_ty), mask=c_mask)


# The MX GEMM for Hopper: dequantize each tile to bf16 while loading, then a bf16 wgmma
#
# E8M0 byte b means 2^(b - 127). In fp32 every one of them is exact: b << 23 is the bit pattern of
# 2^(b - 127) for b = 1..254, and byte 0 is the fp32 subnormal 2^-127 (bits 0x00400000); byte 255
# is NaN. An fp8 value x times 2^k is exact in fp32 too: x has at most 4 significant bits and its
# smallest step is 2^-9 (E4M3) or 2^-16 (E5M2), so x * 2^k is a multiple of 2^-136 or 2^-143,
# above fp32's smallest subnormal 2^-149 (and overflows to inf exactly where the reference's fp32
# dequantization does). The tile is then rounded to bf16. bf16 has fp32's exponent range but 8
# significant bits, so 4-bit values are exact down to 2^-126, and below that on bf16's subnormal
# grid, multiples of 2^-133. So x * 2^(b - 127) is exact in bf16 iff x is a multiple of 2^(-6 - b):
# every E4M3 value under bytes 3..254, every E5M2 value under bytes 10..254; under lower bytes the
# values off that grid round to nearest even on it (an absolute error of at most 2^-134). bf16 x bf16 products are exact in
# fp32 (16 significant bits), and the wgmma sums them in fp32 into the accumulator, 128 of K at a
# time, as reference_gemm_mx sums its 128-wide slices. So: gemm_mx on Hopper equals
# reference_gemm_mx of the operands dequantized and rounded to bf16 (reference_gemm_mx_bf16), up to
# fp32 summation order, and equals reference_gemm_mx itself wherever the bf16 tiles are exact.


@triton.jit
def _mx_tile_to_bf16(x, s_ptr, safe_rows, ki, KS, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
                     INTERPRETED: tl.constexpr):
    """x (ROWS, BLOCK_K) fp8 at K-step ki -> bf16 x * 2^(byte - 127), each byte the E8M0 scale of
    32 values of a row (bytes past the end of K read 127: 2^0 times the zeros TMA filled in)."""
    s_cols = ki * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
    b = tl.load(s_ptr + safe_rows[:, None] * KS + s_cols[None, :], mask=s_cols[None, :] < KS,
                other=127).to(tl.int32)
    scale = tl.where(b == 0, 0x00400000, b << 23).to(tl.float32, bitcast=True)  # 2^(b - 127)
    scale = tl.where(b == 255, float("nan"), scale)  # E8M0's NaN (b << 23 would be inf)
    scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (ROWS, BLOCK_K // 32, 32)), (ROWS, BLOCK_K))
    v = x.to(tl.float32) * scale  # exact (see above)
    if INTERPRETED:  # bf16's grid kept in fp32: the interpreter's bf16 cast truncates and flushes
        # subnormals to zero, its tl.dot reads bf16 as raw bits, and its fp8 cast reads E4M3's NaN
        # (0x7F, 0xFF) as 480 and E5M2's NaN (exponent 31, mantissa != 0) as a number
        bits = x.to(tl.uint8, bitcast=True) & 0x7F
        is_nan = (bits == 0x7F) if x.dtype == tl.float8e4nv else (bits > 0x7C)
        return tl.where(is_nan, float("nan"), _round_to_bf16_grid(v))
    return v.to(tl.bfloat16)


def _mx_bf16_configs():
    if INTERPRET or not torch.cuda.is_available():
        return [triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": KBLOCK, "GROUP_M": 8})]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": KBLOCK, "GROUP_M": 8},
                          num_stages=s, num_warps=w) for bm, bn, s, w in _MX_TILES_BF16]


@triton.autotune(configs=_mx_bf16_configs(), key=["M", "N", "K", "HAS_BIAS"])
@triton.jit
def _mx_gemm_bf16_kernel(a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, bias_ptr, M, N, K,
                         HAS_BIAS: tl.constexpr, INTERPRETED: tl.constexpr, ROUND_BF16: tl.constexpr,
                         BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """c (M, N) = (a * 2^ea) @ (b * 2^eb)^T (+ bias), as _mx_gemm_kernel, with the scales applied
    while loading (fp8 -> fp32 * 2^e -> bf16) and a bf16 tl.dot: Hopper's wgmma. INTERPRETED:
    the tiles hold the same bf16 values in fp32 (the products and sums are the same: exact
    products, fp32 sums), as the interpreter's bf16 is unusable here."""
    pid_m, pid_n = _tile_coords(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    safe_m = tl.where(offs_m < M, offs_m, 0)  # rows past the edge read row 0, never stored
    safe_n = tl.where(offs_n < N, offs_n, 0)
    KS = K // 32  # scales per row
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(tl.cdiv(K, BLOCK_K)):
        a = _mx_tile_to_bf16(a_desc.load([pid_m * BLOCK_M, ki * BLOCK_K]), a_scale_ptr, safe_m, ki, KS,
                             BLOCK_M, BLOCK_K, INTERPRETED)
        b = _mx_tile_to_bf16(b_desc.load([pid_n * BLOCK_N, ki * BLOCK_K]), b_scale_ptr, safe_n, ki, KS,
                             BLOCK_N, BLOCK_K, INTERPRETED)
        acc = tl.dot(a, b.T, acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + safe_n).to(tl.float32)[None, :]
    if ROUND_BF16:
        acc = _round_to_bf16_grid(acc)
    c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(c_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(c_ptr.dtype.element_ty), mask=c_mask)


def _interpreter_has_dot_scaled():
    from triton.runtime import interpreter
    return hasattr(interpreter.InterpreterBuilder, "create_dot_scaled")


MX_METHODS = ("dot_scaled", "bf16")


def mx_method(device):
    """The MX GEMM gemm_mx runs by default: "bf16" on Hopper (sm_90 has no MX instruction, and
    dot_scaled's own upcast there reads the scale 2^-127 as zero) and in an interpreter without
    dot_scaled (triton 3.6); "dot_scaled" elsewhere (sm_100's block-scaled MMA)."""
    if device.type == "cuda":
        return "bf16" if torch.cuda.get_device_capability(device)[0] == 9 else "dot_scaled"
    return "dot_scaled" if _interpreter_has_dot_scaled() else "bf16"


def gemm_mx(a_data, a_scale, b_data, b_scale, out_dtype=torch.bfloat16, bias=None, method=None):
    """out (M, N) = (a_data * a_scale) @ (b_data * b_scale)^T (+ bias), accumulated in fp32.

    a_data (M, K), b_data (N, K): float8_e4m3fn or float8_e5m2 (MXFP8 uses E4M3), row-major.
    a_scale (M, ceil(K/32)), b_scale (N, ceil(K/32)): torch.float8_e8m0fnu DECODE scales 2^k,
    one per 32 values of a row along K (nanofp8.mx.mx_scales(q) of an MX Fp8Tensor q).
    The bias is added to the fp32 product before the cast to out_dtype. K need not be a multiple
    of 32: the operands are then zero-padded to one (a copy). Needs a CUDA GPU with TMA or the
    interpreter. method: None picks mx_method(device); "dot_scaled" (tl.dot_scaled: sm_100's
    block-scaled MMA; interpreter of triton >= 3.9) or "bf16" (_mx_gemm_bf16_kernel: tiles
    dequantized to bf16 while loading, a bf16 tl.dot; equal to reference_gemm_mx_bf16 up to fp32
    summation order, and to reference_gemm_mx where every scaled value is exact in bf16)."""
    for name, t in (("a_data", a_data), ("b_data", b_data)):
        if not torch.is_tensor(t) or t.dtype not in MX_FORMATS or t.dim() != 2:
            raise ValueError(f"{name} must be a 2-D float8_e4m3fn or float8_e5m2 tensor, got "
                             f"{getattr(t, 'dtype', type(t))} of shape {tuple(getattr(t, 'shape', ()))}")
    if a_data.shape[1] != b_data.shape[1]:
        raise ValueError(f"contraction dims differ: a_data is {tuple(a_data.shape)}, b_data is "
                         f"{tuple(b_data.shape)} (b_data must be (N, K), i.e. B^T)")
    (M, K), N = a_data.shape, b_data.shape[0]
    for name, s, rows in (("a_scale", a_scale, M), ("b_scale", b_scale, N)):
        want = (rows, cdiv(K, MX_BLOCK))
        if not torch.is_tensor(s) or s.dtype != torch.float8_e8m0fnu or tuple(s.shape) != want:
            raise ValueError(f"{name} must be a float8_e8m0fnu tensor of shape {want} (one decode "
                             f"scale 2^k per {MX_BLOCK} values along K), got "
                             f"{getattr(s, 'dtype', type(s))} of shape {tuple(getattr(s, 'shape', ()))}")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    if bias is not None and (not torch.is_tensor(bias) or tuple(bias.shape) != (N,)):
        raise ValueError(f"bias must be a tensor of shape ({N},), got {getattr(bias, 'shape', bias)}")
    if max(M, N) * (K + MX_BLOCK) >= 2**31 or M * N >= 2**31:
        raise ValueError(f"M, N, K = {M}, {N}, {K}: operands or output of 2^31 or more elements "
                         "are not supported (int32 offsets)")
    _check_device(a_data, b_data, a_scale, b_scale, *([bias] if bias is not None else []))
    dev = a_data.device
    if dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] < 9:
        raise ValueError("gemm_mx needs a Hopper (sm_90) or newer GPU (TMA loads); "
                         "use the reference (dequantize and matmul) on older GPUs")
    if method is not None and method not in MX_METHODS:
        raise ValueError(f"method must be None or one of {MX_METHODS}, got {method!r}")
    method = method or mx_method(dev)
    if method == "dot_scaled" and INTERPRET and dev.type != "cuda" and not _interpreter_has_dot_scaled():
        raise ValueError(f"triton {triton.__version__}'s interpreter has no tl.dot_scaled (3.9 has "
                         "it): use method='bf16', run gemm_mx on a GPU, or upgrade triton")
    if torch.compiler.is_compiling():  # one opaque op in the graph, as fp8_gemm
        return gemm_mx_op(a_data, a_scale, b_data, b_scale, out_dtype, bias, method)
    return _launch_gemm_mx(a_data, a_scale, b_data, b_scale, out_dtype, bias, method)


def _launch_gemm_mx(a_data, a_scale, b_data, b_scale, out_dtype, bias, method):
    (M, K), N = a_data.shape, b_data.shape[0]
    if M == 0 or N == 0 or K == 0:
        out = torch.zeros((M, N), device=a_data.device, dtype=torch.float32)
        return (out if bias is None else out + bias.float()).to(out_dtype)

    def operand(d):  # contiguous, K padded with zeros to a multiple of 32, 16-byte aligned (TMA)
        u = d.contiguous().view(torch.uint8)
        if K % MX_BLOCK:
            u = F.pad(u, (0, -K % MX_BLOCK))
        elif u.data_ptr() % 16:
            u = u.clone()
        return u.view(d.dtype)

    a, b = operand(a_data), operand(b_data)
    sa, sb = (s.contiguous().view(torch.uint8) for s in (a_scale, b_scale))
    c = torch.empty((M, N), device=a.device, dtype=out_dtype)
    if a.device.type == "cuda":
        triton.set_allocator(tma_scratch)  # the TMA descriptors' scratch (per thread: see fp8_gemm)
    grid = lambda META: (cdiv(M, META["BLOCK_M"]) * cdiv(N, META["BLOCK_N"]),)
    bias_arg = bias.contiguous() if bias is not None else sa
    round_bf16 = INTERPRET and out_dtype == torch.bfloat16
    if method == "bf16":
        _mx_gemm_bf16_kernel[grid](a, b, c, sa, sb, bias_arg, M, N, a.shape[1], HAS_BIAS=bias is not None,
                                   INTERPRETED=INTERPRET, ROUND_BF16=round_bf16)
        return c
    _mx_gemm_kernel[grid](a, b, c, sa, sb, bias_arg, M, N, a.shape[1], A_FMT=MX_FORMATS[a.dtype],
                          B_FMT=MX_FORMATS[b.dtype], HAS_BIAS=bias is not None, ROUND_BF16=round_bf16)
    return c


@torch.library.custom_op("nanofp8::gemm_mx", mutates_args=())
def gemm_mx_op(a_data: torch.Tensor, a_scale: torch.Tensor, b_data: torch.Tensor, b_scale: torch.Tensor,
               out_dtype: torch.dtype, bias: Optional[torch.Tensor], method: str) -> torch.Tensor:
    return _launch_gemm_mx(a_data, a_scale, b_data, b_scale, out_dtype, bias, method)


@gemm_mx_op.register_fake
def _(a_data, a_scale, b_data, b_scale, out_dtype, bias, method):
    return a_data.new_empty((a_data.shape[0], b_data.shape[0]), dtype=out_dtype)


# -----------------------------------------------------------------------------
# `python kernels.py`: correctness check everywhere, benchmark on CUDA

GEMM_SHAPES = ([(f"square {s}", (s, s, s)) for s in (1024, 2048, 4096, 8192)]  # (M, N, K)
               + [(f"GPT-2 124M {n}", (8192, N, K)) for n, (K, N) in
                  {"qkv": (768, 2304), "proj": (768, 768), "fc": (768, 3072), "fc-proj": (3072, 768)}.items()]
               + [(f"GPT-2 XL {n}", (8192, N, K)) for n, (K, N) in
                  {"qkv": (1600, 4800), "proj": (1600, 1600), "fc": (1600, 6400), "fc-proj": (6400, 1600)}.items()]
               + [(f"LLaMA-7B {n}", (8192, N, K)) for n, (K, N) in
                  {"qkv": (4096, 12288), "o": (4096, 4096), "gate/up": (4096, 11008), "down": (11008, 4096)}.items()]
               # weight gradients: dW (out, in) summed over K = 8192 tokens (few tiles: split-K)
               + [(f"GPT-2 124M {n} wgrad", (M, N, 8192)) for n, (M, N) in {"proj": (768, 768), "fc": (3072, 768)}.items()])
# The benchmark's summary: each Triton GEMM over its cuBLAS counterpart (MX: over bf16's matmul)
RATIOS = [("triton", "_scaled_mm"), ("triton fast", "_scaled_mm fast"), ("triton block", "_scaled_mm block"),
          ("triton mx", "bf16 matmul")]


def sqnr(ref, x):
    """Signal-to-quantization-noise ratio in dB: 20 log10(|ref| / |ref - x|) (nanofp8.fp8.sqnr)."""
    noise = (ref.double() - x.double()).norm()
    return float("inf") if noise == 0 else (20 * torch.log10(ref.double().norm() / noise)).item()


def reference_quantize(x, fmt_dtype, granularity="tensor", block=(1, KBLOCK), margin=0,
                       power_of_two=False):
    """The quantizers' contract in plain torch, as nanofp8.fp8.quantize computes it: amax per
    tensor / row / tile (padding reads 0), scale = fp8_max / max(amax, 1e-12) in float64 (rounded
    down to a power of two, divided by 2^margin), 1.0 where amax is not finite; then clamp, NaN
    for non-finite inputs, and torch's round-to-nearest-even cast. Returns (data, scale)."""
    fp8_max = FP8_FORMATS[fmt_dtype][0]
    x2 = x.reshape(-1, x.shape[-1]).float()
    R, C = x2.shape
    br, bc = {"tensor": (R, C), "row": (1, C)}.get(granularity, tuple(block))
    padded = F.pad(x2.abs(), (0, -C % bc, 0, -R % br))
    amax = padded.reshape(padded.shape[0] // br, br, -1, bc).amax(dim=(1, 3))
    s = fp8_max / amax.double().clamp(min=AMAX_EPS.value)
    if power_of_two:
        s = torch.exp2(torch.floor(torch.log2(s)))
    s = torch.where(torch.isfinite(amax), (s / 2.0**margin).float(), 1.0)
    s_el = s.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:R, :C]
    data = torch.where(torch.isfinite(x2), (x2 * s_el).clamp(-fp8_max, fp8_max), torch.nan)
    return data.to(fmt_dtype), s.reshape(()) if granularity == "tensor" else s


def reference_gemm(a, b, a_inv_scale, b_inv_scale, bias=None):
    """fp32 (a * a_inv_scale) @ (b * b_inv_scale)^T (+ bias), summed per 128-wide slice of K."""
    def dequantize(d, s):
        rows, k = d.shape
        if s.numel() > 1 and tuple(s.shape) != (rows, 1):  # tiles: one scale per element
            s = s.repeat_interleave(1 if s.shape[0] == rows else KBLOCK, 0)[:rows]
            s = s.repeat_interleave(KBLOCK, 1)[:, :k]
        return d.float() * s
    a32, b32 = dequantize(a, a_inv_scale), dequantize(b, b_inv_scale)
    out = sum(a32[:, k:k + KBLOCK] @ b32[:, k:k + KBLOCK].t() for k in range(0, a.shape[1], KBLOCK))
    return out if bias is None else out + bias.float()


def reference_gemm_mx(a_data, a_scale, b_data, b_scale, bias=None):
    """gemm_mx's contract: both MX operands dequantized to fp32 (exact: an fp8 value times a
    power of two, its E8M0 decode scale repeated over 32 values of K), then reference_gemm's
    fp32 product summed per 128-wide slice of K (+ bias)."""
    def dequantize(d, s):
        return d.float() * s.float().repeat_interleave(MX_BLOCK, 1)[:, :d.shape[1]]
    one = torch.ones((), device=a_data.device)
    return reference_gemm(dequantize(a_data, a_scale), dequantize(b_data, b_scale), one, one, bias)


def reference_gemm_mx_bf16(a_data, a_scale, b_data, b_scale, bias=None):
    """gemm_mx's contract with method="bf16" (Hopper): reference_gemm_mx of the operands dequantized
    to fp32 (exact) and rounded to nearest-even bf16, which changes only values off bf16's grid:
    scaled values below 2^-126 that are not multiples of 2^-133 (E8M0 bytes 0..2 with E4M3 data,
    0..9 with E5M2)."""
    def bf16_grid(d, s):
        v = d.float() * s.float().repeat_interleave(MX_BLOCK, 1)[:, :d.shape[1]]
        return v.bfloat16().float()
    one = torch.ones((), device=a_data.device)
    return reference_gemm(bf16_grid(a_data, a_scale), bf16_grid(b_data, b_scale), one, one, bias)


def mx_operand(x):
    """(E4M3 data, E8M0 decode scales) of a finite x (rows, K) under the OCP MX rule: per 32 values of a
    row, k = floor(log2(amax)) - 8 clamped to [-127, 127] (an all-zero block: -127), data =
    saturate(x / 2^k). For the self-check and the benchmark (nanofp8.fp8 has the training cast)."""
    rows, K = x.shape
    blocks = F.pad(x.float(), (0, -K % MX_BLOCK)).reshape(rows, -1, MX_BLOCK)
    amax = blocks.abs().amax(dim=-1).double()
    k = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 8, -127.0).clamp(-127, 127)
    data = (blocks / torch.exp2(k).float()[..., None]).clamp(-448, 448).reshape(rows, -1)[:, :K]
    return data.to(torch.float8_e4m3fn), (k + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def native_block_gemm(a, b, a_inv, b_inv, out_dtype, padded=True):
    """torch's own 1x128 x 128x128 block GEMM: torch.nn.functional.scaled_mm with the weight's
    scale grid padded to a multiple of 4 K tiles (padded=True), or the v1 torch._scaled_mm with
    the unpadded grid, which cuBLASLt misreads unless ceil(K/128) % 4 == 0 (PyTorch PR 166752)."""
    sa = a_inv.t().contiguous().t()
    if not padded:
        return torch._scaled_mm(a, b.t(), sa, b_inv.t(), out_dtype=out_dtype)
    return F.scaled_mm(a, b.t(), sa, F.ScalingType.BlockWise1x128, F.pad(b_inv, (0, -b_inv.shape[1] % 4)).t(),
                       F.ScalingType.BlockWise128x128, output_dtype=out_dtype)


def _self_check(device):
    """Quantizers vs reference_quantize (bytes and scales), GEMM vs reference_gemm."""
    torch.manual_seed(0)
    M, N, K = (65, 96, 200) if device == "cpu" else (1000, 1536, 2000)
    x = torch.randn(M, K, device=device) * 4
    x[0, :3] = torch.tensor([float("inf"), float("nan"), 1e-30])
    grans = (("tensor", (1, KBLOCK)), ("row", (1, KBLOCK)), ("block", (1, KBLOCK)),
             ("block", (KBLOCK, KBLOCK)))
    same_bytes = lambda a, b: torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # noqa: E731
    name = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
    ok = True
    for fmt in FP8_FORMATS:
        for gran, block in grans:
            ref, ref_scale = reference_quantize(x, fmt, gran, block, margin=1)
            data, scale = quantize(x, fmt, gran, block, margin=1)
            same = same_bytes(data, ref) and torch.equal(scale, ref_scale)
            ok &= same
            print(f"quantize {name[fmt]} {gran:6s} {str(block) if gran == 'block' else '':10s} "
                  f"bit-exact: {same}")
        data, data_t, scale = quantize_transpose(x, fmt, margin=1)
        ref, ref_scale = reference_quantize(x, fmt, margin=1)
        same = same_bytes(data, ref) and same_bytes(data_t, ref.t()) and torch.equal(scale, ref_scale)
        ok &= same
        print(f"quantize_transpose {name[fmt]}            bit-exact: {same}")
    x = x.nan_to_num(0.0, 0.0, 0.0)
    w = torch.randn(N, K, device=device) * 0.05
    bias = torch.randn(N, device=device)
    for fa, fb in ((torch.float8_e4m3fn, torch.float8_e4m3fn), (torch.float8_e5m2, torch.float8_e4m3fn)):
        for gran, ba, bb in (("tensor", None, None), ("row", None, None),
                             ("block", (1, KBLOCK), (KBLOCK, KBLOCK))):
            a, sa = quantize(x, fa, gran, ba or (1, KBLOCK))
            b, sb = quantize(w, fb, gran, bb or (1, KBLOCK))
            ref = reference_gemm(a, b, sa.reciprocal(), sb.reciprocal(), bias)
            out = fp8_gemm(a, b, sa.reciprocal(), sb.reciprocal(), torch.float32, bias)
            rel = ((out - ref).abs().max() / ref.abs().max()).item()
            # The interpreter sums in fp32 as the reference does. Hopper's FP8 MMA sums in its own
            # order and precision: 1.4e-4 to 2.0e-4 on an H200 (78 dB). A misread scale is < 0 dB.
            ok &= rel < (1e-5 if device == "cpu" else 1e-3)
            print(f"fp8_gemm {name[fa]}x{name[fb]} {gran:6s} M,N,K={M},{N},{K}: max rel err {rel:.2e}, "
                  f"SQNR vs fp32 reference {sqnr(ref, out):.1f} dB, vs unquantized "
                  f"{sqnr(x @ w.t() + bias, out):.1f} dB")
    ok &= _self_check_mx(x, w, bias)
    if device == "cuda" and torch.cuda.get_device_capability()[0] == 9 and hasattr(F, "scaled_mm"):
        # torch's native block GEMM at K = 768 (6 K tiles: the case the v1 call gets wrong)
        a, sa = quantize(x[:, :768].contiguous(), torch.float8_e4m3fn, "block", (1, KBLOCK))
        b, sb = quantize(w[:, :768].contiguous(), torch.float8_e4m3fn, "block", (KBLOCK, KBLOCK))
        ref = reference_gemm(a, b, sa.reciprocal(), sb.reciprocal())
        for padded in (True, False):
            try:
                out = native_block_gemm(a, b, sa.reciprocal(), sb.reciprocal(), torch.float32, padded)
                db = sqnr(ref, out)
            except (RuntimeError, ValueError) as e:
                db = f"refused ({str(e).splitlines()[0][:80]})"
            if padded:  # right: about 78 dB, as the Triton GEMM; a misread scale: below 0 dB
                ok &= not isinstance(db, str) and db > 60
            print(f"torch native block GEMM, K=768, {'F.scaled_mm, padded scales' if padded else 'torch._scaled_mm, unpadded (expected wrong)'}: "
                  f"SQNR vs reference {db if isinstance(db, str) else f'{db:.1f} dB'}")
    print("correctness:", "OK" if ok else "FAILED")
    return ok


def _self_check_mx(x, w, bias):
    """gemm_mx of the OCP MX casts of x and w (K = 200 / 2000: padded to a multiple of 32)."""
    cpu = x.device.type == "cpu"
    if (cpu and not _interpreter_has_dot_scaled()) or (not cpu and torch.cuda.get_device_capability()[0] < 9):
        print(f"gemm_mx: skipped (needs sm_90+ or the interpreter of triton >= 3.9; triton {triton.__version__})")
        return True
    (a, sa), (b, sb) = mx_operand(x), mx_operand(w)
    ref = reference_gemm_mx(a, sa, b, sb, bias)
    ok = True
    # the GPU's own method; in the interpreter both (the bf16 one is Hopper's)
    for method in ("dot_scaled", "bf16") if cpu else (mx_method(x.device),):
        out = gemm_mx(a, sa, b, sb, torch.float32, bias, method=method)
        rel = ((out - ref).abs().max() / ref.abs().max()).item()
        # the interpreter and Hopper (bf16 tiles exact here, fp32 wgmma sums) differ from the reference
        # in fp32 summation order only; sm_100's block-scaled MMA has not been measured: fp8_gemm's bound
        print(f"gemm_mx {method} e4m3 (1x32 E8M0 scales) M,N,K={x.shape[0]},{w.shape[0]},{x.shape[1]}: "
              f"max rel err {rel:.2e}, SQNR vs fp32 reference {sqnr(ref, out):.1f} dB, vs unquantized "
              f"{sqnr(x @ w.t() + bias, out):.1f} dB")
        ok &= rel < (1e-5 if cpu else 1e-3)
    return ok


def _benchmark(json_path=None):
    """TFLOPS of every GEMM on GEMM_SHAPES, and the RATIOS per shape. Its GPU time is bounded:
    18 shapes x 9 GEMMs x one do_bench each (~0.15 s) is about 25 s; compiling is about 25
    kernels (fp8_gemm: at most two tiles a shape from gemm_plan, over 5 tiles and 3 variants, plus
    the split-K reduction; gemm_mx: 3 tiles), a few seconds each: about 2-3 minutes in all."""
    import datetime
    import json
    import time
    from triton.testing import do_bench, do_bench_cudagraph
    t0 = time.time()
    e4m3, bf16, dev = torch.float8_e4m3fn, torch.bfloat16, "cuda"
    names = ["triton", "triton graph", "triton fast", "triton block", "triton mx", "_scaled_mm", "_scaled_mm fast",
             "_scaled_mm block", "bf16 matmul"]
    print(f"\nGEMM TFLOPS (2*M*N*K / time) on {torch.cuda.get_device_name()}, bf16 output; "
          "'fast' = Hopper fast accumulation, 'block' = 1x128 x 128x128 block scales, "
          f"'mx' = gemm_mx, MXFP8 1x32 E8M0 scales (method {mx_method(torch.device(dev))!r}); "
          "'graph' = 'triton' replayed in a CUDA graph: the GPU's time without the host's")
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, compute capability "
          f"{torch.cuda.get_device_capability()}; 'n/a' where torch._scaled_mm refuses a GEMM")
    print(f"{'shape':22s} {'M':>5s} {'N':>6s} {'K':>6s} " + " ".join(f"{n:>15s}" for n in names))
    results = {"device": torch.cuda.get_device_name(), "date": datetime.datetime.now().isoformat(),
               "torch": torch.__version__, "triton": triton.__version__, "gemm": [], "quantize": []}
    for label, (M, N, K) in GEMM_SHAPES:
        x, w = torch.randn(M, K, device=dev, dtype=bf16), torch.randn(N, K, device=dev, dtype=bf16)
        (qa, sa), (qb, sb) = quantize(x, e4m3, "tensor"), quantize(w, e4m3, "tensor")
        (ta, tsa), (tb, tsb) = quantize(x, e4m3, "block", (1, 128)), quantize(w, e4m3, "block", (128, 128))
        ia, ib, tia, tib = sa.reciprocal(), sb.reciprocal(), tsa.reciprocal(), tsb.reciprocal()
        (ma, msa), (mb, msb) = mx_operand(x), mx_operand(w)
        fns = [lambda: fp8_gemm(qa, qb, ia, ib, bf16),
               lambda: fp8_gemm(qa, qb, ia, ib, bf16),  # (timed in a CUDA graph, below)
               lambda: fp8_gemm(qa, qb, ia, ib, bf16, fast_accum=True),
               lambda: fp8_gemm(ta, tb, tia, tib, bf16),
               lambda: gemm_mx(ma, msa, mb, msb, bf16),
               lambda: torch._scaled_mm(qa, qb.t(), ia, ib, out_dtype=bf16),
               lambda: torch._scaled_mm(qa, qb.t(), ia, ib, out_dtype=bf16, use_fast_accum=True),
               # native 1x128 x 128x128 (SM90, cuBLASLt >= 12.9, torch >= 2.11), in the scale
               # layouts nanofp8/fp8.py passes: (M, K/128) with strides (1, M), and the weight's
               # grid padded to a multiple of 4 K tiles, as cuBLASLt reads it (v2 API)
               lambda: native_block_gemm(ta, tb, tia, tib, bf16),
               lambda: torch.matmul(x, w.t())]
        row = {"shape": label, "M": M, "N": N, "K": K}
        for name, fn in zip(names, fns):
            try:
                ms = do_bench_cudagraph(fn) if name == "triton graph" else do_bench(fn)
                row[name] = round(2 * M * N * K / ms * 1e-9, 1)
            except Exception as e:  # report the failure, never a number we did not measure
                print(f"  {name} failed on {label}: {str(e).splitlines()[0][:120]}")
                row[name] = None
        for num, den in RATIOS:
            row[f"{num} / {den}"] = round(row[num] / row[den], 3) if row[num] and row[den] else None
        results["gemm"].append(row)
        print(f"{label:22s} {M:5d} {N:6d} {K:6d} " + " ".join(
            f"{'n/a' if row[n] is None else row[n]:>15}" for n in names))
        print(f"{'':22s} ratios: " + ", ".join(f"{n} {'n/a' if row[n] is None else f'{row[n]:.2f}'}"
                                              for n in (f"{a} / {b}" for a, b in RATIOS)))
        del x, w, qa, qb, ta, tb, ma, mb
    print("\nquantization GB/s ((bytes read once + bytes written) / time), x = 8192 x 4096 bf16")
    x = torch.randn(8192, 4096, device=dev, dtype=bf16)
    io = x.numel() * (x.element_size() + 1)
    cases = [("tensor (2 passes)", lambda: quantize(x, e4m3, "tensor"), io),
             ("row", lambda: quantize(x, e4m3, "row"), io),
             ("block 1x128", lambda: quantize(x, e4m3, "block", (1, 128)), io),
             ("block 128x128", lambda: quantize(x, e4m3, "block", (128, 128)), io),
             ("tensor + transpose", lambda: quantize_transpose(x, e4m3), io + x.numel())]
    for name, fn, nbytes in cases:
        gbs = round(nbytes / do_bench(fn) * 1e-6, 1)
        results["quantize"].append({"kernel": name, "shape": list(x.shape), "GB/s": gbs})
        print(f"  {name:20s} {gbs:8.1f}")
    results["seconds"] = round(time.time() - t0, 1)  # compiling included (see the docstring)
    print(f"benchmark: {results['seconds']} s")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=1)
        print(f"wrote {json_path}")


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--json", metavar="PATH", help="write the benchmark figures to PATH")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ok = _self_check(device)
    if device == "cuda":
        _benchmark(args.json)
    else:
        print("no CUDA GPU: kernels ran in the Triton interpreter; timings need a GPU (skipped)")
    sys.exit(0 if ok else 1)
