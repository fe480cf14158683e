#!/usr/bin/env python3
"""Draws the GPU streams of a Chrome trace (PyTorch's profiler / Kineto, as written by
bench_step_bench --trace and bench/fsdp2_step.py --trace) as an SVG timeline and measures
how much of the communication streams' busy time overlaps compute.

    scripts/trace_timeline.py TRACE.json[.gz] OUT.svg [--title TEXT] [--last-ms MS]

Each GPU stream is one row; kernels and copies are boxes (NCCL kernels and copies on the
non-compute streams in orange, compute in blue). The compute stream is the one with the
most busy time; every other stream counts as communication. Printed: each stream's busy
time, and the overlap = the part of the communication streams' busy time during which
the compute stream was busy too. --last-ms draws only the trace's last MS milliseconds
(one step of a multi-step trace). Needs only the standard library.

A Tessera trace (<run.dir>/profile/trace.json, the trainer's `profile:` keys) is drawn
by rank and track instead: each thread and each communicator's collectives is a row,
nested spans (a unit's forward inside the micro-batch's) on lanes below their parent;
compute blue, collectives orange, waits red, the optimizer green, data grey. Printed: the
collectives' busy time on each rank, and how much of it overlaps the main thread's compute.
"""
import argparse
import gzip
import html
import json
import sys

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def load_events(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    out = []
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in GPU_CATEGORIES:
            continue
        stream = (e.get("args") or {}).get("stream", e.get("tid"))
        out.append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), stream, e.get("name", ""), e["cat"]))
    return out


def merged(intervals):
    """Union of [start, end) intervals, sorted and merged."""
    out = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out


def total(intervals):
    return sum(end - start for start, end in intervals)


def intersection(a, b):
    """Total length of the intersection of two merged interval lists."""
    i = j = 0
    length = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            length += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return length


TESSERA_COLORS = {"compute": "#3a6fb0", "comm": "#e8871e", "wait": "#c0392b", "optimizer": "#2e8b57",
                  "ema": "#8e44ad", "data": "#888888", "checkpoint": "#a0522d", "log": "#f1c40f", "step": "#dddddd"}


def tessera_main(trace, args):
    """Draws a Tessera trace: one row per (rank, track), spans on nesting lanes."""
    tracks = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            tracks[(e["pid"], e["tid"])] = e["args"]["name"]
    spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["pid"], tracks[(e["pid"], e["tid"])], e["name"],
              e["cat"]) for e in trace["traceEvents"] if e.get("ph") == "X"]
    if not spans:
        print(f"{args.trace}: no spans", file=sys.stderr)
        return 1
    end = max(s[1] for s in spans)
    if args.last_ms > 0:
        spans = [s for s in spans if s[1] >= end - args.last_ms * 1e3]
    begin = min(s[0] for s in spans)
    span = end - begin
    for rank in sorted({s[2] for s in spans}):
        compute = merged([(s[0], s[1]) for s in spans if s[2] == rank and s[3] == "main" and s[5] == "compute"])
        comm = merged([(s[0], s[1]) for s in spans if s[2] == rank and s[5] == "comm"])
        if total(comm) > 0:
            print(f"rank {rank}: collectives busy {total(comm) / 1e3:.2f} ms, of which {intersection(comm, compute) / 1e3:.2f}"
                  f" ms ({100 * intersection(comm, compute) / total(comm):.0f}%) overlap the main thread's compute")
    rows = sorted({(s[2], s[3]) for s in spans}, key=lambda r: (r[0], r[1] != "main", r[1]))
    lanes = {}  # the nesting depth of each span on its row
    for row in rows:
        stack = []
        for s in sorted((s for s in spans if (s[2], s[3]) == row), key=lambda s: (s[0], -s[1])):
            while stack and stack[-1] <= s[0]:
                stack.pop()
            lanes[s] = len(stack)
            stack.append(s[1])
    depth = {row: 1 + max(lanes[s] for s in spans if (s[2], s[3]) == row) for row in rows}
    lane, width, left, top = 14, 1400, 230, 40
    height = top + sum(depth[r] * lane + 8 for r in rows) + 40
    scale = (width - left - 20) / max(span, 1e-9)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'font-family="sans-serif" font-size="11">',
             f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<text x="10" y="20" font-size="14">{html.escape(args.title or args.trace)} — {span / 1e3:.1f} ms shown</text>']
    y = top
    for row in rows:
        parts.append(f'<text x="10" y="{y + 11}">rank {row[0]}: {html.escape(row[1][:30])}</text>')
        for s in spans:
            if (s[2], s[3]) != row:
                continue
            x = left + (s[0] - begin) * scale
            w = max((s[1] - s[0]) * scale, 0.5)
            color = TESSERA_COLORS.get(s[5], "#999999")
            parts.append(f'<rect x="{x:.2f}" y="{y + lanes[s] * lane}" width="{w:.2f}" height="{lane - 2}" '
                         f'fill="{color}"><title>{html.escape(s[4])} ({(s[1] - s[0]):.0f} us)</title></rect>')
            if w > 7 * len(s[4]):
                parts.append(f'<text x="{x + 2:.1f}" y="{y + lanes[s] * lane + 10}" fill="white">{html.escape(s[4])}</text>')
        y += depth[row] * lane + 8
        parts.append(f'<line x1="{left}" y1="{y - 4}" x2="{width - 20}" y2="{y - 4}" stroke="#eee"/>')
    for tick in range(6):
        t = span * tick / 5
        parts.append(f'<text x="{left + t * scale:.1f}" y="{y + 15}" text-anchor="middle">{t / 1e3:.1f} ms</text>')
    legend = "  ".join(f"{k}" for k in TESSERA_COLORS)
    x = left
    for name, color in TESSERA_COLORS.items():
        parts.append(f'<rect x="{x}" y="{y + 24}" width="10" height="10" fill="{color}"/>'
                     f'<text x="{x + 14}" y="{y + 33}">{name}</text>')
        x += 90
    parts.append("</svg>")
    with open(args.svg, "w") as f:
        f.write("\n".join(parts))
    print(f"timeline: {args.svg}")
    return 0


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("svg")
    ap.add_argument("--title", default="")
    ap.add_argument("--last-ms", type=float, default=0.0)
    args = ap.parse_args(argv)
    opener = gzip.open if args.trace.endswith(".gz") else open
    with opener(args.trace, "rt") as f:
        trace = json.load(f)
    if isinstance(trace, dict) and any(e.get("cat") == "compute" for e in trace.get("traceEvents", [])):
        return tessera_main(trace, args)
    events = load_events(args.trace)
    if not events:
        print(f"{args.trace}: no GPU events (kernel, gpu_memcpy, gpu_memset)", file=sys.stderr)
        return 1
    end = max(e[1] for e in events)
    if args.last_ms > 0:
        events = [e for e in events if e[1] >= end - args.last_ms * 1e3]
    begin = min(e[0] for e in events)
    streams = {}
    for e in events:
        streams.setdefault(e[2], []).append(e)
    busy = {s: merged([(e[0], e[1]) for e in evs]) for s, evs in streams.items()}
    compute = max(busy, key=lambda s: total(busy[s]))
    comm = merged([iv for s, ivs in busy.items() if s != compute for iv in ivs])
    comm_total, overlap = total(comm), intersection(comm, busy[compute])
    span = end - begin
    print(f"{args.trace}: {len(events)} GPU events over {span / 1e3:.2f} ms; compute stream {compute} busy "
          f"{total(busy[compute]) / 1e3:.2f} ms ({100 * total(busy[compute]) / span:.0f}%)")
    for s in sorted(busy, key=str):
        if s != compute:
            print(f"  stream {s}: busy {total(busy[s]) / 1e3:.3f} ms in {len(streams[s])} events "
                  f"(e.g. {streams[s][0][3][:60]})")
    if comm_total > 0:
        print(f"communication streams busy {comm_total / 1e3:.3f} ms, of which {overlap / 1e3:.3f} ms "
              f"({100 * overlap / comm_total:.0f}%) overlap compute")

    # The picture: one row per stream, compute first.
    order = [compute] + sorted((s for s in streams if s != compute), key=str)
    width, row, left, top = 1200, 34, 150, 40
    height = top + row * len(order) + 40
    scale = (width - left - 20) / max(span, 1e-9)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'font-family="sans-serif" font-size="12">',
             f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<text x="10" y="20" font-size="14">{html.escape(args.title or args.trace)} — {span / 1e3:.1f} ms shown</text>']
    for k, s in enumerate(order):
        y = top + k * row
        label = f"compute (stream {s})" if s == compute else f"stream {s}"
        parts.append(f'<text x="10" y="{y + row / 2 + 4}">{label}</text>')
        parts.append(f'<line x1="{left}" y1="{y + row - 4}" x2="{width - 20}" y2="{y + row - 4}" stroke="#ddd"/>')
        for start, stop, _, name, cat in streams[s]:
            x = left + (start - begin) * scale
            w = max((stop - start) * scale, 0.5)
            nccl = "nccl" in name.lower() or (s != compute and cat != "kernel")
            color = "#e8871e" if s != compute or nccl else "#3a6fb0"
            parts.append(f'<rect x="{x:.2f}" y="{y + 4}" width="{w:.2f}" height="{row - 12}" fill="{color}">'
                         f'<title>{html.escape(name[:120])} ({(stop - start):.0f} us)</title></rect>')
    axis_y = top + row * len(order) + 15
    for tick in range(6):
        t = span * tick / 5
        x = left + t * scale
        parts.append(f'<text x="{x:.1f}" y="{axis_y}" text-anchor="middle">{t / 1e3:.1f} ms</text>')
    if comm_total > 0:
        parts.append(f'<text x="{left}" y="{axis_y + 18}">communication busy {comm_total / 1e3:.2f} ms, '
                     f'{100 * overlap / comm_total:.0f}% of it overlapping compute</text>')
    parts.append("</svg>")
    with open(args.svg, "w") as f:
        f.write("\n".join(parts))
    print(f"timeline: {args.svg}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
