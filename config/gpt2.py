# GPT-2 small (124M) on OpenWebText, 8 GPUs, one node: train.py's defaults are this run, so the
# file holds only what differs. The precision level is a command-line choice:
#   python data/openwebtext/prepare.py      (once: downloads and tokenizes ~9B tokens)
#   torchrun --standalone --nproc_per_node=8 train.py config/gpt2.py                 # bf16
#   torchrun --standalone --nproc_per_node=8 train.py config/gpt2.py precision=O2    # FP8
# (config/gpt2_bf16.py and config/gpt2_fp8.py are this file with the level and out_dir set.)
# The defaults: 12 layers x 768, block 1024, ~0.5M tokens per step (12 sequences x 1024 tokens x
# 40 micro-batches, 5 per GPU on 8 GPUs), AdamW 6e-4 -> 6e-5 over 600k steps (~300B tokens, the
# GPT-2/-3 papers' budget for this size). At width 768 the GEMMs are too small for FP8 tensor
# cores to beat the cost of the casts: this run is about numerics (for speed: config/llama.py).

out_dir = "out-gpt2"
eval_interval = 1000
