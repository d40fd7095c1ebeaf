# config/shakespeare_char.py at bf16, the baseline of config/shakespeare_char_fp8.py.
#   python train.py config/shakespeare_char_bf16.py && python sample.py --out_dir=out-shakespeare-char-bf16
exec(open(__file__.replace("_bf16.py", ".py")).read())
out_dir = "out-shakespeare-char-bf16"
