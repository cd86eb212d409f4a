#!/usr/bin/env python3
"""Multi-process fault matrix: the same cells against gixl and the real NIXL 1.5.1.

Every agent lives in a child process (peer.py, driven over a pipe by peer_client.py); peers are killed with
SIGKILL / stopped with SIGSTOP, every child call has a timeout. A cell returns an *outcome*: the steps it ran
with the status or exception each produced, e.g. ``kill→RemoteDisconnect · reload=NotAllowed · act=RemoteDisconnect
· mem=untouched``. When a child dies on its own the outcome ends in ``crash (signal N)``; when a call does not
answer in time, ``hang (timeout)``. ``mem=`` is what the new incarnation's buffer holds afterwards
(``untouched``, ``new-write`` = exactly the blocks a *new* handle wrote, or ``CORRUPTED``).

Used two ways:
  * ``test_faults.py`` runs each cell under pytest (impl chosen with ``--impl``) and compares with ``EXPECTED``;
  * ``python python/tests/fault_matrix.py`` runs every cell against both implementations (``.venv/gixl`` with
    the installed gixl wheel, ``.venv/nixl`` with nixl-cu12 1.5.1) and prints a Markdown table.
    Options: ``--impl gixl|nixl_cu12`` (repeatable), ``--cells SUBSTR`` (repeatable), ``--race-runs N``,
    ``--big-mb N``, ``--json FILE``.

Exception names are shortened: ``NotFound`` is ``nixlNotFoundError`` and so on.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from peer_client import PeerDied, PeerError, PeerProcess  # noqa: E402

BLK = 16 * 1024
NB = 8
SMALL = NB * BLK
FIXED_VA = 0x3E0000000000  # where the same-VA prefill maps its buffer in every incarnation
BIG_MB = int(os.environ.get("GIXL_FAULT_BIG_MB", "256"))
BIG_DESCS = 4096
RACE_RUNS = int(os.environ.get("GIXL_FAULT_RACE_RUNS", "10"))

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PYTHONS = {
    "gixl": os.path.join(ROOT, ".venv", "gixl", "bin", "python"),
    "nixl_cu12": os.path.join(ROOT, ".venv", "nixl", "bin", "python"),
}


def short(exc_name) -> str:
    if exc_name is None:
        return "-"
    if exc_name.startswith("nixl") and exc_name.endswith("Error"):
        return exc_name[4:-5]
    return exc_name


def _name(prefix):
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def _rows(base, nb=NB, blk=BLK):
    return [[base, blk, 0, blk, nb]]


class Outcome:
    """The steps of one cell: ``step(label, fn)`` records fn's result or its exception's short name."""

    def __init__(self):
        self.steps = []
        self.info = {}

    def add(self, label, value):
        self.steps.append(f"{label}={value}" if label else str(value))

    def step(self, label, fn, *a, **kw):
        try:
            r = fn(*a, **kw)
        except PeerError as exc:
            self.add(label, short(exc.exc))
            return None
        self.add(label, "ok" if r is None else _fmt(r))
        return r

    def __str__(self):
        return " · ".join(self.steps)


def _fmt(r):
    if isinstance(r, list):  # states from wait(): the last one counts; PROC at the end = still running
        if r and r[-1] == "PROC":
            return "PROC (still, at the poll limit)"
        return r[-1] if r else "?"
    if isinstance(r, (bytes, int)):  # a name, or the id of a new dlist/xfer handle
        return "ok"
    return str(r)


def _post_wait(D, xid, timeout=10.0):
    """transfer + check_xfer_state until done; the final state or the exception."""
    D.post(xid=xid)
    return _wait(D, xid, timeout)


def _wait(D, xid, timeout):
    """peer.wait with its own poll limit ``timeout`` (the pipe call gets more)."""
    D.send("wait", xid=xid, timeout=timeout)
    return D.recv(timeout=timeout + 15)


def _mem(buf: bytes, fill: int, new_blocks=()):
    """Classify the new incarnation's buffer: untouched, new-write (only ``new_blocks`` hold the decode's 9s)."""
    if buf == bytes([fill]) * len(buf):
        return "untouched"
    exp = bytearray([fill]) * len(buf)
    for b in new_blocks:
        exp[b * BLK : (b + 1) * BLK] = b"\x09" * BLK
    return "new-write" if bytes(exp) == buf else "CORRUPTED"


def _until_error(D, xid, seconds=10.0):
    """Repost ``xid`` until the dead peer surfaces; (short name, seconds). DONE each time = never noticed."""
    t0 = time.monotonic()
    last = None
    while time.monotonic() - t0 < seconds:
        try:
            last = _fmt(_post_wait(D, xid, timeout=seconds))
        except PeerError as exc:
            return short(exc.exc), time.monotonic() - t0
        if last != "DONE":
            return last, time.monotonic() - t0
        time.sleep(0.05)
    return f"{last} (no error in {seconds:.0f} s)", time.monotonic() - t0


# ---------------------------------------------------------------------------------------------------------------
# cells


def prefill_restart(spawn, va, reload, act):
    """Decode pulls from prefill; prefill SIGKILLed and restarted under the same name.

    va: "new" (new buffer address) | "same" (both incarnations map their buffer at FIXED_VA).
    reload: "readd" (add_remote_agent(new md) without remove) | "remove_readd" | "none".
    act: "repost_old" (post the old WRITE handle) | "make_old_dlist" (make a WRITE from the old remote prepped
    dlist) | "all_new" (prep the new address on the peer's name, make, post).
    """
    o = Outcome()
    pname = _name("prefill")
    fixed = FIXED_VA if va == "same" else 0
    P1, D = spawn("prefill1"), spawn("decode")
    P1.send("init", name=pname, size=SMALL, fill="1", fixed_addr=fixed)
    D.send("init", name=_name("decode"), size=SMALL, fill="9")
    p1, d = P1.recv(), D.recv()
    name = D.add_remote(md=p1["md"])
    local = D.prep(side="", rows=_rows(d["addr"]))
    remote = D.prep(side=name, rows=_rows(p1["addr"]))
    w = D.make(op="WRITE", lh=local, lidx=[0, 1], rh=remote, ridx=[2, 3])
    assert _fmt(_post_wait(D, w)) == "DONE", "baseline WRITE failed"
    P1.kill()
    err, _ = _until_error(D, w, seconds=5)
    o.add("kill", err)
    P2 = spawn("prefill2")
    p2 = P2.init(name=pname, size=SMALL, fill="7", fixed_addr=fixed)
    o.info["same_va"] = p2["addr"] == p1["addr"]
    if reload == "readd":
        o.step("readd", D.add_remote, md=p2["md"])
    elif reload == "remove_readd":
        o.step("remove", D.remove_remote, name=name)
        o.step("add", D.add_remote, md=p2["md"])
    new_blocks = ()
    if act == "repost_old":
        o.step("repost", _post_wait, D, w)
    elif act == "make_old_dlist":
        x = o.step("make", D.make, op="WRITE", lh=local, lidx=[0, 1], rh=remote, ridx=[4, 5])
        if x is not None:
            o.step("post", _post_wait, D, x)
    else:
        r2 = o.step("prep", D.prep, side=name, rows=_rows(p2["addr"]))
        if r2 is not None:
            x = o.step("make", D.make, op="WRITE", lh=local, lidx=[0, 1], rh=r2, ridx=[2, 3])
            if x is not None:
                o.step("post", _post_wait, D, x)
                new_blocks = (2, 3)
    o.add("mem", _mem(P2.read_buf(), 7, new_blocks))
    return o


def decode_restart(spawn):
    """Reverse direction (push, as SGLang): the prefill WRITEs into the decode; the decode is SIGKILLed and
    restarted under the same name while the prefill lives; the prefill removes and re-adds it, reposts its old
    handle, then builds new ones."""
    o = Outcome()
    dname = _name("decode")
    D1, P = spawn("decode1"), spawn("prefill")
    D1.send("init", name=dname, size=SMALL, fill="0")
    P.send("init", name=_name("prefill"), size=SMALL, fill="9")
    d1, p = D1.recv(), P.recv()
    name = P.add_remote(md=d1["md"])
    local = P.prep(side="", rows=_rows(p["addr"]))
    remote = P.prep(side=name, rows=_rows(d1["addr"]))
    w = P.make(op="WRITE", lh=local, lidx=[0], rh=remote, ridx=[1])
    assert _fmt(_post_wait(P, w)) == "DONE", "baseline WRITE failed"
    D1.kill()
    err, _ = _until_error(P, w, seconds=5)
    o.add("kill", err)
    o.step("notif", P.send_notif, name=name, msg=b"HB:x")
    D2 = spawn("decode2")
    d2 = D2.init(name=dname, size=SMALL, fill="0")
    o.step("remove", P.remove_remote, name=name)
    o.step("add", P.add_remote, md=d2["md"])
    o.step("repost_old", _post_wait, P, w)
    o.step("make_old_dlist", P.make, op="WRITE", lh=local, lidx=[0], rh=remote, ridx=[2])
    r2 = P.prep(side=name, rows=_rows(d2["addr"]))
    x = P.make(op="WRITE", lh=local, lidx=[0, 1], rh=r2, ridx=[2, 3])
    o.step("new", _post_wait, P, x)
    o.add("mem", _mem(D2.read_buf(), 0, (2, 3)))
    return o


def kill_in_flight(spawn, op, big_mb=None, delay=0.002):
    """A big READ or WRITE (big_mb MiB in BIG_DESCS descriptors) is posted while a thread in the decode
    SIGKILLs the prefill ``delay`` s later (inside transfer() when the implementation copies inline); the decode
    polls. Outcome: post status or exception, final state or exception, seconds from the kill to the answer."""
    big = (big_mb or BIG_MB) * 1024 * 1024
    blk = big // BIG_DESCS
    o = Outcome()
    P, D = spawn("prefill"), spawn("decode")
    P.send("init", name=_name("prefill"), size=big, fill="3")
    D.send("init", name=_name("decode"), size=big, fill="0")
    p, d = P.recv(timeout=60), D.recv(timeout=60)
    name = D.add_remote(md=p["md"])
    local = D.prep(side="", rows=_rows(d["addr"], BIG_DESCS, blk))
    remote = D.prep(side=name, rows=_rows(p["addr"], BIG_DESCS, blk))
    idx = list(range(BIG_DESCS))
    x = D.make(op=op, lh=local, lidx=idx, rh=remote, ridx=idx)
    r = D.call("kill_during_xfer", timeout=60, xid=x, pid=p["pid"], delay=delay)
    P.kill()
    o.add("post", short(r["post"]))
    if r["final"] is not None:
        o.add("final", short(r["final"]))
    o.info["seconds"] = round(r["s"], 3)
    o.add("bounded", "yes" if r["s"] < 10 else f"NO ({r['s']:.1f} s)")
    err, _ = _until_error(D, x, seconds=5)
    o.add("repost", err)
    o.step("decode_alive", D.md)
    return o


def remove_during_xfer(spawn, runs=None, big_mb=64):
    """remove_remote_agent from a second thread while a READ (big_mb MiB, 1024 descriptors) is in flight, in
    ``runs`` fresh decode processes against one prefill. Outcome: counts of each distinct result."""
    runs = runs or RACE_RUNS
    big = big_mb * 1024 * 1024
    n = 1024
    P = spawn("prefill")
    p = P.init(name=_name("prefill"), size=big, fill="3", timeout=60)
    counts = {}
    for i in range(runs):
        D = spawn(f"decode{i}")
        try:
            d = D.init(name=_name("decode"), size=big, fill="0", timeout=60)
            name = D.add_remote(md=p["md"])
            local = D.prep(side="", rows=_rows(d["addr"], n, big // n))
            remote = D.prep(side=name, rows=_rows(p["addr"], n, big // n))
            x = D.make(op="READ", lh=local, lidx=list(range(n)), rh=remote, ridx=list(range(n)))
            r = D.call("remove_during_xfer", timeout=30, xid=x, name=name, delay=(0, 0.001, 0.003, 0.01)[i % 4])
            key = f"post={short(r['post'])} remove={short(r['remove'])} poll={short(r['poll'])}"
            # the agent must still work afterwards
            D.add_remote(md=p["md"])
        except PeerDied as exc:
            key = f"crash (signal {-exc.rc})" if exc.rc and exc.rc < 0 else f"exit {exc.rc}"
        except TimeoutError:
            key = "hang (timeout)"
        finally:
            D.close()
        counts[key] = counts.get(key, 0) + 1
    o = Outcome()
    for k, v in sorted(counts.items(), key=lambda kv: -kv[1]):
        o.add("", f"{v}/{runs}: {k}")
    o.info["counts"] = counts
    return o


def add_remove_storm(spawn, threads=4, iters=100, sync_mode=None):
    """Several threads add_remote_agent/remove_remote_agent the same live peer; then one clean add + READ.
    sync_mode: None (the default, as vLLM) or e.g. "NIXL_THREAD_SYNC_STRICT" (as SGLang/LMCache)."""
    o = Outcome()
    P, D = spawn("prefill"), spawn("decode")
    P.send("init", name=_name("prefill"), size=SMALL, fill="5")
    D.send("init", name=_name("decode"), size=SMALL, fill="0", sync_mode=sync_mode)
    p, d = P.recv(), D.recv()
    counts = D.call("add_remove_storm", timeout=120, md=p["md"], name=p["name"], threads=threads, iters=iters)
    o.info["counts"] = counts
    o.add("storm", "hang" if "hang" in counts else "survived")
    kinds = sorted({short(k.split(":", 1)[1]) for k in counts if ":" in k} - {"ok"})
    o.add("errors", "+".join(kinds) or "none")
    name = D.add_remote(md=p["md"])
    local = D.prep(side="", rows=_rows(d["addr"]))
    remote = D.prep(side=name, rows=_rows(p["addr"]))
    x = D.make(op="READ", lh=local, lidx=[0], rh=remote, ridx=[1])
    o.step("after", _post_wait, D, x)
    return o


def passive_target(spawn):
    """The prefill never calls into the library after start-up: READ, WRITE, a notification queued for it;
    then it is SIGKILLed and the decode must see it."""
    o = Outcome()
    P, D = spawn("prefill"), spawn("decode")
    P.send("init", name=_name("prefill"), size=SMALL, fill="5")
    D.send("init", name=_name("decode"), size=SMALL, fill="0")
    p, d = P.recv(), D.recv()
    name = D.add_remote(md=p["md"])
    local = D.prep(side="", rows=_rows(d["addr"]))
    remote = D.prep(side=name, rows=_rows(p["addr"]))
    r = D.make(op="READ", lh=local, lidx=[0, 1], rh=remote, ridx=[0, 1], notif=b"passive-1")
    w = D.make(op="WRITE", lh=local, lidx=[0], rh=remote, ridx=[7])
    time.sleep(1.0)  # let any progress machinery go idle
    o.step("read", _post_wait, D, r)
    o.step("write", _post_wait, D, w)
    got = P.notifs(count=1, timeout=5)
    o.add("notif", "delivered" if got == {d["name"]: [b"passive-1"]} else f"got {got!r}")
    P.kill()
    err, secs = _until_error(D, r, seconds=10)
    o.add("kill", err)
    o.info["detect_s"] = round(secs, 3)
    return o


def sigstopped_target(spawn):
    """The prefill is SIGSTOPped: READ, WRITE and a notification to it; SIGCONT; then SIGSTOP + SIGKILL."""
    o = Outcome()
    P, D = spawn("prefill"), spawn("decode")
    P.send("init", name=_name("prefill"), size=SMALL, fill="5")
    D.send("init", name=_name("decode"), size=SMALL, fill="0")
    p, d = P.recv(), D.recv()
    name = D.add_remote(md=p["md"])
    local = D.prep(side="", rows=_rows(d["addr"]))
    remote = D.prep(side=name, rows=_rows(p["addr"]))
    r = D.make(op="READ", lh=local, lidx=[0, 1], rh=remote, ridx=[0, 1])
    w = D.make(op="WRITE", lh=local, lidx=[2], rh=remote, ridx=[7])
    os.kill(p["pid"], signal.SIGSTOP)
    try:
        o.step("read", _post_wait, D, r, timeout=5)
        o.step("write", _post_wait, D, w, timeout=5)
        o.step("notif", D.send_notif, name=name, msg=b"while-stopped")
    finally:
        os.kill(p["pid"], signal.SIGCONT)
    # whatever was still in progress must finish once the target runs again
    o.step("read_after_cont", _wait, D, r, 10)
    o.step("write_after_cont", _wait, D, w, 10)
    got = P.notifs(count=1, timeout=5)
    o.add("after_cont", "delivered" if got == {d["name"]: [b"while-stopped"]} else f"got {got!r}")
    os.kill(p["pid"], signal.SIGSTOP)
    P.kill()
    err, secs = _until_error(D, r, seconds=10)
    o.add("kill_stopped", err)
    o.info["detect_s"] = round(secs, 3)
    return o


def _cells():
    cells = {}
    for va in ("new", "same"):
        for reload in ("readd", "remove_readd", "none"):
            for act in ("repost_old", "make_old_dlist", "all_new"):
                cells[f"prefill_restart[{va}_va,{reload},{act}]"] = (
                    lambda spawn, va=va, reload=reload, act=act: prefill_restart(spawn, va, reload, act)
                )
    cells["decode_restart"] = decode_restart
    cells["kill_during_read"] = lambda spawn: kill_in_flight(spawn, "READ")
    cells["kill_during_write"] = lambda spawn: kill_in_flight(spawn, "WRITE")
    cells["remove_during_xfer"] = remove_during_xfer
    cells["add_remove_storm[default_sync]"] = add_remove_storm
    cells["add_remove_storm[strict]"] = lambda spawn: add_remove_storm(spawn, sync_mode="NIXL_THREAD_SYNC_STRICT")
    cells["passive_target"] = passive_target
    cells["sigstopped_target"] = sigstopped_target
    return cells


CELLS = _cells()


def run_cell(name, spawn) -> Outcome:
    """Run one cell; a child that dies on its own or stops answering ends the outcome with crash/hang."""
    fn = CELLS[name]
    try:
        return fn(spawn)
    except PeerDied as exc:
        o = Outcome()
        o.add("", f"crash (signal {-exc.rc})" if exc.rc is not None and exc.rc < 0 else f"exit {exc.rc}")
        o.info["log"] = str(exc)[-2000:]
        return o
    except TimeoutError as exc:
        o = Outcome()
        o.add("", "hang (timeout)")
        o.info["log"] = str(exc)[-2000:]
        return o


# ---------------------------------------------------------------------------------------------------------------
# command line: both implementations, Markdown table


def _spawner(impl, tmp):
    procs = []
    env = {"GIXL_TEST_INSTALLED": "1"} if impl == "gixl" else {}
    bindings = "native" if impl == "gixl" else impl

    def spawn(label):
        p = PeerProcess(label, impl, bindings, tmp, python=PYTHONS[impl], env=env)
        procs.append(p)
        return p

    return spawn, procs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impl", action="append", choices=list(PYTHONS))
    ap.add_argument("--cells", action="append", help="run only cells whose name contains this")
    ap.add_argument("--race-runs", type=int, default=None)
    ap.add_argument("--big-mb", type=int, default=None)
    ap.add_argument("--json", help="also write the outcomes here")
    args = ap.parse_args(argv)
    global RACE_RUNS, BIG_MB
    if args.race_runs:
        RACE_RUNS = args.race_runs
    if args.big_mb:
        BIG_MB = args.big_mb
    impls = args.impl or list(PYTHONS)
    names = [n for n in CELLS if not args.cells or any(c in n for c in args.cells)]
    results = {}
    with tempfile.TemporaryDirectory(prefix="gixl-faults-") as tmp:
        for impl in impls:
            for name in names:
                spawn, procs = _spawner(impl, tmp)
                t0 = time.monotonic()
                try:
                    o = run_cell(name, spawn)
                finally:
                    for p in procs:
                        p.close()
                dt = time.monotonic() - t0
                results.setdefault(name, {})[impl] = {"outcome": str(o), "info": o.info, "s": round(dt, 1)}
                print(f"# {impl:9s} {name}: {o} ({dt:.1f} s) {json.dumps(o.info)[:200]}", file=sys.stderr, flush=True)
    print(f"\nFault matrix (big transfers: {BIG_MB} MiB in {BIG_DESCS} descriptors; "
          f"remove race: {RACE_RUNS} runs)\n")
    print("| cell | " + " | ".join(impls) + " |")
    print("|---|" + "---|" * len(impls))
    for name in names:
        row = [results[name][i]["outcome"].replace("|", "/") for i in impls]
        print(f"| {name} | " + " | ".join(row) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
