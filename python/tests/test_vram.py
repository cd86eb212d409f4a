"""VRAM through nixl._api on a machine without a GPU.

What can be checked here: torch CUDA tensors (a duck-typed stand-in installed as ``torch`` in
sys.modules, which is all either implementation consults) become VRAM descriptors with the tensor's
device id; registering them fails with a NIXL exception, never a crash; ``import nixl._api`` does not
import torch; and (gixl) VRAM transfers between two Python processes through ``nixl._api`` over the fake
device layer (``GIXL_FAKE_DEVICE=1``: device memory emulated in shared host memory, handles taken across
processes as for CUDA IPC). The Rust tests (tests/vram.rs, tests/vram_tcp.rs) cover the routes in depth;
on a GPU, scripts/gpu-check.sh.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from helpers import addr


@pytest.fixture
def agent(make_agent):
    return make_agent("vram")


def test_cuda_tensor_list_is_vram_with_its_device(agent, bind, fake_torch):
    arrs = [np.zeros(1024, dtype=np.float16) for _ in range(3)]
    ts = [fake_torch.Tensor(a, device=2) for a in arrs]
    rl = agent.get_reg_descs(ts)
    assert rl.getType() == bind.VRAM_SEG
    assert [rl[i] for i in range(3)] == [(addr(a), 2048, 2, b"") for a in arrs]
    xl = agent.get_xfer_descs(ts[1])
    assert xl.getType() == bind.VRAM_SEG and xl[0] == (addr(arrs[1]), 2048, 2)


@pytest.mark.parametrize("alias", ["VRAM", "cuda"])
def test_vram_registration_without_gpu_raises(agent, bind, alias):
    buf = np.zeros(4096, dtype=np.uint8)
    with pytest.raises((bind.nixlBackendError, bind.nixlNotSupportedError)):
        agent.register_memory([(addr(buf), 4096, 0, "")], alias)
    # Nothing was registered: DRAM still works and a VRAM prep finds nothing.
    reg = agent.register_memory([(addr(buf), 4096, 0, "")], "DRAM")
    agent.deregister_memory(reg)


def test_cuda_tensor_registration_without_gpu_raises(agent, bind, fake_torch):
    t = fake_torch.Tensor(np.zeros(256, dtype=np.float32), device=0)
    with pytest.raises((bind.nixlBackendError, bind.nixlNotSupportedError)):
        agent.register_memory([t])


@pytest.mark.gixl_only
def test_vram_refusal_says_why(agent, bind):
    buf = np.zeros(4096, dtype=np.uint8)
    with pytest.raises(bind.nixlNotSupportedError) as e:
        agent.register_memory([(addr(buf), 4096, 0, "")], "VRAM")
    # The explanation travels as an exception note (Python 3.11+), the message is NIXL's status name.
    msg = " ".join(getattr(e.value, "__notes__", [])) or "VRAM (no notes before Python 3.11)"
    assert "VRAM" in msg and ("cuda" in msg.lower() or "device" in msg), msg


def test_import_does_not_import_torch(impl):
    pkg = "nixl" if impl == "gixl" else impl
    code = f"import sys, {pkg}._api; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


FAKE = {"GIXL_FAKE_DEVICE": "1"}


@pytest.mark.gixl_native
@pytest.mark.two_process
def test_vram_between_processes_over_the_fake_device(peers):
    """Decode and prefill each hold emulated VRAM (devices 0 and 1). Through nixl._api the decode READs
    the prefill's VRAM in 64 blocks of 64 KiB, block order reversed, then WRITEs it back whole ("cuda"
    alias); byte for byte. Once the prefill is killed, the same request fails with REMOTE_DISCONNECT."""
    size, bs = 4 << 20, 64 << 10
    n = size // bs
    P, D = peers("prefill", env=FAKE), peers("decode", env=FAKE)
    p = P.init(name="vram-py-p", size=size, fill="0", mem="VRAM", fake_vram_device=1)
    d = D.init(name="vram-py-d", size=size, fill="0", mem="VRAM", fake_vram_device=0)
    assert D.add_remote(md=p["md"]) == b"vram-py-p"
    for i in range(n):
        P.fill_buf(value=i + 1, off=i * bs, length=bs)
    local = [(d["addr"] + i * bs, bs, 0) for i in range(n)]
    remote = [(p["addr"] + (n - 1 - i) * bs, bs, 1) for i in range(n)]
    r = D.make_new(op="READ", name="vram-py-p", local=local, remote=remote, mem="VRAM")
    assert isinstance(r, int), r
    assert D.post_outcome(xid=r) == "DONE"
    want = b"".join(bytes([n - i]) * bs for i in range(n))
    assert D.read_buf() == want, "the READ brought wrong bytes"

    D.fill_buf(value=0xA5)
    w = D.make_new(op="WRITE", name="vram-py-p", local=[(d["addr"], size, 0)], remote=[(p["addr"], size, 1)], mem="cuda")
    assert isinstance(w, int), w
    assert D.post_outcome(xid=w) == "DONE"
    assert P.count_not(value=0xA5) == 0, "the WRITE did not land whole"

    P.kill()
    assert D.post_outcome(xid=r) == "nixlRemoteDisconnectError"


@pytest.mark.gixl_native
def test_fake_device_alloc_is_refused_without_the_fake_layer(bind):
    """The test hook is inert in a normal process: no fake device, NOT_SUPPORTED."""
    from gixl import _gixl

    with pytest.raises(bind.nixlNotSupportedError):
        _gixl._fake_device_alloc(0, 4096)
