#!/usr/bin/env python3
"""The LibTorch operators two traced runs execute per step, side by side (issue 73: where a
step's fixed cost goes when the products are the same on both sides).

Each trace is a Chrome-trace JSON with "step N" spans and category "aten" events, as written
by tessera-train with `--set profile.aten_ops=true` (<run.dir>/profile/trace.json; rank 0's
events are read) and by `bench_train_throughput_bench --plain-only --json --trace FILE`.
Per operator name: calls per step (every call, nested ones included) and the time per step
of its outermost calls (a call inside another operator on the same thread is the outer one's
time). Sorted by the difference in time; the totals at the end.

    bench/aten_ops.py A_TRACE B_TRACE [--names A B] [--top 25]
"""

import argparse
import json
from collections import defaultdict


def per_step(path):
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    tracks = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "thread_name" and e.get("pid", 0) == 0:
            tracks[e["tid"]] = e["args"]["name"]
    spans = [e for e in events if e.get("ph") == "X" and e.get("pid", 0) == 0]
    steps = [e for e in spans if e["name"].startswith("step ") and e["cat"] == "step"]
    if not steps:
        raise SystemExit(f"{path}: no 'step N' spans on rank 0 (was it traced with the operators on?)")
    ops = sorted((e for e in spans if e["cat"] == "aten"), key=lambda e: (e["tid"], e["ts"], -e["dur"]))
    if not ops:
        raise SystemExit(f"{path}: no aten events (tessera-train: --set profile.aten_ops=true)")
    calls, outer_us = defaultdict(int), defaultdict(float)
    by_track = defaultdict(float)
    open_until = {}  # tid -> end of the outermost operator open on that thread
    for e in ops:
        calls[e["name"]] += 1
        if e["ts"] >= open_until.get(e["tid"], -1.0):
            outer_us[e["name"]] += e["dur"]
            by_track[tracks.get(e["tid"], str(e["tid"]))] += e["dur"]
            open_until[e["tid"]] = e["ts"] + e["dur"]
    n = len(steps)
    step_us = sum(e["dur"] for e in steps) / n
    return ({k: v / n for k, v in calls.items()}, {k: v / n for k, v in outer_us.items()},
            {k: v / n for k, v in by_track.items()}, step_us, n)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--names", nargs=2, default=["A", "B"])
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    (ca, ta, ka, sa, na), (cb, tb, kb, sb, nb) = per_step(args.a), per_step(args.b)
    an, bn = args.names
    print(f"{an}: {args.a} ({na} steps, traced step {sa:.0f} us); {bn}: {args.b} ({nb} steps, traced step {sb:.0f} us)")
    print(f"\n{'operator':<44} {an + ' calls':>10} {bn + ' calls':>10} {an + ' us':>9} {bn + ' us':>9} {'diff us':>9}")
    names = sorted(set(ca) | set(cb), key=lambda k: -abs(ta.get(k, 0) - tb.get(k, 0)))
    for k in names[:args.top]:
        print(f"{k[:44]:<44} {ca.get(k, 0):>10.1f} {cb.get(k, 0):>10.1f} {ta.get(k, 0):>9.1f} {tb.get(k, 0):>9.1f} "
              f"{ta.get(k, 0) - tb.get(k, 0):>+9.1f}")
    print(f"{'all operators':<44} {sum(ca.values()):>10.1f} {sum(cb.values()):>10.1f} {sum(ta.values()):>9.1f} "
          f"{sum(tb.values()):>9.1f} {sum(ta.values()) - sum(tb.values()):>+9.1f}")
    print("\noutermost operator time per step by thread:")
    for t in sorted(set(ka) | set(kb)):
        print(f"  {t:<40} {an} {ka.get(t, 0):>9.1f} us   {bn} {kb.get(t, 0):>9.1f} us")


if __name__ == "__main__":
    main()
