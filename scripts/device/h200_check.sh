#!/usr/bin/env bash
# One short lease (about 7 minutes of device time): check on a GPU what the last stops built
# without one, and measure the defaults once, each part in its own process and time limit,
# most important first, so a lease that runs out loses the least:
#   tests    the compiled GPU tests of async scheduling (prompt chunks and admissions launched
#            ahead since 4d3bdf7, never run on a GPU before) and of the engine's waits
#   w1       offline throughput, ours (256 x 1024 -> 128, 8B shape, defaults) -> $out/w1.json
#   w2       decode step time, batch 1, 64, 256 at context 1024             -> $out/w2.json
#   prefill  where a W1 prefill step's time goes (8 x 1024 whole prompts)  -> $out/prefill.json
#   awq      the AWQ batch-1 step with the int4 GEMV's launch chosen on an H100 (00026c1)
#                                                                            -> $out/awq.json
#   bash scripts/device/h200_check.sh [step ...]   (default: all five, in that order)
# Wheels the image lacks: scripts/device/device_wheels.sh, carried as .whl.
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/lent_env.sh
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', \
triton.__version__, 'transformers', transformers.__version__)" | tee "$out/versions.txt"
summary=()
for step in ${*:-tests w1 w2 prefill awq}; do
  echo "=== $step $(date +%T)"
  start=$SECONDS
  case $step in
    tests)
      line=$(timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu \
        tests/services/engine/test_gpu_async.py tests/services/engine/test_gpu_wait.py 2>&1 |
        tee "$out/tests.txt" | tail -1) ;;
    w1)
      line=$(timeout 170 python3 -m services.cli bench offline --model llama-3.1-8b \
        --max-model-len 2048 --num-prompts 256 --input-len 1024 --output-len 128 \
        --json-out "$out/w1.json" 2>&1 | grep -E "^tandem|Error|error" | tail -2) ;;
    w2)
      line=$(timeout 130 python3 -m services.cli bench latency --model llama-3.1-8b \
        --max-model-len 2048 --input-len 1024 --output-len 24 --batch-sizes 1,64,256 \
        --json-out "$out/w2.json" 2>&1 | grep -E "^batch|Error|error" | tr '\n' ';') ;;
    prefill)
      line=$(timeout 90 python3 -m services.engine.bench.profile_step --model llama-3.1-8b \
        --batch 8 --context 1024 --prefill --top 12 --json-out "$out/prefill.json" 2>&1 |
        tee "$out/prefill.txt" | tail -3 | tr '\n' ';') ;;
    awq)
      line=$(timeout 110 python3 -m services.cli bench latency --model llama-3.1-8b \
        --load-format dummy --dtype bfloat16 --quantization awq --batch-sizes 1 \
        --input-len 512 --output-len 32 --max-model-len 2048 --json-out "$out/awq.json" 2>&1 |
        grep -E "^batch|Error|error" | tr '\n' ';') ;;
  esac
  summary+=("$step ($((SECONDS - start)) s): $line")
done
echo "=== summary"
printf '%s\n' "${summary[@]}"
