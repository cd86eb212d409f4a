"""Two-process scenarios in the shapes real consumers use (vLLM, SGLang, LMCache).

Every peer is a child process (peer.py) driven over a pipe; every call has a timeout
and all children are killed at teardown.
"""

from __future__ import annotations

import threading
import time
import uuid

import numpy as np
import pytest

from helpers import addr, wait_done
from peer_client import PeerError

pytestmark = pytest.mark.two_process

BLK = 16 * 1024
NB = 8  # blocks per region; two regions (K and V) per peer


def _name(prefix):
    return f"{prefix}-{uuid.uuid4()}"


def _rows(base, nb=NB, blk=BLK, regions=2):
    return [[base + r * nb * blk, blk, 0, blk, nb] for r in range(regions)]


def _start(peers, **inits):
    """Spawn one peer per keyword and initialise them concurrently."""
    procs = {label: peers(label) for label in inits}
    for label, kw in inits.items():
        procs[label].send("init", **kw)
    infos = {label: procs[label].recv() for label in inits}
    return procs, infos


def _expect_peer_error(exc_name, fn, *a, **kw):
    with pytest.raises(PeerError) as info:
        fn(*a, **kw)
    assert info.value.exc == exc_name, info.value
    return info.value


def test_vllm_pull_pattern(peers):
    procs, infos = _start(
        peers,
        prefill=dict(name=_name("prefill"), size=2 * NB * BLK, fill="arange"),
        decode=dict(name=_name("decode"), size=2 * NB * BLK, fill="zeros", telemetry=True),
    )
    P, D = procs["prefill"], procs["decode"]
    p, d = infos["prefill"], infos["decode"]

    # metadata travels out of band as bytes; add_remote_agent returns the name as bytes
    name = D.add_remote(md=p["md"])
    assert name == p["name"].encode()
    assert D.add_remote(md=p["md"]) == name  # idempotent

    local = D.prep(side="NIXL_INIT_AGENT", rows=_rows(d["addr"]))
    remote = D.prep(side=name, rows=_rows(p["addr"]))
    # request: decode blocks 0..2 of both regions <- prefill blocks 5..7 of both regions
    lids = [0, 1, 2, NB + 0, NB + 1, NB + 2]
    rids = [5, 6, 7, NB + 5, NB + 6, NB + 7]
    x = D.make(op="READ", lh=local, lidx=lids, rh=remote, ridx=rids, notif=b"req-1:1", dtype="int32")
    assert D.post(xid=x) in ("DONE", "PROC")
    states = D.wait(xid=x)
    assert states[-1] == "DONE" and set(states) <= {"PROC", "DONE"}

    pbuf, dbuf = P.read_buf(), D.read_buf()
    for li, ri in zip(lids, rids):
        assert dbuf[li * BLK : (li + 1) * BLK] == pbuf[ri * BLK : (ri + 1) * BLK]
    assert dbuf[3 * BLK : NB * BLK] == bytes((NB - 3) * BLK)

    assert P.notifs(count=1) == {d["name"]: [b"req-1:1"]}

    t = D.telemetry(xid=x)
    assert t["totalBytes"] == len(lids) * BLK
    assert 1 <= t["descCount"] <= len(lids)
    D.release_xfer(xid=x)

    # heartbeat and "done reading" notifications over send_notif, bytes name
    D.send_notif(name=name, msg=b"HB:req-2,req-3")
    D.send_notif(name=name, msg=b"req-2:1")
    assert P.notifs(count=2) == {d["name"]: [b"HB:req-2,req-3", b"req-2:1"]}

    # shutdown order used by vLLM
    D.release_dlist(did=remote)
    D.release_dlist(did=local)
    D.remove_remote(name=name)
    assert D.check_md(name=name) is False


def test_vllm_many_requests_reuse_prepped_lists(peers):
    procs, infos = _start(
        peers,
        prefill=dict(name=_name("prefill"), size=2 * NB * BLK, fill="arange"),
        decode=dict(name=_name("decode"), size=2 * NB * BLK, fill="zeros"),
    )
    P, D = procs["prefill"], procs["decode"]
    name = D.add_remote(md=infos["prefill"]["md"])
    local = D.prep(side="", rows=_rows(infos["decode"]["addr"]))
    remote = D.prep(side=name, rows=_rows(infos["prefill"]["addr"]))
    xs = []
    for req in range(NB):
        xs.append(
            D.make(op="READ", lh=local, lidx=[req, NB + req], rh=remote, ridx=[NB - 1 - req, 2 * NB - 1 - req],
                   notif=f"req-{req}:1".encode())
        )
    for x in xs:
        D.post(xid=x)
    for x in xs:
        assert D.wait(xid=x)[-1] == "DONE"
    got = P.notifs(count=NB)
    assert sorted(got[infos["decode"]["name"]]) == sorted(f"req-{r}:1".encode() for r in range(NB))
    pbuf, dbuf = P.read_buf(), D.read_buf()
    for req in range(NB):
        src = NB - 1 - req
        assert dbuf[req * BLK : (req + 1) * BLK] == pbuf[src * BLK : (src + 1) * BLK]


def test_peer_sigkill_and_restart_same_name(peers):
    pname = _name("prefill")
    procs, infos = _start(
        peers,
        prefill=dict(name=pname, size=2 * NB * BLK, fill="arange"),
        decode=dict(name=_name("decode"), size=2 * NB * BLK, fill="zeros"),
    )
    P, D = procs["prefill"], procs["decode"]
    name = D.add_remote(md=infos["prefill"]["md"])
    local = D.prep(side="", rows=_rows(infos["decode"]["addr"]))
    remote = D.prep(side=name, rows=_rows(infos["prefill"]["addr"]))
    read = D.make(op="READ", lh=local, lidx=[0], rh=remote, ridx=[1], notif=b"r1")
    write = D.make(op="WRITE", lh=local, lidx=[0, 1], rh=remote, ridx=[2, 3])
    D.post(xid=read)
    assert D.wait(xid=read)[-1] == "DONE"

    P.kill()

    # the dead peer surfaces as nixlRemoteDisconnectError from transfer/check_xfer_state
    deadline = time.monotonic() + 5
    err = None
    while err is None:
        try:
            D.post(xid=read)
            D.wait(xid=read, timeout=1)
        except PeerError as exc:
            err = exc
        assert time.monotonic() < deadline, "no error from a killed peer"
    assert err.exc == "nixlRemoteDisconnectError"
    # NIXL 1.5 semantics: the metadata is NOT dropped automatically
    assert D.check_md(name=name) is True
    _expect_peer_error("nixlRemoteDisconnectError", D.send_notif, name=name, msg=b"HB:x")

    # restart under the same name: new connection info, different memory
    P2 = peers("prefill2")
    p2 = P2.init(name=pname, size=2 * NB * BLK, fill="7")
    _expect_peer_error("nixlNotAllowedError", D.add_remote, md=p2["md"])  # must remove first
    D.remove_remote(name=name)
    D.remove_remote(name=name)
    assert D.check_md(name=name) is False
    _expect_peer_error("nixlNotFoundError", D.post, xid=read)
    assert D.add_remote(md=p2["md"]) == name

    # old handles and old remote prepped lists are stale
    _expect_peer_error("nixlNotFoundError", D.post, xid=read)
    _expect_peer_error("nixlNotFoundError", D.post, xid=write)
    _expect_peer_error("nixlNotFoundError", D.make, op="READ", lh=local, lidx=[0], rh=remote, ridx=[0])

    # new handles work
    remote2 = D.prep(side=name, rows=_rows(p2["addr"]))
    x2 = D.make(op="READ", lh=local, lidx=[4, 5], rh=remote2, ridx=[0, NB], notif=b"req-2:1")
    D.post(xid=x2)
    assert D.wait(xid=x2)[-1] == "DONE"
    assert D.read_buf(off=4 * BLK, length=2 * BLK) == b"\x07" * (2 * BLK)
    assert P2.notifs(count=1) == {infos["decode"]["name"]: [b"req-2:1"]}

    # the stale WRITE never reached the new incarnation
    _expect_peer_error("nixlNotFoundError", D.post, xid=write)
    assert P2.read_buf() == b"\x07" * (2 * NB * BLK)
    D.release_xfer(xid=read)
    D.release_xfer(xid=write)
    D.release_dlist(did=remote)


def test_restart_churn_with_stale_handles(peers):
    """Repeated kill/restart at the same name while stale handles keep being posted.

    Required (NIXL 1.5.1 passes this too): no crash, stale handles fail (NOT_FOUND or REMOTE_DISCONNECT), and no
    byte ever reaches a later incarnation through a handle made for an earlier one.
    """
    pname = _name("prefill")
    procs, infos = _start(
        peers,
        prefill=dict(name=pname, size=2 * NB * BLK, fill="1"),
        decode=dict(name=_name("decode"), size=2 * NB * BLK, fill="9"),
    )
    D, P, info = procs["decode"], procs["prefill"], infos["prefill"]
    local = D.prep(side="", rows=_rows(infos["decode"]["addr"]))
    stale = []
    for gen in range(3):
        name = D.add_remote(md=info["md"])
        remote = D.prep(side=name, rows=_rows(info["addr"]))
        w = D.make(op="WRITE", lh=local, lidx=[0], rh=remote, ridx=[gen])
        D.post(xid=w)
        assert D.wait(xid=w)[-1] == "DONE"
        for old in stale:
            _expect_peer_error("nixlNotFoundError", D.post, xid=old)
        stale.append(w)
        P.kill()
        for old in stale:  # posting to a dead peer must fail cleanly
            try:
                D.post(xid=old)
                D.wait(xid=old, timeout=1)
            except PeerError as exc:
                assert exc.exc in ("nixlNotFoundError", "nixlRemoteDisconnectError")
        D.remove_remote(name=name)
        P = peers(f"prefill-gen{gen + 1}")
        info = P.init(name=pname, size=2 * NB * BLK, fill=str(10 + gen))
        D.add_remote(md=info["md"])
        for old in stale:
            _expect_peer_error("nixlNotFoundError", D.post, xid=old)
        assert P.read_buf() == bytes([10 + gen]) * (2 * NB * BLK)
        D.remove_remote(name=name)
    assert D.check_md(name=pname) is False


def test_sglang_shape_strict_threads_write(peers, api, make_agent):
    procs, infos = _start(peers, decode=dict(name=_name("decode"), size=2 * NB * BLK, fill="zeros"))
    D = procs["decode"]
    d = infos["decode"]
    P = make_agent(
        "prefill", backends=[], num_threads=2, sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
    )
    assert "UCX" in P.get_plugin_list()
    P.create_backend("UCX", {"num_threads": "2"})
    src = ((np.arange(2 * NB * BLK) * 13) % 251).astype(np.uint8)
    reg = P.register_memory([(addr(src), src.nbytes, 0, "")], "DRAM")
    assert reg
    name = P.add_remote_agent(d["md"])
    assert P.add_remote_agent(d["md"]) == name

    # prepped Nx5 path for KV, non-prepped initialize_xfer path for aux data
    local = P.prep_xfer_dlist("", np.array(_rows(addr(src)), dtype=np.uint64), "DRAM")
    remote = P.prep_xfer_dlist(name, np.array(_rows(d["addr"]), dtype=np.uint64), "DRAM")
    errors = []

    def worker(k):
        try:
            # KV: WRITE block k of both regions with no notification
            idx = np.array([k, NB + k], dtype=np.int64)
            h = P.make_prepped_xfer("WRITE", local, idx, remote, idx)
            assert h
            assert P.transfer(h) in ("DONE", "PROC")
            assert wait_done(P, h) == "DONE"
            P.release_xfer_handle(h)
            assert P.check_remote_metadata(name)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def aux_worker(k):
        try:
            off = (NB // 2 + k) * BLK + 100
            l = P.get_xfer_descs(np.array([[addr(src, off), 200, 0]], dtype=np.uint64), "DRAM")
            r = P.get_xfer_descs([(d["addr"] + off, 200, 0)], "DRAM")
            h = P.initialize_xfer("WRITE", l, r, name)
            if P.transfer(h) == "ERR":
                raise RuntimeError("transfer ERR")
            assert wait_done(P, h) == "DONE"
            P.release_xfer_handle(h)
        except Exception as exc:  # pragma: no cover
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(NB // 2)]
    threads += [threading.Thread(target=aux_worker, args=(k,)) for k in range(NB // 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    dbuf = np.frombuffer(D.read_buf(), dtype=np.uint8)
    for k in range(NB // 2):
        for blk in (k, NB + k):
            assert (dbuf[blk * BLK : (blk + 1) * BLK] == src[blk * BLK : (blk + 1) * BLK]).all()
        off = (NB // 2 + k) * BLK + 100
        assert (dbuf[off : off + 200] == src[off : off + 200]).all()
    assert not dbuf[(NB // 2) * BLK : (NB // 2) * BLK + 100].any()


def test_lmcache_shape_pickled_dlists_cpu(peers, make_agent, bind):
    page = 4096
    npages = 8
    procs, infos = _start(peers, remote=dict(name=_name("lmc-remote"), size=npages * page, fill="zeros", mem="cpu"))
    R = procs["remote"]
    r = infos["remote"]
    L = make_agent("lmc-local", backends=["UCX"])
    buf = ((np.arange(npages * page) * 3 + 1) % 251).astype(np.uint8)
    reg = L.get_reg_descs([(addr(buf), buf.nbytes, 0, "")], mem_type="cpu")
    L.register_memory(reg)
    name = L.add_remote_agent(r["md"])
    assert L.add_remote_agent(r["md"]) == name  # "learn the peer (idempotent on repeat)"

    # the remote side's page descriptors arrive pickled
    blob = R.serialized_descs(rows=[(r["addr"] + i * page, page, 0) for i in range(npages)], mem="cpu")
    remote_descs = L.deserialize_descs(blob)
    assert isinstance(remote_descs, bind.nixlXferDList)
    assert remote_descs.descCount() == npages
    assert remote_descs.getType() == bind.DRAM_SEG
    assert remote_descs[3] == (r["addr"] + 3 * page, page, 0)
    assert remote_descs == L.get_xfer_descs([(r["addr"] + i * page, page, 0) for i in range(npages)], "cpu")

    local_descs = L.get_xfer_descs([(addr(buf, i * page), page, 0) for i in range(npages)], "cpu")
    lh = L.prep_xfer_dlist("", local_descs, "cpu")
    rh = L.prep_xfer_dlist(name, remote_descs)
    h = L.make_prepped_xfer("WRITE", lh, [1, 2, 5], rh, [0, 1, 7])
    state = L.transfer(h)
    while state != "DONE":
        state = L.check_xfer_state(h)
        assert state != "ERR"
    rbuf = np.frombuffer(R.read_buf(), dtype=np.uint8)
    for li, ri in ((1, 0), (2, 1), (5, 7)):
        assert (rbuf[ri * page : (ri + 1) * page] == buf[li * page : (li + 1) * page]).all()
    # read back into another local page
    buf[6 * page : 7 * page] = 0
    h2 = L.make_prepped_xfer("READ", lh, [6], rh, [7])
    L.transfer(h2)
    assert wait_done(L, h2) == "DONE"
    assert (buf[6 * page : 7 * page] == buf[5 * page : 6 * page]).all()
    L.release_xfer_handle(h)
    L.release_xfer_handle(h2)
    L.deregister_memory(reg)
