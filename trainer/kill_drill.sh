#!/usr/bin/env bash
# Kill -9 drill for `train --max_restarts=3`: each trial starts 2 ranks on a
# 200-step run (checkpoints every 20), kills a random rank at a random step
# in 25..124, and expects the launcher to restart both ranks, the trainer to
# resume from the job's latest checkpoint (losing at most one interval) with
# checkpoint.resume left at its default (false: a restart resumes anyway),
# and every step's final loss to equal the uninterrupted run's digit for
# digit.
#
#   bash trainer/kill_drill.sh [TRIALS] [TRAIN] [WORKDIR]
#
# TRAIN defaults to bazel-bin/trainer/train (build it first); WORKDIR to a
# fresh temporary directory. trainer/train_e2e_test.sh runs 2 trials.
set -euo pipefail
trials=${1:-20}
train=${2:-bazel-bin/trainer/train}
work=${3:-$(mktemp -d)}
train=$(realpath "$train")
mkdir -p "$work"

fail() {
  echo "FAIL: $*" >&2
  exit 1
}

flags=(
  --set model.n_layers=2 --set model.dim=64
  --set training.steps=200 --set training.global_batch=8
  --set training.micro_batch=2 --set training.seq_len=32
  --set training.warmup_steps=2 --set checkpoint.interval=20
  --set validation.interval=0
  --set metrics.log_interval=1 --set metrics.trace_steps=0
)

source "$(dirname "$0")/drill_helpers.sh"  # losses, rank_pid

"$train" "${flags[@]}" --set "checkpoint.folder=$work/ref/ckpt" \
  --set "metrics.jsonl_path=$work/ref/metrics.jsonl" >"$work/ref.log" 2>&1 ||
  { cat "$work/ref.log"; fail "the reference run failed"; }
losses "$work/ref/metrics.jsonl" >"$work/ref.losses"

for trial in $(seq "$trials"); do
  dir="$work/trial$trial"
  "$train" "${flags[@]}" --max_restarts=3 \
    --set "checkpoint.folder=$dir/ckpt" \
    --set "metrics.jsonl_path=$dir/metrics.jsonl" >"$dir.log" 2>&1 &
  launcher=$!
  victim=$((RANDOM % 2))
  at=$((25 + RANDOM % 100))
  for _ in $(seq 1500); do
    grep -qE "step +$at/200" "$dir.log" 2>/dev/null && break
    sleep 0.02
  done
  killed=0
  p=$(rank_pid "$launcher" "$victim")
  [[ -n "$p" ]] && kill -9 "$p" && killed=1
  wait "$launcher" || { cat "$dir.log"; fail "trial $trial: the job failed"; }
  (( killed )) || fail "trial $trial: rank $victim not found at step $at"
  grep -q "restarting the local ranks (restart 1 of 3)" "$dir.log" ||
    { cat "$dir.log"; fail "trial $trial: no restart (rank $victim, step $at)"; }
  resumed=$(grep -oP 'resumed from \S+/step-\K[0-9]+' "$dir.log" | head -1)
  [[ -n "$resumed" ]] || fail "trial $trial: no resume"
  # The run records: the first attempt from step 0, the restart from the
  # checkpoint it resumed.
  starts=$(grep '"kind":"run"' "$dir/metrics.jsonl" |
    grep -oP '"start_step":\K[0-9]+' | tr '\n' ' ')
  [[ "$starts" == "0 $resumed " ]] ||
    fail "trial $trial: run records start at [$starts], not [0 $resumed]"
  # At most one checkpoint interval lost: the resume point is the interval
  # before the step the rank died at (it may have died a few steps later
  # than $at, never before).
  (( at - resumed <= 20 + 20 )) || fail "trial $trial: resumed from $resumed for a kill at $at"
  losses "$dir/metrics.jsonl" | diff "$work/ref.losses" - >/dev/null ||
    fail "trial $trial: losses differ from the uninterrupted run"
  echo "trial $trial: kill -9 rank $victim at step ~$at, resumed from step" \
    "$resumed, all 200 losses equal"
done
echo "PASS: $trials/$trials trials"
