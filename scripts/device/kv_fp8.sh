#!/usr/bin/env bash
# Issue 20's FP8 KV cache on one GPU:
#   tests    the FP8 KV kernels compiled (TRITON_INTERPRET=0): rounding, writes, decode and
#            prefill attention and block copies against their torch references
#   quality  python -m services.engine.bench.kv_fp8: the embedded model's 56 prompts with a bf16
#            and an FP8 cache (equal continuations, near-ties) and the blocks each gets
#   latency  the 8B shape (dummy weights): batch-1 and batch-64 decode steps, bf16 cache against
#            FP8 (tandem bench latency)
# Needs .whl (device_wheels.sh).
#   bash scripts/device/kv_fp8.sh tests,quality,latency   -> $OUT/*.json (or ./gpu-out)
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/lent_env.sh
stages="${1:-tests,quality,latency}"
if has tests; then
  TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_kv.py \
    tests/kernels/test_triton_block_copy.py 2>&1 | tail -5 | tee "$out/tests.txt" || true
fi
if has quality; then
  python3 -m services.engine.bench.kv_fp8 --json-out "$out/kv-fp8-quality.json" \
    >"$out/quality.out" 2>"$out/quality.err" || echo "quality failed: $(tail -3 "$out/quality.err")"
fi
if has latency; then
  for kv in auto fp8; do
    python3 -m services.cli bench latency --model llama-3.1-8b --load-format dummy \
      --dtype bfloat16 --kv-cache-dtype "$kv" --batch-sizes 1,64 --input-len 1024 \
      --output-len 64 --max-model-len 2048 >"$out/latency-$kv.out" 2>"$out/latency-$kv.err" \
      && sed -n '/^{/,$p' "$out/latency-$kv.out" >"$out/latency-$kv.json" \
      || echo "latency $kv failed: $(tail -3 "$out/latency-$kv.err")"
  done
fi
cat "$out/tests.txt" 2>/dev/null || true
python3 - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
q = out / "kv-fp8-quality.json"
if q.exists():
    d = json.loads(q.read_text())
    print("quality:", json.dumps(d["quality"]), "blocks:", d["blocks"], "ratio:", d["blocks_ratio"])
for kv in ("auto", "fp8"):
    f = out / f"latency-{kv}.json"
    if f.exists():
        print(kv, f.read_text()[:600])
PY
