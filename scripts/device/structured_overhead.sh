#!/usr/bin/env bash
# Issue 17, acceptance 3: what grammar-constrained decoding adds to a decode step at batch 64 on
# the 8B shape (random weights), measured by services.engine.bench.structured_step. The grammar
# needs a tokenizer and the lent machine has no hub: this carries the embedded model's
# (SmolLM2, 49k tokens; the bitmask still spans the 8B model's 128k vocabulary):
#   mkdir -p .device-tokenizer && cp ~/.cache/tandem/models/SmolLM2-*/tokenizer*.json .device-tokenizer/
#   bash scripts/device/device_wheels.sh      # xgrammar and pydantic for the image's Python 3.12
# then on the device (carry .whl and .device-tokenizer):
#   bash scripts/device/structured_overhead.sh   -> $OUT/structured_step.json (or ./gpu-out)
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/lent_env.sh
python3 -c "import torch, xgrammar; print('torch', torch.__version__)"
python3 -m services.engine.bench.structured_step --model llama-3.1-8b --load-format dummy \
  --tokenizer .device-tokenizer --batch "${BATCH:-64}" --steps "${STEPS:-60}" \
  --repeats "${REPEATS:-2}" | tee "$out/structured_step.json"
