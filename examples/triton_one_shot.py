"""One-shot all-reduce in Triton over symmalloc's symmetric memory (h.buffer_ptrs, h.signal_pad_ptrs):
signal ready, wait, sum in rank order, signal done. Device epochs: graph-safe. torchrun --nproc_per_node=2"""
import torch
import triton
import triton.language as tl

import symmalloc


@triton.jit
def _signal_all(pads, ranks, slot, value, WORLD: tl.constexpr):
    peer_pads = tl.load(pads + ranks, mask=ranks < WORLD, other=0).to(tl.pointer_type(tl.int64))
    tl.atomic_xchg(peer_pads + slot, value, mask=ranks < WORLD, sem="release", scope="sys")


@triton.jit
def _wait_all(pads, rank, slot0, value, WORLD: tl.constexpr):  # bounded by a spin count
    mine = tl.load(pads + rank).to(tl.pointer_type(tl.int64)) + slot0
    for r in tl.static_range(WORLD):
        spins = 0
        while (tl.atomic_add(mine + r, 0, sem="acquire", scope="sys") < value) & (spins < 100_000_000):
            spins += 1
    tl.debug_barrier()  # the program's other threads see what the peers wrote before signalling


@triton.jit  # slots of program p: 16p + r "input ready from rank r", 16p + 8 + r "rank r done reading"
def one_shot_sum(bufs, pads, out, epochs, n, rank, WORLD: tl.constexpr, R: tl.constexpr, BLOCK: tl.constexpr):
    pid, ranks = tl.program_id(0), tl.arange(0, R)
    e = tl.load(epochs + pid) + 1
    ready, done = pid * 16, pid * 16 + 8
    _signal_all(pads, ranks, ready + rank, 2 * e - 1, WORLD)
    _wait_all(pads, rank, ready, 2 * e - 1, WORLD)
    for start in range(pid * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], tl.float32)
        for r in tl.static_range(WORLD):  # rank order: every rank gets the same bits
            acc += tl.load(tl.load(bufs + r).to(tl.pointer_type(tl.float32)) + offs, mask=offs < n)
        tl.store(out + offs, acc, mask=offs < n)
    tl.debug_barrier()  # every read of the peers' inputs before "done"
    _signal_all(pads, ranks, done + rank, 2 * e, WORLD)
    _wait_all(pads, rank, done, 2 * e, WORLD)
    tl.store(epochs + pid, e)


def all_reduce(h, out, epochs):
    """out = the sum of every rank's h.tensor (float32); epochs: int64 zeros, one per program."""
    one_shot_sum[(epochs.numel(),)](h.buffer_ptrs, h.signal_pad_ptrs, out, epochs, out.numel(), h.rank,
                                    WORLD=h.world_size, R=triton.next_power_of_2(h.world_size), BLOCK=1024)


if __name__ == "__main__":
    comm = symmalloc.Communicator.from_env()
    torch.cuda.set_device(comm.device)
    with torch.cuda.use_mem_pool(symmalloc.mem_pool()):
        x = torch.full((1 << 20,), float(comm.rank + 1), device="cuda")
    h, out, epochs = comm.rendezvous(x), torch.empty_like(x), torch.zeros(32, dtype=torch.int64, device="cuda")
    all_reduce(h, out, epochs)
    assert out.eq(comm.world_size * (comm.world_size + 1) / 2).all().item()
    print(f"rank {comm.rank}: Triton one-shot all-reduce correct")
