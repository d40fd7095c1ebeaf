# config/llama.py in FP8 (level O1), everything else equal to config/llama_bf16.py.
#   python train.py config/llama_fp8.py
exec(open(__file__.replace("_fp8.py", ".py")).read())
precision = "O1"
out_dir = "out-llama-fp8"
