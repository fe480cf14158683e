"""PyTorch's side of bench/compare_mlp.py (and the older bench/vs_pytorch.py): the step time
of DistributedDataParallel, or of ZeRO-1 (DDP + ZeroRedundancyOptimizer), on the model,
batch and data bench_strategy_step_bench trains (Linear layers with ReLU between them, MSE
against a fixed target, AdamW, one intra-op thread per rank, gloo), set up for speed: AdamW
with foreach=True (1.13's fastest CPU kernel), DDP with gradient_as_bucket_view, ZeRO-1 with
parameters_as_bucket_view (--old: the single-tensor AdamW and the defaults the older
driver ran). Run under torchrun, one process per rank:

    python3 -m torch.distributed.run --standalone --nproc_per_node 2 \
        bench/vs_pytorch_reference.py --mode ddp

Prints one JSON line on rank 0, as the Tessera bench does.
"""

import argparse
import json
import time

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["ddp", "ddp_zero"], default="ddp")
    parser.add_argument("--widths", type=int, nargs="+", default=[1024, 2048, 2048, 1024])
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--old", action="store_true", help="the older baseline: single-tensor AdamW, default buckets")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} is not a multiple of the {world} ranks")
    local = args.global_batch // world

    torch.manual_seed(0)
    layers = []
    for i in range(len(args.widths) - 1):
        layers.append(torch.nn.Linear(args.widths[i], args.widths[i + 1]))
        if i + 2 < len(args.widths):
            layers.append(torch.nn.ReLU())
    model = DistributedDataParallel(torch.nn.Sequential(*layers), gradient_as_bucket_view=not args.old)
    foreach = not args.old
    if args.mode == "ddp":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=foreach)
    else:
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4,
                                            foreach=foreach, parameters_as_bucket_view=not args.old)

    torch.manual_seed(1)
    x = torch.randn(args.global_batch, args.widths[0])[rank * local:(rank + 1) * local]
    y = torch.randn(args.global_batch, args.widths[-1])[rank * local:(rank + 1) * local]

    times, phases = [], {"forward": [], "backward": [], "step": []}
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        forward_end = time.perf_counter()
        loss.backward()  # DDP's bucketed all-reduces run during it and are waited for at its end
        backward_end = time.perf_counter()
        optimizer.step()  # ZeRO-1: the update of this rank's shard and the broadcasts of the others'
        end = time.perf_counter()
        if step >= args.warmup:
            times.append(end - start)
            phases["forward"].append(forward_end - start)
            phases["backward"].append(backward_end - forward_end)
            phases["step"].append(end - backward_end)
    if rank == 0:
        print(json.dumps({"framework": "pytorch", "strategy": args.mode, "world": world,
                          "median_s": sorted(times)[len(times) // 2], "step_s_mean": sum(times) / len(times),
                          "phases_median_s": {k: sorted(v)[len(v) // 2] for k, v in phases.items()},
                          "times_s": times, "settings": {"adamw_foreach": foreach, "bucket_views": not args.old,
                                                         "transport": "gloo", "threads": args.threads}}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
