"""Two GPUs in one process with symmalloc as PyTorch's global allocator (the device machine with 2
GPUs; not collected by pytest). Standalone: stdlib + torch (+ triton where installed).

    python3 python/tests/global_multigpu_check.py symmalloc   # symmalloc.install_global(allocator="cpp")
    python3 python/tests/global_multigpu_check.py torch       # control: PyTorch's own allocator

Checks, each printing PASS name, FAIL name: error or SKIP name: reason, then one closing line;
exit code 1 if any failed. With fewer than 2 GPUs every check is skipped with the count found,
and it exits 0. A skip is never a pass.

  copies       cuda:0 -> cuda:1 and back: contiguous (a peer memcpy), transposed and converted
               to float64 (PyTorch's copy kernel, which reads the peer's memory itself when
               P2P is on), exact against the CPU
  peer_kernel  with P2P on (torch.cuda.can_device_access_peer; PyTorch enables peer access,
               and symmalloc grants its segments to the peer): a Triton kernel on GPU 1 reads
               a GPU 0 tensor directly and writes its double into a GPU 1 tensor; then again on
               a tensor in memory GPU 0 reserved after access was granted (a new 300 MiB
               segment), which must be readable too. SKIP without triton or without P2P
  streams      per device current streams and events: work queued on GPU 1's stream waits on an
               event of GPU 0's stream, and reads the result
"""
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

MODE = sys.argv[1] if len(sys.argv) > 1 else None
if MODE not in ("symmalloc", "torch"):
    sys.exit("usage: global_multigpu_check.py symmalloc|torch")
import torch  # noqa: E402

# Counting devices does not initialize CUDA in PyTorch (torch.cuda.is_initialized() stays False),
# so the allocator can still be chosen after it; without 2 GPUs nothing is installed.
FOUND = torch.cuda.device_count() if torch.cuda.is_available() else 0
if MODE == "symmalloc" and FOUND >= 2:
    import symmalloc  # noqa: E402

    symmalloc.install_global(allocator="cpp")  # before anything allocates on a GPU


class Skip(Exception):
    pass


def check_copies():
    n = 1 << 22
    x = torch.randn(n, device="cuda:0")
    ref = x.cpu()
    y = x.to("cuda:1")
    assert y.device.index == 1 and torch.equal(y.cpu(), ref), "contiguous copy to GPU 1"
    m = x.view(2048, -1)
    t = m.t().to("cuda:1")
    assert torch.equal(t.cpu(), m.cpu().t()), "transposed copy to GPU 1"
    w = x.to("cuda:1", torch.float64)
    assert torch.equal(w.cpu(), ref.double()), "float64 conversion on the way to GPU 1"
    back = (y * 2).to("cuda:0")
    assert torch.equal(back.cpu(), ref * 2), "copy back to GPU 0"


def check_peer_kernel():
    if not torch.cuda.can_device_access_peer(1, 0):
        raise Skip("GPU 1 cannot access GPU 0 (no P2P)")
    try:
        import triton
        import triton.language as tl
    except ImportError as e:
        raise Skip(f"triton not importable ({e})") from None

    @triton.jit
    def double(src, dst, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst + i, tl.load(src + i, mask=i < n) * 2, mask=i < n)

    # PyTorch enables peer access (and calls the allocator's enablePeerAccess) on its first
    # cross-device copy; the kernel below then reads GPU 0's memory from GPU 1 with no copy.
    torch.zeros(1, device="cuda:0").to("cuda:1")
    for label, n in (("a tensor of an existing segment", 1 << 20),
                     ("a tensor in a segment reserved after access was granted", 300 << 18)):
        src = torch.randn(n, device="cuda:0")
        dst = torch.full((n,), float("nan"), device="cuda:1")
        with torch.cuda.device(1):
            double[(triton.cdiv(n, 1024),)](src, dst, n, BLOCK=1024)
        torch.cuda.synchronize(1)
        assert torch.equal(dst.cpu(), src.cpu() * 2), f"GPU 1 read {label} on GPU 0 wrong"


def check_streams():
    s0 = torch.cuda.Stream(device=0)
    s1 = torch.cuda.Stream(device=1)
    a = torch.zeros(1 << 20, device="cuda:0")
    s0.wait_stream(torch.cuda.current_stream(0))  # the zeros first
    with torch.cuda.stream(s0):
        torch.cuda._sleep(50_000_000)
        a.add_(3)
        ev = torch.cuda.Event()
        ev.record(s0)
    with torch.cuda.stream(s1):
        s1.wait_event(ev)
        b = a.to("cuda:1", non_blocking=True) + 1
    s1.synchronize()
    assert torch.equal(b.cpu(), torch.full((1 << 20,), 4.0)), "GPU 1 ran before GPU 0's event"


CHECKS = {"copies": check_copies, "peer_kernel": check_peer_kernel, "streams": check_streams}


def main():
    counts = [0, 0, 0]
    for name, fn in CHECKS.items():
        if FOUND < 2:
            print(f"SKIP {name}: needs 2 GPUs, found {FOUND}")
            counts[2] += 1
            continue
        t0 = time.time()
        try:
            fn()
            print(f"PASS {name} ({time.time() - t0:.1f}s)")
            counts[0] += 1
        except Skip as e:
            print(f"SKIP {name}: {e}")
            counts[2] += 1
        except Exception as e:  # noqa: BLE001
            print(f"FAIL {name}: {type(e).__name__}: {e}")
            traceback.print_exc(limit=4)
            counts[1] += 1
    if MODE == "symmalloc" and FOUND >= 2:
        import symmalloc.memory

        assert symmalloc.memory.installed() == "cpp", symmalloc.memory.installed()
    print(f"global_multigpu_check {MODE}: {counts[0]} passed, {counts[1]} failed, {counts[2]} skipped")
    return 1 if counts[1] else 0


if __name__ == "__main__":
    sys.exit(main())
