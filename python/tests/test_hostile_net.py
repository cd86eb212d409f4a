"""Hostile peers against the metadata listener and the local notification socket (raw sockets, see hostile_net.py).

Each attack asserts: refused with a defined answer, no state changed, memory and fds bounded, and the real peer
keeps working. gixl only: NIXL's listener speaks another protocol and its notifications travel over UCX (these
attacks do not apply as written; NIXL has no equivalent bounds or cluster key).
"""

from __future__ import annotations

import os
import socket
import time

import pytest

import hostile_net as H
from peer_client import PeerProcess

pytestmark = [pytest.mark.gixl_only, pytest.mark.two_process]

KEY = "hostile-test-cluster-key-0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def victim(nixl_impl, tmp_path):
    procs = []

    def _spawn(label, regions=1, env=None):
        port = free_port()
        p = PeerProcess(label, nixl_impl.impl, nixl_impl.bindings, tmp_path, env=env)
        procs.append(p)
        info = p.call("init", name=label, size=1 << 20, listen_port=port, regions=regions)
        return p, port, info

    yield _spawn
    for p in procs:
        p.close()


def fetch_ok(port, name, timeout=5.0):
    r = H.fetch_md(port, name, timeout=timeout)
    return r is not None and r[0] == H.LOAD and r[1][:6] == b"GIXLMD"


# -- the local notification socket ----------------------------------------------------------------------------
def _as_uid(uid, fn):
    """Run ``fn`` in a forked child with ``uid``; return its string result."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        os.close(r)
        try:
            os.setgid(uid)
            os.setuid(uid)
            res = fn()
        except BaseException as e:  # noqa: BLE001
            res = f"error {e!r}"
        os.write(w, res.encode()[:4000])
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    out = os.read(r, 4000).decode()
    os.close(r)
    return out


def _refusal(name, inc, sender, msg):
    """Connect, send the old unauthenticated hello (incarnation + name) and a notification; describe the answer."""
    import struct

    s = H.local_connect(name)
    with s:
        try:
            s.sendall(H.old_hello(inc, sender) + H.notif_frame(msg))
        except OSError:
            pass  # refused before we could say anything: the refusal is still there to read
        head = H.recv_exact(s, 5)
        if head is None:
            return "closed"
        (n,) = struct.unpack("<I", head[:4])
        body = H.recv_exact(s, n - 1) or b""
        tail = "" if H.closed_by_peer(s) else " (left open)"
        return ("refused:" if head[4] == 5 else f"kind{head[4]}:") + body.decode(errors="replace") + tail


def test_another_uid_is_refused_at_the_local_socket(victim, make_agent):
    if os.geteuid() != 0:
        pytest.skip("needs root to run the attacker as uid 65534")
    p, port, info = victim("v-uid")
    socks = H.local_sockets(p.pid)
    assert socks, "the victim's notification socket is listed in /proc/net/unix"
    name, _, inc = socks[0]
    fds0 = H.nfds(p.pid)
    res = _as_uid(65534, lambda: _refusal(name, inc, "prefill-0", b"forged by uid 65534"))
    assert res.startswith("refused:") and "uid 65534" in res and "left open" not in res, res
    assert H.nfds(p.pid) <= fds0 + 1
    # A real peer (same uid, knows the secret from the metadata) still gets through, and its message is the
    # only one delivered (a forged one, sent first, would come before it).
    a = make_agent("real-sender")
    a.add_remote_agent(info["md"])
    a.send_notif("v-uid", b"genuine")
    got = p.call("notifs", count=1)
    assert got == {a.name: [b"genuine"]}


def test_same_uid_without_the_secret_cannot_forge_a_sender(victim, make_agent):
    p, port, info = victim("v-secret")
    name, _, inc = H.local_sockets(p.pid)[0]
    res = _refusal(name, inc, "prefill-0", b"forged")
    assert res.startswith("refused:") and "authenticated hello" in res and "left open" not in res, res
    # A hello of the current shape with a guessed tag: refused too.
    import struct

    body = bytes([1]) + inc + os.urandom(16) + os.urandom(16) + os.urandom(8) + b"prefill-0"
    with H.local_connect(name) as s:
        s.sendall(struct.pack("<I", len(body)) + body + H.notif_frame(b"forged"))
        head = H.recv_exact(s, 5)
        why = H.recv_exact(s, struct.unpack("<I", head[:4])[0] - 1)
        assert head[4] == 5 and b"authentication failed" in why, why
        assert H.closed_by_peer(s)
    a = make_agent("real-sender-2")
    a.add_remote_agent(info["md"])
    a.send_notif("v-secret", b"genuine")
    assert p.call("notifs", count=1) == {a.name: [b"genuine"]}


# -- the metadata listener --------------------------------------------------------------------------------------
def test_unread_requests_are_back_pressured(victim):
    p, port, _ = victim("v-flood", regions=1024)
    rss0 = H.rss_kib(p.pid)
    s = socket.create_connection(("127.0.0.1", port))
    s.setblocking(False)
    one = H.frame(H.SEND, b"")
    sent, deadline = 0, time.monotonic() + 5
    while sent < 20000 and time.monotonic() < deadline:
        try:
            sent += s.send(one * 500) // len(one)
        except BlockingIOError:
            time.sleep(0.005)
    assert sent > 1000
    assert fetch_ok(port, "v-flood"), "a real peer is still served"
    grew = (H.rss_kib(p.pid) - rss0) / 1024
    assert grew < 24, f"RSS grew by {grew:.0f} MiB"
    s.close()


def test_idle_connections_cannot_lock_out_a_real_peer(victim):
    p, port, _ = victim("v-idle")
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(300)]
    try:
        t = time.monotonic()
        assert fetch_ok(port, "v-idle", timeout=5)
        assert time.monotonic() - t < 2
        assert H.nfds(p.pid) < 12 + 256 + 16
    finally:
        for c in idle:
            c.close()


def test_forged_local_loads_open_no_pidfds(victim):
    p, port, _ = victim("v-pidfd")
    md = H.fetch_md(port, "v-pidfd")[1]
    fds0 = H.nfds(p.pid)
    with socket.create_connection(("127.0.0.1", port)) as s:
        for i in range(300):
            s.sendall(H.frame(H.LOAD, H.forged_local_md(md, f"forged-{i}", os.getpid())))
        # The victim loaded them (NIXL's trust model: the listener takes LOADs from anyone)...
        deadline = time.monotonic() + 10
        while not p.call("check_md", name="forged-299") and time.monotonic() < deadline:
            time.sleep(0.05)
    assert p.call("check_md", name="forged-299")
    # ... but none proved it runs here, so none holds a pidfd.
    assert H.nfds(p.pid) <= fds0 + 2, (fds0, H.nfds(p.pid))


def test_oversized_and_malformed_frames_are_refused_from_the_header(victim):
    p, port, _ = victim("v-big")
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(H.MAGIC + bytes([H.SEND]) + (1 << 20).to_bytes(4, "little"))
        kind, body = H.read_frame(s)
        assert kind == H.ERR and b"too large" in body
        assert H.closed_by_peer(s)
    rss0 = H.rss_kib(p.pid)
    conns = []
    for _ in range(4):
        c = socket.create_connection(("127.0.0.1", port))
        c.settimeout(1)
        c.sendall(H.MAGIC + bytes([H.LOAD]) + (16 << 20).to_bytes(4, "little"))
        try:
            for _ in range(16):
                c.sendall(b"\0" * (1 << 20))
        except OSError:
            pass  # not read: the budget is spent
        conns.append(c)
    grew = (H.rss_kib(p.pid) - rss0) / 1024
    assert grew < 80, f"RSS grew by {grew:.0f} MiB"
    assert fetch_ok(port, "v-big")
    for c in conns:
        c.close()


# -- the cluster key ---------------------------------------------------------------------------------------------
def test_cluster_key_signs_requests_and_metadata(victim, make_agent, bind):
    env = {"GIXL_CLUSTER_KEY": KEY}
    p, port, info = victim("v-keyed", env=env)
    q, _, qinfo = victim("keyed-peer", env=env)
    # Key holders exchange metadata through the listener with signed requests: fetch, send, invalidate.
    q.call("fetch_md", name="v-keyed", ip="127.0.0.1", port=port)
    deadline = time.monotonic() + 10
    while not q.call("check_md", name="v-keyed") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert q.call("check_md", name="v-keyed"), "signed fetch"
    q.call("send_md", ip="127.0.0.1", port=port)
    while not p.call("check_md", name="keyed-peer") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert p.call("check_md", name="keyed-peer"), "signed send"
    q.call("invalidate_md", ip="127.0.0.1", port=port)
    while p.call("check_md", name="keyed-peer") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not p.call("check_md", name="keyed-peer"), "signed invalidation"
    assert p.call("add_remote", md=qinfo["md"]) in (b"keyed-peer", "keyed-peer")
    # An agent without the key: a clear error, not a hang.
    plain = make_agent("no-key")
    with pytest.raises(bind.nixlNotAllowedError):
        plain.add_remote_agent(info["md"])
    # A tampered blob is refused by a key holder.
    bad = bytearray(qinfo["md"])
    bad[len(bad) // 2] ^= 1
    with pytest.raises(Exception):
        p.call("add_remote", md=bytes(bad))
    # Unsigned requests to the keyed listener: challenge, then ERR, then closed; nothing invalidated.
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        kind, nonce = H.read_frame(s)
        assert kind == 5 and len(nonce) == 16
        s.sendall(H.frame(H.INVL, b"keyed-peer"))
        kind, body = H.read_frame(s)
        assert kind == H.ERR and b"cluster key" in body
        assert H.closed_by_peer(s)
    # Signed with the wrong key: refused as well.
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        _, nonce = H.read_frame(s)
        body = b"keyed-peer"
        t = H.hmac_tag(b"wrong-key-0123456789", nonce, (0).to_bytes(8, "little"), bytes([H.INVL]), body)
        s.sendall(H.frame(H.INVL | H.AUTH_BIT, body + t))
        kind, why = H.read_frame(s)
        assert kind == H.ERR and b"signature" in why
    assert p.call("check_md", name="keyed-peer"), "state unchanged"
    # The unsigned SEND of a keyless fetcher gets the same ERR (it is logged there; never a hang).
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(H.frame(H.SEND, b""))
        kinds = []
        while (f := H.read_frame(s)) is not None:
            kinds.append(f[0])
        assert kinds == [5, H.ERR]


def test_allowed_uids_pass_the_uid_check_but_still_need_the_secret(victim):
    if os.geteuid() != 0:
        pytest.skip("needs root to run the attacker as uid 65534")
    p, _, _ = victim("v-allow", env={"GIXL_ALLOW_UIDS": "65534"})
    name, _, inc = H.local_sockets(p.pid)[0]
    res = _as_uid(65534, lambda: _refusal(name, inc, "prefill-0", b"forged"))
    assert res.startswith("refused:") and "uid" not in res and "hello" in res, res
