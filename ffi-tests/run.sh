#!/usr/bin/env bash
# ffi-tests/run.sh LIB_DIR INCLUDE_DIR
#
# Builds the C-API tests with AddressSanitizer + UBSan against the
# libnixl_capi.so found in LIB_DIR and the header gixl.h found in INCLUDE_DIR,
# runs them, and prints "N passed, M failed (K skipped)".  Exit status is
# non-zero when any check failed or any test binary crashed.
#
# Environment:
#   GIXL_ORACLE=nixl   LIB_DIR holds real NVIDIA NIXL.  Checks that are
#                      undefined behaviour in NIXL (use after release/destroy,
#                      double release of a dlist handle, NULL out-pointers that
#                      NIXL writes through, ...) are skipped; on gixl they must
#                      return an error code.  Also turns LeakSanitizer off,
#                      because NIXL and UCX leak on their own at exit.
#   FFI_LIBNAME=name   link against lib<name>.so instead of libnixl_capi.so.
#   FFI_BUILD_DIR=dir  build directory (default: ffi-tests/build).
#   FFI_TESTS="t_a t_b" run only these tests.
#   FFI_TIMEOUT=secs   per-test time limit (default 180).
#   FFI_CONSUMER=1     also build and run nixl-sys-consumer/ (needs cargo,
#                      network access for crates, and libclang for bindgen).
#
# Sanitizers and real NIXL: the test executables link libasan themselves, so
# no LD_PRELOAD is needed; NIXL's dlopen() of its plugins works under ASan.
# With NIXL, leak detection must be off (detect_leaks=0).  Anything already in
# ASAN_OPTIONS / UBSAN_OPTIONS is kept and takes precedence.
set -u

usage() {
    echo "usage: $0 LIB_DIR INCLUDE_DIR" >&2
    exit 2
}
[ $# -eq 2 ] || usage

here="$(cd "$(dirname "$0")" && pwd)"
lib_dir="$(cd "$1" && pwd)" || usage
inc_dir="$(cd "$2" && pwd)" || usage
libname="${FFI_LIBNAME:-nixl_capi}"
build="${FFI_BUILD_DIR:-$here/build}"
timeout_s="${FFI_TIMEOUT:-180}"
tests="${FFI_TESTS:-t_basic t_dlist t_metadata t_xfer t_telemetry t_nullargs t_two_process t_hostile t_exact}"

if [ ! -e "$lib_dir/lib$libname.so" ]; then
    echo "error: $lib_dir/lib$libname.so not found" >&2
    exit 2
fi
if [ ! -e "$inc_dir/gixl.h" ]; then
    echo "error: $inc_dir/gixl.h not found" >&2
    exit 2
fi

oracle="${GIXL_ORACLE:-gixl}"
if [ "$oracle" = "nixl" ]; then
    asan_default="detect_leaks=0"
else
    asan_default="detect_leaks=1"
fi
export ASAN_OPTIONS="${asan_default}:abort_on_error=0:${ASAN_OPTIONS:-}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:${UBSAN_OPTIONS:-}"
export GIXL_ORACLE="$oracle"

cc="${CC:-cc}"
cflags="-std=c11 -g -O1 -Wall -Wextra -fno-omit-frame-pointer -fsanitize=address,undefined"
ldflags="-L$lib_dir -l$libname -Wl,-rpath-link,$lib_dir -Wl,--allow-shlib-undefined"

mkdir -p "$build"
echo "# ffi-tests: lib=$lib_dir/lib$libname.so include=$inc_dir/gixl.h oracle=$oracle"

pass=0
fail=0
skip=0

for t in $tests; do
    src="$here/$t.c"
    exe="$build/$t"
    if ! $cc $cflags -I"$inc_dir" -I"$here" "$src" -o "$exe" $ldflags 2>"$build/$t.build.log"; then
        cat "$build/$t.build.log"
        echo "FAIL $t: build failed"
        fail=$((fail + 1))
        continue
    fi
    [ -s "$build/$t.build.log" ] && cat "$build/$t.build.log"

    log="$build/$t.log"
    LD_LIBRARY_PATH="$lib_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
        timeout -k 10 "$timeout_s" "$exe" >"$log" 2>"$build/$t.stderr"
    rc=$?
    cat "$log"
    p=$(grep -c '^ok  ' "$log")
    f=$(grep -c '^FAIL' "$log")
    s=$(grep -c '^skip' "$log")
    pass=$((pass + p))
    fail=$((fail + f))
    skip=$((skip + s))
    if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then
        echo "FAIL $t: exited with status $rc without a failed check (crash, sanitizer report or timeout); stderr tail:"
        tail -n 30 "$build/$t.stderr" | sed 's/^/    /'
        fail=$((fail + 1))
    elif [ "$rc" -ne 0 ]; then
        echo "# $t: exit status $rc; stderr in $build/$t.stderr"
    fi
done

if [ "${FFI_CONSUMER:-0}" = "1" ]; then
    echo "# nixl-sys-consumer"
    if (cd "$here/nixl-sys-consumer" && cargo build -q 2>"$build/consumer.build.log"); then
        if LD_LIBRARY_PATH="$lib_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
            timeout -k 10 "$timeout_s" "$here/nixl-sys-consumer/target/debug/nixl-sys-consumer" \
            >"$build/consumer.log" 2>&1; then
            echo "ok   nixl-sys-consumer"
            pass=$((pass + 1))
        else
            cat "$build/consumer.log"
            echo "FAIL nixl-sys-consumer"
            fail=$((fail + 1))
        fi
    else
        cat "$build/consumer.build.log"
        echo "FAIL nixl-sys-consumer: build failed"
        fail=$((fail + 1))
    fi
fi

echo "$pass passed, $fail failed ($skip skipped)"
[ "$fail" -eq 0 ]
