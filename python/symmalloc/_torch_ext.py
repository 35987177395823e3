"""The C++ allocator for PyTorch (csrc/torch_allocator.cpp): found built for the running torch,
built with ``torch.utils.cpp_extension`` when it is not (and cached), loaded and installed.

Supported: torch 2.10 to 2.15 (csrc/torch_compat.h guards each difference). Where it looks, in
order: ``SYMMALLOC_TORCH_EXT`` (a path to a built library: it must exist and fit, or load()
says why), the package's ``lib/torch-2.X/libsymmalloc_torch.so`` for the running minor (the
wheel carries one per supported minor of PyPI's default CUDA build), its
``lib/libsymmalloc_torch.so`` (a package staged by hand), the folder of the
libsymmalloc.so in use (a checkout's ``target/release``: ``make torch-ext``), then the build
cache (``SYMMALLOC_CACHE_DIR``, else ``$XDG_CACHE_HOME/symmalloc``, else ``~/.cache/symmalloc``),
one folder per key: symmalloc's version, a hash of csrc/, torch's version and Python's.

A library fits the running torch when it was built for the same torch minor and CUDA major and
against the same allocator headers (the c10/ and torch/ headers csrc includes, hashed at build
time and compared with the running torch's; version.h aside). A fitting library built for
another patch release is used (docs/memory.md, "Torch versions", says what that risks).

Building: one process per cache key builds at a time (``fcntl.flock`` on ``KEY.lock``, which the
kernel releases when its holder dies, so a killed build never blocks another); the library is
built in a folder of its own and published with one ``os.replace``, so N ranks starting at once
all load the same file. A failed build leaves ``build.log`` (the compiler's output) and
``FAILED`` in the key's folder: later processes raise at once instead of building again, until
``FAILED`` is deleted. ninja and the compiler are looked for beside ``sys.executable`` too (a
venv that is not activated). Nothing here runs on the allocation path.

    python -m symmalloc._torch_ext --build DIR     build into DIR (make test, the wheel)
"""

import contextlib
import ctypes
import glob
import hashlib
import os
import re
import shutil
import sys

__all__ = ["load", "build", "selftest", "prebuilt_dir", "SUPPORTED", "TorchExtUnavailable"]

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(PACKAGE_DIR, "csrc")
SOURCE = os.path.join(CSRC, "torch_allocator.cpp")
LIBRARY = "libsymmalloc_torch.so"
SUPPORTED = ((2, 10), (2, 15))  # the torch minors csrc/torch_compat.h accepts, both included
RANGE = "2.10 to 2.15"
_loaded = None


class TorchExtUnavailable(RuntimeError):
    """No C++ allocator can be had for the running torch; the message says why in one line."""


def _minor(version):
    """(major, minor) of a torch version string ("2.11.0+cu130" -> (2, 11)); None if unparsable."""
    m = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def supported(version):
    """Whether csrc compiles for torch ``version`` (2.10 to 2.15)."""
    mm = _minor(version)
    return mm is not None and SUPPORTED[0] <= mm <= SUPPORTED[1]


def _cuda_major(cuda):
    return (cuda or "").split(".")[0]


def _cuda_paths(torch):
    """(include folders, folder with libcudart, its file name) for the CUDA runtime the
    running torch uses: CUDA_HOME (or CUDA_PATH, or /usr/local/cuda) when it has the CUDA
    headers (crt/ included), else the nvidia wheels beside torch. The runtime headers'
    crt/host_config.h comes with a toolkit or the nvidia-cuda-crt wheel."""
    major = _cuda_major(torch.version.cuda) or "13"
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


def _csrc_files():
    return sorted(glob.glob(os.path.join(CSRC, "*.cpp")) + glob.glob(os.path.join(CSRC, "*.h")))


def _abi_include():
    """The folder of symmalloc.h, the C ABI csrc/api.h includes: the package's copy (the
    wheel's symmalloc/include/), else a checkout's include/."""
    here = os.path.dirname(os.path.abspath(__file__))
    for d in (os.path.join(here, "include"), os.path.join(here, "..", "..", "include")):
        if os.path.isfile(os.path.join(d, "symmalloc.h")):
            return os.path.normpath(d)
    raise RuntimeError(f"symmalloc.h not found in {here}/include or a checkout's include/: "
                       "reinstall the package")


def _source_hash():
    """A hash of csrc/ (every file, by name and content) and of this file (how build() compiles
    it)."""
    h = hashlib.sha256()
    for f in _csrc_files() + [os.path.join(_abi_include(), "symmalloc.h"), os.path.abspath(__file__)]:
        h.update(os.path.basename(f).encode() + b"\0")
        with open(f, "rb") as fh:
            h.update(fh.read() + b"\0")
    return h.hexdigest()[:16]


def _abi_hash(torch):
    """A hash of the running torch's headers that csrc includes (c10/..., torch/...; not
    torch/headeronly/version.h, which names the patch release), or "" when torch ships no
    headers. Equal hashes: the allocator's classes and structs are laid out the same."""
    inc = os.path.join(os.path.dirname(torch.__file__), "include")
    names = set()
    for f in _csrc_files():
        with open(f, encoding="utf-8") as fh:
            names.update(re.findall(r"#include <((?:c10|torch)/[^>]+)>", fh.read()))
    names.discard("torch/headeronly/version.h")
    h = hashlib.sha256()
    for n in sorted(names):
        p = os.path.join(inc, n)
        if not os.path.exists(p):
            return ""
        with open(p, "rb") as fh:
            h.update(n.encode() + b"\0" + fh.read() + b"\0")
    return h.hexdigest()[:16]


def _tool_path():
    """PATH with the folders that hold this Python's ninja and compiler first: beside
    sys.executable (a venv's bin/, used without activating it) and the ninja package's."""
    dirs = [os.path.dirname(os.path.abspath(sys.executable))]
    try:
        import ninja  # the PyPI package: its binary lives in the package

        dirs.append(getattr(ninja, "BIN_DIR", ""))
    except ImportError:
        pass
    old = os.environ.get("PATH", "")
    return os.pathsep.join([d for d in dirs if d and os.path.isdir(d)] + ([old] if old else []))


@contextlib.contextmanager
def _env(**values):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def build(out_dir, verbose=False, profile=False):
    """Builds csrc/torch_allocator.cpp against the running torch into ``out_dir``; returns
    the library's path. Needs a C++ compiler and ninja (torch.utils.cpp_extension.load).
    ``profile``: a build that times each allocation and free (csrc/profile.h), for
    ``profile_take``; never the one the package installs by itself."""
    import torch
    from torch.utils import cpp_extension

    if not supported(torch.__version__):
        raise RuntimeError(f"torch {torch.__version__} is outside the supported range ({RANGE})")
    _check_tools()
    incs, libdir, cudart = _cuda_paths(torch)
    os.makedirs(out_dir, exist_ok=True)
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    with _env(PATH=_tool_path()):
        # The path it built: a second build in one process (another folder, or the profiling
        # build) gets a versioned name (symmalloc_torch_v1.so) from cpp_extension.
        built = cpp_extension.load(
            name="symmalloc_torch",
            sources=[SOURCE],
            extra_cflags=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter",
                          f'-DSYMM_TORCH_FULL_VERSION=\\"{torch.__version__}\\"',
                          f'-DSYMM_TORCH_ABI=\\"{_abi_hash(torch)}\\"',
                          f'-DSYMM_TORCH_CUDA=\\"{torch.version.cuda or ""}\\"']
            + (["-DSYMM_TORCH_PROFILE"] if profile else []),
            extra_include_paths=incs + [_abi_include()],
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


def _cache_root():
    return os.environ.get("SYMMALLOC_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "symmalloc")


def cache_key(torch):
    """The build cache's folder name for the running torch: symmalloc's version, the hash of
    csrc/ and its build, torch's version, Python's version."""
    from . import __version__

    key = (f"symmalloc-{__version__}-src-{_source_hash()}-torch-{torch.__version__}"
           f"-py{sys.version_info[0]}{sys.version_info[1]}")
    return re.sub(r"[^A-Za-z0-9._-]", "_", key)


def _cache_dir(torch):
    return os.path.join(_cache_root(), cache_key(torch))


def _open(path):
    lib = ctypes.CDLL(path)
    for name in ("symm_torch_built_for", "symm_torch_abi", "symm_torch_built_cuda"):
        if hasattr(lib, name):
            getattr(lib, name).restype = ctypes.c_char_p
    return lib


def _built_for(path):
    lib = _open(path)
    return lib, lib.symm_torch_built_for().decode()


def _fits(lib, torch):
    """None when ``lib`` (a loaded library) fits the running torch, else why not."""
    version = lib.symm_torch_built_for().decode()
    if version == torch.__version__:
        return None
    if _minor(version) != _minor(torch.__version__):
        return f"built for torch {version}"
    cuda = lib.symm_torch_built_cuda().decode() if hasattr(lib, "symm_torch_built_cuda") else ""
    abi = lib.symm_torch_abi().decode() if hasattr(lib, "symm_torch_abi") else ""
    if not cuda or _cuda_major(cuda) != _cuda_major(torch.version.cuda):
        return f"built for torch {version} with CUDA {cuda or 'unknown'}"
    if not abi or abi != _abi_hash(torch):
        return f"built for torch {version} against other allocator headers"
    return None


def prebuilt_dir(version):
    """The folder of the wheel's prebuilt for torch ``version``'s minor (``lib/torch-2.X``,
    one per supported minor of PyPI's default CUDA build: scripts/build-torch-prebuilts.sh);
    None outside the supported range."""
    if not supported(version):
        return None
    mm = _minor(version)
    return os.path.join(PACKAGE_DIR, "lib", f"torch-{mm[0]}.{mm[1]}")


def _candidates(version):
    """The libraries to try for torch ``version``, in order: the wheel's prebuilt for that
    minor, a single ``lib/libsymmalloc_torch.so`` (a package staged by hand), then beside the
    libsymmalloc.so in use. Each is loaded only if it fits (_fits)."""
    folder = prebuilt_dir(version)
    if folder:
        yield os.path.join(folder, LIBRARY)
    yield os.path.join(PACKAGE_DIR, "lib", LIBRARY)
    try:  # beside the libsymmalloc.so in use (a checkout's target/release, a staged folder)
        from ._lib import library_path

        yield os.path.join(os.path.dirname(library_path()), LIBRARY)
    except Exception:  # no library found: install_global() says so itself
        pass


def _unavailable(torch, why, log=None, failed=None):
    """The short error: the torch found and the range, the reason in one line, what to do."""
    lines = [f"symmalloc's C++ allocator cannot be had for torch {torch.__version__} "
             f"(supported: torch {RANGE}): {why.rstrip('.')}."]
    if supported(torch.__version__):
        lines.append("Install a C++ compiler (g++) and ninja (pip install ninja) for the build "
                     "on first use, or a symmalloc wheel built for this torch.")
    else:
        lines.append("Install a supported torch (pip install 'torch>=2.10,<2.16').")
    if log:
        lines.append(f"The compiler's log: {log}.")
    if failed:
        lines.append(f"Remembered for this torch: delete {failed} to try again.")
    lines.append('Or take the limited path on purpose: install_global(allocator="pluggable") '
                 "(no memory statistics, snapshots, CUDA-graph trees or torch.OutOfMemoryError).")
    return TorchExtUnavailable("\n".join(lines))


def _first_error(text):
    """The build log's first error line (or its first line), shortened: not the commands ninja
    echoes, nor cpp_extension's "Error building extension" wrapper."""
    lines = [x.strip() for x in text.splitlines()]
    lines = [re.sub(r"^Error building extension '[^']*':\s*", "", x) for x in lines]
    lines = [x for x in lines if x and not x.startswith(("[", "FAILED:", "ninja: build stopped"))
             and not re.match(r"\S*(c\+\+|g\+\+|clang\+\+|cc|gcc) ", x)]
    for x in lines:
        if re.search(r"error|not found|no such file", x, re.IGNORECASE):
            return x[:240]
    return lines[0][:240] if lines else "the build failed with no output"


def _check_tools():
    """Raises, in words a user can act on, when the compiler or ninja cannot be run (looked for
    on _tool_path(): the venv's bin/ first)."""
    path = _tool_path()
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx.split()[0], path=path) is None:
        raise RuntimeError(f"no C++ compiler: {cxx} not found" + (" (CXX)" if "CXX" in os.environ
                                                                  else " on PATH"))
    if shutil.which("ninja", path=path) is None:
        raise RuntimeError("ninja not found beside this Python or on PATH (pip install ninja)")


def _build_cached(torch, verbose=False):
    """The cache's library for the running torch: built once per cache key, under a lock, and
    published atomically; a failure is remembered (FAILED) and raised as the short error."""
    import fcntl

    folder = _cache_dir(torch)
    lib, failed, log = (os.path.join(folder, n) for n in (LIBRARY, "FAILED", "build.log"))
    os.makedirs(folder, exist_ok=True)
    with open(folder + ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released by the kernel if this process dies
        if os.path.exists(lib):  # another process built it while this one waited
            return lib
        if os.path.exists(failed):
            with open(failed, encoding="utf-8", errors="replace") as fh:
                why = fh.read().strip() or "an earlier build failed"
            raise _unavailable(torch, why, log if os.path.exists(log) else None, failed)
        for stale in glob.glob(os.path.join(folder, "build-*")):  # left by a killed build
            shutil.rmtree(stale, ignore_errors=True)
        work = os.path.join(folder, f"build-{os.getpid()}")
        try:
            built = build(work, verbose=verbose)
            os.replace(built, lib)  # atomic: every process sees the whole file or none
            return lib
        except Exception as e:  # no compiler, no ninja, no CUDA headers, a compile error
            text = str(e)
            why = _first_error(text)
            for path, body in ((log, text + "\n"), (failed, why + "\n")):
                with open(path + ".tmp", "w", encoding="utf-8") as fh:
                    fh.write(body)
                os.replace(path + ".tmp", path)
            raise _unavailable(torch, why, log, failed) from None
        finally:
            shutil.rmtree(work, ignore_errors=True)


def load(verbose=False):
    """The C++ allocator's library (ctypes) that fits the running torch, building it into the
    cache if none does; raises TorchExtUnavailable (the short error) when it cannot be had."""
    global _loaded
    if _loaded is not None:
        return _loaded
    import torch

    lib = None
    env = os.environ.get("SYMMALLOC_TORCH_EXT")
    if env:  # asked for by name: it must be there and fit
        if not os.path.isfile(env):
            raise TorchExtUnavailable(f"SYMMALLOC_TORCH_EXT={env}: no such file; unset it or "
                                      "point it at a built libsymmalloc_torch.so")
        try:
            lib = _open(env)
        except OSError as e:
            raise TorchExtUnavailable(f"SYMMALLOC_TORCH_EXT={env} cannot be loaded: {e}") from None
        why = _fits(lib, torch)
        if why:
            raise TorchExtUnavailable(f"SYMMALLOC_TORCH_EXT={env} does not fit torch "
                                      f"{torch.__version__}: {why}")
    elif not supported(torch.__version__):
        raise _unavailable(torch, f"torch {torch.__version__} is outside that range")
    else:
        for path in _candidates(torch.__version__):
            if not os.path.exists(path):
                continue
            try:
                cand = _open(path)
            except OSError:  # built for another torch or CUDA: its libraries do not resolve
                continue
            if _fits(cand, torch) is None:
                lib = cand
                break
        if lib is None:
            try:
                built = _build_cached(torch, verbose=verbose)
            except OSError as e:  # the cache cannot be written (a read-only home, say)
                raise _unavailable(torch, f"the build cache {_cache_root()} cannot be used: {e} "
                                          "(SYMMALLOC_CACHE_DIR names another)") from None
            lib = _open(built)
    _loaded = lib
    for name in ("symm_torch_install", "symm_torch_selftest", "symm_torch_installed"):
        getattr(_loaded, name).restype = ctypes.c_int
    if hasattr(_loaded, "symm_torch_configure"):
        _loaded.symm_torch_configure.restype = ctypes.c_int
        _loaded.symm_torch_configure.argtypes = [ctypes.c_double, ctypes.c_int, ctypes.c_char_p,
                                                 ctypes.c_size_t]
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


def configure(fraction, caching):
    """Sets the installed allocator's per_process_memory_fraction from PYTORCH_CUDA_ALLOC_CONF
    (1.0: none; each device's cap is set at its first allocation) and caching (False:
    PYTORCH_NO_CUDA_MEMORY_CACHING); raises with the reason when it cannot."""
    lib = load()
    if not hasattr(lib, "symm_torch_configure"):
        raise RuntimeError(f"{lib._name} predates symm_torch_configure: rebuild it")
    err = ctypes.create_string_buffer(512)
    if lib.symm_torch_configure(float(fraction), 1 if caching else 0, err, ctypes.sizeof(err)):
        raise RuntimeError(err.value.decode(errors="replace"))


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
