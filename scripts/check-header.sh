#!/usr/bin/env bash
# scripts/check-header.sh
#
# Compiles include/gixl.h on its own as C11 (gcc) and C++17 (g++) with -Wall -Wextra -Werror (plus
# -pedantic), and checks a few layout and value facts NIXL's C API promises. Does not need the library.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

cat >"$tmp/check.c" <<'SRC'
#include "gixl.h"
#include "gixl.h" /* the include guard works */

#ifdef __cplusplus
#define STATIC_ASSERT static_assert
#else
#define STATIC_ASSERT _Static_assert
#endif

STATIC_ASSERT(sizeof(nixl_capi_agent_config_t) == 40, "nixl_capi_agent_config_t is 40 bytes");
STATIC_ASSERT(sizeof(struct nixl_capi_xfer_telemetry_s) == 40, "telemetry struct is 5 x uint64_t");
STATIC_ASSERT(NIXL_CAPI_SUCCESS == 0 && NIXL_CAPI_IN_PROG == 1, "success / in progress");
STATIC_ASSERT(NIXL_CAPI_ERROR_INVALID_PARAM == -1 && NIXL_CAPI_ERROR_BACKEND == -2, "errors");
STATIC_ASSERT(NIXL_CAPI_ERROR_INVALID_STATE == -3 && NIXL_CAPI_ERROR_EXCEPTION == -4, "errors");
STATIC_ASSERT(NIXL_CAPI_ERROR_NO_TELEMETRY == -5 && NIXL_CAPI_ERROR_NOT_FOUND == -6, "errors");
STATIC_ASSERT(NIXL_CAPI_MEM_FILE == 4 && NIXL_CAPI_MEM_UNKNOWN == 5, "memory types");
STATIC_ASSERT(NIXL_CAPI_THREAD_SYNC_DEFAULT == NIXL_CAPI_THREAD_SYNC_NONE, "default sync mode");
STATIC_ASSERT(NIXL_CAPI_XFER_OP_WRITE == 1 && NIXL_CAPI_COST_ANALYTICAL_BACKEND == 0, "ops");

/* Enumerators have their enum's type (C++ rejects an int here). */
static nixl_capi_thread_sync_t default_sync(void) { nixl_capi_thread_sync_t s = NIXL_CAPI_THREAD_SYNC_DEFAULT; return s; }

/* Every function is declared with the expected signature (a mismatch fails to compile). */
nixl_capi_status_t (*check_create)(const char *, nixl_capi_agent_t *) = nixl_capi_create_agent;
nixl_capi_status_t (*check_make)(nixl_capi_agent_t, nixl_capi_xfer_op_t, nixl_capi_xfer_dlist_handle_t,
                                 const int *, size_t, nixl_capi_xfer_dlist_handle_t, const int *, size_t,
                                 nixl_capi_xfer_req_t *, nixl_capi_opt_args_t) = nixl_capi_make_xfer_req;
nixl_capi_status_t (*check_telemetry)(nixl_capi_agent_t, nixl_capi_xfer_req_t,
                                      nixl_capi_xfer_telemetry_t) = nixl_capi_get_xfer_telemetry;
bool (*check_stub)(void) = nixl_capi_is_stub;
const char *(*check_last)(void) = gixl_last_error;

int gixl_header_check(void);
int gixl_header_check(void)
{
    return (int)default_sync();
}
SRC

cc="${CC:-gcc}"
cxx="${CXX:-g++}"
"$cc" -std=c11 -Wall -Wextra -Werror -pedantic -I"$root/include" -c "$tmp/check.c" -o "$tmp/c.o"
echo "ok   gixl.h compiles as C11 ($cc -std=c11 -Wall -Wextra -Werror -pedantic)"
cp "$tmp/check.c" "$tmp/check.cpp"
"$cxx" -std=c++17 -Wall -Wextra -Werror -pedantic -I"$root/include" -c "$tmp/check.cpp" -o "$tmp/cpp.o"
echo "ok   gixl.h compiles as C++17 ($cxx -std=c++17 -Wall -Wextra -Werror -pedantic)"
# The header alone, with nothing around it.
for std in c11:"$cc -x c" c++17:"$cxx -x c++"; do
    flag="${std%%:*}"
    comp="${std#*:}"
    echo '#include "gixl.h"' | $comp -std="$flag" -Wall -Wextra -Werror -I"$root/include" -fsyntax-only -
done
echo "ok   gixl.h alone (C11, C++17)"
# The C++ drop-in headers (include/nixl/), each alone and all together, as C++17 and C++20, pedantic; also
# in declaration-only mode (GIXL_NIXL_ORACLE), as built against NIXL's libnixl.so.
for h in nixl_types.h nixl_params.h nixl_descriptors.h serdes/serdes.h nixl.h; do
    for std in c++17 c++20; do
        for mode in "" -DGIXL_NIXL_ORACLE; do
            printf '#include <%s>\n#include <nixl.h>\n#include <%s>\n' "$h" "$h" |
                $cxx -x c++ -std=$std $mode -Wall -Wextra -Werror -pedantic -I"$root/include/nixl" -fsyntax-only -
        done
    done
done
echo "ok   include/nixl/*.h alone and together (C++17, C++20; with and without GIXL_NIXL_ORACLE)"
