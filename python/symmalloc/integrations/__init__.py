"""Engine adapters over ``symmalloc.moe`` (docs/moe.md, "Engine adapters"): ``vllm`` (a
modular-kernel prepare/finalize and an all-to-all manager) and ``sglang`` (a DeepEP
low-latency token dispatcher). Each module imports its engine only if it is installed and
otherwise uses stand-ins with the same fields, so ``import symmalloc.integrations.vllm`` works
without the engine (``ENGINE`` says which: the engine's module, or None)."""
