"""The C++ allocator's memory history under threads, without a GPU (host backend): frames are
gathered outside every allocator lock, so a recorder that takes the GIL (as PyTorch's Python
recorder does) never waits on a thread that holds the GIL and waits on the allocator (as
torch.cuda.memory._snapshot does). Two Python threads allocate and free with the GIL released
(ctypes.CDLL) while the main thread takes snapshots holding it (ctypes.PyDLL), history on; a
watchdog (the subprocess's timeout) fails a run that does not finish. The C++ selftest runs the
same with a stand-in GIL (selftest.h, selftest_threads)."""

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="the C++ allocator needs torch (make test-torch's venv runs this)")

from symmalloc import _torch_ext  # noqa: E402

_CODE = r"""
import ctypes, threading, symmalloc, symmalloc._torch_ext as t
err = t.install(symmalloc.library_path())
assert err is None, err
path = t.load()._name
cdll, pydll = ctypes.CDLL(path), ctypes.PyDLL(path)  # GIL released / held during a call
for lib in (cdll, pydll):
    lib.symm_torch_host_churn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_uint64,
                                          ctypes.c_char_p, ctypes.c_size_t]
    lib.symm_torch_host_snapshot.argtypes = [ctypes.POINTER(ctypes.c_size_t)] * 2 + [
        ctypes.c_char_p, ctypes.c_size_t]
calls = [0]
HOOK = ctypes.CFUNCTYPE(None)
def frames():  # the recorder's work, in Python: ctypes takes the GIL to run it
    calls[0] += 1
hook = HOOK(frames)
buf = ctypes.create_string_buffer(512)
assert cdll.symm_torch_host_history(1, hook, buf, 512) == 0, buf.value
failures, ROUNDS, ITERS = [], 40, 50
def work(seed):
    b = ctypes.create_string_buffer(512)
    for r in range(ROUNDS):
        if cdll.symm_torch_host_churn(0, ITERS, seed * 1000 + r, b, 512) != 0:
            failures.append(b.value.decode())
threads = [threading.Thread(target=work, args=(i + 1,)) for i in range(2)]
for th in threads:
    th.start()
segments, allocs, snaps = ctypes.c_size_t(), ctypes.c_size_t(), 0
while any(th.is_alive() for th in threads) or snaps < 20:
    assert pydll.symm_torch_host_snapshot(ctypes.byref(segments), ctypes.byref(allocs), buf,
                                          512) == 0, buf.value
    snaps += 1
for th in threads:
    th.join()
assert pydll.symm_torch_host_snapshot(ctypes.byref(segments), ctypes.byref(allocs), buf,
                                      512) == 0, buf.value
assert cdll.symm_torch_host_history(0, None, buf, 512) == 0
print("RESULT", snaps, allocs.value, calls[0], 2 * ROUNDS * ITERS, failures, flush=True)
"""


def test_history_under_threads_with_the_gil_finishes():
    try:
        _torch_ext.load()
    except RuntimeError as e:
        pytest.skip(f"no C++ allocator for this torch here ({e})")
    env = dict(os.environ, SYMMALLOC_BACKEND="host")
    try:
        p = subprocess.run([sys.executable, "-c", _CODE], env=env, capture_output=True,
                           text=True, timeout=120)
    except subprocess.TimeoutExpired as e:
        out = [x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
               for x in (e.stdout, e.stderr)]
        pytest.fail("history under threads did not finish in 120 s (a deadlock: frames "
                    f"gathered under an allocator lock?): {out[0][-2000:]} {out[1][-2000:]}")
    assert p.returncode == 0, p.stdout + p.stderr
    line = next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))
    snaps, allocs, calls, want, failures = line.split(" ", 5)[1:]
    assert failures == "[]", line
    assert int(snaps) >= 20, line
    # Every allocation of both threads is in the trace with its frames; the recorder ran for
    # each allocation and each free (context "all").
    assert int(allocs) == int(want), line
    assert int(calls) >= 2 * int(want), line


def test_selftest_runs_history_under_threads_with_a_stand_in_gil():
    """symm_torch_selftest's selftest_threads: the same scenario in C++ threads, with a mutex
    standing in for the GIL (it fails, naming a deadlock, after 60 s)."""
    try:
        _torch_ext.load()
    except RuntimeError as e:
        pytest.skip(f"no C++ allocator for this torch here ({e})")
    code = ("import symmalloc, symmalloc._torch_ext as t; "
            "r = t.selftest(symmalloc.library_path(), 3); print('SELFTEST', r)")
    env = dict(os.environ, SYMMALLOC_BACKEND="host")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=180)
    assert "SELFTEST None" in p.stdout, p.stdout + p.stderr
