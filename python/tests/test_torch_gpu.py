"""The PyTorch integration on two GPUs, through torchrun. Skips (visibly) without torch or
without two GPUs; run on the device machine."""
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed here")
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("mode", ["mempool", "graph", "global", "scatter_gather"])
def test_torchrun(mode):
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    env.pop("SYMMALLOC_ENABLE_MULTICAST", None)
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29533",
         os.path.join(HERE, "torch_gpu_check.py"), mode],
        env=env, capture_output=True, text=True, timeout=300,
    )
    print(r.stdout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
