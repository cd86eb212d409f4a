#!/usr/bin/env python3
"""The OBJ (S3) backend: gixl vs NIXL 1.5.1's own OBJ backend, against one real S3 server, in one run.

    python3 benches/obj_side_by_side.py            # 3 rounds, alternating implementations
    python3 benches/obj_side_by_side.py --rounds 1

Starts Garage 2.5.0 (single node, loopback; built by scripts/setup.sh) and runs, per round, each
configuration in its own process: NIXL with its default settings, NIXL with num_threads=8, and gixl with its
defaults. Cases: 64 MiB as one object (WRITE then READ), 1024 x 16 KiB blocks as 1024 objects (WRITE then
READ), and a dead server (the port closed) for one 16 KiB READ. Every READ is checked byte for byte. Figures
are medians over the rounds; ratios are gixl over NIXL in the same run. Garage does not set TCP_NODELAY, so a
small GET on one connection waits ~40 ms for the delayed ACK: parallel requests hide that, one-at-a-time
requests pay it, and the figures say which each configuration does.

Also the child program (``--child``), run under each implementation's interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "python" / "tests"))

MiB = 1 << 20
BLK = 16 * 1024
N = 1024
BIG = 64 * MiB


def child(impl: str, params: dict, dead_endpoint: str) -> dict:
    import garage as gar

    gar.isolate_this_process()
    import importlib

    import numpy as np

    api = importlib.import_module(impl + "._api")
    a = api.nixl_agent(f"bench-{os.getpid()}", api.nixl_agent_config(backends=[]))
    a.create_backend("OBJ", params)
    out = {}
    tag = f"{impl}-{os.getpid()}-{time.monotonic_ns()}"

    import resource

    def cpu():
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    def run(case, op, local, remote, timeout=600):
        h = a.initialize_xfer(op, local, remote, a.name)
        c0 = cpu()
        t0 = time.perf_counter()
        st = a.transfer(h)
        while st == "PROC":
            if time.perf_counter() - t0 > timeout:
                raise TimeoutError(op)
            time.sleep(0.0002)
            st = a.check_xfer_state(h)
        dt = time.perf_counter() - t0
        out[f"{case}_cpu"] = cpu() - c0
        out[f"{case}_s"] = dt
        a.release_xfer_handle(h)
        assert st == "DONE", st

    src = ((np.arange(BIG, dtype=np.uint64) * 7 + 3) % 251).astype(np.uint8)
    dst = np.zeros(BIG, np.uint8)
    a.register_memory([(src.ctypes.data, BIG, 0, ""), (dst.ctypes.data, BIG, 0, "")], "DRAM")
    a.register_memory([(0, 0, 1, f"{tag}/big")], "OBJ")
    remote = a.get_xfer_descs([(0, BIG, 1)], "OBJ")
    run("big_write", "WRITE", a.get_xfer_descs([(src.ctypes.data, BIG, 0)], "DRAM"), remote)
    run("big_read", "READ", a.get_xfer_descs([(dst.ctypes.data, BIG, 0)], "DRAM"), remote)
    assert np.array_equal(src, dst), "64 MiB READ returned other bytes"

    a.register_memory([(0, 0, 100 + i, f"{tag}/kv/{i:05d}") for i in range(N)], "OBJ")
    remote = a.get_xfer_descs([(0, BLK, 100 + i) for i in range(N)], "OBJ")
    dst[: N * BLK] = 0
    run("kv_write", "WRITE", a.get_xfer_descs([(src.ctypes.data + i * BLK, BLK, 0) for i in range(N)], "DRAM"), remote)
    run("kv_read", "READ", a.get_xfer_descs([(dst.ctypes.data + i * BLK, BLK, 0) for i in range(N)], "DRAM"), remote)
    assert np.array_equal(src[: N * BLK], dst[: N * BLK]), "KV READ returned other bytes"

    b = api.nixl_agent(f"dead-{os.getpid()}", api.nixl_agent_config(backends=[]))
    b.create_backend("OBJ", dict(params, endpoint_override=dead_endpoint))
    b.register_memory([(dst.ctypes.data, BLK, 0, "")], "DRAM")
    b.register_memory([(0, 0, 1, "dead")], "OBJ")
    h = b.initialize_xfer("READ", b.get_xfer_descs([(dst.ctypes.data, BLK, 0)], "DRAM"),
                          b.get_xfer_descs([(0, BLK, 1)], "OBJ"), b.name)
    t0 = time.perf_counter()
    try:
        st = b.transfer(h)
        while st == "PROC":
            time.sleep(0.001)
            st = b.check_xfer_state(h)
        out["dead"] = f"state {st}"
    except Exception as e:  # the expected outcome: NIXL_ERR_BACKEND
        out["dead"] = type(e).__name__
    out["dead_s"] = time.perf_counter() - t0
    return out


def server_cpu(pid: int) -> float:
    """CPU seconds the server process has used (user + system)."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


CONFIGS = [
    ("NIXL (default)", "nixl", "nixl_cu12", {}),
    ("NIXL num_threads=8", "nixl", "nixl_cu12", {"num_threads": "8"}),
    ("gixl (default)", "gixl", "nixl", {}),
]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        spec = json.loads(args.child)
        print(json.dumps(child(spec["impl"], spec["params"], spec["dead"])))
        return 0

    import garage as gar

    if gar.garage_exe() is None:
        print("garage is not installed: run scripts/setup.sh", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        g = gar.Garage.start(Path(tmp) / "garage")
        try:
            dead = f"http://127.0.0.1:{gar.free_port()}"
            results: dict = {c[0]: [] for c in CONFIGS}
            for r in range(args.rounds):
                for label, venv, impl, extra in CONFIGS:
                    py = REPO / ".venv" / venv / "bin" / "python"
                    spec = {"impl": impl, "params": g.params(**extra), "dead": dead}
                    t0 = time.monotonic()
                    s0 = server_cpu(g.proc.pid)
                    p = subprocess.run([str(py), __file__, "--child", json.dumps(spec)], capture_output=True, text=True,
                                       timeout=1800, env=gar.no_discovery())
                    if p.returncode != 0:
                        print(f"{label}: failed\n{p.stderr[-3000:]}", file=sys.stderr)
                        return 1
                    res = json.loads(p.stdout.strip().splitlines()[-1])
                    res["server_cpu"] = server_cpu(g.proc.pid) - s0
                    results[label].append(res)
                    print(f"round {r + 1} {label}: {json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()})} "
                          f"({time.monotonic() - t0:.0f} s)", file=sys.stderr)
        finally:
            g.kill()

    def med(label, k):
        return statistics.median(x[k] for x in results[label])

    rows = [
        ("64 MiB WRITE, one object", "big_write_s", lambda s: f"{BIG / s / 1e9:.2f} GB/s"),
        ("64 MiB READ, one object", "big_read_s", lambda s: f"{BIG / s / 1e9:.2f} GB/s"),
        ("1024 x 16 KiB WRITE, 1024 objects", "kv_write_s", lambda s: f"{s:.3f} s ({N / s:,.0f} obj/s)"),
        ("1024 x 16 KiB READ, 1024 objects", "kv_read_s", lambda s: f"{s:.3f} s ({N / s:,.0f} obj/s)"),
        ("client CPU, 1024 x 16 KiB WRITE", "kv_write_cpu", lambda s: f"{s:.2f} s"),
        ("client CPU, 1024 x 16 KiB READ", "kv_read_cpu", lambda s: f"{s:.2f} s"),
        ("server (Garage) CPU, all the cases above", "server_cpu", lambda s: f"{s:.2f} s"),
        ("dead server, one READ: reported after", "dead_s", lambda s: f"{s:.2f} s"),
    ]
    labels = [c[0] for c in CONFIGS]
    print(f"\nOBJ backend vs Garage 2.5.0 on loopback, {args.rounds} round(s), medians; ratio = NIXL time / gixl time")
    print("| case | " + " | ".join(labels) + " | gixl vs NIXL default | gixl vs NIXL num_threads=8 |")
    print("|---" * (len(labels) + 3) + "|")
    for name, k, fmt in rows:
        g_ = med("gixl (default)", k)
        cells = [fmt(med(l, k)) for l in labels]
        r1 = med("NIXL (default)", k) / g_
        r2 = med("NIXL num_threads=8", k) / g_
        print(f"| {name} | " + " | ".join(cells) + f" | {r1:.1f}x | {r2:.1f}x |")
    print("dead-server outcome: " + ", ".join(f"{l}: {results[l][0]['dead']}" for l in labels))
    return 0


if __name__ == "__main__":
    sys.exit(main())
