#!/usr/bin/env bash
# The batch-1 int4 GEMV in its forms, on one lent GPU (issue 20's AWQ step), each step in its
# own process:
#   tests    the compiled tests of the int4 kernels and of kernels.bench.w4_unpack's forms
#   bench    every form at its launches over the 8B projections, in a graph, for W4_ROWS rows
#            of x (default 1 2; from 2 rows the int4 GEMM and the tensor-core planes too)
#                                                           -> $out/w4-forms-x<rows>.json
#   latency  the decode steps of each of W4_LATENCY (default: awq none; awq-unpacked: AWQ with
#            the small batches' GEMM tile served before the nibble planes; awq-x-planes and
#            awq-x-whole: x loaded plane by plane or whole at every batch; awq-single: batches of
#            1-2 on the GEMV with planes made one a shift, as served before plane pairs;
#            awq-nowide: gate_up at one row on the default launch, as before session 13) at W4_BATCHES
#            (default 1,2,8)                                       -> $out/latency-<q>.json
#   ceiling  the GEMV's loads alone (kernels.bench.w4_ceiling: words, + scales and zeros, + x)
#            beside the served GEMV, after its compiled test           -> $out/w4-ceiling.json
#   bash scripts/device/w4_gemv.sh [tests] [bench] [latency] [ceiling]   (default: tests bench)
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/lent_env.sh
for step in ${*:-tests bench}; do
  echo "=== $step $(date +%T)"
  case $step in
    tests)
      timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kernels/bench/test_w4_unpack.py \
        tests/kernels/test_triton_quant.py 2>&1 | tail -3 ;;
    bench)
      timeout 480 python3 -m kernels.bench.w4_unpack --rows ${W4_ROWS:-1 2} \
        --json-out "$out/w4-forms.json" 2>&1 | grep -v "best launch" | tail -30 ;;
    ceiling)
      timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/bench/test_w4_ceiling.py \
        2>&1 | tail -2
      timeout 300 python3 -m kernels.bench.w4_ceiling --json-out "$out/w4-ceiling.json" 2>&1 |
        tail -8 ;;
    latency)
      for q in ${W4_LATENCY:-awq none}; do
        args=(); [ "$q" = none ] || args=(--quantization "${q%%-*}")
        patch=""; [ "$q" = awq-unpacked ] && patch="t.W4_SMALL_GEMM_CONFIG = (16, 64, 128, 4)"
        [ "$q" = awq-x-planes ] && patch="t.W4_PLANES_X_WHOLE_ROWS = 16"
        [ "$q" = awq-x-whole ] && patch="t.W4_PLANES_X_WHOLE_ROWS = 0"
        [ "$q" = awq-nowide ] && patch="t.W4_GEMV_WIDE_N = 10**9"
        [ "$q" = awq-single ] && patch="import kernels.bench.w4_unpack as b; t.w4a16_linear = b.single_w4a16_linear"
        latency_run "$q" "import kernels.triton_quant as t; $patch" "${args[@]}" \
          --batch-sizes "${W4_BATCHES:-1,2,8}" --input-len 512 --output-len 32
      done ;;
  esac
done
