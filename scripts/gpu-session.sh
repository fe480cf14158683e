#!/usr/bin/env bash
# Everything the GPU issues measure, for a lent GPU machine whose device time is short:
# each stage writes one log into $OUT (the folder the device tool brings back, at most 8
# files; default gpu-out/), bounded by its own time limit, so one call can run them all and
# a stage that fails or runs long leaves the others' figures.
#
#   scripts/gpu-session.sh build       # scripts/gpu-build.sh (needs .gpu-debs/ carried along);
#                                      # TESSERA_GPU_TARGETS=all builds everything
#   scripts/gpu-session.sh step        # plain LibTorch loop vs Tessera zero3 vs FSDP2, all with
#                                      # fused AdamW, separate processes alternated over
#                                      # STEP_ROUNDS rounds: GPT-2 small, DiT-XL/2; Chrome traces
#                                      # with memory events into $OUT/traces_{gpt,dit}.tar.gz
#   scripts/gpu-session.sh cuda-test   # the CUDA tests (tests/cuda), required to run
#   scripts/gpu-session.sh offload     # zero3 with CPU offload vs FSDP2's CPUOffloadPolicy, GPT-2 XL
#   scripts/gpu-session.sh largest     # the largest GPT one step trains, without and with offload
#   scripts/gpu-session.sh train       # tessera-train on cuda (nccl) vs cpu, bf16, stop + resume
#                                      # (needs Fashion-MNIST's t10k files in .gpu-data/)
#   scripts/gpu-session.sh checkpoint  # checkpoint bench of GPU state, checksums inline vs pipelined
#   scripts/gpu-session.sh ema         # the EMA update over 1B parameters vs copy bandwidth
#   scripts/gpu-session.sh test        # the whole suite with the CUDA tests required
#
# Several stages may be given in one call (build step cuda-test train checkpoint);
# GPU_SESSION_SECONDS (default 570) bounds them all: each command gets at most its own
# limit and what is left of that, so the call returns with its logs before the device
# tool's limit.
# Nothing here is needed on a CPU machine; docs/benchmarks.md says which figures each
# stage produced.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
BUILD_DIR=${TESSERA_BUILD_DIR:-build-gpu}
BIN=$BUILD_DIR/bin
PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1  # a stage stopped at its limit keeps what it printed
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
DEADLINE=$(( $(date +%s) + ${GPU_SESSION_SECONDS:-570} ))
[ $# -gt 0 ] || { echo "usage: scripts/gpu-session.sh build|step|offload|largest|cuda-test|train|checkpoint|ema|test ..." >&2; exit 2; }

# Runs "$@" for at most $1 seconds (and never past the deadline), its output appended to
# the log $2.
bounded() {
  local limit=$1 log=$2
  shift 2
  local left=$(( DEADLINE - $(date +%s) - 5 ))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -le 0 ]; then
    echo "(skipped, no time left: $*)" >> "$log"
    return 0
  fi
  echo "\$ $*" >> "$log"
  timeout --kill-after=10 "$limit" "$@" >> "$log" 2>&1
  local rc=$?
  [ $rc -eq 0 ] || echo "(exit status $rc)" >> "$log"
  return 0
}

for stage in "$@"; do
  start=$(date +%s)
  case "$stage" in
    build)
      targets=${TESSERA_GPU_TARGETS:-tessera-train tessera_cuda_tests bench_step_bench bench_checkpoint_bench}
      args=""
      [ "$targets" = all ] || for t in $targets; do args="$args --target $t"; done
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/build.txt" 2>&1
      export TESSERA_BUILD_ARGS="$args -- -k 0"  # every error in one go
      bounded 400 /tmp/gpu-build.log scripts/gpu-build.sh -DCMAKE_CUDA_ARCHITECTURES=90
      grep -E "error:|Error|KINETO|gpu-build" /tmp/gpu-build.log | head -60 >> "$OUT/build.txt"
      tail -15 /tmp/gpu-build.log >> "$OUT/build.txt"
      ;;
    step)
      log=$OUT/step.txt
      mkdir -p /tmp/traces
      # TESSERA_GPU_TRACES=0: no traces (each costs seconds of device time).
      tr() { [ "${TESSERA_GPU_TRACES:-1}" = 0 ] || echo "--trace /tmp/traces/$1.json"; }
      # The plain loop (fused AdamW), Tessera's zero3 and FSDP2 (AdamW fused=True), each in its
      # own process, alternated over STEP_ROUNDS rounds (default 3) in a rotating order;
      # traces in the first round; bench/step_rounds.py gives each one's median and range.
      # GPT-2 small (124M parameters, context 1024); DiT-XL/2 (675M parameters) on 32x32x4
      # latents (256 tokens), as the DiT paper's 256 px.
      gpt=(--model gpt --embed 768 --layers 12 --heads 12 --context 1024 --batch 16)
      dit=(--model dit --embed 1152 --layers 28 --heads 16 --image 32 --channels 4 --patch 2 --classes 1000 --batch 32)
      timed=(--steps 10 --warmup 3)
      for model in gpt dit; do
        echo "== model $model" >> "$log"
        if [ "$model" = gpt ]; then shape=("${gpt[@]}"); else shape=("${dit[@]}"); fi
        for round in $(seq 1 "${STEP_ROUNDS:-3}"); do
          order=(plain tessera fsdp2)
          for i in 0 1 2; do
            variant=${order[$(( (i + round - 1) % 3 ))]}
            trace=""
            [ "$round" = 1 ] && trace=$(tr "${variant}_$model")
            if [ "$variant" = fsdp2 ]; then
              bounded 90 "$log" "$PYTHON" bench/fsdp2_step.py "${shape[@]}" "${timed[@]}" $trace
            else
              bounded 90 "$log" "$BIN/bench_step_bench" --device cuda "${shape[@]}" "${timed[@]}" --rounds 1 \
                --only "$variant" $trace
            fi
          done
        done
      done
      "$PYTHON" bench/step_rounds.py "$log" | tee -a "$log"
      # The traces are drawn off the machine (scripts/trace_timeline.py needs no GPU).
      (cd /tmp/traces && ls ./*gpt*.json >/dev/null 2>&1 && tar czf "$OUT/traces_gpt.tar.gz" ./*gpt*.json)
      (cd /tmp/traces && ls ./*dit*.json >/dev/null 2>&1 && tar czf "$OUT/traces_dit.tar.gz" ./*dit*.json)
      ls -la "$OUT" >> "$log"
      ;;
    offload)
      log=$OUT/offload.txt
      # GPT-2 XL (1.64B parameters with this vocabulary): masters, gradients and AdamW on the
      # host; against FSDP2 with CPUOffloadPolicy and without (no plain loop: it initialises
      # the model on the GPU through the host, likely what used the stage's 150 s before).
      xl=(--model gpt --embed 1600 --layers 48 --heads 25 --context 1024 --batch 4)
      bounded 150 "$log" "$BIN/bench_step_bench" --device cuda "${xl[@]}" --offload --offload-only --steps 3 --warmup 1
      bounded 120 "$log" "$PYTHON" bench/fsdp2_step.py "${xl[@]}" --offload --steps 3 --warmup 1
      bounded 90 "$log" "$PYTHON" bench/fsdp2_step.py "${xl[@]}" --steps 3 --warmup 1
      ;;
    largest)
      log=$OUT/largest.txt
      # The largest GPT that trains on this GPU, without and with CPU offload: sizes tried from
      # the largest down until one step runs (an out-of-memory ends an attempt with exit 1).
      # Without offload a rank holds ~16 bytes per parameter on the GPU; with it, on the host
      # (page-locked), so host memory bounds it there. Batch 1 x 1024 tokens.
      for mode in zero3 offload; do
        flags=(--steps 1 --warmup 1 --rounds 1)
        if [ "$mode" = offload ]; then flags+=(--offload --offload-only); else flags+=(--no-plain); fi
        # Offload holds 16 bytes per parameter in page-locked host memory: its sizes start
        # well below the host's 128 GiB (5.6B: 90 GB; 8.2B would meet the OOM killer).
        sizes=("4096 40 32" "4096 34 32" "4096 27 32" "4096 20 32")
        [ "$mode" = offload ] && sizes=("4096 27 32" "4096 20 32" "2560 36 20")
        # The first mode gets half of the time left, so that the second one runs too.
        saved_deadline=$DEADLINE
        [ "$mode" = zero3 ] && DEADLINE=$(( $(date +%s) + (DEADLINE - $(date +%s)) / 2 ))
        for size in "${sizes[@]}"; do
          set -- $size
          echo "== $mode: embed $1, $2 layers" >> "$log"
          before=$(wc -l < "$log")
          bounded 150 "$log" "$BIN/bench_step_bench" --device cuda --model gpt --embed "$1" --layers "$2" --heads "$3" \
            --context 1024 --batch 1 "${flags[@]}"
          tail -n +"$before" "$log" | grep -q "^step: " && break
        done
        DEADLINE=$saved_deadline
      done
      ;;
    cuda-test)
      TESSERA_EXPECT_CUDA=1 bounded 240 "$OUT/cuda_test.txt" "$BIN/tessera_cuda_tests" --gtest_brief=1
      tail -5 "$OUT/cuda_test.txt"
      ;;
    train)
      log=$OUT/train.txt
      d=.gpu-data
      data=(--set "data.path=$d/t10k-images-idx3-ubyte.gz" --set "data.labels=$d/t10k-labels-idx1-ubyte.gz"
            --set "data.eval_path=$d/t10k-images-idx3-ubyte.gz" --set "data.eval_labels=$d/t10k-labels-idx1-ubyte.gz"
            --set run.steps=200 --set run.log_every=50 --set checkpoint.every_steps=100)
      rm -rf /tmp/tr && mkdir -p /tmp/tr
      bounded 120 "$log" "$BIN/tessera-train" --config configs/gpu_dit.yaml "${data[@]}" --set run.dir=/tmp/tr/cuda
      bounded 120 "$log" "$BIN/tessera-train" --config configs/gpu_dit.yaml "${data[@]}" --set run.dir=/tmp/tr/cpu \
        --set run.device=cpu
      bounded 120 "$log" "$BIN/tessera-train" --config configs/gpu_dit.yaml "${data[@]}" --set run.dir=/tmp/tr/resumed \
        --set run.stop_after_steps=100
      bounded 120 "$log" "$BIN/tessera-train" --config configs/gpu_dit.yaml "${data[@]}" --set run.dir=/tmp/tr/resumed
      bounded 120 "$log" "$BIN/tessera-train" --config configs/gpu_dit.yaml "${data[@]}" --set run.dir=/tmp/tr/bf16 \
        --set sharding.param_dtype=bf16
      bounded 60 "$log" "$PYTHON" scripts/compare_exports.py /tmp/tr/cuda/export/generator_ema.safetensors \
        /tmp/tr/cpu/export/generator_ema.safetensors /tmp/tr/resumed/export/generator_ema.safetensors \
        /tmp/tr/bf16/export/generator_ema.safetensors
      for r in cuda cpu resumed bf16; do echo "== $r metrics" >> "$log"; cat /tmp/tr/$r/metrics.jsonl >> "$log" 2>&1; done
      (cd /tmp/tr && tar czf "$OUT/train_runs.tar.gz" cuda/samples cuda/loss.svg bf16/samples 2>/dev/null)
      ;;
    checkpoint)
      log=$OUT/checkpoint.txt
      for pipeline in 0 1; do
        echo "== TESSERA_CHECKPOINT_PIPELINE=$pipeline" >> "$log"
        TESSERA_CHECKPOINT_PIPELINE=$pipeline bounded 120 "$log" "$BIN/bench_checkpoint_bench" --device cuda --mib 2048 \
          --world 2 --reps 3 --dir /tmp/ckb
      done
      ;;
    ema)
      bounded 120 "$OUT/ema.txt" "$BIN/bench_ema_bench" --device cuda --params 1000000000 --iters 20
      ;;
    test)
      TESSERA_EXPECT_CUDA=1 bounded 560 "$OUT/test.txt" ctest --test-dir "$BUILD_DIR" -j "$(nproc)" --timeout 300 \
        --output-on-failure
      tail -30 "$OUT/test.txt"
      ;;
    *)
      echo "gpu-session: unknown stage '$stage' (build, step, offload, largest, cuda-test, train, checkpoint, ema, test)" >&2
      exit 2
      ;;
  esac
  echo "gpu-session: stage $stage took $(( $(date +%s) - start )) s" | tee -a "$OUT/build.txt"
done
