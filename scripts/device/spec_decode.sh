#!/usr/bin/env bash
# Issue 21, acceptance 2 and 3: decode speed without and with n-gram speculative decoding, by
# services.engine.bench.spec_decode, each variant in its own process.
#  - the embedded model's real weights (SmolLM2-135M-Instruct, bf16), the `copy` prompt set,
#    batch 1: TPOT, acceptance length, and whether the greedy outputs are identical;
#  - the 8B shape with random weights (nothing accepted): TPOT at batch 1 and 64.
# Needs .whl (device_wheels.sh) and the GGUF carried in two calls (device_gguf.sh split; carry
# .gguf-a with a first call that runs `device_gguf.sh stash`, .gguf-b with this one).
#   bash scripts/device/spec_decode.sh   -> $OUT/spec_decode.jsonl (or ./gpu-out)
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/lent_env.sh
gguf=$(bash scripts/device/device_gguf.sh assemble 2>/dev/null || true)
spec='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'
log="$out/spec_decode.jsonl"
: > "$log"
bench() { python3 -m services.engine.bench.spec_decode "$@" 2>"$out/stderr-$RANDOM.txt" | tail -1 | tee -a "$log"; }
if [ -n "$gguf" ]; then
  export TANDEM_EMBEDDED_GGUF=$gguf
  for dtype in ${SPEC_DTYPES:-bfloat16 float32}; do  # float32: numerics of bf16, or the method?
    for s in "" "$spec"; do
      bench --model embedded --dtype $dtype --prompts copy --batch 1 --max-tokens 256 \
        ${s:+--speculative-config "$s"}
    done
  done
else
  echo "no GGUF: the real-weights runs are skipped" | tee -a "$out/notes.txt"
fi
for s in "" "$spec"; do
  bench --model llama-3.1-8b --load-format dummy --prompts random --input-len 1024 \
    --batch 1,64 --max-tokens 128 --max-model-len 2048 ${s:+--speculative-config "$s"}
done
python3 - "$log" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
key = lambda d, r: (d["model"], d["dtype"], r["batch"])
base = {key(d, r): r for d in rows if not d["speculative_config"] for r in d["results"]}
print(f"{'model':<14}{'dtype':<16}{'spec':<5}{'batch':>6}{'tpot ms':>9}{'tok/s':>9}{'acc len':>8}"
      f"{'equal':>7}  first difference (token index) per request")
for d in rows:
    for r in d["results"]:
        acc, ref = r["acceptance_length"], base.get(key(d, r))
        same, first = "-", ""
        if ref is not None and d["speculative_config"]:
            pairs = list(zip(ref["token_ids"], r["token_ids"]))
            same = f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
            diffs = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                     for a, b in pairs if a != b]
            first = " ".join(map(str, diffs[:8]))
        print(f"{d['model']:<14}{d['dtype']:<16}{'on' if d['speculative_config'] else 'off':<5}{r['batch']:>6}"
              f"{r['tpot_ms_median']:>9.2f}{r['output_tok_s']:>9.1f}"
              f"{(f'{acc:.2f}' if acc else '-'):>8}{same:>7}  {first}")
PY
