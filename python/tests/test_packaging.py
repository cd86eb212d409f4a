"""gixl packaging: the nixl_cu12 / nixl_cu13 aliases and pickle module names."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest

import _impl

ALIASES = os.path.join(_impl.PYTHON_DIR, "aliases")


@pytest.mark.gixl_native
@pytest.mark.parametrize("alias", ["nixl_cu12", "nixl_cu13"])
def test_alias_packages_map_to_nixl(alias):
    code = (
        f"import sys, pickle\n"
        f"import {alias}._api as a, {alias}._bindings as b, {alias}._utils as u, {alias}.logging as lg\n"
        f"import nixl, nixl._api, nixl._bindings, nixl._utils, nixl.logging\n"
        f"assert a is nixl._api and b is nixl._bindings and u is nixl._utils and lg is nixl.logging\n"
        f"import {alias}\n"
        f"assert {alias}.nixl_agent is nixl._api.nixl_agent\n"
        f"d = b.nixlXferDList(b.DRAM_SEG, [(1, 2, 3)])\n"
        f"assert pickle.loads(pickle.dumps(d)) == d\n"
        f"print('ok')\n"
    )
    env = dict(os.environ)
    if os.environ.get("GIXL_TEST_INSTALLED") != "1":
        # Testing the checkout: the aliases are not installed, so put them (and python/) on the path.
        # Testing an installed wheel: check the aliases it installed.
        env["PYTHONPATH"] = os.pathsep.join([ALIASES, _impl.PYTHON_DIR] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


@pytest.mark.gixl_native
def test_pickles_reference_nixl_bindings(bind):
    d = bind.nixlXferDList(bind.DRAM_SEG, [(1, 2, 3)])
    blob = pickle.dumps(d)
    # so that a process running NIXL's own `nixl` meta-package can resolve the class too
    assert b"nixl._bindings" in blob
    assert pickle.loads(blob) == d
