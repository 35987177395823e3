"""CUDA tensors shared between processes (torch.multiprocessing) on one GPU, with symmalloc's C++
allocator (global mode) and PyTorch's own on either side: PyTorch's one-GPU CUDA tests of
test/test_multiprocessing.py, ported.

    python3 python/tests/ipc_check.py symmalloc|torch|mixed [TEST ...]

symmalloc: parent and children under symmalloc; torch: both under PyTorch's allocator; mixed:
a symmalloc parent with PyTorch children, then a PyTorch parent with symmalloc children (each
test sends both ways: parent to child and child to parent). Each configuration runs in a fresh
process (an allocator is chosen before CUDA allocates). Prints PASS/FAIL/SKIP per test and
configuration and the counts per test; exits 1 if any failed. Without a GPU every test is
skipped with the reason, and it exits 0.

Tests (PyTorch's names; "adapted" where one GPU needs a change):
  cuda_simple              _test_sharing: a child fills a tensor and a view it got; a child
                           sends one tensor twice (one storage)
  cuda_memory_allocation   a child sends 5 tensors and drops them; the parent reads them
  cuda_ipc_deadlock        an LSTM's state_dict through a queue of one, 100 times each side
  cuda_send_many           p1 -> p2 -> p3 chain of COUNT tensors (SYMM_IPC_SEND_MANY, 2000;
                           PyTorch's slow test sends 100000)
  cuda_small_tensors       adapted to one GPU: 5 small tensors (one cached block) summed by a
                           child
  rebuild_cuda_tensor      _share_cuda_ specs rebuilt with rebuild_cuda_tensor
  event                    an interprocess event orders the child's multiply after the add
  cuda_variable_sharing    autograd sharing, requires_grad True and False
  cuda_parameter_sharing   a Parameter shared, grad and hooks not sent
  mixed_types_cuda_sharing float and byte tensors from one producer, 10 rounds
  leaf_variable_sharing    requires_grad survives the trip
  integer_parameter_serialization  an int64 Parameter sent to a child
  empty_tensor_sharing     an empty CUDA tensor through a queue
  large_tensor             (added) 300 MiB: the handle spans several of the heap's chunks
  producer_frees           (added) lifetimes: the parent's memory stays while the child holds
                           it, and goes back (ipc_collect) once the child let go
  bad_handles              (added) a malformed handle and a handle of a process that is gone
                           raise, naming it (symmalloc's consumer)
  two_devices              (added; needs 2 GPUs, else SKIP with the count found) a tensor made
                           on GPU 0 read by a child working on GPU 1 (copied there, once as is
                           and once converted to float64), and the child's GPU 1 tensor read
                           back by the parent
"""
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
WAIT = 60  # seconds any child may take


def _setup(alloc):
    """Install the allocator `alloc` in this process (before any CUDA allocation)."""
    if alloc == "symmalloc":
        import symmalloc.memory

        symmalloc.memory.install_global()


# A spawned child imports this file as __mp_main__: it takes the allocator its parent named.
if __name__ == "__mp_main__":
    _setup(os.environ.get("SYMM_IPC_ALLOC", "torch"))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.nn import Parameter  # noqa: E402


def _installed():
    try:
        import symmalloc.memory

        return symmalloc.memory.installed()
    except Exception as e:  # noqa: BLE001
        return f"unknown ({e})"


# ---- children (PyTorch's helpers, as in test_multiprocessing.py) ----


def simple_fill(queue, event):
    data = queue.get()
    data[0][:] = 4
    torch.cuda.synchronize()
    event.set()


def send_tensor(queue, event, device, dtype):
    t = torch.ones(5, 5, device=device, dtype=dtype)
    queue.put(t)
    queue.put(t)
    event.wait()


def send_and_delete_tensors(queue, event, device, dtype, count, size=5):
    for i in range(count):
        t = torch.full([size], i, device=device, dtype=dtype)
        queue.put(t)
        del t
    event.wait()


def receive_and_send_sum(queue, out_queue, event, device, dtype, count, size=5):
    s = torch.full([size], 0, device=device, dtype=dtype)
    for _ in range(count):
        t = queue.get()
        s += t
    out_queue.put(s)
    event.wait()


def receive_and_send(queue, out_queue, event, count):
    for _ in range(count):
        t = queue.get()
        out_queue.put(t.clone())
    event.wait()


def sum_tensors(inq, outq):
    tensors = inq.get()
    for tensor in tensors:
        outq.put((tensor.sum().item(), tensor.get_device(), tensor.numel()))


def send_tensor_with_untyped_storage(queue, event):
    tensors = torch.ones(2, device="cuda").chunk(2, dim=0)
    specs = []
    for tensor in tensors:
        storage = tensor.untyped_storage()
        (dev, handle, size_bytes, offset_bytes, rc_handle, rc_offset, ev_handle,
         ev_sync) = storage._share_cuda_()
        specs.append(dict(
            tensor_cls=type(tensor), tensor_size=tensor.shape, tensor_stride=tensor.stride(),
            tensor_offset=tensor.storage_offset(), dtype=tensor.dtype,
            requires_grad=tensor.requires_grad, storage_cls=type(storage), storage_device=dev,
            storage_handle=handle, storage_size_bytes=size_bytes,
            storage_offset_bytes=offset_bytes, ref_counter_handle=rc_handle,
            ref_counter_offset=rc_offset, event_handle=ev_handle, event_sync_required=ev_sync))
    queue.put(specs)
    event.wait()


def cuda_multiply_two(queue, ready, done):
    ready.set()
    with torch.cuda.stream(torch.cuda.Stream()):
        cuda_event, tensor = queue.get()
        cuda_event.wait()
        tensor.mul_(2)
        cuda_event.record()
        done.set()
        del cuda_event


def autograd_sharing(queue, ready, master_modified, device, is_parameter):
    var = queue.get()
    ready.set()
    master_modified.wait()
    expected_var = torch.arange(1.0, 26, device=device).view(5, 5)
    expected_var[0, 0] = 1000
    is_ok = var.data.equal(expected_var)
    var.data[:] = torch.ones(5, 5, device=device)
    is_ok &= var.grad is None
    is_ok &= not var._backward_hooks
    if is_parameter:
        is_ok &= type(var) is Parameter
    else:
        is_ok &= type(var) is torch.Tensor
    var._grad = torch.ones(5, 5, device=device)
    torch.cuda.synchronize()
    queue.put(is_ok)


def mixed_type_producer(queue, event):
    for _ in range(10):
        float_tensor = torch.ones(2, 2).float().cuda()
        byte_tensor = torch.zeros(2, 2).byte().cuda()
        queue.put(float_tensor)
        queue.put(byte_tensor)
        event.wait()
        event.clear()


def requires_grad_variable_sharing(queue, ready):
    var = queue.get()
    ready.set()
    queue.put(var.requires_grad)


def integer_parameter_serialization(iparam):
    iparam + 1


def _deadlock_actor(queue, iterations):
    for _ in range(iterations):
        if not queue.empty():
            queue.get()
        time.sleep(0.01)


def _deadlock_learner(queue, iterations):
    net = torch.nn.LSTM(1, 1).cuda()
    for _ in range(iterations):
        if not queue.full():
            queue.put({k: v.clone() for k, v in net.state_dict().items()})
        time.sleep(0.01)


def read_large(queue, out, done):
    t = queue.get()
    out.put((t[0].item(), t[-1].item(), int(t.sum().item())))
    t[len(t) // 2] = 7
    torch.cuda.synchronize()
    del t
    done.wait()


def hold_and_release(queue, out, release):
    t = queue.get()
    out.put(float(t.sum().item()))
    release.wait()
    del t
    import gc

    gc.collect()
    out.put("released")
    time.sleep(1)


def bad_handle_child(out):
    out.put(os.getpid())


def two_device_child(queue, out, done):
    torch.cuda.set_device(1)
    x = queue.get()  # opened in this process; it stays on the producer's GPU 0
    same = x.to("cuda:1")
    wide = x.to("cuda:1", torch.float64)  # a conversion: a kernel, across GPUs when P2P is on
    torch.cuda.synchronize(1)
    out.put((x.device.index, same.device.index, bool(torch.equal(same.cpu(), x.cpu())),
             float(wide.sum().item())))
    r = torch.arange(1 << 16, device="cuda:1", dtype=torch.int32) * 3
    out.put(r)
    done.wait()
    del x, r


# ---- tests (parent side) ----


class Skip(Exception):
    """A test that cannot run on this machine (printed as SKIP with the reason, never a pass)."""


def _ctx():
    return mp.get_context("spawn")


def _join(*ps):
    for p in ps:
        p.join(WAIT)
        assert not p.is_alive(), f"child {p.pid} still alive after {WAIT}s"


def t_cuda_simple():
    ctx = _ctx()
    # test_fill
    x = torch.zeros(5, 5).to("cuda", torch.float)
    q, e = ctx.Queue(), ctx.Event()
    data = [x, x[:, 1]]
    q.put(data)
    p = ctx.Process(target=simple_fill, args=(q, e))
    p.daemon = True
    p.start()
    assert e.wait(WAIT), "the child did not fill"
    assert data[0].eq(4).all() and data[1].eq(4).all(), data[0]
    _join(p)
    # test_receive
    q, e = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=send_tensor, args=(q, e, "cuda", torch.float))
    p.daemon = True
    p.start()
    t1, t2 = q.get(timeout=WAIT), q.get(timeout=WAIT)
    assert t1.eq(1).all()
    s1, s2 = t1.untyped_storage(), t2.untyped_storage()
    assert s1.data_ptr() == s2.data_ptr(), "one storage sent twice opens once"
    assert torch.equal(t1, t2)
    del t1, t2, s1, s2
    e.set()
    _join(p)


def t_cuda_memory_allocation():
    ctx = _ctx()
    q, e = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=send_and_delete_tensors, args=(q, e, "cuda", torch.int, 5))
    p.start()
    t = [q.get(timeout=WAIT) for _ in range(5)]
    for i, x in enumerate(t):
        assert torch.equal(x.cpu(), torch.full([5], i, dtype=torch.int32)), (i, x)
    del t, x
    e.set()
    _join(p)


def t_cuda_ipc_deadlock():
    ctx = _ctx()
    queue = ctx.Queue(1)
    ps = [ctx.Process(target=_deadlock_actor, args=(queue, 100)),
          ctx.Process(target=_deadlock_learner, args=(queue, 100))]
    for p in ps:
        p.start()
    _join(*ps)
    for p in ps:
        assert p.exitcode == 0, f"exit code {p.exitcode}"


def t_cuda_send_many():
    count, size = int(os.environ.get("SYMM_IPC_SEND_MANY", "2000")), 5
    ctx = _ctx()
    q1, q2, q3 = ctx.Queue(), ctx.Queue(), ctx.Queue()
    e1, e2, e3 = ctx.Event(), ctx.Event(), ctx.Event()
    p1 = ctx.Process(target=send_and_delete_tensors,
                     args=(q1, e1, "cuda", torch.long, count, size))
    p2 = ctx.Process(target=receive_and_send, args=(q1, q2, e2, count))
    p3 = ctx.Process(target=receive_and_send_sum,
                     args=(q2, q3, e3, "cuda", torch.long, count, size))
    for p in (p1, p2, p3):
        p.start()
    result = q3.get(timeout=WAIT * 4)
    assert result[0].item() == count * (count - 1) // 2, result
    del result
    for e in (e1, e2, e3):
        e.set()
    _join(p1, p2, p3)


def t_cuda_small_tensors():
    ctx = _ctx()
    tensors = [torch.arange(i * 5.0, (i + 1) * 5).cuda() for i in range(5)]
    inq, outq = ctx.Queue(), ctx.Queue()
    inq.put(tensors)
    p = ctx.Process(target=sum_tensors, args=(inq, outq))
    p.start()
    results = [outq.get(timeout=WAIT) for _ in range(5)]
    _join(p)
    for i, (v, device, n) in enumerate(results):
        assert v == torch.arange(i * 5.0, (i + 1) * 5).sum().item(), (i, v)
        assert device == 0 and n == 5, (device, n)
    del tensors
    torch.cuda.ipc_collect()


def t_rebuild_cuda_tensor():
    ctx = _ctx()
    queue, event = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=send_tensor_with_untyped_storage, args=(queue, event))
    p.start()
    specs = queue.get(timeout=WAIT)
    tensors = [mp.reductions.rebuild_cuda_tensor(**spec) for spec in specs]
    assert [t.item() for t in tensors] == [1, 1], tensors
    del tensors, specs
    event.set()
    _join(p)


def t_event():
    ctx = _ctx()
    queue, ready, done = ctx.Queue(), ctx.Event(), ctx.Event()
    p = ctx.Process(target=cuda_multiply_two, args=(queue, ready, done))
    p.start()
    ready.wait(WAIT)
    with torch.cuda.stream(torch.cuda.Stream()):
        tensor = torch.ones(4, device="cuda")
        event = torch.cuda.Event(interprocess=True)
        torch.cuda._sleep(20000000)  # about 30 ms: without the event the multiply comes first
        tensor.add_(1)
        event.record()
        queue.put((event, tensor))
        assert done.wait(WAIT)
        event.synchronize()
        assert tensor.tolist() == [4, 4, 4, 4], tensor
    _join(p)


def _autograd_sharing(var, is_parameter=False):
    ctx = _ctx()
    ready, master_modified, queue = ctx.Event(), ctx.Event(), ctx.Queue()
    p = ctx.Process(target=autograd_sharing,
                    args=(queue, ready, master_modified, "cuda", is_parameter))
    p.daemon = True
    p.start()

    @torch.utils.hooks.unserializable_hook
    def hook(*unused):
        pass

    if var.requires_grad:
        var.register_hook(hook)
    var._grad = torch.zeros(5, 5, device="cuda")
    queue.put(var)
    assert ready.wait(WAIT)
    var.data[0, 0] = 1000
    var.grad.data[:] = torch.ones(5, 5, device="cuda") * 4
    torch.cuda.synchronize()
    master_modified.set()
    assert queue.get(timeout=WAIT), "the child saw wrong data, grad or type"
    assert torch.equal(var.data, torch.ones(5, 5, device="cuda")), var.data
    assert torch.equal(var.grad.data, torch.ones(5, 5, device="cuda") * 4)
    _join(p)


def t_cuda_variable_sharing():
    for requires_grad in (True, False):
        var = torch.arange(1.0, 26, device="cuda").view(5, 5).requires_grad_(requires_grad)
        _autograd_sharing(var)


def t_cuda_parameter_sharing():
    _autograd_sharing(Parameter(torch.arange(1.0, 26, device="cuda").view(5, 5)), True)


def t_mixed_types_cuda_sharing():
    ctx = _ctx()
    all_ones, all_zeros = torch.ones(2, 2).float(), torch.zeros(2, 2).byte()
    queue, event = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=mixed_type_producer, args=(queue, event))
    p.start()
    for _ in range(10):
        f, b = queue.get(timeout=WAIT), queue.get(timeout=WAIT)
        assert torch.equal(f.cpu(), all_ones) and torch.equal(b.cpu(), all_zeros), (f, b)
        del f, b
        event.set()
    _join(p)


def t_leaf_variable_sharing():
    for requires_grad in (True, False):
        var = torch.arange(1.0, 26, device="cuda").view(5, 5).requires_grad_(requires_grad)
        ctx = _ctx()
        ready, queue = ctx.Event(), ctx.Queue()
        p = ctx.Process(target=requires_grad_variable_sharing, args=(queue, ready))
        p.daemon = True
        p.start()
        queue.put(var)
        assert ready.wait(WAIT)
        assert queue.get(timeout=WAIT) == requires_grad
        _join(p)


def t_integer_parameter_serialization():
    param = Parameter(torch.tensor(0, dtype=torch.int64, device="cuda"), requires_grad=False)
    p = _ctx().Process(target=integer_parameter_serialization, args=(param,))
    p.start()
    _join(p)
    assert p.exitcode == 0, f"exit code {p.exitcode}"


def t_empty_tensor_sharing():
    for dtype in (torch.float32, torch.int64):
        q = mp.Queue()
        empty = torch.tensor([], dtype=dtype, device="cuda")
        q.put(empty)
        out = q.get(timeout=WAIT)
        assert out.numel() == 0 and out.dtype == dtype and out.is_cuda


def t_large_tensor():
    n = 300 << 20
    ctx = _ctx()
    t = torch.ones(n, dtype=torch.uint8, device="cuda")
    t[0], t[-1] = 3, 5
    q, out, done = ctx.Queue(), ctx.Queue(), ctx.Event()
    p = ctx.Process(target=read_large, args=(q, out, done))
    p.start()
    q.put(t)
    first, last, total = out.get(timeout=WAIT)
    assert (first, last, total) == (3, 5, n + 6), (first, last, total)
    done.set()
    _join(p)
    assert t[n // 2].item() == 7, "the child's write is not in the parent's tensor"
    del t


def t_producer_frees():
    ctx = _ctx()
    torch.cuda.ipc_collect()
    base = torch.cuda.memory_allocated()
    t = torch.full((16 << 20,), 2.0, device="cuda")  # 64 MiB
    q, out, release = ctx.Queue(), ctx.Queue(), ctx.Event()
    p = ctx.Process(target=hold_and_release, args=(q, out, release))
    p.start()
    q.put(t)
    assert out.get(timeout=WAIT) == 2.0 * (16 << 20)
    del t
    torch.cuda.ipc_collect()
    held = torch.cuda.memory_allocated() - base
    assert held >= 64 << 20, f"the producer let go of memory a consumer holds ({held} bytes)"
    release.set()
    assert out.get(timeout=WAIT) == "released"
    _join(p)
    deadline = time.time() + 10
    while time.time() < deadline:
        torch.cuda.ipc_collect()
        if torch.cuda.memory_allocated() - base < 64 << 20:
            break
        time.sleep(0.1)
    left = torch.cuda.memory_allocated() - base
    assert left < 64 << 20, f"the memory stayed after the consumer let go ({left} bytes)"


def t_bad_handles():
    import struct

    ctx = _ctx()
    q = ctx.Queue()
    p = ctx.Process(target=bad_handle_child, args=(q,))
    p.start()
    gone = q.get(timeout=WAIT)
    _join(p)
    consumer_is_symmalloc = _installed() == "cpp"
    # The running torch's handle version (2, or 3 with the handle type in the header), from a
    # real handle: the first byte of any handle either allocator makes.
    from torch.multiprocessing.reductions import reduce_tensor

    version = reduce_tensor(torch.ones(1, device="cuda"))[1][7][0]
    header = struct.pack("=i4xQQ", gone, 2 << 20, 1)
    if version >= 3:
        header += struct.pack("=i4x", 1)  # handle type: POSIX fd
    cases = [
        (bytes([version]) + b"x" + bytes(24), "type byte"),
        (bytes([version]) + b"e" + header + struct.pack("=i", 3), "is gone"),
    ]
    for handle, want in cases:
        try:
            torch.UntypedStorage._new_shared_cuda(0, handle, 64, 0, b"", 0, b"", False)
        except Exception as e:  # noqa: BLE001
            if consumer_is_symmalloc:
                assert want in str(e), f"want '{want}' in: {e}"
        else:
            raise AssertionError(f"a bad handle opened: {handle!r}")


def t_two_devices():
    found = torch.cuda.device_count()
    if found < 2:
        raise Skip(f"needs 2 GPUs, found {found}")
    n = 1 << 20
    ctx = _ctx()
    x = torch.arange(n, device="cuda:0", dtype=torch.float32)
    q, out, done = ctx.Queue(), ctx.Queue(), ctx.Event()
    p = ctx.Process(target=two_device_child, args=(q, out, done))
    p.daemon = True  # a failed assertion here leaves it waiting on `done`: it goes with this process
    p.start()
    q.put(x)
    dev, dev_copy, equal, total = out.get(timeout=WAIT)
    assert (dev, dev_copy) == (0, 1), f"the child saw the tensor on GPU {dev}, its copy on {dev_copy}"
    assert equal, "the child's copy on GPU 1 differs from the GPU 0 tensor it got"
    assert total == n * (n - 1) / 2, f"the float64 conversion on GPU 1 summed to {total}"
    r = out.get(timeout=WAIT)
    assert r.device.index == 1, f"the child's GPU 1 tensor opened on GPU {r.device.index}"
    want = torch.arange(1 << 16, dtype=torch.int32) * 3
    assert torch.equal(r.cpu(), want), "the child's GPU 1 tensor reads wrong in the parent"
    assert torch.equal(r.to("cuda:0").cpu(), want), "its copy to GPU 0 reads wrong"
    del r
    done.set()
    _join(p)


TESTS = {name[2:]: fn for name, fn in globals().items() if name.startswith("t_")}


def run_config(parent, child, only):
    """In this process: install `parent`, name `child` for spawned children, run the tests;
    prints one RESULT line per test."""
    _setup(parent)
    os.environ["SYMM_IPC_ALLOC"] = child
    torch.zeros(1, device="cuda")  # CUDA up outside the tests
    have = _installed()
    want = "cpp" if parent == "symmalloc" else None
    if parent == "symmalloc" and have != want:
        print(f"RESULT * FAIL symmalloc is not installed (installed() = {have})", flush=True)
        return
    for name, fn in TESTS.items():
        if only and name not in only:
            continue
        t0 = time.time()
        try:
            fn()
            print(f"RESULT {name} PASS {time.time() - t0:.1f}s", flush=True)
        except Skip as e:
            print(f"RESULT {name} SKIP {e}", flush=True)
        except Exception as e:  # noqa: BLE001
            msg = " ".join(f"{type(e).__name__}: {e}".split())[:400]
            print(f"RESULT {name} FAIL {msg}", flush=True)
        torch.cuda.ipc_collect()


def main():
    if len(sys.argv) >= 4 and sys.argv[1] == "--run":
        run_config(sys.argv[2], sys.argv[3], set(sys.argv[4:]))
        return 0
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    configs = {"symmalloc": [("symmalloc", "symmalloc")], "torch": [("torch", "torch")],
               "mixed": [("symmalloc", "torch"), ("torch", "symmalloc")]}.get(mode)
    if configs is None:
        print(__doc__)
        return 2
    only = sys.argv[2:]
    counts = {name: [0, 0, 0] for name in TESTS if not only or name in only}
    # An expandable-segment handle (symmalloc's, or PyTorch's with expandable segments) is
    # opened with pidfd_getfd: a ptrace check. Yama's scope 1 lets only a parent take from its
    # children, so a parent producer's tensor fails in a child without CAP_SYS_PTRACE.
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            scope = f.read().strip()
    except OSError:
        scope = "absent (no Yama)"
    print(f"kernel {os.uname().release}, kernel.yama.ptrace_scope {scope}, uid {os.getuid()}")
    if not torch.cuda.is_available():
        reason = "no CUDA GPU visible (torch.cuda.is_available() is False)"
        for name in counts:
            print(f"SKIP {name}: {reason}")
            counts[name][2] += 1
    else:
        for parent, child in configs:
            label = f"parent {parent}, children {child}"
            cmd = [sys.executable, os.path.abspath(__file__), "--run", parent, child, *only]
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
                lines, tail = r.stdout.splitlines(), (r.stdout + r.stderr)[-3000:]
            except subprocess.TimeoutExpired as e:
                lines, tail = (e.stdout or b"").decode(errors="replace").splitlines(), "timeout"
                r = None
            seen = set()
            for line in lines:
                if not line.startswith("RESULT "):
                    continue
                _, name, verdict, *rest = line.split(" ", 3)
                print(f"{verdict} {name} [{label}] {' '.join(rest)}")
                if name == "*":
                    for n in counts:
                        counts[n][1] += 1
                        seen.add(n)
                    continue
                seen.add(name)
                counts[name][{"PASS": 0, "SKIP": 2}.get(verdict, 1)] += 1
            for name in counts:
                if name not in seen:
                    print(f"FAIL {name} [{label}] no result (the run died)")
                    counts[name][1] += 1
            if r is None or r.returncode != 0 or len(seen) < len(counts):
                rc = None if r is None else r.returncode
                print(f"--- output of [{label}] (rc {rc}):\n{tail}")
    print(f"\n{'test':34} pass fail skip")
    for name, (ok, bad, skip) in counts.items():
        print(f"{name:34} {ok:4} {bad:4} {skip:4}")
    failed = sum(c[1] for c in counts.values())
    print(f"ipc_check {mode}: {sum(c[0] for c in counts.values())} passed, {failed} failed, "
          f"{sum(c[2] for c in counts.values())} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
