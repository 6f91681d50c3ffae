#!/usr/bin/env bash
# Issue #3's measurements in one run on one H100 (or any CUDA GPU): GPU kernel tests, GPU parity
# (8B logits, SmolLM2-shape greedy, SmolLM2 real weights when a GGUF is available), then W2
# (decode step latency), W1 (offline throughput vs transformers) and W3 (kernel roofline).
# JSON goes to $OUT (default ./gpu-out). Extra wheels (gguf) install from $WHEELS if given.
#   OUT=/tmp/out bash deploy/gpu_bench_h100.sh [w2|w1|w3|tests ...]   (default: all, in that order)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=$PWD:/tmp/site
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
steps=${*:-tests w2 w1 w3}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
for step in $steps; do
  echo "=== $step $(date +%T)"
  case $step in
    tests)
      python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_triton_attention.py tests/kernels/test_triton_decode.py tests/kernels/test_triton_layers.py tests/kernels/test_triton_gemv.py tests/kernels/test_ops.py 2>&1 | tail -3
      python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/services/engine/test_gpu_engine.py 2>&1 | grep -E "^\{|passed|failed|Error" ;;
    w2)
      python3 -m services.cli bench latency --model llama-3.1-8b --max-model-len 2048 --input-len 1024 \
        --output-len 24 --batch-sizes 1,64,256 --json-out "$OUT/w2.json" 2>&1 | grep -E "^batch|Error" ;;
    w1)
      python3 -m services.cli bench offline --model llama-3.1-8b --max-model-len 2048 --num-prompts 256 \
        --input-len 1024 --output-len 128 --compare-transformers --batch-sizes 64,128 --json-out "$OUT/w1.json" 2>&1 | grep -E "tok/s|speedup|fraction|Error" ;;
    w3)
      python3 -m services.cli bench kernels --json-out "$OUT/w3.json" 2>&1 | tail -12
      python3 -m kernels.bench_gemv --json-out "$OUT/gemv.json" 2>&1 | grep -v -i warn ;;
  esac
done
echo "=== done $(date +%T)"
