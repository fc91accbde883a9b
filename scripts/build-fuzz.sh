#!/usr/bin/env bash
# Builds the libFuzzer targets that the ctest tests Fuzz.* of the main build run (Note [Fuzz
# targets] in tests/fuzz/CMakeLists.txt): ./build-fuzz (PIPEMAT_FUZZ_BUILD_DIR), configured with
# clang (libFuzzer is clang's: Debian's `clang` package, scripts/install-deps.sh) and
# -DPIPEMAT_FUZZ=ON, which builds no LibTorch and no test suite: only the torch-free libraries the
# targets use, with -fsanitize=fuzzer-no-link,address,undefined, and the targets.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${PIPEMAT_FUZZ_BUILD_DIR:-$root/build-fuzz}"
generator=()
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi
werror=(-DPIPEMAT_WERROR="${PIPEMAT_WERROR:-ON}")  # as scripts/build.sh
if [ ! -f "$dir/CMakeCache.txt" ]; then
  CC=clang CXX=clang++ cmake -S "$root" -B "$dir" "${generator[@]}" \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPIPEMAT_FUZZ=ON "${werror[@]}" >/dev/null
else
  cmake -S "$root" -B "$dir" "${werror[@]}" >/dev/null
fi
echo "pipemat: building the fuzz targets in $dir"
start=$(date +%s)
cmake --build "$dir" -j "${PIPEMAT_BUILD_JOBS:-$(nproc)}"
echo "pipemat: fuzz build done in $(( $(date +%s) - start )) s"
