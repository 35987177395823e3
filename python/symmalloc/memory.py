"""The allocator side: statistics, PyTorch MemPools backed by symmalloc, and global mode."""

import ctypes
import functools
import os
from typing import Dict, Optional

from ._lib import _STATS, SymmallocError, _check, _find, _invalid, _library, _Stats, library_path

__all__ = ["memory_stats", "pluggable_path", "mem_pool", "install_global", "installed",
           "alloc_conf"]


def memory_stats(device: int = 0) -> Dict[str, int]:
    """The allocator's statistics for ``device`` as a dict."""
    s = _Stats()
    _check(_library().symm_memory_stats_sized(device, ctypes.byref(s), ctypes.sizeof(s)))
    return {n: getattr(s, n) for n in _STATS}


def pluggable_path() -> str:
    """Path of libsymmalloc_pluggable.so (load only with dlopen/CUDAPluggableAllocator)."""
    p = _find("libsymmalloc_pluggable.so")
    if os.path.dirname(p) != os.path.dirname(library_path()):
        raise _invalid("the shim must sit beside libsymmalloc.so")
    return p


_allocator = None  # kept alive for the process: PyTorch crashes if it dies before its pools
_pools: Dict[int, object] = {}


def _pluggable():
    global _allocator
    if _allocator is None:
        import torch

        _allocator = torch.cuda.memory.CUDAPluggableAllocator(pluggable_path(), "malloc", "free")
    return _allocator


def mem_pool(device: Optional[int] = None):
    """A ``torch.cuda.MemPool`` whose segments come from symmalloc (one per device)."""
    import torch

    if device is None:
        device = torch.cuda.current_device()
    if device not in _pools:
        _pools[device] = torch.cuda.MemPool(_pluggable().allocator())
    return _pools[device]


def _wrap_empty_cache(cuda, symm_empty_cache) -> bool:
    """Makes ``cuda.empty_cache()`` (and ``cuda.memory.empty_cache()``, the same function) run
    the original and then ``symm_empty_cache()``. ``cuda`` is the ``torch.cuda`` module (a
    stand-in in the tests). Once per process; False when already wrapped."""
    original = cuda.memory.empty_cache
    if getattr(original, "_symmalloc_original", None) is not None:
        return False

    @functools.wraps(original)
    def empty_cache() -> None:
        original()
        symm_empty_cache()

    empty_cache._symmalloc_original = original  # type: ignore[attr-defined]
    cuda.memory.empty_cache = empty_cache
    cuda.empty_cache = empty_cache
    return True


_installed = None  # "cpp" or "pluggable" once install_global() has run
# PYTORCH_CUDA_ALLOC_CONF keys (PYTORCH_ALLOC_CONF's too) that ask for nothing when they have
# PyTorch's default value; any other value asks for a behaviour symmalloc's heap does not have.
_CONF_DEFAULTS = {
    "backend": "native",
    "expandable_segments": "false",
    "release_lock_on_cudamalloc": "false",
    "throw_on_cudamalloc_oom": "false",
    "graph_capture_record_stream_reuse": "false",
}
_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def _conf_items(text):
    """PyTorch's allocator configuration string as (key, value) pairs: "k:v,k2:[a:1,b:2]"."""
    items, depth, cur = [], 0, ""
    for ch in text + ",":
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            if cur.strip():
                key, _, value = cur.partition(":")
                items.append((key.strip(), value.strip()))
            cur = ""
        else:
            cur += ch
    return items


def _bool_text(value):
    v = value.strip().lower()
    return {"1": "true", "0": "false"}.get(v, v)


def alloc_conf(environ=None, allocator="cpp"):
    """What install_global() does with PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF and
    PYTORCH_NO_CUDA_MEMORY_CACHING (``environ``: os.environ): returns (fraction, caching) for the
    C++ allocator (``allocator="cpp"``), or raises naming every key it cannot honour.

    Honoured: ``per_process_memory_fraction`` (each device's cap, as
    ``set_per_process_memory_fraction``), ``PYTORCH_NO_CUDA_MEMORY_CACHING`` (set at all, as
    PyTorch reads it: caching off, cudaMalloc and cudaFree per tensor), the ``pinned_*`` keys
    (PyTorch's pinned host memory allocator reads them; symmalloc does not replace it), and the
    keys of _CONF_DEFAULTS at their default value. Every other key or value is refused. The
    pluggable path honours none of the first two."""
    env = os.environ if environ is None else environ
    fraction, caching, refused = 1.0, True, []
    for var in _CONF_VARS:
        for key, value in _conf_items(env.get(var, "")):
            if key.startswith("pinned_"):
                continue
            if key in _CONF_DEFAULTS:
                if _bool_text(value) != _CONF_DEFAULTS[key] and value != _CONF_DEFAULTS[key]:
                    refused.append(f"{var}'s {key}:{value}")
                continue
            if key == "per_process_memory_fraction" and allocator == "cpp":
                try:
                    fraction = float(value)
                except ValueError:
                    fraction = -1.0
                if not 0.0 <= fraction <= 1.0:
                    raise _invalid(f"{var}'s per_process_memory_fraction:{value}: expected a "
                                   "fraction in [0, 1]")
                continue
            refused.append(f"{var}'s {key}" + (f":{value}" if value else ""))
    if "PYTORCH_NO_CUDA_MEMORY_CACHING" in env:
        if allocator == "cpp":
            caching = False
        else:
            refused.append("PYTORCH_NO_CUDA_MEMORY_CACHING")
    if refused:
        what = ("symmalloc's heap has no such setting"
                if allocator == "cpp" else "the pluggable path cannot apply it")
        raise SymmallocError(
            "SYMM_ERR_UNSUPPORTED",
            f"install_global(): {', '.join(refused)}: not honoured ({what}). Unset it for "
            "global mode, or leave PyTorch's allocator in place. symmalloc's C++ allocator "
            "honours per_process_memory_fraction, the pinned_* keys and "
            "PYTORCH_NO_CUDA_MEMORY_CACHING (docs/memory.md, \"Global mode's settings\").")
    return fraction, caching


def installed() -> Optional[str]:
    """Which allocator ``install_global()`` installed: ``"cpp"`` (symmalloc's C++ allocator for
    PyTorch), ``"pluggable"`` (CUDAPluggableAllocator over the shim) or None."""
    return _installed


def install_global(allocator: str = "auto") -> None:
    """Make symmalloc PyTorch's CUDA allocator. Must run before CUDA allocates anything, and
    before ``torch.cuda.set_device`` (which sets up PyTorch's own allocator).

    ``allocator="auto"`` (the default; ``"cpp"`` is the same) installs symmalloc's C++ allocator
    for PyTorch (csrc/torch_allocator.cpp, torch 2.10 to 2.15): every method of PyTorch's
    ``CUDAAllocator`` over libsymmalloc's C ABI, so statistics, snapshots, cuDNN benchmark mode,
    CUDA-graph trees (``torch.compile(mode="reduce-overhead")``), ``torch.OutOfMemoryError`` and
    ``set_per_process_memory_fraction`` work (README, "Global mode"). It is the wheel's build
    when that fits the running torch, or one built on first use with
    ``torch.utils.cpp_extension`` and cached (symmalloc._torch_ext). When it cannot be had (an
    unsupported torch, no compiler), this raises a short error naming the torch, the supported
    range, what to install, the compiler's log and the limited path; it never falls back by
    itself. PYTORCH_CUDA_ALLOC_CONF's keys are honoured or refused (``alloc_conf``).

    ``"pluggable"`` takes the limited path on purpose: PyTorch's ``CUDAPluggableAllocator`` over
    libsymmalloc_pluggable.so, without memory statistics, snapshots, CUDA-graph trees or
    ``torch.OutOfMemoryError`` (a failed allocation hands PyTorch a NULL pointer), with every
    hook setter PyTorch exposes (``set_begin_allocate_to_pool``, ``set_end_allocate_to_pool_fn``,
    ``set_release_pool``, ``set_record_stream_fn``, ``set_reset_fn``) set to its ``symm_*``
    function, the begin hook to the shim's ``begin_allocate_to_pool`` (which keeps PyTorch's
    capture filter), and ``torch.cuda.empty_cache`` wrapped to also run ``symm_empty_cache()``.
    Each capture takes a use of its pool and each graph deleted gives one back."""
    global _installed
    import torch

    if allocator not in ("auto", "cpp", "pluggable"):
        raise _invalid(f"install_global(allocator={allocator!r}); expected 'auto', 'cpp' or "
                       "'pluggable'")
    if _installed is not None:
        return
    if torch.cuda.is_initialized() and torch.cuda.memory_reserved() > 0:
        raise _invalid("install_global() must run before any CUDA tensor is allocated")
    if allocator == "pluggable":
        alloc_conf(allocator="pluggable")
        _install_pluggable(torch)
        _installed = "pluggable"
        return
    fraction, caching = alloc_conf(allocator="cpp")
    from . import _torch_ext

    try:
        _torch_ext.load()
    except (_torch_ext.TorchExtUnavailable, OSError) as e:
        raise SymmallocError("SYMM_ERR_UNSUPPORTED", str(e)) from None
    why = _torch_ext.install(library_path())
    if why is not None:
        raise SymmallocError(
            "SYMM_ERR_INVALID_ARGUMENT",
            "install_global() must run before any CUDA use in this process, "
            f"torch.cuda.set_device included: {why}")
    if fraction < 1.0 or not caching:
        _torch_ext.configure(fraction, caching)
    _installed = "cpp"


def _install_pluggable(torch) -> None:
    alloc = _pluggable()
    raw = alloc.allocator()
    lib = _library()
    # The begin hook is the shim's: PyTorch passes it a C++ std::function filter (a capture's
    # accepts the capturing stream, from any thread: the backward allocates on the autograd
    # thread), which the shim hands to symm_begin_pool_filtered.
    shim = ctypes.CDLL(pluggable_path())  # the handle CUDAPluggableAllocator opened
    for setter, owner, fn in [
        ("set_begin_allocate_to_pool", shim, "begin_allocate_to_pool"),
        ("set_end_allocate_to_pool_fn", lib, "symm_end_pool"),
        ("set_release_pool", lib, "symm_release_pool"),
        ("set_record_stream_fn", lib, "symm_record_stream"),
        ("set_reset_fn", lib, "symm_empty_cache"),
    ]:
        if hasattr(raw, setter):  # only some PyTorch builds expose these to Python
            getattr(raw, setter)(ctypes.cast(getattr(owner, fn), ctypes.c_void_p).value)
    try:
        torch.cuda.memory.change_current_allocator(alloc)
    except RuntimeError as e:  # torch's allocator is already set up (set_device, a tensor, ...)
        raise SymmallocError("SYMM_ERR_INVALID_ARGUMENT", f"install_global() must run before any CUDA use in this process, torch.cuda.set_device included: {e}") from None
    _wrap_empty_cache(torch.cuda, lib.symm_empty_cache)
