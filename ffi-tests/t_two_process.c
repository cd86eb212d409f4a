/*
 * t_two_process: a driver process D and a peer process P (this same binary,
 * re-executed with --peer) talking over UCX, with metadata passed through a
 * pipe.
 *
 *   1. P registers a buffer and sends its metadata and buffer address to D.
 *      D READs the buffer with a notification; P waits for the notification;
 *      D verifies the data.  D also WRITEs into P through a prepped handle.
 *   2. Peer restart: D SIGKILLs P and starts P2 under the same agent name with
 *      a new buffer.  D checks what its old handles do (before and after
 *      invalidate_remote_md), reloads the new metadata, and checks that new
 *      handles work and that no byte of P2's buffer changed through the old
 *      handles.
 *
 * Pipe protocol, D -> P: 1 byte command + u32 length + payload.
 *   'W' payload = message: wait for a notification from D with that payload.
 *   'V' payload = u32 seed: verify the buffer holds ft_pattern(seed).
 *   'Q' quit.
 * P -> D: first the metadata record (struct md_hdr + blob), then one reply
 * byte per command: 'Y' or 'N'.
 */
#define _GNU_SOURCE
#include "util.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#define LEN (256 * 1024)
#define PEER_NAME "tp-peer"
#define DRIVER_NAME "tp-driver"
#define PIPE_TIMEOUT_MS 30000
/* Application range on x86-64 Linux, clear of ASan's heap at 0x600000000000. */
#define PEER_BUF_ADDR ((void *)0x500000000000ull)

struct md_hdr {
    uint64_t addr;
    uint64_t len;
    uint64_t md_len;
};

/* ---------- pipe helpers ---------- */

static bool read_full(int fd, void *p, size_t n)
{
    return ft_read_full(fd, p, n, PIPE_TIMEOUT_MS);
}

/* ---------- peer role ---------- */

static int peer_main(unsigned seed)
{
    int rfd = FT_PEER_R, wfd = FT_PEER_W;
    alarm(180);
    setvbuf(stdout, NULL, _IONBF, 0);

    nixl_capi_agent_t ag = NULL;
    nixl_capi_backend_t be = NULL;
    if (ft_make_agent(PEER_NAME, &ag, &be) != 0)
        return 10;
    /* P and P2 map their buffer at the same fixed address when possible, so
     * the old descriptors of D point at valid, registered memory of P2. */
    unsigned char *buf = mmap(PEER_BUF_ADDR, LEN, PROT_READ | PROT_WRITE,
                              MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
    if (buf == MAP_FAILED)
        buf = mmap(NULL, LEN, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (buf == MAP_FAILED)
        return 18;
    ft_fill(buf, LEN, seed);
    if (ft_register(ag, buf, LEN) != 0)
        return 11;
    void *md = NULL;
    size_t md_len = 0;
    if (nixl_capi_get_local_md(ag, &md, &md_len) != 0)
        return 12;
    struct md_hdr h = {(uint64_t)(uintptr_t)buf, LEN, md_len};
    if (!ft_write_full(wfd, &h, sizeof h) || !ft_write_full(wfd, md, md_len))
        return 13;
    free(md);

    nixl_capi_notif_map_t nm = NULL;
    nixl_capi_create_notif_map(&nm);
    size_t seen = 0; /* notifications from D already consumed */
    for (;;) {
        unsigned char op;
        uint32_t n;
        if (!read_full(rfd, &op, 1) || !read_full(rfd, &n, sizeof n))
            return 14;
        unsigned char *arg = malloc(n + 1);
        if (n && !read_full(rfd, arg, n))
            return 15;
        char reply = 'N';
        if (op == 'W') {
            if (ft_wait_notifs(ag, nm, DRIVER_NAME, seen + 1)) {
                reply = ft_notif_equals(nm, DRIVER_NAME, seen, arg, n) ? 'Y' : 'N';
                seen++;
            }
        } else if (op == 'V' && n == sizeof(uint32_t)) {
            uint32_t s;
            memcpy(&s, arg, sizeof s);
            reply = ft_verify(buf, LEN, s) < 0 ? 'Y' : 'N';
        } else if (op == 'Q') {
            free(arg);
            nixl_capi_destroy_notif_map(nm);
            int ds = ft_deregister(ag, buf, LEN);
            nixl_capi_destroy_backend(be);
            int as = nixl_capi_destroy_agent(ag);
            munmap(buf, LEN);
            reply = (ds == 0 && as == 0) ? 'Y' : 'N';
            ft_write_full(wfd, &reply, 1);
            return reply == 'Y' ? 0 : 16;
        }
        free(arg);
        if (!ft_write_full(wfd, &reply, 1))
            return 17;
    }
}

/* ---------- driver role ---------- */

struct peer {
    pid_t pid;
    int to;   /* D writes commands here */
    int from; /* D reads metadata and replies here */
    struct md_hdr hdr;
    void *md;
};

static bool spawn_peer(struct peer *p, unsigned seed)
{
    char seed_s[16];
    snprintf(seed_s, sizeof seed_s, "%u", seed);
    char *argv[] = {"/proc/self/exe", "--peer", seed_s, NULL};
    pid_t pid = ft_spawn_self(argv, false, &p->to, &p->from);
    if (pid < 0)
        return false;
    p->pid = pid;
    p->md = NULL;
    if (!read_full(p->from, &p->hdr, sizeof p->hdr))
        return false;
    p->md = malloc(p->hdr.md_len);
    return read_full(p->from, p->md, p->hdr.md_len);
}

static bool cmd(struct peer *p, char op, const void *arg, uint32_t n)
{
    char r = 0;
    if (!ft_write_full(p->to, &op, 1) || !ft_write_full(p->to, &n, sizeof n) ||
        (n && !ft_write_full(p->to, arg, n)))
        return false;
    return read_full(p->from, &r, 1) && r == 'Y';
}

static bool peer_verify(struct peer *p, uint32_t seed)
{
    return cmd(p, 'V', &seed, sizeof seed);
}

static bool peer_got(struct peer *p, const char *msg)
{
    return cmd(p, 'W', msg, (uint32_t)strlen(msg));
}

static int close_peer(struct peer *p)
{
    int st = 0;
    bool ok = cmd(p, 'Q', NULL, 0);
    close(p->to);
    close(p->from);
    waitpid(p->pid, &st, 0);
    free(p->md);
    return ok && WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : -1;
}

static nixl_capi_opt_args_t notif_args(const char *msg)
{
    nixl_capi_opt_args_t o = NULL;
    nixl_capi_create_opt_args(&o);
    nixl_capi_opt_args_set_notif_msg(o, msg, strlen(msg));
    nixl_capi_opt_args_set_has_notif(o, true);
    return o;
}

static int post_wait(nixl_capi_agent_t ag, nixl_capi_xfer_req_t r, nixl_capi_opt_args_t o)
{
    int s = nixl_capi_post_xfer_req(ag, r, o);
    return s < 0 ? s : ft_wait_xfer(ag, r, s);
}

static int driver_main(void)
{
    ft_begin("t_two_process");
    alarm(300);

    struct peer p1, p2;
    REQUIRE(spawn_peer(&p1, 11), "peer P started and sent its metadata");

    nixl_capi_agent_t d = NULL;
    nixl_capi_backend_t dbe = NULL;
    REQUIRE_ST(0, ft_make_agent(DRIVER_NAME, &d, &dbe));
    unsigned char *local = calloc(1, LEN);
    REQUIRE_ST(0, ft_register(d, local, LEN));

    char *name = NULL;
    CHECK_ST(0, nixl_capi_load_remote_md(d, p1.md, p1.hdr.md_len, &name));
    CHECK(name && strcmp(name, PEER_NAME) == 0, "D loaded P's metadata as \"tp-peer\"");
    free(name);
    name = NULL;

    /* Part 1: READ P's buffer with a notification. */
    nixl_capi_xfer_dlist_t ll = ft_xfer_list(local, LEN);
    nixl_capi_xfer_dlist_t rl1 = ft_xfer_list((void *)(uintptr_t)p1.hdr.addr, LEN);
    nixl_capi_xfer_req_t read_old = NULL;
    nixl_capi_opt_args_t o = notif_args("read-done-1");
    CHECK_ST(0, nixl_capi_create_xfer_req(d, NIXL_CAPI_XFER_OP_READ, ll, rl1, PEER_NAME,
                                          &read_old, o));
    nixl_capi_destroy_opt_args(o);
    REQUIRE(read_old != NULL, "READ request for P");
    CHECK_ST(0, post_wait(d, read_old, NULL));
    CHECK(ft_verify(local, LEN, 11) < 0, "D READ P's buffer correctly");
    CHECK(peer_got(&p1, "read-done-1"), "P received the READ notification \"read-done-1\"");
    CHECK(peer_verify(&p1, 11), "READ left P's buffer unchanged");

    /* A WRITE through prepped handles, kept for the restart test. */
    nixl_capi_xfer_dlist_handle_t hl = NULL, hr_old = NULL;
    CHECK_ST(0, nixl_capi_prep_xfer_dlist(d, "", ll, &hl, NULL));
    CHECK_ST(0, nixl_capi_prep_xfer_dlist(d, PEER_NAME, rl1, &hr_old, NULL));
    REQUIRE(hl && hr_old, "prepped local and remote handles");
    const int i0[] = {0};
    nixl_capi_xfer_req_t write_old = NULL;
    o = notif_args("old-write");
    CHECK_ST(0, nixl_capi_make_xfer_req(d, NIXL_CAPI_XFER_OP_WRITE, hl, i0, 1, hr_old, i0, 1,
                                        &write_old, o));
    nixl_capi_destroy_opt_args(o);
    REQUIRE(write_old != NULL, "WRITE request for P");
    ft_fill(local, LEN, 12);
    CHECK_ST(0, post_wait(d, write_old, NULL));
    CHECK(peer_got(&p1, "old-write"), "P received the WRITE notification \"old-write\"");
    CHECK(peer_verify(&p1, 12), "P's buffer holds D's written pattern");

    /* Part 2: peer restart. */
    int st = 0;
    CHECK(kill(p1.pid, SIGKILL) == 0, "SIGKILL sent to P");
    waitpid(p1.pid, &st, 0);
    CHECK(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL, "P died of SIGKILL");
    close(p1.to);
    close(p1.from);
    free(p1.md);

    /* NIXL 1.5 does not notice the death by itself: the metadata stays cached. */
    CHECK_ST(0, nixl_capi_check_remote_md(d, PEER_NAME, NULL));

    REQUIRE(spawn_peer(&p2, 21), "peer P2 (same name) started and sent its metadata");
    printf("# P's buffer was at 0x%llx, P2's is at 0x%llx%s\n", (unsigned long long)p1.hdr.addr,
           (unsigned long long)p2.hdr.addr,
           p1.hdr.addr == p2.hdr.addr ? " (same address: old rkeys must not work)" : "");

    /* Before invalidation, the old handle targets the dead P: the backend sees
     * the peer failure (REMOTE_DISCONNECT, reported as BACKEND).  It must not
     * reach P2, which is checked below with peer_verify. */
    ft_fill(local, LEN, 14);
    CHECK_ST(-2, nixl_capi_post_xfer_req(d, write_old, NULL));
    /* The failed post is the request's status now (it completed before): an error, not SUCCESS. */
    CHECK_ST(-2, nixl_capi_get_xfer_status(d, write_old));
    CHECK_ST(-2, nixl_capi_gen_notif(d, PEER_NAME, "to-the-dead", 11, NULL));
    /* ... and in NIXL 1.5 the failure does not invalidate the cached metadata. */
    CHECK_ST(0, nixl_capi_check_remote_md(d, PEER_NAME, NULL));

    /* New connection info under a cached name: NOT_ALLOWED, reported as BACKEND. */
    CHECK_ST(-2, nixl_capi_load_remote_md(d, p2.md, p2.hdr.md_len, &name));
    free(name);
    name = NULL;

    CHECK_ST(0, nixl_capi_invalidate_remote_md(d, PEER_NAME));
    CHECK_ST(-6, nixl_capi_check_remote_md(d, PEER_NAME, NULL));

    /* Old handles after invalidation. */
    ft_fill(local, LEN, 13);
    CHECK_ST(-6, nixl_capi_post_xfer_req(d, write_old, NULL));
    CHECK_ST(-6, nixl_capi_post_xfer_req(d, read_old, NULL));
    /* A post refused as stale leaves the status as the last post left it. */
    CHECK_ST(-2, nixl_capi_get_xfer_status(d, write_old));
    CHECK_ST(0, nixl_capi_get_xfer_status(d, read_old));
    int64_t du, em;
    nixl_capi_cost_t cm;
    CHECK_ST(-6, nixl_capi_estimate_xfer_cost(d, write_old, NULL, &du, &em, &cm));
    nixl_capi_xfer_req_t r_bad = NULL;
    CHECK_ST(-6, nixl_capi_make_xfer_req(d, NIXL_CAPI_XFER_OP_WRITE, hl, i0, 1, hr_old, i0, 1,
                                         &r_bad, NULL));

    /* Load P2's metadata after the invalidation. */
    CHECK_ST(0, nixl_capi_load_remote_md(d, p2.md, p2.hdr.md_len, &name));
    CHECK(name && strcmp(name, PEER_NAME) == 0, "D loaded P2's metadata as \"tp-peer\"");
    free(name);
    name = NULL;
    CHECK_ST(0, nixl_capi_check_remote_md(d, PEER_NAME, NULL));

    /* Old handles stay dead after the reload. */
    CHECK_ST(-6, nixl_capi_post_xfer_req(d, write_old, NULL));
    CHECK_ST(-6, nixl_capi_post_xfer_req(d, read_old, NULL));
    CHECK_ST(-6, nixl_capi_make_xfer_req(d, NIXL_CAPI_XFER_OP_WRITE, hl, i0, 1, hr_old, i0, 1,
                                         &r_bad, NULL));
    CHECK(peer_verify(&p2, 21), "no byte of P2's buffer changed through the old handles");

    /* New handles work. */
    memset(local, 0, LEN);
    nixl_capi_xfer_dlist_t rl2 = ft_xfer_list((void *)(uintptr_t)p2.hdr.addr, LEN);
    nixl_capi_xfer_req_t read_new = NULL;
    o = notif_args("read-done-2");
    CHECK_ST(0, nixl_capi_create_xfer_req(d, NIXL_CAPI_XFER_OP_READ, ll, rl2, PEER_NAME,
                                          &read_new, o));
    nixl_capi_destroy_opt_args(o);
    if (read_new) {
        CHECK_ST(0, post_wait(d, read_new, NULL));
        CHECK(ft_verify(local, LEN, 21) < 0, "new READ returns P2's original pattern");
        CHECK(peer_got(&p2, "read-done-2"), "P2 received \"read-done-2\"");
        CHECK_ST(0, nixl_capi_release_xfer_req(d, read_new));
        CHECK_ST(0, nixl_capi_destroy_xfer_req(read_new));
    }

    nixl_capi_xfer_dlist_handle_t hr_new = NULL;
    CHECK_ST(0, nixl_capi_prep_xfer_dlist(d, PEER_NAME, rl2, &hr_new, NULL));
    nixl_capi_xfer_req_t write_new = NULL;
    if (hr_new) {
        o = notif_args("new-write");
        CHECK_ST(0, nixl_capi_make_xfer_req(d, NIXL_CAPI_XFER_OP_WRITE, hl, i0, 1, hr_new, i0, 1,
                                            &write_new, o));
        nixl_capi_destroy_opt_args(o);
    }
    if (write_new) {
        ft_fill(local, LEN, 22);
        CHECK_ST(0, post_wait(d, write_new, NULL));
        CHECK(peer_got(&p2, "new-write"), "P2 received \"new-write\"");
        CHECK(peer_verify(&p2, 22), "P2's buffer holds the new WRITE's pattern");
        CHECK_ST(0, nixl_capi_release_xfer_req(d, write_new));
        CHECK_ST(0, nixl_capi_destroy_xfer_req(write_new));
    }

    /* Stale requests release and destroy normally. */
    CHECK_ST(0, nixl_capi_release_xfer_req(d, write_old));
    CHECK_ST(0, nixl_capi_destroy_xfer_req(write_old));
    CHECK_ST(0, nixl_capi_release_xfer_req(d, read_old));
    CHECK_ST(0, nixl_capi_destroy_xfer_req(read_old));
    CHECK_ST(0, nixl_capi_release_xfer_dlist_handle(d, hr_old));
    if (hr_new)
        CHECK_ST(0, nixl_capi_release_xfer_dlist_handle(d, hr_new));
    CHECK_ST(0, nixl_capi_release_xfer_dlist_handle(d, hl));

    CHECK(close_peer(&p2) == 0, "P2 deregistered, destroyed its agent and exited 0");

    nixl_capi_destroy_xfer_dlist(ll);
    nixl_capi_destroy_xfer_dlist(rl1);
    nixl_capi_destroy_xfer_dlist(rl2);
    CHECK_ST(0, ft_deregister(d, local, LEN));
    nixl_capi_destroy_backend(dbe);
    CHECK_ST(0, nixl_capi_destroy_agent(d));
    free(local);
    return ft_end();
}

int main(int argc, char **argv)
{
    if (argc == 3 && strcmp(argv[1], "--peer") == 0)
        return peer_main((unsigned)strtoul(argv[2], NULL, 10));
    return driver_main();
}
