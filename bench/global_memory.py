"""Device memory of a training step in PyTorch's global mode, symmalloc against PyTorch's own
allocator measured in the same run (the targets for memory that PyTorch gives back).

    SYMMALLOC_LIBRARY_DIR=target/release python3 bench/global_memory.py [--runs 3] [--scale 1]

One GPU. Fresh processes in alternating order (torch, symmalloc; then symmalloc, torch; ...),
each running the same script on its own allocator (symmalloc via symmalloc.install_global()
before any CUDA use). The model: timm's resnet50 when timm imports, else a ResNet-50 built here
from torch.nn (same layers: bottlenecks 3-4-6-3, 25.6 M parameters). bf16 autocast, SGD with
momentum, batch 64 x 3 x 224 x 224, cross-entropy. Phases, device memory read from the driver
(total - free of cudaMemGetInfo, so both allocators are measured alike):
  1. eager: --eager-steps steps; the highest device use (sampled after each step) and the
     allocator's reserved memory;
  2. capture: the same step captured into a CUDA graph after the eager steps (the warm-up on a
     side stream and torch.cuda.graph, as PyTorch's docs do it); the device memory it adds, and
     the graphed step's time over --replays replays (p50, p99);
  3. ten graphs: that graph deleted, 10 graphs of batch 512, 256, ..., 1 (times --scale)
     captured into one shared pool (largest first), each after an eager warm-up of its size;
     the device use at the end and its change from after the delete.
Targets (printed as verdicts): capture adds <= PyTorch's figure + 5% of the eager footprint
(the highest eager device use minus the use before the model existed), and, the same moment in
absolute terms, device use at the capture's end <= PyTorch's + that 5% (the added figure counts
from each allocator's eager cache, which the capture's empty_cache returns); the ten graphs end at
<= PyTorch's device use; eager device use <= PyTorch's; the graphed step no slower (p50 within
3%, the run-to-run noise seen on one H100). Each child also reports whether PyTorch exposed the
pool hooks (set_begin_allocate_to_pool: without them captures allocate into symmalloc's
default pool) and whether torch.cuda.empty_cache reached symmalloc by itself.

Diagnosis (one child, PyTorch's allocator): `--child torch --record FILE` writes PyTorch's trace
of the ten graphs' first capture, `--child torch --record-capture FILE` the trace of the whole
process up to the end of phase 2's capture with the phases marked; `alloc_bench --replay FILE`
and `--replay-capture FILE` (bench/replay.rs) replay them into symmalloc's heap on host memory.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
MIB = float(1 << 20)


def used():
    import torch

    free, total = torch.cuda.mem_get_info()
    return (total - free) / MIB


def resnet50(nn):
    """ResNet-50 (torchvision's layout) from torch.nn only."""

    class Bottleneck(nn.Module):
        def __init__(self, cin, width, stride):
            super().__init__()
            cout = width * 4
            self.body = nn.Sequential(
                nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout),
            )
            self.down = None
            if stride != 1 or cin != cout:
                self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            self.relu = nn.ReLU(inplace=True)

        def forward(self, x):
            idn = x if self.down is None else self.down(x)
            return self.relu(self.body(x) + idn)

    layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for width, blocks, stride in [(64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)]:
        for i in range(blocks):
            layers.append(Bottleneck(cin, width, stride if i == 0 else 1))
            cin = width * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2048, 1000)]
    return nn.Sequential(*layers)


def torch_pools():
    """PyTorch's allocator, per pool: segments, reserved, allocated MiB (--probe)."""
    import torch

    pools = {}
    for seg in torch.cuda.memory_snapshot():
        p = pools.setdefault(str(tuple(seg.get("segment_pool_id", (0, 0)))), [0, 0.0, 0.0])
        p[0] += 1
        p[1] += seg["total_size"] / MIB
        p[2] += seg["allocated_size"] / MIB
    return {k: f"{n} segments, {r:.1f} reserved, {a:.1f} allocated" for k, (n, r, a) in sorted(pools.items())}


def start_trace():
    """PyTorch's allocator trace from now on (--record, --record-capture)."""
    import torch

    torch.cuda.memory._record_memory_history("all", context=None, stacks="python", max_entries=4_000_000)


def write_trace(path, marks=()):
    """Stops the trace and writes it as alloc_bench's replays read it (bench/replay.rs): a line
    `action size addr stream` per event, `mark NAME` before the event a mark's index names, and
    `mark capture_end` last when there are marks."""
    import torch

    trace = torch.cuda.memory._snapshot()["device_traces"][0]
    torch.cuda.memory._record_memory_history(None)
    at = {}
    for n, i in marks:
        at.setdefault(i, []).append(n)
    with open(path, "w") as f:
        for i, e in enumerate(trace):
            for n in at.get(i, []):
                f.write(f"mark {n}\n")
            f.write(f"{e['action']} {e.get('size', 0)} {e.get('addr', 0):#x} {e.get('stream', 0):#x}\n")
        if marks:
            f.write("mark capture_end\n")


def child(alloc, args):
    import torch

    def probe(what):
        # --probe: where the memory sits at this point (symmalloc's per-pool lines come from
        # SYMMALLOC_DEBUG=TRACE at every empty_cache, on stderr).
        if args.probe:
            extra = torch_pools() if alloc == "torch" else {}
            print(f"PROBE {what}: used {used():.0f} MiB {json.dumps(extra)}", file=sys.stderr, flush=True)

    info = {"alloc": alloc}
    if alloc == "symmalloc":
        import symmalloc

        symmalloc.install_global()  # before any CUDA use
        try:
            raw = torch.cuda.memory._get_current_allocator().allocator()
            info["pool_hooks"] = hasattr(raw, "set_begin_allocate_to_pool")
        except Exception as e:  # noqa: BLE001 (reported, not fatal)
            info["pool_hooks"] = f"unknown ({e})"
    torch.cuda.set_device(0)
    marks = []  # --record-capture: (phase, index of the trace's next entry)
    recording = args.record_capture and alloc == "torch"
    if recording:  # PyTorch's trace of the whole process up to the end of the first capture
        start_trace()

    def mark(name):
        if recording:
            marks.append((name, len(torch.cuda.memory._snapshot()["device_traces"][0])))

    base_used = used()
    if alloc == "symmalloc":
        # Does torch.cuda.empty_cache reach symm_empty_cache? If not (a package without the
        # wrapper), wire it here so the heap is what gets measured, and say so.
        x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        del x
        r0 = symmalloc.memory_stats(0)["reserved_bytes"]
        torch.cuda.empty_cache()
        reached = symmalloc.memory_stats(0)["reserved_bytes"] < r0
        info["empty_cache_reaches"] = reached
        if not reached:
            import ctypes

            lib = ctypes.CDLL(symmalloc.library_path())
            native = torch.cuda.empty_cache

            def empty_cache():
                native()
                lib.symm_empty_cache()

            torch.cuda.empty_cache = empty_cache
        reserved = lambda: symmalloc.memory_stats(0)["reserved_bytes"] / MIB  # noqa: E731
    else:
        reserved = lambda: torch.cuda.memory_reserved() / MIB  # noqa: E731
    torch.manual_seed(0)
    import torch.nn as nn

    try:
        import timm

        model = timm.create_model("resnet50", num_classes=1000)
        info["model"] = "timm resnet50"
    except Exception:  # noqa: BLE001 (timm absent: the same network from torch.nn)
        model = resnet50(nn)
        info["model"] = "resnet50 (torch.nn)"
    model = model.cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    gen = torch.Generator(device="cuda").manual_seed(1)

    def batch(n):
        x = torch.randn(n, 3, 224, 224, device="cuda", generator=gen)
        y = torch.randint(0, 1000, (n,), device="cuda", generator=gen)
        return x, y

    def step(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss

    # 1. Eager steps.
    mark("eager")
    eager_peak = 0.0
    for _ in range(args.eager_steps):
        x, y = batch(args.batch)
        opt.zero_grad(set_to_none=True)
        loss = step(x, y)
        loss.item()
        torch.cuda.synchronize()
        eager_peak = max(eager_peak, used())
    del x, y, loss
    torch.cuda.synchronize()
    info["eager_peak_used"] = eager_peak
    info["eager_footprint"] = eager_peak - base_used
    info["eager_reserved"] = reserved()

    probe("after eager")
    # 2. The same step captured after the eager steps.
    mark("after_eager")
    before = used()
    sx, sy = batch(args.batch)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            step(sx, sy)
    torch.cuda.current_stream().wait_stream(side)
    opt.zero_grad(set_to_none=True)
    g = torch.cuda.CUDAGraph()
    mark("capture")
    with torch.cuda.graph(g):
        sloss = step(sx, sy)
    torch.cuda.synchronize()
    info["capture_added"] = used() - before
    # The same moment in absolute terms (over the context): capture_added counts from the eager
    # cache that torch.cuda.graph's empty_cache then returns, so a smaller eager cache reads as
    # more added (bench/history/NOTES-2026-11-22-to-11-28.md, "The allocator").
    info["capture_end_used"] = used() - base_used
    if recording:
        write_trace(args.record_capture, marks)
    probe("after capture")
    times = []
    for _ in range(args.replays):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        g.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    info["graph_p50_ms"] = times[len(times) // 2]
    info["graph_p99_ms"] = times[min(len(times) - 1, int(len(times) * 0.99))]
    info["graph_loss_finite"] = bool(torch.isfinite(sloss).item())

    # 3. The graph deleted, then ten graphs of decreasing batch sharing one pool.
    del g, sloss, sx, sy
    import gc

    gc.collect()
    torch.cuda.synchronize()
    after_delete = used()
    pool = torch.cuda.graph_pool_handle()
    graphs, losses = [], []
    for b in [512, 256, 128, 64, 32, 16, 8, 4, 2, 1]:
        n = max(1, int(b * args.scale))
        gx, gy = batch(n)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # the other work: an eager warm-up of this size
            opt.zero_grad(set_to_none=True)
            step(gx, gy)
        torch.cuda.current_stream().wait_stream(side)
        opt.zero_grad(set_to_none=True)
        gr = torch.cuda.CUDAGraph()
        record = args.record and alloc == "torch" and b == 512
        if record:  # --record: PyTorch's own trace of the first shared-pool capture
            start_trace()
        with torch.cuda.graph(gr, pool=pool):
            losses.append(step(gx, gy))
        if record:
            write_trace(args.record)
        graphs.append((gr, gx, gy))
        probe(f"after graph of batch {n}")
    torch.cuda.synchronize()
    info["ten_graphs_used"] = used()
    info["ten_graphs_change"] = info["ten_graphs_used"] - after_delete
    for gr, _, _ in graphs:  # replayed in capture order, as a shared pool requires
        gr.replay()
    torch.cuda.synchronize()
    info["ten_graphs_losses_finite"] = all(bool(torch.isfinite(v).item()) for v in losses)
    info["end_reserved"] = reserved()
    if args.probe:
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        probe("at the end, after empty_cache")
    return info


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="fresh-process pairs, alternating order")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--eager-steps", type=int, default=10)
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--scale", type=float, default=1.0, help="scales the ten graphs' batches (512..1)")
    ap.add_argument("--out", default=None, help="write every run's figures here as JSON")
    ap.add_argument("--child", choices=["torch", "symmalloc"], help=argparse.SUPPRESS)
    ap.add_argument("--record", default=None, help="with --child torch: write PyTorch's allocator trace of the "
                    "first shared-pool capture (batch 512) to this file")
    ap.add_argument("--record-capture", default=None,
                    help="with --child torch: write PyTorch's allocator trace from the start to the end of the "
                         "capture after eager, with the phases marked, to this file (alloc_bench --replay-capture)")
    ap.add_argument("--probe", action="store_true",
                    help="with --child: print where memory sits at each phase on stderr (PyTorch: "
                         "per pool from memory_snapshot; symmalloc: run with SYMMALLOC_DEBUG=TRACE)")
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args)), flush=True)
        return
    passthrough = ["--batch", str(args.batch), "--eager-steps", str(args.eager_steps),
                   "--replays", str(args.replays), "--scale", str(args.scale)]
    results = {"torch": [], "symmalloc": []}
    for r in range(args.runs):
        order = ["torch", "symmalloc"] if r % 2 == 0 else ["symmalloc", "torch"]
        for alloc in order:
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", alloc] + passthrough,
                               capture_output=True, text=True)
            line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            if p.returncode != 0 or not line:
                sys.stderr.write(p.stdout[-4000:] + p.stderr[-4000:])
                sys.exit(f"run {r}, {alloc}: the child failed (exit {p.returncode})")
            res = json.loads(line[0][len("RESULT "):])
            results[alloc].append(res)
            print(f"run {r} {alloc:9s} " + " ".join(
                f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items() if k != "alloc"),
                flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    med = {a: {k: statistics.median(r[k] for r in rs) for k in rs[0] if isinstance(rs[0][k], float)}
           for a, rs in results.items()}
    rows = [("eager: highest device use (MiB)", "eager_peak_used"),
            ("eager: allocator reserved (MiB)", "eager_reserved"),
            ("eager: footprint over the context (MiB)", "eager_footprint"),
            ("capture after eager: device memory added (MiB)", "capture_added"),
            ("capture after eager: device use at its end (MiB)", "capture_end_used"),
            ("graphed step p50 (ms)", "graph_p50_ms"),
            ("graphed step p99 (ms)", "graph_p99_ms"),
            ("10 graphs, one pool: device use at the end (MiB)", "ten_graphs_used"),
            ("10 graphs, one pool: change after the delete (MiB)", "ten_graphs_change")]
    t, s = med["torch"], med["symmalloc"]
    print(f"\nmedians of {args.runs} fresh processes each; model {results['torch'][0]['model']}, batch "
          f"{args.batch}; symmalloc pool hooks: {results['symmalloc'][0].get('pool_hooks')}, empty_cache "
          f"reached it by itself: {results['symmalloc'][0].get('empty_cache_reaches')}")
    print(f"{'':52s} {'PyTorch':>10s} {'symmalloc':>10s} {'ratio':>7s}")
    for name, k in rows:
        ratio = s[k] / t[k] if t[k] else float("nan")
        print(f"{name:52s} {t[k]:10.1f} {s[k]:10.1f} {ratio:7.3f}")
    allowed = t["capture_added"] + 0.05 * t["eager_footprint"]
    verdicts = [
        ("capture adds <= PyTorch + 5% of the eager footprint", s["capture_added"] <= allowed,
         f"{s['capture_added']:.0f} vs {allowed:.0f} MiB"),
        ("device use after the capture <= PyTorch's + 5% of the eager footprint",
         s["capture_end_used"] <= t["capture_end_used"] + 0.05 * t["eager_footprint"],
         f"{s['capture_end_used']:.0f} vs {t['capture_end_used'] + 0.05 * t['eager_footprint']:.0f} MiB"),
        ("ten graphs end at <= PyTorch's device use", s["ten_graphs_used"] <= t["ten_graphs_used"],
         f"{s['ten_graphs_used']:.0f} vs {t['ten_graphs_used']:.0f} MiB"),
        ("eager device use <= PyTorch's", s["eager_peak_used"] <= t["eager_peak_used"],
         f"{s['eager_peak_used']:.0f} vs {t['eager_peak_used']:.0f} MiB"),
        ("graphed step no slower (p50 within 3%)", s["graph_p50_ms"] <= 1.03 * t["graph_p50_ms"],
         f"{s['graph_p50_ms']:.3f} vs {t['graph_p50_ms']:.3f} ms"),
        ("every replayed loss finite", all(r["graph_loss_finite"] and r["ten_graphs_losses_finite"]
                                           for rs in results.values() for r in rs), ""),
    ]
    print()
    for name, ok, detail in verdicts:
        print(f"{'PASS' if ok else 'FAIL'}  {name}  {detail}")


if __name__ == "__main__":
    main()
