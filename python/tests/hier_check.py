"""One rank of a simulated multi-host job (test_hier.py starts the ranks; each gets its host
from SYMMALLOC_HOST_ID, and the env:// variables of torch.distributed):
    python hier_check.py MODE
On the host backend (CPU tensors, gloo between "hosts") or on GPUs (``HIER_DEVICE`` set: the
ranks' CUDA device; gloo between "hosts" unless ``HIER_INTER=nccl``). Modes:

- ``collectives``: every collective of a HierCommunicator, every path (auto, small, sliced,
  flat; ``HIER_NO_FLAT=1`` leaves flat out), every dtype and op, in and out of place, odd sizes, against a float64 reference on
  fresh random data with poisoned outputs; every rank's bits equal; the custom ops eager and
  under torch.compile(fullgraph=True) with 0 graph breaks (on GPUs with NCCL between hosts also
  mode="reduce-overhead": CUDA graphs);
- ``mixed``: Communicator.from_process_group over several hosts is refused on every rank;
- ``uneven``: a HierCommunicator over hosts of different sizes is refused on every rank;
- ``device``: a rank without its GPU is named on every rank;
- ``leave``: the last rank leaves after setup; every other rank's next call fails, naming ranks.

Prints ``OK <mode> ...`` on success; exits non-zero with the failures otherwise. With
``HIER_PROGRESS=1`` also a line per step, with the seconds since the start."""
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import symmalloc  # noqa: E402
import symmalloc.ops as sops  # noqa: E402

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-5}
PATHS = ("auto", "small", "sliced", "flat")
FAILURES = []


def fail(msg):
    FAILURES.append(f"rank {dist.get_rank()}: {msg}")


_T0 = time.monotonic()


def progress(what):
    """With HIER_PROGRESS=1, one line per step (where a case that runs past its time stopped)."""
    if os.environ.get("HIER_PROGRESS") == "1":
        print(f"[{time.monotonic() - _T0:7.1f} s] {what}", flush=True)


def data(seed, rank, shape, dtype, dev):
    g = torch.Generator().manual_seed(seed * 977 + rank)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * 2).to(dtype).to(dev)


def reduce_ref(xs, op):
    s = torch.stack([x.double().cpu() for x in xs])
    return {"sum": s.sum(0), "max": s.max(0).values, "min": s.min(0).values, "abs": s.abs().sum(0)}[op]


def compare(what, got, want, dtype, op="sum", scale=None):
    """``got`` against the float64 ``want``: exact for max and min; for sums, the error relative
    to ``scale`` (the sum of the addends' magnitudes, so that a sum that cancels is judged by
    the rounding its addends allow)."""
    got = got.double().cpu()
    if tuple(got.shape) != tuple(want.shape):
        return fail(f"{what}: shape {tuple(got.shape)}, want {tuple(want.shape)}")
    if not torch.isfinite(got).all():
        return fail(f"{what}: not every element written ({got.flatten()[:4].tolist()})")
    if op != "sum":  # max and min are exact
        if not torch.equal(got, want.to(dtype).double()):
            fail(f"{what}: differs from the exact {op}")
        return
    ref = want if scale is None else scale
    err = ((got - want).norm() / ref.norm().clamp_min(1e-30)).item()
    if err > TOL[dtype]:
        fail(f"{what}: rel err {err:.3g} > {TOL[dtype]}")


def same_everywhere(what, t):
    """Every rank of the world holds the same bits."""
    bits = t.detach().contiguous().cpu().view(-1).view(torch.uint8).to(torch.int32)
    every = [torch.empty_like(bits) for _ in range(dist.get_world_size())]
    dist.all_gather(every, bits)
    if not all(torch.equal(e, every[0]) for e in every):
        fail(f"{what}: the ranks' bits differ")


def collectives(comm, dev, world, rank, full):
    """Every collective by every path against float64; ``full``: every dtype (else bf16 and
    fp32), and max and min. Returns the number of cases."""
    seed = int(os.environ.get("HIER_SEED", "1"))
    case = 0
    L, N = comm.local_size, comm.nodes
    dtypes = DTYPES if full else (torch.bfloat16, torch.float32)
    # HIER_NO_FLAT: the group's own NCCL cannot run where ranks of two "hosts" share a GPU.
    paths = [p for p in PATHS if p != "flat" or os.environ.get("HIER_NO_FLAT") != "1"]
    for path in paths:
        comm.path = path
        for dtype in dtypes:
            progress(f"collectives: path {path}, {dtype}")
            ops = ("sum", "max", "min") if full and dtype == torch.float32 else ("sum",)
            for op in ops:
                for n in (1, 2 * world + 1, 1000):
                    for inplace in (True, False):
                        case += 1
                        xs = [data(seed + case, r, (n,), dtype, dev) for r in range(world)]
                        x = xs[rank].clone()
                        what = f"all_reduce {path} {dtype} {op} n={n} {'in' if inplace else 'out of'} place"
                        if inplace:
                            comm.all_reduce(x, op=op)
                            got = x
                        else:
                            got = torch.full_like(x, float("nan"))
                            comm.all_reduce(x, op=op, out=got)
                            if not torch.equal(x, xs[rank]):
                                fail(f"{what}: the input changed")
                        compare(what, got, reduce_ref(xs, op), dtype, op, reduce_ref(xs, "abs"))
                        same_everywhere(what, got)
            for op in ops[:2]:
                for m, rest in ((1, ()), (64, ()), (2, (5,))):
                    for inplace in (True, False):
                        case += 1
                        xs = [data(seed + case, r, (world * m,) + rest, dtype, dev) for r in range(world)]
                        x = xs[rank].clone()
                        what = f"reduce_scatter {path} {dtype} {op} m={m}x{rest} {'in' if inplace else 'out of'} place"
                        out = x[rank * m:(rank + 1) * m] if inplace else torch.full((m,) + rest, float("nan"), dtype=dtype, device=dev)
                        comm.reduce_scatter(out, x, op=op)
                        compare(what, out, reduce_ref(xs, op)[rank * m:(rank + 1) * m], dtype, op,
                                reduce_ref(xs, "abs")[rank * m:(rank + 1) * m])
                        case += 1
                        xs = [data(seed + case, r, (m,) + rest, dtype, dev) for r in range(world)]
                        what = f"all_gather {path} {dtype} m={m}x{rest} {'in' if inplace else 'out of'} place"
                        out = torch.full((world * m,) + rest, float("nan"), dtype=dtype, device=dev)
                        if inplace:
                            out[rank * m:(rank + 1) * m].copy_(xs[rank])
                            comm.all_gather(out, out[rank * m:(rank + 1) * m])
                        else:
                            comm.all_gather(out, xs[rank].clone())
                        if not torch.equal(out.cpu(), torch.cat([v.cpu() for v in xs])):
                            fail(f"{what}: not every rank's block in rank order")
            if dtype == torch.float32:
                continue
            for tokens, hidden in ((1, 8), (5, 136)):
                for given_out in (False, True):
                    case += 1
                    xs = [data(seed + case, r, (tokens, hidden), dtype, dev) for r in range(world)]
                    res0 = data(seed + case, 1000, (tokens, hidden), dtype, dev)
                    w = (1 + 0.1 * data(seed + case, 2000, (hidden,), torch.float32, dev)).to(dtype)
                    res = res0.clone()
                    out = torch.full_like(res, float("nan")) if given_out else None
                    got = comm.all_reduce_add_rms_norm(xs[rank].clone(), res, w, eps=1e-6, out=out)
                    what = f"all_reduce_add_rms_norm {path} {dtype} [{tokens}, {hidden}]"
                    r64 = reduce_ref(xs, "sum") + res0.double().cpu()
                    want = r64 * torch.rsqrt(r64.square().mean(-1, keepdim=True) + 1e-6) * w.double().cpu()
                    compare(what + " residual", res, r64, dtype, scale=reduce_ref(xs, "abs") + res0.double().cpu().abs())
                    compare(what + " out", got, want, dtype)
                    if given_out and got.data_ptr() != out.data_ptr():
                        fail(f"{what}: did not return out")
                    same_everywhere(what, got)
    comm.path = "auto"
    # The model's choices at this shape (bench/NOTES.md tabulates them).
    cost = symmalloc.HierCost()
    for coll in ("all_reduce", "reduce_scatter", "all_gather", "all_reduce_add_rms_norm"):
        for nbytes in (8 << 10, 1 << 20, 64 << 20):
            want = cost.choose(coll, nbytes, N, L)
            if coll in ("reduce_scatter", "all_gather") and not comm._node_major:
                want = "flat"
            if comm.plan(coll, nbytes) != want:
                fail(f"plan {coll} {nbytes}: {comm.plan(coll, nbytes)}, the model says {want}")
    return case


def custom_ops(comm, dev, world, rank, graphs):
    """The custom ops take the HierCommunicator unchanged: eager, compiled, with CUDA graphs.
    On CPU tensors torch.compile runs Dynamo and AOT autograd (``aot_eager``: fullgraph, the
    ops' fakes and functionalized mutations) but not Inductor's C++ code generation, which
    would cost each of the ranks minutes on a CI machine; on GPUs, Inductor."""
    dtype, hidden = torch.bfloat16, 64
    tokens = 2 * world
    ln = (1 + 0.1 * data(7, 3000, (hidden,), torch.float32, dev)).to(dtype)

    def block(x, residual):
        summed = sops.all_reduce(x, comm)
        res = residual + 0
        normed = sops.all_reduce_add_rms_norm(x, res, ln, comm, eps=1e-6)
        sp = sops.all_gather(sops.reduce_scatter(x * 2, comm), comm)
        mx = x * 1
        sops.all_reduce_(mx, comm, op="max")
        return summed, normed, res, sp, mx

    backend = "aot_eager" if dev == "cpu" else "inductor"
    modes = [("eager", block), (f"compiled ({backend})", torch.compile(block, fullgraph=True, backend=backend))]
    if graphs:
        modes.append(("compiled+cudagraphs", torch.compile(block, fullgraph=True, mode="reduce-overhead")))
    torch._dynamo.utils.counters.clear()
    for mode, fn in modes:
        for step in range(4):
            progress(f"custom ops: {mode}, step {step}")
            xs = [data(100 + step, r, (tokens, hidden), dtype, dev) for r in range(world)]
            res0 = data(200 + step, 0, (tokens, hidden), dtype, dev)
            got = [t.clone() for t in fn(xs[rank].clone(), res0)]
            progress(f"custom ops: {mode}, step {step} issued; checking")
            s64 = reduce_ref(xs, "sum")
            r64 = s64 + res0.double().cpu()
            want = [s64, r64 * torch.rsqrt(r64.square().mean(-1, keepdim=True) + 1e-6) * ln.double().cpu(), r64,
                    2 * s64, reduce_ref(xs, "max")]
            for name, a, b in zip(("all_reduce", "fused out", "fused residual", "rs+ag", "max"), got, want):
                compare(f"op {mode} step {step} {name}", a, b, dtype, "max" if name == "max" else "sum",
                        2 * reduce_ref(xs, "abs") + res0.double().cpu().abs())
                same_everywhere(f"op {mode} step {step} {name}", a)
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    if breaks:
        fail(f"graph breaks: {dict(torch._dynamo.utils.counters['graph_break'])}")
    return [m for m, _ in modes]


def expect_refused(what, fn, says):
    t0 = time.monotonic()
    try:
        fn()
    except symmalloc.SymmallocError as e:
        for s in says:
            if s not in str(e):
                fail(f"{what}: the message lacks {s!r}: {e}")
        return time.monotonic() - t0, str(e)
    fail(f"{what}: not refused")
    return time.monotonic() - t0, ""


def main():
    mode = sys.argv[1]
    rank = int(os.environ["RANK"])
    dev = "cpu"
    device = None
    if "HIER_DEVICE" in os.environ:
        device = int(os.environ["HIER_DEVICE"])
        torch.cuda.set_device(device)
        dev = f"cuda:{device}"
    inter = os.environ.get("HIER_INTER")
    backend = "gloo" if dev == "cpu" or inter != "nccl" else "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=60))
    world = dist.get_world_size()
    hosts = os.environ.get("HIER_HOSTS", "")
    detail = ""
    if mode == "collectives":
        comm = symmalloc.from_process_group(device=device, inter_backend=inter)
        if not isinstance(comm, symmalloc.HierCommunicator):
            fail(f"from_process_group over {hosts} gave {type(comm).__name__}")
        full = os.environ.get("HIER_FULL", "1") == "1"
        progress(f"{comm!r}")
        cases = collectives(comm, dev, world, rank, full)
        progress(f"collectives: {cases} cases done; custom ops")
        ops = custom_ops(comm, dev, world, rank, graphs=dev != "cpu" and inter == "nccl") if full else []
        if dev != "cpu":
            progress("custom ops checked; synchronizing the device")
            torch.cuda.synchronize()
        progress("barrier")
        comm.barrier()
        progress("barrier passed; close")
        detail = f"{comm!r}: {cases} cases" + (f", custom ops {', '.join(ops)}, 0 graph breaks" if ops else "")
        if "compiled+cudagraphs" in ops:
            # As HierCommunicator.close() asks: the CUDA graphs that captured the NCCL group's
            # collectives go first. With them alive, destroying the group never returned (2x H200,
            # torch 2.11, NCCL 2.28.9, 2026-11-27); released first, the case passed.
            import gc
            torch._dynamo.reset()
            gc.collect()
            progress("compiled graphs released")
        if comm.local is not None:
            comm.local.close()
            progress("node-local communicator closed")
        comm.close()
        progress("closed")
    elif mode == "mixed":
        secs, msg = expect_refused("Communicator.from_process_group over hosts",
                                   lambda: symmalloc.Communicator.from_process_group(device=device),
                                   ("spans 2 hosts", "'node-0'", "'node-1'", "group rank(s) 0-1", "group rank(s) 2-3",
                                    "HierCommunicator"))
        detail = f"refused in {secs:.2f} s: {msg}"
        if secs > 10:
            fail(f"the refusal took {secs:.1f} s")
    elif mode == "uneven":
        secs, msg = expect_refused("HierCommunicator over 3 + 1", lambda: symmalloc.HierCommunicator.from_process_group(),
                                   ("different numbers of ranks", "group rank(s) 0-2", "group rank(s) 3", "refused"))
        detail = f"refused in {secs:.2f} s: {msg}"
    elif mode == "device":
        bad = 99 if dev != "cpu" and rank == 1 else device
        says = ("every rank of the group needs its GPU", "group rank 1 on host")
        secs, msg = expect_refused("a rank without its GPU", lambda: symmalloc.from_process_group(device=bad), says)
        detail = f"refused in {secs:.2f} s: {msg}"
    elif mode == "leave":
        comm = symmalloc.HierCommunicator.from_process_group(path=os.environ.get("HIER_PATH", "sliced"))
        x = torch.ones(64)
        comm.all_reduce(x)
        comm.barrier()
        if rank == world - 1:
            os._exit(0)  # leaves without a word, as a crash would
        time.sleep(0.5)
        secs, msg = expect_refused("a call after a rank left", lambda: comm.all_reduce(x), ())
        detail = f"failed in {secs:.2f} s: {msg}"
        if secs > 30:
            fail(f"the failure took {secs:.1f} s")
        print(f"OK {mode} rank {rank}: {detail}", flush=True)
        os._exit(1 if FAILURES else 0)  # the group cannot be torn down cleanly any more
    else:
        raise SystemExit(f"unknown mode {mode}")
    if FAILURES:
        print("\n".join(FAILURES[:30]), flush=True)
        sys.exit(1)
    print(f"OK {mode} rank {rank}: {detail}", flush=True)
    progress("destroying the process group")
    dist.destroy_process_group()
    progress("done")


if __name__ == "__main__":
    main()
