#!/usr/bin/env bash
# Where W1's GPU sits idle (Llama-3.1-8B's shape, dummy bf16 weights): a traced 8 x 1024
# prefill step (profile_step --trace-out, eager as W1's prefill runs) and a batch-256 decode
# step, each trace's idle gaps and the host ops over them (scripts/device/trace_gaps.py); then
# W1 itself (`tandem bench offline` 256 x 1024 -> 128) for its step split.
# Needs .whl (device_wheels.sh).  bash scripts/device/w1_gaps.sh [LABEL]
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/lent_env.sh
label="${1:-run}"
for kind in prefill decode; do
  [[ $kind == prefill ]] && extra="--prefill --batch 8" || extra="--batch 256"
  timeout 200 python3 -m services.engine.bench.profile_step --model llama-3.1-8b --context 1024 \
    $extra --top 12 --json-out "$out/profile-$kind-$label.json" \
    --trace-out "/tmp/trace-$kind.json" >"$out/profile-$kind-$label.txt" 2>&1 ||
    echo "$kind failed: $(tail -4 "$out/profile-$kind-$label.txt")"
  grep -v -i warn "$out/profile-$kind-$label.txt" | tail -14
  python3 scripts/device/trace_gaps.py "/tmp/trace-$kind.json" --top 12 |
    tee "$out/gaps-$kind-$label.txt"
  gzip -c "/tmp/trace-$kind.json" >"$out/trace-$kind-$label.json.gz"
done
timeout 200 python3 -m services.cli bench offline --model llama-3.1-8b --load-format dummy \
  --dtype bfloat16 --num-prompts 256 --input-len 1024 --output-len 128 \
  --json-out "$out/w1-$label.json" >"$out/w1-$label.log" 2>&1 || echo "w1 failed: $(tail -4 "$out/w1-$label.log")"
python3 -c "import json, sys; t = json.load(open(sys.argv[1]))['tandem']
print('W1', round(t['seconds'], 3), 's', json.dumps(t['steps']))" "$out/w1-$label.json"
