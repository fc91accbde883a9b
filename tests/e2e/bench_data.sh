#!/usr/bin/env bash
# bench_data.sh PIPEMAT CONFIG: `pipemat bench pipeline` with parallel.data=2 (mpi: 4 ranks
# through pipemat-run; local: ranks as threads; small buckets) reports per parallel.weight_tail
# value a row whose losses equal the reference's bitwise, with the gradient all-reduce's time
# and its hidden share.
set -euo pipefail
pipemat="$1" config="$2"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && "$pipemat" bench pipeline --config "$config" --set parallel.data=2 \
   --set parallel.bucket_bytes=1024 --schedules zb-h1 --transports mpi,local \
   --weight-tail true,false --steps 3 --warmup 1 --json) > "$work/rows.json"
python3 - "$work/rows.json" <<'PY'
import json, sys
rows = [r for r in json.load(open(sys.argv[1])) if r["transport"] != "reference"]
assert [(r["transport"], r["weight_tail"]) for r in rows] == [
    ("mpi", True), ("mpi", False), ("local", True), ("local", False)], rows
for r in rows:
    assert r["losses_equal"] is True, r
    assert r["allreduce_ms"] > 0 and 0 <= r["allreduce_hidden"] <= 1, r
    print(f"{r['transport']} weight_tail {r['weight_tail']}: all-reduce {r['allreduce_ms']:.3f} ms, "
          f"hidden {r['allreduce_hidden']:.2f}, losses equal")
PY
