"""Memory history under threads on a GPU (the device machine, ONE GPU; not collected by pytest):
a Python thread runs backward passes, whose CUDA allocations happen on autograd's device thread
with the GIL released, while the main thread takes memory snapshots holding the GIL, history
recorded with Python stacks (PyTorch's recorder takes the GIL). A recorder called under an
allocator lock deadlocks here; a watchdog ends the run after 120 s with every thread's stack.

    python python/tests/history_threads_check.py symmalloc   # symmalloc.install_global("cpp")
    python python/tests/history_threads_check.py torch       # control: PyTorch's allocator

Prints one line ``PASS history_threads: ...`` or ``FAIL history_threads: ...``; exit code 1 on
failure. The host-backend version (no GPU): python/tests/test_torch_history.py."""

import faulthandler
import sys
import threading
import time


def main(which):
    if which == "symmalloc":
        import symmalloc

        symmalloc.install_global(allocator="cpp")
    elif which != "torch":
        print(f"usage: {sys.argv[0]} symmalloc|torch")
        return 2
    import torch

    if not torch.cuda.is_available():
        print("SKIP history_threads: no CUDA device")
        return 0
    # The watchdog is re-armed at every snapshot: it fires when one snapshot (or the trainer,
    # below) makes no progress for 90 s, which is a deadlock, not a slow machine. The trace is
    # bounded (20,000 entries) so a snapshot's cost stays bounded while it grows.
    faulthandler.dump_traceback_later(90, exit=True)
    torch.cuda.memory._record_memory_history(max_entries=20000, stacks="python")
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).cuda()
    errors, steps = [], [0]

    def train():
        try:
            for _ in range(200):
                x = torch.randn(64, 1024, device="cuda", requires_grad=True)
                model(x).square().sum().backward()  # allocations on autograd's device thread
                model.zero_grad(set_to_none=True)
                steps[0] += 1
        except Exception as e:  # noqa: BLE001: reported below
            errors.append(repr(e))

    t = threading.Thread(target=train)
    start = time.time()
    t.start()
    snaps, seen, last = 0, 0, time.time()
    while t.is_alive() or snaps < 20:
        torch.cuda.memory._snapshot()  # holds the GIL while it reads the allocator
        snaps += 1
        faulthandler.dump_traceback_later(90, exit=True)
        if steps[0] != seen:
            seen, last = steps[0], time.time()
        elif t.is_alive() and time.time() - last > 90:
            faulthandler.dump_traceback(all_threads=True)
            print(f"FAIL history_threads ({which}): the trainer made no progress for 90 s at step "
                  f"{steps[0]} ({snaps} snapshots)")
            return 1
        time.sleep(0.005)  # the trainer's Python side gets the GIL between snapshots
    t.join()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    faulthandler.cancel_dump_traceback_later()
    allocs = sum(1 for tr in snap["device_traces"] for e in tr if e["action"] == "alloc")
    took = time.time() - start
    if errors or steps[0] != 200 or allocs == 0:
        print(f"FAIL history_threads ({which}): steps {steps[0]}, {snaps} snapshots, "
              f"{allocs} alloc entries, errors {errors}")
        return 1
    print(f"PASS history_threads ({which}): 200 backward passes beside {snaps} snapshots in "
          f"{took:.1f} s, {allocs} alloc entries in the trace")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "symmalloc"))
