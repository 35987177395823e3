"""symmalloc: symmetric-memory CUDA allocator with NVLink all-reduce kernels.

Pure Python over ctypes. The shared objects are found in ``$SYMMALLOC_LIBRARY_DIR`` (an
override), in this package's ``lib/`` folder (the wheel carries them there), or in the
repository's ``target/release`` when run from a checkout. ``symmalloc.ops`` registers the
collectives as ``torch.ops.symmalloc.*`` custom ops for torch.compile; ``python -m
symmalloc.bench`` is an nccl-tests-style benchmark.

MemPool mode (recommended)::

    import torch, symmalloc
    comm = symmalloc.Communicator.from_env()          # torchrun / mpirun variables
    with torch.cuda.use_mem_pool(symmalloc.mem_pool()):
        x = torch.randn(1 << 20, device="cuda", dtype=torch.bfloat16)
    comm.all_reduce(x)                                 # in place, on the current stream
"""

import ctypes
import itertools
import os
import weakref
from typing import Dict, Optional

__version__ = "0.1.0"  # kept equal to Cargo.toml's version by tests/test_no_gpu.py

__all__ = [
    "SymmallocError",
    "library_path",
    "pluggable_path",
    "get_unique_id",
    "Communicator",
    "mem_pool",
    "install_global",
    "memory_stats",
    "communicator",
]

STATUS = [
    "SYMM_SUCCESS", "SYMM_ERR_INVALID_ARGUMENT", "SYMM_ERR_OUT_OF_MEMORY", "SYMM_ERR_CUDA",
    "SYMM_ERR_NO_DEVICE", "SYMM_ERR_NOT_SYMMETRIC", "SYMM_ERR_PEER", "SYMM_ERR_TIMEOUT",
    "SYMM_ERR_UNSUPPORTED", "SYMM_ERR_INTERNAL",
]
_DTYPES = {"bfloat16": 0, "float16": 1, "float32": 2}
_OPS = {"sum": 0, "max": 1, "min": 2}
_ALGOS = {"auto": 0, "one_shot": 1, "two_shot": 2, "multimem": 3, "one_shot_ll": 4}
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


def _candidates():
    env = os.environ.get("SYMMALLOC_LIBRARY_DIR")
    if env:
        yield env
    here = os.path.dirname(os.path.abspath(__file__))
    yield os.path.join(here, "lib")
    yield os.path.normpath(os.path.join(here, "..", "..", "target", "release"))


def _find(name: str) -> str:
    """``lib<name>.so`` in the first folder that has it; a wheel's copy is ``lib<name>.abi3.so``
    (setuptools-rust's name for a cdylib without Python bindings)."""
    tried = []
    for d in _candidates():
        for n in (name, name[:-3] + ".abi3.so"):
            p = os.path.join(d, n)
            if os.path.isfile(p):
                return p
        tried.append(os.path.join(d, name))
    raise SymmallocError(
        "SYMM_ERR_NO_DEVICE",
        f"{name} not found (tried {', '.join(tried)}); build it with `make build` or set "
        "SYMMALLOC_LIBRARY_DIR to the folder that holds it",
    )


def library_path() -> str:
    """Path of libsymmalloc.so."""
    return _find("libsymmalloc.so")


def pluggable_path() -> str:
    """Path of libsymmalloc_pluggable.so (load only with dlopen/CUDAPluggableAllocator)."""
    p = _find("libsymmalloc_pluggable.so")
    if os.path.dirname(p) != os.path.dirname(library_path()):
        raise SymmallocError("SYMM_ERR_INVALID_ARGUMENT", "the shim must sit beside libsymmalloc.so")
    return p


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


def memory_stats(device: int = 0) -> Dict[str, int]:
    """The allocator's statistics for ``device`` as a dict."""
    s = _Stats()
    _check(_library().symm_memory_stats_sized(device, ctypes.byref(s), ctypes.sizeof(s)))
    return {n: getattr(s, n) for n in _STATS}


def get_unique_id() -> bytes:
    """A new job id (128 bytes); send it to every rank by any means."""
    buf = ctypes.create_string_buffer(128)
    _check(_library().symm_get_unique_id(buf))
    return buf.raw


_raw_stream = None
_VOIDP, _SIZE = ctypes.c_void_p, ctypes.c_size_t
_fast = None  # symmalloc._fastcall.all_reduce once bound; False when the module is absent
_FASTCALL_MODULE = None  # the bound symmalloc._fastcall module, once found


def _eager_fallback(handle: int, *args, **kwargs) -> None:
    """What the compiled eager caller hands back: ``Communicator.all_reduce`` in Python."""
    return Communicator.all_reduce(communicator(handle), *args, **kwargs)


def _fast_all_reduce():
    """The compiled ``symm_all_reduce_algo`` caller (``_fastcall.c``, built into the wheel;
    about 1 us less host time per call than ctypes), or None, when it is not built (a checkout
    without the wheel): then calls go through ctypes. Looked for in the package, then beside
    the library (``_fastcall.abi3.so``), and bound to the library ctypes loaded."""
    global _fast
    if _fast is None:
        mod = None
        try:
            from . import _fastcall as mod  # type: ignore[attr-defined]
        except ImportError:
            import importlib.util

            for d in _candidates():
                path = os.path.join(d, "_fastcall.abi3.so")
                if os.path.isfile(path):
                    spec = importlib.util.spec_from_file_location("symmalloc._fastcall", path)
                    mod = importlib.util.module_from_spec(spec)
                    spec.loader.exec_module(mod)
                    break
        if mod is not None:
            mod.bind(ctypes.cast(_library().symm_all_reduce_algo, ctypes.c_void_p).value)
        _fast = mod.all_reduce if mod is not None else False
        global _FASTCALL_MODULE
        _FASTCALL_MODULE = mod
    return _fast or None


def _stream_getter():
    """``device -> current stream handle`` without a Stream object (about 10x cheaper), bound once."""
    global _raw_stream
    if _raw_stream is None:
        import torch

        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        _raw_stream = raw if raw is not None else (lambda d: torch.cuda.current_stream(d).cuda_stream)
    return _raw_stream


def _current_stream_handle(device: Optional[int] = None) -> int:
    if device is None:
        import torch

        device = torch.cuda.current_device()
    return _stream_getter()(device)


_TORCH_DTYPE_CODES: Dict[object, int] = {}
_COMMS: "weakref.WeakValueDictionary[int, Communicator]" = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)
_FROM_ENV_CALLS = itertools.count()


def communicator(handle: int) -> "Communicator":
    """The live communicator behind ``Communicator.handle`` (the int the custom ops take)."""
    comm = _COMMS.get(handle)
    if comm is None or not comm._comm.value:
        raise SymmallocError("SYMM_ERR_INVALID_ARGUMENT", f"communicator handle {handle} is not a live Communicator of this process (closed, collected, or never made)")
    return comm


def _dtype_code(dtype) -> Optional[int]:
    """The symm_dtype_t of a torch dtype (None when unsupported), cached per dtype object."""
    code = _TORCH_DTYPE_CODES.get(dtype)
    if code is None:
        code = _DTYPES.get(str(dtype).replace("torch.", ""))
        if code is not None:
            _TORCH_DTYPE_CODES[dtype] = code
    return code


class Communicator:
    """One per (process, GPU). ``Communicator(rank, world_size, unique_id)`` or ``from_env()``."""

    def __init__(self, rank: int, world_size: int, unique_id: bytes, device: Optional[int] = None):
        if not isinstance(unique_id, (bytes, bytearray)) or len(unique_id) != 128:
            raise SymmallocError("SYMM_ERR_INVALID_ARGUMENT", "unique_id must be the 128 bytes of get_unique_id()")
        self.rank, self.world_size = rank, world_size
        self.device = rank if device is None else device
        self._comm = ctypes.c_void_p()
        _check(_library().symm_comm_init(ctypes.byref(self._comm), world_size, rank, self.device, bytes(unique_id)))
        self._bind()

    @classmethod
    def from_env(cls, timeout_s: float = 300.0) -> "Communicator":
        """From launcher variables: torchrun (LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, ...) or
        mpirun (OMPI_COMM_WORLD_LOCAL_RANK, ...).

        Under torchrun with torch installed, local rank 0 makes a fresh unique id (random key and
        secret) and hands it to the other local ranks through the launcher's TCP store, then
        deletes it from the store once every rank has joined: no other process can derive it.
        Otherwise (mpirun, or torchrun without torch) ``symm_comm_init_from_env`` derives the id
        from the job's variables, which keeps other jobs out but not a process that can read
        them; set ``SYMMALLOC_UNIQUE_ID`` (the hex of ``get_unique_id()``) to give it a secret."""
        env = os.environ
        store = None
        if "LOCAL_RANK" in env and "MASTER_ADDR" in env and "MASTER_PORT" in env and "SYMMALLOC_UNIQUE_ID" not in env:
            store = _launcher_store(timeout_s)
        if store is None:
            self = cls.__new__(cls)
            self._comm = ctypes.c_void_p()
            _check(_library().symm_comm_init_from_env(ctypes.byref(self._comm)))
            self._bind()
            self.rank = int(env.get("LOCAL_RANK", env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")))
            self.world_size = int(env.get("LOCAL_WORLD_SIZE", env.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1")))
            self.device = self.rank
            return self
        rank, world = _env_int("LOCAL_RANK"), _env_int("LOCAL_WORLD_SIZE")
        # One key per node (GROUP_RANK) and per from_env call of this process (every rank calls
        # from_env in the same order, as with any collective).
        key = f"symmalloc/unique_id/{env.get('GROUP_RANK', '0')}/{next(_FROM_ENV_CALLS)}"
        if rank == 0:
            uid = get_unique_id()
            store.set(key, uid)
        else:
            uid = bytes(store.get(key))
        self = cls(rank, world, uid)
        if rank == 0:  # every rank has joined: the id has done its job
            try:
                store.delete_key(key)
            except Exception:  # an old store without delete_key: the id stays, as before
                pass
        return self

    @classmethod
    def from_process_group(cls, pg=None, device: Optional[int] = None) -> "Communicator":
        """From an initialized ``torch.distributed`` group (default: the world group) whose ranks
        are the GPUs of one node: group rank 0 makes a fresh unique id (random secret) and
        broadcasts it over the group. ``device`` defaults to the current CUDA device (to the
        group rank when CUDA is absent, as on the host backend)."""
        import torch
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise SymmallocError("SYMM_ERR_INVALID_ARGUMENT", "from_process_group needs an initialized torch.distributed process group (call init_process_group first)")
        group = pg if pg is not None else dist.group.WORLD
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        if rank < 0:
            raise SymmallocError("SYMM_ERR_INVALID_ARGUMENT", "this process is not a member of the given process group")
        box = [get_unique_id() if rank == 0 else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        if device is None:
            device = torch.cuda.current_device() if torch.cuda.is_available() else rank
        return cls(rank, world, box[0], device=device)

    def all_reduce(self, tensor, op: str = "sum", algo: str = "auto", out=None) -> None:
        """All-reduce of a contiguous CUDA tensor on the current stream: in place, or into
        ``out`` (same shape and dtype).

        The eager path is kept lean (it is most of an eager call's cost). Where the compiled
        ``_fastcall`` module is present (the wheel has it) and torch is imported, each
        communicator's ``all_reduce`` is that module's caller, which does what this method does
        in C and hands anything unusual back here (see ``_compile_eager``). This method calls the
        library through the compiled module's int-level entry, else through ctypes; only what
        the library cannot see is checked here (dtype, op, algorithm names, contiguity, ``out``'s
        shape); pointers, sizes and symmetry are checked by it."""
        code = _TORCH_DTYPE_CODES.get(tensor.dtype)
        if code is None:
            code = _dtype_code(tensor.dtype)
            if code is None:
                raise SymmallocError("SYMM_ERR_INVALID_ARGUMENT", f"dtype {tensor.dtype} is not bfloat16, float16 or float32")
        if op == "sum" and algo == "auto":  # the defaults: no lookups
            op_code = algo_code = 0
        else:
            op_code, algo_code = _OPS.get(op), _ALGOS.get(algo)
            if op_code is None or algo_code is None:
                raise SymmallocError("SYMM_ERR_INVALID_ARGUMENT", f"op {op!r} / algo {algo!r} unknown; ops {list(_OPS)}, algos {list(_ALGOS)}")
        if not tensor.is_contiguous():
            raise SymmallocError("SYMM_ERR_INVALID_ARGUMENT", "tensor must be contiguous")
        send = tensor.data_ptr()
        if out is None:
            recv, dst = send, tensor
        else:
            if out.dtype != tensor.dtype or out.numel() != tensor.numel() or not out.is_contiguous():
                raise SymmallocError("SYMM_ERR_INVALID_ARGUMENT", "out must be contiguous with the tensor's dtype and size")
            recv, dst = out.data_ptr(), out
        dev = dst.get_device()
        fast = self._fast
        if fast is not None:
            status = fast(self._handle, algo_code, send, recv, tensor.numel(), code, op_code,
                          self._stream(dev) if dev >= 0 else 0)
            if status:
                _check(status)
            return
        # _all_reduce has no argtypes (their per-argument converters cost more than wrapping the
        # three 64-bit values by hand); the small codes pass as C ints, which is what they are.
        ptr = _VOIDP(send)
        status = self._all_reduce(self._comm, algo_code, ptr, ptr if recv == send else _VOIDP(recv),
                                  _SIZE(tensor.numel()), code, op_code, _VOIDP(self._stream(dev) if dev >= 0 else 0))
        if status:
            _check(status)

    def _shapes(self, out, inp, out_per_in: int, in_per_out: int):
        """The symm_dtype_t of two contiguous tensors of one dtype whose sizes relate as given."""
        code = _dtype_code(inp.dtype)
        if code is None or out.dtype != inp.dtype:
            raise SymmallocError("SYMM_ERR_INVALID_ARGUMENT", f"dtypes {out.dtype} / {inp.dtype}: expected one of bfloat16, float16, float32 for both")
        if not (out.is_contiguous() and inp.is_contiguous()):
            raise SymmallocError("SYMM_ERR_INVALID_ARGUMENT", "out and inp must be contiguous")
        if out.numel() * in_per_out != inp.numel() * out_per_in:
            raise SymmallocError("SYMM_ERR_INVALID_ARGUMENT", f"out has {out.numel()} elements and inp {inp.numel()}; expected out = inp * {out_per_in} / {in_per_out} (world size {self.world_size})")
        return code

    def reduce_scatter(self, out, inp, op: str = "sum") -> None:
        """Rank r's ``out`` gets elements [r * n, (r + 1) * n) of the reduction of every rank's
        ``inp`` (n = out.numel(), inp.numel() = world_size * n), on the current stream."""
        code = self._shapes(out, inp, 1, self.world_size)
        op_code = _OPS.get(op)
        if op_code is None:
            raise SymmallocError("SYMM_ERR_INVALID_ARGUMENT", f"op {op!r} unknown; ops {list(_OPS)}")
        dev = out.get_device()
        _check(_library().symm_reduce_scatter(self._comm, inp.data_ptr(), out.data_ptr(), out.numel(), code, op_code,
                                               self._stream(dev) if dev >= 0 else 0))

    def all_gather(self, out, inp) -> None:
        """Every rank's ``inp`` lands at r * inp.numel() of ``out`` (world_size * inp.numel()
        elements), on the current stream."""
        code = self._shapes(out, inp, self.world_size, 1)
        dev = out.get_device()
        _check(_library().symm_all_gather(self._comm, inp.data_ptr(), out.data_ptr(), inp.numel(), code,
                                           self._stream(dev) if dev >= 0 else 0))

    def all_reduce_add_rms_norm(self, x, residual, weight, eps: float = 1e-6, out=None):
        """``residual += allreduce(x)``, then returns ``out = rms_norm(residual) * weight``
        (fp32 inside). x and residual are [tokens, hidden] bf16/fp16, weight [hidden]; ``out``
        (same shape as x) is allocated when not given. On the current stream."""
        code = _dtype_code(x.dtype)
        hidden = weight.numel()
        if code is None or residual.dtype != x.dtype or weight.dtype != x.dtype:
            raise SymmallocError("SYMM_ERR_INVALID_ARGUMENT", f"dtypes x {x.dtype}, residual {residual.dtype}, weight {weight.dtype}: expected one of bfloat16, float16 for all")
        if hidden == 0 or x.numel() % hidden or residual.numel() != x.numel():
            raise SymmallocError("SYMM_ERR_INVALID_ARGUMENT", f"x has {x.numel()} elements, residual {residual.numel()}, weight {hidden}; expected x and residual [tokens, hidden], weight [hidden]")
        if out is None:
            out = x.new_empty(x.shape)
        elif out.dtype != x.dtype or out.numel() != x.numel():
            raise SymmallocError("SYMM_ERR_INVALID_ARGUMENT", "out must have x's dtype and size")
        if not all(t.is_contiguous() for t in (x, residual, weight, out)):
            raise SymmallocError("SYMM_ERR_INVALID_ARGUMENT", "x, residual, weight and out must be contiguous")
        dev = out.get_device()
        _check(_library().symm_all_reduce_add_rms_norm(
            self._comm, x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
            x.numel() // hidden, hidden, eps, code, self._stream(dev) if dev >= 0 else 0))
        return out

    def _bind(self) -> None:
        """What every call needs, looked up once: the entry point and the stream getter; and the
        ``handle`` by which the custom ops (``symmalloc.ops``) name this communicator."""
        self.handle = next(_HANDLES)
        _COMMS[self.handle] = self
        self._handle = self._comm.value or 0  # the symm_comm_t address, for the compiled caller
        self._all_reduce = _library()["symm_all_reduce_algo"]  # a function object of its own
        self._all_reduce.restype = ctypes.c_int
        self._fast = _fast_all_reduce()
        try:
            self._stream = _stream_getter()
        except ImportError:  # no torch (the host backend): only CPU tensors, stream 0
            self._stream = lambda dev: 0
            return
        import torch

        self._compile_eager(torch.Tensor, {getattr(torch, name): code for name, code in _DTYPES.items()}, self._stream)

    def _compile_eager(self, tensor_type, dtypes, stream) -> bool:
        """Puts the eager all-reduce in C (``_fastcall.eager``) in front of the method: an
        instance attribute that shadows ``Communicator.all_reduce``, so ``comm.all_reduce(x)``
        runs no Python frame. It takes exact ``tensor_type`` instances of the three ``dtypes``
        (dtype object -> code) with known op/algo names; anything else (a subclass, an unknown
        name, a mismatched ``out``, a closed communicator) goes to the method, which raises as
        always. close() invalidates it. False when the compiled module is absent."""
        mod = _FASTCALL_MODULE
        if self._fast is None or not self._handle or mod is None or not hasattr(mod, "eager"):
            return False
        self.all_reduce = mod.eager(self.handle, self._handle, _eager_fallback, _check, tensor_type,
                                    tuple(dtypes.items()), dict(_OPS), dict(_ALGOS), stream)
        return True

    def barrier(self) -> None:
        """All ranks meet, ordered on the current stream."""
        try:
            stream = _current_stream_handle(self.device)
        except (ImportError, RuntimeError):  # no torch or no CUDA: the host backend ignores it
            stream = 0
        _check(_library().symm_barrier(self._comm, stream))

    def close(self) -> None:
        if getattr(self, "_comm", None) and self._comm.value:
            self._handle = 0
            caller = self.__dict__.pop("all_reduce", None)
            if caller is not None:
                _FASTCALL_MODULE.invalidate(caller)  # a caller someone kept now takes the fallback
            _check(_library().symm_comm_destroy(self._comm))
            self._comm = ctypes.c_void_p()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _env_int(name: str) -> int:
    v = os.environ.get(name)
    try:
        return int(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise SymmallocError("SYMM_ERR_INVALID_ARGUMENT", f"environment variable {name}={v!r}: expected an integer") from None


def _launcher_store(timeout_s: float):
    """torchrun's store (the agent's, at MASTER_ADDR:MASTER_PORT), or None without torch."""
    try:
        import datetime

        import torch.distributed as dist
    except ImportError:
        return None
    if not dist.is_available():
        return None
    if dist.is_initialized():
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    port = _env_int("MASTER_PORT")
    return dist.TCPStore(os.environ["MASTER_ADDR"], port, is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


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


def install_global() -> None:
    """Make symmalloc PyTorch's CUDA allocator. Must run before CUDA allocates anything, and
    before ``torch.cuda.set_device`` (which sets up PyTorch's own allocator)."""
    import torch

    if torch.cuda.is_initialized() and torch.cuda.memory_reserved() > 0:
        raise SymmallocError("SYMM_ERR_INVALID_ARGUMENT", "install_global() must run before any CUDA tensor is allocated")
    alloc = _pluggable()
    raw = alloc.allocator()
    lib = _library()
    for setter, fn in [
        ("set_begin_allocate_to_pool", "symm_begin_pool"),
        ("set_end_allocate_to_pool_fn", "symm_end_pool"),
        ("set_release_pool", "symm_release_pool"),
        ("set_record_stream_fn", "symm_record_stream"),
    ]:
        if hasattr(raw, setter):  # only some PyTorch builds expose these to Python
            getattr(raw, setter)(ctypes.cast(getattr(lib, fn), ctypes.c_void_p).value)
    try:
        torch.cuda.memory.change_current_allocator(alloc)
    except RuntimeError as e:  # torch's allocator is already set up (set_device, a tensor, ...)
        raise SymmallocError("SYMM_ERR_INVALID_ARGUMENT", f"install_global() must run before any CUDA use in this process, torch.cuda.set_device included: {e}") from None
