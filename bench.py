"""
Evidence for nanofp8, from one script. Each subcommand prints a table and, with --json, writes
the same figures (plus machine, date and versions) as JSON.

    python bench.py memory      bytes per parameter of the training state, and activation bytes
                                per token, for bf16 / O1 / O2 (with FP8 v, with FP8 gradient
                                accumulation), measured by walking the real tensors
                                (nanofp8/memory.py: training_state_bytes)
    python bench.py state       how fine the scales of O2's stored state (FP8 gradient, Adam m and
                                v) must be: the fraction of values each granularity flushes to zero,
                                on the README model's real gradients and moments and on adversarial
                                ones (nanofp8/optim.py, (7))
    python bench.py comm        bytes each rank puts on the wire per parameter per step, for the
                                bf16 baseline (fp32 gradient all-reduce, as nanoGPT's DDP), O1,
                                O2 and O3, at 2 and 4 gloo ranks (counted by nanofp8/counter.py),
                                the FP8 layers' bytes apart from the whole model's
    python bench.py parity      BF16 vs every FP8 level, recipe and layout on shakespeare_char at
                                equal steps, at several seeds (each run a child process, kept in
                                --runs: resumable), plus longer runs: the gap to bf16 seed by seed
                                with its uncertainty, the noise floor and a verdict per target
                                (parity_cpu.json), curves (parity.csv, parity.png)
    python bench.py throughput  tokens/s and peak memory, fp32 / BF16 / O1 / O2, the levels taking
                                turns over several rounds
    python bench.py gemm        the kernels benchmark (python kernels.py)
    python bench.py kernels     what a GPU would run, counted on any machine: the non-GEMM kernels
                                and the bytes per token of one compiled GPT-2 block, forward and
                                backward, per level (inductor's CUDA fusion rules applied to the
                                CPU graph: nanofp8/schedule.py), and the launches and bytes of one
                                optimizer step outside the compiled graphs
    python bench.py design      the design card's measures: lines of the core files, the project
                                functions one O1 Linear step and one O2 optimizer step run through,
                                beside their budgets (reported, not enforced by the tests)
    python bench.py predict     predicted H100 (or B200) step time of bf16, O1 and O2 from the ops
                                this code issues, priced by a roofline (predict.py), validated
                                against published FP8 speedups
    python bench.py stats DIR   per-layer heatmaps (SQNR, underflow, saturation) over the steps and
                                amax trends, as PNG, from DIR/fp8_stats.jsonl (train.py with
                                fp8_stats_interval > 0); --cost: step time with the statistics off,
                                every 100 steps and every step

Nothing here is typed in by hand: every figure is measured when the command runs.
"""

import argparse
import glob
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone

import torch
import torch.nn as nn

from nanofp8.fp8 import GRANULARITIES, Recipe
from nanofp8.layout import leave_process
from nanofp8.model import GPT, GPTConfig, apply_fp8, fp8_module_filter
from nanofp8.memory import activation_bytes, training_state_bytes
from nanofp8.o2_compile import cast_for_step, push_amaxes
from nanofp8.optim import ADAMW_MOMENTS, fp8_grad

REPO = os.path.dirname(os.path.abspath(__file__))


def environment():
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    # the vector ISA torch's CPU kernels use, and whether the CPU has bf16 matrix instructions:
    # without them (AVX2, plain AVX512) bf16 GEMMs run far slower than fp32 ones, with them faster
    bf16 = [n for n, f in (("AVX512-BF16", "_is_avx512_bf16_supported"), ("AMX", "_is_amx_tile_supported"))
            if getattr(torch.cpu, f, lambda: False)()]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    return {"device": dev, "commit": commit or None, "command": " ".join(["python"] + sys.argv),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_bf16_instructions": " ".join(bf16) or "none",
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
            "triton": triton_version, "python": platform.python_version()}


def emit(name, rows, columns, args, extra=None):
    """Print rows (list of dicts) as a table; write {"env", name: rows} as JSON if asked."""
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths)))
    if args.json:
        out = {"env": environment(), name: rows, **(extra or {})}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")


def _fmt(v):
    return f"{v:.3f}" if isinstance(v, float) else str(v)


# -----------------------------------------------------------------------------
# memory

MODELS = {
    # GPT-2 124M (config/gpt2_*.py)
    "gpt2-124M": GPTConfig(arch="gpt2", n_layer=12, n_head=12, n_embd=768, vocab_size=50304, block_size=1024),
    # the LLaMA-style config (config/llama_*.py: 16 layers, width 2048). Bytes per parameter do not
    # depend on the depth, so --llama_layers (default 2) keeps this within a laptop's memory; the
    # "model" column is then for that depth (embeddings weigh more in a shallower model).
    "llama": GPTConfig(arch="llama", n_layer=16, n_head=16, n_embd=2048, vocab_size=50304,
                       block_size=2048, bias=False, tie_embeddings=False),
    # for the tests: runs in seconds
    "tiny": GPTConfig(arch="gpt2", n_layer=2, n_head=2, n_embd=64, vocab_size=128, block_size=64),
}
# The levels the memory table measures: name -> train.py's overrides. O2's two variants: sqrt(v)
# stored in E4M3 instead of v in fp16 ("-fp8v"), micro-steps summed in FP8 instead of in an fp16
# buffer ("-fp8acc"; nanofp8/optim.py, (6)).
LEVELS = {
    "bf16": dict(precision="bf16"),
    "O1": dict(precision="O1"),
    "O2": dict(precision="O2"),
    "O2-fp8v": dict(precision="O2", o2_v_format="fp8"),
    "O2-fp8acc": dict(precision="O2", o2_grad_accum="fp8"),
    "O2-fp8v-fp8acc": dict(precision="O2", o2_v_format="fp8", o2_grad_accum="fp8"),
    "O1-mxfp8": dict(precision="O1", fp8_recipe="mxfp8"),
    "O1-fp8attn": dict(precision="O1", fp8_attention=True),  # Q K^T and P V in FP8 (nanofp8/attention.py)
}
WITH_RANKS = {"O3": dict(precision="O3")}  # levels build() also takes, for runs on several ranks (comm)
# and the other recipes that throughput and kernels measure
RECIPE_LEVELS = {"O1-delayed": dict(precision="O1", fp8_recipe="delayed"),
                 "O1-rowwise": dict(precision="O1", fp8_recipe="rowwise"),
                 "O2-fused": dict(precision="O2", o2_fused=True)}  # (the optimizer step compiled)


def build(cfg, level, backend=None, device="cpu"):
    """A model on `device` and its optimizer at a precision level, built by train.py's own
    setup_precision and build_optimizer. Returns (model, optimizer, train.py's settings, for
    train.optimizer_step). level: a name in LEVELS, or O3; backend: train.py's fp8_backend."""
    import train

    overrides = {**LEVELS, **WITH_RANKS, **RECIPE_LEVELS}[level]
    settings = train.load_config([f"{k}={v}" for k, v in overrides.items()]
                                 + [f"fp8_backend={backend}", "compile=False"])
    torch.manual_seed(0)
    model = GPT(cfg)
    train.setup_precision(model, settings, device.split(":")[0])
    model.to(device)
    opt = train.build_optimizer(model, settings, device.split(":")[0])
    cast_for_step(model, record=False)  # O1's FP8 weights for the first step, as train.py casts them
    return model, opt, settings


def measure_memory(cfg, level, tokens):
    model, opt, _ = build(cfg, level, "torch")
    idx = torch.randint(0, cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    ac = torch.autocast("cpu", dtype=torch.bfloat16)
    with ac:
        loss = model(idx, idx)[1]
    loss.backward()
    opt.step()  # creates the optimizer state
    opt.zero_grad()
    # Activation memory per token: the saved tensors also hold weights (and their bf16 casts),
    # which do not grow with the sequence, so take the slope between two lengths.
    with ac:
        short = idx[:, : tokens // 2]
        act_short = activation_bytes(lambda: model(short, short))[0]
        act, (_, loss) = activation_bytes(lambda: model(idx, idx))
    loss.backward()  # gradients present, as they are between micro-steps
    acc = training_state_bytes(model, opt, is_block_linear=fp8_module_filter())
    lin, tot = acc["linear"], acc["model"]
    # At the step: O2 has cast its summed gradient to FP8 (reading fp8_grad does it)
    for p in model.parameters():
        fp8_grad(p)
    at_step = training_state_bytes(model, opt, is_block_linear=fp8_module_filter())["linear"]
    return {"level": level, "params": tot["params"],
            "linear_B_per_param": lin["per_param"],
            "linear_B_per_param_at_step": at_step["per_param"],
            "linear_weight": lin["weight"] / lin["params"], "linear_grad": lin["grad"] / lin["params"],
            "linear_optim": lin["optimizer"] / lin["params"],
            "gemm_weight_B_per_param": lin["gemm_weight"] / lin["params"],
            "model_B_per_param": tot["per_param"],
            "activation_B_per_token": (act - act_short) / (tokens - tokens // 2)}


def memory_models(args):
    """(label, GPTConfig) of each model the memory subcommands measure (llama cut to --llama_layers)."""
    for name in args.models:
        cfg = MODELS[name]
        if name == "llama":
            cfg = GPTConfig(**{**cfg.__dict__, "n_layer": args.llama_layers})
        yield (name if name != "llama" else f"llama-{cfg.n_layer}L"), cfg


def cmd_memory(args):
    rows = []
    for label, cfg in memory_models(args):
        for level in LEVELS:
            rows.append({"model": label, **measure_memory(cfg, level, args.tokens)})
            print(f"  measured {label} {level}", file=sys.stderr)
    cols = ["model", "level", "params", "linear_B_per_param", "linear_B_per_param_at_step", "linear_weight",
            "linear_grad", "linear_optim", "gemm_weight_B_per_param", "model_B_per_param", "activation_B_per_token"]
    print("Training state in bytes per parameter (block Linears, then whole model), measured by "
          "walking the tensors after a backward (as between micro-steps); at_step = once the step has "
          "cast O2's summed gradient to FP8; gemm_weight = FP8 copies held from forward to step.")
    emit("memory", rows, cols, args, {"tokens": args.tokens})
    cmd_memory_frozen(args)


# Frozen FP8 models (nanofp8/checkpoint.py: freeze_fp8): the weights of an inference model, or of
# the frozen reference / reward model of RLHF or distillation, which needs no master copy at all.
# The finer granularities, whose scales cost bytes (a per-tensor scale is 4 bytes per weight matrix).
FROZEN_GRANULARITIES = tuple(g for g in GRANULARITIES if g != "tensor")


def measure_frozen(cfg, granularity):
    """Weight bytes of the frozen FP8 model against the same model in bf16. The block Linears are
    measured on the frozen model (E4M3 bytes + fp32 scales); the other tensors (embeddings, norms,
    LM head) are counted at 2 B, as a bf16 inference model would hold them."""
    from nanofp8.checkpoint import freeze_fp8

    torch.manual_seed(0)
    model = GPT(cfg)
    total = sum(p.numel() for p in model.parameters())  # a tied table once
    _, st = freeze_fp8(model, granularity)
    rest = total - st["weights"]
    mb = 2**20
    return {"granularity": granularity, "params": total,
            "linear_bf16_MB": st["bf16"] / mb, "linear_fp8_MB": st["fp8"] / mb,
            "linear_fp8_B_per_weight": st["fp8"] / st["weights"],
            "linear_fp8_vs_bf16": st["fp8"] / st["bf16"],
            "model_bf16_MB": 2 * total / mb, "model_fp8_MB": (st["fp8"] + 2 * rest) / mb,
            "model_fp8_vs_bf16": (st["fp8"] + 2 * rest) / (2 * total)}


def cmd_memory_frozen(args):
    rows = [{"model": label, **measure_frozen(cfg, g)} for label, cfg in memory_models(args)
            for g in FROZEN_GRANULARITIES]
    print("\nFrozen FP8 model (freeze_fp8: block Linears in E4M3 + fp32 scales, the rest bf16) vs the "
          "same model in bf16, weight bytes (sample.py --fp8_weights=True prints the val-loss cost)")
    cols = ["model", "granularity", "params", "linear_bf16_MB", "linear_fp8_MB", "linear_fp8_B_per_weight",
            "linear_fp8_vs_bf16", "model_bf16_MB", "model_fp8_MB", "model_fp8_vs_bf16"]
    emit("memory_frozen_fp8", rows, cols, argparse.Namespace(json=None))
    if args.json:  # added to the file cmd_memory wrote
        with open(args.json) as f:
            data = json.load(f)
        data["memory_frozen_fp8"] = rows
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)


# -----------------------------------------------------------------------------
# state: how fine the scales of O2's stored state must be (nanofp8/optim.py, (7))

STATE_GRANULARITIES = ("tensor", "row", 2048, 1024, 512, 256, 128, 64, 32)


def _flushed(x, gran, fmt):
    """The fraction of x's non-zero values that its stored copy flushes to zero: fmt "e4m3" (a
    scale that maps each group's amax to 448) or "fp16" (a power-of-two scale that maps it near
    2^14, as nanofp8/optim.py stores v), one scale per `gran` ("tensor", "row", or that many
    consecutive values of the flattened tensor)."""
    from nanofp8.fp8 import E4M3, compute_scale

    xs = x.reshape(1, -1) if gran == "tensor" else x.reshape(x.shape[0], -1) if gran == "row" else x.reshape(-1, gran)
    amax = xs.abs().amax(1, keepdim=True)
    if fmt == "e4m3":
        back = (xs * compute_scale(amax, E4M3)).clamp(-E4M3.max, E4M3.max).to(E4M3.dtype)
    else:
        back = (xs * torch.exp2(torch.floor(torch.log2(2.0**14 / amax.clamp(min=1e-38))).clamp(-126, 126))).half()
    nonzero = xs != 0
    return ((back == 0) & nonzero).sum().item() / max(nonzero.sum().item(), 1)


def _state_of_training(steps, keep):
    """The README model (config/shakespeare_char.py's sizes and AdamW settings) trained in fp32
    with torch.optim.AdamW: {step: [(weight gradient, m, v) of every block Linear]}."""
    from nanofp8.configurator import read_dataset_meta
    from nanofp8.data import batch_generator, data_dir, get_batch, open_splits
    from nanofp8.layout import Layout

    import train

    cfg = train.load_config([os.path.join(REPO, "config", "shakespeare_char.py"), "device=cpu"])
    data = open_splits(cfg["dataset"], cfg["block_size"], Layout())
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=cfg["n_layer"], n_head=cfg["n_head"], n_embd=cfg["n_embd"], block_size=cfg["block_size"],
                          bias=cfg["bias"], vocab_size=read_dataset_meta(data_dir(cfg["dataset"]))["vocab_size"]))
    lins = [m for n, m in model.named_modules() if isinstance(m, nn.Linear) and fp8_module_filter()(n, m)]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["learning_rate"], betas=(cfg["beta1"], cfg["beta2"]),
                            weight_decay=cfg["weight_decay"])
    out = {}
    for it in range(1, steps + 1):
        for g in opt.param_groups:
            g["lr"] = train.lr_at(it - 1, {**cfg, "lr_decay_iters": steps})
        x, y = get_batch(data["train"], cfg["batch_size"], cfg["block_size"], batch_generator(0, 0, it, 0, 0), "cpu")
        model(x, y)[1].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
        grads = [m.weight.grad.clone() for m in lins]
        opt.step()
        opt.zero_grad()
        if it in keep:
            out[it] = [(g, *(opt.state[m.weight][mo.key].clone() for mo in ADAMW_MOMENTS["fp16"].values()))
                       for g, m in zip(grads, lins)]
    return out, sorted({m.in_features for m in lins})


def cmd_state(args):
    """Fractions of values that each granularity of scales flushes to zero in O2's stored state:
    on the README model's real gradients and moments, and on adversarial gradients."""
    keep = sorted({1, 10, 100, args.steps})
    snaps, widths = _state_of_training(args.steps, keep)
    gen = torch.Generator().manual_seed(0)
    synthetic = {}
    for k in (128, 768):
        for span in (24, 35):  # tests/test_o2_numerics.py's first steps: log2 |g| with a std of span / 7.2
            synthetic[f"lognormal_2^{span}_k{k}"] = torch.exp2(torch.randn(768, k, generator=gen) * span / 7.2)
        x = torch.randn(768, k, generator=gen)
        x[1::2] *= 1e-6
        synthetic[f"rows_1e6_k{k}"] = x
    rows = []
    for gran in STATE_GRANULARITIES:
        row = {"granularity": gran, "scale_B_per_value": 0.0 if gran == "tensor" else None if gran == "row" else 4 / gran,
               "whole_rows": gran in ("tensor", "row") or all(w % gran == 0 for w in widths)}
        for name, idx, fmt in (("g", 0, "e4m3"), ("m", 1, "e4m3"), ("v_fp16", 2, "fp16"), ("sqrt_v_e4m3", 2, "e4m3")):
            row[f"model_{name}_flushed_max"] = max(
                _flushed(t[idx].sqrt() if name.startswith("sqrt") else t[idx], gran, fmt) for s in keep for t in snaps[s])
        for name, x in synthetic.items():
            row[f"{name}_flushed"] = _flushed(x, gran, "e4m3")
        rows.append(row)
    print(f"Fraction of non-zero values flushed to zero by each granularity of scales (nanofp8/optim.py, (7)): "
          f"the README model (block Linear widths {widths}) trained {args.steps} steps in fp32, worst over steps "
          f"{keep} and layers; then, in E4M3, 768 rows of k values: lognormal magnitudes (log2 |g| with a std of "
          f"span / 7.2, as tests/test_o2_numerics.py's first steps over 2^span) and rows 1e6 apart")
    emit("state", rows, list(rows[0]), args, {"steps": keep, "widths": widths})


# -----------------------------------------------------------------------------
# comm

COMM_CFG = GPTConfig(arch="gpt2", n_layer=2, n_head=4, n_embd=128, vocab_size=256, block_size=64)


def _comm_worker(rank, world, port, out):
    """Every measure of `bench.py comm` on `world` gloo ranks, in one process group (a spawn of
    the ranks costs more than the measures): the hand-written engine's levels, engine=torch's,
    and at 2 ranks the model-parallel cuts. Rank 0 saves them to out."""
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    res = {"dp": {level: _comm_level(rank, level) for level in ("bf16", "O1", "O2", "O3")},
           "torch": {level: _comm_torch_level(rank, world, level) for level in ("bf16", "O1")},
           "mp": _comm_mp(world) if world == 2 else None}
    if rank == 0:
        torch.save(res, out)
    dist.destroy_process_group()
    leave_process(0)  # (the worker's end: see nanofp8/layout.py)


def _comm_level(rank, level):
    """Three training steps of COMM_CFG at `level` on the gloo ranks, counting the bytes of the
    FP8 layers (their weight gradients, and under O3 their gathered weights) apart from the bytes
    of every other parameter (embeddings, LM head, norms, biases: fp32 gradients)."""
    from nanofp8 import dist as fdist
    from nanofp8.zero import sync_fp8_wgrads

    model, opt, _ = build(COMM_CFG, level, "torch")  # as train.py builds them
    # The FP8 layers' weights (bf16: the same block Linears, whose gradients go in fp32).
    lin = [m.weight for fqn, m in model.named_modules()
           if isinstance(m, nn.Linear) and fp8_module_filter()(fqn, m)]
    others = [p for p in model.parameters() if all(p is not w for w in lin)]
    # As train.py: bf16 sends every gradient in fp32; O1 the FP8 weight gradients in E4M3 (with
    # a scale per 128 values of one parameter); O2/O3 send their FP8 gradients themselves.
    dp_lin = None
    if level in ("bf16", "O1"):
        dp_lin = fdist.Fp8DataParallel(model, fmt=torch.float32 if level == "bf16" else fdist.E4M3,
                                       params=lin, fp8_params=lin, overlap=False, broadcast=False)
    dp_rest = fdist.Fp8DataParallel(model, params=others, overlap=False)
    idx = torch.randint(0, COMM_CFG.vocab_size, (4, COMM_CFG.block_size), generator=torch.Generator().manual_seed(rank))
    steps, lin_bytes, rest_bytes = 3, 0, 0
    fdist.comm_stats(reset=True)
    for _ in range(steps):
        model(idx, idx)[1].backward()
        ok = dp_rest.sync_gradients()
        rest_bytes += fdist.comm_stats(reset=True)["bytes_sent"]
        if dp_lin is not None:
            ok = dp_lin.sync_gradients() and ok
        if level == "O2":
            sync_fp8_wgrads(model.parameters())
        if level == "O3":  # reduce-scatter of FP8 gradients, flags, all-gather of FP8 weights
            opt.step(grads_finite=ok)
        lin_bytes += fdist.comm_stats(reset=True)["bytes_sent"]
        if level != "O3":
            opt.step()
        opt.zero_grad()  # (Fp8AdamW's clears the FP8 gradients too)
    n = sum(p.numel() for p in model.parameters())
    n_lin = sum(p.numel() for p in lin)
    return {"fp8_layers": lin_bytes / steps / n_lin, "rest": rest_bytes / steps / (n - n_lin),
            "model": (lin_bytes + rest_bytes) / steps / n, "params": n, "linear_params": n_lin}


# Model parallelism: what the cut model sends per token, FP8 against BF16 (2 gloo ranks).
COMM_MP = {  # name: (tensor_parallel, sequence_parallel, pipeline_parallel, what travels)
    "tensor": (2, False, 1, "all-reduce of row-parallel outputs; bwd: of column-parallel input grads"),
    "tensor+sequence": (2, True, 1, "all-gather before column-parallel, reduce-scatter after "
                                    "row-parallel; bwd: mirrored"),
    "pipeline": (1, False, 2, "activations across the stage boundary; bwd: their gradients"),
}


def _comm_mp(world):
    """One forward and one training step of COMM_CFG, cut as in COMM_MP, with FP8 layers and FP8
    communication, then with the BF16 layers of the same cut (bf16 GEMMs and collectives);
    bytes from nanofp8/dist.py's COMM counter."""
    import torch.distributed as dist
    from nanofp8 import dist as fdist
    from nanofp8 import parallel as P
    from nanofp8.fp8 import E4M3, E5M2

    batch = torch.randint(0, COMM_CFG.vocab_size, (4, COMM_CFG.block_size + 1),
                          generator=torch.Generator().manual_seed(0))  # the same on every rank
    micro = [(batch[:, :-1], batch[:, 1:])]
    res = {}
    for name, (tp, sp, pp, _) in COMM_MP.items():
        groups = P.make_groups(tp=tp, pp=pp)
        for comm in ("fp8", "bf16"):
            for train in (False, True):
                torch.manual_seed(0)
                model = GPT(COMM_CFG)
                if comm == "fp8":
                    apply_fp8(model, Recipe(backend="emulate"))
                P.parallelize(model, groups.tp_group, sp=sp, comm=comm)
                stage = P.PipelineStage(model, groups)
                fmts = (E4M3, E5M2) if comm == "fp8" else (torch.bfloat16, torch.bfloat16)
                fdist.comm_stats(reset=True)
                P.pipeline_step(stage, micro, groups, autocast=torch.autocast("cpu", dtype=torch.bfloat16),
                                act_fmt=fmts[0], grad_fmt=fmts[1], train=train)
                by_op = fdist.comm_stats(reset=True)["by_op"]
                # Per layer, only the layers' traffic: not the SP region's edges (the fp32 residual
                # stream gathered once per forward) nor the loss broadcast.
                ops = {k: v["bytes_sent"] for k, v in by_op.items()
                       if (k.startswith("pp_send") if pp > 1 else k != "all_gather_float32")}
                sent = torch.tensor([float(sum(ops.values()))])
                names = [None] * world
                dist.all_gather_object(names, sorted(ops))
                if pp > 1:  # activations go one way, gradients the other: count both ranks
                    dist.all_reduce(sent)
                res[name, comm, train] = {"bytes": sent.item(), "ops": sorted(set(sum(names, [])))}
    return res


def comm_model_parallel(res):
    """Rows of bytes per token (per block for TP, per stage boundary for PP), FP8 vs BF16, from
    _comm_mp's counts."""
    tokens = 4 * COMM_CFG.block_size
    rows = []
    for name, (tp, sp, pp, what) in COMM_MP.items():
        per = tokens if pp > 1 else tokens * COMM_CFG.n_layer
        for train in (False, True):
            fp8, bf16 = (res[name, c, train]["bytes"] / per for c in ("fp8", "bf16"))
            rows.append({"parallel": name, "pass": "fwd+bwd" if train else "fwd",
                         "unit": "both ranks, per boundary" if pp > 1 else "one rank, per block",
                         "fp8_B_per_token": fp8, "bf16_B_per_token": bf16, "fp8_vs_bf16": fp8 / bf16,
                         "fp8_ops": " ".join(res[name, "fp8", train]["ops"]), "what": what})
    return rows


def _comm_torch_level(rank, world, level):
    """engine=torch: three training steps of COMM_CFG sharded by FSDP2 as train.py shards it
    (nanofp8/torchstack.py; at O1 the block Linears' weights gathered in FP8, nanofp8/fsdp.py),
    counting what FSDP2 hands its all-gathers and reduce-scatters (its custom-collective hooks,
    which call the same collectives) and what fsdp.py adds to COMM (the amax all-reduces)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    from nanofp8 import dist as fdist
    from nanofp8 import torchstack
    from nanofp8.fsdp import agree_after_steps
    from nanofp8.layout import make_layout

    model, _, _ = build(COMM_CFG, level, "torch")
    model = torchstack.shard_model(model, {"precision": level, "sequence_parallel": False, "fsdp_param_dtype": "fp32"},
                                   make_layout(device="cpu", engine="torch"), "fp8")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if level == "O1":  # the amaxes agreed once per step, as train.py agrees them (run.restore_state)
        agree_after_steps(opt, model)
    sent = {"all_gather": 0, "reduce_scatter": 0}
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # (torch 2.11: the latter)
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    class Gather(AllGather):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            sent["all_gather"] += input_tensor.nbytes * (world - 1)
            return gather(output_tensor, input_tensor, group=group, async_op=async_op)

    class Scatter(ReduceScatter):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            sent["reduce_scatter"] += input_tensor.nbytes * (world - 1) / world
            return scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_custom_all_gather(Gather())
            m.set_custom_reduce_scatter(Scatter())
    idx = torch.randint(0, COMM_CFG.vocab_size, (4, COMM_CFG.block_size), generator=torch.Generator().manual_seed(rank))
    steps = 3
    fdist.comm_stats(reset=True)
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(idx, idx)[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
    ours = fdist.comm_stats(reset=True)["by_op"]
    n = sum(p.numel() for p in model.parameters())
    return {k: v / steps / n for k, v in sent.items()} | {
        "fp8_all_gather": ours.get("fsdp_all_gather_fp8", {}).get("bytes_sent", 0) / steps / n,
        "amax": ours.get("fsdp_amax_all_reduce", {}).get("bytes_sent", 0) / steps / n}


def _on_ranks(worker, world, *args):
    """worker(rank, world, port, *args, out) on `world` gloo ranks; returns what rank 0 saved to out."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(tempfile.mkdtemp(), "result.pt")
    mp.spawn(worker, args=(world, port, *args, out), nprocs=world, join=True)
    return torch.load(out, weights_only=False)


def comm_torch(results):
    """Rows of bytes per parameter per step under engine=torch's FSDP2, bf16 and O1."""
    rows = []
    for world, res in results.items():
        base = None
        for level, r in res["torch"].items():
            total = r["all_gather"] + r["reduce_scatter"] + r["amax"]
            base = base or total
            rows.append({"world": world, "engine": "torch (FSDP2)", "level": level,
                         "all_gather_B_per_param": r["all_gather"], "of_which_fp8": r["fp8_all_gather"],
                         "reduce_scatter_B_per_param": r["reduce_scatter"], "amax_B_per_param": r["amax"],
                         "model_B_per_param": total, "model_vs_bf16": total / base})
    return rows


def cmd_comm(args):
    results = {world: _on_ranks(_comm_worker, world) for world in args.worlds}
    rows = []
    for world, res in results.items():
        base = None
        for level, r in res["dp"].items():
            base = base or r
            rows.append({"world": world, "level": level,
                         "fp8_layers_B_per_param": r["fp8_layers"],
                         "fp8_layers_vs_fp32": r["fp8_layers"] / base["fp8_layers"],
                         "rest_B_per_param": r["rest"],
                         "model_B_per_param": r["model"], "model_vs_fp32": r["model"] / base["model"],
                         "fp8_layer_share": r["linear_params"] / r["params"]})
    print("Bytes each rank puts on the wire per parameter per step, gloo, "
          f"{COMM_CFG.n_layer}-layer GPT of width {COMM_CFG.n_embd}. fp8_layers: the block Linears "
          "(weight gradients; O3: + gathered weights), rest: every other parameter (fp32 gradients), "
          "model: all of it; baseline = bf16 level (fp32 gradient all-reduce)")
    emit("comm", rows, ["world", "level", "fp8_layers_B_per_param", "fp8_layers_vs_fp32", "rest_B_per_param",
                        "model_B_per_param", "model_vs_fp32", "fp8_layer_share"],
         argparse.Namespace(json=None))  # printed; written below
    torch_rows = comm_torch(results)
    print("\nengine=torch (FSDP2), same GPT and steps: bytes each rank puts on the wire per parameter per "
          "step; all-gathers run before each block's forward and again before its backward, gradients are "
          "reduce-scattered in fp32; O1 gathers the block Linears' weights in FP8 (of_which_fp8)")
    emit("comm_torch", torch_rows, ["world", "engine", "level", "all_gather_B_per_param", "of_which_fp8",
                                    "reduce_scatter_B_per_param", "amax_B_per_param", "model_B_per_param",
                                    "model_vs_bf16"], argparse.Namespace(json=None))
    # (measured on 2 ranks: a cut of the model into 2; a run without world 2 measures it there too)
    mp_rows = comm_model_parallel(results[2]["mp"] if 2 in results else _on_ranks(_comm_worker, 2)["mp"])
    print(f"\nModel parallelism on 2 gloo ranks, same GPT, batch 4 x {COMM_CFG.block_size}: bytes on the "
          "wire per token, FP8 layers and payloads (+ scales) vs BF16 layers of the same cut")
    emit("comm_model_parallel", mp_rows, ["parallel", "pass", "unit", "fp8_B_per_token", "bf16_B_per_token",
                                          "fp8_vs_bf16", "fp8_ops"], args, {"comm": rows, "comm_torch": torch_rows})


# -----------------------------------------------------------------------------
# parity: every variant at several seeds, each run a child process with its own CPU time

# Every variant differs from the bf16 run in its precision settings and layout only: same model,
# hyper-parameters, steps and tokens per step. name -> (train.py overrides, processes).
VARIANTS = {
    "bf16": ({"precision": "bf16"}, 1),
    "O1": ({"precision": "O1"}, 1),
    "O1-delayed": ({"precision": "O1", "fp8_scaling": "delayed"}, 1),
    "O1-row": ({"precision": "O1", "fp8_granularity": "row"}, 1),
    "O1-block": ({"precision": "O1", "fp8_granularity": "block", "fp8_formats": "e4m3"}, 1),
    "O1-mxfp8": ({"precision": "O1", "fp8_recipe": "mxfp8"}, 1),
    "O2": ({"precision": "O2"}, 1),
    "O2-fp8v": ({"precision": "O2", "o2_v_format": "fp8"}, 1),
    # two gloo ranks of half the batch each: the same 16 sequences per step as one process
    "O3-dp2": ({"precision": "O3", "batch_size": 8, "gradient_accumulation_steps": 2}, 2),
    "O1-tp2-sp": ({"precision": "O1", "tensor_parallel": 2, "sequence_parallel": True}, 2),
    "O1-pp2": ({"precision": "O1", "pipeline_parallel": 2}, 2),
    "O1-fp8attn": ({"precision": "O1", "fp8_attention": True}, 1),
}
# The same seed gives the same initial weights, training batches and evaluation text at every
# level, so a variant's gap is taken seed by seed against bf16 (paired). Not quite for these:
# each data-parallel rank draws its own batches, so they share the initial weights and only part
# of the text. (The paired standard error is taken from the per-seed gaps themselves, so it stays
# honest where the pairing is weaker: it is just not as small.)
OWN_BATCHES = {"O3-dp2"}
# What a reader needs next to a variant's verdict: what it changes against its neighbour
NOTES = {
    "O2-fp8v": "It differs from O2 only in how Adam's second moment is stored: sqrt(v) in E4M3 instead of v "
               "in fp16 (1 byte per parameter less). FP8-LM keeps v in fp16 because in FP8 it underflows and it "
               "sits in the update's denominator; here sqrt(v) has a scale per 128 values and is rounded "
               "stochastically (nanofp8/optim.py, (5) and (7)), and its gap lies within O2's uncertainty.",
}
TARGET, BLOCK_TARGET = 0.01, 0.0025  # the largest relative gap in final val loss a variant may have
MIN_SEEDS = 3  # fewer pairs than this: no verdict
LONG_SEED = 0  # the seed of the long runs
# Student t, 97.5% quantile by degrees of freedom: the 95% interval of a mean of n values is
# mean +- T975[n - 1] * standard error. From 10 on, 10's value (a little wider than it need be).
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}
METHOD = {
    "final_val_loss": "val loss at the last step (eval_iters batches, the same text for bf16 and the variant "
                      "at one seed); mean and std (n - 1) over seeds",
    "gap": "paired: mean over seeds of (variant - bf16) / bf16 at the same seed, bf16 run on the same machine "
           "where it ran there too (a twin: bf16_on_two_machines shows how far one seed lands on two machines), "
           "else on another (pairs_across_machines counts those); gap_se = std of those per-seed gaps / sqrt(n); "
           "gap_ci95 = gap +- t(0.975, n - 1) * gap_se",
    "gap_unpaired": "(mean of the variant - mean of bf16) / mean of bf16, with the standard error of a "
                    "difference of two independent means, sqrt(s_v^2 / n_v + s_bf16^2 / n_bf16) / mean of bf16",
    "noise_floor": "bf16's seed-to-seed std of the final val loss / its mean: how far two bf16 runs "
                   "differing only in their seed land apart",
    "verdict": "from the paired gap (it cancels what a seed does to both runs): 'met' when the whole "
               "95% interval lies below the target, 'missed' when it lies above, 'unresolvable' when it "
               f"contains the target, 'incomplete' with fewer than {MIN_SEEDS} seeds done for both",
    "cpu_seconds": "user + system CPU time of a run's processes (all ranks; os.wait4), mean over the seeds "
                   "run on each machine ('machines'), never across machines: CPU time, not wall time, as runs "
                   "shared the machine",
}


def target(variant):
    return BLOCK_TARGET if VARIANTS[variant][0].get("fp8_granularity") == "block" else TARGET


def run_path(runs_dir, name, seed, iters, tag=None):
    """The record of a run; tag: a machine's, for a twin (the same run again on another machine)."""
    return os.path.join(runs_dir, f"{name}-seed{seed}-{iters}{'' if tag is None else '-' + tag}.json")


def machine_tag(env):
    """A short name for a run's machine (_machine): 'avx2', 'avx512-avx512-bf16', ..."""
    bf16 = env.get("cpu_bf16_instructions", "none")
    return "-".join([env.get("cpu_capability", "unknown")] + ([] if bf16 == "none" else bf16.split())).lower()


def start_run(name, seed, iters, config, threads, set_=()):
    """Start one training run (variant, seed, steps) as a child process: `python train.py ...` or
    torchrun for the multi-process variants. Returns (popen, history path, record without
    results, temporary directory)."""
    over, procs = VARIANTS[name]
    over = {**over, **dict(a.split("=", 1) for a in set_)}
    tmp = tempfile.mkdtemp(prefix="parity-")
    argv = [os.path.relpath(config, REPO), f"out_dir={tmp}", "always_save_checkpoint=False", f"max_iters={iters}",
            f"lr_decay_iters={iters}", f"seed={seed}", "device=cpu"] + [f"{k}={v}" for k, v in over.items()]
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"]
              if procs > 1 else [sys.executable])
    out = os.path.join(tmp, "history.json")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    with open(os.path.join(tmp, "log.txt"), "w") as log:  # the child holds its own copy
        p = subprocess.Popen(launch + ["bench.py", "train", out] + argv, cwd=REPO, env=env, stdout=log, stderr=log,
                             start_new_session=True)  # its own process group: run_all can stop all its ranks
    rec = {"variant": name, "seed": seed, "iters": iters, "processes": procs, "threads_per_process": threads,
           "command": " ".join(["python" if procs == 1 else f"torchrun --nproc_per_node={procs}", "train.py"] + argv[:1]
                               + [a for a in argv[1:] if not a.startswith("out_dir=")]),
           "env": environment(), "commit": subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO,
                                                          capture_output=True, text=True).stdout.strip()}
    return p, out, rec, tmp


def cmd_train(args):
    """One run of start_run's child: train.main, then rank 0 writes the history as JSON."""
    import train

    h = train.main(args.argv)
    if os.environ.get("RANK", "0") == "0":
        with open(args.out, "w") as f:
            json.dump({"losses": h["losses"], "evals": h["evals"]}, f)


def run_all(todo, config, runs_dir, jobs, threads, set_=(), twins=False):
    """Run (variant, seed, iters) triples not yet in runs_dir, `jobs` at a time, and write each as
    runs_dir/<variant>-seed<seed>-<iters>.json with its CPU seconds (os.wait4: the child and the
    ranks it waited for), so that runs sharing the machine still report their own cost.
    twins=True: a triple whose run was made on another machine is run again on this one, and kept
    beside it as <variant>-seed<seed>-<iters>-<machine tag>.json (a twin: summarize pairs a run
    with the bf16 run of its own machine where one exists)."""
    os.makedirs(runs_dir, exist_ok=True)
    here = machine_tag(environment())

    def done(t):
        path = run_path(runs_dir, *t)
        if not os.path.exists(path) or not twins:
            return os.path.exists(path)
        return machine_tag(json.load(open(path)).get("env", {})) == here or os.path.exists(run_path(runs_dir, *t, here))

    todo = [t for t in todo if not done(t)]
    running = {}
    try:
        while todo or running:
            while todo and len(running) < jobs:
                name, seed, iters = todo.pop(0)
                p, out, rec, tmp = start_run(name, seed, iters, config, threads, set_)
                running[p.pid] = (p, out, rec, tmp, time.time())
                print(f"== start {name} seed {seed} ({iters} steps): {rec['command']}", file=sys.stderr)
            pid, status, ru = os.wait4(-1, 0)
            if pid not in running:
                continue
            p, out, rec, tmp, t0 = running.pop(pid)
            p.returncode = os.waitstatus_to_exitcode(status)
            if p.returncode != 0:
                raise RuntimeError(f"{rec['variant']} seed {rec['seed']} failed (exit {p.returncode}); "
                                   f"log: {os.path.join(tmp, 'log.txt')}")
            rec.update(json.load(open(out)), cpu_seconds=ru.ru_utime + ru.ru_stime, wall_seconds=time.time() - t0)
            path = run_path(runs_dir, rec["variant"], rec["seed"], rec["iters"])
            with open(path if not os.path.exists(path) else run_path(runs_dir, rec["variant"], rec["seed"],
                                                                     rec["iters"], here), "w") as f:
                json.dump(rec, f)
            shutil.rmtree(tmp)
            print(f"== done {rec['variant']} seed {rec['seed']}: val {rec['evals'][-1][2]:.4f}, "
                  f"{rec['cpu_seconds']:.0f} CPU s", file=sys.stderr)
    except BaseException:  # a failed run, Ctrl-C: stop the other runs, every rank, and leave no orphan
        for q, *_ in running.values():  # (each child leads its own process group: start_run)
            os.killpg(q.pid, signal.SIGTERM)
            q.wait()
        raise


def load_runs(runs_dir, twins=False):
    """{(variant, seed, iters): record} of the finished runs in runs_dir; twins=True: the twins
    instead (run_all), {(variant, seed, iters, machine): record}."""
    runs = {}
    for name in sorted(os.listdir(runs_dir)) if os.path.isdir(runs_dir) else []:
        if name.endswith(".json"):
            with open(os.path.join(runs_dir, name)) as f:
                r = json.load(f)
            twin = name != os.path.basename(run_path(runs_dir, r["variant"], r["seed"], r["iters"]))
            if twin and twins:
                runs[r["variant"], r["seed"], r["iters"], _machine(r)] = r
            elif not twin and not twins:
                runs[r["variant"], r["seed"], r["iters"]] = r
    return runs


def _mean_std(xs):
    m = sum(xs) / len(xs)
    return m, (sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5 if len(xs) > 1 else None


def verdict(gaps, tgt):
    """(verdict, mean, standard error, 95% interval) of per-seed relative gaps against a target."""
    n = len(gaps)
    if n == 0:
        return "incomplete", None, None, None
    m, s = _mean_std(gaps)
    if n < MIN_SEEDS:
        return "incomplete", m, None if s is None else s / n ** 0.5, None
    se = s / n ** 0.5
    lo, hi = m - T975[min(n - 1, 10)] * se, m + T975[min(n - 1, 10)] * se
    return ("met" if hi < tgt else "missed" if lo > tgt else "unresolvable"), m, se, [lo, hi]


def _machine(run):
    """What sets a run's CPU time: the CPU and the vector instructions torch's kernels use."""
    e = run.get("env", {})
    return (f"{e.get('device', '?')}, {e.get('cpu_capability', 'CPU capability not recorded')}, "
            f"bf16 matrix instructions: {e.get('cpu_bf16_instructions', 'not recorded')}")


def summarize(runs, variants, seeds, iters, long_variants=(), long_iters=0, twins=None):
    """The parity table from finished runs: per variant the final val loss over seeds, its paired
    and unpaired gap to bf16 with their uncertainties, and the verdict against its target
    (METHOD says how each is computed); then the long runs (one seed each, LONG_SEED). twins
    (load_runs(twins=True)): bf16 runs made again on another machine; a run is paired with the
    bf16 run of its own machine where there is one (the same seed lands apart on two machines)."""
    final = {k: r["evals"][-1][2] for k, r in runs.items() if r["evals"][-1][0] == r["iters"]}
    base = {s: final[("bf16", s, iters)] for s in seeds if ("bf16", s, iters) in final}
    b_mean, b_std = _mean_std(list(base.values())) if base else (None, None)
    # CPU time is a property of the machine (bf16 GEMMs: 16x apart between AVX2 and AVX512-BF16),
    # so it is averaged per machine, never across machines
    mach = {k: _machine(r) for k, r in runs.items()}
    base_on = {(s, mach["bf16", s, iters]): b for s, b in base.items()}  # bf16 by (seed, machine)
    base_on.update({(s, m): r["evals"][-1][2] for (v, s, n, m), r in (twins or {}).items()
                    if v == "bf16" and n == iters and s in base and r["evals"][-1][0] == n})
    machine_effect = [{"seed": s, "final_val_loss": {m: b for (s2, m), b in base_on.items() if s2 == s}}
                      for s in base if sum(s2 == s for s2, _ in base_on) > 1]
    machines = sorted(set(mach.values()), key=lambda m: min(runs[k]["env"].get("date", "") for k in runs
                                                             if mach[k] == m))

    def cpu_by_machine(v, ss):
        t = {m: [runs[v, s, iters]["cpu_seconds"] for s in ss if mach[v, s, iters] == m] for m in machines}
        return {m: sum(x) / len(x) for m, x in t.items() if x}

    b_cpu = cpu_by_machine("bf16", base)
    rows = []
    for v in variants:
        done = [s for s in seeds if (v, s, iters) in final]
        pairs = [s for s in done if s in base]
        row = {"variant": v, "processes": VARIANTS[v][1], "seeds": done, "n": len(done), "verdict": "baseline"}
        if v != "bf16":
            paired = [base_on.get((s, mach[v, s, iters]), base[s]) for s in pairs]
            verd, gap, se, ci = verdict([(final[v, s, iters] - b) / b for s, b in zip(pairs, paired)], target(v))
            row.update(target=target(v), verdict=verd, gap=gap, gap_se=se, gap_ci95=ci, pairing=(
                "same initial weights; batches partly shared (each rank draws its own)" if v in OWN_BATCHES
                else "same initial weights, batches and evaluation text"),
                pairs_across_machines=sum((s, mach[v, s, iters]) not in base_on for s in pairs))
            if len(pairs) < len(seeds):
                row["note"] = f"{len(pairs)} of {len(seeds)} seeds done (with bf16 at the same seed)"
        if done:
            mean, std = _mean_std([final[v, s, iters] for s in done])
            row.update(final_val_mean=mean, final_val_std=std, command=runs[v, done[0], iters]["command"],
                       cpu_seconds=cpu_by_machine(v, done))
            row["cpu_seconds_vs_bf16"] = {m: t / b_cpu[m] for m, t in row["cpu_seconds"].items() if m in b_cpu}
            if base and v != "bf16":
                row["gap_unpaired"] = (mean - b_mean) / b_mean
                if std is not None and b_std is not None:
                    row["gap_unpaired_se"] = (std ** 2 / len(done) + b_std ** 2 / len(base)) ** 0.5 / b_mean
        rows.append(row)
    long_rows = []
    for v in long_variants:
        if (v, LONG_SEED, long_iters) in final:
            val, b = final[v, LONG_SEED, long_iters], final.get(("bf16", LONG_SEED, long_iters))
            long_rows.append({"variant": v, "seed": LONG_SEED, "iters": long_iters, "final_val_loss": val,
                              "gap": None if b is None else (val - b) / b,
                              "cpu_seconds": runs[v, LONG_SEED, long_iters]["cpu_seconds"],
                              "machine": mach[v, LONG_SEED, long_iters],
                              "commit": runs[v, LONG_SEED, long_iters].get("commit", "")})
    run_envs = [r.get("env", {}) for r in runs.values()]
    return {"env": environment(), "iters": iters, "seeds": list(seeds), "method": METHOD,
            "noise_floor": None if b_std is None else b_std / b_mean, "bf16_seeds": len(base),
            "bf16_on_two_machines": machine_effect,
            "parity": rows, "long": long_rows, "long_note": "one seed each: no uncertainty of their own",
            "machines": [{"machine": m, "dates": sorted({runs[k]["env"].get("date", "?")[:10] for k in runs
                                                         if mach[k] == m}),
                          "runs": sum(x == m for x in mach.values())} for m in machines],
            "runs": {"devices": sorted({e.get("device", "?") for e in run_envs}),
                     "torch": sorted({e.get("torch", "?") for e in run_envs}),
                     "commits": sorted({r.get("commit", "") for r in runs.values()})}}


def cmd_parity(args):
    """Run what --runs lacks (unless --no_run), then summarize every finished run asked for:
    parity_cpu.json, parity.csv and parity.png in --out."""
    todo = [(v, s, args.iters) for v in args.variants for s in args.seeds]
    todo += [(v, LONG_SEED, args.long_iters) for v in args.long_variants if args.long_iters]
    if not args.no_run:
        run_all(todo, args.config, args.runs, args.jobs, args.threads, args.set, args.twins)
    runs = {k: r for k, r in load_runs(args.runs).items() if k in set(todo)}
    twins = {k: r for k, r in load_runs(args.runs, twins=True).items() if k[:3] in set(todo)}
    d = summarize(runs, args.variants, args.seeds, args.iters, args.long_variants, args.long_iters, twins)
    d["config"] = os.path.relpath(args.config, REPO)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "parity.csv"), "w") as f:
        f.write("variant,seed,iters,kind,iter,loss\n")
        for (v, s, n), r in sorted(runs.items()):
            f.writelines(f"{v},{s},{n},train,{i},{l:.4f}\n" for i, l in r["losses"])
            f.writelines(f"{v},{s},{n},val,{i},{l:.4f}\n" for i, _, l in r["evals"])
    plot_parity(runs, d, os.path.join(args.out, "parity.png"))
    print(f"Final val loss at {args.iters} steps ({d['config']}), over seeds {args.seeds}; gap = paired "
          f"relative gap to bf16 +- its standard error; noise floor (bf16 seed-to-seed std) "
          f"{_pct(d['noise_floor'], '')}; CPU seconds are CPU time per run")
    letters = _letters(d)
    table = [{**r, "gap": _pct(r.get("gap")), "gap_se": _pct(r.get("gap_se"), ""), "target": _pct(r.get("target"), ""),
              "cpu_seconds": _cpu_cell(r.get("cpu_seconds"), None, letters)} for r in d["parity"]]
    emit("parity", table, ["variant", "n", "final_val_mean", "final_val_std", "gap", "gap_se", "target",
                           "verdict", "cpu_seconds"], argparse.Namespace(json=None))
    print("CPU seconds per run on each machine: " + "; ".join(f"{letters[m['machine']]} = {m['machine']}"
                                                               for m in d["machines"]))
    with open(os.path.join(args.out, "parity_cpu.json"), "w") as f:
        json.dump(d, f, indent=1)
    print(f"wrote parity_cpu.json, parity.csv and parity.png in {args.out}")


def _smooth(ys, k):
    import numpy as np

    ys = np.asarray(ys, dtype=float)
    c = np.cumsum(np.concatenate([[0.0], ys]))
    lo = np.maximum(0, np.arange(len(ys)) - k + 1)  # a trailing mean over up to k steps
    return (c[1:] - c[lo]) / (np.arange(len(ys)) + 1 - lo)


def _plot_runs(ax, ax_val, curves, colour, label):
    """The mean over runs of the smoothed train loss on ax and of the val loss on ax_val, each with
    a band from the lowest to the highest run."""
    import numpy as np

    it, ev = [i for i, _ in curves[0]["losses"]], [e[0] for e in curves[0]["evals"]]
    tr = np.array([_smooth([l for _, l in cv["losses"]], max(1, curves[0]["iters"] // 50)) for cv in curves])
    va = np.array([[e[2] for e in cv["evals"]] for cv in curves])
    for a, x, y, kw in ((ax, it, tr, {"label": label}), (ax_val, ev, va, {"marker": "o", "ms": 3})):
        a.plot(x, y.mean(0), color=colour, lw=1, **kw)
        a.fill_between(x, y.min(0), y.max(0), color=colour, alpha=0.2, lw=0)


def plot_parity(runs, d, path):
    """Four panels: train loss (smoothed) and val loss of the main runs, the mean over seeds with a
    band from the lowest to the highest seed; the paired gaps with their 95% intervals, targets
    and noise floor; the long runs."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, k = d["parity"], max(1, d["iters"] // 50)
    colour = {r["variant"]: plt.cm.tab10(i % 10) for i, r in enumerate(rows)}
    fig, ((a, b), (c, e)) = plt.subplots(2, 2, figsize=(13, 9))
    for r in (r for r in rows if r["seeds"]):
        _plot_runs(a, b, [runs[r["variant"], s, d["iters"]] for s in r["seeds"]], colour[r["variant"]],
                   f"{r['variant']} ({r['n']} seeds)")
    for r in d["long"]:
        _plot_runs(e, e, [runs[r["variant"], r["seed"], r["iters"]]], colour.get(r["variant"]),
                   f"{r['variant']} (seed {r['seed']})")
    for ax in (a, b, e):  # the loss falls from ~4.4 at first: leave the first quarter off the scale
        ys = [y for ln in ax.lines for x, y in zip(ln.get_xdata(), ln.get_ydata()) if x >= max(ln.get_xdata()) / 4]
        if ys:
            ax.set_ylim(min(ys) - 0.05, max(ys) + 0.05)
    a.set(title=f"train loss (trailing mean over {k} steps), band = min..max over seeds", xlabel="iteration")
    b.set(title="val loss, band = min..max over seeds", xlabel="iteration")
    e.set(title="long runs: train loss (smoothed), val loss (dots)", xlabel="iteration")
    fp8 = [r for r in rows if r.get("gap") is not None]
    if d["noise_floor"]:
        c.axvspan(-100 * d["noise_floor"], 100 * d["noise_floor"], color="grey", alpha=0.2,
                  label="noise floor: +- bf16 seed-to-seed std")
    for y, r in enumerate(fp8):
        lo, hi = r["gap_ci95"] or (r["gap"], r["gap"])
        c.errorbar(100 * r["gap"], y, xerr=[[100 * (r["gap"] - lo)], [100 * (hi - r["gap"])]], fmt="o",
                   color=colour[r["variant"]], capsize=3)
        c.plot([100 * r["target"]] * 2, [y - 0.4, y + 0.4], color="red", lw=2)
    c.set_yticks(range(len(fp8)), [f"{r['variant']}: {r['verdict']}" for r in fp8], fontsize=8)
    c.axvline(0, color="black", lw=0.5)
    c.set(title="paired gap to bf16 (%), 95% interval; red: target", xlabel="final val loss gap (%)")
    for ax, empty in ((a, False), (c, not fp8), (e, not d["long"])):
        if empty:
            ax.text(0.5, 0.5, "no run finished yet", ha="center", transform=ax.transAxes)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(f"FP8 vs BF16 at equal steps and seeds: {d['config']}, {d['iters']} steps")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -----------------------------------------------------------------------------
# throughput

THROUGHPUT_MODELS = {
    "gpt2-124M": (MODELS["gpt2-124M"], 8, 1024),  # (config, batch, sequence)
    "gpt2-xl": (GPTConfig(arch="gpt2", n_layer=48, n_head=25, n_embd=1600, vocab_size=50304, block_size=1024), 4, 1024),
    "llama-1B": (MODELS["llama"], 4, 2048),
    # GPT-2's layer at the width where predict.py says FP8 pays well (d=4096), 4 layers deep so
    # that it compiles in about a minute: the second point a GPU run checks the prediction at
    "wide-4096": (GPTConfig(arch="gpt2", n_layer=4, n_head=64, n_embd=4096, vocab_size=50304, block_size=1024), 8, 1024),
    # 24 layers at width 2048 (1.2B parameters): where the training state outweighs the
    # activations, so what O2's formats save shows in the peak memory
    "d2048-24L": (GPTConfig(arch="gpt2", n_layer=24, n_head=16, n_embd=2048, vocab_size=50304, block_size=1024), 8, 1024),
    # what a CPU can run in seconds
    "cpu-small": (GPTConfig(arch="gpt2", n_layer=4, n_head=4, n_embd=256, vocab_size=256, block_size=128), 8, 128),
    # config/shakespeare_char_fp8.py's model and batch
    "shakespeare-char": (GPTConfig(arch="gpt2", n_layer=4, n_head=4, n_embd=128, vocab_size=84, block_size=64,
                                   bias=False), 16, 64),
    "tiny": (MODELS["tiny"], 2, 32),  # for the tests
}


# fp32: the bf16 level's model with autocast off. On a CPU whose torch has no bf16 GEMM (AVX2:
# environment()'s cpu_capability) bf16 is far slower than fp32, so there the ratios to both say
# what the machine does, not what FP8 does.
THROUGHPUT_LEVELS = ("fp32", "bf16", "O1", "O2", "O1-mxfp8")
# measured when named (--levels ... O1-fp8attn): its attention is one FP8 GEMM per head (a compile
# unrolls them all), so it is no default
EXTRA_THROUGHPUT_LEVELS = ("O1-fp8attn", "O1-delayed", "O1-rowwise")
STEP_TARGET = 1.5  # the CPU main job: O1's step time at most this many times bf16's (issue #19)


def measure_throughput(cfg, level, batch, seq, steps, compile_model, device, profile=None):
    """Tokens per second of train.py's training step (forward, backward, optimizer_step: clip,
    non-finite check, update) on one device, with train.py's FP8 backend for the device (emulated
    on a CPU, as the main job runs), and the peak memory on CUDA. profile=N: also the N kernels
    (operators on a CPU) of one more step that took the most time, as a third element."""
    import gc

    import train

    gc.collect()  # the last level's model, before this one's peak memory is measured
    model, opt, settings = build(cfg, "bf16" if level == "fp32" else level, None, device)
    if compile_model:
        # Each level's model is a fresh compile: past dynamo's recompile limit (8 per code object)
        # a later model would run eagerly and be timed as if compiled. The compiled kernels stay in
        # inductor's cache on disk, so a second round does not compile them again.
        torch._dynamo.reset()
    fwd = torch.compile(model) if compile_model else model
    idx = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
    ac = torch.autocast(device, dtype=torch.bfloat16, enabled=level != "fp32")

    def step():
        with ac:
            loss = fwd(idx, idx)[1]
        loss.backward()
        if compile_model:
            push_amaxes(model)  # (delayed scaling: what train.py does after a compiled backward)
        train.optimizer_step(model, opt, settings)

    for _ in range(2):  # warm-up (and compilation)
        step()
    parts = None
    if device == "cuda":  # where one step's peak goes: what stays between steps (weights, optimizer
        # state, FP8 casts), what the forward keeps for backward, and what comes and goes beyond it
        torch.cuda.synchronize()
        state = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with ac:
            loss = fwd(idx, idx)[1]
        kept = torch.cuda.memory_allocated()
        loss.backward()
        if compile_model:
            push_amaxes(model)
        train.optimizer_step(model, opt, settings)
        torch.cuda.synchronize()
        del loss
        parts = {"state_GiB": state / 2**30, "saved_for_backward_GiB": (kept - state) / 2**30,
                 "transient_GiB": (torch.cuda.max_memory_allocated() - kept) / 2**30}
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / steps
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    if profile is not None:  # one more step under the profiler: its kernels, by device time
        with torch.profiler.profile() as prof:
            step()
            if device == "cuda":
                torch.cuda.synchronize()
        key = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
        events = sorted(prof.key_averages(), key=lambda e: -getattr(e, key))[:profile]
        return batch * seq / dt, peak, [{"name": e.key[:90], "calls": e.count, "ms": getattr(e, key) / 1e3}
                                        for e in events]
    return batch * seq / dt, (peak, parts) if parts else peak


def cmd_throughput(args):
    """Each level measured in every round, the levels taking turns, so that a load that drifts
    over the run slows them alike; the median round per level, and its ratio to bf16 and fp32.
    Each measurement builds its model afresh (on a GPU: compiles again), so that one model at a
    time is in memory."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    names = args.models or (["gpt2-124M", "gpt2-xl", "llama-1B"] if device == "cuda" else ["shakespeare-char", "cpu-small"])
    compiles = [False, True] if (device == "cuda" and not args.no_compile) else [False]
    if args.compiled_only:
        compiles = [True]
    levels = args.levels
    rows, profiles = [], []
    for name in names:
        cfg, batch, seq = THROUGHPUT_MODELS[name]
        for comp in compiles:
            runs = {level: [] for level in levels}
            for r in range(args.rounds):
                for level in levels:
                    runs[level].append(measure_throughput(cfg, level, batch, seq, args.steps, comp, device))
                    print(f"  {name} {level} compile={comp} round {r}: {runs[level][-1][0]:,.0f} tok/s", file=sys.stderr)
            for level in levels:  # (on CUDA the peak comes with its parts: state, saved, transient)
                runs[level] = [(t, p[0], p[1]) if isinstance(p, tuple) else (t, p, None) for t, p in runs[level]]
            tps = {level: sorted(t for t, *_ in runs[level])[(args.rounds - 1) // 2] for level in levels}
            if args.profile:  # one step of the level named, profiled, after the timed rounds
                profiles.append({"model": name, "level": args.profile, "compile": comp, "top": measure_throughput(
                    cfg, args.profile, batch, seq, 1, comp, device, profile=15)[2]})
            for level in levels:
                rows.append({"model": name, "level": level, "compile": comp, "tokens_per_s": tps[level],
                             "vs_bf16": tps[level] / tps["bf16"] if "bf16" in tps else None,
                             "vs_fp32": tps[level] / tps["fp32"] if "fp32" in tps else None,
                             "peak_GiB": runs[level][0][1], **(runs[level][0][2] or {}), "steps": args.steps,
                             "rounds": args.rounds,
                             "device_kind": "GPU" if device == "cuda" else "CPU (FP8 emulated: not a speed figure)"})
    env = environment()
    print(f"Training throughput, {env['device']} (CPU capability {env['cpu_capability']}), median of "
          f"{args.rounds} rounds of {args.steps} steps, the levels taking turns")
    emit("throughput", rows, ["model", "level", "compile", "tokens_per_s", "vs_bf16", "vs_fp32", "peak_GiB"]
         + (["state_GiB", "saved_for_backward_GiB", "transient_GiB"] if device == "cuda" else []) + ["device_kind"],
         args, extra={"profiles": profiles} if profiles else None)
    for p in profiles:
        print(f"\n{p['model']} {p['level']} compile={p['compile']}: one step's top kernels")
        for e in p["top"]:
            print(f"  {e['ms']:8.3f} ms  {e['calls']:5d}x  {e['name']}")


# -----------------------------------------------------------------------------
# gemm: the kernels benchmark lives next to the kernels


def cmd_gemm(args):
    import subprocess

    cmd = [sys.executable, os.path.join(REPO, "kernels.py")] + (["--json", args.json] if args.json else [])
    sys.exit(subprocess.run(cmd).returncode)


# -----------------------------------------------------------------------------
# kernels: what a compiled block and an optimizer step cost a GPU, counted on any machine

# issue #36's targets for one compiled GPT-2 block (n_embd 768, 8 x 1024 tokens): non-GEMM kernels
# and KB moved per token, forward and backward; and for an O2 optimizer step
COMPILED_BLOCK_TARGET = {"kernels": 45, "KB_per_token": 250}
O2_STEP_TARGET = {"launches": 20, "bytes_per_fp8_value": 20}


def cmd_kernels(args):
    """Per level: one GPT-2 block compiled (forward and backward, bf16 autocast, FP8 on
    torch._scaled_mm), its graphs scheduled by inductor's CUDA rules (nanofp8/schedule.py); and one
    optimizer step of a GPT-2 model outside the compiled graphs, in ATen launches and bytes."""
    from nanofp8 import schedule

    rows = []
    for level in args.levels:
        b = schedule.block_cost(level, n_embd=args.n_embd, n_head=args.n_embd // 64, batch=args.batch, seq=args.seq)
        st = schedule.step_cost(level, n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_embd // 64)
        rows.append({"level": level, "block_kernels": b["kernels"], "block_KB_per_token": b["KB_per_token"],
                     "saved_KB_per_token": b["saved_KB_per_token"],
                     "block_gemms": b["gemms"], "block_graphs": b["graphs"], "step_launches": st["launches"],
                     "step_bytes_per_fp8_value": st["bytes_per_fp8_value"] if st["fp8_values"] else None,
                     "optimizer_launches": st["optimizer_launches"],
                     "optimizer_bytes_per_fp8_value": st["optimizer_bytes_per_fp8_value"] if st["fp8_values"] else None,
                     "step_top_ops": st["top_ops"], "block_kernel_list": b["kernel_list"] if args.list else None})
        print(f"  {level}: block {b['kernels']} kernels, {b['KB_per_token']:.1f} KB/token; step "
              f"{st['launches']} launches, the optimizer's {st['optimizer_launches']}", file=sys.stderr)
    base = next((r for r in rows if r["level"] == "bf16"), None)
    for r in rows:
        r["KB_vs_bf16"] = r["block_KB_per_token"] / base["block_KB_per_token"] if base else None
    print(f"One GPT-2 block (n_embd {args.n_embd}, {args.batch} x {args.seq} tokens) compiled, forward and "
          f"backward, as a GPU's inductor would run it (non-GEMM kernels, KB read and written per token; "
          f"target at O1: <= {COMPILED_BLOCK_TARGET['kernels']} kernels, <= {COMPILED_BLOCK_TARGET['KB_per_token']} KB); one "
          f"optimizer step of a {args.n_layer}-layer model outside the compiled graphs (launches, bytes "
          f"per FP8 weight value; the whole step with clipping and checks, and the optimizer's step alone; "
          f"target at O2: < {O2_STEP_TARGET['launches']} launches, ~{O2_STEP_TARGET['bytes_per_fp8_value']} B). "
          f"{torch.__version__}")
    emit("kernels", rows, ["level", "block_kernels", "block_KB_per_token", "KB_vs_bf16", "saved_KB_per_token",
                           "block_gemms", "block_graphs", "step_launches", "step_bytes_per_fp8_value",
                           "optimizer_launches", "optimizer_bytes_per_fp8_value"], args,
         extra={"block_target": COMPILED_BLOCK_TARGET, "o2_step_target": O2_STEP_TARGET,
                "command": "python bench.py " + " ".join(sys.argv[2:] if len(sys.argv) > 2 else [])})


# -----------------------------------------------------------------------------
# design: the measures of the design card, reported (a fork is free to grow a file)

CORE = ("nanofp8/fp8.py", "nanofp8/optim.py", "nanofp8/dist.py", "nanofp8/model.py", "train.py")
DESIGN_BUDGET = {"core_file_lines": 650, "core_lines": 2620, "train_py_lines": 480, "o1_linear_step_functions": 15,
                 "o2_step_functions": 20, "train_py_from_run": 19}


def functions_called(fn):
    """The distinct project functions (files under the repository, outside tests/) fn() runs
    through, as "file:line qualified name", counted with sys.setprofile."""
    seen, tests = {}, os.path.join(REPO, "tests")

    def profile(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_filename.startswith(REPO + os.sep) and not code.co_filename.startswith(tests) \
                and not code.co_name.startswith("<"):
            seen[(code.co_filename, code.co_firstlineno)] = code.co_qualname
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return sorted(f"{os.path.relpath(f, REPO)}:{line} {name}" for (f, line), name in seen.items())


def cmd_design(args):
    """Lines of the core files; the project functions one O1 step of an Fp8Linear runs through
    (the reference backend, forward and backward) and one O2 optimizer step (the readable loop),
    each after a warm-up; beside the design card's budgets (reported, not enforced)."""
    from nanofp8.fp8 import Fp8Linear
    from nanofp8.optim import Fp8AdamW, convert_to_o2
    from nanofp8.fp8 import convert_to_fp8

    lines = {f: sum(1 for _ in open(os.path.join(REPO, f))) for f in CORE}
    torch.manual_seed(0)
    lin = Fp8Linear(64, 64, recipe=Recipe(backend="emulate"))
    x = torch.randn(8, 64, requires_grad=True)
    lin(x).sum().backward()
    o1 = functions_called(lambda: lin(x).sum().backward())
    model = convert_to_o2(convert_to_fp8(nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)),
                                         Recipe(backend="emulate")))
    opt = Fp8AdamW(model.parameters(), model, foreach=False)
    for _ in range(2):
        model(x.detach()).square().mean().backward()
        if _ == 0:
            opt.step()
            opt.zero_grad()
    o2 = functions_called(opt.step)
    import ast
    tree = ast.parse(open(os.path.join(REPO, "train.py")).read())
    from_run = [a.name for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == "nanofp8.run" for a in n.names]
    b = DESIGN_BUDGET
    rows = [{"measure": f"lines of {f}", "value": n, "budget": b["train_py_lines"] if f == "train.py" else b["core_file_lines"]}
            for f, n in lines.items()]
    rows += [{"measure": "lines of the core", "value": sum(lines.values()), "budget": b["core_lines"]},
             {"measure": "functions of one O1 Linear step", "value": len(o1), "budget": b["o1_linear_step_functions"]},
             {"measure": "functions of one O2 optimizer step", "value": len(o2), "budget": b["o2_step_functions"]},
             {"measure": "names train.py takes from run.py", "value": len(from_run), "budget": b["train_py_from_run"]}]
    for r in rows:
        r["within"] = r["value"] <= r["budget"]
    print("The design card's measures (python bench.py design --list: the functions)")
    emit("design", rows, ["measure", "value", "budget", "within"], args,
         extra={"o1_linear_step": o1, "o2_step": o2})
    if args.list:
        print("\nO1 Linear step:\n  " + "\n  ".join(o1) + "\nO2 optimizer step:\n  " + "\n  ".join(o2))


# -----------------------------------------------------------------------------
# stats: pictures of nanofp8/stats.py's records, and what collecting them costs

STAT_PANELS = (("sqnr_db", "SQNR (dB)", "viridis"), ("underflow", "underflow (% of non-zero values)", "magma"),
               ("saturation", "saturation (% of values)", "magma"))
OPERAND_ORDER = ("x", "w", "dy", "xT", "wT", "dyT", "wgrad")


def cmd_predict(args):
    """The step-time model of predict.py (its own file: it reads standalone), with its arguments."""
    import predict

    predict.main(args.args + (["--json", args.json] if args.json else []))


def cmd_stats(args):
    if args.cost:
        stats_cost(args)
    if args.out_dir:
        for path in plot_stats(args.out_dir, args.out or args.out_dir):
            print(f"wrote {path}")


def plot_stats(stats_dir, out):
    """Heatmaps (one row per metric, one column per operand; layers down, statistics steps across)
    and amax trends (one panel per operand, one line per layer). Returns the PNG paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from nanofp8.stats import read_records

    path = os.path.join(stats_dir, "fp8_stats.jsonl")
    if not os.path.exists(path):
        sys.exit(f"error: {path} not found: train with fp8_stats_interval > 0 and out_dir={stats_dir}")
    try:
        recs = [r for r in read_records(path) if "sqnr_db" in r]  # the casts (not O2's stored moments)
    except ValueError as e:  # a line cut short: named, with its line number
        sys.exit(f"error: {e}")
    if not recs:
        sys.exit(f"error: {path} holds no cast statistics")
    iters = sorted({r["iter"] for r in recs})
    layers = list(dict.fromkeys(r["layer"] for r in recs))
    ops = [o for o in OPERAND_ORDER if any(r["operand"] == o for r in recs)]
    col, row = {it: j for j, it in enumerate(iters)}, {name: i for i, name in enumerate(layers)}
    grid = {}
    for key, _, _ in STAT_PANELS:
        for op in ops:
            grid[key, op] = np.full((len(layers), len(iters)), np.nan)
    amax = {op: np.full((len(layers), len(iters)), np.nan) for op in ops}
    for r in recs:
        if r["operand"] not in ops:
            continue
        i, j = row[r["layer"]], col[r["iter"]]
        for key, _, _ in STAT_PANELS:
            v = r[key]
            grid[key, r["operand"]][i, j] = np.nan if v is None else (v if key == "sqnr_db" else 100 * v)
        amax[r["operand"]][i, j] = r["amax"]

    os.makedirs(out, exist_ok=True)
    fig, axes = plt.subplots(len(STAT_PANELS), len(ops), squeeze=False, layout="constrained",
                             figsize=(3.2 * len(ops) + 2, 0.16 * len(layers) * len(STAT_PANELS) + 2))
    ticks = np.linspace(0, len(iters) - 1, min(len(iters), 5)).round().astype(int)
    for a, (key, title, cmap) in enumerate(STAT_PANELS):
        vals = np.concatenate([grid[key, op].ravel() for op in ops])
        vals = vals[np.isfinite(vals)]
        lo, hi = (vals.min(), vals.max()) if vals.size else (0.0, 1.0)
        if key != "sqnr_db":  # fractions: 0 is black, whatever the largest value
            lo, hi = 0.0, max(hi, 1e-3)
        elif hi == lo:
            lo, hi = lo - 1, hi + 1
        for b, op in enumerate(ops):
            ax = axes[a][b]
            im = ax.imshow(grid[key, op], aspect="auto", interpolation="nearest", cmap=cmap, vmin=lo, vmax=hi)
            ax.set_title(f"{op}: {title}", fontsize=8)
            ax.set_xticks(ticks, [str(iters[t]) for t in ticks], fontsize=6)
            ax.set_yticks(range(len(layers)), layers if b == 0 else [""] * len(layers), fontsize=6)
        fig.colorbar(im, ax=list(axes[a]), fraction=0.02, pad=0.01)  # one scale per metric
    fig.suptitle(f"FP8 cast statistics per layer over training steps "
                 f"({os.path.basename(os.path.normpath(stats_dir))})", fontsize=9)
    heat = os.path.join(out, "fp8_stats_heatmap.png")
    fig.savefig(heat, dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(ops), squeeze=False, figsize=(3.6 * len(ops), 3.4))
    for b, op in enumerate(ops):
        ax = axes[0][b]
        for i, name in enumerate(layers):
            ax.semilogy(iters, amax[op][i], lw=0.8, label=name, color=plt.cm.viridis(i / max(1, len(layers) - 1)))
        ax.set(title=f"amax of {op}", xlabel="iteration")
    axes[0][0].legend(fontsize=5, ncol=2)  # colour runs with depth: first layer dark, last light
    fig.tight_layout()
    trend = os.path.join(out, "fp8_stats_amax.png")
    fig.savefig(trend, dpi=110)
    plt.close(fig)
    return [heat, trend]


def stats_cost(args):
    """Mean training-step time with statistics off, every 100 steps and every step, on one model
    and optimizer. The three settings take turns in blocks of steps, so a machine whose load
    drifts slows them alike."""
    import train
    from nanofp8.stats import Fp8Stats

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg, batch, seq = THROUGHPUT_MODELS[args.model]
    model, opt, train_cfg = build(cfg, "O1", None, device)  # fp8_backend: torch on CUDA, cpu on a CPU
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen).to(device)
    ac = torch.autocast(device, dtype=torch.bfloat16)
    settings = {"off": None, "every 100": Fp8Stats(model, 100), "every 1": Fp8Stats(model, 1)}
    step_of = {k: 0 for k in settings}
    spent = {k: 0.0 for k in settings}

    def step(name):
        st = settings[name]
        if st is not None and st.due(step_of[name]):
            st.start()
        with ac:
            loss = model(idx, idx)[1]
        loss.backward()
        train.optimizer_step(model, opt, train_cfg)
        if st is not None:
            st.finish(step_of[name], opt)
        step_of[name] += 1

    for name in settings:  # warm-up
        step(name)
        step_of[name] = 0
    block = max(1, min(args.steps, 20))
    while min(step_of.values()) < args.steps:
        for name in settings:
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(min(block, args.steps - step_of[name])):
                step(name)
            if device == "cuda":
                torch.cuda.synchronize()
            spent[name] += time.perf_counter() - t0
    base = spent["off"] / args.steps
    rows = [{"model": args.model, "stats": name, "steps": args.steps, "ms_per_step": 1000 * spent[name] / args.steps,
             "vs_off": spent[name] / args.steps / base} for name in settings]
    print(f"Step time with FP8 statistics ({args.model}, O1, {environment()['device']}, "
          f"{'FP8 GEMMs emulated' if device == 'cpu' else 'torch._scaled_mm'}, eager)")
    emit("stats_cost", rows, ["model", "stats", "steps", "ms_per_step", "vs_off"], args)


# -----------------------------------------------------------------------------
# report: the results sections of README.md and docs/*.md, regenerated from results/*.json


def _md_table(rows, cols, fmt=None):
    fmt = fmt or {}
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(fmt.get(c, _fmt)(r.get(c)) for c in cols) + " |")
    return "\n".join(out)


def _env_line(env):
    cpu = ""
    if env.get("cpu_capability") and env["device"].startswith("CPU"):
        cpu = (f" (torch's CPU capability {env['cpu_capability']}, bf16 matrix instructions: "
               f"{env.get('cpu_bf16_instructions', 'not recorded')})")
    return f"*{env['device']}{cpu}, {env['date'][:10]}, torch {env['torch']}, triton {env.get('triton')}*"


def _pct(v, sign="+"):
    return "" if v is None else f"{100 * v:{sign}.2f}%"


def _target_sentence(r):
    """One sentence on a variant against its target, from its row of parity_cpu.json."""
    name, tgt = f"**{r['variant']}** (target {_pct(r.get('target'), '')})", r.get("target")
    if r["verdict"] == "incomplete":
        so_far = "" if r.get("gap") is None else f": paired gap so far {_pct(r['gap'])}"
        return f"{name}: incomplete, {r.get('note', 'fewer than 3 seeds')}{so_far}."
    lo, hi = r["gap_ci95"]
    gap = f"{_pct(r['gap'])} +- {_pct(r['gap_se'], '')} (95% interval {_pct(lo)} to {_pct(hi)}, {r['n']} seeds)"
    return {"met": f"{name}: met, {gap}, below the target.",
            "missed": f"{name}: missed, {gap}, above the target.",
            "unresolvable": f"{name}: unresolvable, {gap}: the interval contains the target, so these seeds "
                            f"cannot tell whether the gap is below {_pct(tgt, '')}."}[r["verdict"]]


def _letters(d):
    """{machine: "A", ...} in the order of the summary's machines (the earliest first)."""
    return {m["machine"]: chr(ord("A") + i) for i, m in enumerate(d.get("machines", []))}


def _cpu_cell(cpu, vs_bf16, letters):
    """'A: 1,282 (1.00x bf16) · B: 81 (1.00x bf16)': CPU seconds per run on each machine."""
    cpu, vs_bf16 = cpu or {}, vs_bf16 or {}
    return " · ".join(f"{letters.get(m, '?')}: {t:,.0f}" + (f" ({vs_bf16[m]:.2f}x bf16)" if m in vs_bf16 else "")
                      for m, t in cpu.items())


def _pairing_sentence(d, letters):
    """Which pairs were made on one machine, and how far bf16 at one seed lands on two machines."""
    two = d.get("bf16_on_two_machines") or []
    across = [f"{r['variant']} ({r['pairs_across_machines']} of {len(r['seeds'])})" for r in d["parity"]
              if r.get("pairs_across_machines")]
    if not two:
        return "Pairs across machines: " + (", ".join(across) if across else "none") + "."
    apart = "; ".join(f"seed {e['seed']}: " + ", ".join(f"{letters.get(m, '?')} {b:.4f}" for m, b in e["final_val_loss"].items())
                      for e in two)
    return ("bf16 at one seed lands apart on two machines (" + apart + "), so a run is paired with the bf16 run "
            "of its own machine where bf16 ran there; pairs across machines: " + (", ".join(across) if across else "none") + ".")


def report_parity(d):
    """The README's parity section from parity_cpu.json (bench.py parity)."""
    if "method" not in d:
        return ["### Loss parity", "results/parity_cpu.json predates the seeded runs: rerun `bench.py parity`.", ""]
    def pm(v, e):  # "v +- e", or v alone where one seed gives no spread
        return v if e in (None, "") else f"{v} +- {e}"

    letters = _letters(d)
    rows = [{**r, "seeds": r["n"],
             "final val loss": "" if r.get("final_val_mean") is None else
             pm(f"{r['final_val_mean']:.4f}", None if r.get("final_val_std") is None else f"{r['final_val_std']:.4f}"),
             "paired gap +- SE": "" if r.get("gap") is None else pm(_pct(r["gap"]), _pct(r.get("gap_se"), "")),
             "95% interval": "" if not r.get("gap_ci95") else " to ".join(_pct(x) for x in r["gap_ci95"]),
             "unpaired gap +- SE": "" if r.get("gap_unpaired") is None else
             pm(_pct(r["gap_unpaired"]), _pct(r.get("gap_unpaired_se"), "")),
             "target": _pct(r.get("target"), ""),
             "CPU s/run": _cpu_cell(r.get("cpu_seconds"), r.get("cpu_seconds_vs_bf16"), letters)}
            for r in d["parity"]]
    cols = ["variant", "seeds", "final val loss", "paired gap +- SE", "95% interval", "unpaired gap +- SE",
            "target", "verdict", "CPU s/run"]
    out = [f"### Loss parity: FP8 vs BF16 at equal steps and seeds (`{d['config']}`, {d['iters']} steps)",
           _env_line(d["env"]), "",
           f"Made by `python bench.py parity` (seeds {' '.join(map(str, d['seeds']))}): it runs what "
           "results/parity_runs/ lacks, one JSON per run, then writes this summary (parity_cpu.json), "
           "parity.csv and parity.png; `--no_run` only summarizes.", "", _md_table(rows, cols), "",
           "**Noise floor:** " + (f"bf16's final val loss moves by {_pct(d['noise_floor'], '')} (std over "
                                  f"{d['bf16_seeds']} seeds, relative to its mean) from one seed to the next."
                                  if d["noise_floor"] else "not measured yet (fewer than 2 bf16 seeds).")
           + " The paired gap compares each variant with bf16 at the same seed (same initial weights; same "
           "batches and evaluation text too, except for "
           + (", ".join(r["variant"] for r in d["parity"] if r.get("pairing", "").startswith("same initial weights;"))
              or "none") + ", whose ranks draw their own), which takes out what the seed does to both runs (compare the "
           "paired and unpaired standard errors). " + _pairing_sentence(d, letters) + " The verdicts use "
           "it: met when the whole 95% interval (Student's t) lies below the target, missed when it lies "
           "above, unresolvable when it contains the target. The unpaired gap (difference of the means over "
           "seeds) is shown for comparison. Final val loss: mean +- std over seeds. CPU s/run: CPU time (user "
           "+ system, all ranks) per run, not wall time (the runs shared the machine), averaged per machine: "
           + "; ".join(f"{letters[m['machine']]} = {m['machine']} ({m['runs']} runs, {', '.join(m['dates'])})"
                       for m in d.get("machines", [])) + ". Delayed scaling "
           "has no row or block variant: nanofp8 refuses it (an activation's per-row amax history says "
           "nothing about the next step's rows).", ""]
    out += [f"- {_target_sentence(r)}" + (f" {NOTES[r['variant']]}" if r["variant"] in NOTES else "")
            for r in d["parity"] if r["variant"] != "bf16"] + [""]
    if d.get("long"):
        out += ["Long runs (one seed each, no uncertainty of their own: read their gaps against the noise "
                "floor above; the commit each ran, as a run is kept until it is run again):", "",
                _md_table([{**r, "final val loss": f"{r['final_val_loss']:.4f}", "gap to bf16": _pct(r["gap"]),
                            "CPU s": f"{letters.get(r.get('machine'), '?')}: {r['cpu_seconds']:,.0f}"} for r in d["long"]],
                          ["variant", "iters", "seed", "final val loss", "gap to bf16", "CPU s", "commit"]), ""]
    return out + ["![parity](results/parity.png)", ""]


GIB_PARTS = ("peak_GiB", "state_GiB", "saved_for_backward_GiB", "transient_GiB")  # (bench.py throughput on CUDA)


def report_gpu(folder, kinds=("kernels_", "throughput_")):
    """The GPU figures: each kernels_*.json (python kernels.py --json) and throughput_*.json (the
    figures of first_gpu_run.sh, transcribed from its log, which lies beside them) in folder, of the
    kinds asked for."""
    names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    if not names:
        return ["### GPU figures", "No GPU figures are published yet. `bash first_gpu_run.sh` produces them.", ""]
    names = [n for n in names if n.startswith(kinds)]
    out = []
    for name in (n for n in names if n.startswith("kernels_") and n.endswith(".json")):
        d = json.load(open(os.path.join(folder, name)))
        cols = [c for c in d["gemm"][0] if c not in ("M", "N", "K")]
        # TFLOPS as integers; the ratios (columns "triton / _scaled_mm", ...) to two decimals
        fmt = {c: (lambda v: "n/a" if v is None else f"{v:.2f}") if " / " in c else
               (lambda v: "n/a" if v is None else f"{v:.0f}") for c in cols[1:]}
        took = f"; the benchmark took {d['seconds']:.0f} s, compiling included" if "seconds" in d else ""
        out += [f"### GEMM TFLOPS on an {d['device']} (`python kernels.py`, [`results/gpu/{name}`](results/gpu/{name}))",
                f"torch {d['torch']}, triton {d['triton']}, {d['date'][:10]}; bf16 output; 'fast' = Hopper's fast "
                "accumulation; 'block' = 1x128 by 128x128 scales (torch's through the v2 API, padded scales); "
                f"'graph' = replayed in a CUDA graph (no host time); 'a / b' = a's TFLOPS over b's{took}.", "",
                _md_table(d["gemm"], cols, fmt), ""]
    for name in (n for n in names if n.startswith("throughput_") and n.endswith(".json")):
        d = json.load(open(os.path.join(folder, name)))
        env = d.get("env", d)  # (bench.py throughput --json keeps it apart; the transcribed files do not)
        runs, peaks = {}, {}
        for r in d["throughput"]:
            runs.setdefault((r["model"], r["compile"], r["level"]), []).append(r["tokens_per_s"])
            peaks[(r["model"], r["compile"], r["level"])] = {k: r.get(k) for k in GIB_PARTS}
        rows = []
        for (model, comp, level), tps in runs.items():
            best = statistics.median(tps)
            bf16 = runs.get((model, comp, "bf16"))
            rows.append({"model": model, "compile": comp, "level": level, "rounds": len(tps), "tokens_per_s": best,
                         "vs_bf16": best / statistics.median(bf16) if bf16 else None, **peaks[(model, comp, level)]})
        parts = [k for k in GIB_PARTS if any(r[k] is not None for r in rows)]
        out += [f"### Training throughput on an {env['device']} ([`results/gpu/{name}`](results/gpu/{name}))",
                f"torch {env['torch']}, triton {env['triton']}, {env['date']}, commit {env.get('commit', '?')}: "
                f"`{env.get('command', '?')}`. " + d.get("throughput_note", ""), "",
                _md_table(rows, ["model", "compile", "level", "rounds", "tokens_per_s", "vs_bf16"] + parts,
                          {"tokens_per_s": lambda v: f"{v:,.0f}", "vs_bf16": lambda v: "" if v is None else f"{v:.3f}x",
                           **{k: (lambda v: "" if v is None else f"{v:.2f}") for k in parts}}), ""]
        for prof in d.get("profiles", []):  # (bench.py throughput --profile LEVEL)
            out += [f"One {prof['level']} step of {prof['model']} (compile={prof['compile']}), its kernels by time:", "",
                    _md_table(prof["top"], ["ms", "calls", "name"], {"ms": lambda v: f"{v:.3f}"}), ""]
    return out


def report_throughput(d):
    """A throughput section (docs/results.md), with what the ratios mean on the machine that made them."""
    rows = d["throughput"]
    cpu_kind = (f", CPU capability {d['env']['cpu_capability']}" if d["env"].get("cpu_capability")
                and d["env"]["device"].startswith("CPU") else "")
    out = [f"### Throughput (`bench.py throughput`{cpu_kind})", _env_line(d["env"]), "",
           _md_table(rows, ["model", "level", "compile", "tokens_per_s", "vs_bf16", "vs_fp32", "device_kind"],
                     {"tokens_per_s": lambda v: f"{v:,.0f}", "vs_bf16": lambda v: f"{v:.2f}x",
                      "vs_fp32": lambda v: f"{v:.2f}x"}), ""]
    cpu = {r["level"]: r for r in rows if r["device_kind"].startswith("CPU") and r["model"] == rows[0]["model"]}
    if {"bf16", "O1"} <= set(cpu):
        out += [f"Median of {cpu['bf16'].get('rounds', 1)} rounds, the levels taking turns. On this CPU (torch's "
                f"CPU capability {d['env'].get('cpu_capability', 'not recorded')}), {rows[0]['model']}: bf16 runs at "
                f"{cpu['bf16']['vs_fp32']:.2f}x fp32's speed, O1 at {cpu['O1']['vs_bf16']:.2f}x bf16's and "
                f"{cpu['O1']['vs_fp32']:.2f}x fp32's. The FP8 levels are emulated and multiply in fp32, so "
                "where bf16 GEMMs have no native instructions (AVX2 has none) they can outrun bf16: vs_bf16 "
                "is a property of the machine, not of FP8; vs_fp32 is the cost of the emulation.", ""]
        o1 = 1 / cpu["O1"]["vs_bf16"]  # step times relative to bf16's
        floor = 1 / cpu["fp32"]["vs_bf16"] if "fp32" in cpu else None
        verdict = "met" if o1 <= STEP_TARGET else "missed"
        line = (f"- **Emulation cost** (target: O1's step at most {STEP_TARGET}x bf16's): {verdict} on this CPU, "
                f"O1's step takes {o1:.2f}x bf16's")
        if floor is not None:
            line += (f". The emulation's floor is the fp32 step, as its GEMMs multiply in fp32 (torch has no CPU "
                     f"GEMM of bf16 inputs with an fp32 result): fp32's step takes {floor:.2f}x bf16's here, "
                     f"and the casts and decodes add {o1 / floor:.2f}x on top of it")
            if verdict == "missed":
                line += (f"; meeting the target here needs them to add at most {STEP_TARGET / floor:.2f}x"
                         if floor < STEP_TARGET else
                         "; the fp32 step alone misses the target here, so no emulation that multiplies in fp32 "
                         "can meet it on this CPU")
        out += [line + ".", ""]
    return out


def report_predict(h100, b200):
    """The predict section (docs/performance.md), from results/predict_h100.json (and predict_b200.json)."""
    out = ["Validation on an H100 (`results/predict_h100.json`), predicted FP8 speedup over bf16, compiled:", "",
           _md_table([{"published measurement": v["case"], "published": v["published"],
                       "predicted": f"{v['predicted_speedup']:.3f}x",
                       "error": f"{v['error_pct']:+.1f}%" if v["error_pct"] is not None else
                       f"direction {'right' if v['direction_right'] else 'WRONG'}"} for v in h100["validation"]],
                     ["published measurement", "published", "predicted", "error"]), "",
           f"The largest error is {h100['max_abs_error_pct']:.1f}%.", ""]
    if h100.get("against_gpu"):
        out += ["Against the GPU measurements of `results/gpu/` (compiled; the measured code is that of the "
                "commit named, the prediction is for this code):", "",
                _md_table([{"GPU": v["gpu"], "model": v["model"], "level": v["level"], "measured": f"{v['measured']:.3f}x",
                            "commit": v["commit"], "predicted": f"{v['predicted']:.3f}x", "error": f"{v['error_pct']:+.1f}%"}
                           for v in h100["against_gpu"]], ["GPU", "model", "level", "measured", "commit", "predicted",
                                                           "error"]), ""]
    rows = []
    for i, r in enumerate(h100["sweep"]):
        row = {"layers": r["n_layer"], "n_embd": r["n_embd"], "bf16 ms/micro-step (H100)": f"{r['bf16_ms']:.1f}",
               "O1 H100": f"{r['O1_speedup']:.3f}x", "O2 H100": f"{r['O2_speedup']:.3f}x"}
        if b200:
            row |= {"O1 B200": f"{b200['sweep'][i]['O1_speedup']:.3f}x", "O2 B200": f"{b200['sweep'][i]['O2_speedup']:.3f}x"}
        rows.append(row)
    out += ["Sweep, GPT-2-like models (bias, tied embeddings), 8 x 2048 tokens per micro-step, 8 micro-steps per step:",
            "", _md_table(rows, list(rows[0])), "",
            f"**With this code, O1 pays from about n_embd = {h100['o1_pays_from_n_embd']} on** (predicted, H100)."]
    return out


def write_sections(path, sections, root):
    """Rewrites, in the file at path, each section whose markers it holds (<!-- name:start --> to
    <!-- name:end -->), its links to results/ made relative to the file's folder (root: the folder
    of README.md and results/). Returns the names of the sections written."""
    text, written = open(path).read(), []
    rel = os.path.relpath(os.path.join(root, "results"), os.path.dirname(os.path.abspath(path)))
    for name, lines in sections.items():
        a, b = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
        if lines is not None and a in text:
            body = "\n".join(lines).replace("](results/", f"]({rel}/")
            text = text[: text.index(a)] + a + "\n" + body + "\n" + text[text.index(b):]
            written.append(name)
    if written:
        with open(path, "w") as f:
            f.write(text)
    return written


def cmd_report(args):
    res, parts, extra = args.results, [], []  # parts: README.md's results section; extra: docs/results.md's

    def load(name):
        path = os.path.join(res, name)
        return json.load(open(path)) if os.path.exists(path) else None

    if (d := load("parity_cpu.json")):
        parts += report_parity(d)
    if (d := load("memory_cpu.json")):
        parts += ["### Training state, bytes per parameter (`bench.py memory`)", _env_line(d["env"]), "",
                  _md_table(d["memory"], ["model", "level", "linear_B_per_param", "linear_B_per_param_at_step",
                                          "model_B_per_param", "gemm_weight_B_per_param", "activation_B_per_token"],
                            {"activation_B_per_token": lambda v: f"{v:,.0f}"}),
                  "", "`linear` = the block Linears, measured after a backward (as between micro-steps), every "
                  "scale counted (O2's FP8 gradient, m and v carry one fp32 scale per 128 values: 1/32 B each); "
                  "`at_step` = once the step has cast O2's summed gradient to FP8; `-fp8v` = sqrt(v) in E4M3; "
                  "`-fp8acc` = micro-steps summed in FP8 instead of fp16; `gemm_weight` = FP8 copies held "
                  "from forward to the optimizer step (not in the total); activation bytes per token saved "
                  "for backward; `O1-mxfp8` = MXFP8's 1x32 tiles, one E8M0 byte per 32 values; `O1-fp8attn` = "
                  "O1 with FP8 attention (FP8 Q, K, V and one lse per row kept for backward).", ""]
    if (d := load("comm_cpu.json")):
        extra += ["### Communication (`bench.py comm`)", _env_line(d["env"]), "",
                  _md_table(d["comm"], [k for k in d["comm"][0] if k != "note"]), "",
                  "`fp8_layers` = the block Linears: their weight gradients (O3: + the all-gathered FP8 "
                  "weights); `rest` = every other parameter (embeddings, LM head, norms, biases), whose "
                  "gradients travel in fp32 at every level; `model` = all bytes over all parameters; "
                  "`fp8_layer_share` = the block Linears' share of the parameters.", ""]
        if d.get("comm_torch"):
            extra += ["engine=torch (FSDP2, `nanofp8/torchstack.py`), the same GPT and steps, bytes per parameter "
                      "per step on the wire: what FSDP2 hands its collectives (weights all-gathered before each "
                      "block's forward and again before its backward, gradients reduce-scattered in fp32); O1 "
                      "gathers the block Linears' weights in FP8 (`of_which_fp8`, `nanofp8/fsdp.py`):", "",
                      _md_table(d["comm_torch"], [k for k in d["comm_torch"][0] if k not in ("note", "engine")]), ""]
        if d.get("comm_model_parallel"):
            mp_rows = d["comm_model_parallel"]
            extra += ["Tensor, sequence and pipeline parallelism, bytes per token on the wire, FP8 vs bf16:", "",
                      _md_table(mp_rows, [k for k in mp_rows[0] if k not in ("note", "fp8_ops", "what")]), ""]
    if (d := load("kernels_schedule_cpu.json")):
        t = d["block_target"]
        extra += ["### What a GPU runs, counted on a CPU (`bench.py kernels`)", _env_line(d["env"]), "",
                  _md_table(d["kernels"], ["level", "block_kernels", "block_KB_per_token", "KB_vs_bf16",
                                           "saved_KB_per_token", "step_launches", "step_bytes_per_fp8_value",
                                           "optimizer_launches", "optimizer_bytes_per_fp8_value"],
                            {"block_KB_per_token": lambda v: f"{v:.0f}", "KB_vs_bf16": lambda v: f"{v:.2f}x",
                             "saved_KB_per_token": lambda v: f"{v:.1f}",
                             "step_bytes_per_fp8_value": lambda v: "" if v is None else f"{v:.0f}",
                             "optimizer_launches": lambda v: "" if v is None else f"{v}",
                             "optimizer_bytes_per_fp8_value": lambda v: "" if v is None else f"{v:.1f}"}), "",
                  "`block` = one GPT-2 block (n_embd 768, 8 x 1024 tokens) compiled, forward and backward, its "
                  "graphs scheduled with inductor's CUDA fusion rules (`nanofp8/schedule.py`): the kernels "
                  "besides the GEMMs and attention, and the bytes they read and write per token (target at "
                  f"O1: <= {t['kernels']} kernels, <= {t['KB_per_token']} KB); `saved` = what its forward "
                  "keeps for the backward, per token (the activations' share of the peak memory). `step` = one "
                  "optimizer step of "
                  "a 12-layer model outside the compiled graphs, on a GPU's paths: operators launched (a "
                  "foreach operator once; bf16 and O1 on torch's fused AdamW; O2-fused's Triton kernels by "
                  "their traffic, `optim_triton.traffic`) and bytes of their operands per FP8 weight value, "
                  "for the whole step (checks, clipping, the optimizer) and for the optimizer's `step()` "
                  "alone (`optimizer_`). Not timings: what a GPU would run, from this code, on any machine.", ""]
    for name in sorted(f for f in os.listdir(res) if f.startswith("throughput_cpu") and f.endswith(".json")):
        extra += report_throughput(load(name))  # one per CPU kind measured: bf16's speed differs most
    if (d := load("stats_cost_cpu.json")):
        extra += ["### Cost of the FP8 statistics (`bench.py stats --cost`)", _env_line(d["env"]), "",
                  _md_table(d["stats_cost"], ["model", "stats", "steps", "ms_per_step", "vs_off"]), "",
                  "Eager mode; on a CPU the FP8 GEMMs are emulated, so the step itself is slow and the "
                  "ratio is the CPU's, not a GPU's.", ""]
    parts += report_gpu(os.path.join(res, "gpu"), ("throughput_",))
    extra += report_gpu(os.path.join(res, "gpu"), ("kernels_",))
    h100 = load("predict_h100.json")
    sections = {"results": parts, "results-more": extra,
                "predict": report_predict(h100, load("predict_b200.json")) if h100 else None}
    # Each section is written where its markers are: README.md, or a file of docs/ beside it.
    root = os.path.dirname(os.path.abspath(args.readme))
    paths = [args.readme] + sorted(glob.glob(os.path.join(root, "docs", "*.md")))
    written = {path: write_sections(path, sections, root) for path in paths}
    if "results" not in written[args.readme]:
        sys.exit(f"{args.readme} has no <!-- results:start --> and <!-- results:end --> markers")
    for path, names in written.items():
        if names:
            print(f"{path}: {', '.join(names)} rewritten from {res}/*.json")
    if (lost := [n for n, v in sections.items() if v is not None and not any(n in w for w in written.values())]):
        print(f"not written (no file holds their markers): {', '.join(lost)}")


# -----------------------------------------------------------------------------


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["predict"]:  # predict.py's own arguments, options first included (argparse's
        import predict           # REMAINDER would refuse `predict --gpu H200`)

        return predict.main(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("memory")
    p.add_argument("--tokens", type=int, default=64, help="sequence length of the measured step")
    p.add_argument("--llama_layers", type=int, default=2)
    p.add_argument("--models", nargs="+", default=["gpt2-124M", "llama"], choices=list(MODELS))
    p = sub.add_parser("comm")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p = sub.add_parser("state", help="flushed fractions of O2's stored state per granularity of scales")
    p.add_argument("--steps", type=int, default=300, help="steps of the README model trained in fp32")
    p = sub.add_parser("parity", help="every variant at several seeds (resumable), then the summary")
    p.add_argument("--config", default=os.path.join(REPO, "config", "shakespeare_char.py"))
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--iters", type=int, default=1000)
    p.add_argument("--long_iters", type=int, default=3000, help="0: no long runs")
    p.add_argument("--long_variants", nargs="*", default=["bf16", "O1", "O2"], choices=list(VARIANTS))
    p.add_argument("--jobs", type=int, default=1, help="runs at a time (each reports its own CPU time)")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each process")
    p.add_argument("--runs", default=os.path.join(REPO, "results", "parity_runs"),
                   help="one JSON per finished run; a run found there is not run again")
    p.add_argument("--no_run", action="store_true", help="start no run: summarize those in --runs")
    p.add_argument("--twins", action="store_true", help="run again on this machine what another machine ran, "
                   "kept beside it (the summary pairs each run with the bf16 run of its own machine)")
    p.add_argument("--out", default=os.path.join(REPO, "results"))
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more train.py overrides")
    p = sub.add_parser("train", help="(internal) one run of bench.py parity")
    p.add_argument("out")
    p.add_argument("argv", nargs=argparse.REMAINDER)
    p = sub.add_parser("throughput")
    p.add_argument("--models", nargs="+", choices=list(THROUGHPUT_MODELS))
    p.add_argument("--steps", type=int, default=5, help="timed steps per level and round")
    p.add_argument("--rounds", type=int, default=3, help="the levels take turns this many times; median")
    p.add_argument("--no_compile", action="store_true")
    p.add_argument("--compiled_only", action="store_true", help="on a GPU: the compiled runs alone")
    p.add_argument("--levels", nargs="+", default=list(THROUGHPUT_LEVELS),
                   choices=THROUGHPUT_LEVELS + EXTRA_THROUGHPUT_LEVELS)
    p.add_argument("--profile", metavar="LEVEL", help="also profile one step of this level: its top kernels")
    sub.add_parser("gemm")
    p = sub.add_parser("design", help="the design card's measures: core lines, functions on a step's path")
    p.add_argument("--list", action="store_true", help="also print the functions")
    p = sub.add_parser("kernels", help="kernels and bytes of a compiled block, launches of a step, per level")
    p.add_argument("--levels", nargs="+", default=["bf16", "O1", "O1-delayed", "O1-rowwise", "O2"],
                   choices=list(LEVELS) + list(RECIPE_LEVELS))
    p.add_argument("--n_embd", type=int, default=768)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--n_layer", type=int, default=12, help="depth of the model whose optimizer step is counted")
    p.add_argument("--list", action="store_true", help="also keep every kernel of the block in the JSON")
    p = sub.add_parser("predict", help="predicted H100/B200 step time of bf16, O1, O2 (predict.py)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="predict.py's own arguments")
    p = sub.add_parser("stats")
    p.add_argument("out_dir", nargs="?", help="a train.py out_dir holding fp8_stats.jsonl: draw it")
    p.add_argument("--out", help="where the PNGs go (default: out_dir)")
    p.add_argument("--cost", action="store_true", help="time steps with statistics off / every 100 / every 1")
    p.add_argument("--model", default="shakespeare-char", choices=list(THROUGHPUT_MODELS))
    p.add_argument("--steps", type=int, default=200, help="--cost: timed steps per setting")
    for p in (q for name, q in sub.choices.items() if name != "parity"):  # parity writes to --out
        p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    p = sub.add_parser("report")
    p.add_argument("--results", default=os.path.join(REPO, "results"))
    p.add_argument("--readme", default=os.path.join(REPO, "README.md"))
    args = ap.parse_args(argv)
    {"memory": cmd_memory, "comm": cmd_comm, "state": cmd_state, "parity": cmd_parity,
     "throughput": cmd_throughput, "gemm": cmd_gemm, "predict": cmd_predict, "train": cmd_train,
     "stats": cmd_stats, "report": cmd_report, "kernels": cmd_kernels, "design": cmd_design}[args.cmd](args)


if __name__ == "__main__":
    main()
