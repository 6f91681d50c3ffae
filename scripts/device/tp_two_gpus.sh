#!/usr/bin/env bash
# Issues 19/25 on a lent machine with 2 GPUs (nvidia-h200-x2):
#   1. scripts/device/tp_workers.py: the offline engine TP 2 == TP 1 over NCCL, then `tandem up
#      --gpus 0,1` with prefill TP 2 -> decode TP 1, prefill TP 1 -> decode TP 2 and a colocated
#      TP 2 worker (greedy text equal to the offline engine's), and a follower killed under load
#   2. if time is left: the 8B shape (dummy weights) decode step at TP 1 and TP 2
# MODEL_DIR: a float32 checkpoint with a tokenizer; build one here (the lent image has no model):
#   python -c "from tests.services.engine.conftest import tiny_checkpoint; ..." into .gpu-carry/
#   bash scripts/device/tp_two_gpus.sh .gpu-carry/tiny-llama    (carry .whl and .gpu-carry)
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/lent_env.sh
model="${1:-.gpu-carry/tiny-llama}"
nvidia-smi -L
timeout 200 python3 scripts/device/tp_workers.py "$model" 2>"$out/tp_workers.err" \
  | tee "$out/tp_workers.jsonl"
tail -5 "$out/tp_workers.err"
for tp in 1 2; do
  timeout 90 python3 -m services.cli bench latency --model llama-3.1-8b --load-format dummy \
    --dtype bfloat16 --tensor-parallel-size "$tp" --batch-sizes 1,64 --input-len 512 \
    --output-len 32 --max-model-len 1024 >"$out/latency-tp$tp.out" 2>"$out/latency-tp$tp.err" \
    && sed -n '/^{/,$p' "$out/latency-tp$tp.out" >"$out/latency-tp$tp.json" \
    || echo "latency tp$tp failed: $(tail -3 "$out/latency-tp$tp.err")"
done
head -c 1500 "$out"/latency-tp*.json 2>/dev/null || true
