"""The graphed launch floor: what a kernel call costs with nothing in it, in the form
bench/moe.py times its calls (10 calls captured in one CUDA graph, per-call time = replay / 10,
p50 / p99 / max over 200 replays behind a GPU spin).

    python3 bench/graph_floor.py

Kernels: an empty Triton kernel and one with a load and a store per block, on grids of 4, 32
and 132 blocks of 16 warps (the MoE kernels' 512 threads), and torch's one-element `add_`; each
set twice. Needs a GPU, torch and Triton. bench/NOTES.md ("What the 1-token target leaves the
kernel") reads it against the MoE dispatch.
"""
import torch
import triton
import triton.language as tl

@triton.jit
def empty(p, n):
    pid = tl.program_id(0)
    if pid < 0:
        tl.store(p, n)

@triton.jit
def touch(p, n):
    # one load and one store per block: a round trip's shape
    pid = tl.program_id(0)
    v = tl.load(p + pid)
    tl.store(p + pid, v + 1)

def graph_ms(fn, calls=10, replays=200):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    for _ in range(20):
        g.replay()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    torch.cuda._sleep(2_000_000)
    for a, b in ev:
        a.record(); g.replay(); b.record()
    torch.cuda.synchronize()
    t = sorted(a.elapsed_time(b) * 1000 / calls for a, b in ev)
    return t[len(t) // 2], t[int(len(t) * 0.99) - 1], t[-1]

buf = torch.zeros(256, dtype=torch.int32, device="cuda")
one = torch.zeros(1, device="cuda")
print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
for rep in range(2):
    for G in (4, 32, 132):
        for name, k in (("empty", empty), ("touch", touch)):
            r = graph_ms(lambda: k[(G,)](buf, 1, num_warps=16))
            print(f"  {name} grid {G} x 512 threads: p50 {r[0]:.2f} p99 {r[1]:.2f} max {r[2]:.2f} us")
    r = graph_ms(lambda: one.add_(1))
    print(f"  torch add_ 1 element: p50 {r[0]:.2f} p99 {r[1]:.2f} max {r[2]:.2f} us")
