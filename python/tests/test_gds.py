"""The GDS and GDS_MT backends through nixl._api, as the disk tiers of SGLang (HiCache's NIXL storage backend) and
LMCache (its NIXL storage backend) call them: GPU memory <-> files.

NIXL 1.5.1 lists both plugins, but they load only where cuFile and the CUDA runtime are installed; on this
machine its ``get_plugin_params("GDS")`` fails NOT_FOUND. So only the listing is compared with NIXL; the rest
runs on gixl, in a child process started with ``GIXL_FAKE_DEVICE=1`` (device memory emulated in host memory),
where the backends stage VRAM <-> FILE through page-locked buffers as they do on a GPU without cuFile; one test
adds a fake libcufile (tests/fake_cufile.c), over which they take the direct path through cuFile.
The Rust tests (tests/gds.rs) cover ext4, O_DIRECT alignment, a full disk and the lifetime races in depth.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest


def test_gds_plugins_are_listed(make_agent):
    agent = make_agent("gds-list", backends=[])
    plugins = agent.get_plugin_list()
    assert "GDS" in plugins and "GDS_MT" in plugins, plugins


@pytest.mark.gixl_only
def test_gds_plugins_declare_nixls_memory_types_and_no_defaults(make_agent):
    agent = make_agent("gds-params", backends=[])
    for name in ("GDS", "GDS_MT"):
        assert set(agent.get_plugin_mem_types(name)) == {"DRAM_SEG", "VRAM_SEG", "FILE_SEG"}
        assert agent.get_plugin_params(name) == {}
    agent.create_backend("GDS_MT", {"thread_count": "2"})
    assert agent.get_backend_params("GDS_MT") == {"thread_count": "2"}


# The child's common part: fake VRAM filled with a pattern, and a check of it, through ctypes (fake device memory
# is host memory of the child).
PRELUDE = """
import ctypes, json, os, sys, uuid
from gixl import _gixl
from nixl._api import nixl_agent, nixl_agent_config

def vram(dev, size, seed):
    p = _gixl._fake_device_alloc(dev, size)
    ctypes.memmove(p, (bytes(range(seed, 251)) + bytes(range(seed))) * (size // 251 + 1), size)
    return p

def read(p, n):
    return ctypes.string_at(p, n)

def wait(agent, h):
    state = agent.transfer(h)
    while state == "PROC":
        state = agent.check_xfer_state(h)
    return state
"""

# SGLang HiCache's NIXL storage: its own agent, the first of its preferred file plugins that is listed, one file
# per page key registered in NIXL 1.5.1's path mode ("rw,create:<path>" in metaInfo, a unique devId per file; the
# backend opens the file), a batch of pages WRITTEN from the KV pool in one request to the agent itself, then READ
# back into another buffer; query_memory tells which keys exist.
HICACHE = """
agent = nixl_agent(str(uuid.uuid4()), nixl_agent_config(backends=[]))
plugins = agent.get_plugin_list()
backend = next(b for b in ("3FS", "GDS_MT", "GDS", "POSIX") if b in plugins)
agent.create_backend(backend)
page, n, dev = 64 * 1024, 32, 0
pool = vram(dev, page * n, 7)
back = vram(dev, page * n, 0)
kv = agent.register_memory([(pool, page * n, dev, ""), (back, page * n, dev, "")], "VRAM")
d = sys.argv[1]
paths = [os.path.join(d, f"key-{i}.bin") for i in range(n)]
fds = [1000 + i for i in range(n)]  # devIds, not descriptors: path mode
files = agent.register_memory([(0, page, fd, "rw,create:" + p) for fd, p in zip(fds, paths)], "FILE")
src = agent.get_xfer_descs([(pool + i * page, page, dev) for i in range(n)], "VRAM")
dst = agent.get_xfer_descs([(0, page, fd) for fd in fds], "FILE")
h = agent.initialize_xfer("WRITE", src, dst, agent.name)
out = {"backend": backend, "write": wait(agent, h)}
agent.release_xfer_handle(h)
# Pages back in reverse order.
into = agent.get_xfer_descs([(back + i * page, page, dev) for i in range(n)], "VRAM")
fr = agent.get_xfer_descs([(0, page, fd) for fd in reversed(fds)], "FILE")
h = agent.initialize_xfer("READ", into, fr, agent.name)
out["read"] = wait(agent, h)
agent.release_xfer_handle(h)
out["exact"] = all(read(back + i * page, page) == read(pool + (n - 1 - i) * page, page) for i in range(n))
q = agent.query_memory([(0, 0, 0, paths[0]), (0, 0, 0, os.path.join(d, "missing.bin"))], backend, "FILE")
out["query"] = [None if r is None else int(r["size"]) for r in q]
agent.deregister_memory(files)
agent.deregister_memory(kv)
print(json.dumps(out))
"""

# LMCache's NIXL storage backend: backend GDS_MT with thread_count, one registered VRAM buffer of pages, a pool
# of O_DIRECT files (use_direct_io), the memory list prepped against "" and the file list against the agent's own
# name, page-indexed make_prepped_xfer, and nixlBind.nixlBackendError caught on failure (a closed file).
LMCACHE = """
from nixl._api import nixlBind
agent_name = "lmcache-" + uuid.uuid4().hex[:8]
agent = nixl_agent(agent_name, nixl_agent_config(backends=[]))
agent.create_backend("GDS_MT", {"thread_count": "4"})
page, n, dev = 256 * 1024, 64, 1
buf = vram(dev, page * n, 3)
reg = agent.register_memory([(buf, page * n, dev, "")], mem_type="VRAM")
mem = agent.prep_xfer_dlist("", [(buf + i * page, page, dev) for i in range(n)], mem_type="VRAM")
d = sys.argv[1]
flags = os.O_CREAT | os.O_RDWR | os.O_DIRECT
fds = [os.open(os.path.join(d, f"pool-{i}.bin"), flags, 0o644) for i in range(4)]
freg = agent.register_memory([(0, 0, fd, "") for fd in fds], mem_type="FILE")
# 16 pages per file, page i at file i % 4, slot i // 4.
slots = agent.prep_xfer_dlist(agent_name, [((i // 4) * page, page, fds[i % 4]) for i in range(n)], mem_type="FILE")
idx = list(range(n))
h = agent.make_prepped_xfer("WRITE", mem, idx, slots, idx)
out = {"write": wait(agent, h)}
agent.release_xfer_handle(h)
want = read(buf, page * n)
ctypes.memset(buf, 0, page * n)
h = agent.make_prepped_xfer("READ", mem, idx[::-1], slots, idx[::-1])
out["read"] = wait(agent, h)
agent.release_xfer_handle(h)
out["exact"] = read(buf, page * n) == want
# A closed file: the post fails with nixlBackendError and the buffer is untouched.
os.close(fds[0])
ctypes.memset(buf, 0x5A, page * n)
h = agent.make_prepped_xfer("READ", mem, [0], slots, [0])
try:
    out["closed"] = wait(agent, h)
except nixlBind.nixlBackendError:
    out["closed"] = "nixlBackendError"
out["untouched"] = read(buf, page * n) == b"\\x5a" * (page * n)
agent.release_xfer_handle(h)
print(json.dumps(out))
"""


def child(code: str, tmp_path, **extra_env: str) -> dict:
    env = dict(os.environ, GIXL_FAKE_DEVICE="1", **extra_env)
    script = textwrap.dedent(PRELUDE) + textwrap.dedent(code)
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.gixl_native
def test_sglang_hicache_shape_over_the_fake_device(tmp_path):
    out = child(HICACHE, tmp_path)
    assert out["backend"] == "GDS_MT"
    assert out["write"] == "DONE" and out["read"] == "DONE", out
    assert out["exact"], "pages read back differ from the pages written"
    assert out["query"] == [64 * 1024, None]


@pytest.mark.gixl_native
def test_lmcache_storage_shape_over_the_fake_device(tmp_path):
    # tmpfs takes O_DIRECT since Linux 6.6; pytest's tmp_path may be on tmpfs or disk, both fine.
    out = child(LMCACHE, tmp_path)
    assert out["write"] == "DONE" and out["read"] == "DONE", out
    assert out["exact"], "pages read back differ from the pages written"
    assert out["closed"] == "nixlBackendError", out
    assert out["untouched"], "a request on a closed file moved data"


# After LMCACHE: the fake libcufile's counters (tests/fake_cufile.c), read through ctypes from the library gixl
# opened (the same path gives the same library).
CUFILE_COUNTS = """
lib = ctypes.CDLL(os.environ["GIXL_CUFILE_LIB"])
c = (ctypes.c_uint64 * 12)()
lib.gixl_fake_cufile_counts(c, 12)
out["cufile"] = {"open": c[0], "reads": c[6], "writes": c[7], "rbytes": c[8], "wbytes": c[9], "bad": c[11]}
print(json.dumps(out))
"""


@pytest.mark.gixl_native
def test_lmcache_storage_shape_through_cufile_over_a_fake_libcufile(tmp_path):
    """The direct path: with a cuFile that passes gixl's self-test (the fake library of tests/gds_cufile.rs), every
    byte of LMCache's round trip goes through cuFileWrite/cuFileRead, and the closed file is still refused."""
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler to build the fake libcufile")
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    lib = str(tmp_path / "libfake-cufile.so")
    subprocess.run(
        [cc, "-shared", "-fPIC", "-O2", "-o", lib, os.path.join(root, "tests", "fake_cufile.c"), "-lpthread"],
        check=True,
    )
    out = child(LMCACHE + CUFILE_COUNTS, tmp_path, GIXL_CUFILE_LIB=lib)
    assert out["write"] == "DONE" and out["read"] == "DONE", out
    assert out["exact"], "pages read back differ from the pages written"
    assert out["closed"] == "nixlBackendError", out
    assert out["untouched"], "a request on a closed file moved data"
    c = out["cufile"]
    self_test = 1 << 20
    data = 256 * 1024 * 64
    assert c["open"] == 1 and c["bad"] == 0, c
    assert c["wbytes"] == self_test + data and c["rbytes"] == self_test + data, f"not all through cuFile: {c}"
