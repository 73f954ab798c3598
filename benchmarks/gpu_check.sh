#!/usr/bin/env bash
# GPU check on the device machine (see benchmarks/gpu_check.py). The device image
# has torch (with triton), transformers, safetensors, ml_dtypes, tokenizers; the
# store's own dependencies and the linear-attention kernels travel as wheels made
# here first, their list read from pyproject.toml (benchmarks/device_wheels.py):
#   echo /.whl/ >> .git/info/exclude
#   python3 benchmarks/device_wheels.py --download .whl
# then run this script with `.whl` carried. causal-conv1d has no binary wheel on PyPI
# (only a CUDA source build, or wheels on its GitHub releases, which the device cannot
# reach): without it the conv1d runs transformers' PyTorch fallback, and the JSON says
# so. Prints one JSON line per phase as it ends, the verdict last (PASS / PARTIAL / FAIL);
# `--phases kernels,train` reruns some.
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
