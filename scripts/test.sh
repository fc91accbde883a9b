#!/usr/bin/env bash
# Installs what is missing, builds, and runs the whole test suite (unit, in-process multi-rank,
# and real mpirun multi-process tests). Ends with ctest's summary.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/install-deps.sh"
bash "$root/scripts/check-format.sh"
# Warnings are errors here (PIPEMAT_WERROR, README "Building and the checks CI runs").
export PIPEMAT_WERROR="${PIPEMAT_WERROR:-ON}"
bash "$root/scripts/build.sh"
bash "$root/scripts/build-sanitize.sh"
build="${PIPEMAT_BUILD_DIR:-$root/build}"
export OMP_NUM_THREADS=1
cd "$build"
# Wall-clock checks (label perf) depend on the machine, not on the code: `ctest -L perf` runs them.
ctest --output-on-failure -j "$(nproc)" -LE perf "$@"
