#!/usr/bin/env bash
# Issue 23: prefill attention reading the chunk's own K/V contiguously (k_new/v_new).
#   1. the compiled GPU tests of the prefill kernel, the fused rotary + KV write and the
#      engine against transformers (dummy weights)
#   2. tandem bench kernels (both prefill rows, paged and contiguous, beside SDPA)
#   3. where a W1 prefill step's time goes (8 x 1024 whole prompts)
#   4. the 256-row tile sweep with the contiguous path (kernels.bench.tune prefill contig m256)
# Needs .whl (device_wheels.sh). bash scripts/device/prefill_contig.sh -> $OUT/*
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/lent_env.sh
echo "== tests $(date +%T)"
TRITON_INTERPRET=0 timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/kernels/test_triton_prefill.py tests/kernels/test_triton_attention.py \
  tests/services/engine/test_gpu_engine.py -k "not embedded" >"$out/tests.txt" 2>&1
tail -3 "$out/tests.txt"
echo "== kernels $(date +%T)"
timeout 150 python3 -m services.cli bench kernels --json-out "$out/kernels.json" >"$out/kernels.txt" 2>&1
grep -i "prefill\|sdpa" "$out/kernels.txt" | head -12
echo "== prefill step $(date +%T)"
timeout 90 python3 -m services.engine.bench.profile_step --model llama-3.1-8b --batch 8 \
  --context 1024 --prefill --top 12 --json-out "$out/prefill.json" >"$out/prefill.txt" 2>&1
tail -14 "$out/prefill.txt"
echo "== tune $(date +%T)"
timeout "${TUNE_S:-120}" python3 -m kernels.bench.tune prefill contig m256 >"$out/tune.txt" 2>&1
tail -25 "$out/tune.txt"
