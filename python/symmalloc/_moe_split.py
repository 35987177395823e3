"""The split halves of ``Moe.dispatch`` and ``Moe.combine`` (``symm_moe_dispatch_send`` /
``_recv``, ``symm_moe_combine_send`` / ``_recv``; docs/moe.md, "Split halves") and the clock
probe (``symm_moe_probe``), as a base class of ``symmalloc.moe.Moe``::

    h = moe.dispatch_send(x, topk_idx, topk_weights)   # routes, stages, publishes; no wait
    ...                                                # attention, the other micro-batch
    d = moe.dispatch_recv(h)                           # waits, pulls: what dispatch returns
    moe.combine_send(run_experts(d.recv_x, d.recv_counts))
    ...
    y = moe.combine_recv()                             # waits, sums: what combine returns

The halves give what the one-call forms give, bit for bit. Each send is followed by its
receive before any other call of the object (another call is refused, naming the receive it
expects, and changes nothing); ``x`` (and ``x_scales``) and ``expert_out`` must stay unchanged
until their receive ran (the handles keep them alive). Other work may run between the halves:
other collectives of the communicator, another ``Moe``'s halves (two micro-batches: one object
each). A receive on another stream is ordered after its send by the library (as every call of
a communicator), inside one CUDA graph capture too. A send whose arguments are refused (here or
by the library) completes its call at once on this rank, so no peer waits: it raises, and
nothing is pending after it. Both modes (the throughput mode's receive returns a
``MoeTpDispatch``, its combine takes one row per received row). Eager only (``torch.compile``
keeps ``dispatch``/``combine``).
"""

import ctypes
from typing import NamedTuple, Optional

from ._lib import _MOE_PROBE_WORDS as _PROBE_WORDS
from ._lib import SymmallocError, _check, _invalid
from ._moe_args import HostView, _check_combine, _check_dispatch, _is_torch

_VOIDP = ctypes.c_void_p
# symm_moe_probe's words (layout.rs PROBE_*), by name.
_PROBE_DISPATCH = ("start", "routed", "staged", "published", "recv_start", "waited", "pulled", "epoch")
_PROBE_COMBINE = ("start", "pushed", "recv_start", "waited", "summed", "epoch")


class MoeSend(NamedTuple):
    """What ``Moe.dispatch_send`` returns and ``Moe.dispatch_recv`` takes: this rank's
    ``num_tokens``, the object's handle and its dispatch number, and the inputs, kept alive
    until the receive ran (it reads this rank's own rows from ``x``)."""

    num_tokens: int
    moe: int
    seq: int
    inputs: tuple


class MoeCombineSend(NamedTuple):
    """What ``Moe.combine_send`` returns and ``Moe.combine_recv`` may take: ``y`` (written by
    the receive) and ``expert_out``, kept alive until then."""

    y: object
    expert_out: object
    moe: int
    seq: int


class _Split:
    """The split API of ``Moe`` (module docstring). ``_pending``: None, or the ``MoeSend`` /
    ``MoeCombineSend`` whose receive half comes next."""

    _pending = None
    _combine_seq = 0

    def _idle(self, what: str) -> None:
        """Refuses `what` while a send half waits for its receive half (nothing is called)."""
        p = self._pending
        if p is None:
            return
        sent, want = (("dispatch_send", "dispatch_recv(handle)") if isinstance(p, MoeSend)
                      else ("combine_send", "combine_recv()"))
        raise _invalid(f"{what}: rank {self.rank}: moe.{sent} was called and its receive half was not; expected "
                       f"moe.{want} first (every send half is followed by its receive half before any other call "
                       "of this Moe)")

    def _eager(self, what: str) -> None:
        if self._compiling():
            raise _invalid(f"{what}: the split halves are eager only; under torch.compile use moe.dispatch and "
                           "moe.combine")

    def dispatch_send(self, x, topk_idx, topk_weights, x_scales=None) -> MoeSend:
        """The send half of ``dispatch`` (same arguments): routes this rank's tokens, stages
        their rows and publishes its counts, waiting for no peer; returns the handle
        ``dispatch_recv`` takes. Collective, on the current stream."""
        self._eager("moe.dispatch_send")
        ptr = self._live()
        self._idle("moe.dispatch_send")
        try:
            n, k, idx_code = _check_dispatch(self, x, topk_idx, topk_weights, x_scales)
            self._check_device("moe.dispatch_send", x=x, topk_idx=topk_idx, topk_weights=topk_weights,
                               x_scales=x_scales)
        except SymmallocError as e:
            self._seq += 1
            self._tokens = self._last = None
            # Refused for its NULL pointers: the library publishes the refusal and completes the
            # call on this rank (nothing pending), so the peers' receive halves name this rank.
            self._lib.symm_moe_dispatch_send(self._ptr, None, None, None, 0, None, 1, 1, _VOIDP(self._stream()))
            raise e
        self._seq += 1
        self._tokens = self._last = None
        _check(self._lib.symm_moe_dispatch_send(
            ptr, x.data_ptr(), None if x_scales is None else x_scales.data_ptr(), topk_idx.data_ptr(), idx_code,
            topk_weights.data_ptr(), n, k, _VOIDP(self._stream())))
        h = MoeSend(n, self.handle, self._seq, (x, topk_idx, topk_weights, x_scales))
        self._pending = h
        return h

    def dispatch_recv(self, handle: MoeSend):
        """The receive half of the dispatch ``handle`` (``dispatch_send``'s) sent: waits for
        every rank's counts and pulls this rank's rows. Returns what ``dispatch`` returns (a
        ``MoeDispatch``; throughput mode: a ``MoeTpDispatch``), bit for bit. Collective, on the current stream (ordered
        after the send by the library)."""
        self._eager("moe.dispatch_recv")
        ptr = self._live()
        p = self._pending
        if not isinstance(p, MoeSend):
            self._idle("moe.dispatch_recv")
            raise _invalid(f"moe.dispatch_recv: rank {self.rank}: no dispatch was sent; expected moe.dispatch_send "
                           "first")
        if not isinstance(handle, MoeSend) or handle.moe != self.handle or handle.seq != p.seq:
            raise _invalid(f"moe.dispatch_recv: rank {self.rank}: the handle is not the pending send's; expected what "
                           f"this Moe's latest dispatch_send returned (dispatch {p.seq})")
        self._pending = None
        _check(self._lib.symm_moe_dispatch_recv(ptr, _VOIDP(self._stream())))
        return self._result(_is_torch(p.inputs[0]), p.num_tokens)

    def combine_send(self, expert_out, handle=None, out=None) -> MoeCombineSend:
        """The send half of ``combine`` (same arguments): this rank's experts' rows back to
        their tokens' ranks, waiting for no peer. Returns the handle ``combine_recv`` may take;
        ``y`` is written by the receive half. Collective, on the current stream."""
        self._eager("moe.combine_send")
        ptr = self._live()
        self._idle("moe.combine_send")
        try:
            h = self._handle_of(handle)
            self._check_handle(h)
            _check_combine(self, expert_out, h.num_tokens, out)
            self._check_device("moe.combine_send", expert_out=expert_out, out=out)
        except SymmallocError as e:
            # Completes the call on this rank; the peers' receive halves name it.
            self._lib.symm_moe_combine_send(self._ptr, None, None, _VOIDP(self._stream()))
            raise e
        if out is None:
            shape = (h.num_tokens, self.hidden)
            out = expert_out.new_empty(shape) if _is_torch(expert_out) else HostView.empty(shape, "bfloat16")
        _check(self._lib.symm_moe_combine_send(ptr, expert_out.data_ptr(), out.data_ptr(), _VOIDP(self._stream())))
        self._combine_seq += 1
        c = MoeCombineSend(out, expert_out, self.handle, self._combine_seq)
        self._pending = c
        return c

    def combine_recv(self, handle: Optional[MoeCombineSend] = None):
        """The receive half of the pending ``combine_send`` (``handle`` may name it): waits for
        every peer's rows and returns ``y`` [num_tokens, H] bfloat16, bit for bit what
        ``combine`` returns. Collective, on the current stream."""
        self._eager("moe.combine_recv")
        ptr = self._live()
        p = self._pending
        if not isinstance(p, MoeCombineSend):
            self._idle("moe.combine_recv")
            raise _invalid(f"moe.combine_recv: rank {self.rank}: no combine was sent; expected moe.combine_send first")
        if handle is not None and (not isinstance(handle, MoeCombineSend) or handle.moe != self.handle
                                   or handle.seq != p.seq):
            raise _invalid(f"moe.combine_recv: rank {self.rank}: the handle is not the pending combine_send's; "
                           "expected what this Moe's latest combine_send returned (or none)")
        self._pending = None
        _check(self._lib.symm_moe_combine_recv(ptr, _VOIDP(self._stream())))
        return p.y

    def probe(self) -> dict:
        """The clock probe of an object made with ``probe=True``: ``{"dispatch": {start, routed,
        staged, published, recv_start, waited, pulled, epoch}, "combine": {start, pushed,
        recv_start, waited, summed, epoch}}`` of the last dispatch and combine (a throughput-mode
        dispatch adds ``scanned`` and ``sorted``; docs/moe.md "Clock probe"), times in ns
        (%globaltimer on GPUs, after a device synchronization; the wall clock on the host
        backend). Local; raises when the probe is off."""
        ptr = self._live()
        words = (ctypes.c_uint64 * _PROBE_WORDS)()
        _check(self._lib.symm_moe_probe(ptr, words, _PROBE_WORDS))
        v = list(words)
        d = dict(zip(_PROBE_DISPATCH, v[:8]))
        if v[14] or v[15]:  # the throughput mode's dispatch (docs/moe.md "Clock probe")
            d.update(scanned=v[14], sorted=v[15])
        return {"dispatch": d, "combine": dict(zip(_PROBE_COMBINE, v[8:14]))}
