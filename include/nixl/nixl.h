/*
 * nixl.h - gixl's C++ drop-in for NVIDIA NIXL 1.5.x: nixlAgent.
 *
 * Header-only, over gixl's C ABI (gixl.h): build with -I<this folder>, link with -lgixl (or -lnixl_capi).
 * The handles this API returns (nixlBackendH*, nixlDlistH*, nixlXferReqH*, memory views) are gixl C
 * handles: tokens that are never dereferenced and never reused. A released handle, a handle of another
 * agent, or a handle whose agent has been destroyed is refused with an error status, never undefined
 * behaviour. Requests made against a peer that has since been invalidated (restarted) fail with
 * NIXL_ERR_NOT_FOUND / NIXL_ERR_REMOTE_DISCONNECT.
 */
#ifndef _NIXL_H
#define _NIXL_H

#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>
#if __cplusplus >= 202002L
#include <span>
#endif

#include "nixl_descriptors.h"
#include "nixl_params.h"
#include "nixl_types.h"

class nixlAgent {
private:
    std::unique_ptr<nixlAgentData> data;

public:
    // Throws std::runtime_error if the agent cannot be created (an empty name, a listener port in use).
    nixlAgent(const std::string &name, const nixlAgentConfig &cfg);
    // Releases every request, prepped list and memory view this agent still holds, then the agent.
    ~nixlAgent();

    nixlAgent(nixlAgent &&) noexcept = delete;
    nixlAgent &
    operator=(nixlAgent &&) noexcept = delete;

    nixl_status_t
    getAvailPlugins(std::vector<nixl_backend_t> &plugins);
    nixl_status_t
    getPluginParams(const nixl_backend_t &type, nixl_mem_list_t &mems, nixl_b_params_t &params) const;
    nixl_status_t
    getBackendParams(const nixlBackendH *backend, nixl_mem_list_t &mems, nixl_b_params_t &params) const;
    nixl_status_t
    createBackend(const nixl_backend_t &type, const nixl_b_params_t &params, nixlBackendH *&backend);

    nixl_status_t
    registerMem(const nixl_reg_dlist_t &descs, const nixl_opt_args_t *extra_params = nullptr);
    nixl_status_t
    deregisterMem(const nixl_reg_dlist_t &descs, const nixl_opt_args_t *extra_params = nullptr);
    nixl_status_t
    queryMem(const nixl_reg_dlist_t &descs,
             std::vector<nixl_query_resp_t> &resp,
             const nixl_opt_args_t *extra_params) const;
    nixl_status_t
    makeConnection(const std::string &remote_agent, const nixl_opt_args_t *extra_params = nullptr);

    nixl_status_t
    prepXferDlist(const std::string &agent_name,
                  const nixl_xfer_dlist_t &descs,
                  nixlDlistH *&dlist_hndl,
                  const nixl_opt_args_t *extra_params = nullptr) const;
    // This agent's own buffers as the initiator (agent name NIXL_INIT_AGENT).
    nixl_status_t
    prepXferDlist(const nixl_xfer_dlist_t &descs,
                  nixlDlistH *&dlist_hndl,
                  const nixl_opt_args_t *extra_params = nullptr) const;
    // Strided lists: index i of the handle stands for all `count` blocks of descriptor i.
    nixl_status_t
    prepXferDlist(const std::string &agent_name,
                  const nixl_stride_dlist_t &descs,
                  nixlDlistH *&dlist_hndl,
                  const nixl_opt_args_t *extra_params = nullptr) const;
    nixl_status_t
    prepXferDlist(const nixl_stride_dlist_t &descs,
                  nixlDlistH *&dlist_hndl,
                  const nixl_opt_args_t *extra_params = nullptr) const;

    nixl_status_t
    makeXferReq(const nixl_xfer_op_t &operation,
                const nixlDlistH *local_side,
                const std::vector<int> &local_indices,
                const nixlDlistH *remote_side,
                const std::vector<int> &remote_indices,
                nixlXferReqH *&req_hndl,
                const nixl_opt_args_t *extra_params = nullptr) const;
#if __cplusplus >= 202002L
    nixl_status_t
    makeXferReq(nixl_xfer_op_t operation,
                const nixlDlistH &local_side,
                std::span<const int> local_indices,
                const nixlDlistH &remote_side,
                std::span<const int> remote_indices,
                nixlXferReqH *&req_hndl,
                const nixl_opt_args_t *extra_params = nullptr) const;
#endif
    nixl_status_t
    createXferReq(const nixl_xfer_op_t &operation,
                  const nixl_xfer_dlist_t &local_descs,
                  const nixl_xfer_dlist_t &remote_descs,
                  const std::string &remote_agent,
                  nixlXferReqH *&req_hndl,
                  const nixl_opt_args_t *extra_params = nullptr) const;

    nixl_status_t
    estimateXferCost(const nixlXferReqH *req_hndl,
                     std::chrono::microseconds &duration,
                     std::chrono::microseconds &err_margin,
                     nixl_cost_t &method,
                     const nixl_opt_args_t *extra_params = nullptr) const;
    nixl_status_t
    postXferReq(nixlXferReqH *req_hndl, const nixl_opt_args_t *extra_params = nullptr) const;
    nixl_status_t
    getXferStatus(nixlXferReqH *req_hndl) const;
    nixl_status_t
    getXferTelemetry(const nixlXferReqH *req_hndl, nixl_xfer_telem_t &telemetry) const;
    nixl_status_t
    queryXferBackend(const nixlXferReqH *req_hndl, nixlBackendH *&backend) const;
    nixl_status_t
    releaseXferReq(nixlXferReqH *req_hndl) const;

    nixl_status_t
    prepMemView(const nixl_remote_dlist_t &remote_buffs,
                nixlMemViewH &mvh,
                const nixl_opt_args_t *extra_params = nullptr) const;
    nixl_status_t
    prepMemView(const nixl_local_dlist_t &local_buffs,
                nixlMemViewH &mvh,
                const nixl_opt_args_t *extra_params = nullptr) const;
    // As NIXL: no status (a handle this agent did not make, or already released, is ignored).
    void
    releaseMemView(nixlMemViewH mvh) const;

    nixl_status_t
    releasedDlistH(nixlDlistH *dlist_hndl) const;

    nixl_status_t
    getNotifs(nixl_notifs_t &notif_map, const nixl_opt_args_t *extra_params = nullptr);
    nixl_status_t
    genNotif(const std::string &remote_agent, const nixl_blob_t &msg, const nixl_opt_args_t *extra_params = nullptr)
        const;

    nixl_status_t
    getLocalMD(nixl_blob_t &str) const;
    nixl_status_t
    getLocalPartialMD(const nixl_reg_dlist_t &descs,
                      nixl_blob_t &str,
                      const nixl_opt_args_t *extra_params = nullptr) const;
    nixl_status_t
    loadRemoteMD(const nixl_blob_t &remote_metadata, std::string &agent_name);
    nixl_status_t
    invalidateRemoteMD(const std::string &remote_agent);

    nixl_status_t
    sendLocalMD(const nixl_opt_args_t *extra_params = nullptr) const;
    nixl_status_t
    sendLocalPartialMD(const nixl_reg_dlist_t &descs, const nixl_opt_args_t *extra_params = nullptr) const;
    nixl_status_t
    fetchRemoteMD(const std::string remote_name, const nixl_opt_args_t *extra_params = nullptr);
    nixl_status_t
    invalidateLocalMD(const nixl_opt_args_t *extra_params = nullptr) const;
    nixl_status_t
    checkRemoteMD(const std::string remote_name, const nixl_xfer_dlist_t &descs) const;
};

#ifndef GIXL_NIXL_ORACLE

#if __has_include("gixl.h")
#include "gixl.h"
#else
#include "../gixl.h"
#endif

namespace gixl_detail {

// A nixl_status_t for a C result: NIXL's own status behind a failure when gixl recorded one.
inline nixl_status_t
status(nixl_capi_status_t c) {
    switch (c) {
    case NIXL_CAPI_SUCCESS:
        return NIXL_SUCCESS;
    case NIXL_CAPI_IN_PROG:
        return NIXL_IN_PROG;
    default:
        break;
    }
    const int32_t n = gixl_last_nixl_status();
    if (n <= NIXL_ERR_NOT_POSTED && n >= NIXL_ERR_NO_TELEMETRY) return static_cast<nixl_status_t>(n);
    switch (c) {
    case NIXL_CAPI_ERROR_INVALID_PARAM:
        return NIXL_ERR_INVALID_PARAM;
    case NIXL_CAPI_ERROR_NOT_FOUND:
        return NIXL_ERR_NOT_FOUND;
    case NIXL_CAPI_ERROR_NO_TELEMETRY:
        return NIXL_ERR_NO_TELEMETRY;
    default:
        return NIXL_ERR_BACKEND;
    }
}

#define GIXL_TRY(expr)                                     \
    do {                                                   \
        const nixl_status_t gixl_st_ = (expr);             \
        if (gixl_st_ != NIXL_SUCCESS) return gixl_st_;     \
    } while (0)

// Owns one C handle of type H, destroyed with D.
template<class H, nixl_capi_status_t (*D)(H)> struct Owned {
    H h = nullptr;
    Owned() = default;
    Owned(const Owned &) = delete;
    Owned &
    operator=(const Owned &) = delete;
    ~Owned() {
        if (h != nullptr) D(h);
    }
};

using OptArgs = Owned<nixl_capi_opt_args_t, nixl_capi_destroy_opt_args>;
using RegList = Owned<nixl_capi_reg_dlist_t, nixl_capi_destroy_reg_dlist>;
using XferList = Owned<nixl_capi_xfer_dlist_t, nixl_capi_destroy_xfer_dlist>;
using RemoteList = Owned<nixl_capi_remote_dlist_t, nixl_capi_destroy_remote_dlist>;
using Params = Owned<nixl_capi_params_t, nixl_capi_destroy_params>;
using StringList = Owned<nixl_capi_string_list_t, nixl_capi_destroy_string_list>;
using MemList = Owned<nixl_capi_mem_list_t, nixl_capi_destroy_mem_list>;
using NotifMap = Owned<nixl_capi_notif_map_t, nixl_capi_destroy_notif_map>;
using QueryResp = Owned<nixl_capi_query_resp_list_t, nixl_capi_destroy_query_resp_list>;

inline nixl_status_t
toC(const nixl_opt_args_t *o, OptArgs &out) {
    if (o == nullptr) return NIXL_SUCCESS;
    GIXL_TRY(status(nixl_capi_create_opt_args(&out.h)));
    for (nixlBackendH *b : o->backends)
        GIXL_TRY(status(nixl_capi_opt_args_add_backend(out.h, reinterpret_cast<nixl_capi_backend_t>(b))));
    const nixl_blob_t &msg = o->notif ? *o->notif : o->notifMsg;
    if (!msg.empty()) GIXL_TRY(status(nixl_capi_opt_args_set_notif_msg(out.h, msg.data(), msg.size())));
    GIXL_TRY(status(nixl_capi_opt_args_set_has_notif(out.h, o->notif.has_value() || o->hasNotif)));
    GIXL_TRY(status(nixl_capi_opt_args_set_skip_desc_merge(out.h, o->skipDescMerge)));
    if (!o->customParam.empty())
        GIXL_TRY(
            status(nixl_capi_opt_args_set_custom_param(out.h, o->customParam.data(), o->customParam.size())));
    if (!o->ipAddr.empty()) GIXL_TRY(status(nixl_capi_opt_args_set_ip_addr(out.h, o->ipAddr.c_str())));
    if (o->port < 0 || o->port > 65535) return NIXL_ERR_INVALID_PARAM;
    GIXL_TRY(status(nixl_capi_opt_args_set_port(out.h, static_cast<uint16_t>(o->port))));
    return NIXL_SUCCESS;
}

inline nixl_capi_mem_type_t
memToC(nixl_mem_t m) {
    return static_cast<nixl_capi_mem_type_t>(static_cast<int>(m));
}

// Descriptor lists cross the C ABI in bulk: a nixlBasicDesc is laid out as a gixl_desc_t, so a list's own
// storage is handed over as it is (one call for the whole list, not one per descriptor).
static_assert(sizeof(nixlBasicDesc) == sizeof(gixl_desc_t) && alignof(nixlBasicDesc) == alignof(gixl_desc_t) &&
                  offsetof(nixlBasicDesc, addr) == offsetof(gixl_desc_t, addr) &&
                  offsetof(nixlBasicDesc, len) == offsetof(gixl_desc_t, len) &&
                  offsetof(nixlBasicDesc, devId) == offsetof(gixl_desc_t, dev_id),
              "nixlBasicDesc must have gixl_desc_t's layout");

inline const gixl_desc_t *
descs(const nixl_xfer_dlist_t &l) {
    return l.isEmpty() ? nullptr : reinterpret_cast<const gixl_desc_t *>(&l[0]);
}

inline nixl_status_t
toC(const nixl_reg_dlist_t &l, RegList &out) {
    GIXL_TRY(status(nixl_capi_create_reg_dlist(memToC(l.getType()), &out.h)));
    std::vector<gixl_reg_desc_t> v;
    v.reserve(static_cast<size_t>(l.descCount()));
    for (const nixlBlobDesc &d : l)
        v.push_back(gixl_reg_desc_t{
            d.addr, d.len, d.devId, d.metaInfo.empty() ? nullptr : d.metaInfo.data(), d.metaInfo.size()});
    return status(gixl_reg_dlist_add_descs(out.h, v.data(), v.size()));
}

inline nixl_status_t
toC(const nixl_xfer_dlist_t &l, XferList &out) {
    GIXL_TRY(status(nixl_capi_create_xfer_dlist(memToC(l.getType()), &out.h)));
    return status(gixl_xfer_dlist_add_descs(out.h, descs(l), static_cast<size_t>(l.descCount())));
}

inline nixl_status_t
toC(const nixl_remote_dlist_t &l, RemoteList &out) {
    GIXL_TRY(status(nixl_capi_create_remote_dlist(memToC(l.getType()), &out.h)));
    for (const nixlRemoteDesc &d : l)
        GIXL_TRY(status(nixl_capi_remote_dlist_add_desc(out.h, d.addr, d.len, d.devId, d.remoteAgent.c_str())));
    return NIXL_SUCCESS;
}

inline nixl_status_t
toC(const nixl_b_params_t &p, Params &out) {
    GIXL_TRY(status(nixl_capi_create_params(&out.h)));
    for (const auto &kv : p) GIXL_TRY(status(nixl_capi_params_add(out.h, kv.first.c_str(), kv.second.c_str())));
    return NIXL_SUCCESS;
}

inline nixl_status_t
fromC(nixl_capi_params_t p, nixl_b_params_t &out) {
    nixl_capi_param_iter_t it = nullptr;
    GIXL_TRY(status(nixl_capi_params_create_iterator(p, &it)));
    nixl_b_params_t got;
    bool more = true;
    nixl_status_t st = NIXL_SUCCESS;
    bool empty = true;
    st = status(nixl_capi_params_is_empty(p, &empty));
    while (st == NIXL_SUCCESS && !empty && more) {
        const char *k = nullptr;
        const char *v = nullptr;
        st = status(nixl_capi_params_iterator_next(it, &k, &v, &more));
        if (st == NIXL_SUCCESS && k != nullptr && v != nullptr) got[k] = v;
    }
    nixl_capi_params_destroy_iterator(it);
    if (st == NIXL_SUCCESS) out = std::move(got);
    return st;
}

inline nixl_status_t
fromC(nixl_capi_mem_list_t m, nixl_mem_list_t &out) {
    size_t n = 0;
    GIXL_TRY(status(nixl_capi_mem_list_size(m, &n)));
    nixl_mem_list_t got;
    for (size_t i = 0; i < n; i++) {
        nixl_capi_mem_type_t t = NIXL_CAPI_MEM_UNKNOWN;
        GIXL_TRY(status(nixl_capi_mem_list_get(m, i, &t)));
        got.push_back(static_cast<nixl_mem_t>(static_cast<int>(t)));
    }
    out = std::move(got);
    return NIXL_SUCCESS;
}

// A malloc'd buffer from the C API, freed on scope exit.
struct CBuf {
    void *p = nullptr;
    size_t n = 0;
    CBuf() = default;
    CBuf(const CBuf &) = delete;
    CBuf &
    operator=(const CBuf &) = delete;
    ~CBuf() {
        std::free(p);
    }
};

// What a prepped list's indices mean: for a strided list, index i is `counts[i]` blocks from `starts[i]`.
struct DlistInfo {
    bool strided = false;
    std::vector<int> starts;
    std::vector<int> counts;
};

inline nixl_status_t
expand(const DlistInfo *info, const int *idx, size_t n, std::vector<int> &out) {
    out.clear();
    if (info == nullptr || !info->strided) {
        out.assign(idx, idx + n);
        return NIXL_SUCCESS;
    }
    for (size_t k = 0; k < n; k++) {
        const int i = idx[k];
        if (i < 0 || static_cast<size_t>(i) >= info->starts.size()) return NIXL_ERR_INVALID_PARAM;
        for (int j = 0; j < info->counts[i]; j++) out.push_back(info->starts[i] + j);
    }
    return NIXL_SUCCESS;
}

} // namespace gixl_detail

// What a nixlAgent holds: its gixl agent and the handles it gave out and has not had back.
class nixlAgentData {
public:
    nixl_capi_agent_t agent = nullptr;
    std::mutex mu;
    std::set<nixl_capi_xfer_req_t> reqs;
    std::map<nixl_capi_xfer_dlist_handle_t, gixl_detail::DlistInfo> dlists;
    std::set<nixl_capi_mem_view_t> views;
    std::vector<nixl_capi_backend_t> backends;

    // The descriptors are read in place. On failure `out` is left as it was, or set to nullptr where NIXL
    // does so (registrations searched and none covering the list).
    nixl_status_t
    prep(const std::string &agent_name,
         nixl_mem_t mem,
         const gixl_desc_t *descs,
         size_t n,
         gixl_detail::DlistInfo info,
         nixlDlistH *&out,
         const nixl_opt_args_t *extra) {
        gixl_detail::OptArgs o;
        GIXL_TRY(gixl_detail::toC(extra, o));
        auto h = reinterpret_cast<nixl_capi_xfer_dlist_handle_t>(out);
        const nixl_status_t st = gixl_detail::status(
            gixl_prep_xfer_dlist_descs(agent, agent_name.c_str(), gixl_detail::memToC(mem), descs, n, &h, o.h));
        if (st != NIXL_SUCCESS) {
            if (h == nullptr) out = nullptr;
            return st;
        }
        std::lock_guard<std::mutex> g(mu);
        dlists.emplace(h, std::move(info));
        out = reinterpret_cast<nixlDlistH *>(h);
        return NIXL_SUCCESS;
    }

    nixl_status_t
    prepStrided(const std::string &agent_name,
                const nixl_stride_dlist_t &descs,
                nixlDlistH *&out,
                const nixl_opt_args_t *extra) {
        std::vector<gixl_desc_t> flat;
        gixl_detail::DlistInfo info;
        info.strided = true;
        for (const nixlStrideDesc &d : descs) {
            if (d.count == 0 || flat.size() + d.count > static_cast<size_t>(INT32_MAX)) return NIXL_ERR_INVALID_PARAM;
            info.starts.push_back(static_cast<int>(flat.size()));
            info.counts.push_back(static_cast<int>(d.count));
            for (size_t j = 0; j < d.count; j++) flat.push_back(gixl_desc_t{d.addr + j * d.stride, d.len, d.devId});
        }
        return prep(agent_name, descs.getType(), flat.data(), flat.size(), std::move(info), out, extra);
    }

    nixl_status_t
    make(const nixl_xfer_op_t &op,
         const nixlDlistH *local,
         const int *li,
         size_t ln,
         const nixlDlistH *remote,
         const int *ri,
         size_t rn,
         nixlXferReqH *&out,
         const nixl_opt_args_t *extra) {
        out = nullptr; // as NIXL: cleared on entry, whatever follows
        auto lh = reinterpret_cast<nixl_capi_xfer_dlist_handle_t>(const_cast<nixlDlistH *>(local));
        auto rh = reinterpret_cast<nixl_capi_xfer_dlist_handle_t>(const_cast<nixlDlistH *>(remote));
        std::vector<int> lx, rx;
        {
            std::lock_guard<std::mutex> g(mu);
            auto l = dlists.find(lh);
            auto r = dlists.find(rh);
            GIXL_TRY(gixl_detail::expand(l == dlists.end() ? nullptr : &l->second, li, ln, lx));
            GIXL_TRY(gixl_detail::expand(r == dlists.end() ? nullptr : &r->second, ri, rn, rx));
        }
        gixl_detail::OptArgs o;
        GIXL_TRY(gixl_detail::toC(extra, o));
        nixl_capi_xfer_req_t req = nullptr;
        GIXL_TRY(gixl_detail::status(nixl_capi_make_xfer_req(agent,
                                                             static_cast<nixl_capi_xfer_op_t>(op),
                                                             lh,
                                                             lx.data(),
                                                             lx.size(),
                                                             rh,
                                                             rx.data(),
                                                             rx.size(),
                                                             &req,
                                                             o.h)));
        std::lock_guard<std::mutex> g(mu);
        reqs.insert(req);
        out = reinterpret_cast<nixlXferReqH *>(req);
        return NIXL_SUCCESS;
    }
};

inline nixlAgent::nixlAgent(const std::string &name, const nixlAgentConfig &cfg) : data(new nixlAgentData()) {
    nixl_capi_agent_config_t c{};
    c.enable_prog_thread = cfg.useProgThread;
    c.enable_listen_thread = cfg.useListenThread;
    c.listen_port = cfg.listenPort;
    c.thread_sync = static_cast<nixl_capi_thread_sync_t>(static_cast<int>(cfg.syncMode));
    c.num_workers = 1;
    c.pthr_delay_us = cfg.pthrDelay;
    c.lthr_delay_us = cfg.lthrDelay;
    c.capture_telemetry = cfg.captureTelemetry;
    if (nixl_capi_create_configured_agent(name.c_str(), &c, &data->agent) != NIXL_CAPI_SUCCESS)
        throw std::runtime_error(std::string("nixlAgent: ") + gixl_last_error());
}

inline nixlAgent::~nixlAgent() {
    if (!data) return;
    for (nixl_capi_xfer_req_t r : data->reqs) {
        nixl_capi_release_xfer_req(data->agent, r);
        nixl_capi_destroy_xfer_req(r);
    }
    for (const auto &d : data->dlists) nixl_capi_release_xfer_dlist_handle(data->agent, d.first);
    for (nixl_capi_mem_view_t v : data->views) nixl_capi_release_mem_view(data->agent, v);
    for (nixl_capi_backend_t b : data->backends) nixl_capi_destroy_backend(b);
    nixl_capi_destroy_agent(data->agent);
}

inline nixl_status_t
nixlAgent::getAvailPlugins(std::vector<nixl_backend_t> &plugins) {
    gixl_detail::StringList l;
    GIXL_TRY(gixl_detail::status(nixl_capi_get_available_plugins(data->agent, &l.h)));
    size_t n = 0;
    GIXL_TRY(gixl_detail::status(nixl_capi_string_list_size(l.h, &n)));
    std::vector<nixl_backend_t> got;
    for (size_t i = 0; i < n; i++) {
        const char *s = nullptr;
        GIXL_TRY(gixl_detail::status(nixl_capi_string_list_get(l.h, i, &s)));
        got.emplace_back(s);
    }
    plugins = std::move(got);
    return NIXL_SUCCESS;
}

inline nixl_status_t
nixlAgent::getPluginParams(const nixl_backend_t &type, nixl_mem_list_t &mems, nixl_b_params_t &params) const {
    gixl_detail::MemList m;
    gixl_detail::Params p;
    GIXL_TRY(gixl_detail::status(nixl_capi_get_plugin_params(data->agent, type.c_str(), &m.h, &p.h)));
    GIXL_TRY(gixl_detail::fromC(m.h, mems));
    return gixl_detail::fromC(p.h, params);
}

inline nixl_status_t
nixlAgent::getBackendParams(const nixlBackendH *backend, nixl_mem_list_t &mems, nixl_b_params_t &params) const {
    gixl_detail::MemList m;
    gixl_detail::Params p;
    auto b = reinterpret_cast<nixl_capi_backend_t>(const_cast<nixlBackendH *>(backend));
    GIXL_TRY(gixl_detail::status(nixl_capi_get_backend_params(data->agent, b, &m.h, &p.h)));
    GIXL_TRY(gixl_detail::fromC(m.h, mems));
    return gixl_detail::fromC(p.h, params);
}

inline nixl_status_t
nixlAgent::createBackend(const nixl_backend_t &type, const nixl_b_params_t &params, nixlBackendH *&backend) {
    gixl_detail::Params p;
    GIXL_TRY(gixl_detail::toC(params, p));
    nixl_capi_backend_t b = nullptr;
    GIXL_TRY(gixl_detail::status(nixl_capi_create_backend(data->agent, type.c_str(), p.h, &b)));
    std::lock_guard<std::mutex> g(data->mu);
    data->backends.push_back(b);
    backend = reinterpret_cast<nixlBackendH *>(b);
    return NIXL_SUCCESS;
}

inline nixl_status_t
nixlAgent::registerMem(const nixl_reg_dlist_t &descs, const nixl_opt_args_t *extra_params) {
    gixl_detail::RegList l;
    gixl_detail::OptArgs o;
    GIXL_TRY(gixl_detail::toC(descs, l));
    GIXL_TRY(gixl_detail::toC(extra_params, o));
    return gixl_detail::status(nixl_capi_register_mem(data->agent, l.h, o.h));
}

inline nixl_status_t
nixlAgent::deregisterMem(const nixl_reg_dlist_t &descs, const nixl_opt_args_t *extra_params) {
    gixl_detail::RegList l;
    gixl_detail::OptArgs o;
    GIXL_TRY(gixl_detail::toC(descs, l));
    GIXL_TRY(gixl_detail::toC(extra_params, o));
    return gixl_detail::status(nixl_capi_deregister_mem(data->agent, l.h, o.h));
}

inline nixl_status_t
nixlAgent::queryMem(const nixl_reg_dlist_t &descs,
                    std::vector<nixl_query_resp_t> &resp,
                    const nixl_opt_args_t *extra_params) const {
    gixl_detail::RegList l;
    gixl_detail::OptArgs o;
    gixl_detail::QueryResp q;
    GIXL_TRY(gixl_detail::toC(descs, l));
    GIXL_TRY(gixl_detail::toC(extra_params, o));
    GIXL_TRY(gixl_detail::status(nixl_capi_create_query_resp_list(&q.h)));
    GIXL_TRY(gixl_detail::status(nixl_capi_query_mem(data->agent, l.h, q.h, o.h)));
    size_t n = 0;
    GIXL_TRY(gixl_detail::status(nixl_capi_query_resp_list_size(q.h, &n)));
    std::vector<nixl_query_resp_t> got(n);
    for (size_t i = 0; i < n; i++) {
        bool has = false;
        GIXL_TRY(gixl_detail::status(nixl_capi_query_resp_list_has_value(q.h, i, &has)));
        if (!has) continue;
        gixl_detail::Params p;
        GIXL_TRY(gixl_detail::status(nixl_capi_query_resp_list_get_params(q.h, i, &p.h)));
        nixl_b_params_t m;
        GIXL_TRY(gixl_detail::fromC(p.h, m));
        got[i] = std::move(m);
    }
    resp = std::move(got);
    return NIXL_SUCCESS;
}

inline nixl_status_t
nixlAgent::makeConnection(const std::string &remote_agent, const nixl_opt_args_t *extra_params) {
    gixl_detail::OptArgs o;
    GIXL_TRY(gixl_detail::toC(extra_params, o));
    return gixl_detail::status(nixl_capi_agent_make_connection(data->agent, remote_agent.c_str(), o.h));
}

inline nixl_status_t
nixlAgent::prepXferDlist(const std::string &agent_name,
                         const nixl_xfer_dlist_t &descs,
                         nixlDlistH *&dlist_hndl,
                         const nixl_opt_args_t *extra_params) const {
    return data->prep(agent_name,
                      descs.getType(),
                      gixl_detail::descs(descs),
                      static_cast<size_t>(descs.descCount()),
                      gixl_detail::DlistInfo(),
                      dlist_hndl,
                      extra_params);
}

inline nixl_status_t
nixlAgent::prepXferDlist(const nixl_xfer_dlist_t &descs,
                         nixlDlistH *&dlist_hndl,
                         const nixl_opt_args_t *extra_params) const {
    return prepXferDlist(NIXL_INIT_AGENT, descs, dlist_hndl, extra_params);
}

inline nixl_status_t
nixlAgent::prepXferDlist(const std::string &agent_name,
                         const nixl_stride_dlist_t &descs,
                         nixlDlistH *&dlist_hndl,
                         const nixl_opt_args_t *extra_params) const {
    return data->prepStrided(agent_name, descs, dlist_hndl, extra_params);
}

inline nixl_status_t
nixlAgent::prepXferDlist(const nixl_stride_dlist_t &descs,
                         nixlDlistH *&dlist_hndl,
                         const nixl_opt_args_t *extra_params) const {
    return data->prepStrided(NIXL_INIT_AGENT, descs, dlist_hndl, extra_params);
}

inline nixl_status_t
nixlAgent::makeXferReq(const nixl_xfer_op_t &operation,
                       const nixlDlistH *local_side,
                       const std::vector<int> &local_indices,
                       const nixlDlistH *remote_side,
                       const std::vector<int> &remote_indices,
                       nixlXferReqH *&req_hndl,
                       const nixl_opt_args_t *extra_params) const {
    return data->make(operation,
                      local_side,
                      local_indices.data(),
                      local_indices.size(),
                      remote_side,
                      remote_indices.data(),
                      remote_indices.size(),
                      req_hndl,
                      extra_params);
}

#if __cplusplus >= 202002L
inline nixl_status_t
nixlAgent::makeXferReq(nixl_xfer_op_t operation,
                       const nixlDlistH &local_side,
                       std::span<const int> local_indices,
                       const nixlDlistH &remote_side,
                       std::span<const int> remote_indices,
                       nixlXferReqH *&req_hndl,
                       const nixl_opt_args_t *extra_params) const {
    return data->make(operation,
                      &local_side,
                      local_indices.data(),
                      local_indices.size(),
                      &remote_side,
                      remote_indices.data(),
                      remote_indices.size(),
                      req_hndl,
                      extra_params);
}
#endif

inline nixl_status_t
nixlAgent::createXferReq(const nixl_xfer_op_t &operation,
                         const nixl_xfer_dlist_t &local_descs,
                         const nixl_xfer_dlist_t &remote_descs,
                         const std::string &remote_agent,
                         nixlXferReqH *&req_hndl,
                         const nixl_opt_args_t *extra_params) const {
    req_hndl = nullptr; // as NIXL: cleared on entry, whatever follows
    gixl_detail::OptArgs o;
    GIXL_TRY(gixl_detail::toC(extra_params, o));
    nixl_capi_xfer_req_t req = nullptr;
    GIXL_TRY(gixl_detail::status(gixl_create_xfer_req_descs(data->agent,
                                                            static_cast<nixl_capi_xfer_op_t>(operation),
                                                            gixl_detail::memToC(local_descs.getType()),
                                                            gixl_detail::descs(local_descs),
                                                            static_cast<size_t>(local_descs.descCount()),
                                                            gixl_detail::memToC(remote_descs.getType()),
                                                            gixl_detail::descs(remote_descs),
                                                            static_cast<size_t>(remote_descs.descCount()),
                                                            remote_agent.c_str(),
                                                            &req,
                                                            o.h)));
    std::lock_guard<std::mutex> g(data->mu);
    data->reqs.insert(req);
    req_hndl = reinterpret_cast<nixlXferReqH *>(req);
    return NIXL_SUCCESS;
}

inline nixl_status_t
nixlAgent::estimateXferCost(const nixlXferReqH *req_hndl,
                            std::chrono::microseconds &duration,
                            std::chrono::microseconds &err_margin,
                            nixl_cost_t &method,
                            const nixl_opt_args_t *extra_params) const {
    gixl_detail::OptArgs o;
    GIXL_TRY(gixl_detail::toC(extra_params, o));
    int64_t d = 0, e = 0;
    nixl_capi_cost_t m = NIXL_CAPI_COST_ANALYTICAL_BACKEND;
    auto r = reinterpret_cast<nixl_capi_xfer_req_t>(const_cast<nixlXferReqH *>(req_hndl));
    // As NIXL's: the outputs are written only when there is an estimate.
    GIXL_TRY(gixl_detail::status(nixl_capi_estimate_xfer_cost(data->agent, r, o.h, &d, &e, &m)));
    duration = std::chrono::microseconds(d);
    err_margin = std::chrono::microseconds(e);
    method = static_cast<nixl_cost_t>(static_cast<int>(m));
    return NIXL_SUCCESS;
}

inline nixl_status_t
nixlAgent::postXferReq(nixlXferReqH *req_hndl, const nixl_opt_args_t *extra_params) const {
    gixl_detail::OptArgs o;
    GIXL_TRY(gixl_detail::toC(extra_params, o));
    return gixl_detail::status(
        nixl_capi_post_xfer_req(data->agent, reinterpret_cast<nixl_capi_xfer_req_t>(req_hndl), o.h));
}

inline nixl_status_t
nixlAgent::getXferStatus(nixlXferReqH *req_hndl) const {
    return gixl_detail::status(
        nixl_capi_get_xfer_status(data->agent, reinterpret_cast<nixl_capi_xfer_req_t>(req_hndl)));
}

inline nixl_status_t
nixlAgent::getXferTelemetry(const nixlXferReqH *req_hndl, nixl_xfer_telem_t &telemetry) const {
    nixl_capi_xfer_telemetry_s t{};
    auto r = reinterpret_cast<nixl_capi_xfer_req_t>(const_cast<nixlXferReqH *>(req_hndl));
    GIXL_TRY(gixl_detail::status(nixl_capi_get_xfer_telemetry(data->agent, r, &t)));
    telemetry.startTime = chrono_point_t(
        std::chrono::duration_cast<chrono_point_t::duration>(std::chrono::microseconds(t.start_time_us)));
    telemetry.postDuration = std::chrono::microseconds(t.post_duration_us);
    telemetry.xferDuration = std::chrono::microseconds(t.xfer_duration_us);
    telemetry.totalBytes = t.total_bytes;
    telemetry.descCount = t.desc_count;
    return NIXL_SUCCESS;
}

inline nixl_status_t
nixlAgent::queryXferBackend(const nixlXferReqH *req_hndl, nixlBackendH *&backend) const {
    nixl_capi_backend_t b = nullptr;
    auto r = reinterpret_cast<nixl_capi_xfer_req_t>(const_cast<nixlXferReqH *>(req_hndl));
    GIXL_TRY(gixl_detail::status(nixl_capi_query_xfer_backend(data->agent, r, &b)));
    std::lock_guard<std::mutex> g(data->mu);
    // Hand back the pointer createBackend gave for this backend, as NIXL does.
    for (nixl_capi_backend_t known : data->backends) {
        bool same = false;
        if (gixl_backend_same(known, b, &same) == NIXL_CAPI_SUCCESS && same) {
            nixl_capi_destroy_backend(b);
            backend = reinterpret_cast<nixlBackendH *>(known);
            return NIXL_SUCCESS;
        }
    }
    data->backends.push_back(b);
    backend = reinterpret_cast<nixlBackendH *>(b);
    return NIXL_SUCCESS;
}

inline nixl_status_t
nixlAgent::releaseXferReq(nixlXferReqH *req_hndl) const {
    auto r = reinterpret_cast<nixl_capi_xfer_req_t>(req_hndl);
    const nixl_status_t st = gixl_detail::status(nixl_capi_release_xfer_req(data->agent, r));
    if (st != NIXL_SUCCESS) {
        // A request whose agent is gone can only be freed; the error stands.
        nixl_capi_destroy_xfer_req(r);
        return st;
    }
    nixl_capi_destroy_xfer_req(r);
    std::lock_guard<std::mutex> g(data->mu);
    data->reqs.erase(r);
    return NIXL_SUCCESS;
}

inline nixl_status_t
nixlAgent::prepMemView(const nixl_remote_dlist_t &remote_buffs,
                       nixlMemViewH &mvh,
                       const nixl_opt_args_t *extra_params) const {
    gixl_detail::RemoteList l;
    gixl_detail::OptArgs o;
    GIXL_TRY(gixl_detail::toC(remote_buffs, l));
    GIXL_TRY(gixl_detail::toC(extra_params, o));
    nixl_capi_mem_view_t v = nullptr;
    GIXL_TRY(gixl_detail::status(nixl_capi_prep_mem_view_remote(data->agent, l.h, &v, o.h)));
    std::lock_guard<std::mutex> g(data->mu);
    data->views.insert(v);
    mvh = v;
    return NIXL_SUCCESS;
}

inline nixl_status_t
nixlAgent::prepMemView(const nixl_local_dlist_t &local_buffs,
                       nixlMemViewH &mvh,
                       const nixl_opt_args_t *extra_params) const {
    gixl_detail::XferList l;
    gixl_detail::OptArgs o;
    GIXL_TRY(gixl_detail::toC(local_buffs, l));
    GIXL_TRY(gixl_detail::toC(extra_params, o));
    nixl_capi_mem_view_t v = nullptr;
    GIXL_TRY(gixl_detail::status(nixl_capi_prep_mem_view_local(data->agent, l.h, &v, o.h)));
    std::lock_guard<std::mutex> g(data->mu);
    data->views.insert(v);
    mvh = v;
    return NIXL_SUCCESS;
}

inline void
nixlAgent::releaseMemView(nixlMemViewH mvh) const {
    auto v = static_cast<nixl_capi_mem_view_t>(mvh);
    {
        std::lock_guard<std::mutex> g(data->mu);
        if (data->views.erase(v) == 0) {
            return; // not made by this agent, or released already
        }
    }
    nixl_capi_release_mem_view(data->agent, v);
}

inline nixl_status_t
nixlAgent::releasedDlistH(nixlDlistH *dlist_hndl) const {
    auto h = reinterpret_cast<nixl_capi_xfer_dlist_handle_t>(dlist_hndl);
    GIXL_TRY(gixl_detail::status(nixl_capi_release_xfer_dlist_handle(data->agent, h)));
    std::lock_guard<std::mutex> g(data->mu);
    data->dlists.erase(h);
    return NIXL_SUCCESS;
}

inline nixl_status_t
nixlAgent::getNotifs(nixl_notifs_t &notif_map, const nixl_opt_args_t *extra_params) {
    gixl_detail::OptArgs o;
    gixl_detail::NotifMap m;
    GIXL_TRY(gixl_detail::toC(extra_params, o));
    GIXL_TRY(gixl_detail::status(nixl_capi_create_notif_map(&m.h)));
    GIXL_TRY(gixl_detail::status(nixl_capi_get_notifs(data->agent, m.h, o.h)));
    size_t agents = 0;
    GIXL_TRY(gixl_detail::status(nixl_capi_notif_map_size(m.h, &agents)));
    for (size_t i = 0; i < agents; i++) {
        const char *name = nullptr;
        size_t n = 0;
        GIXL_TRY(gixl_detail::status(nixl_capi_notif_map_get_agent_at(m.h, i, &name)));
        GIXL_TRY(gixl_detail::status(nixl_capi_notif_map_get_notifs_size(m.h, name, &n)));
        std::vector<nixl_blob_t> &out = notif_map[name];
        for (size_t j = 0; j < n; j++) {
            const void *p = nullptr;
            size_t len = 0;
            GIXL_TRY(gixl_detail::status(nixl_capi_notif_map_get_notif(m.h, name, j, &p, &len)));
            out.emplace_back(static_cast<const char *>(p), len);
        }
    }
    return NIXL_SUCCESS;
}

inline nixl_status_t
nixlAgent::genNotif(const std::string &remote_agent, const nixl_blob_t &msg, const nixl_opt_args_t *extra_params)
    const {
    gixl_detail::OptArgs o;
    GIXL_TRY(gixl_detail::toC(extra_params, o));
    return gixl_detail::status(nixl_capi_gen_notif(
        data->agent, remote_agent.c_str(), msg.empty() ? nullptr : msg.data(), msg.size(), o.h));
}

inline nixl_status_t
nixlAgent::getLocalMD(nixl_blob_t &str) const {
    gixl_detail::CBuf b;
    GIXL_TRY(gixl_detail::status(nixl_capi_get_local_md(data->agent, &b.p, &b.n)));
    str.assign(static_cast<const char *>(b.p), b.n);
    return NIXL_SUCCESS;
}

inline nixl_status_t
nixlAgent::getLocalPartialMD(const nixl_reg_dlist_t &descs, nixl_blob_t &str, const nixl_opt_args_t *extra_params)
    const {
    gixl_detail::RegList l;
    gixl_detail::OptArgs o;
    gixl_detail::CBuf b;
    GIXL_TRY(gixl_detail::toC(descs, l));
    GIXL_TRY(gixl_detail::toC(extra_params, o));
    const bool conn = extra_params != nullptr && extra_params->includeConnInfo;
    GIXL_TRY(gixl_detail::status(gixl_get_local_partial_md(data->agent, l.h, conn, &b.p, &b.n, o.h)));
    str.assign(static_cast<const char *>(b.p), b.n);
    return NIXL_SUCCESS;
}

inline nixl_status_t
nixlAgent::loadRemoteMD(const nixl_blob_t &remote_metadata, std::string &agent_name) {
    char *name = nullptr;
    GIXL_TRY(gixl_detail::status(
        nixl_capi_load_remote_md(data->agent, remote_metadata.data(), remote_metadata.size(), &name)));
    agent_name = name;
    std::free(name);
    return NIXL_SUCCESS;
}

inline nixl_status_t
nixlAgent::invalidateRemoteMD(const std::string &remote_agent) {
    return gixl_detail::status(nixl_capi_invalidate_remote_md(data->agent, remote_agent.c_str()));
}

inline nixl_status_t
nixlAgent::sendLocalMD(const nixl_opt_args_t *extra_params) const {
    gixl_detail::OptArgs o;
    GIXL_TRY(gixl_detail::toC(extra_params, o));
    return gixl_detail::status(nixl_capi_send_local_md(data->agent, o.h));
}

inline nixl_status_t
nixlAgent::sendLocalPartialMD(const nixl_reg_dlist_t &descs, const nixl_opt_args_t *extra_params) const {
    gixl_detail::RegList l;
    gixl_detail::OptArgs o;
    GIXL_TRY(gixl_detail::toC(descs, l));
    GIXL_TRY(gixl_detail::toC(extra_params, o));
    const bool conn = extra_params != nullptr && extra_params->includeConnInfo;
    const char *label = extra_params != nullptr ? extra_params->metadataLabel.c_str() : "";
    return gixl_detail::status(gixl_send_local_partial_md(data->agent, l.h, conn, label, o.h));
}

inline nixl_status_t
nixlAgent::fetchRemoteMD(const std::string remote_name, const nixl_opt_args_t *extra_params) {
    gixl_detail::OptArgs o;
    GIXL_TRY(gixl_detail::toC(extra_params, o));
    const char *label = extra_params != nullptr ? extra_params->metadataLabel.c_str() : "";
    return gixl_detail::status(gixl_fetch_remote_md(data->agent, remote_name.c_str(), label, o.h));
}

inline nixl_status_t
nixlAgent::invalidateLocalMD(const nixl_opt_args_t *extra_params) const {
    gixl_detail::OptArgs o;
    GIXL_TRY(gixl_detail::toC(extra_params, o));
    return gixl_detail::status(nixl_capi_invalidate_local_md(data->agent, o.h));
}

inline nixl_status_t
nixlAgent::checkRemoteMD(const std::string remote_name, const nixl_xfer_dlist_t &descs) const {
    gixl_detail::XferList l;
    GIXL_TRY(gixl_detail::toC(descs, l));
    return gixl_detail::status(nixl_capi_check_remote_md(data->agent, remote_name.c_str(), l.h));
}

#undef GIXL_TRY

#endif // GIXL_NIXL_ORACLE

#endif
