#!/usr/bin/env bash
# Issue 24, acceptance 3: TTFT of a repeated 16k-token prompt after another prompt pushed its KV
# out of the pool, without and with the prefix cache's host tier (8B shape, random weights), by
# services.engine.bench.host_tier_ttft, each in its own process. Needs .whl (device_wheels.sh).
#   bash scripts/device/host_tier_ttft.sh   -> $OUT/host_tier_ttft.json (or ./gpu-out)
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/lent_env.sh
: > "$out/host_tier_ttft.json"
for gib in 0 8; do
  python3 -m services.engine.bench.host_tier_ttft --model llama-3.1-8b --load-format dummy \
    --prompt-len "${PROMPT_LEN:-16384}" --kv-offloading-size "$gib" | tail -1 \
    | tee -a "$out/host_tier_ttft.json"
done
