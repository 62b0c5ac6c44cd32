#!/usr/bin/env bash
# GPT-2 124M training steps at W = 4 under FSDP 4, FSDP 2 x TP 2 (with and
# without sequence parallelism) and TP 4, in interleaved rounds (the machine
# is shared and noisy, so only same-round ratios are meaningful): time/step,
# exposed communication per step and peak memory per rank, as the trainer
# measures them (multi-process ranks, so memory is per rank).
#
#   bash tools/bench/tp_layouts.sh [ROUNDS] [STEPS]
#
# Small batch for 2 cores: global batch 4 x 256 tokens, micro batch 1, f32.
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds=${1:-2}
steps=${2:-5}
bazel build -c opt //trainer:train >/dev/null 2>&1
out=$(mktemp -d)
layouts=("tp=1" "tp=2" "tp=2 sp" "tp=4")
printf "%-8s %-10s %12s %14s %16s\n" round layout "time/step s" "exposed ms" "peak MiB/rank"
for r in $(seq 1 "$rounds"); do
  for l in "${layouts[@]}"; do
    tp=${l%% *}
    tp=${tp#tp=}
    sp=false
    [[ "$l" == *sp ]] && sp=true
    log="$out/r${r}_tp${tp}_sp${sp}.txt"
    bazel-bin/trainer/train --nproc_per_node=4 \
      --config=trainer/configs/gpt2_124m.textproto \
      --set parallelism.tp="$tp" --set parallelism.sequence_parallel="$sp" \
      --set training.steps="$steps" --set training.warmup_steps=1 \
      --set training.global_batch=4 --set training.micro_batch=1 \
      --set training.seq_len=256 \
      --set training.mixed_precision.param_dtype=f32 \
      --set checkpoint.interval=0 --set checkpoint.folder="$out/ckpt" \
      --set checkpoint.async=false --set validation.interval=0 \
      --set metrics.jsonl_path="$out/r${r}_${tp}_${sp}.jsonl" \
      --set metrics.throughput_warmup_steps=2 >"$log" 2>&1
    t=$(grep -oP 'Time/step:\s+\K[0-9.]+' "$log")
    c=$(grep -oP 'Exposed comm/step:\s+\K[0-9.]+' "$log")
    m=$(grep -oP 'Peak memory/rank:\s+\K[0-9.]+' "$log")
    printf "%-8s %-10s %12s %14s %16s\n" "$r" "$l" "$t" "$c" "$m"
  done
done
echo "logs: $out"
