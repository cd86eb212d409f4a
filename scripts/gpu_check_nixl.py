#!/usr/bin/env python3
"""The GPU cases of scripts/gpu-check.sh through ``nixl._api``, for NIXL 1.5.1 (``--impl nixl_cu12``, VRAM
through UCX) or gixl's wheel (``--impl nixl``): two processes on one GPU, device memory allocated with the
CUDA driver API through ctypes (no torch needed).

Cases: VRAM->VRAM READ and WRITE (1 x 64 MiB, 1024 x 16 KiB with the remote blocks shuffled), remote VRAM ->
local DRAM, local DRAM -> remote VRAM, local VRAM <-> remote DRAM, and the target killed and restarted with
the old handle. Data is checked; figures are medians of ``--iters`` posts.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import os
import random
import subprocess
import sys
import time

MIB = 1 << 20
BULK = 64 * MIB
BLOCKS, BLOCK = 1024, 16 << 10


class Cuda:
    def __init__(self, dev: int):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.ok(self.lib.cuInit(0), "cuInit")
        d = ctypes.c_int()
        self.ok(self.lib.cuDeviceGet(ctypes.byref(d), dev), "cuDeviceGet")
        self.ctx = ctypes.c_void_p()
        self.ok(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), d), "cuDevicePrimaryCtxRetain")
        self.current()

    def current(self):
        self.ok(self.lib.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")

    @staticmethod
    def ok(r, what):
        if r != 0:
            raise RuntimeError(f"{what} failed: CUDA error {r}")

    def alloc(self, n: int) -> int:
        p = ctypes.c_uint64()
        self.ok(self.lib.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(n)), "cuMemAlloc")
        return p.value

    def fill(self, p: int, n: int, b: int):
        self.ok(self.lib.cuMemsetD8_v2(ctypes.c_uint64(p), ctypes.c_ubyte(b), ctypes.c_size_t(n)), "cuMemsetD8")

    def read(self, p: int, n: int) -> bytes:
        buf = ctypes.create_string_buffer(n)
        self.ok(self.lib.cuMemcpyDtoH_v2(buf, ctypes.c_uint64(p), ctypes.c_size_t(n)), "cuMemcpyDtoH")
        return buf.raw

    def write(self, p: int, data: bytes):
        self.ok(self.lib.cuMemcpyHtoD_v2(ctypes.c_uint64(p), data, ctypes.c_size_t(len(data))), "cuMemcpyHtoD")


def target(impl: str, dev: int, fill: int):
    api = importlib.import_module(f"{impl}._api")
    import numpy as np

    cu = Cuda(dev)
    v = cu.alloc(BULK)
    cu.fill(v, BULK, fill)
    dram = np.full(BULK, 255 - fill, dtype=np.uint8)
    a = api.nixl_agent("gpu-target", api.nixl_agent_config(backends=["UCX"]))
    a.register_memory([(v, BULK, dev, "")], "VRAM")
    a.register_memory([(dram.ctypes.data, BULK, 0, "")], "DRAM")
    print(f"@md {a.get_agent_metadata().hex()} {v} {dram.ctypes.data}", flush=True)
    for line in sys.stdin:
        if line.strip() == "sum":
            cu.current()
            print(f"sum {sum(cu.read(v, BULK))} {int(dram.sum(dtype=np.uint64))}", flush=True)
        else:
            break


class Target:
    def __init__(self, args, fill):
        env = dict(os.environ, GPU_CHECK_ROLE="target", GPU_CHECK_FILL=str(fill))
        self.p = subprocess.Popen(
            [sys.executable, __file__, "--impl", args.impl, "--gpu", str(args.gpu)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )
        for line in self.p.stdout:
            if line.startswith("@md "):
                f = line.split()
                self.md, self.vram, self.dram = bytes.fromhex(f[1]), int(f[2]), int(f[3])
                return
        raise RuntimeError("target exited before printing metadata")

    def sums(self):
        self.p.stdin.write("sum\n")
        self.p.stdin.flush()
        f = self.p.stdout.readline().split()
        return int(f[1]), int(f[2])

    def kill(self):
        self.p.kill()
        self.p.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", default="nixl_cu12")
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    if os.environ.get("GPU_CHECK_ROLE") == "target":
        target(args.impl, args.gpu, int(os.environ["GPU_CHECK_FILL"]))
        return
    api = importlib.import_module(f"{args.impl}._api")
    import numpy as np

    dev = args.gpu
    cu = Cuda(dev)
    t = Target(args, 3)
    a = api.nixl_agent("gpu-initiator", api.nixl_agent_config(backends=["UCX"]))
    lv = cu.alloc(BULK)
    host = np.zeros(BULK, dtype=np.uint8)
    a.register_memory([(lv, BULK, dev, "")], "VRAM")
    a.register_memory([(host.ctypes.data, BULK, 0, "")], "DRAM")
    peer = a.add_remote_agent(t.md)
    failures = 0
    rows = []

    def check(ok, what):
        nonlocal failures
        print(f"  {'ok  ' if ok else 'FAIL'} {what}", flush=True)
        failures += 0 if ok else 1

    def post(h, limit=60.0):
        t0 = time.perf_counter()
        st = a.transfer(h)
        while st == "PROC":
            st = a.check_xfer_state(h)
            if time.perf_counter() - t0 > limit:
                raise TimeoutError("transfer did not finish")
        if st != "DONE":
            raise RuntimeError(f"transfer state {st}")
        return time.perf_counter() - t0

    def rate(name, op, local, remote, nbytes):
        cu.current()
        h = a.initialize_xfer(op, local, remote, peer)
        try:
            post(h)
            times = sorted(post(h) for _ in range(args.iters))
            gbs = nbytes / times[len(times) // 2] / 1e9
        except Exception as e:  # a case that fails is reported, the others still run
            print(f"  FAIL {name}: {type(e).__name__} {e}", flush=True)
            gbs = float("nan")
        rows.append((name, gbs))
        return h

    def xd(mem, descs, d):
        return a.get_xfer_descs([(p, n, d) for p, n in descs], mem)

    v = "VRAM"
    rate("VRAM->VRAM READ 1 x 64 MiB", "READ", xd(v, [(lv, BULK)], dev), xd(v, [(t.vram, BULK)], dev), BULK)
    check(sum(cu.read(lv, BULK)) == 3 * BULK, "READ 64 MiB: data")
    cu.fill(lv, BULK, 7)
    rate("VRAM->VRAM WRITE 1 x 64 MiB", "WRITE", xd(v, [(lv, BULK)], dev), xd(v, [(t.vram, BULK)], dev), BULK)
    check(t.sums()[0] == 7 * BULK, "WRITE 64 MiB: data")
    perm = list(range(BLOCKS))
    random.Random(7).shuffle(perm)
    pattern = b"".join(bytes([(i ^ 0x5A) & 0xFF]) * BLOCK for i in range(BLOCKS))
    cu.write(lv, pattern)
    bl = xd(v, [(lv + i * BLOCK, BLOCK) for i in range(BLOCKS)], dev)
    br = xd(v, [(t.vram + j * BLOCK, BLOCK) for j in perm], dev)
    rate("VRAM->VRAM WRITE 1024 x 16 KiB", "WRITE", bl, br, BLOCKS * BLOCK)
    cu.fill(lv, BULK, 0)
    rate("VRAM->VRAM READ 1024 x 16 KiB", "READ", bl, br, BLOCKS * BLOCK)
    check(cu.read(lv, BLOCKS * BLOCK) == pattern, "1024 x 16 KiB WRITE then READ: data")
    hl = xd("DRAM", [(host.ctypes.data, BULK)], 0)
    rate("remote VRAM -> local DRAM (READ) 64 MiB", "READ", hl, xd(v, [(t.vram, BULK)], dev), BULK)
    rate("local DRAM -> remote VRAM (WRITE) 64 MiB", "WRITE", hl, xd(v, [(t.vram, BULK)], dev), BULK)
    cu.fill(lv, BULK, 0x21)
    rd = xd("DRAM", [(t.dram, BULK)], 0)
    rate("local VRAM -> remote DRAM (WRITE) 64 MiB", "WRITE", xd(v, [(lv, BULK)], dev), rd, BULK)
    check(t.sums()[1] == 0x21 * BULK, "VRAM -> remote DRAM: data")
    cu.fill(lv, BULK, 0)
    rate("remote DRAM -> local VRAM (READ) 64 MiB", "READ", xd(v, [(lv, BULK)], dev), rd, BULK)
    check(sum(cu.read(lv, BULK)) == 0x21 * BULK, "remote DRAM -> VRAM: data")

    print(f"\n| case | {args.impl} GB/s |\n|---|---:|")
    for name, gbs in rows:
        print(f"| {name} | {gbs:.2f} |")
    print()

    # Restart with the old handle.
    w = a.initialize_xfer("WRITE", xd(v, [(lv, 4096)], dev), xd(v, [(t.vram, 4096)], dev), peer)
    post(w)
    old = t.vram
    t.kill()
    t0 = time.perf_counter()
    outcome = None
    while time.perf_counter() - t0 < 30:
        try:
            st = a.transfer(w)
            while st == "PROC":
                st = a.check_xfer_state(w)
            outcome = st
        except Exception as e:
            outcome = type(e).__name__
            break
        time.sleep(0.01)
    print(f"  killed target, old handle: {outcome} after {time.perf_counter() - t0:.3f} s")
    t2 = Target(args, 9)
    print(f"  restarted target: VRAM at {t2.vram:#x} ({'same' if t2.vram == old else 'another'} address)")
    try:
        a.remove_remote_agent(peer)
    except Exception as e:
        print(f"  remove_remote_agent: {type(e).__name__}")
    a.add_remote_agent(t2.md)
    try:
        st = a.transfer(w)
        while st == "PROC":
            st = a.check_xfer_state(w)
        print(f"  reloaded, old handle: {st}")
    except Exception as e:
        print(f"  reloaded, old handle: {type(e).__name__}")
    check(t2.sums()[0] == 9 * BULK, "the new incarnation's VRAM is unchanged")
    h = a.initialize_xfer("READ", xd(v, [(lv, BULK)], dev), xd(v, [(t2.vram, BULK)], dev), peer)
    try:
        post(h)
        check(sum(cu.read(lv, BULK)) == 9 * BULK, "new handle READ: data")
    except Exception as e:
        check(False, f"new handle READ: {type(e).__name__} {e}")
    t2.kill()
    print(f"\ngpu_check_nixl ({args.impl}): {failures} failure(s)")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
