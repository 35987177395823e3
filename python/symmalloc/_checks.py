"""The argument checks that ``Communicator``, ``HierCommunicator`` and the custom ops' fake
implementations (``symmalloc.ops``) share: what the library cannot see (dtype names, op names,
devices, shapes, eps), on shapes only where a fake implementation applies the same rule
(docs/python-errors.md)."""

import math
from typing import Dict, Optional, Sequence, Tuple

from ._lib import _DTYPES, _OPS, _QUANTS, _invalid

_TORCH_DTYPE_CODES: Dict[object, int] = {}


def _dtype_code(dtype) -> Optional[int]:
    """The symm_dtype_t of a torch dtype (None when unsupported), cached per dtype object."""
    code = _TORCH_DTYPE_CODES.get(dtype)
    if code is None:
        code = _DTYPES.get(str(dtype).replace("torch.", ""))
        if code is not None:
            _TORCH_DTYPE_CODES[dtype] = code
    return code


def _device_name(dev: int) -> str:
    return "cpu" if dev < 0 else f"cuda:{dev}"


def _shape(t) -> Tuple[int, ...]:
    return tuple(t.shape)


def _fmt(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


# Shape rules, on shapes only so that the custom ops' fake implementations apply the same ones.

def _gathered_shapes(small: Sequence[int], world: int):
    """The shapes a world-size gather of ``small`` may have: concatenated along dim 0
    ((world * s0,) + rest), or stacked ((world,) + small); a 0-d ``small`` gives (world,)."""
    small = tuple(small)
    if not small:
        return [(world,)]
    return [(world * small[0],) + small[1:], (world,) + small]


def _check_gather(what: str, small, big, world: int) -> None:
    """``big`` is ``small`` gathered from every rank, along dim 0: shapes, not only sizes."""
    if tuple(big) not in _gathered_shapes(small, world):
        want = " or ".join(_fmt(s) for s in _gathered_shapes(small, world))
        raise _invalid(
            f"{what}: the gathered tensor has shape {_fmt(big)} and the per-rank one {_fmt(small)}; "
            f"expected {want} (world size {world}: ranks are concatenated along dim 0)")


def _check_rms_norm(x, residual, weight, out=None, eps: float = 1e-6) -> None:
    """The fused call's shapes (``x`` and ``residual`` [..., hidden], ``weight`` [hidden], as
    torch.nn.functional.rms_norm with normalized_shape = weight.shape) and eps."""
    if len(weight) != 1 or len(x) == 0 or x[-1] != weight[0] or tuple(residual) != tuple(x) or weight[0] == 0:
        raise _invalid(
            f"all_reduce_add_rms_norm: x {_fmt(x)}, residual {_fmt(residual)}, weight {_fmt(weight)}; "
            "expected x and residual of one shape [..., hidden] and weight [hidden] (hidden > 0)")
    if out is not None and tuple(out) != tuple(x):
        raise _invalid(f"all_reduce_add_rms_norm: out {_fmt(out)}; expected x's shape {_fmt(x)}")
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0):
        raise _invalid(f"all_reduce_add_rms_norm: eps {eps!r} is not a finite number >= 0")


def _fp8_mode(what: str, x, scale, group_size) -> Tuple[int, Tuple[int, ...]]:
    """The FP8 output's symm_quant_t and the shape of its scales, from the arguments' shapes:
    a given ``scale`` (one float32 element) is static; else ``group_size`` None is a scale per
    row (shape [..., 1]) and 128 a scale per 128 elements of a row ([..., hidden / 128])."""
    x = tuple(x)
    if scale is not None:
        if group_size is not None:
            raise _invalid(f"{what}: group_size {group_size!r} with a static scale; a static scale is one value")
        if tuple(scale) not in ((), (1,)):
            raise _invalid(f"{what}: scale has shape {_fmt(scale)}; expected one float32 element ([] or [1])")
        return _QUANTS["static"], tuple(scale)
    if group_size is None:
        return _QUANTS["per_token"], x[:-1] + (1,)
    if group_size != 128:
        raise _invalid(f"{what}: group_size {group_size!r}; expected None (a scale per row) or 128")
    if x[-1] % 128:
        raise _invalid(f"{what}: hidden {x[-1]} is not a multiple of 128 (group_size 128)")
    return _QUANTS["per_group_128"], x[:-1] + (x[-1] // 128,)


def _check_op(op: str) -> int:
    code = _OPS.get("sum" if op is None else op) if isinstance(op, (str, type(None))) else None
    if code is None:
        raise _invalid(f"op {op!r} unknown; ops {list(_OPS)}")
    return code
