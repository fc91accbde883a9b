#!/usr/bin/env bash
# cross_host.sh MODE PIPEMAT CONFIG [--set k=v ...]: a 4-rank tcp job (2 replicas x 2 pipeline
# ranks) over two hosts with a network between them, on this machine: each host is a network
# namespace, joined by a third one that routes between them and relays every connection from
# one host to the other through tests/e2e/fault_proxy.py (iptables REDIRECT).
#
#   host h0 (10.201.0.2): ranks 0, 1   <- veth -> sw (relay) <- veth ->   host h1 (10.201.1.2): ranks 2, 3
#
# Rank w is pipeline rank w / 2 of replica w % 2, so the pipeline's messages cross the link and
# each data group stays on its host, as a cluster launcher places them.
# MODE
#   delay  the relay holds every chunk 5 ms; the job's losses equal `--reference` bitwise, and
#          the relay carried exactly the 4 cross-host connections (2->0, 3->0, 2->1, 3->1).
#   stall  once the job trains, the relay stops relaying (connections stay open): every rank
#          ends non-zero within the transport timeout + 20 s, and a rank of h0 says that nothing
#          arrived from a rank of h1, not even a heartbeat (Note [Liveness of a peer]).
#   cut    the same with every relayed connection reset: "the connection to rank 2 failed".
# Exit 77 (a ctest skip) with the reason when this machine refuses namespaces, veth or iptables.
set -uo pipefail
mode="$1" pipemat="$2" config="$3"
shift 3
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
skip() { echo "SKIP: $*"; exit 77; }
fail() {
  echo "FAIL: $*"
  for f in "$work"/*.log; do echo "---- ${f##*/} ----"; tail -n 15 "$f"; done
  exit 1
}
[ "$(id -u)" -eq 0 ] || skip "network namespaces need root"
for tool in ip iptables python3; do
  command -v "$tool" >/dev/null || skip "$tool is not installed (scripts/install-deps.sh installs it)"
done

work=$(mktemp -d)
tag="pm$$"
h0="$tag-h0" h1="$tag-h1" sw="$tag-sw"
cleanup() {
  for ns in "$h0" "$h1" "$sw"; do
    for p in $(ip netns pids "$ns" 2>/dev/null); do kill -CONT "$p"; kill -KILL "$p"; done 2>/dev/null
  done
  wait 2>/dev/null  # reaps them without the shell's "Killed" notices
  for ns in "$h0" "$h1" "$sw"; do ip netns del "$ns" 2>/dev/null; done
  rm -rf "$work"
}
trap cleanup EXIT
# Every step of the network's setup: a refusal is the machine's, not pipemat's.
net() { "$@" 2>"$work/net.err" || skip "this machine refuses '$*': $(cat "$work/net.err")"; }
net ip netns add "$sw"
net ip netns add "$h0"
net ip netns add "$h1"
for i in 0 1; do
  host="$tag-h$i"
  net ip -n "$sw" link add "s$i" type veth peer name eth0 netns "$host"
  net ip -n "$sw" addr add "10.201.$i.1/24" dev "s$i"
  net ip -n "$host" addr add "10.201.$i.2/24" dev eth0
  for ns in "$sw" "$host"; do net ip -n "$ns" link set lo up; done
  net ip -n "$sw" link set "s$i" up
  net ip -n "$host" link set eth0 up
  net ip -n "$host" route add default via "10.201.$i.1"
done
proxy_port=7000
net ip netns exec "$sw" iptables -t nat -A PREROUTING -p tcp -j REDIRECT --to-ports "$proxy_port"

delay=0
[ "$mode" = delay ] && delay=5
ip netns exec "$sw" python3 "$here/fault_proxy.py" "$proxy_port" --delay-ms "$delay" \
  >"$work/proxy.log" 2>&1 &
proxy=$!
for _ in $(seq 1 100); do grep -q relaying "$work/proxy.log" && break; sleep 0.1; done
grep -q relaying "$work/proxy.log" || fail "the relay did not start"

secret=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
timeout_s=8
pids=()
for r in 0 1 2 3; do
  host="$h0"
  [ "$r" -ge 2 ] && host="$h1"
  ip netns exec "$host" env PIPEMAT_TRANSPORT=tcp PIPEMAT_RANK="$r" PIPEMAT_WORLD_SIZE=4 \
    PIPEMAT_MASTER=10.201.0.2:29500 PIPEMAT_JOB_SECRET="$secret" OMP_NUM_THREADS=1 \
    "$pipemat" train --config "$config" --set transport.kind=tcp \
    --set transport.timeout="$timeout_s" --metrics "$work/pipe.jsonl" "$@" \
    >"$work/rank$r.log" 2>&1 &
  pids+=($!)
done

if [ "$mode" = delay ]; then
  for r in 0 1 2 3; do
    wait "${pids[$r]}" || fail "rank $r exited with code $? over the delayed link"
  done
  kill -TERM "$proxy"
  wait "$proxy"
  relayed=$(grep -o 'relayed [0-9]* connections, [0-9]* bytes' "$work/proxy.log")
  echo "relay: $relayed"
  [ "$(awk '{print $2}' <<<"$relayed")" = 4 ] || fail "expected the 4 cross-host connections"
  "$pipemat" train --config "$config" "$@" --set output.progress=false --reference \
    --metrics "$work/ref.jsonl" >"$work/reference.log" 2>&1 || fail "--reference failed"
  losses() { grep -o '"step":[0-9]*,"loss":[-0-9.e]*' "$1"; }
  [ "$(losses "$work/pipe.jsonl" | wc -l)" -gt 0 ] || fail "no losses"
  diff <(losses "$work/pipe.jsonl") <(losses "$work/ref.jsonl") ||
    fail "--reference differs from the job across hosts"
  echo "ok: $(losses "$work/ref.jsonl" | wc -l) losses across a ${delay} ms link equal --reference"
  exit 0
fi

# stall | cut: wait until the job reports step 2 (replica 0's last stage does).
trains() { cat "$work"/rank*.log | grep -q "step 2/"; }
for _ in $(seq 1 600); do
  trains && break
  for r in 0 1 2 3; do kill -0 "${pids[$r]}" 2>/dev/null || fail "rank $r ended before the $mode"; done
  sleep 0.1
done
trains || fail "the job did not reach step 2 in 60 s"
signal=USR1
[ "$mode" = cut ] && signal=USR2
start=$(date +%s%N)
kill "-$signal" "$proxy"
bound=$(( timeout_s + 20 ))
for _ in $(seq 1 $(( bound * 10 ))); do
  running=0
  for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && running=1; done
  [ "$running" -eq 0 ] && break
  sleep 0.1
done
ms=$(( ($(date +%s%N) - start) / 1000000 ))
[ "$running" -eq 0 ] || fail "ranks still run $bound s after the $mode"
for r in 0 1 2 3; do
  wait "${pids[$r]}"
  code=$?
  [ "$code" -ne 0 ] || fail "rank $r exited 0 after the $mode"
  echo "rank $r: exit code $code; $(grep -m1 -E 'Error|error' "$work/rank$r.log" | cut -c1-220)"
done
echo "the $mode ended every rank after $((ms / 1000)).$(printf '%03d' $((ms % 1000))) s (bound $bound s)"
# The host h0 names what it lost: a rank of h1 (2 or 3), the other side of the link.
named='Nothing arrived from rank [23] for the last [0-9.]+ s, not even its heartbeat: it is stalled or unreachable'
[ "$mode" = cut ] && named='the connection to rank [23] failed'
grep -Eq "$named" "$work/rank0.log" "$work/rank1.log" || fail "h0's ranks do not say '$named'"
exit 0
