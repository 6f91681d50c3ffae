#!/usr/bin/env bash
# Issue 23's async scheduling on one lent GPU, each part in its own processes:
#   tests  the GPU tests of launched decode steps, the reader and the engine (compiled kernels)
#   w2     decode step time (batch 1, 64, 256 at context 1024), --async-scheduling and
#          --no-async-scheduling alternated, twice                      -> $out/w2-<mode>-<run>.json
#   w1     offline throughput (256 x 1024 -> 128, ours only), both modes -> $out/w1-<mode>.json
#   bash scripts/device/async_sched.sh [tests] [w2] [w1]   (default: all three)
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/lent_env.sh
modes="async-scheduling no-async-scheduling"
for step in ${*:-tests w2 w1}; do
  echo "=== $step $(date +%T)"
  case $step in
    tests)
      timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu \
        tests/services/engine/test_gpu_async.py tests/services/engine/test_gpu_wait.py \
        tests/services/engine/test_gpu_engine.py 2>&1 | tail -4 ;;
    w2)
      for run in $(seq 1 "${W2_RUNS:-2}"); do
        for mode in $modes; do
          timeout 200 python3 -m services.cli bench latency --model llama-3.1-8b \
            --max-model-len 2048 --input-len 1024 --output-len 24 --batch-sizes 1,64,256 \
            --"$mode" --json-out "$out/w2-$mode-$run.json" 2>&1 |
            grep -E "^batch|Error|error" | sed "s/^/$mode $run: /"
        done
      done ;;
    w1)
      for mode in $modes; do
        timeout 240 python3 -m services.cli bench offline --model llama-3.1-8b \
          --max-model-len 2048 --num-prompts 256 --input-len 1024 --output-len 128 \
          --"$mode" --json-out "$out/w1-$mode.json" 2>&1 |
          grep -E "tok/s|Error|error" | sed "s/^/$mode: /"
      done ;;
  esac
done
