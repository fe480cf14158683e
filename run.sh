#!/usr/bin/env bash
# Installs what is missing, builds, and runs the main job: configs/default.yaml on
# 2 CPU ranks started by tessera-run. Extra arguments go to tessera-train
# (e.g. ./run.sh --set run.steps=50).
set -euo pipefail
cd "$(dirname "$0")"
./scripts/setup.sh
./scripts/build.sh tessera-train tessera-run   # the programs the main job runs (./test.sh builds the rest)
BIN=${TESSERA_BUILD_DIR:-build}/bin
RUN_DIR=$(sed -n 's/^  dir: *//p' configs/default.yaml | head -1)
for arg in "$@"; do
  case "$arg" in run.dir=*) RUN_DIR=${arg#run.dir=} ;; esac
done
rm -rf "$RUN_DIR"   # the main job starts fresh each time
LAUNCH=("$BIN/tessera-run" --standalone --nproc-per-node 2 --log-dir "$RUN_DIR/launcher" --tee)
echo "== part 1: train until step 150, checkpoint, stop"
"${LAUNCH[@]}" "$BIN/tessera-train" --config configs/default.yaml --set run.stop_after_steps=150 "$@"
echo "== part 2: resume from the checkpoint, finish, export model_ema"
"${LAUNCH[@]}" "$BIN/tessera-train" --config configs/default.yaml --resume auto "$@"
RUN_DIR=$(cd "$RUN_DIR" && pwd)   # the paths below, wherever ./run.sh was started from
echo
echo "run directory:   $RUN_DIR"
echo "resolved config: $RUN_DIR/config.resolved.yaml"
echo "metrics:         $RUN_DIR/metrics.jsonl"
echo "loss curve:      $RUN_DIR/loss.svg"
echo "checkpoints:     $RUN_DIR/checkpoints ($(ls "$RUN_DIR/checkpoints" | grep -c '^step_') kept)"
echo "export:          $(ls "$RUN_DIR"/export/*.safetensors | tr '\n' ' ')"
first=$(head -1 "$RUN_DIR/metrics.jsonl" | sed 's/.*"loss":\([0-9.]*\).*/\1/')
last=$(tail -1 "$RUN_DIR/metrics.jsonl" | sed 's/.*"loss":\([0-9.]*\).*/\1/')
echo "training loss:   $first (first window) -> $last (last window)"
