"""Tests of kernels.py (Triton FP8 quantizers and GEMM), run on CPU in the Triton interpreter.

What holds, and is checked here:
* quantize / quantize_transpose are bit-exact (same fp8 bytes, same fp32 scales) with
  nanofp8.fp8.quantize and with the small torch reference below, special values included.
* fp8_gemm: products of fp8 values are exact in fp32, so with power-of-two scales and operands
  whose partial sums are small integers the result is EXACT (any summation order), and a bf16
  output equals the fp32 reference rounded to nearest even. With random data the only
  difference left is fp32 summation order: relative error <= 1e-6, SQNR > 120 dB.
* backend="triton" of nanofp8.fp8 casts on these quantizers (a tensor-scaled cast writes the
  transpose for the backward GEMMs in the same pass) and saves the same FP8 bytes as the torch
  casts; a kernels.py that cannot be imported is an error that says why.
* kernels.py is standalone (torch and triton only): its copies of the format constants, the amax
  floor, the block size, sqnr and its plain-torch references equal nanofp8's, and its self-check
  (`python kernels.py`) passes.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton / kernels are imported (conftest sets it too)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import importlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
import kernels  # noqa: E402

if not kernels.INTERPRET:  # imported earlier without the interpreter (by another test file)
    kernels = importlib.reload(kernels)

fp8 = pytest.importorskip("nanofp8.fp8")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FMT = {E4M3: fp8.E4M3, E5M2: fp8.E5M2}
GRANS = [("tensor", (1, 128)), ("row", (1, 128)), ("block", (1, 128)), ("block", (128, 128))]


def ref_quantize(x, dtype, gran, block=(1, 128), margin=0, pow2=False):
    """The contract in plain torch: kernels.reference_quantize (what `python kernels.py` checks
    against; test_reference_is_nanofp8 below holds it to nanofp8.fp8.quantize, bit for bit)."""
    return kernels.reference_quantize(x, dtype, gran, block, margin, pow2)


def assert_same_quant(got, want):
    (d, s), (rd, rs) = got, want
    assert d.dtype == rd.dtype and d.shape == rd.shape and s.shape == rs.shape and s.dtype == torch.float32
    bad = (d.view(torch.uint8) != rd.view(torch.uint8)).sum().item()
    assert bad == 0, f"{bad} fp8 bytes differ"
    assert torch.equal(s, rs), f"scales differ: {s} vs {rs}"


def special_input(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-12, 12, shape, generator=g).float())
    flat = x.view(-1)
    flat[::37] = 0.0
    flat[5::41] = -0.0
    flat[7::53] *= 1e6  # a few outliers per tile
    return x.to(dtype)


# (the inner loop, -m "not slow", keeps one format per case; CI runs them all)
IN_SLOW = pytest.mark.slow


@pytest.mark.parametrize("dtype", [E4M3, pytest.param(E5M2, marks=IN_SLOW)])
@pytest.mark.parametrize("gran,block", GRANS)
def test_quantize_bit_exact(dtype, gran, block):
    for i, (shape, xdt, margin, pow2) in enumerate([((65, 200), torch.float32, 0, False),
                                                   ((300, 129), torch.bfloat16, 0, True),
                                                   ((2, 33, 160), torch.float16, 3, False),
                                                   ((1, 7), torch.float32, 1, True),
                                                   ((130, 256), torch.bfloat16, 0, False)]):
        x = special_input(shape, xdt, seed=i)
        got = kernels.quantize(x, dtype, gran, block, margin=margin, power_of_two=pow2)
        assert_same_quant(got, ref_quantize(x, dtype, gran, block, margin, pow2))
        # (the kernels cast a GEMM operand (M, K): a 3-D x is its tokens, not a batch of matrices)
        q = fp8.quantize(x.reshape(-1, x.shape[-1]), FMT[dtype], gran, block, margin=margin, power_of_two=pow2)
        assert_same_quant(got, (q.data, q.scale))


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("gran,block", GRANS)
def test_quantize_special_values(dtype, gran, block):
    x = special_input((40, 256), seed=7)
    x[0, :4] = torch.tensor([float("inf"), -float("inf"), float("nan"), 1.0])  # row 0 tile 0: bad amax
    x[1] = 0.0  # all-zero row: amax 0 -> scale fp8_max / 1e-12
    x[2] = 1e-14  # amax below the 1e-12 floor
    x[3, :128] = 3.0e38  # near fp32 max
    x[4, 128:] = torch.nan  # a whole NaN tile
    got = kernels.quantize(x, dtype, gran, block)
    assert_same_quant(got, ref_quantize(x, dtype, gran, block))
    q = fp8.quantize(x, FMT[dtype], gran, block)
    assert_same_quant(got, (q.data, q.scale))
    data, scale = got
    assert torch.isnan(data[0, :3].float()).all() and torch.isfinite(scale).all()


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_round_to_nearest_even_and_subnormals(dtype):
    """amax = fp8_max makes the scale exactly 1: the kernel's rounding is then visible
    directly. Midpoints between grid values, subnormals and values below the smallest
    subnormal (flush to +-0, sign kept) must match torch's cast bit for bit."""
    fmax = FMT[dtype].max
    grid = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    grid = grid[torch.isfinite(grid)].unique()
    mids = (grid[1:] + grid[:-1]) / 2  # exact ties: round half to even
    x = torch.cat([torch.tensor([fmax]), grid, mids, mids.nextafter(torch.tensor(float("inf"))),
                   mids.nextafter(torch.tensor(-float("inf"))), torch.tensor([2.0**-20, -2.0**-20, -0.0])])
    data, scale = kernels.quantize(x, dtype, "tensor")
    assert scale.item() == 1.0
    assert torch.equal(data.view(torch.uint8).view(-1), x.to(dtype).view(torch.uint8))


def test_power_of_two_scale_at_binade_edges():
    """amax = fp8_max * 2^-k and its fp32 neighbours: the power-of-two scale is 2^floor(log2).
    Row granularity gives each candidate amax its own row, so one launch checks them all."""
    for dtype in (E4M3, E5M2):
        edge = torch.tensor(FMT[dtype].max) * torch.exp2(torch.arange(-40, 40).float())
        amax = torch.cat([edge, edge.nextafter(edge * 2), edge.nextafter(edge / 2)])
        x = torch.stack([amax, amax / 3], dim=1)
        for margin in (0, 2):
            got = kernels.quantize(x, dtype, "row", power_of_two=True, margin=margin)
            assert_same_quant(got, ref_quantize(x, dtype, "row", margin=margin, pow2=True))


def test_quantize_transpose():
    # (300, 600): more tiles than programs in pass 2, and a looping pass 1
    for dtype, shape in ((E4M3, (70, 200)), (E5M2, (300, 600))):
        x = special_input(shape, torch.bfloat16, seed=3)
        if dtype == E4M3:
            x[5, 9] = float("inf")  # scale falls back to 1.0; the inf becomes NaN in both copies
        data, data_t, scale = kernels.quantize_transpose(x, dtype, margin=1)
        assert_same_quant((data, scale), ref_quantize(x, dtype, "tensor", margin=1))
        assert data_t.shape == shape[::-1] and data_t.is_contiguous()
        assert torch.equal(data_t.view(torch.uint8), data.t().view(torch.uint8))


# -----------------------------------------------------------------------------
# GEMM


ref_gemm = kernels.reference_gemm  # dequantize to fp32, sum per 128-slice of K
sqnr = fp8.sqnr


def pow2_scales(kind, rows, K, gen, lo=-6, hi=2):
    kb = -(-K // 128)
    shape = {"tensor": (), "row": (rows, 1), "tile": (rows, kb), "block": (-(-rows // 128), kb)}[kind]
    return torch.exp2(torch.randint(lo, hi + 1, shape, generator=gen).float())


SCALINGS = [("tensor", "tensor"), ("row", "row"), ("tensor", "row"), ("tile", "block"), ("tile", "tile")]
SHAPES = [(65, 96, 200), (1, 16, 128), (33, 17, 16), (200, 136, 272)]  # K=200, N=17: no TMA


@pytest.mark.parametrize("fa,fb", [(E4M3, E4M3), pytest.param(E5M2, E4M3, marks=IN_SLOW),
                                   pytest.param(E4M3, E5M2, marks=IN_SLOW)])
@pytest.mark.parametrize("ka,kb", SCALINGS)
def test_gemm_exact(fa, fb, ka, kb):
    """Small-integer fp8 operands and power-of-two scales: every partial sum is exact in fp32,
    so the kernel must match the reference exactly, TMA path and pointer path alike."""
    gen = torch.Generator().manual_seed(0)
    for i, (M, N, K) in enumerate(SHAPES):
        a = torch.randint(-8, 9, (M, K), generator=gen).float().to(fa)
        b = torch.randint(-8, 9, (N, K), generator=gen).float().to(fb)
        sa, sb = pow2_scales(ka, M, K, gen), pow2_scales(kb, N, K, gen)
        bias = torch.randint(-100, 100, (N,), generator=gen).float().to(torch.bfloat16) if i % 2 else None
        ref = ref_gemm(a, b, sa, sb, bias)
        # rotate through (output dtype, TMA descriptors or pointers) to keep the test quick
        out_dtype, use_tma = [(torch.float32, None), (torch.bfloat16, False),
                              (torch.bfloat16, None), (torch.float32, False)][(i + len(ka)) % 4]
        out = kernels.fp8_gemm(a, b, sa, sb, out_dtype, bias, use_tma=use_tma)
        assert out.dtype == out_dtype and out.shape == (M, N)
        assert torch.equal(out, ref.to(out_dtype)), (M, N, K, out_dtype, use_tma)


@pytest.mark.parametrize("fa", [E4M3, E5M2])
@pytest.mark.parametrize("gran,ba,bb", [("tensor", None, None), ("row", None, None),
                                        ("block", (1, 128), (128, 128)), ("block", (1, 128), (1, 128))])
def test_gemm_random_vs_fp32(fa, gran, ba, bb, capsys):
    """Random data quantized by nanofp8 (arbitrary, non-power-of-two scales), through
    fp8.scaled_gemm(backend='triton') and directly: fp32 summation order is the only difference."""
    torch.manual_seed(1)
    for M, N, K in [(100, 160, 304)]:  # ragged tiles in M, N and K, TMA-aligned rows
        x, w, bias = torch.randn(M, K) * 3, torch.randn(N, K) * 0.02, torch.randn(N)
        a = fp8.quantize(x, FMT[fa], gran, ba or (1, 128))
        b = fp8.quantize(w, fp8.E4M3, gran, bb or (1, 128))
        ref = ref_gemm(a.data, b.data, a.inv_scale, b.inv_scale, bias)
        for fast in (False, True) if gran == "tensor" else (False,):
            out = kernels.fp8_gemm(a.data, b.data, a.inv_scale, b.inv_scale, torch.float32, bias,
                                   fast_accum=fast)
            rel = ((out - ref).abs().max() / ref.abs().max()).item()
            assert rel < 1e-6 and sqnr(ref, out) > 120, (rel, sqnr(ref, out))
        via_fp8 = fp8.scaled_gemm(a, b, torch.bfloat16, bias, backend="triton")
        emul = fp8.scaled_gemm(a, b, torch.bfloat16, bias, backend="emulate")
        # bf16 output: the rounded reference, but where fp32 summation order differs (~1e-7 of
        # the largest output) the rounding of a bf16 value can flip by one unit (<= 2^-7 relative)
        tol = emul.float().abs() * 2**-7 + 1e-6 * emul.float().abs().max()
        assert ((via_fp8.float() - emul.float()).abs() <= tol).all()
        q_sqnr = sqnr(x @ w.t() + bias, out)  # the quantization error itself, for the record
        assert q_sqnr > (24 if fa == E4M3 else 18)
        with capsys.disabled():
            print(f"\n  {fa} {gran} {ba} {bb} M,N,K={M},{N},{K}: rel err {rel:.1e}, SQNR vs fp32 "
                  f"reference {sqnr(ref, out):.0f} dB, vs unquantized fp32 GEMM {q_sqnr:.1f} dB", end="")


def test_gemm_degenerate_k():
    a, b = torch.zeros(3, 0, dtype=E4M3), torch.zeros(5, 0, dtype=E4M3)
    one = torch.tensor(1.0)
    out = kernels.fp8_gemm(a, b, one, one, torch.float32, torch.arange(5.0))
    assert torch.equal(out, torch.arange(5.0).expand(3, 5))


def test_errors():
    a, b, one = torch.zeros(64, 256, dtype=E4M3), torch.zeros(32, 256, dtype=E4M3), torch.tensor(1.0)
    with pytest.raises(ValueError, match="float8"):
        kernels.fp8_gemm(a.float(), b, one, one, torch.float32)
    with pytest.raises(ValueError, match="contraction"):
        kernels.fp8_gemm(a, b[:, :128], one, one, torch.float32)
    with pytest.raises(ValueError, match="b_inv_scale has shape"):
        kernels.fp8_gemm(a, b, one, torch.ones(7, 2), torch.float32)
    with pytest.raises(ValueError, match="out_dtype"):
        kernels.fp8_gemm(a, b, one, one, E4M3)
    with pytest.raises(ValueError, match="bias"):
        kernels.fp8_gemm(a, b, one, one, torch.float32, bias=torch.zeros(64))
    with pytest.raises(ValueError, match="use_tma"):
        kernels.fp8_gemm(a[:, :200], b[:, :200], one, one, torch.float32, use_tma=True)
    x = torch.randn(8, 128)
    with pytest.raises(ValueError, match="granularity"):
        kernels.quantize(x, E4M3, "channel")
    with pytest.raises(ValueError, match="fmt_dtype"):
        kernels.quantize(x, torch.float8_e4m3fnuz, "tensor")
    with pytest.raises(ValueError, match="float32"):
        kernels.quantize(x.to(torch.int32), E4M3, "tensor")
    with pytest.raises(ValueError, match="shape"):
        kernels.quantize(torch.zeros(0, 4), E4M3, "tensor")
    with pytest.raises(ValueError, match="block"):
        kernels.quantize(x, E4M3, "block", (1, 100))
    interp, kernels.INTERPRET = kernels.INTERPRET, False
    try:
        with pytest.raises(ValueError, match="CUDA"):
            kernels.quantize(x, E4M3, "tensor")
    finally:
        kernels.INTERPRET = interp


@pytest.mark.parametrize("gran", list(fp8.GRANULARITIES))
def test_fp8_linear_with_triton_backend(gran):
    """The whole layer (forward, dgrad, wgrad) on the Triton kernels agrees with the reference."""
    from nanofp8.fp8 import Recipe, convert_to_fp8

    outs = []
    for backend in ("triton", "emulate"):
        torch.manual_seed(0)
        layer = convert_to_fp8(torch.nn.Linear(200, 144), Recipe(granularity=gran, backend=backend))
        x = torch.randn(3, 40, 200, requires_grad=True)
        y = layer(x)
        y.backward(torch.randn_like(y))
        outs.append((y.detach(), x.grad, layer.weight.grad, layer.bias.grad))
    for a, b in zip(*outs):
        assert sqnr(b, a) > 120  # fp32 summation order is the only difference


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("gran,block", GRANS)
def test_negative_values_that_round_to_zero_are_minus_zero(dtype, gran, block):
    # -0.0 and negatives below half the smallest subnormal must be stored as -0 (0x80), as torch's
    # cast does. (Triton 3.6 compiled `-tl.abs(r)` as `0 - x`, which gives +0: kernels.py
    # multiplies by -1 instead, and the sm_90 compile test checks the PTX for it.)
    fmax = FMT[dtype].max
    row = torch.tensor([fmax, -0.0, -1e-30, -1e-12, 0.0, 1e-30, -fmax / 2**40, 1.0] * 20)  # 160 wide
    x = row.repeat(3, 1)
    data, _ = kernels.quantize(x, dtype, gran, block)
    bytes_ = data.view(torch.uint8)
    for col, want in ((1, 0x80), (2, 0x80), (3, 0x80), (4, 0x00), (5, 0x00), (6, 0x80)):
        assert (bytes_[:, col] == want).all(), (col, bytes_[0, col].item())
    assert_same_quant((data, _), ref_quantize(x, dtype, gran, block))


def test_no_float_negation_in_jitted_code():
    # Triton 3.6 compiles a unary minus on a float tensor as `0 - x` (PTX sub.f32), which maps
    # -0.0 to +0.0; triton 3.9 emits neg.f32. Checked by hand with triton 3.6.0 for sm_90:
    # `-tl.abs(r)` -> sub.f32, `tl.abs(r) * -1.0` -> neg.f32. CI runs 3.9 only, so kernels.py
    # is held to the form both compile right: no unary minus in @triton.jit code except on
    # literals and constexprs (ALL_CAPS names, folded by Python before triton sees them).
    import ast

    tree = ast.parse(open(os.path.join(ROOT, "kernels.py")).read())
    bad = []
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in fn.decorator_list):
            for node in ast.walk(fn):
                if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
                    v = node.operand
                    if not (isinstance(v, ast.Constant) or (isinstance(v, ast.Name) and v.id.isupper())):
                        bad.append(f"{fn.name}: {ast.unparse(node)}")
    assert not bad, bad


# -----------------------------------------------------------------------------
# The launch heuristic (kernels.gemm_plan) and every configuration family it can pick


VARIANTS = [(ob, tma, fast, blockwise, both) for ob in (2, 4) for tma in (True, False)
            for fast, blockwise, both in ((True, False, False), (False, False, False), (False, True, False),
                                          (False, True, True))]


def test_plan_picks_small_tiles_or_split_k_where_big_tiles_leave_sms_idle():
    # An H100/H200 has 132 SMs. GPT-2 124M's attention projection (8192 x 768 x 768): 128x256 tiles
    # make 192 work items, 1.45 rounds of 132 (73% of SM time busy): a smaller tile
    big = max(t[0] * t[1] for t in kernels._TILES_16BIT)
    for fast in (False, True):
        plan = kernels.gemm_plan(8192, 768, 768, 132, 2, True, fast)
        assert all(c.block_m * c.block_n < big or c.split_k > 1 for c in plan), plan
        # 8192^3: the biggest tile the variant compiles without spills, K unsplit
        plan = kernels.gemm_plan(8192, 8192, 8192, 132, 2, True, fast)
        tiles = kernels.hopper_gemm_tiles(2, True, fast, False)
        assert {c[:4] for c in plan} == {t for t in tiles if t[0] * t[1] == max(u[0] * u[1] for u in tiles)}
        assert all(c.split_k == 1 for c in plan)
    assert {c[:2] for c in kernels.gemm_plan(8192, 8192, 8192, 132, 2, True, True)} == {(128, 256), (256, 128)}
    # the weight gradient of that projection (768 x 768, K = 8192 tokens): 36 tiles of 128x128 for
    # 132 SMs, so K is split, into the fewest slices that keep 80% of the SMs busy
    plan = kernels.gemm_plan(768, 768, 8192, 132, 4, True, False)
    assert {c.split_k for c in plan} == {3}, plan
    for c in plan:
        assert kernels.sm_fill(6 * 6 * 3 if c.block_m == 128 else 12 * 6 * 3, 132) >= kernels.FILL


@pytest.mark.parametrize("num_sms", [4, 132])
def test_plan_is_small_compiled_and_fills_the_sms(num_sms):
    """Every plan: one or two configs of one tile size and one split_k, tiles the sm_90 compile test
    checked for that variant (fp32 tiles when split, as the partial sums are fp32), split only on
    the TMA path with >= MIN_K_TILES K steps a slice, and the SMs kept busy unless nothing does."""
    sizes = (1, 64, 200, 768, 2304, 8192)
    for (ob, tma, fast, blockwise, both) in VARIANTS:
        for M in sizes:
            for N in sizes:
                for K in (16, 768, 8192):
                    plan = kernels.gemm_plan(M, N, K, num_sms, ob, tma, fast, blockwise, both)
                    assert 1 <= len(plan) <= 2 and len({c.block_m * c.block_n for c in plan}) == 1, plan
                    split = plan[0].split_k
                    assert {c.split_k for c in plan} == {split}
                    tiles = kernels.hopper_gemm_tiles(4 if split > 1 else ob, tma, fast, blockwise, both)
                    assert all(c[:4] in tiles for c in plan), (plan, tiles)
                    k_tiles = -(-K // 128)
                    assert split == 1 or (tma and -(-k_tiles // split) >= kernels.MIN_K_TILES)
                    items = lambda c, s: -(-M // c[0]) * -(-N // c[1]) * s  # noqa: E731
                    if all(kernels.sm_fill(items(c, split), num_sms) < kernels.FILL for c in plan):
                        # then no tile fills them at any split the heuristic may use
                        for s in range(1, (max(1, k_tiles // kernels.MIN_K_TILES) if tma else 1) + 1):
                            for t in kernels.hopper_gemm_tiles(4 if s > 1 else ob, tma, fast, blockwise, both):
                                assert kernels.sm_fill(items(t, s), num_sms) < kernels.FILL


def test_plan_is_made_once_per_shape(monkeypatch):
    # planning (and on a GPU, timing the candidates) happens at a shape's first call only: every
    # later call is a dictionary lookup, as a small GEMM's launch is bound by host time
    calls = []
    plan = kernels.gemm_plan
    monkeypatch.setattr(kernels, "gemm_plan", lambda *args: calls.append(args) or plan(*args))
    monkeypatch.setattr(kernels, "_CHOSEN_CONFIGS", {})
    a, one = torch.ones(40, 256).to(E4M3), torch.tensor(1.0)
    for _ in range(3):
        assert torch.equal(kernels.fp8_gemm(a, a[:24], one, one, torch.float32), torch.full((40, 24), 256.0))
    kernels.fp8_gemm(a, a[:24], one, one, torch.float32, fast_accum=True)  # another variant: planned
    assert len(calls) == 2, calls


def config_families():
    """(config, use_tma): every tile of the tables, unsplit and split in 2 and 5 slices on the TMA
    path; the pointer path's tile unsplit. Stages and warps do not change what the interpreter
    computes (the sm_90 compile test checks each table entry). (The inner loop skips split 2.)"""
    tma_tiles = sorted({t[:2] for t in kernels._TILES_16BIT + kernels._TILES_FP32})
    return ([pytest.param(kernels.GemmConfig(bm, bn, 2, 4, s), True, marks=IN_SLOW if s == 2 else ())
             for bm, bn in tma_tiles for s in (1, 2, 5)]
            + [(kernels.GemmConfig(*t), False) for t in kernels._TILES_POINTER])


@pytest.mark.parametrize("config,use_tma", config_families(), ids=lambda v: str(tuple(v)) if isinstance(v, tuple) else str(v))
def test_every_config_family_is_exact(config, use_tma):
    """Small-integer operands, power-of-two scales: every partial sum is exact in fp32, so each tile
    and each split of K equals the reference bit for bit, with tensor, row, 1x128 and 128x128 scales
    (2^-2 .. 2^1: products are multiples of 2^-4 below 2^8, their sums below 2^18: exact).
    M, N ragged for every tile; 6 K steps, so 5 slices leave some empty."""
    gen = torch.Generator().manual_seed(config.block_m + config.block_n + config.split_k)
    M, N, K = 70, 72, 688 if use_tma else 680
    a = torch.randint(-8, 9, (M, K), generator=gen).float().to(E4M3)
    b = torch.randint(-8, 9, (N, K), generator=gen).float().to(E5M2)
    for i, (ka, kb) in enumerate(SCALINGS):
        sa, sb = pow2_scales(ka, M, K, gen, -2, 1), pow2_scales(kb, N, K, gen, -2, 1)
        bias = torch.randint(-100, 100, (N,), generator=gen).float().to(torch.bfloat16) if i % 2 else None
        out_dtype = (torch.float32, torch.bfloat16)[i % 2]
        out = kernels.fp8_gemm(a, b, sa, sb, out_dtype, bias, use_tma=use_tma, config=config,
                               fast_accum=ka == "tensor")
        assert torch.equal(out, ref_gemm(a, b, sa, sb, bias).to(out_dtype)), (config, ka, kb)


@pytest.mark.parametrize("ka,kb", [("tensor", "tensor"), ("row", "row"), ("tile", "block")])
def test_split_k_within_the_derived_bound(ka, kb):
    """Random fp8 operands (every exponent) and power-of-two scales: each product is exact in fp32,
    so any order of fp32 sums of n_k = ceil(K/128) slice sums of 128 products each is within
    gamma(127 + n_k - 1) * sum|a_k b_k| of the exact value, gamma(j) = j u / (1 - j u), u = 2^-24
    (each product goes through at most that many roundings). Unsplit and split in 2 and 3 alike."""
    gen = torch.Generator().manual_seed(11)
    M, N, K = 96, 80, 1008
    a = (torch.randn(M, K, generator=gen) * 64).to(E4M3)
    b = (torch.randn(N, K, generator=gen) * 64).to(E4M3)
    sa, sb = pow2_scales(ka, M, K, gen), pow2_scales(kb, N, K, gen)
    deq = lambda d, s: kernels.reference_gemm(d, torch.eye(K).to(E4M3), s, torch.tensor(1.0)).double()  # noqa: E731
    a64, b64 = deq(a, sa), deq(b, sb)
    exact, absum = a64 @ b64.t(), a64.abs() @ b64.abs().t()
    j = 127 + (-(-K // 128)) - 1
    gamma = j * 2.0**-24 / (1 - j * 2.0**-24)
    bound = gamma * absum + K * 2.0**-52 * absum  # (+ the float64 product's own rounding)
    outs = []
    for split in (1, 2, 3):
        out = kernels.fp8_gemm(a, b, sa, sb, torch.float32, config=kernels.GemmConfig(128, 128, 2, 4, split))
        assert ((out.double() - exact).abs() <= bound).all(), split
        outs.append(out)
    assert sqnr(exact, outs[2]) > 120


# -----------------------------------------------------------------------------
# kernels.py standalone, and the triton backend of nanofp8.fp8


def test_kernels_imports_only_torch_and_triton():
    import ast

    tree = ast.parse(open(os.path.join(ROOT, "kernels.py")).read())
    roots = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    roots |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert roots <= {"os", "sys", "typing", "torch", "triton", "argparse", "datetime", "json", "time"}, roots
    assert "sys.path" not in open(os.path.join(ROOT, "kernels.py")).read()


def test_constants_are_nanofp8s():
    """kernels.py keeps its own copies (it imports nothing from nanofp8): they must be the same."""
    for dtype, (fmax, mbits, emin) in kernels.FP8_FORMATS.items():
        fi = torch.finfo(dtype)
        assert fmax == FMT[dtype].max == fi.max
        assert 2.0**emin == FMT[dtype].min_normal == fi.smallest_normal
        assert 2.0**-mbits == fi.eps
    assert set(kernels.FP8_FORMATS) == {f.dtype for f in (fp8.E4M3, fp8.E5M2)}
    assert kernels.KBLOCK == fp8.BLOCK and kernels.AMAX_EPS.value == fp8.AMAX_EPS
    g = torch.Generator().manual_seed(0)
    for scale in (1.0, 1e-30, 1e30):
        ref = torch.randn(257, generator=g) * scale
        x = ref + torch.randn(257, generator=g) * scale * 1e-3
        assert kernels.sqnr(ref, x) == fp8.sqnr(ref, x)
    assert kernels.sqnr(ref, ref) == fp8.sqnr(ref, ref) == float("inf")


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("gran,block", GRANS)
def test_reference_is_nanofp8(dtype, gran, block):
    """kernels.reference_quantize (the self-check's and these tests' contract) is
    nanofp8.fp8.quantize, bit for bit; reference_gemm is fp8.scaled_gemm's fp32 reference (exact
    here: integer-valued products with power-of-two scales, so no summation order matters)."""
    x = special_input((70, 300), seed=4)
    x[3, :2] = torch.tensor([float("inf"), float("nan")])
    for margin, pow2 in ((0, False), (2, True)):
        q = fp8.quantize(x, FMT[dtype], gran, block, margin=margin, power_of_two=pow2)
        assert_same_quant(ref_quantize(x, dtype, gran, block, margin, pow2), (q.data, q.scale))
    g = torch.Generator().manual_seed(1)
    a = fp8.quantize(torch.randint(-8, 9, (33, 300), generator=g).float(), FMT[dtype], gran, (1, 128),
                     power_of_two=True)
    b = fp8.quantize(torch.randint(-8, 9, (48, 300), generator=g).float(), fp8.E4M3, gran, block,
                     power_of_two=True)
    bias = torch.randn(48, generator=g)
    want = fp8.scaled_gemm(a, b, torch.float32, bias, backend="emulate")
    assert torch.equal(ref_gemm(a.data, b.data, a.inv_scale, b.inv_scale, bias), want)


@pytest.mark.slow  # `python kernels.py` repeats, in one run, what the tests above check
def test_self_check_passes(capsys):
    """`python kernels.py` on a machine without a GPU: quantizers and GEMM against the references."""
    assert kernels._self_check("cpu")
    out = capsys.readouterr().out
    assert "correctness: OK" in out and "bit-exact: False" not in out


@pytest.mark.parametrize("gran,casts", [("tensor", {"quantize_transpose": 3}), ("row", {"quantize": 6}),
                                        ("block", {"quantize": 5})])
def test_triton_backend_casts_on_the_kernels(gran, casts, monkeypatch):
    """backend="triton" runs the layer's casts on kernels.py's quantizers. Tensor scaling: x, W and
    dy once each, every cast writing the transpose its backward GEMM reads in the same pass
    (nothing re-quantized, no separate transpose). Row: x, W, dy and their re-quantized
    transposes. Block: the same less W^T (a 128x128 grid transposes). The FP8 operands saved for
    backward are the torch casts' bytes, adversarial inputs included."""
    calls = {}

    def counted(name):
        real = getattr(kernels, name)

        def wrapper(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return real(*args, **kwargs)
        return wrapper

    for name in ("quantize", "quantize_transpose"):
        monkeypatch.setattr(kernels, name, counted(name))
    saved = {}
    for backend in ("triton", "emulate"):
        calls.clear()
        torch.manual_seed(0)
        layer = fp8.convert_to_fp8(torch.nn.Linear(200, 144), fp8.Recipe(granularity=gran, backend=backend))
        x = special_input((3, 40, 200), seed=5).requires_grad_()
        packed = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
            y = layer(x)
        y.backward(special_input(tuple(y.shape), seed=6))
        saved[backend] = [t for t in packed if t.dtype in (E4M3, E5M2)]
        assert torch.isfinite(layer.weight.grad).all() and torch.isfinite(x.grad).all()
        if backend == "triton":
            assert calls == casts
    assert calls == {}  # the torch path never calls the kernels
    assert len(saved["triton"]) == len(saved["emulate"]) == 2  # x^T and W^T
    for got, want in zip(saved["triton"], saved["emulate"]):
        assert got.shape == want.shape and torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_triton_backend_says_why_kernels_do_not_import(monkeypatch):
    import sys

    from nanofp8 import device

    a = fp8.quantize(torch.randn(16, 128), fp8.E4M3)
    monkeypatch.setitem(sys.modules, "kernels", None)  # as if run from outside the repo root
    with pytest.raises(ImportError, match="kernels.py from the repo root .* not on sys.path"):
        fp8.scaled_gemm(a, a, torch.float32, backend="triton")
    assert not device._triton_available(torch.device("cuda"))  # backend="torch" falls back elsewhere
    monkeypatch.delitem(sys.modules, "kernels")
    monkeypatch.setitem(sys.modules, "triton", None)  # triton not installed
    with pytest.raises(ImportError, match="kernels.py needs the `triton` package"):
        fp8.scaled_gemm(a, a, torch.float32, backend="triton")




def test_tma_allocator_is_set_at_every_launch():
    """Triton keeps its allocator per thread, and autograd runs the backward GEMMs in a thread of
    its own: every launch sets it (to kernels.tma_scratch, a module-level function). Under
    torch.compile the launch runs inside the custom op nanofp8::fp8_gemm, at run time, in whichever
    thread runs the graph, so dynamo never meets triton.set_allocator (torch 2.11's breaks the
    graph there: tests/test_compile.py checks the op is what the graph holds)."""
    import inspect

    import kernels

    assert "triton.set_allocator(tma_scratch)" in inspect.getsource(kernels._launch_fp8_gemm)
