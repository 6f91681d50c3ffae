#!/usr/bin/env bash
# The kernel tests compiled on the lent GPU (TRITON_INTERPRET=0: every test of tests/kernels
# runs its edge cases on the GPU against the torch reference, and the `gpu`-marked ones run),
# then the GPU tests of the services (the engine's graphs, waits and warm-up, the int4 and FP8
# layers, LoRA graphs, the KV transfer on one GPU). Each group is its own pytest-xdist run
# (the image has pytest-xdist and pytest-timeout; the kernels compile on the host's cores) with
# its own time limit, so a group that runs out loses only itself; failures and the slowest tests
# are written under $out, a line a group last.
#   bash scripts/device/gpu_suite.sh [group,...] [LABEL]   groups: moe, attention, rest, services
# Needs .whl (device_wheels.sh) and .gpu-carry/tok.tgz (the test tokenizer: the embedded
# model's tokenizer files, for the tests that build tiny checkpoints).
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/lent_env.sh
tar xzf .gpu-carry/tok.tgz -C .gpu-carry && export TANDEM_TEST_TOKENIZER=$PWD/.gpu-carry/tok
stages="${1:-moe,attention,rest,services}"
label="${2:-run}"
K=tests/kernels
declare -A groups=(
  [moe]="$K/test_triton_moe.py $K/test_triton_moe_pairs.py $K/test_moe.py $K/test_triton_routing.py
         $K/test_triton_quant.py $K/test_quant.py $K/test_triton_gemv.py $K/test_triton_lora.py"
  [attention]="$K/test_triton_prefill.py $K/test_triton_varlen.py $K/test_triton_decode.py
               $K/test_triton_mla.py $K/test_triton_attention.py $K/test_attention.py
               $K/test_fp8_kv.py"
  [rest]="$K/test_triton_layers.py $K/test_triton_block_copy.py $K/test_triton_checksum.py
          $K/test_triton_common.py $K/test_ops.py $K/test_pdl.py $K/test_no_name_clash.py"
  [services]="-m gpu tests/services tests/kvtransfer"
)
lines=()
for group in moe attention rest services; do
  has "$group" || continue
  echo "=== $group $(date +%T)"
  start=$SECONDS
  # shellcheck disable=SC2086  # the group's paths split on purpose
  TRITON_INTERPRET=0 timeout 280 python3 -m pytest -q -p no:cacheprovider -n 8 --timeout 240 \
    --tb=short -rfE --durations=8 --junitxml "$out/$label-$group.xml" ${groups[$group]} \
    > "$out/$label-$group.txt" 2>&1
  rc=$?
  grep -E "^(FAILED|ERROR) " "$out/$label-$group.txt" | head -20
  lines+=("$group rc=$rc $((SECONDS - start)) s: $(tail -1 "$out/$label-$group.txt")")
done
printf '%s\n' "${lines[@]}" | tee "$out/$label-summary.txt"
