"""Conformance suite for gixl's NIXL-compatible Python API.

Run against gixl (default):           pytest python/tests
Run against real NIXL (the oracle):   /work/ref-nixl/bin/python -m pytest python/tests --impl nixl_cu12
gixl's Python layer over NIXL's bindings (development shim, no native module needed):
                                      /work/ref-nixl/bin/python -m pytest python/tests --gixl-bindings nixl_cu12

Markers:
  gixl_only   - checks a gixl improvement over NIXL; skipped for real NIXL.
  gixl_native - a gixl improvement in the native bindings; also skipped when gixl's Python
                layer runs over NIXL's bindings (--gixl-bindings nixl_cu12).
  two_process - spawns child processes (each under a timeout).
"""

from __future__ import annotations

import faulthandler
import os
import sys
import types
import uuid

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _impl  # noqa: E402

_LOADED = None
_LOAD_ERROR = None

# A single test may not take longer than this (seconds) before the whole run
# is aborted with a traceback; children have their own, shorter timeouts.
WATCHDOG_S = float(os.environ.get("GIXL_TEST_WATCHDOG_S", "90"))


def pytest_addoption(parser):
    group = parser.getgroup("gixl")
    group.addoption(
        "--impl",
        default=os.environ.get("GIXL_TEST_IMPL", "gixl"),
        choices=list(_impl.IMPLS),
        help="implementation under test: gixl (default) or the real NIXL wheel (nixl_cu12/nixl_cu13)",
    )
    group.addoption(
        "--gixl-bindings",
        default=os.environ.get("GIXL_TEST_BINDINGS", "native"),
        choices=["native"] + list(_impl.REAL_IMPLS),
        help="with --impl gixl: 'native' (gixl._gixl) or run gixl's Python layer on real NIXL's bindings",
    )


def pytest_configure(config):
    global _LOADED, _LOAD_ERROR
    config.addinivalue_line("markers", "gixl_only: gixl improvement over NIXL; skipped for real NIXL")
    config.addinivalue_line("markers", "gixl_native: gixl improvement in the native bindings")
    config.addinivalue_line("markers", "two_process: spawns child processes")
    impl = config.getoption("--impl")
    bindings = config.getoption("--gixl-bindings") if impl == "gixl" else impl
    # Children (peer.py) load the same implementation through these.
    os.environ["GIXL_TEST_IMPL"] = impl
    os.environ["GIXL_TEST_BINDINGS"] = bindings
    try:
        _LOADED = _impl.load(impl, bindings)
    except Exception as exc:  # ImportError while the native module does not exist yet
        _LOAD_ERROR = exc


def pytest_report_header(config):
    impl = config.getoption("--impl")
    if _LOADED is not None:
        where = getattr(_LOADED.api, "__file__", "?")
        return [f"nixl implementation: {impl} (bindings: {_LOADED.bindings}) api={where}"]
    return [f"nixl implementation: {impl} NOT IMPORTABLE: {_LOAD_ERROR!r}"]


def pytest_collection_modifyitems(config, items):
    impl = config.getoption("--impl")
    if _LOADED is None:
        reason = (
            f"implementation {impl!r} cannot be imported ({type(_LOAD_ERROR).__name__}: {_LOAD_ERROR}). "
            "For gixl this means the native module gixl._gixl (behind nixl._bindings) is not built yet; "
            "use --impl nixl_cu12 for the oracle or --gixl-bindings nixl_cu12 for the shim."
        )
        skip_all = pytest.mark.skip(reason=reason)
        for item in items:
            item.add_marker(skip_all)
        return
    real = impl in _impl.REAL_IMPLS
    shim = not real and _LOADED.bindings != "native"
    skip = pytest.mark.skip(reason="gixl-only behaviour (NIXL differs or lacks it)")
    skip_native = pytest.mark.skip(reason="needs gixl's native bindings (running over NIXL's bindings)")
    for item in items:
        if real and ("gixl_only" in item.keywords or "gixl_native" in item.keywords):
            item.add_marker(skip)
        elif shim and "gixl_native" in item.keywords:
            item.add_marker(skip_native)


@pytest.fixture(autouse=True)
def _watchdog():
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="session")
def nixl_impl():
    return _LOADED


@pytest.fixture(scope="session")
def impl(nixl_impl):
    return nixl_impl.impl


@pytest.fixture(scope="session")
def api(nixl_impl):
    return nixl_impl.api


@pytest.fixture(scope="session")
def bind(nixl_impl):
    return nixl_impl.bind


@pytest.fixture(scope="session")
def utils(nixl_impl):
    return nixl_impl.utils


def unique_name(prefix: str = "agent") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def make_agent(api):
    """Factory: ``make_agent(prefix="a", **config_kwargs)`` -> nixl_agent with a unique name."""
    created = []

    def _make(prefix: str = "agent", name: str | None = None, **cfg):
        conf = api.nixl_agent_config(**cfg) if cfg else None
        agent = api.nixl_agent(name or unique_name(prefix), conf)
        created.append(agent)
        return agent

    yield _make
    created.clear()


@pytest.fixture
def peers(nixl_impl, tmp_path):
    """Factory for child-process peers (see peer.py); all are killed at teardown."""
    from peer_client import PeerProcess

    procs = []

    def _spawn(label: str = "peer", env: dict | None = None):
        p = PeerProcess(label, nixl_impl.impl, nixl_impl.bindings, tmp_path, env=env)
        procs.append(p)
        return p

    yield _spawn
    for p in procs:
        p.close()


# --------------------------------------------------------------------------- torch-like tensors


class _FakeDevice:
    def __init__(self, kind, index):
        self.type, self.index = kind, index

    def __eq__(self, other):
        return (self.type, self.index) == (other.type, other.index)

    def __ne__(self, other):
        return not self == other


@pytest.fixture
def fake_torch(monkeypatch):
    """Install a tiny stand-in for torch in sys.modules (NIXL only consults sys.modules)."""
    mod = types.ModuleType("torch")

    class Tensor:
        def __init__(self, array, device=-1, contiguous=True):
            self.array = array
            self._dev = device
            self._contig = contiguous
            self.device = _FakeDevice("cpu" if device < 0 else "cuda", None if device < 0 else device)

        def data_ptr(self):
            return int(self.array.ctypes.data)

        def numel(self):
            return int(self.array.size)

        def element_size(self):
            return int(self.array.itemsize)

        def get_device(self):
            return self._dev

        def is_contiguous(self):
            return self._contig

        # NIXL looks at ``descs[0]`` before checking for a tensor.
        def __getitem__(self, i):
            return Tensor(self.array[i], self._dev, self._contig)

        def __len__(self):
            return len(self.array)

    mod.Tensor = Tensor
    monkeypatch.setitem(sys.modules, "torch", mod)
    return mod
