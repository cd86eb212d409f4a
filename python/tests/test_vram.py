"""VRAM through nixl._api on a machine without a GPU.

What can be checked here: torch CUDA tensors (a duck-typed stand-in installed as ``torch`` in
sys.modules, which is all either implementation consults) become VRAM descriptors with the tensor's
device id; registering them fails with a NIXL exception, never a crash; ``import nixl._api`` does not
import torch. VRAM transfers themselves run in Rust over the fake device layer (tests/vram.rs) and on a
GPU with scripts/gpu-check.sh.
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
