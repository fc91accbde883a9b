#!/usr/bin/env bash
# build_tree_package.sh BUILD_DIR: a project whose CMAKE_PREFIX_PATH names the pipemat build
# directory (not an install prefix) stops at configure with a message that says to run
# `cmake --install BUILD_DIR --prefix <dir>` and point CMAKE_PREFIX_PATH at <dir>.
set -euo pipefail
build="$(cd "$1" && pwd)"
work="$build/build-tree-package-test"
rm -rf "$work"
mkdir -p "$work/src"
cat > "$work/src/CMakeLists.txt" <<'CMAKE'
cmake_minimum_required(VERSION 3.22)
project(uses_pipemat LANGUAGES NONE)
find_package(pipemat CONFIG REQUIRED)
CMAKE
if cmake -S "$work/src" -B "$work/out" -DCMAKE_PREFIX_PATH="$build" > "$work/configure.log" 2>&1; then
  echo "build_tree_package: FAIL: the configure against the build directory succeeded"; exit 1
fi
cat "$work/configure.log"
grep -q "Unknown CMake command" "$work/configure.log" &&
  { echo "build_tree_package: FAIL: an unknown command instead of the message"; exit 1; }
tr -s ' \n' ' ' < "$work/configure.log" > "$work/flat.log"
grep -qF "cmake --install $build --prefix <dir>" "$work/flat.log" &&
  grep -qF "CMAKE_PREFIX_PATH=<dir>" "$work/flat.log" ||
  { echo "build_tree_package: FAIL: the message does not say to install"; exit 1; }
echo "build_tree_package: ok"
