#!/usr/bin/env python3
"""PyTorch FSDP2 baseline for bench/gpt_step_bench.cpp (issue 9).

The same GPT-2-style decoder as Tessera's built-in `gpt` (trainer/models.h: nanoGPT
names, learned positions, pre-norm blocks with causal self-attention through
scaled_dot_product_attention and an exact-GELU MLP, untied lm_head without bias), under
FSDP2's `fully_shard` (each block, then the root) with MixedPrecisionPolicy(param_dtype
bf16, reduce_dtype fp32) and torch.optim.AdamW(lr 1e-4, weight_decay 0.1) on the fp32
parameters; one step = zero_grad, forward, cross-entropy over every position in fp32,
backward, optimizer step. Prints the median step time of --steps steps after --warmup,
tokens/s and the peak GPU memory (torch.cuda.max_memory_allocated) per step, in the
format of bench_gpt_step_bench.

Run on the GPU machine with PyTorch >= 2.4, one process (world size 1):
    python3 bench/fsdp2_gpt_step.py --embed 1024 --layers 24 --heads 16 --context 1024 --batch 8
`--plain` runs the model without fully_shard (bf16 autocast instead), which also works
on the CPU with older PyTorch, to check the model code.
"""
import argparse
import math
import os
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
            raise SystemExit(f"fsdp2_gpt_step.py: FSDP2 (fully_shard) needs PyTorch >= 2.4, this is {torch.__version__} "
                             f"({type(e).__name__}: {e}); --plain runs without it")
    return fully_shard, MixedPrecisionPolicy


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--embed", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--plain", action="store_true", help="no fully_shard: bf16 autocast over fp32 parameters")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    device = torch.device(args.device)

    torch.manual_seed(0)
    model = Gpt(args.vocab, args.context, args.embed, args.layers, args.heads).to(device)
    params = sum(p.numel() for p in model.parameters())
    if not args.plain:
        for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29517"), ("RANK", "0"), ("WORLD_SIZE", "1")):
            os.environ.setdefault(key, value)
        dist.init_process_group("nccl" if cuda else "gloo")
        if cuda:
            torch.cuda.set_device(0)
        fully_shard, MixedPrecisionPolicy = fully_shard_api()
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.h:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    tokens = torch.randint(args.vocab, (args.batch, args.context), device=device)
    targets = torch.randint(args.vocab, (args.batch, args.context), device=device)

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.plain):
            logits = model(tokens)
        F.cross_entropy(logits.float().view(-1, args.vocab), targets.view(-1)).backward()
        optimizer.step()

    def sync():
        if cuda:
            torch.cuda.synchronize()

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
    name = "plain PyTorch (autocast bf16)" if args.plain else "PyTorch FSDP2 fully_shard"
    print(f"GPT {params} parameters (embed {args.embed}, {args.layers} layers, {args.heads} heads, context "
          f"{args.context}, vocab {args.vocab}), batch {args.batch}, bf16 compute, fp32 masters, on {args.device}"
          f"{' (' + torch.cuda.get_device_name(0) + ', torch ' + torch.__version__ + ')' if cuda else ''}")
    print(f"step: {name} {ms:.2f} ms ({args.batch * args.context / ms * 1e3:.0f} tokens/s, peak {peak / 2**30:.2f} GiB)")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
