#!/usr/bin/env bash
# Slurm in the suite (issue 48): a one-node Slurm cluster of this test's own (slurmctld and
# slurmd as its processes, AuthType=auth/none, private ports, all state in a scratch
# directory; slurm.conf.in beside this file) runs tessera-train three ways, each on 2
# tasks, each ending with an export equal to the others':
#   1. srun, uninterrupted (the reference);
#   2. an `sbatch --requeue` job that `scontrol requeue` stops after its first checkpoint:
#      Slurm starts it again and it resumes from that checkpoint;
#   3. an sbatch job whose time limit sends its warning signal (`--signal=TERM@30`): the
#      ranks agree to stop, save a checkpoint and exit; the job script requeues the job
#      (the run is not finished: no export yet) and it resumes.
# Needs Debian's slurm-wlm and root (a cluster without munge runs as root only); exits 77
# (ctest: skipped) with the reason otherwise.
#
#   tests/apps/slurm_test.sh BUILD_DIR SOURCE_DIR SCRATCH_DIR [PYTHON_WITH_TORCH]
set -uo pipefail
BUILD=$(cd "$1" && pwd)
SRC=$(cd "$2" && pwd)
SCRATCH=$3
PYTHON=${4:-/usr/bin/python3}
BIN=$BUILD/bin

skip() { echo "SKIPPED: $*"; exit 77; }
command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null ||
  skip "slurm-wlm is not installed (apt-get install slurm-wlm; test.sh installs it)"
[ "$(id -u)" = 0 ] || skip "a one-node Slurm without munge runs as root only"

rm -rf "$SCRATCH" && mkdir -p "$SCRATCH"/{state,spool,log,runs}
D=$(cd "$SCRATCH" && pwd)
# Two free ports, and a cluster name of this test's own: another cluster on the machine
# (a second test, a user's) is left alone.
read -r PORT PORT1 < <("$PYTHON" -c '
import socket
s = [socket.socket() for _ in range(2)]
for x in s: x.bind(("127.0.0.1", 0))
print(*(x.getsockname()[1] for x in s))')
HOST=$(hostname -s)
sed -e "s#@DIR@#$D#g" -e "s#@HOST@#$HOST#g" -e "s#@PORT@#$PORT#g" -e "s#@PORT1@#$PORT1#g" \
  "$SRC/tests/apps/slurm.conf.in" > "$D/slurm.conf"
export SLURM_CONF=$D/slurm.conf

fail() {
  echo "FAILED: $*"
  for f in "$D"/log/*.log "$D"/runs/*.out; do [ -f "$f" ] && { echo "--- $f"; tail -20 "$f"; }; done
  exit 1
}
stop_cluster() {
  for pid in "$D/ctld.pid" "$D/d.pid"; do [ -f "$pid" ] && kill "$(cat "$pid")" 2>/dev/null; done
  sleep 1
}
trap stop_cluster EXIT

slurmctld -f "$SLURM_CONF" || fail "slurmctld did not start"
slurmd -f "$SLURM_CONF" || fail "slurmd did not start"
for _ in $(seq 1 60); do sinfo -h -o %T 2>/dev/null | grep -q idle && break; sleep 1; done
sinfo -h -o %T | grep -q idle || fail "the node never became idle"
echo "slurm: cluster up on ports $PORT/$PORT1"

# Each run must train for longer than the time limit's warning needs (Slurm sends it up to
# 60 s before the limit, so within 30 s of a 1-minute job's start), whatever this machine's
# speed: 1000 steps are timed first (start-up included) and the runs take as many steps as
# 120 s of that pace gives, 3000 to 60000. A fixed 3000 steps were over in 12 s on a fast
# machine, before the signal came; a pace taken while other tests shared the cores and a
# 50 s target gave runs of 17 s once they had the cores to themselves.
BASE=("$BIN/tessera-train" --config "$SRC/configs/default.yaml" --set run.log_every=500 --set run.eval_every=0)
start=$(date +%s.%N)
srun -n 2 -O "${BASE[@]}" --set run.steps=1000 --set checkpoint.every_steps=0 --set run.dir="$D/runs/pace" \
  > "$D/runs/pace.out" 2>&1 || fail "srun tessera-train (timing 1000 steps) failed"
STEPS=$(awk -v s="$(date +%s.%N)" -v t="$start" 'BEGIN { n = int(1000 * 120 / (s - t));
  print (n < 3000 ? 3000 : (n > 60000 ? 60000 : n)) }')
TRAIN=("${BASE[@]}" --set run.steps=$STEPS --set checkpoint.every_steps=500)
EXPORT=export/model_ema.safetensors

job_state() { scontrol show job "$1" 2>/dev/null | grep -o 'JobState=[A-Z_]*' | cut -d= -f2; }
restarts() { scontrol show job "$1" 2>/dev/null | grep -o 'Restarts=[0-9]*' | cut -d= -f2; }
# Waits for job $1 to complete (at most $2 s). A requeued job waits ~120 s for its begin
# time; this releases it after 3 s ($3: a time limit to give it then, or empty). Not at
# once: slurmd refuses a job started within the second its previous run's credential was
# revoked ("Job credential revoked").
wait_done() {
  local job=$1 limit=$2 newLimit=${3:-} state held=0
  for _ in $(seq 1 "$limit"); do
    state=$(job_state "$job")
    case "$state" in
      COMPLETED) return 0 ;;
      FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY|BOOT_FAIL|DEADLINE) fail "job $job ended $state" ;;
      PENDING)
        if scontrol show job "$job" | grep -q 'Reason=BeginTime'; then
          held=$((held + 1))
          if [ "$held" -ge 3 ]; then
            scontrol update JobId="$job" StartTime=now ${newLimit:+TimeLimit=$newLimit} || fail "could not release job $job"
            held=0
          fi
        fi ;;
    esac
    sleep 1
  done
  fail "job $job did not complete within $limit s (state $(job_state "$job"))"
}

# 1. srun, uninterrupted.
srun -n 2 -O "${TRAIN[@]}" --set run.dir="$D/runs/srun" > "$D/runs/srun.out" 2>&1 || fail "srun tessera-train failed"
[ -f "$D/runs/srun/$EXPORT" ] || fail "srun: no export"
echo "slurm: srun -n 2 trained $STEPS steps"

# 2. sbatch --requeue, requeued by scontrol after the first checkpoint.
cat > "$D/runs/requeue.sh" <<EOF
#!/bin/bash
srun ${TRAIN[*]} --set run.dir=$D/runs/requeue
EOF
J=$(sbatch --parsable -n 2 -O --requeue -o "$D/runs/requeue.out" --open-mode=append "$D/runs/requeue.sh") ||
  fail "sbatch failed"
for _ in $(seq 1 600); do
  ls "$D/runs/requeue/checkpoints" 2>/dev/null | grep -q '^step_' && break
  [ "$(job_state "$J")" = COMPLETED ] && fail "job $J finished before its first checkpoint was seen"
  sleep 0.1
done
scontrol requeue "$J" || fail "scontrol requeue $J failed"
wait_done "$J" 300
[ "$(restarts "$J")" -ge 1 ] || fail "job $J was not restarted"
grep -q "resum" "$D/runs/requeue.out" || fail "the requeued job did not resume (no 'resum' in its log)"
echo "slurm: sbatch --requeue + scontrol requeue: restarted $(restarts "$J") time(s), resumed"

# 3. The time limit's warning signal: checkpoint, exit, requeue by the job script, resume.
# Slurm checks limits about every 30 s, so the signal lands anywhere in the job's first
# 30 s; one that lands in tessera-train's start-up, before it handles signals, ends the
# process (the job requeues and starts afresh: also correct), so up to three jobs are tried
# until one is stopped with a checkpoint.
stopped=""
for attempt in 1 2 3; do
  run=signal$attempt
  cat > "$D/runs/$run.sh" <<EOF
#!/bin/bash
srun ${TRAIN[*]} --set run.dir=$D/runs/$run
# Stopped by the signal before the end (no export yet): run again from the checkpoint.
[ -f $D/runs/$run/$EXPORT ] || scontrol requeue \$SLURM_JOB_ID
EOF
  J=$(sbatch --parsable -n 2 -O --requeue --time=1 --signal=TERM@30 -o "$D/runs/$run.out" --open-mode=append \
    "$D/runs/$run.sh") || fail "sbatch failed"
  # Released with a longer limit: the resumed run goes to its end.
  wait_done "$J" 300 10
  [ "$(restarts "$J")" -ge 1 ] || fail "job $J was not requeued after its warning signal"
  if grep -q "stopped early" "$D/runs/$run.out"; then
    stopped=$run
    break
  fi
  echo "slurm: attempt $attempt: the signal came during start-up (the job started afresh); again"
done
[ -n "$stopped" ] || fail "no signalled run stopped with a checkpoint in 3 attempts"
echo "slurm: --signal=TERM@30: stopped with a checkpoint, requeued $(restarts "$J") time(s), resumed"

# Each run ends with the uninterrupted run's parameters, bitwise.
for run in requeue "$stopped"; do
  "$PYTHON" "$SRC/scripts/compare_exports.py" --max-abs 0 "$D/runs/srun/$EXPORT" "$D/runs/$run/$EXPORT" ||
    fail "$run: export differs from the uninterrupted run's"
done
echo "slurm: all three exports equal"
