"""register_memory / deregister_memory."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import addr


@pytest.fixture
def agent(make_agent):
    return make_agent("reg")


@pytest.fixture
def buf():
    return np.zeros(64 * 1024, dtype=np.uint8)


def test_register_tuples_returns_reg_dlist(agent, bind, buf):
    reg = agent.register_memory([(addr(buf), 4096, 0, ""), (addr(buf, 8192), 4096, 0, "m")], "DRAM")
    assert isinstance(reg, bind.nixlRegDList)
    assert reg  # truthy (SGLang checks `if not descs`)
    assert reg.descCount() == 2
    assert reg[1] == (addr(buf, 8192), 4096, 0, b"m")
    agent.deregister_memory(reg)


def test_register_array_and_reg_dlist(agent, bind, buf):
    reg = agent.register_memory(np.array([[addr(buf), 1024, 0]], dtype=np.uint64), "DRAM")
    assert reg[0] == (addr(buf), 1024, 0, b"")
    pre = bind.nixlRegDList(bind.DRAM_SEG, [(addr(buf, 2048), 1024, 0, "")])
    assert agent.register_memory(pre) is pre
    agent.deregister_memory(reg)
    agent.deregister_memory(pre)


def test_register_with_backend_names(agent, buf):
    reg = agent.register_memory([(addr(buf), 4096, 0, "")], "DRAM", backends=["UCX"])
    agent.deregister_memory(reg, backends=["UCX"])


def test_register_cpu_alias(agent, bind, buf):
    reg = agent.register_memory([(addr(buf), 4096, 0, "")], "cpu")
    assert reg.getType() == bind.DRAM_SEG
    agent.deregister_memory(reg)


def test_register_unusable_input_raises_typeerror(agent, buf):
    with pytest.raises(TypeError):
        agent.register_memory([(addr(buf), 10, 0)], "DRAM")  # 3-tuples: get_reg_descs gives None


def test_register_type_without_backend(agent, bind, buf):
    with pytest.raises(bind.nixlNotFoundError):
        agent.register_memory([(3, 10, 0, "")], "FILE")


def test_register_empty_list_fails(agent, bind):
    with pytest.raises(bind.nixlBackendError):
        agent.register_memory(bind.nixlRegDList(bind.DRAM_SEG))


def test_deregister_must_match_exactly(agent, bind, buf):
    reg = agent.register_memory([(addr(buf), 4096, 0, "")], "DRAM")
    with pytest.raises(bind.nixlNotFoundError):
        agent.deregister_memory(agent.get_reg_descs([(addr(buf), 100, 0, "")], "DRAM"))
    agent.deregister_memory(reg)
    with pytest.raises(bind.nixlNotFoundError) as info:
        agent.deregister_memory(reg)
    assert str(info.value) == "NIXL_ERR_NOT_FOUND"


def test_deregister_unknown_type(agent, bind, buf):
    with pytest.raises(bind.nixlNotFoundError):
        agent.deregister_memory(agent.get_reg_descs([(addr(buf), 4096, 0, "")], "DRAM"))


def test_duplicate_registration_is_allowed(agent, buf):
    r1 = agent.register_memory([(addr(buf), 4096, 0, "")], "DRAM")
    r2 = agent.register_memory([(addr(buf), 4096, 0, "")], "DRAM")
    agent.deregister_memory(r1)
    agent.deregister_memory(r2)


def test_overlapping_registrations(agent, buf):
    r1 = agent.register_memory([(addr(buf), 8192, 0, "")], "DRAM")
    r2 = agent.register_memory([(addr(buf, 4096), 8192, 0, "")], "DRAM")
    agent.deregister_memory(r2)
    agent.deregister_memory(r1)
