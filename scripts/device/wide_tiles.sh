#!/usr/bin/env bash
# End to end, the whole-prompt tiles of heads wider than 128 that kernels.bench.wide_heads
# chose on an H200: each variant its own `tandem bench offline` process (dummy bf16 weights),
# run twice in alternating order.
#   gemma    gemma-3-1b (head dim 256) 128 x 2048 -> 8: the paged prefill kernel's whole-prompt
#            tiles for 256 (triton_prefill.WIDE_WHOLE_PROMPT_TILES) as committed, against
#            the variant in $GEMMA_TILES (default the other of (64, 64, 4, 2) / (128, 64, 8, 2))
#   deepseek deepseek-v2-lite 256 x 1024 -> 128: the varlen kernel's tiles for 192/128
#            (triton_varlen.WIDE_VARLEN_TILES) as committed, against $DEEPSEEK_TILES
# Needs .whl (device_wheels.sh).  bash scripts/device/wide_tiles.sh gemma,deepseek [LABEL]
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/lent_env.sh
stages="${1:-gemma,deepseek}"
label="${2:-run}"
offline() {  # offline NAME PATCH ARGS...: one `tandem bench offline` in its own process
  local name=$1 patch=$2
  shift 2
  timeout 240 python3 -c "import sys; $patch
from services.cli import main; sys.exit(main(sys.argv[1:]))" bench offline --load-format dummy \
    --dtype bfloat16 "$@" --json-out "$out/$name.json" >"$out/$name.log" 2>&1 ||
    echo "$name failed: $(tail -4 "$out/$name.log")"
  python3 -c "import json, sys; t = json.load(open(sys.argv[1]))['tandem']
print(sys.argv[2], round(t['seconds'], 3), 's', round(t['total_tok_s']), 'tok/s')" \
    "$out/$name.json" "$name" 2>/dev/null
}
committed() {  # committed MODULE NAME: the tiles as committed, for the table
  python3 -c "import importlib; print(tuple(getattr(importlib.import_module('$1'), '$2'))[:4])"
}
if has gemma; then
  now=$(committed kernels.triton_prefill WIDE_WHOLE_PROMPT_TILES)
  other="${GEMMA_TILES:-$([[ $now == "(64, 64, 4, 2)" ]] && echo "(128, 64, 8, 2)" || echo "(64, 64, 4, 2)")}"
  echo "gemma-3-1b whole-prompt tiles: committed $now, variant $other"
  patch="import kernels.triton_prefill as tp; tp.WIDE_WHOLE_PROMPT_TILES = tp.Tiles(*$other, True)"
  for round in 1 2; do
    offline "gemma-committed-$round-$label" "" --model gemma-3-1b --num-prompts 128 \
      --input-len 2048 --output-len 8 --max-model-len 4096
    offline "gemma-variant-$round-$label" "$patch" --model gemma-3-1b --num-prompts 128 \
      --input-len 2048 --output-len 8 --max-model-len 4096
  done
fi
if has deepseek; then
  now=$(committed kernels.triton_varlen WIDE_VARLEN_TILES)
  other="${DEEPSEEK_TILES:-(128, 64, 8, 3)}"
  echo "deepseek-v2-lite varlen tiles: committed $now, variant $other"
  patch="import kernels.triton_varlen as tv; tv.WIDE_VARLEN_TILES = tv.VarlenTiles(*$other)"
  for round in 1 2; do
    offline "deepseek-committed-$round-$label" "" --model deepseek-v2-lite --num-prompts 256 \
      --input-len 1024 --output-len 128
    offline "deepseek-variant-$round-$label" "$patch" --model deepseek-v2-lite --num-prompts 256 \
      --input-len 1024 --output-len 128
  done
fi
