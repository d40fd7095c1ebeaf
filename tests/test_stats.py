"""nanofp8/stats.py: the statistics find what was planted (an outlier, a tiny gradient), agree with
an independent count, the Linear table and strict mode report what cannot run in FP8, and
collecting statistics leaves training bit-identical."""

import json
import math
import re

import pytest
import torch
import torch.nn as nn

import bench
import conftest
import train
from nanofp8 import device, emulate, fp8, stats
from nanofp8.fp8 import BLOCK, E4M3, E5M2, GRANULARITIES, Recipe, convert_to_fp8, dequantize, quantize, sqnr
from nanofp8.model import GPT, GPTConfig, apply_fp8

pytestmark = pytest.mark.usefixtures("shakespeare")  # the training runs at the end

# ---------------------------------------------------------------------------------------------
# planted faults, found in exactly the layer that has them

D = 64


def toy(recipe):
    """Three Fp8Linears with LayerNorms between them: layers '0', '2', '4'."""
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(D, D), nn.LayerNorm(D), nn.Linear(D, D), nn.LayerNorm(D), nn.Linear(D, D))
    return convert_to_fp8(seq, recipe)


def run(model, collector, steps, it0=0, seed=0):
    """Forward and backward, statistics on every step, the same batch every time (the weights do
    not change either): a planted fault is the only difference. Returns the records by
    (iter, layer, operand)."""
    out = {}
    for i in range(it0, it0 + steps):
        x = torch.randn(128, D, generator=torch.Generator().manual_seed(seed))
        collector.start()
        model(x).square().mean().backward()
        collector.finish(i)
        out.update({(r["iter"], r["layer"], r["operand"]): r for r in collector.records})
    return out


def test_outlier_channel_saturates_only_that_layers_input(tmp_path):
    # Delayed scaling: the scale comes from earlier steps, so a sudden outlier overflows it. A
    # margin of 1 (2x headroom) absorbs the ordinary step-to-step growth of the clean steps.
    model = toy(Recipe(scaling="delayed", margin=1, backend="emulate"))
    st = stats.Fp8Stats(model, 1, str(tmp_path))
    clean = run(model, st, 4)
    channel = 5

    def outlier(mod, args):  # channel x 1e4 in the forward pass; the gradient passes unchanged
        x = args[0]
        boost = torch.zeros_like(x)
        boost[:, channel] = x[:, channel].detach() * (1e4 - 1)
        return (x + boost,)

    hook = model[2].register_forward_pre_hook(outlier)
    hit = run(model, st, 1, it0=4)
    hook.remove()
    sat = {k[1:]: r["saturation"] for k, r in hit.items()}
    assert sat["2", "x"] > 0  # the channel's values were clipped at 448 ...
    assert sat["2", "x"] <= 1 / D + 1e-9  # ... and only they (one channel of D)
    assert all(v == 0 for k, v in sat.items() if k != ("2", "x")), sat
    assert hit[4, "2", "x"]["sqnr_db"] < clean[3, "2", "x"]["sqnr_db"] - 20
    assert min(hit.values(), key=lambda r: r["sqnr_db"])["layer"] == "2"
    line = stats.summary_line(4, list(hit.values()))
    assert "(2 x)" in line and f"saturated {hit[4, '2', 'x']['saturated_count']} of" in line
    # every clean step: nothing saturates, SQNR of E4M3 / E5M2 round-to-nearest
    assert all(r["saturation"] == 0 for r in clean.values())
    assert all(29 < r["sqnr_db"] < 33 for r in clean.values() if r["format"] == "e4m3")
    assert all(23 < r["sqnr_db"] < 27 for r in clean.values() if r["format"] == "e5m2")
    # written as JSON lines, one per (step, layer, operand)
    lines = (tmp_path / "fp8_stats.jsonl").read_text().splitlines()
    assert len(lines) == len(clean) + len(hit) and json.loads(lines[-1])["iter"] == 4


def test_outlier_under_current_scaling_squeezes_the_rest_into_subnormals():
    """Current scaling fits the scale to the outlier: nothing saturates, the other channels drop
    into the subnormals and below, and the SQNR of the whole tensor, dominated by the outlier's
    energy, barely moves: only the fractions show it."""
    model = toy(Recipe(scaling="current", backend="emulate"))
    st = stats.Fp8Stats(model, 1)
    model[2].register_forward_pre_hook(lambda m, a: (a[0] * torch.where(torch.arange(D) == 5, 1e4, 1.0),))
    recs = {k[1:]: r for k, r in run(model, st, 1).items()}
    assert all(r["saturation"] == 0 for r in recs.values())
    assert recs["2", "x"]["subnormal"] > 0.3 and recs["2", "x"]["underflow"] > 0.01
    assert recs["2", "x"]["sqnr_db"] > 29
    assert all(r["subnormal"] < 0.01 and r["underflow"] < 0.01 for k, r in recs.items() if k != ("2", "x"))


def test_tiny_gradient_underflows_in_that_layer():
    model = toy(Recipe(scaling="delayed", backend="emulate"))
    st = stats.Fp8Stats(model, 1)
    run(model, st, 4)  # the gradient amax history of normal steps

    def tiny(mod, args, out):  # the gradient reaching the first layer's output, x 1e-12
        out.register_hook(lambda g: g * 1e-12)

    model[0].register_forward_hook(tiny)
    recs = run(model, st, 1, it0=4)
    und = {k[1:]: r["underflow"] for k, r in recs.items()}
    assert und["0", "dy"] > 0.9
    assert all(v < 0.01 for k, v in und.items() if k != ("0", "dy")), und
    assert recs[4, "0", "dy"]["sqnr_db"] < 1


@pytest.mark.parametrize("gran,ops", [("tensor", {"x", "w", "dy"}), ("row", {"x", "w", "dy", "xT", "wT", "dyT"}),
                                      ("block", {"x", "w", "dy", "xT", "dyT"})])
def test_transposed_operands_recorded_when_they_are_separate_casts(gran, ops):
    """wT, xT, dyT are recorded where they are cast anew (row, 1x128 tiles), not where they are
    transposes of the forward cast (tensor scales, 128x128 weight tiles)."""
    st = stats.Fp8Stats(toy(Recipe(granularity=gran, backend="emulate")), 1)
    recs = run(st.model, st, 1)
    assert {k[2] for k in recs} == ops
    spread = {k[2]: r["scale_spread"] for k, r in recs.items() if k[1] == "2"}
    assert all(v == 0 for v in spread.values()) if gran == "tensor" else spread["x"] > 0


# ---------------------------------------------------------------------------------------------
# the fractions against an independent count on the dequantized tensors

HALF_STEP_ABOVE_MAX = {"e4m3": 464.0, "e5m2": 61440.0}  # where a cast without clamping rounds up


def nasty(rows, cols, seed):
    """Magnitudes over 60 binades, signs, exact zeros, a NaN, and a few rows 1e6 louder."""
    g = torch.Generator().manual_seed(seed)
    x = torch.exp2(torch.rand(rows, cols, generator=g) * 60 - 40) * torch.sign(torch.randn(rows, cols, generator=g))
    x[torch.rand(rows, cols, generator=g) < 0.1] = 0
    x[::7] *= 1e6
    x[3, 4] = float("nan")
    return x


def expand(scale, q):
    """Per-element scales, by repeat_interleave (not fp8.py's gather)."""
    if q.granularity == "tensor":
        return scale.expand(q.data.shape)
    if q.granularity == "row":
        return scale.expand(q.data.shape)
    br, bc = q.block
    return scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)[: q.data.shape[0], : q.data.shape[1]]


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("gran,block", [("tensor", (1, BLOCK)), ("row", (1, BLOCK)), ("block", (1, BLOCK)),
                                        ("block", (BLOCK, BLOCK))])
def test_fractions_match_an_independent_count(fmt, gran, block):
    x = nasty(200, 300, seed=sum(map(ord, f"{fmt.name}{gran}{block}")))
    q0 = quantize(x, fmt, gran, block)
    # a scale 64x too large for a tenth of the rows/tiles: those saturate, as under a stale scale
    scale = q0.scale.clone()
    scale.view(-1)[:: 10] *= 64
    q = quantize(x, fmt, gran, block, scale=scale)
    got = stats.summarize(*[t.cpu() for t in stats.cast_stats(x, q)])

    x64, deq = x.double(), dequantize(q, torch.float32).double()
    s64 = expand(q.scale.double(), q)
    finite = torch.isfinite(x64)
    nonzero = finite & (x64 != 0)
    underflow = (nonzero & (deq == 0)).sum().item() / nonzero.sum().item()
    # (deq * scale is the FP8 value up to the rounding of 1/scale; subnormals end at 0.875 (E4M3)
    # or 0.75 (E5M2) of the smallest normal, so 0.95 of it cleanly separates them)
    subnormal = ((deq != 0) & ((deq * s64).abs() < 0.95 * fmt.min_normal)).sum().item() / x.numel()
    saturated = (finite & ((x64 * s64).abs() > HALF_STEP_ABOVE_MAX[fmt.name])).sum().item()
    assert saturated > 0 and got["saturated_count"] == saturated
    assert got["saturation"] == saturated / x.numel()
    assert got["underflow"] == underflow and got["subnormal"] == subnormal
    if gran != "block" or block == (1, BLOCK):
        assert got["underflow_count"] > 0 and got["subnormal"] > 0  # the test sees both
    assert got["nonfinite"] == 1
    xs, ds = torch.where(finite, x64, 0.0), torch.where(finite, deq, 0.0)
    assert got["sqnr_db"] == pytest.approx(sqnr(xs, ds), abs=1e-9)
    assert got["amax"] == xs.abs().max().item()
    assert got["scale_max"] == q.scale.max().item() and got["scale_min"] == q.scale.min().item()
    spread = math.log2(q.scale.max().item() / q.scale.min().item())
    assert got["scale_spread"] == pytest.approx(spread, abs=1e-12)
    assert (got["scale"] is None) == (spread > 0)


def test_current_scaling_leaves_nothing_saturated():
    """The amax element lands on the max itself (its product with the scale may round just above
    it in fp32): not a saturation."""
    for seed in range(20):
        x = torch.randn(64, 96, generator=torch.Generator().manual_seed(seed)) * 10.0 ** (seed - 10)
        for fmt in (E4M3, E5M2):
            for gran in GRANULARITIES:
                got = stats.summarize(*stats.cast_stats(x, quantize(x, fmt, gran)))
                assert got["saturation"] == 0, (seed, fmt.name, gran)


def test_micro_steps_add_up():
    """Over micro-steps the counts and the signal and noise powers are summed."""
    model = toy(Recipe(backend="emulate"))
    st = stats.Fp8Stats(model, 1)
    xs = [torch.randn(32, D, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    st.start()
    for x in xs:
        model[0](x)
    st.finish(0)
    both = {r["operand"]: r for r in st.records if r["layer"] == "0"}
    one = [stats.summarize(*stats.cast_stats(x, quantize(x, E4M3))) for x in xs]
    assert both["x"]["n"] == sum(r["n"] for r in one) == 64 * D
    assert both["x"]["amax"] == max(r["amax"] for r in one)
    signals = [(x.double() ** 2).sum().item() for x in xs]
    noise = sum(sig / 10 ** (r["sqnr_db"] / 10) for r, sig in zip(one, signals))
    signal = sum(signals)
    assert both["x"]["sqnr_db"] == pytest.approx(10 * math.log10(signal / noise), abs=1e-6)


# ---------------------------------------------------------------------------------------------
# what ran in FP8, and strict mode


def test_linear_table_names_why_not():
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, vocab_size=84, block_size=16))
    apply_fp8(model, Recipe(backend="emulate"), fp8_lm_head=True)
    rows = {r["layer"]: r for r in stats.linear_table(model)}
    assert rows["lm_head"]["fp8"] is False and rows["lm_head"]["why"] == "shape: K=32, N=84 not multiples of 16"
    assert rows["blocks.0.mlp.c_fc"]["fp8"] is True and rows["blocks.0.mlp.c_fc"]["backend"] == "emulate"
    assert rows["blocks.0.mlp.c_fc"]["recipe"] == "tensorwise (current/tensor/hybrid)"
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, vocab_size=96, block_size=16))
    apply_fp8(model, Recipe(backend="emulate"))  # LM head left out by choice
    assert {r["layer"]: r for r in stats.linear_table(model)}["lm_head"]["why"].startswith("filter")
    text = stats.format_linear_table(stats.linear_table(model))
    assert text.splitlines()[0].split() == ["layer", "shape", "fp8", "recipe", "backend", "why"]


def cuda_like_scaled_mm(real):
    """A stand-in for torch._scaled_mm with CUDA's rule: the second operand's dims in multiples
    of 16 (CPU's own kernel takes any shape)."""

    def scaled_mm(a, b, **kw):
        if b.shape[0] % 16 or b.shape[1] % 16:
            raise RuntimeError(f"stand-in: mat2 {tuple(b.shape)} dims must be multiples of 16")
        return real(a, b, **kw)

    return scaled_mm


def test_runtime_fallbacks_are_counted_and_strict_raises(monkeypatch):
    monkeypatch.setattr(torch, "_scaled_mm", cuda_like_scaled_mm(torch._scaled_mm))
    monkeypatch.setattr(emulate, "handles", lambda t: False)  # reach the kernel, not the CPU emulation
    monkeypatch.setattr(device, "fallbacks", {})
    lin = convert_to_fp8(nn.Linear(84, 64), Recipe(backend="torch"))  # K = 84
    x = torch.randn(8, 84, requires_grad=True)
    with pytest.warns(UserWarning, match="falling back"):
        lin(x).sum().backward()
    assert device.fallbacks == {"linear": 3}  # forward, dgrad, wgrad
    assert stats.fallback_line().endswith(": 3 (linear: 3)")
    ok = convert_to_fp8(nn.Linear(64, 64), Recipe(backend="torch"))
    ok(torch.randn(16, 64, requires_grad=True)).sum().backward()
    assert device.fallbacks == {"linear": 3}  # multiples of 16: ran in "FP8"
    monkeypatch.setattr(device, "strict", True)
    with pytest.raises(RuntimeError, match="strict mode"):
        lin(x)


# conftest's tiny model, 3 steps of 2 micro-batches, no checkpoint
TINY = conftest.TINY + ["eval_iters=1", "max_iters=3", "lr_decay_iters=3", "eval_interval=3",
                        "gradient_accumulation_steps=2", "always_save_checkpoint=False"]


def test_train_strict_refuses_an_fp8_lm_head_that_cannot_be(tmp_path, capsys):
    with pytest.raises(train.ConfigError, match="fp8_strict"):
        train.main(TINY + ["precision=O1", "fp8_lm_head=True", "fp8_strict=True", f"out_dir={tmp_path}"])
    with pytest.raises(train.ConfigError, match="compile"):
        train.load_config(TINY + ["fp8_stats_interval=2", "compile=True"])
    with pytest.raises(train.ConfigError, match="fp8_alarm"):
        train.load_config(TINY + ["fp8_alarm_intervals=0"])


# ---------------------------------------------------------------------------------------------
# in training: bit-identical, logged, drawn


@pytest.mark.slow
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_statistics_leave_training_bit_identical(tmp_path, capsys, monkeypatch, level):
    off = train.main(TINY + [f"precision={level}", f"out_dir={tmp_path / 'off'}"])
    log_off = capsys.readouterr().out
    assert not (tmp_path / "off" / "fp8_stats.jsonl").exists()
    assert "fp8 stats" not in log_off
    assert "blocks.0.mlp.c_fc" in log_off and "lm_head" in log_off  # the start-up table
    assert "fell back to high precision at run time: 0" in log_off
    # (an SQNR threshold above what E4M3 reaches: every cast alarms at its second statistics step)
    on = train.main(TINY + [f"precision={level}", f"out_dir={tmp_path / 'on'}", "fp8_stats_interval=2",
                            "fp8_alarm_sqnr_db=40", "fp8_alarm_intervals=2"])
    log_on = capsys.readouterr().out
    assert "ALARM fp8 sqnr: blocks.0.attn.c_attn x (e4m3) below threshold for 2" in log_on
    assert "ALARM" not in log_on.split("fp8 stats iter 2")[0]
    assert on["losses"] == off["losses"] and on["evals"] == off["evals"]  # bit for bit
    recs = stats.read_records(tmp_path / "on" / "fp8_stats.jsonl")
    assert sorted({r["iter"] for r in recs}) == [0, 2]
    assert log_on.count("fp8 stats iter") == 2 and "worst SQNR" in log_on
    ops = {r["operand"] for r in recs}
    assert ops == ({"x", "w", "dy"} | ({"wgrad", "m", "v"} if level == "O2" else set()))
    if level == "O2":
        bench.main(["stats", str(tmp_path / "on"), "--out", str(tmp_path / "png")])
        assert (tmp_path / "png" / "fp8_stats_heatmap.png").stat().st_size > 10000
        assert (tmp_path / "png" / "fp8_stats_amax.png").stat().st_size > 10000
    if level == "O2":
        return
    # off means off: the collector is never even built
    monkeypatch.setattr(train, "Fp8Stats", None)
    again = train.main(TINY + [f"precision={level}", f"out_dir={tmp_path / 'off2'}"])
    assert again["losses"] == off["losses"]


def test_alarms_need_a_streak_and_amax_growth_fires_per_factor():
    # (saturation_severe above the 10% below: the streak rule alone)
    st = stats.Fp8Stats(nn.Linear(2, 2), 1, alarms=stats.Alarms(saturation=0.01, intervals=3, amax_growth=10,
                                                                saturation_severe=0.5))

    def rec(sat, amax, sqnr=30.0):
        return {"layer": "l", "operand": "x", "format": "e4m3", "saturation": sat, "underflow": 0.0,
                "sqnr_db": sqnr, "amax": amax}

    lines = [st._check_alarms(i, [rec(s, a)]) for i, (s, a) in
             enumerate([(0.1, 1), (0.1, 2), (0.0, 3), (0.1, 4), (0.1, 5), (0.1, 9), (0.1, 12), (0.1, 150)])]
    flat = [(i, x) for i, ls in enumerate(lines) for x in ls]
    sat = [i for i, x in flat if "saturation" in x]
    assert sat == [5]  # three in a row only after the clean step 2; once per streak
    growth = [i for i, x in flat if "amax growth" in x]
    assert growth == [6, 7]  # x12 (past 10), then x150 (past 100)


def test_bench_stats_cost_runs(capsys):
    bench.main(["stats", "--cost", "--model", "tiny", "--steps", "2"])
    out = capsys.readouterr().out
    assert "every 100" in out and "every 1" in out and "ms_per_step" in out


def test_one_severe_saturation_alarms_at_once():
    """More than saturation_severe (1% by default) of an operand clipped on a single statistics
    step raises the alarm on that step, with no streak; below it, the streak rule applies."""
    st = stats.Fp8Stats(nn.Linear(2, 2), 1)

    def rec(sat):
        return {"layer": "blocks.0.mlp.c_fc", "operand": "x", "format": "e4m3", "saturation": sat,
                "underflow": 0.0, "sqnr_db": 30.0, "amax": 1.0}

    lines = [st._check_alarms(i, [rec(s)]) for i, s in enumerate([0.0, 0.005, 0.0, 0.96, 0.0])]
    assert [len(ls) for ls in lines] == [0, 0, 0, 1, 0]
    assert lines[3][0] == ("ALARM fp8 saturation: blocks.0.mlp.c_fc x (e4m3) 96.000% of its values clipped at "
                           "the FP8 max on this statistics step (severe: above 1.000%)")
    with pytest.raises(ValueError, match="bad alarm thresholds"):
        stats.Alarms(saturation_severe=2.0)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_clipping_is_logged_on_the_step_it_happens(tmp_path, capsys, monkeypatch, level):
    """Delayed scaling, statistics off: the input of one layer jumps 100x at iteration 4. The log
    names that layer, its role and the fraction clipped, on iteration 4; the counts are the layer's
    own `clipped` buffer, which the checkpoint keeps."""
    real = train.setup_precision
    jumps = {"calls": 0}

    def setup(model, cfg, device_type):
        desc = real(model, cfg, device_type)

        def jump(mod, args):
            if mod.training:  # (evaluation passes are not training steps)
                jumps["calls"] += 1
                if jumps["calls"] == 5:  # iteration 4: one micro-batch per iteration
                    return (args[0] * 100,)

        model.blocks[0].mlp.c_fc.register_forward_pre_hook(jump)
        return desc

    monkeypatch.setattr(train, "setup_precision", setup)
    train.main(conftest.TINY + [f"precision={level}", "fp8_scaling=delayed", "max_iters=6", "eval_interval=6",
                                "always_save_checkpoint=True", f"out_dir={tmp_path}"])
    log = capsys.readouterr().out
    lines = {int(line.split(":")[0][5:]): line for line in log.splitlines() if "FP8 clipping" in line}
    print("\n".join(lines.values()))
    # the largest fraction first: that layer's input, nearly all of it
    n_clipped, n_cast = (int(v.replace(",", "")) for v in
                         re.search(r"max: blocks.0.mlp.c_fc x \(e4m3\) [\d.]+% \(([\d,]+) of ([\d,]+)\)", lines[4]).groups())
    assert n_cast == 4 * 32 * 32 and n_clipped > 0.9 * n_cast  # (batch_size 4 x block_size 32 tokens, n_embd 32)
    others = [re.search(r"c_fc x \(e4m3\) ([\d.]+)%", line) for it, line in lines.items() if it != 4]
    assert all(float(m[1]) < 1 for m in others if m), lines  # (at most the early growth of the weights)
    ckpt = torch.load(conftest.newest_checkpoint(tmp_path), weights_only=True)
    assert ckpt["model"]["blocks.0.mlp.c_fc.clipped"][0] >= n_clipped


class Fp8Scores(nn.Module):
    """q k^T with both operands in FP8 (batched, one scale per row), as an FP8 attention computes
    its scores: not an Fp8Linear, but a module with an `observer` slot that reports its casts."""
    observer, fqn = None, "attn.scores"

    def forward(self, q, k):
        fq, fk = quantize(q, E4M3, "row"), quantize(k, E4M3, "row")
        if self.observer is not None:
            self.observer.observe(self, "q", q, fq)
            self.observer.observe(self, "k", k, fk)
        return fp8.scaled_gemm(fq, fk, torch.float32, backend="emulate")


def test_any_module_that_casts_to_fp8_can_be_observed():
    """Statistics are not Fp8Linear's alone: a module with an `observer` slot reports its casts,
    batched ones included, and gets the same records an Fp8Linear's cast would (SQNR of the FP8
    copy against its source, counts over the whole batch)."""
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 4, 16, 32, generator=g), torch.randn(2, 4, 16, 32, generator=g) * 1e-3
    model = nn.Sequential(convert_to_fp8(nn.Linear(32, 32), Recipe(backend="emulate")), Fp8Scores())
    st = stats.Fp8Stats(model, 1)
    st.start()
    model[1](q, k)
    st.finish(0)
    got = {(r["layer"], r["operand"]): r for r in st.records}
    assert set(got) == {("attn.scores", "q"), ("attn.scores", "k")}
    for name, src in (("q", q), ("k", k)):
        rec = got[("attn.scores", name)]
        assert rec["n"] == src.numel() and rec["format"] == "e4m3" and rec["scale_spread"] > 0
        assert rec["sqnr_db"] == pytest.approx(sqnr(src, dequantize(quantize(src, E4M3, "row"))), abs=1e-6)
    assert Fp8Scores.observer is None and model[1].observer is None  # released after the step
