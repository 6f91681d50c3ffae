#!/usr/bin/env bash
# Download the wheels a bare GPU image lacks (for runs on a lent GPU machine that cannot reach
# PyPI): everything the gateway, the workers, `tandem up`, `tandem bench serve|disagg`, GGUF
# loading and structured output (xgrammar, pydantic) import, and the test-only imports of the
# GPU test runs (compressed-tensors, jsonschema: scripts/device/gpu_suite.sh), beyond what the
# image ships (torch, triton, transformers, tokenizers, grpcio, protobuf, numpy, httpx, anyio,
# h11, click, requests, uvloop, matplotlib, psutil, pyyaml, jinja2, prometheus-client, tqdm,
# typing-extensions: /work/.library/device/KINDS.md). One version of each,
# every Requires-Dist of these wheels already in the image; about 9 MB. Install them there with:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site
#
# Usage: scripts/device/device_wheels.sh [--check] [EXTRA==VERSION ...]
#   --check   then install them into a scratch --target and import each with $PYTHON (default
#             python3, which needs the image's packages: run it from the project's venv); the
#             compiled one (httptools, cp312) is imported only when $PYTHON is 3.12.
#   WHEEL_DIR=DIR downloads elsewhere than .whl (which is emptied first).
set -euo pipefail
cd "$(dirname "$0")/../.."
check=0
if [[ "${1:-}" == "--check" ]]; then
  check=1
  shift
fi
dir="${WHEEL_DIR:-.whl}"
rm -rf "$dir"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d "$dir" \
  grpcio-health-checking==1.73.1 grpcio-reflection==1.73.1 \
  starlette==1.10.0 uvicorn==0.54.0 httptools==0.9.0 \
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2 \
  gguf==0.19.0 xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 pydantic==2.14.3 pydantic-core==2.50.4 \
  annotated-types==0.8.0 typing-inspection==0.4.5 \
  compressed-tensors==0.20.0 loguru==0.7.3 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 \
  referencing==0.37.0 rpds-py==2026.9.1 "$@"
ls "$dir"
du -sh "$dir"
if [[ "$check" == 1 ]]; then
  py="${PYTHON:-python3}"
  site="$(mktemp -d)"
  trap 'rm -rf "$site"' EXIT
  if "$py" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
    wheels=("$dir"/*.whl)
  else
    wheels=("$dir"/*-none-any.whl)  # a cp312 wheel does not install for another Python
  fi
  "$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" "${wheels[@]}"
  PYTHONPATH="$PWD:$site" "$py" - <<'EOF'
import importlib, sys
names = ["starlette", "starlette.applications", "uvicorn", "opentelemetry.trace",
         "opentelemetry.sdk.trace", "opentelemetry.semconv.trace", "grpc_health.v1.health",
         "grpc_reflection.v1alpha.reflection", "gguf", "gateway.http.app", "deploy.launcher"]
if sys.version_info[:2] == (3, 12):  # compiled wheels
    names += ["httptools", "pydantic", "xgrammar", "services.engine.structured"]
for name in names:
    module = importlib.import_module(name)
    print(f"ok {name} ({getattr(module, '__file__', '')})")
EOF
fi
