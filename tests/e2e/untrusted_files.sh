#!/usr/bin/env bash
# untrusted_files.sh PIPEMAT CONFIG LLAMA_CONFIG DATA [--set k=v ...]: every file a command reads is untrusted
# (Note [Opening an input file], Note [Non-finite values at load], Note [Export never destroys]).
# A 2-rank run (ranks as threads) and a sharded 2 x 2 run save checkpoints; then, each under
# `timeout 5`:
#   * a rank file (rank-1.safetensors) or an optimizer shard (rank-1.shard-1-of-2.safetensors)
#     that is a FIFO, or a symlink to /dev/zero, ends `pipemat export`, `pipemat generate` and
#     `pipemat train --resume` at once with exit 1 and one line naming the path (before: a hang
#     that ignored SIGTERM);
#   * a NaN in a weight file is refused by training.init_from and generate naming the file, the
#     tensor and the index, and training.allow_non_finite=true lets it through;
#   * export refuses a destination in the checkpoint, a symlink, an existing file without
#     --overwrite and an empty --out, and leaves no file behind when config.json is a directory.
set -euo pipefail
pipemat="$1" config="$2" llama="$3" data="$4"
shift 4
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
base=(--set transport.kind=local --set output.progress=false --set 'output.loss_svg=""'
      --set 'output.metrics=""' --set 'sample.tokens=0')
common=("${base[@]}" "$@")

# expect_refusal WHAT REGEX COMMAND...: exits 1 within 5 s, its output matching REGEX, no
# backtrace.
expect_refusal() {
  local what="$1" regex="$2" rc=0 start
  shift 2
  start=$(date +%s%N)
  timeout -s KILL 5 "$@" >"$work/out" 2>&1 || rc=$?
  local ms=$(( ($(date +%s%N) - start) / 1000000 ))
  [ "$rc" -ne 137 ] || fail "$what: still running after 5 s (a hang)"
  [ "$rc" -eq 1 ] || { cat "$work/out"; fail "$what: exit code $rc, expected 1"; }
  grep -Eq -- "$regex" "$work/out" || { cat "$work/out"; fail "$what: no line matching: $regex"; }
  ! grep -q "frame #" "$work/out" || { cat "$work/out"; fail "$what: a backtrace"; }
  echo "ok: $what ($ms ms): $(grep -E -- "$regex" "$work/out" | head -1)"
}

"$pipemat" train --config "$config" "${common[@]}" --set training.steps=1 \
  --set "checkpoint.dir=$work/ck" >/dev/null
"$pipemat" train --config "$config" "${common[@]}" --set training.steps=1 \
  --set "checkpoint.dir=$work/sharded" --set schedule.ranks=2 --set parallel.data=2 \
  --set parallel.shard_optimizer=true >/dev/null
ck="$work/ck/step-000001"
sharded="$work/sharded/step-000001"
[ -f "$sharded/rank-1.shard-1-of-2.safetensors" ] || fail "the sharded run wrote no shard files"

for kind in fifo zero; do
  for target in "$ck/rank-1.safetensors" "$sharded/rank-1.shard-1-of-2.safetensors"; do
    dir=$(dirname "$target")
    copy="$work/$kind-$(basename "$(dirname "$dir")")/step-000001"
    mkdir -p "$(dirname "$copy")"
    cp -r "$dir" "$copy"
    bad="$copy/$(basename "$target")"
    rm "$bad"
    if [ "$kind" = fifo ]; then
      mkfifo "$bad"; regex="$bad' is a FIFO \(named pipe\)"
    else
      ln -s /dev/zero "$bad"; regex="$bad' is a character device"
    fi
    if [ "$target" = "$ck/rank-1.safetensors" ]; then
      expect_refusal "export, $kind as rank-1.safetensors" "$regex" \
        "$pipemat" export --checkpoint "$copy" --out "$work/never.safetensors"
      expect_refusal "generate, $kind as rank-1.safetensors" "$regex" \
        "$pipemat" generate --checkpoint "$copy" --tokens 4
      expect_refusal "train --resume, $kind as rank-1.safetensors" "$regex" \
        "$pipemat" train --config "$config" "${common[@]}" --set training.steps=2 \
        --set "checkpoint.dir=$(dirname "$copy")" --resume "$copy"
    else
      expect_refusal "train --resume, $kind as a shard" "$regex" \
        "$pipemat" train --config "$config" "${common[@]}" --set training.steps=2 \
        --set "checkpoint.dir=$(dirname "$copy")" --resume "$copy" --set schedule.ranks=2 \
        --set parallel.data=2 --set parallel.shard_optimizer=true
    fi
  done
done
[ ! -e "$work/never.safetensors" ] || fail "a refused export left its file"

# A NaN at [2, 5] of the first two-dimensional weight (in name order) of an exported file.
"$pipemat" export --checkpoint "$ck" --out "$work/w/model.safetensors" >/dev/null
name=$(python3 - "$work/w/model.safetensors" "$work/nan/model.safetensors" <<'PY'
import json, os, struct, sys
data = bytearray(open(sys.argv[1], "rb").read())
n = struct.unpack("<Q", data[:8])[0]
header = json.loads(data[8:8 + n])
name = sorted(k for k in header if k != "__metadata__" and len(header[k]["shape"]) == 2)[0]
info = header[name]
assert info["dtype"] == "F32"
at = 8 + n + info["data_offsets"][0] + 4 * (2 * info["shape"][1] + 5)
data[at:at + 4] = struct.pack("<f", float("nan"))
os.makedirs(os.path.dirname(sys.argv[2]), exist_ok=True)
open(sys.argv[2], "wb").write(data)
print(name)
PY
)
expect_refusal "init_from with a NaN" \
  "training.init_from: $work/nan/model.safetensors: tensor '$name' holds NaN at index \[2, 5\]" \
  "$pipemat" train --config "$config" "${common[@]}" --set training.steps=1 \
  --set "training.init_from=$work/nan/model.safetensors" --set "checkpoint.dir=$work/ck-nan"
expect_refusal "generate with a NaN" \
  "generate: $work/nan/model.safetensors: tensor '$name' holds NaN at index \[2, 5\]" \
  "$pipemat" generate --checkpoint "$work/nan/model.safetensors" --tokens 4
"$pipemat" train --config "$config" "${common[@]}" --set training.steps=1 \
  --set "training.init_from=$work/nan/model.safetensors" --set training.allow_non_finite=true \
  --set "checkpoint.dir=$work/ck-nan" >/dev/null || fail "training.allow_non_finite=true did not let the NaN through"
echo "ok: training.allow_non_finite=true trains on it"

# Export never destroys.
before=$(sha256sum "$ck"/* | sha256sum)
expect_refusal "export into the checkpoint (rank file)" "is inside the checkpoint directory" \
  "$pipemat" export --checkpoint "$ck" --out "$ck/rank-0.safetensors"
expect_refusal "export into the checkpoint (rank file, --overwrite)" \
  "is inside the checkpoint directory" \
  "$pipemat" export --checkpoint "$ck" --out "$ck/rank-0.safetensors" --overwrite
expect_refusal "export into the checkpoint (manifest)" "is inside the checkpoint directory" \
  "$pipemat" export --checkpoint "$ck" --out "$ck/manifest.json"
[ "$(sha256sum "$ck"/* | sha256sum)" = "$before" ] || fail "a refused export changed the checkpoint"
ln -s "$work/w/model.safetensors" "$work/link.safetensors"
expect_refusal "export to a symlink" "is a symbolic link" \
  "$pipemat" export --checkpoint "$ck" --out "$work/link.safetensors"
[ -L "$work/link.safetensors" ] || fail "export replaced the link"
expect_refusal "export over a file" "exists; export never replaces a file unless told to \(--overwrite\)" \
  "$pipemat" export --checkpoint "$ck" --out "$work/w/model.safetensors"
inode=$(stat -c %i "$work/w/model.safetensors")
"$pipemat" export --checkpoint "$ck" --out "$work/w/model.safetensors" --overwrite >/dev/null ||
  fail "--overwrite did not replace the file"
# The new file was renamed into place: another inode, never a write into the old one.
[ "$(stat -c %i "$work/w/model.safetensors")" != "$inode" ] || fail "--overwrite wrote in place"
expect_refusal "export to ''" "--out is empty" "$pipemat" export --checkpoint "$ck" --out ''
# A llama writes config.json beside its file: a directory of that name is refused before either
# file is written.
"$pipemat" train --config "$llama" "${base[@]}" --set training.steps=1 --set schedule.ranks=1 \
  --set model.layers=1 --set model.hidden=32 --set model.heads=2 --set model.kv_heads=1 \
  --set model.ffn=64 --set model.seq_len=16 --set model.batch=2 --set "data.path=$data" \
  --set "checkpoint.dir=$work/llama" >/dev/null
mkdir -p "$work/cfgdir/config.json"
expect_refusal "export beside a config.json directory" \
  "$work/cfgdir/config.json exists and is not a regular file" \
  "$pipemat" export --checkpoint "$work/llama/step-000001" --out "$work/cfgdir/model.safetensors"
[ ! -e "$work/cfgdir/model.safetensors" ] || fail "export left model.safetensors beside the refusal"
[ -z "$(find "$work" -name '*.tmp')" ] || fail "temporaries left: $(find "$work" -name '*.tmp')"
echo "PASS"
