"""
Fp8AdamW's foreach step: the same update as the per-parameter loop of nanofp8/optim.py, for all
tensors of a param group at once. Fp8AdamW(foreach=True), the default, runs it; foreach=False runs
the loop. This is torch.optim's own pair, _multi_tensor_adamw beside _single_tensor_adamw, and
tests/test_optim.py holds the two bit-equal over many steps of adversarial gradients.

Each elementwise operation is one torch._foreach_* call over every O2 weight (or every fp32
parameter) of a run, so the update is ~140 operator calls whatever the model's depth, plus the
rounding noise of the whole run (rounding_noise_all: one hash per stream, ~45 integer operations on
a CPU, one compiled kernel on a GPU), plus two per O2 weight: the block amaxes of m and v
(tests/test_optim.py counts them). Each tensor gets the same operations in the same order as in
the loop, so the results are the same bits (the CPU runs a foreach op tensor by tensor with the
ordinary kernels).

The price is transient memory: the fp32 copies of w, m, v and g, the int64 element counters and
int32 rounding noise, and the update's intermediates come to several dozen bytes per value while a
foreach call runs, ten times the state O2 keeps. So the step takes the O2 weights of a group in runs of at most
STEP_CHUNK = 2^25 values (a larger weight alone), which changes no bit (tests/test_optim.py): the
step's temporaries stay a few GB whatever the model's size, at the price of ~140 more operator
calls per run.

O3 (ZeroFp8AdamW) updates its shards with these functions too.
"""

import math
import warnings

import torch

from nanofp8 import o2_compile
from nanofp8.emulate import amax_each
from nanofp8.fp8 import compute_scale, dequantize
from nanofp8.o2_compile import compiled_or_eager, refresh_all
from nanofp8.optim import (FP16, FP16_MAX, MASTER_HEADROOM, adam_ratio_bound, counter_noise, dequantize_blocks,
                           fp8_grad, fp16_scale, holds_fp8_grad, noise_bits, noise_key, quantize_wgrad, state_block,
                           wgrad_tensor)

STEP_CHUNK = 2**25  # values of O2 weights per run of the step's foreach calls


def step_chunks(tensors):
    """The step's runs: consecutive slices [i, j) of `tensors` holding at most STEP_CHUNK values
    each (a tensor larger than that alone)."""
    runs, start, n = [], 0, 0
    for i, t in enumerate(tensors):
        if i > start and n + t.numel() > STEP_CHUNK:
            runs.append((start, i))
            start, n = i, 0
        n += t.numel()
    return runs + ([(start, len(tensors))] if start < len(tensors) else [])


def _blocks(t, scale):
    """t as (blocks, values per block) for its scale: one row per scale (shape (blocks, 1)), or
    one row for a single scale (shape (), as the masters and older checkpoints' moments have)."""
    return t.reshape(scale.shape[0] if scale.dim() else 1, -1)


def round_stochastic_all(ys, noises, fmt, out=None):
    """optim.round_stochastic for lists of tensors (out: tensors of fmt's dtype to write into)."""
    mag = torch._foreach_abs(ys)
    at = torch._foreach_clamp_min(mag, 1.5 * fmt.min_normal)  # where the dither is measured
    moved = torch._foreach_add([a.view(torch.int32) for a in at], noises)
    dither = torch._foreach_sub([m.view(torch.float32) for m in moved], at)
    torch._foreach_add_(mag, dither)
    torch._foreach_mul_(mag, torch._foreach_sign(ys))
    if fmt.dtype != torch.float16:  # (fp16 values are far below its max: 4x under, at most)
        torch._foreach_clamp_min_(mag, -fmt.max)
        torch._foreach_clamp_max_(mag, fmt.max)
    out = out if out is not None else [torch.empty(y.shape, dtype=fmt.dtype, device=y.device) for y in ys]
    torch._foreach_copy_(out, mag)  # the cast rounds to nearest
    return out


def dequantize_blocks_all(datas, scales):
    """[optim.dequantize_blocks(data, scale)] for stored tensors of one dtype: a foreach cast (copy
    into fp32) and a foreach multiply by the reciprocal scales, per block or per tensor."""
    out = [torch.empty(_blocks(d, s).shape, dtype=torch.float32, device=d.device) for d, s in zip(datas, scales)]
    torch._foreach_copy_(out, [_blocks(d, s) for d, s in zip(datas, scales)])
    torch._foreach_mul_(out, torch._foreach_reciprocal(scales))
    return [o.view(d.shape) for o, d in zip(out, datas)]


def quantize_blocks_all(xs, fmt, noises=None):
    """[optim.quantize_blocks(x, fmt, noise)] for a list of fp32 tensors: the scales of all blocks of
    all tensors computed at once. The values are finite (the step checked the gradients, and m and
    v are made from them), so the cast needs no NaN guard (fp8.quantize has one)."""
    views = [x.reshape(-1, state_block(x.numel())) for x in xs]
    amax = [a.amax(1, keepdim=True) for a in torch._foreach_abs(views)]  # one reduction per tensor
    every = torch.cat(amax)
    every = fp16_scale(every, FP16_MAX / 4) if fmt.dtype == torch.float16 else compute_scale(every, fmt)
    scales = list(every.split([len(a) for a in amax]))
    ys = torch._foreach_mul(views, scales)
    if noises is not None:
        datas = round_stochastic_all(ys, [n.view(y.shape) for n, y in zip(noises, ys)], fmt)
    else:
        if fmt.dtype != torch.float16:
            torch._foreach_clamp_min_(ys, -fmt.max)
            torch._foreach_clamp_max_(ys, fmt.max)
        datas = [torch.empty(y.shape, dtype=fmt.dtype, device=y.device) for y in ys]
        torch._foreach_copy_(datas, ys)
    return [(d.view(x.shape), s) for d, x, s in zip(datas, xs, scales)]


def _scaled_all(xs, target):
    """The power-of-two fp16 scale of every tensor (optim.to_fp16_scaled's) and the tensors times it."""
    scales = list(fp16_scale(torch.stack([a.float() for a in amax_each(xs)]), target).unbind())
    return torch._foreach_mul(xs, scales), scales


def to_fp16_scaled_all(xs, noises, target=MASTER_HEADROOM):
    """[optim.to_fp16_scaled(x, target, noise)] for lists of tensors and their noises (fp16's)."""
    ys, scales = _scaled_all(xs, target)
    return list(zip(round_stochastic_all(ys, noises, FP16), scales))


@torch.no_grad()
def set_weights(mods, ws, noises):
    """The end of Fp8AdamW.step's loop, for many modules: each new fp32 weight stored as its scaled
    fp16 master, rounded stochastically with its own noise, then cast to FP8 for the next forward."""
    ys, scales = _scaled_all(ws, MASTER_HEADROOM)
    round_stochastic_all(ys, [n.view(y.shape) for n, y in zip(noises, ys)], FP16, out=[m.weight for m in mods])
    torch._foreach_copy_([m.weight_scale for m in mods], scales)
    refresh_all(mods)  # each one's refresh_fp8_weight, in one call (on a GPU compiled)


def adam_moments(m, v, g, betas):
    """Adam's moment recursions, in place, in torch.optim.AdamW's operations and order. m, v, g:
    tensors, or lists of tensors (one foreach call per operation)."""
    if torch.is_tensor(m):
        m, v, g = [m], [v], [g]
    b1, b2 = betas
    torch._foreach_lerp_(m, g, 1 - b1)
    torch._foreach_mul_(v, b2)
    torch._foreach_addcmul_(v, g, g, value=1 - b2)


def adamw_apply(ws, ms, vs, ts, group):
    """The AdamW update of the weights ws from the moments after steps ts (lists, one step
    count per tensor), decay first, as torch does. Returns the new weights (new tensors)."""
    lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    ws = torch._foreach_mul(ws, 1 - lr * wd)
    denom = torch._foreach_sqrt(vs)
    torch._foreach_div_(denom, [math.sqrt(1 - b2**t) for t in ts])
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(ws, ms, denom, [-lr / (1 - b1**t) for t in ts])
    return ws


def count_steps(sts):
    """Advance the step counters of these states (one foreach add) and return them as Python
    numbers (one read of host memory for all of them, no .item() per parameter)."""
    steps = [st["step"] for st in sts]
    if not steps:
        return []
    torch._foreach_add_(steps, 1)
    return torch.stack(steps).tolist()


def update(opt, ws, gs, sts, group, ts, noises=None):
    """Fp8AdamW.update for lists of tensors of one param group (ts: their step counts, already
    counted): the same operations in the same order, one foreach call each. Returns the new fp32
    weights (not yet stored)."""
    M, V = opt.moments["m"], opt.moments["v"]
    if noises is None:  # fp32 moments, updated in place
        ms, vs = [st[M.key] for st in sts], [st[V.key] for st in sts]
    else:  # (shaped as the gradients: the moments are stored 2-D, O3's shards and masters are flat)
        ms, vs = (dequantize_blocks_all([st[mo.key].view(g.shape) for st, g in zip(sts, gs)],
                                        [st[mo.key + "_scale"] for st in sts]) for mo in (M, V))
        ws = [w.view(g.shape) for w, g in zip(ws, gs)]
        vs = torch._foreach_pow(vs, 2) if V.sqrt else vs
    adam_moments(ms, vs, gs, group["betas"])
    if noises is not None:
        lim = torch._foreach_sqrt(vs)
        torch._foreach_mul_(lim, [adam_ratio_bound(t, *group["betas"]) for t in ts])
        torch._foreach_minimum_(ms, lim)
        torch._foreach_neg_(lim)
        torch._foreach_maximum_(ms, lim)
    ws = adamw_apply(ws, ms, vs, ts, group)
    if noises is not None:
        for st, (data, scale) in zip(sts, quantize_blocks_all(ms, M.fmt, [n["m"] for n in noises])):
            st[M.key], st[M.key + "_scale"] = data, scale
        vs = torch._foreach_sqrt(vs) if V.sqrt else vs
        for st, (data, scale) in zip(sts, quantize_blocks_all(vs, V.fmt, [n["v"] for n in noises])):
            st[V.key], st[V.key + "_scale"] = data, scale
    return ws


# The step's two parts, shared by O2's foreach step (step below) and O3's (nanofp8/zero.py, on its
# shards). Each runs Fp8AdamW.update's twin above, or Fp8AdamW.update itself when opt.foreach is
# False (O3 has no loop of its own).


def update_plain(opt, group, ps):
    """torch.optim.AdamW on the ordinary parameters ps of one param group (fp32 state): its
    foreach or single-tensor code, or (Fp8AdamW(fused=True)) its fused kernel."""
    if not ps:
        return
    for p in ps:
        if not opt.state[p]:
            opt.init_state(p)
    sts = [opt.state[p] for p in ps]
    ts = count_steps(sts)
    if opt.fused:  # torch's fused AdamW kernel, one launch (torch.optim.AdamW(fused=True)'s bits)
        (b1, b2), M, V = group["betas"], opt.moments["m"], opt.moments["v"]
        steps = list(host_to_device(ts, torch.float32, ps[0].device).unbind())  # (its step counts)
        torch._fused_adamw_(ps, [p.grad for p in ps], [st[M.key] for st in sts], [st[V.key] for st in sts], [],
                            steps, lr=group["lr"], beta1=b1, beta2=b2, weight_decay=group["weight_decay"],
                            eps=group["eps"], amsgrad=False, maximize=False)
        return
    if opt.foreach:
        ws = update(opt, [p.float() for p in ps], [p.grad for p in ps], sts, group, ts)
    else:
        ws = [opt.update(p.float(), p.grad, st, group) for p, st in zip(ps, sts)]
    torch._foreach_copy_(ps, ws)


def rounding_noise_all(opt, numbers, ts, gs, starts):
    """[opt.rounding_noise(i, t, g, start)] for a run of tensors, made as one flat tensor per
    stream (the elements of all tensors side by side), so the number of operator calls does not
    grow with the number of tensors; the same bits as the per-tensor calls."""
    if not gs:
        return []
    numels = [g.numel() for g in gs]
    device, formats = gs[0].device, opt.rounded_formats()
    firsts = [sum(numels[:k]) for k in range(len(numels))]  # (where each tensor begins in the run)
    as_tensor = lambda values: host_to_device(values, torch.int64, device)  # noqa: E731
    keys = as_tensor([[noise_key(opt.seed, t, i, stream) for stream in range(len(formats))] for i, t in zip(numbers, ts)])
    args = (keys, as_tensor(firsts), as_tensor([s - f for s, f in zip(starts, firsts)]), sum(numels),
            tuple(noise_bits(fmt) for fmt in formats.values()))
    if compiled_noise(device):
        flat = compiled_or_eager(hash_noise, "the rounding noise's hash", *args)
    else:
        flat = hash_noise(*args)
    noises = [{} for _ in gs]
    for name, noise in zip(formats, flat):
        for n, part, g in zip(noises, noise.split(numels), gs):
            n[name] = part.view(g.shape)
    return noises


def hash_noise(keys, firsts, offsets, total, bits):
    """optim.counter_noise of a run of tensors, one int32 tensor per stream: keys (tensors,
    streams), firsts (where each tensor begins in the run), offsets (its first element's number
    in its parameter, less its first), total (the run's length), bits (one per stream). Every
    element finds its tensor by a search among firsts, so nothing per element is made but the
    noise: compiled (on a GPU), one kernel writes the streams' int32 noise, 4 B per value each;
    eager, each of the hash's ~45 integer operations is a pass over int64 values. Integer
    operations only: both make the same bits (tests/test_o2_numerics.py)."""
    index = torch.arange(total, dtype=torch.int64, device=keys.device)
    which = torch.searchsorted(firsts, index, right=True) - 1
    element = index + offsets[which]
    return [counter_noise(keys[which, k], element, b) for k, b in enumerate(bits)]


hash_noise.compiled = None


def compiled_noise(device):
    """Does the foreach step compile the noise's hash on this device? On a GPU."""
    return device.type == "cuda"


def update_decoupled(opt, group, numbers, ps, ws, gs):
    """The O2 update of a run of O2 weights ps of one param group (O3: this rank's shards of them),
    numbers: their parameter numbers (the rounding noise's seed), ws and gs: their fp32 masters and
    gradients. Counts their steps and draws their noise. Returns the new fp32 weights and the noise
    for each one's master: the caller stores the masters (O2: in the layers; O3: in the state)."""
    sts = [opt.state[p] for p in ps]
    ts = count_steps(sts)
    starts = [opt.shard_start(p) for p in ps]
    if opt.foreach:
        noises = rounding_noise_all(opt, numbers, ts, gs, starts)
    else:
        noises = [opt.rounding_noise(i, t, g, s) for i, t, g, s in zip(numbers, ts, gs, starts)]
    if opt.foreach:
        ws = update(opt, ws, gs, sts, group, ts, noises)
    else:
        ws = [opt.update(w.view(g.shape), g, st, group, n) for w, g, st, n in zip(ws, gs, sts, noises)]
    return ws, [n["master"] for n in noises]


def grads_finite(opt):
    """Fp8AdamW.grads_finite on the foreach path: an O2 gradient by its amax, the others by their
    largest magnitudes, one foreach reduction (NaN propagates through a max, an inf is its own)."""
    amaxes, plain = [], []
    for group in opt.param_groups:
        for p in group["params"]:
            q = fp8_grad(p)
            if q is not None:
                amaxes.append(q.amax.float().amax())  # (a NaN among the block amaxes stays)
            elif p.grad is not None:
                plain.append(p.grad)
    amaxes += [a.float() for a in amax_each(plain)]
    return torch.isfinite(torch.stack(amaxes or [torch.zeros(())])).all()


def sort_group(opt, group):
    """A group's parameters that have a gradient this step, their state made where it is the
    first: (O2 weights, their FP8 gradients, the other parameters)."""
    o2, grads, plain = [], [], []
    for p in group["params"]:
        q = fp8_grad(p)
        if q is None and (holds_fp8_grad(p) or p.grad is None):
            continue
        if not opt.state[p]:
            opt.init_state(p)
        if q is None:
            plain.append(p)
        else:
            o2.append(p)
            grads.append(q)
    return o2, grads, plain


def step(opt):
    """Fp8AdamW.step's update on the foreach path (the gradients are known to be finite)."""
    number = {p: i for i, p in enumerate(p for group in opt.param_groups for p in group["params"])}
    for group in opt.param_groups:
        o2, grads, plain = sort_group(opt, group)
        update_plain(opt, group, plain)
        for i, j in step_chunks(o2):  # the FP8 gradients, dequantized (foreach), run by run
            ps, mods = o2[i:j], [opt.o2[p] for p in o2[i:j]]
            gs = dequantize_blocks_all([q.data for q in grads[i:j]], [q.scale for q in grads[i:j]])
            gs = [g.view(p.shape) for g, p in zip(gs, ps)]
            ws = dequantize_blocks_all([m.weight for m in mods], [m.weight_scale for m in mods])
            ws, noises = update_decoupled(opt, group, [number[p] for p in ps], ps, ws, gs)
            set_weights(mods, ws, noises)


# -----------------------------------------------------------------------------
# The gradients' casts and norms of clip_grad_norm, every O2 weight at once


def fp8_grads(params):
    """fp8_grad of each of params (None where it has none), the pending fp16 sums cast to E4M3
    all together (a cast is a dozen small operators: a loop of them launched ~30 kernels per
    weight): on a GPU two Triton launches that also measure their norms (optim_triton.cast_sums),
    else where its kernels do not run one compiled call; fp8_grad's bytes and scales."""
    params = list(params)
    held = [p._held_grad for p in params if holds_fp8_grad(p) and p._held_grad.acc is not None]
    cast, accs = None, [h.acc for h in held]
    if held and triton_takes(accs[0][0]):
        cast = on_triton("the FP8 casts of the summed weight gradients",
                         lambda ot: ot.cast_sums(accs) if ot.takes_sums(accs) else None)
    if cast is None and held and o2_compile._compiled_casts(held[0].acc[0]):
        cast = compiled_or_eager(_cast_sums, "the FP8 casts of the summed weight gradients", accs)
    if cast is not None:
        for h, (data, scale, amax, *norm) in zip(held, cast):
            h.q, h.acc = wgrad_tensor(data, scale, amax, h.acc[0].shape), None
            if norm:  # (the Triton cast measured it, for fp8_norms)
                h.q._norm = (scale, norm[0])
    return [fp8_grad(p) for p in params]


def _cast_sums(accs):
    """quantize_wgrad of each dequantized fp16 sum, as tensors (data, scale, amax)."""
    return [(q.data, q.scale, q.amax) for q in (quantize_wgrad(dequantize_blocks(*acc)) for acc in accs)]


_cast_sums.compiled = None


def fp8_norms(qs):
    """The 2-norm of each dequantized FP8 gradient of qs: the norms their casts measured where
    they did (fp8_grads on a GPU) and the scales are still those; else on a GPU two Triton
    launches (optim_triton.norms), else where its kernels do not run one compiled call."""
    if qs and all(q._norm is not None and q._norm[0] is q.scale for q in qs):
        return [q._norm[1] for q in qs]
    if qs and triton_takes(qs[0].data):
        norms = on_triton("the norms of the FP8 gradients", lambda ot: ot.norms(qs) if ot.takes_grads(qs) else None)
        if norms is not None:
            return list(norms.unbind())
    if qs and o2_compile._compiled_casts(qs[0].data):
        return compiled_or_eager(_norms, "the norms of the FP8 gradients", [(q.data, q.scale) for q in qs])
    return [dequantize(q, torch.float32).norm() for q in qs]


def _norms(qs):
    """The 2-norm of each dequantized FP8 gradient (data, scale)."""
    return [dequantize_blocks(data, scale).norm() for data, scale in qs]


_norms.compiled = None


def triton_takes(t):
    """Do the FP8 gradients' casts and norms of tensors like t run on nanofp8/optim_triton.py's
    kernels (one launch for every weight's cast, two for the norms)? Where the fused O2 step does
    (optim_fused.runs_on_triton: on a GPU)."""
    from nanofp8 import optim_fused
    return optim_fused.runs_on_triton(t)


def host_to_device(values, dtype, device):
    """A host list (of lists) of numbers as a tensor on `device`: on a GPU copied from pinned memory
    without waiting (from pageable memory torch's copy waits for the device: a sync every step)."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else t


def on_triton(what, fn):
    """fn(nanofp8/optim_triton.py), None if it returns None (the kernels do not take these
    tensors) or if its kernels failed the first time they ran (a GPU's toolchain, say: a warning
    naming `what`, and the compiled casts from then on; a failure after they ran once is an error)."""
    global TRITON_RAN
    if TRITON_RAN is False:
        return None
    try:
        from nanofp8 import optim_triton  # (Triton and kernels.py: imported where they run)
        out = fn(optim_triton)
        if out is None:
            return None
    except Exception as e:
        if TRITON_RAN:
            raise
        warnings.warn(f"nanofp8: {what} failed on their Triton kernels ({type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else ''}); they run compiled by torch.compile")
        TRITON_RAN = False
        return None
    TRITON_RAN = True
    return out


TRITON_RAN = None  # whether optim_triton's kernels ran here (None: not yet; False: they failed)
