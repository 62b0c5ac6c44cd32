#!/usr/bin/env bash
# The planner against measured runs: each case is trained for a few steps by
# the trainer (real processes, tools/launch) and planned by tools/plan on
# the same config; prints the measured and planned peak memory per rank
# (live tensors, fsdpp's allocators) and step time, with their ratios.
#
#   bash tools/bench/plan_vs_measured.sh [STEPS]   (default 6; 3 warm-up)
#
# Figures go to docs/PERFORMANCE.md ("Planner").
set -euo pipefail
cd "$(dirname "$0")/../.."
steps="${1:-6}"
bazel build -c opt //trainer:train //tools/plan 2>/dev/null
train=bazel-bin/trainer/train
plan=bazel-bin/tools/plan/plan
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
common=(training.steps="$steps" training.warmup_steps=0 checkpoint.interval=0
  checkpoint.resume=false
  validation.interval=0 metrics.trace_steps=0 metrics.jsonl_path=
  metrics.log_interval=1000 checkpoint.folder="$out/ckpt")
# name | config | world | overrides
cases=(
  "gpt2 W=1 ZeRO-3|default|1|"
  "gpt2 W=1 AC|default|1|training.activation_checkpointing=full"
  "gpt2 W=2 ZeRO-3|default|2|"
  "gpt2 W=2 ZeRO-2|default|2|parallelism.reshard_after_forward=false"
  "gpt2 W=2 offload|default|2|parallelism.offload=true"
  "gpt2 W=4 hpZ 2|default|4|parallelism.hpz_degree=2,training.micro_batch=4"
  "gpt2 W=4 HSDP 2x2|default|4|parallelism.dp_replicate=2,parallelism.dp_shard=2,training.micro_batch=4"
  "llama W=4 HSDP bf16|llama_debug|4|"
  "llama W=2 AC bf16|llama_debug|2|parallelism.dp_replicate=1,parallelism.dp_shard=2,training.activation_checkpointing=full"
  "gpt2 W=2 TP 2|default|2|parallelism.dp_shard=1,parallelism.tp=2"
  "gpt2 W=4 FSDP 2 x TP 2 SP|default|4|parallelism.dp_shard=2,parallelism.tp=2,parallelism.sequence_parallel=true"
  "gpt2 W=4 TP 4|default|4|parallelism.dp_shard=1,parallelism.tp=4"
  "llama W=4 FSDP 2 x TP 2|llama_debug|4|parallelism.dp_replicate=1,parallelism.dp_shard=2,parallelism.tp=2"
  "gpt2 W=2 CP 2|default|2|parallelism.cp=2"
  "llama W=4 CP 2 x FSDP 2|llama_debug|4|parallelism.dp_replicate=1,parallelism.cp=2,training.seq_len=128"
  "gpt2 W=2 PP 2 1F1B|default|2|parallelism.dp_shard=1,parallelism.pp=2"
  "gpt2 W=2 PP 2 GPipe|default|2|parallelism.dp_shard=1,parallelism.pp=2,parallelism.pp_schedule=gpipe"
  "gpt2 W=4 PP 2 x TP 2|default|4|parallelism.dp_shard=1,parallelism.pp=2,parallelism.tp=2"
  "gpt2_124m W=2 bf16 AC|gpt2_124m|2|parallelism.dp_shard=2,training.global_batch=2,training.micro_batch=1,training.seq_len=256,training.activation_checkpointing=full"
  "gpt2_124m W=1 f32|gpt2_124m|1|parallelism.dp_shard=1,training.global_batch=2,training.micro_batch=2,training.seq_len=256,training.mixed_precision.param_dtype=f32"
)
printf '%-24s %10s %10s %6s   %9s %9s %6s\n' case "peak MiB" planned ratio \
  "step s" predicted ratio
for c in "${cases[@]}"; do
  IFS='|' read -r name config world extra <<<"$c"
  args=()
  for kv in "${common[@]}" ${extra//,/ }; do args+=(--set="$kv"); done
  log="$out/$(echo "$name" | tr ' /=' '___').log"
  "$train" --config="trainer/configs/$config.textproto" \
    --nproc_per_node="$world" "${args[@]}" >"$log" 2>&1 || {
    echo "$name: the trainer failed:"; tail -5 "$log"; continue; }
  line="$(grep -o 'Peak memory/rank:.*' "$log")"
  measured="$(echo "$line" | awk '{print $3}')"
  planned="$(echo "$line" | sed -E 's/.*planned ([0-9.]+) MiB.*/\1/')"
  step="$(grep -o 'Time/step: *[0-9.]*' "$log" | awk '{print $2}')"
  predicted="$("$plan" --config="trainer/configs/$config.textproto" \
    --world="$world" "${args[@]}" |
    sed -nE 's/^Step time: .* = ([0-9.]+) s;.*/\1/p')"
  awk -v n="$name" -v m="$measured" -v p="$planned" -v s="$step" \
    -v q="$predicted" 'BEGIN { printf "%-24s %10.1f %10.1f %6.3f   %9.3f %9.3f %6.3f\n", n, m, p, p / m, s, q, q / s }'
done
