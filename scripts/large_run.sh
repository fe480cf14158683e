#!/usr/bin/env bash
# Trains configs/large.yaml (604M parameters, zero3) for 4 steps on 8 ranks, stops with a
# sharded checkpoint, resumes it on 4 ranks for the last 2 steps, exports generator_ema
# offline with tessera-export, and prints the peak memory per rank of each part (the
# largest over the ranks, VmHWM, set-up included). Needs ~16 GB of memory and ~30 GB of
# disk under RUN_DIR (default runs/large). Usage: scripts/large_run.sh [RUN_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_DIR=${1:-runs/large}
./scripts/build.sh tessera-train tessera-run tessera-export >/dev/null
BIN=${TESSERA_BUILD_DIR:-build}/bin
rm -rf "$RUN_DIR"
peak() { sed -n 's/.*"peak_rss_mib":\([0-9.]*\).*/\1/p' "$RUN_DIR/metrics.jsonl" | tail -1; }
start=$(date +%s)
"$BIN/tessera-run" --standalone --nproc-per-node 8 "$BIN/tessera-train" --config configs/large.yaml \
  --set run.dir="$RUN_DIR" --set run.stop_after_steps=4 --set log.per_rank_files=false 2>&1 | grep -v "^\[rank [1-9]\]" | tail -4
echo "== 8 ranks, zero3: peak RSS per rank $(peak) MiB; $(( $(date +%s) - start )) s"
start=$(date +%s)
"$BIN/tessera-run" --standalone --nproc-per-node 4 "$BIN/tessera-train" --config configs/large.yaml \
  --set run.dir="$RUN_DIR" --resume auto --set log.per_rank_files=false 2>&1 | grep -E "resumed from|\[rank 0\].*step [0-9]" | tail -3
echo "== resumed on 4 ranks, zero3: peak RSS per rank $(peak) MiB; $(( $(date +%s) - start )) s"
start=$(date +%s)
TIME=()
[ -x /usr/bin/time ] && TIME=(/usr/bin/time -f "== tessera-export: peak RSS %M KiB, %e s")
"${TIME[@]}" "$BIN/tessera-export" "$RUN_DIR/checkpoints" --what generator_ema \
  --out "$RUN_DIR/export/generator_ema.safetensors"
ls -l "$RUN_DIR/export/generator_ema.safetensors"
du -sh "$RUN_DIR/checkpoints"
