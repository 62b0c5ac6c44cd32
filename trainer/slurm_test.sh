#!/usr/bin/env bash
# The trainer under a real workload manager: a single-node Slurm cluster
# (Debian slurm-wlm: slurmctld + slurmd on this machine, configuration, state
# and ports of its own, written here) runs `srun -n 2 train ...` with no
# MASTER_ADDR / MASTER_PORT / RANK in the environment, so each task finds
# its rank, the world, its node's share and the store from the Slurm
# variables alone (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
# SLURM_TASKS_PER_NODE, SLURM_LAUNCH_NODE_IPADDR, the port from
# SLURM_JOB_ID / SLURM_STEP_ID). Checks:
#  * both tasks say they joined through the Slurm environment;
#  * every step's loss equals (to the last digit) the same 2-rank run
#    started by the trainer's own launcher;
#  * a second step of the same allocation (`salloc` + two `srun`s) gets its
#    own store port and trains too;
#  * a task that fails (a bad config value on every rank) ends the step with
#    an error, not a hang.
# Needs root and slurm-wlm (tools/setup.sh installs it); skips, saying so,
# where the daemons cannot start.
set -euo pipefail
train=$PWD/trainer/train
source "$PWD/trainer/drill_helpers.sh" # losses
work="${TEST_TMPDIR:-$(mktemp -d)}/slurm"
rm -rf "$work"
mkdir -p "$work"
# slurmd's step sockets live in its spool folder, and a Unix socket path has
# at most 108 bytes: the daemons' folders are short ones of their own.
spool=$(mktemp -d /tmp/fsdpp_slurm.XXXXXX)
mkdir -p "$spool/state" "$spool/spool"

fail() {
  echo "FAIL: $*" >&2
  for f in "$work"/*.log; do
    [[ -f $f ]] && { echo "--- $f"; tail -n 30 "$f"; } >&2
  done
  exit 1
}

for tool in slurmctld slurmd srun salloc sinfo scancel; do
  if ! command -v "$tool" >/dev/null; then
    echo "SKIP: $tool not found (Debian slurm-wlm; tools/setup.sh installs it)"
    exit 0
  fi
done
if [[ $(id -u) != 0 ]]; then
  echo "SKIP: the Slurm daemons of this test run as root"
  exit 0
fi

host=$(hostname)
# Ports of this test's own: two from the pid, away from a system Slurm's
# 6817/6818.
port=$((20000 + ($$ % 5000) * 2))
cat >"$work/slurm.conf" <<EOF
ClusterName=fsdpp$$
SlurmctldHost=$host
SlurmctldPort=$port
SlurmdPort=$((port + 1))
AuthType=auth/none
CredType=cred/none
MpiDefault=none
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$spool/state
SlurmdSpoolDir=$spool/spool
SlurmctldPidFile=$work/slurmctld.pid
SlurmdPidFile=$work/slurmd.pid
SlurmctldLogFile=$work/slurmctld.log
SlurmdLogFile=$work/slurmd.log
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
KillWait=5
NodeName=$host CPUs=$(nproc) State=UNKNOWN
PartitionName=fsdpp Nodes=$host Default=YES MaxTime=10 State=UP OverSubscribe=YES
EOF
export SLURM_CONF=$work/slurm.conf

daemons=()
cleanup() {
  scancel --quiet --user=root 2>/dev/null || true
  for p in "${daemons[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${daemons[@]}"; do
    for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$p" 2>/dev/null || true
  done
  rm -rf "$spool"
}
trap cleanup EXIT
# -D: in the foreground (of their own background job), so the test owns them.
slurmctld -D -i -f "$SLURM_CONF" >"$work/slurmctld.out" 2>&1 &
daemons+=($!)
slurmd -D -f "$SLURM_CONF" >"$work/slurmd.out" 2>&1 &
daemons+=($!)
state=""
for _ in $(seq 60); do
  state=$(sinfo -h -N -o %T 2>/dev/null || true)
  [[ $state == idle* ]] && break
  sleep 0.5
done
if [[ $state != idle* ]]; then
  echo "SKIP: the single-node Slurm did not come up in 30 s (node state" \
    "'$state'); logs:"
  tail -n 5 "$work"/slurmctld.log "$work"/slurmd.log "$work"/*.out 2>/dev/null
  exit 0
fi
echo "slurm: $(sinfo --version), node $host idle"

common=(
  --set training.steps=6 --set training.global_batch=4
  --set training.micro_batch=2 --set training.seq_len=32
  --set training.warmup_steps=1 --set checkpoint.interval=0
  --set checkpoint.resume=false --set validation.interval=0
  --set metrics.log_interval=1 --set comm.timeout_s=30
)
# Nothing of another launcher's may leak in: Slurm's variables alone.
clean_env=(env -u MASTER_ADDR -u MASTER_PORT -u RANK -u WORLD_SIZE
  -u LOCAL_RANK -u LOCAL_WORLD_SIZE)

# The reference: 2 ranks by the trainer's own launcher.
"$train" --nproc_per_node=2 "${common[@]}" \
  --set metrics.jsonl_path="$work/ref.jsonl" \
  --set checkpoint.folder="$work/ref_ckpt" >"$work/ref.log" 2>&1 ||
  fail "the launcher's 2-rank run exited $?"
losses "$work/ref.jsonl" >"$work/ref.losses"

# srun -n 2: two tasks of one step; --kill-on-bad-exit ends the step when a
# task fails.
run_srun() { # run_srun NAME [SRUN FLAGS...] -- [TRAIN FLAGS...]
  local name=$1
  shift
  local srun_flags=()
  while [[ $1 != -- ]]; do srun_flags+=("$1"); shift; done
  shift
  timeout 300 "${clean_env[@]}" srun -n 2 --kill-on-bad-exit=1 \
    --time=5 "${srun_flags[@]}" "$train" "${common[@]}" \
    --set metrics.jsonl_path="$work/$name.jsonl" \
    --set checkpoint.folder="$work/${name}_ckpt" "$@" >"$work/$name.log" 2>&1
}

run_srun srun -- || fail "srun -n 2 exited $?"
[[ $(grep -c "rendezvous from slurm" "$work/srun.log") == 2 ]] ||
  fail "the tasks did not both join through the Slurm environment"
losses "$work/srun.jsonl" >"$work/srun.losses"
cmp -s "$work/ref.losses" "$work/srun.losses" || {
  diff "$work/ref.losses" "$work/srun.losses" >&2 || true
  fail "srun's losses differ from the launcher's"
}
echo "srun -n 2: $(wc -l <"$work/srun.losses") steps, losses equal the" \
  "launcher's to the last digit (last: $(tail -n 1 "$work/srun.losses"))"

# Two steps of one allocation: each gets its own port from SLURM_STEP_ID.
timeout 300 "${clean_env[@]}" salloc -n 2 --time=5 bash -c '
  set -e
  for s in 0 1; do
    srun -n 2 --kill-on-bad-exit=1 "$0" "${@:1}" \
      --set metrics.jsonl_path="'"$work"'/step$s.jsonl" \
      --set checkpoint.folder="'"$work"'/step${s}_ckpt"
  done' "$train" "${common[@]}" >"$work/salloc.log" 2>&1 ||
  fail "salloc with two srun steps exited $?"
for s in 0 1; do
  losses "$work/step$s.jsonl" >"$work/step$s.losses"
  cmp -s "$work/ref.losses" "$work/step$s.losses" ||
    fail "step $s of the allocation: losses differ from the launcher's"
done
ports=$(grep -o "rendezvous from slurm [^ ]*" "$work/salloc.log" | sort -u |
  wc -l)
[[ $ports == 2 ]] || fail "the two steps did not use two store addresses" \
  "($(grep -o "rendezvous from slurm [^ ]*" "$work/salloc.log" | sort -u))"
echo "salloc + 2 srun steps: both trained, on two store ports"

# A failing task ends the step, with the error, promptly.
start=$SECONDS
if run_srun bad -- --set training.micro_batch=0; then
  fail "a bad config ran under srun"
fi
grep -q "micro_batch" "$work/bad.log" || fail "the error does not say what was wrong"
echo "a bad config under srun: the step failed in $((SECONDS - start)) s," \
  "saying: $(grep -m1 "micro_batch" "$work/bad.log")"
echo "PASS"
