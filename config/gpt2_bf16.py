# config/gpt2.py at bf16, the baseline of config/gpt2_fp8.py: compare their val loss curves.
#   torchrun --standalone --nproc_per_node=8 train.py config/gpt2_bf16.py
exec(open(__file__.replace("_bf16.py", ".py")).read())
out_dir = "out-gpt2-bf16"
