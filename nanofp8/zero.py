"""
ZeRO in FP8 (level O3): the optimizer state and the master weights sharded over the data-parallel
ranks, the FP8 weight replicated.

O2 (nanofp8/optim.py) still keeps every optimizer state on every data-parallel rank. O3 shards
the part that is only needed by the update, and keeps only what the GEMMs need everywhere:

  per block-Linear parameter, per rank      bytes
  FP8 weight (E4M3 + one tensor scale)      1        replicated: forward and backward read it
  weight gradient, summed in fp16 (+ scale) 2        full, until the step casts it to FP8 (1 B,
                                                     or 1 B throughout with grad_accum="fp8")
  fp16 master weight (+ scale)              2 / N    sharded: only the update reads it
  Adam m (E4M3 + a scale per 128 values)    1 / N    sharded
  Adam v (fp16 + a scale per 128 values)    2 / N    sharded
                                   total:   3 + 5/N between backward and step (2 + 5/N), plus
                                            the scales of the FP8 gradient, m and v (1/32 B each)

The update is O2's (nanofp8/optim.py): the same bound on m, and stochastic rounding into the
fp16 master shard and the moments, with the noise O2 gives the same elements of the whole weight
(its counter_noise is a function of each element's number: shard_start).

One step: reduce-scatter the FP8 gradients (their bytes go out as they are, with their block
scales: 1 + 1/32 B per parameter on the wire, and the receiver sums in fp32), run AdamW on the
local shard in fp32, then all-gather the updated shards in FP8 (1 B per parameter). For the
gathered bytes to form one valid per-tensor FP8 weight, every rank must quantize its shard with
the same scale: the ranks agree on it with one small MAX all-reduce of the shard amaxes (4
bytes per weight tensor). On a GPU the update and that cast are nanofp8/optim_triton.py's
(update_shards): per param group one launch for the new weights' amaxes, the MAX all-reduce, one
launch that stores m, v, the master and the FP8 shard (every weight's in one buffer), one
all-gather of those buffers, one launch that puts the bytes into the weights.

Shards are cut from each weight flattened: rank r owns values [r*C, (r+1)*C) with
C = held_shard_len(p, N) (whole blocks of 128 values), the tail zero-padded. A checkpoint holds
each rank's state_dict, its own shard, in a file that rank writes itself (nanofp8/run.py), so
no rank ever holds another's. load_state_dict takes it back at the same world size only; at
another size the shards do not line up, and nanofp8/checkpoint.py glues them in one process
(resume_from: the masters and moments, re-cut by the new run).

The collectives are dist.py's; this file adds the O3 layer, its optimizer, and the shared-scale
all-gather that turns the updated shards back into one FP8 weight.
"""

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from . import optim_fused
from .dist import (COMM, Fp8Chunks, _all_gather, all_gather_fp8, any_nonfinite, gather_wgrads,
                   held_grad_chunks, held_shard_len, reduce_scatter_fp8)
from .fp8 import BLOCK, E4M3, Fp8Tensor, compute_scale, dequantize, expand_tiles, measure_amax, quantize
from .optim import Fp8AdamW, O2Linear, convert_to_o2, holds_fp8_grad, state_block, to_fp16_scaled
from .optim_foreach import (count_steps, dequantize_blocks_all, step_chunks, to_fp16_scaled_all, update_decoupled,
                            update_plain)


class O3Linear(O2Linear):
    """Fp8Linear whose `.weight` is the full FP8 (E4M3) weight, stored in the layout the recipe's
    forward GEMM reads: `.weight_scale` is its scale grid (tensor: one scale, row: one per output
    row, block: one per tile of the recipe's weight_tile, 128x128 or MX's 1x32 with E8M0 scales).
    The forward GEMM takes it as it is: the weight is rounded to FP8 once, from the fp32 update
    (re-quantizing a per-tensor FP8 weight with row or block scales would round it twice). The
    dgrad GEMM needs W^T quantized along the output rows: a tensor scale and square tiles
    transpose with the data; row scales and 1xN tiles do not, so there W^T is re-quantized from
    the FP8 weight (a second rounding of the dgrad operand only). The fp16
    master lives, sharded, in ZeroFp8AdamW. The gradient is kept in FP8 on the weight
    (optim.fp8_grad), as for O2."""

    @classmethod
    def from_fp8_linear(cls, lin):
        new = super().from_fp8_linear(lin, cast=False)
        r = lin.recipe
        q = quantize(lin.weight.detach(), E4M3, r.granularity, r.weight_tile, scale_rule=r.scale_rule)
        new.weight = nn.Parameter(q.data.view(lin.weight.shape))
        new.weight_scale = q.scale.clone()  # (the buffer O2 registered, now the recipe's grid)
        new.init_master = lin.weight.detach().float()  # taken (and dropped) by the optimizer
        new.ensure_grad_hook()  # the new weight holds the FP8 gradient
        # The casts a compiled forward reads (eager code would notice the new weight and cast again)
        new.refresh_fp8_weight(record=False)
        return new

    def weight_layout(self):
        """(shape, granularity, block tile, scale rule) of the stored FP8 weight: what
        gather_shared_scale produces."""
        r = self.recipe
        return self.weight.shape, r.granularity, r.weight_tile, r.scale_rule

    def fp8_weight(self):
        """The stored weight as an Fp8Tensor (no copy, no rounding)."""
        g = self.recipe.granularity
        return Fp8Tensor(self.weight.detach(), self.weight_scale, E4M3, g,
                         tuple(self.recipe.weight_tile) if g == "block" else (1, self.weight.shape[1]),
                         self.weight.shape, torch.float32)

    def hp_weight(self):
        return dequantize(self.fp8_weight(), torch.float32)

    def cast_weight(self):
        qw, r = self.fp8_weight(), self.recipe
        if "w_t" not in r.transposes:  # W^T cast anew: scales that do not transpose, or its own cast (fp8.py)
            fmt, granularity, tile = r.casts["w_t"]
            return qw, quantize(self.hp_weight().t(), fmt, granularity, tile, scale_rule=r.scale_rule)
        return qw, qw.t()

    @torch.no_grad()
    def set_fp8_weight(self, data, scale):
        self.weight.copy_(data.view(self.weight.shape))
        self.weight_scale.copy_(scale)
        self.weight_changed()


def convert_to_o3(model):
    """Swap every Fp8Linear of the model for an O3Linear."""
    return convert_to_o2(model, O3Linear)


class ZeroFp8AdamW(Fp8AdamW):
    """AdamW for level O3 over a model converted with convert_to_o3: O3Linear weights sharded as
    above, every other parameter replicated with fp32 AdamW state (average their .grad first,
    e.g. with Fp8DataParallel(model, params=other_params(model))).

        loss.backward()
        ok = dp.sync_gradients()          # the replicated parameters
        opt.step(grads_finite=ok)         # reduce-scatter, update shards, all-gather FP8 weights
        opt.zero_grad()

    With dp = Fp8DataParallel(model, wgrads="reduce_scatter") the reduce-scatter runs during
    backward instead: opt.step(grads_finite=ok, shards=dp.take_wgrad_shards()) (the same bits).
    """

    _prepared = None  # (gradient shards, replicated gradients, clipping factor) of prepare_step
    sharded = True  # (Fp8AdamW.sharded)

    def __init__(self, params, model, group=None, v_format="fp16", **kw):
        if kw.get("fused"):
            raise ValueError("fused=True compiles O2's step; O3 steps its shards on the foreach path: "
                             "leave fused unset")
        self.group, self.world = group, dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        super().__init__(params, model, v_format=v_format, **kw)
        self.o2 = {m.weight: m for m in model.modules() if isinstance(m, O3Linear)}
        for p, m in self.o2.items():  # each rank builds its master shard from the fp32 weight
            c = held_shard_len(p, self.world)
            full = F.pad(m.__dict__.pop("init_master").to(p.device).reshape(-1), (0, self.world * c - p.numel()))
            self.init_state(p, like=torch.zeros(c, device=p.device))
            st = self.state[p]
            st["master"], st["master_scale"] = to_fp16_scaled(full[self.rank * c : (self.rank + 1) * c])

    def state_keys(self, p):
        return super().state_keys(p) | ({"master", "master_scale"} if p in self.o2 else set())

    def shard_start(self, p):
        return self.rank * held_shard_len(p, self.world) if p in self.o2 else 0

    def state_dict(self):
        sd = super().state_dict()
        sd["zero"] = {"world_size": self.world, "rank": self.rank}
        return sd

    def load_state_dict(self, state_dict):
        zero = state_dict.get("zero", {})
        if zero.get("world_size") != self.world or zero.get("rank") != self.rank:
            raise ValueError(f"this optimizer state is the shard of rank {zero.get('rank')} of "
                             f"{zero.get('world_size')}; this is rank {self.rank} of {self.world}. "
                             "O3 state resumes only at the world size it was saved with.")
        params = [p for g in self.param_groups for p in g["params"]]
        for i, st in state_dict["state"].items():
            p = params[i]
            if p in self.o2 and "master" in st and st["master"].numel() != held_shard_len(p, self.world):
                raise ValueError(f"this O3 state holds shards of {st['master'].numel()} values of a weight "
                                 f"of {p.numel()}; this version cuts it into shards of whole blocks of "
                                 f"{state_block(p.numel())} values ({held_shard_len(p, self.world)}); its "
                                 "weights still load (train.py init_from=<its out_dir> gathers the masters)")
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "zero"})

    @torch.no_grad()
    def step(self, closure=None, grads_finite=True, max_norm=float("inf"), shards=None, verdict=None):
        """One O3 step; returns whether it was taken. grads_finite: the verdict on the replicated
        parameters' gradients (from Fp8DataParallel.sync_gradients; a bool, or a device tensor
        1.0/0.0). max_norm: clip the global gradient norm (kept in self.grad_norm), computed from
        the reduced shards. shards: the averaged fp32 gradient shards, {weight: shard}, where the
        data-parallel wrapper already reduce-scattered them during backward
        (Fp8DataParallel(wgrads="reduce_scatter").take_wgrad_shards()); None: reduce-scatter the
        FP8 gradients here (the same bits).

        The step needs one device sync, to read whether every rank's gradients are finite. A
        caller with values of its own to read (train.py: the norm, the weights' check) calls
        prepare_step(...) first, reads its flag with them in one copy, and passes what it read
        as `verdict` (then the other arguments are not used)."""
        if verdict is None:
            verdict = bool(self.prepare_step(grads_finite, max_norm, shards))
        shards, others, coef = self._prepared
        self._prepared = None
        if not verdict:
            self.skipped_steps += 1
            return False
        for dtype in {t.dtype for t in others}:
            torch._foreach_mul_([t for t in others if t.dtype == dtype], coef.to(dtype))
        return self._update(shards, coef)

    @torch.no_grad()
    def prepare_step(self, grads_finite=True, max_norm=float("inf"), shards=None):
        """The half of step() before its decision: every collective, no device sync. Returns the
        flag, the same on every rank: a 0-dim device tensor, 1.0 to step, 0.0 to skip."""
        held, reduced = list(self.o2), shards  # the O3 weights, whose gradients are fp8_grad
        # 1. reduce-scatter the FP8 gradients, all launched before any is waited for
        pending = [reduce_scatter_fp8(held_grad_chunks(p, self.world), self.group, op="mean",
                                      out_dtype=torch.float32, async_op=True)
                   for p in (held if reduced is None else ())]
        shards = [pd.wait() for pd in pending] if reduced is None else [reduced[p] for p in held]
        # A reduce-scatter shows a NaN only to the shard's owner: ask every rank (one flag).
        others = [p.grad for g in self.param_groups for p in g["params"] if p not in self.o2 and p.grad is not None]
        # The global norm: the shards' squares summed over the ranks (one all-reduce), plus the
        # replicated gradients (already averaged, the same on every rank: counted once).
        sq = _sum_squares(shards, shards[0].device if shards else None)
        if self.world > 1:
            dist.all_reduce(sq, group=self.group)
            COMM.add("grad_norm", sq.nbytes, sq.nbytes * 2 * (self.world - 1) / self.world)
        sq = sq + _sum_squares(others, sq.device)
        self.grad_norm = sq.sqrt()
        # Every rank asks (the same collectives on every rank, whatever its local verdict), and
        # the caller's verdict and the norm are folded into the one flag, so all ranks skip or
        # step together. The norm is the finiteness check: an inf or NaN in any shard of any rank,
        # or among the replicated gradients, makes it non-finite (through the sum), and so does a
        # square that overflows fp32 (a step no one should take either).
        mine = torch.as_tensor(grads_finite, dtype=torch.float32, device=self.grad_norm.device)
        flags = [torch.where(mine > 0, self.grad_norm, torch.nan)]
        self._prepared = (shards, others, torch.clamp(max_norm / (self.grad_norm + 1e-6), max=1.0))
        return 1.0 - any_nonfinite(flags, self.group)

    def _update(self, shards, coef):
        # 2. AdamW on the local shards: O2's update (Fp8AdamW.update, or its foreach twin), each
        # shard's fp16 master kept in the state; the replicated parameters as O2 updates them
        shard = dict(zip(self.o2, shards))
        number = {p: i for i, p in enumerate(p for group in self.param_groups for p in group["params"])}
        new = []
        for group in self.param_groups:
            mine = [p for p in group["params"] if p in self.o2]
            update_plain(self, group, [p for p in group["params"] if p not in self.o2 and p.grad is not None])
            mine = self._step_on_triton(group, mine, shard, coef, number)  # (on a GPU: steps 2 and 3)
            for p in mine:
                shard[p].mul_(coef)  # (the clipping)
            for i, j in step_chunks([shard[p] for p in mine]):  # (runs that bound the temporaries)
                part, sts = mine[i:j], [self.state[p] for p in mine[i:j]]
                gs = [shard[p] for p in part]
                ws = dequantize_blocks_all([st["master"] for st in sts], [st["master_scale"] for st in sts])
                ws, noises = update_decoupled(self, group, [number[p] for p in part], part, ws, gs)
                for st, (master, scale) in zip(sts, to_fp16_scaled_all(ws, noises)):
                    st["master"], st["master_scale"] = master, scale
                new += list(zip(part, ws))
        # 3. all-gather the new weights in FP8, under one scale per weight
        layouts = [self.o2[p].weight_layout() for p, _ in new]
        gathered = gather_shared_scale([w for _, w in new], self.group, layouts=layouts)
        for (p, _), (data, s) in zip(new, gathered):
            self.o2[p].set_fp8_weight(data[: p.numel()], s)
        return True

    def _step_on_triton(self, group, mine, shard, coef, number):
        """Steps 2 and 3 for the weights of `mine` that nanofp8/optim_triton.py's kernels take (on a
        GPU, where optim_fused.runs_on_triton): its launches, with this file's two collectives
        between them (the MAX all-reduce of the new amaxes, one all-gather of every weight's FP8
        shard); the update below to within the roundings a compiler may fuse (tests/test_optim_triton.py).
        Returns the weights left to step here.
        A kernel that fails the first time (a GPU's toolchain) costs a warning, and the foreach step."""
        if not mine or self.fused_triton is False or not optim_fused.runs_on_triton(mine[0]):
            return mine
        try:
            from nanofp8 import optim_triton  # (Triton and kernels.py: imported where they run)
            on = [p for p in mine if optim_triton.steps_shard(self, self.o2[p], shard[p])]
        except ImportError as e:
            on, self.fused_triton = [], self._triton_failed(e)
        if not on:
            return mine
        steps = [self.state[p]["step"] for p in on]
        try:
            send, place = optim_triton.update_shards(
                self, group, on, [shard[p] for p in on], coef, count_steps([self.state[p] for p in on]),
                [number[p] for p in on], optim_fused.step_numbers,
                lambda amax: max_over_ranks(amax, self.group))
        except Exception as e:  # (a kernel's compile, before it wrote any state: on every rank alike)
            if self.fused_triton:
                raise
            torch._foreach_sub_(steps, 1)
            self.fused_triton = self._triton_failed(e)
            return mine
        place(self._gather_rows(send))
        self.fused_triton = True
        taken = {id(p) for p in on}
        return [p for p in mine if id(p) not in taken]

    @staticmethod
    def _triton_failed(e):
        warnings.warn(f"nanofp8: the O3 step's Triton kernels failed ({type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else ''}); the shards take the foreach step")
        return False

    def _gather_rows(self, send):
        """Every rank's bytes `send` (its FP8 shards of a group's weights), one row per rank."""
        recv = send.new_empty(self.world * send.numel())
        _all_gather(recv, send, group=self.group)
        COMM.add("all_gather_fp8", send.nbytes, send.nbytes * (self.world - 1), torch.float8_e4m3fn)
        return recv.view(self.world, -1)


def _sum_squares(tensors, device):
    """The sum of the squares of every value of `tensors`, in fp32: their norms in one multi-tensor
    reduction (a GPU launches one kernel for all of them), squared and added."""
    if not tensors:
        return torch.zeros((), device=device)
    return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32)).square().sum()


def _shard_amax(w, shape, granularity, lo, block=(BLOCK, BLOCK)):
    """The amax of every scale's values among this rank's flat shard `w`: the values
    [lo, lo + len(w)) of a matrix of `shape` (N, K) flattened, zero-padded past N * K (padding is
    not counted). Returns (amax grid, the scale grid -> one scale per value of w). A tensor scale
    covers the matrix, a row scale a row, a block scale a `block` tile; the shard is laid
    into the whole rows of tiles it touches (zeros elsewhere), so fp8.py's tile amax and
    expand_tiles apply as they do to a whole weight."""
    (N, K), c = shape, w.numel()
    n = max(0, min(c, N * K - lo))  # this rank's values that are the matrix's (not padding)
    tile = {"tensor": (N, K), "row": (1, K), "block": tuple(block)}[granularity]
    grid = () if granularity == "tensor" else (-(-N // tile[0]), -(-K // tile[1]))
    amax = w.new_zeros(grid if grid else (1, 1))
    if granularity == "tensor":
        amax = torch.maximum(amax, w[:n].abs().amax()) if n else amax
        return amax.view(grid), lambda s: F.pad(s.reshape(1).expand(n), (0, c - n), value=1.0)
    r0 = min(lo // K, N) // tile[0] * tile[0]  # the first row of the first tile the shard touches
    r1 = -(-(lo + n) // K) if n else r0
    window = F.pad(w[:n], (lo - r0 * K, r1 * K - lo - n)).view(r1 - r0, K) if n else None
    if n:
        amax[r0 // tile[0] :][: -(-(r1 - r0) // tile[0])] = measure_amax(window, "block", tile)

    def per_value(s):  # (padding: scale 1, its values are 0)
        if not n:
            return s.new_ones(c)
        el = expand_tiles(s[r0 // tile[0] :], tile, (r1 - r0, K)).reshape(-1)[lo - r0 * K :][:n]
        return F.pad(el, (0, c - n), value=1.0)

    return amax, per_value


def max_over_ranks(amax, group=None):
    """The amaxes of every rank's shards, the largest of each over the ranks (one MAX all-reduce,
    in place): what the shared scales are made of. Returns amax."""
    world = dist.get_world_size(group)
    if world > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        COMM.add("all_reduce_amax", amax.nbytes, amax.nbytes * 2 * (world - 1) / world)
    return amax


def gather_shared_scale(shards, group=None, fmt=E4M3, layouts=None):
    """All-gather flat fp32 shards (one per tensor, this rank's part of the tensor flattened and
    zero-padded to world * shard length) as FP8 under scales every rank agrees on: one MAX
    all-reduce of the amaxes of every scale's values (each rank contributes its part), then each
    rank quantizes its shard with the common scales and the bytes are gathered. The result is a
    valid FP8 tensor on every rank, bit-identical everywhere, and bit-identical to quantizing the
    whole tensor at once (tests/test_comm.py).
    layouts: per shard, (shape, granularity[, block tile[, scale rule]]) of the whole tensor: "tensor"
    (one scale), "row" (one per row) or "block" (one per tile); None: one scale per tensor.
    Returns [(flat FP8 data of world * shard length, scale grid: fp32, or E8M0 under MX's rule)]."""
    if not shards:
        return []
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    layouts = [(*lay, *((BLOCK, BLOCK), compute_scale)[len(lay) - 2:]) if lay else  # (defaults)
               ((1, world * w.numel()), "tensor", None, compute_scale) for w, lay in zip(shards, layouts or [None] * len(shards))]
    grids = [_shard_amax(w.detach().reshape(-1).float(), shape, g, rank * w.numel(), tile)
             for w, (shape, g, tile, _) in zip(shards, layouts)]
    amax = max_over_ranks(torch.cat([a.reshape(-1) for a, _ in grids]), group)
    scales = [lay[3](a, fmt).view(g.shape)  # (the rule is elementwise: per tensor as at once)
              for a, (g, _), lay in zip(amax.split([g.numel() for g, _ in grids]), grids, layouts)]
    pending = []
    for w, (_, per_value), s in zip(shards, grids, scales):
        q = quantize(w.view(1, -1), fmt, scale=per_value(s.float()).view(1, -1))
        pending.append(all_gather_fp8(Fp8Chunks(q.data, torch.ones(1, 1, device=s.device), w.numel()),
                                      group, keep_fp8=True, async_op=True))
    return [(pd.wait().data.reshape(-1), s) for pd, s in zip(pending, scales)]


@torch.no_grad()
def sync_fp8_wgrads(params, group=None):
    """Data parallelism for O2, after backward: average the FP8 weight gradients that the O2
    weights among `params` hold outside autograd (fp8_grad; Fp8DataParallel(params=...) handles the rest;
    Fp8DataParallel(wgrads="all_reduce") does this too, overlapped with backward, to the same
    bits). Reduce-scatter the FP8 bytes as they are (1 B per parameter out, and a scale per 128
    values), sum in fp32, all-gather the averaged shards in FP8 with a scale per 128 values (1 B
    per parameter back, and the scales): each weight's fp8_grad becomes the same FP8 tensor on
    every rank. A NaN anywhere reaches every rank through the sum and the gather. A weight without a gradient on some rank counts as zero there
    (and gets the average everywhere)."""
    world = dist.get_world_size(group)
    # Every weight, with or without a gradient on this rank: a rank that skipped a layer must
    # still issue the same collectives as the others (it sends zeros), or the ranks deadlock.
    params = [p for p in params if holds_fp8_grad(p)]
    pending = [reduce_scatter_fp8(held_grad_chunks(p, world), group, op="mean", out_dtype=torch.float32,
                                  async_op=True) for p in params]
    gather_wgrads(params, [pd.wait() for pd in pending], group)
