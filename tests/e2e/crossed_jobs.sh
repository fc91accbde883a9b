#!/usr/bin/env bash
# crossed_jobs.sh PIPEMAT CONFIG: two jobs started by hand on one tcp master port, without a job
# secret: rank 0 of job A (training.seed=0) and rank 1 of job B (training.seed=1). Job B's rank
# is refused at the rendezvous, naming both job digests (Note [Rendezvous handshake]), and
# exits; job A's rank 0 reports the refused connection and times out waiting for its own rank
# 1. Nothing trains: the two never cross.
set -u
pipemat="$1" config="$2"
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$work"' EXIT
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
export OMP_NUM_THREADS=1 PIPEMAT_WORLD_SIZE=2 PIPEMAT_MASTER="127.0.0.1:$port"
unset PIPEMAT_JOB_SECRET
common=(train --config "$config" --set transport.kind=tcp --set training.steps=300
        --set transport.timeout=6 --set 'checkpoint.dir=""' --set 'output.metrics=""')
PIPEMAT_RANK=0 timeout 60 "$pipemat" "${common[@]}" --set training.seed=0 >"$work/a0" 2>&1 &
a0=$!
PIPEMAT_RANK=1 timeout 60 "$pipemat" "${common[@]}" --set training.seed=1 >"$work/b1" 2>&1
b1=$?
wait "$a0"
a0=$?
fail() { echo "--- job A rank 0:"; tail -5 "$work/a0"; echo "--- job B rank 1:"; tail -5 "$work/b1"; echo "FAIL: $*"; exit 1; }
[ "$b1" -ne 0 ] && [ "$b1" -ne 124 ] || fail "job B's rank 1 exited $b1"
[ "$a0" -ne 0 ] && [ "$a0" -ne 124 ] || fail "job A's rank 0 exited $a0"
grep -Eq "refused rank 1: it belongs to another job \(job digest [0-9a-f]{12}, this rank's [0-9a-f]{12}\)" "$work/b1" ||
  fail "job B's rank 1 does not say it belongs to another job"
grep -Eq "dropped a connection from 127.0.0.1:[0-9]+ during rendezvous: it belongs to another job" "$work/a0" ||
  fail "job A's rank 0 does not report the refused connection"
if grep -q "^step " "$work/a0" "$work/b1"; then fail "a step was trained"; fi
echo "ok: job B's rank was refused at the rendezvous (exit $b1), job A's rank 0 exited $a0; nothing trained"
