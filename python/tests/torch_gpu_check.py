"""GPU checks of the PyTorch integration, run by torchrun (one process per GPU):
    torchrun --nproc_per_node=2 python/tests/torch_gpu_check.py mempool|graph|global|scatter_gather
Each mode asserts and exits non-zero on failure. python/tests/test_torch_gpu.py drives it."""
import contextlib
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import symmalloc  # noqa: E402

TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def mempool(comm):
    pool = symmalloc.mem_pool()
    gen = torch.Generator(device="cuda").manual_seed(100 + comm.rank)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for n in (1, 7, 1000, 65_537, 1_000_003):
            with torch.cuda.use_mem_pool(pool):
                x = torch.randn(n, generator=gen, device="cuda").to(dtype)
            ref = x.clone()
            dist.all_reduce(ref)
            comm.all_reduce(x)
            torch.cuda.synchronize()
            e = rel(x, ref)
            assert e <= TOL[dtype], f"{dtype} n={n}: rel err {e}"
            for op, dop in (("max", dist.ReduceOp.MAX), ("min", dist.ReduceOp.MIN)):
                with torch.cuda.use_mem_pool(pool):
                    y = torch.randn(n, generator=gen, device="cuda").to(dtype)
                r = y.clone()
                dist.all_reduce(r, op=dop)
                comm.all_reduce(y, op=op)
                torch.cuda.synchronize()
                assert torch.equal(y, r), f"{dtype} n={n} {op} differs from NCCL"
    s = symmalloc.memory_stats(comm.device)
    assert s["staged_collectives"] == 0, s
    print(f"rank {comm.rank}: MemPool all-reduce matches NCCL (bf16/fp16/fp32, sum/max/min, odd sizes); {s}")


def graph(comm):
    pool = symmalloc.mem_pool()
    with torch.cuda.use_mem_pool(pool):
        static_in = torch.empty(4099, device="cuda", dtype=torch.bfloat16)
        work = torch.empty_like(static_in)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        work.copy_(static_in).mul_(2)
        comm.all_reduce(work)  # warm-up: shares the segment with the peers outside capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        work.copy_(static_in).mul_(2)
        comm.all_reduce(work)
    gen = torch.Generator(device="cuda").manual_seed(7 + comm.rank)
    for i in range(200):
        static_in.copy_(torch.randn(4099, generator=gen, device="cuda").to(torch.bfloat16))
        ref = static_in.float() * 2
        dist.all_reduce(ref)
        g.replay()
        torch.cuda.synchronize()
        e = rel(work, ref)
        assert e <= 1e-2, f"replay {i}: rel err {e}"
    print(f"rank {comm.rank}: 200 graph replays of a step with comm.all_reduce match NCCL")


def train(comm, use_symm, steps=100):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator(device="cuda").manual_seed(1000 + comm.rank)
    losses, after2 = [], None
    for step in range(steps):
        x = torch.randn(64, 256, generator=gen, device="cuda")
        y = torch.randint(0, 10, (64,), generator=gen, device="cuda")
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            if use_symm:
                comm.all_reduce(p.grad)
            else:
                dist.all_reduce(p.grad)
            p.grad.div_(comm.world_size)
        opt.step()
        losses.append(loss.item())
        if use_symm and step == 2:
            s = symmalloc.memory_stats(comm.device)
            after2 = (s["physical_creates"], s["peer_mappings"])
    if use_symm:
        s = symmalloc.memory_stats(comm.device)
        assert (s["physical_creates"], s["peer_mappings"]) == after2, f"new segments/mappings after step 2: {after2} -> {s}"
    return losses


def global_mode(comm):
    a = train(comm, True)
    b = train(comm, False)
    worst = max(abs(x - y) / max(abs(y), 1e-6) for x, y in zip(a, b))
    assert worst < 1e-3, f"loss curves differ: worst rel diff {worst}"
    print(f"rank {comm.rank}: global mode, 100 MLP steps; loss {a[0]:.4f} -> {a[-1]:.4f}, matches NCCL (worst rel diff {worst:.1e})")


def scatter_gather(comm):
    """comm.reduce_scatter / comm.all_gather against NCCL's reduce_scatter_tensor and
    all_gather_into_tensor: MemPool tensors, plain torch tensors (staged), odd sizes."""
    pool = symmalloc.mem_pool()
    world = dist.get_world_size()
    gen = torch.Generator(device="cuda").manual_seed(300 + comm.rank)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for n in (1, 7, 4096, 4099, 1 << 20, 1_000_003, (1 << 26) + 1) if dtype == torch.bfloat16 else (1, 7, 4096, 4099, 1 << 20, 1_000_003, 1 << 26):
            for pooled in (True, False):
                with torch.cuda.use_mem_pool(pool) if pooled else contextlib.nullcontext():
                    inp = torch.randn(world * n, generator=gen, device="cuda").to(dtype)
                    out = torch.full((n,), float("nan"), device="cuda", dtype=dtype)
                    small = torch.randn(n, generator=gen, device="cuda").to(dtype)
                    gathered = torch.full((world * n,), float("nan"), device="cuda", dtype=dtype)
                ref = torch.empty(n, device="cuda", dtype=torch.float32)
                dist.reduce_scatter_tensor(ref, inp.float())
                comm.reduce_scatter(out, inp)
                ref_g = torch.empty(world * n, device="cuda", dtype=dtype)
                dist.all_gather_into_tensor(ref_g, small)
                comm.all_gather(gathered, small)
                torch.cuda.synchronize()
                e = rel(out, ref)
                assert e <= TOL[dtype], f"reduce_scatter {dtype} n={n} pooled={pooled}: rel err {e}"
                assert torch.equal(gathered, ref_g), f"all_gather {dtype} n={n} pooled={pooled} differs from NCCL"
    print(f"rank {comm.rank}: reduce_scatter and all_gather match NCCL (bf16/fp16/fp32, counts 1 to 2^26+1, pooled and staged)")
    # The fused call against NCCL all-reduce + add + torch's rms_norm, in float32.
    for dtype in (torch.bfloat16, torch.float16):
        shapes = [(t, h) for h in (2048, 4096, 8192) for t in (1, 6, 138, 1024, 4096)] + [(6, 6144), (3, 16384)]
        for tokens, hidden in shapes:
            with torch.cuda.use_mem_pool(pool):
                x = torch.randn(tokens, hidden, generator=gen, device="cuda").to(dtype)
            residual = torch.randn(tokens, hidden, generator=gen, device="cuda").to(dtype)
            dist.broadcast(residual, 0)  # replicated, as in a model
            weight = (torch.rand(hidden, generator=gen, device="cuda") + 0.5).to(dtype)
            dist.broadcast(weight, 0)
            total = x.float()
            dist.all_reduce(total)
            r = total + residual.float()
            ref = torch.nn.functional.rms_norm(r, (hidden,), weight.float(), 1e-6)
            out = comm.all_reduce_add_rms_norm(x, residual, weight, eps=1e-6)
            torch.cuda.synchronize()
            assert rel(residual, r) <= TOL[dtype], f"fused residual {dtype} {tokens}x{hidden}: {rel(residual, r)}"
            assert rel(out, ref) <= TOL[dtype], f"fused out {dtype} {tokens}x{hidden}: {rel(out, ref)}"
    print(f"rank {comm.rank}: all_reduce_add_rms_norm matches NCCL + rms_norm (bf16/fp16, tokens 1-4096 x hidden 2048/4096/8192, 6x6144, 3x16384)")


def main():
    mode = sys.argv[1]
    rank = int(os.environ["LOCAL_RANK"])
    if mode == "global":
        symmalloc.install_global()  # before any CUDA allocation
    torch.cuda.set_device(rank)
    comm = symmalloc.Communicator.from_env()
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    {"mempool": mempool, "graph": graph, "global": global_mode, "scatter_gather": scatter_gather}[mode](comm)
    dist.barrier()
    comm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
