# Shell helpers the trainer's end-to-end tests and drills share (sourced).

# losses JSONL: "step loss" of every step of a trainer's metrics JSONL, the
# last line of a step winning (a resumed run repeats the steps after its
# checkpoint).
losses() {
  /usr/bin/python3 - "$1" <<'PY'
import json, sys
last = {}
for line in open(sys.argv[1]):
    d = json.loads(line)
    if d.get("kind") == "train":
        last[d["step"]] = d["loss"]
for step in sorted(last):
    print(step, repr(last[step]))
PY
}

# rank_pid LAUNCHER RANK: the pid of the launcher's child process whose
# environment has RANK=<RANK> (empty if there is none).
rank_pid() {
  local status p
  for status in /proc/[0-9]*/status; do
    p=${status#/proc/}
    p=${p%/status}
    grep -qx "PPid:[[:space:]]*$1" "$status" 2>/dev/null || continue
    # Not grep -q at the end of the pipe: with pipefail, tr's SIGPIPE would
    # make a match look like a miss.
    if tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null |
      grep -x "RANK=$2" >/dev/null; then
      echo "$p"
      return 0
    fi
  done
  return 0
}
