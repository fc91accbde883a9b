#!/usr/bin/env bash
# Builds the sanitizer suites that the ctest tests Sanitize.* of the main build run:
#   ./build-asan (PIPEMAT_SANITIZE_BUILD_DIR): the core, schedule, comm and weights unit suites with
#     AddressSanitizer + UndefinedBehaviorSanitizer;
#   ./build-tsan (PIPEMAT_TSAN_BUILD_DIR): the comm unit suite (the tcp transport's I/O thread
#     and the local transport's rank threads among it) with ThreadSanitizer.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
generator=()
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi

# build DIR SANITIZERS TARGET...
build() {
  local dir="$1" sanitizers="$2"
  shift 2
  local werror=(-DPIPEMAT_WERROR="${PIPEMAT_WERROR:-ON}")  # as scripts/build.sh
  if [ ! -f "$dir/CMakeCache.txt" ]; then
    cmake -S "$root" -B "$dir" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
          -DPIPEMAT_SANITIZE="$sanitizers" "${werror[@]}" >/dev/null
  else
    cmake -S "$root" -B "$dir" "${werror[@]}" >/dev/null
  fi
  echo "pipemat: building the $sanitizers sanitizer suites in $dir"
  local start
  start=$(date +%s)
  cmake --build "$dir" -j "${PIPEMAT_BUILD_JOBS:-$(nproc)}" --target "$@"
  echo "pipemat: $sanitizers sanitizer build done in $(( $(date +%s) - start )) s"
}

build "${PIPEMAT_SANITIZE_BUILD_DIR:-$root/build-asan}" address,undefined \
      core_test schedule_test comm_test weights_test
build "${PIPEMAT_TSAN_BUILD_DIR:-$root/build-tsan}" thread comm_test
