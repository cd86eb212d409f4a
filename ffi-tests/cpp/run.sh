#!/usr/bin/env bash
# ffi-tests/cpp/run.sh LIB_DIR INCLUDE_DIR
#
# Builds the C++ drop-in tests (C++17, -Wall -Wextra -Werror, ASan + UBSan) with -I INCLUDE_DIR (the folder
# holding nixl.h) against LIB_DIR/libgixl.so, runs them, and prints "N passed, M failed".
#   CPP_TESTS="t_a t_b"  run only these.   CPP_BUILD_DIR=dir  build folder (default ffi-tests/cpp/build).
set -u
[ $# -eq 2 ] || { echo "usage: $0 LIB_DIR INCLUDE_DIR" >&2; exit 2; }
here="$(cd "$(dirname "$0")" && pwd)"
lib_dir="$(cd "$1" && pwd)" || exit 2
inc_dir="$(cd "$2" && pwd)" || exit 2
build="${CPP_BUILD_DIR:-$here/build}"
tests="${CPP_TESTS:-t_api t_example t_two_process}"
libname="${CPP_LIBNAME:-gixl}"
[ -e "$inc_dir/nixl.h" ] || { echo "error: $inc_dir/nixl.h not found" >&2; exit 2; }
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:${ASAN_OPTIONS:-}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:${UBSAN_OPTIONS:-}"
cxx="${CXX:-c++}"
flags="-std=c++17 -g -O1 -Wall -Wextra -Werror -fno-omit-frame-pointer -fsanitize=address,undefined"
mkdir -p "$build"
echo "# cpp tests: include=$inc_dir lib=$lib_dir/lib$libname.so"
pass=0
fail=0
for t in $tests; do
    exe="$build/$t"
    if ! $cxx $flags -I"$inc_dir" "$here/$t.cpp" -o "$exe" -L"$lib_dir" -l"$libname" -Wl,-rpath,"$lib_dir" \
        2>"$build/$t.build.log"; then
        cat "$build/$t.build.log"
        echo "FAIL $t: build failed"
        fail=$((fail + 1))
        continue
    fi
    log="$build/$t.log"
    timeout -k 10 300 "$exe" >"$log" 2>"$build/$t.stderr"
    rc=$?
    cat "$log"
    p=$(grep -c '^ok  ' "$log")
    f=$(grep -c '^FAIL' "$log")
    pass=$((pass + p))
    fail=$((fail + f))
    if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then
        echo "FAIL $t: exited with status $rc without a failed check; stderr tail:"
        tail -n 30 "$build/$t.stderr" | sed 's/^/    /'
        fail=$((fail + 1))
    fi
done
echo "$pass passed, $fail failed (0 skipped)"
[ "$fail" -eq 0 ]
