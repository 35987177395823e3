"""``python -m symmalloc.bench``: an nccl-tests-style benchmark of symmalloc's collectives.

One process per GPU: started here (``--nproc``, default every visible GPU) or by torchrun.
For each size it checks symmalloc's result against a float64 reference on fresh random data
(the output poisoned first), then times it with CUDA events: ``--reps`` repetitions of
``--iters`` back-to-back calls (eagerly, each repetition after a barrier; or one CUDA graph of
them with ``--graph 1``, every replay enqueued behind a GPU gate so that they run back to back),
after ``--warmup`` untimed repetitions. p50 and p99 are over the repetitions' per-call means.
``--compare nccl,torch`` times NCCL and PyTorch's symmetric memory on the same buffers' sizes
in the same processes. Multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1).

    python -m symmalloc.bench -b 8K -e 256M -f 4 --graph 1 --compare nccl,torch --plot ar.png
    python -m symmalloc.bench -c reduce_scatter -d fp16 -b 1M -e 64M

Bus bandwidth follows nccl-tests: all-reduce algbw * 2(n-1)/n, reduce-scatter and all-gather
algbw * (n-1)/n, where the size is the all-reduce's buffer, the reduce-scatter's input and the
all-gather's output.
"""
import argparse
import json
import os
import sys
from typing import Callable, Dict, List, Optional

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")
_GATE_CYCLES = 40_000_000  # about 20 ms at 2 GHz: longer than enqueuing the timed replays takes


def parse_size(text: str) -> int:
    t = text.strip().upper().rstrip("B").rstrip("I")
    unit = t[-1] if t and t[-1] in "KMG" else ""
    try:
        value = float(t[: len(t) - len(unit)]) * _UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"size {text!r}: expected a number with an optional K, M or G suffix") from None
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"size {text!r}: expected a whole number of bytes >= 1")
    return int(value)


def size_label(n: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def sizes(begin: int, end: int, factor: float) -> List[int]:
    out, s = [], begin
    while s <= end:
        out.append(s)
        s = int(s * factor)
    return out


def bus_factor(coll: str, world: int) -> float:
    return 2 * (world - 1) / world if coll == "all_reduce" else (world - 1) / world


def arguments(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m symmalloc.bench", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-c", "--collective", choices=COLLECTIVES, default="all_reduce")
    ap.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("8K"), help="first size (default 8K)")
    ap.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("64M"), help="last size (default 64M)")
    ap.add_argument("-f", "--stepfactor", type=float, default=2.0, help="size multiplier (default 2)")
    ap.add_argument("-d", "--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    ap.add_argument("-o", "--op", choices=("sum", "max", "min"), default="sum")
    ap.add_argument("-a", "--algo", choices=("auto", "one_shot", "two_shot", "one_shot_ll"), default="auto",
                    help="all-reduce algorithm (default auto)")
    ap.add_argument("-n", "--iters", type=int, default=20, help="calls per repetition (default 20)")
    ap.add_argument("-r", "--reps", type=int, default=50, help="timed repetitions (default 50)")
    ap.add_argument("-w", "--warmup", type=int, default=5, help="untimed repetitions first (default 5)")
    ap.add_argument("-G", "--graph", type=int, choices=(0, 1), default=1, help="1: replay a CUDA graph of the calls (default), 0: eager")
    ap.add_argument("-i", "--in-place", type=int, choices=(0, 1), default=0,
                    help="1: in place (the NCCL rule for reduce-scatter / all-gather), 0: out of place (default)")
    ap.add_argument("--compare", default="", help="peers timed in the same run: nccl, torch (comma-separated)")
    ap.add_argument("--plot", metavar="FILE.png", help="latency and bus bandwidth against size")
    ap.add_argument("--json", metavar="FILE", help="every row as JSON")
    ap.add_argument("--nproc", type=int, default=0, help="processes (GPUs) to start when not under torchrun (default: all)")
    a = ap.parse_args(argv)
    if a.maxbytes < a.minbytes or a.stepfactor <= 1:
        ap.error(f"sizes: expected minbytes <= maxbytes and stepfactor > 1, got -b {a.minbytes} -e {a.maxbytes} -f {a.stepfactor}")
    if a.iters < 1 or a.reps < 1 or a.warmup < 0:
        ap.error(f"expected iters >= 1, reps >= 1, warmup >= 0; got {a.iters}, {a.reps}, {a.warmup}")
    peers = [p for p in a.compare.split(",") if p]
    bad = [p for p in peers if p not in ("nccl", "torch")]
    if bad:
        ap.error(f"--compare {a.compare!r}: unknown peer(s) {bad}; expected nccl and/or torch")
    a.peers = peers
    if a.collective != "all_reduce" and a.algo != "auto":
        ap.error(f"--algo {a.algo} applies to all_reduce only")
    return a


def percentile(sorted_values: List[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def _timed(torch, dist, fn: Callable[[], None], a) -> Dict[str, float]:
    """p50/p99/max of the per-call mean over ``a.reps`` repetitions of ``a.iters`` calls."""
    stream = torch.cuda.current_stream()
    if a.graph:
        side = torch.cuda.Stream()
        side.wait_stream(stream)
        with torch.cuda.stream(side):
            fn()  # first call outside capture: lazy set-up happens here
        stream.wait_stream(side)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(a.iters):
                fn()
        run = g.replay
    else:
        def run():
            for _ in range(a.iters):
                fn()
    for _ in range(a.warmup):
        run()
    torch.cuda.synchronize()
    times = []
    if a.graph:
        # Every replay enqueued behind a gate (a fixed GPU spin, the same on every rank), so the
        # replays run back to back and one rank's host launching late never shows as its
        # peer's wait; one untimed replay absorbs the ranks' skew at the gate's end.
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(a.reps)]
        dist.barrier()
        torch.cuda.synchronize()
        torch.cuda._sleep(_GATE_CYCLES)
        run()
        for start, stop in events:
            start.record()
            run()
            stop.record()
        torch.cuda.synchronize()
        times = sorted(start.elapsed_time(stop) * 1000.0 / a.iters for start, stop in events)
        return {"p50": percentile(times, 0.5), "p99": percentile(times, 0.99), "max": times[-1]}
    for _ in range(a.reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        torch.cuda.synchronize()
        start.record()
        run()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1000.0 / a.iters)
    times.sort()
    return {"p50": percentile(times, 0.5), "p99": percentile(times, 0.99), "max": times[-1]}


def run(a) -> None:
    import torch
    import torch.distributed as dist

    import symmalloc

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = symmalloc.Communicator.from_process_group()
    pool = symmalloc.mem_pool()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    tol = {"bf16": 1e-2, "fp16": 2e-3, "fp32": 1e-5}[a.dtype]
    elt = torch.finfo(dtype).bits // 8
    nccl_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[a.op]
    group = dist.group.WORLD
    symm_mem = None
    if "torch" in a.peers:
        import torch.distributed._symmetric_memory as symm_mem
    rows = []
    if rank == 0:
        head = (f"# symmalloc.bench {a.collective} {a.dtype} {a.op} algo={a.algo} {'graph' if a.graph else 'eager'} "
                f"{'in-place' if a.in_place else 'out-of-place'}, {world}x {torch.cuda.get_device_name()}, "
                f"iters {a.iters} reps {a.reps} warmup {a.warmup}; times in us per call (p50/p99 over reps), bandwidth in GB/s")
        print(head)
        cols = f"{'size':>7} {'count':>11} | {'p50':>8} {'p99':>8} {'algbw':>7} {'busbw':>7} {'check':>10}"
        for p in a.peers:
            cols += f" | {p + ' p50':>10} {'p99':>8} {'busbw':>7}"
        print(cols, flush=True)
    for size in sizes(a.minbytes, a.maxbytes, a.stepfactor):
        count = size // elt
        count -= count % world if a.collective != "all_reduce" else 0
        if count == 0:
            continue
        part = count // world
        in_n, out_n = {"all_reduce": (count, count), "reduce_scatter": (count, part), "all_gather": (part, count)}[a.collective]
        with torch.cuda.use_mem_pool(pool):
            inp = torch.empty(in_n, dtype=dtype, device="cuda")
            out = inp if (a.in_place and a.collective == "all_reduce") else torch.empty(out_n, dtype=dtype, device="cuda")
        if a.in_place and a.collective == "reduce_scatter":
            out = inp[rank * part:(rank + 1) * part]
        if a.in_place and a.collective == "all_gather":
            inp = out[rank * part:(rank + 1) * part]

        def call():
            if a.collective == "all_reduce":
                comm.all_reduce(inp, op=a.op, algo=a.algo, out=None if out is inp else out)
            elif a.collective == "reduce_scatter":
                comm.reduce_scatter(out, inp, op=a.op)
            else:
                comm.all_gather(out, inp)

        # Correctness first: fresh random input, the output poisoned, a float64 reference.
        gen = torch.Generator(device="cuda").manual_seed(size * 131 + rank)
        src = torch.randn(in_n, generator=gen, device="cuda", dtype=torch.float32).to(dtype)
        every = torch.empty(world * in_n, dtype=torch.float64, device="cuda")
        dist.all_gather_into_tensor(every, src.double())
        every = every.view(world, in_n)
        if a.collective == "all_gather":
            want = every.reshape(-1)
        else:
            full = {"sum": every.sum(0), "max": every.max(0).values, "min": every.min(0).values}[a.op]
            want = full if a.collective == "all_reduce" else full[rank * part:(rank + 1) * part]
        if out is not inp:
            out.fill_(float("nan"))
        inp.copy_(src)
        call()
        torch.cuda.synchronize()
        err = ((out.double() - want).norm() / want.norm().clamp_min(1e-30)).item()
        ok = err <= tol if (a.op == "sum" and a.collective != "all_gather") else bool(torch.equal(out.double(), want))
        row = {"bytes": size, "count": count, "err": err, "ok": ok, "symmalloc": _timed(torch, dist, call, a)}
        if "nccl" in a.peers:
            n_in, n_out = src.clone(), torch.empty(out_n, dtype=dtype, device="cuda")
            peer = {"all_reduce": lambda: dist.all_reduce(n_in, op=nccl_op),
                    "reduce_scatter": lambda: dist.reduce_scatter_tensor(n_out, n_in, op=nccl_op),
                    "all_gather": lambda: dist.all_gather_into_tensor(n_out, n_in)}[a.collective]
            row["nccl"] = _timed(torch, dist, peer, a)
            del n_in, n_out
        if "torch" in a.peers:
            # torch's symmetric memory: sum only, and no all-gather without multicast.
            row["torch"] = None
            if a.collective != "all_gather" and a.op == "sum":
                t_in = symm_mem.empty(in_n, dtype=dtype, device=torch.device("cuda", local))
                symm_mem.rendezvous(t_in, group.group_name)
                t_in.copy_(src)
                t_out = torch.empty(out_n, dtype=dtype, device="cuda")
                if a.collective == "all_reduce":
                    # torch's fastest non-multicast all-reduce for the size: one-shot up to 256 KiB.
                    peer = (lambda: torch.ops.symm_mem.one_shot_all_reduce_out(t_in, a.op, group.group_name, t_out)) \
                        if size <= (256 << 10) else (lambda: torch.ops.symm_mem.two_shot_all_reduce_out(t_in, a.op, group.group_name, t_out))
                else:
                    peer = lambda: torch.ops.symm_mem.reduce_scatter_out(t_in, group.group_name, False, t_out)  # noqa: E731
                row["torch"] = _timed(torch, dist, peer, a)
                del t_in, t_out
        rows.append(row)
        if rank == 0:
            s = row["symmalloc"]
            bw = size / (s["p50"] * 1e-6) / 1e9
            line = (f"{size_label(size):>7} {count:>11} | {s['p50']:8.2f} {s['p99']:8.2f} {bw:7.1f} "
                    f"{bw * bus_factor(a.collective, world):7.1f} {('ok' if ok else 'WRONG'):>4} {err:5.0e}")
            for p in a.peers:
                t = row.get(p)
                if t:
                    pbw = size / (t["p50"] * 1e-6) / 1e9 * bus_factor(a.collective, world)
                    line += f" | {t['p50']:10.2f} {t['p99']:8.2f} {pbw:7.1f}"
                else:
                    line += f" | {'-':>10} {'-':>8} {'-':>7}"
            print(line, flush=True)
        del inp, out
    wrong = sum(not r["ok"] for r in rows)
    if rank == 0:
        print(f"# {len(rows)} sizes, {wrong} wrong")
        meta = {"collective": a.collective, "dtype": a.dtype, "op": a.op, "algo": a.algo, "graph": a.graph,
                "in_place": a.in_place, "world": world, "device": torch.cuda.get_device_name(),
                "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
        if a.plot:
            plot(rows, meta, a.peers, a.plot)
    comm.close()
    dist.destroy_process_group()
    if wrong:
        sys.exit(1)


def plot(rows, meta, peers, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"# --plot {path}: matplotlib is not installed; no plot written", flush=True)
        return
    fig, (lat, bus) = plt.subplots(1, 2, figsize=(12, 4.5))
    xs = [r["bytes"] for r in rows]
    for name in ["symmalloc"] + peers:
        pts = [(x, r[name]) for x, r in zip(xs, rows) if r.get(name)]
        if not pts:
            continue
        px = [x for x, _ in pts]
        (line,) = lat.plot(px, [t["p50"] for _, t in pts], marker="o", label=f"{name} p50")
        lat.plot(px, [t["p99"] for _, t in pts], ls=":", color=line.get_color(), alpha=0.7, label=f"{name} p99")
        bus.plot(px, [x / (t["p50"] * 1e-6) / 1e9 * bus_factor(meta["collective"], meta["world"]) for x, t in pts],
                 marker="o", color=line.get_color(), label=name)
    for ax, ylab in ((lat, "time per call (us)"), (bus, "bus bandwidth (GB/s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel(ylab)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    lat.set_yscale("log")
    fig.suptitle(f"{meta['collective']} {meta['dtype']} {meta['op']}, {meta['world']}x {meta['device']}, "
                 f"{'graph' if meta['graph'] else 'eager'}")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    print(f"# plot written to {path}", flush=True)


def _spawned(rank: int, world: int, port: int, a) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    run(a)


def main(argv: Optional[List[str]] = None) -> None:
    a = arguments(argv)
    for k, v in _MULTICAST_OFF.items():
        os.environ[k] = v  # never a multicast object, whatever the caller's environment says
    os.environ.pop("SYMMALLOC_ENABLE_MULTICAST", None)
    if "LOCAL_RANK" in os.environ:  # torchrun started us
        run(a)
        return
    import socket

    import torch
    import torch.multiprocessing as mp

    world = a.nproc or torch.cuda.device_count()
    if world < 2:
        sys.exit(f"symmalloc.bench: needs >= 2 GPUs (found {torch.cuda.device_count()}; --nproc {a.nproc})")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_spawned, args=(world, port, a), nprocs=world)


if __name__ == "__main__":
    main()
