#!/usr/bin/env python3
"""SHA-256 digests of a run's tensors, independent of how they were sharded: one over the
tensors of each export (export/*.safetensors: name, dtype, shape and bytes, in name order)
and one over every tensor of a checkpoint (the rows of each tensor put together from the
ranks' chunks, whatever world size or strategy wrote them). Two runs of run.deterministic
(configs/README.md) agree on every digest; compare them with diff.

    scripts/run_digest.py RUN_DIR [--step N]    (default: the newest checkpoint)
"""

import argparse
import hashlib
import json
import os
import struct
import sys

DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def export_digest(path):
    """(digest, tensor count) of one safetensors file's tensors."""
    total = os.path.getsize(path)
    if total < 8:
        raise ValueError(f"{path}: {total} bytes, shorter than a safetensors header's length")
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        if size > min(total - 8, 100 << 20):
            raise ValueError(f"{path}: a header of {size} bytes in a file of {total}: not a safetensors file")
        header = json.loads(f.read(size))
        h = hashlib.sha256()
        names = sorted(k for k in header if k != "__metadata__")
        for name in names:
            t = header[name]
            begin, end = t["data_offsets"]
            if not 0 <= begin <= end <= total - 8 - size:
                raise ValueError(f"{path}: tensor {name!r} lies outside the file")
            h.update(f"{name} {t['dtype']} {t['shape']}\n".encode())
            f.seek(8 + size + begin)
            h.update(f.read(end - begin))
    return h.hexdigest(), len(names)


def checkpoint_digest(step_dir):
    """(digest, tensor count) of every tensor of one checkpoint step directory."""
    with open(os.path.join(step_dir, "metadata.json")) as f:
        metadata = json.load(f)
    h = hashlib.sha256()
    tensors = sorted(metadata["tensors"], key=lambda t: t["name"])
    for t in tensors:
        shape = t["shape"]
        row_bytes = DTYPE_BYTES[t["dtype"]]
        for d in shape[1:]:
            row_bytes *= d
        h.update(f"{t['name']} {t['dtype']} {shape}\n".encode())
        chunks = sorted(t["chunks"], key=lambda c: c["rows"][0])
        if t["placement"] != "shard0" or not shape:
            chunks = chunks[:1]  # replicated: every copy is the same
        for c in chunks:
            if os.path.basename(c["file"]) != c["file"]:
                raise ValueError(f"{step_dir}/metadata.json: a chunk of {t['name']!r} names {c['file']!r}")
            rows = c["rows"][1] - c["rows"][0] if shape and t["placement"] == "shard0" else None
            length = rows * row_bytes if rows is not None else c["length"]
            with open(os.path.join(step_dir, c["file"]), "rb") as f:
                f.seek(c["offset"])
                chunk = f.read(length)
            if len(chunk) != length:
                raise ValueError(f"{step_dir}/{c['file']}: {t['name']!r} ends past the file")
            h.update(chunk)
    return h.hexdigest(), len(tensors)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir")
    parser.add_argument("--step", type=int, default=None)
    args = parser.parse_args()
    exports = os.path.join(args.run_dir, "export")
    checkpoints = os.path.join(args.run_dir, "checkpoints")
    if not os.path.isdir(exports) and not os.path.isdir(checkpoints):
        sys.exit(f"run_digest: {args.run_dir} has neither export/ nor checkpoints/")
    if os.path.isdir(exports):
        for name in sorted(os.listdir(exports)):
            if name.endswith(".safetensors"):
                digest, count = export_digest(os.path.join(exports, name))
                print(f"export/{name}: {count} tensors, sha256 {digest}")
    if os.path.isdir(checkpoints):
        steps = sorted(d for d in os.listdir(checkpoints) if d.startswith("step_") and
                       os.path.isfile(os.path.join(checkpoints, d, "metadata.json")))
        if args.step is not None:
            steps = [d for d in steps if d == f"step_{args.step:08d}"]
        if not steps:
            sys.exit(f"run_digest: no complete checkpoint{'' if args.step is None else f' of step {args.step}'} "
                     f"in {checkpoints}")
        digest, count = checkpoint_digest(os.path.join(checkpoints, steps[-1]))
        print(f"checkpoints/{steps[-1]}: {count} tensors, sha256 {digest}")


if __name__ == "__main__":
    try:
        main()
    except (OSError, ValueError, KeyError, TypeError, IndexError, MemoryError, struct.error) as e:
        # A damaged or foreign file: say which and why, exit 1 (no traceback).
        sys.exit(f"run_digest: cannot read {getattr(e, 'filename', None) or 'a file'} of the run: "
                 f"{type(e).__name__}: {e}")
