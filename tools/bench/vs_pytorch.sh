#!/usr/bin/env bash
# fsdpp against PyTorch on the same GPT-2 124M training step, side by side
# in one run: B=4 sequences of T=256 tokens, forward + backward + clipping +
# AdamW, on 2 cores, in f32 and in bf16 (fsdpp: param_dtype bf16 with f32
# masters and f32 reduction; PyTorch: torch.autocast(cpu, bfloat16)).
#
#   tools/bench/vs_pytorch.sh [--rounds=2] [--steps=4] [--warmup=2]
#                             [--dtypes="bf16 f32"]
#
# Each round runs, per dtype and in this order: fsdpp's trainer (1 rank x 2
# threads), fsdpp's trainer (2 ranks x 1 thread, ZeRO-3), and the PyTorch
# script tools/bench/pytorch_gpt2_step.py (2 threads) -- so the machine's
# drift hits every contender alike. Each reports the median of its measured
# steps (after `warmup` steps); the table gives, per dtype, the median over
# rounds and the ratios fsdpp / PyTorch (lower is faster) and 2x1 / 1x2.
# The 1 x 2 trainer runs itself under OMP_WAIT_POLICY=ACTIVE (spinning
# OpenMP workers) and the ranks it launches under PASSIVE; PyTorch's
# process gets ACTIVE too, so that both single processes wait alike.
#
# PyTorch is Debian's python3-torch 1.13 run by /usr/bin/python3; its f32
# matmuls use the system BLAS, which must be OpenBLAS (libopenblas0-openmp,
# installed by tools/setup.sh) for the comparison to mean anything.
set -euo pipefail
cd "$(dirname "$0")/../.."

rounds=2
steps=4
warmup=2
dtypes="bf16 f32"
for arg in "$@"; do
  case "$arg" in
    --rounds=*) rounds="${arg#--rounds=}" ;;
    --steps=*) steps="${arg#--steps=}" ;;
    --warmup=*) warmup="${arg#--warmup=}" ;;
    --dtypes=*) dtypes="${arg#--dtypes=}" ;;
    -h | --help)
      sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'
      exit 0
      ;;
    *)
      echo "vs_pytorch.sh: unknown argument '$arg' (see --help)" >&2
      exit 2
      ;;
  esac
done
for n in "$rounds" "$steps" "$warmup"; do
  [[ "$n" =~ ^[0-9]+$ && "$n" -ge 1 ]] || {
    echo "vs_pytorch.sh: rounds, steps and warmup must be integers >= 1" >&2
    exit 2
  }
done
for dtype in $dtypes; do
  [[ "$dtype" == bf16 || "$dtype" == f32 ]] || {
    echo "vs_pytorch.sh: dtype '$dtype' is not bf16 or f32" >&2
    exit 2
  }
done
blas=$(readlink -f /usr/lib/x86_64-linux-gnu/libblas.so.3 || true)
if [[ "$blas" != *openblas* ]]; then
  echo "vs_pytorch.sh: the system BLAS is '$blas', not OpenBLAS: install" \
    "libopenblas0-openmp (tools/setup.sh does) or PyTorch's f32 is" \
    "meaningless" >&2
  exit 1
fi

# OpenBLAS 0.3.21 falls back to its generic SSE3 kernels ("Prescott") on a
# CPU model it does not know (seen: an Intel Xeon of family 6, model 207,
# 47 GFLOP/s on 2 threads where its Cooperlake kernels give ~230), which
# would make PyTorch's f32 a straw man: then this script names the kernels
# for the CPU's ISA itself (OPENBLAS_CORETYPE; one the user set is kept).
if [[ -z "${OPENBLAS_CORETYPE:-}" ]]; then
  core=$(OPENBLAS_VERBOSE=2 /usr/bin/python3 -c 'import torch; torch.ones(2, 2) @ torch.ones(2, 2)' 2>&1 |
    sed -n 's/^Core: //p' | head -1)
  if [[ "$core" == Prescott ]]; then
    flags=$(grep -m1 '^flags' /proc/cpuinfo)
    case "$flags" in
      *avx512_bf16*) export OPENBLAS_CORETYPE=Cooperlake ;;
      *avx512f*) export OPENBLAS_CORETYPE=SkylakeX ;;
      *avx2*) export OPENBLAS_CORETYPE=Haswell ;;
    esac
  fi
fi
echo "vs_pytorch.sh: PyTorch's OpenBLAS kernels:"   "${OPENBLAS_CORETYPE:-its own choice${core:+ ($core)}}"   "${OPENBLAS_CORETYPE:+(OPENBLAS_CORETYPE)}" >&2

bazel build -c opt //trainer:train >/dev/null 2>&1 || {
  echo "vs_pytorch.sh: bazel build -c opt //trainer:train failed" >&2
  exit 1
}
train=$(pwd)/bazel-bin/trainer/train
config=$(pwd)/trainer/configs/gpt2_124m.textproto
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
results="$work/results.tsv"

# Median of the step times after the warm-up in a trainer's metrics JSONL.
median_step() {
  /usr/bin/python3 - "$1" "$warmup" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
t = [r["step_time_s"] for r in rows
     if r.get("kind") == "train" and r["step"] > int(sys.argv[2])]
print(statistics.median(t))
EOF
}

# fsdpp's trainer: DTYPE NPROC.
run_fsdpp() {
  local dir="$work/fsdpp_$1_$2_$round"
  mkdir -p "$dir"
  (cd "$dir" && env -u OMP_WAIT_POLICY "$train" --config="$config" --nproc_per_node="$2" \
    --set training.steps=$((warmup + steps)) \
    --set training.global_batch=4 \
    --set training.micro_batch=$((4 / $2)) \
    --set training.seq_len=256 \
    --set training.warmup_steps=0 \
    --set training.mixed_precision.param_dtype="$1" \
    --set metrics.log_interval=1 \
    --set metrics.jsonl_path="$dir/metrics.jsonl" \
    --set checkpoint.interval=0 \
    --set checkpoint.folder="$dir/ckpt" \
    --set validation.interval=0 >"$dir/log" 2>&1) || {
    echo "vs_pytorch.sh: fsdpp $1 ${2}x$((2 / $2)) failed; its log:" >&2
    tail -20 "$dir/log" >&2
    exit 1
  }
  median_step "$dir/metrics.jsonl"
}

run_pytorch() {
  OMP_WAIT_POLICY=ACTIVE /usr/bin/python3 tools/bench/pytorch_gpt2_step.py --dtype="$1" \
    --threads=2 --steps="$steps" --warmup="$warmup" |
    /usr/bin/python3 -c 'import json,sys; print(json.load(sys.stdin)["median_step_s"])'
}

for round in $(seq 1 "$rounds"); do
  for dtype in $dtypes; do
    a=$(run_fsdpp "$dtype" 1)
    b=$(run_fsdpp "$dtype" 2)
    c=$(run_pytorch "$dtype")
    printf '%s\t%s\t%s\t%s\t%s\n' "$round" "$dtype" "$a" "$b" "$c" |
      tee -a "$results" >&2
  done
done

/usr/bin/python3 - "$results" <<'EOF'
import statistics, sys
rows = [l.split("\t") for l in open(sys.argv[1]).read().split("\n") if l]
print("GPT-2 124M, B=4 T=256, fwd+bwd+clip+AdamW, 2 cores; seconds per step")
print("(median over rounds of each run's median step)")
print(f"{'dtype':6}{'fsdpp 1x2':>11}{'fsdpp 2x1':>11}{'PyTorch':>10}"
      f"{'1x2/PT':>9}{'2x1/PT':>9}{'2x1/1x2':>9}")
for dtype in dict.fromkeys(r[1] for r in rows):
    a, b, c = (statistics.median(float(r[i]) for r in rows if r[1] == dtype)
               for i in (2, 3, 4))
    print(f"{dtype:6}{a:11.3f}{b:11.3f}{c:10.3f}{a / c:9.3f}{b / c:9.3f}"
          f"{b / a:9.3f}")
EOF
