set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/lent_env.sh
echo "=== tests $(date +%T)"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_quant.py 2>&1 | tail -2
echo "=== bench $(date +%T)"
timeout 300 python3 -c "
import kernels.bench.w4_unpack as w
w.LAUNCHES = [(16, 1024, 8, 1), (32, 512, 8, 1), (16, 2048, 16, 1), (8, 2048, 8, 1), (16, 512, 8, 1), (16, 512, 4, 1), (32, 1024, 8, 1), (8, 1024, 4, 1)]
w.main(['--rows', '1', '--json-out', '$out/w4-ahead.json'])" 2>&1 | tail -40
echo "=== latency $(date +%T)"
W4_LATENCY="awq awq-ahead2 awq awq-ahead2" W4_BATCHES="1,2" bash scripts/device/w4_gemv.sh latency 2>&1 | tail -12
