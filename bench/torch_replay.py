"""A training step's allocations and frees (bench/step_probe.py --ext-trace FILE) replayed
through PyTorch's allocator interface, with their threads: PyTorch's own allocator against
symmalloc's C++ allocator, the same sequence and harness (bench/torch_replay.cpp).

    python3 bench/torch_replay.py default|global TRACE.csv [--reps 30] [--warmup 1] [--lib torch_replay.so]
                                  [--symm-lib DIR]

One GPU. Prints one JSON row: per recorded thread and call, calls and µs per repetition (the
trace's steps), mean, p50, p99 and max µs per call. Run each mode in fresh processes,
alternating. `--lib` names a prebuilt harness; without it the harness is built here with
torch.utils.cpp_extension (a compiler and the CUDA headers are needed). `--symm-lib DIR` runs mode
global on the libsymmalloc.so in DIR (another build: `scripts/stage-device.sh --old` puts one in
.device/old), for an A/B between builds, which resolves less than one against PyTorch's."""
import argparse
import ctypes
import json
import os

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("mode", choices=["default", "global"])
ap.add_argument("trace")
ap.add_argument("--reps", type=int, default=30)
ap.add_argument("--warmup", type=int, default=1,
                help="repetitions not timed (the heap settles over the first few: segments made and given back)")
ap.add_argument("--lib", default=None, help="a prebuilt torch_replay .so")
ap.add_argument("--symm-lib", metavar="DIR", help="mode global on the libsymmalloc.so in DIR (another build)")
ap.add_argument("--build", metavar="DIR", help="only build the harness into DIR and print its path")
a = ap.parse_args()

os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
os.environ.pop("SYMMALLOC_ENABLE_MULTICAST", None)
import torch  # noqa: E402


def build(out_dir):
    from torch.utils import cpp_extension

    from symmalloc._torch_ext import _cuda_paths

    incs, libdir, cudart = _cuda_paths(torch)
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    os.makedirs(out_dir, exist_ok=True)
    return cpp_extension.load(name="torch_replay", sources=[os.path.join(os.path.dirname(__file__), "torch_replay.cpp")],
                       extra_cflags=["-O2"], extra_include_paths=incs,
                       extra_ldflags=[f"-L{torch_lib}", "-lc10_cuda", "-lc10", f"-L{libdir}", f"-l:{cudart}"],
                       build_directory=out_dir, is_python_module=False, with_cuda=False)


if a.build:
    print(build(a.build))
    raise SystemExit(0)
if a.symm_lib and a.mode != "global":
    raise SystemExit("torch_replay.py: --symm-lib names a symmalloc build: it needs mode global")
if a.symm_lib:
    if not os.path.isfile(os.path.join(a.symm_lib, "libsymmalloc.so")):
        raise SystemExit(f"torch_replay.py: --symm-lib {a.symm_lib}: no libsymmalloc.so there")
    os.environ["SYMMALLOC_LIBRARY_DIR"] = os.path.abspath(a.symm_lib)
if a.mode == "global":
    import symmalloc
    symmalloc.install_global()
torch.cuda.init()
torch.empty(1, device="cuda")  # the allocator and the context exist before the replay
lib = ctypes.CDLL(a.lib or build(os.path.join(os.path.expanduser("~/.cache/symmalloc"), "torch_replay")))
buf = ctypes.create_string_buffer(1 << 16)
if lib.torch_replay(a.trace.encode(), a.reps, a.warmup, buf, ctypes.sizeof(buf)) != 0:
    raise SystemExit(f"torch_replay.py: {buf.value.decode()}")
row = {"mode": a.mode, "reps": a.reps, "warmup": a.warmup, "symm_lib": a.symm_lib,
       "per_thread": json.loads(buf.value.decode())}
row["total_us_per_rep"] = round(sum(v["us_per_rep"] for v in row["per_thread"].values()), 1)
print("ROW " + json.dumps(row), flush=True)
