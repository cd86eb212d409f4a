/*
 * t_xfer: transfers between two agents that live in this process (A is the
 * initiator, B the target) over the UCX backend.
 *
 * Covers prep_xfer_dlist (local "", own name loopback, remote), make_xfer_req
 * and create_xfer_req error paths, the post/status/release/destroy order,
 * estimate_xfer_cost, query_xfer_backend, telemetry while it is disabled,
 * notifications (transfer notifications, gen_notif, map helpers), WRITE and
 * READ with data verification, stale handles after invalidate_remote_md,
 * memory views on DRAM, and (gixl only) use of handles after release/destroy.
 */
#define _GNU_SOURCE
#include "util.h"

#define LEN (64 * 1024)
#define HALF (LEN / 2)

static nixl_capi_agent_t A, B;
static nixl_capi_backend_t BA, BB;
static unsigned char *a_src, *a_dst, *b_buf, *unreg;

static nixl_capi_xfer_dlist_handle_t prep(nixl_capi_agent_t ag, const char *who, void *buf,
                                          size_t len, int *status)
{
    nixl_capi_xfer_dlist_handle_t h = NULL;
    nixl_capi_xfer_dlist_t d = ft_xfer_list(buf, len);
    *status = nixl_capi_prep_xfer_dlist(ag, who, d, &h, NULL);
    nixl_capi_destroy_xfer_dlist(d);
    return *status == 0 ? h : NULL;
}

/* Two descriptors of HALF bytes each over one buffer. */
static nixl_capi_xfer_dlist_t halves(void *buf)
{
    nixl_capi_xfer_dlist_t d = ft_xfer_list(NULL, 0);
    nixl_capi_xfer_dlist_add_desc(d, (uintptr_t)buf, HALF, 0);
    nixl_capi_xfer_dlist_add_desc(d, (uintptr_t)buf + HALF, HALF, 0);
    return d;
}

/* Post, wait for completion; returns the final status. */
static int run_req(nixl_capi_agent_t ag, nixl_capi_xfer_req_t r, nixl_capi_opt_args_t o)
{
    int s = nixl_capi_post_xfer_req(ag, r, o);
    if (s < 0)
        return s;
    return ft_wait_xfer(ag, r, s);
}

static void setup(void)
{
    a_src = malloc(LEN);
    a_dst = malloc(LEN);
    b_buf = malloc(LEN);
    unreg = malloc(LEN);
    REQUIRE_ST(0, ft_make_agent("xfer-A", &A, &BA));
    REQUIRE_ST(0, ft_make_agent("xfer-B", &B, &BB));
    REQUIRE_ST(0, ft_register(A, a_src, LEN));
    REQUIRE_ST(0, ft_register(A, a_dst, LEN));
    REQUIRE_ST(0, ft_register(B, b_buf, LEN));
    char name[64] = "";
    REQUIRE_ST(0, ft_exchange_md(B, A, name, sizeof name));
    REQUIRE(strcmp(name, "xfer-B") == 0, "A loaded B's metadata as \"xfer-B\"");
    /* B also knows A, so B can send notifications back. */
    REQUIRE_ST(0, ft_exchange_md(A, B, name, sizeof name));
}

static void test_prep(void)
{
    int s;
    nixl_capi_xfer_dlist_handle_t h;

    h = prep(A, "", a_src, LEN, &s);
    CHECK_ST(0, s);
    CHECK(h != NULL, "prep local (\"\") gives a handle");
    if (h)
        CHECK_ST(0, nixl_capi_release_xfer_dlist_handle(A, h));

    h = prep(A, "xfer-A", a_dst, LEN, &s);
    CHECK_ST(0, s);
    CHECK(h != NULL, "prep with the agent's own name (loopback) gives a handle");
    if (h)
        CHECK_ST(0, nixl_capi_release_xfer_dlist_handle(A, h));

    h = prep(A, "xfer-B", b_buf + 128, 1024, &s);
    CHECK_ST(0, s);
    CHECK(h != NULL, "prep remote sub-range gives a handle");
    if (h)
        CHECK_ST(0, nixl_capi_release_xfer_dlist_handle(A, h));

    /* Error paths: all NOT_FOUND. */
    prep(A, "xfer-B", unreg, LEN, &s);
    CHECK(s == -6, "prep remote with an unregistered range is NOT_FOUND");
    prep(A, "xfer-B", b_buf + LEN - 8, 16, &s);
    CHECK(s == -6, "prep remote straddling the end of a registration is NOT_FOUND");
    prep(A, "xfer-nobody", b_buf, LEN, &s);
    CHECK(s == -6, "prep for an unknown agent is NOT_FOUND");
    prep(A, "", unreg, LEN, &s);
    CHECK(s == -6, "prep local with an unregistered range is NOT_FOUND");
    prep(A, "", NULL, 0, &s);
    CHECK(s == -6, "prep local with an empty list is NOT_FOUND");
    prep(A, "xfer-B", NULL, 0, &s);
    CHECK(s == -6, "prep remote with an empty list is NOT_FOUND");

    nixl_capi_xfer_dlist_t f = NULL;
    nixl_capi_xfer_dlist_handle_t fh = NULL;
    CHECK_ST(0, nixl_capi_create_xfer_dlist(NIXL_CAPI_MEM_FILE, &f));
    CHECK_ST(0, nixl_capi_xfer_dlist_add_desc(f, 0, 4096, 3));
    CHECK_ST(-6, nixl_capi_prep_xfer_dlist(A, "", f, &fh, NULL));
    CHECK_ST(0, nixl_capi_destroy_xfer_dlist(f));

    /* NIXL writes the handle through a NULL out-pointer after a successful prep. */
    if (gixl_only("prep_xfer_dlist with dlist_hndl == NULL")) {
        nixl_capi_xfer_dlist_t d = ft_xfer_list(a_src, LEN);
        CHECK_ST(-1, nixl_capi_prep_xfer_dlist(A, "", d, NULL, NULL));
        nixl_capi_destroy_xfer_dlist(d);
    }
}

static void test_make_errors(void)
{
    int s1, s2;
    nixl_capi_xfer_dlist_handle_t loc = NULL, rem = NULL, loc2 = NULL, rem2 = NULL;
    nixl_capi_xfer_dlist_t d;

    d = halves(a_src);
    CHECK_ST(0, nixl_capi_prep_xfer_dlist(A, "", d, &loc2, NULL));
    nixl_capi_destroy_xfer_dlist(d);
    d = halves(b_buf);
    CHECK_ST(0, nixl_capi_prep_xfer_dlist(A, "xfer-B", d, &rem2, NULL));
    nixl_capi_destroy_xfer_dlist(d);
    loc = prep(A, "", a_src, LEN, &s1);
    rem = prep(A, "xfer-B", b_buf, LEN, &s2);
    REQUIRE(loc && rem && loc2 && rem2, "prepped local/remote handles for make_xfer_req");

    nixl_capi_xfer_req_t r = NULL;
    const int i0[] = {0}, i01[] = {0, 1}, i10[] = {1, 0}, i2[] = {2}, ineg[] = {-1};

    /* Valid: one whole-buffer descriptor on each side. */
    CHECK_ST(0, nixl_capi_make_xfer_req(A, NIXL_CAPI_XFER_OP_WRITE, loc, i0, 1, rem, i0, 1, &r,
                                        NULL));
    if (r) {
        CHECK_ST(0, nixl_capi_release_xfer_req(A, r));
        CHECK_ST(0, nixl_capi_destroy_xfer_req(r));
        r = NULL;
    }
    /* Valid: two halves, crossed order. */
    CHECK_ST(0, nixl_capi_make_xfer_req(A, NIXL_CAPI_XFER_OP_WRITE, loc2, i01, 2, rem2, i10, 2,
                                        &r, NULL));
    if (r) {
        CHECK_ST(0, nixl_capi_release_xfer_req(A, r));
        CHECK_ST(0, nixl_capi_destroy_xfer_req(r));
        r = NULL;
    }

    /* INVALID_PARAM cases. */
    CHECK_ST(-1, nixl_capi_make_xfer_req(A, NIXL_CAPI_XFER_OP_WRITE, loc2, i01, 2, rem2, i0, 1,
                                         &r, NULL)); /* count mismatch */
    CHECK_ST(-1, nixl_capi_make_xfer_req(A, NIXL_CAPI_XFER_OP_WRITE, loc, i0, 1, rem2, i0, 1, &r,
                                         NULL)); /* length mismatch LEN vs HALF */
    CHECK_ST(-1, nixl_capi_make_xfer_req(A, NIXL_CAPI_XFER_OP_WRITE, loc2, i2, 1, rem2, i0, 1,
                                         &r, NULL)); /* local index out of range */
    CHECK_ST(-1, nixl_capi_make_xfer_req(A, NIXL_CAPI_XFER_OP_WRITE, loc2, i0, 1, rem2, i2, 1,
                                         &r, NULL)); /* remote index out of range */
    CHECK_ST(-1, nixl_capi_make_xfer_req(A, NIXL_CAPI_XFER_OP_WRITE, loc2, ineg, 1, rem2, i0, 1,
                                         &r, NULL)); /* negative index */
    CHECK_ST(-1, nixl_capi_make_xfer_req(A, NIXL_CAPI_XFER_OP_WRITE, loc2, i0, 0, rem2, i0, 0,
                                         &r, NULL)); /* no indices */
    CHECK_ST(-1, nixl_capi_make_xfer_req(A, NIXL_CAPI_XFER_OP_WRITE, rem, i0, 1, loc, i0, 1, &r,
                                         NULL)); /* sides swapped */
    CHECK_ST(-1, nixl_capi_make_xfer_req(A, NIXL_CAPI_XFER_OP_WRITE, loc, i0, 1, loc, i0, 1, &r,
                                         NULL)); /* local handle used as the remote side */
    CHECK(r == NULL, "failed make_xfer_req leaves *req_hndl untouched");

    CHECK_ST(0, nixl_capi_release_xfer_dlist_handle(A, loc));
    CHECK_ST(0, nixl_capi_release_xfer_dlist_handle(A, rem));
    CHECK_ST(0, nixl_capi_release_xfer_dlist_handle(A, loc2));

    /* Released dlist handles are dangling in NIXL (the wrapper is freed). */
    if (gixl_only("dlist handle used after release (double release, make_xfer_req)")) {
        CHECK_ERR(nixl_capi_release_xfer_dlist_handle(A, loc));
        CHECK_ERR(nixl_capi_make_xfer_req(A, NIXL_CAPI_XFER_OP_WRITE, loc, i0, 1, rem2, i0, 1,
                                          &r, NULL));
    }
    CHECK_ST(0, nixl_capi_release_xfer_dlist_handle(A, rem2));
}

static void test_create_errors(void)
{
    nixl_capi_xfer_req_t r = NULL;
    nixl_capi_xfer_dlist_t l_full = ft_xfer_list(a_src, LEN);
    nixl_capi_xfer_dlist_t l_halves = halves(a_src);
    nixl_capi_xfer_dlist_t r_full = ft_xfer_list(b_buf, LEN);
    nixl_capi_xfer_dlist_t r_short = ft_xfer_list(b_buf, HALF);
    nixl_capi_xfer_dlist_t r_unreg = ft_xfer_list(unreg, LEN);
    nixl_capi_xfer_dlist_t empty = ft_xfer_list(NULL, 0);

    /* create_xfer_req reports every failure as BACKEND (-2), unmapped. */
    CHECK_ST(-2, nixl_capi_create_xfer_req(A, NIXL_CAPI_XFER_OP_WRITE, l_halves, r_full, "xfer-B",
                                           &r, NULL)); /* count mismatch */
    CHECK_ST(-2, nixl_capi_create_xfer_req(A, NIXL_CAPI_XFER_OP_WRITE, l_full, r_short, "xfer-B",
                                           &r, NULL)); /* length mismatch */
    CHECK_ST(-2, nixl_capi_create_xfer_req(A, NIXL_CAPI_XFER_OP_WRITE, l_full, r_full,
                                           "xfer-nobody", &r, NULL)); /* unknown agent */
    CHECK_ST(-2, nixl_capi_create_xfer_req(A, NIXL_CAPI_XFER_OP_WRITE, l_full, r_unreg, "xfer-B",
                                           &r, NULL)); /* remote not registered */
    CHECK_ST(-2, nixl_capi_create_xfer_req(A, NIXL_CAPI_XFER_OP_WRITE, empty, empty, "xfer-B", &r,
                                           NULL)); /* empty lists */
    CHECK(r == NULL, "failed create_xfer_req leaves *req_hndl untouched");

    /* The same validation through make_xfer_req maps statuses (NOT_FOUND for an unknown agent). */
    nixl_capi_xfer_dlist_handle_t h = NULL;
    CHECK_ST(-6, nixl_capi_prep_xfer_dlist(A, "xfer-nobody", r_full, &h, NULL));

    nixl_capi_destroy_xfer_dlist(l_full);
    nixl_capi_destroy_xfer_dlist(l_halves);
    nixl_capi_destroy_xfer_dlist(r_full);
    nixl_capi_destroy_xfer_dlist(r_short);
    nixl_capi_destroy_xfer_dlist(r_unreg);
    nixl_capi_destroy_xfer_dlist(empty);
}

static void test_lifecycle_and_write(void)
{
    nixl_capi_xfer_dlist_t l = ft_xfer_list(a_src, LEN);
    nixl_capi_xfer_dlist_t rm = ft_xfer_list(b_buf, LEN);
    nixl_capi_xfer_req_t r = NULL;
    nixl_capi_notif_map_t nm = NULL;
    static const char msg[] = {'n', '\0', 't', 'i', 'f'};

    ft_fill(a_src, LEN, 1);
    memset(b_buf, 0, LEN);

    nixl_capi_opt_args_t o = NULL;
    CHECK_ST(0, nixl_capi_create_opt_args(&o));
    CHECK_ST(0, nixl_capi_opt_args_set_notif_msg(o, msg, sizeof msg));
    CHECK_ST(0, nixl_capi_opt_args_set_has_notif(o, true));
    CHECK_ST(0, nixl_capi_create_xfer_req(A, NIXL_CAPI_XFER_OP_WRITE, l, rm, "xfer-B", &r, o));
    REQUIRE(r != NULL, "create_xfer_req(WRITE) gives a request");

    /* Never posted: NOT_POSTED, reported as BACKEND. */
    CHECK_ST(-2, nixl_capi_get_xfer_status(A, r));

    /* estimate_xfer_cost with UCX: SUCCESS and an analytical estimate.  The
     * duration depends on the size and the transport (0 us for 4 KiB, 5 us
     * for 64 KiB over loopback here), so only its sign is checked. */
    int64_t dur = -7, err = -7;
    nixl_capi_cost_t method = (nixl_capi_cost_t)7;
    CHECK_ST(0, nixl_capi_estimate_xfer_cost(A, r, NULL, &dur, &err, &method));
    {
        char text[128];
        snprintf(text, sizeof text,
                 "UCX estimate is (>= 0 us, >= 0 us, ANALYTICAL_BACKEND); got (%lld, %lld, %d)",
                 (long long)dur, (long long)err, (int)method);
        CHECK(dur >= 0 && err >= 0 && method == NIXL_CAPI_COST_ANALYTICAL_BACKEND, text);
    }

    nixl_capi_backend_t qb = NULL;
    CHECK_ST(0, nixl_capi_query_xfer_backend(A, r, &qb));
    CHECK(qb != NULL, "query_xfer_backend gives a backend handle");
    if (qb) {
        nixl_capi_mem_list_t qm = NULL;
        nixl_capi_params_t qp = NULL;
        CHECK_ST(0, nixl_capi_get_backend_params(A, qb, &qm, &qp));
        nixl_capi_destroy_mem_list(qm);
        nixl_capi_destroy_params(qp);
        CHECK_ST(0, nixl_capi_destroy_backend(qb));
    }

    /* Post and wait. */
    int s = nixl_capi_post_xfer_req(A, r, NULL);
    CHECK_ST2(0, 1, s);
    CHECK_ST(0, ft_wait_xfer(A, r, s));
    CHECK_ST(0, nixl_capi_get_xfer_status(A, r)); /* DONE stays DONE */
    CHECK(ft_verify(b_buf, LEN, 1) < 0, "WRITE: B's buffer holds A's pattern");

    /* Telemetry is off by default. */
    struct nixl_capi_xfer_telemetry_s tel;
    memset(&tel, 0xab, sizeof tel);
    CHECK_ST(-5, nixl_capi_get_xfer_telemetry(A, r, &tel));
    CHECK(tel.total_bytes == 0xababababababababull, "telemetry struct untouched on failure");

    /* B receives the notification, with its embedded NUL intact. */
    CHECK_ST(0, nixl_capi_create_notif_map(&nm));
    CHECK(ft_wait_notifs(B, nm, "xfer-A", 1), "B receives the transfer notification from A");
    size_t n = 0;
    CHECK_ST(0, nixl_capi_notif_map_size(nm, &n));
    CHECK(n == 1, "notif map has one sender");
    const char *who = NULL;
    CHECK_ST(0, nixl_capi_notif_map_get_agent_at(nm, 0, &who));
    CHECK(who && strcmp(who, "xfer-A") == 0, "sender is \"xfer-A\"");
    CHECK_ST(0, nixl_capi_notif_map_get_notifs_size(nm, "xfer-A", &n));
    CHECK(n == 1, "one notification from xfer-A");
    CHECK(ft_notif_equals(nm, "xfer-A", 0, msg, sizeof msg), "notification payload is \"n\\0tif\"");
    const void *nd = NULL;
    size_t nl = 0;
    CHECK_ST(-1, nixl_capi_notif_map_get_notif(nm, "xfer-A", 1, &nd, &nl));
    CHECK_ST(-1, nixl_capi_notif_map_get_notif(nm, "xfer-B", 0, &nd, &nl));
    CHECK_ST(-1, nixl_capi_notif_map_get_agent_at(nm, 1, &who));

    /* Repost with NULL opt_args keeps (re-sends) the creation notification. */
    ft_fill(a_src, LEN, 2);
    CHECK_ST(0, run_req(A, r, NULL));
    CHECK(ft_verify(b_buf, LEN, 2) < 0, "reposted WRITE delivers the new pattern");
    /* get_notifs appends into the map. */
    CHECK(ft_wait_notifs(B, nm, "xfer-A", 2), "repost re-sends the notification (map appends)");
    CHECK(ft_notif_equals(nm, "xfer-A", 1, msg, sizeof msg), "second notification equals the first");

    /* A per-post notification replaces the message. */
    nixl_capi_opt_args_t o2 = NULL;
    CHECK_ST(0, nixl_capi_create_opt_args(&o2));
    CHECK_ST(0, nixl_capi_opt_args_set_notif_msg(o2, "per-post", 8));
    CHECK_ST(0, nixl_capi_opt_args_set_has_notif(o2, true));
    CHECK_ST(0, run_req(A, r, o2));
    CHECK(ft_wait_notifs(B, nm, "xfer-A", 3), "per-post notification arrives");
    CHECK(ft_notif_equals(nm, "xfer-A", 2, "per-post", 8), "per-post payload is \"per-post\"");
    CHECK_ST(0, nixl_capi_destroy_opt_args(o2));

    /* An empty notification through has_notif(true) with no message. */
    nixl_capi_opt_args_t o3 = NULL;
    CHECK_ST(0, nixl_capi_create_opt_args(&o3));
    CHECK_ST(0, nixl_capi_opt_args_set_has_notif(o3, true));
    CHECK_ST(0, run_req(A, r, o3));
    CHECK(ft_wait_notifs(B, nm, "xfer-A", 4), "empty notification arrives");
    CHECK(ft_notif_equals(nm, "xfer-A", 3, "", 0), "empty notification has length 0");
    CHECK_ST(0, nixl_capi_destroy_opt_args(o3));

    CHECK_ST(0, nixl_capi_notif_map_clear(nm));
    CHECK_ST(0, nixl_capi_notif_map_size(nm, &n));
    CHECK(n == 0, "notif_map_clear empties the map");

    /* Order: destroy before release is INVALID_STATE; then release, destroy. */
    CHECK_ST(-3, nixl_capi_destroy_xfer_req(r));
    CHECK_ST(0, nixl_capi_release_xfer_req(A, r));
    /* The wrapper survives release, with its inner handle cleared. */
    CHECK_ST(-1, nixl_capi_release_xfer_req(A, r));
    CHECK_ST(-1, nixl_capi_post_xfer_req(A, r, NULL));
    if (gixl_only("status/estimate/backend/telemetry of a released request")) {
        CHECK_ERR(nixl_capi_get_xfer_status(A, r));
        CHECK_ERR(nixl_capi_estimate_xfer_cost(A, r, NULL, &dur, &err, &method));
        CHECK_ERR(nixl_capi_query_xfer_backend(A, r, &qb));
        CHECK_ERR(nixl_capi_get_xfer_telemetry(A, r, &tel));
    }
    CHECK_ST(0, nixl_capi_destroy_xfer_req(r));
    if (gixl_only("request used after destroy_xfer_req")) {
        CHECK_ERR(nixl_capi_destroy_xfer_req(r));
        CHECK_ERR(nixl_capi_release_xfer_req(A, r));
        CHECK_ERR(nixl_capi_post_xfer_req(A, r, NULL));
        CHECK_ERR(nixl_capi_get_xfer_status(A, r));
    }

    CHECK_ST(0, nixl_capi_destroy_opt_args(o));
    CHECK_ST(0, nixl_capi_destroy_notif_map(nm));
    nixl_capi_destroy_xfer_dlist(l);
    nixl_capi_destroy_xfer_dlist(rm);
}

static void test_read_and_loopback(void)
{
    nixl_capi_xfer_req_t r = NULL;

    /* READ: B's buffer into A's a_dst. */
    ft_fill(b_buf, LEN, 3);
    memset(a_dst, 0, LEN);
    nixl_capi_xfer_dlist_t l = ft_xfer_list(a_dst, LEN);
    nixl_capi_xfer_dlist_t rm = ft_xfer_list(b_buf, LEN);
    CHECK_ST(0, nixl_capi_create_xfer_req(A, NIXL_CAPI_XFER_OP_READ, l, rm, "xfer-B", &r, NULL));
    if (r) {
        CHECK_ST(0, run_req(A, r, NULL));
        CHECK(ft_verify(a_dst, LEN, 3) < 0, "READ: A's buffer holds B's pattern");
        CHECK(ft_verify(b_buf, LEN, 3) < 0, "READ leaves the source unchanged");
        CHECK_ST(0, nixl_capi_release_xfer_req(A, r));
        CHECK_ST(0, nixl_capi_destroy_xfer_req(r));
        r = NULL;
    }
    nixl_capi_destroy_xfer_dlist(l);
    nixl_capi_destroy_xfer_dlist(rm);

    /* Loopback through prepped handles: a_src -> a_dst, own name as target. */
    ft_fill(a_src, LEN, 4);
    memset(a_dst, 0, LEN);
    int s1, s2;
    nixl_capi_xfer_dlist_handle_t hl = NULL, hr = NULL;
    nixl_capi_xfer_dlist_t dl = halves(a_src), dr = halves(a_dst);
    s1 = nixl_capi_prep_xfer_dlist(A, "", dl, &hl, NULL);
    s2 = nixl_capi_prep_xfer_dlist(A, "xfer-A", dr, &hr, NULL);
    CHECK_ST(0, s1);
    CHECK_ST(0, s2);
    nixl_capi_destroy_xfer_dlist(dl);
    nixl_capi_destroy_xfer_dlist(dr);
    if (hl && hr) {
        /* Swap the halves: a_dst[0..HALF) <- a_src[HALF..LEN) and vice versa. */
        const int li[] = {1, 0}, ri[] = {0, 1};
        nixl_capi_opt_args_t o = NULL;
        nixl_capi_create_opt_args(&o);
        nixl_capi_opt_args_set_skip_desc_merge(o, true);
        CHECK_ST(0, nixl_capi_make_xfer_req(A, NIXL_CAPI_XFER_OP_WRITE, hl, li, 2, hr, ri, 2, &r,
                                            o));
        nixl_capi_destroy_opt_args(o);
        if (r) {
            CHECK_ST(0, run_req(A, r, NULL));
            bool ok = true;
            for (size_t i = 0; i < HALF; i++) {
                if (a_dst[i] != ft_pattern(i + HALF, 4) || a_dst[i + HALF] != ft_pattern(i, 4)) {
                    ok = false;
                    break;
                }
            }
            CHECK(ok, "loopback WRITE with swapped indices moved both halves");
            CHECK_ST(0, nixl_capi_release_xfer_req(A, r));
            CHECK_ST(0, nixl_capi_destroy_xfer_req(r));
        }
        /* Loopback notification goes to the agent itself. */
        nixl_capi_notif_map_t nm = NULL;
        nixl_capi_create_notif_map(&nm);
        CHECK_ST(0, nixl_capi_gen_notif(A, "xfer-A", "self", 4, NULL));
        CHECK(ft_wait_notifs(A, nm, "xfer-A", 1), "gen_notif to the agent's own name arrives");
        CHECK(ft_notif_equals(nm, "xfer-A", 0, "self", 4), "self notification payload");
        nixl_capi_destroy_notif_map(nm);
    }
    if (hl)
        CHECK_ST(0, nixl_capi_release_xfer_dlist_handle(A, hl));
    if (hr)
        CHECK_ST(0, nixl_capi_release_xfer_dlist_handle(A, hr));
}

static void test_gen_notif(void)
{
    nixl_capi_notif_map_t nm = NULL;
    CHECK_ST(0, nixl_capi_create_notif_map(&nm));
    CHECK_ST(0, nixl_capi_gen_notif(A, "xfer-B", "one", 3, NULL));
    CHECK_ST(0, nixl_capi_gen_notif(A, "xfer-B", "two", 3, NULL));
    CHECK_ST(0, nixl_capi_gen_notif(A, "xfer-B", NULL, 0, NULL));
    CHECK(ft_wait_notifs(B, nm, "xfer-A", 3), "B receives three gen_notif messages");
    CHECK(ft_notif_equals(nm, "xfer-A", 0, "one", 3) && ft_notif_equals(nm, "xfer-A", 1, "two", 3) &&
              ft_notif_equals(nm, "xfer-A", 2, "", 0),
          "gen_notif messages arrive in order: one, two, \"\"");
    /* Notifications the other way: B -> A, with a backend hint. */
    nixl_capi_opt_args_t o = NULL;
    CHECK_ST(0, nixl_capi_create_opt_args(&o));
    CHECK_ST(0, nixl_capi_opt_args_add_backend(o, BB));
    CHECK_ST(0, nixl_capi_gen_notif(B, "xfer-A", "back", 4, o));
    nixl_capi_notif_map_t am = NULL;
    CHECK_ST(0, nixl_capi_create_notif_map(&am));
    CHECK(ft_wait_notifs(A, am, "xfer-B", 1), "A receives B's gen_notif");
    CHECK_ST(0, nixl_capi_destroy_opt_args(o));
    CHECK_ST(0, nixl_capi_destroy_notif_map(am));

    CHECK_ST(-6, nixl_capi_gen_notif(A, "xfer-nobody", "x", 1, NULL));

    /* An agent without any backend cannot send or receive notifications. */
    nixl_capi_agent_t bare = NULL;
    CHECK_ST(0, nixl_capi_create_agent("xfer-bare", &bare));
    CHECK_ST(-2, nixl_capi_get_notifs(bare, nm, NULL));
    CHECK_ST(-2, nixl_capi_gen_notif(bare, "xfer-B", "x", 1, NULL));
    CHECK_ST(0, nixl_capi_destroy_agent(bare));

    if (gixl_only("gen_notif with data == NULL and len > 0")) {
        CHECK_ST(-1, nixl_capi_gen_notif(A, "xfer-B", NULL, 5, NULL));
    }
    CHECK_ST(0, nixl_capi_destroy_notif_map(nm));
}

static void test_stale_handles(void)
{
    /* Handles made against B's metadata become stale when A invalidates it. */
    nixl_capi_xfer_dlist_t l = ft_xfer_list(a_src, LEN);
    nixl_capi_xfer_dlist_t rm = ft_xfer_list(b_buf, LEN);
    nixl_capi_xfer_req_t r = NULL, r2 = NULL;
    nixl_capi_xfer_dlist_handle_t hl = NULL, hr = NULL;
    const int i0[] = {0};

    ft_fill(a_src, LEN, 5);
    CHECK_ST(0, nixl_capi_create_xfer_req(A, NIXL_CAPI_XFER_OP_WRITE, l, rm, "xfer-B", &r, NULL));
    CHECK_ST(0, nixl_capi_prep_xfer_dlist(A, "", l, &hl, NULL));
    CHECK_ST(0, nixl_capi_prep_xfer_dlist(A, "xfer-B", rm, &hr, NULL));
    REQUIRE(r && hl && hr, "handles for the stale-handle test");
    CHECK_ST(0, run_req(A, r, NULL));
    CHECK(ft_verify(b_buf, LEN, 5) < 0, "WRITE before invalidation lands");

    CHECK_ST(0, nixl_capi_invalidate_remote_md(A, "xfer-B"));
    ft_fill(a_src, LEN, 6);
    CHECK_ST(-6, nixl_capi_post_xfer_req(A, r, NULL));
    int64_t dur, err;
    nixl_capi_cost_t m;
    CHECK_ST(-6, nixl_capi_estimate_xfer_cost(A, r, NULL, &dur, &err, &m));
    /* A completed request keeps reporting its cached status. */
    CHECK_ST(0, nixl_capi_get_xfer_status(A, r));
    CHECK_ST(-6, nixl_capi_make_xfer_req(A, NIXL_CAPI_XFER_OP_WRITE, hl, i0, 1, hr, i0, 1, &r2,
                                         NULL));
    CHECK(ft_verify(b_buf, LEN, 5) < 0, "stale handle did not write into B");

    /* Reloading B's metadata does not revive the old handles. */
    REQUIRE_ST(0, ft_exchange_md(B, A, NULL, 0));
    CHECK_ST(-6, nixl_capi_post_xfer_req(A, r, NULL));
    CHECK_ST(-6, nixl_capi_make_xfer_req(A, NIXL_CAPI_XFER_OP_WRITE, hl, i0, 1, hr, i0, 1, &r2,
                                         NULL));
    CHECK(ft_verify(b_buf, LEN, 5) < 0, "stale handle still did not write into B after reload");
    /* A stale request releases fine. */
    CHECK_ST(0, nixl_capi_release_xfer_req(A, r));
    CHECK_ST(0, nixl_capi_destroy_xfer_req(r));
    CHECK_ST(0, nixl_capi_release_xfer_dlist_handle(A, hr));

    /* Fresh handles work. */
    hr = NULL;
    CHECK_ST(0, nixl_capi_prep_xfer_dlist(A, "xfer-B", rm, &hr, NULL));
    CHECK_ST(0, nixl_capi_make_xfer_req(A, NIXL_CAPI_XFER_OP_WRITE, hl, i0, 1, hr, i0, 1, &r2,
                                        NULL));
    if (r2) {
        CHECK_ST(0, run_req(A, r2, NULL));
        CHECK(ft_verify(b_buf, LEN, 6) < 0, "fresh handle after reload writes into B");
        CHECK_ST(0, nixl_capi_release_xfer_req(A, r2));
        CHECK_ST(0, nixl_capi_destroy_xfer_req(r2));
    }
    CHECK_ST(0, nixl_capi_release_xfer_dlist_handle(A, hl));
    if (hr)
        CHECK_ST(0, nixl_capi_release_xfer_dlist_handle(A, hr));
    nixl_capi_destroy_xfer_dlist(l);
    nixl_capi_destroy_xfer_dlist(rm);
}

static void test_mem_view(void)
{
    /* Memory views belong to the GPU device API; on DRAM the UCX backend fails
     * (BACKEND) and no handle is produced. */
    nixl_capi_xfer_dlist_t l = ft_xfer_list(a_src, LEN);
    nixl_capi_remote_dlist_t r = NULL;
    nixl_capi_mem_view_t mv = NULL;
    CHECK_ST(-2, nixl_capi_prep_mem_view_local(A, l, &mv, NULL));
    CHECK_ST(0, nixl_capi_create_remote_dlist(NIXL_CAPI_MEM_DRAM, &r));
    CHECK_ST(0, nixl_capi_remote_dlist_add_desc(r, (uintptr_t)b_buf, LEN, 0, "xfer-B"));
    CHECK_ST(-2, nixl_capi_prep_mem_view_remote(A, r, &mv, NULL));
    CHECK(mv == NULL, "failed prep_mem_view leaves the handle NULL");
    nixl_capi_destroy_remote_dlist(r);
    nixl_capi_destroy_xfer_dlist(l);
}

static void teardown(void)
{
    nixl_capi_destroy_backend(BA);
    nixl_capi_destroy_backend(BB);
    CHECK_ST(0, nixl_capi_destroy_agent(A));
    CHECK_ST(0, nixl_capi_destroy_agent(B));
    free(a_src);
    free(a_dst);
    free(b_buf);
    free(unreg);
}

int main(void)
{
    ft_begin("t_xfer");
    setup();
    test_prep();
    test_make_errors();
    test_create_errors();
    test_lifecycle_and_write();
    test_read_and_loopback();
    test_gen_notif();
    test_stale_handles();
    test_mem_view();
    teardown();
    return ft_end();
}
