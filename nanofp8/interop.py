"""
Models in files other tools read: a portable FP8 export, and GPT-2 and LLaMA in the Hugging Face
layout.
nanofp8/checkpoint.py turns any training checkpoint into the fp32 state_dict these functions take.

1. A portable export (export_portable / load_portable): a directory with config.json and
   model.safetensors. safetensors is a JSON header plus raw bytes: no pickle, nothing executes
   when it is read, and any framework reads it. The block Linear weights are stored as what an
   FP8 GPU consumes, float8_e4m3fn, with "<name>.weight_scale" next to each: fp32, one per output
   row, the *dequantization* factor (w = fp8.float() * weight_scale: a multiply, as an inference
   kernel applies it, not nanofp8's quantization scale). Everything else is fp32. The header's
   metadata holds a CRC-32 of every tensor's bytes ("nanofp8.crc32", JSON), checked on import so
   that a damaged file is reported by the tensor that is damaged. Nothing of nanofp8 is needed to
   read it:

       from safetensors.torch import load_file
       t = load_file("export/model.safetensors")
       w = t["blocks.0.mlp.c_fc.weight"].float() * t["blocks.0.mlp.c_fc.weight_scale"]

2. GPT-2 in the Hugging Face layout (load_hf_gpt2 / export_hf_gpt2): config.json and
   model.safetensors as transformers writes them. Its Linears are Conv1D modules that store the
   weight as (in, out), the transpose of nn.Linear's (out, in), so the four block matrices are
   transposed on the way in and out. Our GPT-2 dialect is GPT-2: the same tanh GELU, pre-norm
   LayerNorms, fused q/k/v and tied head, so logits agree to fp32 rounding (tests/test_export.py).

3. LLaMA in the Hugging Face layout (load_hf_llama / export_hf_llama): transformers'
   LlamaForCausalLM. Its Linears are nn.Linear, (out, in) like ours; what differs is that ours
   fuse GEMMs that share an input: c_attn's rows are [q | k | v] and c_fc's are [gate | up], which
   HF keeps as separate matrices (LLAMA_BLOCK below). Both rotate the channel pairs (i, i + d/2) of
   each head ("rotate half"), with the same frequencies (Llama 3.1's rescaled ones too:
   GPTConfig.rope_scaling), so no row is permuted. A config nanofp8 does not compute (RoPE scaled
   otherwise, biases, another activation) is refused, never loaded as something else.
   Grouped-query attention carries over: num_key_value_heads is n_kv_head, and k and v hold fewer
   rows than q. Both readers take the weights in any file layout save_pretrained writes
   (read_hf_weights).
"""

import json
import os
import re

import torch
import torch.nn as nn

from nanofp8.fp8 import BLOCK, E4M3, quantize
from nanofp8.model import GPT, ROPE_SCALING_KEYS, ROPE_TYPES, GPTConfig
from nanofp8.ckptfile import (CheckpointError, check_checksums, is_newer_format, make_dir, tensor_checksums,
                              write_file)

# -----------------------------------------------------------------------------
# 1. The portable export: safetensors + JSON

EXPORT_FORMAT = "nanofp8-export-1"
CRC_KEY = "nanofp8.crc32"  # safetensors metadata: {tensor name: CRC-32 of its bytes}, as JSON


def _block_linear_weights(model_args):
    """Names and shapes of the weights stored in FP8: the block Linears (the FP8 GEMMs' weights)."""
    with torch.device("meta"):
        model = GPT(GPTConfig(**model_args))
    return {f"{n}.weight": tuple(m.weight.shape) for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and n.startswith("blocks.")}


def _expected(model_args, fp8):
    """{name: (dtype, shape)} of every tensor an export of this model holds."""
    with torch.device("meta"):
        model = GPT(GPTConfig(**model_args))
    out = {k: (torch.float32, tuple(v.shape)) for k, v in model.state_dict().items()}
    if model_args.get("tie_embeddings", True):
        out.pop("lm_head.weight")  # the same tensor as tok_emb.weight, stored once
    if fp8:
        for name, shape in _block_linear_weights(model_args).items():
            out[name] = (torch.float8_e4m3fn, shape)
            out[name + "_scale"] = (torch.float32, (shape[0], 1))
    return out


def export_portable(state, model_args, out_dir, fp8=True, extra=None):
    """Write state (an fp32 GPT state_dict) to out_dir/model.safetensors + out_dir/config.json.
    fp8=True stores the block Linear weights in E4M3 with one fp32 scale per output row. Returns
    the paths written."""
    make_dir(out_dir)
    expected = _expected(model_args, fp8)
    tensors = {}
    for name in expected:
        if name.endswith(".weight_scale"):
            continue
        t = state[name].detach().float().cpu()
        if not torch.isfinite(t).all():
            raise CheckpointError(f"{name} holds NaN or inf values: not exported")
        if fp8 and expected[name][0] == torch.float8_e4m3fn:
            q = quantize(t, E4M3, "row")
            tensors[name] = q.data.contiguous()
            tensors[name + "_scale"] = q.inv_scale.float().contiguous()  # dequantize: data * this
        else:
            tensors[name] = t.contiguous()
    meta = {"format": EXPORT_FORMAT, "model_args": dict(model_args),
            "fp8": {"weights": "float8_e4m3fn, one fp32 scale per output row in <name>_scale; "
                               "w = weight.float() * weight_scale"} if fp8 else None,
            **(extra or {})}
    return _write_export(out_dir, tensors, meta)


def _write_export(out_dir, tensors, config):
    """model.safetensors (with its tensors' CRC-32s), then config.json, which marks the export as
    complete. Each is written whole or not at all (a temp file renamed into place), with the mode
    any new file gets (0644 under umask 022). A failed write (disk full) is a WriteError and
    leaves no temp file. Returns the paths written."""
    from safetensors.torch import save

    blob = save(tensors, metadata={"format": "pt", CRC_KEY: json.dumps(tensor_checksums(tensors))})
    paths = [os.path.join(out_dir, "model.safetensors"), os.path.join(out_dir, "config.json")]
    if os.path.exists(paths[1]):  # replacing an export: until the new config.json, it is none
        os.remove(paths[1])
    for path, data in zip(paths, (blob, json.dumps(config, indent=2).encode())):
        write_file(path, data)
    return paths


def _read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"no {os.path.basename(path)} in {os.path.dirname(path)}") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None


def _read_safetensors(path):
    """The tensors of a safetensors file, checked against the CRC-32s in its metadata where it has
    them (nanofp8's exports; a file from elsewhere has none)."""
    from safetensors import safe_open

    if not os.path.isfile(path):
        raise CheckpointError(f"no {os.path.basename(path)} in {os.path.dirname(path)}")
    try:
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # truncated header, bad offsets, not a safetensors file at all
        raise CheckpointError(f"cannot read {path}: {e}") from None
    if CRC_KEY in metadata:
        try:
            saved = json.loads(metadata[CRC_KEY])
        except ValueError:
            raise CheckpointError(f"{path} is damaged: its checksums cannot be read") from None
        check_checksums(saved, tensors, path, "export it again")
    return tensors


# The files a Hugging Face model directory keeps its weights in, as save_pretrained writes them: one
# model.safetensors, or shards listed by model.safetensors.index.json (a model above
# max_shard_size, 5 GB by default: any Llama from 3B up as published). Older directories hold
# pytorch_model.bin (or its shards): a pickle, which torch.load reads with weights_only=True, the
# unpickler that builds tensors and plain containers only and refuses any other object, so a file
# cannot run code on load.
HF_WEIGHT_FILES = [("model.safetensors.index.json", "model.safetensors"),
                   ("pytorch_model.bin.index.json", "pytorch_model.bin")]


def _read_weight_file(path):
    if path.endswith(".safetensors"):
        return _read_safetensors(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated zip, or a pickle holding more than tensors
        raise CheckpointError(f"cannot read {path} as plain tensors: {str(e).splitlines()[0]}") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path} does not hold a state_dict (a dict of tensors)")
    return state


def read_hf_weights(path):
    """Every tensor of a Hugging Face model directory, by name, from whichever of HF_WEIGHT_FILES
    it has (safetensors first); an index's shards are read whole and checked against it: each
    tensor in the shard the index names, none missing."""
    for index_name, single in HF_WEIGHT_FILES:
        if os.path.isfile(os.path.join(path, single)):
            return _read_weight_file(os.path.join(path, single))
        index_path = os.path.join(path, index_name)
        if not os.path.isfile(index_path):
            continue
        where = _read_json(index_path).get("weight_map")
        if not isinstance(where, dict) or not where:
            raise CheckpointError(f"{index_path} has no weight_map: it does not say which file holds which tensor")
        tensors = {}
        for shard in sorted(set(where.values())):
            got = _read_weight_file(os.path.join(path, shard))
            strays = sorted(k for k in got if where.get(k) != shard)
            if strays:
                raise CheckpointError(f"{path}/{shard} holds {strays[:3]}, which {index_name} does not place there")
            tensors.update(got)
        missing = sorted(set(where) - set(tensors))
        if missing:
            raise CheckpointError(f"{path}: {index_name} lists {len(missing)} tensors no shard holds, e.g. {missing[:3]}")
        return tensors
    raise CheckpointError(f"no weights in {path}: none of {', '.join(f for pair in HF_WEIGHT_FILES for f in pair)}")


def load_portable(path):
    """Read an export_portable directory back. Returns (fp32 state_dict of the GPT, config.json as a
    dict). Every tensor is checked against the model config.json describes: a missing or unexpected
    tensor, a wrong dtype or a wrong shape is a CheckpointError naming it; non-finite values too."""
    meta = _read_json(os.path.join(path, "config.json"))
    if is_newer_format(meta.get("format"), EXPORT_FORMAT):
        raise CheckpointError(f"{path} was written by a newer nanofp8 (format {meta['format']!r}; this version "
                              f"reads {EXPORT_FORMAT!r}): update nanofp8 to read it")
    if meta.get("format") != EXPORT_FORMAT:
        raise CheckpointError(f"{path}/config.json is not a nanofp8 export (format "
                              f"{meta.get('format')!r}, expected {EXPORT_FORMAT!r})")
    try:
        model_args = GPTConfig(**meta["model_args"]).__dict__
    except (TypeError, ValueError, KeyError) as e:
        raise CheckpointError(f"{path}/config.json: bad model_args: {e}") from None
    tensors = _read_safetensors(os.path.join(path, "model.safetensors"))
    expected = _expected(model_args, bool(meta.get("fp8")))
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{path}/model.safetensors does not match its config.json: missing "
                              f"{missing[:5]}, unexpected {unexpected[:5]}")
    for name, (dtype, shape) in expected.items():
        t = tensors[name]
        if t.dtype != dtype:
            raise CheckpointError(f"{path}: tensor {name} is {t.dtype}, expected {dtype}")
        if tuple(t.shape) != shape:
            raise CheckpointError(f"{path}: tensor {name} has shape {tuple(t.shape)}, expected {shape}")
    state = {}
    for name, t in tensors.items():
        if name.endswith(".weight_scale"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            t = t.float() * tensors[name + "_scale"]
        if not torch.isfinite(t).all():
            raise CheckpointError(f"{path}: tensor {name} holds NaN or inf values")
        state[name] = t
    if model_args["tie_embeddings"]:
        state["lm_head.weight"] = state["tok_emb.weight"]
    return state, meta


# -----------------------------------------------------------------------------
# 2. GPT-2 in the Hugging Face layout

CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
# Key renames, applied in order (the norm rule before the general block rule).
HF_TO_OURS = [(r"^wte\.", "tok_emb."), (r"^wpe\.", "pos_emb."), (r"^ln_f\.", "norm_f."),
              (r"^h\.(\d+)\.ln_(\d)\.", r"blocks.\1.norm_\2."), (r"^h\.(\d+)\.", r"blocks.\1.")]
OURS_TO_HF = [(r"^tok_emb\.", "wte."), (r"^pos_emb\.", "wpe."), (r"^norm_f\.", "ln_f."),
              (r"^blocks\.(\d+)\.norm_(\d)\.", r"h.\1.ln_\2."), (r"^blocks\.(\d+)\.", r"h.\1.")]


def _hf_to_ours(key):
    key = key.removeprefix("transformer.")  # GPT2LMHeadModel's prefix; GPT2Model files have none
    for pattern, repl in HF_TO_OURS:
        key = re.sub(pattern, repl, key)
    return key


def _ours_to_hf(key):
    if key == "lm_head.weight":
        return key
    for pattern, repl in OURS_TO_HF:
        key = re.sub(pattern, repl, key)
    return "transformer." + key


def load_hf_gpt2(path):
    """A GPT-2 in the Hugging Face layout (config.json + model.safetensors, as transformers'
    save_pretrained writes it or as downloaded) -> (fp32 state_dict of our GPT, model_args)."""
    c = _read_json(os.path.join(path, "config.json"))
    if c.get("model_type") != "gpt2":
        raise CheckpointError(f"{path}/config.json: model_type {c.get('model_type')!r}, expected 'gpt2'")
    # Variants of the attention our model does not compute: refuse rather than be subtly wrong.
    if c.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise CheckpointError(f"{path}: activation_function={c['activation_function']!r}; only GPT-2's "
                              "tanh GELU (gelu_new) is supported")
    if c.get("scale_attn_by_inverse_layer_idx") or not c.get("scale_attn_weights", True):
        raise CheckpointError(f"{path}: attention scaling other than 1/sqrt(head_dim) is not supported")
    try:
        model_args = GPTConfig(arch="gpt2", block_size=c["n_positions"], vocab_size=c["vocab_size"],
                               n_layer=c["n_layer"], n_head=c["n_head"], n_embd=c["n_embd"], bias=True,
                               tie_embeddings=c.get("tie_word_embeddings", True),
                               mlp_hidden=c.get("n_inner") or 0,
                               norm_eps=c.get("layer_norm_epsilon", 1e-5)).__dict__
    except KeyError as e:
        raise CheckpointError(f"{path}/config.json has no {e.args[0]!r}") from None
    except ValueError as e:
        raise CheckpointError(f"{path}/config.json: {e}") from None
    hf = read_hf_weights(path)
    state = {}
    for k, v in hf.items():
        if re.search(r"\.attn\.(masked_)?bias$", k):
            continue  # old files store the causal mask as a buffer named like a bias
        ours = _hf_to_ours(k)
        state[ours] = v.float().t().contiguous() if ours.endswith(CONV1D) else v.float()
    if model_args["tie_embeddings"]:
        state.pop("lm_head.weight", None)
        state["lm_head.weight"] = state.get("tok_emb.weight")
    _check_against_model(state, model_args, path)
    return state, model_args


def _check_against_model(state, model_args, path):
    with torch.device("meta"):
        want = GPT(GPTConfig(**model_args)).state_dict()
    missing = sorted(k for k in want if state.get(k) is None)
    unexpected = sorted(set(state) - set(want))
    if missing or unexpected:
        raise CheckpointError(f"{path} does not hold a {model_args['arch']} of its config.json: missing "
                              f"{missing[:5]}, unexpected {unexpected[:5]}")
    for k, v in want.items():
        if tuple(state[k].shape) != tuple(v.shape):
            raise CheckpointError(f"{path}: {k} has shape {tuple(state[k].shape)}, expected {tuple(v.shape)}")
        if not torch.isfinite(state[k]).all():
            raise CheckpointError(f"{path}: {k} holds NaN or inf values")


def export_hf_gpt2(state, model_args, out_dir):
    """Write an fp32 GPT state_dict (arch gpt2) in the Hugging Face GPT-2 layout: transformers'
    GPT2LMHeadModel.from_pretrained(out_dir) then computes the same logits. A model trained
    without biases (bias=False) gets zero biases, which is the same function. Returns the paths
    written."""
    c = GPTConfig(**model_args)
    if c.arch != "gpt2":
        raise ValueError(f"the Hugging Face GPT-2 layout needs arch='gpt2', this model is {c.arch!r} "
                         "(use the portable export)")
    if c.kv_heads != c.n_head:
        raise ValueError(f"the Hugging Face GPT-2 layout has no grouped-query attention, this model has "
                         f"n_kv_head={c.n_kv_head} (use the portable export)")
    with torch.device("meta"):
        keys = GPT(c).state_dict().keys()  # the weights only: no FP8 scaling buffers of an O1 run
    missing = [k for k in keys if k not in state]
    if missing:
        raise CheckpointError(f"cannot export: the state has no {missing[:5]}")
    tensors = {}
    for k, v in ((k, state[k]) for k in keys):
        if k == "lm_head.weight" and c.tie_embeddings:
            continue
        if not torch.isfinite(v).all():
            raise CheckpointError(f"{k} holds NaN or inf values: not exported")
        tensors[_ours_to_hf(k)] = (v.t() if k.endswith(CONV1D) else v).detach().float().contiguous().cpu()
    if not c.has_bias:  # GPT-2 always has biases: zeros compute the same as none
        for i in range(c.n_layer):
            for name, width in (("attn.c_attn", 3 * c.n_embd), ("attn.c_proj", c.n_embd),
                                ("mlp.c_fc", c.hidden), ("mlp.c_proj", c.n_embd),
                                ("ln_1", c.n_embd), ("ln_2", c.n_embd)):
                tensors[f"transformer.h.{i}.{name}.bias"] = torch.zeros(width)
        tensors["transformer.ln_f.bias"] = torch.zeros(c.n_embd)
    make_dir(out_dir)
    eos = 50256 if c.vocab_size > 50256 else None
    config = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": c.vocab_size,
              "n_positions": c.block_size, "n_embd": c.n_embd, "n_layer": c.n_layer, "n_head": c.n_head,
              "n_inner": c.mlp_hidden or None, "activation_function": "gelu_new",
              "layer_norm_epsilon": c.norm_eps, "resid_pdrop": c.dropout, "embd_pdrop": c.dropout,
              "attn_pdrop": c.dropout, "tie_word_embeddings": c.tie_embeddings,
              "scale_attn_weights": True, "bos_token_id": eos, "eos_token_id": eos}
    return _write_export(out_dir, tensors, config)


# -----------------------------------------------------------------------------
# 3. LLaMA in the Hugging Face layout

# Each block's tensors: ours -> HF's, a fused matrix split row-wise in this order (into equal parts,
# but for c_attn: GPTConfig.qkv_rows).
LLAMA_BLOCK = [("attn.c_attn", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
               ("attn.c_proj", ("self_attn.o_proj",)),
               ("mlp.c_fc", ("mlp.gate_proj", "mlp.up_proj")),
               ("mlp.c_proj", ("mlp.down_proj",)),
               ("norm_1", ("input_layernorm",)),
               ("norm_2", ("post_attention_layernorm",))]
LLAMA_TOP = [("tok_emb", "model.embed_tokens"), ("norm_f", "model.norm"), ("lm_head", "lm_head")]


def hf_model_type(path):
    """The model_type of a Hugging Face directory's config.json ("gpt2", "llama", ...), or None
    where path has no config.json or one without model_type (a nanofp8 export)."""
    cfg = os.path.join(path, "config.json")
    if not os.path.isfile(cfg):
        return None
    try:
        return _read_json(cfg).get("model_type")
    except CheckpointError:
        return None


def is_hf_gpt2(path):
    """Whether path is a directory in the Hugging Face layout (config.json of model_type gpt2)."""
    return hf_model_type(path) == "gpt2"


def _llama_model_args(c, path):
    """model_args of our llama from an HF LlamaConfig dict; a CheckpointError, one line naming the
    key, for what our model does not compute."""
    def refuse(key, why):
        raise CheckpointError(f"{path}/config.json: {key}={c.get(key)!r}: {why}")

    heads = c.get("num_attention_heads")
    kv_heads = c.get("num_key_value_heads") or heads  # (absent or null: one per query head)
    if heads and kv_heads and heads % kv_heads:
        refuse("num_key_value_heads", f"it must divide num_attention_heads={heads}")
    if c.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "the SwiGLU MLP here gates with silu only")
    for key in ("attention_bias", "mlp_bias"):
        if c.get(key):
            refuse(key, "LLaMA's Linears have no biases here")
    if heads and c.get("head_dim") not in (None, c.get("hidden_size", 0) // heads):
        refuse("head_dim", "a head here is hidden_size / num_attention_heads wide")
    # transformers 5 writes rope_parameters (rope_theta inside); older files rope_theta and
    # rope_scaling (null: none), whose type key was once "type"
    rope_key = "rope_parameters" if c.get("rope_parameters") else "rope_scaling"
    rope = c.get(rope_key) or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", *ROPE_TYPES):
        refuse(rope_key, f"RoPE of type {kind!r} is not implemented here (only unscaled RoPE and {ROPE_TYPES})")
    scaling = None
    if kind != "default":  # Llama 3.1's: GPTConfig.rope_scaling holds the same numbers (model.rope_inv_freq)
        missing = [k for k in ROPE_SCALING_KEYS[1:] if k not in rope]
        if missing:
            refuse(rope_key, f"RoPE of type {kind!r} needs {missing}")
        scaling = {"rope_type": kind, **{k: rope[k] for k in ROPE_SCALING_KEYS[1:]}}
    if rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)) != 1.0:
        refuse("partial_rotary_factor", "RoPE here rotates every channel of a head")
    try:
        return GPTConfig(arch="llama", block_size=c["max_position_embeddings"], vocab_size=c["vocab_size"],
                         n_layer=c["num_hidden_layers"], n_head=heads, n_embd=c["hidden_size"], bias=False,
                         n_kv_head=0 if kv_heads == heads else kv_heads,
                         tie_embeddings=c.get("tie_word_embeddings", False), mlp_hidden=c["intermediate_size"],
                         rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
                         rope_scaling=scaling,
                         norm_eps=c.get("rms_norm_eps", 1e-6)).__dict__
    except KeyError as e:
        raise CheckpointError(f"{path}/config.json has no {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}/config.json: {e}") from None


def load_hf_llama(path):
    """A LLaMA in the Hugging Face layout (LlamaForCausalLM: config.json + model.safetensors, as
    save_pretrained writes it) -> (fp32 state_dict of our GPT, model_args)."""
    c = _read_json(os.path.join(path, "config.json"))
    if c.get("model_type") != "llama":
        raise CheckpointError(f"{path}/config.json: model_type {c.get('model_type')!r}, expected 'llama'")
    if c.get("quantization_config"):
        raise CheckpointError(f"{path}/config.json: quantization_config="
                              f"{c['quantization_config'].get('quant_method')!r}: a quantized LLaMA is not "
                              "read back here (export.py --format=hf writes the one that is)")
    model_args = _llama_model_args(c, path)
    hf = read_hf_weights(path)
    state = {}
    for ours, theirs in LLAMA_TOP:
        if f"{theirs}.weight" in hf:
            state[f"{ours}.weight"] = hf.pop(f"{theirs}.weight").float()
    for i in range(model_args["n_layer"]):
        for ours, parts in LLAMA_BLOCK:
            names = [f"model.layers.{i}.{p}.weight" for p in parts]
            if all(n in hf for n in names):
                state[f"blocks.{i}.{ours}.weight"] = torch.cat([hf.pop(n).float() for n in names])
    if model_args["tie_embeddings"]:
        state["lm_head.weight"] = state.get("tok_emb.weight")
    if hf:  # what no rule took: a tensor of a model other than its config.json says
        raise CheckpointError(f"{path} does not hold a LLaMA of its config.json: unexpected {sorted(hf)[:5]}")
    _check_against_model(state, model_args, path)
    return state, model_args


# FP8 in the Hugging Face layout: how each granularity of nanofp8's weight scales is declared.
# Both store the E4M3 bytes as "<Linear>.weight" and the *dequantization* factors beside them
# (w = weight.float() * scale, expanded over a row or a tile), fp32; only the block Linears are
# FP8, the LM head is listed as not converted (embeddings and norms are not Linears).
HF_FP8 = {
    # compressed-tensors' "float-quantized" (transformers reads it with compressed-tensors installed;
    # it is also the FP8 checkpoint format of vLLM's LLM Compressor): one scale per output channel, (N, 1); activations cast per token at run time, as
    # nanofp8's rowwise recipe casts them.
    "row": ("weight_scale", {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"], "format": "float-quantized", "output_activations": None,
            "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel",
                        "dynamic": False, "group_size": None},
            "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                                  "dynamic": True, "group_size": None}}},
        "ignore": ["lm_head"], "kv_cache_scheme": None}),
    # transformers' own "fp8" (FineGrainedFP8, the layout of DeepSeek-V3's published weights):
    # one scale per 128x128 tile, "weight_scale_inv" (its name, yet a multiplier like the other);
    # activations cast in 1x128 tiles at run time, as nanofp8's blockwise recipe casts them.
    "block": ("weight_scale_inv", {
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK],
        "modules_to_not_convert": ["lm_head"]}),
}


def export_hf_llama(state, model_args, out_dir, fp8=None, margin=0):
    """Write an fp32 GPT state_dict (arch llama) in the Hugging Face LlamaForCausalLM layout:
    transformers' LlamaForCausalLM.from_pretrained(out_dir) then computes the same logits.

    fp8="row" or "block" stores the block Linears in E4M3 as a serving stack loads them (HF_FP8),
    with the bytes nanofp8's FP8 GEMMs read: each weight cast by fp8.quantize as a rowwise
    (per-row scales) or blockwise (128x128 tiles) recipe with this `margin` casts it. A fused
    matrix splits between its rows (a row's scale goes with it; a tile row of 128 with its tiles),
    so a tile must not straddle q and k or gate and up: blockwise needs n_embd and the MLP width to
    be multiples of 128. Returns the paths written."""
    c = GPTConfig(**model_args)
    if c.arch != "llama":
        raise ValueError(f"the Hugging Face LLaMA layout needs arch='llama', this model is {c.arch!r}")
    kv_rows = c.qkv_rows[1]  # k's and v's (n_kv_head * head dim)
    if fp8 == "block" and (c.n_embd % BLOCK or c.hidden % BLOCK or kv_rows % BLOCK):
        raise ValueError(f"blockwise FP8 in the HF layout needs n_embd ({c.n_embd}), the MLP width "
                         f"({c.hidden}) and the key/value width ({kv_rows}) to be multiples of {BLOCK}: a "
                         f"{BLOCK}x{BLOCK} tile would straddle two of the matrices HF keeps apart (q/k/v, gate/up)")
    tensors = {}
    for ours, theirs in LLAMA_TOP:
        if not (ours == "lm_head" and c.tie_embeddings):
            tensors[f"{theirs}.weight"] = _exportable(state, f"{ours}.weight")
    for i in range(c.n_layer):
        for ours, parts in LLAMA_BLOCK:
            w = _exportable(state, f"blocks.{i}.{ours}.weight")
            names = [f"model.layers.{i}.{p}" for p in parts]
            rows = c.qkv_rows if ours == "attn.c_attn" else [w.shape[0] // len(parts)] * len(parts)
            if fp8 is None or w.dim() == 1:  # (a norm's weight: never FP8)
                tensors.update({f"{n}.weight": piece.contiguous() for n, piece in zip(names, w.split(rows))})
                continue
            q = quantize(w, E4M3, fp8, block=(BLOCK, BLOCK), margin=margin)
            scale = q.inv_scale.float()  # the dequantization factor: (N, 1) per row, (N/128, K/128) per tile
            scale_rows = [r * scale.shape[0] // w.shape[0] for r in rows]  # a row's, or a tile row's
            for n, data, s in zip(names, q.data.split(rows), scale.split(scale_rows)):
                tensors[f"{n}.weight"] = data.contiguous()
                tensors[f"{n}.{HF_FP8[fp8][0]}"] = s.contiguous()
    config = llama_hf_config(c)
    if fp8 is not None:
        config["quantization_config"] = HF_FP8[fp8][1]
    make_dir(out_dir)
    return _write_export(out_dir, tensors, config)


def llama_hf_config(c):
    """config.json of LlamaForCausalLM for our GPTConfig c (arch llama)."""
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": c.vocab_size,
            "hidden_size": c.n_embd, "intermediate_size": c.hidden, "num_hidden_layers": c.n_layer,
            "num_attention_heads": c.n_head, "num_key_value_heads": c.kv_heads,
            "head_dim": c.n_embd // c.n_head, "hidden_act": "silu", "max_position_embeddings": c.block_size,
            "rms_norm_eps": c.norm_eps, "rope_theta": c.rope_theta,
            # transformers 5 reads rope_parameters, older versions rope_theta and rope_scaling
            "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta, **(c.rope_scaling or {})},
            "rope_scaling": c.rope_scaling,
            "attention_bias": False, "mlp_bias": False, "attention_dropout": c.dropout,
            "tie_word_embeddings": c.tie_embeddings, "torch_dtype": "float32",
            "bos_token_id": None, "eos_token_id": None}


def _exportable(state, key):
    """state[key] as a contiguous fp32 CPU tensor; a CheckpointError if it is missing or not finite."""
    if state.get(key) is None:
        raise CheckpointError(f"cannot export: the state has no {key}")
    v = state[key]
    if not torch.isfinite(v).all():
        raise CheckpointError(f"{key} holds NaN or inf values: not exported")
    return v.detach().float().cpu().contiguous()
