"""CUDA graphs in global mode on one GPU: symmalloc as PyTorch's allocator
(``symmalloc.install_global()``), against PyTorch's own allocator as the control.

    python3 python/tests/global_capture_check.py symmalloc|torch [CHECK ...]

Each check captures a small MLP training step (forward and backward: PyTorch runs the backward
on its autograd device thread, not the capturing one), replays it, and compares the replayed
loss and gradient with the same step run eagerly before the capture, on the same weights and
inputs. Live eager tensors filled with a sentinel are held during the replays: a graph whose
memory overlaps them overwrites the sentinel. The checks:
  backward_in_pool      the backward's temporaries belong to the capture's pool, not to the
                        default pool that later eager work reuses;
  shared_pool           four graphs of decreasing batch captured into one pool, each after an
                        eager warm-up of its size (bench/global_memory.py's third phase);
  adopted_segments      a capture after eager work on its stream takes the segments that work
                        left cached (less new memory than the same capture without them), and
                        replays correctly from them;
  empty_cache_live      torch.cuda.empty_cache() while a graph is alive: the graph's memory
                        stays;
  release_shared        a pool shared by two graphs: deleting the first (PyTorch releases the
                        pool) leaves the second's memory in place;
  other_stream_free     a block of the pool made on another stream is freed during a capture
                        into that pool: the capture goes on and both graphs replay correctly;
  grown_segments        a capture's request just larger than its pool's free tail grows that
                        segment in place (symmalloc) and the output across both chunks replays
                        correctly;
  record_stream_reuse   a block recorded on a side stream (Tensor.record_stream) and freed is
                        not reused by the main stream before the side stream's work is done
                        (global mode's record_stream hook).
Prints PASS/FAIL per check; exits 1 if any failed."""
import gc
import os
import sys
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import torch  # noqa: E402

ALLOC = sys.argv[1] if len(sys.argv) > 1 else "symmalloc"
if ALLOC == "symmalloc":
    import symmalloc  # noqa: E402

    symmalloc.install_global()  # before any CUDA use
torch.cuda.set_device(0)
torch.manual_seed(0)
MAIN = threading.get_ident()
BACKWARD_THREADS = set()


class Probe(torch.autograd.Function):
    """Identity that records which thread runs its backward."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        BACKWARD_THREADS.add(threading.get_ident())
        return g * 1.0


def mlp():
    return torch.nn.Sequential(
        torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 2048), torch.nn.GELU(),
        torch.nn.Linear(2048, 512),
    ).cuda()


class Step:
    """loss = mean(mlp(x)^2) and its backward, for a fixed x of `batch` rows."""

    def __init__(self, model, batch):
        self.model = model
        self.x = torch.randn(batch, 512, device="cuda")

    def __call__(self):
        loss = Probe.apply(self.model(self.x)).square().mean()
        loss.backward()
        return loss, self.model[0].weight.grad

    def reference(self, side):
        """Warms up on `side` (as PyTorch's docs do before a capture) and returns the last
        eager loss and gradient, copied."""
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                self.model.zero_grad(set_to_none=True)
                loss, grad = self()
        torch.cuda.current_stream().wait_stream(side)
        ref = (loss.detach().clone(), grad.clone())
        self.model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return ref


def capture(step, pool=None, stream=None, via_context=True):
    g = torch.cuda.CUDAGraph()
    if via_context:
        with torch.cuda.graph(g, pool=pool, stream=stream):
            out = step()
    else:  # without torch.cuda.graph's empty_cache: what eager work cached stays cached
        s = stream or torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            g.capture_begin(pool=pool)
            out = step()
            g.capture_end()
        torch.cuda.current_stream().wait_stream(s)
    step.model.zero_grad(set_to_none=True)
    return g, out


def sentinels(mib=256, each=4):
    """Live eager tensors over `mib` MiB, every element 7."""
    return [torch.full((each << 18,), 7.0, device="cuda") for _ in range(mib // each)]


def check_replay(g, out, ref, guards, what):
    g.replay()
    torch.cuda.synchronize()
    loss, grad = out
    bad = sum(int((t != 7.0).any().item()) for t in guards)
    assert bad == 0, f"{what}: the replay overwrote {bad} of {len(guards)} live eager tensors"
    assert torch.allclose(loss, ref[0], rtol=1e-4, atol=1e-6), f"{what}: loss {loss.item()} vs eager {ref[0].item()}"
    assert torch.allclose(grad, ref[1], rtol=1e-3, atol=1e-6), \
        f"{what}: gradient differs from the eager one by up to {(grad - ref[1]).abs().max().item():.3g}"


def backward_in_pool():
    side = torch.cuda.Stream()
    step = Step(mlp(), 1024)
    ref = step.reference(side)
    g, out = capture(step)
    guards = sentinels()
    for _ in range(3):
        check_replay(g, out, ref, guards, "graph")
    others = BACKWARD_THREADS - {MAIN}
    print(f"  (backward ran on {'the autograd device thread' if others else 'the capturing thread'})")


def shared_pool():
    side = torch.cuda.Stream()
    model = mlp()
    pool = torch.cuda.graph_pool_handle()
    graphs = []
    for b in [2048, 512, 128, 32]:
        step = Step(model, b)
        ref = step.reference(side)  # the other work: an eager warm-up of this size
        g, out = capture(step, pool=pool)
        graphs.append((g, out, ref, b, step))  # the step keeps the graph's input alive
    guards = sentinels()
    for g, out, ref, b, _ in graphs:  # in capture order, as a shared pool requires
        check_replay(g, out, ref, guards, f"graph of batch {b}")


def adopted_segments():
    """The same capture twice on one stream, without torch.cuda.graph's empty_cache: the first
    after nothing was cached for that stream, the second after eager work on it left freed
    segments of sizes a capture's requests fit (a capture may take only segments no other stream
    used: an eager stream cannot be joined into it). With symmalloc the second takes them and
    creates less memory; both replay correctly. (PyTorch's private pools never take cached
    memory: there both grow alike.)"""
    side = torch.cuda.Stream()
    cap = torch.cuda.Stream()
    step = Step(mlp(), 2048)
    ref = step.reference(side)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()

    def grown(after_work):
        if after_work:
            cap.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(cap):
                junk = [torch.empty(s, device="cuda", dtype=torch.uint8).fill_(3) for s in [16 << 20, 24 << 20, 40 << 20] * 2]
                del junk
            torch.cuda.synchronize()
        r0 = symmalloc.memory_stats(0)["reserved_bytes"] if ALLOC == "symmalloc" else torch.cuda.memory_reserved()
        g, out = capture(step, stream=cap, via_context=False)
        torch.cuda.synchronize()
        r1 = symmalloc.memory_stats(0)["reserved_bytes"] if ALLOC == "symmalloc" else torch.cuda.memory_reserved()
        check_replay(g, out, ref, sentinels(64), "graph" + (" on adopted segments" if after_work else ""))
        return g, out, r1 - r0

    g1, o1, first = grown(False)
    del g1, o1
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    g2, o2, second = grown(True)
    print(f"  (the capture grew reserved memory by {first >> 20} MiB with nothing cached, "
          f"{second >> 20} MiB after eager work on its stream)")
    if ALLOC == "symmalloc":
        assert second < first, "the capture took none of the segments cached for its stream"
    check_replay(g2, o2, ref, sentinels(64), "graph on adopted segments, again")


def grown_segments():
    """A capture whose second request is just larger than the free tail of the segment its
    first made: symmalloc maps what the request lacks right after that segment (one segment of
    two chunks, 34 MiB) where PyTorch's pool makes a second segment (20 + 30 MiB). The output
    that spans both chunks replays correctly, on fresh inputs each time."""
    n_small, n_big = 3 << 18, 30 << 18  # 3 MiB and 30 MiB of fp32
    x = torch.randn(n_big, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # nothing cached for the capture to take (docs/memory.md, donors)
    r0 = symmalloc.memory_stats(0)["reserved_bytes"] if ALLOC == "symmalloc" else torch.cuda.memory_reserved()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        a = x[:n_small] * 2
        b = x * 3
        b.add_(1)  # in place: one 30 MiB request
    torch.cuda.synchronize()
    r1 = symmalloc.memory_stats(0)["reserved_bytes"] if ALLOC == "symmalloc" else torch.cuda.memory_reserved()
    guards = sentinels(64)
    for i in range(3):
        x.copy_(torch.randn(n_big, device="cuda"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(a, x[:n_small] * 2), f"replay {i}: the first output differs from eager"
        bad = int((b != x * 3 + 1).sum().item())
        assert bad == 0, f"replay {i}: {bad} of {n_big} elements of the output across both chunks differ"
        hit = sum(int((t != 7.0).any().item()) for t in guards)
        assert hit == 0, f"replay {i} overwrote {hit} of {len(guards)} live eager tensors"
    grew = (r1 - r0) >> 20
    print(f"  (the capture grew reserved memory by {grew} MiB)")
    if ALLOC == "symmalloc":
        assert grew == 34, f"expected one 20 MiB segment grown by 14 MiB, got {grew} MiB"


def empty_cache_live():
    side = torch.cuda.Stream()
    step = Step(mlp(), 1024)
    ref = step.reference(side)
    g, out = capture(step)
    torch.cuda.empty_cache()
    guards = sentinels()
    check_replay(g, out, ref, guards, "graph after empty_cache")


def release_shared():
    side = torch.cuda.Stream()
    model = mlp()
    pool = torch.cuda.graph_pool_handle()
    s1, s2 = Step(model, 1024), Step(model, 256)
    r1 = s1.reference(side)
    g1, o1 = capture(s1, pool=pool)
    r2 = s2.reference(side)
    g2, o2 = capture(s2, pool=pool)
    check_replay(g1, o1, r1, [], "first graph")
    del g1, o1
    gc.collect()
    torch.cuda.empty_cache()
    guards = sentinels()
    check_replay(g2, o2, r2, guards, "second graph after the first was deleted")


def other_stream_free():
    side = torch.cuda.Stream()
    other = torch.cuda.Stream()
    model = mlp()
    pool = torch.cuda.graph_pool_handle()
    s1, s2 = Step(model, 1024), Step(model, 512)
    r1 = s1.reference(side)
    g1, o1 = capture(s1, pool=pool, stream=other)  # the pool's blocks on `other`
    r2 = s2.reference(side)
    keep = torch.zeros(1, device="cuda")
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2, pool=pool):
        del o1  # frees g1's output blocks (made on `other`) into the pool, mid-capture
        o2 = s2()
        keep.add_(1)
    s2.model.zero_grad(set_to_none=True)
    guards = sentinels()
    check_replay(g2, o2, r2, guards, "graph captured while another stream's blocks were freed")
    del g1
    gc.collect()
    check_replay(g2, o2, r2, guards, "the same after the other graph was deleted")


def record_stream_reuse():
    """A block used on a side stream and recorded there (Tensor.record_stream) is not handed to
    the main stream before the side stream's work is done, though it was freed at once."""
    side = torch.cuda.Stream()
    n = 16 << 20
    x = torch.ones(n, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s: the side stream reads x long after the free
        y = x * 2
    x.record_stream(side)
    del x
    z = torch.empty(n, device="cuda")  # the same size, on the main stream
    z.fill_(5.0)
    torch.cuda.synchronize()
    bad = int((y != 2).sum().item())
    assert bad == 0, f"{bad} of {n} elements read on the side stream were overwritten by the main stream"


CHECKS = [backward_in_pool, shared_pool, adopted_segments, grown_segments, empty_cache_live, release_shared,
          other_stream_free, record_stream_reuse]


def main():
    want = sys.argv[2:]
    failed = 0
    for c in CHECKS:
        if want and c.__name__ not in want:
            continue
        try:
            c()
            print(f"PASS {c.__name__}", flush=True)
        except AssertionError as e:
            failed += 1
            print(f"FAIL {c.__name__}: {e}", flush=True)
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    print(f"{ALLOC}: {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
