"""Every Triton kernel of kernels.py compiles for an H100 (sm_90), on a machine without a GPU.

triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32)) runs the whole compiler offline,
down to ptxas (bundled with triton). For every GEMM variant (output dtype x accumulation mode x
TMA or pointer path) and every tile config that kernels.gemm_plan may pick for it, and for
every quantizer, this checks what would otherwise first be seen on the GPU:

* it compiles (split-K GEMMs and their reduction included); the GEMMs use Hopper's wgmma
  (`wgmma.mma_async`), the TMA path really loads with TMA (`cp.async.bulk.tensor`);
* shared memory per block is within the H100's 232,448 bytes (a config over it fails to launch);
* ptxas reports zero spilled registers (spills to local memory cost bandwidth in the main loop),
  except a few bytes in the 128x128 weight-tile quantizer (see kernels.tile_warps);
* the quantizers restore the sign with `neg.f32` (triton 3.6 compiled `-x` as a subtraction,
  which stores -0 as +0; see tests/test_kernels.py).

What it cannot check: speed, and correctness of the compiled code (the interpreter tests in
tests/test_kernels.py run the same source). Those await a GPU: `python kernels.py`.
"""

import importlib
import multiprocessing
import os
import re
import subprocess
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

import pytest

H100_SHARED = 232448  # bytes of shared memory a block may use on sm_90 (opt-in maximum)

triton = pytest.importorskip("triton")


def _gemm_variants():
    """(name, signature dtypes, constexprs, warps, stages) for every GEMM fp8_gemm may run."""
    import kernels

    out = []
    modes = {"fast": dict(BLOCKWISE=False, FAST_ACCUM=True, A_SCALE_ROWS=1, B_SCALE_ROWS=1),
             "promote": dict(BLOCKWISE=False, FAST_ACCUM=False, A_SCALE_ROWS=1, B_SCALE_ROWS=1),
             "block-1x128x128x128": dict(BLOCKWISE=True, FAST_ACCUM=False, A_SCALE_ROWS=1, B_SCALE_ROWS=128),
             "block-1x128x1x128": dict(BLOCKWISE=True, FAST_ACCUM=False, A_SCALE_ROWS=1, B_SCALE_ROWS=1)}
    # (out dtype, TMA, split_k): every output dtype unsplit; split-K (TMA only) writes fp32 partial
    # sums whatever the output dtype, so once, with fp32 tiles (kernels.gemm_plan)
    launches = [(o, tma, 1) for o in ("bf16", "fp16", "fp32") for tma in (True, False)] + [("bf16", True, 2)]
    for out_t, tma, split in launches:
        for mode, flags in modes.items():
            tiles = kernels.hopper_gemm_tiles(4 if out_t == "fp32" or split > 1 else 2, tma, flags["FAST_ACCUM"],
                                              flags["BLOCKWISE"], flags["B_SCALE_ROWS"] == 1)
            for bm, bn, stages, warps in tiles:
                # the forward GEMM is E4M3 x E4M3; dgrad and wgrad put an E5M2 gradient first
                a_t = "fp8e4nv" if mode == "fast" else "fp8e5"
                sig = {"a_ptr": f"*{a_t}", "b_ptr": "*fp8e4nv", "c_ptr": f"*{out_t}", "ws_ptr": "*fp32",
                       "a_scale_ptr": "*fp32", "b_scale_ptr": "*fp32", "bias_ptr": f"*{out_t}",
                       "M": "i32", "N": "i32", "K": "i32", "MP": "i32", "stride_sam": "i32", "stride_sak": "i32",
                       "stride_sbn": "i32", "stride_sbk": "i32"}
                const = dict(flags, USE_TMA=tma, HAS_BIAS=True, ROUND_BF16=False, NUM_SMS=132, SPLIT_K=split,
                             BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=8)
                name = (f"gemm {out_t} {mode} {'tma' if tma else 'pointer'} {bm}x{bn} s{stages} w{warps}"
                        + (f" split{split}" if split > 1 else ""))
                out.append((name, "_fp8_gemm_kernel", sig, const, warps, stages))
    for out_t in ("bf16", "fp16", "fp32"):  # the split-K sum and epilogue, as _launch_fp8_gemm runs it
        for blockwise in (False, True):
            sig = {"ws_ptr": "*fp32", "c_ptr": f"*{out_t}", "a_scale_ptr": "*fp32", "b_scale_ptr": "*fp32",
                   "bias_ptr": f"*{out_t}", "M": "i32", "N": "i32", "MP": "i32", "stride_sam": "i32",
                   "stride_sbn": "i32"}
            const = dict(A_SCALE_ROWS=1, B_SCALE_ROWS=1, BLOCKWISE=blockwise, HAS_BIAS=True, ROUND_BF16=False,
                         SPLIT_K=4, BLOCK_M=64, BLOCK_N=64)
            out.append((f"reduce {out_t} blockwise={blockwise}", "_split_k_reduce_kernel", sig, const, 4, 3))
    return out


def _quantizer_variants():
    """Each quantizer once per input dtype / format pairing that changes its code, with the
    block sizes kernels.quantize launches for rows of >= 1024 values."""
    import kernels
    import torch
    fmt = {name: (ty, dict(zip(("FP8_MAX", "MBITS", "EMIN"), kernels.FP8_FORMATS[dtype])))
           for name, ty, dtype in (("e4m3", "fp8e4nv", torch.float8_e4m3fn), ("e5m2", "fp8e5", torch.float8_e5m2))}
    out = [("amax bf16", "_amax_partial_kernel", {"x_ptr": "*bf16", "partial_ptr": "*fp32", "n": "i32"},
            dict(BLOCK=4096), 4, 3)]
    for f, x_t in (("e4m3", "bf16"), ("e5m2", "fp32")):
        ty, consts = fmt[f]
        common = dict(consts, MARGIN_MUL=1.0, POW2=False)
        for write_t in (False, True):
            out.append((f"cast tensor {f} {x_t} transpose={write_t}", "_cast_tensor_kernel",
                        {"x_ptr": f"*{x_t}", "q_ptr": f"*{ty}", "qt_ptr": f"*{ty}", "partial_ptr": "*fp32",
                         "scale_ptr": "*fp32", "R": "i32", "C": "i32", "P": "i32"},
                        dict(common, WRITE_T=write_t, P_BLOCK=1024, BLOCK_R=64 if write_t else 16,
                             BLOCK_C=64 if write_t else 256), 4, 3))
        out.append((f"rows {f} {x_t}", "_quantize_rows_kernel",
                    {"x_ptr": f"*{x_t}", "q_ptr": f"*{ty}", "scale_ptr": "*fp32", "R": "i32", "C": "i32"},
                    dict(common, BLOCK_R=4, BLOCK_C=1024), 4, 3))
        for tr, br in ((1, 32), (128, 128)):  # as kernels.quantize launches them
            warps = kernels.tile_warps(br * 128)
            out.append((f"tiles {tr}x128 {f} {x_t}", "_quantize_tiles_kernel",
                        {"x_ptr": f"*{x_t}", "q_ptr": f"*{ty}", "scale_ptr": "*fp32", "R": "i32", "C": "i32",
                         "n_col_tiles": "i32"},
                        dict(common, TILE_R=tr, TILE_C=128, BLOCK_R=br), warps, 3))
    return out


def _optim_variants():
    """The O2 step's kernels (nanofp8/optim_triton.py) as it launches them: v in fp16 and as
    sqrt(v) in E4M3; the weight cast to E4M3 and to E5M2; the gradient sums' casts and norms;
    O3's update of its shards and the placing of the gathered weights."""
    from nanofp8 import optim_triton as ot

    out = []
    for v_fp8 in (False, True):
        const = dict(V_FP8=v_fp8, ROWS_=ot.ROWS, B=ot.STATE_BLOCK)  # (every constexpr given: its default is not)
        out.append((f"optim adam amax v_fp8={v_fp8}", "nanofp8.optim_triton:_adam_amax_kernel",
                    {"table": "*i64", "prog_weight": "*i32", "amax_w": "*fp32"}, dict(const, G_FP32=False), 4, 3))
        out.append((f"optim adam store v_fp8={v_fp8}", "nanofp8.optim_triton:_adam_store_kernel",
                    {"table": "*i64", "prog_weight": "*i32", "amax_w": "*fp32", "amax_q": "*fp32", "s_new": "*fp32"},
                    dict(const, BITS16=13, BITS8=20, SHARD=False), 4, 3))
        # O3's (update_shards): fp32 gradient shards; the FP8 shard under the shared scale
        out.append((f"optim adam amax o3 v_fp8={v_fp8}", "nanofp8.optim_triton:_adam_amax_kernel",
                    {"table": "*i64", "prog_weight": "*i32", "amax_w": "*fp32"}, dict(const, G_FP32=True), 4, 3))
        out.append((f"optim adam store o3 v_fp8={v_fp8}", "nanofp8.optim_triton:_adam_store_kernel",
                    {"table": "*i64", "prog_weight": "*i32", "amax_w": "*fp32", "amax_q": "*fp32", "s_new": "*fp32"},
                    dict(const, BITS16=13, BITS8=20, SHARD=True), 4, 3))
    rows = dict(ROWS_=ot.ROWS, B=ot.STATE_BLOCK)
    out += [("optim cast sums", "nanofp8.optim_triton:_cast_sums_kernel",
             {"table": "*i64", "prog_weight": "*i32", "partial": "*fp32"}, rows, 4, 3),
            ("optim square sums", "nanofp8.optim_triton:_square_sums_kernel",
             {"table": "*i64", "prog_weight": "*i32", "partial": "*fp32"}, rows, 4, 3),
            ("optim norms", "nanofp8.optim_triton:_norms_kernel",
             {"table": "*i64", "partial": "*fp32", "norms": "*fp32"},
             dict(ROW=4, BLOCKS_AT=2, P_BLOCK=256, ROWS_=ot.ROWS), 4, 3)]
    for e5m2, (fmax, mbits, emin) in ((False, (448.0, 3, -6)), (True, (57344.0, 2, -14))):
        for master in (True, False):  # (False: O1's fp32 weights, cast_weights)
            out.append((f"optim cast weight e5m2={e5m2} master={master}", "nanofp8.optim_triton:_cast_weight_kernel",
                        {"table": "*i64", "tile_weight": "*i32", "amax_q": "*fp32", "s_new": "*fp32"},
                        dict(FP8_MAX=fmax, MBITS=mbits, EMIN=emin, MARGIN_MUL=1.0, POW2=False, E5M2=e5m2,
                             TILE_=ot.TILE, MASTER=master), 4, 3))
    out.append(("optim weights amax", "nanofp8.optim_triton:_weights_amax_kernel",
                {"table": "*i64", "tile_weight": "*i32", "amax": "*fp32"}, dict(TILE_=ot.TILE), 4, 3))
    out.append(("optim place o3", "nanofp8.optim_triton:_place_kernel",
                {"table": "*i64", "prog_weight": "*i32", "recv": "*u8", "row_len": "i64"}, rows, 4, 3))
    # delayed scaling's (nanofp8/history_triton.py): the pushes, with the weights' casts logged or not
    for most_recent, has_cast in ((False, False), (True, True)):
        out.append((f"history push most_recent={most_recent} cast={has_cast}", "nanofp8.history_triton:_push_kernel",
                    {"table": "*i64"}, dict(H=16, HP=16, MOST_RECENT=most_recent, FWD_MAX=448.0, BWD_MAX=57344.0,
                                            MARGIN_MUL=1.0, POW2=False, HAS_CAST=has_cast), 4, 3))
    for e5m2, (fmax, mbits, emin, edge) in ((False, (448.0, 3, -6, 464.0)), (True, (57344.0, 2, -14, 61440.0))):
        out.append((f"history delayed cast e5m2={e5m2}", "nanofp8.history_triton:_delayed_cast_kernel",
                    {"table": "*i64", "tile_weight": "*i32", "amax": "*fp32", "over": "*i32"},
                    dict(FP8_MAX=fmax, MBITS=mbits, EMIN=emin, E5M2=e5m2, CLIP_EDGE=edge, TILE_=ot.TILE), 4, 3))
    return out


def _compile(job, cap=90):
    """Compile one variant for sm_{cap} (in a worker process); returns what the test checks.
    (tests/test_mx_compile.py compiles the MX GEMM with it for sm_100 too.)"""
    name, kernel, sig, const, warps, stages = job
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    import kernels
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    module, _, kernel = kernel.rpartition(":")  # ("module:kernel" for a kernel outside kernels.py)
    fn = getattr(importlib.import_module(module) if module else kernels, kernel)
    while not isinstance(fn, triton.runtime.JITFunction):  # under the autotuner
        fn = fn.fn
    target = GPUTarget("cuda", cap, 32)
    opts = make_backend(target).parse_options({"num_warps": warps, "num_stages": stages}).__dict__
    sig = dict(sig, **{k: "constexpr" for k in const})
    t0 = time.time()
    k = triton.compile(ASTSource(fn, sig, const), target=target, options=opts)
    ptx = k.asm["ptx"]
    with tempfile.TemporaryDirectory() as d:  # ptxas -v: registers and spills
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run([get_ptxas(cap).path, "-v", f"--gpu-name=sm_{cap}a", src, "-o",
                            os.path.join(d, "k.cubin")], capture_output=True, text=True)
    log = r.stdout + r.stderr
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    regs = re.search(r"Used (\d+) registers", log)
    return dict(name=name, shared=k.metadata.shared, spills=int(spill.group(1)) + int(spill.group(2)),
                regs=int(regs.group(1)), wgmma="wgmma.mma_async" in ptx, tma="cp.async.bulk.tensor" in ptx,
                neg=bool(re.search(r"\bneg\.f32", ptx)), ftz=".ftz" in ptx,
                div_rn="div.rn.f32" in ptx, sqrt_rn="sqrt.rn.f32" in ptx,
                approx=sorted(set(re.findall(r"\b(?:div|sqrt|rcp|rsqrt)\.approx[\w.]*", ptx))),
                atomic_max=bool(re.search(r"\b(?:atom|red)\.global[\w.]*\.max", ptx)),
                mma=sorted(set(re.findall(r"(?:tcgen05\.mma|wgmma\.mma_async)[\w.:]*", ptx))),
                seconds=time.time() - t0)


@pytest.fixture(scope="module")
def compiled():
    jobs = _gemm_variants() + _quantizer_variants() + _optim_variants()
    t0 = time.time()
    # Fresh processes: this one holds triton and kernels.py built for the interpreter. Children
    # inherit the environment when they start and import triton (unpickling _compile imports this
    # file) before _compile runs, so they start without TRITON_INTERPRET (tests/conftest.py sets it).
    interpret = os.environ.pop("TRITON_INTERPRET", None)
    try:
        with ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("spawn")) as pool:
            res = list(pool.map(_compile, jobs))
    finally:
        if interpret is not None:
            os.environ["TRITON_INTERPRET"] = interpret
    print(f"\n{len(res)} kernels compiled for sm_90 in {time.time() - t0:.0f} s")
    for r in res:
        print(f"  {r['name']:48s} shared {r['shared']:6d} B  regs {r['regs']:3d}  spills {r['spills']:4d} B")
    return res


@pytest.mark.slow
def test_every_gemm_variant_compiles_for_sm90(compiled):
    gemms = [r for r in compiled if r["name"].startswith("gemm")]
    assert len(gemms) >= 24 and sum(" split" in r["name"] for r in gemms) >= 8
    for r in gemms:
        assert r["wgmma"], f"{r['name']}: no wgmma.mma_async"
        assert r["tma"] == (" tma " in r["name"]), f"{r['name']}: TMA expected only on the TMA path"
        assert r["shared"] <= H100_SHARED, f"{r['name']}: {r['shared']} B of shared memory"
        assert r["spills"] == 0, f"{r['name']}: {r['spills']} B spilled"


@pytest.mark.slow
def test_split_k_reduction_compiles_for_sm90(compiled):
    reduce = [r for r in compiled if r["name"].startswith("reduce")]
    assert len(reduce) == 6
    for r in reduce:
        assert r["shared"] <= H100_SHARED and r["spills"] == 0, r


@pytest.mark.slow
def test_every_quantizer_compiles_for_sm90(compiled):
    quant = [r for r in compiled if not r["name"].startswith(("gemm", "reduce", "optim", "history"))]
    assert len(quant) >= 11
    for r in quant:
        # The one documented exception (kernels.tile_warps): the 128x128 weight-tile quantizer
        # spills a few bytes (8 for bf16 -> e4m3, 16 for fp32 -> e5m2 with triton 3.9).
        allowed = 16 if r["name"].startswith("tiles 128x128") else 0
        assert r["shared"] <= H100_SHARED and r["spills"] <= allowed, r
        if "cast" in r["name"] or "tiles" in r["name"] or "rows" in r["name"]:
            assert r["neg"], f"{r['name']}: the sign restore is not a neg.f32"


@pytest.mark.slow
def test_the_history_kernels_compile_for_sm90(compiled):
    """nanofp8/history_triton.py: no spills; the next scales' inverses a correctly rounded division
    (div.rn, as torch's reciprocal), no .approx, no flush of subnormals; the casts' amaxes and
    clipped counts as atomics."""
    history = {r["name"]: r for r in compiled if r["name"].startswith("history")}
    assert len(history) == 4
    for name, r in history.items():
        assert r["shared"] <= H100_SHARED and r["spills"] == 0, r
        assert not r["ftz"] and not r["approx"], r
        assert r["div_rn"] == ("push" in name) and r["atomic_max"] == ("cast e5m2" in name), name


@pytest.mark.slow
def test_the_o2_step_kernels_compile_for_sm90(compiled):
    """nanofp8/optim_triton.py: no spills at its ROWS and TILE; its divisions and square roots
    correctly rounded (div.rn, sqrt.rn: an approximate one would break the bit-equality with torch's
    CUDA kernels that tests/test_optim_triton.py states), no flush of subnormals (.ftz: the fp16
    master and v keep subnormals), and the amaxes of the launches as atomic maxima."""
    optim = {r["name"]: r for r in compiled if r["name"].startswith("optim")}
    assert len(optim) == 17
    for name, r in optim.items():
        assert r["shared"] <= H100_SHARED and r["spills"] == 0, r
        assert not r["ftz"] and not r["approx"], r
        if any(k in name for k in ("adam", "cast", "square")):  # (the kernels that divide)
            assert r["div_rn"], name
        if ("adam" in name and "store o3" not in name) or name == "optim weights amax":
            assert r["atomic_max"], name
        if "adam" in name:
            assert r["sqrt_rn"], name
    assert optim["optim norms"]["sqrt_rn"]
