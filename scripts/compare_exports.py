#!/usr/bin/env python3
"""Compares exported weights: the first file against each other one, tensor by tensor.

    scripts/compare_exports.py [--max-abs X] REFERENCE.safetensors OTHER.safetensors [...]

For each OTHER prints the largest absolute difference, the tensor it is in, and the largest
relative difference (||a - b|| / ||b|| per tensor). Exit status 1 when a file is missing,
the names or shapes differ, or (with --max-abs) a difference is above X (0: bitwise equal). Used by scripts/gpu-session.sh (CUDA vs CPU, resumed vs
uninterrupted); needs only torch (python/tessera_models.py reads the files).
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from tessera_models import read_safetensors, relative_difference  # noqa: E402


def main(argv):
    max_abs = None
    if len(argv) > 2 and argv[1] == "--max-abs":
        try:
            max_abs = float(argv[2])
        except ValueError:
            print(f"--max-abs: '{argv[2]}' is not a number", file=sys.stderr)
            return 2
        argv = argv[:1] + argv[3:]
    if len(argv) < 3:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    if not os.path.exists(argv[1]):
        print(f"{argv[1]}: missing (the reference)")
        return 1
    reference = read_safetensors(argv[1])
    status = 0
    for path in argv[2:]:
        if not os.path.exists(path):
            print(f"{path}: missing")
            status = 1
            continue
        other = read_safetensors(path)
        if sorted(other) != sorted(reference) or any(other[k].shape != reference[k].shape for k in reference):
            print(f"{path}: names or shapes differ from {argv[1]}")
            status = 1
            continue
        worst, where, relative = 0.0, "", 0.0
        for name, ref in reference.items():
            diff = (other[name].double() - ref.double()).abs().max().item() if ref.numel() else 0.0
            if diff >= worst:
                worst, where = diff, name
            relative = max(relative, relative_difference(other[name], ref))
        print(f"{path} vs {argv[1]}: max abs difference {worst:.3g} (in {where}), max relative {relative:.3g}, "
              f"{len(reference)} tensors")
        if max_abs is not None and worst > max_abs:
            print(f"{path}: differs by more than --max-abs {max_abs:g}")
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv))
