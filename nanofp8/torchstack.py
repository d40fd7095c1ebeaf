"""
engine="torch": the same GPT, FP8 layers and training loop, scaled on torch's own stack.

nanofp8's hand-written engine (dist.py, zero.py, parallel.py) is the lesson: every byte that
crosses ranks is in view, and O2/O3's precision decoupling lives there. A run that outgrows a
machine wants what torchtitan and torchao's float8 build on instead: FSDP2 (fully_shard), DTensor
tensor parallelism and DCP checkpoints, which compose with the rest of torch (other models,
optimizers, checkpoint tools). engine=torch puts nanofp8's FP8 layers on that stack:

    torchrun --nproc_per_node=8 train.py config/gpt2_fp8.py engine=torch      # FSDP2 over 8 ranks
    torchrun --nproc_per_node=8 train.py config/gpt2_fp8.py engine=torch \\
        tensor_parallel=2 sequence_parallel=True                               # 4 x FSDP2, 2 x TP

1. Data parallelism: FSDP2
--------------------------
fully_shard(block) for every block, then fully_shard(model) for what is left (embeddings, final
norm, LM head): each rank keeps 1/N of every parameter (a DTensor cut along dim 0), of its
gradient and of its Adam moments. A block's weights are all-gathered before its forward and
again before its backward, its gradients reduce-scattered after its backward, at every
micro-step (holding whole gradients until the last one would cost the memory FSDP2 saves). At O1
the FP8 layers' weights travel in FP8 (nanofp8/fsdp.py): each rank casts its shard with scales
all ranks agree on, so the gathered bytes are the FP8 cast of the whole weight, which the forward
and dgrad GEMMs read as they are: a quarter of the fp32 all-gather's bytes (half with row scales,
whose W^T travels as a second copy). torch.compile, of the model or of each block, trains as
eager does there: FSDP2's hooks run between the graphs, which read the gathered FP8 weight
(tests/test_fsdp.py). With TP as well, the weights are DTensors before FSDP2 cuts them, and gather
in fp32.

fsdp_param_dtype=bf16 (mixed_precision below; "auto" on CUDA) is FSDP2's MixedPrecisionPolicy:
the parameters not gathered in FP8 travel and compute in bf16, their gradients reduce in fp32.
data_parallel_replicate=R is FSDP2's HSDP: the dp ranks form R replicas (layout.hsdp_mesh,
("replicate", "shard")), each parameter is sharded within a replica, and the gradients, once
reduce-scattered there, are all-reduced across the replicas. Its all-gathers stay inside a
replica (within a node, where the links are fast); DCP saves each shard once and reads back
at plain FSDP2's layout or another R.

2. Tensor parallelism: DTensor
------------------------------
The cut of parallel.py (its section 1, the same tp_plan): c_attn and c_fc column-parallel, the two
c_proj row-parallel. Every parameter becomes a DTensor over the mesh's "tp" dimension, so that the
optimizer, gradient clipping, FSDP2 and DCP know each tensor's whole shape and which piece lives
where. The GEMMs and their FP8 collectives are parallel.py's TPLinear (an SP all-gather in FP8 with
an agreed scale, partial sums in mp_comm), run on the local shards: torch's own ColwiseParallel
would all-gather the high-precision input and cast it afterwards.

The fused q/k/v weight (3 * n_embd, n_embd) holds [q | k | v]. A rank needs the same heads of all
three: rows that are three slices of the fused matrix, not one DTensor placement. Held as
(3, n_embd, n_embd) and cut along dim 1, they are Shard(1): the checkpoint knows the cut, and a
one-process reader gets the fused matrix back by a reshape. LLaMA's [gate | up] likewise,
(2, hidden, n_embd). With grouped-query attention q has more rows than k and v, and no such
view cuts all three: the whole q/k/v weight is held grouped by key/value head instead,
(n_kv_head, (group + 2) * head_dim, n_embd), each entry a key/value head's query heads, key and
value, and cut along dim 0, Shard(0): a rank's key/value heads with the query heads that read them.
The GEMM reads the local shard regrouped into [q | k | v] rows (a copy of the shard at each
forward), and a one-process reader regroups the whole (grouped_to_rows). Under sequence
parallelism the block norms are torch's SequenceParallel style: each reads its rank's tokens, so
its weight gradient is a Partial sum, summed over the TP ranks in sync_gradients (parallel.py's
sp_partial, here said by the DTensor's placement). Embeddings, final norm and LM head are
replicated DTensors that read and write plain tensors.

3. Checkpoints: DCP
-------------------
A checkpoint set (nanofp8/outdir.py) holds dcp/, written by torch.distributed.checkpoint from
every rank at once, each rank its own shards and no rank another's, and ckpt.pt (settings,
position, every rank's dropout RNG and FP8 scaling state: DCP saves a plain buffer once, one
rank's amax history), written by rank 0. The manifest lists every file with its hash, as for the
hand-written engine, and every reader checks them before DCP reads a byte (check_dcp): DCP's own
files carry no checksum, and a flipped byte would load as a weight. DCP stores each tensor by
name with its whole shape, so a
resume reads the shards it needs at any data-parallel size: FSDP2 over 2 ranks resumes over 1 or
3 with the same weights and Adam moments, bit for bit (tests/test_torchstack.py). Another tensor_parallel, level or
engine goes through nanofp8/checkpoint.py's conversion (weights exact; Adam moments too, read
whole by read_dcp_moments, unless the new layout cuts over tensor or pipeline ranks), and so
do sample.py and export.py: read_dcp_set reads a set in one process into the single-device GPT.

4. What runs where (docs/distributed.md: "Scaling beyond one machine")
----------------------------------------------------------------------
bf16 and O1, FSDP2 and/or TP (+SP). Not here, refused by the config check with the reason:
pipeline parallelism, O2 and O3 (their FP8 weight gradient lives outside .grad, which is all
FSDP2 reduce-scatters; their moments carry a scale per 128 values of a shard, tied to the
layout that cut it), delayed scaling under TP (one amax history per TP rank, which DCP would
save as one replicated tensor), an FP8 LM head under TP, compile=True under TP (its layers' collectives
break the graph), and the FP8 statistics.
"""

import hashlib
import os
import warnings
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

from . import parallel
from .ckptfile import CheckpointError, WriteError, load_checkpoint, root_cause
from .fp8 import Fp8Linear
from .optim import ADAMW_MOMENTS

DCP_DIR, META = "dcp", "ckpt.pt"


def local(t):
    """A DTensor's local piece; a plain tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


# -----------------------------------------------------------------------------
# Tensor parallelism (section 2 above)


def rows_to_grouped(t, group, head_dim):
    """[q | k | v] rows of grouped-query attention (n_kv * group, n_kv and n_kv heads of head_dim;
    a weight or its bias) -> (n_kv, (group + 2) * head_dim, ...): per key/value head, its query
    heads, its key and its value."""
    kv_rows = t.shape[0] // (group + 2)
    q, k, v = t.split([group * kv_rows, kv_rows, kv_rows])
    n_kv, rest = kv_rows // head_dim, t.shape[1:]
    return torch.cat([q.view(n_kv, group * head_dim, *rest), k.view(n_kv, head_dim, *rest),
                      v.view(n_kv, head_dim, *rest)], dim=1)


def grouped_to_rows(t, group):
    """The inverse of rows_to_grouped."""
    head_dim = t.shape[1] // (group + 2)
    return torch.cat([x.reshape(-1, *t.shape[2:]) for x in t.split([group * head_dim, head_dim, head_dim], dim=1)])


class _DTensorShard:
    """What engine=torch adds to parallel.py's TP layers: DTensor parameters. The GEMM reads their
    local shards, fused pieces flattened back into rows."""

    bias_grad = None  # placements of the bias gradient: Partial for a row bias under SP
    q_per_kv = 0  # grouped-query attention's q/k/v, held grouped: query heads per key/value head

    def shard(self):
        w = self.weight.to_local()
        b = None if self.bias is None else self.bias.to_local(grad_placements=self.bias_grad)
        w = grouped_to_rows(w, self.q_per_kv) if self.q_per_kv else w.reshape(-1, w.shape[-1])
        if b is not None:
            b = grouped_to_rows(b, self.q_per_kv) if self.q_per_kv else b.reshape(-1)
        return w, b


class TorchTPLinear(_DTensorShard, parallel.TPLinear):
    """parallel.TPLinear with DTensor parameters (the FP8 levels)."""

    def hp_weight(self):  # (the weight's local rows only: the bias is not cast)
        w = self.weight.to_local()
        return grouped_to_rows(w, self.q_per_kv) if self.q_per_kv else w.reshape(-1, w.shape[-1])


class TorchTPLinearPlain(_DTensorShard, parallel.TPLinearPlain):
    """parallel.TPLinearPlain with DTensor parameters (bf16)."""


def _as_dtensors(mod, mesh, pieces, head_dim):
    """Replace a TP layer's own shards by DTensors of the whole tensors over `mesh` (section 2).
    pieces: tp_plan's (name, rows) of the fused matrices in the layer's weight."""
    w, b = mod.weight.detach(), None if mod.bias is None else mod.bias.detach()
    n = len(pieces)
    if mod.parallel == "row":
        w_place, b_place = Shard(1), Replicate()  # the bias is added once, after the sum
        mod.bias_grad = [Partial()] if mod.sp else None  # under SP a rank sees its own tokens' share
    elif len({rows for _, rows in pieces}) > 1:  # grouped-query q/k/v: per key/value head, Shard(0)
        mod.q_per_kv = pieces[0][1] // pieces[1][1]
        w, b = (None if t is None else rows_to_grouped(t, mod.q_per_kv, head_dim) for t in (w, b))
        w_place = b_place = Shard(0)
    elif n > 1:  # [q | k | v] or [gate | up]: this rank's rows of each piece, Shard(1)
        w, b, w_place, b_place = w.view(n, -1, w.shape[-1]), b if b is None else b.view(n, -1), Shard(1), Shard(1)
    else:
        w_place = b_place = Shard(0)
    mod.weight = nn.Parameter(DTensor.from_local(w, mesh, [w_place], run_check=False))
    if b is not None:
        mod.bias = nn.Parameter(DTensor.from_local(b, mesh, [b_place], run_check=False))


def _replicate(module, mesh):
    """Parameters that every TP rank holds whole, as replicated DTensors; the module reads and
    writes plain tensors (its inputs enter as replicated DTensors, its output leaves as local)."""
    to_dt = lambda t: DTensor.from_local(t, mesh, [Replicate()], run_check=False) if torch.is_tensor(t) else t  # noqa: E731
    distribute_module(module, mesh, input_fn=lambda mod, inputs, m: tuple(to_dt(t) for t in inputs),
                      output_fn=lambda mod, out, m: local(out))


def tensor_parallel(model, mesh, sp, comm):
    """Cut a GPT (precision set up: Fp8Linear at the FP8 levels) over the 1-D mesh `mesh`, in place."""
    tp, rank, group = mesh.size(), mesh.get_local_rank(), mesh.get_group()
    plan = parallel.tp_plan(model.config)
    for i, block in enumerate(model.blocks):
        recipe = getattr(block.attn.c_attn, "recipe", None)

        def make(w, b, cut, name, i=i, recipe=recipe):
            if recipe is None:
                mod = TorchTPLinearPlain(w, b, cut, group, sp, comm)
            else:
                mod = TorchTPLinear(w, b, cut, group, sp, recipe, comm, f"blocks.{i}.{name}")
            _as_dtensors(mod, mesh, plan[name][1], model.config.n_embd // model.config.n_head)
            return mod

        parallel.shard_linears(block, plan, rank, tp, make)
        for norm in (block.norm_1, block.norm_2):
            if sp:  # reads this rank's tokens, a DTensor Shard(1) inside; writes them, plain
                parallelize_module(norm, mesh, SequenceParallel(use_local_output=True))
            else:
                _replicate(norm, mesh)
    _replicate(model.tok_emb, mesh)
    if model.pos_emb is not None:
        _replicate(model.pos_emb, mesh)
    if model.config.tie_embeddings:  # one Parameter for both: a DTensor already, kept as it is
        model.lm_head.weight = model.tok_emb.weight
    _replicate(model.lm_head, mesh)
    _replicate(model.norm_f, mesh)
    if sp:  # the block stack is sequence-parallel: enter and leave it as parallel.parallelize does
        model.blocks[0].register_forward_pre_hook(
            lambda m, args: (parallel._SeqScatter.apply(args[0], group), *args[1:]))
        model.blocks[-1].register_forward_hook(lambda m, args, out: parallel._SeqGather.apply(out, group))
    return model


# -----------------------------------------------------------------------------
# The model of a run: TP, then FSDP2 (section 1); what the training step does differently


def shard_model(model, cfg, layout, comm):
    """This rank's model under engine=torch: cut over the TP ranks (comm: what TP collectives
    send, run.mp_comm_format), then sharded over the data-parallel ranks by FSDP2."""
    from torch.distributed.fsdp import fully_shard

    model.to(layout.device)  # (DTensors are made from the local tensors, on the mesh's device)
    for m in model.modules():  # FSDP2 gathers a new weight at every forward: nothing to cache
        if isinstance(m, Fp8Linear):
            m.cache_weight = False
    if layout.tp > 1:
        tensor_parallel(model, layout.mesh["tp"], cfg["sequence_parallel"], comm)
    if layout.dp > 1:
        if layout.tp == 1 and cfg["precision"] != "bf16":  # (configurator.compile_choice knows it too)
            from .fsdp import fp8_all_gather  # the FP8 weights' all-gather (section 1)

            fp8_all_gather(model)
        mp = mixed_precision(cfg["fsdp_param_dtype"], layout.device_type)
        mesh = layout.mesh["dp"] if layout.hsdp_mesh is None else layout.hsdp_mesh  # (2-D: FSDP2's HSDP)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
    model.engine = "torch"
    return model


def mixed_precision(param_dtype, device_type):
    """FSDP2's MixedPrecisionPolicy for fsdp_param_dtype ("auto": bf16 on CUDA, fp32 elsewhere).
    bf16: each parameter gathered in high precision is cast to bf16 before its all-gather (half
    the bytes of fp32) and computed with in bf16; its gradient is reduce-scattered in fp32 into
    the fp32 shard the optimizer steps. FSDP2 casts a sharded module's inputs to bf16 as well, so
    the residual stream enters each block in bf16. FP8-gathered weights travel in FP8 either way
    (their cast is made from the fp32 shard) and report the policy's dtype, as does their
    gradient. fp32: FSDP2 gathers every parameter as it is stored, and a run computes what one
    process does."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if param_dtype == "auto":
        param_dtype = "bf16" if device_type == "cuda" else "fp32"
    if param_dtype == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def forward_backward(model, batches, layout, autocast, train=True):
    """train.py's micro-step loop, for a model cut over TP ranks (run.pipeline_loss hands it here):
    the mean loss over `batches`, backward of each (train), averaged over the replicas (train)."""
    loss = torch.zeros((), device=layout.device)
    for x, y in batches:
        with autocast:
            micro = model(x, y)[1]  # (the logits not held: see train.py)
        if train:
            (micro / len(batches)).backward()
        loss += micro.detach().float()
    loss = loss / len(batches)
    if train and layout.dp > 1:
        dist.all_reduce(loss, group=layout.dp_group)
        loss = loss / layout.dp
    return loss


@torch.no_grad()
def sync_gradients(model, layout):
    """FSDP2 has reduce-scattered during backward. What is left: the Partial gradients of SP
    (norm gains, row biases), summed over the TP ranks. Returns 1.0 (a NaN reaches the norm)."""
    for p in model.parameters():
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            p.grad = g.redistribute(g.device_mesh, p.placements)
    return torch.ones((), device=layout.device)


@torch.no_grad()
def clip(model, max_norm, layout):
    """Clip by the whole model's gradient norm, the same on every rank. Each piece of a gradient
    counts once: a DTensor's local piece on the ranks at coordinate 0 of its Replicate mesh
    dimensions, summed in fp64 over all ranks (one all-reduce, as parallel.clip_grad_norm_).
    Returns the norm."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    sq = torch.zeros((), dtype=torch.float64, device=layout.device)
    for g in grads:
        if isinstance(g, DTensor):
            where = g.device_mesh.get_coordinate()
            if any(pl.is_replicate() and c for pl, c in zip(g.placements, where)):
                continue
        sq += local(g).double().pow(2).sum()
    if layout.world > 1:
        dist.all_reduce(sq)
    norm = sq.sqrt().float()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        local(g).mul_(coef)
    return norm


def replicated(p):
    """A parameter every rank holds whole (run.check_replicas compares them; FSDP2's shards and TP's
    cuts differ by design)."""
    return isinstance(p, DTensor) and all(pl.is_replicate() for pl in p.placements)


# -----------------------------------------------------------------------------
# Checkpoints (section 3)


@contextmanager
def _one_process():
    """DCP without a process group warns that it reads or writes in one process: it does."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def _digest(path):
    h, n = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
            n += len(chunk)
    return {"bytes": n, "sha256": h.hexdigest()}


def _reason(error):
    """Why a DCP call failed, in a few words; Ctrl-C or SIGTERM raised again as KeyboardInterrupt.
    DCP gathers every rank's failure, those included, into one CheckpointException, which is a
    BaseException (`except Exception` misses it): the first rank's original exception is read,
    and what is behind it (root_cause: a full disk's OSError, a KeyboardInterrupt)."""
    if isinstance(error, CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]
    cause = root_cause(error)
    if isinstance(cause, KeyboardInterrupt):
        raise KeyboardInterrupt from None
    if isinstance(cause, OSError) and cause.strerror:
        return cause.strerror
    return (str(error).strip().splitlines() or [type(error).__name__])[0].split("] ")[-1][:200]


def write_dcp(model, optimizer, path, layout):
    """Every rank writes its shards into path/dcp (a collective). Returns [(name, {"bytes",
    "sha256"})] of the files this rank wrote, for the set's manifest (rank 0: the metadata too).
    A failed write is a WriteError (a full disk: its reason), Ctrl-C or SIGTERM a KeyboardInterrupt,
    whatever DCP wrapped them in."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    where = os.path.join(path, DCP_DIR)
    try:
        with _one_process():
            dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=where)
    except (Exception, CheckpointException) as e:
        raise WriteError(f"cannot write {where}: {_reason(e)}") from None
    mine = sorted(f for f in os.listdir(where) if f.startswith(f"__{layout.rank}_"))
    if layout.master:
        mine.append(".metadata")
    return [(f"{DCP_DIR}/{f}", _digest(os.path.join(where, f))) for f in mine]


def check_dcp(found, rank=0, world=1):
    """Check a set's DCP files against its manifest before DCP reads any of them, as
    load_checkpoint checks the hand-written engine's: every file the manifest lists (rank r of
    `world` checks every world-th, so that each file is read once) has its size and sha256, and
    .metadata names no file the manifest does not list. Returns the problem (one line naming the
    file), or None. A set whose dcp/ was damaged, cut short, or replaced by another run's is
    refused, not loaded: training on from it would write its values into the next set."""
    names = sorted(f for f in found.files if f.startswith(DCP_DIR + "/"))  # (outdir.CheckpointSet.dcp)
    meta = f"{DCP_DIR}/.metadata"
    advice = f"restore it from a copy, or move {found.path} out of the way to use the set before it"
    if meta not in names:
        return f"{found.path}'s manifest lists no {meta}: the set is damaged; move it out of the way to use the set before it"
    for name in names[rank::world]:
        path, want = found.file(name), found.expected(name)
        if not os.path.isfile(path):
            return f"{path} is missing; {advice}"
        got = _digest(path)
        if got["bytes"] != want.get("bytes"):
            return (f"{path} is damaged: it has {got['bytes']:,} bytes, its manifest says {want.get('bytes', 0):,} "
                    f"(cut short or overwritten); {advice}")
        if got["sha256"] != want.get("sha256"):
            return f"{path} is damaged: its sha256 differs from its manifest's (changed or replaced); {advice}"
    if rank == 0:  # (the metadata's hash is checked above: it can be read safely)
        stored = dcp.FileSystemReader(found.file(DCP_DIR)).read_metadata().storage_data.values()
        unlisted = sorted({f"{DCP_DIR}/{s.relative_path}" for s in stored} - set(names))
        if unlisted:
            return (f"{found.file(meta)} names {unlisted[0]}, which {found.path}'s manifest does not list: the set "
                    f"is damaged; move {found.path} out of the way to use the set before it")
    return None


def load_dcp(model, optimizer, ckpt):
    """An exact resume: the model's and optimizer's shards, read from the set's dcp/ whatever the
    data-parallel size that wrote it (DCP reads the pieces each rank's shards need). The files
    were checked against the manifest first (check_dcp, run.resume_point)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    try:
        with _one_process():
            dcp.load(state, checkpoint_id=ckpt["dcp"])
    except (Exception, CheckpointException) as e:
        raise CheckpointError(f"{ckpt['dcp']} cannot be read ({_reason(e)}): resume from an earlier "
                              f"checkpoint") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def _read_whole(found, prefix):
    """{name: tensor} of every tensor of the set's dcp/ whose key starts with `prefix`, read whole
    in one process (the prefix taken off the name), after the files were checked against the
    manifest (check_dcp). Tensors come back in the shapes DCP holds (see _rows)."""
    problem = check_dcp(found)
    if problem:
        raise CheckpointError(problem)
    try:
        reader = dcp.FileSystemReader(found.file(DCP_DIR))
        tensors = {k: m for k, m in reader.read_metadata().state_dict_metadata.items()
                   if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)}
        state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in tensors.items()}
        with _one_process():
            dcp.load(state, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as e:  # (a file that changed after the check)
        raise CheckpointError(f"{found.file(DCP_DIR)} cannot be read ({_reason(e)}): use another "
                              f"checkpoint") from None
    return {k.removeprefix(prefix): v for k, v in state.items()}


def _rows(name, v, group):
    """A parameter (or its moment) as the single-device GPT holds it: [q | k | v] pieces, held as
    (3, n_embd, n_embd) under TP (grouped by key/value head with `group` > 1 query heads per
    key/value head), back into the fused rows."""
    if name.endswith(".weight") and v.dim() == 3 or name.endswith(".bias") and v.dim() == 2:
        v = grouped_to_rows(v, group) if group > 1 and ".attn.c_attn." in name else v.reshape(-1, *v.shape[2:])
    return v.float() if v.is_floating_point() else v


def _group(meta):
    """Query heads per key/value head of the model a set's ckpt.pt describes."""
    from .model import GPTConfig

    c = GPTConfig(**meta["model_args"])
    return c.n_head // c.kv_heads


def read_dcp_set(found):
    """(fp32 state_dict of the single-device GPT, the set's ckpt.pt) from an engine=torch set, in
    one process: every model tensor read whole from its shards, fused pieces reshaped to rows.
    The files are checked against the manifest first (check_dcp): CheckpointError otherwise."""
    meta = load_checkpoint(found.file(META), map_location="cpu", expect=found.expected(META))
    return {k: _rows(k, v, _group(meta)) for k, v in _read_whole(found, "model.").items()}, meta


def read_dcp_moments(found):
    """Adam's state of an engine=torch set as checkpoint.fp32_moments gives it for the hand-written
    engine's: {parameter name: {step, and each moment under its name in optim.ADAMW_MOMENTS}}
    (torch.optim.AdamW's names), fp32, whole, in the single-device GPT's shapes (DCP holds whole
    tensors whatever the TP and FSDP2 cut, so every layout's carry over)."""
    out, meta = {}, load_checkpoint(found.file(META), map_location="cpu", expect=found.expected(META))
    for key, v in _read_whole(found, "optimizer.state.").items():
        name, what = key.rsplit(".", 1)
        out.setdefault(name, {})[what] = v.float().cpu() if what == "step" else _rows(name, v, _group(meta))
    keys = {"step"} | {mo.key for mo in ADAMW_MOMENTS["fp16"].values()}
    return {k: st for k, st in out.items() if keys <= st.keys()}
