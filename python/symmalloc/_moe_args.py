"""The argument checks and host views of ``Moe`` (moe.py): the constructor's values
(``_uint``, ``_payload_code``), the shape and dtype rules of ``dispatch`` and ``combine``
(``_check_dispatch``, ``_check_combine``), the error text's pieces (``_dname``; ``_fmt`` and
``_device_name`` are _checks.py's), and the tensors over the object's buffer that callers get: ``HostView``
without torch (the host backend), ``_torch_view`` with it.

Invariants: the rules read shapes and dtype names only, never data (moe.py checks devices and
contiguity), so the custom ops' fake implementations apply the same ones as the eager calls;
each refusal is ``_invalid`` (a ``SymmallocError``) naming the value and what was expected, and
for dispatch and combine the rank. Nothing here imports torch (``sys.modules`` or an argument
gives it) or moe.py (the ``Moe`` is an argument ``m``), so moe.py imports this module without a
cycle. A view owns no memory, except ``HostView.empty``'s (16-byte
aligned)."""

import ctypes
import sys
from typing import Tuple

from ._checks import _device_name, _fmt
from ._lib import _INDEX_DTYPES, _MOE_DTYPES, _MOE_INPUTS, _MOE_SCALE_LAYOUTS, _invalid

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


def _quant_codes(payload: int, input_dtype, scale_layout, ue8m0) -> Tuple[int, int, int]:
    """(input, scale_layout, scale_ue8m0) codes of ``symm_moe_config_t`` for a payload code and
    the constructor's ``input_dtype`` (None: x is the payload; torch.bfloat16 with a float8
    payload: x is bf16, quantized inside the dispatch), ``scale_layout`` ("row" / "col_tma") and
    ``ue8m0``, or the error naming the value and what was expected."""
    fp8 = payload == _MOE_DTYPES["fp8"]
    name = None if input_dtype is None else _dname(input_dtype)
    if name is None or _MOE_DTYPES.get(name) == payload:
        inp = _MOE_INPUTS["payload"]
    elif name in ("bfloat16", "bf16") and fp8:
        inp = _MOE_INPUTS["bfloat16"]
    else:
        raise _invalid(f"moe: input_dtype {input_dtype!r} with dtype {('bfloat16', 'float8_e4m3fn')[payload]}; expected None "
                       "(x is the payload dtype) or torch.bfloat16 with dtype torch.float8_e4m3fn (bf16 x quantized "
                       "inside the dispatch)")
    layout = _MOE_SCALE_LAYOUTS.get(scale_layout) if isinstance(scale_layout, str) else None
    if layout is None:
        raise _invalid(f"moe: scale_layout {scale_layout!r}; expected 'row' ([L, R, H / 128] row-major) or 'col_tma' "
                       "(per expert column-major, rows padded to a multiple of 4: DeepGEMM's TMA-aligned scales)")
    if layout and not fp8:
        raise _invalid(f"moe: scale_layout {scale_layout!r} with dtype bfloat16 (no scales); expected 'row'")
    if not isinstance(ue8m0, bool):
        raise _invalid(f"moe: ue8m0 {ue8m0!r}; expected True or False")
    if ue8m0 and inp != _MOE_INPUTS["bfloat16"]:
        raise _invalid("moe: ue8m0=True without quantization; expected input_dtype=torch.bfloat16 with dtype "
                       "torch.float8_e4m3fn (the dispatch then computes the scales, rounded up to powers of two)")
    return inp, layout, int(ue8m0)


class HostView:
    """A tensor-like view of host memory, what ``Moe`` returns to callers without torch (the
    host backend): ``data_ptr()``, ``shape``, ``dtype`` (its name), ``numel()``,
    ``element_size()``, ``is_contiguous()``, ``get_device()`` (-1), ``stride()`` (in elements)
    and ``tolist()`` (flat, in the logical row-major order whatever the strides; bfloat16 and
    float8 elements as their raw bits). ``HostView.empty(shape, dtype)`` owns its memory
    (16-byte aligned)."""

    def __init__(self, ptr: int, shape, dtype: str, owner=None, strides=None):
        self.ptr, self.shape, self.dtype, self._owner = ptr, tuple(int(s) for s in shape), dtype, owner
        self._strides = None if strides is None else tuple(int(s) for s in strides)

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

    def stride(self) -> tuple:
        if self._strides is not None:
            return self._strides
        out, acc = [], 1
        for s in reversed(self.shape):
            out.append(acc)
            acc *= max(s, 1)
        return tuple(reversed(out))

    def is_contiguous(self) -> bool:
        return self._strides is None or self._strides == HostView(0, self.shape, self.dtype).stride()

    def get_device(self) -> int:
        return -1

    def tolist(self) -> list:
        if not self.numel():
            return []
        if self.is_contiguous():
            return list((_CTYPES[self.dtype] * self.numel()).from_address(self.ptr))
        st = self.stride()
        span = 1 + sum((n - 1) * s for n, s in zip(self.shape, st))
        flat = (_CTYPES[self.dtype] * span).from_address(self.ptr)
        offs = [0]
        for n, s in zip(self.shape, st):
            offs = [o + i * s for o in offs for i in range(n)]
        return [flat[o] for o in offs]

    def __repr__(self):
        return f"HostView({_fmt(self.shape)}, {self.dtype}, 0x{self.ptr:x})"


def _is_torch(t) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(t, torch.Tensor)


# Shape and dtype rules, on shapes and dtype names only, so that the custom ops' fake
# implementations apply the same ones.

def _check_dispatch(m, x, idx, w, scales) -> Tuple[int, int, int]:
    """(num_tokens, k, index dtype code) of a dispatch's arguments on the ``Moe`` ``m`` (shapes
    and dtype names), or the error naming this rank, the value and what was expected."""
    what = f"moe.dispatch: rank {m.rank}"
    H, T = m.hidden, m.max_tokens_per_rank
    xs, dt = tuple(x.shape), _dname(x.dtype)
    if dt != m.input_dtype:
        why = "bf16 x, quantized inside the dispatch" if m.quantize else "the object's payload dtype"
        raise _invalid(f"{what}: x has dtype {dt}; expected {m.input_dtype} ({why})")
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
    if m.quantize:
        if scales is not None:
            raise _invalid(f"{what}: x_scales given ({_fmt(scales.shape)}), but this Moe quantizes bf16 x itself "
                           "(input_dtype bfloat16); expected None")
    elif m.dtype == "bfloat16":
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


def _check_combine(m, expert_out, num_tokens: int, out) -> None:
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


def _torch_view(torch, ptr: int, shape, dtype, device, strides=None):
    """A torch tensor of ``shape`` and ``dtype`` over memory at ``ptr`` it does not own
    (contiguous, or with ``strides`` in elements)."""
    if strides is None:
        strides = HostView(0, shape, "float32").stride()
    span = 1 + sum((int(n) - 1) * int(s) for n, s in zip(shape, strides)) if all(int(n) for n in shape) else 0
    nbytes = span * torch.empty(0, dtype=dtype).element_size()
    storage = torch._C._construct_storage_from_data_pointer(ptr, device, nbytes)
    return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, tuple(shape), tuple(strides))
