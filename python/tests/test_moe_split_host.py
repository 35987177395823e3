"""The split halves of symmalloc.moe (``dispatch_send`` / ``dispatch_recv``, ``combine_send`` /
``combine_recv``; docs/moe.md, "Split halves") and the clock probe, on the host backend through
``HostView`` tensors at 2, 4 and 8 ranks: every case of test_moe_host.py through the halves, with
a barrier between them, equal bit for bit to the one-call forms (the layout and y, which is also
the exact reference); two objects' halves interleaved (two-batch overlap) and repeated combines
through the halves; every out-of-order call raising on every rank, naming what was expected,
the object usable after; a send one rank refuses, named by the others' receive halves; the
probe's words in phase order. With torch (the torch venv), moe_gpu_check.py's split cases
(moe_split_gpu_cases.py) on CPU tensors at 2 and 4 ranks against the gathered reference."""
import ctypes
import datetime
import os
import tempfile
import traceback

import pytest

import symmalloc
import test_moe_host as base
from error_text import error_of
from test_moe_host import (
    CASES, H_BF16, NUM_EXPERTS, T_MAX, TOPK, Case, _child_env, _spawn, expert_fn, gen, inputs, make, poison,
    reference_y,
)

pytestmark = base.pytestmark


def _snapshot(moe):
    """The filled rows of the receive buffers: counts, codes, rows (and scales)."""
    recv_x, recv_s, counts, src = moe._buffer_views(False)
    L, R, H = moe.local_experts, moe.max_recv, moe.hidden
    cnt, pay, codes = counts.tolist(), recv_x.tolist(), src.tolist()
    sc = recv_s.tolist() if recv_s is not None else None
    G = H // 128
    rows = []
    for le in range(L):
        for j in range(cnt[le]):
            i = le * R + j
            rows.append((codes[i], pay[i * H:(i + 1) * H], None if sc is None else sc[i * G:(i + 1) * G]))
    return cnt, rows


def _expert_out(moe, fp8, shift=0):
    """The test's experts applied to every filled row (NaN past the counts)."""
    recv_x, recv_s, counts, _ = moe._buffer_views(False)
    L, R, H, first = moe.local_experts, moe.max_recv, moe.hidden, moe.first_expert
    cnt, pay = counts.tolist(), recv_x.tolist()
    sc = recv_s.tolist() if fp8 else None
    G = H // 128
    out = [0xFFFF] * (L * R * H)
    for le in range(L):
        for j in range(cnt[le]):
            b = (le * R + j) * H
            srow = sc[(le * R + j) * G:(le * R + j + 1) * G] if fp8 else None
            out[b:b + H] = expert_fn(first + le, pay[b:b + H], srow, H, fp8, shift)
    return make((L, R, H), "bfloat16", out)


def _split_case(comm, moe, case, seed, rank, world):
    """One case through the one-call forms (checked exactly by test_moe_host.run_case), then the
    halves with a barrier between each send and its receive, then the two mixes: every layout
    and y the same bit for bit."""
    fp8 = case.dtype == "fp8"
    y1 = base.run_case(moe, case, seed, rank, world, runs=1)
    snap = _snapshot(moe)
    eo = _expert_out(moe, fp8)
    xt, it, wt, st = inputs(case, gen(case, seed, rank))
    for form in ("split", "split dispatch", "split combine"):
        for t in moe._buffer_views(False):
            poison(t)
        if form == "split combine":
            d = moe.dispatch(xt, it, wt, st)
        else:
            h = moe.dispatch_send(xt, it, wt, st)
            comm.barrier()
            d = moe.dispatch_recv(h)
        assert d.num_tokens == xt.shape[0] and (d.recv_scales is None) == (not fp8)
        assert _snapshot(moe) == snap, f"{case.name} ({form}): the layout differs from the one-call dispatch's"
        if form == "split dispatch":
            y = moe.combine(eo)
        else:
            c = moe.combine_send(eo)
            comm.barrier()
            y = moe.combine_recv(c if form == "split" else None)
        assert tuple(y.shape) == (d.num_tokens, moe.hidden)
        assert y.tolist() == y1, f"{case.name} ({form}): y differs from the one-call combine's"


def _cases_rank(rank, world, uid, q):
    try:
        _child_env()
        comm = symmalloc.Communicator(rank, world, uid)
        with comm.moe(T_MAX, H_BF16, TOPK, NUM_EXPERTS, dtype="bf16") as mb, \
                comm.moe(T_MAX, base.H_FP8, TOPK, NUM_EXPERTS, dtype="float8_e4m3fn") as mf:
            for i, case in enumerate(CASES):
                _split_case(comm, mf if case.dtype == "fp8" else mb, case, 700 + i, rank, world)
        comm.barrier()
        comm.close()
        q.put((rank, len(CASES), None))
    except Exception:
        q.put((rank, None, traceback.format_exc()))


@pytest.mark.parametrize("world", [2, 4, 8])
def test_split_halves_equal_the_one_call_forms(world):
    got = _spawn(_cases_rank, world)
    assert all(n == len(CASES) for n in got.values())


def _overlap_rank(rank, world, uid, q, rounds):
    """Two objects (two micro-batches), their halves interleaved: A send, B send, A recv, B recv,
    A combine send, B combine send, A combine recv, B combine recv; then 2 or 3 combines of B's
    dispatch through the halves, each y exact."""
    try:
        _child_env()
        comm = symmalloc.Communicator(rank, world, uid)
        case = Case("overlap", "bf16", 4, T_MAX)
        H = H_BF16
        with comm.moe(T_MAX, H, TOPK, NUM_EXPERTS) as a, comm.moe(T_MAX, H, TOPK, NUM_EXPERTS) as b:
            for i in range(rounds):
                data = [gen(case, 9000 + 2 * i + j, rank) for j in range(2)]
                ins = [inputs(case, dj) for dj in data]
                hs = [m.dispatch_send(*ins[j][:3]) for j, m in enumerate((a, b))]
                ds = [m.dispatch_recv(h) for m, h in zip((a, b), hs)]
                assert all(d.num_tokens == T_MAX for d in ds)
                eos = [_expert_out(m, False, i % 3) for m in (a, b)]
                cs = [m.combine_send(eo) for m, eo in zip((a, b), eos)]
                ys = [m.combine_recv(c) for m, c in zip((a, b), cs)]
                for j, y in enumerate(ys):
                    x, _, idx, w = data[j]
                    assert y.tolist() == reference_y(x, None, idx, w, H, False, i % 3), f"round {i} batch {j}"
                for shift in range(2 + i % 2):
                    eo = _expert_out(b, False, shift)
                    b.combine_send(eo)
                    y = b.combine_recv()
                    x, _, idx, w = data[1]
                    assert y.tolist() == reference_y(x, None, idx, w, H, False, shift), f"round {i} repeat {shift}"
        comm.barrier()
        comm.close()
        q.put((rank, rounds, None))
    except Exception:
        q.put((rank, None, traceback.format_exc()))


@pytest.mark.parametrize("world", [2, 4, 8])
def test_interleaved_micro_batches_and_repeated_split_combines(world):
    got = _spawn(_overlap_rank, world, 3)
    assert all(n == 3 for n in got.values())


def _misuse_rank(rank, world, uid, q):
    try:
        _child_env()
        comm = symmalloc.Communicator(rank, world, uid)
        case = Case("misuse", "bf16", 2, 7)
        H = H_BF16
        with comm.moe(T_MAX, H, TOPK, NUM_EXPERTS) as m:
            x, _, idx, w = data = gen(case, 31, rank)
            xt, it, wt, _ = inputs(case, data)
            want_y = reference_y(x, None, idx, w, H, False)

            def raises(fn, needle):
                msg = error_of(fn)
                assert msg is not None and needle in msg and f"rank {rank}" in msg, f"{msg!r} lacks {needle!r}"

            raises(lambda: m.dispatch_recv(None), "moe.dispatch_recv: rank")
            raises(lambda: m.dispatch_recv(None), "no dispatch was sent; expected moe.dispatch_send first")
            raises(lambda: m.combine_recv(), "no combine was sent; expected moe.combine_send first")
            raises(lambda: m.combine_send(make((m.local_experts, m.max_recv, H), "bfloat16", None)),
                   "no dispatch to combine")
            h = m.dispatch_send(xt, it, wt)
            pend = "moe.dispatch_send was called and its receive half was not; expected moe.dispatch_recv(handle) first"
            raises(lambda: m.dispatch_send(xt, it, wt), pend)
            raises(lambda: m.dispatch(xt, it, wt), pend)
            eo0 = make((m.local_experts, m.max_recv, H), "bfloat16", None)
            raises(lambda: m.combine(eo0), pend)
            raises(lambda: m.combine_send(eo0), pend)
            raises(lambda: m.combine_recv(), pend)
            raises(lambda: m.dispatch_recv(h._replace(seq=h.seq + 1)), "the handle is not the pending send's")
            m.dispatch_recv(h)
            eo = _expert_out(m, False)
            c = m.combine_send(eo)
            pend = "moe.combine_send was called and its receive half was not; expected moe.combine_recv() first"
            raises(lambda: m.combine_send(eo), pend)
            raises(lambda: m.dispatch_send(xt, it, wt), pend)
            raises(lambda: m.dispatch_recv(h), pend)
            raises(lambda: m.combine_recv(c._replace(seq=0)), "the handle is not the pending combine_send's")
            assert m.combine_recv(c).tolist() == want_y
            raises(lambda: m.combine_recv(), "no combine was sent")
            # A send one rank refuses (float64 weights): it raises naming itself, nothing is left
            # pending there; the others' receive halves name it.
            bad = 1 % world
            if rank == bad:
                w64 = make(tuple(wt.shape), "int32", None)
                raises(lambda: m.dispatch_send(xt, it, w64), "topk_weights")
                raises(lambda: m.dispatch_recv(None), "no dispatch was sent")
            else:
                h = m.dispatch_send(xt, it, wt)
                msg = error_of(lambda: m.dispatch_recv(h))
                assert msg is not None and f"rank {bad} refused the dispatch" in msg, msg
            # A combine send one rank refuses (float32 expert_out), then usable.
            h = m.dispatch_send(xt, it, wt)
            m.dispatch_recv(h)
            eo = _expert_out(m, False)
            if rank == bad:
                raises(lambda: m.combine_send(make((m.local_experts, m.max_recv, H), "float32", None)),
                       "expert_out is float32")
            else:
                m.combine_send(eo)
                msg = error_of(m.combine_recv)
                assert msg is not None and f"rank {bad} refused the combine" in msg, msg
            m.combine_send(eo)
            assert m.combine_recv().tolist() == want_y
            msg = error_of(m.probe)
            assert msg is not None and "the clock probe is off" in msg, msg
        # The probe: the words in phase order, the epochs counted.
        with comm.moe(T_MAX, H, TOPK, NUM_EXPERTS, probe=True) as m:
            for i in range(2):
                m.dispatch_recv(m.dispatch_send(xt, it, wt))
                m.combine_send(_expert_out(m, False))
                assert m.combine_recv().tolist() == want_y
                p = m.probe()
                d, cb = p["dispatch"], p["combine"]
                order = ["start", "routed", "staged", "published", "recv_start", "waited", "pulled"]
                assert [d[k] for k in order] == sorted(d[k] for k in order) and d["start"] > 0, p
                order = ["start", "pushed", "recv_start", "waited", "summed"]
                assert [cb[k] for k in order] == sorted(cb[k] for k in order) and d["pulled"] <= cb["start"], p
                assert d["epoch"] == cb["epoch"] == i + 1, p
        comm.barrier()
        comm.close()
        q.put((rank, True, None))
    except Exception:
        q.put((rank, None, traceback.format_exc()))


@pytest.mark.parametrize("world", [2, 4, 8])
def test_out_of_order_calls_raise_on_every_rank_and_the_probe(world):
    got = _spawn(_misuse_rank, world)
    assert all(got.values())


def test_probe_words_match_the_header():
    """The probe's names cover SYMM_MOE_PROBE_WORDS words with the epoch last of each half."""
    from symmalloc import _moe_split

    assert len(_moe_split._PROBE_DISPATCH) == 8 and len(_moe_split._PROBE_COMBINE) == 6
    assert _moe_split._PROBE_WORDS == 16 == ctypes.sizeof(ctypes.c_uint64 * 16) // 8


def _torch_split_rank(rank, world, uid, q, init):
    try:
        import torch
        import torch.distributed as dist

        import moe_gpu_check as g
        import moe_split_gpu_cases as sc

        _child_env()
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        comm = symmalloc.Communicator(rank, world, uid)
        T, E = 160, 32
        ctx = g.Ctx(rank, world, comm, torch.device("cpu"), "gloo", T=T, H=128, E=E, K=8)
        mb = comm.moe(max_tokens_per_rank=T, hidden=128, topk=8, num_experts=E, dtype=torch.bfloat16)
        mf = comm.moe(max_tokens_per_rank=T, hidden=256, topk=8, num_experts=E, dtype=torch.float8_e4m3fn)
        results = []
        if g.run_cases(sc.cases(ctx, comm, mb, mf, 128, True), results):
            mb.close()
            mf.close()
            comm.barrier()
            comm.close()
            dist.destroy_process_group()
        q.put((rank, results, None))
    except Exception:
        q.put((rank, None, traceback.format_exc()))


@base.needs_torch
@pytest.mark.parametrize("world", [2, 4])
def test_torch_split_cases_of_the_gpu_check(world):
    with tempfile.TemporaryDirectory() as d:
        got = _spawn(_torch_split_rank, world, "file://" + os.path.join(d, "store"))
    names = set()
    for rank, results in sorted(got.items()):
        bad = [f"rank {rank}, {n}: {detail}" for n, ok, detail, _ in results if not ok]
        assert not bad, "\n".join(bad)
        names |= {n for n, *_ in results}
    assert len(names) == 5, sorted(names)  # 2 eager cases per payload and the probe
