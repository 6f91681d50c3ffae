#!/usr/bin/env bash
# W7 (docs/benchmarks.md, "W7 CPU"): the embedded model on this machine's CPU against transformers
# `generate` in its own process, in one run:
#   1. the in-process engine at batch 1 and 16 (`tandem bench offline --compare-transformers`),
#      once with the default layers and once with TANDEM_CPU_BLOCKS=0 (float32 oneDNN layers);
#   2. `tandem up` (gateway + prefill + decode on the same cores), 16 concurrent streams of the
#      same shape (`tandem bench serve`), against the peer's batch-16 output tok/s of step 1.
# Usage: bash scripts/w7_cpu.sh [OUT_DIR]   (default: w7-cpu-out); the JSON files land there.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-w7-cpu-out}
mkdir -p "$OUT"
PY=${PY:-.venv/bin/python}
TANDEM=${TANDEM:-.venv/bin/tandem}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}
SHAPE=(--model embedded --input-len 64 --output-len 128)

for blocks in 1 0; do
  TANDEM_CPU_BLOCKS=$blocks "$TANDEM" bench offline "${SHAPE[@]}" --num-prompts 1 \
    --compare-transformers --batch-sizes 1 >"$OUT/batch1-blocks$blocks.json"
  TANDEM_CPU_BLOCKS=$blocks "$TANDEM" bench offline "${SHAPE[@]}" --num-prompts 16 \
    --kv-cache-gib 1 --compare-transformers --batch-sizes 16 >"$OUT/batch16-blocks$blocks.json"
done

PORT=${PORT:-$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
"$TANDEM" up --port "$PORT" >"$OUT/up.log" 2>&1 &
UP=$!
trap 'kill -TERM $UP 2>/dev/null; wait $UP 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
  kill -0 $UP 2>/dev/null || { echo "tandem up exited: see $OUT/up.log" >&2; exit 1; }
  sleep 1
done
"$TANDEM" bench serve --base-url "http://127.0.0.1:$PORT" --endpoint /v1/completions \
  --input-len 64 --output-len 128 --num-prompts 16 --max-concurrency 16 --request-rate inf \
  --json-out "$OUT/up-16-streams.json" >"$OUT/up-16-streams.txt"

"$PY" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])

def offline(name):
    text = (out / name).read_text()
    return json.loads(text[text.index("{"):])

print(f"{'run':<34} {'Tandem s':>9} {'peer s':>8} {'ratio':>6}")
peer16 = None
for blocks in (1, 0):
    for batch in (1, 16):
        d = offline(f"batch{batch}-blocks{blocks}.json")
        t = d["tandem"]["seconds"]
        peer = d["transformers"]["best"]
        p = peer["seconds"]
        if batch == 16 and blocks == 1:
            peer16 = peer
        label = f"batch {batch}, {'blocks' if blocks else 'float32 (oneDNN)'}"
        print(f"{label:<34} {t:9.2f} {p:8.2f} {p / t:5.2f}x")
serve = json.loads((out / "up-16-streams.json").read_text())
rate = serve["results"][0] if "results" in serve else serve
tok_s = rate.get("output_throughput") or rate.get("output_tok_s")
peer_tok_s = peer16["output_tokens"] / peer16["seconds"] if peer16 else float("nan")
print(f"tandem up, 16 streams: {tok_s:.1f} output tok/s; peer batch 16: {peer_tok_s:.1f} "
      f"({tok_s / peer_tok_s:.2f}x)")
EOF
