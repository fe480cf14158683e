#!/usr/bin/env bash
# Installs what is missing, builds, and runs the main job: configs/dit_quick.yaml, a small
# class-conditional DiT learning Fashion-MNIST on 2 CPU ranks started by tessera-run (zero3,
# EMA), stopped halfway and resumed, exported, drawn as a sample grid (2.5-4 minutes). Extra
# arguments go to tessera-train (e.g. ./run.sh --set run.steps=200).
set -euo pipefail
cd "$(dirname "$0")"
./scripts/setup.sh
./scripts/build.sh tessera-train tessera-run   # the programs the main job runs (./test.sh builds the rest)
BIN=${TESSERA_BUILD_DIR:-build}/bin
CONFIG=configs/dit_quick.yaml
RUN_DIR=$(sed -n 's/^  dir: *//p' "$CONFIG" | head -1)
HALF=$(( $(sed -n 's/^  steps: *//p' "$CONFIG" | head -1) / 2 ))
for arg in "$@"; do
  case "$arg" in run.dir=*) RUN_DIR=${arg#run.dir=} ;; esac
done
rm -rf "$RUN_DIR"   # the main job starts fresh each time
LAUNCH=("$BIN/tessera-run" --standalone --nproc-per-node 2 --log-dir "$RUN_DIR/launcher" --tee)
echo "== part 1: train until step $HALF, checkpoint, stop"
"${LAUNCH[@]}" "$BIN/tessera-train" --config "$CONFIG" --set run.stop_after_steps=$HALF "$@"
echo "== part 2: resume from the checkpoint, finish, export generator_ema, draw the sample grids"
"${LAUNCH[@]}" "$BIN/tessera-train" --config "$CONFIG" --resume auto "$@"
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
for grid in "$RUN_DIR"/samples/*generator_ema*.png; do
  [ -e "$grid" ] && last_grid=$grid
done
echo "sample grids:    $RUN_DIR/samples/ (one row per class; the last: ${last_grid:-none})"
