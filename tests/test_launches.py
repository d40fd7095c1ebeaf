"""Kernel launches of an eager FP8 Linear per micro-step, counted on CPU.

An H100 runs a small kernel in a few microseconds; launching one from Python takes about as long.
A Linear whose micro-step is dozens of small kernels is then bound by the host, not the GPU: at
GPT-2 124M, quantize() in plain torch ops (about a dozen launches per cast, four casts and three
GEMMs per Linear) made an eager O1 step about twice as slow as bf16's. This test counts what an
eager Linear launches on the path a CUDA device takes (device.one_pass_cast: the casts on kernels.py's
Triton quantizers, run here in the interpreter; the GEMMs on torch._scaled_mm; the CPU
emulation's shortcuts off), under bf16 autocast, as train.py runs it at O1 (weight cast cached
across the micro-steps of an optimizer step):

* ATen operators that launch work, seen by a TorchDispatchMode (views, detach and allocations
  launch nothing and are not counted);
* Triton kernel launches, counted at the kernels of kernels.py.
"""

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from nanofp8 import device, emulate, fp8
from nanofp8.fp8 import Recipe, convert_to_fp8

# Launches per Linear per micro-step, forward and backward, by granularity. tensor: 3 GEMMs, 2
# casts of 2 Triton kernels each (x and dy, each writing its transpose too), the inverse scales,
# the bias gradient and the gradient accumulation. row and block also re-quantize x^T and dy^T
# (a transposed copy and a cast each) and lay out their scales. (A bf16 nn.Linear under
# autocast: 10, counted the same way.) Before the Triton casts: about 70 (tensor).
BAR = {"tensor": 16, "row": 20, "block": 30}
NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "lift_fresh", "lift_fresh_copy"}


class LaunchCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.overloadpacket.__name__ not in NO_KERNEL:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


class CountedKernel:
    """A kernels.py kernel whose launches (kernel[grid](...)) are counted, and run outside the
    dispatch mode (the interpreter's own tensor operations are not launches)."""

    def __init__(self, kernel, counter):
        self.kernel, self.counter = kernel, counter

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.counter.ops.append(f"triton:{getattr(self.kernel, '__name__', 'kernel')}")
            with _disable_current_modes():
                return self.kernel[grid](*args, **kwargs)
        return launch


def micro_step_launches(layer, x, counter):
    dy = torch.ones(*x.shape[:-1], layer.out_features, dtype=torch.bfloat16)
    x.grad = None  # (x stands for the previous layer's output: nothing accumulates into it)
    counter.ops.clear()
    with counter:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
        y.backward(dy)
    return list(counter.ops)


def counted(fn, counter, name):
    """A GEMM entry point counted as one launch (the CUDA stand-in computes it with many CPU ops)."""
    def call(*args, **kwargs):
        counter.ops.append(name)
        with _disable_current_modes():
            return fn(*args, **kwargs)
    return call


@pytest.mark.slow  # ~6 s a recipe
@pytest.mark.parametrize("granularity, formats", [("tensor", "hybrid"), ("row", "e4m3"), ("block", "e4m3")])
def test_eager_fp8_linear_launches_per_micro_step(granularity, formats, monkeypatch):
    import torch.nn.functional as F

    import kernels
    from cuda_contract import CudaScaledMM

    counter = LaunchCounter()
    for name in ("_amax_partial_kernel", "_cast_tensor_kernel", "_quantize_rows_kernel",
                 "_quantize_tiles_kernel", "_fp8_gemm_kernel"):
        monkeypatch.setattr(kernels, name, CountedKernel(getattr(kernels, name), counter))
    # the path of an H100: the decisions and GEMM calls of CUDA (the stand-in), the CPU
    # emulation's shortcuts off, the casts on the Triton quantizers
    contract = CudaScaledMM().install(monkeypatch)
    monkeypatch.setattr(torch, "_scaled_mm", counted(contract, counter, "_scaled_mm"))
    monkeypatch.setattr(F, "scaled_mm", counted(contract.scaled_mm_v2, counter, "scaled_mm"))
    monkeypatch.setattr(emulate, "handles", lambda t: False)
    monkeypatch.setattr(device, "one_pass_cast", lambda t: not torch.compiler.is_compiling(), raising=False)
    torch.manual_seed(0)
    recipe = Recipe(granularity=granularity, formats=formats, backend="torch")
    layer = convert_to_fp8(nn.Linear(256, 512), recipe)
    layer.cache_weight = True  # as train.py sets it at O1
    x = torch.randn(4, 64, 256, requires_grad=True)
    steps = [micro_step_launches(layer, x, counter) for _ in range(3)]
    ref = nn.Linear(256, 512)
    bf16 = micro_step_launches(ref, x, counter)
    print(f"{granularity}: launches per micro-step {[len(s) for s in steps]} (bf16 nn.Linear: {len(bf16)}); "
          f"the last: {steps[-1]}")
    assert not contract.refusals and sum(op in ("_scaled_mm", "scaled_mm") for op in steps[-1]) == 3
    # the first micro-step of a step also casts the weight (and its transpose): a few more
    assert len(steps[0]) <= BAR[granularity] + 6, steps[0]
    for s in steps[1:]:  # then the cast is reused
        assert len(s) <= BAR[granularity], (len(s), s)
    assert steps[1] == steps[2]


def test_o1_casts_the_weight_once_per_step():
    """train.py at O1: the micro-steps of a step reuse one FP8 cast of each weight; the step of
    torch's fused AdamW (CUDA's optimizer, which writes the weights without bumping their version
    counters) is followed by its post hook (o2_compile.cast_after_steps), which bumps them and casts
    every weight once, for the next step's micro-steps (compiled ones read that cast). Other writes
    bump the counter themselves (foreach AdamW, copy_): eager code casts again."""
    import train
    from nanofp8.model import GPT, GPTConfig

    cfg = train.load_config(["device=cpu", "precision=O1", "grad_clip=1.0", "learning_rate=0.1"])
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, vocab_size=64, block_size=16))
    train.setup_precision(model, cfg, "cpu")
    opt = train.build_optimizer(model, cfg, "cuda")  # fused, as on CUDA
    layer = model.blocks[0].mlp.c_fc
    x = torch.randint(0, 64, (2, 16))
    casts = []
    real = type(layer).cast_weight
    for m in model.modules():
        if isinstance(m, fp8.Fp8Linear):
            m.cast_weight = (lambda m: lambda: casts.append(m) or real(m))(m)
    for _ in range(3):  # three micro-steps: one cast per Linear
        model(x, x)[1].backward()
    assert len(casts) == 4, len(casts)
    before = layer.weight_operands()
    train.optimizer_step(model, opt, cfg)
    assert len(casts) == 8  # the step cast each Linear once
    after = layer.weight_operands()
    assert after is not before and len(casts) == 8  # and the forward takes that cast
    want = fp8.quantize(layer.weight.detach(), fp8.E4M3)
    assert torch.equal(after[0].data.view(torch.uint8), want.data.view(torch.uint8))
    with torch.no_grad():
        layer.weight.mul_(2)  # any write that bumps the counter
    assert layer.weight_operands() is not after
