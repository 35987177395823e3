#!/usr/bin/env bash
# Installs the pinned CUDA compiler (nvcc 13.0 from PyPI wheels) into .toolchain/, plus CMake for
# the C harness. All five nvcc wheels are pinned: an unpinned nvvm/ptxas rejects nvcc's PTX.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .toolchain/nvidia/cu13/bin/nvcc ]; then
  echo "symmalloc: installing nvcc 13.0 into .toolchain/ (pip wheels)"
  "$PY" -m pip install --quiet --disable-pip-version-check --target .toolchain \
    nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 \
    nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85
fi
if ! command -v cmake >/dev/null 2>&1 && [ ! -x .toolchain/bin/cmake ]; then
  echo "symmalloc: installing cmake into .toolchain/ (pip wheel)"
  "$PY" -m pip install --quiet --disable-pip-version-check --target .toolchain cmake==3.31.6
fi
if ! "$PY" -c "import pytest" 2>/dev/null; then
  echo "symmalloc: installing pytest (for the Python package's tests)"
  "$PY" -m pip install --quiet --disable-pip-version-check pytest==8.3.3
fi
echo "symmalloc: toolchain ready ($(.toolchain/nvidia/cu13/bin/nvcc --version | tail -1))"
