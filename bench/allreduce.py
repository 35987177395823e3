"""All-reduce benchmark: symmalloc (AUTO, one-shot LL, one-shot, two-shot) against PyTorch symmetric memory
(one_shot_all_reduce, two_shot_all_reduce_) and NCCL (torch.distributed.all_reduce), bf16 sum,
8 KiB to 256 MiB, eager and CUDA graph, all in the same run.

Run on a machine with >= 2 GPUs:  python3 bench/allreduce.py [--out DIR]
(it starts one process per GPU itself). Each number is the median over R repetitions (50; 30
above 4 MiB) of the mean time of K (20; 10) back-to-back calls, timed with CUDA events after warm-up; graph numbers replay
a graph of K captured calls. Results are checked against NCCL before timing.
Multicast stays off (TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NCCL_NVLS_ENABLE=0).
"""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import symmalloc  # noqa: E402

from tail import ll_capacity as ll_max  # noqa: E402  (the LL capacity, as src/config.rs sets it)

SIZES = [8 << 10, 32 << 10, 64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]


def timed(fn, k, reps, graph):
    stream = torch.cuda.current_stream()
    if graph:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(stream)
        with torch.cuda.stream(s):
            fn()  # warm-up outside capture
        stream.wait_stream(s)
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            for _ in range(k):
                fn()
        run = g.replay
    else:
        def run():
            for _ in range(k):
                fn()
    for _ in range(10):  # warm: clocks up, caches and peer mappings touched
        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        torch.cuda.synchronize()
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0 / k)
    times.sort()
    return times[len(times) // 2]


def worker(rank, world, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    group = dist.group.WORLD
    import torch.distributed._symmetric_memory as symm_mem

    uid = [symmalloc.get_unique_id() if rank == 0 else None]
    dist.broadcast_object_list(uid, src=0)
    comm = symmalloc.Communicator(rank, world, uid[0])
    pool = symmalloc.mem_pool(rank)
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(1234 + rank)
    for size in SIZES:
        n = size // 2
        with torch.cuda.use_mem_pool(pool):
            buf = torch.empty(n, dtype=torch.bfloat16, device="cuda")
            out = torch.empty(n, dtype=torch.bfloat16, device="cuda")
        # Correctness against NCCL on fresh random data.
        src = torch.randn(n, generator=gen, device="cuda", dtype=torch.float32).to(torch.bfloat16)
        ref = src.float().clone()
        dist.all_reduce(ref)
        for algo in ["auto", "one_shot_ll", "one_shot", "two_shot"]:
            if algo == "one_shot_ll" and size > ll_max(world):
                continue
            buf.copy_(src)
            comm.all_reduce(buf, algo=algo)
            torch.cuda.synchronize()
            err = ((buf.float() - ref).norm() / ref.norm()).item()
            assert err < 1e-2, f"symmalloc {algo} size {size}: rel err {err}"
            buf.copy_(src)
            out.fill_(float("nan"))
            comm.all_reduce(buf, algo=algo, out=out)
            torch.cuda.synchronize()
            err = ((out.float() - ref).norm() / ref.norm()).item()
            assert err < 1e-2, f"symmalloc {algo} out-of-place size {size}: rel err {err}"
        tsym = symm_mem.empty(n, dtype=torch.bfloat16, device=torch.device("cuda", rank))
        symm_mem.rendezvous(tsym, group.group_name)
        tsym.copy_(src)
        nccl_buf = src.clone()
        k = 20 if size <= (4 << 20) else 10
        reps = 50 if size <= (4 << 20) else 30
        row = {"bytes": size}
        methods = {
            "symm_auto": lambda: comm.all_reduce(buf, algo="auto"),
            "symm_ll": lambda: comm.all_reduce(buf, algo="one_shot_ll"),
            "symm_one": lambda: comm.all_reduce(buf, algo="one_shot"),
            "symm_two": lambda: comm.all_reduce(buf, algo="two_shot"),
            "symm_auto_oop": lambda: comm.all_reduce(buf, algo="auto", out=out),
            "symm_one_oop": lambda: comm.all_reduce(buf, algo="one_shot", out=out),
            "torch_one": lambda: torch.ops.symm_mem.one_shot_all_reduce(tsym, "sum", group.group_name),
            "torch_two": lambda: torch.ops.symm_mem.two_shot_all_reduce_(tsym, "sum", group.group_name),
            "nccl": lambda: dist.all_reduce(nccl_buf),
        }
        for name, fn in methods.items():
            if name in ("symm_one", "symm_one_oop") and size > (64 << 20):
                continue
            if name == "symm_ll" and size > ll_max(world):
                continue
            for graph in [False, True]:
                try:
                    row[f"{name}_{'graph' if graph else 'eager'}"] = timed(fn, k, reps, graph)
                except Exception as e:  # report, keep going
                    row[f"{name}_{'graph' if graph else 'eager'}"] = None
                    if rank == 0:
                        print(f"  {name} {'graph' if graph else 'eager'} {size}: {type(e).__name__}: {e}", flush=True)
        rows.append(row)
        del buf, out, tsym
        if rank == 0:
            print(f"{size:>10} B  " + "  ".join(f"{k}={v:.1f}" for k, v in row.items() if k != "bytes" and v), flush=True)
    stats = symmalloc.memory_stats(rank)
    comm.close()
    if rank == 0:
        with open(os.path.join(out_dir, "allreduce.json"), "w") as f:
            json.dump({"rows": rows, "stats": stats, "device": torch.cuda.get_device_name(0), "world": world,
                       "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version()))}, f, indent=1)
    dist.destroy_process_group()


def table(path):
    d = json.load(open(path))
    cols = ["symm_auto", "symm_ll", "symm_one", "symm_two", "symm_auto_oop", "symm_one_oop", "torch_one", "torch_two", "nccl"]
    print(f"\nbf16 sum, {d['world']}x {d['device']}, torch {d['torch']}, NCCL {d['nccl']}; us per call (median)")
    print(f"{'size':>9} | " + " | ".join(f"{c:>9} e/g" for c in cols) + " | auto algbw GB/s | best other | auto vs best")
    for r in d["rows"]:
        def f(c, m):
            v = r.get(f"{c}_{m}")
            return f"{v:6.1f}" if v else "     -"
        cells = " | ".join(f"{f(c, 'eager')}/{f(c, 'graph')}".rjust(13) for c in cols)
        best_g = min(v for k, v in r.items() if v and k.endswith("graph") and not k.startswith("symm"))
        auto_g = r.get("symm_auto_graph") or float("inf")
        bw = r["bytes"] / (auto_g * 1e-6) / 1e9
        size = r["bytes"]
        label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
        print(f"{label:>9} | {cells} | {bw:15.1f} | {best_g:10.1f} | {best_g / auto_g:5.2f}x")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(8, 5))
        xs = [r["bytes"] for r in d["rows"]]
        for c in cols:
            for m, ls in [("graph", "-"), ("eager", ":")]:
                ys = [r.get(f"{c}_{m}") for r in d["rows"]]
                if any(ys):
                    ax.plot([x for x, y in zip(xs, ys) if y], [y for y in ys if y], ls, marker="o", label=f"{c} {m}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("latency (us)")
        ax.set_title(f"bf16 all-reduce, {d['world']}x {d['device']}")
        ax.legend(fontsize=7, ncol=2)
        ax.grid(True, which="both", alpha=0.3)
        fig.savefig(os.path.join(os.path.dirname(path), "allreduce.png"), dpi=120, bbox_inches="tight")
    except ImportError:
        print("(matplotlib missing: no plot)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    ap.add_argument("--table-only", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "allreduce.json")
    if not a.table_only:
        world = torch.cuda.device_count()
        if world < 2:
            sys.exit(f"needs >= 2 GPUs, found {world}")
        for k, v in [("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")]:
            os.environ[k] = v  # multicast stays off
        mp.spawn(worker, args=(min(world, 8), 29511, a.out), nprocs=min(world, 8))
    table(path)


if __name__ == "__main__":
    main()
