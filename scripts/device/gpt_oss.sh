#!/usr/bin/env bash
# gpt-oss on a GPU: the compiled sink and biased-expert kernel tests, the tiny gpt-oss
# checkpoints (float layout and MXFP4) against transformers in float32 through the compiled
# kernels and CUDA graphs, then gpt-oss-20b's shape with dummy weights (bf16): batch-1..256
# decode steps, and W1's shape (256 x 1024 -> 128) offline.
# Needs .whl (device_wheels.sh) and .gpu-carry/tok.tgz (the test tokenizer).
# bash scripts/device/gpt_oss.sh -> $OUT/*
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/lent_env.sh
tar xzf .gpu-carry/tok.tgz -C .gpu-carry && export TANDEM_TEST_TOKENIZER=$PWD/.gpu-carry/tok
echo "== kernel tests $(date +%T)"
TRITON_INTERPRET=0 timeout 150 python3 -m pytest -q -p no:cacheprovider -k "sink or gpt_oss or clamp" \
  tests/kernels/test_triton_decode.py tests/kernels/test_triton_prefill.py \
  tests/kernels/test_triton_moe.py >"$out/gpt-oss-kernels.txt" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$out/gpt-oss-kernels.txt" | cut -c1-300 | tail -4
echo "== parity $(date +%T)"
timeout 200 python3 -m pytest -q -p no:cacheprovider -k "gpt_oss and not triton" \
  tests/services/engine/test_arch_parity.py tests/services/engine/test_gpt_oss_weights.py \
  >"$out/gpt-oss-parity.txt" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed|Error" "$out/gpt-oss-parity.txt" | cut -c1-300 | tail -6
echo "== latency $(date +%T)"
timeout 240 python3 -m services.cli bench latency --model gpt-oss-20b --load-format dummy \
  --dtype bfloat16 --batch-sizes 1,16,64,256 --input-len 1024 --output-len 32 --max-model-len 4096 \
  --json-out "$out/gpt-oss-latency.json" >"$out/gpt-oss-latency.txt" 2>&1
echo "rc=$?"; grep -v Warning "$out/gpt-oss-latency.txt" | tail -14
echo "== offline 256 x 1024 -> 128 $(date +%T)"
timeout 240 python3 -m services.cli bench offline --model gpt-oss-20b --load-format dummy \
  --dtype bfloat16 --num-prompts 256 --input-len 1024 --output-len 128 --max-model-len 2048 \
  --json-out "$out/gpt-oss-offline.json" >"$out/gpt-oss-offline.txt" 2>&1
echo "rc=$?"; grep -v Warning "$out/gpt-oss-offline.txt" | tail -8
