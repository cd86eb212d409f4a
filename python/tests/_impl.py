"""Load the implementation under test (shared by conftest.py and peer.py).

``impl``:
  * ``gixl``      -> ``nixl._api`` / ``nixl._bindings`` / ``nixl._utils`` from
                    this checkout (python/), backed by the native ``gixl._gixl``;
  * ``nixl_cu12`` -> the real NIXL wheel (the oracle), likewise ``nixl_cu13``.

``bindings`` (gixl only): ``native`` (default) or ``nixl_cu12``/``nixl_cu13``,
a development shim that runs gixl's pure-Python layer on top of real NIXL's
pybind module by pre-seeding ``sys.modules["nixl._bindings"]``.

Environment equivalents (used by child processes): GIXL_TEST_IMPL,
GIXL_TEST_BINDINGS, GIXL_TEST_INSTALLED=1 (test an installed ``nixl`` instead
of python/ from the checkout).
"""

from __future__ import annotations

import importlib
import os
import sys
from types import SimpleNamespace

PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REAL_IMPLS = ("nixl_cu12", "nixl_cu13")
IMPLS = ("gixl",) + REAL_IMPLS


def load(impl: str, bindings: str = "native") -> SimpleNamespace:
    """Import and return ``SimpleNamespace(api=, bind=, utils=, impl=, bindings=)``."""
    if impl in REAL_IMPLS:
        api = importlib.import_module(f"{impl}._api")
        bind = importlib.import_module(f"{impl}._bindings")
        utils = importlib.import_module(f"{impl}._utils")
        return SimpleNamespace(api=api, bind=bind, utils=utils, impl=impl, bindings=impl)
    if impl != "gixl":
        raise ValueError(f"unknown implementation {impl!r}")
    if os.environ.get("GIXL_TEST_INSTALLED") != "1" and PYTHON_DIR not in sys.path:
        sys.path.insert(0, PYTHON_DIR)
    if bindings and bindings != "native":
        real = importlib.import_module(f"{bindings}._bindings")
        sys.modules["nixl._bindings"] = real
        pkg = importlib.import_module("nixl")
        pkg._bindings = real
    api = importlib.import_module("nixl._api")
    bind = importlib.import_module("nixl._bindings")
    utils = importlib.import_module("nixl._utils")
    return SimpleNamespace(api=api, bind=bind, utils=utils, impl=impl, bindings=bindings)


def child_env(impl: str, bindings: str) -> dict:
    """Environment for a child process that must load the same implementation."""
    env = dict(os.environ)
    env["GIXL_TEST_IMPL"] = impl
    env["GIXL_TEST_BINDINGS"] = bindings or "native"
    paths = [TESTS_DIR]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env
