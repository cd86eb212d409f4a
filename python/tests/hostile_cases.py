"""Hostile-input cases for nixl._api (shared by test_hostile.py and its ``python hostile_cases.py`` probe).

Each case is a function ``case(api, bind) -> str`` returning a compact outcome: the result or the exception
class name of every hostile call it makes, joined by " · ". Cases build their own agents (two in one process,
UCX loopback), so a case can run alone in a child process: ``python hostile_cases.py CASE`` prints the outcome
(with the address space limited, so a "huge count" that tries to allocate fails instead of swapping). Run with
no argument it runs every case against gixl and NIXL 1.5.1 in children and prints a Markdown table.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import uuid

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

LEN = 64 * 1024


def _name(p):
    return f"{p}-{uuid.uuid4().hex[:8]}"


def _try(fn, *a, **kw):
    try:
        r = fn(*a, **kw)
    except Exception as exc:  # the class name is the outcome
        return type(exc).__name__
    if isinstance(r, str):
        return r
    return "ok"


class Env:
    """Two agents with a registered buffer each; b is loaded into a."""

    def __init__(self, api):
        self.api = api
        self.a = api.nixl_agent(_name("hostile-a"))
        self.b = api.nixl_agent(_name("hostile-b"))
        self.abuf = np.zeros(LEN, dtype=np.uint8)
        self.bbuf = np.full(LEN, 5, dtype=np.uint8)
        self.areg = self.a.register_memory([(self.abuf.ctypes.data, LEN, 0, "")], "DRAM")
        self.breg = self.b.register_memory([(self.bbuf.ctypes.data, LEN, 0, "")], "DRAM")
        self.bname = self.a.add_remote_agent(self.b.get_agent_metadata())
        self.aaddr = self.abuf.ctypes.data
        self.baddr = self.bbuf.ctypes.data

    def prep_pair(self, n=4):
        blk = LEN // n
        loc = self.a.prep_xfer_dlist("", [(self.aaddr + i * blk, blk, 0) for i in range(n)], "DRAM")
        rem = self.a.prep_xfer_dlist(self.bname, [(self.baddr + i * blk, blk, 0) for i in range(n)], "DRAM")
        return loc, rem

    def xfer(self, local_rows, remote_rows, op="READ"):
        l = self.a.get_xfer_descs(local_rows, "DRAM")
        r = self.a.get_xfer_descs(remote_rows, "DRAM")
        h = self.a.initialize_xfer(op, l, r, self.bname)
        s = self.a.transfer(h)
        while s == "PROC":
            s = self.a.check_xfer_state(h)
        return s


def _join(*parts):
    return " · ".join(parts)


# -- descriptors -------------------------------------------------------------------------------------------


def zero_length(api, bind):
    e = Env(api)
    return _join(
        "reg:" + _try(e.a.register_memory, [(e.aaddr, 0, 0, "")], "DRAM"),
        "prep_local:" + _try(e.a.prep_xfer_dlist, "", [(e.aaddr, 0, 0)], "DRAM"),
        "prep_remote:" + _try(e.a.prep_xfer_dlist, e.bname, [(e.baddr, 0, 0)], "DRAM"),
        "xfer:" + _try(e.xfer, [(e.aaddr, 0, 0)], [(e.baddr, 0, 0)]),
    )


def overflow_addr_len(api, bind):
    e = Env(api)
    top = 2**64 - 4096
    return _join(
        "descs:" + _try(e.a.get_xfer_descs, [(top, 8192, 0)], "DRAM"),
        "prep_local:" + _try(e.a.prep_xfer_dlist, "", [(top, 8192, 0)], "DRAM"),
        "prep_remote:" + _try(e.a.prep_xfer_dlist, e.bname, [(top, 8192, 0)], "DRAM"),
        # inside the registration by address, wrapping around by length
        "prep_wrap:" + _try(e.a.prep_xfer_dlist, e.bname, [(e.baddr, 2**64 - 1, 0)], "DRAM"),
        "xfer_wrap:" + _try(e.xfer, [(e.aaddr, 16, 0)], [(e.baddr + 16, 2**64 - 16, 0)]),
        "dst_intact:" + ("yes" if (e.bbuf == 5).all() else "NO"),
    )


def null_addresses(api, bind):
    e = Env(api)
    return _join(
        "prep_local:" + _try(e.a.prep_xfer_dlist, "", [(0, 4096, 0)], "DRAM"),
        "prep_remote:" + _try(e.a.prep_xfer_dlist, e.bname, [(0, 4096, 0)], "DRAM"),
        "xfer:" + _try(e.xfer, [(0, 4096, 0)], [(e.baddr, 4096, 0)]),
    )


def null_registration(api, bind):
    e = Env(api)
    return "reg_null:" + _try(e.a.register_memory, [(0, 4096, 0, "")], "DRAM")


def unregistered_ranges(api, bind):
    e = Env(api)
    return _join(
        "past_end:" + _try(e.a.prep_xfer_dlist, e.bname, [(e.baddr + LEN - 8, 16, 0)], "DRAM"),
        "wrong_dev:" + _try(e.a.prep_xfer_dlist, e.bname, [(e.baddr, 16, 3)], "DRAM"),
        "xfer_past_end:" + _try(e.xfer, [(e.aaddr, 16, 0)], [(e.baddr + LEN - 8, 16, 0)]),
    )


def huge_counts(api, bind):
    e = Env(api)
    # Nx5 strided rows whose expanded block count is absurd
    rows = np.array([[e.baddr, 64, 0, 64, 2**40]], dtype=np.uint64)
    rows2 = np.array([[e.baddr, 64, 0, 2**63, 4]], dtype=np.uint64)
    return _join(
        "strided_count:" + _try(e.a.prep_xfer_dlist, e.bname, rows, "DRAM"),
        "strided_stride:" + _try(e.a.prep_xfer_dlist, e.bname, rows2, "DRAM"),
    )


def many_descs(api, bind):
    """A legitimately large list: 200k descriptors inside the registration."""
    e = Env(api)
    n = 200_000
    rows = np.zeros((n, 3), dtype=np.uint64)
    rows[:, 0] = e.baddr + (np.arange(n, dtype=np.uint64) % (LEN // 8)) * 8
    rows[:, 1] = 8
    return "prep_200k:" + _try(e.a.prep_xfer_dlist, e.bname, rows, "DRAM")


def bad_indices(api, bind):
    e = Env(api)
    loc, rem = e.prep_pair(4)
    mk = e.a.make_prepped_xfer
    return _join(
        "neg:" + _try(mk, "READ", loc, [-1], rem, [0]),
        "past:" + _try(mk, "READ", loc, [0], rem, [4]),
        "huge:" + _try(mk, "READ", loc, np.array([2**40], dtype=np.int64), rem, np.array([0], dtype=np.int64)),
        "len_mismatch:" + _try(mk, "READ", loc, [0, 1], rem, [0]),
        "empty:" + _try(mk, "READ", loc, [], rem, []),
        "float:" + _try(mk, "READ", loc, np.array([0.5]), rem, np.array([0.5])),
        "bad_op:" + _try(mk, "SWAP", loc, [0], rem, [0]),
        "dst_intact:" + ("yes" if (e.bbuf == 5).all() and (e.abuf == 0).all() else "NO"),
    )


def unknown_mem_type(api, bind):
    e = Env(api)
    return _join(
        "descs:" + _try(e.a.get_xfer_descs, [(e.aaddr, 16, 0)], "HBM9"),
        "reg:" + _try(e.a.register_memory, [(e.aaddr, 16, 0, "")], "HBM9"),
        "prep:" + _try(e.a.prep_xfer_dlist, "", [(e.aaddr, 16, 0)], "HBM9"),
        "file_on_ucx:" + _try(e.a.prep_xfer_dlist, e.bname, [(0, 16, 3)], "FILE"),
    )


def unknown_agent(api, bind):
    e = Env(api)
    return _join(
        "prep:" + _try(e.a.prep_xfer_dlist, "nobody", [(e.baddr, 16, 0)], "DRAM"),
        "init_xfer:" + _try(
            e.a.initialize_xfer, "READ", e.a.get_xfer_descs([(e.aaddr, 16, 0)], "DRAM"),
            e.a.get_xfer_descs([(e.baddr, 16, 0)], "DRAM"), "nobody"),
        "notif:" + _try(e.a.send_notif, "nobody", b"x"),
        "check_md:" + _try(e.a.check_remote_metadata, "nobody"),
        "remove:" + _try(e.a.remove_remote_agent, "nobody"),
    )


def foreign_dlist(api, bind):
    """Agent a's prepped dlists given to agent b's make_prepped_xfer."""
    e = Env(api)
    loc, rem = e.prep_pair(2)
    return "make_with_a_dlists_on_b:" + _try(e.b.make_prepped_xfer, "READ", loc, [0], rem, [0])


def foreign_xfer(api, bind):
    """Agent a's xfer handle given to agent b's transfer/check/release."""
    e = Env(api)
    loc, rem = e.prep_pair(2)
    h = e.a.make_prepped_xfer("READ", loc, [0], rem, [0])
    return _join(
        "transfer:" + _try(e.b.transfer, h),
        "check:" + _try(e.b.check_xfer_state, h),
        "release:" + _try(e.b.release_xfer_handle, h),
        "own_still_works:" + _try(lambda: (e.a.transfer(h), e.a.check_xfer_state(h))[1]),
    )


def released_handles(api, bind):
    e = Env(api)
    loc, rem = e.prep_pair(2)
    h = e.a.make_prepped_xfer("READ", loc, [0], rem, [0])
    e.a.release_xfer_handle(h)
    e.a.release_dlist_handle(rem)
    return _join(
        "transfer_released:" + _try(e.a.transfer, h),
        "check_released:" + _try(e.a.check_xfer_state, h),
        "make_released_dlist:" + _try(e.a.make_prepped_xfer, "READ", loc, [0], rem, [0]),
    )


# -- metadata garbage -----------------------------------------------------------------------------------------


def _md_load(api, blobs):
    a = api.nixl_agent(_name("md-victim"))
    counts = {}
    for blob in blobs:
        try:
            name = a.add_remote_agent(blob)
            a.remove_remote_agent(name)  # a flip that still decodes (e.g. in the name): load it, then forget it
            r = "ok"
        except Exception as exc:
            r = type(exc).__name__
        counts[r] = counts.get(r, 0) + 1
    return " ".join(f"{k}={v}" for k, v in sorted(counts.items()))


def _good_md(api):
    b = api.nixl_agent(_name("md-src"))
    buf = np.zeros(4096, dtype=np.uint8)
    b.register_memory([(buf.ctypes.data, 4096, 0, "")], "DRAM")
    return b.get_agent_metadata(), (b, buf)


def md_truncated(api, bind):
    md, keep = _good_md(api)
    return _md_load(api, [md[:n] for n in range(0, len(md))])


def md_bitflips(api, bind):
    md, keep = _good_md(api)
    rng = random.Random(1234)
    blobs = []
    for i in range(400):
        b = bytearray(md)
        for _ in range(1 + i % 3):
            pos = rng.randrange(len(b))
            b[pos] ^= 1 << rng.randrange(8)
        blobs.append(bytes(b))
    return _md_load(api, blobs)


def md_random(api, bind):
    rng = random.Random(99)
    return _md_load(api, [b""] + [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300))) for _ in range(300)])


CASES = {f.__name__: f for f in [
    zero_length, overflow_addr_len, null_addresses, null_registration, unregistered_ranges, huge_counts,
    many_descs, bad_indices, unknown_mem_type, unknown_agent, foreign_dlist, foreign_xfer, released_handles,
    md_truncated, md_bitflips, md_random,
]}


# -- child-process runner ---------------------------------------------------------------------------------------

AS_LIMIT = 8 * 1024**3  # address-space cap for a case's child (a huge count must fail, not swap)


def run_in_child(case, impl, python=None, timeout=120, bindings="native"):
    """Run one case in a child; its outcome, or "crash (signal N)" / "hang (timeout)" / "exit N"."""
    import _impl

    env = _impl.child_env(impl, bindings)
    try:
        p = subprocess.run([python or sys.executable, os.path.abspath(__file__), case], env=env,
                           capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "hang (timeout)", ""
    out = p.stdout.decode(errors="replace").strip().splitlines()
    if p.returncode < 0:
        return f"crash (signal {-p.returncode})", p.stderr.decode(errors="replace")[-2000:]
    if p.returncode != 0 or not out:
        return f"exit {p.returncode}", p.stderr.decode(errors="replace")[-2000:]
    return out[-1], ""


def _child(case):
    import resource

    import _impl

    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))
    m = _impl.load(os.environ["GIXL_TEST_IMPL"], os.environ.get("GIXL_TEST_BINDINGS", "native"))
    out = CASES[case](m.api, m.bind)
    sys.stdout.write(out + "\n")
    sys.stdout.flush()
    os._exit(0)


def main():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    pys = {"gixl": os.path.join(root, ".venv/gixl/bin/python"), "nixl_cu12": os.path.join(root, ".venv/nixl/bin/python")}
    os.environ["GIXL_TEST_INSTALLED"] = "1"
    print("| case | gixl | nixl_cu12 |\n|---|---|---|")
    for case in CASES:
        cols = [run_in_child(case, impl, py)[0] for impl, py in pys.items()]
        print(f"| {case} | " + " | ".join(c.replace("|", "/") for c in cols) + " |", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        _child(sys.argv[1])
    else:
        main()
