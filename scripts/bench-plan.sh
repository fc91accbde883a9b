#!/bin/sh
# Measured against predicted for `pipemat plan` (docs/remat.md): for each budget, plans
# configs/plan-transformer.yaml, runs the plan and the uniform full and selective policies as two
# local TCP processes, and prints per rank the predicted and measured peak (the step's peak above
# its start plus the rank's weights and optimizer state) and the median step after 4 warm-up steps.
# Usage: scripts/bench-plan.sh [BUILD_DIR] [BUDGET...]   e.g. scripts/bench-plan.sh build 26MiB 30MiB
set -eu
build=${1:-build}
[ $# -gt 0 ] && shift
budgets=${*:-"26MiB 30MiB"}
config=configs/plan-transformer.yaml
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for b in $budgets; do
  "$build/launch/pipemat" plan --config $config --memory-budget "$b" --out "$tmp/plan.yaml" --json \
    >"$tmp/plan.json"
  "$build/launch/pipemat-run" -n 2 --tcp "$tmp/plan.yaml" -- --set output.metrics="$tmp/plan.jsonl" \
    --set output.progress=false >"$tmp/log" 2>&1
  for policy in full selective; do
    "$build/launch/pipemat-run" -n 2 --tcp $config -- --set remat.policy=$policy \
      --set output.metrics="$tmp/$policy.jsonl" --set output.progress=false >"$tmp/log" 2>&1
  done
  python3 - "$b" "$tmp" <<'PY'
import json, statistics, sys
budget, tmp = sys.argv[1], sys.argv[2]
plan = json.load(open(f"{tmp}/plan.json"))
fixed = plan["fixed_bytes"]
MiB = 2 ** 20
def measured(name):
    rows = [json.loads(line) for line in open(f"{tmp}/{name}.jsonl")][4:]
    step = statistics.median(r["step_ms"] for r in rows)
    last = max(r["peak_bytes"] for r in rows)           # the last stage's rank (rank 1)
    top = max(r["max_rank_peak_bytes"] for r in rows)    # the larger of the ranks
    return step, last, top
step, last, top = measured("plan")
want = [r["peak_bytes"] for r in plan["plan"]["ranks"]]
print(f"budget {budget}: plan step predicted {plan['plan']['step_ms']:.1f} ms, measured {step:.1f} ms "
      f"({step / plan['plan']['step_ms'] - 1:+.1%})")
print(f"  rank 1 peak predicted {want[1] / MiB:.2f} MiB, measured {(last + fixed[1]) / MiB:.2f} MiB "
      f"({(last + fixed[1]) / want[1] - 1:+.1%})")
print(f"  larger rank peak predicted {max(want) / MiB:.2f} MiB, measured "
      f"{(top + fixed[0]) / MiB:.2f} MiB ({(top + fixed[0]) / max(want) - 1:+.1%})")
for policy in ("full", "selective"):
    s, _, t = measured(policy)
    u = plan["uniform"][policy]
    print(f"  {policy}: step measured {s:.1f} ms (predicted {u['step_ms']:.1f}), larger rank peak "
          f"{(t + fixed[0]) / MiB:.2f} MiB, {'fits' if u['fits'] else 'over budget'}; plan speed "
          f"{s / step:.3f}x measured, {u['step_ms'] / plan['plan']['step_ms']:.3f}x predicted")
PY
done
