"""Expert parallelism from Python (symmalloc.moe over symm_moe_*, docs/moe.md) on the host backend:
ranks are processes, tensors live in host memory. Runs under ``SYMMALLOC_BACKEND=host`` (the
Makefile's second pytest pass); GPU runs: python/tests/moe_gpu_check.py.

Without torch (every venv): ``HostView`` tensors at 2 and 4 ranks, every rank's inputs
regenerated from per-rank seeds, the layout and ``y`` checked exactly against a pure-Python
reference (exact fp32 ``fmaf`` over k in increasing order, one bf16 rounding); and every bad
input, on every rank or on one, raising on every rank with the rank and the value, the object
usable after.

With torch (the torch venv: ``.toolchain/torch-venv-2.11.0/bin/python -m pytest``), CPU
tensors at 2, 4 and 8 ranks, with moe_gpu_check.py's cases and reference: every rank's x,
topk_idx and topk_weights gathered over gloo; recv_counts, recv_src, the payload rows and FP8
scales against the layout they give; ``y`` bit for bit against fmaf k-ascending + one bf16
rounding (computed exactly) and within bf16 tolerance of float64, bitwise the same over 3
runs; k = 1, 2, 8 x 1, 7, 128, max tokens, int32 and int64 indices, bf16 and FP8; ragged
token counts with empty experts and ranks; every token to one expert (exactly full); errors
raised on every rank naming the rank; a full expert; repeated combines of one dispatch back to
back and a refused combine retried (HostView too, three runs at 2, 4 and 8 ranks); a split
child as the EP group; and ``torch.compile(fullgraph=True)`` with 0 graph breaks, the same bits as eager."""
import ctypes
import functools
import multiprocessing as mp
import os
import random
import re
import struct
import tempfile
import traceback

import pytest

import symmalloc
from error_text import error_of  # noqa: E402
from symmalloc.moe import HostView

HOST = os.environ.get("SYMMALLOC_BACKEND") == "host"
pytestmark = pytest.mark.skipif(not HOST, reason="needs SYMMALLOC_BACKEND=host (GPU runs use moe_gpu_check.py)")


def _have_torch():
    """Whether torch is installed, without importing it (the rank processes import this file,
    and the HostView ones should not pay for torch)."""
    import importlib.util

    return importlib.util.find_spec("torch") is not None


needs_torch = pytest.mark.skipif(not _have_torch(), reason="PyTorch is not installed here (the torch venv runs this)")


# Exact fp32 / bf16 / e4m3 arithmetic in Python floats (doubles) ------------------------------

def f32(v: float) -> float:
    """``v`` rounded to fp32 (nearest even)."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


def _f32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def _f32_of_bits(b: int) -> float:
    return struct.unpack("<f", struct.pack("<I", b & 0xFFFFFFFF))[0]


def _f32_next(f: float, up: bool) -> float:
    """The fp32 neighbour of fp32 ``f`` towards +inf (``up``) or -inf."""
    if f == 0.0:
        tiny = _f32_of_bits(1)
        return tiny if up else -tiny
    b = _f32_bits(f)
    away = (f > 0) == up  # moving away from zero increases the magnitude bits
    return _f32_of_bits(b + 1 if away else b - 1)


def fmaf(a: float, b: float, c: float) -> float:
    """fp32 ``fmaf(a, b, c)``: a * b + c rounded once to fp32 (nearest even), for fp32 a, c and a
    bf16 b (a * b is exact in a double). The double sum s is corrected by its exact error
    (TwoSum): s rounds to the same fp32 as the exact value unless s is a midpoint of two fp32
    values, where the error's sign decides."""
    p = a * b
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)
    f = f32(s)
    if err == 0.0 or f == s:
        return f
    g = _f32_next(f, s > f)
    if s - f == g - s:  # s is a midpoint: the exact value lies on err's side of it
        return g if (err > 0) == (g > f) else f
    return f


def bf16_value(bits: int) -> float:
    return _f32_of_bits(bits << 16)


def bf16_bits(v: float) -> int:
    """fp32 ``v`` rounded to bf16 (nearest even), as bits (no NaN here)."""
    b = _f32_bits(v)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF


def _e4m3(byte: int) -> float:
    s = -1.0 if byte & 0x80 else 1.0
    e, m = (byte >> 3) & 0xF, byte & 7
    if e == 0:
        return s * m * 2.0 ** -9
    return s * (1 + m / 8) * 2.0 ** (e - 7)


E4M3 = [_e4m3(b) for b in range(256)]


# HostView cases (no torch) ------------------------------------------------------------------------

T_MAX = 24  # max_tokens_per_rank
TOPK = 8
NUM_EXPERTS = 16  # a multiple of 2 and 4
H_BF16, H_FP8 = 128, 256  # FP8: two scales per row


class Case:
    def __init__(self, name, dtype, k, tokens, routing="random", idx_dtype="int32"):
        self.name, self.dtype, self.k, self.tokens, self.routing, self.idx_dtype = name, dtype, k, tokens, routing, idx_dtype

    def n(self, rank):
        return self.tokens(rank) if callable(self.tokens) else self.tokens


CASES = [
    Case("k=1, 7 tokens", "bf16", 1, 7),
    Case("k=2, 1 token, int64 indices", "bf16", 2, 1, idx_dtype="int64"),
    Case("k=8, max tokens", "bf16", 8, T_MAX),
    Case("k=2, empty experts and ranks, 0/7/24/1 tokens", "bf16", 2, lambda r: (0, 7, T_MAX, 1)[r % 4], routing="subset"),
    Case("k=4, every token to one expert, max tokens", "bf16", 4, T_MAX, routing="one"),
    Case("fp8 k=2, 7 tokens", "fp8", 2, 7),
    Case("fp8 k=8, max tokens, int64 indices", "fp8", 8, T_MAX, idx_dtype="int64"),
]


def gen(case, seed, rank):
    """Rank ``rank``'s inputs of a case: x (bf16 bits or e4m3 bytes, flat), scales (FP8),
    topk_idx and topk_weights (lists of rows). Fresh random data, never zeros."""
    rng = random.Random(seed * 7919 + rank)
    n, k = case.n(rank), case.k
    H = H_BF16 if case.dtype == "bf16" else H_FP8
    if case.dtype == "bf16":  # |v| in [0.5, 4): sign, exponent 126..128, 7 random mantissa bits
        x = [(rng.getrandbits(1) << 15) | ((126 + rng.randrange(3)) << 7) | rng.getrandbits(7) for _ in range(n * H)]
        scales = None
    else:
        x = [b ^ 1 if b & 0x7F == 0x7F else b for b in (rng.getrandbits(8) for _ in range(n * H))]  # no NaN
        scales = [f32(rng.uniform(0.01, 1.0)) for _ in range(n * H // 128)]
    idx = []
    for _ in range(n):
        if case.routing == "one":
            row = [5] + [-1] * (k - 1)
        elif case.routing == "subset":  # even experts of the lower half: the others get nothing
            row = rng.sample(range(0, NUM_EXPERTS // 2, 2), k)
        else:
            row = [e if rng.random() > 0.15 else -1 for e in rng.sample(range(NUM_EXPERTS), k)]
        idx.append(row)
    w = [[f32(rng.uniform(-1.0, 1.0)) for _ in range(k)] for _ in range(n)]
    return x, scales, idx, w


def expert_fn(e: int, payload, scales, H: int, fp8: bool, shift: int = 0):
    """What the test's expert e does to a row (bf16 bits out): the row (FP8: dequantized with
    its scales, rounded to fp32) times 2^-((e + shift) % 3), rounded to bf16 (three shifts: three
    different experts)."""
    f = 2.0 ** -((e + shift) % 3)
    if fp8:
        return [bf16_bits(f32(E4M3[payload[j]] * scales[j // 128]) * f) for j in range(H)]
    return [bf16_bits(bf16_value(b) * f) for b in payload]


def reference_y(x, scales, idx, w, H, fp8, shift=0):
    """y (bf16 bits, flat) by the contract: fmaf over k in increasing order, one rounding."""
    y = []
    for t, row in enumerate(idx):
        acc = [0.0] * H
        for kk, e in enumerate(row):
            if e < 0:
                continue
            out = expert_fn(e, x[t * H:(t + 1) * H], None if scales is None else scales[t * (H // 128):(t + 1) * (H // 128)], H, fp8,
                            shift)
            wk = w[t][kk]
            acc = [fmaf(wk, bf16_value(o), a) for o, a in zip(out, acc)]
        y.extend(bf16_bits(a) for a in acc)
    return y


def make(shape, dtype, flat):
    """A HostView of ``dtype`` ('bfloat16' / 'float8_e4m3fn' from bits, 'float32', 'int32',
    'int64') and ``shape`` holding ``flat`` (uninitialized when None)."""
    v = HostView.empty(shape, dtype)
    if flat:
        (symmalloc.moe._CTYPES[dtype] * len(flat)).from_address(v.data_ptr())[:] = flat
    return v


def poison(t, byte=0xFF):
    """Every byte of ``t`` set to ``byte`` (NaN payloads, -1 indices and counts)."""
    if t is not None:
        ctypes.memset(t.data_ptr(), byte, t.numel() * t.element_size())


def inputs(case, data):
    x, scales, idx, w = data
    n, k = len(idx), case.k
    H = H_BF16 if case.dtype == "bf16" else H_FP8
    pay = "bfloat16" if case.dtype == "bf16" else "float8_e4m3fn"
    return (make((n, H), pay, x), make((n, k), case.idx_dtype, [e for r in idx for e in r]),
            make((n, k), "float32", [v for r in w for v in r]),
            None if scales is None else make((n, H // 128), "float32", scales))


def run_case(moe, case, seed, rank, world, runs=3):
    """Dispatch + expert + combine of one case, ``runs`` times on the same inputs (combine's
    handle: none, the MoeDispatch with ``out=``, its handle), every output poisoned first;
    checks the layout and y exactly. Returns y's bits."""
    fp8 = case.dtype == "fp8"
    H = moe.hidden
    L, R, first = moe.local_experts, moe.max_recv, moe.first_expert
    every = [gen(case, seed, s) for s in range(world)]
    x, scales, idx, w = every[rank]
    xt, it, wt, st = inputs(case, every[rank])
    # The expected layout: local expert le's rows in (source rank, token) order.
    want_rows = [[] for _ in range(L)]
    for s in range(world):
        xs, ss, ids, _ = every[s]
        for t, row in enumerate(ids):
            for kk, e in enumerate(row):
                if first <= e < first + L:
                    want_rows[e - first].append(((s * moe.max_tokens_per_rank + t) * moe.topk + kk,
                                                 xs[t * H:(t + 1) * H], None if ss is None else ss[t * (H // 128):(t + 1) * (H // 128)]))
    want_y = reference_y(x, scales, idx, w, H, fp8)
    G = H // 128
    ys = []
    for run in range(runs):
        for t in moe._buffer_views(False):
            poison(t)
        d = moe.dispatch(xt, it, wt, st)
        recv_x, recv_s, counts, h = d
        assert tuple(recv_x.shape) == (L, R, H) and tuple(counts.shape) == (L,) and tuple(d.recv_src.shape) == (L, R)
        assert (recv_s is None) == (not fp8) and d.num_tokens == len(idx) and h.num_tokens == len(idx)
        got_counts = counts.tolist()
        assert got_counts == [len(r) for r in want_rows], f"{case.name} run {run}: recv_counts {got_counts}, want {[len(r) for r in want_rows]}"
        src, pay = d.recv_src.tolist(), recv_x.tolist()
        sc = recv_s.tolist() if fp8 else None
        out = [0xFFFF] * (L * R * H)  # NaN past the counts: combine must not read it
        for le, rows in enumerate(want_rows):
            for j, (code, xrow, srow) in enumerate(rows):
                assert src[le * R + j] == code, f"{case.name}: recv_src[{le}][{j}] = {src[le * R + j]}, want {code}"
                base = (le * R + j) * H
                assert pay[base:base + H] == xrow, f"{case.name}: recv_x[{le}][{j}] is not source row {code}'s payload"
                if fp8:
                    assert sc[(le * R + j) * G:(le * R + j + 1) * G] == srow, f"{case.name}: recv_scales[{le}][{j}]"
                # The expert works on what arrived.
                out[base:base + H] = expert_fn(first + le, pay[base:base + H],
                                               sc[(le * R + j) * G:(le * R + j + 1) * G] if fp8 else None, H, fp8)
        expert_out = make((L, R, H), "bfloat16", out)
        if run == 0:
            y = moe.combine(expert_out)
        elif run == 1:
            y_out = make((len(idx), H), "bfloat16", None)
            poison(y_out)
            y = moe.combine(expert_out, d, out=y_out)
            assert y is y_out
        else:
            y = moe.combine(expert_out, h)
        got = y.tolist()
        assert tuple(y.shape) == (len(idx), H)
        if got != want_y:
            bad = next(i for i, (a, b) in enumerate(zip(got, want_y)) if a != b)
            raise AssertionError(f"{case.name} run {run}: y[{bad // H}][{bad % H}] = 0x{got[bad]:04x}, want 0x{want_y[bad]:04x}")
        ys.append(got)
    assert all(y == ys[0] for y in ys), f"{case.name}: y differs between runs"
    return ys[0]


# Rank processes -------------------------------------------------------------------------------

def _spawn(target, world, *args, timeout=300):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    uid = symmalloc.get_unique_id()
    procs = [ctx.Process(target=target, args=(r, world, uid, q) + args) for r in range(world)]
    for p in procs:
        p.start()
    got, failures = {}, []
    try:
        for _ in procs:
            rank, report, failure = q.get(timeout=timeout)
            if failure is not None:
                failures.append(f"rank {rank}:\n{failure}")
            got[rank] = report
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    assert not failures, "\n".join(failures)
    for p in procs:
        assert p.exitcode == 0, f"exit code {p.exitcode}"
    return got


def _child_env():
    os.environ["SYMMALLOC_TIMEOUT_S"] = "30"  # a hang becomes an error within half a minute


def _cases_rank(rank, world, uid, q):
    try:
        _child_env()
        comm = symmalloc.Communicator(rank, world, uid)
        report = {}
        with comm.moe(T_MAX, H_BF16, TOPK, NUM_EXPERTS, dtype="bf16") as mb, \
                comm.moe(T_MAX, H_FP8, TOPK, NUM_EXPERTS, dtype="float8_e4m3fn") as mf:
            L = NUM_EXPERTS // world
            assert (mb.local_experts, mb.first_expert, mb.max_recv) == (L, rank * L, world * T_MAX), mb
            assert (mb.rank, mb.world_size, mb.dtype, mf.dtype) == (rank, world, "bfloat16", "float8_e4m3fn")
            assert mb.buffer_bytes >= L * world * T_MAX * H_BF16 * 2 and mf.buffer_bytes >= L * world * T_MAX * H_FP8
            for i, case in enumerate(CASES):
                y = run_case(mf if case.dtype == "fp8" else mb, case, 100 + i, rank, world)
                report[case.name] = y[:8]
            # A smaller capacity that fits: the rows are the same, R is smaller.
            with comm.moe(T_MAX, H_BF16, TOPK, NUM_EXPERTS, max_recv_per_expert=16) as mc:
                assert mc.max_recv == 16
                run_case(mc, Case("capacity 16, 3 tokens", "bf16", 2, 3), 300, rank, world, runs=1)
            # An SM budget (num_sms): the same results, whatever the grid.
            with comm.moe(T_MAX, H_BF16, TOPK, NUM_EXPERTS, num_sms=1) as ms:
                for i, case in enumerate(CASES[:5]):
                    if case.dtype == "bf16":
                        assert run_case(ms, case, 100 + i, rank, world, runs=1)[:8] == report[case.name]
        comm.barrier()
        comm.close()
        q.put((rank, report, None))
    except Exception:
        q.put((rank, None, traceback.format_exc()))


@pytest.mark.parametrize("world", [2, 4])
def test_dispatch_combine_exact_hostview(world):
    """The layout and y exactly, through HostView tensors (what callers without torch use)."""
    got = _spawn(_cases_rank, world)
    assert len(got) == world and all(set(r) == {c.name for c in CASES} for r in got.values())


# Repeated and retried combines (docs/moe.md, "Repeated combines") ------------------------------

def _repeat_rank(rank, world, uid, q, rounds):
    """``rounds`` dispatches, each combined 2 or 3 times back to back with different experts
    (every y checked exactly once all were issued), then a combine that rank ``i % world``
    refuses (a float32 expert_out): it raises its own error, every other rank raises naming it;
    at once two more combines, both exact."""
    try:
        _child_env()
        comm = symmalloc.Communicator(rank, world, uid)
        case = Case("repeat", "bf16", 4, T_MAX)
        H, report = H_BF16, []
        with comm.moe(T_MAX, H, TOPK, NUM_EXPERTS) as moe:
            L, R, first = moe.local_experts, moe.max_recv, moe.first_expert
            for i in range(rounds):
                x, _, idx, w = data = gen(case, 5000 + i, rank)
                xt, it, wt, _ = inputs(case, data)
                recv_x, _, counts, h = moe.dispatch(xt, it, wt)
                pay, cnt = recv_x.tolist(), counts.tolist()

                # A round combines with each of the three shifts more than once: the expert's bits
                # and y's reference are computed once per shift, each combine gets a fresh view.
                @functools.lru_cache(maxsize=None)
                def expert_bits(shift):
                    out = [0xFFFF] * (L * R * H)  # NaN past the counts
                    for le in range(L):
                        for j in range(cnt[le]):
                            b = (le * R + j) * H
                            out[b:b + H] = expert_fn(first + le, pay[b:b + H], None, H, False, shift)
                    return out

                def expert_out(shift):
                    return make((L, R, H), "bfloat16", expert_bits(shift))

                @functools.lru_cache(maxsize=None)
                def want_y(shift):
                    return reference_y(x, None, idx, w, H, False, shift)

                def combines(shifts):
                    eos = [expert_out(s) for s in shifts]  # made first: the combines go back to back
                    ys = [moe.combine(eo) for eo in eos]
                    for s, y in zip(shifts, ys):
                        got, want = y.tolist(), want_y(s)
                        assert got == want, f"round {i}: combine with expert shift {s} is not the reference"
                    assert len({tuple(y.tolist()) for y in ys}) == len(ys), "the combines' y are not all different"

                combines([(i + j) % 3 for j in range(2 + i % 2)])
                bad = i % world
                eo = expert_out(i % 3)
                if rank == bad:
                    eo = make((L, R, H), "float32", None)
                msg = error_of(lambda: moe.combine(eo, h))
                want = "expert_out is float32" if rank == bad else f"rank {bad} refused the combine"
                assert msg is not None and want in msg, f"round {i}: {msg!r} lacks {want!r}"
                combines([(i + 1) % 3, (i + 2) % 3])
                report.append(i)
        comm.barrier()
        comm.close()
        q.put((rank, report, None))
    except Exception:
        q.put((rank, None, traceback.format_exc()))


@pytest.mark.parametrize("world", [2, 4, 8])
def test_repeated_combines_each_their_own_and_a_refused_one_retried(world):
    """Combines of one dispatch back to back, each y exact; a refused combine named on every
    rank, then retried. Three runs: a race shows in some runs only."""
    for _ in range(3):
        got = _spawn(_repeat_rank, world, 6)
        assert all(r == list(range(6)) for r in got.values())


# Bad inputs ----------------------------------------------------------------------------------

class Elsewhere:
    """A tensor as the calls read it, but on another device or not contiguous."""

    def __init__(self, t, device=None, contiguous=True):
        self.t, self.device, self.contiguous = t, device, contiguous
        self.shape, self.dtype = t.shape, t.dtype

    def data_ptr(self):
        return self.t.data_ptr()

    def get_device(self):
        return self.t.get_device() if self.device is None else self.device

    def is_contiguous(self):
        return self.contiguous


def _bad_inputs_rank(rank, world, uid, q, only):
    """Every bad input, passed by every rank (``only`` None) or by rank ``only`` while the
    others pass good ones; after each, a good call is checked exactly."""
    try:
        _child_env()
        comm = symmalloc.Communicator(rank, world, uid)
        moe = comm.moe(T_MAX, H_BF16, TOPK, NUM_EXPERTS)
        good = Case("good", "bf16", 2, 7)
        seed = [1000]

        def good_call():
            seed[0] += 1
            run_case(moe, good, seed[0], rank, world, runs=1)

        none_yet = error_of(lambda: moe.combine(make((moe.local_experts, moe.max_recv, H_BF16), "bfloat16", None)))
        good_call()
        H, n, k = H_BF16, 7, 2
        bad_here = only is None or only == rank
        data = gen(good, 999, rank)
        x, idx, w, _ = inputs(good, data)
        f32x = make((n, H), "float32", [1.0] * (n * H))
        wide = make((n, H + 16), "bfloat16", [0x3F80] * (n * (H + 16)))
        many = Case("many", "bf16", 2, T_MAX + 1)
        mx, mi, mw, _ = inputs(many, gen(many, 5, rank))
        fidx = make((n, k), "float32", [1.0] * (n * k))
        k0 = (make((n, 0), "int32", []), make((n, 0), "float32", []))
        kbig = Case("kbig", "bf16", TOPK + 1, n)
        _, bi, bw, _ = inputs(kbig, ([0] * (n * H), None, [[-1] * (TOPK + 1)] * n, [[0.5] * (TOPK + 1)] * n))
        w16 = make((n, k), "bfloat16", [0x3F80] * (n * k))
        scales = make((n, 1), "float32", [1.0] * n)
        host_side = [  # (name, dispatch arguments, what the bad rank's message must name)
            ("x float32", (f32x, idx, w, None), "x has dtype float32; expected bfloat16"),
            ("x hidden", (wide, idx, w, None), f"x has shape [{n}, {H + 16}]; expected [num_tokens, {H}]"),
            ("too many tokens", (mx, mi, mw, None), f"x has {T_MAX + 1} tokens; expected at most {T_MAX}"),
            ("topk_idx float32", (x, fidx, w, None), "topk_idx has dtype float32; expected int32 or int64"),
            ("k = 0", (x, k0[0], k0[1], None), f"topk_idx has shape [{n}, 0]"),
            (f"k = {TOPK + 1}", (x, bi, bw, None), f"topk_idx has shape [{n}, {TOPK + 1}]"),
            ("weights bf16", (x, idx, w16, None), f"topk_weights is bfloat16 [{n}, {k}]; expected float32"),
            ("scales for bf16", (x, idx, w, scales), "x_scales given"),
            ("x on cuda:0", (Elsewhere(x, device=0), idx, w, None), "x is on cuda:0; this object's tensors are on cpu"),
            ("x not contiguous", (Elsewhere(x, contiguous=False), idx, w, None), f"x [7, {H}] is not contiguous"),
        ]
        # (name, message, what it must contain, the rank it must name). Python's refusal names
        # this rank on the refusing rank; the others hear "rank r refused the dispatch".
        named = rank if only is None else only
        report = [("combine before any dispatch", none_yet, "no dispatch to combine", rank)]
        for name, args, what in host_side:
            msg = error_of(lambda: moe.dispatch(*(args if bad_here else (x, idx, w, None))))
            report.append((name, msg, what if bad_here else "refused the dispatch", named))
            good_call()
        # What only the routing shows: every rank reports the bad rank's token, slot and value
        # (the lowest rank's when every rank is bad).
        bad_rank = 0 if only is None else only

        def routed(rows):
            return make((n, k), "int32", [e for r in rows for e in r])

        base = [list(r) for r in data[2]]
        device_side = []
        for name, (t, kk, v) in (("expert = num_experts", (3, 1, NUM_EXPERTS)), ("expert = -2", (5, 0, -2))):
            rows = [list(r) for r in base]
            rows[t][kk] = v
            device_side.append((name, rows, f"topk_idx[{t}][{kk}] = {v} is out of range"))
        rows = [list(r) for r in base]
        rows[4] = [9, 9]
        device_side.append(("expert twice in a token", rows, "topk_idx[4][1] = 9 repeats an expert"))
        for name, rows, what in device_side:
            bad = rank == bad_rank or only is None
            msg = error_of(lambda: (moe.dispatch(x, routed(rows) if bad else idx, w), moe.check()))
            report.append((name, msg, what, bad_rank))
            after = error_of(lambda: moe.combine(make((moe.local_experts, moe.max_recv, H), "bfloat16", None)))
            report.append((f"combine after '{name}'", after, "no dispatch to combine", rank))
            good_call()
        # Capacity: 7 tokens from every rank to expert 0 with room for 4 rows.
        with comm.moe(T_MAX, H_BF16, TOPK, NUM_EXPERTS, max_recv_per_expert=4) as small:
            one = make((n, 1), "int32", [0] * n)
            msg = error_of(lambda: (small.dispatch(x, one, make((n, 1), "float32", [1.0] * n)), small.check()))
            report.append(("capacity", msg, f"would receive {7 * world} rows; expected at most max_recv_per_expert = 4", 0))
            run_case(small, Case("fits", "bf16", 1, 1, routing="one"), 77, rank, world, runs=1)
        # Combine: expert_out of another shape or dtype, a wrong out, a stale handle, a handle
        # of another object.
        L, R = moe.local_experts, moe.max_recv
        eo = make((L, R, H), "bfloat16", [0x3F80] * (L * R * H))
        combine_side = [
            ("expert_out shape", lambda h: moe.combine(make((L, R, H + 16), "bfloat16", None), h),
             f"expert_out is bfloat16 [{L}, {R}, {H + 16}]; expected bfloat16 [{L}, {R}, {H}]"),
            ("expert_out float32", lambda h: moe.combine(make((L, R, H), "float32", None), h),
             f"expert_out is float32 [{L}, {R}, {H}]"),
            ("out shape", lambda h: moe.combine(eo, h, out=make((n + 1, H), "bfloat16", None)),
             f"out is bfloat16 [{n + 1}, {H}]; expected bfloat16 [{n}, {H}]"),
            ("not a handle", lambda h: moe.combine(eo, "handle"), "handle is str; expected what dispatch returned"),
        ]
        for name, call, what in combine_side:
            d = moe.dispatch(x, idx, w)
            msg = error_of(lambda: call(d) if bad_here else moe.combine(eo, d))
            report.append((name, msg, what if bad_here else "refused the combine", named))
            good_call()
        old = moe.dispatch(x, idx, w)
        new = moe.dispatch(x, idx, w)
        msg = error_of(lambda: moe.combine(eo, old if bad_here else new))
        report.append(("stale handle", msg, "the handle is of dispatch" if bad_here else "refused the combine", named))
        good_call()
        moe.close()
        moe.close()  # twice: nothing
        closed = error_of(lambda: moe.dispatch(x, idx, w))
        comm.barrier()
        comm.close()
        q.put((rank, (report, closed), None))
    except Exception:
        q.put((rank, None, traceback.format_exc()))


@pytest.mark.parametrize("world,only", [(2, None), (2, 1), (4, 2)], ids=["every-rank", "rank1-of-2", "rank2-of-4"])
def test_bad_inputs_raise_on_every_rank(world, only):
    got = _spawn(_bad_inputs_rank, world, only)
    for rank, (report, closed) in got.items():
        for name, msg, what, bad in report:
            assert msg is not None, f"rank {rank}, {name}: no error"
            assert msg.startswith("SYMM_ERR_INVALID_ARGUMENT"), f"rank {rank}, {name}: {msg}"
            assert re.search(rf"\brank {bad}\b", msg), f"rank {rank}, {name}: the message does not name rank {bad}: {msg}"
            assert what in msg, f"rank {rank}, {name}: {what!r} not in {msg}"
        assert closed is not None and "was closed" in closed, closed


def _create_rank(rank, world, uid, q):
    """Configurations the library refuses, on one rank or on every rank, and a Moe kept past
    its communicator."""
    try:
        _child_env()
        comm = symmalloc.Communicator(rank, world, uid)
        errors = {
            "experts not a multiple": error_of(lambda: comm.moe(8, 128, 2, 3 * world + 1)),
            "topk above 16": error_of(lambda: comm.moe(8, 128, 17, 4 * world)),
            "fp8 hidden": error_of(lambda: comm.moe(8, 64, 2, 4 * world, dtype="fp8")),
            "dtype": error_of(lambda: comm.moe(8, 128, 2, 4 * world, dtype="float16")),
            "ranks differ": error_of(lambda: comm.moe(8 + rank, 128, 2, 4 * world)),
            "num_sms differs": error_of(lambda: comm.moe(8, 128, 2, 4 * world, num_sms=2 + rank)),
            "num_sms negative": error_of(lambda: comm.moe(8, 128, 2, 4 * world, num_sms=-1)),
            # Refused by the package on the last rank alone: every rank fails at once.
            "one rank's topk": error_of(lambda: comm.moe(8, 128, 0 if rank == world - 1 else 2, 4 * world)),
        }
        m = comm.moe(8, 128, 2, 4 * world)  # the communicator is usable after every refusal
        x, idx, w, _ = inputs(Case("c", "bf16", 1, 1), ([0x3F80] * 128, None, [[0]], [[1.0]]))
        d = m.dispatch(x, idx, w)
        assert d.recv_counts.tolist()[0] == (world if rank == 0 else 0)
        comm.barrier()
        comm.close()
        errors["after the communicator closed"] = error_of(lambda: m.dispatch(x, idx, w))
        m.close()  # gives its buffer back, also now
        q.put((rank, errors, None))
    except Exception:
        q.put((rank, None, traceback.format_exc()))


def test_create_refusals_and_lifetime():
    got = _spawn(_create_rank, 2)
    for rank, errors in got.items():
        for name, msg in errors.items():
            assert msg is not None, f"rank {rank}, {name}: no error"
        assert "num_experts" in errors["experts not a multiple"], errors
        assert "topk" in errors["topk above 16"], errors
        assert "128" in errors["fp8 hidden"], errors
        assert "dtype 'float16'" in errors["dtype"], errors
        assert errors["ranks differ"].startswith("SYMM_ERR_NOT_SYMMETRIC") and "rank 1" in errors["ranks differ"], errors
        assert "communicator of this Moe (rank" in errors["after the communicator closed"], errors
        ns = errors["num_sms differs"]
        assert ns.startswith("SYMM_ERR_NOT_SYMMETRIC") and "num_sms 2" in ns and "num_sms 3" in ns, errors
        assert "num_sms" in errors["num_sms negative"], errors
        one = errors["one rank's topk"]
        if rank == 1:
            assert "topk 0; expected an int" in one, errors
        else:
            assert "rank 1: symm_moe_create_config: config is NULL" in one, errors


# With torch: moe_gpu_check.py's cases on CPU tensors, the reference over gloo --------------------

def _torch_rank(rank, world, uid, q, init, sections):
    import datetime

    import torch
    import torch.distributed as dist

    import moe_gpu_check as g

    results = []
    try:
        _child_env()
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        comm = symmalloc.Communicator(rank, world, uid)
        T, E = 160, 32  # 128 tokens is not the maximum; E a multiple of 2, 4 and 8
        ctx = g.Ctx(rank, world, comm, torch.device("cpu"), "gloo", T=T, H=128, E=E, K=8)
        mb = comm.moe(max_tokens_per_rank=T, hidden=128, topk=8, num_experts=E, dtype=torch.bfloat16)
        mf = comm.moe(max_tokens_per_rank=T, hidden=256, topk=8, num_experts=E, dtype=torch.float8_e4m3fn,
                      max_recv_per_expert=0)
        cases = []
        if "cases" in sections:
            cases += [("cases: " + n, f) for n, f in g.eager_cases(ctx, mb) + g.eager_cases(ctx, mf)]
        if "errors" in sections:
            cases += [("errors: bf16", lambda: g.errors_case(ctx, mb)), ("errors: fp8", lambda: g.errors_case(ctx, mf)),
                      ("errors: capacity", lambda: g.capacity_case(ctx, comm, 128))]
        if "repeat" in sections:
            cases += [("repeat: bf16", lambda: g.repeat_case(ctx, mb)), ("repeat: fp8", lambda: g.repeat_case(ctx, mf))]
        if "split" in sections:
            cases.append(("split: a child as the EP group", lambda: g.split_case(ctx, comm, 128, "gloo")))
        if "compile" in sections:
            cases.append(("compile: fullgraph", lambda: g.compile_case(ctx, mb, "default", backend="aot_eager")))
        if g.run_cases(cases, results):
            mb.close()
            mf.close()
            comm.barrier()
            comm.close()
            dist.destroy_process_group()
        q.put((rank, results, None))
    except Exception:
        q.put((rank, results, traceback.format_exc()))


# World -> the sections its run holds (one spawn per world serves its tests).
SECTIONS = {2: ("cases", "errors", "repeat", "split", "compile"), 4: ("cases", "errors", "repeat", "split"),
            8: ("cases", "errors", "repeat")}


@functools.lru_cache(maxsize=None)
def _torch_world(world):
    """Every rank's results ({rank: [(name, ok, detail, seconds)]}) of this world's sections, or
    the error that stopped the world (kept too: one spawn per world, whatever its tests find)."""
    try:
        with tempfile.TemporaryDirectory() as d:
            init = "file://" + os.path.join(d, "store")
            return _spawn(_torch_rank, world, init, SECTIONS[world]), None
    except Exception as e:  # noqa: BLE001 (every test of this world reports it)
        return None, e


def _section(world, prefix):
    got, error = _torch_world(world)
    if error is not None:
        raise AssertionError(f"the {world}-rank run stopped: {error}")
    failures, names = [], set()
    for rank, results in sorted(got.items()):
        for name, ok, detail, _ in results:
            if name.startswith(prefix + ":"):
                names.add(name)
                if not ok:
                    failures.append(f"rank {rank}, {name}: {detail}")
    assert not failures, "\n".join(failures)
    for rank, results in got.items():  # every rank ran every case of the section
        assert {n for n, *_ in results if n.startswith(prefix + ":")} == names, f"rank {rank} stopped early"
    assert names, f"no {prefix} cases ran"
    return names


@needs_torch
@pytest.mark.parametrize("world", [2, 4, 8])
def test_torch_layout_and_y_against_gathered_reference(world):
    names = _section(world, "cases")
    assert len(names) == 28, sorted(names)  # k 1, 2, 8 x 4 token counts + ragged + one expert, bf16 and fp8


@needs_torch
@pytest.mark.parametrize("world", [2, 4, 8])
def test_torch_errors_raise_on_every_rank_naming_it(world):
    _section(world, "errors")


@needs_torch
@pytest.mark.parametrize("world", [2, 4, 8])
def test_torch_repeated_combines_and_a_refused_one_retried(world):
    assert _section(world, "repeat") == {"repeat: bf16", "repeat: fp8"}


@needs_torch
@pytest.mark.parametrize("world", [2, 4])
def test_torch_split_child_as_the_ep_group(world):
    _section(world, "split")


@needs_torch
def test_torch_compile_fullgraph_no_graph_breaks():
    _section(2, "compile")


# The reference helpers ------------------------------------------------------------------------

def _fmaf_oracle(a, b, c):
    """a * b + c rounded to fp32 (nearest even) in exact rational arithmetic (normal range)."""
    from fractions import Fraction

    v = Fraction(a) * Fraction(b) + Fraction(c)
    if v == 0:
        return 0.0
    sign, v = (-1 if v < 0 else 1), abs(v)
    e = v.numerator.bit_length() - v.denominator.bit_length()
    if Fraction(2) ** e > v:
        e -= 1
    q = v / Fraction(2) ** (e - 23)  # in [2^23, 2^24)
    n, rem = divmod(q.numerator, q.denominator)
    if 2 * rem > q.denominator or (2 * rem == q.denominator and n & 1):
        n += 1
    return sign * float(Fraction(n) * Fraction(2) ** (e - 23))


def _fma_operands(count, seed):
    rng = random.Random(seed)
    out = []
    for i in range(count):
        x = f32(rng.uniform(-2, 2) * 2.0 ** rng.randint(-20, 20))
        y = bf16_value(bf16_bits(f32(rng.uniform(-2, 2))))
        if i % 2:  # c near -x*y's fp32 neighbours: cancellation and midpoints
            c = f32(-x * y + rng.choice([-1, 1]) * 2.0 ** rng.randint(-60, 0) * abs(x * y))
        else:
            c = f32(rng.uniform(-2, 2) * 2.0 ** rng.randint(-40, 40))
        want = _fmaf_oracle(x, y, c)
        if want != 0.0 and abs(want) < 2.0 ** -120:
            continue  # subnormal range: not used by the tests
        out.append((x, y, c, want))
    return out


def test_exact_fma_helper():
    """The reference's fmaf: a double sum that lands on an fp32 midpoint (1.5 + 1.5 * 2^-23 is
    halfway between 1.5 + 2^-23 and 1.5 + 2^-22) is decided by the exact error, a true tie goes
    to even; and random operands, many near midpoints, against exact rational arithmetic."""
    a = f32(1.0 + 2.0 ** -23)
    assert fmaf(a, 1.5, -(2.0 ** -60)) == 1.5 + 2.0 ** -23  # below the midpoint
    assert fmaf(a, 1.5, 2.0 ** -60) == 1.5 + 2.0 ** -22  # above
    assert fmaf(a, 1.5, 0.0) == 1.5 + 2.0 ** -22  # the tie: to even
    assert f32(a * 1.5 - 2.0 ** -60) == 1.5 + 2.0 ** -22  # what a double sum would give
    b = 1.0 + 2.0 ** -7  # a bf16 value: a * b - 1 = 2^-7 + 2^-23 + 2^-30, an fp32 value that
    assert fmaf(a, b, -1.0) == 2.0 ** -7 + 2.0 ** -23 + 2.0 ** -30  # one rounding keeps, and
    assert f32(f32(a * b) - 1.0) == 2.0 ** -7 + 2.0 ** -23  # two roundings lose
    for x, y, c, want in _fma_operands(20000, 5):
        assert fmaf(x, y, c) == want, (x, y, c)
    assert bf16_bits(1.0 + 2.0 ** -8) == 0x3F80 and bf16_bits(1.0 + 3 * 2.0 ** -8) == 0x3F82  # ties to even
    assert bf16_bits(1.0 + 2.0 ** -8 + 2.0 ** -20) == 0x3F81


@needs_torch
def test_vectorized_fma_helper():
    """moe_gpu_check.fmaf_t (the torch reference) against the exact rational one, midpoints
    included, and y's reference against this file's pure-Python one."""
    import torch

    import moe_gpu_check as g

    ops = _fma_operands(20000, 6)
    a, b, c, want = (torch.tensor([o[i] for o in ops], dtype=torch.float64) for i in range(4))
    a = f32(1.0 + 2.0 ** -23)
    mids = [(a, 1.5, -(2.0 ** -60)), (a, 1.5, 2.0 ** -60), (a, 1.5, 0.0), (a, 1.0 + 2.0 ** -7, -1.0)]
    a = torch.cat([torch.tensor([o[0] for o in ops]), torch.tensor([m[0] for m in mids])]).float()
    b = torch.cat([torch.tensor([o[1] for o in ops]), torch.tensor([m[1] for m in mids])]).float()
    c = torch.cat([torch.tensor([o[2] for o in ops]), torch.tensor([m[2] for m in mids])]).float()
    want = torch.cat([want, torch.tensor([_fmaf_oracle(*m) for m in mids], dtype=torch.float64)])
    got = g.fmaf_t(a, b, c)
    bad = (got.double() != want).nonzero().flatten()
    assert bad.numel() == 0, [(float(a[i]), float(b[i]), float(c[i]), float(got[i]), float(want[i])) for i in bad[:5]]
    # y of one rank: the same bits as reference_y.
    case = Case("ref", "fp8", 8, 5)
    x, scales, idx, w = gen(case, 3, 0)
    y = reference_y(x, scales, idx, w, H_FP8, True)
    xt = torch.tensor(x, dtype=torch.uint8).view(torch.float8_e4m3fn).view(5, H_FP8)
    yt, y64, bound = g.combine_reference(xt, torch.tensor(scales).view(5, 2), torch.tensor(idx), torch.tensor(w))
    assert [v & 0xFFFF for v in yt.view(torch.int16).flatten().tolist()] == y
    assert bool(((yt.double() - y64).abs() <= bound).all())
