"""
Fp8AdamW's fused step (Fp8AdamW(fused=True)). On a GPU the O2 weights of a param group step in
three Triton launches (nanofp8/optim_triton.py: runs_on_triton); here is the rest: the O2 update
of one O2 weight as one torch.compile'd function, which inductor fuses into a few kernels, for the
weights those kernels do not take and off a GPU; and the step that picks between them. The fp32
parameters take torch's fused AdamW (optim_foreach.update_plain). The readable loop of
nanofp8/optim.py (foreach=False) stays the reference, and tests/test_optim.py holds the two equal.

What one O2 weight costs the step. The loop (and its foreach twin) reads and writes each stored
tensor several times: dequantize the gradient, the master, m and v to fp32 copies, update them in
a dozen elementwise passes, then quantize m, v and the master back, each through its own amax,
scale and rounding passes, with the rounding noise made as a tensor first. Compiled, the same
operations become a handful of kernels (the block amaxes of m and v are rows of 128 values of one
reduction; the master's rounding waits for the whole tensor's amax), and the noise is a hash
computed where it is used (optim.counter_noise, integer ops only, so the compiled code makes the
eager code's bits), never a tensor in memory. Scheduled by inductor's CUDA rules
(nanofp8/schedule.py), a weight's update is 5 kernels moving about 37 B per value (fp16 v; 35
with v in E4M3), where the state read and written is 11 B (the gradient 1 B, m 1 B, v 2 B and the
master 2 B read; m, v and the master written): inductor keeps the new fp32 m and v in memory
between the kernels that take their amaxes and those that round them.

The step's numbers (betas, eps, the bias corrections, the bound on m, the learning rate) enter as
one small fp32 tensor per group and the noise keys as one int64 tensor: a new step, or another
group, reuses the compiled code (a graph keyed on values would recompile every step). Each is the
fp32 number eager code computes from its Python float (a Python scalar meets an fp32 tensor as
fp32), and each elementwise operation is eager's, in eager's order (ATen's addcmul and addcdiv
as self + value * t1 * t2 and self + value * t1 / t2): where inductor's code makes the same
fp32 operations the bits are the reference's. Where its generated code rounds an intermediate
otherwise than ATen's kernel (a multiply and an add fused into one rounding in one of them, say),
an fp32 value differs by an ulp, and a value that lands on the other side of a stochastic rounding's threshold goes to the other
neighbour of its stored format; tests/test_optim.py bounds that (test_fused_step_matches_the_loop).

Each weight's FP8 cast for the next forward (O2Linear.refresh_fp8_weight) follows the compiled
update, as in the loop, all weights in one call (o2_compile.refresh_all: on a GPU compiled). The
ordinary parameters (fp32 state) take the foreach step (optim_foreach.update_plain). Where the
update cannot be compiled, a warning says so, that step runs update_group eagerly and the next
ones take the foreach step (Fp8AdamW.fused turns False).
"""

import math
import warnings

import torch

from nanofp8.o2_compile import refresh_all
from nanofp8.optim import (adam_ratio_bound, counter_noise, dequantize_blocks, noise_bits,
                           noise_key, quantize_blocks, to_fp16_scaled)

# the numbers of a step, in update_one's order
NUMBERS = ("1 - b1", "b2", "1 - b2", "ratio_bound", "decay", "bias2_sqrt", "step_size", "eps")


def step_numbers(t, group):
    """The numbers of step t that Fp8AdamW.update computes as Python floats, in NUMBERS' order
    (all of them, betas and eps too: a graph keyed on none of them serves every group and step)."""
    lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    return [1 - b1, b2, 1 - b2, adam_ratio_bound(t, b1, b2), 1 - lr * wd, math.sqrt(1 - b2**t), -lr / (1 - b1**t), eps]


def update_one(w16, w_scale, g_data, g_scale, m_data, m_scale, v_data, v_scale, numbers, keys, start,
               formats, moments):
    """Fp8AdamW.update (with noise) and the master's rounding for one O2 weight, in the same
    operations and order: writes the new fp16 master and its scale into w16 and w_scale and
    returns ((m data, m scale), (v data, v scale)). numbers: an fp32 tensor (NUMBERS); keys:
    an int64 tensor of the noise keys of `formats` (Fp8AdamW.rounded_formats: the master, m, v);
    start: the number of w16's first element in its parameter."""
    M, V = moments["m"], moments["v"]
    one_b1, b2, one_b2, ratio_bound, decay, bias2_sqrt, step_size, eps = numbers.unbind()
    shape = w16.shape  # (the parameter's; the FP8 gradient's data is shaped as its blocks)
    g = dequantize_blocks(g_data, g_scale).view(shape)
    w = dequantize_blocks(w16, w_scale)
    m, v = (dequantize_blocks(d.view(shape), s) for d, s in ((m_data, m_scale), (v_data, v_scale)))
    v = v.pow(2) if V.sqrt else v
    m = torch.lerp(m, g, one_b1)
    v = v * b2 + one_b2 * g * g
    lim = v.sqrt() * ratio_bound
    m = m.minimum(lim).maximum(lim.neg())
    w = w * decay
    denom = v.sqrt() / bias2_sqrt + eps
    w = w + step_size * m / denom
    element = torch.arange(start, start + g.numel(), dtype=torch.int64, device=g.device)
    noise = {name: counter_noise(keys[k], element, noise_bits(fmt)).view(shape)
             for k, (name, fmt) in enumerate(formats.items())}
    master, scale = to_fp16_scaled(w, noise=noise["master"])
    w16.copy_(master)
    w_scale.copy_(scale)
    return (quantize_blocks(m, M.fmt, noise["m"]),
            quantize_blocks(v.sqrt() if V.sqrt else v, V.fmt, noise["v"]))


def update_group(tensors, numbers, keys, starts, formats, moments, one=update_one, out=None):
    """update_one for every O2 weight of a group: tensors, one 8-tuple per weight (update_one's
    first eight arguments); numbers (weights, 8) fp32, keys (weights, 3) int64. one: update_one,
    or its compiled twin (compiled_update_one). out: the list each weight's result is appended to
    once its master is written; a list holding some already goes on from the next weight (a
    compile that failed midway: the weights before it are not stepped twice)."""
    out = [] if out is None else out
    for i in range(len(out), len(tensors)):
        out.append(one(*tensors[i], numbers[i], keys[i], starts[i], formats, moments))
    return out


def compiled_update_one():
    """update_one compiled, one function for every optimizer of the process: dynamo's cache keeps
    its graphs by their guards (a weight's shape, the formats), so GPT-2's 48 O2 weights make 4
    graphs, and a second optimizer over the same shapes reuses the first one's. (One graph for a
    group's weights compiled for longer with every weight, about 4 s of inductor each at
    GPT-2's width: minutes before a GPT-2's first step; per weight, the kernels are the same.)
    Static shapes: a block's length (optim.state_block, a gcd) is a Python number of the trace."""
    global COMPILED
    if COMPILED is None:
        COMPILED = torch.compile(update_one, fullgraph=True, dynamic=False)
    return COMPILED


COMPILED = None
RECOMPILE_LIMIT = 64  # graphs of update_one per process


def runs_on_triton(p):
    """Does the fused step of this parameter's group run on nanofp8/optim_triton.py's kernels (three
    launches for all O2 weights)? On a GPU. (Tests run them in Triton's interpreter.)"""
    return p.is_cuda


def step(opt):
    """Fp8AdamW.step's update on the fused path (the gradients are known to be finite)."""
    from nanofp8.optim_foreach import count_steps, sort_group, update_plain

    number = {p: i for i, p in enumerate(p for group in opt.param_groups for p in group["params"])}
    for group in opt.param_groups:
        o2, grads, plain = sort_group(opt, group)
        update_plain(opt, group, plain)
        if not o2:
            continue
        mods = [opt.o2[p] for p in o2]
        ts = count_steps([opt.state[p] for p in o2])
        if opt.fused_triton is not False and runs_on_triton(o2[0]):
            on = [False] * len(o2)
            try:
                from nanofp8 import optim_triton  # (Triton and kernels.py: imported where they run)
                on = [optim_triton.steps(opt, mod, q) for mod, q in zip(mods, grads)]
                if any(on):
                    optim_triton.step_group(opt, group, *([x for x, y in zip(xs, on) if y] for xs in (
                        o2, grads, ts, [number[p] for p in o2])), step_numbers)
                    opt.fused_triton = True
            except Exception as e:  # (raised before any state is written: an import, a kernel's compile)
                if opt.fused_triton:
                    raise
                warnings.warn(f"nanofp8: the O2 step's Triton kernels failed ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}); it runs compiled by torch.compile")
                opt.fused_triton, on = False, [False] * len(o2)
            # the weights the kernels do not take (optim_triton.steps): compiled, below
            o2, grads, ts, mods = ([x for x, y in zip(xs, on) if not y] for xs in (o2, grads, ts, mods))
            if not o2:
                continue
        args = group_args(opt, group, o2, grads, ts, [number[p] for p in o2])
        new = []
        if opt.fused:  # (False: an earlier group of this step could not be compiled)
            try:  # (a graph per weight shape and formats, and its state's layouts: a process that steps
                # many models, the tests, makes more than dynamo's default limit of 8 graphs per
                # function, which fullgraph=True turns into an error)
                with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                    update_group(*args, one=compiled_update_one(), out=new)
                opt.fused_compiled = True
            except Exception as e:  # a compiler's failure (a GPU's toolchain, say) costs speed, not the run
                if opt.fused_compiled:
                    raise
                warnings.warn(f"nanofp8: the fused O2 step could not be compiled ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}); this step runs its code eagerly, "
                              "the next ones the foreach step")
                opt.fused = False
        update_group(*args, out=new)  # (eagerly, the weights a failed compile left: none where it ran)
        store_moments(opt, o2, new)
        refresh_all(mods)  # the FP8 casts for the next forward, every weight in one call


def group_args(opt, group, o2, grads, ts, numbers):
    """update_group's arguments but `one` for the O2 weights o2 of a param group (their FP8
    gradients, step counts and parameter numbers)."""
    from nanofp8.optim_foreach import host_to_device

    M, V, device, formats = opt.moments["m"], opt.moments["v"], o2[0].device, opt.rounded_formats()
    tensors = [(opt.o2[p].weight, opt.o2[p].weight_scale, q.data, q.scale, opt.state[p][M.key],
                opt.state[p][M.key + "_scale"], opt.state[p][V.key], opt.state[p][V.key + "_scale"])
               for p, q in zip(o2, grads)]
    keys = [[noise_key(opt.seed, t, n, k) for k in range(len(formats))] for t, n in zip(ts, numbers)]
    return (tensors, host_to_device([step_numbers(t, group) for t in ts], torch.float32, device),
            host_to_device(keys, torch.int64, device), [opt.shard_start(p) for p in o2], formats, opt.moments)


def store_moments(opt, o2, new):
    """update_group's new moments (its result `new`) into the state of the O2 weights o2."""
    M, V = opt.moments["m"], opt.moments["v"]
    for p, ((m, m_scale), (v, v_scale)) in zip(o2, new):
        opt.state[p].update({M.key: m, M.key + "_scale": m_scale, V.key: v, V.key + "_scale": v_scale})
