#!/usr/bin/env bash
# run.sh NAME BUILD_DIR [SECONDS]: the ctest Fuzz.NAME (Note [Fuzz targets] in
# tests/fuzz/CMakeLists.txt). Runs BUILD_DIR/tests/fuzz/fuzz_NAME over its seed corpus
# (tests/fuzz/corpus/NAME, every input once), then fuzzes for SECONDS (default 20) with a fixed
# seed from that corpus, writing new inputs to a scratch directory only. Exit 77 (skipped) when
# the fuzz build has no such binary; any finding fails with libFuzzer's report and the input
# that caused it (under the scratch directory, kept).
set -uo pipefail
name="$1"
dir="$2"
seconds="${3:-20}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bin="$dir/tests/fuzz/fuzz_$name"
corpus="$here/corpus/$name"
if [ ! -x "$bin" ]; then
  echo "fuzz: $bin is not built; run scripts/build-fuzz.sh (clang's libFuzzer) to build it"
  exit 77
fi
[ -d "$corpus" ] || { echo "fuzz: no seed corpus $corpus"; exit 1; }
# Hostile sizes must fail in the library, not in the allocator: libFuzzer reports a malloc above
# -rss_limit_mb as a finding, so nothing may ask for that much.
export ASAN_OPTIONS=detect_leaks=1:halt_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
options=(-rss_limit_mb=2048 -timeout=10 -print_final_stats=1)
[ -f "$here/$name.dict" ] && options+=(-dict="$here/$name.dict")
scratch="$(mktemp -d "${TMPDIR:-/tmp}/pipemat-fuzz-$name.XXXXXX")"
mkdir -p "$scratch/new"
# Every seed once: a seed that found something once stays in the corpus as its regression test.
seeds=("$corpus"/*)
if ! "$bin" "${options[@]}" -artifact_prefix="$scratch/" "${seeds[@]}" >"$scratch/seeds.log" 2>&1; then
  tail -n 60 "$scratch/seeds.log"
  echo "fuzz: fuzz_$name failed on its seed corpus $corpus (log and input under $scratch)"
  exit 1
fi
echo "fuzz: fuzz_$name ran its ${#seeds[@]} seeds"
if ! "$bin" "${options[@]}" -seed=1 -max_total_time="$seconds" -artifact_prefix="$scratch/" \
     "$scratch/new" "$corpus" >"$scratch/fuzz.log" 2>&1; then
  tail -n 60 "$scratch/fuzz.log"
  echo "fuzz: fuzz_$name found something in $seconds s (log and input under $scratch)"
  exit 1
fi
grep -E "^#[0-9]+.*DONE|stat::number_of_executed_units|stat::peak_rss_mb" "$scratch/fuzz.log"
echo "fuzz: fuzz_$name fuzzed $seconds s without a finding"
rm -rf "$scratch"
