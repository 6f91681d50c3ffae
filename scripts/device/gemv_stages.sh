#!/usr/bin/env bash
# The short-batch GEMVs (bf16, FP8, int4) with their chunk loads software-pipelined, on one lent
# GPU, each step in its own process:
#   tests    the compiled GEMV tests (bf16, FP8, programmatic launch) and the bench's own
#   bench    kernels.bench.gemv_stages over the 8B projections in a graph, against the served
#            launches (GEMV_KINDS, default: int4 fp8 bf16; GEMV_ROWS, default 1)
#                                                                   -> $out/gemv-stages.json
#   latency  the decode steps of each of STAGES_LATENCY (default: bf16 bf16-old fp8 fp8-old;
#            -old: the GEMV launches served before pipelining; -nofuse: gate_up and SiLU-and-mul
#            as two kernels, as before they were fused; -early: the fused launch lets the down
#            GEMV launch at its start, not after its loop; -lateall: every pipelined GEMV lets
#            the next kernel launch after its loop; awq: AWQ weights, as fp8's) at STAGES_BATCHES (default 1 for bf16,
#            1,8 for fp8), context 1024 (bf16, W2's) or 512 (fp8, issue 20's)
#                                                                   -> $out/latency-<q>.json
#   bash scripts/device/gemv_stages.sh [tests] [bench] [latency]   (default: bench)
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/lent_env.sh
# the bf16 GEMV's launches before pipelining (kernels.triton_gemv.pick_config until 2026-11-30)
OLD_BF16='
def old(n, k, _new=g.pick_config):
    if k < 2048:
        return _new(n, k)
    if k >= 8192:
        return (16, 1024, 8)
    if n >= 16384 or n <= k:
        return (4, 1024 if n >= 16384 else 512, 8)
    return (8, 1024, 8)
g.pick_config = old'
# the FP8 GEMV's launches before pipelining (kernels.triton_quant.fp8_gemv_config until then)
OLD_FP8='
def old8(n, k, block_k, _new=t.fp8_gemv_config):
    if block_k < k:
        return _new(n, k, block_k)
    if k >= 8192:
        return (2, 2048, 4)
    if n <= k:
        return (8, 1024, 8)
    return (16, 512, 8) if n <= 2 * k else (8, 512, 4)
t.fp8_gemv_config = old8'
for step in ${*:-bench}; do
  echo "=== $step $(date +%T)"
  case $step in
    tests)
      timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_gemv.py \
        tests/kernels/test_pdl.py tests/kernels/bench/test_gemv_stages.py \
        tests/kernels/test_triton_quant.py tests/kernels/test_ops.py \
        tests/services/engine/quantization/test_fp8.py tests/services/engine/models/test_llama.py \
        tests/services/engine/quantization/test_int4.py \
        -k "gemv or fp8 or pdl or stages or silu or mlp or linear or int4" 2>&1 | tail -3 ;;
    bench)
      timeout 540 python3 -m kernels.bench.gemv_stages --kinds ${GEMV_KINDS:-int4 fp8 bf16} \
        --rows ${GEMV_ROWS:-1} --json-out "$out/gemv-stages.json" 2>&1 | tail -24 ;;
    latency)
      for q in ${STAGES_LATENCY:-bf16 bf16-old fp8 fp8-old}; do
        patch="import kernels.triton_gemv as g, kernels.triton_quant as t"
        [ "$q" = bf16-old ] && patch="$patch$OLD_BF16"
        [ "$q" = fp8-old ] && patch="$patch$OLD_FP8"
        [ "${q#*-}" = nofuse ] && patch="$patch; import kernels.ops as o
o.silu_and_mul_linear = o.fp8_silu_and_mul_linear = o.w4_silu_and_mul_linear = (
  lambda *a, **k: None)"
        [ "${q#*-}" = early ] && patch="$patch; g.RELEASE_AFTER_LOOP = 'none'"
        [ "${q#*-}" = lateall ] && patch="$patch; g.RELEASE_AFTER_LOOP = 'all'"
        args=(--batch-sizes "${STAGES_BATCHES:-1}" --input-len 1024 --output-len 24)
        [ "${q%%-*}" = fp8 ] && args=(--quantization fp8 --batch-sizes "${STAGES_BATCHES:-1,8}"
          --input-len 512 --output-len 32)
        [ "${q%%-*}" = awq ] && args=(--quantization awq --batch-sizes "${STAGES_BATCHES:-1,2}"
          --input-len 512 --output-len 32)
        latency_run "$q" "$patch" "${args[@]}"
      done ;;
  esac
done
