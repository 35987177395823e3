"""The argument checks and host views of ``Moe`` (moe.py): the constructor's values
(``_uint``, ``_payload_code``), the shape and dtype rules of ``dispatch`` and ``combine``
(``_check_dispatch``, ``_check_combine``), the error text's pieces (``_dname``; ``_fmt`` and
``_device_name`` are _checks.py's), and the tensors over the object's buffer that callers get: ``HostView``
without torch (the host backend), ``_torch_view`` with it.

Invariants: the rules read shapes and dtype names only, never data (moe.py checks devices and
contiguity), so the custom ops' fake implementations apply the same ones as the eager calls;
each refusal is ``_invalid`` (a ``SymmallocError``) naming the value and what was expected, and
for dispatch and combine the rank. Nothing here imports torch (``sys.modules`` or an argument
gives it) or moe.py (the ``Moe`` is an argument; its type hints are strings), so moe.py imports
this module without a cycle. A view owns no memory, except ``HostView.empty``'s (16-byte
aligned)."""

import ctypes
import sys
from typing import TYPE_CHECKING, Tuple

from ._checks import _device_name, _fmt
from ._lib import _INDEX_DTYPES, _MOE_DTYPES, _invalid

if TYPE_CHECKING:  # for the type checker only: importing moe.py at run time would be a cycle
    from .moe import Moe

_SIZES = {"bfloat16": 2, "float8_e4m3fn": 1, "float32": 4, "int32": 4, "int64": 8}
_CTYPES = {"bfloat16": ctypes.c_uint16, "float8_e4m3fn": ctypes.c_uint8, "float32": ctypes.c_float,
           "int32": ctypes.c_int32, "int64": ctypes.c_int64}


def _dname(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _uint(what: str, v, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise _invalid(f"moe: {what} {v!r}; expected an int in [{lo}, {hi}]")
    return v


def _payload_code(dtype) -> int:
    code = _MOE_DTYPES.get(_dname(dtype)) if dtype is not None else None
    if code is None:
        raise _invalid(f"moe: dtype {dtype!r}; expected torch.bfloat16 or torch.float8_e4m3fn (or 'bf16' / 'fp8')")
    return code


class HostView:
    """A tensor-like view of host memory, what ``Moe`` returns to callers without torch (the
    host backend): ``data_ptr()``, ``shape``, ``dtype`` (its name), ``numel()``,
    ``element_size()``, ``is_contiguous()``, ``get_device()`` (-1) and ``tolist()`` (flat;
    bfloat16 and float8 elements as their raw bits). ``HostView.empty(shape, dtype)`` owns its
    memory (16-byte aligned)."""

    def __init__(self, ptr: int, shape, dtype: str, owner=None):
        self.ptr, self.shape, self.dtype, self._owner = ptr, tuple(int(s) for s in shape), dtype, owner

    @classmethod
    def empty(cls, shape, dtype: str) -> "HostView":
        n = 1
        for s in shape:
            n *= int(s)
        buf = (ctypes.c_uint8 * max(16, n * _SIZES[dtype] + 16))()
        ptr = (ctypes.addressof(buf) + 15) & ~15  # 16-byte aligned, as the library wants
        return cls(ptr, shape, dtype, owner=buf)

    def data_ptr(self) -> int:
        return self.ptr

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def element_size(self) -> int:
        return _SIZES[self.dtype]

    def is_contiguous(self) -> bool:
        return True

    def get_device(self) -> int:
        return -1

    def tolist(self) -> list:
        return list((_CTYPES[self.dtype] * self.numel()).from_address(self.ptr)) if self.numel() else []

    def __repr__(self):
        return f"HostView({_fmt(self.shape)}, {self.dtype}, 0x{self.ptr:x})"


def _is_torch(t) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(t, torch.Tensor)


# Shape and dtype rules, on shapes and dtype names only, so that the custom ops' fake
# implementations apply the same ones.

def _check_dispatch(m: "Moe", x, idx, w, scales) -> Tuple[int, int, int]:
    """(num_tokens, k, index dtype code) of a dispatch's arguments (shapes and dtype names),
    or the error naming this rank, the value and what was expected."""
    what = f"moe.dispatch: rank {m.rank}"
    H, T = m.hidden, m.max_tokens_per_rank
    xs, dt = tuple(x.shape), _dname(x.dtype)
    if dt != m.dtype:
        raise _invalid(f"{what}: x has dtype {dt}; expected {m.dtype} (the object's payload dtype)")
    if len(xs) != 2 or xs[1] != H:
        raise _invalid(f"{what}: x has shape {_fmt(xs)}; expected [num_tokens, {H}] (hidden {H})")
    n = xs[0]
    if n > T:
        raise _invalid(f"{what}: x has {n} tokens; expected at most {T} (max_tokens_per_rank)")
    ish, idt = tuple(idx.shape), _dname(idx.dtype)
    if idt not in _INDEX_DTYPES:
        raise _invalid(f"{what}: topk_idx has dtype {idt}; expected int32 or int64")
    if len(ish) != 2 or ish[0] != n or not 1 <= ish[1] <= m.topk:
        raise _invalid(f"{what}: topk_idx has shape {_fmt(ish)}; expected [{n}, k] (x's {n} tokens) "
                       f"with 1 <= k <= {m.topk} (topk)")
    k = ish[1]
    wsh, wdt = tuple(w.shape), _dname(w.dtype)
    if wdt != "float32" or wsh != (n, k):
        raise _invalid(f"{what}: topk_weights is {wdt} {_fmt(wsh)}; expected float32 [{n}, {k}] (topk_idx's shape)")
    if m.dtype == "bfloat16":
        if scales is not None:
            raise _invalid(f"{what}: x_scales given ({_fmt(scales.shape)}) for a bfloat16 payload; expected None "
                           "(scales go with float8_e4m3fn only)")
    else:
        if scales is None:
            raise _invalid(f"{what}: x_scales is None; expected float32 [{n}, {H // 128}] (one scale per 128 "
                           "elements of a float8_e4m3fn row)")
        ssh, sdt = tuple(scales.shape), _dname(scales.dtype)
        if sdt != "float32" or ssh != (n, H // 128):
            raise _invalid(f"{what}: x_scales is {sdt} {_fmt(ssh)}; expected float32 [{n}, {H // 128}] "
                           "(one scale per 128 elements of a row)")
    return n, k, _INDEX_DTYPES[idt]


def _check_combine(m: "Moe", expert_out, num_tokens: int, out) -> None:
    what = f"moe.combine: rank {m.rank}"
    es, edt = tuple(expert_out.shape), _dname(expert_out.dtype)
    if m.mode == "throughput":
        want = (m.max_rows, m.hidden)
        if edt != "bfloat16" or es != want:
            raise _invalid(f"{what}: expert_out is {edt} {_fmt(es)}; expected bfloat16 {_fmt(want)} "
                           "([world_size * max_tokens_per_rank, hidden]: one row per received row, the caller's "
                           "weighted sum over this rank's experts)")
    want = (m.local_experts, m.max_recv, m.hidden)
    if m.mode != "throughput" and (edt != "bfloat16" or es != want):
        raise _invalid(f"{what}: expert_out is {edt} {_fmt(es)}; expected bfloat16 {_fmt(want)} "
                       "([local_experts, max_recv, hidden], the dispatch layout)")
    if out is not None:
        os_, odt = tuple(out.shape), _dname(out.dtype)
        if odt != "bfloat16" or os_ != (num_tokens, m.hidden):
            raise _invalid(f"{what}: out is {odt} {_fmt(os_)}; expected bfloat16 [{num_tokens}, {m.hidden}] "
                           "(the dispatch's tokens x hidden)")


def _torch_view(torch, ptr: int, shape, dtype, device):
    """A torch tensor of ``shape`` and ``dtype`` over memory at ``ptr`` it does not own."""
    n = 1
    for s in shape:
        n *= int(s)
    nbytes = n * torch.empty(0, dtype=dtype).element_size()
    storage = torch._C._construct_storage_from_data_pointer(ptr, device, nbytes)
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(int(s), 1)
    return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, tuple(shape), tuple(reversed(strides)))
