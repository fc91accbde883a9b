#!/usr/bin/env bash
# interrupt.sh SIGNAL TO CODE BOUND LINES -- COMMAND...
# Starts COMMAND (pipemat-run ... or pipemat train) in a session of its own, waits until it
# trains (a "step 2/" progress line), sends SIGNAL (INT or TERM) to TO: `group`, the command's
# process group as a terminal's Ctrl-C does, or `process`, the command alone. Then requires
# (Note [Stopping on a signal] in train/include/pipemat/train/train.h):
#   * the command ends within BOUND seconds with exit code CODE, and no process it started runs;
#   * LINES lines "interrupted at step N of M (the last complete step); ...", one per rank of
#     replica 0 ("1+": at least one: under mpirun the first rank to stop ends the job), all
#     with the same N, which is the last progress line's step;
#   * with checkpoint.dir (@TMP@ in COMMAND is a fresh directory), the checkpoint they name is
#     that step's and complete.
set -uo pipefail
# shellcheck source=job_end.sh
source "$(dirname "$0")/job_end.sh"
signal="$1" to="$2" code="$3" bound="$4" lines="$5"
shift 5
[ "$1" = "--" ] && shift
tmp=$(mktemp -d)
out="$tmp/out"
args=()
for a in "$@"; do args+=("${a//@TMP@/$tmp}"); done
# The signals' default actions: a test runner started in the background may ignore SIGINT, and
# a shell cannot trap what it was started ignoring.
setsid env --default-signal=INT,TERM "${args[@]}" >"$out" 2>&1 &
job=$!
job_procs=()
finish() {
  kill_recorded "${job_procs[@]}"
  for p in $(ps -o pid= -s "$job" 2>/dev/null); do kill -KILL "$p" 2>/dev/null; done
  rm -rf "$tmp"
}
trap finish EXIT
fail() { echo "interrupt: $*"; echo "---- output ----"; cat "$out"; exit 1; }

wait_for_line "$job" "$out" "step 2/"
record_job "$job"  # the command and every process below it (mpirun runs in a session of its own)
start=$(date +%s%N)
if [ "$to" = group ]; then kill "-$signal" -- "-$job"; else kill "-$signal" "$job"; fi
wait_for_end "$job" "$start" $((bound + 20)) || fail "still running $((bound + 20)) s after SIG$signal"
echo "SIG$signal to the $to: exit code $rc after $elapsed s (bound $bound s)"
# At the moment the command has exited (an exited rank its parent has not reaped yet, state Z,
# runs no more).
left=$(still_running "${job_procs[@]}")
[ -z "$left" ] || fail "processes still running after the command ended (pid state name): $left"
[ "$rc" -eq "$code" ] || fail "exit code $rc, expected $code"
[ "$ms" -le $((bound * 1000)) ] || fail "took $elapsed s, more than $bound s"

mapfile -t said < <(grep -E "interrupted at step [0-9]+ of [0-9]+ \(the last complete step\); " "$out")
printf '%s\n' "${said[@]}"
if [ "${lines%+}" != "$lines" ]; then  # "N+": at least N (mpirun ends the job at the first)
  [ "${#said[@]}" -ge "${lines%+}" ] || fail "${#said[@]} interrupted lines, expected $lines"
else
  [ "${#said[@]}" -eq "$lines" ] || fail "${#said[@]} interrupted lines, expected $lines"
fi
steps=$(printf '%s\n' "${said[@]}" | sed -E 's/.*interrupted at step ([0-9]+) .*/\1/' | sort -u)
[ "$(wc -l <<<"$steps")" -eq 1 ] || fail "the ranks stopped at different steps: $steps"
last=$(grep -E "^step [0-9]+/" "$out" | tail -1 | sed -E 's#^step ([0-9]+)/.*#\1#')
[ "$steps" = "$last" ] || fail "interrupted at step $steps, but the last progress line is step $last"
if grep -q "checkpoint.dir=" <<<"${args[*]}"; then
  want=$(printf 'step-%06d' "$steps")
  grep -q "the last complete checkpoint is [^ ]*/$want (pipemat train --resume " <<<"${said[0]}" ||
    fail "the line does not name checkpoint $want"
  dir=$(sed -E 's/.*the last complete checkpoint is ([^ ]+) .*/\1/' <<<"${said[0]}")
  [ -f "$dir/manifest.json" ] || fail "$dir has no manifest.json"
else
  grep -q "there is no complete checkpoint (checkpoint.dir is not set)" <<<"${said[0]}" ||
    fail "the line does not say there is no checkpoint"
fi
exit 0
