#!/usr/bin/env bash
# legacy_checkpoints.sh PIPEMAT LEGACY: checkpoints of the formats before 4 (rank-<r>.pt torch
# archives keyed by stage, Note [Checkpoint layout] in pp/include/pipemat/pp/checkpoint.h) still
# resume, on the layout that wrote them, and train on as the pipemat that wrote them did.
#
# LEGACY (tests/e2e/legacy) holds two real checkpoints of step 2, written by `pipemat train` of
# commit d4d983b (the writer before format 4) on configs/zoo.yaml, made tiny, with ranks as threads:
#   common=(--set transport.kind=local --set model.layers=4 --set model.hidden=16
#           --set model.tokens=8 --set training.optimizer=adamw --set training.lr=0.01
#           --set output.progress=false --set training.steps=4)
#   format-2:          pipemat train --config configs/zoo.yaml "${common[@]}"
#                        --set checkpoint.dir=format-2 --set checkpoint.every=2 --stop-after 2
#   format-3-sharded:  the same with --set parallel.data=2 --set parallel.shard_optimizer=true
#                        --set checkpoint.dir=format-3-sharded
# The uninterrupted 4 steps of the same builds printed these losses (--metrics), and resuming
# each checkpoint with that build gave steps 2 and 3 equal to them:
#   format 2 (2 ranks, 1f1b, D=1):         1.3528742492198944 1.1822892129421234
#                                          1.156068354845047 1.0505937188863754
#   format 3 (2 ranks, 1f1b, D=2 sharded): 1.2975825369358063 1.1926573365926743
#                                          1.1102545261383057 1.0944659188389778
# The config of each is the one its manifest records ("metadata").
#
# Checks, each on a copy (the stored checkpoints are never written):
#   * format 2, format 3 (sharded) and format 1 (the format-2 checkpoint with its manifest
#     rewritten as format 1 wrote it: no digests, no run) resume on their layout: steps 2 and 3
#     equal the old build's bitwise, and the layout is not called another (no "resharded" line);
#   * on another layout (schedule kind, world size, data degree) they are refused with the
#     ConfigError naming the field, the checkpoint unchanged;
#   * a flipped byte in a rank file is refused naming it (Note [Verified checkpoints]), a FIFO in
#     its place at once (Note [Opening an input file]);
#   * the checkpoint the resumed format-2 run saves (format 4) resumes on 4 ranks: "resharded".
set -euo pipefail
pipemat="$1" legacy="$2"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { [ -f "$work/out" ] && tail -20 "$work/out"; echo "FAIL: $*"; exit 1; }
cp -r "$legacy/format-2" "$legacy/format-3-sharded" "$work/"
f2="$work/format-2/step-000002" f3="$work/format-3-sharded/step-000002"
# The config a checkpoint was written with, from its manifest.
config_of() {
  python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["metadata"], end="")' \
    "$1/manifest.json" >"$2"
}
config_of "$f2" "$work/format-2.yaml"
config_of "$f3" "$work/format-3.yaml"
grep -q "shard_optimizer: true" "$work/format-3.yaml" || fail "the format-3 config is not sharded"
common=(--set output.progress=true --set training.stop_after=0 --set checkpoint.every=0
        --set checkpoint.keep_last=0 --set 'output.metrics=""')
# resume NAME CONFIG FROM [--set ...]: resumes FROM; output in $work/out, exit code in $rc,
# losses (one "step loss" line per step) in $work/NAME.losses.
resume() {
  local name="$1" config="$2" from="$3"
  shift 3
  rc=0
  "$pipemat" train --config "$config" "${common[@]}" --set "checkpoint.dir=$work/out-$name" \
    --metrics "$work/$name.jsonl" --resume "$from" "$@" >"$work/out" 2>&1 || rc=$?
  grep -o '"step":[0-9]*,"loss":[-0-9.e]*' "$work/$name.jsonl" 2>/dev/null |
    sed -E 's/"step":([0-9]+),"loss":/\1 /' >"$work/$name.losses" || true
}
# expect_resumed NAME FROM LOSS2 LOSS3: trained steps 2 and 3 from FROM on its own layout.
expect_resumed() {
  [ "$rc" -eq 0 ] || fail "$1: exit code $rc"
  grep -q "^resumed from $2 after step 2$" "$work/out" || fail "$1: no line 'resumed from $2 after step 2'"
  if grep -q "^resharded from" "$work/out"; then
    fail "$1: resumed on the layout that wrote it, but the run says: $(grep '^resharded' "$work/out")"
  fi
  local want
  want=$(printf '2 %s\n3 %s' "$3" "$4")
  [ "$(cat "$work/$1.losses")" = "$want" ] ||
    fail "$1: the losses after the resume differ from the old build's:
$(diff <(echo "$want") "$work/$1.losses")"
  echo "ok: $1 resumed on its layout: steps 2 and 3 equal the old build's ($3 $4)"
}
listing() { (cd "$work" && find format-2 format-3-sharded -type f -exec sha256sum {} + | sort | sha256sum); }
before=$(listing)

resume format-2 "$work/format-2.yaml" "$f2"
expect_resumed format-2 "$f2" 1.156068354845047 1.0505937188863754
resume format-3 "$work/format-3.yaml" "$f3"
expect_resumed format-3 "$f3" 1.1102545261383057 1.0944659188389778
# Format 1: no digests and no run in the manifest (the rank files name a run, unread there).
cp -r "$f2" "$work/format-1"
python3 - "$work/format-1/manifest.json" <<'PY'
import json, sys
path = sys.argv[1]
m = json.load(open(path))
m["format"] = 1
del m["files"], m["run"]
json.dump(m, open(path, "w"), indent=2, sort_keys=True)
PY
resume format-1 "$work/format-2.yaml" "$work/format-1"
expect_resumed format-1 "$work/format-1" 1.156068354845047 1.0505937188863754

# Another layout: refused naming the field (formats 1 to 3 name tensors by rank and stage).
expect_refused() {  # expect_refused WHAT REGEX
  [ "$rc" -eq 1 ] || fail "$1: exit code $rc, expected 1"
  grep -Eq -- "$2" "$work/out" || fail "$1: no line matching: $2"
  if grep -q "^step " "$work/out"; then fail "$1: trained before refusing"; fi
  echo "ok: $1: $(grep -Eo -- "$2" "$work/out" | head -1)"
}
layout() {  # the end of the refusal of format $1 on another layout
  echo "; a checkpoint of format $1 \(written before pipemat stored tensors by global name\) resumes only with the options it was written with; the checkpoints written now \(format 4\) resume on any layout$"
}
resume kind "$work/format-2.yaml" "$f2" --set schedule.kind=gpipe
expect_refused "format 2 on gpipe" \
  "^pipemat: error: load_checkpoint: $f2/manifest.json: schedule_kind is \"1f1b\" in the checkpoint but \"gpipe\" in this pipeline$(layout 2)"
resume ranks "$work/format-2.yaml" "$f2" --set schedule.ranks=4
expect_refused "format 2 on 4 ranks" \
  "^pipemat: error: load_checkpoint: $f2/manifest.json: world_size is 2 in the checkpoint but 4 in this pipeline$(layout 2)"
resume mb "$work/format-3.yaml" "$f3" --set schedule.micro_batches=2
expect_refused "format 3 with 2 micro-batches" \
  "^pipemat: error: load_checkpoint: $f3/manifest.json: micro_batches is 4 in the checkpoint but 2 in this pipeline$(layout 3)"
[ "$before" = "$(listing)" ] || fail "a resume changed the stored checkpoints"

# A flipped byte in a rank file; a FIFO in its place (under timeout: at once, not a hang).
cp -r "$f2" "$work/flipped"
python3 - "$work/flipped/rank-1.pt" <<'PY'
import sys
path = sys.argv[1]
data = bytearray(open(path, "rb").read())
data[len(data) // 2] ^= 0x5a
open(path, "wb").write(bytes(data))
PY
resume flipped "$work/format-2.yaml" "$work/flipped"
expect_refused "format 2 with a flipped byte" \
  "load_checkpoint: $work/flipped/rank-1.pt is damaged or was replaced: its SHA-256 is [0-9a-f]{16}\.\.\. \([0-9]+ bytes\) but $work/flipped/manifest.json recorded [0-9a-f]{16}\.\.\."
cp -r "$f2" "$work/fifo"
rm "$work/fifo/rank-1.pt"
mkfifo "$work/fifo/rank-1.pt"
rc=0
timeout -s KILL 10 "$pipemat" train --config "$work/format-2.yaml" "${common[@]}" \
  --set "checkpoint.dir=$work/out-fifo" --resume "$work/fifo" >"$work/out" 2>&1 || rc=$?
[ "$rc" -ne 137 ] || fail "a FIFO as rank-1.pt: still running after 10 s (a hang)"
expect_refused "format 2 with a FIFO as rank-1.pt" "load_checkpoint: '$work/fifo/rank-1.pt' is a FIFO \(named pipe\)"

# The resumed format-2 run saved step 4 in format 4, which resumes on another layout.
saved="$work/out-format-2/step-000004"
grep -q '"format": 4' "$saved/manifest.json" || fail "the resumed run did not save format 4"
files=$(cd "$saved" && find . -type f | sort | tr '\n' ' ')
[ "$files" = "./manifest.json ./rank-0.safetensors ./rank-1.safetensors " ] ||
  fail "the files of $saved: $files"
rc=0
"$pipemat" train --config "$work/format-2.yaml" "${common[@]}" --set training.steps=5 \
  --set schedule.ranks=4 --set "checkpoint.dir=$work/out-four" --resume "$saved" >"$work/out" 2>&1 ||
  rc=$?
[ "$rc" -eq 0 ] || fail "format 4 on 4 ranks: exit code $rc"
grep -q "^resharded from 2 ranks (1f1b, D=1) to 4 ranks (1f1b, D=1)$" "$work/out" ||
  fail "format 4 on 4 ranks: no 'resharded' line"
grep -Eq "^resumed from $saved after step 4\b.* read [0-9.]+ [KMG]?i?B" "$work/out" ||
  fail "format 4 on 4 ranks: no line 'resumed from $saved after step 4' saying what was read"
grep -q "^step 5/5" "$work/out" || fail "format 4 on 4 ranks: step 5 did not run"
echo "ok: $(grep '^resharded' "$work/out")"
echo "PASS"
