"""Expert parallelism: symmalloc's MoE dispatch/combine (comm.moe, docs/moe.md) against its peers,
measured in the same run, on DeepEP's shapes:

    python3 bench/moe.py [--ranks 2] [--shapes decode1,decode128,prefill4096] [--runs 3] [--json OUT]
        [--routing uniform,skewed] [--zipf-s 1.0] [--dtypes bf16,fp8,fp8q] [--ue8m0]
        [--modes low_latency,throughput] [--num-sms 0,24] [--probe]
    python3 bench/moe.py --shared-gpu --ranks 2 --quick      # N ranks on GPU 0: a filter only
    python3 bench/moe.py --ranks 1 --shapes decode1,decode128 --impls symmalloc --no-link
                                                             # world 1: the kernels' own latency
    python3 bench/moe.py --selftest                          # CPU, gloo, 2 processes: no GPU
    SYMMALLOC_COMM_ARENA_SIZE=1073741824 python3 bench/moe.py --host-check --hidden 1024 \
        --shapes decode1,decode128 --runs 1 --eager-iters 3    # no GPU: every check on the host
                                                             # backend, eager calls wall-clocked

One process per rank (started here), one GPU per rank, or with --shared-gpu every rank on GPU 0
(SYMMALLOC_SHARED_GPU=1; the baseline's group is then gloo, NCCL refusing two ranks on one GPU;
timing is then only a filter and the targets read n/a). Each run is a fresh set of processes
(--runs); the tables give the median over runs of each row's p50 / p99 / max and the worst run.

Shapes (DeepEP's: hidden 7168, top-8 of 256 experts, E/W experts per rank): decode 1 and 128
tokens per rank (max_recv_per_expert left at its default W*T), prefill 4096 tokens per rank with
max_recv_per_expert sized by the load (uniform: W*T*K/E rows per expert times --slack plus four
standard deviations; skewed: the hottest expert's actual count over all ranks, to 16), the
create refused with the reason printed if the arena cannot hold it (SYMMALLOC_COMM_ARENA_SIZE).

Routing (--routing; every table names its routing). Weights: a softmax of random logits.
  uniform  each token's top-k distinct experts uniformly at random, as DeepEP's and pplx's tests
           (DeepEP tests/test_low_latency.py: topk of |randn| + 1 scores).
  skewed   Zipf-like expert popularity: the k-th most popular expert has weight k^-s (--zipf-s,
           default 1.0), which expert is k-th a fixed random permutation shared by every rank
           (so the hot experts are the same everywhere, as a model's are, and spread over the
           ranks), each token drawing its k experts without replacement proportionally to the
           popularity (the Gumbel-top-k trick: the first pick is exactly Categorical(p)). This is
           the scheme of DeepEP PR #393 (tests/utils.py get_global_token_indices: a power-law,
           log-normal or gamma popularity, randomly permuted, torch.multinomial without
           replacement, tuned to a max/mean rank-load target), with the power law fixed at s
           instead of searched, so a row is reproducible from its seed alone. At s = 1, 256
           experts, top-8 the hottest expert is in ~78% of the tokens (~25x the mean expert
           load); with the fixed permutation the busiest rank gets 1.22x the mean load at 2
           ranks and 2.3x at 8 (printed per table, measured on the actual routing). "Hot ranks"
           (whole ranks favoured) was not chosen: a model's popularity is per expert, and
           EPLB-style placement spreads it over the ranks.
  The seed is fixed per rank, shape and run; the same routing feeds the check and the timing.

Payload dtypes (--dtypes; every table names its dtype):
  bf16   bf16 rows.
  fp8    the caller passes e4m3 rows plus fp32 scales per 128 elements (comm.moe(dtype=
         torch.float8_e4m3fn)); the bench quantizes x with a separate torch step (moe_lib
         quantize_fp8: scale = max(amax / 448, FLT_MIN), q = e4m3(x / scale)) OUTSIDE the timed
         region, so the figures are the exchange's only. Combine stays bf16.
  fp8q   quantize inside the dispatch (bf16 in, e4m3 + scales out): used when the installed
         comm.moe has the keyword (input_dtype=torch.bfloat16 or quantize=True; scale_layout
         "row"; --ue8m0 rounds the scales to powers of two), else "not supported by this build".
         The bench's torch quantization is the reference; received bytes that differ from it are
         counted and printed, and every received row must dequantize to within e4m3's rounding
         of the source's bf16 row.
  FP8 correctness: y against the float64 reference computed from the dequantized rows (each
  expert output bf16(dequant(q, s) * s_e), the same fp32 operations the GPU's expert stand-in
  runs, so those are bit for bit equal; what is left is the kernel's fp32 fma sum of <= 8 terms
  and one rounding to bf16, <= 2^-9 relative per element): norm-relative error < 1e-2 passes,
  as for bf16. The error against the unquantized bf16 reference is printed beside it (e4m3's
  own 3-bit mantissa: a few percent), not asserted.

Modes (--modes): low_latency is today's comm.moe (expert-major [L, R, H] receive buffer, one row
per (token, expert)). throughput (comm.moe(mode="throughput"), one row per (token, destination
rank) in a contiguous receive buffer) is used when the build has it, else "not supported by this
build"; its result is read through moe_lib's adapter (TP_FIELDS, tp_expert_rows: the expert
stand-in applies the router weights to each received row, the combine sums the ranks' rows).

SM budget (--num-sms, a list: rows per budget; 0 = every SM): comm.moe(num_sms=). Prefill at
<= 24 SMs is a target row (DeepEP's normal-mode figures are quoted at 24 SMs).

Per-phase probe (--probe, both modes): comm.moe(probe=True) and moe.probe(), per configuration a second object, one untimed dispatch+combine, then one probed
dispatch+combine; the phases (us per phase, per rank) are printed after the tables.

Peers:
  symmalloc  comm.moe(...): dispatch, combine, dispatch+combine, each captured in a CUDA graph of
             --calls calls and replayed (per-call time = replay / calls), and eager.
  nccl       torch.distributed.all_to_all_single, as pplx's published baseline: per-expert counts
             all-to-all, a host read of the splits, the token rows all-to-all (one row per
             (token, expert) pair, its local split included: NCCL copies it on the GPU;
             FP8 rows packed with their scales into one byte row), grouping by expert; combine the
             reverse all-to-all and the weighted sum. The host read makes it uncapturable: eager
             only. Run for bf16 and fp8 (fp8q's table says: see fp8, it cannot quantize inside).
  torch      torch.ops.symm_mem.all_to_all_vdev_2d / all_to_all_vdev_2d_offset (NVSHMEM backend),
             bf16 only, graph where capture works; where it refuses the shape (its kernel takes at
             most 16 experts per rank) the 1-D all_to_all_vdev moves the same rows (no grouping
             by expert: a data-movement peer only). Runs in its own fresh processes after the
             main job (an NVSHMEM failure must not take the other rows with it); reasons printed.
  DeepEP / pplx_kernels / flashinfer: imported if present (reported), never installed.

Correctness before timing, on every rank: the output and the expert buffer's unused rows
poisoned (NaN), then y checked against a float64 reference (expert e's output is
bf16(x * s[e]) with s a fixed random bf16 [E, H]: exactly reproducible anywhere), max abs error
and norm-relative error printed; symmalloc's low-latency received rows are also checked bit for
bit against the layout docs/moe.md promises (rows of a local expert ordered by source rank, then
token).

Bytes, both ways (columns "remote" and "all"), per rank, dispatch rows of the payload dtype
(FP8: H bytes + H/128 fp32 scales) and combine rows bf16:
  remote  rows whose destination is another rank: what crosses the link.
  all     every row, local ones included (DeepEP's tests count all selected (token, expert)
          pairs this way).
  low_latency and both baselines move one row per (token, expert) pair (the baselines' local
  split is a copy on the GPU; symmalloc's local rows are copied into recv_x by the dispatch and
  read in place by the combine); throughput moves one row per (token, destination rank).
GB/s = bytes / p50 for each. link share = remote GB/s over the GPU-to-GPU copy bandwidth
measured in the same run (--link: 256 MiB copies between GPU 0 and 1, both directions at once,
per-direction figure; n/a with --shared-gpu). buffer = symmalloc's buffer_bytes, the baseline's
peak extra torch allocation over one dispatch+combine, torch's symmetric buffers. The target
column: world 1 graphed p50 (1 token dispatch <= 5 us / combine <= 5; 128 tokens <= 12 / <= 10)
and prefill link share >= 0.8; the EP8 model is left to bench/NOTES.md (the link rate printed
is its input).

Multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1; SYMMALLOC_ENABLE_MULTICAST never set).
"""
import argparse
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
sys.path.insert(0, HERE)

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
for _k, _v in NO_MULTICAST.items():
    os.environ[_k] = _v  # before torch loads NCCL / NVSHMEM, in this process and every child
os.environ.pop("SYMMALLOC_ENABLE_MULTICAST", None)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from moe_lib import (DTYPES, MODES, PREFILL_LINK_SHARE, PREFILL_MIN_TOKENS, PREFILL_SMS_TARGET,  # noqa: E402
                     ROUTINGS, SHAPES, TP_FIELDS, WORLD1_TARGETS, A2ABaseline, TpUnsupported, bytes_moved,
                     capacity_for, dequantize_fp8, expected_recv, expert_fn, expert_scales, fp8_error_bound,
                     fp8q_kwargs, gather, gather_json, med, mode_kwargs, model_bytes, moe_params,
                     parse_int_list, parse_list, probe_phases, quantize_fp8, reference_y, rel_err, routing,
                     routing_stats, scales_rows, stats, tokens_x, tp_expert_rows, tp_fields,
                     tp_reference_dispatch)

GIB = 1 << 30
DEV = "cuda"  # "cpu" with --host-check (the host backend: CPU tensors, no timing of graphs)


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


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
    """Each call between events, the ranks started together by a barrier every 10 calls (host
    backend: wall clock, a check of the table code only)."""
    if DEV == "cpu":
        out = []
        for i in range(iters):
            if i % 10 == 0:
                barrier()
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e6)
        return out
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

KEY = ("shape", "routing", "dtype", "impl", "mode", "sms", "op", "exec")


class Case:
    """One (shape, routing, dtype) on this rank: inputs, their FP8 form, references, routing
    statistics over all ranks; `all_*` are every rank's, gathered on first use."""

    def __init__(self, args, rank, world, group, shape, rname, dname, x, idx, w, scales, rstats, ref_bf16):
        self.args, self.rank, self.world, self.group = args, rank, world, group
        self.shape, self.T, self.routing, self.dtype = shape, SHAPES[shape], rname, dname
        self.payload = "bf16" if dname == "bf16" else "fp8"
        self.x, self.idx, self.w, self.scales, self.rstats = x, idx, w, scales, rstats
        self.H, self.K, self.E = args.hidden, args.topk, args.experts
        self.L = self.E // world
        self.ref_bf16 = ref_bf16
        self.q = self.qs = None
        if dname != "bf16":  # a separate torch step, before (outside) every timed region
            self.q, self.qs = quantize_fp8(x, ue8m0=args.ue8m0 and dname == "fp8q")
            self.ref = reference_y(self.q, idx, w, scales, self.qs)
        else:
            self.ref = ref_bf16
        self._all = {}

    def xin(self):
        """dispatch's positional x and keywords: fp8 passes the e4m3 rows and their scales; bf16
        and fp8q (quantized inside) pass the bf16 rows."""
        return (self.q, {"x_scales": self.qs}) if self.dtype == "fp8" else (self.x, {})

    def all(self, name):
        if name not in self._all:
            self._all[name] = torch.stack(gather(getattr(self, name), self.group, self.world, self.args.shared_gpu))
        return self._all[name]

    def moved(self, mode):
        return bytes_moved(self.idx, self.rank, self.L, self.world, self.H, self.payload, mode)


def rank_main(rank, world, port, args, job, out_path):
    try:
        global DEV
        shared = args.shared_gpu
        dev = 0 if shared else rank
        if args.host_check:
            DEV = "cpu"
        else:
            torch.cuda.set_device(dev)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if args.host_check:
            dist.init_process_group("gloo", rank=rank, world_size=world)
        elif shared:
            os.environ["SYMMALLOC_SHARED_GPU"] = "1"
            dist.init_process_group("gloo", rank=rank, world_size=world)
        else:
            dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", dev))
        group = dist.group.WORLD
        barrier = dist.barrier
        name = "host backend (CPU)" if args.host_check else torch.cuda.get_device_name(dev)
        info = {"rank": rank, "world": world, "device": name, "torch": torch.__version__, "shared_gpu": shared,
                "job": job, "rows": [], "checks": [], "notes": [], "probes": [], "routing": {}}
        try:
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001
            info["nccl"] = "?"

        def note(s):
            if rank == 0 and s not in info["notes"]:
                print(f"  [{job}] {s}", flush=True)
            info["notes"].append(s)

        if job == "main" and rank == 0 and world >= 2 and not shared and args.link:
            info["link"] = link_bandwidth()
            print(f"  link GPU0<->GPU1: {info['link']}", flush=True)
        barrier()

        comm = params = tv_mod = None
        if job == "main" and "symmalloc" in args.impls:
            try:
                import symmalloc

                comm = symmalloc.Communicator.from_process_group(group)
                if not hasattr(comm, "moe"):
                    note("symmalloc: Communicator has no moe() in this build: symmalloc rows skipped")
                    comm.close()
                    comm = None
                else:
                    params = moe_params(comm.moe)
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
        scales = expert_scales(E, H, device=DEV)
        for shape in args.shapes:
            T = SHAPES[shape]
            seed = args.seed * 7919 + rank * 104729 + T
            x = tokens_x(T, H, seed, device=DEV)
            for rname in args.routing:
                skew = args.zipf_s if rname == "skewed" else 0.0
                idx, w = routing(T, K, E, seed + 1, skew=skew, device=DEV)
                counts = torch.bincount(idx[idx >= 0], minlength=E)
                if shared:
                    c = counts.cpu()
                    dist.all_reduce(c, group=group)
                    counts = c
                else:
                    dist.all_reduce(counts, group=group)
                rstats = routing_stats(counts.cpu(), world)
                info["routing"][f"{shape}/{rname}"] = rstats
                if rank == 0:
                    print(f"  {shape} {rname}: expert max/mean {rstats['expert_max_over_mean']:.2f}, rank max/mean "
                          f"{rstats['rank_max_over_mean']:.2f}, hottest expert {rstats['hottest_expert']} "
                          f"({rstats['expert_max']} rows)", flush=True)
                ref_bf16 = reference_y(x, idx, w, scales)
                for dname in (args.dtypes if job == "main" else ["bf16"]):
                    if job == "torch" and "bf16" not in args.dtypes:
                        break
                    c = Case(args, rank, world, group, shape, rname, dname, x, idx, w, scales, rstats, ref_bf16)
                    run_case(c, info, note, comm, params, tv_mod, job, barrier)
                    del c
                    torch.cuda.empty_cache()
                del idx, w, ref_bf16
            del x
            torch.cuda.empty_cache()

        if comm is not None:
            comm.barrier()
            sync()
            comm.close()
        barrier()
        dist.destroy_process_group()
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(info, f)
    except Exception:
        traceback.print_exc()
        sys.exit(1)


def run_case(c, info, note, comm, params, tv_mod, job, barrier):
    args, rank = c.args, c.rank
    T = c.T
    calls = args.calls if T < PREFILL_MIN_TOKENS else max(1, args.calls // 5)
    replays = args.replays if T < PREFILL_MIN_TOKENS else max(10, args.replays // 3)
    iters = args.eager_iters if T < PREFILL_MIN_TOKENS else max(10, args.eager_iters // 3)
    base = {"shape": c.shape, "routing": c.routing, "dtype": c.dtype, "tokens": T,
            "model_bytes": model_bytes(T, c.K, c.world, c.H, 2 if c.payload == "bf16" else 1)}
    tag = f"{c.shape}/{c.routing}/{c.dtype}"

    def row(impl, mode, sms, op, ex, times, buf, moved, **extra):
        r = dict(base, impl=impl, mode=mode, sms=sms, op=op, exec=ex, buffer_bytes=buf,
                 bytes_remote=moved["remote"][op], bytes_all=moved["all"][op],
                 rows_remote=moved["rows_remote"], rows_all=moved["rows_all"], **extra)
        r.update(stats(times) or {})
        r["times"] = times
        info["rows"].append(r)
        if rank == 0 and times:
            print(f"  {tag:<26} {impl:<9} {mode:<11} sms {sms:<3} {op:<16} {ex:<5} p50 {r['p50']:9.2f}  "
                  f"p99 {r['p99']:9.2f}  max {r['max']:9.2f} us", flush=True)

    def check(impl, y, **extra):
        ch = dict(rel_err(y, c.ref), shape=c.shape, routing=c.routing, dtype=c.dtype, impl=impl, rank=rank, **extra)
        if c.dtype != "bf16":
            ch["rel_norm_vs_bf16"] = rel_err(y, c.ref_bf16)["rel_norm"]
        info["checks"].append(ch)
        ok = ch["finite"] and ch["rel_norm"] < 1e-2
        if rank == 0 or not ok:
            more = (f" (vs the unquantized bf16 reference {ch['rel_norm_vs_bf16']:.3g}, not asserted)"
                    if "rel_norm_vs_bf16" in ch else "")
            more += "".join(f", {k} {v}" for k, v in extra.items())
            print(f"  {tag:<26} {impl:<9} check rank {rank}: max abs err {ch['max_abs']:.3g}, rel "
                  f"{ch['rel_norm']:.3g}{more}, all written {ch['finite']} -> {'ok' if ok else 'FAILED'}", flush=True)
        if not ok:
            raise AssertionError(f"{impl} {tag}: wrong result on rank {rank}: {ch}")

    if comm is not None:
        for mode in args.modes:
            for sms in args.num_sms:
                sym_case(c, comm, params, mode, sms, row, check, note, calls, replays, iters, barrier, info)
    if job == "main" and "nccl" in args.impls:
        if c.dtype == "fp8q":
            note("nccl baseline: not run for fp8q (it cannot quantize inside its all-to-all): see the fp8 table")
        else:
            nccl_case(c, row, check, iters, barrier)
    if tv_mod is not None:
        try:
            torch_rows(c, row, check, calls, replays, barrier, note)
        except AssertionError:
            raise
        except Exception as e:  # noqa: BLE001
            note(f"torch vdev {tag}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        sync()
        barrier()


def moe_kwargs(c, params, mode, note):
    """comm.moe's keywords for this case, or None (said once why: not supported by this build)."""
    if c.dtype == "fp8q":
        kw = fp8q_kwargs(params, c.args.ue8m0)
        if kw is None:
            note("symmalloc fp8q: not supported by this build (comm.moe has no input_dtype= / quantize= keyword"
                 + (" or no ue8m0=" if c.args.ue8m0 else "") + ")")
            return None
    else:
        kw = {"dtype": torch.bfloat16 if c.dtype == "bf16" else torch.float8_e4m3fn}
    mk = mode_kwargs(params, mode)
    if mk is None:
        note(f"symmalloc mode {mode}: not supported by this build (comm.moe has no mode= keyword)")
        return None
    kw.update(mk)
    return kw


def make_moe(c, comm, kw, mode, sms, note):
    """comm.moe for the case; None with the reason noted. low_latency prefill sizes
    max_recv_per_expert by the load (moe_lib.capacity_for), decode keeps the default W*T."""
    R = 0
    if mode == "low_latency" and c.T >= PREFILL_MIN_TOKENS:
        R = capacity_for(c.rstats["expert_max"], c.T, c.K, c.E, c.world, c.args.slack, c.routing)
    try:
        return comm.moe(max_tokens_per_rank=c.T, hidden=c.H, topk=c.K, num_experts=c.E,
                        max_recv_per_expert=R or None, num_sms=sms, **kw), R
    except TypeError as e:
        what = "fp8q" if c.dtype == "fp8q" else f"mode {mode}"
        note(f"symmalloc {what}: not supported by this build (comm.moe: {e})")
    except Exception as e:  # noqa: BLE001
        need = c.L * (R or c.world * c.T) * c.H * (2 if c.payload == "bf16" else 1) + 2 * c.T * c.K * c.H * 2
        note(f"symmalloc {c.shape}/{c.routing}/{c.dtype} {mode} sms {sms}: create refused (max_recv_per_expert "
             f"{R or c.world * c.T}, recv_x + cbuf alone {need / 2**20:.0f} MiB; SYMMALLOC_COMM_ARENA_SIZE sizes the "
             f"communicator's arena): {type(e).__name__}: {e}")
    return None, R


def sym_case(c, comm, params, mode, sms, row, check, note, calls, replays, iters, barrier, info):
    kw = moe_kwargs(c, params, mode, note)
    if kw is None:
        return
    moe, R = make_moe(c, comm, kw, mode, sms, note)
    if moe is None:
        return
    bb = int(moe.buffer_bytes)
    if c.rank == 0:
        print(f"  {c.shape}/{c.routing}/{c.dtype} symmalloc {mode} sms {sms}: buffer_bytes {bb} ({bb / 2**20:.1f} MiB)"
              + (f", max_recv_per_expert {R or c.world * c.T}" if mode == "low_latency" else ""), flush=True)
    eo = None
    try:
        fn = sym_low_latency if mode == "low_latency" else sym_throughput
        eo = fn(moe, c, kw, check, note)
        if eo is not None:
            sym_timing(moe, c, eo, mode, sms, row, bb, calls, replays, iters, barrier)
    except AssertionError:
        raise
    except Exception as e:  # noqa: BLE001
        note(f"symmalloc {c.shape}/{c.routing}/{c.dtype} {mode} sms {sms}: {type(e).__name__}: {e}")
        traceback.print_exc()
    sync()
    moe.close()  # collective, at the same point on every rank
    barrier()
    if c.args.probe and eo is not None:
        probe_case(c, comm, kw, mode, sms, eo, note, info)


def dispatch(moe, c):
    x, kw = c.xin()
    return moe.dispatch(x, c.idx, c.w, **kw)


def handle_of(d):
    """A dispatch result's handle for combine: MoeDispatch.handle (both modes, assumed for
    throughput as in moe_lib TP_FIELDS), else its fourth element."""
    h = getattr(d, "handle", None)
    return h if h is not None else d[3]


def sym_low_latency(moe, c, kw, check, note):
    """Correctness of a low-latency dispatch (layout bit for bit) and combine (y vs float64), the
    expert buffer and its unused rows poisoned first. Returns the finite expert output for timing."""
    L, H, rank = c.L, c.H, c.rank
    d = dispatch(moe, c)
    sync()
    recv_x = d[0]
    R = recv_x.numel() // (L * H)
    recv_x.fill_(float("nan"))  # poison the landing rows: the next dispatch must write every row it counts
    if d[1] is not None:
        d[1].fill_(float("nan"))
    sync()
    dist.barrier()
    recv_x, recv_sc, recv_counts, handle = dispatch(moe, c)
    sync()
    counts, le, src = expected_recv(c.all("idx"), rank, L, c.world)
    got_counts = recv_counts.to(torch.int64).cpu()
    assert torch.equal(got_counts, counts.cpu()), f"symmalloc recv_counts {got_counts.tolist()[:8]}... want {counts.tolist()[:8]}..."
    start = torch.cumsum(counts, 0) - counts
    j = torch.arange(le.numel(), device=le.device) - start[le]
    recv_x = recv_x.view(L, R, H)
    pick = le * R + j
    got_rows = recv_x.reshape(L * R, H).index_select(0, pick)
    extra = {}
    rs = None
    if c.payload == "bf16":
        want = c.all("x").reshape(-1, H).index_select(0, src)
        assert torch.equal(got_rows.view(torch.int16), want.view(torch.int16)), "symmalloc recv_x rows differ from the layout"
    else:
        S = H // 128
        rs = scales_rows(recv_sc, kw.get("scale_layout", "row"), L, R, S)
        got_sc = rs.reshape(L * R, S).index_select(0, pick)
        want = c.all("q").reshape(-1, H).index_select(0, src)
        want_sc = c.all("qs").reshape(-1, S).index_select(0, src)
        if c.dtype == "fp8":  # the caller's bytes and scales, moved: bit for bit
            assert torch.equal(got_rows.view(torch.uint8), want.view(torch.uint8)), "symmalloc FP8 rows differ"
            assert torch.equal(got_sc, want_sc), "symmalloc FP8 scales differ"
        else:  # quantized by the kernel: within e4m3's rounding of the source's bf16 row
            xs = c.all("x").reshape(-1, H).index_select(0, src)
            bad = diff = 0
            deq = None
            for a in range(0, xs.shape[0], 4096):  # float64 in slices: prefill holds ~32k rows
                b = a + 4096
                deq = dequantize_fp8(got_rows[a:b], got_sc[a:b]).double()
                bad += int(((deq - xs[a:b].double()).abs() > fp8_error_bound(xs[a:b], got_sc[a:b])).sum())
                diff += int((got_rows[a:b].view(torch.uint8) != want[a:b].view(torch.uint8)).sum())
            lo = bool((got_sc >= want_sc * (1 - 2 ** -20)).all())
            hi = bool((got_sc <= want_sc * 2 * (1 + 2 ** -20)).all())
            assert bad == 0 and lo and hi, (f"symmalloc fp8q rows: {bad} elements beyond e4m3 rounding of the source "
                                            f"row, scales >= amax/448: {lo}, <= 2x: {hi}")
            extra["fp8q_bytes_differing_from_torch"] = f"{diff}/{got_rows.numel()}"
            del xs, deq
    del got_rows, want
    # Expert outputs, a few experts at a time (skewed prefill: L x R x H is GBs): rows past each
    # expert's count poisoned for the check (combine must not read them), then zeroed for timing.
    unused = ~(torch.arange(R, device=DEV)[None, :] < recv_counts.to(torch.int64)[:, None])
    eo = torch.empty(L, R, H, dtype=torch.bfloat16, device=DEV)
    sl = c.scales[rank * L: (rank + 1) * L]
    for a in range(0, L, 8):
        eo[a:a + 8] = expert_fn(recv_x[a:a + 8], sl[a:a + 8, None, :], None if rs is None else rs[a:a + 8])
    eo.masked_fill_(unused[..., None], float("nan"))
    y = torch.full((c.T, H), float("nan"), dtype=torch.bfloat16, device=DEV)
    got = moe.combine(eo, handle, out=y)
    sync()
    check("symmalloc", got if got is not None else y, mode="low_latency", **extra)
    eo.masked_fill_(unused[..., None], 0.0)  # finite, for timing
    return eo


def sym_throughput(moe, c, kw, check, note):
    """Correctness of a throughput dispatch through moe_lib's adapter: the row count, the rows
    (where the result names each row's source), y vs float64. Returns the expert output."""
    d = dispatch(moe, c)
    sync()
    try:
        f = tp_fields(d)
    except TpUnsupported as e:
        note(f"symmalloc mode throughput: {e}")
        return None
    ref = tp_reference_dispatch(c.all("x"), c.all("idx"), c.all("w"), c.rank, c.L)
    n_want = ref[TP_FIELDS["count"]]
    eo, n = tp_expert_rows(d, c.scales, moe.first_expert)
    assert n == n_want, f"symmalloc throughput: {n} rows received, want {n_want} (one per (token, this rank))"
    if f["src"] is not None and c.payload == "bf16":
        # recv_src read as s*T+t, or as the low-latency code (s*T+t)*K+k: the rows must match one.
        src = f["src"].reshape(-1)[:n].long()
        got = f["x"].reshape(-1, c.H)[:n].view(torch.int16)
        rows = c.all("x").reshape(-1, c.H)
        ok = [how for how, s_ in (("s*T+t", src), ("(s*T+t)*K+k", src // c.K))
              if bool((s_ >= 0).all() and (s_ < rows.shape[0]).all())
              and torch.equal(got, rows.index_select(0, s_).view(torch.int16))]
        assert ok, "symmalloc throughput rows differ from their sources, recv_src read as s*T+t or (s*T+t)*K+k"
    eo_poisoned = eo.clone()
    eo_poisoned[n:] = float("nan")
    y = torch.full((c.T, c.H), float("nan"), dtype=torch.bfloat16, device=DEV)
    got = moe.combine(eo_poisoned, handle_of(d), out=y)
    sync()
    check("symmalloc", got if got is not None else y, mode="throughput", rows=n)
    return eo


def sym_timing(moe, c, eo, mode, sms, row, bb, calls, replays, iters, barrier):
    """dispatch, combine, dispatch+combine: graphed and eager (finite expert outputs; one y)."""
    y = torch.empty(c.T, c.H, dtype=torch.bfloat16, device=DEV)
    h = {"handle": handle_of(dispatch(moe, c))}

    def disp():
        h["handle"] = handle_of(dispatch(moe, c))

    def comb():
        moe.combine(eo, h["handle"], out=y)

    def both():
        moe.combine(eo, handle_of(dispatch(moe, c)), out=y)

    moved = c.moved(mode)
    for op, fn in (("dispatch", disp), ("combine", comb), ("dispatch+combine", both)):
        try:
            if DEV == "cpu":
                raise NotImplementedError("no CUDA graphs on the host backend")
            row("symmalloc", mode, sms, op, "graph", graph_time(fn, calls, replays, c.args.gate, barrier), bb, moved,
                calls=calls)
        except Exception as e:  # noqa: BLE001
            sync()
            row("symmalloc", mode, sms, op, "graph", [], bb, moved, error=f"{type(e).__name__}: {e}"[:200])
            if DEV == "cuda":
                print(f"  symmalloc {op} graph: {type(e).__name__}: {e}", flush=True)
        disp()
        row("symmalloc", mode, sms, op, "eager", eager_time(fn, iters, barrier), bb, moved)


def probe_case(c, comm, kw, mode, sms, eo, note, info):
    """A second object made with the probe on: one untimed dispatch+combine, then one probed;
    every rank's phases gathered to rank 0."""
    from symmalloc.moe import Moe

    if not hasattr(Moe, "probe"):
        note("per-phase probe: not supported by this build (Moe has no probe())")
        return
    moe, _ = make_moe(c, comm, dict(kw, probe=True), mode, sms, note)
    if moe is None:
        return
    try:
        y = torch.empty(c.T, c.H, dtype=torch.bfloat16, device=DEV)
        for _ in range(2):  # the first untimed, the second probed
            moe.combine(eo, handle_of(dispatch(moe, c)), out=y)
            sync()
            dist.barrier()
        raw = moe.probe()
        ph = probe_phases(raw)
        res = ph if ph is not None else repr(raw)[:300]
    except Exception as e:  # noqa: BLE001
        res = f"{type(e).__name__}: {e}"[:300]
    sync()
    moe.close()
    dist.barrier()
    got = gather_json(res, dist.group.WORLD, c.world, c.args.shared_gpu, device=DEV)
    if c.rank == 0:
        info["probes"].append({"shape": c.shape, "routing": c.routing, "dtype": c.dtype, "mode": mode, "sms": sms,
                               "ranks": got})


def nccl_case(c, row, check, iters, barrier):
    L, rank = c.L, c.rank
    bl = A2ABaseline(dist.group.WORLD, c.world, rank, c.E, stage=c.args.shared_gpu)
    xin, qs = (c.q, c.qs) if c.dtype == "fp8" else (c.x, None)
    grouped, gs, gle, _, h = bl.dispatch(xin, c.idx, qs)
    eo = expert_fn(grouped, c.scales[rank * L + gle], gs)
    y = bl.combine(eo, h, c.w, c.idx)
    sync()
    check("nccl", y)
    sync()
    peak = None
    if DEV == "cuda":
        torch.cuda.reset_peak_memory_stats()
        m0 = torch.cuda.memory_allocated()
        out = bl.dispatch(xin, c.idx, qs)
        bl.combine(eo, out[4], c.w, c.idx)
        sync()
        peak = torch.cuda.max_memory_allocated() - m0
        del out
    moved = c.moved("low_latency")
    for op, fn in (("dispatch", lambda: bl.dispatch(xin, c.idx, qs)),
                   ("combine", lambda: bl.combine(eo, h, c.w, c.idx)),
                   ("dispatch+combine", lambda: bl.combine(eo, bl.dispatch(xin, c.idx, qs)[4], c.w, c.idx))):
        row("nccl", "-", "-", op, "eager", eager_time(fn, iters, barrier), peak, moved)
    del bl, grouped, gle, h, eo, y
    torch.cuda.empty_cache()


def torch_rows(c, row, check, calls, replays, barrier, note):
    group, rank, world, L = dist.group.WORLD, c.rank, c.world, c.L
    x, idx, w, scales = c.x, c.idx, c.w, c.scales
    tv = TorchVdev(group.group_name, world, rank, c.E, c.T, c.K, c.H, torch.device("cuda", torch.cuda.current_device()))
    try:
        order = tv.dispatch(x, idx)
        sync()
    except Exception as e:  # noqa: BLE001
        note(f"torch all_to_all_vdev_2d {c.shape}: refused ({str(e).splitlines()[0][:160]}); 1-D all_to_all_vdev "
             "instead (moves the same rows; no grouping by expert)")
        sync()
        barrier()
        tv.mode = "1d"
        order = tv.dispatch(x, idx)
        sync()
    impl = "torch_2d" if tv.mode == "2d" else "torch_1d"
    tv.eo.fill_(float("nan"))
    if tv.mode == "2d":
        so = tv.out_so.cpu()  # [splits; offsets] of chunk c = le * W + src (blocks may be padded)
        rows = torch.cat([torch.arange(int(so[1][i]), int(so[1][i] + so[0][i])) for i in range(c.E)]).cuda()
        le = torch.repeat_interleave(torch.arange(c.E) // world, so[0]).cuda()
        tv.eo[rows] = expert_fn(tv.out[rows], scales[rank * L + le])
        y = tv.combine(order, w)
        sync()
        check(impl, y)
    else:  # identity experts: the round trip must return every row to its token
        n = int(tv.out1[0].sum())
        tv.eo[:n] = tv.out[:n]
        y = tv.combine(order, w)
        sync()
        want = (x.double()[:, None, :] * w.double()[..., None]).sum(1)
        ch = rel_err(y, want)
        if not (ch["finite"] and ch["rel_norm"] < 1e-2):
            raise AssertionError(f"{impl} {c.shape}: round trip wrong on rank {rank}: {ch}")
        if rank == 0:
            print(f"  {c.shape:<12} {impl:<10} round trip (identity experts) rel {ch['rel_norm']:.3g}: ok", flush=True)
        tv.eo[:n] = expert_fn(tv.out[:n], scales[rank * L])  # finite data for timing
    st = {"order": order}

    def disp():
        st["order"] = tv.dispatch(x, idx)

    def comb():
        tv.combine(st["order"], w)

    def both():
        tv.combine(tv.dispatch(x, idx), w)

    moved = c.moved("low_latency")
    for op, fn in (("dispatch", disp), ("combine", comb), ("dispatch+combine", both)):
        try:
            row(impl, "-", "-", op, "graph", graph_time(fn, calls, replays, c.args.gate, barrier), tv.bytes, moved,
                calls=calls)
        except Exception as e:  # noqa: BLE001
            sync()
            note(f"{impl} {op} graph capture failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
        row(impl, "-", "-", op, "eager", eager_time(fn, c.args.eager_iters, barrier), tv.bytes, moved)


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
    """KEY -> per-run rows."""
    rows = {}
    for r in runs:
        for row in r["rows"]:
            if row.get("p50") is not None:
                rows.setdefault(tuple(row[k] for k in KEY), []).append(row)
    return rows


IMPL_ORDER = {"symmalloc": 0, "nccl": 1, "torch_2d": 2, "torch_1d": 3}
OPS = ["dispatch", "combine", "dispatch+combine"]


def sort_key(k):
    return (IMPL_ORDER.get(k[3], 9), MODES.index(k[4]) if k[4] in MODES else 9, str(k[5]), OPS.index(k[6]),
            k[7] != "graph")


def target_cell(k, p50, share, world, shared):
    """The target beside a row, with its verdict: world-1 latency (symmalloc low-latency graphed
    decode rows) and prefill link share (symmalloc graphed dispatch / combine)."""
    shape, _, _, impl, mode, sms, op, ex = k
    if impl != "symmalloc" or ex != "graph":
        return ""
    lim = WORLD1_TARGETS.get((shape, op))
    if lim is not None and mode == "low_latency":
        if world != 1:
            return f"<= {lim:g} us at world 1"
        return f"<= {lim:g} us: {'MET' if p50 <= lim else 'MISSED'}"
    if SHAPES[shape] >= PREFILL_MIN_TOKENS and op != "dispatch+combine":
        star = " (<= 24 SMs: target row)" if 0 < sms <= PREFILL_SMS_TARGET else ""
        if shared or share is None:
            return f">= {PREFILL_LINK_SHARE} link: n/a{star}"
        return f">= {PREFILL_LINK_SHARE} link: {'MET' if share >= PREFILL_LINK_SHARE else 'MISSED'}{star}"
    return ""


def human(n):
    """Bytes as B / KiB / MiB / GiB with 3 significant figures or so."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def report(runs, link, args, world):
    rows = aggregate(runs)
    d = runs[0]
    shared = args.shared_gpu
    lbw = (link or {}).get("bidirectional_per_direction_GBps")
    print(f"\nMoE dispatch/combine, hidden {args.hidden}, top-{args.topk} of {args.experts} experts, "
          f"{world} ranks on {'ONE GPU (shared: timing is a filter only)' if shared else f'{world}x ' + d['device']}, "
          f"torch {d['torch']}, NCCL {d['nccl']}; {len(runs)} run(s); us per call, rank 0; median over runs "
          f"(worst run's p50); skewed = Zipf s={args.zipf_s}")
    if link:
        print(f"link: GPU0->GPU1 copy {link['unidirectional_GBps']:.1f} GB/s alone, {lbw:.1f} GB/s per direction "
              f"both at once (peer access {link['peer_access']}); link share = remote GB/s over the latter")
    else:
        print("link: n/a (" + ("shared GPU" if shared else "one rank per GPU needed, W >= 2, --link") + ")")
    summary = {}
    for shape in args.shapes:
        for rname in args.routing:
            for dname in args.dtypes:
                keys = sorted((k for k in rows if k[:3] == (shape, rname, dname)), key=sort_key)
                if not keys:
                    continue
                T = SHAPES[shape]
                rs = d.get("routing", {}).get(f"{shape}/{rname}", {})
                sent = {}
                for k in keys:
                    unit = "(token, rank)" if k[4] == "throughput" else "(token, expert)"
                    sent.setdefault(unit, (rows[k][0]["rows_remote"], rows[k][0]["rows_all"]))
                how = {"fp8": " (x quantized to e4m3 + scales by a torch step before timing: not in the figures)",
                       "fp8q": " (bf16 in, quantized inside the dispatch)"}.get(dname, "")
                print(f"\n{shape} / {rname} routing / {dname}{how}: {T} tokens per rank; rank 0 sends "
                      + "; ".join(f"{r} remote of {a} rows per {u}" for u, (r, a) in sent.items())
                      + f" (uniform model T*K*(W-1)/W = {T * args.topk * (world - 1) / world:.0f} remote pairs); "
                      f"expert load max/mean {rs.get('expert_max_over_mean', 0):.2f}, rank load max/mean "
                      f"{rs.get('rank_max_over_mean', 0):.2f}")
                print("| impl | mode | SMs | op | exec | p50 µs | p99 µs | max µs | worst p50 | remote bytes/rank | "
                      "remote GB/s | all bytes/rank (incl. local) | all GB/s | link share | buffer | target |")
                print("|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
                for k in keys:
                    per = rows[k]
                    p50, p99, mx = (med([r[q] for r in per]) for q in ("p50", "p99", "max"))
                    worst = max(r["p50"] for r in per)
                    br, ba = per[0]["bytes_remote"], per[0]["bytes_all"]
                    gr = br / (p50 * 1e-6) / 1e9 if p50 else 0
                    ga = ba / (p50 * 1e-6) / 1e9 if p50 else 0
                    share = gr / lbw if lbw and not shared else None
                    buf = per[0].get("buffer_bytes")
                    ex = k[7] + {"nccl": " (host sync)", "torch_1d": " (no grouping)"}.get(k[3], "")
                    print(f"| {k[3]} | {k[4]} | {k[5]} | {k[6]} | {ex} | {p50:.1f} | {p99:.1f} | {mx:.1f} | {worst:.1f} | "
                          f"{human(br)} | {gr:.1f} | {human(ba)} | {ga:.1f} | "
                          f"{f'{share:.2f}' if share is not None else 'n/a'} | "
                          f"{human(buf) if buf else '-'} | {target_cell(k, p50, share, world, shared)} |")
                    summary[k] = {"p50": p50, "p99": p99, "max": mx, "gbps_remote": gr, "gbps_all": ga, "share": share,
                                  "buffer": buf, "bytes_remote": br, "bytes_all": ba}
    probes = [p for r in runs[:1] for p in r.get("probes", [])]
    if args.probe:
        print("\nPer-phase probe (one probed dispatch+combine per configuration, first run; us per phase, per rank):")
        if not probes:
            print("  none recorded (see the notes: not supported by this build, or no object was made)")
        for p in probes:
            print(f"  {p['shape']}/{p['routing']}/{p['dtype']} {p['mode']} sms {p['sms']}:")
            for r, ph in enumerate(p["ranks"]):
                text = ", ".join(f"{n} {us:.2f}" for n, us in ph) if isinstance(ph, list) else f"raw: {ph}"
                print(f"    rank {r}: {text}")
    notes = sorted({n for r in runs for n in r.get("notes", [])})
    if notes:
        print("\nnotes:")
        for n in notes:
            print(f"  - {n}")
    others = other_libraries()
    print("other MoE libraries importable here: " + ", ".join(f"{k} {'(' + str(v) + ')' if v else 'absent'}"
                                                              for k, v in others.items())
          + " (reported only; not benchmarked by this script)")
    return targets(summary, args, world, link, shared), summary, others


def targets(s, args, world, link, shared):
    lbw = (link or {}).get("bidirectional_per_direction_GBps")
    print("\nTargets")
    out = {}
    print("  link rate measured (input of the EP8 model, bench/NOTES.md 'Expert parallelism (model)'): "
          + (f"{lbw:.1f} GB/s per direction both at once, {link['unidirectional_GBps']:.1f} alone" if link else "n/a"))
    combos = sorted({k[1:3] + k[4:6] for k in s if k[3] == "symmalloc"}, key=str)
    # 0. world 1: the kernels' latency, graphed p50 (p99 beside it), low-latency mode.
    for (shape, op), limit in WORLD1_TARGETS.items():
        if shape not in args.shapes:
            continue
        if world != 1:
            out[f"world1_{shape}_{op}"] = "n/a (target is at 1 rank)"
            print(f"  world 1 {shape} {op} graphed p50 <= {limit:g} us: n/a (target is at 1 rank)")
            continue
        for rname, dname, mode, sms in combos:
            if mode != "low_latency":
                continue
            r = s.get((shape, rname, dname, "symmalloc", mode, sms, op, "graph"))
            if not r:
                verdict, text = "n/a", "missing row"
            else:
                text = f"p50 {r['p50']:.2f} us, p99 {r['p99']:.2f} us"
                verdict = "MET" if r["p50"] <= limit else "MISSED"
            out[f"world1_{shape}_{op}_{rname}_{dname}_sms{sms}"] = verdict
            print(f"  world 1 {shape} {op} {rname} {dname} sms {sms} graphed p50 <= {limit:g} us: {text} -> {verdict}")
    # 1. decode dispatch+combine vs the NCCL baseline, >= 3x at 2 ranks.
    for shape in [x for x in args.shapes if SHAPES[x] < PREFILL_MIN_TOKENS]:
        if world != 2:
            out[f"decode_speedup_{shape}"] = "n/a (target is at 2 ranks)"
            print(f"  decode {shape} dispatch+combine >= 3x NCCL: n/a (target is at 2 ranks)")
            continue
        for rname, dname, mode, sms in combos:
            sg = s.get((shape, rname, dname, "symmalloc", mode, sms, "dispatch+combine", "graph"))
            bd = "fp8" if dname == "fp8q" else dname  # the baseline cannot quantize inside: fp8q vs its fp8 row
            nb = s.get((shape, rname, bd, "nccl", "-", "-", "dispatch+combine", "eager"))
            if not (sg and nb):
                verdict, text = "n/a", "missing rows"
            else:
                ratio = nb["p50"] / sg["p50"]
                text = f"NCCL eager {nb['p50']:.1f} us / symmalloc graph {sg['p50']:.1f} us = {ratio:.2f}x"
                verdict = "n/a (shared GPU)" if shared else ("MET" if ratio >= 3 else "MISSED")
            out[f"decode_speedup_{shape}_{rname}_{dname}_{mode}_sms{sms}"] = verdict
            print(f"  decode {shape} {rname} {dname} {mode} sms {sms} dispatch+combine >= 3x NCCL: {text} -> {verdict}")
    # 2. prefill: remote GB/s over the measured link, >= 0.8 (dispatch and combine each); <= 24 SMs flagged.
    for shape in [x for x in args.shapes if SHAPES[x] >= PREFILL_MIN_TOKENS]:
        for rname, dname, mode, sms in combos:
            parts, ok = [], True
            for op in ("dispatch", "combine"):
                r = s.get((shape, rname, dname, "symmalloc", mode, sms, op, "graph"))
                if r and lbw:
                    parts.append(f"{op} {r['gbps_remote']:.0f} GB/s = {r['gbps_remote'] / lbw:.2f}")
                    ok = ok and r["gbps_remote"] / lbw >= PREFILL_LINK_SHARE
                else:
                    parts.append(f"{op} n/a")
                    ok = None
            verdict = "n/a (shared GPU)" if shared else ("n/a" if ok is None else ("MET" if ok else "MISSED"))
            row = " [target row: <= 24 SMs]" if 0 < sms <= PREFILL_SMS_TARGET else ""
            out[f"prefill_link_share_{shape}_{rname}_{dname}_{mode}_sms{sms}"] = verdict
            print(f"  prefill {shape} {rname} {dname} {mode} sms {sms}{row} >= {PREFILL_LINK_SHARE} of the link: "
                  f"{', '.join(parts)} -> {verdict}")
    # 3. buffers <= 1 GiB per rank at 128 tokens x 7168 x top-8 (uniform, bf16, low latency).
    r = next((v for k, v in s.items() if k[:5] == ("decode128", "uniform", "bf16", "symmalloc", "low_latency")
              and v["buffer"]), None)
    if r:
        verdict = "MET" if r["buffer"] <= GIB else "MISSED"
        text = f"buffer_bytes {r['buffer'] / 2**20:.1f} MiB"
    else:
        verdict, text = "n/a", "decode128 uniform bf16 low_latency not run with symmalloc"
    out["buffer_decode128"] = verdict
    print(f"  buffers <= 1 GiB per rank at 128 tokens x {args.hidden} x top-{args.topk}: {text} -> {verdict}")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2, help="ranks (default 2); one GPU each unless --shared-gpu")
    ap.add_argument("--shared-gpu", action="store_true", help="every rank on GPU 0 (SYMMALLOC_SHARED_GPU=1): a filter")
    ap.add_argument("--shapes", default="decode1,decode128,prefill4096", help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--routing", default="uniform,skewed", help="comma list of uniform, skewed (Zipf, --zipf-s)")
    ap.add_argument("--zipf-s", type=float, default=1.0, help="skewed routing: popularity of the k-th expert ~ k^-s")
    ap.add_argument("--dtypes", default="bf16,fp8,fp8q", help="comma list of bf16, fp8 (caller-quantized), fp8q "
                                                              "(quantized inside the dispatch, where supported)")
    ap.add_argument("--ue8m0", action="store_true", help="fp8q: scales rounded up to powers of two")
    ap.add_argument("--modes", default="low_latency,throughput", help="comma list of low_latency, throughput")
    ap.add_argument("--num-sms", default="0,24", help="comma list of SM budgets, comm.moe(num_sms=); 0: every SM")
    ap.add_argument("--probe", action="store_true", help="per-phase probe (comm.moe(probe=True), moe.probe(); both modes)")
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
    ap.add_argument("--json", help="write the raw numbers (every run's rows and per-call times) to this file")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/out"), help="folder for per-run JSON")
    ap.add_argument("--port", type=int, default=29600)
    ap.add_argument("--job-timeout", type=int, default=900, help="seconds per job before its ranks are killed")
    ap.add_argument("--host-check", action="store_true", help="no GPU: the host backend (SYMMALLOC_BACKEND=host, "
                    "CPU tensors, gloo) runs every check and eager call once timed by the wall clock: a check of "
                    "this script, not a measurement")
    ap.add_argument("--selftest", action="store_true", help="CPU only: the pure helpers and the baseline at 2 ranks "
                                                            "over gloo vs float64")
    args = ap.parse_args()
    if args.selftest:
        from moe_selftest import selftest

        return selftest()
    try:
        args.shapes = parse_list(args.shapes, list(SHAPES), "--shapes")
        args.routing = parse_list(args.routing, ROUTINGS, "--routing")
        args.dtypes = parse_list(args.dtypes, DTYPES, "--dtypes")
        args.modes = parse_list(args.modes, MODES, "--modes")
        args.impls = parse_list(args.impls, ("symmalloc", "nccl", "torch"), "--impls")
        args.num_sms = parse_int_list(args.num_sms, "--num-sms", 0, 1024)
    except ValueError as e:
        sys.exit(str(e))
    if args.zipf_s <= 0 and "skewed" in args.routing:
        sys.exit(f"--zipf-s {args.zipf_s}: must be > 0 (0 is the uniform routing)")
    if args.quick:
        args.runs, args.replays, args.eager_iters = 1, 50, 30
    if args.experts % args.ranks:
        sys.exit(f"--experts {args.experts} must be a multiple of --ranks {args.ranks}")
    gpus = torch.cuda.device_count()
    if args.host_check:  # the host backend: CPU tensors, gloo, no link, no torch vdev
        os.environ["SYMMALLOC_BACKEND"] = "host"
        args.link, args.shared_gpu = False, False
        args.impls = [i for i in args.impls if i != "torch"]
    elif args.shared_gpu:
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
                for k in ("rows", "checks", "notes", "probes"):
                    merged[k] += r.get(k, [])
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
                       "summary": [dict(zip(KEY, k), **v) for k, v in summary.items()]}, f)
        print(f"raw numbers: {args.json}")


if __name__ == "__main__":
    main()
