#!/usr/bin/env bash
# expect_failure.sh REGEX SECONDS CMD ARGS...: passes when CMD exits non-zero within SECONDS and
# its output (stdout + stderr) matches REGEX. A hang, a crash-free success or a wrong message fail.
# With EXPECT_ERROR_LINES=N in the environment, the output must hold exactly N lines that start
# with "pipemat: error:" (one line per failure, however many ranks share it); with
# EXPECT_EXIT=N, the exit code must be N.
set -u
regex="$1" limit="$2"
shift 2
out=$(timeout "$limit" "$@" 2>&1)
status=$?
if [ "$status" -eq 124 ]; then echo "FAIL: no exit within ${limit}s (hang): $*"; echo "$out" | tail -5; exit 1; fi
if [ "$status" -eq 0 ]; then echo "FAIL: exit code 0, expected an error: $*"; echo "$out" | tail -5; exit 1; fi
if [ "$status" -ge 128 ]; then echo "FAIL: killed by signal $((status - 128)) (crash): $*"; echo "$out" | tail -5; exit 1; fi
if [ -n "${EXPECT_EXIT:-}" ] && [ "$status" -ne "$EXPECT_EXIT" ]; then
  echo "FAIL: exit code $status, expected $EXPECT_EXIT: $*"; echo "$out" | tail -5; exit 1
fi
if ! grep -E -q -- "$regex" <<<"$out"; then echo "FAIL: output does not match /$regex/: $*"; echo "$out" | tail -5; exit 1; fi
if [ -n "${EXPECT_ERROR_LINES:-}" ]; then
  lines=$(grep -c "^pipemat: error:" <<<"$out")
  if [ "$lines" -ne "$EXPECT_ERROR_LINES" ]; then
    echo "FAIL: $lines 'pipemat: error:' lines, expected $EXPECT_ERROR_LINES: $*"; echo "$out" | grep "error"; exit 1
  fi
fi
echo "ok: exit $status with the expected message"
