"""Tests of kernels.gemm_mx (the MXFP8 GEMM on tl.dot_scaled), run in the Triton interpreter.

The contract (kernels.reference_gemm_mx): dequantize both operands to fp32, which is exact (an fp8
value times 2^k, k in [-127, 127], lands on fp32's grid, subnormals included, unless it overflows),
then multiply in fp32. Products of two such values are exact in fp32 too, so where every product
of an output element is an integer multiple of one power of two and their sum stays below 2^24 of
it, the fp32 sum is EXACT in any order: the kernel must then equal the reference bit for bit, and
the float64 product as well. The adversarial cases below are built that way; each also checks that
swapping the scales of two blocks changes the answer, so a kernel that read a wrong scale fails.
Random data differ from the reference in fp32 summation order only (numpy vs torch): <= 1e-6.

Where the interpreter runs dot_scaled: triton 3.9's does (InterpreterBuilder.create_dot_scaled,
fp32 dequantize and np.matmul). triton 3.6's does not: tl.dot_scaled fails in semantic.py
("'str' object has no attribute 'value'") and the builder has no create_dot_scaled; gemm_mx
refuses it in one line. The compiled kernel: tests/test_mx_compile.py (sm_100 and sm_90).
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

if not kernels._interpreter_has_dot_scaled():
    pytest.skip(f"triton {kernels.triton.__version__}'s interpreter has no dot_scaled", allow_module_level=True)

E4M3, E5M2, E8M0 = torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu


def e8m0(k):
    """E8M0 bytes of the exponents k (an integer tensor): 2^k. Not torch's float -> e8m0 cast,
    which rounds up (3.0 -> 4.0)."""
    return (k + 127).to(torch.uint8).view(E8M0)


def ints(shape, gen, lo=-8, hi=8):
    """Small integers, exact in E4M3 (up to 16), as E4M3."""
    return torch.randint(lo, hi + 1, shape, generator=gen).float().to(E4M3)


def exact_f64(a, sa, b, sb, bias=None):
    """The true product in float64 (the dequantized operands are exact in float64 too)."""
    deq = lambda d, s: d.double() * s.double().repeat_interleave(32, 1)[:, :d.shape[1]]  # noqa: E731
    out = deq(a, sa) @ deq(b, sb).t()
    return out if bias is None else out + bias.double()


def swap_blocks(s, row, j0, j1):
    """s with the scales of blocks j0 and j1 of one row exchanged."""
    s = s.clone().view(torch.uint8)
    s[row, [j0, j1]] = s[row, [j1, j0]]
    return s.view(E8M0)


def check_exact(a, sa, b, sb, bias=None, out_dtype=torch.float32, swap=(0, 0, 1), vs_f64=True):
    """gemm_mx == reference_gemm_mx bit for bit (and == float64 when vs_f64), and the reference
    with two of a's block scales swapped differs from it (the check has teeth)."""
    out = kernels.gemm_mx(a, sa, b, sb, out_dtype, bias)
    ref = kernels.reference_gemm_mx(a, sa, b, sb, bias)
    assert out.dtype == out_dtype and out.shape == (a.shape[0], b.shape[0])
    torch.testing.assert_close(out, ref.to(out_dtype), rtol=0, atol=0, equal_nan=True)
    if vs_f64:
        torch.testing.assert_close(ref.double(), exact_f64(a, sa, b, sb, bias), rtol=0, atol=0)
    wrong = kernels.reference_gemm_mx(a, swap_blocks(sa, *swap), b, sb, bias)
    assert not torch.equal(wrong.to(out_dtype), out), "swapping two block scales goes unseen"
    return out


@pytest.mark.parametrize("M,N,K", [(70, 50, 160), (1, 3, 64), (130, 65, 288)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_ragged_shapes_exact(M, N, K, out_dtype):
    # ragged M and N (not multiples of the 64x64 tile), K tails inside the 128-wide K step,
    # data of both signs, scales 2^-2 .. 2^2 (products: multiples of 2^-4 up to 2^10, 288 of them:
    # exact), a bias; bf16 output: the fp32 result rounded to nearest even
    g = torch.Generator().manual_seed(M + N + K)
    a, b = ints((M, K), g), ints((N, K), g)
    ka, kb = torch.randint(-2, 3, (M, K // 32), generator=g), torch.randint(-2, 3, (N, K // 32), generator=g)
    ka[0, :2] = torch.tensor([2, -2])  # what the swap check moves
    bias = torch.randint(-100, 100, (N,), generator=g).float()
    check_exact(a, e8m0(ka), b, e8m0(kb), bias, out_dtype)


def test_blocks_2_to_the_40_apart():
    # Along K, a's blocks alternate 2^20 and 2^-20 (2^40 apart), every value positive: the small
    # blocks' products (at most 2^-20 * 64 * 160 in all) are below half an ulp of any partial sum
    # that holds a big product (>= 2^20), so the fp32 sum is the big blocks' sum exactly, in any
    # order. The float64 truth keeps the small part: the SQNR says how little it is.
    # Across rows, a's rows are also 2^40 apart (2^20 and 2^-20 for all of a row's blocks).
    g = torch.Generator().manual_seed(1)
    M, N, K = 66, 40, 320
    a, b = ints((M, K), g, 1, 8), ints((N, K), g, 1, 8)
    ka = torch.where(torch.arange(K // 32) % 2 == 0, 20, -20).repeat(M, 1)
    ka[M // 2:] = torch.where(torch.arange(M - M // 2) % 2 == 0, 20, -20)[:, None]  # rows apart
    sa, sb = e8m0(ka), e8m0(torch.zeros(N, K // 32, dtype=torch.long))
    out = check_exact(a, sa, b, sb, vs_f64=False)
    truth = exact_f64(a, sa, b, sb)
    a_big = a.clone()
    a_big.view(torch.uint8)[:M // 2].view(M // 2, -1, 32)[:, 1::2] = 0  # the 2^-20 blocks
    big = exact_f64(a_big, sa, b, sb)
    assert torch.equal(out[:M // 2].double(), big[:M // 2])  # the small blocks vanish exactly
    assert (truth[:M // 2] != big[:M // 2]).all()  # (they are not zero)
    assert torch.equal(out[M // 2:].double(), truth[M // 2:])  # one scale a row: exact
    assert kernels.sqnr(truth, out) > 200


def test_all_zero_blocks():
    # The MX rule gives an all-zero block the scale 2^-127; a zero block can also sit under a huge
    # scale (2^127, b's side). Zero rows of a and zero rows of b give zero outputs (plus bias).
    g = torch.Generator().manual_seed(2)
    M, N, K = 40, 36, 256
    a, b = ints((M, K), g), ints((N, K), g)
    ka, kb = torch.randint(-2, 3, (M, K // 32), generator=g), torch.randint(-2, 3, (N, K // 32), generator=g)
    a.view(torch.uint8)[:, 64:96] = 0  # block 2 of every row of a
    ka[:, 2] = -127
    ka[0, :2] = torch.tensor([2, -2])  # what the swap check moves
    a.view(torch.uint8)[5] = 0  # a whole row
    ka[5] = -127
    b.view(torch.uint8)[::3, 160:192] = 0  # block 5 of every third row of b, under 2^127
    kb[::3, 5] = 127
    b.view(torch.uint8)[7] = 0
    kb[7] = 127
    bias = torch.arange(N).float()
    out = check_exact(a, e8m0(ka), b, e8m0(kb), bias, swap=(0, 0, 1))
    assert torch.equal(out[5], bias) and torch.equal(out[:, 7], torch.full((M,), 7.0))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy, on purpose
def test_extreme_exponents():
    # 2^-127 (E8M0's byte 0; in fp32 a subnormal) and 2^127 (byte 254), paired so that products
    # stay finite: per block j, (k_a, k_b) is (-127, 127), (127, -127), (-100, 100) or (0, 0).
    # Under a 2^127 scale data must stay below 2 (448 * 2^127 overflows), so those blocks hold
    # values in [-1.75, 1.75] (multiples of 1/4): products are multiples of 2^-2 up to 2^6, exact sums.
    g = torch.Generator().manual_seed(3)
    M, N, K = 48, 40, 256
    pattern = torch.tensor([[-127, 127], [127, -127], [-100, 100], [0, 0]])[torch.arange(K // 32) % 4]
    ka, kb = pattern[:, 0].repeat(M, 1), pattern[:, 1].repeat(N, 1)
    halves = lambda shape: (torch.randint(-7, 8, shape, generator=g) / 4).to(E4M3)  # noqa: E731
    a, b = ints((M, K), g), ints((N, K), g)
    for j in range(K // 32):
        cols = slice(32 * j, 32 * j + 32)
        if pattern[j, 0] == 127:
            a[:, cols] = halves((M, 32))
        if pattern[j, 1] == 127:
            b[:, cols] = halves((N, 32))
    out = check_exact(a, e8m0(ka), b, e8m0(kb), swap=(0, 0, 3))
    assert torch.isfinite(out).all()
    # where products do overflow (1.75 * 2^127 times 1.75 * 2^127, in one output only) the
    # result is inf, as in the reference; the rest is untouched
    a2, b2 = a.clone(), b.clone()
    a2[:, 32:64], b2[0, 32:64] = torch.tensor(0.0).to(E4M3), torch.tensor(1.75).to(E4M3)
    a2[0, 32:64] = torch.tensor(1.75).to(E4M3)
    kb2 = kb.clone()
    kb2[0, 1] = 127
    out2 = kernels.gemm_mx(a2, e8m0(ka), b2, e8m0(kb2), torch.float32)
    inf = torch.zeros(M, N, dtype=torch.bool)
    inf[0, 0] = True
    assert torch.equal(out2 == float("inf"), inf) and torch.isfinite(out2[~inf]).all()
    torch.testing.assert_close(out2, kernels.reference_gemm_mx(a2, e8m0(ka), b2, e8m0(kb2)), rtol=0, atol=0)


def test_e4m3_subnormals():
    # E4M3 subnormals m * 2^-9 (m = 1..7) and the smallest normals, under scales 2^-2 .. 2^9 and
    # 2^-127 (a subnormal times 2^-127 is 2^-136 and smaller: still exact in fp32, whose
    # subnormals reach 2^-149). Products are multiples of 2^-18 * 2^-127 * ... : per row of a the
    # scale is one exponent (a 2^9 row has one block at 2^8), so an output element's products are
    # multiples of one power of two (>= 2^-145 on the 2^-127 rows: fp32 subnormals, still exact).
    g = torch.Generator().manual_seed(4)
    M, N, K = 40, 33, 192
    sub = torch.tensor([m * 2.0**-9 for m in range(-7, 8)] + [2.0**-6, -(2.0**-6), 1.125 * 2**-6])
    a = sub[torch.randint(0, len(sub), (M, K), generator=g)].to(E4M3)
    b = sub[torch.randint(0, len(sub), (N, K), generator=g)].to(E4M3)
    assert (a.float().abs() < 2.0**-6).float().mean() > 0.5  # mostly subnormals
    ka = torch.tensor([-2, 9, -127, 0])[torch.arange(M) % 4][:, None].repeat(1, K // 32)
    kb = torch.zeros(N, K // 32, dtype=torch.long)
    ka[1::4, 1] = 8  # a block of a 2^9 row at 2^8: the swap check below moves it
    out = check_exact(a, e8m0(ka), b, e8m0(kb), swap=(1, 0, 1))
    assert (out[2::4] != 0).any() and out[2::4].abs().max() < 2.0**-126  # fp32 subnormal outputs


def test_nan_scale_and_nan_data_propagate():
    # E8M0's byte 255 is NaN: that row's outputs are NaN, never a silent finite number; so is an
    # E4M3 NaN (0x7F) in b. Everything else is exact.
    g = torch.Generator().manual_seed(5)
    M, N, K = 20, 18, 96
    a, b = ints((M, K), g), ints((N, K), g)
    sa, sb = e8m0(torch.zeros(M, K // 32, dtype=torch.long)), e8m0(torch.zeros(N, K // 32, dtype=torch.long))
    sa.view(torch.uint8)[3, 1] = 255
    b.view(torch.uint8)[4, 10] = 0x7F
    out = kernels.gemm_mx(a, sa, b, sb, torch.float32)
    nan = torch.zeros(M, N, dtype=torch.bool)
    nan[3, :], nan[:, 4] = True, True
    assert torch.equal(out.isnan(), nan)
    torch.testing.assert_close(out, kernels.reference_gemm_mx(a, sa, b, sb), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("K", [100, 96])
def test_k_not_a_multiple_of_32_and_unaligned_operands(K):
    # K = 100: 4 scales a row, the operands zero-padded to 128 inside gemm_mx. a starts 1 byte
    # into its storage (TMA needs 16-byte aligned rows: at K = 96 it is copied). e5m2 x e4m3.
    g = torch.Generator().manual_seed(K)
    M, N = 33, 17
    a = ints((M * K + 1,), g)[1:].view(M, K)
    assert a.data_ptr() % 16 != 0
    b = ints((N, K), g).float().to(E5M2)
    nk = -(-K // 32)
    ka, kb = torch.randint(-2, 3, (M, nk), generator=g), torch.randint(-2, 3, (N, nk), generator=g)
    ka[0, 0], ka[0, -1] = 2, -2
    check_exact(a, e8m0(ka), b, e8m0(kb), swap=(0, 0, nk - 1))


def test_random_mx_operands_vs_fp32_and_float64():
    # Gaussians of very different magnitudes per block, cast by the OCP rule (kernels.mx_operand):
    # the only difference left is fp32 summation order.
    g = torch.Generator().manual_seed(7)
    M, N, K = 65, 96, 256
    x = torch.randn(M, K, generator=g) * torch.exp2(torch.randint(-30, 30, (M, K // 32), generator=g).float()).repeat_interleave(32, 1)
    w = torch.randn(N, K, generator=g)
    (a, sa), (b, sb) = kernels.mx_operand(x), kernels.mx_operand(w)
    out = kernels.gemm_mx(a, sa, b, sb, torch.float32)
    ref = kernels.reference_gemm_mx(a, sa, b, sb)
    rel = ((out - ref).abs() / ref.abs().amax(dim=1, keepdim=True)).max().item()
    assert rel < 1e-6, rel
    assert kernels.sqnr(exact_f64(a, sa, b, sb), out) > 120
    # a misread scale (block 0 of row 0 of a, under the next one's) is caught by the same bounds
    wrong = kernels.reference_gemm_mx(a, swap_blocks(sa, 0, 0, 1), b, sb)
    assert ((wrong - ref).abs() / ref.abs().amax(dim=1, keepdim=True)).max().item() > 1e-6


def test_the_ocp_cast_of_the_self_check():
    # kernels.mx_operand (used by `python kernels.py` and the benchmark): k = floor(log2 amax) - 8
    x = torch.zeros(2, 64)
    x[0, :32] = 0.5
    x[0, 0] = -3.0  # amax 3: k = 1 - 8 = -7, data -384 and 64
    x[0, 32:] = 1.0
    x[0, 32] = 960.0  # amax 960 = 1.875 * 2^9: k = 1, 960 / 2 = 480 saturates to 448 (by design)
    data, s = kernels.mx_operand(x)
    assert s.dtype == E8M0 and s.view(torch.uint8).tolist() == [[120, 128], [0, 0]]  # zero blocks: 2^-127
    want = x.clone()
    want[0, 32] = 896.0
    assert torch.equal(data.float() * s.float().repeat_interleave(32, 1), want)


def test_degenerate_and_bad_input():
    one = e8m0(torch.zeros(3, 1, dtype=torch.long))
    a = torch.ones(3, 32).to(E4M3)
    out = kernels.gemm_mx(a[:, :0], e8m0(torch.zeros(3, 0, dtype=torch.long)), a[:2, :0],
                          e8m0(torch.zeros(2, 0, dtype=torch.long)), torch.float32, torch.ones(2))
    assert torch.equal(out, torch.ones(3, 2))
    cases = [((a.float(), one, a, one), "a_data must be a 2-D float8_e4m3fn or float8_e5m2"),
             ((a, one.float(), a, one), "a_scale must be a float8_e8m0fnu tensor of shape (3, 1)"),
             ((a, one, a, e8m0(torch.zeros(3, 2, dtype=torch.long))), "b_scale must be a float8_e8m0fnu tensor of shape (3, 1)"),
             ((a, one, a[:, :16], one), "contraction dims differ"),
             ((a, one, a, one, torch.int8), "out_dtype must be one of")]
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
            kernels.gemm_mx(*args)
    with pytest.raises(ValueError, match=r"bias must be a tensor of shape \(3,\)"):
        kernels.gemm_mx(a, one, a, one, torch.float32, torch.ones(4))


def test_refuses_an_interpreter_without_dot_scaled(monkeypatch):
    # triton 3.6 (the GPU image's) interprets no dot_scaled: asked for it, one line, not a numpy
    # traceback (by default gemm_mx runs the bf16 kernel there: tests/test_kernels_mx_bf16.py)
    monkeypatch.setattr(kernels, "_interpreter_has_dot_scaled", lambda: False)
    s = e8m0(torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="interpreter has no tl.dot_scaled"):
        kernels.gemm_mx(torch.ones(2, 32).to(E4M3), s, torch.ones(2, 32).to(E4M3), s, method="dot_scaled")


def test_mx_autotuner_keeps_the_gpus_own_tiles(monkeypatch):
    # What the autotuner may run on a GPU is what tests/test_mx_compile.py compiled and checked
    configs = kernels.mx_gemm_configs()
    for major in (9, 10):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, 0))
        kept = kernels._prune_mx_configs(configs, {"c_ptr": torch.empty(1)})
        got = {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_stages, c.num_warps) for c in kept}
        assert got == set(kernels.mx_gemm_tiles(major)) and got


def test_an_mx_fp8tensor_pair_goes_in_as_it_is():
    # How nanofp8 calls it: an MX Fp8Tensor q (fp8.quantize with the mxfp8 preset's rule) gives
    # q.data and mx.mx_scales(q) (its decode scales); the result is fp8.gemm_reference's. And the
    # self-check's cast (kernels.mx_operand) is the training cast, byte for byte.
    from nanofp8 import fp8, mx
    g = torch.Generator().manual_seed(8)
    M, N, K = 70, 40, 200  # K: 6.25 blocks of 32 (a partial last block)
    x = torch.randn(M, K, generator=g) * torch.exp2(torch.randint(-30, 30, (M, 1), generator=g).float())
    x[3, 64:96] = 0.0  # an all-zero block: k = -127
    w = torch.randn(N, K, generator=g)
    bias = torch.randn(N, generator=g)
    xq, wq = (fp8.quantize(t, fp8.E4M3, "block", (1, mx.MX_BLOCK), scale_rule=mx.mx_scale) for t in (x, w))
    assert mx.is_mx(xq) and mx.is_mx(wq)
    out = kernels.gemm_mx(xq.data, mx.mx_scales(xq), wq.data, mx.mx_scales(wq), torch.float32, bias)
    ref = fp8.gemm_reference(xq, wq, torch.float32, bias)
    assert ((out - ref).abs() / ref.abs().amax(dim=1, keepdim=True)).max() < 1e-6
    for t, q in ((x, xq), (w, wq)):
        data, s = kernels.mx_operand(t)
        assert torch.equal(data.view(torch.uint8), q.data.view(torch.uint8))
        assert torch.equal(s.view(torch.uint8), mx.mx_scales(q).view(torch.uint8))
