/*
 * utils/common/nixl_time.h - the monotonic clock readings NIXL's install offers beside its API (nixlbench times
 * its runs with them): whole nanoseconds, microseconds, milliseconds or seconds of std::chrono::steady_clock.
 * Written for gixl; part of the NIXL install layout that scripts/build-capi.sh lays out (target/capi/nixl).
 */
#ifndef GIXL_NIXL_TIME_H
#define GIXL_NIXL_TIME_H

#include <chrono>
#include <cstdint>

namespace nixlTime {

using ns_t = uint64_t;
using us_t = uint64_t;
using ms_t = uint64_t;
using sec_t = uint64_t;

namespace detail {
template<class Unit>
inline uint64_t
since_epoch() {
    return static_cast<uint64_t>(
        std::chrono::duration_cast<Unit>(std::chrono::steady_clock::now().time_since_epoch()).count());
}
} // namespace detail

inline ns_t
getNs() {
    return detail::since_epoch<std::chrono::nanoseconds>();
}

inline us_t
getUs() {
    return detail::since_epoch<std::chrono::microseconds>();
}

inline ms_t
getMs() {
    return detail::since_epoch<std::chrono::milliseconds>();
}

inline sec_t
getSec() {
    return detail::since_epoch<std::chrono::seconds>();
}

} // namespace nixlTime

#endif
