#!/usr/bin/env bash
# Installs what is missing, builds the `pipemat` command, and runs the main job.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
start=$(date +%s)
bash "$root/scripts/install-deps.sh"
echo "pipemat: dependencies ready in $(( $(date +%s) - start )) s"
bash "$root/scripts/build.sh" --target pipemat
build="${PIPEMAT_BUILD_DIR:-$root/build}"
export OMP_NUM_THREADS=1
config="${1:-$root/configs/default.yaml}"
[ $# -gt 0 ] && shift
exec "$build/launch/pipemat-run" -n 2 "$config" -- "$@"
