#!/usr/bin/env bash
# Runs the CUDA tests packed by tools/gpu/bundle.sh on a GPU machine, then
# the PyTorch peer of tests/cuda_train_test's GPT-2 124M timing. Run from the
# repo root with .gpu_bundle/ beside it; logs go to $OUT (or /tmp/gpu_out).
set -uo pipefail
out="${OUT:-/tmp/gpu_out}"
mkdir -p "$out"
work=/tmp/gpu_bundle  # kept, for runs of single tests after this script
rm -rf "$work" && mkdir -p "$work"
tar -C "$work" -xJf .gpu_bundle/bundle.tar.xz || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv |
  tee "$out/gpu.txt"
# The machine's own CUDA libraries: the toolkit's, else the pip wheels'.
libdirs=""
for name in libcudart.so.13 libcublasLt.so.13 libnccl.so.2; do
  found="$(find /usr/local/cuda*/ /usr/lib/x86_64-linux-gnu /opt /usr/local/lib \
    -name "$name*" -not -path '*/stubs/*' 2>/dev/null | head -1)"
  echo "$name: ${found:-NOT FOUND}"
  [ -n "$found" ] && libdirs="$libdirs:$(dirname "$found")"
done
export LD_LIBRARY_PATH="$work/lib${libdirs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export OMP_WAIT_POLICY=PASSIVE
passed=0
failed=0
while read -r t; do
  log="$out/$(echo "$t" | tr / _).log"
  echo "=== $t"
  if timeout 240 "$work/bin/$t" >"$log" 2>&1; then
    passed=$((passed + 1))
    status=PASSED
  else
    failed=$((failed + 1))
    status="FAILED (rc $?)"
  fi
  grep -E '^\[  (PASSED  |SKIPPED )\] [0-9]+ tests?|^\[  FAILED  \] [A-Z]' "$log" |
    head -20
  echo "$t: $status"
  [ "$status" = PASSED ] || tail -30 "$log"
done <"$work/tests.txt"
grep -h "loss cpu\|parameter error\|median step" "$out"/tests_cuda_train_test.log
grep -h "planned" "$out"/plan_dry_run_cuda_test.log
if [ "${GPU_PEER:-1}" = 1 ]; then  # GPU_PEER=0 skips the PyTorch peer
  echo "=== PyTorch peer (GPT-2 124M bf16, 8 x 1024, cuda)"
  timeout 180 python3 tools/bench/pytorch_gpt2_step.py --device=cuda \
    --dtype=bf16 --batch=8 --seq=1024 --steps=5 --warmup=3 |
    tee "$out/pytorch_peer.json"
fi
echo "$passed passed, $failed failed"
