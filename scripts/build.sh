#!/usr/bin/env bash
# Configures and builds pipemat into ./build (Ninja and ccache when present).
# Usage: scripts/build.sh [extra cmake -D options]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${PIPEMAT_BUILD_DIR:-$root/build}"
generator=()
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi
# PIPEMAT_WERROR=ON|OFF in the environment is passed on (scripts/test.sh sets ON).
werror=()
if [ -n "${PIPEMAT_WERROR:-}" ]; then werror=(-DPIPEMAT_WERROR="$PIPEMAT_WERROR"); fi
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo "${werror[@]}" "$@" >/dev/null
elif [ ${#werror[@]} -gt 0 ] || [ $# -gt 0 ]; then
  cmake -S "$root" -B "$build" "${werror[@]}" "$@" >/dev/null
fi
jobs="${PIPEMAT_BUILD_JOBS:-$(nproc)}"
echo "pipemat: building in $build with $jobs jobs"
start=$(date +%s)
cmake --build "$build" -j "$jobs"
echo "pipemat: build done in $(( $(date +%s) - start )) s"
