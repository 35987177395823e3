"""The C++ allocator for PyTorch (csrc/torch_allocator.cpp): found built for the running torch,
built with ``torch.utils.cpp_extension`` when it is not (and cached), loaded and installed.

Where it looks, in order: ``SYMMALLOC_TORCH_EXT`` (a path to the built library), the package's
``lib/libsymmalloc_torch.so`` (the wheel's, built for the torch it pins), the folder of the
libsymmalloc.so in use (a checkout's ``target/release``: ``make torch-ext``), the build cache
(``SYMMALLOC_CACHE_DIR``, else ``$XDG_CACHE_HOME/symmalloc``, else ``~/.cache/symmalloc``), one
folder per torch version. A library is used only when it says it was built for the running
torch (``symm_torch_built_for``); otherwise it is built into the cache. Nothing here runs on the
allocation path: PyTorch calls the C++ allocator directly.

    python -m symmalloc._torch_ext --build DIR     build into DIR (make test, the wheel)
"""

import ctypes
import glob
import os
import sys

__all__ = ["load", "build", "selftest"]

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "torch_allocator.cpp")
LIBRARY = "libsymmalloc_torch.so"
_loaded = None


def _cuda_paths(torch):
    """(include folders, folder with libcudart, its file name) for the CUDA runtime the
    running torch uses: CUDA_HOME (or CUDA_PATH, or /usr/local/cuda) when it has the CUDA
    headers (crt/ included), else the nvidia wheels beside torch. The runtime headers'
    crt/host_config.h comes with a toolkit or the nvidia-cuda-crt wheel."""
    major = (torch.version.cuda or "13").split(".")[0]
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    roots = [home]
    for entry in sys.path:
        for sub in (f"nvidia/cu{major}", "nvidia/cuda_runtime", "nvidia/cuda_crt"):
            roots.append(os.path.join(entry, sub))
    incs, lib = [], None
    for r in roots:
        inc = os.path.join(r, "include")
        has_api = os.path.exists(os.path.join(inc, "cuda_runtime_api.h"))
        has_crt = os.path.exists(os.path.join(inc, "crt", "host_config.h"))
        if (has_api or has_crt) and inc not in incs:
            incs.append(inc)
        for libdir in (os.path.join(r, "lib"), os.path.join(r, "lib64")):
            libs = sorted(glob.glob(os.path.join(libdir, f"libcudart.so.{major}*")))
            if libs and lib is None:
                lib = (libdir, os.path.basename(libs[0]))
    have = lambda f: any(os.path.exists(os.path.join(i, f)) for i in incs)  # noqa: E731
    if lib is None or not have("cuda_runtime_api.h") or not have("crt/host_config.h"):
        raise RuntimeError(
            f"the CUDA {major} runtime's headers (with crt/host_config.h) and libcudart were "
            f"not all found in {home} or beside torch: set CUDA_HOME to a CUDA {major} toolkit "
            f"(or pip install nvidia-cuda-crt)")
    return incs, lib[0], lib[1]


def build(out_dir, verbose=False, profile=False):
    """Builds csrc/torch_allocator.cpp against the running torch into ``out_dir``; returns
    the library's path. Needs a C++ compiler and ninja (torch.utils.cpp_extension.load).
    ``profile``: a build that times each allocation and free (csrc/profile.h), for
    ``profile_take``; never the one the package installs by itself."""
    import torch
    from torch.utils import cpp_extension

    incs, libdir, cudart = _cuda_paths(torch)
    os.makedirs(out_dir, exist_ok=True)
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    # The path it built: a second build in one process (another folder, or the profiling
    # build) gets a versioned name (symmalloc_torch_v1.so) from cpp_extension.
    built = cpp_extension.load(
        name="symmalloc_torch",
        sources=[SOURCE],
        extra_cflags=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter",
                      f'-DSYMM_TORCH_FULL_VERSION=\\"{torch.__version__}\\"']
        + (["-DSYMM_TORCH_PROFILE"] if profile else []),
        extra_include_paths=incs,
        extra_ldflags=[f"-L{torch_lib}", "-lc10_cuda", "-ltorch_cuda", f"-L{libdir}",
                       f"-l:{cudart}", "-ldl"],
        build_directory=out_dir,
        is_python_module=False,
        with_cuda=False,
        verbose=verbose,
    )
    path = os.path.join(out_dir, LIBRARY)
    os.replace(built, path)
    return path


def _cache_dir(torch):
    base = os.environ.get("SYMMALLOC_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "symmalloc")
    tag = f"torch-{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}"
    return os.path.join(base, tag.replace("+", "_"))


def _built_for(path):
    lib = ctypes.CDLL(path)
    lib.symm_torch_built_for.restype = ctypes.c_char_p
    return lib, lib.symm_torch_built_for().decode()


def _candidates(torch):
    env = os.environ.get("SYMMALLOC_TORCH_EXT")
    if env:
        yield env
    here = os.path.dirname(os.path.abspath(__file__))
    yield os.path.join(here, "lib", LIBRARY)
    try:  # beside the libsymmalloc.so in use (a checkout's target/release, a staged folder)
        from ._lib import library_path

        yield os.path.join(os.path.dirname(library_path()), LIBRARY)
    except Exception:  # no library found: install_global() says so itself
        pass
    yield os.path.join(_cache_dir(torch), LIBRARY)


def load(verbose=False):
    """The C++ allocator's library (ctypes) built for the running torch, building it into the
    cache if none is; raises with the reason when it cannot be had."""
    global _loaded
    if _loaded is not None:
        return _loaded
    import torch

    seen = []
    for path in _candidates(torch):
        if not os.path.exists(path):
            continue
        try:
            lib, version = _built_for(path)
        except OSError as e:  # built for another torch or CUDA: its libraries do not resolve
            seen.append(f"{path}: {e}")
            continue
        if version == torch.__version__:
            _loaded = lib
            break
        seen.append(f"{path}: built for torch {version}")
    else:
        try:
            path = build(_cache_dir(torch), verbose=verbose)
        except Exception as e:  # no compiler, no ninja, no CUDA headers: say which
            raise RuntimeError(
                f"the C++ allocator for torch {torch.__version__} could not be built: {e}"
                + (f" (found: {'; '.join(seen)})" if seen else "")) from None
        _loaded, _ = _built_for(path)
    for name in ("symm_torch_install", "symm_torch_selftest"):
        getattr(_loaded, name).restype = ctypes.c_int
    _loaded.symm_torch_installed.restype = ctypes.c_int
    return _loaded


def _call(fn, *args):
    err = ctypes.create_string_buffer(2048)
    r = fn(*args, err, ctypes.sizeof(err))
    return None if r == 0 else err.value.decode(errors="replace")


def _text(fn, size):
    """The text an entry point of the form fn(out, len) -> 0 writes; its message raised when
    it returns nonzero."""
    buf = ctypes.create_string_buffer(size)
    if fn(buf, ctypes.sizeof(buf)) != 0:
        raise RuntimeError(buf.value.decode(errors="replace"))
    return buf.value.decode()


def install(library_path):
    """Installs the C++ allocator over ``library_path`` as PyTorch's CUDA allocator; returns
    None, or the reason it could not."""
    return _call(load().symm_torch_install, library_path.encode())


def selftest(library_path, device=0):
    """The C++ allocator's own checks against ``library_path`` on ``device`` (host backend:
    no GPU needed); returns None when they hold, else the first failure."""
    return _call(load().symm_torch_selftest, library_path.encode(), ctypes.c_int(device))


def profile_take():
    """The loaded C++ allocator's time in allocations and frees per thread (thread id ->
    {"alloc": ..., "free": ...}: count, us, inner_us in libsymmalloc, slow_n/slow_us over
    10 us, max_us) since the last call; raises when the build does not profile."""
    import json

    return json.loads(_text(load().symm_torch_profile, 1 << 16))


def history_state():
    """The C++ allocator's memory history in one line (recorded or not, the trace ring's size,
    skipped actions, open pool routes, caching), for diagnosis."""
    return _text(load().symm_torch_history_state, 4096)


def profile_trace(on, path=None):
    """A profiling build (``profile_take``): keep every allocation and free as an event from
    now (``on``), or write them to ``path`` as CSV (t_ns, dur_ns, inner_ns, tid, op, ptr, size,
    stream) and stop."""
    err = _call(load().symm_torch_profile_trace, ctypes.c_int(1 if on else 0),
                (path or "").encode())
    if err:
        raise RuntimeError(err)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", metavar="DIR", required=True)
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--profile", action="store_true", help="a build that times the allocation path")
    a = ap.parse_args()
    print(build(a.build, verbose=a.verbose, profile=a.profile))
