"""symmalloc: symmetric-memory CUDA allocator with NVLink all-reduce kernels.

Pure Python over ctypes. The shared objects are found in ``$SYMMALLOC_LIBRARY_DIR`` (an
override), in this package's ``lib/`` folder (the wheel carries them there), or in the
repository's ``target/release`` when run from a checkout. ``symmalloc.ops`` registers the
collectives as ``torch.ops.symmalloc.*`` custom ops for torch.compile; ``python -m
symmalloc.bench`` is an nccl-tests-style benchmark.

MemPool mode (recommended)::

    import torch, symmalloc
    comm = symmalloc.Communicator.from_env()          # torchrun / mpirun variables
    with torch.cuda.use_mem_pool(symmalloc.mem_pool()):
        x = torch.randn(1 << 20, device="cuda", dtype=torch.bfloat16)
    comm.all_reduce(x)                                 # in place, on the current stream

The modules: ``_lib`` (loading the library, status codes, errors), ``_fast`` (the compiled
eager caller and the stream getter), ``_checks`` (the argument checks the communicators and the
custom ops share), ``_registry`` (the handles by which the custom ops name a communicator),
``comm`` (``Communicator``, with ``groups`` and ``p2p``), ``memory`` (statistics, pools, global
mode) and ``hier`` (``HierCommunicator``: more than one node, with the cost model of
``hier_cost`` and the host exchange of ``_hosts``). What each misuse gets back: docs/python-errors.md.
"""

__version__ = "0.2.0"  # kept equal to Cargo.toml's version by tests/test_no_gpu.py

from ._fast import _current_stream_handle, _fast_all_reduce, _stream_getter  # noqa: E402,F401
from ._lib import (  # noqa: E402,F401
    _ALGOS, _DTYPES, _OPS, _QUANTS, _STATS, STATUS, SymmallocError, _candidates, _check, _find, _library,
    get_unique_id, library_path,
)
from .comm import Communicator, _eager_fallback, communicator  # noqa: E402,F401
from .memory import install_global, mem_pool, memory_stats, pluggable_path  # noqa: E402
from .hier import HierCommunicator, HierCost, from_process_group  # noqa: E402

__all__ = [
    "SymmallocError",
    "library_path",
    "pluggable_path",
    "get_unique_id",
    "Communicator",
    "mem_pool",
    "install_global",
    "memory_stats",
    "communicator",
    "HierCommunicator",
    "HierCost",
    "from_process_group",
]
