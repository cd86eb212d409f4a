// t_parity: NIXL's public C++ API, type by type and method by method, with the exact signatures of NIXL's headers
// (the repository's head, which nixlbench builds against, and the 1.5.x releases). Every member function is taken
// by a pointer of its exact type, so a missing overload, a changed parameter or return type fails the build; the
// types are named as NIXL's users (nixlbench, NIXL's examples and gtests) name them. Then a few calls the way
// nixlbench makes them. Written for gixl: a header change that drops parity fails this program's build.
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include <nixl.h>

#include "check.hpp"

namespace {

// One pointer of the given member-function type: the build fails where the header has no such overload.
#define HAS(T, name, ...)                                                                                              \
    do {                                                                                                               \
        using Member = __VA_ARGS__;                                                                                    \
        Member p = &T::name;                                                                                           \
        CHECK(p != nullptr, #T "::" #name);                                                                            \
    } while (0)

using Opt = const nixl_opt_args_t *;

void
types() {
    static_assert(std::is_same_v<nixl_backend_t, std::string>);
    static_assert(std::is_same_v<nixl_telemetry_plugin_t, std::string>);
    static_assert(std::is_same_v<nixl_blob_t, std::string>);
    static_assert(std::is_same_v<nixl_mem_list_t, std::vector<nixl_mem_t>>);
    static_assert(std::is_same_v<nixl_b_params_t, std::unordered_map<std::string, std::string>>);
    static_assert(std::is_same_v<nixl_notifs_t, std::unordered_map<std::string, std::vector<nixl_blob_t>>>);
    static_assert(std::is_same_v<nixl_query_resp_t, std::optional<nixl_b_params_t>>);
    static_assert(std::is_same_v<nixl_opt_args_t, nixlAgentOptionalArgs>);
    static_assert(std::is_same_v<nixlMemViewH, void *>);
    static_assert(std::is_same_v<chrono_point_t, std::chrono::steady_clock::time_point>);
    static_assert(std::is_same_v<chrono_period_us_t, std::chrono::microseconds>);
    static_assert(std::is_same_v<nixl_xfer_telem_t, nixlXferTelemetry>);
    static_assert(std::is_same_v<nixl_xfer_dlist_t, nixlDescList<nixlBasicDesc>>);
    static_assert(std::is_same_v<nixl_local_dlist_t, nixlDescList<nixlBasicDesc>>);
    static_assert(std::is_same_v<nixl_reg_dlist_t, nixlDescList<nixlBlobDesc>>);
    static_assert(std::is_same_v<nixl_remote_dlist_t, nixlDescList<nixlRemoteDesc>>);
    static_assert(std::is_base_of_v<nixlBasicDesc, nixlBlobDesc>);
    static_assert(std::is_base_of_v<nixlBasicDesc, nixlRemoteDesc>);
    static_assert(std::is_enum_v<nixl_mem_t> && std::is_enum_v<nixl_xfer_op_t> && std::is_enum_v<nixl_status_t>);
    static_assert(std::is_enum_v<nixl_thread_sync_t> && std::is_enum_v<nixl_cost_t>);
    nixl_mem_t mems[] = {DRAM_SEG, VRAM_SEG, BLK_SEG, OBJ_SEG, FILE_SEG};
    nixl_xfer_op_t ops[] = {NIXL_READ, NIXL_WRITE};
    nixl_thread_sync_t syncs[] = {nixl_thread_sync_t::NIXL_THREAD_SYNC_NONE,
                                  nixl_thread_sync_t::NIXL_THREAD_SYNC_STRICT,
                                  nixl_thread_sync_t::NIXL_THREAD_SYNC_RW,
                                  nixl_thread_sync_t::NIXL_THREAD_SYNC_DEFAULT};
    nixl_cost_t costs[] = {nixl_cost_t::ANALYTICAL_BACKEND};
    CHECK(sizeof(mems) / sizeof(mems[0]) == 5 && sizeof(ops) / sizeof(ops[0]) == 2, "memory types and operations");
    CHECK(sizeof(syncs) / sizeof(syncs[0]) == 4 && sizeof(costs) == sizeof(nixl_cost_t), "sync modes and costs");
    CHECK(std::string(NIXL_INIT_AGENT).empty(), "NIXL_INIT_AGENT");
    CHECK(nixlEnumStrings::memTypeStr(DRAM_SEG) == "DRAM_SEG", "nixlEnumStrings::memTypeStr");
    CHECK(nixlEnumStrings::xferOpStr(NIXL_WRITE) == "WRITE", "nixlEnumStrings::xferOpStr");
    CHECK(nixlEnumStrings::statusStr(NIXL_ERR_NOT_POSTED) == "NIXL_ERR_NOT_POSTED", "nixlEnumStrings::statusStr");
}

void
optionalArgs() {
    nixl_opt_args_t o;
    std::vector<nixlBackendH *> &backends = o.backends;
    std::optional<nixl_blob_t> &notif_new = o.notif;
    nixl_blob_t &notif = o.notifMsg;
    bool &has = o.hasNotif;
    bool &skip = o.skipDescMerge;
    bool &conn = o.includeConnInfo;
    std::string &ip = o.ipAddr;
    int &port = o.port;
    std::string &group = o.metadataLabel;
    nixl_blob_t &custom = o.customParam;
    CHECK(backends.empty() && !notif_new && notif.empty() && !has && !skip && !conn && ip.empty() && group.empty() &&
              custom.empty() && port == default_comm_port,
          "nixl_opt_args_t: every field, NIXL's defaults");
    nixl_xfer_telem_t tel{};
    chrono_point_t &start = tel.startTime;
    chrono_period_us_t &post = tel.postDuration;
    chrono_period_us_t &xfer = tel.xferDuration;
    size_t &bytes = tel.totalBytes;
    size_t &count = tel.descCount;
    CHECK(bytes == 0 && count == 0 && post.count() == 0 && xfer.count() == 0 &&
              start == chrono_point_t{},
          "nixlXferTelemetry: every field");
}

void
config() {
    nixlAgentConfig d;
    CHECK(!d.useProgThread && !d.useListenThread && d.listenPort == default_comm_port &&
              d.syncMode == nixl_thread_sync_t::NIXL_THREAD_SYNC_DEFAULT && !d.captureTelemetry,
          "nixlAgentConfig(): NIXL's defaults");
    // nixlbench: nixlAgentConfig dev_meta(true, false, 0, nixl_thread_sync_t::NIXL_THREAD_SYNC_RW, 1, 100000)
    nixlAgentConfig bench(true, false, 0, nixl_thread_sync_t::NIXL_THREAD_SYNC_RW, 1, 100000);
    CHECK(bench.useProgThread && !bench.useListenThread && bench.listenPort == 0 &&
              bench.syncMode == nixl_thread_sync_t::NIXL_THREAD_SYNC_RW && bench.pthrDelay == 100000,
          "nixlAgentConfig: nixlbench's six arguments");
    nixlAgentConfig all(true,
                        true,
                        1234,
                        nixl_thread_sync_t::NIXL_THREAD_SYNC_STRICT,
                        2,
                        5,
                        7,
                        true,
                        std::chrono::microseconds(9));
    CHECK(all.listenPort == 1234 && all.pthrDelay == 5 && all.lthrDelay == 7 && all.captureTelemetry &&
              all.etcdWatchTimeout == std::chrono::microseconds(9),
          "nixlAgentConfig: all nine arguments");
    static_assert(!std::is_convertible_v<bool, nixlAgentConfig>, "the long constructor is explicit");
}

void
descriptors() {
    nixlBasicDesc b(0x1000, 64, 3);
    nixlBasicDesc inside(0x1010, 16, 3);
    CHECK(b.covers(inside) && b.overlaps(inside) && !(inside < b) && b != inside && !(b == inside),
          "nixlBasicDesc: covers, overlaps, ordering, equality");
    nixlBasicDesc round(b.serialize());
    CHECK(round == b, "nixlBasicDesc: serialize and the blob constructor");
    nixlBlobDesc blob(0x1000, 64, 3, "meta");
    nixlBlobDesc from_basic(b, "meta");
    nixlBlobDesc blob_round(blob.serialize());
    CHECK(blob == from_basic && blob_round == blob && blob.metaInfo == "meta", "nixlBlobDesc");
    nixlRemoteDesc r(0x1000, 64, 3, "peer");
    nixlRemoteDesc from_basic_r(b, "peer");
    nixlRemoteDesc r_round(r.serialize());
    CHECK(r == from_basic_r && r_round == r && r.remoteAgent == "peer", "nixlRemoteDesc");
    HAS(nixlBasicDesc, print, void (nixlBasicDesc::*)(const std::string &) const);
    HAS(nixlBlobDesc, print, void (nixlBlobDesc::*)(const std::string &) const);

    nixl_xfer_dlist_t l(DRAM_SEG, 0);
    l.reserve(4);
    l.addDesc(b);
    nixlBasicDesc &e = l.emplace(0x2000, 32, 3);
    CHECK(l.getType() == DRAM_SEG && l.descCount() == 2 && !l.isEmpty() && e.addr == 0x2000 && l[1].len == 32,
          "nixlDescList: getType, descCount, isEmpty, emplace, operator[]");
    CHECK(l.getIndex(b) == 0 && std::distance(l.begin(), l.end()) == 2, "nixlDescList: getIndex, iteration");
    const nixl_xfer_dlist_t &cl = l;
    CHECK(cl[0] == b && std::distance(cl.begin(), cl.end()) == 2, "nixlDescList: const access");
    std::string s = l.to_string(true);
    CHECK(!s.empty() && !l.to_string().empty(), "nixlDescList::to_string");
    l.remDesc(1);
    l.resize(3);
    CHECK(l.descCount() == 3, "nixlDescList: remDesc, resize");
    l.clear();
    CHECK(l.isEmpty(), "nixlDescList::clear");
    nixl_reg_dlist_t reg(DRAM_SEG);
    reg.addDesc(blob);
    nixl_xfer_dlist_t trimmed = reg.trim();
    CHECK(trimmed.descCount() == 1 && trimmed[0] == b, "nixlDescList::trim");
    HAS(nixl_reg_dlist_t, serialize, nixl_status_t (nixl_reg_dlist_t::*)(nixlSerDes *) const);
    HAS(nixl_reg_dlist_t, print, void (nixl_reg_dlist_t::*)() const);
    nixlSerDes sd;
    CHECK(reg.serialize(&sd) == NIXL_SUCCESS, "nixlDescList::serialize");
    nixlSerDes back;
    CHECK(back.importStr(sd.exportStr()) == NIXL_SUCCESS, "nixlSerDes: exportStr, importStr");
    nixl_reg_dlist_t reg2(&back);
    CHECK(reg2 == reg, "nixlDescList: the deserializing constructor, operator==");
}

void
agentMethods() {
    using A = nixlAgent;
    HAS(A, getAvailPlugins, nixl_status_t (A::*)(std::vector<nixl_backend_t> &));
    HAS(A, getPluginParams, nixl_status_t (A::*)(const nixl_backend_t &, nixl_mem_list_t &, nixl_b_params_t &) const);
    HAS(A,
        getBackendParams,
        nixl_status_t (A::*)(const nixlBackendH *, nixl_mem_list_t &, nixl_b_params_t &) const);
    HAS(A, createBackend, nixl_status_t (A::*)(const nixl_backend_t &, const nixl_b_params_t &, nixlBackendH *&));
    HAS(A, registerMem, nixl_status_t (A::*)(const nixl_reg_dlist_t &, Opt));
    HAS(A, deregisterMem, nixl_status_t (A::*)(const nixl_reg_dlist_t &, Opt));
    HAS(A, queryMem, nixl_status_t (A::*)(const nixl_reg_dlist_t &, std::vector<nixl_query_resp_t> &, Opt) const);
    HAS(A, makeConnection, nixl_status_t (A::*)(const std::string &, Opt));
    HAS(A,
        prepXferDlist,
        nixl_status_t (A::*)(const std::string &, const nixl_xfer_dlist_t &, nixlDlistH *&, Opt) const);
    HAS(A, prepXferDlist, nixl_status_t (A::*)(const nixl_xfer_dlist_t &, nixlDlistH *&, Opt) const);
    HAS(A,
        makeXferReq,
        nixl_status_t (A::*)(const nixl_xfer_op_t &,
                             const nixlDlistH *,
                             const std::vector<int> &,
                             const nixlDlistH *,
                             const std::vector<int> &,
                             nixlXferReqH *&,
                             Opt) const);
    HAS(A,
        createXferReq,
        nixl_status_t (A::*)(const nixl_xfer_op_t &,
                             const nixl_xfer_dlist_t &,
                             const nixl_xfer_dlist_t &,
                             const std::string &,
                             nixlXferReqH *&,
                             Opt) const);
    HAS(A,
        estimateXferCost,
        nixl_status_t (A::*)(const nixlXferReqH *,
                             std::chrono::microseconds &,
                             std::chrono::microseconds &,
                             nixl_cost_t &,
                             Opt) const);
    HAS(A, postXferReq, nixl_status_t (A::*)(nixlXferReqH *, Opt) const);
    HAS(A, getXferStatus, nixl_status_t (A::*)(nixlXferReqH *) const);
    HAS(A, getXferTelemetry, nixl_status_t (A::*)(const nixlXferReqH *, nixl_xfer_telem_t &) const);
    HAS(A, queryXferBackend, nixl_status_t (A::*)(const nixlXferReqH *, nixlBackendH *&) const);
    HAS(A, releaseXferReq, nixl_status_t (A::*)(nixlXferReqH *) const);
    HAS(A, prepMemView, nixl_status_t (A::*)(const nixl_remote_dlist_t &, nixlMemViewH &, Opt) const);
    HAS(A, prepMemView, nixl_status_t (A::*)(const nixl_local_dlist_t &, nixlMemViewH &, Opt) const);
    HAS(A, releaseMemView, void (A::*)(nixlMemViewH) const);
    HAS(A, releasedDlistH, nixl_status_t (A::*)(nixlDlistH *) const);
    HAS(A, getNotifs, nixl_status_t (A::*)(nixl_notifs_t &, Opt));
    HAS(A, genNotif, nixl_status_t (A::*)(const std::string &, const nixl_blob_t &, Opt) const);
    HAS(A, getLocalMD, nixl_status_t (A::*)(nixl_blob_t &) const);
    HAS(A, getLocalPartialMD, nixl_status_t (A::*)(const nixl_reg_dlist_t &, nixl_blob_t &, Opt) const);
    HAS(A, loadRemoteMD, nixl_status_t (A::*)(const nixl_blob_t &, std::string &));
    HAS(A, invalidateRemoteMD, nixl_status_t (A::*)(const std::string &));
    HAS(A, sendLocalMD, nixl_status_t (A::*)(Opt) const);
    HAS(A, sendLocalPartialMD, nixl_status_t (A::*)(const nixl_reg_dlist_t &, Opt) const);
    HAS(A, fetchRemoteMD, nixl_status_t (A::*)(const std::string, Opt));
    HAS(A, invalidateLocalMD, nixl_status_t (A::*)(Opt) const);
    HAS(A, checkRemoteMD, nixl_status_t (A::*)(const std::string, const nixl_xfer_dlist_t &) const);
    static_assert(std::is_constructible_v<nixlAgent, const std::string &, const nixlAgentConfig &>);
    static_assert(!std::is_copy_constructible_v<nixlAgent> && !std::is_move_constructible_v<nixlAgent>);
}

nixl_remote_dlist_t
remoteOf(const std::string &agent, std::vector<uint8_t> &buf) {
    nixl_remote_dlist_t l(DRAM_SEG);
    l.addDesc(nixlRemoteDesc(reinterpret_cast<uintptr_t>(buf.data()), buf.size(), 0, agent));
    return l;
}

// The calls nixlbench's NIXL worker makes, with its argument forms (defaults left out, literals, temporaries).
void
asNixlbenchCalls() {
    nixlAgentConfig cfg(true, false, 0, nixl_thread_sync_t::NIXL_THREAD_SYNC_RW, 1, 100000);
    nixlAgent agent("parity-initiator", cfg), target("parity-target", cfg);
    std::vector<nixl_backend_t> plugins;
    CHECK_ST(NIXL_SUCCESS, agent.getAvailPlugins(plugins));
    nixl_mem_list_t mems;
    nixl_b_params_t params;
    CHECK_ST(NIXL_SUCCESS, agent.getPluginParams("UCX", mems, params));
    nixlBackendH *backend = nullptr, *target_backend = nullptr;
    CHECK_ST(NIXL_SUCCESS, agent.createBackend("UCX", params, backend));
    CHECK_ST(NIXL_SUCCESS, target.createBackend("UCX", params, target_backend));
    nixl_opt_args_t opt_args, target_args;
    opt_args.backends.push_back(backend);
    target_args.backends.push_back(target_backend);
    std::vector<uint8_t> src(4096, 7), dst(4096, 0);
    nixl_reg_dlist_t reg(DRAM_SEG), target_reg(DRAM_SEG);
    reg.addDesc(nixlBlobDesc(reinterpret_cast<uintptr_t>(src.data()), src.size(), 0, ""));
    target_reg.addDesc(nixlBlobDesc(reinterpret_cast<uintptr_t>(dst.data()), dst.size(), 0, ""));
    CHECK_ST(NIXL_SUCCESS, agent.registerMem(reg, &opt_args));
    CHECK_ST(NIXL_SUCCESS, target.registerMem(target_reg, &target_args));
    std::string md, name;
    CHECK_ST(NIXL_SUCCESS, target.getLocalMD(md));
    CHECK_ST(NIXL_SUCCESS, agent.loadRemoteMD(md, name));
    CHECK(name == "parity-target", "loadRemoteMD names the target");
    nixl_xfer_dlist_t local(DRAM_SEG), remote(DRAM_SEG);
    local.addDesc(nixlBasicDesc(reinterpret_cast<uintptr_t>(src.data()), src.size(), 0));
    remote.addDesc(nixlBasicDesc(reinterpret_cast<uintptr_t>(dst.data()), dst.size(), 0));
    CHECK_ST(NIXL_SUCCESS, agent.checkRemoteMD(name, remote));
    nixlXferReqH *req = nullptr;
    opt_args.notifMsg = "0xBEEF";
    opt_args.hasNotif = true;
    CHECK_ST(NIXL_SUCCESS, agent.createXferReq(NIXL_WRITE, local, remote, name, req, &opt_args));
    if (req == nullptr) return;
    nixl_status_t rc = agent.postXferReq(req);
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (rc == NIXL_IN_PROG && std::chrono::steady_clock::now() < until) rc = agent.getXferStatus(req);
    CHECK_ST(NIXL_SUCCESS, rc);
    CHECK(dst[4095] == 7, "the WRITE moved the bytes");
    nixlBackendH *used = nullptr;
    CHECK_ST(NIXL_SUCCESS, agent.queryXferBackend(req, used));
    CHECK(used == backend, "queryXferBackend names the backend");
    CHECK_ST(NIXL_SUCCESS, agent.releaseXferReq(req));
    nixl_notifs_t notifs;
    for (int i = 0; i < 5000 && notifs.empty(); i++) {
        CHECK_ST(NIXL_SUCCESS, target.getNotifs(notifs));
        if (notifs.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    CHECK(notifs.count("parity-initiator") == 1 && notifs["parity-initiator"].front() == "0xBEEF",
          "the notification after the WRITE");
    nixlMemViewH mvh = nullptr;
    nixl_status_t view = agent.prepMemView(remoteOf(name, dst), mvh);
    CHECK(view != NIXL_SUCCESS || mvh != nullptr, "prepMemView: a view, or an error status");
    if (view == NIXL_SUCCESS) agent.releaseMemView(mvh);
    CHECK_ST(NIXL_SUCCESS, agent.invalidateRemoteMD(name));
    CHECK_ST(NIXL_SUCCESS, agent.deregisterMem(reg, &opt_args));
    CHECK_ST(NIXL_SUCCESS, target.deregisterMem(target_reg, &target_args));
}

} // namespace

int
main() {
    t::begin("parity");
    types();
    optionalArgs();
    config();
    descriptors();
    agentMethods();
    asNixlbenchCalls();
    return t::end();
}
