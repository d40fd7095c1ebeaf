"""A strict stand-in for torch._scaled_mm as CUDA runs it, for tests on a machine without a GPU.

torch._scaled_mm on CPU is lenient: it takes layouts, scale shapes and bias dtypes that the CUDA
kernel refuses. A test that passes on CPU therefore proves little about the first run on an H100.
This module checks every call against the CUDA rules and then computes the result the way
nanofp8's fp32 reference does (same primitives, so results can be compared bit for bit).

The rules, written from the checks in aten/src/ATen/native/cuda/ScaledBlas.cpp and
aten/src/ATen/cuda/CUDABlas.cpp of torch 2.11 and later (our own code, not a copy), in the order
the kernel applies them; ValueError where the kernel raises ValueError (TORCH_CHECK_VALUE),
NotImplementedError where it raises that, RuntimeError otherwise:

  1. The device needs compute capability 8.9 or 9.x and newer.           RuntimeError
  2. mat1 and mat2 are matrices with matching inner dims.                  RuntimeError
  3. The scales pick a mode pair, in this order (first match wins):      RuntimeError if none
       tensor  x tensor   fp32, one element each
       row     x row      scale_a (M, 1) contiguous, scale_b (1, N) contiguous, fp32
       128x128 x 1x128, 1x128 x 128x128, 1x128 x 1x128 (never 128x128 x 128x128), fp32, where
       1x128 for mat1 is (M, ceil(K/128)) with strides (1, M), and for mat2 (ceil(K/128), N)
       with strides (N, 1); 128x128 for mat1 is (ceil(M/128), ceil(K/128)) with strides
       (ceil(K/128), 1), and for mat2 (ceil(K/128), ceil(N/128)) with strides (1, ceil(K/128)).
       A stride is not checked along a dim of size 1.
  4. A bias has N elements.                                                 RuntimeError
  5. K % 16 == 0, and both dims of mat2 are multiples of 16.                RuntimeError
  6. Both operands are FP8; e5m2 x e5m2 is refused.                         ValueError
  7. Bias: none with fp32 output; bf16 or fp16; bf16 output needs a bf16 bias, fp16 output
     an fp16 bias.                                                          RuntimeError
  8. Row x row without cuBLASLt >= 12.9 (or below SM90) runs a CUTLASS kernel: output bf16 or
     fp16 only, mat2 E4M3 only.                                             ValueError
  9. Block modes need SM90 exactly, cuBLASLt >= 12.9 and torch >= 2.11   NotImplementedError
     and refuse use_fast_accum.                                             RuntimeError
 10. cuBLASLt on SM90 multiplies row-major mat1 by column-major mat2 only, with 16-byte aligned
     data and leading dimensions.                                           RuntimeError

What the kernel then computes, for 128x128 scales, is modelled too: cuBLASLt reads such a grid
row by row with the row length padded to L4 = ceil(K/128) rounded up to a multiple of 4, from the
tensor's first element. v1 checks the unpadded grid (step 3) and passes its pointer on, so where
ceil(K/128) % 4 != 0 the stand-in, like the GPU, multiplies by the wrong scales (and by NaN where
the read runs past the allocation), without an error (PyTorch PR 166752); it notes each such
call in `misreads`.

torch.nn.functional.scaled_mm (the v2 API, `scaled_mm_v2` here; installed in place of
F.scaled_mm) takes the scale kinds by name (ScalingType) and checks, for block scales, the
layouts of aten/src/ATen/native/cuda/ScaledBlas.cpp's v2 entry points: 1x128 as (rows,
ceil(K/128)) with strides (1, rows), for mat1 and for mat2's N rows alike; 128x128 as (L4, row
tiles) with strides (1, L4), the padded grid that cuBLASLt reads. Before those, it looks the
(scale kinds, dtypes) up in a table of recipes, and its block recipes (check_deepseek_recipe)
take float8_e4m3fn x float8_e4m3fn only: an E5M2 operand with block scales is "Invalid scaling
configuration" (ValueError). That is the rule of the torch the stand-in models,
`torch_version`, from 2.11, where native block scales start: torch 2.11.0+cu130's
libtorch_cuda.so and torch 2.13's libtorch_cpu.so both compare both dtypes with
float8_e4m3fn there. Its other rules are steps 1-10.

MX scales (1x32 blocks along K, float8_e8m0fnu decode factors; nanofp8/device.py's rules say
where each is read from): v1 takes them as its last pair, 1x32 x 1x32, when both operands are FP8,
both scales E8M0, contiguous, with round_up(rows, 128) * round_up(ceil(K/32), 4) elements (rows:
M, or N for scale_b, which v1 does not transpose for this mode), in cuBLASLt's blocked layout
(which no check can see: the stand-in reads them by that layout, `_unblocked`, so a wrong
swizzle gives wrong numbers, as on the GPU). v2 takes ScalingType.BlockWise1x32 for both with
SwizzleType.SWIZZLE_32_4_4 for both (ValueError otherwise, "Expected single swizzle argument"
without one), E4M3 x E4M3 only ("Invalid scaling configuration"), the same element counts
("For Blockwise scaling scale_a should have ...") and contiguous scales. Then steps 2-8 apply.
The kernels exist from SM100 with a CUDA >= 12.8 build: below SM100 torch's checks pass and
cuBLASLt finds no kernel (RuntimeError, CUBLAS_STATUS_NOT_SUPPORTED); an older build refuses the
scale mode (RuntimeError). MX results are computed as nanofp8's reference computes block scales
(fp32 partial sums per 128 of K), with the scales as the layout places them.

Beyond what the kernel checks, the stand-in refuses three combinations that PyTorch's own tests
never run (test_scaled_matmul_cuda.py), so that nanofp8 is held to the tested ones: block scales
with a bias, block scales with an E5M2 operand on v1 (whose checks let it through to cuBLASLt,
while v2 refuses it), and row-wise scales with an E5M2 mat1; and for MX scales, a bias, an E5M2
operand, or an output other than bf16 (PyTorch's MX tests run bf16 only). RuntimeError

Use: `contract = CudaScaledMM(...)`; `contract.install(monkeypatch)` replaces torch._scaled_mm,
torch.nn.functional.scaled_mm and nanofp8.device.scaled_mm_support; `contract.calls` lists (mode_a,
mode_b, dtype_a, dtype_b, out_dtype, bias dtype or None, use_fast_accum, api "v1"/"v2") of every
accepted call; `contract.refusals` every refused one (which nanofp8 must never make).
"""

import torch
import torch.nn.functional as F

from nanofp8 import device as nanofp8_device

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
E4M3 = torch.float8_e4m3fn
E8M0 = torch.float8_e8m0fnu


def _cdiv(a, b):
    return -(-a // b)


def _size_stride(s, dim, size, stride):
    return s.size(dim) == size and (size <= 1 or s.stride(dim) == stride)


def _mx_count(rows, k):
    """Elements of an MX scale tensor for an operand (rows, K): the blocked layout's padding."""
    return _cdiv(rows, 128) * 128 * _cdiv(_cdiv(k, 32), 4) * 4


def _unblocked(s, rows, k):
    """The (rows, ceil(K/32)) grid of MX scales (as fp32) that cuBLASLt reads from a blocked scale
    tensor s: the 128x4 tile of (r, c) is tile (r // 128, c // 4), tiles row-major, 512 bytes
    each, and in it (r, c) sits at (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4."""
    kb = _cdiv(k, 32)
    r, c = torch.arange(rows)[:, None], torch.arange(kb)[None, :]
    at = ((r // 128) * _cdiv(kb, 4) + c // 4) * 512 + (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4
    return s.reshape(-1)[at].float()


def _mode_of(t, s, which):
    """Which of the modes that `which` lists the (operand, scale) pair satisfies (None if none).
    t is given as (rows, K): mat1 itself, or mat2 transposed (with its scale transposed, but for
    1x32, whose scale v1 takes as it is)."""
    rows, k = t.shape
    kt = _cdiv(k, 128)
    if which == "1x32":
        ok = t.dtype in FP8 and s.dtype == E8M0 and s.numel() == _mx_count(rows, k) and s.is_contiguous()
        return "1x32" if ok else None
    if s.dtype != torch.float32:
        return None
    if which == "tensor":
        return "tensor" if s.numel() == 1 else None
    if which == "row":
        return "row" if s.dim() == 2 and tuple(s.shape) == (rows, 1) and s.is_contiguous() else None
    if s.dim() != 2:
        return None
    if which == "1x128":
        ok = _size_stride(s, 0, rows, 1) and _size_stride(s, 1, kt, rows)
        return "1x128" if ok else None
    ok = _size_stride(s, 0, _cdiv(rows, 128), kt) and _size_stride(s, 1, kt, 1)
    return "128x128" if ok else None


PAIRS = [("tensor", "tensor"), ("row", "row"), ("128x128", "1x128"), ("1x128", "128x128"),
         ("1x128", "1x128"), ("1x32", "1x32")]


def _rows_view(s, mode, api, mat2):
    """A scale argument seen along its operand's rows: (rows or row tiles, K tiles or 1)."""
    if mode == "1x32":
        return s  # the flat blocked tensor, for mat2 too
    if api == "v2" and mode == "128x128":
        return s.t()  # (row tiles, L4)
    if api == "v2" and mode == "1x128":
        return s  # (rows, Kt), for mat2 too
    return s.t() if mat2 else s  # v1 (and v2's tensor and row scales): mat2's scale is (.., N)


def _as_read(sim, s, mode, shape, api):
    """The scales the kernel uses for an operand of `shape` (rows, K) whose scale, seen along its
    rows, is s: for 128x128, the (row tiles, Kt) grid that cuBLASLt reads from s's first element
    with rows L4 apart. v2's s is that padded grid; v1's is unpadded, so where Kt % 4 != 0 the
    rows are misread (NaN where the read runs past the allocation)."""
    if mode == "1x32":
        return _unblocked(s, *shape)
    if mode != "128x128":
        return s
    rows_t, kt = _cdiv(shape[0], 128), _cdiv(shape[1], 128)
    if api == "v2":
        return s[:, :kt]
    l4 = _cdiv(kt, 4) * 4
    if l4 == kt:
        return s
    sim.misreads.append((rows_t, kt))
    flat = torch.empty(0, dtype=s.dtype).set_(s.untyped_storage())[s.storage_offset():]
    at = torch.arange(rows_t)[:, None] * l4 + torch.arange(kt)[None, :]
    padded = torch.cat([flat, torch.full((rows_t * l4,), float("nan"))])
    return padded[at]


class CudaScaledMM:
    """torch._scaled_mm with the CUDA rules. sm: compute capability; cublaslt: (major, minor);
    torch_version: the simulated torch's (major, minor). From 2.11 it has native block scales
    (which nanofp8 uses) and v2's block recipes take E4M3 x E4M3 only."""

    def __init__(self, sm=(9, 0), cublaslt=(12, 9), torch_version=(2, 11)):
        self.sm, self.cublaslt, self.torch_version = sm, cublaslt, torch_version
        self.torch_block = torch_version >= (2, 11)
        self.cuda_mx = cublaslt >= (12, 8)  # the build's cuBLASLt has the 1x32 E8M0 scale mode
        self.calls, self.refusals, self.misreads = [], [], []

    def support(self, device=None):
        """What nanofp8.device.scaled_mm_support would report on the simulated device."""
        fp8_ok = self.sm >= (8, 9)
        new = self.cublaslt >= (12, 9)
        return nanofp8_device.ScaledMMSupport("cuda", fp8=fp8_ok, rowwise=fp8_ok,
                                   cublaslt_rowwise=new and self.sm[0] >= 9,
                                   block=self.sm[0] == 9 and new and self.torch_block,
                                   mx=self.sm[0] >= 10 and self.cuda_mx and self.torch_block)

    def install(self, monkeypatch):
        monkeypatch.setattr(torch, "_scaled_mm", self)
        monkeypatch.setattr(F, "scaled_mm", self.scaled_mm_v2)
        monkeypatch.setattr(nanofp8_device, "scaled_mm_support", self.support)
        return self

    def __call__(self, mat1, mat2, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None,
                 use_fast_accum=False):
        try:
            modes = self._check(mat1, mat2, scale_a, scale_b, bias, out_dtype, use_fast_accum)
        except Exception as e:
            self.refusals.append(f"{type(e).__name__}: {e}")
            raise
        return self._accepted(mat1, mat2, scale_a, scale_b, bias, out_dtype or mat1.dtype, modes,
                              use_fast_accum, "v1")

    def scaled_mm_v2(self, mat_a, mat_b, scale_a, scale_recipe_a, scale_b, scale_recipe_b,
                     swizzle_a=None, swizzle_b=None, bias=None, output_dtype=torch.bfloat16,
                     contraction_dim=(), use_fast_accum=False):
        """torch.nn.functional.scaled_mm, for the scale kinds nanofp8 can pass (tensor, row, 1x128,
        128x128: fp32 scales, one per operand, unswizzled; 1x32: E8M0, swizzled)."""
        try:
            modes = self._check_v2(mat_a, mat_b, scale_a, scale_recipe_a, scale_b, scale_recipe_b,
                                   swizzle_a, swizzle_b, contraction_dim)
            self._check(mat_a, mat_b, scale_a, scale_b, bias, output_dtype, use_fast_accum, modes)
        except Exception as e:
            self.refusals.append(f"{type(e).__name__}: {e}")
            raise
        return self._accepted(mat_a, mat_b, scale_a, scale_b, bias, output_dtype or mat_a.dtype, modes,
                              use_fast_accum, "v2")

    def _accepted(self, mat1, mat2, scale_a, scale_b, bias, out_dtype, modes, fast, api):
        self.calls.append((*modes, mat1.dtype, mat2.dtype, out_dtype,
                           None if bias is None else bias.dtype, fast, api))
        # what the kernel reads: v1 hands cuBLASLt a 128x128 grid unpadded, v2 padded
        sa = _as_read(self, _rows_view(scale_a, modes[0], api, False), modes[0], mat1.shape, api)
        sb = _as_read(self, _rows_view(scale_b, modes[1], api, True), modes[1], mat2.t().shape, api)
        return self._compute(mat1, mat2, sa, sb.t(), bias, out_dtype, modes)

    def _check_v2(self, mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, swizzle_a, swizzle_b,
                  contraction):
        kinds = {F.ScalingType.TensorWise: "tensor", F.ScalingType.RowWise: "row",
                 F.ScalingType.BlockWise1x128: "1x128", F.ScalingType.BlockWise128x128: "128x128",
                 F.ScalingType.BlockWise1x32: "1x32"}
        if any(isinstance(x, (list, tuple)) for x in (scale_a, recipe_a, scale_b, recipe_b)):
            raise ValueError("one scale per operand expected (multi-level scales are NVFP4's)")
        swizzles = [sw[0] if isinstance(sw, (list, tuple)) and len(sw) == 1 else sw for sw in (swizzle_a, swizzle_b)]
        if F.ScalingType.BlockWise1x32 in (recipe_a, recipe_b):
            return self._check_v2_mx(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, swizzles)
        if any(sw not in (None, F.SwizzleType.NO_SWIZZLE) for sw in swizzles):
            raise ValueError("fp32 scales take no swizzle")
        if tuple(contraction) not in ((), (1, 0)):
            raise ValueError(f"contraction_dim must be () or (1, 0), got {contraction}")
        if recipe_a not in kinds or recipe_b not in kinds:
            raise NotImplementedError(f"scale recipes {recipe_a}, {recipe_b}: not an FP8 recipe with fp32 scales")
        modes = (kinds[recipe_a], kinds[recipe_b])
        if modes not in PAIRS:
            raise ValueError(f"Invalid scaling configuration: {modes} is not a supported pair")
        if "1x128" in modes and self.torch_block and (mat_a.dtype, mat_b.dtype) != (E4M3, E4M3):
            raise ValueError(f"Invalid scaling configuration: block recipes {modes} take "
                             f"float8_e4m3fn x float8_e4m3fn only, got {mat_a.dtype} x {mat_b.dtype}")
        (M, K), N = mat_a.shape, mat_b.shape[1]
        kt, l4 = _cdiv(K, 128), _cdiv(_cdiv(K, 128), 4) * 4
        for name, s, mode, rows in (("scale_a", scale_a, modes[0], M), ("scale_b", scale_b, modes[1], N)):
            if mode == "1x128":  # (rows, Kt) with strides (1, rows): the same for mat1 and mat2
                ok = s.dim() == 2 and _size_stride(s, 0, rows, 1) and _size_stride(s, 1, kt, rows)
                want = f"({rows}, {kt}) with strides (1, {rows})"
            elif mode == "128x128":  # the padded grid cuBLASLt reads, as (L4, row tiles)
                ok = s.dim() == 2 and _size_stride(s, 0, l4, 1) and _size_stride(s, 1, _cdiv(rows, 128), l4)
                want = f"({l4}, {_cdiv(rows, 128)}) with strides (1, {l4})"
            else:
                continue  # tensor and row: as v1 (checked by _check)
            if not ok or s.dtype != torch.float32:
                raise ValueError(f"{name} must be fp32 of shape {want}; got {tuple(s.shape)}, "
                                 f"strides {s.stride()}, {s.dtype}")
        return modes

    def _check_v2_mx(self, mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, swizzles):
        """v2's MXFP8 recipe (check_mxfp8_recipe, check_swizzle_lengths, _scaled_mxfp8_mxfp8)."""
        mx = F.ScalingType.BlockWise1x32
        if (recipe_a, recipe_b) != (mx, mx) or (mat_a.dtype, mat_b.dtype) != (E4M3, E4M3) \
                or (scale_a.dtype, scale_b.dtype) != (E8M0, E8M0):
            raise ValueError(f"Invalid scaling configuration: MXFP8 takes BlockWise1x32 x BlockWise1x32, "
                             f"float8_e4m3fn operands and float8_e8m0fnu scales; got {recipe_a}, {recipe_b}, "
                             f"{mat_a.dtype} x {mat_b.dtype}, scales {scale_a.dtype} x {scale_b.dtype}")
        if any(sw is None or isinstance(sw, (list, tuple)) for sw in swizzles):
            raise ValueError("Expected single swizzle argument")
        (M, K), N = mat_a.shape, mat_b.shape[1]
        for name, s, rows in (("scale_a", scale_a, M), ("scale_b", scale_b, N)):
            if s.numel() != _mx_count(rows, K):
                raise ValueError(f"For Blockwise scaling {name} should have {_mx_count(rows, K)} "
                                 f"elements, got: {s.numel()}")
        for name, sw in zip(("scale_a", "scale_b"), swizzles):
            if sw != F.SwizzleType.SWIZZLE_32_4_4:
                raise ValueError(f"{name} must be swizzled to SWIZZLE_32_4_4 format")
        if not (scale_a.is_contiguous() and scale_b.is_contiguous()):
            raise ValueError("For Blockwise scaling both scales should be contiguous")
        return ("1x32", "1x32")

    def _check(self, mat1, mat2, scale_a, scale_b, bias, out_dtype, fast, modes=None):
        if self.sm < (8, 9):
            raise RuntimeError("torch._scaled_mm is only supported on CUDA devices with compute "
                               "capability >= 9.0 or 8.9")
        if mat1.dim() != 2 or mat2.dim() != 2:
            raise RuntimeError("mat1 and mat2 must be matrices")
        (M, K), (K2, N) = mat1.shape, mat2.shape
        if K != K2:
            raise RuntimeError(f"mat1 and mat2 shapes cannot be multiplied ({M}x{K} and {K2}x{N})")
        for ma, mb in [modes] if modes else PAIRS:  # (v2: the modes it was told, layouts checked)
            sb = scale_b if mb == "1x32" else scale_b.t()  # (v1 takes an MX scale_b as it is)
            if modes or (_mode_of(mat1, scale_a, ma) == ma and _mode_of(mat2.t(), sb, mb) == mb):
                modes = (ma, mb)
                break
        else:
            raise RuntimeError(f"Invalid scaling configuration: scale_a {tuple(scale_a.shape)} "
                               f"strides {scale_a.stride()} {scale_a.dtype}, scale_b "
                               f"{tuple(scale_b.shape)} strides {scale_b.stride()} {scale_b.dtype}")
        if bias is not None and bias.numel() != N:
            raise RuntimeError(f"Bias must be size {N} but got {bias.numel()}")
        if K % 16:
            raise RuntimeError(f"Expected trailing dimension of mat1 to be divisible by 16 ({M}x{K})")
        if K2 % 16 or N % 16:
            raise RuntimeError(f"mat2 shape ({K2}x{N}) must be divisible by 16")
        if mat1.dtype not in FP8 or mat2.dtype not in FP8:
            raise RuntimeError(f"Expected Float8 matrices, got {mat1.dtype} and {mat2.dtype}")
        if mat1.dtype == mat2.dtype == torch.float8_e5m2:
            raise ValueError("Multiplication of two Float8_e5m2 matrices is not supported")
        out = out_dtype or mat1.dtype
        if bias is not None:
            if out == torch.float32:
                raise RuntimeError("Bias is not supported when out_dtype is set to Float32")
            if bias.dtype not in (torch.bfloat16, torch.float16):
                raise RuntimeError(f"Bias must be BFloat16 or Half, but got {bias.dtype}")
            if out == torch.bfloat16 and bias.dtype != torch.bfloat16:
                raise RuntimeError(f"Bias must be BFloat16 to compute BFloat16 output, got {bias.dtype}")
            if out == torch.float16 and bias.dtype != torch.float16:
                raise RuntimeError(f"Bias must be Float16 to compute Float16 output, got {bias.dtype}")
        if bias is not None and "1x128" in modes:
            raise RuntimeError("block scales with a bias: never run by PyTorch's tests")
        if "1x128" in modes and torch.float8_e5m2 in (mat1.dtype, mat2.dtype):
            raise RuntimeError("block scales with an E5M2 operand: never run by PyTorch's tests "
                               "(and refused by its v2 API)")
        if "row" in modes and mat1.dtype == torch.float8_e5m2:
            raise RuntimeError("row-wise scales with an E5M2 mat1: never run by PyTorch's tests")
        if "1x32" in modes:  # (what PyTorch's MX tests never run, then the device)
            if bias is not None:
                raise RuntimeError("MX scales with a bias: never run by PyTorch's tests")
            if torch.float8_e5m2 in (mat1.dtype, mat2.dtype):
                raise RuntimeError("MX scales with an E5M2 operand: never run by PyTorch's tests "
                                   "(and refused by its v2 API)")
            if out != torch.bfloat16:
                raise RuntimeError(f"MX scales with {out} output: never run by PyTorch's tests (bf16 only)")
            if not self.cuda_mx:
                raise RuntimeError("scaled_gemm with `torch.float8_e8m0fnu` scales of 1x32 blocks is "
                                   "only supported for CUDA 12.8 and above")
        cublaslt_129 = self.cublaslt >= (12, 9)
        if modes == ("row", "row") and (self.sm[0] < 9 or not cublaslt_129):
            if out not in (torch.bfloat16, torch.float16):
                raise ValueError("row-wise scaling on the CUTLASS kernel writes bf16/fp16 only")
            if mat2.dtype != torch.float8_e4m3fn:
                raise ValueError(f"row-wise scaling on the CUTLASS kernel needs mat2 float8_e4m3fn, "
                                 f"got {mat2.dtype}")
        if "1x128" in modes:
            if self.sm[0] != 9:
                raise NotImplementedError("DeepSeek style (1x128, 128x128) scaling only supported "
                                          "in CUDA for SM90")
            if not cublaslt_129 or not self.torch_block:
                raise NotImplementedError("DeepSeek style (1x128, 128x128) scaling requires "
                                          "cublasLt >= 12.9")
            if fast:
                raise RuntimeError("use_fast_accum is not supported with block-wise scaling")
        if mat1.stride(1) != 1 or mat1.stride(0) < max(K, 1):
            raise RuntimeError(f"mat1 must be row-major, got strides {mat1.stride()}; only "
                               "multiplication of row-major and column-major matrices is supported")
        if mat2.stride(0) != 1 or mat2.stride(1) < max(K, 1):
            raise RuntimeError(f"mat2 must be column-major, got strides {mat2.stride()}; only "
                               "multiplication of row-major and column-major matrices is supported")
        for name, t, ld in (("mat1", mat1, mat1.stride(0)), ("mat2", mat2, mat2.stride(1))):
            if t.data_ptr() % 16 or (ld * t.element_size()) % 16:
                raise RuntimeError(f"{name}: data and leading dimension must be 16-byte aligned "
                                   f"(pointer offset {t.data_ptr() % 16}, leading dimension {ld})")
        if "1x32" in modes and self.sm[0] < 10:  # all of torch's checks passed: cuBLASLt has no kernel
            raise RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling "
                               "`cublasLtMatmulAlgoGetHeuristic(...)` (no 1x32 block-scaled FP8 kernel below SM100)")
        return modes

    @staticmethod
    def _compute(mat1, mat2, scale_a, scale_b, bias, out_dtype, modes):
        """fp32 dequantize-and-multiply, in the order nanofp8.fp8.gemm_reference uses."""
        (M, K), N = mat1.shape, mat2.shape[1]
        b_nk = mat2.t()  # (N, K), row-major, like the Fp8Tensor it came from

        def per_element(t, s, mode, rows):
            r = torch.arange(rows)[:, None]
            c = torch.arange(K)[None, :] // 128
            if mode == "tensor":
                return s.reshape(())
            if mode == "row":
                return s.reshape(rows, 1)
            if mode == "1x128":
                return s[r, c]
            if mode == "1x32":
                return s[r, torch.arange(K)[None, :] // 32]
            return s[r // 128, c]

        a32 = mat1.float() * per_element(mat1, scale_a, modes[0], M)
        b32 = b_nk.float().contiguous() * per_element(b_nk, scale_b.t(), modes[1], N)
        if modes[0] in ("tensor", "row"):
            out = a32 @ b32.t()
        else:
            out = sum(a32[:, k0 : k0 + 128] @ b32[:, k0 : k0 + 128].t() for k0 in range(0, K, 128))
        out = out if bias is None else out + bias.float()
        return out.to(out_dtype)
