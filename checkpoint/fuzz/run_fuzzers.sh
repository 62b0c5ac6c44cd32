#!/usr/bin/env bash
# Builds the checkpoint fuzz entry points (checkpoint/metadata_fuzz.cc and
# formats/safetensors/safetensors_fuzz.cc) as libFuzzer binaries with clang++, outside
# Bazel, runs each for a bounded time from seed corpora, and writes a
# JUnit-style XML report with one test case per fuzzer: passed when the
# fuzzer exits 0, otherwise a <failure> holding the tail of its log (with the
# crash reproducer's path). Prints one summary line per fuzzer. Run by
# .ci/run; see checkpoint/README.md, "Fuzzing with libFuzzer".
#
# Usage: checkpoint/fuzz/run_fuzzers.sh REPORT.xml
#   FUZZ_SECONDS  seconds per fuzzer (default 60); the two run concurrently.
#   FUZZ_CXX      the compiler (default clang++).
#   FUZZ_WORKDIR  keep the build (bin/), seeds and grown corpora (NAME/corpus)
#                 there instead of in a temporary directory; reusing it
#                 resumes from the corpora.
# Seeds: valid files like the *_fuzz_test seeds, written by write_seeds.cc.
# Crash reproducers are kept in fuzz-artifacts/ next to REPORT.xml. A missing
# clang++, libFuzzer or protoc is an error, not a skip.
set -euo pipefail

if (( $# != 1 )); then
  echo "usage: $0 REPORT.xml" >&2
  exit 2
fi
report=$(realpath -m "$1")
seconds=${FUZZ_SECONDS:-60}
cxx=${FUZZ_CXX:-clang++}
if ! [[ "$seconds" =~ ^[1-9][0-9]*$ ]]; then
  echo "fuzz: FUZZ_SECONDS must be a positive integer, not '$seconds'" >&2
  exit 2
fi
if [[ -n "${FUZZ_WORKDIR:-}" ]]; then
  work=$(realpath -m "$FUZZ_WORKDIR")
  mkdir -p "$work"
  rm -f "$work/compile_failed"
else
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
fi
cd "$(dirname "$0")/../.."

fuzzers=(metadata_fuzz safetensors_fuzz)
artifacts="$(dirname "$report")/fuzz-artifacts"
rm -f "$report"
mkdir -p "$(dirname "$report")"

# XML text: printable ASCII only, markup escaped.
xml_escape() {
  LC_ALL=C tr -cd '\11\12\15\40-\176' |
    sed -e 's/&/\&amp;/g' -e 's/</\&lt;/g' -e 's/>/\&gt;/g' -e 's/"/\&quot;/g'
}

# Appends one <testcase> to $work/cases: NAME SECONDS [MESSAGE DETAILS_FILE].
add_case() {
  local name=$1 time=$2
  {
    printf '    <testcase classname="checkpoint.fuzz" name="%s" time="%s"' \
      "$name" "$time"
    if (( $# == 2 )); then
      printf '/>\n'
    else
      printf '>\n      <failure message="%s">' "$(xml_escape <<< "$3")"
      xml_escape < "$4"
      printf '</failure>\n    </testcase>\n'
    fi
  } >> "$work/cases"
}

write_report() {
  local tests failures
  tests=$(grep -c '<testcase' "$work/cases" || true)
  failures=$(grep -c '<failure' "$work/cases" || true)
  {
    printf '<?xml version="1.0" encoding="UTF-8"?>\n'
    printf '<testsuites tests="%s" failures="%s">\n' "$tests" "$failures"
    printf '  <testsuite name="checkpoint_fuzz" tests="%s" failures="%s">\n' \
      "$tests" "$failures"
    cat "$work/cases"
    printf '  </testsuite>\n</testsuites>\n'
  } > "$work/report.xml"
  mv "$work/report.xml" "$report"
}

# Fails every fuzzer with MESSAGE and DETAILS_FILE's tail, writes the
# report and exits 1.
fail_all() {
  local message=$1 details=$2 name
  echo "fuzz: error: $message" >&2
  tail -n 40 "$details" >&2 || true
  tail -n 40 "$details" > "$work/details" || true
  : > "$work/cases"
  for name in "${fuzzers[@]}"; do
    add_case "$name" 0 "$message" "$work/details"
  done
  write_report
  exit 1
}

: > "$work/cases"
: > "$work/empty"
if ! command -v "$cxx" > /dev/null; then
  fail_all "$cxx not found: install clang (tools/setup.sh lists it)" \
    "$work/empty"
fi
if ! command -v protoc > /dev/null; then
  fail_all "protoc not found: install protobuf-compiler" "$work/empty"
fi
# libFuzzer and the sanitizer runtimes (clang's compiler-rt) link?
echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*,' \
  'unsigned long) { return 0; }' > "$work/probe.cc"
if ! "$cxx" -fsanitize=fuzzer,address,undefined "$work/probe.cc" \
    -o "$work/probe" > "$work/probe.log" 2>&1; then
  fail_all "$cxx cannot link -fsanitize=fuzzer,address,undefined: libFuzzer or \
the sanitizer runtimes are missing (Debian: libclang-rt-dev)" "$work/probe.log"
fi

# Abseil: the libraries of //third_party:absl.BUILD's "absl" target.
mapfile -t absl_libs < <(sed -n '/name = "absl"/,/^)/p' third_party/absl.BUILD |
  grep -o -- '-labsl_[a-z0-9_]*' || true)
if (( ${#absl_libs[@]} == 0 )); then
  fail_all "no -labsl_* flags found in third_party/absl.BUILD" "$work/empty"
fi

# -fno-sanitize-recover: UBSan findings abort, so libFuzzer reports them.
cxxflags=(-std=c++17 -O1 -g "-fsanitize=fuzzer,address,undefined"
  -fno-sanitize-recover=all -I. -I"$work/gen")
common=(core/allocator.cc core/device.cc core/dtype.cc core/logging.cc
  core/memcpy.cc core/status.cc tensor/tensor.cc)
metadata=(checkpoint/metadata.cc checkpoint/boxes.cc checkpoint/crc32c.cc
  formats/file_util.cc "$work/gen/checkpoint/metadata.pb.cc")
safetensors=(formats/json.cc formats/safetensors/safetensors.cc core/json_quote.cc)
sources=("${common[@]}" "${metadata[@]}" "${safetensors[@]}"
  checkpoint/metadata_fuzz.cc formats/safetensors/safetensors_fuzz.cc
  checkpoint/fuzz/write_seeds.cc formats/safetensors/safetensors_seeds.cc)

started=$(date +%s)
mkdir -p "$work/gen" "$work/obj" "$work/bin"
if ! protoc --proto_path=. --cpp_out="$work/gen" checkpoint/metadata.proto \
    > "$work/protoc.log" 2>&1; then
  fail_all "protoc failed on checkpoint/metadata.proto" "$work/protoc.log"
fi

obj() { echo "$work/obj/$(basename "${1%.cc}").o"; }

# Every source once, as many at a time as there are cores.
jobs_max=$(nproc)
for src in "${sources[@]}"; do
  while (( $(jobs -rp | wc -l) >= jobs_max )); do wait -n || true; done
  ( "$cxx" "${cxxflags[@]}" -c "$src" -o "$(obj "$src")" \
      > "$(obj "$src").log" 2>&1 || echo "$src" >> "$work/compile_failed" ) &
done
wait
if [[ -s "$work/compile_failed" ]]; then
  first=$(head -n 1 "$work/compile_failed")
  fail_all "compiling $first failed" "$(obj "$first").log"
fi

link() {  # OUTPUT SANITIZERS SOURCES...
  local out=$1 sanitize=$2 src objs=()
  shift 2
  for src in "$@"; do objs+=("$(obj "$src")"); done
  if ! "$cxx" -fsanitize="$sanitize" "${objs[@]}" -lprotobuf "${absl_libs[@]}" \
      -lpthread -o "$work/bin/$out" > "$work/bin/$out.log" 2>&1; then
    fail_all "linking $out failed" "$work/bin/$out.log"
  fi
}
link metadata_fuzz fuzzer,address,undefined checkpoint/metadata_fuzz.cc \
  "${metadata[@]}" "${common[@]}"
link safetensors_fuzz fuzzer,address,undefined formats/safetensors/safetensors_fuzz.cc \
  "${safetensors[@]}" "${common[@]}"
# Has its own main(): the sanitizers without libFuzzer's.
link write_seeds address,undefined checkpoint/fuzz/write_seeds.cc \
  formats/safetensors/safetensors_seeds.cc "${metadata[@]}" "${safetensors[@]}" \
  "${common[@]}"
echo "fuzz: built ${fuzzers[*]} with $("$cxx" --version | head -n 1)" \
  "in $(( $(date +%s) - started )) s"

mkdir -p "$work/seeds/metadata_fuzz" "$work/seeds/safetensors_fuzz"
if ! "$work/bin/write_seeds" "$work/seeds/metadata_fuzz" \
    "$work/seeds/safetensors_fuzz" > "$work/seeds.log" 2>&1; then
  fail_all "write_seeds failed" "$work/seeds.log"
fi

# Runs fuzzer NAME; leaves its log, exit code and wall time in $work/NAME/.
run_fuzzer() {
  local name=$1 dir="$work/$1" begin end rc=0
  mkdir -p "$dir/corpus" "$artifacts"
  begin=$(date +%s%N)
  UBSAN_OPTIONS=print_stacktrace=1 timeout -k 10 $(( seconds + 120 )) \
    "$work/bin/$name" -max_total_time="$seconds" -max_len=4096 -timeout=10 \
    -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$artifacts/$name-" "$dir/corpus" "$work/seeds/$name" \
    > "$dir/log" 2>&1 || rc=$?
  end=$(date +%s%N)
  echo "$rc" > "$dir/rc"
  echo "$(( (end - begin) / 1000000 ))" > "$dir/ms"
}

for name in "${fuzzers[@]}"; do run_fuzzer "$name" & done
wait

# The last match of sed script SCRIPT in the log of fuzzer $name.
last() { sed -n "$1" "$work/$name/log" | tail -n 1; }

: > "$work/cases"
failed=0
for name in "${fuzzers[@]}"; do
  dir="$work/$name"
  rc=$(cat "$dir/rc")
  ms=$(cat "$dir/ms")
  time=$(printf '%d.%03d' $(( ms / 1000 )) $(( ms % 1000 )))
  execs=$(last 's/^stat::number_of_executed_units: *//p')
  if [[ -z "$execs" ]]; then  # No final stats: the last "#N ..." status line.
    execs=$(last 's/^#\([0-9][0-9]*\).*/\1/p')
  fi
  execs=${execs:-0}
  cov=$(last 's/.* cov: \([0-9]*\) .*/\1/p')
  corpus=$(last 's/.* corp: \([0-9]*\)\/.*/\1/p')
  seeds=$(find "$work/seeds/$name" -type f | wc -l)
  stats="$execs executions in $time s"
  stats+=" ($(( execs * 1000 / (ms > 0 ? ms : 1) ))/s), coverage ${cov:-?},"
  stats+=" corpus ${corpus:-?} from $seeds seeds"
  if (( rc == 0 )); then
    echo "fuzz: $name: passed: $stats"
    add_case "$name" "$time"
  else
    failed=1
    reproducer=$(last 's/.*Test unit written to \(.*\)$/\1/p')
    if (( rc == 124 )); then
      message="$name timed out (stopped after $(( seconds + 120 )) s)"
    elif (( rc > 128 )); then
      message="$name killed by signal $(( rc - 128 ))"
    else
      message="$name exited $rc"
    fi
    [[ -z "$reproducer" ]] || message="$message; reproducer: $reproducer"
    echo "fuzz: $name: FAILED: $message: $stats"
    tail -n 60 "$dir/log" | sed 's/^/  /'
    tail -n 60 "$dir/log" > "$dir/tail"
    add_case "$name" "$time" "$message" "$dir/tail"
  fi
done
rmdir "$artifacts" 2> /dev/null || true
write_report
echo "fuzz: report: $report"
exit $failed
