#!/usr/bin/env bash
# Issue 15 on one GPU: the prefill -> decode hand-off when both workers share the GPU.
#   tests   the GPU-marked transfer and block-copy tests (CUDA IPC between two processes)
#   kv      python -m kvtransfer.bench.transfer on one GPU: the block-move kernel, a whole
#           transfer of 1024 / 4096 / 32768 tokens of the 8B shape, and the tail a layer-by-layer
#           transfer leaves after a simulated 4096-token prefill
#   w4      tandem bench disagg on GPU 0 (8B shape, random weights): W4_WORKLOAD (default
#           1024:128), W4_RATES (4,8,16,32), W4_TOPOLOGIES (colocated,disagg,disagg-local)
# Needs .whl (device_wheels.sh).
#   bash scripts/device/handoff.sh tests,kv   -> $OUT/*.json (or ./gpu-out)
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/lent_env.sh
stages="${1:-tests,kv}"
if has tests; then
  echo "== tests" >&2
  TRITON_INTERPRET=0 timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kvtransfer/test_gpu.py \
    tests/kernels/test_triton_block_copy.py ${EXTRA_TESTS:-} >"$out/tests.txt" 2>&1 || true; tail -15 "$out/tests.txt"; grep -n "Fatal\|File \"/work" "$out/tests.txt" | head -20 || true
fi
if has kv; then
  echo "== kv" >&2
  timeout 420 python3 -m kvtransfer.bench.transfer --tokens ${KV_TOKENS:-1024 4096 32768} --ttft-tokens 4096 \
    --iters 20 --json-out "$out/kv-same-gpu.json" 2>&1 | tail -30 | tee "$out/kv.txt" || true
fi
if has w4; then
  echo "== w4" >&2
  timeout 560 python3 -m services.cli bench disagg --model llama-3.1-8b --max-model-len 4608 \
    --gpus 0 --topologies "${W4_TOPOLOGIES:-colocated,disagg,disagg-local}" \
    --workloads "${W4_WORKLOAD:-1024:128}" --rates "${W4_RATES:-4,8,16,32}" \
    --num-prompts "${W4_PROMPTS:-200}" --time-budget-s 540 ${W4_EXTRA:-} --out-dir "$out/w4" 2>&1 | tee "$out/w4-full.txt" | tail -40 | tee "$out/w4.txt" || true
fi
