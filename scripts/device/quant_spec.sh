#!/usr/bin/env bash
# Issues 20 and 21 on one GPU, the 8B shape with random weights (--load-format dummy), every
# variant in its own process, one after the other:
#   kernels  the quantized linear layers against the roofline (python -m kernels.bench.quant:
#            each launch is checked against its torch reference before it is timed)
#   w8a8     the large-batch FP8 layer: per-token quantization (torch against the Triton
#            kernel) and torch._scaled_mm against bf16, at 256, 2048 and 8192 rows
#   latency  the batch-1 and batch-16 decode step: bf16, --quantization fp8, awq, gptq
#   w1       W1 (256 prompts x 1024 tokens -> 128): bf16 against fp8 throughput
#   draft    speculative decoding with a draft of the SmolLM2-135M shape (given the 8B's
#            vocabulary, so that it can propose for it): TPOT and acceptance at batch 1 and 64,
#            against no speculation (random weights: the method's cost, not its quality);
#            draft-cost.json: the TPOT cost per batch size and where the draft's time went
# Needs .whl (device_wheels.sh).
#   bash scripts/device/quant_spec.sh kernels,latency   -> $OUT/*.json (or ./gpu-out)
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/lent_env.sh
stages="${1:-kernels,latency,w1,draft}"
eightb=(--model llama-3.1-8b --load-format dummy --dtype bfloat16)
run() {  # name, then the command; its stdout's last line is its JSON
  local name=$1
  shift
  echo "== $name" >&2
  if "$@" >"$out/$name.out" 2>"$out/$name.err"; then
    # a one-line JSON result last: kept apart (the lent machine returns few files)
    if tail -1 "$out/$name.out" | grep -q '^{'; then tail -1 "$out/$name.out" >"$out/$name.json"; fi
    [ -s "$out/$name.err" ] || rm -f "$out/$name.err"
  else
    echo "$name failed: $(tail -3 "$out/$name.err" | tr '\n' ' ')" | tee -a "$out/notes.txt"
  fi
}
if has kernels; then
  run kernels python3 -m kernels.bench.quant --rows 1 4 16 --json-out "$out/kernels-full.json"
fi
if has w8a8; then
  run w8a8 python3 -m kernels.bench.quant --rows --w8a8-rows 256 2048 8192 \
    --json-out "$out/w8a8-full.json"
fi
if has latency; then
  for q in none fp8 awq gptq; do
    quant=()
    [ "$q" != none ] && quant=(--quantization "$q")
    run "latency-$q" python3 -m services.cli bench latency "${eightb[@]}" "${quant[@]}" \
      --batch-sizes 1,16 --input-len 512 --output-len 64 --max-model-len 2048
  done
fi
if has w1; then
  for q in none fp8; do
    quant=()
    [ "$q" != none ] && quant=(--quantization "$q")
    run "w1-$q" python3 -m services.cli bench offline "${eightb[@]}" "${quant[@]}" \
      --num-prompts 256 --input-len 1024 --output-len 128 --max-model-len 2048
  done
fi
if has draft; then
  draft_dir=$(mktemp -d)
  python3 - "$draft_dir" <<'PY'
import json, sys
from pathlib import Path
from services.model_files import named_configs
config = json.loads(named_configs()["smollm2-135m"].read_text())
config["vocab_size"] = json.loads(named_configs()["llama-3.1-8b"].read_text())["vocab_size"]
(Path(sys.argv[1]) / "config.json").write_text(json.dumps(config))
PY
  spec="{\"method\": \"draft_model\", \"model\": \"$draft_dir\", \"num_speculative_tokens\": 4}"
  for s in "" "$spec"; do
    name=draft-off
    [ -n "$s" ] && name=draft-on
    run "$name" python3 -m services.engine.bench.spec_decode "${eightb[@]}" --prompts random \
      --input-len 1024 --batch 1,64 --max-tokens 128 --max-model-len 2048 \
      ${s:+--speculative-config "$s"}
  done
  # the cost of failed drafting per batch size (TPOT with / without - 1; the bound is 5%) and
  # where the draft's time went: one JSON line, also on stderr for the log
  if [ -s "$out/draft-off.json" ] && [ -s "$out/draft-on.json" ]; then
    python3 - "$out/draft-off.json" "$out/draft-on.json" >"$out/draft-cost.json" <<'PY'
import json, sys
off, on = (json.load(open(p)) for p in sys.argv[1:3])
rows = []
for a, b in zip(off["results"], on["results"]):
    spent = b["speculation"]
    rows.append({
        "batch": a["batch"], "tpot_ms_off": a["tpot_ms_mean"], "tpot_ms_on": b["tpot_ms_mean"],
        "cost_pct": 100 * (b["tpot_ms_mean"] / a["tpot_ms_mean"] - 1),
        "ttft_ms_off": a["ttft_ms_mean"], "ttft_ms_on": b["ttft_ms_mean"],
        "verify_steps": b["verify_steps"], "draft_tokens": b["draft_tokens"],
        "accepted_tokens": b["accepted_tokens"], "same_tokens": a["outputs_sha256"] == b["outputs_sha256"],
        "speculation": spent,
    })
line = json.dumps({"draft_cost": rows})
print(line)
print(line, file=sys.stderr)
PY
  fi
fi
ls "$out"
