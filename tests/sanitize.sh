#!/usr/bin/env bash
# sanitize.sh BUILD_DIR: runs the core, schedule and comm unit suites built with
# -fsanitize=address,undefined (scripts/build-sanitize.sh). Any sanitizer report fails.
set -uo pipefail
dir="$1"
for t in core/core_test schedule/schedule_test comm/comm_test; do
  [ -x "$dir/tests/$t" ] || { echo "sanitize: $dir/tests/$t not built; run scripts/build-sanitize.sh"; exit 1; }
done
export OMP_NUM_THREADS=1
# Hostile-size tests ask for 2^62 bytes on purpose: the allocator must fail, not abort.
export ASAN_OPTIONS=allocator_may_return_null=1:detect_leaks=1:halt_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
status=0
for t in core/core_test schedule/schedule_test comm/comm_test; do
  out=$("$dir/tests/$t" 2>&1)
  rc=$?
  echo "$out" | tail -1
  if [ $rc -ne 0 ] || grep -q "runtime error\|ERROR: AddressSanitizer\|ERROR: LeakSanitizer" <<<"$out"; then
    echo "sanitize: $t failed (exit $rc)"; grep -m20 -A10 "runtime error\|ERROR: \|FAILED" <<<"$out"
    status=1
  fi
done
exit $status
