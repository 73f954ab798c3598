#!/usr/bin/env bash
# GPU check on the device machine (see benchmarks/gpu_check.py). The device image
# has torch (with triton), transformers, safetensors, ml_dtypes, tokenizers; the
# store's own dependencies and the linear-attention kernels travel as wheels made
# here first (flash-linear-attention and fla-core are pure-Python Triton kernels):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl "zarr==3.1.6" "numcodecs==0.16.6" "google-crc32c==1.9.0" "donfig==0.8.1.post1" \
#     "typing_extensions" "packaging" "flash-linear-attention==0.6.0" "fla-core==0.6.0" "einops"
# then run this script with `.whl` carried. causal-conv1d has no binary wheel on PyPI
# (only a CUDA source build, or wheels on its GitHub releases, which the device cannot
# reach): without it the conv1d runs transformers' PyTorch fallback, and the JSON says
# so (`kernels_check.causal_conv1d`, `kernels.causal_conv1d`). Prints one JSON line last.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
python3 -c "import fla, sys; print('fla', fla.__version__, file=sys.stderr)" || echo "fla not importable: the linear attention will time the PyTorch fallback" >&2
exec timeout 480 python3 benchmarks/gpu_check.py "$@"
