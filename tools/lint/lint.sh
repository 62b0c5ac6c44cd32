#!/usr/bin/env bash
# The format checks CI runs: clang-format (Google style, .clang-format) on
# C++ and CUDA sources and tools/lint/build_lint.py (a buildifier
# equivalent) on Bazel files, over every tracked file, or with --base REV
# over the files changed since REV. Prints each problem, then one line
# "lint: N file(s) checked, M with problems"; exits 1 if M > 0.
#
#   tools/lint/lint.sh                 # the whole tree (CI)
#   tools/lint/lint.sh --base HEAD~3   # what the last three commits touched
#   tools/lint/lint.sh --fix           # rewrite instead of report
set -uo pipefail
cd "$(dirname "$0")/../.."
base=""
fix=0
while (( $# > 0 )); do
  case "$1" in
    --base=*) base="${1#--base=}" ;;
    --base) base="${2:-}"; shift ;;
    --fix) fix=1 ;;
    *) echo "usage: lint.sh [--base REV] [--fix]" >&2; exit 2 ;;
  esac
  shift
done
if [[ -n "$base" ]]; then
  files=$(git diff --name-only --diff-filter=d "$base" --)
else
  files=$(git ls-files)
fi
cxx=$(grep -E '\.(cc|h|cu|cuh)$' <<< "$files" | grep -v '^third_party/' || true)
bazel_files=$(grep -E '(^|/)(BUILD|WORKSPACE)$|\.bzl$' <<< "$files" || true)
if ! command -v clang-format > /dev/null; then
  echo "lint: clang-format not found (tools/setup.sh installs it)" >&2
  exit 1
fi
bad=0
checked=0
for f in $cxx; do
  checked=$((checked + 1))
  if (( fix )); then clang-format -i --style=file "$f"; continue; fi
  if [[ -n "$(clang-format --style=file --dry-run "$f" 2>&1 | head -1)" ]]; then
    echo "$f: not clang-formatted (clang-format -i --style=file $f)"
    bad=$((bad + 1))
  fi
done
if [[ -n "$bazel_files" ]]; then
  checked=$((checked + $(wc -w <<< "$bazel_files")))
  fix_flag=()
  (( fix )) && fix_flag=(--fix)
  # shellcheck disable=SC2086
  findings=$(python3 tools/lint/build_lint.py "${fix_flag[@]}" $bazel_files)
  if [[ -n "$findings" ]]; then
    echo "$findings"
    bad=$((bad + $(cut -d: -f1 <<< "$findings" | sort -u | wc -l)))
  fi
fi
echo "lint: $checked file(s) checked, $bad with problems"
(( bad == 0 ))
