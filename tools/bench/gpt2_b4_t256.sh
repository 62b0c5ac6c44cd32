# Sourced by the 2-core trainer benchmarks (thread_placement.sh,
# two_ranks.sh, wait_policy.sh): their arguments' checks and the GPT-2 124M
# run they time (B = 4, T = 256, 8 steps, 3 of them warm-up, nothing saved
# or validated).

# bench_init NAME [DTYPE] [ROUNDS]: goes to the repository's root and sets
# dtype (bf16) and rounds (1), or exits 2 with a message naming NAME unless
# DTYPE is bf16 or f32 and ROUNDS an integer >= 1; then builds the opt
# trainer and sets log to a temporary file, removed on exit.
bench_init() {
  cd "$(dirname "${BASH_SOURCE[0]}")/../.."
  dtype="${2:-bf16}"
  rounds="${3:-1}"
  [[ "$dtype" == bf16 || "$dtype" == f32 ]] || {
    echo "$1: dtype '$dtype' is not bf16 or f32" >&2
    exit 2
  }
  [[ "$rounds" =~ ^[0-9]+$ && "$rounds" -ge 1 ]] || {
    echo "$1: rounds must be an integer >= 1" >&2
    exit 2
  }
  bazel build -c opt //trainer:train 2>/dev/null
  log="$(mktemp)"
  trap 'rm -f "$log"' EXIT
}

# gpt2_run RANKS DTYPE [--set KEY=VALUE...]: the trainer's run over RANKS
# ranks of one thread each (one rank: two threads) on stdout and stderr,
# under the trainer's own OpenMP wait policies (ACTIVE in-process, PASSIVE
# for launched ranks) unless GPT2_WAIT_POLICY names one.
gpt2_run() {
  local ranks=$1 dtype=$2
  shift 2
  local policy=(-u OMP_WAIT_POLICY)
  [[ -n "${GPT2_WAIT_POLICY:-}" ]] && policy=("OMP_WAIT_POLICY=$GPT2_WAIT_POLICY")
  env "${policy[@]}" timeout 900 \
    "$PWD/bazel-out/k8-opt/bin/trainer/train" \
    --config="$PWD/trainer/configs/gpt2_124m.textproto" \
    --nproc_per_node="$ranks" \
    --set training.steps=8 --set training.warmup_steps=2 \
    --set training.global_batch=4 --set training.micro_batch=$((4 / ranks)) \
    --set training.seq_len=256 \
    --set training.mixed_precision.param_dtype="$dtype" \
    --set checkpoint.interval=0 --set checkpoint.resume=false \
    --set validation.interval=0 --set metrics.throughput_warmup_steps=3 \
    --set metrics.jsonl_path= "$@"
}
