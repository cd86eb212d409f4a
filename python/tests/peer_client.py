"""Parent side of peer.py: spawn a child NIXL peer and call it with timeouts."""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time

import _impl
from _wire import dec, enc

PEER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer.py")
DEFAULT_TIMEOUT = float(os.environ.get("GIXL_TEST_PEER_TIMEOUT_S", "15"))


class PeerError(Exception):
    """An exception raised inside the peer; ``.exc`` is its class name."""

    def __init__(self, exc: str, msg: str):
        super().__init__(f"{exc}: {msg}")
        self.exc = exc
        self.msg = msg


class PeerDied(Exception):
    """The child exited; ``.rc`` is its exit status (negative: killed by that signal)."""

    rc = None


class PeerProcess:
    def __init__(self, label, impl, bindings, tmp_path, python=None, env=None):
        self.label = label
        self.log_path = os.path.join(str(tmp_path), f"{label}-{os.getpid()}-{time.monotonic_ns()}.log")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [python or sys.executable, PEER_SCRIPT],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env={**_impl.child_env(impl, bindings), **(env or {})},
            cwd=os.path.dirname(PEER_SCRIPT),
        )
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.proc.stdout, selectors.EVENT_READ)
        self._buf = b""

    @property
    def pid(self):
        return self.proc.pid

    def log_tail(self, n=4000) -> str:
        try:
            self._log.flush()
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode("utf-8", "replace")
        except OSError:
            return ""

    def _readline(self, timeout):
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"peer {self.label} did not answer within {timeout}s\n{self.log_tail()}")
            if not self._sel.select(left):
                continue
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                try:
                    rc = self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    rc = None
                err = PeerDied(f"peer {self.label} exited (rc={rc})\n{self.log_tail()}")
                err.rc = rc
                raise err
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line

    def send(self, cmd, **kw):
        """Send a request without waiting for the reply (use ``recv``)."""
        kw["cmd"] = cmd
        try:
            self.proc.stdin.write((json.dumps(enc(kw)) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise PeerDied(f"peer {self.label} is gone: {exc}\n{self.log_tail()}")

    def recv(self, timeout=DEFAULT_TIMEOUT):
        reply = json.loads(self._readline(timeout))
        if not reply["ok"]:
            raise PeerError(reply["exc"], reply["msg"])
        return dec(reply["result"])

    def call(self, cmd, timeout=DEFAULT_TIMEOUT, **kw):
        self.send(cmd, **kw)
        return self.recv(timeout)

    def __getattr__(self, cmd):
        if cmd.startswith("_"):
            raise AttributeError(cmd)
        return lambda timeout=DEFAULT_TIMEOUT, **kw: self.call(cmd, timeout=timeout, **kw)

    def kill(self):
        """SIGKILL the child and reap it."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def close(self):
        if self.proc.poll() is None:
            try:
                self.send("exit")
                self.proc.wait(timeout=3)
            except Exception:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except Exception:
                pass
        try:
            self._sel.close()
        except Exception:
            pass
        self._log.close()
