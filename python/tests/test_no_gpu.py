"""Tests that run anywhere (CI has no GPU): import, library discovery, error paths."""
import ctypes
import os

import pytest

import symmalloc


def test_paths_exist_and_sit_together():
    lib = symmalloc.library_path()
    shim = symmalloc.pluggable_path()
    assert os.path.isfile(lib) and os.path.isfile(shim)
    assert os.path.dirname(lib) == os.path.dirname(shim)


def test_missing_library_dir_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.delenv("SYMMALLOC_LIBRARY_DIR", raising=False)
    monkeypatch.setattr(symmalloc._lib, "_candidates", lambda: iter([str(tmp_path)]))
    with pytest.raises(symmalloc.SymmallocError) as e:
        symmalloc.library_path()
    assert "libsymmalloc.so not found" in str(e.value) and "SYMMALLOC_LIBRARY_DIR" in str(e.value)


@pytest.mark.parametrize("kind", ["empty folder", "no such path", "a file"])
def test_library_dir_pointing_at_nothing_is_an_error_naming_it(monkeypatch, tmp_path, kind):
    target = {"empty folder": tmp_path, "no such path": tmp_path / "nowhere",
              "a file": tmp_path / "f"}[kind]
    if kind == "a file":
        target.write_text("")
    monkeypatch.setenv("SYMMALLOC_LIBRARY_DIR", str(target))
    for find in (symmalloc.library_path, symmalloc.pluggable_path):
        with pytest.raises(symmalloc.SymmallocError) as e:
            find()
        assert e.value.status == "SYMM_ERR_INVALID_ARGUMENT"
        assert f"SYMMALLOC_LIBRARY_DIR={target}" in str(e.value), str(e.value)


def test_unique_id_is_128_random_bytes():
    a, b = symmalloc.get_unique_id(), symmalloc.get_unique_id()
    assert len(a) == 128 and a != b and a.startswith(b"SYMMID02")


def test_bad_unique_id_rejected():
    with pytest.raises(symmalloc.SymmallocError) as e:
        symmalloc.Communicator(0, 1, b"x" * 128)
    assert e.value.status == "SYMM_ERR_INVALID_ARGUMENT" and "magic" in str(e.value)
    assert str(e.value).count("SYMM_ERR_INVALID_ARGUMENT") == 1, "the status is stated once"
    with pytest.raises(symmalloc.SymmallocError):
        symmalloc.Communicator(0, 1, b"short")


def test_from_env_names_the_missing_variable(monkeypatch):
    for k in ["LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"]:
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(symmalloc.SymmallocError) as e:
        symmalloc.Communicator.from_env()
    assert "LOCAL_RANK" in str(e.value)


def test_stats_and_no_device_or_host_backend():
    if os.environ.get("SYMMALLOC_BACKEND") == "host":
        s = symmalloc.memory_stats(0)
        assert s["active_blocks"] == 0 and "staged_collectives" in s
    else:
        lib = symmalloc._library()
        p = lib.symm_malloc(4096, 0, None)
        if p is None:  # no GPU here: the error says why
            assert b"SYMM_ERR_NO_DEVICE" in lib.symm_last_error()
        else:
            lib.symm_free(p, 4096, 0, None)


def test_torch_helpers_need_torch():
    try:
        import torch  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError):
            symmalloc.mem_pool(0)
    else:
        pytest.skip("torch installed: covered by the GPU tests")


def test_version_matches_the_crate():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cargo = os.path.join(root, "Cargo.toml")
    if not os.path.isfile(cargo):
        pytest.skip("not run from a checkout (no Cargo.toml beside the package)")
    import re

    want = re.search(r'^version = "([^"]+)"', open(cargo).read(), re.M).group(1)
    assert symmalloc.__version__ == want


def test_custom_op_handles_name_live_communicators_only():
    with pytest.raises(symmalloc.SymmallocError) as e:
        symmalloc.communicator(123456)
    assert "handle 123456 is not a live Communicator" in str(e.value)


def test_bench_cli_arguments():
    from symmalloc import bench

    assert [bench.parse_size(s) for s in ("8K", "1M", "256MiB", "3", "1.5K")] == [8192, 1 << 20, 256 << 20, 3, 1536]
    assert bench.sizes(8 << 10, 64 << 10, 2) == [8 << 10, 16 << 10, 32 << 10, 64 << 10]
    assert bench.size_label(1 << 20) == "1M" and bench.size_label(1536) == "1536"
    assert bench.bus_factor("all_reduce", 4) == 1.5 and bench.bus_factor("all_gather", 4) == 0.75
    a = bench.arguments(["-c", "reduce_scatter", "-b", "1M", "-e", "4M", "--compare", "nccl,torch", "-G", "0"])
    assert (a.collective, a.minbytes, a.maxbytes, a.peers, a.graph) == ("reduce_scatter", 1 << 20, 4 << 20, ["nccl", "torch"], 0)
    for bad in (["-b", "1M", "-e", "8K"], ["--compare", "mpi"], ["-b", "8Q"], ["-c", "all_gather", "-a", "two_shot"], ["-n", "0"]):
        with pytest.raises(SystemExit):
            bench.arguments(bad)


def test_bench_cli_help_runs_without_torch_or_gpu():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "symmalloc.bench", "--help"], capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(symmalloc.__file__)))
    assert r.returncode == 0 and "--compare" in r.stdout and "bus bandwidth" in r.stdout.lower(), r.stdout + r.stderr


def test_fast_path_when_built_reports_errors_like_ctypes():
    fast = symmalloc._fast_all_reduce()
    if fast is None:
        pytest.skip("symmalloc._fastcall is not built (make test-python builds it; the wheel has it)")
    assert fast(0, 0, 0, 0, 1, 0, 0, 0) == 1  # comm NULL: SYMM_ERR_INVALID_ARGUMENT
    assert "comm" in symmalloc._library().symm_last_error().decode()
    with pytest.raises(TypeError):
        fast(0, 0, 0)
    with pytest.raises(OverflowError):
        fast(0, 1 << 40, 0, 0, 1, 0, 0, 0)


def test_install_global_wraps_empty_cache_original_first():
    """install_global's torch.cuda.empty_cache wrapper, on a stand-in for torch.cuda: the
    original runs, then symm_empty_cache; torch.cuda.empty_cache and
    torch.cuda.memory.empty_cache are the same wrapper; a second install wraps nothing."""
    import types

    from symmalloc.memory import _wrap_empty_cache

    calls = []
    cuda = types.SimpleNamespace(memory=types.SimpleNamespace(empty_cache=lambda: calls.append("torch")))
    cuda.empty_cache = cuda.memory.empty_cache
    assert _wrap_empty_cache(cuda, lambda: calls.append("symm"))
    cuda.empty_cache()
    cuda.memory.empty_cache()
    assert calls == ["torch", "symm", "torch", "symm"]
    assert not _wrap_empty_cache(cuda, lambda: calls.append("again"))
    cuda.empty_cache()
    assert calls[-2:] == ["torch", "symm"] and "again" not in calls


def test_empty_cache_wrapper_on_torch_reaches_the_library():
    """With torch (no GPU needed): the wrapper installed on the real torch.cuda, calling the
    library's symm_empty_cache, is what torch.cuda.graph's torch.cuda.empty_cache() finds."""
    torch = pytest.importorskip("torch", reason="PyTorch is not installed here")
    from symmalloc.memory import _wrap_empty_cache

    saved = (torch.cuda.empty_cache, torch.cuda.memory.empty_cache)
    calls = []
    lib = symmalloc._library()
    try:
        assert _wrap_empty_cache(torch.cuda, lambda: (calls.append(1), lib.symm_empty_cache()))
        torch.cuda.empty_cache()
        assert calls == [1] and torch.cuda.memory.empty_cache is torch.cuda.empty_cache
    finally:
        torch.cuda.empty_cache, torch.cuda.memory.empty_cache = saved
