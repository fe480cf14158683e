#!/usr/bin/env python3
"""A lost node: steps lost and seconds from the failure to the next step, with the node-local
checkpoint tier against the persistent tier alone (issue 48), in one invocation.

Starts NODES launchers of RANKS ranks each (tessera-run --nnodes 1:NODES, nodes as separate
launchers on this machine, as the elastic tests do) training configs/default.yaml with
persistent checkpoints every 100 steps, and for the local tier checkpoint.local.every_steps 5
with each node's own checkpoint.local.dir. Once rank 0's metrics reach --kill-at, the last
node's launcher and ranks are SIGKILLed and its local directory deleted (its memory is gone).
The survivors restart (last_call_timeout 2 s) and resume; the bench reports the step trained
when the node was lost, the step resumed from, their difference (steps lost), the seconds from
the kill to the resumed run's first step (from metrics.jsonl, written every step), and, for
the local tier, the promotion's log line.

    bench/node_loss_bench.py [--layouts 2x2 4x4] [--kill-at 33] [--build build]
    bench/node_loss_bench.py --overhead [--dit] [--layouts 2x2] [--steps 300]   # what local saves cost
    bench/node_loss_bench.py --survive [--layouts 2x2 4x4]   # fault.survive against the restart path
    bench/node_loss_bench.py --rejoin [--dit] [--reference] [--strategy no_shard|zero1|zero2] [--backend gloo] [--layouts 2x2]   # elastic, a rank
                                                                            # killed, rejoined
"""

import argparse
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def last_step(metrics):
    """The newest step in metrics.jsonl (0 when none)."""
    try:
        with open(metrics) as f:
            steps = [json.loads(line)["step"] for line in f if line.strip().endswith("}")]
        return steps[-1] if steps else 0
    except (OSError, ValueError, KeyError):
        return 0


def wait_for(predicate, seconds, what):
    deadline = time.time() + seconds
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    sys.exit(f"node_loss_bench: timed out waiting for {what}")


def train_command(build, nodes, ranks, steps, run_dir, sets, dit=False):
    """The trainer of every case: configs/default.yaml, hidden 48 (or the main job's DiT,
    configs/dit_quick.yaml, without its evaluations and sample grids), a checkpoint every 100
    steps, metrics every step, `sets` (--set ...) on top."""
    common = ["--set", f"run.steps={steps}", "--set", "checkpoint.every_steps=100", "--set", "run.log_every=1",
              "--set", "log.per_rank_files=false", "--set", f"run.dir={run_dir}"]
    if dit:
        return [os.path.join(build, "bin", "tessera-train"), "--config", os.path.join(ROOT, "configs", "dit_quick.yaml"),
                "--set", "eval.sample_every=0", "--set", "run.eval_every=0"] + common + sets
    # A global batch both world sizes divide (before and after the loss), at least 32;
    # micro-batches of at most 8, chosen by the trainer.
    before, after = nodes * ranks, (nodes - 1) * ranks
    batch = before * after // math.gcd(before, after)
    batch *= -(-32 // batch)
    return [os.path.join(build, "bin", "tessera-train"), "--config", os.path.join(ROOT, "configs", "default.yaml"),
            "--set", "model.hidden=[48]", "--set", f"data.global_batch={batch}", "--set", "data.micro_batch=8"] + \
        common + sets


def hybrid_sets(ranks):
    """Each node one replica group: what fault.survive needs, and the restart path's same run."""
    return ["--set", "sharding.strategy=hybrid", "--set", f"sharding.shard_size={ranks}"]


def kill_node(launcher):
    """The node's ranks and launcher at once, as a power loss would: each rank is in a process
    group of its own, and a launcher killed alone has them stop with a checkpoint."""
    children = []
    for task in os.listdir(f"/proc/{launcher.pid}/task"):
        with open(f"/proc/{launcher.pid}/task/{task}/children") as f:
            children += [int(c) for c in f.read().split()]
    for pid in children + [launcher.pid]:
        os.kill(pid, signal.SIGKILL)


def survive_case(build, nodes, ranks, kill_at, steps, dit=False):
    """fault.survive: static launchers (--nnodes N), each node a hybrid replica group; the last
    node lost as in run_case; the others go on in-process. Seconds from the kill to the end of
    the next step in metrics.jsonl (its rows carry `time`)."""
    work = tempfile.mkdtemp(prefix="tessera_node_loss_")
    port = free_port()
    run_dir = os.path.join(work, "run")
    metrics = os.path.join(run_dir, "metrics.jsonl")
    train = train_command(build, nodes, ranks, steps, run_dir,
                          hybrid_sets(ranks) + ["--set", "fault.survive=true", "--set", "run.backend=auto"], dit)
    launchers, logs = [], []
    for node in range(nodes):
        command = [os.path.join(build, "bin", "tessera-run"), "--nnodes", str(nodes), "--node-rank", str(node),
                   "--nproc-per-node", str(ranks), "--master-port", str(port)] + train
        log = open(os.path.join(work, f"node{node}.log"), "w")
        logs.append(log)
        launchers.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    def reached():
        if any(p.poll() is not None for p in launchers):
            with open(os.path.join(work, "node0.log")) as f:
                sys.exit("node_loss_bench: a launcher ended before the kill:\n" + f.read()[-3000:])
        return last_step(metrics) >= kill_at
    wait_for(reached, 600, f"step {kill_at}")
    kill_node(launchers[-1])
    killed_at = time.time()
    lost_step = last_step(metrics)  # after the kill: the node may have finished one more step
    launchers[0].wait(timeout=1800)
    with open(metrics) as f:
        after = [r for r in (json.loads(line) for line in f if line.strip().endswith("}")) if r["step"] > lost_step]
    with open(os.path.join(work, "node0.log")) as f:
        text = f.read()
    went_on = re.search(r"fault\.survive: ranks [^\n]* go on as a world of \d+ from step (\d+)", text)
    for p in launchers[1:]:
        p.wait()
    for log in logs:
        log.close()
    if not after or not went_on:
        sys.exit("node_loss_bench: the survivors did not go on:\n" + text[-3000:])
    shutil.rmtree(work, ignore_errors=True)
    return {"layout": f"{nodes}x{ranks}", "model": "DiT (dit_quick)" if dit else "MLP (default, hidden 48)",
            "tier": "fault.survive (no checkpoint read)", "node lost at step": lost_step,
            # metrics.jsonl lags the survivors by up to a step: the row of a step whose update
            # every rank made is written after its metrics' all-gather, which the loss interrupts.
            "resumed from step": int(went_on.group(1)), "steps lost": max(0, lost_step - int(went_on.group(1))),
            "seconds to the next step": round(after[0]["time"] - killed_at, 2),
            "launcher of node 0 exit status": launchers[0].returncode}


def log_time(line_match, near):
    """Unix seconds of a log line's [HH:MM:SS.mmm] (local time) on the day of `near`."""
    h, m, sec = int(line_match.group(1)), int(line_match.group(2)), float(line_match.group(3))
    t = time.localtime(near)
    midnight = near - (t.tm_hour * 3600 + t.tm_min * 60 + t.tm_sec + near % 1)
    return midnight + h * 3600 + m * 60 + sec


def rank_pids(launcher):
    children = []
    for task in os.listdir(f"/proc/{launcher.pid}/task"):
        with open(f"/proc/{launcher.pid}/task/{task}/children") as f:
            children += [int(c) for c in f.read().split()]
    return sorted(children)


def max_difference(a, b):
    """The largest |a - b| over the F32 tensors of two safetensors files."""
    from array import array

    def tensors(path):
        with open(path, "rb") as f:
            data = f.read()
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + n])
        out = {}
        for name, t in header.items():
            if name == "__metadata__":
                continue
            if t["dtype"] != "F32":
                sys.exit(f"node_loss_bench: {path}: {name} is {t['dtype']}, not F32")
            begin, end = t["data_offsets"]
            out[name] = array("f", data[8 + n + begin:8 + n + end])
        return out
    ta, tb = tensors(a), tensors(b)
    return max(max((abs(x - y) for x, y in zip(ta[k], tb[k])), default=0.0) for k in ta)


def rejoin_case(build, nodes, ranks, kill_at, steps, dit=False, reference=False, strategy="hybrid",
                deterministic=True, backend="auto", keep=False):
    """fault.survive in an elastic run (--nnodes N:N, --max-restarts 1): one rank of the last
    node SIGKILLed (its launcher lives); the other nodes go on in-process and the launcher of the
    lost rank restarts its ranks into the running round, where they rejoin from a live peer.
    Seconds from the kill to the next step, from the restart to the step the node is back in
    (metrics.jsonl's replicas_live), whether node 0's ranks are the same processes, and with
    `reference` the final EMA export against an uninterrupted run's (cmp). `strategy` no_shard,
    zero1 or zero2: every rank a replica, what the strategy shards sharded inside each node.
    `backend` gloo: the collectives across hosts (here on loopback) instead of shared memory.
    `keep`: the runs and launcher logs stay (their folder is in the result)."""
    work = tempfile.mkdtemp(prefix="tessera_node_loss_")
    layout = hybrid_sets(ranks) if strategy == "hybrid" else ["--set", f"sharding.strategy={strategy}"]
    sets = layout + ["--set", "fault.survive=true", "--set", f"run.backend={backend}", "--set",
                     f"run.deterministic={'true' if deterministic else 'false'}"]
    if dit:
        sets += ["--set", "data.micro_batch=16"]  # whole micro-batches on 4 ranks and on 2

    def start(run_dir, port):
        launchers, logs = [], []
        for node in range(nodes):
            command = [os.path.join(build, "bin", "tessera-run"), "--nnodes", f"{nodes}:{nodes}", "--nproc-per-node",
                       str(ranks), "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "rejoin", "--rdzv-conf",
                       "last_call_timeout=1", "--max-restarts", "1"] + \
                train_command(build, nodes, ranks, steps, run_dir, sets, dit)
            log = open(os.path.join(run_dir + f".node{node}.log"), "w")
            logs.append(log)
            launchers.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        return launchers, logs

    def read(path):
        with open(path) as f:
            return f.read()

    run_dir = os.path.join(work, "run")
    metrics = os.path.join(run_dir, "metrics.jsonl")
    launchers, logs = start(run_dir, free_port())
    paths = [run_dir + f".node{n}.log" for n in range(nodes)]
    wait_for(lambda: last_step(metrics) >= kill_at, 900, f"step {kill_at}")
    # The node ranks go by the order the launchers met in: find node 0 and the last node.
    first_rank = {n: re.search(r"started \d+ ranks? \(RANK (\d+)", read(p)) for n, p in enumerate(paths)}
    by_rank = sorted(range(nodes), key=lambda n: int(first_rank[n].group(1)))
    live, lost = launchers[by_rank[0]], launchers[by_rank[-1]]
    live_pids = rank_pids(live)
    victim = rank_pids(lost)[-1]
    os.kill(victim, signal.SIGKILL)
    killed_at = time.time()
    lost_step = last_step(metrics)

    def rows():
        try:
            with open(metrics) as f:
                return [json.loads(line) for line in f if line.strip().endswith("}")]
        except (OSError, ValueError):
            return []

    def back():
        after = [r for r in rows() if r["time"] > killed_at]
        gone = [r for r in after if r["replicas_live"] < nodes]
        return next((r for r in after if gone and r["step"] > gone[0]["step"] and r["replicas_live"] == nodes), None)

    back_row = wait_for(back, 900, "the lost node back in the step")
    same_processes = all(os.path.exists(f"/proc/{pid}") for pid in live_pids) and rank_pids(live) == live_pids
    for p in launchers:
        p.wait(timeout=3600)
    lost_log = read(paths[by_rank[-1]])
    restarted = re.search(r"\[(\d\d):(\d\d):(\d\d\.\d+)\] \[info\] tessera-run: started \d+ ranks [^\n]*restart 1",
                          lost_log)
    after = [r for r in rows() if r["time"] > killed_at]
    went_on = re.search(r"fault\.survive: ranks [^\n]* go on as a world of \d+ from step (\d+)",
                        read(paths[by_rank[0]]))
    if not restarted or not went_on or not after:
        sys.exit("node_loss_bench: no rejoin:\n" + read(paths[by_rank[0]])[-3000:] + lost_log[-3000:])
    result = {"layout": f"{nodes}x{ranks}", "strategy": strategy, "backend": backend, "deterministic": deterministic,
              "launchers": "elastic", "model": "DiT (dit_quick)" if dit else
              "MLP (default, hidden 48)", "rank killed at step": lost_step,
              "steps lost": max(0, lost_step - int(went_on.group(1))),
              "seconds to the next step": round(after[0]["time"] - killed_at, 2),
              "node 0's ranks the same processes": same_processes,
              "seconds from the kill to the restart": round(log_time(restarted, killed_at) - killed_at, 2),
              "seconds from the restart to the end of the first step back": round(
                  back_row["time"] - log_time(restarted, killed_at), 2),
              "back at step": back_row["step"],
              "launcher exit statuses": [p.returncode for p in launchers]}
    for log in logs:
        log.close()
    if reference:
        export = "generator_ema" if dit else "model_ema"
        ref_dir = os.path.join(work, "reference")
        ref_launchers, ref_logs = start(ref_dir, free_port())
        for p in ref_launchers:
            p.wait(timeout=3600)
        for log in ref_logs:
            log.close()
        a, b = (os.path.join(d, "export", f"{export}.safetensors") for d in (ref_dir, run_dir))
        result[f"{export} bitwise the uninterrupted run's (cmp)"] = \
            subprocess.run(["cmp", "-s", a, b]).returncode == 0
        result[f"{export} largest difference to the uninterrupted run's"] = max_difference(a, b)
    if keep:
        result["kept"] = work
    else:
        shutil.rmtree(work, ignore_errors=True)
    return result


def run_case(build, nodes, ranks, local, kill_at, steps, sets=(), dit=False):
    work = tempfile.mkdtemp(prefix="tessera_node_loss_")
    # Each simulated node's local tier in memory, as the default (/dev/shm) has it.
    shm = tempfile.mkdtemp(prefix="tessera_node_loss_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    port = free_port()
    run_dir = os.path.join(work, "run")
    metrics = os.path.join(run_dir, "metrics.jsonl")
    train = train_command(build, nodes, ranks, steps, run_dir, list(sets), dit)
    launchers = []
    logs = []
    for node in range(nodes):
        extra = []
        if local:
            extra = ["--set", "checkpoint.local.every_steps=5", "--set",
                     f"checkpoint.local.dir={os.path.join(shm, f'local{node}')}"]
        command = [os.path.join(build, "bin", "tessera-run"), "--nnodes", f"1:{nodes}", "--nproc-per-node", str(ranks),
                   "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "node_loss", "--rdzv-conf",
                   "last_call_timeout=2", "--max-restarts", "3"] + train + extra
        log = open(os.path.join(work, f"node{node}.log"), "w")
        logs.append(log)
        launchers.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        if node == 0:
            time.sleep(1.0)  # node 0 hosts the rendezvous
    wait_for(lambda: last_step(metrics) >= kill_at, 600, f"step {kill_at}")
    kill_node(launchers[-1])
    killed_at = time.time()
    lost_step = last_step(metrics)  # after the kill: the node may have finished one more step
    if local:
        shutil.rmtree(os.path.join(shm, f"local{nodes - 1}"), ignore_errors=True)
    # After the restart, rank 0 may be on any surviving node (the rendezvous renumbers them).
    node_logs = [os.path.join(work, f"node{n}.log") for n in range(nodes - 1)]

    def read(path):
        with open(path) as f:
            return f.read()

    def resumed():
        """(step resumed from, rank 0's log, offset of the line) once the restarted rank 0 says."""
        pattern = re.compile(r"\[rank 0\] (?:resumed from \S+ \(step (\d+)|(resume auto: no complete checkpoint))")
        for path in node_logs:
            text = read(path)
            restart = text.find("restart 1 of")
            m = pattern.search(text, restart) if restart >= 0 else None
            if m:
                return (int(m.group(1)) if m.group(1) else 0, path, m.end())
        return None

    resumed_step, log0, offset = wait_for(resumed, 600, "the resume")
    # The resumed run's first step: rank 0 logs every step with its wall-clock time.
    first = re.compile(r"\[(\d\d):(\d\d):(\d\d\.\d+)\] \[info\] \[rank 0\] step (\d+)/")
    step_line = wait_for(lambda: first.search(read(log0), offset), 600, "the first step after the resume")
    h, m, sec = int(step_line.group(1)), int(step_line.group(2)), float(step_line.group(3))
    t = time.localtime(killed_at)
    recovery = (h * 3600 + m * 60 + sec) - (t.tm_hour * 3600 + t.tm_min * 60 + t.tm_sec + killed_at % 1)
    recovery %= 86400
    back = re.compile(r"\[(\d\d):(\d\d):(\d\d\.\d+)\] \[info\] \[rank 0\] step %d/" % max(lost_step, resumed_step + 1))
    back_line = wait_for(lambda: back.search(read(log0), offset), 600, f"step {lost_step} again")
    h, m, sec = int(back_line.group(1)), int(back_line.group(2)), float(back_line.group(3))
    regained = (h * 3600 + m * 60 + sec) - (t.tm_hour * 3600 + t.tm_min * 60 + t.tm_sec + killed_at % 1)
    regained %= 86400
    text = read(log0)
    promoted = re.search(r"checkpoint\.local: step \d+ of the node-local tier[^\n]*", text)
    for p in launchers:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()
    for log in logs:
        log.close()
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(shm, ignore_errors=True)
    return {"layout": f"{nodes}x{ranks}", "tier": "local every 5 + persistent every 100" if local else
            "persistent every 100", "node lost at step": lost_step, "resumed from step": resumed_step,
            "steps lost": lost_step - resumed_step, "seconds to the next step": round(recovery, 2),
            "seconds back at the step lost": round(regained, 2),
            "promotion": promoted.group(0) if promoted else ""}


def overhead(build, nodes, ranks, local, steps, config_args):
    """samples/s of an uninterrupted run (NODES launchers on this machine), with the local
    tier every 5 steps or without it. config_args: the model and data (--set ...)."""
    work = tempfile.mkdtemp(prefix="tessera_node_loss_")
    # Each simulated node's local tier in memory, as the default (/dev/shm) has it.
    shm = tempfile.mkdtemp(prefix="tessera_node_loss_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    port = free_port()
    outputs = []
    launchers = []
    for node in range(nodes):
        extra = (["--set", "checkpoint.local.every_steps=5", "--set",
                  f"checkpoint.local.dir={os.path.join(shm, f'local{node}')}"] if local else [])
        command = [os.path.join(build, "bin", "tessera-run"), "--nnodes", str(nodes), "--nproc-per-node", str(ranks),
                   "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "overhead",
                   os.path.join(build, "bin", "tessera-train")] + config_args + [
                   "--set", f"run.steps={steps}", "--set", "checkpoint.every_steps=100",
                   "--set", "log.per_rank_files=false", "--set", f"run.dir={os.path.join(work, 'run')}"] + extra
        launchers.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        if node == 0:
            time.sleep(1.0)
    for p in launchers:
        outputs.append(p.communicate(timeout=900)[0])
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(shm, ignore_errors=True)
    m = re.search(r"done: \d+ steps, .*?, ([0-9.]+) samples/s", "".join(outputs))
    if not m:
        sys.exit("node_loss_bench: no 'done:' line:\n" + "".join(outputs)[-3000:])
    return float(m.group(1))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", nargs="+", default=["2x2", "4x4"], help="NODESxRANKS")
    parser.add_argument("--kill-at", type=int, default=33)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--overhead", action="store_true",
                        help="instead: samples/s of uninterrupted runs with and without the local tier")
    parser.add_argument("--survive", action="store_true",
                        help="instead: fault.survive (the other nodes go on in-process) against the restart path with "
                             "the local tier, both hybrid with a node per replica group")
    parser.add_argument("--rejoin", action="store_true",
                        help="instead: fault.survive in an elastic run, one rank of the last node killed and rejoining "
                             "from a live peer")
    parser.add_argument("--strategy", choices=["hybrid", "no_shard", "zero1", "zero2"], default="hybrid",
                        help="--rejoin: each node a hybrid shard group, or a node's ranks of no_shard/zero1/zero2")
    parser.add_argument("--backend", choices=["auto", "gloo"], default="auto",
                        help="--rejoin: run.backend (auto: shared memory on this machine; gloo: as across hosts)")
    parser.add_argument("--keep", action="store_true", help="--rejoin: keep the runs and the launchers' logs")
    parser.add_argument("--not-deterministic", action="store_true",
                        help="--rejoin: without run.deterministic (the export within float tolerance, not bitwise)")
    parser.add_argument("--reference", action="store_true",
                        help="--rejoin: also run the uninterrupted run and compare the final EMA export (cmp)")
    parser.add_argument("--dit", action="store_true",
                        help="--overhead or --survive on the main job's DiT (configs/dit_quick.yaml) instead of the "
                             "default MLP")
    args = parser.parse_args()
    if args.overhead:
        for layout in args.layouts:
            nodes, ranks = (int(x) for x in layout.split("x"))
            for rep in range(2):  # interleaved, best of two each
                if args.dit:
                    config = ["--config", os.path.join(ROOT, "configs", "dit_quick.yaml"), "--set", "eval.sample_every=0",
                              "--set", "run.eval_every=0"]
                else:
                    config = ["--config", os.path.join(ROOT, "configs", "default.yaml"), "--set", "model.hidden=[48]",
                              "--set", f"data.global_batch={4 * nodes * ranks}", "--set", "data.micro_batch=4"]
                without = overhead(args.build, nodes, ranks, False, args.steps, config)
                with_local = overhead(args.build, nodes, ranks, True, args.steps, config)
                print(json.dumps({"layout": layout, "rep": rep, "samples/s without": without,
                                  "samples/s with local every 5": with_local,
                                  "ratio": round(with_local / without, 3)}), flush=True)
        return
    if args.rejoin:
        for layout in args.layouts:
            nodes, ranks = (int(x) for x in layout.split("x"))
            print(json.dumps(rejoin_case(args.build, nodes, ranks, args.kill_at, args.steps, args.dit, args.reference,
                                         args.strategy, not args.not_deterministic, args.backend, args.keep)),
                             flush=True)
        return
    if args.survive:
        for layout in args.layouts:
            nodes, ranks = (int(x) for x in layout.split("x"))
            print(json.dumps(survive_case(args.build, nodes, ranks, args.kill_at, args.steps, args.dit)), flush=True)
            print(json.dumps(run_case(args.build, nodes, ranks, True, args.kill_at, args.steps, hybrid_sets(ranks),
                                      args.dit)), flush=True)
        return
    for layout in args.layouts:
        nodes, ranks = (int(x) for x in layout.split("x"))
        for local in (True, False):
            print(json.dumps(run_case(args.build, nodes, ranks, local, args.kill_at, args.steps)), flush=True)


if __name__ == "__main__":
    main()
