#!/bin/bash
# Does FP8 pay on this GPU? Issue #36's measurements, side by side in one call (at most 8 minutes
# on an H100 or H200, compiles included; each part has a time limit):
#
#   bash scripts/gpu_speed.sh [OUT_DIR]          (default results/gpu/)
#
# 1. GPT-2 124M compiled, 8 x 1024 tokens a step: tokens/s and peak GiB of bf16, O1, O1 with
#    delayed scaling and O2, one after the other (20 timed steps each, after 2 of warm-up and
#    compile), and the 15 kernels of one O1 step that took the most device time (torch.profiler).
# 2. a 24-layer width-2048 GPT (1.2B parameters), compiled: bf16, O1 and O2, where the state's
#    bytes decide the peak memory.
# Each writes throughput_*.json (device, versions, date, commit, command: bench.py's environment);
# `python bench.py report` renders every throughput_*.json of results/gpu/ into the README. The
# CPU-side count of the same code (kernels and bytes per compiled block) is `python bench.py kernels`.
set -u
out=${1:-results/gpu}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
timeout 290 python bench.py throughput --models gpt2-124M --levels bf16 O1 O1-delayed O2 --compiled_only \
    --rounds 1 --steps 20 --profile O1 --json "$out/throughput_speed_124M.json"
timeout 190 python bench.py throughput --models d2048-24L --levels bf16 O1 O2 --compiled_only \
    --rounds 1 --steps 4 --json "$out/throughput_speed_d2048.json"
