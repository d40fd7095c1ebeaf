#!/bin/bash
# The first run on a CUDA GPU, in one go: what the CPU tests stand for, confirmed on the device.
#
#   bash first_gpu_run.sh [OUT_DIR]        (default gpu-first-run/; about 15 minutes on an H100 or H200)
#
# SKIP_KERNELS=1 leaves out kernels.py. QUICK=1 is the regression check after a change (about 6
# minutes): 60 training steps per run, and throughput for GPT-2 124M compiled only. It writes
# OUT_DIR/first_run.log (everything, in order) and three JSON files (kernels_gpu.json,
# throughput_compiled.json, throughput_eager.json). Each step has a time limit and the script
# goes on when one fails, so one broken step never hides the others. Phase A runs the
# correctness checks side by side (they share the GPU: their timings mean nothing), phase B the
# timed benchmarks one at a time.
#   A. train.py compiled at bf16, O1, O1 row-wise, O2 with block scales, O3, and eager O1 with
#      fp8_strict=True (FP8 GEMMs that fell back to high precision: must be 0);
#      graph breaks of a compiled FP8 MLP, per backend and granularity, vs eager;
#      the compile of the benchmark models, so that phase B finds inductor's cache warm.
#   B. kernels.py (Triton kernels vs the reference, torch's block GEMM through the v2 API with
#      padded scales at K = 768, GEMM TFLOPS); bench.py throughput compiled, then eager
#      (GPT-2 124M, where predict.py expects FP8 to lose, and a 4-layer d=4096 GPT, where it
#      expects FP8 to win). Compare with: python bench.py predict --gpu H100 --n_layer 12
#      --n_embd 768 --batch 8 --seq 1024 --accum 1 (and --n_layer 4 --n_embd 4096).
set -u
out=${1:-gpu-first-run}
mkdir -p "$out"
out=$(cd "$out" && pwd)
log="$out/first_run.log"
tmp=$(mktemp -d)
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")"

say() { echo "== $(date +%T) $*" | tee -a "$log"; }

# A background job of phase A: NAME LIMIT_S COMMAND...; its log is appended when phase A ends
job() {
    local name=$1 limit=$2
    shift 2
    ( timeout "$limit" "$@" > "$tmp/$name.log" 2>&1; echo "exit status $?" >> "$tmp/$name.log" ) &
}

say "machine"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python -c \
  "import torch, triton; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"; } 2>&1 | tee -a "$log"

say "phase A: correctness, side by side"
iters=200; [ -n "${QUICK:-}" ] && iters=60
run=(python train.py config/shakespeare_char.py device=cuda max_iters=$iters eval_interval=$((iters / 2)) always_save_checkpoint=False)
job bf16-compiled 300 "${run[@]}" out_dir="$tmp/o-bf16" compile=True precision=bf16
job O1-compiled 300 "${run[@]}" out_dir="$tmp/o-O1" compile=True precision=O1
job O1-row-compiled 300 "${run[@]}" out_dir="$tmp/o-O1row" compile=True precision=O1 fp8_granularity=row
job O2-block-compiled 300 "${run[@]}" out_dir="$tmp/o-O2b" compile=True precision=O2 fp8_granularity=block fp8_formats=e4m3
job O3-compiled 300 torchrun --standalone --nproc_per_node=1 "${run[@]:1}" out_dir="$tmp/o-O3" compile=True precision=O3
job O1-eager-strict 300 "${run[@]}" out_dir="$tmp/o-O1s" compile=False precision=O1 fp8_strict=True
cat > "$tmp/graph_breaks.py" <<'EOF'
# A compiled FP8 MLP under autocast, per backend and granularity: graphs, breaks, and how far the
# compiled forward and gradients are from eager's (SQNR, dB).
import copy, torch, torch.nn as nn
from torch._dynamo.testing import CompileCounterWithBackend
from nanofp8.fp8 import Recipe, convert_to_fp8, sqnr
for backend in ("torch", "triton"):
    for gran in ("tensor", "row", "block"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        eager = nn.Sequential(nn.Linear(768, 3072), nn.GELU(), nn.Linear(3072, 768)).cuda()
        convert_to_fp8(eager, Recipe(granularity=gran, backend=backend))
        model = copy.deepcopy(eager)
        counter = CompileCounterWithBackend("inductor")
        compiled = torch.compile(model, backend=counter)
        try:
            for step in range(3):
                x = torch.randn(8, 256, 768, device="cuda")
                xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    ye, yc = eager(xe), compiled(xc)
                ye.float().square().sum().backward()
                yc.float().square().sum().backward()
            grads = min(sqnr(pe.grad, pc.grad) for pe, pc in zip(eager.parameters(), model.parameters()))
            print(f"{backend:6s} {gran:6s}: frames {counter.frame_count} (1 = no graph break), "
                  f"SQNR compiled vs eager: output {sqnr(ye.float(), yc.float()):.1f} dB, "
                  f"input grad {sqnr(xe.grad, xc.grad):.1f} dB, weight grads >= {grads:.1f} dB")
            if counter.frame_count > 1:
                torch._dynamo.reset()
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    why = torch._dynamo.explain(model)(x.clone().requires_grad_()).break_reasons
                print("   breaks:", "; ".join(str(b.reason)[:300] for b in why))
        except Exception as e:
            import traceback  # the whole trace: a first line can be empty (an AssertionError)
            print(f"{backend:6s} {gran:6s}: FAILED {type(e).__name__}\n" + traceback.format_exc()[-3000:])
EOF
job graph-breaks 300 env PYTHONPATH="$PWD" python "$tmp/graph_breaks.py"
bench=(python bench.py throughput --models gpt2-124M wide-4096 --compiled_only --rounds 1 --steps 1)
[ -n "${QUICK:-}" ] && bench=(python bench.py throughput --models gpt2-124M --compiled_only --rounds 1 --steps 1)
for level in bf16 O1 O2; do job "warm-$level" 300 "${bench[@]}" --levels $level; done
wait
for f in "$tmp"/*.log; do
    echo "---- $(basename "$f" .log)" >> "$log"
    case $f in  # the compile warm-up's figures were measured side by side: keep the verdict only
        */warm-*) tail -n 3 "$f" >> "$log" ;;
        *) grep -v "^iter [0-9]*: loss" "$f" | tail -n 60 >> "$log"; grep "^iter [0-9]*: loss" "$f" | \
           awk 'NR % 50 == 1' >> "$log" ;;
    esac
done

say "phase B: timed, one at a time"
[ -n "${SKIP_KERNELS:-}" ] || timeout 150 python kernels.py --json "$out/kernels_gpu.json" 2>&1 | tee -a "$log"
say "throughput, compiled"
models=(gpt2-124M wide-4096); [ -n "${QUICK:-}" ] && models=(gpt2-124M)
timeout 400 python bench.py throughput --models "${models[@]}" --levels bf16 O1 O2 --compiled_only \
    --rounds 1 --steps 10 --json "$out/throughput_compiled.json" 2>&1 | tee -a "$log"
say "throughput, eager"
[ -n "${QUICK:-}" ] || timeout 300 python bench.py throughput --models gpt2-124M wide-4096 --levels bf16 O1 O2 --no_compile \
    --rounds 2 --steps 10 --json "$out/throughput_eager.json" 2>&1 | tee -a "$log"
say "done"
rm -rf "$tmp"
