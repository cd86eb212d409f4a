#!/usr/bin/env python3
"""scripts/nixlbench_rounds.py [--rounds N] [--from BYTES] [--to BYTES] [--ops WRITE,READ] [--way NAME=VAR=VALUE ...]

Rounds of nixlbench, NIXL 1.5.1 against gixl, with each cell's median over the rounds: a single nixlbench run
at 1 MiB and up does about 60 transfers per size and moves by up to 2x from run to run on a 2-core host, so
one sweep says little. Uses the two builds of `scripts/nixlbench.sh NIXL_SRC build` (target/nixlbench/{nixl,gixl})
and runs them as that script does (ASIO runtime, UCX, DRAM to DRAM, batch 1, 256 MiB, --check_consistency), the
ways alternating within each round and operation. `--way NAME=VAR=VALUE` adds a way: gixl with VAR=VALUE in its
environment (an A/B of a temporary switch in one library). Prints, per operation and way, the median of the
per-round ratios to NIXL with their range, then each way's median GB/s."""

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from nixlbench_table import ROW, size  # nixlbench's result rows, and block sizes as the table names them

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "target" / "nixlbench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(impl: str, op: str, env_extra: dict[str, str], lo: int, hi: int, nixl_libs: Path) -> dict[int, float]:
    exe = OUT / impl / "nixlbench"
    args = [str(exe), "--runtime_type", "ASIO", "--asio_port", str(free_port()), "--backend", "UCX",
            "--initiator_seg_type", "DRAM", "--target_seg_type", "DRAM", "--op_type", op, "--check_consistency",
            "--total_buffer_size", "268435456", "--start_block_size", str(lo), "--max_block_size", str(hi),
            "--start_batch_size", "1", "--max_batch_size", "1"]
    env = dict(os.environ, UCX_TLS="tcp,self,sm", **env_extra)
    if impl == "nixl":
        env["NIXL_PLUGIN_DIR"] = str(nixl_libs / "plugins")
    procs = []
    for rank in range(2):
        procs.append(subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        if rank == 0:
            time.sleep(1)  # the first process is the ASIO runtime's server
    outs = [p.communicate()[0] for p in procs]
    rates = {}
    for line in "".join(outs).splitlines():
        m = ROW.match(line.strip())
        if m:
            rates[int(m.group(1))] = float(m.group(3))
    if not rates or any(p.returncode for p in procs):
        sys.exit(f"nixlbench ({impl}, {op}) failed:\n" + "\n".join(o[-2000:] for o in outs))
    return rates


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--from", dest="lo", type=int, default=4096)
    ap.add_argument("--to", dest="hi", type=int, default=64 << 20)
    ap.add_argument("--ops", default="WRITE,READ")
    ap.add_argument("--way", action="append", default=[], help="NAME=VAR=VALUE: gixl with VAR=VALUE set")
    a = ap.parse_args()
    for impl in ("nixl", "gixl"):
        if not (OUT / impl / "nixlbench").exists():
            sys.exit(f"{OUT / impl / 'nixlbench'} is missing: run scripts/nixlbench.sh NIXL_SRC build first")
    libs = sorted(ROOT.glob(".venv/nixl/lib/python3*/site-packages/.nixl_cu12.mesonpy.libs"))
    if not libs:
        sys.exit("NIXL 1.5.1's libraries are missing: run scripts/setup.sh")
    ways: dict[str, tuple[str, dict[str, str]]] = {"nixl": ("nixl", {}), "gixl": ("gixl", {})}
    for w in a.way:
        name, _, kv = w.partition("=")
        var, eq, value = kv.partition("=")
        if not name or not var or not eq:
            sys.exit(f"--way {w!r}: expected NAME=VAR=VALUE")
        ways[name] = ("gixl", {var: value})
    ops = a.ops.split(",")
    res: dict[tuple[str, str], list[dict[int, float]]] = {(w, op): [] for w in ways for op in ops}
    for i in range(a.rounds):
        for op in ops:
            for w, (impl, env) in ways.items():
                res[(w, op)].append(run(impl, op, env, a.lo, a.hi, libs[0]))
        print(f"round {i + 1} of {a.rounds}: load average {os.getloadavg()[0]:.2f}", flush=True)
    for op in ops:
        blocks = sorted(res[("nixl", op)][0])
        print(f"\n{op}: median gixl ÷ NIXL over {a.rounds} rounds [range]; then median GB/s")
        for w in ways:
            if w == "nixl":
                continue
            cells = []
            for b in blocks:
                rs = [g[b] / n[b] for g, n in zip(res[(w, op)], res[("nixl", op)]) if g.get(b) and n.get(b)]
                cells.append(f"{size(b)} {statistics.median(rs):.2f}× [{min(rs):.2f}–{max(rs):.2f}]")
            print(f"  {w}: " + " | ".join(cells))
        for w in ways:
            med = [statistics.median(r.get(b, 0.0) for r in res[(w, op)]) for b in blocks]
            print(f"  {w} GB/s: " + " | ".join(f"{size(b)} {m:.2f}" for b, m in zip(blocks, med)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
