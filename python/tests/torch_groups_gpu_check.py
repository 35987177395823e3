"""Several communicators on one GPU through torch, in one process (a world of one rank and two
children by ``split``): each communicator's ``mem_pool()`` serves tensors from its arena (an
all-reduce on them stages nothing), a torch.compile'd function over two communicators has 0
graph breaks and runs in CUDA graphs, children keep working after the parent is closed, and a
closed communicator's pool refuses new memory. Run on a GPU machine:
    python3 python/tests/torch_groups_gpu_check.py
Exits non-zero on any failure."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import symmalloc  # noqa: E402
import symmalloc.ops as sops  # noqa: E402


def staged():
    return symmalloc.memory_stats(0)["staged_collectives"]


def main():
    torch.cuda.set_device(0)
    world = symmalloc.Communicator(0, 1, symmalloc.get_unique_id(), device=0)
    tp, ep = world.split(0), world.split(0, key=5)
    with torch.cuda.use_mem_pool(symmalloc.mem_pool()):
        junk = torch.empty(5 << 20, dtype=torch.uint8, device="cuda")  # device-level memory
    for name, c in (("world", world), ("tp", tp), ("ep", ep)):
        with torch.cuda.use_mem_pool(c.mem_pool()):
            x = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
        want = x.clone()
        before = staged()
        c.all_reduce(x)  # in place: nothing to stage when x is in the arena
        sops.all_reduce_(x, c)
        torch.cuda.synchronize()
        assert staged() == before, f"{name}: a MemPool tensor was staged (not in the arena)"
        assert torch.equal(x, want) and torch.equal(sops.all_reduce(x, c), want), name

    def step(x):
        return sops.all_reduce(sops.all_reduce(x * 2, tp) + 1, world)

    fn = torch.compile(step, fullgraph=True, mode="reduce-overhead")
    torch._dynamo.utils.counters.clear()
    for i in range(4):
        x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
        got = fn(x).clone()
        torch.cuda.synchronize()
        assert torch.equal(got, x * 2 + 1), f"step {i}"
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    assert dict(torch._dynamo.utils.counters["inductor"]).get("cudagraph_skips", 0) == 0
    pool = tp.mem_pool()
    world.close()
    x = torch.ones(1000, device="cuda", dtype=torch.float32)
    tp.all_reduce(x)
    ep.all_reduce(x)
    torch.cuda.synchronize()
    assert torch.all(x == 1)
    tp.close()
    try:
        with torch.cuda.use_mem_pool(pool):
            torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        raise AssertionError("a closed communicator's pool gave new memory")
    except torch.OutOfMemoryError:
        pass  # the slot's function refused: its communicator was destroyed
    ep.close()
    del junk
    print("torch groups on one GPU: mem_pool per communicator (nothing staged), 1 compiled graph over "
          "2 communicators in CUDA graphs with 0 graph breaks, children after the parent closed: ok")


if __name__ == "__main__":
    main()
