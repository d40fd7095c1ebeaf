# GPT-2 small (124M) on OpenWebText, bf16 baseline: 8 GPUs, one node.
#   python data/openwebtext/prepare.py      (once: downloads and tokenizes ~9B tokens)
#   torchrun --standalone --nproc_per_node=8 train.py config/gpt2_bf16.py
# The FP8 twin is config/gpt2_fp8.py; compare their val loss curves.

out_dir = "out-gpt2-bf16"
dataset = "openwebtext"
precision = "bf16"

# the model: GPT-2 small
arch = "gpt2"
n_layer = 12
n_head = 12
n_embd = 768
block_size = 1024
bias = True
dropout = 0.0

# ~0.5M tokens per step: 12 sequences x 1024 tokens x 40 micro-batches (5 per GPU on 8 GPUs)
batch_size = 12
gradient_accumulation_steps = 5 * 8

# 600k steps x 0.5M tokens = ~300B tokens, as in the GPT-2/-3 papers' budget for this size
max_iters = 600000
lr_decay_iters = 600000
learning_rate = 6e-4
min_lr = 6e-5
warmup_iters = 2000
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0

eval_interval = 1000
eval_iters = 200
log_interval = 10
