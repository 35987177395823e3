"""More than one node: ``HierCommunicator``, symmalloc inside each host and ``torch.distributed``
(NCCL on GPUs, gloo on the host backend) between hosts. symmalloc never carries inter-node
traffic itself.

Made from a group that spans hosts (``HierCommunicator.from_process_group(pg)``, or
``symmalloc.from_process_group(pg)``, which returns a plain ``Communicator`` when the group is
on one host):

- the ranks' hosts, devices and fresh ids are exchanged over the group's store first
  (``_hosts.py``), so a rank without its GPU, hosts with different rank counts, or settings
  that differ are reported on every rank, by name, before anything waits;
- each host's ranks get one node-local ``Communicator`` (id made by the host's lowest rank);
- the ranks of one local index across hosts get one group, ``dist.new_group(ranks,
  use_local_synchronization=True)`` from ``pg``'s ranks (only its members call it: the default
  group and ``pg`` are left alone);
- each call takes the path ``HierCost`` (hier_cost.py) picks for its size: ``small``,
  ``sliced`` or ``flat`` (``pg``'s own collective).

Layout: node j is the j-th host in order of its lowest group rank, local index l a rank's
position among its host's ranks. Reduce-scatter and all-gather need each host's ranks to be
contiguous in the group (torchrun's layout) for the sliced and small paths; other layouts
take the flat path for those two (all-reduce and the fused call do not care). Every host must
have the same number of ranks: an uneven split (3 + 1) is refused, on every rank, with the
ranks of each host. One rank per host has nothing to do inside a host: every call is the
group's own collective.

Determinism: every rank gets the same bits from a call, given that the inter-node collective
gives every member the same bits (NCCL's ring and tree all-reduces do; gloo's too). The small
all-reduce runs the inter-node step first, then the node-local one, so that the node-local
kernel (rank order, fp32) adds identical inputs on every host. The bits depend on the path
(and so on the size), the node count and NCCL's algorithm; the inter-node sum is in the dtype
(one rounding at the host boundary that a single-node call does not have).

Errors: a node-local failure keeps the library's status and adds which group ranks the local
ranks are; an inter-node failure becomes SYMM_ERR_PEER naming the group ranks of that step."""

import ctypes
from typing import Optional

from . import _hosts
from ._checks import _check_gather, _check_op, _check_rms_norm, _dtype_code
from ._lib import _ALGOS, SymmallocError, _invalid
from ._registry import register
from .comm import Communicator
from .hier_cost import COLLECTIVES, PATHS, HierCost

__all__ = ["HierCommunicator", "HierCost", "from_process_group"]

_DIST_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN"}


def from_process_group(pg=None, device: Optional[int] = None, **kwargs):
    """A ``Communicator`` when ``pg`` is on one host, else a ``HierCommunicator`` (``kwargs``
    go to ``HierCommunicator.from_process_group``). Collective over ``pg``."""
    return HierCommunicator.from_process_group(pg, device, _single=True, **kwargs)


class HierCommunicator:
    """A communicator over ranks on several hosts; the collectives and the handle of
    ``Communicator`` (so ``symmalloc.ops`` takes it as is). Make it with ``from_process_group``.

    Attributes: ``rank``, ``world_size`` (in ``pg``), ``device``, ``nodes``, ``local_size``,
    ``node`` and ``local_rank`` (this rank's node and local index), ``hosts`` (names, by node),
    ``local`` (the node-local ``Communicator``; None with one rank per host), ``cross`` (the
    inter-node group of this local index; None on one host), ``pg``, ``cost`` and ``path``
    (``"auto"``: the model's choice per call; ``"small"``, ``"sliced"`` or ``"flat"`` forces one,
    for tests and experiments; must be equal on every rank, like any argument of a collective)."""

    _closed_by: Optional[str] = None
    handle = 0

    @classmethod
    def from_process_group(cls, pg=None, device: Optional[int] = None, *, inter_backend: Optional[str] = None,
                           cost: Optional[HierCost] = None, path: str = "auto", timeout_s: float = 300.0,
                           _single: bool = False):
        """Collective over ``pg`` (default: the world group). ``device``: this rank's GPU (default
        the current CUDA device; ignored on the host backend). ``inter_backend``: of the
        inter-node groups (default ``"nccl"``, ``"gloo"`` on the host backend; ``"gloo"`` also
        lets ranks that share a GPU be "nodes", for tests). ``cost``: the model that picks the
        path (default ``HierCost()``). ``timeout_s``: how long to wait for the group's ranks at
        the exchange."""
        import torch.distributed as dist

        self = cls.__new__(cls)
        self._comm = ctypes.c_void_p()  # the registry's liveness mark (_registry.communicator)
        self.local = self.cross = None
        cost = HierCost() if cost is None else cost
        if not isinstance(cost, HierCost):
            raise _invalid(f"cost {cost!r} is not a symmalloc.HierCost")
        if path != "auto" and path not in PATHS:
            raise _invalid(f"path {path!r} unknown; expected auto or one of {list(PATHS)}")
        group, rank, world = _hosts.process_group(pg)
        host = _hosts.host_backend()
        if inter_backend is None:
            inter_backend = "gloo" if host else "nccl"
        device, problem = _hosts.device_problem(device, rank)
        what = "HierCommunicator.from_process_group"
        settings = {"cost": list(cost.key()), "path": path, "inter_backend": inter_backend}
        ranks = _hosts.exchange(group, rank, world, device, problem, settings, timeout_s, what)
        _hosts.check_devices(ranks, what)
        for r in ranks:
            if r.extra != settings:
                raise _invalid(f"{what}: group rank {r.rank} has {r.extra}, group rank {rank} {settings}; "
                               "pass the same cost, path and inter_backend on every rank")
        hosts = _hosts.by_host(ranks)
        if _single and len(hosts) == 1:
            return Communicator(rank, world, ranks[0].uid, device=device)
        sizes = {len(rs) for rs in hosts.values()}
        if len(sizes) > 1:
            raise _invalid(
                f"{what}: the hosts have different numbers of ranks ({_hosts.describe_hosts(hosts)}); "
                "a HierCommunicator needs the same number on every host (an uneven split is refused, "
                "not handled: use the group's own collectives, or a group with equal hosts)")
        members = list(hosts.values())
        self.pg, self.cost, self.path = group, cost, path
        self.rank, self.world_size, self.device = rank, world, device
        self.nodes, self.local_size = len(members), len(members[0])
        self.node = next(j for j, rs in enumerate(members) if rank in rs)
        self.local_rank = members[self.node].index(rank)
        self.hosts = [h.name for h in hosts]
        self._members = members
        self._node_major = all(rs == list(range(j * self.local_size, (j + 1) * self.local_size))
                               for j, rs in enumerate(members))
        self._tensor_device = -1 if host else device
        self._plans = {}
        self._gloo_groups = {}
        # Node-local communicators, then the inter-node groups; a failure on any rank is
        # reported on every rank (a second exchange), so no host is left half made.
        problem = None
        try:
            if self.local_size > 1:
                leader = ranks[members[self.node][0]]
                self.local = Communicator(self.local_rank, self.local_size, leader.uid, device=device)
        except SymmallocError as e:
            problem = f"its node-local communicator failed: {e}"
        agreed = _hosts.exchange(group, rank, world, device, problem, {}, timeout_s, what + " (node-local)")
        failed = [f"group rank {r.rank} on host {r.host.describe()}: {r.problem}" for r in agreed if r.problem]
        if failed:
            self.close()
            raise _invalid(f"{what}: " + "; ".join(failed))
        if self.local_size == 1:
            self.cross = group  # nothing inside a host: every call is the group's own
        elif self.nodes > 1:
            globals_ = [dist.get_global_rank(group, rs[self.local_rank]) for rs in members]
            self.cross = dist.new_group(globals_, backend=inter_backend, use_local_synchronization=True)
        if self.cross is not None:
            # NCCL makes its communicator at a group's first call, which must not be inside a
            # CUDA-graph capture: make it now (and meet the group's problems here, not later).
            try:
                self._net_probe("the inter-node group's first call")
            except SymmallocError:
                self.close()
                raise
        self.handle = register(self)
        self._comm = ctypes.c_void_p(1)
        return self

    # ---- helpers ---------------------------------------------------------------------------

    def _closed_message(self) -> str:
        return (f"this HierCommunicator (rank {getattr(self, 'rank', '?')} of {getattr(self, 'world_size', '?')}) "
                f"was closed by {self._closed_by or 'close()'}; make a new one")

    def _live(self) -> None:
        if not self._comm.value:
            raise _invalid(self._closed_message())

    def plan(self, coll: str, nbytes: int) -> str:
        """The path a call of ``coll`` over ``nbytes`` takes (see ``HierCost``)."""
        if coll not in COLLECTIVES:
            raise _invalid(f"collective {coll!r} unknown; expected one of {list(COLLECTIVES)}")
        key = (coll, nbytes, self.path)
        p = self._plans.get(key)
        if p is None:
            if self.local_size == 1:
                p = "flat"
            elif self.nodes == 1:
                p = "small"
            elif self.path != "auto":
                p = self.path
            else:
                p = self.cost.choose(coll, nbytes, self.nodes, self.local_size)
            if coll in ("reduce_scatter", "all_gather") and not self._node_major:
                p = "flat"  # the blocks of a host are not contiguous: the group's own order
            self._plans[key] = p
        return p

    def _local_ranks(self) -> str:
        return (f"[node-local ranks 0..{self.local_size - 1} of host '{self.hosts[self.node]}' are group ranks "
                f"{self._members[self.node]}; this is group rank {self.rank}]")

    def _step(self, what: str, fn, *args, **kwargs):
        """A node-local step, its error naming the group ranks."""
        try:
            return fn(*args, **kwargs)
        except SymmallocError as e:
            raise SymmallocError(e.status, f"{e} {self._local_ranks()} ({what})") from None

    def _net(self, what: str, fn, *args, group=None, **kwargs) -> None:
        """An inter-node (or flat) step; a failure becomes SYMM_ERR_PEER naming its ranks."""
        group = self.cross if group is None else group
        try:
            if args and args[0].get_device() >= 0 and self._gloo(group):
                # gloo takes CUDA tensors in all_reduce only (and not every dtype): through
                # host memory, for tests where ranks that share a GPU act as hosts.
                host = [a.cpu() for a in args]
                fn(*host, group=group, **kwargs)
                args[0].copy_(host[0])
            else:
                fn(*args, group=group, **kwargs)
        except Exception as e:
            if group is self.pg:
                who = f"the group's {self.world_size} ranks"
            else:
                who = f"group ranks {[rs[self.local_rank] for rs in self._members]} (local index {self.local_rank} of every host)"
            raise SymmallocError("SYMM_ERR_PEER", f"{what} over {who} failed: {type(e).__name__}: {e}") from None

    def _net_probe(self, what: str) -> None:
        """A one-element all-reduce over the inter-node group on this rank's device (the host
        backend: the CPU): the group's first call, and its barrier over NCCL."""
        import torch
        import torch.distributed as dist

        device = "cpu" if self._tensor_device < 0 else f"cuda:{self._tensor_device}"
        self._net(what, dist.all_reduce, torch.zeros(1, device=device))

    def _gloo(self, group) -> bool:
        """Whether ``group`` runs CUDA tensors' collectives on gloo (cached per group)."""
        g = self._gloo_groups.get(id(group))
        if g is None:
            import torch.distributed as dist

            b = str(dist.get_backend(group)).lower()
            g = self._gloo_groups[id(group)] = "gloo" in b and "nccl" not in b
        return g

    def _dist_op(self, op: str):
        import torch.distributed as dist

        _check_op(op)
        return getattr(dist.ReduceOp, _DIST_OPS["sum" if op is None else op])

    def _check(self, what: str, *tensors) -> int:
        self._live()
        code = _dtype_code(tensors[0].dtype)
        if code is None or any(t.dtype != tensors[0].dtype for t in tensors):
            raise _invalid(f"{what}: dtypes {', '.join(str(t.dtype) for t in tensors)}: expected one of bfloat16, float16, float32 for all")
        if not all(t.is_contiguous() for t in tensors):
            raise _invalid(f"{what}: every tensor must be contiguous")
        for t in tensors:
            if t.get_device() != self._tensor_device:
                where = "cpu" if self._tensor_device < 0 else f"cuda:{self._tensor_device}"
                raise _invalid(f"{what}: a tensor is on {t.device}; this communicator's tensors are on {where}")
        return code

    # ---- collectives -----------------------------------------------------------------------

    def all_reduce(self, tensor, op: str = "sum", algo: str = "auto", out=None) -> None:
        """All-reduce over every rank of ``pg``: in place, or into ``out`` (same dtype and element
        count). ``algo`` names the node-local all-reduce's kernel on the small path."""
        self._check("all_reduce", tensor, *(() if out is None else (out,)))
        if out is not None and out.numel() != tensor.numel():
            raise _invalid("all_reduce: out must be contiguous with the tensor's dtype and size")
        if (algo or "auto") not in _ALGOS:
            raise _invalid(f"all_reduce: algo {algo!r} unknown; algos {list(_ALGOS)}")
        self._all_reduce(tensor, op, algo, out, self.plan("all_reduce", tensor.numel() * tensor.element_size()))

    def _all_reduce(self, tensor, op, algo, out, path) -> None:
        """The all-reduce over a checked ``tensor`` (and ``out``) by ``path``."""
        import torch.distributed as dist

        dop = self._dist_op(op)
        n = tensor.numel()
        if n == 0:
            return
        dst = tensor if out is None else out
        src_f, dst_f = tensor.view(-1), dst.view(-1)
        L, l = self.local_size, self.local_rank
        m = n // L
        if path == "sliced" and m > 0:
            mine = dst_f[l * m:(l + 1) * m]
            self._step("node-local reduce-scatter of the all-reduce", self.local.reduce_scatter, mine, src_f[:m * L], op=op)
            self._net("inter-node all-reduce of the slice", dist.all_reduce, mine, op=dop)
            self._step("node-local all-gather of the all-reduce", self.local.all_gather, dst_f[:m * L], mine)
            if m * L == n:
                return
            src_f, dst_f = src_f[m * L:], dst_f[m * L:]  # the last n % L elements: the small path
            path = "small"
        if dst_f.data_ptr() != src_f.data_ptr():
            dst_f.copy_(src_f)
        if path == "flat":
            self._net("all-reduce", dist.all_reduce, dst_f, op=dop, group=self.pg)
            return
        if self.cross is not None:  # the inter-node step first: see "Determinism" above
            self._net("inter-node all-reduce", dist.all_reduce, dst_f, op=dop)
        self._step("node-local all-reduce", self.local.all_reduce, dst_f, op=op, algo=algo)

    def reduce_scatter(self, out, inp, op: str = "sum") -> None:
        """Rank r's ``out`` gets elements [r * n, (r + 1) * n) of the reduction of every rank's
        ``inp`` (n = out.numel()), r the rank in ``pg``; shapes as ``Communicator.reduce_scatter``."""
        import torch.distributed as dist

        self._check("reduce_scatter", out, inp)
        _check_gather("reduce_scatter", tuple(out.shape), tuple(inp.shape), self.world_size)
        dop = self._dist_op(op)
        m = out.numel()
        if m == 0:
            return
        o, x = out.view(-1), inp.view(-1)
        N, L = self.nodes, self.local_size
        path = self.plan("reduce_scatter", inp.numel() * inp.element_size())
        if path == "flat":
            self._net("reduce-scatter", dist.reduce_scatter_tensor, o, x, op=dop, group=self.pg)
        elif path == "sliced":  # node-local first: 1/L of the input crosses the network
            tmp = x.new_empty(N * m) if N > 1 else o
            for j in range(N):  # node j's ranks' blocks: one node-local reduce-scatter each
                self._step("node-local reduce-scatter", self.local.reduce_scatter,
                           tmp[j * m:(j + 1) * m], x[j * L * m:(j + 1) * L * m], op=op)
            if N > 1:
                self._net("inter-node reduce-scatter", dist.reduce_scatter_tensor, o, tmp, op=dop)
        else:  # inter-node first: this node's blocks, summed over nodes, then one local call
            tmp = x
            if N > 1:
                tmp = x.new_empty(L * m)
                self._net("inter-node reduce-scatter", dist.reduce_scatter_tensor, tmp, x, op=dop)
            self._step("node-local reduce-scatter", self.local.reduce_scatter, o, tmp, op=op)

    def all_gather(self, out, inp) -> None:
        """Every rank's ``inp`` lands at r * inp.numel() of ``out``, r the rank in ``pg``; shapes
        as ``Communicator.all_gather``."""
        import torch.distributed as dist

        self._check("all_gather", out, inp)
        _check_gather("all_gather", tuple(inp.shape), tuple(out.shape), self.world_size)
        m = inp.numel()
        if m == 0:
            return
        o, x = out.view(-1), inp.view(-1)
        N, L = self.nodes, self.local_size
        path = self.plan("all_gather", out.numel() * out.element_size())
        if path == "flat":
            self._net("all-gather", dist.all_gather_into_tensor, o, x, group=self.pg)
        elif path == "sliced":  # inter-node first: each rank's block crosses the network once
            tmp = x
            if N > 1:
                tmp = x.new_empty(N * m)
                self._net("inter-node all-gather", dist.all_gather_into_tensor, tmp, x)
            for j in range(N):
                self._step("node-local all-gather", self.local.all_gather,
                           o[j * L * m:(j + 1) * L * m], tmp[j * m:(j + 1) * m])
        else:  # node-local first, then this node's blocks to every node
            tmp = x.new_empty(L * m) if N > 1 else o
            self._step("node-local all-gather", self.local.all_gather, tmp, x)
            if N > 1:
                self._net("inter-node all-gather", dist.all_gather_into_tensor, o, tmp)

    def all_reduce_add_rms_norm(self, x, residual, weight, eps: float = 1e-6, out=None):
        """``residual += allreduce(x)`` over every rank of ``pg``, then returns ``out =
        rms_norm(residual) * weight``, as ``Communicator.all_reduce_add_rms_norm`` (bf16/fp16).
        Small path: the inter-node all-reduce of x, then the node-local fused kernel. Sliced and
        flat: the all-reduce of that path, then the add and the norm in torch, in fp32 like the
        kernel. Either way the inter-node sum is rounded to the dtype once."""
        _check_rms_norm(tuple(x.shape), tuple(residual.shape), tuple(weight.shape),
                        None if out is None else tuple(out.shape), eps)
        self._check("all_reduce_add_rms_norm", x, residual, weight, *(() if out is None else (out,)))
        if x.element_size() != 2:
            raise _invalid(f"all_reduce_add_rms_norm: dtype {x.dtype}: expected bfloat16 or float16")
        path = self.plan("all_reduce_add_rms_norm", x.numel() * x.element_size())
        if path == "small" and self.local is not None:
            t = x.clone()
            if self.cross is not None:
                import torch.distributed as dist

                self._net("inter-node all-reduce of the fused call", dist.all_reduce, t.view(-1), op=self._dist_op("sum"))
            return self._step("node-local all-reduce + RMSNorm", self.local.all_reduce_add_rms_norm,
                              t, residual, weight, eps=eps, out=out)
        t = x.new_empty(x.shape)
        self._all_reduce(x, "sum", "auto", t, path)
        r = t.float() + residual.float()
        residual.copy_(r)
        import torch

        y = (r * torch.rsqrt(r.square().mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
        if out is None:
            return y
        out.copy_(y)
        return out

    def barrier(self) -> None:
        """Every rank of ``pg`` meets (host-side, and on the current stream for the node-local
        part)."""
        import torch.distributed as dist

        self._live()
        if self.local is not None:
            self._step("node-local barrier", self.local.barrier)
        if self.cross is not None:
            if self._tensor_device >= 0 and not self._gloo(self.cross):
                # NCCL: a one-element all-reduce on this rank's device, then the host waits for
                # it (dist.barrier picks its device itself; this one passed on 2x H200 in
                # test_hier's NCCL case, groups over GPUs 0, 1 and 1, 0, 2026-11-27).
                import torch

                self._net_probe("inter-node barrier")
                torch.cuda.current_stream(self._tensor_device).synchronize()
            else:
                self._net("inter-node barrier", dist.barrier)
        if self.local is not None:
            self._step("node-local barrier", self.local.barrier)

    def close(self) -> None:
        """Destroys the node-local communicator and the inter-node group (every rank should
        close its own). Later calls raise; closing twice does nothing.

        Release the CUDA graphs that captured this communicator's calls first (a
        ``torch.compile(mode="reduce-overhead")`` function: ``torch._dynamo.reset()``): with
        them alive, destroying an NCCL inter-node group never returned (2x H200, torch 2.11,
        NCCL 2.28.9, 2026-11-27; NCCL waits on the work they hold)."""
        self._close("close()")

    def _close(self, by: str) -> None:
        self._comm = ctypes.c_void_p()
        if self._closed_by is None and self.handle:
            self._closed_by = by
        if self.local is not None:
            self.local._close(by)
        if by == "close()" and self.cross is not None and self.cross is not getattr(self, "pg", None):
            import torch.distributed as dist

            try:
                dist.destroy_process_group(self.cross)
            except Exception:
                pass
        self.cross = None

    def __del__(self):
        try:
            self._close("garbage collection")
        except Exception:
            pass

    def __repr__(self) -> str:
        return (f"HierCommunicator(rank {getattr(self, 'rank', '?')} of {getattr(self, 'world_size', '?')}: "
                f"{getattr(self, 'nodes', '?')} hosts x {getattr(self, 'local_size', '?')} ranks, node "
                f"{getattr(self, 'node', '?')} local rank {getattr(self, 'local_rank', '?')}, path {getattr(self, 'path', '?')})")

