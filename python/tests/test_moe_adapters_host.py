"""Engine adapters (symmalloc.integrations.vllm / .sglang) on the host backend at 2 ranks with
torch CPU tensors: each adapter's dispatch -> experts -> combine against a float64 torch
reference of routed experts (expert e scales its rows by (e + 1) / 8), and the layout checked
(each local expert's rows, its count). With the engine installed (a venv with vllm 0.34.0 or
sglang 0.5.23 --no-deps beside the torch venv) the adapters subclass the engine's real base
classes and return its real types, and this test asserts that; without it they use stand-ins
with the same fields (``ENGINE`` is None) and the test checks the data path only."""
import importlib.util
import os
import traceback

import pytest

import symmalloc

HOST = os.environ.get("SYMMALLOC_BACKEND") == "host"
pytestmark = [
    pytest.mark.skipif(not HOST, reason="needs SYMMALLOC_BACKEND=host"),
    pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                       reason="PyTorch is not installed here (the torch venv runs this)"),
]

T, H, K, E = 16, 128, 4, 8


def _inputs(torch, rank):
    g = torch.Generator().manual_seed(1000 + rank)
    n = (T, 5)[rank % 2]  # ragged token counts
    x = torch.randn(n, H, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)]).to(torch.int64)
    if n:
        idx[0, 1:] = -1  # an unused slot
    w = torch.rand(n, K, generator=g)
    return x, idx, w


def _reference(torch, x, idx, w):
    ref = torch.zeros(x.shape[0], H, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if e >= 0:
                ref[t] += float(w[t, k]) * x[t].double() * (e + 1) / 8
    return ref


def _experts(torch, a, counts, first_expert):
    out = torch.zeros_like(a)
    for le in range(a.shape[0]):
        c = int(counts[le])
        out[le, :c] = (a[le, :c].double() * (first_expert + le + 1) / 8).to(torch.bfloat16)
    return out


def _check_layout(torch, a, counts, m, world):
    """Every local expert's rows are exactly the tokens routed to it, from every rank."""
    for le in range(m.local_experts):
        e = m.first_expert + le
        want = []
        for r in range(world):
            x, idx, _ = _inputs(torch, r)
            want += [x[t] for t in range(x.shape[0]) if (idx[t] == e).any()]
        assert int(counts[le]) == len(want), (le, int(counts[le]), len(want))
        for i, row in enumerate(want):
            assert torch.equal(a[le, i], row), (le, i)


def _rank(rank, world, uid, q, engine):
    try:
        import torch

        os.environ["SYMMALLOC_TIMEOUT_S"] = "30"
        torch.set_num_threads(1)
        comm = symmalloc.Communicator(rank, world, uid)
        x, idx, w = _inputs(torch, rank)
        ref = _reference(torch, x, idx, w)
        report = {}
        if engine == "vllm":
            from symmalloc.integrations import vllm as ad

            mgr = ad.SymmallocAll2AllManager(comm)
            m = mgr.get_handle(dict(max_num_tokens_per_dp_rank=T, hidden_size=H, num_topk=K, num_experts=E))
            assert mgr.get_handle(dict(max_num_tokens_per_dp_rank=T, hidden_size=H, num_topk=K, num_experts=E)) is m
            pf = ad.SymmallocPrepareAndFinalize(m)
            report["real"] = ad.ENGINE is not None
            if ad.ENGINE is not None:
                from vllm.model_executor.layers.fused_moe import modular_kernel as mk
                from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceDelegate
                assert isinstance(pf, mk.FusedMoEPrepareAndFinalizeModular)
                delegate = TopKWeightAndReduceDelegate()
            else:
                delegate = type("TopKWeightAndReduceDelegate", (), {})()  # stand-in, named like vllm's
            assert pf.activation_format == ad.FusedMoEActivationFormat.BatchedExperts
            quant = type("QuantConfig", (), {"a1_scale": None, "quant_dtype": None})()
            a, a_s, meta, ids2, w2 = pf.prepare(x, w, idx, E, None, False, quant)
            assert a_s is None and ids2 is None and w2 is None
            assert isinstance(meta, ad.ExpertTokensMetadata) and meta.expert_num_tokens_cpu is None
            counts = meta.expert_num_tokens
            _check_layout(torch, a, counts, m, world)
            out = _experts(torch, a, counts, m.first_expert)
            y = torch.empty(x.shape[0], H, dtype=torch.bfloat16)
            pf.finalize(y, out, w, idx, False, delegate)
            with pytest.raises(ValueError, match="TopKWeightAndReduceDelegate"):
                pf.finalize(y, out, w, idx, False, object())
            mgr.destroy()
        else:
            from symmalloc.integrations import sglang as ad

            m = comm.moe(max_tokens_per_rank=T, hidden=H, topk=K, num_experts=E, dtype=torch.bfloat16)
            m2 = comm.moe(max_tokens_per_rank=T, hidden=H, topk=K, num_experts=E, dtype=torch.bfloat16)
            disp, disp2 = ad.SymmallocDeepEPLLDispatcher(m), ad.SymmallocDeepEPLLDispatcher(m2)
            report["real"] = ad.ENGINE is not None
            if ad.ENGINE is not None:
                from sglang.srt.layers.moe.token_dispatcher import base, deepep
                assert isinstance(disp, base.BaseDispatcher)
                assert ad.DeepEPLLDispatchOutput is deepep.DeepEPLLDispatchOutput
            topk = type("TopK", (), {"topk_ids": idx, "topk_weights": w})()
            # Two-batch overlap: two dispatchers (one per micro-batch), their halves interleaved,
            # a barrier (another collective) between a send and its receive. The second
            # micro-batch sends the rows flipped: other data through the same routing.
            xf = x.flip(1).contiguous()
            disp.dispatch_a(x, topk)
            with pytest.raises(RuntimeError, match="call dispatch_b first"):
                disp.dispatch_a(x, topk)
            disp2.dispatch_a(xf, topk)
            comm.barrier()
            d = disp.dispatch_b()
            d2 = disp2.dispatch_b()
            with pytest.raises(RuntimeError, match="no dispatch_a before it"):
                disp.dispatch_b()
            assert isinstance(d, ad.DeepEPLLDispatchOutput) and d.hidden_states_scale is None and d.expected_m >= 1
            _check_layout(torch, d.hidden_states, d.masked_m, m, world)
            assert torch.equal(d2.masked_m, d.masked_m)
            for le in range(m.local_experts):
                c = int(d.masked_m[le])
                assert torch.equal(d2.hidden_states[le, :c], d.hidden_states[le, :c].flip(1)), le
            out = _experts(torch, d.hidden_states, d.masked_m, m.first_expert)
            out2 = _experts(torch, d2.hidden_states, d2.masked_m, m2.first_expert)
            disp.combine_a(ad.DeepEPLLCombineInput(out, idx, w))
            disp2.combine_a(ad.DeepEPLLCombineInput(out2, idx, w))
            comm.barrier()
            y = disp.combine_b()
            y2 = disp2.combine_b()
            with pytest.raises(RuntimeError, match="no combine_a before it"):
                disp.combine_b()
            # The halves give what the one-call forms give, bit for bit (rows past the counts are
            # not compared).
            assert torch.equal(y, disp.combine(ad.DeepEPLLCombineInput(out, idx, w)))
            counts, rows = d.masked_m.clone(), d.hidden_states.clone()
            d.hidden_states.fill_(float("nan"))
            d1 = disp.dispatch(x, topk)
            assert torch.equal(d1.masked_m, counts)
            for le in range(m.local_experts):
                c = int(counts[le])
                assert torch.equal(d1.hidden_states[le, :c], rows[le, :c]), le
            assert torch.equal(y, disp.combine(ad.DeepEPLLCombineInput(out, idx, w)))
            ref2 = _reference(torch, xf, idx, w)
            err2 = (y2.double() - ref2).abs().max().item() if x.shape[0] else 0.0
            assert err2 <= 2 ** -7 * (ref2.abs().max().item() + 1) + 1e-3, err2
            m.close()
            m2.close()
        err = (y.double() - ref).abs().max().item() if x.shape[0] else 0.0
        tol = 2 ** -7 * (ref.abs().max().item() + 1) + 1e-3
        assert err <= tol, f"rank {rank}: max |y - float64 reference| {err} > {tol}"
        report["err"] = err
        comm.barrier()
        comm.close()
        q.put((rank, report, None))
    except Exception:
        q.put((rank, None, traceback.format_exc()))


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_adapter_against_float64_reference_2_ranks(engine):
    from test_moe_host import _spawn

    got = _spawn(_rank, 2, engine)
    real = {r["real"] for r in got.values()}
    assert len(real) == 1
    print(f"{engine}: {'the real engine types' if real.pop() else 'stand-ins (engine not installed)'}, "
          f"max err {max(r['err'] for r in got.values())}")
