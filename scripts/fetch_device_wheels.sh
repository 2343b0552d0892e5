#!/usr/bin/env bash
# Run here (not on the device machine): download the pure-Python and manylinux wheels that the
# device machines lack (Python 3.12, no network there) into .whl/, which scripts/gpu_checks.sh
# installs. Keep .whl/ out of git: `echo /.whl/ >> .git/info/exclude`.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
for pkg in msgspec==0.22.0 llguidance==1.9.1 pyzmq==27.3.0 pytest==9.2.0 pluggy iniconfig pygments packaging \
           hypothesis==6.170.17 sortedcontainers attrs; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_26_x86_64 --platform any -d .whl "$pkg"
done
ls .whl
