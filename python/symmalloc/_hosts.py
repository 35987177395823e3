"""Who runs where: each rank's host identity, its device and a fresh unique id, exchanged over a
``torch.distributed`` group's store before any communicator is made.

A rank's host is what the library stamps into a fresh unique id (bytes 56..128: a 16-byte
digest of the boot id and network namespace, or of ``SYMMALLOC_HOST_ID``, then the host name;
src/ipc/unique_id.rs keeps that layout), so Python and the library agree on it by
construction. The exchange goes through the default store (torchrun's TCP store) rather than a
collective of the group: a rank whose GPU is missing could not take part in an NCCL collective,
and this way every rank learns that, by name, instead of waiting for it.

Invariant: every rank of the group calls ``exchange`` the same number of times in the same
order (as with any collective); each call has its own keys, deleted by the last rank to read.

``node_local_id`` is that exchange for ``Communicator.from_process_group`` (one host);
``HierCommunicator`` (hier.py) runs it over several."""

import collections
import datetime
import itertools
import json
import os
from typing import Dict, List, NamedTuple, Optional

from ._lib import SymmallocError, _invalid, get_unique_id

_HOST_OFFSET = 56
_CALLS: Dict[str, "itertools.count[int]"] = collections.defaultdict(itertools.count)


class Host(NamedTuple):
    digest: str  # hex of the 16-byte digest ("" for an id that records no host)
    name: str

    def describe(self) -> str:
        return f"'{self.name}' [{self.digest[:8]}]" if self.digest else "an unrecorded host"


def host_of(uid: bytes) -> Host:
    """The host recorded in a unique id made by this library."""
    if uid[:8] != b"SYMMID02":
        return Host("", "")
    stamp = uid[_HOST_OFFSET:]
    n = stamp[16]
    return Host(stamp[:16].hex(), stamp[17:17 + n].decode("utf-8", "replace"))


def host_backend() -> bool:
    """The host backend (CPU tensors over memfd), as ``Communicator`` decides it."""
    return os.environ.get("SYMMALLOC_BACKEND") == "host"


def device_problem(device: Optional[int], group_rank: int):
    """(device, None) when this rank can use its device, else (device, the reason). On the host
    backend there is no device to check and the device defaults to the global rank."""
    if host_backend():
        # The process's own device: its global rank, the same for every group of the process
        # (a subgroup's rank would put the process on another device than its other groups,
        # which the library refuses) and distinct between the processes of a host.
        if device is None:
            import torch.distributed as dist

            device = dist.get_rank()
        return int(device), None
    import torch

    if not torch.cuda.is_available():
        return (-1 if device is None else int(device)), "no CUDA device is visible (torch.cuda.is_available() is False)"
    count = torch.cuda.device_count()
    if device is None:
        device = torch.cuda.current_device()
    if not 0 <= int(device) < count:
        return int(device), f"device {device} does not exist (this process sees {count} GPU(s))"
    return int(device), None


class Rank(NamedTuple):
    rank: int  # in the group
    host: Host
    uid: bytes
    device: int
    problem: Optional[str]
    extra: dict


def exchange(group, rank: int, world: int, device: int, problem: Optional[str], extra: dict,
             timeout_s: float, what: str) -> List[Rank]:
    """Every rank's record, in group rank order, through the default store."""
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    name = getattr(group, "group_name", None) or str(id(group))
    base = f"symmalloc/{what}/{name}/{next(_CALLS[name])}"
    uid = get_unique_id()
    mine = {"uid": uid.hex(), "device": device, "problem": problem, "extra": extra}
    store.set(f"{base}/{rank}", json.dumps(mine))
    keys = [f"{base}/{r}" for r in range(world)]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except Exception as e:  # a rank of the group never came: name the ones missing
        missing = [r for r in range(world) if not store.check([keys[r]])]
        raise SymmallocError(
            "SYMM_ERR_TIMEOUT",
            f"{what}: group rank(s) {missing} did not reach the host exchange within {timeout_s:g} s "
            f"(every rank of the group must call it): {e}") from None
    out = []
    for r in range(world):
        d = json.loads(store.get(keys[r]))
        u = bytes.fromhex(d["uid"])
        out.append(Rank(r, host_of(u), u, int(d["device"]), d["problem"], d["extra"]))
    if store.add(f"{base}/read", 1) == world:  # the last reader cleans up
        for k in keys + [f"{base}/read"]:
            try:
                store.delete_key(k)
            except Exception:
                pass
    return out


def check_devices(ranks: List[Rank], what: str) -> None:
    """Raises on every rank when any rank cannot use its device, naming each."""
    bad = [f"group rank {r.rank} on host {r.host.describe()}: {r.problem}" for r in ranks if r.problem]
    if bad:
        raise _invalid(f"{what}: every rank of the group needs its GPU, and " + "; ".join(bad))


def by_host(ranks: List[Rank]) -> "collections.OrderedDict[Host, List[int]]":
    """Group ranks per host, hosts in the order of their lowest group rank."""
    hosts: "collections.OrderedDict[Host, List[int]]" = collections.OrderedDict()
    for r in ranks:
        hosts.setdefault(r.host, []).append(r.rank)
    return hosts


def describe_hosts(hosts) -> str:
    return "; ".join(f"host {h.describe()}: group rank(s) {_ranges(rs)}" for h, rs in hosts.items())


def process_group(pg):
    """(``pg`` or the world group, this rank in it, its size); raises when torch.distributed is not
    initialized or this process is not a member."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise _invalid("from_process_group needs an initialized torch.distributed process group (call init_process_group first)")
    group = pg if pg is not None else dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise _invalid("this process is not a member of the given process group")
    return group, rank, world


def node_local_id(pg, device, timeout_s: float = 300.0):
    """For ``Communicator.from_process_group``: (group rank, world, the id of group rank 0,
    device), after checking over the group's store that every rank is on one host and can use
    its device (raised on every rank otherwise)."""
    group, rank, world = process_group(pg)
    device, problem = device_problem(device, rank)
    ranks = exchange(group, rank, world, device, problem, {}, timeout_s, "from_process_group")
    check_devices(ranks, "from_process_group")
    hosts = by_host(ranks)
    if len(hosts) > 1:
        raise _invalid(
            f"from_process_group: the group spans {len(hosts)} hosts ({describe_hosts(hosts)}); "
            "a Communicator joins the ranks of one host. Use symmalloc.HierCommunicator.from_process_group(pg) "
            "(symmalloc inside each host, torch.distributed between hosts) or symmalloc.from_process_group(pg), "
            "which picks (README, \"Across nodes\")")
    return rank, world, ranks[0].uid, device


def _ranges(rs: List[int]) -> str:
    parts, start = [], None
    for i, r in enumerate(rs):
        if start is None:
            start = r
        if i + 1 == len(rs) or rs[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(parts)
