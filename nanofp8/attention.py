"""
FP8 attention: causal self-attention whose two matrix products run in FP8 (opt-in,
train.py's fp8_attention=True at O1/O2/O3).

This file is meant to be read top to bottom, after nanofp8/fp8.py, whose formats, scales and
GEMM it uses as they are.

1. What runs in FP8
-------------------
Attention of one head, for queries Q, keys K and values V (each T x d, T tokens, d = head dim):

    S = Q K^T / sqrt(d)          scores (T x T)
    P = softmax(S), causal       each query sees itself and the keys before it
    O = P V                      the output (T x d)

Two GEMMs: S = Q K^T and O = P V. They run as FP8 GEMMs with E4M3 operands; their backward
GEMMs take the gradients in E5M2 at formats="hybrid" (E4M3 at "e4m3"), as the Linear layers do.
The softmax stays fp32: its input spans a range (scores of -30 and +30 give probabilities 1e-26
apart) that is exactly what 8 bits cannot hold, and it costs no GEMM. P itself is an FP8 operand
all the same: its values lie in [0, 1], and E4M3 keeps ~2^-4 relative precision over the ~15
binades below its amax and flushes to zero only what lies ~18 binades below (P < 4e-6 where the
largest P is ~1): a thousand such probabilities weigh less than one rounding. What no format
gives: a score's rounding error is relative to |q| |k| / sqrt(d), not to the score, so a key far
larger than the others blurs the scores of the queries nearly orthogonal to it (in bf16 as well,
less: tests/test_attention.py).

A batch of heads is a batch of matrices: Q, K, V are (B, H, T, d) tensors, and fp8.quantize
quantizes such a tensor as B*H matrices along its last dim; fp8.scaled_gemm(a, b) with
a (..., M, K) and b (..., N, K) multiplies each pair (fp8.py, sections 2 and 3).

2. The GEMMs, and the dim each one contracts
--------------------------------------------
Every GEMM is out = A @ B^T with both operands quantized along the contracted dim (fp8.py,
section 3): a row scale must sit on a dim the GEMM keeps. So each operand is quantized in the
orientation its GEMM reads it:

    forward   S  = Q  @ K^T       Q (T, d),    K (T, d)        contraction over d
              O  = P  @ V         P (T, T),    V^T (d, T)      over the keys
    backward  S  = Q  @ K^T       recomputed from the saved FP8 Q and K (the same bytes)
              dV = P^T  @ dO      P^T (T, T),  dO^T (d, T)     over the queries
              dP = dO   @ V^T     dO (T, d),   V (T, d)        over d
              dQ = dS   @ K  / sqrt(d)   dS (T, T),  K^T (d, T)   over the keys
              dK = dS^T @ Q  / sqrt(d)   dS^T (T, T), Q^T (d, T)  over the queries

with the softmax's backward in fp32 between them (P = exp(S - lse) is a softmax, so
dS = P * (dP - D) with D = rowsum(P * dP), one number per query). FlashAttention takes
D = rowsum(dO * O), the same number, which would need O; from P and dP it does not.

The 1/sqrt(d) is applied to the fp32 outputs of the S, dQ and dK GEMMs: one fp32 multiply,
exact where d is a power of 4 (d = 16, 64, 256: 1/sqrt(d) is a power of two), otherwise one
fp32 rounding (2^-24 relative, nothing next to FP8's 2^-4).

3. What is kept for backward: FP8 Q, K, V and one log-sum-exp per row
---------------------------------------------------------------------
Not S, not P (T x T each), not O: the FP8 Q, K and V as the forward quantized them along d
(1 byte per element), their scales, and lse = log(sum_j exp(S_ij)) per query row (fp32): from
them the backward recomputes S (the same FP8 GEMM of the same bytes: the same S) and
P = exp(S - lse) without another reduction. A bf16 attention saves Q, K, V and O at 2 bytes each
(8 bytes per head channel of a token); this one 3 bytes, plus 4 per head of a token for the lse.

The backward needs Q and K also transposed, along the tokens (dK and dQ contract over them).
A tensor scale transposes with its data (Fp8Tensor.t()); a row or 1xN tile scale does not, and
is re-quantized from the saved FP8 values: one more rounding of those operands (the forward
quantized V^T from the high-precision V instead, which it has at hand).

4. Scaling granularity
----------------------
The casts use the model's Recipe (the one its Fp8Linear layers use, given by model.apply_fp8):
its granularity, formats, margin, power-of-two rule and scale rule, and its act_tile for
"block". Granularity "tensor": one scale per tensor (all heads of the batch; under tensor
parallelism, the heads of the rank), "row": one scale per row of each GEMM operand (a query, a
key, a channel of V^T, ...), "block": one scale per act_tile (1 x 128: a row's 128 values along
the contracted dim; any 1 x N tile, 1x32 MX tiles included). Scaling is current: delayed
scaling's amax history (Fp8Linear) has no equivalent here, so a "delayed" recipe's attention
measures each tensor as it casts it. A recipe's casts of one Linear operand (Recipe.operands:
rowwise_with_gw_hp's high-precision weight gradient) have no equivalent either: attention has no
weight, and casts every operand by the recipe's granularity and formats. nanofp8/stats.py does
not observe these casts.

What it costs: this is the lesson, not a fused kernel. S and P are materialized (B*H*T*T fp32,
for the duration of one call), and fp8.scaled_gemm runs one GEMM per head (B*H per product).
On a CPU the FP8 GEMMs are emulated; on a GPU it is slower than a fused bf16 attention.
"""

import math

import torch

from nanofp8.fp8 import Fp8Tensor, dequantize, quantize, scaled_gemm

NAME = "attention"  # how GEMM fallbacks name this layer (device.py reports them once per name)


def cast(recipe, x, fmt):
    """FP8 copy of x (..., rows, k) along k, by `recipe` (current scaling), each matrix of a
    batch on its own. Backend "emulate": fp8.quantize; the others: device.cast of the same
    values as one (rows of all matrices, k) matrix, which gives the same bytes where a scale
    never spans two rows (tensor, row, 1 x N tiles), faster (tests/test_attention.py holds
    the two equal)."""
    r = recipe
    tile = r.act_tile
    if r.backend == "emulate" or (r.granularity == "block" and tile[0] > 1):
        return quantize(x, fmt, r.granularity, tile, margin=r.margin, power_of_two=r.power_of_two,
                        scale_rule=r.scale_rule)
    from nanofp8.device import cast as device_cast  # the engine (seam), as Fp8Linear uses it

    q = device_cast(r, x.reshape(-1, x.shape[-1]), fmt, r.granularity, tile)
    scale = q.scale if r.granularity == "tensor" else q.scale.reshape(*x.shape[:-1], q.scale.shape[-1])
    return Fp8Tensor(q.data.view(x.shape), scale, fmt, q.granularity, q.block, x.shape, x.dtype, q.amax)


def transposed(recipe, q, fmt, x=None):
    """The operand (..., k, rows) along rows, from q (..., rows, k) quantized along k: q.t() (the
    same bytes) where a tensor scale transposes with them; else x^T cast anew from the
    high-precision x where it is at hand, or from q's own values where it is not."""
    if q.granularity == "tensor" or q.block[0] > 1:  # scales that transpose with the data (fp8.py's rule)
        return q.t()
    return cast(recipe, (dequantize(q, torch.float32) if x is None else x).mT, fmt)


def mask_future(s):
    """s (..., T, T) with the future masked (in place, -inf): each query sees itself and the keys
    before it. Every row keeps at least its diagonal, so every log-sum-exp of it is finite."""
    T = s.shape[-1]
    return s.masked_fill_(torch.ones(T, T, dtype=torch.bool, device=s.device).triu(1), float("-inf"))


class Fp8AttentionFunction(torch.autograd.Function):
    """Causal attention O = softmax(Q K^T / sqrt(d)) V of q, k, v (B, H, T, d), its two GEMMs
    and their four backward GEMMs in FP8, by `recipe` (fp8.Recipe). Returns O in q's dtype."""

    @staticmethod
    def forward(ctx, q, k, v, recipe):
        # Autocast off inside (not around .apply: dynamo refuses a region that toggles it there)
        with torch.autocast(q.device.type, enabled=False):
            r, fwd = recipe, recipe.fwd_fmt
            c = 1.0 / math.sqrt(q.shape[-1])
            qq, qk, qv = cast(r, q, fwd), cast(r, k, fwd), cast(r, v, fwd)  # along d

            # ---- S (T, T) = Q (T, d) @ [K (T, d)]^T        E4M3 x E4M3, contraction over d
            s = scaled_gemm(qq, qk, torch.float32, backend=r.backend, fast_accum=True, name=NAME) * c
            lse = torch.logsumexp(mask_future(s), dim=-1, keepdim=True)  # (T, 1), fp32
            p = torch.exp(s - lse)  # fp32; 0 where masked

            qv_t = transposed(r, qv, fwd, v)  # V^T (d, T) along the keys
            qp = cast(r, p, fwd)  # along the keys
            # ---- O (T, d) = P (T, T) @ [V^T (d, T)]^T      E4M3 x E4M3, contraction over the keys
            o = scaled_gemm(qp, qv_t, q.dtype, backend=r.backend, fast_accum=True, name=NAME)

            ctx.save_for_backward(qq.data, qq.scale, qk.data, qk.scale, qv.data, qv.scale, lse.squeeze(-1))
            ctx.meta = [(x.fmt, x.granularity, x.block, x.shape, x.dtype) for x in (qq, qk, qv)]
            ctx.recipe = r
            return o

    @staticmethod
    def backward(ctx, do):
        r = ctx.recipe
        q8, sq, k8, sk, v8, sv, lse = ctx.saved_tensors
        qq, qk, qv = (Fp8Tensor(d, s, *m) for (d, s), m in zip(((q8, sq), (k8, sk), (v8, sv)), ctx.meta))
        fwd, bwd = r.fwd_fmt, r.bwd_fmt
        with torch.autocast(do.device.type, enabled=False):
            c = 1.0 / math.sqrt(qq.shape[-1])
            # ---- S again = Q @ K^T: the forward's FP8 GEMM of the same bytes, so the same S,
            # and P = exp(S - lse) with the forward's lse
            s = scaled_gemm(qq, qk, torch.float32, backend=r.backend, fast_accum=True, name=NAME) * c
            p = torch.exp(mask_future(s) - lse.unsqueeze(-1))  # (no second log-sum-exp)

            qdo = cast(r, do, bwd)  # dO (T, d) along d
            qdo_t = transposed(r, qdo, bwd, do)  # dO^T (d, T) along the queries
            # ---- dV (T, d) = P^T (T, T) @ [dO^T (d, T)]^T     E4M3 x E5M2, contraction over the queries
            dv = scaled_gemm(cast(r, p.mT, fwd), qdo_t, torch.float32, backend=r.backend, name=NAME)
            # ---- dP (T, T) = dO (T, d) @ [V (T, d)]^T          E5M2 x E4M3, contraction over d
            dp = scaled_gemm(qdo, qv, torch.float32, backend=r.backend, name=NAME)

            # the softmax's backward, fp32 (masked entries: P = 0, so dS = 0)
            d_row = (p * dp).sum(-1, keepdim=True)
            ds = p * (dp - d_row)

            qds = cast(r, ds, bwd)  # along the keys
            qds_t = transposed(r, qds, bwd, ds)  # dS^T along the queries
            # ---- dQ (T, d) = dS (T, T) @ [K^T (d, T)]^T / sqrt(d)     E5M2 x E4M3, over the keys
            dq = scaled_gemm(qds, transposed(r, qk, fwd), torch.float32, backend=r.backend, name=NAME) * c
            # ---- dK (T, d) = dS^T (T, T) @ [Q^T (d, T)]^T / sqrt(d)   E5M2 x E4M3, over the queries
            dk = scaled_gemm(qds_t, transposed(r, qq, fwd), torch.float32, backend=r.backend, name=NAME) * c
        dtype = qq.dtype
        return dq.to(dtype), dk.to(dtype), dv.to(dtype), None


def fp8_attention(q, k, v, recipe):
    """Causal attention of q (B, H, T, d) and k, v (B, H_kv, T, d) in FP8 by `recipe` (an
    fp8.Recipe): the output (B, H, T, d) in q's dtype. Drop-in for
    F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True) without dropout.

    Grouped-query attention (H_kv < H, dividing it): query head h reads key/value head
    h // (H / H_kv). Each key/value head is repeated for the query heads of its group before the
    casts: every per-head GEMM above then has its own operands, and autograd sums the group's dK
    and dV back into the one head (in the gradients' dtype, after the FP8 GEMMs)."""
    if k.shape[1] != q.shape[1]:
        if q.shape[1] % k.shape[1] or k.shape != v.shape:
            raise ValueError(f"fp8_attention: {q.shape[1]} query heads cannot share {k.shape[1]} key and "
                             f"{v.shape[1]} value heads (grouped-query attention needs H_kv to divide H)")
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return Fp8AttentionFunction.apply(q, k, v, recipe)
