"""Expert parallelism: MoE dispatch and combine over a communicator (``symm_moe_*``; the
contract is docs/moe.md)::

    moe = comm.moe(max_tokens_per_rank=128, hidden=7168, topk=8, num_experts=256,
                   dtype=torch.bfloat16)            # collective; or dtype=torch.float8_e4m3fn
    d = moe.dispatch(x, topk_idx, topk_weights)     # x_scales=... for float8_e4m3fn
    # d.recv_x [L, R, H]: local expert le's rows are d.recv_x[le, :d.recv_counts[le]]
    expert_out = run_experts(d.recv_x, d.recv_counts)   # [L, R, H] bfloat16, any memory
    y = moe.combine(expert_out)                     # [num_tokens, H] bfloat16
    moe.close()                                     # every rank (or ``with comm.moe(...)``)

``dispatch`` returns a ``MoeDispatch``, a named tuple ``(recv_x, recv_scales, recv_counts,
handle)`` with ``recv_src`` and ``num_tokens`` as attributes too. ``L = num_experts / world``
local experts (this rank holds global experts ``first_expert .. first_expert + L - 1``), ``R =
max_recv`` rows per local expert (``world * max_tokens_per_rank`` unless
``max_recv_per_expert`` is given: then a routing that sends more rows to one expert is an
error, never a drop). ``num_sms`` (0: every SM, at most 132) caps the SMs the dispatch and
combine kernels use, leaving the rest to other work; the results do not depend on it. A local
expert's rows are ordered by source rank, then source token, so
the layout and ``y`` are bitwise the same every run. ``recv_src[le, row]`` is ``(src_rank *
max_tokens_per_rank + token) * topk + k`` of each row. ``recv_counts`` stays on the device:
nothing here synchronizes with the host.

FP8 quantized inside the dispatch: ``comm.moe(..., dtype=torch.float8_e4m3fn,
input_dtype=torch.bfloat16)`` takes bf16 ``x`` (no ``x_scales``) and the dispatch kernel
quantizes each row once, per 128 elements: ``s = max(amax / 448, FLT_MIN)`` (``ue8m0=True``:
rounded up to a power of two), ``q = e4m3(x * (1 / s))`` rounded to nearest even and saturated
to +-448; ``recv_x`` is float8_e4m3fn and ``recv_scales`` holds the ``s``. ``scale_layout``
(any FP8 object): ``"row"`` gives ``recv_scales`` [L, R, H / 128] contiguous; ``"col_tma"``
gives the same shape with strides ``(G * R4, 1, R4)`` (``G = H / 128``, ``R4`` = R rounded up
to a multiple of 4): per local expert a column-major [G, R4] block, what DeepGEMM's grouped FP8
GEMMs read (``get_mn_major_tma_aligned_tensor`` returns such a view unchanged).
``Moe.scale_strides()`` gives the strides.

Arguments of ``dispatch``: ``x`` [num_tokens, H] of the payload dtype (bfloat16 when the object
quantizes) (num_tokens <=
max_tokens_per_rank, may be 0 and differ between ranks), ``x_scales`` [num_tokens, H / 128]
float32 for FP8 (one scale per 128 elements; None for bf16 and when quantizing), ``topk_idx`` [num_tokens, k]
int32 or int64 (global expert ids, -1 for an unused slot; 1 <= k <= topk) and ``topk_weights``
[num_tokens, k] float32, contiguous, on this communicator's device (CPU tensors on the host
backend). Everything is stream-ordered on the current stream, with no host synchronization,
and can be captured in a CUDA graph (a fixed ``num_tokens`` per capture; the routing is read
at each replay).

The returned ``recv_x``, ``recv_scales``, ``recv_counts`` and ``recv_src`` are views of the
object's symmetric buffer, overwritten by its next dispatch: issue the expert work between
dispatch and combine on the same stream (or order it so), and combine the latest dispatch
(``combine(expert_out)``, or with its handle; an older one is refused). ``y[t] = sum_k w[t, k]
* expert_out[row of (t, k)]`` in fp32 (``fmaf`` in increasing k), rounded to bf16 once; a
token with no expert gets zeros.

Errors (``SymmallocError``, the library's message): what Python can see (dtypes, shapes,
devices, contiguity, a stale handle) is refused here, naming this rank, the value and what was
expected; the refusing rank still takes part in the exchange (the library publishes its
refusal), so every other rank's call fails too, naming it, and nothing hangs. What only the
routing shows (an expert id outside -1..num_experts-1, an expert twice in one token's top-k,
more than ``max_recv`` rows for one expert) fails on every rank, naming the rank, token, slot
and value: at the call itself on the host backend; on GPUs, at the next call of the object or
at ``check()`` (the kernel records it; nothing is dispatched). A GPU rank also hears of a
peer's refusal that way. After either kind the object and the communicator stay usable.

Under ``torch.compile`` the methods call the custom ops ``torch.ops.symmalloc.moe_dispatch``
and ``moe_combine`` (registered by ``symmalloc.ops``), whose fake implementations apply the
same shape and dtype checks, so ``dispatch -> experts -> combine`` compiles into one graph.
With ``mode="reduce-overhead"`` (CUDA graph trees) keep dispatch and combine in one compiled
function and return none of the dispatch's views from it: they live in the object's buffer,
not in the graph's pool, and CUDA graph trees refuse such outputs. A dispatch compiled alone
is combined by its handle or, eagerly, by ``combine(expert_out)``; after a compiled combine,
``combine(expert_out)`` needs a new dispatch.
Without torch (the host backend), inputs may be any objects with ``data_ptr()``, ``shape``,
``dtype``, ``is_contiguous()`` and ``get_device()``; the results are then ``HostView`` objects.

Split halves, for two-batch overlap: ``dispatch_send`` / ``dispatch_recv(handle)`` and
``combine_send`` / ``combine_recv()`` give what ``dispatch`` and ``combine`` give, bit for bit,
with other work between the halves (symmalloc/_moe_split.py has the rules).

Throughput mode (``comm.moe(..., mode="throughput")``, DeepEP's normal/prefill mode; its
figures: bench/RESULTS.md): a token goes once to each rank holding one of its experts; ``dispatch``
returns a ``MoeTpDispatch`` ``(recv_x [W*T, H], recv_topk_idx [W*T, K] int32 (local expert ids,
-1 elsewhere), recv_topk_weights [W*T, K], num_recv_tokens_per_expert [L], handle)`` with
``num_recv``, ``recv_src``, ``recv_scales``, ``expert_offsets`` and ``expert_rows`` (a CSR of the
rows by local expert) as attributes; ``combine(expert_out)`` takes one row per received row,
already weighted and summed over this rank's experts. ``input_dtype``, ``scale_layout`` and
``ue8m0`` work as above, ``recv_scales`` being [W*T, H / 128] (``"col_tma"``: strides ``(1,
R4)``, ``R4`` = W*T rounded up to 4). Under torch.compile the methods call the custom ops
``symmalloc::moe_tp_dispatch`` / ``moe_tp_combine``.

This module owns the ``Moe`` object (its lifetime, calls, refusals) and the custom ops; the
argument checks and the views (``HostView``) are in _moe_args.py, and importable from here.
"""

import ctypes
import itertools
import sys
import weakref
from typing import Optional, Tuple

from ._lib import (
    _MOE_CONFIG_VERSION, _MOE_LAYOUT_VERSION, _MOE_MODES, _MOE_TP_LAYOUT_VERSION, SymmallocError, _check, _invalid,
    _moe_library, _MoeConfig, _MoeLayout, _MoeTpLayout,
)
from ._moe_args import _CTYPES  # noqa: F401 (symmalloc.moe._CTYPES: the host tests read raw elements with it)
from ._moe_args import (
    HostView, _check_combine, _check_dispatch, _device_name, _fmt, _is_torch, _payload_code, _quant_codes, _torch_view,
    _uint,
)
from ._moe_split import MoeCombineSend, MoeSend, _Split
from ._moe_types import MoeDispatch, MoeHandle, MoeTpDispatch, MoeTpHandle

__all__ = ["Moe", "MoeDispatch", "MoeHandle", "MoeSend", "MoeCombineSend", "MoeTpDispatch", "MoeTpHandle",
           "HostView", "moe"]

_VOIDP = ctypes.c_void_p
_PAYLOAD_NAMES = ("bfloat16", "float8_e4m3fn")  # by SYMM_MOE_* code
_MOES: "weakref.WeakValueDictionary[int, Moe]" = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)


def moe(handle: int) -> "Moe":
    """The live ``Moe`` behind ``Moe.handle`` (the int the custom ops take)."""
    m = _MOES.get(handle)
    if m is None or not m._ptr:
        raise _invalid(f"moe handle {handle} is not a live Moe of this process (closed, collected, or never made)")
    return m


class Moe(_Split):
    """Dispatch and combine of one MoE layer shape over a communicator (see the module's
    docstring). Made by ``Communicator.moe(...)`` on every rank of the communicator (a
    collective: every rank passes the same values, ``SYMM_ERR_NOT_SYMMETRIC`` on every rank
    otherwise). ``close()``, the context manager or garbage collection destroy it. The split
    halves (``dispatch_send``/``dispatch_recv``, ``combine_send``/``combine_recv``) and the
    clock probe (``probe=True``, ``probe()``) are in _moe_split.py."""

    _ptr = None

    def __init__(self, comm, max_tokens_per_rank: int, hidden: int, topk: int, num_experts: int,
                 dtype="bf16", max_recv_per_expert: Optional[int] = 0, num_sms: Optional[int] = 0,
                 input_dtype=None, scale_layout: str = "row", ue8m0: bool = False, probe: bool = False,
                 mode: str = "low_latency"):
        refused = None
        cfg = _MoeConfig()
        try:
            code = _payload_code(dtype)
            cfg.input, cfg.scale_layout, cfg.scale_ue8m0 = _quant_codes(code, input_dtype, scale_layout, ue8m0)
            cfg.version, cfg.size = _MOE_CONFIG_VERSION, ctypes.sizeof(_MoeConfig)
            cfg.max_tokens_per_rank = _uint("max_tokens_per_rank", max_tokens_per_rank, 1, (1 << 63) - 1)
            cfg.hidden = _uint("hidden", hidden, 1, (1 << 63) - 1)
            cfg.topk = _uint("topk", topk, 1, (1 << 32) - 1)
            cfg.num_experts = _uint("num_experts", num_experts, 1, (1 << 32) - 1)
            cfg.dtype, cfg.flags = code, (1 if probe else 0)  # SYMM_MOE_FLAG_PROBE
            cfg.max_recv_per_expert = _uint("max_recv_per_expert", max_recv_per_expert or 0, 0, (1 << 63) - 1)
            cfg.num_sms = _uint("num_sms", num_sms or 0, 0, (1 << 32) - 1)
            if mode not in _MOE_MODES:
                raise _invalid(f"moe: mode {mode!r}; expected 'low_latency' or 'throughput'")
            cfg.mode = _MOE_MODES[mode]
        except SymmallocError as e:
            refused = e
        lib = _moe_library()
        self._comm = comm
        ptr = _VOIDP()
        if refused is not None:
            # Create is collective: this rank still takes part (a NULL config is its refusal), so
            # the other ranks fail at once naming it instead of waiting for the bootstrap timeout.
            lib.symm_moe_create_config(comm._live(), None, ctypes.byref(ptr))
            raise refused
        _check(lib.symm_moe_create_config(comm._live(), ctypes.byref(cfg), ctypes.byref(ptr)))
        self._ptr = ptr
        self._lib = lib
        self.mode = mode
        if mode == "throughput":
            lay = _MoeTpLayout()
            lay.version, lay.size = _MOE_TP_LAYOUT_VERSION, ctypes.sizeof(_MoeTpLayout)
            _check(lib.symm_moe_tp_layout(ptr, ctypes.byref(lay)))
        else:
            lay = _MoeLayout()
            lay.version, lay.size = _MOE_LAYOUT_VERSION, ctypes.sizeof(_MoeLayout)
            _check(lib.symm_moe_layout(ptr, ctypes.byref(lay)))
        self._layout = lay
        self.rank, self.world_size = int(lay.rank), int(lay.world)
        self.hidden, self.topk, self.num_experts = int(lay.hidden), int(lay.topk), int(lay.num_experts)
        self.max_tokens_per_rank = int(lay.max_tokens_per_rank)
        self.dtype = _PAYLOAD_NAMES[lay.dtype]
        # x is bf16, quantized to the FP8 payload inside the dispatch (input_dtype=torch.bfloat16).
        self.quantize = bool(lay.input)
        self.input_dtype = "bfloat16" if self.quantize else self.dtype
        self.scale_layout = ("row", "col_tma")[lay.scale_layout]
        self.ue8m0 = bool(lay.scale_ue8m0)
        self._device = comm._tensor_device  # -1: the host backend (CPU tensors)
        self._seq = 0  # dispatches issued (eager)
        self._tokens = None  # num_tokens of the latest dispatch the library accepted
        self._last = None  # that dispatch's MoeHandle (what combine(expert_out) combines)
        self._views = {}  # "torch" / "host" -> the buffer's views
        self._op_layout = self._make_op_layout()
        self.handle = next(_HANDLES)
        _MOES[self.handle] = self
        self._torch = None
        self._find_torch()

    def _find_torch(self):
        """torch when the process imported it (then with the custom ops registered), else
        None: callers without torch never pay for its import. Checked at creation and by the
        eager calls, so a compiled function sees it (Dynamo is torch)."""
        if self._torch is None:
            torch = sys.modules.get("torch")
            if torch is not None:
                _register_ops(torch)  # torch.ops.symmalloc.moe_* (once)
                self._torch = torch
        return self._torch

    # Properties of the layout.

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the communicator's arena this object holds (one symmetric block)."""
        return int(self._layout.buffer_bytes)

    @property
    def local_experts(self) -> int:
        """L = num_experts / world_size: the experts this rank holds."""
        return int(self._layout.local_experts)

    @property
    def first_expert(self) -> int:
        """The global id of this rank's local expert 0 (``rank * local_experts``)."""
        return int(self._layout.first_expert)

    @property
    def max_recv(self) -> int:
        """R: rows per local expert in ``recv_x`` (throughput mode: ``max_rows``, all of them)."""
        return int(self.max_rows if self.mode == "throughput" else self._layout.max_recv)

    @property
    def max_rows(self) -> int:
        """Throughput mode: rows of ``recv_x`` (``world_size * max_tokens_per_rank``)."""
        if self.mode != "throughput":
            raise _invalid(f"moe: max_rows is of the throughput mode; this Moe is {self.mode} (see max_recv)")
        return int(self._layout.max_rows)

    # Lifetime.

    def _live(self):
        if not self._ptr:
            raise _invalid(f"moe: this Moe (rank {self.rank}) was closed; make a new one with comm.moe(...)")
        if not self._comm._handle:
            raise _invalid(f"moe: the communicator of this Moe (rank {self.rank}) was closed; "
                           "close the Moe before its communicator")
        return self._ptr

    def close(self) -> None:
        """Destroys the object after the device's work on it, and gives its buffer back to the
        communicator's arena (also after the communicator was closed). Every rank closes its
        object, at the same point of its sequence of calls on the communicator (no rank waits
        for another). Later calls raise; closing twice does nothing. The tensors ``dispatch``
        returned must not be used after."""
        ptr = self._ptr
        if ptr:
            self._ptr = None
            self._views = {}
            self._last = None
            _check(self._lib.symm_moe_destroy(ptr))

    def __enter__(self) -> "Moe":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # Views of the buffer.

    def _buffer_views(self, like_torch: bool):
        """(recv_x, recv_scales or None, recv_counts, recv_src): torch tensors for torch
        callers (on this communicator's device), ``HostView`` objects otherwise."""
        key = "torch" if like_torch else "host"
        v = self._views.get(key)
        if v is None:
            v = self._make_views(like_torch)
            self._views[key] = v
        return v

    def scale_strides(self) -> Tuple[int, int, int]:
        """``recv_scales``' strides in float32 elements (local expert, row, group): ``(R * G, G,
        1)`` row-major, ``(G * R4, 1, R4)`` for ``scale_layout="col_tma"`` (``G = hidden / 128``,
        ``R4`` = ``max_recv`` rounded up to a multiple of 4); zeros for bf16. Throughput mode:
        ``recv_scales`` is [R, G] (``R = max_rows``), one "expert" of these strides."""
        lay = self._layout
        if self.mode == "throughput":
            row, group = int(lay.scale_stride_row), int(lay.scale_stride_group)
            if row == 0:
                return 0, 0, 0
            R, G = self.max_rows, self.hidden // 128
            return (G * group if lay.scale_layout else R * G), row, group
        return int(lay.scale_stride_expert), int(lay.scale_stride_row), int(lay.scale_stride_group)

    def _make_views(self, like_torch: bool):
        lay, L, R, H = self._layout, self.local_experts, self.max_recv, self.hidden
        if self.mode == "throughput":
            K = self.topk
            shapes = ((R, H), (R, H // 128), (R, K), (R, K), (L,), (R,), (1,), (L + 1,), (R * K,))
            ptrs = (lay.recv_x, lay.recv_scales, lay.recv_topk_idx, lay.recv_topk_weights,
                    lay.num_recv_tokens_per_expert, lay.recv_src, lay.num_recv, lay.expert_offsets, lay.expert_rows)
            names = (self.dtype, "float32", "int32", "float32", "int32", "int32", "int32", "int32", "int32")
            strides = [None] * len(shapes)
            strides[1] = self.scale_strides()[1:]  # recv_scales [R, H / 128] in its layout
        else:
            shapes = ((L, R, H), (L, R, H // 128), (L,), (L, R))
            ptrs = (lay.recv_x, lay.recv_scales, lay.recv_counts, lay.recv_src)
            names = (self.dtype, "float32", "int32", "int32")
            strides = (None, self.scale_strides(), None, None)  # recv_scales in its layout
        if like_torch:
            torch = self._torch
            dev = torch.device("cpu") if self._device < 0 else torch.device("cuda", self._device)
            make = lambda p, s, n, st: _torch_view(torch, p, s, getattr(torch, n), dev, st)  # noqa: E731
        else:
            make = lambda p, s, n, st: HostView(p, s, n, strides=st)  # noqa: E731
        return tuple(None if (i == 1 and self.dtype == "bfloat16") else make(p, s, n, st)
                     for i, (p, s, n, st) in enumerate(zip(ptrs, shapes, names, strides)))

    def _stream(self) -> int:
        return self._comm._current_stream()

    def _check_device(self, what: str, **tensors) -> None:
        for name, t in tensors.items():
            if t is None:
                continue
            dev = t.get_device()
            if dev != self._device:
                raise _invalid(f"{what}: rank {self.rank}: {name} is on {_device_name(dev)}; this object's tensors are on "
                               f"{_device_name(self._device)}" + (" (the host backend: CPU tensors)" if self._device < 0 else ""))
            if not t.is_contiguous():
                raise _invalid(f"{what}: rank {self.rank}: {name} {_fmt(t.shape)} is not contiguous; expected a contiguous tensor")

    # Refusals the peers hear of: the library refuses a call with NULL arguments on this rank
    # and publishes the refusal ("rank r refused ..."), so the other ranks' calls end too.

    def _refuse_dispatch(self, err: SymmallocError):
        self._seq += 1
        self._tokens = self._last = None
        # One token, k = 1, no buffers: refused for its NULL pointers (never for k or the
        # token count, which would name the wrong reason to the peers).
        self._lib.symm_moe_dispatch(self._ptr, None, None, None, 0, None, 1, 1, _VOIDP(self._stream()))
        raise err

    def _refuse_combine(self, err: SymmallocError):
        self._lib.symm_moe_combine(self._ptr, None, None, _VOIDP(self._stream()))
        raise err

    # The calls.

    def _compiling(self) -> bool:
        torch = self._torch
        return torch is not None and torch.compiler.is_compiling()

    def dispatch(self, x, topk_idx, topk_weights, x_scales=None) -> MoeDispatch:
        """Sends each token's row (and FP8 scales) to the ranks of its top-k experts. Returns a
        ``MoeDispatch`` ``(recv_x [L, R, H], recv_scales [L, R, H / 128] float32 or None
        (bf16), recv_counts [L] int32, handle)``, views of this object's buffer valid until its
        next dispatch; see the module's docstring for the arguments. Collective, on the current
        stream, no host synchronization."""
        if self._compiling():
            return self._dispatch_op(x, topk_idx, topk_weights, x_scales)
        ptr = self._live()
        self._idle("moe.dispatch")
        try:
            n, k, idx_code = _check_dispatch(self, x, topk_idx, topk_weights, x_scales)
            self._check_device("moe.dispatch", x=x, topk_idx=topk_idx, topk_weights=topk_weights, x_scales=x_scales)
        except SymmallocError as e:
            self._refuse_dispatch(e)
        self._seq += 1
        self._tokens = self._last = None
        status = self._lib.symm_moe_dispatch(
            ptr, x.data_ptr(), None if x_scales is None else x_scales.data_ptr(), topk_idx.data_ptr(), idx_code,
            topk_weights.data_ptr(), n, k, _VOIDP(self._stream()))
        if status:
            _check(status)
        return self._result(_is_torch(x), n)

    def _result(self, like_torch: bool, n: int):
        """The result of the dispatch of ``n`` tokens the library just accepted (the one-call
        form's or the receive half's): the buffer's views (torch or HostView), as this mode's
        named tuple, also kept as the latest dispatch."""
        self._tokens = n
        if like_torch:
            self._find_torch()
        if self.mode == "throughput":
            x_, sc, idx, wt, per, src, nrecv, offs, rows = self._buffer_views(like_torch)
            h = MoeTpHandle(src, nrecv, n, self.handle, self._seq, sc, offs, rows)
            self._last = h
            return MoeTpDispatch(x_, idx, wt, per, h)
        recv_x, recv_scales, recv_counts, recv_src = self._buffer_views(like_torch)
        h = MoeHandle(recv_src, recv_counts, n, self.handle, self._seq)
        self._last = h
        return MoeDispatch(recv_x, recv_scales, recv_counts, h)

    def op_layout(self) -> str:
        """The shapes, dtypes and strides of this object's dispatch results, as the dispatch
        ops' ``layout`` argument: a constant of every traced graph, so that a compiled graph
        (and torch's on-disk caches of it, keyed by the graph) is never reused for an object
        whose results have other shapes, which the ``moe`` handle alone (a number per process)
        does not tell apart. The ops refuse a ``layout`` that is not their object's. Made once,
        at creation (a plain string Dynamo reads without tracing the layout's fields)."""
        return self._op_layout

    def _make_op_layout(self) -> str:
        if self.mode == "throughput":
            return (f"throughput rows={self.max_rows} hidden={self.hidden} topk={self.topk} "
                    f"local_experts={self.local_experts} {self.dtype} from {self.input_dtype} "
                    f"scale_strides={self.scale_strides()}")
        return (f"low_latency local_experts={self.local_experts} max_recv={self.max_recv} hidden={self.hidden} "
                f"{self.dtype} from {self.input_dtype} scale_strides={self.scale_strides()}")

    def _dispatch_op(self, x, topk_idx, topk_weights, x_scales):
        if self.mode == "throughput":
            x_, sc, idx, wt, per, src, nrecv, offs, rows = self._torch.ops.symmalloc.moe_tp_dispatch(
                x, topk_idx, topk_weights, x_scales, self.handle, self.op_layout())
            h = MoeTpHandle(src, nrecv, x.shape[0], self.handle, None, None if self.dtype == "bfloat16" else sc,
                            offs, rows)
            self._last = h  # as below
            return MoeTpDispatch(x_, idx, wt, per, h)
        recv_x, recv_scales, recv_counts, recv_src = self._torch.ops.symmalloc.moe_dispatch(
            x, topk_idx, topk_weights, x_scales, self.handle, self.op_layout())
        h = MoeHandle(recv_src, recv_counts, x.shape[0], self.handle, None)
        self._last = h  # a side effect Dynamo keeps, for combine(expert_out); combine clears it
        return MoeDispatch(recv_x, None if self.dtype == "bfloat16" else recv_scales, recv_counts, h)

    def _handle_of(self, handle) -> MoeHandle:
        """The handle to combine: the one given (or a ``MoeDispatch``'s), else the latest."""
        if isinstance(handle, (MoeDispatch, MoeTpDispatch)):
            return handle.handle
        if handle is None:
            if self._last is None:
                raise _invalid(f"moe.combine: rank {self.rank}: no dispatch to combine (none yet, or the latest one "
                               "failed); expected a successful dispatch first")
            return self._last
        return handle

    def combine(self, expert_out, handle=None, out=None):
        """Sends each row of ``expert_out`` ([L, R, H] bfloat16, the dispatch layout; rows past
        ``recv_counts`` are not read) back to its token's rank and returns ``y`` [num_tokens, H]
        bfloat16 (into ``out`` when given): each token's weighted sum over its top-k experts.
        Combines the latest dispatch; ``handle`` (its ``MoeDispatch`` or handle) may name it,
        and an older one is refused. A dispatch may be combined any number of times (other
        expert outputs, back to back), each ``y`` its own; a combine a rank refused (naming it
        on every rank) may be retried. Collective, on the current stream, no host
        synchronization. Throughput mode: ``expert_out`` is [world_size * max_tokens_per_rank,
        H] bfloat16, row i the caller's weighted sum over this rank's experts for received row i
        (rows past ``num_recv`` are not read); ``y[t]`` is the sum of token t's rows over the
        ranks it went to, in increasing rank order, in fp32, rounded to bf16 once (docs/moe.md,
        "Throughput mode")."""
        if self._compiling():
            h = self._handle_of(handle)
            if self.mode == "throughput":
                y = self._torch.ops.symmalloc.moe_tp_combine(expert_out, h.num_recv, h.recv_src, self.handle,
                                                            h.num_tokens)
            else:
                y = self._torch.ops.symmalloc.moe_combine(expert_out, h.recv_counts, h.recv_src, self.handle,
                                                         h.num_tokens)
            # Nothing of the combined dispatch outlives the graph: a view of the object's buffer
            # kept on it would become a graph output, which CUDA graph trees (mode=
            # "reduce-overhead") refuse (it is not the graph pool's memory).
            self._last = None
            return y if out is None else out.copy_(y)
        ptr = self._live()
        self._idle("moe.combine")
        try:
            h = self._handle_of(handle)
            self._check_handle(h)
            _check_combine(self, expert_out, h.num_tokens, out)
            self._check_device("moe.combine", expert_out=expert_out, out=out)
        except SymmallocError as e:
            self._refuse_combine(e)
        if out is None:
            shape = (h.num_tokens, self.hidden)
            if _is_torch(expert_out):
                out = expert_out.new_empty(shape)
            else:
                out = HostView.empty(shape, "bfloat16")
        _check(self._lib.symm_moe_combine(ptr, expert_out.data_ptr(), out.data_ptr(), _VOIDP(self._stream())))
        return out

    def _check_handle(self, handle) -> None:
        what = f"moe.combine: rank {self.rank}"
        kind = MoeTpHandle if self.mode == "throughput" else MoeHandle
        if not isinstance(handle, kind):
            raise _invalid(f"{what}: handle is {type(handle).__name__}; expected what dispatch returned (a "
                           f"{'MoeTpDispatch' if kind is MoeTpHandle else 'MoeDispatch'} or its handle)")
        if handle.moe != self.handle:
            raise _invalid(f"{what}: the handle is of Moe {handle.moe}; expected one of this Moe ({self.handle})")
        if handle.seq is not None and handle.seq != self._seq:
            raise _invalid(f"{what}: the handle is of dispatch {handle.seq}, and this object's buffers hold dispatch "
                           f"{self._seq}'s rows (each dispatch overwrites them); expected the latest dispatch's handle")
        if handle.num_tokens != self._tokens:
            raise _invalid(f"{what}: the handle has num_tokens {handle.num_tokens}, and the latest dispatch had "
                           f"{'failed' if self._tokens is None else self._tokens}; expected the latest successful "
                           "dispatch's handle")

    def check(self) -> None:
        """Raises the error a dispatch or combine kernel recorded (an expert id out of range, an
        expert twice in a token's top-k, more than ``max_recv`` rows for an expert, a peer's
        refusal), after synchronizing the current stream; clears it. Every call of the object
        also reports it first. On the host backend calls report their errors themselves."""
        ptr = self._live()
        torch = self._find_torch()
        if self._device >= 0 and torch is not None:
            torch.cuda.current_stream(self._device).synchronize()
        _check(self._lib.symm_moe_check(ptr))

    def __repr__(self):
        state = "closed" if not self._ptr else f"{self.buffer_bytes} bytes"
        return (f"Moe(rank {self.rank} of {self.world_size}, T={self.max_tokens_per_rank}, H={self.hidden}, "
                f"topk={self.topk}, E={self.num_experts}, {self.dtype}"
                f"{' from bfloat16' if self.quantize else ''}{', ue8m0' if self.ue8m0 else ''}"
                f"{', col_tma scales' if self.scale_layout == 'col_tma' else ''}, L={self.local_experts}, "
                f"R={self.max_recv}, {self.mode}, {state})")


_OPS_REGISTERED = False


def _register_ops(torch) -> None:
    """Registers ``torch.ops.symmalloc.moe_dispatch`` / ``moe_combine`` and the throughput mode's
    ``moe_tp_dispatch`` / ``moe_tp_combine`` (once; torch is passed
    in, so this module never imports it itself)."""
    global _OPS_REGISTERED
    if _OPS_REGISTERED:
        return
    _OPS_REGISTERED = True
    find = moe  # the module's lookup (the ops' parameter `moe` is a handle and shadows it)

    def find_as(handle: int, layout: str) -> "Moe":
        """The Moe of ``handle``, refused unless its results have ``layout`` (Moe.op_layout)."""
        m = find(handle)
        if layout != m.op_layout():
            raise _invalid(f"symmalloc::moe dispatch op: rank {m.rank}: layout {layout!r} is not Moe {handle}'s "
                           f"({m.op_layout()!r}); expected the op_layout() of the Moe the handle names")
        return m

    # Expert parallelism (symmalloc/moe.py). The results of moe_dispatch are views of the Moe's
    # symmetric buffer (fresh tensor objects each call, over the same memory): valid until the next
    # dispatch of that Moe, which is what the graph's order (dispatch -> experts -> combine) gives.
    # The fakes apply the eager calls' shape and dtype rules (_moe_args.py), naming the rank.

    @torch.library.custom_op("symmalloc::moe_dispatch", mutates_args=())
    def _moe_dispatch(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, x_scales: Optional[torch.Tensor],
                      moe: int, layout: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        m = find_as(moe, layout)
        m.dispatch(x.contiguous(), topk_idx.contiguous(), topk_weights.contiguous(),
                   None if x_scales is None else x_scales.contiguous())
        recv_x, recv_scales, recv_counts, recv_src = m._make_views(True)
        if recv_scales is None:
            recv_scales = x.new_empty((0,), dtype=torch.float32)
        return recv_x, recv_scales, recv_counts, recv_src


    @_moe_dispatch.register_fake
    def _(x, topk_idx, topk_weights, x_scales, moe, layout):
        m = find_as(moe, layout)
        _check_dispatch(m, x, topk_idx, topk_weights, x_scales)
        L, R, H = m.local_experts, m.max_recv, m.hidden
        scales = (x.new_empty((0,), dtype=torch.float32) if m.dtype == "bfloat16" else
                  x.new_empty_strided((L, R, H // 128), m.scale_strides(), dtype=torch.float32))
        return (x.new_empty((L, R, H), dtype=getattr(torch, m.dtype)),
                scales,
                x.new_empty((L,), dtype=torch.int32), x.new_empty((L, R), dtype=torch.int32))


    @torch.library.custom_op("symmalloc::moe_combine", mutates_args=())
    def _moe_combine(expert_out: torch.Tensor, recv_counts: torch.Tensor, recv_src: torch.Tensor, moe: int,
                     num_tokens: int) -> torch.Tensor:
        m = find(moe)
        return m.combine(expert_out.contiguous(), MoeHandle(recv_src, recv_counts, num_tokens, moe, None))


    @_moe_combine.register_fake
    def _(expert_out, recv_counts, recv_src, moe, num_tokens):
        m = find(moe)
        _check_combine(m, expert_out, num_tokens, None)
        return expert_out.new_empty((num_tokens, m.hidden))

    # The throughput mode's pair (docs/moe.md, "Throughput mode"): the dispatch returns every
    # view of MoeTpDispatch and its handle (recv_scales an empty tensor for bf16), the combine
    # takes what it reads of the handle.

    @torch.library.custom_op("symmalloc::moe_tp_dispatch", mutates_args=())
    def _moe_tp_dispatch(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                         x_scales: Optional[torch.Tensor], moe: int, layout: str) -> Tuple[
                             torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                             torch.Tensor, torch.Tensor, torch.Tensor]:
        m = find_as(moe, layout)
        m.dispatch(x.contiguous(), topk_idx.contiguous(), topk_weights.contiguous(),
                   None if x_scales is None else x_scales.contiguous())
        views = list(m._make_views(True))  # fresh tensor objects over the buffer
        if views[1] is None:
            views[1] = x.new_empty((0,), dtype=torch.float32)
        return tuple(views)


    @_moe_tp_dispatch.register_fake
    def _(x, topk_idx, topk_weights, x_scales, moe, layout):
        m = find_as(moe, layout)
        _check_dispatch(m, x, topk_idx, topk_weights, x_scales)
        R, H, K, L = m.max_rows, m.hidden, m.topk, m.local_experts
        i32 = lambda *shape: x.new_empty(shape, dtype=torch.int32)  # noqa: E731
        return (x.new_empty((R, H), dtype=getattr(torch, m.dtype)),
                (x.new_empty((0,), dtype=torch.float32) if m.dtype == "bfloat16" else
                 x.new_empty_strided((R, H // 128), m.scale_strides()[1:], dtype=torch.float32)),
                i32(R, K), x.new_empty((R, K), dtype=torch.float32), i32(L), i32(R), i32(1), i32(L + 1), i32(R * K))


    @torch.library.custom_op("symmalloc::moe_tp_combine", mutates_args=())
    def _moe_tp_combine(expert_out: torch.Tensor, num_recv: torch.Tensor, recv_src: torch.Tensor, moe: int,
                        num_tokens: int) -> torch.Tensor:
        m = find(moe)
        h = MoeTpHandle(recv_src, num_recv, num_tokens, moe, None, None, None, None)
        return m.combine(expert_out.contiguous(), h)


    @_moe_tp_combine.register_fake
    def _(expert_out, num_recv, recv_src, moe, num_tokens):
        m = find(moe)
        _check_combine(m, expert_out, num_tokens, None)
        return expert_out.new_empty((num_tokens, m.hidden))
