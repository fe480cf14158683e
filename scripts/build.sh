#!/usr/bin/env bash
# Configures (once) and builds Tessera into build/ with ninja and ccache.
#   scripts/build.sh                      everything (libraries, programs, tests, benchmarks)
#   scripts/build.sh tessera-train ...    only these targets and what they need
#   scripts/build.sh -DTESSERA_SANITIZE=address   reconfigure with these CMake options
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${TESSERA_BUILD_DIR:-build}
configure=()
targets=()
for arg in "$@"; do
  case "$arg" in
    -*) configure+=("$arg") ;;
    *) targets+=(--target "$arg") ;;
  esac
done
if [ ! -f "$BUILD_DIR/build.ninja" ] || [ ${#configure[@]} -gt 0 ]; then
  cmake -S . -B "$BUILD_DIR" -G Ninja ${configure[@]+"${configure[@]}"}
fi
# ccache's default cache lives in the home directory; keep it bounded. With the project
# root as base directory (and the working directory out of the hash), a fresh clone in
# another path reuses the objects of an earlier build.
export CCACHE_MAXSIZE=${CCACHE_MAXSIZE:-5G}
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
export CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
# Precompiled headers (cmake/TesseraCompileOptions.cmake): ccache caches their builds and
# the files that use them only when told not to fuss over the macros and times of a
# precompiled header's build (ccache's manual, "Precompiled headers").
export CCACHE_SLOPPINESS=${CCACHE_SLOPPINESS:-pch_defines,time_macros,include_file_mtime,include_file_ctime}
cmake --build "$BUILD_DIR" -j "${TESSERA_BUILD_JOBS:-$(nproc)}" ${targets[@]+"${targets[@]}"}
