"""PyTorch caching allocator pair latency (torch.empty + del), the anchor column of the
allocator benchmark. p50/p99 over 20,000 pairs on 1 thread, 5,000 per thread on 8 threads
(which start timing together; the GIL serializes them).

bench/alloc.rs (alloc_bench) runs this script in its own run and merges the column into its
table (``--lines`` prints one machine-readable line per row). Alone:
    python3 bench/alloc_torch.py [--sizes 512,4096,...]"""
import argparse
import threading
import time

import torch

SIZES = [512, 4 << 10, 64 << 10, 1 << 20, 8 << 20, 64 << 20]


def pairs(size, n, start, out):
    for _ in range(n // 10):
        t = torch.empty(size, dtype=torch.uint8, device="cuda")
        del t
    start.wait()
    for _ in range(n):
        t0 = time.perf_counter_ns()
        t = torch.empty(size, dtype=torch.uint8, device="cuda")
        del t
        out.append((time.perf_counter_ns() - t0) / 1000.0)


def measure(size, threads):
    res = []
    start = threading.Barrier(threads)
    n = 20000 if threads == 1 else 5000
    ts = [threading.Thread(target=pairs, args=(size, n, start, res)) for _ in range(threads)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    res.sort()
    return res[len(res) // 2], res[int((len(res) - 1) * 0.99)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="bytes, comma-separated")
    ap.add_argument("--lines", action="store_true", help="print 'torch SIZE THREADS P50 P99' lines")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    torch.cuda.init()
    if not args.lines:
        print(f"torch {torch.__version__} caching allocator, torch.empty + del pair, us (p50 / p99)")
    for size in sizes:
        for threads in (1, 8):
            p50, p99 = measure(size, threads)
            if args.lines:
                print(f"torch {size} {threads} {p50:.3f} {p99:.3f}", flush=True)
            else:
                print(f"{size:>10} B  {threads} thr {p50:6.2f} / {p99:6.2f}", flush=True)


if __name__ == "__main__":
    main()
