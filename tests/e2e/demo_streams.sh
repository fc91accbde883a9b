#!/usr/bin/env bash
# demo_streams.sh PIPEMAT
# `pipemat demo` prints a line per step as the step ends (issue 44 #12): with a million steps to
# run, its lines "step 1", "step 2", "step 3" appear, in order, long before the end.
set -uo pipefail
out=$(mktemp)
"$1" demo --steps 1000000 >"$out" 2>&1 &
demo=$!
trap 'kill -KILL "$demo" 2>/dev/null; rm -f "$out"' EXIT
for _ in $(seq 1 600); do
  grep -q "^step 3 " "$out" && break
  kill -0 "$demo" 2>/dev/null || { echo "demo ended early"; cat "$out"; exit 1; }
  sleep 0.1
done
got=$(grep -E "^step [0-9]+ " "$out" | head -3 | cut -d' ' -f1-2 | tr '\n' ',')
[ "$got" = "step 1,step 2,step 3," ] || { echo "expected step 1..3 lines within 60 s, got '$got'"; cat "$out"; exit 1; }
echo "streams: $got"
