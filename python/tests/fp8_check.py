"""The fused all-reduce + residual + RMSNorm with an FP8 e4m3 output from Python, run by torchrun
(one process per rank):
    torchrun --nproc_per_node=N python/tests/fp8_check.py
On GPUs (N ranks may share one GPU with SYMMALLOC_SHARED_GPU=1: the reference runs over gloo on
the CPU) or, with SYMMALLOC_BACKEND=host, on CPU tensors over the host backend.

- ``Communicator.all_reduce_add_rms_norm_fp8`` in every mode (static, per-token, per-group 128),
  bf16 and fp16, against a float64 reference converted by torch's float8_e4m3fn cast (every byte
  equal or one e4m3 step apart; a computed scale within 2^-20 of the reference's: the fp32
  RMSNorm differs from float64 by a few ulps), and against the unfused path (the bf16/fp16
  fused call, then torch's quant with the same scale); the residual bit for bit the bf16 call's;
  every rank's bytes the same.
- The custom ops: ``torch.ops.symmalloc.all_reduce_add_rms_norm_fp8`` (mutating) and the
  functional forms, compiled with fullgraph=True (and mode="reduce-overhead" on GPUs) in a
  function that takes the residual as an argument: 0 graph breaks, 0 cudagraph skips, the same
  bits as eager.
- GPUs: a captured graph replayed with a static scale that changes between replays.
Exits non-zero on any failure."""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import symmalloc  # noqa: E402
import symmalloc.ops as sops  # noqa: E402

EPS = 1e-6
FP8 = torch.float8_e4m3fn


def ordinal(q):
    """An e4m3 code's place on the number line (neighbours differ by 1, +-0 are 0)."""
    b = q.view(torch.uint8).to(torch.int32)
    return torch.where(b >= 128, -(b & 0x7F), b & 0x7F)


def within_a_step(what, q, want):
    d = (ordinal(q.cpu()) - ordinal(want.cpu())).abs()
    assert int(d.max()) <= 1, f"{what}: {int((d > 1).sum())} bytes more than one e4m3 step from the reference"
    return int((d == 0).sum()), d.numel()


def quant_ref(y, s):
    """torch's cast of y / s (float64 -> float32, clamped to +-448) to float8_e4m3fn."""
    return (y / s).clamp(-448, 448).float().to(FP8)


def ref_scales(y, group):
    t = y.reshape(-1, y.shape[-1] // group, group)
    return (t.abs().amax(-1) / 448).clamp_min(torch.finfo(torch.float32).tiny)


def same_on_every_rank(what, t):
    b = t.detach().cpu().contiguous().view(torch.uint8).clone()
    other = b.clone()
    dist.broadcast(other, src=0)
    assert torch.equal(b, other), f"{what}: rank {dist.get_rank()} differs from rank 0"


def main():
    host = os.environ.get("SYMMALLOC_BACKEND") == "host"
    cuda = torch.cuda.is_available() and not host
    local = int(os.environ["LOCAL_RANK"])
    if cuda:
        torch.cuda.set_device(local % torch.cuda.device_count())
    dist.init_process_group("gloo")  # the reference: float64 on the CPU (ranks may share a GPU)
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = symmalloc.Communicator.from_process_group()
    dev = "cuda" if cuda else "cpu"
    shapes = [(1, 1024), (3, 4096), (2, 5120), (40, 4096), (1, 8192), (130, 2048)] if cuda else [(1, 256), (3, 1024)]
    equal = total = 0
    for dtype in (torch.bfloat16, torch.float16):
        for tokens, hidden in shapes:
            g = torch.Generator().manual_seed(100 + tokens * hidden)
            xs = [torch.randn(tokens, hidden, generator=g).to(dtype) for _ in range(world)]
            residual = torch.randn(tokens, hidden, generator=g).to(dtype)
            weight = (1 + 0.2 * torch.randn(hidden, generator=g)).to(dtype)
            r = sum(x.double() for x in xs) + residual.double()
            y = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()
            x = xs[rank].to(dev)
            res0, w = residual.to(dev), weight.to(dev)
            plain_res = res0.clone()
            plain = comm.all_reduce_add_rms_norm(x, plain_res, w, eps=EPS)
            for mode in ("static", "per_token", "per_group_128"):
                what = f"{dtype} [{tokens}, {hidden}] {mode}"
                res = res0.clone()
                if mode == "static":
                    s_in = torch.tensor([float(y.abs().max()) / 448 / 1.2], dtype=torch.float32, device=dev)
                    out, s = comm.all_reduce_add_rms_norm_fp8(x, res, w, scale=s_in, eps=EPS)
                    assert s is s_in
                    sref = s.cpu().double().expand(tokens, hidden)
                else:
                    group = hidden if mode == "per_token" else 128
                    out, s = comm.all_reduce_add_rms_norm_fp8(x, res, w, eps=EPS, group_size=None if mode == "per_token" else 128)
                    assert s.dtype == torch.float32 and tuple(s.shape) == (tokens, hidden // group), (what, s.shape)
                    want = ref_scales(y, group)
                    err = ((s.cpu().double() - want).abs() / want).max().item()
                    assert err <= 2.0**-20, f"{what}: scale off by {err} (relative)"
                    sref = s.cpu().double().repeat_interleave(group, dim=-1)
                assert out.dtype == FP8 and out.shape == x.shape
                assert torch.equal(res.view(torch.int16), plain_res.view(torch.int16)), f"{what}: residual differs from the bf16 call's"
                e, n = within_a_step(f"{what} (float64)", out, quant_ref(y, sref))
                equal, total = equal + e, total + n
                within_a_step(f"{what} (unfused)", out, quant_ref(plain.cpu().double(), sref))
                for name, t in (("out", out), ("scale", s), ("residual", res)):
                    same_on_every_rank(f"{what} {name}", t)
    misuse(comm, dev)
    if cuda:
        graph_replays(comm, dev)
    compiled(comm, dev, cuda)
    comm.close()
    print(f"rank {rank}: fp8 ok, {equal} of {total} bytes equal the float64 reference's (the rest one step), "
          f"{world} ranks, {'GPU' if cuda else 'host backend'}", flush=True)
    dist.destroy_process_group()


def misuse(comm, dev):
    """What the Python layer and the library refuse, naming the argument; the communicator stays
    usable (every rank makes the same calls)."""
    x = torch.randn(2, 256).to(dev, torch.bfloat16)
    res, w = torch.zeros_like(x), torch.ones(256, dtype=torch.bfloat16, device=dev)
    cases = [
        (dict(group_size=64), "SYMM_ERR_INVALID_ARGUMENT", "group_size 64"),
        (dict(scale=torch.ones(2, device=dev)), "SYMM_ERR_INVALID_ARGUMENT", "scale has shape [2]"),
        (dict(scale=torch.ones(1, device=dev, dtype=torch.float64)), "SYMM_ERR_INVALID_ARGUMENT", "scale is torch.float64"),
        (dict(scale=torch.ones(1, device=dev), group_size=128), "SYMM_ERR_INVALID_ARGUMENT", "with a static scale"),
        (dict(out=torch.empty(2, 256, device=dev)), "SYMM_ERR_INVALID_ARGUMENT", "expected a contiguous float8_e4m3fn"),
    ]
    for kw, status, words in cases:
        try:
            comm.all_reduce_add_rms_norm_fp8(x, res, w, **kw)
        except symmalloc.SymmallocError as e:
            assert e.status == status and words in str(e), (kw, str(e))
        else:
            raise AssertionError(f"{kw} was accepted")
    try:
        comm.all_reduce_add_rms_norm_fp8(x.float(), res.float(), w.float())
    except symmalloc.SymmallocError as e:
        assert e.status == "SYMM_ERR_UNSUPPORTED" and "fp32 is not supported" in str(e), str(e)
    else:
        raise AssertionError("fp32 was accepted")
    y = torch.randn(2, 136).to(dev, torch.bfloat16)
    try:
        comm.all_reduce_add_rms_norm_fp8(y, torch.zeros_like(y), torch.ones(136, dtype=torch.bfloat16, device=dev), group_size=128)
    except symmalloc.SymmallocError as e:
        assert "hidden 136 is not a multiple of 128" in str(e), str(e)
    else:
        raise AssertionError("hidden 136 with group_size 128 was accepted")
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        q, _ = comm.all_reduce_add_rms_norm_fp8(x, res, w, scale=torch.tensor([bad], device=dev))
        assert bool((q.view(torch.uint8) & 0x7F == 0x7F).all()), f"static scale {bad}: expected all NaN"
    q, s = comm.all_reduce_add_rms_norm_fp8(x, res, w)
    assert not bool(torch.isnan(q.float()).any()), "NaN after the refusals"


def graph_replays(comm, dev):
    """A captured static-scale call replayed with the scale changed between replays."""
    tokens, hidden = 4, 4096
    g = torch.Generator().manual_seed(5)
    world, rank = dist.get_world_size(), dist.get_rank()
    xs = [torch.randn(tokens, hidden, generator=g).to(torch.bfloat16) for _ in range(world)]
    residual = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    weight = torch.ones(hidden, dtype=torch.bfloat16)
    r = sum(x.double() for x in xs) + residual.double()
    y = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + EPS)
    with torch.cuda.use_mem_pool(symmalloc.mem_pool()):
        x = xs[rank].to(dev)
    res, w = residual.to(dev), weight.to(dev)
    scale = torch.ones(1, dtype=torch.float32, device=dev)
    out = torch.empty(tokens, hidden, dtype=FP8, device=dev)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        comm.all_reduce_add_rms_norm_fp8(x, res, w, scale=scale, eps=EPS, out=out)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        comm.all_reduce_add_rms_norm_fp8(x, res, w, scale=scale, eps=EPS, out=out)
    amax = float(y.abs().max())
    for k, f in enumerate((1.0, 0.5, 2.0, 0.25)):
        res.copy_(residual.to(dev))
        scale.fill_(amax / 448 / f)
        graph.replay()
        torch.cuda.synchronize()
        within_a_step(f"replay {k}", out, quant_ref(y, scale.cpu().double()))


def compiled(comm, dev, cuda):
    """The custom ops under torch.compile, the residual an argument of the compiled function."""
    tokens, hidden = 8, 1024
    w = (1 + 0.1 * torch.arange(hidden) / hidden).to(dev, torch.bfloat16)
    sc = torch.full((1,), 0.02, device=dev)

    def functional(x, residual):
        out, r1 = sops.all_reduce_add_rms_norm_functional(x, residual, w, comm, eps=EPS)
        q, s, r2 = sops.all_reduce_add_rms_norm_fp8_functional(x, r1, w, comm, eps=EPS)
        q2, s2, r3 = sops.all_reduce_add_rms_norm_fp8_functional(x, r2, w, comm, scale=sc, eps=EPS)
        q3, s3, _ = sops.all_reduce_add_rms_norm_fp8_functional(x, r3, w, comm, eps=EPS, group_size=128)
        return out, r1, q, s, r2, q2, s2, r3, q3, s3

    def mutating(x, residual):
        res = residual + 0  # a graph-internal residual: the mutating op keeps the graph too
        q, s = sops.all_reduce_add_rms_norm_fp8(x, res, w, comm, eps=EPS)
        return q, s, res

    modes = [("compiled", dict(fullgraph=True))]
    if cuda:
        modes.append(("compiled+cudagraphs", dict(fullgraph=True, mode="reduce-overhead")))
    torch._dynamo.utils.counters.clear()
    for fn in (functional, mutating):
        for mode, kw in modes:
            cfn = torch.compile(fn, **kw)
            for step in range(4):
                g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
                x = torch.randn(tokens, hidden, generator=g).to(dev, torch.bfloat16)
                residual = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(step)).to(dev, torch.bfloat16)
                keep = residual.clone()
                want = fn(x, residual)
                assert torch.equal(residual, keep), f"{fn.__name__} eager mutated its residual argument"
                got = [t.clone() for t in cfn(x, residual)]
                if fn is functional:
                    assert torch.equal(residual, keep), f"{fn.__name__} {mode} mutated its residual argument"
                for i, (a, b) in enumerate(zip(got, want)):
                    assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), \
                        f"{fn.__name__} {mode} step {step}: output {i} differs from eager"
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    assert breaks == 0, dict(torch._dynamo.utils.counters["graph_break"])
    skips = dict(torch._dynamo.utils.counters["inductor"]).get("cudagraph_skips", 0)
    assert skips == 0, f"reduce-overhead skipped CUDA graphs: {dict(torch._dynamo.utils.counters['inductor'])}"
    print(f"rank {dist.get_rank()}: {', '.join(m for m, _ in modes)}: 0 graph breaks, 0 cudagraph skips, "
          "the residual a graph input", flush=True)


if __name__ == "__main__":
    main()
