#!/usr/bin/env bash
# weights.sh PIPEMAT PIPEMAT_RUN CONFIG [--set k=v ...]: weights in and out as safetensors files
# with real processes. A 2-rank gpt run under mpirun (pipemat-run) saves a checkpoint;
# `pipemat export` writes it as one file; generate samples the same bytes from the file as from
# the checkpoint; a 2-rank run with training.init_from of that file and a step that moves
# nothing (SGD, lr 1e-300) exports the same bytes again; a file that lacks a tensor is one clear
# error, reported once (every rank finds it), never a crash.
set -euo pipefail
pipemat="$1" run="$2" config="$3"
shift 3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
common=(--set output.progress=false --set 'output.loss_svg=""' --set 'output.metrics=""'
        --set 'sample.tokens=0' "$@")
"$run" -n 2 "$config" -- "${common[@]}" --set training.steps=2 --set "checkpoint.dir=$work/ck"
ck="$work/ck/step-000002"
out=$("$pipemat" export --checkpoint "$ck" --out "$work/a.safetensors")
echo "$out"
grep -q "^exported $ck (gpt, step 2, 2 stages over 2 ranks): [0-9]* tensors, .* -> $work/a.safetensors$" <<<"$out" ||
  { echo "FAIL: export printed no summary"; exit 1; }
if ! cmp <("$pipemat" generate --checkpoint "$ck" --tokens 80 --seed 3 --quiet) \
         <("$pipemat" generate --checkpoint "$work/a.safetensors" --tokens 80 --seed 3 --quiet); then
  echo "FAIL: generate from the exported file differs from generate from the checkpoint"; exit 1
fi
"$run" -n 2 "$config" -- "${common[@]}" --set training.steps=1 --set "checkpoint.dir=$work/ck2" \
  --set "training.init_from=$work/a.safetensors" --set training.optimizer=sgd \
  --set training.lr=1e-300 --set training.lr_decay=none --set training.min_lr=0 \
  --set training.warmup=0 --set training.weight_decay=0 --set training.clip_grad_norm=0
"$pipemat" export --checkpoint "$work/ck2/step-000001" --out "$work/b.safetensors" >/dev/null
cmp "$work/a.safetensors" "$work/b.safetensors" ||
  { echo "FAIL: export -> init_from -> export changed the file"; exit 1; }
# The file without its first tensor (the one at offset 0), made with Python's standard library.
python3 - "$work/a.safetensors" "$work/bad.safetensors" <<'PY'
import json, struct, sys
data = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", data[:8])[0]
header = json.loads(data[8:8 + n])
meta = header.pop("__metadata__", None)
first = sorted(header, key=lambda k: header[k]["data_offsets"][0])[0]
begin, end = header.pop(first)["data_offsets"]
body = data[8 + n:]
out = {}
if meta is not None:
    out["__metadata__"] = meta
for k in sorted(header, key=lambda k: header[k]["data_offsets"][0]):
    b, e = header[k]["data_offsets"]
    out[k] = dict(header[k], data_offsets=[b - (end - begin), e - (end - begin)])
text = json.dumps(out, separators=(",", ":")).encode()
text += b" " * ((8 - len(text) % 8) % 8)
open(sys.argv[2], "wb").write(struct.pack("<Q", len(text)) + text + body[:begin] + body[end:])
print(first)
PY
if out=$("$run" -n 2 "$config" -- "${common[@]}" --set training.steps=1 \
         --set "checkpoint.dir=$work/ck3" --set "training.init_from=$work/bad.safetensors" 2>&1); then
  echo "FAIL: a file without a tensor was accepted"; exit 1
fi
echo "$out" | grep "error" | head -3
grep -q "training.init_from: $work/bad.safetensors does not hold the parameters of this model (.*; 1 missing: " <<<"$out" ||
  { echo "$out" | tail -5; echo "FAIL: the error does not list the missing tensor"; exit 1; }
[ "$(grep -c "pipemat: error" <<<"$out")" -eq 1 ] ||
  { echo "$out" | tail -5; echo "FAIL: not one error line (the fault is every rank's)"; exit 1; }
if grep -q "Segmentation\|Aborted\|terminate called" <<<"$out"; then
  echo "FAIL: a crash"; exit 1
fi
echo "ok"
