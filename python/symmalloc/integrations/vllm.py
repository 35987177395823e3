"""vLLM adapter: symmalloc's MoE dispatch/combine as a modular-kernel prepare/finalize.

``SymmallocPrepareAndFinalize`` subclasses
``vllm.model_executor.layers.fused_moe.modular_kernel.FusedMoEPrepareAndFinalizeModular``
(interface as of vllm 0.34.0) when vLLM imports, else ``object`` (then ``ExpertTokensMetadata``
and ``FusedMoEActivationFormat`` below are stand-ins with the real ones' fields). ``prepare``
returns the ``BatchedExperts`` layout that vLLM's batched experts consume: ``a`` [L, R, H]
expert-major (local expert ``le``'s rows are ``a[le, :expert_num_tokens[le]]``, the rest is
masked), FP8 scales [L, R, H / 128] or None, and ``ExpertTokensMetadata(expert_num_tokens=
recv_counts [L] int32 on the device, expert_num_tokens_cpu=None)``. ``finalize`` combines: the
top-k weights are applied in symmalloc's combine (like DeepEP low latency), so it takes vLLM's
``TopKWeightAndReduceDelegate`` and ``output_is_reduced()`` is True.

``SymmallocAll2AllManager`` mirrors vLLM's ``All2AllManagerBase.get_handle(kwargs)``: one
``Moe`` per layer shape over a symmalloc communicator (the EP group), made on first use
(collective: every rank asks for the same shapes in the same order) and closed by
``destroy()``. It does not subclass vLLM's base, whose constructor needs vLLM's process groups.

Not covered: ``expert_map`` (global->local remapping; pass None, experts are placed
``rank * L .. rank * L + L - 1``), ``defer_input_quant``, quantization inside ``prepare``
(FP8 input must come quantized: pass ``a1`` as float8_e4m3fn with ``quant_config.a1_scale``
[M, H / 128] float32), and ``prepare_async``/``finalize_async`` (symmalloc has no split
send/recv yet; ``supports_async()`` is False).
"""
from dataclasses import dataclass
from enum import Enum

try:  # the engine when installed; the adapter works without it
    from vllm.model_executor.layers.fused_moe import modular_kernel as _mk

    ENGINE = _mk
    _Base = _mk.FusedMoEPrepareAndFinalizeModular
    ExpertTokensMetadata = _mk.ExpertTokensMetadata
    FusedMoEActivationFormat = _mk.FusedMoEActivationFormat
except ImportError:
    ENGINE = None
    _Base = object

    @dataclass
    class ExpertTokensMetadata:  # stand-in: vllm's fields (0.34.0)
        expert_num_tokens: object
        expert_num_tokens_cpu: object
        psum_recv_per_rank: object = None
        rank_expert_offset: object = None

    class FusedMoEActivationFormat(Enum):  # stand-in: vllm's members (0.34.0)
        Standard = ("standard",)
        BatchedExperts = ("batched_experts",)
        PaddedStandard = ("padded_standard",)

__all__ = ["ENGINE", "ExpertTokensMetadata", "FusedMoEActivationFormat", "SymmallocAll2AllManager",
           "SymmallocPrepareAndFinalize"]


class SymmallocAll2AllManager:
    """One ``Moe`` per ``get_handle(kwargs)`` shape over ``comm`` (the EP group). kwargs:
    ``max_num_tokens_per_dp_rank``, ``hidden_size``, ``num_topk``, ``num_experts``, optional
    ``dtype`` (torch.bfloat16 default, or torch.float8_e4m3fn) and ``max_recv_per_expert``."""

    def __init__(self, comm):
        self.comm = comm
        self.rank, self.world_size = comm.rank, comm.world_size
        self._handles = {}

    def get_handle(self, kwargs):
        key = (int(kwargs["max_num_tokens_per_dp_rank"]), int(kwargs["hidden_size"]), int(kwargs["num_topk"]),
               int(kwargs["num_experts"]), kwargs.get("dtype", "bf16"), kwargs.get("max_recv_per_expert", 0))
        m = self._handles.get(key)
        if m is None:
            m = self.comm.moe(max_tokens_per_rank=key[0], hidden=key[1], topk=key[2], num_experts=key[3],
                              dtype=key[4], max_recv_per_expert=key[5])
            self._handles[key] = m
        return m

    def destroy(self):
        """Closes every ``Moe`` (every rank, at the same point)."""
        for m in self._handles.values():
            m.close()
        self._handles = {}


class SymmallocPrepareAndFinalize(_Base):
    """Prepare (dispatch) and finalize (combine) over one ``symmalloc.moe.Moe``."""

    def __init__(self, moe):
        if _Base is not object:
            super().__init__()
        self.moe = moe
        self._last = None

    @property
    def activation_format(self):
        return FusedMoEActivationFormat.BatchedExperts

    def topk_indices_dtype(self):
        return None  # int32 and int64 both accepted

    def max_num_tokens_per_rank(self):
        return self.moe.max_tokens_per_rank

    def num_dispatchers(self):
        return self.moe.world_size

    def output_is_reduced(self):
        return True

    def supports_async(self):
        return False

    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map, apply_router_weight_on_input,
                quant_config, defer_input_quant=False):
        m = self.moe
        if expert_map is not None or defer_input_quant:
            raise NotImplementedError("symmalloc prepare: expert_map and defer_input_quant are not supported; "
                                      "pass expert_map=None and quantized input")
        if num_experts != m.num_experts:
            raise ValueError(f"symmalloc prepare: num_experts {num_experts}; this Moe has {m.num_experts}")
        scales = getattr(quant_config, "a1_scale", None)
        if apply_router_weight_on_input:
            if topk_ids.shape[1] != 1:
                raise ValueError("symmalloc prepare: apply_router_weight_on_input needs topk 1 (as vLLM's)")
            a1 = (a1.float() * topk_weights.float()).to(a1.dtype)
            topk_weights = topk_weights.new_ones(topk_weights.shape)
        d = m.dispatch(a1.contiguous(), topk_ids.contiguous(), topk_weights.float().contiguous(),
                       x_scales=None if scales is None else scales.contiguous())
        self._last = d
        meta = ExpertTokensMetadata(expert_num_tokens=d.recv_counts, expert_num_tokens_cpu=None)
        return d.recv_x, d.recv_scales, meta, None, None

    def finalize(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input,
                 weight_and_reduce_impl):
        name = type(weight_and_reduce_impl).__name__
        if name != "TopKWeightAndReduceDelegate":
            raise ValueError(f"symmalloc finalize: weight_and_reduce_impl is {name}; the combine applies the "
                             "weights, so expected TopKWeightAndReduceDelegate")
        if self._last is None:
            raise RuntimeError("symmalloc finalize: no prepare to finalize; call prepare first")
        self.moe.combine(fused_expert_output.contiguous(), self._last, out=output)
