"""bench/moe.py --selftest on the CPU: moe_lib's helpers (routing, bytes, FP8 quantization, the
clock probe's parsing, the throughput-mode adapter) and the NCCL baseline's algorithm at 2
processes over gloo, against direct counts and float64. Needs torch (run by `make test-torch`);
no GPU, no symmalloc library. A device run lost to a harness bug costs minutes of GPU time."""
import importlib.util
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "moe.py")

if not os.path.isfile(BENCH):
    pytest.skip("bench/moe.py is not beside the tests (the wheel's venv)", allow_module_level=True)
if importlib.util.find_spec("torch") is None:
    pytest.skip("bench/moe.py's selftest needs torch (make test-torch runs it)", allow_module_level=True)


def test_moe_bench_selftest():
    r = subprocess.run([sys.executable, BENCH, "--selftest"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "selftest ok" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
