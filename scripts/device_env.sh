# Sourced by the device scripts (gpu_checks.sh, spec_gpu.sh, moe_gpu.sh) from the repository root:
# installs the carried wheels (.whl) into /tmp/site and sets PYTHONPATH and OUT for what follows.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
