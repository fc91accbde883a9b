#!/usr/bin/env bash
# resume_data.sh PIPEMAT_RUN PIPEMAT CONFIG [--set k=v ...]: checkpoints of 2 replicas of a
# 2-rank pipeline under mpirun (pipemat-run -n 4, parallel.data=2), resumed
#   * by 2 replicas again (mpirun -np 4): the steps after the checkpoint equal the straight
#     run's, bitwise;
#   * by 1 replica (another data degree, the same pipeline) of twice the micro-batches (the same
#     micro-batches per step: a resume keeps the global batch) under mpirun -np 2 and as threads
#     in one process (transport.kind=local): the two equal each other bitwise;
#   * by 1 replica of the checkpoint's micro-batches (half the global batch): refused, naming
#     both counts.
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
one=(--set schedule.micro_batches=8)
"$run" -n 2 "$config" -- "${common[@]}" "${one[@]}" --set "checkpoint.dir=$work/one-mpi" \
  --resume "$ck" --metrics "$work/one-mpi.jsonl"
"$pipemat" train --config "$config" "${common[@]}" "${one[@]}" --set transport.kind=local \
  --set "checkpoint.dir=$work/one-local" --resume "$ck" --metrics "$work/one-local.jsonl"
if out=$("$pipemat" train --config "$config" "${common[@]}" --set transport.kind=local \
         --set "checkpoint.dir=$work/half" --resume "$ck" 2>&1); then
  echo "FAIL: 1 replica of 4 micro-batches resumed a checkpoint of 2 x 4"; exit 1
fi
grep -q "load_checkpoint: $ck was written with 4 micro-batches x 2 data replicas = 8 micro-batches per step, this pipeline has 4 x 1 = 4; a resume keeps the global batch (the micro-batch count times the data degree)" <<<"$out" ||
  { echo "$out" | tail -5; echo "FAIL: the refusal of half the global batch does not name both counts"; exit 1; }
losses() { grep -o '"step":[0-9]*,"loss":[-0-9.e]*' "$1"; }
after() { losses "$1" | grep -E '"step":[45],'; }
[ "$(after "$work/straight.jsonl" | wc -l)" -eq 2 ] || { echo "FAIL: the straight run has no steps 5 and 6"; exit 1; }
diff <(after "$work/straight.jsonl") <(losses "$work/again.jsonl") ||
  { echo "FAIL: 2 replicas resumed differ from the straight run"; exit 1; }
[ "$(losses "$work/one-mpi.jsonl" | wc -l)" -eq 2 ] || { echo "FAIL: 1 replica did not run steps 5 and 6"; exit 1; }
diff <(losses "$work/one-mpi.jsonl") <(losses "$work/one-local.jsonl") ||
  { echo "FAIL: 1 replica resumed under mpirun differs from the same in one process"; exit 1; }
echo "ok: a 2 x 2 checkpoint resumed by 2 replicas equals the straight run; by 1 replica of 8" \
     "micro-batches, mpirun equals threads; of 4, it is refused:"
paste -d' ' <(after "$work/straight.jsonl") <(losses "$work/one-mpi.jsonl")
