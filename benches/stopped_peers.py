#!/usr/bin/env python3
"""Stopped and dead peers: what each side's calls cost while the other process is stopped or a zombie.

Measures one implementation of the NIXL Python API (`<module>._api`), with real processes on one host, DRAM
memory and the UCX backend (`nixl_agent_config(backends=["UCX"])`), in three cases:

1. Stopped target. The target T registers a 64 MiB buffer and sends its `get_agent_metadata()` to this
   script over a pipe. The script stops T (SIGSTOP) and passes the metadata to the initiator I, which calls
   `add_remote_agent` and then READs 1 MiB from T: `initialize_xfer`, `transfer`, then `check_xfer_state`
   until DONE or ERR, for at most 10 s. Reported: the time of `add_remote_agent`, the outcome and time of
   the READ. Then T is continued (SIGCONT) and a READ still in progress is polled 5 s more. For
   comparison, I then removes T, adds it again and READs while T runs, and READs once more with T
   stopped again (a connection that has already carried a READ).
2. Stopped initiator inside a transfer. T registers the 64 MiB buffer I reads and two sets of 16 separate
   4 KiB buffers, then sends its metadata. I loads it and READs the whole 64 MiB in a loop (one
   `initialize_xfer` handle, reposted). First, while I is idle, T deregisters set A (the baseline). Then
   the script stops I while a READ is in flight and T deregisters set B; the script reports how long
   that took. I is then continued and the outcome of its interrupted READ is reported.
3. Zombie initiator. As in 2, but I, once stopped inside a READ, is killed (SIGKILL) and not reaped: it
   stays a zombie, and its pid and /proc entry remain, while T deregisters set B.

In each case T's health is checked afterwards (in 2 and 3 while I is still stopped or a zombie): a 4 KiB
`register_memory`, `get_agent_metadata` and `deregister_memory`, plus a check that T's 64 MiB buffer
still holds its pattern.

"Inside a READ" means: I had posted the READ (its `transfer` call had started) and had not yet seen it end
when the stop took effect, and the stop signal went out between a quarter and a half of a typical READ's
time (the median of 5 warm-up READs) after the post, so the copy was most likely under way and
unfinished. I publishes its loop state (sequence number, in-flight flag, post time) in a small shared
file, which the script reads after the stop to confirm; if the READ had already ended, the script
continues I and tries again (up to --attempts times).

The 16 small buffers of a set are separate allocations and separate registrations (one descriptor each).
By default each set is registered with one `register_memory` call holding 16 descriptors and deregistered
with one `deregister_memory` call on that list (`--dereg one`); `--dereg each` registers and deregisters
each buffer with its own call (16 calls). The output says which.

Every step has a watchdog: a reply that does not come within 15 s (`--watchdog`) is reported as
"blocked > 15 s"; the script then resumes or reaps the stopped peer and reports whether (and when) the
call returned afterwards. All children are killed at the end, whatever happened.

Run it with the implementation's own interpreter (numpy and the implementation importable):

    .venv/nixl/bin/python benches/stopped_peers.py --impl nixl_cu12
    .venv/gixl/bin/python benches/stopped_peers.py --impl gixl

The module is chosen as the conformance tests choose it (python/tests/_impl.py): `nixl_cu12._api` (or
`nixl_cu13._api`) for NVIDIA NIXL; for gixl, `nixl._api` from this checkout's python/ when its native
module has been built there (python/gixl/_gixl*.so), otherwise the installed `nixl` package
(GIXL_TEST_INSTALLED=1 forces the installed one). The first output line says which file was loaded.

Options: --cases 1,2,3 (default all), --dereg one|each, --watchdog S (15), --read-poll S (10),
--attempts N (20), --keep-logs DIR (the children's stderr). Timings are wall-clock around the Python API
calls (`time.perf_counter`), so they include the binding overhead. Exit status 0 when every case ran to
its end (whatever the outcome measured), 1 otherwise.
"""

import argparse
import glob
import json
import mmap
import os
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS_DIR = os.path.join(REPO, "python", "tests")
THIS = os.path.abspath(__file__)

KiB = 1024
MiB = 1024 * KiB
BIG = 64 * MiB  # T's registered buffer
READ1 = 1 * MiB  # case 1's READ
SMALL = 4 * KiB  # each of the 16 small registrations
NSMALL = 16
KEY = 0x5A5A_0000_0000_0001  # word i of T's buffer holds i ^ KEY

# The initiator's loop state, shared with the parent: int64 words of a small file both map.
W_SEQ, W_PHASE, W_TPOST, W_STOP, W_NDONE, W_WATCH, W_WSTATE, W_WDUR = range(8)
SHM_WORDS = 8
WSTATE = {0: "(not ended)", 1: "DONE", 2: "ERR", 3: "exception", 4: "other"}


# ----------------------------------------------------------------------------------------------------------
# Children (--role target|initiator): JSON lines on stdin, replies on the original stdout
# ----------------------------------------------------------------------------------------------------------

def load_api(impl):
    """Import the implementation's `_api` the way python/tests/_impl.py does."""
    sys.path.insert(0, TESTS_DIR)
    import _impl

    m = _impl.load(impl, os.environ.get("GIXL_TEST_BINDINGS", "native") if impl == "gixl" else impl)
    return m.api


def die_with_parent():
    """PR_SET_PDEATHSIG: this child gets SIGKILL when the script that started it dies."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:
            os._exit(1)
    except Exception:
        pass


def fill(np, buf):
    words = buf.view(np.uint64)
    words[:] = np.arange(words.size, dtype=np.uint64)
    words ^= np.uint64(KEY)


def holds_pattern(np, buf, first_word=0):
    words = buf.view(np.uint64)
    exp = np.arange(first_word, first_word + words.size, dtype=np.uint64)
    exp ^= np.uint64(KEY)
    return bool(np.array_equal(words, exp))


def make_agent(api, prefix):
    return api.nixl_agent(f"{prefix}-{uuid.uuid4().hex[:8]}", api.nixl_agent_config(backends=["UCX"]))


def poll_state(agent, h, st, bound_s):
    """check_xfer_state until not PROC or `bound_s` passes; returns the last state."""
    deadline = time.monotonic() + bound_s
    while st == "PROC" and time.monotonic() < deadline:
        time.sleep(0.0002)
        st = agent.check_xfer_state(h)
    return st


def exc_text(e):
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]


class Target:
    def __init__(self, api, np):
        self.api, self.np = api, np
        self.agent = make_agent(api, "target")
        self.big = np.empty(BIG, np.uint8)
        fill(np, self.big)
        self.big_reg = self.agent.register_memory([(self.big.ctypes.data, BIG, 0, "")], "DRAM")
        self.sets = {}

    def cmd_setup(self, send, sets=(), per_call=False):
        np = self.np
        for s in sets:
            bufs = [np.full(SMALL, 7, np.uint8) for _ in range(NSMALL)]
            rows = [(b.ctypes.data, SMALL, 0, "") for b in bufs]
            if per_call:
                regs = [self.agent.register_memory([r], "DRAM") for r in rows]
            else:
                regs = [self.agent.register_memory(rows, "DRAM")]
            self.sets[s] = (bufs, regs)
        return dict(name=self.agent.name, md=self.agent.get_agent_metadata().hex(), addr=int(self.big.ctypes.data))

    def cmd_dereg(self, send, set):
        bufs, regs = self.sets.pop(set)
        t0 = time.perf_counter()
        for r in regs:
            self.agent.deregister_memory(r)
        return dict(s=time.perf_counter() - t0, calls=len(regs))

    def cmd_health(self, send):
        np = self.np
        b = np.zeros(SMALL, np.uint8)
        t0 = time.perf_counter()
        reg = self.agent.register_memory([(b.ctypes.data, SMALL, 0, "")], "DRAM")
        md = self.agent.get_agent_metadata()
        self.agent.deregister_memory(reg)
        s = time.perf_counter() - t0
        return dict(s=s, md_bytes=len(md), pattern=holds_pattern(np, self.big))


class Initiator:
    def __init__(self, api, np):
        self.api, self.np = api, np
        self.agent = make_agent(api, "initiator")
        self.buf = self.reg = self.h = None
        self.remote = None

    def cmd_prepare(self, send, size):
        self.buf = self.np.zeros(size, self.np.uint8)
        self.reg = self.agent.register_memory([(self.buf.ctypes.data, size, 0, "")], "DRAM")
        return {}

    def cmd_add_remote(self, send, md):
        md = bytes.fromhex(md)
        send(step="add_remote_agent")
        t0 = time.perf_counter()
        name = self.agent.add_remote_agent(md)
        s = time.perf_counter() - t0
        self.remote = name.decode() if isinstance(name, bytes) else str(name)
        return dict(s=s, name=self.remote)

    def cmd_remove_remote(self, send):
        if self.h is not None:
            self.agent.release_xfer_handle(self.h)
            self.h = None
        t0 = time.perf_counter()
        self.agent.remove_remote_agent(self.remote)
        return dict(s=time.perf_counter() - t0)

    def _descs(self, addr, size):
        a = self.agent
        return (a.get_xfer_descs([(self.buf.ctypes.data, size, 0)], "DRAM"),
                a.get_xfer_descs([(addr, size, 0)], "DRAM"))

    def cmd_read_once(self, send, addr, size, poll_s):
        """One READ with a step message before and after each call (so a block is located)."""
        if self.h is not None:
            self.agent.release_xfer_handle(self.h)
            self.h = None
        self.buf[:size] = 0
        out = {}
        t_start = time.perf_counter()
        send(step="initialize_xfer")
        t0 = time.perf_counter()
        try:
            ld, rd = self._descs(addr, size)
            self.h = self.agent.initialize_xfer("READ", ld, rd, self.remote, b"")
        except Exception as e:
            return dict(state="initialize_xfer raised " + exc_text(e), s=time.perf_counter() - t_start)
        out["init_s"] = time.perf_counter() - t0
        send(step="initialize_xfer", s=out["init_s"])
        send(step="transfer")
        t0 = time.perf_counter()
        try:
            st = self.agent.transfer(self.h)
        except Exception as e:
            return dict(out, state="transfer raised " + exc_text(e), s=time.perf_counter() - t_start)
        out["post_s"] = time.perf_counter() - t0
        out["post_state"] = st
        send(step="transfer", s=out["post_s"], state=st)
        send(step="check_xfer_state")
        try:
            st = poll_state(self.agent, self.h, st, poll_s)
        except Exception as e:
            st = "check_xfer_state raised " + exc_text(e)
        out["s"] = time.perf_counter() - t_start
        out["state"] = st
        if st == "DONE":
            out["data_ok"] = holds_pattern(self.np, self.buf[:size])
        return out

    def cmd_poll(self, send, poll_s, size):
        t0 = time.perf_counter()
        try:
            st = poll_state(self.agent, self.h, "PROC", poll_s)
        except Exception as e:
            st = "check_xfer_state raised " + exc_text(e)
        out = dict(state=st, s=time.perf_counter() - t0)
        if st == "DONE":
            out["data_ok"] = holds_pattern(self.np, self.buf[:size])
        return out

    def cmd_setup_loop(self, send, addr, size, warm, shm):
        fd = os.open(shm, os.O_RDWR)
        self.mm = mmap.mmap(fd, SHM_WORDS * 8)
        os.close(fd)
        self.mv = memoryview(self.mm).cast("q")
        ld, rd = self._descs(addr, size)
        self.h = self.agent.initialize_xfer("READ", ld, rd, self.remote, b"")
        durs = []
        for _ in range(warm):
            t0 = time.perf_counter()
            st = poll_state(self.agent, self.h, self.agent.transfer(self.h), 30.0)
            durs.append(time.perf_counter() - t0)
            if st != "DONE":
                raise RuntimeError(f"warm-up READ ended {st}")
        return dict(durs=durs, data_ok=holds_pattern(self.np, self.buf))

    def cmd_loop(self, send, max_s):
        """READ the whole region again and again until the parent sets W_STOP (or max_s passes)."""
        mv, agent, h = self.mv, self.agent, self.h
        send(step="looping")
        end = time.monotonic() + max_s
        seq, durs, bad = 0, [], None
        while mv[W_STOP] == 0 and time.monotonic() < end:
            seq += 1
            mv[W_SEQ] = seq
            mv[W_TPOST] = time.monotonic_ns()
            mv[W_PHASE] = 1
            t0 = time.monotonic_ns()
            try:
                st = agent.transfer(h)
                while st == "PROC":
                    st = agent.check_xfer_state(h)
            except Exception as e:
                st = "exception " + exc_text(e)
            dur = time.monotonic_ns() - t0
            mv[W_PHASE] = 0
            mv[W_NDONE] = seq
            durs.append(dur / 1e9)
            if mv[W_WATCH] == seq:
                mv[W_WDUR] = dur
                mv[W_WSTATE] = 1 if st == "DONE" else 2 if st == "ERR" else 3 if st.startswith("exception") else 4
            if st != "DONE":
                bad = f"READ #{seq} ended {st}"
                break
        return dict(reads=seq, bad=bad, median_s=statistics.median(durs) if durs else None,
                    data_ok=holds_pattern(self.np, self.buf) if bad is None else None)


def child_main(args):
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # native log output must not reach the protocol pipe
    sys.stdout = sys.stderr
    die_with_parent()
    import faulthandler

    faulthandler.dump_traceback_later(args.child_life, exit=True)

    def send(**msg):
        proto.write(json.dumps(msg) + "\n")
        proto.flush()

    try:
        import numpy as np

        api = load_api(args.impl)
        role = (Target if args.role == "target" else Initiator)(api, np)
    except Exception as e:
        send(ok=False, err=exc_text(e), tb=traceback.format_exc())
        return 1
    send(ok=True, api=getattr(api, "__file__", "?"), pid=os.getpid())
    stdin = sys.stdin.buffer
    while True:
        line = stdin.readline()
        if not line:
            return 0
        msg = json.loads(line)
        cmd = msg.pop("cmd")
        if cmd == "quit":
            send(ok=True)
            return 0
        try:
            res = getattr(role, "cmd_" + cmd)(send, **msg)
            send(ok=True, **res)
        except Exception as e:
            send(ok=False, err=exc_text(e), tb=traceback.format_exc())


# ----------------------------------------------------------------------------------------------------------
# Parent: starts the children, sends the signals, keeps the time
# ----------------------------------------------------------------------------------------------------------

CHILDREN = []


class Blocked(Exception):
    """No reply within the watchdog; `.step` is the call the child was in (its last step message)."""

    def __init__(self, step, after_s):
        super().__init__(f"blocked in {step}")
        self.step, self.after_s = step, after_s


class ChildFailed(Exception):
    pass


class Child:
    def __init__(self, role, impl, env, logdir, tag):
        self.role, self.tag = role, tag
        self.log_path = os.path.join(logdir, f"{tag}-{role}.log")
        with open(self.log_path, "wb") as log:
            self.p = subprocess.Popen(
                [sys.executable, THIS, "--impl", impl, "--role", role],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env, cwd=REPO,
                start_new_session=True)
        CHILDREN.append(self)
        self.pid = self.p.pid
        self.buf = b""
        self.step = None
        self.reaped = False

    def send(self, cmd, timeout=5.0, **kw):
        data = memoryview((json.dumps(dict(cmd=cmd, **kw)) + "\n").encode())
        deadline = time.monotonic() + timeout
        fd = self.p.stdin.fileno()
        while data:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Blocked(f"reading command {cmd}", timeout)
            _, w, _ = select.select([], [fd], [], left)
            if w:
                n = os.write(fd, data[:4096])
                data = data[n:]

    def recv(self, timeout):
        deadline = time.monotonic() + timeout
        fd = self.p.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            r, _, _ = select.select([fd], [], [], left)
            if r:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    raise ChildFailed(f"{self.role} exited (see {self.log_path}: {log_tail(self.log_path)})")
                self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def reply(self, timeout, on_step=None):
        """The final reply of the current command; step messages along the way. Each message must come
        within `timeout` of the previous one, else Blocked names the step the child is in."""
        t0 = time.monotonic()
        while True:
            try:
                m = self.recv(timeout)
            except TimeoutError:
                raise Blocked(self.step or "(no step reported)", time.monotonic() - t0) from None
            if "step" in m:
                self.step = m["step"] if "s" not in m else None
                if on_step:
                    on_step(m)
                continue
            self.step = None
            if not m.get("ok"):
                raise ChildFailed(m.get("err", "?"))
            return m

    def call(self, cmd, timeout, on_step=None, **kw):
        self.step = None
        self.send(cmd, **kw)
        return self.reply(timeout, on_step)

    def state(self):
        """The process state letter from /proc (R, S, T, Z, ...), or None if gone."""
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            return None

    def wait_state(self, letters, timeout=2.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.state()
            if s in letters:
                return s
            time.sleep(0.0005)
        return self.state()

    def signal(self, sig):
        if not self.reaped:
            os.kill(self.pid, sig)

    def reap(self, timeout=5.0):
        try:
            self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        self.reaped = self.p.returncode is not None

    def close(self, grace=5.0):
        """quit if it still answers, then kill its process group and reap it."""
        if self.reaped or self.p.returncode is not None:
            return
        try:
            os.kill(self.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        if self.state() not in ("Z", None):
            try:
                self.call("quit", grace)
            except Exception:
                pass
            try:
                self.p.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        if self.p.returncode is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.reap(10.0)
        for f in (self.p.stdin, self.p.stdout):
            try:
                f.close()
            except OSError:
                pass
        self.reaped = True


def kill_all():
    for c in CHILDREN:
        if not c.reaped and c.p.returncode is None:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.killpg(c.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            c.reap(5.0)


def log_tail(path, n=3, pattern=None):
    """The last `n` distinct non-empty lines of a child's stderr (with `pattern`: only those, not INFO or
    DEBUG log records, that contain one of its words)."""
    try:
        with open(path, "rb") as f:
            lines = [ln.strip() for ln in f.read()[-65536:].decode("utf-8", "replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    if pattern:
        lines = [ln for ln in lines if " INFO " not in ln and " DEBUG " not in ln
                 and any(p in ln.lower() for p in pattern)]
    out = []
    for ln in reversed(lines):
        if ln[:200] not in out:
            out.append(ln[:200])
        if len(out) == n:
            break
    return " | ".join(reversed(out))


def fmt_s(s):
    if s is None:
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.0f} us"
    if s < 1.0:
        return f"{s * 1e3:.3g} ms"
    return f"{s:.3g} s"


class Case:
    def __init__(self, label):
        self.label = label
        self.rows = []  # (step, time text, outcome)
        self.notes = []
        self.complete = False

    def add(self, step, s, outcome, timetext=None):
        self.rows.append((step, timetext or fmt_s(s), outcome))

    def line(self):
        parts = [f"{step} {t} {o}".replace(" - ", " ") for step, t, o in self.rows]
        text = f"case {self.label}: " + "; ".join(parts)
        if self.notes:
            text += " [" + "; ".join(self.notes) + "]"
        return text


def blocked_text(args, b, what=""):
    return f"blocked > {args.watchdog:g} s in {b.step}{what}"


def late_reply(child, timeout):
    """After a Blocked: does the call return within `timeout` now that the peer moved on? (reply, seconds)."""
    t0 = time.monotonic()
    try:
        m = child.reply(timeout)
        return m, time.monotonic() - t0
    except (Blocked, ChildFailed) as e:
        return e, time.monotonic() - t0


def health(args, case, T, when):
    try:
        h = T.call("health", args.watchdog)
        ok = h["pattern"]
        case.add(f"T health ({when})", h["s"], "healthy" if ok else "buffer pattern changed")
        return True
    except Blocked as b:
        case.add(f"T health ({when})", None, blocked_text(args, b), f"> {args.watchdog:g} s")
    except ChildFailed as e:
        case.add(f"T health ({when})", None, f"failed: {e}")
    return False


def start_pair(args, env, logdir, tag):
    T = Child("target", args.impl, env, logdir, tag)
    I = Child("initiator", args.impl, env, logdir, tag)
    t_ready = T.reply(60.0)
    I.reply(60.0)
    return T, I, t_ready


def stop_target(T):
    T.signal(signal.SIGSTOP)
    if T.wait_state("T") != "T":
        raise ChildFailed(f"target not stopped (state {T.state()})")


def read_from_stopped(args, case, T, I, setup, label):
    """READ 1 MiB while T is stopped, then SIGCONT T (always) and follow the READ to its end.
    Returns False when the initiator is stuck for good."""
    steps = {}

    def on_step(m):
        if "s" in m:
            steps[m["step"]] = m

    try:
        m = I.call("read_once", args.watchdog, on_step, addr=setup["addr"], size=READ1, poll_s=args.read_poll)
    except Blocked as b:
        done = ", ".join(f"{k} {fmt_s(v['s'])}" for k, v in steps.items())
        case.add(label, None, blocked_text(args, b, f" (done: {done})" if done else ""), f"> {args.watchdog:g} s")
        T.signal(signal.SIGCONT)
        r, s = late_reply(I, args.watchdog)
        if isinstance(r, dict):
            case.notes.append(f"{label}: the call returned {fmt_s(s)} after SIGCONT, {r.get('state')}")
            return True
        case.notes.append(f"{label}: the call still blocked {fmt_s(s)} after SIGCONT")
        return False
    except ChildFailed as e:
        T.signal(signal.SIGCONT)
        case.add(label, None, f"failed: {e}")
        return True
    T.signal(signal.SIGCONT)
    st = m["state"]
    detail = []
    if "init_s" in m:
        detail.append(f"initialize_xfer {fmt_s(m['init_s'])}")
    if "post_s" in m:
        detail.append(f"transfer {fmt_s(m['post_s'])} -> {m['post_state']}")
    outcome = st if st != "PROC" else f"still PROC after {args.read_poll:g} s"
    if st == "DONE" and not m.get("data_ok"):
        outcome += " (data WRONG)"
    case.add(label, m["s"], outcome + (f" ({', '.join(detail)})" if detail else ""))
    if st == "PROC":
        try:
            p = I.call("poll", args.watchdog, poll_s=5.0, size=READ1)
            o = p["state"] if p["state"] != "PROC" else "still PROC after 5 s"
            if p["state"] == "DONE" and not p.get("data_ok"):
                o += " (data WRONG)"
            case.add("  the same READ after SIGCONT", p["s"], o)
        except Blocked as b:
            case.add("  the same READ after SIGCONT", None, blocked_text(args, b), f"> {args.watchdog:g} s")
            return False
        except ChildFailed as e:
            case.add("  the same READ after SIGCONT", None, f"failed: {e}")
    return True


def case1(args, env, logdir, out):
    case = Case("1 stopped target")
    out.append(case)
    T, I, _ = start_pair(args, env, logdir, "case1")
    try:
        setup = T.call("setup", 30.0)
        I.call("prepare", 30.0, size=READ1)
        stop_target(T)
        added = False
        try:
            m = I.call("add_remote", args.watchdog, md=setup["md"])
            case.add("add_remote_agent, T stopped", m["s"], "ok")
            added = True
        except Blocked as b:
            case.add("add_remote_agent, T stopped", None, blocked_text(args, b), f"> {args.watchdog:g} s")
            T.signal(signal.SIGCONT)
            r, s = late_reply(I, args.watchdog)
            if not isinstance(r, dict):
                case.notes.append(f"add_remote_agent still blocked {fmt_s(s)} after SIGCONT")
                raise ChildFailed("initiator stuck") from None
            case.notes.append(f"add_remote_agent returned {fmt_s(s)} after SIGCONT")
            case.add("READ 1 MiB, T stopped", None, "not run (T was continued to unblock add_remote_agent)")
        except ChildFailed as e:
            T.signal(signal.SIGCONT)
            case.add("add_remote_agent, T stopped", None, f"failed: {e}")
        if added and not read_from_stopped(args, case, T, I, setup, "READ 1 MiB, T stopped"):
            raise ChildFailed("initiator stuck")
        T.signal(signal.SIGCONT)
        if T.wait_state("RS", 2.0) not in ("R", "S"):
            raise ChildFailed(f"target not running after SIGCONT (state {T.state()})")
        health(args, case, T, "after SIGCONT")

        # For comparison: T running (I removes T and adds it again, then READs), then the same READ with T
        # stopped again, this time on a connection that has carried a READ already.
        if added:
            try:
                I.call("remove_remote", args.watchdog)
                m = I.call("add_remote", args.watchdog, md=setup["md"])
                case.add("add_remote_agent again, T running", m["s"], "ok")
                r = I.call("read_once", args.watchdog, addr=setup["addr"], size=READ1, poll_s=args.read_poll)
                case.add("READ 1 MiB, T running", r["s"], r["state"] + ("" if r.get("data_ok", True) else
                                                                          " (data WRONG)"))
            except (Blocked, ChildFailed) as e:
                case.notes.append(f"comparison with T running failed: {type(e).__name__}: {e}")
            else:
                stop_target(T)
                if not read_from_stopped(args, case, T, I, setup, "READ 1 MiB, T stopped after a READ"):
                    raise ChildFailed("initiator stuck")
                T.wait_state("RS", 2.0)
                health(args, case, T, "at the end")
        case.complete = True
    finally:
        add_log_notes(case, T, I)
        I.close()
        T.close()
    return case


def stop_inside_read(args, I, mv, typical_s):
    """SIGSTOP I while a READ is in flight (retrying); returns (attempt, ms after post, seq) or None."""
    for attempt in range(1, args.attempts + 1):
        time.sleep(0.02 + 0.013 * (attempt % 5))  # let the loop run a little, at varying phases
        deadline = time.monotonic() + 2.0
        sent = None
        lo, hi = 0.25 * typical_s * 1e9, 0.5 * typical_s * 1e9
        while time.monotonic() < deadline:
            if mv[W_PHASE] == 1:
                seq, t_post = mv[W_SEQ], mv[W_TPOST]
                age = time.monotonic_ns() - t_post
                if lo <= age < hi:
                    I.signal(signal.SIGSTOP)
                    sent = (seq, age)
                    break
            time.sleep(0.0001)
        if sent is None:
            continue
        if I.wait_state("T", 2.0) != "T":
            raise ChildFailed(f"initiator not stopped (state {I.state()})")
        seq, age = sent
        if mv[W_PHASE] == 1 and mv[W_SEQ] == seq:
            return attempt, age / 1e9, seq
        I.signal(signal.SIGCONT)
    return None


def case23(args, env, logdir, out, zombie):
    label = "3 zombie initiator" if zombie else "2 stopped initiator inside a READ"
    case = Case(label)
    out.append(case)
    tag = "case3" if zombie else "case2"
    shm_dir = "/dev/shm" if os.path.isdir("/dev/shm") else None
    fd, shm = tempfile.mkstemp(prefix=f"stopped_peers-{tag}-", dir=shm_dir)
    os.write(fd, b"\0" * (SHM_WORDS * 8))
    mm = mmap.mmap(fd, SHM_WORDS * 8)
    os.close(fd)
    mv = memoryview(mm).cast("q")
    T, I, _ = start_pair(args, env, logdir, tag)
    how = "16 calls" if args.dereg == "each" else "1 call with 16 descriptors"
    try:
        setup = T.call("setup", 30.0, sets=["A", "B"], per_call=args.dereg == "each")
        I.call("prepare", 60.0, size=BIG)
        I.call("add_remote", args.watchdog, md=setup["md"])
        w = I.call("setup_loop", 120.0, addr=setup["addr"], size=BIG, warm=5, shm=shm)
        typical = statistics.median(w["durs"])
        if not w["data_ok"]:
            case.notes.append("warm-up READ data WRONG")
        case.notes.append(f"64 MiB READ median {fmt_s(typical)} ({BIG / typical / 1e9:.2f} GB/s) before the loop")
        try:
            d = T.call("dereg", args.watchdog, set="A")
            case.add(f"deregister 16 x 4 KiB, {how}, I idle (baseline)", d["s"], "ok")
        except Blocked as b:
            case.add(f"deregister 16 x 4 KiB, {how}, I idle (baseline)", None, blocked_text(args, b),
                     f"> {args.watchdog:g} s")
            raise ChildFailed("baseline deregistration blocked") from None

        I.send("loop", max_s=120.0)
        first = I.recv(30.0)
        if first.get("step") != "looping":
            raise ChildFailed(f"initiator did not start its loop: {first}")
        got = stop_inside_read(args, I, mv, typical)
        if got is None:
            case.add("stop I inside a READ", None, f"not achieved in {args.attempts} attempts")
            raise ChildFailed("no stop inside a READ")
        attempt, age, seq = got
        mv[W_WATCH] = seq
        case.notes.append(f"I stopped inside READ #{seq} on attempt {attempt}, SIGSTOP sent {fmt_s(age)} after "
                          "its post")
        if zombie:
            I.signal(signal.SIGKILL)
            st = I.wait_state("Z", 5.0)
            if st != "Z":
                raise ChildFailed(f"killed initiator is not a zombie (state {st})")
            case.notes.append("I killed (SIGKILL) while stopped; not reaped (state Z)")
        step = f"deregister 16 x 4 KiB, {how}, I {'zombie' if zombie else 'stopped'}"
        dereg_blocked = False
        try:
            d = T.call("dereg", args.watchdog, set="B")
            case.add(step, d["s"], "ok")
        except Blocked as b:
            dereg_blocked = True
            case.add(step, None, blocked_text(args, b), f"> {args.watchdog:g} s")
        except ChildFailed as e:
            case.add(step, None, f"failed: {e}")
        if dereg_blocked:
            # Let the peer go (continue it, or reap the zombie) and see whether the call then returns.
            if zombie:
                I.reap(5.0)
                what = "reaping I"
            else:
                I.signal(signal.SIGCONT)
                what = "SIGCONT to I"
            r, s = late_reply(T, args.watchdog)
            case.notes.append(f"deregister_memory returned {fmt_s(s)} after {what}" if isinstance(r, dict)
                              else f"deregister_memory still blocked {fmt_s(s)} after {what}")
            if not isinstance(r, dict):
                raise ChildFailed("target stuck") from None
        health(args, case, T, ("I zombie" if zombie else "I stopped") if not dereg_blocked else
               ("I reaped" if zombie else "I continued"))

        if zombie:
            I.reap(5.0)
            case.notes.append(f"I reaped: exit status {I.p.returncode}")
        else:
            I.signal(signal.SIGCONT)
            deadline = time.monotonic() + args.watchdog
            while mv[W_NDONE] < seq and time.monotonic() < deadline and I.state() not in (None, "Z"):
                time.sleep(0.001)
            if mv[W_NDONE] >= seq:
                case.add("I's interrupted READ after SIGCONT", mv[W_WDUR] / 1e9, WSTATE.get(mv[W_WSTATE], "?"),
                         f"{fmt_s(mv[W_WDUR] / 1e9)} (stop included)")
            else:
                case.add("I's interrupted READ after SIGCONT", None, f"not ended {args.watchdog:g} s after SIGCONT")
            mv[W_STOP] = 1
            try:
                r = I.reply(args.watchdog)
                note = f"I's loop: {r['reads']} READs"
                if r.get("bad"):
                    note += f", {r['bad']}"
                elif r.get("data_ok") is False:
                    note += ", last data WRONG"
                case.notes.append(note)
            except (Blocked, ChildFailed) as e:
                case.notes.append(f"I's loop did not end: {type(e).__name__}: {e}")
        case.complete = True
    finally:
        mv[W_STOP] = 1
        add_log_notes(case, T, I)
        I.close()
        T.close()
        mv.release()
        mm.close()
        try:
            os.unlink(shm)
        except OSError:
            pass
    return case


def add_log_notes(case, T, I):
    for c in (T, I):
        t = log_tail(c.log_path, 2, pattern=("gixl:", "warn", "error", "fail", "timeout", "timed out"))
        if t:
            case.notes.append(f"{c.role} stderr: {t}")


def gixl_env(env):
    """How python/tests/_impl.py picks gixl: the checkout's python/ unless GIXL_TEST_INSTALLED=1; here
    the installed package is also used when the checkout has no built native module."""
    if env.get("GIXL_TEST_INSTALLED") == "1":
        return "installed (GIXL_TEST_INSTALLED=1)"
    if glob.glob(os.path.join(REPO, "python", "gixl", "_gixl*.so")):
        return "checkout python/"
    env["GIXL_TEST_INSTALLED"] = "1"
    return "installed (no native module built in python/gixl)"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--impl", required=True, choices=["gixl", "nixl_cu12", "nixl_cu13"])
    ap.add_argument("--role", choices=["target", "initiator"], help=argparse.SUPPRESS)
    ap.add_argument("--child-life", type=float, default=600.0, help=argparse.SUPPRESS)
    ap.add_argument("--cases", default="1,2,3")
    ap.add_argument("--dereg", choices=["one", "each"], default="one")
    ap.add_argument("--watchdog", type=float, default=15.0)
    ap.add_argument("--read-poll", type=float, default=10.0)
    ap.add_argument("--attempts", type=int, default=20)
    ap.add_argument("--keep-logs", metavar="DIR")
    args = ap.parse_args()
    if args.role:
        return child_main(args)

    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    source = ""
    if args.impl == "gixl":
        env.setdefault("GIXL_TEST_BINDINGS", "native")
        source = gixl_env(env)
    env["GIXL_TEST_IMPL"] = args.impl

    logdir = args.keep_logs or tempfile.mkdtemp(prefix="stopped_peers-")
    os.makedirs(logdir, exist_ok=True)

    def on_signal(signum, frame):
        kill_all()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    cases = []
    failed = []
    try:
        # Which module the children load, from a throwaway child.
        probe = Child("target", args.impl, env, logdir, "probe")
        try:
            r = probe.reply(60.0)
            print(f"stopped_peers: impl {args.impl}, module {r['api']}{' (' + source + ')' if source else ''}; "
                  f"UCX backend, DRAM; {os.cpu_count()} CPUs; watchdog {args.watchdog:g} s", flush=True)
        except (ChildFailed, Blocked) as e:
            print(f"stopped_peers: cannot load {args.impl}: {e} ({log_tail(probe.log_path, 4)})", flush=True)
            return 1
        finally:
            probe.close()
        wanted = [c.strip() for c in args.cases.split(",") if c.strip()]
        for c in wanted:
            try:
                if c == "1":
                    case1(args, env, logdir, cases)
                elif c in ("2", "3"):
                    case23(args, env, logdir, cases, zombie=c == "3")
                else:
                    print(f"unknown case {c!r}", flush=True)
                    continue
            except Exception as e:
                if cases and not cases[-1].complete:
                    cases[-1].notes.append(f"case aborted: {type(e).__name__}: {e}")
                failed.append(c)
            finally:
                kill_all()
            if cases:
                print(cases[-1].line(), flush=True)
    finally:
        kill_all()
        if not args.keep_logs:
            shutil.rmtree(logdir, ignore_errors=True)

    # The compact table.
    print()
    print("| case | step | time | outcome |")
    print("|---|---|---|---|")
    for c in cases:
        for i, (step, t, o) in enumerate(c.rows):
            print(f"| {c.label if i == 0 else ''} | {step} | {t} | {o} |")
        if not c.rows:
            print(f"| {c.label} | (nothing measured) | - | - |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
