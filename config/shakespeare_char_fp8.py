# The README's main job: a baby GPT on the complete works of Shakespeare, one character per token,
# trained in FP8 (level O1) in a few minutes on a laptop-class CPU.
#   python train.py config/shakespeare_char_fp8.py && python sample.py --out_dir=out-shakespeare-char-fp8
# Its bf16 twin is config/shakespeare_char_bf16.py (everything equal but the precision).
#
# On a CPU the FP8 GEMMs are emulated: operands are really rounded to E4M3/E5M2 with their
# scales (the same rounding an FP8 GPU run applies), then multiplied in fp32. So this shows FP8
# *training quality* on any machine; here it is slower than bf16, never faster (speed needs FP8
# tensor cores).

out_dir = "out-shakespeare-char-fp8"
dataset = "shakespeare_char"
precision = "O1"
fp8_scaling = "current"
fp8_granularity = "tensor"
fp8_formats = "hybrid"  # E4M3 weights and activations, E5M2 gradients

# the baby model: 4 layers of width 128 (0.8M parameters), 64 characters of context
arch = "gpt2"
n_layer = 4
n_head = 4
n_embd = 128
block_size = 64
bias = False
dropout = 0.0  # 4.5M characters of training text, ~1M seen: nothing to regularize against

batch_size = 16
gradient_accumulation_steps = 1
max_iters = 1000  # ~1M characters seen
lr_decay_iters = 1000
learning_rate = 4e-3  # small models take large steps
min_lr = 4e-4
warmup_iters = 100
beta2 = 0.99  # few tokens per step: a longer second-moment average is steadier
weight_decay = 0.1
grad_clip = 1.0

eval_interval = 250
eval_iters = 20
log_interval = 50
