"""Misuse of every public Python call and custom op, on the host backend, at 2 and 3 ranks
(processes): each class is refused with a message or handled correctly (as
docs/python-errors.md says), the communicator stays usable afterwards, and the tensors of the
call and of earlier calls keep their data. Ranks that disagree on a call: the error reaches
every rank, on a fresh communicator, after many calls and with SYMMALLOC_CHECK_SYMMETRY=1;
close-and-recreate is the way back. Needs torch (CI's wheel test installs it)."""
import math
import multiprocessing as mp
import os
import traceback

import pytest

import symmalloc

pytestmark = pytest.mark.skipif(
    os.environ.get("SYMMALLOC_BACKEND") != "host",
    reason="needs SYMMALLOC_BACKEND=host (ranks as processes on host memory)",
)
INVALID, NOT_SYMMETRIC = "SYMM_ERR_INVALID_ARGUMENT", "SYMM_ERR_NOT_SYMMETRIC"


class _Checks:
    """One rank's checks; failures are collected, not raised, so every rank reports."""

    def __init__(self, torch, comm, rank, world):
        self.torch, self.comm, self.rank, self.world = torch, comm, rank, world
        self.failures = []
        self.kept = torch.full((7,), 3.0)  # an earlier call's result: must never change
        comm.all_reduce(self.kept)

    def fail(self, what):
        self.failures.append(f"rank {self.rank}/{self.world}: {what}")

    def probe(self, what):
        """The communicator still works: an agreeing all-reduce gives the right sum."""
        t = self.torch
        y = t.full((33,), float(self.rank + 1))
        try:
            self.comm.all_reduce(y)
        except Exception as e:
            return self.fail(f"after {what}: the next call failed: {e}")
        if not t.all(y == self.world * (self.world + 1) / 2):
            self.fail(f"after {what}: the next call gave {y[:3].tolist()}")
        if not t.all(self.kept == 3.0 * self.world):
            self.fail(f"after {what}: an earlier result changed to {self.kept.tolist()}")

    def refused(self, what, fn, *tensors, status=INVALID, says=(), probe=True):
        before = [x.clone() for x in tensors]
        try:
            fn()
        except symmalloc.SymmallocError as e:
            if e.status != status:
                self.fail(f"{what}: status {e.status}, expected {status}: {e}")
            for s in says:
                if s not in str(e):
                    self.fail(f"{what}: the message lacks {s!r}: {e}")
        except Exception as e:  # torch.compile wraps the fake's error
            if not (status in str(e) and all(s in str(e) for s in says)):
                self.fail(f"{what}: {type(e).__name__}: {str(e)[:300]}")
        else:
            self.fail(f"{what}: not refused")
        for b, x in zip(before, tensors):
            if not self.torch.equal(b, x):
                self.fail(f"{what}: a tensor of the refused call changed")
        if probe:
            self.probe(what)

    def handled(self, what, got, want, tol=0.0):
        t = self.torch
        if tuple(got.shape) != tuple(want.shape) or not t.allclose(got.float(), want.float(), atol=tol, rtol=tol):
            self.fail(f"{what}: got {got.flatten()[:4].tolist()} {tuple(got.shape)}, want {want.flatten()[:4].tolist()} {tuple(want.shape)}")
        self.probe(what)


def _inputs(torch, rank, shape, dtype=None):
    g = torch.Generator().manual_seed(1234 + rank)
    return torch.randint(-8, 8, shape, generator=g).to(dtype or torch.float32)


def _misuse(torch, comm, rank, world, ck):
    import symmalloc.ops as sops

    w, c = world, comm
    f32 = torch.float32
    x = torch.ones(12 * w)
    mine = _inputs(torch, rank, (2 * w, 6))
    every = [_inputs(torch, r, (2 * w, 6)) for r in range(w)]
    total = sum(every)

    # dtype
    for name, fn in [
        ("all_reduce int64", lambda: c.all_reduce(torch.ones(8, dtype=torch.int64))),
        ("all_reduce float64", lambda: c.all_reduce(torch.ones(8, dtype=torch.float64))),
        ("all_reduce out of another dtype", lambda: c.all_reduce(x, out=torch.empty(12 * w, dtype=torch.bfloat16))),
        ("reduce_scatter int64", lambda: c.reduce_scatter(torch.empty(2, dtype=torch.int64), torch.ones(2 * w, dtype=torch.int64))),
        ("reduce_scatter mixed dtypes", lambda: c.reduce_scatter(torch.empty(2, dtype=torch.float16), torch.ones(2 * w))),
        ("all_gather int64", lambda: c.all_gather(torch.empty(2 * w, dtype=torch.int64), torch.ones(2, dtype=torch.int64))),
        ("fused float64", lambda: c.all_reduce_add_rms_norm(*(torch.ones(2, 8, dtype=torch.float64),) * 2, torch.ones(8, dtype=torch.float64))),
        ("fused weight of another dtype", lambda: c.all_reduce_add_rms_norm(torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(8))),
        ("op all_reduce int64", lambda: sops.all_reduce(torch.ones(8, dtype=torch.int64), c)),
        ("op all_gather float64", lambda: sops.all_gather(torch.ones(8, dtype=torch.float64), c)),
    ]:
        ck.refused(name, fn, x, says=("dtype",))

    # device: on the host backend the communicator takes CPU tensors; a tensor that says it is
    # on a GPU (what a CUDA tensor would be here) is refused, by the compiled caller's fallback too.
    class OnGpu:
        def __init__(self, t):
            self.t, self.dtype, self.shape = t, t.dtype, t.shape

        def is_contiguous(self):
            return self.t.is_contiguous()

        def data_ptr(self):
            return self.t.data_ptr()

        def numel(self):
            return self.t.numel()

        def new_empty(self, *a):
            return self.t.new_empty(*a)

        def get_device(self):
            return 0

    g = OnGpu(torch.ones(8))
    for name, fn in [
        ("all_reduce on cuda:0", lambda: c.all_reduce(g)),
        ("all_reduce out on cuda:0", lambda: c.all_reduce(torch.ones(8), out=g)),
        ("reduce_scatter on cuda:0", lambda: c.reduce_scatter(OnGpu(torch.ones(2)), torch.ones(2 * w))),
        ("all_gather on cuda:0", lambda: c.all_gather(torch.ones(2 * w), OnGpu(torch.ones(2)))),
        ("fused on cuda:0", lambda: c.all_reduce_add_rms_norm(OnGpu(torch.ones(2, 8, dtype=torch.bfloat16)),
                                                             torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(8, dtype=torch.bfloat16))),
    ]:
        ck.refused(name, fn, x, says=("a tensor is on cuda:0", "this communicator's tensors are on cpu"))
    if symmalloc._fast_all_reduce() is not None:
        caller = c.all_reduce
        c._compile_eager(OnGpu, {f32: 2, torch.float16: 1, torch.bfloat16: 0}, lambda dev: 0)
        ck.refused("the compiled caller, a tensor on cuda:0", lambda: c.all_reduce(g), x, says=("a tensor is on cuda:0",), probe=False)
        c.__dict__["all_reduce"] = caller
        ck.probe("the compiled caller, a tensor on cuda:0")

    # contiguity: the methods refuse; the custom ops copy an input (handled) but refuse a tensor
    # they update in place.
    nc = mine.t()  # [6, 2w], not contiguous
    for name, fn in [
        ("all_reduce not contiguous", lambda: c.all_reduce(nc)),
        ("all_reduce out not contiguous", lambda: c.all_reduce(mine, out=torch.empty(6, 2 * w).t())),
        ("reduce_scatter not contiguous", lambda: c.reduce_scatter(torch.empty(2, 6), torch.ones(6, 2 * w).t())),
        ("all_gather not contiguous", lambda: c.all_gather(torch.empty(6, 2 * w).t(), torch.ones(2, 6))),
        ("fused x not contiguous", lambda: c.all_reduce_add_rms_norm(torch.ones(8, 2, dtype=torch.bfloat16).t(), torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(8, dtype=torch.bfloat16))),
        ("op all_reduce_ not contiguous", lambda: sops.all_reduce_(nc, c)),
        ("op fused residual not contiguous", lambda: sops.all_reduce_add_rms_norm(torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(8, 2, dtype=torch.bfloat16).t(), torch.ones(8, dtype=torch.bfloat16), c)),
    ]:
        ck.refused(name, fn, mine, nc, says=("contiguous",))
    ck.handled("op all_reduce not contiguous", sops.all_reduce(nc, c), total.t())
    ck.handled("op reduce_scatter not contiguous", sops.reduce_scatter(mine.t().contiguous().t(), c), total[2 * rank:2 * rank + 2])

    # shapes and out
    ck.refused("all_reduce out of another size", lambda: c.all_reduce(mine, out=torch.empty(12 * w + 1)), mine, says=("out must be",))
    out = torch.empty(12 * w)  # the same element count, another shape: handled, flat
    c.all_reduce(mine, out=out)
    ck.handled("all_reduce out of another shape (flat)", out, total.flatten())
    bad_rs = [  # (out, inp): sizes agree, shapes do not
        (torch.empty(2 * w, 6 // w), mine),  # the width, not dim 0, divided by the world size
        (torch.empty(2, 6), torch.ones(12 * w)), (torch.empty(3, 4), mine)]
    for o, i in bad_rs:
        ck.refused(f"reduce_scatter out {list(o.shape)} inp {list(i.shape)}", lambda o=o, i=i: c.reduce_scatter(o, i), mine,
                   says=(f"shape [{', '.join(map(str, i.shape))}]", "along dim 0"))
    o = torch.full((2, 6), float("nan"))
    c.reduce_scatter(o, mine)
    ck.handled("reduce_scatter along dim 0", o, total[2 * rank:2 * rank + 2])
    o = torch.full((w, 2, 6), float("nan"))
    c.all_gather(o, every[rank][:2].clone())
    ck.handled("all_gather stacked", o, torch.stack([e[:2] for e in every]))
    for o in (torch.empty(2, 6 * w), torch.empty(12 * w)):
        ck.refused(f"all_gather out {list(o.shape)} inp [2, 6]", lambda o=o: c.all_gather(o, torch.ones(2, 6)), mine,
                   says=("[2, 6]", "along dim 0"))
    ck.refused("op reduce_scatter dim 0 not divisible", lambda: sops.reduce_scatter(torch.ones(w + 1, 4), c), mine,
               says=("dim 0 divisible",))
    bf = torch.bfloat16
    for xs, rs, ws, say in [((4, 24), (4, 24), (12,), "weight [12]"), ((4, 24), (2, 48), (24,), "residual [2, 48]"),
                            ((4, 24), (4, 24), (4, 24), "weight [4, 24]"), ((24,), (24,), (0,), "weight [0]")]:
        args = (torch.ones(xs, dtype=bf), torch.ones(rs, dtype=bf), torch.ones(ws, dtype=bf))
        ck.refused(f"fused x {xs} residual {rs} weight {ws}", lambda a=args: c.all_reduce_add_rms_norm(*a), *args,
                   says=(f"x [{', '.join(map(str, xs))}]", say))
        ck.refused(f"op fused x {xs} residual {rs} weight {ws}", lambda a=args: sops.all_reduce_add_rms_norm(*a, c), *args,
                   says=(f"x [{', '.join(map(str, xs))}]", say))
        compiled = torch.compile(lambda a, b, wt: sops.all_reduce_add_rms_norm(a, b, wt, c), backend="eager", fullgraph=True)
        ck.refused(f"compiled fused x {xs} weight {ws}", lambda a=args: compiled(*a), *args, says=(say,))
    args = (torch.ones(4, 24, dtype=bf), torch.ones(4, 24, dtype=bf), torch.ones(24, dtype=bf))
    ck.refused("fused out of another shape", lambda: c.all_reduce_add_rms_norm(*args, out=torch.empty(96, dtype=bf)), *args,
               says=("out [96]",))
    # The fused call, right: [2, 3, 16] (any leading dims), against torch's rms_norm.
    xf = _inputs(torch, rank, (2, 3, 16), bf)
    res0 = _inputs(torch, 99, (2, 3, 16), bf)
    wt = (_inputs(torch, 98, (16,)) / 4).to(bf)
    res = res0.clone()
    got = c.all_reduce_add_rms_norm(xf, res, wt, eps=0.0 + 1e-6)
    want_res = (sum(_inputs(torch, r, (2, 3, 16), bf).float() for r in range(w)) + res0.float())
    ck.handled("fused [2, 3, 16] residual", res, want_res.to(bf), tol=1e-2)
    ck.handled("fused [2, 3, 16] out", got, torch.nn.functional.rms_norm(want_res, (16,), wt.float(), 1e-6).to(bf), tol=3e-2)

    # op and algorithm names, eps
    for name, fn in [
        ("all_reduce op avg", lambda: c.all_reduce(x, op="avg")),
        ("all_reduce algo fast", lambda: c.all_reduce(x, algo="fast")),
        ("all_reduce op 0", lambda: c.all_reduce(x, op=0)),
        ("reduce_scatter op avg", lambda: c.reduce_scatter(torch.empty(12), x, op="avg")),
        ("op all_reduce algo fast", lambda: sops.all_reduce(x, c, algo="fast")),
        ("op all_reduce_ op prod", lambda: sops.all_reduce_(x, c, op="prod")),
        ("op reduce_scatter op avg", lambda: sops.reduce_scatter(x, c, op="avg")),
    ]:
        ck.refused(name, fn, x, says=("unknown",))
    for eps in (float("nan"), -1e-6, float("inf")):
        ck.refused(f"fused eps {eps}", lambda eps=eps: c.all_reduce_add_rms_norm(*args, eps=eps), *args, says=("eps",))
        ck.refused(f"op fused eps {eps}", lambda eps=eps: sops.all_reduce_add_rms_norm(*args, c, eps=eps), *args, says=("eps",))

    # handles
    y = torch.full((5,), float(rank + 1))
    c.all_reduce(y, op=None, algo=None)  # None: the defaults, on both paths
    ck.handled("all_reduce op=None algo=None (the defaults)", y, torch.full((5,), w * (w + 1) / 2))
    ck.refused("op with a handle never made", lambda: sops.all_reduce(x, 10 ** 9), x, says=("is not a live Communicator",))
    ck.refused("op with a handle never made (compiled)", lambda: torch.compile(lambda t: sops.all_gather(t, 10 ** 9), backend="eager")(x),
               x, says=("is not a live Communicator",))


def _disagree(torch, comm, rank, world, ck, mode):
    """Ranks that disagree on count, dtype, op or call: NOT_SYMMETRIC on every rank from the bad
    call itself (host backend), nothing outside the communicator's buffers written, usable after."""
    lib = symmalloc._library()
    if mode == "many":
        for _ in range(50):
            ck.probe("an agreeing call")
    # Plain CPU tensors (staged through the scratch) and tensors in symmalloc's heap.
    p = lib.symm_malloc(4 * 256, rank, None)
    heap = torch.frombuffer((ctypes_array(4 * 256)).from_address(p), dtype=torch.float32)
    for where in ("staged", "heap"):
        for what in ("count", "dtype", "op", "call"):
            if where == "heap" and what == "call":
                continue  # rank 1 leaves the sequence here and closes; rank 0 then gets SYMM_ERR_PEER (it segfaulted before retire.rs checked for it): not a disagreement case
            if where == "heap":
                heap.fill_(float(rank + 1))
                t = heap[:64 + (rank if what == "count" else 0)]
            else:
                t = torch.full((64 + (rank if what == "count" else 0),), float(rank + 1))
            if what == "dtype" and rank == 1:
                t = t.view(torch.bfloat16)[:64] if where == "heap" else t.to(torch.bfloat16)
            if what == "call" and rank == 1:
                fn = lambda t=t: comm.all_gather(torch.empty(64 * world), t)  # noqa: E731
            else:
                fn = lambda t=t: comm.all_reduce(t, op="max" if (what == "op" and rank == 1) else "sum")  # noqa: E731
            ck.refused(f"{mode}: ranks disagree on {what} ({where})", fn, t, status=NOT_SYMMETRIC)
    lib.symm_free(p, 4 * 256, rank, None)


def ctypes_array(n):
    import ctypes

    return ctypes.c_char * n


def _rank(rank, world, uids, q):
    try:
        import torch

        torch.set_num_threads(1)
        ck = None
        comm = symmalloc.Communicator(rank, world, uids[0])
        ck = _Checks(torch, comm, rank, world)
        _misuse(torch, comm, rank, world, ck)
        _disagree(torch, comm, rank, world, ck, "fresh")
        _disagree(torch, comm, rank, world, ck, "many")
        # A closed communicator: every call says so; closing twice does nothing.
        kept, handle = comm.all_reduce, comm.handle
        comm.close()
        comm.close()
        import symmalloc.ops as sops

        t = torch.ones(8)
        for name, fn in [
            ("all_reduce", lambda: comm.all_reduce(t)), ("kept all_reduce", lambda: kept(t)),
            ("reduce_scatter", lambda: comm.reduce_scatter(torch.ones(8), torch.ones(8 * world))),
            ("all_gather", lambda: comm.all_gather(torch.ones(8 * world), torch.ones(8))),
            ("fused", lambda: comm.all_reduce_add_rms_norm(torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(8, dtype=torch.bfloat16))),
            ("barrier", comm.barrier), ("op all_reduce", lambda: sops.all_reduce(t, comm)),
            ("op all_reduce_ by handle", lambda: torch.ops.symmalloc.all_reduce_(t, handle, "sum", "auto")),
        ]:
            ck.refused(f"closed: {name}", fn, t, says=("was closed by close()",), probe=False)
        # The way back: close and make a new one (here with SYMMALLOC_CHECK_SYMMETRY=1, read at init).
        os.environ["SYMMALLOC_CHECK_SYMMETRY"] = "1"
        comm = ck.comm = symmalloc.Communicator(rank, world, uids[1])
        ck.kept = torch.full((7,), 3.0)
        comm.all_reduce(ck.kept)
        ck.probe("a new communicator")
        _disagree(torch, comm, rank, world, ck, "check")
        comm.close()
        q.put((rank, ck.failures))
    except Exception:
        q.put((rank, (ck.failures if ck else []) + [f"rank {rank}: {traceback.format_exc()}"]))


@pytest.mark.parametrize("world", [2, 3])
def test_misuse_is_refused_or_handled_and_the_communicator_lives_on(world):
    pytest.importorskip("torch", reason="PyTorch is not installed here (make test-wheel's torch venv runs this)")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    uids = [symmalloc.get_unique_id(), symmalloc.get_unique_id()]
    env = {"SYMMALLOC_TIMEOUT_S": "60"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        procs = [ctx.Process(target=_rank, args=(r, world, uids, q)) for r in range(world)]
        for p in procs:
            p.start()
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    import queue
    import time

    failures, got, deadline = [], 0, time.time() + 600
    while got < world and time.time() < deadline:
        try:
            rank, f = q.get(timeout=5)
            failures += f
            got += 1
        except queue.Empty:  # a rank that died without reporting (a crash) ends the wait
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                failures.append(f"ranks {dead} exited with {[procs[r].exitcode for r in dead]} without reporting")
                break
    for p in procs:
        p.join(60)
        if p.exitcode is None:
            p.kill()
    assert got == world or failures, "a rank did not report within 600 s"
    assert not failures, "\n".join(failures)
    assert all(p.exitcode == 0 for p in procs)
