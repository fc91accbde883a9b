#!/usr/bin/env bash
# checkpoint_states.sh PIPEMAT_RUN PIPEMAT TRANSPORT GROUP CONFIG [--set k=v ...]
# A run meets every state its checkpoint.dir can be in (Note [Checkpoint directories],
# docs/training.md "Checkpoints"), under mpirun (TRANSPORT mpi) or the tcp transport (tcp): it
# either trains and leaves the newest complete checkpoint of its run intact, or stops at once
# with a clear error; never a crash, never a deletion of what it did not write.
#   GROUP dir:      empty; this run's older steps (resume); another run's later steps (refused,
#                   then checkpoint.overwrite); a partial save; files that are no checkpoint.
#   GROUP readonly: a read-only checkpoint.dir (refused before training).
#   GROUP full:     a full disk (the save of step 2 fails: the run stops with step 1 intact;
#                   the save after the last step fails: exit code 3, training finished).
# The last two mount small tmpfs file systems in a private mount namespace; where the kernel
# refuses that, they are skipped (exit 77) with the reason.
set -euo pipefail
run="$1" pipemat="$2" transport="$3" group="$4" config="$5"
shift 5
if [ "$group" != dir ] && [ -z "${PIPEMAT_STATES_NS:-}" ]; then
  if ! unshare -m --propagation private true 2>/dev/null; then
    echo "skipped: no private mount namespace here (unshare -m refused), needed for tmpfs"; exit 77
  fi
  PIPEMAT_STATES_NS=1 exec unshare -m --propagation private "$0" "$run" "$pipemat" "$transport" \
    "$group" "$config" "$@"
fi
work=$(mktemp -d)
trap 'umount -q "$work"/mnt* 2>/dev/null || true; rm -rf "$work"' EXIT
flags=()
[ "$transport" = tcp ] && flags=(--tcp)
common=(--set output.progress=true --set 'output.loss_svg=""' --set 'sample.tokens=0'
        --set checkpoint.keep_last=1 "$@")
train() {  # train DIR STEPS [more args]: runs the job, its output in $work/out, its exit code in $rc
  local dir="$1" steps="$2"
  shift 2
  rc=0
  "$run" -n 2 "${flags[@]}" "$config" -- "${common[@]}" --set "checkpoint.dir=$dir" \
    --set "training.steps=$steps" "$@" >"$work/out" 2>&1 || rc=$?
}
fail() { tail -15 "$work/out"; echo "FAIL ($transport, $group): $*"; exit 1; }
expect_ok() { [ "$rc" -eq 0 ] || fail "exit code $rc: $*"; }
expect_refused() {  # expect_refused REGEX WHAT
  [ "$rc" -ne 0 ] || fail "accepted: $2"
  grep -Eq "$1" "$work/out" || fail "the refusal does not say '$1': $2"
  if grep -q "^step 1/" "$work/out"; then fail "trained before refusing: $2"; fi
}
run_id() { grep -o '"id": "[0-9a-f]*"' "$1/manifest.json"; }
steps_in() { ls "$1" | tr '\n' ' '; }
# The job's lock file (.pipemat-lock, Note [One job per file]) names its latest holder: not data.
listing() { (cd "$1" && find . ! -name .pipemat-lock -printf '%p %s %T@\n' | sort | md5sum); }

case "$group" in
dir)
  # Empty (not even created yet): trains, one complete checkpoint.
  train "$work/ck" 2
  expect_ok "an empty checkpoint.dir"
  grep -q "checkpoints: $work/ck, run [0-9a-f]* (new)" "$work/out" || fail "no run line"
  [ -f "$work/ck/step-000002/manifest.json" ] || fail "no complete step 2"
  first=$(run_id "$work/ck/step-000002")
  # This run's older steps: resuming continues the run and prunes its own older checkpoint.
  train "$work/ck" 4 --resume latest
  expect_ok "resume over this run's step 2"
  grep -q "(continued)" "$work/out" || fail "the resumed run is not the same run"
  [ "$(steps_in "$work/ck")" = "step-000004 " ] || fail "after keep_last 1: $(steps_in "$work/ck")"
  [ "$(run_id "$work/ck/step-000004")" = "$first" ] || fail "the resumed run has another id"
  # Another run's later steps: a run from step 0 with fewer steps is refused before training,
  # and nothing changes; checkpoint.overwrite=true removes them and starts there.
  before=$(listing "$work/ck")
  train "$work/ck" 3
  expect_refused "checkpoint.dir '$work/ck' already holds checkpoints: 1 complete checkpoint of run [0-9a-f]{12} \(step 4, newest $work/ck/step-000004, written with another config\)\. This run starts at step 0 and leaves them alone\. To continue that run: --resume latest" \
    "a new run into another run's step 4"
  [ "$before" = "$(listing "$work/ck")" ] || fail "the refused run changed the directory"
  train "$work/ck" 3 --set checkpoint.overwrite=true
  expect_ok "checkpoint.overwrite"
  grep -q "checkpoint.overwrite: removed 1 step directory from $work/ck" "$work/out" || fail "no removal line"
  [ "$(steps_in "$work/ck")" = "step-000003 " ] || fail "after overwrite: $(steps_in "$work/ck")"
  [ "$(run_id "$work/ck/step-000003")" != "$first" ] || fail "the overwriting run kept the old id"
  # A partial save (no manifest) beside a complete one: a new run is refused (naming it), a
  # resume continues from the complete one and completes the partial step.
  cp -r "$work/ck/step-000003" "$work/ck/step-000005"
  rm "$work/ck/step-000005/manifest.json"
  train "$work/ck" 6
  expect_refused "1 incomplete \(no manifest: $work/ck/step-000005\)" "a new run beside a partial save"
  train "$work/ck" 5 --resume latest --set checkpoint.keep_last=0
  expect_ok "resume beside a partial save"
  grep -q "resumed from $work/ck/step-000003 after step 3" "$work/out" || fail "did not resume step 3"
  [ -f "$work/ck/step-000005/manifest.json" ] || fail "step 5 is not complete"
  [ -f "$work/ck/step-000003/manifest.json" ] || fail "step 3 went away with keep_last 0"
  # Files that are no checkpoint are never touched: a new run beside them trains, and pruning
  # leaves them.
  mkdir -p "$work/other/notes"
  echo "mine" >"$work/other/notes.txt"
  echo "mine too" >"$work/other/notes/a"
  mkdir "$work/other/step-abc"
  train "$work/other" 2
  expect_ok "a new run beside foreign files"
  train "$work/other" 3 --resume latest
  expect_ok "resume beside foreign files"
  [ "$(steps_in "$work/other")" = "notes notes.txt step-000003 step-abc " ] ||
    fail "foreign files changed: $(steps_in "$work/other")"
  [ "$(cat "$work/other/notes.txt")" = mine ] && [ "$(cat "$work/other/notes/a")" = "mine too" ] ||
    fail "foreign files changed"
  # Two runs' checkpoints in one directory: --resume latest does not guess.
  cp -r "$work/ck/step-000005" "$work/other/step-000009"
  train "$work/other" 12 --resume latest
  expect_refused "holds the checkpoints of 2 runs: .*name the step directory to resume" \
    "--resume latest over two runs"
  echo "ok ($transport): empty, own older steps, another run's later steps (refused; overwrite)," \
       "a partial save, foreign files, two runs"
  ;;
readonly)
  mkdir "$work/mnt"
  mount -t tmpfs -o size=1m,ro tmpfs "$work/mnt"
  train "$work/mnt" 2
  expect_refused "checkpoint.dir '$work/mnt' is not writable \(rank [01]\): Read-only file system" \
    "a read-only checkpoint.dir"
  train "$work/mnt/ck" 2
  expect_refused "checkpoint.dir '$work/mnt/ck' cannot be created \(rank [01]\): Read-only file system" \
    "a checkpoint.dir that cannot be created"
  echo "ok ($transport): a read-only checkpoint.dir is refused before training"
  ;;
full)
  # Room for the first checkpoint and a part of the second.
  probe="$work/probe"
  train "$probe" 1
  expect_ok "the probe run"
  size=$(du -sk "$probe/step-000001" | cut -f1)
  mkdir "$work/mnt"
  mount -t tmpfs -o size=$((size * 3 / 2 + 16))k tmpfs "$work/mnt"
  train "$work/mnt/ck" 4 --set checkpoint.every=1 --set checkpoint.keep_last=0
  [ "$rc" -ne 0 ] || fail "a run whose save of step 2 filled the disk exited 0"
  grep -Eq "save_checkpoint: .*(No space left on device|could not write its part)" "$work/out" ||
    fail "the error does not say the disk is full"
  if grep -q "^step 3/" "$work/out"; then fail "trained on after a failed save"; fi
  [ -f "$work/mnt/ck/step-000001/manifest.json" ] || fail "step 1 is not intact"
  [ ! -e "$work/mnt/ck/step-000002" ] || fail "the failed save left $(steps_in "$work/mnt/ck/step-000002")"
  "$pipemat" train --config "$config" "${common[@]}" --set transport.kind=local \
    --set "checkpoint.dir=$work/mnt/ck" --set training.steps=1 --resume latest \
    --set checkpoint.keep_last=0 >"$work/out" 2>&1 || fail "step 1 cannot be resumed"
  # The save after the last step fails: training finished, exit code 3, nothing lost.
  umount "$work/mnt"
  mount -t tmpfs -o size=$((size / 2))k tmpfs "$work/mnt"
  train "$work/mnt/ck" 2
  [ "$rc" -eq 3 ] || fail "exit code $rc, expected 3 (the final checkpoint failed)"
  grep -q "^step 2/2" "$work/out" || fail "training did not finish"
  grep -q "pipemat: error: the final checkpoint failed after the run's last step (step 2 of 2): " \
    "$work/out" || fail "no end-of-run error line"
  if grep -q "MPI_ABORT" "$work/out"; then fail "the job was aborted after training"; fi
  [ -z "$(ls -A "$work/mnt/ck" | grep -vx .pipemat-lock)" ] ||
    fail "the failed save left $(steps_in "$work/mnt/ck")"
  echo "ok ($transport): a full disk stops the run at the failed save with step 1 intact;" \
       "at the end it is exit code 3 with training finished"
  ;;
*) echo "unknown group $group"; exit 2 ;;
esac
