#!/usr/bin/env bash
# Check the hand-written stubs python/gixl/_gixl.pyi against the compiled module gixl._gixl.
#
# Usage: python/scripts/stubtest.sh [PYTHON]
#   PYTHON (default: $PYTHON or python3) must have mypy installed and gixl importable, e.g. after
#   `maturin develop --release` in its virtualenv, or `pip install .` of this repository.
# No allowlist is needed today; if one ever is, put it next to this script as stubtest-allowlist.txt
# with a comment per entry saying why the difference cannot be avoided.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py="${1:-${PYTHON:-python3}}"

if ! "$py" -c "import gixl._gixl" 2>/dev/null; then
    echo "stubtest: gixl._gixl is not importable with $py; build it first:" >&2
    echo "  VIRTUAL_ENV=<venv> maturin develop --release   (or: <venv>/bin/pip install .)" >&2
    exit 2
fi

args=(gixl._gixl)
if [[ -f "$here/stubtest-allowlist.txt" ]]; then
    args+=(--allowlist "$here/stubtest-allowlist.txt")
fi
# Run from a neutral directory so the checkout's python/ does not shadow the importable package.
cd "$(mktemp -d)"
exec "$py" -m mypy.stubtest "${args[@]}"
