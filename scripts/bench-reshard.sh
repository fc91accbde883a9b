#!/usr/bin/env bash
# bench-reshard.sh [--config CONFIG] [--rounds N] [--set k=v ...]: what a resume reads and how long
# it takes, on the layout that wrote the checkpoint and on others (Note [Checkpoint load planner]
# in pp/src/checkpoint_load.cpp). Trains 2 steps of CONFIG (default configs/dp-pp.yaml: 2 ranks x 2
# replicas, zb-v) under pipemat-run with a checkpoint, then resumes it for one
# step on: the same layout; 4 ranks x 1 replica (1f1b, the micro-batches doubled: the same global
# batch); 2 ranks x 2 replicas unsharded (1f1b). Prints per layout every rank's bytes read against
# the bytes of the tensors it holds (of the last round), and the load's time (the fastest and the
# slowest of N rounds, default 3), the same layout's first. The machine and its load come first (compare only within one run).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
config="$root/configs/dp-pp.yaml" rounds=3 extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --config) config="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --set) extra+=(--set "$2"); shift 2 ;;
    -h|--help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "bench-reshard: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
run="$root/build/launch/pipemat-run"
[ -x "$run" ] || { echo "bench-reshard: build first (bash scripts/build.sh)" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
echo "machine: $(lscpu | sed -n 's/^Model name: *//p' | head -1), $(nproc) hardware threads; load:$(cut -d' ' -f1-3 /proc/loadavg | sed 's/^/ /')"
common=(--set 'sample.tokens=0' --set 'output.loss_svg=""' --set training.eval_every=0
        --set output.reference_steps=0 --set checkpoint.keep_last=0 --set training.steps=3
        --set transport.kind=mpi "${extra[@]}")
"$run" -n 4 "$config" -- "${common[@]}" --set "checkpoint.dir=$work/ck" --stop-after 2 >/dev/null
size=$(du -sb "$work/ck/step-000002" | cut -f1)
micro=$("$root/build/launch/pipemat" train --config "$config" "${common[@]}" --print-config |
        sed -n 's/^  micro_batches: //p')
echo "checkpoint: $(python3 -c "print(f'{$size/2**20:.2f} MiB')") in $(ls "$work/ck/step-000002" | wc -l) files (configs: $(basename "$config"))"
layouts=("same layout|4|"
         "4 ranks x 1 replica, 1f1b|4|--set schedule.kind=1f1b --set schedule.ranks=4 --set parallel.data=1 --set schedule.micro_batches=$((micro * 2)) --set parallel.shard_optimizer=false"
         "2 ranks x 2 replicas unsharded, 1f1b|4|--set schedule.kind=1f1b --set parallel.shard_optimizer=false")
for entry in "${layouts[@]}"; do
  IFS='|' read -r name n sets <<<"$entry"
  best="" worst="" line=""
  for _ in $(seq 1 "$rounds"); do
    rm -rf "$work/out"
    # shellcheck disable=SC2086
    out=$("$run" -n "$n" "$config" -- "${common[@]}" --set output.progress=true \
          --set "checkpoint.dir=$work/out" --resume "$work/ck/step-000002" $sets 2>&1) ||
      { echo "$out" | tail -3; exit 1; }
    line=$(grep "^resumed from" <<<"$out")
    seconds=$(grep -o "in [0-9.]* s$" <<<"$line" | grep -o "[0-9.]*")
    if [ -z "$best" ] || python3 -c "import sys; sys.exit(0 if $seconds < $best else 1)"; then
      best=$seconds
    fi
    if [ -z "$worst" ] || python3 -c "import sys; sys.exit(0 if $seconds > $worst else 1)"; then
      worst=$seconds
    fi
  done
  echo "$name: load ${best}-${worst} s ($rounds rounds); last round: ${line#*: }"
done
