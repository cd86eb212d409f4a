"""Small helpers shared by the conformance tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np


def wait_until(fn, timeout=5.0, interval=0.002, what="condition"):
    """Call ``fn`` until it returns a truthy value; return that value or raise TimeoutError."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def wait_done(agent, handle, timeout=5.0):
    """Poll ``check_xfer_state`` until it is no longer "PROC"; return the final state."""
    deadline = time.monotonic() + timeout
    while True:
        state = agent.check_xfer_state(handle)
        if state != "PROC":
            return state
        if time.monotonic() > deadline:
            raise TimeoutError("transfer still in progress")
        time.sleep(0.001)


def collect_notifs(agent, count=1, timeout=5.0):
    """Gather ``get_new_notifs`` results until ``count`` messages arrived (or timeout)."""
    out: dict = {}
    total = 0
    deadline = time.monotonic() + timeout
    while total < count and time.monotonic() < deadline:
        for sender, msgs in agent.get_new_notifs().items():
            out.setdefault(sender, []).extend(msgs)
            total += len(msgs)
        if total < count:
            time.sleep(0.002)
    return out


def pattern(size: int, seed: int = 0) -> np.ndarray:
    """A deterministic, non-constant uint8 buffer."""
    return ((np.arange(size, dtype=np.uint64) * 7 + seed) % 251).astype(np.uint8)


def addr(arr: np.ndarray, offset: int = 0) -> int:
    return int(arr.ctypes.data) + offset


def make_pair(make_agent, size=8 * 1024, **cfg):
    """Two in-process agents: A (initiator, buffer ``src``) and B (target, buffer ``dst``).

    Both buffers are registered as DRAM and A has loaded B's metadata.
    """
    a = make_agent("init", **cfg)
    b = make_agent("target")
    src = pattern(size, 3)
    dst = np.zeros(size, dtype=np.uint8)
    reg_a = a.register_memory([(addr(src), size, 0, "")], "DRAM")
    reg_b = b.register_memory([(addr(dst), size, 0, "")], "DRAM")
    remote = a.add_remote_agent(b.get_agent_metadata())
    return SimpleNamespace(A=a, B=b, src=src, dst=dst, reg_a=reg_a, reg_b=reg_b, remote=remote, size=size)


def run_impl_child(code: str, env: dict | None = None, drop=lambda k: False, timeout=60) -> str:
    """Run ``code`` in a fresh interpreter that has loaded the implementation under test as ``M``; the last
    line it printed. The child inherits this environment less the variables ``drop`` selects, plus ``env``."""
    import _impl

    child = _impl.child_env(os.environ["GIXL_TEST_IMPL"], os.environ["GIXL_TEST_BINDINGS"])
    for k in [k for k in child if drop(k)]:
        del child[k]
    child.update(env or {})
    prelude = "import os, sys, _impl\nM = _impl.load(os.environ['GIXL_TEST_IMPL'], os.environ['GIXL_TEST_BINDINGS'])\n"
    out = subprocess.run(
        [sys.executable, "-c", prelude + code],
        env=child,
        cwd=_impl.TESTS_DIR,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]
