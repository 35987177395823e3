# symmalloc: the two commands of the README.
#   make        set up the toolchain if missing, build release, run symmalloc-demo
#   make test   cargo test, the C harness (ctest), header drift, fmt and clippy
CARGO ?= cargo
PYTHON ?= python3
NVCC := $(CURDIR)/.toolchain/nvidia/cu13/bin/nvcc
CMAKE := $(shell command -v cmake 2>/dev/null || echo $(CURDIR)/.toolchain/cmake/data/bin/cmake)
CTEST := $(shell command -v ctest 2>/dev/null || echo $(CURDIR)/.toolchain/cmake/data/bin/ctest)
CUDA_INCLUDE := $(CURDIR)/.toolchain/nvidia/cu13/include

.PHONY: all run build toolchain test test-rust test-c test-python test-install lint header install python-install clean

all: run

toolchain:
	@if [ -z "$$NVCC" ] && ! command -v nvcc >/dev/null 2>&1 && [ ! -x $(NVCC) ] || [ ! -x $(CMAKE) ] \
	  || ! $(PYTHON) -c "import pytest" 2>/dev/null; then bash scripts/setup-toolchain.sh; fi

# SONAME version (build.rs): MAJOR, or 0.MINOR before 1.0.
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
VMAJOR := $(word 1,$(subst ., ,$(VERSION)))
VMINOR := $(word 2,$(subst ., ,$(VERSION)))
SOVERSION := $(if $(filter 0,$(VMAJOR)),0.$(VMINOR),$(VMAJOR))

build: toolchain
	$(CARGO) build --release
	ln -sf libsymmalloc.so target/release/libsymmalloc.so.$(SOVERSION)

run: build
	./target/release/symmalloc-demo

# The C harness first: it builds the release .so files that tests/exports.rs inspects.
test: toolchain lint test-c test-rust test-python test-install

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --all-targets -- -D warnings

test-rust:
	$(CARGO) test -p symmalloc

# The Python package against the release build, on both backends (no GPU needed).
test-python: build
	cd python && SYMMALLOC_LIBRARY_DIR=$(CURDIR)/target/release $(PYTHON) -m pytest -q tests
	cd python && SYMMALLOC_BACKEND=host SYMMALLOC_LIBRARY_DIR=$(CURDIR)/target/release $(PYTHON) -m pytest -q tests

test-c: build
	$(CMAKE) -S tests/c -B build/c -DSYMMALLOC_LIB_DIR=$(CURDIR)/target/release \
	  -DCUDA_INCLUDE_DIR=$(CUDA_INCLUDE) >/dev/null
	$(CMAKE) --build build/c -j 2
	$(CTEST) --test-dir build/c --output-on-failure

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
	install -m 644 include/symmalloc.h $(PREFIX)/include/
	sed -e 's|@PREFIX@|$(PREFIX)|' -e 's|@VERSION@|$(VERSION)|' cmake/symmalloc.pc.in > $(PREFIX)/lib/pkgconfig/symmalloc.pc
	sed -e 's|@VERSION@|$(VERSION)|' -e 's|@SOVERSION@|$(SOVERSION)|' cmake/symmalloc-config.cmake.in > $(PREFIX)/lib/cmake/symmalloc/symmalloc-config.cmake
	sed -e 's|@VERSION@|$(VERSION)|' cmake/symmalloc-config-version.cmake.in > $(PREFIX)/lib/cmake/symmalloc/symmalloc-config-version.cmake

# `make install` into build/prefix, then a consumer project finds it with
# find_package(symmalloc VERSION), links it by SONAME and runs; a newer version is refused.
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
	! $(CMAKE) -S tests/install -B build/consumer-newer -DCMAKE_PREFIX_PATH=$(CURDIR)/build/prefix \
	  -DWANT_VERSION=$(VMAJOR).$(shell echo $$(($(VMINOR) + 1))) >/dev/null 2>&1
	@echo "test-install: find_package($(VMAJOR).$(VMINOR)) links libsymmalloc.so.$(SOVERSION) and runs; $(VMAJOR).$$(($(VMINOR) + 1)) is refused"

# pip-installs the Python package with the freshly built .so files inside it.
python-install: build
	mkdir -p python/symmalloc/lib
	cp target/release/libsymmalloc.so target/release/libsymmalloc_pluggable.so python/symmalloc/lib/
	$(PYTHON) -m pip install ./python

header:
	SYMMALLOC_BLESS=1 $(CARGO) test -p symmalloc --test header

clean:
	$(CARGO) clean
	rm -rf build
