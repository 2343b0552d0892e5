# Sourced on a device machine: unpacks the vLLM archives of scripts/vllm_pack.sh that this call
# carried (.vllm/A.tar.xz, .vllm/M.tar.xz, .vllm/B.tar.xz; one or two a call fit its 64 MiB) into
# /tmp/vllm_site, which stays while the machine is held, and exports VLLM_SITE. A run needs A and B
# (and M for MoE models) unpacked, over one or more calls of the same warm machine:
#   run(carry=[".vllm/A.tar.xz"], "source scripts/vllm_device_env.sh")
#   run(carry=[".vllm/B.tar.xz", ".whl"], "source scripts/vllm_device_env.sh && ...")
# then PYTHONPATH=$VLLM_SITE:... for the vLLM process alone (ember keeps /tmp/site).
VLLM_SITE=/tmp/vllm_site
mkdir -p "$VLLM_SITE"
for a in .vllm/*.tar.xz; do
  [[ -f $a ]] || continue
  tar -C "$VLLM_SITE" -xJf "$a" && echo "unpacked $a"
done
export VLLM_SITE VLLM_USE_FLASHINFER_SAMPLER=0
[[ -f $VLLM_SITE/vllm/_C_stable_libtorch.abi3.so ]] || echo "vllm: archive A not unpacked yet"
[[ -f $VLLM_SITE/vllm/__init__.py ]] || echo "vllm: archive B not unpacked yet"
