#!/usr/bin/env bash
# Reads what limits the large all-reduce (2 GPUs) and the MoE throughput kernels (one GPU), from
# prebuilt artifacts in .device/ (scripts/stage-device.sh) or bench sources. Logs go to $OUT.
#   probe: bench/link_probe.cu, the NVLink traffic patterns without symmalloc
#   copy:  bench/copy_sms.cu, a row copy on 24, 32 and all SMs (registers or the bulk-copy
#          engine), one GPU: the floor under the MoE throughput kernels at an SM budget
#   ncu:   Nsight Compute on the two-shot kernel at 64 MiB; rank 0 alone runs under ncu and
#          the peer runs unprofiled, so the profiled kernel's barriers find a live peer. The
#          metrics must fit in one pass: a replayed pass would wait for a peer that has moved on.
# Safety: NVLink multicast stays off (scripts/device-env.sh).
. "$(dirname "$0")/device-env.sh"
export PATH=$PATH:/usr/local/cuda/bin
what=${1:-all}

if [ "$what" = copy ]; then
  nvcc -O3 -arch=sm_90 -o /tmp/copy_sms bench/copy_sms.cu || exit 1
  timeout 300 /tmp/copy_sms | tee "$OUT/copy_sms.log"
  exit "${PIPESTATUS[0]}"
fi

P=/tmp/link_probe
nvcc -O3 -arch=sm_90 -o $P bench/link_probe.cu || exit 1

if [ "$what" = probe ] || [ "$what" = all ]; then
  echo "=== link_probe ==="
  timeout 300 $P "${PROBE_MIB:-64}" | tee "$OUT/link_probe.log"
fi

if [ "$what" = ncu ] || [ "$what" = all ]; then
  echo "=== ncu ==="
  NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  if [ -z "$NCU" ]; then echo "no ncu on this machine"; exit 1; fi
  "$NCU" --version | tail -1
  # The largest metric set that ncu collects in one pass, tried on the probe's write kernel.
  M=
  for m in gpu__time_duration.sum,nvlrx__bytes.sum,nvltx__bytes.sum,nvlrx__bytes_data_user.sum,nvltx__bytes_data_user.sum,dram__bytes_read.sum,dram__bytes_write.sum \
           gpu__time_duration.sum,nvlrx__bytes.sum,nvltx__bytes.sum,nvlrx__bytes_data_user.sum,nvltx__bytes_data_user.sum \
           gpu__time_duration.sum,nvlrx__bytes.sum,nvltx__bytes.sum gpu__time_duration.sum; do
    passes=$("$NCU" --clock-control none --cache-control none -k regex:copy -c 1 --metrics $m $P 8 write 2>&1 | grep -oE "[0-9]+ pass" | head -1)
    echo "$m: $passes"
    if [ "$passes" = "1 pass" ]; then M=$m; break; fi
  done
  [ -n "$M" ] || { echo "no one-pass metric set"; exit 1; }
  # NVLink counters need 3 passes, so they are read on the probe's kernels (no peer waits),
  # one GPU at a time (ncu serializes): link efficiency per pattern, one direction loaded.
  NVL=gpu__time_duration.sum,nvlrx__bytes.sum,nvltx__bytes.sum,nvlrx__bytes_data_user.sum,nvltx__bytes_data_user.sum
  for pat in read write bulk twoshot; do
    "$NCU" --clock-control none --cache-control none --devices 0 -s 3 -c 1 --metrics $NVL --csv $P 64 $pat 132 512 2>/dev/null |
      grep -vE "^==" | awk -F'","' -v p=$pat 'NR>1 {gsub(/"/,"",$15); printf "%s %s=%s\n", p, $13, $15}'
  done | tee "$OUT/ncu_probe.txt"
  [ "${NCU_PROBE_ONLY:-0}" = 1 ] && exit 0
  SYMMALLOC_TIMEOUT_S=60 SYMM_BENCH_MIN_BYTES=64M SYMM_BENCH_MAX_BYTES=64M \
    SYMM_BENCH_RANK0_WRAP="$NCU --clock-control none --cache-control none -k regex:${NCU_KERNEL:-two_shot_bf16_sum_vec} --launch-skip 10 --launch-count 3 --metrics $M --csv --log-file $OUT/ncu.csv" \
    timeout 400 "$D/allreduce_c" > "$OUT/ncu_run.log" 2>&1
  echo "[allreduce_c under ncu rc=$?]"; tail -5 "$OUT/ncu_run.log"
  grep -vE "^==PROF==" "$OUT/ncu.csv" | awk -F'","' '{print $5, $13, $14, $15}' | head -40
fi
