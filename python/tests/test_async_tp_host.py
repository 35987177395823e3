"""Async tensor parallelism (symmalloc.async_tp) on the host backend (CI, no GPU): both pipelines
against a float64 reference on fresh data at 2, 3 and 4 ranks (bf16 and fp16, a 3-d input
gathered along dim 1, M not a multiple of anything but the world size), 50 calls in a row with
fresh data, the refusals, torch.compile(fullgraph=True) over the custom ops, and a rank that
dies mid-pipeline, which the others report within the timeout, naming it. GPU runs:
python/tests/async_tp_check.py."""
import multiprocessing as mp
import os
import time

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed here (the torch venv runs these)")
import symmalloc  # noqa: E402
from error_text import error_of  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("SYMMALLOC_BACKEND") != "host",
    reason="needs SYMMALLOC_BACKEND=host (GPU runs use async_tp_check.py)",
)


def _data(seed, rank, shape, dtype):
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    return (torch.randn(shape, generator=g) / shape[-1] ** 0.25).to(dtype)


def _close(got, want64, what):
    """bf16/fp16 output of an fp32-accumulated product against float64: within a few units of
    the output's rounding, relative to the row scale."""
    err = (got.double() - want64).abs().max().item()
    scale = want64.abs().max().item()
    tol = 2 ** -7 if got.dtype == torch.bfloat16 else 2 ** -10
    assert err <= 2 * tol * scale, f"{what}: max error {err:.3g} for values up to {scale:.3g}"


def _rank(rank, world, uid, q):
    try:
        import symmalloc.async_tp as atp

        comm = symmalloc.Communicator(rank, world, uid)
        report = {}
        for dtype in (torch.bfloat16, torch.float16):
            K, N, m = 96, 40, 5
            for it in range(50 if dtype == torch.bfloat16 else 3):
                shards = [_data(it, p, (m, K), dtype) for p in range(world)]
                b = _data(it, 100, (K, N), dtype)
                y, a = atp.all_gather_matmul(shards[rank], b, comm, return_a=True)
                full = torch.cat(shards)
                assert torch.equal(a, full), "gathered a"
                _close(y, full.double() @ b.double(), f"all_gather_matmul {dtype} call {it}")
                # matmul_reduce_scatter: M = 3 * world rows (not a multiple of anything else).
                M = 3 * world
                a_parts = [_data(it + 500, p, (M, K), dtype) for p in range(world)]
                b_shards = [_data(it + 900, p, (K, N), dtype) for p in range(world)]
                z = atp.matmul_reduce_scatter(a_parts[rank], b_shards[rank], comm)
                want = sum(a_parts[p].double() @ b_shards[p].double() for p in range(world))
                assert z.shape == (3, N) and z.dtype == dtype
                _close(z, want[3 * rank:3 * rank + 3], f"matmul_reduce_scatter {dtype} call {it}")
                # The exact bits: each rank's block in the dtype (its matmul's rounding), added in
                # fp32 in rank order, rounded once (whatever order the blocks arrived in).
                parts = [torch.matmul(a_parts[p][3 * rank:3 * rank + 3], b_shards[p]) for p in range(world)]
                exact = parts[0].float()
                for part in parts[1:]:
                    exact += part.float()
                assert torch.equal(z, exact.to(dtype)), f"matmul_reduce_scatter {dtype} call {it}: not the rank-order fp32 sum"
        # A 3-d input gathered along dim 1 (sequence parallel), and scattered back along dim 1.
        shards = [_data(7, p, (2, 3, 64), torch.bfloat16) for p in range(world)]
        b = _data(8, 100, (64, 16), torch.bfloat16)
        y = atp.all_gather_matmul(shards[rank], b, comm, gather_dim=1)
        _close(y, torch.cat(shards, 1).double() @ b.double(), "gather_dim=1")
        a3 = [_data(9, p, (2, 2 * world, 64), torch.bfloat16) for p in range(world)]
        z = atp.matmul_reduce_scatter(a3[rank], b, comm, scatter_dim=1)
        want = sum(a3[p].double() @ b.double() for p in range(world))
        _close(z, want[:, 2 * rank:2 * rank + 2], "scatter_dim=1")
        # torch.compile keeps both calls in one graph (fullgraph raises on a break).
        f = torch.compile(lambda x, w: atp.matmul_reduce_scatter(atp.all_gather_matmul(x, w, comm), w.t().contiguous(), comm),
                          fullgraph=True, backend="aot_eager")
        x = _data(11, rank, (4, 32), torch.bfloat16)
        w = _data(12, 100, (32, 32), torch.bfloat16)
        report["compiled"] = torch.equal(f(x, w), atp.matmul_reduce_scatter(atp.all_gather_matmul(x, w, comm), w.t().contiguous(), comm))
        # Refusals, each leaving the communicator usable.
        bf = torch.bfloat16
        report["errors"] = [
            error_of(lambda: atp.matmul_reduce_scatter(torch.zeros(2 * world + 1, 8, dtype=bf), torch.zeros(8, 4, dtype=bf), comm)),
            error_of(lambda: atp.all_gather_matmul(torch.zeros(4, 8), torch.zeros(8, 4), comm)),
            error_of(lambda: atp.all_gather_matmul(torch.zeros(4, 8, dtype=bf), torch.zeros(6, 4, dtype=bf), comm)),
            error_of(lambda: atp.all_gather_matmul(torch.zeros(4, 8, dtype=bf), torch.zeros(8, 4, dtype=bf), comm, gather_dim=1)),
            error_of(lambda: atp.all_gather_matmul(torch.zeros(4, 8, dtype=bf), torch.zeros(8, 4, dtype=torch.float16), comm)),
        ]
        y = atp.all_gather_matmul(shards[rank][0], b, comm)  # still usable
        _close(y, torch.cat([s[0] for s in shards]).double() @ b.double(), "after the refusals")
        comm.barrier()  # every rank's last call has finished with the others' memory
        comm.close()
        q.put((rank, report, None))
    except Exception:  # reported to the parent, never a hang
        import traceback

        q.put((rank, None, traceback.format_exc()))


def _run(target, world, *args):
    """``target(rank, world, uid, q, *args)`` in a spawned process per rank: {rank: report},
    every rank's failure raised together."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    uid = symmalloc.get_unique_id()
    procs = [ctx.Process(target=target, args=(r, world, uid, q) + args) for r in range(world)]
    for p in procs:
        p.start()
    got, failures = {}, []
    for _ in procs:
        rank, report, failure = q.get(timeout=300)
        if failure is not None:
            failures.append(f"world {world}, rank {rank}: {failure}")
        got[rank] = report
    assert not failures, "\n".join(failures)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    return got


@pytest.mark.parametrize("world", [2, 3, 4])
def test_async_tp_against_float64(world):
    got = _run(_rank, world)
    for rank, report in got.items():
        assert report["compiled"], f"rank {rank}: the compiled calls differ from the eager ones"
        e = report["errors"]
        assert "dim 0 (" in e[0] and f"divisible by the world size {world}" in e[0], e[0]
        assert "dtype torch.float32; expected bfloat16 or float16" in e[1], e[1]
        assert "the last dim of a_shard must equal dim 0 of b" in e[2], e[2]
        assert "dim 1 for a_shard of 2 dims" in e[3], e[3]
        assert "b has dtype torch.float16 and a_shard torch.bfloat16" in e[4], e[4]
        assert all(x is not None and x.startswith("SYMM_ERR_INVALID_ARGUMENT") for x in e), e


def _dying(rank, world, uid, q):
    try:
        import symmalloc.async_tp as atp

        comm = symmalloc.Communicator(rank, world, uid)
        x = _data(1, rank, (4, 16), torch.bfloat16)
        b = _data(2, 100, (16, 8), torch.bfloat16)
        atp.all_gather_matmul(x, b, comm)  # the workspace is set up, every rank alive
        if rank == world - 1:
            # The pipeline's first step, then death before any put: the others are left
            # waiting for this rank's signal inside their next call.
            atp._barrier(comm)
            os._exit(0)
        t0 = time.monotonic()
        err = error_of(lambda: atp.all_gather_matmul(x, b, comm))
        q.put((rank, (err, time.monotonic() - t0), None))
    except Exception:
        import traceback

        q.put((rank, None, traceback.format_exc()))


def test_a_rank_dying_mid_pipeline_is_named():
    world = 3
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    uid = symmalloc.get_unique_id()
    os.environ["SYMMALLOC_TIMEOUT_S"] = "3"
    try:
        procs = [ctx.Process(target=_dying, args=(r, world, uid, q)) for r in range(world)]
        for p in procs:
            p.start()
    finally:
        del os.environ["SYMMALLOC_TIMEOUT_S"]
    for _ in range(world - 1):
        rank, report, failure = q.get(timeout=120)
        assert failure is None, f"rank {rank}: {failure}"
        err, took = report
        assert err is not None and f"rank {world - 1}" in err, f"rank {rank}: {err}"
        assert took < 30, f"rank {rank} took {took:.1f} s to report the dead rank"
    for p in procs:
        p.join(30)


def _worlds_rank(rank, world, uid, q, cache):
    try:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # the shared on-disk cache, set before compiling
        import symmalloc.async_tp as atp
        import symmalloc.ops as sops

        torch.set_num_threads(1)
        comm = symmalloc.Communicator(rank, world, uid)
        K, N = 32, 16
        x = _data(7, rank, (4, K), torch.bfloat16)  # the same shapes at every world size
        b = _data(8, 100, (K, N), torch.bfloat16)

        def step(x, b):  # downstream ops that name no shape: the graph is the same at every world
            g = sops.all_gather(x, comm.handle) * 2  # a handle traces too (world_of's plain dict)
            s = sops.reduce_scatter(g, comm)
            y = atp.all_gather_matmul(x, b, comm) + 1
            z = atp.matmul_reduce_scatter(y, b.t().contiguous(), comm)
            return g, s, y, z

        want = step(x, b)
        got = torch.compile(step, fullgraph=True, backend="inductor")(x, b)
        assert [t.shape for t in got] == [t.shape for t in want], ([t.shape for t in got], [t.shape for t in want])
        assert all(torch.equal(u, v) for u, v in zip(got[:3], want[:3])), "compiled gather / scatter / matmul differ"
        _close(got[3], want[3].double(), "compiled matmul_reduce_scatter")
        err = error_of(lambda: torch.ops.symmalloc.all_gather(x, comm.handle, world + 1))
        assert f"all_gather: world {world + 1} is not the world size of communicator handle" in err, err
        comm.barrier()
        comm.close()
        q.put((rank, [tuple(t.shape) for t in got], None))
    except Exception:
        import traceback

        q.put((rank, None, traceback.format_exc()))


def test_compiled_graphs_are_not_reused_across_world_sizes_through_torchs_caches(tmp_path):
    """Inductor keeps compiled graphs on disk, keyed by the graph; a communicator handle is a
    number per process, so a world-2 and a world-4 run of the same code trace the same graph
    while reduce_scatter, all_gather and async TP's ops return other shapes. The ops take the
    world size as an argument, so the graphs differ: world 2, then world 4 on the same cache
    directory, both give eager's results (before, the second replayed the first's code)."""
    cache = str(tmp_path / "inductor")
    for world in (2, 4):
        got = _run(_worlds_rank, world, cache)
        assert got[0][0] == (4 * world, 32), got
    assert os.listdir(cache), "inductor wrote no cache: the test did not exercise it"
