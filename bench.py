"""
Evidence for nanofp8, from one script. Each subcommand prints a table and, with --json, writes
the same figures (plus machine, date and versions) as JSON.

    python bench.py memory      bytes per parameter of the training state, and activation bytes
                                per token, for bf16 / O1 / O2 (with FP8 v, with FP8 gradient
                                accumulation), measured by walking the real tensors
                                (nanofp8/optim.py: training_state_bytes)
    python bench.py comm        bytes each rank puts on the wire per parameter per step, for the
                                bf16 baseline (fp32 gradient all-reduce, as nanoGPT's DDP), O1,
                                O2 and O3, at 2 and 4 gloo ranks (counted by nanofp8/dist.py),
                                the FP8 layers' bytes apart from the whole model's
    python bench.py parity      BF16 vs every FP8 level and recipe variant on shakespeare_char at
                                equal steps and seeds: loss curves (CSV + PNG), final val losses
    python bench.py throughput  tokens/s and peak memory, BF16 vs O1/O2
    python bench.py gemm        the kernels benchmark (python kernels.py)
    python bench.py stats DIR   per-layer heatmaps (SQNR, underflow, saturation) over the steps and
                                amax trends, as PNG, from DIR/fp8_stats.jsonl (train.py with
                                fp8_stats_interval > 0); --cost: step time with the statistics off,
                                every 100 steps and every step

Nothing here is typed in by hand: every figure is measured when the command runs.
"""

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone

import torch
import torch.nn as nn

from nanofp8.fp8 import Recipe
from nanofp8.model import GPT, GPTConfig, apply_fp8, fp8_module_filter
from nanofp8.optim import activation_bytes, fp8_grad, training_state_bytes

REPO = os.path.dirname(os.path.abspath(__file__))


def environment():
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"device": dev, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "triton": triton_version, "python": platform.python_version()}


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
# O2 variants: "-fp8v" stores sqrt(v) in E4M3 (o2_v_format="fp8"), "-fp8acc" sums micro-steps in
# FP8 instead of in an fp16 buffer (convert_to_o2(grad_accum="fp8"); nanofp8/optim.py, (6)).
LEVELS = ("bf16", "O1", "O2", "O2-fp8v", "O2-fp8acc", "O2-fp8v-fp8acc")


def build(cfg, level, backend=None, device="cpu"):
    """A model on `device` and its optimizer at a precision level, built by train.py's own
    setup_precision and build_optimizer. Returns (model, optimizer, train.py's settings, for
    train.optimizer_step). level: one of LEVELS; backend: train.py's fp8_backend."""
    import train

    precision, variants = level.split("-")[0], level.split("-")[1:]
    settings = train.load_config([f"precision={precision}", f"fp8_backend={backend}", "compile=False",
                                  f"o2_v_format={'fp8' if 'fp8v' in variants else 'fp16'}",
                                  f"o2_grad_accum={'fp8' if 'fp8acc' in variants else 'fp16'}"])
    torch.manual_seed(0)
    model = GPT(cfg)
    train.setup_precision(model, settings, device.split(":")[0])
    model.to(device)
    return model, train.build_optimizer(model, settings, device.split(":")[0]), settings


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
FROZEN_GRANULARITIES = ("row", "block")


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
# comm

COMM_CFG = GPTConfig(arch="gpt2", n_layer=2, n_head=4, n_embd=128, vocab_size=256, block_size=64)


def _comm_worker(rank, world, port, level, out):
    """Three training steps of COMM_CFG at `level` on `world` gloo ranks, counting the bytes of
    the FP8 layers (their weight gradients, and under O3 their gathered weights) apart from the
    bytes of every other parameter (embeddings, LM head, norms, biases: fp32 gradients)."""
    import torch.distributed as dist
    from nanofp8 import dist as fdist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
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
            fdist.sync_fp8_wgrads(model.parameters())
        if level == "O3":  # reduce-scatter of FP8 gradients, flags, all-gather of FP8 weights
            opt.step(grads_finite=ok)
        lin_bytes += fdist.comm_stats(reset=True)["bytes_sent"]
        if level != "O3":
            opt.step()
        opt.zero_grad()  # (Fp8AdamW's clears the FP8 gradients too)
    n = sum(p.numel() for p in model.parameters())
    n_lin = sum(p.numel() for p in lin)
    if rank == 0:
        torch.save({"fp8_layers": lin_bytes / steps / n_lin, "rest": rest_bytes / steps / (n - n_lin),
                    "model": (lin_bytes + rest_bytes) / steps / n, "params": n, "linear_params": n_lin}, out)
    dist.destroy_process_group()


# Model parallelism: what the cut model sends per token, FP8 against BF16 (2 gloo ranks).
COMM_MP = {  # name: (tensor_parallel, sequence_parallel, pipeline_parallel, what travels)
    "tensor": (2, False, 1, "all-reduce of row-parallel outputs; bwd: of column-parallel input grads"),
    "tensor+sequence": (2, True, 1, "all-gather before column-parallel, reduce-scatter after "
                                    "row-parallel; bwd: mirrored"),
    "pipeline": (1, False, 2, "activations across the stage boundary; bwd: their gradients"),
}


def _comm_mp_worker(rank, world, port, out):
    """One forward and one training step of COMM_CFG, cut as in COMM_MP, with FP8 layers and FP8
    communication, then with the BF16 layers of the same cut (bf16 GEMMs and collectives);
    bytes from nanofp8/dist.py's COMM counter."""
    import torch.distributed as dist
    from nanofp8 import dist as fdist
    from nanofp8 import parallel as P
    from nanofp8.fp8 import E4M3, E5M2

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
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
    if rank == 0:
        torch.save(res, out)
    dist.destroy_process_group()


def comm_model_parallel():
    """Rows of bytes per token (per block for TP, per stage boundary for PP), FP8 vs BF16."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(tempfile.mkdtemp(), "comm_mp.pt")
    mp.spawn(_comm_mp_worker, args=(2, port, out), nprocs=2, join=True)
    res = torch.load(out, weights_only=False)
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


def cmd_comm(args):
    import torch.multiprocessing as mp

    rows = []
    for world in args.worlds:
        base = None
        for level in ("bf16", "O1", "O2", "O3"):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            out = os.path.join(tempfile.mkdtemp(), "comm.pt")
            mp.spawn(_comm_worker, args=(world, port, level, out), nprocs=world, join=True)
            r = torch.load(out, weights_only=False)
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
    mp_rows = comm_model_parallel()
    print(f"\nModel parallelism on 2 gloo ranks, same GPT, batch 4 x {COMM_CFG.block_size}: bytes on the "
          "wire per token, FP8 layers and payloads (+ scales) vs BF16 layers of the same cut")
    emit("comm_model_parallel", mp_rows, ["parallel", "pass", "unit", "fp8_B_per_token", "bf16_B_per_token",
                                          "fp8_vs_bf16", "fp8_ops"], args, {"comm": rows})


# -----------------------------------------------------------------------------
# parity

# Every variant differs from the bf16 run in its precision settings and layout only: same model,
# hyper-parameters, steps and tokens per step. name -> (train.py overrides, processes).
VARIANTS = {
    "bf16": ({"precision": "bf16"}, 1),
    "O1": ({"precision": "O1"}, 1),
    "O1-delayed": ({"precision": "O1", "fp8_scaling": "delayed"}, 1),
    "O1-row": ({"precision": "O1", "fp8_granularity": "row"}, 1),
    "O1-block": ({"precision": "O1", "fp8_granularity": "block", "fp8_formats": "e4m3"}, 1),
    "O2": ({"precision": "O2"}, 1),
    "O2-fp8v": ({"precision": "O2", "o2_v_format": "fp8"}, 1),
    # two gloo ranks of half the batch each: the same 16 sequences per step as one process
    "O3-dp2": ({"precision": "O3", "batch_size": 8, "gradient_accumulation_steps": 2}, 2),
    "O1-tp2-sp": ({"precision": "O1", "tensor_parallel": 2, "sequence_parallel": True}, 2),
    "O1-pp2": ({"precision": "O1", "pipeline_parallel": 2}, 2),
}

def run_path(runs_dir, name, seed, iters):
    return os.path.join(runs_dir, f"{name}-seed{seed}-{iters}.json")


def start_run(name, seed, iters, config, runs_dir, threads, set_=()):
    """Start one training run (variant, seed, steps) as a child process: `python train.py ...` or
    torchrun for the multi-process variants. Returns (popen, path, record without results)."""
    over, procs = VARIANTS[name]
    over = {**over, **dict(a.split("=", 1) for a in set_)}
    tmp = tempfile.mkdtemp(prefix="parity-")
    argv = [os.path.relpath(config, REPO), f"out_dir={tmp}", "always_save_checkpoint=False", f"max_iters={iters}",
            f"lr_decay_iters={iters}", f"seed={seed}", "device=cpu"] + [f"{k}={v}" for k, v in over.items()]
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"]
              if procs > 1 else [sys.executable])
    out = os.path.join(tmp, "history.json")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    log = open(os.path.join(tmp, "log.txt"), "w")
    p = subprocess.Popen(launch + ["bench.py", "train", out] + argv, cwd=REPO, env=env, stdout=log, stderr=log)
    rec = {"variant": name, "seed": seed, "iters": iters, "processes": procs, "threads_per_process": threads,
           "command": " ".join(["python" if procs == 1 else f"torchrun --nproc_per_node={procs}", "train.py"] + argv[:1]
                               + [a for a in argv[1:] if not a.startswith("out_dir=")]),
           "env": environment(), "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                                          capture_output=True, text=True).stdout.strip()}
    return p, out, rec, tmp


def cmd_train(args):
    """One run of start_run's child: train.main, then rank 0 writes the history as JSON."""
    import train

    h = train.main(args.argv)
    if os.environ.get("RANK", "0") == "0":
        with open(args.out, "w") as f:
            json.dump({"losses": h["losses"], "evals": h["evals"]}, f)


def run_all(todo, config, runs_dir, jobs, threads, set_=()):
    """Run (variant, seed, iters) triples not yet in runs_dir, `jobs` at a time, and write each as
    runs_dir/<variant>-seed<seed>-<iters>.json with its CPU seconds (os.wait4: the child and the
    ranks it waited for), so that runs sharing the machine still report their own cost."""
    os.makedirs(runs_dir, exist_ok=True)
    todo = [t for t in todo if not os.path.exists(run_path(runs_dir, *t))]
    running = {}
    while todo or running:
        while todo and len(running) < jobs:
            name, seed, iters = todo.pop(0)
            p, out, rec, tmp = start_run(name, seed, iters, config, runs_dir, threads, set_)
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
        with open(run_path(runs_dir, rec["variant"], rec["seed"], rec["iters"]), "w") as f:
            json.dump(rec, f)
        print(f"== done {rec['variant']} seed {rec['seed']}: val {rec['evals'][-1][2]:.4f}, "
              f"{rec['cpu_seconds']:.0f} CPU s", file=sys.stderr)


def cmd_parity(args):
    import train

    runs = {}
    for name in args.variants:
        over = [f"--{k}={v}" for k, v in {**VARIANTS[name], **dict(a.split("=", 1) for a in args.set)}.items()]
        argv = [args.config, f"--out_dir={tempfile.mkdtemp(prefix='parity-')}", "--always_save_checkpoint=False",
                f"--max_iters={args.iters}", f"--lr_decay_iters={args.iters}", f"--eval_interval={args.eval_interval}",
                "--device=cpu" if args.cpu else "--device=auto"] + over
        print(f"== {name}: python train.py {' '.join(argv)}", file=sys.stderr)
        t0 = time.time()
        runs[name] = train.main(argv)
        runs[name]["seconds"] = time.time() - t0
    base = runs["bf16"]["evals"][-1][2] if "bf16" in runs else None
    rows = []
    for name, r in runs.items():
        val = r["evals"][-1][2]
        rows.append({"variant": name, "final_val_loss": val, "final_train_loss": r["evals"][-1][1],
                     "gap_vs_bf16": None if base is None else (val - base) / base,
                     "seconds": r["seconds"]})
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "parity.csv"), "w") as f:
        f.write("variant,kind,iter,loss\n")
        for name, r in runs.items():
            f.writelines(f"{name},train,{i},{l:.5f}\n" for i, l in r["losses"])
            f.writelines(f"{name},val,{i},{v:.5f}\n" for i, _, v in r["evals"])
    _plot(runs, os.path.join(args.out, "parity.png"), args)
    print(f"Final val loss at {args.iters} steps ({args.config}), relative gap to bf16; "
          f"curves in {args.out}/parity.csv and parity.png")
    emit("parity", rows, ["variant", "final_val_loss", "final_train_loss", "gap_vs_bf16", "seconds"], args,
         {"config": args.config, "iters": args.iters, "curves": {n: r for n, r in runs.items()}})


def _plot(runs, path, args):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in runs.items():
        it, loss = zip(*r["losses"])
        k = max(1, len(loss) // 50)  # smooth the noisy per-step loss a little
        sm = [sum(loss[max(0, i - k): i + 1]) / len(loss[max(0, i - k): i + 1]) for i in range(len(loss))]
        a.plot(it, sm, label=name, lw=1)
        ev = r["evals"]
        b.plot([e[0] for e in ev], [e[2] for e in ev], marker="o", label=name, lw=1)
    a.set(title="train loss (smoothed)", xlabel="iteration")
    b.set(title="val loss", xlabel="iteration")
    b.legend()
    fig.suptitle(f"FP8 vs BF16 at equal steps: {os.path.basename(args.config)}, {environment()['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -----------------------------------------------------------------------------
# throughput

THROUGHPUT_MODELS = {
    "gpt2-124M": (MODELS["gpt2-124M"], 8, 1024),  # (config, batch, sequence)
    "gpt2-xl": (GPTConfig(arch="gpt2", n_layer=48, n_head=25, n_embd=1600, vocab_size=50304, block_size=1024), 4, 1024),
    "llama-1B": (MODELS["llama"], 4, 2048),
    # what a CPU can run in seconds
    "cpu-small": (GPTConfig(arch="gpt2", n_layer=4, n_head=4, n_embd=256, vocab_size=256, block_size=128), 8, 128),
    # config/shakespeare_char_fp8.py's model and batch
    "shakespeare-char": (GPTConfig(arch="gpt2", n_layer=4, n_head=4, n_embd=128, vocab_size=84, block_size=64,
                                   bias=False), 16, 64),
    "tiny": (MODELS["tiny"], 2, 32),  # for the tests
}


def measure_throughput(cfg, level, batch, seq, steps, compile_model, device):
    """Tokens per second of train.py's training step (forward, backward, optimizer_step: clip,
    non-finite check, update) on one device, and the peak memory on CUDA."""
    import train

    model, opt, settings = build(cfg, level, "torch", device)
    fwd = torch.compile(model) if compile_model else model
    idx = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
    ac = torch.autocast(device, dtype=torch.bfloat16)

    def step():
        with ac:
            loss = fwd(idx, idx)[1]
        loss.backward()
        train.optimizer_step(model, opt, settings)

    for _ in range(2):  # warm-up (and compilation)
        step()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / steps
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    return batch * seq / dt, peak


def cmd_throughput(args):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    names = args.models or (["gpt2-124M", "gpt2-xl", "llama-1B"] if device == "cuda" else ["cpu-small"])
    compiles = [False, True] if (device == "cuda" and not args.no_compile) else [False]
    rows = []
    for name in names:
        cfg, batch, seq = THROUGHPUT_MODELS[name]
        base = {}
        for comp in compiles:
            for level in ("bf16", "O1", "O2"):
                tps, peak = measure_throughput(cfg, level, batch, seq, args.steps, comp, device)
                base.setdefault(comp, tps)
                rows.append({"model": name, "level": level, "compile": comp, "tokens_per_s": tps,
                             "vs_bf16": tps / base[comp], "peak_GiB": peak,
                             "device_kind": "GPU" if device == "cuda" else "CPU (FP8 emulated: not a speed figure)"})
                print(f"  {name} {level} compile={comp}: {tps:,.0f} tok/s", file=sys.stderr)
    print(f"Training throughput, {environment()['device']}")
    emit("throughput", rows, ["model", "level", "compile", "tokens_per_s", "vs_bf16", "peak_GiB", "device_kind"], args)


# -----------------------------------------------------------------------------
# gemm: the kernels benchmark lives next to the kernels


def cmd_gemm(args):
    import subprocess

    cmd = [sys.executable, os.path.join(REPO, "kernels.py")] + (["--json", args.json] if args.json else [])
    sys.exit(subprocess.run(cmd).returncode)


# -----------------------------------------------------------------------------
# stats: pictures of nanofp8/stats.py's records, and what collecting them costs

STAT_PANELS = (("sqnr_db", "SQNR (dB)", "viridis"), ("underflow", "underflow (% of non-zero values)", "magma"),
               ("saturation", "saturation (% of values)", "magma"))
OPERAND_ORDER = ("x", "w", "dy", "xT", "wT", "dyT", "wgrad")


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
    recs = [r for r in read_records(path) if "sqnr_db" in r]  # the casts (not O2's stored moments)
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
    model, opt, train_cfg = build(cfg, "O1", None, device)  # fp8_backend: torch on CUDA, emulate on CPU
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
# report: the README's results section, regenerated from results/*.json


def _md_table(rows, cols, fmt=None):
    fmt = fmt or {}
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(fmt.get(c, _fmt)(r.get(c)) for c in cols) + " |")
    return "\n".join(out)


def _env_line(env):
    return f"*{env['device']}, {env['date'][:10]}, torch {env['torch']}, triton {env['triton']}*"


def cmd_report(args):
    res, parts = args.results, []

    def load(name):
        path = os.path.join(res, name)
        return json.load(open(path)) if os.path.exists(path) else None

    pct = lambda v: "" if v is None else f"{100 * v:+.2f}%"  # noqa: E731
    if (d := load("parity_cpu.json")):
        parts += [f"### Loss parity: FP8 vs BF16 at equal steps ({os.path.basename(d['config'])}, {d['iters']} steps)",
                  _env_line(d["env"]), "",
                  _md_table(d["parity"], ["variant", "final_val_loss", "gap_vs_bf16"], {"gap_vs_bf16": pct}),
                  "", "![parity](results/parity.png)", ""]
    if (d := load("memory_cpu.json")):
        parts += ["### Training state, bytes per parameter (`bench.py memory`)", _env_line(d["env"]), "",
                  _md_table(d["memory"], ["model", "level", "linear_B_per_param", "linear_B_per_param_at_step",
                                          "model_B_per_param", "gemm_weight_B_per_param", "activation_B_per_token"],
                            {"activation_B_per_token": lambda v: f"{v:,.0f}"}),
                  "", "`linear` = the block Linears, measured after a backward (as between micro-steps); "
                  "`at_step` = once the step has cast O2's summed gradient to FP8; `-fp8v` = sqrt(v) in E4M3; "
                  "`-fp8acc` = micro-steps summed in FP8 instead of fp16; `gemm_weight` = FP8 copies held "
                  "from forward to the optimizer step (not in the total); activation bytes per token saved "
                  "for backward.", ""]
    if (d := load("comm_cpu.json")):
        parts += ["### Communication (`bench.py comm`)", _env_line(d["env"]), "",
                  _md_table(d["comm"], [k for k in d["comm"][0] if k != "note"]), "",
                  "`fp8_layers` = the block Linears: their weight gradients (O3: + the all-gathered FP8 "
                  "weights); `rest` = every other parameter (embeddings, LM head, norms, biases), whose "
                  "gradients travel in fp32 at every level; `model` = all bytes over all parameters; "
                  "`fp8_layer_share` = the block Linears' share of the parameters.", ""]
        if d.get("comm_model_parallel"):
            mp_rows = d["comm_model_parallel"]
            parts += ["Tensor, sequence and pipeline parallelism, bytes per token on the wire, FP8 vs bf16:", "",
                      _md_table(mp_rows, [k for k in mp_rows[0] if k not in ("note", "fp8_ops", "what")]), ""]
    if (d := load("throughput_cpu.json")):
        parts += ["### Throughput (`bench.py throughput`)", _env_line(d["env"]), "",
                  _md_table(d["throughput"], ["model", "level", "compile", "tokens_per_s", "vs_bf16", "device_kind"],
                            {"tokens_per_s": lambda v: f"{v:,.0f}"}), ""]
    if (d := load("stats_cost_cpu.json")):
        parts += ["### Cost of the FP8 statistics (`bench.py stats --cost`)", _env_line(d["env"]), "",
                  _md_table(d["stats_cost"], ["model", "stats", "steps", "ms_per_step", "vs_off"]), "",
                  "Eager mode; on a CPU the FP8 GEMMs are emulated, so the step itself is slow and the "
                  "ratio is the CPU's, not a GPU's.", ""]
    gpu = [f for f in sorted(os.listdir(res)) if f.startswith(("kernels_", "throughput_gpu", "parity_gpu"))] if os.path.isdir(res) else []
    if not gpu:
        parts += ["### GPU figures", "No GPU figures are published yet: none has been measured on a Hopper GPU "
                  "for this repository. `python bench.py gemm --json results/kernels_h100.json` and "
                  "`python bench.py throughput --json results/throughput_gpu.json` produce them.", ""]
    readme = args.readme
    text = open(readme).read()
    a, b = text.index("<!-- results:start -->"), text.index("<!-- results:end -->")
    text = text[: a] + "<!-- results:start -->\n" + "\n".join(parts) + "\n" + text[b:]
    with open(readme, "w") as f:
        f.write(text)
    print(f"{readme}: results section rewritten from {res}/*.json")


# -----------------------------------------------------------------------------


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("memory")
    p.add_argument("--tokens", type=int, default=64, help="sequence length of the measured step")
    p.add_argument("--llama_layers", type=int, default=2)
    p.add_argument("--models", nargs="+", default=["gpt2-124M", "llama"], choices=list(MODELS))
    p = sub.add_parser("comm")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p = sub.add_parser("parity")
    p.add_argument("--config", default=os.path.join(REPO, "config", "shakespeare_char_bf16.py"))
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--iters", type=int, default=1000)
    p.add_argument("--eval_interval", type=int, default=250)
    p.add_argument("--out", default=os.path.join(REPO, "results"))
    p.add_argument("--cpu", action="store_true", help="force the CPU even if a GPU is present")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more train.py overrides")
    p = sub.add_parser("train", help="(internal) one run of bench.py parity")
    p.add_argument("out")
    p.add_argument("argv", nargs=argparse.REMAINDER)
    p = sub.add_parser("throughput")
    p.add_argument("--models", nargs="+", choices=list(THROUGHPUT_MODELS))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--no_compile", action="store_true")
    sub.add_parser("gemm")
    p = sub.add_parser("stats")
    p.add_argument("out_dir", nargs="?", help="a train.py out_dir holding fp8_stats.jsonl: draw it")
    p.add_argument("--out", help="where the PNGs go (default: out_dir)")
    p.add_argument("--cost", action="store_true", help="time steps with statistics off / every 100 / every 1")
    p.add_argument("--model", default="shakespeare-char", choices=list(THROUGHPUT_MODELS))
    p.add_argument("--steps", type=int, default=200, help="--cost: timed steps per setting")
    for p in sub.choices.values():
        p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    p = sub.add_parser("report")
    p.add_argument("--results", default=os.path.join(REPO, "results"))
    p.add_argument("--readme", default=os.path.join(REPO, "README.md"))
    args = ap.parse_args(argv)
    {"memory": cmd_memory, "comm": cmd_comm, "parity": cmd_parity, "throughput": cmd_throughput,
     "gemm": cmd_gemm, "train": cmd_train, "stats": cmd_stats, "report": cmd_report}[args.cmd](args)


if __name__ == "__main__":
    main()
