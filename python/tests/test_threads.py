"""One agent used from several threads, in the shape of vLLM's NIXL connector.

vLLM calls a single agent from the engine thread (make/transfer/check/release,
notifications), a handshake thread (add_remote_agent + prep_xfer_dlist) and,
in push mode, a writer thread, while leaving sync_mode at its default (NONE).
NIXL is only thread-safe with STRICT/RW; gixl promises thread safety always.
"""

from __future__ import annotations

import queue
import threading
import time

import numpy as np
import pytest

from helpers import addr, collect_notifs, pattern

BLK = 4096
NB = 16


def _run_vllm_threads(api, make_agent, sync_mode):
    cfg = dict(capture_telemetry=True, num_threads=2)
    if sync_mode is not None:
        cfg["sync_mode"] = getattr(api.nixl_thread_sync_t, sync_mode)
    decode = make_agent("decode", **cfg)
    dbuf = np.zeros(3 * NB * BLK, dtype=np.uint8)
    decode.register_memory([(addr(dbuf), dbuf.nbytes, 0, "")], "DRAM")
    local = decode.prep_xfer_dlist("NIXL_INIT_AGENT", np.array([[addr(dbuf), BLK, 0, BLK, 3 * NB]], dtype=np.uint64), "DRAM")

    prefills = []
    for i in range(3):
        p = make_agent(f"prefill{i}")
        buf = pattern(NB * BLK, 17 * (i + 1))
        p.register_memory([(addr(buf), buf.nbytes, 0, "")], "DRAM")
        prefills.append((p, buf))

    handshakes: queue.Queue = queue.Queue()
    errors: list = []
    stop = threading.Event()

    def handshake_thread():
        try:
            for i, (p, buf) in enumerate(prefills):
                name = decode.add_remote_agent(p.get_agent_metadata())
                rh = decode.prep_xfer_dlist(name, np.array([[addr(buf), BLK, 0, BLK, NB]], dtype=np.uint64), "DRAM")
                handshakes.put((i, name, rh))
        except Exception as exc:  # pragma: no cover
            errors.append(exc)
            handshakes.put(None)

    def heartbeat_thread(names):
        try:
            while not stop.is_set():
                for name in list(names):
                    decode.send_notif(name, notif_msg=b"HB:x")
                decode.get_new_notifs()
                time.sleep(0.001)
        except Exception as exc:  # pragma: no cover
            errors.append(exc)

    known: list = []
    hs = threading.Thread(target=handshake_thread)
    hb = threading.Thread(target=heartbeat_thread, args=(known,))
    hs.start()
    hb.start()
    try:
        pending = []
        for _ in range(len(prefills)):
            item = handshakes.get(timeout=10)
            assert item is not None, errors
            i, name, rh = item
            known.append(name)
            for blk in range(0, NB, 4):
                lids = np.arange(i * NB + blk, i * NB + blk + 4, dtype=np.int32)
                rids = np.arange(blk, blk + 4, dtype=np.int32)[::-1].copy()
                h = decode.make_prepped_xfer("READ", local, lids, rh, rids, notif_msg=f"req-{i}-{blk}:1".encode())
                decode.transfer(h)
                pending.append(h)
            assert decode.check_remote_metadata(name)
        deadline = time.monotonic() + 10
        while pending:
            for h in list(pending):
                state = decode.check_xfer_state(h)
                assert state in ("PROC", "DONE")
                if state == "DONE":
                    t = decode.get_xfer_telemetry(h)
                    assert t.totalBytes == 4 * BLK
                    decode.release_xfer_handle(h)
                    pending.remove(h)
            assert time.monotonic() < deadline
    finally:
        stop.set()
        hs.join(timeout=10)
        hb.join(timeout=10)
    assert not errors, errors

    for i, (p, buf) in enumerate(prefills):
        for blk in range(NB):
            src_blk = (blk // 4) * 4 + (3 - blk % 4)
            got = dbuf[(i * NB + blk) * BLK : (i * NB + blk + 1) * BLK]
            assert (got == buf[src_blk * BLK : (src_blk + 1) * BLK]).all(), (i, blk)
        want = {f"req-{i}-{b}:1".encode() for b in range(0, NB, 4)}
        seen: list = []
        deadline = time.monotonic() + 5
        while not want <= set(seen):
            seen += collect_notifs(p, 1, timeout=0.2).get(decode.name, [])
            assert time.monotonic() < deadline, (want, seen[:10])
        reqs = [m for m in seen if not m.startswith(b"HB:")]
        assert sorted(reqs) == sorted(want)  # each exactly once
    for name in known:
        decode.remove_remote_agent(name)
        assert not decode.check_remote_metadata(name)


def test_vllm_threads_strict(api, make_agent):
    _run_vllm_threads(api, make_agent, "NIXL_THREAD_SYNC_STRICT")


@pytest.mark.gixl_native
def test_vllm_threads_default_sync_mode(api, make_agent):
    _run_vllm_threads(api, make_agent, None)


def test_nixl_package_top_level(api):
    import importlib

    pkg = importlib.import_module(api.__name__.rsplit(".", 1)[0])
    for name in (
        "DEFAULT_COMM_PORT",
        "nixl_agent",
        "nixl_agent_config",
        "nixl_backend_handle",
        "nixl_prepped_dlist_handle",
        "nixl_thread_sync_t",
        "nixl_xfer_handle",
    ):
        assert getattr(pkg, name) is getattr(api, name), name
