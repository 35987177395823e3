"""SGLang adapter: symmalloc's MoE dispatch/combine as a token dispatcher with DeepEP
low-latency outputs.

``SymmallocDeepEPLLDispatcher`` subclasses
``sglang.srt.layers.moe.token_dispatcher.base.BaseDispatcher`` (interface as of sglang 0.5.23)
when SGLang imports, else ``object`` (then ``DeepEPLLDispatchOutput`` and
``DeepEPLLCombineInput`` below are stand-ins with the real named tuples' fields).
``dispatch(hidden_states, topk_output)`` returns ``DeepEPLLDispatchOutput(hidden_states [L,
R, H] expert-major, hidden_states_scale [L, R, H / 128] or None, topk_ids, topk_weights,
masked_m = recv_counts [L] int32 on the device, expected_m)``; ``combine(DeepEPLLCombineInput)``
returns [num_tokens, H] bf16, the top-k weights applied in symmalloc's combine.

Two-batch overlap: ``dispatch_a`` / ``combine_a`` are the send halves (``Moe.dispatch_send`` /
``combine_send``: route, stage and publish, or push the rows back; no wait on a peer) and
``dispatch_b`` / ``combine_b`` the receive halves (the wait and the pull, or the sum), so the
other micro-batch's work runs between them. One dispatcher (one ``Moe``) per micro-batch: an
``_a`` half must be followed by its ``_b`` half before the next call of the same dispatcher.
The results are bit for bit those of ``dispatch`` / ``combine``.
"""
from typing import NamedTuple, Optional

try:
    from sglang.srt.layers.moe.token_dispatcher import base as _base
    from sglang.srt.layers.moe.token_dispatcher import deepep as _deepep

    ENGINE = _deepep
    _Base = _base.BaseDispatcher
    DeepEPLLDispatchOutput = _deepep.DeepEPLLDispatchOutput
    DeepEPLLCombineInput = _deepep.DeepEPLLCombineInput
except ImportError:
    ENGINE = None
    _Base = object

    class DeepEPLLDispatchOutput(NamedTuple):  # stand-in: sglang's fields (0.5.23)
        hidden_states: object
        hidden_states_scale: Optional[object]
        topk_ids: object
        topk_weights: object
        masked_m: object
        expected_m: int

    class DeepEPLLCombineInput(NamedTuple):  # stand-in: sglang's fields (0.5.23)
        hidden_states: object
        topk_ids: object
        topk_weights: object

__all__ = ["ENGINE", "DeepEPLLCombineInput", "DeepEPLLDispatchOutput", "SymmallocDeepEPLLDispatcher"]


class SymmallocDeepEPLLDispatcher(_Base):
    """A DeepEP-LL-shaped dispatcher over one ``symmalloc.moe.Moe``. ``topk_output`` is any
    object with ``topk_ids`` and ``topk_weights`` (SGLang's ``StandardTopKOutput``)."""

    def __init__(self, moe):
        if _Base is not object:
            super().__init__()
        self.moe = moe
        self._last = None
        self._pending_dispatch = None
        self._pending_combine = None

    def dispatch(self, hidden_states, topk_output, x_scales=None):
        ids, w = topk_output.topk_ids, topk_output.topk_weights
        d = self.moe.dispatch(hidden_states.contiguous(), ids.contiguous(), w.float().contiguous(),
                              x_scales=None if x_scales is None else x_scales.contiguous())
        return self._output(d, ids, w)

    def _output(self, d, ids, w):
        m = self.moe
        self._last = d
        n, k = ids.shape[0], ids.shape[1]
        # DeepEP's estimate of rows per local expert (a hint for the grouped GEMM's tiling).
        expected_m = max(1, (n * m.world_size * k + m.num_experts - 1) // m.num_experts)
        return DeepEPLLDispatchOutput(d.recv_x, d.recv_scales, ids, w, d.recv_counts, expected_m)

    def combine(self, combine_input):
        if self._last is None:
            raise RuntimeError("symmalloc combine: no dispatch to combine; call dispatch first")
        return self.moe.combine(combine_input.hidden_states.contiguous(), self._last)

    # Two-batch overlap halves: _a sends (no wait on a peer), _b receives.

    def dispatch_a(self, hidden_states, topk_output, x_scales=None):
        if self._pending_dispatch is not None:
            raise RuntimeError("symmalloc dispatch_a: the previous dispatch_a has no dispatch_b yet; "
                               "call dispatch_b first")
        ids, w = topk_output.topk_ids, topk_output.topk_weights
        h = self.moe.dispatch_send(hidden_states.contiguous(), ids.contiguous(), w.float().contiguous(),
                                   x_scales=None if x_scales is None else x_scales.contiguous())
        self._pending_dispatch = (h, ids, w)

    def dispatch_b(self):
        pending, self._pending_dispatch = self._pending_dispatch, None
        if pending is None:
            raise RuntimeError("symmalloc dispatch_b: no dispatch_a before it")
        h, ids, w = pending
        return self._output(self.moe.dispatch_recv(h), ids, w)

    def combine_a(self, combine_input):
        if self._pending_combine is not None:
            raise RuntimeError("symmalloc combine_a: the previous combine_a has no combine_b yet; "
                               "call combine_b first")
        if self._last is None:
            raise RuntimeError("symmalloc combine_a: no dispatch to combine; call dispatch (or dispatch_a and "
                               "dispatch_b) first")
        self._pending_combine = self.moe.combine_send(combine_input.hidden_states.contiguous(), self._last)

    def combine_b(self):
        pending, self._pending_combine = self._pending_combine, None
        if pending is None:
            raise RuntimeError("symmalloc combine_b: no combine_a before it")
        return self.moe.combine_recv(pending)
