"""The Triton one-shot all-reduce of examples/triton_one_shot.py (written by a user over
``h.buffer_ptrs`` / ``h.signal_pad_ptrs``) against the library's own one-shot all-reduce, float32
sum, 8 KiB to 1 MiB, in the same processes:

    python3 bench/triton_one_shot.py [--world N] [--sizes 8K,64K,256K,1M]

One process per GPU (default: every GPU). Both are checked first against a float64 reference on
fresh random data (outputs poisoned). Timing as bench/fused.py: a CUDA graph of 20 calls,
replayed 200 times, each replay between events: p50 / p99 / max µs per call, the two variants'
replays interleaved. At world 1 it times local work only (a filter); the figure docs/p2p.md
quotes needs 2 GPUs. Multicast stays off."""
import argparse
import importlib.util
import os
import sys

os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.pop("SYMMALLOC_ENABLE_MULTICAST", None)

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
import symmalloc  # noqa: E402

_spec = importlib.util.spec_from_file_location("triton_one_shot", os.path.join(HERE, "..", "examples", "triton_one_shot.py"))
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)
CALLS, REPLAYS = 20, 200


def size(s):
    s = s.strip().upper()
    return int(s[:-1]) << {"K": 10, "M": 20}[s[-1]] if s[-1] in "KM" else int(s)


def graph_of(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(CALLS):
            fn()
    return g


def rank_main(rank, world, uid, sizes, q):
    try:
        torch.cuda.set_device(rank)
        comm = symmalloc.Communicator(rank, world, uid, device=rank)
        rows = []
        for nbytes in sizes:
            n = nbytes // 4
            with torch.cuda.use_mem_pool(symmalloc.mem_pool(rank)):
                x = torch.empty(n, device="cuda")
                out_lib = torch.empty(n, device="cuda")
            out_tri = torch.empty(n, device="cuda")
            epochs = torch.zeros(32, dtype=torch.int64, device="cuda")
            h = comm.rendezvous(x)
            g = torch.Generator().manual_seed(1000 + nbytes)
            inputs = [torch.randn(n, generator=g) for _ in range(world)]
            want = sum(t.double() for t in inputs)
            x.copy_(inputs[rank])
            variants = {"symmalloc one_shot": lambda: comm.all_reduce(x, algo="one_shot", out=out_lib),
                        "triton example": lambda: example.all_reduce(h, out_tri, epochs)}
            for name, out in (("symmalloc one_shot", out_lib), ("triton example", out_tri)):
                out.fill_(float("nan"))
                comm.barrier()
                variants[name]()
                torch.cuda.synchronize()
                err = ((out.double().cpu() - want).norm() / want.norm()).item()
                assert err < 1e-6, f"{name} at {nbytes} B: relative error {err:.3g}"
            graphs = {k: graph_of(f) for k, f in variants.items()}
            times = {k: [] for k in graphs}
            comm.barrier()
            torch.cuda.synchronize()
            for _ in range(REPLAYS):
                for k, gr in graphs.items():
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    gr.replay()
                    b.record()
                    times[k].append((a, b))
            torch.cuda.synchronize()
            for k, evs in times.items():
                t = sorted(a.elapsed_time(b) * 1e3 / CALLS for a, b in evs)
                rows.append((nbytes, k, t[len(t) // 2], t[int(len(t) * 0.99)], t[-1]))
            del graphs
            comm.barrier()
            torch.cuda.synchronize()
        comm.close()
        q.put((rank, rows, None))
    except Exception:
        import traceback

        q.put((rank, None, traceback.format_exc()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=torch.cuda.device_count())
    ap.add_argument("--sizes", default="8K,64K,256K,1M")
    a = ap.parse_args()
    if a.world > torch.cuda.device_count():
        sys.exit(f"--world {a.world}: one rank per GPU, and this machine has {torch.cuda.device_count()}")
    sizes = [size(s) for s in a.sizes.split(",")]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    uid = symmalloc.get_unique_id()
    procs = [ctx.Process(target=rank_main, args=(r, a.world, uid, sizes, q)) for r in range(a.world)]
    for p in procs:
        p.start()
    got = {}
    for _ in procs:
        rank, rows, failure = q.get(timeout=900)
        if failure:
            sys.exit(f"rank {rank} failed:\n{failure}")
        got[rank] = rows
    for p in procs:
        p.join(60)
    print(f"{torch.cuda.get_device_name(0)}, world {a.world}, float32 sum, rank 0, graphed, µs per call")
    print("| bytes | variant | p50 | p99 | max |")
    print("|---:|---|---:|---:|---:|")
    for nbytes, k, p50, p99, mx in got[0]:
        print(f"| {nbytes} | {k} | {p50:.2f} | {p99:.2f} | {mx:.2f} |")


if __name__ == "__main__":
    main()
