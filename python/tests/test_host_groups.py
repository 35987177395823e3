"""Several groups through the Python package on the host backend (no GPU, no torch): four
processes, a world communicator, TP pairs and EP halves by ``Communicator.split`` (reversed
keys), a child without rank 0, all-reduces on each against the sum of their members' inputs,
a bad color on one rank (raised on every rank, naming it; the parent stays usable), a child
that outlives its parent, and the MemPool slot functions behind ``comm.mem_pool()``. Runs in CI
under ``SYMMALLOC_BACKEND=host``; GPU runs cover ``mem_pool`` with torch."""
import ctypes
import multiprocessing as mp
import os
import random
import traceback

import pytest

import symmalloc
from symmalloc.groups import SPLIT_NOCOLOR

pytestmark = pytest.mark.skipif(
    os.environ.get("SYMMALLOC_BACKEND") != "host",
    reason="needs SYMMALLOC_BACKEND=host (GPU runs use torch)",
)

WORLD = 4


class _F32:
    def __str__(self):
        return "torch.float32"


class HostTensor:
    """What Communicator.all_reduce reads of a torch tensor, over host memory."""

    dtype = _F32()

    def __init__(self, ptr, n):
        self.ptr, self.n, self.shape = ptr, n, (n,)

    def data_ptr(self):
        return self.ptr

    def numel(self):
        return self.n

    def is_contiguous(self):
        return True

    def get_device(self):
        return -1

    def values(self):
        return list((ctypes.c_float * self.n).from_address(self.ptr))

    def fill(self, vals):
        (ctypes.c_float * self.n).from_address(self.ptr)[:] = vals


def _inputs(seed, rank, n):
    g = random.Random(seed * 1000 + rank)
    return [ctypes.c_float(g.uniform(-4, 4)).value for _ in range(n)]


def _check_sum(lib, comm, rank, members, seed, n=1031):
    """An all-reduce on ``comm`` (world ranks ``members``) against the sum of their inputs."""
    p = lib.symm_malloc(4 * n, rank, None)
    t = HostTensor(p, n)
    t.fill(_inputs(seed, rank, n))
    comm.all_reduce(t)
    want = [sum(v) for v in zip(*(_inputs(seed, m, n) for m in members))]
    got = t.values()
    lib.symm_free(p, 4 * n, rank, None)
    assert all(abs(g - w) <= 1e-5 * max(1.0, abs(w)) for g, w in zip(got, want)), (seed, members)


def _rank(rank, uid, q):
    try:
        lib = symmalloc._library()
        world = symmalloc.Communicator(rank, WORLD, uid)
        tp = world.split(rank // 2)                       # key: the rank
        ep = world.split(rank % 2, key=-rank)             # reversed
        rest = world.split(None if rank == 0 else 0)
        assert (tp.rank, tp.world_size, tp.device) == (rank % 2, 2, rank)
        assert (ep.rank, ep.world_size) == (1 - rank // 2, 2), (ep.rank, ep.world_size)
        if rank == 0:
            assert rest is None
        else:
            assert (rest.rank, rest.world_size) == (rank - 1, WORLD - 1)
        assert world.split(SPLIT_NOCOLOR) is None
        groups = [("world", world, list(range(WORLD))), ("tp", tp, [rank // 2 * 2, rank // 2 * 2 + 1]),
                  ("ep", ep, [rank % 2, rank % 2 + 2])]
        if rest is not None:
            groups.append(("rest", rest, [1, 2, 3]))
        for seed, (name, comm, members) in enumerate(groups):
            _check_sum(lib, comm, rank, members, seed)
        # A bad color on rank 1: every rank raises, naming it; the parent stays usable.
        try:
            world.split(-5 if rank == 1 else 0)
            raise AssertionError("a bad color was accepted")
        except symmalloc.SymmallocError as e:
            assert e.status == "SYMM_ERR_INVALID_ARGUMENT" and "rank 1: color -5 is not accepted" in str(e), e
        for bad in ("x", 2**40, True):
            try:
                world.split(bad)
                raise AssertionError(f"color {bad!r} was accepted")
            except symmalloc.SymmallocError as e:
                assert "is not a 32-bit integer" in str(e), e
        _check_sum(lib, world, rank, list(range(WORLD)), 10)
        # The host backend has no CUDA MemPool; the slot functions behind it work all the same.
        try:
            tp.mem_pool()
            raise AssertionError("mem_pool on the host backend")
        except symmalloc.SymmallocError as e:
            assert "host backend" in str(e), e
        slot = ctypes.c_int()
        assert lib.symm_comm_mem_pool_slot(tp._comm, ctypes.byref(slot)) == 0
        again = ctypes.c_int()
        assert lib.symm_comm_mem_pool_slot(tp._comm, ctypes.byref(again)) == 0 and again.value == slot.value
        fn = getattr(lib, f"symm_comm_pool_malloc_{slot.value}")
        fn.restype, fn.argtypes = ctypes.c_void_p, [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        p = fn(1 << 20, rank, None)
        assert p, lib.symm_last_error()
        assert not fn(1 << 20, rank + 1, None) and b"device" in lib.symm_last_error()
        # The pool's memory is symmetric within the TP pair: an all-reduce on it works.
        t = HostTensor(p, 1000)
        t.fill(_inputs(20, rank, 1000))
        tp.all_reduce(t)
        # Children outlive their parent.
        world.close()
        _check_sum(lib, tp, rank, [rank // 2 * 2, rank // 2 * 2 + 1], 30)
        try:
            world.split(0)
            raise AssertionError("split of a closed communicator")
        except symmalloc.SymmallocError as e:
            assert "closed" in str(e), e
        tp.close()
        assert not fn(4096, rank, None) and b"was destroyed" in lib.symm_last_error()
        lib.symm_free(p, 1 << 20, rank, None)
        assert lib.symm_mem_pool_slot_release(slot.value) == 0
        ep.close()
        if rest is not None:
            rest.close()
        q.put((rank, None))
    except BaseException:  # reported to the parent, never a hang
        q.put((rank, traceback.format_exc()))


def test_four_processes_split_into_groups():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    uid = symmalloc.get_unique_id()
    procs = [ctx.Process(target=_rank, args=(r, uid, q)) for r in range(WORLD)]
    for p in procs:
        p.start()
    failures = {}
    for _ in procs:
        rank, failure = q.get(timeout=180)
        if failure:
            failures[rank] = failure
    for p in procs:
        p.join(30)
    assert not failures, "\n".join(f"rank {r}:\n{f}" for r, f in sorted(failures.items()))
    assert all(p.exitcode == 0 for p in procs)
