#!/usr/bin/env python3
"""A vLLM-style prefill/decode pair moving KV-cache blocks, written against NIXL's Python API.

The decode process (this one) starts a prefill process, loads its metadata, and READs random sets of
16 KiB KV blocks with a notification per request, the way vLLM's NixlConnector does. Then the prefill is
SIGKILLed and restarted under the same name; decode sees the disconnect, drops the old peer, loads the new
incarnation and carries on. It prints what happened and the bandwidth.

    python3 examples/kv_demo.py            # gixl (import nixl)
    python3 examples/kv_demo.py --impl nixl_cu12   # the real NIXL, for comparison
"""

import argparse
import importlib
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np

BLOCK = 16 * 1024
BLOCKS = 4096  # 64 MiB of KV cache on the prefill side
PER_REQ = 1024  # blocks per request (16 MiB)


def load(impl):
    return importlib.import_module(f"{impl}._api")


def prefill(impl, gen):
    api = load(impl)
    agent = api.nixl_agent("prefill", api.nixl_agent_config(backends=["UCX"]))
    kv = np.full(BLOCKS * BLOCK, gen, dtype=np.uint8)
    agent.register_memory(agent.get_reg_descs([(kv.ctypes.data, kv.nbytes, 0, "")], "DRAM"))
    sys.stdout.write(f"MD {agent.get_agent_metadata().hex()} {kv.ctypes.data}\n")
    sys.stdout.flush()
    seen = 0
    while True:  # serve until killed; report notifications as they come
        for sender, msgs in agent.get_new_notifs().items():
            for m in msgs:
                seen += 1
                sys.stdout.write(f"NOTIF {sender} {m.decode(errors='replace')}\n")
                sys.stdout.flush()
        time.sleep(0.001)


def start_prefill(impl, gen):
    p = subprocess.Popen([sys.executable, __file__, "--impl", impl, "--role", "prefill", "--gen", str(gen)],
                         stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    while line and not line.startswith("MD "):  # NIXL's logger also writes to stdout
        line = p.stdout.readline()
    if not line:
        p.kill()
        raise SystemExit("prefill exited before printing its metadata")
    _, md, addr = line.split()
    return p, bytes.fromhex(md), int(addr)


def status(e):
    """The NIXL status behind an exception: nixlRemoteDisconnectError -> NIXL_ERR_REMOTE_DISCONNECT."""
    m = re.fullmatch(r"nixl(\w+)Error", type(e).__name__)
    if not m:
        return type(e).__name__
    return "NIXL_ERR_" + re.sub(r"(?<!^)(?=[A-Z])", "_", m.group(1)).upper()


def ms(t):
    return f"{1e3 * (time.perf_counter() - t):.2f} ms"


def wait_notif(p, tag, timeout=5.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        line = p.stdout.readline()
        if line.startswith("NOTIF") and tag in line:
            return line.strip()
    raise SystemExit(f"no notification {tag!r} within {timeout}s")


def decode(impl):
    api = load(impl)
    agent = api.nixl_agent("decode", api.nixl_agent_config(backends=["UCX"]))
    dst = np.zeros(BLOCKS * BLOCK, dtype=np.uint8)
    agent.register_memory(agent.get_reg_descs([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM"))
    # The N x 5 strided form vLLM 0.33 uses: (addr, block len, dev, stride, count) expands to BLOCKS blocks.
    local = agent.prep_xfer_dlist("", np.array([[dst.ctypes.data, BLOCK, 0, BLOCK, BLOCKS]], dtype=np.uint64), "DRAM")
    rng = np.random.default_rng(0)

    def run_requests(remote, gen, n, label):
        total, secs = 0, 0.0
        for r in range(n):
            idx = rng.choice(BLOCKS, PER_REQ, replace=False)
            dst[:] = 0
            t = time.perf_counter()
            h = agent.make_prepped_xfer("READ", local, idx, remote, idx, f"{label}-{r}".encode())
            state = agent.transfer(h)
            while state == "PROC":
                state = agent.check_xfer_state(h)
            secs += time.perf_counter() - t
            total += PER_REQ * BLOCK
            got = dst.reshape(BLOCKS, BLOCK)[idx]
            assert state == "DONE" and (got == gen).all(), "KV blocks arrived wrong"
            agent.release_xfer_handle(h)
        return total, secs

    t_start = time.perf_counter()
    print(f"[decode] implementation: {impl}")
    t = time.perf_counter()
    p, md, addr = start_prefill(impl, 1)
    print(f"[demo] prefill started: its metadata in hand after {ms(t)}")
    t = time.perf_counter()
    name = agent.add_remote_agent(md)
    print(f"[decode] loaded metadata of {name!r} ({len(md)} bytes) in {ms(t)}")
    remote = agent.prep_xfer_dlist("prefill", np.array([[addr, BLOCK, 0, BLOCK, BLOCKS]], dtype=np.uint64), "DRAM")
    nbytes, secs = run_requests(remote, 1, 8, "req")
    print(f"[decode] 8 requests x {PER_REQ} random 16 KiB blocks READ and verified: "
          f"{nbytes / secs / 1e9:.2f} GB/s")
    print(f"[prefill] {wait_notif(p, 'req-7')}")

    # A request in hand, the prefill dies.
    idx = np.arange(PER_REQ)
    old = agent.make_prepped_xfer("READ", local, idx, remote, idx, b"after-kill")
    p.send_signal(signal.SIGKILL)
    p.wait()
    print("[demo] prefill SIGKILLed, a request to it in hand")
    t = time.perf_counter()
    try:
        state = agent.transfer(old)
        while state == "PROC":
            state = agent.check_xfer_state(old)
        print(f"[decode] transfer to the dead peer ended {state} (unexpected)")
    except Exception as e:  # nixlRemoteDisconnectError on both implementations
        print(f"[decode] transfer to the dead peer refused: {status(e)} ({type(e).__name__}) after {ms(t)}")

    t = time.perf_counter()
    p, md, addr = start_prefill(impl, 2)
    print(f"[demo] prefill restarted under the same name (new incarnation, new buffer) in {ms(t)}")
    t = time.perf_counter()
    try:
        agent.add_remote_agent(md)
        print(f"[decode] re-add without remove: accepted in {ms(t)}")
    except Exception as e:
        print(f"[decode] re-add without remove refused: {status(e)} after {ms(t)} (the old incarnation is still loaded)")
    t = time.perf_counter()
    agent.remove_remote_agent("prefill")
    agent.add_remote_agent(md)
    print(f"[decode] removed the old incarnation and loaded the new one in {ms(t)}")
    t = time.perf_counter()
    try:
        agent.transfer(old)
        print("[decode] old handle: posted (unexpected)")
    except Exception as e:
        print(f"[decode] old handle refused: {status(e)} ({type(e).__name__}) after {ms(t)}: "
              "it was built against the dead incarnation")
    agent.release_xfer_handle(old)
    agent.release_dlist_handle(remote)
    remote = agent.prep_xfer_dlist("prefill", np.array([[addr, BLOCK, 0, BLOCK, BLOCKS]], dtype=np.uint64), "DRAM")
    nbytes, secs = run_requests(remote, 2, 8, "again")
    print(f"[decode] new incarnation served: 8 more requests READ from the new prefill and verified: "
          f"{nbytes / secs / 1e9:.2f} GB/s")
    print(f"[prefill] {wait_notif(p, 'again-7')}")
    p.kill()
    p.wait()
    print(f"[demo] done in {1e3 * (time.perf_counter() - t_start):.0f} ms")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impl", default="nixl", help="module providing _api: nixl (gixl) or nixl_cu12")
    ap.add_argument("--role", default="decode", choices=["decode", "prefill"])
    ap.add_argument("--gen", type=int, default=1)
    a = ap.parse_args()
    if a.role == "prefill":
        prefill(a.impl, a.gen)
    else:
        decode(a.impl)


if __name__ == "__main__":
    main()
