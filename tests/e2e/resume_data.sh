#!/usr/bin/env bash
# resume_data.sh PIPEMAT_RUN PIPEMAT CONFIG [--set k=v ...]: checkpoints of 2 replicas of a
# 2-rank pipeline under mpirun (pipemat-run -n 4, parallel.data=2), resumed
#   * by 2 replicas again (mpirun -np 4): the steps after the checkpoint equal the straight
#     run's, bitwise;
#   * by 1 replica (another data degree, the same pipeline) under mpirun -np 2 and as threads in
#     one process (transport.kind=local): the two equal each other bitwise, and differ from the
#     2-replica steps (half the global batch).
set -euo pipefail
run="$1" pipemat="$2" config="$3"
shift 3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
common=(--set output.progress=false --set 'output.loss_svg=""' --set sample.tokens=0
        --set training.steps=6 "$@")
two=(--set parallel.data=2)
"$run" -n 4 "$config" -- "${common[@]}" "${two[@]}" --set "checkpoint.dir=$work/straight" \
  --metrics "$work/straight.jsonl"
"$run" -n 4 "$config" -- "${common[@]}" "${two[@]}" --set "checkpoint.dir=$work/ck" \
  --set checkpoint.every=2 --stop-after 4 --metrics "$work/first.jsonl"
ck="$work/ck/step-000004"
[ -f "$ck/manifest.json" ] || { echo "FAIL: no complete checkpoint of step 4"; exit 1; }
"$run" -n 4 "$config" -- "${common[@]}" "${two[@]}" --set "checkpoint.dir=$work/again" \
  --resume "$ck" --metrics "$work/again.jsonl"
"$run" -n 2 "$config" -- "${common[@]}" --set "checkpoint.dir=$work/one-mpi" --resume "$ck" \
  --metrics "$work/one-mpi.jsonl"
"$pipemat" train --config "$config" "${common[@]}" --set transport.kind=local \
  --set "checkpoint.dir=$work/one-local" --resume "$ck" --metrics "$work/one-local.jsonl"
losses() { grep -o '"step":[0-9]*,"loss":[-0-9.e]*' "$1"; }
after() { losses "$1" | grep -E '"step":[45],'; }
[ "$(after "$work/straight.jsonl" | wc -l)" -eq 2 ] || { echo "FAIL: the straight run has no steps 5 and 6"; exit 1; }
diff <(after "$work/straight.jsonl") <(losses "$work/again.jsonl") ||
  { echo "FAIL: 2 replicas resumed differ from the straight run"; exit 1; }
[ "$(losses "$work/one-mpi.jsonl" | wc -l)" -eq 2 ] || { echo "FAIL: 1 replica did not run steps 5 and 6"; exit 1; }
diff <(losses "$work/one-mpi.jsonl") <(losses "$work/one-local.jsonl") ||
  { echo "FAIL: 1 replica resumed under mpirun differs from the same in one process"; exit 1; }
if diff -q <(losses "$work/one-mpi.jsonl") <(losses "$work/again.jsonl") >/dev/null; then
  echo "FAIL: 1 replica's steps equal 2 replicas' (the global batch should be half)"; exit 1
fi
echo "ok: a 2 x 2 checkpoint resumed by 2 replicas equals the straight run; by 1 replica, mpirun equals threads:"
paste -d' ' <(after "$work/straight.jsonl") <(losses "$work/one-mpi.jsonl")
