"""The wheel ships the two Rust libraries under their own names (``libsymmalloc.so``,
``libsymmalloc_pluggable.so``): setuptools-rust names a binding-less cdylib like a Python
extension (``<name>.abi3.so``) and has no option for a plain library name, so its
``build_rust`` command is given the file name here. The C ABI's header, the checkout's
include/symmalloc.h, goes into the package as ``symmalloc/include/symmalloc.h`` (the C++
allocator built on first use includes it; so may other C code).

Two checks before anything is built: Rust's cargo must be there (a one-line error says so, not
a failure deep in the build), and the kernels' nvcc is the pinned one that pyproject.toml's build
requirements install from PyPI (the ``nvidia-cuda-nvcc`` wheel and its companions), handed to
build.rs in ``NVCC`` unless the user set it; so no CUDA toolkit is needed. Everything else is in
pyproject.toml."""

import os
import shutil
import sys

if "sdist" not in sys.argv:  # a source archive builds nothing
    if shutil.which(os.environ.get("CARGO", "cargo")) is None:
        sys.exit("symmalloc: building needs Rust (cargo, 1.85 or newer), which is not on PATH: "
                 "install it from https://rustup.rs, then run pip again")
    for _base in sys.path:
        _nvcc = os.path.join(_base or ".", "nvidia", "cu13", "bin", "nvcc")
        if os.path.isfile(_nvcc) and os.access(_nvcc, os.X_OK):
            os.environ.setdefault("NVCC", os.path.abspath(_nvcc))
            break

from setuptools import setup  # noqa: E402
from setuptools.command.build_py import build_py  # noqa: E402
from setuptools_rust import Binding  # noqa: E402
from setuptools_rust.build import build_rust  # noqa: E402


class build_rust_plain_names(build_rust):
    def get_dylib_ext_path(self, ext, target_fname):
        path = super().get_dylib_ext_path(ext, target_fname)
        if ext.binding != Binding.NoBinding:
            return path
        # symmalloc.lib.libsymmalloc -> .../symmalloc/lib/libsymmalloc.so
        return os.path.join(os.path.dirname(path), target_fname.rsplit(".", 1)[-1] + ".so")


class build_py_with_header(build_py):
    def run(self):
        super().run()
        here = os.path.dirname(os.path.abspath(__file__))
        header = os.path.join(here, "..", "include", "symmalloc.h")
        if not os.path.isfile(header):
            raise SystemExit(f"{os.path.normpath(header)} is missing: build from a whole checkout")
        dst = os.path.join(self.build_lib, "symmalloc", "include")
        self.mkpath(dst)
        self.copy_file(header, os.path.join(dst, "symmalloc.h"))


setup(cmdclass={"build_rust": build_rust_plain_names, "build_py": build_py_with_header})
