#!/usr/bin/env bash
# Installs what building and testing fsdpp needs on Debian bookworm, once.
#
# Idempotent: packages already installed are skipped, and apt is not touched
# at all when nothing is missing. Everything comes from Debian's archive
# (the build is fully offline after this), except the optional npm step at
# the end (tiktoken, for the GPT-2 tokenizer). Run as root or with sudo.
set -euo pipefail

packages=(
  bazel-bootstrap     # Bazel 4.2.3 (WORKSPACE mode, offline shims in third_party/)
  g++                 # C++17 compiler
  python3             # .ci/count_tests.py
  libabsl-dev         # Abseil (status, strings, time, synchronization, flags)
  libprotobuf-dev     # protobuf runtime
  protobuf-compiler   # protoc, used through //third_party:proto.bzl
  libgtest-dev        # GoogleTest
  libgmock-dev        # GoogleMock
  libbenchmark-dev    # Google Benchmark
  libbenchmark-tools  # compare.py (tools/bench/compare.sh)
  python3-scipy       # compare.py's Mann-Whitney U test
  libgloo-dev         # Gloo collectives (CPU, TCP)
  libdnnl-dev         # oneDNN (CPU matmul, AVX-512 / AMX at run time)
  libhwy-dev          # Google Highway: SIMD host kernels, runtime dispatch
  python3-torch       # independent numerical reference in the parity tests
  libopenblas0-openmp # PyTorch's f32 BLAS for tools/bench/vs_pytorch.sh (the
                      # reference BLAS makes its step ~50x slower)
  python3-matplotlib  # tools/plot: loss and throughput curves to PNG
  clang               # clang++ for the libFuzzer runs (checkpoint/fuzz/run_fuzzers.sh)
  clang-format        # the format check in CI (tools/lint/lint.sh)
  libclang-rt-dev     # libFuzzer + ASan/UBSan runtimes (libclang-rt-14-dev on bookworm)
  iproute2            # ip netns: trainer/multinode_test's two nodes (skips without)
  slurm-wlm           # slurmctld + slurmd + srun: trainer/slurm_test (skips without)
)
# Extra packages: FSDPP_SETUP_EXTRA="clang ...".
if [[ -n "${FSDPP_SETUP_EXTRA:-}" ]]; then
  read -r -a extra <<< "${FSDPP_SETUP_EXTRA}"
  packages+=("${extra[@]}")
fi

missing=()
for p in "${packages[@]}"; do
  if [[ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" != "install ok installed" ]]; then
    missing+=("$p")
  fi
done

sudo=()
if (( EUID != 0 )) && command -v sudo >/dev/null; then sudo=(sudo); fi

if (( ${#missing[@]} == 0 )); then
  echo "setup: all ${#packages[@]} packages present"
else
  if (( EUID != 0 && ${#sudo[@]} == 0 )); then
    echo "setup: need root to install: ${missing[*]}" >&2
    exit 1
  fi
  echo "setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  "${sudo[@]}" apt-get update -qq
  "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
  echo "setup: done"
fi

# npm step (optional): the npm tiktoken package, the reference of the GPT-2
# tokenizer parity test, and GPT-2's encoder.json + vocab.bpe derived from
# its bundled gpt2 ranks (checked against OpenAI's published SHA-256s) for
# the trainer's "gpt2" tokenizer. Both live outside the source tree, in
# /usr/local/share/fsdpp. Without npm (or the npm registry) the step is
# skipped: the parity test then skips visibly and the gpt2 tokenizer reports
# the missing files. See trainer/data/README.md.
fsdpp_share=/usr/local/share/fsdpp
tiktoken_version=1.0.22
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -f "$fsdpp_share/node_modules/tiktoken/package.json" &&
      "$(node -p "require('$fsdpp_share/node_modules/tiktoken/package.json').version" 2>/dev/null)" == "$tiktoken_version" &&
      -f "$fsdpp_share/gpt2/encoder.json" && -f "$fsdpp_share/gpt2/vocab.bpe" ]]; then
  echo "setup: tiktoken $tiktoken_version and GPT-2 BPE files present in $fsdpp_share"
elif ! command -v npm >/dev/null || ! command -v node >/dev/null; then
  echo "setup: npm/node not found; skipping tiktoken and the GPT-2 BPE files (their tests will skip)"
elif (( EUID != 0 && ${#sudo[@]} == 0 )); then
  echo "setup: need root to write $fsdpp_share; skipping tiktoken (its tests will skip)" >&2
else
  echo "setup: installing tiktoken@$tiktoken_version into $fsdpp_share"
  if "${sudo[@]}" mkdir -p "$fsdpp_share" &&
     "${sudo[@]}" npm install --prefix "$fsdpp_share" --save-exact --no-audit --no-fund \
       --loglevel=error "tiktoken@$tiktoken_version" &&
     "${sudo[@]}" node "$repo_root/trainer/data/gpt2_bpe_from_tiktoken.js" \
       "$fsdpp_share/node_modules/tiktoken" "$fsdpp_share/gpt2"; then
    echo "setup: GPT-2 encoder.json and vocab.bpe written to $fsdpp_share/gpt2"
  else
    echo "setup: warning: tiktoken / GPT-2 BPE step failed; its tests will skip" >&2
  fi
fi
