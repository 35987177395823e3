"""The handle registry: every live ``Communicator`` and ``HierCommunicator`` of the process under
the int ``handle`` by which the custom ops (``symmalloc.ops``) and the compiled eager caller name
it. Held weakly: a collected communicator leaves the registry by itself."""

import itertools
import weakref

from ._lib import _invalid

_COMMS: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)


def register(comm) -> int:
    """A fresh handle for ``comm``, which the registry holds weakly from now on."""
    handle = next(_HANDLES)
    _COMMS[handle] = comm
    return handle


def communicator(handle: int):
    """The live communicator behind ``Communicator.handle`` (the int the custom ops take)."""
    comm = _COMMS.get(handle)
    if comm is None:
        raise _invalid(f"communicator handle {handle} is not a live Communicator of this process (closed and collected, or never made)")
    if not comm._comm.value:
        raise _invalid(f"communicator handle {handle} is not a live Communicator: {comm._closed_message()}")
    return comm
