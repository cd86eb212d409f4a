"""nixl_agent_config / nixl_agent construction, plugins and backends."""

from __future__ import annotations

import time

import pytest

import conftest


def test_config_defaults(api):
    c = api.nixl_agent_config()
    assert c.backends == ["UCX"]
    assert c.enable_pthread is True
    assert c.enable_listen is False
    assert c.port == 8888
    assert c.capture_telemetry is False
    assert c.num_threads == 0
    assert c.sync_mode is None


def test_config_positional(api):
    c = api.nixl_agent_config(False, True, 5555, True, 4, ["UCX", "POSIX"])
    assert (c.enable_pthread, c.enable_listen, c.port) == (False, True, 5555)
    assert (c.capture_telemetry, c.num_threads, c.backends) == (True, 4, ["UCX", "POSIX"])


@pytest.mark.parametrize("bad, tname", [(1, "int"), ("STRICT", "str"), (object(), "object")])
def test_config_bad_sync_mode(api, bad, tname):
    with pytest.raises(TypeError) as info:
        api.nixl_agent_config(sync_mode=bad)
    assert str(info.value) == f"sync_mode must be a nixl_thread_sync_t (got {tname!r})"


def test_config_bindings_enum_is_not_a_sync_mode(api, bind):
    with pytest.raises(TypeError, match="nixl_thread_sync_t"):
        api.nixl_agent_config(sync_mode=bind.NIXL_THREAD_SYNC_STRICT)


class _Captured(Exception):
    pass


@pytest.fixture
def capture_agent_ctor(monkeypatch, bind):
    """Replace _bindings.nixlAgent; the replacement records its arguments and aborts."""
    seen = {}

    class FakeAgent:
        def __init__(self, name, cfg):
            seen["name"] = name
            seen["cfg"] = cfg
            raise _Captured()

    monkeypatch.setattr(bind, "nixlAgent", FakeAgent)
    return seen


@pytest.mark.parametrize(
    "listen, mode, expected",
    [
        (False, None, "NIXL_THREAD_SYNC_NONE"),
        (True, None, "NIXL_THREAD_SYNC_STRICT"),
        (False, "NIXL_THREAD_SYNC_NONE", "NIXL_THREAD_SYNC_NONE"),
        (False, "NIXL_THREAD_SYNC_STRICT", "NIXL_THREAD_SYNC_STRICT"),
        (False, "NIXL_THREAD_SYNC_RW", "NIXL_THREAD_SYNC_RW"),
        (True, "NIXL_THREAD_SYNC_NONE", "NIXL_THREAD_SYNC_NONE"),
        (True, "NIXL_THREAD_SYNC_RW", "NIXL_THREAD_SYNC_RW"),
        (False, "NIXL_THREAD_SYNC_DEFAULT", "NIXL_THREAD_SYNC_NONE"),
    ],
)
def test_sync_mode_reaches_bindings(api, bind, capture_agent_ctor, listen, mode, expected):
    sync = getattr(api.nixl_thread_sync_t, mode) if mode else None
    conf = api.nixl_agent_config(enable_listen_thread=listen, listen_port=0, sync_mode=sync)
    with pytest.raises(_Captured):
        api.nixl_agent("sync-agent", conf)
    cfg = capture_agent_ctor["cfg"]
    assert capture_agent_ctor["name"] == "sync-agent"
    assert isinstance(cfg, bind.nixlAgentConfig)
    assert cfg.syncMode == getattr(bind, expected)
    if sync is not None:
        assert cfg.syncMode == sync.value


def test_config_fields_reach_bindings(api, capture_agent_ctor):
    conf = api.nixl_agent_config(False, True, 4321, True)
    with pytest.raises(_Captured):
        api.nixl_agent("cfg-agent", conf)
    cfg = capture_agent_ctor["cfg"]
    assert cfg.useProgThread is False
    assert cfg.useListenThread is True
    assert cfg.listenPort == 4321
    assert cfg.captureTelemetry is True
    assert cfg.pthrDelay == 0
    assert cfg.lthrDelay == 100000


def test_default_config_reaches_bindings(api, bind, capture_agent_ctor):
    with pytest.raises(_Captured):
        api.nixl_agent("dflt")
    cfg = capture_agent_ctor["cfg"]
    assert cfg.useProgThread is True
    assert cfg.useListenThread is False
    assert cfg.listenPort == 8888
    assert cfg.syncMode == bind.NIXL_THREAD_SYNC_NONE
    assert cfg.captureTelemetry is False


def test_empty_agent_name(api):
    with pytest.raises(ValueError):
        api.nixl_agent("")


@pytest.mark.gixl_only
def test_libfabric_is_the_engine_under_nixls_plugin_name(make_agent):
    """LIBFABRIC, the backend Ray picks on EFA nodes, is gixl's engine under NIXL's plugin name (its options
    as NIXL's plugin source declares them; the oracle's own plugin does not load here: it needs CUDA and
    libfabric). Two agents that both ask for it transfer over the engine's routes."""
    import numpy as np

    a = make_agent("lf-a", backends=["LIBFABRIC"])
    b = make_agent("lf-b", backends=["LIBFABRIC"])
    assert "LIBFABRIC" in a.get_plugin_list() and list(a.backends) == ["LIBFABRIC"]
    params, mems = a.get_plugin_params("LIBFABRIC"), a.get_plugin_mem_types("LIBFABRIC")
    assert set(params) == {"num_threads", "split_batch_size"} and set(mems) == {"DRAM_SEG", "VRAM_SEG"}
    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    a.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
    b.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
    assert a.add_remote_agent(b.get_agent_metadata()) == b.name.encode()
    local = a.get_xfer_descs([(dst.ctypes.data, dst.nbytes, 0)], "DRAM")
    remote = a.get_xfer_descs([(src.ctypes.data, src.nbytes, 0)], "DRAM")
    h = a.initialize_xfer("READ", local, remote, b.name)
    assert a.transfer(h) in ("PROC", "DONE")
    for _ in range(2000):
        if a.check_xfer_state(h) == "DONE":
            break
        time.sleep(0.005)
    assert a.check_xfer_state(h) == "DONE" and (dst == src).all()
    a.release_xfer_handle(h)


def test_agent_attributes(make_agent, bind):
    a = make_agent("attrs")
    assert a.name.startswith("attrs-")
    assert isinstance(a.agent, bind.nixlAgent)
    assert "UCX" in a.get_plugin_list()
    assert a.plugin_list == a.get_plugin_list()
    assert list(a.backends) == ["UCX"]
    assert isinstance(a.backends["UCX"], int)
    assert a.notifs == {}
    assert a._leaked_xfer_handles == []
    assert "DRAM_SEG" in a.get_backend_mem_types("UCX")
    assert isinstance(a.get_backend_params("UCX"), dict)
    assert a.backend_mems["UCX"] == a.get_backend_mem_types("UCX")


def test_plugin_params_ucx(make_agent):
    a = make_agent()
    params = a.get_plugin_params("UCX")
    assert isinstance(params, dict) and params
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in params.items())
    mems = a.get_plugin_mem_types("UCX")
    assert "DRAM_SEG" in mems and "VRAM_SEG" in mems
    assert a.plugin_b_options["UCX"] == params
    assert a.plugin_mem_types["UCX"] == mems


def test_invalid_plugin_name_gives_empty_results(make_agent):
    a = make_agent()
    assert a.get_plugin_params("UVX") == {}
    assert a.get_plugin_mem_types("UVX") == []
    assert a.get_backend_params("UVX") == {}
    assert a.get_backend_mem_types("UVX") == []


def test_invalid_backend_creation(make_agent, bind):
    a = make_agent()
    with pytest.raises(bind.nixlNotFoundError):
        a.create_backend("UVX")
    assert "UVX" not in a.backends


def test_backend_created_twice(make_agent, bind):
    a = make_agent()
    with pytest.raises(bind.nixlInvalidParamError):
        a.create_backend("UCX")
    assert list(a.backends) == ["UCX"]


def test_no_backends_then_create(make_agent, bind):
    a = make_agent(backends=[])
    assert a.backends == {}
    assert a.get_backend_mem_types("UCX") == []
    a.create_backend("UCX", {})
    assert "UCX" in a.backends
    assert "DRAM_SEG" in a.get_backend_mem_types("UCX")


def test_missing_plugin_in_config_is_skipped(make_agent):
    a = make_agent(backends=["NOT_A_PLUGIN", "UCX"])
    assert list(a.backends) == ["UCX"]


def test_num_threads_config(make_agent):
    a = make_agent(num_threads=2)
    assert "UCX" in a.backends


def test_instantiate_all_ignored_with_config(api):
    a = api.nixl_agent(conftest.unique_name("ia"), api.nixl_agent_config(backends=[]), instantiate_all=True)
    assert a.backends == {}


def test_invalid_operation_rejected_before_bindings(make_agent):
    a = make_agent()

    class Dummy:
        _handle = 0

    for op in ("RD", "WR", "read", ""):
        with pytest.raises(KeyError):
            a.make_prepped_xfer(op, Dummy(), [0], Dummy(), [0])
        with pytest.raises(KeyError):
            a.initialize_xfer(op, None, None, "nobody")


def test_unknown_backend_name_in_lists(make_agent):
    a = make_agent()
    with pytest.raises(KeyError):
        a.get_new_notifs(backends=["GDS"])
    with pytest.raises(KeyError):
        a.register_memory([(1, 1, 0, "")], "DRAM", backends=["GDS"])
    with pytest.raises(ValueError):
        a.query_memory([(1, 1, 0, "")], "GDS", "DRAM")


def test_query_memory_not_supported_by_ucx(make_agent, bind):
    a = make_agent()
    with pytest.raises(bind.nixlNotSupportedError):
        a.query_memory([(1, 1, 0, "")], "UCX", "DRAM")


AGENT_FAILS = {
    # A listener port that another socket holds.
    "listener-port-taken": (
        "import socket\n"
        "s = socket.socket(); s.bind(('0.0.0.0', 0)); s.listen(); port = s.getsockname()[1]\n"
        "cfg = M.api.nixl_agent_config(enable_listen_thread=True, listen_port=port)\n",
        {},
    ),
    # A telemetry exporter that cannot be made.
    "unknown-exporter": (
        "cfg = M.api.nixl_agent_config()\n",
        {"NIXL_TELEMETRY_ENABLE": "y", "NIXL_TELEMETRY_EXPORTER": "no-such-exporter"},
    ),
}


@pytest.mark.parametrize("case", sorted(AGENT_FAILS))
def test_agent_construction_failure_is_a_runtime_error(case):
    """NIXL's agent constructor raises RuntimeError (its C++ exception) when it fails; code that catches it must
    keep working after the swap."""
    from helpers import run_impl_child

    setup, env = AGENT_FAILS[case]
    code = setup + (
        "try:\n"
        "    M.api.nixl_agent('fails', cfg)\n"
        "    print('created')\n"
        "except RuntimeError as e:\n"
        "    print('RuntimeError', bool(str(e)))\n"
    )
    assert run_impl_child(code, env, drop=lambda k: k.startswith("NIXL_TELEMETRY_")) == "RuntimeError True"
