"""Tests of the CPU emulation (nanofp8/emulate.py): the same bits as fp8.py's plain torch code,
torch's float8 conversions and torch's CPU kernel.

On a CPU, emulate.py decodes FP8 with integer and fp16 operations (fp8_to_float), casts without
isfinite/where when every amax is finite, and computes torch._scaled_mm's CPU arithmetic itself.
Each must give the very bits of the slow path it replaces, on adversarial inputs; the references
here are torch's own conversions (and ml_dtypes), and the GEMM references use the same fp32 matmul
call, so no test depends on which CPU kernel the machine has."""

import ml_dtypes
import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nanofp8 import emulate, fp8
from nanofp8.emulate import fp8_to_float
from nanofp8.fp8 import E4M3, E5M2, quantize, scaled_gemm

FORMATS = [E4M3, E5M2]
ML = {E4M3.name: ml_dtypes.float8_e4m3fn, E5M2.name: ml_dtypes.float8_e5m2}
GRANS = [("tensor", (1, 128)), ("row", (1, 128)), ("block", (1, 128)), ("block", (128, 128))]


def bits(t):
    return t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.uint8)


def assert_same_bits(a, b):
    """Bit for bit, except that a NaN only has to be a NaN: which NaN (sign, payload) a float
    conversion or multiply returns differs between torch's vectorized and scalar loops, so it
    depends on the machine's vector width and on where a tensor's tail falls."""
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.is_floating_point() and a.element_size() > 1:
        assert torch.equal(a.isnan(), b.isnan())
        a, b = torch.where(a.isnan(), 0.0, a), torch.where(b.isnan(), 0.0, b)
    assert torch.equal(bits(a), bits(b))


# -- decoding ------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_fp8_to_float_every_code(fmt):
    codes = torch.arange(256, dtype=torch.uint8).view(fmt.dtype)
    assert_same_bits(fp8_to_float(codes), codes.float())  # NaN codes too
    ref = codes.view(torch.uint8).numpy().view(ML[fmt.name]).astype(np.float32)
    assert np.array_equal(fp8_to_float(codes).numpy(), ref, equal_nan=True)
    # a 2-D transposed view (the GEMM operands' layout) and a multiplier (the dequant scales)
    grid = codes.reshape(16, 16).t()
    assert_same_bits(fp8_to_float(grid), grid.float())
    for times in [torch.tensor(3.0e-5), torch.tensor(2.0**-140), torch.tensor(7.0e37),
                  torch.tensor(1.0e37), torch.linspace(1e-30, 1e30, 16).reshape(16, 1)]:
        assert_same_bits(fp8_to_float(grid, times), grid.float() * times)
    # without NaN codes E4M3 takes the short path (no NaN repair): every other code, each sign
    finite = codes[(codes.view(torch.uint8) & 0x7F) != 0x7F].reshape(-1, 2)
    for times in [None, torch.tensor(3.0e-5), torch.tensor(7.0e37), torch.rand(len(finite), 1)]:
        assert_same_bits(fp8_to_float(finite, times), finite.float() if times is None else finite.float() * times)
    assert fp8_to_float(codes[:0], torch.tensor(2.0)).shape == (0,)
    half = torch.randn(4, 8).half()  # dist.py keeps fp16 data in Fp8Tensor containers too
    assert_same_bits(fp8_to_float(half, torch.tensor(3.0)), half.float() * 3.0)


# -- the cast ------------------------------------------------------------------------


def old_cast(x2, scale_el, fmt):
    """The cast as fp8.py wrote it before the CPU shortcut (and still writes it elsewhere)."""
    y = x2.float() * scale_el
    return torch.where(torch.isfinite(x2), y.clamp(-fmt.max, fmt.max), torch.nan).to(fmt.dtype)


def adversarial(fmt, seed=0):
    """Finite values that stress rounding: every FP8 value and the ties between them, at many
    scales; values one fp32 ulp around every power of two; subnormals; the range's edges; -0.0."""
    grid = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).float()
    grid = grid[torch.isfinite(grid)].unique()
    ties = (grid[1:] + grid[:-1]) / 2
    p2 = torch.exp2(torch.arange(-149, 128, dtype=torch.float32))
    around = torch.cat([p2, torch.nextafter(p2, torch.zeros(())), torch.nextafter(p2, torch.full((), 1e38))])
    edges = torch.tensor([fmt.max, fmt.max * 1.0001, fmt.max * 1.1, 2 * fmt.max, 3.4e38, fmt.min_normal,
                          fmt.min_normal * (1 - 2**-10), 448.0, 464.0, 480.0, 57344.0, 61440.0, 65536.0,
                          -0.0, 0.0, 1e-45, 2.0**-9, 2.0**-10, 2.0**-16, 2.0**-17, 1.5 * 2.0**-17])
    g = torch.Generator().manual_seed(seed)
    fuzz = torch.randn(1_000_000, generator=g) * torch.exp2(torch.randint(-40, 40, (1_000_000,), generator=g).float())
    x = torch.cat([grid, ties, grid * 2.0**-20, ties * 2.0**-20, grid * 2.0**20, ties * 2.0**20, around, edges])
    x = torch.cat([x, -x, fuzz])
    x = torch.cat([x, torch.zeros((-len(x)) % 256)]).reshape(-1, 256)
    x[1::7] *= 1e6  # rows 1e6 apart
    x[3::7] *= 1e-6
    return x.clamp(-3.4e38, 3.4e38)  # the 1e6 rows overflowed the largest values


class WhereCounter(TorchDispatchMode):
    """Counts the elementwise isfinite/where calls over tensors of `numel` elements."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.calls = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in ("isfinite", "where") and any(getattr(a, "numel", lambda: 0)() == self.numel for a in args):
            self.calls += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("gran,block", GRANS, ids=lambda v: str(v))
def test_cast_bit_exact_against_the_old_cast_and_ml_dtypes(fmt, gran, block):
    x = adversarial(fmt)
    with WhereCounter(x.numel()) as counter:
        q = emulate.quantize(x, fmt, gran, block)
    assert counter.calls == 0  # every amax finite: the shortcut ran
    plain = quantize(x, fmt, gran, block)  # fp8.py's cast, the lesson's
    assert_same_bits(q.data, plain.data)
    assert_same_bits(q.scale, plain.scale)
    el = fp8.expand_tiles(q.scale, q.block, x.shape) if gran == "block" else q.scale
    assert_same_bits(q.data, old_cast(x, el, fmt))
    y = np.clip((x.double() * el.double()).float().double().numpy(), -fmt.max, fmt.max)
    assert np.array_equal(q.data.view(torch.uint8).numpy(), y.astype(ML[fmt.name]).view(np.uint8))
    # a given scale (delayed scaling) that saturates: still the old cast's bits
    q = quantize(x, fmt, "tensor", scale=torch.tensor(1e3))
    assert_same_bits(q.data, old_cast(x, torch.tensor(1e3), fmt))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("gran,block", GRANS, ids=lambda v: str(v))
def test_cast_keeps_nonfinite_visible(fmt, gran, block):
    x = adversarial(fmt)[:512].clone()
    x[5, 7], x[200, 3], x[300, 100], x[301, 0] = float("nan"), float("inf"), -float("inf"), -float("nan")
    q = emulate.quantize(x, fmt, gran, block)
    el = fp8.expand_tiles(q.scale, q.block, x.shape) if gran == "block" else q.scale
    assert_same_bits(q.data, old_cast(x, el, fmt))
    assert torch.equal(torch.isnan(q.data.float()), ~torch.isfinite(x))  # NaN exactly where x was not finite
    assert torch.isfinite(q.scale).all()  # a NaN amax never becomes a scale


# -- the GEMM ------------------------------------------------------------------------


def kernel_formula(a, b, out_dtype, bias):
    """torch._scaled_mm's CPU arithmetic (aten/src/ATen/native/Blas.cpp) with torch's own
    conversions, and bias as fp8.gemm_scaled_mm hands it over."""
    a32 = a.data.float() * a.inv_scale
    b32 = b.data.t().contiguous().float() * b.inv_scale
    out = a32 @ b32
    return (out if bias is None else out + bias.to(out_dtype)).to(out_dtype)


def operands(fa, fb, m=96, n=80, k=160, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-8, 8, (m, 1), generator=g).float())
    w = torch.randn(n, k, generator=g) * 1e-3
    return quantize(x, fa), quantize(w, fb), torch.randn(n, generator=g)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fa,fb", [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)], ids=lambda f: f.name)
def test_cpu_gemm_is_the_kernel_arithmetic(fa, fb, out_dtype):
    a, b, bias = operands(fa, fb)
    for bb in (None, bias):
        assert_same_bits(scaled_gemm(a, b, out_dtype, bb), kernel_formula(a, b, out_dtype, bb))
    # a NaN operand row (from a non-finite input) makes its output row NaN, as in the kernel
    x = torch.randn(8, 160)
    x[2, 5] = float("inf")
    qx = quantize(x, fa)
    out = scaled_gemm(qx, b, out_dtype)
    assert torch.isnan(out[2]).all() and torch.isfinite(out[[0, 1, 3]]).all()


@pytest.mark.parametrize("fa,fb", [(E4M3, E4M3), (E5M2, E4M3)], ids=lambda f: f.name)
def test_cpu_gemm_equals_torch_scaled_mm_on_exact_arithmetic(fa, fb):
    # FP8 values times powers of two, small K: every product and partial sum is exact in fp32,
    # so any kernel (the emulated one, oneDNN on AMX CPUs) gives these bits
    g = torch.Generator().manual_seed(3)
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid) & (grid.abs() <= 16) & (grid.abs() >= 2**-3)]
    pick = lambda *s: grid[torch.randint(len(grid), s, generator=g)]
    a = quantize(pick(32, 48), fa, scale=torch.tensor(4.0))
    b = quantize(pick(16, 48), fb, scale=torch.tensor(0.5))
    ref = torch._scaled_mm(a.data, b.data.t(), scale_a=a.inv_scale, scale_b=b.inv_scale, out_dtype=torch.float32)
    assert_same_bits(scaled_gemm(a, b, torch.float32), ref)


@pytest.mark.parametrize("gran,block", GRANS[1:3], ids=lambda v: str(v))
def test_cpu_emulate_path_unchanged(gran, block, monkeypatch):
    # row and block scales: the fp32 reference, with the fast decode == with torch's conversion
    x, w = torch.randn(64, 256), torch.randn(48, 256)
    a, b = quantize(x, E5M2, gran, block), quantize(w, E4M3, gran, block if gran != "block" else (128, 128))
    fast = scaled_gemm(a, b, torch.float32)
    assert_same_bits(fast, scaled_gemm(a, b, torch.float32, backend="cpu"))
    assert_same_bits(fast, scaled_gemm(a, b, torch.float32, backend="emulate"))  # the plain reference
    monkeypatch.setattr(emulate, "handles", lambda t: False)  # torch's conversions everywhere
    assert_same_bits(fast, scaled_gemm(a, b, torch.float32, backend="cpu"))


# -- the amax of each tensor (the non-finite checks) -----------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_amax_each_is_the_inf_norm(dtype):
    # aminmax per tensor on a CPU, torch's inf-norm elsewhere: the same values, NaN and inf too
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(7, 5, generator=g) * 1e3, -torch.rand(33, generator=g), torch.zeros(4, 4), -torch.zeros(3),
          torch.tensor([1.0, float("nan"), -2.0]), torch.tensor([[1.0, -float("inf")]]), torch.tensor(-3.5),
          torch.tensor([2.0, float("inf"), float("nan")]), torch.randn(3, 4, generator=g).t() * 1e-6]
    xs = [x.to(dtype) for x in xs]
    got, ref = emulate.amax_each(xs), torch._foreach_norm(xs, float("inf"))
    for a, b in zip(got, ref):
        assert a.dtype == b.dtype and a.shape == ()
        assert_same_bits(a.reshape(1), b.reshape(1))
    assert emulate.amax_each([]) == [] and emulate.amax_each([torch.empty(0, 3)])[0].item() == 0.0


def test_cpu_has_no_fp32_output_bf16_gemm():
    # bench.py's throughput report says why the emulation multiplies in fp32 and not in bf16: a
    # bf16 GEMM rounds its fp32 sum to bf16 before the scales, and torch has no CPU GEMM of bf16
    # inputs with an fp32 result. If a torch release adds one, this fails: use it, and reword.
    a = torch.ones(4, 4, dtype=torch.bfloat16)
    with pytest.raises((RuntimeError, NotImplementedError, TypeError)):
        torch.mm(a, a, out_dtype=torch.float32)


def test_cpu_transpose_is_a_view_and_multiplies_the_same():
    # Fp8Tensor.t() on a CPU hands back a view of the same bytes (the emulated GEMM reads it in its
    # original layout); as either GEMM operand it gives the bits a contiguous copy gives
    x, w = operands(E4M3, E4M3)[:2]
    xt, wt = x.t(), w.t()
    assert xt.data.data_ptr() == x.data.data_ptr()
    assert torch.equal(xt.data.view(torch.uint8), x.data.t().view(torch.uint8))
    copy = lambda q: fp8.Fp8Tensor(q.data.contiguous(), q.scale, q.fmt, q.granularity, q.block, q.shape, q.dtype)
    dy = quantize(torch.randn(96, 80, generator=torch.Generator().manual_seed(5)), E5M2)
    for a, b in [(dy.t(), xt), (dy, wt)]:  # wgrad (a transposed view first) and dgrad (second)
        assert_same_bits(scaled_gemm(a, b, torch.float32), scaled_gemm(copy(a), copy(b), torch.float32))


@pytest.mark.parametrize("shape", [(256, 384, 128), (200, 384, 130), (128, 256, 256), (96, 160, 200)])
def test_block_tiles_whole_and_ragged_match_the_reference(shape):
    # the CPU twin multiplies whole tiles through a reshape and ragged edges element by element:
    # the reference's bits either way, for the forward, dgrad and wgrad operand layouts
    m, k, n = shape
    g = torch.Generator().manual_seed(m + k + n)
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-9, 9, (m, 1), generator=g).float())
    w = torch.randn(n, k, generator=g)
    for fmt in FORMATS:
        qx, qw = emulate.quantize(x, fmt, "block", (1, 128)), emulate.quantize(w, E4M3, "block", (128, 128))
        plain_x, plain_w = quantize(x, fmt, "block", (1, 128)), quantize(w, E4M3, "block", (128, 128))
        assert_same_bits(qx.data, plain_x.data)
        assert_same_bits(qw.data, plain_w.data)
        for a, b in [(qx, qw), (qx, qw.t().t())]:
            assert_same_bits(scaled_gemm(a, b, torch.float32, backend="cpu"),
                             scaled_gemm(a, b, torch.float32, backend="emulate"))
        wt = qw.t()  # dgrad: dy (m, n) @ [W^T (k, n)]^T, W^T a transposed view of 128x128 tiles
        dy = emulate.quantize(torch.randn(m, n, generator=g), fmt, "block", (1, 128))
        assert_same_bits(scaled_gemm(dy, wt, torch.float32, backend="cpu"),
                         scaled_gemm(dy, wt, torch.float32, backend="emulate"))
        assert_same_bits(emulate._scaled(wt), fp8._scaled(wt))
