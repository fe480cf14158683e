#!/usr/bin/env python3
"""Tessera's built-in models in plain PyTorch, with Tessera's parameter names and forward
passes, so that an export (safetensors) loads into them with strict=True and computes what
Tessera computes; the diffusion models' samplers (DDIM, DDPM) as Tessera runs them.

No Tessera import and no dependency beyond torch (numpy is not needed). Models:

  arch mlp, token data     ContextMlp          tokens [B, context] -> logits [B, vocab]
  arch mlp, tensor data    FeatureMlp          x [B, *input_shape] -> [B, classes] (or
                                               [B, prod(target_shape)] for regression);
                                               features(x): the head's input
  arch convnet             ConvNet             images [B, C, H, W] -> [B, classes];
                                               features(x): the head's input
  arch gpt                 Gpt                 tokens [B, T] -> logits [B, T, vocab]
  arch diffusion           DiffusionDenoiser   (x, t[, y ignored]) -> the noise or velocity
  arch dit                 DiT                 (x [N,C,H,W], t [N], y [N]) -> the noise or
                                               velocity (Peebles & Xie's DiT, learn_sigma=False)
  (which one: the export's "prediction", read by noise_schedule())
  A denoiser exported with "gan_head_block" >= 0 (a DMD critic) also has its GAN head,
  gan_head = Sequential(LayerNorm, Linear(W, W), SiLU, Linear(W, 1)) (loaded, not run here).

The C++ sources they transcribe: models/models.cpp (ContextMlp, FeatureMlp, Gpt),
models/diffusion.cpp (DiffusionDenoiser, NoiseSchedule, sampleDdpm, sampleDdim),
models/convnet.cpp (ConvNet),
models/layers.cpp (Linear, Embedding, LayerNorm eps 1e-5 = torch.nn's).

An export's __metadata__["tessera.model"] is a JSON object: the run's resolved model
section plus "data" ({"tokens", "input_shape", "classes", "target_shape"}). load_export()
builds the model it describes and loads the weights.

Command line (exit status 0: success; 1: mismatch, outputs beyond rtol or weights that do
not fit the model their metadata describes; 2: bad input, an unreadable file or option):

  tessera_models.py check-forward --weights EXPORT --probe PROBE [--rtol 1e-4]
  tessera_models.py check-samples --weights EXPORT --noise NOISE --samples SAMPLES \\
      --steps K --cfg C [--rtol 1e-4]
  tessera_models.py describe --weights EXPORT

check-forward runs the model on a probe file's inputs (tokens; x; x, t, y) and compares
its outputs (out, and features_out for FeatureMlp) with Tessera's; check-samples runs DDIM
from a noise file (noise, optional labels) and compares with Tessera's samples. Both by
relative difference ||a - b|| / ||b||.
"""

import argparse
import ctypes
import json
import math
import mmap
import os
import struct
import sys

import torch
from torch import nn
import torch.nn.functional as F

__all__ = [
    "ContextMlp", "FeatureMlp", "ConvNet", "Gpt", "GptBlock", "DiffusionDenoiser", "DenoiserBlock", "DiT", "DiTBlock",
    "NoiseSchedule", "ExportError", "ExportMismatch", "build_model", "load_export", "read_safetensors",
    "save_safetensors", "noise_schedule", "ddim_timesteps", "guided_noise", "sample_ddim", "sample_ddpm",
    "get_2d_sincos_pos_embed", "relative_difference", "main",
]

METADATA_KEY = "tessera.model"


class ExportError(Exception):
    """Bad input: an unreadable file, missing metadata or tensors, impossible options."""


class ExportMismatch(Exception):
    """The export does not fit the model its metadata describes (names or shapes)."""


# ---------------------------------------------------------------------------------------
# Safetensors reader and writer
# ---------------------------------------------------------------------------------------

# dtype name -> (torch dtype, bytes per element)
_DTYPES = {
    "F64": (torch.float64, 8), "F32": (torch.float32, 4), "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2), "I64": (torch.int64, 8), "I32": (torch.int32, 4),
    "I16": (torch.int16, 2), "I8": (torch.int8, 1), "U8": (torch.uint8, 1), "BOOL": (torch.bool, 1),
}
_NAMES = {dtype: (name, size) for name, (dtype, size) in _DTYPES.items()}
_MAX_HEADER = 100_000_000  # what the safetensors library (and Tessera's reader) accepts


def _check_little_endian():
    if sys.byteorder != "little":
        raise ExportError("safetensors: only little-endian hosts are supported")


def read_safetensors(path, with_metadata=False):
    """Reads a safetensors file: {name: tensor} (dtypes as stored), and with
    `with_metadata` also its __metadata__ map: ({name: tensor}, {str: str}).
    ExportError for a file that is not valid safetensors."""
    _check_little_endian()
    try:
        f = open(path, "rb")
    except OSError as e:
        raise ExportError(f"{path}: {e.strerror}") from e
    with f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise ExportError(f"{path}: {size} bytes, too short for a safetensors file")
        (n,) = struct.unpack("<Q", f.read(8))
        if n > _MAX_HEADER or 8 + n > size:
            raise ExportError(f"{path}: header length {n} is past the end of the {size}-byte file")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise ExportError(f"{path}: the header is not JSON ({e})") from e
        if not isinstance(header, dict):
            raise ExportError(f"{path}: the header is not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise ExportError(f"{path}: __metadata__ is not a map of strings")
        data_size = size - 8 - n
        tensors = {}
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size > 0 else None
        try:
            for name, info in header.items():
                try:
                    dtype, itemsize = _DTYPES[info["dtype"]]
                    shape = [int(d) for d in info["shape"]]
                    begin, end = (int(o) for o in info["data_offsets"])
                except (KeyError, TypeError, ValueError) as e:
                    raise ExportError(f"{path}: tensor '{name}': bad entry {info!r}") from e
                numel = math.prod(shape)
                if any(d < 0 for d in shape) or not 0 <= begin <= end <= data_size or end - begin != numel * itemsize:
                    raise ExportError(f"{path}: tensor '{name}': shape {shape} x {info['dtype']} does not fit "
                                      f"offsets [{begin}, {end}) of a {data_size}-byte data section")
                if numel == 0:
                    tensors[name] = torch.empty(shape, dtype=dtype)
                    continue
                # A copy of the bytes: aligned for its dtype whatever the offset.
                buffer = bytearray(mm[8 + n + begin:8 + n + end])
                tensors[name] = torch.frombuffer(buffer, dtype=dtype).reshape(shape)
        finally:
            if mm is not None:
                mm.close()
    return (tensors, metadata) if with_metadata else tensors


def save_safetensors(path, tensors, metadata=None):
    """Writes {name: tensor} (any dtype of the table above) as a safetensors file, in the
    given order, with `metadata` ({str: str}; dict or list values are written as JSON) as
    its __metadata__. Written to path.tmp, then renamed."""
    _check_little_endian()
    header, blobs, offset = {}, [], 0
    if metadata:
        header["__metadata__"] = {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()}
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"save_safetensors: '{name}' is not a tensor")
        t = tensor.detach().cpu().contiguous()
        if t.dtype not in _NAMES:
            raise TypeError(f"save_safetensors: '{name}' has dtype {t.dtype}, which safetensors cannot hold here")
        dtype_name, itemsize = _NAMES[t.dtype]
        nbytes = t.numel() * itemsize
        blobs.append(ctypes.string_at(t.data_ptr(), nbytes) if nbytes else b"")
        header[name] = {"dtype": dtype_name, "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)
    os.replace(tmp, path)


def _read_export_files(path):
    """The tensors and metadata of an export: one safetensors file, or a sharded export's
    *.index.json (Hugging Face's layout: {"weight_map": {name: file}}, the files beside
    the index, each carrying the export's metadata). Checked as Tessera's reader checks
    it: plain file names, every name in the file the map gives, no name in two files."""
    if not path.endswith(".index.json"):
        return read_safetensors(path, with_metadata=True)
    try:
        with open(path, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map is not a map of file names")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ExportError(f"{path}: not a safetensors index ({e})") from e
    folder = os.path.dirname(path)
    tensors, metadata, file_of = {}, {}, {}
    for file_name in sorted(set(weight_map.values())):
        if file_name in ("", ".", "..") or "/" in file_name or "\0" in file_name:
            raise ExportError(f"{path}: weight_map file '{file_name}' is not a plain file name")
        part, md = read_safetensors(os.path.join(folder, file_name), with_metadata=True)
        for name in part:
            if name in file_of:
                raise ExportError(f"{path}: tensor '{name}' is in both {file_of[name]} and {file_name}")
            file_of[name] = file_name
        tensors.update(part)
        if METADATA_KEY in md and not metadata:
            metadata = md
    for name, file_name in weight_map.items():
        if file_of.get(name) != file_name:
            raise ExportError(f"{path}: weight_map puts '{name}' in {file_name}, which does not hold it")
    return tensors, metadata


# ---------------------------------------------------------------------------------------
# Models (models/models.cpp, models/diffusion.cpp)
# ---------------------------------------------------------------------------------------

def _activation(name):
    # models/models.cpp runHiddenLayers: relu for "relu", otherwise gelu (exact, erf).
    return F.relu if name == "relu" else F.gelu


class ContextMlp(nn.Module):
    """mlp on token windows: embed (vocab x embed_dim), flatten the window, hidden Linear
    layers (layers.<i>) each followed by the activation, head Linear -> vocab logits."""

    def __init__(self, vocab_size, context, embed_dim, hidden, activation="gelu"):
        super().__init__()
        self.context = context
        self.activation = activation
        self.embed = nn.Embedding(vocab_size, embed_dim)
        self.layers = nn.ModuleList()
        width = context * embed_dim
        for h in hidden:
            self.layers.append(nn.Linear(width, h))
            width = h
        self.head = nn.Linear(width, vocab_size)

    def forward(self, tokens):
        if tokens.dim() != 2 or tokens.size(1) != self.context:
            raise ValueError(f"ContextMlp: expected tokens [batch, {self.context}], got {list(tokens.shape)}")
        x = self.embed(tokens).flatten(1)
        act = _activation(self.activation)
        for layer in self.layers:
            x = act(layer(x))
        return self.head(x)


class FeatureMlp(nn.Module):
    """mlp on float tensors: flatten, hidden Linear layers (layers.<i>) each followed by the
    activation, head Linear -> out_features: the classes' logits, or the flattened target's
    values for regression (as Tessera's forward, [B, out_features] either way)."""

    def __init__(self, in_features, hidden, activation, out_features):
        super().__init__()
        self.activation = activation
        self.layers = nn.ModuleList()
        width = in_features
        for h in hidden:
            self.layers.append(nn.Linear(width, h))
            width = h
        self.head = nn.Linear(width, out_features)

    def features(self, x):
        """The input of the head (the penultimate features): [B, last hidden width], or the
        flattened input without hidden layers."""
        x = x.flatten(1).to(self.head.weight.dtype)
        act = _activation(self.activation)
        for layer in self.layers:
            x = act(layer(x))
        return x

    def forward(self, x):
        return self.head(self.features(x))


class ConvNet(nn.Module):
    """convnet (models/convnet.h): stages.<i> Conv2d(3x3, padding 1) each followed by ReLU and
    a 2x2 max pool, one per entry of hidden but the last; fc Linear over the flattened map,
    ReLU (the features); head Linear -> the classes' logits."""

    def __init__(self, input_shape, hidden, classes):
        super().__init__()
        channels, height, width = input_shape
        self.stages = nn.ModuleList()
        for h in hidden[:-1]:
            self.stages.append(nn.Conv2d(channels, h, 3, padding=1))
            channels, height, width = h, height // 2, width // 2
        self.fc = nn.Linear(channels * height * width, hidden[-1])
        self.head = nn.Linear(hidden[-1], classes)

    def features(self, x):
        x = x.to(self.head.weight.dtype)
        for stage in self.stages:
            x = F.max_pool2d(F.relu(stage(x)), 2)
        return F.relu(self.fc(x.flatten(1)))

    def forward(self, x):
        return self.head(self.features(x))


class GptBlock(nn.Module):
    """nanoGPT's Block: ln_1, attn.c_attn (W -> 3W), attn.c_proj, ln_2, mlp.c_fc (W -> 4W),
    mlp.c_proj; causal attention, exact GELU, LayerNorm with bias (eps 1e-5)."""

    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(width)
        self.attn = nn.Module()
        self.attn.c_attn = nn.Linear(width, 3 * width)
        self.attn.c_proj = nn.Linear(width, width)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Module()
        self.mlp.c_fc = nn.Linear(width, 4 * width)
        self.mlp.c_proj = nn.Linear(4 * width, width)

    def forward(self, x):
        batch, time, width = x.shape
        head_dim = width // self.heads
        q, k, v = (t.view(batch, time, self.heads, head_dim).transpose(1, 2)
                   for t in self.attn.c_attn(self.ln_1(x)).chunk(3, dim=2))
        scores = q.matmul(k.transpose(-2, -1)) / math.sqrt(head_dim)
        future = torch.ones(time, time, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
        attended = torch.softmax(scores, -1).matmul(v).transpose(1, 2).reshape(batch, time, width)
        h = x + self.attn.c_proj(attended)
        return h + self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(h))))


class Gpt(nn.Module):
    """GPT-2-style decoder with nanoGPT's names (wte, wpe, h.<i>, ln_f, lm_head without
    bias). With tie_head there is no lm_head: the logits are x @ wte.weight^T."""

    def __init__(self, vocab_size, context, embed_dim, layers, heads, tie_head=False):
        super().__init__()
        if embed_dim % heads:
            raise ValueError(f"gpt: embed_dim {embed_dim} is not divisible by heads {heads}")
        self.context = context
        self.tie_head = tie_head
        self.wte = nn.Embedding(vocab_size, embed_dim)
        self.wpe = nn.Embedding(context, embed_dim)
        self.h = nn.ModuleList([GptBlock(embed_dim, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(embed_dim)
        if not tie_head:
            self.lm_head = nn.Linear(embed_dim, vocab_size, bias=False)

    def forward(self, tokens):
        if tokens.dim() != 2 or not 1 <= tokens.size(1) <= self.context:
            raise ValueError(f"Gpt: expected tokens [batch, 1..{self.context}], got {list(tokens.shape)}")
        positions = torch.arange(tokens.size(1), dtype=tokens.dtype, device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        return x.matmul(self.wte.weight.t()) if self.tie_head else self.lm_head(x)

    def next_token_logits(self, tokens):
        return self.forward(tokens)[:, -1]


class DenoiserBlock(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.time_proj = nn.Linear(width, width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, h, temb):
        y = self.norm(h) + self.time_proj(F.silu(temb))
        return h + self.fc2(F.silu(self.fc1(y)))


class DiffusionDenoiser(nn.Module):
    """Tessera's MLP denoiser (models/diffusion.h): time_embed Sequential(Linear, SiLU,
    Linear) of a sinusoidal embedding of t, input_proj of the flattened x_t, residual
    blocks.<i> (norm, time_proj, fc1, fc2), out_norm, output_proj. Unconditional: the
    forward takes labels `y` for the samplers' sake and ignores them."""

    def __init__(self, sample_shape, embed_dim, layers):
        super().__init__()
        self.sample_shape = list(sample_shape)
        self.width = embed_dim
        features = math.prod(self.sample_shape)
        if features < 1:
            raise ValueError(f"diffusion: samples of shape {self.sample_shape} have no features")
        self.time_embed = nn.Sequential(nn.Linear(embed_dim, embed_dim), nn.SiLU(), nn.Linear(embed_dim, embed_dim))
        self.input_proj = nn.Linear(features, embed_dim)
        self.blocks = nn.ModuleList([DenoiserBlock(embed_dim) for _ in range(layers)])
        self.out_norm = nn.LayerNorm(embed_dim)
        self.output_proj = nn.Linear(embed_dim, features)

    def time_embedding(self, t):
        # [cos(t f_k), sin(t f_k)], f_k = 10000^(-k / half), zero-padded to an odd width.
        half = self.width // 2
        freqs = torch.exp(torch.arange(half, dtype=torch.float32, device=t.device)
                          * (-math.log(10000.0) / max(half, 1)))
        args = t.float().unsqueeze(1) * freqs.unsqueeze(0)
        emb = torch.cat([torch.cos(args), torch.sin(args)], 1)
        if self.width % 2:
            emb = torch.cat([emb, torch.zeros(emb.size(0), 1, device=t.device)], 1)
        return emb

    def forward(self, x, t, y=None):
        features = math.prod(self.sample_shape)
        if x.dim() < 2 or x.numel() != x.size(0) * features or t.dim() != 1 or t.size(0) != x.size(0):
            raise ValueError(f"DiffusionDenoiser: expected x_t [batch, {features} features] and t [batch], "
                             f"got {list(x.shape)} and {list(t.shape)}")
        dtype = self.input_proj.weight.dtype
        temb = self.time_embed(self.time_embedding(t).to(dtype))
        h = self.input_proj(x.flatten(1).to(dtype))
        for block in self.blocks:
            h = block(h, temb)
        return self.output_proj(self.out_norm(h)).view(x.shape)


# ---------------------------------------------------------------------------------------
# DiT (Peebles & Xie, facebookresearch/DiT models.py), learn_sigma=False, without timm
# ---------------------------------------------------------------------------------------

def modulate(x, shift, scale):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


def _get_1d_sincos(embed_dim, positions):
    # MAE's get_1d_sincos_pos_embed_from_grid in float64: [sin(pos w_d)..., cos(pos w_d)...],
    # w_d = 1 / 10000^(d / (embed_dim / 2)).
    omega = [1.0 / 10000.0 ** (d / (embed_dim / 2.0)) for d in range(embed_dim // 2)]
    return [[math.sin(p * w) for w in omega] + [math.cos(p * w) for w in omega] for p in positions]


def get_2d_sincos_pos_embed(embed_dim, grid_size):
    """The reference's fixed 2-D sin-cos position embedding, [grid_size^2, embed_dim]
    float64 (row-major patches; as np.meshgrid(grid_w, grid_h), the first half of the
    columns encodes the patch's column, the second its row)."""
    if embed_dim % 4:
        raise ValueError(f"dit: embed_dim {embed_dim} must be a multiple of 4 (2-D sin-cos position embedding)")
    cols = [float(j) for i in range(grid_size) for j in range(grid_size)]
    rows = [float(i) for i in range(grid_size) for j in range(grid_size)]
    emb_a = _get_1d_sincos(embed_dim // 2, cols)
    emb_b = _get_1d_sincos(embed_dim // 2, rows)
    return torch.tensor([a + b for a, b in zip(emb_a, emb_b)], dtype=torch.float64)


class PatchEmbed(nn.Module):
    """timm's PatchEmbed as DiT uses it: proj Conv2d(C, D, p, stride p), flatten, no norm."""

    def __init__(self, img_size, patch_size, in_chans, embed_dim):
        super().__init__()
        self.img_size = (img_size, img_size)
        self.patch_size = (patch_size, patch_size)
        self.grid_size = (img_size // patch_size, img_size // patch_size)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size, bias=True)

    def forward(self, x):
        if tuple(x.shape[-2:]) != self.img_size:
            raise ValueError(f"DiT: expected images of {self.img_size[0]}x{self.img_size[1]}, got {list(x.shape)}")
        return self.proj(x).flatten(2).transpose(1, 2)


class TimestepEmbedder(nn.Module):
    def __init__(self, hidden_size, frequency_embedding_size=256):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(frequency_embedding_size, hidden_size, bias=True), nn.SiLU(),
                                 nn.Linear(hidden_size, hidden_size, bias=True))
        self.frequency_embedding_size = frequency_embedding_size

    @staticmethod
    def timestep_embedding(t, dim, max_period=10000):
        half = dim // 2
        freqs = torch.exp(-math.log(max_period) * torch.arange(start=0, end=half, dtype=torch.float32) / half
                          ).to(device=t.device)
        args = t[:, None].float() * freqs[None]
        embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        if dim % 2:
            embedding = torch.cat([embedding, torch.zeros_like(embedding[:, :1])], dim=-1)
        return embedding

    def forward(self, t):
        # In the MLP's dtype, as Tessera: bf16 parameters (FSDP2's param_dtype) take bf16 in.
        return self.mlp(self.timestep_embedding(t, self.frequency_embedding_size).to(self.mlp[0].weight.dtype))


class LabelEmbedder(nn.Module):
    """classes + 1 rows (the last, index `classes`, is "no class"). No label dropout here:
    training code drops labels itself (y -> classes with probability class_dropout)."""

    def __init__(self, num_classes, hidden_size):
        super().__init__()
        self.embedding_table = nn.Embedding(num_classes + 1, hidden_size)
        self.num_classes = num_classes

    def forward(self, labels):
        return self.embedding_table(labels)


class Attention(nn.Module):
    """timm's Attention (qkv_bias=True, no q/k norm) computed as Tessera does:
    softmax(q k^T / sqrt(head_dim)) v, through the fused kernel on PyTorch 2."""

    def __init__(self, dim, num_heads):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dit: embed_dim {dim} is not divisible by heads {num_heads}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        if hasattr(F, "scaled_dot_product_attention"):  # PyTorch 2: the fused kernel, as timm and Tessera there
            x = F.scaled_dot_product_attention(q, k, v)
        else:
            x = ((q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)).softmax(dim=-1) @ v
        x = x.transpose(1, 2).reshape(B, N, C)
        return self.proj(x)


class Mlp(nn.Module):
    """timm's Mlp: fc1, GELU (tanh approximation, as DiT asks), fc2."""

    def __init__(self, in_features, hidden_features):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden_features, in_features)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class DiTBlock(nn.Module):
    def __init__(self, hidden_size, num_heads, mlp_ratio=4.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(hidden_size, num_heads)
        self.norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(hidden_size, int(hidden_size * mlp_ratio))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size, bias=True))

    def forward(self, x, c):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        x = x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))
        return x


class FinalLayer(nn.Module):
    def __init__(self, hidden_size, patch_size, out_channels):
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        # patch_size: the side of each token's output window (the patch, or with
        # patch_overlap m the patch plus m on every side).
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels, bias=True)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size, bias=True))

    def forward(self, x, c):
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class DiT(nn.Module):
    """DiT with adaLN-Zero blocks, learn_sigma=False (out_channels = in_channels).
    forward(x [N,C,H,W], t [N] int64, y [N] int64 in [0, classes]) -> the predicted noise or
    velocity [N,C,H,W] (the export's "prediction"); y == classes is the unconditional label.
    Modules are created in the reference's order, so a seeded construction draws what the
    reference draws (without final_conv, whose Conv2d draws too before it is zeroed).
    final_conv (Tessera's model.final_conv, not the reference's): the unpatchified output y
    becomes y + conv3x3(y) (U-ViT's remedy for patch seams), the convolution zero at first.
    patch_overlap m (Tessera's model.patch_overlap, 0 <= m <= patch_size / 2): each token
    predicts a (p + 2m)^2 window centred on its patch; the windows are weighted by a
    window that is 1 inside and falls linearly over the 2m pixels neighbours share, summed
    (F.fold) and divided by the weights' sum at each pixel."""

    def __init__(self, input_size=28, patch_size=4, in_channels=1, hidden_size=128, depth=6, num_heads=4,
                 mlp_ratio=4.0, num_classes=10, final_conv=False, patch_overlap=0):
        super().__init__()
        if input_size % patch_size:
            raise ValueError(f"dit: image size {input_size} is not a multiple of patch_size {patch_size}")
        if not 0 <= 2 * patch_overlap <= patch_size:
            raise ValueError(f"dit: patch_overlap {patch_overlap} must be between 0 and half of patch_size {patch_size}")
        self.in_channels = in_channels
        self.out_channels = in_channels
        self.patch_size = patch_size
        self.num_heads = num_heads
        self.num_classes = num_classes
        self.x_embedder = PatchEmbed(input_size, patch_size, in_channels, hidden_size)
        self.t_embedder = TimestepEmbedder(hidden_size)
        self.y_embedder = LabelEmbedder(num_classes, hidden_size)
        num_patches = self.x_embedder.num_patches
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches, hidden_size), requires_grad=False)
        self.blocks = nn.ModuleList([DiTBlock(hidden_size, num_heads, mlp_ratio=mlp_ratio) for _ in range(depth)])
        self.patch_overlap, self.window = patch_overlap, patch_size + 2 * patch_overlap
        self.final_layer = FinalLayer(hidden_size, self.window, self.out_channels)
        if patch_overlap:
            ramp, k = 2 * patch_overlap, self.window
            edge = torch.tensor([min(1.0, (min(i, k - 1 - i) + 0.5) / ramp) for i in range(k)])
            weights = torch.outer(edge, edge).reshape(1, k * k).expand(in_channels, -1).reshape(1, -1, 1)
            self.register_buffer("blend_weights", weights, persistent=False)
            self.register_buffer("blend_norm", F.fold(weights.expand(-1, -1, num_patches), (input_size, input_size), k,
                                                      padding=patch_overlap, stride=patch_size), persistent=False)
        self.final_conv = nn.Conv2d(self.out_channels, self.out_channels, 3, padding=1) if final_conv else None
        self.initialize_weights()

    def initialize_weights(self):
        """The reference's initialisation: xavier-uniform Linear weights, zero biases, fixed
        sin-cos pos_embed, patch projection as a Linear (bias 0), label table N(0, 0.02),
        timestep MLP weights N(0, 0.02), adaLN modulations and the final linear zero."""
        def _basic_init(module):
            if isinstance(module, nn.Linear):
                torch.nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.constant_(module.bias, 0)
        self.apply(_basic_init)

        pos_embed = get_2d_sincos_pos_embed(self.pos_embed.shape[-1], int(self.x_embedder.num_patches ** 0.5))
        self.pos_embed.data.copy_(pos_embed.float().unsqueeze(0))

        # The patch projection is initialised like a Linear (xavier on the flattened kernel).
        w = self.x_embedder.proj.weight.data
        nn.init.xavier_uniform_(w.view([w.shape[0], -1]))
        nn.init.constant_(self.x_embedder.proj.bias, 0)

        nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)

        for block in self.blocks:
            nn.init.constant_(block.adaLN_modulation[-1].weight, 0)
            nn.init.constant_(block.adaLN_modulation[-1].bias, 0)
        nn.init.constant_(self.final_layer.adaLN_modulation[-1].weight, 0)
        nn.init.constant_(self.final_layer.adaLN_modulation[-1].bias, 0)
        nn.init.constant_(self.final_layer.linear.weight, 0)
        nn.init.constant_(self.final_layer.linear.bias, 0)
        if self.final_conv is not None:
            nn.init.constant_(self.final_conv.weight, 0)
            nn.init.constant_(self.final_conv.bias, 0)

    def unpatchify(self, x):
        c = self.out_channels
        p = self.x_embedder.patch_size[0]
        h = w = int(x.shape[1] ** 0.5)
        assert h * w == x.shape[1]
        if self.patch_overlap:
            k = self.window
            columns = x.reshape(x.shape[0], h * w, k, k, c).permute(0, 4, 2, 3, 1).reshape(x.shape[0], c * k * k, h * w)
            return F.fold(columns * self.blend_weights, (h * p, h * p), k, padding=self.patch_overlap,
                          stride=p) / self.blend_norm
        x = x.reshape(shape=(x.shape[0], h, w, p, p, c))
        x = torch.einsum("nhwpqc->nchpwq", x)
        return x.reshape(shape=(x.shape[0], c, h * p, h * p))

    def forward(self, x, t, y):
        x = self.x_embedder(x) + self.pos_embed
        c = self.t_embedder(t) + self.y_embedder(y)
        for block in self.blocks:
            x = block(x, c)
        out = self.unpatchify(self.final_layer(x, c))
        return out if self.final_conv is None else out + self.final_conv(out)


# ---------------------------------------------------------------------------------------
# Noise schedule and samplers (models/diffusion.cpp)
# ---------------------------------------------------------------------------------------

class NoiseSchedule:
    """The betas and their cumulative products, as Python floats (doubles), and what the
    denoiser outputs. linear: betas[t] = beta_start + (beta_end - beta_start) t / (T - 1)
    (T == 1: beta_start); cosine (Nichol & Dhariwal): abar(u) = f(u) / f(0), f(u) =
    cos^2((u / T + 0.008) / 1.008 pi / 2), betas[t] = min(1 - abar(t + 1) / abar(t), 0.999);
    alpha_bars[t] = prod_{s <= t} (1 - betas[s]). zero_terminal_snr (Lin et al. 2024):
    sqrt(abar) shifted and scaled so that its first value stays and its last is 0, the betas
    from the ratios. prediction: "eps" (the noise) or "v" (the velocity
    sqrt(abar) eps - sqrt(1 - abar) x0); clean_estimate and noise_estimate read an output."""

    def __init__(self, timesteps, beta_start, beta_end, noise_schedule="linear", zero_terminal_snr=False,
                 prediction="eps"):
        if timesteps < 1:
            raise ValueError(f"timesteps must be >= 1, got {timesteps}")
        if not 0 < beta_start <= beta_end < 1:
            raise ValueError(f"beta_start {beta_start} and beta_end {beta_end} must satisfy "
                             "0 < beta_start <= beta_end < 1")
        if noise_schedule not in ("linear", "cosine"):
            raise ValueError(f"noise_schedule '{noise_schedule}': linear or cosine")
        if prediction not in ("eps", "v"):
            raise ValueError(f"prediction '{prediction}': eps or v")
        if zero_terminal_snr and (prediction != "v" or timesteps < 2):
            raise ValueError("zero_terminal_snr needs prediction v and timesteps >= 2")
        if noise_schedule == "cosine" and prediction != "v":
            raise ValueError("noise_schedule cosine needs prediction v")
        self.timesteps, self.prediction = timesteps, prediction
        self.betas, self.alpha_bars = [], []
        product = 1.0
        for t in range(timesteps):
            beta = beta_start if timesteps == 1 else beta_start + (beta_end - beta_start) * t / (timesteps - 1)
            product *= 1.0 - beta
            self.betas.append(beta)
            self.alpha_bars.append(product)
        if noise_schedule == "cosine":
            def f(u):
                return math.cos((u / timesteps + 0.008) / (1 + 0.008) * math.pi / 2) ** 2
            product = 1.0
            for t in range(timesteps):
                beta = min(1.0 - f(t + 1) / f(t), 0.999)
                product *= 1.0 - beta
                self.betas[t], self.alpha_bars[t] = beta, product
        if zero_terminal_snr:
            first, last = math.sqrt(self.alpha_bars[0]), math.sqrt(self.alpha_bars[-1])
            previous = 1.0
            for t in range(timesteps):
                root = (math.sqrt(self.alpha_bars[t]) - last) * first / (first - last)
                self.alpha_bars[t] = 0.0 if t == timesteps - 1 else root * root
                self.betas[t] = 1.0 - self.alpha_bars[t] / previous
                previous = self.alpha_bars[t]

    def clean_estimate(self, x, out, t):
        """The clean sample a denoiser's output `out` at x_t estimates (float32 tensors
        times double scalars, as Tessera computes it)."""
        signal, spread = math.sqrt(self.alpha_bars[t]), math.sqrt(1.0 - self.alpha_bars[t])
        return (x - spread * out) / signal if self.prediction == "eps" else signal * x - spread * out

    def noise_estimate(self, x, out, t):
        """The noise a denoiser's output `out` at x_t estimates."""
        signal, spread = math.sqrt(self.alpha_bars[t]), math.sqrt(1.0 - self.alpha_bars[t])
        return out if self.prediction == "eps" else spread * x + signal * out


def ddim_timesteps(timesteps, steps):
    """DDIM's timesteps T-1 = t_0 > ... > t_{steps-1} = 0: t_k = (T-1)(steps-1-k)/(steps-1)
    rounded half to even, in exact integer arithmetic; steps == 1: [T-1]."""
    if not 1 <= steps <= timesteps:
        raise ValueError(f"{steps} DDIM steps for {timesteps} timesteps (1 to {timesteps})")
    if steps == 1:
        return [timesteps - 1]
    den = steps - 1
    out = []
    for k in range(steps):
        q, r = divmod((timesteps - 1) * (steps - 1 - k), den)
        if 2 * r > den or (2 * r == den and q % 2 == 1):
            q += 1
        out.append(q)
    return out


def guided_noise(model, x, t, labels, cfg):
    """The output the samplers step with (the noise or the velocity, as the model predicts).
    An unconditional model (no `num_classes`, or 0 of them: DiffusionDenoiser) or cfg == 1:
    model(x, t, labels), one call. Otherwise classifier-free guidance from two calls,
    out_u + cfg (out_c - out_u), out_u with every label "no class" (= num_classes)."""
    classes = getattr(model, "num_classes", 0)
    eps = model(x, t, labels).float()
    if cfg == 1 or classes == 0:
        return eps
    eps_u = model(x, t, torch.full_like(labels, classes)).float()
    return eps_u + cfg * (eps - eps_u)


def _labels_or_unconditional(model, batch, labels):
    """labels as int64, or for None the "no class" label (num_classes) of each of batch's
    samples."""
    if labels is not None:
        return labels.to(torch.int64)
    return torch.full((batch.size(0),), getattr(model, "num_classes", 0), dtype=torch.int64, device=batch.device)


@torch.no_grad()
def sample_ddim(model, schedule, noise, labels=None, steps=50, cfg=1.0, timesteps=None):
    """Deterministic DDIM (eta = 0) from `noise` [N, ...] in `steps` steps over
    ddim_timesteps(), or over `timesteps` (decreasing: a distilled generator's
    sample_timesteps, see sample_timesteps()): the estimates x0 and eps of the
    output at x (a noise prediction: x0 = (x - sqrt(1 - abar_t) eps) / sqrt(abar_t)), then
    the next x = sqrt(abar_s) x0 + sqrt(1 - abar_s) eps; after the last, x0 (no
    clipping). float32 tensors times double scalars, as Tessera computes it. labels [N] in
    [0, classes] (None: "no class")."""
    x = noise.float()
    labels = _labels_or_unconditional(model, noise, labels)
    if timesteps is None:
        ts = ddim_timesteps(schedule.timesteps, steps)
    else:
        ts = list(timesteps)
        if not ts or any(not 0 <= t < schedule.timesteps for t in ts) or any(b >= a for a, b in zip(ts, ts[1:])):
            raise ValueError(f"DDIM timesteps {ts}: need a decreasing list within [0, {schedule.timesteps - 1}]")
    for k, t in enumerate(ts):
        out = guided_noise(model, x, torch.full((x.size(0),), t, dtype=torch.int64, device=x.device), labels, cfg)
        x0, eps = schedule.clean_estimate(x, out, t), schedule.noise_estimate(x, out, t)
        if k + 1 < len(ts):
            next_bar = schedule.alpha_bars[ts[k + 1]]
            x = math.sqrt(next_bar) * x0 + math.sqrt(1.0 - next_bar) * eps
    return x0


@torch.no_grad()
def sample_ddpm(model, schedule, noise, labels=None, cfg=1.0, generator=None):
    """DDPM ancestral sampling from `noise` [N, ...] over t = T-1 ... 0: a noise prediction
    x = (x - eps beta_t / sqrt(1 - abar_t)) / sqrt(1 - beta_t), a velocity the posterior mean
    sqrt(abar_{t-1}) beta_t / (1 - abar_t) x0 + sqrt(1 - beta_t) (1 - abar_{t-1}) / (1 - abar_t) x,
    plus sqrt(beta_t) z for t > 0 (z drawn with `generator`; Tessera's C++ random stream is
    not reproduced)."""
    x = noise.float()
    labels = _labels_or_unconditional(model, noise, labels)
    for t in range(schedule.timesteps - 1, -1, -1):
        beta, abar = schedule.betas[t], schedule.alpha_bars[t]
        out = guided_noise(model, x, torch.full((x.size(0),), t, dtype=torch.int64, device=x.device), labels, cfg)
        if schedule.prediction == "eps":
            x = (x - out * (beta / math.sqrt(1.0 - abar))) / math.sqrt(1.0 - beta)
        else:
            previous = 1.0 if t == 0 else schedule.alpha_bars[t - 1]
            x0 = schedule.clean_estimate(x, out, t)
            x = x0 * (math.sqrt(previous) * beta / (1.0 - abar)) + \
                x * (math.sqrt(1.0 - beta) * (1.0 - previous) / (1.0 - abar))
        if t > 0:
            x = x + torch.randn(x.shape, generator=generator).to(x.device) * math.sqrt(beta)
    return x


# ---------------------------------------------------------------------------------------
# Exports: metadata -> model, weights -> model
# ---------------------------------------------------------------------------------------

def _field(obj, key, kind, where=""):
    """obj[key], checked to be of `kind` (int, float, bool, str, dict, or "ints": a list of
    ints); ExportError naming the key otherwise."""
    if key not in obj:
        raise ExportError(f"{METADATA_KEY}: '{where}{key}' is missing")
    value = obj[key]
    if kind == "ints":
        ok = isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        expected = "a list of integers" if kind == "ints" else kind.__name__
        raise ExportError(f"{METADATA_KEY}: '{where}{key}' is {value!r}, expected {expected}")
    return value


def noise_schedule(metadata):
    """The NoiseSchedule of a denoiser's metadata (timesteps, beta_start, beta_end, and
    noise_schedule, zero_terminal_snr, prediction: an export made before them is linear,
    without zero terminal SNR, predicting the noise)."""
    def optional(key, kind, default):
        return _field(metadata, key, kind) if key in metadata else default
    try:
        return NoiseSchedule(_field(metadata, "timesteps", int), _field(metadata, "beta_start", float),
                             _field(metadata, "beta_end", float), optional("noise_schedule", str, "linear"),
                             optional("zero_terminal_snr", bool, False), optional("prediction", str, "eps"))
    except ValueError as e:
        raise ExportError(f"{METADATA_KEY}: {e}") from e


def sample_timesteps(metadata):
    """The timesteps a denoiser's export says it samples at (a distilled few-step
    generator's model.sample_timesteps), or None: DDIM's evenly spaced steps."""
    if "sample_timesteps" not in metadata:
        return None
    return _field(metadata, "sample_timesteps", "ints") or None


def _build(metadata):
    arch = _field(metadata, "arch", str)
    data = _field(metadata, "data", dict)
    input_shape = _field(data, "input_shape", "ints", "data.")
    if arch == "mlp" and _field(data, "tokens", bool, "data."):
        return ContextMlp(_field(metadata, "vocab_size", int), _field(metadata, "context", int),
                          _field(metadata, "embed_dim", int), _field(metadata, "hidden", "ints"),
                          _field(metadata, "activation", str))
    if arch == "mlp":
        classes = _field(data, "classes", int, "data.")
        out = classes if classes > 0 else math.prod(_field(data, "target_shape", "ints", "data."))
        return FeatureMlp(math.prod(input_shape), _field(metadata, "hidden", "ints"),
                          _field(metadata, "activation", str), out)
    if arch == "convnet":
        hidden = _field(metadata, "hidden", "ints")
        if len(input_shape) != 3 or len(hidden) < 2:
            raise ExportError(f"{METADATA_KEY}: convnet needs images, data.input_shape [C, H, W], and hidden with the "
                              f"stages' channels and the feature width, got {input_shape} and {hidden}")
        return ConvNet(input_shape, hidden, _field(data, "classes", int, "data."))
    if arch == "gpt":
        return Gpt(_field(metadata, "vocab_size", int), _field(metadata, "context", int),
                   _field(metadata, "embed_dim", int), _field(metadata, "layers", int), _field(metadata, "heads", int),
                   _field(metadata, "tie_head", bool))
    if arch == "diffusion":
        return _with_gan_head(DiffusionDenoiser(input_shape, _field(metadata, "embed_dim", int),
                                                _field(metadata, "layers", int)), metadata,
                              _field(metadata, "embed_dim", int))
    if arch == "dit":
        if len(input_shape) != 3 or input_shape[1] != input_shape[2]:
            raise ExportError(f"{METADATA_KEY}: dit needs square images, data.input_shape [C, H, H], "
                              f"got {input_shape}")
        return _with_gan_head(DiT(input_size=input_shape[1], patch_size=_field(metadata, "patch_size", int),
                   in_channels=input_shape[0], hidden_size=_field(metadata, "embed_dim", int),
                   depth=_field(metadata, "layers", int), num_heads=_field(metadata, "heads", int),
                   mlp_ratio=_field(metadata, "mlp_ratio", float), num_classes=_field(metadata, "classes", int),
                   final_conv=_field(metadata, "final_conv", bool) if "final_conv" in metadata else False,
                   patch_overlap=_field(metadata, "patch_overlap", int) if "patch_overlap" in metadata else 0),
                              metadata, _field(metadata, "embed_dim", int))
    raise ExportError(f"{METADATA_KEY}: unknown arch '{arch}' (mlp, gpt, diffusion, dit, convnet)")


def _with_gan_head(model, metadata, width):
    """A denoiser exported with a GAN head (gan_head_block >= 0: a DMD critic) gets the
    head's modules, so that its export loads strictly."""
    if metadata.get("gan_head_block", -1) >= 0:
        model.gan_head = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.SiLU(), nn.Linear(width, 1))
    return model


# Ranges of the size fields, as Tessera's config schema bounds them (common/limits.h).
_MAX_WIDTH, _MAX_LAYERS, _MAX_SAMPLE_ELEMENTS = 1 << 24, 1 << 16, 1 << 28


def _check_ranges(metadata):
    """Each size field within Tessera's bounds before anything is sized by it."""
    arch = _field(metadata, "arch", str)
    for key, low, high in (("vocab_size", 2, 1 << 31), ("context", 1, _MAX_WIDTH), ("embed_dim", 1, _MAX_WIDTH),
                           ("layers", 1, _MAX_LAYERS), ("heads", 1, _MAX_WIDTH), ("patch_size", 1, _MAX_WIDTH),
                           ("patch_overlap", 0, _MAX_WIDTH),
                           ("timesteps", 1, _MAX_WIDTH), ("classes", 0, 1 << 20)):
        if key in metadata:
            value = _field(metadata, key, int)
            if isinstance(value, bool) or not low <= value <= high:
                raise ExportError(f"{METADATA_KEY}: '{key}' is {value}, outside [{low}, {high}]")
    for width in (_field(metadata, "hidden", "ints") if "hidden" in metadata else []):
        if not 1 <= width <= _MAX_WIDTH:
            raise ExportError(f"{METADATA_KEY}: 'hidden' holds {width}, outside [1, {_MAX_WIDTH}]")
    if "mlp_ratio" in metadata:
        ratio = _field(metadata, "mlp_ratio", float)
        if not (math.isfinite(ratio) and 0 < ratio <= 64):
            raise ExportError(f"{METADATA_KEY}: 'mlp_ratio' is {ratio}, outside (0, 64]")
    if arch in ("gpt", "dit") and "heads" in metadata and "embed_dim" in metadata:
        if metadata["embed_dim"] % metadata["heads"] != 0:
            raise ExportError(f"{METADATA_KEY}: 'embed_dim' {metadata['embed_dim']} is not divisible by "
                              f"'heads' {metadata['heads']}")
    data = _field(metadata, "data", dict)
    for key in ("input_shape", "target_shape"):
        if key not in data:
            continue
        shape = _field(data, key, "ints", "data.")
        elements = 1
        for dim in shape:
            if dim < 1 or elements * dim > _MAX_SAMPLE_ELEMENTS:
                raise ExportError(f"{METADATA_KEY}: 'data.{key}' {shape} is not a sample size Tessera trains "
                                  f"(dimensions >= 1, at most {_MAX_SAMPLE_ELEMENTS} elements)")
            elements *= dim


def _check_against_file(metadata, tensors, path):
    """The metadata's sizes against the tensors the file holds (as Tessera's
    checkedModelMetadata): no more blocks than tensors, no width beyond the largest
    dimension, DiT's positional table no larger than the file."""
    shapes = [list(t.shape) for t in tensors.values()]
    largest = max((d for shape in shapes for d in shape), default=0)
    arch = metadata["arch"]
    if arch in ("gpt", "dit", "diffusion") and metadata.get("layers", 0) > len(shapes):
        raise ExportError(f"{path}: __metadata__ '{METADATA_KEY}' says layers {metadata['layers']}, but the file "
                          f"holds only {len(shapes)} tensors")
    widths = [metadata.get("embed_dim", 0)] if arch in ("gpt", "dit") else []
    widths += metadata.get("hidden", []) if arch in ("mlp", "convnet") else []
    for width in widths:
        if width > largest:
            raise ExportError(f"{path}: __metadata__ '{METADATA_KEY}' has a width {width}, wider than any tensor "
                              f"of the file (largest dimension {largest})")
    if arch == "dit":
        shape = metadata["data"]["input_shape"]
        if len(shape) == 3:
            grid = shape[1] // metadata.get("patch_size", 1)
            if grid * grid * metadata.get("embed_dim", 0) > sum(t.numel() for t in tensors.values()):
                raise ExportError(f"{path}: __metadata__ '{METADATA_KEY}' says {grid} x {grid} patches of width "
                                  f"{metadata.get('embed_dim')}, more values than the file holds")


def build_model(metadata):
    """The model (freshly initialised, float32) that an export's metadata describes: the
    parsed tessera.model object. ExportError for a missing field or impossible sizes."""
    if not isinstance(metadata, dict):
        raise ExportError(f"{METADATA_KEY}: not a JSON object")
    _check_ranges(metadata)
    try:
        model = _build(metadata)
    except ValueError as e:
        raise ExportError(f"{METADATA_KEY}: {e}") from e
    if metadata["arch"] in ("diffusion", "dit"):
        noise_schedule(metadata)  # refuses an impossible schedule now rather than at sampling
    return model


def load_export(path):
    """(model in eval mode, metadata dict) of a Tessera export: a safetensors file or a
    sharded export's *.index.json. The weights must be exactly the model's (strict):
    ExportMismatch names every missing or unexpected tensor and every shape that differs;
    ExportError for an unreadable file or metadata."""
    tensors, file_metadata = _read_export_files(path)
    if METADATA_KEY not in file_metadata:
        raise ExportError(f"{path}: no __metadata__ '{METADATA_KEY}' (not a Tessera export, or written before "
                          "exports described their model)")
    try:
        metadata = json.loads(file_metadata[METADATA_KEY])
    except ValueError as e:
        raise ExportError(f"{path}: __metadata__ '{METADATA_KEY}' is not JSON ({e})") from e
    if not isinstance(metadata, dict):
        raise ExportError(f"{path}: __metadata__ '{METADATA_KEY}' is not a JSON object")
    try:
        _check_ranges(metadata)
    except ExportError as e:
        raise ExportError(f"{path}: {e}") from e
    _check_against_file(metadata, tensors, path)
    model = build_model(metadata)
    expected = {name: list(t.shape) for name, t in model.state_dict().items()}
    problems = [f"missing '{name}' {shape}" for name, shape in expected.items() if name not in tensors]
    problems += [f"unexpected '{name}' {list(t.shape)}" for name, t in tensors.items() if name not in expected]
    problems += [f"'{name}' is {list(t.shape)}, the model's is {expected[name]}"
                 for name, t in tensors.items() if name in expected and list(t.shape) != expected[name]]
    if problems:
        raise ExportMismatch(f"{path}: the weights do not fit the {metadata['arch']} model its metadata describes: "
                             + "; ".join(problems))
    model.load_state_dict(tensors, strict=True)
    return model.eval(), metadata


# ---------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------

def relative_difference(a, b):
    """||a - b|| / max(||b||, 1e-12), Frobenius norms in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / max(b.norm().item(), 1e-12)).item()


def _compare(name, ours, theirs, rtol):
    """Prints one comparison line; whether it is within rtol."""
    if list(ours.shape) != list(theirs.shape):
        print(f"{name}: MISMATCH: Python's shape {list(ours.shape)}, Tessera's {list(theirs.shape)}")
        return False
    diff = relative_difference(ours, theirs)
    ok = diff <= rtol  # False for NaN
    print(f"{name}: relative difference {diff:.3e} over {list(theirs.shape)} (rtol {rtol:g}) "
          f"{'ok' if ok else 'MISMATCH'}")
    return ok


def _tensor(tensors, name, path):
    if name not in tensors:
        raise ExportError(f"{path}: no tensor '{name}' (has {sorted(tensors)})")
    return tensors[name]


def _check_forward(args):
    model, _ = load_export(args.weights)
    probe = read_safetensors(args.probe)
    try:
        if isinstance(model, (ContextMlp, Gpt)):
            ours = {"out": model(_tensor(probe, "tokens", args.probe).to(torch.int64))}
        elif isinstance(model, (FeatureMlp, ConvNet)):
            x = _tensor(probe, "x", args.probe).float()
            ours = {"out": model(x)}
            if "features_out" in probe:
                ours["features_out"] = model.features(x)
        else:
            x = _tensor(probe, "x", args.probe).float()
            y = probe["y"].to(torch.int64) if "y" in probe else _labels_or_unconditional(model, x, None)
            ours = {"out": model(x, _tensor(probe, "t", args.probe).to(torch.int64), y)}
    except (ValueError, IndexError, RuntimeError) as e:
        raise ExportError(f"{args.probe}: the probe's inputs do not fit the model: {e}") from e
    results = [_compare(name, out, _tensor(probe, name, args.probe).float(), args.rtol) for name, out in ours.items()]
    return 0 if all(results) else 1


def _int_list(text):
    """argparse type: "999,749,499" -> [999, 749, 499]."""
    try:
        return [int(item) for item in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of integers") from None


def _check_samples(args):
    model, metadata = load_export(args.weights)
    if metadata["arch"] not in ("diffusion", "dit"):
        raise ExportError(f"{args.weights}: check-samples needs a denoiser (diffusion, dit), not {metadata['arch']}")
    schedule = noise_schedule(metadata)
    if args.steps is not None and not 1 <= args.steps <= schedule.timesteps:
        raise ExportError(f"--steps {args.steps}: 1 to the model's {schedule.timesteps} timesteps")
    # As tessera-sample: the export's own timesteps (a distilled generator) unless told the steps.
    timesteps = args.timesteps if args.timesteps is not None else None if args.steps is not None else \
        sample_timesteps(metadata)
    noise_file = read_safetensors(args.noise)
    noise = _tensor(noise_file, "noise", args.noise).float()
    sample_shape = metadata["data"]["input_shape"]
    if noise.dim() == 0 or list(noise.shape[1:]) != sample_shape:
        raise ExportError(f"{args.noise}: noise is {list(noise.shape)}, the model's samples are {sample_shape}")
    labels = noise_file.get("labels")
    if labels is not None:
        labels = labels.to(torch.int64)
        if list(labels.shape) != [noise.size(0)]:
            raise ExportError(f"{args.noise}: labels are {list(labels.shape)}, expected [{noise.size(0)}]")
        classes = getattr(model, "num_classes", None)  # None: a model that ignores labels
        if classes is not None and labels.numel() and not 0 <= labels.min().item() <= labels.max().item() <= classes:
            raise ExportError(f"{args.noise}: labels must be in [0, {classes}] ({classes}: no class), got "
                              f"[{labels.min().item()}, {labels.max().item()}]")
    try:
        ours = sample_ddim(model, schedule, noise, labels, args.steps or 50, args.cfg, timesteps)
    except ValueError as e:
        raise ExportError(f"{args.weights}: {e}") from e
    return 0 if _compare("samples", ours, _tensor(read_safetensors(args.samples), "samples", args.samples).float(),
                         args.rtol) else 1


# The metadata keys that size each model.
_SIZE_KEYS = {
    ContextMlp: ["vocab_size", "context", "embed_dim", "hidden", "activation"],
    FeatureMlp: ["hidden", "activation"],
    ConvNet: ["hidden"],
    Gpt: ["vocab_size", "context", "embed_dim", "layers", "heads", "tie_head"],
    DiffusionDenoiser: ["embed_dim", "layers", "timesteps", "beta_start", "beta_end"],
    DiT: ["embed_dim", "layers", "heads", "patch_size", "mlp_ratio", "classes", "timesteps", "beta_start", "beta_end"],
}
# The diffusion keys describe shows when the export has them (older exports: eps, linear).
_SCHEDULE_KEYS = ["final_conv", "noise_schedule", "zero_terminal_snr", "prediction"]


def _describe(args):
    model, metadata = load_export(args.weights)
    print(f"arch: {metadata['arch']} ({type(model).__name__})")
    keys = _SIZE_KEYS[type(model)] + [k for k in _SCHEDULE_KEYS if k in metadata]
    print("model: " + ", ".join(f"{k} {metadata[k]}" for k in keys))
    print("data: " + ", ".join(f"{k} {v}" for k, v in metadata["data"].items()))
    state = model.state_dict()
    print(f"parameters: {sum(t.numel() for t in state.values())} in {len(state)} tensors")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description="Tessera's built-in models in PyTorch: check an export's forward "
                                                 "pass and DDIM samples against Tessera's, or describe it.")
    commands = parser.add_subparsers(dest="command", required=True)
    forward = commands.add_parser("check-forward", help="compare the forward pass with a probe file's outputs")
    forward.add_argument("--weights", required=True, help="export: .safetensors or a sharded export's .index.json")
    forward.add_argument("--probe", required=True, help="safetensors: inputs and Tessera's outputs")
    forward.add_argument("--rtol", type=float, default=1e-4, help="largest relative difference accepted")
    forward.set_defaults(run=_check_forward)
    samples = commands.add_parser("check-samples", help="compare DDIM samples with Tessera's")
    samples.add_argument("--weights", required=True, help="export: .safetensors or a sharded export's .index.json")
    samples.add_argument("--noise", required=True, help="safetensors: 'noise' [N, ...], optional 'labels' [N]")
    samples.add_argument("--samples", required=True, help="safetensors: Tessera's 'samples' [N, ...]")
    which = samples.add_mutually_exclusive_group()
    which.add_argument("--steps", type=int, help="DDIM steps, evenly spaced (default: the export's "
                       "sample_timesteps, or 50)")
    which.add_argument("--timesteps", type=_int_list, help="DDIM at these timesteps, e.g. 999,749,499,249")
    samples.add_argument("--cfg", type=float, required=True, help="classifier-free guidance scale (1: none)")
    samples.add_argument("--rtol", type=float, default=1e-4, help="largest relative difference accepted")
    samples.set_defaults(run=_check_samples)
    describe = commands.add_parser("describe", help="print the architecture, sizes and parameter count")
    describe.add_argument("--weights", required=True, help="export: .safetensors or a sharded export's .index.json")
    describe.set_defaults(run=_describe)
    args = parser.parse_args(argv)
    try:
        with torch.no_grad():
            return args.run(args)
    except ExportMismatch as e:
        print(f"mismatch: {e}", file=sys.stderr)
        return 1
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
