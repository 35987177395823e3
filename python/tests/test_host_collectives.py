"""The Python all-reduce path end to end on the host backend (no GPU, no torch): two processes,
real shared memory, duck-typed tensors over symm_malloc'd host memory. Runs in CI under
``SYMMALLOC_BACKEND=host`` (the Makefile's second pytest pass); skipped, with the reason, on the
CUDA backend, where python/tests/torch_gpu_check.py covers the same path on GPUs."""
import ctypes
import multiprocessing as mp
import os
import random

import pytest

import symmalloc

pytestmark = pytest.mark.skipif(
    os.environ.get("SYMMALLOC_BACKEND") != "host",
    reason="needs SYMMALLOC_BACKEND=host (GPU runs use torch_gpu_check.py)",
)


class _DType:
    def __init__(self, name):
        self.name = name

    def __str__(self):
        return f"torch.{self.name}"


FLOAT32 = _DType("float32")


class HostTensor:
    """What Communicator.all_reduce reads of a torch tensor, over host memory."""

    def __init__(self, ptr, n, dtype=FLOAT32, contiguous=True, shape=None):
        self.ptr, self.n, self.dtype, self.contiguous = ptr, n, dtype, contiguous
        self.shape = (n,) if shape is None else shape

    def data_ptr(self):
        return self.ptr

    def numel(self):
        return self.n

    def is_contiguous(self):
        return self.contiguous

    def get_device(self):
        return -1

    def values(self):
        return list((ctypes.c_float * self.n).from_address(self.ptr))

    def fill(self, vals):
        (ctypes.c_float * self.n).from_address(self.ptr)[:] = vals


def _inputs(seed, rank, n):
    g = random.Random(seed * 1000 + rank)
    return [ctypes.c_float(g.uniform(-4, 4)).value for _ in range(n)]


def _rank(rank, world, uid, q, compiled=False):
    try:
        lib = symmalloc._library()
        comm = symmalloc.Communicator(rank, world, uid)
        fallbacks = []
        if compiled:
            # The compiled eager caller, for these duck-typed tensors as for torch.Tensor; calls
            # it hands back to the Python method are counted.
            dtypes = {FLOAT32: 2, _DType("bfloat16"): 0, _DType("float16"): 1}
            assert comm._compile_eager(HostTensor, dtypes, lambda dev: 0), "the compiled module is not loaded"
            assert "all_reduce" in comm.__dict__ and type(comm.all_reduce).__name__ == "builtin_function_or_method"
            method = symmalloc.Communicator.all_reduce

            def counted(self, *args, **kwargs):
                fallbacks.append(kwargs)
                return method(self, *args, **kwargs)

            symmalloc.Communicator.all_reduce = counted
        results = []
        for case, (n, algo, op, in_place) in enumerate(
            [(1, "auto", "sum", True), (1001, "one_shot", "sum", False), (4099, "two_shot", "max", True),
             (777, "one_shot_ll", "min", False), (65_537, "auto", "sum", False)]
        ):
            a = lib.symm_malloc(4 * n, rank, None)
            b = lib.symm_malloc(4 * n, rank, None)
            x, out = HostTensor(a, n), HostTensor(b, n)
            x.fill(_inputs(case, rank, n))
            out.fill([float("nan")] * n)
            comm.all_reduce(x, op=op, algo=algo, out=None if in_place else out)
            results.append((x if in_place else out).values())
            lib.symm_free(a, 4 * n, rank, None)
            lib.symm_free(b, 4 * n, rank, None)
        # Reduce-scatter and all-gather through the same wrappers.
        n = 1001
        a = lib.symm_malloc(4 * n * world, rank, None)
        b = lib.symm_malloc(4 * n * world, rank, None)
        big, small = HostTensor(a, n * world), HostTensor(b, n)
        big.fill(_inputs(100, rank, n * world))
        small.fill([float("nan")] * n)
        comm.reduce_scatter(small, big)
        results.append(small.values())
        small.fill(_inputs(200, rank, n))
        comm.all_gather(big, small)
        results.append(big.values())
        try:
            comm.reduce_scatter(HostTensor(b, n + 1), big)
        except symmalloc.SymmallocError as e:
            results.append(str(e))
        lib.symm_free(a, 4 * n * world, rank, None)
        lib.symm_free(b, 4 * n * world, rank, None)
        # The fused all-reduce + residual + RMSNorm (fp16: two bytes per element).
        tokens, hidden = 3, 64
        bufs = [lib.symm_malloc(2 * tokens * hidden, rank, None) for _ in range(3)]
        wbuf = lib.symm_malloc(2 * hidden, rank, None)
        h16 = lambda p, vals: (ctypes.c_uint16 * len(vals)).from_address(p).__setitem__(slice(None), vals)  # noqa: E731
        import struct
        half = lambda v: struct.unpack("<H", struct.pack("<e", v))[0]  # noqa: E731
        xs = _inputs(300, rank, tokens * hidden)
        rs = _inputs(301, 9, tokens * hidden)
        h16(bufs[0], [half(v) for v in xs])
        h16(bufs[1], [half(v) for v in rs])
        h16(wbuf, [half(1.0)] * hidden)
        F16 = _DType("float16")
        mat = (tokens, hidden)
        comm.all_reduce_add_rms_norm(HostTensor(bufs[0], tokens * hidden, F16, shape=mat), HostTensor(bufs[1], tokens * hidden, F16, shape=mat),
                                     HostTensor(wbuf, hidden, F16), eps=1e-6, out=HostTensor(bufs[2], tokens * hidden, F16, shape=mat))
        read16 = lambda p, k: [struct.unpack("<e", struct.pack("<H", v))[0] for v in (ctypes.c_uint16 * k).from_address(p)]  # noqa: E731
        results.append((read16(bufs[1], tokens * hidden), read16(bufs[2], tokens * hidden)))
        for p in bufs:
            lib.symm_free(p, 2 * tokens * hidden, rank, None)
        lib.symm_free(wbuf, 2 * hidden, rank, None)
        # Errors the Python side reports before the library is called.
        p = lib.symm_malloc(64, rank, None)
        errors = []
        for kwargs in [dict(op="avg"), dict(algo="fast"), dict(out=HostTensor(p, 8))]:
            try:
                comm.all_reduce(HostTensor(p, 16), **kwargs)
            except symmalloc.SymmallocError as e:
                errors.append(str(e))
        for t in [HostTensor(p, 16, dtype=_DType("int64")), HostTensor(p, 16, contiguous=False)]:
            try:
                comm.all_reduce(t)
            except symmalloc.SymmallocError as e:
                errors.append(str(e))
        comm.barrier()
        lib.symm_free(p, 64, rank, None)
        kept = comm.all_reduce
        comm.close()
        if compiled:
            results.append(len(fallbacks))
            try:  # a caller kept past close() must not reach the freed communicator
                kept(HostTensor(p, 16))
            except symmalloc.SymmallocError as e:
                errors.append(str(e))
        q.put((rank, results, errors, None))
    except Exception as e:  # reported to the parent, never a hang
        q.put((rank, None, None, repr(e)))


@pytest.mark.parametrize("compiled", [False, True], ids=["python", "compiled"])
def test_two_processes_reduce_through_the_python_path(compiled):
    """The same calls, results and errors through the Python method and through the compiled
    eager caller (symmalloc/_fastcall.c) that Communicator puts in front of it."""
    if compiled and symmalloc._fast_all_reduce() is None:
        pytest.skip("symmalloc._fastcall is not built (make test-python builds it; the wheel has it)")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    uid = symmalloc.get_unique_id()
    procs = [ctx.Process(target=_rank, args=(r, 2, uid, q, compiled)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict()
    for _ in procs:
        rank, results, errors, failure = q.get(timeout=120)
        assert failure is None, f"rank {rank}: {failure}"
        got[rank] = (results, errors)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    cases = [(1, "sum"), (1001, "sum"), (4099, "max"), (777, "min"), (65_537, "sum")]
    for case, (n, op) in enumerate(cases):
        a, b = _inputs(case, 0, n), _inputs(case, 1, n)
        fold = {"sum": lambda u, v: u + v, "max": max, "min": min}[op]
        want = [fold(u, v) for u, v in zip(a, b)]
        for rank in (0, 1):
            out = got[rank][0][case]
            assert all(abs(o - w) <= 1e-5 * max(1.0, abs(w)) for o, w in zip(out, want)), (case, rank)
        assert got[0][0][case] == got[1][0][case], f"case {case}: ranks differ bitwise"
    n = 1001
    for rank in (0, 1):
        rs, ag, shape_error = got[rank][0][5], got[rank][0][6], got[rank][0][7]
        ins = [_inputs(100, r, 2 * n) for r in (0, 1)]
        want = [ins[0][rank * n + i] + ins[1][rank * n + i] for i in range(n)]
        assert all(abs(o - w) <= 1e-5 * max(1.0, abs(w)) for o, w in zip(rs, want)), rank
        assert ag == _inputs(200, 0, n) + _inputs(200, 1, n), f"rank {rank}: all-gather differs"
        assert "the gathered tensor has shape [2002] and the per-rank one [1002]" in shape_error, shape_error
    # The fused call: residual = sum of x + residual, out = its RMS norm (weight 1), fp16.
    import struct
    r16 = lambda v: struct.unpack("<e", struct.pack("<e", v))[0]  # noqa: E731
    tokens, hidden = 3, 64
    xs = [[r16(v) for v in _inputs(300, r, tokens * hidden)] for r in (0, 1)]
    rs = [r16(v) for v in _inputs(301, 9, tokens * hidden)]
    want_r = [xs[0][i] + xs[1][i] + rs[i] for i in range(tokens * hidden)]
    want_o = []
    for t in range(tokens):
        row = want_r[t * hidden:(t + 1) * hidden]
        inv = (sum(v * v for v in row) / hidden + 1e-6) ** -0.5
        want_o += [v * inv for v in row]
    for rank in (0, 1):
        got_r, got_o = got[rank][0][8]
        assert all(abs(g - w) <= 2e-3 * max(1.0, abs(w)) for g, w in zip(got_r, want_r)), rank
        assert all(abs(g - w) <= 2e-3 * max(1.0, abs(w)) for g, w in zip(got_o, want_o)), rank
    assert got[0][0][8] == got[1][0][8], "the fused outputs differ between ranks"
    errors = got[0][1]
    if compiled:
        # Only the five bad calls went back to the Python method; the five good ones did not.
        assert got[0][0][9] == 5 and got[1][0][9] == 5, (got[0][0][9], got[1][0][9])
        assert "is not a live Communicator" in errors.pop(), "a kept caller after close()"
    assert len(errors) == 5, errors
    assert "op 'avg'" in errors[0] and "algo 'fast'" in errors[1]
    assert "out must be contiguous with the tensor's dtype and size" in errors[2]
    assert "dtype torch.int64 is not" in errors[3] and "contiguous" in errors[4]
    assert all(e.startswith("SYMM_ERR_INVALID_ARGUMENT") for e in errors)
