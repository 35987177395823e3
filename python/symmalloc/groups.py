"""Several groups on one GPU: ``Communicator.split`` (``symm_comm_split``), what a
communicator is (``symm_comm_info``), and ``Communicator.mem_pool`` (a torch ``MemPool`` over
the communicator's own arena of the device heap).

A torch pluggable allocator passes no pool id to its allocation function, so the library
exports one per MemPool slot (``symm_comm_pool_malloc_<k>``); ``mem_pool`` binds a slot to the
communicator and builds a ``CUDAPluggableAllocator`` over that function of libsymmalloc.so
(frees go to ``symm_free``). The slot is released when the MemPool is collected; until then
allocations fail once the communicator is closed (the pool can still give memory back)."""

import ctypes
import weakref
from typing import Optional

from ._lib import _check, _invalid, _library, library_path

__all__ = ["SPLIT_NOCOLOR", "CommInfo"]

#: ``color`` of a rank that takes part in a split but wants no child (``SYMM_SPLIT_NOCOLOR``).
SPLIT_NOCOLOR = -1


class CommInfo(ctypes.Structure):
    """``symm_comm_info_t``."""

    _fields_ = [
        ("rank", ctypes.c_int32), ("world_size", ctypes.c_int32), ("device", ctypes.c_int32),
        ("comms_on_device", ctypes.c_int32), ("arena_offset", ctypes.c_uint64), ("arena_bytes", ctypes.c_uint64),
    ]


_signatures_set = False


def _lib():
    global _signatures_set
    lib = _library()
    if not _signatures_set:
        vp = ctypes.c_void_p
        lib.symm_comm_split.argtypes = [vp, ctypes.c_int, ctypes.c_int, ctypes.POINTER(vp)]
        lib.symm_comm_info.argtypes = [vp, ctypes.POINTER(CommInfo), ctypes.c_size_t]
        lib.symm_comm_mem_pool_slot.argtypes = [vp, ctypes.POINTER(ctypes.c_int)]
        lib.symm_mem_pool_slot_release.argtypes = [ctypes.c_int]
        lib.symm_comm_malloc.restype = vp
        lib.symm_comm_malloc.argtypes = [vp, ctypes.c_size_t, vp]
        lib.symm_comm_free.argtypes = [vp, vp, ctypes.c_size_t, vp]
        lib.symm_comm_free.restype = None
        _signatures_set = True
    return lib


def info(handle: ctypes.c_void_p) -> CommInfo:
    out = CommInfo()
    _check(_lib().symm_comm_info(handle, ctypes.byref(out), ctypes.sizeof(out)))
    return out


def split(comm, color: Optional[int], key: Optional[int]) -> Optional[ctypes.c_void_p]:
    """``comm.split``: the child's symm_comm_t (``Communicator`` wraps it), or None for
    ``SPLIT_NOCOLOR`` (or None)."""
    color = SPLIT_NOCOLOR if color is None else color
    key = comm.rank if key is None else key
    for name, v in (("color", color), ("key", key)):
        if not isinstance(v, int) or isinstance(v, bool) or not -2**31 <= v < 2**31:
            raise _invalid(f"split: {name} {v!r} is not a 32-bit integer")
    handle = comm._live()
    child = ctypes.c_void_p()
    _check(_lib().symm_comm_split(handle, color, key, ctypes.byref(child)))
    return child if child.value else None


_allocators = []  # kept for the process: PyTorch crashes if an allocator dies before its pools


def _release_slot(slot: int) -> None:
    try:
        _lib().symm_mem_pool_slot_release(slot)
    except Exception:  # interpreter shutdown
        pass


def mem_pool(comm):
    """``comm.mem_pool()``: a ``torch.cuda.MemPool`` whose segments come from the communicator's
    arena, at the same offset on all its ranks whatever else the GPU holds (given the same
    sequence of allocations on those ranks). One per communicator."""
    pool = comm.__dict__.get("_mem_pool")
    if pool is not None:
        return pool
    handle = comm._live()
    if comm._tensor_device < 0:
        raise _invalid("mem_pool: the host backend has no CUDA tensors (a MemPool needs torch.cuda)")
    import torch

    slot = ctypes.c_int()
    _check(_lib().symm_comm_mem_pool_slot(handle, ctypes.byref(slot)))
    alloc = torch.cuda.memory.CUDAPluggableAllocator(library_path(), f"symm_comm_pool_malloc_{slot.value}", "symm_free")
    _allocators.append(alloc)
    pool = torch.cuda.MemPool(alloc.allocator())
    try:
        weakref.finalize(pool, _release_slot, slot.value)
    except TypeError:  # a MemPool without weak references: the slot stays taken
        pass
    comm._mem_pool = pool
    return pool
