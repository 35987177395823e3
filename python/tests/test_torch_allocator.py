"""The C++ allocator for PyTorch (symmalloc/csrc/torch_allocator.cpp) without a GPU: it is
found built for the running torch (the wheel's, or SYMMALLOC_TORCH_EXT), it builds from source
with torch.utils.cpp_extension, and its own checks pass against libsymmalloc's host backend
(statistics, resets, out of memory as torch.OutOfMemoryError, cacheInfo, pools checked and
restored as CUDA-graph trees do, snapshots and the trace, the refusals). install_global()'s
fallback warning names what will not work. The GPU side: global_api_check.py (device runs)."""

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="the C++ allocator needs torch (make test-wheel's torch venv runs this)")

import symmalloc  # noqa: E402
from symmalloc import _torch_ext, memory  # noqa: E402


def _have_prebuilt():
    try:
        _torch_ext.load()
        return True
    except RuntimeError:
        return False


def _run_on_host(code, **env):
    """`code` in a fresh Python on the host backend (which the library needs from its first
    call); asserts it exited 0 and returns its stdout."""
    env = dict(os.environ, SYMMALLOC_BACKEND="host", **env)
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def test_built_for_the_running_torch():
    if not _have_prebuilt():
        pytest.skip("no C++ allocator built for this torch and none could be built here "
                    "(test_builds_from_source says why)")
    lib = _torch_ext.load()
    import ctypes

    lib.symm_torch_built_for.restype = ctypes.c_char_p
    assert lib.symm_torch_built_for().decode() == torch.__version__
    assert lib.symm_torch_installed() == 0, "loading does not install"


def test_selftest_on_the_host_backend():
    """Runs in a fresh process: the selftest needs the host backend from the first call."""
    code = (
        "import symmalloc, symmalloc._torch_ext as t; "
        "r = t.selftest(symmalloc.library_path(), 2); "
        "print('SELFTEST', r); raise SystemExit(0 if r is None else 1)"
    )
    assert "SELFTEST None" in _run_on_host(code)


def test_builds_from_source(tmp_path):
    """torch.utils.cpp_extension builds csrc/torch_allocator.cpp against this torch (what
    install_global() does on first use with a torch the wheel was not built for)."""
    from torch.utils import cpp_extension

    try:
        cpp_extension.verify_ninja_availability()
    except RuntimeError:
        pytest.skip("ninja is not installed: install_global() would warn and fall back")
    try:
        _torch_ext._cuda_paths(torch)
    except RuntimeError as e:
        pytest.skip(f"no CUDA runtime headers here ({e})")
    path = _torch_ext.build(str(tmp_path))
    lib, version = _torch_ext._built_for(path)
    assert version == torch.__version__
    assert lib.symm_torch_installed() == 0


def test_fallback_warns_once_naming_what_will_not_work(monkeypatch):
    def no_compiler(verbose=False):
        raise RuntimeError("the C++ allocator for torch X could not be built: no compiler")

    calls = []
    monkeypatch.setattr(_torch_ext, "load", no_compiler)
    monkeypatch.setattr(memory, "_install_pluggable", lambda t: calls.append(t))
    monkeypatch.setattr(memory, "_installed", None)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    with pytest.warns(RuntimeWarning) as w:
        symmalloc.install_global()
    assert len(w) == 1
    msg = str(w[0].message)
    for what in ("memory_stats", "_dump_snapshot", "cuDNN benchmark", "reduce-overhead",
                 "OutOfMemoryError", "no compiler"):
        assert what in msg, msg
    assert calls, "the pluggable path was installed"
    assert memory.installed() == "pluggable"


def test_cpp_only_raises_instead_of_falling_back(monkeypatch):
    def no_compiler(verbose=False):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(_torch_ext, "load", no_compiler)
    monkeypatch.setattr(memory, "_installed", None)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    with pytest.raises(symmalloc.SymmallocError, match="SYMM_ERR_UNSUPPORTED: no compiler"):
        symmalloc.install_global(allocator="cpp")
    with pytest.raises(symmalloc.SymmallocError, match="expected 'auto', 'cpp' or 'pluggable'"):
        symmalloc.install_global(allocator="cuda")


def test_profiling_entry_points_refuse_in_the_default_build():
    """profile_take / profile_trace time the allocation path only in a build made for it
    (-DSYMM_TORCH_PROFILE); the shipped build says so and how to get one."""
    if not _have_prebuilt():
        pytest.skip("no C++ allocator built for this torch (test_builds_from_source says why)")
    for call in (_torch_ext.profile_take, lambda: _torch_ext.profile_trace(True)):
        with pytest.raises(RuntimeError, match="SYMM_TORCH_PROFILE"):
            call()


def test_history_state_names_what_is_recorded():
    """history_state() is one line: history and recording off, an empty trace ring, caching on,
    no pool route open, before anything was recorded (fresh process, host backend)."""
    code = (
        "import symmalloc, symmalloc._torch_ext as t; "
        "assert t.selftest(symmalloc.library_path(), 0) is None; "
        "print('STATE', t.history_state())"
    )
    line = next(x for x in _run_on_host(code).splitlines() if x.startswith("STATE "))
    for part in ("history 0", "recording 0", "ring 0 of", "skip []", "routes open 0",
                 "foreign routes 0", "caching 1"):
        assert part in line, (part, line)


def test_profiling_build_times_and_traces_the_allocation_path(tmp_path):
    """A build with profile=True (csrc/profile.h) counts and times every allocation and free per
    thread, and writes the calls as CSV while tracing (bench/step_probe.py --ext-profile)."""
    from torch.utils import cpp_extension

    try:
        cpp_extension.verify_ninja_availability()
        _torch_ext._cuda_paths(torch)
    except RuntimeError as e:
        pytest.skip(f"cannot build the C++ allocator here ({e})")
    path = _torch_ext.build(str(tmp_path / "build"), profile=True)
    csv = tmp_path / "trace.csv"
    code = (
        "import json, symmalloc, symmalloc._torch_ext as t; "
        "t.profile_trace(True); "
        "assert t.selftest(symmalloc.library_path(), 0) is None; "
        f"t.profile_trace(False, {str(csv)!r}); "
        "print('PROFILE', json.dumps(t.profile_take())); "
        "print('AGAIN', json.dumps(t.profile_take()))"
    )
    out = _run_on_host(code, SYMMALLOC_TORCH_EXT=path).splitlines()
    import json

    prof = json.loads(next(x for x in out if x.startswith("PROFILE "))[8:])
    allocs = sum(t["alloc"]["n"] for t in prof.values())
    frees = sum(t["free"]["n"] for t in prof.values())
    assert allocs > 0 and frees > 0, prof
    assert all(t["alloc"]["inner_us"] <= t["alloc"]["us"] for t in prof.values()), prof
    again = json.loads(next(x for x in out if x.startswith("AGAIN "))[6:])
    assert all(t["alloc"]["n"] == 0 and t["free"]["n"] == 0 for t in again.values()), again
    lines = csv.read_text().splitlines()
    assert lines[0] == "t_ns,dur_ns,inner_ns,tid,op,ptr,size,stream"
    ops = [line.split(",")[4] for line in lines[1:]]
    assert ops.count("a") == allocs and ops.count("f") == frees, (len(ops), allocs, frees)
