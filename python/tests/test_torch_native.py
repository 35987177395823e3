"""PyTorch-native paths through torchrun: torch.compile over the custom ops
(torch_compile_check.py), the FP8 fused output against torch (fp8_check.py), from_env's secret through
torchrun's store (from_env_check.py) and several groups (groups_check.py).
On CI-like machines they run on CPU tensors over the host backend (SYMMALLOC_BACKEND=host);
on a machine with 2 GPUs the compile check runs on them. Both skip, with the reason, without
torch."""
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed here (the device machine runs these)")
HERE = os.path.dirname(os.path.abspath(__file__))
HOST = os.environ.get("SYMMALLOC_BACKEND") == "host"


def _torchrun(script, port, nproc=2):
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    env.pop("SYMMALLOC_ENABLE_MULTICAST", None)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={port}",
                        os.path.join(HERE, script)], env=env, capture_output=True, text=True, timeout=900)
    print(r.stdout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r.stdout


def test_compile_keeps_the_block_whole():
    if not HOST and not (torch.cuda.is_available() and torch.cuda.device_count() >= 2):
        pytest.skip("needs 2 GPUs, or SYMMALLOC_BACKEND=host")
    out = _torchrun("torch_compile_check.py", 29541)
    assert out.count("0 graph breaks") == 2, out


def test_fp8_output_matches_torch_and_compiles_into_cuda_graphs():
    if not HOST and not (torch.cuda.is_available() and torch.cuda.device_count() >= 2):
        pytest.skip("needs 2 GPUs, or SYMMALLOC_BACKEND=host")
    out = _torchrun("fp8_check.py", 29543)
    assert out.count("fp8 ok") == 2 and out.count("0 cudagraph skips") == 2, out


def test_from_env_secret_comes_through_the_store():
    if not HOST:
        pytest.skip("runs on the host backend (SYMMALLOC_BACKEND=host)")
    out = _torchrun("from_env_check.py", 29542)
    assert "intruder refused" in out and out.count("id removed") == 2, out


def test_groups_from_process_groups_and_split():
    """groups_check.py at 4 processes: the world, TP and EP process groups and a split, each
    against torch.distributed; one compiled graph over a TP and the world communicator."""
    if not HOST and not (torch.cuda.is_available() and torch.cuda.device_count() >= 4):
        pytest.skip("needs 4 GPUs, or SYMMALLOC_BACKEND=host")
    out = _torchrun("groups_check.py", 29543, nproc=4)
    assert out.count("0 graph breaks, 1 graph over 2 communicators") == 4, out
