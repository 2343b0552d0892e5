#!/bin/bash
source scripts/device_env.sh
mkdir -p $OUT
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt
timeout 170 python -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_warmup.py tests/models/test_gpu_engine.py tests/models/test_weight_staging.py > $OUT/gpu_tests.log 2>&1; echo "tests rc=$?" >> $OUT/gpu_tests.log
tail -3 $OUT/gpu_tests.log
mkdir -p $OUT/files
OUT=$OUT/files timeout 380 python benchmarks/served_gpu.py --engines ember@.ab/head,ember,ember@.ab/head,ember --loads b1 --starts fresh,warm --weights files > $OUT/served_files.log 2>&1; echo "served rc=$?" >> $OUT/served_files.log
tail -40 $OUT/served_files.log
grep -h "start-up:\|beside the start-up\|read ahead" /tmp/served-gpu-*/*.log 2>/dev/null | head -40
