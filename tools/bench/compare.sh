#!/usr/bin/env bash
# Compares two runs of tools/bench/run.sh, binary by binary, with Google
# Benchmark's compare.py (Debian libbenchmark-tools; its Mann-Whitney U test
# needs python3-scipy and the runs' repetitions):
#
#   tools/bench/compare.sh BASELINE_DIR NEW_DIR [--threshold=0.05]
#
# Prints compare.py's table per binary (time and CPU change, U-test
# p-values), then the cases whose time grew by more than the threshold
# (default 5%) as "REGRESSION" lines. Exit status: 0 when there is none, 1
# when there is at least one, 2 on a usage error.
set -uo pipefail

compare_py=/usr/share/benchmark/compare.py
python=/usr/bin/python3  # Debian's, which has scipy.
threshold=0.05
args=()
for arg in "$@"; do
  case "$arg" in
    --threshold=*) threshold="${arg#--threshold=}" ;;
    *) args+=("$arg") ;;
  esac
done
if [[ ${#args[@]} -ne 2 || ! -d "${args[0]}" || ! -d "${args[1]}" ]]; then
  echo "usage: compare.sh BASELINE_DIR NEW_DIR [--threshold=0.05]" >&2
  exit 2
fi
if [[ ! -f "$compare_py" ]]; then
  echo "compare.sh: $compare_py not found (apt-get install libbenchmark-tools)" >&2
  exit 2
fi
base=${args[0]}
new=${args[1]}

regressions=0
compared=0
for new_json in "$new"/*.json; do
  [[ -e "$new_json" ]] || continue
  name=$(basename "$new_json")
  base_json="$base/$name"
  if [[ ! -f "$base_json" ]]; then
    echo "compare.sh: $name has no baseline; skipped"
    continue
  fi
  compared=$((compared + 1))
  echo "=== ${name%.json}"
  dump=$(mktemp)
  "$python" "$compare_py" --no-color -a -d "$dump" benchmarks \
    "$base_json" "$new_json" || { rm -f "$dump"; exit 2; }
  # compare.py's JSON dump: one entry per case with the measurements'
  # relative time change; a case is regressed when its median time grew by
  # more than the threshold.
  found=$("$python" - "$dump" "$threshold" "${name%.json}" <<'PY'
import json, sys
dump, threshold, binary = sys.argv[1], float(sys.argv[2]), sys.argv[3]
entries = json.load(open(dump))
# With repetitions, judge each case by its median; without, by its one run.
medians = [e for e in entries if e["name"].endswith("_median")]
n = 0
for entry in medians or [e for e in entries if e.get("run_type") != "aggregate"]:
    for m in entry.get("measurements", []):
        if m["time"] > threshold:
            print(f"REGRESSION {binary} {entry['name']}: time {m['time']:+.1%}")
            n += 1
            break
sys.exit(0 if n == 0 else 1)
PY
)
  rc=$?
  rm -f "$dump"
  [[ -n "$found" ]] && echo "$found"
  [[ $rc -eq 0 ]] || regressions=1
done
if [[ $compared -eq 0 ]]; then
  echo "compare.sh: no binary of $new has a baseline in $base" >&2
  exit 2
fi
exit $regressions
