#!/usr/bin/env bash
# The wheel's prebuilt C++ allocators (python/symmalloc/csrc/torch_allocator.cpp): one
# libsymmalloc_torch.so per supported torch minor of PyPI's default CUDA build (2.10 to 2.15),
# written to OUT/torch-2.X/libsymmalloc_torch.so, on a machine without a GPU or those torches
# installed. _torch_ext.py loads the one for the running minor when it fits (same minor, same
# CUDA major, same allocator headers); any other torch builds on first use.
#
# How, per minor (the latest patch release of each on PyPI, below):
# - headers, torch/version.py and the dynamic symbols of torch's four libraries come from its
#   wheel (pip download once into .toolchain/torch-range/VERSION/, the wheel then deleted;
#   2.11 and 2.15 from the pinned and the kept venvs);
# - compiled as torch.utils.cpp_extension compiles it (same flags, C++17 up to 2.11, C++20
#   from 2.12) with the same -DSYMM_TORCH_* stamps _torch_ext.build() sets, against the CUDA
#   runtime's headers of that build's CUDA major (12: the nvidia-cuda-runtime-cu12 and
#   nvidia-cuda-nvcc-cu12 wheels' headers, 12.8 as torch 2.10's own; 13: the toolchain's);
# - linked against stub libc10.so, libc10_cuda.so, libtorch_cpu.so and libtorch_cuda.so
#   (shared objects with those SONAMEs defining the symbols the object needs that the real
#   one defines, from the wheel's symbol tables) with --as-needed in cpp_extension's order, so
#   the NEEDED entries are the ones a link against the real libraries gives (2.15 drops
#   libtorch_cpu.so, 2.11 keeps it), and the real libcudart.so.12/13 (its symbols are
#   versioned: the same version needs as a real build). Torch has loaded them all by the time
#   the allocator is opened, so nothing needs an RPATH. Only small files are kept: the wheels'
#   libraries (over 1 GB) are read for their symbol tables and deleted.
# Checks on every prebuilt: readelf -d lists only torch's libraries, its libcudart, libstdc++,
# libgcc_s and libc as NEEDED, and every undefined unversioned symbol is defined by that
# minor's torch libraries (their dynamic symbols, from the wheel), so it loads in that torch. --verify also builds 2.11 and 2.15 for real
# (cpp_extension, in their venvs), compares NEEDED sets, and loads each prebuilt in its real
# venv and runs the host selftest (needs target/release/libsymmalloc.so).
# Usage: scripts/build-torch-prebuilts.sh OUT           build the six into OUT
#        scripts/build-torch-prebuilts.sh OUT --verify  check OUT's 2.11 and 2.15 (no build)
#        scripts/build-torch-prebuilts.sh --fetch VERSION  print VERSION's folder (torch/include)
# (PINNED_VENV: the 2.11 venv.)
set -euo pipefail
shopt -s inherit_errexit
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${1:?usage: build-torch-prebuilts.sh OUT [--verify] | --fetch VERSION}
VERIFY=${2:-}
PYTHON=${PYTHON:-python3}
PINNED_VENV=${PINNED_VENV:-$ROOT/.toolchain/torch-venv-2.11.0}
CACHE=$ROOT/.toolchain/torch-range
SRC=$ROOT/python/symmalloc/csrc/torch_allocator.cpp
CU13=$ROOT/.toolchain/nvidia/cu13
CU12=$CACHE/cuda-12.8
# The latest of each minor on PyPI; 2.11 is the pinned venv's, 2.15 the venv
# check-torch-range.sh keeps (the others are downloaded).
VERSIONS="2.10.0 2.11.0 2.12.1 2.13.0 2.14.1 2.15.0"
LATEST=2.15.0
PIP="pip --disable-pip-version-check --quiet"
TORCH_LIBS="libc10.so libc10_cuda.so libtorch_cpu.so libtorch_cuda.so"
mkdir -p "$CACHE"
[ "$OUT" = --fetch ] || { mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd); }

# dynsyms LIBDIR DIR: for each of torch's four libraries in LIBDIR, DIR/LIB.txt lists the
# dynamic symbols it defines ("TYPE NAME" a line, as nm -D prints them; no version suffix).
dynsyms() {
  rm -rf "$2.tmp" && mkdir -p "$2.tmp"
  for l in $TORCH_LIBS; do
    nm -D --defined-only "$1/$l" | awk 'NF == 3 {sub(/@.*/, "", $3); print $2, $3}' \
      | LC_ALL=C sort -k2,2 -u > "$2.tmp/$l.txt"
  done
  rm -rf "$2" && mv "$2.tmp" "$2"
}

# venv_site VERSION: the site-packages of the venv kept with that torch (2.11: the pinned venv;
# 2.15: check-torch-range.sh's), or nothing.
venv_site() {
  local venv=
  case $1 in 2.11.*) venv=$PINNED_VENV ;; "$LATEST") venv=$CACHE/venv-$LATEST ;; esac
  [ -n "$venv" ] || return 0
  local site
  site=$(ls -d "$venv"/lib/python3*/site-packages 2>/dev/null | head -1 || true)
  [ -z "$site" ] || [ ! -f "$site/torch/version.py" ] || [ ! -f "$venv/.installed" ] || echo "$site"
}

# torch_dir VERSION: a folder holding torch/include and torch/version.py for VERSION, and
# $CACHE/dynsyms-VERSION/ (the wheel downloaded once, its libraries read, then deleted).
torch_dir() {
  local v=$1 dir=$CACHE/$1 site
  site=$(venv_site "$v")
  if [ -n "$site" ]; then  # a venv with that torch: its libraries are there
    [ -d "$CACHE/dynsyms-$v" ] || dynsyms "$site/torch/lib" "$CACHE/dynsyms-$v"
    echo "$site"; return
  fi
  if [ ! -f "$dir/.ok-prebuilt" ] || [ ! -d "$CACHE/dynsyms-$v" ]; then
    local w=$CACHE/wheels-$v
    rm -rf "$w" && mkdir -p "$dir" "$w/lib"
    $PYTHON -m $PIP download --no-deps "torch==$v" -d "$w" >&2
    $PYTHON - "$(ls "$w"/torch-*.whl)" "$dir" "$w/lib" $TORCH_LIBS <<'EOF'
import os, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
names = z.namelist()
keep = [n for n in names if n.startswith("torch/include/") or n == "torch/version.py"]
z.extractall(sys.argv[2], keep)
for lib in sys.argv[4:]:
    with z.open("torch/lib/" + lib) as src, open(os.path.join(sys.argv[3], lib), "wb") as dst:
        while chunk := src.read(1 << 24):
            dst.write(chunk)
EOF
    dynsyms "$w/lib" "$CACHE/dynsyms-$v"
    rm -rf "$w"
    touch "$dir/.ok" "$dir/.ok-prebuilt"
  fi
  echo "$dir"
}

# The CUDA 12.8 runtime's headers (with crt/) and libcudart.so.12, for torch 2.10's build.
cuda12() {
  if [ ! -f "$CU12/.ok" ]; then
    local w=$CACHE/wheels-cu12
    rm -rf "$w" "$CU12" && mkdir -p "$CU12/include/crt" "$CU12/lib"
    $PYTHON -m $PIP download --no-deps nvidia-cuda-runtime-cu12==12.8.90 \
      nvidia-cuda-nvcc-cu12==12.8.93 -d "$w" >&2
    $PYTHON - "$w" "$CU12" <<'EOF'
import glob, os, sys, zipfile
w, out = sys.argv[1:]
for whl in glob.glob(os.path.join(w, "*.whl")):
    z = zipfile.ZipFile(whl)
    for n in z.namelist():
        for pre, dst in (("nvidia/cuda_runtime/include/", "include/"),
                         ("nvidia/cuda_runtime/lib/libcudart.so.12", "lib/libcudart.so.12"),
                         ("nvidia/cuda_nvcc/include/crt/", "include/crt/")):
            if n.startswith(pre) and not n.endswith("/"):
                path = os.path.join(out, dst + n[len(pre):])
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with z.open(n) as s, open(path, "wb") as d:
                    d.write(s.read())
EOF
    rm -rf "$w"
    touch "$CU12/.ok"
  fi
}

if [ "$OUT" = --fetch ]; then  # check-torch-range.sh's headers: one download for both
  torch_dir "$VERIFY"
  exit 0
fi

# needed LIB: its NEEDED entries, sorted, space-separated.
needed() { readelf -d "$1" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | LC_ALL=C sort | tr '\n' ' '; }

# build VERSION: OUT/torch-MAJOR.MINOR/libsymmalloc_torch.so for that torch.
build() {
  local v=$1 dir inc ver cuda major std=c++20 abi cudainc cudalib mm
  dir=$(torch_dir "$v")
  inc=$dir/torch/include
  ver=$(sed -n "s/^__version__ = '\([^']*\)'.*/\1/p" "$dir/torch/version.py")
  cuda=$(sed -n "s/^cuda: Optional\[str\] = '\([^']*\)'.*/\1/p" "$dir/torch/version.py")
  [ -n "$ver" ] && [ -n "$cuda" ] || { echo "build-torch-prebuilts: no version or CUDA in $dir/torch/version.py"; exit 1; }
  major=${cuda%%.*}
  case $major in
    12) cuda12; cudainc=("-I$CU12/include"); cudalib=$CU12/lib ;;
    13) cudainc=("-I$CU13/include"); cudalib=$CU13/lib ;;
    *) echo "build-torch-prebuilts: torch $ver uses CUDA $cuda: no runtime known for it"; exit 1 ;;
  esac
  case $v in 2.10.*|2.11.*) std=c++17 ;; esac
  abi=$(cd python && $PYTHON -c "import sys, types; from symmalloc import _torch_ext as t; \
    print(t._abi_hash(types.SimpleNamespace(__file__=sys.argv[1] + '/__init__.py')))" "$dir/torch")
  [ -n "$abi" ] || { echo "build-torch-prebuilts: $inc lacks a header csrc includes"; exit 1; }
  mm=$(echo "$v" | cut -d. -f1,2)
  local o=$OUT/torch-$mm t0=$SECONDS
  rm -rf "$o" && mkdir -p "$o"
  nice c++ -DTORCH_EXTENSION_NAME=symmalloc_torch -DTORCH_API_INCLUDE_EXTENSION_H \
    -I"$ROOT/include" "${cudainc[@]}" -isystem "$inc" -isystem "$inc/torch/csrc/api/include" -fPIC -std=$std \
    -O2 -Wall -Wextra -Werror -Wno-unused-parameter -DSYMM_TORCH_FULL_VERSION=\""$ver"\" \
    -DSYMM_TORCH_ABI=\""$abi"\" -DSYMM_TORCH_CUDA=\""$cuda"\" -c "$SRC" -o "$o/torch_allocator.o"
  # Stubs of torch's four libraries defining the symbols the object needs that each defines
  # (as the real ones do), linked --as-needed in cpp_extension's order: the linker records the
  # NEEDED entries a link against the real libraries records.
  local syms=$CACHE/dynsyms-$v stubs=$o/stubs l
  mkdir -p "$stubs"
  nm --undefined-only "$o/torch_allocator.o" | awk '{print $NF}' | LC_ALL=C sort -u > "$stubs/undef"
  for l in $TORCH_LIBS; do
    LC_ALL=C join -1 2 -2 1 -o 1.1,1.2 "$syms/$l.txt" "$stubs/undef" | awk '
      $1 ~ /^[TtWiI]$/ {printf ".text\n.globl %s\n.type %s,@function\n%s:\nret\n", $2, $2, $2; next}
      {printf ".data\n.globl %s\n.type %s,@object\n.size %s,8\n%s:\n.quad 0\n", $2, $2, $2, $2}' \
      > "$stubs/$l.s"
    cc -shared -nostdlib -Wl,-soname,"$l" "$stubs/$l.s" -o "$stubs/$l"
  done
  c++ "$o/torch_allocator.o" -shared -Wl,--as-needed -L"$stubs" -lc10_cuda -ltorch_cuda \
    -L"$cudalib" -l:libcudart.so."$major" -ldl -lc10 -ltorch_cpu -o "$o/libsymmalloc_torch.so"
  local lib=$o/libsymmalloc_torch.so n missing
  for n in $(needed "$lib"); do
    case " $TORCH_LIBS libcudart.so.$major libstdc++.so.6 libgcc_s.so.1 libc.so.6 libm.so.6 " in
      *" $n "*) ;; *) echo "build-torch-prebuilts: $lib needs $n, which torch does not bring"; exit 1 ;;
    esac
  done
  # Every undefined unversioned symbol must be defined by this torch's libraries.
  missing=$(nm -D --undefined-only "$lib" | awk '$1 == "U" && $2 !~ /@/ {print $2}' \
    | LC_ALL=C sort -u | LC_ALL=C comm -23 - <(cat "$syms"/*.txt | awk '{print $2}' | LC_ALL=C sort -u))
  [ -z "$missing" ] || { echo "build-torch-prebuilts: $lib needs symbols torch $ver lacks:"; echo "$missing"; exit 1; }
  rm -rf "$stubs" "$o/torch_allocator.o"
  echo "build-torch-prebuilts: torch $ver (CUDA $cuda, $std), $((SECONDS - t0)) s: NEEDED $(needed "$lib")"
}

# verify VERSION: the prebuilt for VERSION against a real build in that torch's venv (the
# same NEEDED set), then loaded there by _torch_ext.load() (it fits) and self-tested on the
# host backend.
verify() {
  local v=$1 mm site venv real lib
  mm=$(echo "$v" | cut -d. -f1,2)
  lib=$OUT/torch-$mm/libsymmalloc_torch.so
  [ -f "$lib" ] || { echo "build-torch-prebuilts: no $lib (build it first)"; exit 1; }
  if [ "$v" = "$LATEST" ] && [ -z "$(venv_site "$v")" ]; then  # as check-torch-range.sh makes it
    local nv=$CACHE/venv-$LATEST
    rm -rf "$nv" && $PYTHON -m venv "$nv"
    "$nv/bin/python" -m $PIP install "torch==$LATEST" ninja==1.13.0
    touch "$nv/.installed"
  fi
  site=$(venv_site "$v")
  [ -n "$site" ] || { echo "build-torch-prebuilts: no venv with torch $v to verify in (make test-torch-range keeps 2.15's, make test-torch the pinned 2.11)"; exit 1; }
  venv=${site%/lib/python3*}
  real=$(mktemp -d)
  local log
  log=$(cd python && CUDA_HOME=$CU13 nice "$venv/bin/python" -W ignore -m symmalloc._torch_ext \
    --build "$real" 2>&1) || { echo "$log"; exit 1; }
  [ "$(needed "$lib")" = "$(needed "$real/libsymmalloc_torch.so")" ] || { echo \
    "build-torch-prebuilts: NEEDED differ for torch $v: prebuilt $(needed "$lib"), real build $(needed "$real/libsymmalloc_torch.so")"; exit 1; }
  rm -rf "$real"
  (cd python && SYMMALLOC_BACKEND=host SYMMALLOC_LIBRARY_DIR=${SYMMALLOC_LIBRARY_DIR:-$ROOT/target/release} \
    SYMMALLOC_TORCH_EXT=$lib SYMMALLOC_CACHE_DIR=$OUT/.verify-cache "$venv/bin/python" -W ignore -c "
import symmalloc, torch, symmalloc._torch_ext as t
lib = t.load()  # raises unless it loads and fits this torch
r = t.selftest(symmalloc.library_path(), 2)
assert r is None, r
print('build-torch-prebuilts: torch', torch.__version__, ': the prebuilt has a real build\'s NEEDED set, loads, fits and passes the selftest on the host backend')
" 2>&1 | grep -v "Failed to initialize NumPy\|_conversion_method_template")
  [ ! -e "$OUT/.verify-cache" ] || { echo "build-torch-prebuilts: torch $v built into the cache"; exit 1; }
}

if [ "$VERIFY" = --verify ]; then
  for v in 2.11.0 $LATEST; do verify "$v"; done
  exit 0
fi

t_all=$SECONDS
for v in $VERSIONS; do
  build "$v"
done
echo "build-torch-prebuilts: 6 prebuilts in $((SECONDS - t_all)) s"
