#!/usr/bin/env bash
# Builds the CUDA tests here (--config=cuda; no GPU needed to build) and packs
# them with the shared libraries a bare GPU machine may lack into
# .gpu_bundle/bundle.tar.xz, for tools/gpu/run_checks.sh to run there:
#
#   bash tools/gpu/bundle.sh     # here
#   bash tools/gpu/run_checks.sh # on the GPU machine, from the repo root
#
# The CUDA libraries themselves (cudart, cuBLASLt, NCCL: hundreds of MB) are
# not packed: run_checks.sh finds the GPU machine's own. glibc, libstdc++ and
# libgcc are not packed either (the bundle is built on an older glibc than
# the machines it runs on).
set -euo pipefail
cd "$(dirname "$0")/../.."
TESTS=(
  //core:cuda_runtime_test
  //core:caching_allocator_test
  //core:device_test
  //tensor:cuda_backend_test
  //tensor:attention_test
  //tensor:ops_errors_test
  //tensor:tensor_test
  //optim:adamw_cuda_test
  //comm:nccl_backend_test
  //tests:cuda_train_test
  //plan:dry_run_cuda_test
)
bazel build --config=cuda "${TESTS[@]}"
bin="$(bazel info --config=cuda bazel-bin)"
stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin" "$stage/lib"
for t in "${TESTS[@]}"; do
  rel="${t#//}"
  rel="${rel/://}"
  mkdir -p "$stage/bin/$(dirname "$rel")"
  cp -L "$bin/$rel" "$stage/bin/$rel"
  echo "$rel" >>"$stage/tests.txt"
  # Our own libraries (RUNPATH $ORIGIN/../_solib_k8) and the system ones
  # that are not in every Linux image.
  ldd "$bin/$rel" | awk '$3 ~ /^\// {print $3}' | while read -r lib; do
    case "$lib" in
      */_solib_k8/*)
        mkdir -p "$stage/bin/_solib_k8"
        cp -Ln "$lib" "$stage/bin/_solib_k8/" ;;
      */libc.so*|*/libm.so*|*/libdl.so*|*/librt.so*|*/libpthread.so*|\
      */libstdc++.so*|*/libgcc_s.so*|*/ld-linux*|\
      */libcudart.so*|*/libcublas*|*/libnccl.so*) ;;
      *) cp -Ln "$lib" "$stage/lib/" ;;
    esac
  done
done
mkdir -p .gpu_bundle
tar -C "$stage" -cJf .gpu_bundle/bundle.tar.xz .
grep -qx '/.gpu_bundle/' .git/info/exclude 2>/dev/null ||
  echo '/.gpu_bundle/' >>.git/info/exclude
ls -la .gpu_bundle/bundle.tar.xz
