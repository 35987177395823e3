"""The allocator side: statistics, PyTorch MemPools backed by symmalloc, and global mode."""

import ctypes
import functools
import os
from typing import Dict, Optional

from ._lib import _STATS, SymmallocError, _check, _find, _invalid, _library, _Stats, library_path

__all__ = ["memory_stats", "pluggable_path", "mem_pool", "install_global"]


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


def install_global() -> None:
    """Make symmalloc PyTorch's CUDA allocator. Must run before CUDA allocates anything, and
    before ``torch.cuda.set_device`` (which sets up PyTorch's own allocator).

    PyTorch 2.11's ``CUDAPluggableAllocator`` exposes hook setters to Python (seen on torch
    2.11.0+cu130: ``set_begin_allocate_to_pool``, ``set_end_allocate_to_pool_fn``,
    ``set_release_pool``, ``set_record_stream_fn``, ``set_reset_fn``, ...); each one present is
    set to its ``symm_*`` function, ``set_reset_fn`` (what the allocator's ``emptyCache`` calls)
    to ``symm_empty_cache``, and the begin hook to the shim's ``begin_allocate_to_pool``, which
    keeps PyTorch's filter (a graph capture's allocations are those on the capturing stream,
    from any thread, the autograd engine's included). Each capture takes a use of its pool and
    each graph deleted gives one back: a pool shared by several graphs keeps its memory until
    the last is deleted. ``torch.cuda.empty_cache`` (``torch.cuda.memory.empty_cache``,
    which ``torch.cuda.graph`` calls before capture) is also wrapped, for builds whose
    ``emptyCache`` does not call the hook: the original runs, then ``symm_empty_cache()``
    returns symmalloc's cached segments without live blocks (a second call finds nothing)."""
    import torch

    if torch.cuda.is_initialized() and torch.cuda.memory_reserved() > 0:
        raise _invalid("install_global() must run before any CUDA tensor is allocated")
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
