"""
Memory accounting: the bytes the training state really holds, walked over the model's parameters
and the optimizer's state, not computed from a formula (bench.py memory, tests/test_optim.py).
"""

import torch
import torch.nn as nn

from nanofp8.fp8 import Fp8Linear
from nanofp8.optim import O2Linear


def _nbytes(t):
    return t.numel() * t.element_size()


def _fp8_nbytes(q):
    return 0 if q is None else _nbytes(q.data) + _nbytes(q.scale)


def fp8_grad_nbytes(p):
    """Bytes p's FP8 gradient holds now (the E4M3 tensor and its scale, or the fp16 buffer while
    accumulating), without ending an accumulation; 0 for a parameter whose gradient is .grad."""
    h = getattr(p, "_held_grad", None)
    if h is None:
        return 0
    return sum(_nbytes(t) for t in h.acc) if h.acc is not None else _fp8_nbytes(h.q)


def training_state_bytes(model, optimizer, is_block_linear=None):
    """Bytes held per parameter by the training state, split into block Linear weights and the
    whole model. Call it after backward (gradients present) and after at least one step
    (optimizer state present). Returns a dict of dicts:

        {"linear": {"params", "weight", "grad", "optimizer", "gemm_weight", "per_param"},
         "model":  {... the same over every parameter ...}}

    weight = the stored (master) weight, grad = gradients (fp32, bf16 or FP8 + scale), optimizer
    = every tensor of the optimizer state, gemm_weight = the FP8 weight copies an Fp8Linear holds
    from its first forward of a step to the optimizer step, an O2Linear from one step to the next
    (reported, not in per_param)."""
    if is_block_linear is None:
        is_block_linear = lambda fqn, m: isinstance(m, nn.Linear) and not fqn.endswith("lm_head")
    owner = {}
    for fqn, m in model.named_modules():
        if isinstance(m, nn.Linear) and is_block_linear(fqn, m):
            owner[m.weight] = m
    out = {k: dict(params=0, weight=0, grad=0, optimizer=0, gemm_weight=0) for k in ("linear", "model")}
    seen = set()
    for p in model.parameters():
        if id(p) in seen:  # tied weights count once
            continue
        seen.add(id(p))
        m = owner.get(p)
        row = dict(params=p.numel(), weight=_nbytes(p), grad=0, optimizer=0, gemm_weight=0)
        if p.grad is not None:
            row["grad"] += _nbytes(p.grad)
        row["grad"] += fp8_grad_nbytes(p)  # without ending an accumulation
        if isinstance(m, O2Linear):  # the master's scale; the step's casts, held until the next step
            row["weight"] += _nbytes(m.weight_scale)
            own = {p.untyped_storage().data_ptr()}  # (O3: the forward's W is the stored weight)
            row["gemm_weight"] += sum(_nbytes(t) for t in {getattr(m, k) for k in ("fp8_w", "fp8_w_scale", "fp8_w_inv", "fp8_wt", "fp8_wt_scale", "fp8_wt_inv")}
                                      if t.untyped_storage().data_ptr() not in own)
        elif isinstance(m, Fp8Linear) and m._w_cache is not None:
            row["gemm_weight"] += sum(_fp8_nbytes(q) for q in m._w_cache[1] if q is not None)
        for v in optimizer.state.get(p, {}).values():
            if torch.is_tensor(v):
                row["optimizer"] += _nbytes(v)
        for key in ["model"] + (["linear"] if m is not None else []):
            for k, val in row.items():
                out[key][k] += val
    for d in out.values():
        n = max(d["params"], 1)
        d["per_param"] = (d["weight"] + d["grad"] + d["optimizer"]) / n
    return out


def activation_bytes(fn):
    """Bytes of the tensors autograd saves for backward while fn() runs (the forward pass),
    counted once per storage. Returns (bytes, result of fn)."""
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        storages[(s.data_ptr(), t.device)] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        res = fn()
    return sum(storages.values()), res
