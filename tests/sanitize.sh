#!/usr/bin/env bash
# sanitize.sh KIND BUILD_DIR: runs the unit suites that scripts/build-sanitize.sh built with
# sanitizers into BUILD_DIR. KIND is address_undefined (core, schedule, comm) or thread (comm).
# Any sanitizer report fails.
set -uo pipefail
kind="$1"
dir="$2"
case "$kind" in
  address_undefined) suites=(core/core_test schedule/schedule_test comm/comm_test weights/weights_test) ;;
  thread) suites=(comm/comm_test) ;;
  *) echo "sanitize: unknown kind '$kind'; expected address_undefined or thread"; exit 2 ;;
esac
for t in "${suites[@]}"; do
  [ -x "$dir/tests/$t" ] || { echo "sanitize: $dir/tests/$t not built; run scripts/build-sanitize.sh"; exit 1; }
done
export OMP_NUM_THREADS=1
# Hostile-size tests ask for 2^62 bytes on purpose: the allocator must fail, not abort.
export ASAN_OPTIONS=allocator_may_return_null=1:detect_leaks=1:halt_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export TSAN_OPTIONS="allocator_may_return_null=1 halt_on_error=1 second_deadlock_stack=1"
status=0
for t in "${suites[@]}"; do
  out=$("$dir/tests/$t" 2>&1)
  rc=$?
  echo "$out" | tail -1
  if [ $rc -ne 0 ] || grep -q "runtime error\|ERROR: AddressSanitizer\|ERROR: LeakSanitizer\|WARNING: ThreadSanitizer" <<<"$out"; then
    echo "sanitize: $t failed (exit $rc)"; grep -m20 -A30 "runtime error\|ERROR: \|WARNING: ThreadSanitizer\|FAILED" <<<"$out"
    status=1
  fi
done
exit $status
