"""PyTorch's side of bench/dit_vs_pytorch.py: the DiT of configs/dit_quick.yaml trained by
plain PyTorch — python/tessera_models.DiT, DistributedDataParallel over gloo, AdamW with
gradient clipping, an EMA updated every step (torch._foreach_mul_ and _add_: 1.13 has no foreach lerp), the same loss
(uniform timestep, noise prediction, 10% label drop, random flips) on Fashion-MNIST read
from Debian's IDX files. One intra-op thread per rank. Run under torchrun:

    python3 -m torch.distributed.run --standalone --nproc_per_node 2 bench/dit_pytorch_ddp.py

Prints one JSON line on rank 0: images per second over the steps after --warmup.
"""

import argparse
import gzip
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
import tessera_models  # noqa: E402  (the same DiT the parity test checks against Tessera's)

FASHION = "/usr/share/datasets/fashion-mnist/"


def read_idx(path, header_ints):
    with gzip.open(path, "rb") as f:
        data = f.read()
    return torch.frombuffer(bytearray(data[4 * header_ints:]), dtype=torch.uint8)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--embed-dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=2)  # configs/dit_quick.yaml
    parser.add_argument("--patch-size", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = args.global_batch // world
    images = read_idx(FASHION + "train-images-idx3-ubyte.gz", 4).view(-1, 1, 28, 28)
    labels = read_idx(FASHION + "train-labels-idx1-ubyte.gz", 2).long()

    torch.manual_seed(0)
    model = tessera_models.DiT(input_size=28, patch_size=args.patch_size, in_channels=1, hidden_size=args.embed_dim,
                               depth=args.layers, num_heads=args.heads, mlp_ratio=4.0, num_classes=10)
    ema = [p.detach().clone() for p in model.parameters()]
    model = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0)
    schedule = tessera_models.NoiseSchedule(1000, 1e-4, 0.02)
    alpha_bars = torch.tensor(schedule.alpha_bars, dtype=torch.float64)
    generator = torch.Generator().manual_seed(rank)

    start = None
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            start = time.perf_counter()
        index = torch.randint(len(images), (local,), generator=generator)
        x0 = images[index].float() / 127.5 - 1.0
        flip = torch.rand(local, generator=generator) < 0.5
        x0 = torch.where(flip[:, None, None, None], x0.flip(3), x0)
        y = torch.where(torch.rand(local, generator=generator) < 0.1, torch.full((local,), 10), labels[index])
        t = torch.randint(1000, (local,), generator=generator)
        noise = torch.randn(x0.shape, generator=generator)
        abar = alpha_bars[t].float()[:, None, None, None]
        noisy = abar.sqrt() * x0 + (1 - abar).sqrt() * noise
        optimizer.zero_grad(set_to_none=True)
        loss = (model(noisy, t, y) - noise).square().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        with torch.no_grad():
            torch._foreach_mul_(ema, 0.999)
            torch._foreach_add_(ema, [p.detach() for p in model.parameters()], alpha=1 - 0.999)
    elapsed = time.perf_counter() - start
    if rank == 0:
        print(json.dumps({"framework": "pytorch_ddp", "world": world, "images_per_sec":
                          args.global_batch * args.steps / elapsed, "loss": float(loss)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
