#!/usr/bin/env python3
"""PyTorch FSDP2 baseline for bench/step_bench.cpp (issue 35).

The same models as Tessera's built-in ones: `--model gpt`, the GPT-2-style decoder of
models/models.h (nanoGPT names, learned positions, pre-norm blocks with causal
self-attention through scaled_dot_product_attention and an exact-GELU MLP, untied lm_head
without bias), or `--model dit`, the DiT of python/tessera_models.py (Tessera's models/dit.h,
facebookresearch/DiT names). Under FSDP2's `fully_shard` (each block, then the root) with
MixedPrecisionPolicy(param_dtype bf16, reduce_dtype fp32) and torch.optim.AdamW(lr 1e-4,
weight_decay 0.1, fused=True: Tessera's kernel) on the fp32 parameters; one step = zero_grad, forward, the loss in fp32
(gpt: cross-entropy at every position; dit: MSE against the noise, random timesteps and
labels), backward, optimizer step. Prints the median step time of --steps steps after
--warmup, tokens/s or images/s, TFLOP/s and MFU by bench_step_bench's formulas and peak
(--peak-tflops, else the same bf16 8192^3 matrix-product probe), and the peak GPU memory
(torch.cuda.max_memory_allocated) per step, in the format of bench_step_bench.

Run on the GPU machine with PyTorch >= 2.4, one process (world size 1):
    python3 bench/fsdp2_step.py --model gpt --embed 768 --layers 12 --heads 12 --context 1024 --batch 8
`--plain` runs the model without fully_shard (bf16 autocast instead), which also works
on the CPU with older PyTorch, to check the model code.
"""
import argparse
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)

    def forward(self, x):
        b, t, w = x.shape
        q, k, v = self.c_attn(x).split(w, dim=2)
        q, k, v = (z.view(b, t, self.heads, w // self.heads).transpose(1, 2) for z in (q, k, v))
        if hasattr(F, "scaled_dot_product_attention"):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # PyTorch 1.x
            scores = q @ k.transpose(-2, -1) / math.sqrt(w // self.heads)
            scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
            y = scores.softmax(-1) @ v
        return self.c_proj(y.transpose(1, 2).reshape(b, t, w))


class Mlp(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.c_fc = nn.Linear(width, 4 * width)
        self.c_proj = nn.Linear(4 * width, width)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(width), Attention(width, heads)
        self.ln_2, self.mlp = nn.LayerNorm(width), Mlp(width)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Gpt(nn.Module):
    def __init__(self, vocab, context, width, layers, heads):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.h = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def fully_shard_api():
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # PyTorch >= 2.6
    except Exception:
        try:
            from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard  # 2.4, 2.5
        except Exception as e:
            raise SystemExit(f"fsdp2_step.py: FSDP2 (fully_shard) needs PyTorch >= 2.4, this is {torch.__version__} "
                             f"({type(e).__name__}: {e}); --plain runs without it")
    return fully_shard, MixedPrecisionPolicy


def probe_peak_tflops(device, n=8192):
    """bf16 n^3 matrix products: mean TFLOP/s of 10 after 3 warm-ups (bench_step_bench's probe)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = n if device.type == "cuda" else 1024
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    for _ in range(3):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 2.0 * n ** 3 * 10 / (time.perf_counter() - start) / 1e12


def params_named(model, parts):
    return sum(p.numel() for name, p in model.named_parameters() if any(part in name for part in parts))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=("gpt", "dit"), default="gpt")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--embed", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--image", type=int, default=32)
    ap.add_argument("--channels", type=int, default=4)
    ap.add_argument("--patch", type=int, default=2)
    ap.add_argument("--classes", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--peak-tflops", type=float, default=0.0)
    ap.add_argument("--trace", default="", help="write a Chrome trace of two steps here (torch.profiler)")
    ap.add_argument("--plain", action="store_true", help="no fully_shard: bf16 autocast over fp32 parameters")
    ap.add_argument("--offload", action="store_true",
                    help="CPUOffloadPolicy: sharded fp32 parameters, gradients and AdamW on the host (fused CPU AdamW)")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    device = torch.device(args.device)

    torch.manual_seed(0)
    if args.model == "gpt":
        model = Gpt(args.vocab, args.context, args.embed, args.layers, args.heads).to(device)
        blocks = model.h
        tokens = torch.randint(args.vocab, (args.batch, args.context), device=device)
        targets = torch.randint(args.vocab, (args.batch, args.context), device=device)

        def loss_of():
            logits = model(tokens)
            return F.cross_entropy(logits.float().view(-1, args.vocab), targets.view(-1))

        per_token = 6.0 * params_named(model, ("h.", "lm_head")) + 6.0 * args.layers * args.context * args.embed
        items, item_name = args.batch * args.context, "tokens"
        flops = per_token * items
        what = (f"GPT (embed {args.embed}, {args.layers} layers, {args.heads} heads, context {args.context}, "
                f"vocab {args.vocab}), batch {args.batch}")
    else:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
        from tessera_models import DiT
        model = DiT(args.image, args.patch, args.channels, args.embed, args.layers, args.heads, 4.0, args.classes).to(device)
        blocks = model.blocks
        x = torch.randn(args.batch, args.channels, args.image, args.image, device=device)
        noise = torch.randn_like(x)
        t = torch.randint(1000, (args.batch,), device=device)
        y = torch.randint(args.classes + 1, (args.batch,), device=device)

        def loss_of():
            return (model(x, t, y).float() - noise).square().mean()

        tokens_per_image = (args.image // args.patch) ** 2
        per_token = params_named(model, ("x_embedder", "attn.", "mlp.fc", "final_layer.linear"))
        per_image = params_named(model, ("t_embedder", "adaLN_modulation"))
        flops = args.batch * (6.0 * (tokens_per_image * per_token + per_image)
                              + 12.0 * args.layers * tokens_per_image ** 2 * args.embed)
        items, item_name = args.batch, "images"
        what = (f"DiT (embed {args.embed}, {args.layers} layers, {args.heads} heads, patch {args.patch}, "
                f"{args.channels}x{args.image}x{args.image} inputs: {tokens_per_image} tokens, {args.classes} "
                f"classes), batch {args.batch}")
    params = sum(p.numel() for p in model.parameters())
    if not args.plain:
        for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29517"), ("RANK", "0"), ("WORLD_SIZE", "1")):
            os.environ.setdefault(key, value)
        dist.init_process_group("nccl" if cuda else "gloo")
        if cuda:
            torch.cuda.set_device(0)
        fully_shard, MixedPrecisionPolicy = fully_shard_api()
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        extra = {}
        if args.offload:
            try:
                from torch.distributed.fsdp import CPUOffloadPolicy
            except ImportError:
                from torch.distributed._composable.fsdp import CPUOffloadPolicy
            extra["offload_policy"] = CPUOffloadPolicy()
        for block in blocks:
            fully_shard(block, mp_policy=policy, **extra)
        fully_shard(model, mp_policy=policy, **extra)
    trainable = [p for p in model.parameters() if p.requires_grad]
    # Fused AdamW (one kernel over parameters, gradients and moments), as Tessera's optimizer
    # steps on a GPU and on the host with offload; on the CPU without PyTorch 2 (the model
    # check) the default form.
    fused = (device.type == "cuda" or args.offload) and int(torch.__version__.split(".")[0]) >= 2
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.1, **({"fused": True} if fused else {}))

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.plain):
            loss = loss_of()
        loss.backward()
        optimizer.step()

    def sync():
        if cuda:
            torch.cuda.synchronize()

    peak_tflops = args.peak_tflops or probe_peak_tflops(device)
    for _ in range(args.warmup):
        step()
    sync()
    times, peak = [], 0
    for _ in range(args.steps):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        step()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
        if cuda:
            peak = max(peak, torch.cuda.max_memory_allocated())
    ms = sorted(times)[len(times) // 2]
    name = ("plain PyTorch (autocast bf16)" if args.plain else
            "PyTorch FSDP2 fully_shard, CPUOffloadPolicy" if args.offload else "PyTorch FSDP2 fully_shard")
    tflops = flops / (ms * 1e-3) / 1e12
    print(f"{what}: {params} parameters, bf16 compute, fp32 masters, AdamW {'fused' if fused else 'default form'}, "
          f"on {args.device}"
          f"{' (' + torch.cuda.get_device_name(0) + ', torch ' + torch.__version__ + ')' if cuda else ''}")
    print(f"model FLOPs per step {flops:.4g}; peak {peak_tflops:.1f} TFLOP/s "
          f"({'given' if args.peak_tflops else 'measured: bf16 8192^3 matrix product'})")
    print(f"step: {name} {ms:.2f} ms ({items / ms * 1e3:.0f} {item_name}/s, {tflops:.1f} TFLOP/s, "
          f"MFU {100 * tflops / peak_tflops:.1f}%, peak {peak / 2**30:.2f} GiB = {peak / 2**20:.1f} MiB)")
    if args.trace and cuda:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], profile_memory=True) as prof:
            for _ in range(2):
                step()
            sync()
        prof.export_chrome_trace(args.trace)
        print(f"trace of 2 steps: {args.trace}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
