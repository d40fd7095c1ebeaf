"""
FP8 training, from the bits up: formats, scaling, and the FP8 linear layer.

This file is meant to be read top to bottom. It is everything nanofp8 needs to run the
GEMMs of a Linear layer in 8-bit floating point, and it doubles as a lesson.

1. Two 8-bit formats
--------------------
An 8-bit float has 1 sign bit and 7 bits to split between exponent (range) and mantissa
(precision). Hopper tensor cores take two splits:

    E4M3 (torch.float8_e4m3fn): 4 exponent bits, 3 mantissa bits. Max 448, smallest normal
         2^-6, smallest subnormal 2^-9. No infinity ("fn" = finite): 0x7f/0xff are NaN.
    E5M2 (torch.float8_e5m2):   5 exponent bits, 2 mantissa bits. Max 57344, smallest normal
         2^-14, smallest subnormal 2^-16. Has +-inf, like a shortened fp16.

Each spans only about 18 (E4M3) or 32 (E5M2) binades, against fp32's 277. Weights and
activations have a fairly tame spread, and they benefit from the extra mantissa bit, so they
use E4M3. Gradients are spikier (a few large values next to many tiny ones), and losing a
tiny gradient to underflow is worse than rounding a large one, so they get E5M2's range.
That split is the "hybrid" convention (Transformer Engine, MS-AMP, torchao tensorwise).
Fine-grained recipes (DeepSeek-V3) give every 128 values their own scale, which makes range
much less of a problem, so they use E4M3 everywhere: `Recipe(formats="e4m3")`.

2. Scaling: putting a tensor's values where the format has room
---------------------------------------------------------------
FP8's range is tiny, so a tensor is multiplied by a scale before the cast, chosen to bring its
largest magnitude (amax) up to the format's max:

    scale = fp8_max / amax          x_fp8 = saturate(x * scale)          x ~= x_fp8 / scale

THE CONVENTION, stated once: in nanofp8 `scale` is always the multiply-before-cast factor (as in
Transformer Engine and torchao). Dequantizing multiplies by `inv_scale = 1 / scale`, and that
inverse is what `torch._scaled_mm` (and our Triton kernel) take as `scale_a` / `scale_b`: they
compute (a_fp8 * inv_a) @ (b_fp8 * inv_b).

Details that matter:
  * amax is taken in float64 before the division. fp8_max / amax in fp32 can round differently
    depending on how the compiler fuses it; float64 then one rounding to fp32 gives the same
    scale in eager, compiled and Triton code (torchao's trick), so every backend multiplies the
    very same FP8 bytes and scales (only the fp32 summation order of the GEMM may differ).
  * amax is clamped to >= 1e-12 so an all-zero tensor gets a large finite scale, not inf.
  * Optional power-of-two scales (rounded down, as MS-AMP always does): multiplying by 2^k is
    exact, so scaling itself adds no rounding error and the scale survives any re-encoding.
  * margin m divides the scale by 2^m: headroom for values that grow before the next amax.
  * Casts saturate: a finite value never becomes inf or NaN (we clamp to +-fp8_max first;
    E5M2 would otherwise overflow to inf). A non-finite input is NOT hidden: torch's E4M3
    cast would turn inf into 448, so we map inf/NaN to NaN explicitly and let it propagate
    to the loss, where the training loop sees it and skips the step.
  * A NaN or inf amax never becomes a scale: the previous scale (or 1.0) is kept instead.

Where the amax comes from:
  * current ("just-in-time") scaling: the amax of the very tensor being cast. Always fits,
    costs one extra read of the tensor.
  * delayed scaling: the amax of the last H steps (the history), as Transformer Engine does.
    The scale used at step t comes only from steps before t; the amax of step t is recorded
    afterwards, by the same pass that casts. Values can outgrow a stale scale, and then they
    saturate: every layer counts the values it clipped, per tensor role, and train.py logs them
    on the step it happens. The first cast of a role has no history: it measures the tensor
    itself (Transformer Engine starts from a scale of 1.0, which flushes a gradient of 1e-6 to
    zero), so the history starts from a true value.

How many scales:
  * "tensor": one scale for the whole tensor.
  * "row":    one scale per row of the GEMM operand, along the contraction dimension.
  * "block":  one scale per tile: 1x128 for activations and gradients (one token, 128
              channels), 128x128 for weights, as in DeepSeek-V3. One outlier then only costs
              precision to its own 128 neighbours, not to the whole tensor.

3. The three GEMMs of a Linear layer
------------------------------------
For y = x W^T (x: M x K tokens by features, W: N x K), training runs three GEMMs:

    forward  y  = x  @ W^T     E4M3 x E4M3   contraction over K
    dgrad    dx = dy @ W       E5M2 x E4M3   contraction over N
    wgrad    dW = dy^T @ x     E5M2 x E4M3   contraction over M (the tokens)

Every GEMM here is written in one form, out = A @ B^T with A: (rows, k), B: (cols, k), both
quantized along k. That matters twice. First, scales must sit along the non-contracted
dimensions (a row scale of A and a row scale of B factor out of the dot product; a scale that
varied along k would not), so each GEMM quantizes its operands along its own contraction
dimension: the row-scaled x of the forward pass cannot be reused for wgrad, where the
contraction is over tokens. Second, FP8 tensor cores (and torch._scaled_mm) want the first
operand row-major and the second column-major, which is exactly what B (cols, k) row-major
viewed as B^T is.

What is saved for backward are the FP8 operands the backward GEMMs need (x^T and W^T, quantized
along M and N respectively), not the high-precision x and W: an activation saved for backward
then costs 1 byte per element instead of 2 or 4, which is most of the activation memory of a
transformer. With tensor scaling these are plain transposes of the forward copies; with row and
block scaling they are re-quantized from the high-precision values while those are still at hand.

Fast accumulation (Hopper's cheaper, less precise FP8 accumulate) is used only in the forward
GEMM; gradients, whose errors compound over training, always get the careful path.

4. What a cast did: the statistics (nanofp8/stats.py, train.py's fp8_stats_interval)
------------------------------------------------------------------------------------
A cast loses information in three ways, and each has its own number per layer and operand:
  * saturation: values the clamp changed, because they lay beyond the format's max at this
    scale. Current scaling cannot saturate (the scale is made from this very amax); delayed
    scaling does when a tensor outgrows its history.
  * underflow and subnormals: values too small for the scale, flushed to zero or kept with
    fewer mantissa bits. One outlier under current scaling pushes the other values towards them.
  * rounding: the rest keep 3 (E4M3) or 2 (E5M2) mantissa bits. The SQNR of the FP8 copy
    against its source measures the total: about 31 and 25 dB on well-scaled data.
The SQNR is dominated by the largest values, so it can stay near 31 dB while the small ones
drop into subnormals; read it together with the fractions. With row and block scales, the
spread of the scales (log2 of the largest over the smallest) says how much range a single
tensor scale would have needed. Every Linear's FP8 status is listed at start-up, and a GEMM
that falls back to high precision at run time is counted (fallbacks), or refused (strict).
"""

import math
import os
import warnings
from dataclasses import dataclass, field, fields, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

# -----------------------------------------------------------------------------
# 1. Formats


@dataclass(frozen=True)
class Fp8Format:
    name: str
    dtype: torch.dtype
    max: float  # largest finite value
    min_normal: float  # below this, values lose mantissa bits (subnormals), then flush to 0


E4M3 = Fp8Format("e4m3", torch.float8_e4m3fn, 448.0, 2.0**-6)
E5M2 = Fp8Format("e5m2", torch.float8_e5m2, 57344.0, 2.0**-14)


def clip_edge(fmt):
    """The rounding boundary above the format's max (max + half a step of its top binade: 464 for
    E4M3, 61440 for E5M2). A scaled value beyond it was clipped: the cast changed it by more than
    rounding to nearest would have."""
    mantissa_bits = round(-math.log2(torch.finfo(fmt.dtype).eps))
    return fmt.max + 2.0 ** (math.floor(math.log2(fmt.max)) - mantissa_bits) / 2

# (format of weights and activations, format of gradients)
FORMAT_CONVENTIONS = {"hybrid": (E4M3, E5M2), "e4m3": (E4M3, E4M3)}

AMAX_EPS = 1e-12  # amax floor: an all-zero tensor gets a large finite scale, never inf
BLOCK = 128  # tile edge of block scaling (DeepSeek-V3), and the K step of the block GEMM

# -----------------------------------------------------------------------------
# 2. Scales and the quantized-tensor container


def compute_scale(amax, fmt, margin=0, power_of_two=False, fallback=None):
    """scale = fp8_max / amax (/ 2^margin), computed in float64, returned as fp32.

    Where amax is NaN or inf, the result is `fallback` (same shape, or broadcastable) or 1.0:
    a bad amax is never allowed to become a scale."""
    amax64 = amax.detach().double()
    scale = fmt.max / torch.clamp(amax64, min=AMAX_EPS)
    if power_of_two:
        scale = torch.exp2(torch.floor(torch.log2(scale)))  # round down: never exceed range
    scale = (scale / 2.0**margin).float()
    if fallback is None:
        fallback = torch.ones_like(scale)
    return torch.where(torch.isfinite(amax64), scale, fallback.float().expand_as(scale))


@dataclass
class Fp8Tensor:
    """FP8 data + fp32 scales + what is needed to give the original tensor back.

    data is 2-D (rows, cols) = the input flattened to (-1, last dim), contiguous (on a CPU, the
    transpose t() gives is a view instead: see there)
    scale (the multiply-before-cast factor) has shape () for "tensor", (rows, 1) for "row",
    and (ceil(rows/br), ceil(cols/bc)) for "block" with tiles `block` = (br, bc)."""

    data: torch.Tensor
    scale: torch.Tensor
    fmt: Fp8Format
    granularity: str
    block: tuple
    shape: torch.Size  # original shape
    dtype: torch.dtype  # original dtype
    amax: torch.Tensor = None  # the amax the data was measured with (NaN where it was non-finite;
    #                            None where a Triton quantizer measured it and kept it on chip)
    data_t: torch.Tensor = None  # the transposed copy, where the quantizer wrote it in the same pass
    _inv: tuple = field(default=None, repr=False, compare=False)  # (scale, 1 / scale), once computed

    @property
    def inv_scale(self):
        """1 / scale, what the GEMMs multiply by; computed once per scale (a cached weight cast
        serves every micro-step of an optimizer step). Kept with the scale it inverts, so a
        container whose scale is replaced (clipping divides an FP8 gradient's scale) never hands
        out the old inverse."""
        if self._inv is None or self._inv[0] is not self.scale:
            self._inv = (self.scale, self.scale.reciprocal())
        return self._inv[1]

    def t(self):
        """The transpose, without re-quantizing. A tensor scale and a square block grid transpose
        with the data; a row scale does not (it would then vary along the new contraction dim)."""
        if self.granularity == "row":
            raise ValueError("row-scaled FP8 data cannot be transposed: re-quantize the transpose")
        scale = self.scale if self.granularity == "tensor" else self.scale.t().contiguous()
        rows, cols = self.data.shape
        if self.data_t is not None:
            data_t = self.data_t
        elif _emulating(self.data):  # a view: the emulated GEMM wants this operand back in its
            data_t = self.data.t()   # original layout (_gemm_cpu's mat2), so a copy would be undone
        else:
            data_t = self.data.t().contiguous()
        return Fp8Tensor(data_t, scale, self.fmt, self.granularity, self.block[::-1],
                         torch.Size((cols, rows)), self.dtype, self.amax,
                         _inv=self._inv if self.granularity == "tensor" else None)


def _tile_amax(x2, block):
    """amax over (br, bc) tiles of a 2-D tensor; ragged edge tiles are padded with zeros."""
    br, bc = block
    rows, cols = x2.shape
    xp = F.pad(x2.abs(), (0, (-cols) % bc, 0, (-rows) % br))
    return xp.unflatten(1, (-1, bc)).unflatten(0, (-1, br)).amax(dim=(1, 3))


def expand_tiles(s, block, shape):
    """Tile scales (R, C) -> one per element (rows, cols): element (i, j) gets s[i // br, j // bc].
    A gather rather than s.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:rows, :cols]: under
    torch.compile, inductor's CPU code (torch 2.13) gets that form wrong when a dim is not a
    multiple of its tile (its "loop split" drops the ragged last tile): wrong numbers, no error."""
    rows = torch.arange(shape[0], device=s.device) // block[0]
    cols = torch.arange(shape[1], device=s.device) // block[1]
    return s[rows[:, None], cols]


def _per_element(q, s):
    """Broadcast a scale-shaped tensor of q to q.data's shape."""
    return expand_tiles(s, q.block, q.data.shape) if q.granularity == "block" else s


def _amax(x2, granularity, block):
    if granularity == "block":
        return _tile_amax(x2, block)
    # max(|x|) = max(max x, -min x): one read of x, where abs() then amax() make two passes
    lo, hi = torch.aminmax(x2) if granularity == "tensor" else torch.aminmax(x2, dim=1, keepdim=True)
    return torch.maximum(hi, -lo).abs()  # a NaN in x makes both NaN, an inf either; abs: +0, never -0


def amax_each(xs):
    """[max |x| for x in xs] as 0-dim tensors of each x's dtype, NaN where x holds a NaN. One
    foreach reduction on a GPU; on a CPU one aminmax per tensor, as torch's CPU inf-norm is a
    scalar loop (about 30x slower: the non-finite checks of an O2 step spent milliseconds in it)."""
    if not xs:
        return []
    if not _emulating(xs[0]):
        return list(torch._foreach_norm(xs, float("inf")))
    return [_amax(x, "tensor", None) if x.numel() else x.new_zeros(()) for x in xs]


def _saturating_cast(x2, scale_el, fmt, amax):
    """x * scale, clamped to the format's range, then rounded to FP8 (round-to-nearest-even).
    Non-finite inputs become NaN (E4M3 would silently turn inf into 448). `amax` is x's."""
    y = x2.float() * scale_el
    if _emulating(x2) and bool(torch.isfinite(amax).all()):
        # Every amax finite: no input is NaN or inf (either would make its group's amax NaN or
        # inf), so the `where` below would keep every value. On a CPU isfinite and where cost
        # several times the rest of the cast, and the amax is already measured.
        return y.clamp_(-fmt.max, fmt.max).to(fmt.dtype)
    y = torch.where(torch.isfinite(x2), y.clamp(-fmt.max, fmt.max), torch.nan)
    return y.to(fmt.dtype)


# On a CPU, FP8 is emulated, and torch's own float8 -> fp32 conversion is slow there (a scalar
# loop per element: about 4x the whole cast for E4M3). The emulation reads FP8 through
# fp8_to_float instead, the same bits from a few vectorized integer and fp16 operations; other
# devices (and torch.compile, which fuses the conversion) keep torch's conversion.


def _emulating(t):
    """Does the CPU emulation (fp8_to_float, the cast's shortcut, _gemm_cpu) handle t?"""
    return t.device.type == "cpu" and not torch.compiler.is_compiling()


def fp8_to_float(data, times=None):
    """The fp32 values of FP8 `data` (float8_e4m3fn or float8_e5m2), multiplied by `times` (a
    broadcastable fp32 tensor) if given: bit for bit data.float() * times (a NaN code gives a NaN),
    computed on a CPU without torch's scalar conversion loop. Other dtypes: data.float() * times."""
    if not _emulating(data) or data.dtype not in (E4M3.dtype, E5M2.dtype):
        return data.float() if times is None else data.float() * times
    if data.dim() == 2 and not data.is_contiguous() and data.t().is_contiguous():
        # a transposed view (Fp8Tensor.t() on a CPU): decode it in memory order, where the
        # reduction below runs several times faster, and hand back the same view of the result
        t_times = times.t() if times is not None and times.dim() == 2 else times
        return fp8_to_float(data.t(), t_times).t()
    c = data.view(torch.int8).to(torch.int16)  # sign-extended: bits 15..7 all hold the sign bit
    if data.dtype == torch.float8_e5m2:  # E5M2 is the top byte of an fp16: same exponent field
        out = (c << 8).view(torch.float16).float()
        return out if times is None else out.mul_(times)
    # E4M3 s.eeee.mmm -> the fp16 s.0eeee.mmm0000000, which is the value / 2^8: both formats
    # keep their subnormals at exponent field 0, so those map too. Shifted in place: every pass
    # over the data counts here.
    c.bitwise_left_shift_(7).bitwise_and_(~0x4000)
    out = c.view(torch.float16).float()
    lo, hi = torch.aminmax(out) if out.numel() else (out.new_zeros(()),) * 2  # finite codes:
    if bool(hi > 1.75) or bool(lo < -1.75):  # within +-448 / 2^8 = +-1.75; one pass to find out
        # The NaN codes s.1111.111 landed on +-480 / 2^8: give them the fp16 exponent 11111
        # instead, by adding 1 to their low 7 bits (which carries into bit 7). Rare: only a
        # non-finite input makes them (quantize's cast turns NaN and inf into NaN).
        c = data.view(torch.int8).to(torch.int16)
        h = (c << 7) & ~0x4000
        h |= (((c & 0x7F) + 1) << 7) & 0x4000
        out = h.view(torch.float16).float()
    if times is None:
        return out.mul_(2.0**8)
    # (value / 2^8) * (2^8 * times) rounds the same exact product once, as value * times does,
    # wherever 2^8 * times does not overflow
    k = times * 2.0**8
    if not bool(torch.isfinite(k).all()):
        out, k = out.mul_(2.0**8), times
    return out.mul_(k)


GRANULARITIES = ("tensor", "row", "block")


def quantize(x, fmt, granularity="tensor", block=(1, BLOCK), scale=None, margin=0,
             power_of_two=False, amax=None):
    """Quantize x to FP8 along its last dim (the GEMM contraction dim). Returns an Fp8Tensor.

    scale: use this scale instead of measuring one (delayed scaling). Its shape must match
    the granularity; the amax is still measured and returned in the container, unless `amax`
    gives it (x's, measured already)."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"unknown granularity {granularity!r}; expected one of {GRANULARITIES}")
    if x.dim() < 1 or x.numel() == 0:
        raise ValueError(f"cannot quantize a tensor of shape {tuple(x.shape)}")
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    block = tuple(block) if granularity == "block" else (1, x2.shape[1])
    if amax is None:
        amax = _amax(x2.detach(), granularity, block)
    if scale is None:
        scale = compute_scale(amax, fmt, margin, power_of_two)
    # Not a bare scale.float(): on an fp32 tensor that returns the tensor itself, a second name for
    # the same storage, and torch.compile refuses to save such an alias for the backward pass.
    scale = scale if scale.dtype == torch.float32 else scale.float()
    el = expand_tiles(scale, block, x2.shape) if granularity == "block" else scale
    # Contiguous (row-major) whatever x's layout: an elementwise op on a transposed view (the
    # x^T of a backward GEMM) keeps the transposed layout, which FP8 GEMMs do not take.
    data = _saturating_cast(x2.detach(), el, fmt, amax).contiguous()
    return Fp8Tensor(data, scale, fmt, granularity, block, x.shape, x.dtype, amax)


def dequantize(q, dtype=None):
    """The high-precision tensor (original shape; original dtype unless `dtype` is given)."""
    x = fp8_to_float(q.data, _per_element(q, q.inv_scale))
    return x.to(dtype or q.dtype).reshape(q.shape)


def sqnr(ref, approx):
    """Signal-to-quantization-noise ratio in dB: 20 log10(|ref| / |ref - approx|)."""
    ref, approx = ref.double(), approx.double()
    noise = (ref - approx).norm()
    return float("inf") if noise == 0 else (20 * torch.log10(ref.norm() / noise)).item()


# -----------------------------------------------------------------------------
# 3. The scaled GEMM, three ways: out = dequantize(a) @ dequantize(b).T (+ bias)
#
# torch._scaled_mm is strict on CUDA and lenient on CPU, and CI has no GPU. So the rules of the
# CUDA kernel (aten/src/ATen/native/cuda/ScaledBlas.cpp, torch >= 2.11) are written down here and
# every call is checked against them before it is made: a GEMM the kernel would refuse is never
# attempted, it goes to a named alternative, and the reason is reported once per layer. The
# tests replace torch._scaled_mm and `scaled_mm_support` with a strict stand-in of the CUDA
# kernel (tests/cuda_contract.py), so the calls made on an H100 are the calls checked on a CPU.
#
# The rules, for out = mat1 @ mat2 with mat1 = a (M, K) row-major, mat2 = b^T (K, N) column-major:
#   * K, N multiples of 16; fp32 scales (the *inverse* scales); never e5m2 x e5m2 (ValueError).
#   * scale modes, tried in this order: tensor x tensor (one element each), row x row
#     (scale_a (M, 1), scale_b (1, N)), then block pairs on SM90 with cuBLASLt >= 12.9 only:
#     1x128 (scale_a (M, ceil(K/128)) with strides (1, M); for b (ceil(K/128), N) contiguous) and
#     128x128 (for a (ceil(M/128), ceil(K/128)) contiguous; for b the transpose of b's
#     (ceil(N/128), ceil(K/128)) grid). 128x128 x 128x128 is not a pair; block modes refuse
#     use_fast_accum, and take E4M3 x E4M3 only: v2 refuses an E5M2 operand ("Invalid scaling
#     configuration": its block recipes, check_deepseek_recipe, compare both dtypes with E4M3 in
#     torch 2.11 and 2.13), and v1 passes it to cuBLASLt untested. So the dgrad and wgrad GEMMs
#     of formats="hybrid", whose gradient is E5M2, never meet torch's block GEMM.
#   * 128x128 scales as cuBLASLt reads them: row by row, each row's ceil(K/128) scales padded to
#     a multiple of 4 (L4). torch.nn.functional.scaled_mm (the v2 API, torch >= 2.10) checks for
#     that padded layout: (L4, row tiles) with strides (1, L4). The v1 torch._scaled_mm checks the
#     unpadded grid and hands its pointer on, so where ceil(K/128) % 4 != 0 the kernel reads the
#     wrong scales, and past the allocation, without an error (PyTorch PR 166752): v1 is used
#     for a 128x128 operand only where ceil(K/128) % 4 == 0, where the two layouts are one.
#   * no bias with fp32 output; a bias is bf16/fp16 and has the output's dtype.
#   * what PyTorch's own tests never run is not run here either: block scales with a bias (the
#     bias is added outside the GEMM, in fp32), and row scales with an E5M2 first operand (the
#     dgrad and wgrad GEMMs of formats="hybrid": the Triton GEMM, tested here for that pair, or
#     the fp32 reference).
#   * builds whose cuBLASLt is older than 12.9 (CUDA 12.6 wheels) run row x row on a CUTLASS
#     kernel that writes bf16/fp16 only and wants mat2 in E4M3 (ValueError otherwise).
#   * CPU: torch 2.11's kernel takes one-element (tensor) scales only; 2.13 also takes rows. We use
#     only what both take, and run the fp32 reference for the others (a CPU has no FP8 units, so
#     nothing is lost). Its dequantize-and-multiply matches the reference; on CPUs with AMX, torch
#     sends FP8 GEMMs to oneDNN instead, which applies the scales in another order. So on a CPU
#     the kernel is not called at all: _gemm_cpu does its arithmetic, with a faster FP8 decoding,
#     whether or not the CPU has AMX.

_warned = set()


def _warn_once(key, msg):
    # Under torch.compile this would be traced: mutating the set makes dynamo recompile. The
    # choice itself depends only on shapes, dtypes and the device, so eager calls report it.
    if key not in _warned and not torch.compiler.is_compiling():
        _warned.add(key)
        warnings.warn(msg, stacklevel=3)


# What really ran in FP8 (reported by nanofp8/stats.py): GEMMs that fell back to a high-precision
# GEMM at run time, per layer. strict = True (train.py's fp8_strict) makes such a fallback an error.
fallbacks = {}
strict = False
HIGH_PRECISION = "a high-precision GEMM of the FP8 values"


def _fell_back(name, reason, alt=HIGH_PRECISION):
    """A GEMM that torch._scaled_mm cannot run goes to `alt`, reported once per layer and reason.
    Only a high-precision GEMM is a fallback: counted per call, and an error under strict. The
    Triton GEMM or the row-wise loop still multiply in FP8: reported, not counted.
    Under torch.compile nothing is counted or reported: the choice is made while tracing and holds
    for every call of the graph, and a counter read and written there is a value dynamo guards on:
    it would recompile at every step, and past its limit of 8 run the model eagerly. Eager runs of
    the same shapes report it."""
    high = alt == HIGH_PRECISION
    if strict and high:
        raise RuntimeError(f"nanofp8: layer {name}: torch._scaled_mm cannot run this GEMM ({reason}), "
                           "and strict mode (fp8_strict=True) forbids a high-precision fallback")
    if torch.compiler.is_compiling():
        return
    if high:
        fallbacks[name] = fallbacks.get(name, 0) + 1
    _warn_once((name, reason), f"nanofp8: layer {name}: torch._scaled_mm cannot run this GEMM "
               f"({reason}); falling back to {alt}")


def _version(text):
    """'2.13.0+cpu' -> (2, 13); '12.6' -> (12, 6); None -> (0, 0)."""
    parts = (text or "0.0").split("+")[0].split(".")
    return tuple(int("".join(ch for ch in p if ch.isdigit()) or 0) for p in parts[:2])


# Fixed for the life of the process: parsed once here, not on every GEMM (scaled_mm_support runs
# three times per Linear per step). torch.version.cuda is the toolkit torch was built with; its
# cuBLASLt is that version or newer, so this under-reports at worst (then a slower path runs,
# never a refused call).
_CUBLASLT_12_9 = _version(torch.version.cuda) >= (12, 9)
_TORCH_2_11 = _version(torch.__version__) >= (2, 11)


@dataclass(frozen=True)
class ScaledMMSupport:
    """What torch._scaled_mm takes on one kind of device (the rules above)."""
    device: str  # "cuda": the CUDA rules apply (dims multiples of 16, bias rules); "cpu": lenient
    fp8: bool  # any FP8 GEMM at all (CUDA: compute capability 8.9 or newer)
    rowwise: bool  # per-row scales
    cublaslt_rowwise: bool  # row x row runs on cuBLASLt (>= 12.9): any output dtype, any mat2 format
    block: bool  # 1x128 / 128x128 block scales natively


@torch.compiler.assume_constant_result  # under torch.compile: asked once, a constant after
def _capability(index):
    return torch.cuda.get_device_capability(index)


def scaled_mm_support(device):
    """Feature detection for torch._scaled_mm on `device` (a torch.device)."""
    if device.type != "cuda":
        return ScaledMMSupport("cpu", fp8=True, rowwise=False, cublaslt_rowwise=False, block=False)
    major, minor = _capability(device.index)
    has_fp8 = (major, minor) >= (8, 9)
    return ScaledMMSupport("cuda", fp8=has_fp8, rowwise=has_fp8,
                           cublaslt_rowwise=_CUBLASLT_12_9 and major >= 9,
                           block=major == 9 and _CUBLASLT_12_9 and _TORCH_2_11)


def _gemm_emulate(a, b, out_dtype, bias):
    """The reference: dequantize both operands to fp32 and multiply. Slow, simple, exact.
    With block scales the fp32 partial sums are added one 128-wide slice of K at a time, the
    order in which a block-scaled kernel promotes them. The bias is added to the fp32 product
    before the output cast, as the GEMM kernels' epilogues do."""
    # (a is row-major, scaled_gemm saw to it; b as a CPU's transposed view makes b32.t() row-major)
    a32 = fp8_to_float(a.data, _per_element(a, a.inv_scale))
    b32 = fp8_to_float(b.data, _per_element(b, b.inv_scale))
    if a.granularity == "block":
        k = a32.shape[1]
        out = sum(a32[:, k0 : k0 + BLOCK] @ b32[:, k0 : k0 + BLOCK].t() for k0 in range(0, k, BLOCK))
    else:
        out = a32 @ b32.t()
    out = out if bias is None else out + bias.float()
    return out.to(out_dtype)


def _gemm_cpu(a, b, out_dtype, bias):
    """torch._scaled_mm's CPU kernel (per-tensor scales), step by step as that kernel computes
    it: each operand converted to fp32 and multiplied by its inverse scale (mat2 = b^T made
    contiguous first), one fp32 matmul, the bias (in the output dtype, as _gemm_torch passes
    it) added in fp32, one cast. The same numbers, bit for bit, with the fast conversion."""
    a32 = fp8_to_float(a.data, a.inv_scale)
    b32 = fp8_to_float(b.data.t().contiguous(), b.inv_scale)  # (K, N), row-major
    out = a32 @ b32
    out = out if bias is None else out.add_(bias.to(out_dtype))
    return out.to(out_dtype)


_HAS_SCALED_MM_V2 = hasattr(F, "scaled_mm")  # torch.nn.functional.scaled_mm: torch >= 2.10


def padded_block_scales():
    """Do block-scaled GEMMs go through torch.nn.functional.scaled_mm, with padded 128x128 scales?
    Where torch has it, and not under torch.compile: there torch 2.11's shape checks of the v2 op
    want K and N multiples of 128 (ragged shapes fail the trace), and torch 2.13's inductor turns
    the v2 op into a v1 torch._scaled_mm call with the padded scales, which the kernel refuses
    unless ceil(K/128) % 4 == 0. Compiled code calls v1 itself, where it is right (the rules)."""
    return _HAS_SCALED_MM_V2 and not torch.compiler.is_compiling()


def _block_scale_arg(q, operand, padded=False):
    """q's inverse block scales laid out as torch's scaled GEMM wants them for `operand` "a"
    (mat1) or "b" (mat2 = q^T). q.inv_scale is the (row tiles, K tiles) grid, contiguous.
    padded: for torch.nn.functional.scaled_mm (v2), else for torch._scaled_mm (v1)."""
    s = q.inv_scale
    if q.block[0] == 1:  # 1x128: (rows, Kt) with strides (1, rows); v1's b: its transpose (Kt, N)
        return s.t().contiguous() if operand == "b" and not padded else s.t().contiguous().t()
    if padded:  # 128x128, v2: the grid with each row padded to L4 scales, as (L4, row tiles)
        return F.pad(s, (0, -s.shape[1] % 4)).t()
    return s if operand == "a" else s.t()  # 128x128, v1: a (Mt, Kt) contiguous; b (Kt, Nt) strides (1, Kt)


def _gemm_torch(a, b, out_dtype, bias, fast_accum):
    """One torch._scaled_mm (or, for block scales, torch.nn.functional.scaled_mm) call; the
    operands already passed _scaled_mm_refusal."""
    # cuBLASLt wants 16-byte aligned rows; a view into a packed buffer (SP's gathered FP8 rows
    # carry their scale behind them) is not, so it is copied (free when already contiguous).
    mat1, mat2 = a.data.contiguous(), b.data.contiguous().t()
    if a.granularity == "block":  # (no fast accumulation: block modes refuse it, and promote to
        # fp32 every 128 of K anyway.) PyTorch never tests block scales with a bias: the GEMM
        # writes fp32 and the bias is added to that, as the reference adds it.
        gemm_dtype = out_dtype if bias is None else torch.float32
        if padded_block_scales():
            kinds = [F.ScalingType.BlockWise1x128 if q.block[0] == 1 else F.ScalingType.BlockWise128x128
                     for q in (a, b)]
            out = F.scaled_mm(mat1, mat2, _block_scale_arg(a, "a", True), kinds[0],
                              _block_scale_arg(b, "b", True), kinds[1], output_dtype=gemm_dtype)
        else:
            out = torch._scaled_mm(mat1, mat2, scale_a=_block_scale_arg(a, "a"),
                                   scale_b=_block_scale_arg(b, "b"), out_dtype=gemm_dtype)
        return out if bias is None else (out + bias.float()).to(out_dtype)
    sa, sb = a.inv_scale, b.inv_scale
    if a.granularity == "row" or b.granularity == "row":
        # a tensor scale next to a row scale is repeated per row: row x row is a mode, mixed is not
        # (a fresh column, not expand().contiguous(): with one row that keeps a stride of 0,
        # which _scaled_mm refuses)
        per_row = lambda q, s: s if q.granularity == "row" else s.reshape(1, 1) * torch.ones(  # noqa: E731
            len(q.data), 1, device=s.device)
        sa, sb = per_row(a, sa), per_row(b, sb).t()  # (M, 1), (1, N)
    in_gemm = bias is not None and out_dtype != torch.float32  # CUDA: no bias with fp32 output
    out = torch._scaled_mm(mat1, mat2, scale_a=sa, scale_b=sb, bias=bias.to(out_dtype) if in_gemm else None,
                           out_dtype=out_dtype, use_fast_accum=fast_accum)
    if bias is not None and not in_gemm:
        out = out + bias.float()  # the fp32 output takes the bias outside the GEMM, in fp32
    return out


def _gemm_block_loop(a, b, out_dtype, bias):
    """Block scales without native support: one row-wise _scaled_mm per 128-wide slice of K,
    fp32 outputs summed in fp32 (the "promote every 128 of K" of DeepSeek-V3, done by hand)."""
    ad, bd, k = a.data, b.data.contiguous(), a.data.shape[1]  # (b: see _gemm_torch)
    # every row's scale for each 128-wide slice of K: (M, K tiles) and (N, K tiles)
    ia = expand_tiles(a.inv_scale, (a.block[0], 1), (len(a.data), a.inv_scale.shape[1]))
    ib = expand_tiles(b.inv_scale, (b.block[0], 1), (len(b.data), b.inv_scale.shape[1]))
    out = None
    for j, k0 in enumerate(range(0, k, BLOCK)):
        ks = slice(k0, min(k0 + BLOCK, k))
        part = torch._scaled_mm(ad[:, ks], bd[:, ks].t(), scale_a=ia[:, j : j + 1].contiguous(),
                                scale_b=ib[:, j : j + 1].t().contiguous(), out_dtype=torch.float32)
        out = part if out is None else out + part
    out = out if bias is None else out + bias.float()
    return out.to(out_dtype)


def _kernels():
    """The Triton kernels of backend="triton": the top-level kernels.py, next to this package and
    not in it (it imports torch and triton only, and runs on its own: `python kernels.py`). It is
    importable where the repo root is on sys.path, as it is for the scripts of the repo."""
    try:
        import kernels
    except ModuleNotFoundError as e:
        if e.name != "kernels":  # triton itself: kernels.py raises its own message for that
            raise
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        raise ImportError(f"backend='triton' needs kernels.py from the repo root ({repo}), which is "
                          "not on sys.path: run from the repo root or add it to PYTHONPATH") from None
    return kernels


def _gemm_triton(a, b, out_dtype, bias, fast_accum):
    return _kernels().fp8_gemm(a.data, b.data, a.inv_scale, b.inv_scale, out_dtype, bias,
                               fast_accum=fast_accum)


_TRITON = []  # [whether kernels.py imports], asked once


def _triton_available(device):
    """May backend="torch" use kernels.py (its casts, or its GEMM as a fallback)? On CUDA, where
    kernels.py imports."""
    if device.type != "cuda":
        return False
    if not _TRITON:
        try:
            _kernels()
            _TRITON.append(True)
        except ImportError:
            _TRITON.append(False)
    return _TRITON[0]


def one_pass_cast(x):
    """Does an eager cast of x run on kernels.py's Triton quantizers? On a CUDA device where
    kernels.py imports, outside torch.compile (which fuses quantize()'s operations itself).
    quantize() in eager mode is about a dozen kernels per cast (amax, the scale's float64
    arithmetic, clamp, cast, the NaN guard), each a launch: with four to six casts per Linear
    and micro-step, the host could not keep an H100 busy. The Triton quantizers read the tensor
    once (a tensor scale: once more for the amax), give the same bytes (tests/test_kernels.py),
    and write the transposed copy that backward needs in the same pass."""
    return x.is_cuda and not torch.compiler.is_compiling() and _triton_available(x.device)


def triton_cast(recipe, x):
    """Does this cast run on kernels.py's Triton quantizers? backend="triton" asks for them, and
    eager CUDA casts take them (one_pass_cast). Under torch.compile a cast stays torch operations
    for inductor to fuse, whichever the backend: dynamo then traces no Triton launch (torch 2.11's
    cannot trace every one: kernels.fp8_gemm_op)."""
    return (recipe.backend == "triton" and not torch.compiler.is_compiling()) or one_pass_cast(x)


def _quantize_triton(x2, fmt, granularity, block, margin, power_of_two):
    """quantize() on kernels.py's Triton quantizers (bit-exact with it: tests/test_kernels.py),
    for backend="triton". A tensor-scaled cast also writes its transpose in the same pass
    (kernels.quantize_transpose), so the x^T, W^T and dy^T of the backward GEMMs cost no second
    read of the tensor (Fp8Tensor.t() returns that copy)."""
    kernels = _kernels()
    if granularity == "tensor":
        data, data_t, scale = kernels.quantize_transpose(x2, fmt.dtype, margin, power_of_two)
    else:
        data_t = None
        data, scale = kernels.quantize(x2, fmt.dtype, granularity, block, margin, power_of_two)
    block = tuple(block) if granularity == "block" else (1, x2.shape[1])
    return Fp8Tensor(data, scale, fmt, granularity, block, x2.shape, x2.dtype, data_t=data_t)


def _shape_refusal(a, b, sup):
    k, n = a.data.shape[1], b.data.shape[0]
    if sup.device == "cuda" and (k % 16 or n % 16):
        return f"dims K={k}, N={n} are not multiples of 16"
    if a.fmt is E5M2 and b.fmt is E5M2:
        return "e5m2 x e5m2 is not a supported pair"
    return None


def _scaled_mm_refusal(a, b, out_dtype, sup):
    """Why torch._scaled_mm on a device with support `sup` would refuse out = a @ b.T (None if
    it takes it), by the rules at the top of this section."""
    if not sup.fp8:
        return "this GPU has no FP8 tensor cores (compute capability 8.9 or newer needed)"
    reason = _shape_refusal(a, b, sup)
    if reason:
        return reason
    grans = {a.granularity, b.granularity}
    if "block" in grans:
        if not sup.block:
            return ("block scales need torch >= 2.11 on an SM90 GPU with cuBLASLt >= 12.9 "
                    f"(this device: {sup.device}, torch {torch.__version__}, CUDA {torch.version.cuda})")
        if a.fmt is not E4M3 or b.fmt is not E4M3:
            return "block scales with an E5M2 operand (torch's block GEMM takes E4M3 x E4M3 only)"
        if a.block[0] > 1 and b.block[0] > 1:
            return "128x128 x 128x128 block scales are not a supported pair"
        kt = -(-a.data.shape[1] // BLOCK)
        if max(a.block[0], b.block[0]) > 1 and kt % 4 and not padded_block_scales():
            return (f"128x128 block scales with ceil(K/128) = {kt}, not a multiple of 4, need "
                    "torch.nn.functional.scaled_mm (not used under torch.compile): torch._scaled_mm "
                    "would hand cuBLASLt an unpadded scale grid, which it misreads")
        return None
    if "row" in grans:
        if a.fmt is E5M2:
            return "row-wise scales with an E5M2 first operand (never run by PyTorch's tests)"
        if not sup.rowwise:
            return f"torch._scaled_mm on {sup.device} takes only per-tensor scales (torch 2.11)"
        if not sup.cublaslt_rowwise and out_dtype == torch.float32:
            return "row-wise scales with fp32 output need cuBLASLt >= 12.9 (older: bf16/fp16 only)"
        if not sup.cublaslt_rowwise and b.fmt is not E4M3:
            return "row-wise scales with an E5M2 second operand need cuBLASLt >= 12.9"
    return None


BACKENDS = ("torch", "emulate", "triton")


def scaled_gemm(a, b, out_dtype, bias=None, backend="torch", fast_accum=False, name="?"):
    """out (M, N) = dequantize(a) @ dequantize(b).T (+ bias), accumulated in fp32.
    a: Fp8Tensor (M, K), b: Fp8Tensor (N, K), both quantized along K.

    backend="torch": torch._scaled_mm where its rules allow the call (block scales natively on
    SM90 with cuBLASLt >= 12.9). Otherwise, reported once per layer with the reason: the Triton
    GEMM on CUDA when kernels.py imports, then for block scales one row-wise GEMM per 128 of K,
    then the fp32 reference."""
    if a.data.shape[1] != b.data.shape[1]:
        raise ValueError(f"contraction dims differ: a is {tuple(a.data.shape)}, b is {tuple(b.data.shape)}")
    if (a.granularity == "block") != (b.granularity == "block"):
        raise ValueError("block-scaled operands can only be multiplied with block-scaled operands")
    if not a.data.is_contiguous():  # a CPU's Fp8Tensor.t() is a view: every GEMM reads a row-major
        a = replace(a, data=a.data.contiguous())
    if backend == "emulate":
        return _gemm_emulate(a, b, out_dtype, bias)
    if backend == "triton":
        return _gemm_triton(a, b, out_dtype, bias, fast_accum)
    if backend != "torch":
        raise ValueError(f"unknown GEMM backend {backend!r}; expected one of {BACKENDS}")
    sup = scaled_mm_support(a.data.device)
    reason, refused = _scaled_mm_refusal(a, b, out_dtype, sup), False
    if sup.device == "cpu" and _emulating(a.data):  # (under the CUDA stand-in, sup says "cuda")
        # The CPU rule of section 3: torch's kernel arithmetic in _gemm_cpu, with fp8_to_float.
        return _gemm_cpu(a, b, out_dtype, bias) if reason is None else _gemm_emulate(a, b, out_dtype, bias)
    if reason is None:
        try:
            return _gemm_torch(a, b, out_dtype, bias, fast_accum)
        except (RuntimeError, ValueError) as e:  # a rule missing above: say so, loudly, once
            # (Under torch.compile this `try` is traced, not run: only the rules above, decided
            # while tracing, can fall back there; a refusal by the kernel fails the step.)
            reason, refused = "refused by torch._scaled_mm: " + str(e).splitlines()[0], True
    if _triton_available(a.data.device):
        alt, fn = "the Triton GEMM (kernels.py)", lambda: _gemm_triton(a, b, out_dtype, bias, fast_accum)
    elif (a.granularity == "block" and sup.cublaslt_rowwise and not _shape_refusal(a, b, sup)
          and a.fmt is E4M3):  # (its row-wise GEMMs: never an E5M2 first operand, see the rules)
        kt = -(-a.data.shape[1] // BLOCK)
        alt = (f"{kt} row-wise GEMMs (one per 128 of K) with fp32 outputs summed in fp32: "
               f"{kt}x the launches and {kt} x M x N x 8 bytes of extra traffic")
        fn = lambda: _gemm_block_loop(a, b, out_dtype, bias)
    else:
        alt, fn = HIGH_PRECISION, lambda: _gemm_emulate(a, b, out_dtype, bias)
    if sup.device == "cuda" or refused:  # a CPU's choices are all emulations: nothing is lost
        _fell_back(name, reason, alt)  # a high-precision one: counted, an error under fp8_strict
    return fn()


# -----------------------------------------------------------------------------
# 4. The recipe: every knob of FP8 training in one place


@dataclass
class Recipe:
    scaling: str = "current"  # "current" (amax of this tensor) | "delayed" (amax history)
    granularity: str = "tensor"  # "tensor" | "row" | "block" (1x128 acts/grads, 128x128 weights)
    formats: str = "hybrid"  # "hybrid" (E4M3 fwd, E5M2 grads) | "e4m3" (E4M3 everywhere)
    history_len: int = 16  # delayed scaling: steps of amax history (MS-AMP uses 16)
    amax_algo: str = "max"  # delayed scaling: "max" over the window | "most_recent"
    margin: int = 0  # scale /= 2^margin
    power_of_two: bool = False  # round scales down to powers of two
    backend: str = "torch"  # "torch" (_scaled_mm) | "emulate" (fp32 reference) | "triton"

    def __post_init__(self):
        choices = {"scaling": ("current", "delayed"), "granularity": GRANULARITIES,
                   "formats": tuple(FORMAT_CONVENTIONS), "amax_algo": ("max", "most_recent"),
                   "backend": BACKENDS}
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise ValueError(f"Recipe.{key}={getattr(self, key)!r}; expected one of {allowed}")
        if self.scaling == "delayed" and self.granularity != "tensor":
            # The rows and tiles of an activation are different tokens every step, so a history
            # of per-row amaxes describes nothing that comes again: delay only whole tensors.
            raise ValueError("delayed scaling needs granularity='tensor' (per-row/tile amax "
                             "histories of activations do not carry over between steps)")
        if self.history_len < 1 or self.margin < 0:
            raise ValueError("Recipe needs history_len >= 1 and margin >= 0")

    @property
    def fwd_fmt(self):
        return FORMAT_CONVENTIONS[self.formats][0]

    @property
    def bwd_fmt(self):
        return FORMAT_CONVENTIONS[self.formats][1]


# -----------------------------------------------------------------------------
# 5. The FP8 linear layer: one autograd.Function for the three GEMMs
#
# The Function is written once, for a layer on one device and for one rank's shard of a layer
# under tensor parallelism (nanofp8/parallel.py's TPLinear). A shard differs only in what it
# exchanges with the other shards, and only at four fixed points, which the Function leaves to
# four methods of the layer (the communication hooks):
#
#     forward:   x  --gemm_input-->  forward GEMM  --gemm_output-->  y
#     backward:  dy --dgrad_input--> dgrad GEMM    --dgrad_output--> dx     (wgrad: local)
#
# On one device the two input hooks only quantize, and the two output hooks return what they get.

INPUT, WEIGHT, GRAD_OUTPUT = 0, 1, 2  # tensor roles; each has its own scaling state
ACT_BLOCK = (1, BLOCK)  # block-scale tile of activations and gradients: one token, 128 channels


def _requantize_t(mod, x2, fmt, q, block):
    """The operand for a backward GEMM that contracts over x2's *first* dim: the transpose of
    the FP8 copy where scales allow it, else a fresh quantization of x2^T along that dim."""
    r = mod.recipe
    if r.granularity == "tensor" or (r.granularity == "block" and q.block[0] > 1):
        return q.t()
    if triton_cast(r, x2):
        return _quantize_triton(x2.t(), fmt, r.granularity, block, r.margin, r.power_of_two)
    return quantize(x2.t(), fmt, r.granularity, block, margin=r.margin, power_of_two=r.power_of_two)


def pack_saved(q):  # Fp8Tensor -> (tensors for save_for_backward, metadata for ctx)
    return (q.data, q.scale), (q.fmt, q.granularity, q.block, q.data.shape, q.dtype)


def unpack_saved(tensors, meta):
    return Fp8Tensor(tensors[0], tensors[1], meta[0], meta[1], meta[2], meta[3], meta[4])


class _Fp8LinearFunction(torch.autograd.Function):
    """y = x W^T (+ b), its three GEMMs in FP8. `mod` is the layer, kept for backward (ctx.mod):
    backward writes per-layer state that lives there (the grad-output's delayed-scaling history,
    the statistics), hands dW to its take_wgrad (O2: added to the FP8 gradient the weight holds,
    optim.fp8_grad), and calls its communication hooks."""

    @staticmethod
    def forward(ctx, x, weight, bias, mod, out_dtype):
        # Autocast is off inside, where every dtype is chosen here (out_dtype is autocast's where it
        # was on). Turned off here, not around .apply: dynamo fails a compiled region that changes
        # the global autocast state around a Function ("Global autocast state changed").
        with torch.autocast(x.device.type, enabled=False):
            r = mod.recipe
            # x2: x as (M, K) in high precision; None where it never exists whole on this rank
            qx, x2, lead = mod.gemm_input(x)
            qw, qw_t = mod.weight_operands()  # W for this GEMM, W^T for dgrad
            b = None if bias is None else bias.to(out_dtype)
            y = scaled_gemm(qx, qw, out_dtype, b, r.backend, fast_accum=True, name=mod.fqn)
            y = mod.gemm_output(y.reshape(*lead, y.shape[-1]))
            # Keep only the FP8 operands of the two backward GEMMs, laid out along their
            # contraction dims: x^T (K, M) for wgrad, W^T (K, N) for dgrad. Where only the FP8 copy
            # of x exists (gathered in FP8), row and block scales re-quantize x^T from it.
            if x2 is None and r.granularity != "tensor":
                x2 = dequantize(qx, torch.float32)
            qx_t = _requantize_t(mod, x2, r.fwd_fmt, qx, ACT_BLOCK)
            if mod.observer is not None:  # a statistics step (nanofp8/stats.py)
                mod.observer.observe_forward(mod, x2, qx, qx_t, qw, qw_t)
            (tx, mx), (tw, mw) = pack_saved(qx_t), pack_saved(qw_t)
            ctx.save_for_backward(*tx, *tw)
            ctx.meta, ctx.mod, ctx.lead = (mx, mw), mod, lead
            ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
            ctx.has_bias, ctx.b_dtype = bias is not None, None if bias is None else bias.dtype
            return y

    @staticmethod
    def backward(ctx, dy):
        mod, r = ctx.mod, ctx.mod.recipe
        saved = ctx.saved_tensors
        qx_t, qw_t = unpack_saved(saved[:2], ctx.meta[0]), unpack_saved(saved[2:], ctx.meta[1])
        dx = dw = db = qdy_t = None
        with torch.autocast(dy.device.type, enabled=False):
            qdy, dy2 = mod.dgrad_input(dy)  # dy2: as x2 in forward
            if ctx.needs_input_grad[0]:  # dgrad: dx (M, K) = dy (M, N) @ [W^T (K, N)]^T
                dx = scaled_gemm(qdy, qw_t, mod.dgrad_dtype or ctx.x_dtype, backend=r.backend,
                                 name=mod.fqn)
                dx = mod.dgrad_output(dx.reshape(*ctx.lead, dx.shape[-1]))
                dx = dx.to(ctx.x_dtype).reshape(ctx.x_shape)
            if ctx.needs_input_grad[1]:  # wgrad: dW (N, K) = dy^T (N, M) @ [x^T (K, M)]^T
                if dy2 is None and r.granularity != "tensor":
                    dy2 = dequantize(qdy, torch.float32)
                qdy_t = _requantize_t(mod, dy2, r.bwd_fmt, qdy, ACT_BLOCK)
                dw = scaled_gemm(qdy_t, qx_t, torch.float32, backend=r.backend, name=mod.fqn)
                dw = mod.take_wgrad(dw)  # O1: the autograd gradient; O2: kept in FP8 instead
            if mod.observer is not None:
                mod.observer.observe_backward(mod, dy2, qdy, qdy_t)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                db = dy.reshape(-1, dy.shape[-1]).float().sum(0).to(ctx.b_dtype)
        return dx, dw, db, None, None


def fp8_linear(x, layer, bias):
    """F.linear(x, layer.weight, bias) with the three GEMMs in FP8, by the layer's recipe,
    scaling state and hooks. The output dtype is autocast's where autocast is on, else x's."""
    dev = x.device.type
    out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    return _Fp8LinearFunction.apply(x, layer.weight, bias, layer, out_dtype)


def _count_clips_from_zero(module, state_dict, prefix, *args):
    """A state_dict saved before Fp8Linear counted clipped values has no `clipped`: start at 0."""
    if prefix + "amax_history" in state_dict and prefix + "clipped" not in state_dict:
        state_dict[prefix + "clipped"] = torch.zeros_like(module.clipped)


class Fp8Linear(nn.Linear):
    """nn.Linear whose three GEMMs run in FP8. Same parameters, same state_dict keys, plus
    the scaling state of its three tensor roles (input, weight, grad-output) as buffers:

        amax_history (3, H)  newest first, zeros where not yet filled
        history_count (3,)   how many entries are valid (0: the stored scale is used)
        scale        (3,)    the scale last used (what a NaN amax falls back to)
        nonfinite    (3,)    how many non-finite amaxes were seen and kept out of the history
        clipped      (3,)    how many values a delayed-scaling cast clipped at the FP8 max

    and, not saved, cast_values (3,): how many values delayed scaling cast, the denominator of
    `clipped` (train.py's log reports the fraction clipped on the step it happens). A state_dict
    saved before `clipped` existed loads with the count at 0.
    """

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None,
                 recipe=None, fqn=""):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.recipe = recipe or Recipe()
        self.fqn = fqn or "Fp8Linear"
        self._init_scaling_state(self.weight.device)
        self.register_load_state_dict_pre_hook(_count_clips_from_zero)

    # Two extension points, used by precision decoupling (level O2, nanofp8/optim.py), which
    # keeps the master weight in fp16 and the weight gradient in FP8:
    def hp_weight(self):
        """The high-precision weight the FP8 copies are cast from."""
        return self.weight

    def take_wgrad(self, dw):
        """Receives the fp32 weight gradient; returns what autograd accumulates into .grad."""
        return dw.to(self.weight.dtype)

    # Cast the weight to FP8 once per optimizer step and reuse the cast across micro-steps (eager
    # code), as long as the weight's version counter and storage stay the same? Off by default:
    # torch's fused AdamW writes the weights without bumping their version counters (measured
    # here), so a training loop turns it on only where it bumps them after such a step
    # (torch.autograd.graph.increment_version: train.py's optimizer_step at O1). Foreach and
    # single-tensor torch.optim steps, load_state_dict and copy_ bump it themselves. (O2/O3 keep
    # their own cast, which their optimizer refreshes.)
    cache_weight = False

    # Statistics of the casts (nanofp8/stats.py): set for the steps it observes, else None.
    observer = None

    def weight_operands(self):
        """FP8 W (N, K) and W^T (K, N) for the forward and dgrad GEMMs."""
        use_cache = self.cache_weight and not torch.compiler.is_compiling()
        if use_cache:
            key = (self.weight._version, self.weight.data_ptr(), self.training)
            if self._w_cache is not None and self._w_cache[0] == key:
                return self._w_cache[1]
        ops = self.cast_weight()
        self._w_cache = (key, ops) if use_cache else None
        return ops

    def cast_weight(self):
        """The FP8 cast itself (O3, which stores the weight in FP8, overrides this, not the caching)."""
        w, r = self.hp_weight().detach(), self.recipe
        qw = self.quantize_operand(WEIGHT, w, r.fwd_fmt)
        return qw, _requantize_t(self, w, r.fwd_fmt, qw, (BLOCK, BLOCK))

    def quantize_operand(self, role, x2, fmt):
        """Quantize a GEMM operand (M, K) along K with the layer's recipe: current scaling measures
        it, delayed scaling takes the scale from the role's history. Tiles of block scales:
        128x128 for the weight, 1x128 for activations and gradients."""
        r = self.recipe
        if r.scaling == "delayed":
            return self.delayed_quantize(role, x2, fmt)
        block = (BLOCK, BLOCK) if role == WEIGHT else ACT_BLOCK
        if triton_cast(r, x2):
            return _quantize_triton(x2, fmt, r.granularity, block, r.margin, r.power_of_two)
        return quantize(x2, fmt, r.granularity, block, margin=r.margin, power_of_two=r.power_of_two)

    # The four communication hooks of _Fp8LinearFunction (section 5). A layer on one device has
    # nothing to exchange: the input hooks quantize, the output hooks hand their tensor back.

    def gemm_input(self, x):
        """Before the forward GEMM: x (..., K) -> (FP8 operand (M, K), the high-precision (M, K)
        it was cast from or None, the leading dims of y)."""
        x2 = x.reshape(-1, x.shape[-1])
        return self.quantize_operand(INPUT, x2, self.recipe.fwd_fmt), x2, x.shape[:-1]

    def gemm_output(self, y):
        """After the forward GEMM: y (*lead, N), in the output dtype."""
        return y

    def dgrad_input(self, dy):
        """Before the dgrad GEMM: dy (..., N) -> (FP8 operand (M, N), its high-precision source
        or None)."""
        dy2 = dy.reshape(-1, dy.shape[-1])
        return self.quantize_operand(GRAD_OUTPUT, dy2, self.recipe.bwd_fmt), dy2

    def dgrad_output(self, dx):
        """After the dgrad GEMM: dx (*lead, K), in dgrad_dtype."""
        return dx

    dgrad_dtype = None  # what the dgrad GEMM writes; None: the input's dtype

    def free_weight_cache(self):
        self._w_cache = None

    def _init_scaling_state(self, device):
        self._w_cache = None
        h = self.recipe.history_len
        self.register_buffer("amax_history", torch.zeros(3, h, device=device))
        self.register_buffer("history_count", torch.zeros(3, dtype=torch.long, device=device))
        self.register_buffer("scale", torch.ones(3, device=device))
        self.register_buffer("nonfinite", torch.zeros(3, dtype=torch.long, device=device))
        self.register_buffer("clipped", torch.zeros(3, dtype=torch.long, device=device))
        self.register_buffer("cast_values", torch.zeros(3, dtype=torch.long, device=device), persistent=False)

    @classmethod
    def from_linear(cls, lin, recipe, fqn=""):
        """Wrap an existing nn.Linear, sharing (not copying) its parameters."""
        new = cls(lin.in_features, lin.out_features, lin.bias is not None, device="meta",
                  recipe=recipe, fqn=fqn)
        new.weight, new.bias = lin.weight, lin.bias
        new._init_scaling_state(lin.weight.device)
        new.train(lin.training)
        return new

    @torch.no_grad()
    def delayed_quantize(self, role, x2, fmt):
        """Delayed scaling: the scale comes from the amax history of earlier steps only, so it is
        known before the cast, and the amax of this step is measured by the same read of the
        tensor that casts it (one fused read-cast-reduce kernel can do it all) and recorded
        afterwards, with the count of values the cast clipped. Before any finite amax is in the
        history (the first cast of the role), the scale is made from this tensor's own amax
        (where that is not finite: the stored scale); its amax then starts the history."""
        r, hist, n = self.recipe, self.amax_history[role], self.history_count[role]
        amax = _amax(x2.detach(), "tensor", None)
        past = hist.max() if r.amax_algo == "max" else hist[0]
        prev = self.scale[role]
        own = compute_scale(amax, fmt, r.margin, r.power_of_two, fallback=prev)  # no history yet
        scale = torch.where(n > 0, compute_scale(past, fmt, r.margin, r.power_of_two, fallback=prev), own)
        q = quantize(x2, fmt, "tensor", scale=scale, amax=amax)
        if self.training:  # evaluation reads the state but never writes it
            finite = torch.isfinite(amax)
            hist.copy_(torch.where(finite, torch.cat([amax.reshape(1).float(), hist[:-1]]), hist))
            n.copy_(torch.where(finite, (n + 1).clamp(max=hist.numel()), n))
            self.nonfinite[role] += (~finite).long()
            self.scale[role] = scale
            # values beyond the rounding boundary above the max (a non-finite tensor is counted
            # as such, above, and its step skipped)
            over = torch.count_nonzero((x2.detach().float() * scale).abs_() > clip_edge(fmt))
            self.clipped[role] += torch.where(finite, over, 0)
            self.cast_values[role] += x2.numel()
        return q

    def forward(self, x):
        return fp8_linear(x, self, self.bias)

    def extra_repr(self):
        r = self.recipe
        return (f"{super().extra_repr()}, fp8={r.scaling}/{r.granularity}/{r.formats}, "
                f"backend={r.backend}")


def convert_to_fp8(model, recipe=None, module_filter=None):
    """Swap every nn.Linear in `model` (in place) for an Fp8Linear sharing its parameters.
    module_filter(fqn, linear) -> bool chooses which ones; returns the model."""
    recipe = recipe or Recipe()
    if type(model) is nn.Linear:  # a bare Linear cannot be swapped inside itself
        return Fp8Linear.from_linear(model, recipe, "linear")
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            fqn = f"{parent_name}.{name}" if parent_name else name
            if type(child) is nn.Linear and (module_filter is None or module_filter(fqn, child)):
                setattr(parent, name, Fp8Linear.from_linear(child, recipe, fqn))
    return model


def recipe_fields():
    """Names of the Recipe knobs (for config validation in train.py)."""
    return [f.name for f in fields(Recipe)]
