#!/usr/bin/env bash
# The few-token fused MoE (kernels.triton_moe_pairs: a GEMV a (token, expert) pair) on one GPU:
#   tests    its interpreter tests and the grouped kernel's, compiled (TRITON_INTERPRET=0)
#   tune     python -m kernels.bench.moe --tune-pairs: tiles swept against the grouped kernels
#   latency  the decode step of Qwen3-30B-A3B and DeepSeek-V2-Lite (dummy bf16 weights) at batch
#            1-16, with the pair kernels (as served) and without (MAX_PAIRS 0, patched in)
# Needs .whl (device_wheels.sh).
#   bash scripts/device/moe_pairs.sh tests,tune,latency   -> $OUT/*.json (or ./gpu-out)
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/lent_env.sh
stages="${1:-tests,tune,latency}"
if has tests; then
  TRITON_INTERPRET=0 timeout 400 python3 -m pytest -q -p no:cacheprovider \
    tests/kernels/test_triton_moe_pairs.py tests/kernels/test_triton_moe.py 2>&1 | tail -6 |
    tee "$out/tests.txt"
fi
if has tune; then
  timeout 300 python3 -m kernels.bench.moe --tune-pairs --tokens 1 2 4 8 16 \
    --json-out "$out/moe-pairs-tune.json" 2>&1 | grep -v Warn | tail -12
fi
if has latency; then
  for model in qwen3-30b-a3b deepseek-v2-lite; do
    for variant in pairs grouped; do
      patch=""
      [[ $variant == grouped ]] && patch="import kernels.triton_moe_pairs as p; p.MAX_PAIRS = 0"
      timeout 300 python3 -c "import sys; $patch
from services.cli import main; sys.exit(main(sys.argv[1:]))" bench latency --model "$model" \
        --load-format dummy --dtype bfloat16 --batch-sizes 1,2,4,8,16 --input-len 1024 \
        --output-len 24 --max-model-len 2048 --json-out "$out/latency-$model-$variant.json" \
        > "$out/latency-$model-$variant.log" 2>&1 || tail -5 "$out/latency-$model-$variant.log"
      python3 -c "import json, sys; [print(sys.argv[2], r['batch'], round(r['step_ms'], 3),
        round(r['graph_replay_ms'] or 0, 3), round(r['floor_ms'], 3)) for r in
        json.load(open(sys.argv[1]))['rows']]" "$out/latency-$model-$variant.json" \
        "$model-$variant" 2>/dev/null
    done
  done
fi
