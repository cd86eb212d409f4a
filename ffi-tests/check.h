/*
 * check.h - tiny check harness for the gixl C-API tests.
 *
 * Every check prints exactly one line:
 *   "ok   <suite>: <text>"
 *   "FAIL <suite>: <text>: got <x>, expected <y> (<file>:<line>)"
 *   "skip <suite>: <text> (<reason>)"
 * and ft_end() prints "# <suite>: N passed, M failed, K skipped" and returns
 * the process exit code (non-zero when anything failed).
 *
 * Oracle mode: when the environment variable GIXL_ORACLE is "nixl" (or the
 * file is compiled with -DGIXL_ORACLE_NIXL), checks guarded by gixl_only()
 * are skipped.  They cover calls that are undefined behaviour (crashes,
 * use-after-free) in real NIXL but must return an error code in gixl.
 */
#ifndef GIXL_FFI_CHECK_H
#define GIXL_FFI_CHECK_H

#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gixl.h"

static struct {
    const char *suite;
    int pass;
    int fail;
    int skip;
} ft;

static inline void ft_begin(const char *suite)
{
    /* Unbuffered, so lines survive an abort or a sanitizer report. */
    setvbuf(stdout, NULL, _IONBF, 0);
    ft.suite = suite;
    ft.pass = ft.fail = ft.skip = 0;
}

static inline bool ft_oracle_is_nixl(void)
{
#ifdef GIXL_ORACLE_NIXL
    return true;
#else
    const char *o = getenv("GIXL_ORACLE");
    return o && strcmp(o, "nixl") == 0;
#endif
}

static inline const char *ft_status_name(int s)
{
    switch (s) {
    case 1: return "IN_PROG";
    case 0: return "SUCCESS";
    case -1: return "INVALID_PARAM";
    case -2: return "BACKEND";
    case -3: return "INVALID_STATE";
    case -4: return "EXCEPTION";
    case -5: return "NO_TELEMETRY";
    case -6: return "NOT_FOUND";
    default: return "?";
    }
}

static inline void ft_line(const char *tag, const char *fmt, va_list ap)
{
    printf("%s %s: ", tag, ft.suite ? ft.suite : "?");
    vprintf(fmt, ap);
}

static inline void ft_ok(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    ft_line("ok  ", fmt, ap);
    va_end(ap);
    printf("\n");
    ft.pass++;
}

static inline void ft_bad(const char *file, int line, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    ft_line("FAIL", fmt, ap);
    va_end(ap);
    printf(" (%s:%d)\n", file, line);
    ft.fail++;
}

static inline void ft_skipped(const char *why, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    ft_line("skip", fmt, ap);
    va_end(ap);
    printf(" (%s)\n", why);
    ft.skip++;
}

static inline bool ft_check_status(int got, int want, const char *expr, const char *file, int line)
{
    if (got == want) {
        ft_ok("%s == %d %s", expr, want, ft_status_name(want));
        return true;
    }
    ft_bad(file, line, "%s: got %d %s, expected %d %s", expr, got, ft_status_name(got), want,
           ft_status_name(want));
    return false;
}

static inline bool ft_check_status2(int got, int want1, int want2, const char *expr,
                                    const char *file, int line)
{
    if (got == want1 || got == want2) {
        ft_ok("%s == %d %s (accepts %d or %d)", expr, got, ft_status_name(got), want1, want2);
        return true;
    }
    ft_bad(file, line, "%s: got %d %s, expected %d or %d", expr, got, ft_status_name(got), want1,
           want2);
    return false;
}

static inline bool ft_check_error(int got, const char *expr, const char *file, int line)
{
    if (got < 0) {
        ft_ok("%s is an error (%d %s)", expr, got, ft_status_name(got));
        return true;
    }
    ft_bad(file, line, "%s: got %d %s, expected an error (< 0)", expr, got, ft_status_name(got));
    return false;
}

static inline bool ft_check_cond(bool c, const char *text, const char *file, int line)
{
    if (c) {
        ft_ok("%s", text);
        return true;
    }
    ft_bad(file, line, "%s: condition is false", text);
    return false;
}

/* CHECK_ST(expected, call): the call must return exactly `expected`. */
#define CHECK_ST(want, call) ft_check_status((int)(call), (int)(want), #call, __FILE__, __LINE__)
/* CHECK_ST2(a, b, call): the call may return either status (e.g. 0 or IN_PROG). */
#define CHECK_ST2(w1, w2, call) \
    ft_check_status2((int)(call), (int)(w1), (int)(w2), #call, __FILE__, __LINE__)
/* CHECK_ERR(call): any negative status; used only for gixl-only checks. */
#define CHECK_ERR(call) ft_check_error((int)(call), #call, __FILE__, __LINE__)
/* CHECK(cond, text): a boolean property; the text names it. */
#define CHECK(cond, text) ft_check_cond((cond) ? true : false, (text), __FILE__, __LINE__)

/* REQUIRE_*: like CHECK_*, but a failure ends the test (setup steps). */
#define REQUIRE_ST(want, call)                  \
    do {                                        \
        if (!CHECK_ST(want, call))              \
            exit(ft_abort_suite(#call));        \
    } while (0)
#define REQUIRE(cond, text)                     \
    do {                                        \
        if (!CHECK(cond, text))                 \
            exit(ft_abort_suite(text));         \
    } while (0)

static inline int ft_end(void)
{
    printf("# %s: %d passed, %d failed, %d skipped\n", ft.suite, ft.pass, ft.fail, ft.skip);
    return ft.fail ? 1 : 0;
}

static inline int ft_abort_suite(const char *what)
{
    printf("# %s: aborting after failed setup step: %s\n", ft.suite, what);
    ft_end();
    return 1;
}

/*
 * gixl_only(what): true when the guarded checks should run.  On real NIXL it
 * prints a skip line and returns false.  Use it as:
 *     if (gixl_only("double destroy of an xfer request")) { CHECK_ERR(...); }
 */
static inline bool gixl_only(const char *what)
{
    if (ft_oracle_is_nixl()) {
        ft_skipped("gixl-only: undefined behaviour in NIXL", "%s", what);
        return false;
    }
    return true;
}

#endif /* GIXL_FFI_CHECK_H */
