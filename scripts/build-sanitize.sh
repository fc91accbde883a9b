#!/usr/bin/env bash
# Builds the unit suites of core, schedule and comm with AddressSanitizer and
# UndefinedBehaviorSanitizer into ./build-asan (PIPEMAT_SANITIZE_BUILD_DIR); the ctest test
# Sanitize.address_undefined of the main build runs them.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${PIPEMAT_SANITIZE_BUILD_DIR:-$root/build-asan}"
generator=()
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
        -DPIPEMAT_SANITIZE=address,undefined >/dev/null
fi
echo "pipemat: building the sanitizer suites in $build"
start=$(date +%s)
cmake --build "$build" -j "${PIPEMAT_BUILD_JOBS:-$(nproc)}" --target core_test schedule_test comm_test
echo "pipemat: sanitizer build done in $(( $(date +%s) - start )) s"
