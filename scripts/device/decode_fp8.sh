#!/usr/bin/env bash
# Decode attention over an FP8 KV cache (issue 20): the scores as [keys, heads] tiles
# (key_rows: the converted K and V tiles are the dots' first operand) against [heads, keys].
#   tests    the compiled decode-attention and FP8-KV kernel tests (key_rows included)
#   tune     python -m kernels.bench.tune decode [fp8] graph b64 w1 keyrows quick: the tiles
#            and both orders at batch 64 x 4096, 256 x 512 and W1's 224 x 1100, FP8 and bf16
#   b1       the same at batch 1 x 32768 (split-K), FP8 and bf16
#   profile  profile_step: W1's decode step (224 x 1100) with FP8 weights and FP8 KV, and with
#            FP8 weights and a bf16 cache
#   w1       W1 in bf16, FP8 weights, FP8 weights + FP8 KV, one process each (W1_ROUNDS times)
# Needs .whl (device_wheels.sh). bash scripts/device/decode_fp8.sh tests,tune -> $OUT/*
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/lent_env.sh
stages="${1:-tests,tune}"
has() { [[ ",$stages," == *",$1,"* ]]; }
if has tests; then
  echo "== tests $(date +%T)"
  TRITON_INTERPRET=0 timeout 240 python3 -m pytest -q -p no:cacheprovider \
    tests/kernels/test_triton_decode.py tests/kernels/test_fp8_kv.py >"$out/tests.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$out/tests.txt" | cut -c1-300 | tail -6
fi
if has tune; then
  for kv in fp8 bf16; do
    echo "== tune $kv $(date +%T)"
    arg=""; [ "$kv" = fp8 ] && arg=fp8
    timeout 300 python3 -m kernels.bench.tune decode $arg graph b64 w1 keyrows quick \
      >"$out/tune-$kv.txt" 2>&1
    grep -E "^decode|default|best with|tiles" "$out/tune-$kv.txt" | tail -16
  done
fi
if has b1; then
  for kv in fp8 bf16; do
    echo "== b1 $kv $(date +%T)"
    arg=""; [ "$kv" = fp8 ] && arg=fp8
    timeout 200 python3 -m kernels.bench.tune decode $arg graph b1 keyrows quick \
      >"$out/b1-$kv.txt" 2>&1
    grep -E "^decode|default|best with|tiles" "$out/b1-$kv.txt" | tail -8
  done
fi
if has profile; then
  for kv in fp8 auto; do
    echo "== fp8 decode step, kv $kv $(date +%T)"
    timeout 120 python3 -m services.engine.bench.profile_step --model llama-3.1-8b --batch 224 \
      --context 1100 --max-model-len 1200 --quantization fp8 --kv-cache-dtype $kv --top 8 \
      --json-out "$out/decode-$kv.json" >"$out/decode-$kv.txt" 2>&1
    grep -v Warning "$out/decode-$kv.txt" | grep -v _warn_once | tail -9
  done
fi
if has w1; then  # one JSON file of every run (the lent machine returns a few files only)
  mkdir -p /tmp/w1
  for round in $(seq "${W1_ROUNDS:-1}"); do
    for q in "" "--quantization fp8" "--quantization fp8 --kv-cache-dtype fp8" "--kv-cache-dtype fp8"; do
      tag=$(echo "bf16 $q" | tr -s ' -' '_')
      echo "== w1 round $round $tag $(date +%T)"
      timeout 150 python3 -m services.cli bench offline --model llama-3.1-8b \
        --max-model-len 2048 --num-prompts 256 --input-len 1024 --output-len 128 $q \
        --json-out "/tmp/w1/$round$tag.json" 2>&1 | grep -E "^tandem|Error|error" | tail -2
    done
  done
  python3 -c 'import json, pathlib, sys; print(json.dumps({p.stem: json.loads(p.read_text()) for p in sorted(pathlib.Path("/tmp/w1").glob("*.json"))}))' >"$out/w1.json"
fi
