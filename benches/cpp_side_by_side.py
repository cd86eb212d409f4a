#!/usr/bin/env python3
"""C++ descriptor-list costs side by side: NIXL 1.5.1's libnixl.so and gixl's nixl.h, and gixl's Python path.

Builds benches/cpp_dlist.cpp twice (against gixl: target/capi, rebuilt with scripts/build-capi.sh --release; against
NIXL: the libraries of .venv/nixl's nixl-cu12 wheel, with -DGIXL_NIXL_ORACLE), runs the two programs in
alternating rounds, measures the same lists through gixl's Python `prep_xfer_dlist` in .venv/gixl, and prints
one Markdown table: per case the medians over rounds (ms), NIXL / gixl (above 1: gixl faster), the issue's
target (gixl C++ at most half of NIXL's time) and gixl C++ / gixl Python (target: within 20 %).

    python3 benches/cpp_side_by_side.py [--rounds N] [--quick]
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.path.join(ROOT, "target", "bench-cpp")

# The Python side: the same two agents, the same lists (built before the clock starts), prep_xfer_dlist timed.
PY_CHILD = r"""
import sys, time
import numpy as np
from nixl._api import nixl_agent, nixl_agent_config
reps = int(sys.argv[1])
block, max_n = 64, 1 << 21
tbuf = np.ones(max_n * block, dtype=np.uint8)
ibuf = np.full(max_n * block, 2, dtype=np.uint8)
T = nixl_agent("py-bench-T", nixl_agent_config(backends=["UCX"]))
I = nixl_agent("py-bench-I", nixl_agent_config(backends=["UCX"]))
T.register_memory([(tbuf.ctypes.data, tbuf.nbytes, 0, "")], "DRAM")
I.register_memory([(ibuf.ctypes.data, ibuf.nbytes, 0, "")], "DRAM")
I.add_remote_agent(T.get_agent_metadata())

def blocks(base, n, shuffled):
    i = np.arange(n, dtype=np.uint64)
    b = (i * np.uint64(2654435761)) & np.uint64(n - 1) if shuffled else i
    a = np.empty((n, 3), dtype=np.uint64)
    a[:, 0] = np.uint64(base) + b * np.uint64(block)
    a[:, 1] = block
    a[:, 2] = 0
    return I.get_xfer_descs(a.astype(np.int64), "DRAM")

def med(v):
    v = sorted(v)
    return v[len(v) // 2], v[0]

for n in (1 << 20, max_n):
    for shuffled in (False, True):
        il, tl = blocks(ibuf.ctypes.data, n, shuffled), blocks(tbuf.ctypes.data, n, shuffled)
        tag = f"{n} {'shuffled' if shuffled else 'blocks'}"
        local, remote = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            h = I.prep_xfer_dlist("", il)
            local.append((time.perf_counter() - t0) * 1e3)
            I.release_dlist_handle(h)
            t0 = time.perf_counter()
            h = I.prep_xfer_dlist("py-bench-T", tl)
            remote.append((time.perf_counter() - t0) * 1e3)
            I.release_dlist_handle(h)
        for name, v in (("prep_local", local), ("prep_remote", remote)):
            m, lo = med(v)
            print(f"{name} {tag} {m:.3f} {lo:.3f} {len(v)}", flush=True)
"""


def run(cmd, env=None, timeout=900):
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return out.stdout


def parse(text):
    got = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 4:
            try:
                got[" ".join(parts[:-3])] = float(parts[-3])
            except ValueError:
                pass
    return got


def build():
    os.makedirs(BUILD, exist_ok=True)
    src = os.path.join(ROOT, "benches", "cpp_dlist.cpp")
    flags = ["-std=c++17", "-O2", "-g", "-Wall", "-Wextra", "-Werror"]
    capi = os.path.join(ROOT, "target", "capi")
    # Always: target/capi may hold a debug build (scripts/valgrind.sh puts one there), 10-20x slower.
    run([os.path.join(ROOT, "scripts", "build-capi.sh"), "--release"])
    gixl = os.path.join(BUILD, "cpp_dlist_gixl")
    run(["c++", *flags, "-I", os.path.join(capi, "include"), src, "-o", gixl, "-L", capi, "-lgixl",
         f"-Wl,-rpath,{capi}"])
    libs = glob.glob(os.path.join(ROOT, ".venv", "nixl", "lib", "python3*", "site-packages", ".nixl_cu12.mesonpy.libs"))
    if not libs:
        sys.exit("NIXL's libraries not found: run scripts/setup.sh first (.venv/nixl)")
    nixl = os.path.join(BUILD, "cpp_dlist_nixl")
    run(["c++", *flags, "-DGIXL_NIXL_ORACLE", "-I", os.path.join(ROOT, "include", "nixl"), src, "-o", nixl,
         "-L", libs[0], "-lnixl", "-lnixl_build", "-lserdes", f"-Wl,-rpath,{libs[0]}"])
    return gixl, nixl


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="3 repetitions per case instead of 7")
    args = ap.parse_args()
    gixl, nixl = build()
    reps = 3 if args.quick else 7
    rounds = {"nixl": [], "gixl": [], "py": []}
    env = dict(os.environ, UCX_LOG_LEVEL="error")
    for r in range(args.rounds):
        order = ["nixl", "gixl", "py"] if r % 2 == 0 else ["py", "gixl", "nixl"]
        for who in order:
            if who == "py":
                with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
                    f.write(PY_CHILD)
                try:
                    out = run([os.path.join(ROOT, ".venv", "gixl", "bin", "python"), f.name, str(reps)], env=env)
                finally:
                    os.unlink(f.name)
            else:
                exe = gixl if who == "gixl" else nixl
                out = run([exe] + (["--quick"] if args.quick else []), env=env)
            rounds[who].append(parse(out))
            print(f"# round {r + 1}: {who} done", file=sys.stderr, flush=True)

    def med(who, case):
        v = [d[case] for d in rounds[who] if case in d]
        return statistics.median(v) if v else None

    cases = list(rounds["gixl"][0].keys())
    print(f"| case ({args.rounds} rounds × {reps} runs, median ms) | NIXL 1.5.1 C++ | gixl C++ | NIXL / gixl "
          "| ≤ ½ NIXL | gixl Python | gixl C++ / Python |")
    print("|---|---:|---:|---:|---|---:|---:|")
    ok = True
    for c in cases:
        n, g, p = med("nixl", c), med("gixl", c), med("py", c)
        ratio = f"{n / g:.2f}×" if n and g else "—"
        half = "—"
        if n and g and (c.startswith("prep_") or c.startswith("register_mem")):
            half = "✓" if g <= n / 2 else "✗"
            ok &= g <= n / 2
        vs_py = f"{g / p:.2f}" if p and g else "—"
        fmt = lambda x: "—" if x is None else f"{x:.2f}"
        print(f"| {c} | {fmt(n)} | {fmt(g)} | {ratio} | {half} | {fmt(p)} | {vs_py} |")
    print()
    print(f"load average after the run: {os.getloadavg()[0]:.2f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
