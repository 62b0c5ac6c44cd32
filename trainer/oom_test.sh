#!/usr/bin/env bash
# Out of memory, for real: `train` in a memory cgroup limited to 400 MiB,
# with a run that needs about 1.5 GiB per rank (GPT-2 124M, f32, two
# ranks).
#  1. The trainer plans before it allocates: told the budget
#     (training.max_memory_gib=0.39) it refuses the run at once, naming the
#     largest part and the settings that would fit, and writes nothing.
#  2. Forced past the check (training.skip_memory_check=true), the rank is
#     killed by the kernel's out-of-memory killer; the launcher says so (not
#     just "killed by signal SIGKILL"), quoting the rank's last memory report
#     and the plan.
# Needs root and a writable memory cgroup (v1 or v2); skips, saying so,
# where there is none.
set -euo pipefail
train=$(realpath trainer/train)
work=$(mktemp -d)
cg=""
cleanup() {
  if [ -n "$cg" ] && [ -d "$cg" ]; then
    # Move ourselves out before removing it.
    echo $$ >"$cg_parent/cgroup.procs" 2>/dev/null || true
    rmdir "$cg" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*" >&2
  exit 1
}

# This process's memory cgroup: v1 (N:memory:/path) or v2 (0::/path).
v1=$(awk -F: '$2 == "memory" {print $3}' /proc/self/cgroup)
v2=$(awk -F: '$1 == "0" && $2 == "" {print $3}' /proc/self/cgroup)
limit=$((400 << 20))
if [ -n "$v1" ] && [ -w "/sys/fs/cgroup/memory$v1" ]; then
  cg_parent="/sys/fs/cgroup/memory$v1"
  cg="$cg_parent/fsdpp_oom_$$"
  mkdir "$cg"
  echo "$limit" >"$cg/memory.limit_in_bytes"
  # No swap to fall back on, where the kernel accounts it.
  echo "$limit" >"$cg/memory.memsw.limit_in_bytes" 2>/dev/null || true
elif [ -n "$v2" ] && [ -w "/sys/fs/cgroup$v2" ] &&
  grep -qw memory "/sys/fs/cgroup$v2/cgroup.controllers" 2>/dev/null; then
  cg_parent="/sys/fs/cgroup$v2"
  cg="$cg_parent/fsdpp_oom_$$"
  mkdir "$cg"
  echo "$limit" >"$cg/memory.max"
  echo 0 >"$cg/memory.swap.max" 2>/dev/null || true
else
  echo "SKIP: no writable memory cgroup (needs root and cgroup v1 or v2)"
  exit 0
fi
echo $$ >"$cg/cgroup.procs" || {
  echo "SKIP: cannot join the cgroup $cg"
  exit 0
}

flags=(
  --nproc_per_node=2
  --set model.name=gpt2_124m --set model.n_layers=12
  --set model.dim=768 --set model.n_heads=12 --set model.vocab_size=50257
  --set model.context_length=1024
  --set training.steps=2 --set training.global_batch=2
  --set training.micro_batch=1 --set training.seq_len=256
  --set training.warmup_steps=0 --set data.tokenizer=gpt2
  --set validation.interval=0 --set metrics.trace_steps=0
  --set checkpoint.interval=0 --set checkpoint.resume=false
  --set "checkpoint.folder=$work/ckpt" --set "metrics.jsonl_path=$work/m.jsonl"
  --set training.max_memory_gib=0.39
)

# 1. Refused up front.
start=$(date +%s%N)
if "$train" "${flags[@]}" >"$work/refused.log" 2>&1; then
  cat "$work/refused.log"
  fail "the over-budget run was not refused"
fi
elapsed_ms=$((($(date +%s%N) - start) / 1000000))
grep -q "does not fit" "$work/refused.log" ||
  { cat "$work/refused.log"; fail "no 'does not fit' in the refusal"; }
grep -q "the largest part is" "$work/refused.log" ||
  { cat "$work/refused.log"; fail "the refusal names no largest part"; }
[ ! -e "$work/ckpt" ] && [ ! -e "$work/m.jsonl" ] ||
  fail "the refused run wrote files"
echo "refused in ${elapsed_ms} ms (process start included):"
grep -o "does not fit.*" "$work/refused.log" | head -1 | cut -c1-400

# 2. Forced: killed by the out-of-memory killer, and told so.
if "$train" "${flags[@]}" --set training.skip_memory_check=true \
  >"$work/oom.log" 2>&1; then
  cat "$work/oom.log"
  fail "the forced run survived a 400 MiB limit"
fi
grep -q "was killed by the out-of-memory killer" "$work/oom.log" ||
  { tail -20 "$work/oom.log"; fail "the launcher did not say out of memory"; }
grep -q "its last memory report: .*the plan: peak" "$work/oom.log" ||
  { tail -20 "$work/oom.log"; fail "no memory report or plan quoted"; }
grep -o "rank . was killed by the out-of-memory killer.*" "$work/oom.log" |
  head -1
echo "PASS"
