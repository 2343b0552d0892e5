#!/usr/bin/env bash
# Run here (not on the device machine): download the pure-Python and manylinux wheels that the
# device machines lack (Python 3.12, no network there) into .whl/, which scripts/gpu_checks.sh
# installs (gguf: to import the real model's GGUF there; compressed-tensors: the quantized-weights
# tests pack with it). Keep .whl/ out of git: `echo /.whl/ >> .git/info/exclude`.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
# The engine and its tests; then the HTTP server stack (`ember serve` and the router on a GPU).
for pkg in msgspec==0.22.0 llguidance==1.9.1 pyzmq==27.3.0 pytest==9.2.0 pluggy iniconfig pygments packaging \
           hypothesis==6.170.17 sortedcontainers attrs \
           fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 \
           annotated-types==0.8.0 annotated-doc==0.0.7 typing_extensions==4.16.0 \
           typing-inspection==0.4.5 uvicorn==0.54.0 httptools==0.9.0 orjson==3.13.0 anyio==4.16.0 \
           opentelemetry-api importlib-metadata gguf==0.19.0 \
           compressed-tensors==0.20.1 loguru==0.7.3 psutil; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_26_x86_64 --platform any -d .whl "$pkg"
done
ls .whl
