#!/usr/bin/env bash
# bench-data.sh [--tokenizer DIR] [--input PATH] [--separator S] [--threads N] [--python PY]:
# tokenization speed side by side on the same documents and cores. `pipemat prepare` (encode and
# write a Megatron indexed dataset, its own summary's tokens/s) against the tokenizers package's
# encode_batch (on N threads: RAYON_NUM_THREADS), each run 3 times, the best of each; then both
# datasets' ids compared. Defaults: the repo's BPE (configs/tokenizers/fortunes-bpe), the fortunes
# split at "\n%\n", the machine's hardware threads, the project's Python. Prints one line per
# tool and the ratio; the machine and its load come first (compare only within one run).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tokenizer="$root/configs/tokenizers/fortunes-bpe" input=/usr/share/games/fortunes
separator=$'\n%\n' threads=$(nproc) python=/opt/pipemat-venv/bin/python3
while [ $# -gt 0 ]; do
  case "$1" in
    --tokenizer) tokenizer="$2"; shift 2 ;;
    --input) input="$2"; shift 2 ;;
    --separator) separator="$2"; shift 2 ;;
    --threads) threads="$2"; shift 2 ;;
    --python) python="$2"; shift 2 ;;
    -h|--help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "bench-data: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
pipemat="$root/build/launch/pipemat"
[ -x "$pipemat" ] || { echo "bench-data: build first (bash scripts/build.sh)" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "machine: $(lscpu | sed -n 's/^Model name: *//p' | head -1), $(nproc) hardware threads; load:$(cut -d' ' -f1-3 /proc/loadavg | sed 's/^/ /')"
best=0
for run in 1 2 3; do
  line=$("$pipemat" prepare --tokenizer "$tokenizer" --input "$input" --separator "$separator" \
         --threads "$threads" --output "$work/pipemat" --overwrite --quiet)
  rate=$(sed -n 's/.*s, \([0-9]*\) tokens\/s on.*/\1/p' <<<"$line")
  [ "$rate" -gt "$best" ] && best=$rate
done
echo "pipemat prepare: $best tokens/s (best of 3; ${line#prepared })"
RAYON_NUM_THREADS="$threads" "$python" - "$tokenizer" "$input" "$separator" "$work/pipemat" "$best" <<'PY'
import os, sys, time, warnings
warnings.filterwarnings("ignore")
from tokenizers import Tokenizer
tokenizer_dir, root, separator, prefix, ours = sys.argv[1:6]
path = os.path.join(tokenizer_dir, "tokenizer.json") if os.path.isdir(tokenizer_dir) else tokenizer_dir
tok = Tokenizer.from_file(path)
paths = [root] if os.path.isfile(root) else sorted(
    os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)
docs, seen = [], set()
for p in paths:
    real = os.path.realpath(p)
    if real in seen or not os.path.isfile(p):
        continue
    seen.add(real)
    data = open(p, "rb").read()
    if data and b"\0" not in data:
        docs += [d for d in data.decode("utf-8", "replace").split(separator) if d]
best, encoded = None, None
for _ in range(3):
    t0 = time.perf_counter()
    encoded = tok.encode_batch(docs, add_special_tokens=False)
    seconds = time.perf_counter() - t0
    best = seconds if best is None else min(best, seconds)
tokens = sum(len(e.ids) for e in encoded)
rate = tokens / best
print(f"tokenizers {__import__('tokenizers').__version__} encode_batch: {rate:.0f} tokens/s "
      f"(best of 3; {len(docs)} documents, {tokens} tokens in {best:.3f} s)")
print(f"ratio: pipemat / tokenizers = {int(ours) / rate:.2f}")
# The same ids: the dataset's sequences against the package's.
try:
    from megatron.core.datasets.indexed_dataset import IndexedDataset
except ImportError:
    print("ids: not compared (megatron-core missing)")
    sys.exit(0)
ds = IndexedDataset(prefix)
same = len(ds) == len(encoded) and all(list(ds[i]) == e.ids for i, e in enumerate(encoded))
print("ids: " + ("equal, every document" if same else "DIFFERENT"))
sys.exit(0 if same else 1)
PY
