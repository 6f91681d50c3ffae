#!/usr/bin/env bash
# The bf16 GEMMs of large decode batches against cuBLAS, on one lent GPU (issue 23's batch-256
# step), each step in its own process:
#   bench    kernels.bench.decode_gemm over the 8B projections at DG_ROWS rows (default 64 128
#            256): cuBLAS, cuBLASLt, Triton split-K and stream-K tiles  -> $out/decode-gemm.json
#   latency  the decode step at DG_BATCHES (default 64,256; context 1024, W2's) for each of
#            DG_LATENCY (default: cublas)                         -> $out/latency-<variant>.json
#   bash scripts/device/decode_gemm.sh [bench] [latency]   (default: bench)
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/lent_env.sh
for step in ${*:-bench}; do
  echo "=== $step $(date +%T)"
  case $step in
    bench)
      timeout 540 python3 -m kernels.bench.decode_gemm --rows ${DG_ROWS:-64 128 256} \
        --json-out "$out/decode-gemm.json" 2>&1 | tail -60 ;;
    latency)
      for v in ${DG_LATENCY:-cublas}; do
        latency_run "$v" "" --batch-sizes "${DG_BATCHES:-64,256}" --input-len 1024 --output-len 24
      done ;;
  esac
done
