#!/usr/bin/env python3
"""gixl vs NVIDIA NIXL, side by side, measured in the same run on this machine.

    python3 benches/side_by_side.py                 # both implementations, 3 alternating rounds
    python3 benches/side_by_side.py --quick         # CI smoke: fewer iterations, about 2 min for both
    python3 benches/side_by_side.py --impl nixl_cu12 --json out.json

Every figure comes from the same script driving the Python `nixl._api` surface, so the very same calls run
on both implementations; only the interpreter and the imported module differ (`nixl` for gixl, `nixl_cu12`
for NIXL). Each round starts two real processes per implementation, the vLLM pattern: a prefill *target*
that owns the KV memory, and a decode *initiator* that loads the target's metadata (passed over a pipe) and
moves data. A third short-lived process measures an idle agent. Rounds alternate between implementations so
that drifting machine load hits both alike. See benches/README.md for what each figure means.

This file is also the child program: `--role target|initiator|idle` (internal) runs one side under the
implementation's interpreter. The orchestrator itself needs only the standard library.
"""

import argparse
import json
import math
import os
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

KiB = 1024
MiB = 1024 * KiB
BULK_BYTES = 64 * MiB
BLOCK = 16 * KiB
KV_BLOCKS = 16384  # 256 MiB of KV cache
KV_BYTES = BLOCK * KV_BLOCKS
PER_REQ = 1024  # blocks per KV request (16 MiB)
SMALL_BYTES = 64 * KiB  # latency / notification buffer
SMALL_XFER = 4 * KiB
CTL_REGIONS = 1000
# Production-shaped planning (vLLM's per-block N x 3 lists: one entry per block x layer x K/V).
PLAN_ENTRY = 64  # bytes per prepped entry
PLAN_REGIONS = 64  # layer x K/V regions; the list is region-major (every block of a region, then the next)
PLAN_SIZES = (1 << 14, 1 << 17, 1 << 20)  # entries per prepped list
PLAN_COUNTS = (1024, 16384, 131072)  # random int64 indices per request
PLAN_BYTES = PLAN_ENTRY * max(PLAN_SIZES)  # 64 MiB each side
COLD_BYTES = 64 * MiB  # written between requests for the "cold" figures (L3 here: 32 MiB)

# XOR keys of the verification patterns (each 8-byte word holds its word index XOR the key).
KEY_BULK_READ = 0x1111_0000_0000_0001
KEY_BULK_WRITE = 0x2222_0000_0000_0002
KEY_KV_READ = 0x3333_0000_0000_0003
KEY_KV_WRITE = 0x4444_0000_0000_0004

SCENARIOS = ("bulk", "kv", "plan", "latency", "notif", "control", "idle")

# Iteration counts per round. Samples are pooled over rounds.
# plan_*: iterations of a 1024-index cell; larger requests run fewer (divided by sqrt(indices / 1024)).
FULL = dict(rounds=3, bulk_warmup=3, bulk_iters=20, kv_warmup=3, kv_read=100, kv_write=50, kv_make=2000,
            lat_warmup=200, lat_iters=10000, notif_iters=1000, ctl_reps=3, ctl_agents=5, idle_secs=3.0,
            plan_warm=100, plan_cold=20, plan_e2e=20, plan_preps=7, timeout=300.0)
QUICK = dict(rounds=1, bulk_warmup=1, bulk_iters=5, kv_warmup=1, kv_read=10, kv_write=5, kv_make=200,
             lat_warmup=50, lat_iters=1000, notif_iters=100, ctl_reps=2, ctl_agents=2, idle_secs=1.0,
             plan_warm=20, plan_cold=4, plan_e2e=4, plan_preps=3, timeout=150.0)


# ----------------------------------------------------------------------------------------------------------
# Shared helpers (orchestrator and children)
# ----------------------------------------------------------------------------------------------------------

class Chan:
    """JSON lines over a pair of pipe fds, with timeouts (select) so that no side waits forever."""

    def __init__(self, rfd, wfd):
        self.r, self.w, self.buf = rfd, wfd, b""

    def send(self, **msg):
        data = (json.dumps(msg, separators=(",", ":")) + "\n").encode()
        view = memoryview(data)
        while view:
            n = os.write(self.w, view)
            view = view[n:]

    def ready(self):
        """Whether a message can be read without blocking."""
        if b"\n" in self.buf:
            return True
        r, _, _ = select.select([self.r], [], [], 0)
        return bool(r)

    def recv(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            r, _, _ = select.select([self.r], [], [], left)
            if not r:
                raise TimeoutError(f"peer sent nothing within {timeout} s")
            chunk = os.read(self.r, 1 << 20)
            if not chunk:
                raise EOFError("peer closed the pipe")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)


def proc_ticks(pid="self"):
    """utime + stime of the whole process (all threads), in clock ticks."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5), counted after "(comm)"


def proc_status(key, pid="self"):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return None


def thread_ticks():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                head, rest = f.read().rsplit(")", 1)
            fields = rest.split()
            out[tid] = (head.split("(", 1)[1], int(fields[11]) + int(fields[12]))
        except (OSError, IndexError, ValueError):
            pass
    return out


def measure_idle(secs):
    """CPU (cores) and VmRSS of this process while its main thread sleeps for `secs`; busy threads named."""
    tck = os.sysconf("SC_CLK_TCK")
    th0 = thread_ticks()
    t0, w0 = proc_ticks(), time.monotonic()
    time.sleep(secs)
    t1, w1 = proc_ticks(), time.monotonic()
    th1 = thread_ticks()
    busy = {}
    for tid, (comm, ticks) in th1.items():
        d = ticks - th0.get(tid, (comm, 0))[1]
        if d > 0:
            busy[f"{comm}/{tid}"] = round(d / tck / (w1 - w0), 3)
    return dict(cores=(t1 - t0) / tck / (w1 - w0), secs=w1 - w0, ticks=t1 - t0, clk_tck=tck,
                rss_kb=proc_status("VmRSS"), threads=len(th1), busy_threads=busy)


def heap_in_use():
    """Bytes allocated from glibc's malloc right now (all arenas, mmapped chunks included)."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(f, ctypes.c_size_t) for f in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                    "fsmblks", "uordblks", "fordblks", "keepcost")]
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    m = libc.mallinfo2()
    return m.uordblks + m.hblkhd


def percentile(sorted_vals, q):
    """Nearest-rank percentile of an already sorted list."""
    if not sorted_vals:
        return None
    k = max(0, min(len(sorted_vals) - 1, math.ceil(q / 100.0 * len(sorted_vals)) - 1))
    return sorted_vals[k]


def summarize(vals):
    s = sorted(vals)
    if not s:
        return None
    return dict(n=len(s), median=percentile(s, 50), p99=percentile(s, 99), min=s[0], max=s[-1],
                mean=sum(s) / len(s))


# ----------------------------------------------------------------------------------------------------------
# Children: run under the implementation's interpreter (numpy and the implementation importable)
# ----------------------------------------------------------------------------------------------------------

def load_api(module):
    import importlib
    return importlib.import_module(f"{module}._api")


def fill_pattern(np, buf, key, first_word=0):
    """Write word i := (first_word + i) ^ key into `buf` (a uint8 array), 8 MiB at a time."""
    words = buf.view(np.uint64)
    step = 1 << 20
    for s in range(0, words.size, step):
        e = min(words.size, s + step)
        chunk = words[s:e]
        chunk[:] = np.arange(first_word + s, first_word + e, dtype=np.uint64)
        chunk ^= np.uint64(key)


def check_pattern(np, buf, key):
    words = buf.view(np.uint64)
    step = 1 << 20
    for s in range(0, words.size, step):
        e = min(words.size, s + step)
        exp = np.arange(s, e, dtype=np.uint64)
        exp ^= np.uint64(key)
        if not np.array_equal(words[s:e], exp):
            return False
    return True


def check_blocks(np, kv, key, blocks, src_blocks):
    """Block blocks[j] of `kv` must hold the pattern (key) of block src_blocks[j]."""
    per = BLOCK // 8
    got = kv.view(np.uint64).reshape(KV_BLOCKS, per)[np.asarray(blocks, dtype=np.int64)]
    exp = (np.asarray(src_blocks, dtype=np.uint64)[:, None] * np.uint64(per)
           + np.arange(per, dtype=np.uint64)[None, :]) ^ np.uint64(key)
    return bool(np.array_equal(got, exp))


def make_agent(api, name):
    # The vLLM default: UCX backend, progress thread on, no listener, no sync mode given.
    return api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))


def child_target(a):
    """The prefill side: owns the memory, answers the initiator's commands until the pipe closes."""
    import numpy as np
    api = load_api(a.module)
    ch = Chan(a.rfd, a.wfd)
    name = f"prefill-{uuid.uuid4().hex[:8]}"
    agent = make_agent(api, name)
    bulk = np.empty(BULK_BYTES, np.uint8)
    kv = np.empty(KV_BYTES, np.uint8)
    small = np.zeros(SMALL_BYTES, np.uint8)
    plan = np.zeros(PLAN_BYTES, np.uint8)
    fill_pattern(np, bulk, KEY_BULK_READ)
    fill_pattern(np, kv, KEY_KV_READ)
    agent.register_memory(agent.get_reg_descs(
        [(x.ctypes.data, x.nbytes, 0, "") for x in (bulk, kv, small, plan)], "DRAM"))
    md = agent.get_agent_metadata()
    ch.send(name=name, md=md.hex(), bulk=bulk.ctypes.data, kv=kv.ctypes.data, small=small.ctypes.data,
            plan=plan.ctypes.data, pid=os.getpid())
    keep = []  # control-path agents stay alive (and their memory registered) until the end
    while True:
        try:
            msg = ch.recv()
        except EOFError:
            return
        cmd = msg["cmd"]
        if cmd == "quit":
            return
        try:
            if cmd == "check_bulk":
                ch.send(ok=check_pattern(np, bulk, msg["key"]))
            elif cmd == "check_kv":
                ch.send(ok=check_blocks(np, kv, msg["key"], msg["blocks"], msg["src"]))
            elif cmd == "drain":
                agent.get_new_notifs()
                ch.send(ok=True)
            elif cmd == "notif_listen":
                ch.send(**notif_listen(agent, ch))
            elif cmd == "ctl_prepare":
                ch.send(**ctl_prepare(np, api, msg["n"], msg["reps"], keep))
            elif cmd == "idle":
                ch.send(**measure_idle(msg["secs"]))
            else:
                ch.send(error=f"unknown command {cmd!r}")
        except Exception as e:  # report to the initiator, keep serving
            ch.send(error=f"target: {type(e).__name__}: {e}")


def notif_listen(agent, ch):
    """Poll get_new_notifs in a tight loop; ack each timestamped notification; stop on the next command."""
    get, mono = agent.get_new_notifs, time.monotonic_ns
    lat, other = [], 0
    next_check = 0
    ch.send(listening=True)
    while True:
        notifs = get()
        now = mono()
        if notifs:
            for msgs in notifs.values():
                for m in msgs:
                    if m[:1] == b"T":
                        seq, sent = m[1:].split(b":")
                        lat.append(now - int(sent))
                        ch.send(ack=int(seq))
                    else:
                        other += 1
        elif now >= next_check:  # look at the pipe once a millisecond, not on every poll
            next_check = now + 1_000_000
            if ch.ready():
                ch.recv()  # "stop"
                return dict(lat_ns=lat, other=other)


def ctl_prepare(np, api, n, reps, keep):
    """A fresh agent with n separate regions: time register_memory, return its metadata."""
    ctl = make_agent(api, f"prefill-ctl-{uuid.uuid4().hex[:8]}")
    buf = np.zeros(n * 2 * SMALL_XFER, np.uint8)  # 4 KiB regions with 4 KiB gaps: nothing can merge
    base = buf.ctypes.data
    tuples = [(base + i * 2 * SMALL_XFER, SMALL_XFER, 0, "") for i in range(n)]
    descs_s, reg_s = [], []
    for r in range(reps):
        t0 = time.perf_counter()
        descs = ctl.get_reg_descs(tuples, "DRAM")
        t1 = time.perf_counter()
        ctl.register_memory(descs)
        t2 = time.perf_counter()
        descs_s.append(t1 - t0)
        reg_s.append(t2 - t1)
        if r < reps - 1:
            ctl.deregister_memory(descs)
    md = ctl.get_agent_metadata()
    keep.append((ctl, buf, descs))
    return dict(md=md.hex(), addr0=base, get_reg_descs_s=descs_s, register_s=reg_s)


def child_idle(a):
    """A fresh process with one agent (UCX backend, 64 KiB registered): RSS growth and idle CPU."""
    import numpy as np
    out = dict(rss_base_kb=proc_status("VmRSS"))
    t0 = time.perf_counter()
    api = load_api(a.module)
    out["import_s"] = time.perf_counter() - t0
    out["rss_after_import_kb"] = proc_status("VmRSS")
    t0 = time.perf_counter()
    agent = make_agent(api, f"idle-{uuid.uuid4().hex[:8]}")
    out["agent_create_s"] = time.perf_counter() - t0
    buf = np.zeros(SMALL_BYTES, np.uint8)
    agent.register_memory(agent.get_reg_descs([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM"))
    time.sleep(0.2)  # let start-up work settle
    idle = measure_idle(a.idle_secs)
    out.update(idle)
    out["rss_delta_kb"] = idle["rss_kb"] - out["rss_base_kb"]
    with open(a.out, "w") as f:
        json.dump(out, f)


def child_initiator(a):
    """The decode side: loads the target's metadata and runs the scenarios, writing results as it goes."""
    import numpy as np
    p = json.loads(a.params)
    res = dict(scenarios={}, errors={}, current=None)

    def save():
        tmp = a.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(res, f)
        os.replace(tmp, a.out)

    api = load_api(a.module)
    ch = Chan(a.rfd, a.wfd)
    res["current"] = "startup"
    save()
    hello = ch.recv(timeout=p["timeout"])
    agent = make_agent(api, f"decode-{uuid.uuid4().hex[:8]}")
    bulk = np.empty(BULK_BYTES, np.uint8)
    kv = np.empty(KV_BYTES, np.uint8)
    small = np.zeros(SMALL_BYTES, np.uint8)
    plan = np.ones(PLAN_BYTES, np.uint8)
    fill_pattern(np, bulk, KEY_BULK_WRITE)
    fill_pattern(np, kv, KEY_KV_WRITE)
    agent.register_memory(agent.get_reg_descs(
        [(x.ctypes.data, x.nbytes, 0, "") for x in (bulk, kv, small, plan)], "DRAM"))
    md = bytes.fromhex(hello["md"])
    t0 = time.perf_counter()
    peer = agent.add_remote_agent(md)
    res["main_md_bytes"] = len(md)
    res["main_add_remote_agent_s"] = time.perf_counter() - t0
    ctx = dict(np=np, api=api, ch=ch, agent=agent, peer=peer, hello=hello, bulk=bulk, kv=kv, small=small,
               plan=plan, p=p, tpid=hello["pid"])

    def ask(**msg):
        ch.send(**msg)
        r = ch.recv(timeout=p["timeout"])
        if "error" in r:
            raise RuntimeError(r["error"])
        return r
    ctx["ask"] = ask

    for name in p["scenarios"]:
        fn = INITIATOR_SCENARIOS.get(name)
        if fn is None:
            continue
        res["current"] = name
        save()
        t0 = time.monotonic()
        try:
            res["scenarios"][name] = fn(ctx)
            res.setdefault("scenario_s", {})[name] = time.monotonic() - t0
        except Exception as e:
            res["errors"][name] = f"{type(e).__name__}: {e}"
            res.setdefault("tracebacks", {})[name] = traceback.format_exc()
            if isinstance(e, (EOFError, TimeoutError, BrokenPipeError)):
                break  # the target is gone or stuck: nothing more can run
    res["current"] = None
    save()
    try:
        ch.send(cmd="quit")
    except OSError:
        pass


def wait_done(agent, h, st):
    chk = agent.check_xfer_state
    while st == "PROC":
        st = chk(h)
    if st != "DONE":
        raise RuntimeError(f"transfer ended in state {st}")


def sc_bulk(c):
    """One 64 MiB descriptor, READ and WRITE, reposted; GB/s per transfer."""
    np, agent, p = c["np"], c["agent"], c["p"]
    out = {}
    local = agent.get_xfer_descs([(c["bulk"].ctypes.data, BULK_BYTES, 0)], "DRAM")
    remote = agent.get_xfer_descs([(c["hello"]["bulk"], BULK_BYTES, 0)], "DRAM")
    for op in ("READ", "WRITE"):
        if op == "WRITE":
            fill_pattern(np, c["bulk"], KEY_BULK_WRITE)  # READ overwrote it
        h = agent.initialize_xfer(op, local, remote, c["peer"])
        gbps = []
        for i in range(p["bulk_warmup"] + p["bulk_iters"]):
            t0 = time.perf_counter()
            wait_done(agent, h, agent.transfer(h))
            dt = time.perf_counter() - t0
            if i == 0:  # verify once
                ok = (check_pattern(np, c["bulk"], KEY_BULK_READ) if op == "READ"
                      else c["ask"](cmd="check_bulk", key=KEY_BULK_WRITE)["ok"])
                if not ok:
                    raise RuntimeError(f"bulk {op}: data arrived wrong")
            if i >= p["bulk_warmup"]:
                gbps.append(BULK_BYTES / dt / 1e9)
        agent.release_xfer_handle(h)
        out[op] = dict(gbps=gbps)
    return out


def sc_kv(c):
    """256 MiB as 16 KiB blocks prepped once (N x 5 strided, as vLLM 0.33); requests of 1024 random blocks."""
    np, agent, p = c["np"], c["agent"], c["p"]
    rng = np.random.default_rng(12345)
    t0 = time.perf_counter()
    local = agent.prep_xfer_dlist(
        "", np.array([[c["kv"].ctypes.data, BLOCK, 0, BLOCK, KV_BLOCKS]], dtype=np.uint64), "DRAM")
    t1 = time.perf_counter()
    remote = agent.prep_xfer_dlist(
        c["peer"], np.array([[c["hello"]["kv"], BLOCK, 0, BLOCK, KV_BLOCKS]], dtype=np.uint64), "DRAM")
    t2 = time.perf_counter()
    out = dict(prep_local_s=t1 - t0, prep_remote_s=t2 - t1)
    pool = [(rng.choice(KV_BLOCKS, PER_REQ, replace=False).astype(np.int32),
             rng.choice(KV_BLOCKS, PER_REQ, replace=False).astype(np.int32)) for _ in range(64)]
    make, post, chk, rel = agent.make_prepped_xfer, agent.transfer, agent.check_xfer_state, agent.release_xfer_handle
    pc = time.perf_counter_ns

    # make_prepped_xfer alone (the handle is released outside the timed part)
    make_ns = []
    for i in range(p["kv_make"]):
        li, ri = pool[i % len(pool)]
        t0 = pc()
        h = make("READ", local, li, remote, ri)
        make_ns.append(pc() - t0)
        rel(h)
    out["make_us"] = [x / 1e3 for x in make_ns]

    for op, n, key in (("READ", p["kv_read"], KEY_KV_READ), ("WRITE", p["kv_write"], KEY_KV_WRITE)):
        if op == "WRITE":
            fill_pattern(np, c["kv"], KEY_KV_WRITE)  # READ overwrote some blocks
        gbps, mt_us, inline = [], [], 0
        for i in range(p["kv_warmup"] + n):
            li, ri = pool[(i * 7 + 3) % len(pool)]
            t0 = pc()
            h = make(op, local, li, remote, ri)
            st = post(h)
            t1 = pc()
            inline += st == "DONE"
            while st == "PROC":
                st = chk(h)
            t2 = pc()
            if st != "DONE":
                raise RuntimeError(f"kv {op}: transfer ended in state {st}")
            rel(h)
            if i == 0:
                ok = (check_blocks(np, c["kv"], key, li, ri) if op == "READ"
                      else c["ask"](cmd="check_kv", key=key, blocks=ri.tolist(), src=li.tolist())["ok"])
                if not ok:
                    raise RuntimeError(f"kv {op}: blocks arrived wrong")
            if i >= p["kv_warmup"]:
                gbps.append(PER_REQ * BLOCK / ((t2 - t0) / 1e9) / 1e9)
                mt_us.append((t1 - t0) / 1e3)
        out[op] = dict(gbps=gbps, make_transfer_us=mt_us, done_on_post=inline, posts=p["kv_warmup"] + n)
    agent.release_dlist_handle(local)
    agent.release_dlist_handle(remote)
    return out


def sc_plan(c):
    """Production-shaped planning: per-block N x 3 prepped lists of 2^14 / 2^17 / 2^20 entries of 64 B each
    side (region-major, as vLLM's NixlConnector builds them), requests of 1024 / 16384 / 131072 random int64 indices (with repetition), WRITE to the target.
    "cold": COLD_BYTES written by the initiator just before each timed call (its model ran in between)."""
    import gc
    np, agent, p, peer = c["np"], c["agent"], c["p"], c["peer"]
    rng = np.random.default_rng(4242)
    scratch = np.zeros(COLD_BYTES, np.uint8)
    make, post, chk, rel = agent.make_prepped_xfer, agent.transfer, agent.check_xfer_state, agent.release_xfer_handle
    pc, tc = time.perf_counter_ns, time.thread_time_ns
    out = {}

    def rows(base, n):
        """vLLM's per-block list: region-major, n / PLAN_REGIONS blocks per region; regions in reverse order
        in memory (so the list is PLAN_REGIONS arithmetic runs, not one)."""
        per = n // PLAN_REGIONS
        i = np.arange(n, dtype=np.uint64)
        r = np.empty((n, 3), np.uint64)
        r[:, 0] = (np.uint64(base) + (np.uint64(PLAN_REGIONS - 1) - i // np.uint64(per)) * np.uint64(per * PLAN_ENTRY)
                   + (i % np.uint64(per)) * np.uint64(PLAN_ENTRY))
        r[:, 1] = PLAN_ENTRY
        r[:, 2] = 0
        return r

    def prep(name, r):
        """prep_xfer_dlist from an N x 3 array, timed as the caller sees it (building the descriptor list
        included), `plan_preps` times (each prepped list released before the next; the last one is kept); the
        heap bytes the kept list holds (glibc's mallinfo2: in use after - before, with the descriptor list it was
        made from still alive; RSS would hide reuse of freed memory), measured outside the timed calls."""
        ms, descs_ms = [], []
        for i in range(p["plan_preps"]):
            gc.collect()
            t0 = pc()
            descs = agent.get_xfer_descs(r, "DRAM")
            t1 = pc()
            heap0, rss0 = heap_in_use(), proc_status("VmRSS")
            t2 = pc()
            h = agent.prep_xfer_dlist(name, descs, "DRAM")
            t3 = pc()
            heap1, rss1 = heap_in_use(), proc_status("VmRSS")
            del descs
            ms.append((t1 - t0 + t3 - t2) / 1e6)
            descs_ms.append((t1 - t0) / 1e6)
            if i + 1 < p["plan_preps"]:
                agent.release_dlist_handle(h)
        return h, dict(prep_ms=ms, descs_ms=descs_ms, heap_bytes=heap1 - heap0, rss_kb=rss1 - rss0)

    for n in PLAN_SIZES:
        cell = out[str(n)] = {}
        local, cell["local"] = prep("", rows(c["plan"].ctypes.data, n))
        remote, cell["remote"] = prep(peer, rows(c["hello"]["plan"], n))
        cell["bytes_per_entry"] = (cell["local"]["heap_bytes"] + cell["remote"]["heap_bytes"]) / (2 * n)
        for k in PLAN_COUNTS:
            f = math.sqrt(k / 1024)
            sets = [(rng.integers(0, n, k, dtype=np.int64), rng.integers(0, n, k, dtype=np.int64)) for _ in range(4)]
            res = cell[str(k)] = {}
            for mode in ("warm", "cold"):
                iters = max(3, int((p["plan_warm"] if mode == "warm" else p["plan_cold"]) / f))
                ns, cpu = [], []
                for i in range(iters + 2):  # 2 warm-ups
                    li, ri = sets[i % len(sets)]
                    if mode == "cold":
                        scratch.fill(i & 0xFF)
                    c0 = tc()
                    t0 = pc()
                    h = make("WRITE", local, li, remote, ri)
                    t1 = pc()
                    c1 = tc()
                    rel(h)
                    if i >= 2:
                        ns.append(t1 - t0)
                        cpu.append(c1 - c0)
                res[f"make_{mode}_us"] = [x / 1e3 for x in ns]
                res[f"make_{mode}_cpu_us"] = [x / 1e3 for x in cpu]
                iters = max(2, int(p["plan_e2e"] / f))
                ns = []
                for i in range(iters + 1):
                    li, ri = sets[i % len(sets)]
                    if mode == "cold":
                        scratch.fill(i & 0xFF)
                    t0 = pc()
                    h = make("WRITE", local, li, remote, ri)
                    st = post(h)
                    while st == "PROC":
                        st = chk(h)
                    t1 = pc()
                    if st != "DONE":
                        raise RuntimeError(f"plan {n}/{k}: transfer ended in state {st}")
                    rel(h)
                    if i >= 1:
                        ns.append(t1 - t0)
                res[f"e2e_{mode}_us"] = [x / 1e3 for x in ns]
        agent.release_dlist_handle(local)
        agent.release_dlist_handle(remote)
    return out


def sc_latency(c):
    """One 4 KiB READ / WRITE handle reposted: post -> DONE, check_xfer_state polled in a tight loop."""
    agent, p = c["agent"], c["p"]
    local = agent.get_xfer_descs([(c["small"].ctypes.data, SMALL_XFER, 0)], "DRAM")
    remote = agent.get_xfer_descs([(c["hello"]["small"], SMALL_XFER, 0)], "DRAM")
    out = {}
    for op in ("READ", "WRITE"):
        h = agent.initialize_xfer(op, local, remote, c["peer"])
        post, chk, pc = agent.transfer, agent.check_xfer_state, time.perf_counter_ns
        lat, inline = [], 0
        for i in range(p["lat_warmup"] + p["lat_iters"]):
            t0 = pc()
            st = post(h)
            inline += st == "DONE"
            while st == "PROC":
                st = chk(h)
            t1 = pc()
            if st != "DONE":
                raise RuntimeError(f"4 KiB {op}: transfer ended in state {st}")
            if i >= p["lat_warmup"]:
                lat.append((t1 - t0) / 1e3)
        # One binding round trip that does no work (a status check of a finished request): the part of each
        # post -> DONE above that no transport can remove.
        calls = []
        for i in range(p["lat_iters"]):
            t0 = pc()
            chk(h)
            calls.append((pc() - t0) / 1e3)
        agent.release_xfer_handle(h)
        out[op] = dict(us=lat, done_on_post=inline, posts=p["lat_warmup"] + p["lat_iters"], call_us=calls)
    # The bare system call against this very target buffer (benches/cma_ceiling.c --small, from this process's
    # child): what a same-host 4 KiB READ through CMA costs at least here.
    exe = p.get("cma_exe")
    if exe:
        try:
            r = subprocess.run([exe, "--small", str(SMALL_XFER), "20000", str(c["tpid"]), str(c["hello"]["small"])],
                               capture_output=True, text=True, timeout=60)
            if r.returncode == 0:
                out["READ"]["syscall_us"] = json.loads(r.stdout)["median_us"]
            else:
                out["READ"]["syscall_error"] = r.stderr.strip()[-300:]
        except (subprocess.TimeoutExpired, ValueError, KeyError) as e:
            out["READ"]["syscall_error"] = repr(e)
    return out


def sc_notif(c):
    """WRITE + notification and send_notif: send -> the target's get_new_notifs, one at a time (acked)."""
    agent, p, ch = c["agent"], c["p"], c["ch"]
    local = agent.get_xfer_descs([(c["small"].ctypes.data, SMALL_XFER, 0)], "DRAM")
    remote = agent.get_xfer_descs([(c["hello"]["small"] + SMALL_XFER, SMALL_XFER, 0)], "DRAM")
    out = {}
    mono = time.monotonic_ns
    for kind in ("write_notif", "send_notif"):
        c["ask"](cmd="drain")
        ch.send(cmd="notif_listen")
        r = ch.recv(timeout=p["timeout"])
        if "error" in r:
            raise RuntimeError(r["error"])
        h = agent.initialize_xfer("WRITE", local, remote, c["peer"], b"x") if kind == "write_notif" else None
        lost = 0
        for i in range(p["notif_iters"]):
            if kind == "write_notif":
                wait_done(agent, h, agent.transfer(h, b"T%d:%d" % (i, mono())))
            else:
                agent.send_notif(c["peer"], notif_msg=b"T%d:%d" % (i, mono()))
            try:  # wait for the target to have seen it, so notifications never queue behind each other
                while ch.recv(timeout=2.0).get("ack") != i:
                    pass
            except TimeoutError:
                lost += 1
        ch.send(cmd="stop")
        r = ch.recv(timeout=p["timeout"])
        while "ack" in r:  # late acks of lost notifications
            r = ch.recv(timeout=p["timeout"])
        if h is not None:
            agent.release_xfer_handle(h)
        out[kind] = dict(us=[x / 1e3 for x in r["lat_ns"]], lost=lost, sent=p["notif_iters"])
    return out


def sc_control(c):
    """register 1000 regions, metadata size, add_remote_agent into fresh agents, first transfer after it."""
    np, api, p = c["np"], c["api"], c["p"]
    r = c["ask"](cmd="ctl_prepare", n=CTL_REGIONS, reps=p["ctl_reps"])
    md = bytes.fromhex(r["md"])
    out = dict(md_bytes=len(md), register_ms=[x * 1e3 for x in r["register_s"]],
               get_reg_descs_ms=[x * 1e3 for x in r["get_reg_descs_s"]],
               add_ms=[], first_ms=[], second_us=[], agent_create_ms=[])
    for k in range(p["ctl_agents"]):
        t0 = time.perf_counter()
        a = make_agent(api, f"decode-ctl-{k}-{uuid.uuid4().hex[:8]}")
        out["agent_create_ms"].append((time.perf_counter() - t0) * 1e3)
        buf = np.zeros(SMALL_XFER, np.uint8)
        reg = a.get_reg_descs([(buf.ctypes.data, SMALL_XFER, 0, "")], "DRAM")
        a.register_memory(reg)
        t0 = time.perf_counter()
        name = a.add_remote_agent(md)
        out["add_ms"].append((time.perf_counter() - t0) * 1e3)
        local = a.get_xfer_descs([(buf.ctypes.data, SMALL_XFER, 0)], "DRAM")
        remote = a.get_xfer_descs([(r["addr0"], SMALL_XFER, 0)], "DRAM")
        t0 = time.perf_counter()
        h = a.initialize_xfer("READ", local, remote, name)
        wait_done(a, h, a.transfer(h))
        out["first_ms"].append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        wait_done(a, h, a.transfer(h))
        out["second_us"].append((time.perf_counter() - t0) * 1e6)
        a.release_xfer_handle(h)
        a.remove_remote_agent(name)
        a.deregister_memory(reg)
        del a
    return out


def sc_idle(c):
    """Both processes of the pair idle at once, after all the traffic above (agents connected)."""
    c["ch"].send(cmd="idle", secs=c["p"]["idle_secs"])
    mine = measure_idle(c["p"]["idle_secs"])
    theirs = c["ch"].recv(timeout=c["p"]["timeout"])
    if "error" in theirs:
        raise RuntimeError(theirs["error"])
    return dict(target=theirs, initiator=mine)


INITIATOR_SCENARIOS = dict(bulk=sc_bulk, kv=sc_kv, plan=sc_plan, latency=sc_latency, notif=sc_notif, control=sc_control,
                           idle=sc_idle)


# ----------------------------------------------------------------------------------------------------------
# Orchestrator (standard library only)
# ----------------------------------------------------------------------------------------------------------

class Impl:
    def __init__(self, key, label, python, module):
        self.key, self.label, self.python, self.module = key, label, python, module
        self.available, self.reason, self.version = False, "", ""
        self.rounds = []  # raw per-round results
        self.notes = []


def probe(impl, timeout):
    """Can this interpreter import the implementation (and numpy)? Record its version."""
    if not impl.python or not os.path.exists(impl.python):
        impl.reason = f"interpreter {impl.python or '(none)'} not found"
        if impl.key == "gixl":
            impl.reason += " (run scripts/setup.sh)"
        return
    code = ("import importlib, importlib.metadata as m, json, sys\n"
            "import numpy\n"
            f"importlib.import_module({impl.module!r} + '._api')\n"
            "v = ''\n"
            f"for d in m.packages_distributions().get({impl.module!r}, []) + ['gixl']:\n"
            "    try:\n"
            "        v = d + ' ' + m.version(d); break\n"
            "    except Exception: pass\n"
            "print('VERSION', v)\n")
    try:
        r = subprocess.run([impl.python, "-c", code], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        impl.reason = f"`import {impl.module}._api` took more than {timeout:.0f} s"
        return
    except OSError as e:
        impl.reason = f"cannot run {impl.python}: {e}"
        return
    if r.returncode != 0:
        last = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
        impl.reason = f"`import {impl.module}._api` failed: {last[-1] if last else 'exit ' + str(r.returncode)}"
        return
    for line in r.stdout.splitlines():
        if line.startswith("VERSION "):
            impl.version = line[len("VERSION "):].strip()
    impl.available = True


def tail(path, n=6):
    try:
        with open(path, errors="replace") as f:
            lines = [ln.rstrip() for ln in f if ln.strip()]
        return " | ".join(lines[-n:])
    except OSError:
        return ""


def kill_tree(p):
    """Kill a child we started (its own process group, in case it started helpers) and reap it."""
    if p is None:
        return
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            try:
                p.kill()
            except ProcessLookupError:
                pass
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def spawn(impl, args, log_path, pass_fds=()):
    log = open(log_path, "wb")
    try:
        return subprocess.Popen([impl.python, os.path.abspath(__file__), "--module", impl.module] + args,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                pass_fds=pass_fds, start_new_session=True, cwd=REPO)
    finally:
        log.close()


def run_pair(impl, params, workdir, rnd):
    """One round: a target and an initiator process, wired by two pipes; results from the initiator's file."""
    tag = f"{impl.key}-r{rnd}"
    out = os.path.join(workdir, f"{tag}-initiator.json")
    i2t_r, i2t_w = os.pipe()
    t2i_r, t2i_w = os.pipe()
    target = initiator = None
    t_start = time.monotonic()
    try:
        target = spawn(impl, ["--role", "target", "--rfd", str(i2t_r), "--wfd", str(t2i_w)],
                       os.path.join(workdir, f"{tag}-target.log"), pass_fds=(i2t_r, t2i_w))
        initiator = spawn(impl, ["--role", "initiator", "--rfd", str(t2i_r), "--wfd", str(i2t_w),
                                 "--out", out, "--params", json.dumps(params)],
                          os.path.join(workdir, f"{tag}-initiator.log"), pass_fds=(t2i_r, i2t_w))
        for fd in (i2t_r, i2t_w, t2i_r, t2i_w):
            os.close(fd)
        i2t_r = i2t_w = t2i_r = t2i_w = None
        timed_out = False
        try:
            rc = initiator.wait(timeout=params["timeout"])
        except subprocess.TimeoutExpired:
            timed_out, rc = True, None
        try:
            with open(out) as f:
                res = json.load(f)
        except (OSError, ValueError):
            res = dict(scenarios={}, errors={}, current="startup")
        if timed_out:
            res["fatal"] = f"pair timed out after {params['timeout']:.0f} s during '{res.get('current')}'"
        elif rc != 0:
            why = tail(os.path.join(workdir, f"{tag}-initiator.log"))
            res["fatal"] = f"initiator exited {rc} during '{res.get('current')}': {why}"
        if res.get("fatal") and target.poll() is not None and target.returncode != 0:
            res["fatal"] += f"; target exited {target.returncode}: " + \
                tail(os.path.join(workdir, f"{tag}-target.log"))
        res["wall_s"] = time.monotonic() - t_start
        return res
    finally:
        kill_tree(initiator)
        kill_tree(target)
        for fd in (i2t_r, i2t_w, t2i_r, t2i_w):
            if fd is not None:
                os.close(fd)


def cma_ceiling(workdir, threads=2, reps=10):
    """The box's process_vm_readv ceiling (benches/cma_ceiling.c, compiled once): median GB/s or None."""
    exe = os.path.join(workdir, "cma_ceiling")
    if not os.path.exists(exe):
        cc = shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            return None
        r = subprocess.run([cc, "-O2", "-pthread", os.path.join(REPO, "benches", "cma_ceiling.c"), "-o", exe],
                           capture_output=True, text=True)
        if r.returncode != 0:
            return None
    try:
        r = subprocess.run([exe, str(threads), str(reps)], capture_output=True, text=True, timeout=120)
        return json.loads(r.stdout)["median_gbps"] if r.returncode == 0 else None
    except (subprocess.TimeoutExpired, ValueError, KeyError):
        return None


def run_idle(impl, params, workdir, rnd):
    tag = f"{impl.key}-r{rnd}"
    out = os.path.join(workdir, f"{tag}-idle.json")
    p = None
    try:
        p = spawn(impl, ["--role", "idle", "--out", out, "--idle-secs", str(params["idle_secs"])],
                  os.path.join(workdir, f"{tag}-idle.log"))
        try:
            rc = p.wait(timeout=params["idle_secs"] + min(60.0, params["timeout"]))
        except subprocess.TimeoutExpired:
            return dict(error="idle agent process timed out")
        if rc != 0:
            return dict(error=f"idle agent process exited {rc}: " + tail(os.path.join(workdir, f"{tag}-idle.log")))
        with open(out) as f:
            return json.load(f)
    finally:
        kill_tree(p)


# --- aggregation -------------------------------------------------------------------------------------------

def pooled(impl, *path):
    """All samples at `path` (a list per round) concatenated over rounds; None if no round has them."""
    vals, found = [], False
    for r in impl.rounds:
        x = r.get("pair", {}).get("scenarios", {})
        for k in path:
            x = x.get(k) if isinstance(x, dict) else None
        if isinstance(x, list):
            vals.extend(x)
            found = True
        elif isinstance(x, (int, float)):
            vals.append(x)
            found = True
    return vals if found else None


def idle_vals(impl, key):
    vals = [r["idle"][key] for r in impl.rounds if isinstance(r.get("idle"), dict) and key in r["idle"]]
    return vals or None


def errors_of(impl, scenario):
    errs = []
    for i, r in enumerate(impl.rounds):
        pair = r.get("pair", {})
        if scenario in pair.get("errors", {}):
            errs.append(f"round {i + 1}: {pair['errors'][scenario]}")
        elif pair.get("fatal") and scenario not in pair.get("scenarios", {}) and scenario != "idle-fresh":
            errs.append(f"round {i + 1}: {pair['fatal']}" + ("" if pair.get("current") == scenario
                                                              else f" (so '{scenario}' did not run)"))
        if scenario == "idle-fresh" and isinstance(r.get("idle"), dict) and "error" in r["idle"]:
            errs.append(f"round {i + 1}: {r['idle']['error']}")
    return errs


# Rows of the table: (id, label, unit, better ("hi"/"lo"), getter(impl) -> value or None, scenario, target)
def stat(vals, which):
    s = summarize(vals) if vals else None
    return None if s is None else s[which]


def rows_spec():
    def g(*path, which="median"):
        return lambda im: stat(pooled(im, *path), which)

    def idle_fresh(key, scale=1.0):
        return lambda im: (None if not idle_vals(im, key) else stat([v * scale for v in idle_vals(im, key)], "median"))

    return [
        ("bulk_read", "bulk READ, 1 × 64 MiB (GB/s, median)", "GB/s", "hi", g("bulk", "READ", "gbps"), "bulk",
         ("ratio", 1.5), "≥ 1.5× NIXL; ≥ 80 % of the CMA ceiling (below)"),
        ("bulk_write", "bulk WRITE, 1 × 64 MiB (GB/s, median)", "GB/s", "hi", g("bulk", "WRITE", "gbps"), "bulk",
         ("ratio", 1.5), "≥ 1.5× NIXL; ≥ 80 % of the CMA ceiling (below)"),
        ("kv_read", "KV READ, 1024 × 16 KiB prepped, end to end (GB/s, median)", "GB/s", "hi",
         g("kv", "READ", "gbps"), "kv", ("ratio", 2.5), "≥ 2.5× NIXL"),
        ("kv_write", "KV WRITE, 1024 × 16 KiB prepped, end to end (GB/s, median)", "GB/s", "hi",
         g("kv", "WRITE", "gbps"), "kv", None, "—"),
        ("make_med", "make_prepped_xfer, 1024 indices (µs, median)", "µs", "lo", g("kv", "make_us"), "kv",
         ("max", 10.0), "≤ 10 µs"),
        ("make_p99", "make_prepped_xfer, 1024 indices (µs, p99)", "µs", "lo", g("kv", "make_us", which="p99"),
         "kv", None, "—"),
        ("mt_med", "make_prepped_xfer + transfer, 1024 indices (µs, median)", "µs", "lo",
         g("kv", "READ", "make_transfer_us"), "kv", None, "—"),
        ("mt_p99", "make_prepped_xfer + transfer, 1024 indices (µs, p99)", "µs", "lo",
         g("kv", "READ", "make_transfer_us", which="p99"), "kv", None, "—"),
        ("lat_read_med", "4 KiB READ, post → DONE (µs, median)", "µs", "lo", g("latency", "READ", "us"), "latency",
         ("ratio", 2.0), "≤ ½ NIXL"),
        ("lat_read_p99", "4 KiB READ, post → DONE (µs, p99)", "µs", "lo",
         g("latency", "READ", "us", which="p99"), "latency", ("max", 10.0), "≤ 10 µs"),
        ("lat_write_med", "4 KiB WRITE, post → DONE (µs, median)", "µs", "lo", g("latency", "WRITE", "us"),
         "latency", None, "—"),
        ("lat_write_p99", "4 KiB WRITE, post → DONE (µs, p99)", "µs", "lo",
         g("latency", "WRITE", "us", which="p99"), "latency", None, "—"),
        ("wn_med", "WRITE+notif → target's get_new_notifs (µs, median)", "µs", "lo",
         g("notif", "write_notif", "us"), "notif", ("max", 12.0), "≤ 12 µs"),
        ("wn_p99", "WRITE+notif → target's get_new_notifs (µs, p99)", "µs", "lo",
         g("notif", "write_notif", "us", which="p99"), "notif", ("max", 100.0), "≤ 100 µs"),
        ("sn_med", "send_notif → target's get_new_notifs (µs, median)", "µs", "lo",
         g("notif", "send_notif", "us"), "notif", ("max", 12.0), "≤ 12 µs"),
        ("sn_p99", "send_notif → target's get_new_notifs (µs, p99)", "µs", "lo",
         g("notif", "send_notif", "us", which="p99"), "notif", ("max", 100.0), "≤ 100 µs"),
        ("reg1000", "register_memory, 1000 descriptors (ms, median)", "ms", "lo", g("control", "register_ms"),
         "control", None, "—"),
        ("md1000", "metadata size, 1000 regions (KB)", "KB", "lo",
         lambda im: (lambda v: None if v is None else v / 1000.0)(stat(pooled(im, "control", "md_bytes"), "median")),
         "control", ("max", 20.0), "≤ 20 KB"),
        ("add1000", "add_remote_agent, 1000 regions, fresh agent (ms, median)", "ms", "lo", g("control", "add_ms"),
         "control", ("max", 1.0), "≤ 1 ms"),
        ("first", "first transfer after it: 4 KiB READ create+post → DONE (ms, median)", "ms", "lo",
         g("control", "first_ms"), "control", None, "—"),
        ("idle_cpu", "idle CPU, fresh agent with UCX backend (cores)", "cores", "lo", idle_fresh("cores"),
         "idle-fresh", ("max", 0.01), "0"),
        ("idle_rss", "idle RSS growth, fresh agent over python+numpy (MB)", "MB", "lo",
         idle_fresh("rss_delta_kb", 1024 / 1e6), "idle-fresh", ("max", 10.0), "≤ 10 MB"),
        ("idle_cpu_pair", "idle CPU after traffic, target + initiator (cores)", "cores", "lo",
         lambda im: (lambda v: None if not v else stat(v, "median"))(
             [r["pair"]["scenarios"]["idle"]["target"]["cores"] + r["pair"]["scenarios"]["idle"]["initiator"]["cores"]
              for r in im.rounds if "idle" in r.get("pair", {}).get("scenarios", {})]),
         "idle", ("max", 0.02), "0"),
    ]


def fmt(v, unit):
    if v is None:
        return "n/a"
    if unit in ("cores",):
        return f"{v:.2f}"
    if unit == "µs":
        return f"{v:.1f}" if v < 1000 else f"{v:,.0f}"
    if unit == "ms":
        return f"{v:.3f}" if v < 1 else f"{v:.2f}"
    return f"{v:.2f}" if v < 100 else f"{v:,.0f}"


def ratio(g, n, better):
    """> 1 means gixl is better: gixl/NIXL for higher-is-better, NIXL/gixl for times, sizes, CPU."""
    if g is None or n is None:
        return None
    num, den = (g, n) if better == "hi" else (n, g)
    if den == 0:
        return math.inf if num > 0 else None
    return num / den


def verdict(target, g, r):
    if target is None or g is None:
        return ""
    kind = target[0]
    if kind == "max":
        return " ✓" if g <= target[1] else " ✗"
    if kind == "ratio":
        return "" if r is None else (" ✓" if r >= target[1] else " ✗")
    if kind == "ratio_abs":
        ok = g >= target[2] and (r is None or r >= target[1])
        return " ✓" if ok else " ✗"
    return ""


class _OneRound:
    def __init__(self, r):
        self.rounds = [r]


def build_table(impls, gixl, nixl, scenarios):
    nlab = f"NIXL {nixl.version.split()[-1]}" if nixl and nixl.version else "NIXL"
    glab = "gixl" + (f" {gixl.version.split()[-1]}" if gixl and gixl.version else "")
    lines = [f"| scenario | {nlab} | {glab} | ratio (>1: gixl better) | target (gixl) |",
             "|---|---:|---:|---:|---|"]
    rows, footnotes, spread = [], [], []

    def cell(im, getter, scen, unit):
        if im is None:
            return None, "—"
        if not im.available:
            return None, "n/a"
        v = getter(im)
        if v is None:
            errs = errors_of(im, scen)
            if errs:
                footnotes.append(f"{im.label} {scen}: {errs[0]}")
                return None, "err"
            return None, "n/a"
        return v, fmt(v, unit)

    for rid, label, unit, better, getter, scen, target, target_txt in rows_spec():
        if scen.split("-")[0] not in scenarios:
            continue
        for im in (nixl, gixl):  # flag figures whose per-round values disagree by more than 2x
            if im is None or not im.available or len(im.rounds) < 2:
                continue
            per = [getter(_OneRound(r)) for r in im.rounds]
            if all(isinstance(v, (int, float)) and v > 0 for v in per) and max(per) > 2 * min(per):
                spread.append(f"{im.label}, {label}: per round " + ", ".join(fmt(v, unit) for v in per))
        nv, ns = cell(nixl, getter, scen, unit)
        gv, gs = cell(gixl, getter, scen, unit)
        r = ratio(gv, nv, better)
        rs = "—" if r is None else ("∞" if r == math.inf else f"{r:.2f}×")
        lines.append(f"| {label} | {ns} | {gs} | {rs} | {target_txt}{verdict(target, gv, r)} |")
        rows.append(dict(id=rid, label=label, unit=unit, better=better, nixl=nv, gixl=gv, ratio=r,
                         target=target_txt, met=(verdict(target, gv, r).strip() or None)))
    seen = set()
    notes = []
    for f in footnotes:
        if f not in seen:
            seen.add(f)
            notes.append(f)
    return lines, rows, notes, spread


def build_plan_table(gixl, nixl):
    """The production-shaped planning table: one row per (list size, indices), medians pooled over rounds."""
    def med(im, *path):
        if im is None or not im.available:
            return None
        return stat(pooled(im, "plan", *path), "median")

    def trio(path, unit, better, target):
        nv, gv = med(nixl, *path), med(gixl, *path)
        r = ratio(gv, nv, better)
        ok = "" if r is None or target is None else (" ✓" if r >= target else " ✗")
        rs = "—" if r is None else f"{r:.2f}×"
        return f"{fmt(nv, unit)} / {fmt(gv, unit)} ({rs}{ok})", dict(nixl=nv, gixl=gv, ratio=r)

    lines = ["| list entries | indices | make_prepped_xfer warm (µs) | make_prepped_xfer cold (µs) "
             "| make, thread CPU, warm (µs) | make, thread CPU, cold (µs) "
             "| make + post + wait warm (µs) | make + post + wait cold (µs) |",
             "|---:|---:|---|---|---|---|---|---|"]
    rows = []
    for n in PLAN_SIZES:
        for k in PLAN_COUNTS:
            cells, row = [], dict(entries=n, indices=k)
            for key, target in (("make_warm_us", 2.0), ("make_cold_us", 2.0), ("make_warm_cpu_us", 2.0),
                                ("make_cold_cpu_us", 2.0), ("e2e_warm_us", None), ("e2e_cold_us", None)):
                txt, d = trio((str(n), str(k), key), "µs", "lo", target)
                cells.append(txt)
                row[key] = d
            lines.append(f"| {n:,} | {k:,} | " + " | ".join(cells) + " |")
            rows.append(row)
    lines += ["", "| list entries | prep_xfer_dlist local (ms) | prep_xfer_dlist remote (ms) "
              "| heap bytes kept per prepped entry |", "|---:|---|---|---|"]
    for n in PLAN_SIZES:
        a, da = trio((str(n), "local", "prep_ms"), "ms", "lo", None)
        b, db = trio((str(n), "remote", "prep_ms"), "ms", "lo", None)
        m, dm = trio((str(n), "bytes_per_entry"), "B/entry", "lo", 1.0)
        lines.append(f"| {n:,} | {a} | {b} | {m} |")
        rows.append(dict(entries=n, prep_local_ms=da, prep_remote_ms=db, bytes_per_entry=dm))
    return lines, rows


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def machine_line():
    try:
        with open("/proc/loadavg") as f:
            load = " ".join(f.read().split()[:3])
    except OSError:
        load = "?"
    return load


def main():
    ap = argparse.ArgumentParser(description="gixl vs NIXL side by side (see benches/README.md)")
    ap.add_argument("--impl", action="append", choices=["gixl", "nixl_cu12", "both"],
                    help="implementation(s) to measure (repeatable; default both)")
    ap.add_argument("--quick", action="store_true", help="fewer iterations (CI smoke, about 2 min for both; NIXL's plan scenario takes most)")
    ap.add_argument("--json", metavar="FILE", help="also write every figure and summary as JSON")
    ap.add_argument("--rounds", type=int, help="rounds per implementation, alternating (default 3, quick 1)")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS),
                    help=f"comma-separated subset of {','.join(SCENARIOS)} (default all)")
    ap.add_argument("--gixl-python", default=".venv/gixl/bin/python",
                    help="interpreter with gixl installed (relative to the repo root unless absolute)")
    ap.add_argument("--gixl-module", default="nixl", help="module providing _api for gixl (default nixl)")
    ap.add_argument("--nixl-python", default=None,
                    help="interpreter with NIXL (default .venv/nixl/bin/python, else /work/ref-nixl/bin/python)")
    ap.add_argument("--nixl-module", default="nixl_cu12", help="module providing _api for NIXL (default nixl_cu12)")
    ap.add_argument("--timeout", type=float, help="seconds allowed per process pair (default 300, quick 150)")
    ap.add_argument("--idle-secs", type=float, help="idleness measured for idle CPU (default 3, quick 1)")
    ap.add_argument("--keep-logs", metavar="DIR", help="keep the children's logs and raw results in DIR")
    # internal: the child roles
    ap.add_argument("--role", choices=["target", "initiator", "idle"], help=argparse.SUPPRESS)
    ap.add_argument("--module", help=argparse.SUPPRESS)
    ap.add_argument("--rfd", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--wfd", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--params", help=argparse.SUPPRESS)
    a = ap.parse_args()

    if a.role == "target":
        return child_target(a)
    if a.role == "initiator":
        return child_initiator(a)
    if a.role == "idle":
        return child_idle(a)

    params = dict(QUICK if a.quick else FULL)
    if a.rounds:
        params["rounds"] = a.rounds
    if a.timeout:
        params["timeout"] = a.timeout
    if a.idle_secs is not None:
        params["idle_secs"] = a.idle_secs
    scen = [s.strip() for s in a.scenarios.split(",") if s.strip()]
    bad = [s for s in scen if s not in SCENARIOS]
    if bad:
        ap.error(f"unknown scenario(s) {bad}; choose from {SCENARIOS}")
    params["scenarios"] = [s for s in scen if s != "idle"] + (["idle"] if "idle" in scen else [])

    def repo_path(p):
        return p if os.path.isabs(p) else os.path.join(REPO, p)

    nixl_python = a.nixl_python
    if nixl_python is None:
        nixl_python = repo_path(".venv/nixl/bin/python")
        if not os.path.exists(nixl_python) and os.path.exists("/work/ref-nixl/bin/python"):
            nixl_python = "/work/ref-nixl/bin/python"
    else:
        nixl_python = repo_path(nixl_python)
    wanted = set(a.impl or ["both"])
    if "both" in wanted:
        wanted = {"gixl", "nixl_cu12"}
    nixl = Impl("nixl_cu12", "NIXL", nixl_python, a.nixl_module) if "nixl_cu12" in wanted else None
    gixl = Impl("gixl", "gixl", repo_path(a.gixl_python), a.gixl_module) if "gixl" in wanted else None
    impls = [im for im in (nixl, gixl) if im is not None]

    command = f"{shlex.join([sys.executable] + sys.argv)}   (in {os.getcwd()})"
    # A SIGTERM (e.g. from a CI timeout) unwinds like Ctrl-C, so the children are still killed.
    signal.signal(signal.SIGTERM, _interrupt)
    load_before = machine_line()
    t_start = time.monotonic()
    workdir = a.keep_logs or tempfile.mkdtemp(prefix="gixl-bench-")
    os.makedirs(workdir, exist_ok=True)
    try:
        for im in impls:
            probe(im, timeout=min(60.0, params["timeout"]))
            status = f"{im.version or im.module} via {im.python}" if im.available else f"n/a: {im.reason}"
            print(f"[bench] {im.label}: {status}", file=sys.stderr, flush=True)
        live = [im for im in impls if im.available]
        ceiling = []  # process_vm_readv with two threads, measured between the rounds' pairs
        if "latency" in params["scenarios"] and cma_ceiling(workdir, reps=1) is not None:  # compiles it
            params["cma_exe"] = os.path.join(workdir, "cma_ceiling")
        for rnd in range(params["rounds"]):
            order = live if rnd % 2 == 0 else list(reversed(live))  # alternate who goes first
            for im in order:
                t0 = time.monotonic()
                rr = dict(pair=run_pair(im, params, workdir, rnd + 1))
                if "idle" in params["scenarios"]:
                    rr["idle"] = run_idle(im, params, workdir, rnd + 1)
                im.rounds.append(rr)
                if "bulk" in params["scenarios"]:
                    v = cma_ceiling(workdir)
                    if v is not None:
                        ceiling.append(v)
                pair = rr["pair"]
                msg = f"round {rnd + 1}/{params['rounds']} {im.label}: {time.monotonic() - t0:.1f} s"
                if pair.get("fatal"):
                    msg += f"; FAILED: {pair['fatal']}"
                for k, v in pair.get("errors", {}).items():
                    msg += f"; {k}: {v}"
                print(f"[bench] {msg}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        print("[bench] interrupted; children killed; partial results follow", file=sys.stderr)
    finally:
        if not a.keep_logs:
            shutil.rmtree(workdir, ignore_errors=True)

    lines, rows, notes, spread = build_table(impls, gixl, nixl, params["scenarios"])
    if "bulk" in params["scenarios"] and ceiling:
        c = stat(ceiling, "median")
        lines.append(f"| process_vm_readv ceiling, 2 threads, 64 MiB (GB/s, median of {len(ceiling)}) | — | {c:.2f} | — | — |")
        for rid, op in (("bulk_read", "READ"), ("bulk_write", "WRITE")):
            g = next((r["gixl"] for r in rows if r["id"] == rid), None)
            if g is not None:
                ok = " ✓" if g >= 0.8 * c else " ✗"
                lines.append(f"| gixl bulk {op} / that ceiling | — | {100 * g / c:.0f} % | — | ≥ 80 %{ok} |")
        rows.append(dict(id="cma_ceiling", gixl=c, samples=ceiling))
    if "latency" in params["scenarios"]:
        # The floor under a 4 KiB READ through the Python API: the bare system call against the same target
        # buffer plus one binding call, per implementation.
        def floor_parts(im):
            if im is None or not im.available:
                return None, None
            return (stat(pooled(im, "latency", "READ", "syscall_us"), "median"),
                    stat(pooled(im, "latency", "READ", "call_us"), "median"))
        (sn, cn), (sg, cg) = floor_parts(nixl), floor_parts(gixl)
        fmt_c = lambda v: "n/a" if v is None else f"{v:.2f}"
        lines.append(f"| one 4 KiB process_vm_readv of the same target buffer, C (µs, median) | {fmt_c(sn)} | "
                     f"{fmt_c(sg)} | — | — |")
        lines.append(f"| one binding call, check_xfer_state of a finished request (µs, median) | {fmt_c(cn)} | "
                     f"{fmt_c(cg)} | — | — |")
        read = next((r for r in rows if r["id"] == "lat_read_med"), None)
        if None not in (sg, cg) and read is not None and read.get("nixl") is not None:
            floor, half = sg + cg, read["nixl"] / 2
            ok = "✓ reachable" if floor <= half else "✗ ½ NIXL is below the floor: unreachable on this box"
            lines.append(f"| 4 KiB READ floor: those two (gixl) vs ½ NIXL's median (µs) | {half:.2f} | "
                         f"{floor:.2f} | — | {ok} |")
            lines.append(f"| gixl's 4 KiB READ above its floor (µs) | — | {read['gixl'] - floor:.2f} | — | — |")
    load_after = machine_line()
    ncpu = os.cpu_count()
    print()
    print("\n".join(lines))
    print()
    plan_rows = []
    if "plan" in params["scenarios"]:
        plan_lines, plan_rows = build_plan_table(gixl, nixl)
        print("Production-shaped planning: NIXL / gixl (ratio, above 1 = gixl better; ✓/✗: issue #13's ≥ 2×, "
              "entries no larger than NIXL's)")
        print()
        print("\n".join(plan_lines))
        print()
    for im in impls:
        if not im.available:
            print(f"- {im.label}: n/a — {im.reason}")
    for n in notes:
        print(f"- error: {n}")
    lost = []
    for im in impls:
        for kind in ("write_notif", "send_notif"):
            tot = sum(r["pair"]["scenarios"].get("notif", {}).get(kind, {}).get("lost", 0) for r in im.rounds
                      if "pair" in r)
            if tot:
                lost.append(f"{im.label} {kind}: {tot} notifications not seen within 2 s")
    for ln in lost:
        print(f"- lost: {ln}")
    for ln in spread:
        print(f"- unstable (rounds differ > 2×): {ln}")
    print(f"- ratio: gixl/NIXL for GB/s, NIXL/gixl for times, sizes and CPU — above 1 means gixl is better. "
          f"✓/✗: gixl against the issue #6 / #13 target.")
    rounds_done = {im.label: len(im.rounds) for im in impls if im.available}
    print(f"- machine: nproc {ncpu}, loadavg {load_before} (start) → {load_after} (end); "
          f"rounds {rounds_done}, {'quick' if a.quick else 'full'} mode, {time.monotonic() - t_start:.0f} s")
    ucx = {k: v for k, v in os.environ.items() if k.startswith(("UCX_", "NIXL_"))}
    if ucx:
        print(f"- environment: {' '.join(f'{k}={v}' for k, v in sorted(ucx.items()))}")
    print(f"- command: {command}")

    if a.json:
        doc = dict(command=command, nproc=ncpu, loadavg_start=load_before, loadavg_end=load_after,
                   mode="quick" if a.quick else "full", params=params, env=ucx, rows=rows,
                   plan_rows=plan_rows, impls={})
        for im in impls:
            entry = dict(label=im.label, python=im.python, module=im.module, available=im.available,
                         reason=im.reason, version=im.version, rounds=[])
            for r in im.rounds:
                pair = r.get("pair", {})
                entry["rounds"].append(dict(
                    fatal=pair.get("fatal"), errors=pair.get("errors", {}), wall_s=pair.get("wall_s"),
                    scenario_s=pair.get("scenario_s"), main_md_bytes=pair.get("main_md_bytes"), main_add_remote_agent_s=pair.get("main_add_remote_agent_s"),
                    summary=summarize_tree(pair.get("scenarios", {})), idle_fresh=r.get("idle")))
            entry["pooled"] = {row["id"]: row.get(im.key if im.key == "gixl" else "nixl") for row in rows}
            doc["impls"][im.key] = entry
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"- json: {a.json}")
    ok = all(im.available and im.rounds and not any(r["pair"].get("fatal") or r["pair"].get("errors")
                                                    for r in im.rounds) for im in impls)
    return 0 if ok else 1


def summarize_tree(x):
    """Replace every list of samples by its summary (the JSON keeps summaries, not raw samples)."""
    if isinstance(x, dict):
        return {k: summarize_tree(v) for k, v in x.items()}
    if isinstance(x, list) and x and all(isinstance(v, (int, float)) for v in x):
        return summarize(x)
    return x


if __name__ == "__main__":
    sys.exit(main() or 0)
