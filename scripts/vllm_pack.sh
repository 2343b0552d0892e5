#!/usr/bin/env bash
# Packs vLLM 0.26.0 for a GPU machine with no network, to run it beside ember there: vLLM's wheel,
# less the parts bf16 Llama/Qwen/DeepSeek on Hopper never load, and the wheels it imports that the
# GPU image lacks, in archives that each fit one call's 64 MiB working tree (unpacked by
# scripts/vllm_device_env.sh):
#   .vllm/A.tar.xz  vllm/_C_stable_libtorch.abi3.so alone (~56 MB)
#   .vllm/M.tar.xz  vllm/_moe_C_stable_libtorch.abi3.so (MoE models only)
#   .vllm/B.tar.xz  the rest of vllm (FA3 included) and the pure-Python and small wheels it needs
# Run here, where PyPI is reachable: bash scripts/vllm_pack.sh   (.vllm/ is git-ignored)
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.26.0
WORK=${VLLM_WORK:-/tmp/vllm_pack}
OUT=.vllm
grep -qxF "/$OUT/" .git/info/exclude 2>/dev/null || echo "/$OUT/" >> .git/info/exclude
rm -rf "$WORK/site" && mkdir -p "$WORK/wheels" "$WORK/site" "$OUT"

download() {  # NAME==VERSION ...: cp312 manylinux wheels, no dependencies
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any \
    -d "$WORK/wheels" "$@" 2>&1 | grep -v '^WARNING: Location' || true
}

download "vllm==$VERSION"
# What Llama/Qwen/DeepSeek in bf16 on Hopper never load (each import is guarded there).
unzip -q -o "$WORK/wheels/vllm-$VERSION-"*.whl -d "$WORK/site" \
  -x 'vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so' 'vllm/vllm-rs' \
     'vllm/third_party/deep_gemm/*' 'vllm/third_party/fmha_sm100/*'

# The packages vLLM and its OpenAI server import that the GPU image lacks (all into archive B).
download pydantic==2.14.4 pydantic_core==2.50.5 annotated-types typing-inspection \
  fastapi==0.136.3 starlette==1.10.0 msgspec==0.22.0 pyzmq==27.3.0 cbor2 pybase64 cachetools \
  openai==3.57.0 httpx2 sniffio jiter distro docstring-parser openai-harmony==0.0.8 \
  partial-json-parser xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 llguidance==1.7.6 \
  depyf==0.20.0 astor dill setproctitle blake3 \
  lark==1.2.2 diskcache python-json-logger gguf ijson jsonschema referencing rpds-py \
  jsonschema-specifications interegular lm-format-enforcer==0.11.3 outlines_core==0.2.14 \
  watchfiles compressed-tensors==0.17.0 loguru \
  uvicorn httptools prometheus-fastapi-instrumentator python-multipart email-validator \
  dnspython model-hosting-container-standards jmespath supervisor
for w in "$WORK"/wheels/*.whl; do
  case "$(basename "$w")" in vllm-*) continue ;; esac
  unzip -q -o "$w" -d "$WORK/site"
done

pack() {  # archive, then the paths under site/ it takes
  local archive=$1; shift
  tar -C "$WORK/site" -cf - "$@" | xz -T0 -9 > "$OUT/$archive"
}
pack A.tar.xz vllm/_C_stable_libtorch.abi3.so
pack M.tar.xz vllm/_moe_C_stable_libtorch.abi3.so
rm "$WORK/site/vllm/_C_stable_libtorch.abi3.so" "$WORK/site/vllm/_moe_C_stable_libtorch.abi3.so"
pack B.tar.xz .
ls -l "$OUT"
