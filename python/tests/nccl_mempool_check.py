"""NCCL's user-buffer registration over a MemPool with an allocator of its own (the device
machine, ONE GPU; not collected by pytest), as PyTorch's test_nccl_user_buffer_registration does:
a MemPool over ProcessGroupNCCL's ``mem_allocator`` (ncclMemAlloc), a tensor made in it,
``register_mem_pool`` (which registers every segment the pool's snapshot lists), an all-reduce,
``deregister_mem_pool``. Run under symmalloc's global mode and PyTorch's allocator: the pool's
snapshot must list the tensor's segment under both, and NCCL's registration lines
(NCCL_DEBUG_SUBSYS=REG) must be as many under both.

    python python/tests/nccl_mempool_check.py symmalloc|torch|both

Prints ``PASS nccl_mempool (...)`` or ``FAIL nccl_mempool (...)`` lines; exit code 1 on failure.
NVLS stays off (NCCL_NVLS_ENABLE=0 from the device environment)."""

import os
import subprocess
import sys
import tempfile


def one(which, log):
    os.environ.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="REG", NCCL_DEBUG_FILE=log)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    if which == "symmalloc":
        import symmalloc

        symmalloc.install_global(allocator="cpp")
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        print(f"SKIP nccl_mempool ({which}): no CUDA device")
        return 0
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    pg = dist.group.WORLD
    backend = pg._get_backend(torch.device("cuda", 0))
    pool = torch.cuda.MemPool(backend.mem_allocator)
    with torch.cuda.use_mem_pool(pool):
        t = torch.arange(2 * 1024 * 1024, device="cuda", dtype=torch.float32)
    segs = pool.snapshot()
    addr = t.data_ptr()
    covered = any(s["address"] <= addr < s["address"] + s["total_size"] for s in segs)
    backend.register_mem_pool(pool)
    dist.all_reduce(t)
    torch.cuda.synchronize()
    ok_val = bool((t[:5] == torch.arange(5, device="cuda", dtype=torch.float32)).all())
    backend.deregister_mem_pool(pool)
    del t
    dist.destroy_process_group()
    print(f"RESULT {which} segments={len(segs)} covered={covered} allreduce_ok={ok_val}", flush=True)
    return 0 if (covered and ok_val and segs) else 1


def main(argv):
    which = argv[1] if len(argv) > 1 else "both"
    if which in ("symmalloc", "torch") and len(argv) > 2:
        return one(which, argv[2])
    if which not in ("symmalloc", "torch", "both"):
        print(f"usage: {argv[0]} symmalloc|torch|both")
        return 2
    regs, fails = {}, 0
    for w in (["symmalloc", "torch"] if which == "both" else [which]):
        with tempfile.NamedTemporaryFile("r", suffix=".log") as f:
            p = subprocess.run([sys.executable, argv[0], w, f.name], capture_output=True, text=True, timeout=240)
            out = p.stdout + p.stderr
            lines = [line for line in open(f.name, errors="replace") if "REG" in line or "egister" in line]
        res = [line for line in out.splitlines() if line.startswith(("RESULT", "SKIP"))]
        regs[w] = len(lines)
        ok = p.returncode == 0 and any(r.startswith("RESULT") for r in res)
        fails += not ok
        print(f"{'PASS' if ok else 'FAIL'} nccl_mempool ({w}): {res[-1] if res else out[-600:]}; "
              f"{len(lines)} NCCL registration lines", flush=True)
        for line in lines[:4]:
            print("   ", line.rstrip())
    if which == "both":
        same = regs["symmalloc"] == regs["torch"]
        fails += not same
        print(f"{'PASS' if same else 'FAIL'} nccl_mempool: registration lines symmalloc {regs['symmalloc']}, "
              f"PyTorch's allocator {regs['torch']}", flush=True)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
