#!/usr/bin/env bash
# reference.sh PIPEMAT_RUN PIPEMAT RANKS CONFIG [--set k=v ...]: the pipeline under mpirun (with
# RUN_FLAGS=--tcp in the environment: processes over TCP) and `pipemat train --reference` (one
# process, the threads of one rank) print the same losses, bitwise, in their metrics files.
set -euo pipefail
run="$1" pipemat="$2" ranks="$3" config="$4"
shift 4
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# shellcheck disable=SC2086  # RUN_FLAGS: words for pipemat-run
"$run" -n "$ranks" "$config" ${RUN_FLAGS:-} -- "$@" --set output.progress=false --metrics "$work/pipe.jsonl"
"$pipemat" train --config "$config" "$@" --set output.progress=false --reference \
  --metrics "$work/ref.jsonl"
losses() { grep -o '"step":[0-9]*,"loss":[-0-9.e]*' "$1"; }
[ "$(losses "$work/pipe.jsonl" | wc -l)" -gt 0 ] || { echo "FAIL: no losses"; exit 1; }
diff <(losses "$work/pipe.jsonl") <(losses "$work/ref.jsonl") ||
  { echo "FAIL: --reference differs from the pipeline"; exit 1; }
echo "ok: $(losses "$work/ref.jsonl" | wc -l) losses of --reference equal the $ranks-rank pipeline's"
