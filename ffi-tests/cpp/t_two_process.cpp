// t_two_process: a driver D and a peer P (this binary re-run with --peer) over UCX, metadata through a pipe.
//   1. D READs P's buffer with a notification; P waits for it with getNotifs; D checks the bytes.
//   2. Peer restart: D kills P and starts P2 under the same name. D's old request fails (REMOTE_DISCONNECT
//      before invalidation, NOT_FOUND after, also after reloading P2), never reaches P2; new requests work.
// Pipe protocol D -> P: 1 byte command + u32 length + payload ('W' wait for notification payload, 'V' verify
// the buffer holds seed u32's pattern, 'Q' quit); P -> D: metadata record first, then 'Y'/'N' per command.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <nixl.h>

#include "check.hpp"

static const size_t kLen = 256 * 1024;
static const char *kPeer = "cpp-tp-peer";
static const char *kDriver = "cpp-tp-driver";
static const int kPeerR = 200, kPeerW = 201;

static void
fill(unsigned char *p, size_t n, uint32_t seed) {
    for (size_t i = 0; i < n; i++) p[i] = (unsigned char)((i * 31 + seed * 17) ^ (i >> 8));
}

static bool
holds(const unsigned char *p, size_t n, uint32_t seed) {
    for (size_t i = 0; i < n; i++)
        if (p[i] != (unsigned char)((i * 31 + seed * 17) ^ (i >> 8))) return false;
    return true;
}

static bool
readFull(int fd, void *p, size_t n) {
    auto *c = static_cast<unsigned char *>(p);
    while (n) {
        pollfd pfd{fd, POLLIN, 0};
        if (poll(&pfd, 1, 30000) <= 0) return false;
        ssize_t r = read(fd, c, n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return false;
        c += r;
        n -= (size_t)r;
    }
    return true;
}

static bool
writeFull(int fd, const void *p, size_t n) {
    auto *c = static_cast<const unsigned char *>(p);
    while (n) {
        ssize_t r = write(fd, c, n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return false;
        c += r;
        n -= (size_t)r;
    }
    return true;
}

static int
peerMain(uint32_t seed) {
    nixlAgent P(kPeer, nixlAgentConfig(true));
    if (t::ucx(P) == nullptr) return 10;
    std::vector<unsigned char> buf(kLen);
    fill(buf.data(), kLen, seed);
    nixl_reg_dlist_t reg(DRAM_SEG);
    reg.addDesc(nixlBlobDesc((uintptr_t)buf.data(), kLen, 0, ""));
    if (P.registerMem(reg) != NIXL_SUCCESS) return 11;
    nixl_blob_t md;
    if (P.getLocalMD(md) != NIXL_SUCCESS) return 12;
    const uint64_t hdr[3] = {(uint64_t)(uintptr_t)buf.data(), kLen, md.size()};
    if (!writeFull(kPeerW, hdr, sizeof hdr) || !writeFull(kPeerW, md.data(), md.size())) return 13;
    for (;;) {
        char op = 0;
        uint32_t n = 0;
        if (!readFull(kPeerR, &op, 1) || !readFull(kPeerR, &n, sizeof n)) return 14;
        std::string arg(n, '\0');
        if (n && !readFull(kPeerR, &arg[0], n)) return 15;
        bool ok = false;
        if (op == 'Q') {
            ok = P.deregisterMem(reg) == NIXL_SUCCESS;
            char r = ok ? 'Y' : 'N';
            writeFull(kPeerW, &r, 1);
            return ok ? 0 : 16;
        } else if (op == 'W') {
            ok = t::waitNotif(P, kDriver, arg);
        } else if (op == 'V' && n == 4) {
            uint32_t s;
            memcpy(&s, arg.data(), 4);
            ok = holds(buf.data(), kLen, s);
        }
        char r = ok ? 'Y' : 'N';
        if (!writeFull(kPeerW, &r, 1)) return 17;
    }
}

struct Peer {
    pid_t pid = -1;
    int to = -1, from = -1;
    uint64_t addr = 0;
    nixl_blob_t md;
};

static bool
spawn(Peer &p, uint32_t seed) {
    int d2p[2], p2d[2];
    if (pipe2(d2p, O_CLOEXEC) || pipe2(p2d, O_CLOEXEC)) return false;
    char seed_s[16];
    snprintf(seed_s, sizeof seed_s, "%u", seed);
    pid_t pid = fork();
    if (pid < 0) return false;
    if (pid == 0) {
        // Async-signal-safe calls only until exec: the driver has threads.
        if (dup2(d2p[0], kPeerR) < 0 || dup2(p2d[1], kPeerW) < 0) _exit(120);
        char self[] = "/proc/self/exe", flag[] = "--peer";
        char *argv[] = {self, flag, seed_s, nullptr};
        execv(self, argv);
        _exit(121);
    }
    close(d2p[0]);
    close(p2d[1]);
    p.pid = pid;
    p.to = d2p[1];
    p.from = p2d[0];
    uint64_t hdr[3];
    if (!readFull(p.from, hdr, sizeof hdr)) return false;
    p.addr = hdr[0];
    p.md.resize(hdr[2]);
    return readFull(p.from, &p.md[0], hdr[2]);
}

static bool
cmd(Peer &p, char op, const void *arg, uint32_t n) {
    char r = 0;
    if (!writeFull(p.to, &op, 1) || !writeFull(p.to, &n, sizeof n) || (n && !writeFull(p.to, arg, n))) return false;
    return readFull(p.from, &r, 1) && r == 'Y';
}

static bool
verify(Peer &p, uint32_t seed) {
    return cmd(p, 'V', &seed, 4);
}

static bool
got(Peer &p, const std::string &msg) {
    return cmd(p, 'W', msg.data(), (uint32_t)msg.size());
}

static nixl_opt_args_t
withNotif(const std::string &msg) {
    nixl_opt_args_t o;
    o.notifMsg = msg;
    o.hasNotif = true;
    return o;
}

static int
driverMain() {
    t::begin("t_two_process");
    alarm(300);
    Peer p1, p2;
    CHECK(spawn(p1, 11), "peer P started and sent its metadata");
    nixlAgent D(kDriver, nixlAgentConfig(true));
    CHECK(t::ucx(D) != nullptr, "driver's UCX backend");
    std::vector<unsigned char> local(kLen, 0);
    nixl_reg_dlist_t reg(DRAM_SEG);
    reg.addDesc(nixlBlobDesc((uintptr_t)local.data(), kLen, 0, ""));
    CHECK_ST(NIXL_SUCCESS, D.registerMem(reg));
    std::string name;
    CHECK_ST(NIXL_SUCCESS, D.loadRemoteMD(p1.md, name));
    CHECK(name == kPeer, "D loaded P's metadata");

    nixl_xfer_dlist_t ll(DRAM_SEG), rl1(DRAM_SEG);
    ll.addDesc(nixlBasicDesc((uintptr_t)local.data(), kLen, 0));
    rl1.addDesc(nixlBasicDesc((uintptr_t)p1.addr, kLen, 0));
    nixl_opt_args_t o = withNotif("read-done-1");
    nixlXferReqH *read_old = nullptr;
    CHECK_ST(NIXL_SUCCESS, D.createXferReq(NIXL_READ, ll, rl1, kPeer, read_old, &o));
    CHECK_ST(NIXL_SUCCESS, t::wait(D, read_old, D.postXferReq(read_old)));
    CHECK(holds(local.data(), kLen, 11), "D READ P's buffer correctly");
    CHECK(got(p1, "read-done-1"), "P received the READ notification");

    nixlDlistH *hl = nullptr, *hr_old = nullptr;
    CHECK_ST(NIXL_SUCCESS, D.prepXferDlist(NIXL_INIT_AGENT, ll, hl));
    CHECK_ST(NIXL_SUCCESS, D.prepXferDlist(kPeer, rl1, hr_old));
    o = withNotif("old-write");
    nixlXferReqH *write_old = nullptr;
    CHECK_ST(NIXL_SUCCESS, D.makeXferReq(NIXL_WRITE, hl, {0}, hr_old, {0}, write_old, &o));
    fill(local.data(), kLen, 12);
    CHECK_ST(NIXL_SUCCESS, t::wait(D, write_old, D.postXferReq(write_old)));
    CHECK(got(p1, "old-write"), "P received the WRITE notification");
    CHECK(verify(p1, 12), "P's buffer holds D's pattern");

    // Peer restart.
    int st = 0;
    CHECK(kill(p1.pid, SIGKILL) == 0, "SIGKILL sent to P");
    waitpid(p1.pid, &st, 0);
    close(p1.to);
    close(p1.from);
    CHECK(spawn(p2, 21), "P2 (same name) started");
    fill(local.data(), kLen, 14);
    CHECK_ST(NIXL_ERR_REMOTE_DISCONNECT, t::wait(D, write_old, D.postXferReq(write_old)));
    // NIXL's gtest error_handling: the request's status after a failed post is that failure, not NOT_POSTED.
    CHECK_ST(NIXL_ERR_REMOTE_DISCONNECT, D.getXferStatus(write_old));
    CHECK_ST(NIXL_ERR_NOT_ALLOWED, D.loadRemoteMD(p2.md, name));
    CHECK_ST(NIXL_SUCCESS, D.invalidateRemoteMD(kPeer));
    CHECK_ST(NIXL_ERR_NOT_FOUND, D.postXferReq(write_old));
    CHECK_ST(NIXL_SUCCESS, D.loadRemoteMD(p2.md, name));
    CHECK_ST(NIXL_ERR_NOT_FOUND, D.postXferReq(write_old));
    CHECK_ST(NIXL_ERR_NOT_FOUND, D.postXferReq(read_old));
    // A post refused as stale leaves each request's status as its last post left it.
    CHECK_ST(NIXL_ERR_REMOTE_DISCONNECT, D.getXferStatus(write_old));
    CHECK_ST(NIXL_SUCCESS, D.getXferStatus(read_old));
    nixlXferReqH *r_bad = nullptr;
    CHECK_ST(NIXL_ERR_NOT_FOUND, D.makeXferReq(NIXL_WRITE, hl, {0}, hr_old, {0}, r_bad));
    CHECK(verify(p2, 21), "no byte of P2's buffer changed through the old handles");

    nixl_xfer_dlist_t rl2(DRAM_SEG);
    rl2.addDesc(nixlBasicDesc((uintptr_t)p2.addr, kLen, 0));
    std::fill(local.begin(), local.end(), 0);
    o = withNotif("read-done-2");
    nixlXferReqH *read_new = nullptr;
    CHECK_ST(NIXL_SUCCESS, D.createXferReq(NIXL_READ, ll, rl2, kPeer, read_new, &o));
    if (read_new) {
        CHECK_ST(NIXL_SUCCESS, t::wait(D, read_new, D.postXferReq(read_new)));
        CHECK(holds(local.data(), kLen, 21), "new READ returns P2's pattern");
        CHECK(got(p2, "read-done-2"), "P2 received the new READ's notification");
        CHECK_ST(NIXL_SUCCESS, D.releaseXferReq(read_new));
    }
    CHECK_ST(NIXL_SUCCESS, D.releaseXferReq(write_old));
    CHECK_ST(NIXL_SUCCESS, D.releaseXferReq(read_old));
    CHECK_ST(NIXL_SUCCESS, D.releasedDlistH(hr_old));
    CHECK_ST(NIXL_SUCCESS, D.releasedDlistH(hl));
    CHECK(cmd(p2, 'Q', nullptr, 0), "P2 deregistered and quit");
    close(p2.to);
    close(p2.from);
    waitpid(p2.pid, &st, 0);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "P2 exited 0");
    CHECK_ST(NIXL_SUCCESS, D.deregisterMem(reg));
    return t::end();
}

int
main(int argc, char **argv) {
    if (argc == 3 && strcmp(argv[1], "--peer") == 0) return peerMain((uint32_t)strtoul(argv[2], nullptr, 10));
    return driverMain();
}
