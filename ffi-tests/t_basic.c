/*
 * t_basic: agent lifecycle, plugin discovery, backend creation and the small
 * container helpers (params, string lists, memory lists, optional args).
 */
#define _GNU_SOURCE
#include "util.h"

static size_t count_params(nixl_capi_params_t p)
{
    size_t n = 0;
    nixl_capi_param_iter_t it = NULL;
    if (nixl_capi_params_create_iterator(p, &it) != 0)
        return (size_t)-1;
    bool more = true;
    while (more) {
        const char *k = NULL, *v = NULL;
        if (nixl_capi_params_iterator_next(it, &k, &v, &more) != 0 || !k)
            break;
        n++;
    }
    nixl_capi_params_destroy_iterator(it);
    return n;
}

static void test_agent_lifecycle(void)
{
    nixl_capi_agent_t a = NULL, b = NULL, c = NULL;

    CHECK_ST(0, nixl_capi_create_agent("basic-A", &a));
    CHECK(a != NULL, "create_agent stores a non-NULL handle");
    /* Two agents may share a name inside one process. */
    CHECK_ST(0, nixl_capi_create_agent("basic-A", &b));
    CHECK(b != NULL && b != a, "second agent with the same name is a distinct handle");
    CHECK_ST(0, nixl_capi_destroy_agent(b));
    /* An empty name throws in C++; the C API reports BACKEND. */
    CHECK_ST(-2, nixl_capi_create_agent("", &c));

    nixl_capi_agent_config_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.enable_prog_thread = false;
    cfg.enable_listen_thread = false;
    cfg.listen_port = 0;
    cfg.thread_sync = NIXL_CAPI_THREAD_SYNC_RW;
    cfg.num_workers = 4; /* ignored by NIXL */
    cfg.pthr_delay_us = 0;
    cfg.lthr_delay_us = 100000;
    cfg.capture_telemetry = false;
    CHECK(sizeof(nixl_capi_agent_config_t) == 40, "sizeof(nixl_capi_agent_config_t) == 40");
    CHECK_ST(0, nixl_capi_create_configured_agent("basic-cfg", &cfg, &b));
    CHECK(b != NULL, "create_configured_agent stores a non-NULL handle");
    CHECK_ST(0, nixl_capi_destroy_agent(b));
    b = NULL;

    cfg.thread_sync = NIXL_CAPI_THREAD_SYNC_STRICT;
    cfg.enable_prog_thread = true;
    CHECK_ST(0, nixl_capi_create_configured_agent("basic-cfg-strict", &cfg, &b));
    CHECK_ST(0, nixl_capi_destroy_agent(b));
    b = NULL;

    /* listen_port 0 means an OS-assigned port for the metadata listener. */
    cfg.enable_listen_thread = true;
    cfg.listen_port = 0;
    CHECK_ST(0, nixl_capi_create_configured_agent("basic-cfg-listen", &cfg, &b));
    CHECK_ST(0, nixl_capi_destroy_agent(b));
    b = NULL;

    cfg.enable_listen_thread = false;
    CHECK_ST(-2, nixl_capi_create_configured_agent("", &cfg, &b));

    /* An agent with no backend: metadata calls need a remote-capable backend. */
    void *md = NULL;
    size_t md_len = 0;
    CHECK_ST(-1, nixl_capi_get_local_md(a, &md, &md_len));
    free(md);

    CHECK_ST(0, nixl_capi_destroy_agent(a));
    CHECK(!nixl_capi_is_stub(), "nixl_capi_is_stub() is false for a real library");
}

static void test_plugins_and_backend(void)
{
    nixl_capi_agent_t a = NULL;
    REQUIRE_ST(0, nixl_capi_create_agent("basic-plugins", &a));

    nixl_capi_string_list_t plugins = NULL;
    CHECK_ST(0, nixl_capi_get_available_plugins(a, &plugins));
    size_t n = 0;
    CHECK_ST(0, nixl_capi_string_list_size(plugins, &n));
    CHECK(n >= 1, "at least one plugin is available");
    bool have_ucx = false;
    for (size_t i = 0; i < n; i++) {
        const char *s = NULL;
        if (nixl_capi_string_list_get(plugins, i, &s) == 0 && s && strcmp(s, "UCX") == 0)
            have_ucx = true;
    }
    CHECK(have_ucx, "plugin list contains \"UCX\"");
    const char *s = (const char *)0x1;
    CHECK_ST(-1, nixl_capi_string_list_get(plugins, n, &s));
    CHECK(s == (const char *)0x1, "string_list_get out of range leaves *str untouched");
    CHECK_ST(0, nixl_capi_destroy_string_list(plugins));

    /* Plugin params: UCX supports DRAM and VRAM and has three init options. */
    nixl_capi_mem_list_t mems = NULL;
    nixl_capi_params_t params = NULL;
    CHECK_ST(0, nixl_capi_get_plugin_params(a, "UCX", &mems, &params));
    bool empty = true;
    CHECK_ST(0, nixl_capi_mem_list_is_empty(mems, &empty));
    CHECK(!empty, "UCX mem list is not empty");
    size_t nm = 0;
    CHECK_ST(0, nixl_capi_mem_list_size(mems, &nm));
    CHECK(nm == 2, "UCX mem list has 2 entries");
    nixl_capi_mem_type_t mt = NIXL_CAPI_MEM_UNKNOWN;
    CHECK_ST(0, nixl_capi_mem_list_get(mems, 0, &mt));
    CHECK(mt == NIXL_CAPI_MEM_DRAM, "UCX mem list [0] is DRAM");
    CHECK_ST(0, nixl_capi_mem_list_get(mems, 1, &mt));
    CHECK(mt == NIXL_CAPI_MEM_VRAM, "UCX mem list [1] is VRAM");
    CHECK_ST(-1, nixl_capi_mem_list_get(mems, nm, &mt));

    bool have_mode = false, have_workers = false, have_devices = false;
    size_t count = 0;
    nixl_capi_param_iter_t it = NULL;
    CHECK_ST(0, nixl_capi_params_create_iterator(params, &it));
    bool has_next = true;
    while (has_next) {
        const char *k = NULL, *v = NULL;
        if (nixl_capi_params_iterator_next(it, &k, &v, &has_next) != 0 || !k)
            break;
        count++;
        if (strcmp(k, "ucx_error_handling_mode") == 0 && strcmp(v, "peer") == 0)
            have_mode = true;
        if (strcmp(k, "num_workers") == 0 && strcmp(v, "1") == 0)
            have_workers = true;
        if (strcmp(k, "ucx_devices") == 0 && strcmp(v, "") == 0)
            have_devices = true;
    }
    CHECK(count == 3, "UCX plugin params have 3 entries");
    CHECK(have_mode, "UCX param ucx_error_handling_mode=peer");
    CHECK(have_workers, "UCX param num_workers=1");
    CHECK(have_devices, "UCX param ucx_devices is empty");
    {
        /* An exhausted iterator reports has_next=false and leaves key/value alone. */
        const char *k = "untouched", *v = "untouched";
        bool hn = true;
        CHECK_ST(0, nixl_capi_params_iterator_next(it, &k, &v, &hn));
        CHECK(!hn && strcmp(k, "untouched") == 0 && strcmp(v, "untouched") == 0,
              "exhausted iterator: has_next=false, key/value unchanged");
    }
    CHECK_ST(0, nixl_capi_params_destroy_iterator(it));

    /* Unknown plugin. */
    nixl_capi_mem_list_t m2 = NULL;
    nixl_capi_params_t p2 = NULL;
    CHECK_ST(-2, nixl_capi_get_plugin_params(a, "NO_SUCH_PLUGIN", &m2, &p2));

    /* Backend creation. */
    nixl_capi_backend_t be = NULL, be2 = NULL;
    CHECK_ST(-2, nixl_capi_create_backend(a, "NO_SUCH_PLUGIN", params, &be2));
    CHECK_ST(0, nixl_capi_create_backend(a, "UCX", params, &be));
    CHECK(be != NULL, "create_backend stores a non-NULL handle");
    /* A second backend of the same type is refused (INVALID_PARAM in C++, BACKEND here). */
    CHECK_ST(-2, nixl_capi_create_backend(a, "UCX", params, &be2));

    nixl_capi_mem_list_t bm = NULL;
    nixl_capi_params_t bp = NULL;
    CHECK_ST(0, nixl_capi_get_backend_params(a, be, &bm, &bp));
    size_t nbm = 0;
    CHECK_ST(0, nixl_capi_mem_list_size(bm, &nbm));
    CHECK(nbm == 2, "UCX backend mem list has 2 entries");
    bool bp_empty = false;
    CHECK_ST(0, nixl_capi_params_is_empty(bp, &bp_empty));
    CHECK(!bp_empty, "UCX backend params (after init) are not empty");
    CHECK(count_params(bp) == 3, "backend params echo the 3 init params it was created with");
    CHECK_ST(0, nixl_capi_destroy_mem_list(bm));
    CHECK_ST(0, nixl_capi_destroy_params(bp));

    /* Metadata is available once a remote-capable backend exists. */
    void *md = NULL;
    size_t md_len = 0;
    CHECK_ST(0, nixl_capi_get_local_md(a, &md, &md_len));
    /* The blob format is each implementation's own (gixl's starts with "GIXLMD"); only NIXL's is checked. */
    if (ft_oracle_is_nixl())
        CHECK(md != NULL && md_len > 11 && memcmp(md, "nixlSerDes|", 11) == 0,
              "metadata blob starts with \"nixlSerDes|\"");
    else
        CHECK(md != NULL && md_len > 6 && memcmp(md, "GIXLMD", 6) == 0, "metadata blob starts with \"GIXLMD\"");
    free(md);

    /* destroy_backend frees only the wrapper; the engine stays in the agent. */
    CHECK_ST(0, nixl_capi_destroy_backend(be));
    md = NULL;
    CHECK_ST(0, nixl_capi_get_local_md(a, &md, &md_len));
    free(md);

    CHECK_ST(0, nixl_capi_destroy_mem_list(mems));
    CHECK_ST(0, nixl_capi_destroy_params(params));
    CHECK_ST(0, nixl_capi_destroy_agent(a));
}

static void test_backend_empty_params(void)
{
    /* A backend created with empty init params reports empty params. */
    nixl_capi_agent_t a = NULL;
    nixl_capi_params_t empty = NULL, bp = NULL;
    nixl_capi_mem_list_t bm = NULL;
    nixl_capi_backend_t be = NULL;
    REQUIRE_ST(0, nixl_capi_create_agent("basic-empty-params", &a));
    CHECK_ST(0, nixl_capi_create_params(&empty));
    CHECK_ST(0, nixl_capi_create_backend(a, "UCX", empty, &be));
    CHECK_ST(0, nixl_capi_get_backend_params(a, be, &bm, &bp));
    bool is_empty = false;
    CHECK_ST(0, nixl_capi_params_is_empty(bp, &is_empty));
    CHECK(is_empty, "UCX created with {} reports empty backend params");
    size_t n = 0;
    CHECK_ST(0, nixl_capi_mem_list_size(bm, &n));
    CHECK(n == 2, "... and still supports 2 memory types");
    nixl_capi_destroy_mem_list(bm);
    nixl_capi_destroy_params(bp);
    nixl_capi_destroy_params(empty);
    nixl_capi_destroy_backend(be);
    CHECK_ST(0, nixl_capi_destroy_agent(a));
}

static void test_params(void)
{
    nixl_capi_params_t p = NULL;
    bool empty = false;
    CHECK_ST(0, nixl_capi_create_params(&p));
    CHECK_ST(0, nixl_capi_params_is_empty(p, &empty));
    CHECK(empty, "new params are empty");

    nixl_capi_param_iter_t it = NULL;
    CHECK_ST(0, nixl_capi_params_create_iterator(p, &it));
    const char *k = "untouched", *v = "untouched";
    bool hn = true;
    CHECK_ST(0, nixl_capi_params_iterator_next(it, &k, &v, &hn));
    CHECK(!hn && strcmp(k, "untouched") == 0, "iterator over empty params: has_next=false");
    CHECK_ST(0, nixl_capi_params_destroy_iterator(it));

    CHECK_ST(0, nixl_capi_params_add(p, "alpha", "1"));
    CHECK_ST(0, nixl_capi_params_add(p, "beta", "two"));
    CHECK_ST(0, nixl_capi_params_add(p, "alpha", "3")); /* overwrite */
    CHECK_ST(0, nixl_capi_params_add(p, "empty", ""));
    CHECK_ST(0, nixl_capi_params_is_empty(p, &empty));
    CHECK(!empty, "params with entries are not empty");

    size_t count = 0;
    bool alpha3 = false, beta = false, emp = false;
    CHECK_ST(0, nixl_capi_params_create_iterator(p, &it));
    hn = true;
    while (hn) {
        k = v = NULL;
        if (nixl_capi_params_iterator_next(it, &k, &v, &hn) != 0 || !k)
            break;
        count++;
        if (!strcmp(k, "alpha") && !strcmp(v, "3"))
            alpha3 = true;
        if (!strcmp(k, "beta") && !strcmp(v, "two"))
            beta = true;
        if (!strcmp(k, "empty") && !strcmp(v, ""))
            emp = true;
    }
    CHECK(count == 3, "iterator yields 3 entries (overwrite did not duplicate)");
    CHECK(alpha3, "params_add overwrote alpha with 3");
    CHECK(beta && emp, "beta=two and empty=\"\" present");
    CHECK_ST(0, nixl_capi_params_destroy_iterator(it));
    CHECK_ST(0, nixl_capi_destroy_params(p));
}

static void test_mem_type_strings(void)
{
    static const char *want[] = {"DRAM", "VRAM", "BLOCK", "OBJECT", "FILE", "UNKNOWN"};
    for (int i = 0; i <= 5; i++) {
        const char *s = NULL;
        CHECK_ST(0, nixl_capi_mem_type_to_string((nixl_capi_mem_type_t)i, &s));
        char text[96];
        snprintf(text, sizeof text, "mem_type_to_string(%d) == \"%s\"", i, want[i]);
        CHECK(s && strcmp(s, want[i]) == 0, text);
    }
    const char *s = NULL;
    CHECK_ST(-1, nixl_capi_mem_type_to_string((nixl_capi_mem_type_t)6, &s));
    CHECK_ST(-1, nixl_capi_mem_type_to_string((nixl_capi_mem_type_t)-1, &s));
}

static void test_opt_args(void)
{
    nixl_capi_opt_args_t o = NULL;
    CHECK_ST(0, nixl_capi_create_opt_args(&o));

    void *data = (void *)0x1;
    size_t len = 99;
    bool flag = true;

    /* Defaults. */
    CHECK_ST(0, nixl_capi_opt_args_get_notif_msg(o, &data, &len));
    CHECK(data == NULL && len == 0, "default notif msg is NULL/0");
    CHECK_ST(0, nixl_capi_opt_args_get_has_notif(o, &flag));
    CHECK(!flag, "default has_notif is false");
    flag = true;
    CHECK_ST(0, nixl_capi_opt_args_get_skip_desc_merge(o, &flag));
    CHECK(!flag, "default skip_desc_merge is false");
    data = (void *)0x1;
    len = 99;
    CHECK_ST(0, nixl_capi_opt_args_get_custom_param(o, &data, &len));
    CHECK(data == NULL && len == 0, "default custom param is NULL/0");

    /* Notification message: binary safe, malloc'd copy. */
    static const char msg[] = {'n', '\0', 't', 'i', 'f'};
    CHECK_ST(0, nixl_capi_opt_args_set_notif_msg(o, msg, sizeof msg));
    CHECK_ST(0, nixl_capi_opt_args_get_notif_msg(o, &data, &len));
    CHECK(data && len == sizeof msg && memcmp(data, msg, len) == 0,
          "notif msg round-trips (with an embedded NUL)");
    free(data);
    /* Setting the message does not turn has_notif on by itself. */
    CHECK_ST(0, nixl_capi_opt_args_get_has_notif(o, &flag));
    CHECK(!flag, "set_notif_msg leaves has_notif false");
    CHECK_ST(-1, nixl_capi_opt_args_set_notif_msg(o, NULL, 3));
    CHECK_ST(0, nixl_capi_opt_args_set_has_notif(o, true));
    CHECK_ST(0, nixl_capi_opt_args_get_has_notif(o, &flag));
    CHECK(flag, "has_notif reads back true");
    CHECK_ST(0, nixl_capi_opt_args_set_notif_msg(o, "second", 6));
    CHECK_ST(0, nixl_capi_opt_args_get_notif_msg(o, &data, &len));
    CHECK(data && len == 6 && memcmp(data, "second", 6) == 0,
          "notif msg replaced while has_notif is on");
    free(data);
    /* Clearing the message with (NULL, 0) is allowed. */
    CHECK_ST(0, nixl_capi_opt_args_set_notif_msg(o, NULL, 0));
    data = (void *)0x1;
    CHECK_ST(0, nixl_capi_opt_args_get_notif_msg(o, &data, &len));
    CHECK(data == NULL && len == 0, "notif msg cleared by (NULL, 0)");
    CHECK_ST(0, nixl_capi_opt_args_set_has_notif(o, false));
    CHECK_ST(0, nixl_capi_opt_args_get_has_notif(o, &flag));
    CHECK(!flag, "has_notif reads back false");

    /* Skip merge. */
    CHECK_ST(0, nixl_capi_opt_args_set_skip_desc_merge(o, true));
    CHECK_ST(0, nixl_capi_opt_args_get_skip_desc_merge(o, &flag));
    CHECK(flag, "skip_desc_merge reads back true");
    CHECK_ST(0, nixl_capi_opt_args_set_skip_desc_merge(o, false));
    CHECK_ST(0, nixl_capi_opt_args_get_skip_desc_merge(o, &flag));
    CHECK(!flag, "skip_desc_merge reads back false");

    /* P2P address (write-only in the C API). */
    CHECK_ST(0, nixl_capi_opt_args_set_ip_addr(o, "127.0.0.1"));
    CHECK_ST(0, nixl_capi_opt_args_set_ip_addr(o, ""));
    CHECK_ST(0, nixl_capi_opt_args_set_port(o, 8888));
    CHECK_ST(0, nixl_capi_opt_args_set_port(o, 0));

    /* Custom param. */
    static const unsigned char cp[] = {0, 1, 2, 0xff};
    CHECK_ST(0, nixl_capi_opt_args_set_custom_param(o, cp, sizeof cp));
    CHECK_ST(0, nixl_capi_opt_args_get_custom_param(o, &data, &len));
    CHECK(data && len == sizeof cp && memcmp(data, cp, len) == 0, "custom param round-trips");
    free(data);
    CHECK_ST(-1, nixl_capi_opt_args_set_custom_param(o, NULL, 2));
    CHECK_ST(0, nixl_capi_opt_args_set_custom_param(o, NULL, 0));
    data = (void *)0x1;
    CHECK_ST(0, nixl_capi_opt_args_get_custom_param(o, &data, &len));
    CHECK(data == NULL && len == 0, "custom param cleared by (NULL, 0)");

    /* Backend hints. */
    nixl_capi_agent_t a = NULL;
    nixl_capi_backend_t be = NULL;
    REQUIRE_ST(0, ft_make_agent("basic-optargs", &a, &be));
    CHECK_ST(0, nixl_capi_opt_args_add_backend(o, be));
    CHECK_ST(0, nixl_capi_opt_args_add_backend(o, be));
    CHECK_ST(0, nixl_capi_destroy_backend(be));

    CHECK_ST(0, nixl_capi_destroy_opt_args(o));
    CHECK_ST(0, nixl_capi_destroy_agent(a));
}

int main(void)
{
    ft_begin("t_basic");
    test_agent_lifecycle();
    test_plugins_and_backend();
    test_backend_empty_params();
    test_params();
    test_mem_type_strings();
    test_opt_args();
    return ft_end();
}
