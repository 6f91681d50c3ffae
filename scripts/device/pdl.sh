#!/usr/bin/env bash
# Programmatic dependent launch (kernels.triton_common.pdl) on one lent Hopper GPU, each run in
# its own process, TANDEM_PDL=0 (plain launches) and 1 alternated:
#   tests    the compiled kernel tests of the decode path and the GPU engine tests, PDL on
#   profile  a batch-1 decode step's kernels and graph replay, the 8B GEMVs back to back in a
#            graph                         -> $out/profile-pdl<0|1>.json, gemv-graph-pdl<0|1>.json
#   w2       decode step time, batch 1, 64, 256 at context 1024   -> $out/w2-pdl<0|1>-<run>.json
#   quant    FP8 and AWQ batch-1 and batch-8 steps                -> $out/<q>-pdl<0|1>.json
#   ablate   the batch-1 graph without each kind of small kernel (PDL on): what fusing it saves
#            at most (services.engine.bench.ablate_step)          -> $out/ablate-<kind>.json
#   w4       the batch-1 int4 GEMV with and without integer-to-float conversions, in a graph
#            (kernels.bench.w4_unpack), and int4 at 64-8192 rows: the Triton GEMM against
#            dequantize-then-matmul (kernels.bench.quant --w4-rows)
#                                                -> $out/w4-unpack.json, $out/w4-rows.json
#   bash scripts/device/pdl.sh [tests] [profile] [w2] [quant] [ablate] [w4]   (default: tests profile w2 quant)
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/lent_env.sh
for step in ${*:-tests profile w2 quant}; do
  echo "=== $step $(date +%T)"
  case $step in
    tests)
      timeout 400 python3 -m pytest -q -p no:cacheprovider -x tests/kernels/test_pdl.py \
        tests/kernels/test_triton_layers.py tests/kernels/test_triton_gemv.py \
        tests/kernels/test_triton_decode.py tests/kernels/test_triton_attention.py \
        tests/kernels/test_triton_quant.py tests/kernels/bench/test_w4_unpack.py 2>&1 | tail -3
      timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu \
        tests/services/engine/test_gpu_async.py tests/services/engine/test_gpu_engine.py 2>&1 |
        tail -3 ;;
    profile)
      for p in 0 1; do
        TANDEM_PDL=$p timeout 200 python3 -m services.engine.bench.profile_step \
          --model llama-3.1-8b --batch 1 --context 1024 --top 12 \
          --json-out "$out/profile-pdl$p.json" 2>&1 | tail -13 | sed "s/^/pdl=$p: /"
        TANDEM_PDL=$p timeout 200 python3 -m kernels.bench.gemv_graph \
          --json-out "$out/gemv-graph-pdl$p.json" 2>&1 | tail -6 | sed "s/^/pdl=$p: /"
      done ;;
    w2)
      for run in $(seq 1 "${W2_RUNS:-2}"); do
        for p in 0 1; do
          TANDEM_PDL=$p timeout 200 python3 -m services.cli bench latency --model llama-3.1-8b \
            --max-model-len 2048 --input-len 1024 --output-len 24 --batch-sizes 1,64,256 \
            --json-out "$out/w2-pdl$p-$run.json" 2>&1 |
            grep -E "^batch|Error|error" | sed "s/^/pdl=$p $run: /"
        done
      done ;;
    quant)
      for q in ${QUANTS:-fp8 awq}; do
        for p in 0 1; do
          TANDEM_PDL=$p timeout 200 python3 -m services.cli bench latency --model llama-3.1-8b \
            --load-format dummy --dtype bfloat16 --quantization $q --batch-sizes 1,8 \
            --input-len 512 --output-len 32 --max-model-len 2048 \
            --json-out "$out/$q-pdl$p.json" 2>&1 |
            grep -E "^batch|Error|error" | sed "s/^/$q pdl=$p: /"
        done
      done ;;
    w4)
      timeout 300 python3 -m kernels.bench.w4_unpack --json-out "$out/w4-unpack.json" 2>&1 |
        tail -6
      timeout 300 python3 -m kernels.bench.quant --rows --w4-rows 64 128 256 2048 8192 \
        --json-out "$out/w4-rows.json" 2>&1 | grep -E "^int4|Error|error" ;;
    ablate)
      for kind in none silu norm rotary merge; do
        timeout 150 python3 -m services.engine.bench.ablate_step --skip $kind --model llama-3.1-8b \
          --batch 1 --context 1024 --json-out "$out/ablate-$kind.json" 2>&1 | tail -1 |
          sed "s/^/without $kind: /"
      done ;;
  esac
done
