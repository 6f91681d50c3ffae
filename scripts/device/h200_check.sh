#!/usr/bin/env bash
# One short lease (about 7 minutes of device time): check on a GPU what the last stops built
# without one, and measure the defaults once, each part in its own process and time limit,
# most important first, so a lease that runs out loses the least:
#   tests    the compiled GPU tests of async scheduling (prompt chunks and admissions launched
#            ahead since 4d3bdf7, never run on a GPU before) and of the engine's waits
#   w1       offline throughput, ours (256 x 1024 -> 128, 8B shape, defaults) -> $out/w1.json
#   w2       decode step time, batch 1, 64, 256 at context 1024             -> $out/w2.json
#   prefill  where a W1 prefill step's time goes (8 x 1024 whole prompts)  -> $out/prefill.json
#   awq      the AWQ batch-1 step with the int4 GEMV's launch chosen on an H100 (00026c1)
#                                                                            -> $out/awq.json
#   fp8dec   where a W1 decode step's time goes, FP8 weights + FP8 KV against bf16 (batch 224,
#            context 1100: W1's decode steps)            -> $out/decode-{fp8,bf16}.json
#   fp8tune  the decode kernel's tiles over an FP8 KV cache, read as bf16 and as fp16
#            (kernels.bench.tune decode fp8 graph b64 w1)              -> $out/fp8tune.txt
#   kvtl     the one-GPU hand-off of a 1024-token KV with its time line (TANDEM_KV_TIMELINE)
#                                                                            -> $out/kv-tl.json
#   kvgrant  the KV transfer GPU tests, then the one-GPU hand-off of 1024 and 32k tokens asked
#            for (header, Go) and granted ahead (kvtransfer.grants), with the time line
#                                                              -> $out/kv-granted.{json,txt}
#   w1q      W1 with bf16, FP8 weights, FP8 weights + FP8 KV, one after another
#                                                        -> $out/w1-{none,fp8,fp8-fp8kv}.json
#   peer256  the transformers peer at batch 256 in its own process, then ours (W1)
#                                                                            -> $out/w1-peer256.json
#   bash scripts/device/h200_check.sh [step ...]   (default: all five, in that order)
# Wheels the image lacks: scripts/device/device_wheels.sh, carried as .whl.
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/lent_env.sh
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', \
triton.__version__, 'transformers', transformers.__version__)" | tee "$out/versions.txt"
summary=()
for step in ${*:-tests w1 w2 prefill awq}; do
  echo "=== $step $(date +%T)"
  start=$SECONDS
  case $step in
    tests)
      line=$(timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu \
        tests/services/engine/test_gpu_async.py tests/services/engine/test_gpu_wait.py 2>&1 |
        tee "$out/tests.txt" | tail -1) ;;
    w1)
      line=$(timeout 170 python3 -m services.cli bench offline --model llama-3.1-8b \
        --max-model-len 2048 --num-prompts 256 --input-len 1024 --output-len 128 \
        --json-out "$out/w1.json" 2>&1 | grep -E "^tandem|Error|error" | tail -2) ;;
    w2)
      line=$(timeout 130 python3 -m services.cli bench latency --model llama-3.1-8b \
        --max-model-len 2048 --input-len 1024 --output-len 24 --batch-sizes 1,64,256 \
        --json-out "$out/w2.json" 2>&1 | grep -E "^batch|Error|error" | tr '\n' ';') ;;
    prefill)
      line=$(timeout 90 python3 -m services.engine.bench.profile_step --model llama-3.1-8b \
        --batch 8 --context 1024 --prefill --top 12 --json-out "$out/prefill.json" 2>&1 |
        tee "$out/prefill.txt" | tail -3 | tr '\n' ';') ;;
    awq)
      line=$(timeout 110 python3 -m services.cli bench latency --model llama-3.1-8b \
        --load-format dummy --dtype bfloat16 --quantization awq --batch-sizes 1 \
        --input-len 512 --output-len 32 --max-model-len 2048 --json-out "$out/awq.json" 2>&1 |
        grep -E "^batch|Error|error" | tr '\n' ';') ;;
    fp8dec)
      for q in fp8 bf16; do
        flags=(); [[ $q == fp8 ]] && flags=(--quantization fp8 --kv-cache-dtype fp8)
        timeout 120 python3 -m services.engine.bench.profile_step --model llama-3.1-8b \
          --batch 224 --context 1100 --max-model-len 1200 --top 14 "${flags[@]}" \
          --json-out "$out/decode-$q.json" >"$out/decode-$q.txt" 2>&1
        tail -18 "$out/decode-$q.txt"
      done
      line=$(grep -h -i "step\b.*ms" "$out"/decode-*.txt | tail -2 | tr '\n' ';') ;;
    fp8tune)
      timeout 300 python3 -m kernels.bench.tune decode fp8 graph b64 w1 >"$out/fp8tune.txt" 2>&1
      grep -v "skip" "$out/fp8tune.txt" | tail -45
      line=$(grep -A2 "^decode" "$out/fp8tune.txt" | tr '\n' ';') ;;
    kvtl)
      line=$(TANDEM_KV_TIMELINE=1 timeout 150 python3 -m kvtransfer.bench.transfer --tokens 1024 \
        --iters 30 --json-out "$out/kv-tl.json" 2>&1 | tee "$out/kv-tl.txt" | grep -E "e2e" |
        tail -3 | tr '\n' ';') ;;
    kvgrant)
      timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kvtransfer/test_gpu.py \
        tests/kvtransfer/test_pusher.py tests/kernels/test_triton_block_copy.py 2>&1 | tee "$out/kv-gpu-tests.txt" | tail -3
      line=$(TANDEM_KV_TIMELINE=1 timeout 240 python3 -m kvtransfer.bench.transfer --tokens 1024 \
        32768 --iters 30 --no-ttft --json-out "$out/kv-granted.json" 2>&1 |
        tee "$out/kv-granted.txt" | grep -E "e2e|push|passed|failed" | tr '\n' ';') ;;
    w1q)
      line=""
      for q in none fp8 fp8-fp8kv; do
        flags=(); [[ $q != none ]] && flags=(--quantization fp8)
        [[ $q == fp8-fp8kv ]] && flags+=(--kv-cache-dtype fp8)
        got=$(timeout 150 python3 -m services.cli bench offline --model llama-3.1-8b \
          --max-model-len 2048 --num-prompts 256 --input-len 1024 --output-len 128 "${flags[@]}" \
          --json-out "$out/w1-$q.json" 2>&1 | grep -E "^tandem|Error|error" | tail -1)
        line+="$q: $got; "
      done ;;
    peer256)
      line=$(timeout 300 python3 -m services.cli bench offline --model llama-3.1-8b \
        --max-model-len 2048 --num-prompts 256 --input-len 1024 --output-len 128 \
        --compare-transformers --batch-sizes 256 --json-out "$out/w1-peer256.json" 2>&1 |
        tee "$out/w1-peer256.txt" | grep -E "tok/s|speedup|Error|error" | tr '\n' ';') ;;
  esac
  summary+=("$step ($((SECONDS - start)) s): $line")
done
echo "=== summary"
printf '%s\n' "${summary[@]}"
