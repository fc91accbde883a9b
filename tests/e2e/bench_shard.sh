#!/usr/bin/env bash
# bench_shard.sh PIPEMAT CONFIG: `pipemat bench pipeline` with parallel.data=2 and
# --shard-optimizer false,true (Note [Sharded optimizer]) reports a row per value whose losses
# equal the reference's bitwise; the sharded row's largest rank holds less optimizer state, and
# only it spends time gathering the updated parameters.
set -euo pipefail
pipemat="$1" config="$2"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && "$pipemat" bench pipeline --config "$config" --set parallel.data=2 \
   --set training.optimizer=adamw --schedules 1f1b --transports local \
   --shard-optimizer false,true --steps 3 --warmup 1 --json) > "$work/rows.json"
python3 - "$work/rows.json" <<'PY'
import json, sys
rows = [r for r in json.load(open(sys.argv[1])) if r["transport"] != "reference"]
assert [r["shard_optimizer"] for r in rows] == [False, True], rows
plain, sharded = rows
for r in rows:
    assert r["losses_equal"] is True, r
assert 0 < sharded["optimizer_state_bytes"] < plain["optimizer_state_bytes"], rows
assert plain["gather_ms"] == 0 and sharded["gather_ms"] > 0, rows
print(f"optimizer state of the largest rank: {plain['optimizer_state_bytes']} bytes unsharded, "
      f"{sharded['optimizer_state_bytes']} sharded; gather {sharded['gather_ms']:.3f} ms; "
      "losses equal")
PY
