#!/usr/bin/env bash
# Runs symmalloc's GPU checks (and, with "bench", the benchmarks) on a GPU machine, from
# prebuilt artifacts in .device/ (docs/development.md, "GPU runs"). Logs go to $OUT.
#   bash scripts/device-run.sh tests | gpu | bench | alloc | tail | native | fused | ab | p2p | fp8 | groups | moe | global | atp | hier | x2 | multimem
#   multimem: the multimem all-reduce's body with unicast peer loads and stores, no multicast
#             object (tests/multimem_unicast; docs/multicast.md) at RANKS (default "2 4 8") ranks
#             sharing the machine's GPUs (SYMMALLOC_SHARED_GPU=1). Exit 77 in its log: skipped.
#   x2: the 2-GPU runs first made on 2026-11-27 (PARTS; see the branch), each part within what is left of BUDGET s.
#   fused: bench/fused.py (all-reduce + residual add + RMSNorm, fused vs unfused vs NCCL, and a
#          16-layer decoder step).
#   native: the PyTorch-native checks (torch.compile over the custom ops at 2 ranks; the wheel
#           installed in a fresh venv outside the checkout, running the benchmark CLI with peers
#           and a plot).
#   tail: bench/tail.py over RUNS (default 10) fresh processes, with the eager Python-vs-C table;
#         LIB=DIR runs it against the libraries in DIR instead of .device/ (an older build).
#   ab: this build against .device/old (scripts/stage-device.sh --old), in alternating processes,
#       ROUNDS (default 2) of bench/fused.py (HIDDEN, TOKENS) and allreduce_c (AUTO, 8 KiB-4 MiB);
#       WORLD=N runs N ranks (1 on one GPU: the kernels' local work alone, a filter only).
#   groups: tests/gpu_groups.rs at RANKS (default 4) ranks sharing the GPUs, then bench/groups.rs
#           (split vs init, a child vs a standalone communicator); TORCH=1 adds
#           python/tests/torch_groups_gpu_check.py.
#   moe: expert parallelism (docs/moe.md): tests/gpu_moe.rs at RANKS (default "2 4 8") ranks
#        sharing the machine's GPUs (FILTER: a test name filter).
#   global: global mode on one GPU (PARTS="checks memory host alloc"; see the branch below).
#   fp8: the FP8 output of the fused call: t_fused_quant at RANKS (default "2 4 8")
#        ranks sharing the GPUs, t_bitwise at 2, python/tests/fp8_check.py at 2 (torchrun; gloo
#        reference, torch.compile reduce-overhead), then bench/fused.py --world 1 --fp8
#        (HIDDEN, TOKENS; LIB=DIR: the libraries in DIR; SKIP_BENCH=1 leaves it out, SKIP_TESTS=1
#        runs the benchmark alone, BITWISE=0 and CHECK=0 leave out t_bitwise and fp8_check).
#   atp: async TP: python/tests/async_tp_check.py at RANKS (default "2 4 8") ranks
#        sharing the GPUs and its dying-rank case at 3, then bench/async_tp.py --world 1
#        (SKIP_BENCH=1 leaves it out).
#   hier: the hierarchical communicator's GPU tests (pytest python/tests/test_hier.py -k gpu:
#         2 simulated hosts x 2 ranks sharing one GPU; the NCCL one needs 2 GPUs and says so).
#   shared: the multi-rank GPU tests (t_gpu_comm, t_gpu_sg, t_bitwise) at RANKS (default "2 4") ranks on the
#           machine's GPUs, several ranks per GPU (SYMMALLOC_SHARED_GPU=1): the protocol at N
#           ranks on a one-GPU machine; correctness only (the ranks' kernels time-slice).
# Safety: NVLink multicast stays off (scripts/device-env.sh).
. "$(dirname "$0")/device-env.sh"
export SYMMALLOC_LIBRARY_DIR=$D PYTHONUNBUFFERED=1 RUST_BACKTRACE=1
step() { echo; echo "=== $* ==="; }
run() { local name=$1; shift; step "$name"; timeout "${T:-300}" "$@" > "$OUT/$name.log" 2>&1; local rc=$?; tail -n "${TAILN:-15}" "$OUT/$name.log"; echo "[$name rc=$rc]"; }

if [ "${1:-tests}" = alloc ]; then
  # The allocator table alone (the issue names a one-GPU machine): alloc_bench runs
  # bench/alloc_torch.py itself, so the torch column comes from the same run.
  step machine; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  T=300 TAILN=30 run alloc $D/alloc_bench
elif [ "${1:-tests}" = tail ]; then
  step machine; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  export SYMMALLOC_LIBRARY_DIR=${LIB:-$D}
  T=590 TAILN=${TAILN:-60} run tail python3 bench/tail.py --runs "${RUNS:-10}" --out "$OUT" --c-bench "$D/allreduce_c"
elif [ "${1:-tests}" = native ]; then
  step machine; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch; print('torch', torch.__version__)"
  [ -n "${SKIP_COMPILE:-}" ] || T=400 TAILN=6 run torch_compile python3 -m torch.distributed.run --nproc_per_node=2 --master_port=29534 python/tests/torch_compile_check.py
  step wheel
  # Installed into a folder of its own (the machine's torch lives in a venv that a new venv
  # cannot inherit), used through PYTHONPATH from outside the checkout.
  V=/tmp/symm-wheel-site; rm -rf $V
  python3 -m pip install --no-deps --no-index --target $V $D/symmalloc-*.whl > "$OUT/wheel.log" 2>&1; echo "[pip install rc=$?]"
  export PYTHONPATH=$V
  ( cd /tmp && env -u SYMMALLOC_LIBRARY_DIR python3 -c "import symmalloc; print('wheel', symmalloc.__version__, symmalloc.library_path(), symmalloc.pluggable_path())" )
  for c in ${COLLS:-all_reduce reduce_scatter all_gather}; do
    ( cd /tmp && T=300 TAILN=30 run cli_$c env -u SYMMALLOC_LIBRARY_DIR python3 -m symmalloc.bench -c $c -b 8K -e ${MAXB:-256M} -f 4 -G 1 \
        --compare nccl,torch --plot "$OUT/cli_$c.png" --json "$OUT/cli_$c.json" )
  done
elif [ "${1:-tests}" = ab ]; then
  [ -f "$D/old/libsymmalloc.so" ] || { echo "ab: no .device/old (run scripts/stage-device.sh --old on the other build first)"; exit 2; }
  step machine; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  W=${WORLD:-}
  for i in $(seq "${ROUNDS:-2}"); do
    for b in new old; do
      L=$D; [ $b = old ] && L=$D/old
      step "fused $b, round $i"
      SYMMALLOC_LIBRARY_DIR=$L timeout 300 python3 bench/fused.py ${W:+--world $W} --hidden "${HIDDEN:-4096,6144,8192}" \
        --tokens "${TOKENS:-1,6,32,128}" --step-tokens "" --out "$OUT/ab_${b}_$i" > "$OUT/ab_fused_${b}_$i.log" 2>&1
      echo "[rc=$?]"; grep -E "^\[ .*\|" "$OUT/ab_fused_${b}_$i.log" | awk -F'|' '{print $1 "| fused" $2 "| all-reduce" $5 "|" $7}'
      step "allreduce_c $b, round $i"
      env SYMMALLOC_LIBRARY_DIR="$L" ${W:+SYMM_BENCH_WORLD=$W} SYMM_BENCH_ALGOS=auto SYMM_BENCH_MAX_BYTES=4M timeout 120 "$L/allreduce_c" \
        > "$OUT/ab_arc_${b}_$i.log" 2>&1
      echo "[rc=$?]"; grep -E "(KiB|MiB) \|" "$OUT/ab_arc_${b}_$i.log" | grep -v enqueue | awk -F'|' '{print $1 "|" $2}'
    done
  done
elif [ "${1:-tests}" = fused ]; then
  step machine; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  T=560 TAILN=${TAILN:-60} run fused python3 bench/fused.py --out "$OUT"
elif [ "${1:-tests}" = p2p ]; then
  # Symmetric memory you program yourself: the signal/wait/put benchmark at 1 rank and
  # at 2 ranks sharing the GPU; the GPU tests at 1 rank and at RANKS (default "2 4 8") sharing it;
  # the CUDA example over the device helpers; the Python/Triton check at TRITON_RANKS.
  step machine; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  T=${T_BENCH:-90} TAILN=16 run p2p_bench_1 env SYMM_BENCH_WORLD=1 $D/p2p_bench
  T=${T_BENCH:-150} TAILN=16 run p2p_bench_2 env SYMM_BENCH_WORLD=2 SYMMALLOC_SHARED_GPU=1 $D/p2p_bench
  T=90 TAILN=4 run gpu_p2p_1 $D/t_gpu_p2p gpu_p2p_one_rank --include-ignored --test-threads=1 --nocapture
  for n in ${RANKS:-2 4 8}; do
    T=150 TAILN=5 run gpu_p2p_$n env SYMMALLOC_SHARED_GPU=1 SYMM_TEST_RANKS=$n $D/t_gpu_p2p gpu_p2p_ring gpu_p2p_a_wait --include-ignored --test-threads=1 --nocapture
  done
  [ -x $D/p2p_allreduce ] && for n in ${EXAMPLE_RANKS:-2 4}; do T=90 TAILN=5 run p2p_example_$n env SYMMALLOC_SHARED_GPU=1 LD_LIBRARY_PATH=$D $D/p2p_allreduce $n; done
  T=${T_TRITON:-300} TAILN=8 run triton_p2p python3 python/tests/triton_p2p_check.py --world ${TRITON_RANKS:-2 4 8}
elif [ "${1:-tests}" = global ]; then
  # Global mode on one GPU (memory given back, host cost), PARTS of: checks (python/tests/global_capture_check.py
  # for PyTorch's allocator and symmalloc), memory (bench/global_memory.py, RUNS pairs), host
  # (bench/torch_global.py, PAIRS rounds, STEPS training steps, MODES; with .device/old present
  # the mode global-old runs that build; MODEL=resnet50 for the ResNet-50 step, BATCH its batch,
  # MODES=default,default-b,global with SHUFFLE=seed for an A/A control in position-balanced
  # shuffled rounds; floor-reuse in MODES for the step's floor), alloc
  # (t_gpu_alloc), api (python/tests/global_api_check.py), build (the C++ allocator built on
  # first use), upstream (python/tests/torch_upstream_check.py: PyTorch's own tests ported), ipc
  # (python/tests/ipc_check.py symmalloc, torch, mixed: torch.multiprocessing's CUDA sharing).
  step machine; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  for part in ${PARTS:-checks memory}; do
    case $part in
      checks) for a in torch symmalloc; do T=150 TAILN=12 run checks_$a python3 python/tests/global_capture_check.py $a; done ;;
      memory) T=${T_MEMORY:-400} TAILN=16 run global_memory python3 bench/global_memory.py --runs "${RUNS:-2}" \
                --replays "${REPLAYS:-100}" --out "$OUT/global_memory.json" ;;
      host) old=(); [ -f "$D/old/libsymmalloc.so" ] && old=(--old-lib "$D/old")
            T=${T_HOST:-400} TAILN=24 run torch_global python3 bench/torch_global.py --pairs "${PAIRS:-6}" --steps "${STEPS:-0}" \
              --modes "${MODES:-default,global,floor${old:+,global-old}}" "${old[@]}" --model "${MODEL:-transformer}" \
              --batch "${BATCH:-64}" ${SHUFFLE:+--shuffle "$SHUFFLE"} --bump "$D/libbump_alloc.so" --out "$OUT" ;;
      alloc) T=200 TAILN=6 run gpu_alloc $D/t_gpu_alloc --include-ignored --test-threads=1 --nocapture ;;
      api) # PyTorch's memory API row by row (the C++ allocator; PyTorch's as the control), then
           # torch.compile(reduce-overhead) under both, compared.
           for a in symmalloc torch; do T=300 TAILN=14 run api_$a python3 python/tests/global_api_check.py $a; done
           T=400 TAILN=6 run api_compare python3 python/tests/global_api_check.py compare ;;
      build) # install_global() on a machine whose torch the staged build does not fit: built on
             # first use into a fresh cache (the staged library is hidden), then used.
           T=300 TAILN=6 run ext_build env SYMMALLOC_TORCH_EXT=/nonexistent SYMMALLOC_CACHE_DIR=$OUT/cache \
             SYMMALLOC_LIBRARY_DIR=/tmp/symm-nolib-$$ python3 -c "import sys; sys.path.insert(0, 'python'); \
             import os, shutil; d = '/tmp/symm-nolib-$$'; os.makedirs(d, exist_ok=True); \
             [shutil.copy('$D/' + f, d) for f in ('libsymmalloc.so', 'libsymmalloc_pluggable.so')]; \
             import symmalloc, torch; symmalloc.install_global(allocator='cpp'); \
             x = torch.ones(10, device='cuda'); print('installed', symmalloc.memory.installed(), \
             torch.cuda.memory_allocated(), os.listdir('$OUT/cache'))" ;;
      upstream) for a in symmalloc torch; do T=400 TAILN=8 run upstream_$a python3 python/tests/torch_upstream_check.py $a; done ;;
      ipc) # CUDA tensors between processes (torch.multiprocessing): PyTorch's one-GPU tests, both
           # sides symmalloc, both PyTorch's, and mixed (each allocator producing for the other).
           for a in symmalloc torch mixed; do T=600 TAILN=24 run ipc_$a python3 python/tests/ipc_check.py $a; done ;;
    esac
  done
elif [ "${1:-tests}" = fp8 ]; then
  step machine; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  [ -n "${SKIP_TESTS:-}" ] || {
  for n in ${RANKS:-2 4 8}; do
    SYMMALLOC_SHARED_GPU=1 SYMM_TEST_RANKS=$n T=${T:-200} TAILN=6 run fused_quant_$n $D/t_fused_quant gpu_ --include-ignored --test-threads=1 --nocapture
  done
  [ "${BITWISE:-1}" = 0 ] || SYMMALLOC_SHARED_GPU=1 SYMM_TEST_RANKS=2 T=300 TAILN=4 run bitwise_2 $D/t_bitwise gpu_ --include-ignored --test-threads=1 --nocapture
  [ "${CHECK:-1}" = 0 ] || SYMMALLOC_SHARED_GPU=1 T=400 TAILN=6 run fp8_check python3 -m torch.distributed.run --nproc_per_node=2 --master_port=29535 python/tests/fp8_check.py
  }
  [ -n "${SKIP_BENCH:-}" ] || SYMMALLOC_LIBRARY_DIR=${LIB:-$D} T=560 TAILN=40 run fused_fp8 python3 bench/fused.py --world 1 --fp8 --hidden "${HIDDEN:-4096,6144,8192}" \
    --tokens "${TOKENS:-1,4,16,64,128,512}" --step-tokens "" --out "$OUT"
elif [ "${1:-tests}" = atp ]; then
  step machine; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  T=${T_CHECK:-400} TAILN=6 run atp_check python3 python/tests/async_tp_check.py --world ${RANKS:-2 4 8} --dying 3
  [ -n "${SKIP_BENCH:-}" ] || T=${T_BENCH:-400} TAILN=24 run atp_bench python3 bench/async_tp.py --world 1 --out "$OUT"
elif [ "${1:-tests}" = x2 ]; then
  # The 2-GPU verdicts (first run on 2026-11-27), PARTS of: tail (bench/tail.py, RUNS fresh processes, with the
  # eager Python-vs-C table), tailab (tail.py --ab-lib .device/old: RUNS, default 5, pairs of
  # fresh jobs of this build and the old one, alternating), fused (bench/fused.py --fp8 at every GPU: HIDDEN, TOKENS,
  # STEP_TOKENS; LIB=DIR: the libraries in DIR), atpcheck (python/tests/async_tp_check.py at RANKS, default "2 4", and its
  # dying rank), atp (bench/async_tp.py), triton (bench/triton_one_shot.py), hier (test_hier's
  # NCCL case between two GPUs), global (bench/global_memory.py on GPU 0, RUNS_GLOBAL
  # pairs). Every part gets at most what is left of BUDGET seconds (default 570), so a call
  # never outruns the device's 600 s limit and the parts that ran come back.
  step machine; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nvidia-smi topo -m | head -4
  end=$(( $(date +%s) + ${BUDGET:-570} ))
  left() { local l=$(( end - $(date +%s) )); [ "$l" -gt "$1" ] && l=$1; echo $(( l > 5 ? l : 5 )); }
  for part in ${PARTS:-fused atp triton hier}; do
    case $part in
      tail) T=$(left 560) TAILN=${TAILN:-70} run tail python3 bench/tail.py --runs "${RUNS:-10}" --out "$OUT" --c-bench "$D/allreduce_c" ;;
      tailab) [ -f "$D/old/libsymmalloc.so" ] || { echo "tailab: no .device/old (scripts/stage-device.sh --old on the other build)"; continue; }
              T=$(left 560) TAILN=${TAILN:-120} run tail_ab python3 bench/tail.py --runs "${RUNS:-5}" --out "$OUT/ab" --ab-lib "$D/old" ;;
      fused) SYMMALLOC_LIBRARY_DIR=${LIB:-$D} T=$(left 400) TAILN=70 run fused python3 bench/fused.py --fp8 --hidden "${HIDDEN:-4096,6144,8192}" \
               --tokens "${TOKENS:-1,8,32,128,512,2048}" --step-tokens "${STEP_TOKENS-1,8,64}" --out "$OUT" ;;
      atpcheck) T=$(left 200) TAILN=8 run atp_check python3 python/tests/async_tp_check.py --world ${RANKS:-2 4} --dying 3 ;;
      atp) T=$(left 200) TAILN=30 run atp_bench python3 bench/async_tp.py --out "$OUT" ;;
      triton) T=$(left 120) TAILN=12 run triton_one_shot python3 bench/triton_one_shot.py ;;
      # The NCCL case alone (the 2 x 2 one sharing a GPU is the one-GPU mode's), its own limit
      # under the part's, -s so each rank's progress lines come back either way.
      hier) t=$(left 300); HIER_GPU_TIMEOUT=$(( t > 60 ? t - 30 : t )) T=$t TAILN=60 run hier_gpu python3 -m pytest -q -rs -s python/tests/test_hier.py -k nccl_between_hosts ;;
      global) CUDA_VISIBLE_DEVICES=0 T=$(left 300) TAILN=16 run global_memory python3 bench/global_memory.py \
                --runs "${RUNS_GLOBAL:-1}" --replays "${REPLAYS:-100}" --out "$OUT/global_memory.json" ;;
    esac
  done
elif [ "${1:-tests}" = multimem ]; then
  step machine; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  for n in ${RANKS:-2 4 8}; do
    SYMMALLOC_SHARED_GPU=1 T=${T:-300} TAILN=6 run multimem_unicast_$n env LD_LIBRARY_PATH=$D $D/multimem_unicast $n
  done
elif [ "${1:-tests}" = hier ]; then
  step machine; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  T=${T:-400} TAILN=8 run hier_gpu python3 -m pytest -q -rs python/tests/test_hier.py -k gpu
elif [ "${1:-tests}" = shared ]; then
  step machine; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  for n in ${RANKS:-2 4}; do
    export SYMMALLOC_SHARED_GPU=1 SYMM_TEST_RANKS=$n
    T=${T:-400} TAILN=14 run gpu_comm_$n $D/t_gpu_comm --include-ignored --test-threads=1 --nocapture ${FILTER:-}
    T=${T:-300} TAILN=5 run gpu_sg_$n $D/t_gpu_sg --include-ignored --test-threads=1 --nocapture ${FILTER:-}
    T=${T:-300} TAILN=5 run bitwise_$n $D/t_bitwise gpu_ --include-ignored --test-threads=1 --nocapture
  done
elif [ "${1:-tests}" = groups ]; then
  # Several communicators per GPU (tests/gpu_groups.rs): a TP and an EP communicator on two
  # streams at once, split vs fresh init, at RANKS (default 4) ranks sharing the GPUs; the
  # benchmark (bench/groups.rs); with TORCH=1 also
  # python/tests/torch_groups_gpu_check.py (MemPools, a compiled graph over two communicators).
  step machine; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  export SYMMALLOC_SHARED_GPU=1 SYMM_TEST_RANKS=${RANKS:-4}
  T=${T:-200} TAILN=8 run gpu_groups_streams $D/t_gpu_groups gpu_tp_and_ep --include-ignored --test-threads=1 --nocapture
  T=${T:-200} TAILN=14 run gpu_groups_cost env SYMMALLOC_DEBUG=INFO $D/t_gpu_groups gpu_split_and_init --include-ignored --test-threads=1 --nocapture
  # The benchmark (bench/groups.rs): split vs init at RANKS ranks, and a child's all-reduce vs a
  # standalone communicator's at one rank per GPU.
  T=${T:-300} TAILN=20 run groups_bench env -u SYMMALLOC_SHARED_GPU SYMM_BENCH_WORLD=${RANKS:-4} $D/groups_bench
  if [ -n "${TORCH:-}" ]; then
    T=${T:-300} TAILN=6 run groups_torch python3 python/tests/torch_groups_gpu_check.py
  fi
elif [ "${1:-tests}" = moe ]; then
  step machine; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  for n in ${RANKS:-2 4 8}; do
    SYMMALLOC_SHARED_GPU=1 SYMM_TEST_RANKS=$n T=${T:-300} TAILN=14 run gpu_moe_$n $D/t_gpu_moe ${FILTER:-} --include-ignored --test-threads=1 --nocapture
  done
elif [ "${1:-tests}" = gpu ]; then
  run gpu_alloc $D/t_gpu_alloc --include-ignored --test-threads=1 --nocapture
  T=200 TAILN=6 run gpu_grown $D/t_grown gpu_ --include-ignored --test-threads=1 --nocapture
  T=400 TAILN=12 run gpu_comm $D/t_gpu_comm --include-ignored --test-threads=1 --nocapture
  T=200 TAILN=6 run gpu_sg $D/t_gpu_sg --include-ignored --test-threads=1 --nocapture
elif [ "${1:-tests}" = tests ]; then
  step machine; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nvidia-smi topo -m | head -5; ldd --version | head -1
  env | grep -E "NVLS|MULTICAST" | sort
  run demo $D/symmalloc-demo
  run unit $D/t_unit --test-threads=2
  run gpu_alloc $D/t_gpu_alloc --include-ignored --test-threads=1 --nocapture
  # The multi-rank suites run one rank per GPU; on a machine with one GPU, 2 ranks share it
  # (SYMMALLOC_SHARED_GPU=1: the same protocol, the kernels time-slice). The torchrun checks
  # take NCCL references, which refuse two ranks on one GPU: they need 2 GPUs and say so.
  NGPU=$(nvidia-smi -L | grep -c "^GPU")
  SHARE=(); [ "$NGPU" -lt 2 ] && { SHARE=(env SYMMALLOC_SHARED_GPU=1 SYMM_TEST_RANKS=2); echo "one GPU: the multi-rank suites run 2 ranks sharing it"; }
  T=200 TAILN=6 run gpu_grown "${SHARE[@]}" $D/t_grown gpu_ --include-ignored --test-threads=1 --nocapture
  T=400 TAILN=25 run gpu_comm "${SHARE[@]}" $D/t_gpu_comm --include-ignored --test-threads=1 --nocapture
  T=200 TAILN=6 run gpu_sg "${SHARE[@]}" $D/t_gpu_sg --include-ignored --test-threads=1 --nocapture
  for mode in mempool graph global scatter_gather; do
    if [ "$NGPU" -lt 2 ]; then echo "[torch_$mode skipped: needs 2 GPUs (NCCL references, one process per GPU); found $NGPU]"; continue; fi
    T=240 TAILN=4 run torch_$mode python3 -m torch.distributed.run --nproc_per_node=2 --master_port=29533 python/tests/torch_gpu_check.py $mode
  done
  step c_harness
  cmake -S tests/c -B /tmp/cbuild -DSYMMALLOC_LIB_DIR=$D -DCUDA_INCLUDE_DIR=/usr/local/cuda/include > "$OUT/c.log" 2>&1 && cmake --build /tmp/cbuild -j 8 >> "$OUT/c.log" 2>&1 && ctest --test-dir /tmp/cbuild --output-on-failure >> "$OUT/c.log" 2>&1; echo "[ctest rc=$?]"; grep -E "tests passed|Test +#|link_test|dlopen|shared" "$OUT/c.log" | tail -14
  for t in link_test dlopen_shim shared_state; do /tmp/cbuild/$t $D 2>&1 | tail -1; done
  step sass
  cuobjdump --dump-sass --gpu-architecture sm_90 $D/symmalloc_kernels.fatbin > "$OUT/sass_sm90.txt" 2>&1
  awk '/Function : symm_multimem_bf16_sum_vec/{f=1} f&&/Function : /&&!/multimem/{f=0} f' "$OUT/sass_sm90.txt" > "$OUT/sass_multimem.txt"
  echo "multimem kernel SASS lines: $(wc -l < $OUT/sass_multimem.txt); multimem instructions:"; grep -oE "[A-Z]+MC[A-Z0-9.]*|MULTIMEM[A-Z0-9.]*" "$OUT/sass_multimem.txt" | sort | uniq -c | head
  grep -E "LDG.E.128|STG.E.128" "$OUT/sass_sm90.txt" | head -2
  cuobjdump --dump-resource-usage $D/symmalloc_kernels.fatbin 2>/dev/null | grep -A1 "two_shot_bf16_sum_vec\|one_shot_ll_bf16_sum_vec" | head -8
  awk "/Function : symm_one_shot_ll_bf16_sum_vec/{f=1} f&&/Function : /&&!/one_shot_ll_bf16_sum_vec/{f=0} f" "$OUT/sass_sm90.txt" | grep -oE "(LDG|STG)[A-Z0-9.]*" | sort | uniq -c
else
  T=200 TAILN=16 run allreduce_c $D/allreduce_c
  T=560 TAILN=30 run allreduce python3 bench/allreduce.py --out "$OUT"
  T=300 TAILN=30 run alloc $D/alloc_bench
fi
