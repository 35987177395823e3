"""Loading libsymmalloc: where the shared objects are, the ctypes signatures, and the status
codes and errors. The tables below mirror include/symmalloc.h; python/tests/test_header_tables.py
compares them with the header of the checkout."""

import ctypes
import os

__all__ = ["STATUS", "SymmallocError", "library_path", "get_unique_id"]

# symm_status_t, in value order.
STATUS = [
    "SYMM_SUCCESS", "SYMM_ERR_INVALID_ARGUMENT", "SYMM_ERR_OUT_OF_MEMORY", "SYMM_ERR_CUDA",
    "SYMM_ERR_NO_DEVICE", "SYMM_ERR_NOT_SYMMETRIC", "SYMM_ERR_PEER", "SYMM_ERR_TIMEOUT",
    "SYMM_ERR_UNSUPPORTED", "SYMM_ERR_INTERNAL",
]
# torch dtype name -> SYMM_BF16 / SYMM_FP16 / SYMM_FP32.
_DTYPES = {"bfloat16": 0, "float16": 1, "float32": 2}
# op name -> SYMM_SUM / SYMM_MAX / SYMM_MIN.
_OPS = {"sum": 0, "max": 1, "min": 2}
# algorithm name -> SYMM_ALGO_<NAME upper-cased>.
_ALGOS = {"auto": 0, "one_shot": 1, "two_shot": 2, "multimem": 3, "one_shot_ll": 4}
# FP8 output mode -> SYMM_QUANT_FP8_<NAME upper-cased>.
_QUANTS = {"static": 0, "per_token": 1, "per_group_128": 2}
# symm_memory_stats_t's fields, in order (all uint64_t).
_STATS = [
    "allocated_bytes", "reserved_bytes", "peak_allocated_bytes", "active_blocks", "segments",
    "physical_creates", "cache_hits", "cache_misses", "peer_mappings", "staged_collectives",
    "requested_bytes", "physical_releases", "heap_bytes",
]


class SymmallocError(RuntimeError):
    """A failed symmalloc call: ``status`` is the symm_status_t name."""

    def __init__(self, status: str, message: str):
        # symm_last_error() already starts with the status: state it once.
        if message.startswith(status + ": "):
            message = message[len(status) + 2:]
        super().__init__(f"{status}: {message}")
        self.status = status


def _invalid(message: str) -> SymmallocError:
    return SymmallocError("SYMM_ERR_INVALID_ARGUMENT", message)


def _candidates():
    env = os.environ.get("SYMMALLOC_LIBRARY_DIR")
    if env:
        yield env
    here = os.path.dirname(os.path.abspath(__file__))
    yield os.path.join(here, "lib")
    yield os.path.normpath(os.path.join(here, "..", "..", "target", "release"))


def _find(name: str) -> str:
    """``name`` (``libsymmalloc.so``, ``libsymmalloc_pluggable.so``) in the first folder that
    has it: the override, the package's ``lib/`` (the wheel ships them there under these names)
    or a checkout's ``target/release``."""
    tried = []
    for d in _candidates():
        p = os.path.join(d, name)
        if os.path.isfile(p):
            return p
        tried.append(p)
    raise SymmallocError(
        "SYMM_ERR_NO_DEVICE",
        f"{name} not found (tried {', '.join(tried)}); build it with `make build` or set "
        "SYMMALLOC_LIBRARY_DIR to the folder that holds it",
    )


def library_path() -> str:
    """Path of libsymmalloc.so."""
    return _find("libsymmalloc.so")


class _Stats(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in _STATS]


_lib = None


def _library():
    global _lib
    if _lib is None:
        lib = ctypes.CDLL(library_path())
        lib.symm_malloc.restype = ctypes.c_void_p
        lib.symm_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        lib.symm_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        lib.symm_last_error.restype = ctypes.c_char_p
        lib.symm_empty_cache.argtypes = []
        lib.symm_empty_cache.restype = None
        lib.symm_memory_stats_sized.argtypes = [ctypes.c_int, ctypes.POINTER(_Stats), ctypes.c_size_t]
        lib.symm_get_unique_id.argtypes = [ctypes.c_char_p]
        lib.symm_comm_init.argtypes = [
            ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_char_p,
        ]
        lib.symm_comm_init_from_env.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        lib.symm_comm_destroy.argtypes = [ctypes.c_void_p]
        lib.symm_all_reduce_algo.argtypes = [
            ctypes.c_void_p, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
            ctypes.c_uint32, ctypes.c_uint32, ctypes.c_void_p,
        ]
        lib.symm_barrier.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.symm_reduce_scatter.argtypes = [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint32,
            ctypes.c_uint32, ctypes.c_void_p,
        ]
        lib.symm_all_reduce_add_rms_norm.argtypes = [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_size_t, ctypes.c_size_t, ctypes.c_float, ctypes.c_uint32, ctypes.c_void_p,
        ]
        lib.symm_all_reduce_add_rms_norm_quant.argtypes = [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_float, ctypes.c_uint32,
            ctypes.c_uint32, ctypes.c_void_p,
        ]
        lib.symm_all_gather.argtypes = [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint32,
            ctypes.c_void_p,
        ]
        _lib = lib
    return _lib


def _check(status: int) -> None:
    if status != 0:
        msg = _library().symm_last_error().decode(errors="replace")
        name = STATUS[status] if 0 <= status < len(STATUS) else f"status {status}"
        raise SymmallocError(name, msg)


def get_unique_id() -> bytes:
    """A new job id (128 bytes); send it to every rank by any means."""
    buf = ctypes.create_string_buffer(128)
    _check(_library().symm_get_unique_id(buf))
    return buf.raw
