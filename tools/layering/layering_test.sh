#!/usr/bin/env bash
# Runs layering_check.py on every package's dependencies file (see BUILD),
# after its self-test. The source root is found through the runfiles link of
# floors.bzl, to notice packages that are on no floor.
set -euo pipefail
dir=tools/layering
python3 "$dir/layering_check.py" --self-test "$dir/floors.bzl"
root=$(cd "$(dirname "$(readlink -f "$dir/floors.bzl")")/../.." && pwd)
python3 "$dir/layering_check.py" "$dir/floors.bzl" "$root" "$@"
