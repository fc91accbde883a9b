#!/usr/bin/env bash
# resume.sh PIPEMAT_RUN CONFIG KIND: pipeline training under mpirun (pipemat-run), AdamW. Ten steps
# straight against four steps (a checkpoint every two), a stop (the processes exit), and
# `--resume latest` to ten: every step's loss in the metrics must be equal, bitwise. Then a
# resume with another schedule kind must fail naming the field, and leave the checkpoints alone.
set -euo pipefail
run="$1" config="$2" kind="$3"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
common=(--set "schedule.kind=$kind" --set training.optimizer=adamw --set training.lr=0.003
        --set output.progress=false)
"$run" -n 2 "$config" -- "${common[@]}" --set training.steps=10 --metrics "$work/straight.jsonl"
"$run" -n 2 "$config" -- "${common[@]}" --set training.steps=4 --set "checkpoint.dir=$work/ck" \
  --set checkpoint.every=2 --metrics "$work/resumed.jsonl"
ls "$work/ck"
[ -f "$work/ck/step-000004/manifest.json" ] || { echo "FAIL: no complete checkpoint of step 4"; exit 1; }
"$run" -n 2 "$config" -- "${common[@]}" --set training.steps=10 --set "checkpoint.dir=$work/ck" \
  --resume latest --metrics "$work/resumed.jsonl"
losses() { grep -o '"step":[0-9]*,"loss":[-0-9.e]*' "$1"; }
[ "$(losses "$work/straight.jsonl" | wc -l)" -eq 10 ] || { echo "FAIL: the straight run has no 10 steps"; exit 1; }
if ! diff <(losses "$work/straight.jsonl") <(losses "$work/resumed.jsonl"); then
  echo "FAIL: the resumed run's losses differ from the straight run's"; exit 1
fi
before=$(ls -R "$work/ck" | md5sum)
other=zb-h1
[ "$kind" = zb-h1 ] && other=1f1b
if out=$("$run" -n 2 "$config" -- "${common[@]}" --set "schedule.kind=$other" --set training.steps=12 \
         --set "checkpoint.dir=$work/ck" --resume latest 2>&1); then
  echo "FAIL: resuming with schedule.kind=$other was accepted"; exit 1
fi
grep -q "schedule_kind is \"$kind\" in the checkpoint but \"$other\" in this pipeline" <<<"$out" ||
  { echo "$out" | tail -5; echo "FAIL: the refusal does not name the field"; exit 1; }
[ "$before" = "$(ls -R "$work/ck" | md5sum)" ] || { echo "FAIL: the refused resume changed the checkpoints"; exit 1; }
echo "ok: 10 losses equal after a stop at step 4 and --resume latest ($kind); a foreign resume is refused"
