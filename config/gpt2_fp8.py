# GPT-2 small (124M) on OpenWebText in FP8 (level O1): 8 GPUs, one node.
#   python data/openwebtext/prepare.py      (once: downloads and tokenizes ~9B tokens)
#   torchrun --standalone --nproc_per_node=8 train.py config/gpt2_fp8.py
#
# Everything but `precision` equals config/gpt2_bf16.py, so the two loss curves are directly
# comparable. This run is about numerics, not speed: at width 768 the GEMMs are too small for
# FP8 tensor cores to beat the cost of the casts (for speed, see config/llama_fp8.py).

out_dir = "out-gpt2-fp8"
dataset = "openwebtext"
precision = "O1"
fp8_scaling = "current"  # amax of the tensor being cast, every time: no stale scales
fp8_granularity = "tensor"  # one scale per tensor: the cheapest, and enough at this scale
fp8_formats = "hybrid"  # E4M3 weights/activations, E5M2 gradients

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
