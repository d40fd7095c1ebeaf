#!/bin/bash
# r27 vs main d8af6d2 on one GPU: compiled training at each level (60 steps), then throughput side by side
# Ran as `bash gpu_check2.sh` from the repo root at e65494c, with main d8af6d2 unpacked in
# baseline_main/ (git archive) and data/shakespeare_char/{train,val}.bin, meta.json carried.
export PYTHONUNBUFFERED=1
run=(python train.py config/shakespeare_char.py device=cuda max_iters=60 eval_interval=30 always_save_checkpoint=False)
j() { local n=$1; shift; ( timeout 200 "$@" > $OUT/$n.log 2>&1; echo "exit status $?" >> $OUT/$n.log ) & }
j O1-compiled "${run[@]}" out_dir=/tmp/o1 compile=True precision=O1
j O1-block-hybrid-compiled "${run[@]}" out_dir=/tmp/o1b compile=True precision=O1 fp8_granularity=block
j O2-block-compiled "${run[@]}" out_dir=/tmp/o2b compile=True precision=O2 fp8_recipe=blockwise
j O3-compiled torchrun --standalone --nproc_per_node=1 "${run[@]:1}" out_dir=/tmp/o3 compile=True precision=O3
j O1-eager-strict "${run[@]}" out_dir=/tmp/o1s compile=False precision=O1 fp8_strict=True
j bf16-compiled "${run[@]}" out_dir=/tmp/bf compile=True precision=bf16
wait
for f in $OUT/*.log; do echo "---- $f"; grep -v "^iter" $f | tail -4; done
b=(bench.py throughput --models gpt2-124M --levels bf16 O1 O2 --compiled_only --rounds 1 --steps 10)
echo "==== r27"; timeout 150 python "${b[@]}" --json $OUT/tp_r27.json 2>&1 | tail -5
echo "==== main d8af6d2"; (cd baseline_main && timeout 150 python "${b[@]}" --json $OUT/tp_main.json 2>&1 | tail -5)
