# The README's main job: a baby GPT on the complete works of Shakespeare, one character per token,
# a few minutes on a laptop-class CPU. The precision level is a command-line choice:
#   python train.py config/shakespeare_char.py precision=O1 && python sample.py --out_dir=out-shakespeare-char
# config/shakespeare_char_fp8.py (O1) and config/shakespeare_char_bf16.py are this file with the
# level and out_dir set, so that their validation losses can be compared directly.
#
# On a CPU the FP8 GEMMs are emulated: operands are really rounded to E4M3/E5M2 with their
# scales (the same rounding an FP8 GPU run applies), then multiplied in fp32. So this shows FP8
# *training quality* on any machine; here it is slower than bf16, never faster (speed needs FP8
# tensor cores).

out_dir = "out-shakespeare-char"
dataset = "shakespeare_char"

# the baby model: 4 layers of width 128 (0.8M parameters), 64 characters of context
n_layer = 4
n_head = 4
n_embd = 128
block_size = 64
bias = False  # dropout stays 0: 4.5M characters of training text, ~1M seen: nothing to regularize

batch_size = 16
gradient_accumulation_steps = 1
max_iters = 1000  # ~1M characters seen
lr_decay_iters = 1000
learning_rate = 4e-3  # small models take large steps
min_lr = 4e-4
warmup_iters = 100
beta2 = 0.99  # few tokens per step: a longer second-moment average is steadier

eval_interval = 250
eval_iters = 20
log_interval = 50
