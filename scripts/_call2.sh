#!/bin/bash
source scripts/device_env.sh
mkdir -p $OUT
timeout 100 python -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_warmup.py -k "beside or mixed_workload or probe" > $OUT/gpu_tests.log 2>&1; echo "tests rc=$?" >> $OUT/gpu_tests.log
tail -3 $OUT/gpu_tests.log
mkdir -p $OUT/cold
OUT=$OUT/cold timeout 450 python benchmarks/served_gpu.py --engines ember,ember@.ab/head,ember,ember@.ab/head --loads b1 --starts fresh,warm --weights files --cold-weights --cold-libs > $OUT/served_cold.log 2>&1; echo "served rc=$?" >> $OUT/served_cold.log
grep -A8 "^| |" $OUT/served_cold.log
for f in /tmp/served-gpu-*/*.log; do echo "== $f"; grep -h "start-up:\|beside the start-up\|read ahead\|dry run:" $f | cut -c1-300; done
