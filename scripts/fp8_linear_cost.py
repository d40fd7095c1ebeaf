"""What one Fp8Linear costs on this machine's CPU, per recipe: forward + backward time, tensor vs
block scales, on the CPU default backend ("cpu": the reference's fast twin, nanofp8/emulate.py).
Also the SQNR of the dgrad and wgrad GEMMs of the row-wise recipes (E5M2 vs E4M3 gradients: the
rowwise preset is the second). Runs on main's code too (--backend emulate was main's CPU default).

    python scripts/fp8_linear_cost.py [--tokens 2048] [--width 768] [--reps 20]

Prints medians of --reps calls after 3 warm-up calls, side by side in one run, in CPU time of
this process (time.process_time) on --threads threads (default 1): on a shared machine wall
time moves with the other processes' load, CPU time much less. Compare the ratios."""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanofp8.fp8 import Fp8Linear, Recipe, sqnr  # noqa: E402


def step_time(recipe, x, w, reps):
    lin = Fp8Linear(w.shape[1], w.shape[0], bias=True, recipe=recipe)
    with torch.no_grad():
        lin.weight.copy_(w)
    xx = x.clone().requires_grad_(True)
    times = []
    for i in range(reps + 3):
        t0 = time.process_time()
        lin(xx).sum().backward()
        if i >= 3:
            times.append(time.process_time() - t0)
        xx.grad = lin.weight.grad = lin.bias.grad = None
    return statistics.median(times)


def grad_sqnr(recipe, x, w, dy):
    lin = Fp8Linear(w.shape[1], w.shape[0], bias=False, recipe=recipe)
    with torch.no_grad():
        lin.weight.copy_(w)
    xx = x.clone().requires_grad_(True)
    lin(xx).backward(dy)
    return sqnr(dy.double() @ w.double(), xx.grad), sqnr(dy.double().t() @ x.double(), lin.weight.grad)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.tokens, args.width, generator=g)
    w = torch.randn(args.width, args.width, generator=g) * args.width**-0.5
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, backend={args.backend}, "
          f"x ({args.tokens}, {args.width}), W ({args.width}, {args.width})")
    cases = {"tensor (hybrid)": Recipe(backend=args.backend),
             "block (e4m3)": Recipe(granularity="block", formats="e4m3", backend=args.backend),
             "block (hybrid)": Recipe(granularity="block", backend=args.backend),
             "row (hybrid)": Recipe(granularity="row", backend=args.backend)}
    times = {name: step_time(r, x, w, args.reps) for name, r in cases.items()}
    base = times["tensor (hybrid)"]
    for name, t in times.items():
        print(f"  {name:16s} fwd+bwd {t * 1e3:8.2f} ms CPU   {t / base:5.2f}x tensor")
    dy = torch.randn(args.tokens, args.width, generator=g)
    for name, r in (("row + E5M2 grads", Recipe(granularity="row", backend="emulate")),
                    ("row + E4M3 grads", Recipe(granularity="row", formats="e4m3", backend="emulate")),
                    ("tensor + E5M2 grads", Recipe(backend="emulate"))):
        d, wg = grad_sqnr(r, x, w, dy)
        print(f"  {name:18s} dgrad SQNR {d:5.1f} dB   wgrad SQNR {wg:5.1f} dB")


if __name__ == "__main__":
    main()
