#!/usr/bin/env bash
# What a second rank costs on one host: GPT-2 124M, B = 4, T = 256, fwd +
# bwd + clipping + AdamW, 1 rank x 2 threads against ZeRO-3 over 2 ranks x
# 1 thread with FSDP's all-gathers and reduce-scatters through shared memory
# (comm.shared_memory, the default) and over Gloo's TCP loopback, the three
# in turn each round. Prints each run's time/step (after 3 warm-up steps)
# and its measured and planned peak per rank.
#
#   bash tools/bench/two_ranks.sh [DTYPE] [ROUNDS]   (bf16, 1)
#
# Figures go to docs/PERFORMANCE.md ("Trainer: where a step's time goes").
set -euo pipefail
source "$(dirname "$0")/gpt2_b4_t256.sh"
bench_init two_ranks.sh "$@"

for round in $(seq 1 "$rounds"); do
  for run in "1 true" "2 true" "2 false"; do
    read -r ranks shm <<<"$run"
    gpt2_run "$ranks" "$dtype" --set comm.shared_memory="$shm" \
      >"$log" 2>&1 || {
      echo "two_ranks.sh: the ${ranks}-rank run (shared_memory $shm) failed:" >&2
      tail -20 "$log" >&2
      exit 1
    }
    step=$(grep -m1 'Time/step' "$log" | awk '{print $(NF-1)}')
    peak=$(grep -m1 'Peak memory/rank' "$log" | sed -E 's/.*Peak memory\/rank: *//')
    if [[ "$ranks" == 1 ]]; then
      what="1 x 2"
    elif [[ "$shm" == true ]]; then
      what="2 x 1 shared memory"
    else
      what="2 x 1 TCP"
    fi
    printf 'round %d  %s %-20s %s s/step  peak %s\n' "$round" "$dtype" \
      "$what" "$step" "$peak"
  done
done
