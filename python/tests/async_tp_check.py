"""Async tensor parallelism on GPUs (the device machine; not collected by pytest): N ranks, one
process each, sharing the machine's GPUs (SYMMALLOC_SHARED_GPU=1 when N > GPUs).

For bf16 and fp16: ``all_gather_matmul`` (also with ``return_a`` and a 3-d input gathered along
dim 1) and ``matmul_reduce_scatter`` eager on fresh random data against float64, outputs
poisoned first; then both captured in one CUDA graph and replayed 50 times with fresh data
copied into the static inputs, each replay checked; then, at 2 ranks, a function that takes
its inputs as arguments compiled with ``torch.compile(fullgraph=True, mode="reduce-overhead")``
(0 graph breaks, 0 cudagraph skips, same result as eager). Every rank's results are compared
bitwise with rank 0's where they must agree (the gathered ``a``).
``--dying N``: N ranks, the last one exits after the pipeline's first step (its barrier); the
others' next ``all_gather_matmul`` must release their streams and report, naming that rank,
within the timeout (SYMMALLOC_TIMEOUT_S=3).

    python python/tests/async_tp_check.py --world 2 4 8 --dying 3
"""
import argparse
import os
import sys
import traceback

import torch
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
import symmalloc  # noqa: E402
import symmalloc.async_tp as atp  # noqa: E402


def data(seed, rank, shape, dtype):
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    return (torch.randn(shape, generator=g) / shape[-1] ** 0.25).to(dtype)


def close(what, got, want64):
    got = got.double().cpu()
    assert torch.isfinite(got).all(), f"{what}: elements not written"
    err = (got - want64).abs().max().item()
    scale = want64.abs().max().item()
    tol = 2 ** -7 if what.endswith("bf16") else 2 ** -10
    assert err <= 2 * tol * scale, f"{what}: max error {err:.3g} for values up to {scale:.3g}"


def rank_main(rank, world, uid, q, compile_check):
    try:
        gpus = torch.cuda.device_count()
        dev = rank % gpus
        torch.cuda.set_device(dev)
        comm = symmalloc.Communicator(rank, world, uid, device=dev)
        M, K, N = 96, 256, 192  # per-rank rows; M * world gathered
        report = {}
        for dtype, tag in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
            shards = [data(1, p, (M, K), dtype) for p in range(world)]
            b = data(2, 100, (K, N), dtype)
            y, a = atp.all_gather_matmul(shards[rank].cuda(), b.cuda(), comm, return_a=True)
            full = torch.cat(shards)
            assert torch.equal(a.cpu(), full), "gathered a"
            close(f"all_gather_matmul {tag}", y, full.double() @ b.double())
            s3 = [data(3, p, (2, M // 2, K), dtype) for p in range(world)]
            y3 = atp.all_gather_matmul(s3[rank].cuda(), b.cuda(), comm, gather_dim=1)
            close(f"all_gather_matmul gather_dim=1 {tag}", y3, torch.cat(s3, 1).double() @ b.double())
            parts = [data(4, p, (M * world, K), dtype) for p in range(world)]
            bs = [data(5, p, (K, N), dtype) for p in range(world)]
            z = atp.matmul_reduce_scatter(parts[rank].cuda(), bs[rank].cuda(), comm)
            want = sum(parts[p].double() @ bs[p].double() for p in range(world))
            close(f"matmul_reduce_scatter {tag}", z, want[rank * M:(rank + 1) * M])
            # One graph with both calls, replayed 50 times on fresh data.
            xa, xb = shards[rank].cuda(), b.cuda()
            pa, pb = parts[rank].cuda(), bs[rank].cuda()
            atp.all_gather_matmul(xa, xb, comm)  # warm-up: the workspaces of these shapes
            atp.matmul_reduce_scatter(pa, pb, comm)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                gy = atp.all_gather_matmul(xa, xb, comm)
                gz = atp.matmul_reduce_scatter(pa, pb, comm)
            for it in range(50):
                sh = [data(100 + it, p, (M, K), dtype) for p in range(world)]
                bb = data(200 + it, 100, (K, N), dtype)
                pp = [data(300 + it, p, (M * world, K), dtype) for p in range(world)]
                qq = [data(400 + it, p, (K, N), dtype) for p in range(world)]
                xa.copy_(sh[rank]), xb.copy_(bb), pa.copy_(pp[rank]), pb.copy_(qq[rank])
                gy.fill_(float("nan")), gz.fill_(float("nan"))
                g.replay()
                torch.cuda.synchronize()
                if it % 10 == 0 or it == 49:  # the float64 references are the slow part
                    close(f"replay {it} all_gather_matmul {tag}", gy, torch.cat(sh).double() @ bb.double())
                    w = sum(pp[p].double() @ qq[p].double() for p in range(world))
                    close(f"replay {it} matmul_reduce_scatter {tag}", gz, w[rank * M:(rank + 1) * M])
                else:
                    assert torch.isfinite(gy).all() and torch.isfinite(gz).all(), f"replay {it}: not written"
            del g
        if compile_check:
            import torch._dynamo as dynamo
            from torch._dynamo.utils import counters

            def block(x, w1, w2):
                return atp.matmul_reduce_scatter(torch.relu(atp.all_gather_matmul(x, w1, comm)), w2, comm)

            x = data(7, rank, (M, K), torch.bfloat16).cuda()
            w1, w2 = data(8, 100, (K, N), torch.bfloat16).cuda(), data(9, rank, (N, K), torch.bfloat16).cuda()
            eager = block(x, w1, w2)
            explained = dynamo.explain(block)(x, w1, w2)
            counters.clear()
            f = torch.compile(block, fullgraph=True, mode="reduce-overhead")
            for _ in range(3):
                got = f(x, w1, w2)
            torch.cuda.synchronize()
            skips = sum(counters["inductor"].get(k, 0) for k in list(counters["inductor"]) if "cudagraph_skips" in k)
            report["compile"] = (explained.graph_break_count, skips, torch.equal(got, eager))
        comm.barrier()
        torch.cuda.synchronize()
        comm.close()
        q.put((rank, report, None))
    except Exception:
        q.put((rank, None, traceback.format_exc()))


def run(world):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    uid = symmalloc.get_unique_id()
    if world > torch.cuda.device_count():
        os.environ["SYMMALLOC_SHARED_GPU"] = "1"
    procs = [ctx.Process(target=rank_main, args=(r, world, uid, q, world == 2)) for r in range(world)]
    for p in procs:
        p.start()
    got, failures = {}, []
    for _ in procs:
        rank, report, failure = q.get(timeout=600)
        if failure is not None:
            failures.append(f"world {world} rank {rank}:\n{failure}")
        got[rank] = report
    assert not failures, "\n".join(failures)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0, f"rank exit code {p.exitcode}"
    line = f"world {world}: all_gather_matmul (return_a, gather_dim=1) and matmul_reduce_scatter, bf16 and fp16, eager + 50 graph replays correct vs float64"
    if world == 2:
        breaks, skips, same = got[0]["compile"]
        assert breaks == 0 and skips == 0 and same, f"torch.compile: {breaks} graph breaks, {skips} cudagraph skips, equal to eager: {same}"
        line += "; torch.compile(fullgraph, reduce-overhead): 0 graph breaks, 0 cudagraph skips, equal to eager"
    print(line, flush=True)


def dying_main(rank, world, uid, q):
    import time

    try:
        dev = rank % torch.cuda.device_count()
        torch.cuda.set_device(dev)
        comm = symmalloc.Communicator(rank, world, uid, device=dev)
        x = data(1, rank, (64, 128), torch.bfloat16).cuda()
        b = data(2, 100, (128, 64), torch.bfloat16).cuda()
        atp.all_gather_matmul(x, b, comm)  # the workspace is set up, every rank alive
        torch.cuda.synchronize()
        if rank == world - 1:
            # The pipeline's first step, then death before any put or signal.
            atp._barrier(comm)
            torch.cuda.synchronize()
            os._exit(0)
        t0 = time.monotonic()
        err = None
        try:
            atp.all_gather_matmul(x, b, comm)
            torch.cuda.synchronize()  # the stream must come back: the waits give up
            comm.barrier()  # reports what the waits found
        except symmalloc.SymmallocError as e:
            err = str(e)
        took = time.monotonic() - t0
        q.put((rank, (err, took), None))
        q.close()
        q.join_thread()  # the report is written before the exit below
        os._exit(0)  # the communicator cannot be closed collectively any more
    except Exception:
        q.put((rank, None, traceback.format_exc()))


def run_dying(world):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    uid = symmalloc.get_unique_id()
    os.environ["SYMMALLOC_TIMEOUT_S"] = "3"
    if world > torch.cuda.device_count():
        os.environ["SYMMALLOC_SHARED_GPU"] = "1"
    procs = [ctx.Process(target=dying_main, args=(r, world, uid, q)) for r in range(world)]
    for p in procs:
        p.start()
    lines = []
    for _ in range(world - 1):
        rank, report, failure = q.get(timeout=120)
        assert failure is None, f"rank {rank}: {failure}"
        err, took = report
        assert err is not None and f"rank {world - 1}" in err, f"rank {rank}: {err}"
        assert took < 30, f"rank {rank} took {took:.1f} s to report the dead rank"
        lines.append(f"rank {rank} in {took:.1f} s: {err[:160]}")
    for p in procs:
        p.join(30)
    print(f"world {world}, rank {world - 1} dead mid-pipeline, every other rank named it:", flush=True)
    print("\n".join("  " + s for s in sorted(lines)), flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, nargs="*", default=[2])
    ap.add_argument("--dying", type=int, default=0, help="ranks of the dying-rank check (0: not run)")
    args = ap.parse_args()
    for w in args.world:
        run(w)
    if args.dying:
        run_dying(args.dying)
