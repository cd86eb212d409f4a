"""Direct use of nixl._bindings.nixlAgent (as NIXL's own test_nixl_bindings.py does).

These pin down the raw binding contract that nixl._api builds on: which calls
return a nixl_status_t and which raise, handle types, and map semantics.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import conftest
from helpers import addr


@pytest.fixture
def raw(bind):
    cfg = bind.nixlAgentConfig()
    cfg.useProgThread = False
    a_name = conftest.unique_name("rawA")
    a = bind.nixlAgent(a_name, cfg)
    b = bind.nixlAgent(conftest.unique_name("rawB"), bind.nixlAgentConfig(True))
    ha = a.createBackend("UCX", {})
    hb = b.createBackend("UCX", {})
    return a, b, ha, hb, a_name


def test_backend_and_plugin_queries(raw, bind):
    a, _, ha, _, _ = raw
    assert isinstance(ha, int) and ha != 0
    plugins = a.getAvailPlugins()
    assert isinstance(plugins, list) and "UCX" in plugins
    params, mems = a.getBackendParams(ha)
    assert isinstance(params, dict) and "DRAM_SEG" in mems
    params, mems = a.getPluginParams("UCX")
    assert isinstance(params, dict) and params and "DRAM_SEG" in mems
    with pytest.raises(bind.nixlNotFoundError):
        a.getPluginParams("UVX")
    with pytest.raises(bind.nixlNotFoundError):
        a.createBackend("UVX", {})


def test_raw_transfer_flow(raw, bind):
    a, b, ha, hb, a_name = raw
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(64, dtype=np.uint8)
    rs = bind.nixlRegDList(bind.DRAM_SEG, [(addr(src), 64, 0, "")])
    rd = bind.nixlRegDList(bind.DRAM_SEG, [(addr(dst), 64, 0, "")])
    assert a.registerMem(rs, [ha]) == bind.NIXL_SUCCESS
    assert b.registerMem(rd) == bind.NIXL_SUCCESS
    b_md = b.getLocalMD()
    assert isinstance(b_md, bytes)
    name = a.loadRemoteMD(b_md)
    assert isinstance(name, bytes)
    assert a.checkRemoteMD(name.decode(), bind.nixlXferDList(bind.DRAM_SEG)) == bind.NIXL_SUCCESS
    assert a.checkRemoteMD("nobody", bind.nixlXferDList(bind.DRAM_SEG)) == bind.NIXL_ERR_NOT_FOUND
    assert a.makeConnection(name.decode(), []) == bind.NIXL_SUCCESS

    l = bind.nixlXferDList(bind.DRAM_SEG, [(addr(src), 8, 0)])
    r = bind.nixlXferDList(bind.DRAM_SEG, [(addr(dst), 8, 0)])
    x = a.createXferReq(bind.NIXL_WRITE, l, r, name.decode(), "n\0tification", [ha])
    assert isinstance(x, int) and x != 0
    est = a.estimateXferCost(x)
    assert isinstance(est, tuple) and len(est) == 3
    assert a.queryXferBackend(x) == ha
    status = a.postXferReq(x)
    assert status in (bind.NIXL_SUCCESS, bind.NIXL_IN_PROG)
    assert isinstance(status, bind.nixl_status_t)
    deadline = time.monotonic() + 5
    while status != bind.NIXL_SUCCESS:
        status = a.getXferStatus(x)
        assert status in (bind.NIXL_SUCCESS, bind.NIXL_IN_PROG)
        assert time.monotonic() < deadline
    assert (dst[:8] == src[:8]).all()

    # getNotifs appends into a copy of the given map; keys are the sender's name
    seed = {"pre": [b"x"]}
    got = {}
    deadline = time.monotonic() + 5
    while a_name not in got:
        got = b.getNotifs(seed)
        assert time.monotonic() < deadline
    assert seed == {"pre": [b"x"]}
    assert got == {"pre": [b"x"], a_name: [b"n\x00tification"]}

    assert a.genNotif(name.decode(), b"hi") == bind.NIXL_SUCCESS
    deadline = time.monotonic() + 5
    got = {}
    while not got:
        got = b.getNotifs({}, [hb])
        assert time.monotonic() < deadline
    assert got == {a_name: [b"hi"]}

    assert a.releaseXferReq(x) == bind.NIXL_SUCCESS
    assert a.deregisterMem(rs, [ha]) == bind.NIXL_SUCCESS
    assert a.invalidateRemoteMD(name.decode()) == bind.NIXL_SUCCESS
    # invalidateRemoteMD reports failures as a status, without raising
    assert a.invalidateRemoteMD(name.decode()) == bind.NIXL_ERR_NOT_FOUND


def test_prepped_raw(raw, bind):
    a, b, ha, _, _ = raw
    src = np.arange(256, dtype=np.uint8)
    dst = np.zeros(256, dtype=np.uint8)
    a.registerMem(bind.nixlRegDList(bind.DRAM_SEG, [(addr(src), 256, 0, "")]))
    b.registerMem(bind.nixlRegDList(bind.DRAM_SEG, [(addr(dst), 256, 0, "")]))
    name = a.loadRemoteMD(b.getLocalMD()).decode()
    l = bind.nixlXferDList(bind.DRAM_SEG, [(addr(src, 64 * i), 64, 0) for i in range(4)])
    r = bind.nixlXferDList(bind.DRAM_SEG, [(addr(dst, 64 * i), 64, 0) for i in range(4)])
    lh = a.prepXferDlist(bind.NIXL_INIT_AGENT, l, [])
    lh2 = a.prepXferDlist(l)  # overload without an agent name: local side
    rh = a.prepXferDlist(name, r)
    rh5 = a.prepXferDlist(name, bind.DRAM_SEG, np.array([[addr(dst), 64, 0, 64, 4]], dtype=np.uint64), [])
    for h in (lh, lh2, rh, rh5):
        assert isinstance(h, int) and h != 0
    x = a.makeXferReq(bind.NIXL_WRITE, lh, [0, 1], rh, [2, 3])
    x2 = a.makeXferReq(
        operation=bind.NIXL_WRITE,
        local_side=lh2,
        local_indices=np.array([3], dtype=np.int32),
        remote_side=rh5,
        remote_indices=np.array([0], dtype=np.int32),
        notif_msg=b"kw",
        backend=[],
        skip_desc_merg=True,
    )
    for xx in (x, x2):
        a.postXferReq(xx)
        deadline = time.monotonic() + 5
        while a.getXferStatus(xx) != bind.NIXL_SUCCESS:
            assert time.monotonic() < deadline
    assert (dst[128:256] == src[:128]).all()
    assert (dst[:64] == src[192:256]).all()
    with pytest.raises(bind.nixlInvalidParamError):
        a.makeXferReq(bind.NIXL_WRITE, lh, [4], rh, [0])
    for xx in (x, x2):
        assert a.releaseXferReq(xx) == bind.NIXL_SUCCESS
    for h in (lh, lh2, rh, rh5):
        assert a.releasedDlistH(h) == bind.NIXL_SUCCESS


def test_partial_md_raw(raw, bind):
    _, b, _, _, _ = raw
    buf = np.zeros(64, dtype=np.uint8)
    rd = bind.nixlRegDList(bind.DRAM_SEG, [(addr(buf), 64, 0, "")])
    b.registerMem(rd)
    assert isinstance(b.getLocalPartialMD(rd, True, []), bytes)
    assert isinstance(b.getLocalPartialMD(bind.nixlRegDList(bind.DRAM_SEG), False), bytes)


def test_raw_errors_raise(raw, bind):
    a, _, ha, _, _ = raw
    with pytest.raises(bind.nixlNotFoundError):
        a.prepXferDlist("nobody", bind.nixlXferDList(bind.DRAM_SEG, [(1, 1, 0)]))
    with pytest.raises(bind.nixlMismatchError):
        a.loadRemoteMD(b"junk")
    with pytest.raises(bind.nixlNotSupportedError):
        a.queryMem(bind.nixlRegDList(bind.DRAM_SEG, [(1, 1, 0, "")]), ha)
    with pytest.raises(ValueError):
        bind.nixlAgent("", bind.nixlAgentConfig())
