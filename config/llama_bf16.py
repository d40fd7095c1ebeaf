# A ~1B-parameter LLaMA-style model on OpenWebText, bf16 baseline, one H100.
#   python data/openwebtext/prepare.py
#   python train.py config/llama_bf16.py
# The FP8 twin is config/llama_fp8.py: same everything, precision="O1". Compare tok/s and loss.

out_dir = "out-llama-bf16"
dataset = "openwebtext"
precision = "bf16"

# RMSNorm, RoPE, SwiGLU, no biases, untied embeddings (as in LLaMA 1-3).
# 16 x (4 d^2 attention + 3 d h MLP) = 16 x 51.4M = 822M in the blocks, + 2 x 103M embeddings.
arch = "llama"
n_layer = 16
n_head = 16  # head dim 128
n_embd = 2048
mlp_hidden = 0  # default: 8/3 * 2048 rounded up to a multiple of 256 = 5632
block_size = 2048
tie_embeddings = False
bias = False
dropout = 0.0

# 8 x 2048 tokens per micro-batch, 32 micro-batches: ~0.5M tokens per step
batch_size = 8
gradient_accumulation_steps = 32

# 20k steps x 0.5M = ~10B tokens (about 10 tokens per parameter)
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
