// t_example: the flow of NIXL's C++ example program, written anew for gixl: two agents, plugin discovery,
// backend creation with the plugin's defaults, registration, metadata exchange, a WRITE with a notification
// polled to completion alongside getNotifs, release, deregistration and invalidation.
#include <cstdlib>
#include <cstring>
#include <iostream>

#include <nixl.h>

#include "check.hpp"

int
main() {
    t::begin("t_example");
    const std::string n1 = "example-1", n2 = "example-2";
    nixlAgentConfig cfg(true);
    nixlAgent A1(n1, cfg);
    nixlAgent A2(n2, cfg);

    std::vector<nixl_backend_t> plugins;
    CHECK_ST(NIXL_SUCCESS, A1.getAvailPlugins(plugins));
    nixl_b_params_t init1, init2;
    nixl_mem_list_t mems1, mems2;
    CHECK_ST(NIXL_SUCCESS, A1.getPluginParams("UCX", mems1, init1));
    CHECK_ST(NIXL_SUCCESS, A2.getPluginParams("UCX", mems2, init2));
    nixlBackendH *b1 = nullptr, *b2 = nullptr;
    CHECK_ST(NIXL_SUCCESS, A1.createBackend("UCX", init1, b1));
    CHECK_ST(NIXL_SUCCESS, A2.createBackend("UCX", init2, b2));
    nixl_opt_args_t x1, x2;
    x1.backends.push_back(b1);
    x2.backends.push_back(b2);
    CHECK_ST(NIXL_SUCCESS, A1.getBackendParams(b1, mems1, init1));
    for (const auto &kv : init1) std::cout << "# param " << kv.first << " = " << kv.second << "\n";
    for (nixl_mem_t m : mems1) std::cout << "# mem " << nixlEnumStrings::memTypeStr(m) << "\n";

    const size_t len = 256;
    void *addr1 = calloc(1, len);
    void *addr2 = calloc(1, len);
    memset(addr1, 0xbb, len);
    nixlBlobDesc buff1, buff2;
    buff1.addr = (uintptr_t)addr1;
    buff1.len = len;
    buff1.devId = 0;
    buff2.addr = (uintptr_t)addr2;
    buff2.len = len;
    buff2.devId = 0;
    nixl_reg_dlist_t dlist1(DRAM_SEG), dlist2(DRAM_SEG);
    dlist1.addDesc(buff1);
    dlist2.addDesc(buff2);
    CHECK_ST(NIXL_SUCCESS, A1.registerMem(dlist1, &x1));
    CHECK_ST(NIXL_SUCCESS, A2.registerMem(dlist2, &x2));

    std::string meta2, got_name;
    CHECK_ST(NIXL_SUCCESS, A2.getLocalMD(meta2));
    CHECK_ST(NIXL_SUCCESS, A1.loadRemoteMD(meta2, got_name));
    CHECK(got_name == n2, "loaded example-2's metadata");

    // 8 bytes from offset 16 of buffer 1 to offset 8 of buffer 2.
    nixl_xfer_dlist_t src(DRAM_SEG), dst(DRAM_SEG);
    src.addDesc(nixlBasicDesc((uintptr_t)addr1 + 16, 8, 0));
    dst.addDesc(nixlBasicDesc((uintptr_t)addr2 + 8, 8, 0));
    x1.notif = "notification"; // NIXL 1.5's optional<blob> form of notifMsg + hasNotif
    nixlXferReqH *req = nullptr;
    CHECK_ST(NIXL_SUCCESS, A1.createXferReq(NIXL_WRITE, src, dst, n2, req, &x1));
    nixl_status_t st = A1.postXferReq(req);
    CHECK(st >= NIXL_SUCCESS, "posted (" + t::name(st) + ")");

    nixl_notifs_t notifs;
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while ((st == NIXL_IN_PROG || notifs.empty()) && std::chrono::steady_clock::now() < until) {
        if (st == NIXL_IN_PROG) st = A1.getXferStatus(req);
        if (notifs.empty() && A2.getNotifs(notifs) != NIXL_SUCCESS) break;
        std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    CHECK_ST(NIXL_SUCCESS, st);
    CHECK(notifs.size() == 1 && notifs[n1].size() == 1 && notifs[n1].front() == "notification",
          "exactly one notification, \"notification\", from example-1");
    const unsigned char *d = static_cast<const unsigned char *>(addr2);
    bool ok = true;
    for (size_t i = 0; i < len; i++) ok = ok && d[i] == ((i >= 8 && i < 16) ? 0xbb : 0);
    CHECK(ok, "only bytes 8..16 of buffer 2 were written, with 0xbb");

    CHECK_ST(NIXL_SUCCESS, A1.releaseXferReq(req));
    CHECK_ST(NIXL_SUCCESS, A1.deregisterMem(dlist1, &x1));
    CHECK_ST(NIXL_SUCCESS, A2.deregisterMem(dlist2, &x2));
    CHECK_ST(NIXL_SUCCESS, A1.invalidateRemoteMD(n2));
    free(addr1);
    free(addr2);
    return t::end();
}
