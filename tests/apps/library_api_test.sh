#!/usr/bin/env bash
# Installs the build tree $1 into a scratch prefix under $3, configures and builds the
# examples project $2 against it (find_package(Tessera)), and runs its programs on one
# rank and, through the installed tessera-run, on two. Fails on any step.
set -euo pipefail
build_dir=$1 examples_dir=$2 work=$3
rm -rf "$work" && mkdir -p "$work"
cmake --install "$build_dir" --prefix "$work/prefix" --strip > "$work/install.log"
# Tessera's headers live under include/tessera/ only: none in the prefix's include/ itself.
test -f "$work/prefix/include/tessera/trainer/trainer.h" && test -f "$work/prefix/include/tessera/models/models.h"
test "$(ls "$work/prefix/include")" = "tessera"
launcher=()
command -v ccache > /dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
generator=()
command -v ninja > /dev/null && generator=(-G Ninja)
cmake -S "$examples_dir" -B "$work/build" "${generator[@]}" "${launcher[@]}" \
  -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$work/prefix" > "$work/configure.log"
cmake --build "$work/build" > "$work/build.log"
"$work/build/train_with_tessera" --dir "$work/one" --steps 60
# Two ranks: 40 steps, then a second invocation resumes from the step-40 checkpoint.
"$work/prefix/bin/tessera-run" --standalone --nproc-per-node 2 \
  "$work/build/train_with_tessera" --dir "$work/two" --steps 40
"$work/prefix/bin/tessera-run" --standalone --nproc-per-node 2 \
  "$work/build/train_with_tessera" --dir "$work/two" --steps 60 | tee "$work/resumed.log"
grep -q "steps 40 -> 60" "$work/resumed.log"
test -s "$work/one/regressor_ema.safetensors" && test -s "$work/two/regressor_ema.safetensors"
test -f "$work/two/checkpoints/step_00000060/metadata.json"
# Two models, two optimizers, one EMA, one checkpoint: it checks itself that the loss fell
# and that the run resumed from its checkpoint ends where the uninterrupted one does.
"$work/build/two_models_one_checkpoint" --dir "$work/two1"
"$work/prefix/bin/tessera-run" --standalone --nproc-per-node 2 \
  "$work/build/two_models_one_checkpoint" --dir "$work/two2"
test -s "$work/two1/decoder_ema.safetensors" && test -s "$work/two2/decoder_ema.safetensors"
test -f "$work/two2/checkpoints/step_00000020/metadata.json"
echo "library API: installed, both examples built and run on 1 and 2 ranks"
