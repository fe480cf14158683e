#!/usr/bin/env python3
"""Tessera's four strategies against PyTorch on the same job, in one invocation (issue 18).

For each world size, runs PyTorch's DistributedDataParallel and DDP + ZeroRedundancyOptimizer
(bench/vs_pytorch_reference.py under torchrun, Debian's python3-torch) and Tessera's
no_shard, zero1, zero2 and zero3 (build/bin/bench_strategy_step_bench under tessera-run)
on the same MLP, global batch, data and thread count (PyTorch with the fastest OpenBLAS
kernel this core runs: bench/fastest_blas.py), interleaved repetition by
repetition, and prints each one's median step time (best of the repetitions) with its
ratio to the PyTorch baseline that does the same job: no_shard against DDP, the ZeRO
stages against DDP + ZeroRedundancyOptimizer. Below 1.0x, Tessera is faster.

    bench/vs_pytorch.py [--worlds 2 4] [--reps 2] [--steps 15] [--build build]
"""

import argparse
import json
import os
import subprocess
import sys

from fastest_blas import fastest_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BASELINE = {"no_shard": "ddp", "zero1": "ddp_zero", "zero2": "ddp_zero", "zero3": "ddp_zero"}
BASELINE_NAME = {"ddp": "DDP", "ddp_zero": "DDP + ZeroRedundancyOptimizer"}


def run_json(command, env):
    """Runs a bench command and returns the JSON line rank 0 printed."""
    result = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, timeout=600, check=False)
    if result.returncode != 0:
        sys.exit(f"vs_pytorch: {' '.join(command)} exited {result.returncode}:\n{result.stdout[-4000:]}")
    for line in result.stdout.splitlines():
        if '"framework"' in line and "{" in line:  # after the launcher's rank prefix
            return json.loads(line[line.index("{"):])
    sys.exit(f"vs_pytorch: no result line from {' '.join(command)}:\n{result.stdout[-4000:]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--widths", type=int, nargs="+", default=[1024, 2048, 2048, 1024])
    parser.add_argument("--strategies", nargs="+", default=["no_shard", "zero1", "zero2", "zero3"])
    parser.add_argument("--build", default=os.path.join(ROOT, "build"), help="Tessera's build directory")
    parser.add_argument("--baseline-blas", choices=["fastest", "as-given"], default="fastest",
                        help="PyTorch's OpenBLAS kernel: the fastest this core runs (bench/fastest_blas.py), "
                             "or the environment's")
    parser.add_argument("--python", default="/usr/bin/python3",
                        help="the Python with torch (Debian's python3-torch)")
    args = parser.parse_args()

    tessera_bench = os.path.join(args.build, "bin", "bench_strategy_step_bench")
    launcher = os.path.join(args.build, "bin", "tessera-run")
    for path in (tessera_bench, launcher):
        if not os.access(path, os.X_OK):
            sys.exit(f"vs_pytorch: {path} is missing: build first (scripts/build.sh, or ./test.sh)")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    baseline_env = env
    if args.baseline_blas == "fastest":
        baseline_env, line = fastest_env(args.python, env)
        print(line, flush=True)
    common = ["--widths", *map(str, args.widths), "--global-batch", str(args.global_batch),
              "--warmup", str(args.warmup), "--steps", str(args.steps), "--threads", "1"]
    params = sum(a * b + b for a, b in zip(args.widths, args.widths[1:]))
    print(f"MLP {'-'.join(map(str, args.widths))} ({params / 1e6:.1f}M parameters), global batch "
          f"{args.global_batch}, AdamW, 1 thread per rank; Tessera over shm (its default on one host), PyTorch over gloo; median step time of {args.steps} steps "
          f"after {args.warmup}, best of {args.reps} repetitions", flush=True)

    for world in args.worlds:
        best = {}
        collectives = {}
        for rep in range(args.reps):
            for mode in ("ddp", "ddp_zero"):
                out = run_json([args.python, "-m", "torch.distributed.run", "--standalone",
                                "--nproc_per_node", str(world), "--redirects", "1", "--tee", "1",  # torchrun 1.13 on Python 3.11 cannot parse its defaults
                                os.path.join(ROOT, "bench", "vs_pytorch_reference.py"),
                                "--mode", mode, *common], baseline_env)
                best[mode] = min(best.get(mode, float("inf")), out["median_s"])
            for strategy in args.strategies:
                out = run_json([launcher, "--standalone", "--nproc-per-node", str(world), tessera_bench,
                                "--strategy", strategy, *common], env)
                best[strategy] = min(best.get(strategy, float("inf")), out["median_s"])
                collectives[strategy] = out["collectives_per_step"]
            print(f"  world {world}: repetition {rep + 1} of {args.reps} done", file=sys.stderr, flush=True)
        print(f"\nworld size {world}\n")
        print("| Tessera | step | collectives/step | PyTorch | step | Tessera / PyTorch |")
        print("|---|---|---|---|---|---|")
        for strategy in args.strategies:
            base = BASELINE[strategy]
            print(f"| {strategy} | {best[strategy]:.3f} s | {collectives[strategy]:.0f} | {BASELINE_NAME[base]} | "
                  f"{best[base]:.3f} s | **{best[strategy] / best[base]:.2f}x** |", flush=True)


if __name__ == "__main__":
    main()
