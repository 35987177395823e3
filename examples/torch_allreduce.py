"""symmalloc from PyTorch in MemPool mode. Run: torchrun --nproc_per_node=2 examples/torch_allreduce.py"""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
import symmalloc  # noqa: E402  (or: pip install ./python)

comm = symmalloc.Communicator.from_env()          # LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT
torch.cuda.set_device(comm.device)
dist.init_process_group("nccl")                    # only to compare with NCCL below

with torch.cuda.use_mem_pool(symmalloc.mem_pool()):  # these tensors live in the symmetric heap
    x = torch.randn(1 << 20, device="cuda", dtype=torch.bfloat16)

expected = x.float().clone()
dist.all_reduce(expected)
comm.all_reduce(x)                                 # in place, zero copy, on the current stream
torch.cuda.synchronize()

err = ((x.float() - expected).norm() / expected.norm()).item()
print(f"rank {comm.rank}: bf16 all-reduce of {x.numel()} elements, rel. error vs NCCL {err:.2e}")
print(f"rank {comm.rank}: stats {symmalloc.memory_stats(comm.device)}")
assert err < 1e-2
comm.close()
dist.destroy_process_group()
