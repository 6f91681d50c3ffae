#!/usr/bin/env bash
# Decode attention over an FP8 KV cache (issue 20): why it reads at about half the copy
# bandwidth where a bf16 cache's reaches ~95%, and the register cap and the head dim in halves
# that help.
#   tests    the compiled decode-attention and FP8-KV kernel tests
#   tune     python -m kernels.bench.tune decode [fp8] graph b64 w1 maxreg quick: the tiles,
#            uncapped and with registers capped, at batch 64 x 4096, 256 x 512 and W1's
#            224 x 1100 (TUNE_KV: fp8, bf16 or both)
#   b1       the same at batch 1 x 32768 (split-K), FP8 and bf16
#   cap      the FP8 cache's default register cap against none, batch 1 (split-K) to 256
#   halves   the head dim in halves (the default) against whole, FP8 and bf16 caches, batch 1
#            to 256, and the largest difference between their outputs
#   prefill  the compiled prefill-attention kernel tests (the sliding window's included)
#   warmup   the compiled warm-up test (serving after it builds no kernel; FP8 KV included)
#   profile  profile_step: W1's decode step (224 x 1100) with FP8 weights and FP8 KV, and with
#            FP8 weights and a bf16 cache
#   ncu      Nsight Compute on one decode-attention call at W1's shape (224 x 1100), FP8 cache
#            (the default cap and none) and bf16: speed of light, memory, warp stalls, source counters; and
#            the Triton IR and PTX of each variant (ncu.tgz)
#   w1       W1 in bf16, FP8 weights, FP8 weights + FP8 KV, one process each (W1_ROUNDS times)
# Needs .whl (device_wheels.sh). bash scripts/device/decode_fp8.sh tests,tune -> $OUT/*
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/lent_env.sh
stages="${1:-tests,tune}"
if has tests; then
  echo "== tests $(date +%T)"
  TRITON_INTERPRET=0 timeout 240 python3 -m pytest -q -p no:cacheprovider \
    tests/kernels/test_triton_decode.py tests/kernels/test_fp8_kv.py >"$out/tests.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$out/tests.txt" | cut -c1-300 | tail -6
fi
if has tune; then
  for kv in ${TUNE_KV:-fp8 bf16}; do
    echo "== tune $kv $(date +%T)"
    arg=""; [ "$kv" = fp8 ] && arg=fp8
    timeout 300 python3 -m kernels.bench.tune decode $arg graph b64 w1 maxreg quick \
      >"$out/tune-$kv.txt" 2>&1
    grep -E "^decode|default|best with|tiles" "$out/tune-$kv.txt" | tail -16
  done
fi
if has b1; then
  for kv in fp8 bf16; do
    echo "== b1 $kv $(date +%T)"
    arg=""; [ "$kv" = fp8 ] && arg=fp8
    timeout 200 python3 -m kernels.bench.tune decode $arg graph b1 maxreg quick \
      >"$out/b1-$kv.txt" 2>&1
    grep -E "^decode|default|best with|tiles" "$out/b1-$kv.txt" | tail -8
  done
fi
if has cap; then
  echo "== cap $(date +%T)"
  timeout 200 python3 -m kernels.bench.tune cap graph >"$out/cap.txt" 2>&1
  tail -9 "$out/cap.txt"
fi
if has halves; then
  echo "== halves $(date +%T)"
  timeout 200 python3 -m kernels.bench.tune halves graph >"$out/halves.txt" 2>&1
  tail -16 "$out/halves.txt"
fi
if has prefill; then
  echo "== prefill tests $(date +%T)"
  TRITON_INTERPRET=0 timeout 300 python3 -m pytest -q -p no:cacheprovider \
    tests/kernels/test_triton_prefill.py >"$out/prefill-tests.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$out/prefill-tests.txt" | cut -c1-300 | tail -6
fi
if has warmup; then
  echo "== warmup $(date +%T)"
  TRITON_INTERPRET=0 timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/services/engine/test_gpu_warmup.py >"$out/warmup.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$out/warmup.txt" | cut -c1-300 | tail -6
fi
if has ncu; then
  echo "== ncu $(date +%T)"
  mkdir -p /tmp/ncu && export TRITON_CACHE_DIR=/tmp/ncu/cache
  cat >/tmp/ncu/one.py <<'PY'
import sys, torch
from kernels.bench.cases import paged
from kernels.triton_decode import paged_decode_attention
kv, cap = sys.argv[1], (None if sys.argv[2] == "default" else 0)
p = paged([1100] * 224)
if kv == "fp8":
    p.k_cache, p.v_cache = p.k_cache.to(torch.float8_e4m3fn), p.v_cache.to(torch.float8_e4m3fn)
args = (p.q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale)
for _ in range(3):
    paged_decode_attention(*args, max_registers=cap)
torch.cuda.synchronize()
PY
  for v in "fp8 default" "fp8 uncapped" "bf16 default"; do
    tag=$(echo "$v" | tr ' ' '-')
    timeout 120 ncu --clock-control none -k regex:_decode_kernel -s 2 -c 1 --set full \
      --import-source yes --page details --print-details all \
      python3 /tmp/ncu/one.py $v >"/tmp/ncu/$tag.txt" 2>&1
    timeout 60 ncu --clock-control none -k regex:_decode_kernel -s 2 -c 1 --set full \
      --page source --csv --print-source sass python3 /tmp/ncu/one.py $v \
      >"/tmp/ncu/$tag-sass.csv" 2>&1
    echo "-- $tag"
    grep -E "Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Theoretical Occ|Stall|Issue Slots Busy|Executed Ipc A" \
      "/tmp/ncu/$tag.txt" | head -16
  done
  for f in $(find /tmp/ncu/cache -name "_decode_kernel.ttgir" -o -name "_decode_kernel.ptx"); do
    cp "$f" "/tmp/ncu/$(basename "$(dirname "$f")" | cut -c1-12)-$(basename "$f")"
  done
  tar -czf "$out/ncu.tgz" -C /tmp/ncu --exclude cache .
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
if has w1; then  # fp8_gemm.sh's W1 stage, with bf16 weights + FP8 KV too
  W1_VARIANTS=" ;--quantization fp8;--quantization fp8 --kv-cache-dtype fp8;--kv-cache-dtype fp8" \
    bash scripts/device/fp8_gemm.sh w1
fi
