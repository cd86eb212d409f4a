#!/usr/bin/env bash
# scripts/test-all.sh — every test gixl has, from a fresh clone: installs what it needs (scripts/setup.sh),
# then runs each suite and prints a summary. Exits non-zero if any step fails.
#
# Steps: Rust unit + multi-process tests (cargo test, incl. the header-drift check); the VRAM tests again
# with the `cuda` feature (fake device layer); the header alone as C11 and C++17; the C library's exports;
# the C test suite under ASan/UBSan against gixl and against NVIDIA's NIXL 1.5.1 (the oracle); the nixl-sys
# (stub-api) Rust consumer against gixl; the C++ drop-in (nixl.h) tests under ASan/UBSan against gixl and
# against NIXL's libnixl.so; the Python conformance suite
# against gixl and against NIXL (including the fault matrix and hostile-input tests); the typed stubs
# (mypy.stubtest); the two-process demo; the C tests under valgrind; a short soak; the Python extension's
# exports; replacing NVIDIA's nixl-cu12 with gixl in a fresh virtualenv and back (scripts/swap-test.sh);
# the documentation's relative links (scripts/check-links.py); and that no must-run test skipped on CI. Ends with passed / failed / skipped per suite.
#
# Skips: a Rust test that cannot run here calls tests/common::skip, which appends a line to $GIXL_SKIP_LOG;
# pytest and the C runner count their own. With CI=true, a skip in the must-run set (network namespaces,
# etcd, the CMA fall-back, io_uring, the Prometheus scrape, libfabric, loop devices, real-time scheduling, Garage,
# the TCPStore tests' torch master) fails the run.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

passed=0
failed=0
failures=()
logs="$root/target/test-all"
mkdir -p "$logs"
# Every skip a Rust test records (tests/common::skip, util::test_skip) lands here, one line each.
export GIXL_SKIP_LOG="$logs/skips.txt"
: >"$GIXL_SKIP_LOG"
# Per-suite counts, one line each: "<suite>|<passed>|<failed>|<skipped>|<note>".
counts="$logs/counts.txt"
: >"$counts"
# Bounds, so that a hung or crawling step shows up as a failed step in the summary instead of CI's own timeout
# (90 minutes) with no summary at all: each step gets at most $GIXL_STEP_LIMIT_S seconds, and no step starts
# after $GIXL_DEADLINE_S seconds from the start of this script (setup included).
step_limit=${GIXL_STEP_LIMIT_S:-1800}
deadline=${GIXL_DEADLINE_S:-4500}
step() {
    local name="$1"
    shift
    echo
    echo "=== $name"
    local t0=$SECONDS limit=$step_limit
    if ((SECONDS >= deadline)); then
        failed=$((failed + 1))
        failures+=("$name (not started: ${deadline} s had passed)")
        echo "=== $name: NOT STARTED (${SECONDS} s into the run, past the ${deadline} s deadline)"
        return
    fi
    ((deadline - SECONDS < limit)) && limit=$((deadline - SECONDS + 60))
    # The step's functions run in a child bash (exported below), under timeout(1), which ends the whole group.
    if timeout -k 30 "$limit" bash -c '"$@"' step "$@"; then
        passed=$((passed + 1))
        echo "=== $name: ok ($((SECONDS - t0)) s)"
    else
        failed=$((failed + 1))
        failures+=("$name")
        echo "=== $name: FAILED ($((SECONDS - t0)) s$( ((SECONDS - t0 >= limit)) && echo ", stopped at its ${limit} s limit"))"
    fi
}
# Run a suite with its output shown and kept in $logs/<tag>.log; returns the suite's status.
logged() {
    local tag="$1"
    shift
    "$@" 2>&1 | tee "$logs/$tag.log"
    return "${PIPESTATUS[0]}"
}
# cargo test: sum libtest's "test result:" lines; skips are the lines the tests recorded.
count_cargo() {
    local p f i s
    p=$(grep -o '[0-9]* passed;' "$logs/cargo.log" | awk '{n += $1} END {print n + 0}')
    f=$(grep -o '[0-9]* failed;' "$logs/cargo.log" | awk '{n += $1} END {print n + 0}')
    i=$(grep -o '[0-9]* ignored;' "$logs/cargo.log" | awk '{n += $1} END {print n + 0}')
    s=$(grep -c '^SKIPPED: ' "$GIXL_SKIP_LOG")
    echo "cargo test|$p|$f|$s|$i ignored (throughput runs, on demand); libtest also counts a skipped test as passed" >>"$counts"
}
# ffi-tests/run.sh ends with "N passed, M failed (K skipped)".
count_c() {
    local line
    line=$(grep -E '^[0-9]+ passed, [0-9]+ failed \([0-9]+ skipped\)$' "$logs/$1.log" | tail -n 1)
    [ -n "$line" ] || line="0 passed, 1 failed (0 skipped)"
    # shellcheck disable=SC2086
    set -- "$2" $line
    echo "$1|$2|$4|${6#(}|" >>"$counts"
}
# pytest -q ends with "N passed, M skipped, K failed in ...".
count_py() {
    local line p f s
    line=$(grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|errors?|deselected)\b.* in [0-9.]+s' "$logs/$1.log" | tail -n 1)
    p=$(grep -oE '[0-9]+ passed' <<<"$line" | grep -oE '[0-9]+' || echo 0)
    f=$(grep -oE '[0-9]+ (failed|error)' <<<"$line" | grep -oE '[0-9]+' | awk '{n += $1} END {print n + 0}')
    s=$(grep -oE '[0-9]+ skipped' <<<"$line" | grep -oE '[0-9]+' || echo 0)
    [ -n "$line" ] || f=1
    echo "$2|$p|$f|$s|" >>"$counts"
}

scripts/setup.sh || { echo "setup failed"; exit 1; }

nixl_site() { ls -d .venv/nixl/lib/python3*/site-packages | head -n 1; }

rust_tests() {
    # The `rdma` feature is on by default: its bindings are checked against the header of the rdma-core that
    # setup.sh unpacked (the library itself is opened in rust_rdma, whose LD_LIBRARY_PATH the oracle must not see).
    GIXL_RDMA_CORE="$HOME/.cache/gixl/rdma-core" logged cargo cargo test --workspace --release
    local rc=$?
    count_cargo
    return $rc
}
rust_cuda() {
    # The `cuda` feature (cudarc; the driver is loaded at run time, so this builds and runs without CUDA) over
    # the fake device layer: lint, the VRAM route's unit and multi-process tests (incl. the no-driver
    # NOT_SUPPORTED path), the GDS backends' VRAM <-> FILE round trips, and the GPU check program as a dry run.
    cargo clippy --release --features cuda --lib --example gpu_check -- -D warnings &&
        cargo test --release --features cuda --lib --test vram --test vram_tcp --test gds -- vram &&
        GIXL_FAKE_DEVICE=1 GIXL_ITERS=2 GIXL_FAKE_VERBS=2 GIXL_FAKE_VERBS_DIR="${TMPDIR:-/tmp}/gixl-gpu-check-fv-$$" \
            timeout 180 cargo run -q --release --features cuda --example gpu_check
}
rust_rdma() {
    # The `rdma` feature: the verbs layer over the fake fabric (multi-process), rdma-core's layout against
    # the bindings, the real library's no-device path (rdma-core unpacked by setup.sh, opened by path), and no
    # load-time dependency on libibverbs (the feature's library, and the wheel's extension as installed).
    local rdma_lib="$HOME/.cache/gixl/rdma-core/usr/lib/x86_64-linux-gnu"
    cargo clippy --release --features rdma --lib --test verbs_abi --test verbs_fake -- -D warnings &&
        cargo test --release --features rdma --lib verbs &&
        GIXL_RDMA_CORE="$HOME/.cache/gixl/rdma-core" GIXL_LIBIBVERBS="$rdma_lib/libibverbs.so.1" \
            LD_LIBRARY_PATH="$rdma_lib:$HOME/.cache/gixl/rdma-core/lib/x86_64-linux-gnu" cargo test --release --features rdma --test verbs_fake --test verbs_abi &&
        cargo build --release --features rdma --lib || return 1
    if ldd target/release/libgixl.so | grep -qE 'ibverbs|libfabric'; then
        echo "libgixl.so built with the rdma feature links libibverbs or libfabric at load time:"
        ldd target/release/libgixl.so
        return 1
    fi
    echo "libgixl.so (rdma feature) needs no libibverbs to load: $(ldd target/release/libgixl.so | wc -l) libraries"
    local ext
    ext=$(ls .venv/gixl/lib/python3*/site-packages/gixl/_gixl*.so 2>/dev/null | head -n 1)
    if [ -z "$ext" ]; then
        echo "the wheel's extension is not installed in .venv/gixl (scripts/setup.sh): cannot check it"
        return 1
    fi
    if ldd "$ext" | grep -qE 'ibverbs|libfabric'; then
        echo "the wheel's extension links libibverbs or libfabric at load time:"
        ldd "$ext"
        return 1
    fi
    echo "the wheel's extension ($ext) needs neither libibverbs nor libfabric to load"
}
rust_libfabric2() {
    # The libfabric tests again over libfabric 2.1.0 (scripts/setup.sh builds it; `cargo test` ran them over
    # Debian's 1.17): the bindings against 2.1's headers, API 1.20, GPU memory registered as dma-buf.
    GIXL_LIBFABRIC_ROOT="$HOME/.cache/gixl/libfabric-2.1.0" \
        cargo test --release --test fabric --test fabric_route --test fabric_vram -- --nocapture 2>&1 |
        grep -vE '^gixl (INFO|DEBUG)'
    return "${PIPESTATUS[0]}"
}
rust_lint() {
    # A machine without the tools must not pass this step by accident.
    if ! cargo fmt --version >/dev/null 2>&1; then
        echo "rustfmt is NOT installed: rustup component add rustfmt (this step fails without it)"
        return 1
    fi
    if ! cargo clippy --version >/dev/null 2>&1; then
        echo "clippy is NOT installed: rustup component add clippy (this step fails without it)"
        return 1
    fi
    cargo fmt --all --check && cargo clippy --workspace --all-targets --release -- -D warnings &&
        python3 scripts/module-cycles.py
}
# The Python extension is loaded by Python only: it must not export NIXL's C ABI as well (it is built
# without the gixl crate's `capi` feature).
py_exports() {
    local so n
    so=$(.venv/gixl/bin/python -c "import gixl._gixl as m; print(m.__file__)") || return 1
    n=$(nm -D --defined-only "$so" | grep -c ' T nixl_capi_')
    echo "$(basename "$so") exports $n nixl_capi_* functions (must be 0)"
    [ "$n" -eq 0 ]
}
# On CI (root, Linux) the tests that need namespaces, etcd, another uid or io_uring must have run.
must_run() {
    local must
    must=$(grep -E '^SKIPPED: .* \[(netns|etcd|cma|io_uring|prometheus|libfabric|loopdev|sched)\]: ' "$GIXL_SKIP_LOG")
    # pytest's own skips (-rs lines) of the Python etcd, TCPStore and Garage (OBJ) tests count too, and the
    # C++ TCPStore test's skip (no torch for its master).
    local py
    py=$({ grep -hE '^SKIPPED \[[0-9]+\] .*(test_etcd|test_obj|test_tcpstore.*no torch)' "$logs"/py-gixl.log
        grep -hE '^SKIPPED \[[0-9]+\] .*(test_obj.*\[garage\]|test_tcpstore.*no torch)' "$logs"/py-nixl.log
        grep -hE '^skip t_tcpstore' "$logs"/cpp-gixl.log "$logs"/cpp-nixl.log; } 2>/dev/null)
    [ -n "$py" ] && must=$(printf '%s\n%s' "$must" "$py")
    [ -n "$must" ] && printf 'must-run tests skipped:\n%s\n' "$must"
    if [ "${CI:-}" = "true" ] && [ -n "$must" ]; then
        echo "CI=true: these tests must run here (root, Linux, etcd, io_uring, loop devices, SCHED_FIFO, garage, torch); failing"
        return 1
    fi
    echo "must-run set (netns, etcd, cma, io_uring, prometheus, libfabric, loopdev, sched, garage, tcpstore): $(grep -c . <<<"${must}") skipped"
}
header() { scripts/check-header.sh; }
capi_exports() {
    scripts/build-capi.sh --release || return 1
    local n
    n=$(nm -D --defined-only target/capi/libnixl_capi.so | grep -c ' T nixl_capi_')
    echo "libnixl_capi.so exports $n nixl_capi_* functions (NIXL 1.5.1 has 104)"
    [ "$n" -eq 104 ]
}
ffi_gixl() {
    FFI_CONSUMER=1 FFI_BUILD_DIR="$root/target/ffi-gixl" logged c-gixl ffi-tests/run.sh "$root/target/capi" "$root/include"
    local rc=$?
    count_c c-gixl "C tests vs gixl"
    return $rc
}
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
    GIXL_ORACLE=nixl FFI_BUILD_DIR="$root/target/ffi-nixl" logged c-nixl \
        ffi-tests/run.sh "$root/$(nixl_site)/.nixl_cu12.mesonpy.libs" "$decls"
    local rc=$?
    count_c c-nixl "C tests vs NIXL"
    return $rc
}
py_gixl() {
    GIXL_TEST_INSTALLED=1 logged py-gixl .venv/gixl/bin/python -m pytest -q -rs python/tests --impl gixl -p no:cacheprovider
    local rc=$?
    count_py py-gixl "Python vs gixl"
    return $rc
}
py_nixl() {
    logged py-nixl .venv/nixl/bin/python -m pytest -q -rs python/tests --impl nixl_cu12 -p no:cacheprovider
    local rc=$?
    count_py py-nixl "Python vs NIXL"
    return $rc
}
cpp_gixl() {
    CPP_BUILD_DIR="$root/target/cpp-gixl" logged cpp-gixl ffi-tests/cpp/run.sh "$root/target/capi" "$root/target/capi/include"
    local rc=$?
    count_c cpp-gixl "C++ tests vs gixl"
    return $rc
}
cpp_nixl() {
    # The same C++ programs built against NIXL's libnixl.so (our headers in declaration-only mode, NIXL 1.5.1's layouts).
    CPP_ORACLE=nixl CPP_BUILD_DIR="$root/target/cpp-nixl" logged cpp-nixl \
        ffi-tests/cpp/run.sh "$root/$(nixl_site)/.nixl_cu12.mesonpy.libs" "$root/include/nixl"
    local rc=$?
    count_c cpp-nixl "C++ tests vs NIXL"
    return $rc
}
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
# Every relative link and #anchor in README.md and docs/*.md resolves; the checker first proves it fails on
# planted broken links.
docs_links() { python3 scripts/check-links.py --self-test && python3 scripts/check-links.py; }
soak_quick() { GIXL_TEST_INSTALLED=1 timeout 300 .venv/gixl/bin/python python/tests/soak.py --quick; }

echo "setup took ${SECONDS} s"
export root logs counts
# shellcheck disable=SC2046
export -f $(declare -F | awk '{print $3}')
step "rustfmt + clippy -D warnings + module cycles" rust_lint
step "cargo test" rust_tests
step "cargo test --features cuda (fake device layer)" rust_cuda
step "cargo test --features rdma (fake verbs, rdma-core ABI, no load-time libibverbs)" rust_rdma
step "libfabric 2.1 (built from source): the libfabric tests again" rust_libfabric2
step "header compiles alone (C11, C++17)" header
step "C library exports" capi_exports
step "C tests + nixl-sys consumer vs gixl" ffi_gixl
step "C tests vs NIXL 1.5.1" ffi_nixl
step "C++ drop-in tests (nixl.h) vs gixl" cpp_gixl
step "C++ drop-in tests vs NIXL 1.5.1 (libnixl.so)" cpp_nixl
step "Python conformance vs gixl" py_gixl
step "Python conformance vs NIXL 1.5.1" py_nixl
step "type stubs (mypy.stubtest)" stubs
step "two-process demo" demo
step "vLLM call sequence: same output on gixl and NIXL" vllm_sequence
step "C tests under valgrind (memcheck)" valgrind_c
step "soak: 1000 cycles, 20 peer restarts, RSS and fds flat" soak_quick
step "Python extension exports no C ABI" py_exports
step "NIXL -> gixl swap and back in a fresh virtualenv" scripts/swap-test.sh
step "documentation links (README.md, docs/)" docs_links
step "must-run tests ran (fails on CI=true if any skipped)" must_run

echo
echo "=== tests per suite (skipped tests are listed above with their reason)"
printf '%-22s %8s %8s %8s  %s\n' suite passed failed skipped note
while IFS='|' read -r suite p f s note; do
    printf '%-22s %8s %8s %8s  %s\n' "$suite" "$p" "$f" "$s" "$note"
done <"$counts"
if [ -s "$GIXL_SKIP_LOG" ]; then
    echo "Rust skips:"
    sed 's/^/  /' "$GIXL_SKIP_LOG"
fi

echo
for f in "${failures[@]}"; do echo "failed step: $f"; done
echo "steps: $passed passed, $failed failed (${SECONDS} s, setup included)"
[ "$failed" -eq 0 ]
