#!/usr/bin/env bash
# On the one lent GPU: the GPU tests of the code the tensor-parallel engine changed (the model
# runner's planned steps with CUDA graphs, the MoE kernels' expert-parallel build, quantized
# models at one rank), then one engine's batch-1 decode through `ember serve` (the planned
# step's host cost), each log under $OUT. Usage: bash scripts/parallel_gpu_checks.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh
status=0
timeout "${GPU_TEST_TIMEOUT:-360}" python3 -m pytest -q -p no:cacheprovider -m gpu -x \
  tests/engine tests/kernels/test_fused_moe.py tests/kernels/test_fused_moe_quant.py \
  tests/models/test_quantized_gpu.py > "$OUT/parallel_gpu_tests.log" 2>&1
status=$?
grep -a "passed\|failed\|^FAILED\|^ERROR" "$OUT/parallel_gpu_tests.log" | tail -12
timeout "${SERVED_TIMEOUT:-150}" python3 benchmarks/served_gpu.py --shape llama --engines ember \
  --loads b1 --starts fresh > "$OUT/served_llama_b1.log" 2>&1
status=$(( status || $? ))
grep -a -A6 "^## " "$OUT/served_llama_b1.log" || tail -20 "$OUT/served_llama_b1.log"
exit $status
