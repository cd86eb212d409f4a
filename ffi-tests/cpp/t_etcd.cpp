// t_etcd: the etcd metadata methods (sendLocalMD, sendLocalPartialMD with metadataLabel, fetchRemoteMD with and
// without a label, invalidateLocalMD and the watch that follows) against a real etcd on loopback ports, which
// this program starts. Skips (visibly) when no etcd binary is installed.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <vector>

#include <nixl.h>

#include "check.hpp"

extern char **environ;

static int
freePort() {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t n = sizeof a;
    if (fd < 0 || bind(fd, (sockaddr *)&a, sizeof a) != 0 || getsockname(fd, (sockaddr *)&a, &n) != 0) return -1;
    close(fd);
    return ntohs(a.sin_port);
}

static bool
accepting(int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    const bool ok = fd >= 0 && connect(fd, (sockaddr *)&a, sizeof a) == 0;
    if (fd >= 0) close(fd);
    return ok;
}

static nixl_xfer_dlist_t
xl(const std::vector<unsigned char> &b) {
    nixl_xfer_dlist_t l(DRAM_SEG);
    l.addDesc(nixlBasicDesc((uintptr_t)b.data(), b.size(), 0));
    return l;
}

int
main() {
    t::begin("t_etcd");
    const char *bin = "/usr/bin/etcd";
    if (access(bin, X_OK) != 0) {
        t::skip("etcd metadata methods", "no etcd binary at /usr/bin/etcd");
        return t::end();
    }
    char dir[] = "/tmp/gixl-cpp-etcd-XXXXXX";
    if (mkdtemp(dir) == nullptr) {
        CHECK(false, "temporary etcd data directory");
        return t::end();
    }
    const int cport = freePort(), pport = freePort();
    const std::string client = "http://127.0.0.1:" + std::to_string(cport);
    const std::string peer = "http://127.0.0.1:" + std::to_string(pport);
    const std::string cluster = "cpp-etcd=" + peer;
    std::vector<std::string> args = {bin,
                                     "--data-dir",
                                     dir,
                                     "--name",
                                     "cpp-etcd",
                                     "--listen-client-urls",
                                     client,
                                     "--advertise-client-urls",
                                     client,
                                     "--listen-peer-urls",
                                     peer,
                                     "--initial-advertise-peer-urls",
                                     peer,
                                     "--initial-cluster",
                                     cluster,
                                     "--log-level",
                                     "error"};
    std::vector<char *> argv;
    for (auto &a : args) argv.push_back(&a[0]);
    argv.push_back(nullptr);
    pid_t etcd = -1;
    if (posix_spawn(&etcd, bin, nullptr, nullptr, argv.data(), environ) != 0) {
        CHECK(false, "etcd started");
        return t::end();
    }
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (!accepting(cport) && std::chrono::steady_clock::now() < end)
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    CHECK(accepting(cport), "etcd accepts clients on " + client);
    setenv("NIXL_ETCD_ENDPOINTS", client.c_str(), 1);

    {
        nixlAgentConfig cfg(true);
        nixlAgent P("cpp-etcd-prefill", cfg), D("cpp-etcd-decode", cfg), C("cpp-etcd-other", cfg);
        CHECK(t::ucx(P) && t::ucx(D) && t::ucx(C), "three agents with UCX");
        std::vector<unsigned char> b1(4096, 0x11), b2(4096, 0x22), local(4096, 0);
        nixl_reg_dlist_t r1(DRAM_SEG), both(DRAM_SEG), lr(DRAM_SEG);
        r1.addDesc(nixlBlobDesc((uintptr_t)b1.data(), b1.size(), 0, ""));
        both = r1;
        both.addDesc(nixlBlobDesc((uintptr_t)b2.data(), b2.size(), 0, ""));
        lr.addDesc(nixlBlobDesc((uintptr_t)local.data(), local.size(), 0, ""));
        CHECK_ST(NIXL_SUCCESS, P.registerMem(both));
        CHECK_ST(NIXL_SUCCESS, D.registerMem(lr));

        CHECK_ST(NIXL_SUCCESS, P.sendLocalMD());
        CHECK_ST(NIXL_SUCCESS, D.fetchRemoteMD("cpp-etcd-prefill"));
        CHECK_ST(NIXL_SUCCESS, t::until(NIXL_SUCCESS, [&] { return D.checkRemoteMD("cpp-etcd-prefill", xl(b2)); }, 20));

        nixl_opt_args_t nolabel;
        CHECK_ST(NIXL_ERR_INVALID_PARAM, P.sendLocalPartialMD(r1, &nolabel));
        nixl_opt_args_t lab;
        lab.metadataLabel = "blocks-1";
        lab.includeConnInfo = true;
        CHECK_ST(NIXL_SUCCESS, P.sendLocalPartialMD(r1, &lab));
        CHECK_ST(NIXL_SUCCESS, C.fetchRemoteMD("cpp-etcd-prefill", &lab));
        CHECK_ST(NIXL_SUCCESS, t::until(NIXL_SUCCESS, [&] { return C.checkRemoteMD("cpp-etcd-prefill", xl(b1)); }, 20));
        CHECK_ST(NIXL_ERR_NOT_FOUND, C.checkRemoteMD("cpp-etcd-prefill", xl(b2)));

        // The fetched metadata carries a READ with a notification.
        nixl_opt_args_t n;
        n.notif = "etcd-read";
        nixlXferReqH *r = nullptr;
        CHECK_ST(NIXL_SUCCESS, D.createXferReq(NIXL_READ, xl(local), xl(b2), "cpp-etcd-prefill", r, &n));
        if (r) {
            CHECK_ST(NIXL_SUCCESS, t::wait(D, r, D.postXferReq(r)));
            CHECK(local == b2, "READ through etcd-fetched metadata");
            CHECK(t::waitNotif(P, "cpp-etcd-decode", "etcd-read"), "P got the READ's notification");
            CHECK_ST(NIXL_SUCCESS, D.releaseXferReq(r));
        }

        // invalidateLocalMD deletes P's keys; the watchers of D and C drop P.
        CHECK_ST(NIXL_SUCCESS, P.invalidateLocalMD());
        const nixl_xfer_dlist_t none(DRAM_SEG);
        CHECK_ST(NIXL_ERR_NOT_FOUND, t::until(NIXL_ERR_NOT_FOUND, [&] { return D.checkRemoteMD("cpp-etcd-prefill", none); }, 20));
        // C loaded P only through a labelled partial fetch. NIXL 1.5.1 usually drops P there too, but not always:
        // one run in several keeps it past 20 s (its watch of a label-only fetch), so against NIXL a miss is
        // reported as a skip, not a failure. gixl must drop it every time.
        const nixl_status_t c_dropped =
            t::until(NIXL_ERR_NOT_FOUND, [&] { return C.checkRemoteMD("cpp-etcd-prefill", none); }, 20);
        if (t::oracle && c_dropped != NIXL_ERR_NOT_FOUND)
            t::skip("C, which fetched only a label, drops P", "NIXL 1.5.1 kept it past 20 s in this run");
        else
            CHECK_ST(NIXL_ERR_NOT_FOUND, c_dropped);
        CHECK_ST(NIXL_SUCCESS, D.deregisterMem(lr));
        CHECK_ST(NIXL_SUCCESS, P.deregisterMem(both));
    }
    kill(etcd, SIGTERM);
    int st = 0;
    waitpid(etcd, &st, 0);
    const std::string rm = std::string("rm -rf ") + dir;
    CHECK(system(rm.c_str()) == 0, "etcd stopped and its data removed");
    return t::end();
}
