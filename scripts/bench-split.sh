#!/usr/bin/env bash
# bench-split.sh [--steps N] [--warmup W] [--rounds R] [--only NAME]: the stage split by measured
# cost against the parameter split (Note [Split by cost] in train/include/pipemat/train/plan.h).
# Each case runs as a pipemat-run job (MPI, one process and one thread per rank) twice per round:
# with the default split (balanced by parameter count) and with partition.layers_per_stage auto.
# Prints per case both splits, each one's predicted step (the auto run's line) and its measured
# step: the median of steps after W warm-up steps (default 12 steps, 4 warm-up), then the median
# over R rounds (default 2); and the measured speedup of the cost split. The cases: the main job
# (configs/default.yaml) on 2 and 4 ranks (1f1b), and a Llama whose head and loss cost several
# blocks (configs/llama.yaml: vocab 16000 and 8 blocks on 2 ranks, vocab 8000 and 16 blocks on
# 4), and a Llama of SmolLM-135M's shape (vocab 49,152, 30 blocks, hidden 576, tied embeddings;
# bf16 on 2 ranks: about 40 s a step here, so it runs only when asked, --only smollm, best with
# fewer steps).
# The machine and its load come first (compare only within one run).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
steps=12 warmup=4 rounds=2 only=""
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) steps="$2"; shift 2 ;;
    --warmup) warmup="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --only) only="$2"; shift 2 ;;
    -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "bench-split: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ "$warmup" -lt "$steps" ] || { echo "bench-split: --warmup must be below --steps" >&2; exit 2; }
run="$root/build/launch/pipemat-run"
[ -x "$run" ] || { echo "bench-split: build first (bash scripts/build.sh)" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
echo "machine: $(lscpu | sed -n 's/^Model name: *//p' | head -1), $(nproc) hardware threads; load:$(cut -d' ' -f1-3 /proc/loadavg | sed 's/^/ /')"
common=(--set sample.tokens=0 --set 'output.loss_svg=""' --set training.eval_every=0
        --set output.reference_steps=0 --set 'checkpoint.dir=""' --set training.threads=1
        --set schedule.kind=1f1b --set "training.steps=$steps" --set transport.kind=mpi)
# name|ranks|config|overrides
cases=("main job|2|configs/default.yaml|"
       "main job|4|configs/default.yaml|--set schedule.ranks=4"
       "llama vocab 16000, 8 blocks|2|configs/llama.yaml|--set model.vocab=16000 --set model.layers=8"
       "llama vocab 8000, 16 blocks|4|configs/llama.yaml|--set model.vocab=8000 --set model.layers=16 --set schedule.ranks=4"
       "smollm-135m shape, bf16|2|configs/llama.yaml|--set model.vocab=49152 --set model.layers=30 --set model.hidden=576 --set model.heads=9 --set model.kv_heads=3 --set model.ffn=1536 --set model.seq_len=256 --set model.tie_embeddings=true --set training.precision=bf16")
median() { python3 -c "import statistics,sys; print(statistics.median(float(x) for x in sys.argv[1:]))" "$@"; }
# The median step_ms of a metrics file after the warm-up steps.
measured() {
  python3 - "$1" "$warmup" <<'EOF'
import json, statistics, sys
steps = [json.loads(line)["step_ms"] for line in open(sys.argv[1]) if line.strip()]
print(round(statistics.median(steps[int(sys.argv[2]):]), 1))
EOF
}
for entry in "${cases[@]}"; do
  IFS='|' read -r name n config sets <<<"$entry"
  [ -z "$only" ] || [[ "$name" == *"$only"* ]] || continue
  [ -n "$only" ] || [[ "$name" != smollm* ]] || continue  # only when asked
  param=() cost=() line=""
  for ((round = 0; round < rounds; ++round)); do
    # shellcheck disable=SC2086
    "$run" -n "$n" "$root/$config" -- "${common[@]}" $sets --metrics "$work/param.jsonl" \
      >"$work/param.log" 2>&1 || { cat "$work/param.log"; exit 1; }
    param+=("$(measured "$work/param.jsonl")")
    # shellcheck disable=SC2086
    "$run" -n "$n" "$root/$config" -- "${common[@]}" $sets --metrics "$work/cost.jsonl" \
      --set partition.layers_per_stage=auto >"$work/cost.log" 2>&1 || { cat "$work/cost.log"; exit 1; }
    cost+=("$(measured "$work/cost.jsonl")")
    line=$(grep -m1 '^split by cost' "$work/cost.log")
  done
  p=$(median "${param[@]}") c=$(median "${cost[@]}")
  echo "$name, $n ranks (1f1b): $line"
  python3 -c "print(f'  measured: parameter split {$p:.1f} ms, cost split {$c:.1f} ms ({$p / $c:.2f}x); rounds: parameter ${param[*]}, cost ${cost[*]}')"
done
