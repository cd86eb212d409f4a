#!/usr/bin/env python3
"""Soak: thousands of register/transfer/release cycles across prefill restarts; RSS and fds must stay flat.

A decode peer (child process) runs ``--cycles`` cycles per round (register a buffer, prep both sides, make a
READ with a notification, transfer, wait, release the handle and both dlists, deregister) against a prefill
peer; after every round the prefill is SIGKILLed and restarted under the same name and the decode removes and
re-adds it (a new incarnation each round). The decode's RSS and open fds are sampled after the warm-up round
and at the end; the run fails if RSS grew by more than ``--rss-tol-mb`` or the fd count by more than
``--fd-tol``. The prefill drains its notifications each round.

    .venv/gixl/bin/python python/tests/soak.py --quick            # 20 rounds x 50 cycles (about 30 s)
    .venv/gixl/bin/python python/tests/soak.py                    # 200 rounds x 50 cycles = 10000 cycles
    .venv/nixl/bin/python python/tests/soak.py --impl nixl_cu12   # the same against NIXL 1.5.1
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from peer_client import PeerProcess  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", default="gixl", choices=["gixl", "nixl_cu12"])
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--cycles", type=int, default=50)
    ap.add_argument("--quick", action="store_true", help="20 rounds")
    ap.add_argument("--rss-tol-mb", type=float, default=16.0)
    ap.add_argument("--fd-tol", type=int, default=2)
    args = ap.parse_args(argv)
    rounds = 20 if args.quick else args.rounds
    bindings = "native" if args.impl == "gixl" else args.impl
    pname = f"soak-prefill-{uuid.uuid4().hex[:8]}"
    size = 8 * 4096
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gixl-soak-") as tmp:
        D = PeerProcess("decode", args.impl, bindings, tmp)
        P = PeerProcess("prefill0", args.impl, bindings, tmp)
        try:
            D.init(name=f"soak-decode-{uuid.uuid4().hex[:8]}", size=4096)
            p = P.init(name=pname, size=size, fill="3")
            name = D.add_remote(md=p["md"])
            start = None
            total = done = 0
            for r in range(rounds):
                done += D.soak_cycles(name=name, raddr=p["addr"], n=args.cycles, timeout=300)
                total += args.cycles
                P.drain_notifs()
                P.kill()
                P.close()
                P = PeerProcess(f"prefill{r + 1}", args.impl, bindings, tmp)
                p = P.init(name=pname, size=size, fill="3")
                D.remove_remote(name=name)
                D.add_remote(md=p["md"])
                if r == 0:
                    start = D.rss_fds()
                    print(f"after warm-up round: RSS {start['rss_kb'] / 1024:.1f} MiB, {start['fds']} fds", flush=True)
            end = D.rss_fds()
        finally:
            P.close()
            D.close()
    dt = time.monotonic() - t0
    grow = (end["rss_kb"] - start["rss_kb"]) / 1024
    print(f"{args.impl}: {total} cycles ({done} DONE), {rounds} prefill restarts in {dt:.0f} s")
    print(f"decode RSS {start['rss_kb'] / 1024:.1f} -> {end['rss_kb'] / 1024:.1f} MiB ({grow:+.1f}), "
          f"fds {start['fds']} -> {end['fds']}")
    ok = done == total and grow <= args.rss_tol_mb and end["fds"] - start["fds"] <= args.fd_tol
    print("soak: ok" if ok else "soak: FAILED (a cycle did not end DONE, or RSS/fds grew beyond tolerance)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
