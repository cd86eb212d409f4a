"""Per-transfer telemetry: capture_telemetry, NIXL_TELEMETRY_ENABLE and the nixlXferTelemetry fields."""

from __future__ import annotations

import time

import pytest

from helpers import addr, make_pair, wait_done


@pytest.fixture
def telemetry_env(monkeypatch, tmp_path):
    monkeypatch.delenv("NIXL_TELEMETRY_ENABLE", raising=False)
    monkeypatch.setenv("NIXL_TELEMETRY_DIR", str(tmp_path))
    return monkeypatch


def _two_desc_write(p, notif=b"telem_msg"):
    a = p.A
    l = a.get_xfer_descs([(addr(p.src), 64, 0), (addr(p.src, 128), 64, 0)], "DRAM")
    r = a.get_xfer_descs([(addr(p.dst), 64, 0), (addr(p.dst, 128), 64, 0)], "DRAM")
    return a.initialize_xfer("WRITE", l, r, p.remote, notif)


def _check_fields(bind, t, desc_count, total_bytes):
    assert isinstance(t, bind.nixlXferTelemetry)
    for field in ("startTime", "postDuration", "xferDuration", "totalBytes", "descCount"):
        assert isinstance(getattr(t, field), int), field
    assert t.descCount == desc_count
    assert t.totalBytes == total_bytes
    assert t.startTime > 0
    # startTime is a steady-clock timestamp in microseconds (CLOCK_MONOTONIC)
    assert abs(t.startTime - time.monotonic() * 1e6) < 60e6
    assert t.postDuration >= 0
    assert t.xferDuration >= t.postDuration
    assert t.xferDuration > 0


def test_capture_telemetry_config(make_agent, bind, telemetry_env):
    p = make_pair(make_agent, size=256, capture_telemetry=True)
    h = _two_desc_write(p)
    with pytest.raises(bind.nixlNotPostedError):
        p.A.get_xfer_telemetry(h)
    assert p.A.transfer(h) in ("DONE", "PROC")
    assert wait_done(p.A, h) == "DONE"
    _check_fields(bind, p.A.get_xfer_telemetry(h), 2, 128)


def test_telemetry_off_by_default(make_agent, bind, telemetry_env):
    p = make_pair(make_agent, size=256)
    h = _two_desc_write(p)
    with pytest.raises(bind.nixlNoTelemetryError) as info:
        p.A.get_xfer_telemetry(h)
    assert str(info.value) == "NIXL_ERR_NO_TELEMETRY"
    p.A.transfer(h)
    assert wait_done(p.A, h) == "DONE"
    with pytest.raises(bind.nixlNoTelemetryError):
        p.A.get_xfer_telemetry(h)


@pytest.mark.parametrize("value", ["y", "1"])
def test_telemetry_enabled_by_env(make_agent, bind, telemetry_env, value):
    telemetry_env.setenv("NIXL_TELEMETRY_ENABLE", value)
    p = make_pair(make_agent, size=256)
    h = _two_desc_write(p)
    p.A.transfer(h)
    assert wait_done(p.A, h) == "DONE"
    _check_fields(bind, p.A.get_xfer_telemetry(h), 2, 128)


@pytest.mark.parametrize("value", ["no", "n"])
def test_env_disable_overrides_config(make_agent, bind, telemetry_env, value):
    telemetry_env.setenv("NIXL_TELEMETRY_ENABLE", value)
    p = make_pair(make_agent, size=256, capture_telemetry=True)
    h = _two_desc_write(p)
    p.A.transfer(h)
    assert wait_done(p.A, h) == "DONE"
    with pytest.raises(bind.nixlNoTelemetryError):
        p.A.get_xfer_telemetry(h)


def test_telemetry_after_repost(make_agent, bind, telemetry_env):
    p = make_pair(make_agent, size=4096, capture_telemetry=True)
    a = p.A
    lh = a.prep_xfer_dlist("", [(addr(p.src), 1024, 0)], "DRAM")
    rh = a.prep_xfer_dlist(p.remote, [(addr(p.dst), 1024, 0)], "DRAM")
    h = a.make_prepped_xfer("READ", lh, [0], rh, [0])
    a.transfer(h)
    wait_done(a, h)
    first = a.get_xfer_telemetry(h).startTime
    time.sleep(0.002)
    a.transfer(h)
    wait_done(a, h)
    t = a.get_xfer_telemetry(h)
    assert t.startTime > first
    assert (t.totalBytes, t.descCount) == (1024, 1)
