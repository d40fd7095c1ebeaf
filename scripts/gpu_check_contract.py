"""What a real GPU does with MX operands, against what nanofp8/device.py's rules say. One JSON line.

    python scripts/gpu_check_contract.py        (seconds; needs CUDA)

1. torch's own MX GEMM, called directly with 1x32 E8M0 scales in the blocked layout (v2
   torch.nn.functional.scaled_mm where torch has it, and v1 torch._scaled_mm): on SM100 it runs
   (then: is it the reference's product?); below, the rules say it refuses: the first line of the
   error is recorded. The rules' own answer (device.scaled_mm_support(...).mx) is printed beside.
2. nanofp8's routing of an MX pair through fp8.scaled_gemm(backend="torch"): what ran instead
   (the fallback it reported), and its product against the fp32 reference (SQNR, max relative error).
3. A 1x32 tile never reaches a path of 128-wide scale columns: the pair's product equals the
   reference to fp32 summation, which a 128-wide read of its scales would not give (checked by
   reading them that way on purpose).
"""

import json
import os
import sys
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
from nanofp8 import device  # noqa: E402
from nanofp8.fp8 import E4M3, expand_tiles, gemm_reference, quantize, scaled_gemm, sqnr  # noqa: E402
from nanofp8.mx import mx_scale, mx_scales  # noqa: E402


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def first_line(fn):
    try:
        out = fn()
        sync()
        return "ran", out
    except Exception as e:  # noqa: BLE001 (recorded, not hidden)
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}", None


def main():
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # (a CPU: a dry run of the script)
    g = torch.Generator(device=dev).manual_seed(0)
    M, N, K = 256, 512, 1024
    x = torch.randn(M, K, device=dev, generator=g) * torch.exp2(torch.randint(-20, 20, (M, K // 32), device=dev,
                                                                                generator=g).float()).repeat_interleave(32, 1)
    w = torch.randn(N, K, device=dev, generator=g)
    qa, qb = (quantize(t, E4M3, "block", (1, 32), scale_rule=mx_scale) for t in (x, w))
    ref = gemm_reference(qa, qb, torch.float32, None)
    sup = device.scaled_mm_support(torch.device(dev))
    res = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
           "cc": list(torch.cuda.get_device_capability()) if dev == "cuda" else None,
           "torch": torch.__version__, "cuda": torch.version.cuda, "rules_say_mx_native": bool(sup.mx)}
    mat1, mat2 = qa.data, qb.data.t()
    sa, sb = device.blocked_scales(mx_scales(qa)), device.blocked_scales(mx_scales(qb))
    if hasattr(F, "scaled_mm"):
        kind, sw = F.ScalingType.BlockWise1x32, F.SwizzleType.SWIZZLE_32_4_4
        res["v2_scaled_mm"], out = first_line(lambda: F.scaled_mm(mat1, mat2, sa, kind, sb, kind, swizzle_a=sw,
                                                                    swizzle_b=sw, output_dtype=torch.bfloat16))
        if out is not None:
            res["v2_sqnr_vs_reference"] = round(sqnr(ref, out.float()), 1)
    res["v1_scaled_mm"], out = first_line(lambda: torch._scaled_mm(mat1, mat2, scale_a=sa, scale_b=sb,
                                                                     out_dtype=torch.bfloat16))
    if out is not None:
        res["v1_sqnr_vs_reference"] = round(sqnr(ref, out.float()), 1)
    device.fallbacks.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = scaled_gemm(qa, qb, torch.float32, backend="torch", name="mx-pair")
        sync()
    res["routed_warnings"] = [str(w.message)[:300] for w in caught]
    res["fallbacks"] = {k: str(v)[:200] for k, v in device.fallbacks.items()}
    res["routed_sqnr_vs_reference"] = round(sqnr(ref, out), 1)
    res["routed_max_rel_err"] = float(((out - ref).abs().amax(1) / ref.abs().amax(1)).max())
    res["routed_sqnr_vs_fp32_gemm"] = round(sqnr(x.double() @ w.double().t(), out), 1)
    # the same scales read 128 wide (one scale per 128 of K: the first of each four): far off
    wrong = [expand_tiles(s.float().reciprocal()[:, ::4], (1, 128), q.data.shape) * q.data.float()
             for s, q in ((qa.scale, qa), (qb.scale, qb))]
    res["read_128_wide_sqnr_vs_reference"] = round(sqnr(ref, wrong[0] @ wrong[1].t()), 1)
    res["ok"] = res["routed_sqnr_vs_reference"] > 100 and res["read_128_wide_sqnr_vs_reference"] < 20
    print(json.dumps(res))


if __name__ == "__main__":
    main()
