"""torch.compile on Fp8Linear, forward and backward, against eager (CPU, inductor).

train.py compiles the model by default on CUDA, so every recipe has to go through dynamo,
AOTAutograd and inductor: the autograd.Function with its three GEMMs, the saved FP8 operands,
and, for delayed scaling, the in-place updates of the amax-history buffers (also from the
backward pass, for the grad-output role).

What holds, and is checked here, for current tensor/row/block scaling and delayed scaling, with
backends "torch" (torch._scaled_mm) and "emulate", over 3 scripted steps of a 2-layer MLP:
* the model compiles into ONE graph, once: no graph break, no recompile over the steps;
* the output, the input gradient and the weight gradients are BIT-EXACT with eager. Quantizing
  is elementwise work plus max reductions (exact in any order), the scales are divided in
  float64 and rounded once, and the GEMMs are the same library calls in both modes;
* the bias gradients (an fp32 sum over the tokens) agree to fp32 rounding, not bit for bit:
  inductor writes its own reduction kernel, which adds the tokens in another order;
* delayed scaling: the buffers (amax history, history count, scale, non-finite count) are
  bit-exact with eager after every step.

The MLP uses ReLU, not GELU: inductor's erf is not eager's to the last bit, and that ulp would
flow into the next layer's amax and hide what is tested here. Its sizes are not multiples of
128 on purpose: ragged tiles are where inductor's CPU code went silently wrong for block scaling
(see fp8.expand_tiles). One compile (forward and backward) per case, ~10-30 s each on a CPU.
"""

import copy

import pytest
import torch
import torch.nn as nn

from nanofp8.fp8 import RECIPES as RECIPE_NAMES, Recipe, convert_to_fp8, sqnr
from nanofp8.o2_compile import push_amaxes

# (scaling, granularity, bf16 autocast); each MLP runs its first layer on backend "torch" and its
# second on "emulate", which tests both backends with half the compiles. train.py runs the model
# under autocast: the default recipe is compiled that way too.
RECIPES = [("current", "tensor", False), ("current", "row", False), ("current", "block", False),
           ("delayed", "tensor", False), ("current", "tensor", True), ("current", "mxfp8", False),
           ("current", "rowwise_with_gw_hp", False)]


def mlp(scaling, granularity):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(160, 144), nn.ReLU(), nn.Linear(144, 136))
    for layer, backend in (("0", "torch"), ("2", "emulate")):
        recipe = (Recipe.from_name(granularity, backend=backend) if granularity in RECIPE_NAMES else  # (presets:
                  Recipe(scaling=scaling, granularity=granularity, history_len=4, backend=backend))  # MX, hp wgrad)
        convert_to_fp8(model, recipe, module_filter=lambda fqn, lin: fqn == layer)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("scaling, granularity, autocast", RECIPES,
                         ids=["-".join(r[:2]) + ("-autocast" if r[2] else "") for r in RECIPES])
def test_compiled_matches_eager(scaling, granularity, autocast):
    # Imported here, not at the top: torch._dynamo imports triton, and a triton imported while
    # pytest collects would be the compiled one, not the interpreter that test_kernels.py sets up.
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()  # a fresh cache: earlier tests must not count against the recompile limit
    eager, model = mlp(scaling, granularity), mlp(scaling, granularity)
    assert [m.recipe.backend for m in model if hasattr(m, "recipe")] == ["torch", "emulate"]
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(2, 12, 160, generator=g) * 4.0**step  # growing: delayed scales lag behind
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            ye, yc = eager(xe), compiled(xc)
        assert yc.dtype == (torch.bfloat16 if autocast else torch.float32)
        ye.square().sum().backward()
        yc.square().sum().backward()
        push_amaxes(model)  # (delayed scaling: the compiled graph's amaxes into the histories)

        if autocast:  # bf16 outputs: the CPU's torch._scaled_mm (compiled) adds the bias in its
            # own order, eager's emulation in the reference's: a bf16 ulp here and there, and the
            # gradients made from them may round to a neighbouring E5M2 value (25 dB apart)
            assert sqnr(ye, yc) > 40, f"step {step}: output"
            for what, c, e in [("input gradient", xc.grad, xe.grad)] + [
                    (n, pc.grad, pe.grad) for (n, pe), pc in zip(eager.named_parameters(), model.parameters())]:
                assert sqnr(e, c) > 30, f"step {step}: {what}"
        else:
            assert torch.equal(yc, ye), f"step {step}: output"
            assert torch.equal(xc.grad, xe.grad), f"step {step}: input gradient"
        for (name, pe), pc in zip(eager.named_parameters(), model.parameters()):
            if autocast:
                continue  # (compared above)
            if name.endswith("weight"):
                assert torch.equal(pc.grad, pe.grad), f"step {step}: {name}.grad"
            else:  # fp32 sum over tokens, reordered by inductor
                torch.testing.assert_close(pc.grad, pe.grad, rtol=1e-5, atol=1e-5 * pe.grad.abs().max())
        for (name, be), bc in zip(eager.named_buffers(), model.buffers()):
            assert torch.equal(bc, be), f"step {step}: buffer {name}"

        with torch.no_grad():  # one SGD step on both (eager's gradients), so the weights move too
            for pe, pc in zip(eager.parameters(), model.parameters()):
                pe -= 1e-3 * pe.grad
                pc.copy_(pe)
                pe.grad = pc.grad = None

    # delayed scaling: one recompile, when the histories fill (the first cast measures its tensor)
    assert counter.frame_count == 1 + (scaling == "delayed"), "graph breaks or recompiles"
    assert counter.op_count > 0
    if scaling == "delayed":  # the history really was written, from forward and backward
        for lin in (eager[0], eager[2]):
            assert (lin.history_count == 3).all() and (lin.amax_history[:, :3] > 0).all()


@pytest.mark.slow  # a torch.compile of a GPT: ~12 s
@pytest.mark.parametrize("level", ["O2", "O3"])
def test_o2_gpt_traces_as_one_graph_and_keeps_its_gradients(level):
    """O2 and O3 under torch.compile: a GPT block's forward, with the backward of every FP8 Linear
    that dynamo traces with it, is ONE graph with no break (explain). The FP8 weight gradient,
    which eager mode stores in the module from inside the backward, leaves the graph in fp32 as
    the gradient of the layer's sink and reaches take_wgrad through its hook (nanofp8/optim.py,
    O2Linear.ensure_grad_hook): the sum over three micro-steps is eager's, bit for bit (a graph that handed it over in fp16 rounded it once more per micro-step; O3's
    FP8 weight could not carry it at all, and broke the graph). Compiled with aot_eager: the
    graph, not inductor's kernels, is what is tested here."""
    from nanofp8.model import GPT, GPTConfig, apply_fp8
    from nanofp8.optim import Fp8AdamW, O2Linear, convert_to_o2, fp8_grad, set_fp8_grad
    from nanofp8.zero import convert_to_o3

    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=64))
    apply_fp8(eager, Recipe(backend="torch"))
    (convert_to_o2 if level == "O2" else convert_to_o3)(eager)
    model = copy.deepcopy(eager)  # the copy gets the gradient hooks of its own weights
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))

    explained = torch._dynamo.explain(lambda x: model(x, x)[1])(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons

    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter)
    pairs = [(a, b) for a, b in zip(eager.modules(), model.modules()) if isinstance(a, O2Linear)]
    assert len(pairs) == 4
    for micro in range(3):
        eager(x, x)[1].backward()
        compiled(x, x)[1].backward()
    for a, b in pairs:  # (read once, at the end: a read casts the sum so far to E4M3)
        qa, qb = fp8_grad(a.weight), fp8_grad(b.weight)
        assert torch.equal(qa.data.view(torch.uint8), qb.data.view(torch.uint8))
        assert torch.equal(qa.scale, qb.scale)
        assert b.weight.grad is None and b.wgrad_sink.grad is None  # taken out of autograd by the hook
    if level == "O3":
        return  # (O3's step runs on ranks: tests/test_zero.py)

    # The FP8 weight is cast once per step, by the optimizer's step, outside the graph: after a
    # step on both models (the same gradients), the compiled forward runs on the new weight
    # without tracing again, and gives eager's loss bit for bit; it reads the step's FP8 weight.
    for a, b in pairs:
        set_fp8_grad(b.weight, fp8_grad(a.weight))
    for m in (eager, model):
        for p in m.parameters():
            p.grad = torch.ones_like(p) if p.dtype == torch.float32 else None
    for m in (eager, model):
        opt = Fp8AdamW(m.parameters(), m, lr=0.05)
        assert opt.step()
    for a, b in pairs:
        assert torch.equal(a.weight, b.weight) and a.fp8_w_scale == b.fp8_w_scale
    assert torch.equal(compiled(x, x)[1], eager(x, x)[1])
    assert counter.frame_count == 1  # one graph, traced once: the new weight needed no retrace
    for _, b in pairs:  # and that graph reads the step's cast, not a cast of its own
        b.fp8_w = torch.zeros_like(b.fp8_w)
    assert not torch.equal(compiled(x, x)[1], eager(x, x)[1])


# -- train.py with compile=True, against the same run in eager mode ------------------------------

TRAIN = ["dataset=shakespeare_char", "n_layer=1", "n_head=2", "n_embd=32", "block_size=32",
         "batch_size=4", "gradient_accumulation_steps=2", "log_interval=1", "device=cpu",
         "fp8_backend=torch", "max_iters=3", "learning_rate=3e-3", "warmup_iters=0"]


def _no_evaluation(*args, **kwargs):
    # Evaluation runs the model in eval mode under no_grad: a second compile (~40 s on a CPU) that
    # tests nothing the training step does not. Its checkpoint logic sees a loss of 0.
    return {"train": 0.0, "val": 0.0}


@pytest.mark.slow
@pytest.mark.usefixtures("shakespeare")
@pytest.mark.parametrize("precision", ["O1", "O2"])
def test_train_compiled_matches_eager(precision, tmp_path, monkeypatch):
    """train.py's training step under torch.compile (inductor), as a CUDA run does by default:
    under bf16 autocast, at O1 and O2 (O3 below), the same losses as eager to within a few 1e-4
    (inductor reorders fp32 sums, e.g. of the layer norms)."""
    import train

    monkeypatch.setattr(train, "estimate_loss", _no_evaluation)
    torch._dynamo.reset()
    runs = {}
    for compile_ in (False, True):
        out = tmp_path / str(compile_)
        runs[compile_] = [loss for _, loss in train.main(TRAIN + [f"precision={precision}", f"compile={compile_}",
                                                                  f"out_dir={out}"])["losses"]]
    assert len(runs[True]) == 3
    assert max(abs(a - b) for a, b in zip(runs[True], runs[False])) < 2e-3, runs


def _o3_worker(rank, world, out_dir):
    """train.py's O3 wiring on 2 gloo ranks, eager and compiled side by side (the compiled copy
    traced with aot_eager: dynamo and AOTAutograd, where the autocast failure was; inductor's
    kernels are those of O2 above): 3 steps of forward/backward and the ZeRO step."""
    import copy
    import os

    import train
    from nanofp8.layout import make_layout
    from nanofp8.model import GPT, GPTConfig
    from conftest import micro_steps
    from nanofp8.run import wrap_data_parallel

    cfg = train.load_config(["device=cpu", "batch_size=2", "block_size=32", "gradient_accumulation_steps=4",
                             "precision=O3", "fp8_backend=torch", "learning_rate=3e-3"])
    layout = make_layout()
    torch.manual_seed(0)
    model = GPT(GPTConfig(arch="gpt2", n_layer=1, n_head=2, n_embd=32, vocab_size=64, block_size=32))
    models = []
    for compiled in (False, True):
        m = copy.deepcopy(model)
        train.setup_precision(m, cfg, "cpu")
        opt = train.build_optimizer(m, cfg, "cpu")
        run = torch.compile(m, backend="aot_eager") if compiled else m
        models.append((wrap_data_parallel(run, cfg, layout), opt))
    g = torch.Generator().manual_seed(rank)
    losses = []
    for step in range(3):
        batches = [(t[:, :-1], t[:, 1:]) for t in torch.randint(0, 64, (2, 2, 33), generator=g)]
        step_losses = []
        for wrapped, opt in models:
            loss = micro_steps(wrapped, batches, layout)
            _, stepped, _ = train.optimizer_step(wrapped, opt, cfg, layout)
            assert stepped
            step_losses.append(float(loss))
        losses.append(step_losses)
    torch.save(losses, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.slow
@pytest.mark.dist
def test_train_compiled_o3_matches_eager(tmp_path):
    from conftest import spawn

    spawn(_o3_worker, 2, str(tmp_path))
    for rank in range(2):
        losses = torch.load(tmp_path / f"rank{rank}.pt")
        assert all(abs(e - c) < 1e-5 for e, c in losses), losses


@pytest.mark.slow
def test_triton_backend_compiles_to_one_opaque_gemm():
    """backend="triton" under torch.compile (autocast on): one graph, no break, and each GEMM is the
    custom op nanofp8::fp8_gemm, so dynamo traces no Triton launch. Traced, the autotuned GEMM
    crashed torch 2.11's dynamo on an H200 ("Can't construct an AttrSource without a valid base
    source", pytorch#178179): every compiled GEMM of backend=triton, and the block recipe's GEMMs
    routed to Triton. The casts stay torch operations for inductor (device.triton_cast). Outputs and
    gradients are bit-identical to eager's (the same kernels run)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(256, 128))
    convert_to_fp8(eager, Recipe(backend="triton"))
    model = copy.deepcopy(eager)
    x = torch.randn(16, 256)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        explained = torch._dynamo.explain(model)(x.clone().requires_grad_())
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    graphs = [str(m.graph) for g in explained.graphs for m in g.modules() if hasattr(m, "graph")]
    assert sum(s.count("nanofp8.fp8_gemm") for s in graphs) == 3, "forward, dgrad and wgrad GEMMs"
    assert not any("triton_kernel_wrapper" in s for s in graphs)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter)
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ye, yc = eager(xe), compiled(xc)
    ye.float().square().sum().backward()
    yc.float().square().sum().backward()
    assert counter.frame_count == 1
    assert torch.equal(yc, ye)
    assert torch.equal(xc.grad, xe.grad) and torch.equal(model[0].weight.grad, eager[0].weight.grad)


def test_a_gemm_routed_while_tracing_does_not_recompile(monkeypatch):
    """A GEMM that torch._scaled_mm cannot run is routed while dynamo traces, and that choice holds
    for every call of the graph. Counted there (a Python counter read and written in the compiled
    region), it made dynamo recompile at every step: on an H200, O2 with block scales hit the
    recompile limit (8) at step 8 and ran eagerly from then on. Twelve calls: one compile."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from nanofp8 import device

    monkeypatch.setattr(device, "fallbacks", {})
    torch._dynamo.reset()

    def step(x):
        device._fell_back("layer", "a rule of torch._scaled_mm")  # to a high-precision GEMM
        device._fell_back("layer", "a rule of torch._scaled_mm", "the Triton GEMM (kernels.py)")
        return x + 1

    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(step, backend=counter)
    for _ in range(12):
        compiled(torch.ones(2))
    assert counter.frame_count == 1, f"{counter.frame_count} compiles"
    with pytest.warns(UserWarning, match="falling back to a high-precision GEMM"):
        step(torch.ones(2))  # eager: counted and reported
    assert device.fallbacks == {"layer": 1}, "only the high-precision GEMM is a fallback"


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "delayed"])
@pytest.mark.parametrize("input_grad", [False, True])
def test_autocast_holds_after_an_fp8_layer(recipe, input_grad):
    """Every matmul after an FP8 layer keeps autocast's dtype in a compiled graph, as in eager.
    Dynamo traces a Function's backward at its forward; a layout question there (is_contiguous of
    a tensor made from the gradient) made it trace the backward again, and the failed try left
    autocast disabled for the rest of the graph: a later Fp8Linear wrote fp32 (the GELU input of
    a GPT block in fp32, twice the bytes) and a plain Linear (the LM head) ran in fp32."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 32))
    convert_to_fp8(model, Recipe.from_name(recipe, backend="torch"),
                   module_filter=lambda fqn, lin: fqn != "2")  # "2" stays a plain Linear
    x = torch.randn(16, 64, requires_grad=input_grad)

    def dtypes(m):
        with torch.autocast("cpu", torch.bfloat16):
            h = m[0](x)
            return [t.dtype for t in (h, m[1](h), m[2](h))]

    assert dtypes(model) == [torch.bfloat16] * 3
    torch._dynamo.reset()
    assert torch.compile(dtypes, backend="aot_eager")(model) == [torch.bfloat16] * 3
