#!/usr/bin/env bash
# torch_range.sh SOURCE_DIR WORK_DIR: the configure step refuses a LibTorch outside the supported
# range with one message naming the version and where it was found (Note [Finding LibTorch] in
# cmake/PipematTorch.cmake). Stand-in CMake packages of LibTorch 2.10.0 and 2.16.0 are given as
# Torch_DIR; no compiler runs past CMake's own checks.
set -euo pipefail
src="$1" work="$2"
rm -rf "$work"
for version in 2.10.0 2.16.0; do
  pkg="$work/torch-$version"
  mkdir -p "$pkg"
  echo "set(PACKAGE_VERSION \"$version\")
set(PACKAGE_VERSION_COMPATIBLE TRUE)" > "$pkg/TorchConfigVersion.cmake"
  echo "add_library(torch INTERFACE IMPORTED)" > "$pkg/TorchConfig.cmake"
  status=0
  out=$(cmake -S "$src" -B "$work/build-$version" -DTorch_DIR="$pkg" 2>&1) || status=$?
  if [ "$status" -eq 0 ]; then
    echo "torch_range: FAIL: LibTorch $version was accepted"; exit 1
  fi
  expected="pipemat supports LibTorch 2.11 to 2.15; found:"
  if ! grep -q "$expected" <<<"$out" || ! grep -q "LibTorch $version at $pkg" <<<"$out"; then
    echo "$out" | tail -20
    echo "torch_range: FAIL: no message naming LibTorch $version and the range"; exit 1
  fi
  echo "torch_range: LibTorch $version refused: $(grep -o "$expected" <<<"$out") LibTorch $version at $pkg"
done
echo "torch_range: ok"
