"""MX GEMMs (1x32 tiles, E8M0 scales) against the CUDA contract (tests/cuda_contract.py).

The rules (nanofp8/device.py, read from PyTorch's sources): torch's MX GEMM runs on SM100 and newer
with a CUDA >= 12.8 build, takes the decode scales 2^k in cuBLASLt's blocked 128x4 layout, and
is tested upstream with E4M3 operands, bf16 output and no bias. Everywhere else (an H100 or H200,
a CPU, the other cases) an MX GEMM runs on kernels.py's Triton MX GEMM where it exists, else on
the fp32 reference, and never on a path that reads scales one column per 128 of K (the 1x128 /
128x128 GEMMs, the row-wise loop, the Triton block GEMM): there a 1x32 grid would be misread,
silently. The tests here check:

* the blocked layout, index by index, against the cuBLAS formula and PyTorch's own test helper;
* the stand-in's MX rules (what it accepts, what it refuses with which message) and arithmetic;
* on an SM100 stand-in: one native call per MX GEMM, bit-exact with the reference;
* on SM90 and the rest: no MX call reaches torch._scaled_mm, the named alternative runs, and the
  numbers are the reference's even where every 128-wide path is available and would misread;
* an MX operand with a 1x128 one: refused, one line.
"""

import dataclasses
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from cuda_contract import CudaScaledMM, _unblocked
from nanofp8 import device, emulate, fp8, mx
from nanofp8.fp8 import E4M3, E5M2, RECIPES, K_STEP, convert_to_fp8, dequantize, quantize, scaled_gemm, sqnr

DEVICES = {"sm100": dict(sm=(10, 0), cublaslt=(12, 9)),
           "sm100-cuda12.6": dict(sm=(10, 0), cublaslt=(12, 6)),
           "h100": dict(sm=(9, 0), cublaslt=(12, 9)),
           "h100-no-native-block": dict(sm=(9, 0), cublaslt=(12, 9), torch_version=(2, 10)),
           "sm89": dict(sm=(8, 9), cublaslt=(12, 9))}
NOT_SM100 = [d for d in DEVICES if d != "sm100"]
E8M0 = torch.float8_e8m0fnu
SWZ = F.SwizzleType.SWIZZLE_32_4_4
MX = F.ScalingType.BlockWise1x32


@pytest.fixture
def contract(monkeypatch, request):
    device._warned.clear()
    device.fallbacks.clear()
    return CudaScaledMM(**DEVICES[request.param]).install(monkeypatch)


def _mx(rows, k, fmt=E4M3, seed=0):
    """An MX operand whose 32-wide blocks are 2^-20 .. 2^20 apart (rows 1e6 apart, an all-zero
    block, a tiny one): a scale read for the wrong block changes the product by orders of
    magnitude, so no misread can hide in rounding."""
    g = torch.Generator().manual_seed(seed)
    kb = -(-k // 32)
    spread = torch.exp2(torch.randint(-20, 21, (rows, kb), generator=g).float())
    x = torch.randn(rows, k, generator=g) * spread.repeat_interleave(32, 1)[:, :k]
    x[0] *= 1e6
    x[-1, :32] = 0
    x[rows // 2, -32:] *= 1e-30
    return quantize(x, fmt, "block", (1, 32), scale_rule=mx.mx_scale)


def _exact(a, b):
    return dequantize(a).double() @ dequantize(b).double().t()


def _read_128_wide(a_data, b_data, a_inv, b_inv, out_dtype, bias=None, fast_accum=False):
    """What a block GEMM that steps through K 128 columns at a time computes from a scale grid:
    scale column j for the whole j-th slice (kernels.fp8_gemm's, the row-wise loop's and torch's
    1x128 reading). Given a 1x32 grid, that is the silent misread the routing must prevent."""
    k = a_data.shape[1]
    col = torch.arange(k) // K_STEP
    a32 = emulate.fp8_to_float(a_data, a_inv[:, col])  # (data.float() * ..., faster)
    b32 = emulate.fp8_to_float(b_data, b_inv[:, col])
    out = sum(a32[:, k0 : k0 + K_STEP] @ b32[:, k0 : k0 + K_STEP].t() for k0 in range(0, k, K_STEP))
    return (out if bias is None else out + bias.float()).to(out_dtype)


# -- the blocked layout ----------------------------------------------------------------


SHAPES = [(1, 1), (31, 3), (128, 4), (130, 7), (257, 9), (64, 32)]


def _slow_blocked(s):
    """cuBLASLt's blocked layout of a (rows, cols) E8M0 grid, by the cuBLAS documentation's
    formula, one scale at a time: 128x4 tiles, row-major, 512 bytes each; in a tile, row r and
    column c at (r % 32) * 16 + (r // 32) * 4 + c; padding byte 0 (as PyTorch's tests pad)."""
    rows, cols = s.shape
    rt, ct = -(-rows // 128), -(-cols // 4)
    flat, grid = [0] * (rt * 128 * ct * 4), s.view(torch.uint8).tolist()
    for r in range(rows):
        for c in range(cols):
            tile = (r // 128) * ct + c // 4
            flat[tile * 512 + (r % 32) * 16 + (r % 128) // 32 * 4 + c % 4] = grid[r][c]
    return torch.tensor(flat, dtype=torch.uint8).view(E8M0)


def _grid(rows, cols):
    g = torch.Generator().manual_seed(rows * 100 + cols)
    return torch.randint(1, 255, (rows, cols), generator=g, dtype=torch.uint8).view(E8M0)


@pytest.mark.parametrize("rows,cols", SHAPES)
def test_blocked_scales_place_every_scale_where_cublas_reads_it(rows, cols):
    # (also equal, byte for byte, to torch/testing/_internal/common_quantized.py's to_blocked,
    # the helper PyTorch's MX tests use: checked once by hand, as that module needs expecttest)
    s = _grid(rows, cols)
    out = device.blocked_scales(s)
    assert out.dtype == E8M0 and out.is_contiguous()
    assert torch.equal(out.view(torch.uint8), _slow_blocked(s).view(torch.uint8))


@pytest.mark.parametrize("rows,cols", SHAPES)
def test_stand_in_reads_the_documented_layout(rows, cols):
    # the stand-in's reading is its own, anchored on the formula, not on device.blocked_scales:
    # a wrong swizzle in nanofp8 then gives wrong numbers under the stand-in, as on the GPU
    s = _grid(rows, cols)
    k = cols * 32 - 16  # (ceil(K/32) = cols)
    assert torch.equal(_unblocked(_slow_blocked(s), rows, k), s.float())


# -- the stand-in's MX rules -------------------------------------------------------------


def test_stand_in_takes_mx_calls_as_the_sm100_kernel_does():
    sm100, h100 = CudaScaledMM(**DEVICES["sm100"]), CudaScaledMM(**DEVICES["h100"])
    a, b = _mx(130, 240), _mx(48, 240, seed=1)  # K = 240: no multiple of 32 (PyTorch tests it)
    sa, sb = device.blocked_scales(mx.mx_scales(a)), device.blocked_scales(mx.mx_scales(b))
    v1 = sm100(a.data, b.data.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    v2 = sm100.scaled_mm_v2(a.data, b.data.t(), sa, MX, sb, MX, swizzle_a=SWZ, swizzle_b=SWZ)
    assert [c[:2] + c[4:] for c in sm100.calls] == [("1x32", "1x32", torch.bfloat16, None, False, api)
                                                   for api in ("v1", "v2")]
    want = fp8.gemm_reference(a, b, torch.bfloat16, None)
    assert torch.equal(v1, want) and torch.equal(v2, want)  # the reference's order, bit for bit
    assert sqnr(_exact(a, b), v1.float()) > 45  # bf16 output rounding, nothing else
    grid = mx.mx_scales(a)
    cases = [  # (call, exception, message)
        (lambda: sm100(a.data, b.data.t(), scale_a=grid.contiguous(), scale_b=sb, out_dtype=torch.bfloat16),
         RuntimeError, "Invalid scaling"),  # the unpadded grid: wrong count
        (lambda: sm100(a.data, b.data.t(), scale_a=sa.float(), scale_b=sb, out_dtype=torch.bfloat16),
         RuntimeError, "Invalid scaling"),  # fp32 scales are no MX scales
        (lambda: sm100(a.data, b.data.t(), scale_a=sa.view(torch.uint8).repeat_interleave(2)[::2].view(E8M0), scale_b=sb,
                       out_dtype=torch.bfloat16), RuntimeError, "Invalid scaling"),  # not contiguous
        (lambda: sm100(a.data, b.data.t(), scale_a=sa, scale_b=sb, out_dtype=torch.float32),
         RuntimeError, "bf16 only"),
        (lambda: sm100(a.data, b.data.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                       bias=torch.zeros(48, dtype=torch.bfloat16)), RuntimeError, "bias"),
        (lambda: sm100(a.data[:, :200], b.data[:, :200].t(), scale_a=sa, scale_b=sb,
                       out_dtype=torch.bfloat16), RuntimeError, "Invalid scaling|divisible by 16"),
        (lambda: sm100.scaled_mm_v2(a.data, b.data.t(), grid, MX, sb, MX, swizzle_a=SWZ, swizzle_b=SWZ),
         ValueError, "scale_a should have 2048 elements, got: 1040"),
        (lambda: sm100.scaled_mm_v2(a.data, b.data.t(), sa, MX, sb, MX), ValueError, "single swizzle"),
        (lambda: sm100.scaled_mm_v2(a.data, b.data.t(), sa, MX, sb, MX, swizzle_a=SWZ,
                                    swizzle_b=F.SwizzleType.NO_SWIZZLE), ValueError, "scale_b must be swizzled"),
        (lambda: sm100.scaled_mm_v2(a.data, b.data.t(), sa, MX, sb.float(), F.ScalingType.BlockWise1x128,
                                    swizzle_a=SWZ, swizzle_b=SWZ), ValueError, "Invalid scaling"),
        # SM90: torch's checks pass, cuBLASLt has no kernel
        (lambda: h100(a.data, b.data.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16),
         RuntimeError, "CUBLAS_STATUS_NOT_SUPPORTED"),
        (lambda: h100.scaled_mm_v2(a.data, b.data.t(), sa, MX, sb, MX, swizzle_a=SWZ, swizzle_b=SWZ),
         RuntimeError, "CUBLAS_STATUS_NOT_SUPPORTED"),
        (lambda: CudaScaledMM(**DEVICES["sm100-cuda12.6"])(a.data, b.data.t(), scale_a=sa, scale_b=sb,
                                                           out_dtype=torch.bfloat16), RuntimeError, "CUDA 12.8"),
    ]
    for call, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            call()
    e5 = _mx(48, 240, fmt=E5M2, seed=2)
    s5 = device.blocked_scales(mx.mx_scales(e5))
    with pytest.raises(RuntimeError, match="E5M2"):  # v1 lets it through; PyTorch never tests it
        sm100(a.data, e5.data.t(), scale_a=sa, scale_b=s5, out_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="Invalid scaling"):  # v2's recipe table refuses it
        sm100.scaled_mm_v2(a.data, e5.data.t(), sa, MX, s5, MX, swizzle_a=SWZ, swizzle_b=SWZ)
    assert len(sm100.calls) == 2 and not h100.calls


def test_a_wrong_swizzle_gives_wrong_numbers_under_the_stand_in():
    # as on the GPU, no check sees the order of the bytes: the stand-in reads them by the layout
    sm100 = CudaScaledMM(**DEVICES["sm100"])
    a, b = _mx(130, 256), _mx(48, 256, seed=1)
    plain = mx.mx_scales(a).view(torch.uint8)
    padded = torch.zeros(256, 8, dtype=torch.uint8)
    padded[:130] = plain
    row_major = padded.reshape(-1).view(E8M0)  # the right count, unswizzled
    out = sm100(a.data, b.data.t(), scale_a=row_major, scale_b=device.blocked_scales(mx.mx_scales(b)),
                out_dtype=torch.bfloat16)
    assert not sqnr(_exact(a, b), out.float()) > 10


# -- nanofp8's MX GEMMs under the stand-in -------------------------------------------------


@pytest.mark.parametrize("contract", ["sm100"], indirect=True)
@pytest.mark.parametrize("padded", [True, False], ids=["eager-v2", "compiled-v1"])
@pytest.mark.parametrize("mkn", [(130, 240, 48), (64, 512, 96), (2, 96, 272)])
def test_mx_gemm_on_sm100_is_one_native_call(contract, padded, mkn, monkeypatch):
    monkeypatch.setattr(device, "padded_block_scales", lambda: padded)
    m, k, n = mkn
    a, b = _mx(m, k), _mx(n, k, seed=1)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = scaled_gemm(a, b, torch.bfloat16, name="mx")
    assert not [str(x.message) for x in w if "nanofp8" in str(x.message)]
    assert [c[:2] + c[4:] for c in contract.calls] == [("1x32", "1x32", torch.bfloat16, None, False,
                                                        "v2" if padded else "v1")]
    assert torch.equal(out, fp8.gemm_reference(a, b, torch.bfloat16, None))
    assert not contract.refusals


@pytest.mark.parametrize("contract", ["sm100"], indirect=True)
def test_mx_gemm_on_sm100_outside_the_tested_cases_goes_to_the_reference(contract):
    a, b = _mx(64, 256), _mx(48, 256, seed=1)
    bias = torch.randn(48).to(torch.bfloat16)
    for out_dtype, bias_, says in ((torch.float32, None, "float32 output"),
                                   (torch.bfloat16, bias, "bfloat16 output and a bias")):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            out = scaled_gemm(a, b, out_dtype, bias_, name="mx")
        msgs = [str(x.message) for x in w]
        assert len(msgs) == 1 and says in msgs[0] and "high-precision" in msgs[0], msgs
        assert torch.equal(out, fp8.gemm_reference(a, b, out_dtype, bias_))
    assert not contract.calls and not contract.refusals and device.fallbacks == {"mx": 2}


class _Kernels:
    """kernels.py as a CUDA machine would import it, on CPU tensors: the 128-wide block GEMM
    (fp8_gemm) computes what it computes from whatever scale grid it is given, and gemm_mx (when
    present) the MX product from E8M0 decode scales, recorded."""

    def __init__(self, mx=True):
        self.mx_calls, self.block_calls = [], []
        if mx:
            self.gemm_mx = self._gemm_mx

    def fp8_gemm(self, a_data, b_data, a_inv, b_inv, out_dtype, bias, fast_accum=False):
        self.block_calls.append(tuple(a_inv.shape))
        return _read_128_wide(a_data, b_data, a_inv, b_inv, out_dtype, bias)

    def _gemm_mx(self, a_data, a_scale, b_data, b_scale, out_dtype, bias):
        self.mx_calls.append((a_scale.dtype, b_scale.dtype, out_dtype))
        a32 = emulate.fp8_to_float(a_data, a_scale.float().repeat_interleave(32, 1)[:, : a_data.shape[1]])
        b32 = emulate.fp8_to_float(b_data, b_scale.float().repeat_interleave(32, 1)[:, : b_data.shape[1]])
        k = a32.shape[1]
        out = sum(a32[:, k0 : k0 + K_STEP] @ b32[:, k0 : k0 + K_STEP].t() for k0 in range(0, k, K_STEP))
        return (out if bias is None else out + bias.float()).to(out_dtype)


@pytest.mark.parametrize("contract", NOT_SM100, indirect=True)
@pytest.mark.parametrize("triton", ["gemm_mx", "no-gemm_mx", "no-kernels"])
def test_mx_gemm_elsewhere_never_meets_a_128_wide_path(contract, triton, monkeypatch):
    # Every 128-wide path is open here where the device has it: torch's 1x128 modes (h100), the
    # row-wise loop (h100-no-native-block, sm89 with rows), kernels.fp8_gemm (when "kernels.py
    # imports"). An MX pair must reach none of them: the numbers would be off by orders of
    # magnitude (_mx), not by rounding. It runs on kernels.gemm_mx, else on the reference.
    kern = _Kernels(mx=triton == "gemm_mx")
    monkeypatch.setattr(device, "_triton_available", lambda dev: triton != "no-kernels")
    monkeypatch.setattr(device, "_kernels", lambda: kern)
    a, b = _mx(130, 512), _mx(48, 512, seed=1)
    for out_dtype, bias in ((torch.bfloat16, None), (torch.float32, torch.randn(48).bfloat16())):
        device._warned.clear()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            out = scaled_gemm(a, b, out_dtype, bias, name="mx")
        want = fp8.gemm_reference(a, b, out_dtype, bias)
        assert torch.equal(out, want)
        misread = _read_128_wide(a.data, b.data, a.inv_scale, b.inv_scale, out_dtype, bias)
        assert sqnr(want.double(), misread.double()) < 10  # (what a 128-wide path would give)
        msgs = [str(x.message) for x in w]
        alt = "the Triton MX GEMM (kernels.gemm_mx)" if triton == "gemm_mx" else "high-precision"
        assert len(msgs) == 1 and alt in msgs[0] and "compute capability 10.0" in msgs[0], msgs
    assert not contract.calls and not contract.refusals and not kern.block_calls
    assert kern.mx_calls == ([(E8M0, E8M0, torch.bfloat16), (E8M0, E8M0, torch.float32)]
                             if triton == "gemm_mx" else [])
    assert device.fallbacks == ({} if triton == "gemm_mx" else {"mx": 2})


@pytest.mark.parametrize("triton", [True, False])
def test_backend_triton_sends_mx_to_gemm_mx_only(triton, monkeypatch):
    kern = _Kernels(mx=triton)
    monkeypatch.setattr(device, "_kernels", lambda: kern)
    monkeypatch.setattr(device, "_triton_available", lambda dev: True)
    device._warned.clear()
    device.fallbacks.clear()
    a, b = _mx(64, 256), _mx(48, 256, seed=1)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = scaled_gemm(a, b, torch.float32, backend="triton", name="mx")
    assert torch.equal(out, fp8.gemm_reference(a, b, torch.float32, None)) and not kern.block_calls
    msgs = [str(x.message) for x in w]
    if triton:  # the kernel of backend="triton" for MX: not a fallback
        assert kern.mx_calls == [(E8M0, E8M0, torch.float32)] and not msgs and not device.fallbacks
    else:
        assert len(msgs) == 1 and "no MX GEMM" in msgs[0] and device.fallbacks == {"mx": 1}, msgs


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_an_mx_operand_with_a_1x128_one_is_refused_in_one_line(backend):
    mx = _mx(64, 256)
    blk = quantize(torch.randn(48, 256), E4M3, "block", (1, 128))
    for a, b in ((mx, blk), (blk, _mx(48, 256))):
        with pytest.raises(ValueError) as e:
            scaled_gemm(a, b, torch.float32, backend=backend)
        msg = str(e.value)
        assert "\n" not in msg and "MX operand" in msg and "fp8_recipe=mxfp8" in msg, msg


@pytest.mark.parametrize("contract", ["sm100", "h100"], indirect=True)
def test_mxfp8_layer_under_the_stand_in_matches_emulate(contract):
    # the mxfp8 preset, forward and backward under bf16 autocast: SM100 runs the forward (bf16
    # out) natively and names what does not run there (dgrad and wgrad write fp32); the H100 and
    # its neighbours run none of them natively.
    def run(backend):
        torch.manual_seed(0)
        layer = convert_to_fp8(nn.Linear(256, 192, bias=False), dataclasses.replace(RECIPES["mxfp8"], backend=backend))
        x = (torch.randn(2, 80, 256) * 3).requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
        y.float().square().sum().backward()
        return y, x.grad, layer.weight.grad

    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = run("torch")
    for g, want in zip(got, run("emulate")):
        assert torch.equal(g, want)
    assert not contract.refusals
    assert [c[:2] + c[4:5] for c in contract.calls] == \
        ([] if contract.sm[0] == 9 else [("1x32", "1x32", torch.bfloat16)])  # the forward
    msgs = [str(x.message) for x in w if "nanofp8" in str(x.message)]
    assert msgs and all("high-precision" in m for m in msgs), msgs
