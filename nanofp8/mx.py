"""MXFP8: the OCP Microscaling format, the FP8 recipe of Blackwell's tensor cores, beside fp8.py.

fp8.py's block scaling gives each tile an fp32 scale, fp8_max / amax. MX changes two things:

  * tiles of 32 values along each GEMM's contraction dim, for weights, activations and gradients
    alike (so W and W^T are quantized separately, as row scales are), and
  * a scale that is a bare power of two stored in one byte: E8M0 (torch.float8_e8m0fnu), an
    8-bit exponent with no sign and no mantissa, 2^(bits - 127), 0xFF is NaN. 1 byte per 32
    values instead of 4 per 128, and the tensor core applies it exactly.

The rule (OCP MX v1.0, section 6.3) is not fp8_max / amax. The 32 values share the exponent

    k = floor(log2(amax)) - emax,    emax = the exponent of the format's largest binade
                                            (8 for E4M3: 448 = 1.75 * 2^8; 15 for E5M2)

clamped to E8M0's [-127, 127], and are cast as x / 2^k. The block's amax then lands in
[256, 512) (E4M3), and what lies above 448 *saturates*: the rule clips, by design, the values of
blocks whose max has a mantissa above 1.75, each by at most 1/8. That is 0.5-0.9% of a
Gaussian's values, more for flat blocks (~9% of a uniform's); nanofp8/stats.py counts it apart
(saturation_rule), and its alarms ignore it. An all-zero block gets k = -127 and stays zero.

The scale kept in an Fp8Tensor follows the project's convention (fp8.py, section 2): the
multiply-before-cast factor 2^-k, in E8M0. A GEMM takes the decode factor 2^k (mx_scales):
torch._scaled_mm on SM100 (nanofp8/device.py), kernels.gemm_mx (tl.dot_scaled). Everything else
in fp8.py (quantize, dequantize, the reference GEMM, the Linear) takes MX operands as they are:
the recipe "mxfp8" is fp8.RECIPES' block recipe with 1x32 tiles and this scale rule.
"""

import math

import torch

MX_BLOCK = 32  # values per scale: 1x32 tiles along K, every operand
E8M0 = torch.float8_e8m0fnu  # 2^(bits - 127); 0xFF is NaN; no zero, no sign


def mx_scale(amax, fmt, margin=0, power_of_two=True, fallback=None):
    """The OCP rule as a Recipe's scale_rule: scale = 2^-k with k = floor(log2(amax)) - emax(fmt)
    (+ margin), k clamped to E8M0's [-127, 127], as E8M0 bytes. An all-zero block (log2(0) = -inf)
    gets k = -127. A NaN or inf amax gets k = 0 (its data is NaN anyway: quantize keeps
    non-finite values visible), never a NaN scale.
    The exponent is floor(log2) in float64, exact for every fp32 amax, subnormals included
    (torch.frexp would be the obvious tool, but under torch.compile its CPU code does not build).
    power_of_two is implied; `fallback` (delayed scaling's) does not apply to a current-only rule."""
    amax64 = amax.detach().double()
    emax = math.floor(math.log2(fmt.max))
    k = (torch.floor(torch.log2(amax64)) - emax + margin).clamp(-127, 127)
    k = torch.where(torch.isfinite(amax64), k, 0.0)
    # 2^-k is exact in float64 and E8M0 holds it exactly (no bit view of an integer: under
    # torch.compile a view made inside a Function's graph may not be saved for its backward)
    return torch.exp2(-k).to(E8M0)


def mx_scales(q):
    """q's MX scales as an MX GEMM takes them: the decode factors 2^k (1 / q.scale), as E8M0
    bytes. Exact: the reciprocal of a power of two is one, and E8M0 holds it (NaN stays NaN)."""
    return q.scale.float().reciprocal().to(E8M0)


def is_mx(q):
    """Is the Fp8Tensor q an MX operand: block tiles with E8M0 scales?"""
    return q.granularity == "block" and q.scale.dtype == E8M0
