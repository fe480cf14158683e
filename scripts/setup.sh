#!/usr/bin/env bash
# Installs every Debian package Tessera's build, tests and main job need; `--tests` adds
# those only the test suite uses (./test.sh passes it).
# Idempotent (installs only what is missing), non-interactive, works as root or via
# sudo, and downloads nothing but Debian packages.
set -euo pipefail

PACKAGES=(
  # toolchain
  g++ cmake ninja-build ccache pkg-config
  # LibTorch 1.13 (CPU) and the c10d Gloo headers
  libtorch-dev libgloo-dev
  # oneDNN headers: fp32 CPU products at the core's speed whatever OpenBLAS detects (kernels/)
  libdnnl-dev
  # an optimised BLAS: LibTorch calls libblas.so.3, and the reference BLAS is ~50x slower
  libopenblas0-pthread
  # libraries
  libyaml-cpp-dev libspdlog-dev libfmt-dev libcli11-dev nlohmann-json3-dev libxxhash-dev libzstd-dev
  # image files (PNG, JPEG) and the main job's data
  libpng-dev libturbojpeg0-dev zlib1g-dev dataset-fashion-mnist
  # TensorBoard event files: protobuf (C++ library and schema compiler), CRC-32C from Intel
  # ISA-L; the independent reader the tests check them with (python3 protobuf and crc32c)
  libprotobuf-dev protobuf-compiler libisal-dev python3-protobuf python3-crc32c
  # tests and benchmarks; clang and its runtimes for the libFuzzer targets (fuzz/)
  libgtest-dev libgmock-dev libbenchmark-dev clang libclang-rt-14-dev
  # golden references and the real torchrun (python3 -m torch.distributed.run)
  python3 python3-torch
)
# For the test suite only: a one-node Slurm cluster the Slurm test starts itself.
TEST_PACKAGES=(slurm-wlm)
case "${1:-}" in
  --tests) PACKAGES+=("${TEST_PACKAGES[@]}") ;;
  "") ;;
  *) echo "setup: unknown argument '$1' (--tests adds the test suite's packages)" >&2; exit 2 ;;
esac

missing=()
SUDO=""   # "sudo -n" when not root and something must be installed (never from the environment)
for pkg in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$pkg")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#PACKAGES[@]} packages present"
else
  echo "setup: installing ${missing[*]}"
  if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
      SUDO="sudo -n"
    else
      echo "setup: need root or sudo to install: ${missing[*]}" >&2
      exit 1
    fi
  fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -q </dev/null
  $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}" </dev/null
fi

# Make sure libblas.so.3 resolves to OpenBLAS, not the reference BLAS.
blas_link=$(readlink -f /usr/lib/x86_64-linux-gnu/libblas.so.3 2>/dev/null || true)
case "$blas_link" in
  *openblas*) ;;
  *)
    echo "setup: pointing libblas.so.3 at OpenBLAS (was: ${blas_link:-none})"
    alt=$(ls /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 2>/dev/null || true)
    if [ -n "$alt" ]; then
      $SUDO update-alternatives --set libblas.so.3-x86_64-linux-gnu "$alt"
    fi
    ;;
esac
