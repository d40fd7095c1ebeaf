"""
Bucketed overlap: the engine under Fp8DataParallel (dist.py) that starts the gradient reductions
while backward is still running.

Backward produces gradients roughly in reverse order of the forward pass, which is roughly the
reverse of the order in which the parameters were registered. The gradients are flattened into
buckets of about `bucket_mb` MB in that order, so the first buckets fill early: a hook on each
parameter (autograd's post-accumulate-grad hook, or optim.fp8_grad_hook for a weight that holds
its gradient in FP8 outside .grad) marks its gradient final, and once every gradient of the next
bucket is final, the wrapper's launch function starts that bucket's reduction asynchronously.

Buckets are launched strictly in one order, fixed at construction and the same on every rank,
even when gradients become ready in a different order on different ranks: every rank issues the
same collectives in the same sequence (a parameter without a gradient this step holds its bucket,
and all later ones, back until the wrapper launches them after backward). Gradients of different
kinds (FP8, baseline, held FP8) never share a bucket, and `late` parameters (whose gradient is
still changed between backward and the reduction) get buckets of their own, launched last.

Each reduction in flight is a Pending (what dist.py's collectives return with async_op=True).
"""

from .fp8 import Fp8Format


class Pending:
    """A collective in flight (what async_op=True returns). wait() blocks until it is done and
    returns the result. A stage is (work, finish): once `work` completes, finish() computes the
    result, or starts the next collective and returns its Pending (an all-reduce is a
    reduce-scatter, then an all-gather). advance() completes one stage without waiting for the
    next, so a caller can start the all-gathers of many buckets before waiting for any."""

    def __init__(self, work, finish):
        self.work, self.finish = work, finish
        self.done, self.result = False, None

    def advance(self):
        if not self.done:
            if self.work is not None:
                self.work.wait()
            out = self.finish()
            if isinstance(out, Pending):
                self.work, self.finish, self.done, self.result = out.work, out.finish, out.done, out.result
            else:
                self.done, self.result = True, out
        return self

    def wait(self):
        while not self.done:
            self.advance()
        return self.result


class Bucket:
    """Parameters whose gradients travel in one collective, each padded to a multiple of `pad`
    values in the flat buffer (an FP8 bucket pads to its block: a scale never spans two
    parameters, whose gradients can be orders of magnitude apart)."""

    def __init__(self, params, fmt, block, pad, held=False):
        self.params, self.fmt, self.block = params, fmt, block
        self.spans = [-(-p.numel() // pad) * pad for p in params]
        self.held = held  # whether it carries held FP8 gradients (optim.fp8_grad) instead of .grad
        self.ready = set()  # ids of the parameters whose gradient is final for this step
        self.pending = None  # the reduction in flight, once launched


def make_buckets(params, bucket_bytes):
    """Group parameters into lists of about bucket_bytes (of fp32 gradient) each, in the given
    order; a parameter larger than a bucket gets one of its own."""
    buckets, cur, size = [], [], 0
    for p in params:
        if cur and size + 4 * p.numel() > bucket_bytes:
            buckets.append(cur)
            cur, size = [], 0
        cur.append(p)
        size += 4 * p.numel()
    return buckets + ([cur] if cur else [])


def plan_buckets(module, params, held, fp8, late, formats, block, bucket_bytes):
    """The buckets of a data-parallel wrapper, in launch order. params: the parameters reduced
    through .grad; held: the weights whose FP8 gradient is held outside it; fp8: ids of those of
    `params` that travel in FP8; late: ids of the parameters launched last; formats: what each
    kind travels in, {"held": ..., "fp8": ..., "rest": ...} (an Fp8Format pads to `block`)."""
    order = params[::-1]
    if held:  # place the held weights among the others by registration order
        reg = {id(p): i for i, p in enumerate(module.parameters())}
        order = sorted(params + held, key=lambda p: -reg[id(p)])
    held_ids = {id(p) for p in held}
    pos = {id(p): i + (len(order) if id(p) in late else 0) for i, p in enumerate(order)}

    def kind(p):  # (what its gradient travels in, launched late)
        return ("held" if id(p) in held_ids else "fp8" if id(p) in fp8 else "rest", id(p) in late)

    buckets = []
    for k in sorted({kind(p) for p in order}):
        fmt = formats[k[0]]
        pad = block if isinstance(fmt, Fp8Format) else 1
        for ps in make_buckets([p for p in order if kind(p) == k], bucket_bytes):
            buckets.append(Bucket(ps, fmt, block, pad, k[0] == "held"))
    # launched in the order in which their last parameter's gradient comes
    return sorted(buckets, key=lambda b: pos[id(b.params[-1])])


class InOrder:
    """Launches buckets in their fixed order as their gradients become final. ready(p) is the
    gradient hook; launch(index, bucket) is the wrapper's function that starts a reduction.
    While `enabled` is False (the wrapper's no_sync()), hooks do nothing."""

    def __init__(self, buckets, launch):
        self.buckets, self.launch = buckets, launch
        self.of = {id(p): b for b in buckets for p in b.params}
        self.next = 0  # index of the next bucket to launch
        self.enabled = True

    def ready(self, p):  # (.grad and fp8_grad alike: p's gradient for this micro-step is in)
        if not self.enabled:
            return
        bucket = self.of[id(p)]
        if bucket.pending is not None:
            raise RuntimeError("a gradient changed after its bucket was sent: call "
                               "sync_gradients() after each backward, or accumulate in no_sync()")
        bucket.ready.add(id(p))
        while self.next < len(self.buckets) and len(self.buckets[self.next].ready) == len(self.buckets[self.next].params):
            self.launch_next()

    def launch_next(self):
        i, self.next = self.next, self.next + 1
        self.launch(i, self.buckets[i])

    def launch_rest(self):
        """Launch every bucket not launched yet (after backward), in order."""
        while self.next < len(self.buckets):
            self.launch_next()

    def reset(self):
        for b in self.buckets:
            b.ready, b.pending = set(), None
        self.next = 0
