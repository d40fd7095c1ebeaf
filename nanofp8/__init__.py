"""nanofp8: a compact reference implementation of FP8 mixed-precision LLM training.

The core, the lesson: read these top to bottom, in this order (train.py is in the repo root).

fp8.py       formats, scaling, Fp8Tensor, quantize/dequantize, the reference GEMM and one
             torch._scaled_mm GEMM, the recipes (one table), the FP8 Linear and its Function
optim.py     precision decoupling (O2): fp16 master, FP8 gradient and Adam m, fp16 v (one
             table of formats), and Fp8AdamW, whose step is one loop over the parameters
dist.py      FP8 collectives (the bytes and their scales on the wire) and FP8 data parallelism
model.py     the GPT, in GPT-2 and LLaMA dialects
train.py     the training loop: micro-steps, loss.backward(), the step, evaluation

The engine beside it, one concern per file:

device.py    CUDA: what torch._scaled_mm takes, refusals and fallbacks, block-scale layouts, Triton glue
emulate.py   the CPU backend: the reference's arithmetic, bit for bit, on fast FP8 decoding
mx.py        MXFP8 (OCP Microscaling): the shared-exponent rule, E8M0 scales, 1x32 tiles
attention.py FP8 attention (fp8_attention=True): Q K^T and P V as FP8 GEMMs, one Function
optim_foreach.py  Fp8AdamW's foreach twin (the default, bit-equal to the loop); optim_fused.py: the
             loop compiled (o2_fused); o2_compile.py: the per-step FP8 weight cast an O2 layer
             keeps for compiled forwards; memory.py: bytes
zero.py      ZeRO in FP8 (level O3); overlap.py: gradient buckets launched during backward;
             counter.py: the bytes each collective sends
parallel.py  FP8 tensor, sequence and pipeline parallelism; layout.py: the DeviceMesh (pp x dp x tp)
fsdp.py      FP8 weight all-gathers under torch's FSDP2; convert(): any model, ready for fully_shard
torchstack.py  engine=torch: the GPT on FSDP2, DTensor tensor parallelism and DCP checkpoint sets
stats.py     what each FP8 cast did (saturation, underflow, SQNR) and the alarms
run.py       what differs between layouts in train.py's loop, resume, checkpoint sets on disk
ckptfile.py  the checkpoint file; outdir.py: sets, manifests, the lock; checkpoint.py: conversion
             between levels and layouts; interop.py: safetensors, Hugging Face GPT-2 and LLaMA
data.py      token data and reproducible batches; configurator.py: configs and their validation

The seams: the only engine names the library's core imports (tests/test_design.py holds them):

fp8.py       device.gemm (every backend but the reference), device.cast (Triton and CPU casts),
             mx.mx_scale (the "mxfp8" preset's scale rule), o2_compile.kept_operands (compiled
             O1: the weight's cast of the step)
optim.py     optim_foreach (the twin step), optim_fused (the compiled step), o2_compile.O2CompileParts
dist.py      overlap.InOrder, overlap.Pending, overlap.plan_buckets, counter.COMM,
             counter.comm_stats, emulate.fp8_to_float
model.py     attention.fp8_attention (opt-in: fp8_attention=True)

train.py, the script that puts it all together, imports the engine by module: configurator, data,
layout, run, stats, zero, ckptfile, o2_compile.

One O2 weight, from forward to optimizer step, in three files (read in this order):

fp8.py    Fp8Linear.forward                    -> Fp8LinearFunction.forward: the forward GEMM
                                                  on the weight's FP8 cast
optim.py  O2Linear.weight_operands             that cast, made once per step by the optimizer
fp8.py    Fp8LinearFunction.backward           the wgrad GEMM hands dW to the layer's take_wgrad
optim.py  O2Linear.take_wgrad                  adds dW to the FP8 gradient the weight itself
                                                  holds, fp8_grad(p), and calls its fp8_grad_hook
dist.py   Fp8DataParallel._launch              (from that hook, once the bucket is whole)
                                                  starts the bucket's FP8 reduce-scatter
dist.py   Fp8DataParallel.sync_gradients       all-gathers the average onto the weight
                                                  (set_fp8_grad)
optim.py  clip_grad_norm                       the norm of every .grad and every fp8_grad(p)
optim.py  Fp8AdamW.step                        AdamW on the dequantized fp8_grad(p) (Fp8AdamW.update,
                                                  O3's too); the new fp16 master and its next FP8
                                                  cast (O2Linear.refresh_fp8_weight)

train.py's optimizer_step calls the last three (the first two through run.sync_gradients and
run.clip). Every consumer of the FP8 gradient asks the parameter (optim.fp8_grad); no module
holds it.
"""

__version__ = "0.1.0"  # pyproject.toml reads it (the distribution's version)
