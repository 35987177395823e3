"""The cost model behind HierCommunicator's default (symmalloc.hier_cost; bench/NOTES.md,
"Across nodes: the cost model") and the host a unique id records (symmalloc._hosts). No torch
needed."""
import os
import subprocess
import sys

import pytest

import symmalloc
from symmalloc import _hosts
from symmalloc.hier_cost import COLLECTIVES, HierCost

HERE = os.path.dirname(os.path.abspath(__file__))


def test_the_default_follows_the_model_at_2_and_4_hosts_of_8():
    c = HierCost()
    for nodes in (2, 4):
        for coll in COLLECTIVES:
            assert c.choose(coll, 8 << 10, nodes, 8) == "small", (coll, nodes)
            # One 400 Gb/s NIC per GPU: NCCL's pipelined algorithms win large messages.
            assert c.choose(coll, 64 << 20, nodes, 8) == "flat", (coll, nodes)
    # A network slow against NVLink (N x L x net < NVLink per GPU): the sliced path wins.
    slow = HierCost(net_gbps=12.5)
    assert slow.choose("all_reduce", 64 << 20, 2, 8) == "sliced"
    assert slow.choose("all_reduce", 64 << 20, 4, 8) == "flat"  # 4 x 8 x 12.5 > 300


def test_crossovers_are_where_the_times_cross():
    c = HierCost()
    x = c.crossovers("all_reduce", 2, 8)
    assert list(x) == ["small", "flat"] and 150 << 10 < x["flat"] < 300 << 10, x
    n = x["flat"]
    t_before, t_at = c.times("all_reduce", int(n / 1.02), 2, 8), c.times("all_reduce", n, 2, 8)
    assert t_before["small"] <= t_before["flat"] and t_at["flat"] <= t_at["small"]


def test_degenerate_shapes_and_bad_names():
    c = HierCost()
    assert c.choose("all_reduce", 1 << 30, 4, 1) == "flat"     # one rank per host
    assert c.choose("all_reduce", 1 << 30, 1, 8) == "small"    # one host
    with pytest.raises(ValueError, match="collective 'broadcast' unknown"):
        c.times("broadcast", 8, 2, 8)
    # Every path's time grows with the size.
    for coll in COLLECTIVES:
        a, b = c.times(coll, 1 << 10, 2, 8), c.times(coll, 1 << 20, 2, 8)
        assert all(b[p] > a[p] for p in a), coll


def _host_of_fresh_id(env):
    code = "import symmalloc; from symmalloc import _hosts; print(_hosts.host_of(symmalloc.get_unique_id()))"
    e = dict(os.environ, **env)
    return subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, cwd=os.path.dirname(HERE))


def test_an_id_records_its_host():
    uid = symmalloc.get_unique_id()
    h = _hosts.host_of(uid)
    assert len(h.digest) == 32 and h.name, h
    r = _host_of_fresh_id({"SYMMALLOC_HOST_ID": "node-7"})
    assert r.returncode == 0 and "name='node-7'" in r.stdout, r.stdout + r.stderr
    other = _host_of_fresh_id({"SYMMALLOC_HOST_ID": "node-8"})
    assert other.stdout.split("digest='")[1][:32] != r.stdout.split("digest='")[1][:32]
    bad = _host_of_fresh_id({"SYMMALLOC_HOST_ID": "node 7"})
    assert bad.returncode != 0 and 'SYMMALLOC_HOST_ID="node 7" is not accepted' in bad.stderr, bad.stderr
