"""
What an O2/O3 layer (nanofp8/optim.py's O2Linear) needs to run under torch.compile as in eager mode.

The FP8 weight, cast once per optimizer step. The step calls refresh_fp8_weight() (through
O2Linear.set_weight) right after it writes the new master; the casts W (N, K) and W^T (K, N) stay
in buffers (not saved: they are made from the master) until the next step. A forward takes them
as they are, also a compiled one: dynamo reads buffers as graph inputs, and the cast stays out of
the graph. (Fp8Linear's own cache is keyed on the weight's version, which only eager code can
read, so it is off under torch.compile.) Eager mode also notices a weight changed some other way
(a load, a copy, a move to another device) and casts again.

The weight gradient, handed over through autograd. O2Linear.take_wgrad runs, under torch.compile,
while dynamo traces the backward, where storing on the weight would be a side effect it cannot
keep in the graph (a graph break around every layer). There the gradient goes to autograd
instead, as the weight's own gradient: scaled by a power of two into fp16 (the weight's dtype;
the scale in a buffer, written in place, which dynamo keeps), and a hook on the weight
(_grad_from_autograd), run by autograd once it has the gradient, hands it back to take_wgrad,
outside the graph. (An FP8 weight, O3, cannot carry it: O3 keeps the graph break.)
"""

import torch

from nanofp8.fp8 import WEIGHT, Fp8Tensor, compute_scale, quantize


class O2CompileParts:
    """O2Linear's parts for torch.compile: the FP8 weight cast by the step (refresh_fp8_weight),
    held in buffers, the operands the GEMMs take from them, and the gradient's way back."""

    @torch.no_grad()
    def refresh_fp8_weight(self, record=True):
        """Cast the weight to FP8 now and keep W and W^T in buffers. record=False (a weight that
        was loaded or moved, not stepped): under delayed scaling, cast with the scale the weight
        last had and record no amax, as the step that made this weight already did (a weight
        never cast in training has no such scale: its own amax makes it, as for a first cast)."""
        r = self.recipe
        if record or r.scaling == "current":
            qw, qwt = self.cast_weight()
        else:
            w = self.hp_weight().detach()
            own = compute_scale(w.abs().amax(), r.fwd_fmt, r.margin, r.power_of_two)
            scale = torch.where(self.history_count[WEIGHT] > 0, self.scale[WEIGHT], own)
            qw = quantize(w, r.fwd_fmt, "tensor", scale=scale)
            qwt = qw.t()
        meta = []
        for name, q in (("fp8_w", qw), ("fp8_wt", qwt)):
            meta.append((q.fmt, q.granularity, q.block, q.data.shape, q.dtype))  # the rest of q
            for key, t in ((name, q.data), (name + "_scale", q.scale)):
                # a new tensor, not a copy into the old one: a graph saved for backward may
                # still hold the old one (autograd would refuse it after an in-place write)
                self.register_buffer(key, t if t is not self.weight_scale else t.clone(), persistent=False)
        self._fp8_meta = tuple(meta)
        self._fp8_key = (self.weight._version, self.weight.data_ptr())
        self._w_cache = None

    def _fp8_operands(self):  # the FP8 W and W^T of refresh_fp8_weight, from its buffers
        return (Fp8Tensor(self.fp8_w, self.fp8_w_scale, *self._fp8_meta[0]),
                Fp8Tensor(self.fp8_wt, self.fp8_wt_scale, *self._fp8_meta[1]))

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
    def _loaded_state(module, incompatible_keys):
        module.refresh_fp8_weight(record=False)  # the loaded weight, with its loaded scale

    @torch.no_grad()
    def _grad_from_autograd(self, weight):
        """The hook of take_wgrad's compiled path: take the gradient back out of .grad."""
        g, weight.grad = weight.grad, None
        if g is not None:  # (autograd also runs it when eager take_wgrad gave it no gradient)
            self.take_wgrad(g.float() * self.wgrad_in_scale.reciprocal())
