"""All-reduce fused with residual add + RMSNorm: symmalloc's fused call against the
same work unfused (symmalloc all-reduce, then torch add + rms_norm) and against NCCL all-reduce +
the same torch ops; and a tensor-parallel decoder step built each way.

    python3 bench/fused.py [--out DIR] [--hidden 4096,6144,8192] [--tokens 1,6,8,32,128,138,512,2048] [--fp8]

One process per GPU (started here). bf16, eps 1e-6. Every variant is first checked on fresh random
data against torch.nn.functional.rms_norm of the float32 sum (outputs poisoned first). Timing: a
CUDA graph of 20 calls of the variant, replayed 200 times behind a GPU gate (as bench/tail.py),
each replay timed with events: p50 / p99 / max of the per-call time. "all-reduce alone" is
symmalloc's out-of-place all-reduce of the same tensor, the floor the fused call is held to.

The decoder step: 16 layers, hidden 4096, each an attention-output block (a [h, h/world] and a
[h/world, h] matmul) and an MLP block ([h, 11008/world], GELU, [11008/world, h]), each block ending
in all-reduce + residual add + RMSNorm: 32 collectives per step, the whole step one CUDA graph,
replayed 100 times: p50 / p99 / max per step. The matmul outputs that feed the collectives live in
symmalloc's pool (zero copy) for every variant.

--fp8 adds the FP8 e4m3 outputs (symm_all_reduce_add_rms_norm_quant, static and per-token
scales) against the bf16 fused call followed by a torch.compile'd quant of its output (the same
static scale; per-token: amax / 448 per row, then the cast), each checked first (every byte
within one e4m3 step of the compiled quant of the bf16 output).
Multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1).
"""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import symmalloc  # noqa: E402

CALLS, REPLAYS, STEP_REPLAYS = 20, 200, 100
GATE_CYCLES = 40_000_000
EPS = 1e-6


def timed(fn, calls, replays):
    """p50/p99/max µs per call of a graph of `calls` calls of fn, replayed behind a gate."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    for _ in range(3):
        g.replay()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    dist.barrier()
    torch.cuda.synchronize()
    torch.cuda._sleep(GATE_CYCLES)
    g.replay()
    for a, b in ev:
        a.record()
        g.replay()
        b.record()
    torch.cuda.synchronize()
    t = sorted(a.elapsed_time(b) * 1000.0 / calls for a, b in ev)
    del g
    return {"p50": t[len(t) // 2], "p99": t[int(len(t) * 0.99)], "max": t[-1]}


def worker(rank, world, port, a, out_path):
    # One compiled quant per shape (static shapes): room for every shape of a run.
    for knob in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 1024)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    comm = symmalloc.Communicator.from_process_group()
    pool = symmalloc.mem_pool()
    gen = torch.Generator(device="cuda").manual_seed(99 + rank)
    shared = torch.Generator(device="cuda").manual_seed(7)  # the same on every rank
    rows = []
    for hidden in a.hidden:
        weight = (1 + 0.1 * torch.randn(hidden, generator=shared, device="cuda")).to(torch.bfloat16)
        for tokens in a.tokens:
            with torch.cuda.use_mem_pool(pool):
                x = torch.empty(tokens, hidden, dtype=torch.bfloat16, device="cuda")
                y = torch.empty_like(x)
                residual = torch.empty_like(x)
                out = torch.empty_like(x)
            nx = torch.empty_like(x)

            def fused():
                comm.all_reduce_add_rms_norm(x, residual, weight, eps=EPS, out=out)

            def unfused():
                comm.all_reduce(x, out=y)
                residual.add_(y)
                out.copy_(F.rms_norm(residual, (hidden,), weight, EPS))

            def nccl():
                nx.copy_(x)
                dist.all_reduce(nx)
                residual.add_(nx)
                out.copy_(F.rms_norm(residual, (hidden,), weight, EPS))

            def ar_alone():
                comm.all_reduce(x, out=y)

            if a.fp8:
                q = torch.empty(tokens, hidden, dtype=torch.float8_e4m3fn, device="cuda")
                s_static = torch.full((1,), 0.05, device="cuda")
                s_tok = torch.empty(tokens, 1, device="cuda")

                def fp8_static():
                    comm.all_reduce_add_rms_norm_fp8(x, residual, weight, scale=s_static, eps=EPS, out=q)

                def fp8_token():
                    comm.all_reduce_add_rms_norm_fp8(x, residual, weight, eps=EPS, out=q, scale_out=s_tok)

                def then_static():
                    fused()
                    QUANT_STATIC(out, s_static)

                def then_token():
                    fused()
                    QUANT_TOKEN(out)

            # Correctness: fresh data, outputs poisoned, against float32 torch.
            for name, fn in (("fused", fused), ("unfused", unfused), ("nccl", nccl)):
                x.copy_(torch.randn(tokens, hidden, generator=gen, device="cuda"))
                r0 = torch.randn(tokens, hidden, generator=shared, device="cuda").to(torch.bfloat16)
                residual.copy_(r0)
                out.fill_(float("nan"))
                xs = x.float().clone()
                dist.all_reduce(xs)
                want_r = xs + r0.float()
                want = F.rms_norm(want_r, (hidden,), weight.float(), EPS)
                fn()
                torch.cuda.synchronize()
                e_out = ((out.float() - want).norm() / want.norm()).item()
                e_res = ((residual.float() - want_r).norm() / want_r.norm()).item()
                assert e_out < 2e-2 and e_res < 2e-2, f"{name} [{tokens}, {hidden}]: rel err out {e_out} residual {e_res}"
            x.copy_(torch.randn(tokens, hidden, generator=gen, device="cuda") * 1e-3)  # keeps residual finite
            residual.copy_(torch.randn(tokens, hidden, generator=shared, device="cuda"))
            row = {"tokens": tokens, "hidden": hidden}
            variants = [("fused", fused), ("unfused", unfused), ("nccl", nccl), ("all_reduce", ar_alone)]
            if a.fp8:
                check_fp8(fused, fp8_static, fp8_token, out, q, s_static, s_tok, residual, f"[{tokens}, {hidden}]")
                variants += [("fp8_static", fp8_static), ("fp8_token", fp8_token),
                             ("fused_quant_static", then_static), ("fused_quant_token", then_token)]
            for name, fn in variants:
                row[name] = timed(fn, CALLS, REPLAYS)
            rows.append(row)
            if rank == 0:
                print(f"[{tokens:>4}, {hidden}] " + "  ".join(f"{k} {v['p50']:.2f}/{v['p99']:.2f}" for k, v in row.items()
                                                            if isinstance(v, dict)), flush=True)
            del x, y, residual, out, nx
            if a.fp8:
                del q, s_static, s_tok
    steps = decoder_steps(comm, pool, world, rank, a) if a.step_tokens else []
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"rows": rows, "steps": steps, "world": world, "device": torch.cuda.get_device_name(),
                       "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version()))}, f)
    comm.close()
    dist.destroy_process_group()


def _quant_static(o, s):
    return (o.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn)


def _quant_token(o):
    s = (o.float().abs().amax(-1, keepdim=True) / 448).clamp_min(torch.finfo(torch.float32).tiny)
    return (o.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn), s


QUANT_STATIC = torch.compile(_quant_static)
QUANT_TOKEN = torch.compile(_quant_token)


def check_fp8(fused, fp8_static, fp8_token, out, q, s_static, s_tok, residual, what):
    """Each FP8 call's bytes within one e4m3 step of the compiled quant of the bf16 call's output
    on the same residual; the per-token scales within 1% of the compiled quant's."""
    def ordinal(t):
        b = t.view(torch.uint8).to(torch.int32)
        return torch.where(b >= 128, -(b & 0x7F), b & 0x7F)

    r0 = residual.clone()
    fused()
    want_static, (want_tok, want_s) = QUANT_STATIC(out, s_static), QUANT_TOKEN(out)
    for name, fn, want in (("static", fp8_static, want_static), ("per-token", fp8_token, want_tok)):
        residual.copy_(r0)
        q.view(torch.uint8).fill_(0x7F)  # NaN until written
        fn()
        torch.cuda.synchronize()
        d = (ordinal(q) - ordinal(want)).abs().max().item()
        assert d <= 1, f"fp8 {name} {what}: {d} e4m3 steps from the compiled quant of the bf16 output"
    e = ((s_tok - want_s).abs() / want_s).max().item()
    assert e < 1e-2, f"fp8 per-token {what}: scales off by {e}"
    residual.copy_(r0)


def decoder_steps(comm, pool, world, rank, a):
    hidden, ffn, layers = 4096, 11008, 16
    g = torch.Generator(device="cuda").manual_seed(11)  # the same weights on every rank
    w = lambda r, c: (torch.randn(r, c, generator=g, device="cuda") / r**0.5).to(torch.bfloat16)  # noqa: E731
    attn = [(w(hidden, hidden // world), w(hidden // world, hidden)) for _ in range(layers)]
    mlp = [(w(hidden, ffn // world), w(ffn // world, hidden)) for _ in range(layers)]
    norms = [(1 + 0.1 * torch.randn(hidden, generator=g, device="cuda")).to(torch.bfloat16) for _ in range(2 * layers)]
    kinds = ["fused", "unfused", "nccl"]
    if a.fp8:
        # The FP8 step: each block's end writes e4m3 (static scale) and the block's first matmul
        # reads it (torch._scaled_mm, tensor-wise scales, weights in e4m3): fused with the FP8
        # output, the bf16 fused call + the compiled quant, NCCL + torch ops + the compiled quant.
        kinds += ["fused_fp8", "unfused_fp8", "nccl_fp8"]
        s_act = torch.full((1,), 0.05, device="cuda")
        s_w = torch.full((1,), 1 / 448 * 4, device="cuda")
        wq = lambda m: (m.float() / s_w).to(torch.float8_e4m3fn).t().contiguous().t()  # noqa: E731 [K, N] column-major
        attn_q = [wq(wa) for wa, _ in attn]
        mlp_q = [wq(w1) for w1, _ in mlp]
    steps = []
    for tokens in a.step_tokens:
        with torch.cuda.use_mem_pool(pool):
            partial = torch.empty(tokens, hidden, dtype=torch.bfloat16, device="cuda")
            summed = torch.empty_like(partial)
            residual = torch.empty_like(partial)
            h = torch.empty_like(partial)
        hq = torch.empty(tokens, hidden, dtype=torch.float8_e4m3fn, device="cuda")
        start_h = torch.randn(tokens, hidden, generator=g, device="cuda").to(torch.bfloat16)
        mm8 = None
        if a.fp8:
            def mm8(x8, w8):
                return torch._scaled_mm(x8, w8, scale_a=s_act, scale_b=s_w, out_dtype=torch.bfloat16)
            try:
                mm8(hq.view(torch.uint8).fill_(0x38).view(torch.float8_e4m3fn), attn_q[0])
                torch.cuda.synchronize()
            except RuntimeError as e:  # a shape _scaled_mm refuses: dequantize, then a bf16 matmul
                if rank == 0:
                    print(f"decoder step, {tokens} tokens: torch._scaled_mm refused ({str(e).splitlines()[0]}); "
                          "the FP8 step dequantizes before a bf16 matmul", flush=True)

                def mm8(x8, w8):
                    return torch.matmul(x8.to(torch.bfloat16) * s_act.to(torch.bfloat16), w8.to(torch.bfloat16)) * s_w

        def block_end(kind, i):
            if kind == "fused":
                comm.all_reduce_add_rms_norm(partial, residual, norms[i], eps=EPS, out=h)
                return
            if kind == "fused_fp8":
                comm.all_reduce_add_rms_norm_fp8(partial, residual, norms[i], scale=s_act, eps=EPS, out=hq)
                return
            if kind == "unfused_fp8":
                comm.all_reduce_add_rms_norm(partial, residual, norms[i], eps=EPS, out=h)
                hq.copy_(QUANT_STATIC(h, s_act))
                return
            if kind == "unfused":
                comm.all_reduce(partial, out=summed)
            else:
                summed.copy_(partial)
                dist.all_reduce(summed)
            residual.add_(summed)
            h.copy_(F.rms_norm(residual, (hidden,), norms[i], EPS))
            if kind == "nccl_fp8":
                hq.copy_(QUANT_STATIC(h, s_act))

        def step(kind):
            fp8 = kind.endswith("_fp8")
            residual.copy_(start_h)
            h.copy_(start_h)
            if fp8:
                hq.copy_(QUANT_STATIC(start_h, s_act))
            for layer in range(layers):
                wa, wb = attn[layer]
                torch.matmul(mm8(hq, attn_q[layer]) if fp8 else torch.matmul(h, wa), wb, out=partial)
                block_end(kind, 2 * layer)
                w1, w2 = mlp[layer]
                torch.matmul(F.gelu(mm8(hq, mlp_q[layer]) if fp8 else torch.matmul(h, w1)), w2, out=partial)
                block_end(kind, 2 * layer + 1)

        results = {}
        for kind in kinds:
            step(kind)
            torch.cuda.synchronize()
            results[kind] = (hq.float() * s_act if kind.endswith("_fp8") else h.float()).clone()
        for kind in kinds[1:]:
            base = "fused_fp8" if kind.endswith("_fp8") else "fused"
            if kind == base:
                continue
            e = ((results[kind] - results[base]).norm() / results[base].norm()).item()
            assert e < 5e-2 if base == "fused" else e < 0.2, f"decoder step, {tokens} tokens: {kind} differs from {base} by {e}"
        if a.fp8:
            e = ((results["fused_fp8"] - results["fused"]).norm() / results["fused"].norm()).item()
            assert results["fused_fp8"].isfinite().all(), f"decoder step, {tokens} tokens: FP8 step not finite"
            if rank == 0:
                print(f"decoder step, {tokens} tokens: FP8 step's output differs from the bf16 step's by {e:.3f} (norm)",
                      flush=True)
        row = {"tokens": tokens}
        for kind in kinds:
            row[kind] = timed(lambda k=kind: step(k), 1, STEP_REPLAYS)
        steps.append(row)
        if rank == 0:
            print(f"decoder step, {tokens} tokens: " + "  ".join(f"{k} {row[k]['p50']:.1f}/{row[k]['p99']:.1f}"
                                                                 for k in kinds), flush=True)
        del partial, summed, residual, h, hq
    return steps


def table(path):
    d = json.load(open(path))
    print(f"\nall-reduce + residual add + RMSNorm, bf16, {d['world']}x {d['device']}, torch {d['torch']}, NCCL {d['nccl']}; "
          f"graphs of {CALLS} calls x {REPLAYS} replays; us per call p50 / p99 / max")
    print(f"{'shape':>13} | {'fused':>20} | {'symm unfused':>20} | {'NCCL unfused':>20} | {'all-reduce alone':>20} | "
          "unfused/fused | fused - AR")
    f3 = lambda v: f"{v['p50']:6.2f} {v['p99']:6.2f} {v['max']:6.1f}"  # noqa: E731
    for r in d["rows"]:
        print(f"[{r['tokens']:>4}, {r['hidden']:>5}] | {f3(r['fused'])} | {f3(r['unfused'])} | {f3(r['nccl'])} | "
              f"{f3(r['all_reduce'])} | {r['unfused']['p50'] / r['fused']['p50']:12.2f}x | {r['fused']['p50'] - r['all_reduce']['p50']:+9.2f}")
    if any("fp8_static" in r for r in d["rows"]):
        print(f"\nFP8 e4m3 output, {d['world']}x {d['device']}; us per call p50 / p99: the fused call with an FP8 output "
              "(static scale; per-token scales) against the bf16 fused call, and the bf16 fused call followed by a "
              "torch.compile'd quant")
        print(f"{'shape':>13} | {'bf16 fused':>13} | {'fp8 static':>13} | {'fp8 per-token':>13} | "
              f"{'bf16 + quant s':>14} | {'bf16 + quant t':>14} | static - bf16 | token - bf16 | speedup s / t")
        f2 = lambda v: f"{v['p50']:6.2f} {v['p99']:6.2f}"  # noqa: E731
        for r in d["rows"]:
            if "fp8_static" not in r:
                continue
            b = r["fused"]["p50"]
            print(f"[{r['tokens']:>4}, {r['hidden']:>5}] | {f2(r['fused'])} | {f2(r['fp8_static'])} | {f2(r['fp8_token'])} | "
                  f"{f2(r['fused_quant_static'])} | {f2(r['fused_quant_token'])} | {r['fp8_static']['p50'] - b:+13.2f} | "
                  f"{r['fp8_token']['p50'] - b:+12.2f} | {r['fused_quant_static']['p50'] / r['fp8_static']['p50']:5.2f}x / "
                  f"{r['fused_quant_token']['p50'] / r['fp8_token']['p50']:.2f}x")
    if d["steps"]:
        print(f"\ndecoder step (16 layers, hidden 4096, 32 collectives, one graph), {STEP_REPLAYS} replays; us per step p50 / p99 / max")
        print(f"{'tokens':>6} | {'fused':>22} | {'symm unfused':>22} | {'NCCL unfused':>22} | unfused/fused | NCCL/fused")
        g3 = lambda v: f"{v['p50']:7.1f} {v['p99']:7.1f} {v['max']:6.0f}"  # noqa: E731
        for r in d["steps"]:
            print(f"{r['tokens']:>6} | {g3(r['fused'])} | {g3(r['unfused'])} | {g3(r['nccl'])} | "
                  f"{r['unfused']['p50'] / r['fused']['p50']:12.2f}x | {r['nccl']['p50'] / r['fused']['p50']:9.2f}x")
        if any("fused_fp8" in r for r in d["steps"]):
            print("\nthe same step with FP8 activations (each block's end writes e4m3, static scale; the next matmul is "
                  "torch._scaled_mm): the fused FP8 output against the bf16 fused call + a compiled quant, and NCCL + "
                  "torch ops + the compiled quant")
            print(f"{'tokens':>6} | {'fused FP8':>22} | {'fused + quant':>22} | {'NCCL + quant':>22} | unfused/fused | NCCL/fused")
            for r in d["steps"]:
                if "fused_fp8" in r:
                    print(f"{r['tokens']:>6} | {g3(r['fused_fp8'])} | {g3(r['unfused_fp8'])} | {g3(r['nccl_fp8'])} | "
                          f"{r['unfused_fp8']['p50'] / r['fused_fp8']['p50']:12.2f}x | "
                          f"{r['nccl_fp8']['p50'] / r['fused_fp8']['p50']:9.2f}x")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    ap.add_argument("--hidden", default="4096,6144,8192")
    ap.add_argument("--tokens", default="1,6,8,32,128,138,512,2048")
    ap.add_argument("--step-tokens", default="1,8,64")
    ap.add_argument("--table-only", action="store_true")
    ap.add_argument("--fp8", action="store_true", help="also time the FP8 outputs (static, per-token) against the bf16 "
                    "fused call followed by a torch.compile'd quant")
    ap.add_argument("--world", type=int, default=0,
                    help="ranks (default: every GPU, at most 8, at least 2); --world 1 times the "
                    "kernels' local work alone on one GPU (no NVLink traffic)")
    a = ap.parse_args()
    a.hidden = [int(v) for v in a.hidden.split(",") if v]
    a.tokens = [int(v) for v in a.tokens.split(",") if v]
    a.step_tokens = [int(v) for v in a.step_tokens.split(",") if v]
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "fused.json")
    if not a.table_only:
        for k, v in [("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")]:
            os.environ[k] = v  # multicast stays off
        os.environ.pop("SYMMALLOC_ENABLE_MULTICAST", None)
        gpus = torch.cuda.device_count()
        world = a.world or min(gpus, 8)
        if world > gpus or (world < 2 and not a.world):
            sys.exit(f"needs {'>= 2' if not a.world else world} GPUs, found {gpus}")
        mp.spawn(worker, args=(world, 29581, a, path), nprocs=world)
    table(path)


if __name__ == "__main__":
    main()
