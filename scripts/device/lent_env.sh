# Sourced by the lent-GPU scripts after they cd to the repository root: $out (the results
# folder, $OUT on the lent machine or ./gpu-out), the wheels of .whl (device_wheels.sh) on
# PYTHONPATH, compiled (not interpreted) Triton kernels, unbuffered Python output, and the
# GPU's name and driver and the torch and triton versions in the log.
out="${OUT:-$PWD/gpu-out}"
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0  # the lent GPU compiles the kernels
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

# latency_run LABEL PATCH ARGS...: `tandem bench latency` of Llama-3.1-8B's shape (dummy bf16
# weights, --max-model-len 2048) with ARGS, in a process of its own that runs the Python PATCH
# first; its JSON and log in $out/latency-LABEL.*, then a line a batch: label, batch, step ms,
# graph replay ms, floor ms
latency_run() {
  local label=$1 patch=$2
  shift 2
  timeout 240 python3 -c "import sys; $patch
from services.cli import main; sys.exit(main(sys.argv[1:]))" bench latency --model llama-3.1-8b \
    --load-format dummy --dtype bfloat16 "$@" --max-model-len 2048 \
    --json-out "$out/latency-$label.json" > "$out/latency-$label.log" 2>&1
  python3 -c "import json, sys; [print(sys.argv[2], r['batch'], round(r['step_ms'], 3),
    round(r['graph_replay_ms'] or 0, 3), round(r['floor_ms'], 3)) for r in
    json.load(open(sys.argv[1]))['rows']]" "$out/latency-$label.json" "$label" ||
    tail -5 "$out/latency-$label.log"
}

# has STAGE: whether STAGE is one of the comma-separated $stages the script was asked for
has() { [[ ",${stages:-}," == *",$1,"* ]]; }
