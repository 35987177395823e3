#!/usr/bin/env bash
# The 2-GPU run (the 2-rank verdicts, first made on 2026-11-27), batched for an nvidia-h200-x2.
# Multicast stays off (scripts/device-env.sh, sourced by device-run.sh).
#
# Here, before the first call (no GPU needed):
#   bash scripts/two-gpu-run.sh prepare   stages this checkout into .device/ and the A/B's other
#                                         build (848a182, the last main measured at 2 ranks) into
#                                         .device/old, through a temporary worktree
# On the device (each part fits one call of at most 10 minutes; logs under $OUT):
#   bash scripts/two-gpu-run.sh tail      1. device-run.sh tail: 10 fresh processes, every
#                                            algorithm, in and out of place, 8 KiB-64 MiB, torch
#                                            and NCCL in the same processes, and (2.) the eager
#                                            Python-vs-C table
#   bash scripts/two-gpu-run.sh ab        1. this build against 848a182 in alternating processes
#   bash scripts/two-gpu-run.sh fused     3. bench/fused.py: bf16 fused, FP8 static and per-token,
#                                            unfused, NCCL; hidden 4096/6144/8192, tokens 1-2048;
#                                            the 16-layer decoder step
#   bash scripts/two-gpu-run.sh atp       4. bench/async_tp.py --world 2 (TFLOP/s against torch's
#                                            fused ops, NCCL then matmul, matmul alone)
#   bash scripts/two-gpu-run.sh triton    5. bench/triton_one_shot.py --world 2 (the Triton example
#                                            against the library's one-shot, 8 KiB-1 MiB)
#   bash scripts/two-gpu-run.sh global2   global mode with two GPUs in one process, under
#                                            symmalloc and then PyTorch's allocator:
#                                            global_multigpu_check.py (copies, a Triton kernel on
#                                            GPU 1 reading GPU 0, streams), the two ported tests
#                                            that need 2 GPUs (torch_upstream_check.py), and
#                                            ipc_check.py's two_devices (symmalloc, torch, mixed)
#   bash scripts/two-gpu-run.sh ddp       bench/ddp_memory.py --rounds ROUNDS (3): DDP step time
#                                            and memory against PyTorch's allocator, alternating
#                                            fresh jobs; COMPILE=1 adds --compile (reduce-overhead)
#   bash scripts/two-gpu-run.sh moe       bench/moe.py --ranks 2, one rank per GPU: RUNS (3) fresh
#                                            sets, SHAPES (decode1,decode128; prefill4096 in a
#                                            call of its own), MOE_ARGS for the rest (every mode,
#                                            dtype, routing, SM budget and peer by default)
#   bash scripts/two-gpu-run.sh moecheck  MoE correctness over the two GPUs: t_gpu_moe at 2 ranks
#                                            (one per GPU) and moe_gpu_check.py at 2 and 4 ranks
set -uo pipefail
cd "$(dirname "$0")/.."
# The parts that run a script themselves: the device machine's environment (multicast off, D,
# OUT: scripts/device-env.sh), this build's libraries, and this checkout's Python package (which
# every script also puts on its own sys.path).
device_env() {
  . scripts/device-env.sh
  export SYMMALLOC_LIBRARY_DIR=$D PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python
}
case "${1:-}" in
  prepare)
    set -e
    bash scripts/stage-device.sh
    wt=$(mktemp -d)/old
    git worktree add -q --detach "$wt" 848a182
    ln -s "$PWD/.toolchain" "$wt/.toolchain"
    (cd "$wt" && bash scripts/stage-device.sh --old)
    rm -rf .device/old && cp -r "$wt/.device/old" .device/old
    git worktree remove --force "$wt"
    du -sh .device ;;
  tail) RUNS=${RUNS:-10} bash scripts/device-run.sh tail ;;
  ab) ROUNDS=${ROUNDS:-4} bash scripts/device-run.sh ab ;;
  fused) bash scripts/device-run.sh fused ;;
  atp)
    device_env
    timeout 580 python3 bench/async_tp.py --world 2 --out "$OUT" 2>&1 | tee "$OUT/async_tp.log" ;;
  triton)
    device_env
    timeout 580 python3 bench/triton_one_shot.py --world 2 2>&1 | tee "$OUT/triton_one_shot.log" ;;
  global2)
    device_env
    for a in symmalloc torch; do
      timeout 120 python3 python/tests/global_multigpu_check.py $a 2>&1 | tee "$OUT/global_multigpu_$a.log"
      timeout 200 python3 python/tests/torch_upstream_check.py $a test_memory_stats_multigpu \
        test_manager_per_device 2>&1 | tee "$OUT/upstream_multigpu_$a.log"
    done
    for a in symmalloc torch mixed; do
      timeout 150 python3 python/tests/ipc_check.py $a two_devices 2>&1 | tee "$OUT/ipc_two_devices_$a.log"
    done ;;
  ddp)
    device_env
    timeout 580 python3 bench/ddp_memory.py --rounds "${ROUNDS:-3}" ${COMPILE:+--compile} --out "$OUT" 2>&1 \
      | tee "$OUT/ddp${COMPILE:+_compiled}.log" ;;
  moe)
    device_env
    timeout 580 python3 bench/moe.py --ranks 2 --runs "${RUNS:-3}" --shapes "${SHAPES:-decode1,decode128}" \
      ${MOE_ARGS:-} --out "$OUT" 2>&1 | tee "$OUT/moe_2gpu.log" ;;
  moecheck)
    device_env
    SYMM_TEST_RANKS=2 timeout 200 "$D/t_gpu_moe" --include-ignored --test-threads=1 --nocapture 2>&1 | tee "$OUT/gpu_moe_2gpu.log" | tail -16
    timeout 360 python3 python/tests/moe_gpu_check.py --world 2 4 --reference gloo 2>&1 | tee "$OUT/moe_check_2gpu.log" | tail -30 ;;
  *) sed -n 2,36p "$0"; exit 2 ;;
esac
