"""Communicator.from_env under torchrun, on the host backend (CPU tensors):
    SYMMALLOC_BACKEND=host torchrun --nproc_per_node=2 python/tests/from_env_check.py
Local rank 0 first starts an intruder: a process of the same user with the same launcher
variables (it claims local rank 1) that joins the way the C `symm_comm_init_from_env` does,
from an id derived from those variables. The real ranks share a fresh random id through
torchrun's store, so the intruder never joins (it times out naming rank 0), the job is not
disturbed (with an id derived from the variables it would join in rank 1's place), and the id is gone from the store once every rank has joined."""
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import symmalloc  # noqa: E402

INTRUDER = """
import ctypes, sys
import symmalloc
lib = symmalloc._library()
c = ctypes.c_void_p()
status = lib.symm_comm_init_from_env(ctypes.byref(c))
print(status, lib.symm_last_error().decode())
sys.exit(status)
"""


def main():
    rank = int(os.environ["LOCAL_RANK"])
    intruder = None
    if rank == 0:
        env = dict(os.environ, LOCAL_RANK="1", SYMMALLOC_TIMEOUT_S="8")
        intruder = subprocess.Popen([sys.executable, "-c", INTRUDER], env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, cwd=os.path.dirname(symmalloc.__file__) + "/..")
    else:
        time.sleep(3)  # the intruder gets a head start on the real rank 1
    comm = symmalloc.Communicator.from_env()
    assert (comm.rank, comm.world_size) == (rank, 2)
    x = torch.arange(1000, dtype=torch.float32) * (rank + 1)
    comm.all_reduce(x)
    assert torch.equal(x, torch.arange(1000, dtype=torch.float32) * 3), x[:4]
    comm.barrier()
    if rank == 0:
        out, _ = intruder.communicate(timeout=60)
        assert intruder.returncode != 0, f"the intruder joined: {out}"
        assert "SYMM_ERR_TIMEOUT" in out and "rank 0" in out, out
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
        assert not store.check(["symmalloc/unique_id/0/0"]), "the id is still in the store"
        print(f"intruder refused: {out.strip()}")
    comm.close()
    print(f"rank {rank}: from_env through torchrun's store: joined, all-reduce exact, id removed")


if __name__ == "__main__":
    main()
