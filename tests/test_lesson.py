"""fp8.py as a lesson: the path a reader follows is short, the recipes are one table, and the
engine beside it (device.py, emulate.py) never changes a number.

Each claim of issue #27's fp8 part has a test here: the project functions one O1 step of an
Fp8Linear runs through all in fp8.py (their count: bench.py design), the named presets and their overrides, the rowwise preset's E4M3
gradients, the scale rule as one field used by every cast, the tile shape kept apart from the
GEMM's K step, and the CPU emulation kept off tensor subclasses."""

import dataclasses

import pytest
import torch

from bench import functions_called as project_functions  # (what bench.py design counts)
from cuda_contract import CudaScaledMM
from nanofp8 import device, emulate
from nanofp8.fp8 import (E4M3, E5M2, GRANULARITIES, RECIPES, Fp8Linear, Recipe, compute_scale, dequantize,
                         quantize, scaled_gemm, sqnr)
from nanofp8.mx import mx_scale


def test_one_o1_step_of_a_linear_reads_in_one_file():
    """One O1 forward+backward of one Fp8Linear on the reference backend, after a warm-up call,
    runs through fp8.py's functions only: the reference needs no engine. (How many: `python
    bench.py design`, beside the lesson's budget of 15; issue #27 found 29.)"""
    torch.manual_seed(0)
    lin = Fp8Linear(64, 64, recipe=Recipe(backend="emulate"))
    x = torch.randn(8, 64, requires_grad=True)
    lin(x).sum().backward()
    called = project_functions(lambda: lin(x).sum().backward())
    assert all(c.startswith("nanofp8/fp8.py:") for c in called), called


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_the_function_multiplies_operands_given_cast(granularity):
    """A tensor-parallel shard gathers x (forward) and dy (backward) in FP8 and hands them to the
    Function already cast (torchao's pattern); the stand-ins autograd carries instead are never
    read (NaN here). Output and dx are those of the layer casting x and dy itself, bit for bit, and
    so is dW with tensor scales; with row and 1x128 scales dW's operands are re-quantized along
    the tokens from the FP8 values, one more rounding. A bias gradient sums dy's FP8 values."""
    from nanofp8.fp8 import Fp8LinearFunction
    from nanofp8.parallel import Gathered

    g = torch.Generator().manual_seed(7)
    lin = Fp8Linear(160, 48, recipe=Recipe(granularity=granularity, backend="emulate"))
    x, dy = torch.randn(2, 8, 160, generator=g), torch.randn(2, 8, 48, generator=g)
    x.requires_grad_()
    lin(x).backward(dy)
    want = lin(x).detach(), x.grad, lin.weight.grad.clone(), lin.bias.grad.clone()
    lin.zero_grad()
    given = Gathered(x=lin.quantize_operand("x", x.detach().reshape(-1, 160)))
    stand_in = torch.full_like(x, float("nan")).requires_grad_()
    y = Fp8LinearFunction.apply(stand_in, lin.weight, lin.bias, lin, torch.float32, given)
    assert given.x is None  # taken: not kept alive until backward
    given.dy = qdy = lin.quantize_operand("dy", dy.reshape(-1, 48))
    y.backward(torch.full_like(dy, float("nan")))
    assert torch.equal(y, want[0]) and torch.equal(stand_in.grad, want[1])
    if granularity == "tensor":  # x^T and dy^T are transposes of the given casts: the same dW
        assert torch.equal(lin.weight.grad, want[2])
    else:  # re-quantized along the tokens from the FP8 values (the full x never exists here)
        exact = dy.reshape(-1, 48).double().t() @ x.detach().reshape(-1, 160).double()
        # a second rounding about doubles each operand's noise: -3 dB (measured: 26.1 -> 22.2 dB)
        assert sqnr(exact, want[2]) - 4.5 < sqnr(exact, lin.weight.grad) < sqnr(exact, want[2])
    assert torch.equal(lin.bias.grad, dequantize(qdy, torch.float32).sum(0)) and sqnr(want[3], lin.bias.grad) > 20


def test_presets_are_one_frozen_table_and_knobs_override_them():
    assert set(RECIPES) == {"tensorwise", "rowwise", "blockwise", "delayed", "mxfp8", "rowwise_with_gw_hp"}
    assert RECIPES["tensorwise"] == Recipe()
    row, block, delayed = RECIPES["rowwise"], RECIPES["blockwise"], RECIPES["delayed"]
    assert (row.granularity, row.fwd_fmt, row.bwd_fmt) == ("row", E4M3, E4M3)  # torchao's rowwise
    assert (block.granularity, block.fwd_fmt, block.bwd_fmt) == ("block", E4M3, E4M3)
    assert (block.act_tile, block.weight_tile) == ((1, 128), (128, 128))  # DeepSeek-V3
    assert (delayed.scaling, delayed.granularity) == ("delayed", "tensor")
    mx = RECIPES["mxfp8"]  # OCP MX: 1x32 tiles for every operand, E8M0 scales by the shared-exponent rule
    assert (mx.granularity, mx.fwd_fmt, mx.bwd_fmt, mx.act_tile, mx.weight_tile) == ("block", E4M3, E4M3, (1, 32), (1, 32))
    assert mx.scale_rule is mx_scale
    # torchao's ROWWISE_WITH_GW_HP: rowwise E4M3 forward and dgrad, but W^T with one tensor scale, and
    # the wgrad GEMM's operands (x^T, dy^T) kept in high precision
    hp = RECIPES["rowwise_with_gw_hp"]
    assert {op: hp.casts[op][:2] if hp.casts[op] else None for op in ("x", "w", "dy", "w_t", "x_t", "dy_t")} == {
        "x": (E4M3, "row"), "w": (E4M3, "row"), "dy": (E4M3, "row"), "w_t": (E4M3, "tensor"), "x_t": None, "dy_t": None}
    assert all(row.casts[op] == (E4M3, "row", (1, 128) if op[0] != "w" else (128, 128)) for op in row.casts)
    with pytest.raises(dataclasses.FrozenInstanceError):
        row.granularity = "tensor"
    r = Recipe.from_name("rowwise", formats="hybrid", margin=2)
    assert (r.granularity, r.bwd_fmt, r.margin) == ("row", E5M2, 2)  # fwd/bwd follow the override
    with pytest.raises(ValueError, match="unknown FP8 recipe 'mx'"):
        Recipe.from_name("mx")
    assert GRANULARITIES == ("tensor", "row", "block")


@pytest.mark.parametrize("name", list(RECIPES))
def test_a_recipe_says_its_name_alike_at_start_up_in_its_layers_and_in_the_layer_table(name):
    """One phrase (Recipe.describe) describes a recipe wherever a run shows it: train.py's
    start-up line, Fp8Linear's repr and the table of Linears (nanofp8/stats.py)."""
    import train
    from conftest import TINY
    from nanofp8.model import GPT, GPTConfig
    from nanofp8.run import MODEL_KEYS
    from nanofp8.stats import linear_table

    cfg = train.load_config(TINY + ["precision=O1", f"fp8_recipe={name}"])
    model = GPT(GPTConfig(**{k: cfg[k] for k in MODEL_KEYS}))
    line = train.setup_precision(model, cfg, "cpu")
    said = model.blocks[0].mlp.c_fc.recipe.describe()
    assert said.startswith(f"{name} (") and f"in FP8 ({said}, backend=cpu;" in line, line
    assert f"fp8={said}, backend=cpu" in repr(model.blocks[0].mlp.c_fc)
    assert {row["recipe"] for row in linear_table(model) if row["fp8"]} == {said}


def test_a_knob_that_leaves_every_preset_makes_the_recipe_custom():
    """A recipe's name is the preset it equals knob for knob (the backend aside: an engine does
    not change a number), else "custom"."""
    import train
    from conftest import TINY
    from nanofp8.model import GPT, GPTConfig
    from nanofp8.run import MODEL_KEYS

    assert Recipe.from_name("rowwise", backend="emulate").name == "rowwise"
    assert Recipe(granularity="row", formats="e4m3").name == "rowwise"  # built by hand: the knobs name it
    assert Recipe.from_name("rowwise", margin=1).name == "custom"
    assert Recipe(history_len=8).name == "custom"  # even a knob that current scaling never reads
    assert Recipe.from_name("mxfp8", power_of_two=True).describe() == "custom (current/mx/e4m3)"
    cfg = train.load_config(TINY + ["precision=O1", "fp8_recipe=rowwise", "fp8_margin=1"])
    model = GPT(GPTConfig(**{k: cfg[k] for k in MODEL_KEYS}))
    assert "in FP8 (custom (current/row/e4m3), backend=cpu;" in train.setup_precision(model, cfg, "cpu")
    assert "fp8=custom (current/row/e4m3)" in repr(model)


def _grads(recipe, x, w, dy):
    lin = Fp8Linear(w.shape[1], w.shape[0], bias=False, recipe=recipe)
    with torch.no_grad():
        lin.weight.copy_(w)
    xx = x.clone().requires_grad_(True)
    lin(xx).backward(dy)
    return xx.grad, lin.weight.grad


def test_rowwise_preset_gradients_are_e4m3_and_more_accurate():
    # torchao's rowwise recipe casts gradients to E4M3 too: its dgrad and wgrad beat row + E5M2
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 128, generator=g) * torch.exp2(torch.randint(-6, 6, (256, 1), generator=g).float())
    w, dy = torch.randn(96, 128, generator=g) * 0.05, torch.randn(256, 96, generator=g)
    dx_ref, dw_ref = dy.double() @ w.double(), dy.double().t() @ x.double()
    rowwise = _grads(Recipe.from_name("rowwise", backend="emulate"), x, w, dy)
    hybrid = _grads(Recipe(granularity="row", backend="emulate"), x, w, dy)
    for new, old, ref in zip(rowwise, hybrid, (dx_ref, dw_ref)):
        assert sqnr(ref, new) > 27 and sqnr(ref, new) > sqnr(ref, old) + 2


@pytest.mark.parametrize("backend", ["emulate", "cpu"])
def test_rowwise_with_gw_hp_multiplies_the_weight_gradient_in_high_precision(backend):
    """torchao's ROWWISE_WITH_GW_HP: the forward and dgrad GEMMs as rowwise's (W^T with one tensor
    scale), within rowwise's float64 floors; dW = dy^T x is the GEMM a Linear runs without FP8, from
    x and dy as they are, in autocast's bf16: that GEMM's very bits, and far closer to float64 than
    rowwise's FP8 wgrad. Backward keeps x in bf16 for it, in place of rowwise's FP8 x^T."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 128, generator=g) * torch.exp2(torch.randint(-6, 6, (256, 1), generator=g).float())
    w, dy = torch.randn(96, 128, generator=g) * 0.05, torch.randn(256, 96, generator=g)
    dx_ref, dw_ref = dy.double() @ w.double(), dy.double().t() @ x.double()
    gw_hp = _grads(Recipe.from_name("rowwise_with_gw_hp", backend=backend), x, w, dy)
    rowwise = _grads(Recipe.from_name("rowwise", backend=backend), x, w, dy)
    assert sqnr(dx_ref, gw_hp[0]) > 27 and torch.equal(gw_hp[1], dy.t() @ x)  # (fp32 in, fp32 out)
    assert sqnr(dw_ref, gw_hp[1]) > 120 and sqnr(dw_ref, rowwise[1]) < 35

    lin = Fp8Linear(128, 96, bias=False, recipe=Recipe.from_name("rowwise_with_gw_hp", backend=backend))
    with torch.no_grad():
        lin.weight.copy_(w)
    xx = x.clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = lin(xx)
    y.backward(dy.bfloat16())
    assert torch.equal(lin.weight.grad, (dy.bfloat16().t() @ x.bfloat16()).float())  # autocast's Linear's dW
    fp8_dw = scaled_gemm(quantize(dy.bfloat16().t(), E4M3, "row"), quantize(x.t(), E4M3, "row"), torch.float32)
    assert not torch.equal(lin.weight.grad, fp8_dw) and sqnr(dw_ref, lin.weight.grad) > sqnr(dw_ref, fp8_dw) + 10
    assert [t.dtype for t in saved if t.shape == (128, 256)] == [torch.bfloat16]  # x^T, kept in bf16
    assert sqnr(dx_ref, xx.grad) > 25


@pytest.mark.parametrize("backend", ["emulate", "cpu", "torch"])
def test_scale_rule_is_one_field_used_by_every_cast(backend):
    # a fork's new rule: one field of the recipe, and every operand cast of the layer uses it
    calls = []

    def half_scale(amax, fmt, margin=0, power_of_two=False, fallback=None):
        calls.append(fmt.name)
        return compute_scale(amax, fmt, margin, power_of_two, fallback) / 2

    lin = Fp8Linear(64, 32, recipe=Recipe(scale_rule=half_scale, backend=backend))
    x = torch.randn(16, 64, requires_grad=True)
    lin(x).sum().backward()
    assert calls == ["e4m3", "e4m3", "e5m2"]  # x, W, dy (their transposes keep the scale)
    q = lin.quantize_operand("x", x.detach())
    assert torch.equal(q.scale, compute_scale(x.detach().abs().amax(), E4M3) / 2)


def test_tile_shape_is_not_the_gemm_k_step():
    # a 1x32 tile must never be read with 128-wide scale columns: the FP8 block GEMMs refuse it
    # (device.tile_refusal), and the GEMM falls back to the reference, which scales each element
    # by its own tile's scale
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(64, 256, generator=g), torch.randn(48, 256, generator=g)
    x[:, 40] *= 1e3  # one outlier column: 1x32 tiles keep it to its own 32 neighbours
    a, b = quantize(x, E4M3, "block", (1, 32)), quantize(w, E4M3, "block", (32, 32))
    assert device.tile_refusal(a, b) and "1x32" in device.tile_refusal(a, b)
    assert device.tile_refusal(quantize(x, E4M3, "block", (1, 128)), quantize(w, E4M3, "block", (128, 128))) is None
    ref = dequantize(a, torch.float64) @ dequantize(b, torch.float64).t()
    for backend in ("emulate", "cpu", "torch"):
        assert sqnr(ref, scaled_gemm(a, b, torch.float32, backend=backend)) > 100  # the fp32 sum of the same values


def test_tile_refusal_under_the_cuda_contract(monkeypatch):
    # on a (simulated) H100 with native block scales, a 1x32 recipe is refused before any call:
    # no block-scaled torch._scaled_mm is made, the reference runs, and it is counted as a fallback
    contract = CudaScaledMM()
    contract.install(monkeypatch)
    monkeypatch.setattr(device, "fallbacks", {})
    monkeypatch.setattr(device, "_warned", set())
    lin = Fp8Linear(256, 64, recipe=Recipe(granularity="block", formats="e4m3", act_tile=(1, 32),
                                           weight_tile=(32, 32)))
    x = torch.randn(32, 256, requires_grad=True)
    with pytest.warns(UserWarning, match="1x32 block scales"):
        lin(x).sum().backward()
    assert not contract.calls and not contract.refusals and device.fallbacks == {"Fp8Linear": 3}


class Sub(torch.Tensor):
    pass


def test_cpu_emulation_never_meets_subclasses_or_compile():
    data = quantize(torch.randn(8, 16), E4M3).data
    assert emulate.handles(data)
    sub = data.as_subclass(Sub)
    assert not emulate.handles(sub)
    assert torch.equal(emulate.fp8_to_float(sub).as_subclass(torch.Tensor), data.float())
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        assert not emulate.handles(torch.empty(4, 4))
    seen = []

    @torch.compile(backend="eager", fullgraph=True)
    def f(t):
        seen.append(emulate.handles(t))
        return t + 1

    f(torch.ones(3))
    assert seen == [False]


def test_train_picks_a_preset_by_name_and_knobs_override_it():
    """fp8_recipe=NAME on train.py's command line sets the recipe's keys; a key given by hand
    overrides the preset even where it names the default value (rowwise's E4M3 gradients back to
    hybrid); no name: the keys as before."""
    import train
    from nanofp8.configurator import ConfigError

    def recipe(*args, device="cpu"):
        return train.build_recipe(train.load_config(["precision=O1", *args]), device)

    assert recipe() == Recipe(backend="cpu")  # no name: the knobs, as before
    assert recipe(device="cuda").backend == "torch"
    assert recipe("fp8_recipe=rowwise", "fp8_margin=2") == Recipe.from_name("rowwise", margin=2, backend="cpu")
    assert recipe("fp8_recipe=rowwise", "fp8_formats=hybrid") == Recipe(granularity="row", backend="cpu")
    assert recipe("fp8_recipe=blockwise", "fp8_backend=emulate") == Recipe(granularity="block", formats="e4m3",
                                                                            backend="emulate")
    assert recipe("fp8_recipe=delayed") == Recipe(scaling="delayed", backend="cpu")
    cfg = train.load_config(["precision=O1", "fp8_recipe=blockwise"])
    assert cfg["fp8_granularity"] == "block" and cfg["fp8_formats"] == "e4m3"  # what a checkpoint records
    assert recipe("fp8_recipe=mxfp8") == Recipe.from_name("mxfp8", backend="cpu")  # tiles and rule: no key says them
    with pytest.raises(ConfigError, match="fp8_recipe"):
        train.load_config(["fp8_recipe=nvfp4"])
    with pytest.raises(ConfigError, match="delayed"):  # a preset and a knob that contradict it
        train.load_config(["precision=O1", "fp8_recipe=delayed", "fp8_granularity=row"])
