#!/usr/bin/env bash
# The batch-1 GEMV launches tuned on an H200 against the best ones a sweep found on an H100
# (kernels.bench.gemv_graph and kernels.bench.w4_unpack in a graph on one H100, 2026-12-02),
# end to end: `tandem bench latency` of Llama-3.1-8B's shape at batch 1, each run in its own
# process, alternated (bf16: W2's context 1024; awq: issue 20's context 512):
#   bf16 / bf16-h100   the bf16 GEMV at kernels.triton_gemv.pick_config / the H100 sweep's best
#   awq / awq-h100     the int4 GEMV at kernels.triton_quant.w4_gemv_config / the sweep's best
#   bash scripts/device/h100_launches.sh [ROUNDS]        (default 2)  -> $out/latency-*.json
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/lent_env.sh
BF16_H100='
import kernels.triton_gemv as g
_t = {(6144, 4096): (4, 1024, 8), (4096, 4096): (8, 512, 8), (28672, 4096): (2, 4096, 4),
      (4096, 14336): (4, 1024, 4)}
_old = g.pick_config
g.pick_config = lambda n, k: _t.get((n, k)) or _old(n, k)'
W4_H100='
import kernels.triton_quant as t
_w = {(6144, 4096): (16, 1024, 16, 1), (4096, 4096): (16, 2048, 16, 1)}
_o4 = t.w4_gemv_config
t.w4_gemv_config = lambda n, k, rows=1: (_w.get((n, k)) if rows == 1 else None) or _o4(n, k, rows)'
bf16=(--batch-sizes 1 --input-len 1024 --output-len 24)
awq=(--quantization awq --batch-sizes 1 --input-len 512 --output-len 32)
for round in $(seq "${1:-2}"); do
  latency_run "bf16-r$round" "" "${bf16[@]}"
  latency_run "bf16-h100-r$round" "$BF16_H100" "${bf16[@]}"
  latency_run "awq-r$round" "" "${awq[@]}"
  latency_run "awq-h100-r$round" "$W4_H100" "${awq[@]}"
done
