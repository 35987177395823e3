#!/usr/bin/env bash
# Several device-run.sh modes in one device call, each with its own settings, within one time
# budget; every mode's logs go to a folder of their own and all of them come back as ONE file,
# $OUT/logs.tgz, re-packed after each mode (a call returns a few files only, and a call cut off
# at its limit still returns what finished).
#   bash scripts/device-batch.sh "fp8 SKIP_BENCH=1" "groups TORCH=1" "shared RANKS=2"
# Each argument: a mode, then VAR=value settings for it (a '+' in a value stands for a space:
# RANKS=2+4 is RANKS="2 4"; commas stay, as in TOKENS=1,8,32). BUDGET (default 570 s) bounds the whole
# batch: a mode starts only with at least MIN_LEFT (default 60) s left, and runs under `timeout`
# for what is left. Safety: device-run.sh sources device-env.sh (multicast stays off).
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
FINAL=${OUT:-/tmp/symm-out}
LOGS=$(mktemp -d /tmp/symm-batch.XXXX)
mkdir -p "$FINAL"
end=$(( $(date +%s) + ${BUDGET:-570} ))
for spec in "$@"; do
  read -r -a words <<< "$spec"
  for i in "${!words[@]}"; do words[$i]=${words[$i]//+/ }; done
  mode=${words[0]}
  left=$(( end - $(date +%s) ))
  if [ "$left" -lt "${MIN_LEFT:-60}" ]; then echo "=== $mode: skipped, ${left} s left ==="; continue; fi
  dir=$LOGS/$mode; n=1; while [ -e "$dir" ]; do n=$((n + 1)); dir=$LOGS/$mode.$n; done; mkdir -p "$dir"
  echo; echo "##### $spec (${left} s left) #####"
  t0=$(date +%s)
  ( cd "$ROOT" && env OUT="$dir" "${words[@]:1}" timeout "$left" bash scripts/device-run.sh "$mode" ) 2>&1 | tee "$dir/batch.log"
  echo "##### $mode took $(( $(date +%s) - t0 )) s #####"
  tar czf "$FINAL/logs.tgz" -C "$LOGS" .
done
