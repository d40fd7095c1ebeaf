# A ~1B-parameter LLaMA-style model on OpenWebText, one H100 (what differs from train.py's
# defaults). The precision level is a command-line choice; config/llama_bf16.py and
# config/llama_fp8.py are this file with the level and out_dir set:
#   python data/openwebtext/prepare.py
#   python train.py config/llama.py precision=O1
#
# Why this size: FP8 tensor cores have twice the bf16 throughput, but every FP8 GEMM also pays
# for amax reductions and casts, which scale with the tensor size, not with the FLOPs. At width
# 2048 and MLP width 5632 the GEMMs are large enough (K and N in the thousands, 16k tokens per
# micro-batch) for the doubled throughput to outweigh that overhead; at GPT-2 small's width 768 it
# does not. torch.compile (on by default on CUDA) fuses the casts into neighbouring kernels.

out_dir = "out-llama"

# RMSNorm, RoPE, SwiGLU, no biases, untied embeddings (as in LLaMA 1-3).
# 16 x (4 d^2 attention + 3 d h MLP) = 16 x 51.4M = 822M in the blocks, + 2 x 103M embeddings.
# (mlp_hidden=0, the default: 8/3 * 2048 rounded up to a multiple of 256 = 5632)
arch = "llama"
n_layer = 16
n_head = 16  # head dim 128
# n_kv_head = 4  # grouped-query attention (Llama 3): 4 query heads per key/value head, a KV cache
#                # 4x smaller for serving; 0 (the default) = n_head, multi-head attention
n_embd = 2048
block_size = 2048
tie_embeddings = False
bias = False

# 8 x 2048 tokens per micro-batch, 32 micro-batches: ~0.5M tokens per step
batch_size = 8
gradient_accumulation_steps = 32

# 20k steps x 0.5M = ~10B tokens (about 10 tokens per parameter)
max_iters = 20000
lr_decay_iters = 20000
learning_rate = 3e-4
min_lr = 3e-5
warmup_iters = 1000

eval_interval = 500
eval_iters = 100
