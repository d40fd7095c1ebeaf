"""FP8 on a CPU, fast: the lesson's plain code (fp8.py) computed with fewer passes, bit for bit.

A CPU has no FP8 units, so every FP8 GEMM there is an emulation: decode the bytes to fp32, scale,
multiply in fp32. fp8.py writes that in plain torch (quantize, dequantize, gemm_reference); this
file is its twin for plain CPU tensors, chosen by backend "cpu" (train.py's default on a CPU) and
by backend "torch" on a CPU. tests/test_emulation.py holds every function here bit-equal to the
plain code it replaces, on adversarial inputs.

  * torch's float8 -> fp32 conversion is a scalar loop on a CPU (about 4x a whole cast for E4M3):
    fp8_to_float gives the same bits from a few vectorized integer and fp16 operations.
  * the cast's isfinite/where (which keeps inf visible as NaN) costs several times the rest of
    the cast; where every amax is finite no input is inf or NaN, and the cast can skip it.
  * torch's CPU inf-norm is a scalar loop too: amax_each takes one aminmax per tensor instead.
  * block scales are applied by reshaping whole tiles, not by expanding one scale per element.

The bit tricks (shifts of the FP8 bytes seen as integers) are only for plain tensors on a CPU in
eager mode: never under torch.compile, which fuses torch's own conversion, and never on a tensor
subclass (DTensor, FakeTensor, FSDP2's parameters), where `t << 8` may not even shift (torch
2.13, DTensor). `handles` says which; everything else takes fp8.py's plain path.
"""

import torch
import torch.nn as nn

from nanofp8 import fp8
from nanofp8.fp8 import E4M3, E5M2, K_STEP, Fp8Tensor, compute_scale, expand_tiles, measure_amax

_FP8 = (E4M3.dtype, E5M2.dtype)


# Off: a CPU takes the paths a GPU takes (nanofp8/schedule.py counts a GPU's launches that way).
ENABLED = True


def handles(t):
    """Does the CPU emulation handle t: a plain tensor on a CPU, outside torch.compile?"""
    return (ENABLED and t.device.type == "cpu" and type(t) in (torch.Tensor, nn.Parameter)
            and not torch.compiler.is_compiling())


def fp8_to_float(data, times=None):
    """The fp32 values of FP8 `data` (float8_e4m3fn or float8_e5m2), multiplied by `times` (a
    broadcastable fp32 tensor) if given: bit for bit data.float() * times (a NaN code gives a NaN),
    without torch's scalar conversion loop. Other dtypes and tensors: data.float() * times."""
    if not handles(data) or data.dtype not in _FP8:
        return data.float() if times is None else data.float() * times
    if data.dim() == 2 and not data.is_contiguous() and data.t().is_contiguous():
        # a transposed view (Fp8Tensor.t()): decode it in memory order, where the reduction
        # below runs several times faster, and hand back the same view of the result
        t_times = times.t() if times is not None and times.dim() == 2 else times
        return fp8_to_float(data.t(), t_times).t()
    c = data.view(torch.int8).to(torch.int16)  # sign-extended: bits 15..7 all hold the sign bit
    if data.dtype == torch.float8_e5m2:  # E5M2 is the top byte of an fp16: same exponent field
        out = torch.bitwise_left_shift(c, 8).view(torch.float16).float()
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
        h = torch.bitwise_left_shift(c, 7) & ~0x4000
        h |= torch.bitwise_left_shift((c & 0x7F) + 1, 7) & 0x4000
        out = h.view(torch.float16).float()
    if times is None:
        return out.mul_(2.0**8)
    # (value / 2^8) * (2^8 * times) rounds the same exact product once, as value * times does,
    # wherever 2^8 * times does not overflow
    k = times * 2.0**8
    if not bool(torch.isfinite(k).all()):
        out, k = out.mul_(2.0**8), times
    return out.mul_(k)


def _times_tiles(v, s, block):
    """v (rows, cols) times its tile scales s (R, C) with tiles `block`: each whole tile multiplied
    by its one scale through a (R, br, C, bc) view, not by a gathered scale per element (that
    gather, and the passes it feeds, cost more than the multiply). Where a dim is not a multiple
    of its tile (a ragged edge), the per-element scales (expand_tiles). The same products either
    way: one rounding of value * scale."""
    (rows, cols), (br, bc) = v.shape, block
    if rows % br or cols % bc:
        return v * expand_tiles(s, block, v.shape)
    tiles = v.unflatten(1, (cols // bc, bc)).unflatten(0, (rows // br, br))
    return (tiles * s[:, None, :, None]).reshape(rows, cols)


def quantize(x2, fmt, granularity, block, margin=0, power_of_two=False, scale_rule=compute_scale):
    """fp8.quantize(x2, fmt, granularity, block, margin=, power_of_two=, scale_rule=) of a 2-D
    x2, current scaling: where every amax is finite, no input is NaN or inf (either would make its group's
    amax NaN or inf), so the cast skips the isfinite/where that would keep every value."""
    block = tuple(block) if granularity == "block" else (1, x2.shape[1])
    x2 = x2.detach()
    am = measure_amax(x2, granularity, block)
    if not bool(torch.isfinite(am).all()):
        return fp8.quantize(x2, fmt, granularity, block, margin=margin, power_of_two=power_of_two, amax=am,
                            scale_rule=scale_rule)
    scale = scale_rule(am, fmt, margin, power_of_two)
    s32 = scale.float()  # (an E8M0 scale, MX's, is kept in its byte in the container)
    y = _times_tiles(x2.float(), s32, block) if granularity == "block" else x2.float() * s32
    data = y.clamp_(-fmt.max, fmt.max).to(fmt.dtype).contiguous()
    return Fp8Tensor(data, scale, fmt, granularity, block, x2.shape, x2.dtype, am)


def _scaled(q):
    """dequantize(q, fp32) as 2-D (rows, cols), q.data's layout kept (a transposed view stays one)."""
    if q.granularity != "block":
        return fp8_to_float(q.data, q.inv_scale)
    return _times_tiles(fp8_to_float(q.data), q.inv_scale, q.block)


def gemm_reference(a, b, out_dtype, bias):
    """fp8.gemm_reference, bit for bit, with the fast decoding."""
    a32, b32 = _scaled(a), _scaled(b)
    if a.granularity == "block":  # sum() of the K_STEP slices' products, added in place: sum()
        out = None                # starts from 0, so the first partial sum is p0 + 0 (-0 -> +0)
        for k0 in range(0, a32.shape[1], K_STEP):
            part = a32[:, k0 : k0 + K_STEP] @ b32[:, k0 : k0 + K_STEP].t()
            out = part.add_(0) if out is None else out.add_(part)
    else:
        out = a32 @ b32.t()
    out = out if bias is None else out + bias.float()
    return out.to(out_dtype)


def gemm_kernel(a, b, out_dtype, bias):
    """torch._scaled_mm's CPU kernel (per-tensor scales), step by step as that kernel computes
    it: each operand converted to fp32 and multiplied by its inverse scale (mat2 = b^T made
    contiguous first), one fp32 matmul, the bias (in the output dtype, as gemm_scaled_mm passes
    it) added in fp32, one cast. The same numbers, bit for bit, with the fast conversion."""
    a32 = fp8_to_float(a.data, a.inv_scale)
    b32 = fp8_to_float(b.data.t().contiguous(), b.inv_scale)  # (K, N), row-major
    out = a32 @ b32
    out = out if bias is None else out.add_(bias.to(out_dtype))
    return out.to(out_dtype)


def amax_each(xs):
    """[max |x| for x in xs] as 0-dim tensors of each x's dtype, NaN where x holds a NaN: one
    foreach reduction (torch's inf-norm), or on a CPU one aminmax per tensor, as torch's CPU
    inf-norm is a scalar loop (about 30x slower: the non-finite checks of an O2 step spent
    milliseconds in it)."""
    if not xs:
        return []
    if not handles(xs[0]):
        return list(torch._foreach_norm(xs, float("inf")))
    return [measure_amax(x, "tensor", None) if x.numel() else x.new_zeros(()) for x in xs]

