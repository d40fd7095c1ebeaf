"""
Precision decoupling (level O2): give every tensor of the training state the lowest precision
it tolerates, as FP8-LM (MS-AMP) does. For the Linear weights of the transformer blocks:

    state                 | bf16 baseline | O2 here                       | why this precision is enough
    ----------------------+---------------+-------------------------------+------------------------------
    master weight         | fp32  4 B     | fp16 + per-tensor scale  2 B  | see (1)
    weight for the GEMMs  | bf16 (cast)   | E4M3, cast once per step      | fp8.py: the GEMM inputs
    weight gradient       | fp32  4 B     | E4M3 + per-tensor scale  1 B  | see (2)
    Adam first moment m   | fp32  4 B     | E4M3 + per-tensor scale  1 B  | see (3)
    Adam second moment v  | fp32  4 B     | fp16 + per-tensor scale  2 B  | see (4)
                                    total:  16 B  ->  6 B per parameter

Embeddings, norms, biases and the LM head are few parameters and numerically touchy; they keep
fp32 master weights and fp32 Adam state, exactly as in the bf16 run.

(1) Master weights need mantissa, not range. An update is lr * m / sqrt(v), about lr in size,
    often 1e-3 to 1e-4 of the weight it is added to. bf16's 8-bit significand rounds such an
    update away (relative precision 2^-8 = 4e-3); fp16's 11 bits keep it (5e-4). fp16's narrow
    range is what the scale is for: the master is stored as w * s, with s a power of two that
    puts amax(w) at 2^12 (far below fp16's max 65504, and 2^26 above its smallest normal), so
    no weight overflows and none of the small ones go subnormal. Powers of two rescale exactly.
(2) The weight gradient only feeds Adam, which normalizes it: the update is m / sqrt(v), so a
    relative error in g of a few percent moves the update by a few percent, the same order as
    the noise of a mini-batch gradient. E4M3 (3 mantissa bits) with a per-tensor scale is enough.
(3) m is a running average of gradients with the same spread as g, and it too enters the update
    only through m / sqrt(v): E4M3 with a per-tensor scale, as for the gradient.
(4) v is a running average of g^2, whose dynamic range is twice that of g in binades: squared
    small gradients would underflow FP8 entirely, and v sits in a *denominator*, where a value
    flushed to zero turns into an exploding step. fp16 (40 binades with subnormals) with a scale
    holds it. Option `v_format="fp8"` (beyond FP8-LM, 5 B per parameter) stores sqrt(v) in E4M3
    instead: the square root halves the dynamic range back to that of g, and the update needs
    only sqrt(v) anyway.

Gradient accumulation over micro-steps: the FP8 gradient is re-quantized with a fresh scale after
each micro-step (dequantize, add the new fp32 gradient, quantize). The scale follows the growing
sum, so the error per micro-step is relative to the running sum and does not compound into drift;
tests/test_optim.py measures it. No wider buffer is kept, so the gradient stays at 1 B.

Non-finite gradients: before any state is touched, one check over every gradient (a single
device-to-host sync per step) decides whether the step is taken. If any is NaN or inf, the step is
skipped and counted (`optimizer.skipped_steps`), and no scale, moment or weight changes.

The optimizer math itself runs in fp32 on dequantized copies, one tensor at a time, with the
same betas, lr, weight decay and schedule as torch.optim.AdamW.
"""

import math

import torch
import torch.nn as nn

from nanofp8.fp8 import E4M3, Fp8Linear, Fp8Tensor, compute_scale, dequantize, quantize

FP16_MAX = 65504.0
MASTER_HEADROOM = 2.0**12  # master weights are stored with amax scaled to ~2^12 in fp16


def _fp16_scale(amax, target):
    """Power-of-two scale putting amax near `target` in fp16 (1.0 when amax is 0 or bad)."""
    amax = amax.detach().double()
    good = torch.isfinite(amax) & (amax > 0)
    exp = torch.floor(torch.log2(target / torch.where(good, amax, torch.ones_like(amax))))
    return torch.where(good, torch.exp2(exp), torch.ones_like(amax)).float()


def to_fp16_scaled(x, target=MASTER_HEADROOM):
    """(x * s in fp16, s) with s a power of two: exact rescaling, no subnormals for the bulk."""
    s = _fp16_scale(x.abs().amax(), target)
    return (x.float() * s).half(), s


class O2Linear(Fp8Linear):
    """Fp8Linear whose weight is stored as an fp16 master (values * weight_scale) and whose weight
    gradient is kept in FP8 (`.wgrad`, an Fp8Tensor) instead of in `.weight.grad`.

    `.weight` is the fp16 storage; `hp_weight()` gives the true fp32 weight."""

    cache_weight = True  # cast once per step: the optimizer's set_weight() frees the cast

    @classmethod
    def from_fp8_linear(cls, lin):
        new = cls(lin.in_features, lin.out_features, lin.bias is not None, device="meta",
                  recipe=lin.recipe, fqn=lin.fqn)
        new._init_scaling_state(lin.weight.device)
        new.load_state_dict({k: v for k, v in lin.state_dict().items() if k not in ("weight", "bias")},
                            strict=False)
        new.bias = lin.bias
        master, s = to_fp16_scaled(lin.weight.detach())
        new.weight = nn.Parameter(master)
        new.register_buffer("weight_scale", s)
        new.wgrad = None
        new.train(lin.training)
        return new

    def hp_weight(self):
        return self.weight.float() * self.weight_scale.reciprocal()

    def take_wgrad(self, dw):
        # Gradient accumulation: dequantize the running sum, add, re-quantize with a fresh scale.
        if self.wgrad is not None:
            dw = dw + dequantize(self.wgrad, torch.float32)
        self.wgrad = quantize(dw, E4M3)
        if self.observer is not None:  # a statistics step (nanofp8/stats.py)
            self.observer.observe_wgrad(self, dw, self.wgrad)
        return None  # nothing for autograd: .weight.grad stays None

    @torch.no_grad()
    def set_weight(self, w):
        """Store a new fp32 weight as the scaled fp16 master (bumps the version: FP8 recast)."""
        master, s = to_fp16_scaled(w)
        self.weight.copy_(master)
        self.weight_scale.copy_(s)
        self.free_weight_cache()


def convert_to_o2(model, cls=None):
    """Swap every Fp8Linear of the model for an O2Linear (fp16 master, FP8 gradient), or for
    another subclass `cls` built by cls.from_fp8_linear (O3Linear, nanofp8/dist.py)."""
    cls = cls or O2Linear
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is Fp8Linear:
                setattr(parent, name, cls.from_fp8_linear(child))
    return model


# -----------------------------------------------------------------------------
# The optimizer


def _stored(t, fmt):
    """(data, scale) of one moment tensor in its storage format: "fp8" (E4M3) or "fp16"."""
    if fmt == "fp8":
        q = quantize(t, E4M3)
        return q.data, q.scale
    return to_fp16_scaled(t, FP16_MAX / 4)


def _loaded(data, scale):
    return data.float() * scale.reciprocal()


class Fp8AdamW(torch.optim.Optimizer):
    """AdamW over a model converted with convert_to_o2: O2Linear weights get the decoupled
    state of the table above, every other parameter plain fp32 AdamW (the same math).

    State per O2 weight: exp_avg (E4M3) + exp_avg_scale, exp_avg_sq (fp16, or E4M3 holding
    sqrt(v) when v_format="fp8") + exp_avg_sq_scale, step. Other parameters: exp_avg,
    exp_avg_sq (fp32), step."""

    def __init__(self, params, model, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                 v_format="fp16"):
        if v_format not in ("fp16", "fp8"):
            raise ValueError(f"v_format={v_format!r}; expected 'fp16' or 'fp8'")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.v_format = v_format
        self.o2 = {m.weight: m for m in model.modules() if isinstance(m, O2Linear)}
        self.skipped_steps = 0

    def state_dict(self):
        return {**super().state_dict(), "v_format": self.v_format}  # how exp_avg_sq is stored

    def load_state_dict(self, state_dict):
        # The same bytes mean v in fp16 and sqrt(v) in E4M3: never read one as the other.
        saved = state_dict.get("v_format", self.v_format)
        if saved != self.v_format:
            raise ValueError(f"optimizer state has Adam v stored as v_format={saved!r}; this "
                             f"optimizer has v_format={self.v_format!r}")
        state_dict = {k: v for k, v in state_dict.items() if k != "v_format"}
        # torch.optim casts loaded state to each parameter's dtype (fp16 for an O2 master), which
        # would turn FP8 moments and fp32 scales into fp16: put back the tensors as they were saved.
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for i, st in state_dict["state"].items():
            for k, v in st.items():
                if torch.is_tensor(v):
                    self.state[params[i]][k] = v.to(params[i].device, copy=True)

    def _grad(self, p):
        if p in self.o2:
            q = self.o2[p].wgrad
            return None if q is None else dequantize(q, torch.float32)
        return p.grad

    def zero_grad(self, set_to_none=True):
        super().zero_grad(set_to_none)
        for m in self.o2.values():
            m.wgrad = None

    def grads_finite(self):
        """One flag for all gradients, one sync. O2 gradients are judged by their amax, which is
        non-finite exactly when the fp32 gradient was."""
        flags = []
        for g in self.param_groups:
            for p in g["params"]:
                if p in self.o2 and self.o2[p].wgrad is not None:
                    flags.append(torch.isfinite(self.o2[p].wgrad.amax).all())
                elif p.grad is not None:
                    flags.append(torch.isfinite(p.grad).all())
        return bool(torch.stack(flags).all()) if flags else True

    def _init_state(self, p):
        """fp32 moments for an ordinary parameter; the decoupled formats for an O2 weight."""
        st = self.state[p]
        st["step"] = torch.zeros((), dtype=torch.float32)
        zeros = torch.zeros_like(p, dtype=torch.float32)
        if p in self.o2:
            st["exp_avg"], st["exp_avg_scale"] = _stored(zeros, "fp8")
            st["exp_avg_sq"], st["exp_avg_sq_scale"] = _stored(zeros, self.v_format)
        else:
            st["exp_avg"], st["exp_avg_sq"] = zeros, zeros.clone()

    def _decoupled_update(self, st, w, g, group):
        """One AdamW step of an fp32 weight w from FP8 m and fp16 (or FP8 sqrt) v held in st;
        stores the new moments back into st and returns the new w."""
        m = _loaded(st["exp_avg"], st["exp_avg_scale"])
        v = _loaded(st["exp_avg_sq"], st["exp_avg_sq_scale"])
        if self.v_format == "fp8":
            v = v.square()  # stored as sqrt(v)
        st["step"] += 1
        w = adamw_math(w, g, m, v, st["step"].item(), group)
        st["exp_avg"], st["exp_avg_scale"] = _stored(m, "fp8")
        vs = v.sqrt() if self.v_format == "fp8" else v
        st["exp_avg_sq"], st["exp_avg_sq_scale"] = _stored(vs, self.v_format)
        return w

    def _fp32_update(self, p, g, group):
        st = self.state[p]
        st["step"] += 1
        p.copy_(adamw_math(p.float(), g, st["exp_avg"], st["exp_avg_sq"], st["step"].item(), group))

    @torch.no_grad()
    def step(self, closure=None):
        if not self.grads_finite():
            self.skipped_steps += 1
            return False
        for group in self.param_groups:
            for p in group["params"]:
                g = self._grad(p)
                if g is None:
                    continue
                if not self.state[p]:
                    self._init_state(p)
                if p in self.o2:
                    mod = self.o2[p]
                    mod.set_weight(self._decoupled_update(self.state[p], mod.hp_weight(), g, group))
                else:
                    self._fp32_update(p, g, group)
        return True


def adamw_math(w, g, m, v, t, group):
    """AdamW on fp32 tensors: updates m and v in place, returns the new w. The operations and
    their order are torch.optim.AdamW's (single-tensor path), so fp32 parameters come out
    bit-identical to it."""
    lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    w = w * (1 - lr * wd)
    m.lerp_(g, 1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    denom = (v.sqrt() / math.sqrt(1 - b2**t)).add_(eps)
    return w.addcdiv(m, denom, value=-lr / (1 - b1**t))


@torch.no_grad()
def clip_grad_norm(model, max_norm):
    """torch.nn.utils.clip_grad_norm_ that also sees the FP8 gradients of O2Linear. The total
    norm is over every .grad and every dequantized FP8 gradient; clipping multiplies the .grads
    and divides the FP8 gradients' scales (exact: the FP8 bytes stay as they are). Returns the
    norm before clipping (non-finite if any gradient is)."""
    params = [p for p in model.parameters() if p.grad is not None]
    fp8 = [m.wgrad for m in model.modules() if isinstance(m, O2Linear) and m.wgrad is not None]
    norms = [torch.nn.utils.get_total_norm([p.grad for p in params])] if params else []
    norms += [dequantize(q, torch.float32).norm() for q in fp8]
    if not norms:
        return torch.zeros(())
    norm = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # torch's rule, as below
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    for q in fp8:
        q.scale = q.scale / coef
        q.amax = q.amax * coef
    return norm


# -----------------------------------------------------------------------------
# Memory accounting: real storage bytes, walked, not computed from a formula


def _nbytes(t):
    return t.numel() * t.element_size()


def _fp8_nbytes(q):
    return 0 if q is None else _nbytes(q.data) + _nbytes(q.scale)


def training_state_bytes(model, optimizer, is_block_linear=None):
    """Bytes held per parameter by the training state, split into block Linear weights and the
    whole model. Call it after backward (gradients present) and after at least one step
    (optimizer state present). Returns a dict of dicts:

        {"linear": {"params", "weight", "grad", "optimizer", "gemm_weight", "per_param"},
         "model":  {... the same over every parameter ...}}

    weight = the stored (master) weight, grad = gradients (fp32, bf16 or FP8 + scale), optimizer
    = every tensor of the optimizer state, gemm_weight = the FP8 weight copies an Fp8Linear holds
    from its first forward of a step to the optimizer step (reported, not in per_param)."""
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
        if isinstance(m, O2Linear):
            row["grad"] += _fp8_nbytes(m.wgrad)
            row["weight"] += _nbytes(m.weight_scale)
        if isinstance(m, Fp8Linear) and m._w_cache is not None:
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
