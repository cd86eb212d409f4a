#!/usr/bin/env python3
"""POSIX backend throughput, gixl vs NVIDIA NIXL 1.5.1, through the same nixl._api code in one run.

    python3 benches/posix_side_by_side.py [--iters 20] [--dir /var/tmp]

For each implementation (its own interpreter: .venv/gixl with `nixl`, .venv/nixl with `nixl_cu12`) and each
file mode (page cache warm; O_DIRECT where the filesystem allows it) it times DRAM -> FILE (WRITE) and
FILE -> DRAM (READ) of one 64 MiB descriptor and of 1024 x 16 KiB descriptors (file side in reversed order,
so nothing merges), median of `--iters` requests after one warm-up, data checked once. Prints a Markdown table.
"""

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMPLS = {
    "NIXL 1.5.1": (os.path.join(ROOT, ".venv/nixl/bin/python"), "nixl_cu12"),
    "gixl": (os.path.join(ROOT, ".venv/gixl/bin/python"), "nixl"),
}

CHILD = r'''
import json, mmap, os, statistics, sys, time
import numpy as np
module, path, direct, iters = sys.argv[1], sys.argv[2], sys.argv[3] == "1", int(sys.argv[4])
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
api = __import__(module + "._api", fromlist=["_"])
ag = api.nixl_agent("posix-bench", api.nixl_agent_config(backends=["POSIX"]))
flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
fd = os.open(path, flags, 0o600)
MIB = 1 << 20
def buf():  # page-aligned, as O_DIRECT needs
    m = mmap.mmap(-1, 64 * MIB)
    return m, np.frombuffer(m, dtype=np.uint8)
ms, src = buf(); md, dst = buf()
src[:] = np.random.default_rng(0).integers(0, 255, src.size, dtype=np.uint8)
ag.register_memory([(src.ctypes.data, src.nbytes, 0, ""), (dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
ag.register_memory([(0, 0, fd, path)], "FILE")
def shapes(base):
    return {
        "64 MiB x1": ([(base, 64 * MIB, 0)], [(0, 64 * MIB, fd)], 64 * MIB),
        "16 KiB x1024": ([(base + i * 16384, 16384, 0) for i in range(1024)],
                          [((1023 - i) * 16384, 16384, fd) for i in range(1024)], 16 * MIB),
    }
out = {}
for shape in ("64 MiB x1", "16 KiB x1024"):
    for op in ("WRITE", "READ"):
        base = src.ctypes.data if op == "WRITE" else dst.ctypes.data
        l, f, nbytes = shapes(base)[shape]
        h = ag.initialize_xfer(op, ag.get_xfer_descs(l, "DRAM"), ag.get_xfer_descs(f, "FILE"), "posix-bench")
        def go():
            s = ag.transfer(h)
            while s == "PROC":
                s = ag.check_xfer_state(h)
            assert s == "DONE", s
        go()
        if op == "READ":
            n = 64 * MIB if shape == "64 MiB x1" else 16 * MIB
            if shape == "64 MiB x1":
                assert (dst == src).all(), "READ returned wrong bytes"
            else:
                assert (dst[:16384] == src[:16384]).all(), "READ returned wrong bytes"
        times = []
        for _ in range(iters):
            t = time.perf_counter(); go(); times.append(time.perf_counter() - t)
        out[f"{shape} {op}"] = nbytes / statistics.median(times) / 1e9
        ag.release_xfer_handle(h)
os.close(fd)
os.unlink(path)
print(json.dumps(out))
'''


def direct_ok(d):
    p = os.path.join(d, f"gixl-odirect-probe-{os.getpid()}")
    try:
        os.close(os.open(p, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600))
        return True
    except OSError:
        return False
    finally:
        if os.path.exists(p):
            os.unlink(p)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--dir", default="/var/tmp")
    a = ap.parse_args()
    modes = [("page cache", "0")] + ([("O_DIRECT", "1")] if direct_ok(a.dir) else [])
    res = {}
    for mode, direct in modes:
        for impl, (py, module) in IMPLS.items():
            path = os.path.join(a.dir, f"gixl-posix-bench-{os.getpid()}.bin")
            p = subprocess.run([py, "-c", CHILD, module, path, direct, str(a.iters)], capture_output=True, text=True,
                               timeout=600)
            if p.returncode != 0:
                res[(mode, impl)] = {"error": (p.stderr.strip().splitlines() or ["?"])[-1]}
            else:
                res[(mode, impl)] = json.loads(p.stdout.strip().splitlines()[-1])
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(f"POSIX backend, GB/s (median of {a.iters}); machine: {os.cpu_count()} cores, load {' '.join(load)}; "
          f"files in {a.dir}\n")
    print("| mode | transfer | NIXL 1.5.1 | gixl | gixl / NIXL |")
    print("|---|---|---:|---:|---:|")
    for mode, _ in modes:
        n, g = res[(mode, "NIXL 1.5.1")], res[(mode, "gixl")]
        for k in ("64 MiB x1 WRITE", "64 MiB x1 READ", "16 KiB x1024 WRITE", "16 KiB x1024 READ"):
            nv, gv = n.get(k), g.get(k)
            fmt = lambda v: f"{v:.2f}" if isinstance(v, float) else (n.get("error") or g.get("error") or "n/a")[:40]
            ratio = f"{gv / nv:.2f}x" if isinstance(nv, float) and isinstance(gv, float) else "-"
            print(f"| {mode} | {k} | {fmt(nv)} | {fmt(gv)} | {ratio} |")
    print(f"\ncommand: python3 benches/posix_side_by_side.py --iters {a.iters} --dir {a.dir}")


if __name__ == "__main__":
    sys.exit(main())
