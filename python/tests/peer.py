"""Child-process NIXL peer driven over a JSON-lines pipe (see peer_client.py).

The protocol uses the original stdout file descriptor; fd 1 is then pointed at
stderr so that log output from NIXL (Python or native) cannot corrupt it.
Bytes travel as {"__b": "<hex>"}. Every request gets exactly one reply:
{"ok": true, "result": ...} or {"ok": false, "exc": "<class name>", "msg": "..."}.
"""

from __future__ import annotations

import json
import os
import sys
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
    def init(self, name, size=0, fill="zeros", mem="DRAM", telemetry=False, sync_mode=None):
        cfg = {"capture_telemetry": telemetry}
        if sync_mode:
            cfg["sync_mode"] = getattr(api.nixl_thread_sync_t, sync_mode)
        self.agent = api.nixl_agent(name, api.nixl_agent_config(**cfg))
        out = {"name": self.agent.name, "addr": 0, "size": size}
        if size:
            if fill == "arange":
                self.buf = (np.arange(size, dtype=np.uint64) % 251).astype(np.uint8)
            else:
                self.buf = np.full(size, 0 if fill == "zeros" else int(fill), dtype=np.uint8)
            self.reg = self.agent.register_memory([(self.buf.ctypes.data, size, 0, "")], mem)
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

    # -- memory ----------------------------------------------------------------
    def read_buf(self, off=0, length=None):
        end = len(self.buf) if length is None else off + length
        return self.buf[off:end].tobytes()

    def fill_buf(self, value, off=0, length=None):
        end = len(self.buf) if length is None else off + length
        self.buf[off:end] = value
        return None


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
