#!/usr/bin/env bash
# Context parallelism's acceptance runs (real processes, tools/launch):
# Llama debug at T = 8192 (model.context_length raised to it), 2 sequences
# per step, 6 steps, on one rank (cp 1), on 4 ranks as cp 4, cp 2 x
# dp_shard 2 and cp 2 x tp 2 (ring), and on 2 ranks as cp 2 in the
# all-to-all style; every loss against the one rank's (relative
# difference); a checkpoint saved at step 3 of a cp 4 run resumed at cp 2
# (2 ranks) and cp 1 (1 rank), steps 4-6 against the uninterrupted run's;
# each run's peak activation and attention memory per rank (fsdpp's
# allocator) and its plan.
#
#   bash tools/bench/context_parallel.sh [SEQ] [OUT.json]   (default 8192)
#
# Figures go to docs/PERFORMANCE.md ("Context parallelism").
set -euo pipefail
cd "$(dirname "$0")/../.."
seq="${1:-8192}"
json="${2:-}"
bazel build -c opt //trainer:train 2>/dev/null
train="$PWD/bazel-out/k8-opt/bin/trainer/train"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
common=(model.name=llama_debug model.context_length="$seq"
  training.seq_len="$seq" training.global_batch=2 training.micro_batch=1
  training.steps=6 training.warmup_steps=2 checkpoint.interval=3
  checkpoint.resume=true validation.interval=0 metrics.log_interval=1
  metrics.trace_steps=0)

# run NAME WORLD DIR [--stop_after_steps N] [key=value ...]
run() {
  local name=$1 world=$2 dir=$3
  shift 3
  local flags=()
  for kv in "${common[@]}" "$@"; do
    case $kv in --*) flags+=("$kv") ;; *) flags+=(--set="$kv") ;; esac
  done
  mkdir -p "$dir"
  (cd "$dir" && OMP_NUM_THREADS=$((world > 1 ? 1 : 2)) "$train" \
    --nproc_per_node="$world" "${flags[@]}" >"$out/$name.log" 2>&1) || {
    echo "$name: the trainer failed:" >&2
    tail -5 "$out/$name.log" >&2
    exit 1
  }
}

run cp1 1 "$out/cp1"
run cp4 4 "$out/cp4" parallelism.cp=4
run cp2_dp2 4 "$out/cp2_dp2" parallelism.cp=2
run cp2_tp2 4 "$out/cp2_tp2" parallelism.cp=2 parallelism.tp=2
run cp2_a2a 2 "$out/cp2_a2a" parallelism.cp=2 parallelism.cp_style=alltoall
run stop_cp4 4 "$out/resume" parallelism.cp=4 --stop_after_steps=3
cp -r "$out/resume" "$out/resume1"
run resume_cp2 2 "$out/resume" parallelism.cp=2
run resume_cp1 1 "$out/resume1"

python3 - "$out" "$seq" "$json" <<'EOF'
import json, re, sys
out, seq, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]

def losses(d):
    with open(f"{out}/{d}/fsdpp_run/metrics.jsonl") as f:
        rows = [json.loads(l) for l in f]
    return {r["step"]: r["loss"] for r in rows if r.get("kind") == "train"}

def memory(name):
    text = open(f"{out}/{name}.log").read()
    def last(label):
        rows = re.findall(label + r"\s+([0-9. ]+)\n", text)
        return max(float(v) for v in rows[-1].split())
    peak = re.search(r"Peak memory/rank:\s+([0-9.]+) MiB \(planned ([0-9.]+)",
                     text)
    return {"activations_mib": last("Peak activations"),
            "attention_mib": last("Peak attention"),
            "peak_mib": float(peak.group(1)),
            "planned_mib": float(peak.group(2))}

want = losses("cp1")
result = {"seq_len": seq, "model": "llama_debug", "runs": {}}
print(f"Llama debug, T = {seq}, 2 sequences/step, 6 steps")
print(f"{'run':<22}{'worst rel. loss diff':>22}{'act+attn MiB':>14}"
      f"{'peak MiB':>10}{'planned':>9}")
for name, d in [("cp1", "cp1"), ("cp4", "cp4"), ("cp2_dp2", "cp2_dp2"),
                ("cp2_tp2", "cp2_tp2"), ("cp2_a2a", "cp2_a2a"),
                ("resume_cp2", "resume"),
                ("resume_cp1", "resume1")]:
    got = losses(d)
    steps = sorted(got)
    worst = max(abs(got[s] - want[s]) / want[s] for s in steps)
    m = memory(name)
    result["runs"][name] = dict(m, losses=[got[s] for s in steps],
                                steps=steps, worst_relative=worst)
    print(f"{name:<22}{worst:>22.2e}"
          f"{m['activations_mib'] + m['attention_mib']:>14.1f}"
          f"{m['peak_mib']:>10.1f}{m['planned_mib']:>9.1f}")
one, four = result["runs"]["cp1"], result["runs"]["cp4"]
ratio = ((four["activations_mib"] + four["attention_mib"]) /
         (one["activations_mib"] + one["attention_mib"]))
result["cp4_over_cp1_activations_attention"] = ratio
print(f"activations + attention per rank, cp 4 / cp 1: {ratio:.3f}")
if path:
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
EOF
