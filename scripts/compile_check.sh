#!/usr/bin/env bash
# Every Triton launch of the kernel and model tests, compiled for sm_90 without a GPU, with the
# GPU image's Triton (kernels.bench.compile_check): run before a lease, after kernel changes.
#   bash scripts/compile_check.sh [PYTEST_ARGS...]   (default: the kernel tests and the MoE,
#   DeepSeek and architecture parity tests that run the Triton kernels under the interpreter)
# Triton 3.6.0 (the GPU image's; this machine's venv may hold another) is installed once into
# .cache/triton-gpu-image with pip (no dependencies); the launches go to .cache/launches.json.
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
target=.cache/triton-gpu-image
if [[ ! -d $target/triton ]]; then
  $py -m pip install -q --no-deps --target "$target" triton==3.6.0
fi
args=("$@")
if [[ ${#args[@]} -eq 0 ]]; then
  args=(tests/kernels tests/services/engine/models/test_deepseek.py
        tests/services/engine/test_arch_parity.py tests/services/engine/quantization/test_experts.py)
fi
OMP_NUM_THREADS=1 TRITON_INTERPRET=1 $py -m kernels.bench.compile_check record \
  .cache/launches.json -- "${args[@]}" -q -p no:cacheprovider
PYTHONPATH="$PWD/$target:$PWD" TRITON_INTERPRET=0 $py -m kernels.bench.compile_check compile \
  .cache/launches.json
