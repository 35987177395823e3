#!/usr/bin/env bash
# Builds the GPU artifacts here (no GPU needed) and copies them into the git-ignored .device/
# that scripts/device-run.sh runs on a GPU machine: the two .so files, the demo, the
# benchmarks, the stripped test binaries, the kernels' fatbin and the wheel.
#   bash scripts/stage-device.sh         stage this checkout (.device/old, if there, is kept)
#   bash scripts/stage-device.sh --old   only the build an A/B compares against: the libraries,
#                                        the compiled eager caller and allreduce_c, into .device/old
#                                        (`device-run.sh ab` times .device against it)
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --examples
cargo build --release --features testing  # the demo too (Cargo.toml, `testing`)
# The SONAME the C harness records (build.rs): the file under that name beside the library in $1.
link_soname() {
  local soname
  soname=$(readelf -d "$1/libsymmalloc.so" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
  ln -sf libsymmalloc.so "$1/$soname"
}
if [ "${1:-}" = --old ]; then
  rm -rf .device/old && mkdir -p .device/old
  cp target/release/libsymmalloc.so target/release/libsymmalloc_pluggable.so target/release/examples/allreduce_c .device/old/
  # Its own Python package (tail.py --ab-lib runs it with its library: the calls must match).
  mkdir -p .device/old/python && cp -r python/symmalloc .device/old/python/ && rm -rf .device/old/python/symmalloc/lib
  find .device/old/python -name __pycache__ -prune -exec rm -rf {} +
  make --no-print-directory target/release/_fastcall.abi3.so >/dev/null && cp target/release/_fastcall.abi3.so .device/old/
  strip .device/old/allreduce_c && strip --strip-debug .device/old/*.so
  link_soname .device/old
  ls -la .device/old
  exit 0
fi
mapfile -t tests < <(cargo test --release -p symmalloc --lib --test gpu_alloc --test gpu_comm --test gpu_scatter_gather --test bitwise --test gpu_p2p --test gpu_groups --test gpu_moe --test fused_quant --test grown_host --no-run 2>&1 |
  grep -oE "\(target/release/deps/[^)]+\)" | tr -d '()')
# Everything but an A/B's other build (--old) is replaced.
mkdir -p .device && find .device -mindepth 1 -maxdepth 1 ! -name old -exec rm -rf {} +
cp target/release/libsymmalloc.so target/release/libsymmalloc_pluggable.so target/release/symmalloc-demo \
  target/release/examples/alloc_bench target/release/examples/allreduce_c target/release/examples/p2p_bench target/release/examples/groups_bench .device/
for t in "${tests[@]}"; do
  case "$t" in
    *gpu_alloc-*) cp "$t" .device/t_gpu_alloc ;;
    *gpu_comm-*) cp "$t" .device/t_gpu_comm ;;
    *gpu_scatter_gather-*) cp "$t" .device/t_gpu_sg ;;
    *bitwise-*) cp "$t" .device/t_bitwise ;;
    *gpu_p2p-*) cp "$t" .device/t_gpu_p2p ;;
    *gpu_groups-*) cp "$t" .device/t_gpu_groups ;;
    *gpu_moe-*) cp "$t" .device/t_gpu_moe ;;
    *fused_quant-*) cp "$t" .device/t_fused_quant ;;
    *grown_host-*) cp "$t" .device/t_grown ;;
    *symmalloc-*) cp "$t" .device/t_unit ;;
  esac
done
cp "$(ls -t target/release/build/symmalloc-*/out/symmalloc_kernels.fatbin | head -1)" .device/
# The C harness's CUDA example (examples/cpp/p2p_allreduce.cu), built here with the toolchain's
# nvcc when there is one (the device run also builds it with the machine's).
if [ -x .toolchain/nvidia/cu13/bin/nvcc ]; then
  .toolchain/nvidia/cu13/bin/nvcc -std=c++17 -O2 -gencode=arch=compute_90,code=sm_90 -Iinclude \
    examples/cpp/p2p_allreduce.cu -o .device/p2p_allreduce -L.toolchain/nvidia/cu13/lib -Ltarget/release -lsymmalloc
fi
make --no-print-directory build/mm-unicast/multimem_unicast >/dev/null && cp build/mm-unicast/multimem_unicast .device/  # device-run.sh multimem
strip .device/t_* .device/alloc_bench .device/allreduce_c .device/p2p_bench .device/groups_bench .device/symmalloc-demo
strip --strip-debug .device/*.so  # keeps the dynamic symbols; the tree travels under 64 MiB
link_soname .device
# The C++ allocator for PyTorch (make torch-ext: built against the pinned torch here; the device
# run also builds it with the machine's torch on first use when this one does not load there) and
# the floor allocator of bench/torch_global.py.
make --no-print-directory target/release/libsymmalloc_torch.so >/dev/null && cp target/release/libsymmalloc_torch.so .device/
cc -O2 -shared -fPIC bench/bump_alloc.c -o .device/libbump_alloc.so -ldl
# The manylinux wheel (make wheel), for the install-and-run check on the device.
make --no-print-directory wheel >/dev/null && cp .whl/symmalloc-*.whl .device/
# Its compiled eager caller, beside the libraries: the in-tree package loads it from there.
python3 -c "import zipfile, glob; zipfile.ZipFile(glob.glob('.device/symmalloc-*.whl')[0]).extract('symmalloc/_fastcall.abi3.so', '/tmp/symm-stage')"
cp /tmp/symm-stage/symmalloc/_fastcall.abi3.so .device/
ls -la .device
