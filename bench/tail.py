"""Tail latency of graphed all-reduces, across fresh processes: symmalloc against PyTorch's
symmetric memory and NCCL, all measured in the same processes.

    python3 bench/tail.py [--runs 10] [--out DIR] [--c-bench PATH/allreduce_c]

Each run is a fresh job (one process per GPU, started anew). In a run, for every size (8 KiB to
64 MiB) and every method that takes it, a graph of 20 bf16-sum all-reduces of one buffer pair
is captured and kept (many graphs in one process, as an inference engine holds one per batch
size), checked against NCCL on fresh random data (the output poisoned first), then replayed
300 times back to back behind a gate (a fixed GPU spin that holds the stream until the host has
enqueued every replay), each replay timed with CUDA events: per row p50 / p99 / max of the
per-call time (replay time / 20). Methods: symmalloc AUTO, ONE_SHOT_LL (within its capacity),
ONE_SHOT (to 4 MiB) and TWO_SHOT, in place and out of place; torch two_shot_all_reduce_ (in
place) and one_shot_all_reduce (out of place); NCCL (in place).

After the runs it prints, per row, the median over runs of p50 / p99 / max and the worst run,
and counts stalled rows: a row whose p50 in a run is more than 1.5x that row's best p50 over
all runs. Targets, every symmalloc row of every run: p99 <= 1.1x p50, max <= p50 +
50 us, no stalled row.

With --ab-lib DIR, every run is a pair of fresh jobs, this build's and DIR's libraries (with
DIR/python's package when there is one: `scripts/stage-device.sh --old` puts it there), in
alternating order, and each build gets its table.

With --c-bench, the eager section compares one eager call from Python (this package's
Communicator.all_reduce, and the wrapper as it was before 010ab24 (2026-11-23/24), kept below as
`legacy_all_reduce`) with the same call from C (bench/allreduce_c.rs), AUTO in place, 8 KiB to
1 MiB. An eager call is bound by the host's CPU, which drifts on a shared machine, so Python and
C jobs alternate (--eager-pairs, default 3) and each pair's difference is reported. With
SYMM_BENCH_PIN=1 every rank of both runs on its own four cores (4r+4 .. 4r+7); SYMM_BENCH_WORLD=N
runs N ranks in both (N = 1 on one GPU: the host side alone). Two processes
differ by more than the target's margin on their own (an empty cuLaunchKernel cost 3.3 to 4.6 us
in 21 processes of one machine, bench/NOTES.md), so the target is judged within the Python job:
the package's call and the same C ABI call with its arguments computed once, in alternation.

Multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1).
"""
import argparse
import ctypes
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# The package: this checkout's, or SYMM_BENCH_PYTHON's (--ab-lib: the other build's own package,
# whose calls match its library).
sys.path.insert(0, os.environ.get("SYMM_BENCH_PYTHON") or os.path.join(HERE, "..", "python"))

SIZES = [8 << 10, 64 << 10, 256 << 10, 768 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
EAGER_SIZES = [8 << 10, 64 << 10, 256 << 10, 1 << 20]
CALLS, REPLAYS = 20, 300
# The gate before the timed replays (clock cycles: about 20 ms at 2 GHz, ten times what the
# host takes to enqueue 300 replays); SYMM_BENCH_GATE=0 turns it off to compare.
GATE_CYCLES = int(os.environ.get("SYMM_BENCH_GATE", 40_000_000))
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def label(size):
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


def ll_capacity(world):
    """SYMMALLOC_LL_BYTES' default (src/config.rs), unless set."""
    v = os.environ.get("SYMMALLOC_LL_BYTES")
    if v:
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        return int(v[:-1]) * units[v[-1].upper()] if v[-1].upper() in units else int(v)
    return 4 << 20 if world <= 2 else (1 << 20 if world <= 4 else 256 << 10)


def legacy_all_reduce(comm, tensor, op="sum", algo="auto", out=None):
    """The package's all_reduce as it was before 010ab24 (for the eager before/after)."""
    import symmalloc as s

    try:
        from symmalloc.comm import _dtype_code
    except ImportError:  # a package from before the reference refactor (--ab-lib)
        _dtype_code = s._dtype_code

    code = _dtype_code(tensor.dtype)
    op_code, algo_code = s._OPS.get(op), s._ALGOS.get(algo)
    if code is None or op_code is None or algo_code is None or not tensor.is_contiguous():
        raise ValueError("bad call")
    dst = tensor if out is None else out
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    dev = dst.get_device() if dst.is_cuda else None
    stream = raw(torch.cuda.current_device() if dev is None else dev)
    status = s._library().symm_all_reduce_algo(
        comm._comm, algo_code, tensor.data_ptr(), dst.data_ptr(), tensor.numel(), code, op_code, stream)
    if status:
        s._check(status)


# ---------------------------------------------------------------- one run (one process per GPU)

def _borrowed_class():
    import symmalloc

    class Borrowed(symmalloc.Communicator):
        """A view of another Communicator's handle (for an experiment); it never destroys it."""

        def __del__(self):
            pass

    return Borrowed


def worker(rank, world, port, out_path, mode):
    import torch
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    import symmalloc

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    if os.environ.get("SYMM_BENCH_PIN") == "1":  # as bench/allreduce_c.rs pins its ranks
        os.sched_setaffinity(0, range(4 * rank + 4, 4 * rank + 8))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    group = dist.group.WORLD.group_name
    uid = [symmalloc.get_unique_id() if rank == 0 else None]
    dist.broadcast_object_list(uid, src=0)
    comm = symmalloc.Communicator(rank, world, uid[0])
    pool = symmalloc.mem_pool(rank)
    gen = torch.Generator(device="cuda").manual_seed(int(time.time()) * 16 + rank)
    stream = torch.cuda.Stream()
    keep = []  # every graph stays alive, as in an engine that holds many
    rows = []

    def check_and_time(name, size, fn, result, fill):
        """Captures CALLS calls of fn, checks one replay, times REPLAYS replays."""
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            fn()  # warm-up outside capture (segment exchange, kernel lookup)
        torch.cuda.synchronize()
        with torch.cuda.graph(g, stream=stream):
            for _ in range(CALLS):
                fn()
        keep.append(g)
        # Correctness: fresh random input, output poisoned, one replay of the 20 calls. In place
        # the buffer is reduced 20 times: every rank then holds world^19 times the sum (a
        # power of two at 2, 4 and 8 ranks, so exact in bf16 but for the first sum's rounding).
        src, ref = fill()
        g.replay()
        torch.cuda.synchronize()
        got = result().float() / (world ** (CALLS - 1) if name.endswith("_in") else 1)
        err = ((got - ref).norm() / ref.norm()).item()
        assert err < 1e-2, f"{name} {label(size)}: rel err {err}"
        fill()  # finite data for the timed replays
        for _ in range(5):
            g.replay()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(REPLAYS)]
        dist.barrier()
        torch.cuda.synchronize()
        cur = torch.cuda.current_stream()
        # The gate: a fixed spin holds each GPU's stream while its host enqueues every replay,
        # so the timed replays run back to back on both GPUs and a late host (one rank's
        # process descheduled between two launches) cannot show up as a peer's wait. Both gates
        # start together (barrier) and last the same; one untimed replay absorbs what skew is
        # left. Without it, the time a rank's host takes to launch replay k is part of its
        # peer's replay k (NOTES: "Host gaps in the tail benchmark").
        if GATE_CYCLES:
            torch.cuda._sleep(GATE_CYCLES)
            g.replay()
        for a, b in ev:
            a.record(cur)
            g.replay()
            b.record(cur)
        torch.cuda.synchronize()
        t = sorted(a.elapsed_time(b) * 1000.0 / CALLS for a, b in ev)
        row = {"name": name, "bytes": size, "p50": t[len(t) // 2], "p99": t[int(len(t) * 0.99)], "max": t[-1]}
        rows.append(row)
        return row

    for size in SIZES if mode == "graphs" else []:
        n = size // 2
        with torch.cuda.use_mem_pool(pool):
            buf = torch.empty(n, dtype=torch.bfloat16, device="cuda")
            out = torch.empty(n, dtype=torch.bfloat16, device="cuda")
        tsym = symm_mem.empty(n, dtype=torch.bfloat16, device=torch.device("cuda", rank))
        symm_mem.rendezvous(tsym, group)
        nccl_buf = torch.empty(n, dtype=torch.bfloat16, device="cuda")
        holder = {}

        def fill_into(t, poison=None):
            def f():
                src = torch.randn(n, generator=gen, device="cuda", dtype=torch.float32).to(torch.bfloat16)
                t.copy_(src)
                if poison is not None:
                    poison.fill_(float("nan"))
                ref = src.float()
                dist.all_reduce(ref)
                return src, ref
            return f

        methods = []
        for algo in ["auto", "one_shot_ll", "one_shot", "two_shot"]:
            if algo == "one_shot_ll" and size > ll_capacity(world):
                continue
            if algo == "one_shot" and size > (4 << 20):
                continue
            methods.append((f"symm_{algo}_in", lambda a=algo: comm.all_reduce(buf, algo=a), lambda: buf,
                            fill_into(buf)))
            methods.append((f"symm_{algo}_out", lambda a=algo: comm.all_reduce(buf, algo=a, out=out), lambda: out,
                            fill_into(buf, out)))
        methods.append(("torch_two_shot_in", lambda: torch.ops.symm_mem.two_shot_all_reduce_(tsym, "sum", group),
                        lambda: tsym, fill_into(tsym)))

        def torch_one():
            holder["one"] = torch.ops.symm_mem.one_shot_all_reduce(tsym, "sum", group)

        def fill_one():
            r = fill_into(tsym)()
            if "one" in holder:
                holder["one"].fill_(float("nan"))
            return r
        methods.append(("torch_one_shot_out", torch_one, lambda: holder["one"], fill_one))
        methods.append(("nccl_in", lambda: dist.all_reduce(nccl_buf), lambda: nccl_buf, fill_into(nccl_buf)))
        for name, fn, result, fill in methods:
            row = check_and_time(name, size, fn, result, fill)
            if rank == 0:
                print(f"  {label(size):>7} {name:<22} p50 {row['p50']:8.2f}  p99 {row['p99']:8.2f}  max {row['max']:8.2f}",
                      flush=True)

    def calls_time(fn):
        """µs per call of CALLS back-to-back calls, both ranks starting together."""
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        torch.cuda.synchronize()
        a.record()
        for _ in range(CALLS):
            fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) * 1000.0 / CALLS

    def eager_time(fn):
        """Median over 50 repetitions of the mean of CALLS back-to-back calls, after warm-up."""
        for _ in range(30):
            fn()
        times = sorted(calls_time(fn) for _ in range(50))
        return times[len(times) // 2]

    def eager_paired(fa, fb):
        """fa and fb in alternation, 50 repetitions of CALLS calls each: the median of each, and
        the median over repetitions of fa - fb (each pair a few ms apart, so drift of the host's
        speed within the process cancels)."""
        for _ in range(30):
            fa()
            fb()
        ta, tb = [], []
        for _ in range(50):
            ta.append(calls_time(fa))
            tb.append(calls_time(fb))
        med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
        return med(ta), med(tb), med([x - y for x, y in zip(ta, tb)])

    eager_rows = []
    if mode == "eager":
        for size in EAGER_SIZES:
            with torch.cuda.use_mem_pool(pool):
                x = torch.randn(size // 2, generator=gen, device="cuda").to(torch.bfloat16)
            row = {"bytes": size}
            side = torch.cuda.Stream()  # non-blocking, as allreduce_c's stream; the default is legacy
            # The same wrapper with the entry point bound through ctypes.PyDLL (the GIL is kept
            # across the call instead of released and taken again).
            held = _borrowed_class().__new__(_borrowed_class())  # shares comm's handle; never closes it
            held.__dict__.update(comm.__dict__)
            held.__dict__.pop("all_reduce", None)  # the Python method, not the compiled caller
            held._all_reduce = ctypes.PyDLL(symmalloc.library_path())["symm_all_reduce_algo"]
            held._all_reduce.restype = ctypes.c_int
            held._fast = None
            # The package's wrapper with its compiled caller turned off: calls through ctypes,
            # as every call did before 6268cc7 (2026-11-24).
            plain = _borrowed_class().__new__(_borrowed_class())
            plain.__dict__.update(comm.__dict__)
            plain.__dict__.pop("all_reduce", None)
            plain._fast = None
            # The Python method with the int-level compiled entry: every call before 7511c6d.
            method = _borrowed_class().__new__(_borrowed_class())
            method.__dict__.update(comm.__dict__)
            method.__dict__.pop("all_reduce", None)
            row["fastcall"] = comm._fast is not None
            row["compiled_caller"] = "all_reduce" in comm.__dict__
            # The C ABI's call itself, in this process: symm_all_reduce_algo through the
            # compiled caller with every argument computed once (no Python work per call but
            # the loop's). It takes the C job's place in a comparison that no difference
            # between two processes' CPUs can blur.
            with torch.cuda.stream(side):
                c_args = (comm._comm.value, 0, x.data_ptr(), x.data_ptr(), x.numel(), 0, 0,
                          torch._C._cuda_getCurrentRawStream(rank))
            c_call = (lambda: comm._fast(*c_args)) if comm._fast is not None else None
            if c_call is not None:
                # The target's comparison: the package's call and the C ABI's, in alternation.
                with torch.cuda.stream(side):
                    row["python_paired"], row["c_paired"], row["paired_diff"] = eager_paired(
                        lambda: comm.all_reduce(x), c_call)
            for name, fn, s in [("python", lambda: comm.all_reduce(x), side),
                                ("c_in_process", c_call, side),
                                ("python_method", lambda: method.all_reduce(x), side),
                                ("python_ctypes", lambda: plain.all_reduce(x), side),
                                ("legacy", lambda: legacy_all_reduce(comm, x), side),
                                ("python_default_stream", lambda: comm.all_reduce(x), torch.cuda.default_stream()),
                                ("python_gil_held", lambda: held.all_reduce(x), side)]:
                if fn is None:
                    continue
                with torch.cuda.stream(s):
                    row[name] = eager_time(fn)
            eager_rows.append(row)
    torch.cuda.synchronize()
    dist.barrier()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"rows": rows, "eager": eager_rows, "device": torch.cuda.get_device_name(0), "world": world,
                       "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version()))}, f)
    keep.clear()
    comm.close()
    dist.destroy_process_group()


def one_run(out_path, port, mode):
    import torch
    import torch.multiprocessing as mp

    gpus = torch.cuda.device_count()
    # SYMM_BENCH_WORLD=N runs N ranks, as in bench/allreduce_c.rs (1: the host side and the
    # kernels' local work alone, on one GPU; the C job reads the same variable).
    world = int(os.environ.get("SYMM_BENCH_WORLD", "0")) or min(gpus, 8)
    if not 1 <= world <= gpus or (world < 2 and "SYMM_BENCH_WORLD" not in os.environ):
        sys.exit(f"needs >= 2 GPUs (or SYMM_BENCH_WORLD=N, N <= {gpus}), found {gpus}")
    mp.spawn(worker, args=(world, port, out_path, mode), nprocs=world)


# ---------------------------------------------------------------- the driver and the tables

def c_eager(path):
    """AUTO eager µs per call from bench/allreduce_c.rs, 8 KiB to 1 MiB, by size."""
    env = dict(os.environ, SYMM_BENCH_MAX_BYTES="1M", SYMM_BENCH_ALGOS="auto", **NO_MULTICAST)
    env.pop("SYMMALLOC_ENABLE_MULTICAST", None)
    text = subprocess.run([path], env=env, capture_output=True, text=True, timeout=300).stdout
    got = {}
    for line in text.splitlines():
        m = re.match(r"\s*(\d+) (KiB|MiB) \|\s*([\d.]+) /", line)
        if m:
            got[int(m.group(1)) << (10 if m.group(2) == "KiB" else 20)] = float(m.group(3))
    return got


def eager_pairs(out, c_bench, pairs, port):
    """Python eager jobs and C eager jobs, alternating."""
    result = []
    for i in range(pairs):
        p = os.path.join(out, f"tail_eager{i}.json")
        subprocess.run([sys.executable, os.path.abspath(__file__), "--one-run", p, "--mode", "eager",
                        "--port", str(port + 100 + i)], env=os.environ, timeout=300, check=True)
        py = {row["bytes"]: row for row in json.load(open(p))["eager"]}
        c = c_eager(c_bench)
        result.append({"python": py, "c": c})
        print(f"eager pair {i}: " + "  ".join(
            f"{label(b)} py {py[b]['python']:.2f} legacy {py[b]['legacy']:.2f} C {c.get(b, float('nan')):.2f}"
            for b in EAGER_SIZES if b in py), flush=True)
    return result


def report(runs, pairs):
    if runs:
        graph_table(runs)
    if pairs:
        print(f"\neager AUTO in place, us per call (median of 50 x mean of 20); {len(pairs)} pairs of a Python job "
              "and a C job (bench/allreduce_c.rs), alternating")
        print("(python: comm.all_reduce(x), the compiled caller of symmalloc._fastcall.eager when built "
              f"(compiled: {[p['python'][EAGER_SIZES[0]].get('compiled_caller') for p in pairs]}); python method: "
              "the Python method with the int-level compiled entry (6268cc7); python ctypes: the method through "
              "ctypes (before 6268cc7); legacy: the wrapper before 010ab24; all on a non-blocking "
              "side stream, as C; python default: torch's legacy default stream)")
        print(f"{'size':>7} | {'python':>17} | {'python method':>17} | {'python ctypes':>17} | {'legacy python':>17} | "
              f"{'python default':>17} | {'C ABI':>17} | python - C per pair")
        in_process = []
        for b in EAGER_SIZES:
            py = [p["python"][b]["python"] for p in pairs]
            pm = [p["python"][b].get("python_method", float("nan")) for p in pairs]
            pc = [p["python"][b].get("python_ctypes", float("nan")) for p in pairs]
            lg = [p["python"][b]["legacy"] for p in pairs]
            dflt = [p["python"][b].get("python_default_stream", float("nan")) for p in pairs]
            c = [p["c"].get(b, float("nan")) for p in pairs]
            rng = lambda v: f"{min(v):6.2f} - {max(v):6.2f}"  # noqa: E731
            held = [p["python"][b].get("python_gil_held", float("nan")) for p in pairs]
            cin = [p["python"][b].get("c_in_process", float("nan")) for p in pairs]
            print(f"{label(b):>7} | {rng(py):>17} | {rng(pm):>17} | {rng(pc):>17} | {rng(lg):>17} | {rng(dflt):>17} | {rng(c):>17} | "
                  + " ".join(f"{x - y:+.2f}" for x, y in zip(py, c)) + f"   (GIL kept: {rng(held)})")
            in_process.append((b, cin, [x - y for x, y in zip(py, cin)]))
        print("\nthe same C ABI call from the Python job itself (c_in_process: symm_all_reduce_algo through the "
              "compiled caller, arguments computed once), and python - c_in_process per pair, measured one after "
              "the other:")
        for b, cin, diff in in_process:
            print(f"{label(b):>7} | c_in_process {rng(cin)} | " + " ".join(f"{d:+.2f}" for d in diff))
        paired = [(b, [p["python"][b].get("paired_diff") for p in pairs]) for b in EAGER_SIZES]
        if all(d is not None for _, v in paired for d in v):
            print("\nthe target's comparison: the package's call and the C ABI's call in the same process, in "
                  "alternation (50 x 20 calls each), median of the paired differences (python - C), per pair:")
            for b in EAGER_SIZES:
                py = [p["python"][b]["python_paired"] for p in pairs]
                c = [p["python"][b]["c_paired"] for p in pairs]
                d = [p["python"][b]["paired_diff"] for p in pairs]
                print(f"{label(b):>7} | python {rng(py)} | C ABI {rng(c)} | " + " ".join(f"{x:+.2f}" for x in d))
            worst = max(d for _, v in paired for d in v)
        else:
            worst = max(d for _, _, diff in in_process for d in diff)
        print(f"eager target python <= C + 1.5 us (same process, every size, every pair): worst {worst:+.2f} -> "
              + ("met" if worst <= 1.5 else "MISSED"))


def graph_table(runs):
    rows = {}
    for i, r in enumerate(runs):
        for row in r["rows"]:
            rows.setdefault((row["bytes"], row["name"]), []).append((i, row))
    d = runs[0]
    print(f"\nbf16 sum, {d['world']}x {d['device']}, torch {d['torch']}, NCCL {d['nccl']}; graphs of {CALLS} calls, "
          f"{REPLAYS} replays each, {len(runs)} fresh runs; us per call")
    print(f"{'size':>7} {'method':<22} | {'p50':>7} {'p99':>7} {'max':>7} (median over runs) | "
          f"{'worst p50':>9} {'worst p99':>9} {'worst max':>9} | stalled runs | p99<=1.1p50 max<=p50+50")
    stalled_runs = [0] * len(runs)
    symm_bad = []
    for (size, name), per in rows.items():
        med = lambda k: sorted(r[k] for _, r in per)[len(per) // 2]  # noqa: E731
        best = min(r["p50"] for _, r in per)
        stalled = [i for i, r in per if r["p50"] > 1.5 * best]
        for i in stalled:
            stalled_runs[i] += 1
        tail_ok = all(r["p99"] <= 1.1 * r["p50"] for _, r in per)
        max_ok = all(r["max"] <= r["p50"] + 50 for _, r in per)
        if name.startswith("symm") and not (tail_ok and max_ok and not stalled):
            symm_bad.append((label(size), name))
        worst = lambda k: max(r[k] for _, r in per)  # noqa: E731
        print(f"{label(size):>7} {name:<22} | {med('p50'):7.2f} {med('p99'):7.2f} {med('max'):7.2f}                   | "
              f"{worst('p50'):9.2f} {worst('p99'):9.2f} {worst('max'):9.2f} | {len(stalled):>3} / {len(per):<3}     | "
              f"{'yes' if tail_ok else 'NO':>11} {'yes' if max_ok else 'NO':>11}")
    print(f"\nstalled rows per run (p50 > 1.5x the row's best run): {stalled_runs}")
    print(f"symmalloc rows missing a target in some run: {len(symm_bad)}" + (f" {symm_bad}" if symm_bad else ""))
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    ap.add_argument("--c-bench", help="path of the allreduce_c binary: adds the eager Python vs C table")
    ap.add_argument("--eager-pairs", type=int, default=3)
    ap.add_argument("--one-run", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="graphs", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=29541)
    ap.add_argument("--table-only", action="store_true")
    ap.add_argument("--ab-lib", help="a folder with another build's libraries: each run is then a pair of fresh "
                    "jobs, this build's and that one's, in alternating order, and each build gets its own table")
    a = ap.parse_args()
    for k, v in NO_MULTICAST.items():
        os.environ[k] = v  # multicast stays off, in this process and every child
    os.environ.pop("SYMMALLOC_ENABLE_MULTICAST", None)
    if a.one_run:
        return one_run(a.one_run, a.port, a.mode)
    os.makedirs(a.out, exist_ok=True)
    paths = [os.path.join(a.out, f"tail_run{i}.json") for i in range(a.runs)]
    # --ab-lib: the other build's runs, alternating with this build's (the 2-GPU run's A/B).
    other = [os.path.join(a.out, f"tail_ab_run{i}.json") for i in range(a.runs)] if a.ab_lib else []
    pairs_path = os.path.join(a.out, "tail_eager_pairs.json")
    pairs = []
    if not a.table_only:
        if a.c_bench and a.eager_pairs:
            pairs = eager_pairs(a.out, a.c_bench, a.eager_pairs, a.port)
            with open(pairs_path, "w") as f:
                json.dump(pairs, f)
        for i, p in enumerate(paths):
            jobs = [(p, os.environ, "this build")]
            if a.ab_lib:
                env = dict(os.environ, SYMMALLOC_LIBRARY_DIR=os.path.abspath(a.ab_lib))
                if os.path.isdir(os.path.join(a.ab_lib, "python", "symmalloc")):  # its own package
                    env["SYMM_BENCH_PYTHON"] = os.path.abspath(os.path.join(a.ab_lib, "python"))
                jobs.append((other[i], env, a.ab_lib))
                jobs = jobs if i % 2 == 0 else jobs[::-1]
            for k, (path, env, what) in enumerate(jobs):
                t0 = time.time()
                cmd = [sys.executable, os.path.abspath(__file__), "--one-run", path, "--port", str(a.port + 2 * i + k)]
                r = subprocess.run(cmd, env=env, timeout=600)
                print(f"run {i} ({what}): rc {r.returncode}, {time.time() - t0:.0f} s", flush=True)
    elif os.path.exists(pairs_path):
        pairs = json.load(open(pairs_path))
        for p in pairs:  # JSON keys are strings
            p["python"] = {int(k): v for k, v in p["python"].items()}
            p["c"] = {int(k): v for k, v in p["c"].items()}
    runs = [json.load(open(p)) for p in paths if os.path.exists(p)]
    if not runs and not pairs:
        sys.exit("no run finished")
    report(runs, pairs)
    ab = [json.load(open(p)) for p in other if os.path.exists(p)]
    if a.ab_lib:
        print(f"\n--- the other build ({a.ab_lib}), its runs alternating with the ones above ---")
        if not ab:
            sys.exit("no run of the other build finished")
        report(ab, [])


if __name__ == "__main__":
    main()
