"""
Predicted training step time of bf16, O1 and O2 on an H100 (or a B200), for a model size.

    python predict.py                      # a width sweep of GPT-2-like models, and the validation
    python predict.py --n_layer 12 --n_embd 768 --batch 16 --seq 1024 --gpu B200
    python bench.py predict --json results/predict.json   (the same, from bench.py)

Nothing here runs on a GPU. Two steps:

1. Count. The model of the asked size is built with fake tensors (torch's FakeTensorMode: shapes
   and dtypes, no memory), set up at the level as train.py sets it up for CUDA, and one
   micro-step (forward and backward under bf16 autocast) and one optimizer step run under a
   TorchDispatchMode that records every ATen operator: its FLOPs if it is a GEMM or attention,
   and the tensors it reads and writes. nanofp8 takes the decisions of an H100
   (device.scaled_mm_support), its CPU emulation is off, and the casts are quantize()'s torch
   operations: the code that train.py compiles by default on CUDA.
2. Price, with a roofline whose assumptions are printed (HARDWARE below). A GEMM takes
   max(FLOPs / (peak x efficiency), bytes / bandwidth). Everything else is memory-bound, and is
   priced as torch.compile runs it: the operators between two GEMMs fuse into one kernel, which
   reads the tensors it gets from outside and writes those used outside (a reduction to a single
   value, a tensor amax, ends a kernel: what reads its result is a second pass over the data),
   each kernel costing at least KERNEL_MIN_S. Collectives are not priced (one GPU).

Validated against published measurements (VALIDATION, `python predict.py` prints the error):
torchao/torchtitan's float8 training of Llama3-8B on 8 H100s (compiled, FSDP: the optimizer is
counted for 1/8 of the parameters) and nanochat's FP8 finding (slower than bf16 at d12, faster at
d26). The sweep says from which width FP8 pays with this code.
"""

import argparse
import json
import os
from contextlib import contextmanager

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

# peak dense TFLOPS (bf16, FP8), HBM TB/s, and the fraction of each that this prediction assumes a
# large GEMM / a memory-bound kernel reaches. H100: 989 / 1979 TFLOPS, 3.35 TB/s; measured large
# GEMMs ~750-800 (bf16) and ~1280 (FP8 cuBLAS) TFLOPS, hence 0.78 and 0.65 (REFERENCE). B200:
# 2250 / 4500 TFLOPS, 8 TB/s, with the H100's fractions (an assumption, not validated). H200: the
# H100's chip (same peaks) with 4.8 TB/s of HBM3e.
HARDWARE = {
    "H100": dict(bf16=989e12, fp8=1979e12, hbm=3.35e12, eff_bf16=0.78, eff_fp8=0.65, eff_attn=0.5, eff_hbm=0.8),
    "H200": dict(bf16=989e12, fp8=1979e12, hbm=4.8e12, eff_bf16=0.78, eff_fp8=0.65, eff_attn=0.5, eff_hbm=0.8),
    "B200": dict(bf16=2250e12, fp8=4500e12, hbm=8.0e12, eff_bf16=0.78, eff_fp8=0.65, eff_attn=0.5, eff_hbm=0.8),
}
KERNEL_MIN_S = 3e-6  # the shortest a kernel takes on the GPU (launch latency, tail): small kernels
# what the host spends per operator of eager code (dispatch, launch): an uncompiled step of many
# small operators (O2's optimizer) is bound by it, not by the GPU. Set from the H200's O2 step
# (results/gpu/throughput_h200.json, GPT-2 124M: it makes that O2 row a calibration, not a check).
HOST_OP_S = 5e-6

GEMMS = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_scaled_mm_v2"}
ATTENTION = {"_scaled_dot_product_flash_attention_for_cpu": 1.0,  # (the CPU names of flash
             "_scaled_dot_product_flash_attention_for_cpu_backward": 2.5,  # attention: the same FLOPs)
             "_scaled_dot_product_flash_attention": 1.0, "_scaled_dot_product_flash_attention_backward": 2.5}
FREE = {"empty", "empty_like", "empty_strided", "new_empty", "lift_fresh", "detach", "alias", "_to_copy_meta",
        "zeros_like", "ones_like", "zeros", "ones", "full", "full_like", "scalar_tensor", "arange"}  # (tiny or never read)
TRITON = "triton kernel"  # a launch of nanofp8/optim_triton.py: priced as one kernel, fused with nothing
FULL_REDUCTIONS = {"amax", "max", "aminmax", "sum", "mean", "_foreach_norm", "linalg_vector_norm", "norm", "all", "any"}


# -----------------------------------------------------------------------------
# 1. Count


class Recorder(TorchDispatchMode):
    """Records (name, flops, reads, writes, precision) of every operator; reads/writes are lists
    of (storage id, bytes)."""

    def __init__(self):
        super().__init__()
        self.ops = []
        self.seen = []  # every tensor recorded, kept alive: a freed storage's id would be reused


    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if func.is_view or name in FREE:
            return out
        ins = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if func._schema.is_mutable:  # in-place and out= ops write (some of) their inputs
            outs += [t for t, a in zip(ins, func._schema.arguments) if a.alias_info and a.alias_info.is_write]
        flops, fp8 = 0.0, False
        if name in GEMMS:
            a, b = (args[1], args[2]) if name in ("addmm", "baddbmm") else (args[0], args[1])
            flops = 2.0 * a.numel() * b.shape[-1]
            fp8 = a.element_size() == 1
        elif name in ATTENTION:
            q, k = args[0], args[1]  # (B, H, T, hd); causal: half the square
            flops = ATTENTION[name] * 4.0 * q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * q.shape[3] / 2
        self.ops.append((name, flops, fp8, [_io(t) for t in ins], [_io(t) for t in outs]))
        self.seen += ins + outs
        return out


def _io(t):
    return t.untyped_storage()._cdata, t.numel() * t.element_size()


@contextmanager
def cuda_decisions():
    """nanofp8 as train.py runs it compiled on an H100: CUDA's GEMM rules, no CPU emulation, the
    casts in torch operations (what inductor fuses), not kernels.py's eager quantizers."""
    from nanofp8 import device, emulate

    saved = device.scaled_mm_support, emulate.handles, device.one_pass_cast
    device.scaled_mm_support = lambda dev: device.ScaledMMSupport("cuda", True, True, True, True)
    emulate.handles = lambda t: False
    device.one_pass_cast = lambda t: False
    try:
        yield
    finally:
        device.scaled_mm_support, emulate.handles, device.one_pass_cast = saved


@contextmanager
def fake_step_counts():
    """Adam's step counters read as 1 from fake tensors, which hold no values (reading one is
    torch's DataDependentOutputException). The count only sets the bias-correction constants, so
    every operator of the step is recorded as it runs, the counters' foreach add included."""
    from torch._subclasses.fake_tensor import DataDependentOutputException

    from nanofp8 import optim_foreach, optim_fused, optim_triton

    real, compiled = optim_foreach.count_steps, optim_fused.COMPILED
    on_triton, step_group, casts = optim_fused.runs_on_triton, optim_triton.step_group, optim_triton.cast_weights

    def count(sts):
        try:
            return real(sts)
        except DataDependentOutputException:  # (raised by the read, after the add)
            return [1.0] * len(sts)

    optim_foreach.count_steps = count
    optim_fused.COMPILED = optim_fused.update_one  # O2's fused step: its operators, as compiled on a GPU
    # ... where its Triton kernels (a CUDA run's) do not take a weight: they are recorded as launches
    optim_fused.runs_on_triton, optim_triton.step_group = (lambda p: True), triton_launches
    optim_triton.cast_weights = cast_launches  # (O1's casts for the next forward)
    try:
        yield
    finally:
        optim_foreach.count_steps, optim_fused.COMPILED = real, compiled
        optim_fused.runs_on_triton, optim_triton.step_group, optim_triton.cast_weights = on_triton, step_group, casts


def triton_launches(opt, group, o2, grads, *_):
    """optim_triton.step_group as the Recorder sees it: its launches (TRITON ops, each a kernel of
    its own), their bytes (optim_triton.traffic) shared among them; nothing is computed."""
    from nanofp8.optim_triton import traffic

    _record_launches(*traffic(opt, o2, grads))


def cast_launches(layers):
    """optim_triton.cast_weights as the Recorder sees it (traffic_casts), where it takes the layers."""
    from nanofp8.optim_triton import takes_weights, traffic_casts

    if not takes_weights(layers):
        return None
    _record_launches(*traffic_casts(layers))
    return True


def _record_launches(n, nbytes):
    mode = torch.utils._python_dispatch._get_current_dispatch_mode()
    for _ in range(n):
        mode.ops.append((TRITON, 0.0, False, [(object(), nbytes / n)], []))


def count_step(model_args, level, batch, seq, recipe=()):
    """(ops of one micro-step's forward and backward, ops of one optimizer step)."""
    import train
    from nanofp8.model import GPT, GPTConfig
    from nanofp8.o2_compile import cast_for_step

    cfg = train.load_config([f"precision={level}", "device=cpu", "fp8_backend=torch", *recipe])
    with cuda_decisions(), FakeTensorMode():
        model = GPT(GPTConfig(**model_args, block_size=seq))
        train.setup_precision(model, cfg, "cuda")
        opt = train.build_optimizer(model, cfg, "cuda")
        cast_for_step(model, record=False)  # O1: the weights' casts, made by the step (counted there)
        x = torch.zeros(batch, seq, dtype=torch.long)
        with Recorder() as micro:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, loss = model(x, x)
            loss.backward()
        with Recorder() as step, fake_step_counts():
            opt.step(**({"grads_finite": True} if level == "O2" else {}))
    return micro.ops, step.ops


# -----------------------------------------------------------------------------
# 2. Price


def price(ops, hw, eager=False):
    """Seconds on `hw` for the recorded ops, compiled: {"gemm", "gemm_fp8", "attention", "memory",
    "kernels" (memory-bound kernels after fusion), "total"}. eager: as eager code runs them (O2's
    optimizer step), each operator its own kernel, and the total at least HOST_OP_S per operator."""
    if eager:
        gpu = sum(max((sum(n for _, n in r) + sum(n for _, n in w)) / (hw["hbm"] * hw["eff_hbm"]),
                      f / ((hw["fp8"] * hw["eff_fp8"]) if fp8 else (hw["bf16"] * hw["eff_bf16"])), KERNEL_MIN_S)
                  for _, f, fp8, r, w in ops)
        return dict(gemm=0.0, gemm_fp8=0.0, attention=0.0, memory=gpu, kernels=len(ops),
                    total=max(gpu, len(ops) * HOST_OP_S))
    readers = {}  # storage -> indices of the ops that read it
    for i, (_, _, _, reads, _) in enumerate(ops):
        for sid, _ in reads:
            readers.setdefault(sid, []).append(i)
    t = dict(gemm=0.0, gemm_fp8=0.0, attention=0.0, memory=0.0, kernels=0)
    group = []

    def close():
        if not group:
            return
        inside = set(group)
        written = {sid: n for i in group for sid, n in ops[i][4]}
        nbytes = sum(dict((sid, n) for i in group for sid, n in ops[i][3] if sid not in written).values())
        # an output counts if something outside the kernel reads it, or nothing in this step does
        # (a gradient, a weight, optimizer state, an activation saved for the backward pass)
        nbytes += sum(n for sid, n in written.items()
                      if any(j not in inside for j in readers.get(sid, [])) or sid not in readers)
        t["memory"] += max(nbytes / (hw["hbm"] * hw["eff_hbm"]), KERNEL_MIN_S)
        t["kernels"] += 1
        group.clear()

    for i, (name, flops, fp8, reads, writes) in enumerate(ops):
        if name == TRITON:
            close()
            t["memory"] += max(sum(n for _, n in reads) / (hw["hbm"] * hw["eff_hbm"]), KERNEL_MIN_S)
            t["kernels"] += 1
            continue
        if flops:
            close()
            nbytes = sum(n for _, n in reads) + sum(n for _, n in writes)
            if name in ATTENTION:
                t["attention"] += max(flops / (hw["bf16"] * hw["eff_attn"]), nbytes / (hw["hbm"] * hw["eff_hbm"]))
            else:
                peak = hw["fp8"] * hw["eff_fp8"] if fp8 else hw["bf16"] * hw["eff_bf16"]
                t["gemm_fp8" if fp8 else "gemm"] += max(flops / peak, nbytes / (hw["hbm"] * hw["eff_hbm"]), KERNEL_MIN_S)
            continue
        group.append(i)
        big_in = max((n for _, n in reads), default=0)
        if name in FULL_REDUCTIONS and big_in > 64 and all(n <= 64 for _, n in writes):
            close()  # a value of the whole tensor: its readers are another pass
    close()
    t["total"] = t["gemm"] + t["gemm_fp8"] + t["attention"] + t["memory"]
    return t


def step_compiled(level, recipe=()):
    """Does a CUDA run compile this level's optimizer step? torch's fused AdamW (bf16, O1: a few
    kernels) and O2's fused step (o2_fused: the default where the model is compiled) are priced
    as compiled code (O3's step, several ranks', is not among the levels priced here)."""
    import train

    cfg = train.load_config([f"precision={level}", *recipe])
    return level in ("bf16", "O1") or (level == "O2" and cfg["o2_fused"] is not False)


def price_layers(model_args, level, batch, seq, recipe, hw):
    """price() of a micro-step and of an optimizer step. Every block issues the same operators,
    so a deep model is priced from its 1- and 2-block versions: t(L) = t(1) + (L - 1)(t(2) - t(1))
    (exact where each block's ops are priced alike; it keeps an 8B model to seconds of counting)."""
    n = model_args["n_layer"]
    if n <= 2:
        micro, step = count_step(model_args, level, batch, seq, recipe)
        return price(micro, hw), price(step, hw, eager=not step_compiled(level, recipe))
    one, two = (price_layers(model_args | {"n_layer": k}, level, batch, seq, recipe, hw) for k in (1, 2))
    return tuple({k: a[k] + (n - 1) * (b[k] - a[k]) for k in a} for a, b in zip(one, two))


def predict(model_args, batch, seq, gpu="H100", accum=1, optimizer_share=1.0, recipes=None):
    """Predicted time per micro-step (the optimizer step amortized over `accum` micro-steps, and
    scaled by optimizer_share: 1/N under FSDP over N GPUs) for bf16, O1 and O2 (and any other
    {name: (level, recipe overrides)} in recipes). Returns {name: {...seconds, tokens_per_s}}."""
    hw = HARDWARE[gpu]
    recipes = recipes or {"bf16": ("bf16", ()), "O1": ("O1", ()), "O2": ("O2", ())}
    out = {}
    for name, (level, recipe) in recipes.items():
        t, t_opt = price_layers(model_args, level, batch, seq, recipe, hw)
        total = t["total"] + t_opt["total"] * optimizer_share / accum
        out[name] = {**{k: round(v * 1e3, 4) for k, v in t.items() if k != "kernels"}, "kernels": round(t["kernels"]),
                     "optimizer_ms": round(t_opt["total"] * 1e3, 4), "step_ms": round(total * 1e3, 4),
                     "tokens_per_s": round(batch * seq / total)}
    base = out.get("bf16")
    for r in out.values():
        r["speedup_vs_bf16"] = round(base["step_ms"] / r["step_ms"], 3) if base else None
    return out


# -----------------------------------------------------------------------------
# Validation against published measurements, and the sweep


def gpt2_like(n_layer, n_embd, vocab=50304, bias=True):
    return dict(arch="gpt2", n_layer=n_layer, n_head=max(1, n_embd // 64), n_embd=n_embd, vocab_size=vocab,
                bias=bias, tie_embeddings=True)


LLAMA3_8B = dict(arch="llama", n_layer=32, n_head=32, n_embd=4096, mlp_hidden=14336, vocab_size=128256,
                 bias=False, tie_embeddings=False)
ROWWISE = ("fp8_granularity=row", "fp8_formats=e4m3")  # torchao's rowwise recipe: E4M3 throughout

# (what, model, batch, seq, optimizer share, {name: (level, recipe)}, published speedup of
# "fp8" over "bf16", source). nanochat: its GPT (untied, no biases, 65536-token vocabulary, 2048
# tokens, ReLU^2 MLP: GELU here) at depth 12 (d768) and 26 (d1664); published: FP8 slower at d12,
# faster at d26 (1.17x tokens/s at width 1664).
VALIDATION = [
    ("Llama3-8B, tensorwise (torchao/torchtitan, 8x H100, FSDP)", LLAMA3_8B, 1, 8192, 1 / 8,
     {"bf16": ("bf16", ()), "fp8": ("O1", ())}, 1.25, "torchtitan float8 docs: +25% tensorwise"),
    ("Llama3-8B, rowwise (torchao/torchtitan, 8x H100, FSDP)", LLAMA3_8B, 1, 8192, 1 / 8,
     {"bf16": ("bf16", ()), "fp8": ("O1", ROWWISE)}, 1.10, "torchtitan float8 docs: +10% rowwise"),
    ("nanochat d12 (n_embd 768)", gpt2_like(12, 768, 65536, False) | {"tie_embeddings": False}, 32, 2048, 1.0,
     {"bf16": ("bf16", ()), "fp8": ("O1", ())}, "<1", "nanochat: FP8 slower at d12"),
    ("nanochat d26 (n_embd 1664)", gpt2_like(26, 1664, 65536, False) | {"tie_embeddings": False}, 16, 2048, 1.0,
     {"bf16": ("bf16", ()), "fp8": ("O1", ())}, 1.17, "nanochat: 1.17x tokens/s at width 1664"),
]


def validate(gpu="H100"):
    rows = []
    for what, model, batch, seq, share, recipes, published, source in VALIDATION:
        r = predict(model, batch, seq, gpu, optimizer_share=share, recipes=recipes)
        pred = r["fp8"]["speedup_vs_bf16"]
        if published == "<1":
            err, ok = None, pred < 1
        else:
            err = round(100 * (pred - published) / published, 1)
            ok = None
        rows.append({"case": what, "predicted_speedup": pred, "published": published, "error_pct": err,
                     "direction_right": ok, "source": source,
                     "bf16_ms": r["bf16"]["step_ms"], "fp8_ms": r["fp8"]["step_ms"]})
    return rows


# bench.py throughput's models, as predict() takes them: (model, batch, seq)
GPU_MODELS = {"gpt2-124M": (gpt2_like(12, 768), 8, 1024), "wide-4096": (gpt2_like(4, 4096), 8, 1024),
              "d2048-24L": (gpt2_like(24, 2048), 8, 1024)}


def against_gpu(folder=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gpu")):
    """Every compiled tokens/s ratio to bf16 measured in folder's throughput_*.json (bench.py
    throughput on a GPU; one micro-step per optimizer step), beside this code's prediction for
    the same GPU, model and level. A measurement made at another commit measured other code:
    its commit is given with it."""
    rows = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if not (name.startswith("throughput_") and name.endswith(".json")):
            continue
        d = json.load(open(os.path.join(folder, name)))
        env = d.get("env", d)
        gpu = next((g for g in HARDWARE if g in env["device"]), None)
        runs = {}
        for r in d["throughput"]:
            if r["compile"] and r["model"] in GPU_MODELS:
                runs.setdefault((r["model"], r["level"]), []).append(r["tokens_per_s"])
        for (model, level), tps in sorted(runs.items()):
            base = runs.get((model, "bf16"))
            if gpu is None or level == "bf16" or not base or level not in ("O1", "O2"):
                continue
            measured = sorted(tps)[(len(tps) - 1) // 2] / sorted(base)[(len(base) - 1) // 2]
            args, batch, seq = GPU_MODELS[model]
            pred = predict(args, batch, seq, gpu, accum=1, recipes={"bf16": ("bf16", ()), level: (level, ())})
            p = pred[level]["speedup_vs_bf16"]
            rows.append({"file": name, "commit": env.get("commit"), "gpu": gpu, "model": model, "level": level,
                         "measured": round(measured, 3), "predicted": p,
                         "error_pct": round(100 * (p - measured) / measured, 1)})
    return rows


SWEEP = [(12, 768), (24, 1024), (24, 1536), (24, 2048), (32, 2560), (32, 4096)]


def sweep(gpu="H100", batch=8, seq=2048, accum=8):
    rows = []
    for n_layer, n_embd in SWEEP:
        r = predict(gpt2_like(n_layer, n_embd), batch, seq, gpu, accum=accum)
        rows.append({"n_layer": n_layer, "n_embd": n_embd, **{f"{k}_ms": v["step_ms"] for k, v in r.items()},
                     **{f"{k}_speedup": v["speedup_vs_bf16"] for k, v in r.items() if k != "bf16"}})
    return rows


def assumptions(gpu):
    hw = HARDWARE[gpu]
    return (f"{gpu}: peak {hw['bf16'] / 1e12:.0f} TFLOPS bf16 x {hw['eff_bf16']}, {hw['fp8'] / 1e12:.0f} FP8 x "
            f"{hw['eff_fp8']}, attention at {hw['eff_attn']} of bf16 peak (causal: half the square), HBM "
            f"{hw['hbm'] / 1e12:.2f} TB/s x {hw['eff_hbm']}; each memory-bound kernel >= {KERNEL_MIN_S * 1e6:.0f} us; "
            "compiled: the ops between two GEMMs fuse into one kernel (a tensor amax ends it); one GPU, "
            "no communication, no host overhead")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--gpu", default="H100", choices=sorted(HARDWARE))
    ap.add_argument("--n_layer", type=int)
    ap.add_argument("--n_embd", type=int)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--accum", type=int, default=8, help="micro-steps per optimizer step")
    ap.add_argument("--json", help="write the figures here (JSON)")
    args = ap.parse_args(argv)
    print(f"assumptions: {assumptions(args.gpu)}")
    result = {"gpu": args.gpu, "assumptions": assumptions(args.gpu), "torch": torch.__version__}
    if args.n_layer and args.n_embd:
        r = predict(gpt2_like(args.n_layer, args.n_embd), args.batch, args.seq, args.gpu, args.accum)
        for k, v in r.items():
            print(f"{k:5s} {v['step_ms']:9.3f} ms per micro-step ({v['tokens_per_s']:,} tokens/s), "
                  f"{v['speedup_vs_bf16']:.3f}x bf16's speed; GEMMs {v['gemm'] + v['gemm_fp8']:.3f} ms, "
                  f"memory-bound {v['memory']:.3f} ms in {v['kernels']} kernels, optimizer {v['optimizer_ms']:.3f} ms/step")
        result["model"] = {"n_layer": args.n_layer, "n_embd": args.n_embd, "batch": args.batch, "seq": args.seq,
                           "accum": args.accum, "levels": r}
    else:
        print("\nvalidation (predicted FP8 speedup over bf16 against published measurements, H100):")
        result["validation"] = validate("H100")
        for v in result["validation"]:
            verdict = (f"error {v['error_pct']:+.1f}%" if v["error_pct"] is not None
                       else f"direction {'right' if v['direction_right'] else 'WRONG'}")
            print(f"  {v['case']:58s} predicted {v['predicted_speedup']:.3f}x, published {v['published']}: {verdict}")
        errs = [abs(v["error_pct"]) for v in result["validation"] if v["error_pct"] is not None]
        result["max_abs_error_pct"] = max(errs)
        print(f"  largest error: {max(errs):.1f}%; directions right: "
              f"{all(v['direction_right'] for v in result['validation'] if v['direction_right'] is not None)}")
        print("\nagainst the GPU measurements of results/gpu/ (compiled, tokens/s over bf16's; the code "
              "measured is that of the commit named):")
        result["against_gpu"] = against_gpu()
        for v in result["against_gpu"]:
            print(f"  {v['gpu']} {v['model']:10s} {v['level']}: measured {v['measured']:.3f}x (commit {v['commit']}), "
                  f"predicted for this code {v['predicted']:.3f}x: error {v['error_pct']:+.1f}%")
        print(f"\nsweep (GPT-2-like, {args.batch} x {args.seq} tokens per micro-step, {args.accum} micro-steps "
              f"per step, {args.gpu}): speedup over bf16")
        result["sweep"] = sweep(args.gpu, args.batch, args.seq, args.accum)
        for r in result["sweep"]:
            print(f"  {r['n_layer']:3d} layers, d={r['n_embd']:5d}: O1 {r['O1_speedup']:.3f}x, O2 {r['O2_speedup']:.3f}x "
                  f"(bf16 {r['bf16_ms']:.2f} ms per micro-step)")
        pays = [r["n_embd"] for r in result["sweep"] if r["O1_speedup"] > 1]
        result["o1_pays_from_n_embd"] = min(pays) if pays else None
        print(f"  O1 is faster than bf16 from d={result['o1_pays_from_n_embd']} on")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
