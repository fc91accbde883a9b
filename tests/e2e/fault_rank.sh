#!/usr/bin/env bash
# fault_rank.sh SIGNAL RANK BOUND REGEX -- COMMAND...
# Starts a multi-rank job (COMMAND, e.g. pipemat-run ...), waits until it trains (a "step 2/"
# progress line), sends SIGNAL (KILL or STOP) to the process of rank RANK, then requires the
# job to end within BOUND seconds with a non-zero exit code and output matching REGEX (for STOP:
# the job's first timeout matches it), and no process of the job (the launcher's, mpirun's, a
# rank's: every process below COMMAND once it trains) to run at the moment COMMAND has exited
# (Note [Ranks end with their launcher] in comm/include/pipemat/comm/launcher.h).
# Everything the job started is killed at the end, also a stopped rank.
set -uo pipefail
# shellcheck source=job_end.sh
source "$(dirname "$0")/job_end.sh"
signal="$1" rank="$2" bound="$3" regex="$4"
shift 4
[ "$1" = "--" ] && shift
out=$(mktemp)
setsid "$@" >"$out" 2>&1 &
job=$!
sid=$job
job_procs=()
finish() {
  kill_recorded "${job_procs[@]}"
  for p in $(ps -o pid= -s "$sid" 2>/dev/null); do kill -CONT "$p" 2>/dev/null; kill -KILL "$p" 2>/dev/null; done
  rm -f "$out"
}
trap finish EXIT
fail() { echo "fault_rank: $*"; echo "---- job output ----"; cat "$out"; exit 1; }

# The rank's process: PIPEMAT_RANK (tcp) or OMPI_COMM_WORLD_RANK (mpirun) in its environment.
target=""
for _ in $(seq 1 300); do
  if grep -q "step 2/" "$out"; then
    record_job "$job"
    for entry in "${job_procs[@]}"; do
      p=${entry%%:*}
      env=$(tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null) || continue
      if grep -qx "PIPEMAT_RANK=$rank" <<<"$env" || grep -qx "OMPI_COMM_WORLD_RANK=$rank" <<<"$env"; then
        grep -q "train" "/proc/$p/cmdline" 2>/dev/null && target=$p && break
      fi
    done
    [ -n "$target" ] && break
  fi
  kill -0 "$job" 2>/dev/null || fail "the job ended before the fault"
  sleep 0.1
done
[ -n "$target" ] || fail "no process of rank $rank training after 30 s"
start=$(date +%s%N)
kill "-$signal" "$target"
wait_for_end "$job" "$start" $((bound + 20)) || fail "the job still runs $((bound + 20)) s after SIG$signal to rank $rank"
left=$(still_running "${job_procs[@]}")
[ -z "$left" ] || fail "processes of the job still run after the launcher exited (pid state name): $left"
echo "SIG$signal to rank $rank: the job ended with exit code $rc after $elapsed s (bound $bound s)"
[ "$rc" -ne 0 ] || fail "exit code 0 after SIG$signal to rank $rank"
[ "$ms" -le $((bound * 1000)) ] || fail "took $elapsed s, more than $bound s"
grep -Eq "$regex" "$out" || fail "no line matching '$regex'"
if [ "$signal" = STOP ]; then
  # The job's first timeout names the stopped rank (Note [Liveness of a peer]), not a rank that
  # was only waiting for it.
  first=$(grep -m1 -E "timed out after" "$out")
  grep -Eq "$regex" <<<"$first" || fail "the first timeout does not match '$regex': $first"
fi
grep -E "error" "$out" | head -3
exit 0
