"""Raw-socket attackers against gixl's metadata listener and local notification socket.

No gixl or nixl import: everything here is what a stranger with a socket (and, for the metadata forgeries, a
copy of the wire format) can do. Used by test_hostile_net.py (assertions) and, run as a script, prints the
attack → effect table (``python hostile_net.py`` with the gixl venv; it spawns its own victim peers).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import socket
import struct
import time

MAGIC = b"GXMD"
LOAD, SEND, INVL, ERR = 1, 2, 3, 4
AUTH_BIT = 0x80
NOTIF_HELLO, NOTIF_MSG = 1, 2


# -- listener frames -------------------------------------------------------------------------------------------
def frame(kind: int, payload: bytes) -> bytes:
    return MAGIC + bytes([kind]) + struct.pack("<I", len(payload)) + payload


def read_frame(s: socket.socket, timeout: float = 5.0):
    """One frame (kind, payload), or None when the peer closed the connection first."""
    s.settimeout(timeout)
    head = recv_exact(s, 9)
    if head is None:
        return None
    (n,) = struct.unpack("<I", head[5:9])
    body = recv_exact(s, n)
    return None if body is None else (head[4], body)


def recv_exact(s: socket.socket, n: int):
    out = b""
    while len(out) < n:
        try:
            b = s.recv(n - len(out))
        except (ConnectionResetError, socket.timeout, TimeoutError):
            return None
        if not b:
            return None
        out += b
    return out


def closed_by_peer(s: socket.socket, timeout: float = 5.0) -> bool:
    """True when the peer closes the connection (EOF or reset) within ``timeout``; frames before it are skipped."""
    s.settimeout(timeout)
    try:
        while True:
            b = s.recv(65536)
            if not b:
                return True
    except ConnectionResetError:
        return True
    except (socket.timeout, TimeoutError):
        return False


def fetch_md(port: int, name: str = "", timeout: float = 5.0, host: str = "127.0.0.1"):
    """Ask a listener for its metadata; returns (kind, payload) or None."""
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.sendall(frame(SEND, name.encode()))
        return read_frame(s, timeout)


# -- metadata blobs (gixl's codec, re-implemented) -----------------------------------------------------------
def uvar(v: int) -> bytes:
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def get_uvar(b: bytes, at: int):
    v, shift = 0, 0
    while True:
        x = b[at]
        at += 1
        v |= (x & 0x7F) << shift
        shift += 7
        if not x & 0x80:
            return v, at


def get_bytes(b: bytes, at: int):
    n, at = get_uvar(b, at)
    return b[at : at + n], at + n


def put_bytes(b: bytes) -> bytes:
    return uvar(len(b)) + b


def zigzag(v: int) -> int:
    return ((v << 1) ^ (v >> 63)) & (2**64 - 1)


def parse_md(blob: bytes) -> dict:
    """The fields an attacker needs from a victim's metadata (versions 1 and 2)."""
    assert blob[:6] == b"GIXLMD", blob[:16]
    (version,) = struct.unpack("<H", blob[6:8])
    flags = blob[8]
    name, at = get_bytes(blob, 9)
    inc = blob[at : at + 16]
    at += 16
    if version == 1:
        at += 16  # the unused agent secret of version 1
    nconns, at = get_uvar(blob, at)
    conns = []
    for _ in range(nconns):
        backend, at = get_bytes(blob, at)
        info, at = get_bytes(blob, at)
        conns.append((backend, info))
    return {"version": version, "flags": flags, "name": name.decode(), "inc": inc, "conns": conns}


def parse_conn(info: bytes) -> dict:
    """The UCX engine's connection info, version 3 (src/backend/engine/conn.rs `ConnInfo::encode`)."""
    assert info[0] == 3, info[0]
    host, at = get_bytes(info, 1)
    pid, at = get_uvar(info, at)
    start, at = get_uvar(info, at)
    gate_fd, at = get_uvar(info, at)
    gate_addr = info[at : at + 8]
    sock, at = get_bytes(info, at + 8)
    secret = info[at : at + 16]
    return {
        "host": host,
        "pid": pid,
        "start": start,
        "gate_fd": gate_fd,
        "gate_addr": gate_addr,
        "sock": sock,
        "secret": secret,
        "rest": info[at + 16 :],
    }


def make_conn(c: dict) -> bytes:
    return (
        bytes([3])
        + put_bytes(c["host"])
        + uvar(c["pid"])
        + uvar(c["start"])
        + uvar(c["gate_fd"])
        + c["gate_addr"]
        + put_bytes(c["sock"])
        + c["secret"]
        + c["rest"]
    )


def make_md(version: int, name: str, inc: bytes, conns, sections=()) -> bytes:
    """An unsigned blob. ``sections``: (backend, mem, [(addr, len, dev)])."""
    out = b"GIXLMD" + struct.pack("<H", version) + b"\0" + put_bytes(name.encode()) + inc
    if version == 1:
        out += b"\0" * 16
    out += uvar(len(conns))
    for backend, info in conns:
        out += put_bytes(backend) + put_bytes(info)
    out += uvar(len(sections))
    for backend, mem, regions in sections:
        out += put_bytes(backend.encode()) + uvar(mem) + uvar(len(regions))
        prev_end = 0
        parts = []
        for addr, ln, dev in regions:
            parts.append(uvar(zigzag((addr - prev_end + 2**63) % 2**64 - 2**63)) + uvar(ln) + uvar(dev) + b"\0")
            prev_end = (addr + ln) % 2**64
        out += b"".join(parts)
    return out


def start_time(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])


def forged_local_md(victim_md: bytes, name: str, pid: int, regions=()) -> bytes:
    """Metadata for a made-up agent claiming to be process ``pid`` on the victim's host."""
    m = parse_md(victim_md)
    backend, info = m["conns"][0]
    c = parse_conn(info)
    c["pid"], c["start"] = pid, start_time(pid)
    c["sock"] = b"gixl.forged." + name.encode()
    sections = [("UCX", 0, list(regions))] if regions else []
    return make_md(m["version"], name, os.urandom(16), [(backend, make_conn(c))], sections)


# -- the local notification socket --------------------------------------------------------------------------
def local_sockets(pid: int | None = None):
    """Abstract notification sockets listed in /proc/net/unix: [(name bytes, pid, incarnation bytes)]."""
    out = []
    with open("/proc/net/unix") as f:
        for line in f.read().splitlines()[1:]:
            parts = line.split()
            if len(parts) < 8 or not parts[7].startswith("@gixl."):
                continue
            m = re.fullmatch(r"@gixl\.(\d+)\.([0-9a-f]{32})", parts[7])
            if m and (pid is None or int(m.group(1)) == pid):
                out.append((parts[7][1:].encode(), int(m.group(1)), int(m.group(2), 16).to_bytes(16, "little")))
    return sorted(set(out))


def local_connect(name: bytes, timeout: float = 5.0) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(b"\0" + name)
    return s


def old_hello(inc: bytes, sender: str) -> bytes:
    """The unauthenticated hello of gixl ≤ this change: incarnation + name."""
    body = bytes([NOTIF_HELLO]) + inc + sender.encode()
    return struct.pack("<I", len(body)) + body


def notif_frame(msg: bytes) -> bytes:
    body = bytes([NOTIF_MSG]) + msg
    return struct.pack("<I", len(body)) + body


def forge_local_notif(name: bytes, inc: bytes, sender: str, msg: bytes) -> str:
    """Connect, claim to be ``sender`` and send ``msg``. Returns what happened: 'closed' when the victim hung up
    before or after our hello (refused), 'sent' when everything was written and the connection stayed open."""
    try:
        s = local_connect(name)
    except OSError as e:
        return f"connect refused ({e.errno})"
    with s:
        try:
            s.sendall(old_hello(inc, sender) + notif_frame(msg))
        except OSError:
            return "closed"
        return "closed" if closed_by_peer(s, 1.0) else "sent"


# -- victim figures -----------------------------------------------------------------------------------------
def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def nfds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def hmac_tag(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


# -- the table (run as a script) ------------------------------------------------------------------------------
def _main():  # pragma: no cover - a measurement, not a test
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import tempfile

    from peer_client import PeerProcess

    rows = []
    tmp = tempfile.mkdtemp()

    def victim(label, port, regions=1):
        p = PeerProcess(label, "gixl", "native", tmp)
        info = p.call("init", name=label, size=1 << 20, listen_port=port, regions=regions)
        return p, info

    def free_port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def fetch_ms(port, name):
        t = time.monotonic()
        r = fetch_md(port, name, timeout=10)
        return (time.monotonic() - t) * 1e3, r

    # 1. 20,000 unread SEND requests on one connection.
    port = free_port()
    p, _ = victim("v-send", port, regions=1024)
    rss0 = rss_kib(p.pid)
    s = socket.create_connection(("127.0.0.1", port))
    s.setblocking(False)
    req = frame(SEND, b"") * 1000
    sent = 0
    deadline = time.monotonic() + 20
    while sent < 20000 and time.monotonic() < deadline:
        try:
            n = s.send(req)
            sent += n // len(frame(SEND, b""))
            req = req[n:] or frame(SEND, b"") * 1000
        except BlockingIOError:
            time.sleep(0.01)
    time.sleep(1.0)
    rss1 = rss_kib(p.pid)
    ms, r = fetch_ms(port, "v-send")
    rows.append(("20,000 unread SEND requests (1024-region victim)", f"RSS {rss0 // 1024}→{rss1 // 1024} MiB ({sent} accepted); real fetch {ms:.1f} ms {'ok' if r and r[0] == LOAD else 'FAILED'}"))
    s.close()
    p.close()

    # 2. 300 idle connections, then a real fetch.
    port = free_port()
    p, _ = victim("v-idle", port)
    f0 = nfds(p.pid)
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(300)]
    time.sleep(0.5)
    try:
        ms, r = fetch_ms(port, "v-idle")
        res = f"real fetch {ms:.0f} ms {'ok' if r and r[0] == LOAD else 'FAILED (no reply)'}"
    except OSError as e:
        res = f"real fetch failed: {e}"
    rows.append(("300 idle connections", f"fds {f0}→{nfds(p.pid)}; {res}"))
    for c in idle:
        c.close()
    p.close()

    # 3. 500 forged LOADs claiming local processes (our own pid).
    port = free_port()
    p, info = victim("v-load", port)
    md = fetch_md(port, "v-load")[1]
    f0 = nfds(p.pid)
    with socket.create_connection(("127.0.0.1", port)) as s:
        for i in range(500):
            s.sendall(frame(LOAD, forged_local_md(md, f"forged-{i}", os.getpid())))
        time.sleep(1.0)
    rows.append(("500 forged LOADs claiming a local pid", f"fds {f0}→{nfds(p.pid)}"))
    p.close()

    # 4. Oversized frames: 4 connections each announcing 64 MiB and sending 48 MiB.
    port = free_port()
    p, _ = victim("v-big", port)
    rss0 = rss_kib(p.pid)
    conns = []
    chunk = b"\0" * (1 << 20)
    for _ in range(4):
        c = socket.create_connection(("127.0.0.1", port))
        c.settimeout(2)
        try:
            c.sendall(MAGIC + bytes([LOAD]) + struct.pack("<I", 64 << 20))
            for _ in range(48):
                c.sendall(chunk)
        except OSError:
            pass
        conns.append(c)
    time.sleep(0.5)
    rows.append(("4 × 48 MiB of a 64 MiB frame", f"RSS {rss0 // 1024}→{rss_kib(p.pid) // 1024} MiB"))
    for c in conns:
        c.close()
    # 4b. 8 connections each sending a full 16 MiB LOAD of garbage (the largest frame accepted).
    rss0 = rss_kib(p.pid)
    conns = []
    for _ in range(8):
        c = socket.create_connection(("127.0.0.1", port))
        c.settimeout(2)
        try:
            c.sendall(MAGIC + bytes([LOAD]) + struct.pack("<I", 16 << 20))
            for _ in range(15):
                c.sendall(chunk)
        except OSError:
            pass
        conns.append(c)
    time.sleep(0.5)
    peak = rss_kib(p.pid)
    ms, r = fetch_ms(port, "v-big")
    rows.append(("8 × 15 MiB of a 16 MiB frame", f"RSS {rss0 // 1024}→{peak // 1024} MiB; real fetch {ms:.1f} ms {'ok' if r and r[0] == LOAD else 'FAILED'}"))
    for c in conns:
        c.close()
    p.close()

    # 5. 40,000 regions in descending order.
    port = free_port()
    p, info = victim("v-regions", port)
    md = fetch_md(port, "v-regions")[1]
    regions = [((1 << 40) - i * 8192, 4096, 0) for i in range(40000)]
    blob = forged_local_md(md, "many", os.getpid(), regions)
    t = time.monotonic()
    p.call("add_remote", md=blob)
    rows.append(("add_remote_agent, 40,000 regions descending", f"{(time.monotonic() - t) * 1e3:.0f} ms"))
    p.close()

    # 6/7. The local notification socket: another uid, and the same uid without the secret.
    port = free_port()
    p, _ = victim("v-notif", port)
    (name, _, inc) = local_sockets(p.pid)[0]
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(r)
        try:
            os.setgid(65534)
            os.setuid(65534)
            res = forge_local_notif(name, inc, "prefill-0", b"forged by uid 65534")
        except Exception as e:  # noqa: BLE001
            res = f"error {e}"
        os.write(w, res.encode())
        os._exit(0)
    os.close(w)
    os.waitpid(child, 0)
    res_other = os.read(r, 200).decode()
    res_same = forge_local_notif(name, inc, "prefill-0", b"forged by the same uid")
    # 8. 300 idle connections to the notification socket.
    f0 = nfds(p.pid)
    idle = []
    for _ in range(300):
        try:
            idle.append(local_connect(name))
        except OSError:
            break
    time.sleep(0.5)
    rows.append(("300 idle connections to the notification socket", f"fds {f0}→{nfds(p.pid)}"))
    for c in idle:
        c.close()
    got = p.call("notifs", count=2)
    rows.append(("uid 65534 → notification socket", f"{res_other}; victim got {sum(len(v) for v in got.values()) if got else 0} forged (both)"))
    rows.append(("same uid, no secret → notification socket", f"{res_same}"))
    p.close()

    w = max(len(a) for a, _ in rows)
    for a, b in rows:
        print(f"| {a.ljust(w)} | {b} |")


if __name__ == "__main__":
    _main()
