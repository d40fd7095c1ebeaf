#!/bin/bash
# Issue #29 on a Hopper GPU (H100/H200: sm_90, no MX tensor cores), in one call of at most ~8 minutes:
#   1. the machine; 2. what torch._scaled_mm and nanofp8's routing do with MX operands there;
#   3. kernels.gemm_mx (Triton tl.dot_scaled) against its reference, and its speed;
#   4. FP8 attention against float64, and its time against bf16 flash attention;
#   5. loss parity at equal steps ON THE GPU: bf16, O1, O1-mxfp8 and O1-fp8attn, 5 seeds each, 1000
#      steps of config/shakespeare_char.py (eager: compile=False for every variant alike), paired
#      with the bf16 runs of the same GPU by bench.py parity's own rules.
# Usage, from the repo root (the shakespeare_char data prepared):   OUT=somewhere bash scripts/gpu_check_29.sh
# Writes $OUT/machine.txt, checks.jsonl (one JSON line per check), checks.err, parity.log and
# parity.tgz (the runs' JSON records and parity_cpu.json, parity.csv, parity.png).
set -u
OUT=${OUT:-out-gpu-check-29}
mkdir -p "$OUT"
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'triton', triton.__version__,
torch.cuda.get_device_name(), torch.cuda.get_device_capability(), 'CPUs', __import__('os').cpu_count())"; } > "$OUT/machine.txt" 2>&1
for check in scripts/gpu_check_contract.py scripts/gpu_check_mx.py scripts/fp8_attention_gpu_check.py; do
  timeout 120 python "$check" >> "$OUT/checks.jsonl" 2>> "$OUT/checks.err" || echo "{\"check\": \"$check\", \"exit\": $?}" >> "$OUT/checks.jsonl"
done
# The slowest variant first, so that a run cut short by the time limit is one of the fast ones
timeout "${PARITY_SECONDS:-330}" python bench.py parity --variants O1-fp8attn bf16 O1-mxfp8 O1 --long_iters 0 --jobs 10 \
  --runs "$OUT/runs" --out "$OUT/parity" --set device=cuda compile=False > "$OUT/parity.log" 2>&1
python bench.py parity --no_run --variants O1-fp8attn bf16 O1-mxfp8 O1 --long_iters 0 --runs "$OUT/runs" \
  --out "$OUT/parity" >> "$OUT/parity.log" 2>&1
tar czf "$OUT/parity.tgz" -C "$OUT" runs parity
