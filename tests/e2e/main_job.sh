#!/usr/bin/env bash
# main_job.sh PIPEMAT_RUN PIPEMAT CONFIG [--set k=v ...]: the README's main job, short: 6 steps
# on 2 ranks under mpirun, then `pipemat generate` on its checkpoint.
set -euo pipefail
run="$1" pipemat="$2" config="$3"
shift 3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"  # the config's outputs (runs/gpt-fortunes/...) are relative
"$run" -n 2 "$config" -- "$@" --set training.steps=6 --set sample.tokens=40 | tee train.log
expect() { grep -E -q -- "$1" "$2" || { echo "FAIL: no /$1/ in $2"; exit 1; }; }
expect '^model: gpt: 4 blocks, hidden 32, 2 heads' train.log
expect '^step 6/6  loss [0-9.]+  [0-9.]+k? tok/s  [0-9.]+ ms  bubble [0-9.]+ .* 100%  ETA 0 s' train.log
expect '^validation after step 3: loss [0-9.]+ nats/byte' train.log
expect '^validation after step 6: loss [0-9.]+ nats/byte' train.log
expect '^checkpoint runs/gpt-fortunes/checkpoints/step-000006$' train.log
expect '^sample \(pipemat generate --checkpoint runs/gpt-fortunes/checkpoints/step-000006 --tokens 40\):$' train.log
[ "$(grep -c '"val_loss"' runs/gpt-fortunes/metrics.jsonl)" -eq 2 ] || { echo "FAIL: not 2 val_loss lines"; exit 1; }
[ "$(wc -l < runs/gpt-fortunes/metrics.jsonl)" -eq 6 ] || { echo "FAIL: not 6 metrics lines"; exit 1; }
expect '<polyline' runs/gpt-fortunes/loss.svg
"$pipemat" generate --checkpoint runs/gpt-fortunes/checkpoints/step-000006 --tokens 40 --quiet \
  --prompt "Q: " > sample.bin
[ "$(wc -c < sample.bin)" -eq 40 ] || { echo "FAIL: the sample has $(wc -c < sample.bin) bytes, not 40"; exit 1; }
echo "ok: the main job trains, validates, checkpoints, draws the loss curve and samples 40 bytes"
