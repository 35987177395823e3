"""The wheel ships the two Rust libraries under their own names (``libsymmalloc.so``,
``libsymmalloc_pluggable.so``): setuptools-rust names a binding-less cdylib like a Python
extension (``<name>.abi3.so``) and has no option for a plain library name, so its
``build_rust`` command is given the file name here. Everything else is in pyproject.toml."""

import os

from setuptools import setup
from setuptools_rust import Binding
from setuptools_rust.build import build_rust


class build_rust_plain_names(build_rust):
    def get_dylib_ext_path(self, ext, target_fname):
        path = super().get_dylib_ext_path(ext, target_fname)
        if ext.binding != Binding.NoBinding:
            return path
        # symmalloc.lib.libsymmalloc -> .../symmalloc/lib/libsymmalloc.so
        return os.path.join(os.path.dirname(path), target_fname.rsplit(".", 1)[-1] + ".so")


setup(cmdclass={"build_rust": build_rust_plain_names})
