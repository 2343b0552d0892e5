#!/usr/bin/env bash
# On a device machine: install the carried wheels, run every GPU test, then (optionally) the
# engine benchmark. Every test marked `gpu` runs, wherever it lives. Usage: bash scripts/gpu_checks.sh [tests|bench|all] [bench args...]
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh
what=${1:-all}; shift || true
status=0
if [[ $what == tests || $what == all ]]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  timeout "${GPU_TEST_TIMEOUT:-900}" python3 -m pytest -q -p no:cacheprovider --durations=25 -m gpu tests 2>&1 | tee "$OUT/gpu_tests.log"
  status=${PIPESTATUS[0]}
fi
if [[ $what == bench || $what == all ]]; then
  python3 benchmarks/engine_gpu.py "$@" 2>&1 | tee "$OUT/engine_gpu.log"
  status=$(( status || PIPESTATUS[0] ))
fi
exit $status
