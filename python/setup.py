"""The wheel ships the two Rust libraries under their own names (``libsymmalloc.so``,
``libsymmalloc_pluggable.so``): setuptools-rust names a binding-less cdylib like a Python
extension (``<name>.abi3.so``) and has no option for a plain library name, so its
``build_rust`` command is given the file name here. The C ABI's header, the checkout's
include/symmalloc.h, goes into the package as ``symmalloc/include/symmalloc.h`` (the C++
allocator built on first use includes it; so may other C code). Everything else is in
pyproject.toml."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools_rust import Binding
from setuptools_rust.build import build_rust


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
