"""Global mode and CUDA graphs on one GPU (global_capture_check.py's checks), for
symmalloc and for PyTorch's own allocator as the control, each in a fresh process (the
allocator is chosen before CUDA starts). Skips, visibly, without torch or a GPU; run on the
device machine (`scripts/device-run.sh global`)."""
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed here")
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("alloc", ["torch", "symmalloc"])
def test_global_capture(alloc):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    env.pop("SYMMALLOC_ENABLE_MULTICAST", None)
    env.pop("SYMMALLOC_BACKEND", None)  # global mode needs the CUDA backend
    r = subprocess.run([sys.executable, os.path.join(HERE, "global_capture_check.py"), alloc],
                       env=env, capture_output=True, text=True, timeout=300)
    print(r.stdout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
