#!/usr/bin/env python3
"""Tests of tessera_models.py, Tessera's built-in models in plain PyTorch.

Part 1 needs torch only: the DiT against the reference's (facebookresearch/DiT)
parameter list, position embedding and zero initialisation; the other models' Tessera
names; the safetensors reader and writer; strict export loading; the DDIM timesteps,
guidance and samplers; the command line on exports written here.

Part 2 runs when TESSERA_BIN_DIR names the folder of Tessera's programs (tessera-train,
tessera-model-probe, tessera-sample): run_end_to_end() trains every built-in model for a
few steps, and checks the export's forward pass and DDIM samples against Tessera's.

    python3 python/test_tessera_models.py
    TESSERA_BIN_DIR=build/bin python3 python/test_tessera_models.py
"""

import contextlib
import io
import json
import math
import os
import shlex
import struct
import subprocess
import sys
import tempfile
import unittest

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tessera_models as tm  # noqa: E402  (after the path is set)

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tessera_models.py")

# The model section's defaults (trainer/train_config.h), which metadata always carries.
MODEL_DEFAULTS = {
    "arch": "mlp", "vocab_size": 256, "context": 16, "embed_dim": 32, "hidden": [256, 256], "activation": "gelu",
    "layers": 2, "heads": 4, "tie_head": False, "timesteps": 1000, "beta_start": 1.0e-4, "beta_end": 0.02,
    "patch_size": 4, "mlp_ratio": 4.0, "classes": 0, "class_dropout": 0.1, "sample_timesteps": [],
}


def metadata_of(data, **model):
    """A tessera.model object: the model defaults overridden by `model`, and `data`."""
    return dict(MODEL_DEFAULTS, **model, data=data)


def write_export(path, state, metadata):
    tm.save_safetensors(path, state, {tm.METADATA_KEY: json.dumps(metadata)})


def run_main(argv):
    """tessera_models.main(argv): (exit status, stdout + stderr)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        status = tm.main(argv)
    return status, out.getvalue()


def randomize(model, seed):
    """Every parameter N(0, 0.1): a model whose output depends on all of them (DiT's
    zero-initialised layers included)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


# ---------------------------------------------------------------------------------------
# Part 1: no Tessera programs needed
# ---------------------------------------------------------------------------------------

DIT_SMALL = dict(input_size=28, patch_size=4, in_channels=1, hidden_size=64, depth=2, num_heads=4, num_classes=10)


class DiTReferenceTest(unittest.TestCase):
    def test_parameter_names_and_shapes_are_the_references(self):
        expected = {
            "x_embedder.proj.weight": [64, 1, 4, 4], "x_embedder.proj.bias": [64], "pos_embed": [1, 49, 64],
            "t_embedder.mlp.0.weight": [64, 256], "t_embedder.mlp.0.bias": [64],
            "t_embedder.mlp.2.weight": [64, 64], "t_embedder.mlp.2.bias": [64],
            "y_embedder.embedding_table.weight": [11, 64],
            "final_layer.linear.weight": [16, 64], "final_layer.linear.bias": [16],
            "final_layer.adaLN_modulation.1.weight": [128, 64], "final_layer.adaLN_modulation.1.bias": [128],
        }
        for i in range(2):
            expected.update({
                f"blocks.{i}.attn.qkv.weight": [192, 64], f"blocks.{i}.attn.qkv.bias": [192],
                f"blocks.{i}.attn.proj.weight": [64, 64], f"blocks.{i}.attn.proj.bias": [64],
                f"blocks.{i}.mlp.fc1.weight": [256, 64], f"blocks.{i}.mlp.fc1.bias": [256],
                f"blocks.{i}.mlp.fc2.weight": [64, 256], f"blocks.{i}.mlp.fc2.bias": [64],
                f"blocks.{i}.adaLN_modulation.1.weight": [384, 64], f"blocks.{i}.adaLN_modulation.1.bias": [384],
            })
        model = tm.DiT(**DIT_SMALL)
        self.assertEqual({name: list(t.shape) for name, t in model.state_dict().items()}, expected)
        self.assertFalse(model.pos_embed.requires_grad)

    def test_pos_embed_is_the_2d_sincos_embedding(self):
        model = tm.DiT(**DIT_SMALL)
        grid, dim = 7, 64
        quarter = dim // 4
        omega = [1.0 / 10000.0 ** (k / quarter) for k in range(quarter)]
        pos = model.pos_embed[0]
        for i in range(grid):          # patch row
            for j in range(grid):      # patch column
                m = i * grid + j
                expected = ([math.sin(j * w) for w in omega] + [math.cos(j * w) for w in omega]
                            + [math.sin(i * w) for w in omega] + [math.cos(i * w) for w in omega])
                for k in range(dim):
                    self.assertAlmostEqual(pos[m, k].item(), expected[k], delta=1e-6, msg=f"token {m}, feature {k}")

    def test_timestep_embedding_is_cos_then_sin_of_256_frequencies(self):
        t = torch.tensor([0, 3, 999])
        emb = tm.TimestepEmbedder.timestep_embedding(t, 256)
        self.assertEqual(list(emb.shape), [3, 256])
        for row, step in enumerate([0, 3, 999]):
            for k in (0, 1, 64, 127):
                freq = math.exp(-math.log(10000.0) * k / 128)
                self.assertAlmostEqual(emb[row, k].item(), math.cos(step * freq), delta=1e-4)
                self.assertAlmostEqual(emb[row, 128 + k].item(), math.sin(step * freq), delta=1e-4)

    def test_initialisation_is_adaln_zero(self):
        torch.manual_seed(0)
        model = tm.DiT(**DIT_SMALL)
        zero = ["x_embedder.proj.bias", "final_layer.linear.weight", "final_layer.linear.bias",
                "final_layer.adaLN_modulation.1.weight", "final_layer.adaLN_modulation.1.bias",
                "t_embedder.mlp.0.bias", "blocks.0.attn.qkv.bias"]
        zero += [f"blocks.{i}.adaLN_modulation.1.{p}" for i in range(2) for p in ("weight", "bias")]
        state = model.state_dict()
        for name in zero:
            self.assertTrue(torch.equal(state[name], torch.zeros_like(state[name])), name)
        self.assertLess(abs(state["y_embedder.embedding_table.weight"].std().item() - 0.02), 0.005)

    def test_zero_initialised_output_predicts_exactly_zero(self):
        torch.manual_seed(0)
        model = tm.DiT(**DIT_SMALL).eval()
        x = torch.randn(3, 1, 28, 28)
        out = model(x, torch.tensor([0, 500, 999]), torch.tensor([0, 9, 10]))
        self.assertEqual(out.shape, x.shape)
        self.assertTrue(torch.equal(out, torch.zeros_like(out)))

    def test_unpatchify_inverts_the_patch_order(self):
        # A final layer that copies each patch's pixels back: the identity on images.
        model = tm.DiT(input_size=8, patch_size=2, in_channels=3, hidden_size=16, depth=1, num_heads=2,
                       num_classes=2)
        x = torch.randn(2, 3, 8, 8)
        patches = x.reshape(2, 3, 4, 2, 4, 2).permute(0, 2, 4, 3, 5, 1).reshape(2, 16, 12)  # (p, q, c) order
        self.assertTrue(torch.equal(model.unpatchify(patches), x))

    def test_patch_overlap_blends_neighbouring_windows(self):
        # The figures of Tessera's DiTTest.PatchOverlapBlendsNeighbouringWindows: patch 4,
        # overlap 1 on 8x8, windows of 6 rows weighted [0.25, 0.75, 1, 1, 0.75, 0.25], each
        # window predicting its own row index: rows 1, 2, 3, 3, 2, 2, 3, 4.
        model = tm.DiT(input_size=8, patch_size=4, in_channels=2, hidden_size=16, depth=1, num_heads=2,
                       num_classes=3, patch_overlap=1)
        self.assertEqual(set(model.state_dict()), set(tm.DiT(input_size=8, patch_size=4, in_channels=2,
                                                             hidden_size=16, depth=1, num_heads=2,
                                                             num_classes=3).state_dict()))
        self.assertEqual(list(model.final_layer.linear.weight.shape), [6 * 6 * 2, 16])
        windows = torch.arange(6.0).view(6, 1, 1).expand(6, 6, 2).reshape(1, 1, -1).expand(2, 4, -1)
        rows = torch.tensor([1.0, 2, 3, 3, 2, 2, 3, 4]).view(1, 1, 8, 1).expand(2, 2, 8, 8)
        self.assertTrue(torch.allclose(model.unpatchify(windows), rows, atol=1e-6))
        self.assertTrue(torch.allclose(model.unpatchify(torch.full((2, 4, 72), 0.5)), torch.full((2, 2, 8, 8), 0.5)))
        with self.assertRaises(ValueError):
            tm.DiT(input_size=8, patch_size=4, in_channels=2, hidden_size=16, depth=1, num_heads=2, patch_overlap=3)


def multihead_attention(qkv, proj, heads, causal):
    """torch.nn.MultiheadAttention with the weights of a fused qkv and proj Linear."""
    dim = proj.weight.shape[0]
    mha = nn.MultiheadAttention(dim, heads, batch_first=True)
    with torch.no_grad():
        mha.in_proj_weight.copy_(qkv.weight)
        mha.in_proj_bias.copy_(qkv.bias)
        mha.out_proj.weight.copy_(proj.weight)
        mha.out_proj.bias.copy_(proj.bias)

    def attend(x):
        mask = torch.ones(x.size(1), x.size(1), dtype=torch.bool).triu(1) if causal else None
        return mha(x, x, x, attn_mask=mask, need_weights=False)[0]
    return attend


class AttentionTest(unittest.TestCase):
    """The attention of DiT and Gpt against torch.nn.MultiheadAttention."""

    def test_dit_attention(self):
        attn = randomize(tm.Attention(16, 4), 2)
        x = torch.randn(3, 5, 16)
        expected = multihead_attention(attn.qkv, attn.proj, 4, causal=False)(x)
        self.assertTrue(torch.allclose(attn(x), expected, atol=1e-6))

    def test_gpt_block(self):
        block = randomize(tm.GptBlock(16, 2), 3)
        x = torch.randn(2, 6, 16)
        h = x + multihead_attention(block.attn.c_attn, block.attn.c_proj, 2, causal=True)(block.ln_1(x))
        expected = h + block.mlp.c_proj(torch.nn.functional.gelu(block.mlp.c_fc(block.ln_2(h))))
        self.assertTrue(torch.allclose(block(x), expected, atol=1e-5))


class TesseraNamesTest(unittest.TestCase):
    """The names of models/models.cpp and models/diffusion.cpp."""

    def names(self, model):
        return {name: list(t.shape) for name, t in model.state_dict().items()}

    def test_context_mlp(self):
        self.assertEqual(self.names(tm.ContextMlp(256, 4, 8, [16, 12])), {
            "embed.weight": [256, 8], "layers.0.weight": [16, 32], "layers.0.bias": [16],
            "layers.1.weight": [12, 16], "layers.1.bias": [12], "head.weight": [256, 12], "head.bias": [256]})

    def test_feature_mlp_features_are_the_heads_input(self):
        model = tm.FeatureMlp(6, [16], "relu", 3)
        self.assertEqual(self.names(model), {"layers.0.weight": [16, 6], "layers.0.bias": [16],
                                             "head.weight": [3, 16], "head.bias": [3]})
        x = torch.randn(5, 2, 3)
        self.assertTrue(torch.allclose(model(x), model.head(model.features(x))))
        self.assertGreaterEqual(model.features(x).min().item(), 0.0)  # after relu

    def test_gpt_names_and_causality(self):
        model = tm.Gpt(50, 8, 16, 1, 2, tie_head=False)
        self.assertEqual(self.names(model), {
            "wte.weight": [50, 16], "wpe.weight": [8, 16], "h.0.ln_1.weight": [16], "h.0.ln_1.bias": [16],
            "h.0.attn.c_attn.weight": [48, 16], "h.0.attn.c_attn.bias": [48],
            "h.0.attn.c_proj.weight": [16, 16], "h.0.attn.c_proj.bias": [16],
            "h.0.ln_2.weight": [16], "h.0.ln_2.bias": [16], "h.0.mlp.c_fc.weight": [64, 16],
            "h.0.mlp.c_fc.bias": [64], "h.0.mlp.c_proj.weight": [16, 64], "h.0.mlp.c_proj.bias": [16],
            "ln_f.weight": [16], "ln_f.bias": [16], "lm_head.weight": [50, 16]})
        self.assertNotIn("lm_head.weight", self.names(tm.Gpt(50, 8, 16, 1, 2, tie_head=True)))
        tokens = torch.randint(50, (2, 8))
        changed = tokens.clone()
        changed[:, 5] = (changed[:, 5] + 1) % 50
        a, b = model(tokens), model(changed)
        self.assertTrue(torch.equal(a[:, :5], b[:, :5]))
        self.assertFalse(torch.equal(a[:, 5:], b[:, 5:]))

    def test_diffusion_denoiser(self):
        model = tm.DiffusionDenoiser([2], 8, 1)
        self.assertEqual(self.names(model), {
            "time_embed.0.weight": [8, 8], "time_embed.0.bias": [8], "time_embed.2.weight": [8, 8],
            "time_embed.2.bias": [8], "input_proj.weight": [8, 2], "input_proj.bias": [8],
            "blocks.0.norm.weight": [8], "blocks.0.norm.bias": [8], "blocks.0.time_proj.weight": [8, 8],
            "blocks.0.time_proj.bias": [8], "blocks.0.fc1.weight": [32, 8], "blocks.0.fc1.bias": [32],
            "blocks.0.fc2.weight": [8, 32], "blocks.0.fc2.bias": [8], "out_norm.weight": [8], "out_norm.bias": [8],
            "output_proj.weight": [2, 8], "output_proj.bias": [2]})
        x, t = torch.randn(4, 2), torch.tensor([0, 1, 2, 3])
        self.assertTrue(torch.equal(model(x, t), model(x, t, torch.tensor([5, 6, 7, 8]))))  # y ignored


class SafetensorsTest(unittest.TestCase):
    def test_round_trip_with_metadata(self):
        tensors = {
            "f32": torch.randn(3, 4), "i64": torch.tensor([1, -2, 3]), "u8": torch.arange(7, dtype=torch.uint8),
            "bf16": torch.randn(5).to(torch.bfloat16), "flag": torch.tensor([True, False]),
            "empty": torch.empty(0, 3), "scalar": torch.tensor(2.5, dtype=torch.float64),
        }
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "t.safetensors")
            tm.save_safetensors(path, tensors, {"text": "hello", "object": {"a": [1, 2]}})
            back, metadata = tm.read_safetensors(path, with_metadata=True)
        self.assertEqual(metadata, {"text": "hello", "object": '{"a": [1, 2]}'})
        self.assertEqual(list(back), list(tensors))
        for name, t in tensors.items():
            self.assertEqual(back[name].dtype, t.dtype, name)
            self.assertTrue(torch.equal(back[name], t), name)

    def test_damaged_files_are_export_errors(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "bad.safetensors")
            too_long = json.dumps({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
            for content in (b"", struct.pack("<Q", 10 ** 6) + b"{}", struct.pack("<Q", 4) + b"nope",
                            struct.pack("<Q", len(too_long)) + too_long + bytes(8)):
                with open(path, "wb") as f:
                    f.write(content)
                with self.assertRaises(tm.ExportError):
                    tm.read_safetensors(path)
            with self.assertRaises(tm.ExportError):
                tm.read_safetensors(os.path.join(d, "absent.safetensors"))


class LoadExportTest(unittest.TestCase):
    DATA = {"tokens": False, "input_shape": [1, 8, 8], "classes": 3, "target_shape": []}

    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.addCleanup(self.dir.cleanup)
        self.metadata = metadata_of(self.DATA, arch="dit", embed_dim=16, layers=1, heads=2, patch_size=4, classes=3)
        self.model = randomize(tm.build_model(self.metadata), 1)

    def path(self, name):
        return os.path.join(self.dir.name, name)

    def test_loads_what_was_saved(self):
        write_export(self.path("e.safetensors"), self.model.state_dict(), self.metadata)
        model, metadata = tm.load_export(self.path("e.safetensors"))
        self.assertIsInstance(model, tm.DiT)
        self.assertFalse(model.training)
        self.assertEqual(metadata, self.metadata)
        for name, t in self.model.state_dict().items():
            self.assertTrue(torch.equal(model.state_dict()[name], t), name)

    def test_sharded_export(self):
        state = self.model.state_dict()
        names = list(state)
        files = {"e-00001-of-00002.safetensors": names[:5], "e-00002-of-00002.safetensors": names[5:]}
        for file_name, part in files.items():
            write_export(self.path(file_name), {n: state[n] for n in part}, self.metadata)
        index = {"metadata": {"total_size": 0}, "weight_map": {n: f for f, part in files.items() for n in part}}
        with open(self.path("e.safetensors.index.json"), "w") as f:
            json.dump(index, f)
        model, _ = tm.load_export(self.path("e.safetensors.index.json"))
        self.assertTrue(torch.equal(model.pos_embed, self.model.pos_embed))
        index["weight_map"][names[0]] = "e-00002-of-00002.safetensors"  # a map that lies
        with open(self.path("e.safetensors.index.json"), "w") as f:
            json.dump(index, f)
        with self.assertRaisesRegex(tm.ExportError, "does not hold it"):
            tm.load_export(self.path("e.safetensors.index.json"))

    def test_missing_tensor_is_a_mismatch(self):
        state = self.model.state_dict()
        del state["blocks.0.attn.qkv.bias"]
        write_export(self.path("e.safetensors"), state, self.metadata)
        with self.assertRaisesRegex(tm.ExportMismatch, r"missing 'blocks\.0\.attn\.qkv\.bias'"):
            tm.load_export(self.path("e.safetensors"))

    def test_extra_tensor_is_a_mismatch(self):
        state = dict(self.model.state_dict(), **{"blocks.0.attn.q_norm.weight": torch.ones(8)})
        write_export(self.path("e.safetensors"), state, self.metadata)
        with self.assertRaisesRegex(tm.ExportMismatch, r"unexpected 'blocks\.0\.attn\.q_norm\.weight'"):
            tm.load_export(self.path("e.safetensors"))

    def test_wrong_shape_is_a_mismatch(self):
        state = self.model.state_dict()
        state["y_embedder.embedding_table.weight"] = torch.zeros(3, 16)  # no "no class" row
        write_export(self.path("e.safetensors"), state, self.metadata)
        with self.assertRaisesRegex(tm.ExportMismatch, r"'y_embedder\.embedding_table\.weight' is \[3, 16\]"):
            tm.load_export(self.path("e.safetensors"))

    def test_file_without_metadata_is_an_export_error(self):
        tm.save_safetensors(self.path("e.safetensors"), self.model.state_dict())
        with self.assertRaisesRegex(tm.ExportError, "tessera.model"):
            tm.load_export(self.path("e.safetensors"))

    def test_incomplete_or_impossible_metadata_is_an_export_error(self):
        metadata = dict(self.metadata)
        del metadata["heads"]
        with self.assertRaisesRegex(tm.ExportError, "'heads' is missing"):
            tm.build_model(metadata)
        with self.assertRaisesRegex(tm.ExportError, "divisible"):
            tm.build_model(dict(self.metadata, heads=3))
        with self.assertRaisesRegex(tm.ExportError, "beta_start"):
            tm.build_model(dict(self.metadata, beta_start=0.5))
        with self.assertRaisesRegex(tm.ExportError, "unknown arch"):
            tm.build_model(dict(self.metadata, arch="unet"))

    def test_crafted_sizes_are_refused_before_anything_is_built(self):
        # Each would allocate gigabytes to petabytes, divide by zero or loop if believed.
        data = dict(self.DATA)
        for change, message in (({"embed_dim": 1 << 30}, "'embed_dim' is 1073741824, outside"),
                                ({"layers": 1000000}, "'layers' is 1000000, outside"),
                                ({"layers": 65536}, "says layers 65536, but the file holds only"),
                                ({"embed_dim": 4096, "heads": 2}, "a width 4096, wider than any tensor"),
                                ({"heads": 0}, "'heads' is 0, outside"),
                                ({"mlp_ratio": -1.0}, "'mlp_ratio' is -1.0, outside"),
                                ({"data": dict(data, input_shape=[1, 1 << 20, 1 << 20])}, "not a sample size"),
                                ({"data": dict(data, input_shape=[1, 4096, 4096]), "patch_size": 1},
                                 "patches of width 16, more values than the file holds")):
            with self.subTest(change=change):
                write_export(self.path("e.safetensors"), self.model.state_dict(), dict(self.metadata, **change))
                with self.assertRaisesRegex(tm.ExportError, message):
                    tm.load_export(self.path("e.safetensors"))


class CountingModel(nn.Module):
    """A conditional "denoiser" over 3 classes predicting its label everywhere; records the
    labels of every call."""
    num_classes = 3

    def __init__(self):
        super().__init__()
        self.calls = []

    def forward(self, x, t, y):
        self.calls.append(y.clone())
        return y.float().view(-1, *[1] * (x.dim() - 1)).expand_as(x)


class SamplerTest(unittest.TestCase):
    def test_ddim_timesteps(self):
        ts = tm.ddim_timesteps(1000, 50)
        self.assertEqual((len(ts), ts[0], ts[-1]), (50, 999, 0))
        self.assertTrue(all(a > b for a, b in zip(ts, ts[1:])))
        self.assertEqual(tm.ddim_timesteps(1000, 5), [999, 749, 500, 250, 0])  # 499.5 -> 500, 249.75 -> 250
        self.assertEqual(tm.ddim_timesteps(1000, 1), [999])
        self.assertEqual(tm.ddim_timesteps(3, 3), [2, 1, 0])
        self.assertEqual(tm.ddim_timesteps(8, 3), [7, 4, 0])  # 3.5 -> 4 (even)
        self.assertEqual(tm.ddim_timesteps(6, 3), [5, 2, 0])  # 2.5 -> 2 (even)
        with self.assertRaises(ValueError):
            tm.ddim_timesteps(10, 11)

    def test_noise_schedule(self):
        s = tm.NoiseSchedule(1000, 1e-4, 0.02)
        self.assertEqual((s.betas[0], s.betas[-1]), (1e-4, 0.02))
        self.assertAlmostEqual(s.alpha_bars[1], (1 - 1e-4) * (1 - s.betas[1]), places=15)
        self.assertEqual(tm.NoiseSchedule(1, 0.01, 0.02).betas, [0.01])

    def test_cosine_and_zero_terminal_snr_schedules(self):
        # cosine: abar_t = f(t + 1) / f(0) wherever no beta is capped (Nichol & Dhariwal).
        f = lambda u: math.cos((u / 1000 + 0.008) / 1.008 * math.pi / 2) ** 2  # noqa: E731
        cosine = tm.NoiseSchedule(1000, 1e-4, 0.02, "cosine", prediction="v")
        for t in (0, 10, 500, 900):
            self.assertAlmostEqual(cosine.alpha_bars[t], f(t + 1) / f(0), places=12)
        self.assertEqual(cosine.betas[-1], 0.999)  # the last beta is capped
        self.assertTrue(all(b <= 0.999 for b in cosine.betas))
        # zero terminal SNR: sqrt(abar) an affine map of the original's, first kept, last 0.
        for kind in ("linear", "cosine"):
            base = tm.NoiseSchedule(1000, 1e-4, 0.02, kind, prediction="v")
            z = tm.NoiseSchedule(1000, 1e-4, 0.02, kind, zero_terminal_snr=True, prediction="v")
            self.assertEqual((z.alpha_bars[-1], z.betas[-1]), (0.0, 1.0))
            self.assertAlmostEqual(z.alpha_bars[0], base.alpha_bars[0], places=15)
            first, last = math.sqrt(base.alpha_bars[0]), math.sqrt(base.alpha_bars[-1])
            for t in (1, 400, 998):
                expected = (math.sqrt(base.alpha_bars[t]) - last) / (first - last) * first
                self.assertAlmostEqual(math.sqrt(z.alpha_bars[t]), expected, places=12)
                product = math.prod(1 - b for b in z.betas[:t + 1])
                self.assertAlmostEqual(z.alpha_bars[t], product, places=12)
        for bad in (dict(zero_terminal_snr=True), dict(prediction="x0"), dict(noise_schedule="sigmoid"),
                    dict(noise_schedule="cosine")):
            with self.assertRaises(ValueError, msg=str(bad)):
                tm.NoiseSchedule(1000, 1e-4, 0.02, **bad)

    def test_velocity_estimates_invert_the_forward_process(self):
        g = torch.Generator().manual_seed(4)
        x0, eps = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
        z = tm.NoiseSchedule(100, 1e-4, 0.02, "cosine", zero_terminal_snr=True, prediction="v")
        for t in (0, 50, 99):  # 99: abar = 0, pure noise
            a, b = math.sqrt(z.alpha_bars[t]), math.sqrt(1 - z.alpha_bars[t])
            x, v = a * x0 + b * eps, a * eps - b * x0
            self.assertTrue(torch.allclose(z.clean_estimate(x, v, t), x0, atol=1e-5), t)
            self.assertTrue(torch.allclose(z.noise_estimate(x, v, t), eps, atol=1e-5), t)

    def test_exports_without_the_schedule_keys_are_linear_noise_predictors(self):
        old = tm.noise_schedule(metadata_of({}))
        self.assertEqual((old.prediction, old.alpha_bars), ("eps", tm.NoiseSchedule(1000, 1e-4, 0.02).alpha_bars))
        new = tm.noise_schedule(metadata_of({}, noise_schedule="cosine", zero_terminal_snr=True, prediction="v"))
        self.assertEqual((new.prediction, new.alpha_bars[-1]), ("v", 0.0))
        with self.assertRaisesRegex(tm.ExportError, "zero_terminal_snr"):
            tm.noise_schedule(metadata_of({}, zero_terminal_snr=True))
        with self.assertRaisesRegex(tm.ExportError, "prediction"):
            tm.noise_schedule(metadata_of({}, prediction=1))

    def test_ddim_and_ddpm_from_pure_noise_with_a_velocity_oracle(self):
        # Gaussian data N(m, s^2): the exact E[x0 | x_t] gives the exact velocity; both samplers
        # start at abar = 0 and draw the data's distribution.
        z = tm.NoiseSchedule(200, 1e-4, 0.05, "linear", zero_terminal_snr=True, prediction="v")
        m, sd = 0.5, 0.3

        class Oracle(nn.Module):
            def forward(self, x, t, y):
                abar = torch.tensor([z.alpha_bars[i] for i in t.tolist()], dtype=torch.float64).view(-1, 1)
                x = x.double()
                x0 = m + sd * sd * abar.sqrt() * (x - abar.sqrt() * m) / (abar * sd * sd + 1 - abar)
                eps = torch.where(abar < 1, (x - abar.sqrt() * x0) / (1 - abar).clamp_min(1e-30).sqrt(), x)
                return (abar.sqrt() * eps - (1 - abar).sqrt() * x0).float()

        noise = torch.randn(4000, 1, generator=torch.Generator().manual_seed(7))
        for name, out in (("ddim", tm.sample_ddim(Oracle(), z, noise, None, 100, 1.0)),
                          ("ddpm", tm.sample_ddpm(Oracle(), z, noise, generator=torch.Generator().manual_seed(8)))):
            self.assertTrue(torch.isfinite(out).all(), name)
            self.assertAlmostEqual(out.mean().item(), m, delta=0.03, msg=name)
            self.assertAlmostEqual(out.std().item(), sd, delta=0.03, msg=name)

    def test_ddim_with_an_oracle_returns_x0(self):
        schedule = tm.NoiseSchedule(1000, 1e-4, 0.02)
        x0 = torch.randn(4, 2, 3, generator=torch.Generator().manual_seed(3))

        class Oracle(nn.Module):
            def forward(self, x, t, y):
                abar = torch.tensor([schedule.alpha_bars[i] for i in t.tolist()], dtype=torch.float64)
                abar = abar.view(-1, 1, 1)
                return ((x.double() - abar.sqrt() * x0.double()) / (1 - abar).sqrt()).float()

        for steps in (2, 10, 50):
            out = tm.sample_ddim(Oracle(), schedule, torch.randn(4, 2, 3), None, steps, 1.0)
            self.assertLess((out - x0).abs().max().item(), 1e-5, f"{steps} steps")

    def test_ddim_at_given_timesteps(self):
        schedule = tm.NoiseSchedule(1000, 1e-4, 0.02)
        noise = torch.randn(3, 2, generator=torch.Generator().manual_seed(5))
        model = CountingModel()
        evenly = tm.sample_ddim(model, schedule, noise, None, 5, 1.0)
        given = tm.sample_ddim(model, schedule, noise, None, 5, 1.0, timesteps=tm.ddim_timesteps(1000, 5))
        self.assertTrue(torch.equal(evenly, given))
        model = CountingModel()
        tm.sample_ddim(model, schedule, noise, None, 50, 1.0, timesteps=[999, 749, 499, 249])
        self.assertEqual(len(model.calls), 4)  # the given timesteps, not --steps
        for bad in ([], [500, 500], [249, 499], [1000], [-1]):
            with self.assertRaises(ValueError, msg=str(bad)):
                tm.sample_ddim(model, schedule, noise, None, 5, 1.0, timesteps=bad)
        self.assertEqual(tm.sample_timesteps(metadata_of({}, sample_timesteps=[999, 499])), [999, 499])
        self.assertIsNone(tm.sample_timesteps(metadata_of({}, sample_timesteps=[])))
        self.assertIsNone(tm.sample_timesteps(metadata_of({})))
        with self.assertRaises(tm.ExportError):
            tm.sample_timesteps(metadata_of({}, sample_timesteps="999"))

    def test_guidance_calls_the_model_once_or_twice_per_step(self):
        schedule = tm.NoiseSchedule(100, 1e-4, 0.02)
        labels = torch.tensor([0, 2, 3])
        for cfg, calls in ((1.0, 4), (2.0, 8)):
            model = CountingModel()
            tm.sample_ddim(model, schedule, torch.randn(3, 2), labels, 4, cfg)
            self.assertEqual(len(model.calls), calls, f"cfg {cfg}")
            for i, y in enumerate(model.calls):
                expected = labels if cfg == 1.0 or i % 2 == 0 else torch.full((3,), 3)
                self.assertTrue(torch.equal(y, expected), f"cfg {cfg}, call {i}: {y}")

    def test_guidance_formula(self):
        labels = torch.tensor([0, 1, 2])
        eps = tm.guided_noise(CountingModel(), torch.zeros(3, 2), torch.zeros(3, dtype=torch.int64), labels, 2.0)
        # eps_u = 3 ("no class"), eps_c = label: 3 + 2 (label - 3).
        self.assertTrue(torch.equal(eps, (2 * labels - 3).float().view(3, 1).expand(3, 2)))

    def test_absent_labels_mean_no_class(self):
        model = CountingModel()
        tm.sample_ddim(model, tm.NoiseSchedule(10, 1e-4, 0.02), torch.randn(2, 2), None, 2, 1.0)
        self.assertTrue(all(torch.equal(y, torch.full((2,), 3)) for y in model.calls))

    def test_unconditional_denoiser_is_called_once_per_step_at_any_cfg(self):
        model = tm.DiffusionDenoiser([2], 8, 1)
        calls = []
        model.register_forward_hook(lambda module, inputs, output: calls.append(1))
        tm.sample_ddim(model, tm.NoiseSchedule(100, 1e-4, 0.02), torch.randn(3, 2), None, 5, 3.0)
        self.assertEqual(len(calls), 5)

    def test_ddpm(self):
        noise = torch.randn(3, 2)

        class Zero(nn.Module):
            def forward(self, x, t, y):
                return torch.zeros_like(x)

        one_step = tm.sample_ddpm(Zero(), tm.NoiseSchedule(1, 0.01, 0.01), noise)
        self.assertTrue(torch.equal(one_step, noise / math.sqrt(1 - 0.01)))
        schedule = tm.NoiseSchedule(10, 1e-3, 0.05)
        a = tm.sample_ddpm(Zero(), schedule, noise, generator=torch.Generator().manual_seed(5))
        b = tm.sample_ddpm(Zero(), schedule, noise, generator=torch.Generator().manual_seed(5))
        self.assertTrue(torch.equal(a, b))


class CommandLineTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.addCleanup(self.dir.cleanup)
        torch.manual_seed(0)

    def path(self, name):
        return os.path.join(self.dir.name, name)

    def export(self, metadata, seed=1):
        model = randomize(tm.build_model(metadata), seed).eval()
        write_export(self.path("model.safetensors"), model.state_dict(), metadata)
        return model

    def check_forward(self, probe):
        tm.save_safetensors(self.path("probe.safetensors"), probe)
        return run_main(["check-forward", "--weights", self.path("model.safetensors"),
                         "--probe", self.path("probe.safetensors")])

    def test_check_forward_feature_mlp(self):
        data = {"tokens": False, "input_shape": [6], "classes": 3, "target_shape": []}
        model = self.export(metadata_of(data, hidden=[8]))
        x = torch.randn(5, 6)
        with torch.no_grad():
            out, features = model(x), model.features(x)
        status, text = self.check_forward({"x": x, "out": out, "features_out": features})
        self.assertEqual(status, 0, text)
        self.assertEqual(len(text.strip().splitlines()), 2, text)
        status, text = self.check_forward({"x": x, "out": out, "features_out": features * 1.01})
        self.assertEqual(status, 1, text)
        self.assertIn("features_out", text)
        status, text = self.check_forward({"out": out})
        self.assertEqual(status, 2, text)

    def test_check_forward_gpt_and_dit(self):
        tokens = {"tokens": True, "input_shape": [8], "classes": 0, "target_shape": []}
        model = self.export(metadata_of(tokens, arch="gpt", vocab_size=20, context=8, embed_dim=8, layers=1, heads=2))
        t = torch.randint(20, (3, 8))
        with torch.no_grad():
            self.assertEqual(self.check_forward({"tokens": t, "out": model(t)})[0], 0)
        images = {"tokens": False, "input_shape": [2, 8, 8], "classes": 4, "target_shape": []}
        model = self.export(metadata_of(images, arch="dit", embed_dim=16, layers=1, heads=2, classes=4))
        x, steps, y = torch.randn(3, 2, 8, 8), torch.tensor([0, 10, 999]), torch.tensor([0, 3, 4])
        with torch.no_grad():
            out = model(x, steps, y)
        self.assertEqual(self.check_forward({"x": x, "t": steps, "y": y, "out": out})[0], 0)
        self.assertEqual(self.check_forward({"x": x, "t": steps, "y": y.flip(0), "out": out})[0], 1)
        self.assertEqual(self.check_forward({"x": x, "t": steps, "y": y, "out": out[:2]})[0], 1)  # shape

    def test_check_forward_refuses_an_export_that_does_not_fit(self):
        data = {"tokens": False, "input_shape": [6], "classes": 3, "target_shape": []}
        metadata = metadata_of(data, hidden=[8])
        state = tm.build_model(metadata).state_dict()
        del state["head.bias"]
        write_export(self.path("model.safetensors"), state, metadata)
        status, text = self.check_forward({"x": torch.randn(2, 6), "out": torch.zeros(2, 3)})
        self.assertEqual(status, 1, text)
        self.assertIn("head.bias", text)
        status, text = run_main(["check-forward", "--weights", self.path("absent.safetensors"),
                                 "--probe", self.path("probe.safetensors")])
        self.assertEqual(status, 2, text)

    def test_check_samples_and_describe(self):
        images = {"tokens": False, "input_shape": [1, 8, 8], "classes": 2, "target_shape": []}
        metadata = metadata_of(images, arch="dit", embed_dim=16, layers=1, heads=2, classes=2, timesteps=50)
        model = self.export(metadata)
        noise, labels = torch.randn(3, 1, 8, 8), torch.tensor([0, 1, 2])
        samples = tm.sample_ddim(model, tm.NoiseSchedule(50, 1e-4, 0.02), noise, labels, 5, 2.0)
        tm.save_safetensors(self.path("noise.safetensors"), {"noise": noise, "labels": labels})
        argv = ["check-samples", "--weights", self.path("model.safetensors"), "--noise", self.path("noise.safetensors"),
                "--samples", self.path("samples.safetensors"), "--steps", "5"]
        tm.save_safetensors(self.path("samples.safetensors"), {"samples": samples})
        self.assertEqual(run_main(argv + ["--cfg", "2"])[0], 0)
        self.assertEqual(run_main(argv + ["--cfg", "1"])[0], 1)
        tm.save_safetensors(self.path("noise.safetensors"), {"noise": noise, "labels": labels + 1})  # 3 > classes
        self.assertEqual(run_main(argv + ["--cfg", "2"])[0], 2)
        status, text = run_main(["describe", "--weights", self.path("model.safetensors")])
        self.assertEqual(status, 0, text)
        self.assertIn("arch: dit (DiT)", text)
        self.assertIn(f"parameters: {sum(t.numel() for t in model.state_dict().values())} ", text)


# ---------------------------------------------------------------------------------------
# Part 2: Tessera's programs (TESSERA_BIN_DIR)
# ---------------------------------------------------------------------------------------

def _yaml(config):
    """A config of sections of scalars and lists as YAML (values written as JSON, which
    YAML reads as the same scalars and flow lists)."""
    lines = []
    for section, keys in config.items():
        lines.append(f"{section}:")
        lines += [f"  {key}: {json.dumps(value)}" for key, value in keys.items()]
    return "\n".join(lines) + "\n"


def _run(cmd, cwd):
    """Runs cmd; its output. AssertionError with the command line and its output when it
    fails or cannot start."""
    try:
        done = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=900)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise AssertionError(f"$ {shlex.join(cmd)}\n{e}") from e
    if done.returncode != 0:
        raise AssertionError(f"$ {shlex.join(cmd)}\nexit status {done.returncode}\n{done.stdout}")
    return done.stdout


def _write_idx(images_path, labels_path, images, labels):
    """MNIST's IDX files: images [N, H, W] uint8 (magic 0x803), labels [N] uint8 (0x801),
    sizes big-endian."""
    n, h, w = images.shape
    with open(images_path, "wb") as f:
        f.write(struct.pack(">IIII", 0x00000803, n, h, w) + bytes(images.flatten().tolist()))
    with open(labels_path, "wb") as f:
        f.write(struct.pack(">II", 0x00000801, n) + bytes(labels.tolist()))


def _end_to_end_cases(work_dir):
    """(name, model section, data section, noise) for every built-in model, writing the
    data files they train on; noise: None, or the noise file's tensors (denoisers)."""
    g = torch.Generator().manual_seed(11)
    text = os.path.join(work_dir, "text.txt")
    with open(text, "w") as f:
        f.write("".join(f"line {i}: the quick brown fox jumps over the lazy dog {i * i % 97}\n" for i in range(80)))
    features = os.path.join(work_dir, "features.safetensors")
    tm.save_safetensors(features, {"inputs": torch.randn(64, 6, generator=g),
                                   "targets": torch.randint(3, (64,), generator=g)})
    points = os.path.join(work_dir, "points.safetensors")
    tm.save_safetensors(points, {"inputs": torch.randn(64, 2, generator=g)})
    images, labels = os.path.join(work_dir, "images.idx3"), os.path.join(work_dir, "labels.idx1")
    classes = torch.arange(40) % 4
    pixels = torch.randint(0, 64, (40, 16, 16), generator=g)
    for i, c in enumerate(classes.tolist()):  # class c: a bright quadrant
        pixels[i, (c // 2) * 8:(c // 2) * 8 + 8, (c % 2) * 8:(c % 2) * 8 + 8] += 160
    _write_idx(images, labels, pixels.to(torch.uint8), classes.to(torch.uint8))
    batch = {"global_batch": 8, "micro_batch": 8}
    return [
        ("mlp_text", {"arch": "mlp", "context": 8, "embed_dim": 8, "hidden": [16]},
         dict(kind="text", path=text, **batch), None),
        ("mlp_tensors", {"arch": "mlp", "hidden": [16]}, dict(kind="tensors", path=features, **batch), None),
        ("convnet", {"arch": "convnet", "hidden": [4, 8, 16]}, dict(kind="idx", path=images, labels=labels, **batch),
         None),
        ("gpt", {"arch": "gpt", "context": 8, "embed_dim": 16, "layers": 2, "heads": 2},
         dict(kind="text", path=text, **batch), None),
        ("diffusion", {"arch": "diffusion", "embed_dim": 16, "layers": 2, "timesteps": 50},
         dict(kind="tensors", path=points, **batch), {"noise": torch.randn(6, 2, generator=g)}),
        ("dit", {"arch": "dit", "patch_size": 4, "embed_dim": 32, "layers": 2, "heads": 4, "timesteps": 50},
         dict(kind="idx", path=images, labels=labels, **batch),
         {"noise": torch.randn(6, 1, 16, 16, generator=g), "labels": torch.tensor([0, 1, 2, 3, 4, 1])}),
        # A velocity predictor on a cosine schedule that ends in pure noise: the samplers start there.
        ("dit_v_zero_terminal_snr", {"arch": "dit", "patch_size": 2, "embed_dim": 32, "layers": 2, "heads": 4,
                                     "timesteps": 50, "noise_schedule": "cosine", "zero_terminal_snr": True,
                                     "prediction": "v", "final_conv": True},
         dict(kind="idx", path=images, labels=labels, **batch),
         {"noise": torch.randn(6, 1, 16, 16, generator=g), "labels": torch.tensor([0, 1, 2, 3, 4, 1])}),
        # A DMD critic's kind of export: a GAN head (gan_head.*) beside the denoiser, loaded strictly.
        ("diffusion_gan_head", {"arch": "diffusion", "embed_dim": 16, "layers": 2, "timesteps": 50,
                                "gan_head_block": 0},
         dict(kind="tensors", path=points, **batch), None),
        ("diffusion_v", {"arch": "diffusion", "embed_dim": 16, "layers": 2, "timesteps": 50, "prediction": "v",
                         "zero_terminal_snr": True},
         dict(kind="tensors", path=points, **batch), {"noise": torch.randn(6, 2, generator=g)}),
        # A few-step generator's export: both samplers take its own timesteps from the metadata;
        # its patches' output windows overlap (model.patch_overlap).
        ("dit_sample_timesteps", {"arch": "dit", "patch_size": 4, "embed_dim": 32, "layers": 2, "heads": 4,
                                  "timesteps": 50, "sample_timesteps": [49, 30, 11], "patch_overlap": 2},
         dict(kind="idx", path=images, labels=labels, **batch),
         {"noise": torch.randn(6, 1, 16, 16, generator=g), "labels": torch.tensor([0, 1, 2, 3, 4, 1])}),
    ]


def _end_to_end_one(bin_dir, case_dir, name, model, data, noise):
    """Trains one model for 4 steps in one process, then checks its export's forward pass
    (and for denoisers its DDIM samples, 5 steps at cfg 2) against Tessera's."""
    os.makedirs(case_dir, exist_ok=True)
    run_dir = os.path.join(case_dir, "run")
    config = os.path.join(case_dir, "config.yaml")
    with open(config, "w") as f:
        f.write(_yaml({
            "run": {"name": name, "dir": run_dir, "seed": 1, "steps": 4, "log_every": 1},
            "model": model,
            "data": data,
            "optim": {"lr": 1.0e-3},
            "checkpoint": {"async": False, "export": ["model"]},
        }))
    _run([os.path.join(bin_dir, "tessera-train"), "--config", config], case_dir)
    export = os.path.join(run_dir, "export", "model.safetensors")
    probe = os.path.join(case_dir, "probe.safetensors")
    _run([os.path.join(bin_dir, "tessera-model-probe"), "--weights", export, "--out", probe], case_dir)
    report = _run([sys.executable, SCRIPT, "check-forward", "--weights", export, "--probe", probe], case_dir)
    if noise is not None:
        noise_file = os.path.join(case_dir, "noise.safetensors")
        samples = os.path.join(case_dir, "samples.safetensors")
        tm.save_safetensors(noise_file, noise)
        steps = [] if "sample_timesteps" in model else ["--steps", "5"]  # the export's own timesteps
        _run([os.path.join(bin_dir, "tessera-sample"), "--weights", export, "--noise", noise_file, *steps,
              "--cfg", "2", "--sampler", "ddim", "--out-tensors", samples], case_dir)
        report += _run([sys.executable, SCRIPT, "check-samples", "--weights", export, "--noise", noise_file,
                        "--samples", samples, *steps, "--cfg", "2"], case_dir)
    return report


def run_end_to_end(bin_dir, work_dir):
    """Trains each built-in model (mlp on text and on tensors, gpt, diffusion, dit) with
    {bin_dir}/tessera-train and checks Tessera's forward pass (tessera-model-probe) and
    DDIM samples (tessera-sample) against tessera_models.py's. Runs every model whatever
    the others do; AssertionError listing each failure with its command and output."""
    bin_dir, work_dir = os.path.abspath(bin_dir), os.path.abspath(work_dir)
    failures = []
    cases = _end_to_end_cases(work_dir)
    for name, model, data, noise in cases:
        try:
            report = _end_to_end_one(bin_dir, os.path.join(work_dir, name), name, model, data, noise)
            print(f"end-to-end {name}: ok\n{report}", file=sys.stderr)
        except AssertionError as e:
            print(f"end-to-end {name}: FAILED", file=sys.stderr)
            failures.append(f"{name}:\n{e}")
    if failures:
        raise AssertionError(f"{len(failures)} of {len(cases)} models failed the end-to-end check:\n\n"
                             + "\n\n".join(failures))


class EndToEndTest(unittest.TestCase):
    def test_built_in_models_against_tessera(self):
        bin_dir = os.environ.get("TESSERA_BIN_DIR")
        if not bin_dir:
            self.skipTest("TESSERA_BIN_DIR is not set (the folder of tessera-train, tessera-model-probe, "
                          "tessera-sample)")
        with tempfile.TemporaryDirectory(prefix="tessera_e2e_") as work_dir:
            run_end_to_end(bin_dir, work_dir)


if __name__ == "__main__":
    unittest.main()
