#!/usr/bin/env bash
# checkpoint_crash.sh PIPEMAT_RUN CONFIG POINT RANK [--set k=v ...]: a save killed by SIGKILL in
# the middle (Note [Checkpoint crash injection]: POINT rank-file = half of RANK's file written,
# manifest = every rank file published, no manifest yet) must leave the previous checkpoint
# loadable and the partial one ignored by --resume latest and refused when named; resuming from
# the previous one then gives the losses of an uninterrupted run.
set -euo pipefail
run="$1" config="$2" point="$3" rank="$4"
shift 4
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
common=(--set output.progress=false --set 'output.loss_svg=""' --set 'sample.tokens=0'
        --set training.steps=6 --set checkpoint.keep_last=0 "$@")
"$run" -n 2 "$config" -- "${common[@]}" --set "checkpoint.dir=$work/straight" \
  --metrics "$work/straight.jsonl"
if PIPEMAT_TEST_KILL_IN_CHECKPOINT="4:$point:$rank" "$run" -n 2 "$config" -- "${common[@]}" \
     --set "checkpoint.dir=$work/ck" --set checkpoint.every=2 --metrics "$work/run.jsonl" \
     >"$work/crash.log" 2>&1; then
  echo "FAIL: the run with a kill in the save of step 4 exited 0"; exit 1
fi
grep -q "killed in the save of step 4 at $point" "$work/crash.log" ||
  { tail -5 "$work/crash.log"; echo "FAIL: the kill was not injected"; exit 1; }
[ -f "$work/ck/step-000002/manifest.json" ] || { echo "FAIL: checkpoint 2 is not complete"; exit 1; }
[ ! -f "$work/ck/step-000004/manifest.json" ] || { echo "FAIL: the killed save has a manifest"; exit 1; }
ls "$work/ck/step-000004"
if out=$("$run" -n 2 "$config" -- "${common[@]}" --set "checkpoint.dir=$work/ck" \
         --resume "$work/ck/step-000004" 2>&1); then
  echo "FAIL: the partial checkpoint was loaded"; exit 1
fi
grep -q "is not a complete checkpoint (no manifest.json" <<<"$out" ||
  { echo "$out" | tail -5; echo "FAIL: the refusal of the partial checkpoint is not clear"; exit 1; }
"$run" -n 2 "$config" -- "${common[@]}" --set "checkpoint.dir=$work/ck" --resume latest \
  --metrics "$work/run.jsonl" | tee "$work/resume.log"
losses() { grep -o '"step":[0-9]*,"loss":[-0-9.e]*' "$1"; }
# The crashed run logged steps 0-3; the resume from step 2 logs 2-5: keep the last of each.
merged=$(losses "$work/run.jsonl" | awk -F'[:,]' '{last[$2]=$0} END {for (s = 0; s < 6; s++) print last[s]}')
if ! diff <(losses "$work/straight.jsonl") <(echo "$merged"); then
  echo "FAIL: the run resumed from step 2 differs from the uninterrupted run"; exit 1
fi
echo "ok: a save killed at $point (rank $rank) left step 2 loadable; the partial step 4 was refused"
