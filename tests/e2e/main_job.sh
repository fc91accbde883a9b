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
# The summary: 6 steps x 4 micro-batches x 2 sequences x 32 tokens; each rank's peak is the most
# it held in any step of the metrics file (start + peak bytes); the single process ran the
# config's output.reference_steps (12) after training, measured over steps 5-12, with the faster
# of 1 thread and the machine's hardware threads (measured first when there are more than 1).
expect '^summary: 6 steps, 1.54k tokens in [0-9]+ s of steps: [0-9.]+k? tokens/s \(median step [0-9.]+ ms\) on 2 ranks; ' train.log
peaks=$(python3 -c '
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
ranks = len(rows[0]["rank_peak_bytes"])
most = [max(r["rank_start_bytes"][k] + r["rank_peak_bytes"][k] for r in rows) for k in range(ranks)]
print(", ".join("%.2f KiB" % (b / 1024) if b < 1 << 20 else "%.2f MiB" % (b / (1 << 20)) for b in most))
' runs/gpt-fortunes/metrics.jsonl)
expect "; peak memory per rank $peaks \(tensors: " train.log
threads='[0-9]+ threads?'
[ "$(getconf _NPROCESSORS_ONLN)" -gt 1 ] && threads="[0-9]+ threads?; $(getconf _NPROCESSORS_ONLN) asked, measured first: one micro-batch's forward and backward took [0-9.]+ ms on 1 thread and [0-9.]+ ms on $(getconf _NPROCESSORS_ONLN) \\(medians of 3 rounds, OMP_WAIT_POLICY [^)]+\\), the faster kept"
expect "^single process \\(the same model and data chained in one process, $threads; median of steps 5-12 of 12 run after training\\): [0-9.]+k? tokens/s \\([0-9.]+ ms per step\\), peak memory [0-9.]+ [KM]iB; the pipeline: [0-9.]+x the tokens/s, [0-9.]+x the peak memory on its largest rank$" train.log
"$pipemat" generate --checkpoint runs/gpt-fortunes/checkpoints/step-000006 --tokens 40 --quiet \
  --prompt "Q: " > sample.bin
[ "$(wc -c < sample.bin)" -eq 40 ] || { echo "FAIL: the sample has $(wc -c < sample.bin) bytes, not 40"; exit 1; }
echo "ok: the main job trains, validates, checkpoints, draws the loss curve, summarizes and samples 40 bytes"
