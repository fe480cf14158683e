#!/usr/bin/env bash
# One row of the DiT quality ablations (docs/benchmarks.md, issue 46): trains CONFIG with the
# given --set overrides under tessera-run into runs/ablation_NAME, then judges its
# generator_ema as the docs do (1000 samples: 100 per class, seed 1, DDIM 50 steps, guidance
# 2) with the Fashion-MNIST classifier (configs/fashion_classifier.yaml, trained first), and
# prints the training time, the accuracy and the Frechet distance, and each class's accuracy
# beside the classifier's on real images of that class.
#   bench/dit_ablation.sh NAME CONFIG NPROC [--set KEY=VALUE ...]
#   e.g. bench/dit_ablation.sh v_cosine configs/dit_quick.yaml 2 --set model.prediction=v \
#          --set model.zero_terminal_snr=true --set model.noise_schedule=cosine
# Run from the repository root after ./scripts/build.sh.
set -euo pipefail
if [ $# -lt 3 ]; then sed -n 2,9p "$0" >&2; exit 2; fi
name=$1 config=$2 nproc=$3
shift 3
bin=${TESSERA_BUILD_DIR:-build}/bin
judge=runs/fashion_classifier/export/model_ema.safetensors
[ -f "$judge" ] || { echo "dit_ablation.sh: no judge at $judge: train configs/fashion_classifier.yaml first" >&2; exit 2; }
dir=runs/ablation_$name
rm -rf "$dir"
start=$(date +%s)
"$bin/tessera-run" --standalone --nproc-per-node "$nproc" "$bin/tessera-train" --config "$config" \
    --set run.dir="$dir" "$@" > "$dir.train.log" 2>&1 || { tail -20 "$dir.train.log" >&2; exit 1; }
trained=$(date +%s)
"$bin/tessera-run" --standalone --nproc-per-node "$nproc" "$bin/tessera-sample" \
    --weights "$dir/export/generator_ema.safetensors" --per-class 100 --seed 1 --steps 50 --cfg 2 \
    --judge "$judge" --out "$dir.samples.png" > "$dir.judge.log" 2>&1 || { tail -20 "$dir.judge.log" >&2; exit 1; }
accuracy=$(sed -n 's/.*judge: accuracy \([0-9.]*\).*/\1/p' "$dir.judge.log" | head -1)
frechet=$(sed -n 's/.*judge: Frechet distance \([0-9.]*\).*/\1/p' "$dir.judge.log" | head -1)
echo "$name: trained in $((trained - start)) s; accuracy $accuracy, Frechet distance $frechet ($*)"
sed -n 's/.*judge: per class asked for, accuracy (the classifier on real ones): /  per class (real images): /p' "$dir.judge.log" | head -1
