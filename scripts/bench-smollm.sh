#!/usr/bin/env bash
# bench-smollm.sh: a model of real size. Builds a random SmolLM-135M-shaped Llama with
# transformers (30 layers, hidden 576, 9 heads, 3 key/value heads, ffn 1536, vocab 49152, tied
# embeddings; 134.5 M parameters, float32, save_pretrained), trains it with pipemat for 3 steps
# on 4 ranks (pipemat-run, Open MPI) in bf16 with selective recompute pre-triggered (zb-h1, 8
# micro-batches of 2 x 256 tokens of the fortunes, configs/tokenizers/fortunes-bpe), prints
# pipemat's tokens/s and each rank's peak memory beside the single process's
# (output.reference_steps) and their ratio, and checks the first step's loss against
# transformers on the same batch: fp32 (a separate 1-step run) within 1e-5 relative, bf16
# (transformers under bf16 autocast) within 1e-3 relative. Exits 1 when a loss differs.
# About 3 minutes on a quiet 2-core machine, 6 with other jobs running. Not a ctest (too slow;
# E2e.BenchSmollmSmokeFirstLossEqualsTransformers runs 2 of the layers on 2 ranks).
#
#   bash scripts/bench-smollm.sh [--workdir DIR] [--schedule 1f1b] [...]   (--help: all)
#
# Needs the build's pipemat, pipemat-run and tests/train/llama_hf_check (PIPEMAT_BUILD_DIR,
# default build/; `cmake --build build --target pipemat llama_hf_check`) and the project's
# Python with torch, transformers and safetensors (PIPEMAT_VENV, default /opt/pipemat-venv).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${PIPEMAT_BUILD_DIR:-$root/build}"

python=""
for venv in "${PIPEMAT_VENV:-}" /opt/pipemat-venv "${HOME:-/nonexistent}/.local/share/pipemat/venv"; do
  if [ -n "$venv" ] && [ -x "$venv/bin/python3" ]; then python="$venv/bin/python3"; break; fi
done
[ -n "$python" ] || python="$(command -v python3 || true)"

for arg in "$@"; do
  if [ "$arg" = "-h" ] || [ "$arg" = "--help" ]; then
    sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'
    echo
    [ -n "$python" ] && exec "$python" "$root/scripts/bench_smollm.py" --help
    exit 0
  fi
done

[ -n "$python" ] || { echo "bench-smollm: no python3; scripts/install-deps.sh installs the project's Python" >&2; exit 2; }
"$python" -c "import torch, transformers, safetensors" 2>/dev/null || {
  echo "bench-smollm: $python lacks torch, transformers or safetensors; scripts/install-deps.sh installs them" >&2
  exit 2
}
pipemat="$build/launch/pipemat" run="$build/launch/pipemat-run" check="$build/tests/train/llama_hf_check"
for bin in "$pipemat" "$run" "$check"; do
  [ -x "$bin" ] || {
    echo "bench-smollm: $bin not found; build it: cmake --build $build --target pipemat llama_hf_check" >&2
    exit 2
  }
done
exec "$python" "$root/scripts/bench_smollm.py" --pipemat "$pipemat" --pipemat-run "$run" \
  --check "$check" "$@"
