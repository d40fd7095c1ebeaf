"""
The FP8 weight cast once per optimizer step, also under torch.compile; and what an O2/O3 layer
(nanofp8/optim.py's O2Linear) needs to run under torch.compile as in eager mode.

The FP8 weight, cast once per optimizer step, at every level. Right after the step writes the
weights, the casts W (N, K) and W^T (K, N) are made and kept in buffers (not saved: they are made
from the weight) until the next step: O2/O3's step calls refresh_fp8_weight() once it has written
the new weight; at O1, train.py's optimizer calls cast_for_step() after torch's AdamW. A
forward takes them as they are, also a compiled one: dynamo reads buffers as graph inputs, so the
compiled graph of a micro-step holds no weight cast (its amax, scale and two FP8 copies: about a
third of an FP8 block's kernels at GPT-2 width). (Fp8Linear's own cache is keyed on the weight's
version, which only eager code can read.) Eager mode also notices a weight changed some other way
(a load, a copy, a move to another device) and casts again; a compiled forward cannot, which is
why the cast is made by whoever writes the weight, and again after a load (_loaded_state).

The weight gradient, handed over through autograd. O2Linear.take_wgrad runs, under torch.compile,
while dynamo traces the backward, where storing on the weight would be a side effect it cannot
keep in the graph (a graph break around every layer). There the gradient goes to autograd
instead, in fp32 as the GEMM wrote it, as the gradient of the layer's sink (an fp32 stand-in of
the weight that the Function takes in its place: O2Linear.ensure_grad_hook), and the sink's hook
(_grad_from_autograd), run by autograd once it has the gradient, hands it back to take_wgrad,
outside the graph: no kernel in the graph, the same sum as eager mode's.

Delayed scaling's amax histories, updated after the graph. A compiled graph records each cast's
amax in the layer's cast_log (one small write) and takes its scale as an input; push_amaxes puts
the recorded amaxes into the histories after the graph (train.py calls it after each backward),
where updating them inside it cost several small kernels per cast (nanofp8/fp8.py,
Fp8Linear.delayed_quantize). On a GPU the step's casts run compiled (compiled_or_eager): one
call for all layers instead of a loop of small launches; the pushes take one Triton launch for all
layers (nanofp8/history_triton.py), or where its kernel does not take them, compiled too.
"""

import warnings

import torch

from nanofp8.fp8 import WEIGHT, Fp8Linear, Fp8Tensor, compute_scale, quantize


def keep_cast(layer, qw, qwt):
    """Keep the FP8 W and W^T of a layer in its buffers fp8_w, fp8_wt (and their scales)."""
    meta, own = [], {id(b) for b in layer.buffers()}
    for name, q in (("fp8_w", qw), ("fp8_wt", qwt)):
        meta.append((q.fmt, q.granularity, q.block, q.data.shape, q.dtype))  # the rest of q
        # the inverse scales too (what the GEMMs multiply by): a compiled graph that made them
        # would launch a kernel for each, twice per layer and micro-step
        for key, t in ((name, q.data), (name + "_scale", q.scale), (name + "_inv", q.inv_scale)):
            # a new tensor, not a copy into the old one: a graph saved for backward may still
            # hold the old one (autograd would refuse it after an in-place write); never a buffer
            # the layer has already (an O2 weight's scale can be its W's)
            layer.register_buffer(key, t if id(t) not in own else t.clone(), persistent=False)
            own.add(id(layer._buffers[key]))
    layer._fp8_meta = tuple(meta)
    if layer.bias is not None:  # and the bias in bf16, autocast's dtype in train.py, that the
        # forward GEMM adds (Fp8Linear.gemm_bias; a cast of its own would be a kernel per layer
        # and micro-step). An O2 step writes the biases after its weights' casts: O2CompileParts.keep_biases.
        layer.register_buffer("gemm_bias_kept", layer.bias.detach().to(torch.bfloat16), persistent=False)


def kept_operands(layer):
    """The FP8 W and W^T that keep_cast kept."""
    return (Fp8Tensor(layer.fp8_w, layer.fp8_w_scale, *layer._fp8_meta[0], _inv=(layer.fp8_w_scale, layer.fp8_w_inv)),
            Fp8Tensor(layer.fp8_wt, layer.fp8_wt_scale, *layer._fp8_meta[1], _inv=(layer.fp8_wt_scale, layer.fp8_wt_inv)))


@torch.no_grad()
def cast_now(layer, record=True):
    """The FP8 W and W^T of the layer's weight as it is now. record=False (a weight that was loaded
    or moved, not stepped): under delayed scaling, cast with the scale the weight last had and
    record no amax, as the step that made this weight already did (a weight never cast in training
    has no such scale: its own amax makes it, as for a first cast). The same bytes as that step's."""
    r = layer.recipe
    if record or r.scaling == "current":
        return layer.cast_weight()
    w = layer.hp_weight().detach()
    own = compute_scale(w.abs().amax(), r.fwd_fmt, r.margin, r.power_of_two)
    qw = quantize(w, r.fwd_fmt, "tensor", scale=torch.where(layer.history_count[WEIGHT] > 0, layer.scale[WEIGHT], own))
    return qw, qw.t()


@torch.no_grad()
def cast_for_step(model, written=(), record=True):
    """Cast the weight of every Fp8Linear with cache_weight (train.py's O1) to FP8 now, once for
    all the micro-steps of the next optimizer step, compiled or not. written: parameters a fused
    optimizer wrote without bumping their version counters (torch's fused AdamW): bumped first, so
    that eager code sees the new weights too. train.py's AdamW calls it after every step (a step
    post hook: cast_after_steps), and train.py once before the first forward, with record=False
    (the weights were made, or loaded, not stepped); so does a load_state_dict of the layer.

    The first cast of a layer makes its buffers; the next ones write into them, all layers in one
    call (_recast), on a GPU compiled: one Python call and a few fused kernels per weight, where
    a loop of eager casts would spend more time launching them than the GPU spends on them."""
    if written:
        torch.autograd.graph.increment_version(list(written))
    layers = [m for m in model.modules()
              if isinstance(m, Fp8Linear) and m.cache_weight and not isinstance(m, O2CompileParts)]
    kept = [m for m in layers if getattr(m, "_fp8_meta", None) is not None]
    if kept and record and _triton_casts(kept):  # (a load: eager)
        pass
    elif kept and record and _compiled_casts(kept[0]):
        compiled_or_eager(_recast, "the FP8 weight casts of a step", kept, record)
        push_amaxes(kept)  # (delayed scaling: the amaxes the compiled casts recorded)
    elif kept:
        _recast(kept, record)
    for m in layers:
        if getattr(m, "_fp8_meta", None) is None:
            keep_cast(m, *cast_now(m, record))
            m.register_load_state_dict_post_hook(lambda mod, keys: cast_for_step(mod, record=False))
        m._w_cache = ((m.weight._version, m.weight.data_ptr()), kept_operands(m))  # (eager's key)


def _compiled_casts(x):
    """Are the step's casts of this layer (or of this tensor's kind: optim.fp8_grads) compiled?
    On a GPU."""
    return (x.weight if isinstance(x, torch.nn.Module) else x).is_cuda


def _triton_casts(layers):
    """cast_for_step's casts on nanofp8/optim_triton.py's kernels (two launches for all layers,
    the bytes of _recast's), where they run (a GPU) and take these layers (current scaling, one
    scale per tensor); the biases' bf16 copies in one foreach copy. Whether they ran."""
    from nanofp8 import optim_foreach  # (it imports this file)

    if not optim_foreach.triton_takes(layers[0].weight) or optim_foreach.on_triton(  # (current scaling, or
            "the FP8 weight casts of a step",  # delayed: the casts and their pushes, nanofp8/history_triton.py)
            lambda ot: ot.cast_weights(layers) or _history_triton().cast_weights(layers)) is None:
        return False
    biased = [m for m in layers if m.bias is not None]
    if biased:
        torch._foreach_copy_([m.gemm_bias_kept for m in biased], [m.bias for m in biased])
    return True


def _recast(layers, record):
    """The casts of cast_for_step, written into the buffers that keep_cast made (no graph holds
    them between an optimizer step and the next forward)."""
    for m in layers:
        qw, qwt = cast_now(m, record)
        for name, q in (("fp8_w", qw), ("fp8_wt", qwt)):
            for suffix, t in (("", q.data), ("_scale", q.scale), ("_inv", q.inv_scale)):
                getattr(m, name + suffix).copy_(t)
        if m.bias is not None and m.cache_weight:  # (O1's bf16 bias; O2's steps after its weight)
            m.gemm_bias_kept.copy_(m.bias)


@torch.no_grad()
def refresh_all(layers):
    """refresh_fp8_weight for every O2/O3 layer an optimizer step just wrote, in one call: on a GPU
    compiled, as cast_for_step's casts (a weight's cast is a handful of small operators: a loop
    of them per layer launched ~60 kernels per weight). Layers without kept casts yet (a first
    step after a copy) take refresh_fp8_weight itself."""
    kept = [m for m in layers if getattr(m, "_fp8_meta", None) is not None]
    if kept and _compiled_casts(kept[0]):
        compiled_or_eager(_recast, "the FP8 weight casts of a step", kept, True)
        push_amaxes(kept)
    elif kept:
        _recast(kept, True)
    for m in layers:
        if getattr(m, "_fp8_meta", None) is None:
            m.refresh_fp8_weight()
        else:
            m.mark_cast()


_recast.compiled = None


def compiled_or_eager(fn, what, *args):
    """fn(*args), compiled by its first call; if that compile fails, a warning naming `what`, and
    fn runs eagerly from then on (fn.compiled: None before the first call, False after a failure)."""
    if fn.compiled is not False:
        first = fn.compiled is None
        try:
            fn.compiled = fn.compiled or torch.compile(fn)
            return fn.compiled(*args)
        except Exception as e:
            if not first:
                raise
            warnings.warn(f"nanofp8: {what} could not be compiled "
                          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); they run eagerly")
            fn.compiled = False
    return fn(*args)


def push_amaxes(model):
    """Delayed scaling, compiled: a compiled graph records its casts' amaxes (Fp8Linear.cast_log) but
    leaves the histories to this, which train.py calls after each micro-step's backward (and
    cast_for_step after its compiled casts): Fp8Linear.push_amax for every layer of `model` (a
    module, or a list of layers) in training, on a GPU compiled into a few kernels."""
    layers = [m for m in (model.modules() if isinstance(model, torch.nn.Module) else model)
              if isinstance(m, Fp8Linear) and m.recipe.scaling == "delayed" and m.training]
    if layers and _triton_pushes(layers):
        pass
    elif layers and _compiled_casts(layers[0]):
        compiled_or_eager(_push_histories, "the amax history updates", layers)
    elif layers:
        _push_histories(layers)
    for m in layers:
        m.mark_warm()


def _triton_pushes(layers):
    """push_amaxes' pushes in one launch for all layers (nanofp8/history_triton.py), where the
    step's Triton kernels run (a GPU) and take these layers; whether they ran."""
    from nanofp8 import optim_foreach  # (it imports this file)

    return optim_foreach.triton_takes(layers[0].amax_history) and optim_foreach.on_triton(
        "the amax history updates", lambda _: _history_triton().push_histories(layers)) is not None


def _history_triton():
    from nanofp8 import history_triton  # (Triton and kernels.py: imported where they run)
    return history_triton


def _push_histories(layers):
    for m in layers:
        m.push_history()


_push_histories.compiled = None


def cast_once_per_step(model):
    """Turn on cache_weight in every Fp8Linear of the model (train.py at O1): its weight is cast
    once per optimizer step, by cast_for_step, which the optimizer has to call (cast_after_steps)."""
    for m in model.modules():
        if isinstance(m, Fp8Linear):
            m.cache_weight = True


def cast_after_steps(optimizer, model):
    """Make `optimizer` (torch's AdamW, at O1) call cast_for_step after each of its steps; returns it."""
    written = [p for g in optimizer.param_groups for p in g["params"]] if optimizer.defaults.get("fused") else ()
    optimizer.register_step_post_hook(lambda *_: cast_for_step(model, written))
    optimizer.casts_fp8_weights = True
    return optimizer


def bump_if_fused(optimizer):
    """After a step of a fused optimizer (torch's fused AdamW writes the weights without bumping
    their version counters) that does not call cast_for_step itself: bump them, so that eager
    code casts the new weights (a user's own fused AdamW at O1; compiled code needs the hook)."""
    if optimizer.defaults.get("fused") and not getattr(optimizer, "casts_fp8_weights", False):
        torch.autograd.graph.increment_version([p for g in optimizer.param_groups for p in g["params"]])


class O2CompileParts:
    """O2Linear's parts for torch.compile: the FP8 weight cast by the step (refresh_fp8_weight),
    held in buffers, the operands the GEMMs take from them, and the gradient's way back."""

    @torch.no_grad()
    def refresh_fp8_weight(self, record=True):
        """Cast the weight to FP8 now and keep W and W^T in buffers (record: cast_now's)."""
        keep_cast(self, *cast_now(self, record))
        self.mark_cast()

    def mark_cast(self):
        """The kept casts are of the weight as it is now (whoever wrote them: refresh_all too)."""
        self._fp8_key, self._w_cache = (self.weight._version, self.weight.data_ptr()), None

    def _fp8_operands(self):  # the FP8 W and W^T of refresh_fp8_weight, from its buffers
        return kept_operands(self)

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
        """Fp8Linear's call for a weight just written (O3's set_fp8_weight makes it): cast it, once
        for this step."""
        self.refresh_fp8_weight()

    @staticmethod
    @torch.no_grad()
    def keep_biases(layers):
        """The bf16 copies of these O2/O3 layers' biases (keep_cast), made again after an optimizer
        step, which may write a bias after its weight's cast (another param group, or later in
        the loop): one foreach copy for all layers (Fp8AdamW calls it after each step)."""
        kept = [m for m in layers if m.bias is not None and getattr(m, "gemm_bias_kept", None) is not None]
        if kept:
            torch._foreach_copy_([m.gemm_bias_kept for m in kept], [m.bias for m in kept])

    @staticmethod
    def _loaded_state(module, incompatible_keys):
        module.refresh_fp8_weight(record=False)  # the loaded weight, with its loaded scale

    @torch.no_grad()
    def _grad_from_autograd(self, sink):
        """The hook of take_wgrad's compiled path (ensure_grad_hook): dW out of the sink's .grad."""
        g, sink.grad = sink.grad, None
        if g is not None:
            self.take_wgrad(g)
