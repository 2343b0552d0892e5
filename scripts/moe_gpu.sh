#!/usr/bin/env bash
# On a GPU machine (carry .whl): the MoE and MLA GPU tests, and the engine benchmark of MoE/MLA
# model shapes.
#   TESTS=1 bash scripts/moe_gpu.sh moonlight   # the GPU tests, then the shape(s) named
# Results go to $OUT: moe_gpu_tests.log, engine_gpu-<GPU>.json and engine_gpu.log.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [[ ${TESTS:-0} == 1 ]]; then
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/kernels/test_fused_moe.py tests/attention/test_mla.py tests/kernels/test_mla_decode.py \
    tests/models/test_gpu_engine.py -k "${TEST_K:-moe or mla or deepseek}" 2>&1 \
    | tee "$OUT/moe_gpu_tests.log" | tail -15
fi
[[ -n ${1:-} ]] || exit 0
timeout "${BENCH_TIMEOUT:-420}" python3 benchmarks/engine_gpu.py --shapes "$1" --skip-hf \
  ${BENCH_ARGS:-} 2>&1 | tee "$OUT/engine_gpu.log" | tail -40
