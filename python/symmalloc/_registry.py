"""The handle registry: every live ``Communicator`` and ``HierCommunicator`` of the process under
the int ``handle`` by which the custom ops (``symmalloc.ops``) and the compiled eager caller name
it. Held weakly: a collected communicator leaves the registry by itself."""

import itertools
import weakref

from ._lib import _invalid

_COMMS: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)
# handle -> world size, for world_of (a plain dict: Dynamo traces a lookup in it, not one in the
# weak dictionary). Handles are never reused, and an int per communicator ever made is kept.
_WORLDS: "dict[int, int]" = {}


def register(comm) -> int:
    """A fresh handle for ``comm``, which the registry holds weakly from now on."""
    handle = next(_HANDLES)
    _COMMS[handle] = comm
    _WORLDS[handle] = comm.world_size
    return handle


def communicator(handle: int):
    """The live communicator behind ``Communicator.handle`` (the int the custom ops take)."""
    comm = _COMMS.get(handle)
    if comm is None:
        raise _invalid(f"communicator handle {handle} is not a live Communicator of this process (closed and collected, or never made)")
    if not comm._comm.value:
        raise _invalid(f"communicator handle {handle} is not a live Communicator: {comm._closed_message()}")
    return comm


# The custom ops whose results' shapes depend on the world size (reduce_scatter, all_gather and
# async TP's) take it as an argument next to the handle: a constant of the traced graph, so that a
# graph compiled at one world size is never replayed from torch's on-disk caches (keyed by the
# graph) at another, which the handle, a number per process, does not tell apart.

def world_of(comm) -> int:
    """The world size of ``comm`` (a communicator, or its handle) for those ops' argument; 0 for
    a handle never made (the op then refuses the handle)."""
    w = getattr(comm, "world_size", None)
    return _WORLDS.get(int(comm), 0) if w is None else w


def communicator_of_world(handle: int, world: int, what: str):
    """``communicator(handle)``, refused unless its world size is ``world``."""
    comm = communicator(handle)
    if world != comm.world_size:
        raise _invalid(f"{what}: world {world} is not the world size of communicator handle {handle} "
                       f"({comm.world_size}); expected the world size of the communicator the handle names")
    return comm
