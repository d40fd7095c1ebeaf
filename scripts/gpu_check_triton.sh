#!/bin/bash
# The training step's Triton kernels (nanofp8/optim_triton.py: O2's fused step, O3's, the gradient
# casts and norms, O1's weight casts; nanofp8/history_triton.py: delayed scaling's pushes and casts)
# on this GPU against their references, before any speed is measured with them (about a minute,
# compiles included):
#
#   bash scripts/gpu_check_triton.sh [OUT_DIR]          (default results/gpu/)
#
# These are tests/test_optim_triton.py and tests/test_history_triton.py, which run the kernels in
# Triton's interpreter on a CPU, here compiled for the device with the same bounds (the
# multi-rank O3 test stays on the CPU: it runs gloo ranks). Report: OUT_DIR/triton_kernels_gpu.xml.
set -u
out=${1:-results/gpu}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
NANOFP8_TEST_DEVICE=cuda TRITON_INTERPRET=0 timeout 150 python -m pytest -q -p no:cacheprovider -m "not dist" \
    tests/test_optim_triton.py tests/test_history_triton.py --junitxml "$out/triton_kernels_gpu.xml"
