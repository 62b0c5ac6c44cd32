#!/usr/bin/env bash
# Builds the CUDA tests and the trainer here (--config=cuda -c opt; no GPU
# needed to build) and packs them with the shared libraries a bare GPU
# machine may lack, and the GPT-2 tokenizer's files, into
# .gpu_bundle/bundle.tar.xz, for tools/gpu/run_checks.sh to run there:
#
#   bash tools/gpu/bundle.sh     # here
#   bash tools/gpu/run_checks.sh # on the GPU machine, from the repo root
#
# The CUDA libraries themselves (cudart, cuBLASLt, NCCL, cuDNN: hundreds of
# MB; cuDNN alone ~0.5 GB) are not packed: run_checks.sh finds the GPU
# machine's own (the toolkit's, or the ones PyTorch's wheels ship). glibc, libstdc++ and
# libgcc are not packed either (the bundle is built on an older glibc than
# the machines it runs on).
set -euo pipefail
cd "$(dirname "$0")/../.."
TESTS=(
  //core:cuda_runtime_test
  //core:caching_allocator_test
  //core:device_test
  //tensor:cuda_backend_test
  //tensor:cudnn_sdpa_test
  //tensor:attention_test
  //tensor:ops_errors_test
  //tensor:tensor_test
  //optim:adamw_cuda_test
  //comm:nccl_backend_test
  //tests:cuda_train_test
  //plan:dry_run_cuda_test
  //core:gpus_test
)
# The binaries run on the GPU machine besides the tests.
BINARIES=(
  //trainer:train
)
bazel build --config=cuda -c opt "${TESTS[@]}" "${BINARIES[@]}"
bin="$(bazel info --config=cuda -c opt bazel-bin)"
stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin" "$stage/lib"
for t in "${TESTS[@]}" "${BINARIES[@]}"; do
  rel="${t#//}"
  rel="${rel/://}"
  mkdir -p "$stage/bin/$(dirname "$rel")"
  cp -L "$bin/$rel" "$stage/bin/$rel"
  [[ " ${TESTS[*]} " == *" $t "* ]] && echo "$rel" >>"$stage/tests.txt"
  # Our own libraries (RUNPATH $ORIGIN/../_solib_k8) and the system ones
  # that are not in every Linux image.
  ldd "$bin/$rel" | awk '$3 ~ /^\// {print $3}' | while read -r lib; do
    case "$lib" in
      */_solib_k8/*)
        mkdir -p "$stage/bin/_solib_k8"
        cp -Ln "$lib" "$stage/bin/_solib_k8/" ;;
      */libc.so*|*/libm.so*|*/libdl.so*|*/librt.so*|*/libpthread.so*|\
      */libstdc++.so*|*/libgcc_s.so*|*/ld-linux*|\
      */libcudart.so*|*/libcublas*|*/libnccl.so*|*/libcudnn*) ;;
      *) cp -Ln "$lib" "$stage/lib/" ;;
    esac
  done
done
# The trainer's GPT-2 tokenizer files (tools/setup.sh made them here).
mkdir -p "$stage/share/gpt2"
cp /usr/local/share/fsdpp/gpt2/encoder.json /usr/local/share/fsdpp/gpt2/vocab.bpe \
  "$stage/share/gpt2/"
mkdir -p .gpu_bundle
tar -C "$stage" -cJf .gpu_bundle/bundle.tar.xz .
grep -qx '/.gpu_bundle/' .git/info/exclude 2>/dev/null ||
  echo '/.gpu_bundle/' >>.git/info/exclude
ls -la .gpu_bundle/bundle.tar.xz
