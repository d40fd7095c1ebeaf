# Fine-tuning from an exported checkpoint, end to end on a CPU: the workflow for fine-tuning any
# model in FP8 (SFT), shown on the baby Shakespeare model.
#
#   python train.py config/shakespeare_char_fp8.py          # 1. pretrain (O1), ~3 minutes
#   python export.py --out_dir=out-shakespeare-char-fp8 --to=export-shakespeare-char
#                                                           # 2. export: E4M3 weights + scales
#   python train.py config/finetune_shakespeare.py          # 3. fine-tune from the export at O2
#   python sample.py --out_dir=out-finetune-shakespeare     # 4. sample
#
# Step 3 reads the export (safetensors + JSON, no pickle; nanofp8/interop.py), not the training
# run: the same command fine-tunes a Hugging Face GPT-2 directory (init_from='path/to/gpt2',
# config.json + model.safetensors) or any model exported by someone else. The architecture comes
# from the export; everything about *training* (precision, learning rate, dropout) from here.
# The optimizer and the FP8 scaling state start fresh, and the log says so.

init_from = "export-shakespeare-char"
out_dir = "out-finetune-shakespeare"
dataset = "shakespeare_char"
precision = "O2"  # fine-tune with FP8 weight gradients and Adam m, fp16 master and v: 6 B/param
block_size = 64  # (taken from the export anyway)

batch_size = 16
gradient_accumulation_steps = 1
max_iters = 200
lr_decay_iters = 200
learning_rate = 1e-3  # a quarter of pretraining's peak: move the weights, do not restart them
min_lr = 1e-4
warmup_iters = 20
beta2 = 0.99

eval_interval = 100
eval_iters = 20
log_interval = 25
