"""kernels.gemm_mx compiles for Blackwell (sm_100) and Hopper (sm_90), on a machine without a GPU.

The whole compiler runs offline, ptxas included (triton ships ptxas-blackwell for sm_100a), with
tests/test_sm90_compile.py's _compile. For every tile config the autotuner may pick on each
generation (kernels.mx_gemm_tiles, kernels._MX_TILES_BF16) and each output dtype, this checks:

* sm_100: the MMA is Blackwell's block-scaled one, `tcgen05.mma.cta_group::1.kind::mxf8f6f4
  .block_scale` (the tensor core applies the E8M0 scales; its scale-vector suffix is
  `.block32` with triton 3.9, `.scale_vec::1X` with 3.6), and no wgmma;
* sm_90: Hopper has no MX instruction; gemm_mx runs kernels._mx_gemm_bf16_kernel there, whose
  tiles are dequantized to bf16 while loading: a bf16 wgmma (`wgmma.mma_async....f32.bf16.bf16`);
* both: A and B arrive by TMA, shared memory fits a block (232,448 B on both), no spills; on
  sm_90 no instruction flushes subnormals (`.ftz`): 2^-127 is one.

`python tests/test_mx_compile.py --json results/kernels_sm100.json` writes the figures (shared
memory, registers, spills, MMA instructions, versions) that docs/gpu.md quotes. Speed and the
numbers the compiled code computes need a GPU (`python kernels.py`).
"""

import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from functools import partial

import pytest

triton = pytest.importorskip("triton")

SHARED_LIMIT = 232448  # bytes of shared memory a block may use, sm_90 and sm_100 alike (opt-in)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "results", "kernels_sm100.json")
OUT_TYPES = ("bf16", "fp32")


def _variants(cap):
    """(name, kernel, signature, constexprs, warps, stages) of each MX GEMM the autotuner may run:
    on sm_100 the dot_scaled kernel, on sm_90 the bf16 one (kernels.mx_method)."""
    import kernels
    out = []
    tiles = kernels.mx_gemm_tiles(10) if cap == 100 else kernels._MX_TILES_BF16
    for a_fmt, b_fmt in [("e4m3", "e4m3"), ("e5m2", "e4m3")]:
        for out_t in OUT_TYPES if a_fmt == "e4m3" else ("bf16",):
            for bm, bn, stages, warps in tiles:
                ty = {"e4m3": "*fp8e4nv", "e5m2": "*fp8e5"}
                sig = {"a_ptr": ty[a_fmt], "b_ptr": ty[b_fmt], "c_ptr": f"*{out_t}", "a_scale_ptr": "*u8",
                       "b_scale_ptr": "*u8", "bias_ptr": f"*{out_t}", "M": "i32", "N": "i32", "K": "i32"}
                const = dict(HAS_BIAS=True, ROUND_BF16=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=8)
                if cap == 100:
                    kernel, const = "_mx_gemm_kernel", dict(const, A_FMT=a_fmt, B_FMT=b_fmt)
                else:
                    kernel, const = "_mx_gemm_bf16_kernel", dict(const, INTERPRETED=False)
                name = f"gemm_mx sm_{cap} {a_fmt}x{b_fmt} {out_t} {bm}x{bn} s{stages} w{warps}"
                out.append((name, kernel, sig, const, warps, stages))
    return out


def compile_all():
    """Compile every variant for sm_100 and sm_90 in two fresh worker processes."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_sm90_compile import _compile
    jobs = [(j, cap) for cap in (100, 90) for j in _variants(cap)]
    interpret = os.environ.pop("TRITON_INTERPRET", None)  # (children start without it)
    try:
        with ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(partial(_compile, cap=cap), j) for j, cap in jobs]
            res = [f.result() for f in futures]
    finally:
        if interpret is not None:
            os.environ["TRITON_INTERPRET"] = interpret
    for r, (_, cap) in zip(res, jobs):
        r["target"] = f"sm_{cap}a"
    return res


@pytest.fixture(scope="module")
def compiled():
    t0 = time.time()
    res = compile_all()
    print(f"\n{len(res)} MX GEMM variants compiled in {time.time() - t0:.0f} s")
    for r in res:
        print(f"  {r['name']:44s} shared {r['shared']:6d} B  regs {r['regs']:3d}  spills {r['spills']:4d} B  {r['mma']}")
    return res


@pytest.mark.slow
def test_mx_gemm_compiles_for_sm100_to_the_block_scaled_mma(compiled):
    import kernels
    sm100 = [r for r in compiled if r["target"] == "sm_100a"]
    assert len(sm100) == len(kernels.mx_gemm_tiles(10)) * (len(OUT_TYPES) + 1)
    for r in sm100:
        assert r["mma"] and all(m.startswith("tcgen05.mma.cta_group::1.kind::mxf8f6f4.block_scale")
                                for m in r["mma"]), r
        assert not r["wgmma"] and r["tma"], r
        assert r["shared"] <= SHARED_LIMIT and r["spills"] == 0, r


@pytest.mark.slow
def test_mx_gemm_compiles_for_sm90_to_a_bf16_wgmma(compiled):
    import kernels
    sm90 = [r for r in compiled if r["target"] == "sm_90a"]
    assert len(sm90) == len(kernels._MX_TILES_BF16) * (len(OUT_TYPES) + 1)
    for r in sm90:
        assert r["mma"] and all(m.startswith("wgmma.mma_async") and m.endswith(".f32.bf16.bf16")
                                for m in r["mma"]), r
        # the scale 2^-127 and products below 2^-126 are fp32 subnormals: no flush to zero
        assert not r["ftz"], r
        assert r["tma"] and r["shared"] <= SHARED_LIMIT and r["spills"] == 0, r


def test_recorded_figures_cover_the_tiles_of_today():
    # results/kernels_sm100.json is made by this file's __main__; it must list what
    # kernels.mx_gemm_tiles now holds (rerun it when the tiles change)
    import kernels
    with open(RESULTS) as f:
        rec = json.load(f)
    for cap in (100, 90):
        want = {n for n, *_ in _variants(cap)}
        got = {r["name"] for r in rec["kernels"] if r["target"] == f"sm_{cap}a"}
        assert got == want, (cap, sorted(want ^ got))
    assert all(r["spills"] == 0 for r in rec["kernels"])
    assert kernels.MX_BLOCK == 32


if __name__ == "__main__":
    import argparse
    import datetime
    import platform
    parser = argparse.ArgumentParser(description="compile kernels.gemm_mx for sm_100 and sm_90, offline")
    parser.add_argument("--json", metavar="PATH", help="write the figures to PATH")
    args = parser.parse_args()
    sys.path.insert(0, ROOT)
    from triton.backends.nvidia.compiler import get_ptxas
    res = compile_all()
    for r in res:
        print(f"{r['name']:44s} shared {r['shared']:6d} B  regs {r['regs']:3d}  spills {r['spills']:4d} B  "
              f"tma {r['tma']}  {' '.join(r['mma'])}")
    if args.json:
        import torch
        out = {"what": "kernels._mx_gemm_kernel compiled offline (no GPU) by tests/test_mx_compile.py; "
                       "registers and spills from ptxas -v",
               "date": datetime.date.today().isoformat(), "python": platform.python_version(),
               "torch": torch.__version__, "triton": triton.__version__,
               "ptxas": {f"sm_{c}a": f"{get_ptxas(c).path.rsplit('/', 1)[-1]} {get_ptxas(c).version}" for c in (100, 90)},
               "kernels": [{k: r[k] for k in ("name", "target", "shared", "regs", "spills", "tma", "mma")}
                           for r in res]}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")
