"""kernels.gemm_mx on a GPU in one JSON line: accuracy against the fp32 reference and float64,
exactness on adversarial MX operands, and speed beside the FP8 GEMM and bf16 matmul.

    python scripts/gpu_check_mx.py [--n 4096]      (M = N = K = n; about 15 s on an H200)

Accuracy: gemm_mx (fp32 out, bias) of OCP-cast operands (kernels.mx_operand; x's 1x32 blocks
spread over 2^-20 .. 2^20) vs kernels.reference_gemm_mx and float64; bf16 out vs the reference
rounded. Exact cases (small integers, E4M3 subnormals, one power of two per output element, so the
fp32 sum is exact in any order): "exact_*" says whether gemm_mx equals the reference bit for bit.
Speed: TFLOPS (2 n^3 / time, triton.testing.do_bench) of gemm_mx, kernels.fp8_gemm and
torch._scaled_mm with per-tensor scales, bf16 matmul, and dequantize-to-bf16 + bf16 matmul (what
an MX GEMM can cost without an MX kernel), all bf16 out. Without CUDA it runs in the interpreter
(n = 128, no timings).
"""

import argparse
import json
import os
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kernels  # noqa: E402

E4M3, E8M0 = torch.float8_e4m3fn, torch.float8_e8m0fnu


def deq(d, s, dtype=torch.float64):
    return d.to(dtype) * s.to(dtype).repeat_interleave(32, 1)[:, :d.shape[1]]


def e8m0(k):
    return (k + 127).to(torch.uint8).view(E8M0)


def main():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=4096 if dev == "cuda" else 128)
    n = parser.parse_args().n
    torch.backends.cuda.matmul.allow_tf32 = False
    r = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu (interpreter)",
         "cc": list(torch.cuda.get_device_capability()) if dev == "cuda" else None,
         "torch": torch.__version__, "triton": kernels.triton.__version__, "M=N=K": n}
    g = torch.Generator(device=dev).manual_seed(0)
    spread = torch.exp2(torch.randint(-20, 20, (n, n // 32), device=dev, generator=g).float())
    x = torch.randn(n, n, device=dev, generator=g) * spread.repeat_interleave(32, 1)
    w = torch.randn(n, n, device=dev, generator=g)
    bias = torch.randn(n, device=dev, generator=g)
    (a, sa), (b, sb) = kernels.mx_operand(x), kernels.mx_operand(w)
    t0 = time.time()
    out = kernels.gemm_mx(a, sa, b, sb, torch.float32, bias)
    ref = kernels.reference_gemm_mx(a, sa, b, sb, bias)
    f64 = deq(a, sa) @ deq(b, sb).t() + bias.double()
    rel = ((out.double() - ref.double()).abs().amax(1) / ref.double().abs().amax(1)).max().item()
    r.update(sqnr_vs_fp32_ref=round(kernels.sqnr(ref, out), 1), sqnr_vs_f64=round(kernels.sqnr(f64, out), 1),
             fp32_ref_sqnr_vs_f64=round(kernels.sqnr(f64, ref), 1), max_rel_err_per_row=rel,
             bit_exact_vs_fp32_ref=torch.equal(out, ref))
    out16 = kernels.gemm_mx(a, sa, b, sb, torch.bfloat16, bias)
    r["bf16_out_eq_ref_rounded_frac"] = round((out16 == ref.bfloat16()).float().mean().item(), 4)

    m, k = 256, 512
    ints = lambda lo, hi: torch.randint(lo, hi + 1, (m, k), device=dev, generator=g).float().to(E4M3)  # noqa: E731
    subnormals = (torch.randint(-7, 8, (m, k), device=dev, generator=g) * 2.0**-9).to(E4M3)
    halves = (torch.randint(-7, 8, (m, k), device=dev, generator=g) / 4).to(E4M3)
    zero = torch.zeros(m, k // 32, dtype=torch.long, device=dev)
    alternate = torch.where(torch.arange(k // 32, device=dev) % 2 == 0, 20, -20).repeat(m, 1)
    cases = {"blocks_2^40_apart": (ints(1, 8), e8m0(alternate), ints(1, 8), e8m0(zero)),
             "e4m3_subnormals": (subnormals, e8m0(zero), ints(-8, 8), e8m0(zero)),
             "scale_2^-126_x_2^126": (ints(-8, 8), e8m0(zero - 126), halves, e8m0(zero + 126)),
             "scale_2^-127_x_2^127": (ints(-8, 8), e8m0(zero - 127), halves, e8m0(zero + 127)),
             "subnormals_x_2^-127": (subnormals, e8m0(zero - 127), ints(-8, 8), e8m0(zero))}
    for name, (a_, sa_, b_, sb_) in cases.items():
        o, t = kernels.gemm_mx(a_, sa_, b_, sb_, torch.float32), kernels.reference_gemm_mx(a_, sa_, b_, sb_)
        r[f"exact_{name}"] = torch.equal(o, t)
        r[f"sqnr_{name}"] = str(round(kernels.sqnr(deq(a_, sa_) @ deq(b_, sb_).t(), o), 1))
    if dev == "cuda":
        from triton.testing import do_bench
        xb, wb = x.bfloat16(), w.bfloat16()
        (qa, qsa), (qb, qsb) = kernels.quantize(xb, E4M3, "tensor"), kernels.quantize(wb, E4M3, "tensor")
        ia, ib = qsa.reciprocal(), qsb.reciprocal()
        fns = {"gemm_mx": lambda: kernels.gemm_mx(a, sa, b, sb, torch.bfloat16),
               "fp8_gemm_tensor": lambda: kernels.fp8_gemm(qa, qb, ia, ib, torch.bfloat16),
               "_scaled_mm_tensor": lambda: torch._scaled_mm(qa, qb.t(), ia, ib, out_dtype=torch.bfloat16),
               "bf16_matmul": lambda: xb @ wb.t(),
               "dequant_bf16_matmul": lambda: deq(a, sa, torch.bfloat16) @ deq(b, sb, torch.bfloat16).t()}
        r["TFLOPS"] = {name: round(2 * n**3 / do_bench(f) * 1e-9, 1) for name, f in fns.items()}
    r["seconds"] = round(time.time() - t0, 1)
    print(json.dumps(r))


if __name__ == "__main__":
    main()
