"""Expert parallelism in throughput mode from Python (``comm.moe(..., mode="throughput")``,
docs/moe.md "Throughput mode") on the host backend: ranks are processes, ``HostView`` tensors
(no torch needed). Every rank regenerates every rank's inputs from the seeds and checks the
``MoeTpDispatch`` exactly (one row per token and destination rank, by source rank then token;
local top-k ids and weights; per-expert counts; the CSR) and ``y`` bit for bit against a pure
Python reference of the contract (the caller's per-row sum: fmaf over this rank's slots in
increasing k, rounded to bf16; then fp32 adds over the destination ranks in increasing order,
one bf16 rounding), at 2, 4 and 8 ranks, uniform and skewed routing (every token to one rank),
bf16 and FP8, each case twice; the same y on every rank for the same inputs; errors on one rank
raised on every rank, the object usable after; the split halves against the one-call forms
(mixed, two objects interleaved, a call between halves refused). With torch (make test-wheel's torch venv): torch CPU
tensors at 2 and 4 ranks, and ``torch.compile(fullgraph=True)`` through the mode's custom ops at 2
ranks against eager and the contract."""
import importlib.util
import os

import pytest

import symmalloc
from test_moe_host import (  # noqa: E402 (the tests directory is on sys.path)
    H_BF16, H_FP8, HOST, NUM_EXPERTS, T_MAX, TOPK, Case, _child_env, _spawn, bf16_bits, bf16_value, expert_fn, f32,
    fmaf, gen, inputs, make, poison,
)

pytestmark = pytest.mark.skipif(not HOST, reason="needs SYMMALLOC_BACKEND=host")
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                 reason="PyTorch is not installed here (make test-wheel's torch venv runs this)")

CASES = [
    Case("k=2, 7 tokens", "bf16", 2, 7),
    Case("k=8, max tokens, int64 indices", "bf16", 8, T_MAX, idx_dtype="int64"),
    Case("k=2, empty experts and ranks, ragged", "bf16", 2, lambda r: (0, 7, T_MAX, 1)[r % 4], routing="subset"),
    Case("k=4, every token to expert 5 (one rank)", "bf16", 4, T_MAX, routing="one"),
    Case("fp8 k=3, 7 tokens", "fp8", 3, 7),
]


def gen_case(case, seed, rank):
    """gen's inputs, plus the routing "rank0": every token to 3 experts of rank 0 (sent once)."""
    x, scales, idx, w = gen(case, seed, rank)
    if case.routing == "rank0":
        idx = [[(t + j) % 3 if j < 3 else -1 for j in range(case.k)] for t in range(len(idx))]
    return x, scales, idx, w


CASES.append(Case("k=4, every token to 3 experts of rank 0", "bf16", 4, T_MAX, routing="rank0"))


def row_out(data, t, dest, L, H, fp8, shift=0):
    """The caller's combine row for token t at rank dest: its experts there, fmaf in increasing
    k from 0, rounded to bf16 (bits)."""
    x, scales, idx, w = data
    G = H // 128
    acc = [0.0] * H
    for kk, e in enumerate(idx[t]):
        if e < 0 or e // L != dest:
            continue
        out = expert_fn(e, x[t * H:(t + 1) * H], None if scales is None else scales[t * G:(t + 1) * G], H, fp8, shift)
        acc = [fmaf(w[t][kk], bf16_value(o), a) for o, a in zip(out, acc)]
    return [bf16_bits(a) for a in acc]


def want_y(data, world, L, H, fp8, shift=0):
    y = []
    for t, row in enumerate(data[2]):
        acc = [0.0] * H
        for d in range(world):
            if any(e >= 0 and e // L == d for e in row):
                acc = [f32(a + bf16_value(v)) for a, v in zip(acc, row_out(data, t, d, L, H, fp8, shift))]
        y.extend(bf16_bits(a) for a in acc)
    return y


def run_tp(moe, case, seed, rank, world, same=False, runs=2, shift=0, split=False):
    """One case, ``runs`` times (each checked, the same y each time); ``split``: the odd runs
    go through the split halves (dispatch_send / dispatch_recv, combine_send / combine_recv)."""
    fp8 = case.dtype == "fp8"
    H, K, L, first = moe.hidden, moe.topk, moe.local_experts, moe.first_expert
    T, G = moe.max_tokens_per_rank, H // 128
    every = [gen_case(case, seed, 0 if same else s) for s in range(world)]
    rows = []  # (src, token, local ids, weights)
    for s, (_, _, idx, w) in enumerate(every):
        for t, row in enumerate(idx):
            ids = [e - first if first <= e < first + L else -1 for e in row] + [-1] * (K - len(row))
            if any(v >= 0 for v in ids):
                ws = [w[t][j] if j < len(row) and ids[j] >= 0 else 0.0 for j in range(K)]
                rows.append((s, t, ids, ws))
    xt, it, wt, st = inputs(case, every[rank])
    ys = []
    for run in range(runs):
        for v in moe._buffer_views(False):
            poison(v)
        halves = split and run % 2 == 1
        d = moe.dispatch_recv(moe.dispatch_send(xt, it, wt, st)) if halves else moe.dispatch(xt, it, wt, st)
        recv_x, recv_idx, recv_w, per_expert, h = d
        R = world * T
        assert tuple(recv_x.shape) == (R, H) and tuple(recv_idx.shape) == (R, K) and tuple(per_expert.shape) == (L,)
        assert (d.recv_scales is None) == (not fp8) and d.num_tokens == len(every[rank][2])
        n = d.num_recv.tolist()[0]
        assert n == len(rows), f"{case.name}: num_recv {n}, want {len(rows)}"
        src, ids, ws = d.recv_src.tolist(), recv_idx.tolist(), recv_w.tolist()
        pay = recv_x.tolist()
        sc = d.recv_scales.tolist() if fp8 else None
        csr = [[] for _ in range(L)]
        out = [0xFFFF] * (R * H)  # NaN past num_recv: combine must not read it
        for r, (s, t, wid, ww) in enumerate(rows):
            at = f"{case.name}: row {r} (rank {s} token {t})"
            assert src[r] == s * T + t, at
            assert ids[r * K:(r + 1) * K] == wid, f"{at}: recv_topk_idx {ids[r * K:(r + 1) * K]}, want {wid}"
            assert ws[r * K:(r + 1) * K] == ww, f"{at}: recv_topk_weights"
            xs, ss = every[s][0], every[s][1]
            assert pay[r * H:(r + 1) * H] == xs[t * H:(t + 1) * H], f"{at}: recv_x"
            if fp8:
                assert sc[r * G:(r + 1) * G] == ss[t * G:(t + 1) * G], f"{at}: recv_scales"
            for j, le in enumerate(wid):
                if le >= 0:
                    csr[le].append(r * K + j)
            out[r * H:(r + 1) * H] = row_out(every[s], t, rank, L, H, fp8, shift)
        assert per_expert.tolist() == [len(c) for c in csr], f"{case.name}: per expert"
        offs = d.expert_offsets.tolist()
        assert offs == [sum(len(c) for c in csr[:i]) for i in range(L + 1)], f"{case.name}: offsets {offs}"
        assert d.expert_rows.tolist()[:offs[L]] == [e for c in csr for e in c], f"{case.name}: expert_rows"
        eo = make((R, H), "bfloat16", out)
        if halves:
            sent = moe.combine_send(eo, d)
            y = moe.combine_recv(sent)
        else:
            y = moe.combine(eo, d if run else None)
        got, want = y.tolist(), want_y(every[rank], world, L, H, fp8, shift)
        if got != want:
            bad = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            raise AssertionError(f"{case.name} run {run}: y[{bad // H}][{bad % H}] = 0x{got[bad]:04x}, "
                                 f"want 0x{want[bad]:04x}")
        ys.append(got)
    assert all(y == ys[0] for y in ys), f"{case.name}: y differs between runs"
    return ys[0]


def _cases_rank(rank, world, uid, q):
    import traceback

    try:
        _child_env()
        comm = symmalloc.Communicator(rank, world, uid)
        report = {}
        with comm.moe(T_MAX, H_BF16, TOPK, NUM_EXPERTS, mode="throughput") as mb, \
                comm.moe(T_MAX, H_FP8, TOPK, NUM_EXPERTS, dtype="fp8", mode="throughput") as mf:
            L = NUM_EXPERTS // world
            assert (mb.mode, mb.local_experts, mb.first_expert, mb.max_rows) == ("throughput", L, rank * L,
                                                                                  world * T_MAX), mb
            assert mb.buffer_bytes >= world * T_MAX * H_BF16 * 2
            for i, case in enumerate(CASES):
                run_tp(mf if case.dtype == "fp8" else mb, case, 100 + i, rank, world)
            report["same"] = run_tp(mb, CASES[1], 7, rank, world, same=True)
            # Repeated combines of one dispatch: each its own y.
            for shift in (1, 2):
                run_tp(mb, CASES[0], 50 + shift, rank, world, runs=1, shift=shift)
        # The clock probe: the dispatch's words in phase order with the CSR's two (docs/moe.md
        # "Clock probe"), no receive starts, the combine's after the dispatch's.
        with comm.moe(T_MAX, H_BF16, TOPK, NUM_EXPERTS, mode="throughput", probe=True) as mp:
            for i in range(2):
                run_tp(mp, CASES[0], 60 + i, rank, world, runs=1)
                p = mp.probe()
                d, cb = p["dispatch"], p["combine"]
                order = ["start", "routed", "staged", "published"]
                assert [d[k] for k in order] == sorted(d[k] for k in order) and d["start"] > 0, p
                order = ["staged", "waited", "pulled", "scanned", "sorted"]
                assert [d[k] for k in order] == sorted(d[k] for k in order), p
                order = ["start", "pushed", "summed"]
                assert [cb[k] for k in order] == sorted(cb[k] for k in order) and d["sorted"] <= cb["start"], p
                assert cb["start"] <= cb["waited"] <= cb["summed"], p
                assert d["recv_start"] == cb["recv_start"] == 0, p
                assert d["epoch"] == cb["epoch"] == i + 1, p
        comm.barrier()
        comm.close()
        q.put((rank, report, None))
    except Exception:
        q.put((rank, None, traceback.format_exc()))


def _split_rank(rank, world, uid, q):
    import traceback

    try:
        _child_env()
        comm = symmalloc.Communicator(rank, world, uid)
        with comm.moe(T_MAX, H_BF16, TOPK, NUM_EXPERTS, mode="throughput") as mb, \
                comm.moe(T_MAX, H_FP8, TOPK, NUM_EXPERTS, dtype="fp8", mode="throughput") as mf:
            for i, case in enumerate(CASES):
                # One call, then the halves, then one call: every y the same bits.
                run_tp(mf if case.dtype == "fp8" else mb, case, 300 + i, rank, world, runs=3, split=True)
            # Two objects' halves interleaved (two micro-batches), each result checked after.
            every = [gen_case(CASES[0], 400 + s, s) for s in range(world)]
            xt, it, wt, st = inputs(CASES[0], every[rank])
            ha, hb = mb.dispatch_send(xt, it, wt, st), mf.dispatch_send(*inputs(CASES[4], gen_case(CASES[4], 401, rank)))
            da, db = mb.dispatch_recv(ha), mf.dispatch_recv(hb)
            assert da.num_recv.tolist() == [sum(1 for s in range(world) for row in every[s][2]
                                                if any(e >= 0 and e // mb.local_experts == rank for e in row))]
            assert db.recv_scales is not None and tuple(db.recv_x.shape) == (world * T_MAX, H_FP8)
            # A call between the halves is refused, naming the receive half it expects.
            sent = mb.combine_send(make((world * T_MAX, H_BF16), "bfloat16", [0] * (world * T_MAX * H_BF16)), da)
            try:
                mb.dispatch(xt, it, wt, st)
                raise AssertionError("a dispatch between combine_send and combine_recv was accepted")
            except symmalloc.SymmallocError as e:
                assert "moe.combine_send was called and its receive half was not" in str(e), e
            y = mb.combine_recv(sent)
            assert set(y.tolist()) <= {0, 0x8000}, "a zero expert output gave a nonzero y"
            run_tp(mb, CASES[0], 402, rank, world, runs=1)  # a one-call case last
        comm.barrier()
        comm.close()
        q.put((rank, {}, None))
    except Exception:
        q.put((rank, None, traceback.format_exc()))


@pytest.mark.parametrize("world", [2, 4])
def test_throughput_split_halves_match_the_one_call_forms(world):
    assert len(_spawn(_split_rank, world)) == world


@pytest.mark.parametrize("world", [2, 4, 8])
def test_throughput_dispatch_combine_exact(world):
    got = _spawn(_cases_rank, world)
    ys = [got[r]["same"] for r in range(world)]
    assert all(y == ys[0] for y in ys), "the same inputs gave different y on different ranks"


def _errors_rank(rank, world, uid, q):
    import traceback

    try:
        _child_env()
        comm = symmalloc.Communicator(rank, world, uid)
        seen = []
        try:
            comm.moe(T_MAX, H_BF16, TOPK, NUM_EXPERTS, mode="fast")
        except symmalloc.SymmallocError as e:
            seen.append("mode" if "expected 'low_latency' or 'throughput'" in str(e) else str(e))
        with comm.moe(T_MAX, H_BF16, TOPK, NUM_EXPERTS, mode="throughput") as m:
            case = CASES[0]
            # A wrong expert_out shape on rank 0: rank 0 names it, every other rank names rank 0.
            xt, it, wt, st = inputs(case, gen(case, 5, rank))
            d = m.dispatch(xt, it, wt, st)
            R = world * T_MAX
            bad = make((m.local_experts, R, H_BF16) if rank == 0 else (R, H_BF16), "bfloat16", None)
            poison(bad, 0)
            try:
                m.combine(bad, d)
                seen.append("no error")
            except symmalloc.SymmallocError as e:
                want = "expected bfloat16 [" if rank == 0 else "rank 0 refused the combine"
                seen.append("combine" if want in str(e) else str(e))
            # An expert out of range on the last rank: every rank names it.
            x, s, idx, w = gen(case, 6, rank)
            if rank == world - 1:
                idx[3][1] = 99
            xt, it, wt, st = inputs(case, (x, s, idx, w))
            try:
                m.dispatch(xt, it, wt, st)
                seen.append("no error")
            except symmalloc.SymmallocError as e:
                want = f"rank {world - 1}: topk_idx[3][1] = 99 is out of range"
                seen.append("range" if want in str(e) else str(e))
            run_tp(m, case, 8, rank, world, runs=1)  # usable after
        comm.barrier()
        comm.close()
        q.put((rank, seen, None))
    except Exception:
        q.put((rank, None, traceback.format_exc()))


@pytest.mark.parametrize("world", [2, 4])
def test_throughput_errors_on_every_rank_and_usable_after(world):
    got = _spawn(_errors_rank, world)
    for r in range(world):
        assert got[r] == ["mode", "combine", "range"], (r, got[r])


def _torch_rank(rank, world, uid, q):
    import traceback

    try:
        import torch

        _child_env()
        comm = symmalloc.Communicator(rank, world, uid)
        case = CASES[1]  # k=8, max tokens, int64
        every = [gen_case(case, 11, s) for s in range(world)]
        x, _, idx, w = every[rank]
        H, T = H_BF16, T_MAX
        xt = torch.tensor(x, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(len(idx), H)
        it = torch.tensor(idx, dtype=torch.int64)
        wt = torch.tensor(w, dtype=torch.float32)
        with comm.moe(T, H, TOPK, NUM_EXPERTS, dtype=torch.bfloat16, mode="throughput") as m:
            d = m.dispatch(xt, it, wt)
            L, R = m.local_experts, world * T
            assert isinstance(d.recv_x, torch.Tensor) and d.recv_x.shape == (R, H) and d.recv_x.dtype == torch.bfloat16
            assert d.recv_topk_idx.dtype == torch.int32 and d.recv_topk_weights.dtype == torch.float32
            assert d.num_recv_tokens_per_expert.shape == (L,) and d.recv_scales is None
            n = int(d.num_recv[0])
            # The caller's per-row sum with torch, in the contract's order (fmaf per slot is what
            # row_out computes; here the rows are checked against it bit for bit).
            out = torch.full((R, H), float("nan"), dtype=torch.bfloat16)
            src = d.recv_src[:n].tolist()
            for r in range(n):
                s, t = divmod(src[r], T)
                bits = row_out(every[s], t, rank, L, H, False)
                out[r] = torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
            y = m.combine(out, d)
            assert y.shape == (len(idx), H) and y.dtype == torch.bfloat16
            got = [v & 0xFFFF for v in y.view(torch.int16).flatten().tolist()]
            assert got == want_y(every[rank], world, L, H, False), "torch y differs from the reference"
            # The per-expert counts against the ids (torch ops on the views).
            ids = d.recv_topk_idx[:n]
            want = [int((ids == le).sum()) for le in range(L)]
            assert d.num_recv_tokens_per_expert.tolist() == want
            # The op refuses a layout argument that is not its object's (a graph traced for
            # another object's shapes), before any call of the library.
            try:
                wrong = m.op_layout().replace("rows=", "rows=1")
                torch.ops.symmalloc.moe_tp_dispatch(xt, it, wt, None, m.handle, wrong)
                raise AssertionError("a wrong layout was accepted")
            except symmalloc.SymmallocError as e:
                assert f"rank {rank}: layout 'throughput rows=1" in str(e) and "expected the op_layout()" in str(e), e
        comm.barrier()
        comm.close()
        q.put((rank, n, None))
    except Exception:
        q.put((rank, None, traceback.format_exc()))


@needs_torch
@pytest.mark.parametrize("world", [2, 4])
def test_throughput_with_torch_cpu_tensors(world):
    got = _spawn(_torch_rank, world)
    assert sum(got.values()) >= world * T_MAX  # every token went to at least one rank




# torch.compile: the throughput mode's custom ops (moe_gpu_check.py's tp_compile_case) -----------

def _compile_rank(rank, world, uid, q, backend="aot_eager", cache=None):
    try:
        if cache is not None:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # before torch is imported
        import torch

        import moe_gpu_check as g

        _child_env()
        torch.set_num_threads(1)
        comm = symmalloc.Communicator(rank, world, uid)
        ctx = g.Ctx(rank, world, comm, torch.device("cpu"), "gloo")
        detail = g.tp_compile_case(ctx, comm, "default", backend=backend)
        comm.barrier()
        comm.close()
        q.put((rank, detail, None))
    except Exception:
        import traceback

        q.put((rank, None, traceback.format_exc()))


@needs_torch
def test_throughput_torch_compile_fullgraph_matches_eager_and_the_contract():
    got = _spawn(_compile_rank, 2)
    assert got == {r: "bf16 and fp8, 0 graph breaks" for r in range(2)}, got


@needs_torch
def test_a_compiled_graph_is_not_reused_for_another_world_through_torchs_caches(tmp_path):
    """Inductor keeps compiled graphs on disk, keyed by the graph. The Moe's handle is a number
    per process, so a world-2 and a world-4 run trace the same graph but for results of other
    shapes ([2T, H] and [4T, H] rows): the dispatch ops' layout argument (Moe.op_layout) makes
    their graphs differ. Two runs sharing one cache directory, world 2 then world 4, must both
    pass (before it, the second failed in the cached code's size assertion)."""
    cache = str(tmp_path / "inductor")
    for world in (2, 4):
        got = _spawn(_compile_rank, world, "inductor", cache)
        assert got == {r: "bf16 and fp8, 0 graph breaks" for r in range(world)}, (world, got)
    assert os.listdir(cache), "inductor wrote no cache: the test did not exercise it"
