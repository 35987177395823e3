"""symmalloc's collectives as PyTorch custom ops (``torch.ops.symmalloc.*``), for torch.compile.

A ``Communicator`` method is a ctypes call, which Dynamo cannot trace: inside a compiled
function it is a graph break. These ops are registered with ``torch.library.custom_op``, with
fake (meta) implementations and their mutations declared, so ``torch.compile(fullgraph=True)``
keeps a tensor-parallel block whole, also under ``mode="reduce-overhead"`` (CUDA graphs). A
communicator is named by its ``handle`` (an int); the wrappers below take the object (a
``Communicator`` or, across nodes, a ``HierCommunicator``: the ops are the same)::

    import symmalloc, symmalloc.ops as sops
    comm = symmalloc.Communicator.from_process_group()
    y = sops.all_reduce(x, comm)                     # torch.ops.symmalloc.all_reduce

| op | schema | result |
|---|---|---|
| ``all_reduce`` | ``(Tensor x, int comm, str op, str algo) -> Tensor`` | a new tensor |
| ``all_reduce_`` | ``(Tensor(a!) x, int comm, str op, str algo) -> ()`` | ``x`` in place |
| ``reduce_scatter`` | ``(Tensor x, int comm, str op) -> Tensor`` | dim 0 divided by the world size |
| ``all_gather`` | ``(Tensor x, int comm) -> Tensor`` | dim 0 multiplied by the world size |
| ``all_reduce_add_rms_norm`` | ``(Tensor x, Tensor(a!) residual, Tensor weight, float eps, int comm) -> Tensor`` | ``out``; ``residual`` updated |
| ``put_`` | ``(Tensor src, Tensor(a!) dst, int peer, int comm) -> ()`` | ``src`` into rank ``peer``'s ``dst`` |
| ``signal_`` | ``(Tensor(a!) buf, int peer, int slot, int value, int comm) -> ()`` | rank ``peer``'s slot raised after the puts into ``buf`` |
| ``wait_`` | ``(Tensor(a!) buf, int slot, int value, int comm) -> ()`` | the current stream held until this rank's slot >= ``value`` |
| ``all_reduce_add_rms_norm_fp8`` | ``(Tensor x, Tensor(a!) residual, Tensor weight, Tensor? scale, float eps, int group_size, int comm) -> (Tensor, Tensor)`` | ``(out_fp8, scale)``; ``residual`` updated |
| ``all_reduce_add_rms_norm_functional`` | ``(Tensor x, Tensor residual, Tensor weight, float eps, int comm) -> (Tensor, Tensor)`` | ``(out, residual_out)``; no input mutated |
| ``all_reduce_add_rms_norm_fp8_functional`` | ``(Tensor x, Tensor residual, Tensor weight, Tensor? scale, float eps, int group_size, int comm) -> (Tensor, Tensor, Tensor)`` | ``(out_fp8, scale, residual_out)``; no input mutated |
| ``moe_dispatch`` | ``(Tensor x, Tensor topk_idx, Tensor topk_weights, Tensor? x_scales, int moe) -> (Tensor, Tensor, Tensor, Tensor)`` | ``(recv_x, recv_scales, recv_counts, recv_src)``: views of the ``Moe``'s buffer (``recv_scales`` empty for bf16) |
| ``moe_combine`` | ``(Tensor expert_out, Tensor recv_counts, Tensor recv_src, int moe, SymInt num_tokens) -> Tensor`` | ``y`` [num_tokens, hidden] bf16 |

The fp8 ops' ``scale``: a float32 tensor of one element is the static scale (the returned
``scale`` is then a copy of it: an op's output may not alias an input); ``None`` computes the
scales, one per row (``group_size`` 0, shape [..., 1]) or one per 128 elements of a row
(``group_size`` 128, shape [..., hidden / 128]). The functional forms mutate nothing: a compiled
function that takes the residual as an argument and passes it to them keeps its CUDA graph
under ``mode="reduce-overhead"`` (a mutated graph input makes torch skip CUDA graphs). They copy
the residual into ``residual_out`` and update that copy (one extra copy kernel).

The MoE ops name a ``symmalloc.moe.Moe`` by its ``handle``. ``Moe.dispatch`` and
``Moe.combine`` call them while torch.compile traces (so ``moe.dispatch -> experts ->
moe.combine`` is one graph), as do the wrappers ``moe_dispatch`` / ``moe_combine`` below.
``moe_dispatch``'s results are views of the ``Moe``'s symmetric buffer (fresh tensor objects
over the same memory each call), valid until its next dispatch. ``moe_combine`` takes the
dispatch's ``recv_counts`` and ``recv_src``, which orders it after the dispatch in the graph.

Every op refuses what the ``Communicator`` method refuses (docs/python-errors.md), and its fake
implementation refuses the same names, dtypes and shapes, so torch.compile reports them while
tracing.

Inputs that are not in symmalloc's heap (a compiled graph allocates from PyTorch's own pools)
are staged through the communicator's scratch buffer, inside the same call; allocate the inputs
from ``symmalloc.mem_pool()`` for the zero-copy path.
"""

from typing import Optional, Tuple, Union

import torch

from . import moe as _moe  # registers the MoE ops; its lookup of a handle
from ._checks import _check_op, _check_rms_norm, _dtype_code, _fp8_mode
from ._lib import _ALGOS, SymmallocError
from ._registry import communicator, communicator_of_world, world_of
from .comm import Communicator

__all__ = ["all_reduce", "all_reduce_", "reduce_scatter", "all_gather", "all_reduce_add_rms_norm",
           "all_reduce_add_rms_norm_fp8", "all_reduce_add_rms_norm_functional",
           "all_reduce_add_rms_norm_fp8_functional", "put_", "signal_", "wait_", "moe_dispatch", "moe_combine"]

Comm = Union[Communicator, int]


def _handle(comm: Comm) -> int:
    # A Communicator or a HierCommunicator (symmalloc.hier): both have a handle.
    h = getattr(comm, "handle", None)
    return int(comm) if h is None else h


def _check_names(what: str, x: torch.Tensor, op: str, algo: str = "auto") -> None:
    """What the fakes can check without running: the dtype and the op and algorithm names."""
    if _dtype_code(x.dtype) is None:
        raise SymmallocError("SYMM_ERR_INVALID_ARGUMENT", f"{what}: dtype {x.dtype} is not bfloat16, float16 or float32")
    _check_op(op)
    if algo not in _ALGOS:
        raise SymmallocError("SYMM_ERR_INVALID_ARGUMENT", f"{what}: algo {algo!r} unknown; algos {list(_ALGOS)}")


def _rows(x: torch.Tensor, world: int, what: str) -> int:
    if x.dim() == 0 or x.shape[0] % world:
        raise SymmallocError("SYMM_ERR_INVALID_ARGUMENT", f"{what}: x has shape {tuple(x.shape)}; expected dim 0 divisible by the world size {world}")
    return x.shape[0] // world


@torch.library.custom_op("symmalloc::all_reduce", mutates_args=())
def _all_reduce(x: torch.Tensor, comm: int, op: str, algo: str) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    communicator(comm).all_reduce(x, op=op, algo=algo, out=out)
    return out


@_all_reduce.register_fake
def _(x, comm, op, algo):
    communicator(comm)
    _check_names("all_reduce", x, op, algo)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("symmalloc::all_reduce_", mutates_args=("x",))
def _all_reduce_(x: torch.Tensor, comm: int, op: str, algo: str) -> None:
    if not x.is_contiguous():
        raise SymmallocError("SYMM_ERR_INVALID_ARGUMENT", "all_reduce_: x must be contiguous (it is reduced in place)")
    communicator(comm).all_reduce(x, op=op, algo=algo)


@_all_reduce_.register_fake
def _(x, comm, op, algo):
    communicator(comm)
    _check_names("all_reduce_", x, op, algo)
    return None


@torch.library.custom_op("symmalloc::reduce_scatter", mutates_args=())
def _reduce_scatter(x: torch.Tensor, comm: int, op: str, world: int) -> torch.Tensor:
    c = communicator_of_world(comm, world, "reduce_scatter")
    x = x.contiguous()
    out = x.new_empty((_rows(x, c.world_size, "reduce_scatter"),) + tuple(x.shape[1:]))
    c.reduce_scatter(out, x, op=op)
    return out


@_reduce_scatter.register_fake
def _(x, comm, op, world):
    communicator_of_world(comm, world, "reduce_scatter")
    _check_names("reduce_scatter", x, op)
    return x.new_empty((_rows(x, world, "reduce_scatter"),) + tuple(x.shape[1:]))


@torch.library.custom_op("symmalloc::all_gather", mutates_args=())
def _all_gather(x: torch.Tensor, comm: int, world: int) -> torch.Tensor:
    c = communicator_of_world(comm, world, "all_gather")
    x = x.contiguous()
    out = x.new_empty((x.shape[0] * c.world_size,) + tuple(x.shape[1:])) if x.dim() else x.new_empty(c.world_size)
    c.all_gather(out, x)
    return out


@_all_gather.register_fake
def _(x, comm, world):
    communicator_of_world(comm, world, "all_gather")
    _check_names("all_gather", x, "sum")
    return x.new_empty((x.shape[0] * world,) + tuple(x.shape[1:])) if x.dim() else x.new_empty(world)


@torch.library.custom_op("symmalloc::all_reduce_add_rms_norm", mutates_args=("residual",))
def _all_reduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, comm: int) -> torch.Tensor:
    c = communicator(comm)
    _check_rms_norm(tuple(x.shape), tuple(residual.shape), tuple(weight.shape), None, eps)
    if not residual.is_contiguous():
        raise SymmallocError("SYMM_ERR_INVALID_ARGUMENT", "all_reduce_add_rms_norm: residual must be contiguous (it is updated in place)")
    return c.all_reduce_add_rms_norm(x.contiguous(), residual, weight.contiguous(), eps=eps)


@_all_reduce_add_rms_norm.register_fake
def _(x, residual, weight, eps, comm):
    communicator(comm)
    _check_rms_norm(tuple(x.shape), tuple(residual.shape), tuple(weight.shape), None, eps)
    _check_names("all_reduce_add_rms_norm", x, "sum")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _group(group_size: int) -> Optional[int]:
    return None if group_size == 0 else group_size


def _fp8_fake(what, x, residual, weight, scale, eps, group_size, comm):
    """What the fp8 fakes check and return: (out, scale) of the right shapes and dtypes."""
    communicator(comm)
    _check_rms_norm(tuple(x.shape), tuple(residual.shape), tuple(weight.shape), None, eps)
    _check_names(what, x, "sum")
    _, sshape = _fp8_mode(what, tuple(x.shape), None if scale is None else tuple(scale.shape), _group(group_size))
    return (torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device),
            torch.empty(sshape, dtype=torch.float32, device=x.device))


def _fp8_call(c, what, x, residual, weight, scale, eps, group_size):
    out, s = c.all_reduce_add_rms_norm_fp8(x.contiguous(), residual, weight.contiguous(), scale=scale, eps=eps,
                                           group_size=_group(group_size))
    return out, (s.clone() if scale is not None else s)  # an output may not alias an input


@torch.library.custom_op("symmalloc::all_reduce_add_rms_norm_fp8", mutates_args=("residual",))
def _all_reduce_add_rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                 scale: Optional[torch.Tensor], eps: float, group_size: int,
                                 comm: int) -> Tuple[torch.Tensor, torch.Tensor]:
    c = communicator(comm)
    if not residual.is_contiguous():
        raise SymmallocError("SYMM_ERR_INVALID_ARGUMENT", "all_reduce_add_rms_norm_fp8: residual must be contiguous (it is updated in place)")
    return _fp8_call(c, "all_reduce_add_rms_norm_fp8", x, residual, weight, scale, eps, group_size)


@_all_reduce_add_rms_norm_fp8.register_fake
def _(x, residual, weight, scale, eps, group_size, comm):
    return _fp8_fake("all_reduce_add_rms_norm_fp8", x, residual, weight, scale, eps, group_size, comm)


@torch.library.custom_op("symmalloc::all_reduce_add_rms_norm_functional", mutates_args=())
def _all_reduce_add_rms_norm_functional(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                                        comm: int) -> Tuple[torch.Tensor, torch.Tensor]:
    c = communicator(comm)
    _check_rms_norm(tuple(x.shape), tuple(residual.shape), tuple(weight.shape), None, eps)
    res = residual.contiguous().clone()
    return c.all_reduce_add_rms_norm(x.contiguous(), res, weight.contiguous(), eps=eps), res


@_all_reduce_add_rms_norm_functional.register_fake
def _(x, residual, weight, eps, comm):
    communicator(comm)
    _check_rms_norm(tuple(x.shape), tuple(residual.shape), tuple(weight.shape), None, eps)
    _check_names("all_reduce_add_rms_norm_functional", x, "sum")
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(residual, memory_format=torch.contiguous_format))


@torch.library.custom_op("symmalloc::all_reduce_add_rms_norm_fp8_functional", mutates_args=())
def _all_reduce_add_rms_norm_fp8_functional(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                            scale: Optional[torch.Tensor], eps: float, group_size: int,
                                            comm: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    c = communicator(comm)
    _check_rms_norm(tuple(x.shape), tuple(residual.shape), tuple(weight.shape), None, eps)
    res = residual.contiguous().clone()
    out, s = _fp8_call(c, "all_reduce_add_rms_norm_fp8_functional", x, res, weight, scale, eps, group_size)
    return out, s, res


@_all_reduce_add_rms_norm_fp8_functional.register_fake
def _(x, residual, weight, scale, eps, group_size, comm):
    out, s = _fp8_fake("all_reduce_add_rms_norm_fp8_functional", x, residual, weight, scale, eps, group_size, comm)
    return out, s, torch.empty_like(residual, memory_format=torch.contiguous_format)


def all_reduce(x: torch.Tensor, comm: Comm, op: str = "sum", algo: str = "auto") -> torch.Tensor:
    """The reduction of every rank's ``x``, as a new tensor (``torch.ops.symmalloc.all_reduce``)."""
    return torch.ops.symmalloc.all_reduce(x, _handle(comm), op, algo)


def all_reduce_(x: torch.Tensor, comm: Comm, op: str = "sum", algo: str = "auto") -> torch.Tensor:
    """Reduces ``x`` in place and returns it (``torch.ops.symmalloc.all_reduce_``)."""
    torch.ops.symmalloc.all_reduce_(x, _handle(comm), op, algo)
    return x


def reduce_scatter(x: torch.Tensor, comm: Comm, op: str = "sum") -> torch.Tensor:
    """Rank r's slice r (along dim 0) of the reduction of every rank's ``x``."""
    return torch.ops.symmalloc.reduce_scatter(x, _handle(comm), op, world_of(comm))


def all_gather(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Every rank's ``x`` concatenated along dim 0, in rank order."""
    return torch.ops.symmalloc.all_gather(x, _handle(comm), world_of(comm))


def all_reduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, comm: Comm, eps: float = 1e-6) -> torch.Tensor:
    """``residual += all_reduce(x)``; returns ``rms_norm(residual) * weight``."""
    return torch.ops.symmalloc.all_reduce_add_rms_norm(x, residual, weight, eps, _handle(comm))


# Symmetric memory you program yourself (symmalloc/p2p.py). The tensor each op declares mutated
# is what it guards, so torch.compile keeps them in program order: put_ writes rank peer's dst,
# signal_ follows the puts into buf, wait_ precedes the reads of buf (where the peers' data lands).

@torch.library.custom_op("symmalloc::put_", mutates_args=("dst",))
def _put_(src: torch.Tensor, dst: torch.Tensor, peer: int, comm: int) -> None:
    communicator(comm).put(src, peer, dst)


@_put_.register_fake
def _(src, dst, peer, comm):
    communicator(comm)
    if src.numel() * src.element_size() != dst.numel() * dst.element_size():
        raise SymmallocError("SYMM_ERR_INVALID_ARGUMENT", "put_: src and dst must have the same byte size")
    return None


@torch.library.custom_op("symmalloc::signal_", mutates_args=("buf",))
def _signal_(buf: torch.Tensor, peer: int, slot: int, value: int, comm: int) -> None:
    communicator(comm).signal(peer, slot, value)


@_signal_.register_fake
def _(buf, peer, slot, value, comm):
    communicator(comm)
    return None


@torch.library.custom_op("symmalloc::wait_", mutates_args=("buf",))
def _wait_(buf: torch.Tensor, slot: int, value: int, comm: int) -> None:
    communicator(comm).wait(slot, value)


@_wait_.register_fake
def _(buf, slot, value, comm):
    communicator(comm)
    return None


def put_(src: torch.Tensor, dst: torch.Tensor, peer: int, comm: Comm) -> None:
    """``src`` into rank ``peer``'s ``dst`` (rendezvoused), copy engine, current stream."""
    torch.ops.symmalloc.put_(src, dst, peer, _handle(comm))


def signal_(buf: torch.Tensor, peer: int, slot: int, value: int, comm: Comm) -> None:
    """Raises rank ``peer``'s slot to ``value`` after the puts into ``buf``."""
    torch.ops.symmalloc.signal_(buf, peer, slot, value, _handle(comm))


def wait_(buf: torch.Tensor, slot: int, value: int, comm: Comm) -> None:
    """Holds the current stream until this rank's slot >= ``value``; ``buf`` is read after it."""
    torch.ops.symmalloc.wait_(buf, slot, value, _handle(comm))


def all_reduce_add_rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, comm: Comm,
                                scale: Optional[torch.Tensor] = None, eps: float = 1e-6,
                                group_size: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``residual += all_reduce(x)``; returns ``(e4m3(rms_norm(residual) * weight / s), s)``
    (``Communicator.all_reduce_add_rms_norm_fp8``; a static ``scale`` comes back as a copy)."""
    return torch.ops.symmalloc.all_reduce_add_rms_norm_fp8(x, residual, weight, scale, eps, group_size or 0, _handle(comm))


def all_reduce_add_rms_norm_functional(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, comm: Comm,
                                       eps: float = 1e-6) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(r) * weight, r)`` with ``r = residual + all_reduce(x)``; mutates no input."""
    return torch.ops.symmalloc.all_reduce_add_rms_norm_functional(x, residual, weight, eps, _handle(comm))


def all_reduce_add_rms_norm_fp8_functional(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, comm: Comm,
                                           scale: Optional[torch.Tensor] = None, eps: float = 1e-6,
                                           group_size: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out_fp8, scale, r)`` as ``all_reduce_add_rms_norm_fp8``, with ``r`` the new residual;
    mutates no input."""
    return torch.ops.symmalloc.all_reduce_add_rms_norm_fp8_functional(x, residual, weight, scale, eps, group_size or 0,
                                                                      _handle(comm))


# Expert parallelism: the ops symmalloc::moe_dispatch / moe_combine are registered by
# symmalloc/moe.py itself (it owns the Moe objects they name; imported above, so they exist
# whenever this module does); these are their wrappers.

def _moe_handle(moe) -> int:
    h = getattr(moe, "handle", None)
    return int(moe) if h is None else h


def moe_dispatch(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, moe,
                 x_scales: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(recv_x, recv_scales, recv_counts, recv_src)`` of a dispatch of ``moe`` (a
    ``symmalloc.moe.Moe`` or its handle; ``torch.ops.symmalloc.moe_dispatch``); ``recv_scales``
    is empty for bf16. ``Moe.dispatch`` is the same call with a ``MoeDispatch`` result. The op's
    last argument, the object's ``op_layout()``, keeps a compiled graph to objects whose results
    have its shapes."""
    h = _moe_handle(moe)
    return torch.ops.symmalloc.moe_dispatch(x, topk_idx, topk_weights, x_scales, h, _moe.moe(h).op_layout())


def moe_combine(expert_out: torch.Tensor, recv_counts: torch.Tensor, recv_src: torch.Tensor, num_tokens: int,
                moe) -> torch.Tensor:
    """``y`` [num_tokens, hidden] bf16 of the latest dispatch of ``moe`` (its ``recv_counts``
    and ``recv_src``, ``num_tokens`` its ``x``'s rows; ``torch.ops.symmalloc.moe_combine``)."""
    return torch.ops.symmalloc.moe_combine(expert_out, recv_counts, recv_src, _moe_handle(moe), num_tokens)
