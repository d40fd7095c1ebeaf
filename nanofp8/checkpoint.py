"""
Models that leave the training run: read any checkpoint train.py writes, resume it at another
precision level or layout, and freeze it into an FP8 inference model. Exporting it as plain
tensors and trading weights with Hugging Face GPT-2 and LLaMA live in nanofp8/interop.py;
read_any() below reads all of these kinds of directories, for sample.py, export.py and train.py's
init_from.

1. One model, whatever wrote it. train.py saves what each level trains on, and that is not the
   same tensor at every level:

       bf16, O1   model["...weight"] is the fp32 weight (O1 adds FP8 scaling buffers)
       O2         model["...weight"] is the fp16 master m and model["...weight_scale"] its scale s:
                  w = m / s (a power of two, so exact)
       O3         model["...weight"] is only the E4M3 copy the GEMMs read. The real weight is the
                  fp16 master, cut into world-size flat shards held by the optimizer: each rank
                  writes its state_dict to a file of its own, optimizer-rank{r}.pt
                  (["optimizer"]["state"][i]["master"] and "master_scale"), named by the model
                  file's optimizer["zero_shard_files"]. with_shards reads them all back into
                  optimizer["zero_shards"], the list one file of an older nanofp8 held
       TP / PP    one file per (tensor, pipeline) rank, ckpt-tp{t}-pp{p}.pt, each with its
                  shards of the block matrices (parallel.merge_tp_state_dicts glues them)

   A run keeps these files in checkpoint sets (out_dir/ckpt-00000020/, nanofp8/outdir.py):
   find_checkpoint() picks the newest complete set of an out_dir, or reads a set directory itself.
   read_checkpoint() resolves all of these to one fp32 state_dict of the single-device GPT, so
   sample.py, the exporters and a resume at another level all start from the same thing.
   Resolving O3 from the FP8 copy instead of the master would keep 3 of the master's 10
   mantissa bits (tests/test_export.py: the two are 25-40 dB apart).

2. Resuming at another level or layout (resume_from): the weights carry over exactly (as fp32,
   then converted by train.py's own setup into the new level's storage and cut into the new
   layout's shards). Adam's moments carry over between single-device layouts of any level
   (dequantized, then stored in the new level's formats: O2 -> bf16 turns E4M3 m into fp32 m,
   O3 on 2 ranks -> 1 glues the shards), and between the engines: engine=torch's DCP set holds
   them whole (torchstack.read_dcp_moments), and FSDP2 gets its shard of each (load_moments).
   What does not carry over is printed, never dropped silently: the moments into TP/PP or out
   of the hand-written TP/PP (they restart from zero at the same point of the schedule),
   the FP8 scaling state (amax histories restart) and the dropout RNG stream.

3. Frozen FP8 models (freeze_fp8): the block Linears of a trained model become Fp8WeightLinear,
   1 byte per weight plus one fp32 scale per row, dequantized on the fly. For inference and for
   the frozen reference or reward model of RLHF or distillation, which never updates its weights
   and so needs no master copy.
"""

import os
import re

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, distribute_tensor

from nanofp8.fp8 import BLOCK, E4M3, expand_tiles, quantize
from nanofp8.interop import hf_model_type, load_hf_gpt2, load_hf_llama, load_portable
from nanofp8.model import GPT, GPTConfig
from nanofp8.ckptfile import CheckpointError, load_checkpoint
from nanofp8.outdir import (MANIFEST, SET_NAME, SHARD_FILE, CheckpointSet, legacy_files, newest_set, nothing_found,
                            read_set)

# -----------------------------------------------------------------------------
# 1. Any checkpoint -> one fp32 state_dict of the single-device GPT


def _peek(path):
    """A checkpoint's settings without reading its tensors: memory-mapped, so an exact resume does
    not read the file twice (load_checkpoint's errors for a file that cannot be mapped)."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        if isinstance(ckpt, dict) and "config" in ckpt and "precision" in ckpt["config"]:
            return ckpt
    except Exception:  # an old, truncated or foreign file: let load_checkpoint say what is wrong
        pass
    return load_checkpoint(path, map_location="cpu")


def find_checkpoint(out_dir):
    """(the checkpoint to read in out_dir, notes on what is ignored): its newest complete set
    (nanofp8/outdir.py), else the files an older nanofp8 wrote into out_dir (ckpt.pt or the
    model-parallel ranks' ckpt-tp*-pp*.pt, the later iteration if both are there). A set
    directory itself (out/ckpt-00000010) is read as it is. CheckpointError if there is none."""
    if os.path.isfile(os.path.join(out_dir, MANIFEST)):  # a set, named directly
        found, why = read_set(out_dir)
        if found is None:
            raise CheckpointError(f"{out_dir} is {why}")
        return found, []
    found, notes = newest_set(out_dir)
    if found is not None:
        return found, notes
    legacy = legacy_files(out_dir)
    if not legacy:
        raise CheckpointError(f"no checkpoint in {out_dir}: {nothing_found(out_dir)}")
    single, ranks = [f for f in legacy if f == "ckpt.pt"], [f for f in legacy if f != "ckpt.pt"]
    if single and ranks:
        # Both layouts wrote here (a run resumed at another layout): the later iteration wins.
        newer = _peek(os.path.join(out_dir, ranks[0]))["iter_num"] > _peek(os.path.join(out_dir, "ckpt.pt"))["iter_num"]
        notes.append(f"ignoring {', '.join(single if newer else ranks)} in {out_dir}: an earlier iteration")
        legacy = ranks if newer else single
    return CheckpointSet(out_dir, legacy), notes


def load_shard(found, name, iter_num, map_location="cpu"):
    """One rank's O3 optimizer state (its state_dict) from its file `name` in the set `found`,
    checked against the manifest and against the model file's iteration `iter_num`."""
    path = found.file(name)
    shard = load_checkpoint(path, map_location=map_location, expect=found.expected(name), keys=("optimizer", "iter_num"))
    if shard["iter_num"] != iter_num:
        raise CheckpointError(f"{path} is of iteration {shard['iter_num']}, the model file beside it of "
                              f"{iter_num}: not one checkpoint")
    return shard["optimizer"]


def with_shards(ckpt, found):
    """A model file with O3's optimizer shards read from their files (load_shard), every rank's,
    into ckpt["optimizer"] = {"zero_shards": [rank 0's state_dict, ...]}: what a conversion to one
    process reads. Other files are returned as they are (an O3 file of an older nanofp8 holds its
    zero_shards itself)."""
    names = (ckpt.get("optimizer") or {}).get("zero_shard_files")
    if names is not None:
        ckpt["optimizer"] = {"zero_shards": [load_shard(found, n, ckpt["iter_num"]) for n in names]}
    return ckpt


def _param_order(model_args):
    """Parameter names in the order of train.py's build_optimizer groups: matrices, then the
    rest, each in module order, tied weights once. Optimizer states are keyed by this index."""
    with torch.device("meta"):
        model = GPT(GPTConfig(**model_args))
    named = list(model.named_parameters())
    return [n for n, p in named if p.dim() >= 2] + [n for n, p in named if p.dim() < 2]


def _o3_masters(ckpt, path):
    """{weight name: fp32 weight} from an O3 checkpoint's sharded fp16 masters."""
    shards = (ckpt.get("optimizer") or {}).get("zero_shards")
    if not shards:
        return None
    names = _param_order(ckpt["model_args"])
    index = [i for g in shards[0]["param_groups"] for i in g["params"]]
    if len(index) != len(names):
        raise CheckpointError(f"{path}: the optimizer has {len(index)} parameters, the model "
                              f"{len(names)}: not a checkpoint of this model")
    out = {}
    for i, name in zip(index, names):
        if "master" not in shards[0]["state"].get(i, {}):
            continue  # a replicated parameter, fp32 in the model state
        flat = torch.cat([s["state"][i]["master"].float() * s["state"][i]["master_scale"].reciprocal()
                          for s in shards])
        shape = ckpt["model"][name].shape
        if flat.numel() < shape.numel():
            raise CheckpointError(f"{path}: the O3 shards of {name} hold {flat.numel()} values, "
                                  f"the weight has {shape.numel()}")
        out[name] = flat[: shape.numel()].view(shape)
    return out


def fp32_moments(ckpt):
    """{parameter name: {"step": ..., and each Adam moment under its name in
    optim.ADAMW_MOMENTS}} in fp32, from the optimizer state of a single-device checkpoint of any
    level: torch AdamW's fp32 moments (the same names), O2's E4M3 m and fp16 (or E4M3 sqrt) v
    with their scales, O3's shards of those glued back. None if there is none."""
    from nanofp8.optim import ADAMW_MOMENTS, dequantize_blocks

    opt = ckpt.get("optimizer")
    if not isinstance(opt, dict) or "param_groups" not in opt and "zero_shards" not in opt:
        return None
    shards = opt.get("zero_shards") or [opt]
    names = _param_order(ckpt["model_args"])
    index = [i for g in shards[0]["param_groups"] for i in g["params"]]
    if len(index) != len(names):
        return None
    moments = ADAMW_MOMENTS[ckpt["config"].get("o2_v_format", "fp16")].values()  # (O2/O3 weights')

    def load(st, mo):  # (a scale per block of values, or one per tensor: optim.dequantize_blocks)
        if mo.key + "_scale" not in st:
            return st[mo.key].float()  # fp32 state
        x = dequantize_blocks(st[mo.key], st[mo.key + "_scale"])
        return x.square() if mo.sqrt else x

    out = {}
    for i, name in zip(index, names):
        sts = [s["state"].get(i) for s in shards]
        if not sts[0]:
            continue  # never stepped
        shape = ckpt["model"][name].shape
        if "master" in sts[0]:  # an O3 weight: flat shards, zero-padded at the end
            out[name] = {mo.key: torch.cat([load(st, mo).reshape(-1) for st in sts])[: shape.numel()].view(shape)
                         for mo in moments}
        else:
            out[name] = {mo.key: load(sts[0], mo) for mo in moments}
        out[name]["step"] = sts[0]["step"].float().cpu()
    return out


@torch.no_grad()
def load_moments(optimizer, model, moments):
    """Put fp32 moments (from fp32_moments) into a freshly built optimizer of any level, in its own
    formats: fp32 for torch AdamW, E4M3 m and fp16 (or E4M3 sqrt) v for O2 weights, this rank's
    shard of those for O3, this rank's DTensor piece where FSDP2 shards the parameter (engine=torch).
    Parameters are matched by name; a shape mismatch is an error."""
    from nanofp8.dist import held_shard_len
    from nanofp8.optim import ADAMW_MOMENTS, quantize_blocks

    table = getattr(optimizer, "moments", ADAMW_MOMENTS["fp16"]).values()  # (torch AdamW: fp32, Adam's names)
    trained = {p for g in optimizer.param_groups for p in g["params"]}
    for name, p in model.named_parameters():
        saved = moments.get(name)
        if saved is None or p not in trained:
            continue
        xs = [saved[mo.key].to(p.device) for mo in table]
        if xs[0].shape != p.shape:
            raise CheckpointError(f"optimizer moments of {name} have shape {tuple(xs[0].shape)}, the "
                                  f"parameter {tuple(p.shape)}")
        if isinstance(p, DTensor):  # engine=torch's FSDP2 shard: the moments cut as the parameter is
            xs = [distribute_tensor(t, p.device_mesh, p.placements, src_data_rank=None) for t in xs]
        st = optimizer.state[p]
        if p in getattr(optimizer, "o2", ()):  # an O2/O3 weight: the table's formats
            if getattr(optimizer, "sharded", False):  # this rank's shard (the master is already there)
                c, r = held_shard_len(p, optimizer.world), optimizer.rank
                xs = [F.pad(t.reshape(-1), (0, optimizer.world * c - p.numel()))[r * c : (r + 1) * c] for t in xs]
            for mo, x in zip(table, xs):
                st[mo.key], st[mo.key + "_scale"] = quantize_blocks(x.sqrt() if mo.sqrt else x, mo.fmt)
        else:
            for mo, x in zip(table, xs):
                st[mo.key] = x.clone()
        # torch's fused AdamW wants its step counter on the parameter's device, the others on the CPU
        fused = optimizer.param_groups[0].get("fused") or False
        st["step"] = saved["step"].clone().to(p.device if fused else "cpu")


def _resolve(ckpt, path, notes):
    """The fp32 weights of one file (single-device keys, TP shards still cut)."""
    state = {k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()}
    masters = None
    out = {}
    for k, v in state.items():
        if k.endswith(".weight_scale"):
            continue
        scale = state.get(k + "_scale") if k.endswith(".weight") else None
        if scale is None:
            out[k] = v.float() if v.is_floating_point() else v
        elif v.dtype == torch.float16:  # O2: the scaled fp16 master
            out[k] = v.float() * scale.reciprocal()
        else:  # O3: the FP8 copy; the master is in the optimizer's shards
            if masters is None:
                masters = _o3_masters(ckpt, path) or {}
                if not masters:
                    notes.append(f"{path} has no O3 optimizer shards: weights taken from their "
                                 "E4M3 copies (3 mantissa bits), not the fp16 masters")
            out[k] = masters[k] if k in masters else v.float() * scale.reciprocal()
    return out


def read_checkpoint(out_dir):
    """Any checkpoint train.py wrote in out_dir (find_checkpoint) -> (fp32 state_dict of the
    single-device GPT, info).

    info: model_args, config (the training run's), iter_num, best_val_loss, files, precision,
    layout (tensor_parallel, pipeline_parallel, zero_world: O3's shard count, else None), notes
    (what was approximated or ignored; empty when the weights are exactly the trained ones)."""
    for _ in range(3):
        found, notes = find_checkpoint(out_dir)
        try:
            return _read_found(found, notes)
        except (CheckpointError, FileNotFoundError):
            # A run writing into out_dir pruned the set while it was read (its manifest goes first):
            # its newer set is complete by then, so read that one.
            if found.manifest is None or os.path.isfile(found.file(MANIFEST)):
                raise
    raise CheckpointError(f"the checkpoint sets of {out_dir} were removed three times while being read: a run "
                          f"writing there prunes them (keep_checkpoints); read it once that run stopped")


def _read_found(found, notes):
    from nanofp8.parallel import merge_tp_state_dicts

    if found.dcp:  # engine=torch's DCP shards
        from nanofp8.torchstack import META as torchstack_meta, read_dcp_set

        state, meta = read_dcp_set(found)
        layout = dict(tensor_parallel=meta["config"].get("tensor_parallel", 1), pipeline_parallel=1, zero_world=None)
        return state, dict(model_args=meta["model_args"], config=meta["config"], iter_num=meta["iter_num"],
                           best_val_loss=meta.get("best_val_loss", float("inf")),
                           files=[found.file(f) for f in (torchstack_meta, "dcp")],
                           precision=meta["config"]["precision"], notes=notes, layout=layout)
    names = [f for f in found.files if not SHARD_FILE.fullmatch(f)]  # the model files (with_shards reads the rest)
    files = [found.file(f) for f in names]
    stages = {}
    first = None
    for name, path in zip(names, files):
        ckpt = with_shards(load_checkpoint(path, map_location="cpu", expect=found.expected(name)), found)
        first = first or ckpt
        if ckpt["iter_num"] != first["iter_num"]:
            raise CheckpointError(f"the checkpoints in {found.path} are from different iterations "
                                  f"({first['iter_num']} and {ckpt['iter_num']}): not one model")
        m = re.search(r"ckpt-tp(\d+)-pp(\d+)\.pt$", path)
        t, p = (int(m[1]), int(m[2])) if m else (0, 0)
        stages.setdefault(p, {})[t] = _resolve(ckpt, path, notes)
    cfg = first["config"]
    tp, pp = cfg.get("tensor_parallel", 1), cfg.get("pipeline_parallel", 1)
    for p in range(pp):
        missing = [t for t in range(tp) if t not in stages.get(p, {})]
        if missing:
            raise CheckpointError(f"{found.path} was written with tensor_parallel={tp}, pipeline_parallel="
                                  f"{pp}: ckpt-tp{missing[0]}-pp{p}.pt is missing")
    config = GPTConfig(**first["model_args"])
    state = {}
    for p in sorted(stages):  # the stages hold disjoint blocks (and both copies of a tied table)
        ranks = [stages[p][t] for t in range(tp)]
        state.update(merge_tp_state_dicts(ranks, config) if tp > 1 else ranks[0])
    info = dict(model_args=first["model_args"], config=cfg, iter_num=first["iter_num"],
                best_val_loss=first.get("best_val_loss", float("inf")), files=files,
                precision=cfg["precision"], notes=notes,
                layout=_layout(first))
    return state, info


def _layout(ckpt):
    cfg, opt = ckpt["config"], ckpt.get("optimizer")
    shards = (opt.get("zero_shards") or opt.get("zero_shard_files")) if isinstance(opt, dict) else None
    return dict(tensor_parallel=cfg.get("tensor_parallel", 1), pipeline_parallel=cfg.get("pipeline_parallel", 1),
                zero_world=len(shards) if shards else None)


# -----------------------------------------------------------------------------
# 2. Resuming at another level or layout


def same_layout(precision, layout, cfg, world_size):
    """Whether train.py can load the checkpoint as it is: the same level, the same TP/PP cut, and
    for O3 the same number of optimizer shards (other levels replicate their state over the
    data-parallel ranks, so the data-parallel size may change freely)."""
    engine = cfg.get("engine", "nanofp8")
    if precision != cfg["precision"] or layout.get("engine", "nanofp8") != engine:
        return False
    if engine == "torch":  # DCP re-cuts the shards for any data-parallel size
        return layout["tensor_parallel"] == cfg["tensor_parallel"]
    if any(layout[k] != cfg[k] for k in ("tensor_parallel", "pipeline_parallel")):
        return False
    if precision == "O3":
        return layout["zero_world"] == world_size // (cfg["tensor_parallel"] * cfg["pipeline_parallel"])
    return True


def describe_layout(precision, tp, pp, world):
    cut = [f"{k}={v}" for k, v in (("tensor_parallel", tp), ("pipeline_parallel", pp)) if v > 1]
    if precision == "O3":
        cut.append(f"{world} ZeRO shard{'' if world == 1 else 's'}")
    return f"precision={precision}" + (f" ({', '.join(cut)})" if cut else "")


def resume_from(out_dir, cfg, world_size):
    """What train.py needs to resume from out_dir's checkpoint at cfg's level and layout.

    Returns None when the checkpoint fits as it is (train.py's exact resume applies). Otherwise a
    dict with model (fp32 state_dict of the single-device GPT, to load *before* the level and the
    layout are set up), model_args, iter_num, best_val_loss, moments (for load_moments, or None)
    and note: what carries over and what restarts, for the log."""
    found, _ = find_checkpoint(out_dir)
    if found.manifest is not None:  # the manifest says what wrote the set
        saved_config, saved_layout = found.manifest["config"], found.layout()
    else:  # files of an older nanofp8: one file decides
        head = _peek(found.file(found.files[0]))
        saved_config, saved_layout = head["config"], _layout(head)
        del head
    if same_layout(saved_config["precision"], saved_layout, cfg, world_size):
        return None
    state, info = read_checkpoint(out_dir)
    src = describe_layout(info["precision"], info["layout"]["tensor_parallel"],
                          info["layout"]["pipeline_parallel"], info["layout"]["zero_world"])
    dp = world_size // (cfg["tensor_parallel"] * cfg["pipeline_parallel"])
    dst = describe_layout(cfg["precision"], cfg["tensor_parallel"], cfg["pipeline_parallel"], dp)
    how = {"bf16": "fp32", "O1": "fp32", "O2": "fp32 = fp16 master / scale",
           "O3": "fp32 from the sharded fp16 masters"}[info["precision"]]
    # Moments are keyed by the single-device model's parameters: carried between single-device
    # layouts of any level (O3 counts: its shards are glued back and re-cut), and from engine=torch's
    # DCP sets, which hold whole tensors at any cut; under the hand-written TP/PP the optimizer holds
    # a stage's shards in another order, and the moments restart.
    moments = None
    cut_before = info["layout"]["tensor_parallel"] * info["layout"]["pipeline_parallel"] > 1
    if cfg["tensor_parallel"] * cfg["pipeline_parallel"] == 1:
        if found.dcp:
            from nanofp8.torchstack import read_dcp_moments

            moments = read_dcp_moments(found) or None
        elif not cut_before:
            moments = fp32_moments(with_shards(load_checkpoint(info["files"][0], map_location="cpu",
                                                               expect=found.expected(found.files[0])), found))
    fresh = [] if moments else ["optimizer moments (Adam m and v restart from zero)"]
    if "bf16" not in (info["precision"], cfg["precision"]):
        fresh.append("FP8 scaling state (amax histories)")
    if cfg["dropout"] > 0:
        fresh.append("dropout RNG stream")
    carried = f"weights exactly ({how})" + (", Adam moments (re-stored in the new level's formats)"
                                             if moments else "")
    note = (f"converting the checkpoint of iter {info['iter_num']} ({src}) to {dst}: carried over: "
            f"{carried}; RE-INITIALIZED: {', '.join(fresh) or 'nothing'}; the learning-rate schedule "
            f"continues at iter {info['iter_num']}")
    for extra in info["notes"]:
        note += f"; {extra}"
    return dict(model=state, model_args=info["model_args"], iter_num=info["iter_num"],
                best_val_loss=info["best_val_loss"], moments=moments, note=note, config=saved_config)


# -----------------------------------------------------------------------------
# Any directory: a training run, a portable export, a Hugging Face GPT-2 or LLaMA


HF_READERS = {"gpt2": ("GPT-2", load_hf_gpt2), "llama": ("LLaMA", load_hf_llama)}  # model_type -> reader


def read_any(path):
    """Weights from a directory of any kind -> (fp32 state_dict of the GPT, info): a training run's
    out_dir (its newest complete checkpoint set, any level, any layout) or one set of it, a
    portable export, or a Hugging Face GPT-2 or LLaMA. info: model_args, config (the training run's
    settings, as far as known), iter_num, source, notes."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path!r} is not a directory (expected a training run's out_dir, an "
                              "export, or a Hugging Face GPT-2 or LLaMA)")
    holds_checkpoint = (os.path.isfile(os.path.join(path, MANIFEST)) or legacy_files(path)
                        or any(SET_NAME.fullmatch(f) for f in os.listdir(path)))
    if os.path.isfile(os.path.join(path, "config.json")):
        if holds_checkpoint:
            raise CheckpointError(f"{path} holds both a training run's checkpoints and an export or a "
                                  f"Hugging Face model (config.json): move one of them to its own directory")
        kind = hf_model_type(path)
        if kind in HF_READERS:
            name, reader = HF_READERS[kind]
            state, model_args = reader(path)
            return state, dict(model_args=model_args, config={}, iter_num=None, notes=[],
                               source=f"{path} (Hugging Face {name})")
        if kind is not None:
            raise CheckpointError(f"{path}/config.json: model_type {kind!r}; the Hugging Face models read "
                                  f"here are {', '.join(map(repr, HF_READERS))}")
        state, meta = load_portable(path)
        return state, dict(model_args=GPTConfig(**meta["model_args"]).__dict__, config=meta.get("config", {}),
                           iter_num=meta.get("iter_num"), notes=[], source=f"{path} (portable export)")
    if not holds_checkpoint:
        raise CheckpointError(f"{path} holds no model ({nothing_found(path)}): expected a training run's "
                              f"out_dir or one of its checkpoint sets, an export, or a Hugging Face GPT-2 or "
                              f"LLaMA (config.json + model.safetensors)")
    state, info = read_checkpoint(path)
    src = describe_layout(info["precision"], info["layout"]["tensor_parallel"],
                          info["layout"]["pipeline_parallel"], info["layout"]["zero_world"])
    return state, {**info, "source": f"{', '.join(info['files'])} ({src})"}


def load_pretrained(path):
    """init_from=<dir> -> (fp32 state_dict, model_args); see read_any."""
    state, info = read_any(path)
    return state, info["model_args"]


def load_for_inference(path, device="cpu"):
    """A single-device fp32 GPT in eval mode from any directory read_any reads. Returns (model, info)."""
    from nanofp8.ckptfile import load_model_state

    state, info = read_any(path)
    model = GPT(GPTConfig(**info["model_args"]))
    load_model_state(model, state, path)
    return model.eval().to(device), info


# -----------------------------------------------------------------------------
# 3. Frozen FP8 models


class Fp8WeightLinear(nn.Module):
    """A frozen Linear whose weight lives in FP8: the E4M3 bytes and their scales, nothing else.
    Each forward dequantizes it (one pass over the weight) and runs a matmul in the input's
    dtype (bf16 under autocast). On an FP8 GPU one would hand the bytes to torch._scaled_mm and
    never dequantize; dequantizing keeps it portable and isolates what is measured: the rounding
    of the weights to 3 mantissa bits."""

    def __init__(self, weight, bias, granularity="row"):
        super().__init__()
        # quantize() contracts over the last dim, which for an (out, in) weight is the GEMM's K:
        # "row" gives one scale per output channel, "block" one per 128x128 tile.
        q = quantize(weight.detach().float(), E4M3, granularity, block=(BLOCK, BLOCK))
        self.granularity = granularity
        # Buffers, so .to(device) moves them and they are counted with the model's memory.
        self.register_buffer("weight_fp8", q.data)
        self.register_buffer("weight_scale_inv", q.inv_scale.float())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def dequantized_weight(self, dtype=torch.float32):
        """The weight as fp8.dequantize computes it: fp8 * (1/scale), per row, tile or tensor."""
        s = self.weight_scale_inv
        if self.granularity == "block":
            s = expand_tiles(s, (BLOCK, BLOCK), self.weight_fp8.shape)
        return (self.weight_fp8.float() * s).to(dtype)

    def forward(self, x):
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        bias = None if self.bias is None else self.bias.to(dtype)
        return F.linear(x, self.dequantized_weight(dtype), bias)

    def nbytes(self):
        return sum(t.numel() * t.element_size() for t in (self.weight_fp8, self.weight_scale_inv))


def weight_bytes(model):
    """Bytes of every parameter and buffer (a tied table once)."""
    seen, n = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            n += t.numel() * t.element_size()
    return n


@torch.no_grad()
def freeze_fp8(model, granularity="row"):
    """Turn a trained GPT into a frozen inference model with FP8 weights, in place: every block
    Linear becomes an Fp8WeightLinear (1 byte per weight + fp32 scales), every parameter stops
    requiring gradients, and the model goes to eval mode. Works from any level: O1's Fp8Linear
    and a plain nn.Linear alike (O2/O3 models: load them with load_gpt first, which resolves the
    masters). Returns {"weights": n, "fp32": bytes, "bf16": bytes, "fp8": bytes} of those Linears."""
    stats = {"weights": 0, "fp32": 0, "bf16": 0, "fp8": 0}
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            fqn = f"{name}.{child_name}" if name else child_name
            if isinstance(child, nn.Linear) and fqn.startswith("blocks."):
                w = child.hp_weight() if hasattr(child, "hp_weight") else child.weight
                new = Fp8WeightLinear(w, child.bias, granularity).to(child.weight.device)
                stats["weights"] += w.numel()
                stats["fp32"] += 4 * w.numel()
                stats["bf16"] += 2 * w.numel()
                stats["fp8"] += new.nbytes()
                setattr(module, child_name, new)  # the high-precision weight is now unreferenced
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval(), stats


# -----------------------------------------------------------------------------
# train.py's entry point


def initial_weights(cfg, world_size):
    """Where train.py's weights come from when they are not its own exact checkpoint:

        init_from="resume", a checkpoint of another level or layout: converted (resume_from)
        init_from=<dir>: a portable export or a Hugging Face GPT-2 or LLaMA, fine-tuned from iteration 0

    Returns None for init_from="scratch" and for an exact resume (train.py loads the checkpoint
    itself), else a dict: model (fp32 state_dict to load into the plain GPT before the precision
    level and the layout are set up), model_args, iter_num, best_val_loss, note (for the log)."""
    if cfg["init_from"] == "scratch":
        return None
    if cfg["init_from"] == "resume":
        return resume_from(cfg["out_dir"], cfg, world_size)
    state, model_args = load_pretrained(cfg["init_from"])
    model_args = {**model_args, "dropout": cfg["dropout"]}  # a training choice, not the architecture
    return dict(model=state, model_args=model_args, iter_num=0, best_val_loss=float("inf"), moments=None,
                note=f"fine-tuning the weights of {cfg['init_from']} at precision={cfg['precision']}: "
                     "optimizer state and FP8 scaling state start fresh")
