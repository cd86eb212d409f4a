"""Metadata exchange through a real torch.distributed TCPStore (NIXL_TCPSTORE_ENDPOINT), on both implementations.

The fixture starts a TCPStore master with torch from the test-only venv ``.venv/torch`` (scripts/setup.sh makes
it; ``GIXL_TORCH_PYTHON`` names another interpreter with torch) and stops it after the module; the tests skip
with a message when torch is not there. gixl speaks the c10d protocol itself; torch is only the server here, and
the tool that reads the keys back. The cases are those of NIXL's gtests ``MDManagerTcpStoreFixture``
(SendAndFetchByName, InvalidateLocalRemovesRemote) and what NIXL 1.5.1 does around them (run it: --impl nixl_cu12).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

from helpers import addr, pattern, wait_done, wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The master: print the port, then answer each line of keys on stdin with which of them the store holds (torch's
# own client's view, "1"/"0" each), or store a value ("set KEY HEX"), until stdin closes (so it never outlives the
# test run).
_MASTER = """
import sys, datetime
import torch.distributed as d
s = d.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30))
print(s.port, flush=True)
for line in sys.stdin:
    words = line.split()
    if words[:1] == ["set"]:  # set KEY HEX: store a value, as any torch client would
        s.set(words[1], bytes.fromhex(words[2]))
        print("ok", flush=True)
    else:
        print(" ".join(str(int(s.check([k]))) for k in words), flush=True)
"""


def torch_python() -> str | None:
    exe = os.environ.get("GIXL_TORCH_PYTHON") or os.path.join(ROOT, ".venv", "torch", "bin", "python")
    return exe if os.access(exe, os.X_OK) else None


@pytest.fixture(scope="module")
def tcpstore():
    exe = torch_python()
    if exe is None:
        pytest.skip("no torch for the TCPStore master (scripts/setup.sh makes .venv/torch; or set GIXL_TORCH_PYTHON)")
    proc = subprocess.Popen([exe, "-c", _MASTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline().strip()
    if not line.isdigit():
        proc.kill()
        proc.wait()
        pytest.fail(f"the TCPStore master did not start (said {line!r})")
    try:
        yield Store(proc, int(line))
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Store:
    def __init__(self, proc: subprocess.Popen, port: int):
        self.proc, self.port = proc, port

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def present(self, *keys: str) -> list[bool]:
        """Which of ``keys`` the store holds, asked by torch's own client."""
        assert all(k and " " not in k for k in keys)
        self.proc.stdin.write(" ".join(keys) + "\n")
        self.proc.stdin.flush()
        return [x == "1" for x in self.proc.stdout.readline().split()]

    def set(self, key: str, value: bytes) -> None:
        self.proc.stdin.write(f"set {key} {value.hex()}\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "ok"


@pytest.fixture
def store_env(tcpstore, monkeypatch):
    monkeypatch.delenv("NIXL_ETCD_ENDPOINTS", raising=False)
    monkeypatch.setenv("NIXL_TCPSTORE_ENDPOINT", tcpstore.endpoint)
    # How long a fetch waits for a key that is not there yet (NIXL's default is 30 s).
    monkeypatch.setenv("NIXL_TCPSTORE_TIMEOUT_MS", "10000")
    return tcpstore


def key(label: str, agent: str) -> str:
    return f"nixl/agents/{label}/{agent}/NULL_AGENT"


def registered(agent, size=4096, seed=0):
    buf = pattern(size, seed)
    agent.register_memory([(addr(buf), size, 0, "")], "DRAM")
    return buf


def test_send_fetch_by_name_and_transfer(store_env, make_agent):
    """gtest SendAndFetchByName, then a READ through what was fetched."""
    a = make_agent("ts")
    b = make_agent("td")
    src = registered(a, seed=5)
    dst = np.zeros_like(src)
    b.register_memory([(addr(dst), dst.nbytes, 0, "")], "DRAM")
    a.send_local_metadata()
    b.fetch_remote_metadata(a.name)
    wait_until(lambda: b.check_remote_metadata(a.name), timeout=15, what="metadata fetched from the TCPStore")
    # What the store holds is NIXL's key, as torch's own client sees it.
    assert store_env.present(key("metadata", a.name), key("metadata", b.name)) == [True, False]
    local = b.get_xfer_descs([(addr(dst), dst.nbytes, 0)], "DRAM")
    remote = b.get_xfer_descs([(addr(src), src.nbytes, 0)], "DRAM")
    h = b.initialize_xfer("READ", local, remote, a.name)
    b.transfer(h)
    assert wait_done(b, h) == "DONE"
    assert (dst == src).all()


def test_invalidate_local_removes_the_remote_view(store_env, make_agent):
    """gtest InvalidateLocalRemovesRemote: invalidation deletes the keys; a TCPStore has no watch, so the peer
    keeps what it loaded until it drops it itself, and fetching again then finds nothing."""
    a = make_agent("ti")
    b = make_agent("tj")
    bufs = [registered(a), registered(a, seed=1)]
    descs = a.get_reg_descs([(addr(bufs[1]), 4096, 0, "")], "DRAM")
    a.send_local_metadata()
    a.send_partial_agent_metadata(descs, True, ["UCX"], label="blocks")
    b.fetch_remote_metadata(a.name)
    wait_until(lambda: b.check_remote_metadata(a.name), timeout=15, what="metadata fetched from the TCPStore")
    # The sends are queued: the labelled one may land after the fetch has read the first.
    wait_until(lambda: store_env.present(key("metadata", a.name), key("blocks", a.name)) == [True, True],
               timeout=15, interval=0.05, what="both keys set")
    a.invalidate_local_metadata()
    # Every key the agent set is deleted, the labelled one too.
    wait_until(lambda: store_env.present(key("metadata", a.name), key("blocks", a.name)) == [False, False],
               timeout=15, interval=0.2, what="keys deleted")
    assert b.check_remote_metadata(a.name), "no watch: the peer keeps what it loaded"
    b.remove_remote_agent(a.name)
    b.fetch_remote_metadata(a.name)
    time.sleep(1.0)
    assert not b.check_remote_metadata(a.name)


def test_a_fetch_waits_for_an_agent_not_yet_published(store_env, make_agent):
    """A fetch of a name the store does not hold is not an error; it loads the agent once it is published
    (within NIXL_TCPSTORE_TIMEOUT_MS), and loads nothing else meanwhile."""
    a = make_agent("tw")
    b = make_agent("tx")
    buf = registered(a)
    assert b.fetch_remote_metadata(a.name) is None
    assert b.fetch_remote_metadata("nobody-" + a.name) is None
    time.sleep(1.0)
    assert not b.check_remote_metadata(a.name)
    t = time.monotonic()
    a.send_local_metadata()
    wait_until(lambda: b.check_remote_metadata(a.name), timeout=8, what="the late publication fetched")
    assert time.monotonic() - t < 5
    assert not b.check_remote_metadata("nobody-" + a.name)
    assert b.check_remote_metadata(a.name, b.get_xfer_descs([(addr(buf), 128, 0)], "DRAM"))


def test_a_fetch_gives_up_after_the_timeout(store_env, make_agent, monkeypatch):
    """NIXL_TCPSTORE_TIMEOUT_MS bounds how long a fetch waits: published later than that, nothing is loaded."""
    monkeypatch.setenv("NIXL_TCPSTORE_TIMEOUT_MS", "1000")
    a = make_agent("tg")
    b = make_agent("th")
    b.fetch_remote_metadata(a.name)
    time.sleep(2.0)
    a.send_local_metadata()
    wait_until(lambda: store_env.present(key("metadata", a.name)) == [True], timeout=10, interval=0.1,
               what="published")
    time.sleep(1.0)
    assert not b.check_remote_metadata(a.name)


@pytest.mark.gixl_only
def test_another_agents_metadata_under_a_name_is_not_loaded(store_env, make_agent):
    """A value under one agent's key that is another agent's metadata (a stale or hostile writer) is refused
    before it is loaded: neither name is loaded. (NIXL 1.5.1 loads it, then logs the mismatch.)"""
    a = make_agent("tv")
    other = make_agent("tu")
    store_env.set(key("metadata", a.name), other.get_agent_metadata())
    b = make_agent("tt")
    b.fetch_remote_metadata(a.name)
    time.sleep(1.0)
    assert not b.check_remote_metadata(a.name)
    assert not b.check_remote_metadata(other.name)
    # The real one, published over it, loads. (A's set and B's read go through two agents' queues: a read that
    # still finds the other agent's blob is refused again, so fetch until the real one is read.)
    a.send_local_metadata()
    deadline = time.monotonic() + 15
    while not b.check_remote_metadata(a.name):
        assert time.monotonic() < deadline, "the real metadata was not loaded"
        b.fetch_remote_metadata(a.name)
        time.sleep(0.2)
    assert not b.check_remote_metadata(other.name)


def test_partial_metadata_needs_a_label(store_env, bind, make_agent):
    a = make_agent("tp")
    buf = registered(a)
    descs = a.get_reg_descs([(addr(buf), buf.nbytes, 0, "")], "DRAM")
    with pytest.raises(bind.nixlInvalidParamError):
        a.send_partial_agent_metadata(descs, True, ["UCX"])
    a.send_partial_agent_metadata(descs, True, ["UCX"], label="blocks")
    b = make_agent("tq")
    b.fetch_remote_metadata(a.name, label="blocks")
    wait_until(lambda: b.check_remote_metadata(a.name), timeout=15, what="labelled partial metadata")
    assert b.check_remote_metadata(a.name, b.get_xfer_descs([(addr(buf), 128, 0)], "DRAM"))


def test_no_store_at_the_endpoint_is_only_logged(monkeypatch, make_agent, tcpstore):
    """Nothing listening at the endpoint: agent creation and the calls succeed (the failures are logged, as
    NIXL does), and nothing is loaded."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.delenv("NIXL_ETCD_ENDPOINTS", raising=False)
    monkeypatch.setenv("NIXL_TCPSTORE_ENDPOINT", f"127.0.0.1:{port}")
    monkeypatch.setenv("NIXL_TCPSTORE_TIMEOUT_MS", "1000")
    monkeypatch.setenv("NIXL_TCPSTORE_OP_TIMEOUT_MS", "1000")
    a = make_agent("tn")
    a.send_local_metadata()
    a.fetch_remote_metadata("nobody")
    a.invalidate_local_metadata()
    time.sleep(0.5)
    assert not a.check_remote_metadata("nobody")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
