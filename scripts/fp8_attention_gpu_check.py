"""FP8 attention on a CUDA GPU: its SQNR against float64 attention and its time against torch's bf16
attention (F.scaled_dot_product_attention, flash), forward + backward. Prints one JSON line.

    python scripts/fp8_attention_gpu_check.py [B H T d]        (default 8 16 1024 64; < 1 minute)

The floors are tests/test_attention.py's error budget less its 3 dB margin, for unit-scale
Gaussian inputs. "rerouted": GEMMs that torch._scaled_mm's rules sent elsewhere (nanofp8/device.py),
with the reason (at row granularity the E5M2-first GEMMs of formats="hybrid" go to the Triton
GEMM); "high_precision_gemms": those that lost FP8 on the way (must be none)."""

import json
import os
import sys
import time
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
from nanofp8 import device  # noqa: E402
from nanofp8.attention import fp8_attention  # noqa: E402
from nanofp8.fp8 import Recipe, sqnr  # noqa: E402

A, G = 10 ** -3.1, 10 ** -2.5
FLOORS = {  # tests/test_attention.py: budget_db - 3
    "tensor": {"out": 4 * A, "dq": 4 * A + 2 * G, "dk": 4 * A + 2 * G, "dv": 3 * A + G},
    "row": {"out": 4 * A, "dq": 5 * A + 2 * G, "dk": 5 * A + 2 * G, "dv": 3 * A + G},
}


def fwd_bwd(fn, q, k, v, do):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    o = fn(q, k, v)
    o.backward(do)
    return o, q.grad, k.grad, v.grad


def timed(fn, q, k, v, do, reps=5):
    fwd_bwd(fn, q, k, v, do)  # warm-up (Triton compiles, cuBLAS heuristics)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fwd_bwd(fn, q, k, v, do)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def main():
    warnings.simplefilter("always")
    with warnings.catch_warnings(record=True) as caught:
        run(caught)


def run(caught):
    import math

    B, H, T, d = (int(a) for a in sys.argv[1:5]) if len(sys.argv) > 4 else (8, 16, 1024, 64)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, H, T, d, device="cuda", generator=g).bfloat16() for _ in range(4))
    ref = fwd_bwd(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                  *(x.double() for x in (q, k, v, do)))
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": [B, H, T, d],
           "sqnr_db": {}, "floor_db": {}, "ms_fwd_bwd": {}}
    ok = True
    for gran in ("tensor", "row"):
        recipe = Recipe(granularity=gran, backend="torch")
        fn = lambda q, k, v, recipe=recipe: fp8_attention(q, k, v, recipe)  # noqa: E731
        got = fwd_bwd(fn, q, k, v, do)
        out["sqnr_db"][gran] = {w: round(sqnr(r, x), 2) for w, r, x in zip(("out", "dq", "dk", "dv"), ref, got)}
        out["floor_db"][gran] = {w: round(-10 * math.log10(n) - 3, 2) for w, n in FLOORS[gran].items()}
        ok &= all(out["sqnr_db"][gran][w] > out["floor_db"][gran][w] for w in FLOORS[gran])
        out["ms_fwd_bwd"][f"fp8_{gran}"] = round(timed(fn, q, k, v, do), 2)
    del ref
    out["ms_fwd_bwd"]["sdpa_bf16"] = round(timed(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), q, k, v, do), 3)
    out["high_precision_gemms"] = dict(device.fallbacks)  # counted per call: FP8 lost there
    out["rerouted"] = sorted({str(w.message) for w in caught if "nanofp8" in str(w.message)})
    out["ok"] = bool(ok) and not device.fallbacks
    print(json.dumps(out))


if __name__ == "__main__":
    main()
