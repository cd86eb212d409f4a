#!/usr/bin/env bash
# ffi-tests/cpp/run.sh LIB_DIR INCLUDE_DIR
#
# Builds the C++ drop-in tests (C++17, -Wall -Wextra -Werror, ASan + UBSan) with -I INCLUDE_DIR (the folder
# holding nixl.h) against LIB_DIR/libgixl.so, runs them, and prints "N passed, M failed".
#   CPP_TESTS="t_a t_b"  run only these.   CPP_BUILD_DIR=dir  build folder (default ffi-tests/cpp/build).
#   CPP_ORACLE=nixl      LIB_DIR holds NVIDIA NIXL's libraries: build with -DGIXL_NIXL_ORACLE (the headers then
#                        only declare, with NIXL 1.5.1's layouts) and link libnixl.so, libnixl_build.so and
#                        libserdes.so, so the same programs run against NIXL's C++ library. Checks of gixl's
#                        improvements are skipped; leak detection is off (NIXL and UCX leak at exit).
#   GIXL_TORCH_PYTHON=py the Python with torch that t_tcpstore starts its TCPStore master with (default: the
#                        checkout's .venv/torch, made by scripts/setup.sh; t_tcpstore skips without one).
set -u
[ $# -eq 2 ] || { echo "usage: $0 LIB_DIR INCLUDE_DIR" >&2; exit 2; }
here="$(cd "$(dirname "$0")" && pwd)"
lib_dir="$(cd "$1" && pwd)" || exit 2
inc_dir="$(cd "$2" && pwd)" || exit 2
build="${CPP_BUILD_DIR:-$here/build}"
tests="${CPP_TESTS:-t_api t_outparams t_example t_two_process t_etcd t_tcpstore t_parity}"
export GIXL_TORCH_PYTHON="${GIXL_TORCH_PYTHON:-$(cd "$here/../.." && pwd)/.venv/torch/bin/python}"
libname="${CPP_LIBNAME:-gixl}"
[ -e "$inc_dir/nixl.h" ] || { echo "error: $inc_dir/nixl.h not found" >&2; exit 2; }
oracle="${CPP_ORACLE:-gixl}"
if [ "$oracle" = "nixl" ]; then
    libs="-lnixl -lnixl_build -lserdes"
    defs="-DGIXL_NIXL_ORACLE"
    leaks=0
else
    libs="-l$libname"
    defs=""
    leaks=1
fi
export ASAN_OPTIONS="detect_leaks=$leaks:abort_on_error=0:${ASAN_OPTIONS:-}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:${UBSAN_OPTIONS:-}"
cxx="${CXX:-c++}"
flags="-std=c++17 -g -O1 -Wall -Wextra -Werror -fno-omit-frame-pointer -fsanitize=address,undefined"
mkdir -p "$build"
echo "# cpp tests: include=$inc_dir lib=$lib_dir ($oracle)"
pass=0
fail=0
skip=0
for t in $tests; do
    exe="$build/$t"
    # shellcheck disable=SC2086
    if ! $cxx $flags $defs -I"$inc_dir" "$here/$t.cpp" -o "$exe" -L"$lib_dir" $libs -Wl,-rpath,"$lib_dir" \
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
    s=$(grep -c '^skip' "$log")
    skip=$((skip + s))
    pass=$((pass + p))
    fail=$((fail + f))
    if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then
        echo "FAIL $t: exited with status $rc without a failed check; stderr tail:"
        tail -n 30 "$build/$t.stderr" | sed 's/^/    /'
        fail=$((fail + 1))
    fi
done
echo "$pass passed, $fail failed ($skip skipped)"
[ "$fail" -eq 0 ]
