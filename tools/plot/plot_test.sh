#!/usr/bin/env bash
# tools/plot end to end: renders the sample runs through the :plot wrapper
# and checks the PNGs with the standard library only (signature, IHDR
# width/height and CRC, IEND, non-blank pixels), then checks that each kind
# of bad input exits 1 with a one-line message and no traceback.
#
# Needs python3-matplotlib (tools/setup.sh); without it this test FAILS.
set -uo pipefail

plot="$PWD/tools/plot/plot"
testdata="$PWD/tools/plot/testdata"
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
# Short relative paths from here on (they show up in the messages).
cd "$tmp"
export MPLCONFIGDIR="$tmp/mplconfig"   # matplotlib's cache, out of $HOME
# The wrapper must use /usr/bin/python3, not the first python3 on PATH.
mkdir -p "$tmp/bin"
printf '#!/bin/sh\necho "wrong python3 (from PATH) used" >&2\nexit 97\n' > "$tmp/bin/python3"
chmod +x "$tmp/bin/python3"
export PATH="$tmp/bin:$PATH"

failures=0
fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }

# Checks that $1 is a PNG of $2 x $3 pixels that is not one flat colour.
check_png() {
  /usr/bin/python3 - "$@" <<'PY'
import struct, sys, zlib
path, want_w, want_h = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
data = open(path, "rb").read()
def die(msg):
    print(f"{path}: {msg}", file=sys.stderr); sys.exit(1)
if data[:8] != b"\x89PNG\r\n\x1a\n":
    die("no PNG signature")
pos, chunks, idat = 8, [], b""
while pos + 12 <= len(data):
    (length,) = struct.unpack(">I", data[pos:pos + 4])
    ctype, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
    (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
    if zlib.crc32(ctype + body) != crc:
        die(f"bad CRC in {ctype!r} chunk")
    chunks.append(ctype)
    if ctype == b"IDAT":
        idat += body
    pos += 12 + length
if not chunks or chunks[0] != b"IHDR" or chunks[-1] != b"IEND" or pos != len(data):
    die(f"bad chunk layout {chunks[:3]}...{chunks[-1:]}")
w, h = struct.unpack(">II", data[16:24])
if (w, h) != (want_w, want_h):
    die(f"size {w}x{h}, want {want_w}x{want_h}")
pixels = zlib.decompress(idat)
if len(set(pixels)) < 16:
    die("image looks blank")
print(f"{path}: PNG {w}x{h}, {len(data)} bytes")
PY
}

# Runs plot with the rest of the arguments; expects exit 0 and PNG $1.
expect_png() {
  local png="$1"; shift
  rm -f "$png"
  if ! "$plot" "$@" > out 2> err; then
    fail "plot $* exited non-zero: $(cat err)"
    return
  fi
  grep -q "wrote" out || fail "plot $*: no 'wrote' line: $(cat out)"
  check_png "$png" 1200 900 || fail "plot $*: bad PNG $png"
}

# Runs plot with the rest of the arguments; expects exit 1 and message $1.
expect_error() {
  local fragment="$1"; shift
  "$plot" "$@" > out 2> err
  local rc=$?
  if (( rc != 1 )); then
    fail "plot $*: exit $rc, want 1; stderr: $(cat err)"
  elif ! grep -qF -- "$fragment" err; then
    fail "plot $*: stderr lacks '$fragment': $(cat err)"
  elif grep -q "Traceback" err; then
    fail "plot $*: traceback on stderr: $(cat err)"
  else
    echo "ok: plot $* -> $(head -1 err)"
  fi
}

# matplotlib must be there (a missing one is a failed setup, not a skip).
/usr/bin/python3 -c "import matplotlib" ||
  fail "python3-matplotlib is not installed for /usr/bin/python3: run tools/setup.sh"

# Rendering.
expect_png "a.png" "$testdata/run_a.jsonl" --out "a.png"
expect_png "ab.png" "$testdata/run_a.jsonl" "$testdata/run_b.jsonl" \
  --out "ab.png" --title "run a vs run b"
# Default --out: next to the (first) input, .jsonl replaced by .png.
mkdir -p "default"
cp "$testdata/run_b.jsonl" "default/metrics.jsonl"
expect_png "default/metrics.png" "default/metrics.jsonl"
# Relative paths mean $BUILD_WORKING_DIRECTORY (as under `bazel run`).
mkdir -p "wd/runs"
cp "$testdata/run_a.jsonl" "wd/runs/m.jsonl"
BUILD_WORKING_DIRECTORY="$tmp/wd" expect_png "wd/rel.png" runs/m.jsonl --out rel.png
# Same file names in two directories: still renders (legend by parent dir).
mkdir -p "x" "y"
cp "$testdata/run_a.jsonl" "x/metrics.jsonl"
cp "$testdata/run_b.jsonl" "y/metrics.jsonl"
expect_png "xy.png" "x/metrics.jsonl" "y/metrics.jsonl" --out "xy.png"
# A resumed run appends to the same file from its checkpoint's step.
{ head -n 61 "$testdata/run_a.jsonl"; grep '"kind": "run"' "$testdata/run_a.jsonl";
  sed -n '50,$p' "$testdata/run_a.jsonl"; } > "resumed.jsonl"
expect_png "resumed.png" "resumed.jsonl" --out "resumed.png"
grep -q "resumed run" err || fail "resumed run: no note on stderr"
# The resumed lines replace the first attempt's: the same picture as run_a.
cmp -s a.png resumed.png || fail "resumed run renders differently from run_a"
# A fresh run (header start_step 0) appending to an older run's file
# replaces it whole: the same picture as run_a alone.
{ cat "$testdata/run_b.jsonl"; sed '1s/}$/, "start_step": 0}/' "$testdata/run_a.jsonl"; } > "fresh.jsonl"
expect_png "fresh.png" "fresh.jsonl" --out "fresh.png"
grep -q "1 earlier run(s)" err || fail "fresh run: no note on stderr"
grep -q "resumed run" err && fail "fresh run: called a resumed run"
cmp -s a.png fresh.png || fail "fresh run renders differently from run_a"

# Bad input: exit 1, a clear message, no traceback.

mkdir -p bad
: > "bad/empty.jsonl"
printf '\n\n' > "bad/blank.jsonl"
{ head -n 2 "$testdata/run_a.jsonl"; echo '{"kind": "train", "step": 2, "loss"'; } > "bad/notjson.jsonl"
{ head -n 1 "$testdata/run_a.jsonl"; echo '{"kind": "val", "step": 1, "val_loss": 3.0}';
  echo '{"kind": "summary"}'; } > "bad/notrain.jsonl"
echo '{"kind": "train", "step": 1, "loss": "high"}' > "bad/badtype.jsonl"
echo '{"kind": "train", "step": 1, "loss": 2.5}' > "bad/missing.jsonl"
echo '[1, 2, 3]' > "bad/array.jsonl"
printf '\xff\xfe\n' > "bad/binary.jsonl"

expect_error "bad/nope.jsonl: no such file" "bad/nope.jsonl" --out "e.png"
expect_error "bad/empty.jsonl: empty file" "bad/empty.jsonl" --out "e.png"
expect_error "bad/blank.jsonl: empty file" "bad/blank.jsonl" --out "e.png"
expect_error "bad/notjson.jsonl:3: not JSON" "bad/notjson.jsonl" --out "e.png"
expect_error "bad/notrain.jsonl: no training lines" "bad/notrain.jsonl" --out "e.png"
expect_error "bad/badtype.jsonl:1: \"loss\" must be a number" "bad/badtype.jsonl" --out "e.png"
expect_error "bad/missing.jsonl:1: train line has no \"tokens_per_s\"" "bad/missing.jsonl" --out "e.png"
expect_error "bad/array.jsonl:1: expected a JSON object" "bad/array.jsonl" --out "e.png"
expect_error "bad/binary.jsonl:1: not UTF-8" "bad/binary.jsonl" --out "e.png"
# A bad file among good ones still fails, naming the bad one.
expect_error "bad/empty.jsonl: empty file" "$testdata/run_a.jsonl" "bad/empty.jsonl" --out "e.png"
expect_error "cannot write" "$testdata/run_a.jsonl" --out "no/such/dir/e.png"
[[ ! -e "e.png" ]] || fail "a PNG was written for bad input"

if (( failures > 0 )); then
  echo "$failures check(s) failed" >&2
  exit 1
fi
echo "all plot checks passed"
