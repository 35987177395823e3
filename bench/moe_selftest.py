"""`python3 bench/moe.py --selftest`: bench/moe_lib.py's helpers on the CPU, checked against direct
counts and float64, then the NCCL baseline's algorithm (A2ABaseline), FP8 included, and the
throughput-mode adapter at 2 processes over gloo. No GPU, no symmalloc library.
"""
import math
import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_lib import (DTYPES, ROUTINGS, TP_FIELDS, A2ABaseline, TpUnsupported, bytes_moved, capacity_for,
                     dequantize_fp8, expected_recv, expert_fn, expert_popularity, expert_scales, fp8_error_bound,
                     fp8q_kwargs, gather, gather_json, mode_kwargs, model_bytes, moe_params, parse_int_list, parse_list,
                     probe_phases, quantize_fp8, recv_capacity, reference_y, rel_err, routing, routing_stats,
                     row_bytes, scales_rows, tokens_x, tp_expert_rows, tp_reference_dispatch, ue8m0_ceil, units)

def selftest_pure():
    """moe_lib's pure functions, in one process; returns the lines to print."""
    out = []
    # Lists.
    assert parse_list("bf16, fp8,bf16", DTYPES, "--dtypes") == ["bf16", "fp8"]
    assert parse_list("uniform,skewed", ROUTINGS, "--routing") == ["uniform", "skewed"]
    for bad in ("bf16,fp4", ""):
        try:
            parse_list(bad, DTYPES, "--dtypes")
        except ValueError as e:
            assert "--dtypes" in str(e) and "known: bf16, fp8, fp8q" in str(e), e
        else:
            raise AssertionError(f"parse_list({bad!r}) accepted")
    assert parse_int_list("0,24,24", "--num-sms", 0, 1024) == [0, 24]
    for bad in ("0,x", "-1", "2000", ","):
        try:
            parse_int_list(bad, "--num-sms", 0, 1024)
        except ValueError as e:
            assert "--num-sms" in str(e), e
        else:
            raise AssertionError(f"parse_int_list({bad!r}) accepted")
    out.append("lists: --dtypes/--routing/--modes/--num-sms parse and refuse unknown, empty, out of range")

    # Routing: uniform is the legacy draw; skewed is deterministic, distinct, Categorical(p) in slot 0.
    T, K, E = 20000, 8, 256
    g = torch.Generator().manual_seed(77)
    legacy = torch.rand(T, E, generator=g).topk(K, dim=1).indices
    iu, wu = routing(T, K, E, 77)
    assert torch.equal(iu, legacy), "uniform routing changed"
    i1, w1 = routing(T, K, E, 77, skew=1.0)
    i2, w2 = routing(T, K, E, 77, skew=1.0)
    i3, _ = routing(T, K, E, 78, skew=1.0)
    assert torch.equal(i1, i2) and torch.equal(w1, w2) and not torch.equal(i1, i3), "skewed routing not deterministic"
    assert torch.equal(wu, w1), "weights must not depend on the skew"
    assert bool((i1.sort(1).values.diff(dim=1) > 0).all()), "skewed routing: experts not distinct"
    p = expert_popularity(E, 1.0)
    assert abs(float(p.sum()) - 1) < 1e-12 and torch.equal(p, expert_popularity(E, 1.0))
    hot = int(p.argmax())
    h_256 = sum(1.0 / k for k in range(1, E + 1))
    assert abs(float(p[hot]) - 1 / h_256) < 1e-12 and abs(float(p.min()) - 1 / (E * h_256)) < 1e-12
    f0 = torch.bincount(i1[:, 0], minlength=E).double() / T
    sigma = math.sqrt(float(p[hot]) * (1 - float(p[hot])) / T)
    assert abs(float(f0[hot] - p[hot])) < 5 * sigma, (float(f0[hot]), float(p[hot]))
    tv = 0.5 * float((f0 - p).abs().sum())
    assert tv < 0.05, f"slot 0 vs Categorical(p): total variation {tv}"
    incl = float((i1 == hot).any(1).double().mean())
    assert 0.70 < incl < 0.86, incl  # without replacement, top-8: the hottest expert in ~78% of tokens
    st = routing_stats(torch.bincount(i1.reshape(-1), minlength=E), 8)
    su = routing_stats(torch.bincount(iu.reshape(-1), minlength=E), 8)
    assert st["hottest_expert"] == hot and st["expert_max_over_mean"] > 15, st
    # The fixed permutation puts 36% of the popularity on rank 6 of 8: ~2.3x the mean rank load.
    assert 2.0 < st["rank_max_over_mean"] < 2.6 and su["rank_max_over_mean"] < 1.03, (st, su)
    assert su["expert_max_over_mean"] < 1.2, su
    assert routing_stats(torch.tensor([4, 0, 0, 0]), 2) == {"expert_max_over_mean": 4.0, "rank_max_over_mean": 2.0,
                                                           "expert_max": 4, "hottest_expert": 0}
    out.append(f"routing: uniform == legacy topk(rand); skewed Zipf s=1 deterministic, slot 0 vs Categorical(p) "
               f"TV {tv:.4f}, hottest expert p {float(p[hot]):.4f} drawn {float(f0[hot]):.4f}, "
               f"in {incl:.3f} of tokens; "
               f"EP8 expert max/mean {st['expert_max_over_mean']:.1f}, rank max/mean {st['rank_max_over_mean']:.2f} "
               f"(uniform {su['rank_max_over_mean']:.3f})")

    # FP8: quantize / dequantize against float64, the scale rule, UE8M0.
    x = tokens_x(64, 1024, 5) * 3
    x[3, :128] = 0  # an all-zero group: scale FLT_MIN, q zero
    x[4, 5] = 1e-3  # a lone small value among zeros: subnormal-free after scaling
    q, s = quantize_fp8(x)
    amax = x.float().view(64, 8, 128).abs().amax(-1)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (64, 8)
    want_s = (amax / 448.0).clamp_min(1.1754943508222875e-38)
    assert torch.equal(s, want_s), "scale != max(amax / 448, FLT_MIN)"
    deq = dequantize_fp8(q, s).double()
    err = (deq - x.double()).abs()
    bound = fp8_error_bound(x, s)
    assert bool((err <= bound).all()), f"e4m3 error above bound: {float((err - bound).max())}"
    assert float(err.max()) > 0 and bool((deq[3, :128] == 0).all())
    assert float(q.float().abs().max()) == 448.0, "the largest element of a group must map to 448"
    rel = float((deq - x.double()).norm() / x.double().norm())
    assert 0.005 < rel < 0.05, rel  # e4m3: 3 mantissa bits
    v = torch.tensor([1.0, 1.5, 0.75, 2.0 ** -126, 3.0e-5])
    assert ue8m0_ceil(v).tolist() == [1.0, 2.0, 1.0, 2.0 ** -126, 2.0 ** -15]
    qu, su8 = quantize_fp8(x, ue8m0=True)
    m, e = torch.frexp(su8)
    assert bool((m == 0.5).all()) and bool((su8 >= s).all()) and bool((su8 < 2 * s).all() | (s == su8).all())
    assert bool(((dequantize_fp8(qu, su8).double() - x.double()).abs() <= fp8_error_bound(x, su8)).all())
    out.append(f"fp8: scales == max(amax/448, FLT_MIN); |x - dequant| <= max(2^-4 |x|, 2^-10 s) on all "
               f"{x.numel()} elements (norm-relative {rel:.4f}); ue8m0 scales powers of two in [s, 2s)")

    # The scale layouts.
    L, R, S = 3, 6, 4
    rows = torch.arange(L * R * S, dtype=torch.float32).view(L, R, S)
    r4 = 8
    col = torch.full((L, S, r4), -1.0)
    col[:, :, :R] = rows.transpose(1, 2)
    assert torch.equal(scales_rows(rows, "row", L, R, S), rows)
    assert torch.equal(scales_rows(col, "col_tma", L, R, S), rows), "col_tma scales read back wrong"
    out.append("scale layouts: row and col_tma (R rounded to 4) read back to [L, R, S]")

    # Bytes both ways against a direct count.
    T, K, E, W, H = 37, 8, 32, 4, 7168
    idx, _ = routing(T, K, E, 3, skew=1.0)
    idx[::5, 2] = -1
    Lx = E // W
    for rank in range(W):
        ll_all = sum(1 for r in idx.tolist() for e in r if e >= 0)
        ll_rem = sum(1 for r in idx.tolist() for e in r if e >= 0 and e // Lx != rank)
        tp_all = sum(len({e // Lx for e in r if e >= 0}) for r in idx.tolist())
        tp_rem = sum(len({e // Lx for e in r if e >= 0} - {rank}) for r in idx.tolist())
        assert units(idx, rank, Lx, W, "low_latency") == (ll_all, ll_rem)
        assert units(idx, rank, Lx, W, "throughput") == (tp_all, tp_rem)
        for payload, rb in (("bf16", H * 2), ("fp8", H + H // 128 * 4)):
            mv = bytes_moved(idx, rank, Lx, W, H, payload, "throughput")
            assert mv["remote"]["dispatch"] == tp_rem * rb and mv["all"]["combine"] == tp_all * H * 2
            assert mv["all"]["dispatch+combine"] == tp_all * (rb + H * 2)
            mv = bytes_moved(idx, rank, Lx, W, H, payload)
            assert mv["remote"]["dispatch"] == ll_rem * rb and mv["all"]["dispatch"] == ll_all * rb
    assert row_bytes(7168, "fp8") == 7168 + 56 * 4 and row_bytes(7168, "bf16") == 14336
    assert model_bytes(128, 8, 8, 7168) == 128 * 8 * 7 / 8 * 7168 * 2
    out.append(f"bytes: remote/all rows per (token, expert) and per (token, rank) == direct counts at W={W} "
               f"(rank 0 (all, remote): {units(idx, 0, Lx, W, 'low_latency')} vs "
               f"{units(idx, 0, Lx, W, 'throughput')}); FP8 row {row_bytes(7168, 'fp8')} B")

    # Capacities.
    cap = recv_capacity(4096, 8, 256, 2, 1.5)
    assert cap % 16 == 0 and 256 * 1.5 < cap <= 2 * 4096
    assert capacity_for(100, 4096, 8, 256, 2, 1.5, "uniform") == cap
    assert capacity_for(6390, 4096, 8, 256, 2, 1.5, "skewed") == 6400
    assert capacity_for(9000, 4096, 8, 256, 2, 1.5, "skewed") == 8192
    out.append(f"capacity: uniform prefill {cap} rows per expert (model), skewed = hottest count to 16, <= W*T")

    # Feature detection of comm.moe's keywords (stand-in signatures).
    def today(max_tokens_per_rank, hidden, topk, num_experts, dtype="bf16", max_recv_per_expert=0, num_sms=0):
        pass

    def next_(max_tokens_per_rank, hidden, topk, num_experts, dtype="bf16", max_recv_per_expert=0, num_sms=0,
              mode="low_latency", input_dtype=None, scale_layout="row", ue8m0=False):
        pass

    def other(max_tokens_per_rank, hidden, topk, num_experts, dtype="bf16", quantize=False):
        pass

    def kwargs(*a, **kw):
        pass

    p0, p1, p2, p3 = moe_params(today), moe_params(next_), moe_params(other), moe_params(kwargs)
    assert p3 is None and "num_sms" in p0
    assert fp8q_kwargs(p0) is None and mode_kwargs(p0, "throughput") is None and mode_kwargs(p0, "low_latency") == {}
    assert fp8q_kwargs(p1, ue8m0=True) == {"dtype": torch.float8_e4m3fn, "input_dtype": torch.bfloat16,
                                           "scale_layout": "row", "ue8m0": True}
    assert mode_kwargs(p1, "throughput") == {"mode": "throughput"}
    assert fp8q_kwargs(p2) == {"dtype": torch.float8_e4m3fn, "quantize": True} and fp8q_kwargs(p2, ue8m0=True) is None
    assert fp8q_kwargs(p3)["input_dtype"] == torch.bfloat16 and mode_kwargs(p3, "throughput") == {"mode": "throughput"}
    out.append("feature detection: today's comm.moe -> fp8q and throughput not supported; input_dtype=/quantize=, "
               "mode=, scale_layout=, ue8m0= picked when present")

    # The probe's result shapes.
    assert probe_phases([("start", 1000), ("route", 3500), ("send", 4000)]) == [("route", 2.5), ("send", 0.5)]
    assert probe_phases({"start": 0, "wait": 1500}) == [("wait", 1.5)]
    assert probe_phases({"durations_us": {"a": 1.25}}) == [("a", 1.25)]
    nested = {"dispatch": {"start": 1000, "routed": 2000, "recv_start": 1500, "published": 4500, "epoch": 7},
              "combine": {"start": 9000, "summed": 9500, "epoch": 3}}
    assert probe_phases(nested) == [("dispatch.routed+", 1.0), ("dispatch.recv_start+", 0.5),
                                    ("dispatch.published+", 3.5), ("combine.summed+", 0.5)]
    assert probe_phases([("a", 5), ("b", 3)]) is None and probe_phases("x") is None and probe_phases(7) is None
    out.append("probe: (phase, ns) timestamps -> us per phase; unordered or unknown shapes -> printed raw")
    return out


def selftest_rank(rank, world, port, q):
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        group = dist.group.WORLD
        done = []
        cases = ((5, 256, 4, 16, False, 0.0, "bf16"), (64, 512, 8, 32, False, 0.0, "bf16"),
                 (1, 128, 8, 16, False, 0.0, "bf16"), (7, 256, 3, 8, True, 0.0, "bf16"),
                 (64, 512, 8, 32, False, 1.0, "bf16"), (48, 512, 8, 32, True, 1.0, "fp8"),
                 (5, 256, 4, 16, False, 0.0, "fp8"))
        for T, H, K, E, hole, skew, dname in cases:
            L = E // world
            seed = 11 + 1000 * rank + T
            x = tokens_x(T, H, seed)
            idx, w = routing(T, K, E, seed + 1, skew=skew)
            assert all(len(set(r)) == K for r in idx.tolist()), "routing: experts not distinct"
            if hole:  # some unused slots (-1)
                idx[::2, -1] = -1
            scales = expert_scales(E, H)
            xq = qs = None
            if dname == "fp8":
                xq, qs = quantize_fp8(x)
            ref_bf16 = reference_y(x, idx, w, scales)
            ref = reference_y(xq, idx, w, scales, qs) if dname == "fp8" else ref_bf16
            bl = A2ABaseline(group, world, rank, E)
            grouped, gs, gle, cnt, h = bl.dispatch(x if xq is None else xq, idx, qs)
            # The baseline's grouping is docs/moe.md's layout: by local expert, source, token.
            all_idx = torch.stack(gather(idx, group, world, True))
            all_x = torch.stack(gather(x, group, world, True))
            all_w = torch.stack(gather(w, group, world, True))
            counts, le, src = expected_recv(all_idx, rank, L, world)
            assert torch.equal(cnt, counts), f"counts {cnt.tolist()} vs {counts.tolist()}"
            assert torch.equal(gle, le), "local expert per row"
            if dname == "fp8":
                all_q = torch.stack(gather(xq, group, world, True)).reshape(-1, H)
                all_s = torch.stack(gather(qs, group, world, True)).reshape(-1, H // 128)
                assert torch.equal(grouped.view(torch.uint8), all_q[src].view(torch.uint8)), "grouped e4m3 rows"
                assert torch.equal(gs, all_s[src]), "grouped scales"
            else:
                want = all_x.reshape(-1, H)[src]
                assert torch.equal(grouped.view(torch.int16), want.view(torch.int16)), "grouped rows"
            eo = expert_fn(grouped, scales[rank * L + gle], gs)
            y = bl.combine(eo, h, w, idx)
            c = rel_err(y, ref)
            assert c["finite"] and c["rel_norm"] < 4e-3, f"baseline vs float64: {c}"
            cb = rel_err(y, ref_bf16)["rel_norm"]
            if dname == "fp8":
                assert 2e-3 < cb < 0.08, f"fp8 y vs the unquantized reference {cb}: quantization lost or too coarse"
            # The reference itself against a direct loop for a few tokens (dequantized rows for FP8).
            for t in range(min(T, 3)):
                acc = torch.zeros(H, dtype=torch.float64)
                xr = x[t].double() if dname == "bf16" else dequantize_fp8(xq[t:t + 1], qs[t:t + 1])[0].double()
                for k in range(K):
                    e = int(idx[t, k])
                    if e >= 0:
                        acc += float(w[t, k]) * (xr.float() * scales[e].float()).to(torch.bfloat16).double()
                assert (acc - ref[t]).abs().max() < 1e-6 * acc.abs().max() + 1e-3, "reference vs loop"
            # Throughput mode's adapter, on the reference dispatch: expert rows, then a combine
            # that sums every rank's row of each token (gathered), against float64.
            ex_tp = None
            if dname == "bf16":
                d = tp_reference_dispatch(all_x, all_idx, all_w, rank, L)
                eo_tp, n = tp_expert_rows(d, scales, rank * L)
                assert n == d[TP_FIELDS["count"]] and eo_tp.shape == (n, H)
                pad_src = torch.full((world * T,), -1, dtype=torch.int64)
                pad_src[:n] = d[TP_FIELDS["src"]]
                pad_rows = torch.zeros(world * T, H, dtype=torch.bfloat16)
                pad_rows[:n] = eo_tp
                acc = torch.zeros(T, H, dtype=torch.float32)
                for srcs, rows in zip(gather(pad_src, group, world, True), gather(pad_rows, group, world, True)):
                    mine = (srcs >= 0) & (srcs // T == rank)
                    acc.index_add_(0, srcs[mine] % T, rows[mine].float())
                c2 = rel_err(acc.to(torch.bfloat16), ref)
                assert c2["finite"] and c2["rel_norm"] < 1e-2, f"throughput adapter vs float64: {c2}"
                # Its row count is the units() count of (token, rank) pairs, seen from the receiver.
                sent = sum(units(all_idx[s], rank, L, world, "throughput")[0] - units(all_idx[s], rank, L, world,
                                                                                       "throughput")[1]
                           for s in range(world))
                assert n == sent, (n, sent)
                ex_tp = c2["rel_norm"]
                # a missing field is named
                try:
                    tp_expert_rows({k: v for k, v in d.items() if k != TP_FIELDS["weights"]}, scales, rank * L)
                except TpUnsupported as e:
                    assert TP_FIELDS["weights"] in str(e)
                else:
                    raise AssertionError("tp_expert_rows accepted a result without weights")
            pairs = units(idx, rank, L, world, "low_latency")[1]
            want_pairs = sum(1 for r in idx.tolist() for e in r if e >= 0 and e // L != rank)
            assert pairs == want_pairs
            done.append((T, H, K, E, hole, skew, dname, c["max_abs"], c["rel_norm"], cb, ex_tp, pairs))
        # The probe's results travel as JSON bytes (no pickling).
        got = gather_json({"rank": rank, "phases": [["route", 1.5 + rank]]}, group, world, True)
        assert got == [{"rank": r, "phases": [["route", 1.5 + r]]} for r in range(world)], got
        # Uniform routing's remote fraction is near (W-1)/W.
        idx, _ = routing(4096, 8, 256, 5 + rank)
        frac = units(idx, rank, 128, 2, "low_latency")[1] / (4096 * 8)
        assert abs(frac - 0.5) < 0.02, frac
        dist.barrier()
        dist.destroy_process_group()
        q.put((rank, done, None))
    except Exception:  # noqa: BLE001
        q.put((rank, None, traceback.format_exc()))


def selftest():
    for line in selftest_pure():
        print(f"selftest: {line}")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = 29700 + os.getpid() % 200
    procs = [ctx.Process(target=selftest_rank, args=(r, 2, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = [q.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(30)
    bad = [f for _, _, f in got if f]
    if bad:
        sys.exit("selftest FAILED:\n" + "\n".join(bad))
    for rank, done, _ in sorted(got):
        for T, H, K, E, hole, skew, dname, mx, rel, cb, tp, pairs in done:
            print(f"selftest rank {rank}: T={T} H={H} K={K} E={E} {'skewed' if skew else 'uniform'} {dname}"
                  f"{' (-1 slots)' if hole else ''}: baseline layout == docs/moe.md order, y vs float64 max abs "
                  f"{mx:.3g} rel {rel:.3g}" + (f" (vs unquantized {cb:.3g})" if dname != "bf16" else "")
                  + (f", throughput adapter rel {tp:.3g}" if tp is not None else "") + f", remote pairs {pairs}")
    print("selftest ok")
