"""
Precision decoupling (level O2): give every tensor of the training state the lowest precision
it tolerates, as FP8-LM (MS-AMP) does. For the Linear weights of the transformer blocks:

    state                 | bf16 baseline | O2 here                                | why this precision is enough
    ----------------------+---------------+----------------------------------------+-----------------------------
    master weight         | fp32  4 B     | fp16 + per-tensor scale         2 B    | see (1), (5)
    weight for the GEMMs  | bf16 (cast)   | E4M3, cast once per step               | fp8.py: the GEMM inputs
    weight gradient       | fp32  4 B     | E4M3 + a scale per 128 values   1.03 B | see (2), (6), (7)
      ... while summing micro-steps       | fp16 + per-tensor scale         2 B    | see (6)
    Adam first moment m   | fp32  4 B     | E4M3 + a scale per 128 values   1.03 B | see (3), (5), (7)
    Adam second moment v  | fp32  4 B     | fp16 + a scale per 128 values   2.03 B | see (4), (5), (7)
                                    total:  16 B  ->  7.06 B per parameter between backward and step,
                                                      6.09 B once the step has read the gradient

`v_format="fp8"` takes 1 B off v, `grad_accum="fp8"` 1 B off the gradient sum (at a price, (6)):
5.09 B with both (ADAMW_MOMENTS below; `bench.py memory` measures each). Embeddings, norms, biases
and the LM head (few, touchy) keep fp32 state, bit-identical to torch.optim.AdamW.

(1) Master weights need mantissa, not range. fp16 has 11 significant bits; the range is what the
    scale is for: the master is stored as w * s, with s a power of two that puts amax(w) near
    2^12 (far below fp16's max 65504, and 2^26 above its smallest normal). Powers of two rescale
    exactly.
(2) The weight gradient only feeds Adam, which normalizes it: the update is m / sqrt(v), so a
    relative error in g of a few percent moves the update by a few percent, the order of a
    mini-batch's noise. E4M3 (about 31.5 dB) is enough, with scales fine enough for its range
    (7): tests/test_optim.py measures the summed update of 30 steps at more than 22 dB SQNR
    against fp32 AdamW's.
(3) m enters the update only through m / sqrt(v): E4M3, as for the gradient. But m and v round
    under their own scales, and after a spike they disagree (v's scale follows it for ~1/(1-b2)
    steps, m's for ~1/(1-b1)): a stored m != 0 can sit next to a stored v of 0, and a next
    gradient of 0 then makes an update lr * m_hat / eps, ~1e5 times AdamW's. The guard costs no
    byte: after the moment updates (in fp32), m is clamped to +-adam_ratio_bound(t) * sqrt(v), the
    largest |m| / sqrt(v) Adam's recursions reach from any gradients, which fp32 moments obey: no
    update is larger than one fp32 AdamW can make, and where v is 0, m is 0.
    tests/test_o2_numerics.py replays the spike, and 20 seeded adversarial sequences.
(4) v, a running average of g^2, has twice g's dynamic range in binades: fp16 (40 binades with
    subnormals) with a scale holds it. v_format="fp8" (beyond FP8-LM) stores sqrt(v) in E4M3:
    the root halves the range back to g's, and the update needs only sqrt(v).
(5) Rounding to nearest drops every change below half a spacing: an update of 1e-4 of a weight,
    or GPT-2's decay lr * wd = 6e-6, vanishes in the fp16 master (FP8-LM's has this flaw), and a
    moment whose gradient stopped sticks (m at E4M3's smallest codes, where 0.9 * k rounds back
    to k; sqrt(v) in E4M3 at any size, 1 - sqrt(b2) = 2.5% being under half a spacing). With m
    stuck and v decaying, |m| / sqrt(v) climbs to the bound of (3): 43x AdamW's movement after an
    input feature stopped (tests/test_o2_numerics.py, section 6). So the master, m and v are
    rounded stochastically, to the upper neighbour with probability equal to the distance from
    the lower one, in spacings: every stored value is its fp32 value on average, and small updates
    and decay add up (tests: 1e-4 updates within 10%, 1000 steps of decay within 5% of fp32's,
    section 6 within 2x of AdamW). The noise of each value is a hash of (seed, step, parameter
    number, stream, the value's element number): a resumed run is bit-identical to one that never
    stopped, O3's shard of a weight gets the noise O2 gives those elements, and no byte is stored
    for it (counter_noise; integer ops only, so eager and compiled code make the same bits).
(6) Gradient accumulation. Re-quantizing an FP8 running sum after every micro-step adds a
    rounding error of the size of the partial sum each time: 16 micro-steps come out about 9 dB
    worse than one E4M3 cast of the fp32 sum. grad_accum="fp16" (the default) sums micro-steps in
    a scaled fp16 buffer (1 B more per parameter meanwhile), cast to E4M3 once, when something
    first reads `fp8_grad(p)`: within 1.5 dB of one cast at 1 to 40 micro-steps, also with rows
    1e6 apart. grad_accum="fp8" keeps 1 B throughout, and its error compounds.
(7) Scales for the range of rows. One scale per tensor lets E4M3 cover about 2^18 below the
    tensor's largest value, and rows of a layer's gradient can lie further apart (output units
    that learn at different rates, an almost dead unit). Rows 1e6 apart under one scale: the
    smaller rows' gradient, m and v flush to zero: no update at all (tests/test_o2_numerics.py,
    section 6). So the FP8 gradient, m and v carry one fp32 scale per block of 128 consecutive
    values of the flattened tensor (state_block; v in fp16 too), 1/32 B per value; 128 divides
    every block Linear's width in config/, so no block spans two rows. Of a lognormal gradient
    (log2 |g| with a std of 4.9) one scale per tensor flushes 83%, 128 values per scale 12%, 64
    8% at twice the bytes (`bench.py state`, results/o2_state_cpu.json). A value 1e7 above its
    127 neighbours (a spike) still freezes them for tens of steps.

Non-finite gradients: before any state is touched, one check over every gradient (one device
sync, or the caller's verdict) decides whether the step is taken. If any is NaN or inf, the step
is skipped and counted (`skipped_steps`): no scale, moment or weight changes.

The step (Fp8AdamW.step, foreach=False) is one loop over the parameters: gradient, master and
moments dequantized to fp32, Adam in torch.optim.AdamW's operations and order (Fp8AdamW.update,
which O3 runs on its shards), the new m, v and master rounded into their formats. Its twin,
nanofp8/optim_foreach.py (foreach=True, the default), makes the same operations on all tensors of a
param group at once, in a number of launches that does not grow with depth: torch.optim's
_single_tensor_adamw / _multi_tensor_adamw, bit-equal. fused=True makes the loop's operations a
few kernels: on a GPU three Triton launches for all O2 weights of a group (nanofp8/optim_triton.py,
about 20 B moved per value), elsewhere one weight's update compiled by torch.compile
(nanofp8/optim_fused.py); the fp32 parameters then take torch's fused AdamW. The stored m and v
lie within one code of the loop's.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from nanofp8.fp8 import E4M3, Fp8Format, Fp8Linear, Fp8Tensor, compute_scale, dequantize, quantize
from nanofp8.o2_compile import O2CompileParts

# -----------------------------------------------------------------------------
# The stored formats: one table (see the table at the top)

FP16_MAX = 65504.0
FP16 = Fp8Format("fp16", torch.float16, FP16_MAX, 2.0**-14)  # fp16 under a scale: the master, v
MASTER_HEADROOM = 2.0**12  # master weights are stored with amax scaled to ~2^12 in fp16
STATE_BLOCK = 128  # values per scale of the FP8 weight gradient, Adam m and Adam v (see (7))
WGRAD = E4M3  # the weight gradient held on the weight, fp8_grad(p)


@dataclass(frozen=True)
class Moment:
    """One moment of an optimizer's state, as its table lists it. An O2/O3 weight keeps it in
    `fmt` with one fp32 scale per block of state_block values (7), at state[key] and
    state[key + "_scale"]; any other parameter keeps it in fp32 at state[key]."""
    key: str  # its name in the state (Adam's: torch.optim.AdamW's names)
    fmt: Fp8Format
    sqrt: bool = False  # stored as its square root (4)


ADAMW_MOMENTS = {  # Fp8AdamW's moments by v_format: the one place that names them
    "fp16": {"m": Moment("exp_avg", E4M3), "v": Moment("exp_avg_sq", FP16)},
    "fp8": {"m": Moment("exp_avg", E4M3), "v": Moment("exp_avg_sq", E4M3, sqrt=True)},
}
GRAD_ACCUM = ("fp16", "fp8")  # how micro-steps are summed (6)


def fp16_scale(amax, target):
    """Power-of-two scale putting amax near `target` in fp16 (1.0 when amax is 0 or bad). The
    exponent stays within +-126, so the scale is a finite fp32 number even for an amax of 1e-36
    (a v of tiny gradients squared): such a tensor keeps what fp16 can hold under 2^126."""
    amax = amax.detach().double()
    good = torch.isfinite(amax) & (amax > 0)
    exp = torch.floor(torch.log2(target / torch.where(good, amax, torch.ones_like(amax))))
    exp = exp.clamp(-126, 126)
    return torch.where(good, torch.exp2(exp), torch.ones_like(amax)).float()


def to_fp16_scaled(x, target=MASTER_HEADROOM, noise=None):
    """(x * s in fp16, s) with s a power of two: exact rescaling, no subnormals for the bulk.
    Rounds to nearest, or stochastically with `noise` (see (5): Fp8AdamW.rounding_noise)."""
    s = fp16_scale(x.abs().amax(), target)
    y = x.float() * s
    return (y.half() if noise is None else round_stochastic(y, noise.view(y.shape), FP16)), s


MANTISSA_BITS = {torch.float16: 10, E4M3.dtype: 3}  # (for the noise of stochastic rounding)
MASK32 = 0xFFFFFFFF


def _mul32(x, c):
    """x * c mod 2^32 for x in [0, 2^32) and a constant c < 2^32, in int64 arithmetic that never
    overflows (c in 16-bit halves: each product stays below 2^48), so a Python int, a CPU tensor,
    a CUDA tensor and inductor's code of either give the same bits (signed overflow, which a plain
    int32 or int64 product would need, is undefined in C++)."""
    return (x * (c & 0xFFFF) + ((x * (c >> 16)) & 0xFFFF) * 65536) & MASK32


def mix32(x):
    """A 32-bit integer hash of x in [0, 2^32): two rounds of multiply and xorshift (the constants
    of the "lowbias32" hash, found by search for low bias: each input bit flips each output bit
    with probability close to 1/2). x: a Python int or an int64 tensor; integer ops only."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def noise_key(seed, step, index, stream):
    """The 32-bit key of one stream of rounding noise (a Python int, made on the host): the
    optimizer's seed, the step, the parameter's number and the stream (0: the master, then the
    moments in the table's order), each folded into the hash in turn."""
    key = 0
    for part in (seed & MASK32, (seed >> 32) & MASK32, int(step), index, stream):
        key = mix32(key ^ (part & MASK32))
    return key


def counter_noise(key, element, bits):
    """int32 noise uniform in [-2^(bits-1), 2^(bits-1)), a pure function of (key, element): the
    top `bits` bits of a hash of the element's number within its parameter (int64, flattened
    row-major) under the stream's key (an int, or an int64 tensor of one key per element). No
    generator and no stored state: any shard of a tensor computes its own elements' noise, the
    same bits as the whole tensor's. The key enters twice (xor, then add), so two streams are not
    one sequence read at shifted elements."""
    lo, hi = element & MASK32, element >> 32
    h = mix32((mix32(lo ^ key) + key + hi) & MASK32)
    return ((h >> (32 - bits)) - (1 << (bits - 1))).to(torch.int32)


def noise_bits(fmt):
    """Bits of the rounding noise for fmt: d = 23 - fmt's mantissa bits, the fp32 bits it drops,
    so the noise spans one spacing of fmt in units of fp32's last bit (see round_stochastic)."""
    return 23 - MANTISSA_BITS[fmt.dtype]


def round_stochastic(y, noise, fmt):
    """fp32 y -> fmt's dtype (fp16 or E4M3, values in its range), each value rounded to one of
    its two neighbours there, the upper one with probability equal to the value's distance from
    the lower one, in spacings: the stored value is unbiased.

    How: add to |y| a dither uniform in [-1/2, 1/2) of a spacing, then round to nearest (the
    cast). The value lands above the midpoint between its neighbours exactly as often as it should
    land on the upper one. The dither is made without knowing the spacing: the noise
    (Fp8AdamW.rounding_noise) is added to the fp32 bit pattern of |y|, whose last d bits are what
    the format does not keep, so it moves |y| by up to half a spacing at |y|'s own exponent. Below the format's smallest
    normal the spacing stops shrinking (subnormals are evenly spaced), so there the dither is taken
    at 1.5 times the smallest normal, whose spacing that is. A value of 0 stays 0; a value far
    below a spacing becomes 0 or the smallest subnormal, unbiased."""
    mag = y.abs()
    at = mag.clamp_min(1.5 * fmt.min_normal)  # where the dither is measured
    dither = (at.view(torch.int32) + noise).view(torch.float32) - at
    # |y| <= max plus a dither: above max it rounds to max anyway
    return (mag + dither).mul_(y.sign()).clamp_(-fmt.max, fmt.max).to(fmt.dtype)


# -----------------------------------------------------------------------------
# Stored state with one scale per block of values (see (7) above)


def state_block(numel):
    """Values per scale of a stored tensor of numel values: STATE_BLOCK, or the largest power of
    two below it that divides numel. A block is a run of the flattened (row-major) tensor."""
    return math.gcd(numel, STATE_BLOCK)


def quantize_wgrad(x):
    """The FP8 form of a weight gradient: E4M3, one scale per block of state_block values, as an
    Fp8Tensor of "row" granularity over the (blocks, values per block) view (dequantize gives
    back x's shape)."""
    blocks = x.reshape(-1, math.gcd(x.numel(), STATE_BLOCK))  # (state_block)
    q = quantize(blocks, WGRAD, "row")
    return wgrad_tensor(q.data, q.scale, q.amax, x.shape)


def wgrad_tensor(data, scale, amax, shape):
    """quantize_wgrad's Fp8Tensor from its tensors (data and scale as (blocks, values per block)
    and (blocks, 1); shape: the weight's), as a compiled cast hands them back."""
    return Fp8Tensor(data, scale, WGRAD, "row", (1, data.shape[-1]), shape, torch.float32, amax)


def quantize_blocks(x, fmt, noise=None):
    """(data, scale): fp32 x stored in `fmt` (E4M3, or FP16 under a scale), with one fp32 scale per
    block of state_block values (scale shape (blocks, 1)): rounded to nearest, or stochastically
    with `noise` (Fp8AdamW.rounding_noise's for fmt). The values are finite (the step checked the
    gradients, and m and v are made from them), so the cast needs no NaN guard."""
    y = x.reshape(-1, math.gcd(x.numel(), STATE_BLOCK))  # (state_block)
    amax = y.abs().amax(1, keepdim=True)
    scale = fp16_scale(amax, FP16_MAX / 4) if fmt.dtype == torch.float16 else compute_scale(amax, fmt)
    y = y * scale
    data = y.clamp(-fmt.max, fmt.max).to(fmt.dtype) if noise is None else round_stochastic(y, noise.view(y.shape), fmt)
    return data.view(x.shape), scale


def dequantize_blocks(data, scale):
    """The fp32 values of a stored tensor (a moment, the master, the fp16 gradient sum, an FP8
    gradient) in data's shape, whether its scale is one per block or one for the tensor."""
    blocks = data.reshape(scale.shape[0] if scale.dim() else 1, -1)
    return (blocks.float() * scale.reciprocal()).view(data.shape)


# -----------------------------------------------------------------------------
# The FP8 weight gradient lives on its parameter
#
# Autograd's .grad holds a tensor of the parameter's own dtype; an O2/O3 weight's gradient is E4M3
# with a scale (an Fp8Tensor), so it is kept beside .grad, as an attribute of the parameter object
# itself. Every consumer (data parallelism, clipping, the optimizer, memory accounting) asks
# fp8_grad(p) while iterating over parameters; no module holds the gradient, and nobody walks
# modules to find it. The layer's backward adds to it (O2Linear.take_wgrad), the data-parallel
# average replaces it (set_fp8_grad), zero_grad clears it.


class _HeldGrad:
    """What a parameter whose gradient is held in FP8 carries: the E4M3 gradient `q`, or while
    micro-steps accumulate (grad_accum="fp16") the scaled fp16 sum `acc`; `ready`, the "weight
    gradient ready" hook (data parallelism launches the reduction from it, see fp8_grad_hook)."""

    def __init__(self):
        self.q, self.acc, self.ready = None, None, None


def holds_fp8_grad(p):
    """Whether p's gradient is held in FP8 beside .grad (an O2/O3 weight), present or not."""
    return isinstance(getattr(p, "_held_grad", None), _HeldGrad)


def fp8_grad(p):
    """The FP8 gradient of parameter p: an Fp8Tensor (quantize_wgrad's form), or None (p keeps
    its gradient in .grad, or has none yet). Reading it ends an fp16 accumulation (see (6) above):
    the sum is cast to E4M3 once, and the buffer is freed."""
    h = getattr(p, "_held_grad", None)
    if h is None:
        return None
    if h.acc is not None:
        h.q, h.acc = quantize_wgrad(dequantize_blocks(*h.acc)), None
    return h.q


def set_fp8_grad(p, q):
    """Replace the FP8 gradient of p (an O2/O3 weight) with the Fp8Tensor q; None clears it."""
    p._held_grad.q, p._held_grad.acc = q, None


def fp8_grad_hook(p, hook):
    """Set the "weight gradient ready" hook of p, called as hook(p) after every micro-step's
    gradient is added (the FP8 gradient never enters .grad, so autograd's own hooks never see
    it): data parallelism launches the reduction from it while backward goes on. One hook per
    weight: a second one is an error; None removes the hook and returns it."""
    old = p._held_grad.ready
    if hook is not None and old is not None:
        raise ValueError("this weight's FP8 gradient is already reduced by another wrapper (it "
                         "has a 'weight gradient ready' hook)")
    p._held_grad.ready = hook
    return old


class O2Linear(O2CompileParts, Fp8Linear):
    """Fp8Linear whose weight is stored as an fp16 master (values * weight_scale) and whose weight
    gradient is kept in FP8 on the weight, fp8_grad(self.weight), instead of in `.weight.grad`.

    `.weight` is the fp16 storage; `hp_weight()` gives the true fp32 weight. grad_accum (see (6)
    above): "fp16" sums micro-steps in a scaled fp16 buffer that becomes the FP8 gradient when
    fp8_grad is first read; "fp8" re-quantizes the FP8 sum after every micro-step."""

    grad_accum = "fp16"

    @classmethod
    def from_fp8_linear(cls, lin, cast=True):  # cast=False: a subclass stores another weight first (O3)
        new = cls(lin.in_features, lin.out_features, lin.bias is not None, device="meta",
                  recipe=lin.recipe, fqn=lin.fqn)
        new._init_scaling_state(lin.weight.device)
        new.load_state_dict({k: v for k, v in lin.state_dict().items() if k not in ("weight", "bias")},
                            strict=False)
        new.bias = lin.bias
        master, s = to_fp16_scaled(lin.weight.detach())
        new.weight = nn.Parameter(master)
        new.register_buffer("weight_scale", s)
        new.ensure_grad_hook()
        new.train(lin.training)
        if cast:
            new.refresh_fp8_weight()
        new.register_load_state_dict_post_hook(O2Linear._loaded_state)
        return new

    def hp_weight(self):
        return self.weight.float() * self.weight_scale.reciprocal()

    def take_wgrad(self, dw):
        """Receives the fp32 weight gradient of one micro-step and adds it to the kept sum. (Under
        torch.compile it goes to autograd instead, as the gradient of the layer's fp32 sink, and
        comes back here through a hook: ensure_grad_hook.)"""
        if torch.compiler.is_compiling():
            return dw
        dw, h = dw.float(), self.weight._held_grad
        if self.grad_accum == "fp8":  # dequantize the FP8 sum, add, re-quantize: 1 B, compounds
            if h.q is not None:
                dw = dw + dequantize(h.q, torch.float32)
            h.q = quantize_wgrad(dw)
            if self.observer is not None:  # a statistics step (nanofp8/stats.py)
                self.observer.observe_wgrad(self, dw, h.q)
        else:
            if h.acc is not None:
                dw = dw + dequantize_blocks(*h.acc)
            elif h.q is not None:  # a sum already cast (read mid-accumulation): go on from it
                dw = dw + dequantize(h.q, torch.float32)
            h.q, h.acc = None, to_fp16_scaled(dw, FP16_MAX / 4)
            if self.observer is not None:  # a statistics step: the sum so far and its E4M3 cast
                self.observer.observe_wgrad(self, dw, quantize_wgrad(dw))
        # "Weight gradient ready" (fp8_grad_hook); not while torch.compile traces the backward: a
        # traced launch would not run at the step's time, and whatever a hook did not launch,
        # Fp8DataParallel.sync_gradients() launches after backward.
        if h.ready is not None and not torch.compiler.is_compiling():
            h.ready(self.weight)
        return None  # nothing for autograd: .weight.grad stays None

    def ensure_grad_hook(self):
        """Give the weight, if it has none yet (a deep copy has a new weight), the place its FP8
        gradient is kept (fp8_grad), and the layer its gradient sink on the weight's device.
        Called at conversion, after a copy, by every eager forward, and by Fp8AdamW.

        The sink is what the Function takes in the weight's place (forward): an fp32 stand-in of
        the weight's shape, zero strides over one value, that autograd gives take_wgrad's return
        to. Eager take_wgrad returns nothing, so it never gets a gradient; under torch.compile the
        backward is traced, where storing on the weight would be a side effect dynamo cannot keep
        in the graph (a graph break around every layer), so there take_wgrad returns dW in fp32,
        as the graph's GEMM writes it (no cast, no amax: no kernel of its own), and the hook of
        the sink hands it back to take_wgrad, outside the graph: the same call as eager mode's,
        the same bits. (The weight itself, fp16 or O3's FP8, could not take an fp32 gradient.)"""
        w = self.weight
        if not holds_fp8_grad(w):
            w._held_grad = _HeldGrad()
        sink = getattr(self, "wgrad_sink", None)
        if sink is None or self._sink_of != id(w) or sink.device != w.device or sink.shape != w.shape:
            sink = torch.empty_strided(w.shape, (0,) * w.dim(), device=w.device).requires_grad_()
            sink.register_post_accumulate_grad_hook(self._grad_from_autograd)
            self.wgrad_sink, self._sink_of = sink, id(w)

    def __setstate__(self, state):  # a deep copy, or an unpickled module
        super().__setstate__(state)
        self.ensure_grad_hook()

    def _apply(self, fn, recurse=True):  # .to(device), .cuda(): the sink follows the weight (a
        out = super()._apply(fn, recurse)  # compiled forward reads it without an eager one first)
        self.ensure_grad_hook()
        return out

    def forward(self, x):
        if not torch.compiler.is_compiling():
            self.ensure_grad_hook()
        return super().forward(x, wgrad_to=self.wgrad_sink)


def convert_to_o2(model, cls=None, grad_accum="fp16"):
    """Swap every Fp8Linear of the model for an O2Linear (fp16 master, FP8 gradient), or for
    another subclass `cls` built by cls.from_fp8_linear (O3Linear, nanofp8/zero.py).
    grad_accum: "fp16" or "fp8", how micro-steps are summed (see (6) above)."""
    if grad_accum not in GRAD_ACCUM:
        raise ValueError(f"grad_accum={grad_accum!r}; expected one of {GRAD_ACCUM}")
    cls = cls or O2Linear
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is Fp8Linear:
                new = cls.from_fp8_linear(child)
                new.grad_accum = grad_accum
                setattr(parent, name, new)
    return model


# -----------------------------------------------------------------------------
# The optimizer


class Fp8AdamW(torch.optim.Optimizer):
    """AdamW over a model converted with convert_to_o2: O2Linear weights get the decoupled
    state of the table above, every other parameter plain fp32 AdamW (the same math).

    State per parameter: step, and the moments of `self.moments` (ADAMW_MOMENTS[v_format]: m and
    v, or sqrt(v)), each with its scale for an O2 weight, in fp32 for the others. `seed` picks
    the stream of stochastic rounding (5). foreach: True or None (the default) steps on
    nanofp8/optim_foreach.py, False on the loop of step(). fused=True: the O2 weights' update in a
    few kernels (nanofp8/optim_fused.py: on a GPU three Triton launches for a group, elsewhere
    compiled per weight), the other parameters on torch's fused AdamW."""

    rank = 0  # O3 (nanofp8/zero.py) sets its data-parallel rank
    sharded = False  # O3: each rank holds, and saves, only its shard of the O2 weights' state

    def __init__(self, params, model, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                 v_format="fp16", seed=0, foreach=None, fused=False):
        if v_format not in ADAMW_MOMENTS:
            raise ValueError(f"v_format={v_format!r}; expected one of {tuple(ADAMW_MOMENTS)}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.v_format, self.moments, self.seed = v_format, ADAMW_MOMENTS[v_format], seed
        self.foreach = True if foreach is None else bool(foreach)
        self.fused = bool(fused)  # nanofp8/optim_fused.py
        self.fused_compiled = False  # (whether its compiled step has run: a later failure is an error)
        self.fused_triton = None  # (on a GPU: its Triton kernels ran (True), or failed (False))
        self.o2 = {m.weight: m for m in model.modules() if isinstance(m, O2Linear)}
        for m in self.o2.values():
            m.ensure_grad_hook()
        self.skipped_steps = 0
        # the bf16 biases a compiled forward reads, after every step (a bias may step after its
        # weight's cast: nanofp8/o2_compile.py)
        self.register_step_post_hook(lambda opt, *_: O2CompileParts.keep_biases(opt.o2.values()))

    def rounded_formats(self):
        """The stored tensors an O2 step rounds stochastically, in the order of their noise
        streams: {"master": FP16, then each moment of the table: its format}."""
        return {"master": FP16, **{k: mo.fmt for k, mo in self.moments.items()}}

    def shard_start(self, p):
        """The number of the first element of p that this optimizer steps (O3: its shard's)."""
        return 0

    def rounding_noise(self, index, step, like, start=0):
        """The noise of the stochastic roundings of parameter number `index` (counted over the
        param groups) at `step`, {"master": ..., and one per moment of the table}, each shaped as
        `like` and covering the parameter's elements start .. start + like.numel() (flattened):
        counter_noise of (seed, step, index, stream) and the element's number. A resumed run gets
        the same numbers, whatever else used the global generator, and an O3 shard its elements'
        noise of O2's whole tensor."""
        element = torch.arange(start, start + like.numel(), dtype=torch.int64, device=like.device)
        return {name: counter_noise(noise_key(self.seed, step, index, stream), element, noise_bits(fmt)).view(like.shape)
                for stream, (name, fmt) in enumerate(self.rounded_formats().items())}

    def state_keys(self, p):
        """What p's state holds once it has stepped: the step and every moment of the table (each
        with its scale, for an O2 weight)."""
        keys = {"step"} | {mo.key for mo in self.moments.values()}
        return keys | {mo.key + "_scale" for mo in self.moments.values()} if p in self.o2 else keys

    def state_dict(self):
        return {**super().state_dict(), "v_format": self.v_format}  # how v is stored

    def load_state_dict(self, state_dict):
        # The same bytes mean v in fp16 and sqrt(v) in E4M3: never read one as the other.
        saved = state_dict.get("v_format", self.v_format)
        if saved != self.v_format:
            raise ValueError(f"optimizer state has Adam v stored as v_format={saved!r}; this "
                             f"optimizer has v_format={self.v_format!r}")
        # Another optimizer's state holds other moments: refused here, not found out at the step.
        params = [p for g in self.param_groups for p in g["params"]]
        for i, st in state_dict["state"].items():
            if i < len(params) and set(st) != self.state_keys(params[i]):
                name, keeps = type(self).__name__, ", ".join(sorted(self.state_keys(params[i])))
                raise ValueError(f"this optimizer state is not {name}'s: it holds {', '.join(sorted(st))} for "
                                 f"parameter {i}, where {name} keeps {keeps}")
        state_dict = {k: v for k, v in state_dict.items() if k != "v_format"}
        # torch.optim casts loaded state to each parameter's dtype (fp16 for an O2 master), which
        # would turn FP8 moments and fp32 scales into fp16: put back the tensors as they were saved.
        # The step counter stays on the host (see init_state), wherever the parameter is.
        super().load_state_dict(state_dict)
        for i, st in state_dict["state"].items():
            for k, v in st.items():
                if torch.is_tensor(v):
                    self.state[params[i]][k] = v.to("cpu" if k == "step" else params[i].device, copy=True)

    def zero_grad(self, set_to_none=True):
        super().zero_grad(set_to_none)
        for group in self.param_groups:
            for p in group["params"]:
                if holds_fp8_grad(p):
                    set_fp8_grad(p, None)

    def grads_finite(self):
        """Whether every gradient is finite: a 0-dim bool tensor on the device, read by the step
        (the one device sync) or by train.py with its step's other values. An O2 gradient is
        judged by its amax, non-finite exactly when the fp32 gradient was (foreach: the same
        verdict from optim_foreach.grads_finite, in fewer operator calls)."""
        if self.foreach:
            return _foreach().grads_finite(self)
        ok = []
        for group in self.param_groups:
            for p in group["params"]:
                q = fp8_grad(p)
                g = p.grad if q is None else q.amax
                if g is not None:
                    ok.append(torch.isfinite(g).all())
        return torch.stack(ok).all() if ok else torch.tensor(True)

    def init_state(self, p, like=None):
        """The moments at zero, fp32 for an ordinary parameter, in the table's formats for an O2
        weight (shaped as `like`: O3's shard). The step counter lives on the host, as in
        torch.optim's non-fused AdamW: the step reads it for its bias corrections, and reading
        host memory is no device sync."""
        st = self.state[p]
        st["step"] = torch.zeros((), dtype=torch.float32)
        zeros = torch.zeros_like(p if like is None else like, dtype=torch.float32)
        for mo in self.moments.values():
            if p in self.o2:
                st[mo.key], st[mo.key + "_scale"] = quantize_blocks(zeros, mo.fmt)
            else:
                st[mo.key] = zeros.clone()

    @torch.no_grad()
    def step(self, closure=None, grads_finite=None):
        """One AdamW step over every parameter with a gradient; returns whether it was taken.
        grads_finite: the caller's verdict on the gradients; None: check them here (one sync)."""
        if not bool(self.grads_finite() if grads_finite is None else grads_finite):
            self.skipped_steps += 1  # a NaN or inf gradient: nothing changes
            return False
        if self.fused:  # the loop below, compiled: nanofp8/optim_fused.py
            from nanofp8 import optim_fused
            optim_fused.step(self)
            return True
        if self.foreach:  # the twin of the loop below
            _foreach().step(self)
            return True
        index = -1  # parameters are numbered over the param groups (the rounding noise's seed)
        for group in self.param_groups:
            for p in group["params"]:
                index += 1
                q = fp8_grad(p)
                if q is None and (p in self.o2 or p.grad is None):
                    continue  # no gradient this step
                st = self.state[p]
                if not st:
                    self.init_state(p)
                st["step"] += 1
                if q is None:  # fp32 state: torch.optim.AdamW's own update
                    p.copy_(self.update(p.float(), p.grad, st, group))
                    continue
                mod = self.o2[p]  # an O2 weight: its gradient and master in fp32
                g = dequantize_blocks(q.data, q.scale).view(p.shape)
                noise = self.rounding_noise(index, st["step"].item(), g, self.shard_start(p))  # (host: no sync)
                w = self.update(dequantize_blocks(mod.weight, mod.weight_scale), g, st, group, noise)
                master, scale = to_fp16_scaled(w, noise=noise["master"])  # the new fp16 master (5)
                mod.weight.copy_(master)
                mod.weight_scale.copy_(scale)
                mod.refresh_fp8_weight()  # and its FP8 cast for the next forward
        return True

    def update(self, w, g, st, group, noise=None):
        """One AdamW step of one parameter, or of O3's shard of one (nanofp8/zero.py): w and g in
        fp32, st its state, its step already counted; returns the new fp32 weight, for the
        caller to store. Without noise the moments are fp32, updated in place; with the noise of
        rounding_noise they are read from the table's formats and rounded back stochastically
        (5), after the bound of (3). Its twin for lists is optim_foreach.update."""
        lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        t, M, V = st["step"].item(), self.moments["m"], self.moments["v"]
        if noise is None:
            m, v = st[M.key], st[V.key]
        else:
            m, v = (dequantize_blocks(st[mo.key].view(g.shape), st[mo.key + "_scale"]) for mo in (M, V))
            v = v.pow(2) if V.sqrt else v  # (stored as sqrt(v))
        # Adam's moments and update, in torch.optim.AdamW's operations and order
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        if noise is not None:  # (3): no |m| beyond what Adam allows beside this v
            lim = v.sqrt().mul_(adam_ratio_bound(t, b1, b2))
            m = m.minimum(lim).maximum(lim.neg_())
        w = w * (1 - lr * wd)  # decoupled weight decay
        denom = (v.sqrt() / math.sqrt(1 - b2**t)).add_(eps)
        w.addcdiv_(m, denom, value=-lr / (1 - b1**t))
        if noise is not None:  # the new m and v in their formats, rounded stochastically (5)
            st[M.key], st[M.key + "_scale"] = quantize_blocks(m, M.fmt, noise["m"])
            st[V.key], st[V.key + "_scale"] = quantize_blocks(v.sqrt() if V.sqrt else v, V.fmt, noise["v"])
        return w


def _foreach():
    from nanofp8 import optim_foreach  # (here, not at the top: optim_foreach imports this file)
    return optim_foreach


def adam_ratio_bound(t, b1, b2):
    """The largest |m_t| / sqrt(v_t) Adam's moments can reach after t steps from zero, whatever
    the gradients. By Cauchy-Schwarz on m_t = (1-b1) sum_i b1^(t-i) g_i, with
    b1^(t-i) = (b1 / sqrt(b2))^(t-i) * sqrt(b2)^(t-i):
        |m_t| <= (1-b1) / sqrt(1-b2) * sqrt(sum_{j<t} (b1^2/b2)^j) * sqrt(v_t).
    (0.9, 0.95): 0.45 at t=1, 1.17 in the limit; (0.9, 0.999): 3.2 at t=1, 7.3 in the limit."""
    r = b1 * b1 / b2
    terms = t if r == 1 else (1 - r**t) / (1 - r)
    return (1 - b1) / math.sqrt(1 - b2) * math.sqrt(terms)


@torch.no_grad()
def clip_grad_norm(model, max_norm):
    """torch.nn.utils.clip_grad_norm_ that also sees the FP8 gradients (fp8_grad). The total
    norm is over every .grad and every dequantized FP8 gradient; clipping multiplies the .grads
    and divides the FP8 gradients' scales (exact: the FP8 bytes stay as they are). Returns the
    norm before clipping (non-finite if any gradient is)."""
    from nanofp8 import optim_foreach  # (the twin: every FP8 gradient at once, on a GPU compiled)

    params = [p for p in model.parameters() if p.grad is not None]
    fp8 = [q for q in optim_foreach.fp8_grads(model.parameters()) if q is not None]  # fp8_grad(p) of each
    norms = [torch.nn.utils.get_total_norm([p.grad for p in params])] if params else []
    norms += optim_foreach.fp8_norms(fp8)  # the norm of each dequantized FP8 gradient
    if not norms:
        return torch.zeros(())
    norm = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # torch's rule (clip_grads_with_norm_)
    for dtype in {p.grad.dtype for p in params}:  # ... and its product, by this coefficient (fp32)
        torch._foreach_mul_([p.grad for p in params if p.grad.dtype == dtype], coef)
    if fp8:  # (one foreach call each, not a launch per gradient)
        scales, amaxes = torch._foreach_div([q.scale for q in fp8], coef), torch._foreach_mul([q.amax for q in fp8], coef)
        for q, scale, amax in zip(fp8, scales, amaxes):
            q.scale, q.amax = scale, amax
    return norm

