#!/usr/bin/env bash
# second_signal.sh PIPEMAT CONFIG: a second SIGINT ends `pipemat train` at once (Note [Stopping
# on a signal]). The run's first step takes several seconds (model.tokens=131072, ranks as
# threads); SIGINT during it asks for a stop at the step's end, a second SIGINT 0.3 s later
# ends the process by the signal's default action: exit 130 well before the step could end,
# and no "interrupted" line (that line is the first signal's, at a step boundary).
set -uo pipefail
# shellcheck source=job_end.sh
source "$(dirname "$0")/job_end.sh"
pipemat="$1" config="$2"
tmp=$(mktemp -d)
out="$tmp/out"
setsid env --default-signal=INT,TERM OMP_NUM_THREADS=1 "$pipemat" train --config "$config" \
  --set transport.kind=local --set model.tokens=131072 --set training.steps=2 >"$out" 2>&1 &
job=$!
trap 'kill -KILL "$job" 2>/dev/null; rm -rf "$tmp"' EXIT
fail() { echo "second_signal: $*"; echo "---- output ----"; cat "$out"; exit 1; }
wait_for_line "$job" "$out" "^model: "
sleep 0.5  # inside the first step (it takes several seconds)
start=$(date +%s%N)
kill -INT "$job"
sleep 0.3
grep -q "^step 1/" "$out" && fail "the first step ended before the second signal; make it longer"
kill -0 "$job" 2>/dev/null || fail "the first SIGINT ended the run; it should stop at the step's end"
kill -INT "$job"
wait_for_end "$job" "$start" 20 || fail "still running 20 s after the second SIGINT"
echo "two SIGINTs: exit code $rc after $elapsed s"
[ "$rc" -eq 130 ] || fail "exit code $rc, expected 130 (ended by SIGINT)"
[ "$ms" -le 3000 ] || fail "took $elapsed s after the first SIGINT: the second did not end it at once"
if grep -q "interrupted at step" "$out"; then fail "a step boundary was reached: no second signal test"; fi
echo "ok: the second SIGINT ended the run at once, inside its first step"
