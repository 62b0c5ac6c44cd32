#!/usr/bin/env bash
# The test suite under the sanitizers (CI runs this; so can anyone):
#   asan: every test under AddressSanitizer + UndefinedBehaviorSanitizer
#         (--config=asan: leaks and undefined behaviour fail the test),
#         except those tagged no_asan (each says why in its BUILD file;
#         docs/TESTING.md lists them); with --cuda
#         (CI, where the CUDA toolkit is present) built with --config=cuda,
#         so that one build both checks the CUDA configuration and runs the
#         suite (CUDA tests skip visibly without a GPU);
#   tsan: the tests of the concurrency code (core streams, comm backends and
#         stores, the launcher and its elastic rendezvous, fsdp, the
#         pipeline runner, the asynchronous checkpoint saver) under
#         ThreadSanitizer (--config=tsan), except those tagged no_tsan.
# Each sanitizer builds in its own output tree (.bazelrc's platform_suffix),
# so the plain build's cache stays warm, and builds only the tests it runs
# (--build_tests_only: the benchmarks and tools are not rebuilt).
#
# Usage: tools/sanitizers.sh [--out=DIR] [--cuda] [asan] [tsan]
#        (default: both)
# Writes DIR/<name>.log (the `bazel test` output) and DIR/<name>.testlogs
# (the path of its test.xml folder) for .ci/count_tests.py --extra-log.
# Exit status: 0 when every selected run passed.
set -uo pipefail
cd "$(dirname "$0")/.."

out=""
cuda=()
runs=()
for arg in "$@"; do
  case "$arg" in
    --out=*) out=${arg#--out=} ;;
    --cuda) cuda=(--config=cuda) ;;
    asan | tsan) runs+=("$arg") ;;
    *)
      echo "sanitizers: unknown argument '$arg'" >&2
      echo "usage: tools/sanitizers.sh [--out=DIR] [--cuda] [asan] [tsan]" >&2
      exit 2
      ;;
  esac
done
[[ ${#runs[@]} -gt 0 ]] || runs=(asan tsan)
[[ -n "$out" ]] || out=$(mktemp -d)
mkdir -p "$out"

tsan_targets=(//core/... //comm/... //runtime/... //fsdp/... //parallel/...
  //checkpoint/...)

status=0
for run in "${runs[@]}"; do
  start=$SECONDS
  case "$run" in
    asan) args=(--config=asan "${cuda[@]}" --test_tag_filters=-no_asan -- //...) ;;
    tsan) args=(--config=tsan --test_tag_filters=-no_tsan -- "${tsan_targets[@]}") ;;
  esac
  echo "sanitizers: bazel test --keep_going --build_tests_only ${args[*]}"
  bazel test --keep_going --build_tests_only "${args[@]}" 2>&1 | grep -v '^INFO:' |
    tee "$out/$run.log" | grep -E '^//|FAIL|ERROR' | grep -v ' PASSED in '
  rc=${PIPESTATUS[0]}
  # The folder of this run's test.xml files (bazel-testlogs points there now).
  readlink -f bazel-testlogs >"$out/$run.testlogs"
  echo "sanitizers: $run finished in $((SECONDS - start)) s (bazel exit $rc)"
  [[ $rc -eq 0 ]] || status=1
done
exit $status
