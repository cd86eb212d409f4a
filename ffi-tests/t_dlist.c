/*
 * t_dlist: descriptor-list helpers (xfer, reg, remote), notification-map
 * helpers on maps filled without any transfer, and query-response lists.
 */
#define _GNU_SOURCE
#include "util.h"

#include <unistd.h>

static size_t xcount(nixl_capi_xfer_dlist_t d)
{
    size_t n = (size_t)-1;
    nixl_capi_xfer_dlist_desc_count(d, &n);
    return n;
}

static size_t rcount(nixl_capi_reg_dlist_t d)
{
    size_t n = (size_t)-1;
    nixl_capi_reg_dlist_desc_count(d, &n);
    return n;
}

static void test_xfer_dlist(void)
{
    nixl_capi_xfer_dlist_t d = NULL;
    nixl_capi_mem_type_t mt = NIXL_CAPI_MEM_UNKNOWN;
    bool empty = false;
    size_t n = 99;

    CHECK_ST(0, nixl_capi_create_xfer_dlist(NIXL_CAPI_MEM_DRAM, &d));
    CHECK_ST(0, nixl_capi_xfer_dlist_get_type(d, &mt));
    CHECK(mt == NIXL_CAPI_MEM_DRAM, "xfer dlist type is DRAM");
    CHECK_ST(0, nixl_capi_xfer_dlist_is_empty(d, &empty));
    CHECK(empty, "new xfer dlist is empty");
    CHECK_ST(0, nixl_capi_xfer_dlist_desc_count(d, &n));
    CHECK(n == 0, "new xfer dlist has 0 descriptors");
    /* rem_desc on an empty list: std::out_of_range, reported as BACKEND. */
    CHECK_ST(-2, nixl_capi_xfer_dlist_rem_desc(d, 0));

    CHECK_ST(0, nixl_capi_xfer_dlist_add_desc(d, 0x1000, 0x100, 0));
    CHECK_ST(0, nixl_capi_xfer_dlist_add_desc(d, 0x3000, 0x100, 1));
    CHECK_ST(0, nixl_capi_xfer_dlist_add_desc(d, 0x2000, 0x200, 0));
    /* Zero-length and overlapping descriptors are accepted by the list itself. */
    CHECK_ST(0, nixl_capi_xfer_dlist_add_desc(d, 0x2000, 0, 0));
    CHECK_ST(0, nixl_capi_xfer_dlist_desc_count(d, &n));
    CHECK(n == 4, "xfer dlist has 4 descriptors after 4 adds");
    n = 0;
    CHECK_ST(0, nixl_capi_xfer_dlist_len(d, &n));
    CHECK(n == 4, "deprecated xfer_dlist_len equals desc_count");
    CHECK_ST(0, nixl_capi_xfer_dlist_is_empty(d, &empty));
    CHECK(!empty, "xfer dlist with descriptors is not empty");

    CHECK_ST(0, nixl_capi_xfer_dlist_rem_desc(d, 3));
    CHECK(xcount(d) == 3, "rem_desc(3) leaves 3 descriptors");
    CHECK_ST(-2, nixl_capi_xfer_dlist_rem_desc(d, 3));
    CHECK_ST(-2, nixl_capi_xfer_dlist_rem_desc(d, -1));
    CHECK_ST(-2, nixl_capi_xfer_dlist_rem_desc(d, 1000));
    CHECK(xcount(d) == 3, "failed rem_desc calls leave the count at 3");

    /* trim is a no-op in NIXL: the trimmed copy is discarded. */
    CHECK_ST(0, nixl_capi_xfer_dlist_trim(d));
    CHECK(xcount(d) == 3, "trim keeps 3 descriptors");

    CHECK_ST(0, nixl_capi_xfer_dlist_print(d));

    CHECK_ST(0, nixl_capi_xfer_dlist_resize(d, 6));
    CHECK(xcount(d) == 6, "resize(6) gives 6 descriptors");
    CHECK_ST(0, nixl_capi_xfer_dlist_resize(d, 1));
    CHECK(xcount(d) == 1, "resize(1) gives 1 descriptor");
    CHECK_ST(0, nixl_capi_xfer_dlist_resize(d, 0));
    CHECK(xcount(d) == 0, "resize(0) gives 0 descriptors");

    CHECK_ST(0, nixl_capi_xfer_dlist_add_desc(d, 0x1000, 0x100, 0));
    CHECK_ST(0, nixl_capi_xfer_dlist_clear(d));
    CHECK(xcount(d) == 0, "clear empties the xfer dlist");
    CHECK_ST(0, nixl_capi_xfer_dlist_is_empty(d, &empty));
    CHECK(empty, "cleared xfer dlist is empty");
    CHECK_ST(0, nixl_capi_xfer_dlist_get_type(d, &mt));
    CHECK(mt == NIXL_CAPI_MEM_DRAM, "clear keeps the memory type");
    CHECK_ST(0, nixl_capi_destroy_xfer_dlist(d));

    /* Every memory type round-trips through get_type. */
    for (int t = NIXL_CAPI_MEM_DRAM; t <= NIXL_CAPI_MEM_FILE; t++) {
        nixl_capi_xfer_dlist_t x = NULL;
        CHECK_ST(0, nixl_capi_create_xfer_dlist((nixl_capi_mem_type_t)t, &x));
        mt = NIXL_CAPI_MEM_UNKNOWN;
        CHECK_ST(0, nixl_capi_xfer_dlist_get_type(x, &mt));
        char text[64];
        snprintf(text, sizeof text, "xfer dlist type %d round-trips", t);
        CHECK((int)mt == t, text);
        CHECK_ST(0, nixl_capi_destroy_xfer_dlist(x));
    }
}

static void test_reg_dlist(void)
{
    nixl_capi_reg_dlist_t d = NULL;
    nixl_capi_mem_type_t mt = NIXL_CAPI_MEM_UNKNOWN;
    bool empty = false;
    size_t n = 99;

    CHECK_ST(0, nixl_capi_create_reg_dlist(NIXL_CAPI_MEM_FILE, &d));
    CHECK_ST(0, nixl_capi_reg_dlist_get_type(d, &mt));
    CHECK(mt == NIXL_CAPI_MEM_FILE, "reg dlist type is FILE");
    CHECK_ST(0, nixl_capi_reg_dlist_is_empty(d, &empty));
    CHECK(empty, "new reg dlist is empty");
    CHECK_ST(0, nixl_capi_reg_dlist_desc_count(d, &n));
    CHECK(n == 0, "new reg dlist has 0 descriptors");

    static const char meta[] = "/tmp/some-file";
    CHECK_ST(0, nixl_capi_reg_dlist_add_desc(d, 0, 4096, 3, meta, sizeof meta - 1));
    CHECK_ST(0, nixl_capi_reg_dlist_add_desc(d, 4096, 4096, 3, NULL, 0));
    /* A NULL metadata pointer with a length is treated as "no metadata". */
    CHECK_ST(0, nixl_capi_reg_dlist_add_desc(d, 8192, 4096, 3, NULL, 16));
    CHECK(rcount(d) == 3, "reg dlist has 3 descriptors");
    CHECK_ST(0, nixl_capi_reg_dlist_is_empty(d, &empty));
    CHECK(!empty, "reg dlist with descriptors is not empty");

    CHECK_ST(0, nixl_capi_reg_dlist_rem_desc(d, 0));
    CHECK(rcount(d) == 2, "reg rem_desc(0) leaves 2");
    CHECK_ST(-2, nixl_capi_reg_dlist_rem_desc(d, 2));
    CHECK_ST(-2, nixl_capi_reg_dlist_rem_desc(d, -1));
    CHECK_ST(0, nixl_capi_reg_dlist_trim(d));
    CHECK(rcount(d) == 2, "reg trim keeps 2");
    CHECK_ST(0, nixl_capi_reg_dlist_print(d));
    CHECK_ST(0, nixl_capi_reg_dlist_resize(d, 5));
    CHECK(rcount(d) == 5, "reg resize(5) gives 5");
    CHECK_ST(0, nixl_capi_reg_dlist_resize(d, 1));
    CHECK(rcount(d) == 1, "reg resize(1) gives 1");
    CHECK_ST(0, nixl_capi_reg_dlist_clear(d));
    CHECK(rcount(d) == 0, "reg clear empties the list");
    CHECK_ST(0, nixl_capi_reg_dlist_get_type(d, &mt));
    CHECK(mt == NIXL_CAPI_MEM_FILE, "reg clear keeps the memory type");
    CHECK_ST(0, nixl_capi_destroy_reg_dlist(d));
}

static void test_remote_dlist(void)
{
    nixl_capi_remote_dlist_t d = NULL;
    CHECK_ST(0, nixl_capi_create_remote_dlist(NIXL_CAPI_MEM_DRAM, &d));
    CHECK(d != NULL, "create_remote_dlist stores a handle");
    CHECK_ST(0, nixl_capi_remote_dlist_add_desc(d, 0x1000, 64, 0, "peer-a"));
    /* NULL agent means the placeholder agent "NULL_AGENT". */
    CHECK_ST(0, nixl_capi_remote_dlist_add_desc(d, 0x2000, 64, 0, NULL));
    CHECK_ST(0, nixl_capi_remote_dlist_add_desc(d, 0x3000, 64, 0, ""));
    CHECK_ST(0, nixl_capi_destroy_remote_dlist(d));

    nixl_capi_remote_dlist_t v = NULL;
    CHECK_ST(0, nixl_capi_create_remote_dlist(NIXL_CAPI_MEM_VRAM, &v));
    CHECK_ST(0, nixl_capi_destroy_remote_dlist(v));
}

static void test_notif_map_empty(void)
{
    nixl_capi_notif_map_t m = NULL;
    size_t n = 99;
    const char *name = (const char *)0x1;
    const void *data = (const void *)0x1;
    size_t len = 7;

    CHECK_ST(0, nixl_capi_create_notif_map(&m));
    CHECK_ST(0, nixl_capi_notif_map_size(m, &n));
    CHECK(n == 0, "new notif map is empty");
    CHECK_ST(-1, nixl_capi_notif_map_get_agent_at(m, 0, &name));
    CHECK(name == (const char *)0x1, "get_agent_at failure leaves *agent_name untouched");
    CHECK_ST(-1, nixl_capi_notif_map_get_notifs_size(m, "nobody", &n));
    CHECK_ST(-1, nixl_capi_notif_map_get_notif(m, "nobody", 0, &data, &len));
    CHECK(data == (const void *)0x1 && len == 7, "get_notif failure leaves outputs untouched");
    CHECK_ST(0, nixl_capi_notif_map_clear(m));
    /* NIXL advances an unordered_map iterator past end(): undefined behaviour. */
    if (gixl_only("notif_map_get_agent_at(index > size) on an empty map")) {
        CHECK_ST(-1, nixl_capi_notif_map_get_agent_at(m, 1, &name));
        CHECK_ST(-1, nixl_capi_notif_map_get_agent_at(m, 1000, &name));
    }
    CHECK_ST(0, nixl_capi_destroy_notif_map(m));
}

static bool have_plugin(nixl_capi_agent_t a, const char *want)
{
    nixl_capi_string_list_t l = NULL;
    size_t n = 0;
    bool found = false;
    if (nixl_capi_get_available_plugins(a, &l) != 0)
        return false;
    nixl_capi_string_list_size(l, &n);
    for (size_t i = 0; i < n; i++) {
        const char *s = NULL;
        if (nixl_capi_string_list_get(l, i, &s) == 0 && strcmp(s, want) == 0)
            found = true;
    }
    nixl_capi_destroy_string_list(l);
    return found;
}

static void test_query_resp_list(void)
{
    nixl_capi_query_resp_list_t l = NULL;
    size_t n = 99;
    bool hv = true;
    nixl_capi_params_t p = NULL;

    CHECK_ST(0, nixl_capi_create_query_resp_list(&l));
    CHECK_ST(0, nixl_capi_query_resp_list_size(l, &n));
    CHECK(n == 0, "new query response list is empty");
    CHECK_ST(-1, nixl_capi_query_resp_list_has_value(l, 0, &hv));
    CHECK_ST(-1, nixl_capi_query_resp_list_get_params(l, 0, &p));

    /* query_mem with UCX: the backend does not implement it (NOT_SUPPORTED). */
    nixl_capi_agent_t a = NULL;
    nixl_capi_backend_t ucx = NULL;
    REQUIRE_ST(0, ft_make_agent("dlist-query", &a, &ucx));
    nixl_capi_reg_dlist_t q = NULL;
    CHECK_ST(0, nixl_capi_create_reg_dlist(NIXL_CAPI_MEM_DRAM, &q));
    char buf[64];
    CHECK_ST(0, nixl_capi_reg_dlist_add_desc(q, (uintptr_t)buf, sizeof buf, 0, NULL, 0));
    nixl_capi_opt_args_t o = NULL;
    CHECK_ST(0, nixl_capi_create_opt_args(&o));
    /* Without exactly one backend hint, query_mem is refused. */
    CHECK_ST(-1, nixl_capi_query_mem(a, q, l, NULL));
    CHECK_ST(-1, nixl_capi_query_mem(a, q, l, o));
    CHECK_ST(0, nixl_capi_opt_args_add_backend(o, ucx));
    CHECK_ST(-2, nixl_capi_query_mem(a, q, l, o));
    CHECK_ST(0, nixl_capi_destroy_opt_args(o));
    CHECK_ST(0, nixl_capi_destroy_reg_dlist(q));

    /* With the POSIX plugin, FILE descriptors carry a path in their metadata. */
    if (!have_plugin(a, "POSIX")) {
        ft_skipped("POSIX plugin not available", "query_mem through the POSIX backend");
    } else {
        nixl_capi_mem_list_t pm = NULL;
        nixl_capi_params_t pp = NULL;
        nixl_capi_backend_t posix = NULL;
        CHECK_ST(0, nixl_capi_get_plugin_params(a, "POSIX", &pm, &pp));
        CHECK_ST(0, nixl_capi_create_backend(a, "POSIX", pp, &posix));
        nixl_capi_destroy_mem_list(pm);
        nixl_capi_destroy_params(pp);

        char path[] = "/tmp/gixl-ffi-query-XXXXXX";
        int fd = mkstemp(path);
        REQUIRE(fd >= 0, "mkstemp for query_mem");
        static const char missing[] = "/tmp/gixl-ffi-query-does-not-exist";
        CHECK_ST(0, nixl_capi_create_reg_dlist(NIXL_CAPI_MEM_FILE, &q));
        CHECK_ST(0, nixl_capi_reg_dlist_add_desc(q, 0, 0, 0, path, strlen(path)));
        CHECK_ST(0, nixl_capi_reg_dlist_add_desc(q, 0, 0, 0, missing, strlen(missing)));
        CHECK_ST(0, nixl_capi_reg_dlist_add_desc(q, 0, 0, 0, path, strlen(path)));
        CHECK_ST(0, nixl_capi_create_opt_args(&o));
        CHECK_ST(0, nixl_capi_opt_args_add_backend(o, posix));
        CHECK_ST(0, nixl_capi_query_mem(a, q, l, o));
        CHECK_ST(0, nixl_capi_query_resp_list_size(l, &n));
        CHECK(n == 3, "query_mem returns one response per descriptor");
        CHECK_ST(0, nixl_capi_query_resp_list_has_value(l, 0, &hv));
        CHECK(hv, "existing file has a response");
        CHECK_ST(0, nixl_capi_query_resp_list_has_value(l, 1, &hv));
        CHECK(!hv, "missing file has no response");
        CHECK_ST(-1, nixl_capi_query_resp_list_get_params(l, 1, &p));
        CHECK_ST(0, nixl_capi_query_resp_list_get_params(l, 2, &p));
        bool has_size = false;
        nixl_capi_param_iter_t it = NULL;
        if (p && nixl_capi_params_create_iterator(p, &it) == 0) {
            bool more = true;
            while (more) {
                const char *k = NULL, *v = NULL;
                if (nixl_capi_params_iterator_next(it, &k, &v, &more) != 0 || !k)
                    break;
                if (strcmp(k, "size") == 0)
                    has_size = true;
            }
            nixl_capi_params_destroy_iterator(it);
        }
        CHECK(has_size, "query response params contain \"size\"");
        if (p)
            CHECK_ST(0, nixl_capi_destroy_params(p));
        CHECK_ST(-1, nixl_capi_query_resp_list_has_value(l, 3, &hv));
        CHECK_ST(0, nixl_capi_destroy_opt_args(o));
        CHECK_ST(0, nixl_capi_destroy_reg_dlist(q));
        CHECK_ST(0, nixl_capi_destroy_backend(posix));
        close(fd);
        unlink(path);
    }

    CHECK_ST(0, nixl_capi_destroy_backend(ucx));
    CHECK_ST(0, nixl_capi_destroy_agent(a));
    CHECK_ST(0, nixl_capi_destroy_query_resp_list(l));
}

int main(void)
{
    ft_begin("t_dlist");
    test_xfer_dlist();
    test_reg_dlist();
    test_remote_dlist();
    test_notif_map_empty();
    test_query_resp_list();
    return ft_end();
}
