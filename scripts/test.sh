#!/usr/bin/env bash
# Installs what is missing, builds, and runs the whole test suite (unit, in-process multi-rank,
# and real mpirun multi-process tests). Ends with ctest's summary.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
start=$(date +%s)
bash "$root/scripts/install-deps.sh"
echo "pipemat: dependencies ready in $(( $(date +%s) - start )) s"
bash "$root/scripts/check-format.sh"
# Warnings are errors (scripts/build.sh; README "Building and the checks CI runs"): the same
# configuration as scripts/run.sh, so this builds only what run.sh did not.
bash "$root/scripts/build.sh"
bash "$root/scripts/build-sanitize.sh"
# The libFuzzer targets (clang) that ctest's Fuzz.* run (tests/fuzz).
bash "$root/scripts/build-fuzz.sh"
build="${PIPEMAT_BUILD_DIR:-$root/build}"
export OMP_NUM_THREADS=1
cd "$build"
# Wall-clock checks (label perf) depend on the machine, not on the code: `ctest -L perf` runs them.
# ctest's summary ends the output, with the tests' time ("Total Test time (real)").
ctest --output-on-failure -j "$(nproc)" -LE perf "$@"
