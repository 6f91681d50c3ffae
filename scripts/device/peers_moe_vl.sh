#!/usr/bin/env bash
# W1 side by side with transformers for the MoE and vision-language shapes, on one H100 80GB:
#   moe  issue 22 acceptance 3: Qwen3-30B-A3B's shape (named config qwen3-30b-a3b: 30.5B
#        parameters, 61 GB in bf16, random weights), 256 prompts x 1024 tokens in -> 128 out
#   vl   issue 26 acceptance 3: Qwen2-VL-7B's shape (named config qwen2-vl-7b, 8.3B), the same
#        W1 with one random 448x448 image per prompt (256 image tokens: 1282-token prompts)
#   vl3  the same on Qwen3-VL-8B's shape (named config qwen3-vl-8b, 8.77B; 196 image tokens)
# Each is `tandem bench offline --compare-transformers`: transformers generate first, each batch
# size in a fresh process of its own (services/engine/bench/hf_peer.py: the same config, random
# bf16 weights, the same prompt ids, placeholders and images), then our engine on all 256 prompts.
#
# Bounded to ~250 s of GPU wall time per stage: the peer sweeps two batch sizes and times only
# the first --peer-num-prompts prompts (whole batches of the same shape: static batches run at
# the same speed, so its tok/s is what the 256 would give).
#   moe: peer at 32 and 64 (64 MoE prompts: 2 and 1 batches). 61 GB of weights leave ~15 GB;
#        transformers' cache is 96 KiB a token (7.2 GB at batch 64 x 1152 positions, 14.5 at 128:
#        128 cannot fit), and its prefill at 64 x 1024 tokens needs several GB more: 64 may run
#        out of memory, which is recorded per batch size ("error": "out of memory").
#   vl:  peer at 64 and 128 over 128 prompts (2 and 1 batches); 128 was transformers' best on
#        the 8B text shape (docs/benchmarks.md, W1).
# Our engine plans its KV cache in what the weights leave (--max-model-len 2048).
# Needs .whl (device_wheels.sh) only where the image lacks a wheel.
#   bash scripts/device/peers_moe_vl.sh moe,vl   -> $OUT/{moe,vl}-w1.json (or ./gpu-out)
# Both stages take ~500 s: run them in two calls (`... moe`, then `... vl`) when one command
# may run at most 600 s.
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/lent_env.sh
stages="${1:-moe,vl}"
w1=(python3 -m services.cli bench offline --load-format dummy --dtype bfloat16
  --max-model-len 2048 --num-prompts 256 --input-len 1024 --output-len 128 --compare-transformers)
if has moe; then
  echo "=== moe $(date +%T)"
  timeout 290 "${w1[@]}" --model qwen3-30b-a3b --batch-sizes 32,64 --peer-num-prompts 64 \
    --json-out "$out/moe-w1.json" >"$out/moe-w1.out" 2>"$out/moe-w1.err" \
    || echo "moe failed ($?): $(tail -5 "$out/moe-w1.err")"
  grep -E "tok/s|speedup" "$out/moe-w1.out"
fi
if has vl; then
  echo "=== vl $(date +%T)"
  timeout 290 "${w1[@]}" --model qwen2-vl-7b --image-size 448 --batch-sizes 64,128 \
    --peer-num-prompts 128 --json-out "$out/vl-w1.json" >"$out/vl-w1.out" 2>"$out/vl-w1.err" \
    || echo "vl failed ($?): $(tail -5 "$out/vl-w1.err")"
  grep -E "tok/s|speedup" "$out/vl-w1.out"
fi
if has vl3; then  # the same W1 on Qwen3-VL-8B's shape (8.77B; 448x448: 196 image tokens)
  echo "=== vl3 $(date +%T)"
  timeout 290 "${w1[@]}" --model qwen3-vl-8b --image-size 448 --batch-sizes 64,128 \
    --peer-num-prompts 128 --json-out "$out/vl3-w1.json" >"$out/vl3-w1.out" 2>"$out/vl3-w1.err" \
    || echo "vl3 failed ($?): $(tail -5 "$out/vl3-w1.err")"
  grep -E "tok/s|speedup" "$out/vl3-w1.out"
fi
echo "=== done $(date +%T)"
python3 - "$out" <<'PY'
import json, pathlib, sys

out = pathlib.Path(sys.argv[1])
print(f"{'stage':5} {'engine':34} {'prompts':>7} {'seconds':>8} {'total tok/s':>12}")
for stage in ("moe", "vl", "vl3"):
    f = out / f"{stage}-w1.json"
    if not f.exists():
        continue
    r = json.loads(f.read_text())
    t = r["tandem"]
    print(f"{stage:5} {'tandem':34} {r['num_prompts']:>7} {t['seconds']:>8.2f} {t['total_tok_s']:>12,.0f}")
    for name, run in r.get("transformers", {}).get("runs", {}).items():
        label = f"transformers {name} (own process)"
        if "error" in run:
            print(f"{stage:5} {label:34} {'':>7} {run['error'][:60]}")
        else:
            print(f"{stage:5} {label:34} {run['num_prompts']:>7} {run['seconds']:>8.2f} "
                  f"{run['total_tok_s']:>12,.0f}")
    speedup = r.get("speedup_vs_best_transformers")
    print(f"{stage:5} speedup vs transformers' best: " + (f"{speedup:.2f}x" if speedup else "n/a"))
PY
