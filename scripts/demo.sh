#!/usr/bin/env bash
# scripts/demo.sh — the main job: a vLLM-style prefill/decode pair in two processes moving KV blocks through
# gixl, with the prefill killed and restarted midway. Pass `--impl nixl_cu12` to run the same script on NIXL.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
"$root/scripts/setup.sh" >&2
impl=nixl
venv=gixl
if [ "${1:-}" = "--impl" ] && [ "${2:-}" = "nixl_cu12" ]; then impl=nixl_cu12; venv=nixl; fi
exec "$root/.venv/$venv/bin/python" "$root/examples/kv_demo.py" --impl "$impl"
