#!/usr/bin/env bash
# The one GPU run, on a GPU machine (H100 / H200), from the repo root with
# .gpu_bundle/ beside it (tools/gpu/bundle.sh made it on a machine without a
# GPU). In about 8 minutes, writing everything under $OUT (default
# /tmp/gpu_out):
#
#   1. the machine: GPU, driver, the CUDA / NCCL / cuDNN libraries found
#      (the toolkit's, else the ones PyTorch's wheels ship) and cuDNN's
#      version;                                            -> machine.json
#   2. every CUDA test of the bundle, each bounded;        -> tests.json
#   3. the trainer on the GPU (trainer/configs/gpt2_124m_gpu.textproto:
#      GPT-2 124M, 8 x 1024 tokens, bf16, AdamW): its mean step over the
#      measured steps, MFU and host syncs (the loss and norm read at logged
#      steps only), and a second run of as many steps logging every step,
#      whose losses must equal the first's logged ones bit for bit; and
#      once with the LM head and loss unfused (training.loss_chunk_tokens=0)
#      for its time and peak memory against the fused default; and with
#      selective and full activation checkpointing; and with LoRA r 16
#      on the blocks' linear layers (model.lora);
#   4. the trainer's first 10 losses on the GPU against the CPU trainer's
#      on the same data (a smaller batch: 2 x 256);
#   5. the PyTorch peers of step 3 (tools/bench/pytorch_gpt2_step.py:
#      eager, SDPA + fused AdamW, and that under torch.compile), between two
#      timings of fsdpp's, so both sides see the same machine;
#                                                           -> bench.json
#      ({device, date, fsdpp_ms, pytorch_sdpa_ms, pytorch_eager_ms,
#      pytorch_compile_ms, mfu, ...}: fsdpp's mean step over the measured
#      steps of each timed run, the median of the two; the peers' medians);
#   6. the per-kernel top 20 of one fsdpp step (ncu --clock-control none,
#      kernel durations only).                              -> kernels.csv
#
# GPU_PEER=0 skips step 5 (GPU_COMPILE=0 only its torch.compile line),
# GPU_NCU=0 step 6. If the trainer fails with cuDNN's attention, it is run
# again with FSDPP_CUDNN_ATTENTION=0 (fsdpp's own kernel) and says so.
set -uo pipefail
out="${OUT:-/tmp/gpu_out}"
mkdir -p "$out"
repo="$PWD"
work=/tmp/gpu_bundle  # kept, for runs of single tests after this script
rm -rf "$work" && mkdir -p "$work"
tar -C "$work" -xJf .gpu_bundle/bundle.tar.xz || exit 1
export OMP_WAIT_POLICY=PASSIVE
export PYTHONUNBUFFERED=1
start=$SECONDS
note() { echo "[$((SECONDS - start)) s] $*"; }

# 1. The machine and its libraries.
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader |
  tee "$out/gpu.txt"
torch_lib="$(python3 -c 'import os, torch; print(os.path.dirname(torch.__file__))' 2>/dev/null)"
site="$(dirname "$torch_lib" 2>/dev/null)"
libdirs=""
declare -A found
# PyTorch's own libraries first: its cuDNN is the one fsdpp is built against
# (9.19) and the one the PyTorch peers use.
for name in libcudart.so.13 libcublasLt.so.13 libnccl.so.2 libcudnn.so.9 \
  libnvrtc.so.13 libnvrtc-builtins.so.13; do
  path="$(find ${site:+"$site/nvidia"} /usr/local/cuda*/ \
    /usr/lib/x86_64-linux-gnu /opt /usr/local/lib \
    -name "$name*" -not -path '*/stubs/*' 2>/dev/null | head -1)"
  found[$name]="${path:-NOT FOUND}"
  echo "$name: ${found[$name]}"
  [ -n "$path" ] && libdirs="$libdirs:$(dirname "$path")"
done
# Python (the peers, PyTorch's own cuDNN) runs with the machine's library
# path; fsdpp's binaries with the libraries found above.
py() { LD_LIBRARY_PATH="$orig_ld" python3 "$@"; }
orig_ld="${LD_LIBRARY_PATH:-}"
export LD_LIBRARY_PATH="$work/lib${libdirs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
py - "$out/machine.json" "${found[libcudnn.so.9]}" <<'EOF'
import ctypes, json, subprocess, sys
import torch
version = ctypes.CDLL(sys.argv[2]).cudnnGetVersion() if sys.argv[2] else 0
info = {
    "cudnn_version_fsdpp_uses": version,
    "gpu": subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version",
                           "--format=csv,noheader"], capture_output=True,
                          text=True).stdout.strip(),
    "torch": torch.__version__,
    "torch_cudnn_version": torch.backends.cudnn.version(),
    "cudnn_library": sys.argv[2],
}
json.dump(info, open(sys.argv[1], "w"), indent=1)
print(json.dumps(info))
EOF

# 2. The CUDA tests.
note "CUDA tests"
passed=0
failed=0
: >"$out/tests.jsonl"
while read -r t; do
  log="$out/$(echo "$t" | tr / _).log"
  t0=$SECONDS
  if timeout 150 "$work/bin/$t" >"$log" 2>&1; then
    status=passed
    passed=$((passed + 1))
  else
    status="failed (rc $?)"
    failed=$((failed + 1))
    tail -30 "$log"
  fi
  grep -E '^\[  (PASSED  |SKIPPED )\] [0-9]+ tests?|^\[  FAILED  \] [A-Z]' "$log" |
    head -10
  echo "{\"test\": \"$t\", \"status\": \"$status\", \"s\": $((SECONDS - t0))}" |
    tee -a "$out/tests.jsonl"
done <"$work/tests.txt"
grep -h "loss cpu\|parameter error\|median step" \
  "$out"/tests_cuda_train_test.log 2>/dev/null
note "tests: $passed passed, $failed failed"

# 3. The trainer on the GPU, twice (the second run's losses must be the
# first's bits).
train="$work/bin/trainer/train"
gpu_config=(--config="$repo/trainer/configs/gpt2_124m_gpu.textproto"
  --nproc_per_node=1 --set "data.tokenizer_dir=$work/share/gpt2"
  --set validation.interval=0 --set training.warmup_steps=2)
fsdpp_run() {  # fsdpp_run NAME STEPS [--set ...]
  local name=$1 steps=$2
  shift 2
  if ! timeout 240 "$train" "${gpu_config[@]}" --set "training.steps=$steps" \
    --set "metrics.jsonl_path=$out/$name.jsonl" "$@" >"$out/$name.log" 2>&1; then
    echo "$name: the trainer failed (rc $?)"
    tail -20 "$out/$name.log"
    if [ -z "${FSDPP_CUDNN_ATTENTION:-}" ] && grep -q cuda "$out/$name.log"; then
      echo "$name: again with FSDPP_CUDNN_ATTENTION=0 (fsdpp's own attention)"
      export FSDPP_CUDNN_ATTENTION=0
      echo 1 >"$out/cudnn_attention_off"
      timeout 240 "$train" "${gpu_config[@]}" --set "training.steps=$steps" \
        --set "metrics.jsonl_path=$out/$name.jsonl" "$@" >"$out/$name.log" 2>&1 ||
        { echo "$name: failed again (rc $?)"; tail -20 "$out/$name.log"; }
    fi
  fi
  grep -E "cuDNN|MFU peak|memory plan|Time/step|MFU:|Peak memory|Host syncs" \
    "$out/$name.log" | head -12
}
# The same number of steps each time: the learning-rate schedule depends on
# it. Timed runs log every 10th step (the loss and norm are read only
# then); the bitwise run logs every step.
note "fsdpp, GPU, run 1"
fsdpp_run fsdpp_1 22 --set metrics.log_interval=10
note "fsdpp, GPU, run 2 (every step logged: bitwise against run 1)"
fsdpp_run fsdpp_2 22 --set metrics.log_interval=1
note "fsdpp, GPU, the LM head and loss unfused (time and peak against run 1)"
fsdpp_run fsdpp_unfused_head 22 --set metrics.log_interval=10 \
  --set training.loss_chunk_tokens=0
note "fsdpp, GPU, selective and full activation checkpointing"
fsdpp_run fsdpp_ac_selective 22 --set metrics.log_interval=10 \
  --set training.activation_checkpointing=selective
fsdpp_run fsdpp_ac_full 22 --set metrics.log_interval=10 \
  --set training.activation_checkpointing=full

note "fsdpp, GPU, LoRA r 16 on every linear layer of the blocks"
fsdpp_run fsdpp_lora 22 --set metrics.log_interval=10 \
  --set model.lora.rank=16 --set "model.lora.targets=c_attn,c_proj,fc,proj"

# 4. The first 10 losses, GPU against CPU, at 2 x 256.
small=(--set training.global_batch=2 --set training.micro_batch=2
  --set training.seq_len=256)
note "fsdpp, first 10 losses on the GPU and the CPU (2 x 256)"
fsdpp_run small_gpu 10 "${small[@]}" --set metrics.log_interval=1
fsdpp_run small_cpu 10 "${small[@]}" --set metrics.log_interval=1 \
  --set training.device=cpu

# 5. The PyTorch peers, between two fsdpp timings.
peer() {  # peer VARIANT
  timeout 240 env LD_LIBRARY_PATH="$orig_ld" python3 \
    "$repo/tools/bench/pytorch_gpt2_step.py" --device=cuda \
    --dtype=bf16 --batch=8 --seq=1024 --steps=8 --warmup=3 --variant="$1" \
    >"$out/peer_$1.json" 2>"$out/peer_$1.log" ||
    { echo "peer $1 failed"; tail -5 "$out/peer_$1.log"; }
  cat "$out/peer_$1.json"
}
if [ "${GPU_PEER:-1}" = 1 ]; then
  variants="eager sdpa"
  [ "${GPU_COMPILE:-1}" = 1 ] && variants="$variants compile"
  for variant in $variants; do
    note "PyTorch peer: $variant"
    peer "$variant"
  done
  note "fsdpp, GPU, run 3 (after the peers)"
  fsdpp_run fsdpp_3 22 --set metrics.log_interval=10
fi

# 6. The kernels of one fsdpp step.
if [ "${GPU_NCU:-1}" = 1 ] && command -v ncu >/dev/null; then
  note "ncu: the kernels of step 3"
  # Two steps (the first builds the cuDNN plans; ncu times only kernels),
  # at most 6000 kernels.
  timeout 200 ncu --clock-control none --metrics gpu__time_duration.sum \
    --launch-count 6000 --csv --log-file "$out/ncu.csv" \
    "$train" "${gpu_config[@]}" --set training.steps=2 \
    --set metrics.jsonl_path= >"$out/ncu_run.log" 2>&1 ||
    { echo "ncu failed (rc $?)"; tail -5 "$out/ncu_run.log"; }
fi

# The summary.
python3 - "$out" <<'EOF'
import csv, collections, datetime, json, os, re, statistics, sys
out = sys.argv[1]

def steps(name):
  path = os.path.join(out, name + ".jsonl")
  if not os.path.exists(path):
    return []
  return [json.loads(l) for l in open(path) if '"kind":"train"' in l]

def summary(name):
  path = os.path.join(out, name + ".jsonl")
  if not os.path.exists(path):
    return {}
  s = [json.loads(l) for l in open(path) if '"kind":"summary"' in l]
  return s[-1] if s else {}

def mean_ms(name):
  # The mean over the measured steps: with the values read only at logged
  # steps, a step's own time is when the host got through it, and the
  # logged steps wait for the GPU to catch up.
  t = summary(name).get("step_time_s")
  return 1e3 * t if t else None

def peak_mib(name):
  # The trainer's "Peak memory/rank: X MiB (planned Y MiB ...)" line.
  try:
    m = re.search(r"Peak memory/rank:\s+([0-9.]+) MiB \(planned ([0-9.]+)",
                  open(os.path.join(out, name + ".log")).read())
  except OSError:
    return None
  return [float(m.group(1)), float(m.group(2))] if m else None

def peer_ms(variant):
  try:
    return 1e3 * json.load(open(os.path.join(out, f"peer_{variant}.json")))[
        "median_step_s"]
  except (OSError, ValueError, KeyError):
    return None

run1, run2, run3 = steps("fsdpp_1"), steps("fsdpp_2"), steps("fsdpp_3")
small_gpu, small_cpu = steps("small_gpu"), steps("small_cpu")
logged1 = {r["step"]: r["loss"] for r in run1}
losses1 = [logged1[k] for k in sorted(logged1)]
losses2 = [r["loss"] for r in run2 if r["step"] in logged1]
gpu10 = [r["loss"] for r in small_gpu][:10]
cpu10 = [r["loss"] for r in small_cpu][:10]
fsdpp = [m for m in (mean_ms("fsdpp_1"), mean_ms("fsdpp_3")) if m is not None]
bench = {
    "device": open(os.path.join(out, "gpu.txt")).read().strip(),
    "date": datetime.date.today().isoformat(),
    "fsdpp_ms": statistics.median(fsdpp) if fsdpp else None,
    "fsdpp_ms_runs": fsdpp,
    "pytorch_sdpa_ms": peer_ms("sdpa"),
    "pytorch_eager_ms": peer_ms("eager"),
    "pytorch_compile_ms": peer_ms("compile"),
    "mfu": summary("fsdpp_1").get("mfu"),
    # The LM head fused with the loss (the default) against unfused
    # (training.loss_chunk_tokens=0): mean step and [measured, planned] peak.
    "fsdpp_unfused_head_ms": mean_ms("fsdpp_unfused_head"),
    "peak_mib_measured_planned": peak_mib("fsdpp_1"),
    "peak_mib_measured_planned_unfused_head": peak_mib("fsdpp_unfused_head"),
    # Activation checkpointing (none in run 1): mean step, peak.
    "fsdpp_ac_selective_ms": mean_ms("fsdpp_ac_selective"),
    "peak_mib_measured_planned_ac_selective": peak_mib("fsdpp_ac_selective"),
    "fsdpp_ac_full_ms": mean_ms("fsdpp_ac_full"),
    "peak_mib_measured_planned_ac_full": peak_mib("fsdpp_ac_full"),
    # LoRA r 16 on the blocks' linear layers (model.lora): mean step, peak.
    "fsdpp_lora_ms": mean_ms("fsdpp_lora"),
    "peak_mib_measured_planned_lora": peak_mib("fsdpp_lora"),
    "lora_losses": [r["loss"] for r in steps("fsdpp_lora")],
    "bitwise_rerun": bool(losses2) and losses1 == losses2,
    "bitwise_steps": sorted(logged1),
    "first_losses_gpu": gpu10,
    "first_losses_cpu": cpu10,
    "first_losses_max_rel": max((abs(g - c) / abs(c) for g, c in
                                 zip(gpu10, cpu10)), default=None),
    "shape": "GPT-2 124M, 8 x 1024 tokens, bf16, AdamW",
    "cudnn_attention": not os.path.exists(os.path.join(out,
                                                       "cudnn_attention_off")),
    # Over run 1's steps, and those of its steps not logged.
    "host_syncs_run": summary("fsdpp_1").get("host_syncs"),
    "steps_run": summary("fsdpp_1").get("steps"),
    "host_syncs_logged_steps": sum(r.get("host_syncs", 0) for r in run1),
}
json.dump(bench, open(os.path.join(out, "bench.json"), "w"), indent=1)
print(json.dumps(bench, indent=1))
# Kernels: total time per kernel name over the profiled steps, top 20.
path = os.path.join(out, "ncu.csv")
if os.path.exists(path):
  # ncu profiled two steps; figures are per step (the first builds the
  # cuDNN plans, which runs no extra kernels of the step's own).
  rows = [l for l in open(path) if l.startswith('"')]
  totals = collections.Counter()
  counts = collections.Counter()
  for row in csv.DictReader(rows):
    if row.get("Metric Name") != "gpu__time_duration.sum":
      continue
    value = float(row["Metric Value"].replace(",", ""))
    unit = row.get("Metric Unit")
    scale = {"nsecond": 1e-6, "ns": 1e-6, "usecond": 1e-3, "us": 1e-3,
             "msecond": 1.0, "ms": 1.0}
    if unit not in scale:
      sys.exit(f"ncu.csv: unknown time unit {unit!r}")
    name = re.sub(r"\(.*", "", row["Kernel Name"])[:100]
    totals[name] += value * scale[unit] / 2
    counts[name] += 0.5
  whole = sum(totals.values()) or 1.0
  bench["kernel_ms_per_step"] = whole
  bench["kernels_per_step"] = sum(counts.values())
  json.dump(bench, open(os.path.join(out, "bench.json"), "w"), indent=1)
  print(f"GPU kernel time per step (ncu): {whole:.2f} ms in "
        f"{sum(counts.values()):.0f} kernels")
  with open(os.path.join(out, "kernels.csv"), "w") as f:
    f.write("kernel,calls_per_step,ms_per_step,share\n")
    for name, ms in totals.most_common(20):
      f.write(f'"{name}",{counts[name]:g},{ms:.3f},{ms / whole:.3f}\n')
  print(open(os.path.join(out, "kernels.csv")).read())
EOF
note "done: tests $passed passed, $failed failed"
