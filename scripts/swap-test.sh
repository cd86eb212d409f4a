#!/usr/bin/env bash
# scripts/swap-test.sh — replacing NVIDIA's NIXL with gixl in an existing environment, and back.
#
# In a fresh virtualenv that first has nixl-cu12==1.5.1 (NVIDIA's wheel, from PyPI or pip's cache):
#   1. NIXL works; gixl's wheel is installed on top: `import nixl` warns, naming nixl-cu12 and the command;
#   2. the one-command swap it prints (`pip uninstall -y nixl-cu12 && pip install --force-reinstall
#      --no-deps gixl`) leaves gixl alone: no warning, nixl and nixl_cu12 are gixl's, a transfer works, and
#      pip takes gixl for `nixl==1.5.2` (what vLLM 0.34 pins);
#   3. `pip uninstall -y gixl` is clean: no nixl/, nixl_cu12/, nixl_cu13/, gixl/ left in site-packages;
#   4. back to NIXL: `pip install nixl-cu12==1.5.1` works again as before.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
work="$root/target/swap-test"
rm -rf "$work"
mkdir -p "$work/wheels"
py=${PYTHON:-python3}

echo "swap-test: building gixl's wheel"
.venv/gixl/bin/maturin build --release --quiet -o "$work/wheels" >"$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
wheel=$(ls "$work"/wheels/gixl-*.whl | head -n 1)

"$py" -m venv "$work/venv"
v="$work/venv/bin"
"$v/pip" install -q numpy
"$v/pip" install -q --no-deps nixl-cu12==1.5.1
site=$("$v/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# A transfer through whichever implementation `nixl_cu12._api` is.
check='
import numpy as np, time, nixl_cu12._api as api
mk = lambda n: api.nixl_agent(n, api.nixl_agent_config(backends=["UCX"]))
a, b = mk("swap-a"), mk("swap-b")
s = np.arange(4096, dtype=np.uint8); d = np.zeros(4096, dtype=np.uint8)
a.register_memory([(s.ctypes.data, 4096, 0, "")], "DRAM"); b.register_memory([(d.ctypes.data, 4096, 0, "")], "DRAM")
a.add_remote_agent(b.get_agent_metadata())
h = a.initialize_xfer("WRITE", a.get_xfer_descs([(s.ctypes.data, 4096, 0)], "DRAM"), b.get_xfer_descs([(d.ctypes.data, 4096, 0)], "DRAM"), "swap-b")
a.transfer(h)
t = time.monotonic()
while a.check_xfer_state(h) != "DONE":
    assert time.monotonic() - t < 30
assert (s == d).all()
print("transfer ok through", api.__file__)
'
echo "swap-test: 1. NVIDIA's nixl-cu12 alone"
"$v/python" -c "$check" 2>/dev/null | tail -n 1
echo "swap-test: 1. gixl installed on top"
"$v/pip" install -q --no-deps "$wheel"
out=$("$v/python" -W always -c "import nixl" 2>&1 || true)
echo "$out" | grep -q "nixl-cu12==1.5.1" || { echo "no warning naming nixl-cu12: $out"; exit 1; }
echo "$out" | grep -q "pip uninstall -y nixl-cu12 && pip install --force-reinstall --no-deps gixl" \
    || { echo "the warning does not give the command: $out"; exit 1; }
echo "  warned: $(echo "$out" | grep -o 'gixl and NVIDIA.*environment')"

echo "swap-test: 2. the one-command swap to gixl"
(cd "$work" && "$v/pip" uninstall -q -y nixl-cu12 && "$v/pip" install -q --force-reinstall --no-deps "$wheel")
"$v/python" -W error::RuntimeWarning -c "import nixl, nixl._bindings, gixl._gixl" || { echo "gixl warns or fails after the swap"; exit 1; }
"$v/python" -c "import nixl_cu12._api as x, nixl._api as y; assert x is y, 'nixl_cu12 is not gixl'"
"$v/python" -c "$check" >/dev/null
echo "  gixl alone: no warning, nixl_cu12._api is nixl._api (gixl), a transfer works"
# vLLM 0.34 pins nixl == 1.5.2: gixl's record of the distribution `nixl` satisfies it, so pip keeps gixl
# (--no-index: nothing is fetched; pip fails if it would have to install anything).
"$v/python" -c "import importlib.metadata as m; v = m.version('nixl'); assert v == '1.5.2', v"
"$v/pip" install --no-index --no-deps "nixl==1.5.2" | grep -q "Requirement already satisfied" \
    || { echo "pip does not take gixl for nixl==1.5.2"; exit 1; }
echo "  nixl==1.5.2 (vLLM 0.34's pin) is satisfied by gixl"

echo "swap-test: 3. pip uninstall gixl is clean"
"$v/pip" uninstall -q -y gixl
left=$(cd "$site" && ls -d nixl nixl_cu12 nixl_cu13 gixl nixl-*.egg-info 2>/dev/null || true)
[ -z "$left" ] || { echo "left behind in site-packages: $left"; exit 1; }
echo "  nothing left"

echo "swap-test: 4. back to NVIDIA's NIXL"
"$v/pip" install -q --no-deps nixl-cu12==1.5.1
# Relative to site-packages: the checkout's own path may contain "gixl".
"$v/python" -c "import os, nixl_cu12._api, nixl_cu12._bindings as b; r = os.path.relpath(b.__file__, '$site'); assert 'gixl' not in r and r.startswith('nixl_cu12'), r"
"$v/python" -c "$check" 2>/dev/null | tail -n 1
echo "swap-test: ok"
