#!/usr/bin/env bash
# scripts/test-all.sh — every test gixl has, from a fresh clone: installs what it needs (scripts/setup.sh),
# then runs each suite and prints a summary. Exits non-zero if any step fails.
#
# Steps: Rust unit + multi-process tests (cargo test, incl. the header-drift check); the VRAM tests again
# with the `cuda` feature (fake device layer); the header alone as C11 and C++17; the C library's exports;
# the C test suite under ASan/UBSan against gixl and against NVIDIA's
# NIXL 1.5.1 (the oracle); the nixl-sys (stub-api) Rust consumer against gixl; the Python conformance suite
# against gixl and against NIXL (including the fault matrix and hostile-input tests); the typed stubs
# (mypy.stubtest); the two-process demo; the C tests under valgrind; and a short soak.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

passed=0
failed=0
failures=()
step() {
    local name="$1"
    shift
    echo
    echo "=== $name"
    local t0=$SECONDS
    if "$@"; then
        passed=$((passed + 1))
        echo "=== $name: ok ($((SECONDS - t0)) s)"
    else
        failed=$((failed + 1))
        failures+=("$name")
        echo "=== $name: FAILED ($((SECONDS - t0)) s)"
    fi
}

scripts/setup.sh || { echo "setup failed"; exit 1; }

nixl_site() { ls -d .venv/nixl/lib/python3*/site-packages | head -n 1; }

rust_tests() { cargo test --workspace --release; }
rust_cuda() {
    # The `cuda` feature (cudarc; the driver is loaded at run time, so this builds and runs without CUDA) over
    # the fake device layer: lint, the VRAM route's unit and multi-process tests (incl. the no-driver
    # NOT_SUPPORTED path), and the GPU check program as a dry run.
    cargo clippy --release --features cuda --lib --example gpu_check -- -D warnings &&
        cargo test --release --features cuda --lib --test vram -- vram &&
        GIXL_FAKE_DEVICE=1 GIXL_ITERS=2 timeout 120 cargo run -q --release --features cuda --example gpu_check
}
rust_lint() { cargo fmt --all --check && cargo clippy --workspace --all-targets --release -- -D warnings; }
header() { scripts/check-header.sh; }
capi_exports() {
    scripts/build-capi.sh --release || return 1
    local n
    n=$(nm -D --defined-only target/capi/libnixl_capi.so | grep -c ' T nixl_capi_')
    echo "libnixl_capi.so exports $n nixl_capi_* functions (NIXL 1.5.1 has 104)"
    [ "$n" -eq 104 ]
}
ffi_gixl() { FFI_CONSUMER=1 FFI_BUILD_DIR="$root/target/ffi-gixl" ffi-tests/run.sh "$root/target/capi" "$root/include"; }
ffi_nixl() {
    # NIXL's wheel ships no C header: use the declarations of the nixl-sys crate (fetched by the consumer build),
    # kept outside the repository.
    local wrapper decls
    wrapper=$(ls ~/.cargo/registry/src/*/nixl-sys-1.5.2/wrapper.h 2>/dev/null | head -n 1)
    if [ -z "$wrapper" ]; then
        (cd ffi-tests/nixl-sys-consumer && cargo fetch -q) || return 1
        wrapper=$(ls ~/.cargo/registry/src/*/nixl-sys-1.5.2/wrapper.h | head -n 1)
    fi
    decls="$root/target/nixl-decls"
    mkdir -p "$decls"
    cp "$wrapper" "$decls/nixl_capi_decls.h"
    printf '#pragma once\n#include "nixl_capi_decls.h"\n' >"$decls/gixl.h"
    GIXL_ORACLE=nixl FFI_BUILD_DIR="$root/target/ffi-nixl" ffi-tests/run.sh "$root/$(nixl_site)/.nixl_cu12.mesonpy.libs" "$decls"
}
py_gixl() { GIXL_TEST_INSTALLED=1 .venv/gixl/bin/python -m pytest -q python/tests --impl gixl -p no:cacheprovider; }
py_nixl() { .venv/nixl/bin/python -m pytest -q python/tests --impl nixl_cu12 -p no:cacheprovider; }
stubs() { PATH="$root/.venv/gixl/bin:$PATH" python/scripts/stubtest.sh; }
demo() { timeout 300 .venv/gixl/bin/python examples/kv_demo.py; }
vllm_sequence() {
    # consumers.md §1.13: the same script must print the same lines on gixl and on NIXL.
    local out="$root/target/vllm-sequence"
    mkdir -p "$out"
    timeout 120 .venv/nixl/bin/python examples/vllm_sequence.py --impl nixl_cu12 >"$out/nixl.txt" 2>"$out/nixl.err" || return 1
    timeout 120 .venv/gixl/bin/python examples/vllm_sequence.py --impl nixl >"$out/gixl.txt" 2>"$out/gixl.err" || return 1
    diff -u "$out/nixl.txt" "$out/gixl.txt" && echo "$(wc -l <"$out/gixl.txt") lines, identical"
}
valgrind_c() { scripts/valgrind.sh; }
soak_quick() { GIXL_TEST_INSTALLED=1 timeout 300 .venv/gixl/bin/python python/tests/soak.py --quick; }

step "rustfmt + clippy -D warnings" rust_lint
step "cargo test" rust_tests
step "cargo test --features cuda (fake device layer)" rust_cuda
step "header compiles alone (C11, C++17)" header
step "C library exports" capi_exports
step "C tests + nixl-sys consumer vs gixl" ffi_gixl
step "C tests vs NIXL 1.5.1" ffi_nixl
step "Python conformance vs gixl" py_gixl
step "Python conformance vs NIXL 1.5.1" py_nixl
step "type stubs (mypy.stubtest)" stubs
step "two-process demo" demo
step "vLLM call sequence: same output on gixl and NIXL" vllm_sequence
step "C tests under valgrind (memcheck)" valgrind_c
step "soak: 1000 cycles, 20 peer restarts, RSS and fds flat" soak_quick

echo
for f in "${failures[@]}"; do echo "failed step: $f"; done
echo "steps: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
