"""The eager fast path: the compiled ``symm_all_reduce_algo`` caller (``_fastcall.c``) and the
current-stream getter."""

import ctypes
import os
from typing import Optional

from ._lib import _candidates, _library

_raw_stream = None
_fast = None  # symmalloc._fastcall.all_reduce once bound; False when the module is absent
_FASTCALL_MODULE = None  # the bound symmalloc._fastcall module, once found


def _fast_all_reduce():
    """The compiled ``symm_all_reduce_algo`` caller (``_fastcall.c``, built into the wheel;
    less host time per call than ctypes: bench/RESULTS.md, "Eager from Python against C"), or None, when it is not built (a checkout
    without the wheel): then calls go through ctypes. Looked for in the package, then beside
    the library (``_fastcall.abi3.so``), and bound to the library ctypes loaded."""
    global _fast, _FASTCALL_MODULE
    if _fast is None:
        mod = None
        try:
            from . import _fastcall as mod  # type: ignore[attr-defined]
        except ImportError:
            import importlib.util

            for d in _candidates():
                path = os.path.join(d, "_fastcall.abi3.so")
                if os.path.isfile(path):
                    spec = importlib.util.spec_from_file_location("symmalloc._fastcall", path)
                    mod = importlib.util.module_from_spec(spec)
                    spec.loader.exec_module(mod)
                    break
        if mod is not None:
            mod.bind(ctypes.cast(_library().symm_all_reduce_algo, ctypes.c_void_p).value)
        _fast = mod.all_reduce if mod is not None else False
        _FASTCALL_MODULE = mod
    return _fast or None


def _fastcall_module():
    """The bound ``_fastcall`` module, or None (call ``_fast_all_reduce()`` first)."""
    return _FASTCALL_MODULE


def _stream_getter():
    """``device -> current stream handle`` without a Stream object (about 10x cheaper), bound once."""
    global _raw_stream
    if _raw_stream is None:
        import torch

        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        _raw_stream = raw if raw is not None else (lambda d: torch.cuda.current_stream(d).cuda_stream)
    return _raw_stream


def _current_stream_handle(device: Optional[int] = None) -> int:
    if device is None:
        import torch

        device = torch.cuda.current_device()
    return _stream_getter()(device)
