#!/usr/bin/env bash
# Real processes over the TCP store and Gloo: 2 ranks through tools/launch,
# then a rank that crashes mid-run (started by hand, since the launcher would
# stop the survivor) must be named by the survivor within its timeout.
set -euo pipefail
worker=comm/multiprocess_worker
launch=tools/launch/launch

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

out=$(timeout 120 "$launch" --nproc_per_node=2 --master_port="$(free_port)" "$worker" --mode=ok 2>&1)
echo "$out"
grep -q '^\[rank 0\] rank 0: ok (world 2 via torchrun)' <<< "$out"
grep -q '^\[rank 1\] rank 1: ok (world 2 via torchrun)' <<< "$out"

port=$(free_port)
log=$(mktemp -d)
for r in 0 1; do
  RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 \
    MASTER_PORT=$port timeout 120 "$worker" --mode=die > "$log/$r.out" 2>&1 &
  pids[$r]=$!
done
set +e
wait "${pids[1]}"; status1=$?
wait "${pids[0]}"; status0=$?
set -e
cat "$log/0.out" "$log/1.out"
[[ $status1 -eq 7 ]] || { echo "rank 1 exited $status1, expected 7"; exit 1; }
[[ $status0 -eq 0 ]] || { echo "rank 0 exited $status0, expected 0"; exit 1; }
grep -q 'ranks that did not answer: 1' "$log/0.out"
echo "multiprocess test passed"
