#!/usr/bin/env bash
# bench-trace.sh [--steps N] [--rounds R] [--set k=v ...]: what output.trace costs (Note [Step
# trace] in pp/include/pipemat/pp/trace.h). Runs the main job (configs/default.yaml, 2 ranks under
# pipemat-run, MPI) for N steps (default 30) without and with --trace, R rounds each (default 3),
# alternating; prints each run's median step (its first 5 steps left out), the median over rounds
# of each, their ratio, and the trace's size. The machine and its load come first.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
steps=30 rounds=3 extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) steps="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --set) extra+=(--set "$2"); shift 2 ;;
    -h|--help) sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "bench-trace: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ "$steps" -gt 5 ] || { echo "bench-trace: --steps must be above 5" >&2; exit 2; }
run="$root/build/launch/pipemat-run"
[ -x "$run" ] || { echo "bench-trace: build first (bash scripts/build.sh)" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
echo "machine: $(lscpu | sed -n 's/^Model name: *//p' | head -1), $(nproc) hardware threads; load:$(cut -d' ' -f1-3 /proc/loadavg | sed 's/^/ /')"
common=(--set sample.tokens=0 --set 'output.loss_svg=""' --set training.eval_every=0
        --set output.reference_steps=0 --set 'checkpoint.dir=""' --set "training.steps=$steps"
        --set transport.kind=mpi "${extra[@]}")
median_step() {
  python3 - "$1" <<'PY'
import json, statistics, sys
steps = [json.loads(line)["step_ms"] for line in open(sys.argv[1]) if line.strip()]
print(statistics.median(steps[5:]))
PY
}
off=() on=()
for ((round = 0; round < rounds; ++round)); do
  "$run" -n 2 "$root/configs/default.yaml" -- "${common[@]}" --metrics "$work/off.jsonl" >/dev/null
  off+=("$(median_step "$work/off.jsonl")")
  "$run" -n 2 "$root/configs/default.yaml" -- "${common[@]}" --metrics "$work/on.jsonl" \
    --trace "$work/trace.json" >/dev/null
  on+=("$(median_step "$work/on.jsonl")")
done
python3 - "$(stat -c %s "$work/trace.json")" "$steps" "${off[*]}" "${on[*]}" <<'PY'
import statistics, sys
size, steps = int(sys.argv[1]), int(sys.argv[2])
off = [float(x) for x in sys.argv[3].split()]
on = [float(x) for x in sys.argv[4].split()]
a, b = statistics.median(off), statistics.median(on)
print(f"without trace: {a:.1f} ms per step (rounds: {', '.join(f'{x:.1f}' for x in off)})")
print(f"with trace:    {b:.1f} ms per step (rounds: {', '.join(f'{x:.1f}' for x in on)})")
print(f"with / without: {b / a:.3f}; trace of {steps} steps: {size / 2**10:.0f} KiB")
PY
