#!/usr/bin/env bash
# The decode attention's split merge done in the attention kernel (kernels.triton_decode) on one
# lent GPU, each step in its own process:
#   tests    the compiled decode-attention tests (the merge in place in a replayed graph)
#   latency  the 8B decode step at batch 1 and 8, bf16 / FP8 / AWQ weights (MERGE_QUANT), with
#            the merge in place and with its own kernel (MAX_COUNTERS = 0), alternating
#                                                      -> $out/latency-<q>-<mode>-<i>.json
#   bash scripts/device/merge_in_place.sh [tests] [latency]   (default: both)
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/lent_env.sh
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
for step in ${*:-tests latency}; do
  echo "=== $step $(date +%T)"
  case $step in
    tests)
      timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_decode.py \
        -k gpu 2>&1 | tail -3 ;;
    latency)
      for q in ${MERGE_QUANT:-none fp8}; do
        for i in ${MERGE_RUNS:-1}; do
          for mode in kernel in_place; do
            args=(); [ "$q" = none ] || args=(--quantization "$q")
            timeout 240 python3 -c "import sys; import kernels.triton_decode as t
if sys.argv[1] == 'kernel': t.MAX_COUNTERS = 0
from services.cli import main; sys.exit(main(sys.argv[2:]))" "$mode" bench latency \
              --model llama-3.1-8b --load-format dummy --dtype bfloat16 "${args[@]}" \
              --batch-sizes 1,8 --input-len 512 --output-len 32 --max-model-len 2048 \
              --json-out "$out/latency-$q-$mode-$i.json" > "$out/latency-$q-$mode-$i.log" 2>&1
            python3 -c "import json, sys; [print(*sys.argv[2:], r['batch'], round(r['step_ms'], 3),
              round(r['graph_replay_ms'] or 0, 3), round(r['floor_ms'], 3)) for r in
              json.load(open(sys.argv[1]))['rows']]" "$out/latency-$q-$mode-$i.json" "$q" "$mode" ||
              tail -5 "$out/latency-$q-$mode-$i.log"
          done
        done
      done ;;
  esac
done
