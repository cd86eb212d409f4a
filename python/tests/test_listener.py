"""Metadata exchange through the agents' listener sockets (NIXL's P2P path), on both implementations.

Both agents listen (NIXL needs a listener on the fetching side too; gixl does not, see the gixl-only test).
Everything is asynchronous: each call returns at once and the test polls ``check_remote_metadata``.
"""

from __future__ import annotations

import socket

import numpy as np
import pytest

from helpers import addr, wait_until


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def listeners(make_agent):
    pa, pb = free_port(), free_port()
    a = make_agent("la", enable_listen_thread=True, listen_port=pa)
    b = make_agent("lb", enable_listen_thread=True, listen_port=pb)
    return a, pa, b, pb


def test_fetch_send_and_invalidate(listeners):
    a, pa, b, pb = listeners
    buf = np.zeros(4096, dtype=np.uint8)
    b.register_memory([(addr(buf), buf.nbytes, 0, "")], "DRAM")
    assert not a.check_remote_metadata(b.name)
    a.fetch_remote_metadata(b.name, "127.0.0.1", pb)
    wait_until(lambda: a.check_remote_metadata(b.name), timeout=10, what="fetched metadata")
    assert a.check_remote_metadata(b.name, a.get_xfer_descs([(addr(buf), 64, 0)], "DRAM"))

    a.send_local_metadata("127.0.0.1", pb)
    wait_until(lambda: b.check_remote_metadata(a.name), timeout=10, what="pushed metadata")

    a.invalidate_local_metadata("127.0.0.1", pb)
    wait_until(lambda: not b.check_remote_metadata(a.name), timeout=10, what="invalidation")


def test_partial_metadata_with_label(listeners):
    a, pa, b, pb = listeners
    buf = np.zeros(8192, dtype=np.uint8)
    reg = a.register_memory([(addr(buf), 4096, 0, ""), (addr(buf, 4096), 4096, 0, "")], "DRAM")
    assert reg is not None
    first = a.get_reg_descs([(addr(buf), 4096, 0, "")], "DRAM")
    a.send_partial_agent_metadata(first, True, ["UCX"], "127.0.0.1", pb)
    wait_until(lambda: b.check_remote_metadata(a.name), timeout=10, what="partial metadata")
    assert b.check_remote_metadata(a.name, b.get_xfer_descs([(addr(buf), 4096, 0)], "DRAM"))


def test_send_without_address_or_store_is_invalid(api, bind, make_agent, monkeypatch):
    monkeypatch.delenv("NIXL_ETCD_ENDPOINTS", raising=False)
    a = make_agent("noaddr")
    with pytest.raises(bind.nixlInvalidParamError):
        a.send_local_metadata()


@pytest.mark.gixl_only
def test_fetch_needs_no_listener_on_the_fetching_side(make_agent):
    pb = free_port()
    a = make_agent("nolisten")
    b = make_agent("lb2", enable_listen_thread=True, listen_port=pb)
    a.fetch_remote_metadata(b.name, "127.0.0.1", pb)
    wait_until(lambda: a.check_remote_metadata(b.name), timeout=10, what="fetch without a local listener")
