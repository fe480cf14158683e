#!/usr/bin/env python3
"""Muon against AdamW (issue 76): what the orthogonalisation adds to a step. The main job's DiT
(configs/dit_quick.yaml as shipped) on N ranks, the same tessera-train with --set
optim.name=muon and with AdamW, each in its own processes, alternated (ABBA), at least 5
rounds of --steps timed steps after --warmup; medians with their ranges
(bench/compare_common.py), and the bytes each rank sends a step (metrics.jsonl's comm_mib).

Muon gathers each hidden matrix's momentum-updated gradient to its owner rank (owners spread
over the ranks by the iteration's cost), which runs 5 Newton-Schulz iterations on it and
broadcasts the result; every rank applies its own rows. AdamW is elementwise on each rank's
rows. Both run one intra-op thread per rank.

    bench/compare_muon.py [--world 2] [--strategy zero3] [--rounds 5] [--warmup 20] [--steps 60]
"""

import argparse
import os

import compare_common as cc


def side(args, name, optimizer):
    command = cc.dit_quick_train(args, ["--set", "eval.sample_every=0", "--set", f"optim.name={optimizer}"])
    if args.world > 1:
        command = [os.path.join(args.build, "bin", "tessera-run"), "--standalone", "--nproc-per-node",
                   str(args.world)] + command
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return cc.Side(name, command, env, cc.tessera_step(), {"optimizer": optimizer, "strategy": args.strategy})


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--strategy", default="zero3")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--build", default=os.path.join(cc.ROOT, "build"))
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    where = cc.machine()
    adamw = side(args, "adamw", "adamw")
    muon = side(args, "muon", "muon")
    cc.alternate([muon, adamw], args.rounds)
    print(f"\n{where['cpu']}, {where['cores']} cores, {where['date']}, commit {where['commit']}; DiT of "
          f"configs/dit_quick.yaml, {args.world} ranks x 1 thread, {args.strategy}; {args.rounds} rounds of "
          f"{args.steps} steps after {args.warmup}\n")
    print(cc.header())
    print(cc.row(f"DiT {args.strategy}, {args.world} ranks: Muon vs AdamW", muon, adamw,
                 f"bench/compare_muon.py --world {args.world} --strategy {args.strategy}", where))
    print("\nsent per rank per step, MiB (median over rounds): "
          f"AdamW {cc.median_extra(adamw, 'comm_mib_per_step'):.2f}, "
          f"Muon {cc.median_extra(muon, 'comm_mib_per_step'):.2f}")
    cc.dump(args.json, where, [muon, adamw])


if __name__ == "__main__":
    main()
