#!/usr/bin/python3
"""Writes the toy tensor datasets the shipped configs use (standard library only).

data/rings.safetensors: 4096 points in the plane on three noisy concentric rings
(radii 0.5, 1.0, 1.5; Gaussian noise 0.05), `inputs` float32 [4096, 2] and `targets`
int64 [4096] (the ring of each point). configs/diffusion.yaml trains the diffusion
generator on the points; the ring ids make it a classification set too.

Deterministic: the same bytes on every run (seeded random.Random), so the committed file
can be checked against this script (tests/datasets/tensor_dataset_test.cpp does).
Usage: scripts/make_toy_data.py [OUTPUT_DIR]   (default: data/ next to this script's parent)
"""
import json
import math
import os
import random
import struct
import sys

RADII = (0.5, 1.0, 1.5)
NOISE = 0.05
POINTS = 4096
SEED = 20261123


def write_safetensors(path, tensors):
    """tensors: name -> (dtype string, shape list, raw little-endian bytes)."""
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        dtype, shape, raw = tensors[name]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # pad so the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in blobs:
            f.write(raw)


def rings():
    rng = random.Random(SEED)
    points, labels = [], []
    for _ in range(POINTS):
        ring = rng.randrange(len(RADII))
        angle = rng.uniform(0.0, 2.0 * math.pi)
        r = RADII[ring]
        points += [r * math.cos(angle) + rng.gauss(0.0, NOISE), r * math.sin(angle) + rng.gauss(0.0, NOISE)]
        labels.append(ring)
    return {
        "inputs": ("F32", [POINTS, 2], struct.pack("<%df" % len(points), *points)),
        "targets": ("I64", [POINTS], struct.pack("<%dq" % len(labels), *labels)),
    }


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(root, "data")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "rings.safetensors")
    write_safetensors(path, rings())
    print(path)


if __name__ == "__main__":
    main()
