#!/usr/bin/env bash
# The demo trains to below the unigram baseline and prints the memory table.
set -euo pipefail
out=$(tools/demo/demo)
echo "$out"
grep -q "(learned)" <<< "$out"
grep -q "^params" <<< "$out"
