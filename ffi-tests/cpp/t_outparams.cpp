// t_outparams: what every nixlAgent method leaves in its out-parameters when it fails (each seeded with
// garbage first), and partial metadata of an empty list. Built unchanged against gixl and NIXL 1.5.1: the
// expectations are NIXL's, read off NIXL 1.5.1.
#include <cstdint>
#include <string>
#include <vector>

#include <nixl.h>

#include "check.hpp"

namespace {

// A pointer no call hands out: an out-parameter still holding it was left as it was.
template<class T>
T *
garbage() {
    return reinterpret_cast<T *>(static_cast<uintptr_t>(0x5eed0));
}

nixlBackendH *
backend(nixlAgent &a) {
    nixlBackendH *b = t::ucx(a);
    CHECK(b != nullptr, "createBackend(UCX)");
    return b;
}

void
emptyListMetadata(const nixlAgentConfig &cfg, nixlAgent &A, const nixl_reg_dlist_t &areg, unsigned char *abuf,
                  size_t len) {
    // NIXL puts the connection info into partial metadata when asked to, or when the list is empty.
    const nixl_reg_dlist_t empty(DRAM_SEG);
    nixl_blob_t conn_only, conn_only_flag_off, regions_only;
    CHECK_ST(NIXL_SUCCESS, A.getLocalPartialMD(empty, conn_only, nullptr));
    nixl_opt_args_t off;
    off.includeConnInfo = false;
    CHECK_ST(NIXL_SUCCESS, A.getLocalPartialMD(empty, conn_only_flag_off, &off));
    CHECK(conn_only.size() == conn_only_flag_off.size(), "empty list: the same blob with includeConnInfo false");
    CHECK_ST(NIXL_SUCCESS, A.getLocalPartialMD(areg, regions_only, nullptr));

    // A fresh agent learns A from the connection-only blob, then its regions from the region-only one.
    nixlAgent C("cpp-out-C", cfg);
    backend(C);
    std::string name = "seed";
    CHECK_ST(NIXL_SUCCESS, C.loadRemoteMD(conn_only, name));
    CHECK(name == "cpp-out-A", "the connection-only blob names its agent");
    const nixl_xfer_dlist_t none(DRAM_SEG);
    CHECK_ST(NIXL_SUCCESS, C.checkRemoteMD("cpp-out-A", none));
    std::string again;
    CHECK_ST(NIXL_SUCCESS, C.loadRemoteMD(regions_only, again));
    nixl_xfer_dlist_t ax(DRAM_SEG);
    ax.addDesc(nixlBasicDesc((uintptr_t)abuf, len, 0));
    CHECK_ST(NIXL_SUCCESS, C.checkRemoteMD("cpp-out-A", ax));

    std::vector<unsigned char> cbuf(len, 0);
    nixl_reg_dlist_t creg(DRAM_SEG);
    creg.addDesc(nixlBlobDesc((uintptr_t)cbuf.data(), len, 0, ""));
    CHECK_ST(NIXL_SUCCESS, C.registerMem(creg));
    nixl_xfer_dlist_t cx(DRAM_SEG);
    cx.addDesc(nixlBasicDesc((uintptr_t)cbuf.data(), len, 0));
    nixlXferReqH *r = nullptr;
    CHECK_ST(NIXL_SUCCESS, C.createXferReq(NIXL_READ, cx, ax, "cpp-out-A", r));
    if (r != nullptr) {
        CHECK_ST(NIXL_SUCCESS, t::wait(C, r, C.postXferReq(r)));
        CHECK(std::vector<unsigned char>(abuf, abuf + len) == cbuf, "READ over metadata loaded in two parts");
        CHECK_ST(NIXL_SUCCESS, C.releaseXferReq(r));
    }
    CHECK_ST(NIXL_SUCCESS, C.invalidateRemoteMD("cpp-out-A"));
    CHECK_ST(NIXL_SUCCESS, C.deregisterMem(creg));

    // Without the connection info, an agent that does not know A cannot load its regions.
    nixlAgent D("cpp-out-D", cfg);
    backend(D);
    std::string unchanged = "seed";
    CHECK(D.loadRemoteMD(regions_only, unchanged) != NIXL_SUCCESS, "regions without connection info: refused");
    CHECK(unchanged == "seed", "failed loadRemoteMD leaves agent_name as it was");
}

} // namespace

int
main() {
    t::begin("t_outparams");
    nixlAgentConfig cfg(true);
    nixlAgent A("cpp-out-A", cfg);
    nixlAgent B("cpp-out-B", cfg);

    nixl_mem_list_t mems{VRAM_SEG};
    nixl_b_params_t params{{"seed", "seed"}};
    CHECK(A.getPluginParams("NO_SUCH_PLUGIN", mems, params) != NIXL_SUCCESS, "getPluginParams: unknown plugin");
    CHECK(mems.size() == 1 && mems[0] == VRAM_SEG && params.count("seed") == 1,
          "failed getPluginParams leaves mems and params as they were");

    nixlBackendH *ba = backend(A);
    backend(B);
    nixlBackendH *dup = garbage<nixlBackendH>();
    CHECK(A.createBackend("UCX", params, dup) != NIXL_SUCCESS, "createBackend: a second UCX backend");
    CHECK(dup == garbage<nixlBackendH>(), "failed createBackend leaves the handle as it was");

    const size_t len = 1 << 16;
    std::vector<unsigned char> abuf(len), bbuf(len, 0), stray(len, 0);
    for (size_t i = 0; i < len; i++) abuf[i] = (unsigned char)(i * 7 + 1);
    nixl_reg_dlist_t areg(DRAM_SEG), breg(DRAM_SEG);
    areg.addDesc(nixlBlobDesc((uintptr_t)abuf.data(), len, 0, ""));
    breg.addDesc(nixlBlobDesc((uintptr_t)bbuf.data(), len, 0, ""));
    CHECK_ST(NIXL_SUCCESS, A.registerMem(areg));
    CHECK_ST(NIXL_SUCCESS, B.registerMem(breg));

    std::vector<nixl_query_resp_t> resp(3);
    CHECK_ST(NIXL_ERR_INVALID_PARAM, A.queryMem(areg, resp, nullptr));
    CHECK(resp.size() == 3, "failed queryMem leaves resp as it was");

    nixl_blob_t md = "seed";
    nixl_reg_dlist_t unregistered(DRAM_SEG);
    unregistered.addDesc(nixlBlobDesc((uintptr_t)stray.data(), len, 0, ""));
    CHECK(A.getLocalPartialMD(unregistered, md, nullptr) != NIXL_SUCCESS, "partial metadata of unregistered memory");
    CHECK(md == "seed", "failed getLocalPartialMD leaves the blob as it was");

    std::string name = "seed";
    CHECK(B.loadRemoteMD("not metadata", name) != NIXL_SUCCESS, "loadRemoteMD of garbage");
    CHECK(name == "seed", "failed loadRemoteMD leaves agent_name as it was");

    nixl_xfer_dlist_t ax(DRAM_SEG), bx(DRAM_SEG), strayx(DRAM_SEG), vram(VRAM_SEG);
    ax.addDesc(nixlBasicDesc((uintptr_t)abuf.data(), len, 0));
    bx.addDesc(nixlBasicDesc((uintptr_t)bbuf.data(), len, 0));
    strayx.addDesc(nixlBasicDesc((uintptr_t)stray.data(), len, 0));
    vram.addDesc(nixlBasicDesc(0x10000, 64, 0));

    // prepXferDlist: a peer that is not loaded, or a memory type nobody registered, leaves the handle; a
    // loaded peer (or this agent) whose registrations do not cover the list sets it to nullptr.
    nixlDlistH *h = garbage<nixlDlistH>();
    CHECK_ST(NIXL_ERR_NOT_FOUND, B.prepXferDlist("cpp-out-A", ax, h));
    CHECK(h == garbage<nixlDlistH>(), "prepXferDlist, peer not loaded: handle left as it was");
    nixl_blob_t amd;
    CHECK_ST(NIXL_SUCCESS, A.getLocalMD(amd));
    CHECK_ST(NIXL_SUCCESS, B.loadRemoteMD(amd, name));
    h = garbage<nixlDlistH>();
    CHECK_ST(NIXL_ERR_NOT_FOUND, B.prepXferDlist("cpp-out-A", strayx, h));
    CHECK(h == nullptr, "prepXferDlist, peer loaded, descriptors not registered there: handle set to nullptr");
    h = garbage<nixlDlistH>();
    CHECK_ST(NIXL_ERR_NOT_FOUND, B.prepXferDlist(NIXL_INIT_AGENT, strayx, h));
    CHECK(h == nullptr, "prepXferDlist, local descriptors not registered: handle set to nullptr");
    h = garbage<nixlDlistH>();
    CHECK_ST(NIXL_ERR_NOT_FOUND, B.prepXferDlist(NIXL_INIT_AGENT, vram, h));
    CHECK(h == garbage<nixlDlistH>(), "prepXferDlist, no registration of that memory type: handle left as it was");

    // makeXferReq clears its handle on entry, whatever the failure.
    nixlDlistH *lh = nullptr, *rh = nullptr;
    CHECK_ST(NIXL_SUCCESS, B.prepXferDlist(NIXL_INIT_AGENT, bx, lh));
    CHECK_ST(NIXL_SUCCESS, B.prepXferDlist("cpp-out-A", ax, rh));
    nixlXferReqH *r = garbage<nixlXferReqH>();
    CHECK_ST(NIXL_ERR_INVALID_PARAM, B.makeXferReq(NIXL_READ, lh, {0}, rh, {0, 0}, r));
    CHECK(r == nullptr, "makeXferReq, index counts differ: handle set to nullptr");
    r = garbage<nixlXferReqH>();
    CHECK_ST(NIXL_ERR_INVALID_PARAM, B.makeXferReq(NIXL_READ, rh, {0}, lh, {0}, r));
    CHECK(r == nullptr, "makeXferReq, sides swapped: handle set to nullptr");

    // createXferReq clears its handle on entry too.
    r = garbage<nixlXferReqH>();
    CHECK_ST(NIXL_ERR_NOT_FOUND, B.createXferReq(NIXL_READ, bx, ax, "cpp-out-nobody", r));
    CHECK(r == nullptr, "createXferReq, unknown agent: handle set to nullptr");
    r = garbage<nixlXferReqH>();
    CHECK_ST(NIXL_ERR_INVALID_PARAM, B.createXferReq(NIXL_READ, bx, nixl_xfer_dlist_t(DRAM_SEG), "cpp-out-A", r));
    CHECK(r == nullptr, "createXferReq, list sizes differ: handle set to nullptr");
    r = garbage<nixlXferReqH>();
    CHECK_ST(NIXL_ERR_NOT_FOUND, B.createXferReq(NIXL_READ, bx, strayx, "cpp-out-A", r));
    CHECK(r == nullptr, "createXferReq, remote descriptors not registered: handle set to nullptr");

    // A request made against a peer that is then invalidated: the estimate fails and writes nothing.
    nixlXferReqH *live = nullptr;
    CHECK_ST(NIXL_SUCCESS, B.makeXferReq(NIXL_READ, lh, {0}, rh, {0}, live));
    if (live != nullptr) {
        CHECK_ST(NIXL_SUCCESS, t::wait(B, live, B.postXferReq(live)));
        CHECK(bbuf == abuf, "READ by prepped lists");
        nixl_xfer_telem_t tel{};
        tel.totalBytes = 77;
        if (getenv("NIXL_TELEMETRY_ENABLE") == nullptr) {
            CHECK_ST(NIXL_ERR_NO_TELEMETRY, B.getXferTelemetry(live, tel));
            CHECK(tel.totalBytes == 77, "failed getXferTelemetry leaves the telemetry as it was");
        }
        CHECK_ST(NIXL_SUCCESS, B.invalidateRemoteMD("cpp-out-A"));
        std::chrono::microseconds dur{-7}, margin{-8};
        nixl_cost_t method = static_cast<nixl_cost_t>(9);
        CHECK_ST(NIXL_ERR_NOT_FOUND, B.estimateXferCost(live, dur, margin, method));
        CHECK(dur.count() == -7 && margin.count() == -8 && static_cast<int>(method) == 9,
              "failed estimateXferCost leaves its outputs as they were");
        CHECK_ST(NIXL_SUCCESS, B.releaseXferReq(live));
    }
    CHECK_ST(NIXL_SUCCESS, B.releasedDlistH(lh));
    CHECK_ST(NIXL_SUCCESS, B.releasedDlistH(rh));

    (void)ba;
    emptyListMetadata(cfg, A, areg, abuf.data(), len);

    CHECK_ST(NIXL_SUCCESS, A.deregisterMem(areg));
    CHECK_ST(NIXL_SUCCESS, B.deregisterMem(breg));
    return t::end();
}
