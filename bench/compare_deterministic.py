#!/usr/bin/env python3
"""run.deterministic against the default mode (issue 71): the main job's DiT
(configs/dit_quick.yaml as shipped, data.micro_batch 8: 8 micro-batches a step) on N ranks,
the same tessera-train with and without --set run.deterministic=true, each in its own
processes, alternated (ABBA), at least 5 rounds of --steps timed steps after --warmup;
medians with their ranges (bench/compare_common.py), and the bytes each rank sends a step
(metrics.jsonl's comm_mib over the window's steps).

The default mode overlaps its reduce-scatters with the backward and sums in the ring's
order; the deterministic mode keeps each micro-batch's gradients apart, sums them in the
canonical tree after the last backward, and gathers each rank's slice from every rank
(sharding/canonical_reduce.h). Both run one intra-op thread per rank here (OMP_NUM_THREADS=1,
what the deterministic mode sets itself).

    bench/compare_deterministic.py [--world 2] [--strategy zero3] [--rounds 5] [--warmup 20] [--steps 100]
"""

import argparse
import os

import compare_common as cc


def side(args, name, deterministic):
    command = [os.path.join(args.build, "bin", "tessera-run"), "--standalone", "--nproc-per-node", str(args.world)] + \
        cc.dit_quick_train(args, ["--set", "data.micro_batch=8",
                                  "--set", f"run.deterministic={'true' if deterministic else 'false'}"])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return cc.Side(name, command, env, cc.tessera_step(), {"deterministic": deterministic, "strategy": args.strategy})


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--strategy", default="zero3")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--build", default=os.path.join(cc.ROOT, "build"))
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    where = cc.machine()
    default = side(args, "default", False)
    deterministic = side(args, "run.deterministic", True)
    cc.alternate([deterministic, default], args.rounds)
    print(f"\n{where['cpu']}, {where['cores']} cores, {where['date']}, commit {where['commit']}; DiT of "
          f"configs/dit_quick.yaml, {args.world} ranks x 1 thread, {args.strategy}, global batch 64 in micro-batches "
          f"of 8; {args.rounds} rounds of {args.steps} steps after {args.warmup}\n")
    print(cc.header())
    print(cc.row(f"DiT {args.strategy}, {args.world} ranks: run.deterministic vs default", deterministic, default,
                 f"bench/compare_deterministic.py --world {args.world} --strategy {args.strategy}", where))
    print("\nsent per rank per step, MiB (median over rounds): "
          f"default {cc.median_extra(default, 'comm_mib_per_step'):.2f}, "
          f"run.deterministic {cc.median_extra(deterministic, 'comm_mib_per_step'):.2f}")
    cc.dump(args.json, where, [deterministic, default])


if __name__ == "__main__":
    main()
