# config/llama.py at bf16, the baseline of config/llama_fp8.py: compare tok/s and loss.
#   python train.py config/llama_bf16.py
exec(open(__file__.replace("_bf16.py", ".py")).read())
out_dir = "out-llama-bf16"
