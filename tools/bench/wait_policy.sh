#!/usr/bin/env bash
# What the in-process run's OpenMP wait policy costs: GPT-2 124M, B = 4,
# T = 256, fwd + bwd + clipping + AdamW, 1 rank x 2 threads, under
# OMP_WAIT_POLICY=PASSIVE (workers sleep between parallel regions, as
# libgomp's default does after a short spin) and ACTIVE (they spin: what
# the trainer runs itself under on the CPU), in turn each round. Prints
# each run's time/step (after 3 warm-up steps).
#
#   bash tools/bench/wait_policy.sh [DTYPE] [ROUNDS]   (bf16, 1)
#
# Figures go to docs/PERFORMANCE.md ("Side by side with PyTorch").
set -euo pipefail
source "$(dirname "$0")/gpt2_b4_t256.sh"
bench_init wait_policy.sh "$@"

for round in $(seq 1 "$rounds"); do
  for policy in PASSIVE ACTIVE; do
    GPT2_WAIT_POLICY=$policy gpt2_run 1 "$dtype" >"$log" 2>&1 || {
      echo "wait_policy.sh: the $policy run failed:" >&2
      tail -20 "$log" >&2
      exit 1
    }
    grep -q "OMP_WAIT_POLICY $policy" "$log" || {
      echo "wait_policy.sh: the trainer did not run under $policy:" >&2
      grep "CPU:" "$log" >&2
      exit 1
    }
    step=$(grep -m1 'Time/step' "$log" | awk '{print $(NF-1)}')
    printf 'round %d  %s 1 x 2 %-8s %s s/step\n' "$round" "$dtype" "$policy" \
      "$step"
  done
done
