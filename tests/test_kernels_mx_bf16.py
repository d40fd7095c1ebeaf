"""Tests of gemm_mx(method="bf16"), Hopper's MX GEMM (kernels._mx_gemm_bf16_kernel), in the Triton
interpreter (any triton: this path needs no tl.dot_scaled).

The kernel dequantizes each fp8 tile while loading: x * 2^(byte - 127) in fp32 (exact for every
E8M0 byte 0..254), rounded to bf16, then a bf16 tl.dot with fp32 sums. bf16 holds every such value
except those below 2^-126 that are not multiples of 2^-133: an fp8 value x under byte b is exact
iff x is a multiple of 2^(-6 - b), so always for bytes >= 3 (E4M3) and >= 10 (E5M2). The contract
(kernels.reference_gemm_mx_bf16): reference_gemm_mx of the operands rounded to bf16, equal to
reference_gemm_mx itself where nothing rounds. Where every product of an output is a multiple of
one power of two and their sum stays within 2^24 of it, fp32 sums are exact in any order: the
tests below build such operands, for every byte 0..254, so they can ask for bit equality.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton / kernels are imported (conftest sets it too)

import importlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
import kernels  # noqa: E402

if not kernels.INTERPRET:  # imported earlier without the interpreter (by another test file)
    kernels = importlib.reload(kernels)

E4M3, E5M2, E8M0 = torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu


def e8m0_bytes(b):
    return b.to(torch.uint8).view(E8M0)


def exact_f64(a, sa, b, sb):
    """The true product in float64 (every dequantized value and product is exact there)."""
    deq = lambda d, s: d.double() * s.double().repeat_interleave(32, 1)[:, :d.shape[1]]  # noqa: E731
    return deq(a, sa) @ deq(b, sb).t()


def every_code_operand(fmt, K, gen):
    """(data, scales) of 255 rows, row r under E8M0 byte r in all its blocks. Rows with byte <= 127
    hold integers in [-8, 8]; rows with a larger scale hold the format's subnormals m * 2^-9 (E4M3)
    or m * 2^-16 (E5M2), so that 7 * 2^-9 * 2^127 * 2 * K stays finite. Every value is a multiple of
    2^(-6 - byte), hence exact in bf16 after scaling."""
    rows = torch.arange(255)
    ints = torch.randint(-8, 9, (255, K), generator=gen).float()
    small = torch.randint(-7 if fmt == E4M3 else -3, 8 if fmt == E4M3 else 4, (255, K), generator=gen).float()
    small = small * 2.0 ** (-9 if fmt == E4M3 else -16)
    data = torch.where((rows > 127)[:, None], small, ints).to(fmt)
    assert torch.equal(data.float(), torch.where((rows > 127)[:, None], small, ints))  # on fmt's grid
    return data, e8m0_bytes(rows[:, None].repeat(1, K // 32))


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_every_e8m0_code_exact(fmt):
    # a's rows take every byte 0..254 against b under 2^0 with integers in [-2, 2], and the other way
    # round: each output's products are multiples of one power of two (2^(byte - 127) or 2^(byte -
    # 136) / 2^(byte - 143)) and sum to at most 2^10 of it, so fp32 is exact, and the kernel must
    # equal reference_gemm_mx and the float64 product bit for bit, byte 0 (2^-127) included
    gen = torch.Generator().manual_seed(0 if fmt == E4M3 else 1)
    K = 64
    data, scales = every_code_operand(fmt, K, gen)
    other = torch.randint(-2, 3, (9, K), generator=gen).float().to(E4M3)
    one = e8m0_bytes(torch.full((9, K // 32), 127))
    for a, sa, b, sb in ((data, scales, other, one), (other, one, data, scales)):
        out = kernels.gemm_mx(a, sa, b, sb, torch.float32, method="bf16")
        ref = kernels.reference_gemm_mx(a, sa, b, sb)
        assert torch.equal(out, ref) and torch.equal(out.double(), exact_f64(a, sa, b, sb))
        assert torch.isfinite(out).all() and (out != 0).float().mean() > 0.9
        # teeth: one scale of one row read one byte off changes that row
        wrong = sa.view(torch.uint8).clone()
        wrong[0, 0] += 1
        assert not torch.equal(kernels.reference_gemm_mx(a, wrong.view(E8M0), b, sb), out)
    # byte 0 is 2^-127, not zero (tl.dot_scaled's own upcast on sm_90 reads it as zero)
    assert (kernels.gemm_mx(data[:1], scales[:1], other, one, torch.float32, method="bf16") != 0).any()


@pytest.mark.parametrize("fmt,first_exact", [(E4M3, 3), (E5M2, 10)])
def test_subnormals_under_the_lowest_codes_round_to_the_bf16_grid(fmt, first_exact):
    # the fp8 subnormals m * 2^-9 (E4M3) / m * 2^-16 (E5M2) under bytes 0 .. first_exact: below
    # first_exact some scaled values fall off bf16's 2^-133 grid and round to nearest even on it, as
    # reference_gemm_mx_bf16 says, so they differ from reference_gemm_mx; from first_exact on, none do
    gen = torch.Generator().manual_seed(2)
    K, step, mmax = 64, (2.0**-9 if fmt == E4M3 else 2.0**-16), (7 if fmt == E4M3 else 3)
    codes = torch.arange(first_exact + 1)
    a = (torch.randint(-mmax, mmax + 1, (len(codes), K), generator=gen).float() * step).to(fmt)
    a[:, 0] = torch.tensor(step).to(fmt)  # the smallest subnormal in every row
    sa = e8m0_bytes(codes[:, None].repeat(1, K // 32))
    b = torch.randint(-1, 2, (5, K), generator=gen).float().to(E4M3)
    sb = e8m0_bytes(torch.full((5, K // 32), 254))  # 2^127 (b's +-1 stay finite): normal products
    out = kernels.gemm_mx(a, sa, b, sb, torch.float32, method="bf16")
    assert torch.equal(out, kernels.reference_gemm_mx_bf16(a, sa, b, sb))
    exact = kernels.reference_gemm_mx(a, sa, b, sb)
    assert torch.equal(exact.double(), exact_f64(a, sa, b, sb))
    assert not torch.equal(out[:first_exact], exact[:first_exact])  # rounding happened below
    assert torch.equal(out[first_exact], exact[first_exact])  # and not from first_exact on
    # each rounded value moved by at most half of 2^-133, times |b| <= 1 under 2^127, K times
    assert ((out - exact).abs() <= K * 2.0**-134 * 2.0**127).all()


def test_nan_scale_and_nan_data_propagate():
    # E8M0 byte 255 is NaN (not inf: 255 << 23 would be), as an E4M3 NaN in b is
    g = torch.Generator().manual_seed(3)
    a = torch.randint(-8, 9, (20, 96), generator=g).float().to(E4M3)
    b = torch.randint(-8, 9, (18, 96), generator=g).float().to(E4M3)
    sa, sb = e8m0_bytes(torch.full((20, 3), 127)), e8m0_bytes(torch.full((18, 3), 127))
    sa.view(torch.uint8)[3, 1] = 255
    b.view(torch.uint8)[4, 10] = 0x7F
    out = kernels.gemm_mx(a, sa, b, sb, torch.float32, method="bf16")
    nan = torch.zeros(20, 18, dtype=torch.bool)
    nan[3, :], nan[:, 4] = True, True
    assert torch.equal(out.isnan(), nan)
    torch.testing.assert_close(out, kernels.reference_gemm_mx(a, sa, b, sb), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_random_operands_ragged_shapes_bias(out_dtype):
    # the OCP MX cast of Gaussians 2^+-30 apart per block, ragged M, N, K (K % 32 != 0: padded),
    # e5m2 x e4m3 and a bias: every value is exact in bf16 (bytes >= 97 here), so the only
    # difference from reference_gemm_mx is fp32 summation order
    g = torch.Generator().manual_seed(4)
    M, N, K = 70, 45, 200
    x = torch.randn(M, K, generator=g) * torch.exp2(torch.randint(-30, 30, (M, 1), generator=g).float())
    (a, sa), (b, sb) = kernels.mx_operand(x), kernels.mx_operand(torch.randn(N, K, generator=g))
    a = a.float().to(E5M2)  # (E4M3 values round onto E5M2's grid: an e5m2 operand)
    bias = torch.randn(N, generator=g)
    out = kernels.gemm_mx(a, sa, b, sb, out_dtype, bias, method="bf16")
    ref = kernels.reference_gemm_mx(a, sa, b, sb, bias)
    rel = ((out.float() - ref).abs() / ref.abs().amax(dim=1, keepdim=True)).max().item()
    assert rel < (1e-6 if out_dtype == torch.float32 else 2**-8), rel
    if out_dtype == torch.float32:
        assert kernels.sqnr(exact_f64(a, sa, b, sb) + bias.double(), out) > 120


def test_hopper_runs_the_bf16_kernel_and_blackwell_dot_scaled(monkeypatch):
    for major, want in ((9, "bf16"), (10, "dot_scaled"), (12, "dot_scaled")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, 0))
        assert kernels.mx_method(torch.device("cuda")) == want
    monkeypatch.setattr(kernels, "_interpreter_has_dot_scaled", lambda: False)  # triton 3.6
    assert kernels.mx_method(torch.device("cpu")) == "bf16"
    s = e8m0_bytes(torch.full((2, 1), 127))
    x = torch.ones(2, 32).to(E4M3)
    assert torch.equal(kernels.gemm_mx(x, s, x, s, torch.float32), torch.full((2, 2), 32.0))
    with pytest.raises(ValueError, match="method must be None or one of"):
        kernels.gemm_mx(x, s, x, s, method="fp32")
