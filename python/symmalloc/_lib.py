"""Loading libsymmalloc: where the shared objects are, the ctypes signatures, and the status
codes and errors. The tables below mirror include/symmalloc.h; python/tests/test_header_tables.py
compares them, and the other modules' ctypes structs and prototypes, with the header field by
field."""

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
        return  # set, it is the only place looked at: _find names it when it lacks the file
    here = os.path.dirname(os.path.abspath(__file__))
    yield os.path.join(here, "lib")
    yield os.path.normpath(os.path.join(here, "..", "..", "target", "release"))


def _find(name: str) -> str:
    """``name`` (``libsymmalloc.so``, ``libsymmalloc_pluggable.so``) in the first folder that
    has it: the override, the package's ``lib/`` (the wheel ships them there under these names)
    or a checkout's ``target/release``. A ``SYMMALLOC_LIBRARY_DIR`` that is set is the only
    place looked at, so one pointing at nothing is an error naming it, not a silent fallback."""
    env = os.environ.get("SYMMALLOC_LIBRARY_DIR")
    if env and not os.path.isfile(os.path.join(env, name)):
        what = "does not hold " + name if os.path.isdir(env) else "is not a folder"
        raise SymmallocError(
            "SYMM_ERR_INVALID_ARGUMENT",
            f"SYMMALLOC_LIBRARY_DIR={env} {what}; point it at the folder that holds "
            f"{name} (a checkout's target/release) or unset it",
        )
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


# Expert parallelism (symm_moe_*, docs/moe.md): payload dtypes, index dtypes, struct versions.
# payload name -> SYMM_MOE_BF16 / SYMM_MOE_FP8_E4M3; the torch names and the short ones.
_MOE_DTYPES = {"bfloat16": 0, "bf16": 0, "float8_e4m3fn": 1, "fp8": 1, "fp8_e4m3": 1}
# index dtype name -> SYMM_INDEX_INT32 / SYMM_INDEX_INT64.
_INDEX_DTYPES = {"int32": 0, "int64": 1}
# input -> SYMM_MOE_INPUT_PAYLOAD / SYMM_MOE_INPUT_BF16 (x is the payload, or bf16 quantized in the
# dispatch); scale layout name -> SYMM_MOE_SCALES_ROW_MAJOR / SYMM_MOE_SCALES_COL_TMA.
_MOE_INPUTS = {"payload": 0, "bfloat16": 1}
_MOE_SCALE_LAYOUTS = {"row": 0, "col_tma": 1}
_MOE_CONFIG_VERSION = 3  # SYMM_MOE_CONFIG_VERSION
_MOE_LAYOUT_VERSION = 2  # SYMM_MOE_LAYOUT_VERSION
_MOE_TP_LAYOUT_VERSION = 2  # SYMM_MOE_TP_LAYOUT_VERSION
# mode name -> SYMM_MOE_LOW_LATENCY / SYMM_MOE_THROUGHPUT.
_MOE_MODES = {"low_latency": 0, "throughput": 1}
_MOE_MAX_TOPK = 16  # SYMM_MOE_MAX_TOPK
_MOE_MAX_EXPERTS = 1024  # SYMM_MOE_MAX_EXPERTS
_MOE_FLAG_PROBE = 1  # SYMM_MOE_FLAG_PROBE (flags: the clock probe)
_MOE_PROBE_WORDS = 16  # SYMM_MOE_PROBE_WORDS


class _MoeConfig(ctypes.Structure):
    """``symm_moe_config_t``."""

    _fields_ = [
        ("version", ctypes.c_uint32), ("size", ctypes.c_uint32),
        ("max_tokens_per_rank", ctypes.c_uint64), ("hidden", ctypes.c_uint64),
        ("topk", ctypes.c_uint32), ("num_experts", ctypes.c_uint32),
        ("dtype", ctypes.c_uint32), ("flags", ctypes.c_uint32),
        ("max_recv_per_expert", ctypes.c_uint64),
        ("num_sms", ctypes.c_uint32), ("reserved", ctypes.c_uint32),
        ("input", ctypes.c_uint32), ("scale_layout", ctypes.c_uint32),
        ("scale_ue8m0", ctypes.c_uint32), ("reserved3", ctypes.c_uint32),
        ("mode", ctypes.c_uint32), ("mode_reserved", ctypes.c_uint32),
    ]


class _MoeLayout(ctypes.Structure):
    """``symm_moe_layout_t``: the object's buffers (this rank's addresses) and its shape."""

    _fields_ = [
        ("version", ctypes.c_uint32), ("size", ctypes.c_uint32),
        ("recv_x", ctypes.c_void_p), ("recv_scales", ctypes.c_void_p),
        ("recv_counts", ctypes.c_void_p), ("recv_src", ctypes.c_void_p),
        ("local_experts", ctypes.c_uint64), ("first_expert", ctypes.c_uint64),
        ("max_recv", ctypes.c_uint64), ("hidden", ctypes.c_uint64),
        ("max_tokens_per_rank", ctypes.c_uint64),
        ("topk", ctypes.c_uint32), ("num_experts", ctypes.c_uint32), ("world", ctypes.c_uint32),
        ("rank", ctypes.c_uint32), ("dtype", ctypes.c_uint32), ("reserved", ctypes.c_uint32),
        ("buffer_bytes", ctypes.c_uint64),
        ("input", ctypes.c_uint32), ("scale_layout", ctypes.c_uint32),
        ("scale_ue8m0", ctypes.c_uint32), ("reserved2", ctypes.c_uint32),
        ("scale_stride_expert", ctypes.c_uint64), ("scale_stride_row", ctypes.c_uint64),
        ("scale_stride_group", ctypes.c_uint64),
    ]


class _MoeTpLayout(ctypes.Structure):
    """``symm_moe_tp_layout_t``: a throughput-mode object's buffers and its shape."""

    _fields_ = [
        ("version", ctypes.c_uint32), ("size", ctypes.c_uint32),
        ("recv_x", ctypes.c_void_p), ("recv_scales", ctypes.c_void_p),
        ("recv_topk_idx", ctypes.c_void_p), ("recv_topk_weights", ctypes.c_void_p),
        ("recv_src", ctypes.c_void_p), ("num_recv", ctypes.c_void_p),
        ("num_recv_tokens_per_expert", ctypes.c_void_p), ("expert_offsets", ctypes.c_void_p),
        ("expert_rows", ctypes.c_void_p),
        ("max_rows", ctypes.c_uint64), ("local_experts", ctypes.c_uint64), ("first_expert", ctypes.c_uint64),
        ("hidden", ctypes.c_uint64), ("max_tokens_per_rank", ctypes.c_uint64),
        ("topk", ctypes.c_uint32), ("num_experts", ctypes.c_uint32), ("world", ctypes.c_uint32),
        ("rank", ctypes.c_uint32), ("dtype", ctypes.c_uint32), ("reserved", ctypes.c_uint32),
        ("buffer_bytes", ctypes.c_uint64),
        # version 2
        ("input", ctypes.c_uint32), ("scale_layout", ctypes.c_uint32), ("scale_ue8m0", ctypes.c_uint32),
        ("reserved2", ctypes.c_uint32),
        ("scale_stride_row", ctypes.c_uint64), ("scale_stride_group", ctypes.c_uint64),
    ]


_VP, _SZ, _U32 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint32
# The symm_moe_* prototypes (all return symm_status_t), argument by argument; every pointer is a
# c_void_p but the structs' and the out handle's.
_MOE_PROTOTYPES = {
    "symm_moe_create": [_VP, _SZ, _SZ, _U32, _U32, _U32, _U32, ctypes.POINTER(_VP)],
    "symm_moe_create_config": [_VP, ctypes.POINTER(_MoeConfig), ctypes.POINTER(_VP)],
    "symm_moe_destroy": [_VP],
    "symm_moe_layout": [_VP, ctypes.POINTER(_MoeLayout)],
    "symm_moe_tp_layout": [_VP, ctypes.POINTER(_MoeTpLayout)],
    "symm_moe_dispatch": [_VP, _VP, _VP, _VP, _U32, _VP, _SZ, _U32, _VP],
    "symm_moe_combine": [_VP, _VP, _VP, _VP],
    "symm_moe_check": [_VP],
    "symm_moe_dispatch_send": [_VP, _VP, _VP, _VP, _U32, _VP, _SZ, _U32, _VP],
    "symm_moe_dispatch_recv": [_VP, _VP],
    "symm_moe_combine_send": [_VP, _VP, _VP, _VP],
    "symm_moe_combine_recv": [_VP, _VP],
    "symm_moe_probe": [_VP, _VP, _SZ],
}

_moe_bound = False


def _moe_library():
    """The library with the ``symm_moe_*`` signatures set (once). A library built before them
    is refused with the path and what to do, not an AttributeError."""
    global _moe_bound
    lib = _library()
    if not _moe_bound:
        for name, argtypes in _MOE_PROTOTYPES.items():
            try:
                fn = getattr(lib, name)
            except AttributeError:
                raise SymmallocError(
                    "SYMM_ERR_UNSUPPORTED",
                    f"{library_path()} has no {name} (a build from before expert parallelism); rebuild it with "
                    "`make build` or point SYMMALLOC_LIBRARY_DIR at a newer one") from None
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
        _moe_bound = True
    return lib


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
