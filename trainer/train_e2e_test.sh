#!/usr/bin/env bash
# End-to-end tests of the `train` binary as users run it: 2 processes started
# by the binary itself through tools/launch (TCP store, Gloo), a preemption
# drill (--stop_after_steps) and resume whose losses equal the uninterrupted
# run's digit for digit, a resume on 1 process, config errors (a GPU run
# without GPUs among them), the plot, and a stopped rank (SIGSTOP) named
# within comm.timeout_s + a few seconds.
set -euo pipefail
train=trainer/train
work="${TEST_TMPDIR:-$(mktemp -d)}/e2e"
rm -rf "$work"
mkdir -p "$work"
cd_back=$PWD

fail() {
  echo "FAIL: $*" >&2
  exit 1
}

# A tiny run: 6 steps, checkpoints every 3.
common=(
  --set training.steps=6 --set training.global_batch=8
  --set training.micro_batch=2 --set training.seq_len=32
  --set training.warmup_steps=2 --set checkpoint.interval=3
  --set checkpoint.resume=true --set validation.interval=3
  --set validation.batches=2 --set metrics.log_interval=1
  --set metrics.trace_start_step=2 --set metrics.trace_steps=1
  --set model.n_layers=2 --set model.dim=64
)

run() {  # run DIR [extra flags...]; output in DIR.log
  local dir=$1
  shift
  "$cd_back/$train" "${common[@]}" \
    --set "checkpoint.folder=$dir/ckpt" \
    --set "metrics.jsonl_path=$dir/metrics.jsonl" \
    --set "metrics.trace_path=$dir/trace.json" "$@" >"$dir.log" 2>&1 ||
    { cat "$dir.log"; fail "train $* exited $?"; }
  cat "$dir.log"
}

source "$cd_back/trainer/drill_helpers.sh"  # losses, rank_pid

cd "$work"

# 1. Straight through on 2 processes (no wait policy set: the binary sets
# PASSIVE for the ranks it launches).
mkdir -p straight
(unset OMP_WAIT_POLICY && run "$work/straight")
log=$(cat "$work/straight.log")
grep -q "train: starting 2 local ranks" <<<"$log" || fail "no launch line"
grep -q "\[rank 0\] fsdpp trainer: gpt2_debug" <<<"$log" || fail "no header"
grep -q "\[rank 0\] step 6/6 | loss" <<<"$log" || fail "no step 6 line"
grep -q "\[rank 0\] Memory per rank at the end:" <<<"$log" || fail "no memory table"
grep -q "\[rank 0\]   MFU: " <<<"$log" || fail "no MFU"
grep -q "\[rank 0\]   CPU: [0-9]* OpenMP thread(s) per rank, OMP_WAIT_POLICY PASSIVE" \
  <<<"$log" || fail "launched ranks' OpenMP workers do not sleep"
grep -q "checkpoint: $work/straight/ckpt/step-6" <<<"$log" || fail "no checkpoint path"
grep -q "plot:       $work/straight/metrics.png" <<<"$log" || fail "no plot"
[[ -f "$work/straight/ckpt/step-6/metadata.pb" ]] || fail "checkpoint missing"
[[ -f "$work/straight/ckpt/step-3/metadata.pb" ]] || fail "checkpoint 3 missing"
/usr/bin/python3 - "$work/straight/trace.json" <<'PY' || fail "bad trace"
import json, sys
events = json.load(open(sys.argv[1]))["traceEvents"]
pids = {e["pid"] for e in events if e["ph"] == "X"}
cats = {e["cat"] for e in events if e["ph"] == "X"}
assert pids == {0, 1}, pids
assert {"compute", "comm", "comm_wait"} <= cats, cats
PY
head -c 8 "$work/straight/metrics.png" | od -An -c | grep -q "P   N   G" ||
  fail "metrics.png is not a PNG"

# 2. Preempted after 4 steps (checkpoint 3 is the latest), then resumed: the
# resumed steps 4-6 have exactly the uninterrupted run's losses.
mkdir -p resumed
run "$work/resumed" --stop_after_steps=4
grep -q "stopping after step 4" "$work/resumed.log" || fail "no stop"
[[ ! -d "$work/resumed/ckpt/step-6" ]] || fail "preempted run saved step 6"
run "$work/resumed"
grep -q "resumed from $work/resumed/ckpt/step-3: 3 step(s) done" \
  "$work/resumed.log" || fail "did not resume from step 3"
diff <(losses "$work/straight/metrics.jsonl") \
  <(losses "$work/resumed/metrics.jsonl") ||
  fail "resumed losses differ from the uninterrupted run"

# 3. The step-3 checkpoint of the 2-process run resumed on 1 process,
# which (no wait policy set) runs itself again with spinning OpenMP workers.
mkdir -p single/ckpt
cp -r "$work/straight/ckpt/step-3" "$work/single/ckpt/"
(unset OMP_WAIT_POLICY && run "$work/single" --nproc_per_node=1)
grep -q "  CPU: [0-9]* OpenMP thread(s) per rank, OMP_WAIT_POLICY ACTIVE" \
  "$work/single.log" || fail "the 1-process run kept OpenMP's default"
grep -q "resumed from $work/single/ckpt/step-3" "$work/single.log" ||
  fail "1-process run did not resume"
grep -q "step 6/6" "$work/single.log" || fail "1-process run did not finish"

# 4. Config errors exit 2 with the field named, before starting ranks.
if "$cd_back/$train" --set training.global_batch=7 >"$work/bad.log" 2>&1; then
  fail "a bad config was accepted"
fi
code=$("$cd_back/$train" --set training.global_batch=7 >/dev/null 2>&1; echo $?) || true
[[ "$code" == 2 ]] || fail "bad config exit code $code, want 2"
grep -q "training.global_batch" "$work/bad.log" || { cat "$work/bad.log"; fail "no field in error"; }
grep -q "starting" "$work/bad.log" && fail "ranks started for a bad config"
# A GPU run on a machine without one (or a CPU build) is refused at once,
# saying why, before any rank starts.
if "$cd_back/$train" "${common[@]}" --set checkpoint.interval=0 \
    --set checkpoint.resume=false --set training.device=cuda \
    --set "checkpoint.folder=$work/gpu" >"$work/gpu.log" 2>&1; then
  nvidia-smi -L 2>/dev/null | grep -q GPU || fail "a GPU run ran without GPUs"
else
  grep -q 'training.device "cuda"' "$work/gpu.log" || { cat "$work/gpu.log"; fail "no device error"; }
  grep -Eq "built without CUDA|this machine shows no GPU" "$work/gpu.log" || { cat "$work/gpu.log"; fail "no reason"; }
  grep -q "starting" "$work/gpu.log" && fail "ranks started for a GPU run without GPUs"
fi
if "$cd_back/$train" --sett x=1 >"$work/flag.log" 2>&1; then fail "bad flag accepted"; fi
grep -q "unknown flag --sett" "$work/flag.log" || fail "no flag error"

# 5. A rank stopped mid-run (SIGSTOP) with comm.timeout_s=3: rank 0's next
# collective fails after 3 s naming rank 1 as the rank whose heartbeat
# stopped, and the launcher ends the job (SIGKILL after its 5 s grace
# period): no hang, nothing left behind.
mkdir -p stopped
"$cd_back/$train" "${common[@]}" --set training.steps=100000 \
  --set checkpoint.interval=0 --set validation.interval=0 \
  --set metrics.trace_steps=0 --set comm.timeout_s=3 \
  --set "checkpoint.folder=$work/stopped/ckpt" >"$work/stopped.log" 2>&1 &
launcher=$!
for _ in $(seq 600); do
  grep -qE "step +3/100000" "$work/stopped.log" && break
  sleep 0.1
done
grep -qE "step +3/100000" "$work/stopped.log" ||
  { kill -9 "$launcher"; cat "$work/stopped.log"; fail "no step 3"; }
rank1=$(rank_pid "$launcher" 1)
[[ -n "$rank1" ]] || { kill -9 "$launcher"; fail "rank 1's process not found"; }
start=$(date +%s%N)
kill -STOP "$rank1"
code=0
wait "$launcher" || code=$?
elapsed_ms=$(( ($(date +%s%N) - start) / 1000000 ))
elapsed="$((elapsed_ms / 1000)).$(printf %03d $((elapsed_ms % 1000)))"
[[ $code != 0 ]] || fail "the job succeeded with a stopped rank"
grep -q "1 (heartbeat stopped" "$work/stopped.log" ||
  { cat "$work/stopped.log"; fail "rank 1 not named"; }
# 3 s timeout + diagnosis + 5 s grace, with slack for a loaded machine.
(( elapsed_ms < 20000 )) || fail "took ${elapsed}s to end"
! kill -0 "$rank1" 2>/dev/null || fail "rank 1 left behind"
echo "stopped rank: job ended after ${elapsed}s (exit $code):"
grep -m1 "heartbeat stopped" "$work/stopped.log"

# 6. Kill -9 drill under --max_restarts=3 (trainer/kill_drill.sh, 2
# trials): a random rank killed at a random step, the ranks restarted and
# resumed, every final loss equal to the uninterrupted run's.
bash "$cd_back/trainer/kill_drill.sh" 2 "$cd_back/$train" "$work/drill" ||
  fail "kill -9 drill"

# 7. The memory plan is exact per process: every rank's measured peak of
# live tensors equals the plan's, also for meshes with a tp axis (2
# processes: FSDP 2; tensor parallel 2 with sequence and loss parallelism;
# HSDP 2 x 1 over 3 micro-batches, the replicas' sum held until the last;
# context parallel 2, the ring's buffers included; frozen embeddings and
# first block, with no gradients or optimizer state for them; ZeRO-1 over 3
# micro-batches, the gathered parameters and unsharded gradients held).
for layout in "dp" "tp" "hsdp" "cp" "frozen" "zero1"; do
  mkdir -p "$work/plan_$layout"
  extra=()
  [[ $layout == tp ]] && extra=(--set parallelism.tp=2
    --set parallelism.sequence_parallel=true)
  [[ $layout == cp ]] && extra=(--set parallelism.cp=2)
  [[ $layout == frozen ]] && extra=(--set "model.freeze=wte.weight,h.0.*")
  [[ $layout == zero1 ]] && extra=(--set parallelism.reshard_after_backward=false
    --set training.global_batch=12)
  [[ $layout == hsdp ]] && extra=(--set parallelism.dp_replicate=2
    --set training.global_batch=12)
  run "$work/plan_$layout" --set training.steps=2 --set checkpoint.interval=0 \
    --set validation.interval=0 --set metrics.trace_steps=0 "${extra[@]}" \
    >/dev/null
  line="$(grep -m1 -o 'Peak memory/rank: .*' "$work/plan_$layout.log")" ||
    fail "$layout: no peak memory line"
  measured="$(echo "$line" | awk '{print $3}')"
  planned="$(echo "$line" | sed -nE 's/.*planned ([0-9.]+) MiB.*/\1/p')"
  [[ -n $planned && $measured == "$planned" ]] ||
    fail "$layout: measured peak $measured MiB, planned '$planned' MiB"
  echo "memory plan ($layout): measured $measured MiB = planned $planned MiB"
done

echo "PASS"
