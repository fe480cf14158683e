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
                          [--config configs/fashion_dit.yaml] [--set key=value ...]

--config times another DiT config (the quality run's, for the minutes it needs), --set adds
keys to both sides (e.g. optim.muon.ns_steps=3 reaches only the Muon side's optimizer).
"""

import argparse
import os

import compare_common as cc


def side(args, name, optimizer):
    sets = ["--set", "eval.sample_every=0", "--set", f"optim.name={optimizer}"]
    for kv in args.set:
        # optim.muon.* keys are refused under AdamW (configs/README.md): they go to Muon only
        if optimizer == "muon" or not kv.startswith("optim.muon."):
            sets += ["--set", kv]
    command = cc.dit_quick_train(args, sets, args.config)
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
    parser.add_argument("--config", default=os.path.join(cc.ROOT, "configs", "dit_quick.yaml"))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    where = cc.machine()
    adamw = side(args, "adamw", "adamw")
    muon = side(args, "muon", "muon")
    cc.alternate([muon, adamw], args.rounds)
    print(f"\n{where['cpu']}, {where['cores']} cores, {where['date']}, commit {where['commit']}; DiT of "
          f"{os.path.relpath(args.config, cc.ROOT)} {' '.join(args.set)}, {args.world} ranks x 1 thread, {args.strategy}; {args.rounds} rounds of "
          f"{args.steps} steps after {args.warmup}\n")
    print(cc.header())
    print(cc.row(f"DiT {args.strategy}, {args.world} ranks: Muon vs AdamW", muon, adamw,
                 f"bench/compare_muon.py --world {args.world} --strategy {args.strategy}"
                 + (f" --config {os.path.relpath(args.config, cc.ROOT)}" if "dit_quick" not in args.config else "")
                 + "".join(f" --set {kv}" for kv in args.set), where))
    print("\nsent per rank per step, MiB (median over rounds): "
          f"AdamW {cc.median_extra(adamw, 'comm_mib_per_step'):.2f}, "
          f"Muon {cc.median_extra(muon, 'comm_mib_per_step'):.2f}")
    cc.dump(args.json, where, [muon, adamw])


if __name__ == "__main__":
    main()
