#!/usr/bin/env bash
# Installs the pinned toolchain into .toolchain/, from PyPI wheels:
#   .toolchain/venv           a virtual environment that every pip install below goes through, and
#                             the Python the tests run with (pytest); so a system Python that
#                             refuses pip installs (PEP 668: Debian 12, Ubuntu 24.04) works. It
#                             needs only the venv module (Debian/Ubuntu: apt install python3-venv).
#   .toolchain/nvidia/cu13    nvcc 13.0 and the CUDA runtime (headers, libcudart for CUDA::cudart).
#                             All five nvcc wheels are pinned: an unpinned nvvm/ptxas rejects
#                             nvcc's PTX.
#   .toolchain/bin/cmake      CMake, for the C harness and the examples (when none is on PATH).
# Each step checks its own result, so a rerun repairs what is missing and does nothing else.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.toolchain/venv
say() { echo "symmalloc: $*"; }
die() { echo "symmalloc: $*" >&2; exit 1; }

command -v "$PY" >/dev/null 2>&1 || die "$PY not found: install Python >= 3.10 (or set PYTHON)"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -m pip --version >/dev/null 2>&1; then
  say "creating $VENV (the toolchain's pip installs and the tests' pytest go there)"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV" >/dev/null 2>&1 || {
    rm -rf "$VENV"
    die "'$PY -m venv' failed: install Python's venv module (Debian/Ubuntu: apt install python3-venv)"
  }
fi
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)

CU=.toolchain/nvidia/cu13
if [ ! -x $CU/bin/nvcc ]; then
  say "installing nvcc 13.0 into .toolchain/ (pip wheels)"
  "${PIP[@]}" --target .toolchain \
    nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 \
    nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85
fi
# The runtime wheel ships libcudart.so.13 only; CMake's CUDA::cudart (FindCUDAToolkit) and a
# plain -lcudart look for the development name.
[ -e $CU/lib/libcudart.so ] || ln -s libcudart.so.13 $CU/lib/libcudart.so

if ! command -v cmake >/dev/null 2>&1 && [ ! -x .toolchain/cmake/data/bin/cmake ]; then
  say "installing cmake into .toolchain/ (pip wheel)"
  "${PIP[@]}" --target .toolchain cmake==3.31.6
fi
# pip --target writes .toolchain/bin/cmake as a Python script that imports the cmake package from
# the interpreter's own path, where it is not: point those names at the binaries themselves.
if [ -x .toolchain/cmake/data/bin/cmake ]; then
  mkdir -p .toolchain/bin
  for t in cmake ctest cpack; do ln -sfn ../cmake/data/bin/$t .toolchain/bin/$t; done
  rm -f .toolchain/bin/ccmake  # its binary is not in the wheel
fi

if ! "$VENV/bin/python" -c "import pytest" 2>/dev/null; then
  say "installing pytest into $VENV (for the Python package's tests)"
  "${PIP[@]}" pytest==8.3.3
fi
say "toolchain ready ($($CU/bin/nvcc --version | tail -1); $VENV/bin/python: $("$VENV/bin/python" --version))"
