"""Symmetric memory you program yourself (the C ABI's ``symm_rendezvous``, ``symm_peer_ptr``,
``symm_put``, ``symm_signal``, ``symm_wait`` and ``symm_comm_device``)::

    h = comm.rendezvous(t)            # collective: every rank, the same offset and size
    peer = h.peer_tensor(1)           # a tensor aliasing rank 1's t (same shape, dtype)
    h.buffer_ptrs, h.signal_pad_ptrs  # int64 tensors on t's device: every rank's t and pad
    comm.put(src, 1, t)               # copy engine: src into rank 1's t, on the current stream
    comm.signal(1, slot=3, value=k)   # after the put: raise rank 1's slot 3 to k
    comm.wait(slot=3, value=k)        # hold the current stream until this rank's slot 3 >= k

Works without torch on the host backend (duck-typed tensors: ``data_ptr()``, ``numel()``, a
``dtype``); ``peer_tensor``, ``buffer_ptrs`` and ``signal_pad_ptrs`` need torch. Semantics and
ordering: the README, "Programming symmetric memory"."""

import ctypes
from typing import List

from ._lib import _check, _invalid, _library

__all__ = ["SymmetricHandle", "DeviceComm", "SIGNAL_SLOTS", "MAX_RANKS"]

#: Signal slots per rank and communicator (``SYMM_SIGNAL_SLOTS``).
SIGNAL_SLOTS = 4096
#: Ranks of a communicator, at most (``SYMM_MAX_RANKS``).
MAX_RANKS = 8
#: Bytes of one rank's signal pad: SIGNAL_SLOTS uint64 values, then SIGNAL_SLOTS uint32 writer
#: words (``SYMM_SIGNAL_PAD_BYTES``).
SIGNAL_PAD_BYTES = SIGNAL_SLOTS * 12

_U64, _U32, _I32 = ctypes.c_uint64, ctypes.c_uint32, ctypes.c_int32
_ELEMENT_SIZES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "int64": 8, "int32": 4, "uint8": 1,
                  "int8": 1, "uint64": 8, "int16": 2}


class DeviceComm(ctypes.Structure):
    """``symm_device_comm_t`` (include/symmalloc.h): the communicator as device code sees it."""

    _fields_ = [
        ("struct_size", _U64), ("version", _U32), ("world", _I32), ("rank", _I32), ("signal_slots", _U32),
        ("timeout_ns", _U64), ("heap_bases", _U64 * MAX_RANKS), ("signal_pads", _U64 * MAX_RANKS),
        ("abort_word", _U64), ("error_word", _U64),
    ]


_bound = False


def _lib():
    """The library, with the p2p entry points' signatures set once."""
    global _bound
    lib = _library()
    if not _bound:
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        lib.symm_rendezvous.argtypes = [vp, vp, sz]
        lib.symm_peer_ptr.argtypes = [vp, vp, ctypes.c_int, ctypes.POINTER(vp)]
        lib.symm_put.argtypes = [vp, ctypes.c_int, vp, vp, sz, vp]
        lib.symm_signal.argtypes = [vp, ctypes.c_int, _U32, _U64, vp]
        lib.symm_wait.argtypes = [vp, _U32, _U64, vp]
        lib.symm_comm_device.argtypes = [vp, ctypes.POINTER(DeviceComm), sz]
        _bound = True
    return lib


def _nbytes(t) -> int:
    size = getattr(t, "element_size", None)
    if callable(size):
        return t.numel() * size()
    name = str(t.dtype).replace("torch.", "")
    if name not in _ELEMENT_SIZES:
        raise _invalid(f"dtype {t.dtype}: element size unknown")
    return t.numel() * _ELEMENT_SIZES[name]


def _contiguous(what: str, t) -> None:
    if not t.is_contiguous():
        raise _invalid(f"{what}: the tensor must be contiguous")


def _int(what: str, v, lo: int, hi: int) -> int:
    """An int the C type can carry (the library checks the range it accepts and names it)."""
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v < hi:
        raise _invalid(f"{what} {v!r}: expected an int in [{lo}, {hi})")
    return v


def _tensor_at(ptr: int, like, nbytes: int):
    """A torch tensor of ``like``'s shape, dtype and device over ``nbytes`` at ``ptr`` (not
    owned: the caller keeps the memory alive)."""
    import torch

    storage = torch._C._construct_storage_from_data_pointer(ptr, like.device, nbytes)
    return torch.empty(0, dtype=like.dtype, device=like.device).set_(storage, 0, like.shape, like.stride())


class SymmetricHandle:
    """What ``Communicator.rendezvous(t)`` returns: ``t`` mapped in every rank. Holds ``t`` and
    the communicator; peer tensors hold the handle."""

    def __init__(self, comm, tensor):
        self.comm, self.tensor = comm, tensor
        self.rank, self.world_size = comm.rank, comm.world_size
        self.ptr, self.nbytes = tensor.data_ptr(), _nbytes(tensor)
        self._buffer_ptrs = self._pad_ptrs = None

    def peer_ptr(self, r: int) -> int:
        """Rank ``r``'s address of the tensor (checked each time: a segment released since the
        rendezvous is refused)."""
        _int("peer", r, -(1 << 31), 1 << 31)
        out = ctypes.c_void_p()
        _check(_lib().symm_peer_ptr(self.comm._live(), self.ptr, r, ctypes.byref(out)))
        return out.value or 0

    @property
    def buffer_ptr_list(self) -> List[int]:
        """Every rank's address of the tensor, in this process."""
        return [self.peer_ptr(r) for r in range(self.world_size)]

    def device_comm(self) -> DeviceComm:
        """``symm_comm_device``: the struct the device helpers take."""
        return self.comm.device_comm()

    def peer_tensor(self, r: int):
        """A tensor aliasing rank ``r``'s memory, with the tensor's shape, dtype and strides;
        it keeps this handle (and so the communicator and the tensor) alive."""
        t = _tensor_at(self.peer_ptr(r), self.tensor, self.nbytes)
        t._symmalloc_handle = self
        return t

    def _int64s(self, values: List[int]):
        import torch

        return torch.tensor(values, dtype=torch.int64).to(self.tensor.device)

    @property
    def buffer_ptrs(self):
        """int64 tensor [world_size] on the tensor's device: every rank's address of the tensor
        (for Triton: ``tl.load(ptrs + r).to(tl.pointer_type(tl.float32))``)."""
        if self._buffer_ptrs is None:
            self._buffer_ptrs = self._int64s(self.buffer_ptr_list)
        return self._buffer_ptrs

    @property
    def signal_pad_ptrs(self):
        """int64 tensor [world_size] on the tensor's device: every rank's signal pad
        (SIGNAL_SLOTS uint64 values; store with release, load with acquire, system scope)."""
        if self._pad_ptrs is None:
            d = self.device_comm()
            self._pad_ptrs = self._int64s(list(d.signal_pads[: self.world_size]))
        return self._pad_ptrs


def rendezvous(comm, tensor) -> SymmetricHandle:
    _contiguous("rendezvous", tensor)
    comm._check_devices(tensor)
    h = SymmetricHandle(comm, tensor)
    _check(_lib().symm_rendezvous(comm._live(), h.ptr, h.nbytes))
    return h


def device_comm(comm) -> DeviceComm:
    d = DeviceComm()
    _check(_lib().symm_comm_device(comm._live(), ctypes.byref(d), ctypes.sizeof(d)))
    return d


def put(comm, src, peer: int, dst) -> None:
    _contiguous("put (src)", src)
    _contiguous("put (dst)", dst)
    comm._check_devices(dst)
    n = _nbytes(src)
    if n != _nbytes(dst):
        raise _invalid(f"put: src has {n} bytes and dst {_nbytes(dst)}; expected the same")
    _int("put: peer", peer, -(1 << 31), 1 << 31)
    _check(_lib().symm_put(comm._live(), peer, dst.data_ptr(), src.data_ptr(), n, comm._current_stream()))


def signal(comm, peer: int, slot: int, value: int) -> None:
    _int("signal: peer", peer, -(1 << 31), 1 << 31)
    _int("signal: slot", slot, 0, 1 << 32)
    _int("signal: value", value, 0, 1 << 64)
    _check(_lib().symm_signal(comm._live(), peer, slot, value, comm._current_stream()))


def wait(comm, slot: int, value: int) -> None:
    _int("wait: slot", slot, 0, 1 << 32)
    _int("wait: value", value, 0, 1 << 64)
    _check(_lib().symm_wait(comm._live(), slot, value, comm._current_stream()))
