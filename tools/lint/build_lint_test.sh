#!/usr/bin/env bash
# build_lint.py on a file with one of each problem and on a clean one.
set -uo pipefail
dir=tools/lint
out=$(python3 "$dir/build_lint.py" "$dir/testdata/bad_BUILD")
rc=$?
fail() { echo "FAIL: $*"; echo "$out"; exit 1; }
(( rc == 1 )) || fail "bad_BUILD: exit $rc, wanted 1"
for want in "3: tab" "3: single-quoted string" "4: deps not sorted" \
    "4: deps: a duplicate" "9: indentation of 2 spaces" \
    "9: trailing whitespace"; do
  grep -qF "bad_BUILD:$want" <<< "$out" || fail "missing: $want"
done
out=$(python3 "$dir/build_lint.py" "$dir/testdata/good_BUILD")
rc=$?
(( rc == 0 )) && [[ -z "$out" ]] || fail "good_BUILD: exit $rc"
cp "$dir/testdata/bad_BUILD" "$TEST_TMPDIR/BUILD"
python3 "$dir/build_lint.py" --fix "$TEST_TMPDIR/BUILD" > /dev/null
first=$(grep -n '"//z",' "$TEST_TMPDIR/BUILD" | cut -d: -f1)
local_line=$(grep -n '":a",' "$TEST_TMPDIR/BUILD" | cut -d: -f1)
[[ $(wc -l <<< "$local_line") == 1 ]] || fail "--fix kept the duplicate"
(( local_line < first )) || fail "--fix did not sort the deps"
echo "build_lint_test: ok"
