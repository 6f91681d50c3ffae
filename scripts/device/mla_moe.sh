#!/usr/bin/env bash
# DeepSeek's MLA cache and the MoE decode path on one GPU, dummy weights of published shapes:
#   tests    the attention, MoE and routing kernel tests and the DeepSeek model tests, compiled
#   mla      deepseek-v2-lite (bf16): `tandem bench latency` batch 1 / 64 / 256 at 1024 tokens
#            and `tandem bench offline` 256 x 1024 -> 128; the KV cache's start-up lines
#   profile  deepseek-v2-lite's kernels in a batch-64 decode step and an 8 x 1024 prefill step
#   moe      qwen3-30b-a3b: bf16 and --quantization fp8 (experts in FP8 too), latency batch 1-16
#   routing  python -m kernels.bench.moe --routing: the router's launch against torch's
#   wide     python -m kernels.bench.wide_heads: whole-prompt tiles for 192- and 256-dim heads
#            (the fastest for 192 is patched into the prefill stage's expanded run)
#   int4     the int4 MoE kernel tests compiled (every failure's assertion printed), then
#            kernels.bench.moe's int4 rows beside bf16 and the int4 pair tiles
#   varlen   the varlen and latent-decode kernel tests compiled, then kernels.bench.wide_heads
#            (its tile sweep compiles ~30 variants: give it 240 s)
#   prefill  deepseek-v2-lite offline with the expanded prefill and with it patched off
#            (deepseek.EXPANDED_PREFILL), each in its own process; the MLA prefill kernels'
#            rows of kernels.bench.roofline (V2-Lite's 16 heads, V3's 128)
# Needs .whl (device_wheels.sh) and .gpu-carry/tok.tgz (the test tokenizer, for the DeepSeek tests).
#   bash scripts/device/mla_moe.sh tests,mla,moe,routing [LABEL]   -> $OUT/*.json (or ./gpu-out)
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/lent_env.sh
stages="${1:-tests,mla,moe,routing}"
label="${2:-run}"
bench() {  # bench NAME ARGS...: one `tandem bench` in its own process, its JSON and log in $out
  local name=$1
  shift
  timeout 300 python3 -m services.cli bench "$@" --json-out "$out/$name.json" \
    >"$out/$name.log" 2>&1 || echo "$name failed: $(tail -4 "$out/$name.log")"
  grep -iE "kv cache|latent|experts" "$out/$name.log" | grep -v "^batch" | head -4
}
if has tests; then
  tar xzf .gpu-carry/tok.tgz -C .gpu-carry && export TANDEM_TEST_TOKENIZER=$PWD/.gpu-carry/tok
  TRITON_INTERPRET=0 timeout 420 python3 -m pytest -q -p no:cacheprovider -x ${TESTS_K:+-k "$TESTS_K"} \
    tests/kernels/test_triton_routing.py tests/kernels/test_triton_moe_pairs.py \
    tests/kernels/test_triton_moe.py tests/kernels/test_triton_decode.py \
    tests/kernels/test_triton_prefill.py tests/kernels/test_triton_attention.py \
    tests/kernels/test_triton_block_copy.py tests/services/engine/models/test_deepseek.py \
    2>&1 | tail -8 | tee "$out/tests-$label.txt"
fi
if has int4; then
  TRITON_INTERPRET=0 timeout 150 python3 -m pytest -q -p no:cacheprovider --tb=line \
    -k "int4 or alignment" tests/kernels/test_triton_moe.py tests/kernels/test_triton_moe_pairs.py \
    2>&1 | tail -8 | tee "$out/int4-tests-$label.txt"
  timeout 240 python3 -m kernels.bench.moe --tokens 1 16 256 --row-budget-s 40 \
    --models qwen3-30b-a3b qwen3-30b-a3b-awq mixtral-8x7b mixtral-8x7b-gptq \
    --json-out "$out/moe-int4-$label.json" 2>&1 | grep -E "T=|copy"
  timeout 120 python3 -m kernels.bench.moe --tune-pairs --tokens 1 4 16 --row-budget-s 25 \
    --models qwen3-30b-a3b-awq mixtral-8x7b-gptq --json-out "$out/moe-pairs-$label.json" \
    2>&1 | grep -E "T="
fi
if has varlen; then
  TRITON_INTERPRET=0 timeout 150 python3 -m pytest -q -p no:cacheprovider --tb=line \
    tests/kernels/test_triton_varlen.py tests/kernels/test_triton_mla.py 2>&1 | tail -6 |
    tee "$out/varlen-tests-$label.txt"
  timeout 240 python3 -m kernels.bench.wide_heads --json-out "$out/wide-$label.json" 2>&1 |
    grep -v -i -E "warn|^\.b|^\s*//|^\s*\." | tail -30 | tee "$out/wide-$label.txt"
fi
if has routing; then
  timeout 120 python3 -m kernels.bench.moe --routing --tokens 1 16 256 4096 \
    --json-out "$out/routing-$label.json" 2>&1 | grep routing
fi
if has mla; then
  bench "mla-latency-$label" latency --model deepseek-v2-lite --load-format dummy \
    --dtype bfloat16 --batch-sizes 1,64,256 --input-len 1024 --output-len 24 --max-model-len 2048
  bench "mla-offline-$label" offline --model deepseek-v2-lite --load-format dummy \
    --dtype bfloat16 --num-prompts 256 --input-len 1024 --output-len 128
fi
prefill_patch=""
if has wide; then  # the wide-head whole-prompt tiles swept; the fastest for DeepSeek's 192 dims
  # is then patched into the prefill stage's runs (when it is not the default)
  timeout 240 python3 -m kernels.bench.wide_heads --json-out "$out/wide-$label.json" |
    tee "$out/wide-$label.txt"
  best=$(python3 -c "import json, sys
rows = [r for r in json.load(open(sys.argv[1]))['rows'] if r['shape'] == 'deepseek expanded'
        and 'ms' in r and r['tiles'] != 'torch sdpa']
print(min(rows, key=lambda r: r['ms'])['tiles'])" "$out/wide-$label.json")
  echo "fastest for 192 dims: $best"
  [[ $best != default ]] && prefill_patch="import kernels.triton_prefill as tp; tp.WIDE_WHOLE_PROMPT_TILES = tp.Tiles(*$best, True)"
fi
if has prefill; then  # the expanded prefill against the absorbed one, each in its own process
  for form in expanded absorbed; do
    patch="$prefill_patch"
    [[ $form == absorbed ]] && patch="import services.engine.models.deepseek as d; d.EXPANDED_PREFILL = False"
    timeout 300 python3 -c "import sys; $patch
from services.cli import main; sys.exit(main(sys.argv[1:]))" bench offline --model deepseek-v2-lite \
      --load-format dummy --dtype bfloat16 --num-prompts 256 --input-len 1024 --output-len 128 \
      --json-out "$out/mla-prefill-$form-$label.json" > "$out/mla-prefill-$form-$label.log" 2>&1 ||
      echo "$form failed: $(tail -4 "$out/mla-prefill-$form-$label.log")"
  done
  timeout 120 python3 -c "
from kernels.bench.roofline import bench_mla_prefill
for r in bench_mla_prefill(): print(r)
for r in bench_mla_prefill(heads=128, prompts=2): print(r)" 2>&1 | tee "$out/mla-prefill-kernels-$label.txt"
fi
if has profile; then  # where DeepSeek-V2-Lite's batch-64 decode step and 8 x 1024 prefill go
  for kind in decode prefill; do
    extra=""
    [[ $kind == prefill ]] && extra="--prefill --batch 8" || extra="--batch 64"
    timeout 240 python3 -m services.engine.bench.profile_step --model deepseek-v2-lite \
      --context 1024 $extra --top 20 --json-out "$out/profile-$kind-$label.json" \
      2>&1 | tail -28 | tee "$out/profile-$kind-$label.txt"
  done
fi
if has moe; then
  bench "moe-bf16-$label" latency --model qwen3-30b-a3b --load-format dummy --dtype bfloat16 \
    --batch-sizes 1,2,4,8,16 --input-len 1024 --output-len 24 --max-model-len 2048
  bench "moe-fp8-$label" latency --model qwen3-30b-a3b --load-format dummy --dtype bfloat16 \
    --quantization fp8 --batch-sizes 1,2,4,8,16 --input-len 1024 --output-len 24 \
    --max-model-len 2048
fi
for f in "$out"/*-"$label".json; do
  python3 - "$f" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
name = sys.argv[1].rsplit("/", 1)[-1]
for r in d.get("rows", []):
    if "step_ms" in r:
        print(name, "batch", r["batch"], "step_ms", round(r["step_ms"], 3), "graph",
              round(r["graph_replay_ms"] or 0, 3), "floor", round(r["floor_ms"] or 0, 3))
if "tandem" in d:
    print(name, "seconds", round(d["tandem"]["seconds"], 2), "tok/s", round(d["tandem"]["total_tok_s"]))
PY
done
