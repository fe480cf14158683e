#!/usr/bin/env python3
"""The main job's DiT (configs/dit_quick.yaml as shipped: the velocity on the cosine
schedule, 2 heads, patch_overlap 2, EMA 0.999, clip 1.0, no flips) on N ranks of this
machine, Tessera against PyTorch DistributedDataParallel doing the same job
(bench/dit_pytorch_ddp.py: AdamW foreach=True, the foreach clip, the same EMA, the next
batch prepared on a thread, gloo, its fastest OpenBLAS kernel on the DiT's own products).
Every side in its own processes, alternated (ABBA), at least 5 rounds of --steps timed
steps after --warmup; medians with their ranges (bench/compare_common.py).

Tessera is measured as shipped (shared memory between the ranks, its caching allocator,
oneDNN products, its fused AdamW) and like for like (gloo as PyTorch, LibTorch's allocator,
and with TESSERA_ADAM_IMPL=foreach the same optimizer kernel). PyTorch 1.13 runs FSDP only
on CUDA (torch/distributed/fsdp/fully_sharded_data_parallel.py raises "FSDP does not
support CPU only execution"), so zero3 has no like-for-like baseline here: it is shown
against DDP, the same job replicated.

    bench/compare_dit.py [--world 2] [--rounds 5] [--warmup 20] [--steps 200] [--dtype fp32|bf16]
                         [--ema on|off] [--json FILE]
"""

import argparse
import os

import compare_common as cc
from fastest_blas import fastest_env

# The DiT's products at global batch 64 over 2 ranks (32 images of 49 tokens: 1568 rows),
# [m, k] x [k, n]: what the baseline's OpenBLAS kernel is chosen on.
DIT_SHAPES = [(1568, 64, 192), (1568, 64, 64), (1568, 64, 256), (1568, 256, 64), (1568, 64, 64),
              (64, 1568, 192), (256, 1568, 64), (32, 64, 384)]


def tessera_side(args, name, strategy, env, extra=()):
    build = args.build
    command = [os.path.join(build, "bin", "tessera-run"), "--standalone", "--nproc-per-node", str(args.world),
               os.path.join(build, "bin", "tessera-train"), "--config", os.path.join(cc.ROOT, "configs", "dit_quick.yaml"),
               "--set", "run.dir={tmp}/run", "--set", f"run.steps={args.warmup + args.steps}",
               "--set", f"run.log_every={args.warmup}", "--set", "run.eval_every=0",
               "--set", "checkpoint.every_steps=0", "--set", "checkpoint.at_end=false", "--set", "checkpoint.export=[]",
               "--set", "eval.sample_per_class=1", "--set", "eval.sample_steps=1",
               "--set", "optim.schedule.warmup_steps=10", "--set", f"sharding.strategy={strategy}",
               "--set", "log.per_rank_files=false", "--set", f"ema.enabled={'true' if args.ema == 'on' else 'false'}"]
    if args.dtype == "bf16":
        command += ["--set", "sharding.param_dtype=bf16"]
    command += list(extra)
    return cc.Side(name, command, env, cc.tessera_step(), {"strategy": strategy, "extra": list(extra)})


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--ema", choices=["on", "off"], default="on")
    parser.add_argument("--build", default=os.path.join(cc.ROOT, "build"))
    parser.add_argument("--python", default="/usr/bin/python3")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    if args.steps < 10 or args.steps % args.warmup != 0:
        parser.error("--steps: at least 10, a multiple of --warmup (the metrics windows)")
    where = cc.machine()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    baseline_env, blas = fastest_env(args.python, env, DIT_SHAPES)
    print(blas, flush=True)
    like = dict(env, TESSERA_HOST_ALLOCATOR="torch")
    # The baseline's products go to OpenBLAS with its fastest kernel: so do Tessera's, like for like.
    like_aten = dict(baseline_env, TESSERA_HOST_ALLOCATOR="torch", TESSERA_CPU_MATMUL="aten")
    gloo = ["--set", "run.backend=gloo"]
    def ddp(dtype):
        return cc.Side(
            f"pytorch_ddp ({dtype})",
            [args.python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.world),
             "--redirects", "1", "--tee", "1", os.path.join(cc.ROOT, "bench", "dit_pytorch_ddp.py"), "--warmup",
             str(args.warmup), "--steps", str(args.steps), "--ema", args.ema, "--dtype", dtype],
            baseline_env, cc.json_line(), {"dtype": dtype, "blas": blas})

    # bf16 in PyTorch 1.13 on a CPU: bf16 parameters with fp32 master weights (what Tessera's
    # param_dtype bf16 does) or autocast; both are measured and every row names its baseline.
    baselines = [ddp("fp32")] if args.dtype == "fp32" else [ddp("bf16-params"), ddp("bf16-autocast")]
    sides = [
        *baselines,
        tessera_side(args, "zero3 (shipped: shm, caching allocator, oneDNN)", "zero3", env),
        tessera_side(args, "zero3 (gloo, torch allocator)", "zero3", like, gloo),
        tessera_side(args, "zero3 (gloo, torch allocator, OpenBLAS, foreach AdamW)", "zero3",
                     dict(like_aten, TESSERA_ADAM_IMPL="foreach"), gloo),
        tessera_side(args, "no_shard (shipped)", "no_shard", env),
        tessera_side(args, "no_shard (gloo, torch allocator)", "no_shard", like, gloo),
    ]
    cc.alternate(sides, args.rounds)
    print(f"\n{where['cpu']}, {where['cores']} cores, {where['date']}, commit {where['commit']}; DiT of "
          f"configs/dit_quick.yaml, {args.world} ranks x 1 thread, global batch 64, {args.dtype}, EMA {args.ema}; "
          f"{args.rounds} rounds of {args.steps} steps after {args.warmup}\n")
    print(cc.header())
    command = f"bench/compare_dit.py --world {args.world} --dtype {args.dtype} --ema {args.ema}"
    for tessera in sides[len(baselines):]:
        for baseline in baselines:
            print(cc.row(f"DiT {args.dtype}, {args.world} ranks: {tessera.name} vs DDP ({baseline.settings['dtype']})",
                         tessera, baseline, command, where))
    # MFU on one scale for every side: the model's FLOPs (Tessera's count) at each side's step,
    # against the probe's peak (oneDNN sgemm) and against the core's datasheet peak.
    shipped = sides[len(baselines)]
    mfu, datasheet = cc.median_extra(shipped, "mfu"), cc.median_extra(shipped, "mfu_datasheet")
    if mfu is not None:
        print("\nMFU (probe / datasheet), the model's FLOPs at each side's median step:")
        for side in sides:
            scale = cc.summary(shipped)[0] / cc.summary(side)[0]
            print(f"  {side.name}: {mfu * scale:.3f}" + (f" / {datasheet * scale:.3f}" if datasheet else ""))
    cc.dump(args.json, where, sides)


if __name__ == "__main__":
    main()
