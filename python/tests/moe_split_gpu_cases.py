"""The split halves (``dispatch_send`` / ``dispatch_recv``, ``combine_send`` / ``combine_recv``;
docs/moe.md, "Split halves") and the clock probe in python/tests/moe_gpu_check.py (imported by
it; not collected by pytest): each case on GPUs and, without its stream and graph parts, on the
host backend.

- ``split_eager_case``: a case through the one-call forms, then through the halves with work
  between them (a matmul on the current stream) and, on GPUs, each receive half on a side
  stream (the library orders it after its send): the layout and ``y`` checked against the
  reference and ``y`` bit for bit the one-call form's.
- ``split_graph_case``: dispatch send, a matmul, dispatch receive, the experts, combine send, a
  matmul, combine receive captured once in a CUDA graph, replayed with new routing.
- ``probe_case``: an object made with ``probe=True``, a split pair and a one-call pair, the
  probe's words in phase order (across the halves) and the phases' durations as the detail.
"""
import torch

from moe_gpu_check import (
    BF16, FP8, Check, bits, check_layout, check_y, combine_reference, expected_layout, expert_fn, expert_out,
    make_inputs, poison, seed_of,
)


def _work(ctx):
    """Other work for between the halves (a small matmul on the current stream)."""
    a = torch.randn(256, 256, device=ctx.dev)
    return a @ a


def _case_inputs(ctx, moe, name, k, n, step=0):
    payload = BF16 if moe.dtype == "bfloat16" else FP8
    x, scales, idx, w = make_inputs(seed_of(name, ctx.rank, step), n, moe.hidden, k, moe.num_experts, payload)
    all_x, all_s, all_idx, all_n = ctx.gather_inputs(x, scales, idx, moe.max_tokens_per_rank)
    lay = expected_layout(all_idx, all_n, moe.rank, moe.local_experts, moe.max_recv, moe.max_tokens_per_rank, moe.topk)
    dev = [None if t is None else t.to(ctx.dev) for t in (x, idx, w, scales)]
    return (x, scales, idx, w), (all_x, all_s), lay, dev


def split_eager_case(ctx, moe, name, k, n):
    ck = Check()
    (x, scales, idx, w), (all_x, all_s), lay, (xd, idd, wd, sd) = _case_inputs(ctx, moe, name, k, n)
    ref = combine_reference(x, scales, idx, w)
    d = moe.dispatch(xd, idd, wd, sd)
    eo = expert_out(moe, d, lay, ctx.dev)
    y1 = moe.combine(eo).clone()
    ctx.sync()
    check_y(ck, y1, ref, f"{name} one-call")
    side = torch.cuda.Stream(ctx.dev) if ctx.cuda else None
    for t in moe._buffer_views(True):
        poison(t)
    h = moe.dispatch_send(xd, idd, wd, sd)
    _work(ctx)
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(ctx.dev))  # the side stream sees the poison
        with torch.cuda.stream(side):
            d2 = moe.dispatch_recv(h)
        torch.cuda.current_stream(ctx.dev).wait_stream(side)
    else:
        d2 = moe.dispatch_recv(h)
    ctx.sync()
    check_layout(ck, ctx, moe, d2, lay, all_x, all_s, f"{name} split")
    eo2 = expert_out(moe, d2, lay, ctx.dev)
    moe.combine_send(eo2)
    _work(ctx)
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(ctx.dev))
        with torch.cuda.stream(side):
            y2 = moe.combine_recv()
        torch.cuda.current_stream(ctx.dev).wait_stream(side)
    else:
        y2 = moe.combine_recv()
    ctx.sync()
    check_y(ck, y2, ref, f"{name} split")
    ck(torch.equal(bits(y2.cpu()), bits(y1.cpu())), f"{name}: the halves' y differs from the one-call form's")
    return ck.done(f"{n} tokens here, {int(lay[0].sum())} rows received" + (", receives on a side stream" if side else ""))


def split_graph_case(ctx, moe, name, k, n, replays=6):
    ck = Check()
    L, R, H = moe.local_experts, moe.max_recv, moe.hidden
    steps = [_case_inputs(ctx, moe, name, k, n, i) for i in range(replays)]
    x, idx, w, scales = (None if t is None else t.clone() for t in steps[0][3])
    experts = (moe.first_expert + torch.arange(L, device=ctx.dev)).repeat_interleave(R)
    a = torch.randn(256, 256, device=ctx.dev)

    def layer():
        h = moe.dispatch_send(x, idx, w, scales)
        b = a @ a  # work between the halves
        d = moe.dispatch_recv(h)
        sc = None if d.recv_scales is None else d.recv_scales.reshape(L * R, -1)
        eo = expert_fn(d.recv_x.reshape(L * R, H), sc, experts).view(L, R, H)
        moe.combine_send(eo, d)
        c = b @ a
        return d, moe.combine_recv(), c

    s = torch.cuda.Stream(ctx.dev)
    s.wait_stream(torch.cuda.current_stream(ctx.dev))
    with torch.cuda.stream(s):
        layer()  # warm-up, eager
    torch.cuda.current_stream(ctx.dev).wait_stream(s)
    ctx.sync()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        d, y, _ = layer()
    for i, ((xi, si, ii, wi), (all_x, all_s), lay, (xd, idd, wd, sd)) in enumerate(steps):
        x.copy_(xd)
        idx.copy_(idd)
        w.copy_(wd)
        if scales is not None:
            scales.copy_(sd)
        y.view(torch.uint8).fill_(0xFF)
        g.replay()
        ctx.sync()
        check_layout(ck, ctx, moe, d, lay, all_x, all_s, f"{name} replay {i}")
        check_y(ck, y, combine_reference(xi, si, ii, wi), f"{name} replay {i}")
    del g
    return ck.done(f"{replays} replays of the halves with new routing")


def probe_case(ctx, comm, hidden):
    """An object with the clock probe: a split pair then a one-call pair, the words checked."""
    ck = Check()
    order_d = ["start", "routed", "staged", "published", "recv_start", "waited", "pulled"]
    order_c = ["start", "pushed", "recv_start", "waited", "summed"]
    detail = ""
    with comm.moe(max_tokens_per_rank=ctx.T, hidden=hidden, topk=8, num_experts=ctx.E, dtype=BF16, probe=True) as m:
        name = "probe"
        for i, split in enumerate((True, False)):
            (x, scales, idx, w), _, lay, (xd, idd, wd, sd) = _case_inputs(ctx, m, name, 8, min(128, ctx.T), i)
            if split:
                d = m.dispatch_recv(m.dispatch_send(xd, idd, wd))
                m.combine_send(expert_out(m, d, lay, ctx.dev))
                y = m.combine_recv()
            else:
                d = m.dispatch(xd, idd, wd)
                y = m.combine(expert_out(m, d, lay, ctx.dev))
            ctx.sync()
            check_y(ck, y, combine_reference(x, scales, idx, w), f"probe call {i}")
            p = m.probe()
            pd, pc = p["dispatch"], p["combine"]
            ck(pd["epoch"] == pc["epoch"] == i + 1, f"probe call {i}: epochs {pd['epoch']}, {pc['epoch']}")
            le = lambda q, ks: all(q[a] <= q[b] for a, b in zip(ks, ks[1:]))  # noqa: E731
            ok = le(pd, order_d[:4]) and le(pd, ["routed", "recv_start", "waited", "pulled"]) and le(pd, ["staged", "waited"])
            ok = ok and le(pc, ["start", "pushed", "summed"]) and le(pc, ["start", "recv_start", "waited", "summed"])
            if split:
                ok = ok and le(pd, order_d) and le(pc, order_c)
            ck(ok and pd["pulled"] <= pc["start"], f"probe call {i} (split {split}): words out of order: {p}")
            if split:
                us = lambda q, a, b: (q[b] - q[a]) / 1e3  # noqa: E731
                detail = (f"dispatch send {us(pd, 'start', 'published'):.1f} us, wait {us(pd, 'recv_start', 'waited'):.1f}, "
                          f"pull {us(pd, 'waited', 'pulled'):.1f}; combine push {us(pc, 'start', 'pushed'):.1f}, "
                          f"wait {us(pc, 'recv_start', 'waited'):.1f}, sum {us(pc, 'waited', 'summed'):.1f}")
    return ck.done(detail)


def cases(ctx, comm, mb, mf, hidden, host):
    """The (name, fn) pairs moe_gpu_check.py runs."""
    out = []
    for m in (mb, mf):
        tag = "bf16" if m is mb else "fp8"
        for k, n in ((8, min(128, ctx.T)), (2, 1)):
            name = f"split {tag} k={k} tokens={n}"
            out.append((name, lambda m=m, name=name, k=k, n=n: split_eager_case(ctx, m, name, k, n)))
        if not host:
            name = f"split {tag} in a CUDA graph, k=8 tokens=128, routing new each replay"
            out.append((name, lambda m=m, name=name: split_graph_case(ctx, m, name, 8, min(128, ctx.T))))
    out.append(("clock probe: split and one-call pairs", lambda: probe_case(ctx, comm, hidden)))
    return out
