# config/gpt2.py in FP8 (level O1: current scaling, one scale per tensor, E4M3 forward and E5M2
# gradients, the defaults), everything else equal to config/gpt2_bf16.py.
#   torchrun --standalone --nproc_per_node=8 train.py config/gpt2_fp8.py
exec(open(__file__.replace("_fp8.py", ".py")).read())
precision = "O1"
out_dir = "out-gpt2-fp8"
