"""Device-to-host syncs of a training step, counted on CPU.

On a GPU every read of a device value by the host (`.item()`, `bool(t)`, `if t:`,
`torch.equal`, an output whose size depends on the data) waits for everything queued before it,
so the host stops running ahead of the GPU and each kernel launch is exposed again. train.py
takes one such read per optimizer step, for the verdict that decides whether the step is taken
(finite gradients), and folds into it everything else the step reports (the gradient norm, the
loss, whether the weights the step started from are finite). This test counts the reads under a
TorchDispatchMode over whole runs of train.main, and takes the difference between a run of 4 and
one of 2 iterations: the cost of 2 ordinary iterations (forward, backward, clipping, finite
verdict, optimizer step, the checks after it), outside logging and evaluation iterations.

The CPU run is set up as train.py sets up a CUDA run where that matters here: the FP8 GEMMs go
through torch._scaled_mm (fp8_backend=torch) with the CPU emulation's shortcuts off (its cast
asks the host whether every amax is finite, which a GPU never runs), and O1 gets the fused AdamW
that train.py builds on CUDA (the CPU's single-tensor AdamW reads its host-side step counters
with .item(), which on a GPU is no sync: they live in host memory).
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import train
from nanofp8 import emulate

pytestmark = pytest.mark.usefixtures("shakespeare")

# Operators that make the host wait for the device: scalar reads, outputs whose size is data, and
# copies to the host (counted where they are copies: on a CPU run, .cpu() of a CPU tensor is no op;
# .tolist() is not an operator at all, so a device value is read with a copy first).
SYNCS = {"_local_scalar_dense", "item", "is_nonzero", "equal", "allclose", "nonzero",
         "masked_select", "unique", "_unique", "_unique2", "unique_consecutive", "unique_dim"}

TINY = ["dataset=shakespeare_char", "n_layer=2", "n_head=2", "n_embd=32", "block_size=32",
        "batch_size=4", "gradient_accumulation_steps=2", "eval_iters=1", "device=cpu",
        "compile=False", "fp8_backend=torch", "log_interval=1000", "eval_interval=1000"]


class SyncCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count, self.where = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        kw = kwargs or {}
        if (name in SYNCS or (name == "repeat_interleave" and not kw.get("output_size"))
                or (name == "_to_copy" and kw.get("device") == torch.device("cpu")  # .cpu(), .to("cpu")
                    and kw.get("dtype") in (None, args[0].dtype))):  # (not a cast that names the device)
            self.count += 1
            self.where.append(name)
        return func(*args, **(kwargs or {}))


def syncs(precision, iters, out_dir):
    with SyncCounter() as c:
        train.main(TINY + [f"precision={precision}", f"max_iters={iters}", f"out_dir={out_dir}"])
    return c.count


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["O1", "O2"])
def test_one_sync_per_training_step(precision, tmp_path, monkeypatch):
    real = train.build_optimizer
    monkeypatch.setattr(train, "build_optimizer", lambda model, cfg, device_type: real(model, cfg, "cuda"))
    monkeypatch.setattr(emulate, "handles", lambda t: False)  # the path a GPU takes (see above)
    short = syncs(precision, 2, tmp_path / "short")
    long = syncs(precision, 4, tmp_path / "long")
    per_step = (long - short) / 2
    print(f"{precision}: {per_step:g} device-to-host syncs per training step")
    assert per_step <= 1, f"{precision}: {per_step:g} syncs per training step"
    assert short > 0  # the counter sees syncs at all (evaluation and logging read values)


def _dp_worker(rank, world, level, out_dir):
    """Two data-parallel replicas (gloo) through train.py's wiring: the syncs of one ordinary step
    (forward, backward with the FP8 reduction hooks, sync_gradients, clipping, verdict, step)."""
    import os

    from nanofp8.layout import make_layout
    from nanofp8.model import GPT, GPTConfig
    from conftest import micro_steps
    from nanofp8.run import wrap_data_parallel

    emulate.handles = lambda t: False  # the path a GPU takes (a spawned process of its own)
    cfg = train.load_config(["device=cpu", "compile=False", "batch_size=2", "block_size=32",
                             "gradient_accumulation_steps=4", f"precision={level}", "fp8_backend=torch"])
    layout = make_layout()
    torch.manual_seed(0)
    model = GPT(GPTConfig(arch="gpt2", n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=32))
    train.setup_precision(model, cfg, "cpu")
    raw = model
    model = wrap_data_parallel(model, cfg, layout)
    opt = train.build_optimizer(raw, cfg, "cuda")  # the fused AdamW of a CUDA run (see above)
    g = torch.Generator().manual_seed(rank)
    counts = []
    for step in range(3):
        batches = [(t[:, :-1], t[:, 1:]) for t in torch.randint(0, 64, (2, 2, 33), generator=g)]
        with SyncCounter() as c:
            micro_steps(model, batches, layout)
            _, stepped, _ = train.optimizer_step(model, opt, cfg, layout)
        assert stepped
        counts.append((c.count, c.where))
    torch.save(counts, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("precision", ["O1", "O2", "O3"])
def test_one_sync_per_data_parallel_step(precision, tmp_path):
    """Under torchrun too: Fp8DataParallel's finite verdict is read in the step's one copy. O3:
    ZeroFp8AdamW's verdict (every rank's gradient shards finite, and the norm) too, from its
    prepare_step."""
    from conftest import spawn

    spawn(_dp_worker, 2, precision, str(tmp_path))
    for rank in range(2):
        counts = torch.load(tmp_path / f"rank{rank}.pt")
        print(f"{precision} rank {rank}: syncs per data-parallel step {[n for n, _ in counts]}")
        assert all(n <= 1 for n, _ in counts[1:]), counts  # (the first step may set things up)
