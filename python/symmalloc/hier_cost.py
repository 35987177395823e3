"""The cost model that picks a path for each call of a ``HierCommunicator`` (bench/NOTES.md,
"Across nodes: the cost model", derives it and tabulates it for 2 and 4 nodes x 8 GPUs).

No multi-node machine was available, so the choice follows this model, not a measurement.
Three paths, for N nodes of L ranks and a message of n bytes (all-reduce: the message;
reduce-scatter: the input; all-gather: the output; the fused call: x):

- ``sliced``: each rank puts 1/L of the message on the network. All-reduce: node-local
  reduce-scatter, inter-node all-reduce of the slice, node-local all-gather; reduce-scatter:
  N node-local reduce-scatters (one per node's block), then an inter-node reduce-scatter;
  all-gather the mirror image. Fewest network bytes; one more node-local launch than
  ``small`` (N more for reduce-scatter and all-gather).
- ``small``: the whole message crosses the network on every rank, with one node-local call.
  All-reduce: inter-node all-reduce, then node-local all-reduce (this order gives every rank
  the same bits, see hier.py); reduce-scatter: inter-node reduce-scatter of the node blocks,
  then one node-local reduce-scatter; all-gather: node-local, then inter-node.
- ``flat``: the group's own collective (NCCL over all N x L ranks: its rings and trees pipeline
  NVLink and network traffic).

Each path's time is a sum of latencies and bytes over bandwidths, the flat one's bandwidth term
a max (NCCL pipelines its steps; this library's steps run one after another). Times in
microseconds; 1 GB/s moves 1000 bytes per microsecond. The defaults describe an H100/H200 node
with NVSwitch and one 400 Gb/s NIC per GPU; they are stated assumptions (see each field), to
be replaced by what a machine measures: pass ``HierCost(net_gbps=..., ...)`` to
``HierCommunicator.from_process_group``."""

from dataclasses import astuple, dataclass
from typing import Dict, Tuple

PATHS = ("small", "sliced", "flat")
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_reduce_add_rms_norm")


@dataclass(frozen=True)
class HierCost:
    #: one node-local symmalloc call: launch + NVLink trip (measured 3.1 us graphed at 2 ranks
    #: on H200, bench/RESULTS.md; 5 assumed for 8 ranks and eager calls)
    local_us: float = 5.0
    #: one NCCL call among one rank per node (assumed: inter-node latency over InfiniBand plus
    #: NCCL's proxy)
    net_us: float = 15.0
    #: one NCCL call over every rank of the group (assumed: net_us plus NCCL's intra-node hops)
    flat_us: float = 25.0
    #: the fused call's residual add and RMSNorm in torch on the sliced and flat paths
    torch_us: float = 10.0
    #: per GPU, SM-driven NVLink collectives (measured: SM stores top out at 358 GB/s on H200,
    #: bench/NOTES.md; the two-shot moves 64 MiB in 214 us at 2 ranks)
    nvlink_gbps: float = 300.0
    #: per GPU, inter-node (one 400 Gb/s NIC per GPU at 90 %)
    net_gbps: float = 45.0

    def key(self) -> Tuple[float, ...]:
        return astuple(self)

    def times(self, coll: str, nbytes: int, nodes: int, local: int) -> Dict[str, float]:
        """Each path's modelled time in microseconds."""
        if coll not in COLLECTIVES:
            raise ValueError(f"collective {coll!r} unknown; expected one of {COLLECTIVES}")
        n, N, L = float(nbytes), nodes, local
        bl, bn = self.nvlink_gbps * 1e3, self.net_gbps * 1e3  # bytes per microsecond
        lfrac, nfrac = (L - 1) / L, (N - 1) / N  # the share of a vector a ring step moves
        wfrac = (N * L - 1) / (N * L)
        if coll in ("all_reduce", "all_reduce_add_rms_norm"):
            t = {
                "small": self.net_us + 2 * nfrac * n / bn + self.local_us + 2 * lfrac * n / bl,
                "sliced": 2 * self.local_us + 2 * lfrac * n / bl + self.net_us + 2 * nfrac * (n / L) / bn,
                "flat": self.flat_us + max(2 * wfrac * n / (L * bn), 2 * lfrac * n / bl),
            }
            if coll == "all_reduce_add_rms_norm":  # the small path's last step is the fused kernel
                t["sliced"] += self.torch_us
                t["flat"] += self.torch_us
            return t
        # reduce-scatter (n: input bytes) and all-gather (n: output bytes) mirror each other
        return {
            "small": self.net_us + nfrac * n / bn + self.local_us + lfrac * (n / N) / bl,
            "sliced": N * self.local_us + lfrac * n / bl + self.net_us + nfrac * (n / L) / bn,
            "flat": self.flat_us + max(wfrac * n / (L * bn), lfrac * n / bl),
        }

    def choose(self, coll: str, nbytes: int, nodes: int, local: int) -> str:
        """The cheapest path (``small`` first on ties, then ``sliced``). One rank per node has
        nothing to do inside a node: always ``flat``; one node has no network: ``small``
        (which then is the node-local call alone)."""
        if local == 1:
            return "flat"
        if nodes == 1:
            return "small"
        t = self.times(coll, nbytes, nodes, local)
        return min(PATHS, key=lambda p: (t[p], PATHS.index(p)))

    def crossovers(self, coll: str, nodes: int, local: int, hi: int = 1 << 34) -> Dict[str, int]:
        """Where each path is first chosen, scanning sizes in steps of 1 % from 1 byte to
        ``hi``: {path: bytes} (for the docs and tests)."""
        out: Dict[str, int] = {}
        n = 1
        while n <= hi:
            out.setdefault(self.choose(coll, n, nodes, local), n)
            n = int(n * 1.01) + 1
        return out
