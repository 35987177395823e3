"""The values a ``Moe``'s dispatch returns and its combine takes (NamedTuples; symmalloc.moe
re-exports them): ``MoeHandle`` / ``MoeDispatch`` for the low-latency mode, ``MoeTpHandle`` /
``MoeTpDispatch`` for the throughput mode. Plain data: nothing here imports the rest of the
package, so moe.py and _moe_split.py both build them without importing each other."""
from typing import NamedTuple, Optional


class MoeHandle(NamedTuple):
    """What ``Moe.combine`` needs of a dispatch: ``recv_src`` [L, R] int32 (the source code of
    each row), ``recv_counts`` [L] int32, ``num_tokens`` (this rank's tokens: ``y``'s rows), the
    ``Moe``'s handle and its dispatch number (``seq``; None under torch.compile)."""

    recv_src: object
    recv_counts: object
    num_tokens: int
    moe: int
    seq: Optional[int]


class MoeDispatch(NamedTuple):
    """What ``Moe.dispatch`` returns: ``recv_x`` [L, R, H] (payload dtype), ``recv_scales`` [L,
    R, H / 128] float32 (None for bf16), ``recv_counts`` [L] int32 and the ``handle`` that
    ``combine`` takes; ``recv_src`` and ``num_tokens`` are the handle's. Unpacks as ``recv_x,
    recv_scales, recv_counts, handle = moe.dispatch(...)``."""

    recv_x: object
    recv_scales: object
    recv_counts: object
    handle: MoeHandle

    @property
    def recv_src(self):
        """[L, R] int32: ``(src_rank * max_tokens_per_rank + token) * topk + k`` of each row."""
        return self.handle.recv_src

    @property
    def num_tokens(self) -> int:
        return self.handle.num_tokens


class MoeTpHandle(NamedTuple):
    """A throughput-mode dispatch's buffers (views) and what ``combine`` checks: ``recv_src``
    [W*T] int32 (``src_rank * max_tokens_per_rank + token``), ``num_recv`` [1] int32 (rows
    received, on the device), ``num_tokens``, the ``Moe``'s handle and dispatch number, the FP8
    ``recv_scales`` (None for bf16), ``expert_offsets`` [L + 1] and ``expert_rows`` [W*T*K]
    int32 (``row * K + k`` grouped by local expert)."""

    recv_src: object
    num_recv: object
    num_tokens: int
    moe: int
    seq: Optional[int]
    recv_scales: object
    expert_offsets: object
    expert_rows: object


class MoeTpDispatch(NamedTuple):
    """What ``Moe.dispatch`` returns in throughput mode, in DeepEP normal mode's order:
    ``recv_x`` [W*T, H] (the first ``num_recv`` rows filled, by source rank then token),
    ``recv_topk_idx`` [W*T, K] int32 (local expert ids, -1 for other ranks' experts),
    ``recv_topk_weights`` [W*T, K] float32 (0 where -1), ``num_recv_tokens_per_expert`` [L]
    int32 (on the device) and the ``handle`` (a ``MoeTpHandle``); its fields are properties
    too (``num_recv``, ``recv_src``, ``recv_scales``, ``expert_offsets``, ``expert_rows``)."""

    recv_x: object
    recv_topk_idx: object
    recv_topk_weights: object
    num_recv_tokens_per_expert: object
    handle: MoeTpHandle

    @property
    def num_recv(self):
        return self.handle.num_recv

    @property
    def recv_src(self):
        return self.handle.recv_src

    @property
    def recv_scales(self):
        return self.handle.recv_scales

    @property
    def expert_offsets(self):
        return self.handle.expert_offsets

    @property
    def expert_rows(self):
        return self.handle.expert_rows

    @property
    def num_tokens(self) -> int:
        return self.handle.num_tokens
