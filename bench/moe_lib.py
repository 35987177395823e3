"""bench/moe.py's pure helpers: routing (uniform and skewed), FP8 quantization and its reference,
bytes accounting, capacities, list arguments, feature detection of comm.moe's optional keywords,
the throughput-mode adapter, the per-phase probe's normalization, gathers over a process group
(tensors as bytes, small JSON results) and the NCCL all_to_all_single baseline. Everything here
runs on the CPU (torch CPU tensors, gloo for the baseline) and is exercised by
`python3 bench/moe.py --selftest` (bench/moe_selftest.py).

Invariants: nothing here touches a GPU or symmalloc's library; every random draw comes from a
torch.Generator seeded by the caller, so a routing or a payload is a pure function of its
arguments (the same on every machine, CPU or GPU, run after run).
"""
import inspect
import math

import torch
import torch.distributed as dist

SHAPES = {"decode1": 1, "decode128": 128, "prefill4096": 4096}
PREFILL_MIN_TOKENS = 1024  # shapes with this many tokens per rank size max_recv by the load
ROUTINGS = ("uniform", "skewed")
DTYPES = ("bf16", "fp8", "fp8q")
MODES = ("low_latency", "throughput")
FP8_GROUP = 128  # elements per fp32 scale
E4M3_MAX = 448.0
FLT_MIN = 1.1754943508222875e-38  # the smallest normal fp32: the scale's floor (kernels/quant.cuh)
POPULARITY_PERM_SEED = 20261205  # which expert is the k-th most popular: the same on every rank

# World-1 latency targets (one GPU, every expert local, graphed p50 in us): what the kernels
# themselves cost, with no peer to wait for.
WORLD1_TARGETS = {("decode1", "dispatch"): 5.0, ("decode1", "combine"): 5.0,
                  ("decode128", "dispatch"): 12.0, ("decode128", "combine"): 10.0}
PREFILL_SMS_TARGET = 24  # prefill at <= 24 SMs: the row DeepEP's normal-mode figures are quoted at
PREFILL_LINK_SHARE = 0.8


# ---------------------------------------------------------------- arguments

def parse_list(text, known, what):
    """A comma list of names from `known`, in the order given, duplicates dropped. ValueError
    names the unknown ones and the known ones."""
    out = []
    for s in (p.strip() for p in str(text).split(",")):
        if s and s not in out:
            out.append(s)
    bad = [s for s in out if s not in known]
    if bad or not out:
        raise ValueError(f"{what}: {'unknown ' + str(bad) if bad else 'empty'}; known: {', '.join(known)}")
    return out


def parse_int_list(text, what, lo=0, hi=1 << 31):
    """A comma list of integers in [lo, hi] (e.g. --num-sms 0,24: 0 is 'every SM')."""
    out = []
    for s in (p.strip() for p in str(text).split(",")):
        if not s:
            continue
        try:
            v = int(s)
        except ValueError:
            raise ValueError(f"{what}: {s!r} is not an integer") from None
        if not lo <= v <= hi:
            raise ValueError(f"{what}: {v} is outside {lo}..{hi}")
        if v not in out:
            out.append(v)
    if not out:
        raise ValueError(f"{what}: empty")
    return out


# ---------------------------------------------------------------- routing

def expert_popularity(experts, s, perm_seed=POPULARITY_PERM_SEED):
    """Zipf-like popularity, float64 [E] summing to 1: the k-th most popular expert (k = 1..E)
    has weight k^-s; which expert is k-th is a fixed random permutation (perm_seed, the same on
    every rank), so the hot experts are spread over the ranks as DeepEP PR #393 does. s = 0 is
    uniform."""
    w = torch.arange(1, experts + 1, dtype=torch.float64) ** (-float(s))
    perm = torch.randperm(experts, generator=torch.Generator().manual_seed(perm_seed))
    p = torch.empty(experts, dtype=torch.float64)
    p[perm] = w / w.sum()
    return p


def routing(tokens, topk, experts, seed, skew=0.0, device="cpu"):
    """top-k distinct experts per token and softmax weights: (idx int64 [T, K], w fp32 [T, K]).
    Uniform (skew 0): the k largest of E uniform draws. Skewed: the Gumbel-top-k trick on the
    popularity p = expert_popularity(E, skew): the k largest of log p[e] - log(-log u[e]), which
    samples k experts without replacement, each draw proportional to p among those left (as
    torch.multinomial(p, k, replacement=False) in DeepEP PR #393), and whose first column
    (topk sorts, largest first) is exactly Categorical(p). The same u as the uniform case, so
    skew 0 gives the uniform routing bit for bit."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(tokens, experts, generator=g)
    if skew:
        logp = expert_popularity(experts, skew).log()
        key = logp[None, :] - (-u.double().clamp_min(1e-300).log()).log()
    else:
        key = u
    idx = key.topk(topk, dim=1).indices
    w = torch.softmax(torch.randn(tokens, topk, generator=g), dim=1)
    return idx.to(device), w.to(device)


def routing_stats(counts, world):
    """counts [E]: rows each expert receives from every rank together. Max over mean, per expert
    and per rank (DeepEP PR #393's imbalance measure is the latter), and the hottest expert."""
    c = counts.double()
    per_rank = c.view(world, -1).sum(1)
    return {"expert_max_over_mean": float(c.max() / c.mean()) if c.sum() else 0.0,
            "rank_max_over_mean": float(per_rank.max() / per_rank.mean()) if c.sum() else 0.0,
            "expert_max": int(c.max()), "hottest_expert": int(c.argmax())}


def tokens_x(tokens, hidden, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, hidden, generator=g).to(torch.bfloat16).to(device)


def expert_scales(experts, hidden, seed=4242, device="cpu"):
    """Expert e's 'weights': out = bf16(x * s[e]) elementwise; the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return (0.5 + torch.rand(experts, hidden, generator=g)).to(torch.bfloat16).to(device)


# ---------------------------------------------------------------- FP8 (e4m3, one fp32 scale per 128)

def quantize_fp8(x, ue8m0=False):
    """x [..., H] (H % 128 == 0) -> (q float8_e4m3fn [..., H], s float32 [..., H/128]) as the
    kernels quantize (kernels/quant.cuh): s = max(amax / 448, FLT_MIN) per group of 128,
    rounded up to a power of two when ue8m0; q = e4m3(x * (1 / s)), nearest even."""
    *lead, H = x.shape
    v = x.float().reshape(*lead, H // FP8_GROUP, FP8_GROUP)
    s = (v.abs().amax(-1) / E4M3_MAX).clamp_min(FLT_MIN)
    if ue8m0:
        s = ue8m0_ceil(s)
    inv = 1.0 / s
    q = (v * inv[..., None]).reshape(*lead, H).to(torch.float8_e4m3fn)
    return q, s.contiguous()


def ue8m0_ceil(s):
    """Positive fp32 scales rounded up to a power of two on their bits (a nonzero mantissa goes to
    the next exponent; a power of two stays), as kernels/quant.cuh's ue8m0_ceil."""
    b = s.contiguous().view(torch.int32)
    up = (b & 0x7F800000) + 0x800000
    return torch.where((b & 0x7FFFFF) != 0, up, b).view(torch.float32)


def dequantize_fp8(q, s):
    """q [..., H] e4m3, s [..., H/128] fp32 -> fp32 q * s (one fp32 rounding per element)."""
    *lead, H = q.shape
    return (q.float().reshape(*lead, H // FP8_GROUP, FP8_GROUP) * s[..., None]).reshape(*lead, H)


def fp8_error_bound(x, s):
    """Per element, what e4m3 rounding may cost: half a step, 2^-4 of |x| for normals (3 mantissa
    bits), and 2^-10 * s (half the subnormal step 2^-9 * s) near zero; plus one fp32 rounding of
    q * s. float64 [..., H]."""
    *lead, H = x.shape
    sd = s.double()[..., None].expand(*lead, H // FP8_GROUP, FP8_GROUP).reshape(*lead, H)
    xa = x.double().abs()
    return torch.maximum(xa * 2.0 ** -4, sd * 2.0 ** -10) + xa * 2.0 ** -23


def expert_fn(rows, scales, row_scales=None):
    """Expert e's output for received rows: bf16 rows -> bf16(x * s[e]) (bf16 x bf16 in fp32 is
    exact; one rounding); FP8 rows (row_scales given) -> bf16(dequantize(q, qs) * s[e]) (two fp32
    roundings, then one to bf16). The same elementwise ops on the CPU and the GPU, so the
    expert's output is bit for bit the same wherever it runs."""
    if row_scales is not None:
        return (dequantize_fp8(rows, row_scales) * scales.float()).to(torch.bfloat16)
    return (rows.float() * scales.float()).to(torch.bfloat16)


def reference_y(x, idx, w, scales, x_scales=None, chunk=256):
    """float64: y[t] = sum_k w[t,k] * expert_fn(x[t], s[idx[t,k]]) over idx >= 0. FP8: x is e4m3
    and x_scales its scales, so the reference is computed from the dequantized rows."""
    T, K = idx.shape
    y = torch.zeros(T, x.shape[1], dtype=torch.float64, device=x.device)
    zero = torch.zeros((), dtype=torch.float64, device=x.device)
    for a in range(0, T, chunk):
        b = min(T, a + chunk)
        xs = None if x_scales is None else x_scales[a:b]
        for k in range(K):
            e = idx[a:b, k]
            ok = e >= 0
            eo = expert_fn(x[a:b], scales[e.clamp_min(0)], xs).double()
            y[a:b] += torch.where(ok[:, None], w[a:b, k].double()[:, None] * eo, zero)
    return y


def rel_err(got, ref):
    g = got.double()
    return {"max_abs": (g - ref).abs().max().item() if g.numel() else 0.0,
            "rel_norm": ((g - ref).norm() / ref.norm()).item() if ref.norm() > 0 else float((g - ref).norm()),
            "finite": bool(torch.isfinite(g).all())}


def scales_rows(recv_scales, layout, L, R, S):
    """recv_scales as [L, R, S] whatever its layout: "row" is [L][R][S] already; "col_tma" is per
    local expert a column-major [S][R4] block, R4 = R rounded up to a multiple of 4 (DeepGEMM's
    TMA-aligned MN-major scales: element (le, g, row) at le * S * R4 + g * R4 + row)."""
    if layout == "row":
        return recv_scales.reshape(L, R, S)
    r4 = (R + 3) // 4 * 4
    return recv_scales.reshape(-1)[:L * S * r4].view(L, S, r4)[:, :, :R].transpose(1, 2)


# ---------------------------------------------------------------- bytes, capacities

def row_bytes(hidden, payload):
    """Bytes of one dispatched row: bf16 2 per element; FP8 1 per element plus an fp32 scale
    per 128 (the same for fp8 and fp8q: what crosses the link is e4m3 with its scales)."""
    return hidden * 2 if payload == "bf16" else hidden + hidden // FP8_GROUP * 4


def units(idx, rank, local_experts, world, mode):
    """(all, remote) rows this rank sends in dispatch (and gets back in combine). low_latency and
    the baselines: one row per (token, expert) pair with idx >= 0; throughput: one row per
    (token, destination rank). remote: the destination is another rank."""
    valid = idx >= 0
    dest = torch.where(valid, idx // local_experts, torch.full_like(idx, world))  # world: unused slot
    if mode == "throughput":
        hit = torch.zeros(idx.shape[0], world + 1, dtype=torch.bool, device=idx.device)
        hit.scatter_(1, dest, torch.ones_like(dest, dtype=torch.bool))
        hit = hit[:, :world]
        allr = int(hit.sum())
        return allr, allr - int(hit[:, rank].sum())
    return int(valid.sum()), int((valid & (dest != rank)).sum())


def bytes_moved(idx, rank, local_experts, world, hidden, payload="bf16", mode="low_latency"):
    """Payload bytes per rank, both ways of counting: "remote" (rows whose destination is
    another rank: what crosses the link) and "all" (every row, local ones included: DeepEP's
    tests count every selected (token, expert) that way). Dispatch rows are row_bytes(payload),
    combine rows bf16."""
    allr, remote = units(idx, rank, local_experts, world, mode)
    rb, cb = row_bytes(hidden, payload), hidden * 2
    out = {"rows_all": allr, "rows_remote": remote}
    for name, n in (("all", allr), ("remote", remote)):
        out[name] = {"dispatch": n * rb, "combine": n * cb, "dispatch+combine": n * (rb + cb)}
    return out


def model_bytes(tokens, topk, world, hidden, elem_bytes=2):
    """Expected remote dispatch bytes per rank under uniform routing: T*K*(W-1)/W*H*elem."""
    return tokens * topk * (world - 1) / world * hidden * elem_bytes


def recv_capacity(tokens, topk, experts, world, slack):
    """max_recv_per_expert sized by the load: slack x mean + 4 sd of Binomial(W*T, K/E), to 16."""
    n, p = world * tokens, topk / experts
    mean, sd = n * p, math.sqrt(n * p * (1 - p))
    cap = int(math.ceil((slack * mean + 4 * sd) / 16) * 16)
    return min(cap, world * tokens)


def capacity_for(counts_max, tokens, topk, experts, world, slack, routing_name):
    """Prefill's max_recv_per_expert: uniform routing by the load model (recv_capacity); skewed
    routing by the hottest expert's actual count over all ranks (counts_max) rounded up to 16,
    as a deployment sizes for the load it has seen: the model would overflow (the hottest
    expert gets ~25x the mean at s = 1). Never above W*T."""
    if routing_name == "uniform":
        return max(recv_capacity(tokens, topk, experts, world, slack), -(-int(counts_max) // 16) * 16)
    return min(world * tokens, max(16, -(-int(counts_max) // 16) * 16))


def expected_recv(all_idx, rank, local_experts, world):
    """What rank `rank` must receive under docs/moe.md's layout, from every rank's routing
    (all_idx [W,T,K]): (counts [L], local expert of each row, source row s*T+t of each row), rows
    ordered by local expert, then source rank, then token."""
    W, T, K = all_idx.shape
    L = local_experts
    e = all_idx.reshape(W, T * K)
    mine = (e >= 0) & (e // L == rank)
    s = torch.arange(W, device=e.device)[:, None].expand(W, T * K)
    t = (torch.arange(T * K, device=e.device) // K)[None, :].expand(W, T * K)
    le, s, t = (e - rank * L)[mine], s[mine], t[mine]
    key = (le * W + s) * T + t  # unique: a token reaches an expert at most once
    order = torch.argsort(key)
    counts = torch.bincount(le, minlength=L)
    return counts, le[order], (s * T + t)[order]


def stats(times):
    t = sorted(times)
    if not t:
        return None
    return {"p50": t[len(t) // 2], "p99": t[min(len(t) - 1, int(len(t) * 0.99))], "max": t[-1], "n": len(t)}


def med(v):
    v = sorted(v)
    return v[len(v) // 2]


# ---------------------------------------------------------------- feature detection of comm.moe

def moe_params(fn):
    """The keyword names comm.moe accepts; None when it takes **kwargs (then only a try says)."""
    try:
        ps = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind == p.VAR_KEYWORD for p in ps.values()):
        return None
    return set(ps)


def fp8q_kwargs(params, ue8m0=False):
    """comm.moe keywords for quantize-inside-dispatch (bf16 in, e4m3 + scales out), or None when
    this build has none. Two spellings are in discussion: input_dtype=torch.bfloat16 or
    quantize=True; scale_layout="row" when offered (the bench reads row-major scales), ue8m0
    when asked and offered. params None (**kwargs): the input_dtype spelling, to be tried."""
    kw = {"dtype": torch.float8_e4m3fn}
    if params is None or "input_dtype" in params:
        kw["input_dtype"] = torch.bfloat16
    elif "quantize" in params:
        kw["quantize"] = True
    else:
        return None
    if params is None or "scale_layout" in params:
        kw["scale_layout"] = "row"
    if ue8m0:
        if params is not None and "ue8m0" not in params:
            return None
        kw["ue8m0"] = True
    return kw


def mode_kwargs(params, mode):
    """comm.moe keywords for a mode: low_latency is today's call (no keyword); throughput needs
    mode= (None when this build has no such keyword)."""
    if mode == "low_latency":
        return {}
    if params is None or "mode" in params:
        return {"mode": mode}
    return None


# ---------------------------------------------------------------- throughput mode adapter

# Where a throughput-mode dispatch result keeps what the expert stand-in needs. The API is being
# written as this bench is (docs/moe.md will define it): this table and tp_expert_rows are the
# only places that read it. Assumed, as DeepEP's normal mode: one received row per (token,
# this rank) in a contiguous [N, H] buffer, each with its K slots' local expert ids (-1: the
# slot's expert is on another rank) and router weights, and a row count.
TP_FIELDS = {"x": "recv_x", "scales": "recv_scales", "local_idx": "recv_topk_idx",
             "weights": "recv_topk_weights", "count": "num_recv", "src": "recv_src"}


class TpUnsupported(Exception):
    """The installed symmalloc has no throughput mode, or its result lacks TP_FIELDS."""


def tp_fields(d):
    """The dispatch result's fields named in TP_FIELDS (attribute or key); TpUnsupported names
    the missing ones."""
    out, missing = {}, []
    for k, name in TP_FIELDS.items():
        v = d.get(name) if isinstance(d, dict) else getattr(d, name, None)
        if v is None and k not in ("scales", "src"):
            missing.append(name)
        out[k] = v
    if missing:
        raise TpUnsupported(f"throughput dispatch result has no {', '.join(missing)} (bench/moe_lib.py TP_FIELDS)")
    return out


def tp_expert_rows(d, scales, first_expert):
    """The expert stand-in of throughput mode: per received row n, out[n] =
    bf16(sum_k w[n,k] * expert_fn(x[n], s[first + le[n,k]])) over its slots with le >= 0, in
    fp32 in increasing k (the weights applied on the expert's side, DeepEP normal mode's
    convention, so that the combine sums one row per rank). Rows past the count are zeros.
    Returns (out bf16 [N, H], count)."""
    f = tp_fields(d)
    x, le, w = f["x"], f["local_idx"], f["weights"]
    n = int(f["count"].reshape(-1)[0]) if torch.is_tensor(f["count"]) else int(f["count"])
    N, H = x.shape[0], x.shape[-1]
    rs = None if f["scales"] is None else f["scales"].reshape(N, -1)
    acc = torch.zeros(N, H, dtype=torch.float32, device=x.device)
    for k in range(le.shape[1]):
        e = le[:, k].long()
        ok = (e >= 0) & (torch.arange(N, device=x.device) < n)
        eo = expert_fn(x.reshape(N, H), scales[first_expert + e.clamp_min(0)], rs).float()
        acc += torch.where(ok[:, None], w[:, k].float()[:, None] * eo, torch.zeros((), device=x.device))
    return acc.to(torch.bfloat16), n


def tp_reference_dispatch(all_x, all_idx, all_w, rank, local_experts):
    """What a throughput dispatch delivers to `rank` under TP_FIELDS' assumption, from every
    rank's inputs (all_x [W, T, H], all_idx [W, T, K], all_w [W, T, K]): rows ordered by source
    rank, then token, one per token with at least one slot on this rank. A dict with
    TP_FIELDS' names; src = s * T + t."""
    W, T, K = all_idx.shape
    L = local_experts
    mine = (all_idx >= 0) & (all_idx // L == rank)
    has = mine.any(-1).reshape(-1)
    src = torch.arange(W * T, device=all_idx.device)[has]
    le = torch.where(mine, all_idx - rank * L, torch.full_like(all_idx, -1)).reshape(W * T, K)[has]
    return {TP_FIELDS["x"]: all_x.reshape(W * T, -1)[has], TP_FIELDS["local_idx"]: le,
            TP_FIELDS["weights"]: all_w.reshape(W * T, K)[has], TP_FIELDS["count"]: int(has.sum()),
            TP_FIELDS["src"]: src, TP_FIELDS["scales"]: None}


# ---------------------------------------------------------------- the per-phase probe

def probe_phases(raw):
    """moe.probe()'s result as [(phase, us)]: accepted shapes are an ordered sequence of
    (name, ns) pairs or a dict name -> ns, the ns being timestamps (the first one the start, each
    later one the end of the phase it names), or a dict {"durations_us": {phase: us}}. None for
    anything else (then the raw value is printed)."""
    if isinstance(raw, dict) and all(isinstance(raw.get(k), dict) for k in ("dispatch", "combine")):
        # symmalloc's Moe.probe(): {"dispatch": {start, ..., epoch}, "combine": {...}}, ns
        # timestamps in phase order; "epoch" is a counter, and a word never written is 0.
        # Different blocks record different events, so they need not be in order: each event is
        # given as us after its call's start ("+" in the name).
        out = []
        for call in ("dispatch", "combine"):
            ev = [(k, v) for k, v in raw[call].items() if k != "epoch" and v]
            if not ev or ev[0][0] != "start":
                return None
            out += [(f"{call}.{k}+", (v - ev[0][1]) / 1000.0) for k, v in ev[1:]]
        return out
    if isinstance(raw, dict) and isinstance(raw.get("durations_us"), dict):
        return [(str(k), float(v)) for k, v in raw["durations_us"].items()]
    if isinstance(raw, dict):
        raw = list(raw.items())
    try:
        pairs = [(str(a), float(b)) for a, b in raw]
    except (TypeError, ValueError):
        return None
    if len(pairs) < 2 or any(b2 < b1 for (_, b1), (_, b2) in zip(pairs, pairs[1:])):
        return None
    return [(name, (t - pairs[i][1]) / 1000.0) for i, (name, t) in enumerate(pairs[1:])]


def gather(t, group, world, shared):
    """Every rank's t (the same shape on every rank) as a list on t's device; bf16 / e4m3 as bytes
    (gloo and NCCL both move bytes); with --shared-gpu (gloo) through host copies."""
    raw = t.contiguous()
    b = raw.view(torch.uint8) if raw.dtype in (torch.bfloat16, torch.float8_e4m3fn) else raw
    host = shared or b.device.type == "cpu"
    src = b.cpu() if host else b
    out = [torch.empty_like(src) for _ in range(world)]
    dist.all_gather(out, src, group=group)
    return [(o.to(t.device) if host else o).view(raw.dtype) for o in out]


def gather_json(obj, group, world, shared, device="cpu", nbytes=16384):
    """Every rank's JSON-able obj, as a list (no pickling, no numpy: bytes in a padded tensor)."""
    import json

    b = json.dumps(obj).encode()[:nbytes - 1]
    t = torch.zeros(nbytes, dtype=torch.uint8)
    t[:len(b)] = torch.tensor(list(b), dtype=torch.uint8)
    out = gather(t.to(device), group, world, shared)
    return [json.loads(bytes(o.cpu().tolist()).rstrip(b"\0").decode()) for o in out]


# ---------------------------------------------------------------- the NCCL all_to_all_single baseline

class A2ABaseline:
    """pplx's published baseline on torch.distributed.all_to_all_single: per-expert counts
    all-to-all, a host read of the splits, the token rows all-to-all (one row per (token, expert)
    pair, the local split included: NCCL copies it on the GPU), grouping by expert; combine the
    reverse all-to-all and the weighted sum. FP8: each row is packed with its scales into one
    byte row (H + H/128 * 4 bytes) for one all-to-all, unpacked on arrival.
    stage=True (gloo with CUDA tensors): every exchange goes through host copies, as bytes."""

    def __init__(self, group, world, rank, experts, stage=False):
        self.group, self.W, self.rank, self.E = group, world, rank, experts
        self.L = experts // world
        self.stage = stage

    def _a2a(self, out, inp, out_splits=None, in_splits=None):
        if self.stage or out.device.type == "cpu":  # gloo: exchange raw bytes (rows stay rows)
            o = out.cpu() if out.device.type != "cpu" else out
            i = inp.cpu() if inp.device.type != "cpu" else inp
            ob, ib = (o.view(torch.uint8), i.view(torch.uint8)) if o.dtype == torch.bfloat16 else (o, i)
            dist.all_to_all_single(ob, ib, out_splits, in_splits, group=self.group)
            if o is not out:
                out.copy_(o)
        else:
            dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)

    def dispatch(self, x, idx, x_scales=None):
        """(grouped rows, their scales or None, local expert per row, rows per local expert, handle)."""
        T, K = idx.shape
        H = x.shape[1]
        e = idx.reshape(-1)
        valid = e >= 0
        order = torch.argsort(torch.where(valid, e, self.E), stable=True)  # by expert, then token
        counts = torch.bincount(e[valid], minlength=self.E)  # [E] = [W][L]
        recv_counts = torch.empty_like(counts)
        self._a2a(recv_counts, counts)  # [W src][L]
        host = torch.cat([counts, recv_counts]).cpu()  # the host read of the splits
        send_splits = host[:self.E].view(self.W, self.L).sum(1).tolist()
        recv_cnt = host[self.E:].view(self.W, self.L)
        recv_splits = recv_cnt.sum(1).tolist()
        nsend, nrecv = sum(send_splits), sum(recv_splits)
        rows = x if x_scales is None else torch.cat([x.view(torch.uint8), x_scales.view(torch.uint8)], 1)
        send_x = rows.index_select(0, order[:nsend] // K)
        recv_x = torch.empty(nrecv, rows.shape[1], dtype=rows.dtype, device=x.device)
        self._a2a(recv_x, send_x, recv_splits, send_splits)
        le = torch.repeat_interleave(torch.arange(self.L, device=x.device).repeat(self.W),
                                     recv_cnt.reshape(-1).to(x.device), output_size=nrecv)
        perm = torch.argsort(le, stable=True)  # rows by local expert, then source, then token
        grouped = recv_x.index_select(0, perm)
        gs = None
        if x_scales is not None:
            gs = grouped[:, H:].contiguous().view(torch.float32)
            grouped = grouped[:, :H].contiguous().view(x.dtype)
        handle = (order, nsend, send_splits, recv_splits, perm, T, K)
        return grouped, gs, le.index_select(0, perm), recv_cnt.sum(0), handle

    def combine(self, expert_out, handle, w, idx):
        order, nsend, send_splits, recv_splits, perm, T, K = handle
        back = torch.empty_like(expert_out)
        back[perm] = expert_out
        ret = torch.empty(nsend, expert_out.shape[1], dtype=expert_out.dtype, device=expert_out.device)
        self._a2a(ret, back, send_splits, recv_splits)
        rows = torch.zeros(T * K, expert_out.shape[1], dtype=expert_out.dtype, device=expert_out.device)
        rows[order[:nsend]] = ret
        wm = torch.where(idx >= 0, w, torch.zeros((), dtype=w.dtype, device=w.device))
        return (rows.view(T, K, -1).float() * wm[..., None]).sum(1).to(torch.bfloat16)
