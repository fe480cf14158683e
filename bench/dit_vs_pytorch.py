#!/usr/bin/env python3
"""Images per second of Tessera's DiT step against the same model trained by PyTorch
(issue 32), in one invocation on this machine: configs/dit_quick.yaml under tessera-run
(zero3, as the main job, and no_shard, DDP's layout) against bench/dit_pytorch_ddp.py
under torchrun (DistributedDataParallel, Debian's python3-torch), the same world size,
global batch, model and thread count (1 per rank), interleaved repetition by repetition;
PyTorch with the fastest OpenBLAS kernel this core runs (bench/fastest_blas.py).
Tessera's figure is the steady state of its metrics.jsonl (windows after the first);
PyTorch's the steps after its warm-up. Above 1.0x, Tessera is faster.

    bench/dit_vs_pytorch.py [--world 2] [--reps 3] [--steps 300] [--build build]
"""

import argparse
import json
import os
import shutil
import subprocess
import sys

from fastest_blas import fastest_env
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(command, env):
    result = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            timeout=1200, check=False)
    if result.returncode != 0:
        sys.exit(f"dit_vs_pytorch: {' '.join(command)} exited {result.returncode}:\n{result.stdout[-4000:]}")
    return result.stdout


def tessera(args, strategy, env):
    run_dir = tempfile.mkdtemp(prefix="tessera_dit_bench_")
    try:
        run([os.path.join(args.build, "bin", "tessera-run"), "--standalone", "--nproc-per-node", str(args.world),
             os.path.join(args.build, "bin", "tessera-train"), "--config", os.path.join(ROOT, "configs", "dit_quick.yaml"),
             "--set", f"run.dir={run_dir}", "--set", f"run.steps={args.steps}", "--set", f"run.log_every={args.steps // 5}",
             "--set", f"run.eval_every={args.steps}", "--set", "checkpoint.every_steps=0", "--set", "checkpoint.at_end=false",
             "--set", "checkpoint.export=[]", "--set", f"sharding.strategy={strategy}", "--set", "log.per_rank_files=false",
             "--set", "eval.sample_per_class=1", "--set", "eval.sample_steps=1",
             # the baseline's loss: noise prediction on DDPM's linear schedule (the main job
             # predicts the velocity now; the step's cost is the same)
             "--set", "model.prediction=eps", "--set", "model.noise_schedule=linear",
             "--set", "model.zero_terminal_snr=false"], env)
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            windows = [json.loads(line) for line in f]
        steady = [w["samples_per_sec"] for w in windows[1:]]
        return sum(steady) / len(steady)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def pytorch(args, env):
    # Debian's torchrun 1.13 on Python 3.11 needs --redirects and --tee set.
    out = run([args.python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.world),
               "--redirects", "1", "--tee", "1",
               os.path.join(ROOT, "bench", "dit_pytorch_ddp.py"), "--steps", str(args.steps)], env)
    for line in out.splitlines():
        if '"framework"' in line:
            return json.loads(line[line.index("{"):])["images_per_sec"]
    sys.exit(f"dit_vs_pytorch: no result from PyTorch:\n{out[-4000:]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--baseline-blas", choices=["fastest", "as-given"], default="fastest",
                        help="PyTorch's OpenBLAS kernel: the fastest this core runs (bench/fastest_blas.py), "
                             "or the environment's")
    parser.add_argument("--python", default="/usr/bin/python3", help="the Python with torch (python3-torch)")
    args = parser.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    baseline_env = env
    if args.baseline_blas == "fastest":
        baseline_env, line = fastest_env(args.python, env)
        print(line, flush=True)
    results = {"pytorch_ddp": [], "tessera_no_shard": [], "tessera_zero3": []}
    for rep in range(args.reps):
        results["pytorch_ddp"].append(pytorch(args, baseline_env))
        results["tessera_no_shard"].append(tessera(args, "no_shard", env))
        results["tessera_zero3"].append(tessera(args, "zero3", env))
        print(f"rep {rep + 1}: " + ", ".join(f"{k} {v[-1]:.0f} images/s" for k, v in results.items()), flush=True)
    best = {k: max(v) for k, v in results.items()}
    print(f"\nDiT of configs/dit_quick.yaml, {args.world} ranks, global batch 64, 1 thread per rank, "
          f"best of {args.reps}:")
    for key, value in best.items():
        print(f"  {key:18s} {value:8.0f} images/s  {value / best['pytorch_ddp']:.2f}x PyTorch DDP")


if __name__ == "__main__":
    main()
