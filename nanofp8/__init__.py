"""nanofp8: a compact reference implementation of FP8 mixed-precision LLM training.

fp8.py    formats, scaling, the FP8 linear layer (start reading here)
model.py  GPT-2 and LLaMA-style models
"""
