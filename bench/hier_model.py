"""Prints the tables of bench/NOTES.md, "Across nodes: the cost model": bytes per rank on
NVLink and on the network for each path of a HierCommunicator and for NCCL's own algorithms,
the modelled times, and the crossovers the default follows, at 2 and 4 nodes x 8 GPUs.
A model, not a measurement (no multi-node machine was available):
    python bench/hier_model.py [--net-gbps 45] [--nodes 2,4] [--local 8]"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from symmalloc.hier_cost import HierCost  # noqa: E402

SIZES = [8 << 10, 256 << 10, 1 << 20, 16 << 20, 256 << 20]


def size(n):
    for unit, s in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << s:
            return f"{n / (1 << s):g} {unit}"
    return f"{n} B"


def bytes_per_rank(N, L):
    """All-reduce of n bytes: (NVLink, network) bytes each rank sends, as multiples of n."""
    R = N * L
    return {
        "symmalloc small (inter-node AR, then node-local AR)": (2 * (L - 1) / L, 2 * (N - 1) / N),
        "symmalloc sliced (local RS, inter-node AR of n/L, local AG)": (2 * (L - 1) / L, 2 * (N - 1) / N / L),
        "NCCL ring over N x L": (2 * (R - 1) / R * (L - 1) / L, 2 * (R - 1) / R / L),
        "NCCL tree (intra-node chain, inter-node double binary tree)": (2.0, 2 / L),
        "NCCL NVLSTree (multicast RS/AG in the node, tree between nodes)": (2 / L, (2 * (N - 1) / N if N == 2 else 2) / L),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--net-gbps", type=float, default=HierCost.net_gbps)
    ap.add_argument("--nodes", default="2,4")
    ap.add_argument("--local", type=int, default=8)
    a = ap.parse_args()
    cost = HierCost(net_gbps=a.net_gbps)
    L = a.local
    print(f"cost model: {cost}\n")
    for N in (int(x) for x in a.nodes.split(",")):
        print(f"### {N} nodes x {L} GPUs\n")
        print("| all-reduce of n bytes | NVLink bytes per rank | network bytes per rank |")
        print("|---|---|---|")
        for name, (nvl, net) in bytes_per_rank(N, L).items():
            print(f"| {name} | {nvl:.3f} n | {net:.3f} n |")
        print()
        for coll in ("all_reduce", "reduce_scatter", "all_reduce_add_rms_norm"):
            print(f"| {coll} | " + " | ".join(size(n) for n in SIZES) + " |")
            print("|---|" + "---|" * len(SIZES))
            for p in ("small", "sliced", "flat"):
                t = [cost.times(coll, n, N, L)[p] for n in SIZES]
                print(f"| {p} (us) | " + " | ".join(f"{x:.1f}" for x in t) + " |")
            print("| default | " + " | ".join(cost.choose(coll, n, N, L) for n in SIZES) + " |")
            cross = cost.crossovers(coll, N, L)
            print(f"\nfirst size at which each path is chosen: "
                  + ", ".join(f"{p} from {size(n)}" for p, n in cross.items()) + "\n")


if __name__ == "__main__":
    main()
