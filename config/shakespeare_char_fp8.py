# The README's main job: config/shakespeare_char.py in FP8 (level O1), on a CPU in minutes.
#   python train.py config/shakespeare_char_fp8.py && python sample.py --out_dir=out-shakespeare-char-fp8
exec(open(__file__.replace("_fp8.py", ".py")).read())
precision = "O1"
out_dir = "out-shakespeare-char-fp8"
