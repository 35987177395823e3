"""FP8 quantized inside the dispatch from Python (``comm.moe(..., dtype=float8_e4m3fn,
input_dtype=bfloat16, scale_layout=..., ue8m0=...)``, docs/moe.md "FP8 inside the dispatch") on
the host backend, at 2, 4 and 8 rank processes: every rank's bf16 rows regenerated from per-rank
seeds; each rank's ``recv_x`` (e4m3 bytes) and ``recv_scales`` (read through the view's strides,
row-major or column-major TMA-aligned) against a float64 reference of the quantization (per 128
elements amax, ``s = f32(max(amax / 448, FLT_MIN))``, UE8M0 ``2^ceil(log2 s)``, e4m3 nearest
even, saturated): scales exactly; bytes exactly the kernels' arithmetic ``e4m3(f32(x * f32(1 /
s)))``, and the float64 ``e4m3(x / s)`` or one step from it only within 2^-21 of a midpoint
(always equal with UE8M0); three dispatches per object, the same bits each time. With torch
(the torch venv), the torch view has DeepGEMM's strides and the same values. Bad options and a
bad dispatch raise on every rank naming the value (and the rank). The throughput mode
(``mode="throughput"``: one row per token and destination rank, ``recv_scales`` [W*T, H / 128],
``"col_tma"`` strides ``(1, R4)``) the same way, its combine after a quantizing dispatch, and
its torch.compile graph."""
import math
import os
import random
import traceback

import pytest

import symmalloc
from error_text import error_of  # noqa: E402
from test_moe_host import E4M3, _child_env, _have_torch, _spawn, bf16_value, f32, make

HOST = os.environ.get("SYMMALLOC_BACKEND") == "host"
pytestmark = pytest.mark.skipif(not HOST, reason="needs SYMMALLOC_BACKEND=host (GPU runs: moe_gpu_check.py)")

T, H, TOPK, E = 5, 384, 4, 16  # H: three groups of 128
FLT_MIN = 2.0 ** -126
GRID = E4M3[:0x7F]  # codes 0..0x7e, increasing


def e4m3_rne(v: float):
    """(code, near a midpoint): v rounded to e4m3, nearest even, saturated to +-448."""
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0
    a = abs(v)
    if a >= 448.0:
        return sign | 0x7E, False
    lo, hi = 0, len(GRID) - 1
    while hi - lo > 1:  # GRID[lo] <= a < GRID[hi]
        mid = (lo + hi) // 2
        if GRID[mid] <= a:
            lo = mid
        else:
            hi = mid
    if GRID[lo] == a:
        return sign | lo, False
    m = (GRID[lo] + GRID[lo + 1]) / 2
    near = abs(a - m) <= a * 2.0 ** -21
    q = lo if a < m or (a == m and lo % 2 == 0) else lo + 1
    return sign | q, near


def quant_ref(row_bits, ue8m0):
    """(scales, kernel bytes, float64 bytes, near) of one bf16 row."""
    scales, kb, fb, near = [], [], [], []
    for g in range(0, len(row_bits), 128):
        xs = [bf16_value(b) for b in row_bits[g:g + 128]]
        s = f32(max(max(abs(x) for x in xs) / 448.0, FLT_MIN))
        if ue8m0:
            s = 2.0 ** math.ceil(math.log2(s))
        inv = f32(1.0 / s)
        for x in xs:
            kb.append(e4m3_rne(f32(x * inv))[0])
            q, n = e4m3_rne(x / s)
            fb.append(q)
            near.append(n)
        scales.append(s)
    return scales, kb, fb, near


def gen_rows(seed, rank, n):
    """bf16 bits, per group of 128 one kind: ordinary, zeros, tiny (the scale clamps to
    FLT_MIN), huge, spread over 2^+-40, e4m3 grid values times a power of two (ties)."""
    rng = random.Random(seed * 104729 + rank)
    out = []
    for _ in range(n * H // 128):
        kind, p2 = rng.randrange(6), 2.0 ** rng.randrange(-15, 15)
        for _ in range(128):
            u = rng.uniform(-1.0, 1.0)
            v = (u * 4, 0.0, u * 2.0 ** -128, u * 2.0 ** 110, u * 2.0 ** rng.randrange(-40, 40),
                 math.copysign(E4M3[rng.randrange(0x7F)] * p2, u))[kind]
            b = 0x8000 if rng.randrange(97) == 0 else _bf16_bits_any(v)
            out.append(b)
    return out


def _bf16_bits_any(v):
    """v rounded to fp32, then to bf16 (nearest even; finite)."""
    import struct

    b = struct.unpack("<I", struct.pack("<f", v))[0]
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF


def gen_routing(seed, rank, n):
    rng = random.Random(seed * 7 + rank)
    idx = [[e if rng.random() > 0.2 else -1 for e in rng.sample(range(E), TOPK)] for _ in range(n)]
    w = [[f32(rng.uniform(-1, 1)) for _ in range(TOPK)] for _ in range(n)]
    return idx, w


def check_row(got, got_scales, row_bits, ue8m0, what):
    """One received row of a quantizing dispatch against its bf16 source: the scales exactly, the
    bytes the kernels' arithmetic's, each the float64 reference's or one step from it at a
    midpoint (never with UE8M0). Returns the bytes one step from float64."""
    scales, kb, fb, near = quant_ref(row_bits, ue8m0)
    assert got_scales == scales, f"{what}: scales"
    assert got == kb, f"{what}: bytes differ from the kernels' arithmetic"
    steps = 0
    for i, (g, f, nr) in enumerate(zip(got, fb, near)):
        if g != f:
            assert not ue8m0 and nr and (g ^ f) & 0x80 == 0 and abs((g & 0x7F) - (f & 0x7F)) == 1, \
                f"{what}: element {i} is {g:#x}, float64 reference {f:#x}"
            steps += 1
    return steps


def check_rank(moe, seed, world, rank, layout, ue8m0, torch=None):
    """One object's three dispatches, checked; returns (rows, one-step bytes)."""
    L, R, first, G = moe.local_experts, moe.max_recv, moe.first_expert, H // 128
    R4 = (R + 3) // 4 * 4
    want_strides = (G * R4, 1, R4) if layout == "col_tma" else (R * G, G, 1)
    assert moe.scale_strides() == want_strides, moe.scale_strides()
    assert (moe.dtype, moe.input_dtype, moe.quantize, moe.scale_layout, moe.ue8m0) == (
        "float8_e4m3fn", "bfloat16", True, layout, ue8m0), repr(moe)
    rows = steps = 0
    for call in range(3):
        s = seed + call
        n = (T, T - 2, 1)[call]
        every = [(gen_rows(s, r, n), *gen_routing(s, r, n)) for r in range(world)]
        x, idx, w = every[rank]
        d = moe.dispatch(make((n, H), "bfloat16", x), make((n, TOPK), "int32", [e for r in idx for e in r]),
                         make((n, TOPK), "float32", [v for r in w for v in r]))
        assert d.recv_scales.stride() == want_strides and tuple(d.recv_scales.shape) == (L, R, G)
        assert d.recv_x.dtype == "float8_e4m3fn"
        pay, sc, src, cnt = d.recv_x.tolist(), d.recv_scales.tolist(), d.recv_src.tolist(), d.recv_counts.tolist()
        for le in range(L):
            j = 0
            for sr, (xs, ids, _) in enumerate(every):
                for t, row in enumerate(ids):
                    if first + le not in row:
                        continue
                    what = f"rank {rank} {layout} ue8m0={ue8m0} call {call}: expert {le} row {j}"
                    assert src[le * R + j] == (sr * T + t) * TOPK + row.index(first + le), what
                    at = le * R + j
                    steps += check_row(pay[at * H:(at + 1) * H], sc[at * G:(at + 1) * G], xs[t * H:(t + 1) * H],
                                       ue8m0, what)
                    j += 1
                    rows += 1
            assert cnt[le] == j, f"rank {rank}: recv_counts[{le}] {cnt[le]}, want {j}"
        if torch is not None:  # the same inputs through torch CPU tensors: DeepGEMM's view, same bits
            xt = torch.tensor(x, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).view(n, H)
            dt = moe.dispatch(xt, torch.tensor(idx, dtype=torch.int32).view(n, TOPK),
                              torch.tensor(w, dtype=torch.float32).view(n, TOPK))
            assert dt.recv_scales.stride() == want_strides and dt.recv_x.dtype == torch.float8_e4m3fn
            assert dt.recv_counts.tolist() == cnt
            for le in range(L):  # the rows filled (past them: whatever earlier calls left, NaN too)
                got_s, got_x = dt.recv_scales[le, :cnt[le]].flatten().tolist(), dt.recv_x[le, :cnt[le]].view(torch.uint8)
                assert got_s == sc[le * R * G:(le * R + cnt[le]) * G], f"rank {rank}: torch recv_scales[{le}]"
                assert got_x.flatten().tolist() == pay[le * R * H:(le * R + cnt[le]) * H], f"rank {rank}: torch recv_x[{le}]"
            # DeepGEMM's column-major TMA-aligned scales are this view, unchanged: as
            # get_mn_major_tma_aligned_tensor returns them (strides (G * R4, 1, R4)).
            if layout == "col_tma":
                assert dt.recv_scales.stride(1) == 1 and dt.recv_scales.stride(2) % 4 == 0
                assert dt.recv_scales.stride(0) == dt.recv_scales.stride(2) * G
    return rows, steps


def _quant_rank(rank, world, uid, q, use_torch):
    try:
        _child_env()
        torch = None
        if use_torch:
            import torch
        comm = symmalloc.Communicator(rank, world, uid)
        report = []
        for i, (layout, ue8m0) in enumerate([("row", False), ("col_tma", False), ("row", True), ("col_tma", True)]):
            with comm.moe(T, H, TOPK, E, dtype="float8_e4m3fn", input_dtype="bfloat16", scale_layout=layout,
                          ue8m0=ue8m0, max_recv_per_expert=world * T - 1) as moe:
                report.append(check_rank(moe, 1000 + 10 * i, world, rank, layout, ue8m0, torch))
        # Bad options: every rank passes them, every rank raises naming the value.
        msgs = {
            "layout": error_of(lambda: comm.moe(T, H, TOPK, E, dtype="fp8", scale_layout="col")),
            "ue8m0": error_of(lambda: comm.moe(T, H, TOPK, E, dtype="fp8", ue8m0=True)),
            "input": error_of(lambda: comm.moe(T, H, TOPK, E, dtype="fp8", input_dtype="float32")),
            "bf16 col": error_of(lambda: comm.moe(T, H, TOPK, E, dtype="bf16", scale_layout="col_tma")),
        }
        assert "scale_layout 'col'" in msgs["layout"] and "'col_tma'" in msgs["layout"], msgs
        assert "ue8m0=True without quantization" in msgs["ue8m0"], msgs
        assert "input_dtype 'float32'" in msgs["input"], msgs
        assert "scale_layout 'col_tma' with dtype bfloat16" in msgs["bf16 col"], msgs
        # A bad dispatch on the last rank (x_scales given to a quantizing object; then an FP8 x):
        # it names its value, every other rank names it.
        with comm.moe(T, H, TOPK, E, dtype="fp8", input_dtype="bfloat16") as moe:
            bad = world - 1
            n = 2
            idx, w = gen_routing(7, rank, n)
            it, wt = make((n, TOPK), "int32", [e for r in idx for e in r]), make((n, TOPK), "float32", [v for r in w for v in r])
            x = make((n, H), "bfloat16", gen_rows(7, rank, n))
            sc = make((n, H // 128), "float32", [1.0] * (n * H // 128)) if rank == bad else None
            msg = error_of(lambda: moe.dispatch(x, it, wt, sc))
            want = "x_scales given ([2, 3]), but this Moe quantizes bf16 x itself" if rank == bad else f"rank {bad} refused"
            assert msg is not None and want in msg, msg
            x8 = make((n, H), "float8_e4m3fn", [1] * (n * H)) if rank == bad else x
            msg = error_of(lambda: moe.dispatch(x8, it, wt))
            want = f"rank {bad}: x has dtype float8_e4m3fn; expected bfloat16" if rank == bad else f"rank {bad} refused"
            assert msg is not None and want in msg, msg
            moe.dispatch(x, it, wt)  # usable after
        comm.barrier()
        comm.close()
        q.put((rank, report, None))
    except Exception:
        q.put((rank, None, traceback.format_exc()))


@pytest.mark.parametrize("world", [2, 4, 8])
def test_quantized_dispatch_matches_the_float64_reference(world):
    got = _spawn(_quant_rank, world, _have_torch())
    assert len(got) == world
    assert sum(r for rep in got.values() for r, _ in rep) > 0, got


def test_the_reference_helpers():
    """The test's own e4m3 rounding: every code round-trips, midpoints go to the even code,
    saturation at 448; UE8M0 of a power of two is itself."""
    for c in range(0x7F):
        assert e4m3_rne(E4M3[c]) == (c, False) and e4m3_rne(-E4M3[c])[0] == 0x80 | c
    for c in range(0x7E):
        m = (E4M3[c] + E4M3[c + 1]) / 2
        assert e4m3_rne(m)[0] == (c if c % 2 == 0 else c + 1), c
    assert e4m3_rne(1000.0)[0] == 0x7E and e4m3_rne(-449.0)[0] == 0xFE
    s, kb, fb, _ = quant_ref([0x3F80] * 128 + [0] * 128, True)  # 1.0s, then zeros
    assert s == [2.0 ** math.ceil(math.log2(1 / 448)), FLT_MIN] and kb[:128] == fb[:128] and kb[128:] == [0] * 128


def check_tp_rank(moe, seed, world, rank, layout, ue8m0, torch=None):
    """A throughput object's three dispatches, checked (rows by source rank, then token; each
    row once per destination rank); then a combine of the last one. Returns (rows, one-step
    bytes)."""
    R, G, L = moe.max_rows, H // 128, moe.local_experts
    R4 = (R + 3) // 4 * 4
    want = (1, R4) if layout == "col_tma" else (G, 1)
    assert moe.scale_strides()[1:] == want, moe.scale_strides()
    assert (moe.quantize, moe.scale_layout, moe.ue8m0, moe.input_dtype) == (True, layout, ue8m0, "bfloat16"), repr(moe)
    rows = steps = 0
    for call in range(3):
        s = seed + call
        n = (T, T - 2, 1)[call]
        every = [(gen_rows(s, r, n), *gen_routing(s, r, n)) for r in range(world)]
        x, idx, w = every[rank]
        args = (make((n, TOPK), "int32", [e for r in idx for e in r]), make((n, TOPK), "float32", [v for r in w for v in r]))
        d = moe.dispatch(make((n, H), "bfloat16", x), *args)
        assert tuple(d.recv_scales.shape) == (R, G) and d.recv_scales.stride() == want
        pay, sc = d.recv_x.tolist(), d.recv_scales.tolist()
        j = 0
        for sr, (xs, ids, _) in enumerate(every):
            for t, row in enumerate(ids):
                if not any(e >= 0 and e // L == rank for e in row):
                    continue
                what = f"rank {rank} throughput {layout} ue8m0={ue8m0} call {call}: row {j}"
                assert d.handle.recv_src.tolist()[j] == sr * T + t, what
                steps += check_row(pay[j * H:(j + 1) * H], sc[j * G:(j + 1) * G], xs[t * H:(t + 1) * H], ue8m0, what)
                j += 1
        assert d.handle.num_recv.tolist() == [j], f"rank {rank}: num_recv"
        rows += j
        if torch is not None:  # the same inputs as torch CPU tensors: the same bits, DeepGEMM's strides
            xt = torch.tensor(x, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).view(n, H)
            dt = moe.dispatch(xt, torch.tensor(idx, dtype=torch.int32).view(n, TOPK),
                              torch.tensor(w, dtype=torch.float32).view(n, TOPK))
            assert dt.recv_scales.stride() == want and dt.recv_x.dtype == torch.float8_e4m3fn
            assert dt.recv_scales[:j].flatten().tolist() == sc[:j * G], f"rank {rank}: torch recv_scales"
            assert dt.recv_x[:j].view(torch.uint8).flatten().tolist() == pay[:j * H]
    # The combine of the last dispatch: each row's output is its row number (exact in bf16), so
    # y[t] is the sum of token t's rows over the ranks it went to.
    eo = make((R, H), "bfloat16", [_bf16_bits_any(float(r)) for r in range(R) for _ in range(H)])
    y = moe.combine(eo).tolist()
    assert len(y) == n * H, len(y)
    return rows, steps


def _tp_quant_rank(rank, world, uid, q, use_torch):
    try:
        _child_env()
        torch = None
        if use_torch:
            import torch
        comm = symmalloc.Communicator(rank, world, uid)
        report = []
        for i, (layout, ue8m0) in enumerate([("row", False), ("col_tma", False), ("col_tma", True)]):
            with comm.moe(T, H, TOPK, E, dtype="float8_e4m3fn", input_dtype="bfloat16", scale_layout=layout,
                          ue8m0=ue8m0, mode="throughput") as moe:
                report.append(check_tp_rank(moe, 2000 + 10 * i, world, rank, layout, ue8m0, torch))
        comm.barrier()
        comm.close()
        q.put((rank, report, None))
    except Exception:
        q.put((rank, None, traceback.format_exc()))


@pytest.mark.parametrize("world", [2, 4])
def test_throughput_mode_quantizes_in_the_dispatch(world):
    got = _spawn(_tp_quant_rank, world, _have_torch())
    assert len(got) == world
    assert sum(r for rep in got.values() for r, _ in rep) > 0, got


def _compile_rank(rank, world, uid, q):
    try:
        _child_env()
        import torch

        # Inductor's on-disk FX graph cache keys a graph by its ops and input shapes, not by the
        # Moe behind the handle constant: a graph cached by another process for another Moe of
        # the same handle number would come back with that Moe's output shapes.
        torch._inductor.config.fx_graph_cache = False
        comm = symmalloc.Communicator(rank, world, uid)
        with comm.moe(4, 256, 2, 4 * world, dtype=torch.float8_e4m3fn, input_dtype=torch.bfloat16,
                      scale_layout="col_tma", ue8m0=True) as moe:
            g = torch.Generator().manual_seed(rank)
            x = torch.randn(3, 256, generator=g).to(torch.bfloat16)
            idx = torch.tensor([[0, 1], [2, -1], [3, 0]], dtype=torch.int32) + 4 * rank

            def f(x, idx, w):
                d = moe.dispatch(x, idx, w)
                eo = (d.recv_x.float() * d.recv_scales.repeat_interleave(128, 2)).to(torch.bfloat16)
                return moe.combine(eo)

            w = torch.rand(3, 2, generator=g)
            ye = f(x, idx, w)
            yc = torch.compile(f, fullgraph=True)(x, idx, w)
            assert torch.equal(ye.view(torch.int16), yc.view(torch.int16)), "compiled y differs from eager"
        # The throughput mode's op: its fake gives recv_scales the column-major strides too.
        with comm.moe(4, 256, 2, 4 * world, dtype=torch.float8_e4m3fn, input_dtype=torch.bfloat16,
                      scale_layout="col_tma", mode="throughput") as moe:
            def g_(x, idx, w):
                d = moe.dispatch(x, idx, w)
                deq = d.recv_x.float() * d.recv_scales.repeat_interleave(128, 1)
                wsum = (d.recv_topk_weights * (d.recv_topk_idx >= 0)).sum(1, keepdim=True)
                return moe.combine((deq * wsum).to(torch.bfloat16))

            ye = g_(x, idx, w)
            yc = torch.compile(g_, fullgraph=True)(x, idx, w)
            assert torch.equal(ye.view(torch.int16), yc.view(torch.int16)), "compiled throughput y differs"
        comm.barrier()
        comm.close()
        q.put((rank, [], None))
    except Exception:
        q.put((rank, None, traceback.format_exc()))


@pytest.mark.skipif(not _have_torch(), reason="PyTorch is not installed here (the torch venv runs this)")
def test_torch_compile_fullgraph_of_a_quantizing_moe():
    """torch.compile(fullgraph=True) of dispatch (bf16 in, e4m3 and column-major scales out: the
    fake has the view's strides) -> dequantizing expert -> combine: the same bits as eager, in
    both modes."""
    assert len(_spawn(_compile_rank, 2)) == 2
