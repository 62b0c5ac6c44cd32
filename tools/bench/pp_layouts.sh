#!/usr/bin/env bash
# GPT-2 124M training steps at W = 4: FSDP 4 against PP 2 x FSDP 2 with 1F1B
# and GPipe at 4 and 8 micro-batches per step (the same global batch for
# each pair), in interleaved rounds (the machine is shared and noisy, so
# only same-round ratios are meaningful): time/step, peak memory per rank,
# and per pipeline rank the fraction of its pipeline time spent waiting (the
# measured bubble, transfers included) against the schedule's (p - 1) /
# (m + p - 1), as the trainer measures them (multi-process ranks).
#
#   bash tools/bench/pp_layouts.sh [ROUNDS] [STEPS] [CUTS]
#   bash tools/bench/pp_layouts.sh bubble [ROUNDS] [STEPS] [CUTS]
#
# The second form measures the bubble itself: PP 2 alone on 2 ranks (one
# core each, so a waiting rank is idle), GPipe and 1F1B at 2, 4 and 8
# micro-batches.
#
# Small batch for 2 cores: micro batch 1 x 128 tokens, f32. CUTS (default 9)
# is where stage 1 starts: GPT-2's head (768 x 50304) costs about 5 blocks,
# so 9 + 3 blocks balances the two stages.
set -euo pipefail
cd "$(dirname "$0")/../.."
world=4
if [[ "${1:-}" == bubble ]]; then
  world=2
  shift
fi
rounds=${1:-2}
steps=${2:-4}
cuts=${3:-9}
bazel build -c opt //trainer:train >/dev/null 2>&1
out=$(mktemp -d)
# name:pp:schedule:micro-batches (per data-parallel rank):global batch
layouts=("fsdp4:1:-:2:8" "pp2-1f1b-m4:2:1f1b:4:8" "pp2-gpipe-m4:2:gpipe:4:8"
         "fsdp4:1:-:4:16" "pp2-1f1b-m8:2:1f1b:8:16" "pp2-gpipe-m8:2:gpipe:8:16")
if [[ $world == 2 ]]; then
  layouts=("pp2-1f1b-m2:2:1f1b:2:2" "pp2-gpipe-m2:2:gpipe:2:2"
           "pp2-1f1b-m4:2:1f1b:4:4" "pp2-gpipe-m4:2:gpipe:4:4"
           "pp2-1f1b-m8:2:1f1b:8:8" "pp2-gpipe-m8:2:gpipe:8:8")
fi
printf "%-6s %-13s %6s %12s %14s %10s  %s\n" round layout batch \
  "time/step s" "peak MiB/rank" "schedule" "waiting per rank"
for r in $(seq 1 "$rounds"); do
  for l in "${layouts[@]}"; do
    IFS=: read -r name pp schedule m global <<<"$l"
    log="$out/r${r}_${name}_g${global}.txt"
    pipeline=()
    if [[ "$pp" != 1 ]]; then
      pipeline=(--set parallelism.pp="$pp" --set parallelism.pp_schedule="$schedule"
                --set parallelism.pp_microbatches="$m"
                --set parallelism.pp_cuts="$cuts")
    fi
    bazel-bin/trainer/train --nproc_per_node="$world" \
      --config=trainer/configs/gpt2_124m.textproto \
      "${pipeline[@]}" \
      --set training.steps="$steps" --set training.warmup_steps=1 \
      --set training.global_batch="$global" --set training.micro_batch=1 \
      --set training.seq_len=128 \
      --set training.mixed_precision.param_dtype=f32 \
      --set checkpoint.interval=0 --set checkpoint.folder="$out/ckpt" \
      --set checkpoint.async=false --set validation.interval=0 \
      --set metrics.jsonl_path="$out/r${r}_${name}_g${global}.jsonl" \
      --set metrics.throughput_warmup_steps=1 >"$log" 2>&1
    t=$(grep -oP 'Time/step:\s+\K[0-9.]+' "$log")
    mem=$(grep -oP 'Peak memory/rank:\s+\K[0-9.]+' "$log")
    sched="-"
    waits="-"
    if [[ "$pp" != 1 ]]; then
      sched=$(grep -oP 'bubble with equal stage times \K[0-9.]+%' "$log" | tail -1)
      # The table's rows after its header: the field ending in % per rank.
      waits=$(awk '/waiting  held for backward/{f=1; next}
                   f && /%/ {for (i = 1; i <= NF; i++) if ($i ~ /%$/) print $i}' \
              "$log" | paste -sd' ')
    fi
    printf "%-6s %-13s %6s %12s %14s %10s  %s\n" "$r" "$name" "$global" "$t" \
      "$mem" "$sched" "$waits"
  done
done
echo "logs: $out"
