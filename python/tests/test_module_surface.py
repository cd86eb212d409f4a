"""Module-level names of nixl._api / nixl._bindings / nixl._utils / nixl.logging."""

from __future__ import annotations

import datetime
import importlib
import inspect
import logging

import numpy as np
import pytest

from helpers import run_impl_child

# --------------------------------------------------------------------------- enums


MEM_TYPES = {"DRAM_SEG": 0, "VRAM_SEG": 1, "BLK_SEG": 2, "OBJ_SEG": 3, "FILE_SEG": 4}
STATUSES = {
    "NIXL_IN_PROG": 1,
    "NIXL_SUCCESS": 0,
    "NIXL_ERR_NOT_POSTED": -1,
    "NIXL_ERR_INVALID_PARAM": -2,
    "NIXL_ERR_BACKEND": -3,
    "NIXL_ERR_NOT_FOUND": -4,
    "NIXL_ERR_MISMATCH": -5,
    "NIXL_ERR_NOT_ALLOWED": -6,
    "NIXL_ERR_REPOST_ACTIVE": -7,
    "NIXL_ERR_UNKNOWN": -8,
    "NIXL_ERR_NOT_SUPPORTED": -9,
}
OPS = {"NIXL_READ": 0, "NIXL_WRITE": 1}
SYNC = {"NIXL_THREAD_SYNC_NONE": 0, "NIXL_THREAD_SYNC_STRICT": 1, "NIXL_THREAD_SYNC_RW": 2}
EXCEPTIONS = [
    "nixlNotPostedError",
    "nixlInvalidParamError",
    "nixlBackendError",
    "nixlNotFoundError",
    "nixlMismatchError",
    "nixlNotAllowedError",
    "nixlRepostActiveError",
    "nixlUnknownError",
    "nixlNotSupportedError",
    "nixlRemoteDisconnectError",
    "nixlCancelledError",
    "nixlNoTelemetryError",
]


@pytest.mark.parametrize(
    "enum_name, members",
    [("nixl_mem_t", MEM_TYPES), ("nixl_status_t", STATUSES), ("nixl_xfer_op_t", OPS), ("nixl_thread_sync_t", SYNC)],
)
def test_enum_values_and_module_exports(bind, enum_name, members):
    enum = getattr(bind, enum_name)
    for name, value in members.items():
        member = getattr(bind, name)  # exported at module level
        assert getattr(enum, name) == member
        assert int(member) == value
        assert isinstance(member, enum)
        assert member.name == name


def test_cost_enum(bind):
    assert int(bind.NIXL_COST_ANALYTICAL_BACKEND) == 0
    assert isinstance(bind.NIXL_COST_ANALYTICAL_BACKEND, bind.nixl_cost_t)


def test_thread_sync_default_is_none(bind):
    assert bind.NIXL_THREAD_SYNC_DEFAULT == bind.NIXL_THREAD_SYNC_NONE
    assert int(bind.NIXL_THREAD_SYNC_DEFAULT) == 0


def test_plain_enums_compare_equal_to_int(bind):
    # nixl_mem_t, nixl_status_t and nixl_xfer_op_t are plain C enums in NIXL.
    assert bind.DRAM_SEG == 0
    assert bind.VRAM_SEG == 1
    assert bind.NIXL_SUCCESS == 0
    assert bind.NIXL_IN_PROG == 1
    assert bind.NIXL_ERR_NOT_FOUND == -4
    assert bind.NIXL_READ == 0 and bind.NIXL_WRITE == 1
    assert hash(bind.DRAM_SEG) == hash(0)


def test_enum_class_members_do_not_equal_int(bind):
    # nixl_cost_t and nixl_thread_sync_t are `enum class` in NIXL: no int equality.
    assert not (bind.NIXL_COST_ANALYTICAL_BACKEND == 0)
    assert not (bind.NIXL_THREAD_SYNC_NONE == 0)


def test_enum_lookup_by_value(bind):
    assert bind.nixl_mem_t(1) == bind.VRAM_SEG
    assert bind.nixl_xfer_op_t(1) == bind.NIXL_WRITE


def test_constants(bind):
    assert bind.DEFAULT_COMM_PORT == 8888
    assert bind.NIXL_INIT_AGENT == ""
    assert isinstance(bind.HAVE_UCX_GPU_DEVICE_API, bool)


@pytest.mark.parametrize("name", EXCEPTIONS)
def test_exception_classes_derive_directly_from_exception(bind, name):
    cls = getattr(bind, name)
    assert cls.__bases__ == (Exception,)
    assert cls.__mro__[1:] == (Exception, BaseException, object)
    err = cls("NIXL_ERR_X")
    assert str(err) == "NIXL_ERR_X"


def test_exception_message_is_status_name(make_agent, bind):
    agent = make_agent()
    with pytest.raises(bind.nixlNotFoundError) as info:
        agent.create_backend("NO_SUCH_PLUGIN_XYZ")
    assert str(info.value) == "NIXL_ERR_NOT_FOUND"
    with pytest.raises(bind.nixlMismatchError) as info:
        agent.add_remote_agent(b"definitely not metadata")
    assert str(info.value) == "NIXL_ERR_MISMATCH"


def test_bindings_classes_present(bind):
    for name in (
        "nixlAgent",
        "nixlAgentConfig",
        "nixlXferDList",
        "nixlRegDList",
        "nixlRemoteDList",
        "nixlXferTelemetry",
    ):
        assert isinstance(getattr(bind, name), type), name


# --------------------------------------------------------------------------- _api


def test_api_module_names(api, bind):
    assert api.DEFAULT_COMM_PORT == 8888
    assert api.nixl_backend_handle is int
    assert api.nixlBind is bind  # LMCache imports nixlBind from nixl._api
    for name in (
        "nixl_agent",
        "nixl_agent_config",
        "nixl_prepped_dlist_handle",
        "nixl_xfer_handle",
        "nixl_thread_sync_t",
    ):
        assert isinstance(getattr(api, name), type), name
    assert isinstance(api.logger, logging.Logger)


def test_thread_sync_python_enum(api, bind):
    import enum

    E = api.nixl_thread_sync_t
    assert issubclass(E, enum.Enum)
    assert [m.name for m in E] == ["NIXL_THREAD_SYNC_NONE", "NIXL_THREAD_SYNC_STRICT", "NIXL_THREAD_SYNC_RW"]
    assert E.NIXL_THREAD_SYNC_DEFAULT is E.NIXL_THREAD_SYNC_NONE  # alias
    assert E.NIXL_THREAD_SYNC_STRICT.value == bind.NIXL_THREAD_SYNC_STRICT
    assert isinstance(E.NIXL_THREAD_SYNC_RW.value, bind.nixl_thread_sync_t)
    assert not isinstance(E.NIXL_THREAD_SYNC_RW.value, int)


def _params(func):
    out = []
    for p in inspect.signature(func).parameters.values():
        if p.name == "self":
            continue
        default = p.default if p.default is not inspect.Parameter.empty else "<req>"
        kind = "kw" if p.kind is inspect.Parameter.KEYWORD_ONLY else "pos"
        out.append((p.name, default, kind))
    return out


_R = "<req>"
AGENT_SIGNATURES = {
    "__init__": [("agent_name", _R), ("nixl_conf", None), ("instantiate_all", False)],
    "get_plugin_list": [],
    "get_plugin_mem_types": [("backend", _R)],
    "get_plugin_params": [("backend", _R)],
    "get_backend_mem_types": [("backend", _R)],
    "get_backend_params": [("backend", _R)],
    "create_backend": [("backend", _R), ("initParams", {})],
    "register_memory": [("reg_list", _R), ("mem_type", None), ("backends", [])],
    "deregister_memory": [("dereg_list", _R), ("backends", [])],
    "query_memory": [("reg_list", _R), ("backend", _R), ("mem_type", None)],
    "make_connection": [("remote_agent", _R), ("backends", [])],
    "prep_xfer_dlist": [("agent_name", _R), ("xfer_list", _R), ("mem_type", None), ("backends", [])],
    "estimate_xfer_cost": [("req_handle", _R)],
    "make_prepped_xfer": [
        ("operation", _R),
        ("local_xfer_side", _R),
        ("local_indices", _R),
        ("remote_xfer_side", _R),
        ("remote_indices", _R),
        ("notif_msg", b""),
        ("backends", []),
        ("skip_desc_merge", False),
    ],
    "initialize_xfer": [
        ("operation", _R),
        ("local_descs", _R),
        ("remote_descs", _R),
        ("remote_agent", _R),
        ("notif_msg", b""),
        ("backends", []),
    ],
    "transfer": [("handle", _R), ("notif_msg", b"")],
    "check_xfer_state": [("handle", _R)],
    "get_xfer_telemetry": [("handle", _R)],
    "query_xfer_backend": [("handle", _R)],
    "release_xfer_handle": [("handle", _R)],
    "release_dlist_handle": [("handle", _R)],
    "prep_mem_view": [("dlist", _R), ("backends", None, "kw")],
    "release_mem_view": [("mvh", _R)],
    "get_new_notifs": [("backends", [])],
    "update_notifs": [("backends", [])],
    "check_remote_xfer_done": [
        ("remote_agent_name", _R),
        ("lookup_tag", _R),
        ("backends", []),
        ("tag_is_prefix", True),
    ],
    "send_notif": [("remote_agent_name", _R), ("notif_msg", _R), ("backend", None)],
    "get_agent_metadata": [],
    "get_partial_agent_metadata": [("descs", _R), ("inc_conn_info", False), ("backends", [])],
    "add_remote_agent": [("metadata", _R)],
    "remove_remote_agent": [("agent", _R)],
    "send_local_metadata": [("ip_addr", ""), ("port", 8888)],
    "send_partial_agent_metadata": [
        ("descs", _R),
        ("inc_conn_info", False),
        ("backends", []),
        ("ip_addr", ""),
        ("port", 8888),
        ("label", ""),
    ],
    "fetch_remote_metadata": [("remote_agent", _R), ("ip_addr", ""), ("port", 8888), ("label", "")],
    "invalidate_local_metadata": [("ip_addr", ""), ("port", 8888)],
    "check_remote_metadata": [("agent", _R), ("descs", None)],
    "get_xfer_descs": [("descs", _R), ("mem_type", None)],
    "get_reg_descs": [("descs", _R), ("mem_type", None)],
    "get_remote_descs": [("descs", _R), ("mem_type", None)],
    "get_serialized_descs": [("descs", _R)],
    "deserialize_descs": [("serialized_descs", _R)],
}


@pytest.mark.parametrize("method", sorted(AGENT_SIGNATURES))
def test_agent_method_signatures(api, method):
    expected = [(e[0], e[1], e[2] if len(e) > 2 else "pos") for e in AGENT_SIGNATURES[method]]
    assert _params(getattr(api.nixl_agent, method)) == expected


def test_agent_config_signature(api, impl):
    nixl = [
        ("enable_prog_thread", True, "pos"),
        ("enable_listen_thread", False, "pos"),
        ("listen_port", 8888, "pos"),
        ("capture_telemetry", False, "pos"),
        ("num_threads", 0, "pos"),
        ("backends", ["UCX"], "pos"),
        ("sync_mode", None, "pos"),
    ]
    # gixl adds one option after NIXL's, keyword only (the overlap check, docs/overlap-check.md).
    gixl_only = [("check_overlap", None, "kw")] if impl == "gixl" else []
    assert _params(api.nixl_agent_config.__init__) == nixl + gixl_only


# --------------------------------------------------------------------------- handle classes


class _FakeBindAgent:
    def __init__(self, fail=False):
        self.calls = []
        self.fail = fail
        self._leaked_xfer_handles = []

    def releaseXferReq(self, h):
        self.calls.append(("xfer", h))
        if self.fail:
            raise RuntimeError("cannot release")

    def releasedDlistH(self, h):
        self.calls.append(("dlist", h))


def test_xfer_handle_release_and_repr(api):
    fake = _FakeBindAgent()
    h = api.nixl_xfer_handle(fake, 0x1F)
    assert {"_handle", "_agent", "_released"} <= set(api.nixl_xfer_handle.__slots__)
    assert repr(h) == "nixl_xfer_handle(0x1f, released=False)"
    assert h._handle == 0x1F and h._agent is fake and h._released is False
    h.release()
    h.release()
    assert fake.calls == [("xfer", 0x1F)]
    assert repr(h) == "nixl_xfer_handle(0x1f, released=True)"
    del h
    assert fake.calls == [("xfer", 0x1F)]


def test_prepped_handle_release_and_repr(api):
    fake = _FakeBindAgent()
    h = api.nixl_prepped_dlist_handle(fake, 255)
    assert set(api.nixl_prepped_dlist_handle.__slots__) == {"_handle", "_agent", "_released"}
    assert repr(h) == "nixl_prepped_dlist_handle(0xff, released=False)"
    h.release()
    h.release()
    assert fake.calls == [("dlist", 255)]
    assert "released=True" in repr(h)


def test_handle_del_releases(api):
    fake = _FakeBindAgent()
    api.nixl_xfer_handle(fake, 7)  # dropped at once
    api.nixl_prepped_dlist_handle(fake, 8)
    assert ("xfer", 7) in fake.calls and ("dlist", 8) in fake.calls


def test_xfer_handle_del_failure_is_swallowed(api):
    fake = _FakeBindAgent(fail=True)
    h = api.nixl_xfer_handle(fake, 9)
    del h  # must not raise
    assert fake.calls == [("xfer", 9)]
    assert fake._leaked_xfer_handles == [9]


# --------------------------------------------------------------------------- packaging-level behaviour


def _run_child(code: str, extra_env=None, timeout=30):
    return run_impl_child(code, extra_env, drop=lambda k: k == "NIXL_LOG_LEVEL", timeout=timeout)


def test_import_does_not_import_torch():
    assert _run_child("print('torch' in sys.modules)") == "False"


def test_log_level_env():
    code = "import logging; print(logging.getLogger('nixl').level)"
    assert _run_child(code, {"NIXL_LOG_LEVEL": "ERROR"}) == str(logging.ERROR)
    assert _run_child(code, {"NIXL_LOG_LEVEL": "warn"}) == str(logging.WARNING)
    assert _run_child(code) == str(logging.INFO)


def _logging_module(api):
    return importlib.import_module(api.__name__.rsplit(".", 1)[0] + ".logging")


def test_get_logger_names(api):
    log_mod = _logging_module(api)
    assert log_mod.get_logger("_api").name == "nixl.api"
    assert log_mod.get_logger("foo").name == "nixl.foo"
    assert log_mod.get_logger("__x").name == "nixl.x"
    root = logging.getLogger("nixl")
    assert root.propagate is False
    assert root.handlers


# --------------------------------------------------------------------------- _utils


def test_utils_malloc_fill_verify(utils):
    a = utils.malloc_passthru(4096)
    b = utils.malloc_passthru(100)
    try:
        assert isinstance(a, int) and a % 4096 == 0 and b % 4096 == 0
        utils.ba_buf(a, 4096)
        utils.ba_buf(b, 100)
        view = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * 4096).from_address(a))
        assert (view == 0xBA).all()
        assert utils.verify_transfer(a, b, 100) is None
    finally:
        utils.free_passthru(a)
        utils.free_passthru(b)


@pytest.mark.gixl_only
def test_utils_verify_transfer_detects_mismatch(utils):
    a = utils.malloc_passthru(64)
    b = utils.malloc_passthru(64)
    try:
        utils.ba_buf(a, 64)
        utils.ba_buf(b, 64)
        np.ctypeslib.ctypes.memset(b + 10, 0, 1)
        with pytest.raises(AssertionError, match="offset 10"):
            utils.verify_transfer(a, b, 64)
    finally:
        utils.free_passthru(a)
        utils.free_passthru(b)


def test_agent_config_bindings_defaults(bind):
    c = bind.nixlAgentConfig()
    assert c.useProgThread is False
    assert c.useListenThread is False
    assert c.listenPort == 8888
    assert c.syncMode == bind.NIXL_THREAD_SYNC_NONE
    assert c.captureTelemetry is False
    assert c.pthrDelay == 0
    assert c.lthrDelay == 100000
    assert c.etcdWatchTimeout == datetime.timedelta(seconds=5)
    c2 = bind.nixlAgentConfig(True, True, 1234)
    assert (c2.useProgThread, c2.useListenThread, c2.listenPort) == (True, True, 1234)
    c2.syncMode = bind.NIXL_THREAD_SYNC_RW
    assert c2.syncMode == bind.NIXL_THREAD_SYNC_RW


def test_xfer_telemetry_object(bind):
    t = bind.nixlXferTelemetry()
    for field in ("startTime", "postDuration", "xferDuration", "totalBytes", "descCount"):
        assert getattr(t, field) == 0
        with pytest.raises(AttributeError):
            setattr(t, field, 5)
