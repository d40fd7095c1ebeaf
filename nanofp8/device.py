"""What each device runs: torch._scaled_mm's CUDA contract, the Triton glue, and the choice of a
GEMM and a cast for a Recipe's backend. The engine beside fp8.py (the lesson), which reaches it
through two seams only: `gemm` (scaled_gemm for backend "torch", "triton" or "cpu") and `cast`
(Fp8Linear.quantize_operand for the same backends). Backend "emulate", the fp32 reference, never
comes here.

Every cast chosen here writes the FP8 bytes and scales quantize writes (the Triton quantizers:
tests/test_kernels.py; the CPU emulation, nanofp8/emulate.py: tests/test_emulation.py), and every
GEMM multiplies them as gemm_reference does, up to the fp32 summation order of a GPU kernel (on a
CPU: bit for bit). A GEMM torch._scaled_mm cannot run goes to a named alternative.
"""

import os
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanofp8 import emulate
from nanofp8.fp8 import (E4M3, E5M2, K_STEP, Fp8Tensor, compute_scale, expand_tiles, gemm_reference, gemm_scaled_mm,
                         quantize)
from nanofp8.mx import MX_BLOCK, is_mx, mx_scales

# -----------------------------------------------------------------------------
# 1. torch._scaled_mm's rules, and what runs where they refuse
#
# torch._scaled_mm is strict on CUDA and lenient on CPU, and CI has no GPU. So the rules of the
# CUDA kernel (aten/src/ATen/native/cuda/ScaledBlas.cpp, torch >= 2.11) are written down here and
# every call is checked against them before it is made: a GEMM the kernel would refuse is never
# attempted, it goes to a named alternative, and the reason is reported once per layer. The
# tests replace torch._scaled_mm and `scaled_mm_support` (here) with a strict stand-in of the CUDA
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
#   * MX scales (1x32 tiles along K, E8M0 decode factors 2^k: mx.is_mx), read from PyTorch's
#     sources (aten/src/ATen/native/cuda/ScaledBlas.cpp, ScaledBlasUtils.cpp and
#     ScaledBlasDeviceUtils.cpp, aten/src/ATen/cuda/CUDABlas.cpp, as of torch 2.11 / 2.13; the
#     2.11.0+cu130 wheel's libtorch_cuda.so carries the same checks, messages included):
#     - torch._scaled_mm (v1) takes them as its last scale pair, 1x32 x 1x32 (never mixed with
#       another mode: get_joint_scaling's list has no such pair): both scales float8_e8m0fnu,
#       contiguous, with exactly round_up(rows, 128) * round_up(ceil(K/32), 4) elements each
#       (rows: M for scale_a, N for scale_b, which is NOT transposed like the fp32 modes':
#       is_blockwise_1x32_scaling). That count is the "blocked" layout cuBLASLt's VEC32_UE8M0 mode
#       reads: the (rows, ceil(K/32)) grid padded to 128-row x 4-column tiles, tile by tile
#       (row tiles outer), each 128x4 tile stored as 32 groups of 16 bytes where row r, column c
#       sits at (r % 32) * 16 + (r // 32) * 4 + c (cuBLAS docs, "1D block scaling factors
#       layout"; torch/testing/_internal/common_quantized.py's to_blocked, line 515 in 2.11 and
#       2.13, is what PyTorch's tests pass). v1 has no swizzle argument: the layout is implied.
#     - torch.nn.functional.scaled_mm (v2, torch >= 2.10; functional.py line 6744 in 2.11, 7166
#       in 2.13) takes them as ScalingType.BlockWise1x32 with swizzle SwizzleType.SWIZZLE_32_4_4
#       for both (_scaled_mxfp8_mxfp8: "scale_a must be swizzled to SWIZZLE_32_4_4 format", the
#       same element counts, contiguous; ValueError), and its recipe table (check_mxfp8_recipe)
#       takes float8_e4m3fn x float8_e4m3fn only; it passes use_fast_accum=False whatever it is
#       told. The meta function (torch/_meta_registrations.py, _check_scaled_mm_sizes_v2's MX
#       branch: line 7019 in 2.11, 7450 in 2.13) checks the same counts and swizzle for compile.
#     - shapes: the common rules (K and both dims of mat2 multiples of 16; M free). K need not be
#       a multiple of 32: PyTorch's MX tests run K = 240. Bias: the common rules.
#     - devices: torch itself has no MX gate (scaled_mm_arch_allowed admits 8.9 and 9.0+), and
#       cuBLASLt's scale mode needs a CUDA >= 12.8 build (CUDABlas.cpp cublasLtMatmulScaleMode,
#       "only supported for CUDA 12.8 and above"). The kernels exist from compute capability
#       10.0 (B200/GB200; PyTorch's tests run MX GEMMs on SM100OrLater only:
#       common_cuda.py evaluate_platform_supports_mx_gemm, line 203 in 2.11). On SM90 (H100,
#       H200) every torch check passes and cuBLASLt then finds no kernel: a RuntimeError
#       ("CUBLAS_STATUS_NOT_SUPPORTED", from scaled_gemm's heuristic query), never a result
#       (read from the sources, and seen on an H200 with torch 2.11 + CUDA 13.0 for v1 and v2:
#       results/gpu/r29/checks.jsonl; nanofp8 never makes that call).
#     - what PyTorch's tests run, and all nanofp8 sends: E4M3 x E4M3 with bf16 output and no
#       bias. An fp32 output, a bias or an E5M2 operand goes to the alternative below.
#     Where MX cannot run natively (an H100, an H200, a CPU, the cases above), an MX GEMM runs on
#     kernels.py's Triton MX GEMM (kernels.gemm_mx, tl.dot_scaled) where kernels.py imports and
#     has it, else on the fp32 reference (a fallback, reported and counted as any other). Never
#     on the 1x128 / 128x128 paths: they step through K 128 columns at a time with one scale
#     column per step, and would read a 1x32 grid's columns as 128-wide ones (tile_refusal).
#   * CPU: torch 2.11's kernel takes one-element (tensor) scales only; 2.13 also takes rows. We use
#     only what both take, and run the fp32 reference for the others (a CPU has no FP8 units, so
#     nothing is lost). Its dequantize-and-multiply matches the reference; on CPUs with AMX, torch
#     sends FP8 GEMMs to oneDNN instead, which applies the scales in another order. So on a CPU
#     the kernel is not called at all: emulate.gemm_kernel does its arithmetic, with a faster FP8
#     decoding, whether or not the CPU has AMX.

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
_CUDA_12_8 = _version(torch.version.cuda) >= (12, 8)  # cuBLASLt's MX scale mode (VEC32_UE8M0)
_TORCH_2_11 = _version(torch.__version__) >= (2, 11)


@dataclass(frozen=True)
class ScaledMMSupport:
    """What torch._scaled_mm takes on one kind of device (the rules above)."""
    device: str  # "cuda": the CUDA rules apply (dims multiples of 16, bias rules); "cpu": lenient
    fp8: bool  # any FP8 GEMM at all (CUDA: compute capability 8.9 or newer)
    rowwise: bool  # per-row scales
    cublaslt_rowwise: bool  # row x row runs on cuBLASLt (>= 12.9): any output dtype, any mat2 format
    block: bool  # 1x128 / 128x128 block scales natively
    mx: bool = False  # MX scales (1x32 tiles, E8M0) natively: SM100 and newer


@torch.compiler.assume_constant_result  # under torch.compile: asked once, a constant after
def _capability(index):
    return torch.cuda.get_device_capability(index)


# What gemm takes torch._scaled_mm on a CPU to run: per-tensor scales only (torch 2.11's CPU kernel;
# row-scaled operands go to the emulation: dequantized to fp32, then multiplied). schedule.py, which
# counts the kernels a GPU would run from a CPU graph, lets row scales through while it counts
# (where this torch's CPU kernel takes them, as 2.13's does): the graph then holds a GPU's GEMM
# call, not the emulation's fp32 copies of both operands.
CPU_SCALED_MM = ScaledMMSupport("cpu", fp8=True, rowwise=False, cublaslt_rowwise=False, block=False)


def scaled_mm_support(device):
    """Feature detection for torch._scaled_mm on `device` (a torch.device)."""
    if device.type != "cuda":
        return CPU_SCALED_MM
    major, minor = _capability(device.index)
    has_fp8 = (major, minor) >= (8, 9)
    return ScaledMMSupport("cuda", fp8=has_fp8, rowwise=has_fp8,
                           cublaslt_rowwise=_CUBLASLT_12_9 and major >= 9,
                           block=major == 9 and _CUBLASLT_12_9 and _TORCH_2_11,
                           mx=major >= 10 and _CUDA_12_8 and _TORCH_2_11)


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




def gemm_block_native(a, b, out_dtype, bias):
    """Block scales on torch's own block GEMM: torch.nn.functional.scaled_mm with padded 128x128
    scales where it exists (outside torch.compile), else torch._scaled_mm (the rules say when).
    No fast accumulation: block modes refuse it, and promote to fp32 every 128 of K anyway.
    PyTorch never tests block scales with a bias: the GEMM writes fp32 and the bias is added to
    that, as the reference adds it."""
    mat1, mat2 = a.data.contiguous(), b.data.contiguous().t()  # (see gemm_scaled_mm)
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

def blocked_scales(s):
    """A (rows, K/32) grid of MX scales in cuBLASLt's "blocked" layout, as a flat tensor:
    padded to 128-row x 4-column tiles (the padding: E8M0 byte 0, 2^-127, read for no value),
    tiles stored one after another along each row of tiles, and in a tile, row r and column c
    at byte (r % 32) * 16 + (r // 32) * 4 + c (the rules above; tested index by index)."""
    rows, cols = s.shape
    rt, ct = -(-rows // 128), -(-cols // 4)
    grid = torch.zeros(rt * 128, ct * 4, dtype=torch.uint8, device=s.device)  # (no F.pad for E8M0)
    grid[:rows, :cols] = s.view(torch.uint8)
    # row = 128 * tile row + 32 * i + j: order the bytes (tile row, tile col, j, i, c)
    tiles = grid.view(rt, 4, 32, ct, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(-1).view(s.dtype)


def gemm_mx_native(a, b, out_dtype):
    """MX operands on torch's MX GEMM (SM100): the decode scales 2^k in the blocked layout, on
    torch.nn.functional.scaled_mm outside torch.compile, else on torch._scaled_mm (the same
    tensors: v1 implies the layout v2 is told). bf16 output, no bias (the rules)."""
    mat1, mat2 = a.data.contiguous(), b.data.contiguous().t()  # (see gemm_scaled_mm)
    sa, sb = blocked_scales(mx_scales(a)), blocked_scales(mx_scales(b))
    if padded_block_scales():
        mx, swizzle = F.ScalingType.BlockWise1x32, F.SwizzleType.SWIZZLE_32_4_4
        return F.scaled_mm(mat1, mat2, sa, mx, sb, mx, swizzle_a=swizzle, swizzle_b=swizzle,
                           output_dtype=out_dtype)
    return torch._scaled_mm(mat1, mat2, scale_a=sa, scale_b=sb, out_dtype=out_dtype)


def _gemm_block_loop(a, b, out_dtype, bias):
    """Block scales without native support: one row-wise _scaled_mm per 128-wide slice of K,
    fp32 outputs summed in fp32 (the "promote every 128 of K" of DeepSeek-V3, done by hand)."""
    ad, bd, k = a.data, b.data.contiguous(), a.data.shape[1]  # (b: see gemm_scaled_mm)
    # every row's scale for each 128-wide slice of K: (M, K tiles) and (N, K tiles)
    ia = expand_tiles(a.inv_scale, (a.block[0], 1), (len(a.data), a.inv_scale.shape[1]))
    ib = expand_tiles(b.inv_scale, (b.block[0], 1), (len(b.data), b.inv_scale.shape[1]))
    out = None
    for j, k0 in enumerate(range(0, k, K_STEP)):
        ks = slice(k0, min(k0 + K_STEP, k))
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


def gemm_triton(a, b, out_dtype, bias, fast_accum):
    # (row-major operands: a CPU's or a plain cast's Fp8Tensor.t() is a transposed view)
    return _kernels().fp8_gemm(a.data.contiguous(), b.data.contiguous(), a.inv_scale, b.inv_scale,
                               out_dtype, bias, fast_accum=fast_accum)


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


def quantize_triton(x2, fmt, granularity, block, margin, power_of_two):
    """quantize() on kernels.py's Triton quantizers (bit-exact with it: tests/test_kernels.py),
    for backend="triton". A tensor-scaled cast also writes its transpose in the same pass
    (kernels.quantize_transpose), so the x^T, W^T and dy^T of the backward GEMMs cost no second
    read of the tensor (Fp8Tensor.t() returns that copy)."""
    kernels = _kernels()
    x2 = x2.detach()
    if granularity == "tensor":
        data, data_t, scale = kernels.quantize_transpose(x2, fmt.dtype, margin, power_of_two)
    else:
        data_t = None
        data, scale = kernels.quantize(x2, fmt.dtype, granularity, block, margin, power_of_two)
    block = tuple(block) if granularity == "block" else (1, x2.shape[1])
    return Fp8Tensor(data, scale, fmt, granularity, block, x2.shape, x2.dtype, data_t=data_t)


def tile_refusal(a, b):
    """Why a block-scaled GEMM that steps through K K_STEP columns at a time (torch's block modes,
    the Triton GEMM, the row-wise loop) cannot take these tiles (None if it can): each K step
    must meet exactly one scale column of each operand, so a tile is 1 x K_STEP or
    K_STEP x K_STEP. A 1x32 tile (MX's among them) would otherwise be read with a 128-wide scale
    column, silently.
    The fp32 reference takes any tile (it scales every element by its own tile's scale)."""
    for q in (a, b):
        if q.granularity == "block" and tuple(q.block) not in ((1, K_STEP), (K_STEP, K_STEP)):
            return f"{q.block[0]}x{q.block[1]} block scales (the FP8 block GEMMs take 1x{K_STEP} and {K_STEP}x{K_STEP} tiles)"
    return None


def _shape_refusal(a, b, sup):
    k, n = a.data.shape[1], b.data.shape[0]
    if sup.device == "cuda" and (k % 16 or n % 16):
        return f"dims K={k}, N={n} are not multiples of 16"
    if a.fmt is E5M2 and b.fmt is E5M2:
        return "e5m2 x e5m2 is not a supported pair"
    return None


def mix_refusal(a, b):
    """Why a and b cannot be multiplied at all (None if they can): an MX operand goes with an MX
    operand only, on every backend (its scales are per 32 of K, E8M0; no GEMM mixes those with
    fp32 scales per 128 of K)."""
    if is_mx(a) != is_mx(b):
        mx, other = (a, b) if is_mx(a) else (b, a)
        return (f"nanofp8: an MX operand (1x{mx.block[1]} E8M0 scales) cannot be multiplied with a "
                f"{other.granularity} operand of {'x'.join(map(str, other.block))} {other.scale.dtype} "
                "scales: quantize both with the same recipe (fp8_recipe=mxfp8 casts every operand 1x32)")
    return None


def _mx_refusal(a, b, out_dtype, bias, sup):
    """Why torch's MX GEMM would not take this MX pair (None if it does): the MX rules above."""
    if tuple(a.block) != (1, MX_BLOCK) or tuple(b.block) != (1, MX_BLOCK):
        return f"MX tiles {a.block} x {b.block} (the MX GEMM takes 1x{MX_BLOCK} along K)"
    if not sup.mx:
        return ("MX (1x32, E8M0) scales need a GPU of compute capability 10.0 or newer (SM100: "
                f"B200/GB200) and torch >= 2.11 built with CUDA >= 12.8 (this device: {sup.device}, "
                f"torch {torch.__version__}, CUDA {torch.version.cuda})")
    if a.fmt is not E4M3 or b.fmt is not E4M3:
        return "MX scales with an E5M2 operand (torch's MX GEMM takes E4M3 x E4M3 only)"
    if out_dtype != torch.bfloat16 or bias is not None:
        return (f"MX scales with {str(out_dtype).replace('torch.', '')} output"
                f"{' and a bias' if bias is not None else ''} (PyTorch's tests run bf16 without bias only)")
    return None


def scaled_mm_refusal(a, b, out_dtype, sup, bias=None):
    """Why torch._scaled_mm on a device with support `sup` would refuse out = a @ b.T (None if
    it takes it), by the rules at the top of this section."""
    if not sup.fp8:
        return "this GPU has no FP8 tensor cores (compute capability 8.9 or newer needed)"
    reason = _shape_refusal(a, b, sup) or mix_refusal(a, b)
    if reason:
        return reason
    if is_mx(a):
        return _mx_refusal(a, b, out_dtype, bias, sup)
    grans = {a.granularity, b.granularity}
    if "block" in grans:
        reason = tile_refusal(a, b)
        if reason:
            return reason
        if not sup.block:
            return ("block scales need torch >= 2.11 on an SM90 GPU with cuBLASLt >= 12.9 "
                    f"(this device: {sup.device}, torch {torch.__version__}, CUDA {torch.version.cuda})")
        if a.fmt is not E4M3 or b.fmt is not E4M3:
            return "block scales with an E5M2 operand (torch's block GEMM takes E4M3 x E4M3 only)"
        if a.block[0] > 1 and b.block[0] > 1:
            return "128x128 x 128x128 block scales are not a supported pair"
        kt = -(-a.data.shape[1] // K_STEP)
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




# -----------------------------------------------------------------------------
# 2. The two seams: the GEMM and the cast of a backend


def gemm(a, b, out_dtype, bias, backend, fast_accum, name):
    """fp8.scaled_gemm for backend "torch", "triton" or "cpu" (a and b checked there).

    "cpu": the fp32 reference computed by nanofp8/emulate.py, the same bits, faster.
    "triton": kernels.py's GEMM. "torch": torch._scaled_mm where its rules allow the call (block
    scales natively on SM90 with cuBLASLt >= 12.9), and on a CPU its kernel's arithmetic
    (emulate.gemm_kernel). Otherwise, reported once per layer with the reason: the Triton GEMM on
    CUDA when kernels.py imports, then for block scales one row-wise GEMM per 128 of K, then the
    fp32 reference. MX pairs (mx.is_mx) run natively on SM100, else on the Triton MX GEMM
    (kernels.gemm_mx) where kernels.py has it, else on the fp32 reference: never on a path of
    128-wide scale columns."""
    reason = mix_refusal(a, b)
    if reason:
        raise ValueError(reason)
    mx = is_mx(a)
    if backend == "cpu":
        return emulate.gemm_reference(a, b, out_dtype, bias)
    if backend == "triton":
        if mx:
            return _gemm_mx_alternative(a, b, out_dtype, bias, "backend='triton' with MX scales, "
                                        "and kernels.py has no MX GEMM", name, report=None)
        return gemm_triton(a, b, out_dtype, bias, fast_accum)
    sup = scaled_mm_support(a.data.device)
    reason, refused = scaled_mm_refusal(a, b, out_dtype, sup, bias), False
    if sup.device == "cpu" and emulate.handles(a.data):  # (under the CUDA stand-in, sup says "cuda")
        return (emulate.gemm_kernel if reason is None else emulate.gemm_reference)(a, b, out_dtype, bias)
    if reason is None:
        try:
            if mx:
                return gemm_mx_native(a, b, out_dtype)
            if a.granularity == "block":
                return gemm_block_native(a, b, out_dtype, bias)
            return gemm_scaled_mm(a, b, out_dtype, bias, fast_accum)
        except (RuntimeError, ValueError) as e:  # a rule missing above: say so, loudly, once
            # (Under torch.compile this `try` is traced, not run: only the rules above, decided
            # while tracing, can fall back there; a refusal by the kernel fails the step.)
            reason, refused = "refused by torch._scaled_mm: " + str(e).splitlines()[0], True
    if mx:
        return _gemm_mx_alternative(a, b, out_dtype, bias, reason, name,
                                    report=sup.device == "cuda" or refused)
    if _triton_available(a.data.device) and not tile_refusal(a, b):
        alt, fn = "the Triton GEMM (kernels.py)", lambda: gemm_triton(a, b, out_dtype, bias, fast_accum)
    elif (a.granularity == "block" and sup.cublaslt_rowwise and not _shape_refusal(a, b, sup)
          and not tile_refusal(a, b) and a.fmt is E4M3):  # (never an E5M2 first operand: the rules)
        kt = -(-a.data.shape[1] // K_STEP)
        alt = (f"{kt} row-wise GEMMs (one per 128 of K) with fp32 outputs summed in fp32: "
               f"{kt}x the launches and {kt} x M x N x 8 bytes of extra traffic")
        fn = lambda: _gemm_block_loop(a, b, out_dtype, bias)  # noqa: E731
    else:
        alt, fn = HIGH_PRECISION, lambda: gemm_reference(a, b, out_dtype, bias)  # noqa: E731
    if sup.device == "cuda" or refused:  # a CPU's choices are all emulations: nothing is lost
        _fell_back(name, reason, alt)  # a high-precision one: counted, an error under fp8_strict
    return fn()


def _gemm_mx_alternative(a, b, out_dtype, bias, reason, name, report=True):
    """An MX pair that torch's MX GEMM cannot run: kernels.py's Triton MX GEMM (the E8M0 decode
    scales as they are: tl.dot_scaled on sm_100, its bf16 kernel on sm_90, kernels.mx_method) on
    CUDA where kernels.py imports and has it, else the fp32
    reference, a fallback (reported, counted, an error under fp8_strict). report: say why, once per
    layer (None: only when it is the reference)."""
    dev = a.data.device
    if _triton_available(dev) and hasattr(_kernels(), "gemm_mx"):
        alt = "the Triton MX GEMM (kernels.gemm_mx)"
        fn = lambda: _kernels().gemm_mx(a.data.contiguous(), mx_scales(a), b.data.contiguous(),  # noqa: E731
                                        mx_scales(b), out_dtype, bias)
    else:
        alt, fn = HIGH_PRECISION, lambda: gemm_reference(a, b, out_dtype, bias)  # noqa: E731
    if report or (report is None and alt == HIGH_PRECISION):
        _fell_back(name, reason, alt)
    return fn()


def cast(recipe, x2, fmt, granularity, block, rows_first=False):
    """fp8.quantize of a GEMM operand (current scaling) for backend "torch", "triton" or "cpu":
    the same bytes, on kernels.py's Triton quantizers where triton_cast says so, on the CPU
    emulation's shortcut (emulate.quantize) where that handles x2, else quantize itself
    (rows_first: how it reduces the amax). The granularity is the operand's (Recipe.casts)."""
    r = recipe
    if r.scale_rule is compute_scale and triton_cast(r, x2):  # (kernels.py's rule is compute_scale)
        return quantize_triton(x2, fmt, granularity, block, r.margin, r.power_of_two)
    if emulate.handles(x2):
        return emulate.quantize(x2, fmt, granularity, block, r.margin, r.power_of_two, r.scale_rule)
    return quantize(x2, fmt, granularity, block, margin=r.margin, power_of_two=r.power_of_two,
                    scale_rule=r.scale_rule, rows_first=rows_first)
