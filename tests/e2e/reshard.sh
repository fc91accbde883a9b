#!/usr/bin/env bash
# reshard.sh PIPEMAT_RUN CONFIG [--set k=v ...]: checkpoints resume on another layout (Note
# [Checkpoint layout] in pp/include/pipemat/pp/checkpoint.h), under mpirun and over tcp, bitwise.
# CONFIG is a model whose training does not depend on the layout (a llama: no dropout; the gpt's
# dropout keys its masks by layer). A straight run of 8 steps on 2 ranks (1f1b) is the reference:
#  1. 4 steps on 2 ranks (1f1b) + 4 on 4 ranks (zb-v, 8 virtual stages) under mpirun;
#  2. 4 steps on 4 ranks (1f1b) + 4 on 2 ranks under mpirun;
#  3. 4 steps with layers_per_stage [1,7] + 4 with [7,1] over tcp;
#  4. a lost host: a 4-rank run whose rank 2 is killed (SIGKILL) once it has saved a checkpoint,
#     then `pipemat-run -n 2 CONFIG -- --resume latest` on the 2 ranks that are left;
# every loss after the resume equals the straight run's of that step, bitwise (the metrics' text).
set -euo pipefail
run="$1" config="$2"
shift 2
work=$(mktemp -d)
job=""
cleanup() {
  [ -n "$job" ] && kill -KILL -- "-$job" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
cd "$work"  # the config's output paths are relative
common=(--set output.progress=false --set 'output.loss_svg=""' --set sample.tokens=0
        --set training.eval_every=0 --set checkpoint.keep_last=0 --set output.reference_steps=0 "$@")
fail() { echo "FAIL: $*"; exit 1; }
losses() { grep -o '"step":[0-9]*,"loss":[-0-9.e]*' "$1"; }
# The losses of `$1` after step `$2` against the straight run's.
same_after() {
  local got want
  got=$(losses "$1" | awk -F'[:,]' -v s="$2" '$2 >= s')
  want=$(losses "$work/straight.jsonl" | awk -F'[:,]' -v s="$2" -v e="$3" '$2 >= s && $2 < e')
  [ -n "$got" ] || fail "$4: no steps after step $2"
  [ "$got" = "$want" ] || { diff <(echo "$want") <(echo "$got") | head; fail "$4: the losses after the resume differ from the straight run's"; }
}
steps=8
"$run" -n 2 "$config" -- "${common[@]}" --set schedule.kind=1f1b --set training.steps=$steps \
  --set 'checkpoint.dir=""' --metrics "$work/straight.jsonl"
[ "$(losses "$work/straight.jsonl" | wc -l)" -eq $steps ] || fail "the straight run has no $steps steps"

# 1. 2 ranks (1f1b) -> 4 ranks (zb-v).
"$run" -n 2 "$config" -- "${common[@]}" --set schedule.kind=1f1b --set training.steps=$steps \
  --set "checkpoint.dir=$work/a" --set checkpoint.every=4 --stop-after 4 >/dev/null
out=$("$run" -n 4 "$config" -- "${common[@]}" --set output.progress=true --set schedule.kind=zb-v \
  --set schedule.ranks=4 --set training.steps=$steps --set "checkpoint.dir=$work/a" \
  --resume latest --metrics "$work/a.jsonl" 2>&1)
grep -q "^resharded from 2 ranks (1f1b, D=1) to 4 ranks (zb-v, 8 virtual stages, D=1)$" <<<"$out" ||
  { echo "$out" | head -5; fail "2 -> 4: no resharded line"; }
same_after "$work/a.jsonl" 4 $steps "2 ranks 1f1b -> 4 ranks zb-v"

# 2. 4 ranks -> 2 ranks.
"$run" -n 4 "$config" -- "${common[@]}" --set schedule.kind=1f1b --set schedule.ranks=4 \
  --set training.steps=$steps --set "checkpoint.dir=$work/b" --set checkpoint.every=4 \
  --stop-after 4 >/dev/null
"$run" -n 2 "$config" -- "${common[@]}" --set schedule.kind=1f1b --set training.steps=$steps \
  --set "checkpoint.dir=$work/b" --resume latest --metrics "$work/b.jsonl" >/dev/null
same_after "$work/b.jsonl" 4 $steps "4 ranks -> 2 ranks"

# 3. [1,7] -> [7,1] over tcp.
"$run" -n 2 --tcp "$config" -- "${common[@]}" --set schedule.kind=1f1b --set training.steps=$steps \
  --set 'partition.layers_per_stage=[1,7]' --set "checkpoint.dir=$work/c" --set checkpoint.every=4 \
  --stop-after 4 >/dev/null
out=$("$run" -n 2 --tcp "$config" -- "${common[@]}" --set output.progress=true \
  --set schedule.kind=1f1b --set training.steps=$steps --set 'partition.layers_per_stage=[7,1]' \
  --set "checkpoint.dir=$work/c" --resume latest --metrics "$work/c.jsonl" 2>&1)
grep -q "^resharded from 2 ranks (1f1b, \[1,7\], D=1) to 2 ranks (1f1b, \[7,1\], D=1)$" <<<"$out" ||
  { echo "$out" | head -5; fail "[1,7] -> [7,1]: no resharded line naming both splits"; }
same_after "$work/c.jsonl" 4 $steps "[1,7] -> [7,1] over tcp"

# 4. A lost host: rank 2 of 4 killed after its job saved a checkpoint; 2 ranks go on.
long=400
rm "$work/straight.jsonl"
"$run" -n 2 "$config" -- "${common[@]}" --set schedule.kind=1f1b --set training.steps=$long \
  --set 'checkpoint.dir=""' --metrics "$work/straight.jsonl" >/dev/null
setsid "$run" -n 4 "$config" -- "${common[@]}" --set output.progress=true --set schedule.kind=1f1b \
  --set schedule.ranks=4 --set training.steps=$long --set "checkpoint.dir=$work/d" \
  --set checkpoint.every=2 >"$work/lost.out" 2>&1 &
job=$!
target=""
for _ in $(seq 1 600); do
  if grep -q "^checkpoint .*step-000004" "$work/lost.out"; then
    # The rank's process: its command line names this run's checkpoint directory (mpirun may
    # start it outside the job's session), its environment its rank.
    for p in $(grep -lF "$work/d" /proc/[0-9]*/cmdline 2>/dev/null | cut -d/ -f3); do
      env=$(tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null) || continue
      if grep -qx "OMPI_COMM_WORLD_RANK=2" <<<"$env" && grep -q "train" "/proc/$p/cmdline"; then
        target=$p
        break
      fi
    done
    [ -n "$target" ] && break
  fi
  sleep 0.05
done
[ -n "$target" ] || { cat "$work/lost.out" | tail; fail "the 4-rank run saved no checkpoint of step 4"; }
kill -KILL "$target"
if wait "$job"; then fail "the 4-rank run whose rank 2 was killed exited 0"; fi
job=""
out=$("$run" -n 2 "$config" -- "${common[@]}" --set output.progress=true --set schedule.kind=1f1b \
  --set training.steps=$long --set "checkpoint.dir=$work/d" --resume latest \
  --metrics "$work/d.jsonl" 2>&1)
from=$(grep -o "^resumed from [^ ]* after step [0-9]*" <<<"$out" | grep -o "[0-9]*$") ||
  { echo "$out" | head; fail "the 2-rank resume names no checkpoint"; }
grep -q "^resharded from 4 ranks (1f1b, D=1) to 2 ranks (1f1b, D=1)$" <<<"$out" ||
  fail "lost host: no resharded line"
same_after "$work/d.jsonl" "$from" $long "a lost host: 4 ranks killed -> 2 ranks from step $from"
# `pipemat checkpoint`: the layout, the tensors, every file verified; a damaged copy exits 1
# naming the file.
pipemat="$(dirname "$run")/pipemat"
out=$("$pipemat" checkpoint "$work/a/step-000008") || { echo "$out" | tail -3; fail "pipemat checkpoint failed"; }
grep -q "^written on 4 ranks (zb-v, 8 virtual stages, D=1), 4 micro-batches per replica, optimizer AdamW, seed none$" <<<"$out" ||
  { echo "$out" | head -3; fail "pipemat checkpoint: no layout line"; }
grep -Eq "^  model.layers.7.mlp.down_proj.weight +F32 +\[32, 64\] +stage 7, 1 piece$" <<<"$out" ||
  fail "pipemat checkpoint: no line of model.layers.7.mlp.down_proj.weight"
grep -q "^verified 4 files, .*: every one is the file its manifest recorded$" <<<"$out" ||
  fail "pipemat checkpoint: no verified line"
cp -r "$work/a/step-000008" "$work/damaged"
printf 'X' | dd of="$work/damaged/rank-2.safetensors" bs=1 seek=200 conv=notrunc 2>/dev/null
if out=$("$pipemat" checkpoint "$work/damaged" 2>&1); then fail "pipemat checkpoint passed a damaged file"; fi
grep -q "^pipemat: error: checkpoint $work/damaged: 1 of 4 files are not the ones its manifest recorded: $work/damaged/rank-2.safetensors: damaged or replaced" <<<"$out" ||
  { echo "$out" | tail -3; fail "pipemat checkpoint: the damaged file is not named"; }
echo "ok: 2 -> 4 ranks (zb-v), 4 -> 2 ranks, [1,7] -> [7,1] over tcp and a lost host" \
     "(4 ranks, rank 2 killed, 2 ranks resumed after step $from) train as the straight run, bitwise;" \
     "pipemat checkpoint verifies and names a damaged file"
