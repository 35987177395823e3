"""Async tensor parallelism (symmalloc.async_tp) against its peers, in one run:

    python3 bench/async_tp.py [--world N] [--shapes M,K,N;...] [--iters 30] [--out DIR]

One process per rank (started here), one rank per GPU (default: every GPU). bf16. For each shape
(M = the gathered rows, K, N) and each rank, both directions:
  all-gather + matmul (a_shard [M/W, K], b [K, N/W]):
    symmalloc   atp.all_gather_matmul
    torch       torch.ops.symm_mem.fused_all_gather_matmul (torch's async TP)
    nccl        dist.all_gather_into_tensor, then torch.matmul
    matmul      torch.matmul of the gathered [M, K] by [K, N/W] alone: the ceiling
  matmul + reduce-scatter (a [M, K/W], b_shard [K/W, N]):
    symmalloc   atp.matmul_reduce_scatter
    torch       torch.ops.symm_mem.fused_matmul_reduce_scatter
    nccl        torch.matmul, then dist.reduce_scatter_tensor
    matmul      torch.matmul alone
Every variant is first checked against the NCCL one on fresh random data (symmalloc: equal up to
bf16 rounding). Timing: each variant captured in a CUDA graph of one call (eager where capture
fails; the "run as" column says which), warm, then `iters` replays of each between CUDA events,
interleaved across variants (clock and power drift hit all alike), all ranks started together
by a barrier: p50 / p99 / max per call, TFLOP/s at p50 (2·M·K·N/W flops per rank). A variant that cannot run here (torch's ops need their symmetric-memory backend)
prints why instead of a figure. At world 1 the table times the pipeline's local work (barrier,
signal bookkeeping, matmul) against matmul alone, a filter only: the verdict needs 2+ GPUs.
Correctness with several ranks sharing one GPU: python/tests/async_tp_check.py.
Multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1).
"""
import argparse
import json
import os
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
os.environ.pop("SYMMALLOC_ENABLE_MULTICAST", None)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import symmalloc  # noqa: E402
import symmalloc.async_tp as atp  # noqa: E402

DEFAULT_SHAPES = "1024,4096,4096;4096,4096,4096;4096,8192,8192;8192,8192,8192;16384,8192,8192;8192,16384,16384"


def graphed(fn):
    """fn captured in a CUDA graph after 3 warm calls (a side stream, as torch.cuda.graph wants);
    the eager fn where capture fails (the reason is kept)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return g.replay, "graph"
    except Exception as e:  # noqa: BLE001
        torch.cuda.synchronize()
        return fn, f"eager ({type(e).__name__})"


def timed_round_robin(fns, iters):
    """Each of fns timed `iters` times with events, interleaved (one call of each in turn, so
    clock and power drift hit every variant alike), all ranks started by a barrier:
    {name: (p50, p99, max)} in µs."""
    times = {n: [] for n in fns}
    for f in fns.values():
        f()
    torch.cuda.synchronize()
    dist.barrier()
    for _ in range(iters):
        for n, f in fns.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            f()
            b.record()
            times[n].append((a, b))
    torch.cuda.synchronize()
    out = {}
    for n, evs in times.items():
        t = sorted(a.elapsed_time(b) * 1e3 for a, b in evs)
        out[n] = (t[len(t) // 2], t[min(len(t) - 1, int(len(t) * 0.99))], t[-1])
    return out


def rank_main(rank, world, port, args, q):
    try:
        torch.cuda.set_device(rank)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
        group = dist.group.WORLD
        comm = symmalloc.Communicator.from_process_group(group)
        torch_ops = None
        try:
            import torch.distributed._symmetric_memory as symm_mem

            symm_mem.enable_symm_mem_for_group(group.group_name)
            torch_ops = torch.ops.symm_mem
        except Exception as e:  # noqa: BLE001
            torch_ops = f"{type(e).__name__}: {e}"
        rows = []
        g = torch.Generator(device="cuda").manual_seed(1234 + rank)
        for M, K, N in args.shapes:
            W = world
            flops = 2.0 * M * K * N / W
            # all-gather + matmul
            a = torch.randn(M // W, K, device="cuda", generator=g, dtype=torch.bfloat16)
            b = torch.randn(K, N // W, device="cuda", generator=g, dtype=torch.bfloat16) / K ** 0.5
            full = torch.empty(M, K, device="cuda", dtype=torch.bfloat16)

            def nccl_ag():
                dist.all_gather_into_tensor(full, a)
                return full @ b

            variants = {
                "symmalloc": lambda: atp.all_gather_matmul(a, b, comm),
                "nccl": nccl_ag,
                "matmul": lambda: full @ b,
            }
            if not isinstance(torch_ops, str):
                variants["torch"] = lambda: torch_ops.fused_all_gather_matmul(a, [b], 0, group.group_name)[1][0]
            rows += measure("all_gather_matmul", (M, K, N), flops, variants, nccl_ag, torch_ops, args.iters)
            # matmul + reduce-scatter
            a2 = torch.randn(M, K // W, device="cuda", generator=g, dtype=torch.bfloat16)
            b2 = torch.randn(K // W, N, device="cuda", generator=g, dtype=torch.bfloat16) / K ** 0.5
            rs_out = torch.empty(M // W, N, device="cuda", dtype=torch.bfloat16)

            def nccl_rs():
                dist.reduce_scatter_tensor(rs_out, a2 @ b2)
                return rs_out

            variants = {
                "symmalloc": lambda: atp.matmul_reduce_scatter(a2, b2, comm),
                "nccl": nccl_rs,
                "matmul": lambda: a2 @ b2,
            }
            if not isinstance(torch_ops, str):
                variants["torch"] = lambda: torch_ops.fused_matmul_reduce_scatter(a2, b2, "sum", 0, group.group_name)
            rows += measure("matmul_reduce_scatter", (M, K, N), flops, variants, nccl_rs, torch_ops, args.iters)
            del a, b, full, a2, b2, rs_out
            torch.cuda.empty_cache()
        comm.barrier()
        torch.cuda.synchronize()
        comm.close()
        dist.destroy_process_group()
        q.put((rank, rows, None))
    except Exception:
        import traceback

        q.put((rank, None, traceback.format_exc()))


def measure(kind, shape, flops, variants, reference, torch_ops, iters):
    """Checks every variant against the NCCL one, captures each in a graph, and times them
    round-robin."""
    ref = reference().clone()
    rows, runnable = {}, {}
    for name in ("symmalloc", "torch", "nccl", "matmul"):
        if name not in variants:
            rows[name] = dict(kind=kind, shape=shape, variant=name, error=str(torch_ops)[:120])
            continue
        fn = variants[name]
        try:
            if name != "matmul":
                got = fn()
                torch.cuda.synchronize()
                err = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
                if err > 1e-2:
                    raise AssertionError(f"relative error {err:.3g} against NCCL then matmul")
            runnable[name], how = graphed(fn)
            rows[name] = dict(kind=kind, shape=shape, variant=name, how=how)
        except Exception as e:  # noqa: BLE001
            torch.cuda.synchronize()
            rows[name] = dict(kind=kind, shape=shape, variant=name, error=f"{type(e).__name__}: {e}"[:160])
    for name, (p50, p99, mx) in timed_round_robin(runnable, iters).items():
        rows[name].update(p50=p50, p99=p99, max=mx, tflops=flops / p50 / 1e6)
    return [rows[n] for n in ("symmalloc", "torch", "nccl", "matmul")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=torch.cuda.device_count())
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";")]
    if args.world > torch.cuda.device_count():
        sys.exit(f"--world {args.world}: one rank per GPU, and this machine has {torch.cuda.device_count()} "
                 "(several ranks on one GPU: python/tests/async_tp_check.py, correctness only)")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = 29000 + os.getpid() % 1000
    procs = [ctx.Process(target=rank_main, args=(r, args.world, port, args, q)) for r in range(args.world)]
    for p in procs:
        p.start()
    got = {}
    for _ in procs:
        rank, rows, failure = q.get(timeout=1800)
        if failure:
            sys.exit(f"rank {rank} failed:\n{failure}")
        got[rank] = rows
    for p in procs:
        p.join(60)
    print(f"{torch.cuda.get_device_name(0)}, world {args.world}, bf16, rank 0's times (µs per call), TFLOP/s per rank at p50")
    print("| op | M,K,N | variant | run as | p50 µs | p99 µs | max µs | TFLOP/s |")
    print("|---|---|---|---|---:|---:|---:|---:|")
    for r in got[0]:
        if "error" in r:
            print(f"| {r['kind']} | {','.join(map(str, r['shape']))} | {r['variant']} | n/a: {r['error']} | | | | |")
        else:
            print(f"| {r['kind']} | {','.join(map(str, r['shape']))} | {r['variant']} | {r['how']} | {r['p50']:.1f} | {r['p99']:.1f} | {r['max']:.1f} | {r['tflops']:.0f} |")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "async_tp.json"), "w") as f:
            json.dump(got, f)


if __name__ == "__main__":
    main()
