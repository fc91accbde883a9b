#!/usr/bin/env bash
# Installs what is missing, builds, and runs the main job.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/install-deps.sh"
bash "$root/scripts/build.sh"
build="${PIPEMAT_BUILD_DIR:-$root/build}"
export OMP_NUM_THREADS=1
config="${1:-$root/configs/default.yaml}"
[ $# -gt 0 ] && shift
exec "$build/launch/pipemat-run" -n 2 "$config" -- "$@"
