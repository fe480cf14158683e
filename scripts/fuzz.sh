#!/usr/bin/env bash
# Builds and runs the libFuzzer targets of fuzz/ (clang, ASan + UBSan; fuzz/README.md).
#
#   scripts/fuzz.sh [--seconds N | --runs N | --smoke N] [--jobs J] [--no-build]
#                   [--build-dir DIR] [TARGET...]
#
# TARGET is a name of fuzz/<name>_fuzz.cpp (config, checkpoint_metadata, trainer_state,
# safetensors, dataset); default: all of them, one after the other.
#   --seconds N   run each target for N seconds (default 60)
#   --runs N      run each target for N inputs
#   --smoke N     N inputs with a fixed random seed on a scratch corpus made from the
#                 committed seeds only (what ctest runs: repeatable, leaves nothing behind)
#   --jobs J      J fuzzing processes per target (default 1)
#   --no-build    use the targets already in the build directory
#   --build-dir   the fuzz build (default build/fuzz, the main build's nested one)
# Without --smoke, what a run finds that is new is kept in <build-dir>/corpus/<target>/ and
# seeds the next run; crashes, leaks and timeouts are written to <build-dir>/crashes/<target>/.
# Prints the executions each target ran; exits 1 when a target found anything.
set -euo pipefail
cd "$(dirname "$0")/.."

mode=seconds
amount=60
jobs=1
build=1
build_dir=${TESSERA_BUILD_DIR:-build}/fuzz
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds|--runs|--smoke) mode=${1#--}; amount=$2; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    --no-build) build=0; shift ;;
    --build-dir) build_dir=$2; shift 2 ;;
    -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "fuzz.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
case "$amount" in
  ''|*[!0-9]*) echo "fuzz.sh: --$mode needs a whole number, got '$amount'" >&2; exit 2 ;;
esac
if [ ${#targets[@]} -eq 0 ]; then
  for source in fuzz/*_fuzz.cpp; do
    name=$(basename "$source" _fuzz.cpp)
    targets+=("$name")
  done
fi
for name in "${targets[@]}"; do
  if [ ! -f "fuzz/${name}_fuzz.cpp" ]; then
    echo "fuzz.sh: no target '$name' (fuzz/${name}_fuzz.cpp)" >&2
    exit 2
  fi
done

if [ "$build" = 1 ]; then
  if [ ! -f "$build_dir/build.ninja" ]; then
    cmake -S . -B "$build_dir" -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DTESSERA_BUILD_FUZZ=ON \
      -DTESSERA_BUILD_TESTS=OFF -DTESSERA_BUILD_BENCH=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo
  fi
  cmake --build "$build_dir" -j "${TESSERA_BUILD_JOBS:-$(nproc)}"
fi

# Leaks are findings; a single allocation above 1 GiB is one too (sizes read from the
# input must be checked before anything is allocated for them). No allocation stacks:
# ASan's stack depot grows with every distinct one and slowed the config target from 380
# to 60 inputs/s within 30 minutes; replay a finding (build/fuzz/bin/tessera_<target>_fuzz
# FILE) with ASAN_OPTIONS=malloc_context_size=30 for them.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:allocator_may_return_null=0:malloc_context_size=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
flags=(-max_len=65536 -timeout=10 -rss_limit_mb=2560 -malloc_limit_mb=1024 -print_final_stats=1)

status=0
for name in "${targets[@]}"; do
  binary="$build_dir/bin/tessera_${name}_fuzz"
  if [ ! -x "$binary" ]; then
    echo "fuzz.sh: $binary is not built (run scripts/fuzz.sh without --no-build)" >&2
    exit 2
  fi
  crashes="$build_dir/crashes/$name"
  mkdir -p "$crashes"
  log=$(mktemp)
  case "$mode" in
    smoke)
      corpus=$(mktemp -d)
      run=(-runs="$amount" -seed=1) ;;
    runs)
      corpus="$build_dir/corpus/$name"
      run=(-runs="$amount") ;;
    seconds)
      corpus="$build_dir/corpus/$name"
      run=(-max_total_time="$amount") ;;
  esac
  mkdir -p "$corpus"
  parallel=()
  if [ "$jobs" -gt 1 ]; then parallel=(-fork="$jobs" -ignore_crashes=0); fi
  rc=0
  "$binary" "${flags[@]}" "${run[@]}" ${parallel[@]+"${parallel[@]}"} -artifact_prefix="$crashes/" \
    "$corpus" "fuzz/corpus/$name" > "$log" 2>&1 || rc=$?
  if [ "$mode" = smoke ]; then rm -rf "$corpus"; fi
  # libFuzzer's final statistics: stat::number_of_executed_units.
  executions=$(awk '/^stat::number_of_executed_units:/ {n += $NF} END {print n + 0}' "$log")
  if [ "$rc" -eq 0 ]; then
    echo "fuzz $name: $executions executions, nothing found"
  else
    status=1
    echo "fuzz $name: $executions executions, FOUND a problem (exit $rc); inputs in $crashes/:"
    grep -E "ERROR: |SUMMARY: |Test unit written|deadly signal|uncaught exception" "$log" | head -20 || true
    tail -40 "$log"
  fi
  rm -f "$log"
done
exit "$status"
