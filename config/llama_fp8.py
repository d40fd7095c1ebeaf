# A ~1B-parameter LLaMA-style model on OpenWebText in FP8 (level O1), one H100.
#   python data/openwebtext/prepare.py
#   python train.py config/llama_fp8.py
#
# Why this size: FP8 tensor cores have twice the bf16 throughput, but every FP8 GEMM also pays
# for amax reductions and casts, which scale with the tensor size, not with the FLOPs. At width
# 2048 and MLP width 5632 the GEMMs are large enough (K and N in the thousands, 16k tokens per
# micro-batch) for the doubled throughput to outweigh that overhead; at GPT-2 small's width 768 it
# does not. torch.compile (on by default on CUDA) fuses the casts into neighbouring kernels.
# Everything but the precision equals config/llama_bf16.py.

out_dir = "out-llama-fp8"
dataset = "openwebtext"
precision = "O1"
fp8_scaling = "current"
fp8_granularity = "tensor"
fp8_formats = "hybrid"

arch = "llama"
n_layer = 16
n_head = 16
n_embd = 2048
mlp_hidden = 0  # 5632
block_size = 2048
tie_embeddings = False
bias = False
dropout = 0.0

batch_size = 8
gradient_accumulation_steps = 32

max_iters = 20000
lr_decay_iters = 20000
learning_rate = 3e-4
min_lr = 3e-5
warmup_iters = 1000
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0

eval_interval = 500
eval_iters = 100
log_interval = 10
