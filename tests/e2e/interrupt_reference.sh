#!/usr/bin/env bash
# interrupt_reference.sh PIPEMAT CONFIG: a SIGTERM while the summary measures the single process
# (output.reference_steps, after training) ends that measurement: the command exits within 10 s
# of the signal, printing the summary without the single process's line.
set -uo pipefail
pipemat="$1" config="$2"
log=$(mktemp)
trap 'rm -f "$log"; kill -KILL "$job" 2>/dev/null' EXIT
setsid env --default-signal=INT,TERM "$pipemat" train --config "$config" --set training.steps=2 \
  --set output.reference_steps=1000 --set 'checkpoint.dir=""' --set 'output.metrics=""' \
  --set 'output.loss_svg=""' --set sample.tokens=0 --set transport.kind=local >"$log" 2>&1 &
job=$!
for _ in $(seq 1 240); do
  grep -q "^measuring the single process" "$log" && break
  kill -0 "$job" 2>/dev/null || { cat "$log"; echo "FAIL: ended before measuring"; exit 1; }
  sleep 0.25
done
grep -q "^measuring the single process" "$log" || { cat "$log"; echo "FAIL: no measurement"; exit 1; }
kill -TERM "$job"
start=$(date +%s)
while kill -0 "$job" 2>/dev/null; do
  [ $(( $(date +%s) - start )) -gt 10 ] && { cat "$log"; echo "FAIL: still measuring 10 s after SIGTERM"; exit 1; }
  sleep 0.1
done
cat "$log"
grep -q "^summary: 2 steps" "$log" || { echo "FAIL: no summary"; exit 1; }
if grep -q "^single process" "$log"; then echo "FAIL: the measurement was not ended"; exit 1; fi
echo "interrupt_reference.sh: OK, ended $(( $(date +%s) - start )) s after the signal"
