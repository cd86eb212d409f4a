#!/usr/bin/env python3
"""vLLM's NixlConnector call sequence (pull mode), one line per call, to diff implementations.

Runs a decode (D) here and a prefill (P) child; P is SIGKILLed partway and a new P (new name, as vLLM uses a
fresh uuid per engine) takes over. Every printed line is free of addresses, names and timings, so

    python3 examples/vllm_sequence.py --impl nixl       > gixl.txt    # gixl
    python3 examples/vllm_sequence.py --impl nixl_cu12  > nixl.txt    # NVIDIA NIXL 1.5.1
    diff gixl.txt nixl.txt

prints nothing when gixl behaves as NIXL does. Follows consumers.md §1.13.
"""

import argparse
import importlib
import importlib.metadata
import os
import signal
import subprocess
import sys
import time
import uuid

import numpy as np

# Both implementations log INFO lines to stdout; keep the output to the calls' results.
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

BLOCK = 4096
NBLOCKS = 64


def say(*a):
    print(*a, flush=True)


def make_agent(api, name):
    return api.nixl_agent(name, api.nixl_agent_config(num_threads=4, capture_telemetry=True))


def prefill(impl):
    api = importlib.import_module(f"{impl}._api")
    name = str(uuid.uuid4())
    p = make_agent(api, name)
    kv = ((np.arange(NBLOCKS * BLOCK) * 7) % 251).astype(np.uint8)
    p.register_memory(p.get_reg_descs([(kv.ctypes.data, kv.nbytes, 0, "")], "DRAM"), backends=["UCX"])
    sys.stdout.write(f"MD {p.get_agent_metadata().hex()} {kv.ctypes.data}\n")
    sys.stdout.flush()
    while True:
        for sender, msgs in p.get_new_notifs().items():
            for m in msgs:
                kind = "str" if isinstance(sender, str) else type(sender).__name__
                sys.stdout.write(f"NOTIF {kind} {m!r}\n")
                sys.stdout.flush()
        time.sleep(0.001)


def start(impl):
    proc = subprocess.Popen([sys.executable, __file__, "--impl", impl, "--role", "prefill"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    while line and not line.startswith("MD "):
        line = proc.stdout.readline()
    _, md, addr = line.split()
    return proc, bytes.fromhex(md), int(addr)


def next_notif(proc, timeout=10.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        if line.startswith("NOTIF"):
            return line.strip()
    return "no notification"


def outcome(fn):
    try:
        r = fn()
        return f"ok {r!r}" if r is not None else "ok"
    except Exception as e:  # the exception class is the behaviour being compared
        return type(e).__name__


def decode(impl):
    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")
    api = importlib.import_module(f"{impl}._api")
    importlib.import_module(f"{impl}._bindings")
    dist = "nixl" if impl == "nixl" else impl.replace("_", "-")
    v = tuple(int(x) for x in importlib.metadata.version(dist).split(".")[:2])
    say("dist version >= 1.5:", v >= (1, 5))
    d = make_agent(api, str(uuid.uuid4()))
    dst = np.zeros(NBLOCKS * BLOCK, dtype=np.uint8)
    reg = d.get_reg_descs([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
    say("register_memory:", outcome(lambda: d.register_memory(reg, backends=["UCX"]) and None))
    local = d.prep_xfer_dlist("NIXL_INIT_AGENT", np.array([[dst.ctypes.data, BLOCK, 0, BLOCK, NBLOCKS]], dtype=np.uint64),
                              mem_type="DRAM")
    say("prep local Nx5:", type(local).__name__)
    say("get_agent_metadata:", type(d.get_agent_metadata()).__name__)

    p, md, addr = start(impl)
    name = d.add_remote_agent(md)
    say("add_remote_agent returns:", type(name).__name__)
    say("add again (same metadata):", outcome(lambda: type(d.add_remote_agent(md)).__name__))
    remote = d.prep_xfer_dlist(name, np.array([[addr, BLOCK, 0, BLOCK, NBLOCKS]], dtype=np.uint64), mem_type="DRAM")
    say("prep remote Nx5:", type(remote).__name__)

    ids = np.array([3, 1, 4, 15, 9, 2, 6], dtype=np.int32)
    h = d.make_prepped_xfer("READ", local, ids, remote, ids, notif_msg=b"req-1:1")
    say("make_prepped_xfer:", type(h).__name__, bool(h))
    d.transfer(h)
    s = d.check_xfer_state(h)
    while s == "PROC":
        s = d.check_xfer_state(h)
    say("check_xfer_state ends:", s)
    src = ((np.arange(NBLOCKS * BLOCK) * 7) % 251).astype(np.uint8).reshape(NBLOCKS, BLOCK)
    say("data correct:", bool((dst.reshape(NBLOCKS, BLOCK)[ids] == src[ids]).all()))
    t = d.get_xfer_telemetry(h)
    say("telemetry:", type(t).__name__, [type(getattr(t, f)).__name__ for f in
                                          ("startTime", "postDuration", "xferDuration", "totalBytes", "descCount")],
        "totalBytes", t.totalBytes)
    say("release_xfer_handle:", outcome(lambda: d.release_xfer_handle(h)))
    say("P sees:", next_notif(p))
    say("send_notif heartbeat:", outcome(lambda: d.send_notif(name, notif_msg=b"HB:r1,r2")))
    say("P sees:", next_notif(p))

    h2 = d.make_prepped_xfer("READ", local, ids, remote, ids, notif_msg=b"req-2:1")
    p.send_signal(signal.SIGKILL)
    p.wait()
    time.sleep(0.2)
    say("P killed")
    say("transfer after kill:", outcome(lambda: d.transfer(h2)))
    say("check_remote_metadata(dead):", d.check_remote_metadata(name))
    say("send_notif(dead):", outcome(lambda: d.send_notif(name, notif_msg=b"HB:r1")))
    say("release_dlist_handle(remote):", outcome(lambda: d.release_dlist_handle(remote)))
    say("remove_remote_agent:", outcome(lambda: d.remove_remote_agent(name)))
    say("remove_remote_agent again:", outcome(lambda: d.remove_remote_agent(name)))
    say("check_remote_metadata after remove:", d.check_remote_metadata(name))
    say("release old handle:", outcome(lambda: d.release_xfer_handle(h2)))

    p, md, addr = start(impl)
    name2 = d.add_remote_agent(md)
    say("new peer add_remote_agent:", type(name2).__name__, name2 != name)
    remote = d.prep_xfer_dlist(name2, np.array([[addr, BLOCK, 0, BLOCK, NBLOCKS]], dtype=np.uint64), mem_type="DRAM")
    dst[:] = 0
    h3 = d.make_prepped_xfer("READ", local, ids, remote, ids, notif_msg=b"req-3:1")
    d.transfer(h3)
    s = d.check_xfer_state(h3)
    while s == "PROC":
        s = d.check_xfer_state(h3)
    say("new peer READ:", s, bool((dst.reshape(NBLOCKS, BLOCK)[ids] == src[ids]).all()))
    say("P sees:", next_notif(p))
    d.release_xfer_handle(h3)
    d.release_dlist_handle(remote)
    d.release_dlist_handle(local)
    d.remove_remote_agent(name2)
    say("deregister_memory:", outcome(lambda: d.deregister_memory(reg)))
    p.kill()
    p.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", default="nixl")
    ap.add_argument("--role", default="decode", choices=["decode", "prefill"])
    a = ap.parse_args()
    (prefill if a.role == "prefill" else decode)(a.impl)


if __name__ == "__main__":
    main()
