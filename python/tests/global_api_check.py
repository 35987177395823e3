"""PyTorch's memory API in global mode on one GPU, row by row (docs/global-mode.md): run once
with symmalloc's C++ allocator installed and once with PyTorch's own, same checks.

    python3 python/tests/global_api_check.py symmalloc|torch|pluggable [CHECK ...]
    python3 python/tests/global_api_check.py compare          (compile: both, losses compared)

Checks:
  stats          memory_allocated / reserved / max_memory_allocated follow a tensor's life to
                 the byte (512-rounded), memory_stats has PyTorch's keys, memory_summary prints
  reset_peak     reset_peak_memory_stats: the peak drops to the current value
  snapshot       _record_memory_history, then _snapshot: segments with blocks (a live tensor's
                 block), the trace with its alloc and free and Python frames; _dump_snapshot
                 writes a pickle that torch.cuda._memory_viz turns into its plots
  cudnn          cudnn.benchmark = True: a convolution forward and backward (cacheInfo)
  oom            torch.empty of 1 PiB raises torch.OutOfMemoryError, counted in num_ooms, the
                 observer called; live tensors intact, the process goes on
  fraction       set_per_process_memory_fraction(0.05): a request past it raises
                 OutOfMemoryError; back to 1.0 it succeeds; mem_get_info works
  ipc            torch.multiprocessing's reduction of a CUDA tensor makes PyTorch's handle
                 (symmalloc: the expandable-segment format); ipc_check.py covers the processes
  graphs         torch.cuda.graph capture and replay, record_stream, empty_cache giving memory
                 back, a MemPool with use_mem_pool
  recent         what newer torch adds: _allocation_traceback (2.12+) names the allocating
                 function, memory_stats' reserved_bytes_by_private_pools (2.13+) holds a
                 MemPool's segment; symmalloc: _set_allocator_settings refuses
                 max_split_size_mb by name and enforces a per_process_memory_fraction set there
  compile        torch.compile(mode="reduce-overhead") training (8 steps) and inference (4
                 shapes): prints the losses and outputs' checksums for `compare`
Prints PASS/FAIL per check; exits 1 if any failed."""
import gc
import os
import pickle
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

ALLOC = sys.argv[1] if len(sys.argv) > 1 else "symmalloc"

if ALLOC == "compare":
    outs = {}
    for a in ("torch", "symmalloc"):
        p = subprocess.run([sys.executable, __file__, a, "compile"], capture_output=True, text=True)
        print(p.stdout + p.stderr)
        outs[a] = [ln for ln in p.stdout.splitlines() if ln.startswith("compile ")]
        if p.returncode != 0 or not outs[a]:
            print(f"FAIL compare: the {a} run failed")
            sys.exit(1)
    same = outs["torch"] == outs["symmalloc"]
    print(("PASS" if same else "FAIL") + " compare: torch.compile(reduce-overhead) losses and "
          f"outputs {'identical' if same else 'differ'} under both allocators "
          f"({len(outs['torch'])} lines)")
    sys.exit(0 if same else 1)

import torch  # noqa: E402

if ALLOC in ("symmalloc", "pluggable"):
    import symmalloc  # noqa: E402

    symmalloc.install_global(allocator="cpp" if ALLOC == "symmalloc" else "pluggable")
    print(f"installed: {symmalloc.memory.installed()}")
torch.cuda.set_device(0)
MiB = 1 << 20


def check_stats():
    torch.cuda.synchronize()
    a0, r0 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    x = torch.empty(3 * MiB + 100, dtype=torch.uint8, device="cuda")
    a1 = torch.cuda.memory_allocated()
    assert a1 - a0 == 3 * MiB + 512, (a0, a1)
    assert torch.cuda.memory_reserved() >= a1 and torch.cuda.memory_reserved() >= r0
    assert torch.cuda.max_memory_allocated() >= a1
    s = torch.cuda.memory_stats()
    for k in ("allocated_bytes.all.current", "allocated_bytes.large_pool.peak",
              "reserved_bytes.all.current", "active_bytes.small_pool.allocated",
              "inactive_split_bytes.all.current", "requested_bytes.all.current",
              "allocation.all.current", "segment.all.current", "num_alloc_retries", "num_ooms",
              "num_sync_all_streams", "num_device_alloc", "num_device_free", "max_split_size",
              "oversize_allocations.current"):
        assert k in s, k
    assert s["allocated_bytes.all.current"] == a1
    assert s["requested_bytes.all.current"] - (3 * MiB + 100) >= 0
    assert "Allocated memory" in torch.cuda.memory_summary()
    del x
    assert torch.cuda.memory_allocated() == a0


def check_reset_peak():
    x = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    del x
    peak = torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    assert torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated() < peak
    torch.cuda.reset_accumulated_memory_stats()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == 0


def check_snapshot():
    torch.cuda.memory._record_memory_history(max_entries=1000)
    x = torch.randn(1024, 1024, device="cuda")
    y = torch.randn(10, device="cuda")
    addr = x.data_ptr()
    del y
    snap = torch.cuda.memory._snapshot()
    blocks = [b for s in snap["segments"] for b in s["blocks"]]
    assert any(s["address"] <= addr < s["address"] + s["total_size"] for s in snap["segments"])
    assert any(b["state"] == "active_allocated" for b in blocks)
    trace = [e for t in snap["device_traces"] for e in t]
    assert any(e["action"] == "alloc" and e["addr"] == addr for e in trace), "alloc traced"
    assert any(e["action"] == "free_completed" for e in trace), "free traced"
    assert any(e.get("frames") for e in trace), "Python frames recorded"
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "snap.pickle")
        torch.cuda.memory._dump_snapshot(path)
        with open(path, "rb") as f:
            loaded = pickle.load(f)
        from torch.cuda import _memory_viz

        html = _memory_viz.trace_plot(loaded)
        assert len(html) > 1000
        segs = _memory_viz.segment_plot(loaded)
        assert len(segs) > 1000
        text = _memory_viz.segsum(loaded)
        assert "segment" in text.lower() or len(text) > 0
    torch.cuda.memory._record_memory_history(enabled=None)
    del x


def check_plots():
    """upstream's test_memory_plots, each context named when it fails."""
    import json

    from torch.cuda._memory_viz import segment_plot, trace_plot

    for context, stacks in (("all", "all"), ("all", "python"), (None, "python")):
        try:
            torch.cuda.memory.empty_cache()
            torch.cuda.memory._record_memory_history("all", context=context, stacks=stacks)

            def run():
                x = torch.rand(128, 128, device="cuda")
                x * x + x * x

            run()
            ss = torch.cuda.memory._snapshot()
            trace_plot(ss)
            segment_plot(ss)
            text = json.dumps(ss)
            named = "check_plots" in text
            assert named == (context is not None), (context, stacks, named, text[:3000])
            assert str(128 * 128 * 4) in text, (context, stacks)
        finally:
            torch.cuda.memory._record_memory_history(None)


def check_cudnn():
    torch.backends.cudnn.benchmark = True
    conv = torch.nn.Conv2d(64, 128, 3, padding=1).cuda()
    x = torch.randn(8, 64, 56, 56, device="cuda", requires_grad=True)
    y = conv(x)
    y.sum().backward()
    torch.backends.cudnn.benchmark = False
    ref = torch.nn.functional.conv2d(x.detach().double(), conv.weight.double(), conv.bias.double(),
                                     padding=1)
    err = (y.double() - ref).norm() / ref.norm()
    assert err < 1e-3, err
    assert torch.isfinite(x.grad).all()


def check_oom():
    keep = torch.full((MiB,), 7.0, device="cuda")
    seen = []
    torch._C._cuda_attach_out_of_memory_observer(lambda *a: seen.append(a))
    ooms = torch.cuda.memory_stats()["num_ooms"]
    try:
        torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError as e:
        msg = str(e)
    else:
        raise AssertionError("no OutOfMemoryError")
    assert "CUDA out of memory" in msg and "Tried to allocate" in msg, msg
    assert torch.cuda.memory_stats()["num_ooms"] == ooms + 1
    assert len(seen) == 1, seen
    assert (keep == 7.0).all()
    z = torch.ones(1000, device="cuda") * 2
    assert z.sum().item() == 2000.0


def check_fraction():
    free, total = torch.cuda.mem_get_info()
    assert 0 < free <= total
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(0.05)
    try:
        torch.empty(int(total * 0.1), dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError:
        pass
    else:
        raise AssertionError("the fraction was not enforced")
    torch.cuda.set_per_process_memory_fraction(1.0)
    x = torch.empty(int(total * 0.1), dtype=torch.uint8, device="cuda")
    del x


def check_ipc():
    from torch.multiprocessing.reductions import reduce_tensor

    # Both allocators make PyTorch's own handle (symmalloc: the expandable-segment format);
    # the cross-process cases are python/tests/ipc_check.py.
    t = torch.ones(10, device="cuda")
    _, args = reduce_tensor(t)
    handle = args[7]  # storage_handle
    assert isinstance(handle, bytes) and len(handle) >= 2, handle
    if ALLOC == "symmalloc":  # version 2 or 3 (the running torch's), then 'e'
        assert handle[0] in (2, 3) and handle[1:2] == b"e", handle[:2]


def check_graphs():
    s = torch.cuda.Stream()
    x = torch.randn(1024, device="cuda")
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            y = (x * 2).sin()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = (x * 2).sin()
    x.copy_(torch.randn(1024, device="cuda"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.allclose(y, (x * 2).sin())
    del g, y
    # record_stream: a block used on a side stream is not reused before that work is done.
    side = torch.cuda.Stream()
    a = torch.empty(MiB, device="cuda")
    with torch.cuda.stream(side):
        torch.cuda._sleep(10_000_000)
        a.fill_(3.0)
    a.record_stream(side)
    del a
    b = torch.zeros(MiB, device="cuda")
    torch.cuda.synchronize()
    assert (b == 0).all()
    # empty_cache gives memory back.
    big = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    del big
    before = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() < before
    # A MemPool in global mode.
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        p = torch.ones(2 * MiB, device="cuda")
    assert p.sum().item() == 2 * MiB
    del p
    del pool
    gc.collect()


def check_recent():
    version = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
    if version >= (2, 12) and ALLOC != "pluggable":
        torch.cuda.memory._record_memory_history(max_entries=1000)

        def allocating_here():
            return torch.empty(MiB, device="cuda")

        x = allocating_here()
        frames = torch.cuda.memory._allocation_traceback(x.untyped_storage().data_ptr())
        assert frames and any(f["name"] == "allocating_here" for f in frames), frames
        torch.cuda.memory._record_memory_history(enabled=None)
        y = torch.empty(MiB, device="cuda")
        assert torch.cuda.memory._allocation_traceback(y.untyped_storage().data_ptr()) is None
        del x, y
    if version >= (2, 13) and ALLOC != "pluggable":
        pool = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(pool):
            p = torch.ones(8 * MiB, dtype=torch.uint8, device="cuda")
        pools = torch.cuda.memory_stats_as_nested_dict()["reserved_bytes_by_private_pools"]
        assert pools[pool.id]["all"]["current"] >= 8 * MiB, pools
        assert pools[pool.id]["large_pool"]["current"] >= 8 * MiB, pools
        del p
    if ALLOC == "symmalloc":
        import warnings

        warnings.simplefilter("ignore", FutureWarning)
        try:
            torch.cuda.memory._set_allocator_settings("max_split_size_mb:64")
        except RuntimeError as e:
            assert "max_split_size_mb:64" in str(e), e
        else:
            raise AssertionError("max_split_size_mb was not refused")
        free, total = torch.cuda.mem_get_info()
        torch.cuda.empty_cache()
        torch.cuda.memory._set_allocator_settings("per_process_memory_fraction:0.05")
        try:
            torch.empty(int(total * 0.1), dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError:
            pass
        else:
            raise AssertionError("the fraction set at run time was not enforced")
        torch.cuda.memory._set_allocator_settings("per_process_memory_fraction:1.0")
        x = torch.empty(int(total * 0.1), dtype=torch.uint8, device="cuda")
        del x


def check_compile():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(),
                                torch.nn.Linear(512, 256)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = torch.compile(model, mode="reduce-overhead")
    data = [torch.randn(64, 256, device="cuda", generator=None) for _ in range(8)]
    for i, x in enumerate(data):
        loss = step(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(f"compile train {i} {loss.item():.9e}")
    model.eval()
    infer = torch.compile(model, mode="reduce-overhead")
    with torch.no_grad():
        for n in (1, 8, 64, 8):
            x = torch.randn(n, 256, device="cuda")
            out = infer(x).clone()
            print(f"compile infer {n} {out.double().sum().item():.9e}")


CHECKS = {n[len("check_"):]: f for n, f in globals().items() if n.startswith("check_")}

if __name__ == "__main__":
    names = sys.argv[2:] or [n for n in CHECKS if n != "compile"]
    failed = 0
    for n in names:
        try:
            CHECKS[n]()
            print(f"PASS {n}")
        except Exception as e:  # report every check, then exit non-zero
            failed += 1
            import traceback

            traceback.print_exc()
            print(f"FAIL {n}: {type(e).__name__}: {e}")
    print(f"{len(names) - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)
