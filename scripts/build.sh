#!/usr/bin/env bash
# Configures and builds pipemat into ./build (Ninja and ccache when present), warnings as errors.
# Usage: scripts/build.sh [--target T ...] [extra cmake -D options]
#   --target T  build only T and what it needs (scripts/run.sh builds the `pipemat` command);
#               default: every target. scripts/run.sh and scripts/test.sh configure the same
#               build directory the same way, so the second one only builds what the first did not.
# PIPEMAT_WERROR=OFF in the environment builds with warnings that are not errors.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${PIPEMAT_BUILD_DIR:-$root/build}"
targets=()
options=()
while [ $# -gt 0 ]; do
  case "$1" in
    --target) targets+=(--target "$2"); shift 2 ;;
    *) options+=("$1"); shift ;;
  esac
done
generator=()
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi
start=$(date +%s)
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
        -DPIPEMAT_WERROR="${PIPEMAT_WERROR:-ON}" "${options[@]}" >/dev/null
else
  cmake -S "$root" -B "$build" -DPIPEMAT_WERROR="${PIPEMAT_WERROR:-ON}" "${options[@]}" >/dev/null
fi
echo "pipemat: configured $build in $(( $(date +%s) - start )) s"
jobs="${PIPEMAT_BUILD_JOBS:-$(nproc)}"
echo "pipemat: building ${targets[*]:-every target} in $build with $jobs jobs"
start=$(date +%s)
cmake --build "$build" -j "$jobs" "${targets[@]}"
echo "pipemat: build done in $(( $(date +%s) - start )) s"
