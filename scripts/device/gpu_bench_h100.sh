#!/usr/bin/env bash
# Issues #3 and #7's single-GPU measurements on one H100 (or any CUDA GPU), one step after another:
#   w2      decode step latency (batch 1, 64, 256 at context 1024)            -> $RESULTS/w2.json
#   w1      offline throughput against transformers generate (own process each) -> $RESULTS/w1.json
#   w3      kernel roofline (attention, element-wise, GEMV)                    -> $RESULTS/w3.json, gemv.json
#   kernels the kernel tests with compiled kernels (every edge case of the interpreter tests)
#   parity  GPU parity: 8B logits, SmolLM2-shape greedy, SmolLM2 real weights when the GGUF is
#           here (scripts/device/device_gguf.sh carries it in two calls)   -> $RESULTS/gpu_*.json
#   report  the bf16 parity analysis on real weights (services.engine.bench.parity_report)
#                                                                              -> $RESULTS/parity.json
#   study   exact greedy agreement over 56 prompts, ours and transformers' own variants against
#           transformers bf16 (services.engine.bench.parity_study)             -> $RESULTS/study.json
#   w6      the HTTP + gRPC path against the in-process engine (tandem bench disagg)  -> $RESULTS/w6/
#   tune    the prefill attention tile sweep (kernels.bench.tune prefill)
#   quant   issue 20's decode steps: FP8 weights at batch 1 and 8, AWQ at batch 1 and 2 (8B shape,
#           dummy weights, context 512, each in its own process)   -> $RESULTS/quant-{fp8,awq}.json
#   w1fp8   issue 20's W1 side by side, each in its own process: bf16, FP8 weights, FP8 weights
#           and an FP8 KV cache                                 -> $RESULTS/w1-{bf16,fp8,fp8kv}.json
# The bars issues 20 and 23 still hold open name an H100; a lent machine runs a command for at
# most 600 s, so in two calls, most wanted first (on an H200 a latency run takes ~35 s, an
# offline W1 ~60 s, the transformers peer's three batch sizes a few minutes):
#   bash scripts/device/gpu_bench_h100.sh w2 quant w1fp8    then    ... w1 w3
# Results go to $RESULTS (default ./gpu-out); with $OUT set (a lent GPU machine, which returns
# at most 8 files) they are also packed into $OUT/results.tar.gz after every step. Wheels the
# image lacks install from ./.whl when present (scripts/device/device_wheels.sh). Each step has
# its own time limit, so one hang cannot eat the run.
#   bash scripts/device/gpu_bench_h100.sh [step ...]   (default: w2 w1 w3 kernels parity)
set -uo pipefail
cd "$(dirname "$0")/../.."
RESULTS=${RESULTS:-$PWD/gpu-out}
mkdir -p "$RESULTS"
pack() {
  if [ -n "${OUT:-}" ]; then tar czf "$OUT/results.tar.gz" -C "$RESULTS" .; fi
}
export PYTHONPATH=$PWD
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=$PWD:/tmp/site
fi
gguf=$(bash scripts/device/device_gguf.sh assemble 2>/dev/null || true)
if [ -n "$gguf" ]; then
  export TANDEM_EMBEDDED_GGUF=$gguf
  echo "embedded GGUF: $gguf"
fi
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
steps=${*:-w2 w1 w3 kernels parity}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$RESULTS/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$RESULTS/gpu.txt"
for step in $steps; do
  echo "=== $step $(date +%T)"
  case $step in
    w2)
      timeout 240 python3 -m services.cli bench latency --model llama-3.1-8b --max-model-len 2048 \
        --input-len 1024 --output-len 24 --batch-sizes 1,64,256 --json-out "$RESULTS/w2.json" 2>&1 |
        grep -E "^batch|Error|error" ;;
    w1)
      # the transformers peer first, each batch size in its own fresh process, then our engine
      timeout 560 python3 -m services.cli bench offline --model llama-3.1-8b --max-model-len 2048 \
        --num-prompts 256 --input-len 1024 --output-len 128 --compare-transformers \
        --batch-sizes 64,128,256 --json-out "$RESULTS/w1.json" 2>&1 | grep -E "tok/s|speedup|Error|error" ;;
    w3)
      timeout 200 python3 -m services.cli bench kernels --json-out "$RESULTS/w3.json" 2>&1 | tail -14
      timeout 100 python3 -m kernels.bench.gemv --json-out "$RESULTS/gemv.json" 2>&1 | grep -v -i warn ;;
    kernels)
      timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kernels 2>&1 | tail -4 ;;
    parity)
      OUT=$RESULTS timeout 300 python3 -m pytest -q -s -p no:cacheprovider -m gpu \
        tests/services/engine/test_gpu_engine.py 2>&1 | grep -E "^\{|passed|failed|Error|SKIP" ;;
    report)
      timeout 400 python3 -m services.engine.bench.parity_report --json-out "$RESULTS/parity.json" 2>&1 |
        grep -E "^\{|Error|error" ;;
    study)
      timeout 500 python3 -m services.engine.bench.parity_study --json-out "$RESULTS/study.json" 2>&1 |
        grep -E "^\{|Error|error" ;;
    w6)
      timeout 420 python3 -m services.cli bench disagg --model llama-3.1-8b --max-model-len 2048 \
        --gpus 0 --topologies none --gateway-overhead --workloads 1024:128 \
        --overhead-num-prompts 256 --time-budget-s 400 --out-dir "$RESULTS/w6" 2>&1 |
        grep -E "W6|Error|error|failed" ;;
    tune)
      timeout 200 python3 -m kernels.bench.tune prefill 2>&1 | grep -v -i warn ;;
    quant)
      for q in fp8 awq; do
        batches=1,8; [ "$q" = awq ] && batches=1,2
        timeout 240 python3 -m services.cli bench latency --model llama-3.1-8b --load-format dummy \
          --dtype bfloat16 --quantization "$q" --batch-sizes "$batches" --input-len 512 \
          --output-len 32 --max-model-len 2048 --json-out "$RESULTS/quant-$q.json" 2>&1 |
          grep -E "^batch|Error|error"
      done ;;
    w1fp8)
      for v in bf16 fp8 fp8kv; do
        extra=(); [ "$v" != bf16 ] && extra=(--quantization fp8)
        [ "$v" = fp8kv ] && extra+=(--kv-cache-dtype fp8)
        timeout 300 python3 -m services.cli bench offline --model llama-3.1-8b --load-format dummy \
          --dtype bfloat16 "${extra[@]}" --max-model-len 2048 --num-prompts 256 --input-len 1024 \
          --output-len 128 --json-out "$RESULTS/w1-$v.json" 2>&1 | grep -E "tok/s|Error|error"
      done ;;
  esac
  pack
done
echo "=== done $(date +%T)"
