#!/usr/bin/env bash
# Installs the build tree $1 into a scratch prefix under $3, checks what the prefix holds,
# configures and builds the examples project $2 against it (find_package(Tessera), the
# static libraries), runs its programs on one rank and, through the installed tessera-run,
# on two; then builds them against libtessera.so, once through CMake (tessera::shared) and
# once with pkg-config alone, and runs those. Fails on any step.
set -euo pipefail
build_dir=$1 examples_dir=$2 work=$3
rm -rf "$work" && mkdir -p "$work"
cmake --install "$build_dir" --prefix "$work/prefix" --strip > "$work/install.log"
# Tessera's headers live under include/tessera/ only: none in the prefix's include/ itself.
test -f "$work/prefix/include/tessera/trainer/trainer.h" && test -f "$work/prefix/include/tessera/models/models.h"
test "$(ls "$work/prefix/include")" = "tessera"
# The libraries static and shared, the programs users run and nothing else (no tests,
# no benchmarks), a CMake package and a pkg-config file.
lib=$(dirname "$(find "$work/prefix" -name libtessera_trainer.a)")
test -f "$lib/libtessera_common.a" && test -f "$lib/libtessera.so" && test -f "$lib/pkgconfig/tessera.pc"
test -f "$lib/cmake/Tessera/TesseraConfig.cmake"
for program in "$work"/prefix/bin/*; do
  case "$(basename "$program")" in
    tessera-*) ;;
    *) echo "not a program users run: $program" >&2; exit 1 ;;
  esac
done
test -x "$work/prefix/bin/tessera-train" && test -x "$work/prefix/bin/tessera-run"
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

# The same programs against the shared library, through CMake and through pkg-config.
cmake -S "$examples_dir" -B "$work/build-shared" "${generator[@]}" "${launcher[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$work/prefix" -DTESSERA_EXAMPLES_SHARED=ON > "$work/configure-shared.log"
cmake --build "$work/build-shared" > "$work/build-shared.log"
readelf -d "$work/build-shared/train_with_tessera" | grep -q "NEEDED.*libtessera.so"
if readelf -d "$work/build-shared/train_with_tessera" | grep -q "NEEDED.*libtessera_"; then
  echo "the shared build links a static library's name" >&2; exit 1
fi
"$work/build-shared/train_with_tessera" --dir "$work/shared" --steps 30
"$work/build-shared/two_models_one_checkpoint" --dir "$work/shared2"
compiler=(g++)
command -v ccache > /dev/null && compiler=(ccache g++)
export PKG_CONFIG_PATH="$lib/pkgconfig"
# shellcheck disable=SC2046  # pkg-config's flags are meant to be split into words
"${compiler[@]}" -std=c++17 -O2 "$examples_dir/train_with_tessera.cpp" -o "$work/train_with_tessera_pc" \
  $(pkg-config --cflags --libs tessera)
readelf -d "$work/train_with_tessera_pc" | grep -q "NEEDED.*libtessera.so"
"$work/train_with_tessera_pc" --dir "$work/pkgconfig" --steps 30
test -s "$work/shared/regressor_ema.safetensors" && test -s "$work/pkgconfig/regressor_ema.safetensors"
echo "library API: installed; both examples built against the static libraries and run on 1 and 2 ranks;" \
     "built against libtessera.so through CMake and pkg-config and run"
