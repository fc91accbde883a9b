#!/usr/bin/env bash
# plan_calibration.sh PIPEMAT CONFIG: `pipemat plan` measures the two numbers of its step model
# that belong to the machine on a calibration run of the config with remat none (Note [Plan
# calibration]), unless they are given; the shared speed is the one at which remat none is
# predicted as that run measured it.
set -euo pipefail
pipemat="$1" config="$2"
small=(--config "$config" --set model.layers=4 --set model.tokens=64 --repeats 1
       --memory-budget 1GiB)
check() {  # check JSON PYTHON-ASSERTIONS: j is the plan's JSON object
  python3 -c "import json, sys; j = json.loads(sys.argv[1]); $2" "$1" ||
    { echo "FAIL: $2"; echo "$1"; exit 1; }
}
# Remat none predicted with the fitted speed is the calibration run's step (up to the bisection),
# unless the speed is clamped at 1 (the profile alone is already as slow) or at 0.2.
check_fit() {
  check "$1" '
c, s, none = j["calibration"], j["shared_speed"], j["uniform"]["none"]["step_ms"]
if 0.2 < s < 1: assert abs(none / c["step_ms"] - 1) < 0.01, (none, c)
elif s == 1: assert none == c["predicted_ms"] and none >= c["step_ms"], (none, c)
else: assert none <= c["step_ms"], (none, c)'
}
json=$("$pipemat" plan "${small[@]}" --calibration-steps 4 --json)
check "$json" 'c = j["calibration"]; assert c["steps"] == 4 and c["step_ms"] > 0, c'
check "$json" 'assert 0.2 <= j["shared_speed"] <= 1 and j["message_ms"] >= 0, j'
check_fit "$json"
# Both numbers given: nothing runs and the predictions use them.
json=$("$pipemat" plan "${small[@]}" --message-ms 2 --shared-speed 0.5 --json)
check "$json" 'assert j["calibration"]["steps"] == 0 and j["message_ms"] == 2 and j["shared_speed"] == 0.5, j'
json=$("$pipemat" plan "${small[@]}" --calibration-steps 0 --json)
check "$json" 'assert j["calibration"]["steps"] == 0 and j["message_ms"] == 0 and j["shared_speed"] == 1, j'
text=$("$pipemat" plan "${small[@]}" --calibration-steps 3 --transport tcp)
grep -E -q '^plan: calibrating the step model on 3 steps of the config with remat none \(pipemat-run, tcp\)$' <<<"$text" &&
  grep -E -q '^plan: step model: messages [0-9.]+ ms, shared speed [0-9.]+ \(calibration run of remat none: [0-9.]+ ms a step, predicted at shared speed 1: [0-9.]+ ms\)$' <<<"$text" ||
  { echo "$text"; echo "FAIL: the text output does not give the calibration"; exit 1; }
# With data parallelism the calibration runs the whole job (2 replicas x 2 ranks under mpirun):
# the same fit, and the plan is every replica's.
json=$("$pipemat" plan "${small[@]}" --set parallel.data=2 --calibration-steps 3 --json)
check "$json" 'c = j["calibration"]; assert c["steps"] == 3 and c["step_ms"] > 0, c'
check "$json" 'assert "every one of 2 replicas (parallel.data) runs this plan" in j["summary"], j["summary"]'
check_fit "$json"
echo "ok: the plan's step model is calibrated on a run of remat none, or takes the numbers given"
