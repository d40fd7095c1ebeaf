"""Tests of nanofp8/attention.py: FP8 causal attention against float64 attention, what it keeps for
backward, the formats and contraction dims of its six GEMMs, and a GPT training with it.

The SQNR floors are an error budget, derived here, not fitted:

* One cast to E4M3 keeps about 31 dB of SQNR on the values here (noise-to-signal power
  A = 10^-3.1), one to E5M2 about 25 dB (G = 10^-2.5) (fp8.py, section 4; E4M3 at formats="e4m3").
* The relative noise powers of the operands of a GEMM add in its output (independent roundings):
  NSR(X @ Y^T) ~ NSR(X) + NSR(Y).
* S = Q K^T carries 2A. Through the softmax its error dS moves P relatively, dP/P = dS - E_P[dS],
  so S passes its NSR on to P scaled by the scores' variance; with scores of unit scale (unit
  inputs, 1/sqrt(d)) at most 1:1: P (fp32, recomputed in backward) carries 2A, its FP8 cast 3A.
* Then:  O  = P V          3A + A                      = 4A        25.0 dB
         dV = P^T dO       3A + G                      = 3A + G    22.6 dB
         dP = dO V^T       G + A
         dS = P (dP - D)   2A (P) + A + G (dP)         = 3A + G
         dQ = dS K         3A + G + G (its cast) + A   = 4A + 2G   20.2 dB
         dK = dS^T Q       the same
  Row and 1x128 scales re-quantize K^T and Q^T from the saved FP8 values: one more A in dQ and dK
  (5A + 2G, 19.9 dB). At formats="e4m3", G = A.
* The floor is the budget less MARGIN = 3 dB: the per-cast figures are averages over Gaussian
  values, and a tensor scale spread over rows 1000x apart rounds the small ones no better.

Where a score's scale is large, no floor holds, in any precision: a dot product's rounding error
is relative to |q||k|, not to q.k, so a key 1000x larger than the others gives the queries nearly
orthogonal to it scores with an error of tens (FP8) or units (bf16): torch's own bf16 attention
gets dQ at 5 dB on such a head (measured). The big-key case here keeps the scores at unit scale
(its queries are 1000x smaller), which tests what FP8 controls: the range of a tensor's scale.
"""

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from nanofp8 import attention
from nanofp8.attention import Fp8AttentionFunction, fp8_attention
from nanofp8.fp8 import E4M3, E5M2, GRANULARITIES, RECIPES, Recipe, sqnr

A, G = 10 ** -3.1, 10 ** -2.5  # noise-to-signal power of one E4M3 / E5M2 cast
MARGIN = 3.0


def budget_db(what, granularity, formats):
    """The error budget of the module docstring, in dB of SQNR."""
    g = G if formats == "hybrid" else A
    requant = A if granularity != "tensor" else 0.0  # K^T, Q^T re-quantized from FP8
    nsr = {"out": 4 * A, "dv": 3 * A + g, "dq": 4 * A + 2 * g + requant, "dk": 4 * A + 2 * g + requant}[what]
    return -10 * math.log10(nsr)


CASES = ["gaussian", "big_key", "row_scales", "zero_head", "long_T", "tiny_T"]


def inputs(case, seed=0):
    """q, k, v, dO (B, H, T, d) of an adversarial case."""
    g = torch.Generator().manual_seed(seed)
    B, H, T, d = {"long_T": (1, 1, 512, 64), "tiny_T": (8, 4, 3, 16)}.get(case, (2, 2, 48, 32))
    q, k, v, do = (torch.randn(B, H, T, d, generator=g) for _ in range(4))
    if case == "big_key":  # one key sets K's scale; the others sit 1000x below it
        k[:, :, 5] *= 1e3
        q *= 1e-3  # (scores of unit scale: see the module docstring)
    if case == "row_scales":  # every token's row of q, k, v and dO its own scale, 1 to 1e-3
        for x in (q, k, v, do):
            x *= 10 ** (-3 * torch.rand(B, H, T, 1, generator=g))
    if case == "zero_head":
        for x in (q, k, v):
            x[:, 0] = 0
    return q, k, v, do


def reference(q, k, v, do):
    """Float64 causal attention: (O, dQ, dK, dV)."""
    q, k, v = (x.double().requires_grad_() for x in (q, k, v))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    o.backward(do.double())
    return o, q.grad, k.grad, v.grad


def run_fp8(q, k, v, do, recipe):
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    o = fp8_attention(q, k, v, recipe)
    o.backward(do)
    return o, q.grad, k.grad, v.grad


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c == "long_T" else c for c in CASES])
@pytest.mark.parametrize("granularity, formats", [("tensor", "hybrid"), ("row", "hybrid"), ("block", "hybrid"),
                                                  ("tensor", "e4m3"), ("row", "e4m3")])
def test_gradients_against_float64(case, granularity, formats):
    q, k, v, do = inputs(case)
    ref = reference(q, k, v, do)
    got = run_fp8(q, k, v, do, Recipe(granularity=granularity, formats=formats, backend="cpu"))
    for what, r, x in zip(("out", "dq", "dk", "dv"), ref, got):
        floor = budget_db(what, granularity, formats) - MARGIN
        assert sqnr(r, x) > floor, f"{what}: {sqnr(r, x):.1f} dB, floor {floor:.1f} dB"
    o, dq, dk, dv = got
    # the causal edges: the first query sees only its own key, so its output is its value (P = 1,
    # exact in FP8; V's one E4M3 rounding: relative error <= 2^-4, 24.1 dB) and its dS row is
    # exactly 0, and so its dQ
    assert sqnr(v[..., 0, :], o[..., 0, :]) > 20 * math.log10(16) - 0.1
    assert torch.equal(dq[..., 0, :], torch.zeros_like(dq[..., 0, :]))
    if case == "zero_head":  # Q = K = V = 0: O = 0, dQ = dS K = 0, dK = dS^T Q = 0, exactly
        for x in (o, dq, dk):
            assert torch.equal(x[:, 0], torch.zeros_like(x[:, 0]))


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_grouped_query_against_float64(granularity):
    """Grouped-query attention: 4 query heads read 2 key/value heads (query head h reads h // 2),
    against float64 SDPA with enable_gqa; dK and dV sum their group's gradients. The floors are
    those of multi-head attention: a head read by the wrong queries is off by ~0 dB."""
    q, k, v, do = inputs("row_scales")  # (2, 2, 48, 32)
    q, do = torch.cat([q, q.flip(2)], dim=1), torch.cat([do, do.flip(2)], dim=1)  # 4 query heads
    q, k, v = (x.double().requires_grad_() for x in (q, k, v))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    o.backward(do.double())
    ref = o, q.grad, k.grad, v.grad
    got = run_fp8(*(x.detach().float() for x in (q, k, v)), do, Recipe(granularity=granularity, backend="cpu"))
    assert got[2].shape == k.shape and got[3].shape == v.shape
    for what, r, x in zip(("out", "dq", "dk", "dv"), ref, got):
        floor = budget_db(what, granularity, "hybrid") - MARGIN
        assert sqnr(r, x) > floor, f"{what}: {sqnr(r, x):.1f} dB, floor {floor:.1f} dB"
    with pytest.raises(ValueError, match="4 query heads cannot share 3 key"):
        fp8_attention(q.detach().float(), *(torch.randn(2, 3, 48, 32) for _ in range(2)), Recipe(backend="cpu"))


@pytest.mark.parametrize("preset", list(RECIPES))
def test_every_recipe_preset(preset):
    """Every named recipe runs attention with its own tiles, formats and scale rule (delayed: current
    scaling here) within the floors of its granularity and formats; the fast backend and the
    reference agree bit for bit (MX's 1x32 tiles and E8M0 scales included, where that preset exists)."""
    for case in ("row_scales",):
        q, k, v, do = inputs(case)
        ref = reference(q, k, v, do)
        recipe = RECIPES[preset]
        got = run_fp8(q, k, v, do, replace(recipe, backend="cpu"))
        for what, r, x in zip(("out", "dq", "dk", "dv"), ref, got):
            floor = budget_db(what, recipe.granularity, recipe.formats) - MARGIN
            assert sqnr(r, x) > floor, f"{case} {what}: {sqnr(r, x):.1f} dB, floor {floor:.1f} dB"
        for x, y in zip(got, run_fp8(q, k, v, do, replace(recipe, backend="emulate"))):
            assert torch.equal(x, y)


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_cpu_backend_is_the_reference_bit_for_bit(granularity):
    """attention.cast takes device.cast of all rows at once for the fast backends, fp8.quantize of
    the batch for "emulate": the same bytes, so the same outputs and gradients, bit for bit."""
    q, k, v, do = inputs("row_scales")
    a = run_fp8(q, k, v, do, Recipe(granularity=granularity, formats="hybrid", backend="emulate"))
    b = run_fp8(q, k, v, do, Recipe(granularity=granularity, formats="hybrid", backend="cpu"))
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_only_fp8_qkv_and_one_lse_per_row_are_saved(granularity):
    B, H, T, d = 2, 3, 24, 16
    q, k, v = (torch.randn(B, H, T, d).requires_grad_() for _ in range(3))
    o = fp8_attention(q, k, v, Recipe(granularity=granularity, backend="cpu"))
    ctx = o.grad_fn
    saved = ctx.saved_tensors
    data, scales, lse = saved[0:6:2], saved[1:6:2], saved[6:]
    assert len(saved) == 7
    assert all(x.dtype == torch.float8_e4m3fn and x.shape == (B, H, T, d) for x in data)
    scale_shape = {"tensor": (), "row": (B, H, T, 1), "block": (B, H, T, 1)}[granularity]  # d < 128: one tile
    assert all(s.dtype == torch.float32 and s.shape == scale_shape for s in scales)
    assert len(lse) == 1 and lse[0].dtype == torch.float32 and lse[0].shape == (B, H, T)
    # nothing else: no tensor hides in ctx's attributes (P, S or O kept aside)
    def tensors(x):
        if torch.is_tensor(x):
            return [x]
        if isinstance(x, (list, tuple)):
            return [t for y in x for t in tensors(y)]
        return []
    assert [n for n, x in vars(ctx).items() if tensors(x)] == []
    # bytes per (token, head): 3 d bytes of FP8 Q, K, V and 4 of the lse (scales aside), against
    # 2 * 4 d for a bf16 attention's Q, K, V and O
    per = sum(t.numel() * t.element_size() for t in data + lse) / (B * H * T)
    assert per == 3 * d + 4


def test_gemm_formats_and_contraction_dims(monkeypatch):
    """The six GEMMs, in order, with their operands' formats and shapes: E4M3 in the forward GEMMs,
    E5M2 for every gradient operand at formats="hybrid" (dO, dS), E4M3 everywhere at "e4m3"; each
    operand quantized along its GEMM's contraction dim (T = 24 and d = 16 tell them apart)."""
    calls = []
    real = attention.scaled_gemm

    def recording(a, b, *args, **kw):
        calls.append((a.fmt.name, b.fmt.name, tuple(a.data.shape[-2:]), tuple(b.data.shape[-2:])))
        return real(a, b, *args, **kw)

    monkeypatch.setattr(attention, "scaled_gemm", recording)
    T, d = 24, 16
    for formats, g in (("hybrid", E5M2.name), ("e4m3", E4M3.name)):
        for granularity in GRANULARITIES:
            calls.clear()
            q, k, v = (torch.randn(2, 2, T, d).requires_grad_() for _ in range(3))
            fp8_attention(q, k, v, Recipe(granularity=granularity, formats=formats, backend="cpu")).sum().backward()
            e = E4M3.name
            assert calls == [
                (e, e, (T, d), (T, d)),  # S = Q K^T         over d
                (e, e, (T, T), (d, T)),  # O = P V           over the keys
                (e, e, (T, d), (T, d)),  # S again
                (e, g, (T, T), (d, T)),  # dV = P^T dO       over the queries
                (g, e, (T, d), (T, d)),  # dP = dO V^T       over d
                (g, e, (T, T), (d, T)),  # dQ = dS K         over the keys
                (g, e, (T, T), (d, T)),  # dK = dS^T Q       over the queries
            ], (formats, granularity)


@pytest.mark.slow
@pytest.mark.usefixtures("shakespeare")
def test_gpt_trains_with_fp8_attention(tmp_path):
    """A whole GPT at O1 with fp8_attention, through train.py: its attention runs the FP8
    Function, the loss falls, and it lands near the same run with bf16 attention."""
    import conftest
    import train

    common = conftest.TINY + ["precision=O1", "max_iters=30", "lr_decay_iters=30", "eval_interval=30",
                              "log_interval=1000"]
    calls = []
    real = Fp8AttentionFunction.forward

    def counting(ctx, *args):
        calls.append(1)
        return real(ctx, *args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Fp8AttentionFunction, "forward", staticmethod(counting))
        fa = train.main(common + ["fp8_attention=True", f"out_dir={tmp_path / 'fa'}"])
    assert len(calls) >= 30 * 2  # 2 layers, every training step (and the evaluations)
    n_calls = len(calls)
    plain = train.main(common + [f"out_dir={tmp_path / 'plain'}"])
    assert len(calls) == n_calls  # without the key, attention stays bf16
    first, last = fa["losses"][0][1], fa["evals"][-1][2]
    assert last < first - 0.5, f"loss {first:.3f} -> val {last:.3f}"
    assert abs(last - plain["evals"][-1][2]) < 0.05 * plain["evals"][-1][2]


@pytest.mark.slow
def test_compiles_into_one_graph():
    """Under torch.compile (inductor, CPU) the Function compiles without a graph break, and its
    output and gradients stay those of eager up to the ulps of inductor's exp and sums, which may
    move a value across an FP8 rounding boundary: far above the FP8 floors, not bit for bit."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    q, k, v, do = (x[:1] for x in inputs("gaussian"))  # one sequence: dynamo unrolls the GEMMs per head
    recipe = Recipe(backend="cpu")
    eager = run_fp8(q, k, v, do, recipe)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(lambda q, k, v: fp8_attention(q, k, v, recipe), backend=counter, fullgraph=True)
    qc, kc, vc = (x.clone().requires_grad_() for x in (q, k, v))
    oc = compiled(qc, kc, vc)
    oc.backward(do)
    assert counter.frame_count == 1
    for e, c in zip(eager, (oc, qc.grad, kc.grad, vc.grad)):
        assert sqnr(e, c) > 35


def test_refused_where_it_cannot_work():
    """One ConfigError line naming the key and the way out: no FP8 recipe at bf16, no attention
    dropout; the library call refuses a model with dropout too."""
    import train
    from nanofp8.configurator import ConfigError
    from nanofp8.model import GPT, GPTConfig, apply_fp8

    for args, what in ((["precision=bf16"], "precision=O1, O2 or O3"), (["precision=O1", "dropout=0.1"], "dropout=0")):
        with pytest.raises(ConfigError, match=what):
            train.load_config(args + ["fp8_attention=True"])
    for level in ("O1", "O2", "O3"):  # any layout: tensor parallelism keeps whole heads on a rank
        train.load_config([f"precision={level}", "fp8_attention=True"] + ["tensor_parallel=2"] * (level == "O1"))
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, vocab_size=64, block_size=16, dropout=0.1))
    with pytest.raises(ValueError, match="dropout"):
        apply_fp8(model, Recipe(), attention=True)
