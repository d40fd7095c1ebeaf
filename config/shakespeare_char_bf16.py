# The bf16 baseline of config/shakespeare_char_fp8.py (the README's main job): everything is the
# same but the precision, so the two validation losses can be compared directly.
#   python train.py config/shakespeare_char_bf16.py && python sample.py --out_dir=out-shakespeare-char-bf16

out_dir = "out-shakespeare-char-bf16"
dataset = "shakespeare_char"
precision = "bf16"

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
