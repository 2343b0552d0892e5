#!/usr/bin/env bash
# On a device machine: the KV tiers' GPU tests and measurements, each log and results file under
# $OUT (one folder a run). tests: every GPU test under tests/kv; served: decode TPOT and ready time
# with the host tier on and off (its pinning runs beside weight loading and the first requests);
# probe: start-up work beside the pinning (benchmarks/probes/pinning_beside_start.py); agents:
# agent sessions over a capped pool (ember with a 32 GiB host tier, as vLLM's offload, and with
# no tier). SERVED_ENGINES: served_gpu.py's engines (variants VARIANT@DIR included); AGENT_RUNS:
# agent_sessions.py's runs, `;` between them (each: engine and options); AGENT_TREE: a tree whose
# ember package they run (as a VARIANT@DIR's).
# Usage: bash scripts/tiers_gpu.sh [tests,served,probe,agents]
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh
what=${1:-tests,served,agents}
status=0
if [[ $what == *tests* ]]; then
  timeout "${GPU_TEST_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/kv \
    > "$OUT/tiers_gpu_tests.log" 2>&1
  status=$?
  grep -a "passed\|failed\|^FAILED\|Error" "$OUT/tiers_gpu_tests.log" | tail -15
fi
if [[ $what == *served* ]]; then
  mkdir -p "$OUT/served"
  OUT=$OUT/served timeout "${SERVED_TIMEOUT:-240}" python3 benchmarks/served_gpu.py \
    --engines "${SERVED_ENGINES:-ember,ember-no-host-tier}" --loads b1,batches --starts fresh --weights files \
    > "$OUT/served_host_tier.log" 2>&1
  status=$(( status || $? ))
  grep -a -A20 "^## " "$OUT/served_host_tier.log" || tail -30 "$OUT/served_host_tier.log"
  cp /tmp/served-gpu-*/*.log "$OUT/served/" 2>/dev/null
  rm -rf /tmp/served-llama-* /tmp/served-gpu-*  # its 16 GB of weight files: the disk is for the next run
fi
if [[ $what == *probe* ]]; then
  timeout "${PROBE_TIMEOUT:-150}" python3 benchmarks/probes/pinning_beside_start.py \
    > "$OUT/pinning_beside_start.log" 2>&1
  status=$(( status || $? ))
  tail -8 "$OUT/pinning_beside_start.log"
fi
if [[ $what == *agents* ]]; then
  IFS=';' read -ra runs <<< "${AGENT_RUNS:-ember --host-gb 32 --sessions 16;ember-no-tier --sessions 8,16}"
  for run in "${runs[@]}"; do
    name=${run%% *}
    mkdir -p "$OUT/$name"
    # shellcheck disable=SC2086
    PYTHONPATH=${AGENT_TREE:+$PWD/$AGENT_TREE:}$PYTHONPATH OUT=$OUT/$name timeout "${AGENTS_TIMEOUT:-200}" python3 benchmarks/agent_sessions.py \
      --engines $run > "$OUT/agents_$name.log" 2>&1
    status=$(( status || $? ))
    tail -12 "$OUT/agents_$name.log"
  done
fi
exit $status
