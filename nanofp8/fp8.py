"""
FP8 training, from the bits up: formats, scaling, and the FP8 linear layer.

This file is meant to be read top to bottom: it is everything nanofp8 needs to run the GEMMs of a
Linear layer in 8-bit floating point, and it doubles as a lesson.

1. Two 8-bit formats
--------------------
An 8-bit float has 1 sign bit and 7 bits to split between exponent (range) and mantissa
(precision). Hopper tensor cores take two splits:

    E4M3 (torch.float8_e4m3fn): 4 exponent bits, 3 mantissa bits. Max 448, smallest normal
         2^-6, smallest subnormal 2^-9. No infinity ("fn" = finite): 0x7f/0xff are NaN.
    E5M2 (torch.float8_e5m2):   5 exponent bits, 2 mantissa bits. Max 57344, smallest normal
         2^-14, smallest subnormal 2^-16. Has +-inf, like a shortened fp16.

Each spans only about 18 (E4M3) or 32 (E5M2) binades, against fp32's 277. Weights and
activations have a fairly tame spread and benefit from the extra mantissa bit: E4M3. Gradients
are spikier, and losing a tiny gradient to underflow is worse than rounding a large one: E5M2.
That split is the "hybrid" convention (Transformer Engine, MS-AMP, torchao tensorwise).
Fine-grained recipes (DeepSeek-V3, torchao rowwise) give every row or 128 values their own
scale, which makes range much less of a problem, so they use E4M3 everywhere (formats="e4m3").

2. Scaling: putting a tensor's values where the format has room
---------------------------------------------------------------
A tensor is multiplied by a scale before the cast, chosen to bring its largest magnitude (amax)
up to the format's max:

    scale = fp8_max / amax          x_fp8 = saturate(x * scale)          x ~= x_fp8 / scale

THE CONVENTION, stated once: `scale` is always the multiply-before-cast factor (as in Transformer
Engine and torchao). Dequantizing multiplies by `inv_scale = 1 / scale`, and that inverse is what
`torch._scaled_mm` (and our Triton kernel) take as scale_a / scale_b: (a_fp8 * inv_a) @ (b_fp8 * inv_b).

Details that matter:
  * amax is taken in float64 before the division: fp8_max / amax in fp32 can round differently
    depending on how a compiler fuses it, and float64 then one rounding to fp32 gives the same
    scale in eager, compiled and Triton code (torchao's trick), so every backend multiplies the
    very same FP8 bytes and scales.
  * amax is clamped to >= 1e-12, so an all-zero tensor gets a large finite scale, not inf.
  * Optional power-of-two scales (rounded down, as MS-AMP always does): multiplying by 2^k is
    exact, so scaling adds no rounding error. A margin m divides the scale by 2^m (headroom).
  * Casts saturate: a finite value never becomes inf or NaN (clamped to +-fp8_max first; E5M2
    would overflow to inf). A non-finite input is NOT hidden (E4M3's cast would turn inf into
    448): it becomes NaN and propagates to the loss, where the training loop skips the step.
  * A NaN or inf amax never becomes a scale: the previous scale (or 1.0) is kept instead.

Where the amax comes from:
  * current ("just-in-time") scaling: the amax of the very tensor being cast. Always fits, and
    costs one extra read of the tensor.
  * delayed scaling: the amax of the last H steps (the history), as Transformer Engine does.
    The scale of step t comes only from steps before t; the amax of step t is recorded by the
    pass that casts. Values can outgrow a stale scale and saturate: every layer counts the values
    it clipped, per tensor role. The first cast of a role measures the tensor itself (TE starts
    from a scale of 1.0, which flushes a gradient of 1e-6 to zero).

How many scales (a Recipe's granularity):
  * "tensor": one scale for the whole tensor.
  * "row":    one scale per row of the GEMM operand, along the contraction dimension.
  * "block":  one scale per tile: 1x128 for activations and gradients (one token, 128 channels),
              128x128 for weights, as in DeepSeek-V3. An outlier costs precision to its own tile.
              MXFP8 (Blackwell's) is "block" with 1x32 tiles and one-byte power-of-two scales
              chosen by the OCP rule: nanofp8/mx.py, the recipe "mxfp8".

3. The three GEMMs of a Linear layer
------------------------------------
For y = x W^T (x: M x K tokens by features, W: N x K), training runs three GEMMs:

    forward  y  = x  @ W^T     E4M3 x E4M3   contraction over K
    dgrad    dx = dy @ W       E5M2 x E4M3   contraction over N
    wgrad    dW = dy^T @ x     E5M2 x E4M3   contraction over M (the tokens)

Every GEMM here has one form, out = A @ B^T with A: (rows, k), B: (cols, k), both quantized
along k. Scales must sit along the non-contracted dims (a row scale of A and one of B factor out
of the dot product; a scale varying along k would not), so each GEMM quantizes its operands along
its own contraction dim: the row-scaled x of the forward pass cannot serve wgrad, which contracts
over tokens. And FP8 tensor cores want the first operand row-major and the second column-major,
which is exactly B (cols, k) row-major viewed as B^T.

Saved for backward are the FP8 operands of the backward GEMMs (x^T and W^T, quantized along M
and N), not x and W: an activation then costs 1 byte per element instead of 2 or 4, most of a
transformer's activation memory. With tensor scales (and square tiles) these are transposes of
the forward copies; row and 1x128 scales re-quantize them while the high-precision x is at hand.
Fast accumulation (Hopper's cheaper FP8 accumulate) is used only in the forward GEMM; gradients,
whose errors compound over training, always get the careful path.

4. What a cast did, and what runs where
---------------------------------------
nanofp8/stats.py measures what each cast lost, per layer and operand: values clipped at the max,
values flushed to zero or into subnormals, and the SQNR of the FP8 copy (about 31 dB for E4M3,
25 for E5M2). This file computes everything in plain torch: quantize, dequantize, the fp32
reference GEMM (backend "emulate") and one torch._scaled_mm call. Behind two seams (device.gemm,
device.cast), nanofp8/device.py holds torch._scaled_mm's CUDA contract, its fallbacks and the
Triton glue (backends "torch", "triton"), and nanofp8/emulate.py the reference's fast CPU twin
(backend "cpu", train.py's default on a CPU): the same numbers, bit for bit.
"""

import math
from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn

from nanofp8.mx import mx_scale  # the OCP MX rule (MXFP8), for the "mxfp8" preset

# -----------------------------------------------------------------------------
# 1. Formats


@dataclass(frozen=True)
class Fp8Format:
    name: str
    dtype: torch.dtype
    max: float  # largest finite value
    min_normal: float  # below this, values lose mantissa bits (subnormals), then flush to 0


E4M3 = Fp8Format("e4m3", torch.float8_e4m3fn, 448.0, 2.0**-6)
E5M2 = Fp8Format("e5m2", torch.float8_e5m2, 57344.0, 2.0**-14)


def clip_edge(fmt):
    """The rounding boundary above the format's max (max + half a step of its top binade: 464 for
    E4M3, 61440 for E5M2). A scaled value beyond it was clipped: the cast changed it by more than
    rounding to nearest would have."""
    mantissa_bits = round(-math.log2(torch.finfo(fmt.dtype).eps))
    return fmt.max + 2.0 ** (math.floor(math.log2(fmt.max)) - mantissa_bits) / 2

# (format of weights and activations, format of gradients)
FORMAT_CONVENTIONS = {"hybrid": (E4M3, E5M2), "e4m3": (E4M3, E4M3)}

GRANULARITIES = ("tensor", "row", "block")  # the one list: config, sample, bench, stats, tests read it
AMAX_EPS = 1e-12  # amax floor: an all-zero tensor gets a large finite scale, never inf
BLOCK = 128  # tile edge of block scaling (DeepSeek-V3): 1x128 activations, 128x128 weights
K_STEP = 128  # a block GEMM adds its fp32 partial sums one K_STEP-wide slice of K at a time

# -----------------------------------------------------------------------------
# 2. Scales and the quantized-tensor container


def compute_scale(amax, fmt, margin=0, power_of_two=False, fallback=None):
    """scale = fp8_max / amax (/ 2^margin), computed in float64, returned as fp32.

    Where amax is NaN or inf, the result is `fallback` (same shape, or broadcastable) or 1.0:
    a bad amax is never allowed to become a scale. The default scale rule of a Recipe."""
    amax64 = amax.detach().double()
    scale = fmt.max / torch.clamp(amax64, min=AMAX_EPS)
    if power_of_two:
        scale = torch.exp2(torch.floor(torch.log2(scale)))  # round down: never exceed range
    scale = (scale / 2.0**margin).float()
    if fallback is None:
        fallback = torch.ones_like(scale)
    return torch.where(torch.isfinite(amax64), scale, fallback.float().expand_as(scale))


@dataclass
class Fp8Tensor:
    """FP8 data + fp32 scales + what is needed to give the original tensor back.

    data has the input's shape (..., rows, cols) (a vector: (1, cols)), row-major (the transpose
    t() gives is a view of the same bytes: a GEMM copies what it needs row-major). Leading dims
    make a batch of matrices, each scaled on its own except by a "tensor" scale.
    scale (the multiply-before-cast factor) has shape () for "tensor", (..., rows, 1) for "row",
    and (..., ceil(rows/br), ceil(cols/bc)) for "block" with tiles `block` = (br, bc); E8M0 for MX."""

    data: torch.Tensor
    scale: torch.Tensor
    fmt: Fp8Format
    granularity: str
    block: tuple
    shape: torch.Size  # original shape
    dtype: torch.dtype  # original dtype
    amax: torch.Tensor = None  # the amax the data was measured with (NaN where it was non-finite;
    #                            None where a Triton quantizer measured it and kept it on chip)
    data_t: torch.Tensor = None  # the transposed copy, where the quantizer wrote it in the same pass
    _inv: tuple = field(default=None, repr=False, compare=False)  # (scale, 1 / scale), once computed
    # (scale, the 2-norm of the dequantized values) where the cast that made the data measured it in
    # the same pass (nanofp8/optim_triton.py's gradient casts): valid while the scale is that one
    _norm: tuple = field(default=None, repr=False, compare=False)

    @property
    def inv_scale(self):
        """1 / scale, what the GEMMs multiply by; computed once per scale. Kept with the scale it
        inverts, so a container whose scale is replaced (clipping divides an FP8 gradient's scale)
        never hands out the old inverse."""
        if self._inv is None or self._inv[0] is not self.scale:
            self._inv = (self.scale, self.scale.float().reciprocal())  # (.float(): E8M0 has no reciprocal)
        return self._inv[1]

    def t(self):
        """The transpose, without re-quantizing. A tensor scale and a square block grid transpose
        with the data; a row scale does not (it would then vary along the new contraction dim)."""
        if self.granularity == "row":
            raise ValueError("row-scaled FP8 data cannot be transposed: re-quantize the transpose")
        scale = self.scale if self.granularity == "tensor" else self.scale.mT.contiguous()
        data_t = self.data_t
        if data_t is None:  # a view; under torch.compile a copy (dynamo's capture of an autograd
            # Function refuses to save a view made inside its graph)
            data_t = self.data.mT.contiguous() if torch.compiler.is_compiling() else self.data.mT
        return Fp8Tensor(data_t, scale, self.fmt, self.granularity, self.block[::-1], data_t.shape,
                         self.dtype, self.amax, _inv=self._inv if self.granularity == "tensor" else None)

    def unbind(self):
        """A batch (..., rows, cols) as a list of its matrices, each an Fp8Tensor with its scales."""
        data = self.data.reshape(-1, *self.data.shape[-2:])
        scale = [self.scale] * len(data) if self.granularity == "tensor" else \
            self.scale.reshape(-1, *self.scale.shape[-2:])
        return [Fp8Tensor(d, s, self.fmt, self.granularity, self.block, d.shape, self.dtype)
                for d, s in zip(data, scale)]


def expand_tiles(s, block, shape):
    """Tile scales (..., R, C) -> one per element (..., rows, cols): (i, j) gets s[i // br, j // bc].
    A gather rather than s.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:rows, :cols]: under
    torch.compile, inductor's CPU code (torch 2.13) gets that form wrong when a dim is not a
    multiple of its tile (its "loop split" drops the ragged last tile): wrong numbers, no error."""
    rows = torch.arange(shape[-2], device=s.device) // block[0]
    cols = torch.arange(shape[-1], device=s.device) // block[1]
    return s[..., rows[:, None], cols]


def measure_amax(x2, granularity, block, rows_first=False):
    """max |x| of x2 (..., rows, cols): one value ("tensor"), one per row, or one per (br, bc)
    tile of each matrix (ragged edge tiles padded with zeros). NaN where x holds a NaN. rows_first:
    a tensor's as the max of its rows' (the same value), which, compiled, the kernel making x row by
    row (a LayerNorm) takes in the same pass: one tiny reduction remains, not two reading x again."""
    if granularity == "block":
        br, bc = block
        rows, cols = x2.shape[-2:]
        xp = torch.nn.functional.pad(x2.abs(), (0, (-cols) % bc, 0, (-rows) % br))
        return xp.unflatten(-1, (-1, bc)).unflatten(-3, (-1, br)).amax(dim=(-3, -1))
    # max(|x|) = max(max x, -min x): one read of x, where abs() then amax() make two passes
    lo, hi = torch.aminmax(x2) if granularity == "tensor" and not rows_first else torch.aminmax(x2, dim=-1, keepdim=True)
    amax = torch.maximum(hi, -lo).abs()  # a NaN in x makes both NaN, an inf either; abs: +0, never -0
    return amax.amax() if granularity == "tensor" and rows_first else amax


def quantize(x, fmt, granularity="tensor", block=(1, BLOCK), scale=None, margin=0,
             power_of_two=False, amax=None, scale_rule=compute_scale, rows_first=False):
    """Quantize x (..., rows, cols) to FP8 along its last dim (the GEMM contraction dim), each
    matrix of a batch on its own (a "tensor" scale excepted). Returns an Fp8Tensor.

    scale: use this scale instead of measuring one (delayed scaling). Its shape must match
    the granularity; the amax is still measured and returned in the container, unless `amax`
    gives it (x's, measured already). scale_rule(amax, fmt, margin, power_of_two) makes the scale."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"unknown granularity {granularity!r}; expected one of {GRANULARITIES}")
    if x.dim() < 1 or x.numel() == 0:
        raise ValueError(f"cannot quantize a tensor of shape {tuple(x.shape)}")
    x2 = (x.reshape(1, -1) if x.dim() == 1 else x).detach()
    block = tuple(block) if granularity == "block" else (1, x2.shape[-1])
    if amax is None:
        amax = measure_amax(x2, granularity, block, rows_first)
    if scale is None:
        scale = scale_rule(amax, fmt, margin, power_of_two)
    # Not a bare scale.float(): on an fp32 tensor that returns the tensor itself, a second name for
    # the same storage, and torch.compile refuses to save such an alias for the backward pass.
    # E8M0 scales (MX: nanofp8/mx.py) are kept in their byte, and multiplied in fp32.
    scale = scale if scale.dtype in (torch.float32, torch.float8_e8m0fnu) else scale.float()
    el = expand_tiles(scale.float(), block, x2.shape) if granularity == "block" else scale.float()
    # Saturate: clamp to the format's range, then round to nearest even. A non-finite input
    # becomes NaN (E4M3's cast would silently turn inf into 448). Contiguous (row-major) whatever
    # x's layout: an elementwise op on a transposed view (the x^T of a backward GEMM) keeps it.
    y = torch.where(torch.isfinite(x2), (x2.float() * el).clamp(-fmt.max, fmt.max), torch.nan)
    data = y.to(fmt.dtype).contiguous()
    return Fp8Tensor(data, scale, fmt, granularity, block, x.shape, x.dtype, amax)


def _scaled(q):
    """q's values times its inverse scales, in fp32, in q.data's shape."""
    s = q.scale.float().reciprocal()
    return q.data.float() * (expand_tiles(s, q.block, q.data.shape) if q.granularity == "block" else s)


def dequantize(q, dtype=None):
    """The high-precision tensor (original shape; original dtype unless `dtype` is given)."""
    return _scaled(q).to(dtype or q.dtype).reshape(q.shape)


def sqnr(ref, approx):
    """Signal-to-quantization-noise ratio in dB: 20 log10(|ref| / |ref - approx|)."""
    ref, approx = ref.double(), approx.double()
    noise = (ref - approx).norm()
    return float("inf") if noise == 0 else (20 * torch.log10(ref.norm() / noise)).item()


# -----------------------------------------------------------------------------
# 3. The scaled GEMM: out (M, N) = dequantize(a) @ dequantize(b).T (+ bias), a (M, K), b (N, K)


def gemm_reference(a, b, out_dtype, bias):
    """The reference: dequantize both operands to fp32 and multiply. Slow, simple, exact.
    With block scales the fp32 partial sums are added one K_STEP-wide slice of K at a time, the
    order in which a block-scaled kernel promotes them. The bias is added to the fp32 product
    before the output cast, as the GEMM kernels' epilogues do."""
    a32, b32 = _scaled(a), _scaled(b)
    if a.granularity == "block":
        k = a32.shape[1]
        out = sum(a32[:, k0 : k0 + K_STEP] @ b32[:, k0 : k0 + K_STEP].t() for k0 in range(0, k, K_STEP))
    else:
        out = a32 @ b32.t()
    out = out if bias is None else out + bias.float()
    return out.to(out_dtype)


def gemm_scaled_mm(a, b, out_dtype, bias, fast_accum):
    """One torch._scaled_mm call, tensor or row scales: mat1 = a row-major, mat2 = b^T
    column-major, and the *inverse* scales, as the kernel multiplies (a * inv_a) @ (b * inv_b)^T.
    (On CUDA it refuses much: nanofp8/device.py checks the call against its rules first.)"""
    # cuBLASLt wants 16-byte aligned rows; a view into a packed buffer (SP's gathered FP8 rows
    # carry their scale behind them) is not, so it is copied (free when already contiguous).
    mat1, mat2 = a.data.contiguous(), b.data.contiguous().t()
    sa, sb = a.inv_scale, b.inv_scale
    if a.granularity == "row" or b.granularity == "row":  # row x row is a mode, mixed is not: a
        # tensor scale is repeated per row (a fresh column: expand() keeps a stride of 0, refused)
        sa = sa if a.granularity == "row" else sa.reshape(1, 1) * torch.ones(len(a.data), 1, device=sa.device)
        sb = (sb if b.granularity == "row" else sb.reshape(1, 1) * torch.ones(len(b.data), 1, device=sb.device)).t()
    in_gemm = bias is not None and out_dtype != torch.float32  # CUDA: no bias with fp32 output
    out = torch._scaled_mm(mat1, mat2, scale_a=sa, scale_b=sb, bias=bias.to(out_dtype) if in_gemm else None,
                           out_dtype=out_dtype, use_fast_accum=fast_accum)
    if bias is not None and not in_gemm:
        out = out + bias.float()  # the fp32 output takes the bias outside the GEMM, in fp32
    return out


BACKENDS = ("torch", "emulate", "cpu", "triton")


def scaled_gemm(a, b, out_dtype, bias=None, backend="torch", fast_accum=False, name="?"):
    """out (M, N) = dequantize(a) @ dequantize(b).T (+ bias), accumulated in fp32.
    a: Fp8Tensor (M, K), b: Fp8Tensor (N, K), both quantized along K, or both plain tensors (kept in
    high precision). backend "emulate": the fp32 reference here; the others: nanofp8/device.py's
    gemm (a GEMM torch._scaled_mm cannot run goes to a named alternative, reported once per layer
    `name`). Batched, a (..., M, K) and b (..., N, K) give out (..., M, N): one GEMM per matrix
    (torch._scaled_mm is 2-D only)."""
    if not isinstance(a, Fp8Tensor):  # operands a recipe keeps in high precision (Recipe.operands): the
        # GEMM a Linear runs without FP8, in the dtype of the activation or gradient a (autocast's)
        out = a @ b.to(a.dtype).t()
        return (out if bias is None else out + bias.to(out.dtype)).to(out_dtype)
    if a.data.shape[:-2] != b.data.shape[:-2] or a.data.shape[-1] != b.data.shape[-1]:
        raise ValueError(f"batch or contraction dims differ: a is {tuple(a.data.shape)}, b is {tuple(b.data.shape)}")
    if (a.granularity == "block") != (b.granularity == "block"):
        raise ValueError("block-scaled operands can only be multiplied with block-scaled operands")
    if backend not in BACKENDS:
        raise ValueError(f"unknown GEMM backend {backend!r}; expected one of {BACKENDS}")
    if a.data.dim() > 2:  # (attention's Q K^T and P V)
        out = [scaled_gemm(x, y, out_dtype, bias, backend, fast_accum, name) for x, y in zip(a.unbind(), b.unbind())]
        return torch.stack(out).reshape(*a.data.shape[:-1], b.data.shape[-2])
    # A transposed view (Fp8Tensor.t()) is copied: every GEMM reads a row-major first operand. Not
    # asked while compiling, where t() copies already: dynamo cannot know a gradient's layout when
    # it traces a backward, and on the question it traces the backward again, leaving the autocast
    # state of the failed try behind (every later autocast op of the graph then runs in fp32).
    if not torch.compiler.is_compiling() and not a.data.is_contiguous():
        a = replace(a, data=a.data.contiguous())
    if backend == "emulate":
        return gemm_reference(a, b, out_dtype, bias)
    from nanofp8.device import gemm  # the engine (seam): device rules, fallbacks, CPU emulation
    return gemm(a, b, out_dtype, bias, backend, fast_accum, name)


# -----------------------------------------------------------------------------
# 4. The recipe: every knob of FP8 training in one place, and its named presets

INPUT, WEIGHT, GRAD_OUTPUT = 0, 1, 2  # tensor roles; each has its own scaling state
# The six operands of a Linear's three GEMMs, each with the role of the tensor it is cast from:
#     forward  y = x @ w^T        dgrad  dx = dy @ w_t^T        wgrad  dW = dy_t @ x_t^T
# A recipe casts each operand on its own (Recipe.casts), so one GEMM can take operands that another
# does not: another granularity, another format, or none (high precision). The scaling state stays
# the tensor's: a delayed-scaling history describes x, whichever GEMM x is cast for.
OPERANDS = {"x": INPUT, "w": WEIGHT, "dy": GRAD_OUTPUT, "x_t": INPUT, "w_t": WEIGHT, "dy_t": GRAD_OUTPUT}
GEMMS = (("x", "w"), ("dy", "w_t"), ("dy_t", "x_t"))  # forward, dgrad, wgrad: (first, second operand)


@dataclass(frozen=True)
class Recipe:
    scaling: str = "current"  # "current" (amax of this tensor) | "delayed" (amax history)
    granularity: str = "tensor"  # "tensor" | "row" | "block" (act_tile / weight_tile)
    formats: str = "hybrid"  # "hybrid" (E4M3 fwd, E5M2 grads) | "e4m3" (E4M3 everywhere)
    history_len: int = 16  # delayed scaling: steps of amax history (MS-AMP uses 16)
    amax_algo: str = "max"  # delayed scaling: "max" over the window | "most_recent"
    margin: int = 0  # scale /= 2^margin
    power_of_two: bool = False  # round scales down to powers of two
    backend: str = "torch"  # "torch" (_scaled_mm) | "emulate" (fp32 reference) | "cpu" | "triton"
    act_tile: tuple = (1, BLOCK)  # block scales of activations and gradients: 1 token x 128 channels
    weight_tile: tuple = (BLOCK, BLOCK)  # block scales of weights (DeepSeek-V3)
    scale_rule: object = compute_scale  # (amax, fmt, margin, power_of_two) -> scale, for every cast
    # Operands cast otherwise than the knobs above say, ((operand, granularity, fmt), ...): a
    # granularity of None keeps the operand in high precision, a fmt of None is its tensor's format.
    operands: tuple = ()
    fwd_fmt: Fp8Format = field(init=False, repr=False)  # weights and activations (from `formats`)
    bwd_fmt: Fp8Format = field(init=False, repr=False)  # gradients
    # operand -> (fmt, granularity, tile) of its cast, or None: kept in high precision
    casts: dict = field(init=False, repr=False, compare=False)
    # the operands of a transpose that are the transpose of their tensor's other cast (t(): the same
    # bytes, no second cast): cast alike, with scales that transpose with the data (one tensor
    # scale, square tiles); row scales and 1x128 tiles would vary along the new contraction dim
    transposes: frozenset = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        choices = {"scaling": ("current", "delayed"), "granularity": GRANULARITIES,
                   "formats": tuple(FORMAT_CONVENTIONS), "amax_algo": ("max", "most_recent"),
                   "backend": BACKENDS}
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise ValueError(f"Recipe.{key}={getattr(self, key)!r}; expected one of {allowed}")
        if self.history_len < 1 or self.margin < 0:
            raise ValueError("Recipe needs history_len >= 1 and margin >= 0")
        fwd, bwd = FORMAT_CONVENTIONS[self.formats]
        fmts, own = (fwd, fwd, bwd), {op: (g, fmt) for op, g, fmt in self.operands}
        if not set(own) <= set(OPERANDS) or any(g not in (None, *GRANULARITIES) for g, _ in own.values()):
            raise ValueError(f"Recipe.operands={self.operands!r}: each is (operand, granularity or None, "
                             f"format or None), the operand one of {tuple(OPERANDS)}")
        casts = {}
        for op, role in OPERANDS.items():
            g, fmt = own.get(op, (self.granularity, None))
            tile = self.weight_tile if role == WEIGHT else self.act_tile
            casts[op] = None if g is None else (fmt or fmts[role], g, tile)
        for a, b in GEMMS:  # (torch._scaled_mm multiplies FP8 by FP8: one FP8 operand has no kernel)
            kinds = [None if casts[op] is None else casts[op][1] == "block" for op in (a, b)]
            if kinds[0] != kinds[1]:
                raise ValueError(f"Recipe.operands: {a} and {b} meet in one GEMM: both in high precision or "
                                 f"both FP8, both block-scaled or neither")
        if self.scaling == "delayed" and any(c and (c[1], c[0]) != ("tensor", fmts[OPERANDS[op]])
                                             for op, c in casts.items()):
            # The rows and tiles of an activation are different tokens every step, so a history
            # of per-row amaxes describes nothing that comes again: delay only whole tensors, and
            # the one scale a tensor's history gives fits one format.
            raise ValueError("delayed scaling needs granularity='tensor' for every operand, in its tensor's format "
                             "(per-row/tile amax histories of activations do not carry over between steps)")
        object.__setattr__(self, "fwd_fmt", fwd)  # (frozen: set once, here)
        object.__setattr__(self, "bwd_fmt", bwd)
        object.__setattr__(self, "casts", casts)
        alike = [op for op in ("x_t", "w_t", "dy_t") if casts[op] and casts[op] == casts[op[:-2]]]
        object.__setattr__(self, "transposes", frozenset(
            op for op in alike if casts[op][1] == "tensor" or casts[op][1] == "block" and casts[op][2][0] > 1))

    @property
    def grid(self):  # the scales' layout, for logs: "tensor", "row", "block", or "mx" (1x32, E8M0)
        return "mx" if self.scale_rule is mx_scale else self.granularity

    @property
    def name(self):
        """The preset (RECIPES) this recipe is, knob for knob, or "custom". Only the backend is not
        compared: an engine computes the same numbers as another. So a knob set to a value of its own
        (a margin, a history length, even one that current scaling never reads) makes a recipe custom,
        and a recipe built by hand with a preset's knobs carries that preset's name."""
        return next((name for name, preset in RECIPES.items() if replace(self, backend=preset.backend) == preset),
                    "custom")

    def describe(self):
        """The recipe in one phrase, the one that the start-up line, Fp8Linear's repr and the layer
        table show: its name, then its scaling, scales and formats, e.g. "mxfp8 (current/mx/e4m3)",
        and the operands it casts otherwise ("x_t hp": x^T kept in high precision)."""
        own = "".join(f", {op} {g or 'hp'}{'/' + fmt.name if g and fmt else ''}" for op, g, fmt in self.operands)
        return f"{self.name} ({self.scaling}/{self.grid}/{self.formats}{own})"

    @classmethod
    def from_name(cls, name, **overrides):  # a named preset (RECIPES), single knobs overriding it
        if name not in RECIPES:
            raise ValueError(f"unknown FP8 recipe {name!r}; expected one of {tuple(RECIPES)}")
        return replace(RECIPES[name], **overrides)


RECIPES = {  # the named presets: what each recipe of the field sets
    "tensorwise": Recipe(),  # one scale per tensor, E4M3 forward, E5M2 gradients (torchao, TE)
    "rowwise": Recipe(granularity="row", formats="e4m3"),  # E4M3 gradients too, as torchao's
    "blockwise": Recipe(granularity="block", formats="e4m3"),  # DeepSeek-V3: 1x128 / 128x128 tiles
    "delayed": Recipe(scaling="delayed"),  # amax history (Transformer Engine, MS-AMP)
    # OCP MXFP8 (Blackwell; torchao's MX, TE's MXFP8BlockScaling): E4M3, 1x32 tiles, E8M0 scales
    "mxfp8": Recipe(granularity="block", formats="e4m3", act_tile=(1, 32), weight_tile=(1, 32), scale_rule=mx_scale),
    # torchao's ROWWISE_WITH_GW_HP (torchtitan's other default): row scales in the forward and dgrad
    # GEMMs, one tensor scale for W^T (each tensor is then measured along one dim only), and the weight
    # gradient dW = dy^T x in high precision, from x and dy as they are: backward keeps x, not x^T in FP8
    "rowwise_with_gw_hp": Recipe(granularity="row", formats="e4m3",
                                 operands=(("w_t", "tensor", None), ("x_t", None, None), ("dy_t", None, None))),
}


# -----------------------------------------------------------------------------
# 5. The FP8 linear layer: one autograd.Function for the three GEMMs

# What a delayed-scaling cast records for push_amax, per role (the columns of Fp8Linear.cast_log):
# the largest amax, and the number of casts with a non-finite one, since the last push; the values
# cast and clipped; the scale of the last cast. One float64 row: one write per cast, exact counts.
CAST_LOG = ("amax", "nonfinite", "values", "clipped", "scale")


class Fp8LinearFunction(torch.autograd.Function):
    """y = x W^T (+ b), its three GEMMs in FP8. `mod` is the layer (ctx.mod): its recipe (how it
    casts each operand: Recipe.casts, Recipe.transposes) and scaling state, its FP8 weight
    (weight_operands), where dW goes (take_wgrad: O2 keeps it in FP8). `given`: operands that
    arrive cast already, x before the forward GEMM and dy before the backward ones (a
    tensor-parallel shard gathers them in FP8: nanofp8/parallel.py); x and dy are then stand-ins
    of their shapes, never read."""

    @staticmethod
    def forward(ctx, x, weight, bias, mod, out_dtype, given=None):
        # Autocast off inside, where every dtype is chosen here (out_dtype is autocast's). Not around
        # .apply: dynamo fails a region that changes the global autocast state around a Function.
        with torch.autocast(x.device.type, enabled=False):
            r = mod.recipe
            x2 = x.reshape(-1, x.shape[-1]) if given is None or given.x is None else None
            qx = mod.quantize_operand("x", x2) if x2 is not None else given.x
            if x2 is None:
                given.x = None  # taken: ctx.given must not keep it alive until backward
            qw, qw_t = mod.weight_operands()  # W (N, K) for this GEMM, W^T (K, N) for dgrad

            # ---- forward: y (M, N) = x (M, K) @ [W (N, K)]^T       E4M3 x E4M3, fast accumulation
            b = None if bias is None else mod.gemm_bias(bias, out_dtype)
            y = scaled_gemm(qx, qw, out_dtype, b, r.backend, fast_accum=True, name=mod.fqn)
            y = y.reshape(*x.shape[:-1], y.shape[-1])

            # Keep only the operands of the backward GEMMs (FP8 ones with their inverse scales), along
            # their contraction dims: x^T (K, M) for wgrad, W^T (K, N) for dgrad. Row, 1x128: x^T cast
            # anew (x given cast: from its FP8 values). One the recipe keeps in high precision is kept
            # in the dtype that its GEMM runs in (dy's, the output's), as a copy laid out for that
            # GEMM (compiled, a saved view of the input would alias it: dynamo refuses to save one).
            qx_t = qx.t() if "x_t" in r.transposes else \
                mod.quantize_operand("x_t", (dequantize(qx, torch.float32) if x2 is None else x2).t())
            if mod.observer is not None:  # a statistics step (nanofp8/stats.py)
                mod.observer.observe_forward(mod, x2, qx, qx_t, qw, qw_t)
            keep = [(q.data, q.scale, q.inv_scale) if isinstance(q, Fp8Tensor) else
                    (q.to(out_dtype, copy=True, memory_format=torch.contiguous_format), None, None) for q in (qx_t, qw_t)]
            ctx.save_for_backward(*keep[0], *keep[1])
            ctx.meta = [(q.fmt, q.granularity, q.block, q.data.shape, q.dtype) if isinstance(q, Fp8Tensor) else None
                        for q in (qx_t, qw_t)]
            ctx.mod, ctx.given = mod, given
            ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
            ctx.has_bias, ctx.b_dtype = bias is not None, None if bias is None else bias.dtype
            return y

    @staticmethod
    def backward(ctx, dy):
        mod, r = ctx.mod, ctx.mod.recipe
        tx, sx, ix, tw, sw, iw = ctx.saved_tensors
        qx_t = Fp8Tensor(tx, sx, *ctx.meta[0], _inv=(sx, ix)) if ctx.meta[0] else tx  # (else: high precision)
        qw_t = Fp8Tensor(tw, sw, *ctx.meta[1], _inv=(sw, iw)) if ctx.meta[1] else tw
        dx = dw = db = qdy_t = None
        with torch.autocast(dy.device.type, enabled=False):
            given = ctx.given
            dy2 = dy.reshape(-1, dy.shape[-1]) if given is None or given.dy is None else None
            qdy = mod.quantize_operand("dy", dy2) if dy2 is not None else given.dy

            if ctx.needs_input_grad[0]:
                # ---- dgrad: dx (M, K) = dy (M, N) @ [W^T (K, N)]^T      E5M2 x E4M3 (hybrid)
                dx = scaled_gemm(qdy, qw_t, ctx.x_dtype, backend=r.backend, name=mod.fqn).reshape(ctx.x_shape)

            if ctx.needs_input_grad[1]:
                qdy_t = qdy.t() if "dy_t" in r.transposes else \
                    mod.quantize_operand("dy_t", (dequantize(qdy, torch.float32) if dy2 is None else dy2).t())
                # ---- wgrad: dW (N, K) = dy^T (N, M) @ [x^T (K, M)]^T    E5M2 x E4M3 (hybrid)
                dw = scaled_gemm(qdy_t, qx_t, torch.float32, backend=r.backend, name=mod.fqn)
                dw = mod.take_wgrad(dw)  # O1: the autograd gradient; O2: kept in FP8 instead

            if mod.observer is not None:
                mod.observer.observe_backward(mod, dy2, qdy, qdy_t)
            if ctx.has_bias and ctx.needs_input_grad[2]:  # (dy given cast: the sum of its FP8 values)
                db = (dequantize(qdy, torch.float32) if dy2 is None else dy2.float()).sum(0).to(ctx.b_dtype)
        return dx, dw, db, None, None, None


def _count_clips_from_zero(module, state_dict, prefix, *args):
    """A state_dict saved before Fp8Linear counted clipped values has no `clipped`: start at 0."""
    if prefix + "amax_history" in state_dict and prefix + "clipped" not in state_dict:
        state_dict[prefix + "clipped"] = torch.zeros_like(module.clipped)


def _logged(row, amax, nonfinite, values, clipped, scale):
    """A row of Fp8Linear.cast_log with one more cast: the larger amax (a NaN stays NaN), the
    counts added to, the scale replaced. One elementwise expression over the row, from constant
    masks (no stack of scalars): compiled, one small kernel per cast."""
    one_hot = torch.eye(len(CAST_LOG), dtype=torch.float64, device=row.device)
    counts = row + nonfinite.double() * one_hot[1] + values * one_hot[2] + clipped.double() * one_hot[3]
    return torch.where(one_hot[0] > 0, torch.maximum(row, amax.double()),  # (a NaN only here)
                       torch.where(one_hot[4] > 0, scale.double(), counts))


def _forget_next_scales(module, *args):
    """A loaded history makes its own scales: the next casts take them from it (push_amax)."""
    module.history_warm = (False, False, False)


class Fp8Linear(nn.Linear):
    """nn.Linear whose three GEMMs run in FP8. Same parameters and state_dict keys, plus the
    scaling state of its three tensor roles (input, weight, grad-output) as buffers:

        amax_history (3, H)  newest first, zeros where not yet filled
        history_count (3,)   how many entries are valid (0: the stored scale is used)
        scale        (3,)    the scale last used (what a NaN amax falls back to)
        nonfinite    (3,)    how many non-finite amaxes were seen and kept out of the history
        clipped      (3,)    how many values a delayed-scaling cast clipped at the FP8 max
        cast_values  (3,)    (not saved) how many values delayed scaling cast: clipped's denominator

    Extension points: O2Linear (nanofp8/optim.py) overrides hp_weight, take_wgrad,
    weight_operands and weight_changed; O3Linear (nanofp8/zero.py) cast_weight and hp_weight."""

    observer = None  # statistics of the casts (nanofp8/stats.py): set for the steps it observes
    # Cast the weight once per optimizer step, for all its micro-steps? Eager code casts again when the
    # weight's version or storage change; compiled code reads the cast that o2_compile.cast_for_step
    # kept, which train.py's optimizer makes after each step at O1 (O2/O3 layers cast their own).
    cache_weight = False

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None,
                 recipe=None, fqn=""):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.recipe = recipe or Recipe()
        self.fqn = fqn or "Fp8Linear"
        self._init_scaling_state(self.weight.device)
        self.register_load_state_dict_pre_hook(_count_clips_from_zero)
        self.register_load_state_dict_pre_hook(_forget_next_scales)

    def hp_weight(self):
        """The high-precision weight the FP8 copies are cast from."""
        return self.weight

    def take_wgrad(self, dw):
        """Receives the fp32 weight gradient; returns what autograd accumulates into .grad."""
        return dw.to(self.weight.dtype)

    def weight_operands(self):
        """FP8 W (N, K) and W^T (K, N) for the forward and dgrad GEMMs."""
        if self.cache_weight and torch.compiler.is_compiling() and getattr(self, "_fp8_meta", None):
            from nanofp8.o2_compile import kept_operands  # (the cast of this step: cast_for_step)
            return kept_operands(self)
        use_cache = self.cache_weight and not torch.compiler.is_compiling()
        if use_cache:
            key = (self.weight._version, self.weight.data_ptr())  # (evaluation too: the same weight)
            if self._w_cache is not None and self._w_cache[0] == key:
                return self._w_cache[1]
        ops = self.cast_weight()
        self._w_cache = (key, ops) if use_cache else None
        return ops

    def gemm_bias(self, bias, dtype):
        """The bias in the GEMM's output dtype (compiled: the copy kept with the step's cast)."""
        kept = getattr(self, "gemm_bias_kept", None) if torch.compiler.is_compiling() else None
        return kept if kept is not None and kept.dtype == dtype else bias.to(dtype)

    def cast_weight(self):
        """The FP8 cast of the weight and of its transpose (not cached)."""
        w = self.hp_weight().detach()
        qw = self.quantize_operand("w", w)
        return qw, qw.t() if "w_t" in self.recipe.transposes else self.quantize_operand("w_t", w.t())

    def quantize_operand(self, operand, x2):
        """Cast a GEMM operand (M, K) along K as the recipe casts that operand (OPERANDS, Recipe.casts):
        current scaling measures it, delayed scaling takes the scale from the history of the tensor
        it comes from (its role). An operand the recipe keeps in high precision is x2 itself."""
        r, how = self.recipe, self.recipe.casts[operand]
        if how is None:
            return x2
        fmt, granularity, tile = how
        if r.scaling == "delayed":
            return self.delayed_quantize(OPERANDS[operand], x2, fmt)
        rows_first = OPERANDS[operand] == INPUT  # (compiled: an activation's amax in the kernel that makes it)
        if r.backend == "emulate":
            return quantize(x2, fmt, granularity, tile, margin=r.margin, power_of_two=r.power_of_two,
                            scale_rule=r.scale_rule, rows_first=rows_first)
        from nanofp8.device import cast  # the engine (seam): Triton or CPU casts, the same bytes
        return cast(r, x2, fmt, granularity, tile, rows_first)

    def weight_changed(self):
        """Called by an optimizer that wrote a new weight: forget the cached cast (O2: cast anew)."""
        self._w_cache = None

    def _init_scaling_state(self, device):
        self._w_cache = None
        h = self.recipe.history_len
        self.register_buffer("amax_history", torch.zeros(3, h, device=device))
        self.register_buffer("history_count", torch.zeros(3, dtype=torch.long, device=device))
        self.register_buffer("scale", torch.ones(3, device=device))
        self.register_buffer("nonfinite", torch.zeros(3, dtype=torch.long, device=device))
        self.register_buffer("clipped", torch.zeros(3, dtype=torch.long, device=device))
        self.register_buffer("cast_values", torch.zeros(3, dtype=torch.long, device=device), persistent=False)
        # delayed scaling between a cast and push_amax (not saved: push_amax remakes them)
        self.register_buffer("cast_log", torch.zeros(3, len(CAST_LOG), dtype=torch.float64, device=device),
                             persistent=False)
        # each role's next scale and its inverse, 0-d each: a compiled graph takes them as they are
        # (indexed out of one buffer, a graph copies and inverts them in a kernel per cast)
        for role in (INPUT, WEIGHT, GRAD_OUTPUT):
            self.register_buffer(f"next_scale_{role}", torch.ones((), device=device), persistent=False)
            self.register_buffer(f"next_inv_{role}", torch.ones((), device=device), persistent=False)
        self.history_warm = (False, False, False)  # per role: next_scale_{role} holds its history's scale

    @classmethod
    def from_linear(cls, lin, recipe, fqn=""):
        """Wrap an existing nn.Linear, sharing (not copying) its parameters."""
        new = cls(lin.in_features, lin.out_features, lin.bias is not None, device="meta",
                  recipe=recipe, fqn=fqn)
        new.weight, new.bias = lin.weight, lin.bias
        new._init_scaling_state(lin.weight.device)
        new.train(lin.training)
        return new

    @torch.no_grad()
    def delayed_quantize(self, role, x2, fmt):
        """Delayed scaling: the scale comes from the amax history of earlier casts only, so it is
        known before the cast, and this cast's amax is measured by the same read of the tensor
        that casts it (compiled: with the count of values it clipped). The amax and the counts
        are recorded in one row of cast_log; push_amax puts them into the history and the
        counters, at once in eager code, after the graph in compiled code (train.py calls
        o2_compile.push_amaxes after each backward): a graph that updated the history itself
        would spend several small kernels per cast on it. Before any finite amax is in a role's
        history (its first cast), the scale is made from this tensor's own amax (where that is
        not finite: the stored scale)."""
        r = self.recipe
        rows = measure_amax(x2.detach(), "row", None)  # (compiled: in the kernel that makes x)
        amax = rows.amax()
        scale, inv = getattr(self, f"next_scale_{role}"), getattr(self, f"next_inv_{role}")
        if not torch.compiler.is_compiling():  # eager code pushes right after this cast, in place
            scale, inv = scale.clone(), inv.clone()  # (compiled: after the backward that reads them)
        if not self.history_warm[role]:  # (a Python flag: a compiled graph is remade once it flips)
            inv = None
            past = self.amax_history[role].max() if r.amax_algo == "max" else self.amax_history[role, 0]
            prev = self.scale[role]
            own = r.scale_rule(amax, fmt, r.margin, r.power_of_two, fallback=prev)  # no history yet
            scale = torch.where(self.history_count[role] > 0,
                                r.scale_rule(past, fmt, r.margin, r.power_of_two, fallback=prev), own)
        q = quantize(x2, fmt, "tensor", scale=scale, amax=amax)
        if inv is not None:
            q._inv = (q.scale, inv)  # (else made from the scale, when the GEMM asks)
        if self.training:  # evaluation reads the state but never writes it
            finite = torch.isfinite(amax)
            # values beyond the rounding boundary above the max (a non-finite tensor is counted
            # as such, and its step skipped)
            over = ((x2.detach().float() * scale).abs_() > clip_edge(fmt)).sum(-1, keepdim=True)  # (rows first too)
            # the rows' counts summed beside their amaxes: compiled, one kernel ends both sums (the
            # rows' amaxes read by both; apart, each was a kernel of its own). (A NaN row counts 0.)
            over = torch.where(rows >= 0, over, 0).sum()
            self.cast_log[role] = _logged(self.cast_log[role], amax, ~finite, x2.numel(),
                                          torch.where(finite, over, 0), scale)
            if not torch.compiler.is_compiling():
                self.push_amax()
        return q

    def push_amax(self):
        """Delayed scaling: put the amaxes the casts recorded since the last push (cast_log: per
        role their max) into the history, newest first, the finite ones only, and their counts
        into nonfinite, clipped and cast_values; then make each role's next scale from its
        history (the scale last used where the history gives none). Reads the device once per
        call until every role has a history (history_warm)."""
        self.push_history()
        self.mark_warm()

    def mark_warm(self):
        if not all(self.history_warm):  # (one read of the device, until every role has a history)
            self.history_warm = tuple((self.history_count > 0).tolist())

    @torch.no_grad()
    def push_history(self):
        """push_amax's tensor work (o2_compile.push_amaxes compiles it for all layers at once)."""
        r, log, hist, n = self.recipe, self.cast_log, self.amax_history, self.history_count
        cast, amax = log[:, 2] > 0, log[:, 0].float()
        new = cast & torch.isfinite(amax)
        hist.copy_(torch.where(new[:, None], torch.cat([amax[:, None], hist[:, :-1]], 1), hist))
        n.copy_(torch.where(new, (n + 1).clamp(max=hist.shape[1]), n))
        self.nonfinite += log[:, 1].long()
        self.cast_values += log[:, 2].long()
        self.clipped += log[:, 3].long()
        self.scale.copy_(torch.where(cast, log[:, 4].float(), self.scale))
        log.zero_()
        past = hist.amax(1) if r.amax_algo == "max" else hist[:, 0]
        fwd = r.scale_rule(past[:2], r.fwd_fmt, r.margin, r.power_of_two, fallback=self.scale[:2])  # INPUT, WEIGHT
        bwd = r.scale_rule(past[2:], r.bwd_fmt, r.margin, r.power_of_two, fallback=self.scale[2:])  # GRAD_OUTPUT
        nxt = torch.cat([fwd, bwd])
        roles = (INPUT, WEIGHT, GRAD_OUTPUT)
        torch._foreach_copy_([getattr(self, f"next_{k}_{role}") for k in ("scale", "inv") for role in roles],
                             [*nxt.unbind(), *nxt.reciprocal().unbind()])

    def forward(self, x, bias=True, wgrad_to=None):
        """F.linear(x, weight, bias) with the three GEMMs in FP8 (bias=False: without the bias).
        The output dtype is autocast's where autocast is on, else x's. wgrad_to: the tensor
        autograd gives dW to (the weight; O2's sink: nanofp8/optim.py)."""
        dev = x.device.type
        out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        return Fp8LinearFunction.apply(x, self.weight if wgrad_to is None else wgrad_to,
                                       self.bias if bias else None, self, out_dtype)

    def extra_repr(self):
        return f"{super().extra_repr()}, fp8={self.recipe.describe()}, backend={self.recipe.backend}"


def convert_to_fp8(model, recipe=None, module_filter=None):
    """Swap every nn.Linear in `model` (in place) for an Fp8Linear sharing its parameters.
    module_filter(fqn, linear) -> bool chooses which ones; returns the model."""
    recipe = recipe or Recipe()
    if type(model) is nn.Linear:  # a bare Linear cannot be swapped inside itself
        return Fp8Linear.from_linear(model, recipe, "linear")
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            fqn = f"{parent_name}.{name}" if parent_name else name
            if type(child) is nn.Linear and (module_filter is None or module_filter(fqn, child)):
                setattr(parent, name, Fp8Linear.from_linear(child, recipe, fqn))
    return model
