"""All-reduce across two processes on host memory (the host backend): runs on any machine, with
no GPU and no torch. Each rank fills a symmetric buffer with (rank + 1) * (i % 7), all-reduces it
in place and checks every element.

    pip install ./python && python examples/python/allreduce_host.py
    # or, in a checkout after `make`:
    SYMMALLOC_LIBRARY_DIR=target/release PYTHONPATH=python python3 examples/python/allreduce_host.py

On GPUs the same calls take torch CUDA tensors (the README's GPU start).
"""
import ctypes
import multiprocessing as mp
import os
import sys

# Every process of this example runs on host memory (set before any rank starts).
os.environ["SYMMALLOC_BACKEND"] = "host"

import symmalloc  # noqa: E402

WORLD, N = 2, 1 << 16


class HostBuffer:
    """A float32 buffer of symmetric host memory, with what Communicator.all_reduce reads of a
    tensor (data_ptr, numel, dtype, device: -1, a CPU tensor)."""

    dtype = "float32"

    def __init__(self, device: int, n: int):
        self._lib = symmalloc._library()
        self.device, self.n = device, n
        self.ptr = self._lib.symm_malloc(4 * n, device, None)
        if not self.ptr:
            raise symmalloc.SymmallocError("SYMM_ERR_OUT_OF_MEMORY", self._lib.symm_last_error().decode())
        self.values = (ctypes.c_float * n).from_address(self.ptr)

    def data_ptr(self) -> int:
        return self.ptr

    def numel(self) -> int:
        return self.n

    def is_contiguous(self) -> bool:
        return True

    def get_device(self) -> int:
        return -1

    def free(self) -> None:
        self._lib.symm_free(self.ptr, 4 * self.n, self.device, None)


def rank_main(rank: int, unique_id: bytes) -> None:
    comm = symmalloc.Communicator(rank, WORLD, unique_id)
    buf = HostBuffer(comm.device, N)
    buf.values[:] = [float((rank + 1) * (i % 7)) for i in range(N)]
    comm.all_reduce(buf)  # in place, sum
    total = WORLD * (WORLD + 1) // 2
    bad = [i for i, v in enumerate(buf.values) if v != (i % 7) * total]
    if bad:
        sys.exit(f"rank {rank}: element {bad[0]} = {buf.values[bad[0]]}, expected {(bad[0] % 7) * total}")
    print(f"rank {rank}: fp32 sum of {N} elements across {WORLD} processes correct", flush=True)
    buf.free()
    comm.close()


if __name__ == "__main__":
    uid = symmalloc.get_unique_id()
    ranks = [mp.get_context("spawn").Process(target=rank_main, args=(r, uid)) for r in range(WORLD)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join()
    failed = [r for r, p in enumerate(ranks) if p.exitcode != 0]
    if failed:
        sys.exit(f"ranks {failed} failed (see above)")
    print("allreduce_host.py: correct on every rank")
