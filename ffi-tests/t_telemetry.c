/*
 * t_telemetry: get_xfer_telemetry with telemetry off (NO_TELEMETRY, -5) and
 * on, both through the agent config (capture_telemetry) and through the
 * environment (NIXL_TELEMETRY_ENABLE=y).  The environment is read when an
 * agent is created, so this test changes it between agents.
 */
#define _GNU_SOURCE
#include "util.h"

#include <unistd.h>

#define LEN 4096
#define NDESC 2

static unsigned char *src, *dst;

static int make_cfg_agent(const char *name, bool capture, nixl_capi_agent_t *a,
                          nixl_capi_backend_t *be)
{
    nixl_capi_agent_config_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.enable_prog_thread = true;
    cfg.listen_port = 0;
    cfg.thread_sync = NIXL_CAPI_THREAD_SYNC_NONE;
    cfg.lthr_delay_us = 100000;
    cfg.capture_telemetry = capture;
    int s = nixl_capi_create_configured_agent(name, &cfg, a);
    if (s)
        return s;
    nixl_capi_mem_list_t m = NULL;
    nixl_capi_params_t p = NULL;
    s = nixl_capi_get_plugin_params(*a, "UCX", &m, &p);
    if (s)
        return s;
    s = nixl_capi_create_backend(*a, "UCX", p, be);
    nixl_capi_destroy_mem_list(m);
    nixl_capi_destroy_params(p);
    return s;
}

/*
 * Run a two-descriptor WRITE from initiator `ini` (owning src) to target `tgt`
 * (owning dst) and return the telemetry status; *tel receives the values.
 * `posted` = false checks a request that was never posted.
 */
static int write_and_get_telemetry(nixl_capi_agent_t ini, nixl_capi_agent_t tgt,
                                   const char *tgt_name, bool posted,
                                   struct nixl_capi_xfer_telemetry_s *tel)
{
    nixl_capi_xfer_dlist_t l = ft_xfer_list(NULL, 0), r = ft_xfer_list(NULL, 0);
    for (int i = 0; i < NDESC; i++) {
        /* Non-adjacent pieces so the two descriptors cannot be merged. */
        nixl_capi_xfer_dlist_add_desc(l, (uintptr_t)src + (size_t)i * 2048, 64, 0);
        nixl_capi_xfer_dlist_add_desc(r, (uintptr_t)dst + (size_t)i * 1024, 64, 0);
    }
    nixl_capi_opt_args_t o = NULL;
    nixl_capi_create_opt_args(&o);
    nixl_capi_opt_args_set_notif_msg(o, "telem_msg", 9);
    nixl_capi_opt_args_set_has_notif(o, true);
    nixl_capi_xfer_req_t req = NULL;
    int s = nixl_capi_create_xfer_req(ini, NIXL_CAPI_XFER_OP_WRITE, l, r, tgt_name, &req, o);
    if (s == 0 && posted) {
        s = nixl_capi_post_xfer_req(ini, req, NULL);
        if (s >= 0)
            s = ft_wait_xfer(ini, req, s);
    }
    if (s == 0) {
        memset(tel, 0xab, sizeof *tel);
        s = nixl_capi_get_xfer_telemetry(ini, req, tel);
    } else {
        s = -100 + s; /* setup failed: never equal to an expected status */
    }
    if (req) {
        nixl_capi_release_xfer_req(ini, req);
        nixl_capi_destroy_xfer_req(req);
    }
    /* Drain the target's notifications so they do not pile up. */
    nixl_capi_notif_map_t nm = NULL;
    nixl_capi_create_notif_map(&nm);
    if (posted)
        ft_wait_notifs(tgt, nm, "tel-A", 1);
    nixl_capi_destroy_notif_map(nm);
    nixl_capi_destroy_opt_args(o);
    nixl_capi_destroy_xfer_dlist(l);
    nixl_capi_destroy_xfer_dlist(r);
    return s;
}

static void check_values(const struct nixl_capi_xfer_telemetry_s *t, const char *what)
{
    char text[256];
    snprintf(text, sizeof text,
             "%s: desc_count=%llu (2), total_bytes=%llu (128), start_time_us=%llu (>0), "
             "post_duration_us=%llu, xfer_duration_us=%llu (>= post)",
             what, (unsigned long long)t->desc_count, (unsigned long long)t->total_bytes,
             (unsigned long long)t->start_time_us, (unsigned long long)t->post_duration_us,
             (unsigned long long)t->xfer_duration_us);
    CHECK(t->desc_count == NDESC && t->total_bytes == 64 * NDESC && t->start_time_us > 0 &&
              t->xfer_duration_us >= t->post_duration_us,
          text);
}

/* Build A (initiator, owning src) and B (target, owning dst), exchange metadata. */
static bool pair(nixl_capi_agent_t *a, nixl_capi_backend_t *ba, nixl_capi_agent_t *b,
                 nixl_capi_backend_t *bb, int capture_a)
{
    int s;
    if (capture_a < 0)
        s = ft_make_agent("tel-A", a, ba);
    else
        s = make_cfg_agent("tel-A", capture_a != 0, a, ba);
    if (s)
        return false;
    if (ft_make_agent("tel-B", b, bb))
        return false;
    if (ft_register(*a, src, LEN) || ft_register(*b, dst, LEN))
        return false;
    return ft_exchange_md(*b, *a, NULL, 0) == 0;
}

static void unpair(nixl_capi_agent_t a, nixl_capi_backend_t ba, nixl_capi_agent_t b,
                   nixl_capi_backend_t bb)
{
    nixl_capi_destroy_backend(ba);
    nixl_capi_destroy_backend(bb);
    nixl_capi_destroy_agent(a);
    nixl_capi_destroy_agent(b);
}

int main(void)
{
    ft_begin("t_telemetry");
    src = calloc(1, LEN);
    dst = calloc(1, LEN);
    ft_fill(src, LEN, 9);

    char dir[] = "/tmp/gixl-ffi-telemetry-XXXXXX";
    REQUIRE(mkdtemp(dir) != NULL, "mkdtemp for NIXL_TELEMETRY_DIR");
    setenv("NIXL_TELEMETRY_DIR", dir, 1);

    nixl_capi_agent_t a = NULL, b = NULL;
    nixl_capi_backend_t ba = NULL, bb = NULL;
    struct nixl_capi_xfer_telemetry_s t;

    /* 1. Environment unset, default agent: disabled. */
    unsetenv("NIXL_TELEMETRY_ENABLE");
    REQUIRE(pair(&a, &ba, &b, &bb, -1), "agents without telemetry");
    CHECK_ST(-5, write_and_get_telemetry(a, b, "tel-B", true, &t));
    CHECK(t.total_bytes == 0xababababababababull, "disabled: struct left untouched");
    CHECK_ST(-5, write_and_get_telemetry(a, b, "tel-B", false, &t));
    unpair(a, ba, b, bb);

    /* 2. capture_telemetry in the config. */
    REQUIRE(pair(&a, &ba, &b, &bb, 1), "agents with capture_telemetry=true");
    CHECK_ST(0, write_and_get_telemetry(a, b, "tel-B", true, &t));
    check_values(&t, "capture_telemetry=true");
    /* Enabled, but never posted: NOT_POSTED (BACKEND). */
    CHECK_ST(-2, write_and_get_telemetry(a, b, "tel-B", false, &t));
    unpair(a, ba, b, bb);

    /* 3. NIXL_TELEMETRY_ENABLE=y with a default agent. */
    setenv("NIXL_TELEMETRY_ENABLE", "y", 1);
    REQUIRE(pair(&a, &ba, &b, &bb, -1), "agents with NIXL_TELEMETRY_ENABLE=y");
    CHECK_ST(0, write_and_get_telemetry(a, b, "tel-B", true, &t));
    check_values(&t, "NIXL_TELEMETRY_ENABLE=y");
    unpair(a, ba, b, bb);

    /* 4. An explicit "no" in the environment wins over capture_telemetry. */
    setenv("NIXL_TELEMETRY_ENABLE", "no", 1);
    REQUIRE(pair(&a, &ba, &b, &bb, 1), "agents with capture_telemetry=true, env=no");
    CHECK_ST(-5, write_and_get_telemetry(a, b, "tel-B", true, &t));
    unpair(a, ba, b, bb);
    unsetenv("NIXL_TELEMETRY_ENABLE");

    /* Remove whatever the telemetry writer left behind. */
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0)
        printf("# could not remove %s\n", dir);
    free(src);
    free(dst);
    return ft_end();
}
