"""PyTorch caching allocator pair latency (torch.empty + del), the anchor row of the
allocator benchmark. p50/p99 over 20,000 pairs (5,000 per thread with 8 threads)."""
import threading
import time

import torch

SIZES = [512, 4 << 10, 64 << 10, 1 << 20, 8 << 20, 64 << 20]


def pairs(size, n, out):
    for _ in range(n // 10):
        t = torch.empty(size, dtype=torch.uint8, device="cuda")
        del t
    for _ in range(n):
        t0 = time.perf_counter_ns()
        t = torch.empty(size, dtype=torch.uint8, device="cuda")
        del t
        out.append((time.perf_counter_ns() - t0) / 1000.0)


def main():
    torch.cuda.init()
    print("torch caching allocator, torch.empty + del pair, us (p50 / p99)")
    for size in SIZES:
        row = []
        for threads in (1, 8):
            res = []
            ts = [threading.Thread(target=pairs, args=(size, 20000 if threads == 1 else 5000, res)) for _ in range(threads)]
            [t.start() for t in ts]
            [t.join() for t in ts]
            res.sort()
            row.append(f"{threads} thr {res[len(res) // 2]:6.2f} / {res[int(len(res) * 0.99)]:6.2f}")
        print(f"{size:>10} B  " + "   ".join(row))


if __name__ == "__main__":
    main()
