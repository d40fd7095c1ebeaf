"""nanofp8: a compact reference implementation of FP8 mixed-precision LLM training.

fp8.py       formats, scaling, the scaled GEMM and the FP8 linear layer (start reading here)
optim.py     precision decoupling (O2): fp16 master, FP8 gradients and Adam m, fp16 v; memory accounting
dist.py      FP8 collectives, FP8 data parallelism, ZeRO in FP8 (O3)
parallel.py  FP8 tensor, sequence and pipeline parallelism
model.py     GPT-2 and LLaMA-style models, the checkpoint format
checkpoint.py  models out of the run: any level/layout -> one model, conversion on resume, frozen FP8
interop.py   the portable safetensors export, Hugging Face GPT-2 in and out
layout.py    the run's layout: a DeviceMesh (pp x dp x tp), sizes of 1 for one process
run.py       what differs between layouts in train.py's loop: steps, gradient sums, checkpoints
data.py      token data and reproducible batches; configurator.py: configs and their validation
"""
