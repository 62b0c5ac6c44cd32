#!/usr/bin/env bash
# Installs what building and testing fsdpp needs on Debian bookworm, once.
#
# Idempotent: packages already installed are skipped, and apt is not touched
# at all when nothing is missing. Everything comes from Debian's archive
# (the build is fully offline after this). Run as root or with sudo.
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
  libgloo-dev         # Gloo collectives (CPU, TCP)
  libdnnl-dev         # oneDNN (CPU matmul, AVX-512 / AMX at run time)
  python3-torch       # independent numerical reference in the parity tests
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

if (( ${#missing[@]} == 0 )); then
  echo "setup: all ${#packages[@]} packages present"
  exit 0
fi

sudo=()
if (( EUID != 0 )); then
  if command -v sudo >/dev/null; then sudo=(sudo); else
    echo "setup: need root to install: ${missing[*]}" >&2
    exit 1
  fi
fi
echo "setup: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "setup: done"
