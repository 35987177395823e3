"""Global mode's host cost: symmalloc as PyTorch's allocator (CUDAPluggableAllocator +
change_current_allocator) against PyTorch's own caching allocator and against the floor of any
pluggable allocator (bench/bump_alloc.c: a bump pointer, a free that does nothing), one GPU.

    python3 bench/torch_global.py [--pairs 10] [--steps 120] [--model transformer|resnet50]
                                  [--batch 64] [--bump PATH] [--out DIR]

Modes: default (PyTorch's allocator), global (symmalloc.install_global(): the C++ allocator for
PyTorch), floor (the bump allocator), and optionally default-b (PyTorch's allocator again, in
processes of its own: an A/A control, so the table shows the spread the harness gives two equal
allocators beside global's), floor-reuse (the step's floor: bench/bump_alloc.c's exact-size
stacks, which a step with repeating shapes can train on), global-pluggable (install_global's
CUDAPluggableAllocator path), global-tc0, global-old.

Every mode runs in fresh processes (the allocator is chosen before CUDA starts), in rounds that
alternate the modes' order (rotated, or with --shuffle SEED in blocks of len(modes) rounds that put
every mode once at every position, a random permutation's rotations); a round is one process
per mode. Rows:
  empty+del N     torch.empty(N bytes) then del, us per pair (median of 5 x 3000)
  p99 N           the p99 of 5000 such pairs timed one by one
  mixed 64        64 live tensors of mixed sizes, then all freed, us per tensor
  xthread 64      the same 64 made on this thread and freed on a second one (autograd's
                  backward frees what the forward allocated), us per tensor
  side stream     an allocation on a side stream, record_stream on the main one, then del
  train step      --model transformer (default and global modes): a 6-layer transformer
                  (bench/ddp_memory.py's, world 1 DDP over gloo), bf16 autocast, batch 8,
                  sequence 64..512, AdamW; --model resnet50: timm's ResNet-50 (else
                  bench/global_memory.py's), bf16 autocast, batch 64, SGD with momentum. Not the
                  floor (its bump pointer wraps within a few steps, and PyTorch's pluggable
                  wrapper refuses the address handed out again): its rows are the per-pair ones;
                  the step's floor is floor-reuse (a free stack per exact size, one spin lock).
                  Step p50 (ms) with a sync after each step, and the driver's used-memory
                  peak (GiB); for resnet50 also the host's time to issue a step (enqueue, p50)
                  and the step back to back as a training loop runs it (pipelined: one sync
                  at the end of a window of --steps steps)
The table prints every round's global - floor and global - default, then the medians, and the
targets (issue "Global mode costs nothing on the host"): global - floor <= 0.2 us per pair in
every round; train step median within 2% of default; memory <= 0.97x default.
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
SIZES = [512, 64 << 10, 1 << 20, 64 << 20]
MODES = ["default", "global", "floor"]


def pairs_us(torch, nbytes, reps=7, n=5000):
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(n):
            x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            del x
        out.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(out)


def pair_p99_us(torch, nbytes, n=5000):
    """p99 of single torch.empty + del pairs, each timed alone (perf_counter_ns; its own cost,
    about 0.05 us, is in every sample)."""
    clock = time.perf_counter_ns
    out = []
    for _ in range(n):
        t = clock()
        x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        del x
        out.append(clock() - t)
    out.sort()
    return out[int(len(out) * 0.99)] / 1e3


def mixed_us(torch, reps=50):
    sizes = [(512 << (i % 12)) + 4096 * (i % 5) for i in range(64)]
    out = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(reps):
            live = [torch.empty(s, dtype=torch.uint8, device="cuda") for s in sizes]
            del live
        out.append((time.perf_counter() - t) / (reps * len(sizes)) * 1e6)
    return statistics.median(out)


def xthread_us(torch, reps=200):
    """64 tensors of mixed sizes made on this thread and freed on a second one (PyTorch's
    backward frees on autograd's thread what the forward allocated): µs per tensor, the
    allocation plus the other thread's free (timed by that thread), median over rounds."""
    import queue
    import threading

    sizes = [(512 << (i % 12)) + 4096 * (i % 5) for i in range(64)]
    todo, done = queue.Queue(), queue.Queue()

    def worker():
        while (live := todo.get()) is not None:
            t = time.perf_counter()
            live.clear()  # the last references: the frees run on this thread
            done.put(time.perf_counter() - t)

    th = threading.Thread(target=worker, daemon=True)
    th.start()
    out = []
    for i in range(reps + 10):
        t = time.perf_counter()
        live = [torch.empty(s, dtype=torch.uint8, device="cuda") for s in sizes]
        took = time.perf_counter() - t
        todo.put(live)
        del live
        freed = done.get()
        if i >= 10:
            out.append((took + freed) / len(sizes) * 1e6)
    todo.put(None)
    th.join()
    return statistics.median(out)


def side_stream_us(torch, reps=500):
    side, main = torch.cuda.Stream(), torch.cuda.current_stream()
    out = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(reps):
            with torch.cuda.stream(side):
                x = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
            x.record_stream(main)
            del x
        out.append((time.perf_counter() - t) / reps * 1e6)
    return statistics.median(out)


def train(torch, steps, port):
    import torch.distributed as dist
    import torch.nn as nn

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(1024, 16, 4096, batch_first=True, dropout=0.0)
    model = nn.parallel.DistributedDataParallel(nn.TransformerEncoder(layer, 6).cuda())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    lengths = torch.randint(64, 513, (steps,), generator=torch.Generator().manual_seed(1)).tolist()
    gen = torch.Generator(device="cuda").manual_seed(100)
    total = torch.cuda.mem_get_info()[1]
    times, used, losses = [], 0, []
    for seq in lengths:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        x = torch.randn(8, seq, 1024, device="cuda", generator=gen)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = (model(x).float() - x).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        used = max(used, total - torch.cuda.mem_get_info()[0])
    dist.destroy_process_group()
    return statistics.median(times[10:]), used / float(1 << 30), losses[-1]


def resnet_step(torch, batch=64):
    """The ResNet-50 training step (timm's, else bench/global_memory.py's; bf16 autocast, batch
    64 unless told, SGD with momentum) as a function of no arguments that returns the loss. Also
    bench/step_probe.py's."""
    sys.path.insert(0, HERE)
    import global_memory

    import torch.nn as nn

    torch.manual_seed(0)
    try:
        import timm

        model = timm.create_model("resnet50", num_classes=1000).cuda()
    except Exception:  # noqa: BLE001 (timm absent: the same network from torch.nn)
        model = global_memory.resnet50(nn).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator(device="cuda").manual_seed(100)
    x = torch.randn(batch, 3, 224, 224, device="cuda", generator=gen)
    y = torch.randint(0, 1000, (batch,), device="cuda", generator=gen)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        out.backward()
        opt.step()
        return out

    return step


def train_resnet(torch, steps, batch=64):
    step = resnet_step(torch, batch)
    total = torch.cuda.mem_get_info()[1]
    times, gpu, enq, used, loss = [], [], [], 0, None
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]

    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ev[0].record()
        loss = step()
        enq.append((time.perf_counter() - t0) * 1e3)
        ev[1].record()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        gpu.append(ev[0].elapsed_time(ev[1]))
        CPUS.append(cpu_now())
        used = max(used, total - torch.cuda.mem_get_info()[0])
    GPU_MS.append(statistics.median(gpu[10:]))
    ENQUEUE_MS.append(statistics.median(enq[10:]))
    # As a training loop runs: steps back to back, one sync at the end of the window (the host
    # runs ahead of the GPU, so a slow host moment is hidden while the queue holds work).
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    torch.cuda.synchronize()
    PIPELINED_MS.append((time.perf_counter() - t0) * 1e3 / steps)
    return statistics.median(times[10:]), used / float(1 << 30), float(loss.item())


def host_probe(torch):
    """The process's host speed apart from the allocator: a pure-Python loop (ms) and a launch
    that allocates nothing (``torch.add(..., out=)``, µs per launch; median of 5 batches of 2000).
    A slow process whose probes are slow too is the host's mode, not the allocator's."""
    py = []
    for _ in range(5):
        t0 = time.perf_counter()
        sum(range(200_000))
        py.append((time.perf_counter() - t0) * 1e3)
    a = torch.ones(16, device="cuda")
    c = torch.empty_like(a)
    launch = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(2000):
            torch.add(a, a, out=c)
        launch.append((time.perf_counter() - t0) * 1e6 / 2000)
    torch.cuda.synchronize()
    return min(py), statistics.median(launch)


def cpu_now():
    """The CPU this thread last ran on (/proc/thread-self/stat, field 39)."""
    try:
        with open("/proc/thread-self/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[36])
    except (OSError, ValueError, IndexError):
        return -1


CPUS = []  # the CPUs the training loop ran on, one sample per step
GPU_MS = []  # the ResNet step's GPU time (events around it), p50: tells a host-side slow mode
# from a device-side one
ENQUEUE_MS = []  # the ResNet step's host time to issue it (until opt.step() returns), p50
PIPELINED_MS = []  # the ResNet step back to back, as a training loop runs it (mean of a window)


def child(mode, bump, steps, port, core, old_lib=None, model="transformer", micro=True, batch=64):
    if core >= 0:  # every process on the same core: placement differs between processes otherwise
        os.sched_setaffinity(0, {core})
    t_start = time.perf_counter()
    import torch

    if mode.startswith("global"):
        if mode == "global-old":  # another build's libraries (--old-lib), for an A/B
            os.environ["SYMMALLOC_LIBRARY_DIR"] = old_lib
        if mode == "global-tc0":  # the per-thread caches off (SYMMALLOC_THREAD_CACHE=0)
            os.environ["SYMMALLOC_THREAD_CACHE"] = "0"
        import symmalloc

        symmalloc.install_global(allocator="pluggable" if mode == "global-pluggable" else "auto")
        row_installed = symmalloc.memory.installed()
    elif mode in ("floor", "floor-reuse"):
        fns = ("bump_malloc", "bump_free") if mode == "floor" else ("reuse_malloc", "reuse_free")
        alloc = torch.cuda.memory.CUDAPluggableAllocator(bump, *fns)
        torch.cuda.memory.change_current_allocator(alloc)
    torch.cuda.init()
    torch.empty(1, device="cuda")
    row = {"mode": mode}
    if mode.startswith("global"):
        row["installed"] = row_installed
    phases = [("start", time.perf_counter() - t_start)]
    for n in SIZES if micro else []:
        pairs_us(torch, n, reps=1, n=500)  # warm
        row[f"empty+del {n}"] = pairs_us(torch, n, reps=5, n=3000)
        row[f"p99 {n}"] = pair_p99_us(torch, n)
    if micro:
        row["mixed 64"] = mixed_us(torch)
        row["xthread 64"] = xthread_us(torch)
        row["side stream"] = side_stream_us(torch)
    phases.append(("micro", time.perf_counter() - t_start))
    if steps and mode != "floor":  # the floor hands memory out again once it wraps: no training
        fn = (lambda t, n: train_resnet(t, n, batch)) if model == "resnet50" else (lambda t, n: train(t, n, port))
        row["probe py ms"], row["probe launch us"] = host_probe(torch)
        t_train = time.time()
        row["train step ms"], row["train used GiB"], row["loss"] = fn(torch, steps)
        # wall-clock span of the training, to line up with a clock log (nvidia-smi -lms)
        row["train at"] = [round(t_train, 2), round(time.time(), 2)]
        if GPU_MS:
            row["train gpu ms"] = GPU_MS[-1]
            row["train enqueue ms"] = ENQUEUE_MS[-1]
            row["train pipelined ms"] = PIPELINED_MS[-1]
        row["probe after py ms"], row["probe after launch us"] = host_probe(torch)
        row["train cpus"] = sorted(set(CPUS))
    phases.append(("train", time.perf_counter() - t_start))
    row["phases s"] = " ".join(f"{k} {v:.1f}" for k, v in phases)
    print("ROW " + json.dumps(row), flush=True)


def balanced_block(rng, modes):
    """len(modes) round orders, in a random order, in which every mode runs once at every position:
    the rotations of a random permutation. A shuffle of each round on its own left positions
    unbalanced (bc43e23: global ran second in 6 of 9 rounds, and second ran 2% slower in the
    other call), a rotation of the same permutation always ran the modes in one cycle; blocks
    of a new permutation each keep positions balanced and vary the mode run before."""
    perm = rng.sample(modes, len(modes))
    block = [perm[k:] + perm[:k] for k in range(len(modes))]
    rng.shuffle(block)
    return block


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--bump", default=os.path.join(os.environ.get("SYMMALLOC_LIBRARY_DIR", "."), "libbump_alloc.so"))
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    ap.add_argument("--child")
    ap.add_argument("--modes", default=",".join(MODES),
                    help="default,global,floor and optionally default-b (PyTorch's allocator again: "
                    "an A/A control, the spread the harness gives two equal allocators), floor-reuse "
                    "(the training step's floor), global-tc0, global-old (needs --old-lib)")
    ap.add_argument("--old-lib", default=None, help="the libraries of another build, for mode global-old")
    ap.add_argument("--port", type=int, default=29800)
    ap.add_argument("--model", default="transformer", choices=["transformer", "resnet50"])
    ap.add_argument("--no-micro", action="store_true", help="the training step alone (no floor rows)")
    ap.add_argument("--core", type=int, default=2, help="the core every process runs on (-1: any)")
    ap.add_argument("--shuffle", type=int, default=None, metavar="SEED",
                    help="rounds in blocks of len(modes), each block the rotations of a new random "
                    "permutation (seeded) in random order: every mode once at every position per block, "
                    "and the mode run before each varies (a plain rotation of 3 modes always runs them in "
                    "one cycle)")
    ap.add_argument("--batch", type=int, default=64, help="--model resnet50's batch (64; a small one "
                    "makes the step host-bound, so the host's cost sets it)")
    a = ap.parse_args()
    if a.model == "resnet50" and 0 < a.steps <= 10:
        ap.error(f"--steps {a.steps}: the resnet50 step times the steps after its first 10 (warm-up); "
                 "give more than 10, or 0 for no training")
    for k, v in NO_MULTICAST.items():
        os.environ[k] = v
    os.environ.pop("SYMMALLOC_ENABLE_MULTICAST", None)
    if a.child:
        return child(a.child, a.bump, a.steps, a.port, a.core, a.old_lib, a.model, not a.no_micro, a.batch)
    os.makedirs(a.out, exist_ok=True)
    modes = a.modes.split(",")
    rounds = []
    rng = random.Random(a.shuffle)
    block = []
    for i in range(a.pairs):
        if a.shuffle is None:
            order = modes[i % len(modes):] + modes[:i % len(modes)]
        else:
            block = block or balanced_block(rng, modes)
            order = block.pop()
        got = {}
        for j, mode in enumerate(order):
            p = subprocess.run([sys.executable, __file__, "--child", mode, "--bump", a.bump, "--steps", str(a.steps),
                                "--port", str(a.port + len(modes) * i + j), "--core", str(a.core),
                                "--model", a.model, "--batch", str(a.batch)] + (["--no-micro"] if a.no_micro else [])
                               + (["--old-lib", a.old_lib] if a.old_lib else []),
                               capture_output=True, text=True, timeout=600)
            line = next((l for l in p.stdout.splitlines() if l.startswith("ROW ")), None)
            if line is None:
                sys.exit(f"round {i} {mode} failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
            got[mode] = json.loads(line[4:])
            got[mode]["position"] = j  # where in the round it ran
        rounds.append(got)
        json.dump(rounds, open(os.path.join(a.out, "torch_global.json"), "w"))
        print(f"round {i}: " + "  ".join(
            f"{m} [{' '.join(f'{v:.2f}' for k, v in got[m].items() if isinstance(v, float))}] ({got[m]['phases s']})"
            for m in modes), flush=True)
    import torch

    keys = [k for k in rounds[0]["default"] if k not in ("mode", "loss", "phases s", "installed", "position") and not k.startswith(("train", "probe"))]
    if "train gpu ms" in rounds[0]["default"]:
        for m in modes:
            if "train gpu ms" in rounds[0][m]:
                print(f"train step GPU time (events) p50 ms per process, {m}: "
                      + " ".join(f"{r[m]['train gpu ms']:.2f}" for r in rounds))
    if "probe launch us" in rounds[0]["default"]:
        print("per process: step ms | Python loop ms before/after | launch us before/after | CPUs the loop ran on")
        for m in modes:
            for r in rounds:
                if "probe launch us" in r[m]:
                    x = r[m]
                    print(f"  {m:>8} {x['train step ms']:7.2f} | {x['probe py ms']:5.2f} {x['probe after py ms']:5.2f} | "
                          f"{x['probe launch us']:5.2f} {x['probe after launch us']:5.2f} | {x['train cpus']}")
    print(f"\nGlobal mode vs PyTorch's allocator vs the pluggable floor, {torch.cuda.get_device_name(0)}, torch "
          f"{torch.__version__}, {a.pairs} rounds of fresh processes (p50 over rounds; per-round differences)")
    print(f"{'row':>20} | {'default':>8} {'global':>8} {'floor':>8} | {'global-floor med / max':>23} | "
          f"{'global-default med':>18} | every round's global-floor")
    for k in keys:
        col = {m: [r[m][k] for r in rounds] for m in modes}
        gf = [g - f for g, f in zip(col["global"], col["floor"])]
        gd = [g - d for g, d in zip(col["global"], col["default"])]
        med = {m: statistics.median(v) for m, v in col.items()}
        extra = "".join(f"  {m} {med[m]:.2f}" for m in modes if m not in MODES)
        print(f"{k:>20} | {med['default']:8.2f} {med['global']:8.2f} {med['floor']:8.2f} | "
              f"{statistics.median(gf):+10.2f} / {max(gf):+10.2f} | {statistics.median(gd):+18.2f} | "
              + " ".join(f"{x:+.2f}" for x in gf) + extra)
    if "train step ms" in rounds[0]["default"]:
        tm = [m for m in modes if "train step ms" in rounds[0][m]]
        st = {m: statistics.median(r[m]["train step ms"] for r in rounds) for m in tm}
        mem = {m: statistics.median(r[m]["train used GiB"] for r in rounds) for m in tm}
        print(f"train step ({a.model}) p50 ms, median over rounds: "
              + ", ".join(f"{m} {st[m]:.2f} ({st[m] / st['default']:.3f}x)" for m in tm)
              + f"; installed: {rounds[0]['global'].get('installed')}")
        for m in tm:
            if m != "default":
                diffs = " ".join(f"{r[m]['train step ms'] / r['default']['train step ms']:.3f}" for r in rounds)
                slower = sum(r[m]["train step ms"] > r["default"]["train step ms"] for r in rounds)
                print(f"  {m} / default per round: {diffs} (slower in {slower} of {len(rounds)})")
        if "train pipelined ms" in rounds[0]["default"]:
            for k in ("train pipelined ms", "train enqueue ms"):
                med = {m: statistics.median(r[m][k] for r in rounds) for m in tm}
                print(f"{k[6:]} (median over rounds): "
                      + ", ".join(f"{m} {med[m]:.2f} ({med[m] / med['default']:.3f}x)" for m in tm))
                for m in tm:
                    print(f"  {m} per process: " + " ".join(f"{r[m][k]:.2f}" for r in rounds))
        print(f"train step: global / default = {st['global'] / st['default']:.3f} (target <= 1.00); "
              f"memory global / default = {mem['global'] / mem['default']:.3f} (target <= 0.97)")
        if "default-b" in tm or "floor-reuse" in tm:  # the A/A control: how far apart the harness
            # puts two equal allocators; the floor: how far under PyTorch's any allocator can go
            for m in [m for m in ("default-b", "global", "floor-reuse") if m in tm]:
                r = [x[m]["train step ms"] / x["default"]["train step ms"] for x in rounds]
                print(f"  per-pair {m} / default: median {statistics.median(r):.3f}, "
                      f"range {min(r):.3f}-{max(r):.3f}, slower in {sum(v > 1 for v in r)} of {len(r)}"
                      + {"default-b": " (the A/A control: the same allocator)",
                         "floor-reuse": " (the floor: exact-size stacks)"}.get(m, ""))
    for m in modes if keys and "floor" in modes else []:
        if m not in MODES:
            d = [r[m][k] - r["floor"][k] for r in rounds for k in keys if k.startswith("empty+del")]
            print(f"{m} - floor over every empty+del row and round: median {statistics.median(d):+.2f}, "
                  f"max {max(d):+.2f} us")
    if not keys or "floor" not in modes:
        return
    worst = max(r["global"][f"empty+del {n}"] - r["floor"][f"empty+del {n}"] for r in rounds for n in SIZES)
    print(f"empty+del: the worst round's global - floor = {worst:+.2f} us (target <= 0.2 in every round)")


if __name__ == "__main__":
    main()
