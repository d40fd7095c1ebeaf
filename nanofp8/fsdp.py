"""
FP8 weights on the wire under torch's FSDP2, and one call that readies any model for it.

1. What FSDP2 does with a weight
--------------------------------
`fully_shard(module)` cuts every parameter along dim 0 into one piece per rank and keeps only
that piece. Before the module's forward (and again before its backward) it all-gathers the
pieces into the whole weight, runs the module, and frees the whole weight again; after backward
it reduce-scatters the gradient, so each rank gets the sum over ranks of its own piece, which
the optimizer steps. By default the pieces travel as they are stored: 4 bytes a value in fp32.

2. The extension: the weight says what travels
----------------------------------------------
A parameter whose local piece is a tensor subclass with two methods takes over the all-gather:

    fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)
        -> (tensors to all-gather, metadata)    on each rank, from its own piece
    fsdp_post_all_gather(gathered tensors, metadata, param_dtype, out=None)
        -> (the unsharded weight, the tensors FSDP2 frees after use)

Here the piece is an Fp8AllGatherWeight (the fp32 values, which the optimizer steps as usual),
and what travels is its FP8 cast, viewed as uint8 (gloo has no float8 dtype; to NCCL it is the
same bytes). FSDP2 rebuilds the weight as a GatheredFp8Weight: those FP8 bytes and their scales,
shaped like the weight, which Fp8AllGatherLinear hands to its GEMMs as the FP8 weight operand,
cast once, on the rank that owned each row. The weight gradient is a plain fp32 tensor, which
FSDP2 reduce-scatters as it always does. Later all-gathers refill the same buffers and hand the
new scales over (`out`), and the layer reads its operands from the gathered weight on every
forward, whatever cache_weight says: no cast can outlive the all-gather that brought it.
Mixed precision (mp_policy's param_dtype) changes only the dtype the gathered weight reports:
the FP8 cast is always made from the fp32 piece.

3. Why the ranks must agree on one scale
----------------------------------------
A tensor-scaled FP8 weight is bytes plus ONE scale: w ~= byte / scale. The gathered bytes are
the concatenation of every rank's piece, so they are read with one scale; a rank that cast its
piece with a scale of its own (from its own rows' amax) would have its rows read too large or
too small by the ratio of the two scales, with no error. So before the cast every rank measures
the amax of its piece and one MAX all-reduce (4 bytes) gives all of them the amax of the whole
weight. The maximum is exact, so the scale, and then every byte, is what one process casting
the unsharded weight makes: fed the same batch on every rank, training under FSDP2 is bit-exact
with one process (tests/test_fsdp.py holds both claims).

4. Which recipes, and how their scales are agreed
-------------------------------------------------
Every scale is made from amaxes gathered the same way: each rank fills its part of the grid of
amaxes (zeros elsewhere), one MAX all-reduce completes it on every rank, the recipe's scale rule
turns it into scales, and each rank casts its rows with their scales.

  tensor, current scaling: one amax; W^T of the dgrad GEMM is the transpose of the same bytes.
  block (128x128 weight tiles): one amax per tile. Tiles may straddle two ranks' rows, so the
      grid is all-reduced as a whole; W^T is again the transpose of the same bytes.
  row: W is scaled per row along K, and rows stay on their rank. But dgrad contracts over N, so
      W^T needs a scale per column, over every rank's rows: a second FP8 copy travels, cast with
      the all-reduced column amaxes. 2 bytes a value, still half of fp32, and bit-exact (one copy
      with W^T re-cast from FP8 values would round twice). On one rank FSDP2 copies only the
      first tensor a weight hands it, so there the two copies travel as one.
  MX (1x32 tiles): refused. Its tiles do not transpose, so W^T would need a third cast, along
      N, that the all-gather does not send (read transposed, W's bytes have 32x1 tiles: not the
      one-process cast, and not an MX operand). These layers keep the fp32 all-gather.
  delayed scaling: refused. The weight's scale comes from the layer's amax history, which the
      forward pass writes after the cast; agreeing on it would move the history's bookkeeping
      into the all-gather. These layers keep the fp32 all-gather.
  O2/O3 layers (O2Linear, O3Linear) keep weights of their own making; they are left as they are.
  A weight that is a DTensor already (tensor parallel, or sharded) is left too: the subclass
      must be in place before fully_shard cuts the weight.

fp8_all_gather(model) records what it left, and why, in model.fp8_all_gather_left. Where FSDP2
cuts a weight unevenly (17 rows on 2 ranks: 9 + 8), each piece is padded to the longest, as
FSDP2 requires of what an extension sends, and the padding rows are never read.

5. Counting bytes, and one amax all-reduce per step
---------------------------------------------------
Each FP8 all-gather adds its payload to nanofp8.counter's COMM as "fsdp_all_gather_fp8" (the
bytes the rank hands over; (W-1) times that on the wire) and each amax all-reduce as
"fsdp_amax_all_reduce". FSDP2 sends all parameters of a module in one collective; the FP8
pieces ride in it beside the fp32 biases (as uint8 bytes, since the dtypes differ). Those other
parameters are FSDP2's own bytes, which COMM does not see.
By itself each all-gather agrees its weight's amaxes, from the piece about to travel: never
stale, one small all-reduce per weight and all-gather (forward and backward, every micro-step).
agree_amaxes(model) agrees those of all weights in ONE all-reduce instead, kept on each layer
for the all-gathers until the next call; agree_after_steps(optimizer, model) makes the optimizer
call it after every step (train.py does, at engine=torch). The maximum is exact in any grouping,
so the amaxes, scales and bytes are those the all-gathers agree (tests/test_fsdp.py). A
load_state_dict of a layer forgets its agreed amaxes (the next all-gather agrees its own); a
weight written any other way after the call keeps them until the next one: the same on every
rank, so the bytes still agree, but no longer the weight's own amax.
"""

import inspect

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from .counter import COMM
from .fp8 import Fp8Linear, Fp8Tensor, convert_to_fp8, dequantize, measure_amax, quantize

# -----------------------------------------------------------------------------
# 1. The sharded weight: fp32 values that all-gather as FP8

# Ops that keep the subclass: the ones FSDP2 uses to cut, pad, move and copy a piece (its own
# padded buffer must be an Fp8AllGatherWeight too). Any other op, the optimizer's arithmetic
# included, sees the plain fp32 tensor inside and returns plain tensors.
_KEEP = {torch.ops.aten.detach.default, torch.ops.aten.alias.default, torch.ops.aten.view.default,
         torch.ops.aten.slice.Tensor, torch.ops.aten.split.Tensor, torch.ops.aten.narrow.default,
         torch.ops.aten.as_strided.default, torch.ops.aten.empty_like.default,
         torch.ops.aten.new_zeros.default, torch.ops.aten.new_empty.default,
         torch.ops.aten.clone.default, torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default,
         torch.ops.aten._pin_memory.default}


def _wrapper(cls, like, shape=None, dtype=None):
    shape = like.shape if shape is None else shape
    return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype or like.dtype, device=like.device,
                                               requires_grad=like.requires_grad)


class Fp8AllGatherWeight(torch.Tensor):
    """A weight (or FSDP2's piece of one) whose all-gather sends its FP8 cast. `hp` holds the
    values; the recipe comes from the module that owns the parameter."""

    @staticmethod
    def __new__(cls, hp):
        return _wrapper(cls, hp)

    def __init__(self, hp):
        self.hp = hp

    def __repr__(self):
        return f"Fp8AllGatherWeight({self.hp})"

    def __tensor_flatten__(self):
        return ["hp"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Fp8AllGatherWeight(inner["hp"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        args, kwargs = tree_map_only(Fp8AllGatherWeight, lambda t: t.hp, (args, kwargs or {}))
        out = func(*args, **kwargs)
        return tree_map_only(torch.Tensor, Fp8AllGatherWeight, out) if func in _KEEP else out

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        piece, r = self.hp, module.recipe
        n, k = outer_size
        if piece.shape[1:] != (k,):
            raise ValueError(f"{module.fqn}: FP8 all-gathers need FSDP2 to shard weights along dim 0 "
                             f"(its default); drop the shard_placement_fn for this layer")
        group, world, rows, start = _shard_place(mesh, n)
        amaxes = module.agreed_amaxes  # (agree_amaxes, after the optimizer step)
        if amaxes is None:  # the amaxes of the whole weight, agreed here
            amaxes = _agree([_local_amaxes(piece, start, n, k, r)], group, world)[0]
        fmt = r.fwd_fmt
        scales = [r.scale_rule(a, fmt, r.margin, r.power_of_two) for a in amaxes]
        sent = []
        for scale in _piece_scales(scales, start, len(piece), k, r):
            # (a scale per element, or broadcastable to one: quantize multiplies by what it is given)
            data = quantize(piece, fmt, "tensor", scale=scale, amax=amaxes[0]).data if len(piece) else \
                piece.new_empty((0, k), dtype=fmt.dtype)
            sent.append(torch.nn.functional.pad(data.view(torch.uint8), (0, 0, 0, rows - len(piece))))
        nbytes = sum(t.nbytes for t in sent)
        COMM.add("fsdp_all_gather_fp8", nbytes, nbytes * (world - 1), fmt.dtype)
        if world == 1 and len(sent) > 1:  # FSDP2 on one rank copies only the first tensor sent:
            sent = [torch.cat(sent)]  # row scaling's two copies go as one (no rank pads at 1)
        return tuple(sent), (r, (n, k), tuple(scales), tuple(amaxes))

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        recipe, shape, scales, amaxes = metadata
        if out is not None:  # the same buffers, refilled: only the scales are new
            out.set_scales(scales, amaxes)
            return
        copies = 2 if recipe.granularity == "row" else 1
        data = tuple(all_gather_outputs)
        if len(data) < copies:  # (one rank: the copies arrived as one, see fsdp_pre_all_gather)
            data = data[0].chunk(copies)
        t = {"wt_u8": data[1], "scale_t": scales[1], "amax_t": amaxes[1]} if copies == 2 else {}
        w = GatheredFp8Weight(recipe, shape, param_dtype, data[0], scales[0], amaxes[0], **t)
        return w, tuple(all_gather_outputs)


def _shard_place(mesh, n):
    """(group, ranks, rows per piece, first row of this rank's piece) of an (n, k) weight that
    FSDP2 cuts along dim 0 over the last dim of `mesh` (HSDP: (replicate, shard))."""
    dim = mesh.ndim - 1
    world = mesh.size(dim)
    rows = -(-n // world)  # torch.chunk's piece; the last ones may be short or empty
    return mesh.get_group(dim), world, rows, min(mesh.get_local_rank(dim) * rows, n)


def _agree(grids, group, world):
    """Each weight's list of local amax grids (_local_amaxes) -> those of the whole weights: one
    MAX all-reduce for all of them (a max rounds nothing, so it is the same in any grouping)."""
    flat = torch.cat([g.reshape(-1) for gs in grids for g in gs])
    dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
    COMM.add("fsdp_amax_all_reduce", flat.nbytes, flat.nbytes * 2 * (world - 1) / world)
    out, at = [], 0
    for gs in grids:
        out.append([])
        for g in gs:
            out[-1].append(flat[at:at + g.numel()].view(g.shape))
            at += g.numel()
    return out


def _local_amaxes(piece, start, n, k, r):
    """This rank's share of the amax grids of the whole (n, k) weight, zeros where other ranks'
    rows are: one value (tensor), one per 128x128 tile (block), or per row and per column (row)."""
    zeros = piece.new_zeros
    if r.granularity == "tensor":
        return [measure_amax(piece, "tensor", None) if len(piece) else zeros(())]
    if r.granularity == "row":
        rows, cols = zeros(n, 1), zeros(k, 1)
        if len(piece):
            rows[start:start + len(piece)] = measure_amax(piece, "row", None)
            cols = measure_amax(piece.t(), "row", None)
        return [rows, cols]
    br, bc = r.weight_tile
    grid = zeros(-(-n // br), -(-k // bc))
    if len(piece):  # the piece, put where it sits in its tile rows (zeros do not change a max)
        t0, t1 = start // br, -(-(start + len(piece)) // br)
        aligned = zeros((t1 - t0) * br, k)
        aligned[start - t0 * br:start - t0 * br + len(piece)] = piece
        grid[t0:t1] = measure_amax(aligned, "block", (br, bc))
    return [grid]


def _piece_scales(scales, start, rows, k, r):
    """The scales of this rank's rows, one per copy that travels, broadcastable to (rows, k)."""
    if r.granularity == "tensor":
        return [scales[0]]
    if r.granularity == "row":  # W along K (per row), and W cast for W^T (per column)
        return [scales[0][start:start + rows], scales[1].reshape(1, k)]
    br, bc = r.weight_tile
    ti = (torch.arange(rows, device=scales[0].device) + start) // br
    tj = torch.arange(k, device=scales[0].device) // bc
    return [scales[0][ti[:, None], tj]]


# -----------------------------------------------------------------------------
# 2. The gathered weight: FP8 bytes and scales, shaped like the weight


class GatheredFp8Weight(torch.Tensor):
    """The unsharded weight FSDP2 rebuilds from the FP8 all-gather: the bytes (uint8, padded rows
    at the end) and the agreed scales and amaxes of W; for row scaling also those of W cast along
    N, for W^T (`*_t`; None otherwise). gathered_operands(w) gives the FP8 W and W^T of the
    forward and dgrad GEMMs. Any other use sees the dequantized weight.

    A traceable subclass (__tensor_flatten__ names its inner tensors), so that torch.compile
    takes the weight as one input of the graph and reads its bytes and scales from it. A plain
    subclass is not that: dynamo lifts each tensor read off its attributes as an input of its
    own, the weight itself is then no input of the graph, and the gradient the autograd Function
    returns for it is dropped (compiled, the FP8 weights got no gradient and never trained)."""

    @staticmethod
    def __new__(cls, recipe, shape, dtype, w_u8, scale, amax, wt_u8=None, scale_t=None, amax_t=None):
        return _wrapper(cls, w_u8, torch.Size(shape), dtype)

    def __init__(self, recipe, shape, dtype, w_u8, scale, amax, wt_u8=None, scale_t=None, amax_t=None):
        self.recipe, self.w_u8, self.scale, self.amax = recipe, w_u8, scale, amax
        self.wt_u8, self.scale_t, self.amax_t = wt_u8, scale_t, amax_t

    def __repr__(self):
        return f"GatheredFp8Weight(shape={tuple(self.shape)}, recipe={self.recipe})"

    def inner(self):
        """The inner tensors by name (the `*_t` ones where they exist)."""
        names = ("w_u8", "scale", "amax", "wt_u8", "scale_t", "amax_t")
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}

    def __tensor_flatten__(self):
        return list(self.inner()), (self.recipe, self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return GatheredFp8Weight(meta[0], outer_size, meta[1], **inner)

    def set_scales(self, scales, amaxes):
        """A later all-gather's scales and amaxes (it refilled the same byte buffers)."""
        self.scale, self.amax = scales[0], amaxes[0]
        if len(scales) > 1:
            self.scale_t, self.amax_t = scales[1], amaxes[1]

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default,
                    torch.ops.aten.as_strided.default):  # FSDP2's view of its unsharded weight
            w = args[0]
            if func is torch.ops.aten.as_strided.default and tuple(args[1]) != tuple(w.shape):
                raise NotImplementedError(f"GatheredFp8Weight: as_strided to {tuple(args[1])}")
            return GatheredFp8Weight(w.recipe, w.shape, w.dtype, **w.inner())
        args, kwargs = tree_map_only(GatheredFp8Weight, lambda t: dequantize(gathered_operands(t)[0], t.dtype),
                                     (args, kwargs or {}))
        return func(*args, **kwargs)


def gathered_operands(w):
    """FP8 W (N, K) and W^T (K, N) of a GatheredFp8Weight: views of its bytes, with its scales.
    (A function, not a method: compiled, a method of a tensor subclass would be a torch function
    that returns no tensor, and break the graph there.)"""
    n, k = w.shape
    r, fmt = w.recipe, w.recipe.fwd_fmt
    qw_data = w.w_u8[:n].view(fmt.dtype)
    if r.granularity == "row":
        qw = Fp8Tensor(qw_data, w.scale, fmt, "row", (1, k), w.shape, w.dtype, w.amax)
        wt = w.wt_u8[:n].view(fmt.dtype).t()  # W cast with column scales, read transposed: W^T along N
        return qw, Fp8Tensor(wt, w.scale_t, fmt, "row", (1, n), wt.shape, w.dtype, w.amax_t)
    block = (1, k) if r.granularity == "tensor" else tuple(r.weight_tile)
    qw = Fp8Tensor(qw_data, w.scale, fmt, r.granularity, block, w.shape, w.dtype, w.amax)
    return qw, qw.t()


# -----------------------------------------------------------------------------
# 3. The layer, and the calls that set a model up


class Fp8AllGatherLinear(Fp8Linear):
    """An Fp8Linear whose weight all-gathers in FP8 under FSDP2: its GEMMs take the gathered
    FP8 operands as they arrived. Unsharded (one process, before fully_shard) it casts its
    weight itself, on every forward: the same bytes, since one process agrees with itself."""

    # The amaxes of the whole weight, agreed by agree_amaxes for all layers at once after an
    # optimizer step; None: the all-gather agrees them itself. (Kept on the layer, not on the
    # weight's piece: FSDP2 may swap a padded piece for a new tensor at its first forward.)
    agreed_amaxes = None

    def hp_weight(self):
        w = self.weight
        return w.hp if isinstance(w, Fp8AllGatherWeight) else w

    def weight_operands(self):
        w = self.weight
        return gathered_operands(w) if isinstance(w, GatheredFp8Weight) else self.cast_weight()


def _refusal(m, shared=()):
    """Why layer m keeps the fp32 all-gather, or None when its weight can travel in FP8. shared:
    the names of the other modules that hold m's weight Parameter (tied embeddings)."""
    if shared:
        return (f"its weight is also {', '.join(shared)}'s (tied), which reads it in high precision: a weight of "
                f"its own would untie the two")
    if type(m) is not Fp8Linear:
        return f"{type(m).__name__} keeps a weight of its own making (O2/O3)"
    if m.recipe.scaling == "delayed":
        return "delayed scaling: the weight's scale comes from the layer's amax history"
    if {op for op, *_ in m.recipe.operands} & {"w", "w_t"}:
        return ("the recipe casts W or W^T by a rule of its own (Recipe.operands): the all-gather sends the "
                "recipe's casts of W only")
    if m.recipe.granularity == "block" and len(set(m.recipe.weight_tile)) > 1:
        return (f"{m.recipe.grid} tiles {tuple(m.recipe.weight_tile)} do not transpose: W^T needs a cast of its "
                f"own along N, which the all-gather does not send")
    if isinstance(m.weight, DTensor):
        return "the weight is a DTensor already: call fp8_all_gather before fully_shard or TP"
    return None


def _fp8_all_gather_layer(m):
    """An Fp8AllGatherLinear sharing m's buffers (the same scaling state, not a copy), bias and
    settings, its weight's values wrapped in an Fp8AllGatherWeight."""
    new = Fp8AllGatherLinear.from_linear(m, m.recipe, m.fqn)
    for name, buf in m.named_buffers(recurse=False):
        setattr(new, name, buf)
    new.observer, new.cache_weight = m.observer, m.cache_weight
    new.weight = nn.Parameter(Fp8AllGatherWeight(m.weight.data), m.weight.requires_grad)
    new.register_state_dict_post_hook(_plain_weight)
    new.register_load_state_dict_post_hook(_forget_agreed)
    return new


def fp8_all_gather(model):
    """Make every Fp8Linear of `model` all-gather its weight in FP8 under FSDP2, in place (a
    bare Fp8Linear is returned replaced). Call it before fully_shard and before making the
    optimizer: each layer becomes an Fp8AllGatherLinear with a new weight Parameter. The layers
    it leaves at fp32, with the reason, are in the returned module's fp8_all_gather_left."""
    left = {}
    if isinstance(model, Fp8Linear) and not isinstance(model, Fp8AllGatherLinear):
        why = _refusal(model)
        model = model if why else _fp8_all_gather_layer(model)
        left = {model.fqn: why} if why else {}
    holders = {}  # id of a Parameter -> the modules that hold it (two where an LM head is tied)
    for fqn, mod in model.named_modules():
        for p in mod.parameters(recurse=False):
            holders.setdefault(id(p), []).append(fqn)
    for parent_name, parent in list(model.named_modules()):
        for name, m in list(parent.named_children()):
            if not isinstance(m, Fp8Linear) or isinstance(m, Fp8AllGatherLinear):
                continue
            fqn = f"{parent_name}.{name}" if parent_name else name
            shared = [h for h in holders.get(id(m.weight), []) if h != fqn]
            if (why := _refusal(m, shared)) is not None:
                left[fqn] = why
            else:
                setattr(parent, name, _fp8_all_gather_layer(m))
    model.fp8_all_gather_left = left
    return model


@torch.no_grad()
def agree_amaxes(model):
    """Agree the amaxes of every FP8-all-gathered weight of a sharded model now, with one MAX
    all-reduce per mesh (in a model sharded as train.py does: one), where each all-gather would
    send one of its own. The next all-gathers take them as they are, until the next call (or a
    load_state_dict of the layer, which forgets them): call it after every optimizer step, as
    agree_after_steps makes the optimizer do. The same amaxes, so the same scales and bytes, as
    the all-gathers agree; ones left stale by a weight written otherwise are still the same on
    every rank (the bytes agree), only no longer the weight's own amax."""
    by_mesh = {}
    for m in model.modules():
        if not isinstance(m, Fp8AllGatherLinear):
            continue
        m.agreed_amaxes = None  # (a layer left out here agrees its own in the all-gather)
        w = m.weight
        if isinstance(getattr(w, "_local_tensor", None), Fp8AllGatherWeight):  # (sharded by FSDP2)
            by_mesh.setdefault(w.device_mesh, []).append(m)
    for mesh, layers in by_mesh.items():
        grids = []
        for m in layers:
            (n, k), (group, world, rows, start) = m.weight.shape, _shard_place(mesh, m.weight.shape[0])
            piece = m.weight._local_tensor.hp[:n - start]  # (its rows of the weight, never padding)
            grids.append(_local_amaxes(piece, start, n, k, m.recipe))
        for m, amaxes in zip(layers, _agree(grids, group, world)):
            m.agreed_amaxes = amaxes


def agree_after_steps(optimizer, model):
    """Make `optimizer` call agree_amaxes(model) after each of its steps, and agree them now, for
    the first forward; returns the optimizer."""
    optimizer.register_step_post_hook(lambda *_: agree_amaxes(model))
    agree_amaxes(model)
    return optimizer


def _forget_agreed(module, keys):
    """A loaded weight has amaxes of its own: the next all-gather agrees them."""
    module.agreed_amaxes = None


def _plain_weight(module, state_dict, prefix, local_metadata):
    """The state_dict holds the plain fp32 values (sharing storage with the weight, so loading
    into them, as DCP does, loads the weight): no checkpoint ever pickles the subclass."""
    key = prefix + "weight"
    w = state_dict.get(key)
    if isinstance(w, DTensor) and isinstance(w._local_tensor, Fp8AllGatherWeight):
        state_dict[key] = DTensor.from_local(
            w._local_tensor.hp, w.device_mesh, w.placements, run_check=False, shape=w.shape, stride=w.stride())
    elif isinstance(w, Fp8AllGatherWeight):
        state_dict[key] = w.hp


def multiple_of_16(fqn, linear):
    """FP8 GEMMs need both dims of a weight to be multiples of 16 (nanofp8.model's rule)."""
    return linear.in_features % 16 == 0 and linear.out_features % 16 == 0


def convert(module, recipe=None, module_filter_fn=None):
    """torchao's convert_to_float8_training for any nn.Module: swap its nn.Linear layers that
    module_filter_fn(module, fqn) keeps (torchao's order of arguments; it must return a bool) and
    whose dims are multiples of 16 for FP8 layers whose weights all-gather in FP8 under FSDP2.
    Returns the module, ready for fully_shard; no hook after the optimizer step is needed (each
    all-gather agrees its scales; agree_after_steps agrees all of them in one all-reduce per step)."""
    if module_filter_fn is not None:
        try:
            inspect.signature(module_filter_fn).bind(None, None)
        except TypeError:
            raise TypeError(f"module_filter_fn {module_filter_fn!r} must take two arguments, (module, fqn), as "
                            f"torchao's convert_to_float8_training calls it") from None
        except ValueError:  # (a builtin without a signature: called, and judged by what it returns)
            pass

    def keep(fqn, linear):
        if not multiple_of_16(fqn, linear):
            return False
        if module_filter_fn is None:
            return True
        try:
            kept = module_filter_fn(linear, fqn)
        except (TypeError, AttributeError) as e:  # a filter written for (fqn, module)
            raise TypeError(f"module_filter_fn failed on {fqn!r} ({type(e).__name__}: {e}); it is called as "
                            f"module_filter_fn(module, fqn), module first, as torchao calls it") from None
        if not isinstance(kept, bool):
            raise TypeError(f"module_filter_fn returned {kept!r} for {fqn!r}; it must return True or False "
                            f"(it is called as module_filter_fn(module, fqn), as torchao calls it)")
        return kept

    return fp8_all_gather(convert_to_fp8(module, recipe, keep))
