#!/usr/bin/env bash
# Issue 20: where an FP8 step's time goes, the FP8 GEMM's modes at W1's shapes, W1 and quality.
#   tests    the compiled GPU tests of the prefill kernel (its TMA case at D = 128)
#   fused    the compiled tests of the layer kernels (the norm and SiLU that quantize for W8A8),
#            decode attention's, the quantized models' and the warm-up's (serving after it builds
#            no kernel); the fused kernels' timing against the
#            two kernels each replaces (kernels.bench.quant --fused-rows)
#   gemm     kernels.bench.quant --w8a8-rows: row-wise _scaled_mm against fast accumulation and
#            per-tensor scales, the activation quantization, bf16 cuBLAS
#   profile  profile_step: an FP8 and a bf16 prefill step (8 x 1024) (TRACE=1: with Chrome traces
#            of two steps back to back, where the gaps are), W1's FP8 decode step (224 x 1100)
#   w1       W1 in bf16, FP8 weights, FP8 weights + FP8 KV, one process each (W1_ROUNDS times;
#            W1_VARIANTS: other flag sets, separated by ';')
#   exact    the compiled GPU tests of the fused FP8 forms at 8192 rows (4 seeds) and of the
#            warm-up (16-bit and FP8 caches, FP8 weights); the fused kernels at 8192 rows
#   quality  (the GGUF assembled: scripts/device/device_gguf.sh) kv_fp8 --compare weights
# Needs .whl (device_wheels.sh). bash scripts/device/fp8_gemm.sh gemm,profile -> $OUT/*
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/lent_env.sh
stages="${1:-tests,gemm,profile}"
if has tests; then
  echo "== tests $(date +%T)"
  TRITON_INTERPRET=0 timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/kernels/test_triton_prefill.py >"$out/tests.txt" 2>&1
  tail -3 "$out/tests.txt"
fi
if has fused; then
  echo "== fused $(date +%T)"
  TRITON_INTERPRET=0 timeout 300 python3 -m pytest -q -p no:cacheprovider \
    tests/kernels/test_triton_layers.py tests/kernels/test_triton_decode.py \
    tests/services/engine/test_gpu_warmup.py tests/services/engine/quantization \
    >"$out/tests-fused.txt" 2>&1
  grep -E "passed|failed|Error" "$out/tests-fused.txt" | tail -4
  timeout 120 python3 -m kernels.bench.quant --rows --fused-rows 224 2048 8192 \
    --json-out "$out/fused.json" >"$out/fused.txt" 2>&1
  tail -3 "$out/fused.txt"
fi
if has gemm; then
  echo "== gemm $(date +%T)"
  timeout 200 python3 -m kernels.bench.quant --rows --w8a8-rows ${ROWS:-224 2048 8192} \
    --json-out "$out/w8a8.json" >"$out/w8a8.txt" 2>&1
  cut -c1-250 "$out/w8a8.txt" | tail -14
fi
if has profile; then
  for q in fp8 bf16; do
    echo "== $q prefill step $(date +%T)"
    flags=""; [ "$q" = fp8 ] && flags="--quantization fp8"
    [ "${TRACE:-0}" = 1 ] && flags="$flags --trace-out $out/prefill-$q.trace.json"
    timeout 120 python3 -m services.engine.bench.profile_step --model llama-3.1-8b --batch 8 \
      --context 1024 --prefill $flags --top 8 --json-out "$out/prefill-$q.json" \
      >"$out/prefill-$q.txt" 2>&1
    tail -9 "$out/prefill-$q.txt"
    [ -f "$out/prefill-$q.trace.json" ] && gzip -f "$out/prefill-$q.trace.json"
  done
  echo "== fp8 decode step $(date +%T)"
  timeout 120 python3 -m services.engine.bench.profile_step --model llama-3.1-8b --batch 224 \
    --context 1100 --max-model-len 1200 --quantization fp8 --kv-cache-dtype fp8 --top 8 \
    --json-out "$out/decode.json" >"$out/decode.txt" 2>&1
  tail -9 "$out/decode.txt"
fi
if has w1; then  # one JSON file of every run (the lent machine returns a few files only)
  mkdir -p /tmp/w1
  for round in $(seq "${W1_ROUNDS:-1}"); do
    IFS=';' read -ra variants <<<"${W1_VARIANTS:- ;--quantization fp8;--quantization fp8 --kv-cache-dtype fp8}"
    for q in "${variants[@]}"; do
      tag=$(echo "bf16 $q" | tr -s ' -' '_')
      echo "== w1 round $round $tag $(date +%T)"
      timeout 150 python3 -m services.cli bench offline --model llama-3.1-8b \
        --max-model-len 2048 --num-prompts 256 --input-len 1024 --output-len 128 $q \
        --json-out "/tmp/w1/$round$tag.json" 2>&1 | grep -E "^tandem|Error|error" | tail -2
    done
  done
  python3 -c 'import json, pathlib, sys; print(json.dumps({p.stem: json.loads(p.read_text()) for p in sorted(pathlib.Path("/tmp/w1").glob("*.json"))}))' >"$out/w1.json"
fi
if has quality; then
  echo "== quality $(date +%T)"
  gguf=$(bash scripts/device/device_gguf.sh assemble)
  if [ -z "$gguf" ]; then echo "the GGUF's two parts are not both here"; exit 1; fi
  TANDEM_EMBEDDED_GGUF=$gguf timeout 300 python3 -m services.engine.bench.kv_fp8 \
    --compare weights --json-out "$out/fp8-weights-quality.json" >"$out/quality.txt" 2>&1
  tail -8 "$out/quality.txt"
fi
if has exact; then  # the fused FP8 forms against the two kernels in turn, compiled; warm-up cases
  echo "== exact $(date +%T)"
  TRITON_INTERPRET=0 timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/kernels/test_triton_layers.py tests/services/engine/test_gpu_warmup.py \
    >"$out/tests-exact.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$out/tests-exact.txt" | cut -c1-300 | tail -8
  timeout 60 python3 -m kernels.bench.quant --rows --fused-rows 8192 >"$out/fused-exact.txt" 2>&1
  tail -1 "$out/fused-exact.txt"
fi
