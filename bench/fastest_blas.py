"""The PyTorch baselines' fastest OpenBLAS kernel (issue 45 item 6), for bench/*_vs_pytorch.py.

Debian's LibTorch sends fp32 products to the system's OpenBLAS, which picks its kernel from a
table of CPUs: on cores it does not know it runs a slower one than the core allows (the generic
"Prescott" kernel on some Xeons with AMX; "Haswell" on this AMD EPYC with AVX-512). A fair
baseline gets the best kernel the core runs, so each candidate OPENBLAS_CORETYPE is timed on a
1024^3 fp32 product, or on the model's own products when the caller gives their shapes, one
thread, in the baseline's own Python, and the fastest is set in the baseline's environment only. Tessera's commands keep the environment they were given (its fp32
products go through oneDNN, which detects the core itself), and tests and CI never set it.
"""

import os
import subprocess

# The kernels OpenBLAS 0.3.21 builds for x86-64 that a current core may run, newest first.
CANDIDATES = ["SkylakeX", "Cooperlake", "Zen", "Haswell", "Sandybridge"]

PROBE = """
import sys, time, torch
torch.set_num_threads(1)
shapes = eval(sys.argv[1])  # [(m, k, n), ...]
pairs = [(torch.randn(m, k), torch.randn(k, n)) for m, k, n in shapes]
flops = sum(2 * m * k * n for m, k, n in shapes)
def all_products():
    for a, b in pairs:
        a @ b
all_products()
best, end = float("inf"), time.perf_counter() + 0.5
while time.perf_counter() < end:  # the best of half a second of products: this machine is shared
    start = time.perf_counter(); all_products(); best = min(best, time.perf_counter() - start)
print(flops / best / 1e9)
"""


def probe(python, env, shapes=None):
    """GFLOP/s of the products of `shapes` ([(m, k, n)]; default one 1024^3) in `env`, or
    None when that kernel does not run here."""
    shapes = shapes or [(1024, 1024, 1024)]
    try:
        one_thread = dict(env, OPENBLAS_NUM_THREADS="1")  # OpenBLAS's own pool, whatever torch says
        out = subprocess.run([python, "-c", PROBE, repr(list(shapes))], env=one_thread, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, timeout=120, check=False)
    except subprocess.TimeoutExpired:
        return None
    if out.returncode != 0:  # e.g. SIGILL: the core lacks the kernel's instructions
        return None
    try:
        return float(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None


def fastest_env(python, env, shapes=None):
    """(env with the fastest OPENBLAS_CORETYPE on the products of `shapes`, a line saying what
    was measured)."""
    given = env.get("OPENBLAS_CORETYPE")
    candidates = [("as given" if given is None else f"as given ({given})", None)] + [(k, k) for k in CANDIDATES]
    results = {}
    for _ in range(2):  # two rounds, interleaved, the better of each kernel's two
        for name, kind in candidates:
            gflops = probe(python, env if kind is None else dict(env, OPENBLAS_CORETYPE=kind), shapes)
            before = results.get(name, (None, kind))[0]
            results[name] = (max(g for g in (gflops, before) if g is not None) if gflops or before else None, kind)
    usable = {name: r for name, r in results.items() if r[0] is not None}
    if not usable:
        return env, "PyTorch baseline: no OpenBLAS kernel could be timed; environment as given"
    name, (gflops, kind) = max(usable.items(), key=lambda item: item[1][0])
    chosen = env if kind is None else dict(env, OPENBLAS_CORETYPE=kind)
    table = ", ".join(f"{n} {r[0]:.0f}" if r[0] is not None else f"{n} -" for n, r in results.items())
    what = "the model's fp32 products" if shapes else "a 1024^3 fp32 product"
    return chosen, f"PyTorch baseline's OpenBLAS kernel: {name} (GFLOP/s of {what}, 1 thread: {table})"


if __name__ == "__main__":
    import sys
    _, line = fastest_env(sys.argv[1] if len(sys.argv) > 1 else "/usr/bin/python3", dict(os.environ))
    print(line)
