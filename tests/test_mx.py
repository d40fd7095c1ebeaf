"""MXFP8 (OCP Microscaling): the cast is the OCP rule bit for bit, against two independent
implementations (a per-block reference written here from the spec, and torchao's to_mx), on
adversarial inputs; its scales are E8M0 bytes; the GEMM multiplies exactly what was cast; the
preset reaches every level; the statistics know what the rule clips by design."""

import math

import ml_dtypes
import numpy as np
import pytest
import torch

import train
from nanofp8 import device, emulate
from nanofp8.fp8 import (E4M3, E5M2, RECIPES, Fp8Linear, Recipe, clip_edge, convert_to_fp8, dequantize,
                         expand_tiles, quantize, scaled_gemm, sqnr)
from nanofp8.mx import E8M0, MX_BLOCK, is_mx, mx_scale, mx_scales
from nanofp8.stats import Alarms, Fp8Stats, cast_stats, summarize

ML = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}


def ocp_reference(x, fmt):
    """The OCP MX v1.0 cast, block by block in Python floats: shared exponent
    X = floor(log2(max |v|)) - emax (math.frexp: exact), clamped to E8M0's [-127, 127] (an all-zero
    block: -127); elements v / 2^X, saturated to +-max, rounded to nearest even by ml_dtypes.
    Returns (element bytes, the decode scale's E8M0 byte per block)."""
    emax = math.floor(math.log2(fmt.max))
    rows, cols = x.shape
    nb = -(-cols // MX_BLOCK)
    data = np.zeros((rows, cols), dtype=np.uint8)
    scale = np.zeros((rows, nb), dtype=np.uint8)
    xs = x.double().tolist()
    for r in range(rows):
        for b in range(nb):
            vals = xs[r][b * MX_BLOCK : (b + 1) * MX_BLOCK]
            amax = max(abs(v) for v in vals)
            k = -127 if amax == 0 else min(max(math.frexp(amax)[1] - 1 - emax, -127), 127)
            scale[r, b] = k + 127
            els = [min(max(math.ldexp(v, -k), -fmt.max), fmt.max) for v in vals]
            data[r, b * MX_BLOCK : b * MX_BLOCK + len(vals)] = np.array(els, dtype=ML[fmt.name]).view(np.uint8)
    return torch.from_numpy(data), torch.from_numpy(scale)


def cases():
    """Adversarial inputs, (rows, cols) with cols not always a multiple of 32 (a ragged last block)."""
    g = torch.Generator().manual_seed(0)
    n = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    zeros = n(6, 96)
    zeros[1] = 0
    zeros[2, 32:64] = 0
    spikes = n(8, 128)
    spikes[:, ::32] *= 1e6  # one value per block 10^6 above the rest
    # amax exactly at a power of two, just below one, and at the edges of E4M3's clipping
    edges = torch.tensor([2.0 ** 5, 2.0 ** 5 * (1 - 2 ** -24), 448 * 2.0 ** -3, 464 * 2.0 ** -3, 480 * 2.0 ** -3,
                          511.9 * 2.0 ** -3]).repeat_interleave(MX_BLOCK).reshape(6, MX_BLOCK) * torch.linspace(1, 0.01, MX_BLOCK)
    return {
        "gaussian": n(16, 256),
        "rows 1e-36 to 1e36 apart": n(24, 64) * torch.logspace(-36, 36, 24)[:, None],
        "zero blocks": zeros,
        "fp32 subnormals": n(4, 64) * 1e-40,
        "tiny: E8M0's floor": n(4, 64) * 1e-37,
        "spikes": spikes,
        "powers of two": torch.exp2(torch.randint(-140, 120, (8, 64), generator=g).float()) * n(8, 64).sign(),
        "amax at the rule's edges": edges,
        "ragged: 70 columns": n(5, 70),
        "a single value": n(1, 1),
    }


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_the_mx_cast_is_the_ocp_rule_bit_for_bit(fmt):
    """fp8.quantize with mx_scale, and the CPU fast path (emulate.quantize, what backend "cpu"
    runs), give the reference's element bytes and E8M0 scales exactly, for every case."""
    for name, x in cases().items():
        want_data, want_scale = ocp_reference(x, fmt)
        for path, q in (("fp8.quantize", quantize(x, fmt, "block", (1, MX_BLOCK), scale_rule=mx_scale)),
                        ("emulate.quantize", emulate.quantize(x, fmt, "block", (1, MX_BLOCK), scale_rule=mx_scale))):
            assert is_mx(q) and q.scale.dtype == E8M0, (name, path)
            assert torch.equal(mx_scales(q).view(torch.uint8), want_scale), (name, path)
            assert torch.equal(q.data.view(torch.uint8), want_data), (name, path)
            # the multiply-before-cast scale and the decode scale are exact inverses
            assert torch.equal(q.scale.float() * mx_scales(q).float(), torch.ones_like(q.scale.float())), (name, path)


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_the_mx_cast_matches_torchao(fmt):
    """torchao's MX reference cast (to_mx, FLOOR mode) gives the same bytes and scales. Except at
    E8M0's floor: where a block's exponent clamps to -127, torchao divides by 2^-126 (it floors
    the fp32 scale at the smallest normal) while recording 2^-127, so its values decode to half
    their size; ours (2^127 times the value, exact) decode to the input, as the reference's do."""
    from torchao.prototype.mx_formats.mx_tensor import to_mx  # (requirements.txt: tests only)
    compared = 0
    for name, x in cases().items():
        if x.shape[1] % MX_BLOCK:
            continue  # to_mx takes whole blocks only
        s, d = to_mx(x, fmt.dtype, MX_BLOCK)
        q = quantize(x, fmt, "block", (1, MX_BLOCK), scale_rule=mx_scale)
        ours = mx_scales(q).view(torch.uint8)
        assert torch.equal(ours.reshape(-1), s.view(torch.uint8).reshape(-1)), name
        above_floor = expand_tiles(ours > 0, (1, MX_BLOCK), x.shape)
        assert torch.equal(q.data.view(torch.uint8)[above_floor], d.view(torch.uint8).reshape(x.shape)[above_floor]), name
        compared += int(above_floor.sum())
        at_floor = ~above_floor & (x != 0)
        if at_floor.any():  # where they differ, ours is the right one
            assert sqnr(x[at_floor], dequantize(q)[at_floor]) > {"e4m3": 25, "e5m2": 19}[fmt.name], name
    assert compared > 5_000


def test_zero_and_non_finite_blocks():
    """An all-zero block gets E8M0's smallest scale 2^-127 and stays zero; a block with an inf or
    NaN keeps the project's rule (non-finite becomes NaN, never a finite 448) and a scale of 1,
    never a NaN scale; the blocks beside it are untouched."""
    x = torch.randn(2, 96)
    x[0, :32] = 0
    x[1, 40] = float("inf")
    x[1, 70] = float("nan")
    q = quantize(x, E4M3, "block", (1, MX_BLOCK), scale_rule=mx_scale)
    dec = mx_scales(q).view(torch.uint8)
    assert dec[0, 0] == 0 and (q.data[0, :32].float() == 0).all()  # 2^-127: the E8M0 byte 0
    assert dec[1, 1] == dec[1, 2] == 127  # scale 1
    assert torch.isnan(q.data[1, 40].float()) and torch.isnan(q.data[1, 70].float())
    clean = quantize(x[:, :32].clone().fill_(1.0), E4M3, "block", (1, MX_BLOCK), scale_rule=mx_scale)
    assert torch.equal(q.data[1, :32].view(torch.uint8), quantize(x[1:, :32], E4M3, "block", (1, MX_BLOCK),
                                                                    scale_rule=mx_scale).data[0].view(torch.uint8))
    assert not torch.isnan(clean.scale.float()).any()


def test_the_rule_clips_by_design_and_no_more():
    """With k = floor(log2 amax) - 8, a block's amax lands in [256, 512) x 2^k: what lies above
    448 x 2^k is clipped. On Gaussian blocks that is 0.5-0.9% of the values (the blocks whose max
    has a mantissa above 1.75), every clip costs at most 1/8 of its value, nothing ever clips above
    2^9 x 2^k, and nothing flushes that a per-block fp32 scale would have kept."""
    x = torch.randn(4096, 1024, generator=torch.Generator().manual_seed(1))
    q = quantize(x, E4M3, "block", (1, MX_BLOCK), scale_rule=mx_scale)
    scaled = x * expand_tiles(q.scale.float(), (1, MX_BLOCK), x.shape)
    clipped = scaled.abs() > clip_edge(E4M3)
    assert 0.005 < clipped.float().mean() < 0.009
    assert scaled.abs().max() < 512
    err = (dequantize(q) - x).abs() / x.abs()
    assert err[clipped].max() <= 1 / 8
    assert 29 < sqnr(x, dequantize(q)) < 32


def test_mx_gemm_multiplies_what_was_cast():
    """An MX x MX GEMM on the CPU backends is the fp32 reference bit for bit, equal (to fp32
    summation) to the float64 product of the dequantized operands, and close to the true product."""
    g = torch.Generator().manual_seed(2)
    a = torch.randn(48, 160, generator=g) * torch.logspace(-4, 4, 160)  # columns 1e8 apart
    b = torch.randn(40, 160, generator=g)
    qa, qb = (quantize(t, E4M3, "block", (1, MX_BLOCK), scale_rule=mx_scale) for t in (a, b))
    ref = scaled_gemm(qa, qb, torch.float32, backend="emulate")
    assert torch.equal(scaled_gemm(qa, qb, torch.float32, backend="cpu"), ref)
    assert torch.equal(scaled_gemm(qa, qb, torch.float32, backend="torch"), ref)  # (a CPU: the reference)
    exact = dequantize(qa).double() @ dequantize(qb).double().t()
    assert sqnr(exact, ref) > 120
    assert sqnr(a.double() @ b.double().t(), ref) > 25


def test_the_mxfp8_linear_trains_and_keeps_e8m0_scales():
    """An Fp8Linear with the mxfp8 preset: every operand of its three GEMMs is MX (1x32 along that
    GEMM's contraction dim; W and x re-quantized for the backward, their tiles do not transpose),
    saved for backward with its E8M0 scales, and its gradients match float64 to FP8's precision."""
    torch.manual_seed(0)
    lin = Fp8Linear(96, 64, recipe=Recipe.from_name("mxfp8", backend="cpu"))
    seen = []
    orig = device.gemm

    def spy(a, b, *args):
        seen.append((a, b))
        return orig(a, b, *args)

    x = torch.randn(8, 12, 96, requires_grad=True)
    device.gemm = spy
    try:
        y = lin(x)
        y.square().sum().backward()
    finally:
        device.gemm = orig
    assert len(seen) == 3 and all(is_mx(q) and q.block == (1, MX_BLOCK) for pair in seen for q in pair)
    # forward contracts over 96 (x, W), dgrad over 64 (dy, W^T), wgrad over 96 tokens (dy^T, x^T)
    assert [(a.data.shape[1], b.data.shape[1]) for a, b in seen] == [(96, 96), (64, 64), (96, 96)]
    x64, w64 = x.detach().double().requires_grad_(), lin.weight.detach().double().requires_grad_()
    y64 = torch.nn.functional.linear(x64, w64, lin.bias.detach().double())
    y64.square().sum().backward()
    assert sqnr(y64, y) > 25 and sqnr(x64.grad, x.grad) > 20 and sqnr(w64.grad, lin.weight.grad) > 20


def test_the_preset_reaches_the_recipe():
    """fp8_recipe=mxfp8 gives train.py a Recipe with MX's tiles and rule (the fp8_* keys alone
    could not say them), and a key set by hand still overrides the preset."""
    cfg = train.load_config(["config/shakespeare_char.py", "precision=O1", "fp8_recipe=mxfp8"])
    r = train.build_recipe(cfg, "cpu")
    assert r.scale_rule is mx_scale and r.act_tile == r.weight_tile == (1, MX_BLOCK) and r.formats == "e4m3"
    assert r.grid == "mx" and RECIPES["mxfp8"].grid == r.grid and RECIPES["blockwise"].grid == "block"
    r = train.build_recipe(train.load_config(["config/shakespeare_char.py", "precision=O1", "fp8_recipe=mxfp8",
                                              "fp8_formats=hybrid"]), "cpu")
    assert r.formats == "hybrid" and r.bwd_fmt is E5M2 and r.scale_rule is mx_scale
    assert train.build_recipe(train.load_config(["config/shakespeare_char.py", "precision=O1"]), "cpu") == Recipe(backend="cpu")


def test_the_saturation_alarm_knows_the_mx_rule():
    """A healthy MX cast clips ~0.6% of its values by design: recorded (saturation_rule), and no
    alarm, however many statistics steps in a row. The same clipping by a scale that is not MX's
    (fp32 scales of the same values) is range trouble: the alarm fires."""
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(3))
    q = quantize(x, E4M3, "block", (1, MX_BLOCK), scale_rule=mx_scale)
    rec = summarize(*(t.cpu() for t in cast_stats(x, q)))
    assert 0.004 < rec["saturation"] == rec["saturation_rule"] < 0.01
    fp32_twin = quantize(x, E4M3, "block", (1, MX_BLOCK), scale=q.scale.float())
    twin = summarize(*(t.cpu() for t in cast_stats(x, fp32_twin)))
    assert twin["saturation"] == rec["saturation"] and twin["saturation_rule"] == 0

    def alarms(r):
        stats = Fp8Stats(None, interval=1, alarms=Alarms())
        lines = []
        for it in range(5):
            lines += stats._check_alarms(it, [{**r, "iter": it, "layer": "l", "operand": "x", "format": "e4m3"}])
        return lines

    assert alarms(rec) == []
    assert any("saturation" in line for line in alarms(twin))


def test_o2_takes_the_mx_recipe():
    """At O2 the layer casts its fp16 master to MX operands (W along K, W^T along N, E8M0 scales)
    and keeps its weight gradient in FP8 as O2 does for every recipe (optim.py's own 128-value
    blocks: the optimizer state's scales are not the GEMMs'); the gradient matches float64."""
    from nanofp8.optim import convert_to_o2, fp8_grad

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 64))
    w64 = model[0].weight.detach().double().clone().requires_grad_()
    b64 = model[0].bias.detach().double()
    convert_to_o2(convert_to_fp8(model, Recipe.from_name("mxfp8", backend="cpu")))
    qw, qw_t = model[0].weight_operands()
    assert is_mx(qw) and is_mx(qw_t) and qw.data.shape == (64, 96) and qw_t.data.shape == (96, 64)
    x = torch.randn(4, 16, 96)
    model(x).square().sum().backward()
    torch.nn.functional.linear(x.double(), w64, b64).square().sum().backward()
    g = dequantize(fp8_grad(model[0].weight))
    assert model[0].weight.grad is None and sqnr(w64.grad, g) > 20
