# Sourced by the e2e scripts that signal a job and time its end (fault_rank.sh, interrupt.sh,
# second_signal.sh).
# wait_for_end JOB START_NS LIMIT_S: waits until JOB, a background job of this shell, has ended,
# at most LIMIT_S seconds; then sets rc (its exit code), ms and elapsed ("S.mmm") since START_NS
# (date +%s%N). Returns 1 when it still runs. It returns the moment JOB ends (a blocking wait,
# not a poll), so what the caller checks next is the state of the machine as JOB left it.
wait_for_end() {
  local job="$1" start="$2" limit="$3" timer finished="" code=0
  sleep "$limit" &
  timer=$!
  wait -n -p finished "$job" "$timer" || code=$?
  if [ "$finished" != "$job" ]; then
    kill "$timer" 2>/dev/null
    wait "$timer" 2>/dev/null
    return 1
  fi
  rc=$code
  ms=$((($(date +%s%N) - start) / 1000000))
  elapsed="$((ms / 1000)).$(printf '%03d' $((ms % 1000)))"
  kill "$timer" 2>/dev/null
  wait "$timer" 2>/dev/null
  return 0
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

# record_job ROOT: sets job_procs to ROOT and every process below it (mpirun, the ranks, what
# they started; whatever session they run in), each as "pid:start time" (field 22 of
# /proc/PID/stat), so that a pid the kernel gives to another process later is not taken for it.
record_job() {
  local pid ppid
  local -A parent=()
  while read -r pid ppid; do parent[$pid]=$ppid; done < <(ps -e -o pid=,ppid=)
  job_procs=()
  for pid in "${!parent[@]}"; do
    local up=$pid
    while [ -n "$up" ] && [ "$up" != "$1" ] && [ "$up" -gt 1 ]; do up=${parent[$up]:-}; done
    [ "$up" = "$1" ] || continue
    local stat
    read -r stat 2>/dev/null <"/proc/$pid/stat" || continue
    local -a f
    read -r -a f <<<"${stat##*) }"
    job_procs+=("$pid:${f[19]}")
  done
}

# still_running PID:START...: prints each of those processes that still runs, one a line
# ("PID STATE COMMAND"). An exited process that its parent has not reaped yet (state Z) runs no
# more; a pid with another start time is another process. Only shell builtins: it reads the
# machine as it is at the moment it is called.
still_running() {
  local entry pid stat comm
  local -a f
  for entry in "$@"; do
    pid=${entry%%:*}
    read -r stat 2>/dev/null <"/proc/$pid/stat" || continue
    read -r -a f <<<"${stat##*) }"
    [ "${f[19]}" = "${entry#*:}" ] || continue
    [[ "${f[0]}" == Z* || "${f[0]}" == X* ]] && continue
    comm=${stat#*(}
    echo "$pid ${f[0]} ${comm%%)*}"
  done
}

# kill_recorded PID:START...: SIGCONT and SIGKILL to those of them that still run (a test's
# cleanup, also of a stopped rank).
kill_recorded() {
  local pid
  for pid in $(still_running "$@" | cut -d' ' -f1); do
    kill -CONT "$pid" 2>/dev/null
    kill -KILL "$pid" 2>/dev/null
  done
}
