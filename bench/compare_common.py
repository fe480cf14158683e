"""What every bench/compare_*.py shares (issue 73): the machine and commit a table row is
measured on, the two sides of a comparison run as separate processes in alternation (ABBA:
round r in one order when r is even, the other when odd), at least 5 rounds of at least 10
timed steps, the median of each side with its range, the ratio with the range of the
per-round ratios, and the rows in docs/benchmarks.md's headline format.

A side is a command and how its output says the step time; every side gets a fresh
temporary directory ({tmp} in its command) and its own environment.
"""

import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def machine():
    """The CPU (model, family, model number, the flags that matter), cores, torch, commit."""
    info = {}
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            key, value = key.strip(), value.strip()
            if key in ("model name", "cpu family", "model", "stepping", "cpu MHz", "flags") and key not in info:
                info[key] = value
    flags = [f for f in info.get("flags", "").split() if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16",
                                                                "avx_vnni", "avx512_vp2intersect")]
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], stdout=subprocess.PIPE,
                            text=True, check=False).stdout.strip()
    dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                           stdout=subprocess.PIPE, text=True, check=False).stdout.strip()
    with open("/proc/loadavg") as f:
        load = float(f.read().split()[0])
    return {
        "date": datetime.datetime.utcnow().strftime("%Y-%m-%d"),
        "commit": commit + ("-dirty" if dirty else ""),
        "cpu": f"{info.get('model name', '?')} (family {info.get('cpu family', '?')} model {info.get('model', '?')})",
        "flags": " ".join(flags),
        "cores": os.cpu_count(),
        "load_at_start": load,
    }


class Side:
    """One side of a comparison: `command` (a list; "{tmp}" replaced by a fresh directory),
    `env`, and `parse(output, tmp) -> seconds per step` (the mean of the timed steps), or
    (seconds, {figure: value}) with more figures of the round (MFU, waits)."""

    def __init__(self, name, command, env, parse, settings):
        self.name, self.command, self.env, self.parse, self.settings = name, command, env, parse, settings
        self.times = []
        self.extras = []

    def run_once(self, timeout):
        tmp = tempfile.mkdtemp(prefix="tessera_compare_")
        try:
            command = [part.replace("{tmp}", tmp) for part in self.command]
            result = subprocess.run(command, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    timeout=timeout, check=False)
            if result.returncode != 0:
                sys.exit(f"{self.name}: {' '.join(command)} exited {result.returncode}:\n{result.stdout[-4000:]}")
            parsed = self.parse(result.stdout, tmp)
            seconds, extras = parsed if isinstance(parsed, tuple) else (parsed, {})
            self.times.append(seconds)
            self.extras.append(extras)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def alternate(sides, rounds, timeout=1800):
    """Runs every side `rounds` times, in ABBA order, printing each round."""
    if rounds < 5:
        sys.exit("compare: at least 5 rounds")
    for r in range(rounds):
        order = sides if r % 2 == 0 else list(reversed(sides))
        for side in order:
            side.run_once(timeout)
        print(f"round {r + 1}: " + ", ".join(f"{s.name} {s.times[-1] * 1e3:.2f} ms" for s in sides), flush=True)


def summary(side):
    """(median, min, max) seconds per step."""
    return statistics.median(side.times), min(side.times), max(side.times)


def ratio(tessera, baseline):
    """median(tessera) / median(baseline) and the range of the per-round ratios."""
    per_round = [t / b for t, b in zip(tessera.times, baseline.times)]
    return summary(tessera)[0] / summary(baseline)[0], min(per_round), max(per_round)


def row(comparison, tessera, baseline, command, where, per_step_label="ms"):
    """A headline-table row: Tessera / baseline < 1 means Tessera is faster."""
    tm, tlo, thi = summary(tessera)
    bm, blo, bhi = summary(baseline)
    r, rlo, rhi = ratio(tessera, baseline)
    return (f"| {comparison} | {tm * 1e3:.2f} [{tlo * 1e3:.2f}, {thi * 1e3:.2f}] | {bm * 1e3:.2f} [{blo * 1e3:.2f}, "
            f"{bhi * 1e3:.2f}] | **{r:.3f}x** [{rlo:.3f}, {rhi:.3f}] | `{command}` | {where['date']}, {where['commit']} |")


def header():
    return ("| comparison | Tessera step, ms: median [min, max] | baseline step, ms: median [min, max] | "
            "Tessera / baseline [per-round range] | command | date, commit |\n|---|---|---|---|---|---|")


def dump(path, where, sides):
    if not path:
        return
    with open(path, "w") as f:
        json.dump({"machine": where, "sides": {s.name: {"times_s": s.times, "extras": s.extras, "settings": s.settings}
                                               for s in sides}}, f, indent=1)


def median_extra(side, key):
    """The median over rounds of figure `key` (None when no round has it)."""
    values = [e[key] for e in side.extras if key in e]
    return statistics.median(values) if values else None


def dit_quick_train(args, sets, config=os.path.join(ROOT, "configs", "dit_quick.yaml")):
    """tessera-train on the main job's DiT (configs/dit_quick.yaml, or `config`) for a timed
    comparison: args.warmup + args.steps steps, one metrics window of args.warmup, no
    evaluation, checkpoints or exports, args.strategy, the run in {tmp}/run; `sets` (--set
    ...) on top."""
    return [os.path.join(args.build, "bin", "tessera-train"), "--config", config,
            "--set", "run.dir={tmp}/run", "--set", f"run.steps={args.warmup + args.steps}",
            "--set", f"run.log_every={args.warmup}", "--set", "run.eval_every=0",
            "--set", "checkpoint.every_steps=0", "--set", "checkpoint.at_end=false", "--set", "checkpoint.export=[]",
            "--set", "optim.schedule.warmup_steps=10", "--set", f"sharding.strategy={args.strategy}",
            "--set", "log.per_rank_files=false"] + sets


def tessera_step(metrics_dir_key="run.dir"):
    """A parser for tessera-train: the mean step time of the windows after the first
    (metrics.jsonl's step_time_ms, each window elapsed / steps), with the windows' MFU and
    waits, and the MiB each rank sent a step (comm_mib over the window's steps)."""

    def parse(output, tmp):
        with open(os.path.join(tmp, "run", "metrics.jsonl")) as f:
            windows = [json.loads(line) for line in f if line.strip()]
        pairs = [(p, w) for p, w in zip(windows, windows[1:]) if "step_time_ms" in w]
        steady = [w for _, w in pairs]
        if not steady:
            sys.exit(f"compare: no steady windows in {tmp}/run/metrics.jsonl:\n{output[-2000:]}")
        extras = {key: statistics.mean(w[key] for w in steady)
                  for key in ("mfu", "mfu_datasheet", "data_wait_ms", "comm_wait_ms", "tflops_per_rank")
                  if all(key in w for w in steady)}
        if all("comm_mib" in w for w in steady):
            extras["comm_mib_per_step"] = statistics.mean(w["comm_mib"] / (w["step"] - p["step"]) for p, w in pairs)
        return sum(w["step_time_ms"] for w in steady) / len(steady) / 1e3, extras

    return parse


def json_line(key="step_s_mean", marker='"framework"'):
    """A parser for a side that prints one JSON line holding `key` (seconds per step)."""

    def parse(output, tmp):
        for line in output.splitlines():
            if marker in line:
                return json.loads(line[line.index("{"):])[key]
        sys.exit(f"compare: no result line:\n{output[-4000:]}")

    return parse
