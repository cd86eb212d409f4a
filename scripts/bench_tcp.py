#!/usr/bin/env python3
"""Cross-host TCP figures for gixl, next to NVIDIA NIXL 1.5.1 (UCX_TLS=tcp) and raw TCP, on one link.

    sudo python3 scripts/bench_tcp.py                  # build gixl (release), 2 alternating rounds
    sudo python3 scripts/bench_tcp.py --rounds 1 --iters 10 --no-nixl
    sudo python3 scripts/bench_tcp.py --no-nixl --no-build --gixl-bin before=/tmp/tcp_peer_old --gixl-bin after=target/release/examples/tcp_peer

Two "hosts" are network namespaces joined by a veth pair (192.0.2.1 and 192.0.2.2, TEST-NET-1, which never
leaves them); everything is deleted at the end. On that one link, in the same run:

- READ bandwidth of one 64 MiB block and of 1024 × 16 KiB blocks (remote blocks in reversed order, so
  nothing can merge), WRITE of 64 MiB (the initiator polls each for 100 µs, then after naps growing from
  50 µs to a fiftieth of the time so far, so that it does not take one of the two cores from the transfer:
  the raw program blocks in recv(2)), and 4 KiB READ latency (post to DONE, polled in a tight loop, median and p99 of 1000),
  initiator in one namespace, target in the other: gixl (`examples/tcp_peer.rs`, release build) and NIXL
  (its Python API, this same file with `--role`, UCX forced to TCP);
- raw TCP, a plain C socket program (`benches/tcp_ceiling.c`, built with cc), measured in every round: 64 MiB
  of distinct memory pulled over one connection and over four at once, and a 4 KiB ping-pong round trip
  (median, p99); the table shows the median over rounds;
- fan-in: one target, N = 1, 4, 16, 64 initiator processes, each alternating a 1024 × 16 KiB READ and a
  4 KiB READ for 3 s: aggregate KV GB/s, 4 KiB latency over all of them (median, p99), and failed requests
  (a false disconnect shows here, with the first error of each initiator that saw one); meanwhile the raw
  program's 4 KiB ping-pong between the namespaces, one a millisecond (the raw TCP column: what the load
  leaves of a round trip between two processes). The initiators share
  the cores with the target and poll as the bandwidth rows do (64 processes polling in a tight loop, or even
  every 50 µs, on 2 cores measure their own polling, not the transport);
- time from killing the target process to the initiator's REMOTE_DISCONNECT, and from cutting the link
  (`ip link set down`) to it, the initiator only polling (`hammer`).

Needs root (namespaces). NIXL runs under .venv/nixl/bin/python (scripts/setup.sh; override with --nixl-python).
"""

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20
BULK = 64 * MiB
BLOCK = 16 << 10
BLOCKS = 1024
NS = ("gixl-bench-h0", "gixl-bench-h1")
IPS = ("192.0.2.1", "192.0.2.2")


# ----------------------------------------------------------------------------------------------------------
# NIXL peer (runs under NIXL's interpreter, inside a namespace)
# ----------------------------------------------------------------------------------------------------------

def nixl_peer(role, mdfile, iters, module):
    import importlib
    import numpy as np
    api = importlib.import_module(module + "._api")
    agent = api.nixl_agent(role, api.nixl_agent_config(backends=["UCX"]))
    bulk = np.full(BULK, 0x5A if role == "target" else 0, np.uint8)
    kv = (np.arange(BLOCKS * BLOCK, dtype=np.uint64) // BLOCK).astype(np.uint8)
    agent.register_memory(agent.get_reg_descs(
        [(bulk.ctypes.data, bulk.nbytes, 0, ""), (kv.ctypes.data, kv.nbytes, 0, "")], "DRAM"))
    if role == "target":
        md = agent.get_agent_metadata()
        with open(mdfile + ".tmp", "w") as f:
            f.write(f"{md.hex()}\n{bulk.ctypes.data} {kv.ctypes.data}\n")
        os.rename(mdfile + ".tmp", mdfile)
        sys.stdin.read()  # serve until stdin closes; never call into NIXL meanwhile
        return
    with open(mdfile) as f:
        md_hex, addrs = f.read().split("\n")[:2]
    rbulk, rkv = (int(x) for x in addrs.split())
    peer = agent.add_remote_agent(bytes.fromhex(md_hex))

    def xfer(local, remote, op="READ"):
        l = agent.get_xfer_descs(local, "DRAM")
        r = agent.get_xfer_descs(remote, "DRAM")
        return agent.initialize_xfer(op, l, r, peer)

    def run(h, shared=False):
        # shared (bandwidth and fan-in: the initiator shares the target's cores): poll for 100 µs, then after
        # naps from 50 µs doubling up to a fiftieth of the time so far, as tcp_peer does.
        t = time.perf_counter()
        st = agent.transfer(h)
        nap = 50e-6
        while st == "PROC":
            if shared and time.perf_counter() - t > 100e-6:
                time.sleep(nap)
                nap = max(50e-6, min(nap * 2, (time.perf_counter() - t) / 50))
            st = agent.check_xfer_state(h)
        if st != "DONE":
            raise RuntimeError(f"transfer state {st}")
        return time.perf_counter() - t

    if role == "hammer":
        h = xfer([(bulk.ctypes.data, 32 * MiB, 0)], [(rbulk, 32 * MiB, 0)])
        started = False
        while True:
            try:
                run(h)
            except Exception as e:  # noqa: BLE001 - any failure ends the hammer
                print(f"@failed {type(e).__name__}:{str(e).split()[0] if str(e) else ''} {time.monotonic_ns()}",
                      flush=True)
                return
            if not started:
                started = True
                print("@started", flush=True)

    if role == "fanin":
        small = xfer([(bulk.ctypes.data, 4096, 0)], [(rbulk, 4096, 0)])
        kv_f = xfer([(kv.ctypes.data + i * BLOCK, BLOCK, 0) for i in range(BLOCKS)],
                    [(rkv + i * BLOCK, BLOCK, 0) for i in reversed(range(BLOCKS))])
        run(small)
        print("@ready", flush=True)
        sys.stdin.readline()
        nbytes, lat, failures = 0, [], {}
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < iters:
            for h, is_kv in ((kv_f, True), (small, False)):
                try:
                    dt = run(h, shared=True)
                except Exception as e:  # noqa: BLE001 - counted, as gixl's peer does
                    failures[type(e).__name__] = failures.get(type(e).__name__, 0) + 1
                    continue
                if is_kv:
                    nbytes += BLOCKS * BLOCK
                else:
                    lat.append(round(dt * 1e6, 1))
        print(json.dumps(dict(bytes=nbytes, secs=time.perf_counter() - t0, lat_us=lat, failures=failures)), flush=True)
        return

    bulk_h = xfer([(bulk.ctypes.data, BULK, 0)], [(rbulk, BULK, 0)])
    kv_h = xfer([(kv.ctypes.data + i * BLOCK, BLOCK, 0) for i in range(BLOCKS)],
                [(rkv + i * BLOCK, BLOCK, 0) for i in reversed(range(BLOCKS))])

    def measure(h, nbytes):
        for _ in range(2):
            run(h, shared=True)
        times = [run(h, shared=True) for _ in range(iters)]
        gbps = sorted(nbytes / t / 1e9 for t in times)
        return gbps[len(gbps) // 2], nbytes * iters / sum(times) / 1e9

    bm, ba = measure(bulk_h, BULK)
    km, ka = measure(kv_h, BLOCKS * BLOCK)
    assert (bulk == 0x5A).all()
    assert all(kv[i * BLOCK] == (BLOCKS - 1 - i) % 256 for i in range(BLOCKS))
    wm, wa = measure(xfer([(bulk.ctypes.data, BULK, 0)], [(rbulk, BULK, 0)], "WRITE"), BULK)
    small = xfer([(bulk.ctypes.data, 4096, 0)], [(rbulk, 4096, 0)])
    for _ in range(50):
        run(small)
    us = sorted(run(small) * 1e6 for _ in range(1000))
    print(json.dumps(dict(bulk_median_gbps=bm, bulk_gbps=ba, kv_median_gbps=km, kv_gbps=ka, write_median_gbps=wm,
                          write_gbps=wa, lat_median_us=us[500], lat_p99_us=us[990])), flush=True)


# ----------------------------------------------------------------------------------------------------------
# Orchestrator
# ----------------------------------------------------------------------------------------------------------

def sh(*args, check=True):
    return subprocess.run(args, check=check, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


class Link:
    """Two namespaces and the veth pair between them."""

    def __enter__(self):
        self.down()
        for ns in NS:
            sh("ip", "netns", "add", ns)
        sh("ip", "-n", NS[0], "link", "add", "eth0", "type", "veth", "peer", "name", "eth0", "netns", NS[1])
        for ns, ip in zip(NS, IPS):
            sh("ip", "-n", ns, "addr", "add", ip + "/24", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "eth0", "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        time.sleep(0.2)
        return self

    def set(self, up):
        sh("ip", "-n", NS[0], "link", "set", "eth0", "up" if up else "down")

    def down(self):
        for ns in NS:
            sh("ip", "netns", "del", ns, check=False)

    def __exit__(self, *exc):
        self.down()


def netns(i, *cmd):
    return ["ip", "netns", "exec", NS[i], *cmd]


class Impl:
    def __init__(self, name, cmd, env):
        self.name, self.cmd, self.env = name, cmd, env

    def peer(self, i, role, mdfile, iters=0, **kw):
        return subprocess.Popen(netns(i, *self.cmd(role, mdfile, iters)), env=self.env, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, **kw)


def wait_file(path, proc, timeout=60):
    t = time.monotonic()
    while not os.path.exists(path):
        if proc.poll() is not None:
            raise RuntimeError(f"target exited with {proc.returncode}")
        if time.monotonic() - t > timeout:
            raise RuntimeError("target did not write its metadata")
        time.sleep(0.02)


def bandwidth(impl, iters, tmp):
    md = os.path.join(tmp, f"{impl.name}-md")
    if os.path.exists(md):
        os.remove(md)
    target = impl.peer(0, "target", md)
    try:
        wait_file(md, target)
        ini = impl.peer(1, "initiator", md, iters)
        out, _ = ini.communicate(timeout=600)
        if ini.returncode != 0:
            raise RuntimeError(f"initiator failed ({ini.returncode})")
        return json.loads(out.strip().splitlines()[-1])
    finally:
        target.stdin.close()
        target.wait(timeout=30)


FANIN = (1, 4, 16, 64)
FANIN_SECS = 3


def fanin(impl, n, tmp):
    """One target, `n` initiators (each its own process) alternating a KV READ (1024 × 16 KiB) and a 4 KiB READ
    for FANIN_SECS: aggregate KV GB/s, 4 KiB latency over all initiators, and failures (false disconnects); beside
    them, the raw program's 4 KiB ping-pong between the two namespaces, one round trip a millisecond (what the
    machine's load leaves of the round trip)."""
    md = os.path.join(tmp, f"{impl.name}-md-fanin")
    if os.path.exists(md):
        os.remove(md)
    target = impl.peer(0, "target", md)
    inis = []
    exe = raw_exe(tmp)
    srv = subprocess.Popen(netns(0, exe, "server", IPS[0], str(RAW_PORT + 1)), text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        if next_tagged(srv, time.monotonic() + 30) != "@ready":
            raise RuntimeError("raw TCP server did not start")
        wait_file(md, target)
        inis = [impl.peer(1, "fanin", md, FANIN_SECS) for _ in range(n)]
        for p in inis:
            if next_tagged(p, time.monotonic() + 120) != "@ready":
                raise RuntimeError("a fan-in initiator did not get ready")
        for p in inis:
            p.stdin.write("go\n")
            p.stdin.flush()
        ping = subprocess.Popen(netns(1, exe, "ping", IPS[0], str(RAW_PORT + 1), str(FANIN_SECS)), text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        res = []
        for p in inis:
            out, _ = p.communicate(timeout=FANIN_SECS * 10 + 120)
            res.append(json.loads(out.strip().splitlines()[-1]))
        raw = json.loads(ping.communicate(timeout=FANIN_SECS * 10 + 60)[0].strip().splitlines()[-1])
        lat = sorted(float(x) for r in res for x in r["lat_us"])
        return {
            "gbps": sum(r["bytes"] for r in res) / max(r["secs"] for r in res) / 1e9,
            "lat_median_us": lat[len(lat) // 2] if lat else None,
            "lat_p99_us": lat[len(lat) * 99 // 100] if lat else None,
            # Initiators that saw a failed request, and the failures by status.
            "failed_initiators": sum(1 for r in res if r["failures"]),
            "failures": {k: sum(r["failures"].get(k, 0) for r in res) for r in res for k in r["failures"]},
            # What the first failure of each initiator that saw one said (distinct messages).
            "errors": sorted({r["first_error"] for r in res if r.get("first_error")}),
            "raw_rtt_median_us": raw["rtt_median_us"],
            "raw_rtt_p99_us": raw["rtt_p99_us"],
        }
    finally:
        srv.kill()
        srv.wait()
        for p in inis:
            if p.poll() is None:
                p.kill()
                p.wait()
        target.stdin.close()
        target.wait(timeout=30)


def disconnect_time(impl, fault, link, tmp, cap=30.0):
    """Seconds from the fault to the initiator seeing the request fail (None if not within `cap`)."""
    md = os.path.join(tmp, f"{impl.name}-md-{fault}")
    if os.path.exists(md):
        os.remove(md)
    link.set(True)
    target = impl.peer(0, "target", md)
    ini = None
    try:
        wait_file(md, target)
        ini = impl.peer(1, "hammer", md)
        line = next_tagged(ini, time.monotonic() + 60)
        if not line or not line.startswith("@started"):
            raise RuntimeError(f"hammer did not start: {line!r}")
        time.sleep(0.3)
        t0 = time.monotonic_ns()
        if fault == "kill":
            target.send_signal(signal.SIGKILL)
        else:
            link.set(False)
        line = next_tagged(ini, time.monotonic() + cap)
        if not line:
            return None, "no failure within %.0f s" % cap
        f = line.split()
        return (int(f[2]) - t0) / 1e9, f[1]
    finally:
        for p in (ini, target):
            if p and p.poll() is None:
                p.kill()
                p.wait()
        link.set(True)


def next_tagged(proc, deadline):
    """The next stdout line starting with '@' (libraries may print diagnostics there), or None by `deadline`."""
    import select
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        r, _, _ = select.select([proc.stdout], [], [], left)
        if not r:
            return None
        line = proc.stdout.readline()
        if not line:
            return None
        if line.startswith("@"):
            return line.strip()


RAW_PORT = 7399


def raw_exe(tmp):
    """The raw program (benches/tcp_ceiling.c), built here with cc once per run."""
    exe = os.path.join(tmp, "tcp_ceiling")
    if not os.path.exists(exe):
        sh("cc", "-O2", "-pthread", "-o", exe, os.path.join(REPO, "benches", "tcp_ceiling.c"))
    return exe


def raw_tcp(iters, tmp):
    """The raw TCP ceiling: server in the target's namespace."""
    exe = raw_exe(tmp)
    srv = subprocess.Popen(netns(0, exe, "server", IPS[0], str(RAW_PORT)), text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        if next_tagged(srv, time.monotonic() + 30) != "@ready":
            raise RuntimeError("raw TCP server did not start")
        out = sh(*netns(1, exe, "client", IPS[0], str(RAW_PORT), str(iters))).stdout
        return json.loads(out.strip().splitlines()[-1])
    finally:
        srv.kill()
        srv.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("--md", help=argparse.SUPPRESS)
    ap.add_argument("--module", default="nixl_cu12")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--faults", type=int, default=3, help="repetitions of each fault")
    ap.add_argument("--fanin", default=",".join(map(str, FANIN)), help="initiator counts of the fan-in rows ('' for none)")
    ap.add_argument("--no-nixl", action="store_true")
    ap.add_argument("--no-build", action="store_true")
    ap.add_argument("--nixl-python", default=os.path.join(REPO, ".venv", "nixl", "bin", "python"))
    ap.add_argument("--gixl-bin", action="append", default=[], metavar="NAME=PATH",
                    help="compare these tcp_peer builds (e.g. before/after a change), alternating in each round")
    a = ap.parse_args()
    if a.role:
        return nixl_peer(a.role, a.md, a.iters, a.module)

    if os.geteuid() != 0:
        sys.exit("needs root (network namespaces)")
    if not a.no_build:
        subprocess.run(["cargo", "build", "--release", "--example", "tcp_peer"], cwd=REPO, check=True)
    gixl_bin = os.path.join(REPO, "target", "release", "examples", "tcp_peer")
    env = dict(os.environ)
    bins = [b.split("=", 1) for b in a.gixl_bin] or [("gixl", gixl_bin)]
    impls = [Impl(name, lambda role, md, iters, path=os.path.abspath(path): [path, role, md, str(iters)], env)
             for name, path in bins]
    if not a.no_nixl and os.path.exists(a.nixl_python):
        nenv = dict(env, UCX_TLS="tcp", NIXL_LOG_LEVEL="ERROR")
        me = os.path.abspath(__file__)
        impls.append(Impl("nixl", lambda role, md, iters: [a.nixl_python, me, "--role", role, "--md", md,
                                                            "--iters", str(iters), "--module", a.module], nenv))
    bw = {i.name: [] for i in impls}
    faults = {(i.name, f): [] for i in impls for f in ("kill", "link-down")}
    with tempfile.TemporaryDirectory() as tmp, Link() as link:
        raws = []
        for r in range(max(a.rounds, 1)):
            for impl in impls if a.rounds else []:
                res = bandwidth(impl, a.iters, tmp)
                print(f"round {r + 1} {impl.name}: {res}", flush=True)
                bw[impl.name].append(res)
            # The ceiling in every round too, beside the same conditions.
            raws.append(raw_tcp(a.iters, tmp))
            print(f"round {r + 1} raw TCP: {raws[-1]}", flush=True)
        raw = {k: statistics.median(x[k] for x in raws) for k in raws[0]}
        fan = {}
        for n in [int(x) for x in a.fanin.split(",") if x]:
            for impl in impls:
                fan[(impl.name, n)] = r = fanin(impl, n, tmp)
                print(f"fan-in {impl.name} N={n}: {r}", flush=True)
        for _ in range(a.faults):
            for impl in impls:
                for fault in ("kill", "link-down"):
                    t, what = disconnect_time(impl, fault, link, tmp)
                    print(f"{impl.name} {fault}: {what} after {t if t is None else round(t, 4)} s", flush=True)
                    faults[(impl.name, fault)].append(t)

    def med(xs):
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None

    print("\n| figure (cross-namespace TCP, veth) | " + " | ".join(i.name for i in impls) + " | raw TCP |")
    print("|---|" + "---|" * (len(impls) + 1))
    rawbulk = f"{raw['bulk_1_gbps']:.2f} (1 connection) / {raw['bulk_4_gbps']:.2f} (4)"
    for key, label in (("bulk_gbps", "READ 64 MiB, GB/s"), ("write_gbps", "WRITE 64 MiB, GB/s"),
                       ("kv_gbps", "READ 1024 × 16 KiB, GB/s")):
        if not a.rounds:
            break
        cells = [f"{med([x[key] for x in bw[i.name]]):.2f}" for i in impls]
        print(f"| {label} | " + " | ".join(cells) + f" | {rawbulk if key != 'kv_gbps' else ''} |")
    # Each round's figure over the raw 4-connection rate of the same round, median over rounds: the VM's speed
    # moves between rounds, and both sides of a ratio are measured minutes apart at most.
    for key, label in (("bulk_gbps", "READ 64 MiB"), ("write_gbps", "WRITE 64 MiB")):
        if not a.rounds:
            break
        cells = [f"{med([x[key] / r['bulk_4_gbps'] for x, r in zip(bw[i.name], raws)]):.0%}" for i in impls]
        print(f"| {label} over raw 4 connections, median of per-round ratios | " + " | ".join(cells) + " | |")
    cells = [f"{med([x['lat_median_us'] for x in bw[i.name]]):.0f} / {med([x['lat_p99_us'] for x in bw[i.name]]):.0f}"
             if a.rounds else "—" for i in impls]
    print("| 4 KiB READ µs (median / p99); raw: 4 KiB ping-pong round trip | " + " | ".join(cells)
          + f" | {raw['rtt_median_us']:.0f} / {raw['rtt_p99_us']:.0f} |")
    for n in sorted({n for _, n in fan}):
        cells = []
        for i in impls:
            r = fan.get((i.name, n))
            cells.append("—" if r is None else f"{r['gbps']:.2f} GB/s; {r['lat_median_us']:.0f} / {r['lat_p99_us']:.0f} µs"
                         + (f"; {r['failed_initiators']} of {n} initiators saw failures" if r["failed_initiators"] else ""))
        during = [r for (_, m), r in fan.items() if m == n]
        rtt = (f"ping-pong meanwhile {med([r['raw_rtt_median_us'] for r in during]):.0f} / "
               f"{med([r['raw_rtt_p99_us'] for r in during]):.0f} µs")
        print(f"| fan-in N={n}: KV aggregate; 4 KiB READ median / p99 | " + " | ".join(cells) + f" | {rtt} |")
    for fault in ("kill", "link-down"):
        cells = []
        for i in impls:
            xs = faults[(i.name, fault)]
            m = med(xs)
            miss = sum(x is None for x in xs)
            cells.append(("%.3f s" % m if m is not None else "—") + (f" ({miss}/{len(xs)} not within 30 s)" if miss else ""))
        print(f"| {fault} → request fails (median) | " + " | ".join(cells) + " | |")


if __name__ == "__main__":
    main()
