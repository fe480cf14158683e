#!/usr/bin/env bash
# Everything issue 9 measures, for a lent GPU machine whose device time is short: each
# stage is one command (the device tool runs at most 10 minutes per call) and writes its
# log to $OUT (the folder the device tool brings back; default gpu-out/).
#
#   scripts/gpu-session.sh build    # scripts/gpu-build.sh (needs .gpu-debs/ carried along)
#   scripts/gpu-session.sh test     # the whole suite with the CUDA tests required
#   scripts/gpu-session.sh bench    # EMA, checkpoint and GPT-step benchmarks, FSDP2 baseline
#
# Several stages may be given in one call (build test). Nothing here is needed on a CPU
# machine; docs/benchmarks.md says which figures each stage produces.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
BUILD_DIR=${TESSERA_BUILD_DIR:-build-gpu}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
[ $# -gt 0 ] || { echo "usage: scripts/gpu-session.sh build|test|bench ..." >&2; exit 2; }

for stage in "$@"; do
  case "$stage" in
    build)
      scripts/gpu-build.sh 2>&1 | tail -40 > "$OUT/build.txt"
      ;;
    test)
      TESSERA_EXPECT_CUDA=1 ctest --test-dir "$BUILD_DIR" -j "$(nproc)" --timeout 600 --output-on-failure \
        > "$OUT/test.txt" 2>&1 || true
      tail -30 "$OUT/test.txt"
      ;;
    bench)
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/device.txt" 2>&1 || true
      "$BUILD_DIR/bin/bench_gpt_step_bench" --device cuda --embed 1024 --layers 24 --heads 16 --context 1024 \
        --batch 8 > "$OUT/gpt_step.txt" 2>&1 || true
      "$PYTHON" bench/fsdp2_gpt_step.py --embed 1024 --layers 24 --heads 16 --context 1024 --batch 8 \
        > "$OUT/gpt_step_fsdp2.txt" 2>&1 || true
      "$BUILD_DIR/bin/bench_ema_bench" --device cuda --params 1000000000 --iters 20 > "$OUT/ema.txt" 2>&1 || true
      "$BUILD_DIR/bin/bench_checkpoint_bench" --device cuda --mib 2048 --world 2 --reps 3 --dir /tmp/ckb \
        > "$OUT/checkpoint.txt" 2>&1 || true
      tail -3 "$OUT"/gpt_step*.txt
      ;;
    *)
      echo "gpu-session: unknown stage '$stage' (build, test, bench)" >&2
      exit 2
      ;;
  esac
done
