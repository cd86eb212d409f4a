"""The POSIX file backend through nixl._api: DRAM <-> FILE, query_memory, and its error statuses.

NIXL users (SGLang HiCache, LMCache, vLLM offload) spill KV blocks to files this way: the FILE list is
prepped against the agent's own name, the DRAM list as the local side; READ is file -> DRAM, WRITE is
DRAM -> file. Every test here passes on the real NIXL POSIX backend too.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from helpers import addr, pattern, wait_done

BLK = 16 * 1024


@pytest.fixture
def posix(make_agent):
    return make_agent("posix", backends=["POSIX"])


@pytest.fixture
def fd(tmp_path):
    f = os.open(tmp_path / "kv.bin", os.O_RDWR | os.O_CREAT, 0o600)
    yield f
    try:
        os.close(f)
    except OSError:
        pass


def file_side(agent, fd, n, size=BLK):
    reg = agent.register_memory([(0, 0, fd, "")], "FILE")
    return reg, agent.prep_xfer_dlist(agent.name, [(i * size, size, fd) for i in range(n)], "FILE")


def dram_side(agent, buf, n, size=BLK):
    reg = agent.register_memory([(addr(buf), buf.nbytes, 0, "")], "DRAM")
    return reg, agent.prep_xfer_dlist("", [(addr(buf, i * size), size, 0) for i in range(n)], "DRAM")


def run(agent, op, local, remote, n):
    idx = np.arange(n)
    h = agent.make_prepped_xfer(op, local, idx, remote, idx)
    state = agent.transfer(h)
    assert state in ("DONE", "PROC")
    return agent, h


def test_plugin_reports_posix(api, posix):
    assert "POSIX" in posix.get_plugin_list()
    params = posix.get_plugin_params("POSIX")
    assert {"use_uring", "use_aio", "use_posix_aio"} <= set(params)
    assert set(posix.get_backend_mem_types("POSIX")) == {"DRAM_SEG", "FILE_SEG"}


def test_round_trip_many_descriptors(posix, fd):
    n = 256
    src = pattern(n * BLK, seed=3)
    back = np.zeros_like(src)
    _, fside = file_side(posix, fd, n)
    _, s = dram_side(posix, src, n)
    _, h = run(posix, "WRITE", s, fside, n)
    assert wait_done(posix, h) == "DONE"
    assert os.pread(fd, 64, 5 * BLK) == src[5 * BLK : 5 * BLK + 64].tobytes()
    _, b = dram_side(posix, back, n)
    # Reversed order on the file side: descriptor i reads block n-1-i.
    h2 = posix.make_prepped_xfer("READ", b, np.arange(n), fside, np.arange(n)[::-1].copy())
    assert posix.transfer(h2) in ("DONE", "PROC")
    assert wait_done(posix, h2) == "DONE"
    assert (back.reshape(n, BLK) == src.reshape(n, BLK)[::-1]).all()


def test_read_past_end_of_file_is_an_error(posix, bind, fd):
    os.pwrite(fd, b"x" * BLK, 0)  # the file holds one block; the request asks for two
    buf = np.zeros(2 * BLK, dtype=np.uint8)
    _, fside = file_side(posix, fd, 2)
    _, d = dram_side(posix, buf, 2)
    h = posix.make_prepped_xfer("READ", d, np.arange(2), fside, np.arange(2))
    with pytest.raises(bind.nixlBackendError):
        state = posix.transfer(h)
        while state == "PROC":
            state = posix.check_xfer_state(h)


def test_closed_descriptor_is_an_error(posix, bind, fd):
    buf = pattern(BLK)
    _, fside = file_side(posix, fd, 1)
    _, d = dram_side(posix, buf, 1)
    h = posix.make_prepped_xfer("WRITE", d, [0], fside, [0])
    os.close(fd)
    with pytest.raises(bind.nixlBackendError):
        state = posix.transfer(h)
        while state == "PROC":
            state = posix.check_xfer_state(h)


def test_disk_full_is_an_error(posix, bind):
    full = os.open("/dev/full", os.O_WRONLY)
    try:
        buf = pattern(BLK)
        _, fside = file_side(posix, full, 1)
        _, d = dram_side(posix, buf, 1)
        h = posix.make_prepped_xfer("WRITE", d, [0], fside, [0])
        with pytest.raises(bind.nixlBackendError):
            state = posix.transfer(h)
            while state == "PROC":
                state = posix.check_xfer_state(h)
    finally:
        os.close(full)


def test_notification_is_refused(posix, bind, fd):
    buf = pattern(BLK)
    _, fside = file_side(posix, fd, 1)
    _, d = dram_side(posix, buf, 1)
    with pytest.raises(bind.nixlBackendError):
        posix.make_prepped_xfer("WRITE", d, [0], fside, [0], b"no notifications on files")


def test_file_side_must_be_remote(posix, bind, fd):
    buf = pattern(BLK)
    fl = posix.register_memory([(0, 0, fd, "")], "FILE")
    assert fl is not None
    posix.register_memory([(addr(buf), buf.nbytes, 0, "")], "DRAM")
    local_file = posix.prep_xfer_dlist("", [(0, BLK, fd)], "FILE")
    remote_dram = posix.prep_xfer_dlist(posix.name, [(addr(buf), BLK, 0)], "DRAM")
    with pytest.raises(bind.nixlInvalidParamError):
        posix.make_prepped_xfer("WRITE", local_file, [0], remote_dram, [0])


def test_query_memory(posix, tmp_path):
    p = tmp_path / "exists.bin"
    p.write_bytes(b"12345")
    descs = [(0, 0, 0, str(p)), (0, 0, 0, str(tmp_path / "missing.bin")), (0, 0, 0, str(p))]
    out = posix.query_memory(descs, "POSIX", "FILE")
    assert out[1] is None
    assert out[0] is not None and int(out[0]["size"]) == 5
    assert {"size", "mode", "mtime"} <= set(out[0])
    assert out[2] == out[0]


def test_misaligned_o_direct_fails_clearly(posix, bind, tmp_path):
    """gixl refuses at request creation; NIXL fails the transfer. Either way: an error, never bad data."""
    try:
        fd = os.open(tmp_path / "direct.bin", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        pytest.skip("this filesystem refuses O_DIRECT")
    try:
        buf = pattern(2 * BLK)
        posix.register_memory([(0, 0, fd, "")], "FILE")
        posix.register_memory([(addr(buf), buf.nbytes, 0, "")], "DRAM")
        fside = posix.prep_xfer_dlist(posix.name, [(1, BLK, fd)], "FILE")  # offset 1: misaligned
        d = posix.prep_xfer_dlist("", [(addr(buf, 1), BLK, 0)], "DRAM")
        with pytest.raises((bind.nixlBackendError, bind.nixlInvalidParamError)):
            h = posix.make_prepped_xfer("WRITE", d, [0], fside, [0])
            state = posix.transfer(h)
            while state == "PROC":
                state = posix.check_xfer_state(h)
    finally:
        os.close(fd)


def test_path_mode_registration(posix, bind, tmp_path):
    """NIXL 1.5.1's path mode: metaInfo "<modes>:<path>" makes the backend open the file itself; devId is then
    the caller's name for it (unique per file), not a descriptor."""
    path = tmp_path / "pm.bin"
    reg = posix.register_memory([(0, 0, 4242, f"rw,create:{path}")], "FILE")
    assert path.exists()
    with pytest.raises(bind.nixlBackendError):
        posix.register_memory([(0, 0, 4242, f"rw:{path}")], "FILE")  # the devId is taken
    buf = pattern(4 * BLK, 5)
    m = posix.register_memory([(addr(buf), buf.nbytes, 0, "")], "DRAM")
    src = posix.get_xfer_descs([(addr(buf), buf.nbytes, 0)], "DRAM")
    dst = posix.get_xfer_descs([(0, buf.nbytes, 4242)], "FILE")
    h = posix.initialize_xfer("WRITE", src, dst, posix.name)
    assert posix.transfer(h) in ("DONE", "PROC")
    assert wait_done(posix, h) == "DONE"
    assert path.read_bytes() == buf.tobytes()
    posix.release_xfer_handle(h)
    posix.deregister_memory(reg)
    posix.deregister_memory(m)
