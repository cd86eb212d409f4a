// check.hpp - check harness for the C++ drop-in tests (same output format as ../check.h):
// "ok   <suite>: <text>", "FAIL <suite>: <text>: got <x>, expected <y> (<file>:<line>)", and a closing
// "skip <suite>: <text> (<why>)" and a closing "# <suite>: N passed, M failed, K skipped". Written for gixl.
// Built with -DGIXL_NIXL_ORACLE the same programs run against NVIDIA NIXL's libnixl.so (see run.sh); checks
// of gixl's improvements (calls that are undefined behaviour in NIXL) are then skipped with GIXL_ONLY.
#pragma once
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>

#include <nixl.h>

namespace t {
inline const char *suite = "";
inline int pass = 0;
inline int fail = 0;
inline int skipped = 0;

#ifdef GIXL_NIXL_ORACLE
constexpr bool oracle = true;
#else
constexpr bool oracle = false;
#endif

inline void
skip(const std::string &text, const char *why) {
    printf("skip %s: %s (%s)\n", suite, text.c_str(), why);
    skipped++;
}

inline void
begin(const char *s) {
    setvbuf(stdout, nullptr, _IONBF, 0);
    suite = s;
}

inline void
check(bool ok, const std::string &text, const std::string &got, const std::string &want, const char *file, int line) {
    if (ok) {
        printf("ok   %s: %s\n", suite, text.c_str());
        pass++;
    } else {
        printf("FAIL %s: %s: got %s, expected %s (%s:%d)\n", suite, text.c_str(), got.c_str(), want.c_str(), file, line);
        fail++;
    }
}

inline int
end() {
    printf("# %s: %d passed, %d failed, %d skipped\n", suite, pass, fail, skipped);
    return fail ? 1 : 0;
}

inline std::string
name(nixl_status_t s) {
    return nixlEnumStrings::statusStr(s);
}

// Poll a request until it leaves IN_PROG (bounded: 30 s).
inline nixl_status_t
wait(nixlAgent &a, nixlXferReqH *r, nixl_status_t s) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (s == NIXL_IN_PROG && std::chrono::steady_clock::now() < until) {
        std::this_thread::sleep_for(std::chrono::microseconds(200));
        s = a.getXferStatus(r);
    }
    return s;
}

// Poll getNotifs until `from` has sent `msg` (bounded: 30 s).
inline bool
waitNotif(nixlAgent &a, const std::string &from, const std::string &msg) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    nixl_notifs_t m;
    while (std::chrono::steady_clock::now() < until) {
        if (a.getNotifs(m) != NIXL_SUCCESS) return false;
        for (const auto &n : m[from])
            if (n == msg) return true;
        std::this_thread::sleep_for(std::chrono::microseconds(500));
    }
    return false;
}

// Poll `f` until it returns `want`, for at most `secs` seconds; returns the last status.
template<class F>
inline nixl_status_t
until(nixl_status_t want, F f, int secs) {
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(secs);
    nixl_status_t st = f();
    while (st != want && std::chrono::steady_clock::now() < end) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
        st = f();
    }
    return st;
}

// The UCX backend with its plugin's default parameters, or nullptr when it cannot be created.
inline nixlBackendH *
ucx(nixlAgent &a) {
    nixl_mem_list_t m;
    nixl_b_params_t p;
    nixlBackendH *b = nullptr;
    if (a.getPluginParams("UCX", m, p) != NIXL_SUCCESS || a.createBackend("UCX", p, b) != NIXL_SUCCESS) return nullptr;
    return b;
}
} // namespace t

#define CHECK(cond, text) t::check((cond), (text), "false", "true", __FILE__, __LINE__)
#define CHECK_ST(want, expr)                                                                         \
    do {                                                                                             \
        const nixl_status_t got_ = (expr);                                                           \
        t::check(got_ == (want), #expr, t::name(got_), t::name(want), __FILE__, __LINE__);           \
    } while (0)

// A check of a gixl improvement: undefined behaviour (use after free, foreign handles) in NIXL, skipped there.
#define GIXL_ONLY(text, ...)                                                                         \
    do {                                                                                             \
        if (t::oracle)                                                                               \
            t::skip(text, "undefined behaviour in NIXL");                                            \
        else {                                                                                       \
            __VA_ARGS__;                                                                             \
        }                                                                                            \
    } while (0)
