#!/usr/bin/env bash
# scripts/demo.sh — the main job: a vLLM-style prefill/decode pair in two processes moving KV blocks through
# gixl, with the prefill killed and restarted midway (examples/kv_demo.py).
#
#   scripts/demo.sh                    on gixl: needs a Rust toolchain (cargo, a C linker) and python3 >= 3.10
#   scripts/demo.sh --impl nixl_cu12   the same script on NVIDIA's NIXL 1.5.1, for comparison (no Rust needed)
#
# It installs only what the demo needs, inside this checkout: `.venv/gixl` (pip, maturin, numpy, and gixl's
# wheel built from this checkout, rebuilt on every run so the venv matches the source), or with
# `--impl nixl_cu12` `.venv/nixl` (nixl-cu12==1.5.1 without its dependencies, numpy). Nothing system-wide, no
# apt packages: the test command's full set-up (`scripts/setup.sh`: the NIXL oracle, the S3 server, rdma-core,
# the tools the test suites need) is not run. Each step prints how long it took, on stderr.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
impl=nixl
venv=gixl
case "${1:-}" in
"") ;;
--impl)
    case "${2:-}" in
    nixl | gixl) ;;
    nixl_cu12) impl=nixl_cu12 venv=nixl ;;
    *)
        echo "usage: scripts/demo.sh [--impl nixl_cu12]" >&2
        exit 2
        ;;
    esac
    ;;
*)
    echo "usage: scripts/demo.sh [--impl nixl_cu12]" >&2
    exit 2
    ;;
esac
t0=$SECONDS
say() { echo "demo.sh: $1 ($((SECONDS - t0)) s)" >&2; }
fail() {
    echo "demo.sh: $1" >&2
    exit 1
}

py=${PYTHON:-python3}
command -v "$py" >/dev/null || fail "$py is not installed: the demo needs Python >= 3.10 (set PYTHON to another interpreter)"
"$py" -c 'import sys; sys.exit(sys.version_info < (3, 10))' ||
    fail "$("$py" --version 2>&1) is too old: the demo needs Python >= 3.10 (set PYTHON to another interpreter)"
"$py" -c 'import venv, ensurepip' 2>/dev/null ||
    fail "$py cannot make virtualenvs (on Debian/Ubuntu: apt-get install python3-venv)"

if [ "$venv" = gixl ]; then
    command -v cargo >/dev/null ||
        fail "cargo is not installed: gixl is built from this checkout with a Rust toolchain; install one with
         curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh   (then open a new shell, or: . ~/.cargo/env)
         or run the demo on NVIDIA's NIXL instead: scripts/demo.sh --impl nixl_cu12"
    command -v cc >/dev/null || fail "no C compiler (cc) to link gixl with: apt-get install build-essential (or gcc)"
    if [ ! -x .venv/gixl/bin/python ] || ! .venv/gixl/bin/python -c 'import numpy, maturin' 2>/dev/null; then
        echo "demo.sh: .venv/gixl (pip, maturin, numpy)" >&2
        "$py" -m venv .venv/gixl
        .venv/gixl/bin/pip install -q maturin numpy
        say ".venv/gixl ready"
    fi
    echo "demo.sh: building gixl's wheel from this checkout into .venv/gixl (a few minutes the first time)" >&2
    # The venv's own maturin builds it (no isolated build environment to download); the build backend runs
    # `maturin` from PATH, so the venv's bin comes first.
    PATH="$root/.venv/gixl/bin:$PATH" .venv/gixl/bin/pip install -q --force-reinstall --no-deps --no-build-isolation .
    say "gixl built and installed"
else
    if [ ! -x .venv/nixl/bin/python ] || ! .venv/nixl/bin/python -c 'import numpy, nixl_cu12._api' 2>/dev/null; then
        echo "demo.sh: .venv/nixl (nixl-cu12==1.5.1, numpy)" >&2
        "$py" -m venv .venv/nixl
        .venv/nixl/bin/pip install -q numpy
        .venv/nixl/bin/pip install -q --no-deps nixl-cu12==1.5.1
        say ".venv/nixl ready"
    fi
fi
say "running examples/kv_demo.py --impl $impl"
exec "$root/.venv/$venv/bin/python" "$root/examples/kv_demo.py" --impl "$impl"
