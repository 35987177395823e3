"""The allocator side: statistics, PyTorch MemPools backed by symmalloc, and global mode."""

import ctypes
import functools
import os
from typing import Dict, Optional

from ._lib import _STATS, SymmallocError, _check, _find, _invalid, _library, _Stats, library_path

__all__ = ["memory_stats", "pluggable_path", "mem_pool", "install_global", "installed"]


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
_FALLBACK_LACKS = (
    "memory statistics (torch.cuda.memory_allocated, memory_stats, max_memory_allocated, "
    "reset_peak_memory_stats), memory snapshots (_record_memory_history, _dump_snapshot), "
    "cuDNN benchmark mode, torch.compile(mode='reduce-overhead') (CUDA-graph trees), "
    "torch.OutOfMemoryError (a failed allocation hands PyTorch a NULL pointer) and an "
    "enforced set_per_process_memory_fraction")


def installed() -> Optional[str]:
    """Which allocator ``install_global()`` installed: ``"cpp"`` (symmalloc's C++ allocator for
    PyTorch), ``"pluggable"`` (CUDAPluggableAllocator over the shim) or None."""
    return _installed


def install_global(allocator: str = "auto") -> None:
    """Make symmalloc PyTorch's CUDA allocator. Must run before CUDA allocates anything, and
    before ``torch.cuda.set_device`` (which sets up PyTorch's own allocator).

    ``allocator="auto"`` (the default) installs symmalloc's C++ allocator for PyTorch
    (csrc/torch_allocator.cpp): every method of PyTorch's ``CUDAAllocator`` over
    libsymmalloc's C ABI, so statistics, snapshots, cuDNN benchmark mode, CUDA-graph trees
    (``torch.compile(mode="reduce-overhead")``), ``torch.OutOfMemoryError`` and
    ``set_per_process_memory_fraction`` work (README, "Global mode"). It is the wheel's build
    for the torch it pins, or one built on first use with ``torch.utils.cpp_extension`` and
    cached (symmalloc._torch_ext). When it cannot be had (no compiler, say), one warning names
    what will not work and the pluggable path below is used. ``"cpp"`` raises instead of
    falling back; ``"pluggable"`` takes the pluggable path directly.

    The pluggable path: PyTorch's ``CUDAPluggableAllocator`` over libsymmalloc_pluggable.so,
    with every hook setter PyTorch 2.11 exposes (``set_begin_allocate_to_pool``,
    ``set_end_allocate_to_pool_fn``, ``set_release_pool``, ``set_record_stream_fn``,
    ``set_reset_fn``) set to its ``symm_*`` function, the begin hook to the shim's
    ``begin_allocate_to_pool`` (which keeps PyTorch's capture filter), and
    ``torch.cuda.empty_cache`` wrapped to also run ``symm_empty_cache()``. Each capture takes
    a use of its pool and each graph deleted gives one back."""
    global _installed
    import torch

    if allocator not in ("auto", "cpp", "pluggable"):
        raise _invalid(f"install_global(allocator={allocator!r}); expected 'auto', 'cpp' or "
                       "'pluggable'")
    if _installed is not None:
        return
    if torch.cuda.is_initialized() and torch.cuda.memory_reserved() > 0:
        raise _invalid("install_global() must run before any CUDA tensor is allocated")
    if allocator != "pluggable":
        from . import _torch_ext

        try:
            _torch_ext.load()
        except (RuntimeError, OSError) as e:
            if allocator == "cpp":
                raise SymmallocError("SYMM_ERR_UNSUPPORTED", str(e)) from None
            import warnings

            warnings.warn(
                f"symmalloc: {e}. install_global() falls back to CUDAPluggableAllocator, "
                f"under which these do not work: {_FALLBACK_LACKS}. Install a C++ compiler and "
                "ninja (pip install ninja), or the symmalloc wheel built for this torch.",
                RuntimeWarning, stacklevel=2)
        else:
            why = _torch_ext.install(library_path())
            if why is not None:
                raise SymmallocError(
                    "SYMM_ERR_INVALID_ARGUMENT",
                    "install_global() must run before any CUDA use in this process, "
                    f"torch.cuda.set_device included: {why}")
            _installed = "cpp"
            return
    _install_pluggable(torch)
    _installed = "pluggable"


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
