"""
What a compiled training step costs a GPU, counted on a CPU.

At GPT-2 width an FP8 GEMM takes a few microseconds less than a bf16 one, and every cast around it
costs a read and a write of the tensor it casts: whether FP8 pays is decided by the bytes the
non-GEMM kernels move and by how many of them launch (results/gpu/: 0.78x bf16's tokens/s at
GPT-2 124M, with one graph and no break). torch.compile turns each graph into kernels by fusing
its operations, by rules that depend on the device. Inductor can be told to apply its CUDA rules
(Triton kernels) to a CPU graph (`cpu_backend = "triton"`): scheduling the graphs that
AOTAutograd hands it then gives the kernels a GPU would launch and the bytes each one reads and
writes, without a GPU and without compiling any of them. Priced at HBM bandwidth, this count
reproduced the H200's O1/bf16 ratios within 1% (docs/performance.md, "Where a compiled FP8 step
spends a GPU's time").

    graph_cost(fn, *args)      run fn (forward and backward), counting every graph it compiles
    block_cost(level, ...)     one GPT-2 block of train.py's model at a precision level, with its
                               loss.backward(), as train.py compiles it; and what its forward keeps
                               for the backward (the activations' share of the peak memory)
    step_cost(level, ...)      the work outside the compiled graphs of one optimizer step: the
                               checks, the clipping, the optimizer and the weight casts of the step,
                               counted as ATen launches (each a kernel on a GPU, a foreach operator
                               one) and the bytes of their operands, on the paths a GPU takes (the
                               CPU emulation's shortcuts off; the casts as fp8.quantize's operators,
                               where a GPU's eager casts are two Triton launches: an upper bound)

The scheduling uses inductor's own passes (post-grad passes, lowering, the scheduler's fusion)
and stops before code generation; nothing runs on the graphs but their eager twins, so that
backward gets its inputs. It reads torch internals (torch._inductor), checked on torch 2.11 and
2.13: a change there is a failure of `bench.py kernels`, not of training.
"""

import copy
import functools
from dataclasses import dataclass, field, replace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# what launches nothing on a GPU: allocations, views, metadata
_NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "lift_fresh", "lift_fresh_copy", "detach",
              "_local_scalar_dense", "set_", "alias", "_record_function_enter_new", "_record_function_exit"}


@dataclass
class Graph:
    backward: bool
    kernels: list = field(default_factory=list)  # (bytes read and written, fused operations)
    gemms: list = field(default_factory=list)  # extern kernels: GEMMs, attention, library calls
    out_bytes: int = 0  # what the graph returns: a forward's output and what its backward keeps

    @property
    def bytes(self):
        return sum(b for b, _ in self.kernels)


def _schedule(gm, example_inputs, backward, graphs):
    """Lower one AOT graph with inductor's CUDA rules and keep its fused kernels."""
    from torch._inductor import config
    from torch._inductor.compile_fx import (_recursive_post_grad_passes, _recursive_record_original_output_strides,
                                            fake_tensor_prop, view_to_reshape)
    from torch._inductor.debug import DebugContext
    from torch._inductor.graph import GraphLowering
    from torch._inductor.scheduler import ExternKernelSchedulerNode, NopKernelSchedulerNode, Scheduler
    from torch._inductor.virtualized import V

    outputs = [a.meta.get("val") for a in torch.utils._pytree.tree_leaves(next(
        n for n in gm.graph.nodes if n.op == "output").args) if isinstance(a, torch.fx.Node)]
    out_bytes = sum(v.numel() * v.element_size() for v in outputs if isinstance(v, torch.Tensor))
    view_to_reshape(gm)  # what compile_fx does before lowering, in its order
    with torch.no_grad():
        fake_mode = fake_tensor_prop(gm, example_inputs)
    _recursive_record_original_output_strides(gm)
    with config.patch(cpu_backend="triton"), V.set_fake_mode(fake_mode), DebugContext():
        _recursive_post_grad_passes(gm, is_inference=False)
        lowering = GraphLowering(gm, example_inputs=example_inputs, shape_env=fake_mode.shape_env,
                                 is_backward=backward)
        with V.set_graph_handler(lowering), V.set_extern_kernel_nodes([]):
            lowering.run(*example_inputs)
            graph = Graph(backward, out_bytes=out_bytes)
            for node in Scheduler(lowering.operations).nodes:
                if isinstance(node, NopKernelSchedulerNode):
                    continue
                if isinstance(node, ExternKernelSchedulerNode):
                    name = getattr(node.node, "python_kernel_name", None)
                    if name:  # (a MultiOutput only unpacks a tuple)
                        graph.gemms.append(name.replace("extern_kernels.", "").replace("torch.ops.aten.", ""))
                    continue
                ops = sorted({str(o.target).replace("aten.", "").split(".")[0] for n in node.get_nodes()
                              for o in (getattr(n.node, "origins", None) or ()) if o.op == "call_function"})
                graph.kernels.append((node.get_read_write_buffers_sizes(), ops))
    graphs.append(graph)


def graph_cost(fn, *args, then=None):
    """Run fn(*args) under torch.compile, the graphs scheduled as a GPU's but run by their eager
    twins, then then(result) uncompiled (a .backward(): AOTAutograd compiles the backward graph
    when it runs, as in train.py, where backward is called outside the compiled model). Returns
    (fn's result, [Graph])."""
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._inductor.compile_fx import compile_fx

    graphs = []

    def inner(gm, example_inputs, **kwargs):
        # (a copy: the passes rewrite the graph in place, and the eager twin below runs the original)
        _schedule(copy.deepcopy(gm), example_inputs, kwargs.get("is_backward", False), graphs)
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=lambda gm, inputs: compile_fx(gm, inputs, inner_compile=inner))
    out = compiled(*args)
    if then is not None:
        then(out)
    torch._dynamo.reset()
    return out, graphs


def cpu_runs_row_scales():
    """Does this torch's CPU torch._scaled_mm take row scales ((M, 1) x (1, N), fp32)? 2.13's does."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except (RuntimeError, ValueError):
        return False
    return True


def block_cost(level, n_embd=768, n_head=12, batch=8, seq=1024):
    """Kernels and bytes of one GPT-2 block at a precision level (bench.py's LEVELS), forward and
    backward, compiled as train.py compiles the model (bf16 autocast; FP8 on backend "torch",
    torch._scaled_mm, as on a GPU, row scales too where this CPU's kernel takes them; attention in
    bf16, as on a GPU). Returns a dict; "row_scaled_gemms": whether row-scaled GEMMs were counted
    as a GPU's calls (else as the CPU emulation's dequantize-and-multiply)."""
    import bench
    from nanofp8 import device
    from nanofp8 import model as model_py
    from nanofp8.model import GPTConfig

    cfg = GPTConfig(arch="gpt2", n_layer=1, n_head=n_head, n_embd=n_embd, vocab_size=256, block_size=seq)
    model, _, _ = bench.build(cfg, level, backend="torch")
    block = model.blocks[0]
    x = torch.randn(batch, seq, n_embd, requires_grad=True)

    def forward(x):
        with torch.autocast("cpu", torch.bfloat16):
            return block(x)

    keep, model_py.FP32_ATTENTION_ON_CPU = model_py.FP32_ATTENTION_ON_CPU, False
    cpu_rules, rowwise_counted = device.CPU_SCALED_MM, cpu_runs_row_scales()
    try:
        # a step first, eager and small: delayed scaling's graphs count as after a run's first step,
        # when every role has a history (the first step's graph measures each tensor before its cast)
        forward(torch.randn(1, 16, n_embd)).float().sum().backward()
        block.zero_grad(set_to_none=True)
        if rowwise_counted:  # the graphs call a row-scaled GEMM as a GPU does (device.CPU_SCALED_MM)
            device.CPU_SCALED_MM = replace(cpu_rules, rowwise=True, cublaslt_rowwise=True)
        _, graphs = graph_cost(forward, x, then=lambda y: y.float().sum().backward())
    finally:
        model_py.FP32_ATTENTION_ON_CPU, device.CPU_SCALED_MM = keep, cpu_rules
    tokens = batch * seq
    kernels = [k for g in graphs for k in g.kernels]
    kept = sum(g.out_bytes for g in graphs if not g.backward) - x.numel() * x.element_size()  # (less the output)
    return {"level": level, "n_embd": n_embd, "tokens": tokens, "graphs": len(graphs),
            "kernels": len(kernels), "KB_per_token": sum(b for b, _ in kernels) / tokens / 1024,
            "saved_KB_per_token": kept / tokens / 1024,
            "gemms": sum(len(g.gemms) for g in graphs),
            "kernel_list": [(g.backward, b / tokens / 1024, ops) for g in graphs for b, ops in g.kernels],
            "row_scaled_gemms": rowwise_counted, "graph_list": graphs}


class _Launches(TorchDispatchMode):
    """ATen operators that launch work, and the bytes of their tensor operands and results."""

    def __init__(self, host=()):
        super().__init__()
        self.ops, self.bytes, self.paused = [], 0, False
        self.host = {id(t): t for t in host}  # tensors a GPU keeps in host memory (Fp8AdamW's step counts;
        # held: an id of a freed tensor would be another's)
        self.within = None  # a list that also gets each launch's name (step_cost: the optimizer's)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        paused, name = self.paused, func.overloadpacket.__name__
        self.paused = paused or name.startswith("_foreach_")  # (one launch on a GPU: not the CPU's
        try:  # per-tensor operators, which this mode sees where the CPU falls back to them)
            out = func(*args, **(kwargs or {}))
        finally:
            self.paused = paused
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if tensors and all(id(t) in self.host for t in tensors):  # (host work: no launch; its results
            self.host.update((id(t), t) for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
            return out  # are host tensors too)
        if not self.paused and not func.is_view and name not in _NO_KERNEL:
            self.ops.append(name)
            if self.within is not None:
                self.within.append(name)
            seen = set()
            for t in torch.utils._pytree.tree_leaves((args, kwargs, out)):
                if isinstance(t, torch.Tensor) and id(t) not in seen:
                    seen.add(id(t))
                    self.bytes += t.numel() * t.element_size()
        return out


def step_cost(level, n_layer=12, n_embd=768, n_head=12):
    """Launches and bytes of one optimizer step at a precision level, outside the compiled graphs
    (the step as train.optimizer_step runs it, after a backward that filled the gradients), on a
    GPT-2 model of n_layer blocks; per FP8 weight value and in all. torch's AdamW (bf16, O1) runs
    fused, as train.py runs it on a GPU: one launch per parameter group. What a GPU runs compiled,
    O2's fused update (Fp8AdamW(fused=True), nanofp8/optim_fused.py: a call per weight) and the
    foreach step's noise hash (optim_foreach.hash_noise), counts as the kernels inductor's CUDA
    rules make of its graphs (graph_cost) and the bytes they move; the step's other work as
    launches."""
    import bench
    import train
    from nanofp8 import emulate, o2_compile, optim_foreach, optim_fused
    from nanofp8.fp8 import Fp8Linear
    from nanofp8.model import GPTConfig
    from nanofp8.optim import Fp8AdamW

    cfg = GPTConfig(arch="gpt2", n_layer=n_layer, n_head=n_head, n_embd=n_embd, vocab_size=256, block_size=64)
    model, opt, settings = bench.build(cfg, level, backend="torch")
    if type(opt) is torch.optim.AdamW:  # torch's fused AdamW, as on a GPU (train.py's choice there)
        for group in opt.param_groups:
            group.update(fused=True, foreach=False)
        opt.defaults["fused"] = True
    idx = torch.randint(0, cfg.vocab_size, (2, 64))
    keep, emulate.ENABLED = emulate.ENABLED, False  # the paths of a GPU, not the CPU's shortcuts
    compiled = []  # the calls of compiled functions: (function, args)
    keep_compiled, optim_fused.COMPILED = optim_fused.COMPILED, _run_uncounted(optim_fused.update_one, compiled)
    # the fused step's Triton kernels (nanofp8/optim_triton.py, GPU only): counted by their traffic,
    # the update made meanwhile by the eager code of the compiled step, not counted
    triton_calls = []
    keep_triton = optim_fused.runs_on_triton
    optim_fused.runs_on_triton = lambda p: True
    from nanofp8 import optim_triton
    stand_ins = {"step_group": _counted(triton_calls, lambda opt, group, o2, grads, *_: optim_triton.traffic(
                     opt, o2, grads), _step_group),
                 "cast_sums": _counted(triton_calls, optim_triton.traffic_sums, _sums_and_norms),
                 "norms": _counted(triton_calls, optim_triton.traffic_norms,
                                   lambda qs: torch.stack(optim_foreach._norms([(q.data, q.scale) for q in qs]))),
                 "cast_weights": _counted(triton_calls, optim_triton.traffic_casts, _cast_weights,
                                          takes=optim_triton.takes_weights)}
    keep_triton_fns = {name: getattr(optim_triton, name) for name in stand_ins}
    for name, fn in stand_ins.items():
        setattr(optim_triton, name, fn)
    from nanofp8 import history_triton  # (delayed scaling's casts and pushes: one launch for all layers each)
    keep_history = history_triton.push_histories, history_triton.cast_weights
    history_triton.push_histories = _counted(triton_calls, history_triton.traffic, _pushes,
                                             takes=history_triton.takes_layers)
    history_triton.cast_weights = _counted(triton_calls, history_triton.traffic_casts, _delayed_casts,
                                           takes=history_triton.takes_weights)
    keep_noise = optim_foreach.compiled_noise, optim_foreach.hash_noise.compiled  # (compiled on a GPU)
    optim_foreach.compiled_noise = lambda device: True
    optim_foreach.hash_noise.compiled = _run_uncounted(optim_foreach.hash_noise, compiled)
    # What a GPU runs as one compiled call for all layers (o2_compile._compiled_casts): the FP8
    # weight casts after a step (O1's cast_for_step, O2's refresh_all), delayed scaling's history
    # pushes, O2's casts of the summed gradients and their norms (optim_foreach.fp8_grads, fp8_norms)
    on_gpu = (o2_compile._recast, o2_compile._push_histories, optim_foreach._cast_sums, optim_foreach._norms)
    keep_casts = o2_compile._compiled_casts, [fn.compiled for fn in on_gpu]
    o2_compile._compiled_casts = lambda x: True
    for fn in on_gpu:
        fn.compiled = _run_uncounted(fn, compiled)
    try:
        inner_step = opt.step
        for _ in range(2):  # the second step is the one counted: state exists, the FP8 casts are warm
            with torch.autocast("cpu", torch.bfloat16):
                loss = model(idx, idx)[1]
            loss.backward()
            # Fp8AdamW's step counts live in host memory (no launch on a GPU); torch's fused AdamW's on the device
            counter = _Launches(host=[st["step"] for st in opt.state.values()] if isinstance(opt, Fp8AdamW) else ())
            compiled.clear()
            triton_calls.clear()
            opt_ops, opt_compiled, opt_triton, opt_bytes = [], [], [], [0]

            @functools.wraps(inner_step)  # (its signature: train.py passes the verdict it takes)
            def counted_step(*a, **kw):  # the optimizer's own launches and bytes, beside the step's
                counter.within, n, k, b = opt_ops, len(compiled), len(triton_calls), counter.bytes
                try:
                    return inner_step(*a, **kw)
                finally:
                    counter.within = None
                    opt_compiled.extend(compiled[n:])
                    opt_triton.extend(triton_calls[k:])
                    opt_bytes[0] += counter.bytes - b

            opt.step = counted_step
            with counter:
                train.optimizer_step(model, opt, settings)
            del opt.step
        kernels, seen, opt_kernels = [], {}, []
        with torch.no_grad():  # (as the step runs it)
            for fn, args in compiled:  # (a call like an earlier one, the same graph: scheduled once)
                key = (fn, tuple((tuple(t.shape), t.stride(), t.dtype) if isinstance(t, torch.Tensor) else repr(t)
                                 for t in torch.utils._pytree.tree_leaves(args)))
                if key not in seen:
                    seen[key] = [k for g in graph_cost(fn, *args)[1] for k in g.kernels]
                kernels += seen[key]
                if any(c is args for _, c in opt_compiled):
                    opt_kernels += seen[key]
    finally:
        emulate.ENABLED, optim_fused.COMPILED = keep, keep_compiled
        optim_fused.runs_on_triton = keep_triton
        for name, fn in keep_triton_fns.items():
            setattr(optim_triton, name, fn)
        history_triton.push_histories, history_triton.cast_weights = keep_history
        optim_foreach.compiled_noise, optim_foreach.hash_noise.compiled = keep_noise
        o2_compile._compiled_casts = keep_casts[0]
        for fn, was in zip(on_gpu, keep_casts[1]):
            fn.compiled = was
    # on a GPU each fused AdamW call of Fp8AdamW also copies its step counts to the device
    copies = ["copy to device"] * counter.ops.count("_fused_adamw_") if isinstance(opt, Fp8AdamW) else []
    counter.ops += ["compiled kernel"] * len(kernels) + ["triton kernel"] * sum(n for n, _ in triton_calls) + copies
    counter.bytes += sum(b for b, _ in kernels) + sum(b for _, b in triton_calls)
    opt_launches = (len(opt_ops) + len(opt_kernels) + sum(n for n, _ in opt_triton)
                    + (opt_ops.count("_fused_adamw_") if copies else 0))
    fp8_values = sum(m.weight.numel() for m in model.modules() if isinstance(m, Fp8Linear))
    opt_bytes = opt_bytes[0] + sum(b for b, _ in opt_kernels) + sum(b for _, b in opt_triton)
    return {"level": level, "n_layer": n_layer, "launches": len(counter.ops), "MB": counter.bytes / 2**20,
            "optimizer_launches": opt_launches, "optimizer_bytes_per_fp8_value": opt_bytes / max(fp8_values, 1),
            "compiled_kernels": len(kernels),
            "fp8_values": fp8_values, "bytes_per_fp8_value": counter.bytes / max(fp8_values, 1),
            "top_ops": sorted({op: counter.ops.count(op) for op in counter.ops}.items(), key=lambda kv: -kv[1])[:12]}


def _step_group(opt, group, o2, grads, ts, numbers, step_numbers):
    """optim_triton.step_group's results, made by the compiled step's code run eagerly and the
    layers' own casts (step_cost's stand-in: no GPU to run the kernels)."""
    from nanofp8 import optim_fused

    new = optim_fused.update_group(*optim_fused.group_args(opt, group, o2, grads, ts, numbers))
    optim_fused.store_moments(opt, o2, new)
    for p in o2:
        opt.o2[p].refresh_fp8_weight()


def _pushes(layers):
    """history_triton.push_histories' results, made by the layers' own pushes."""
    from nanofp8 import o2_compile

    o2_compile._push_histories(layers)
    return True


def _delayed_casts(layers):
    """history_triton.cast_weights' results, made by the layers' own casts and pushes."""
    from nanofp8 import o2_compile

    o2_compile._recast(layers, True)
    o2_compile._push_histories(layers)
    return True


def _cast_weights(layers):
    """optim_triton.cast_weights' results, made by the compiled casts' code run eagerly."""
    from nanofp8 import o2_compile

    o2_compile._recast(layers, True)
    return True


def _sums_and_norms(accs):
    """optim_triton.cast_sums' results from the compiled code's reference: [(data, scale, amax, norm)]."""
    from nanofp8 import optim_foreach

    cast = optim_foreach._cast_sums(accs)
    return [(*c, n) for c, n in zip(cast, optim_foreach._norms([(d, s) for d, s, _ in cast]))]


def _counted(calls, traffic, reference, takes=None):
    """An optim_triton function as step_cost runs it: its launches and bytes (traffic) kept in
    `calls`, its result made by `reference`, not counted. takes: where the function checks its
    arguments itself (returns None if it does not take them), the check."""

    def run(*args):
        if takes is not None and not takes(*args):
            return None
        calls.append(traffic(*args))
        mode = torch.utils._python_dispatch._get_current_dispatch_mode()
        if isinstance(mode, _Launches):
            mode.paused = True
        try:
            return reference(*args)
        finally:
            if isinstance(mode, _Launches):
                mode.paused = False
    return run


def _run_uncounted(fn, calls):
    """fn as step_cost runs a compiled function: eagerly, its operators not counted as launches
    (_Launches.paused), each call's arguments kept in `calls` for graph_cost to schedule."""

    def run(*args):
        mode = torch.utils._python_dispatch._get_current_dispatch_mode()
        if isinstance(mode, _Launches):
            mode.paused = True
        try:
            calls.append((fn, args))
            return fn(*args)
        finally:
            if isinstance(mode, _Launches):
                mode.paused = False
    return run

