#!/usr/bin/env bash
# Download the pure-Python wheels a bare GPU image lacks (for runs on a lent GPU machine that
# cannot reach PyPI). Install them there with:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
  grpcio-health-checking==1.73.1 grpcio-reflection==1.73.1 "$@"
ls .whl
