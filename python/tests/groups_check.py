"""Several groups through torch.distributed, run by torchrun with 4 processes:
    torchrun --nproc_per_node=4 python/tests/groups_check.py
On GPUs (NCCL as the reference; ranks may share GPUs with SYMMALLOC_SHARED_GPU=1) or, with
SYMMALLOC_BACKEND=host and no CUDA, on CPU tensors over the host backend (gloo). The world
communicator, TP pairs from ``dist.new_subgroups`` and EP halves from
``dist.new_subgroups_by_enumeration`` (``Communicator.from_process_group`` on each), and TP
pairs again by ``comm.split``: every custom op on each is compared with torch.distributed on
the same group; a torch.compile'd function that uses a TP and the world communicator in one
graph has 0 graph breaks (and, on GPUs, runs in CUDA graphs); on GPUs each communicator's
``mem_pool()`` places the same allocations at the same offsets on its ranks although every rank
allocates other memory first (an all-reduce on them passes the symmetry check). Exits non-zero on any failure."""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import symmalloc  # noqa: E402
import symmalloc.ops as sops  # noqa: E402


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def main():
    cuda = torch.cuda.is_available() and os.environ.get("SYMMALLOC_BACKEND") != "host"
    local = int(os.environ["LOCAL_RANK"])
    if cuda:
        torch.cuda.set_device(local % torch.cuda.device_count())
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 4, "run with 4 processes"
    dev, dtype = ("cuda" if cuda else "cpu"), torch.bfloat16
    tp_pg, _ = dist.new_subgroups(2)
    ep_pgs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    ep_pg = ep_pgs[rank % 2]
    wcomm = symmalloc.Communicator.from_process_group()
    tcomm = symmalloc.Communicator.from_process_group(tp_pg)
    ecomm = symmalloc.Communicator.from_process_group(ep_pg)
    scomm = wcomm.split(rank // 2)  # the TP pairs again, by split
    assert (tcomm.rank, tcomm.world_size) == (scomm.rank, scomm.world_size) == (rank % 2, 2)
    assert (ecomm.rank, ecomm.world_size) == (rank // 2, 2)
    groups = [("world", wcomm, None), ("tp", tcomm, tp_pg), ("ep", ecomm, ep_pg), ("tp-split", scomm, tp_pg)]
    for step in range(3):
        for name, comm, pg in groups:
            g = torch.Generator(device="cpu").manual_seed(1000 * step + 17 * rank + len(name))
            n = comm.world_size
            x = torch.randn(8 * n, 256, generator=g).to(dev, dtype)
            want = x.clone()
            dist.all_reduce(want, group=pg)
            got = sops.all_reduce(x, comm)
            assert rel(got, want) <= 2e-2, f"rank {rank} {name}: all_reduce"
            rs = sops.reduce_scatter(x, comm)
            rs_want = want.chunk(n)[comm.rank]
            assert rel(rs, rs_want) <= 2e-2, f"rank {rank} {name}: reduce_scatter"
            ag = sops.all_gather(rs, comm)
            ag_want = torch.empty_like(x)
            dist.all_gather_into_tensor(ag_want, rs, group=pg)
            assert torch.equal(ag, ag_want), f"rank {rank} {name}: all_gather"

    # One compiled graph over two communicators.
    def step_fn(x):
        y = sops.all_reduce(x * 2, tcomm)
        return sops.all_reduce(y + 1, wcomm)

    torch._dynamo.utils.counters.clear()
    modes = [("compiled", torch.compile(step_fn, fullgraph=True))]
    if cuda:
        modes.append(("compiled+cudagraphs", torch.compile(step_fn, fullgraph=True, mode="reduce-overhead")))
    for mode, fn in modes:
        for step in range(4):
            g = torch.Generator(device="cpu").manual_seed(5000 + 10 * step + rank)
            x = torch.randn(64, 128, generator=g).to(dev, dtype)
            want = x * 2
            dist.all_reduce(want, group=tp_pg)
            want = want + 1
            dist.all_reduce(want)
            got = fn(x).clone()
            if cuda:
                torch.cuda.synchronize()
            assert rel(got, want) <= 3e-2, f"rank {rank} {mode} step {step}: {rel(got, want)}"
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    assert breaks == 0, dict(torch._dynamo.utils.counters["graph_break"])
    explained = torch._dynamo.explain(step_fn)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained
    if cuda:
        skips = dict(torch._dynamo.utils.counters["inductor"])
        assert skips.get("cudagraph_skips", 0) == 0, f"reduce-overhead did not use CUDA graphs: {skips}"

    pools = "no MemPool (CPU)"
    if cuda:
        # Each rank first allocates device-level symmalloc memory of its own size; the pools'
        # tensors still sit at one offset on their communicator's ranks: an all-reduce on them
        # passes the library's symmetry check (SYMM_ERR_NOT_SYMMETRIC otherwise).
        with torch.cuda.use_mem_pool(symmalloc.mem_pool()):
            junk = torch.empty((rank + 1) * (3 << 20), dtype=torch.uint8, device=dev)
        for name, comm, pg in groups:
            with torch.cuda.use_mem_pool(comm.mem_pool()):
                a = torch.empty(3 << 20, dtype=torch.uint8, device=dev)
                b = torch.empty(1000 * (1 + len(name)), dtype=torch.bfloat16, device=dev)
            b.fill_(1.0)
            a.fill_(2)
            comm.all_reduce(b)
            torch.cuda.synchronize()
            assert torch.all(b == comm.world_size), f"rank {rank} {name}: all-reduce on pool memory"
            del a, b
        del junk
        pools = "all-reduces on every group's MemPool memory"
    dist.barrier()
    wcomm.close()  # the children and the other groups keep working
    for name, comm, pg in groups[1:]:
        x = torch.ones(4, 8, device=dev, dtype=dtype)
        comm.all_reduce(x)
        if cuda:
            torch.cuda.synchronize()
        assert torch.all(x == comm.world_size), f"rank {rank} {name} after the world closed"
        comm.close()
    peer = "NCCL" if cuda else "gloo, host backend"
    print(f"rank {rank}: world, tp, ep, tp-split match torch.distributed ({peer}); "
          f"{', '.join(m for m, _ in modes)}: 0 graph breaks, 1 graph over 2 communicators; {pools}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
