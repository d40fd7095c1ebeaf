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

`v_format="fp8"` takes 1 B off v, `grad_accum="fp8"` 1 B off the gradient sum (at a price in
accuracy, (6)): 5.09 B with both. `bench.py memory` measures every combination.

Embeddings, norms, biases and the LM head are few parameters and numerically touchy; they keep
fp32 master weights and fp32 Adam state, and their AdamW is bit-identical to torch.optim.AdamW.

(1) Master weights need mantissa, not range. fp16 has 11 significant bits; the range is what the
    scale is for: the master is stored as w * s, with s a power of two that puts amax(w) near
    2^12 (far below fp16's max 65504, and 2^26 above its smallest normal). Powers of two rescale
    exactly.
(2) The weight gradient only feeds Adam, which normalizes it: the update is m / sqrt(v), so a
    relative error in g of a few percent moves the update by a few percent, the order of the
    noise of a mini-batch gradient. E4M3 (about 31.5 dB) is enough, with scales fine enough for
    its range (7): tests/test_optim.py measures the summed update of 30 steps at more than 22 dB
    SQNR against fp32 AdamW's.
(3) m is a running average of gradients and enters the update only through m / sqrt(v): E4M3,
    as for the gradient. But m and v round independently, each under its own scales, and after a
    spike they disagree: v's scale follows the spike for ~1/(1-b2) steps, m's for ~1/(1-b1), so
    an entry can hold a stored m != 0 next to a stored v of 0. If its next gradient is 0 (an
    E4M3 gradient flushes small entries beside a spike), the update is lr * m_hat / eps:
    hundreds of thousands of times AdamW's. The guard costs no byte: after the moment updates
    (in fp32), m is clamped to +-adam_ratio_bound(t) * sqrt(v), the largest ratio |m| / sqrt(v)
    that Adam's recursions can reach from any gradient sequence (a Cauchy-Schwarz bound, below).
    An update is then never larger than one fp32 AdamW can make, and where v is 0, m is 0. fp32
    moments obey the bound (a gradient growing by b2/b1 per step meets it), so the clamp only
    moves moments that disagree. tests/test_o2_numerics.py checks the bound and replays the
    spike, and 20 seeded adversarial sequences, against fp32 AdamW.
(4) v is a running average of g^2, twice the dynamic range of g in binades, and it sits in a
    denominator. fp16 (40 binades with subnormals) with a scale holds it. Option v_format="fp8"
    (beyond FP8-LM) stores sqrt(v) in E4M3 instead: the square root halves the dynamic range back
    to that of g, and the update needs only sqrt(v). What underflows either format is covered by
    the bound of (3).
(5) Rounding to nearest drops every change below half a spacing, and a stored tensor that is
    updated a little at a time then stops following its fp32 value:
      * the fp16 master: its spacing is 2^-11 to 2^-12 of the weight, so an update of 1e-4 of
        the weight, and every step of weight decay at GPT-2's lr * wd = 6e-6, would vanish
        (FP8-LM's fp16 master has this flaw);
      * the moments: once a gradient stops (a dead unit, an input feature that no longer
        occurs), m decays by b1 = 0.9 per step until it reaches E4M3's smallest codes, where
        0.9 * k rounds back to k (k <= 4, in units of 2^-9), and v by b2 until fp16's, where
        0.95 * k rounds back to k (k <= 10, in units of 2^-24). sqrt(v) in E4M3 sticks at any
        size: when its gradient stops (and its block's largest value does not) it changes by
        1 - sqrt(b2) per step (2.5% at b2 = 0.95), less while gradients shrink slowly, and half a
        spacing is 3-6% there. With m stuck and v decaying, |m| / sqrt(v) climbs to the bound of
        (3), and the weight goes on moving where AdamW's update has decayed to nothing: 43x
        AdamW's movement over the 1000 steps after an input feature stopped (tests/
        test_o2_numerics.py, section 6, rounding to nearest). A v stuck above its fp32 value
        does the opposite: with sqrt(v) in E4M3, columns whose gradient shrank 100x moved 0.17x
        as far as AdamW's.
    So the master, m and v are rounded stochastically: to one of the two neighbours, the upper
    one with probability equal to the distance from the lower one, in spacings. Every stored
    value is then its fp32 value on average: small updates and decay add up, a decaying moment
    decays at AdamW's rate in expectation, and reaches 0 (which rounds to 0) as AdamW's does.
    round_stochastic_all does it with a dither: half a spacing of uniform noise, added through
    the fp32 bit pattern, then the cast's round-to-nearest (subnormals included). Tests: 1e-4
    relative updates kept to within 10%, 1000 steps of decay within 5% of fp32's shrink, and
    every movement of section 6 within 2x of fp32 AdamW's. The random numbers come from a
    generator seeded by (seed, step, parameter number, rank), never the global one, one draw per
    rounded tensor (master, m, v), so a resumed run draws the same numbers and is bit-identical
    to one that never stopped. No byte is stored for it.
(6) Gradient accumulation. Re-quantizing an FP8 running sum after every micro-step adds one
    rounding error per micro-step, of the size of the partial sum: over 16 equal micro-steps
    the sum comes out about 9 dB worse than one E4M3 cast of the fp32 sum. By default
    (grad_accum="fp16") micro-steps are summed in a scaled fp16 buffer (7 more significant bits
    than E4M3), and the sum is cast to E4M3 once, when something first reads `fp8_grad(p)`
    (clipping, communication, the step): within 1.5 dB of one cast at 1, 4, 16 and 40 micro-
    steps, also with rows 1e6 apart. The buffer costs 1 B per parameter while micro-steps
    accumulate. grad_accum="fp8" keeps the gradient at 1 B throughout, and its error compounds
    as above.
(7) Scales for the range of rows. One scale per tensor lets E4M3 cover about 2^18 below the
    tensor's largest value, and rows of a layer's gradient can lie further apart (output units
    that learn at different rates, a unit that is almost dead). Rows 1e6 apart: the smaller
    rows' gradient, m and v flush to zero, and those rows get no update at all (0x AdamW's
    movement, tests/test_o2_numerics.py, section 6). So the FP8 gradient, m and v carry one fp32
    scale per block of 128 consecutive values of the flattened tensor (state_block; v in fp16
    too). The block size comes from `bench.py state` (results/o2_state_cpu.json), which measures
    the fraction of values each granularity flushes to zero. On the README model's real
    gradients and moments it is small at any granularity (one scale per tensor: at most 0.4% of
    a gradient, finer scales 0.0%); the adversaries decide. Blocks must not span two rows: 128
    divides every block Linear's width in config/ (128 for shakespeare_char, 768, 2048), while
    256-value blocks span two rows of the README model's 128-wide layers and flush all of the
    smaller rows 1e6 apart there. Within a row, finer blocks flush less of a gradient whose
    magnitudes are lognormal (log2 |g| with a std of 4.9: section 6's first step over 2^35):
    83% of it with one scale per tensor, 12% with 128 values per scale, 8% with 64 (at twice the
    bytes). The scales cost 4/128 = 1/32 B per value of each of the three tensors. A block still
    holds only E4M3's range: a value 1e7 above its 127 neighbours (a spike) freezes them for
    tens of steps, as one scale per tensor froze the whole tensor.

Non-finite gradients: before any state is touched, one check over every gradient (a single
device-to-host sync per step, or the caller's verdict: train.py has one from its own single sync)
decides whether the step is taken. If any is NaN or inf, the step is skipped and counted
(`optimizer.skipped_steps`), and no scale, moment or weight changes. A scale computed from a tiny
amax stays a finite power of two (at most 2^126).

The optimizer math itself runs in fp32 on dequantized copies, with the same betas, lr, weight
decay and schedule as torch.optim.AdamW, for all tensors of a param group at once: each
operation is one torch._foreach_* call over every O2 weight (or every fp32 parameter), so the
update is ~140 operator calls whatever the model's depth, plus five per O2 weight: the three
draws of its seeded rounding noise and the block amaxes of m and v (tests/test_optim.py counts
them; each weight's FP8 cast for the next forward, which the step also makes, is per tensor: see
O2Linear.refresh_fp8_weight). The price is transient memory: the fp32 copies of w, m, v and g,
the int32 rounding noise of three tensors and the update's intermediates come to several dozen
bytes per value while a foreach call runs, ten times the state O2 keeps. So the step takes the O2
weights of a group in runs of at most STEP_CHUNK = 2^25 values (a larger weight alone), which
changes no bit (tests/test_optim.py): the step's temporaries stay a few GB whatever the model's
size, at the price of ~140 more operator calls per run.
"""

import math
from dataclasses import replace

import torch
import torch.nn as nn

from nanofp8.emulate import amax_each, fp8_to_float
from nanofp8.fp8 import E4M3, WEIGHT, Fp8Linear, compute_scale, dequantize, pack_saved, quantize, unpack_saved

FP16_MAX = 65504.0
MASTER_HEADROOM = 2.0**12  # master weights are stored with amax scaled to ~2^12 in fp16


def _fp16_scale(amax, target):
    """Power-of-two scale putting amax near `target` in fp16 (1.0 when amax is 0 or bad). The
    exponent stays within +-126, so the scale is a finite fp32 number even for an amax of 1e-36
    (a v of tiny gradients squared): such a tensor keeps what fp16 can hold under 2^126."""
    amax = amax.detach().double()
    good = torch.isfinite(amax) & (amax > 0)
    exp = torch.floor(torch.log2(target / torch.where(good, amax, torch.ones_like(amax))))
    exp = exp.clamp(-126, 126)
    return torch.where(good, torch.exp2(exp), torch.ones_like(amax)).float()


def to_fp16_scaled(x, target=MASTER_HEADROOM, generator=None):
    """(x * s in fp16, s) with s a power of two: exact rescaling, no subnormals for the bulk.
    Rounds to nearest, or stochastically (see (5) above) when a generator is given."""
    s = _fp16_scale(x.abs().amax(), target)
    y = x.float() * s
    if generator is not None:
        return round_stochastic(y, rounding_noise(y, torch.float16, generator), torch.float16), s
    return y.half(), s


# -----------------------------------------------------------------------------
# Stochastic rounding (see (5) above), for the fp16 master and the stored moments alike

MANTISSA_BITS = {torch.float16: 10, E4M3.dtype: 3}
SMALLEST_NORMAL = {torch.float16: 2.0**-14, E4M3.dtype: E4M3.min_normal}


def rounding_noise(like, dtype, generator):
    """One integer per element of `like`, uniform in [-2^(d-1), 2^(d-1)), where d = 23 - the
    mantissa bits of `dtype` is how many more significand bits fp32 has: half a spacing of
    `dtype`, counted in units of fp32's last bit (see round_stochastic)."""
    half = 1 << (22 - MANTISSA_BITS[dtype])
    return torch.randint(-half, half, like.shape, generator=generator, device=like.device, dtype=torch.int32)


def round_stochastic_all(ys, noises, dtype, out=None):
    """fp32 tensors ys -> tensors of `dtype` (fp16 or E4M3, values in its range), each value
    rounded to one of its two neighbours there, the upper one with probability equal to the
    value's distance from the lower one, in spacings: the stored value is unbiased.

    How: add to |y| a dither uniform in [-1/2, 1/2) of a spacing, then round to nearest (the
    cast). The value lands above the midpoint between its neighbours exactly as often as it should
    land on the upper one. The dither is made without knowing the spacing: the noise (rounding_noise)
    is added to the fp32 bit pattern of |y|, whose last d bits are what `dtype` does not keep, so
    it moves |y| by up to half a spacing at |y|'s own exponent. Below the format's smallest normal
    the spacing stops shrinking (subnormals are evenly spaced), so there the dither is taken at
    1.5 times the smallest normal, whose spacing that is. A value of 0 stays 0; a value far below
    a spacing becomes 0 or the smallest subnormal, unbiased. noises: from rounding_noise. out:
    tensors of `dtype` to write into (else new ones)."""
    mag = torch._foreach_abs(ys)
    at = torch._foreach_clamp_min(mag, 1.5 * SMALLEST_NORMAL[dtype])  # where the dither is measured
    moved = torch._foreach_add([a.view(torch.int32) for a in at], noises)
    dither = torch._foreach_sub([m.view(torch.float32) for m in moved], at)
    torch._foreach_add_(mag, dither)
    torch._foreach_mul_(mag, torch._foreach_sign(ys))
    if dtype == E4M3.dtype:  # |y| <= 448 plus a dither: above 448 it rounds to 448 anyway
        torch._foreach_clamp_min_(mag, -E4M3.max)
        torch._foreach_clamp_max_(mag, E4M3.max)
    out = out if out is not None else [torch.empty(y.shape, dtype=dtype, device=y.device) for y in ys]
    torch._foreach_copy_(out, mag)  # the cast rounds to nearest
    return out


def round_stochastic(y, noise, dtype):
    """round_stochastic_all for one tensor."""
    return round_stochastic_all([y], [noise], dtype)[0]


GRAD_ACCUM = ("fp16", "fp8")


# -----------------------------------------------------------------------------
# Stored state with one scale per block of values (see (7) above)

STATE_BLOCK = 128  # values per scale of the FP8 weight gradient, Adam m and Adam v
STEP_CHUNK = 2**25  # values of O2 weights per run of the step's foreach calls (see the top)


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


def state_block(numel):
    """Values per scale of a stored tensor of numel values: STATE_BLOCK, or the largest power of
    two below it that divides numel (an FP8 layer's numel is a multiple of 256: 128 there). The
    blocks are runs of consecutive values of the flattened tensor (row-major): a row of a matrix
    whose width is a multiple of the block holds whole blocks, and no block spans two rows."""
    return math.gcd(numel, STATE_BLOCK)


def _blocks(t, scale):
    """t as (blocks, values per block) for its scale: one row per scale (shape (blocks, 1)), or
    one row for a single scale (shape (), as the masters and older checkpoints' moments have)."""
    return t.reshape(scale.shape[0] if scale.dim() else 1, -1)


def quantize_wgrad(x):
    """The FP8 form of a weight gradient: E4M3, one scale per block of state_block values, as an
    Fp8Tensor of "row" granularity over the (blocks, values per block) view (dequantize gives
    back x's shape)."""
    b = state_block(x.numel())
    return replace(quantize(x.reshape(-1, b), E4M3, "row"), shape=x.shape, dtype=torch.float32)


def stored(t, fmt, noise=None):
    """(data, scale) of one moment tensor in its storage format, "fp8" (E4M3) or "fp16", with one
    scale per block (scale shape (blocks, 1)): rounded to nearest, or stochastically with `noise`
    (rounding_noise for the format's dtype)."""
    return stored_all([t], fmt, None if noise is None else [noise])[0]


def dequantize_stored(data, scale):
    """The fp32 values of a stored tensor (a moment, the master, the fp16 gradient sum) in data's
    shape, whether its scale is per block or one for the tensor."""
    return (fp8_to_float(_blocks(data, scale)) * scale.reciprocal()).view(data.shape)


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
        h.q, h.acc = quantize_wgrad(dequantize_stored(*h.acc)), None
    return h.q


def set_fp8_grad(p, q):
    """Replace the FP8 gradient of p (an O2/O3 weight) with the Fp8Tensor q; None clears it."""
    p._held_grad.q, p._held_grad.acc = q, None


def fp8_grad_nbytes(p):
    """Bytes p's FP8 gradient holds now (the E4M3 tensor and its scale, or the fp16 buffer while
    accumulating), without ending an accumulation; 0 for a parameter whose gradient is .grad."""
    h = getattr(p, "_held_grad", None)
    if h is None:
        return 0
    return sum(_nbytes(t) for t in h.acc) if h.acc is not None else _fp8_nbytes(h.q)


def fp8_grad_hook(p, hook):
    """Set the "weight gradient ready" hook of p, called as hook(p) after every micro-step's
    gradient is added (not while torch.compile traces the backward). Data parallelism launches
    the reduction from it while backward goes on: the FP8 gradient never enters .grad, so
    autograd's own post-accumulate-grad hooks never see it. One hook per weight: setting a
    second one is an error; None removes the hook and returns it."""
    old = p._held_grad.ready
    if hook is not None and old is not None:
        raise ValueError("this weight's FP8 gradient is already reduced by another wrapper (it "
                         "has a 'weight gradient ready' hook)")
    p._held_grad.ready = hook
    return old


class O2Linear(Fp8Linear):
    """Fp8Linear whose weight is stored as an fp16 master (values * weight_scale) and whose weight
    gradient is kept in FP8 on the weight, fp8_grad(self.weight), instead of in `.weight.grad`.

    `.weight` is the fp16 storage; `hp_weight()` gives the true fp32 weight. grad_accum (see (6)
    above): "fp16" sums micro-steps in a scaled fp16 buffer that becomes the FP8 gradient when
    fp8_grad is first read; "fp8" re-quantizes the FP8 sum after every micro-step."""

    grad_accum = "fp16"

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
        new.register_buffer("wgrad_in_scale", torch.ones((), device=s.device), persistent=False)
        new.ensure_grad_hook()
        new.train(lin.training)
        new._fp8_key = None
        new.refresh_fp8_weight()
        new.register_load_state_dict_post_hook(O2Linear._loaded_state)
        return new

    # The FP8 weight, cast once per optimizer step. The step calls refresh_fp8_weight() (through
    # weight_changed) right after it writes the new master; the casts W (N, K) and W^T (K, N)
    # stay in buffers (not saved: they are made from the master) until the next step. A forward
    # takes them as they are, also a compiled one: dynamo reads buffers as graph inputs, and the
    # cast stays out of the graph. (Fp8Linear's own cache is keyed on the weight's version, which
    # only eager code can read, so it is off under torch.compile.) Eager mode also notices a
    # weight changed some other way (a load, a copy, a move to another device) and casts again.

    @torch.no_grad()
    def refresh_fp8_weight(self, record=True):
        """Cast the weight to FP8 now and keep W and W^T in buffers. record=False (a weight that
        was loaded or moved, not stepped): under delayed scaling, cast with the scale the weight
        last had and record no amax, as the step that made this weight already did (a weight
        never cast in training has no such scale: its own amax makes it, as for a first cast)."""
        r = self.recipe
        if record or r.scaling == "current":
            qw, qwt = self.cast_weight()
        else:
            w = self.hp_weight().detach()
            own = compute_scale(w.abs().amax(), r.fwd_fmt, r.margin, r.power_of_two)
            scale = torch.where(self.history_count[WEIGHT] > 0, self.scale[WEIGHT], own)
            qw = quantize(w, r.fwd_fmt, "tensor", scale=scale)
            qwt = qw.t()
        meta = []
        for name, q in (("fp8_w", qw), ("fp8_wt", qwt)):
            (data, scale), m = pack_saved(q)
            meta.append(m)
            for key, t in ((name, data), (name + "_scale", scale)):
                # a new tensor, not a copy into the old one: a graph saved for backward may
                # still hold the old one (autograd would refuse it after an in-place write)
                self.register_buffer(key, t if t is not self.weight_scale else t.clone(), persistent=False)
        self._fp8_meta = tuple(meta)
        self._fp8_key = (self.weight._version, self.weight.data_ptr())
        self._w_cache = None

    def _fp8_operands(self):
        return (unpack_saved((self.fp8_w, self.fp8_w_scale), self._fp8_meta[0]),
                unpack_saved((self.fp8_wt, self.fp8_wt_scale), self._fp8_meta[1]))

    def weight_operands(self):
        """FP8 W and W^T for the forward and dgrad GEMMs: the casts of the last step."""
        if torch.compiler.is_compiling():
            return self._fp8_operands()
        key = (self.weight._version, self.weight.data_ptr())
        if self._fp8_key != key:
            self.refresh_fp8_weight(record=False)
        if self._w_cache is None:  # the same objects for every micro-step of a step
            self._w_cache = (key, self._fp8_operands())
        return self._w_cache[1]

    def weight_changed(self):
        """Called by the optimizer once it wrote a new weight: cast it, once for this step."""
        self.refresh_fp8_weight()

    @staticmethod
    def _loaded_state(module, incompatible_keys):
        module.refresh_fp8_weight(record=False)  # the loaded weight, with its loaded scale

    def hp_weight(self):
        return self.weight.float() * self.weight_scale.reciprocal()

    def take_wgrad(self, dw):
        """Receives the fp32 weight gradient of one micro-step and adds it to the kept sum.

        Under torch.compile this runs while dynamo traces the backward, where storing on the
        weight would be a side effect it cannot keep in the graph (a graph break around every
        layer). There the gradient goes to autograd instead, as the weight's own gradient: scaled
        by a power of two into fp16 (the weight's dtype; the scale in a buffer, written in place,
        which dynamo keeps), and a hook on the weight, run by autograd once it has the gradient,
        hands it back here, outside the graph. (An FP8 weight, O3, cannot carry it: O3 keeps the
        graph break.)"""
        if torch.compiler.is_compiling() and self.weight.dtype == torch.float16:
            s = _fp16_scale(dw.detach().abs().amax(), FP16_MAX / 4)
            self.wgrad_in_scale.copy_(s)
            return (dw.float() * s).half()
        dw, h = dw.float(), self.weight._held_grad
        if self.grad_accum == "fp8":  # dequantize the FP8 sum, add, re-quantize: 1 B, compounds
            if h.q is not None:
                dw = dw + dequantize(h.q, torch.float32)
            h.q = quantize_wgrad(dw)
            if self.observer is not None:  # a statistics step (nanofp8/stats.py)
                self.observer.observe_wgrad(self, dw, h.q)
        else:
            if h.acc is not None:
                dw = dw + dequantize_stored(*h.acc)
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
        """Give the weight what its FP8 gradient needs, if this weight has none yet (a deep copy
        of the module has a new weight, without hooks or attributes): the place the gradient is
        kept (fp8_grad) and the hook of take_wgrad's compiled path. Called at conversion, after a
        copy, by every eager forward, and by Fp8AdamW for the weights it updates."""
        if not holds_fp8_grad(self.weight):
            self.weight._held_grad = _HeldGrad()
        if getattr(self, "_hooked", None) != id(self.weight):
            self.weight.register_post_accumulate_grad_hook(self._grad_from_autograd)
            self._hooked = id(self.weight)

    def __setstate__(self, state):  # a deep copy, or an unpickled module
        super().__setstate__(state)
        self.ensure_grad_hook()

    def forward(self, x):
        if not torch.compiler.is_compiling():
            self.ensure_grad_hook()
        return super().forward(x)

    @torch.no_grad()
    def _grad_from_autograd(self, weight):
        """The hook of take_wgrad's compiled path: take the gradient back out of .grad."""
        g, weight.grad = weight.grad, None
        if g is not None:  # (autograd also runs it when eager take_wgrad gave it no gradient)
            self.take_wgrad(g.float() * self.wgrad_in_scale.reciprocal())

    @torch.no_grad()
    def set_weight(self, w, generator=None):
        """Store a new fp32 weight as the scaled fp16 master (bumps the version: FP8 recast),
        rounded stochastically with `generator` if given."""
        master, s = to_fp16_scaled(w, generator=generator)
        self.weight.copy_(master)
        self.weight_scale.copy_(s)
        self.weight_changed()


def convert_to_o2(model, cls=None, grad_accum="fp16"):
    """Swap every Fp8Linear of the model for an O2Linear (fp16 master, FP8 gradient), or for
    another subclass `cls` built by cls.from_fp8_linear (O3Linear, nanofp8/dist.py).
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

    State per O2 weight: exp_avg (E4M3) + exp_avg_scale, exp_avg_sq (fp16, or E4M3 holding
    sqrt(v) when v_format="fp8") + exp_avg_sq_scale, step. Other parameters: exp_avg,
    exp_avg_sq (fp32), step. `seed` picks the stream of stochastic rounding (see (5) above)."""

    rank = 0  # O3 (nanofp8/dist.py) sets its data-parallel rank: each shard rounds differently

    def __init__(self, params, model, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                 v_format="fp16", seed=0):
        if v_format not in ("fp16", "fp8"):
            raise ValueError(f"v_format={v_format!r}; expected 'fp16' or 'fp8'")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.v_format, self.seed = v_format, seed
        self.o2 = {m.weight: m for m in model.modules() if isinstance(m, O2Linear)}
        for m in self.o2.values():
            m.ensure_grad_hook()
        self.skipped_steps = 0
        self._generators = {}  # device -> the generator re-seeded for every rounding

    def rounding_noise(self, index, step, like):
        """The noise of the three stochastic roundings of parameter number `index` (counted over
        the param groups) at `step`: for its master, its m and its v, each shaped as `like` (see
        round_stochastic_all), drawn right after seeding a generator with (seed, step, index, rank)
        alone: a resumed run draws the same numbers, whatever else used the global generator."""
        gen = self._generators.get(like.device)
        if gen is None:
            gen = self._generators[like.device] = torch.Generator(device=like.device)
        key = ((self.seed * 1_000_003 + int(step)) * 1_000_003 + index) * 1_000_003 + self.rank
        gen.manual_seed(key % 2**63)
        v_dtype = E4M3.dtype if self.v_format == "fp8" else torch.float16
        return [rounding_noise(like, dtype, gen) for dtype in (torch.float16, E4M3.dtype, v_dtype)]

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
        # The step counter stays on the host (see _init_state), wherever the parameter is.
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
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
        """One flag for all gradients, one sync. O2 gradients are judged by their amax, which is
        non-finite exactly when the fp32 gradient was; the others by their largest magnitude
        (one foreach reduction: NaN propagates through it, and an inf is its own maximum)."""
        flag = self.grads_finite_flag()
        return True if flag is None else bool(flag)

    def grads_finite_flag(self):
        """grads_finite() as a 0-dim bool tensor on the device, without the sync (None: no
        gradient at all). train.py folds it into the one read of its step."""
        amaxes, plain = [], []
        for g in self.param_groups:
            for p in g["params"]:
                q = fp8_grad(p)
                if q is not None:
                    amaxes.append(q.amax.float().amax())  # (a NaN among the block amaxes stays)
                elif p.grad is not None:
                    plain.append(p.grad)
        amaxes += [a.float() for a in amax_each(plain)]
        return torch.isfinite(torch.stack(amaxes)).all() if amaxes else None

    def _init_state(self, p):
        """fp32 moments for an ordinary parameter; the decoupled formats for an O2 weight. The
        step counter lives on the host, as in torch.optim's non-fused AdamW: the step reads it
        for its bias corrections, and reading host memory is no device sync."""
        st = self.state[p]
        st["step"] = torch.zeros((), dtype=torch.float32)
        zeros = torch.zeros_like(p, dtype=torch.float32)
        if p in self.o2:
            st["exp_avg"], st["exp_avg_scale"] = stored(zeros, "fp8")
            st["exp_avg_sq"], st["exp_avg_sq_scale"] = stored(zeros, self.v_format)
        else:
            st["exp_avg"], st["exp_avg_sq"] = zeros, zeros.clone()

    @staticmethod
    def _count_steps(sts):
        """Advance the step counters of these states (one foreach add) and return them as Python
        numbers (one read of host memory for all of them, no .item() per parameter)."""
        steps = [st["step"] for st in sts]
        if not steps:
            return []
        torch._foreach_add_(steps, 1)
        return torch.stack(steps).tolist()

    def _decoupled_update(self, sts, ws, gs, group, ts, noises):
        """One AdamW step of fp32 weights ws from FP8 m and fp16 (or FP8 sqrt) v held in the
        states sts, each at its step count in ts, for all of them at once (foreach): stores the
        new moments into the states, rounded stochastically with noises[i][1] (m) and
        noises[i][2] (v) (rounding_noise), and returns the new weights (fp32, not yet rounded)."""
        # (shaped as the gradients: the moments are stored 2-D, O3's shards and masters are flat)
        ms = dequantize_stored_all([st["exp_avg"].view(g.shape) for st, g in zip(sts, gs)],
                                   [st["exp_avg_scale"] for st in sts])
        vs = dequantize_stored_all([st["exp_avg_sq"].view(g.shape) for st, g in zip(sts, gs)],
                                   [st["exp_avg_sq_scale"] for st in sts])
        ws = [w.view(g.shape) for w, g in zip(ws, gs)]
        if self.v_format == "fp8":
            vs = torch._foreach_pow(vs, 2)  # stored as sqrt(v)
        adam_moments(ms, vs, gs, group["betas"])
        # (3): no |m| beyond what Adam's recursion allows next to this v (m = 0 where v is 0)
        lim = torch._foreach_sqrt(vs)
        torch._foreach_mul_(lim, [adam_ratio_bound(t, *group["betas"]) for t in ts])
        torch._foreach_minimum_(ms, lim)
        torch._foreach_neg_(lim)
        torch._foreach_maximum_(ms, lim)
        ws = adamw_apply(ws, ms, vs, ts, group)
        for st, (data, scale) in zip(sts, stored_all(ms, "fp8", [n[1] for n in noises])):
            st["exp_avg"], st["exp_avg_scale"] = data, scale
        if self.v_format == "fp8":
            vs = torch._foreach_sqrt(vs)
        for st, (data, scale) in zip(sts, stored_all(vs, self.v_format, [n[2] for n in noises])):
            st["exp_avg_sq"], st["exp_avg_sq_scale"] = data, scale
        return ws

    def _fp32_update(self, ps, gs, group):
        """torch.optim.AdamW on ordinary parameters, all of them at once (foreach)."""
        sts = [self.state[p] for p in ps]
        ts = self._count_steps(sts)
        ws = adamw_math([p.float() for p in ps], gs, [st["exp_avg"] for st in sts],
                        [st["exp_avg_sq"] for st in sts], ts, group)
        torch._foreach_copy_(ps, ws)

    def _o2_update(self, ps, gs, group, number):
        """The O2 weights ps of one param group: AdamW on dequantized copies, the new moments and
        each new weight (its fp16 master) rounded stochastically with its own noise (see (5))."""
        mods, sts = [self.o2[p] for p in ps], [self.state[p] for p in ps]
        ts = self._count_steps(sts)
        noises = [self.rounding_noise(number[p], t, g) for p, t, g in zip(ps, ts, gs)]
        ws = dequantize_stored_all([m.weight for m in mods], [m.weight_scale for m in mods])
        ws = self._decoupled_update(sts, ws, gs, group, ts, noises)
        set_weights(mods, ws, [n[0] for n in noises])

    @torch.no_grad()
    def step(self, closure=None, grads_finite=None):
        """One AdamW step over every parameter with a gradient, in a handful of foreach kernels
        per param group (plus, per O2 weight, the draws of its rounding noise and the block amaxes
        of its moments). Returns whether it
        was taken. grads_finite: the caller's verdict on the gradients (train.py has one from its
        own single sync); None: check them here (one sync)."""
        if grads_finite is None:
            grads_finite = self.grads_finite()
        if not grads_finite:
            self.skipped_steps += 1
            return False
        number = {p: i for i, p in enumerate(p for group in self.param_groups for p in group["params"])}
        for group in self.param_groups:
            o2, grads, plain = [], [], []
            for p in group["params"]:
                q = fp8_grad(p)
                if q is None and (holds_fp8_grad(p) or p.grad is None):
                    continue
                if not self.state[p]:
                    self._init_state(p)
                if q is None:
                    plain.append(p)
                else:
                    o2.append(p)
                    grads.append(q)
            if plain:
                self._fp32_update(plain, [p.grad for p in plain], group)
            for i, j in step_chunks(o2):  # the FP8 gradients, dequantized (foreach), run by run
                gs = dequantize_stored_all([q.data for q in grads[i:j]], [q.scale for q in grads[i:j]])
                self._o2_update(o2[i:j], [g.view(p.shape) for g, p in zip(gs, o2[i:j])], group, number)
        return True


# -----------------------------------------------------------------------------
# The update, on lists of tensors: every elementwise operation is one foreach call over all the
# tensors of a kind, and each tensor gets the same operations, in the same order, as a one-tensor
# update would (the CPU runs foreach ops tensor by tensor with the ordinary kernels, so the two are
# bit-identical; tests/test_optim.py holds the fp32 parameters to torch.optim.AdamW's bits).


def dequantize_stored_all(datas, scales):
    """[dequantize_stored(data, scale)] for stored tensors of one dtype: a foreach cast (copy into
    fp32) and a foreach multiply by the reciprocal scales, per block or per tensor."""
    out = [torch.empty(_blocks(d, s).shape, dtype=torch.float32, device=d.device) for d, s in zip(datas, scales)]
    torch._foreach_copy_(out, [_blocks(d, s) for d, s in zip(datas, scales)])
    torch._foreach_mul_(out, torch._foreach_reciprocal(scales))
    return [o.view(d.shape) for o, d in zip(out, datas)]


def _amaxes(xs):
    """The amax of every tensor, stacked (one foreach reduction, one stack)."""
    return torch.stack([a.float() for a in amax_each(xs)])


def stored_all(xs, fmt, noises=None):
    """stored for a list of fp32 tensors: [(data, scale)], one scale per block (state_block),
    computed for all blocks of all tensors at once. Rounded to nearest, or stochastically with
    `noises`. The values are finite (the step checked the gradients, and m and v are made from
    them), so the E4M3 cast needs no NaN guard (quantize has one)."""
    views = [x.reshape(-1, state_block(x.numel())) for x in xs]
    amax = [a.amax(1, keepdim=True) for a in torch._foreach_abs(views)]  # one reduction per tensor
    every = torch.cat(amax)
    if fmt == "fp8":
        every, dtype = compute_scale(every, E4M3), E4M3.dtype
    else:
        every, dtype = _fp16_scale(every, FP16_MAX / 4), torch.float16
    scales = list(every.split([len(a) for a in amax]))
    ys = torch._foreach_mul(views, scales)
    if noises is not None:
        datas = round_stochastic_all(ys, [n.view(y.shape) for n, y in zip(noises, ys)], dtype)
    else:
        if fmt == "fp8":
            torch._foreach_clamp_min_(ys, -E4M3.max)
            torch._foreach_clamp_max_(ys, E4M3.max)
        datas = [torch.empty(y.shape, dtype=dtype, device=y.device) for y in ys]
        torch._foreach_copy_(datas, ys)
    return [(d.view(x.shape), s) for d, x, s in zip(datas, xs, scales)]


def _scaled_all(xs, target):
    """The power-of-two fp16 scale of every tensor (to_fp16_scaled's) and the tensors times it."""
    scales = list(_fp16_scale(_amaxes(xs), target).unbind())
    return torch._foreach_mul(xs, scales), scales


def to_fp16_scaled_all(xs, noises, target=MASTER_HEADROOM):
    """[to_fp16_scaled(x, target, rounded stochastically)] for lists of tensors and their noises
    (rounding_noise for fp16)."""
    ys, scales = _scaled_all(xs, target)
    return list(zip(round_stochastic_all(ys, noises, torch.float16), scales))


@torch.no_grad()
def set_weights(mods, ws, noises):
    """O2Linear.set_weight for many modules: each new fp32 weight stored as its scaled fp16
    master, rounded stochastically with its own noise."""
    ys, scales = _scaled_all(ws, MASTER_HEADROOM)
    round_stochastic_all(ys, [n.view(y.shape) for n, y in zip(noises, ys)], torch.float16,
                         out=[m.weight for m in mods])
    torch._foreach_copy_([m.weight_scale for m in mods], scales)
    for m in mods:
        m.weight_changed()


def adam_ratio_bound(t, b1, b2):
    """The largest |m_t| / sqrt(v_t) Adam's moments can reach after t steps from zero, whatever
    the gradients. By Cauchy-Schwarz on m_t = (1-b1) sum_i b1^(t-i) g_i, with
    b1^(t-i) = (b1 / sqrt(b2))^(t-i) * sqrt(b2)^(t-i):
        |m_t| <= (1-b1) / sqrt(1-b2) * sqrt(sum_{j<t} (b1^2/b2)^j) * sqrt(v_t).
    (0.9, 0.95): 0.45 at t=1, 1.17 in the limit; (0.9, 0.999): 3.2 at t=1, 7.3 in the limit."""
    r = b1 * b1 / b2
    terms = t if r == 1 else (1 - r**t) / (1 - r)
    return (1 - b1) / math.sqrt(1 - b2) * math.sqrt(terms)


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


def adamw_math(ws, gs, ms, vs, ts, group):
    """AdamW on lists of fp32 tensors: updates ms and vs in place, returns the new weights. The
    operations and their order are torch.optim.AdamW's (single-tensor path), one foreach call
    each, so fp32 parameters come out bit-identical to it."""
    adam_moments(ms, vs, gs, group["betas"])
    return adamw_apply(ws, ms, vs, ts, group)


@torch.no_grad()
def clip_grad_norm(model, max_norm):
    """torch.nn.utils.clip_grad_norm_ that also sees the FP8 gradients (fp8_grad). The total
    norm is over every .grad and every dequantized FP8 gradient; clipping multiplies the .grads
    and divides the FP8 gradients' scales (exact: the FP8 bytes stay as they are). Returns the
    norm before clipping (non-finite if any gradient is)."""
    params = [p for p in model.parameters() if p.grad is not None]
    fp8 = [q for q in map(fp8_grad, model.parameters()) if q is not None]
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
            row["gemm_weight"] += sum(_nbytes(t) for t in {getattr(m, k) for k in ("fp8_w", "fp8_w_scale", "fp8_wt", "fp8_wt_scale")}
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
