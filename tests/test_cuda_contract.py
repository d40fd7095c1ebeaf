"""Every torch._scaled_mm call nanofp8 makes obeys the CUDA contract (tests/cuda_contract.py).

Without a GPU, the calls an H100 would see are checked on CPU by a strict stand-in of the CUDA
kernel, installed in place of torch._scaled_mm (and of device.scaled_mm_support, so nanofp8 takes
the decisions it would take on that device). For four simulated devices, H100 with cuBLASLt
12.9 and torch >= 2.11 (native block scales), H100 with cuBLASLt 12.6 (CUDA 12.6 wheels: row-wise
on CUTLASS, bf16/fp16 only), H100 with a torch without native block scales, and an SM89 GPU:

* every recipe (current/delayed x tensor/row/block x hybrid/e4m3, and rowwise_with_gw_hp's row x
  tensor dgrad beside its high-precision wgrad), with and without bias, in fp32
  and under bf16 autocast, forward and backward, and the TP/SP layers of nanofp8/parallel.py
  inside a GPT: the stand-in refuses nothing;
* GEMMs the device cannot run are never attempted: they go to a named alternative, reported
  once per layer with the reason;
* the results are bit-exact with backend "emulate" (the stand-in computes with its primitives);
* block scales run natively (one call per GEMM, 1x128 / 128x128 modes) where supported, and
  as one row-wise GEMM per 128 of K (its cost named in the warning) where the torch lacks them.
"""

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from cuda_contract import CudaScaledMM
from nanofp8 import device, fp8
from nanofp8.fp8 import E4M3, E5M2, GRANULARITIES, Recipe, convert_to_fp8, dequantize, quantize, scaled_gemm, sqnr

DEVICES = {"h100": dict(sm=(9, 0), cublaslt=(12, 9)),
           "h100-cuda12.6": dict(sm=(9, 0), cublaslt=(12, 6)),
           "h100-no-native-block": dict(sm=(9, 0), cublaslt=(12, 9), torch_version=(2, 10)),
           "sm89": dict(sm=(8, 9), cublaslt=(12, 9))}
RECIPES = [dict(scaling="current", granularity=g, formats=f) for g in GRANULARITIES
           for f in ("hybrid", "e4m3")] + [dict(scaling="delayed", formats=f) for f in ("hybrid", "e4m3")] + [
    dict(granularity="row", formats="e4m3", operands=fp8.RECIPES["rowwise_with_gw_hp"].operands)]  # (dW: no FP8)


@pytest.fixture
def contract(monkeypatch, request):
    device._warned.clear()
    return CudaScaledMM(**DEVICES[request.param]).install(monkeypatch)


# -- the stand-in itself -------------------------------------------------------------


def _ops(M=64, N=48, K=256, fa=E4M3, fb=E4M3, gran="tensor", bb=(1, 128), seed=0):
    g = torch.Generator().manual_seed(seed)
    a = quantize(torch.randn(M, K, generator=g), fa, gran, (1, 128))
    b = quantize(torch.randn(N, K, generator=g), fb, gran, bb)
    return a, b


def test_stand_in_refuses_what_cuda_refuses():
    h100, old = CudaScaledMM(), CudaScaledMM(cublaslt=(12, 6))
    a, b = _ops()
    s1 = torch.ones(())
    ok = dict(scale_a=a.inv_scale, scale_b=b.inv_scale)
    h100(a.data, b.data.t(), out_dtype=torch.bfloat16, **ok)  # the reference call is accepted
    cases = [  # (stand-in, call kwargs, exception, message)
        (h100, dict(bias=torch.zeros(48), out_dtype=torch.float32), RuntimeError, "Float32"),
        (h100, dict(bias=torch.zeros(48), out_dtype=torch.bfloat16), RuntimeError, "BFloat16 or Half"),
        (h100, dict(bias=torch.zeros(48, dtype=torch.float16), out_dtype=torch.bfloat16), RuntimeError, "BFloat16"),
        (h100, dict(bias=torch.zeros(48, dtype=torch.bfloat16), out_dtype=torch.float16), RuntimeError, "Float16"),
    ]
    for sim, kw, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            sim(a.data, b.data.t(), **ok, **kw)
    with pytest.raises(RuntimeError, match="column-major"):  # mat2 must be column-major
        h100(a.data, b.data.t().contiguous(), **ok, out_dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="row-major"):
        h100(a.data.t().contiguous().t(), b.data.t(), **ok, out_dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="divisible by 16"):
        h100(a.data[:, :200], b.data[:, :200].t(), **ok, out_dtype=torch.bfloat16)
    e5a, e5b = _ops(fa=E5M2, fb=E5M2)
    with pytest.raises(ValueError, match="Float8_e5m2"):
        h100(e5a.data, e5b.data.t(), scale_a=s1, scale_b=s1, out_dtype=torch.bfloat16)
    # row-wise: fine on cuBLASLt 12.9 in fp32; the CUTLASS kernel of older builds says ValueError
    ra, rb = _ops(gran="row")
    rows = dict(scale_a=ra.inv_scale, scale_b=rb.inv_scale.t().contiguous())
    h100(ra.data, rb.data.t(), **rows, out_dtype=torch.float32)
    old(ra.data, rb.data.t(), **rows, out_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bf16/fp16"):
        old(ra.data, rb.data.t(), **rows, out_dtype=torch.float32)
    ra5, rb5 = _ops(gran="row", fa=E4M3, fb=E5M2)
    with pytest.raises(ValueError, match="e4m3"):
        old(ra5.data, rb5.data.t(), scale_a=ra5.inv_scale, scale_b=rb5.inv_scale.t().contiguous(),
            out_dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="Invalid scaling"):  # (M, 1) next to a scalar
        h100(ra.data, rb.data.t(), scale_a=ra.inv_scale, scale_b=s1, out_dtype=torch.bfloat16)
    # block scales: the layouts of device._block_scale_arg are the ones accepted
    ba, bw = _ops(gran="block", bb=(128, 128))
    _, bt = _ops(gran="block", bb=(1, 128))
    sa = device._block_scale_arg(ba, "a")
    assert sa.shape == (64, 2) and sa.stride() == (1, 64)
    sw = device._block_scale_arg(bw, "b")
    assert sw.shape == (2, 1) and sw.stride() == (1, 2)
    h100(ba.data, bw.data.t(), scale_a=sa, scale_b=sw, out_dtype=torch.bfloat16)
    h100(ba.data, bt.data.t(), scale_a=sa, scale_b=device._block_scale_arg(bt, "b"), out_dtype=torch.float32)
    assert [c[:2] for c in h100.calls[-2:]] == [("1x128", "128x128"), ("1x128", "1x128")]
    with pytest.raises(RuntimeError, match="Invalid scaling"):  # (M, Kt) row-major: wrong strides
        h100(ba.data, bt.data.t(), scale_a=ba.inv_scale, scale_b=device._block_scale_arg(bt, "b"),
             out_dtype=torch.float32)
    with pytest.raises(RuntimeError, match="Invalid scaling"):  # 128x128 x 128x128 is no pair
        wa = quantize(torch.randn(128, 256), E4M3, "block", (128, 128))
        h100(wa.data, bw.data.t(), scale_a=device._block_scale_arg(wa, "a"), scale_b=sw,
             out_dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="fast_accum"):
        h100(ba.data, bw.data.t(), scale_a=sa, scale_b=sw, out_dtype=torch.bfloat16, use_fast_accum=True)
    with pytest.raises(NotImplementedError, match="12.9"):
        old(ba.data, bw.data.t(), scale_a=sa, scale_b=sw, out_dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="SM90"):
        CudaScaledMM(sm=(8, 9))(ba.data, bw.data.t(), scale_a=sa, scale_b=sw, out_dtype=torch.bfloat16)


def test_stand_in_computes_the_scaled_product():
    # against fp64 dequantize-and-multiply: only fp32 summation error may remain
    h100 = CudaScaledMM()
    for gran, bb in (("tensor", (1, 128)), ("row", (1, 128)), ("block", (128, 128)), ("block", (1, 128))):
        a, b = _ops(M=130, N=96, K=400, gran=gran, bb=bb)
        bias = torch.randn(96).to(torch.bfloat16) if gran != "block" else None  # (block + bias: untested)
        if gran == "block":  # K = 400: 4 K tiles, where the v1 and v2 layouts of 128x128 agree
            sa, sb = device._block_scale_arg(a, "a"), device._block_scale_arg(b, "b")
        else:
            sa = a.inv_scale.expand(130, 1).contiguous()
            sb = b.inv_scale.expand(96, 1).t().contiguous()
        out = h100(a.data, b.data.t(), scale_a=sa, scale_b=sb, bias=bias, out_dtype=torch.bfloat16)
        exact = dequantize(a).double() @ dequantize(b).double().t()
        exact_b = exact if bias is None else exact + bias.double()
        assert sqnr(exact_b, out) > 45  # bf16 output rounding (~52 dB), nothing else
        out32 = h100(a.data, b.data.t(), scale_a=sa, scale_b=sb, out_dtype=torch.float32)
        assert sqnr(exact, out32) > 120
    assert not h100.misreads


@pytest.mark.parametrize("k", [128 * 5, 128 * 6, 128 * 7, 128 * 8, 128 * 6 - 48])
def test_stand_in_reads_128x128_scales_padded(k):
    """cuBLASLt reads a 128x128 scale grid with its rows padded to a multiple of 4 K tiles. v2
    (torch.nn.functional.scaled_mm) is given that padded grid and is right at every K; v1
    (torch._scaled_mm) is given the unpadded grid and, like the GPU, misreads it unless
    ceil(K/128) % 4 == 0. K = 640, 768, 896, 1024, 720: ceil(K/128) % 4 = 1, 2, 3, 0, 2."""
    import torch.nn.functional as F

    h100 = CudaScaledMM()
    a, w = _ops(M=64, N=256, K=k, gran="block", bb=(128, 128), seed=k)
    exact = dequantize(a).double() @ dequantize(w).double().t()
    v2 = h100.scaled_mm_v2(a.data, w.data.t(), device._block_scale_arg(a, "a", padded=True),
                           F.ScalingType.BlockWise1x128, device._block_scale_arg(w, "b", padded=True),
                           F.ScalingType.BlockWise128x128, output_dtype=torch.float32)
    assert sqnr(exact, v2) > 120 and not h100.misreads
    v1 = h100(a.data, w.data.t(), scale_a=device._block_scale_arg(a, "a"),
              scale_b=device._block_scale_arg(w, "b"), out_dtype=torch.float32)
    kt = -(-k // 128)
    if kt % 4 == 0:
        assert sqnr(exact, v1) > 120 and not h100.misreads
    else:  # wrong numbers, no error: what nanofp8 must never let happen
        assert h100.misreads == [(2, kt)] and not sqnr(exact, v1) > 20
    if kt % 4:  # and v2 refuses the unpadded grid
        with pytest.raises(ValueError, match="strides"):
            h100.scaled_mm_v2(a.data, w.data.t(), device._block_scale_arg(a, "a", padded=True),
                              F.ScalingType.BlockWise1x128, device._block_scale_arg(w, "b"),
                              F.ScalingType.BlockWise128x128, output_dtype=torch.float32)


def test_stand_in_refuses_what_pytorch_never_tests():
    h100 = CudaScaledMM()
    a, w = _ops(gran="block", bb=(128, 128))
    with pytest.raises(RuntimeError, match="block scales with a bias"):
        h100(a.data, w.data.t(), scale_a=device._block_scale_arg(a, "a"), scale_b=device._block_scale_arg(w, "b"),
             bias=torch.zeros(48, dtype=torch.bfloat16), out_dtype=torch.bfloat16)
    g, w = _ops(gran="row", fa=E5M2, fb=E4M3)
    with pytest.raises(RuntimeError, match="E5M2 mat1"):
        h100(g.data, w.data.t(), scale_a=g.inv_scale, scale_b=w.inv_scale.t().contiguous(),
             out_dtype=torch.float32)



def test_stand_in_block_recipes_take_e4m3_only():
    """torch 2.11's v2 block recipes (check_deepseek_recipe) take E4M3 x E4M3 only: the dgrad and
    wgrad GEMMs of formats="hybrid" (an E5M2 gradient) are "Invalid scaling configuration"
    (ValueError), as an H200 said to nanofp8. v1 lets the pair through to cuBLASLt, which
    PyTorch never tests: the stand-in refuses it too."""
    import torch.nn.functional as F

    kinds = {(1, 128): F.ScalingType.BlockWise1x128, (128, 128): F.ScalingType.BlockWise128x128}
    for fa, fb, bb in ((E5M2, E4M3, (128, 128)), (E5M2, E4M3, (1, 128)), (E4M3, E5M2, (1, 128))):
        h100 = CudaScaledMM(torch_version=(2, 11))
        a, b = _ops(K=512, fa=fa, fb=fb, gran="block", bb=bb)
        with pytest.raises(ValueError, match="Invalid scaling configuration"):
            h100.scaled_mm_v2(a.data, b.data.t(), device._block_scale_arg(a, "a", padded=True), kinds[(1, 128)],
                              device._block_scale_arg(b, "b", padded=True), kinds[bb], output_dtype=torch.float32)
        with pytest.raises(RuntimeError, match="E5M2 operand"):
            h100(a.data, b.data.t(), scale_a=device._block_scale_arg(a, "a"),
                 scale_b=device._block_scale_arg(b, "b"), out_dtype=torch.float32)
        assert len(h100.refusals) == 2 and not h100.calls
    a, b = _ops(K=512, gran="block", bb=(128, 128))  # E4M3 x E4M3: taken by both
    h100.scaled_mm_v2(a.data, b.data.t(), device._block_scale_arg(a, "a", padded=True), kinds[(1, 128)],
                      device._block_scale_arg(b, "b", padded=True), kinds[(128, 128)], output_dtype=torch.float32)
    h100(a.data, b.data.t(), scale_a=device._block_scale_arg(a, "a"), scale_b=device._block_scale_arg(b, "b"),
         out_dtype=torch.float32)
    assert [c[7] for c in h100.calls] == ["v2", "v1"]

# -- nanofp8 under the stand-in ------------------------------------------------------


def _run_layer(recipe, bias, dtype, seed=0):
    torch.manual_seed(seed)
    layer = convert_to_fp8(nn.Linear(256, 192, bias=bias), recipe)
    x = (torch.randn(2, 80, 256) * 3).requires_grad_()  # 160 tokens: wgrad has 2 K tiles
    outs = []
    for step in range(2):  # two steps: delayed scaling then has a history
        layer.zero_grad()
        x.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            y = layer(x)
        y.float().square().sum().backward()
        outs.append((y.detach(), x.grad.clone(), layer.weight.grad.clone()))
    return outs


def _cases(device):
    """Every recipe with and without bias, in fp32 and under bf16 autocast, on the H100; on the
    other devices the recipes whose GEMMs they decide differently (row and block scales: native,
    row-wise loop, high precision) and one tensor-scaled recipe, once with a bf16 bias and once
    without bias in fp32. The rules of bias and output dtype are the same on every device: the
    H100's cases test them."""
    if device == "h100":
        return [(kw, bias, dtype) for kw in RECIPES for bias in (True, False)
                for dtype in (torch.float32, torch.bfloat16)]
    return [(kw, bias, dtype) for kw in RECIPES[:1] + [r for r in RECIPES if r.get("granularity") in ("row", "block")]
            for bias, dtype in ((True, torch.bfloat16), (False, torch.float32))]


@pytest.mark.parametrize("contract", list(DEVICES), indirect=True)
def test_every_recipe_obeys_the_contract_and_matches_emulate(contract, request):
    sim = contract.support()
    for kw, bias, dtype in _cases(request.node.callspec.params["contract"]):
        device._warned.clear()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            got = _run_layer(Recipe(**kw, backend="torch"), bias, dtype)
        want = _run_layer(Recipe(**kw, backend="emulate"), bias, dtype)
        case = f"{kw} bias={bias} {dtype}"
        for step_got, step_want in zip(got, want):
            for g_, w_ in zip(step_got, step_want):
                assert torch.equal(g_, w_), case
        msgs = [str(m.message) for m in w if "nanofp8" in str(m.message)]
        assert len(msgs) == len(set(msgs)), f"{case}: a fallback reported twice: {msgs}"
        assert all("layer linear" in m and "refused" not in m for m in msgs), msgs
        if kw.get("granularity") == "block":
            if sim.block and kw["formats"] == "e4m3":
                assert not msgs, msgs  # native: nothing falls back
            elif sim.block:  # hybrid: dgrad and wgrad (E5M2 x E4M3) go elsewhere
                assert msgs and all("E5M2 operand" in m for m in msgs), msgs
            elif sim.cublaslt_rowwise:
                assert msgs and all("row-wise GEMMs (one per 128 of K)" in m for m in msgs)
            else:
                assert msgs and all("high-precision GEMM" in m for m in msgs)
    assert not contract.refusals, contract.refusals[:3]
    modes = {c[:2] for c in contract.calls}
    assert ("tensor", "tensor") in modes
    if sim.block:
        assert {("1x128", "128x128"), ("1x128", "1x128")} <= modes  # forward/dgrad, wgrad
    # bias only ever inside a bf16/fp16 GEMM of its own dtype
    assert all(c[5] is None or (c[4] == c[5] and c[4] != torch.float32) for c in contract.calls)
    # fast accumulation: only E4M3 x E4M3 (the forward GEMM), never in a block mode
    assert not any(c[6] and "1x128" in c[:2] for c in contract.calls)
    assert all(c[2] == c[3] == torch.float8_e4m3fn for c in contract.calls if c[6])


@pytest.mark.parametrize("contract", ["h100"], indirect=True)
def test_native_block_scaling_is_one_call_per_gemm(contract):
    torch.manual_seed(0)  # (E4M3 throughout: with formats="hybrid" only the forward is native)
    layer = convert_to_fp8(nn.Linear(768, 3072), Recipe(granularity="block", formats="e4m3"))
    x = torch.randn(256, 768, requires_grad=True)
    layer(x).sum().backward()
    # forward, dgrad, wgrad: three calls, though K/128 = 6 (forward), 24 (dgrad), 2 (wgrad).
    # (With a single K tile, <= 128 tokens in wgrad, a 1x128 scale *is* a row scale, and the
    # kernel takes the call as row x row: the same numbers.)
    assert [c[:2] for c in contract.calls] == [("1x128", "128x128"), ("1x128", "128x128"),
                                              ("1x128", "1x128")]
    assert [c[4] for c in contract.calls] == [torch.float32] * 3


@pytest.mark.parametrize("contract", ["h100-no-native-block"], indirect=True)
def test_block_loop_warns_once_with_its_cost(contract):
    torch.manual_seed(0)
    layer = convert_to_fp8(nn.Linear(3072, 768), Recipe(granularity="block"))
    x = torch.randn(32, 3072)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for _ in range(3):
            layer(x)
    msgs = [str(m.message) for m in w]
    assert len(msgs) == 1 and "24 row-wise GEMMs" in msgs[0] and "layer linear" in msgs[0], msgs
    assert len(contract.calls) == 3 * 24 and not contract.refusals


@pytest.mark.parametrize("contract", ["h100"], indirect=True)
def test_unsupported_shapes_are_never_attempted(contract):
    # K = 200 is no multiple of 16: the GEMM is not tried (it would raise), it falls back, once
    layer = convert_to_fp8(nn.Linear(200, 96), Recipe())
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        layer(torch.randn(8, 200))
        layer(torch.randn(8, 200))
    msgs = [str(m.message) for m in w]
    assert len(msgs) == 1 and "K=200" in msgs[0] and "high-precision" in msgs[0]
    assert not contract.calls and not contract.refusals
    e5 = quantize(torch.randn(16, 64), E5M2)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        scaled_gemm(e5, e5, torch.bfloat16, name="direct")
    assert "e5m2 x e5m2" in str(w[0].message) and not contract.refusals


@pytest.mark.parametrize("contract", ["h100"], indirect=True)
def test_a_refusal_the_rules_missed_is_caught_and_reported(contract, monkeypatch):
    # ValueError as well as RuntimeError (several CUDA checks raise ValueError)
    def refuse(*a, **k):
        raise ValueError("some rule nanofp8 does not know")

    monkeypatch.setattr(torch, "_scaled_mm", refuse)
    layer = convert_to_fp8(nn.Linear(64, 32), Recipe())
    x = torch.randn(8, 64)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        y = layer(x)
    msgs = [str(m.message) for m in w]
    assert len(msgs) == 1 and "refused by torch._scaled_mm: some rule" in msgs[0]
    ref = convert_to_fp8(nn.Linear(64, 32), Recipe(backend="emulate"))
    ref.load_state_dict(layer.state_dict())
    assert torch.equal(y, ref(x))


@pytest.fixture
def one_rank_group():
    # TP/SP layers with a group of one rank: every GEMM call is the real one, communication is
    # the identity. (Multi-rank runs are tests/test_parallel.py's job.)
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.new_group([0])
    if created:
        dist.destroy_process_group()


@pytest.mark.parametrize("contract", ["h100", "h100-cuda12.6"], indirect=True)
def test_tp_sp_layers_obey_the_contract(contract, one_rank_group):
    # parallelize() leaves a one-rank model alone, so the TP blocks are built as it builds them
    from nanofp8.model import GPT, GPTConfig
    from nanofp8.parallel import TPLinear, shard_linears, tp_plan

    for gran in GRANULARITIES:
        for sp in (False, True):
            for dtype in (torch.float32, torch.bfloat16):
                torch.manual_seed(0)
                cfg = GPTConfig(block_size=64, vocab_size=128, n_layer=1, n_head=2, n_embd=128)
                model = GPT(cfg)
                rec = Recipe(granularity=gran)
                blk = model.blocks[0]
                make = lambda w, b, kind, name: TPLinear(w, b, kind, one_rank_group, sp, rec, "fp8", name)  # noqa: E731
                shard_linears(blk, tp_plan(cfg), 0, 1, make)
                idx = torch.randint(0, 128, (4, 64))
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                    logits, loss = model(idx, idx)
                loss.backward()
                assert torch.isfinite(loss)
    assert not contract.refusals, contract.refusals[:3]
    kinds = {c[:2] for c in contract.calls}
    assert ("tensor", "tensor") in kinds and ("row", "row") in kinds
    if contract.support().block:
        assert ("1x128", "128x128") in kinds


@pytest.mark.parametrize("contract", ["h100-no-native-block"], indirect=True)
def test_triton_block_gemm_comes_before_the_loop(contract, monkeypatch):
    # On a CUDA device where kernels.py imports, block scales without native support go to the
    # Triton block GEMM (one launch), not to the K loop. (CPU tensors here: the Triton call is
    # replaced by a recorder that computes the reference.)
    used = []

    def triton_gemm(a, b, out_dtype, bias, fast_accum):
        used.append(a.granularity)
        return fp8.gemm_reference(a, b, out_dtype, bias)

    monkeypatch.setattr(device, "_triton_available", lambda device: True)
    monkeypatch.setattr(device, "gemm_triton", triton_gemm)
    layer = convert_to_fp8(nn.Linear(256, 128), Recipe(granularity="block"))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        layer(torch.randn(32, 256))
    msgs = [str(m.message) for m in w]
    assert used == ["block"] and not contract.calls
    assert len(msgs) == 1 and "the Triton GEMM (kernels.py)" in msgs[0] and "block scales need" in msgs[0]


@pytest.mark.slow
@pytest.mark.parametrize("contract", ["h100"], indirect=True)
@pytest.mark.parametrize("padded", [True, False], ids=["eager-v2", "compiled-v1"])
def test_block_recipe_at_every_k_tile_count(contract, padded, monkeypatch):
    """The block recipe (formats="e4m3", so that all three GEMMs may be native) of a Linear with
    a bias, under bf16 autocast, at K with ceil(K/128) % 4 = 1, 2, 3, 0 (the forward GEMM; dgrad
    contracts over N = 384: 3 tiles, wgrad over 192 tokens: 2). Eager code passes padded scales to torch.nn.functional.scaled_mm at every K;
    compiled code (padded_block_scales() False) calls torch._scaled_mm only where ceil(K/128) %
    4 == 0 and sends the other GEMMs elsewhere, reported. Either way the stand-in misreads no
    scale, refuses nothing, and the results are bit-exact with the fp32 reference."""
    monkeypatch.setattr(device, "padded_block_scales", lambda: padded)
    for k in (640, 768, 896, 1024):
        device._warned.clear()
        contract.calls.clear()
        got, want = [], []
        for backend, out in (("torch", got), ("emulate", want)):
            torch.manual_seed(k)
            layer = convert_to_fp8(nn.Linear(k, 384), Recipe(granularity="block", formats="e4m3",
                                                              backend=backend))
            x = torch.randn(2, 96, k, requires_grad=True)
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    y = layer(x)
                y.float().square().sum().backward()
            out += [y, x.grad, layer.weight.grad, layer.bias.grad]
            msgs = msgs if backend == "emulate" else [str(m.message) for m in w]
        for g_, w_ in zip(got, want):
            assert torch.equal(g_, w_), k
        apis = [c[7] for c in contract.calls]
        if padded:  # all three GEMMs native, through v2
            assert apis == ["v2"] * 3 and not msgs, (k, apis, msgs)
        else:  # dgrad (3 tiles) never on v1's 128x128; forward only at 8 tiles
            native = [c[:2] for c in contract.calls if c[0] == "1x128"]
            assert native == ([("1x128", "128x128")] if k == 1024 else []) + [("1x128", "1x128")], (k, native)
            assert msgs and all("ceil(K/128)" in m for m in msgs), msgs
        assert all(c[5] is None for c in contract.calls)  # never a block GEMM with a bias
    assert not contract.refusals and not contract.misreads


@pytest.mark.parametrize("contract", ["h100"], indirect=True)
@pytest.mark.parametrize("padded", [True, False], ids=["eager-v2", "compiled-v1"])
def test_block_hybrid_mlp_is_routed_by_the_rules(contract, padded, monkeypatch):
    """An MLP like the first GPU run's (768 -> 512 -> GELU -> 768 under bf16 autocast, the block
    recipe with formats="hybrid"; there 768 -> 3072 -> 768) at torch 2.11's rules. Its dgrad and
    wgrad GEMMs have an E5M2 gradient, which torch's block GEMM refuses (an H200 said "Invalid
    scaling configuration" at both layers): the rules send them to the Triton GEMM before any
    call, so the kernel refuses nothing and no try/except decides (compiled code,
    padded_block_scales() False, has none that runs). The forward GEMMs stay on torch's (v1 only
    at ceil(K/128) % 4 == 0), and every number is the fp32 reference's, bit for bit."""
    monkeypatch.setattr(device, "padded_block_scales", lambda: padded)
    routed = []

    def triton_gemm(a, b, out_dtype, bias, fast_accum):  # (CPU tensors: a recorder, not Triton)
        routed.append((a.fmt.name, b.fmt.name))
        return fp8.gemm_reference(a, b, out_dtype, bias)

    monkeypatch.setattr(device, "_triton_available", lambda device: True)
    monkeypatch.setattr(device, "gemm_triton", triton_gemm)
    got, want = [], []
    for backend, out in (("torch", got), ("emulate", want)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(768, 512), nn.GELU(), nn.Linear(512, 768))
        convert_to_fp8(model, Recipe(granularity="block", backend=backend))
        x = torch.randn(2, 96, 768, requires_grad=True)  # wgrad: 192 tokens, 2 K tiles
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = model(x)
            y.float().square().sum().backward()
        out += [y, x.grad] + [p.grad for p in model.parameters()]
        msgs = msgs if backend == "emulate" else [str(m.message) for m in w]
    assert all(torch.equal(g_, w_) for g_, w_ in zip(got, want))
    assert not contract.refusals and not contract.misreads
    # torch's block GEMM: the forward GEMMs only, E4M3 x E4M3, through v2 (eager) or, compiled,
    # through v1 where K = 512 (4 tiles); K = 768 (6 tiles) goes to the Triton GEMM
    want_calls = [("1x128", "128x128", "v2")] * 2 if padded else [("1x128", "128x128", "v1")]
    assert [(c[0], c[1], c[7]) for c in contract.calls] == want_calls
    assert all(c[2] == c[3] == torch.float8_e4m3fn for c in contract.calls)
    e5 = [r for r in routed if "e5m2" in r[0]]
    assert len(e5) == 4 and len(routed) == (4 if padded else 5), routed  # dgrad + wgrad per layer
    e5_msgs = [m for m in msgs if "E5M2 operand" in m]
    assert len(e5_msgs) == 2 and all("the Triton GEMM" in m and "refused" not in m for m in msgs), msgs
