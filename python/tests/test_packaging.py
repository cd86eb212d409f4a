"""gixl packaging: the import finder that answers nixl / nixl_cu12 / nixl_cu13, and pickle module names."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import sysconfig
import tempfile

import pytest

import _impl

# The finder's module: installed at the top of site-packages (run by `_gixl_nixl.pth`); in the checkout, here.
FINDER_DIR = os.path.join(_impl.PYTHON_DIR, "wheel-data", "purelib")
INSTALLED = os.environ.get("GIXL_TEST_INSTALLED") == "1"


def _python(code, **env_extra):
    env = dict(os.environ, **env_extra)
    if not INSTALLED:
        # Testing the checkout: the finder is not installed, so put it (and python/) on the path and run it.
        env["PYTHONPATH"] = os.pathsep.join([FINDER_DIR, _impl.PYTHON_DIR] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        code = "import _gixl_nixl\n" + code
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, cwd=tempfile.gettempdir())


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
    out = _python(code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


@pytest.mark.gixl_native
def test_nixl_is_gixls_package_under_its_own_name():
    # Loaded from gixl's folder under the name `nixl` (pickles and `__module__` say nixl._bindings), once.
    code = (
        "import nixl, nixl._api, os\n"
        "assert nixl.__name__ == 'nixl' and nixl._api.__name__ == 'nixl._api'\n"
        "assert nixl._api.nixl_agent.__module__ == 'nixl._api'\n"
        "assert os.path.basename(os.path.dirname(nixl.__file__)) == '_nixl', nixl.__file__\n"
        "import sys; assert not any(k.startswith('gixl._nixl') for k in sys.modules), 'loaded twice'\n"
        "print('ok')\n"
    )
    out = _python(code)
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.mark.gixl_native
def test_gixl_nixl_off_leaves_the_names_alone():
    # GIXL_NIXL=off: the finder stands aside. Without NVIDIA's wheels here, nothing answers `import nixl`.
    out = _python("import nixl_cu12\n", GIXL_NIXL="off")
    if out.returncode == 0:
        pytest.skip("another nixl_cu12 is installed in this interpreter")
    assert "No module named 'nixl_cu12'" in out.stderr, out.stderr[-2000:]


@pytest.mark.gixl_native
def test_interpreter_start_does_not_import_gixl():
    # The .pth runs at every start of this interpreter: it must stay a few lines and touch nothing else.
    out = _python("import sys\nprint(sorted(k for k in sys.modules if 'gixl' in k or 'nixl' in k))\n")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "['_gixl_nixl']", out.stdout


@pytest.mark.skipif(not INSTALLED, reason="checks the installed wheel (GIXL_TEST_INSTALLED=1)")
def test_installed_wheel_writes_no_file_named_like_nvidias():
    site = sysconfig.get_paths()["purelib"]
    mine = []
    for d in __import__("importlib.metadata").metadata.distributions(name="gixl"):
        mine = [str(f) for f in (d.files or [])]
    assert mine, "gixl's RECORD not found"
    tops = {f.split("/")[0] for f in mine}
    assert not tops & {"nixl", "nixl_cu12", "nixl_cu13", "nixl_ep", "nixl_meta_utils.py"}, sorted(tops)
    assert {"gixl", "_gixl_nixl.pth", "_gixl_nixl.py", "nixl-1.5.2.egg-info"} <= tops, sorted(tops)
    assert os.path.isfile(os.path.join(site, "_gixl_nixl.pth"))


@pytest.mark.skipif(not INSTALLED, reason="checks the installed wheel (GIXL_TEST_INSTALLED=1)")
def test_vllm_version_check_finds_nixl_1_5_2():
    # vLLM: packages_distributions()["nixl"], then version() of that distribution (>= 1.5.0; 0.34 pins 1.5.2).
    code = (
        "import importlib.metadata as m\n"
        "names = m.packages_distributions()['nixl']\n"
        "print(sorted({m.version(n) for n in names}))\n"
    )
    out = _python(code)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "['1.5.2']", out.stdout


@pytest.mark.gixl_native
def test_pickles_reference_nixl_bindings(bind):
    d = bind.nixlXferDList(bind.DRAM_SEG, [(1, 2, 3)])
    blob = pickle.dumps(d)
    # so that a process running NIXL's own `nixl` meta-package can resolve the class too
    assert b"nixl._bindings" in blob
    assert pickle.loads(blob) == d
