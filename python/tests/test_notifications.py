"""send_notif / get_new_notifs / update_notifs / check_remote_xfer_done."""

from __future__ import annotations

import time

import pytest

from helpers import collect_notifs, make_pair, wait_until


@pytest.fixture
def pair(make_agent):
    return make_pair(make_agent, size=1024)


def test_send_notif_payloads(pair):
    a, b = pair.A, pair.B
    msgs = [b"x\x00y", "str-msg", b"", b"z" * (1 << 20), bytes(range(256))]
    for m in msgs[:2]:
        a.send_notif(pair.remote, m)
    a.send_notif(pair.B.name, notif_msg=msgs[2])
    a.send_notif(pair.remote, notif_msg=msgs[3])
    a.send_notif(pair.remote, msgs[4])
    got = collect_notifs(b, len(msgs))
    assert list(got) == [a.name]
    assert got[a.name] == [b"x\x00y", b"str-msg", b"", b"z" * (1 << 20), bytes(range(256))]
    assert all(isinstance(m, bytes) for m in got[a.name])


def test_notifs_are_fifo_per_sender(pair):
    for i in range(20):
        pair.A.send_notif(pair.remote, f"m{i}".encode())
    got = collect_notifs(pair.B, 20)
    assert got == {pair.A.name: [f"m{i}".encode() for i in range(20)]}


def test_get_new_notifs_only_new(pair):
    assert pair.B.get_new_notifs() == {}
    pair.A.send_notif(pair.remote, b"one")
    assert collect_notifs(pair.B, 1) == {pair.A.name: [b"one"]}
    assert pair.B.get_new_notifs() == {}


def test_notifs_from_several_senders(make_agent):
    t = make_agent("target")
    senders = [make_agent(f"s{i}") for i in range(3)]
    md = t.get_agent_metadata()
    for s in senders:
        name = s.add_remote_agent(md)
        s.send_notif(name, s.name.encode())
    got = collect_notifs(t, 3)
    assert got == {s.name: [s.name.encode()] for s in senders}


def test_send_notif_to_self(make_agent):
    a = make_agent()
    a.send_notif(a.name, b"me")
    assert collect_notifs(a, 1) == {a.name: [b"me"]}


def test_send_notif_unknown_agent(make_agent, bind):
    a = make_agent()
    with pytest.raises(bind.nixlNotFoundError):
        a.send_notif("nobody", b"x")


def test_update_notifs_accumulates(pair):
    b = pair.B
    pair.A.send_notif(pair.remote, b"a1")
    wait_until(lambda: b.update_notifs().get(pair.A.name), what="first notification")
    pair.A.send_notif(pair.remote, b"a2")
    wait_until(lambda: len(b.update_notifs().get(pair.A.name, [])) == 2, what="second notification")
    assert b.notifs == {pair.A.name: [b"a1", b"a2"]}
    assert b.update_notifs() is b.notifs or b.update_notifs() == b.notifs


def test_check_remote_xfer_done(pair):
    a, b = pair.A, pair.B
    for m in (b"tag1-abc", b"tag2-abc", b"other"):
        a.send_notif(pair.remote, m)
    wait_until(lambda: len(b.update_notifs().get(a.name, [])) == 3, what="3 notifications")
    assert b.check_remote_xfer_done(a.name, b"abc") is False  # prefix match by default
    assert b.check_remote_xfer_done(a.name, b"abc", tag_is_prefix=False) is True
    assert b.notifs[a.name] == [b"tag2-abc", b"other"]  # only the first match is removed
    assert b.check_remote_xfer_done(a.name, b"tag2") is True
    assert b.check_remote_xfer_done(a.name, b"tag2") is False
    assert b.check_remote_xfer_done(a.name, b"") is True  # empty tag matches anything
    assert b.notifs[a.name] == []
    assert b.check_remote_xfer_done("nobody", b"") is False


def test_check_remote_xfer_done_waits_for_transfer(pair):
    a, b = pair.A, pair.B
    h = a.initialize_xfer(
        "WRITE",
        a.get_xfer_descs([(int(pair.src.ctypes.data), 128, 0)], "DRAM"),
        a.get_xfer_descs([(int(pair.dst.ctypes.data), 128, 0)], "DRAM"),
        pair.remote,
        b"uuid-1234",
    )
    a.transfer(h)
    deadline = time.monotonic() + 5
    while not b.check_remote_xfer_done(a.name, b"uuid-1234"):
        a.check_xfer_state(h)  # keep the initiator progressing
        assert time.monotonic() < deadline, "notification did not arrive"
        time.sleep(0.002)
    # the notification is only delivered after the data
    assert (pair.dst[:128] == pair.src[:128]).all()


def test_notification_after_data_prepped(pair):
    a, b = pair.A, pair.B
    lh = a.prep_xfer_dlist("", [(int(pair.src.ctypes.data), 1024, 0)], "DRAM")
    rh = a.prep_xfer_dlist(pair.remote, [(int(pair.dst.ctypes.data), 1024, 0)], "DRAM")
    h = a.make_prepped_xfer("WRITE", lh, [0], rh, [0], notif_msg=b"done")
    a.transfer(h)
    deadline = time.monotonic() + 5
    got = {}
    while not got:
        a.check_xfer_state(h)
        got = b.get_new_notifs()
        assert time.monotonic() < deadline
    assert got == {a.name: [b"done"]}
    assert (pair.dst == pair.src).all()


@pytest.mark.gixl_only
def test_send_notif_with_backend_name(pair):
    pair.A.send_notif(pair.remote, b"via-ucx", backend="UCX")
    assert collect_notifs(pair.B, 1) == {pair.A.name: [b"via-ucx"]}


@pytest.mark.gixl_only
def test_check_remote_xfer_done_accepts_bytes_name_and_str_tag(pair):
    pair.A.send_notif(pair.remote, b"hello")
    wait_until(lambda: pair.B.update_notifs().get(pair.A.name), what="notification")
    assert pair.B.check_remote_xfer_done(pair.A.name.encode(), "hel") is True


def test_get_new_notifs_with_backend_list(pair):
    pair.A.send_notif(pair.remote, b"b")
    got = {}
    deadline = time.monotonic() + 5
    while not got and time.monotonic() < deadline:
        got = pair.B.get_new_notifs(backends=["UCX"])
    assert got == {pair.A.name: [b"b"]}
