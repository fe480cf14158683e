#!/usr/bin/env bash
# Configures (once) and builds Tessera into build/ with ninja and ccache.
# Extra arguments go to the configure step, e.g. -DTESSERA_SANITIZE=address.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${TESSERA_BUILD_DIR:-build}
if [ ! -f "$BUILD_DIR/build.ninja" ] || [ $# -gt 0 ]; then
  cmake -S . -B "$BUILD_DIR" -G Ninja "$@"
fi
# ccache's default cache lives in the home directory; keep it bounded. With the project
# root as base directory (and the working directory out of the hash), a fresh clone in
# another path reuses the objects of an earlier build.
export CCACHE_MAXSIZE=${CCACHE_MAXSIZE:-5G}
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
export CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
cmake --build "$BUILD_DIR" -j "${TESSERA_BUILD_JOBS:-$(nproc)}"
