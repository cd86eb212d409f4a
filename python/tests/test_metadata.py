"""Metadata exchange: get_agent_metadata / add_remote_agent / remove_remote_agent / check_remote_metadata."""

from __future__ import annotations

import time

import numpy as np
import pytest

from helpers import addr, make_pair


def test_metadata_round_trip_returns_bytes(make_agent):
    a = make_agent("A")
    b = make_agent("B")
    md = b.get_agent_metadata()
    assert isinstance(md, bytes) and md
    name = a.add_remote_agent(md)
    assert isinstance(name, bytes)
    assert name == b.name.encode()
    assert a.check_remote_metadata(name) is True
    assert a.check_remote_metadata(b.name) is True


def test_readd_identical_metadata_is_idempotent(make_agent):
    a = make_agent("A")
    b = make_agent("B")
    buf = np.zeros(4096, dtype=np.uint8)
    b.register_memory([(addr(buf), 4096, 0, "")], "DRAM")
    md = b.get_agent_metadata()
    assert a.add_remote_agent(md) == b.name.encode()
    assert a.add_remote_agent(md) == b.name.encode()
    assert a.add_remote_agent(bytes(md)) == b.name.encode()
    # and the remote registration is usable
    assert a.check_remote_metadata(b.name, a.get_xfer_descs([(addr(buf), 4096, 0)], "DRAM"))


def test_metadata_grows_with_registrations(make_agent):
    a = make_agent("A")
    b = make_agent("B")
    buf = np.zeros(8192, dtype=np.uint8)
    a.add_remote_agent(b.get_agent_metadata())
    descs = a.get_xfer_descs([(addr(buf), 4096, 0)], "DRAM")
    assert a.check_remote_metadata(b.name) is True
    assert a.check_remote_metadata(b.name, descs) is False
    b.register_memory([(addr(buf), 8192, 0, "")], "DRAM")
    a.add_remote_agent(b.get_agent_metadata())  # merge: same connection info, new section
    assert a.check_remote_metadata(b.name, descs) is True


@pytest.mark.parametrize("garbage", [b"garbage", b"", b"nixlSerDes|", "not metadata"])
def test_garbage_metadata(make_agent, bind, garbage):
    a = make_agent()
    with pytest.raises(bind.nixlMismatchError):
        a.add_remote_agent(garbage)


def test_own_metadata_rejected(make_agent, bind):
    a = make_agent()
    with pytest.raises(bind.nixlInvalidParamError) as info:
        a.add_remote_agent(a.get_agent_metadata())
    assert str(info.value) == "NIXL_ERR_INVALID_PARAM"


def test_remove_and_check_never_raise(make_agent):
    a = make_agent()
    assert a.remove_remote_agent("nobody") is None
    assert a.remove_remote_agent(b"nobody") is None
    assert a.remove_remote_agent(a.name) is None  # own name
    assert a.check_remote_metadata("nobody") is False
    assert a.check_remote_metadata(b"nobody") is False


def test_remove_remote_agent(make_agent, bind):
    p = make_pair(make_agent)
    a, name = p.A, p.remote
    assert a.check_remote_metadata(name)
    a.remove_remote_agent(name)
    a.remove_remote_agent(name)  # second time: unknown, still silent
    assert a.check_remote_metadata(name) is False
    with pytest.raises(bind.nixlNotFoundError):
        a.prep_xfer_dlist(name, [(addr(p.dst), 64, 0)], "DRAM")
    with pytest.raises(bind.nixlNotFoundError):
        a.send_notif(name, b"x")
    with pytest.raises(bind.nixlNotFoundError):
        a.make_connection(name)
    assert a.add_remote_agent(p.B.get_agent_metadata()) == name
    assert a.check_remote_metadata(name)


def test_remove_with_str_name(make_agent):
    p = make_pair(make_agent)
    p.A.remove_remote_agent(p.B.name)
    assert not p.A.check_remote_metadata(p.remote)


def test_check_remote_metadata_with_descs(make_agent):
    p = make_pair(make_agent, size=4096)
    a = p.A
    inside = a.get_xfer_descs([(addr(p.dst), 100, 0), (addr(p.dst, 4000), 96, 0)], "DRAM")
    beyond = a.get_xfer_descs([(addr(p.dst), 5000, 0)], "DRAM")
    wrong_dev = a.get_xfer_descs([(addr(p.dst), 100, 1)], "DRAM")
    assert a.check_remote_metadata(p.remote, inside) is True
    assert a.check_remote_metadata(p.remote, beyond) is False
    assert a.check_remote_metadata(p.remote, wrong_dev) is False
    assert a.check_remote_metadata("nobody", inside) is False


def test_same_name_new_incarnation_needs_remove(make_agent, bind):
    a = make_agent("A")
    b1 = make_agent("B")
    b2 = make_agent(name=b1.name)  # same name, different connection info
    a.add_remote_agent(b1.get_agent_metadata())
    with pytest.raises(bind.nixlNotAllowedError):
        a.add_remote_agent(b2.get_agent_metadata())
    a.remove_remote_agent(b1.name)
    assert a.add_remote_agent(b2.get_agent_metadata()) == b1.name.encode()


def test_make_connection(make_agent, bind):
    p = make_pair(make_agent)
    assert p.A.make_connection(p.remote) is None
    assert p.A.make_connection(p.B.name, backends=["UCX"]) is None
    with pytest.raises(bind.nixlNotFoundError):
        p.A.make_connection("nobody")


def test_partial_metadata(make_agent, bind):
    a = make_agent("A")
    b = make_agent("B")
    buf = np.zeros(8192, dtype=np.uint8)
    reg = b.register_memory([(addr(buf), 4096, 0, ""), (addr(buf, 4096), 4096, 0, "")], "DRAM")
    part = b.get_partial_agent_metadata(b.get_reg_descs([(addr(buf), 4096, 0, "")], "DRAM"), True)
    assert isinstance(part, bytes)
    assert a.add_remote_agent(part) == b.name.encode()
    assert a.check_remote_metadata(b.name, a.get_xfer_descs([(addr(buf), 4096, 0)], "DRAM"))
    assert not a.check_remote_metadata(b.name, a.get_xfer_descs([(addr(buf, 4096), 4096, 0)], "DRAM"))
    with pytest.raises(bind.nixlNotFoundError):
        b.get_partial_agent_metadata(b.get_reg_descs([(addr(buf), 100, 0, "")], "DRAM"), True)
    b.deregister_memory(reg)


def test_partial_metadata_of_an_empty_list_carries_connection_info(make_agent, bind):
    # NIXL's rule: connection info goes into partial metadata when asked for, or when the list is empty.
    a = make_agent("A")
    b = make_agent("B")
    buf = np.arange(8192, dtype=np.uint8)
    reg = b.register_memory([(addr(buf), 8192, 0, "")], "DRAM")
    regs = b.get_reg_descs([(addr(buf), 8192, 0, "")], "DRAM")
    regions_only = b.get_partial_agent_metadata(regs, False, ["UCX"])
    with pytest.raises(bind.nixlNotFoundError):
        a.add_remote_agent(regions_only)
    empty = bind.nixlRegDList(bind.DRAM_SEG)
    conn_only = b.get_partial_agent_metadata(empty, False, ["UCX"])
    assert len(conn_only) == len(b.get_partial_agent_metadata(empty))
    assert a.add_remote_agent(conn_only) == b.name.encode()
    descs = a.get_xfer_descs([(addr(buf), 8192, 0)], "DRAM")
    assert not a.check_remote_metadata(b.name, descs)
    assert a.add_remote_agent(regions_only) == b.name.encode()
    assert a.check_remote_metadata(b.name, descs)
    dst = np.zeros(8192, dtype=np.uint8)
    a.register_memory([(addr(dst), 8192, 0, "")], "DRAM")
    h = a.initialize_xfer("READ", a.get_xfer_descs([(addr(dst), 8192, 0)], "DRAM"), descs, b.name)
    assert a.transfer(h) in ("DONE", "PROC")
    deadline = time.monotonic() + 10
    while a.check_xfer_state(h) == "PROC" and time.monotonic() < deadline:
        time.sleep(0.001)
    assert a.check_xfer_state(h) == "DONE"
    assert (dst == buf).all()
    a.release_xfer_handle(h)
    b.deregister_memory(reg)


def test_send_local_metadata_without_destination(make_agent, bind, monkeypatch):
    monkeypatch.delenv("NIXL_ETCD_ENDPOINTS", raising=False)
    monkeypatch.delenv("NIXL_TCPSTORE_ENDPOINT", raising=False)
    a = make_agent()
    with pytest.raises(bind.nixlInvalidParamError):
        a.send_local_metadata()
