#!/usr/bin/env bash
# Gemma 3 on a GPU: the 1B shape (26 layers, 5 of 6 through a 512-token window, head dim 256)
# with dummy weights through the compiled kernels and CUDA graphs, prompts four times the
# window; and the compiled tests of the Gemma norm and GELU-and-mul kernels.
# Needs .whl (device_wheels.sh). bash scripts/device/gemma.sh -> $OUT/*
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/lent_env.sh
echo "== tests $(date +%T)"
TRITON_INTERPRET=0 timeout 120 python3 -m pytest -q -p no:cacheprovider -k "gemma or gelu" \
  tests/kernels/test_triton_layers.py >"$out/gemma-tests.txt" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$out/gemma-tests.txt" | cut -c1-300 | tail -4
echo "== latency $(date +%T)"
timeout 240 python3 -m services.cli bench latency --model gemma-3-1b --load-format dummy \
  --dtype bfloat16 --batch-sizes 1,8,64 --input-len 2048 --output-len 32 --max-model-len 4096 \
  --json-out "$out/gemma-latency.json" >"$out/gemma-latency.txt" 2>&1
echo "rc=$?"; grep -v Warning "$out/gemma-latency.txt" | tail -12
