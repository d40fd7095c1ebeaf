"""
engine=torch on a GPU: issue #38's device check, in one call (about 5 minutes on an H100 or H200,
compiles included):

    python scripts/gpu_engine_torch.py [--json results/gpu/engine_torch.json] [--steps 50]

1. The two engines side by side: train.py at O1, compiled, once with engine=nanofp8 and once with
   engine=torch (FSDP2 on one rank), the same GPT-2 124M shape (12 x 768, 8 x 1024 tokens a step)
   on the repo's own data (shakespeare_char, so nothing needs downloading), the same seed, --steps
   steps each. Per engine: the loss of every step, tokens/s over the steps after the first three
   (compilation), and the peak GiB train.py's log line reports.
2. FSDP2's FP8 all-gather on one rank, forced: train.py skips it at one rank (nothing to gather),
   so this part builds the path itself, as a user of `nanofp8.fsdp.convert` would: the same GPT at
   O1, convert(), fully_shard on a one-GPU mesh (NCCL), each block compiled before it is sharded,
   as torchtitan does; AdamW for 10 steps on one fixed batch, against the same model unsharded and
   compiled the same way. NCCL carries the uint8 bytes and the CUDA tensor subclass is traced; the
   two runs' losses should agree to the last bits (the FP8 cast of a whole weight is the same on
   one rank, the optimizer the same).

It writes one JSON file (device, versions, date, command, commit: bench.py's environment) and
prints a table. --smoke runs both parts on the CPU with a tiny model and gloo, a check of the
script itself where no GPU is.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

GPT2 = ["n_layer=12", "n_head=12", "n_embd=768", "block_size=1024", "batch_size=8"]
TINY = ["n_layer=2", "n_head=2", "n_embd=64", "block_size=64", "batch_size=4"]
LINE = re.compile(r"iter (\d+): loss ([\d.]+), time ([\d.]+)ms, ([\d,]+) tok/s.*?(?:peak ([\d.]+) GiB)?$")


def run_engine(engine, steps, smoke, out_dir):
    """train.py under torchrun (one process), O1 compiled: its log lines -> losses, tokens/s, peak."""
    argv = ["config/shakespeare_char.py", *(TINY if smoke else GPT2), "precision=O1", f"engine={engine}",
            f"compile={not smoke}", f"max_iters={steps}", "log_interval=1", f"eval_interval={steps}", "eval_iters=1",
            "gradient_accumulation_steps=1", "dropout=0.0", "warmup_iters=10", f"lr_decay_iters={steps}",
            "seed=1337", f"out_dir={out_dir}", "keep_checkpoints=1", "device=auto"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "train.py", *argv]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    if out.returncode:
        return {"engine": engine, "error": (out.stderr or out.stdout).strip().splitlines()[-1:], "command": cmd}
    rows = [m.groups() for m in map(LINE.search, out.stdout.splitlines()) if m]
    timed = [float(r[3].replace(",", "")) for r in rows[3:]] or [float(r[3].replace(",", "")) for r in rows]
    peaks = [float(r[4]) for r in rows if r[4]]
    return {"engine": engine, "losses": [float(r[1]) for r in rows], "tokens_per_s": sum(timed) / len(timed),
            "peak_GiB": max(peaks) if peaks else None, "argv": argv}


def forced_all_gather(smoke, steps=10):
    """Part 2, in this process: FSDP2 with the FP8 all-gather on a one-rank mesh against no FSDP."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from nanofp8 import fsdp
    from nanofp8.fp8 import Recipe, convert_to_fp8
    from nanofp8.model import GPT, GPTConfig

    device = "cpu" if smoke else "cuda"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo" if smoke else "nccl", rank=0, world_size=1)
    try:
        n_layer, n_embd, seq, batch = (2, 64, 64, 4) if smoke else (12, 768, 1024, 8)
        cfg = GPTConfig(n_layer=n_layer, n_head=n_embd // 64, n_embd=n_embd, block_size=seq, vocab_size=512)
        torch.manual_seed(0)
        x = torch.randint(0, 512, (batch, seq), device=device)
        y = torch.roll(x, -1, dims=1)
        losses = {}
        for sharded in (False, True):
            torch.manual_seed(1)
            model = GPT(cfg).to(device)
            recipe = Recipe(backend="torch" if not smoke else "cpu")
            if sharded:
                fsdp.convert(model, recipe)
                mesh = init_device_mesh(device, (1,))
                for block in model.blocks:
                    if not smoke:
                        block.compile()  # (in place: the block stays the module fully_shard wraps)
                    fully_shard(block, mesh=mesh)
                fully_shard(model, mesh=mesh)
            else:
                convert_to_fp8(model, recipe)
                for block in model.blocks if not smoke else ():
                    block.compile()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            losses[sharded] = []
            for _ in range(steps):
                with torch.autocast(device, torch.bfloat16):
                    loss = model(x, y)[1]
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses[sharded].append(loss.item())
        gathered = sum(isinstance(m, fsdp.Fp8AllGatherLinear) for m in model.modules())
        return {"losses_unsharded": losses[False], "losses_fsdp2_fp8_all_gather": losses[True],
                "max_loss_gap": max(abs(a - b) for a, b in zip(losses[False], losses[True])),
                "fp8_all_gather_layers": gathered}
    finally:
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=os.path.join(REPO, "results", "gpu", "engine_torch.json"))
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU: checks the script, measures nothing")
    args = p.parse_args()
    import bench

    result = {"env": bench.environment(), "command": " ".join(["python", *sys.argv]), "steps": args.steps}
    with tempfile.TemporaryDirectory() as tmp:
        result["engines"] = [run_engine(e, args.steps, args.smoke, os.path.join(tmp, e)) for e in ("nanofp8", "torch")]
    result["forced_fp8_all_gather"] = forced_all_gather(args.smoke)
    for r in result["engines"]:
        if "error" in r:
            print(f"engine={r['engine']}: failed: {r['error']}")
            continue
        peak = f"{r['peak_GiB']:.2f} GiB" if r["peak_GiB"] is not None else "-"
        print(f"engine={r['engine']:8s} {r['tokens_per_s']:>12,.0f} tok/s  peak {peak}  losses "
              f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}")
    a, b = (r.get("losses") for r in result["engines"])
    if a and b:
        result["max_loss_gap_engines"] = max(abs(u - v) for u, v in zip(a, b))
        print(f"largest loss gap between the engines over {len(a)} steps: {result['max_loss_gap_engines']:.2e}")
    f = result["forced_fp8_all_gather"]
    print(f"FSDP2 + FP8 all-gather on one rank ({f['fp8_all_gather_layers']} layers): largest loss gap to the "
          f"unsharded model over {len(f['losses_unsharded'])} steps {f['max_loss_gap']:.2e}")
    if not args.smoke:
        os.makedirs(os.path.dirname(args.json), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
