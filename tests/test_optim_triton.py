"""The O2 step's Triton kernels (nanofp8/optim_triton.py), run in Triton's interpreter
(TRITON_INTERPRET=1, tests/conftest.py) as a GPU runs them; tests/test_sm90_compile.py compiles
them for sm_90.

Their reference is the fused step's own code run eagerly (optim_fused.update_one, the loop's
operations in the loop's order: tests/test_optim.py holds it to the loop), then the layer's cast.
The kernels make the same fp32 operations, rounded the same way (IEEE, no fused multiply-add in
the interpreter), so the two agree bit for bit where the reference's own kernels do not fuse: with
betas[0] = 0.75, torch.lerp's product by 1 - 0.75 is exact, and an fma there (AVX2's lerp) rounds
as the plain sum does. On a GPU, LLVM contracts multiplies and adds: within the bounds that
test_fused_step_matches_the_loop gives a compiler's roundings.
"""

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import triton
import triton.language as tl
from kernels import _store_fp8
from conftest import spawn
from test_optim import _adversarial_grad, _code_distance, _same_bits, _take_grads

from nanofp8 import optim_fused
from nanofp8.fp8 import E4M3, Recipe, convert_to_fp8, sqnr
from nanofp8.optim import (FP16, FP16_MAX, MASTER_HEADROOM, Fp8AdamW, O2Linear, clip_grad_norm, convert_to_o2,
                           counter_noise, fp16_scale, holds_fp8_grad, noise_bits, round_stochastic)
from nanofp8.optim_triton import _noise, _pow2_scale, _round_stochastic

# Where the kernels run: here the interpreter on the CPU; on a GPU (scripts/gpu_speed.sh) the same tests
# with NANOFP8_TEST_DEVICE=cuda TRITON_INTERPRET=0, the kernels compiled for it
DEVICE = torch.device(os.environ.get("NANOFP8_TEST_DEVICE", "cpu"))
KEPT = ("weight", "weight_scale", "fp8_w", "fp8_w_scale", "fp8_w_inv", "fp8_wt", "fp8_wt_scale", "fp8_wt_inv")


def _twins(v_format, on_triton, monkeypatch, **kw):
    """Two copies of a small O2 model, each with a fused Fp8AdamW: the first steps on update_one
    run eagerly, the second on the Triton kernels. One weight (40 x 56: not in blocks of 128)
    the kernels leave to update_one."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(128, 64), nn.GELU(), nn.Linear(64, 128), nn.Linear(128, 64, bias=False),
                         nn.Linear(64, 56), nn.Linear(56, 40))
    twins = []
    for _ in range(2):
        m = convert_to_o2(convert_to_fp8(copy.deepcopy(base).to(DEVICE), Recipe()))
        opt = Fp8AdamW(m.parameters(), m, lr=1e-2, weight_decay=0.1, betas=(0.75, 0.95), v_format=v_format,
                       fused=True, **kw)
        twins.append((m, opt))
    mine = {id(p) for p in twins[1][0].parameters()}
    monkeypatch.setattr(optim_fused, "COMPILED", optim_fused.update_one)  # (eagerly: no compile)
    monkeypatch.setattr(optim_fused, "runs_on_triton", lambda p: id(p) in mine and on_triton)
    return twins


def _twin_layers(twins):
    """(layer, its twin, their weights, their optimizer states) for each layer with a weight."""
    (m0, opt0), (m1, opt1) = twins
    for l0, l1 in zip(m0, m1):
        if hasattr(l0, "weight"):
            yield l0, l1, l0.weight, l1.weight, opt0.state[l0.weight], opt1.state[l1.weight]


def _micro_steps(twins, step, nan=False):
    gen = torch.Generator().manual_seed(step)
    m0 = twins[0][0]
    grads = [[_adversarial_grad(p.shape, step, gen).to(DEVICE) for p in m0.parameters()] for _ in range(2)]
    if nan:
        grads[1][0][5, 7] = float("nan")
    for m, _ in twins:
        _take_grads(m, grads)


@pytest.mark.parametrize("v_format", ["fp16", "fp8"])
def test_the_triton_step_matches_the_fused_step(v_format, monkeypatch):
    """7 steps of adversarial gradients (spikes, zeros, 1e-30, rows 1e6 apart, vanishing; 2
    micro-steps each, clipped every third step, a NaN step both skip), against the fused step's
    code run eagerly. This CPU's torch.sqrt is not always correctly rounded (sqrt(46.084576) comes
    out 6.7885618, 0.6 ulp off, where the kernels' sqrt_rn, a GPU's torch.sqrt and numpy make
    6.7885623), so a value whose clamp (|m| <= bound x sqrt(v)) or stochastic rounding sits at
    an ulp's distance from its threshold can go the other way: test_fused_step_matches_the_loop's
    bounds, after every step: every stored m and v value within one code of the reference's, at
    most 1% of them (and of the masters) off, every scale within 2^-20, the weights' movement
    from their start at more than 32 dB SQNR against the reference's (a master value can be more
    than a code off where the update cancels the weight: 0.01 - 0.01 leaves its ulps); the FP8
    casts within one code.
    A weight the kernels do not take (40 x 56: not in blocks of 128) is stepped by the same code
    on both sides: bit-equal, as the fp32 biases. The Triton path writes the state in place."""
    twins = _twins(v_format, True, monkeypatch)
    (m0, opt0), (m1, opt1) = twins
    off, total, worst = 0, 0, float("inf")
    start = {id(l): l.hp_weight().clone() for l in m0 if isinstance(l, O2Linear)}
    for step in range(7):
        _micro_steps(twins, step, nan=step == 6)
        for m, opt in twins:
            if step % 3 == 0:
                clip_grad_norm(m, 1.0)
            assert opt.step() == (step != 6)
            opt.zero_grad()
        assert opt1.fused_triton is True
        for l0, l1, p0, p1, st0, st1 in _twin_layers(twins):
            assert set(st0) == set(st1)
            if p0.numel() % 128:  # (not the kernels': the same code both sides)
                assert all(_same_bits(st0[k], st1[k]) for k in st0) and _same_bits(p0, p1)
                continue
            for k in ("exp_avg", "exp_avg_sq"):
                d = _code_distance(st0[k], st1[k])
                assert d.max() <= 1, (step, k)
                off, total = off + int((d > 0).sum()), total + d.numel()
                assert torch.allclose(st0[k + "_scale"], st1[k + "_scale"], rtol=2.0**-20, atol=0), (step, k)
            d = _code_distance(p0.detach(), p1.detach())  # (the masters: not within a code where the
            off, total = off + int((d > 0).sum()), total + d.numel()  # update cancels the weight)
            w0 = start[id(l0)]
            movement = sqnr(l0.hp_weight() - w0, l1.hp_weight() - w0)
            assert movement > 32, (step, movement)
            worst = min(worst, movement)
            for name in ("fp8_w", "fp8_wt"):
                assert _code_distance(getattr(l0, name), getattr(l1, name)).max() <= 1, (step, name)
            for name in ("fp8_w_scale", "fp8_w_inv", "fp8_wt_scale", "fp8_wt_inv"):
                assert torch.allclose(getattr(l0, name), getattr(l1, name), rtol=2.0**-20, atol=0), (step, name)
        for p0, p1 in zip(m0.parameters(), m1.parameters()):
            if not holds_fp8_grad(p0):
                assert _same_bits(p0, p1) and all(_same_bits(opt0.state[p0][k], opt1.state[p1][k])
                                                  for k in opt0.state[p0])
    print(f"Triton vs fused, v {v_format}: {off} of {total} stored values one code apart (masters: any), "
          f"movement SQNR >= {worst:.1f} dB")
    assert off <= 0.01 * total
    # Measured here: 4 and 3 values of 675,840 off, 104 and 146 dB. A kernel that went wrong on a
    # whole block, or rounded without its noise, would be thousands of values off.
    assert off <= 1e-3 * total
    # in place: the kernels keep each state tensor (the eager code makes new ones)
    ws = [p for p in m1.parameters() if holds_fp8_grad(p) and p.numel() % 128 == 0]
    kept = [dict(opt1.state[p]) for p in ws]
    _micro_steps(twins, 7)
    assert opt1.step()
    assert all(a[k] is opt1.state[p][k] for a, p in zip(kept, ws) for k in a if k != "step")


@triton.jit
def _building_blocks_kernel(x_ptr, key_ptr, element_ptr, n16_ptr, n8_ptr, r16_ptr, r8_ptr, s12_ptr, s13_ptr,
                            N: tl.constexpr):
    i = tl.arange(0, N)
    x, key, element = tl.load(x_ptr + i), tl.load(key_ptr + i), tl.load(element_ptr + i)
    n16, n8 = _noise(key, element, 13), _noise(key, element, 20)
    tl.store(n16_ptr + i, n16)
    tl.store(n8_ptr + i, n8)
    r16 = _round_stochastic(tl.minimum(tl.maximum(x, -65504.0), 65504.0), n16, 65504.0, 1.5 * 2.0**-14)
    tl.store(r16_ptr + i, r16.to(tl.float16))
    r8 = _round_stochastic(tl.minimum(tl.maximum(x, -448.0), 448.0), n8, 448.0, 1.5 * 2.0**-6)
    _store_fp8(r8_ptr + i, r8, 1.0, i < N, 448.0, 3, -6)
    tl.store(s12_ptr + i, _pow2_scale(tl.abs(x), 4096.0, 12))
    tl.store(s13_ptr + i, _pow2_scale(tl.abs(x), 16376.0, 13))


def test_the_kernels_building_blocks_are_the_references_bit_for_bit():
    """The kernels' own versions of optim.py's functions, on 4096 seeded values from 1e-45 to 3e38
    and the edges (+-0, the formats' smallest normals and subnormals, their maxima, the scale
    targets and their neighbours, powers of two, inf, NaN), with random 32-bit keys and element
    numbers beyond 2^32: the noise (counter_noise, 13 and 20 bits), stochastic rounding to fp16
    and E4M3 (round_stochastic, with that noise), and the power-of-two scales of the master (target
    2^12) and of v (fp16_scale(amax, FP16_MAX / 4): 16376, not a power of two) are bit-equal."""
    gen = torch.Generator().manual_seed(0)
    n = 4096
    x = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-150, 128, (n,), generator=gen).float())
    edges = [0.0, -0.0, 2.0**-14, 1.5 * 2.0**-14, 2.0**-24, 2.0**-6, 2.0**-9, 448.0, 65504.0, 4096.0, 16376.0,
             16384.0, 8188.0, 8192.0, 1e-45, 1e-40, 1.2e-38, 3e38, float("inf"), float("nan"), 1.0, 0.75]
    e = torch.tensor(edges)
    edges = torch.cat([e, -e, torch.nextafter(e, torch.full_like(e, float("inf"))),
                       torch.nextafter(e, torch.zeros_like(e))])
    x[: edges.numel()] = edges
    x = x.float()
    key = torch.randint(0, 2**32, (n,), generator=gen, dtype=torch.int64)
    element = torch.randint(0, 2**40, (n,), generator=gen, dtype=torch.int64)
    out = dict(n16=torch.empty(n, dtype=torch.int32), n8=torch.empty(n, dtype=torch.int32),
               r16=torch.empty(n, dtype=torch.float16), r8=torch.empty(n, dtype=E4M3.dtype),
               s12=torch.empty(n), s13=torch.empty(n))
    on = {k: v.to(DEVICE) for k, v in out.items()}
    _building_blocks_kernel[(1,)](x.to(DEVICE), key.to(DEVICE), element.to(DEVICE), *on.values(), N=n)
    out = {k: v.cpu() for k, v in on.items()}  # (the references: optim.py's functions on the CPU)
    n16, n8 = counter_noise(key, element, noise_bits(FP16)), counter_noise(key, element, noise_bits(E4M3))
    assert torch.equal(out["n16"], n16) and torch.equal(out["n8"], n8)
    finite = torch.isfinite(x)
    r16 = round_stochastic(x.clamp(-FP16.max, FP16.max), n16, FP16)
    r8 = round_stochastic(x.clamp(-E4M3.max, E4M3.max), n8, E4M3)
    assert torch.equal(out["r16"][finite].view(torch.int16), r16[finite].view(torch.int16))
    assert torch.equal(out["r8"][finite].view(torch.uint8), r8[finite].view(torch.uint8))
    assert torch.equal(out["s12"], fp16_scale(x.abs(), MASTER_HEADROOM))
    assert torch.equal(out["s13"], fp16_scale(x.abs(), FP16_MAX / 4))


def test_kernels_that_fail_to_compile_hand_the_step_to_torch_compile(monkeypatch):
    """A Triton compile that fails (a GPU's toolchain, say) costs speed, not the run: one warning
    naming it, and that step and the next ones take the compiled update (here run eagerly), the
    same bits as an optimizer that never tried the kernels."""
    from nanofp8 import optim_triton

    class Broken:
        def __getitem__(self, grid):
            raise RuntimeError("ptxas: no such GPU")

    twins = _twins("fp16", True, monkeypatch)
    monkeypatch.setattr(optim_triton, "_adam_store_kernel", Broken())
    for step in range(2):
        _micro_steps(twins, step)
        if step == 0:
            with pytest.warns(UserWarning, match=r"Triton kernels failed \(RuntimeError: ptxas: no such GPU\)"):
                assert twins[1][1].step()
        else:
            assert twins[1][1].step()
        assert twins[0][1].step()
        assert twins[1][1].fused_triton is False
        for _, opt in twins:
            opt.zero_grad()
        for p0, p1 in zip(twins[0][0].parameters(), twins[1][0].parameters()):
            assert _same_bits(p0, p1) and all(_same_bits(twins[0][1].state[p0][k], twins[1][1].state[p1][k])
                                              for k in twins[0][1].state[p0])


def test_the_gradient_casts_and_norms_are_the_references(monkeypatch):
    """optim_foreach.fp8_grads and fp8_norms on the kernels (cast_sums: two launches for every
    weight's fp16 sum, the cast measuring the norms in its pass; norms: two, for gradients whose
    scales changed since), against their compiled code's reference run eagerly, on adversarial
    sums (Gaussians over 10 decades, a spike, zeros, 1e-30, rows 1e6 apart, a NaN, an inf): the
    E4M3 data, the block scales and the finite block amaxes bit-equal (a block with a NaN keeps
    inf as its amax where the reference keeps NaN: non-finite either way, the step's verdict);
    each norm within 2^-20 of the reference's (the sum's order differs) and non-finite exactly
    where it is: the cast's own (no second pass), and after a clip replaced the scales, measured
    again."""
    from nanofp8 import optim_foreach
    from nanofp8.optim import _HeldGrad, to_fp16_scaled

    gen = torch.Generator().manual_seed(0)
    shapes = [(64, 128), (128, 64), (256, 384), (8, 16)]
    sums = []
    for i, shape in enumerate(shapes * 2):
        g = _adversarial_grad(shape, i, gen)
        if i == 6:
            g[3, 5] = float("nan")
        if i == 7:
            g[1, 2] = float("inf")
        sums.append(to_fp16_scaled(g.to(DEVICE), FP16_MAX / 4))
    params = [nn.Parameter(torch.zeros(d.shape, dtype=torch.float16, device=DEVICE)) for d, _ in sums]
    ref = optim_foreach._cast_sums(sums)
    for p, acc in zip(params, sums):  # (an O2 weight's gradient sum, as take_wgrad leaves it)
        p._held_grad = _HeldGrad()
        p._held_grad.acc = acc
    monkeypatch.setattr(optim_fused, "runs_on_triton", lambda t: True)
    qs = optim_foreach.fp8_grads(params)
    assert optim_foreach.TRITON_RAN is True
    for q, (data, scale, amax) in zip(qs, ref):
        assert q._norm is not None and q._norm[0] is q.scale
        assert _same_bits(q.data, data) and _same_bits(q.scale, scale)
        finite = torch.isfinite(amax)
        assert torch.equal(q.amax[finite], amax[finite]) and not torch.isfinite(q.amax[~finite]).any()
    from nanofp8 import optim_triton

    def check(norms):
        expect = optim_foreach._norms([(q.data, q.scale) for q in qs])
        for n, e in zip(norms, expect):
            if torch.isfinite(e):
                assert abs(float(n) - float(e)) <= 2.0**-20 * float(e), (float(n), float(e))
            else:
                assert not torch.isfinite(n)

    measured = optim_triton.norms
    monkeypatch.setattr(optim_triton, "norms", None)  # (the cast's norms: no second pass to call)
    check(optim_foreach.fp8_norms(qs))
    for q in qs:  # as clip_grad_norm leaves them: new scales
        q.scale = q.scale * 4.0
    monkeypatch.setattr(optim_triton, "norms", measured)
    check(optim_foreach.fp8_norms(qs))


@pytest.mark.parametrize("recipe", [Recipe(), Recipe(margin=1, power_of_two=True)], ids=["default", "margin-pow2"])
def test_o1s_weight_casts_are_the_layers_own_bit_for_bit(recipe, monkeypatch):
    """O1's FP8 weight casts after each step (o2_compile.cast_for_step) on the kernels
    (optim_triton.cast_weights: two launches for all layers), as a GPU runs them: W, W^T, their
    scales and inverses are the layer's own cast (cast_now) bit for bit, after steps that leave
    adversarial weights (rows 1e6 apart, a layer of zeros, 1e-30, a NaN); the bf16 bias copies
    follow the biases."""
    from nanofp8 import o2_compile
    from nanofp8.o2_compile import cast_after_steps, cast_for_step, cast_now, cast_once_per_step

    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(nn.Linear(128, 64), nn.GELU(), nn.Linear(64, 192), nn.Linear(192, 64)).to(DEVICE),
                           recipe)
    cast_once_per_step(model)
    cast_for_step(model, record=False)
    opt = cast_after_steps(torch.optim.AdamW(model.parameters(), lr=1e-2), model)
    monkeypatch.setattr(optim_fused, "runs_on_triton", lambda t: True)
    ran = []
    real = o2_compile._triton_casts
    monkeypatch.setattr(o2_compile, "_triton_casts",
                        lambda layers: ran.append((len(layers), real(layers))) or ran[-1][1])
    for step in range(4):
        model(torch.randn(8, 128, device=DEVICE)).square().sum().backward()
        with torch.no_grad():
            if step == 1:
                model[0].weight.mul_(10.0 ** torch.linspace(-3, 3, 64, device=DEVICE)[:, None])
                model[2].weight.zero_()
            if step == 2:
                model[3].weight.mul_(1e-30)
            if step == 3:
                model[2].weight[5, 7] = float("nan")
        opt.step()
        opt.zero_grad()
        for m in (model[0], model[2], model[3]):
            qw, qwt = cast_now(m, record=False)
            assert _same_bits(m.fp8_w, qw.data) and _same_bits(m.fp8_w_scale, qw.scale), step
            assert _same_bits(m.fp8_w_inv, qw.inv_scale) and _same_bits(m.fp8_wt_scale, qwt.scale), step
            assert torch.equal(m.fp8_wt.view(torch.uint8), qwt.data.view(torch.uint8)), step
            assert torch.equal(m.gemm_bias_kept, m.bias.detach().to(torch.bfloat16)), step
    assert ran == [(3, True)] * 4  # (the kernels made them, every step)


def _o3_worker(rank, world, v_format):
    """Two O3 twins on each rank, the first on the foreach step, the second on the kernels
    (update_shards), fed the same adversarial gradient shards (test_o3s_triton_step_...)."""
    import torch.nn.functional as F

    from nanofp8.dist import held_shard_len
    from nanofp8.zero import ZeroFp8AdamW, convert_to_o3

    # 40 x 56 and 48 x 40: shards of 1152 and 1024 values, the last zero-padded past the weight's
    # 2240 and 1920; 50 x 48: shards of 1216, not in blocks of 128 (not the kernels')
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(128, 64), nn.GELU(), nn.Linear(64, 128), nn.Linear(128, 64, bias=False),
                         nn.Linear(64, 56), nn.Linear(56, 40), nn.Linear(40, 48), nn.Linear(48, 50))
    twins = []
    for _ in range(2):
        m = convert_to_o3(convert_to_fp8(copy.deepcopy(base), Recipe()))
        twins.append((m, ZeroFp8AdamW(m.parameters(), m, lr=1e-2, weight_decay=0.1, betas=(0.75, 0.95),
                                      v_format=v_format)))
    (m0, opt0), (m1, opt1) = twins
    mine = {id(p) for p in m1.parameters()}
    optim_fused.runs_on_triton = lambda p: id(p) in mine  # (a spawned process: no monkeypatch)
    off = total = 0
    for step in range(7):
        gen = torch.Generator().manual_seed(step)
        grads = [_adversarial_grad(p.shape, step, gen) for p in m0.parameters()]
        if step == 5 and rank == 1:
            grads[0][-1, 3] = float("nan")  # (in rank 1's shard: every rank must skip)
        for m, opt in twins:
            shards = {}
            for p, g in zip(m.parameters(), grads):
                if p in opt.o2:
                    c = held_shard_len(p, world)
                    shards[p] = F.pad(g.reshape(-1), (0, world * c - p.numel()))[rank * c:(rank + 1) * c].clone()
                else:
                    p.grad = g.clone()
            assert opt.step(max_norm=1.0 if step % 3 == 0 else float("inf"), shards=shards) == (step != 5)
            opt.zero_grad()
        assert opt1.fused_triton is True
        for l0, l1, p0, p1, st0, st1 in _twin_layers(twins):
            if st0["master"].numel() % 128:  # (not the kernels': the same code both sides)
                assert all(_same_bits(st0[k], st1[k]) for k in st0) and _same_bits(p0, p1)
                continue
            for k in ("master", "exp_avg", "exp_avg_sq", "weight"):
                a, b = (p0, p1) if k == "weight" else (st0[k], st1[k])
                d = _code_distance(a.detach(), b.detach())
                assert d.max() <= (1 if k != "master" else 2**10), (step, k)  # (see the O2 test on the masters)
                off, total = off + int((d > 0).sum()), total + d.numel()
            for a, b in ((st0["master_scale"], st1["master_scale"]), (l0.weight_scale, l1.weight_scale),
                         (st0["exp_avg_scale"], st1["exp_avg_scale"]),
                         (st0["exp_avg_sq_scale"], st1["exp_avg_sq_scale"]),
                         *((getattr(l0, k), getattr(l1, k)) for k in ("fp8_w_scale", "fp8_w_inv", "fp8_wt_scale",
                                                                     "fp8_wt_inv"))):
                assert torch.allclose(a, b, rtol=2.0**-20, atol=0), step
            w, wt = l1.cast_weight()  # (the layer's kept casts: its new weight's)
            assert _same_bits(l1.fp8_w, w.data) and _same_bits(l1.fp8_w_scale, w.scale), step
            assert _same_bits(l1.fp8_wt_inv, wt.inv_scale) and _same_bits(l1.fp8_wt, wt.data), step
            # every rank holds the same FP8 weight
            both = [torch.empty_like(p1.view(torch.uint8)) for _ in range(world)]
            dist.all_gather(both, p1.detach().view(torch.uint8))
            assert all(torch.equal(both[0], b) for b in both), step
        for p0, p1 in zip(m0.parameters(), m1.parameters()):
            if p0 not in opt0.o2:
                assert _same_bits(p0, p1)
    print(f"O3 Triton vs foreach, rank {rank}, v {v_format}: {off} of {total} stored values one code apart")
    assert off <= 1e-3 * total


def _o3_workers(rank, world):  # (one spawn for the two tests below: a spawn costs seconds of imports)
    for v_format in ("fp16", "fp8"):
        _o3_worker(rank, world, v_format)
    _o3_launches_worker(rank, world)


@pytest.mark.dist
def test_o3s_triton_step_matches_its_foreach_step_in_a_few_launches():
    """O3's step on the kernels (optim_triton.update_shards: launch 1 from fp32 gradient shards
    times the clipping factor, the MAX all-reduce of the amaxes, launch 2 writing the state and the
    FP8 shard under the shared scale, one all-gather, the bytes put into the weights) against
    its foreach step (nanofp8/zero.py), on 2 gloo ranks: 7 steps of adversarial gradient shards,
    clipped every third step, a NaN in one rank's shard that every rank skips; weights whose last
    shard is padded; one the kernels do not take (48 x 50: bit-equal, the same code both sides).
    The bounds of test_the_triton_step_matches_the_fused_step; the kept casts are the new weight's,
    the weight the same bytes on every rank; with v in fp16 and in E4M3.
    Then its launches: three Triton launches and the same few dozen operators (tables, the norm,
    the replicated parameters' foreach step, scale copies, collectives) at 1 and 3 layers, where
    the foreach step launches hundreds, more with every layer (counted as nanofp8/schedule.py
    counts a step: the ATen operators that launch work, a foreach call one)."""
    spawn(_o3_workers, 2)


def _o3_launches_worker(rank, world):
    from nanofp8 import optim_triton, schedule
    from nanofp8.dist import held_shard_len
    from nanofp8.zero import ZeroFp8AdamW, convert_to_o3

    triton_launches = []
    for name in ("_adam_amax_kernel", "_adam_store_kernel", "_place_kernel"):
        kernel = getattr(optim_triton, name)

        class Counted:  # (kernel[grid](...): counted, then launched)
            def __getitem__(self, grid, kernel=kernel, name=name):
                triton_launches.append(name)
                return kernel[grid]
        setattr(optim_triton, name, Counted())
    counts = {}
    for layers in (1, 3):
        for on in (False, True):
            torch.manual_seed(0)
            m = convert_to_o3(convert_to_fp8(nn.Sequential(*[nn.Linear(128, 128) for _ in range(layers)]), Recipe()))
            opt = ZeroFp8AdamW(m.parameters(), m, lr=1e-2)
            optim_fused.runs_on_triton = lambda p, on=on: on
            for _ in range(2):  # (the second step counted: the state exists)
                shards = {p: torch.randn(held_shard_len(p, world)) for p in opt.o2}
                for p in m.parameters():
                    if p not in opt.o2:
                        p.grad = torch.randn_like(p)
                counter = schedule._Launches(host=[st["step"] for st in opt.state.values()])
                triton_launches.clear()
                with counter:
                    assert opt.step(max_norm=1.0, shards=shards)
                opt.zero_grad()
            counts[layers, on] = len(counter.ops), list(triton_launches)
    print(f"rank {rank}: {counts}")
    assert counts[1, True] == counts[3, True], counts  # (whatever the depth)
    assert counts[1, True][1] == ["_adam_amax_kernel", "_adam_store_kernel", "_place_kernel"]
    assert counts[3, True][0] < 60 and counts[3, False][0] > 5 * counts[3, True][0], counts

