#!/usr/bin/env bash
# Builds pipemat against another LibTorch from PyPI and runs the test suite with it:
#   bash scripts/check-torch.sh VERSION [ctest flags]      e.g. scripts/check-torch.sh 2.11.0
# Installs torch==VERSION into /opt/pipemat-venv-VERSION (PIPEMAT_CHECK_VENV overrides; skipped
# when present), configures ./build-torch-VERSION against it (-DTorch_DIR) with warnings as
# errors, builds every target and runs ctest as scripts/test.sh does, less the sanitizer suites
# (scripts/test.sh runs those against the pinned version). The pinned default
# (cmake/torch-version.txt) is what scripts/test.sh checks; this checks the rest of the
# supported range (cmake/PipematTorch.cmake).
set -euo pipefail
if [ $# -lt 1 ] || [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
  sed -n '2,9p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
  exit 2
fi
version="$1"
shift
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${PIPEMAT_CHECK_VENV:-/opt/pipemat-venv-$version}"
PIPEMAT_VENV="$venv" PIPEMAT_TORCH_VERSION="$version" bash "$root/scripts/install-deps.sh"
torch_dir="$(echo "$venv"/lib/python3*/site-packages/torch/share/cmake/Torch)"
[ -f "$torch_dir/TorchConfig.cmake" ] || { echo "pipemat: no TorchConfig.cmake in $torch_dir"; exit 1; }
build="$root/build-torch-$version"
generator=()
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi
start=$(date +%s)
cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DPIPEMAT_WERROR=ON -DTorch_DIR="$torch_dir" >/dev/null
cmake --build "$build" -j "${PIPEMAT_BUILD_JOBS:-$(nproc)}"
echo "pipemat: build against LibTorch $version done in $(( $(date +%s) - start )) s"
export OMP_NUM_THREADS=1
cd "$build"
ctest --output-on-failure -j "$(nproc)" -LE "perf|sanitize" "$@"
