#!/usr/bin/env bash
# scripts/valgrind.sh [TEST...] — C tests from ffi-tests/ under valgrind (memcheck), built WITHOUT sanitizers,
# against gixl's target/capi/libnixl_capi.so (built first with scripts/build-capi.sh).
#
# Default tests: t_xfer (two agents in one process: transfers, notifications, stale handles, released
# handles) and t_hostile (garbage descriptors, indices and metadata). Any memcheck error (invalid read/write,
# use of uninitialised values, a definite leak) fails the run (--error-exitcode=1). "Possibly lost" blocks are
# reported but not errors: they are process-wide statics (registries in hashbrown tables, which point into the
# middle of their allocation, and the std thread handle), still reachable through interior pointers.
# Environment: VALGRIND_TIMEOUT (per test, default 600 s), VALGRIND_ARGS (extra valgrind options).
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
command -v valgrind >/dev/null || { echo "valgrind not installed (apt-get install valgrind)"; exit 2; }
scripts/build-capi.sh >/dev/null || exit 1
lib="$root/target/capi"
build="$root/target/valgrind"
mkdir -p "$build"
tests=("$@")
[ ${#tests[@]} -eq 0 ] && tests=(t_xfer t_hostile)
rc=0
for t in "${tests[@]}"; do
    cc -std=c11 -g -O1 -Wall -Wextra -I"$root/include" -I"$root/ffi-tests" "ffi-tests/$t.c" -o "$build/$t" \
        -L"$lib" -lnixl_capi || { echo "FAIL $t: build"; rc=1; continue; }
    log="$build/$t.valgrind.log"
    LD_LIBRARY_PATH="$lib" timeout -k 10 "${VALGRIND_TIMEOUT:-600}" valgrind --error-exitcode=1 --leak-check=full \
        --errors-for-leak-kinds=definite --show-leak-kinds=definite,possible --track-fds=no \
        --log-file="$log" ${VALGRIND_ARGS:-} "$build/$t" >"$build/$t.out" 2>&1
    s=$?
    summary=$(grep -E "ERROR SUMMARY|definitely lost:|possibly lost:" "$log" | sed 's/^==[0-9]*== *//' | tr '\n' ';')
    checks=$(tail -n 1 "$build/$t.out")
    if [ $s -eq 0 ]; then
        echo "ok   $t under valgrind: $checks | $summary"
    else
        echo "FAIL $t under valgrind (exit $s): $checks | $summary (log: $log)"
        rc=1
    fi
done
exit $rc
