#!/usr/bin/env bash
# scripts/swap-test.sh — replacing NVIDIA's NIXL with gixl in an existing environment, and back.
#
# In a fresh virtualenv that first has NVIDIA's wheels as vLLM installs them (`nixl`, the meta-package that
# carries the `nixl_ep` dispatcher, and `nixl-cu12`, which carries `nixl_ep_cu12` and NVIDIA's own NIXL
# library that it loads; from PyPI or pip's cache):
#   1. NIXL works alone; we note how `import nixl_ep` behaves and which libraries its extension resolves
#      (no GPU, CUDA or torch here: it stops at the same point before and after each swap);
#   2. `pip install gixl` beside them: `import nixl` / `nixl_cu12` are gixl's (no warning), a transfer works,
#      every file of NVIDIA's wheels is still as their RECORD says, `nixl_ep` behaves exactly as before,
#      `GIXL_NIXL=off` gives NVIDIA's NIXL back in one process, and pip takes the environment for
#      `nixl==1.5.2` (what vLLM 0.34 pins);
#   3. `pip uninstall -y gixl` is clean (nothing of gixl left) and NVIDIA's NIXL, files and nixl_ep are as in 1;
#   4. the full replacement (`pip uninstall -y nixl nixl-cu12 && pip install gixl`) works and loses nixl_ep,
#      as docs/drop-in.md says; back to NVIDIA's wheels from there works as before.
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
nvidia=(nixl-cu12==1.5.1 nixl==1.5.2)
"$v/pip" install -q --no-deps "${nvidia[@]}"
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
# Every file NVIDIA's wheels installed, present and unchanged (their RECORD's sha256).
intact='
import base64, hashlib, importlib.metadata as m
n = 0
for name in ("nixl", "nixl-cu12"):
    d = next(d for d in m.distributions(name=name) if "gixl" not in (d.metadata.get("Summary") or ""))
    for f in d.files:
        if f.hash is None:
            continue
        got = base64.urlsafe_b64encode(hashlib.sha256(f.locate().read_bytes()).digest()).rstrip(b"=").decode()
        assert got == f.hash.value, f"{name}: {f} changed"
        n += 1
print(n, "files of NVIDIA'"'"'s wheels intact")
'
# How `import nixl_ep` (vLLM's nixl_ep backend, SGLang's dispatcher) ends here, and what its extension links.
# A stand-in `torch` (version 2.12, CUDA 12) takes the import past the dispatcher and into NVIDIA's extension,
# whose loading then stops at the CUDA driver (none here): every library before it in its link order, NVIDIA's
# libnixl.so first, was found.
mkdir -p "$work/fake-torch/torch"
printf '__version__ = "2.12.0"\nfrom . import version\n' >"$work/fake-torch/torch/__init__.py"
printf 'cuda = "12.8"\n' >"$work/fake-torch/torch/version.py"
ep_probe() {
    PYTHONPATH="$work/fake-torch" "$v/python" -c 'import nixl_ep; print("nixl_ep imports")' 2>&1 | tail -n 1
    for so in "$site"/nixl_ep_cu12/*.so; do ldd "$so" | grep -E 'libnixl|libucp' | sed -e "s|$site/||" -e 's/ (0x[0-9a-f]*)//'; done
}
is_gixl='import nixl, nixl_cu12._api as x, nixl._api as y; assert x is y and "gixl" in nixl.__file__, nixl.__file__'

echo "swap-test: 1. NVIDIA's nixl + nixl-cu12 alone"
"$v/python" -c "$check" 2>/dev/null | tail -n 1
ep_before=$(ep_probe)
echo "  nixl_ep: $(echo "$ep_before" | head -n 1)"
echo "$ep_before" | head -n 1 | grep -q "libcuda.so.1" \
    || { echo "import nixl_ep does not reach NVIDIA's extension: $ep_before"; exit 1; }
[ "$(echo "$ep_before" | grep -c 'nixl_cu12.mesonpy.libs/libnixl.so')" -ge 1 ] \
    || { echo "nixl_ep's extension does not find NVIDIA's libnixl.so: $ep_before"; exit 1; }
"$v/python" -c "$intact"

echo "swap-test: 2. pip install gixl beside them"
"$v/pip" install -q --no-deps "$wheel"
"$v/python" -W error -c "$is_gixl" || { echo "import nixl is not gixl (or warns) with gixl installed"; exit 1; }
"$v/python" -c "$check" >/dev/null
echo "  import nixl / nixl_cu12 are gixl's, no warning, a transfer works"
"$v/python" -c "$intact"
[ "$(ep_probe)" = "$ep_before" ] || { echo "nixl_ep changed: $(ep_probe) (was: $ep_before)"; exit 1; }
echo "  nixl_ep as before (its extension still resolves NVIDIA's libnixl.so and UCX)"
GIXL_NIXL=off "$v/python" -c "import nixl_cu12, os; assert 'gixl' not in os.path.relpath(nixl_cu12.__file__, '$site'), nixl_cu12.__file__"
GIXL_NIXL=off "$v/python" -c "$check" 2>/dev/null | tail -n 1 | sed 's/^/  GIXL_NIXL=off: /'
# vLLM 0.34 pins nixl == 1.5.2 and checks packages_distributions()["nixl"]'s version
# (--no-index: nothing is fetched; pip fails if it would have to install anything).
"$v/python" -c "import importlib.metadata as m; v = {m.version(n) for n in m.packages_distributions()['nixl']}; assert v == {'1.5.2'}, v"
"$v/pip" install --no-index --no-deps "nixl==1.5.2" | grep -q "Requirement already satisfied" \
    || { echo "pip does not take the environment for nixl==1.5.2"; exit 1; }
echo "  nixl==1.5.2 (vLLM 0.34's pin) is satisfied"

echo "swap-test: 3. pip uninstall gixl is clean and leaves NVIDIA's NIXL whole"
"$v/pip" uninstall -q -y gixl
left=$(cd "$site" && ls -d gixl _gixl_nixl.* nixl-1.5.2.egg-info 2>/dev/null || true)
[ -z "$left" ] || { echo "left behind in site-packages: $left"; exit 1; }
"$v/python" -c "$intact"
"$v/python" -c "import os, nixl_cu12._api, nixl_cu12._bindings as b; r = os.path.relpath(b.__file__, '$site'); assert 'gixl' not in r and r.startswith('nixl_cu12'), r"
"$v/python" -c "$check" 2>/dev/null | tail -n 1
[ "$(ep_probe)" = "$ep_before" ] || { echo "nixl_ep changed: $(ep_probe) (was: $ep_before)"; exit 1; }
echo "  nothing of gixl left; NVIDIA's NIXL and nixl_ep as in 1"

echo "swap-test: 4. the full replacement, and back"
"$v/pip" uninstall -q -y nixl nixl-cu12
"$v/pip" install -q --no-deps "$wheel"
"$v/python" -W error -c "$is_gixl"
"$v/python" -c "$check" >/dev/null
ep=$("$v/python" -c 'import nixl_ep' 2>&1 | tail -n 1 || true)
[ "$ep" = "ModuleNotFoundError: No module named 'nixl_ep'" ] || { echo "unexpected: $ep"; exit 1; }
echo "  gixl alone works; nixl_ep is gone with NVIDIA's wheels, as docs/drop-in.md says"
"$v/pip" uninstall -q -y gixl
"$v/pip" install -q --no-deps "${nvidia[@]}"
"$v/python" -c "$intact"
"$v/python" -c "$check" 2>/dev/null | tail -n 1
[ "$(ep_probe)" = "$ep_before" ] || { echo "nixl_ep changed: $(ep_probe) (was: $ep_before)"; exit 1; }
echo "swap-test: ok"
