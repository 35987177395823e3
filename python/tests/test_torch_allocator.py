"""The C++ allocator for PyTorch (symmalloc/csrc/torch_allocator.cpp) without a GPU: it is
found built for the running torch (the wheel's, or SYMMALLOC_TORCH_EXT), it builds from source
with torch.utils.cpp_extension, and its own checks pass against libsymmalloc's host backend
(statistics, resets, out of memory as torch.OutOfMemoryError, cacheInfo, pools checked and
restored as CUDA-graph trees do, snapshots and the trace, the refusals). When it cannot be had,
install_global() raises a short error (no fallback); the build on first use is locked, keyed,
remembered when it fails; PYTORCH_CUDA_ALLOC_CONF's keys are honoured or refused, at install and
through _set_allocator_settings at run time. The GPU side:
global_api_check.py (device runs)."""

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
    except (RuntimeError, OSError):
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
    why = _can_build()
    if why:
        pytest.skip(f"cannot build the C++ allocator here ({why})")
    path = _torch_ext.build(str(tmp_path))
    lib, version = _torch_ext._built_for(path)
    assert version == torch.__version__
    assert lib.symm_torch_installed() == 0


def test_no_cpp_allocator_raises_instead_of_falling_back(monkeypatch):
    """allocator="auto" (and "cpp") never falls back to the pluggable path by itself: the short
    error comes through as SYMM_ERR_UNSUPPORTED and nothing is installed."""
    def unavailable(verbose=False):
        raise _torch_ext.TorchExtUnavailable("no compiler")

    calls = []
    monkeypatch.setattr(_torch_ext, "load", unavailable)
    monkeypatch.setattr(memory, "_install_pluggable", lambda t: calls.append(t))
    monkeypatch.setattr(memory, "_installed", None)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    for allocator in ("auto", "cpp"):
        with pytest.raises(symmalloc.SymmallocError, match="SYMM_ERR_UNSUPPORTED: no compiler"):
            symmalloc.install_global(allocator=allocator)
    assert not calls and memory.installed() is None
    with pytest.raises(symmalloc.SymmallocError, match="expected 'auto', 'cpp' or 'pluggable'"):
        symmalloc.install_global(allocator="cuda")


# ---- the build on first use: the short error, the remembered failure, the lock ----

# Run in a fresh process: the package and libsymmalloc.so as in the checkout, no prebuilt C++
# allocator anywhere (the wheel's and the one beside the library are not looked at), the build
# cache in the given folder. Prints RESULT <lib path> <inode> or ERROR <message>.
_LOAD = """
import os, sys, symmalloc
from symmalloc import _torch_ext as t
t._candidates = lambda version: iter(())
try:
    symmalloc.install_global() if sys.argv[1] == "install" else t.load()
except (symmalloc.SymmallocError, t.TorchExtUnavailable) as e:
    print("ERROR", str(e).replace(chr(10), " | "))
else:
    p = t.load()._name
    print("RESULT", p, os.stat(p).st_ino)
"""


def _load_in_process(cache, how="load", wait=True, **env):
    env = dict(os.environ, SYMMALLOC_BACKEND="host", SYMMALLOC_CACHE_DIR=str(cache), **env)
    env = {k: v for k, v in env.items() if v is not None}
    env.pop("SYMMALLOC_TORCH_EXT", None)
    p = subprocess.Popen([sys.executable, "-W", "ignore", "-c", _LOAD, how], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return _finish(p) if wait else p


def _finish(p, timeout=600):
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, out + err
    line = next((x for x in out.splitlines() if x.startswith(("RESULT ", "ERROR "))), None)
    assert line, out + err
    return line


def _key_dir(cache):
    return cache / _torch_ext.cache_key(torch)


def _can_build():
    try:
        _torch_ext._check_tools()
        _torch_ext._cuda_paths(torch)
        return None
    except RuntimeError as e:
        return str(e)


def test_no_compiler_gives_the_short_error_and_is_remembered(tmp_path):
    """CXX naming a compiler that is not there: install_global() raises a few lines (not the
    compiler's log) naming the torch, the range, what to install, the log file and the
    pluggable path; the failure is kept in the cache key's folder, so the next process raises
    at once, with a working compiler too, until FAILED is deleted."""
    line = _load_in_process(tmp_path, "install", CXX="/nonexistent/bin/c++")
    assert line.startswith("ERROR SYMM_ERR_UNSUPPORTED: "), line
    msg = line[len("ERROR "):]
    parts = msg.split(" | ")
    assert len(parts) <= 6 and len(msg) < 1200, msg
    for what in (f"torch {torch.__version__}", "2.10 to 2.15", "/nonexistent/bin/c++ not found",
                 "pip install ninja", 'install_global(allocator="pluggable")', "build.log",
                 "FAILED to try again"):
        assert what in msg, (what, msg)
    key = _key_dir(tmp_path)
    assert (key / "build.log").is_file() and (key / "FAILED").is_file()
    assert "/nonexistent/bin/c++" in (key / "build.log").read_text()
    assert not (key / _torch_ext.LIBRARY).exists()

    # Remembered: no build is tried again (the log stays as it was), whatever the compiler.
    before = (key / "build.log").stat().st_mtime_ns
    again = _load_in_process(tmp_path, "load", CXX=None)
    assert again.startswith("ERROR ") and "FAILED to try again" in again, again
    assert (key / "build.log").stat().st_mtime_ns == before
    assert not (key / _torch_ext.LIBRARY).exists()

    # Deleting FAILED (what the message says) tries again.
    (key / "FAILED").unlink()
    third = _load_in_process(tmp_path, "load", CXX="false")
    assert third.startswith("ERROR ") and (key / "FAILED").is_file(), third
    assert (key / "build.log").stat().st_mtime_ns != before


def test_two_processes_building_at_once_end_on_the_same_library(tmp_path):
    """Two processes with an empty cache build at once: one builds, the other waits on the lock
    and loads the very file it published (same inode: nothing replaced it). ninja and the
    compiler are found beside sys.executable: PATH does not hold the venv."""
    why = _can_build()
    if why:
        pytest.skip(f"cannot build the C++ allocator here ({why})")
    path = "/usr/local/bin:/usr/bin:/bin"
    procs = [_load_in_process(tmp_path, "load", wait=False, PATH=path) for _ in range(2)]
    lines = [_finish(p) for p in procs]
    assert all(x.startswith("RESULT ") for x in lines), lines
    assert lines[0] == lines[1], lines
    key = _key_dir(tmp_path)
    assert lines[0].split()[1] == str(key / _torch_ext.LIBRARY)
    assert sorted(os.listdir(key)) == [_torch_ext.LIBRARY], "no build folder or log is left"


def test_a_killed_builder_never_blocks_the_next(tmp_path):
    """A process holding the build lock is killed mid-build (its build folder left behind): the
    kernel drops its lock, the next process builds (here: tries, and fails on CXX=false) and
    removes the dead build's folder."""
    import signal

    key = _key_dir(tmp_path)
    key.mkdir(parents=True)
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import fcntl, os, sys, time; f = open(sys.argv[1], 'a+'); "
         "fcntl.flock(f, fcntl.LOCK_EX); os.mkdir(sys.argv[2]); print('locked', flush=True); "
         "time.sleep(600)", str(key) + ".lock", str(key / "build-999999")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        waiting = _load_in_process(tmp_path, "load", wait=False, CXX="false")
        # The lock is held: it waits, trying no build (CXX=false fails within seconds of
        # starting, writing FAILED).
        with pytest.raises(subprocess.TimeoutExpired):
            waiting.wait(timeout=15)
        assert not (key / "FAILED").exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    line = _finish(waiting, timeout=120)
    assert line.startswith("ERROR ") and "FAILED to try again" in line, line
    assert not (key / "build-999999").exists()


def test_the_cache_key_names_symmalloc_csrc_and_torch(monkeypatch, tmp_path):
    key = _torch_ext.cache_key(torch)
    assert f"symmalloc-{symmalloc.__version__}-" in key
    assert torch.__version__.replace("+", "_") in key
    monkeypatch.setattr(symmalloc, "__version__", "9.9.9")
    assert _torch_ext.cache_key(torch) != key and "symmalloc-9.9.9-" in _torch_ext.cache_key(torch)
    monkeypatch.undo()
    # A change to any csrc file changes it (a copy of csrc with one byte more in one header).
    import shutil as sh

    copy = tmp_path / "csrc"
    sh.copytree(_torch_ext.CSRC, copy)
    monkeypatch.setattr(_torch_ext, "CSRC", str(copy))
    assert _torch_ext.cache_key(torch) == key
    with open(copy / "uncached.h", "a") as fh:
        fh.write("\n")
    assert _torch_ext.cache_key(torch) != key


class _FakeLib:
    def __init__(self, version, cuda, abi):
        self.symm_torch_built_for = lambda: version.encode()
        self.symm_torch_built_cuda = lambda: cuda.encode()
        self.symm_torch_abi = lambda: abi.encode()


def test_a_prebuilt_library_fits_the_same_minor_cuda_major_and_headers(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.11.1+cu130")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(_torch_ext, "_abi_hash", lambda t: "abc")
    fits = lambda v, c, a: _torch_ext._fits(_FakeLib(v, c, a), torch)  # noqa: E731
    assert fits("2.11.1+cu130", "", "") is None  # the exact version
    assert fits("2.11.0+cu130", "13.0", "abc") is None  # another patch release, same headers
    assert fits("2.11.0+cu132", "13.2", "abc") is None  # another CUDA 13 build
    assert "built for torch 2.12.0" in fits("2.12.0+cu130", "13.0", "abc")
    assert "CUDA 12.8" in fits("2.11.0+cu128", "12.8", "abc")
    assert "other allocator headers" in fits("2.11.0+cu130", "13.0", "abd")
    assert "other allocator headers" in fits("2.11.0+cu130", "13.0", "")


def test_an_unsupported_torch_gets_the_short_error(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.16.0+cu132")
    monkeypatch.setattr(_torch_ext, "_loaded", None)
    monkeypatch.delenv("SYMMALLOC_TORCH_EXT", raising=False)
    with pytest.raises(_torch_ext.TorchExtUnavailable) as e:
        _torch_ext.load()
    msg = str(e.value)
    for what in ("torch 2.16.0+cu132", "2.10 to 2.15", "pip install 'torch>=2.10,<2.16'",
                 'allocator="pluggable"'):
        assert what in msg, (what, msg)
    assert [_torch_ext.supported(v) for v in ("2.9.1", "2.10.0", "2.15.0+cu132", "2.16.0")] == [
        False, True, True, False]


def test_symmalloc_torch_ext_naming_nothing_is_an_error(monkeypatch, tmp_path):
    monkeypatch.setattr(_torch_ext, "_loaded", None)
    monkeypatch.setenv("SYMMALLOC_TORCH_EXT", str(tmp_path / "none.so"))
    with pytest.raises(_torch_ext.TorchExtUnavailable,
                       match="SYMMALLOC_TORCH_EXT=.*none.so: no such file"):
        _torch_ext.load()


def test_ninja_and_the_compiler_are_looked_for_beside_this_python(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    path = _torch_ext._tool_path().split(os.pathsep)
    assert path[0] == os.path.dirname(os.path.abspath(sys.executable)), path
    assert path[-1] == "/nonexistent"


# ---- PYTORCH_CUDA_ALLOC_CONF and PYTORCH_NO_CUDA_MEMORY_CACHING ----

def test_alloc_conf_honours_the_fraction_caching_off_and_pyTorchs_own_keys():
    conf = memory.alloc_conf
    assert conf({}) == (1.0, True)
    assert conf({"PYTORCH_CUDA_ALLOC_CONF": "per_process_memory_fraction:0.25"}) == (0.25, True)
    assert conf({"PYTORCH_ALLOC_CONF": "per_process_memory_fraction:0.5"}) == (0.5, True)
    assert conf({"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}) == (1.0, False)
    # Pinned host memory is PyTorch's allocator still; defaults ask for nothing.
    ok = ("pinned_use_cuda_host_register:True,pinned_num_register_threads:8,backend:native,"
          "expandable_segments:False,release_lock_on_cudamalloc:False,"
          "throw_on_cudamalloc_oom:False,graph_capture_record_stream_reuse:False")
    assert conf({"PYTORCH_CUDA_ALLOC_CONF": ok}) == (1.0, True)


@pytest.mark.parametrize("text,named", [
    ("max_split_size_mb:128", "max_split_size_mb:128"),
    ("expandable_segments:True", "expandable_segments:True"),
    ("backend:cudaMallocAsync", "backend:cudaMallocAsync"),
    ("garbage_collection_threshold:0.6", "garbage_collection_threshold:0.6"),
    ("roundup_power2_divisions:[256:1,512:2],max_non_split_rounding_mb:4",
     "roundup_power2_divisions:[256:1,512:2], "
     "PYTORCH_CUDA_ALLOC_CONF's max_non_split_rounding_mb:4"),
    ("throw_on_cudamalloc_oom:True", "throw_on_cudamalloc_oom:True"),
    ("large_segment_size_mb:64", "large_segment_size_mb:64"),
    ("no_such_key:1", "no_such_key:1"),
])
def test_alloc_conf_refuses_every_other_key_by_name(text, named):
    with pytest.raises(symmalloc.SymmallocError) as e:
        memory.alloc_conf({"PYTORCH_CUDA_ALLOC_CONF": text})
    msg = str(e.value)
    assert msg.startswith("SYMM_ERR_UNSUPPORTED: "), msg
    assert f"PYTORCH_CUDA_ALLOC_CONF's {named}" in msg, msg
    assert "not honoured" in msg


def test_alloc_conf_checks_the_fraction_and_the_pluggable_path_refuses_both():
    with pytest.raises(symmalloc.SymmallocError, match="per_process_memory_fraction:1.5: expected"):
        memory.alloc_conf({"PYTORCH_CUDA_ALLOC_CONF": "per_process_memory_fraction:1.5"})
    with pytest.raises(symmalloc.SymmallocError, match="per_process_memory_fraction:half"):
        memory.alloc_conf({"PYTORCH_CUDA_ALLOC_CONF": "per_process_memory_fraction:half"})
    for env, named in (({"PYTORCH_CUDA_ALLOC_CONF": "per_process_memory_fraction:0.5"},
                        "per_process_memory_fraction:0.5"),
                       ({"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}, "PYTORCH_NO_CUDA_MEMORY_CACHING")):
        with pytest.raises(symmalloc.SymmallocError, match="pluggable path cannot apply") as e:
            memory.alloc_conf(env, allocator="pluggable")
        assert named in str(e.value)


def test_install_global_applies_the_fraction_and_caching_off():
    """On the host backend: install_global() installs the C++ allocator with the conf's fraction
    (set on each device at its first allocation) and caching off, as history_state() reads
    them; a refused key fails before anything is installed."""
    if not _have_prebuilt():
        pytest.skip("no C++ allocator built for this torch (test_builds_from_source says why)")
    code = ("import symmalloc, symmalloc._torch_ext as t; symmalloc.install_global(); "
            "print('STATE', symmalloc.memory.installed(), t.history_state())")
    out = _run_on_host(code, PYTORCH_CUDA_ALLOC_CONF="per_process_memory_fraction:0.25",
                       PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    line = next(x for x in out.splitlines() if x.startswith("STATE "))
    assert line.startswith("STATE cpp "), line
    assert "caching 0" in line and "conf fraction 0.25" in line, line
    code = ("import symmalloc, symmalloc._torch_ext as t\n"
            "try:\n    symmalloc.install_global()\n"
            "except symmalloc.SymmallocError as e:\n    print('REFUSED', e)\n"
            "print('INSTALLED', symmalloc.memory.installed(), t.load().symm_torch_installed())")
    out = _run_on_host(code, PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:64")
    assert "REFUSED SYMM_ERR_UNSUPPORTED" in out and "max_split_size_mb:64" in out, out
    assert "INSTALLED None 0" in out, out


_SETTINGS = """
import warnings, symmalloc, symmalloc._torch_ext as t, torch
symmalloc.install_global()
def attempt(text):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            torch.cuda.memory._set_allocator_settings(text)
        return "OK"
    except (RuntimeError, ValueError) as e:
        return "RAISED " + type(e).__name__ + " " + str(e).splitlines()[0]
for text in ["pinned_num_register_threads:2,expandable_segments:False",
             "per_process_memory_fraction:0.5", "expandable_segments:True",
             "max_split_size_mb:64,roundup_power2_divisions:[256:1,>:4]",
             "per_process_memory_fraction:2", "no_such_key:1"]:
    print("SET", text, "->", attempt(text))
print("STATE", t.history_state())
"""


def test_settings_changed_at_run_time_are_honoured_or_refused_by_name():
    """torch.cuda.memory._set_allocator_settings after install_global() (settings.h): the keys
    install_global() honours are applied (the fraction becomes each device's cap at its next
    allocation), every other key raises at the call naming it, and a key PyTorch does not know
    still raises PyTorch's own error."""
    if not _have_prebuilt():
        pytest.skip("no C++ allocator built for this torch (test_builds_from_source says why)")
    out = _run_on_host(_SETTINGS)
    got = {x.split(" -> ")[0][4:]: x.split(" -> ")[1] for x in out.splitlines()
           if x.startswith("SET ")}
    assert got["pinned_num_register_threads:2,expandable_segments:False"] == "OK", got
    assert got["per_process_memory_fraction:0.5"] == "OK", got
    for text, named in [("expandable_segments:True", "expandable_segments:True"),
                        ("max_split_size_mb:64,roundup_power2_divisions:[256:1,>:4]",
                         "max_split_size_mb:64, roundup_power2_divisions:[256:1,>:4]"),
                        ("per_process_memory_fraction:2", "expected a fraction in [0, 1]")]:
        assert got[text].startswith("RAISED RuntimeError symmalloc: _set_allocator_settings"), \
            got[text]
        assert named in got[text], (named, got[text])
    assert got["no_such_key:1"].startswith("RAISED ValueError") and \
        "no_such_key" in got["no_such_key:1"], got
    state = next(x for x in out.splitlines() if x.startswith("STATE "))
    assert "conf fraction 0.5" in state, state


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
        "r = t.selftest(symmalloc.library_path(), 0); assert r is None, r; "
        "print('STATE', t.history_state())"
    )
    line = next(x for x in _run_on_host(code).splitlines() if x.startswith("STATE "))
    for part in ("history 0", "recording 0", "ring 0 of", "skip []", "routes open 0",
                 "foreign routes 0", "caching 1"):
        assert part in line, (part, line)


def test_profiling_build_times_and_traces_the_allocation_path(tmp_path):
    """A build with profile=True (csrc/profile.h) counts and times every allocation and free per
    thread, and writes the calls as CSV while tracing (bench/step_probe.py --ext-profile)."""
    why = _can_build()
    if why:
        pytest.skip(f"cannot build the C++ allocator here ({why})")
    path = _torch_ext.build(str(tmp_path / "build"), profile=True)
    csv = tmp_path / "trace.csv"
    code = (
        "import json, symmalloc, symmalloc._torch_ext as t; "
        "t.profile_trace(True); "
        "r = t.selftest(symmalloc.library_path(), 0); assert r is None, r; "
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


# ---- The wheel's prebuilt per torch minor (lib/torch-2.X/) ----


def test_the_prebuilt_for_the_running_minor_comes_first(monkeypatch, tmp_path):
    monkeypatch.setattr(_torch_ext, "PACKAGE_DIR", str(tmp_path))
    for version, minor in (("2.10.0", "2.10"), ("2.11.0+cu130", "2.11"), ("2.12.1", "2.12"),
                           ("2.13.0+cu130", "2.13"), ("2.14.1", "2.14"), ("2.15.3+cu132", "2.15")):
        paths = list(_torch_ext._candidates(version))
        assert paths[0] == str(tmp_path / "lib" / f"torch-{minor}" / "libsymmalloc_torch.so"), paths
        assert paths[1] == str(tmp_path / "lib" / "libsymmalloc_torch.so"), paths
        assert not any(f"torch-{m}" in p for p in paths[1:] for m in ("2.1", "2.9")), paths
    for version in ("2.9.1", "2.16.0", "3.0.0", "nonsense"):
        assert _torch_ext.prebuilt_dir(version) is None
        assert not any("/torch-" in p for p in _torch_ext._candidates(version)), version


_PICK = """
import os, sys, symmalloc
from symmalloc import _torch_ext as t
t.PACKAGE_DIR = sys.argv[1]
p = t.load()._name
print("RESULT", os.path.relpath(p, sys.argv[1]))
"""


def test_load_picks_the_running_minors_prebuilt_without_building(tmp_path):
    """A package whose lib/ holds the built library in the running minor's folder and in
    another minor's loads the running minor's and builds nothing (the cache stays empty)."""
    if not _have_prebuilt():
        pytest.skip("no C++ allocator built for this torch here (test_builds_from_source)")
    import shutil as sh

    built = _torch_ext.load()._name
    mm = _torch_ext._minor(torch.__version__)
    other = f"torch-{mm[0]}.{mm[1] - 1 if mm[1] > 10 else mm[1] + 1}"
    for folder in (f"torch-{mm[0]}.{mm[1]}", other):
        (tmp_path / "pkg" / "lib" / folder).mkdir(parents=True)
        sh.copy(built, tmp_path / "pkg" / "lib" / folder / "libsymmalloc_torch.so")
    cache = tmp_path / "cache"
    env = dict(os.environ, SYMMALLOC_BACKEND="host", SYMMALLOC_CACHE_DIR=str(cache))
    env.pop("SYMMALLOC_TORCH_EXT", None)
    p = subprocess.run([sys.executable, "-W", "ignore", "-c", _PICK, str(tmp_path / "pkg")],
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"RESULT lib/torch-{mm[0]}.{mm[1]}/libsymmalloc_torch.so" in p.stdout, p.stdout
    assert not cache.exists() or not any(cache.iterdir()), list(cache.iterdir())
