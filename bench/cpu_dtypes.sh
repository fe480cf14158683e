#!/usr/bin/env bash
# The CPU step in each compute dtype, measured in one run (docs/benchmarks.md, "bf16 on the
# CPU"): CONFIG trained STEPS steps on NPROC ranks under tessera-run as fp32, with bf16 Linear
# products (run.matmul_dtype: bf16) and with bf16 parameters (sharding.param_dtype: bf16, fp32
# masters), the three one after the other, ROUNDS times, so that a machine's slow minutes fall
# on each; prints each run's median images/s over its logged windows (the first, with its
# warm-up, left out) and last training loss, then each dtype's median against fp32's. The
# extra --set overrides come before the script's own, so they cannot change the dtypes, the
# step count, the run directory or the logging the figures are read from.
#   bench/cpu_dtypes.sh CONFIG STEPS NPROC ROUNDS [--set KEY=VALUE ...]
#   e.g. bench/cpu_dtypes.sh configs/fashion_dit.yaml 120 2 2 --set optim.schedule.warmup_steps=10
# Run from the repository root after ./scripts/build.sh; writes runs/cpu_dtypes_*.
set -euo pipefail
if [ $# -lt 4 ]; then sed -n 2,12p "$0" >&2; exit 2; fi
config=$1 steps=$2 nproc=$3 rounds=$4
for n in "$steps" "$nproc" "$rounds"; do
  [[ $n =~ ^[1-9][0-9]*$ ]] || { echo "cpu_dtypes.sh: STEPS, NPROC and ROUNDS must be positive integers, not '$n'" >&2; exit 2; }
done
shift 4
bin=${TESSERA_BUILD_DIR:-build}/bin
mkdir -p runs
summary=$(mktemp)
trap 'rm -f "$summary"' EXIT
for round in $(seq "$rounds"); do
  for dtype in fp32 bf16_linears bf16_params; do
    case $dtype in
      fp32) sets=(--set run.matmul_dtype=fp32 --set sharding.param_dtype=fp32) ;;
      bf16_linears) sets=(--set run.matmul_dtype=bf16 --set sharding.param_dtype=fp32) ;;
      bf16_params) sets=(--set run.matmul_dtype=fp32 --set sharding.param_dtype=bf16) ;;
    esac
    dir=runs/cpu_dtypes_$dtype
    rm -rf "$dir"
    "$bin/tessera-run" --standalone --nproc-per-node "$nproc" "$bin/tessera-train" --config "$config" "$@" \
        --set run.dir="$dir" --set run.steps="$steps" --set run.log_every=20 --set run.eval_every=0 \
        --set checkpoint.every_steps=0 --set checkpoint.export=[] "${sets[@]}" > "$dir.log" 2>&1 ||
      { tail -5 "$dir.log" >&2; exit 1; }
    python3 - "$dir/metrics.jsonl" "$dtype" "$round" <<'PY' | tee -a "$summary"
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
windows = [r for r in rows if isinstance(r.get("images_per_sec"), (int, float))][1:]
if not windows:
    sys.exit(f"{sys.argv[1]}: no images/s logged after the first window (an image model, and STEPS > 20?)")
ips = statistics.median(r["images_per_sec"] for r in windows)
loss = windows[-1].get("loss")
print(f"round {sys.argv[3]} {sys.argv[2]:13s} {ips:8.1f} images/s  last loss {float('nan') if loss is None else loss:.5f}")
PY
  done
done
python3 - "$summary" <<'PY'
import collections, statistics, sys
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    words = line.split()
    runs[words[2]].append(float(words[3]))
base = statistics.median(runs["fp32"])
for dtype, values in runs.items():
    m = statistics.median(values)
    print(f"{dtype:13s} median {m:8.1f} images/s: {m / base:.2f}x fp32's images/s ({base / m:.2f}x its step)")
PY
