#!/usr/bin/env bash
# resume.sh PIPEMAT_RUN CONFIG KIND [--set k=v ...]: pipeline training under mpirun (pipemat-run).
# Ten steps straight against four steps (a checkpoint every two, --stop-after 4: the processes
# exit, the LR schedule still spans ten steps),
# and `--resume latest` to ten: every step's loss and validation loss in the metrics must be
# equal, bitwise (the validation after the last step is a function of the final parameters;
# the rank files themselves are not byte-comparable: LibTorch keys optimizer state by address).
# Then resumes that must be refused, naming the field, leaving the checkpoints alone: another
# schedule kind, and another world size.
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
other=zb-h1
[ "$kind" = zb-h1 ] && other=1f1b
if out=$("$run" -n 2 "$config" -- "${common[@]}" --set "schedule.kind=$other" --set training.steps=12 \
         --set "checkpoint.dir=$work/ck" --resume latest 2>&1); then
  echo "FAIL: resuming with schedule.kind=$other was accepted"; exit 1
fi
grep -q "schedule_kind is \"$kind\" in the checkpoint but \"$other\" in this pipeline" <<<"$out" ||
  { echo "$out" | tail -5; echo "FAIL: the refusal does not name the field"; exit 1; }
# Another world size: one rank holding both stages.
if out=$("$run" -n 1 "$config" -- "${common[@]}" --set schedule.ranks=1 --set training.steps=12 \
         --set "checkpoint.dir=$work/ck" --resume latest 2>&1); then
  echo "FAIL: resuming on 1 rank was accepted"; exit 1
fi
grep -q "world_size is 2 in the checkpoint but 1 in this pipeline" <<<"$out" ||
  { echo "$out" | tail -5; echo "FAIL: the world-size refusal does not name the field"; exit 1; }
[ "$before" = "$(ls -lR --time-style=+%s.%N "$work/ck" | md5sum)" ] ||
  { echo "FAIL: a refused resume changed the checkpoints"; exit 1; }
echo "ok: 10 losses and the final validation loss equal after a stop at step 4 and --resume latest" \
     "($kind); resumes with another schedule or world size are refused"
