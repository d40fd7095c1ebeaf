"""Delayed scaling's history pushes on one Triton launch (nanofp8/history_triton.py), run in
Triton's interpreter (tests/conftest.py) against Fp8Linear.push_history, the reference."""

import os

import pytest
import torch
import torch.nn as nn
from test_optim import _same_bits

from nanofp8 import o2_compile, optim_fused
from nanofp8.fp8 import Fp8Linear, Recipe, compute_scale, convert_to_fp8
from nanofp8.history_triton import BUFFERS, push_histories


# Where the kernels run: here the interpreter on the CPU; on a GPU (scripts/gpu_speed.sh) the same tests
# with NANOFP8_TEST_DEVICE=cuda TRITON_INTERPRET=0
DEVICE = torch.device(os.environ.get("NANOFP8_TEST_DEVICE", "cpu"))


def _layers(recipe):
    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(*[nn.Linear(32, 32) for _ in range(5)]).to(DEVICE), recipe)
    return [m for m in model if isinstance(m, Fp8Linear)]


def _adversarial_logs(layers, gen):
    """A log per layer and role as casts leave it: most cast (amaxes over 40 decades, one NaN, one
    inf, a zero; counts; the scale each cast used), some not (a zero row)."""
    for m in layers:
        log = torch.zeros_like(m.cast_log)
        for role in range(3):
            kind = int(torch.randint(0, 8, (), generator=gen))
            if kind == 0:
                continue  # (no cast of this role since the last push)
            amax = float(10.0 ** (torch.rand((), generator=gen, dtype=torch.float64) * 40 - 20))
            amax = {1: float("nan"), 2: float("inf"), 3: 0.0}.get(kind, amax)
            values = int(torch.randint(1, 5000, (), generator=gen))
            clipped = int(torch.randint(0, values, (), generator=gen))
            log[role] = torch.tensor([amax, float(kind in (1, 2)), values, clipped,
                                      float(torch.rand((), generator=gen) * 1e4)], dtype=torch.float64)
        m.cast_log.copy_(log)


@pytest.mark.parametrize("recipe", [Recipe(scaling="delayed"),
                                    Recipe(scaling="delayed", amax_algo="most_recent", history_len=5, margin=1,
                                           power_of_two=True, formats="e4m3")],
                         ids=["default", "most-recent-5-margin-pow2-e4m3"])
def test_one_launch_pushes_every_history_as_push_history_does(recipe):
    """40 pushes of adversarial logs into 5 layers' histories (16 values, or 5: they wrap): every
    buffer (the histories, their counts, the counters, the scales, the next scales and their
    inverses, the zeroed log) bit-equal to each layer's push_history."""
    ref, mine = _layers(recipe), _layers(recipe)
    gen = torch.Generator().manual_seed(0)
    for a, b in zip(ref, mine):  # (histories that are not empty at the start)
        h = torch.rand(a.amax_history.shape, generator=gen) * 100
        for m in (a, b):
            m.amax_history.copy_(h)
            m.history_count.fill_(2)
    for step in range(40):
        _adversarial_logs(ref, torch.Generator().manual_seed(step))
        _adversarial_logs(mine, torch.Generator().manual_seed(step))
        for m in ref:
            m.push_history()
        assert push_histories(mine)
        for a, b in zip(ref, mine):
            for name in BUFFERS:
                assert _same_bits(getattr(a, name), getattr(b, name)), (step, name)
    assert all(m.history_count.max() == recipe.history_len for m in mine)  # (the history wrapped)


def test_push_amaxes_takes_the_kernel_where_it_runs(monkeypatch):
    """o2_compile.push_amaxes (train.py's call after each backward, and the O1 step's after its
    weight casts) pushes on the kernel on a GPU (here: where optim_fused.runs_on_triton says so),
    and marks the layers warm as before; a recipe it does not take pushes as before."""
    from nanofp8 import history_triton

    calls, push = [], history_triton.push_histories

    def counted(layers):  # (the pushes the kernel made)
        out = push(layers)
        calls.extend([len(layers)] if out else [])
        return out

    monkeypatch.setattr(history_triton, "push_histories", counted)
    monkeypatch.setattr(optim_fused, "runs_on_triton", lambda p: True)
    ref, mine = _layers(Recipe(scaling="delayed")), _layers(Recipe(scaling="delayed"))
    _adversarial_logs(ref, torch.Generator().manual_seed(1))
    _adversarial_logs(mine, torch.Generator().manual_seed(1))
    for m in ref:
        m.push_amax()
    o2_compile.push_amaxes(mine)
    assert calls == [5]
    for a, b in zip(ref, mine):
        assert a.history_warm == b.history_warm
        assert all(_same_bits(getattr(a, name), getattr(b, name)) for name in BUFFERS)
    other = _layers(Recipe(scaling="delayed", scale_rule=lambda *a, **k: compute_scale(*a, **k)))  # (a rule of its own)
    o2_compile.push_amaxes(other)
    assert calls == [5]


@pytest.mark.parametrize("recipe", [Recipe(scaling="delayed"),
                                    Recipe(scaling="delayed", amax_algo="most_recent", margin=1, power_of_two=True)],
                         ids=["default", "most-recent-margin-pow2"])
def test_o1s_delayed_weight_casts_are_the_layers_own_with_their_pushes(recipe):
    """history_triton.cast_weights (O1's step under delayed scaling: two launches for all layers)
    against the layers' own casts and pushes (o2_compile._recast, _push_histories: the code a GPU
    compiles), over 8 steps of adversarial weights (rows 1e6 apart, values past the format's
    range that the cast clips, zeros, 1e-30, a NaN): the kept FP8 W and W^T, their scales and
    inverses, and every history buffer, bit-equal."""
    from nanofp8 import history_triton

    twins = []
    for _ in range(2):
        torch.manual_seed(0)
        model = convert_to_fp8(nn.Sequential(nn.Linear(96, 64), nn.Linear(64, 130), nn.Linear(130, 40)).to(DEVICE),
                               recipe)
        o2_compile.cast_once_per_step(model)
        o2_compile.cast_for_step(model, record=False)  # (the kept casts' buffers)
        layers = [m for m in model if isinstance(m, Fp8Linear)]
        gen = torch.Generator().manual_seed(1)
        for m in layers:  # every role's history warm, as after a first micro-step
            m.amax_history[:, 0] = torch.rand(3, generator=gen) * 10
            m.history_count.fill_(1)
            m.push_amax()
        twins.append(layers)
    ref, mine = twins
    for step in range(8):
        gen = torch.Generator().manual_seed(step)
        for a, b in zip(ref, mine):
            w = torch.randn(a.weight.shape, generator=gen) * 10.0 ** torch.randint(-4, 3, (), generator=gen)
            kind = step % 4
            if kind == 1:
                w *= 10 ** torch.linspace(-3, 3, w.shape[0])[:, None]
                w[0, :3] = torch.tensor([1e6, -1e6, 0.0])  # (past the range the history's scale allows)
            elif kind == 2:
                w[: w.shape[0] // 2] = 0.0
                w[-1] = 1e-30
            elif kind == 3 and step == 7 and a is ref[1]:
                w[3, 5] = float("nan")
            with torch.no_grad():
                a.weight.copy_(w)
                b.weight.copy_(w)
        o2_compile._recast(ref, True)
        o2_compile._push_histories(ref)
        assert history_triton.cast_weights(mine)
        for a, b in zip(ref, mine):
            for name in ("fp8_w", "fp8_wt", "fp8_w_scale", "fp8_w_inv", "fp8_wt_scale", "fp8_wt_inv") + BUFFERS:
                assert _same_bits(getattr(a, name), getattr(b, name)), (step, name)
    assert sum(int(m.clipped.sum()) for m in mine) > 0 and sum(int(m.nonfinite[1]) for m in mine) == 1
