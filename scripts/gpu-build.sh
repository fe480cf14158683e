#!/usr/bin/env bash
# Builds Tessera with CUDA and the nccl backend against the LibTorch inside an installed
# PyTorch 2.x wheel, on a GPU machine that has PyTorch, CUDA and NCCL but no package
# registry. The few Debian libraries Tessera needs besides (yaml-cpp, spdlog, fmt, CLI11,
# nlohmann-json, xxhash, GoogleTest, gloo headers, libpng, TurboJPEG, zlib, protobuf, ISA-L) travel
# as .deb files:
#
#   on a Debian/Ubuntu machine with apt:   scripts/gpu-build.sh --fetch   (fills .gpu-debs/)
#   copy the checkout to the GPU machine:  scripts/gpu-build.sh           (unpacks, builds)
#
# The .deb files are unpacked into .gpu-deps/ (never into /), both folders are ignored
# by git. Environment: PYTHON (default python3, must import torch), TESSERA_BUILD_DIR
# (default build-gpu), TESSERA_BUILD_JOBS, NCCL_HOME (default: the nvidia-nccl wheel).
# Extra arguments go to CMake's configure step.
set -euo pipefail
cd "$(dirname "$0")/.."

DEBS_DIR=.gpu-debs
DEPS_PREFIX=$PWD/.gpu-deps
BUILD_DIR=${TESSERA_BUILD_DIR:-build-gpu}
PYTHON=${PYTHON:-python3}
DEB_PACKAGES=(
  libyaml-cpp-dev libyaml-cpp0.7 libspdlog-dev libspdlog1.10 libfmt-dev libfmt9
  libcli11-dev nlohmann-json3-dev libxxhash-dev libxxhash0 libgtest-dev libgmock-dev libgloo-dev
  libpng-dev libpng16-16 libturbojpeg0-dev libturbojpeg0 zlib1g-dev zlib1g
  libprotobuf-dev libprotobuf32 protobuf-compiler libprotoc32 libisal-dev libisal2
)

if [ "${1:-}" = "--fetch" ]; then
  mkdir -p "$DEBS_DIR"
  (cd "$DEBS_DIR" && apt-get download "${DEB_PACKAGES[@]}")
  echo "gpu-build: ${#DEB_PACKAGES[@]} packages in $DEBS_DIR/"
  exit 0
fi

die() { echo "gpu-build: $*" >&2; exit 1; }

# 1. Unpack the Debian libraries into a private prefix (once per set of .deb files).
[ -d "$DEBS_DIR" ] || die "no $DEBS_DIR/: run 'scripts/gpu-build.sh --fetch' on a machine with apt first"
stamp="$DEPS_PREFIX/.unpacked"
if [ ! -f "$stamp" ] || [ -n "$(find "$DEBS_DIR" -name '*.deb' -newer "$stamp")" ]; then
  rm -rf "$DEPS_PREFIX" && mkdir -p "$DEPS_PREFIX"
  for deb in "$DEBS_DIR"/*.deb; do
    if command -v dpkg-deb >/dev/null 2>&1; then
      dpkg-deb -x "$deb" "$DEPS_PREFIX"
    else  # a .deb is an ar archive holding data.tar.*
      tmp=$(mktemp -d) && (cd "$tmp" && ar x "$OLDPWD/$deb" && tar -xf data.tar.* -C "$DEPS_PREFIX") && rm -rf "$tmp"
    fi
  done
  # Absolute links (Debian's libz.so -> /lib/...) point into the prefix instead.
  find "$DEPS_PREFIX" -type l | while read -r link; do
    target=$(readlink "$link")
    case "$target" in /*) [ -e "$DEPS_PREFIX$target" ] && ln -sfn "$DEPS_PREFIX$target" "$link" ;; esac
  done
  touch "$stamp"
fi
DEPS_LIB="$DEPS_PREFIX/usr/lib/x86_64-linux-gnu"

# 2. LibTorch, CUDA and NCCL from the Python environment.
"$PYTHON" -c 'import torch' 2>/dev/null || die "$PYTHON cannot import torch (set PYTHON)"
TORCH_CMAKE=$("$PYTHON" -c 'import torch; print(torch.utils.cmake_prefix_path)')
TORCH_CUDA=$("$PYTHON" -c 'import torch; print(torch.version.cuda or "")')
[ -n "$TORCH_CUDA" ] || die "the torch of $PYTHON has no CUDA"
if [ -z "${NCCL_HOME:-}" ]; then
  NCCL_HOME=$("$PYTHON" -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__) if nvidia.nccl.__file__ else list(nvidia.nccl.__path__)[0])' 2>/dev/null || true)
fi
NCCL_LIB=$(ls "$NCCL_HOME"/lib/libnccl.so* 2>/dev/null | head -1 || true)
[ -f "$NCCL_HOME/include/nccl.h" ] && [ -n "$NCCL_LIB" ] || die "NCCL not found under NCCL_HOME=$NCCL_HOME"
# Prefer the gloo headers the wheel ships (they match its ProcessGroupGloo); else Debian's.
GLOO_ARGS=()
TORCH_INCLUDE=$("$PYTHON" -c 'import torch, os; print(os.path.join(os.path.dirname(torch.__file__), "include"))')
if [ ! -f "$TORCH_INCLUDE/gloo/config.h" ]; then
  GLOO_ARGS=(-DGLOO_INCLUDE_DIR="$DEPS_PREFIX/usr/include")
fi
if command -v nvcc >/dev/null 2>&1; then export CUDACXX=${CUDACXX:-$(command -v nvcc)}; fi
echo "gpu-build: torch $("$PYTHON" -c 'import torch; print(torch.__version__)') (CUDA $TORCH_CUDA), NCCL $NCCL_LIB"

# 3. Configure and build. protoc runs from the unpacked debs (configure checks its version).
export LD_LIBRARY_PATH="$DEPS_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
GENERATOR=()
command -v ninja >/dev/null 2>&1 && GENERATOR=(-G Ninja)
cmake -S . -B "$BUILD_DIR" "${GENERATOR[@]}" \
  -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$TORCH_CMAKE;$DEPS_PREFIX/usr" \
  -DCMAKE_BUILD_RPATH="$DEPS_LIB;$(dirname "$NCCL_LIB")" \
  -DTESSERA_WITH_CUDA=ON -DProtobuf_PROTOC_EXECUTABLE="$DEPS_PREFIX/usr/bin/protoc" \
  -DNCCL_INCLUDE_DIR="$NCCL_HOME/include" -DNCCL_LIBRARY="$NCCL_LIB" \
  -DTESSERA_PYTHON3="$(command -v "$PYTHON")" -DTESSERA_INSTALL=OFF \
  "${GLOO_ARGS[@]}" "$@"
cmake --build "$BUILD_DIR" -j "${TESSERA_BUILD_JOBS:-$(nproc)}" ${TESSERA_BUILD_ARGS:-}
echo "gpu-build: built into $BUILD_DIR/ (tests: ctest --test-dir $BUILD_DIR)"
