/*
 * nixl_types.h - gixl's C++ drop-in for NVIDIA NIXL 1.5.x: enums, aliases and option structs.
 *
 * Written for gixl (names and signatures follow NIXL's public C++ API so that programs written for it
 * compile unchanged). Header-only: everything is implemented in these headers over gixl's C ABI
 * (gixl.h, libgixl.so / libnixl_capi.so). See docs/drop-in.md, section "C++".
 */
#ifndef _NIXL_TYPES_H
#define _NIXL_TYPES_H

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

class nixlSerDes;
class nixlDlistH;
class nixlBackendH;
class nixlXferReqH;
class nixlAgentData;

enum nixl_mem_t { DRAM_SEG, VRAM_SEG, BLK_SEG, OBJ_SEG, FILE_SEG };

enum nixl_xfer_op_t { NIXL_READ, NIXL_WRITE };

enum nixl_status_t {
    NIXL_IN_PROG = 1,
    NIXL_SUCCESS = 0,
    NIXL_ERR_NOT_POSTED = -1,
    NIXL_ERR_INVALID_PARAM = -2,
    NIXL_ERR_BACKEND = -3,
    NIXL_ERR_NOT_FOUND = -4,
    NIXL_ERR_MISMATCH = -5,
    NIXL_ERR_NOT_ALLOWED = -6,
    NIXL_ERR_REPOST_ACTIVE = -7,
    NIXL_ERR_UNKNOWN = -8,
    NIXL_ERR_NOT_SUPPORTED = -9,
    NIXL_ERR_REMOTE_DISCONNECT = -10,
    NIXL_ERR_CANCELED = -11,
    NIXL_ERR_NO_TELEMETRY = -12
};

enum class nixl_thread_sync_t {
    NIXL_THREAD_SYNC_NONE,
    NIXL_THREAD_SYNC_STRICT,
    NIXL_THREAD_SYNC_RW,
    NIXL_THREAD_SYNC_DEFAULT = NIXL_THREAD_SYNC_NONE,
};

namespace nixlEnumStrings {
#ifndef GIXL_NIXL_ORACLE
// The same strings as NIXL's; values outside the enums give "BAD_SEG" / "BAD_OP" / "BAD_STATUS".
inline std::string
memTypeStr(const nixl_mem_t &mem) {
    static const char *const names[] = {"DRAM_SEG", "VRAM_SEG", "BLK_SEG", "OBJ_SEG", "FILE_SEG"};
    const int i = static_cast<int>(mem);
    return (i >= 0 && i <= 4) ? names[i] : "BAD_SEG";
}

inline std::string
xferOpStr(const nixl_xfer_op_t &op) {
    switch (op) {
    case NIXL_READ:
        return "READ";
    case NIXL_WRITE:
        return "WRITE";
    }
    return "BAD_OP";
}

inline std::string
statusStr(const nixl_status_t &status) {
    switch (status) {
    case NIXL_IN_PROG:
        return "NIXL_IN_PROG";
    case NIXL_SUCCESS:
        return "NIXL_SUCCESS";
    case NIXL_ERR_NOT_POSTED:
        return "NIXL_ERR_NOT_POSTED";
    case NIXL_ERR_INVALID_PARAM:
        return "NIXL_ERR_INVALID_PARAM";
    case NIXL_ERR_BACKEND:
        return "NIXL_ERR_BACKEND";
    case NIXL_ERR_NOT_FOUND:
        return "NIXL_ERR_NOT_FOUND";
    case NIXL_ERR_MISMATCH:
        return "NIXL_ERR_MISMATCH";
    case NIXL_ERR_NOT_ALLOWED:
        return "NIXL_ERR_NOT_ALLOWED";
    case NIXL_ERR_REPOST_ACTIVE:
        return "NIXL_ERR_REPOST_ACTIVE";
    case NIXL_ERR_UNKNOWN:
        return "NIXL_ERR_UNKNOWN";
    case NIXL_ERR_NOT_SUPPORTED:
        return "NIXL_ERR_NOT_SUPPORTED";
    case NIXL_ERR_REMOTE_DISCONNECT:
        return "NIXL_ERR_REMOTE_DISCONNECT";
    case NIXL_ERR_CANCELED:
        return "NIXL_ERR_CANCELED";
    case NIXL_ERR_NO_TELEMETRY:
        return "NIXL_ERR_NO_TELEMETRY";
    }
    return "BAD_STATUS";
}
#else
std::string
memTypeStr(const nixl_mem_t &mem);
std::string
xferOpStr(const nixl_xfer_op_t &op);
std::string
statusStr(const nixl_status_t &status);
#endif
} // namespace nixlEnumStrings

using nixl_backend_t = std::string;
using nixl_telemetry_plugin_t = std::string;
// Binary data (may hold NUL bytes); not text.
using nixl_blob_t = std::string;
using nixl_mem_list_t = std::vector<nixl_mem_t>;
using nixl_b_params_t = std::unordered_map<std::string, std::string>;
using nixl_notifs_t = std::unordered_map<std::string, std::vector<nixl_blob_t>>;

constexpr int default_comm_port = 8888;

#ifndef GIXL_NIXL_ORACLE
// The etcd label of an agent's full metadata.
inline const std::string default_metadata_label = "metadata";
#else
extern const std::string default_metadata_label;
#endif

enum class nixl_cost_t {
    ANALYTICAL_BACKEND = 0,
};

// One answer of queryMem: empty when the backend knows nothing of that descriptor.
using nixl_query_resp_t = std::optional<nixl_b_params_t>;

// Optional arguments of the agent's methods; a null pointer means all defaults.
struct nixlAgentOptionalArgs {
    // Limit the call to these backends (handles from createBackend / queryXferBackend).
    std::vector<nixlBackendH *> backends;
    // The notification sent with a transfer (createXferReq / makeXferReq / postXferReq), if set. Takes
    // precedence over the older pair below.
    std::optional<nixl_blob_t> notif;
    // The older form: notifMsg is sent when hasNotif is set.
    nixl_blob_t notifMsg;
    bool hasNotif = false;
    // Keep adjacent descriptors apart in makeXferReq.
    bool skipDescMerge = false;
    // getLocalPartialMD / sendLocalPartialMD: add the connection info of the backends used.
    bool includeConnInfo = false;
    // Metadata peer for sendLocalMD, sendLocalPartialMD, fetchRemoteMD, invalidateLocalMD; empty: etcd.
    std::string ipAddr;
    int port = default_comm_port;
    // etcd key suffix for sendLocalPartialMD (required there) and fetchRemoteMD.
    std::string metadataLabel;
    // Passed to the backend as is.
    nixl_blob_t customParam;
};
using nixl_opt_args_t = nixlAgentOptionalArgs;

// A prepared memory view (prepMemView), opaque to its user.
using nixlMemViewH = void *;

using chrono_point_t = std::chrono::steady_clock::time_point;
using chrono_period_us_t = std::chrono::microseconds;

// Telemetry of the last post of a request.
struct nixlXferTelemetry {
    chrono_point_t startTime;
    chrono_period_us_t postDuration;
    chrono_period_us_t xferDuration;
    size_t totalBytes;
    size_t descCount;
};
using nixl_xfer_telem_t = nixlXferTelemetry;

using nixl_etcd_deletion_callback_t = std::function<nixl_status_t(const std::string &remote_agent, void *user_data)>;

// prepXferDlist's agent name for this agent's own buffers as the initiator.
#define NIXL_INIT_AGENT ""

#endif
