"""gixl's overlap check (docs/overlap-check.md): ``nixl_agent_config(check_overlap=...)``,
``nixlAgentConfig.gixlCheckOverlap`` and ``GIXL_CHECK_OVERLAP``.

Loopback READs of 64 MiB (split over the engine's copy threads, so the first is still in flight when
the second is posted; each test retries until that happened) into one destination buffer.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

pytestmark = [pytest.mark.gixl_only, pytest.mark.gixl_native]

SIZE = 64 << 20


def _wait(agent, h, timeout=30.0):
    deadline = time.monotonic() + timeout
    state = agent.check_xfer_state(h)
    while state == "PROC" and time.monotonic() < deadline:
        time.sleep(0.0005)
        state = agent.check_xfer_state(h)
    return state


def _setup(agent):
    bufs = [np.full(SIZE, v, dtype=np.uint8) for v in (1, 2, 0)]
    for b in bufs:
        agent.register_memory([(b.ctypes.data, SIZE, 0, "")], "DRAM")
    src1, src2, dst = bufs

    def xfer(src, notif):
        local = agent.get_xfer_descs([(dst.ctypes.data, SIZE, 0)], "DRAM")
        remote = agent.get_xfer_descs([(src.ctypes.data, SIZE, 0)], "DRAM")
        return agent.initialize_xfer("READ", local, remote, agent.name, notif)

    return bufs, xfer(src1, b"first"), xfer(src2, b"second")


def test_refuse_through_nixl_agent_config_leaves_the_first_intact(make_agent, bind):
    agent = make_agent("overlap", check_overlap="refuse")
    (src1, src2, dst), x1, x2 = _setup(agent)
    for _ in range(50):
        if agent.transfer(x1) == "DONE":
            continue
        try:
            agent.transfer(x2)
        except bind.nixlNotAllowedError as e:
            notes = " ".join(getattr(e, "__notes__", []))
            if sys.version_info >= (3, 11):
                assert "first" in notes and "second" in notes and "refused" in notes, notes
            assert _wait(agent, x1) == "DONE"
            assert (dst == 1).all(), "the refused READ moved bytes"
            # Once the first has finished, the second goes through.
            assert agent.transfer(x2) in ("DONE", "PROC")
            assert _wait(agent, x2) == "DONE"
            assert (dst == 2).all()
            return
        _wait(agent, x1)
        _wait(agent, x2)
    pytest.fail("a 64 MiB loopback READ always finished before the next post")


def test_the_option_is_checked_and_off_by_default(make_agent, api, bind):
    with pytest.raises(ValueError):
        api.nixl_agent_config(check_overlap="sometimes")
    cfg = bind.nixlAgentConfig()
    assert cfg.gixlCheckOverlap == "off"
    cfg.gixlCheckOverlap = "WARN"
    assert cfg.gixlCheckOverlap == "warn"
    with pytest.raises(ValueError):
        cfg.gixlCheckOverlap = "maybe"
    # Off: both posts go ahead, however they overlap.
    if os.environ.get("GIXL_CHECK_OVERLAP"):
        pytest.skip("GIXL_CHECK_OVERLAP is set in this environment")
    agent = make_agent("overlap-off")
    _, x1, x2 = _setup(agent)
    agent.transfer(x1)
    agent.transfer(x2)
    assert _wait(agent, x1) == "DONE" and _wait(agent, x2) == "DONE"


CHILD = textwrap.dedent(
    """
    import time
    import numpy as np
    from nixl._api import nixl_agent
    SIZE = 64 << 20
    a = nixl_agent("env-overlap")
    bufs = [np.full(SIZE, v, dtype=np.uint8) for v in (1, 2, 0)]
    for b in bufs:
        a.register_memory([(b.ctypes.data, SIZE, 0, "")], "DRAM")
    def x(src, n):
        l = a.get_xfer_descs([(bufs[2].ctypes.data, SIZE, 0)], "DRAM")
        r = a.get_xfer_descs([(src.ctypes.data, SIZE, 0)], "DRAM")
        return a.initialize_xfer("READ", l, r, a.name, n)
    x1, x2 = x(bufs[0], b"one"), x(bufs[1], b"two")
    def wait(h):
        while a.check_xfer_state(h) == "PROC":
            time.sleep(0.0005)
    for _ in range(50):
        if a.transfer(x1) == "DONE":
            continue
        a.transfer(x2)
        wait(x1)
        wait(x2)
    print("@done", flush=True)
    """
)


def test_the_environment_variable_switches_warn_on(tmp_path):
    env = {**os.environ, "GIXL_CHECK_OVERLAP": "warn"}
    out = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert out.returncode == 0 and "@done" in out.stdout, out.stderr[-4000:]
    # gixl's log lines go to the ``nixl`` logger, which writes to stdout as NIXL's does.
    lines = [ln for ln in (out.stdout + out.stderr).splitlines() if "overlap check:" in ln]
    assert lines, f"no overlap warning in: {out.stdout[-2000:]} {out.stderr[-2000:]}"
    assert '"one"' in lines[0] and '"two"' in lines[0] and "GIXL_CHECK_OVERLAP=warn" in lines[0], lines[0]


@pytest.mark.two_process
def test_the_tcp_target_reports_two_initiators_writing_one_range(peers):
    """Two decode workers (processes) WRITE the same block of a target process over TCP: neither can see the
    other's request; the target, with the check on, serves both and logs it."""
    import uuid

    size = 16 << 20
    tcp = {"GIXL_TRANSPORT": "tcp"}
    target = peers("target", env={**tcp, "GIXL_CHECK_OVERLAP": "warn"})
    writers = [peers("writer-a", env=tcp), peers("writer-b", env=tcp)]
    t = target.init(name=f"target-{uuid.uuid4()}", size=size, fill="zeros")
    xids = []
    for w, fill in zip(writers, ("3", "4")):
        me = w.init(name=f"writer-{uuid.uuid4()}", size=size, fill=fill)
        w.add_remote(md=t["md"])
        x = w.make_new(op="WRITE", name=t["name"], local=[[me["addr"], size, 0]], remote=[[t["addr"], size, 0]])
        assert isinstance(x, int), x
        xids.append(x)
    seen = ""
    for _ in range(30):
        for w, x in zip(writers, xids):
            w.send("post", xid=x)
        for w in writers:
            assert w.recv() in ("DONE", "PROC")
        for w, x in zip(writers, xids):
            assert w.wait(xid=x, timeout=30)[-1] == "DONE"
        seen = target.log_tail(20000)
        if "overlap check (TCP target)" in seen:
            break
    line = next((ln for ln in seen.splitlines() if "overlap check (TCP target)" in ln), None)
    assert line, f"the target logged no overlap in 30 rounds:\n{seen[-3000:]}"
    assert "WRITE from 'writer-" in line and "being served writes" in line, line
    for w in writers:
        assert "overlap check" not in w.log_tail(20000), "an initiator's own check is off"
