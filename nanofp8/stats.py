"""
Seeing the numerics: what every FP8 cast did to its tensor, layer by layer, and what really ran
in FP8.

When an FP8 loss curve drifts from its bf16 twin, the questions are always the same: which layer,
which tensor, and was it range (values clipped at the top, or flushed to zero at the bottom) or
precision (too few mantissa bits)? nanofp8 owns every cast, so it can answer them for plain
PyTorch. This file is standalone reading: fp8.py, and what sends FP8 between ranks (parallel.py,
dist.py), call it through one `if` per cast site.

1. What is measured, per layer and per GEMM operand
---------------------------------------------------
A Linear's three GEMMs take six FP8 operands (fp8.py, section 3):

    forward  y  = x   @ w^T        operands "x"   and "w"
    dgrad    dx = dy  @ wT^T       operands "dy"  and "wT"
    wgrad    dW = dyT @ xT^T       operands "dyT" and "xT"

With tensor scales (and for 128x128 weight tiles) wT, xT and dyT are plain transposes of w, x and
dy: the same values, the same statistics, recorded once. With row and 1x128 block scales they are
separate casts along another dimension, and recorded separately. Level O2 adds "wgrad", the FP8
weight gradient it keeps instead of .grad, and, after the optimizer step, "m" and "v", the Adam
moments as stored (FP8 m; fp16 or FP8 v). A tensor-parallel shard adds the partial sums it sends
in FP8 to be summed over its group (nanofp8/parallel.py): "y_partial" (a row shard's output) and
"dx_partial" (a column shard's input gradient); of an all-reduce, its first cast. A pipeline
stage ("pipeline.stage<s>") adds what it sends in FP8: "act" forward, "grad" backward; data
parallelism at O1 ("data_parallel") the weight gradients its buckets send, "grad".

For each cast of a high-precision source s (x * scale rounded to FP8 gives the code c):

    amax         max |s|, the number the scale is made from.
    scale        the multiply-before-cast factor; with row/block scales its min and max, and
                 spread = log2(max / min) in binades: how differently the rows or tiles were
                 scaled (0 for one tensor scale). A wide spread says that one scale for the
                 tensor would have cost range.
    underflow    fraction of the *non-zero* values of s whose code is 0: flushed to zero,
                 their information lost. Exact zeros of s (ReLU, padding) are not counted.
    subnormal    fraction of values whose code is a subnormal (0 < |c| < smallest normal): they
                 kept fewer than the format's mantissa bits; the step before underflow.
    saturation   fraction of values the clamp changed: |s * scale| beyond the largest finite
                 value by more than half a step there (so it would have rounded above it). Those
                 values were clipped to +-max. With current scaling the scale comes from the
                 tensor's own amax, so nothing saturates; with delayed scaling a stale scale
                 clips values that outgrew the history. MX is the exception: its rule (fp8.py,
                 mx_scale) puts a block's amax in [256, 512) x 2^k, so values above 448 x 2^k
                 are clipped *by design*, at most 12.5% each: about 0.6% of a Gaussian's values
                 (the blocks whose max has a mantissa above 1.75), more for flat blocks.
    saturation_rule  the part of saturation that MX's rule clips by design (below 2^(emax+1),
                 512 for E4M3, times the block's scale); 0 for every other recipe. The alarms
                 (section 3) count only the rest.
    sqnr_db      10 log10(sum s^2 / sum (s - dequantized)^2): signal to quantization noise of
                 the whole FP8 copy. Round-to-nearest into 3 (E4M3) or 2 (E5M2) mantissa bits
                 gives about 31 and 25 dB on well-scaled data; saturation and underflow pull it
                 lower, and a low SQNR in one layer is where to look first.

The counts and sums add up: over the micro-steps of a statistics step they are summed, and the
fractions and the SQNR are taken of the sums (SQNR of all the signal over all the noise). Each
cast's statistics stay on the device as one small tensor until the step's records are written,
when they all come to the CPU in one transfer.

2. When, and what it costs
--------------------------
Every `interval` steps (train.py: fp8_stats_interval; 0, the default, turns it off) the
collector hangs itself as `observer` for one step on every Fp8Linear, and on any other module
with an `observer` slot (which reports its casts with observer.observe(module, operand, source,
fp8_tensor)); the hooks see `observer is None` on all other steps and skip. Observing reads
tensors and never writes them, so the training step is bit-identical with statistics on or off
(tests/test_stats.py). Records go to out_dir/fp8_stats.jsonl, one JSON object per (step, layer,
operand); the log gets one line per statistics step: the worst layer by SQNR and the saturated and
underflowed totals. Statistics are computed in eager mode (train.py turns compile off for them).

3. Alarms
---------
A threshold crossed once is noise; crossed for `intervals` statistics steps in a row by the same
operand, it is a trend: saturation or underflow above its threshold, SQNR below its own. One
exception: more than `saturation_severe` (1%) of an operand's values clipped on a single step is
damage already done (a 100x jump of an activation under delayed scaling clips nearly all of it),
so it raises the alarm at once. The
amax-growth alarm follows the slow drift that Fishman et al. (Smooth-SwiGLU, 2024) traced late
FP8 divergence to: the input of an MLP's down projection growing outliers over a long run, until
it outgrows the format. It fires when an activation's or weight's amax has grown `amax_growth`
times over its first recorded value, and again at every further factor.

4. Clipping, seen without the statistics
----------------------------------------
Only delayed scaling clips (section 1), and a clipped step is applied like any other. So every
Fp8Linear counts what its delayed-scaling casts clip, per tensor role, always (fp8.py's `clipped`
buffer, saved with the model), and ClipLog turns a change of those counts into a line of the
training log on the step it happens: the layer, the role and the fraction of its values clipped.
Checking costs nothing extra: a flag rides in the training step's one device-to-host copy
(train.py's optimizer_step), and the counts are read only on a step that clipped.

5. What ran in FP8
------------------
linear_table(model) lists every Linear: whether it is FP8, why not (the module filter, or a shape
FP8 tensor cores cannot take), and its recipe and backend. fp8.py counts the GEMMs that fell back
to high precision at run time (device.fallbacks, per layer); with device.strict = True a fallback
raises instead of warning once.
"""

import json
import math
import os
from dataclasses import dataclass

import torch
import torch.nn as nn

from . import device
from .ckptfile import write_file
from .fp8 import GRAD_OUTPUT, INPUT, WEIGHT, Fp8Linear, Fp8Tensor, clip_edge, dequantize
from .mx import is_mx


# The additive statistics of a cast, in this order, then the ones that combine by max.
SUMS = ("n", "nonfinite", "nonzero", "underflow", "subnormal", "saturated", "saturated_rule", "signal", "noise")
MAXES = ("amax", "neg_scale_min", "scale_max")


def cast_stats(src, q):
    """The statistics of one cast: src (the high-precision source, q.data's shape once flattened
    to 2-D) and q (its Fp8Tensor). Returns (sums, maxes), float64 tensors on src's device."""
    codes = q.data.float().abs()  # |s * scale| after rounding, in the format's own units
    s = src.detach().float().reshape(codes.shape)
    finite = torch.isfinite(s)
    s = torch.where(finite, s, 0.0)  # a NaN/inf is counted as such and kept out of the sums
    deq = dequantize(q, torch.float32).reshape(codes.shape)
    deq = torch.where(finite, deq, 0.0)
    nonzero = s != 0
    # Saturated: the code is the format's max and s lay beyond the rounding boundary above it,
    # i.e. |s| > |deq| * boundary / max, with |deq| = max / scale (no per-element scale needed).
    edge = clip_edge(q.fmt) / q.fmt.max
    saturated = (codes == q.fmt.max) & (s.abs() > deq.abs() * edge)
    # MX's rule clips what lies below the top of its block's binade, 2^(emax + 1) x 2^k, by design
    top = 2.0 ** (math.floor(math.log2(q.fmt.max)) + 1) / q.fmt.max
    by_rule = saturated & (s.abs() < deq.abs() * top) if is_mx(q) else torch.zeros_like(saturated)
    f64 = torch.float64
    sums = torch.stack([
        torch.tensor(float(s.numel()), dtype=f64, device=s.device),
        (~finite).sum(dtype=f64),
        nonzero.sum(dtype=f64),
        (nonzero & (codes == 0)).sum(dtype=f64),
        ((codes > 0) & (codes < q.fmt.min_normal)).sum(dtype=f64),
        saturated.sum(dtype=f64),
        by_rule.sum(dtype=f64),
        s.double().square().sum(),
        (s.double() - deq.double()).square().sum(),
    ])
    scale = q.scale.double()
    maxes = torch.stack([s.abs().amax().double(), -scale.min(), scale.max()])
    return sums, maxes


def summarize(sums, maxes):
    """sums, maxes (on the CPU) -> the record's numbers: fractions, SQNR in dB, scale spread."""
    v = dict(zip(SUMS, sums.tolist()))
    amax, neg_min, smax = maxes.tolist()  # in the order of MAXES
    n = max(v["n"], 1.0)
    noise, signal = v["noise"], v["signal"]
    sqnr = None if noise == 0 else (10 * math.log10(signal / noise) if signal > 0 else -math.inf)
    smin = -neg_min
    return {"n": int(v["n"]), "amax": amax, "scale": smax if smin == smax else None,
            "scale_min": smin, "scale_max": smax,
            "scale_spread": math.log2(smax / smin) if smin > 0 else None,
            "underflow": v["underflow"] / max(v["nonzero"], 1.0), "subnormal": v["subnormal"] / n,
            "saturation": v["saturated"] / n, "saturation_rule": v["saturated_rule"] / n, "sqnr_db": sqnr,
            "nonfinite": int(v["nonfinite"]), "saturated_count": int(v["saturated"]),
            "saturated_rule_count": int(v["saturated_rule"]), "underflow_count": int(v["underflow"])}


def stored_stats(data, scale, fmt):
    """Statistics of a tensor held only in its low-precision form (O2's Adam moments: the fp32
    value they were cast from is gone), with one scale or one per block (optim.state_block):
    amax, the scales (and their spread in binades), subnormal fraction, and the fraction of
    exact zeros (zeros of the source and underflows cannot be told apart any more)."""
    codes = data.float().reshape(scale.shape[0] if scale.dim() else 1, -1).abs()
    n = codes.numel()
    s = scale.double().reshape(-1, 1)
    smin, smax = float(s.min()), float(s.max())
    return {"n": n, "amax": float((codes / s).amax()), "scale": smax if smin == smax else None,
            "scale_min": smin, "scale_max": smax, "scale_spread": math.log2(smax / smin) if smin > 0 else None,
            "zeros": float((codes == 0).sum()) / n,
            "subnormal": float(((codes > 0) & (codes < fmt.min_normal)).sum()) / n}


# -----------------------------------------------------------------------------
# The collector


@dataclass
class Alarms:
    saturation: float = 1e-4  # fraction of values clipped at +-max (not counting MX's clipping by design)
    underflow: float = 0.05  # fraction of non-zero values flushed to zero
    sqnr_db: float = 15.0  # below this (E4M3 casts give ~31 dB, E5M2 ~25 dB when well scaled)
    intervals: int = 3  # consecutive statistics steps before an alarm
    amax_growth: float = 10.0  # activation/weight amax grown this many times since first seen
    saturation_severe: float = 0.01  # this fraction clipped on one statistics step: an alarm at once

    def __post_init__(self):
        if self.intervals < 1 or self.amax_growth <= 1 or not 0 <= self.saturation <= 1 \
                or not 0 <= self.underflow <= 1 or not 0 <= self.saturation_severe <= 1:
            raise ValueError(f"bad alarm thresholds {self}: need intervals >= 1, amax_growth > 1, "
                             "fractions in [0, 1]")


class Fp8Stats:
    """Statistics of every FP8 cast of `model`'s Fp8Linears (and of any module with an `observer`
    slot) on every `interval`-th step.

    Use: `if stats.due(it): stats.start()` before the step's forward passes, and
    `stats.finish(it, optimizer)` after its optimizer step; finish returns the lines to log.
    A model cut over ranks (tensor or pipeline parallelism): `gather=True` on every rank, and
    finish (a collective then) merges what the `active` ranks (those of one data-parallel replica)
    observed into the records of whole layers: the counts and sums of a sharded operand add up
    over its shards (section 1), a replicated one is counted on one rank of its group, and each
    pipeline stage brings its own layers."""

    def __init__(self, model, interval, out_dir=None, alarms=None, start_iter=0, gather=False, active=True):
        if interval < 0:
            raise ValueError(f"interval must be >= 0 (0 = off), got {interval}")
        self.model, self.interval, self.alarms = model, interval, alarms or Alarms()
        self.path = None if out_dir is None else os.path.join(out_dir, "fp8_stats.jsonl")
        self.note = None  # what a resumed run (start_iter > 0) dropped from the file: it writes them again
        if self.path and start_iter > 0:
            self.note = trim_jsonl(self.path, start_iter)
        elif self.path and os.path.exists(self.path):
            os.remove(self.path)
        self.acc = {}  # (layer, operand) -> [fmt name, sums, maxes], summed over micro-steps
        self.streak = {}  # (layer, operand, kind) -> consecutive statistics steps over threshold
        self.first_amax = {}  # (layer, operand) -> (iter, amax) at the first record
        self.amax_alarmed = {}  # (layer, operand) -> growth factor already reported
        self.records = []  # the last step's records (also written to the file)
        self.observing, self.gather, self.active = False, gather, active

    def due(self, it):
        return self.interval > 0 and it % self.interval == 0

    def modules(self):
        """What takes part: every module with an `observer` slot (Fp8Linear's; any module that casts
        to FP8 may have one, and an `fqn`, and report each cast with observer.observe)."""
        return [m for m in self.model.modules() if hasattr(m, "observer")]

    def start(self):
        self.acc, self.observing = {}, True
        for m in self.modules() if self.active else ():
            m.observer = self

    # ---- called from fp8.py, optim.py (O2's gradient), parallel.py and dist.py (what they send)

    @torch.no_grad()
    def observe(self, mod, operand, src, q):
        """One cast of mod's: its high-precision source src and its Fp8Tensor q (an operand that the
        recipe keeps in high precision, q not an Fp8Tensor, was not cast: nothing to record)."""
        if not isinstance(q, Fp8Tensor) or _counted_elsewhere(mod, operand):
            return
        sums, maxes = cast_stats(src, q)
        key = (mod.fqn, operand)
        if key in self.acc:
            _, s0, m0 = self.acc[key]
            sums, maxes = s0 + sums, torch.maximum(m0, maxes)
        self.acc[key] = [q.fmt.name, sums, maxes]

    @torch.no_grad()
    def observe_forward(self, mod, x2, qx, qx_t, qw, qw_t):
        """x2: None where x arrived cast (a shard's gather recorded that cast, of its slice)."""
        w = mod.hp_weight().detach()
        if x2 is not None:
            self.observe(mod, "x", x2, qx)
        self.observe(mod, "w", w, qw)
        # a transpose of the same cast (t() keeps the amax tensor) has the same statistics
        if qx_t.amax is not qx.amax:
            self.observe(mod, "xT", (dequantize(qx, torch.float32) if x2 is None else x2).t(), qx_t)
        if qw_t.amax is not qw.amax:
            self.observe(mod, "wT", w.t(), qw_t)

    @torch.no_grad()
    def observe_backward(self, mod, dy2, qdy, qdy_t):
        if dy2 is not None:
            self.observe(mod, "dy", dy2, qdy)
        if qdy_t is not None and qdy_t.amax is not qdy.amax:
            self.observe(mod, "dyT", (dequantize(qdy, torch.float32) if dy2 is None else dy2).t(), qdy_t)

    def observe_wgrad(self, mod, dw, q):
        self.observe(mod, "wgrad", dw, q)

    # ---- the end of a statistics step

    def finish(self, it, optimizer=None):
        """Stop observing; write this step's records; return the log lines (summary, alarms).
        Returns nothing (and does nothing) when start() was not called."""
        if not self.observing:
            return []
        self.observing = False
        for m in self.modules():
            m.observer = None
        keys = list(self.acc)
        # one transfer (one device sync) for all the layers' numbers
        rows = [torch.cat([self.acc[k][1], self.acc[k][2]]) for k in keys]
        merged = {k: (self.acc[k][0], row) for k, row in zip(keys, torch.stack(rows).cpu() if rows else [])}
        if self.gather:
            merged = _merge_ranks(merged)
        if not merged:
            return []
        records = []
        for k, (fmt, row) in merged.items():
            rec = {"iter": it, "layer": k[0], "operand": k[1], "format": fmt}
            rec.update(summarize(row[: len(SUMS)], row[len(SUMS):]))
            records.append(rec)
        records += self._moment_records(it, optimizer)
        self.acc, self.records = {}, records
        if self.path:
            with open(self.path, "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in records)
        return [summary_line(it, records)] + self._check_alarms(it, records)

    def _moment_records(self, it, optimizer):
        """O2/O3: the moments of the optimizer's table as stored after the step (Adam: FP8 m; fp16
        or FP8 sqrt(v))."""
        o2, moments = getattr(optimizer, "o2", None), getattr(optimizer, "moments", None)
        if not o2 or not moments:
            return []
        out = []
        for p, mod in o2.items():
            st = optimizer.state.get(p)
            for name, mo in moments.items():
                if st and mo.key + "_scale" in st:
                    rec = {"iter": it, "layer": mod.fqn, "operand": name, "format": mo.fmt.name}
                    rec.update(stored_stats(st[mo.key], st[mo.key + "_scale"], mo.fmt))
                    out.append(rec)
        return out

    def _check_alarms(self, it, records):
        a, lines = self.alarms, []
        for r in records:
            key = (r["layer"], r["operand"])
            r = {**r, "saturation": r.get("saturation", 0) - r.get("saturation_rule", 0)}  # (MX: by design)
            checks = {"saturation": r["saturation"] > a.saturation,
                      "underflow": r.get("underflow", 0) > a.underflow,
                      "sqnr": r.get("sqnr_db") is not None and r["sqnr_db"] < a.sqnr_db}
            for kind, bad in checks.items():
                n = self.streak.get(key + (kind,), 0) + 1 if bad else 0
                self.streak[key + (kind,)] = n
                if kind == "saturation" and r.get("saturation", 0) > a.saturation_severe:  # no waiting
                    lines.append(f"ALARM fp8 saturation: {key[0]} {key[1]} ({r['format']}) "
                                 f"{_show(kind, r[kind])} of its values clipped at the FP8 max on this "
                                 f"statistics step (severe: above {_show(kind, a.saturation_severe)})")
                elif n == a.intervals:  # once per streak
                    value = r["sqnr_db"] if kind == "sqnr" else r[kind]
                    lines.append(f"ALARM fp8 {kind}: {key[0]} {key[1]} ({r['format']}) "
                                 f"{'below' if kind == 'sqnr' else 'above'} threshold for {n} "
                                 f"statistics steps in a row (now {_show(kind, value)})")
            if r["operand"] in ("x", "w") and r["amax"] > 0 and math.isfinite(r["amax"]):
                first_it, first = self.first_amax.setdefault(key, (it, r["amax"]))
                growth = r["amax"] / first
                told = self.amax_alarmed.get(key, 1.0)
                if growth >= told * a.amax_growth:
                    self.amax_alarmed[key] = told * a.amax_growth ** math.floor(
                        math.log(growth / told) / math.log(a.amax_growth))
                    lines.append(f"ALARM fp8 amax growth: {key[0]} {key[1]} amax {r['amax']:.4g} is "
                                 f"{growth:.1f}x its value at iter {first_it} ({first:.4g})")
        return lines


def trim_jsonl(path, before_iter):
    """Keep the records of a JSON-lines file (fp8_stats.jsonl) from iterations before
    `before_iter`: a resumed run writes the later ones again. A line cut short by a crash goes
    too. Returns a note saying what was dropped, or None."""
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    kept, cut, later = [], 0, 0
    for line in lines:
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            cut += 1
            continue
        if isinstance(rec, dict) and isinstance(rec.get("iter"), int) and rec["iter"] >= before_iter:
            later += 1
            continue
        kept.append(line)
    if not cut and not later:
        return None
    write_file(path, b"".join(line + b"\n" for line in kept))
    what = [f"{cut} damaged line{'s' * (cut > 1)} (cut short by a crash)"] * bool(cut) + [
        f"{later} record{'s' * (later > 1)} of iterations >= {before_iter} (written again now)"] * bool(later)
    return f"{path}: dropped {' and '.join(what)}"


def _counted_elsewhere(mod, operand):
    """A tensor-parallel shard's operand that is the same on every rank of its group (the input a
    column shard reads whole, the gradient a row shard gets whole, unless SP gathered their slices
    in FP8, and what is re-quantized from them): counted by the group's rank 0 only."""
    parallel = getattr(mod, "parallel", None)
    if parallel is None or mod.tp_rank == 0:
        return False
    whole = ("x", "xT") if parallel == "column" else ("dy", "dyT")
    return operand in whole and (operand.endswith("T") or not (mod.sp and mod.comm == "fp8"))


def _merge_ranks(mine):
    """{(layer, operand): (format, row)} of every rank, merged (a collective): sums added, maxes
    maxed (section 1), keys in order of first appearance, stage after stage."""
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, mine)
    merged = {}
    for theirs in everyone:
        for k, (fmt, row) in theirs.items():
            if k in merged:
                old = merged[k][1]
                row = torch.cat([old[: len(SUMS)] + row[: len(SUMS)], torch.maximum(old[len(SUMS):], row[len(SUMS):])])
            merged[k] = (fmt, row)
    return merged


def _show(kind, v):
    return f"{v:.1f} dB" if kind == "sqnr" else f"{100 * v:.3f}%"


def summary_line(it, records):
    """One line for the training log: the worst operand by SQNR, the saturated and underflowed
    totals over every cast of the step."""
    cast = [r for r in records if "saturation" in r]
    if not cast:
        return f"fp8 stats iter {it}: nothing was cast"
    n = sum(r["n"] for r in cast)
    sat = sum(r["saturated_count"] for r in cast)
    rule = sum(r.get("saturated_rule_count", 0) for r in cast)
    und = sum(r["underflow_count"] for r in cast)
    rated = [r for r in cast if r["sqnr_db"] is not None]
    worst = min(rated, key=lambda r: r["sqnr_db"]) if rated else None
    w = (f"worst SQNR {worst['sqnr_db']:.1f} dB ({worst['layer']} {worst['operand']})"
         if worst else "every cast exact")
    by_rule = f" ({rule} of them by MX's rule)" if rule else ""
    return (f"fp8 stats iter {it}: {w}, saturated {sat} of {n:,} values ({100 * sat / n:.4f}%){by_rule}, "
            f"underflowed {und} ({100 * und / n:.4f}%)")


# -----------------------------------------------------------------------------
# Clipping, seen without the statistics (section 4)

ROLES = {INPUT: "x", WEIGHT: "w", GRAD_OUTPUT: "dy"}  # fp8.py's tensor roles, as operands are named here


class ClipLog:
    """The values that the delayed-scaling casts of `model`'s Fp8Linears clipped at the FP8 max,
    reported on the step it happens. After each step: flag() (a device scalar, 1.0 when a count
    moved during the step), read by the caller with its other values and handed to lines()."""

    def __init__(self, model):
        self.mods = [m for m in model.modules() if isinstance(m, Fp8Linear) and m.recipe.scaling == "delayed"]
        if self.mods:
            self.clipped, self.cast = self._counts()  # at the end of the last step (device)
            self.before = self.cast  # values cast before the step now ending

    def _counts(self):
        return (torch.stack([m.clipped for m in self.mods]).clone(),
                torch.stack([m.cast_values for m in self.mods]).clone())

    def flag(self):
        if not self.mods:
            return torch.zeros(())
        clipped, cast = self._counts()
        moved = (clipped != self.clipped).any().float()
        self.before, self.clipped_before = self.cast, self.clipped
        self.clipped, self.cast = clipped, cast
        return moved

    def lines(self, it, flag, most=5):
        """The log line of step `it` (none unless `flag`, flag()'s value, is set): every layer and
        role that clipped during the step, the largest fraction of the values it cast first (the
        `most` largest named, the others counted)."""
        if not flag:
            return []
        clipped, cast = (torch.stack([self.clipped - self.clipped_before, self.cast - self.before])
                         .cpu().tolist())  # (one read, on a step that clipped)
        hits = []
        for m, c, n in zip(self.mods, clipped, cast):
            for role, name in ROLES.items():
                if c[role]:
                    fmt = m.recipe.bwd_fmt if role == GRAD_OUTPUT else m.recipe.fwd_fmt
                    hits.append((c[role] / max(n[role], 1), f"{m.fqn} {name} ({fmt.name})", c[role], n[role]))
        hits.sort(key=lambda h: -h[0])
        named = ", ".join(f"{what} {_show('saturation', frac)} ({c:,} of {n:,})" for frac, what, c, n in hits[:most])
        more = f", and {len(hits) - most} more" if len(hits) > most else ""
        return [f"iter {it}: FP8 clipping (delayed scaling), values clipped at the format's max: {named}{more}"]


# -----------------------------------------------------------------------------
# What ran in FP8


def linear_table(model):
    """One row per nn.Linear of `model`: is it FP8, and if not why not; recipe and backend.
    'fallback' marks an FP8 layer whose GEMMs the backend will refuse on this device: they run
    in high precision (counted in device.fallbacks; an error under device.strict)."""
    rows = []
    for name, m in model.named_modules():
        if not isinstance(m, nn.Linear):
            continue
        k, n = m.in_features, m.out_features
        # FP8 tensor cores (cuBLASLt) take K and N in multiples of 16: device.py's
        # scaled_mm_refusal applies the same rule at run time.
        bad_shape = f"K={k}, N={n} not multiples of 16" if k % 16 or n % 16 else None
        row = {"layer": name, "shape": f"{k}->{n}", "fp8": isinstance(m, Fp8Linear),
               "recipe": "", "backend": "", "fallback": False}
        if isinstance(m, Fp8Linear):
            r = m.recipe
            row["recipe"], row["backend"] = r.describe(), r.backend
            cuda = m.weight.is_cuda
            if r.backend == "torch" and cuda and bad_shape:
                row["fallback"], row["why"] = True, f"GEMM falls back to high precision: {bad_shape}"
            elif r.backend == "emulate" or not cuda:
                row["why"] = "FP8 values, GEMM emulated in fp32 (no FP8 tensor cores here)"
            else:
                row["why"] = "FP8 tensor cores"
        else:
            row["why"] = f"shape: {bad_shape}" if bad_shape else "filter: kept in high precision"
        rows.append(row)
    return rows


def format_linear_table(rows):
    cols = ("layer", "shape", "fp8", "recipe", "backend", "why")
    cells = [[("yes" if r[c] else "no") if c == "fp8" else str(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) if cells else len(c) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()]
    lines += ["  ".join(x.ljust(w) for x, w in zip(cell, widths)).rstrip() for cell in cells]
    return "\n".join(lines)


def fallback_line():
    """The end-of-run count of GEMMs that fell back to high precision (device.fallbacks)."""
    total = sum(device.fallbacks.values())
    if not total:
        return "FP8 GEMMs that fell back to high precision at run time: 0"
    per = ", ".join(f"{k}: {v}" for k, v in sorted(device.fallbacks.items()))
    return f"FP8 GEMMs that fell back to high precision at run time: {total} ({per})"


def read_records(path):
    """The records of an fp8_stats.jsonl file (as written by Fp8Stats). A damaged line (a run killed
    while writing it) is a ValueError naming the file and the line."""
    records = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except ValueError as e:
                    raise ValueError(f"{path}, line {number}: not a JSON record ({e}): cut short by a crash? "
                                     f"A resumed run drops such lines (init_from=resume)") from None
    return records
