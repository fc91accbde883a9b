#!/usr/bin/env bash
# package.sh BUILD_DIR SOURCE_DIR MPIEXEC [MPIEXEC_FLAGS...]: installs the build into
# BUILD_DIR/package-test/prefix, builds examples/pipeline_library against it as a project of its
# own (find_package(pipemat CONFIG REQUIRED), nothing from the build or source tree), runs it on
# 2 ranks, and checks that its result line equals the in-tree example's (and that it builds Release
# when no build type is given); then trains the default config with the installed pipemat-run over
# tcp.
set -euo pipefail
build="$1" src="$2" mpiexec="$3"
shift 3
flags=("$@")
work="$build/package-test"
mkdir -p "$work"
rm -rf "$work/prefix"
echo "package: cmake --install $build --prefix $work/prefix"
cmake --install "$build" --prefix "$work/prefix" > "$work/install.log"
for f in lib/cmake/pipemat/pipematConfig.cmake lib/cmake/pipemat/pipematTargets.cmake \
         include/pipemat/pp/pipeline.h lib/libpipemat_pp.a bin/pipemat bin/pipemat-run; do
  [ -e "$work/prefix/$f" ] || { echo "package: FAIL: $f is not installed"; exit 1; }
done
options=(-DCMAKE_PREFIX_PATH="$work/prefix" -DCMAKE_BUILD_TYPE=RelWithDebInfo)
command -v ninja >/dev/null && options+=(-G Ninja)
command -v ccache >/dev/null && options+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
rm -rf "$work/example"
echo "package: configuring and building examples/pipeline_library against the installed package"
cmake -S "$src/examples/pipeline_library" -B "$work/example" "${options[@]}" > "$work/configure.log"
cmake --build "$work/example" > "$work/build.log" || { tail -30 "$work/build.log"; exit 1; }
if grep -q -- "$src/[a-z_]*/include" "$work/example/build.ninja" 2>/dev/null; then
  echo "package: FAIL: the example build reads headers from the source tree"; exit 1
fi
# Without a build type the example builds Release (CMake's default would compile it at -O0).
rm -rf "$work/example-default"
cmake -S "$src/examples/pipeline_library" -B "$work/example-default" \
      -DCMAKE_PREFIX_PATH="$work/prefix" > "$work/configure-default.log"
grep -q '^CMAKE_BUILD_TYPE:STRING=Release$' "$work/example-default/CMakeCache.txt" ||
  { echo "package: FAIL: the example without CMAKE_BUILD_TYPE does not build Release"; exit 1; }
result() {
  OMP_NUM_THREADS=1 "$mpiexec" "${flags[@]}" -np 2 "$1" 2>&1 | grep "the training loss fell" || true
}
installed=$(result "$work/example/pipeline_example")
in_tree=$(result "$build/examples/pipeline_library/pipeline_example")
echo "installed: $installed"
echo "in tree:   $in_tree"
[ -n "$installed" ] && [ "$installed" = "$in_tree" ] || { echo "package: FAIL: the results differ"; exit 1; }
out=$(OMP_NUM_THREADS=1 "$work/prefix/bin/pipemat-run" -n 2 --tcp "$src/configs/zoo.yaml" -- \
      --set training.steps=2 2>&1) || { echo "$out" | tail -5; echo "package: FAIL: installed pipemat-run"; exit 1; }
grep -q "step 2/2  loss" <<<"$out" || { echo "$out" | tail -5; echo "package: FAIL: no step 2/2"; exit 1; }
echo "package: ok"
