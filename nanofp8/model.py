"""
The model: one decoder-only transformer, in two dialects chosen by GPTConfig.arch.

    arch="gpt2"   LayerNorm, learned position embeddings, GELU MLP, biases (GPT-2, 2019)
    arch="llama"  RMSNorm, rotary position embeddings (RoPE), SwiGLU MLP, no biases (LLaMA, 2023)

Both are the same pre-norm residual stack,

    x = embed(tokens)
    for each block:  x = x + attn(norm(x));  x = x + mlp(norm(x))
    logits = lm_head(norm(x))

and both keep the residual stream x in fp32 (the embeddings are fp32 parameters and every
block output is added to it), while the matmuls run in bf16 under autocast, or in FP8 once
apply_fp8() has swapped the block Linears for nanofp8.fp8.Fp8Linear.

Which Linears go FP8 (apply_fp8): only the four inside each block (fused q/k/v, attention
output, MLP in, MLP out; in LLaMA the MLP-in GEMM computes gate and up together). At scale they
hold nearly all of the FLOPs. The embedding is a lookup, not a GEMM; the norms are elementwise;
and the LM head turns the last hidden state into a softmax over the vocabulary, where rounding
errors land directly on the loss, so FP8 recipes (Transformer Engine, DeepSeek-V3, torchao's
defaults) leave it in high precision. fp8_lm_head=True is there to measure that choice rather
than take it on faith.

The checkpoint file it is saved in is nanofp8/ckptfile.py.
"""

import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange
from torch.utils.checkpoint import checkpoint
from nanofp8.attention import fp8_attention

# -----------------------------------------------------------------------------
# Configuration


@dataclass
class GPTConfig:
    arch: str = "gpt2"  # "gpt2" | "llama"
    block_size: int = 1024  # longest sequence the model sees (context length)
    vocab_size: int = 50304  # GPT-2's 50257 BPE tokens, padded to a multiple of 64 for fast GEMMs
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    # key/value heads: 0 = n_head (multi-head attention); fewer = grouped-query attention, where
    # n_head / n_kv_head query heads share each key/value head (Llama 2 70B, Llama 3)
    n_kv_head: int = 0
    dropout: float = 0.0
    bias: bool = True  # biases in Linears and LayerNorms (gpt2 only; llama never has them)
    tie_embeddings: bool = True  # lm_head shares the token embedding matrix
    mlp_hidden: int = 0  # 0 = the dialect's default: 4*n_embd (gpt2), ~8/3*n_embd (llama)
    rope_theta: float = 10000.0  # llama: base of the rotary frequencies
    # llama: None, or Llama 3.1's long-context rescaling of the rotary frequencies, the Hugging Face
    # dict as config.json has it: {"rope_type": "llama3", "factor", "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"} (see rope_inv_freq)
    rope_scaling: dict | None = None
    norm_eps: float = 1e-5

    def __post_init__(self):
        """Reject a configuration that would build a broken model, naming the field. (n_layer=0
        would build a model with no blocks that still trains: a bigram table, silently.)"""
        if self.arch not in ("gpt2", "llama"):
            raise ValueError(f"GPTConfig.arch must be 'gpt2' or 'llama', got {self.arch!r}")
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.mlp_hidden < 0:
            raise ValueError(f"mlp_hidden must be >= 0 (0 = the default width), got {self.mlp_hidden}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.n_kv_head < 0 or self.n_kv_head and self.n_head % self.n_kv_head:
            raise ValueError(f"n_kv_head={self.n_kv_head} must divide n_head={self.n_head} (0: n_head key/value "
                             f"heads, multi-head attention)")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.arch == "llama" and (self.n_embd // self.n_head) % 2:
            raise ValueError("RoPE rotates pairs of channels: the head dim must be even")
        if self.rope_scaling is not None:
            check_rope_scaling(self.rope_scaling, self.arch)

    @property
    def kv_heads(self):
        """The number of key/value heads: n_kv_head, or n_head where it is 0."""
        return self.n_kv_head or self.n_head

    @property
    def qkv_rows(self):
        """Rows of the fused q/k/v weight [q | k | v]: n_head, n_kv_head and n_kv_head heads."""
        head_dim = self.n_embd // self.n_head
        return self.n_head * head_dim, self.kv_heads * head_dim, self.kv_heads * head_dim

    @property
    def hidden(self):
        if self.mlp_hidden:
            return self.mlp_hidden
        if self.arch == "gpt2":
            return 4 * self.n_embd
        # SwiGLU has three matrices instead of two; 2/3 of 4*d keeps the parameter count of the
        # GELU MLP. Rounded up to a multiple of 256 so the GEMMs tile well (and FP8 needs %16).
        return 256 * math.ceil(8 * self.n_embd / 3 / 256)

    @property
    def has_bias(self):
        return self.bias and self.arch == "gpt2"


# -----------------------------------------------------------------------------
# Building blocks


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (nn.LayerNorm cannot drop only the bias)."""

    def __init__(self, dim, bias, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None
        self.eps = eps

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    """Scale by 1/rms(x), no centering and no bias: cheaper than LayerNorm and just as good."""

    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # Computed in fp32 whatever autocast says: the mean of squares is a long reduction.
        return F.rms_norm(x.float(), self.weight.shape, self.weight.float(), self.eps).type_as(x)


def make_norm(config):
    if config.arch == "gpt2":
        return LayerNorm(config.n_embd, config.has_bias, config.norm_eps)
    return RMSNorm(config.n_embd, config.norm_eps)


ROPE_SCALING_KEYS = ("rope_type", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
ROPE_TYPES = ("llama3",)  # the rope_type values rope_scaling may name


def check_rope_scaling(scaling, arch):
    """ValueError unless `scaling` is a rope_scaling dict rope_inv_freq computes (GPTConfig)."""
    if arch != "llama":
        raise ValueError(f"rope_scaling rescales RoPE, which arch={arch!r} does not have: leave it None")
    kind = scaling.get("rope_type") if isinstance(scaling, dict) else None
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_scaling: rope_type {kind!r} is not supported; the supported types are {ROPE_TYPES}")
    if sorted(scaling) != sorted(ROPE_SCALING_KEYS):
        raise ValueError(f"rope_scaling of rope_type 'llama3' has the keys {list(ROPE_SCALING_KEYS)}, got "
                         f"{list(scaling)}")
    if not (scaling["factor"] >= 1 and 0 < scaling["low_freq_factor"] < scaling["high_freq_factor"]
            and scaling["original_max_position_embeddings"] >= 1):
        raise ValueError(f"rope_scaling needs factor >= 1, 0 < low_freq_factor < high_freq_factor and "
                         f"original_max_position_embeddings >= 1, got {scaling}")


def rope_inv_freq(head_dim, theta, scaling=None):
    """The rotation speed of each channel pair, in radians per position, (head_dim/2,), fp64.

    Pair i turns by theta^(-2i/head_dim) per position: fast for the first pairs, slow for the last.
    With rope_scaling (Llama 3.1, rope_type "llama3") a pair's wavelength 2*pi/speed, in positions,
    decides. A pair whose wavelength is below original_max_position_embeddings / high_freq_factor
    keeps its speed: it measures short distances, which a longer context does not change. A pair
    whose wavelength is above original_max_position_embeddings / low_freq_factor turns `factor`
    times slower, so that over a context `factor` times longer its angles stay in the range it was
    trained on. Between the two, the speed is a linear blend of both, weighted by how far
    original_max_position_embeddings / wavelength lies from low_freq_factor towards
    high_freq_factor. (Hugging Face transformers computes the same, in fp32:
    tests/test_model.py holds the two within an fp32 ulp.)"""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling is None:
        return inv_freq
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelength = 2 * math.pi / inv_freq
    # 0 for the slow pairs (slowed down by factor), 1 for the fast ones (kept), a blend between
    keep = ((scaling["original_max_position_embeddings"] / wavelength - low) / (high - low)).clamp(0, 1)
    return (1 - keep) * inv_freq / scaling["factor"] + keep * inv_freq


def rope_tables(head_dim, length, theta, scaling=None):
    """cos and sin of the rotation angles, (length, head_dim/2), fp32.

    Channel pair i of the vector at position p is rotated by angle p * rope_inv_freq(...)[i]. The
    dot product of a rotated query and a rotated key then depends only on their distance, which is
    how RoPE encodes relative position without any learned parameter."""
    angles = torch.outer(torch.arange(length, dtype=torch.float64), rope_inv_freq(head_dim, theta, scaling))
    return angles.cos().float(), angles.sin().float()


def apply_rope(x, cos, sin):
    """Rotate x (B, H, T, head_dim). The pairs are (channel i, channel i + head_dim/2), the
    "rotate half" layout: two contiguous halves instead of interleaved even/odd channels."""
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.type_as(x)


# A CPU runs attention in fp32 (below); nanofp8/schedule.py turns that off to count the graph a GPU
# compiles.
FP32_ATTENTION_ON_CPU = True


class CausalSelfAttention(nn.Module):
    """Causal self-attention, multi-head or grouped-query. The number of heads is read from the
    tensors, not the config: under tensor parallelism (nanofp8/parallel.py) c_attn is one rank's
    shard and writes only that rank's heads, and this same module runs on them.

    Grouped-query attention (n_kv_head < n_head) keeps fewer key/value heads than query heads:
    query head h reads key/value head h // group, group = n_head / n_kv_head. The q/k/v GEMM
    narrows from 3 to 1 + 2 / group times n_embd outputs; the KV cache a server keeps per token
    shrinks by the factor group."""

    def __init__(self, config):
        super().__init__()
        d, b = config.n_embd, config.has_bias
        self.head_dim = d // config.n_head
        self.group = config.n_head // config.kv_heads  # query heads per key/value head
        # q, k, v in one GEMM (bigger is faster): n_head, n_kv_head and n_kv_head heads of outputs
        self.c_attn = nn.Linear(d, sum(config.qkv_rows), bias=b)
        self.c_proj = nn.Linear(d, d, bias=b)  # back into the residual stream
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)
        self.fp8_recipe = None  # set by apply_fp8(..., attention=True): Q K^T and P V in FP8

    def forward(self, x, rope=None):
        # (B, T, (q heads + 2 kv heads) * head_dim): the columns are [q | k | v], each head after
        # head; a shard holds group query heads per key/value head as the whole layer does
        qkv = self.c_attn(x)
        kv_width = qkv.shape[-1] // (self.group + 2)
        q, k, v = (rearrange(t, "b t (h d) -> b h t d", d=self.head_dim)
                   for t in qkv.split([self.group * kv_width, kv_width, kv_width], dim=-1))
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if self.fp8_recipe is not None:  # opt-in: nanofp8/attention.py (no dropout: refused there)
            y = fp8_attention(q, k, v, self.fp8_recipe)
            return self.resid_dropout(self.c_proj(rearrange(y, "b h t d -> b t (h d)")))
        # The fused kernel (flash / memory-efficient attention) never materializes the T x T
        # matrix. By default attention stays in bf16: it is a small share of the FLOPs at these
        # sizes and its softmax inputs are exactly the kind of values FP8 would hurt.
        dtype, on_cpu = q.dtype, q.device.type == "cpu" and FP32_ATTENTION_ON_CPU
        if on_cpu:
            # PyTorch's CPU flash-attention kernel is ~5x slower in bf16 than in fp32 (its
            # backward especially), so on a CPU attention runs in fp32, autocast or not.
            q, k, v = q.float(), k.float(), v.float()
        # enable_gqa: query head h reads key/value head h // group
        gqa = {"enable_gqa": True} if self.group > 1 else {}
        with torch.autocast("cpu", enabled=False) if on_cpu else nullcontext():
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               dropout_p=self.dropout if self.training else 0.0, **gqa)
        y = rearrange(y.to(dtype), "b h t d -> b t (h d)")
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        d, h, b = config.n_embd, config.hidden, config.has_bias
        self.swiglu = config.arch == "llama"
        # SwiGLU needs two input projections (gate and up); like q/k/v they share one GEMM.
        self.c_fc = nn.Linear(d, 2 * h if self.swiglu else h, bias=b)
        self.c_proj = nn.Linear(h, d, bias=b)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        h = self.c_fc(x)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")  # GPT-2's GELU
        return self.dropout(self.c_proj(h))


class Block(nn.Module):
    recompute = False  # activation checkpointing: set by checkpoint_blocks, read by GPT.run_blocks

    def __init__(self, config):
        super().__init__()
        self.norm_1 = make_norm(config)
        self.attn = CausalSelfAttention(config)
        self.norm_2 = make_norm(config)
        self.mlp = MLP(config)

    def forward(self, x, rope=None):
        x = x + self.attn(self.norm_1(x), rope)
        return x + self.mlp(self.norm_2(x))


# -----------------------------------------------------------------------------
# The model


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd) if config.arch == "gpt2" else None
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm_f = make_norm(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            # One matrix both reads tokens in and scores them out. Saves V*d parameters (a third
            # of GPT-2 small) and, at small scale, trains a little better.
            self.lm_head.weight = self.tok_emb.weight
        if config.arch == "llama":
            # Not persistent: recomputed from the config, so never stored in checkpoints.
            cos, sin = rope_tables(config.n_embd // config.n_head, config.block_size, config.rope_theta,
                                   config.rope_scaling)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init_weights)
        # GPT-2's scaled init: every block adds two outputs (attention, MLP) to the residual
        # stream, so after L blocks its variance has grown by ~2L times the per-add variance.
        # Shrinking the std of the projections that write into the stream by 1/sqrt(2L) keeps
        # the stream's scale independent of depth at initialization.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self, non_embedding=True):
        """Parameter count. non_embedding leaves out the position table (a lookup, no FLOPs) and,
        when untied, the token table; the tied token table does count: it is also the LM head."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            if self.pos_emb is not None:
                n -= self.pos_emb.weight.numel()
            if not self.config.tie_embeddings:
                n -= self.tok_emb.weight.numel()
        return n

    # forward in three parts: a pipeline stage (nanofp8/parallel.py) runs the parts it holds

    def embed(self, idx):
        """Token ids (B, T) -> the residual stream (B, T, n_embd), fp32."""
        T = idx.shape[1]
        if T > self.config.block_size:
            raise ValueError(f"sequence of length {T} exceeds block_size {self.config.block_size}")
        x = self.tok_emb(idx)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(T, device=idx.device))
        return self.drop(x)

    def run_blocks(self, x, blocks, T):
        """The residual stream through `blocks`, for sequences of length T (x may hold a slice
        of them: sequence parallelism)."""
        rope = (self.rope_cos[:T], self.rope_sin[:T]) if self.config.arch == "llama" else None
        for block in blocks:
            if block.recompute and torch.is_grad_enabled():  # (no backward, nothing saved: plain forward)
                # non-reentrant: autograd recomputes inside its own backward, through the block's
                # hooks (FSDP2's gather), with the RNG state of the forward
                x = checkpoint(block, x, rope, use_reentrant=False)
            else:
                x = block(x, rope)
        return x

    def head(self, x, targets=None):
        """Final norm and LM head: (logits, loss), or without targets the last position's logits
        (generation needs no others) and None."""
        x = self.norm_f(x)
        if targets is None:
            return self.lm_head(x[:, -1:, :]), None
        logits = self.lm_head(x)
        # fp32 for the softmax: log-probabilities of rare tokens are large negative numbers whose
        # differences bf16 (8 bits of mantissa) would blur.
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def forward(self, idx, targets=None):
        return self.head(self.run_blocks(self.embed(idx), self.blocks, idx.shape[1]), targets)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None):
        """Extend idx (B, T) by max_new_tokens sampled tokens. temperature=0 means greedy;
        top_k keeps only the k most likely tokens before sampling. No KV cache: each new token
        reruns the (cropped) context, which is simple and fast enough for a baby model."""
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.block_size:]
            logits, _ = self(context)
            logits = logits[:, -1, :].float()
            if temperature == 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx

    # ---- throughput accounting

    def flops_per_token(self):
        """Training FLOPs per token (forward + backward).

        A matmul with a (K, N) weight costs 2KN FLOPs per token in the forward pass (a multiply
        and an add per weight) and twice that in the backward pass (dgrad and wgrad): 6 per
        weight. Attention adds its two T-long matmuls, QK^T and AV, per layer: 2 * 2 * T * d
        forward, times 3 with the backward pass. (Causal masking would halve that in principle;
        like everyone else we count the full square, which is what the kernels mostly compute.)"""
        # Every Linear, LM head included (a tied table is counted once: as the head, the only
        # place it is a GEMM). Embedding lookups and norms are not matmuls and cost ~nothing.
        n_matmul = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        c = self.config
        return 6 * n_matmul + 12 * c.n_layer * c.n_embd * c.block_size

    def estimate_mfu(self, tokens_per_second, peak_flops):
        """Model FLOPs utilization: achieved model FLOP/s over the hardware's peak (of the
        precision in use: an FP8 run is held to the FP8 peak, twice the bf16 one on H100)."""
        return self.flops_per_token() * tokens_per_second / peak_flops


def checkpoint_blocks(model):
    """Activation checkpointing per block (train.py's activation_checkpointing="block"), in place.

    Backward needs what each block's forward computed: the norms' outputs, q, k, v, the attention
    output, the MLP's hidden units, and at the FP8 levels the FP8 copies of the GEMM inputs. A
    recomputed block keeps none of them, only its input; its backward first runs its forward
    again (torch.utils.checkpoint, non-reentrant) to rebuild them. Memory for activations falls
    to about one (B, T, n_embd) tensor per block; compute rises by one more forward of the blocks.

    The recomputation must compute what the forward did. The parameters are the same (FSDP2
    gathers them again for it), dropout draws the same masks (checkpoint restores the RNG
    state), and a current-scaling FP8 cast is a function of its input. Delayed scaling is not:
    its forward records the amax in the layer's history and moves the next scale, so a second
    forward would record every amax twice and cast with another scale (the config check refuses
    the two together, as it refuses the FP8 statistics, which would count every cast twice)."""
    for block in model.blocks:
        block.recompute = True


# -----------------------------------------------------------------------------
# FP8


def fp8_module_filter(fp8_lm_head=False):
    """The filter for convert_to_fp8: the Linears inside the blocks (and optionally the LM head).

    Also skipped: Linears whose dims are not multiples of 16, which FP8 tensor cores cannot take
    (a char-level vocabulary of 84 as LM head, for instance). They would fall back to a slow
    emulated GEMM, so they are better left in bf16."""

    def keep(fqn, linear):
        if not (fqn.startswith("blocks.") or (fp8_lm_head and fqn == "lm_head")):
            return False
        return linear.in_features % 16 == 0 and linear.out_features % 16 == 0

    return keep


def apply_fp8(model, recipe, fp8_lm_head=False, attention=False):
    """Run the chosen Linears of `model` in FP8 (in place), and with attention=True each block's
    Q K^T and P V too, by the same recipe (nanofp8/attention.py). Returns the Linears' names."""
    from nanofp8.fp8 import Fp8Linear, convert_to_fp8

    if attention and model.config.dropout > 0:
        raise ValueError("FP8 attention has no attention dropout: build the model with dropout=0")
    convert_to_fp8(model, recipe, module_filter=fp8_module_filter(fp8_lm_head))
    for block in model.blocks if attention else ():
        block.attn.fp8_recipe = recipe
    return [name for name, m in model.named_modules() if isinstance(m, Fp8Linear)]
