# Sourced by the e2e scripts that signal a job and time its end (fault_rank.sh, interrupt.sh,
# second_signal.sh).
# wait_for_end JOB START_NS LIMIT_S: polls until JOB, a background job of this shell, has ended,
# at most LIMIT_S seconds; then sets rc (its exit code), ms and elapsed ("S.mmm") since START_NS
# (date +%s%N). Returns 1 when it still runs.
wait_for_end() {
  local job="$1" start="$2" limit="$3"
  for _ in $(seq 1 $((limit * 10))); do
    kill -0 "$job" 2>/dev/null || break
    sleep 0.1
  done
  kill -0 "$job" 2>/dev/null && return 1
  wait "$job"
  rc=$?
  ms=$((($(date +%s%N) - start) / 1000000))
  elapsed="$((ms / 1000)).$(printf '%03d' $((ms % 1000)))"
}

# wait_for_line JOB FILE REGEX: polls until FILE (JOB's output) has a line matching REGEX, at most
# 60 s; calls `fail` (the script's) when JOB ends first or the line never comes.
wait_for_line() {
  local job="$1" file="$2" regex="$3"
  for _ in $(seq 1 600); do
    grep -q "$regex" "$file" && return 0
    kill -0 "$job" 2>/dev/null || fail "the command ended before the signal"
    sleep 0.1
  done
  fail "no \"$regex\" line after 60 s"
}
