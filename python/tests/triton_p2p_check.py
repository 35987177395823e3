"""Symmetric memory from Python on GPUs (the device machine; not collected by pytest): N ranks,
one process each, sharing the machine's GPUs (SYMMALLOC_SHARED_GPU=1 when N > GPUs).

1. ``comm.rendezvous`` of a MemPool tensor; ``h.peer_tensor(r)`` reads rank r's data;
2. ``comm.put/signal/wait`` around a ring on the current stream, and the same through the
   ``symmalloc::put_/signal_/wait_`` custom ops captured in a torch CUDA graph;
3. the Triton one-shot all-reduce of examples/triton_one_shot.py over ``h.buffer_ptrs`` and
   ``h.signal_pad_ptrs``, eager and over replays of a captured graph, on fresh random data each
   time (output poisoned first), against a float64 reference, and bitwise equal on every rank.

    python python/tests/triton_p2p_check.py --world 2 4 8
"""
import argparse
import importlib.util
import os
import sys
import traceback

import torch
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
import symmalloc  # noqa: E402
import symmalloc.ops as sops  # noqa: E402

_spec = importlib.util.spec_from_file_location("triton_one_shot", os.path.join(HERE, "..", "..", "examples", "triton_one_shot.py"))
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)

N = (1 << 20) + 5


def data(seed, rank, n=N):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    return torch.randn(n, generator=g, dtype=torch.float32) * 4


def check(what, got, world, seed):
    ref = sum(data(seed, r).double() for r in range(world))
    g = got.double().cpu()
    assert torch.isfinite(g).all(), f"{what}: elements not written"
    err = ((g - ref).norm() / ref.norm()).item()
    assert err < 1e-6, f"{what}: relative error {err:.3g}"
    # A position-weighted checksum of the bits (no numpy needed): equal on every rank.
    bits = got.view(torch.int32).long()
    return int((bits * torch.arange(1, bits.numel() + 1, device=bits.device)).sum().item())


def rank_main(rank, world, uid, q):
    try:
        gpus = torch.cuda.device_count()
        dev = rank % gpus
        torch.cuda.set_device(dev)
        comm = symmalloc.Communicator(rank, world, uid, device=dev)
        with torch.cuda.use_mem_pool(symmalloc.mem_pool(dev)):
            x = torch.empty(N, device="cuda")
            ring = torch.empty(world, 4096, device="cuda")
        h = comm.rendezvous(x)
        hr = comm.rendezvous(ring)
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        # 1. peer views
        x.copy_(data(1, rank))
        comm.barrier()
        torch.cuda.synchronize()
        for r in range(world):
            assert torch.equal(h.peer_tensor(r).cpu(), data(1, r)), f"peer_tensor({r})"
        assert h.buffer_ptrs.is_cuda and h.buffer_ptrs.dtype == torch.int64 and h.signal_pad_ptrs.numel() == world
        comm.barrier()
        torch.cuda.synchronize()
        # 2. put/signal/wait around the ring (slots 200+r; ack on 300+r), eager then captured
        src = torch.empty(4096, device="cuda")
        for k in range(1, 6):
            src.copy_(data(k, rank, 4096))
            comm.put(src, nxt, ring[rank])
            comm.signal(nxt, 200 + rank, k)
            comm.wait(200 + prv, k)
            assert torch.equal(ring[prv].cpu(), data(k, prv, 4096)), f"ring round {k}"
            comm.signal(prv, 300 + rank, k)
            comm.wait(300 + nxt, k)
        g = torch.cuda.CUDAGraph()
        src.copy_(data(99, rank, 4096))
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            sops.put_(src, ring[rank], nxt, comm)
            sops.signal_(ring[rank], nxt, 200 + rank, 99, comm)
            sops.wait_(ring[prv], 200 + prv, 99, comm)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(ring[prv].cpu(), data(99, prv, 4096)), "captured ring round"
        comm.barrier()
        torch.cuda.synchronize()
        # 3. the Triton one-shot all-reduce: eager, then replays of a captured graph
        out = torch.empty_like(x)
        epochs = torch.zeros(32, dtype=torch.int64, device="cuda")
        hashes = []
        x.copy_(data(10, rank))
        out.fill_(float("nan"))
        example.all_reduce(h, out, epochs)
        torch.cuda.synchronize()
        hashes.append(check("eager", out, world, 10))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            example.all_reduce(h, out, epochs)
        for seed in (11, 12, 13):
            x.copy_(data(seed, rank))
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            hashes.append(check(f"graph replay {seed}", out, world, seed))
        comm.barrier()  # a timed-out library wait would be reported here
        torch.cuda.synchronize()
        comm.close()
        q.put((rank, hashes, None))
    except Exception:
        q.put((rank, None, traceback.format_exc()))


def run(world):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    uid = symmalloc.get_unique_id()
    if world > torch.cuda.device_count():
        os.environ["SYMMALLOC_SHARED_GPU"] = "1"
    procs = [ctx.Process(target=rank_main, args=(r, world, uid, q)) for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    for _ in procs:
        rank, hashes, failure = q.get(timeout=600)
        assert failure is None, f"world {world} rank {rank}:\n{failure}"
        got[rank] = hashes
    for p in procs:
        p.join(60)
        assert p.exitcode == 0, f"rank exit code {p.exitcode}"
    assert all(got[r] == got[0] for r in got), f"ranks differ bitwise: {got}"
    print(f"world {world}: peer views, ring (eager and captured custom ops), Triton one-shot all-reduce "
          f"eager + 3 graph replays correct vs float64 and bitwise equal on every rank", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, nargs="+", default=[2])
    for w in ap.parse_args().world:
        run(w)
