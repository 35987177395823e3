"""Expert parallelism: symmalloc's MoE dispatch/combine (comm.moe, docs/moe.md) against its peers,
measured in the same run:

    python3 bench/moe.py [--ranks 2] [--shapes decode1,decode128,prefill4096] [--runs 3] [--json OUT]
    python3 bench/moe.py --shared-gpu --ranks 2 --quick      # N ranks on GPU 0: a filter only
    python3 bench/moe.py --ranks 1 --shapes decode1,decode128 --impls symmalloc --no-link
                                                             # world 1: the kernels' own latency
    python3 bench/moe.py --selftest                          # CPU, gloo, 2 processes: no GPU

One process per rank (started here), one GPU per rank, or with --shared-gpu every rank on GPU 0
(SYMMALLOC_SHARED_GPU=1; the baseline's group is then gloo, NCCL refusing two ranks on one GPU;
timing is then only a filter and the targets read n/a). Each run is a fresh set of processes
(--runs); the tables give the median over runs of each row's p50 / p99 / max and the worst run.

Shapes (bf16, hidden 7168, top-8 of 256 experts, E/W experts per rank): decode 1 and 128 tokens
per rank (max_recv_per_expert left at its default W*T), prefill 4096 tokens per rank with
max_recv_per_expert sized by the expected load (W*T*K/E rows per expert) times --slack plus
four standard deviations (the create call is refused if it does not fit: the reason is printed).
Routing: each token picks top-k distinct experts uniformly at random (a fixed seed per rank and
run), weights a softmax of random logits; the same routing in the check and the timed calls.

Peers:
  symmalloc  comm.moe(...): dispatch, combine, dispatch+combine, each captured in a CUDA graph of
             --calls calls and replayed (per-call time = replay / calls), and eager.
  nccl       torch.distributed.all_to_all_single, as pplx's published baseline: per-expert counts
             all-to-all, a host read of the splits, the token rows all-to-all (one row per
             (token, expert) pair), grouping by expert; combine the reverse all-to-all and the
             weighted sum. The host read makes it uncapturable: eager only (said in the table).
  torch      torch.ops.symm_mem.all_to_all_vdev_2d / all_to_all_vdev_2d_offset (NVSHMEM backend),
             graph where capture works; where it refuses the shape (its kernel takes at most 16
             experts per rank) the 1-D all_to_all_vdev moves the same rows (no grouping by
             expert: a data-movement peer only). Runs in its own fresh processes after the main
             job (an NVSHMEM failure must not take the other rows with it); reasons printed.
  DeepEP / pplx_kernels / flashinfer: imported if present (reported), never installed.

Correctness before timing, on every rank: the output and the expert buffer's unused rows
poisoned (NaN), then y checked against a float64 reference (expert e's output is
bf16(x * s[e]) with s a fixed random bf16 [E, H]: exactly reproducible anywhere), max abs error
and norm-relative error printed; symmalloc's received rows are also checked bit for bit against
the layout docs/moe.md promises (rows of a local expert ordered by source rank, then token).

Table columns: bytes/rank = payload this rank sends over the link ((token, expert) pairs whose
expert is on another rank x row bytes); GB/s = bytes / p50; link share = GB/s over the
GPU-to-GPU copy bandwidth measured in the same run (--link: 256 MiB copies between GPU 0 and 1,
both directions at once, per-direction figure; n/a with --shared-gpu); buffer = symmalloc's
buffer_bytes, the baseline's peak extra torch allocation over one dispatch+combine, torch's
symmetric buffers.

Multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1; SYMMALLOC_ENABLE_MULTICAST never set).
"""
import argparse
import json
import math
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
for _k, _v in NO_MULTICAST.items():
    os.environ[_k] = _v  # before torch loads NCCL / NVSHMEM, in this process and every child
os.environ.pop("SYMMALLOC_ENABLE_MULTICAST", None)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

SHAPES = {"decode1": 1, "decode128": 128, "prefill4096": 4096}
PREFILL_MIN_TOKENS = 1024  # shapes with this many tokens per rank size max_recv by the load
GIB = 1 << 30


# ---------------------------------------------------------------- pure functions (CPU-testable)

def routing(tokens, topk, experts, seed, device="cpu"):
    """top-k distinct experts per token, uniform; softmax weights. (idx int64 [T,K], w fp32 [T,K])."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.rand(tokens, experts, generator=g).topk(topk, dim=1).indices
    w = torch.softmax(torch.randn(tokens, topk, generator=g), dim=1)
    return idx.to(device), w.to(device)


def tokens_x(tokens, hidden, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, hidden, generator=g).to(torch.bfloat16).to(device)


def expert_scales(experts, hidden, seed=4242, device="cpu"):
    """Expert e's 'weights': out = bf16(x * s[e]) elementwise; the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return (0.5 + torch.rand(experts, hidden, generator=g)).to(torch.bfloat16).to(device)


def expert_fn(rows, scales):
    """bf16 x bf16 in fp32 is exact; one rounding to bf16: bitwise the same on CPU and GPU."""
    return (rows.float() * scales.float()).to(torch.bfloat16)


def reference_y(x, idx, w, scales, chunk=256):
    """float64: y[t] = sum_k w[t,k] * expert_fn(x[t], s[idx[t,k]]) over idx >= 0."""
    T, K = idx.shape
    y = torch.zeros(T, x.shape[1], dtype=torch.float64, device=x.device)
    for a in range(0, T, chunk):
        b = min(T, a + chunk)
        for k in range(K):
            e = idx[a:b, k]
            ok = e >= 0
            eo = expert_fn(x[a:b], scales[e.clamp_min(0)]).double()
            y[a:b] += torch.where(ok[:, None], w[a:b, k].double()[:, None] * eo, torch.zeros((), dtype=torch.float64,
                                                                                             device=x.device))
    return y


def remote_pairs(idx, rank, local_experts):
    """(token, expert) pairs whose expert lives on another rank."""
    return int(((idx >= 0) & (idx // local_experts != rank)).sum())


def bytes_moved(pairs, hidden, elem_bytes=2, fp8_scales=False):
    """Payload bytes one rank sends over the link: dispatch (rows + fp32 scales per 128 for FP8)
    and combine (bf16 rows back)."""
    d = pairs * (hidden * elem_bytes + (hidden // 128 * 4 if fp8_scales else 0))
    return {"dispatch": d, "combine": pairs * hidden * 2, "dispatch+combine": d + pairs * hidden * 2}


def model_bytes(tokens, topk, world, hidden, elem_bytes=2):
    """Expected dispatch bytes per rank under uniform routing: T*K*(W-1)/W*H*elem."""
    return tokens * topk * (world - 1) / world * hidden * elem_bytes


def recv_capacity(tokens, topk, experts, world, slack):
    """max_recv_per_expert sized by the load: slack x mean + 4 sd of Binomial(W*T, K/E), to 16."""
    n, p = world * tokens, topk / experts
    mean, sd = n * p, math.sqrt(n * p * (1 - p))
    cap = int(math.ceil((slack * mean + 4 * sd) / 16) * 16)
    return min(cap, world * tokens)


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


# ---------------------------------------------------------------- the NCCL all_to_all_single baseline

class A2ABaseline:
    """pplx's published baseline on torch.distributed.all_to_all_single (see module docstring).
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

    def dispatch(self, x, idx):
        T, K = idx.shape
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
        send_x = x.index_select(0, order[:nsend] // K)
        recv_x = torch.empty(nrecv, x.shape[1], dtype=x.dtype, device=x.device)
        self._a2a(recv_x, send_x, recv_splits, send_splits)
        le = torch.repeat_interleave(torch.arange(self.L, device=x.device).repeat(self.W),
                                     recv_cnt.reshape(-1).to(x.device), output_size=nrecv)
        perm = torch.argsort(le, stable=True)  # rows by local expert, then source, then token
        grouped = recv_x.index_select(0, perm)
        handle = (order, nsend, send_splits, recv_splits, perm, T, K)
        return grouped, le.index_select(0, perm), recv_cnt.sum(0), handle

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


# ---------------------------------------------------------------- torch symmetric memory (NVSHMEM)

class TorchVdev:
    """torch.ops.symm_mem.all_to_all_vdev_2d (+ _2d_offset for combine) where it takes the shape,
    else all_to_all_vdev (1-D, no grouping by expert). Buffers are symmetric (NVSHMEM)."""

    def __init__(self, group_name, world, rank, experts, tokens, topk, hidden, device):
        import torch.distributed._symmetric_memory as symm_mem

        self.sm, self.gn = symm_mem, group_name
        self.W, self.rank, self.E, self.L, self.T, self.K, self.H = world, rank, experts, experts // world, tokens, topk, hidden
        # vdev_2d pads every local expert's block to at least one row (major_align): + L rows.
        rows_in, rows_out = tokens * topk, world * tokens * topk + experts // world
        e = lambda shape, dt=torch.bfloat16: symm_mem.empty(shape, dtype=dt, device=device)  # noqa: E731
        self.inp, self.out = e((rows_in, hidden)), e((rows_out, hidden))
        self.eo, self.back = e((rows_out, hidden)), e((rows_in, hidden))
        self.bytes = sum(t.numel() * t.element_size() for t in (self.inp, self.out, self.eo, self.back))
        self.mode = "2d"
        self.in_splits, self.out_so = e(experts, torch.int64), e((2, experts), torch.int64)
        self.back_so = e((2, experts), torch.int64)
        self.in1, self.out1 = e(world, torch.int64), e((2, world), torch.int64)
        self.cin1, self.cout1 = e(world, torch.int64), e((2, world), torch.int64)
        for t in (self.inp, self.out, self.eo, self.back, self.in_splits, self.out_so, self.back_so,
                  self.in1, self.out1, self.cin1, self.cout1):
            symm_mem.rendezvous(t, group_name)

    def dispatch(self, x, idx):
        e = idx.reshape(-1)
        order = torch.argsort(e, stable=True)  # every slot routed in this benchmark
        torch.index_select(x, 0, order // self.K, out=self.inp)
        # scatter_add, not bincount: CUDA bincount reads its max on the host (no capture).
        counts = torch.zeros(self.E, dtype=torch.int64, device=e.device).scatter_add_(0, e, torch.ones_like(e))
        if self.mode == "2d":
            self.in_splits.copy_(counts)
            torch.ops.symm_mem.all_to_all_vdev_2d(self.inp, self.out, self.in_splits, self.out_so, self.gn)
        else:
            self.in1.copy_(counts.view(self.W, self.L).sum(1))
            torch.ops.symm_mem.all_to_all_vdev(self.inp, self.out, self.in1, self.out1, self.gn)
        return order

    def combine(self, order, w):
        if self.mode == "2d":
            torch.ops.symm_mem.all_to_all_vdev_2d_offset(self.eo, self.back, self.out_so, self.back_so, self.gn)
        else:
            self.cin1.copy_(self.out1[0])
            torch.ops.symm_mem.all_to_all_vdev(self.eo, self.back, self.cin1, self.cout1, self.gn)
        rows = torch.empty_like(self.back).index_copy_(0, order, self.back)
        return (rows.view(self.T, self.K, -1).float() * w[..., None]).sum(1).to(torch.bfloat16)


# ---------------------------------------------------------------- timing

def graph_time(fn, calls, replays, gate_cycles, barrier):
    """fn captured `calls` times in one graph, warm, replayed `replays` times behind a gate (a GPU
    spin that holds the stream until every replay is enqueued, as bench/tail.py): per-call times."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    barrier()
    torch.cuda.synchronize()
    cur = torch.cuda.current_stream()
    if gate_cycles:
        torch.cuda._sleep(gate_cycles)
        g.replay()
    for a, b in ev:
        a.record(cur)
        g.replay()
        b.record(cur)
    torch.cuda.synchronize()
    del g
    return [a.elapsed_time(b) * 1000.0 / calls for a, b in ev]


def eager_time(fn, iters, barrier):
    """Each call between events, the ranks started together by a barrier every 10 calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for i in range(iters):
        if i % 10 == 0:
            torch.cuda.synchronize()
            barrier()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1000.0)
    return out


def link_bandwidth(nbytes=256 << 20, reps=10):
    """GPU 0 <-> GPU 1 copies (torch's peer copy: cudaMemcpyPeerAsync where peer access is on):
    one direction alone, then both at once; GB/s per direction (median)."""
    n = nbytes // 2
    a0 = torch.randn(n, device="cuda:0").to(torch.bfloat16)
    b0 = torch.empty(n, dtype=torch.bfloat16, device="cuda:0")
    a1 = torch.randn(n, device="cuda:1").to(torch.bfloat16)
    b1 = torch.empty(n, dtype=torch.bfloat16, device="cuda:1")
    s0, s1 = torch.cuda.Stream(device=0), torch.cuda.Stream(device=1)
    peer = torch.cuda.can_device_access_peer(0, 1)

    def once(both):
        e = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        with torch.cuda.stream(s0):
            e[0].record(s0)
            b1.copy_(a0, non_blocking=True)  # runs on the source's (GPU 0's) current stream
            e[1].record(s0)
        if both:
            with torch.cuda.stream(s1):
                e[2].record(s1)
                b0.copy_(a1, non_blocking=True)
                e[3].record(s1)
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        t = e[0].elapsed_time(e[1])
        if both:
            t = max(t, e[2].elapsed_time(e[3]))
        return nbytes / (t * 1e-3) / 1e9

    for _ in range(3):
        once(False), once(True)
    uni = sorted(once(False) for _ in range(reps))[reps // 2]
    bi = sorted(once(True) for _ in range(reps))[reps // 2]
    assert torch.equal(b1.cpu(), a0.cpu()) and torch.equal(b0.cpu(), a1.cpu()), "peer copy wrong"
    del a0, b0, a1, b1
    torch.cuda.empty_cache()
    return {"unidirectional_GBps": uni, "bidirectional_per_direction_GBps": bi, "peer_access": peer, "bytes": nbytes}


# ---------------------------------------------------------------- one rank

def make_moe(comm, T, H, K, E, max_recv, num_sms=0):
    """comm.moe (python/symmalloc/moe.py); max_recv 0 = the default W*T; num_sms 0 = every SM."""
    return comm.moe(max_tokens_per_rank=T, hidden=H, topk=K, num_experts=E, dtype=torch.bfloat16,
                    max_recv_per_expert=max_recv or None, num_sms=num_sms)


def rel_err(got, ref):
    g = got.double()
    return {"max_abs": (g - ref).abs().max().item(), "rel_norm": ((g - ref).norm() / ref.norm()).item(),
            "finite": bool(torch.isfinite(g).all())}


def rank_main(rank, world, port, args, job, out_path):
    q = []
    try:
        shared = args.shared_gpu
        dev = 0 if shared else rank
        torch.cuda.set_device(dev)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if shared:
            os.environ["SYMMALLOC_SHARED_GPU"] = "1"
            dist.init_process_group("gloo", rank=rank, world_size=world)
        else:
            dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", dev))
        group = dist.group.WORLD
        barrier = dist.barrier
        info = {"rank": rank, "world": world, "device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                "shared_gpu": shared, "job": job, "rows": [], "checks": [], "notes": []}
        try:
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001
            info["nccl"] = "?"
        note = lambda s: (info["notes"].append(s), rank == 0 and print(f"  [{job}] {s}", flush=True))  # noqa: E731

        if job == "main" and rank == 0 and world >= 2 and not shared and args.link:
            info["link"] = link_bandwidth()
            print(f"  link GPU0<->GPU1: {info['link']}", flush=True)
        barrier()

        comm = None
        tv_mod = None
        if job == "main" and "symmalloc" in args.impls:
            try:
                import symmalloc

                comm = symmalloc.Communicator.from_process_group(group)
                if not hasattr(comm, "moe"):
                    note("symmalloc: Communicator has no moe() in this build: symmalloc rows skipped")
                    comm.close()
                    comm = None
            except Exception as e:  # noqa: BLE001
                note(f"symmalloc: communicator failed: {type(e).__name__}: {e}")
                comm = None
        if job == "torch":
            import torch.distributed._symmetric_memory as symm_mem

            try:
                if not symm_mem.is_nvshmem_available():
                    raise RuntimeError("torch.distributed._symmetric_memory.is_nvshmem_available() is False")
                symm_mem.set_backend("NVSHMEM")
                symm_mem.enable_symm_mem_for_group(group.group_name)
                tv_mod = symm_mem
            except Exception as e:  # noqa: BLE001
                note(f"torch all_to_all_vdev: NVSHMEM backend not usable: {type(e).__name__}: {e}")

        H, K, E = args.hidden, args.topk, args.experts
        L = E // world
        scales = expert_scales(E, H, device="cuda")
        for shape in args.shapes:
            T = SHAPES[shape]
            seed = args.seed * 7919 + rank * 104729 + T
            x = tokens_x(T, H, seed, device="cuda")
            idx, w = routing(T, K, E, seed + 1, device="cuda")
            pairs = remote_pairs(idx, rank, L)
            moved = bytes_moved(pairs, H)
            ref = reference_y(x, idx, w, scales)
            calls = args.calls if T < PREFILL_MIN_TOKENS else max(1, args.calls // 5)
            replays = args.replays if T < PREFILL_MIN_TOKENS else max(10, args.replays // 3)
            base = {"shape": shape, "tokens": T, "pairs_remote": pairs, "model_bytes": model_bytes(T, K, world, H)}

            def row(impl, op, mode, times, buf=None, **extra):
                r = dict(base, impl=impl, op=op, mode=mode, bytes=moved[op], buffer_bytes=buf, **extra)
                r.update(stats(times) or {})
                r["times"] = times
                info["rows"].append(r)
                if rank == 0 and times:
                    print(f"  {shape:<12} {impl:<10} {op:<17} {mode:<6} p50 {r['p50']:9.2f}  p99 {r['p99']:9.2f}  "
                          f"max {r['max']:9.2f} us", flush=True)

            def check(impl, y):
                c = dict(rel_err(y, ref), shape=shape, impl=impl, rank=rank)
                info["checks"].append(c)
                ok = c["finite"] and c["rel_norm"] < 1e-2
                if rank == 0 or not ok:
                    print(f"  {shape:<12} {impl:<10} check rank {rank}: max abs err {c['max_abs']:.3g}, rel "
                          f"{c['rel_norm']:.3g}, all written {c['finite']} -> {'ok' if ok else 'FAILED'}", flush=True)
                if not ok:
                    raise AssertionError(f"{impl} {shape}: wrong result on rank {rank}: {c}")

            # --- symmalloc
            if comm is not None:
                R = recv_capacity(T, K, E, world, args.slack) if T >= PREFILL_MIN_TOKENS else 0
                moe = None
                try:
                    moe = make_moe(comm, T, H, K, E, R, args.num_sms)
                except Exception as e:  # noqa: BLE001
                    need = L * (R or world * T) * H * 2 + 2 * T * K * H * 2  # recv_x, two cbufs
                    note(f"symmalloc {shape}: create refused (max_recv_per_expert {R or world * T}, recv_x + cbuf "
                         f"alone {need / 2**20:.0f} MiB; SYMMALLOC_COMM_ARENA_SIZE sizes the communicator's arena): "
                         f"{type(e).__name__}: {e}")
                if moe is not None:
                    bb = int(moe.buffer_bytes)
                    if rank == 0:
                        print(f"  {shape:<12} symmalloc  buffer_bytes {bb} ({bb / 2**20:.1f} MiB), max_recv_per_expert "
                              f"{R or world * T}", flush=True)
                    try:
                        sym_rows(moe, rank, world, T, H, K, E, L, x, idx, w, scales, ref, check, row, bb, calls,
                                 replays, args, barrier, group)
                    except AssertionError:
                        raise
                    except Exception as e:  # noqa: BLE001
                        note(f"symmalloc {shape}: {type(e).__name__}: {e}")
                        traceback.print_exc()
                    torch.cuda.synchronize()
                    moe.close()  # collective, at the same point on every rank
                    barrier()

            # --- NCCL baseline
            if job == "main" and "nccl" in args.impls:
                bl = A2ABaseline(group, world, rank, E, stage=shared)
                grouped, gle, _, h = bl.dispatch(x, idx)
                eo = expert_fn(grouped, scales[rank * L + gle])
                y = bl.combine(eo, h, w, idx)
                torch.cuda.synchronize()
                check("nccl", y)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                m0 = torch.cuda.memory_allocated()
                g2, gle2, _, h2 = bl.dispatch(x, idx)
                bl.combine(eo, h2, w, idx)
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() - m0
                del g2, gle2, h2
                iters = args.eager_iters if T < PREFILL_MIN_TOKENS else max(10, args.eager_iters // 3)
                row("nccl", "dispatch", "eager", eager_time(lambda: bl.dispatch(x, idx), iters, barrier), peak)
                row("nccl", "combine", "eager", eager_time(lambda: bl.combine(eo, h, w, idx), iters, barrier), peak)
                row("nccl", "dispatch+combine", "eager",
                    eager_time(lambda: bl.combine(eo, bl.dispatch(x, idx)[3], w, idx), iters, barrier), peak)
                del bl, grouped, gle, h, eo, y
                torch.cuda.empty_cache()

            # --- torch symmetric memory
            if tv_mod is not None:
                try:
                    torch_rows(tv_mod, group, rank, world, T, H, K, E, L, x, idx, w, scales, ref, check, row, calls,
                               replays, args, barrier, note, shape)
                except AssertionError:
                    raise
                except Exception as e:  # noqa: BLE001
                    note(f"torch vdev {shape}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                torch.cuda.synchronize()
                barrier()
            del x, idx, w, ref
            torch.cuda.empty_cache()

        if comm is not None:
            comm.barrier()
            torch.cuda.synchronize()
            comm.close()
        barrier()
        dist.destroy_process_group()
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(info, f)
    except Exception:
        traceback.print_exc()
        sys.exit(1)


def sym_rows(moe, rank, world, T, H, K, E, L, x, idx, w, scales, ref, check, row, bb, calls, replays, args,
             barrier, group):
    # Correctness: the expert buffer poisoned, then the layout checked bit for bit.
    out = moe.dispatch(x, idx, w)
    recv_x, _, recv_counts, handle = out
    torch.cuda.synchronize()
    R = recv_x.numel() // (L * H)
    recv_x.fill_(float("nan"))  # poison the landing rows: the next dispatch must write every row it counts
    torch.cuda.synchronize()
    barrier()
    recv_x, _, recv_counts, handle = moe.dispatch(x, idx, w)
    torch.cuda.synchronize()
    all_idx = [torch.empty_like(idx) for _ in range(world)]
    all_x = [torch.empty_like(x) for _ in range(world)]
    if args.shared_gpu:  # gloo: CPU copies
        ai, ax = [t.cpu() for t in all_idx], [t.cpu() for t in all_x]
        dist.all_gather(ai, idx.cpu(), group=group)
        dist.all_gather([t.view(torch.uint8) for t in ax], x.cpu().view(torch.uint8), group=group)
        all_idx, all_x = [t.cuda() for t in ai], [t.cuda() for t in ax]
    else:
        dist.all_gather(all_idx, idx, group=group)
        dist.all_gather(all_x, x, group=group)
    counts, le, src = expected_recv(torch.stack(all_idx), rank, L, world)
    got_counts = recv_counts.to(torch.int64).cpu()
    assert torch.equal(got_counts, counts.cpu()), f"symmalloc recv_counts {got_counts.tolist()[:8]}... want {counts.tolist()[:8]}..."
    start = torch.cumsum(counts, 0) - counts
    j = torch.arange(le.numel(), device=le.device) - start[le]
    recv_x = recv_x.view(L, R, H)
    got_rows = recv_x.reshape(L * R, H).index_select(0, le * R + j)
    want_rows = torch.cat(all_x).index_select(0, src)
    assert torch.equal(got_rows.view(torch.int16), want_rows.view(torch.int16)), "symmalloc recv_x rows differ from the layout"
    del all_x, got_rows, want_rows
    # Expert outputs: rows past each expert's count poisoned (combine must not read them).
    valid = torch.arange(R, device="cuda")[None, :] < recv_counts.to(torch.int64)[:, None]
    eo = expert_fn(recv_x, scales[rank * L: (rank + 1) * L][:, None, :])
    eo_poisoned = torch.where(valid[..., None], eo, torch.full((), float("nan"), dtype=eo.dtype, device="cuda"))
    eo = torch.where(valid[..., None], eo, torch.zeros((), dtype=eo.dtype, device="cuda"))  # finite, for timing
    y = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device="cuda")
    got = moe.combine(eo_poisoned, handle, out=y)
    torch.cuda.synchronize()
    check("symmalloc", got if got is not None else y)
    del eo_poisoned, valid
    # Timing (finite expert outputs; one static y).
    h = {"handle": handle}

    def disp():
        h["handle"] = moe.dispatch(x, idx, w)[3]

    def comb():
        moe.combine(eo, h["handle"], out=y)

    def both():
        moe.combine(eo, moe.dispatch(x, idx, w)[3], out=y)

    for op, fn in (("dispatch", disp), ("combine", comb), ("dispatch+combine", both)):
        try:
            row("symmalloc", op, "graph", graph_time(fn, calls, replays, args.gate, barrier), bb, calls=calls)
        except Exception as e:  # noqa: BLE001
            torch.cuda.synchronize()
            row("symmalloc", op, "graph", [], bb, error=f"{type(e).__name__}: {e}"[:200])
            print(f"  symmalloc {op} graph: {type(e).__name__}: {e}", flush=True)
        disp()
        row("symmalloc", op, "eager", eager_time(fn, args.eager_iters, barrier), bb)
    del eo, y


def torch_rows(symm_mem, group, rank, world, T, H, K, E, L, x, idx, w, scales, ref, check, row, calls, replays,
               args, barrier, note, shape):
    tv = TorchVdev(group.group_name, world, rank, E, T, K, H, torch.device("cuda", torch.cuda.current_device()))
    try:
        order = tv.dispatch(x, idx)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        note(f"torch all_to_all_vdev_2d {shape}: refused ({str(e).splitlines()[0][:160]}); 1-D all_to_all_vdev "
             "instead (moves the same rows; no grouping by expert)")
        torch.cuda.synchronize()
        barrier()
        tv.mode = "1d"
        order = tv.dispatch(x, idx)
        torch.cuda.synchronize()
    impl = "torch_2d" if tv.mode == "2d" else "torch_1d"
    tv.eo.fill_(float("nan"))
    if tv.mode == "2d":
        so = tv.out_so.cpu()  # [splits; offsets] of chunk c = le * W + src (blocks may be padded)
        rows = torch.cat([torch.arange(int(so[1][c]), int(so[1][c] + so[0][c])) for c in range(E)]).cuda()
        le = torch.repeat_interleave(torch.arange(E) // world, so[0]).cuda()
        tv.eo[rows] = expert_fn(tv.out[rows], scales[rank * L + le])
        y = tv.combine(order, w)
        torch.cuda.synchronize()
        check(impl, y)
    else:  # identity experts: the round trip must return every row to its token
        n = int(tv.out1[0].sum())
        tv.eo[:n] = tv.out[:n]
        y = tv.combine(order, w)
        torch.cuda.synchronize()
        want = (x.double()[:, None, :] * w.double()[..., None]).sum(1)
        c = rel_err(y, want)
        if not (c["finite"] and c["rel_norm"] < 1e-2):
            raise AssertionError(f"{impl} {shape}: round trip wrong on rank {rank}: {c}")
        if rank == 0:
            print(f"  {shape:<12} {impl:<10} round trip (identity experts) rel {c['rel_norm']:.3g}: ok", flush=True)
        tv.eo[:n] = expert_fn(tv.out[:n], scales[rank * L])  # finite data for timing
    st = {"order": order}

    def disp():
        st["order"] = tv.dispatch(x, idx)

    def comb():
        tv.combine(st["order"], w)

    def both():
        tv.combine(tv.dispatch(x, idx), w)

    for op, fn in (("dispatch", disp), ("combine", comb), ("dispatch+combine", both)):
        try:
            row(impl, op, "graph", graph_time(fn, calls, replays, args.gate, barrier), tv.bytes, calls=calls)
        except Exception as e:  # noqa: BLE001
            torch.cuda.synchronize()
            note(f"{impl} {op} graph capture failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
        row(impl, op, "eager", eager_time(fn, args.eager_iters, barrier), tv.bytes)


# ---------------------------------------------------------------- driver, tables, summary

def other_libraries():
    found = {}
    for name in ("deep_ep", "pplx_kernels", "flashinfer"):
        try:
            m = __import__(name)
            found[name] = getattr(m, "__version__", "present")
        except Exception as e:  # noqa: BLE001
            found[name] = None if isinstance(e, ImportError) else f"import failed: {type(e).__name__}"
    return found


def run_job(world, port, args, job, path):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, world, port, args, job, path)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.time() + args.job_timeout
    for p in procs:
        p.join(max(1, deadline - time.time()))
    rc = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    return rc


def aggregate(runs):
    """(shape, impl, op, mode) -> per-run rows."""
    rows = {}
    for r in runs:
        for row in r["rows"]:
            if row.get("p50") is not None:
                rows.setdefault((row["shape"], row["impl"], row["op"], row["mode"]), []).append(row)
    return rows


def med(v):
    v = sorted(v)
    return v[len(v) // 2]


def report(runs, link, args, world):
    rows = aggregate(runs)
    d = runs[0]
    shared = args.shared_gpu
    lbw = (link or {}).get("bidirectional_per_direction_GBps")
    print(f"\nMoE dispatch/combine, bf16, hidden {args.hidden}, top-{args.topk} of {args.experts} experts, "
          f"{world} ranks on {'ONE GPU (shared: timing is a filter only)' if shared else f'{world}x ' + d['device']}, "
          f"torch {d['torch']}, NCCL {d['nccl']}; {len(runs)} run(s); us per call, rank 0; median over runs "
          f"(worst run's p50)")
    if link:
        print(f"link: GPU0->GPU1 copy {link['unidirectional_GBps']:.1f} GB/s alone, {lbw:.1f} GB/s per direction "
              f"both at once (peer access {link['peer_access']}); link share uses the latter")
    else:
        print("link: n/a (" + ("shared GPU" if shared else "one rank per GPU needed, W >= 2, --link") + ")")
    summary = {}
    for shape in args.shapes:
        keys = [k for k in rows if k[0] == shape]
        if not keys:
            continue
        T = SHAPES[shape]
        r0 = rows[keys[0]][0]
        print(f"\n{shape}: {T} tokens per rank; remote (token, expert) pairs on rank 0: {r0['pairs_remote']} "
              f"(model T*K*(W-1)/W = {T * args.topk * (world - 1) / world:.0f})")
        print("| impl | op | mode | p50 µs | p99 µs | max µs | worst p50 | bytes/rank | GB/s @p50 | link share | buffer |")
        print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        order = {"symmalloc": 0, "nccl": 1, "torch_2d": 2, "torch_1d": 3}
        for k in sorted(keys, key=lambda k: (order.get(k[1], 9), ["dispatch", "combine", "dispatch+combine"].index(k[2]),
                                            k[3] != "graph")):
            per = rows[k]
            p50, p99, mx = med([r["p50"] for r in per]), med([r["p99"] for r in per]), med([r["max"] for r in per])
            worst = max(r["p50"] for r in per)
            b = per[0]["bytes"]
            gbps = b / (p50 * 1e-6) / 1e9 if p50 else 0
            share = f"{gbps / lbw:.2f}" if lbw and not shared else "n/a"
            buf = per[0].get("buffer_bytes")
            bufs = f"{buf / 2**20:.0f} MiB" if buf else "-"
            mode = k[3] + (" (host sync: not capturable)" if k[1] == "nccl" else "")
            if k[1] == "torch_1d":
                mode += " (no expert grouping)"
            print(f"| {k[1]} | {k[2]} | {mode} | {p50:.1f} | {p99:.1f} | {mx:.1f} | {worst:.1f} | {b / 2**20:.2f} MiB | "
                  f"{gbps:.1f} | {share} | {bufs} |")
            summary[k] = {"p50": p50, "p99": p99, "max": mx, "gbps": gbps, "share": gbps / lbw if lbw else None,
                          "buffer": buf}
    notes = sorted({n for r in runs for n in r.get("notes", [])})
    if notes:
        print("\nnotes:")
        for n in notes:
            print(f"  - {n}")
    others = other_libraries()
    print("other MoE libraries importable here: " + ", ".join(f"{k} {'(' + str(v) + ')' if v else 'absent'}"
                                                              for k, v in others.items())
          + " (reported only; not benchmarked by this script)")
    return targets(summary, args, world, lbw, shared), summary, others


# World-1 latency targets (one GPU, every expert local, graphed p50 in us): what the kernels
# themselves cost, with no peer to wait for.
WORLD1_TARGETS = {("decode1", "dispatch"): 5.0, ("decode1", "combine"): 5.0,
                  ("decode128", "dispatch"): 12.0, ("decode128", "combine"): 10.0}


def targets(s, args, world, lbw, shared):
    print("\nTargets (EP8, 128 tokens)")
    out = {}
    # 0. world 1: the kernels' latency, graphed p50 (p99 printed beside it).
    for (shape, op), limit in WORLD1_TARGETS.items():
        if shape not in args.shapes:
            continue
        r = s.get((shape, "symmalloc", op, "graph"))
        if world != 1:
            verdict, text = "n/a (target is at 1 rank)", ""
        elif not r:
            verdict, text = "n/a", "missing row"
        else:
            text = f"p50 {r['p50']:.2f} us, p99 {r['p99']:.2f} us"
            verdict = "MET" if r["p50"] <= limit else "MISSED"
        out[f"world1_{shape}_{op}"] = verdict
        print(f"  world 1 {shape} {op} graphed p50 <= {limit:g} us: {text} -> {verdict}")
    # 1. decode dispatch+combine vs the NCCL baseline, >= 3x at 2 ranks.
    for shape in [x for x in args.shapes if SHAPES[x] < PREFILL_MIN_TOKENS]:
        sg = s.get((shape, "symmalloc", "dispatch+combine", "graph"))
        se = s.get((shape, "symmalloc", "dispatch+combine", "eager"))
        nb = s.get((shape, "nccl", "dispatch+combine", "eager"))
        if not (sg and nb):
            verdict, text = "n/a", "missing rows"
        else:
            ratio = nb["p50"] / sg["p50"]
            text = (f"NCCL eager {nb['p50']:.1f} us / symmalloc graph {sg['p50']:.1f} us = {ratio:.2f}x"
                    + (f" (symmalloc eager {se['p50']:.1f} us: {nb['p50'] / se['p50']:.2f}x)" if se else ""))
            verdict = "n/a (shared GPU)" if shared else ("n/a (target is at 2 ranks)" if world != 2 else
                                                          ("MET" if ratio >= 3 else "MISSED"))
        out[f"decode_speedup_{shape}"] = verdict
        print(f"  decode {shape} dispatch+combine >= 3x the NCCL baseline: {text} -> {verdict}")
    # 2. prefill: fraction of the measured link bandwidth, >= 0.8 (dispatch and combine each).
    for shape in [x for x in args.shapes if SHAPES[x] >= PREFILL_MIN_TOKENS]:
        parts = []
        ok = True
        for op in ("dispatch", "combine"):
            r = s.get((shape, "symmalloc", op, "graph"))
            if r and lbw:
                parts.append(f"{op} {r['gbps']:.0f} GB/s = {r['gbps'] / lbw:.2f}")
                ok = ok and r["gbps"] / lbw >= 0.8
            else:
                parts.append(f"{op} n/a")
                ok = None
        verdict = "n/a (shared GPU)" if shared else ("n/a" if ok is None else ("MET" if ok else "MISSED"))
        out[f"prefill_link_share_{shape}"] = verdict
        print(f"  prefill {shape} >= 0.8 of the link ({lbw and f'{lbw:.0f} GB/s' or 'not measured'}): "
              f"{', '.join(parts)} -> {verdict}")
    # 3. buffers <= 1 GiB per rank at 128 tokens x 7168 x top-8.
    r = s.get(("decode128", "symmalloc", "dispatch+combine", "graph")) or s.get(
        ("decode128", "symmalloc", "dispatch+combine", "eager"))
    if r and r["buffer"]:
        verdict = "MET" if r["buffer"] <= GIB else "MISSED"
        text = f"buffer_bytes {r['buffer'] / 2**20:.1f} MiB"
    else:
        verdict, text = "n/a", "decode128 not run with symmalloc"
    out["buffer_decode128"] = verdict
    print(f"  buffers <= 1 GiB per rank at 128 tokens x {args.hidden} x top-{args.topk}: {text} -> {verdict}")
    return out


# ---------------------------------------------------------------- self-test (CPU, gloo, 2 processes)

def selftest_rank(rank, world, port, q):
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        group = dist.group.WORLD
        done = []
        for T, H, K, E, hole in ((5, 256, 4, 16, False), (64, 512, 8, 32, False), (1, 128, 8, 16, False),
                                 (7, 256, 3, 8, True)):
            L = E // world
            seed = 11 + 1000 * rank + T
            x = tokens_x(T, H, seed)
            idx, w = routing(T, K, E, seed + 1)
            assert all(len(set(r)) == K for r in idx.tolist()), "routing: experts not distinct"
            if hole:  # some unused slots (-1)
                idx[::2, -1] = -1
            scales = expert_scales(E, H)
            ref = reference_y(x, idx, w, scales)
            bl = A2ABaseline(group, world, rank, E)
            grouped, gle, cnt, h = bl.dispatch(x, idx)
            # The baseline's grouping is docs/moe.md's layout: by local expert, source, token.
            all_idx = [torch.empty_like(idx) for _ in range(world)]
            all_x = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(all_idx, idx)
            dist.all_gather([t.view(torch.uint8) for t in all_x], x.view(torch.uint8))
            counts, le, src = expected_recv(torch.stack(all_idx), rank, L, world)
            assert torch.equal(cnt, counts), f"counts {cnt.tolist()} vs {counts.tolist()}"
            assert torch.equal(gle, le), "local expert per row"
            assert torch.equal(grouped.view(torch.int16), torch.cat(all_x)[src].view(torch.int16)), "grouped rows"
            eo = expert_fn(grouped, scales[rank * L + gle])
            y = bl.combine(eo, h, w, idx)
            c = rel_err(y, ref)
            assert c["finite"] and c["rel_norm"] < 4e-3, f"baseline vs float64: {c}"
            # the reference itself against a direct loop for a few tokens
            for t in range(min(T, 3)):
                acc = torch.zeros(H, dtype=torch.float64)
                for k in range(K):
                    e = int(idx[t, k])
                    if e >= 0:
                        acc += float(w[t, k]) * (x[t].double() * scales[e].double()).to(torch.bfloat16).double()
                assert (acc - ref[t]).abs().max() < 1e-6 * acc.abs().max() + 1e-3, "reference vs loop"
            pairs = remote_pairs(idx, rank, L)
            want_pairs = sum(1 for r in idx.tolist() for e in r if e >= 0 and e // L != rank)
            assert pairs == want_pairs
            mv = bytes_moved(pairs, H)
            assert mv["dispatch"] == pairs * H * 2 and mv["dispatch+combine"] == 2 * pairs * H * 2
            done.append((T, H, K, E, hole, c["max_abs"], c["rel_norm"], pairs))
        # Arithmetic of the model and the capacity.
        assert model_bytes(128, 8, 8, 7168) == 128 * 8 * 7 / 8 * 7168 * 2
        assert bytes_moved(10, 7168, 1, True)["dispatch"] == 10 * (7168 + 56 * 4)
        cap = recv_capacity(4096, 8, 256, 2, 1.5)
        assert cap % 16 == 0 and 256 * 1.5 < cap <= 2 * 4096
        # Uniform routing's remote fraction is near (W-1)/W.
        idx, _ = routing(4096, 8, 256, 5 + rank)
        frac = remote_pairs(idx, rank, 128) / (4096 * 8)
        assert abs(frac - 0.5) < 0.02, frac
        dist.barrier()
        dist.destroy_process_group()
        q.put((rank, done, None))
    except Exception:  # noqa: BLE001
        q.put((rank, None, traceback.format_exc()))


def selftest():
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
        for T, H, K, E, hole, mx, rel, pairs in done:
            print(f"selftest rank {rank}: T={T} H={H} K={K} E={E}{' (-1 slots)' if hole else ''}: baseline layout == "
                  f"docs/moe.md order, y vs float64 max abs {mx:.3g} rel {rel:.3g}, remote pairs {pairs}")
    print(f"recv_capacity(4096, 8, 256, W=2, slack 1.5) = {recv_capacity(4096, 8, 256, 2, 1.5)} rows per expert; "
          f"model bytes EP8 128 tokens = {model_bytes(128, 8, 8, 7168) / 2**20:.2f} MiB per rank")
    print("selftest ok")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2, help="ranks (default 2); one GPU each unless --shared-gpu")
    ap.add_argument("--shared-gpu", action="store_true", help="every rank on GPU 0 (SYMMALLOC_SHARED_GPU=1): a filter")
    ap.add_argument("--shapes", default="decode1,decode128,prefill4096", help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--slack", type=float, default=1.5, help="prefill max_recv_per_expert = slack x mean + 4 sd")
    ap.add_argument("--impls", default="symmalloc,nccl,torch", help="comma list of symmalloc, nccl, torch")
    ap.add_argument("--runs", type=int, default=3, help="fresh sets of processes (default 3)")
    ap.add_argument("--calls", type=int, default=10, help="calls per captured graph (prefill: a fifth)")
    ap.add_argument("--replays", type=int, default=300, help="timed graph replays (prefill: a third)")
    ap.add_argument("--eager-iters", type=int, default=200)
    ap.add_argument("--gate", type=int, default=int(os.environ.get("SYMM_BENCH_GATE", 40_000_000)),
                    help="GPU spin cycles holding the stream while replays are enqueued (0: off)")
    ap.add_argument("--no-link", dest="link", action="store_false", help="skip the GPU0<->GPU1 copy bandwidth")
    ap.add_argument("--quick", action="store_true", help="1 run, 50 replays, 30 eager iterations")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--num-sms", type=int, default=0, help="comm.moe(num_sms=): the kernels' SM cap (0: all)")
    ap.add_argument("--json", help="write the raw numbers (every run's rows and per-call times) to this file")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/out"), help="folder for per-run JSON")
    ap.add_argument("--port", type=int, default=29600)
    ap.add_argument("--job-timeout", type=int, default=300, help="seconds per job before its ranks are killed")
    ap.add_argument("--selftest", action="store_true", help="CPU only: the baseline at 2 ranks over gloo vs float64")
    args = ap.parse_args()
    if args.selftest:
        return selftest()
    args.shapes = [s for s in args.shapes.split(",") if s]
    bad = [s for s in args.shapes if s not in SHAPES]
    if bad:
        sys.exit(f"--shapes: unknown {bad}; known: {list(SHAPES)}")
    args.impls = [s for s in args.impls.split(",") if s]
    if args.quick:
        args.runs, args.replays, args.eager_iters = 1, 50, 30
    if args.experts % args.ranks:
        sys.exit(f"--experts {args.experts} must be a multiple of --ranks {args.ranks}")
    gpus = torch.cuda.device_count()
    if args.shared_gpu:
        if gpus < 1:
            sys.exit("no GPU")
        os.environ["SYMMALLOC_SHARED_GPU"] = "1"
    elif args.ranks > gpus:
        sys.exit(f"--ranks {args.ranks}: one GPU per rank and this machine has {gpus} (or --shared-gpu)")
    os.makedirs(args.out, exist_ok=True)
    print(f"other MoE libraries: {other_libraries()}", flush=True)
    runs, link = [], None
    jobs = []
    if "symmalloc" in args.impls or "nccl" in args.impls:
        jobs.append("main")
    if "torch" in args.impls:
        if args.shared_gpu:
            print("torch all_to_all_vdev: skipped with --shared-gpu (NVSHMEM needs one GPU per rank)")
        else:
            jobs.append("torch")
    for i in range(args.runs):
        merged = None
        for j, job in enumerate(jobs):
            path = os.path.join(args.out, f"moe_run{i}_{job}.json")
            if os.path.exists(path):
                os.remove(path)
            t0 = time.time()
            rc = run_job(args.ranks, args.port + 10 * i + j, args, job, path)
            print(f"run {i} job {job}: exit codes {rc}, {time.time() - t0:.0f} s", flush=True)
            if not os.path.exists(path):
                print(f"run {i} job {job}: no result (see the output above)")
                continue
            r = json.load(open(path))
            link = link or r.get("link")
            if merged is None:
                merged = r
            else:
                merged["rows"] += r["rows"]
                merged["checks"] += r["checks"]
                merged["notes"] += r["notes"]
        if merged:
            runs.append(merged)
    if not runs:
        sys.exit("no run finished")
    verdicts, summary, others = report(runs, link, args, args.ranks)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "link": link, "runs": runs,
                       "targets": verdicts, "other_libraries": others,
                       "summary": [dict(zip(("shape", "impl", "op", "mode"), k), **v) for k, v in summary.items()]},
                      f)
        print(f"raw numbers: {args.json}")


if __name__ == "__main__":
    main()
