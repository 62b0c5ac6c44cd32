#!/usr/bin/env bash
# Where the threads of 2 ranks x 1 thread run, measured: GPT-2 124M, B = 4,
# T = 256, fwd + bwd + clipping + AdamW, ZeRO-3 over 2 processes (Gloo over
# TCP loopback: comm.shared_memory=false) on a 2-core machine, once per
# placement in turn:
#   none  the scheduler's placement;
#   pin   each rank's threads (compute, Gloo, comm streams, heartbeat) on
#         its own core (taskset -a, applied once the ranks are up);
#   nice  every thread of a rank but its main (compute) one at nice 10.
# Prints each run's time/step (after 3 warm-up steps).
#
#   bash tools/bench/thread_placement.sh [DTYPE] [ROUNDS]   (bf16, 1)
#
# Figures go to docs/PERFORMANCE.md ("Trainer: where a step's time goes").
set -euo pipefail
source "$(dirname "$0")/gpt2_b4_t256.sh"
bench_init thread_placement.sh "$@"
command -v taskset >/dev/null || {
  echo "thread_placement.sh: taskset (util-linux) not found" >&2
  exit 1
}

# The ranks: the 2 child processes of the launching trainer (the first
# process named train below the background job; waited for up to 60 s).
rank_pids() {
  local p=$1 kids="" t
  for t in $(seq 1 600); do
    if [[ "$(ps -o comm= -p "$p" 2>/dev/null)" != train ]]; then
      kids=$(pgrep -P "$p" || true)
      [[ $(wc -w <<<"$kids") -eq 1 ]] && p=$kids
    else
      kids=$(pgrep -P "$p" || true)
      if [[ $(wc -w <<<"$kids") -ge 2 ]]; then
        echo "$kids"
        return 0
      fi
    fi
    sleep 0.1
  done
  echo "thread_placement.sh: the 2 ranks did not start within 60 s" >&2
  return 1
}

place() {
  local mode=$1 top=$2 i=0 p t
  [[ "$mode" == none ]] && return 0
  local ranks
  ranks=$(rank_pids "$top") || return 1
  sleep 2  # the ranks' Gloo and comm threads start with their mesh
  for p in $ranks; do
    if [[ "$mode" == pin ]]; then
      taskset -a -cp "$i" "$p" >/dev/null
    else
      for t in /proc/"$p"/task/*; do
        t=${t##*/}
        [[ "$t" != "$p" ]] && renice -n 10 -p "$t" >/dev/null
      done
    fi
    i=$((i + 1))
  done
  echo "$mode: $i ranks placed" >&2
}

for round in $(seq 1 "$rounds"); do
  for mode in none pin nice; do
    gpt2_run 2 "$dtype" --set comm.shared_memory=false >"$log" 2>&1 &
    top=$!
    if ! place "$mode" "$top"; then
      kill "$top" 2>/dev/null || true
      exit 1
    fi
    wait "$top" || {
      echo "thread_placement.sh: the $mode run failed:" >&2
      tail -20 "$log" >&2
      exit 1
    }
    step=$(grep -m1 'Time/step' "$log" | awk '{print $(NF-1)}')
    printf 'round %d  %-5s %s s/step\n' "$round" "$mode" "$step"
  done
done
