#!/usr/bin/env bash
# Runs plot.py with Debian's Python (/usr/bin/python3, which has
# python3-matplotlib from tools/setup.sh), not whatever python3 is first on
# PATH. Usage: bazel run //tools/plot -- metrics.jsonl [--out loss.png]
set -euo pipefail

# plot.py is a runfile of this script: under `bazel run` / bazel-bin it is in
# "$0.runfiles/fsdpp/...", when run as another target's data (a test) in
# $RUNFILES_DIR or $TEST_SRCDIR, and in the runfiles tree it also sits next
# to this script.
py=""
for candidate in \
    "$0.runfiles/fsdpp/tools/plot/plot.py" \
    "${RUNFILES_DIR:-/nonexistent}/fsdpp/tools/plot/plot.py" \
    "${TEST_SRCDIR:-/nonexistent}/fsdpp/tools/plot/plot.py" \
    "$(dirname "$0")/plot.py"; do
  if [[ -f "$candidate" ]]; then
    py="$(cd "$(dirname "$candidate")" && pwd)/plot.py"
    break
  fi
done
if [[ -z "$py" ]]; then
  echo "plot: error: cannot find plot.py in the runfiles of $0" >&2
  exit 1
fi

# `bazel run` starts us in the runfiles tree; relative paths on the command
# line mean the directory the user ran bazel from.
if [[ -n "${BUILD_WORKING_DIRECTORY:-}" ]]; then
  cd "$BUILD_WORKING_DIRECTORY"
fi
exec /usr/bin/python3 "$py" "$@"
