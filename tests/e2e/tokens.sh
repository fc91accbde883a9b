#!/usr/bin/env bash
# tokens.sh PIPEMAT PIPEMAT_RUN CONFIG TOKENIZER PYTHON: training on tokens with real processes.
# `pipemat prepare` tokenizes the fortunes into a Megatron indexed dataset, the same bytes on 1
# and on 2 threads, every document the tokenizers package's ids plus the end-of-text id as
# megatron-core reads them; an existing output is refused without --overwrite. A tied llama of
# vocabulary 2048 trains 60 steps on 2 ranks from it (the validation loss per token and per byte);
# generate continues a prompt greedily from the checkpoint and from its export (a Hugging Face
# directory with the tokenizer beside it) with the same ids, transformers' greedy generate on the
# exported directory gives those ids too, and so does generate on the directory transformers'
# save_pretrained writes from it.
set -euo pipefail
pipemat="$1" run="$2" config="$3" tokenizer="$4" python="$5"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fortunes=/usr/share/games/fortunes
prep=("$pipemat" prepare --tokenizer "$tokenizer" --input "$fortunes" --separator $'\n%\n'
      --append-eod --quiet)
out=$("${prep[@]}" --output "$work/a" --threads 2)
echo "$out"
grep -Eq "^prepared [0-9]+ documents of [0-9]+ files \(.* of text\) with byte-level BPE, 2,048 tokens \(.*\): .* tokens \(uint16\) in [0-9.]+ s, [0-9]+ tokens/s on 2 threads -> $work/a.bin, $work/a.idx$" <<<"$out" ||
  { echo "FAIL: prepare printed no summary"; exit 1; }
"${prep[@]}" --output "$work/b" --threads 1 >/dev/null
cmp "$work/a.bin" "$work/b.bin" && cmp "$work/a.idx" "$work/b.idx" ||
  { echo "FAIL: prepare on 1 and 2 threads differ"; exit 1; }
if "${prep[@]}" --output "$work/a" 2>"$work/err"; then
  echo "FAIL: prepare replaced an existing dataset"; exit 1
fi
grep -q "overwrite" "$work/err" || { cat "$work/err"; echo "FAIL: no --overwrite hint"; exit 1; }
"$python" - "$tokenizer" "$fortunes" "$work/a" <<'PY'
import os, sys, warnings
warnings.filterwarnings("ignore")
from tokenizers import Tokenizer
from megatron.core.datasets.indexed_dataset import IndexedDataset
tok = Tokenizer.from_file(os.path.join(sys.argv[1], "tokenizer.json"))
docs, seen = [], set()
paths = sorted(os.path.join(r, f) for r, _, fs in os.walk(sys.argv[2]) for f in fs)
for p in paths:
    real = os.path.realpath(p)
    if real in seen or not os.path.isfile(p):
        continue
    seen.add(real)
    b = open(p, "rb").read()
    if not b or b"\0" in b:
        continue
    docs += [d for d in b.decode("utf-8", "replace").split("\n%\n") if d]
ds = IndexedDataset(sys.argv[3])
eod = tok.token_to_id("<|endoftext|>")
assert len(ds) == len(docs), (len(ds), len(docs))
for i, e in enumerate(tok.encode_batch(docs, add_special_tokens=False)):
    assert list(ds[i]) == e.ids + [eod], f"document {i} differs"
print(f"megatron-core reads {len(ds)} documents, each the tokenizers package's ids")
PY
common=(--set 'output.loss_svg=""' --set 'output.metrics=""'
        --set sample.tokens=0 --set output.reference_steps=0 --set model.layers=2
        --set model.hidden=64 --set model.heads=2 --set model.kv_heads=1 --set model.ffn=64
        --set model.seq_len=32 --set model.batch=2 --set model.vocab=2048
        --set model.tie_embeddings=true --set schedule.kind=1f1b --set schedule.micro_batches=4
        --set remat.policy=none --set schedule.recompute=none --set training.steps=60
        --set training.eval_every=60 --set training.eval_batches=2 --set training.warmup=0
        --set data.format=indexed --set "data.path=$work/a" --set "data.tokenizer=$tokenizer")
"$run" -n 2 "$config" -- "${common[@]}" --set "checkpoint.dir=$work/ck" 2>&1 | tee "$work/train.log"
grep -Eq '^validation after step 60: loss [0-9.]+ nats/token \([0-9.]+ bits\), [0-9.]+ nats/byte' \
  "$work/train.log" || { echo "FAIL: no loss per token and per byte"; exit 1; }
ck="$work/ck/step-000060"
gen=("$pipemat" generate --greedy --tokens 12 --prompt "Q: What is" --quiet --ids)
"${gen[@]}" --checkpoint "$ck" >"$work/ck.out"
mkdir "$work/hf"
"$pipemat" export --checkpoint "$ck" --out "$work/hf/model.safetensors" >/dev/null
cp "$tokenizer/tokenizer.json" "$work/hf/"
"${gen[@]}" --checkpoint "$work/hf" >"$work/hf.out"
cat "$work/ck.out"
cmp "$work/ck.out" "$work/hf.out" ||
  { cat "$work/hf.out"; echo "FAIL: generate from the export differs"; exit 1; }
ids=$(grep '^ids:' "$work/ck.out" | cut -d: -f2)
"$python" - "$work/hf" "Q: What is" "$ids" <<'PY'
import sys, warnings
warnings.filterwarnings("ignore")
import torch
from tokenizers import Tokenizer
from transformers import LlamaForCausalLM
model = LlamaForCausalLM.from_pretrained(sys.argv[1], torch_dtype=torch.float32).eval()
assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
prompt = Tokenizer.from_file(sys.argv[1] + "/tokenizer.json").encode(sys.argv[2]).ids
want = [int(x) for x in sys.argv[3].split()]
ids = torch.tensor([prompt])
got = []
with torch.no_grad():
    for _ in range(len(want)):
        logits = model(ids[:, -32:]).logits[0, -1, :2048]
        nxt = int(logits.argmax())
        got.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
assert got == want, f"transformers {got} pipemat {want}"
print("transformers' greedy ids equal pipemat's:", got)
model.save_pretrained(sys.argv[1] + "-transformers")  # transformers' own files, no pipemat metadata
PY
# The directory as transformers wrote it (config.json, model.safetensors without pipemat's
# metadata) with the tokenizer beside it: generate reads it as model.from does.
cp "$tokenizer/tokenizer.json" "$work/hf-transformers/"
"${gen[@]}" --checkpoint "$work/hf-transformers" >"$work/tf.out"
cmp "$work/ck.out" "$work/tf.out" ||
  { cat "$work/tf.out"; echo "FAIL: generate from transformers' directory differs"; exit 1; }
# Sampled (not greedy) text, the same from the three: the same logits, the same draws.
sample=("$pipemat" generate --tokens 40 --seed 5 --temperature 1 --top-k 0 --prompt "Q: " --quiet)
for dir in "$work/hf" "$work/hf-transformers"; do
  cmp <("${sample[@]}" --checkpoint "$ck") <("${sample[@]}" --checkpoint "$dir") ||
    { echo "FAIL: sampling from $dir differs from sampling from the checkpoint"; exit 1; }
done
echo "tokens.sh: OK"
