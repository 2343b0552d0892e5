#!/usr/bin/env bash
# On a device machine: the quantized weights' GPU tests, their kernels' sweeps and
# benchmarks/quantized_gpu.py, each log and results file under $OUT.
# Usage: bash scripts/quant_gpu.sh [tests,probes,bench] [quantized_gpu.py args...]
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh
what=${1:-tests,probes,bench}; shift || true
status=0
if [[ $what == *tests* ]]; then
  timeout "${GPU_TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/kernels/test_int_gemm.py tests/kernels/test_fp8_gemm.py \
    tests/kernels/test_fused_moe_quant.py tests/models/test_quantized_gpu.py \
    > "$OUT/quant_gpu_tests.log" 2>&1
  status=$?
  grep -a "passed\|failed\|^FAILED" "$OUT/quant_gpu_tests.log" | tail -15
fi
if [[ $what == *probes* ]]; then
  for probe in int_gemv_sweep moe_int_decode_sweep; do
    [[ -f benchmarks/probes/$probe.py ]] || continue
    timeout "${PROBE_TIMEOUT:-150}" python3 "benchmarks/probes/$probe.py" > "$OUT/$probe.log" 2>&1
    status=$(( status || $? ))
    tail -25 "$OUT/$probe.log"
  done
fi
if [[ $what == *bench* ]]; then
  timeout "${BENCH_TIMEOUT:-330}" python3 benchmarks/quantized_gpu.py "$@" > "$OUT/quantized_gpu.log" 2>&1
  status=$(( status || $? ))
  grep -a -A40 "^GPU:" "$OUT/quantized_gpu.log"
fi
exit $status
