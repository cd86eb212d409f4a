"""Child-process NIXL peer driven over a JSON-lines pipe (see peer_client.py).

The protocol uses the original stdout file descriptor; fd 1 is then pointed at
stderr so that log output from NIXL (Python or native) cannot corrupt it.
Bytes travel as {"__b": "<hex>"}. Every request gets exactly one reply:
{"ok": true, "result": ...} or {"ok": false, "exc": "<class name>", "msg": "..."}.
"""

from __future__ import annotations

import ctypes
import gc
import hashlib
import json
import os
import sys
import threading
import time
import traceback

_proto = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
sys.stdout = sys.stderr

import numpy as np  # noqa: E402

import _impl  # noqa: E402
from _wire import dec, enc  # noqa: E402

M = _impl.load(os.environ["GIXL_TEST_IMPL"], os.environ.get("GIXL_TEST_BINDINGS", "native"))
api, bind = M.api, M.bind


class Peer:
    def __init__(self):
        self.agent = None
        self.buf = None
        self.reg = None
        self.dlists = {}
        self.xfers = {}
        self.next_id = 1

    def _id(self):
        self.next_id += 1
        return self.next_id

    # -- setup -----------------------------------------------------------
    def init(
        self,
        name,
        size=0,
        fill="zeros",
        mem="DRAM",
        telemetry=False,
        sync_mode=None,
        fixed_addr=0,
        listen_port=None,
        regions=1,
        fake_vram_device=None,
    ):
        cfg = {"capture_telemetry": telemetry}
        if listen_port is not None:
            cfg.update(enable_listen_thread=True, listen_port=listen_port)
        if sync_mode:
            cfg["sync_mode"] = getattr(api.nixl_thread_sync_t, sync_mode)
        self.agent = api.nixl_agent(name, api.nixl_agent_config(**cfg))
        out = {"name": self.agent.name, "addr": 0, "size": size}
        dev = 0
        if size:
            if fake_vram_device is not None:
                # gixl only, in a process started with GIXL_FAKE_DEVICE=1: emulated device memory.
                from gixl import _gixl

                dev = fake_vram_device
                at = _gixl._fake_device_alloc(dev, size)
                self.buf = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(at))
                self.buf[:] = 0 if fill == "zeros" else int(fill)
            elif fixed_addr:
                # the same virtual address in every incarnation (the fault suite's same-VA restart)
                self.buf = _map_fixed(fixed_addr, size)
                self.buf[:] = 0 if fill == "zeros" else int(fill)
            elif fill == "arange":
                self.buf = (np.arange(size, dtype=np.uint64) % 251).astype(np.uint8)
            else:
                self.buf = np.full(size, 0 if fill == "zeros" else int(fill), dtype=np.uint8)
            step = size // regions
            rows = [(self.buf.ctypes.data + i * step, step, dev, "") for i in range(regions)]
            self.reg = self.agent.register_memory(rows, mem)
            out["addr"] = int(self.buf.ctypes.data)
        out["md"] = self.agent.get_agent_metadata()
        out["pid"] = os.getpid()
        return out

    def md(self):
        return self.agent.get_agent_metadata()

    def add_remote(self, md):
        return self.agent.add_remote_agent(md)

    def remove_remote(self, name):
        return self.agent.remove_remote_agent(name)

    def check_md(self, name):
        return self.agent.check_remote_metadata(name)

    def fetch_md(self, name, ip, port):
        self.agent.fetch_remote_metadata(name, ip, port)

    def send_md(self, ip, port):
        self.agent.send_local_metadata(ip, port)

    def invalidate_md(self, ip, port):
        self.agent.invalidate_local_metadata(ip, port)

    # -- descriptor lists and transfers ----------------------------------
    def prep(self, side, rows, mem="DRAM", width=None):
        arr = np.asarray(rows, dtype=np.uint64).reshape(-1, width or len(rows[0]))
        h = self.agent.prep_xfer_dlist(side, arr, mem)
        i = self._id()
        self.dlists[i] = h
        return i

    def make(self, op, lh, lidx, rh, ridx, notif=b"", dtype="int32"):
        h = self.agent.make_prepped_xfer(
            op,
            self.dlists[lh],
            np.asarray(lidx, dtype=dtype),
            self.dlists[rh],
            np.asarray(ridx, dtype=dtype),
            notif_msg=notif,
        )
        i = self._id()
        self.xfers[i] = h
        return i

    def post(self, xid, notif=b""):
        return self.agent.transfer(self.xfers[xid], notif)

    def wait(self, xid, timeout=5.0):
        deadline = time.monotonic() + timeout
        states = []
        while True:
            s = self.agent.check_xfer_state(self.xfers[xid])
            if not states or states[-1] != s:
                states.append(s)
            if s != "PROC" or time.monotonic() > deadline:
                return states
            time.sleep(0.001)

    def telemetry(self, xid):
        t = self.agent.get_xfer_telemetry(self.xfers[xid])
        return {k: int(getattr(t, k)) for k in ("startTime", "postDuration", "xferDuration", "totalBytes", "descCount")}

    def release_xfer(self, xid):
        self.agent.release_xfer_handle(self.xfers[xid])

    def release_dlist(self, did):
        self.agent.release_dlist_handle(self.dlists[did])

    # -- notifications -------------------------------------------------------
    def send_notif(self, name, msg):
        self.agent.send_notif(name, notif_msg=msg)

    def notifs(self, count=1, timeout=3.0):
        out = {}
        total = 0
        deadline = time.monotonic() + timeout
        while total < count and time.monotonic() < deadline:
            for k, msgs in self.agent.get_new_notifs().items():
                out.setdefault(k, []).extend(msgs)
                total += len(msgs)
            if total < count:
                time.sleep(0.002)
        return out

    def serialized_descs(self, rows, mem="DRAM"):
        dl = self.agent.get_xfer_descs([tuple(int(x) for x in r) for r in rows], mem)
        return self.agent.get_serialized_descs(dl)

    # -- fault injection (test_faults.py / fault_matrix.py) ----------------------
    def kill_during_xfer(self, xid, pid, delay=0.002, sig=9, timeout=30.0):
        """Post while a timer thread signals ``pid`` (the peer) ``delay`` s later, so the kill lands while the
        transfer runs (inside transfer() when it copies inline); poll to the end. Returns the post status or
        exception, the final state or exception, and the seconds from the kill to the final answer."""
        killed = []

        def killer():
            time.sleep(delay)
            os.kill(pid, sig)
            killed.append(time.monotonic())

        t = threading.Thread(target=killer)
        t.start()
        out = {"post": None, "final": None, "s": None}
        try:
            out["post"] = self.agent.transfer(self.xfers[xid])
        except Exception as exc:
            out["post"] = type(exc).__name__
        t.join()
        if out["post"] in ("DONE", "PROC"):
            try:
                states = self.wait(xid, timeout=timeout)
                out["final"] = "hang (PROC)" if states[-1] == "PROC" else states[-1]
            except Exception as exc:
                out["final"] = type(exc).__name__
        out["s"] = time.monotonic() - killed[0]
        return out

    def remove_during_xfer(self, xid, name, delay=0.0, timeout=10.0):
        """remove_remote_agent from a second thread ``delay`` s after the post starts (so it lands inside an
        inline transfer() or while the transfer is in progress); poll to the end."""
        out = {"post": None, "remove": None, "poll": None}

        def remover():
            if delay:
                time.sleep(delay)
            try:
                self.agent.remove_remote_agent(name)
                out["remove"] = "ok"
            except Exception as exc:
                out["remove"] = type(exc).__name__

        t = threading.Thread(target=remover)
        t.start()
        try:
            out["post"] = self.agent.transfer(self.xfers[xid])
        except Exception as exc:
            out["post"] = type(exc).__name__
            t.join(timeout)
            return out
        deadline = time.monotonic() + timeout
        try:
            while True:
                s = self.agent.check_xfer_state(self.xfers[xid])
                if s != "PROC":
                    out["poll"] = s
                    break
                if time.monotonic() > deadline:
                    out["poll"] = "hang (PROC)"
                    break
        except Exception as exc:
            out["poll"] = type(exc).__name__
        t.join(timeout)
        if t.is_alive():
            out["remove"] = "hang"
        return out

    def add_remove_storm(self, md, name, threads=4, iters=50):
        """Threads adding and removing the same peer concurrently; counts of each outcome."""
        counts = {}
        lock = threading.Lock()

        def worker(k):
            for i in range(iters):
                try:
                    if (i + k) % 2:
                        self.agent.add_remote_agent(md)
                        what = "add:ok"
                    else:
                        self.agent.remove_remote_agent(name)
                        what = "remove:ok"
                except Exception as exc:
                    what = f"{'add' if (i + k) % 2 else 'remove'}:{type(exc).__name__}"
                with lock:
                    counts[what] = counts.get(what, 0) + 1

        ts = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        if any(t.is_alive() for t in ts):
            counts["hang"] = 1
        return counts

    def soak_cycles(self, name, raddr, n, blk=4096, nb=8):
        """``n`` cycles of register -> prep both sides -> make READ -> transfer -> wait -> release everything ->
        deregister, against the loaded peer ``name`` (its buffer at ``raddr``). Returns how many ended DONE."""
        done = 0
        for _ in range(n):
            buf = np.zeros(blk * nb, dtype=np.uint8)
            reg = self.agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
            loc = self.agent.prep_xfer_dlist("", [(buf.ctypes.data + i * blk, blk, 0) for i in range(nb)], "DRAM")
            rem = self.agent.prep_xfer_dlist(name, [(raddr + i * blk, blk, 0) for i in range(nb)], "DRAM")
            x = self.agent.make_prepped_xfer("READ", loc, list(range(nb)), rem, list(range(nb)), notif_msg=b"soak")
            s = self.agent.transfer(x)
            while s == "PROC":
                s = self.agent.check_xfer_state(x)
            done += s == "DONE"
            self.agent.release_xfer_handle(x)
            self.agent.release_dlist_handle(loc)
            self.agent.release_dlist_handle(rem)
            self.agent.deregister_memory(reg)
        return done

    def drain_notifs(self):
        return sum(len(v) for v in self.agent.get_new_notifs().values())

    def digest(self):
        return hashlib.sha256(memoryview(self.buf)).hexdigest()

    def rss_fds(self):
        rss = 0
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1])
        return {"rss_kb": rss, "fds": len(os.listdir("/proc/self/fd"))}

    def release_all(self):
        for h in self.xfers.values():
            try:
                self.agent.release_xfer_handle(h)
            except Exception:
                pass
        for h in self.dlists.values():
            try:
                self.agent.release_dlist_handle(h)
            except Exception:
                pass
        self.xfers.clear()
        self.dlists.clear()

    # -- exactness (test_exact.py) ------------------------------------------------
    def recreate(self, fill):
        """Destroy the agent and create a new one under the same name in this process, registering the same
        buffer (same virtual address) filled with ``fill``: the same-process re-creation case."""
        name = self.agent.name
        self.release_all()
        self.agent.deregister_memory(self.reg)
        self.agent = self.reg = None
        gc.collect()
        self.agent = api.nixl_agent(name, api.nixl_agent_config())
        self.buf[:] = fill
        self.reg = self.agent.register_memory([(self.buf.ctypes.data, self.buf.nbytes, 0, "")], "DRAM")
        return {"md": self.agent.get_agent_metadata(), "addr": int(self.buf.ctypes.data)}

    def reexec(self):
        """Reply, then exec this very script in place (same pid, same start time, a new image); the new image
        serves the same pipe. ASLR stays off if it was (personality survives exec)."""
        _proto.write(json.dumps({"ok": True, "result": None}) + "\n")
        _proto.flush()
        os.dup2(_proto.fileno(), 1)
        os.execv(sys.executable, [sys.executable, os.path.abspath(__file__)])

    def personality(self):
        with open("/proc/self/personality") as f:
            return int(f.read(), 16)

    def unmap_page(self, off):
        """munmap one page of the (fixed-address) buffer: a registered range the process no longer maps."""
        libc = ctypes.CDLL(None, use_errno=True)
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        if libc.munmap(int(self.buf.ctypes.data) + off, 4096) != 0:
            raise OSError(ctypes.get_errno(), "munmap")

    def dereg_when_written(self, off, sentinel, timeout=10.0, untouched=None):
        """Wait until byte ``off`` of the buffer differs from ``untouched`` (default: its value now), i.e. a
        transfer is writing it, deregister the buffer, then fill the whole buffer with ``sentinel``. Returns the
        seconds deregister_memory took. Give ``untouched`` when the transfer may start before this runs."""
        before = int(self.buf[off]) if untouched is None else untouched
        deadline = time.monotonic() + timeout
        while int(self.buf[off]) == before:
            if time.monotonic() > deadline:
                raise TimeoutError("no transfer wrote the buffer")
        t0 = time.monotonic()
        self.agent.deregister_memory(self.reg)
        took = time.monotonic() - t0
        self.reg = None
        self.buf[:] = sentinel
        return took

    def count_not(self, value):
        """Bytes of the buffer that differ from ``value``."""
        return int(np.count_nonzero(self.buf != value))

    def xfer_outcome(self, xid, timeout=20.0):
        """Post (already done by the caller or not) and poll ``xid`` to its end: the final state or exception."""
        try:
            states = self.wait(xid, timeout=timeout)
            return "hang (PROC)" if states[-1] == "PROC" else states[-1]
        except Exception as exc:
            return type(exc).__name__

    def post_outcome(self, xid, timeout=20.0):
        """transfer() then poll to the end; the post's result or exception, then the final one."""
        try:
            s = self.agent.transfer(self.xfers[xid])
        except Exception as exc:
            return type(exc).__name__
        if s == "ERR":
            return "ERR"
        return self.xfer_outcome(xid, timeout)

    def make_new(self, op, name, local, remote, notif=b"", mem="DRAM"):
        """initialize_xfer with explicit descriptor rows, as a fresh request id (or the exception name)."""
        try:
            h = self.agent.initialize_xfer(
                op,
                self.agent.get_xfer_descs([tuple(int(x) for x in r) for r in local], mem),
                self.agent.get_xfer_descs([tuple(int(x) for x in r) for r in remote], mem),
                name,
                notif,
            )
        except Exception as exc:
            return type(exc).__name__
        i = self._id()
        self.xfers[i] = h
        return i

    # -- memory ----------------------------------------------------------------
    def read_buf(self, off=0, length=None):
        end = len(self.buf) if length is None else off + length
        return self.buf[off:end].tobytes()

    def fill_buf(self, value, off=0, length=None):
        end = len(self.buf) if length is None else off + length
        self.buf[off:end] = value
        return None


def _map_fixed(addr, size):
    """Anonymous mapping at exactly ``addr`` (MAP_FIXED_NOREPLACE), viewed as a uint8 array."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    prot = 0x1 | 0x2  # PROT_READ | PROT_WRITE
    flags = 0x02 | 0x20 | 0x100000  # MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE
    p = libc.mmap(addr, size, prot, flags, -1, 0)
    if p is None or p == ctypes.c_void_p(-1).value or p != addr:
        raise OSError(ctypes.get_errno(), f"mmap at {addr:#x} gave {p!r}")
    return np.frombuffer((ctypes.c_uint8 * size).from_address(p), dtype=np.uint8)


def main():
    peer = Peer()
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        req = dec(json.loads(line))
        cmd = req.pop("cmd")
        if cmd == "exit":
            _proto.write(json.dumps({"ok": True, "result": None}) + "\n")
            _proto.flush()
            break
        try:
            result = getattr(peer, cmd)(**req)
            reply = {"ok": True, "result": enc(result)}
        except Exception as exc:  # report, keep serving
            traceback.print_exc(file=sys.stderr)
            reply = {"ok": False, "exc": type(exc).__name__, "msg": str(exc)}
        _proto.write(json.dumps(reply) + "\n")
        _proto.flush()
    os._exit(0)  # skip interpreter teardown (agent destructors) for speed


if __name__ == "__main__":
    main()
