#!/usr/bin/env bash
# resume.sh PIPEMAT_RUN CONFIG KIND [--set k=v ...]: pipeline training under mpirun (pipemat-run).
# Ten steps straight against four steps (a checkpoint every two, --stop-after 4: the processes
# exit, the LR schedule still spans ten steps),
# and `--resume latest` to ten: every step's loss and validation loss in the metrics must be
# equal, bitwise (the validation after the last step is a function of the final parameters;
# the rank files themselves are not byte-comparable: LibTorch keys optimizer state by address).
# Then resumes that must be refused, naming what a resume keeps and both values, leaving the
# checkpoints alone: another number of micro-batches per step (the global batch), another seed.
# Another schedule kind, and another world size, resume (Note [Checkpoint load planner] in
# pp/src/checkpoint_load.cpp: format 4 names tensors by their global names), saying "resharded
# from" the checkpoint's layout "to" theirs (tests/e2e/reshard.sh checks their losses).
set -euo pipefail
run="$1" config="$2" kind="$3"
shift 3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
common=(--set "schedule.kind=$kind" --set output.progress=false --set 'output.loss_svg=""'
        --set 'sample.tokens=0' "$@")
"$run" -n 2 "$config" -- "${common[@]}" --set training.steps=10 --set "checkpoint.dir=$work/straight" \
  --metrics "$work/straight.jsonl"
"$run" -n 2 "$config" -- "${common[@]}" --set training.steps=10 --set "checkpoint.dir=$work/ck" \
  --set checkpoint.every=2 --stop-after 4 --metrics "$work/resumed.jsonl"
[ -f "$work/ck/step-000004/manifest.json" ] || { echo "FAIL: no complete checkpoint of step 4"; exit 1; }
"$run" -n 2 "$config" -- "${common[@]}" --set training.steps=10 --set "checkpoint.dir=$work/ck" \
  --resume latest --metrics "$work/resumed.jsonl"
losses() { grep -o '"step":[0-9]*,"loss":[-0-9.e]*\(,"val_loss":[-0-9.e]*\)\?' "$1"; }
[ "$(losses "$work/straight.jsonl" | wc -l)" -eq 10 ] || { echo "FAIL: the straight run has no 10 steps"; exit 1; }
if ! diff <(losses "$work/straight.jsonl") <(losses "$work/resumed.jsonl"); then
  echo "FAIL: the resumed run's losses differ from the straight run's"; exit 1
fi
# The validation loss after the last step is computed from the final parameters.
grep -q '"step":9,"loss":[-0-9.e]*,"val_loss"' "$work/resumed.jsonl" ||
  { echo "FAIL: no validation loss after the last step"; exit 1; }
before=$(ls -lR --time-style=+%s.%N "$work/ck" | md5sum)
ck="$work/ck/step-000010"
if out=$("$run" -n 2 "$config" -- "${common[@]}" --set schedule.micro_batches=8 --set training.steps=12 \
         --set "checkpoint.dir=$work/ck" --resume latest 2>&1); then
  echo "FAIL: resuming with schedule.micro_batches=8 was accepted"; exit 1
fi
grep -q "load_checkpoint: $ck was written with 4 micro-batches x 1 data replicas = 4 micro-batches per step, this pipeline has 8 x 1 = 8; a resume keeps the global batch (the micro-batch count times the data degree)" <<<"$out" ||
  { echo "$out" | tail -5; echo "FAIL: the micro-batches refusal does not name both counts"; exit 1; }
if out=$("$run" -n 2 "$config" -- "${common[@]}" --set training.seed=1 --set training.steps=12 \
         --set "checkpoint.dir=$work/ck" --resume latest 2>&1); then
  echo "FAIL: resuming with training.seed=1 was accepted"; exit 1
fi
grep -q "checkpoint.resume: $ck was written by a run with training.seed 0 but this run has 1; a resume keeps training.seed (the seed and the batch: what each step trains on), whatever the layout" <<<"$out" ||
  { echo "$out" | tail -5; echo "FAIL: the seed refusal does not name both seeds"; exit 1; }
[ "$before" = "$(ls -lR --time-style=+%s.%N "$work/ck" | md5sum)" ] ||
  { echo "FAIL: a refused resume changed the checkpoints"; exit 1; }
# Another schedule kind, and one rank holding both stages: they resume, and say so (the progress
# stream says it).
other=zb-h1
[ "$kind" = zb-h1 ] && other=1f1b
out=$("$run" -n 2 "$config" -- "${common[@]}" --set output.progress=true --set "schedule.kind=$other" \
      --set training.steps=12 --set "checkpoint.dir=$work/other" --resume "$ck" 2>&1) ||
  { echo "$out" | tail -5; echo "FAIL: resuming with schedule.kind=$other was refused"; exit 1; }
grep -Eq "^resharded from 2 ranks \($kind, [^)]*\) to 2 ranks \($other, [^)]*\)$" <<<"$out" ||
  { echo "$out" | tail -5; echo "FAIL: the resume on $other does not say it resharded"; exit 1; }
[ -f "$work/other/step-000012/manifest.json" ] || { echo "FAIL: the resume on $other did not train to step 12"; exit 1; }
out=$("$run" -n 1 "$config" -- "${common[@]}" --set output.progress=true --set schedule.ranks=1 \
      --set training.steps=12 --set "checkpoint.dir=$work/one" --resume "$ck" 2>&1) ||
  { echo "$out" | tail -5; echo "FAIL: resuming on 1 rank was refused"; exit 1; }
grep -Eq "^resharded from 2 ranks \($kind, [^)]*\) to 1 rank \($kind, [^)]*\)$" <<<"$out" ||
  { echo "$out" | tail -5; echo "FAIL: the resume on 1 rank does not say it resharded"; exit 1; }
[ -f "$work/one/step-000012/manifest.json" ] || { echo "FAIL: the resume on 1 rank did not train to step 12"; exit 1; }
echo "ok: 10 losses and the final validation loss equal after a stop at step 4 and --resume latest" \
     "($kind); resumes with other micro-batches or another seed are refused; on $other and on" \
     "1 rank they reshard"
