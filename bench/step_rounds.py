#!/usr/bin/env python3
"""The rounds of scripts/gpu-session.sh's step stage, summarised (issue 77).

The stage runs the plain LibTorch loop, Tessera's zero3 (bench_step_bench --only ...) and
PyTorch FSDP2 (bench/fsdp2_step.py) in separate processes, alternated, several rounds per
model; each model's runs follow a line `== model NAME`. Each process prints one
`step: VARIANT MS ms (... peak G GiB = M MiB)` line (bench_step_bench also a
`round N: VARIANT ... forward+backward F ms, update U ms` line). This prints, per model and
variant, the rounds, the median step time and its range, the median forward+backward,
the peak memory, and each variant's median against the plain loop's and FSDP2's:

    python3 bench/step_rounds.py gpu-out/step.txt
"""
import os
import re
import stat
import statistics
import sys

STEP = re.compile(r"^step: (.+?) ([0-9.]+) ms \(.*peak [0-9.]+ GiB = ([0-9.]+) MiB\)")
PHASES = re.compile(r"^round \d+: (.+?) [0-9.]+ ms .*forward\+backward ([0-9.]+) ms")
MODEL = re.compile(r"^== model (\S+)")


def parse(lines):
    """{model: {variant: {"ms": [...], "mib": [...], "fb": [...]}}} in the order met."""
    runs, model = {}, "?"
    for line in lines:
        m = MODEL.match(line)
        if m:
            model = m.group(1)
            continue
        m = PHASES.match(line)
        if m:
            runs.setdefault(model, {}).setdefault(m.group(1), {"ms": [], "mib": [], "fb": []})["fb"].append(
                float(m.group(2)))
            continue
        m = STEP.match(line)
        if m:
            v = runs.setdefault(model, {}).setdefault(m.group(1), {"ms": [], "mib": [], "fb": []})
            v["ms"].append(float(m.group(2)))
            v["mib"].append(float(m.group(3)))
    return runs


def summary(runs):
    out = []
    for model, variants in runs.items():
        out.append(f"{model}:")
        med = {name: statistics.median(v["ms"]) for name, v in variants.items() if v["ms"]}
        plain = next((med[n] for n in med if n.startswith("plain")), None)
        fsdp2 = next((med[n] for n in med if "FSDP2" in n), None)
        for name, v in variants.items():
            if not v["ms"]:
                continue
            line = (f"  {name}: {len(v['ms'])} rounds, median {med[name]:.2f} ms "
                    f"[{min(v['ms']):.2f}, {max(v['ms']):.2f}], peak {statistics.median(v['mib']):.1f} MiB")
            if v["fb"]:
                line += f", forward+backward {statistics.median(v['fb']):.2f} ms"
            if plain and not name.startswith("plain"):
                line += f"; {med[name] / plain:.3f}x plain"
            if fsdp2 and "FSDP2" not in name:
                line += f", {med[name] / fsdp2:.3f}x FSDP2"
            out.append(line)
    return "\n".join(out)


def main(argv):
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    try:
        # A regular file only: opening a FIFO would wait for a writer.
        if not stat.S_ISREG(os.stat(argv[1]).st_mode):
            print(f"step_rounds: {argv[1]} is not a regular file", file=sys.stderr)
            return 1
        with open(argv[1], encoding="utf-8", errors="replace") as f:
            runs = parse(f.read().splitlines())
    except OSError as e:
        print(f"step_rounds: cannot read {argv[1]}: {e.strerror}", file=sys.stderr)
        return 1
    if not runs:
        print(f"step_rounds: no 'step:' lines in {argv[1]}", file=sys.stderr)
        return 1
    print(summary(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
