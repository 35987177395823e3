"""Async tensor parallelism on symmetric memory: all-gather + matmul and matmul + reduce-scatter
with the transfers overlapped by the matmuls, built only on the public programming model
(``Communicator.rendezvous``, ``put``, ``signal``, ``wait``, ``barrier``)::

    import symmalloc.async_tp as atp
    y = atp.all_gather_matmul(a_shard, b, comm)                 # all_gather(a_shard) @ b
    y, a = atp.all_gather_matmul(a_shard, b, comm, return_a=True)
    z = atp.matmul_reduce_scatter(a, b_shard, comm)             # reduce_scatter(a @ b_shard)

The pipeline (bench/NOTES.md, "Async tensor parallelism"), per call, on the caller's stream S
and one side stream C per device:

all_gather_matmul (a_shard ``[..., K]`` on every rank, b ``[K, N]``)
  1. ``barrier`` on S: every rank has finished the previous call's reads of its workspace.
  2. C (after S): rank r puts its shard into every peer's workspace block r with the copy
     engine (``put``: no SM) and raises that peer's slot ``AG_SLOT0 + r`` to 1 after each put.
  3. S: the local block's matmul first, then for each peer p in ring order (r+1, r+2, ...):
     ``wait`` (slot ``AG_SLOT0 + p`` >= 1), reset the slot to 0, matmul block p. A block's
     matmul starts as soon as its signal is seen, while later blocks are still arriving.
  4. S waits for C.
matmul_reduce_scatter (a ``[M, K]`` on every rank, b_shard ``[K, n]``)
  1. ``barrier`` on S.
  2. S: for each peer p in ring order (r+1, ...), the partial product of p's rows into a
     staging buffer, then C (after that matmul) puts it into p's workspace block r and raises
     p's slot ``RS_SLOT0 + r``; the local rows' product goes straight into block r.
  3. S: the owner adds the blocks up in fp32, in rank order, each as soon as it has arrived
     (``wait``, then the slot reset), and rounds once: the bits do not depend on timing. The
     last add writes the result (at 2 ranks it is the only pass over the blocks).
  4. S waits for C.

A slot is raised to 1 and reset by its owner after the wait; the barrier of the next call
orders the reset before any new raise, so a captured CUDA graph replays with the same values
(monotonic counters would not survive replays). The calls use signal slots
``RESERVED_SLOT0``..``SIGNAL_SLOTS - 1`` of the communicator; keep your own slots below it.

Workspaces are symmetric blocks from ``symm_malloc``, rendezvoused once per shape and dtype and
cached on the communicator (every rank must make the same sequence of calls, as for any
collective). The first call of a shape sets its workspace up (a collective on the host): make
it once before capturing a graph; a first call under capture is refused with that advice.

The host backend (CI) runs the same program on CPU tensors: put and signal are memory copies
and stores into the peers' mappings, wait polls, both streams are the host thread.
"""

import ctypes
from typing import Dict, List, Tuple, Union

import torch

from ._lib import SymmallocError, _check, _library
from ._registry import communicator_of_world, world_of
from .comm import Communicator, communicator
from .p2p import MAX_RANKS, SIGNAL_SLOTS, _tensor_at

__all__ = ["all_gather_matmul", "matmul_reduce_scatter", "AG_SLOT0", "RS_SLOT0", "RESERVED_SLOT0"]

#: First signal slot the async-TP calls use (one per rank and call kind); slots below it are
#: the caller's.
RESERVED_SLOT0 = SIGNAL_SLOTS - 2 * MAX_RANKS
AG_SLOT0 = RESERVED_SLOT0
RS_SLOT0 = RESERVED_SLOT0 + MAX_RANKS
_DTYPES = (torch.bfloat16, torch.float16)

Comm = Union[Communicator, int]


def _invalid(msg: str) -> SymmallocError:
    return SymmallocError("SYMM_ERR_INVALID_ARGUMENT", msg)


def _comm(comm: Comm) -> Communicator:
    return communicator(comm) if isinstance(comm, int) else comm


def _check_matmul(what: str, a, b, comm: Communicator, dim: int, a_name: str, b_name: str) -> int:
    """The checks the eager path and the fake implementations share (shapes and dtypes only).
    Returns ``dim`` made non-negative."""
    if a.dtype not in _DTYPES:
        raise _invalid(f"{what}: {a_name} has dtype {a.dtype}; expected bfloat16 or float16")
    if b.dtype != a.dtype:
        raise _invalid(f"{what}: {b_name} has dtype {b.dtype} and {a_name} {a.dtype}; expected the same")
    if b.dim() != 2:
        raise _invalid(f"{what}: {b_name} has shape {list(b.shape)}; expected 2 dims [K, N]")
    if a.dim() < 2:
        raise _invalid(f"{what}: {a_name} has shape {list(a.shape)}; expected at least 2 dims [..., K]")
    if a.shape[-1] != b.shape[0]:
        raise _invalid(f"{what}: {a_name} {list(a.shape)} and {b_name} {list(b.shape)}: the last dim of {a_name} must equal dim 0 of {b_name}")
    d = dim + a.dim() if dim < 0 else dim
    if not 0 <= d < a.dim() - 1:
        raise _invalid(f"{what}: dim {dim} for {a_name} of {a.dim()} dims; expected a dim before the last (the K dim)")
    return d


# Workspaces and side streams ------------------------------------------------------------------

class _Workspace:
    """A symmetric block ``[world, *block]`` of ``dtype``, rendezvoused on ``comm``; freed
    (stream-ordered on the stream of its last use) when replaced or when the process ends."""

    def __init__(self, comm: Communicator, block: Tuple[int, ...], dtype, device):
        self.comm, self.key = comm, (block, dtype)
        shape = (comm.world_size,) + tuple(block)
        self.nbytes = max(1, int(torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size())
        lib = _library()
        self.raw = lib.symm_malloc(self.nbytes, comm.device, ctypes.c_void_p(comm._current_stream()))
        if not self.raw:
            raise SymmallocError("SYMM_ERR_OUT_OF_MEMORY", f"async_tp: no symmetric workspace of {self.nbytes} bytes")
        self.tensor = _tensor_at(self.raw, _Like(shape, dtype, device), self.nbytes)
        try:
            self.handle = comm.rendezvous(self.tensor)
        except BaseException:
            self.free()
            raise

    def free(self) -> None:
        if self.raw:
            _library().symm_free(self.raw, self.nbytes, self.comm.device, ctypes.c_void_p(self.comm._current_stream()))
            self.raw = 0


class _Like:
    """What ``_tensor_at`` reads of a tensor it imitates (shape, strides, dtype, device)."""

    def __init__(self, shape, dtype, device):
        self.shape, self.dtype, self.device = torch.Size(shape), dtype, torch.device(device)

    def stride(self):
        s, acc = [], 1
        for n in reversed(self.shape):
            s.append(acc)
            acc *= max(int(n), 1)
        return tuple(reversed(s))


def _workspace(comm: Communicator, kind: str, block: Tuple[int, ...], dtype, device) -> _Workspace:
    cache: Dict[str, _Workspace] = comm.__dict__.setdefault("_async_tp_ws", {})
    ws = cache.get(kind)
    if ws is not None and ws.key == (tuple(block), dtype) and ws.raw:
        return ws
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise _invalid(f"async_tp: the first {kind} call of block {list(block)} {dtype} sets up a symmetric workspace "
                       "(a collective on the host): make one call of this shape before capturing the graph")
    if ws is not None:
        ws.free()
        del cache[kind]
    ws = _Workspace(comm, tuple(block), dtype, device)
    cache[kind] = ws
    return ws


_SIDE: Dict[int, "torch.cuda.Stream"] = {}


def _side_stream(device):
    if device.type != "cuda":
        return None
    s = _SIDE.get(device.index)
    if s is None:
        s = _SIDE[device.index] = torch.cuda.Stream(device=device)
    return s


class _On:
    """``with _On(stream)``: that stream current (a no-op on the host backend)."""

    def __init__(self, stream):
        self.ctx = torch.cuda.stream(stream) if stream is not None else None

    def __enter__(self):
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc):
        if self.ctx is not None:
            self.ctx.__exit__(*exc)


def _ring(rank: int, world: int) -> List[int]:
    return [(rank + i) % world for i in range(1, world)]


def _barrier(comm: Communicator) -> None:
    _check(_library().symm_barrier(comm._live(), ctypes.c_void_p(comm._current_stream())))


# The two pipelines ----------------------------------------------------------------------------

def _all_gather_matmul(a_shard, b, comm: Communicator, gather_dim: int, return_a: bool):
    d = _check_matmul("all_gather_matmul", a_shard, b, comm, gather_dim, "a_shard", "b")
    comm._check_devices(a_shard, b)
    a_shard = a_shard.contiguous()
    W, r = comm.world_size, comm.rank
    ws = _workspace(comm, "all_gather_matmul", tuple(a_shard.shape), a_shard.dtype, a_shard.device)
    blocks = ws.tensor  # [W, *a_shard.shape]; block p holds rank p's shard
    out = a_shard.new_empty((W,) + tuple(a_shard.shape[:-1]) + (b.shape[1],))
    main, side = (torch.cuda.current_stream(a_shard.device), _side_stream(a_shard.device)) if a_shard.is_cuda else (None, None)
    _barrier(comm)
    if side is not None:
        side.wait_stream(main)
    with _On(side):
        for p in _ring(r, W):
            comm.put(a_shard, p, blocks[r])
            comm.signal(p, AG_SLOT0 + r, 1)
        if return_a:
            blocks[r].copy_(a_shard)
    torch.matmul(a_shard, b, out=out[r])
    for p in _ring(r, W):
        comm.wait(AG_SLOT0 + p, 1)
        comm.signal(r, AG_SLOT0 + p, 0)
        torch.matmul(blocks[p], b, out=out[p])
    if side is not None:
        main.wait_stream(side)
    a = None
    if return_a:  # a copy: the workspace is overwritten by the next call
        a = _merge(blocks, d).clone() if d == 0 else _merge(blocks, d)
    return _merge(out, d), a


def _merge(t, d: int):
    """``[W, *shape]`` blocks concatenated along dim ``d`` of ``shape``."""
    if d == 0:
        return t.reshape((t.shape[0] * t.shape[1],) + tuple(t.shape[2:]))
    moved = t.movedim(0, d)  # [..., W, n_d, ...]
    shape = list(t.shape[1:])
    shape[d] *= t.shape[0]
    return moved.reshape(shape)


def _matmul_reduce_scatter(a, b_shard, comm: Communicator, scatter_dim: int):
    d = _check_matmul("matmul_reduce_scatter", a, b_shard, comm, scatter_dim, "a", "b_shard")
    comm._check_devices(a, b_shard)
    W, r = comm.world_size, comm.rank
    if a.shape[d] % W:
        raise _invalid(f"matmul_reduce_scatter: a has shape {list(a.shape)}; dim {d} ({a.shape[d]}) must be divisible by the world size {W}")
    # Rows grouped by owner: [W, *block] with block = a's shape with dim d divided by W.
    split = a.unflatten(d, (W, a.shape[d] // W)).movedim(d, 0)
    block = tuple(split.shape[1:-1]) + (b_shard.shape[1],)
    ws = _workspace(comm, "matmul_reduce_scatter", block, a.dtype, a.device)
    blocks = ws.tensor  # block p: rank p's partial product of this rank's rows
    main, side = (torch.cuda.current_stream(a.device), _side_stream(a.device)) if a.is_cuda else (None, None)
    stage = a.new_empty((W,) + block)
    _barrier(comm)
    for p in _ring(r, W):
        torch.matmul(split[p], b_shard, out=stage[p])
        if side is not None:
            side.wait_stream(main)
        with _On(side):
            comm.put(stage[p], p, blocks[r])
            comm.signal(p, RS_SLOT0 + r, 1)
    torch.matmul(split[r], b_shard, out=blocks[r])
    # The sum in rank order, in fp32, rounded once: blocks[0] + blocks[1] + ... The last add
    # writes the result (fp32 math, one rounding to a's dtype) and, at 2 ranks, is the only pass:
    # torch.add of two bf16 blocks adds them in fp32 and rounds once, the same bits as
    # blocks[0].float().add_(blocks[1]).to(bf16) in a third of the memory traffic.
    out = a.new_empty(block)  # the block's shape is a's with dim d divided by W
    acc = None
    for p in range(W):  # in rank order, as the blocks arrive: the bits do not depend on timing
        if p != r:
            comm.wait(RS_SLOT0 + p, 1)
            comm.signal(r, RS_SLOT0 + p, 0)
        if W == 1:
            out.copy_(blocks[0])
        elif p == W - 1:
            torch.add(blocks[0] if acc is None else acc, blocks[p], out=out)
        elif p == 1:
            acc = blocks[0].float().add_(blocks[1])
        elif p > 1:
            acc.add_(blocks[p])
    if side is not None:
        main.wait_stream(side)
    return out


# Custom ops (torch.compile) and the public calls -------------------------------------------------

@torch.library.custom_op("symmalloc::all_gather_matmul", mutates_args=())
def _ag_mm_op(a_shard: torch.Tensor, b: torch.Tensor, comm: int, gather_dim: int, return_a: bool,
              world: int) -> Tuple[torch.Tensor, torch.Tensor]:
    y, a = _all_gather_matmul(a_shard, b, communicator_of_world(comm, world, "all_gather_matmul"), gather_dim, return_a)
    return y, (a if a is not None else a_shard.new_empty(0))


def _gathered_shape(shape, d: int, world: int) -> List[int]:
    s = list(shape)
    s[d] *= world
    return s


@_ag_mm_op.register_fake
def _(a_shard, b, comm, gather_dim, return_a, world):
    c = communicator_of_world(comm, world, "all_gather_matmul")
    d = _check_matmul("all_gather_matmul", a_shard, b, c, gather_dim, "a_shard", "b")
    shape = _gathered_shape(a_shard.shape, d, c.world_size)
    y = a_shard.new_empty(shape[:-1] + [b.shape[1]])
    return y, (a_shard.new_empty(shape) if return_a else a_shard.new_empty(0))


@torch.library.custom_op("symmalloc::matmul_reduce_scatter", mutates_args=())
def _mm_rs_op(a: torch.Tensor, b_shard: torch.Tensor, comm: int, scatter_dim: int, world: int) -> torch.Tensor:
    return _matmul_reduce_scatter(a, b_shard, communicator_of_world(comm, world, "matmul_reduce_scatter"), scatter_dim)


@_mm_rs_op.register_fake
def _(a, b_shard, comm, scatter_dim, world):
    c = communicator_of_world(comm, world, "matmul_reduce_scatter")
    d = _check_matmul("matmul_reduce_scatter", a, b_shard, c, scatter_dim, "a", "b_shard")
    if a.shape[d] % c.world_size:
        raise _invalid(f"matmul_reduce_scatter: a has shape {list(a.shape)}; dim {d} ({a.shape[d]}) must be divisible by the world size {c.world_size}")
    shape = list(a.shape[:-1]) + [b_shard.shape[1]]
    shape[d] //= c.world_size
    return a.new_empty(shape)


def _handle(comm: Comm) -> int:
    return comm.handle if isinstance(comm, Communicator) else int(comm)


def all_gather_matmul(a_shard: torch.Tensor, b: torch.Tensor, comm: Comm, gather_dim: int = 0,
                      return_a: bool = False):
    """``all_gather(a_shard, dim=gather_dim) @ b``, the shards arriving by copy-engine puts while
    the blocks already here are multiplied (``torch.ops.symmalloc.all_gather_matmul``).
    ``a_shard`` is ``[..., K]`` (bf16 or fp16) on every rank, ``b`` is ``[K, N]``. Returns the
    product, or ``(product, gathered a)`` with ``return_a=True``."""
    y, a = torch.ops.symmalloc.all_gather_matmul(a_shard, b, _handle(comm), gather_dim, return_a, world_of(comm))
    return (y, a) if return_a else y


def matmul_reduce_scatter(a: torch.Tensor, b_shard: torch.Tensor, comm: Comm, scatter_dim: int = 0) -> torch.Tensor:
    """``reduce_scatter(a @ b_shard, dim=scatter_dim)`` (sum): each rank's partial product of a
    peer's rows is put to that peer as soon as it is computed, and the owner adds up what has
    arrived (``torch.ops.symmalloc.matmul_reduce_scatter``). ``a`` is ``[..., K]``, ``b_shard``
    ``[K, n]``; dim ``scatter_dim`` of ``a`` must be divisible by the world size."""
    return torch.ops.symmalloc.matmul_reduce_scatter(a, b_shard, _handle(comm), scatter_dim, world_of(comm))
