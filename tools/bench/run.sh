#!/usr/bin/env bash
# Runs every benchmark of the tree (the Bazel targets tagged "benchmark") and
# writes one Google Benchmark JSON file per binary.
#
#   tools/bench/run.sh [--smoke] [--out=DIR] [--filter=TEXT] [--junit=FILE]
#
#   (default)     tracking mode: builds with -c opt, runs each Google
#                 Benchmark binary with 5 repetitions of >= 0.2 s, and writes
#                 DIR/<package>__<name>.json (DIR defaults to
#                 ./bench_out/<date>). Compare two runs with
#                 tools/bench/compare.sh BASELINE_DIR DIR.
#   --smoke       CI mode: the build configuration already in use, one
#                 iteration of every case at its smallest size, so that no
#                 benchmark rots; the JSON is written but means nothing.
#   --filter=TEXT only the targets whose label contains TEXT.
#   --junit=FILE  also write one JUnit test case per benchmark binary (pass
#                 or fail) to FILE, for .ci/count_tests.py.
#
# Binaries that are not Google Benchmark (commbench's nccl-tests table, the
# end-to-end tools/bench:fsdp_benchmark) run in their own smallest form in
# --smoke mode and are skipped in tracking mode (run them by hand; see
# docs/PERFORMANCE.md). A new non-Google-Benchmark binary must be added to
# the case below, or the smoke run fails on the unknown --benchmark_* flags.
#
# Exit status: 0 when every binary ran and exited 0, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/../.."

smoke=0
out=""
filter=""
junit=""
for arg in "$@"; do
  case "$arg" in
    --smoke) smoke=1 ;;
    --out=*) out="${arg#--out=}" ;;
    --filter=*) filter="${arg#--filter=}" ;;
    --junit=*) junit="${arg#--junit=}" ;;
    -h | --help)
      sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'
      exit 0
      ;;
    *)
      echo "run.sh: unknown argument '$arg' (see --help)" >&2
      exit 2
      ;;
  esac
done
[[ -n "$out" ]] || out="bench_out/$(date +%Y%m%d-%H%M%S)"
mkdir -p "$out" || exit 1
out=$(cd "$out" && pwd)

bazel_flags=()
[[ $smoke -eq 1 ]] || bazel_flags=(-c opt)

mapfile -t targets < <(bazel query 'attr(tags, benchmark, //...)' 2>/dev/null |
  grep -F -- "$filter" | sort)
if [[ ${#targets[@]} -eq 0 ]]; then
  echo "run.sh: no benchmark targets match '$filter'" >&2
  exit 1
fi
echo "run.sh: ${#targets[@]} benchmark binaries -> $out"
bazel build "${bazel_flags[@]}" "${targets[@]}" || exit 1
bin_dir=$(bazel info "${bazel_flags[@]}" bazel-bin 2>/dev/null) || exit 1

status=0
cases=""
for target in "${targets[@]}"; do
  rel=${target#//}
  binary="$bin_dir/${rel/://}"
  name=${rel//\//_}
  name=${name/:/__}
  gbench=1
  args=()
  env_vars=()
  case "$target" in
    //comm:commbench)
      gbench=0
      args=(--min_bytes=1024 --max_bytes=65536 --rounds=1
        --seconds_per_size=0.01)
      ;;
    //tools/bench:fsdp_benchmark)
      gbench=0
      args=(--model=gpt2_debug --steps=1 --warmup=0)
      ;;
    //checkpoint:checkpoint_benchmark)
      [[ $smoke -eq 1 ]] && env_vars=(FSDPP_CKPT_BENCH_MB=16)
      ;;
  esac
  if [[ $gbench -eq 0 && $smoke -eq 0 ]]; then
    echo "run.sh: $target is not a Google Benchmark binary; skipped"
    continue
  fi
  if [[ $gbench -eq 1 ]]; then
    args=(--benchmark_out="$out/$name.json" --benchmark_out_format=json)
    if [[ $smoke -eq 1 ]]; then
      args+=(--benchmark_min_time=0)
    else
      args+=(--benchmark_min_time=0.2 --benchmark_repetitions=5)
    fi
  fi
  echo "=== $target"
  start=$SECONDS
  # Every benchmark bounds its own waits; the timeout is the last resort
  # against a hang in the harness itself.
  env "${env_vars[@]}" timeout 1200 "$binary" "${args[@]}" \
    > "$out/$name.log" 2>&1
  rc=$?
  elapsed=$((SECONDS - start))
  if [[ $rc -eq 0 ]]; then
    echo "    ok (${elapsed} s)"
    cases+="<testcase classname=\"benchmarks\" name=\"$target\" time=\"$elapsed\"/>"
  else
    status=1
    echo "    FAILED (exit $rc, ${elapsed} s); last lines of $out/$name.log:"
    tail -n 20 "$out/$name.log" | sed 's/^/    /'
    cases+="<testcase classname=\"benchmarks\" name=\"$target\" time=\"$elapsed\"><failure message=\"exit $rc\"/></testcase>"
  fi
done

if [[ -n "$junit" ]]; then
  printf '<testsuites><testsuite name="benchmarks">%s</testsuite></testsuites>\n' \
    "$cases" > "$junit"
fi
exit $status
