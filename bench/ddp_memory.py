"""Device memory of a real DDP training run with symmalloc as PyTorch's global allocator, against
PyTorch's own allocator on the same run (the allocator's first target under real load).

    python3 bench/ddp_memory.py [--steps 120] [--out DIR]      (2 GPUs)

Two jobs, one after the other, each 2 processes (one per GPU) with NCCL DDP: a 6-layer
transformer encoder (d_model 1024, 16 heads, ff 4096), bf16 autocast, AdamW, batch 8 and a
sequence length drawn per step from 64..512 (the same draws in both jobs), 120 steps. The only
difference: the second job calls symmalloc.install_global() before CUDA allocates anything.
Per job and rank: the driver's used-memory figure after setup (model and DDP built) and at its
highest (sampled after every step),
peak reserved and peak allocated as the allocator reports them, the losses, the step time.
For symmalloc also where its reserved memory goes at the end: requested bytes, rounding
(allocated - requested), cached (reserved - allocated), segments.

    --rounds R    R pairs of jobs, alternating (torch, symmalloc, torch, ...), each in fresh
                  processes: the step-time and memory ratios per round, so a claim holds across
                  processes and not in one pair
    --compile     the DDP model under torch.compile(mode="reduce-overhead") (CUDA graphs, the
                  step marked with torch.compiler.cudagraph_mark_step_begin), at one sequence
                  length (--seq, default 256: every new shape would be a new graph); the losses
                  of the two allocators are compared bit for bit
"""
import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
GIB = float(1 << 30)


def worker(rank, world, alloc, steps, port, out, tag="", compiled=False, seq_len=0):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch

    if alloc == "symmalloc":
        import symmalloc

        symmalloc.install_global()  # before any CUDA use, torch.cuda.set_device included
    torch.cuda.set_device(rank)
    import torch.distributed as dist
    import torch.nn as nn

    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(1024, 16, 4096, batch_first=True, dropout=0.0)
    model = nn.TransformerEncoder(layer, 6).cuda()
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[rank])
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    run = torch.compile(ddp, mode="reduce-overhead") if compiled else ddp
    lengths = torch.randint(64, 513, (steps,), generator=torch.Generator().manual_seed(1)).tolist()
    if seq_len:
        lengths = [seq_len] * steps
    gen = torch.Generator(device="cuda").manual_seed(100 + rank)
    total = torch.cuda.mem_get_info()[1]
    used_setup = total - torch.cuda.mem_get_info()[0]  # context, NCCL, model, DDP buckets
    symm_stats = None
    if alloc == "symmalloc":
        import symmalloc

        symm_stats = lambda: symmalloc.memory_stats(rank)  # noqa: E731
    used_peak, reserved_peak, losses, times = 0, 0, [], []
    for step, seq in enumerate(lengths):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        x = torch.randn(8, seq, 1024, device="cuda", generator=gen)
        if compiled:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = run(x)
            loss = (y.float() - x).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        used_peak = max(used_peak, total - torch.cuda.mem_get_info()[0])
        if symm_stats is not None:
            reserved_peak = max(reserved_peak, symm_stats()["reserved_bytes"])
    row = {"alloc": alloc, "rank": rank, "tag": tag, "used_peak": used_peak, "used_setup": used_setup, "losses": losses,
           "step_ms": sorted(times[10:])[len(times[10:]) // 2]}
    if alloc == "symmalloc":
        import symmalloc

        s = symmalloc.memory_stats(rank)
        row.update(peak_allocated=s["peak_allocated_bytes"], reserved_end=s["reserved_bytes"],
                   allocated_end=s["allocated_bytes"], requested_end=s["requested_bytes"], segments=s["segments"],
                   reserved_peak=reserved_peak, releases=s["physical_releases"])
    else:
        row.update(peak_allocated=torch.cuda.max_memory_allocated(), reserved_peak=torch.cuda.max_memory_reserved(),
                   reserved_end=torch.cuda.memory_reserved(), allocated_end=torch.cuda.memory_allocated(),
                   segments=torch.cuda.memory_stats().get("segment.all.current"))
    with open(os.path.join(out, f"ddp_{alloc}{tag}_{rank}.json"), "w") as f:
        json.dump(row, f)
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--rounds", type=int, default=1, help="pairs of jobs, alternating torch and symmalloc")
    ap.add_argument("--compile", action="store_true", help='torch.compile(mode="reduce-overhead") over DDP')
    ap.add_argument("--seq", type=int, default=None, help="one sequence length (default: 64-512 drawn; 256 with --compile)")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    a = ap.parse_args()
    seq_len = a.seq if a.seq is not None else (256 if a.compile else 0)
    for k, v in NO_MULTICAST.items():
        os.environ[k] = v  # multicast stays off, here and in every child
    os.environ.pop("SYMMALLOC_ENABLE_MULTICAST", None)
    os.makedirs(a.out, exist_ok=True)
    import torch
    import torch.multiprocessing as mp

    world = 2
    if torch.cuda.device_count() < world:
        sys.exit(f"needs {world} GPUs, found {torch.cuda.device_count()}")
    rows, port = [], 29700
    for rnd in range(a.rounds):
        for alloc in ["torch", "symmalloc"]:
            tag = f"_r{rnd}" + ("_compiled" if a.compile else "")
            mp.spawn(worker, args=(world, alloc, a.steps, port, a.out, tag, a.compile, seq_len), nprocs=world)
            port += 1
            for r in range(world):
                row = json.load(open(os.path.join(a.out, f"ddp_{alloc}{tag}_{r}.json")))
                row["round"] = rnd
                rows.append(row)
    seq = f"seq {seq_len}" if seq_len else "seq 64-512"
    print(f"DDP, 6-layer transformer d_model 1024, bf16 autocast, batch 8, {seq}, {a.steps} steps, "
          f"{'torch.compile reduce-overhead, ' if a.compile else ''}{a.rounds} round(s) alternating, "
          f"{world}x {torch.cuda.get_device_name(0)}, torch {torch.__version__}; GiB")
    print(f"{'round':>5} {'allocator':>10} {'rank':>4} | {'used after setup':>16} | {'driver used peak':>16} | {'peak reserved':>13} | "
          f"{'peak allocated':>14} | {'end reserved':>12} {'end allocated':>13} | segments | loss first -> last | step ms")
    g = lambda v: f"{v / GIB:.3f}" if v is not None else "n/a"  # noqa: E731
    for r in rows:
        print(f"{r['round']:>5} {r['alloc']:>10} {r['rank']:>4} | {g(r['used_setup']):>16} | {g(r['used_peak']):>16} | "
              f"{g(r['reserved_peak']):>13} | {g(r['peak_allocated']):>14} | {g(r['reserved_end']):>12} "
              f"{g(r['allocated_end']):>13} | {r['segments']!s:>8} | {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f} | "
              f"{r['step_ms']:.1f}")
    for rank in range(world):
        steps, mems, worst, same = [], [], 0.0, 0
        for rnd in range(a.rounds):
            t = next(r for r in rows if r["alloc"] == "torch" and r["rank"] == rank and r["round"] == rnd)
            s = next(r for r in rows if r["alloc"] == "symmalloc" and r["rank"] == rank and r["round"] == rnd)
            steps.append(s["step_ms"] / t["step_ms"])
            mems.append(s["used_peak"] / t["used_peak"])
            worst = max([worst] + [abs(x - y) / max(abs(y), 1e-6) for x, y in zip(s["losses"], t["losses"])])
            same += s["losses"] == t["losses"]
        print(f"rank {rank}: symmalloc / torch, per round: step p50 {', '.join(f'{v:.3f}' for v in steps)} "
              f"(target <= 1.00); driver used peak {', '.join(f'{v:.3f}' for v in mems)} (target <= 1.00); "
              f"losses bit for bit equal in {same} of {a.rounds} round(s), at most {worst:.1e} apart (relative); "
              f"symmalloc at the end: requested {g(s['requested_end'])}, rounding "
              f"{g(s['allocated_end'] - s['requested_end'])}, cached {g(s['reserved_end'] - s['allocated_end'])}, "
              f"segments released {s['releases']}")


if __name__ == "__main__":
    main()
