#!/bin/bash
source scripts/device_env.sh
mkdir -p $OUT
timeout 60 python -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_warmup.py -k "beside" tests/models/test_weight_staging.py > $OUT/gpu_tests.log 2>&1; echo "tests rc=$?" >> $OUT/gpu_tests.log
tail -2 $OUT/gpu_tests.log
mkdir -p $OUT/files $OUT/cold
OUT=$OUT/files timeout 230 python benchmarks/served_gpu.py --engines ember@.ab/beside,ember,ember@.ab/head --loads b1 --starts fresh,warm --weights files > $OUT/served_files.log 2>&1; echo "served rc=$?" >> $OUT/served_files.log
grep -A3 "^| |" $OUT/served_files.log
for f in /tmp/served-gpu-*/*.log; do echo "== $f"; grep -h "start-up:\|beside the start-up\|dry run:" $f | cut -c1-250; done
rm -rf /tmp/served-gpu-*
OUT=$OUT/cold timeout 270 python benchmarks/served_gpu.py --engines ember,ember@.ab/head,ember@.ab/beside --loads b1 --starts fresh,warm --weights files --cold-weights --cold-libs > $OUT/served_cold.log 2>&1; echo "served rc=$?" >> $OUT/served_cold.log
grep -A3 "^| |" $OUT/served_cold.log
for f in /tmp/served-gpu-*/*.log; do echo "== $f"; grep -h "start-up:\|beside the start-up\|dry run:" $f | cut -c1-250; done
