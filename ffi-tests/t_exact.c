/*
 * t_exact: exact to the incarnation (issue #10), the C side of
 * python/tests/test_exact.py.  A driver D (one agent, "cx-driver") and, per
 * case, a peer process P (this same binary, re-executed with --peer) that
 * maps its buffer at a fixed virtual address and is driven over a pipe.
 *
 *   1. Same-process re-creation: P destroys its agent and creates a new one
 *      under the same name, registering the same buffer (same address).  D's
 *      old WRITE request, posted afterwards, must be refused and the new
 *      buffer stay untouched (NIXL 1.5.1 refuses it too).
 *   2. exec in place with ASLR off: P runs with personality(ADDR_NO_RANDOMIZE),
 *      re-executes itself (same pid, new image) and registers at the same
 *      address.  gixl refuses D's old request; NIXL 1.5.1 writes into the new
 *      image (recorded as an expected difference, not a failure).
 *   3. Deregister during a 256 MiB WRITE in 128 descriptors: P deregisters as
 *      soon as the transfer is seen writing, then fills the buffer with a
 *      sentinel.  After the transfer ends not one byte may differ from the
 *      sentinel (gixl); what NIXL does is recorded.
 *   4. EFAULT in one descriptor: P unmaps one page of its registered buffer.
 *      The READ that touches it fails with a defined status; the next READ to
 *      the same peer succeeds with exact data (gixl).  NIXL 1.5.1 marks the
 *      peer dead (expected difference).
 *
 * Every case prints one "# EXACT <case> [impl]: <outcome>" line, for the
 * side-by-side table.  Outcomes are C statuses: 0 done, -2 BACKEND (NIXL's
 * REMOTE_DISCONNECT is reported as BACKEND by the C API), -6 NOT_FOUND,
 * "in progress" when the request had not ended by the time limit.
 *
 * Pipe protocol: D sends a fixed-size struct cmd; P answers every command
 * with a struct reply (plus metadata bytes when md_len > 0).  'D' answers
 * twice: once armed, once after deregistration.
 */
#define _GNU_SOURCE
#include "util.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/personality.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#define DRIVER_NAME "cx-driver"
#define PIPE_TIMEOUT_MS 60000
/* Application range on x86-64 Linux, clear of ASan's heap at 0x600000000000. */
#define FIXED_VA 0x510000000000ull
#define SMALL (1u << 20)
#define BIG (256u << 20)
#define BIG_DESCS 128u
#define PAGE 4096u
#define DRIVER_FILL 90
#define NEW_FILL 34
#define SENTINEL 0xEE

struct cmd {
    char op;
    char name[31];
    uint64_t a, b, c;
};

struct reply {
    uint64_t ok, v0, v1, md_len;
};

static const char *impl(void)
{
    return ft_oracle_is_nixl() ? "NIXL 1.5.1" : "gixl";
}

/* ---------- pipe helpers ---------- */

static bool read_full(int fd, void *p, size_t n)
{
    return ft_read_full(fd, p, n, PIPE_TIMEOUT_MS);
}

/* Bytes of [p, p+len) that differ from v (len a multiple of 8). */
static uint64_t count_not(const unsigned char *p, size_t len, unsigned char v)
{
    uint64_t word;
    memset(&word, v, sizeof word);
    uint64_t n = 0;
    for (size_t i = 0; i < len; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        if (w != word)
            for (size_t k = 0; k < 8; k++)
                n += p[i + k] != v;
    }
    return n;
}

/* ---------- peer role ---------- */

struct peer_state {
    nixl_capi_agent_t ag;
    nixl_capi_backend_t be;
    unsigned char *buf;
    size_t len;
    bool registered;
};

static bool peer_reply(uint64_t ok, uint64_t v0, uint64_t v1, const void *md, size_t md_len)
{
    struct reply r = {ok, v0, v1, md_len};
    return ft_write_full(FT_PEER_W, &r, sizeof r) && (!md_len || ft_write_full(FT_PEER_W, md, md_len));
}

/* Agent + UCX backend under `name`, buffer registered; replies with the metadata. */
static bool peer_agent_up(struct peer_state *st, const char *name)
{
    if (ft_make_agent(name, &st->ag, &st->be) != 0)
        return false;
    if (ft_register(st->ag, st->buf, st->len) != 0)
        return false;
    st->registered = true;
    void *md = NULL;
    size_t md_len = 0;
    if (nixl_capi_get_local_md(st->ag, &md, &md_len) != 0)
        return false;
    bool ok = peer_reply(1, (uint64_t)(uintptr_t)st->buf, (uint64_t)getpid(), md, md_len);
    free(md);
    return ok;
}

static int peer_agent_down(struct peer_state *st)
{
    int s = 0;
    if (st->registered)
        s |= ft_deregister(st->ag, st->buf, st->len);
    st->registered = false;
    if (st->be)
        nixl_capi_destroy_backend(st->be);
    s |= nixl_capi_destroy_agent(st->ag);
    st->ag = NULL;
    st->be = NULL;
    return s;
}

/* Wait until one of the sampled bytes (the middle of each descriptor) leaves
 * 0, deregister, fill with the sentinel.  v0 = ns deregistration took,
 * v1 = sampled descriptors already written when it started (0: none seen). */
static bool peer_dereg_when_written(struct peer_state *st, uint64_t desc_len, uint64_t sentinel)
{
    if (!peer_reply(1, 0, 0, NULL, 0)) /* armed */
        return false;
    volatile unsigned char *b = st->buf;
    uint64_t end = ft_now_ms() + 20000;
    uint64_t seen = 0;
    for (unsigned long it = 0; !seen; it++) {
        for (uint64_t off = desc_len / 2; off < st->len; off += desc_len)
            if (b[off] != 0) {
                seen = 1;
                break;
            }
        if ((it & 1023) == 0 && ft_now_ms() > end)
            break;
    }
    uint64_t written = 0;
    for (uint64_t off = desc_len / 2; off < st->len; off += desc_len)
        written += b[off] != 0;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    int s = ft_deregister(st->ag, st->buf, st->len);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    memset(st->buf, (int)sentinel, st->len);
    st->registered = false;
    uint64_t ns = (uint64_t)(t1.tv_sec - t0.tv_sec) * 1000000000u + (uint64_t)t1.tv_nsec -
                  (uint64_t)t0.tv_nsec;
    return peer_reply(s == 0, ns, written, NULL, 0);
}

static int peer_main(void)
{
    alarm(120);
    setvbuf(stdout, NULL, _IONBF, 0);
    struct peer_state st = {0};
    for (;;) {
        struct cmd c;
        if (!read_full(FT_PEER_R, &c, sizeof c))
            return 14;
        c.name[sizeof c.name - 1] = 0;
        bool ok = true;
        switch (c.op) {
        case 'I': /* init: name, a = size, b = fill */
            if (!st.buf) {
                st.len = c.a;
                st.buf = mmap((void *)(uintptr_t)FIXED_VA, st.len, PROT_READ | PROT_WRITE,
                              MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
                if (st.buf == MAP_FAILED || st.buf != (void *)(uintptr_t)FIXED_VA)
                    return 18;
            }
            memset(st.buf, (int)c.b, st.len);
            ok = peer_agent_up(&st, c.name);
            break;
        case 'R': /* re-create the agent in this process: a = fill */
            if (peer_agent_down(&st) != 0)
                return 19;
            memset(st.buf, (int)c.a, st.len);
            ok = peer_agent_up(&st, c.name);
            break;
        case 'X': { /* exec in place; the new image serves the same pipe */
            ok = peer_reply(1, 0, 0, NULL, 0);
            if (!ok)
                break;
            char *argv[] = {"/proc/self/exe", "--peer", NULL};
            execv("/proc/self/exe", argv);
            return 20;
        }
        case 'P': /* personality */
            ok = peer_reply(1, (uint64_t)personality(0xffffffff), 0, NULL, 0);
            break;
        case 'C': /* count bytes != a */
            ok = peer_reply(1, count_not(st.buf, st.len, (unsigned char)c.a), 0, NULL, 0);
            break;
        case 'F': /* fill with a */
            memset(st.buf, (int)c.a, st.len);
            ok = peer_reply(1, 0, 0, NULL, 0);
            break;
        case 'U': /* unmap the page at offset a */
            ok = peer_reply(munmap(st.buf + c.a, PAGE) == 0, 0, 0, NULL, 0);
            break;
        case 'D': /* deregister when written: a = descriptor length, b = sentinel */
            ok = peer_dereg_when_written(&st, c.a, c.b);
            break;
        case 'Q': {
            int s = st.ag ? peer_agent_down(&st) : 0;
            peer_reply(s == 0, 0, 0, NULL, 0);
            return s == 0 ? 0 : 16;
        }
        default:
            ok = peer_reply(0, 0, 0, NULL, 0);
        }
        if (!ok)
            return 17;
    }
}

/* ---------- driver role ---------- */

struct peer {
    pid_t pid;
    int to;
    int from;
    const char *name;
    uint64_t addr;
    uint64_t ppid; /* the pid the peer reported */
    void *md;
    size_t md_len;
};

static bool spawn_peer(struct peer *p, const char *name, bool aslr_off)
{
    char *argv[] = {"/proc/self/exe", "--peer", NULL};
    pid_t pid = ft_spawn_self(argv, aslr_off, &p->to, &p->from);
    if (pid < 0)
        return false;
    p->pid = pid;
    p->name = name;
    p->md = NULL;
    p->md_len = 0;
    return true;
}

static bool send_cmd(struct peer *p, char op, uint64_t a, uint64_t b)
{
    struct cmd c;
    memset(&c, 0, sizeof c);
    c.op = op;
    snprintf(c.name, sizeof c.name, "%s", p->name);
    c.a = a;
    c.b = b;
    return ft_write_full(p->to, &c, sizeof c);
}

/* Reads one reply; metadata (if any) replaces p->md.  Returns ok. */
static bool recv_reply(struct peer *p, struct reply *r)
{
    if (!read_full(p->from, r, sizeof *r))
        return false;
    if (r->md_len) {
        if (r->md_len > (64u << 20))
            return false;
        free(p->md);
        p->md = malloc(r->md_len);
        p->md_len = r->md_len;
        if (!p->md || !read_full(p->from, p->md, r->md_len))
            return false;
        p->addr = r->v0;
        p->ppid = r->v1;
    }
    return r->ok == 1;
}

static bool call(struct peer *p, char op, uint64_t a, uint64_t b, struct reply *out)
{
    struct reply r;
    if (!send_cmd(p, op, a, b) || !recv_reply(p, &r))
        return false;
    if (out)
        *out = r;
    return true;
}

static uint64_t peer_count_not(struct peer *p, unsigned char v)
{
    struct reply r;
    return call(p, 'C', v, 0, &r) ? r.v0 : UINT64_MAX;
}

static int close_peer(struct peer *p)
{
    int st = 0;
    bool ok = call(p, 'Q', 0, 0, NULL);
    close(p->to);
    close(p->from);
    waitpid(p->pid, &st, 0);
    free(p->md);
    p->md = NULL;
    return ok && WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : -1;
}

/* Post and poll to the end: the post's error, or the final status (IN_PROG
 * when it had not ended after timeout_ms). */
static int post_outcome(nixl_capi_agent_t ag, nixl_capi_xfer_req_t r, uint64_t timeout_ms)
{
    int s = nixl_capi_post_xfer_req(ag, r, NULL);
    uint64_t end = ft_now_ms() + timeout_ms;
    while (s == NIXL_CAPI_IN_PROG && ft_now_ms() < end) {
        ft_sleep_us(200);
        s = nixl_capi_get_xfer_status(ag, r);
    }
    return s;
}

static const char *outcome_name(int s)
{
    switch (s) {
    case 0: return "DONE";
    case 1: return "still in progress (hang)";
    case -2: return "-2 BACKEND/REMOTE_DISCONNECT";
    case -6: return "-6 NOT_FOUND";
    default: return ft_status_name(s);
    }
}

/* A difference from gixl's expectation that NIXL 1.5.1 is known to have. */
static void expected_difference(const char *what, const char *fmt, ...)
{
    char buf[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    ft_skipped("expected difference from NIXL 1.5.1", "%s: %s", what, buf);
}

static bool is_refusal(int s)
{
    return s == NIXL_CAPI_ERROR_BACKEND || s == NIXL_CAPI_ERROR_NOT_FOUND;
}

/* D loads P's metadata and builds a WRITE of `len` bytes from `local` into P's
 * buffer through prepped handles. */
struct wreq {
    nixl_capi_xfer_dlist_t ll, rl;
    nixl_capi_xfer_dlist_handle_t hl, hr;
    nixl_capi_xfer_req_t req;
};

static bool build_write(nixl_capi_agent_t d, struct peer *p, void *local, size_t len, unsigned ndesc,
                        struct wreq *w)
{
    memset(w, 0, sizeof *w);
    char *name = NULL;
    if (!CHECK_ST(0, nixl_capi_load_remote_md(d, p->md, p->md_len, &name)))
        return false;
    free(name);
    size_t dl = len / ndesc;
    nixl_capi_create_xfer_dlist(NIXL_CAPI_MEM_DRAM, &w->ll);
    nixl_capi_create_xfer_dlist(NIXL_CAPI_MEM_DRAM, &w->rl);
    int *idx = calloc(ndesc, sizeof *idx);
    for (unsigned i = 0; i < ndesc; i++) {
        nixl_capi_xfer_dlist_add_desc(w->ll, (uintptr_t)local + i * dl, dl, 0);
        nixl_capi_xfer_dlist_add_desc(w->rl, p->addr + i * dl, dl, 0);
        idx[i] = (int)i;
    }
    bool ok = CHECK_ST(0, nixl_capi_prep_xfer_dlist(d, "", w->ll, &w->hl, NULL)) &&
              CHECK_ST(0, nixl_capi_prep_xfer_dlist(d, p->name, w->rl, &w->hr, NULL)) &&
              CHECK_ST(0, nixl_capi_make_xfer_req(d, NIXL_CAPI_XFER_OP_WRITE, w->hl, idx, (int)ndesc,
                                                  w->hr, idx, (int)ndesc, &w->req, NULL));
    free(idx);
    return ok;
}

static void free_write(nixl_capi_agent_t d, struct wreq *w)
{
    if (w->req) {
        nixl_capi_release_xfer_req(d, w->req);
        nixl_capi_destroy_xfer_req(w->req);
    }
    if (w->hr)
        nixl_capi_release_xfer_dlist_handle(d, w->hr);
    if (w->hl)
        nixl_capi_release_xfer_dlist_handle(d, w->hl);
    if (w->ll)
        nixl_capi_destroy_xfer_dlist(w->ll);
    if (w->rl)
        nixl_capi_destroy_xfer_dlist(w->rl);
}

static unsigned char *small_local;

/* Case 1. */
static void case_recreation(nixl_capi_agent_t d)
{
    struct peer p;
    REQUIRE(spawn_peer(&p, "cx-recreate", false), "re-creation peer started");
    REQUIRE(call(&p, 'I', SMALL, 0, NULL), "peer's first agent up, buffer at the fixed address");
    struct wreq w;
    if (build_write(d, &p, small_local, SMALL, 1, &w)) {
        CHECK_ST(0, post_outcome(d, w.req, FT_TIMEOUT_MS));
        CHECK(peer_count_not(&p, DRIVER_FILL) == 0, "re-creation: the first WRITE landed exactly");
        uint64_t old_addr = p.addr;
        void *old_md = malloc(p.md_len);
        size_t old_len = p.md_len;
        memcpy(old_md, p.md, old_len);
        REQUIRE(call(&p, 'R', NEW_FILL, 0, NULL), "peer destroyed its agent and created a new one");
        CHECK(p.addr == old_addr, "re-creation: the new agent registered the same address");
        CHECK(p.md_len != old_len || memcmp(p.md, old_md, old_len) != 0,
              "re-creation: the new agent's metadata differs from the old one's");
        free(old_md);

        int old = post_outcome(d, w.req, 5000);
        CHECK(is_refusal(old), "re-creation: the old request, posted again, is refused (-2 or -6)");
        const int i0[] = {0};
        nixl_capi_xfer_req_t r2 = NULL;
        int mk = nixl_capi_make_xfer_req(d, NIXL_CAPI_XFER_OP_WRITE, w.hl, i0, 1, w.hr, i0, 1, &r2,
                                         NULL);
        int from_dlist = mk;
        if (mk == 0 && r2) {
            from_dlist = post_outcome(d, r2, 5000);
            nixl_capi_release_xfer_req(d, r2);
            nixl_capi_destroy_xfer_req(r2);
        }
        CHECK(is_refusal(from_dlist),
              "re-creation: a request made from the old remote dlist is refused (-2 or -6)");
        uint64_t touched = peer_count_not(&p, NEW_FILL);
        CHECK(touched == 0, "re-creation: no byte of the new agent's buffer changed");
        printf("# EXACT same-process re-creation, same VA [%s]: repost=%s · make_from_old_dlist%s=%s"
               " · mem=%s\n",
               impl(), outcome_name(old), mk == 0 ? "+post" : "", outcome_name(from_dlist),
               touched == 0 ? "untouched" : "WRITTEN");
    }
    free_write(d, &w);
    nixl_capi_invalidate_remote_md(d, p.name);
    CHECK(close_peer(&p) == 0, "re-creation peer deregistered, destroyed its agent and exited 0");
}

/* Case 2. */
static void case_exec(nixl_capi_agent_t d)
{
    struct peer p;
    struct reply r;
    REQUIRE(spawn_peer(&p, "cx-exec", true), "exec peer started with ASLR off");
    REQUIRE(call(&p, 'I', SMALL, 0, NULL), "exec peer's agent up, buffer at the fixed address");
    CHECK(call(&p, 'P', 0, 0, &r) && (r.v0 & ADDR_NO_RANDOMIZE),
          "exec: the peer runs with ADDR_NO_RANDOMIZE");
    struct wreq w;
    if (build_write(d, &p, small_local, SMALL, 1, &w)) {
        CHECK_ST(0, post_outcome(d, w.req, FT_TIMEOUT_MS));
        CHECK(peer_count_not(&p, DRIVER_FILL) == 0, "exec: the first WRITE landed exactly");
        uint64_t old_addr = p.addr, old_pid = p.ppid;
        REQUIRE(call(&p, 'X', 0, 0, NULL), "peer acknowledged the exec");
        REQUIRE(call(&p, 'I', SMALL, NEW_FILL, NULL), "re-executed peer's agent up");
        CHECK(p.addr == old_addr && p.ppid == old_pid && p.ppid == (uint64_t)p.pid,
              "exec: same pid, buffer at the same address");
        bool aslr_off = call(&p, 'P', 0, 0, &r) && (r.v0 & ADDR_NO_RANDOMIZE);
        CHECK(aslr_off, "exec: ASLR still off in the new image");

        int old = post_outcome(d, w.req, 5000);
        uint64_t written = peer_count_not(&p, NEW_FILL);
        printf("# EXACT exec in place, ASLR off, same VA [%s]: repost=%s · mem=%s (%llu bytes)\n",
               impl(), outcome_name(old), written == 0 ? "untouched" : "WRITTEN",
               (unsigned long long)written);
        if (!ft_oracle_is_nixl()) {
            CHECK(is_refusal(old), "exec: the old request, posted again, is refused (-2 or -6)");
            CHECK(written == 0, "exec: no byte of the new image's buffer changed");
        } else {
            /* NIXL 1.5.1 (measured in Python): the pid is the same, so UCX's
             * cross-memory attach writes into the new image; sometimes the
             * post stays in progress instead. */
            CHECK((old == 0 && written == SMALL) || (old == 1 && written == 0) ||
                      (is_refusal(old) && written == 0),
                  "exec (NIXL): a known outcome (DONE+written, in progress, or refused untouched)");
            if (old == 0 || written)
                expected_difference("exec in place, ASLR off",
                                    "NIXL wrote %llu bytes into the new image (post %s); gixl refuses",
                                    (unsigned long long)written, outcome_name(old));
        }
    }
    free_write(d, &w);
    nixl_capi_invalidate_remote_md(d, p.name);
    CHECK(close_peer(&p) == 0, "exec peer deregistered, destroyed its agent and exited 0");
}

/* Case 3. */
static void case_dereg_during_write(nixl_capi_agent_t d)
{
    struct peer p;
    struct reply r;
    unsigned char *big = mmap(NULL, BIG, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    REQUIRE(big != MAP_FAILED, "256 MiB local buffer");
    memset(big, DRIVER_FILL, BIG);
    REQUIRE_ST(0, ft_register(d, big, BIG));
    REQUIRE(spawn_peer(&p, "cx-dereg", false), "deregistration peer started");
    REQUIRE(call(&p, 'I', BIG, 0, NULL), "deregistration peer's agent up, 256 MiB registered");
    struct wreq w;
    if (build_write(d, &p, big, BIG, BIG_DESCS, &w)) {
        REQUIRE(call(&p, 'D', BIG / BIG_DESCS, SENTINEL, NULL), "peer armed to deregister");
        int post = post_outcome(d, w.req, 30000);
        bool got = recv_reply(&p, &r);
        CHECK(got, "deregister_mem returned 0 while the WRITE was in flight");
        CHECK(r.v1 > 0, "the peer saw the WRITE in progress before deregistering");
        if (r.v1 == BIG_DESCS)
            printf("# note: every descriptor had begun before deregistration; the WRITE may have"
                   " ended before it, so this run tested little\n");
        uint64_t landed = peer_count_not(&p, SENTINEL);
        printf("# EXACT deregister during 256 MiB WRITE (%u descs) [%s]: transfer=%s · deregister took"
               " %.1f ms · %llu/%u descs begun at deregistration · bytes landed after it returned=%llu\n",
               BIG_DESCS, impl(), outcome_name(post), (double)r.v0 / 1e6,
               (unsigned long long)r.v1, BIG_DESCS, (unsigned long long)landed);
        if (!ft_oracle_is_nixl()) {
            CHECK(post == 0 || post == NIXL_CAPI_ERROR_BACKEND,
                  "deregister during WRITE: the transfer ended DONE or BACKEND");
            CHECK(landed == 0, "deregister during WRITE: not one byte landed after deregister returned");
        } else {
            CHECK(post == 0 || post == 1 || post < 0,
                  "deregister during WRITE (NIXL): the transfer has a defined outcome");
            if (landed)
                expected_difference("deregister during WRITE",
                                    "NIXL let %llu bytes land after deregister returned",
                                    (unsigned long long)landed);
            else
                ft_skipped("gixl-only expectation", "deregister during WRITE: NIXL landed 0 bytes"
                           " this run (not guaranteed by NIXL)");
        }
    }
    free_write(d, &w);
    nixl_capi_invalidate_remote_md(d, p.name);
    CHECK(close_peer(&p) == 0, "deregistration peer destroyed its agent and exited 0");
    CHECK_ST(0, ft_deregister(d, big, BIG));
    munmap(big, BIG);
}

/* A READ of the peer's pages at `offs` into consecutive local pages. */
static int read_pages(nixl_capi_agent_t d, struct peer *p, const uint64_t *offs, unsigned n,
                      int *made)
{
    nixl_capi_xfer_dlist_t ll = NULL, rl = NULL;
    nixl_capi_create_xfer_dlist(NIXL_CAPI_MEM_DRAM, &ll);
    nixl_capi_create_xfer_dlist(NIXL_CAPI_MEM_DRAM, &rl);
    for (unsigned i = 0; i < n; i++) {
        nixl_capi_xfer_dlist_add_desc(ll, (uintptr_t)small_local + i * PAGE, PAGE, 0);
        nixl_capi_xfer_dlist_add_desc(rl, p->addr + offs[i], PAGE, 0);
    }
    nixl_capi_xfer_req_t r = NULL;
    int s = nixl_capi_create_xfer_req(d, NIXL_CAPI_XFER_OP_READ, ll, rl, p->name, &r, NULL);
    *made = s;
    if (s == 0) {
        s = post_outcome(d, r, FT_TIMEOUT_MS);
        nixl_capi_release_xfer_req(d, r);
        nixl_capi_destroy_xfer_req(r);
    }
    nixl_capi_destroy_xfer_dlist(ll);
    nixl_capi_destroy_xfer_dlist(rl);
    return s;
}

/* Case 4. */
static void case_efault(nixl_capi_agent_t d)
{
    struct peer p;
    REQUIRE(spawn_peer(&p, "cx-efault", false), "EFAULT peer started");
    REQUIRE(call(&p, 'I', SMALL, 77, NULL), "EFAULT peer's agent up, buffer of 77");
    char *name = NULL;
    CHECK_ST(0, nixl_capi_load_remote_md(d, p.md, p.md_len, &name));
    free(name);
    CHECK(call(&p, 'U', 16 * PAGE, 0, NULL), "peer unmapped page 16 of its registered buffer");
    memset(small_local, 0, SMALL);
    const uint64_t bad[] = {0, 16 * PAGE, 32 * PAGE};
    const uint64_t good[] = {0, 32 * PAGE};
    int made1 = 0, made2 = 0;
    int first = read_pages(d, &p, bad, 3, &made1);
    memset(small_local, 0, SMALL);
    int second = read_pages(d, &p, good, 2, &made2);
    bool exact = count_not(small_local, 2 * PAGE, 77) == 0;
    printf("# EXACT EFAULT in one descriptor [%s]: faulting request=%s%s · next request=%s%s · data %s\n",
           impl(), made1 ? "create " : "", outcome_name(first), made2 ? "create " : "",
           outcome_name(second), exact ? "exact" : "not read");
    CHECK(first < 0, "EFAULT: the faulting READ fails with an error status");
    if (!ft_oracle_is_nixl()) {
        CHECK_ST(NIXL_CAPI_ERROR_BACKEND, first);
        CHECK_ST(0, second);
        CHECK(exact, "EFAULT: the next READ to the same peer brought exact data");
    } else {
        /* NIXL 1.5.1 (measured): the fault fails the whole peer. */
        CHECK(second == 0 || is_refusal(second), "EFAULT (NIXL): the next READ has a defined status");
        if (second != 0)
            expected_difference("EFAULT in one descriptor",
                                "NIXL marks the peer dead: next request %s; gixl keeps it usable",
                                outcome_name(second));
    }
    nixl_capi_invalidate_remote_md(d, p.name);
    CHECK(close_peer(&p) == 0, "EFAULT peer destroyed its agent and exited 0");
}

static int driver_main(void)
{
    ft_begin("t_exact");
    alarm(150);
    nixl_capi_agent_t d = NULL;
    nixl_capi_backend_t dbe = NULL;
    REQUIRE_ST(0, ft_make_agent(DRIVER_NAME, &d, &dbe));
    small_local = malloc(SMALL);
    REQUIRE(small_local != NULL, "local buffer");
    memset(small_local, DRIVER_FILL, SMALL);
    REQUIRE_ST(0, ft_register(d, small_local, SMALL));

    case_recreation(d);
    case_exec(d);
    case_dereg_during_write(d);
    case_efault(d);

    CHECK_ST(0, ft_deregister(d, small_local, SMALL));
    nixl_capi_destroy_backend(dbe);
    CHECK_ST(0, nixl_capi_destroy_agent(d));
    free(small_local);
    return ft_end();
}

int main(int argc, char **argv)
{
    if (argc == 2 && strcmp(argv[1], "--peer") == 0)
        return peer_main();
    return driver_main();
}
