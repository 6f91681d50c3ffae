#!/usr/bin/env bash
# The batch-1 FP8 GEMV (issue 20's FP8 step) on one lent GPU, each step in its own process:
#   tests    the compiled tests of the FP8 kernels
#   bench    every launch over the 8B projections in a graph, for FP8_ROWS rows of x (default
#            1; from 2 the GEMM's launches too)                 -> $out/fp8-gemv-graph.json
#   latency  the FP8 decode step at batch 1 and 2, FP8_RUNS times -> $out/latency-fp8-<i>.json
#   bash scripts/device/fp8_gemv.sh [tests] [bench] [latency]   (default: all three)
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/lent_env.sh
for step in ${*:-tests bench latency}; do
  echo "=== $step $(date +%T)"
  case $step in
    tests)
      timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_quant.py \
        -k fp8 2>&1 | tail -3 ;;
    bench)
      timeout 480 python3 -m kernels.bench.gemv_graph --fp8 --rows ${FP8_ROWS:-1} \
        --json-out "$out/fp8-gemv-graph.json" 2>&1 | grep -v "differs" | tail -40 ;;
    latency)
      for i in $(seq ${FP8_RUNS:-1}); do
        timeout 240 python3 -m services.cli bench latency --model llama-3.1-8b \
          --load-format dummy --dtype bfloat16 --quantization fp8 --batch-sizes 1,2 \
          --input-len 512 --output-len 32 --max-model-len 2048 \
          --json-out "$out/latency-fp8-$i.json" > "$out/latency-fp8-$i.log" 2>&1
        python3 -c "import json, sys; [print('fp8', r['batch'], round(r['step_ms'], 3),
          round(r['graph_replay_ms'] or 0, 3), round(r['floor_ms'], 3)) for r in
          json.load(open(sys.argv[1]))['rows']]" "$out/latency-fp8-$i.json" ||
          tail -5 "$out/latency-fp8-$i.log"
      done ;;
  esac
done
