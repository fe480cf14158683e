"""PyTorch's side of bench/compare_dit.py: the job of configs/dit_quick.yaml trained by
plain PyTorch, set up as a PyTorch engineer would for speed, with every setting the
Tessera side has: python/tessera_models.DiT with the main job's shape (2 heads,
patch_overlap 2), DistributedDataParallel over gloo (gradient_as_bucket_view, no buffer
broadcast: the DiT's buffers are constants), AdamW with foreach=True (PyTorch 1.13's
fastest CPU kernel: it has no fused CPU AdamW), the global-norm clip in foreach ops (1.13's
clip_grad_norm_ has no foreach flag), an EMA of decay 0.999 in foreach ops (1.13 has no
foreach lerp), the main job's loss (the velocity on the cosine schedule with a zero
terminal SNR, uniform timesteps, 10% label drop, no flips) on Fashion-MNIST read from
Debian's IDX files, and the next step's batch prepared on a thread while this one computes
(as Tessera's BatchLoader does). One intra-op thread per rank. Run under torchrun:

    python3 -m torch.distributed.run --standalone --nproc_per_node 2 bench/dit_pytorch_ddp.py

Prints one JSON line on rank 0: the time of each step after --warmup, and the settings.
"""

import argparse
import concurrent.futures
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


def clip_grad_norm_foreach(parameters, max_norm):
    """torch.nn.utils.clip_grad_norm_ (norm 2) in foreach ops: one norm per tensor in one
    call, their norm, one scale of every gradient in one call."""
    grads = [p.grad for p in parameters if p.grad is not None]
    norms = torch._foreach_norm(grads)
    total = torch.linalg.vector_norm(torch.stack(norms))
    coef = max_norm / (float(total) + 1e-6)
    if coef < 1.0:
        torch._foreach_mul_(grads, coef)
    return total


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--embed-dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--patch-size", type=int, default=4)
    parser.add_argument("--patch-overlap", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--optimizer", choices=["foreach", "single"], default="foreach",
                        help="AdamW's kernel: foreach (fastest in 1.13 on the CPU) or single-tensor (the old baseline)")
    parser.add_argument("--hflip", action="store_true", help="flip each sample with probability 1/2 (the main job does not)")
    parser.add_argument("--ema", choices=["on", "off"], default="on")
    parser.add_argument("--data", choices=["prefetch", "inline"], default="prefetch",
                        help="the next batch prepared on a thread (as Tessera) or on the step's thread")
    parser.add_argument("--dtype", choices=["fp32", "bf16-autocast", "bf16-params"], default="fp32",
                        help="bf16-autocast: fp32 parameters, bf16 products; bf16-params: the model in bf16 over fp32 "
                             "master weights (what sharding.param_dtype bf16 does)")
    parser.add_argument("--trace", default="", help="write a Chrome trace of 5 steps after the warm-up (rank 0)")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = args.global_batch // world
    images = read_idx(FASHION + "train-images-idx3-ubyte.gz", 4).view(-1, 1, 28, 28)
    labels = read_idx(FASHION + "train-labels-idx1-ubyte.gz", 2).long()

    torch.manual_seed(0)
    model = tessera_models.DiT(input_size=28, patch_size=args.patch_size, in_channels=1, hidden_size=args.embed_dim,
                               depth=args.layers, num_heads=args.heads, mlp_ratio=4.0, num_classes=10,
                               patch_overlap=args.patch_overlap)
    masters = None
    if args.dtype == "bf16-params":
        masters = [p.detach().clone() for p in model.parameters()]  # fp32 masters the optimizer steps
        model = model.bfloat16()
    ema = [p.detach().float().clone() for p in model.parameters()] if args.ema == "on" else None
    if masters is None:
        ddp = DistributedDataParallel(model, broadcast_buffers=False, gradient_as_bucket_view=True)
    else:
        # gloo in PyTorch 1.13 has no bf16 collectives ("Invalid scalar type"), so DDP cannot
        # wrap a bf16 model on the CPU. What Tessera's param_dtype bf16 does instead: the fp32
        # masters' gradients all-reduced as one flat in fp32 after the backward (at this size
        # Tessera's zero3 is one unit, reduced after the backward too). Every rank starts from
        # the same seed, so no initial broadcast is needed.
        ddp = model
    stepped = masters if masters is not None else list(model.parameters())
    if masters is not None:
        for m in masters:
            m.requires_grad_(True)
    optimizer = torch.optim.AdamW(stepped, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0,
                                  foreach=args.optimizer == "foreach")
    schedule = tessera_models.NoiseSchedule(1000, 1e-4, 0.02, noise_schedule="cosine", zero_terminal_snr=True,
                                            prediction="v")
    alpha_bars = torch.tensor(schedule.alpha_bars, dtype=torch.float64)
    generator = torch.Generator().manual_seed(rank)

    def batch():
        index = torch.randint(len(images), (local,), generator=generator)
        x0 = images[index].float() / 127.5 - 1.0
        if args.hflip:
            flip = torch.rand(local, generator=generator) < 0.5
            x0 = torch.where(flip[:, None, None, None], x0.flip(3), x0)
        y = torch.where(torch.rand(local, generator=generator) < 0.1, torch.full((local,), 10), labels[index])
        t = torch.randint(1000, (local,), generator=generator)
        noise = torch.randn(x0.shape, generator=generator)
        abar = alpha_bars[t].float()[:, None, None, None]
        noisy = abar.sqrt() * x0 + (1 - abar).sqrt() * noise
        target = abar.sqrt() * noise - (1 - abar).sqrt() * x0  # the velocity
        return noisy, t, y, target

    pool = concurrent.futures.ThreadPoolExecutor(1) if args.data == "prefetch" else None
    pending = pool.submit(batch) if pool else None
    profiler = None
    times = []
    for step in range(args.warmup + args.steps):
        if args.trace and rank == 0 and step == args.warmup:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            profiler.__enter__()
        begin = time.perf_counter()
        if pool:
            noisy, t, y, target = pending.result()
            pending = pool.submit(batch)
        else:
            noisy, t, y, target = batch()
        optimizer.zero_grad(set_to_none=True)
        if masters is not None:
            for p in model.parameters():
                p.grad = None
        if args.dtype == "bf16-autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = ddp(noisy, t, y)
        else:
            out = ddp(noisy.to(next(model.parameters()).dtype), t, y)
        loss = (out.float() - target).square().mean()
        loss.backward()
        if masters is not None:
            for m, p in zip(masters, model.parameters()):
                # (a parameter no gradient reached, e.g. a frozen positional embedding: zeros)
                m.grad = p.grad.float() if p.grad is not None else torch.zeros_like(m)
            flat = torch._utils._flatten_dense_tensors([m.grad for m in masters])
            dist.all_reduce(flat)
            flat.div_(world)
            for m, reduced in zip(masters, torch._utils._unflatten_dense_tensors(flat, [m.grad for m in masters])):
                m.grad.copy_(reduced)
        clip_grad_norm_foreach(stepped, 1.0)
        optimizer.step()
        if masters is not None:
            with torch.no_grad():
                for m, p in zip(masters, model.parameters()):
                    p.copy_(m)
        if ema is not None:
            with torch.no_grad():
                torch._foreach_mul_(ema, 0.999)
                torch._foreach_add_(ema, [p.detach().float() for p in stepped], alpha=1 - 0.999)
        if step >= args.warmup:
            times.append(time.perf_counter() - begin)
        if profiler is not None and step == args.warmup + 4:
            profiler.__exit__(None, None, None)
            profiler.export_chrome_trace(args.trace)
            profiler = None
    if pool:
        pool.shutdown()
    if rank == 0:
        mean = sum(times) / len(times)
        print(json.dumps({"framework": "pytorch_ddp", "world": world, "step_s_mean": mean, "times_s": times,
                          "images_per_sec": args.global_batch / mean, "loss": float(loss),
                          "settings": {"optimizer_foreach": optimizer.defaults.get("foreach"),
                                       "patch_overlap": args.patch_overlap, "heads": args.heads, "hflip": args.hflip,
                                       "ema": args.ema, "data": args.data, "dtype": args.dtype, "clip": 1.0,
                                       "transport": "gloo" if masters is None else "gloo, fp32 flat all-reduce after the backward", "threads": args.threads,
                                       "loss": "v on cosine, zero terminal SNR"}}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
