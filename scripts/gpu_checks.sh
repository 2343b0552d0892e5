#!/usr/bin/env bash
# On a device machine: install the carried wheels, run every GPU test, then (optionally) the
# engine benchmark. Usage: bash scripts/gpu_checks.sh [tests|bench|all] [bench args...]
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh
what=${1:-all}; shift || true
status=0
if [[ $what == tests || $what == all ]]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  timeout "${GPU_TEST_TIMEOUT:-900}" python3 -m pytest -q -p no:cacheprovider --durations=25 -m gpu tests/kernels tests/engine/test_sampler.py \
    tests/models/test_gpu_engine.py tests/engine/test_async_scheduling.py tests/engine/test_speculative.py tests/engine/test_warmup.py tests/kv/test_engine_tiers_gpu.py \
    tests/engine/test_piecewise_graphs.py tests/engine/test_prompt_logprobs.py 2>&1 | tee "$OUT/gpu_tests.log"
  status=${PIPESTATUS[0]}
fi
if [[ $what == bench || $what == all ]]; then
  python3 benchmarks/engine_gpu.py "$@" 2>&1 | tee "$OUT/engine_gpu.log"
  status=$(( status || PIPESTATUS[0] ))
fi
exit $status
