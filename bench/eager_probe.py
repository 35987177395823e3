"""Where an eager all-reduce from Python spends its host time (the eager call's latency target).

    python3 bench/eager_probe.py        (2 GPUs; starts one process per GPU)

Host time per call (time.perf_counter over 20 back-to-back calls, median of 200 repetitions,
both ranks in step), 8 KiB bf16 AUTO in place, for:
  torch_prep   the torch attribute calls the wrapper makes (is_contiguous, data_ptr, numel,
               get_device, the current stream), without calling the library
  fastcall     symmalloc._fastcall.all_reduce with those values precomputed: the library's own
               host path plus the compiled caller
  ctypes       the same through the ctypes function object
  method       the Python method Communicator.all_reduce (what users called until 7511c6d)
  caller       comm.all_reduce: the compiled caller (symmalloc._fastcall.eager) when built,
               which reads the tensor in C and falls back to the method for anything unusual
The C ABI's eager time for the same call comes from bench/allreduce_c.rs.
"""
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import symmalloc  # noqa: E402

CALLS, REPS = 20, 200


def host_time(fn):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPS):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(CALLS):
            fn()
        times.append((time.perf_counter() - t0) * 1e6 / CALLS)
    torch.cuda.synchronize()
    return statistics.median(times)


def worker(rank, world):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29591", RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    comm = symmalloc.Communicator.from_process_group()
    with torch.cuda.use_mem_pool(symmalloc.mem_pool()):
        x = torch.randn(4096, device="cuda").to(torch.bfloat16)
    side = torch.cuda.Stream()
    raw = torch._C._cuda_getCurrentRawStream
    fast = comm._fast
    lib_fn = comm._all_reduce
    with torch.cuda.stream(side):
        stream = raw(rank)
        ptr, n, handle = x.data_ptr(), x.numel(), comm._comm.value
        vp = ctypes_voidp = __import__("ctypes").c_void_p
        probes = {
            "torch_prep": lambda: (x.is_contiguous(), x.data_ptr(), x.numel(), x.get_device(), raw(rank)),
            "ctypes": lambda: lib_fn(comm._comm, 0, vp(ptr), vp(ptr), __import__("ctypes").c_size_t(n), 0, 0, ctypes_voidp(stream)),
            "method": lambda: symmalloc.Communicator.all_reduce(comm, x),
            "caller": lambda: comm.all_reduce(x),
        }
        if fast is not None:
            probes["fastcall"] = lambda: fast(handle, 0, ptr, ptr, n, 0, 0, stream)
        got = {name: host_time(fn) for name, fn in probes.items()}
    if rank == 0:
        print(f"host us per call, 8 KiB bf16 AUTO in place, {world}x {torch.cuda.get_device_name()}: "
              + "  ".join(f"{k} {v:.2f}" for k, v in got.items()), flush=True)
    comm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    for k, v in [("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")]:
        os.environ[k] = v
    os.environ.pop("SYMMALLOC_ENABLE_MULTICAST", None)
    mp.spawn(worker, args=(2,), nprocs=2)
