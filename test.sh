#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test; ends with ctest's summary.
set -euo pipefail
cd "$(dirname "$0")"
./scripts/setup.sh --tests
./scripts/build.sh
cd "${TESSERA_BUILD_DIR:-build}"
# Each multi-rank test sets its own thread counts; 2 tests at a time fit 2 cores.
OMP_NUM_THREADS=1 ctest --output-on-failure --timeout 900 -j "${TESSERA_TEST_JOBS:-2}" "$@"
