"""nanofp8: a compact reference implementation of FP8 mixed-precision LLM training.

fp8.py       formats, scaling, the scaled GEMM and the FP8 linear layer (start reading here)
optim.py     precision decoupling (O2): fp16 master, FP8 gradients and Adam m, fp16 v; memory accounting
dist.py      FP8 collectives, FP8 data parallelism, ZeRO in FP8 (O3)
parallel.py  FP8 tensor, sequence and pipeline parallelism
model.py     GPT-2 and LLaMA-style models, the checkpoint format
checkpoint.py  models out of the run: any level/layout -> one model, conversion on resume, frozen FP8
outdir.py    what a run keeps in out_dir: checkpoint sets and their manifests, the lock, pre-flight checks
interop.py   the portable safetensors export, Hugging Face GPT-2 in and out
layout.py    the run's layout: a DeviceMesh (pp x dp x tp), sizes of 1 for one process
run.py       what differs between layouts in train.py's loop: steps, gradient sums, checkpoints
data.py      token data and reproducible batches; configurator.py: configs and their validation

One O2 weight, from forward to optimizer step, in three files (read in this order):

fp8.py    Fp8Linear.forward                    -> fp8_linear -> _Fp8LinearFunction.forward: the
                                                  forward GEMM on the weight's FP8 cast
optim.py  O2Linear.weight_operands             that cast, made once per step by the optimizer
fp8.py    _Fp8LinearFunction.backward          the wgrad GEMM hands dW to the layer's take_wgrad
optim.py  O2Linear.take_wgrad                  adds dW to the FP8 gradient the weight itself
                                                  holds, fp8_grad(p), and calls its fp8_grad_hook
dist.py   Fp8DataParallel._launch              (from that hook, once the bucket is whole)
                                                  starts the bucket's FP8 reduce-scatter
dist.py   Fp8DataParallel.sync_gradients       all-gathers the average onto the weight
                                                  (set_fp8_grad)
optim.py  clip_grad_norm                       the norm of every .grad and every fp8_grad(p)
optim.py  Fp8AdamW.step                        AdamW on the dequantized fp8_grad(p); the new fp16
                                                  master (set_weights) and its next FP8 cast
                                                  (O2Linear.refresh_fp8_weight)

train.py's optimizer_step calls the last three (the first two through run.sync_gradients and
run.clip). Every consumer of the FP8 gradient asks the parameter (optim.fp8_grad); no module
holds it.
"""
