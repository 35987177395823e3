"""Symmetric memory you program yourself, from Python, on the host backend (CI, no GPU):
``comm.rendezvous`` and the handle's peer pointers, ``comm.put/signal/wait`` around a ring with
fresh data, the device view, refusals (peer out of range, slot past the pad, a range not
rendezvoused, asymmetric rendezvous on every rank), and, where torch is installed, peer tensors
and the ``symmalloc::put_/signal_/wait_`` custom ops over CPU tensors. GPU runs:
python/tests/triton_p2p_check.py."""
import ctypes
import multiprocessing as mp
import os
import random

import pytest

import symmalloc
from error_text import error_of  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("SYMMALLOC_BACKEND") != "host",
    reason="needs SYMMALLOC_BACKEND=host (GPU runs use triton_p2p_check.py)",
)


class _DType:
    name = "float32"

    def __str__(self):
        return "torch.float32"


class HostTensor:
    """A float32 tensor over host memory, as the p2p calls read it."""

    dtype = _DType()

    def __init__(self, ptr, n):
        self.ptr, self.n = ptr, n

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


def _data(seed, rank, n):
    g = random.Random(seed * 1000 + rank)
    return [ctypes.c_float(g.uniform(-4, 4)).value for _ in range(n)]


def _rank(rank, world, uid, q, use_torch):
    try:
        lib = symmalloc._library()
        comm = symmalloc.Communicator(rank, world, uid)
        n = 1031
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        report = {}
        if use_torch:
            import torch

            from symmalloc import ops  # noqa: F401  (registers the custom ops)
            from symmalloc.p2p import _tensor_at

            raw = lib.symm_malloc(4 * n * world, rank, None)
            buf = _tensor_at(raw, torch.empty(n * world, dtype=torch.float32), 4 * n * world)
            src_of = lambda vals: torch.tensor(vals, dtype=torch.float32)  # noqa: E731
            read = lambda t: t.tolist()  # noqa: E731
        else:
            raw = lib.symm_malloc(4 * n * world, rank, None)
            buf = HostTensor(raw, n * world)
            srcbuf = (ctypes.c_float * n)()
            src_t = HostTensor(ctypes.addressof(srcbuf), n)

            def src_of(vals):
                src_t.fill(vals)
                return src_t

            read = lambda t: t.values()  # noqa: E731
        h = comm.rendezvous(buf)
        ptrs = h.buffer_ptr_list
        assert ptrs[rank] == raw, (ptrs, raw)
        d = comm.device_comm()
        assert (d.world, d.rank, d.signal_slots) == (world, rank, 4096)
        assert all(ptrs[r] == d.heap_bases[r] + (raw - d.heap_bases[rank]) for r in range(world))
        # Around the ring, 20 rounds of fresh data, acknowledged before the next overwrite.
        view = (lambda off: buf[off:off + n]) if use_torch else (lambda off: HostTensor(raw + 4 * off, n))
        for k in range(1, 21):
            mine = _data(k, rank, n)
            if use_torch:
                ops.put_(src_of(mine), view(rank * n), nxt, comm)
                ops.signal_(view(rank * n), nxt, rank, k, comm)
                ops.wait_(view(prv * n), prv, k, comm)
            else:
                comm.put(src_of(mine), nxt, view(rank * n))
                comm.signal(nxt, rank, k)
                comm.wait(prv, k)
            got = read(view(prv * n))
            assert got == _data(k, prv, n), f"round {k}: rank {prv}'s data"
            comm.signal(prv, 64 + rank, k)
            comm.wait(64 + nxt, k)
        if use_torch:
            peer = h.peer_tensor(nxt)
            assert peer.shape == buf.shape and peer.dtype == buf.dtype
            assert peer.data_ptr() == ptrs[nxt]
            assert h.buffer_ptrs.tolist() == ptrs and h.buffer_ptrs.dtype == torch.int64
            assert h.signal_pad_ptrs.tolist() == list(d.signal_pads[:world])
            # Rank nxt's own slice `prv`... is what rank prv put there: its data of round 20
            # (the tensor aliases rank nxt's memory).
            report["peer_tensor"] = peer[rank * n:(rank + 1) * n].tolist() == _data(20, rank, n)
        # Refusals, each leaving the communicator usable.
        q2 = lib.symm_malloc(4 * n, rank, None)
        report["errors"] = [
            error_of(lambda: comm.signal(world, 0, 1)),
            error_of(lambda: comm.wait(4096, 1)),
            error_of(lambda: comm.signal(0, -1, 1)),
            error_of(lambda: comm.put(HostTensor(q2, n), nxt, HostTensor(q2, n))),
            error_of(lambda: h.peer_ptr(world)),
            error_of(lambda: comm.put(HostTensor(q2, n - 1), nxt, HostTensor(raw, n))),
        ]
        # Other sizes on one rank: NOT_SYMMETRIC on every rank.
        report["asymmetric"] = error_of(lambda: comm.rendezvous(HostTensor(q2, n if rank == 0 else n - 1)))
        comm.barrier()
        lib.symm_free(q2, 4 * n, rank, None)
        comm.close()
        q.put((rank, report, None))
    except Exception as e:  # reported to the parent, never a hang
        import traceback

        q.put((rank, None, traceback.format_exc()))


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("use_torch", [False, True], ids=["no_torch", "torch"])
def test_rendezvous_put_signal_wait_and_refusals(world, use_torch):
    if use_torch:
        pytest.importorskip("torch", reason="PyTorch is not installed here (the torch venv runs these)")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    uid = symmalloc.get_unique_id()
    procs = [ctx.Process(target=_rank, args=(r, world, uid, q, use_torch)) for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    for _ in procs:
        rank, report, failure = q.get(timeout=120)
        assert failure is None, f"rank {rank}: {failure}"
        got[rank] = report
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    for rank, report in got.items():
        e = report["errors"]
        assert f"peer {world} is out of range" in e[0], e[0]
        assert "slot 4096 is past the signal pad" in e[1], e[1]
        assert "signal: slot -1" in e[2], e[2]
        assert "not in a range rendezvoused" in e[3], e[3]
        assert f"peer {world} is out of range" in e[4], e[4]
        assert "put: src has" in e[5], e[5]
        assert all(x.startswith("SYMM_ERR_INVALID_ARGUMENT") for x in e), e
        assert report["asymmetric"].startswith("SYMM_ERR_NOT_SYMMETRIC"), report["asymmetric"]
        if use_torch:
            assert report["peer_tensor"], f"rank {rank}: the peer tensor does not alias the peer's memory"
