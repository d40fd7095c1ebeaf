"""Tests of nanofp8/model.py: both architectures, their initialization, RoPE, generation, which
Linears go FP8, FLOP accounting, and loading state across precisions."""

import math

import pytest
import torch
import torch.nn as nn

from nanofp8.fp8 import Recipe, sqnr
from nanofp8.model import GPT, GPTConfig, LayerNorm, RMSNorm, apply_fp8, apply_rope, rope_inv_freq, rope_tables
from nanofp8.ckptfile import CheckpointError, load_model_state


def tiny(**kw):
    args = dict(n_layer=3, n_head=4, n_embd=64, block_size=32, vocab_size=96)
    args.update(kw)
    return GPTConfig(**args)


def test_gpt2_architecture_and_init():
    torch.manual_seed(0)
    cfg = tiny(n_layer=8, n_embd=256, vocab_size=512)
    m = GPT(cfg)
    assert m.lm_head.weight is m.tok_emb.weight  # tied
    assert isinstance(m.norm_f, LayerNorm) and m.pos_emb is not None
    # GPT-2 init: N(0, 0.02), residual projections N(0, 0.02/sqrt(2L)), biases zero
    assert m.blocks[0].mlp.c_fc.weight.std().item() == pytest.approx(0.02, rel=0.05)
    want = 0.02 / math.sqrt(2 * cfg.n_layer)
    for block in m.blocks:
        for proj in (block.attn.c_proj, block.mlp.c_proj):
            assert proj.weight.std().item() == pytest.approx(want, rel=0.05)
            assert torch.all(proj.bias == 0)
    x, y = torch.randint(0, 512, (2, 32)), torch.randint(0, 512, (2, 32))
    logits, loss = m(x, y)
    assert logits.shape == (2, 32, 512)
    assert loss.item() == pytest.approx(math.log(512), rel=0.05)  # ~uniform at init


def test_llama_architecture():
    cfg = tiny(arch="llama", tie_embeddings=False)
    m = GPT(cfg)
    assert m.pos_emb is None and isinstance(m.norm_f, RMSNorm)
    assert all(mod.bias is None for mod in m.modules() if isinstance(mod, nn.Linear))
    assert cfg.hidden % 256 == 0 and m.blocks[0].mlp.c_fc.out_features == 2 * cfg.hidden
    assert m.lm_head.weight is not m.tok_emb.weight
    assert "rope_cos" not in m.state_dict()  # recomputed, never stored
    _, loss = m(torch.randint(0, 96, (2, 32)), torch.randint(0, 96, (2, 32)))
    loss.backward()
    with pytest.raises(ValueError, match="arch"):
        GPTConfig(arch="mamba")


def reference_attention(attn, x, n_head, n_kv_head, inv_freq=None):
    """Causal grouped-query attention written out in float64 from the module's weights: query head
    h reads key/value head h // (n_head / n_kv_head); RoPE from the fp64 frequencies."""
    B, T, C = x.shape
    d = C // n_head
    w, x = attn.c_attn.weight.double(), x.double()
    q, k, v = (x @ part.T for part in w.split([n_head * d, n_kv_head * d, n_kv_head * d]))
    q, k, v = q.view(B, T, n_head, d), k.view(B, T, n_kv_head, d), v.view(B, T, n_kv_head, d)
    if inv_freq is not None:
        angle = torch.outer(torch.arange(T, dtype=torch.float64), inv_freq)[:, None]  # (T, 1, d/2)

        def rotate(t):
            a, b = t[..., : d // 2], t[..., d // 2:]
            return torch.cat([a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()], dim=-1)

        q, k = rotate(q), rotate(k)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    heads = []
    for h in range(n_head):
        j = h // (n_head // n_kv_head)
        s = (q[:, :, h] @ k[:, :, j].mT / math.sqrt(d)).masked_fill(future, float("-inf"))
        heads.append(s.softmax(-1) @ v[:, :, j])
    return torch.cat(heads, dim=-1) @ attn.c_proj.weight.double().T


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("n_kv_head", [1, 2, 4])
def test_grouped_query_attention_against_float64(arch, n_kv_head):
    """n_kv_head key/value heads for 4 query heads: c_attn writes 4 + 2 * n_kv_head heads, and the
    attention equals the float64 one written out (fp32 rounding: > 100 dB; a query head that reads
    the wrong key/value head is off by a few dB). The FP8 attention (nanofp8/attention.py) runs the
    same grouping."""
    torch.manual_seed(0)
    cfg = tiny(arch=arch, n_kv_head=n_kv_head, bias=False)
    m = GPT(cfg)
    attn, T, d = m.blocks[0].attn, 32, cfg.n_embd // cfg.n_head
    assert attn.c_attn.weight.shape == ((4 + 2 * n_kv_head) * d, cfg.n_embd)
    rope = (m.rope_cos[:T], m.rope_sin[:T]) if arch == "llama" else None
    x = torch.randn(2, T, cfg.n_embd)
    want = reference_attention(attn, x, 4, n_kv_head, rope_inv_freq(d, cfg.rope_theta) if rope else None)
    assert sqnr(want, attn(x, rope)) > 100
    attn.fp8_recipe = Recipe(backend="cpu")
    assert 20 < sqnr(want, attn(x, rope)) < 60  # FP8 rounding, of the same function


def test_n_kv_head_equal_to_n_head_is_multi_head_attention():
    """n_kv_head = n_head is the multi-head model of n_kv_head = 0: the same parameters from the
    same seed, the same logits, bit for bit. n_kv_head must divide n_head: one line naming both."""
    x = torch.randint(0, 96, (2, 32))
    for arch in ("gpt2", "llama"):
        torch.manual_seed(0)
        mha = GPT(tiny(arch=arch))
        torch.manual_seed(0)
        same = GPT(tiny(arch=arch, n_kv_head=4))
        assert {k: v.shape for k, v in mha.state_dict().items()} == {k: v.shape for k, v in same.state_dict().items()}
        assert all(torch.equal(v, same.state_dict()[k]) for k, v in mha.state_dict().items())
        assert torch.equal(mha(x, x)[0], same(x, x)[0])
    for bad in (3, -1):
        with pytest.raises(ValueError, match=f"n_kv_head={bad} must divide n_head=4"):
            tiny(n_kv_head=bad)


def test_rope_depends_only_on_distance():
    cos, sin = rope_tables(16, 64, 10000.0)
    q, k = torch.randn(16), torch.randn(16)

    def rot(v, pos):
        return apply_rope(v.view(1, 1, 1, 16).expand(1, 1, 64, 16).contiguous(), cos, sin)[0, 0, pos]

    d1 = rot(q, 10) @ rot(k, 7)
    d2 = rot(q, 40) @ rot(k, 37)
    assert d1.item() == pytest.approx(d2.item(), rel=1e-4, abs=1e-5)
    assert rot(q, 0).allclose(q)  # position 0 is not rotated


LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}  # Llama 3.1's config.json


def _ulps(a, b):
    """How many fp32 steps apart a and b (positive fp32 tensors) are, elementwise."""
    return (a.view(torch.int32).long() - b.view(torch.int32).long()).abs()


@pytest.mark.parametrize("head_dim, theta, scaling", [
    (128, 500000.0, LLAMA31),
    (128, 500000.0, {**LLAMA31, "factor": 32.0}),  # Llama 3.2's
    (16, 10000.0, {**LLAMA31, "factor": 4.0, "high_freq_factor": 8.0, "original_max_position_embeddings": 64}),
])
def test_llama3_rope_scaling_equals_transformers(head_dim, theta, scaling):
    """rope_scaling of rope_type "llama3": the inverse frequencies of transformers'
    ROPE_INIT_FUNCTIONS["llama3"]. Each case has pairs of all three kinds: kept, slowed down by
    `factor`, and blended. The kept and slowed ones are within an fp32 ulp (transformers computes
    the unscaled frequencies in fp32, this file in fp64); the blended ones within 8 ulps, transformers'
    fp32 blend rounding a few times (relative 5e-7)."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = transformers.LlamaConfig(hidden_size=2 * head_dim, num_attention_heads=2, num_key_value_heads=2,
                                  intermediate_size=64, num_hidden_layers=1, vocab_size=32,
                                  max_position_embeddings=scaling["original_max_position_embeddings"] * 2,
                                  rope_parameters={**scaling, "rope_theta": theta})
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    ours, plain = rope_inv_freq(head_dim, theta, scaling).float(), rope_inv_freq(head_dim, theta).float()
    assert theirs.dtype == torch.float32 and theirs.shape == ours.shape
    kept, slowed = ours == plain, ours == plain / scaling["factor"]
    blended = ~kept & ~slowed
    assert kept.any() and slowed.any() and blended.any()
    assert _ulps(ours, theirs)[~blended].max() <= 1
    assert _ulps(ours, theirs)[blended].max() <= 8

    # the model rotates by them
    m = GPT(tiny(arch="llama", n_head=2, n_embd=2 * head_dim, rope_theta=theta, rope_scaling=scaling))
    cos, sin = rope_tables(head_dim, 32, theta, scaling)
    assert torch.equal(m.rope_cos, cos) and torch.equal(m.rope_sin, sin)


def test_rope_scaling_none_changes_nothing():
    """rope_scaling=None: the tables of plain RoPE, theta^(-2i/head_dim) in fp64, and so the same
    logits, bit for bit, as a model given those tables directly."""
    head_dim, theta = 16, 10000.0
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(32, dtype=torch.float64), inv_freq)
    torch.manual_seed(0)
    m = GPT(tiny(arch="llama", rope_scaling=None))
    assert torch.equal(rope_inv_freq(head_dim, theta), inv_freq)
    assert torch.equal(m.rope_cos, angles.cos().float()) and torch.equal(m.rope_sin, angles.sin().float())
    x = torch.randint(0, 96, (2, 32))
    logits, _ = m(x, x)
    m.rope_cos, m.rope_sin = angles.cos().float(), angles.sin().float()
    assert torch.equal(m(x, x)[0], logits)
    assert GPTConfig().rope_scaling is None


def test_rope_scaling_refuses_what_it_does_not_compute():
    """Another rope_type, a missing or unknown key, a dict without RoPE to scale: a ValueError
    naming what is wrong."""
    with pytest.raises(ValueError, match=r"rope_type 'yarn' is not supported; the supported types are \('llama3',\)"):
        tiny(arch="llama", rope_scaling={**LLAMA31, "rope_type": "yarn"})
    with pytest.raises(ValueError, match="rope_type None is not supported"):
        tiny(arch="llama", rope_scaling={"type": "llama3", "factor": 8.0})
    with pytest.raises(ValueError, match="has the keys"):
        tiny(arch="llama", rope_scaling={k: v for k, v in LLAMA31.items() if k != "factor"})
    with pytest.raises(ValueError, match="low_freq_factor < high_freq_factor"):
        tiny(arch="llama", rope_scaling={**LLAMA31, "low_freq_factor": 4.0})
    with pytest.raises(ValueError, match="arch='gpt2' does not have"):
        tiny(rope_scaling=LLAMA31)


def test_generate():
    torch.manual_seed(0)
    m = GPT(tiny()).eval()
    idx = torch.randint(0, 96, (2, 5))
    greedy = m.generate(idx, 40, temperature=0)  # longer than block_size: the context is cropped
    assert greedy.shape == (2, 45) and torch.equal(greedy[:, :5], idx)
    assert torch.equal(m.generate(idx, 10, top_k=1), greedy[:, :15])  # top-1 sampling is greedy
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert torch.equal(m.generate(idx, 10, generator=g1), m.generate(idx, 10, generator=g2))


def test_fp8_goes_only_into_the_blocks():
    m = GPT(tiny(vocab_size=128))
    names = apply_fp8(m, Recipe(backend="emulate"))
    assert len(names) == 4 * 3 and all(n.startswith("blocks.") for n in names)
    assert type(m.lm_head) is nn.Linear and type(m.tok_emb) is nn.Embedding
    m2 = GPT(tiny(vocab_size=128))
    assert "lm_head" in apply_fp8(m2, Recipe(backend="emulate"), fp8_lm_head=True)
    assert m2.lm_head.weight is m2.tok_emb.weight  # still tied after the swap
    m3 = GPT(tiny(vocab_size=84))  # 84 is not a multiple of 16: FP8 tensor cores cannot take it
    assert "lm_head" not in apply_fp8(m3, Recipe(backend="emulate"), fp8_lm_head=True)


def test_fp8_model_trains_close_to_bf16():
    torch.manual_seed(0)
    ref = GPT(tiny())
    fp8 = GPT(tiny())
    fp8.load_state_dict(ref.state_dict())
    apply_fp8(fp8, Recipe(backend="emulate"))
    x = torch.randint(0, 96, (4, 32))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, l_ref = ref(x, x)
        _, l_fp8 = fp8(x, x)
    l_ref.backward()
    l_fp8.backward()
    assert l_fp8.item() == pytest.approx(l_ref.item(), rel=0.01)
    g_ref, g_fp8 = ref.blocks[1].mlp.c_fc.weight.grad, fp8.blocks[1].mlp.c_fc.weight.grad
    assert torch.nn.functional.cosine_similarity(g_ref.flatten(), g_fp8.flatten(), dim=0) > 0.95


def test_flops_per_token():
    m = GPT(tiny())
    c = m.config
    n_linear = sum(mod.weight.numel() for mod in m.modules() if isinstance(mod, nn.Linear))
    assert m.flops_per_token() == 6 * n_linear + 12 * c.n_layer * c.n_embd * c.block_size
    assert m.estimate_mfu(1000.0, m.flops_per_token() * 2000.0) == pytest.approx(0.5)


def test_load_state_across_precisions():
    bf16 = GPT(tiny())
    fp8 = GPT(tiny())
    apply_fp8(fp8, Recipe(backend="emulate", scaling="delayed"))
    load_model_state(fp8, bf16.state_dict())  # FP8 scaling state starts fresh
    assert torch.equal(fp8.blocks[0].attn.c_attn.weight, bf16.blocks[0].attn.c_attn.weight)
    load_model_state(GPT(tiny()), fp8.state_dict())  # FP8 scaling state is ignored
    with pytest.raises(CheckpointError, match="does not fit"):
        load_model_state(GPT(tiny(n_embd=128)), bf16.state_dict())
    with pytest.raises(CheckpointError, match="does not fit"):
        load_model_state(GPT(tiny(n_layer=2)), bf16.state_dict())


@pytest.mark.parametrize("arch, n_kv_head", [("gpt2", 0), ("llama", 0), ("gpt2", 2), ("llama", 2)])
def test_attention_and_mlp_run_on_a_shard(arch, n_kv_head):
    """Attention and MLP read their head count and width from the tensors, so tensor parallelism
    only swaps their Linears (nanofp8/parallel.py): with the Linears cut as the plan says, the
    ranks' partial outputs (+ the row-parallel bias, once) sum to the whole module's output. In
    fp64 the two differ only by summation order. With grouped-query attention a rank holds
    n_kv_head / tp key/value heads and the query heads that read them."""
    import copy

    from nanofp8.parallel import merge_tp_state_dicts, shard_linears, tp_plan

    torch.manual_seed(0)
    cfg = tiny(arch=arch, n_embd=64, n_head=4, n_kv_head=n_kv_head, mlp_hidden=512 if arch == "gpt2" else 256)
    m = GPT(cfg).double()
    for p in m.parameters():  # biases off zero, so that adding the row bias once is checked
        nn.init.normal_(p, std=0.1)
    blk, T = m.blocks[0], 32
    rope = (m.rope_cos[:T].double(), m.rope_sin[:T].double()) if arch == "llama" else None
    x = torch.randn(2, T, cfg.n_embd, dtype=torch.float64)
    for tp in (t for t in (2, 4) if cfg.kv_heads % t == 0):
        attn, mlp, states = torch.zeros_like(x), torch.zeros_like(x), []
        for rank in range(tp):
            shard = copy.deepcopy(blk)

            def make(w, b, cut, name):
                lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None and cut == "column",
                                dtype=w.dtype)
                lin.weight.data.copy_(w)
                if lin.bias is not None:
                    lin.bias.data.copy_(b)
                return lin

            shard_linears(shard, tp_plan(cfg), rank, tp, make)
            assert shard.attn.c_attn.out_features == sum(cfg.qkv_rows) // tp
            attn += shard.attn(x, rope)
            mlp += shard.mlp(x)
            states.append({f"blocks.0.{k}": v for k, v in shard.state_dict().items()})
        whole = merge_tp_state_dicts(states, cfg)  # the shards glue back into the block, bit for bit
        want = {f"blocks.0.{k}": v for k, v in blk.state_dict().items()}  # (the shards here: no row bias)
        assert whole.keys() == want.keys() - {"blocks.0.attn.c_proj.bias", "blocks.0.mlp.c_proj.bias"}
        assert all(torch.equal(v, want[k]) for k, v in whole.items())
        if cfg.has_bias:
            attn, mlp = attn + blk.attn.c_proj.bias, mlp + blk.mlp.c_proj.bias
        for got, want in ((attn, blk.attn(x, rope)), (mlp, blk.mlp(x))):
            assert (got - want).norm() / want.norm() < 1e-13, (arch, tp)


def test_forward_is_embed_blocks_head():
    """GPT.forward is its three parts in a row (nanofp8/parallel.py's PipelineStage runs them
    on its share of the model): bit for bit, logits and loss."""
    torch.manual_seed(0)
    m = GPT(tiny(arch="llama"))
    x = torch.randint(0, 96, (2, 32))
    logits, loss = m(x, x)
    h = m.run_blocks(m.embed(x), m.blocks[:1], 32)
    l2, loss2 = m.head(m.run_blocks(h, m.blocks[1:], 32), x)
    assert torch.equal(logits, l2) and torch.equal(loss, loss2)
    with pytest.raises(ValueError, match="exceeds block_size"):
        m.embed(torch.zeros(1, 33, dtype=torch.long))
