#!/usr/bin/env bash
# Issue 22 on one GPU (H100):
#   tests   the LoRA and fused-MoE Triton kernels compiled (TRITON_INTERPRET=0) against their
#           torch references; LoRA decode replayed from CUDA graphs against the same steps run
#           eagerly, token for token (tests/services/engine/lora/test_gpu_graphs.py)
#   kernels python -m kernels.bench.lora and kernels.bench.moe: achieved bandwidth / FLOP/s
#   cost    python -m services.engine.bench.lora_cost: the 8B shape (dummy weights, bf16), batch
#           64, 4 adapters of rank 16 on every projection, against the base model; its JSON
#           says whether the LoRA variant's decode steps replayed graphs (lora_graphs) and how
#           many projections took the fused path (lora_fused: the shrink in the base GEMM)
#   cost-addlora  the same with TANDEM_LORA_FUSED=0 (every projection on add_lora's separate
#           shrink and expand, as before the fused path): not in the default stages
# Needs .whl (device_wheels.sh).
#   bash scripts/device/lora_moe.sh tests,kernels,cost   -> $OUT/*.json (or ./gpu-out)
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/lent_env.sh
stages="${1:-tests,kernels,cost}"
if has tests; then
  TRITON_INTERPRET=0 timeout 420 python3 -m pytest -q -p no:cacheprovider \
    tests/kernels/test_triton_lora.py tests/kernels/test_triton_moe.py \
    tests/services/engine/lora/test_gpu_graphs.py 2>&1 | tail -12 | tee "$out/tests.txt"
fi
if has kernels; then
  timeout 120 python3 -m kernels.bench.lora --json-out "$out/lora-kernel.json" >"$out/lora-kernel.out" \
    2>&1 || echo "lora kernel bench failed: $(tail -3 "$out/lora-kernel.out")"
  timeout 120 python3 -m kernels.bench.moe --json-out "$out/moe-kernel.json" >"$out/moe-kernel.out" \
    2>&1 || echo "moe kernel bench failed: $(tail -3 "$out/moe-kernel.out")"
fi
if has cost; then
  timeout 300 python3 -m services.engine.bench.lora_cost --model llama-3.1-8b --load-format dummy \
    --dtype bfloat16 --adapters 4 --rank 16 --batch 64 --input-len 512 --output-len 128 \
    --json-out "$out/lora-cost.json" >"$out/lora-cost.out" 2>"$out/lora-cost.err" \
    || echo "lora cost failed: $(tail -5 "$out/lora-cost.err")"
fi
if has cost-addlora; then
  TANDEM_LORA_FUSED=0 timeout 300 python3 -m services.engine.bench.lora_cost --model llama-3.1-8b \
    --load-format dummy --dtype bfloat16 --adapters 4 --rank 16 --batch 64 --input-len 512 \
    --output-len 128 --json-out "$out/lora-cost-addlora.json" >"$out/lora-cost-addlora.out" \
    2>"$out/lora-cost-addlora.err" || echo "lora cost (add_lora) failed: $(tail -5 "$out/lora-cost-addlora.err")"
fi
tail -30 "$out/lora-kernel.out" "$out/moe-kernel.out" 2>/dev/null
cat "$out/lora-cost.json" "$out/lora-cost-addlora.json" 2>/dev/null || true
