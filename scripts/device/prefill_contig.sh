#!/usr/bin/env bash
# Issue 23: prefill attention of whole prompts reading their K/V contiguously (k_new/v_new,
# no_prefix, TMA on Hopper).
#   1. the compiled GPU tests of the prefill kernel, the fused rotary + KV write and the
#      engine against transformers (dummy weights), and async scheduling's
#   2. tandem bench kernels (the prefill rows, paged and whole-prompt, beside SDPA)
#   3. where a W1 prefill step's time goes (8 x 1024 whole prompts); (W1=1) W1 itself
#   4. (TUNE_S > 0) the 256-row tile sweep with the contiguous path
# Needs .whl (device_wheels.sh). bash scripts/device/prefill_contig.sh -> $OUT/*
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/lent_env.sh
echo "== tests $(date +%T)"
TRITON_INTERPRET=0 timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/kernels/test_triton_prefill.py tests/kernels/test_triton_attention.py \
  tests/services/engine/test_gpu_engine.py tests/services/engine/test_gpu_async.py \
  -k "not embedded" >"$out/tests.txt" 2>&1
tail -3 "$out/tests.txt"
echo "== kernels $(date +%T)"
timeout 150 python3 -m services.cli bench kernels --json-out "$out/kernels.json" >"$out/kernels.txt" 2>&1
grep -i "prefill\|sdpa" "$out/kernels.txt" | head -12
echo "== prefill step $(date +%T)"
timeout 90 python3 -m services.engine.bench.profile_step --model llama-3.1-8b --batch 8 \
  --context 1024 --prefill --top 12 --json-out "$out/prefill.json" >"$out/prefill.txt" 2>&1
tail -14 "$out/prefill.txt"
if [ "${W1:-0}" = 1 ]; then
  echo "== w1 $(date +%T)"
  timeout 170 python3 -m services.cli bench offline --model llama-3.1-8b --max-model-len 2048 \
    --num-prompts 256 --input-len 1024 --output-len 128 --json-out "$out/w1.json" 2>&1 |
    grep -E "^tandem|Error|error" | tail -2
fi
if [ "${TUNE_S:-0}" -gt 0 ]; then
  echo "== tune $(date +%T)"
  timeout "$TUNE_S" python3 -m kernels.bench.tune prefill contig m256 >"$out/tune.txt" 2>&1
  tail -25 "$out/tune.txt"
fi
