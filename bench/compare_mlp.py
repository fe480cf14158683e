#!/usr/bin/env python3
"""The 8.4M-parameter MLP (1024-2048-2048-1024, MSE, AdamW, global batch 64, 1 thread per
rank) on N ranks: each Tessera strategy against the PyTorch baseline that does the same job
(bench/vs_pytorch_reference.py: AdamW foreach=True, bucket views, gloo, its fastest OpenBLAS
kernel) — no_shard against DistributedDataParallel, zero1 and zero2 against ZeRO-1 (DDP +
ZeroRedundancyOptimizer; PyTorch 1.13 has no ZeRO-2), zero3 against ZeRO-1 and DDP (1.13 runs
FSDP only on CUDA). Both sides multiply through LibTorch's OpenBLAS (torch::nn::Linear) with
the same kernel. Each Tessera strategy is measured as shipped (shared memory, its caching
allocator, its fused AdamW) and like for like (gloo, LibTorch's allocator, torch's foreach AdamW
through TESSERA_ADAM_IMPL=foreach). Every side in its own processes,
alternated (ABBA), at least 5 rounds (bench/compare_common.py).

    bench/compare_mlp.py [--worlds 2 4] [--rounds 5] [--warmup 5] [--steps 30] [--json FILE]
"""

import argparse
import json
import os

import compare_common as cc
from fastest_blas import fastest_env

WIDTHS = [1024, 2048, 2048, 1024]
PHASES = ("forward", "backward", "step")


def with_phases(output, tmp):
    """Both sides print one JSON line: the mean step and the median of each phase (forward;
    backward with the reductions it issues; step: the rest of the reductions, the optimizer,
    ZeRO's parameter all-gathers or broadcasts)."""
    for line in output.splitlines():
        if '"framework"' in line:
            result = json.loads(line[line.index("{"):])
            return result["step_s_mean"], result.get("phases_median_s", {})
    raise SystemExit(f"compare: no result line:\n{output[-4000:]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--build", default=os.path.join(cc.ROOT, "build"))
    parser.add_argument("--python", default="/usr/bin/python3")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    if args.steps < 10:
        parser.error("--steps: at least 10")
    where = cc.machine()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    shapes = []
    for world in args.worlds:
        rows = 64 // world
        for a, b in zip(WIDTHS, WIDTHS[1:]):
            shapes += [(rows, a, b), (rows, b, a), (b, rows, a)]  # forward, input and weight gradients
    blas_env, blas = fastest_env(args.python, env, shapes)
    print(blas, flush=True)  # the same kernel for both sides: both multiply through LibTorch's OpenBLAS
    common = ["--widths", *map(str, WIDTHS), "--global-batch", "64", "--warmup", str(args.warmup), "--steps",
              str(args.steps), "--threads", "1"]
    lines = []
    all_sides = []
    for world in args.worlds:
        def pytorch(mode):
            return cc.Side(f"{mode}_w{world}",
                           [args.python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
                            "--redirects", "1", "--tee", "1", os.path.join(cc.ROOT, "bench", "vs_pytorch_reference.py"),
                            "--mode", mode, *common], blas_env, with_phases, {"mode": mode})

        def tessera(strategy, like):
            # Like for like: PyTorch's transport, its allocator and its optimizer kernel (foreach).
            extra = ["--backend", "gloo", "--torch-allocator"] if like else []
            side_env = dict(blas_env, TESSERA_ADAM_IMPL="foreach") if like else blas_env
            return cc.Side(f"{strategy}{' (gloo, torch allocator, foreach AdamW)' if like else ' (shipped)'}_w{world}",
                           [os.path.join(args.build, "bin", "tessera-run"), "--standalone", "--nproc-per-node", str(world),
                            os.path.join(args.build, "bin", "bench_strategy_step_bench"), "--strategy", strategy, *common,
                            *extra], side_env, with_phases, {"strategy": strategy, "like_for_like": like})

        ddp, zero1 = pytorch("ddp"), pytorch("ddp_zero")
        tessera_sides = {(s, like): tessera(s, like) for s in ("no_shard", "zero1", "zero2", "zero3") for like in (False, True)}
        sides = [ddp, zero1, *tessera_sides.values()]
        cc.alternate(sides, args.rounds)
        all_sides += sides
        command = f"bench/compare_mlp.py --worlds {world}"
        for (strategy, like), side in tessera_sides.items():
            flavour = "gloo, torch allocator, foreach AdamW" if like else "shm, caching allocator, fused AdamW"
            baselines = [("DDP", ddp)] if strategy == "no_shard" else [("ZeRO-1", zero1)]
            if strategy == "zero3":
                baselines.append(("DDP", ddp))
            for name, base in baselines:
                lines.append(cc.row(f"MLP 8.4M, {world} ranks: {strategy} ({flavour}) vs {name}", side, base, command,
                                    where))
    print(f"\n{where['cpu']}, {where['cores']} cores, {where['date']}, commit {where['commit']}; {blas}; "
          f"{args.rounds} rounds of {args.steps} steps after {args.warmup}\n")
    print(cc.header())
    for line in lines:
        print(line)
    print("\nPhases, ms (median over rounds of each side's median step): forward / backward / step")
    for side in all_sides:
        print(f"  {side.name}: " + " / ".join(f"{(cc.median_extra(side, p) or 0) * 1e3:.1f}" for p in PHASES))
    cc.dump(args.json, where, all_sides)


if __name__ == "__main__":
    main()
