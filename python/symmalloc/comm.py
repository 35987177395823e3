"""The communicator: ``Communicator`` (several per process and GPU: ``split`` and ``mem_pool``
live in groups.py; the symmetric memory you program yourself in p2p.py; expert parallelism,
``moe``, in moe.py). Each one is named by a handle in the registry the custom ops use
(``_registry``).

What the library cannot see is checked here, before it is called, with the checks the custom
ops' fake implementations share (``_checks``): dtype names, op and algorithm names, contiguity,
devices, shapes (the library sees element counts only, so a shape it would reinterpret is
refused here), eps, and a closed communicator. Pointers, sizes, alignment and the ranks'
agreement are the library's (docs/python-errors.md)."""

import ctypes
import itertools
import os
from typing import Optional

from . import _fast, _hosts, groups, p2p
from ._checks import (  # noqa: F401 (_dtype_code: bench/tail.py takes it from here)
    _TORCH_DTYPE_CODES, _check_gather, _check_op, _check_rms_norm, _device_name, _dtype_code, _fmt, _fp8_mode, _shape,
)
from ._lib import _ALGOS, _DTYPES, _OPS, _check, _invalid, _library, get_unique_id
from ._registry import communicator, register

__all__ = ["Communicator", "communicator"]

_VOIDP, _SIZE = ctypes.c_void_p, ctypes.c_size_t
_FROM_ENV_CALLS = itertools.count()


def _eager_fallback(handle: int, *args, **kwargs) -> None:
    """What the compiled eager caller hands back: ``Communicator.all_reduce`` in Python."""
    return Communicator.all_reduce(communicator(handle), *args, **kwargs)


class Communicator:
    """A group of ranks on one node; several may live on one GPU (``split``,
    ``from_process_group`` on several groups). ``Communicator(rank, world_size, unique_id)`` or
    ``from_env()``."""

    _closed_by: Optional[str] = None
    _handle = 0

    def __init__(self, rank: int, world_size: int, unique_id: bytes, device: Optional[int] = None):
        if not isinstance(unique_id, (bytes, bytearray)) or len(unique_id) != 128:
            raise _invalid("unique_id must be the 128 bytes of get_unique_id()")
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
            self.rank = int(env.get("LOCAL_RANK", env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")))
            self.world_size = int(env.get("LOCAL_WORLD_SIZE", env.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1")))
            self.device = self.rank
            self._bind()
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
        are the GPUs of one host. Every rank posts its host, device and a fresh unique id
        (random key and secret) to the group's store (``symmalloc._hosts``), and the ranks use
        group rank 0's id. A group that spans hosts, or a rank that cannot use its device, is
        refused on every rank at once, naming the ranks and hosts (a group over several hosts:
        ``symmalloc.HierCommunicator``, or ``symmalloc.from_process_group``, which picks). No
        numpy needed. ``device`` defaults to the current CUDA device (to the global rank on the
        host backend). Several node-local groups at once work (e.g. those of
        ``dist.new_subgroups()``)."""
        rank, world, uid, device = _hosts.node_local_id(pg, device)
        return cls(rank, world, uid, device=device)

    def all_reduce(self, tensor, op: str = "sum", algo: str = "auto", out=None) -> None:
        """All-reduce of a contiguous CUDA tensor on the current stream: in place, or into
        ``out`` (same dtype and element count, contiguous).

        The eager path is kept lean (it is most of an eager call's cost). Where the compiled
        ``_fastcall`` module is present (the wheel has it) and torch is imported, each
        communicator's ``all_reduce`` is that module's caller, which does what this method does
        in C and hands anything unusual back here (see ``_compile_eager``). This method calls the
        library through the compiled module's int-level entry, else through ctypes; only what
        the library cannot see is checked here (dtype, op, algorithm names, contiguity, device,
        ``out``'s size); pointers, sizes and symmetry are checked by it."""
        code = _TORCH_DTYPE_CODES.get(tensor.dtype)
        if code is None:
            code = _dtype_code(tensor.dtype)
            if code is None:
                raise _invalid(f"dtype {tensor.dtype} is not bfloat16, float16 or float32")
        if op == "sum" and algo == "auto":  # the defaults: no lookups
            op_code = algo_code = 0
        else:
            # None is the default, as in the compiled caller.
            op_code, algo_code = _OPS.get("sum" if op is None else op), _ALGOS.get("auto" if algo is None else algo)
            if op_code is None or algo_code is None:
                raise _invalid(f"op {op!r} / algo {algo!r} unknown; ops {list(_OPS)}, algos {list(_ALGOS)}")
        if not tensor.is_contiguous():
            raise _invalid("tensor must be contiguous")
        send = tensor.data_ptr()
        if out is None:
            recv, dst = send, tensor
        else:
            if out.dtype != tensor.dtype or out.numel() != tensor.numel() or not out.is_contiguous():
                raise _invalid("out must be contiguous with the tensor's dtype and size")
            recv, dst = out.data_ptr(), out
        dev = dst.get_device()
        if dev != self._tensor_device or (out is not None and tensor.get_device() != dev):
            self._check_devices(tensor, out)
        fast = self._fast
        if fast is not None:
            status = fast(self._handle, algo_code, send, recv, tensor.numel(), code, op_code,
                          self._stream(dev) if dev >= 0 else 0)
            if status:
                self._raise(status)
            return
        # _all_reduce has no argtypes (their per-argument converters cost more than wrapping the
        # three 64-bit values by hand); the small codes pass as C ints, which is what they are.
        ptr = _VOIDP(send)
        status = self._all_reduce(self._comm, algo_code, ptr, ptr if recv == send else _VOIDP(recv),
                                  _SIZE(tensor.numel()), code, op_code, _VOIDP(self._stream(dev) if dev >= 0 else 0))
        if status:
            self._raise(status)

    def _raise(self, status: int) -> None:
        """A failed call's error; a closed communicator's says so (the library sees NULL)."""
        if not self._handle:
            raise _invalid(self._closed_message())
        _check(status)

    def _closed_message(self) -> str:
        return (f"this Communicator (rank {getattr(self, 'rank', '?')} of {getattr(self, 'world_size', '?')}) "
                f"was closed by {self._closed_by or 'close()'} (or garbage collected); make a new one")

    def _live(self):
        """The symm_comm_t, or the closed communicator's error."""
        if not self._handle:
            raise _invalid(self._closed_message())
        return self._comm

    def _check_devices(self, *tensors) -> None:
        """Every tensor on this communicator's device (CPU tensors on the host backend, where
        the heap is host memory; the GPU ``device`` otherwise)."""
        for t in tensors:
            if t is not None and t.get_device() != self._tensor_device:
                raise _invalid(
                    f"a tensor is on {_device_name(t.get_device())}; this communicator's tensors are on "
                    f"{_device_name(self._tensor_device)}"
                    + (" (the host backend: CPU tensors)" if self._tensor_device < 0 else ""))

    def _same_dtype(self, what: str, *tensors) -> int:
        code = _dtype_code(tensors[0].dtype)
        if code is None or any(t.dtype != tensors[0].dtype for t in tensors):
            raise _invalid(f"{what}: dtypes {', '.join(str(t.dtype) for t in tensors)}: expected one of bfloat16, float16, float32 for all")
        if not all(t.is_contiguous() for t in tensors):
            raise _invalid(f"{what}: every tensor must be contiguous")
        self._check_devices(*tensors)
        return code

    def _stream_of(self, t) -> int:
        dev = t.get_device()
        return self._stream(dev) if dev >= 0 else 0

    def reduce_scatter(self, out, inp, op: str = "sum") -> None:
        """Rank r's ``out`` gets elements [r * n, (r + 1) * n) of the reduction of every rank's
        ``inp`` (n = out.numel(), inp.numel() = world_size * n), on the current stream. Shapes:
        ``inp`` is ``out`` concatenated along dim 0 ([world * d0, ...]) or stacked ([world, ...])."""
        comm = self._live()
        code = self._same_dtype("reduce_scatter", out, inp)
        _check_gather("reduce_scatter", _shape(out), _shape(inp), self.world_size)
        op_code = _check_op(op)
        _check(_library().symm_reduce_scatter(comm, inp.data_ptr(), out.data_ptr(), out.numel(), code, op_code,
                                               self._stream_of(out)))

    def all_gather(self, out, inp) -> None:
        """Every rank's ``inp`` lands at r * inp.numel() of ``out`` (world_size * inp.numel()
        elements), on the current stream. Shapes: ``out`` is ``inp`` concatenated along dim 0
        ([world * d0, ...]) or stacked ([world, ...])."""
        comm = self._live()
        code = self._same_dtype("all_gather", out, inp)
        _check_gather("all_gather", _shape(inp), _shape(out), self.world_size)
        _check(_library().symm_all_gather(comm, inp.data_ptr(), out.data_ptr(), inp.numel(), code,
                                           self._stream_of(out)))

    def all_reduce_add_rms_norm(self, x, residual, weight, eps: float = 1e-6, out=None):
        """``residual += allreduce(x)``, then returns ``out = rms_norm(residual) * weight``
        (fp32 inside). x and residual are [..., hidden] (one shape) bf16/fp16, weight [hidden],
        as ``torch.nn.functional.rms_norm(residual, weight.shape, weight, eps)``; eps finite and
        >= 0; ``out`` (x's shape) is allocated when not given. On the current stream."""
        comm = self._live()
        _check_rms_norm(_shape(x), _shape(residual), _shape(weight), None if out is None else _shape(out), eps)
        code = self._same_dtype("all_reduce_add_rms_norm", x, residual, weight, *(() if out is None else (out,)))
        if out is None:
            out = x.new_empty(x.shape)
        hidden = weight.numel()
        _check(_library().symm_all_reduce_add_rms_norm(
            comm, x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
            x.numel() // hidden, hidden, eps, code, self._stream_of(out)))
        return out

    def all_reduce_add_rms_norm_fp8(self, x, residual, weight, scale=None, eps: float = 1e-6,
                                    group_size: Optional[int] = None, out=None, scale_out=None):
        """``residual += allreduce(x)``, then the RMSNorm output quantized to FP8 e4m3 in the
        same kernel: returns ``(out, scale)`` with ``out = e4m3(rms_norm(residual) * weight /
        s)`` (torch.float8_e4m3fn, x's shape; round to nearest even, saturated to +-448, NaN
        stays NaN) from the fp32 value, no bf16 round trip. ``scale`` given (a float32 tensor of
        one element, on the device; read by the kernel, so a captured graph sees each replay's
        value): static, returned as is. Otherwise the scales are computed and returned, float32:
        ``group_size=None`` one per row ([..., 1], ``max(amax / 448, FLT_MIN)``), 128 one per 128
        elements of a row ([..., hidden / 128], row-major). x, residual bf16/fp16 [..., hidden],
        weight [hidden]; ``out`` / ``scale_out`` are allocated when not given. On the current
        stream (docs: README, "Quantized output")."""
        import torch

        comm = self._live()
        what = "all_reduce_add_rms_norm_fp8"
        _check_rms_norm(_shape(x), _shape(residual), _shape(weight), None, eps)
        code = self._same_dtype(what, x, residual, weight)
        mode, sshape = _fp8_mode(what, _shape(x), None if scale is None else _shape(scale), group_size)
        if out is None:
            out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
        elif out.dtype != torch.float8_e4m3fn or tuple(out.shape) != tuple(x.shape) or not out.is_contiguous():
            raise _invalid(f"{what}: out is {out.dtype} {_fmt(out.shape)}; expected a contiguous float8_e4m3fn tensor of x's shape {_fmt(x.shape)}")
        if scale is None:
            if scale_out is None:
                scale_out = torch.empty(sshape, dtype=torch.float32, device=x.device)
            elif scale_out.dtype != torch.float32 or tuple(scale_out.shape) != sshape or not scale_out.is_contiguous():
                raise _invalid(f"{what}: scale_out is {scale_out.dtype} {_fmt(scale_out.shape)}; expected contiguous float32 {_fmt(sshape)}")
            scale = scale_out
        elif scale.dtype != torch.float32:
            raise _invalid(f"{what}: scale is {scale.dtype}; expected float32")
        self._check_devices(out, scale)
        hidden = weight.numel()
        _check(_library().symm_all_reduce_add_rms_norm_quant(
            comm, x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(), scale.data_ptr(),
            x.numel() // hidden, hidden, eps, code, mode, self._stream_of(out)))
        return out, scale

    @classmethod
    def _adopt(cls, handle: ctypes.c_void_p) -> "Communicator":
        """The ``Communicator`` over a symm_comm_t the library made (a ``split``'s child): its
        rank, size and device from ``symm_comm_info``."""
        i = groups.info(handle)
        c = cls.__new__(cls)
        c._comm = handle
        c.rank, c.world_size, c.device = i.rank, i.world_size, i.device
        c._bind()
        return c

    def _bind(self) -> None:
        """What every call needs, looked up once: the entry point and the stream getter; and the
        ``handle`` by which the custom ops (``symmalloc.ops``) name this communicator."""
        self.handle = register(self)
        self._handle = self._comm.value or 0  # the symm_comm_t address, for the compiled caller
        # The get_device() of the tensors it takes: on the host backend the heap is host memory
        # and tensors are CPU tensors (-1); otherwise this communicator's GPU.
        self._tensor_device = -1 if os.environ.get("SYMMALLOC_BACKEND") == "host" else self.device
        self._all_reduce = _library()["symm_all_reduce_algo"]  # a function object of its own
        self._all_reduce.restype = ctypes.c_int
        self._fast = _fast._fast_all_reduce()
        try:
            self._stream = _fast._stream_getter()
        except ImportError:  # no torch (the host backend): only CPU tensors, stream 0
            self._stream = lambda dev: 0
            return
        import torch

        self._compile_eager(torch.Tensor, {getattr(torch, name): code for name, code in _DTYPES.items()}, self._stream)

    def _compile_eager(self, tensor_type, dtypes, stream) -> bool:
        """Puts the eager all-reduce in C (``_fastcall.eager``) in front of the method: an
        instance attribute that shadows ``Communicator.all_reduce``, so ``comm.all_reduce(x)``
        runs no Python frame. It takes exact ``tensor_type`` instances of the three ``dtypes``
        (dtype object -> code) on this communicator's device with known op/algo names; anything
        else (a subclass, an unknown name, a mismatched ``out``, another device, a closed
        communicator) goes to the method, which raises as always. close() invalidates it. False
        when the compiled module is absent."""
        mod = _fast._fastcall_module()
        if self._fast is None or not self._handle or mod is None or not hasattr(mod, "eager"):
            return False
        self.all_reduce = mod.eager(self.handle, self._handle, _eager_fallback, _check, tensor_type,
                                    tuple(dtypes.items()), dict(_OPS), dict(_ALGOS), stream, self._tensor_device)
        return True

    def barrier(self) -> None:
        """All ranks meet, ordered on the current stream."""
        comm = self._live()
        stream = 0
        if self._tensor_device >= 0:
            try:
                stream = _fast._current_stream_handle(self.device)
            except (ImportError, RuntimeError):  # no torch or no CUDA
                stream = 0
        _check(_library().symm_barrier(comm, stream))

    # Symmetric memory you program yourself (symmalloc/p2p.py; README, "Programming symmetric
    # memory"). Stream-ordered calls take the current stream of this communicator's device.

    def rendezvous(self, tensor):
        """Collective: every rank passes a contiguous tensor at the same heap offset and size.
        Returns a ``p2p.SymmetricHandle`` (``peer_tensor(r)``, ``buffer_ptrs``,
        ``signal_pad_ptrs``)."""
        return p2p.rendezvous(self, tensor)

    def put(self, src, peer: int, dst) -> None:
        """Copies ``src`` into rank ``peer``'s ``dst`` (a rendezvoused tensor of the same byte
        size) with the copy engine, on the current stream."""
        p2p.put(self, src, peer, dst)

    def signal(self, peer: int, slot: int, value: int) -> None:
        """After the current stream's earlier work (puts included), raises rank ``peer``'s
        signal slot ``slot`` to ``value``."""
        p2p.signal(self, peer, slot, value)

    def wait(self, slot: int, value: int) -> None:
        """Holds the current stream until this rank's slot ``slot`` is >= ``value`` (bounded by
        SYMMALLOC_TIMEOUT_S; a timeout is reported by the next call)."""
        p2p.wait(self, slot, value)

    def device_comm(self):
        """``symm_comm_device``: a ``p2p.DeviceComm`` (ctypes) for kernels that take it."""
        return p2p.device_comm(self)

    def _current_stream(self) -> int:
        """The current stream of this communicator's device (0 on the host backend)."""
        if self._tensor_device < 0:
            return 0
        try:
            return _fast._current_stream_handle(self.device)
        except (ImportError, RuntimeError):  # no torch or no CUDA
            return 0

    def split(self, color: Optional[int], key: Optional[int] = None) -> Optional["Communicator"]:
        """A child communicator (``symm_comm_split``): ranks that pass the same ``color`` (>= 0)
        form one, ordered by ``key`` (default: this rank), then by rank; ``None`` (or
        ``symmalloc.groups.SPLIT_NOCOLOR``) takes part and gets ``None``. Collective: every rank
        calls it. A color below -1 on any rank raises on every rank, naming it, and this
        communicator stays usable. The child shares this one's peer mappings, has its own
        buffers and arena, and keeps working after this one is closed."""
        child = groups.split(self, color, key)
        return None if child is None else Communicator._adopt(child)

    def moe(self, max_tokens_per_rank: int, hidden: int, topk: int, num_experts: int, dtype="bf16",
            max_recv_per_expert: int = 0, num_sms: int = 0, input_dtype=None, scale_layout: str = "row",
            ue8m0: bool = False, probe: bool = False, mode: str = "low_latency"):
        """Expert parallelism over this communicator (``symm_moe_create_config``): a
        ``symmalloc.moe.Moe`` with ``dispatch(x, topk_idx, topk_weights, x_scales=None)`` and
        ``combine(expert_out)``, for up to ``max_tokens_per_rank`` tokens of ``hidden`` elements
        per rank, each routed to up to ``topk`` of ``num_experts`` experts (a multiple of the
        world size: rank r holds experts ``r * L .. (r + 1) * L - 1``, ``L = num_experts /
        world_size``). ``dtype``: the payload, ``torch.bfloat16`` (``"bf16"``) or
        ``torch.float8_e4m3fn`` (``"fp8"``, with a float32 scale per 128 elements).
        ``max_recv_per_expert``: rows per local expert; 0 (or None) is ``world_size *
        max_tokens_per_rank``, which no routing overflows; a smaller capacity makes an overflow
        an error, never a drop. ``num_sms``: the most SMs the kernels use (0: what the work keeps busy, at most 132).
        ``input_dtype=torch.bfloat16`` with ``dtype=torch.float8_e4m3fn``: ``dispatch`` takes
        bf16 ``x`` and quantizes it inside the kernel (one float32 scale per 128 elements,
        ``amax / 448``; ``ue8m0=True`` rounds each up to a power of two). ``scale_layout``:
        ``"row"`` (``recv_scales`` [L, R, H / 128] contiguous) or ``"col_tma"`` (the same shape,
        per expert column-major with rows padded to a multiple of 4: DeepGEMM's TMA-aligned
        scales).
        ``probe``: record the kernels' phase times (``Moe.probe()``; for benchmarks).
        ``mode``: ``"low_latency"`` (rows by local expert, ``[L, R, H]``) or ``"throughput"``
        (one row per token and destination rank, ``[world_size * max_tokens_per_rank, H]``;
        ``dispatch`` then returns a ``MoeTpDispatch``); ``input_dtype``, ``scale_layout``,
        ``ue8m0`` and the split halves work in both modes.
        Collective: every rank passes the same values. Its buffer
        (``buffer_bytes``) comes from this communicator's arena (SYMMALLOC_COMM_ARENA_SIZE).
        docs/moe.md is the contract."""
        from .moe import Moe

        return Moe(self, max_tokens_per_rank, hidden, topk, num_experts, dtype=dtype,
                   max_recv_per_expert=max_recv_per_expert, num_sms=num_sms, input_dtype=input_dtype,
                   scale_layout=scale_layout, ue8m0=ue8m0, probe=probe, mode=mode)

    def mem_pool(self):
        """A ``torch.cuda.MemPool`` over this communicator's arena (``symm_comm_malloc``): what
        is allocated in it sits at the same offset on every rank of this communicator, whatever
        other groups or threads allocate on the GPU, given the same sequence of allocations on
        its ranks. ``with torch.cuda.use_mem_pool(comm.mem_pool()): ...``. One per communicator."""
        return groups.mem_pool(self)

    def close(self) -> None:
        """Destroys the communicator (every rank should close its own). Later calls raise
        "this Communicator was closed by close()"; closing twice does nothing. The way back
        from an error that leaves a communicator unusable: close it and make a new one."""
        self._close("close()")

    def _close(self, by: str) -> None:
        if getattr(self, "_comm", None) and self._comm.value:
            self._handle = 0
            self._closed_by = by
            caller = self.__dict__.pop("all_reduce", None)
            if caller is not None:
                _fast._fastcall_module().invalidate(caller)  # a caller someone kept now takes the fallback
            _check(_library().symm_comm_destroy(self._comm))
            self._comm = ctypes.c_void_p()

    def __del__(self):
        try:
            self._close("garbage collection")
        except Exception:
            pass


def _env_int(name: str) -> int:
    v = os.environ.get(name)
    try:
        return int(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise _invalid(f"environment variable {name}={v!r}: expected an integer") from None


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
