#!/usr/bin/env bash
# The C++ allocator for PyTorch (python/symmalloc/csrc) against every torch minor it supports,
# 2.10 to 2.15 (csrc/torch_compat.h), on a machine without a GPU:
# - each minor's wheel from PyPI (pip download, once: its headers are kept under
#   .toolchain/torch-range/VERSION/ and the wheel deleted; scripts/build-torch-prebuilts.sh), then torch_allocator.cpp compiled
#   against its headers and the toolchain's CUDA headers with -Wall -Wextra -Werror
#   (-fsyntax-only: every guard is taken and SymmAllocator is complete, since the file makes
#   one; C++17 up to 2.11 and C++20 from 2.12, as torch.utils.cpp_extension compiles);
# - the pinned 2.11 is also built, linked and self-tested by make test-torch (its venv's
#   headers are the ones checked here);
# - the latest (2.15) is also built as install_global() builds it on first use
#   (torch.utils.cpp_extension in a venv with that torch: linked against the wheel's torch/lib),
#   and its selftest runs on the host backend. That venv (about 5 GB with its CUDA wheels,
#   about 2 minutes to install) is kept under .toolchain/torch-range/ and reused.
# Usage: scripts/check-torch-range.sh [TORCH_VENV]   (make test-torch-range; TORCH_VENV: the
# pinned 2.11 venv). Needs target/release/libsymmalloc.so (make build) for the selftest.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
PINNED_VENV=${1:-$ROOT/.toolchain/torch-venv-2.11.0}
CACHE=$ROOT/.toolchain/torch-range
CUDA_INCLUDE=$ROOT/.toolchain/nvidia/cu13/include
SRC=$ROOT/python/symmalloc/csrc/torch_allocator.cpp
HEADER_ONLY="2.10.0 2.12.1 2.13.0 2.14.1"   # the latest of each minor on PyPI
LATEST=2.15.0
PIP="pip --disable-pip-version-check --quiet"
mkdir -p "$CACHE"

# headers VERSION: the folder holding torch/include for VERSION (its wheel downloaded once, by
# build-torch-prebuilts.sh, which keeps what the wheel's prebuilts need from it too).
headers() { bash scripts/build-torch-prebuilts.sh --fetch "$1"; }

# compile VERSION INCLUDE: torch_allocator.cpp against torch/include at INCLUDE, syntax only.
compile() {
  local v=$1 inc=$2 std=c++20
  case $v in 2.10.*|2.11.*) std=c++17 ;; esac
  local t0=$SECONDS
  nice c++ -fsyntax-only -std=$std -O2 -Wall -Wextra -Werror -Wno-unused-parameter \
    -I"$ROOT/include" -I"$CUDA_INCLUDE" -isystem "$inc" -isystem "$inc/torch/csrc/api/include" "$SRC"
  echo "check-torch-range: torch $v: torch_allocator.cpp compiles ($std, -Werror, $((SECONDS - t0)) s)"
}

for v in $HEADER_ONLY; do
  compile "$v" "$(headers "$v")/torch/include"
done

pinned_inc=$(ls -d "$PINNED_VENV"/lib/python3*/site-packages/torch/include 2>/dev/null | head -1)
[ -n "$pinned_inc" ] || { echo "check-torch-range: no torch in $PINNED_VENV (make test builds it)"; exit 1; }
compile "$(sed -n "s/^__version__ = '\([^']*\)'.*/\1/p" "$pinned_inc/../version.py")" "$pinned_inc"

# The latest: a venv with it (and ninja), the build as on first use, the host selftest.
venv=$CACHE/venv-$LATEST
if [ ! -f "$venv/.installed" ]; then
  rm -rf "$venv" && $PYTHON -m venv "$venv"
  "$venv/bin/python" -m $PIP install "torch==$LATEST" ninja==1.13.0
  touch "$venv/.installed"
fi
out=$CACHE/build-$LATEST
rm -rf "$out"
t0=$SECONDS
(cd python && CUDA_HOME=$ROOT/.toolchain/nvidia/cu13 nice "$venv/bin/python" -W ignore \
  -m symmalloc._torch_ext --build "$out" >/dev/null)
lib=$out/libsymmalloc_torch.so
readelf -d "$lib" | grep -q 'NEEDED.*libtorch_cuda.so' || { echo "check-torch-range: $lib does not link libtorch_cuda"; exit 1; }
(cd python && SYMMALLOC_BACKEND=host SYMMALLOC_LIBRARY_DIR=${SYMMALLOC_LIBRARY_DIR:-$ROOT/target/release} \
  SYMMALLOC_TORCH_EXT=$lib "$venv/bin/python" -W ignore -c "
import symmalloc, torch, symmalloc._torch_ext as t
lib = t.load()
assert lib.symm_torch_built_for().decode() == torch.__version__, lib.symm_torch_built_for()
r = t.selftest(symmalloc.library_path(), 2)
assert r is None, r
print('check-torch-range: torch', torch.__version__, ': built, linked against its torch/lib, selftest passes on the host backend')
" 2>&1 | grep -v "Failed to initialize NumPy\|_conversion_method_template")
echo "check-torch-range: torch $LATEST built and self-tested in $((SECONDS - t0)) s; torch 2.10 to 2.15 all compile"
rm -rf "$out"
