"""torch.compile over symmalloc's custom ops, run by torchrun (one process per rank):
    torchrun --nproc_per_node=2 python/tests/torch_compile_check.py
On GPUs (NCCL as the reference, bf16) or, with SYMMALLOC_BACKEND=host and no CUDA, on CPU
tensors over the host backend (gloo as the reference). A tensor-parallel block (column-
then row-parallel MLP, all-reduce, residual add + RMSNorm, and a sequence-parallel
reduce-scatter / all-gather pair) runs eager, compiled with fullgraph=True, and compiled with
mode="reduce-overhead" (CUDA graphs, GPU only); every output is compared with the same block
using torch.distributed, zero graph breaks are asserted. The communicator comes from
Communicator.from_process_group. Exits non-zero on any failure."""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import symmalloc  # noqa: E402
import symmalloc.ops as sops  # noqa: E402


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def main():
    cuda = torch.cuda.is_available() and os.environ.get("SYMMALLOC_BACKEND") != "host"
    local = int(os.environ["LOCAL_RANK"])
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = symmalloc.Communicator.from_process_group()
    assert (comm.rank, comm.world_size) == (rank, world), (comm.rank, comm.world_size)
    dev, dtype, tol = ("cuda" if cuda else "cpu"), torch.bfloat16, 2e-2
    tokens, hidden, ffn = 8 * world, 512, 1024
    g = torch.Generator(device="cpu").manual_seed(7)  # the same full weights on every rank
    w1 = (torch.randn(hidden, ffn, generator=g) / hidden**0.5).to(dev, dtype)
    w2 = (torch.randn(ffn, hidden, generator=g) / ffn**0.5).to(dev, dtype)
    ln = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dev, dtype)
    shard = ffn // world
    w1s, w2s = w1[:, rank * shard:(rank + 1) * shard].contiguous(), w2[rank * shard:(rank + 1) * shard].contiguous()

    def block(x, residual):
        partial = F.gelu(x @ w1s) @ w2s                     # row-parallel output, per rank
        summed = sops.all_reduce(partial, comm)
        res = residual + 0                                   # the fused op updates it in place
        normed = sops.all_reduce_add_rms_norm(partial, res, ln, comm, eps=1e-6)
        sp = sops.all_gather(sops.reduce_scatter(partial, comm), comm)   # sequence parallel
        inplace = partial * 1
        sops.all_reduce_(inplace, comm, op="max")
        return summed, normed, res, sp, inplace

    def reference(x, residual):
        partial = F.gelu(x @ w1s) @ w2s
        summed = partial.clone()
        dist.all_reduce(summed)
        res = (residual.float() + summed.float())
        normed = F.rms_norm(res, (hidden,), ln.float(), eps=1e-6).to(dtype)
        mx = partial.clone()
        dist.all_reduce(mx, op=dist.ReduceOp.MAX)
        return summed, normed, res.to(dtype), summed, mx

    names = ("all_reduce", "add_rms_norm out", "add_rms_norm residual", "reduce_scatter+all_gather", "all_reduce_ max")
    modes = [("eager", block), ("compiled", torch.compile(block, fullgraph=True))]
    if cuda:
        modes.append(("compiled+cudagraphs", torch.compile(block, fullgraph=True, mode="reduce-overhead")))
    torch._dynamo.utils.counters.clear()
    for mode, fn in modes:
        for step in range(4):  # fresh data each step; cudagraph trees record on step 2 and replay after
            gx = torch.Generator(device="cpu").manual_seed(1000 * step + 1)
            x = torch.randn(tokens, hidden, generator=gx).to(dev, dtype)           # replicated
            residual = torch.randn(tokens, hidden, generator=gx).to(dev, dtype)
            want = reference(x, residual)
            got = [t.clone() for t in fn(x, residual)]
            if cuda:
                torch.cuda.synchronize()
            for name, a, b in zip(names, got, want):
                assert a.shape == b.shape and a.dtype == b.dtype, f"{mode} {name}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
                e = rel(a, b)
                assert e <= tol, f"rank {rank} {mode} step {step} {name}: rel err {e} > {tol}"
            for t in got:  # every rank holds the same bytes
                other = t.clone()
                dist.broadcast(other, src=0)
                assert torch.equal(t, other), f"rank {rank} {mode}: ranks differ"
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    assert breaks == 0, dict(torch._dynamo.utils.counters["graph_break"])
    explained = torch._dynamo.explain(block)(x, residual)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained
    skips = dict(torch._dynamo.utils.counters["inductor"])
    if cuda:
        assert skips.get("cudagraph_skips", 0) == 0, f"reduce-overhead did not use CUDA graphs: {skips}"
    dist.barrier()
    comm.close()
    peer = "NCCL" if cuda else "gloo, host backend"
    print(f"rank {rank}: {', '.join(m for m, _ in modes)} match torch.distributed ({peer}, bf16), "
          f"0 graph breaks, {explained.graph_count} graph, ops {', '.join(names)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
