"""Where does global mode's ResNet step lose time? One process per mode; prints one JSON row.

    python3 bench/step_probe.py default|global [--ext-profile]    (one GPU, timm installed)

Run it in fresh processes, modes alternating (bench/RESULTS.md, "Global mode's host cost", run B).
Per step: wall, host enqueue (until opt.step() returns, before the sync), the thread's CPU time;
allocations per step from memory_stats; a CPU-only profile of 5 steps (self CPU per op);
the step captured in a CUDA graph and replayed (device time without the host).
--ext-profile (global, with SYMMALLOC_TORCH_EXT naming a C++ allocator built with
`python -m symmalloc._torch_ext --build DIR --profile`): per thread and step, the allocations'
and frees' count and time in the allocator, the part in libsymmalloc, and the calls over 10 us;
--ext-trace FILE with it: 5 more steps' allocations and frees, each with its thread, address,
size, stream and time, written to FILE as CSV (the row gives each step's start and end on the
same clock), for a host replay of the sequence."""
import json
import os
import statistics
import sys
import time

mode = sys.argv[1] if len(sys.argv) > 1 else ""
if mode not in ("default", "global"):
    sys.exit(f"step_probe.py: mode {mode!r}: expected default or global")
ext_profile = "--ext-profile" in sys.argv[2:]
ext_trace = sys.argv[sys.argv.index("--ext-trace") + 1] if "--ext-trace" in sys.argv else None
if ext_trace and not ext_profile:
    sys.exit("step_probe.py: --ext-trace FILE goes with --ext-profile")
if ext_profile and mode != "global":
    sys.exit("step_probe.py: --ext-profile times symmalloc's C++ allocator: mode global only")
os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
os.environ.pop("SYMMALLOC_ENABLE_MULTICAST", None)
import torch
if mode == "global":
    import symmalloc
    symmalloc.install_global()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_global import resnet_step  # noqa: E402 (after the allocator is chosen)

step = resnet_step(torch)
row = {"mode": mode}
for _ in range(15):
    step()
torch.cuda.synchronize()
s0 = torch.cuda.memory_stats()
if ext_profile:
    from symmalloc import _torch_ext
    _torch_ext.profile_take()  # from zero
wall, enq, cpu = [], [], []
for _ in range(40):
    torch.cuda.synchronize()
    t0 = time.perf_counter(); c0 = time.thread_time()
    step()
    t1 = time.perf_counter(); c1 = time.thread_time()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    wall.append((t2 - t0) * 1e3); enq.append((t1 - t0) * 1e3); cpu.append((c1 - c0) * 1e3)
s1 = torch.cuda.memory_stats()
if ext_profile:
    per = {}
    for tid, ops in _torch_ext.profile_take().items():
        if ops["alloc"]["n"] or ops["free"]["n"]:
            per[tid] = {op: {k: round(v / 40, 3) if k != "max_us" else v for k, v in d.items()}
                        for op, d in ops.items()}
    row["ext_profile_per_step"] = per
    n = 200000
    t0 = time.perf_counter_ns()
    for _ in range(n):
        time.perf_counter_ns()
    row["clock_read_ns"] = (time.perf_counter_ns() - t0) / n  # the profile's clock, with Python's call
if ext_trace:
    _torch_ext.profile_trace(True)
    bounds = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.monotonic_ns()
        step()
        torch.cuda.synchronize()
        bounds.append((t0, time.monotonic_ns()))
    _torch_ext.profile_trace(False, ext_trace)
    row["ext_trace_steps_ns"] = bounds
row["wall"] = statistics.median(wall); row["enqueue"] = statistics.median(enq); row["cpu"] = statistics.median(cpu)
for k in ("allocation.all.allocated", "num_alloc_retries", "num_sync_all_streams", "segment.all.allocated", "num_device_alloc", "num_device_free"):
    if k in s0:
        row[k + "/step"] = (s1[k] - s0[k]) / 40
# whole-process CPU (all threads) per step
t0 = time.perf_counter(); p0 = time.process_time()
for _ in range(20):
    step()
torch.cuda.synchronize()
row["wall20"] = (time.perf_counter() - t0) * 1e3 / 20; row["proc_cpu20"] = (time.process_time() - p0) * 1e3 / 20
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(5):
        step()
    torch.cuda.synchronize()
ka = prof.key_averages()
top = sorted(ka, key=lambda e: e.self_cpu_time_total, reverse=True)[:30]
row["prof"] = [(e.key, e.count // 5, round(e.self_cpu_time_total / 5 / 1e3, 3)) for e in top]
row["prof_total_ms"] = round(sum(e.self_cpu_time_total for e in ka) / 5 / 1e3, 3)
try:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    rep = []
    for _ in range(30):
        ev[0].record(); g.replay(); ev[1].record(); torch.cuda.synchronize()
        rep.append(ev[0].elapsed_time(ev[1]))
    row["graph_replay_ms"] = statistics.median(rep[5:])
except Exception as e:  # noqa: BLE001 (a capture that fails is reported, not fatal)
    row["graph_err"] = repr(e)[:300]
print("ROW " + json.dumps(row), flush=True)
