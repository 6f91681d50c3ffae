#!/usr/bin/env bash
# The runs that need two GPUs of one host (nvidia-h200-x2), stage by stage, each under its own
# time limit, skipped when the call's time left (BUDGET_S, default 560 s) would not hold it:
#   smoke    GPUs, their links (nvidia-smi topo -m), an NCCL all-reduce
#   tests    the GPU tests of the KV transfer, of disaggregation (their two-GPU cases) and of a
#            tensor-parallel rank killed while decoding (NCCL abort)
#   tpfam    the CPU tests of tensor parallelism per model family, here on two GPUs (NCCL, CUDA
#            graphs, the compiled kernels): Gemma 3, Mixtral, Qwen3-MoE, Qwen3, FP8/AWQ/GPTQ
#            checkpoints, vision-language, LoRA (against peft), a draft model on rank 0
#   interf   python -m kvtransfer.bench.interference: what a receive pending or streaming over
#            NCCL costs a decode step's GEMMs on the GPU it lands on, per NCCL max_ctas
#   w5       python -m kvtransfer.bench.transfer: GPU 0 -> GPU 1 over NCCL, 1024/4096 tokens of the
#            8B shape (whole transfers, chunk sizes, the tail a layer-by-layer transfer leaves;
#            TIMELINE=1: where each transfer's time goes, kvtransfer.bench.timeline)
#   tp       scripts/device/tp_workers.py on the float32 checkpoint $TINY (offline TP 2 == TP 1,
#            `tandem up --gpus 0,1` with TP on either side and colocated, a follower killed)
#   parity   services.engine.bench.tp_parity: 8B shape, random weights, bf16, TP 2 against TP 1
#   real     the same on the embedded model's real weights and chat prompts (the GGUF assembled
#            by scripts/device/device_gguf.sh: carry .gguf-a with one call, .gguf-b the next)
#   tpdiag   bench latency at TP 2 only, every rank's stacks dumped if it is not done in 90 s
#   w2       bench latency, 8B shape, batch 1 and 64 at TP 1 and TP 2 (each its own process)
#   w1       bench offline W1 (256 x 1024 -> 128) at TP 1 and TP 2 (each its own process)
#   w4       tandem bench disagg --gpus 0,1: W4_TOPOLOGIES at W4_WORKLOAD and W4_RATES
# Writes raw files under $out/raw, packs them into $out/raw.tgz, prints a table last.
#   bash scripts/device/two_gpus.sh smoke,w5,tp,parity,w2     (carry .whl and .gpu-carry)
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/lent_env.sh
# NVLink multicast stays off here and in every process started from here (KINDS.md)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
stages="${1:-smoke,w5,tp,parity,w2}"
budget="${BUDGET_S:-560}"
tiny="${TINY:-.gpu-carry/tiny-llama}"
raw="$out/raw"
mkdir -p "$raw"
table=()
left() { echo $((budget - SECONDS)); }
# stage NAME LIMIT: true when the stage fits in the time left (else records it as skipped)
stage() {
  if (($(left) < $2)); then
    table+=("$1 | skipped: $(left) s left, needs $2")
    return 1
  fi
  echo "== $1 (+${SECONDS}s)" >&2
  return 0
}
row() { table+=("$1 | $2 | $((SECONDS - $3)) s"); }
# what a stage cut short by its time limit may leave: `tandem up` and its workers
reap() {
  pkill -TERM -f "services\.cli (up|prefill|decode|worker|gateway)" && sleep 5
  pkill -KILL -f "services\.cli (up|prefill|decode|worker|gateway)|tp_follower"
  return 0
}

if has smoke && stage smoke 30; then
  t=$SECONDS
  cat >/tmp/nccl_smoke.py <<'EOF'
import torch, torch.multiprocessing as mp, torch.distributed as dist
def f(rank):
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", rank=rank, world_size=2)
    x = torch.full((1 << 20,), float(rank + 1), device=f"cuda:{rank}")
    dist.all_reduce(x)
    assert float(x[0]) == 3.0
    dist.destroy_process_group()
if __name__ == "__main__":
    print("torch", torch.__version__, "gpus", torch.cuda.device_count(), "nccl", torch.cuda.nccl.version())
    mp.spawn(f, nprocs=2)
    print("nccl all-reduce ok")
EOF
  { nvidia-smi -L; nvidia-smi topo -m; python3 /tmp/nccl_smoke.py; } >"$raw/smoke.txt" 2>&1
  row smoke "$(grep -c GPU "$raw/smoke.txt") lines; $(tail -1 "$raw/smoke.txt")" "$t"
fi

if has tests && stage tests 160; then
  t=$SECONDS
  TANDEM_TEST_TOKENIZER=$tiny TRITON_INTERPRET=0 timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/kvtransfer/test_gpu.py tests/services/test_gpu_disagg.py \
    tests/services/engine/test_tp_ranks.py ${TESTS_ARGS:-} >"$raw/tests.txt" 2>&1
  row tests "rc $? $(tail -1 "$raw/tests.txt")" "$t"
fi

if has tpfam && stage tpfam 300; then
  t=$SECONDS
  e=tests/services/engine
  gguf=$(bash scripts/device/device_gguf.sh assemble)  # the LoRA case's base model
  export TANDEM_EMBEDDED_GGUF=${gguf:-/nonexistent}
  TANDEM_TEST_TOKENIZER=$tiny TRITON_INTERPRET=0 timeout 290 python3 -m pytest -q -p no:cacheprovider \
    $e/test_tp_parity.py $e/quantization/test_tensor_parallel.py \
    $e/test_vl_parity.py::test_two_ranks_give_the_tokens_of_one \
    $e/test_lora.py::test_two_ranks_serve_the_adapters_as_peft_does \
    $e/test_speculative_draft.py::test_a_tensor_parallel_target_takes_drafts_from_a_draft_on_rank_zero \
    -k "not embedded" ${TPFAM_ARGS:-} >"$raw/tpfam.txt" 2>&1
  row tpfam "rc $? $(tail -1 "$raw/tpfam.txt")" "$t"
  grep -E "^(FAILED|ERROR)" "$raw/tpfam.txt" >&2
fi

if has interf && stage interf 150; then
  t=$SECONDS
  timeout 140 python3 -m kvtransfer.bench.interference ${INTERF_ARGS:-} \
    --json-out "$raw/interference.json" >"$raw/interference.txt" 2>&1
  row interf "rc $? $(grep -c '^|' "$raw/interference.txt") rows" "$t"
  cat "$raw/interference.txt" >&2
fi

if has w5 && stage w5 150; then
  t=$SECONDS
  TANDEM_KV_TIMELINE=${TIMELINE:-0} timeout 140 python3 -m kvtransfer.bench.transfer --tokens 1024 4096 --ttft-tokens 1024 4096 \
    --iters 10 --chunk-mb 8 32 4096 --skip-same-gpu --json-out "$raw/w5.json" >"$raw/w5.txt" 2>&1
  row w5 "rc $? $(grep -E "e2e|landed" "$raw/w5.txt" | head -3 | tr -s ' ' | tr '\n' ';' | cut -c1-200)" "$t"
fi

if has tpdiag && stage tpdiag 110; then
  # TP 2 under CUDA graphs, traced: faulthandler stacks of every rank if it is not done in 90 s
  t=$SECONDS
  PYTHONFAULTHANDLER=1 TANDEM_LOG_LEVEL=INFO python3 -m services.cli bench latency --model llama-3.1-8b \
    --load-format dummy --dtype bfloat16 --tensor-parallel-size 2 --batch-sizes 1,64 --input-len 512 \
    --output-len 32 --max-model-len 1024 --json-out "$raw/w2-tp2.json" >"$raw/w2-tp2.txt" 2>&1 &
  pid=$!
  for _ in $(seq 90); do kill -0 $pid 2>/dev/null || break; sleep 1; done
  if kill -0 $pid 2>/dev/null; then
    pkill -ABRT -f tp_follower; sleep 2; kill -ABRT $pid; sleep 3; kill -9 $pid 2>/dev/null
  fi
  wait $pid
  row tpdiag "rc $? $(grep -E '^batch' "$raw/w2-tp2.txt" | tr '\n' ';')" "$t"
fi

if has parity && stage parity 160; then
  t=$SECONDS
  timeout 150 python3 -m services.engine.bench.tp_parity --model llama-3.1-8b --load-format dummy \
    --sizes 2 --prompts 24 --longest 700 --json-out "$raw/tp_parity_8b.json" >"$raw/tp_parity_8b.txt" 2>&1
  row parity "rc $? $(grep '^TP 2' "$raw/tp_parity_8b.txt" | cut -c1-220)" "$t"
fi

if has real && stage real 120; then
  t=$SECONDS
  gguf=$(bash scripts/device/device_gguf.sh assemble)
  if [ -z "$gguf" ]; then
    row real "the GGUF's two parts are not both here" "$t"
  else
    TANDEM_EMBEDDED_GGUF=$gguf timeout 110 python3 -m services.engine.bench.tp_parity --model embedded \
      --load-format auto --chat-prompts --prompts 56 --sizes 2 --json-out "$raw/tp_parity_real.json" \
      >"$raw/tp_parity_real.txt" 2>&1
    row real "rc $? $(grep '^TP 2' "$raw/tp_parity_real.txt" | cut -c1-220)" "$t"
  fi
elif has stash || has tpfam; then
  bash scripts/device/device_gguf.sh stash
fi

if has w2; then
  for tp in 1 2; do
    stage "w2 tp$tp" 90 || continue
    t=$SECONDS
    timeout 85 python3 -m services.cli bench latency --model llama-3.1-8b --load-format dummy \
      --dtype bfloat16 --tensor-parallel-size "$tp" --batch-sizes 1,64 --input-len 512 \
      --output-len 32 --max-model-len 1024 --json-out "$raw/w2-tp$tp.json" >"$raw/w2-tp$tp.txt" 2>&1
    row "w2 tp$tp" "rc $? $(grep -E '^batch' "$raw/w2-tp$tp.txt" | tr '\n' ';')" "$t"
  done
fi

if has w1; then
  for tp in 1 2; do
    stage "w1 tp$tp" 120 || continue
    t=$SECONDS
    timeout 115 python3 -m services.cli bench offline --model llama-3.1-8b --max-model-len 2048 \
      --tensor-parallel-size "$tp" --num-prompts 256 --input-len 1024 --output-len 128 \
      --json-out "$raw/w1-tp$tp.json" >"$raw/w1-tp$tp.txt" 2>&1
    row "w1 tp$tp" "rc $? $(grep -E '^tandem' "$raw/w1-tp$tp.txt" | tail -1)" "$t"
  done
fi

if has tp && stage tp 230; then
  t=$SECONDS
  timeout 220 python3 scripts/device/tp_workers.py "$tiny" >"$raw/tp_workers.jsonl" 2>"$raw/tp_workers.err"
  rc=$?
  reap
  row tp "rc $rc; ok $(grep -c '"ok": true' "$raw/tp_workers.jsonl") of $(grep -c '"ok"' "$raw/tp_workers.jsonl"); $(grep -o '"after_kill".*' "$raw/tp_workers.jsonl" | cut -c1-120)" "$t"
fi

if has w4 && stage w4 200; then
  t=$SECONDS
  w4_budget=$(($(left) - 25))
  timeout $((w4_budget + 15)) python3 -m services.cli bench disagg --model llama-3.1-8b \
    --max-model-len 4608 --gpus 0,1 --topologies "${W4_TOPOLOGIES:-colocated,disagg,disagg-whole}" \
    --workloads "${W4_WORKLOAD:-1024:128}" --rates "${W4_RATES:-4,8,16,32}" \
    --num-prompts "${W4_PROMPTS:-200}" --duration-s "${W4_DURATION_S:-20}" \
    --time-budget-s "$w4_budget" ${W4_EXTRA:-} --out-dir "$raw/w4" >"$raw/w4.txt" 2>&1
  row w4 "rc $? $(grep -c 'failed' "$raw/w4.txt") lines naming failures" "$t"
  reap
  tail -45 "$raw/w4.txt"
fi

# nothing of ours may be left running
left_over=$(pgrep -f "services\.(cli|engine|worker)|gateway\.|tp_follower" | grep -v $$ | wc -l)
table+=("processes left | $left_over")
tar -C "$out" -czf "$out/raw.tgz" raw && rm -rf "$raw"
printf '%s\n' "${table[@]}" | tee "$out/table.txt"
