#!/usr/bin/env python3
"""Tessera's fixed cost: tessera-train on the main job's small model (configs/default.yaml:
a 273K-parameter MLP, global batch 64 in micro-batches of 16, AdamW with clip 1.0, EMA at
two decays) at world size 1 and 2, against a plain single-process LibTorch loop doing the
same job with the same optimizer kernel (bench_train_throughput_bench --plain-only: Tessera's
one-pass AdamW and norm, the same EMA blends, the next batch prepared on a BatchLoader
thread). At world size 2 the loop runs with 1 and with 2 intra-op threads (the cores the two
ranks use). Every side in its own processes, alternated (ABBA), at least 5 rounds
(bench/compare_common.py).

--ema off turns the EMA off on both sides; --pin runs both sides of world size 1 under
`taskset -c 0`, so that neither Tessera's loader and transport threads nor the loop's loader
get the second core.

    bench/compare_fixed.py [--worlds 1 2] [--rounds 5] [--warmup 200] [--steps 800]
                           [--ema on|off] [--pin] [--json FILE]
"""

import argparse
import os

import compare_common as cc


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--ema", choices=["on", "off"], default="on")
    parser.add_argument("--pin", action="store_true")
    parser.add_argument("--config", default=os.path.join(cc.ROOT, "configs", "default.yaml"))
    parser.add_argument("--build", default=os.path.join(cc.ROOT, "build"))
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    if args.steps < 10 or args.steps % args.warmup != 0:
        parser.error("--steps: at least 10, a multiple of --warmup (the metrics windows)")
    if args.pin and args.worlds != [1]:
        parser.error("--pin: world size 1 only (--worlds 1)")
    where = cc.machine()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    pin = ["taskset", "-c", "0"] if args.pin else []
    ema_set = ["--set", f"ema.enabled={'true' if args.ema == 'on' else 'false'}"]
    if args.ema == "off":
        ema_set += ["--set", "checkpoint.export=[model]"]  # the config exports its EMAs, which a run without one lacks
    bin_dir = os.path.join(args.build, "bin")

    def plain(threads):
        return cc.Side(f"plain loop, {threads} thread{'s' if threads > 1 else ''}",
                       [*pin, os.path.join(bin_dir, "bench_train_throughput_bench"), "--plain-only", "--json",
                        "--config", args.config, "--threads", str(threads), "--warmup", str(args.warmup), "--steps",
                        str(args.steps), "--plain-ema", "-1" if args.ema == "on" else "0", *ema_set],
                       env, cc.json_line(), {"threads": threads, "optimizer": "fused", "data": "prefetch"})

    def tessera(strategy, world):
        return cc.Side(f"tessera-train {strategy} x{world}",
                       [*pin, os.path.join(bin_dir, "tessera-run"), "--standalone", "--nproc-per-node", str(world),
                        os.path.join(bin_dir, "tessera-train"), "--config", args.config, "--set", "run.dir={tmp}/run",
                        "--set", f"run.steps={args.warmup + args.steps}", "--set", f"run.log_every={args.warmup}",
                        "--set", "run.eval_every=0", "--set", "checkpoint.every_steps=0", "--set",
                        "checkpoint.at_end=false", "--set", "checkpoint.export=[]", "--set", "log.per_rank_files=false",
                        "--set", f"sharding.strategy={strategy}", *ema_set],
                       env, cc.tessera_step(), {"strategy": strategy, "world": world})

    lines, all_sides = [], []
    for world in args.worlds:
        baselines = [plain(1)] if world == 1 else [plain(1), plain(world)]
        tesseras = [tessera("zero3", world)] if world == 1 else [tessera("zero3", world), tessera("no_shard", world)]
        sides = [*baselines, *tesseras]
        cc.alternate(sides, args.rounds)
        all_sides += sides
        command = (f"bench/compare_fixed.py --worlds {world} --ema {args.ema}" + (" --pin" if args.pin else ""))
        for t in tesseras:
            for b in baselines:
                lines.append(cc.row(f"fixed cost, MLP 273K, EMA {args.ema}{', pinned to 1 core' if args.pin else ''}: "
                                    f"{t.name} vs {b.name}", t, b, command, where))
    print(f"\n{where['cpu']}, {where['cores']} cores, {where['date']}, commit {where['commit']}; {args.config}, EMA "
          f"{args.ema}; {args.rounds} rounds of {args.steps} steps after {args.warmup}\n")
    print(cc.header())
    for line in lines:
        print(line)
    cc.dump(args.json, where, all_sides)


if __name__ == "__main__":
    main()
