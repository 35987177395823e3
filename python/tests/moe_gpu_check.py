"""Expert parallelism (``comm.moe``: symmalloc/moe.py over symm_moe_*, docs/moe.md) on GPUs: the
device machine's check, not collected by pytest. N ranks, one process each, one per GPU or
several sharing the GPUs (SYMMALLOC_SHARED_GPU=1, set when N is above the GPU count or with
``--shared``)::

    python3 python/tests/moe_gpu_check.py --world 2 4 8 [--shared] [--reference gloo|nccl] [--quick]

Every rank's x, topk_idx and topk_weights are gathered (torch.distributed: gloo on CPU copies,
or NCCL with one rank per GPU) and the expected layout is built from them: recv_counts, each
row's recv_src code and payload bytes (and FP8 scales), rows of a local expert ordered by
source rank then token. The test's experts scale each received row by 2^-(e % 3) (FP8:
dequantized first); ``y`` is checked bit for bit against the contract's arithmetic (fp32
``fmaf`` over k in increasing order from 0, one bf16 rounding; computed exactly on the CPU,
``fmaf_t``) and against float64 within bf16 tolerance, and is bitwise the same over repeated
runs. Outputs are poisoned before each run (NaN rows, -1 counts and codes; expert rows past
the counts are NaN, so a combine that reads them shows).

Cases, bf16 and FP8: k = 1, 2, 8 x 1, 7, 128 and max_tokens_per_rank tokens (int32 and int64
indices); ragged token counts (0 on some ranks) with experts and ranks that receive nothing;
every token of every rank to one expert (exactly full); FP8 quantized inside the dispatch from
bf16 x (row-major and column-major TMA-aligned scales, with and without UE8M0: bytes and scales
against the kernels' arithmetic and float64, quant_case); a CUDA graph of dispatch -> experts ->
combine replayed with new routing, weights and payload copied into its static inputs before
each replay; repeated combines of one dispatch back to back with different experts and a
combine refused on one rank then retried, eagerly, and two combines of one dispatch in a CUDA
graph; errors (an expert out of range, a duplicate, a full expert, a rank's Python-side
refusal, a combine refused on one rank) raised on every rank naming the rank, the object
usable after; a split child as the EP group; the split halves (dispatch_send / dispatch_recv,
combine_send / combine_recv: equal to the one-call forms bit for bit with work between them and
the receive halves on a side stream, and in a CUDA graph; moe_split_gpu_cases.py) and the clock
probe; torch.compile(fullgraph=True) and mode="reduce-overhead" against eager, in both modes
(the throughput mode's custom ops: tp_compile_case). Prints a PASS / FAIL / SKIP line per case and world and
exits non-zero on any failure.

With SYMMALLOC_BACKEND=host the same script runs on CPU tensors (no graph cases);
python/tests/test_moe_host.py imports its reference and cases for the host-backend CI tests.
"""
import argparse
import os
import sys
import traceback
import zlib

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
import symmalloc  # noqa: E402
from error_text import error_of  # noqa: E402

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
HOST = os.environ.get("SYMMALLOC_BACKEND") == "host"


# The reference: exact fp32 fma, the test's experts, the expected layout ------------------------

def fmaf_t(a, b, c):
    """Elementwise fp32 ``fmaf(a, b, c)``: a * b + c rounded once to fp32 (nearest even), for
    float32 ``a`` and ``c`` and a ``b`` whose product with ``a`` is exact in float64 (a bf16
    value: 24 + 8 significant bits). The float64 sum ``s`` rounds to the same fp32 as the exact
    value unless ``s`` is exactly halfway between two fp32 values; there the sum's exact error
    (TwoSum) decides. Normal range only (no overflow, no subnormal results)."""
    p = a.double() * b.double()
    cd = c.double()
    s = p + cd
    bb = s - p
    err = (p - (s - bb)) + (cd - bb)
    f = s.float()
    fd = f.double()
    inf = torch.full_like(f, float("inf"))
    g = torch.nextafter(f, torch.where(s > fd, inf, -inf))
    gd = g.double()
    mid = (fd != s) & (err != 0) & ((s - fd) == (gd - s))
    return torch.where(mid & ((err > 0) == (gd > fd)), g, f)


def expert_fn(rows, scales, experts):
    """What the test's expert ``e`` does to a received row: the row (FP8: times its scale per
    128 elements, rounded to fp32) times 2^-(e % 3) (exact), rounded to bf16: the same bits on
    the CPU and the GPU, eager or compiled. ``rows`` [N, H] payload, ``scales`` [N, H / 128]
    float32 or None, ``experts`` [N] int64, on one device. No host-to-device copy (capturable)."""
    v = rows.float()
    if scales is not None:
        n, h = v.shape
        v = (v.view(n, h // 128, 128) * scales.view(n, h // 128, 1)).view(n, h)
    m = (experts % 3)[:, None]
    return (v * torch.where(m == 0, 1.0, torch.where(m == 1, 0.5, 0.25))).to(BF16)


def combine_reference(x, scales, idx, w, shift=0):
    """This rank's ``y`` by the contract, from its own inputs (CPU): ``(y_exact bf16, y64
    float64, bound)``: fmaf over k in increasing order from 0 then one bf16 rounding; the float64
    sum; and the tolerance of ``|y - y64|`` (half a bf16 step plus fp32 sums' error). ``shift``:
    the experts of ids shifted by it (2^-((e + shift) % 3): three different experts)."""
    n, k = idx.shape
    h = x.shape[1]
    idx = idx.long()
    e = idx.clamp_min(0).reshape(-1)
    rows = x.repeat_interleave(k, 0) if n else x.new_empty((0, h))
    sc = None if scales is None else scales.repeat_interleave(k, 0)
    eo = expert_fn(rows, sc, e + shift).float().view(n, k, h)
    acc = torch.zeros(n, h, dtype=torch.float32)
    y64 = torch.zeros(n, h, dtype=torch.float64)
    sabs = torch.zeros(n, h, dtype=torch.float64)
    for j in range(k):
        use = (idx[:, j] >= 0)[:, None]
        wj = w[:, j:j + 1].expand(n, h)
        acc = torch.where(use, fmaf_t(wj, eo[:, j], acc), acc)
        prod = wj.double() * eo[:, j].double()
        y64 += torch.where(use, prod, 0.0)
        sabs += torch.where(use, prod.abs(), 0.0)
    return acc.to(BF16), y64, 2.0 ** -8 * y64.abs() + 2.0 ** -20 * sabs + 1e-30


def expected_layout(all_idx, all_n, rank, L, R, T, K):
    """Where rank ``rank``'s dispatch must leave its rows, from every rank's routing
    (``all_idx`` [W, T, k] int64, rows at or past ``all_n[s]`` ignored): ``(counts [L], flat
    [N] (le * R + row), codes [N] (recv_src), src [N] (s * T + t, into the gathered x), le [N])``,
    rows of a local expert in (source rank, token) order."""
    W, Tp, k = all_idx.shape
    s = torch.arange(W).view(W, 1, 1).expand(W, Tp, k)
    t = torch.arange(Tp).view(1, Tp, 1).expand(W, Tp, k)
    j = torch.arange(k).view(1, 1, k).expand(W, Tp, k)
    first = rank * L
    mine = (t < all_n.view(W, 1, 1)) & (all_idx >= first) & (all_idx < first + L)
    le = (all_idx - first)[mine]  # row-major: (s, t, j) order
    order = torch.sort(le, stable=True).indices
    le = le[order]
    codes = ((s[mine] * T + t[mine]) * K + j[mine])[order]
    src = (s[mine] * Tp + t[mine])[order]
    counts = torch.bincount(le, minlength=L)
    start = torch.cumsum(counts, 0) - counts
    pos = torch.arange(le.numel()) - start[le]
    return counts, le * R + pos, codes, src, le


def make_inputs(seed, n, H, k, E, payload, routing="random", idx_dtype=torch.int32, one=0):
    """A rank's inputs (CPU): x [n, H] (bf16 normal values, or FP8 bytes without NaN codes with
    scales in [0.01, 1)), topk_idx [n, k] (distinct experts per token; ``random``: 15% of the
    slots -1; ``subset``: even experts of the lower half only; ``one``: slot 0 = ``one``, the
    others -1), topk_weights [n, k] float32 in [-1, 1)."""
    g = torch.Generator().manual_seed(seed)
    if payload == BF16:
        x, scales = torch.randn(n, H, generator=g).to(BF16), None
    else:
        b = torch.randint(0, 256, (n, H), generator=g, dtype=torch.uint8)
        x = torch.where((b & 0x7F) == 0x7F, b ^ 1, b).view(FP8)
        scales = torch.rand(n, H // 128, generator=g) * 0.99 + 0.01
    if routing == "one":
        idx = torch.full((n, k), -1, dtype=torch.int64)
        idx[:, 0] = one
    elif routing == "subset":
        pool = torch.arange(0, E // 2, 2)
        idx = pool[torch.rand(n, pool.numel(), generator=g).argsort(1)[:, :k]]
    else:
        idx = torch.rand(n, E, generator=g).argsort(1)[:, :k]
        idx[torch.rand(n, k, generator=g) < 0.15] = -1
    w = torch.rand(n, k, generator=g) * 2 - 1
    return x.contiguous(), scales, idx.to(idx_dtype).contiguous(), w


def seed_of(name, rank, step=0):
    return zlib.crc32(f"{name}/{rank}/{step}".encode()) & 0x7FFFFFFF


def bits(t):
    """Raw bits of a bf16 / fp8 tensor (for bitwise comparisons, NaN included)."""
    return t.view(torch.int16) if t.dtype == BF16 else t.view(torch.uint8) if t.dtype == FP8 else t


# Checks that record instead of raising (a rank that stopped mid-case would leave its peers
# waiting in the next collective) ----------------------------------------------------------------

class Check:
    def __init__(self):
        self.failures = []

    def __call__(self, cond, msg):
        if not cond and len(self.failures) < 5:
            self.failures.append(msg() if callable(msg) else msg)
        return bool(cond)

    def done(self, detail=""):
        if self.failures:
            raise CaseFailed("; ".join(self.failures))
        return detail


class CaseFailed(Exception):
    """The checks of a case failed; every rank made the case's calls (the sequence is intact)."""


class Ctx:
    """One rank's run: the communicator, the reference group, the device and the shapes."""

    def __init__(self, rank, world, comm, dev, backend, T=192, H=2048, E=64, K=8, group=None):
        self.rank, self.world, self.comm, self.dev, self.backend = rank, world, comm, dev, backend
        self.T, self.H, self.E, self.K = T, H, E, K
        self.group = group  # the torch.distributed group of comm's ranks (None: the world)
        self.cuda = dev.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.dev)

    def gather(self, t):
        """Every rank's CPU tensor ``t`` (same shape everywhere), stacked in group rank order."""
        import torch.distributed as dist

        W = self.world
        src = t.contiguous()
        if self.backend == "nccl":
            src = src.to(self.dev)
        out = [torch.empty_like(src) for _ in range(W)]
        dist.all_gather(out, src, group=self.group)
        return torch.stack(out).cpu()

    def gather_inputs(self, x, scales, idx, T):
        """Every rank's x (payload bytes), scales, idx and token count, padded to T tokens."""
        n, H = x.shape
        xb = torch.zeros(T, H * x.element_size(), dtype=torch.uint8)
        xb[:n] = x.contiguous().view(torch.uint8).view(n, H * x.element_size())
        ib = torch.full((T, idx.shape[1]), -1, dtype=torch.int64)
        ib[:n] = idx.long()
        all_n = self.gather(torch.tensor([n], dtype=torch.int64)).view(-1)
        all_x = self.gather(xb).view(self.world * T, -1).view(x.dtype)
        all_s = None
        if scales is not None:
            sb = torch.zeros(T, scales.shape[1], dtype=torch.float32)
            sb[:n] = scales
            all_s = self.gather(sb).view(self.world * T, -1)
        return all_x, all_s, self.gather(ib), all_n


def poison(t):
    if t is not None:  # a strided view (column-major scales) as same-size integers
        (t.view(torch.int32) if t.element_size() == 4 else t.view(torch.uint8)).fill_(-1 if t.element_size() == 4 else 0xFF)


def check_layout(ck, ctx, moe, d, lay, all_x, all_s, what):
    """recv_counts, recv_src, the payload rows and scales of a dispatch against the expected
    layout (on the dispatch's device)."""
    counts, flat, codes, src, _ = lay
    L, R, H = moe.local_experts, moe.max_recv, moe.hidden
    got = d.recv_counts.cpu().long()
    ck(torch.equal(got, counts), lambda: f"{what}: recv_counts {got.tolist()[:16]}, want {counts.tolist()[:16]}")
    flat_d = flat.to(ctx.dev)
    got_src = d.recv_src.reshape(-1).index_select(0, flat_d).cpu().long()
    ck(torch.equal(got_src, codes), lambda: f"{what}: recv_src differs at {int((got_src != codes).nonzero()[0])} of {codes.numel()} rows")
    rows = d.recv_x.reshape(L * R, H).index_select(0, flat_d)
    want = all_x.to(ctx.dev).index_select(0, src.to(ctx.dev))
    ck(torch.equal(bits(rows), bits(want)), f"{what}: recv_x rows differ from the sources' rows")
    if all_s is not None:
        srows = d.recv_scales.reshape(L * R, -1).index_select(0, flat_d)
        ck(torch.equal(srows, all_s.to(ctx.dev).index_select(0, src.to(ctx.dev))), f"{what}: recv_scales differ")


def expert_out(moe, d, lay, dev, shift=0):
    """The test's experts (ids shifted by ``shift``) on the counted rows (``lay``'s), every other
    row NaN."""
    L, R, H = moe.local_experts, moe.max_recv, moe.hidden
    _, flat, _, _, le = lay
    eo = torch.full((L * R, H), float("nan"), dtype=BF16, device=dev)
    flat_d = flat.to(dev)
    rows = d.recv_x.reshape(L * R, H).index_select(0, flat_d)
    sc = None if d.recv_scales is None else d.recv_scales.reshape(L * R, -1).index_select(0, flat_d)
    eo.index_copy_(0, flat_d, expert_fn(rows, sc, (moe.first_expert + le + shift).to(dev)))
    return eo.view(L, R, H)


def check_y(ck, y, ref, what):
    y_exact, y64, bound = ref
    yc = y.cpu()
    ck(tuple(yc.shape) == tuple(y_exact.shape) and yc.dtype == BF16, lambda: f"{what}: y is {yc.dtype} {tuple(yc.shape)}")
    if not ck(torch.equal(bits(yc), bits(y_exact)), lambda: f"{what}: y differs from fmaf k-ascending + one rounding in "
              f"{int((bits(yc) != bits(y_exact)).sum())} of {y_exact.numel()} elements"):
        return
    err = (yc.double() - y64).abs()
    ck(bool((err <= bound).all()), lambda: f"{what}: y off the float64 reference by {float((err - bound).max()):.3g} beyond bf16 tolerance")


# Cases: every rank makes the same calls whatever its checks found --------------------------------

def eager_case(ctx, moe, name, k, tokens, routing="random", idx_dtype=torch.int32, runs=3, one=0):
    """Dispatch, the test's experts, combine, ``runs`` times on the same inputs (combine's
    handle: none, the MoeDispatch with ``out=``, its handle), everything poisoned first."""
    ck = Check()
    n = tokens(ctx.rank) if callable(tokens) else tokens
    payload = BF16 if moe.dtype == "bfloat16" else FP8
    x, scales, idx, w = make_inputs(seed_of(name, ctx.rank), n, moe.hidden, k, moe.num_experts, payload, routing,
                                    idx_dtype, one)
    all_x, all_s, all_idx, all_n = ctx.gather_inputs(x, scales, idx, moe.max_tokens_per_rank)
    lay = expected_layout(all_idx, all_n, moe.rank, moe.local_experts, moe.max_recv, moe.max_tokens_per_rank, moe.topk)
    ref = combine_reference(x, scales, idx, w)
    xd, idd, wd = x.to(ctx.dev), idx.to(ctx.dev), w.to(ctx.dev)
    sd = None if scales is None else scales.to(ctx.dev)
    ys = []
    for run in range(runs):
        for t in moe._buffer_views(True):
            poison(t)
        d = moe.dispatch(xd, idd, wd, sd)
        ck(tuple(d.recv_x.shape) == (moe.local_experts, moe.max_recv, moe.hidden) and d.num_tokens == n
           and (d.recv_scales is None) == (payload == BF16), f"{name}: the MoeDispatch's shapes")
        if run == 0:
            ctx.sync()
            check_layout(ck, ctx, moe, d, lay, all_x, all_s, f"{name} run {run}")
        eo = expert_out(moe, d, lay, ctx.dev)
        if run == 0:
            y = moe.combine(eo)
        elif run == 1:
            out = torch.full((n, moe.hidden), float("nan"), dtype=BF16, device=ctx.dev)
            y = moe.combine(eo, d, out=out)
            ck(y is out, f"{name}: combine(out=) returned another tensor")
        else:
            y = moe.combine(eo, d.handle)
        ctx.sync()
        ys.append(y.cpu())
        check_y(ck, y, ref, f"{name} run {run}")
    ck(all(torch.equal(bits(y), bits(ys[0])) for y in ys), f"{name}: y differs between runs")
    return ck.done(f"{n} tokens here, {int(lay[0].sum())} rows received")


def eager_cases(ctx, moe, quick=False):
    """The eager cases of one object: (name, function) pairs."""
    tag = "bf16" if moe.dtype == "bfloat16" else "fp8"
    T = moe.max_tokens_per_rank
    token_counts = (1, 7, T) if quick else (1, 7, 128, T)
    out = []
    for k in (1, 2, 8):
        for n in token_counts:
            it = torch.int64 if n == 7 or (k == 2 and n == T) else torch.int32
            name = f"eager {tag} k={k} tokens={n} {str(it).replace('torch.', '')}"
            out.append((name, lambda name=name, k=k, n=n, it=it: eager_case(ctx, moe, name, k, n, idx_dtype=it)))
    ragged = (0, 7, 128 if T >= 128 else T, T, 1)
    name = f"eager {tag} k=2 ragged tokens (0 on some ranks), empty experts"
    out.append((name, lambda name=name: eager_case(ctx, moe, name, 2, lambda r: ragged[r % 5], routing="subset")))
    name = f"eager {tag} every token to one expert, max tokens (exactly full)"
    out.append((name, lambda name=name: eager_case(ctx, moe, name, 4, T, routing="one", one=moe.num_experts - 1,
                                                   idx_dtype=torch.int64)))
    return out


def graph_case(ctx, moe, name, k, n, replays=6):
    """dispatch -> experts -> combine captured once (n tokens), replayed with new routing,
    weights and payload copied into the static inputs before each replay; the first replay's
    inputs replayed twice (bitwise the same y)."""
    ck = Check()
    payload = BF16 if moe.dtype == "bfloat16" else FP8
    L, R, H = moe.local_experts, moe.max_recv, moe.hidden
    inputs = [make_inputs(seed_of(name, ctx.rank, i), n, H, k, moe.num_experts, payload) for i in range(replays)]
    x, scales, idx, w = (None if t is None else t.to(ctx.dev) for t in inputs[0])
    experts = (moe.first_expert + torch.arange(L, device=ctx.dev)).repeat_interleave(R)

    def layer():
        d = moe.dispatch(x, idx, w, scales)
        sc = None if d.recv_scales is None else d.recv_scales.reshape(L * R, -1)
        eo = expert_fn(d.recv_x.reshape(L * R, H), sc, experts).view(L, R, H)
        return d, moe.combine(eo, d)

    s = torch.cuda.Stream(ctx.dev)
    s.wait_stream(torch.cuda.current_stream(ctx.dev))
    with torch.cuda.stream(s):
        layer()  # warm-up, eager
    torch.cuda.current_stream(ctx.dev).wait_stream(s)
    ctx.sync()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        d, y = layer()
    first = None
    for i, (xi, si, ii, wi) in enumerate(inputs):
        x.copy_(xi)
        idx.copy_(ii)
        w.copy_(wi)
        if scales is not None:
            scales.copy_(si)
        all_x, all_s, all_idx, all_n = ctx.gather_inputs(xi, si, ii, moe.max_tokens_per_rank)
        lay = expected_layout(all_idx, all_n, moe.rank, L, R, moe.max_tokens_per_rank, moe.topk)
        for again in range(2 if i == 0 else 1):
            y.view(torch.uint8).fill_(0xFF)
            g.replay()
            ctx.sync()
            check_layout(ck, ctx, moe, d, lay, all_x, all_s, f"{name} replay {i}")
            check_y(ck, y, combine_reference(xi, si, ii, wi), f"{name} replay {i}")
            if i == 0:
                if again == 0:
                    first = y.cpu().clone()
                else:
                    ck(torch.equal(bits(y.cpu()), bits(first)), f"{name}: the same replay gave another y")
    del g
    return ck.done(f"{replays} replays with new routing")


def repeat_case(ctx, moe, rounds=6):
    """Repeated combines of one dispatch (docs/moe.md, "Repeated combines"): each round
    dispatches new routing, combines it 2 or 3 times back to back with different experts (no
    synchronization between; every y checked after), then a combine that rank ``i % W`` refuses
    (a float32 expert_out) raises on every rank naming it, and two more combines at once are
    exact."""
    ck = Check()
    W, r = ctx.world, ctx.rank
    payload = BF16 if moe.dtype == "bfloat16" else FP8
    L, R, H = moe.local_experts, moe.max_recv, moe.hidden
    for i in range(rounds):
        n = moe.max_tokens_per_rank if i % 2 else 7
        x, scales, idx, w = make_inputs(seed_of("repeat", r, i), n, H, 4, moe.num_experts, payload,
                                        idx_dtype=torch.int64 if i % 2 else torch.int32)
        all_x, all_s, all_idx, all_n = ctx.gather_inputs(x, scales, idx, moe.max_tokens_per_rank)
        lay = expected_layout(all_idx, all_n, moe.rank, L, R, moe.max_tokens_per_rank, moe.topk)
        sd = None if scales is None else scales.to(ctx.dev)
        d = moe.dispatch(x.to(ctx.dev), idx.to(ctx.dev), w.to(ctx.dev), sd)

        def combines(shifts, what):
            eos = [expert_out(moe, d, lay, ctx.dev, s) for s in shifts]  # first: the combines go back to back
            ys = [moe.combine(eo, d) for eo in eos]
            ctx.sync()
            for s, y in zip(shifts, ys):
                check_y(ck, y, combine_reference(x, scales, idx, w, s), f"round {i} {what} (expert shift {s})")
            if n:
                yb = [bits(y.cpu()) for y in ys]
                ck(not any(torch.equal(yb[a], yb[b]) for a in range(len(yb)) for b in range(a)),
                   f"round {i} {what}: two combines gave the same y; the check cannot tell them apart")

        combines([(i + j) % 3 for j in range(2 + i % 2)], "repeated combines")
        bad = i % W
        eo = expert_out(moe, d, lay, ctx.dev, i % 3)
        if r == bad:
            eo = eo.float()
        err = error_of(lambda: (moe.combine(eo, d), moe.check()))
        want = f"expert_out is float32 [{L}, {R}, {H}]" if r == bad else f"rank {bad} refused the combine"
        ck(err is not None and want in err, lambda: f"round {i}: rank {bad} refused the combine; rank {r} got {err!r}, "
           f"expected {want!r}")
        combines([(i + 1) % 3, (i + 2) % 3], f"retry after rank {bad} refused")
    return ck.done(f"{rounds} rounds of 2-3 combines, a refused one and 2 retries")


def graph_repeat_case(ctx, moe, n, replays=6):
    """One dispatch and two combines of it (experts shifted by 0 and 1) captured in one CUDA
    graph, replayed with new routing; both ys checked after every replay."""
    ck = Check()
    payload = BF16 if moe.dtype == "bfloat16" else FP8
    L, R, H, k = moe.local_experts, moe.max_recv, moe.hidden, 4
    inputs = [make_inputs(seed_of("graph repeat", ctx.rank, i), n, H, k, moe.num_experts, payload) for i in range(replays)]
    x, scales, idx, w = (None if t is None else t.to(ctx.dev) for t in inputs[0])
    experts = (moe.first_expert + torch.arange(L, device=ctx.dev)).repeat_interleave(R)

    def layer():
        d = moe.dispatch(x, idx, w, scales)
        sc = None if d.recv_scales is None else d.recv_scales.reshape(L * R, -1)
        rows = d.recv_x.reshape(L * R, H)
        eos = [expert_fn(rows, sc, experts + s).view(L, R, H) for s in (0, 1)]
        return [moe.combine(eo, d) for eo in eos]

    s = torch.cuda.Stream(ctx.dev)
    s.wait_stream(torch.cuda.current_stream(ctx.dev))
    with torch.cuda.stream(s):
        layer()  # warm-up, eager
    torch.cuda.current_stream(ctx.dev).wait_stream(s)
    ctx.sync()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ys = layer()
    for i, (xi, si, ii, wi) in enumerate(inputs):
        x.copy_(xi)
        idx.copy_(ii)
        w.copy_(wi)
        if scales is not None:
            scales.copy_(si)
        for y in ys:
            y.view(torch.uint8).fill_(0xFF)
        g.replay()
        ctx.sync()
        for sh, y in enumerate(ys):
            check_y(ck, y, combine_reference(xi, si, ii, wi, sh), f"replay {i} combine {sh}")
    del g
    return ck.done(f"{replays} replays of a dispatch and two combines")


def errors_case(ctx, moe):
    """Errors raised on every rank, naming the rank; after each, a good call is exact."""
    ck = Check()
    W, r, E, k, n = ctx.world, ctx.rank, moe.num_experts, 2, 9
    payload = BF16 if moe.dtype == "bfloat16" else FP8
    x, scales, idx, w = make_inputs(seed_of("errors", r), n, moe.hidden, k, E, payload)
    x, idx, w = x.to(ctx.dev), idx.to(ctx.dev), w.to(ctx.dev)
    scales = None if scales is None else scales.to(ctx.dev)
    good = [0]

    def good_call(what):
        good[0] += 1
        try:
            eager_case(ctx, moe, f"after {what}", 2, 7, runs=1)
        except CaseFailed as e:
            ck(False, f"the call after {what}: {e}")

    def expect(what, err, *parts):
        ck(err is not None, f"{what}: rank {r} raised nothing")
        if err is not None:
            ck(err.startswith("SYMM_ERR_INVALID_ARGUMENT"), lambda: f"{what}: {err}")
            for p in parts:
                ck(p in err, lambda p=p: f"{what}: {p!r} not in rank {r}'s error: {err}")

    def routed(t, j, v, on):
        bad = idx.clone()
        if r == on:
            bad[t, j] = v
        return bad

    bad = W - 1
    err = error_of(lambda: (moe.dispatch(x, routed(3, 1, E, bad), w, scales), moe.check()))
    expect("an expert out of range", err, f"rank {bad}", f"topk_idx[3][1] = {E}", "out of range")
    good_call("an expert out of range")
    dup = idx.clone()
    if r == 0:
        dup[4, 0], dup[4, 1] = 5, 5
    err = error_of(lambda: (moe.dispatch(x, dup, w, scales), moe.check()))
    expect("an expert twice", err, "rank 0", "topk_idx[4][1] = 5", "repeats an expert")
    good_call("an expert twice")
    wrong = torch.zeros(n, moe.hidden, dtype=torch.float32, device=ctx.dev)
    err = error_of(lambda: (moe.dispatch(wrong if r == 0 else x, idx, w, scales), moe.check()))
    expect("x float32 on rank 0", err, "rank 0", *(("x has dtype float32",) if r == 0 else ("refused",)))
    good_call("x float32 on rank 0")
    d = moe.dispatch(x, idx, w, scales)
    L, R, H = moe.local_experts, moe.max_recv, moe.hidden
    eo = torch.zeros(L, R, H, dtype=BF16, device=ctx.dev)
    bad_eo = torch.zeros(L, R, H + 16, dtype=BF16, device=ctx.dev)
    err = error_of(lambda: (moe.combine(bad_eo if r == bad else eo, d), moe.check()))
    expect(f"expert_out of another shape on rank {bad}", err, f"rank {bad}",
           *((f"expert_out is bfloat16 [{L}, {R}, {H + 16}]",) if r == bad else ("refused the combine",)))
    good_call("a refused combine")
    old = moe.dispatch(x, idx, w, scales)
    moe.dispatch(x, idx, w, scales)
    err = error_of(lambda: (moe.combine(eo, old if r == 0 else None), moe.check()))
    expect("a stale handle on rank 0", err, "rank 0", *(("the handle is of dispatch",) if r == 0 else ()))
    good_call("a stale handle")
    return ck.done(f"5 errors, each followed by {good[0]} exact calls in all")


def quant_reference(x, ue8m0):
    """FP8 quantized inside the dispatch (docs/moe.md), of bf16 rows x [N, H] on the CPU: (the
    kernels' e4m3 bytes [N, H] uint8, scales [N, H / 128] float32, float64's bytes): per 128
    elements s = max(amax / 448, FLT_MIN) in fp32 (UE8M0: 2^ceil(log2 s)), the kernels' q =
    e4m3(fp32(x * fp32(1 / s))) and float64's e4m3(x / s), both nearest even, saturated."""
    n, h = x.shape
    xf = x.float().view(n, h // 128, 128)
    s = torch.clamp(xf.abs().amax(-1) / 448.0, min=torch.finfo(torch.float32).tiny)
    if ue8m0:
        s = torch.exp2(torch.ceil(torch.log2(s.double()))).float()
    q = (xf * (1.0 / s)[..., None]).clamp(-448, 448).to(FP8).view(torch.uint8).view(n, h)
    q64 = (xf.double() / s.double()[..., None]).clamp(-448, 448).to(FP8).view(torch.uint8).view(n, h)
    return q, s, q64


def quant_case(ctx, comm, hidden, layout, ue8m0, runs=2):
    """bf16 x quantized inside the dispatch: recv_x bytes exactly the kernels' arithmetic (what
    the host backend computes) and within one e4m3 step of float64 (equal with UE8M0), the scales
    exactly, read through the ``scale_layout`` view (col_tma: DeepGEMM's strides), the same bits
    every run; ``y`` of the dequantized rows as in the FP8 cases."""
    ck = Check()
    T, K = ctx.T, ctx.K
    with comm.moe(max_tokens_per_rank=T, hidden=hidden, topk=K, num_experts=ctx.E, dtype=FP8, input_dtype=BF16,
                  scale_layout=layout, ue8m0=ue8m0) as moe:
        L, R, G = moe.local_experts, moe.max_recv, hidden // 128
        R4 = -(-R // 4) * 4
        want_st = (G * R4, 1, R4) if layout == "col_tma" else (R * G, G, 1)
        name = f"quant {layout} {ue8m0}"
        x, _, idx, w = make_inputs(seed_of(name, ctx.rank), T, hidden, K, moe.num_experts, BF16)
        x = x * torch.exp2(torch.randint(-20, 20, (T, G), generator=torch.Generator().manual_seed(seed_of(name, 9))
                                         ).repeat_interleave(128, 1).to(BF16))  # groups of different magnitudes
        all_x, _, all_idx, all_n = ctx.gather_inputs(x, None, idx, T)
        lay = expected_layout(all_idx, all_n, moe.rank, L, R, T, K)
        counts, flat, codes, src, _ = lay
        q, s, q64 = quant_reference(all_x, ue8m0)
        firsts = []
        for run in range(runs):
            for t in moe._buffer_views(True):
                poison(t)
            d = moe.dispatch(x.to(ctx.dev), idx.to(ctx.dev), w.to(ctx.dev))
            ck(d.recv_scales.stride() == want_st and d.recv_x.dtype == FP8, f"{name}: strides {d.recv_scales.stride()}")
            got_c = d.recv_counts.cpu().long()
            ck(torch.equal(got_c, counts), f"{name}: recv_counts {got_c.tolist()[:16]}")
            fl = flat.to(ctx.dev)
            ck(torch.equal(d.recv_src.reshape(-1).index_select(0, fl).cpu().long(), codes), f"{name}: recv_src")
            rows = d.recv_x.view(torch.uint8).reshape(L * R, hidden).index_select(0, fl).cpu()
            srows = d.recv_scales.reshape(L * R, G).index_select(0, fl).cpu()
            want_q, want_q64 = q.index_select(0, src), q64.index_select(0, src)
            ck(torch.equal(rows, want_q), lambda: f"{name}: {int((rows != want_q).sum())} bytes differ from the kernels' "
               "arithmetic")
            ck(torch.equal(srows.view(torch.int32), s.index_select(0, src).view(torch.int32)), f"{name}: scales differ")
            off = rows != want_q64
            step = ((rows.int() & 0x7F) - (want_q64.int() & 0x7F)).abs()
            ck(not ue8m0 or not bool(off.any()), f"{name}: UE8M0 bytes differ from float64")
            ck(bool((step[off] == 1).all()), f"{name}: bytes more than one e4m3 step from float64")
            firsts.append((rows, srows))
        ck(all(torch.equal(a[0], firsts[0][0]) and torch.equal(a[1], firsts[0][1]) for a in firsts), f"{name}: runs differ")
        return ck.done(f"{int(counts.sum())} rows")


def capacity_case(ctx, comm, hidden):
    """Capacity W rows per local expert (max_recv_per_expert): every rank sends 2 tokens to
    expert 0, and every rank raises naming expert 0, the 2W rows and the capacity; then one
    token per rank to expert 0 (exactly full) is exact, and so is a random routing of 1 token."""
    ck = Check()
    W = ctx.world
    with comm.moe(ctx.T, hidden, ctx.K, ctx.E, dtype=BF16, max_recv_per_expert=W) as small:
        ck(small.max_recv == W, f"max_recv {small.max_recv}; expected {W}")
        x, _, _, w = make_inputs(seed_of("capacity", ctx.rank), 2, hidden, 1, ctx.E, BF16)
        one = torch.zeros(2, 1, dtype=torch.int32)
        err = error_of(lambda: (small.dispatch(x.to(ctx.dev), one.to(ctx.dev), w.to(ctx.dev)), small.check()))
        ck(err is not None and "expert 0 (local expert 0 of rank 0)" in err and f"would receive {2 * W} rows" in err
           and f"max_recv_per_expert = {W}" in err, f"rank {ctx.rank}: {err}")
        try:
            eager_case(ctx, small, "capacity: one token to expert 0", 1, 1, routing="one", runs=1)
            eager_case(ctx, small, "capacity: one token", 1, 1, runs=1)
        except CaseFailed as e:
            ck(False, f"after the capacity error: {e}")
    return ck.done()


def split_case(ctx, comm, hidden, backend):
    """A split child (two halves, reversed keys) as the EP group: its layout follows the
    child's ranks; the reference gathers over the child's members (torch groups)."""
    import torch.distributed as dist

    W, r = ctx.world, ctx.rank
    color = r % 2 if W >= 4 else 0
    members = [[q for q in range(W) if (q % 2 if W >= 4 else 0) == c] for c in range(2 if W >= 4 else 1)]
    groups = [dist.new_group(m, backend=backend) for m in members]  # every rank makes every group
    child = comm.split(color, key=-r)
    try:
        mine = sorted(members[color], key=lambda q: -q)  # the child's rank order
        assert (child.rank, child.world_size) == (mine.index(r), len(mine)), (child.rank, child.world_size)
        # torch's group ranks are in ascending world rank: reverse the gathers to the child's order.
        sub = Ctx(child.rank, child.world_size, child, ctx.dev, ctx.backend, ctx.T, hidden, ctx.E, ctx.K,
                  group=groups[color])
        gather = sub.gather
        sub.gather = lambda t: gather(t).flip(0)
        with child.moe(ctx.T, hidden, ctx.K, ctx.E, dtype=BF16) as m:
            return eager_case(sub, m, f"split child {color}", 8, 7, runs=2) + f", child rank {child.rank} of {child.world_size}"
    finally:
        ctx.sync()
        child.close()


def compiled_checks(ck, layer, args, mode, refusal, tag=""):
    """What a compiled MoE layer must show after its steps: no graph break (Dynamo's counters),
    one graph (``explain``, which calls the layer once more, on every rank), a float32 ``x``
    (``args[0]``) refused while tracing with ``refusal`` in the message (the fake refuses what
    the method refuses; no rank calls the library), and under reduce-overhead no CUDA graph
    skipped."""
    import torch._dynamo

    counters = torch._dynamo.utils.counters
    breaks = sum(counters["graph_break"].values())
    ck(breaks == 0, f"{tag}{breaks} graph breaks: {dict(counters['graph_break'])}")
    explained = torch._dynamo.explain(layer)(*args)
    ck(explained.graph_count == 1 and explained.graph_break_count == 0,
       f"{tag}explain: {explained.graph_count} graphs, {explained.graph_break_count} breaks")
    try:
        torch.compile(layer, fullgraph=True, backend="aot_eager")(args[0].float(), *args[1:])
        err = None
    except Exception as e:  # noqa: BLE001 (Dynamo wraps it, the message kept)
        err = str(e)
    ck(err is not None and refusal in err, f"{tag}a float32 x under torch.compile: {err}")
    skips = {k: v for k, v in counters["inductor"].items() if "cudagraph_skips" in k}
    if mode == "reduce-overhead":
        ck(not any(skips.values()), f"{tag}CUDA graphs skipped: {skips}")


def compile_case(ctx, moe, mode, backend="inductor"):
    """dispatch -> experts -> combine compiled with fullgraph=True (``mode``; ``backend``:
    "aot_eager" traces the ops' fake implementations as inductor does, without generating
    code): 0 graph breaks, the same bits as eager over 4 steps of fresh routing and two token
    counts (the second compile has a symbolic one); combine without a handle (the traced
    dispatch's, a side effect Dynamo keeps); a float32 x refused while tracing, naming the rank."""
    import torch._dynamo

    ck = Check()
    L, R, H = moe.local_experts, moe.max_recv, moe.hidden
    experts = (moe.first_expert + torch.arange(L, device=ctx.dev)).repeat_interleave(R)

    def layer(x, idx, w):
        d = moe.dispatch(x, idx, w)
        eo = expert_fn(d.recv_x.reshape(L * R, H), None, experts).view(L, R, H)
        return moe.combine(eo)

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    f = torch.compile(layer, fullgraph=True, backend=backend, **({} if mode == "default" else {"mode": mode}))
    for step, n in enumerate((16, 7, 12, 16)):  # a second size: recompiled with a dynamic token count
        n = min(n, moe.max_tokens_per_rank)
        x, _, idx, w = make_inputs(seed_of(f"compile {mode}", ctx.rank, step), n, H, 2, moe.num_experts, BF16)
        x, idx, w = x.to(ctx.dev), idx.to(ctx.dev), w.to(ctx.dev)
        eager = layer(x, idx, w).clone()
        got = f(x, idx, w).clone()
        ctx.sync()
        check_y(ck, got, combine_reference(x.cpu(), None, idx.cpu(), w.cpu()), f"compiled ({mode}) step {step}")
        ck(torch.equal(bits(got), bits(eager)), f"compiled ({mode}) step {step}: y differs from eager")
    compiled_checks(ck, layer, (x, idx, w), mode, f"rank {moe.rank}: x has dtype float32; expected bfloat16")
    return ck.done("0 graph breaks" + (", 0 cudagraph skips" if mode == "reduce-overhead" else ""))


def tp_compile_case(ctx, comm, mode, backend="inductor"):
    """The throughput mode under torch.compile (custom ops symmalloc::moe_tp_dispatch /
    moe_tp_combine): dispatch -> the caller's per-row sum over this rank's experts -> combine,
    fullgraph=True, bf16 and FP8 payloads (the scales' view used by the compiled code): 0 graph
    breaks, one graph, eager's bits and the contract's over 4 steps of fresh routing and two
    token counts (the second compile has a symbolic one); a float32 x refused while tracing,
    naming the rank. Weights are multiples of 1/64 and FP8 scales powers of two, so every fp32
    step is exact: the bits cannot depend on how a compiler fuses or orders them (only the
    roundings to bf16 remain, which the contract fixes)."""
    import torch._dynamo

    ck = Check()
    T, H, K, E = 16, 256, 4, 8
    for dtype in (BF16, FP8):
        fp8 = dtype == FP8
        with comm.moe(T, H, K, E, dtype=dtype, mode="throughput") as m:
            fe, L = m.first_expert, m.local_experts

            def deq(x, s):
                return x.float() * s.repeat_interleave(128, dim=1) if fp8 else x.float()

            def experts(d):
                """Row i: sum over its slots on this rank, in increasing k, of w * (e + 1) / 8 * x."""
                ids, w = d.recv_topk_idx, d.recv_topk_weights
                xf = deq(d.recv_x, d.recv_scales)
                acc = torch.zeros_like(xf)
                for k in range(K):
                    sel = ids[:, k:k + 1]
                    acc = acc + torch.where(sel >= 0, w[:, k:k + 1] * (fe + sel + 1).float() / 8, 0.0) * xf
                return acc.to(BF16)

            def layer(x, idx, w, s):
                d = m.dispatch(x, idx, w, s)
                return m.combine(experts(d))

            def want(x, idx, w, s):
                """y[t]: over the ranks t went to, in increasing order, its row there (bf16)."""
                xf, y = deq(x, s), torch.zeros(x.shape[0], H)
                for t in range(x.shape[0]):
                    for dest in range(ctx.world):
                        on = [k for k in range(K) if idx[t, k] >= 0 and int(idx[t, k]) // L == dest]
                        if on:
                            row = sum(float(w[t, k]) * (int(idx[t, k]) + 1) / 8 * xf[t].double() for k in on)
                            y[t] += row.to(BF16).float()
                return y.to(BF16)

            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            f = torch.compile(layer, fullgraph=True, backend=backend, **({} if mode == "default" else {"mode": mode}))
            for step, n in enumerate((16, 7, 12, 16)):
                g = torch.Generator().manual_seed(seed_of(f"tp compile {mode} {dtype}", ctx.rank, step))
                xb = torch.randn(n, H, generator=g)
                if fp8:
                    amax = xb.view(n, H // 128, 128).abs().amax(-1).clamp_min(1e-4)
                    s = torch.exp2(torch.ceil(torch.log2(amax / 448)))
                    x = (xb / s.repeat_interleave(128, dim=1)).to(FP8)
                else:
                    s, x = None, xb.to(BF16)
                idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)]).to(torch.int32)
                if n:
                    idx[0, 1:] = -1  # unused slots
                w = torch.randint(1, 65, (n, K), generator=g).float() / 64
                ref = want(x, idx, w, s)
                dev = [None if v is None else v.to(ctx.dev) for v in (x, idx, w, s)]
                eager = layer(*dev).clone()
                got = f(*dev).clone()
                ctx.sync()
                tag = f"{str(dtype)[6:]} ({mode}) step {step}"
                ck(torch.equal(bits(got), bits(eager)), f"{tag}: compiled y differs from eager")
                ck(torch.equal(bits(eager.cpu()), bits(ref)), f"{tag}: y differs from the contract")
            compiled_checks(ck, layer, dev, mode, f"rank {ctx.rank}: x has dtype float32; expected {str(dtype)[6:]}",
                            f"{dtype}: ")
    return ck.done("bf16 and fp8, 0 graph breaks" + (", 0 cudagraph skips" if mode == "reduce-overhead" else ""))


# One rank; the driver -----------------------------------------------------------------------------

def run_cases(cases, results):
    """Runs (name, fn) cases in order, appending (name, ok, detail, seconds); False when one
    raised (this rank's sequence of calls is broken: its peers time out and say so)."""
    import time

    for name, fn in cases:
        t0 = time.monotonic()
        try:
            results.append((name, True, fn(), time.monotonic() - t0))
        except CaseFailed as e:
            results.append((name, False, str(e), time.monotonic() - t0))
        except Exception:
            results.append((name, False, traceback.format_exc(), time.monotonic() - t0))
            return False
    return True


def rank_main(rank, world, uid, init, q, args):
    import datetime

    import torch.distributed as dist

    results = []
    try:
        os.environ.setdefault("SYMMALLOC_TIMEOUT_S", "30")
        if HOST:
            dev = torch.device("cpu")
        else:
            gpus = torch.cuda.device_count()
            dev = torch.device("cuda", 0 if args.shared else rank % gpus)
            torch.cuda.set_device(dev)
        backend = "nccl" if args.reference == "nccl" and not HOST else "gloo"
        kw = {"device_id": dev} if backend == "nccl" else {}
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120), **kw)
        comm = symmalloc.Communicator(rank, world, uid, device=None if HOST else dev.index)
        T, H, E = (64, 1024, 32) if args.quick else (192, 2048, 64)
        E = -(-E // world) * world  # a multiple of the world
        ctx = Ctx(rank, world, comm, dev, backend, T=T, H=H, E=E, K=8)
        cases = []
        objs = []

        def with_moe(dtype, hidden):
            m = comm.moe(max_tokens_per_rank=T, hidden=hidden, topk=8, num_experts=ctx.E, dtype=dtype)
            objs.append(m)
            return m

        mb, mf = with_moe(BF16, H), with_moe(FP8, H)
        cases += eager_cases(ctx, mb, args.quick) + eager_cases(ctx, mf, args.quick)
        if not HOST:
            for m in (mb, mf):
                tag = "bf16" if m is mb else "fp8"
                cases.append((f"graph {tag} k=8 tokens=128, routing new each replay",
                              lambda m=m, tag=tag: graph_case(ctx, m, f"graph {tag}", 8, min(128, T))))
                cases.append((f"graph {tag} k=2 tokens=1", lambda m=m, tag=tag: graph_case(ctx, m, f"graph1 {tag}", 2, 1)))
                cases.append((f"graph {tag} two combines of one dispatch, tokens=128",
                               lambda m=m: graph_repeat_case(ctx, m, min(128, T))))
        cases.append(("repeated combines bf16, a refused one retried", lambda: repeat_case(ctx, mb)))
        cases.append(("repeated combines fp8, a refused one retried", lambda: repeat_case(ctx, mf)))
        cases.append(("errors bf16", lambda: errors_case(ctx, mb)))
        cases.append(("errors fp8", lambda: errors_case(ctx, mf)))
        for layout, ue in (("row", False), ("col_tma", False), ("row", True), ("col_tma", True)):
            cases.append((f"fp8 quantized in the dispatch, {layout} scales, ue8m0={ue}",
                          lambda layout=layout, ue=ue: quant_case(ctx, comm, H, layout, ue)))
        cases.append(("capacity error", lambda: capacity_case(ctx, comm, H)))
        cases.append(("split child as the EP group", lambda: split_case(ctx, comm, H, backend)))
        from moe_split_gpu_cases import cases as split_halves  # the split halves, the clock probe

        cases += split_halves(ctx, comm, mb, mf, H, HOST)
        if not args.quick:
            def deepseek(dtype):
                try:
                    m = comm.moe(max_tokens_per_rank=128, hidden=7168, topk=8, num_experts=256, dtype=dtype)
                except symmalloc.SymmallocError as e:
                    if e.status == "SYMM_ERR_OUT_OF_MEMORY":
                        return f"SKIP: {e}"
                    raise
                with m:
                    return eager_case(ctx, m, f"deepseek {dtype}", 8, 128, runs=2)
            cases.append(("eager bf16 H=7168 E=256 k=8 tokens=128", lambda: deepseek(BF16)))
            cases.append(("eager fp8 H=7168 E=256 k=8 tokens=128", lambda: deepseek(FP8)))
        if args.compile:
            cases.append(("torch.compile fullgraph", lambda: compile_case(ctx, mb, "default")))
            if not HOST:
                cases.append(("torch.compile fullgraph reduce-overhead", lambda: compile_case(ctx, mb, "reduce-overhead")))
            cases.append(("torch.compile fullgraph, throughput mode", lambda: tp_compile_case(ctx, comm, "default")))
            if not HOST:
                cases.append(("torch.compile fullgraph reduce-overhead, throughput mode",
                              lambda: tp_compile_case(ctx, comm, "reduce-overhead")))
        cases = [(n, f) for n, f in cases if args.only in n]
        if run_cases(cases, results):  # the sequence intact: shut down cleanly
            for m in objs:
                m.close()
            comm.barrier()
            ctx.sync()
            comm.close()
            dist.destroy_process_group()
    except Exception:
        results.append(("setup", False, traceback.format_exc(), 0.0))
    q.put((rank, results))


def run_world(world, args):
    import socket

    import torch.multiprocessing as mp

    args = argparse.Namespace(**vars(args))  # this world's settings
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    uid = symmalloc.get_unique_id()
    if not HOST and (args.shared or world > torch.cuda.device_count()):
        os.environ["SYMMALLOC_SHARED_GPU"] = "1"
        if args.reference == "nccl":
            print(f"world={world}: ranks share a GPU, so the reference gathers over gloo (NCCL wants one rank per GPU)",
                  flush=True)
            args.reference = "gloo"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init = f"tcp://127.0.0.1:{port}"
    procs = [ctx.Process(target=rank_main, args=(r, world, uid, init, q, args)) for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in procs:
            rank, results = q.get(timeout=args.timeout)
            got[rank] = results
    except Exception as e:  # noqa: BLE001
        print(f"FAIL world={world}: no report from ranks {sorted(set(range(world)) - set(got))} ({type(e).__name__})", flush=True)
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    return report(world, got)


def report(world, got):
    """Prints a PASS / FAIL / SKIP line per case from every rank's results ({rank: [(name, ok,
    detail, seconds)]}); True when every rank passed every case."""
    names = []
    for results in got.values():
        for name, *_ in results:
            if name not in names:
                names.append(name)
    failed = len(got) < world
    for name in names:
        per = {r: next((v for v in res if v[0] == name), None) for r, res in got.items()}
        bad = [(r, v) for r, v in sorted(per.items()) if v is None or not v[1]]
        if bad:
            failed = True
            r, v = bad[0]
            why = "no result (an earlier case broke this rank's sequence)" if v is None else v[2].strip()
            print(f"FAIL world={world} {name}: rank {r}: {why}", flush=True)
        else:
            detail = str(per[0][2] or "") if per.get(0) else ""
            secs = max(v[3] for v in per.values())
            word = "SKIP" if detail.startswith("SKIP") else "PASS"
            print(f"{word} world={world} {name}" + (f" ({detail})" if detail else "") + f" [{secs:.1f} s]", flush=True)
    return not failed


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, nargs="*", default=[2])
    ap.add_argument("--shared", action="store_true", help="every rank on GPU 0 (SYMMALLOC_SHARED_GPU=1)")
    ap.add_argument("--reference", choices=("gloo", "nccl"), default="gloo",
                    help="the reference's gathers: gloo (CPU copies; any placement) or nccl (one rank per GPU)")
    ap.add_argument("--quick", action="store_true", help="smaller shapes, fewer cases")
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="leave out the torch.compile cases")
    ap.add_argument("--timeout", type=float, default=540.0, help="seconds to wait for a world's ranks")
    ap.add_argument("--only", default="", help="run only the cases whose name contains this text")
    args = ap.parse_args()
    if not HOST and not torch.cuda.is_available():
        print("FAIL: no CUDA device (set SYMMALLOC_BACKEND=host for CPU tensors over the host backend)", flush=True)
        sys.exit(2)
    ok = True
    for w in args.world:
        ok = run_world(w, args) and ok
    print("moe_gpu_check: " + ("PASS" if ok else "FAIL"), flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
