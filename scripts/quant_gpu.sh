#!/usr/bin/env bash
# On a device machine: the quantized weights' GPU tests, their kernels' sweeps,
# benchmarks/quantized_gpu.py, and ember beside vLLM on the same quantized config.json
# (served-moonlight: Moonlight in Kimi K2.5's INT4 scheme; served-kimi: Kimi K2's dims in FP8
# blocks, 5 layers; both need vLLM unpacked: scripts/vllm_device_env.sh), each log and results
# file under $OUT. WEIGHTS=files: served-moonlight from random weights written as files (both
# servers' routers then spread the tokens; vLLM's dummy weights send them all to the same few);
# served-kimi too (KIMI_LAYERS=2: its files, ~17 GB a layer, fit the machine's disk).
# Usage: bash scripts/quant_gpu.sh [tests,probes,bench,served-moonlight,served-kimi] [quantized_gpu.py args...]
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh
what=${1:-tests,probes,bench}; shift || true
status=0
if [[ $what == *tests* ]]; then
  timeout "${GPU_TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/kernels/test_int_gemm.py tests/kernels/test_fp8_gemm.py \
    tests/kernels/test_fused_moe_quant.py tests/kernels/test_fused_moe_foreign.py \
    tests/models/test_quantized_gpu.py \
    > "$OUT/quant_gpu_tests.log" 2>&1
  status=$?
  grep -a "passed\|failed\|^FAILED" "$OUT/quant_gpu_tests.log" | tail -15
fi
if [[ $what == *probes* ]]; then
  for probe in ${PROBES:-int_gemv_sweep moe_int_decode_sweep fp8_decode_sweep}; do
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
if [[ $what == *served-moonlight* ]]; then
  timeout "${SERVED_TIMEOUT:-560}" python3 benchmarks/served_gpu.py --shape moonlight \
    --quant k25-int4 --engines ember,vllm --loads mixed,b1 --starts fresh \
    --weights "${WEIGHTS:-dummy}" \
    > "$OUT/served_moonlight_int4.log" 2>&1
  status=$(( status || $? ))
  grep -a -A30 "^## " "$OUT/served_moonlight_int4.log" || tail -30 "$OUT/served_moonlight_int4.log"
fi
if [[ $what == *served-kimi* ]]; then
  timeout "${SERVED_TIMEOUT:-560}" python3 benchmarks/served_gpu.py --shape kimi_k2 \
    --quant fp8-blocks --layers "${KIMI_LAYERS:-5}" --engines ember,vllm --loads b1,batches \
    --starts fresh --weights "${WEIGHTS:-dummy}" > "$OUT/served_kimi_fp8.log" 2>&1
  status=$(( status || $? ))
  grep -a -A30 "^## " "$OUT/served_kimi_fp8.log" || tail -30 "$OUT/served_kimi_fp8.log"
fi
exit $status
