#!/usr/bin/env python3
"""Where a step's peak of GPU memory comes from, read off a Chrome trace with memory events.

The traces of bench_step_bench --trace and bench/fsdp2_step.py --trace record every
allocation and free of the CUDA caching allocator ("[memory]" events, with the total
allocated after each). This prints the peak of that total, the host op running at that
moment, and the blocks alive at the peak that were allocated inside the trace, grouped
by the ops that allocated them. Given a second trace, it prints instead the blocks alive
at one peak and not the other (by size and allocating op): what one step holds that the
other does not.

    scripts/trace_memory.py tessera_dit.json
    scripts/trace_memory.py tessera_dit.json fsdp2_dit.json
"""
import argparse
import collections
import json
import sys


def load(path):
    try:
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        sys.exit(f"trace_memory.py: {path}: not a Chrome trace ({type(e).__name__}: {e})")
    ops = collections.defaultdict(list)  # tid -> host ops
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation", "python_function"):
            ops[e["tid"]].append(e)
    memory = sorted((e for e in events if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type") == 1),
                    key=lambda e: e["ts"])
    if not memory:
        sys.exit(f"trace_memory.py: {path}: no GPU memory events (trace with profile_memory on a GPU)")
    return ops, memory


def stack_at(ops, tid, ts, depth=3):
    """The innermost `depth` host ops open on thread `tid` at `ts`, outermost first."""
    open_ops = sorted((o for o in ops.get(tid, ()) if o["ts"] <= ts <= o["ts"] + o.get("dur", 0)),
                      key=lambda o: -o.get("dur", 0))
    return " > ".join(o["name"][:60] for o in open_ops[-depth:]) or "(outside any op)"


def peak_state(path):
    ops, memory = load(path)
    live, peak, at_peak, peak_event = {}, -1, {}, None
    for e in memory:
        a = e["args"]
        if a["Bytes"] > 0:
            live[a["Addr"]] = (a["Bytes"], e["ts"], e["tid"])
        else:
            live.pop(a["Addr"], None)
        if a["Total Allocated"] > peak:
            peak, at_peak, peak_event = a["Total Allocated"], dict(live), e
    by_origin = collections.Counter()
    for size, ts, tid in at_peak.values():
        by_origin[(size, stack_at(ops, tid, ts))] += 1
    return peak, stack_at(ops, peak_event["tid"], peak_event["ts"], depth=4), by_origin


def mib(b):
    return b / 2 ** 20


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("other", nargs="?", help="a second trace: print what is alive at one peak and not the other")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    peak, where, origins = peak_state(args.trace)
    print(f"{args.trace}: peak {peak / 2 ** 30:.3f} GiB allocated, during {where}")
    if not args.other:
        totals = collections.Counter()
        for (size, origin), count in origins.items():
            totals[origin] += size * count
        print(f"  allocated inside the trace and alive at the peak: {mib(sum(totals.values())):.1f} MiB")
        for origin, total in totals.most_common(args.top):
            print(f"  {mib(total):9.1f} MiB  {origin}")
        return
    other_peak, other_where, other_origins = peak_state(args.other)
    print(f"{args.other}: peak {other_peak / 2 ** 30:.3f} GiB allocated, during {other_where}")
    print(f"difference {mib(peak - other_peak):+.1f} MiB; blocks alive at one peak and not the other "
          "(+: only in the first):")
    rows = []
    for key in set(origins) | set(other_origins):
        diff = origins[key] - other_origins[key]
        if diff:
            rows.append((key[0] * diff, key))
    rows.sort(key=lambda r: -abs(r[0]))
    for total, (size, origin) in rows[:args.top]:
        print(f"  {mib(total):+9.2f} MiB  ({size} B blocks)  {origin}")


if __name__ == "__main__":
    main()
