# Sourced by the lent-GPU scripts after they cd to the repository root: $out (the results
# folder, $OUT on the lent machine or ./gpu-out), the wheels of .whl (device_wheels.sh) on
# PYTHONPATH, and the GPU's name and driver in the log.
out="${OUT:-$PWD/gpu-out}"
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
