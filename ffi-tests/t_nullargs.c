/*
 * t_nullargs: every NULL required argument of every nixl_capi_* function
 * returns NIXL_CAPI_ERROR_INVALID_PARAM (-1), one argument at a time, with
 * all other arguments valid.  A few NULLs that NIXL does not check (it then
 * writes through or reads from them) are gixl-only checks.
 */
#define _GNU_SOURCE
#include "util.h"

#define N(call) CHECK_ST(-1, call)

int main(void)
{
    ft_begin("t_nullargs");

    static unsigned char buf[4096], rbuf[4096];
    nixl_capi_agent_t ag = NULL, peer = NULL;
    nixl_capi_backend_t be = NULL, pbe = NULL;
    REQUIRE_ST(0, ft_make_agent("null-A", &ag, &be));
    REQUIRE_ST(0, ft_make_agent("null-P", &peer, &pbe));
    REQUIRE_ST(0, ft_register(ag, buf, sizeof buf));
    REQUIRE_ST(0, ft_register(peer, rbuf, sizeof rbuf));
    REQUIRE_ST(0, ft_exchange_md(peer, ag, NULL, 0));

    nixl_capi_params_t params = NULL;
    nixl_capi_mem_list_t mems = NULL;
    nixl_capi_string_list_t strs = NULL;
    nixl_capi_opt_args_t opt = NULL;
    nixl_capi_param_iter_t iter = NULL;
    nixl_capi_xfer_dlist_t xl = ft_xfer_list(buf, sizeof buf);
    nixl_capi_xfer_dlist_t xr = ft_xfer_list(rbuf, sizeof rbuf);
    nixl_capi_reg_dlist_t rl = ft_reg_list(buf, sizeof buf);
    nixl_capi_notif_map_t nmap = NULL;
    nixl_capi_query_resp_list_t qrl = NULL;
    nixl_capi_remote_dlist_t rdl = NULL;
    nixl_capi_xfer_dlist_handle_t hl = NULL, hr = NULL;
    nixl_capi_xfer_req_t req = NULL;
    REQUIRE_ST(0, nixl_capi_create_params(&params));
    REQUIRE_ST(0, nixl_capi_params_add(params, "k", "v"));
    nixl_capi_params_t bparams = NULL;
    REQUIRE_ST(0, nixl_capi_get_backend_params(ag, be, &mems, &bparams));
    REQUIRE_ST(0, nixl_capi_get_available_plugins(ag, &strs));
    REQUIRE_ST(0, nixl_capi_create_opt_args(&opt));
    REQUIRE_ST(0, nixl_capi_params_create_iterator(params, &iter));
    REQUIRE_ST(0, nixl_capi_create_notif_map(&nmap));
    REQUIRE_ST(0, nixl_capi_create_query_resp_list(&qrl));
    REQUIRE_ST(0, nixl_capi_create_remote_dlist(NIXL_CAPI_MEM_DRAM, &rdl));
    REQUIRE_ST(0, nixl_capi_prep_xfer_dlist(ag, "", xl, &hl, NULL));
    REQUIRE_ST(0, nixl_capi_prep_xfer_dlist(ag, "null-P", xr, &hr, NULL));
    REQUIRE_ST(0, nixl_capi_create_xfer_req(ag, NIXL_CAPI_XFER_OP_WRITE, xl, xr, "null-P", &req,
                                            NULL));

    void *vp = NULL;
    const void *cvp = NULL;
    size_t sz = 0;
    bool flag = false;
    char *name = NULL;
    const char *cname = NULL;
    nixl_capi_agent_t ag_out = NULL;
    nixl_capi_backend_t be_out = NULL;
    nixl_capi_mem_list_t ml_out = NULL;
    nixl_capi_params_t p_out = NULL;
    nixl_capi_string_list_t sl_out = NULL;
    nixl_capi_mem_type_t mt = NIXL_CAPI_MEM_DRAM;
    nixl_capi_xfer_dlist_handle_t h_out = NULL;
    nixl_capi_xfer_req_t r_out = NULL;
    nixl_capi_mem_view_t mv = NULL;
    int64_t d64 = 0, e64 = 0;
    nixl_capi_cost_t cost = NIXL_CAPI_COST_ANALYTICAL_BACKEND;
    struct nixl_capi_xfer_telemetry_s tel;
    const int idx[] = {0};
    nixl_capi_agent_config_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.lthr_delay_us = 100000;
    void *md = NULL;
    size_t md_len = 0;
    REQUIRE_ST(0, nixl_capi_get_local_md(peer, &md, &md_len));

    /* Agents. */
    N(nixl_capi_create_agent(NULL, &ag_out));
    N(nixl_capi_create_agent("x", NULL));
    N(nixl_capi_create_configured_agent(NULL, &cfg, &ag_out));
    N(nixl_capi_create_configured_agent("x", NULL, &ag_out));
    N(nixl_capi_create_configured_agent("x", &cfg, NULL));
    N(nixl_capi_destroy_agent(NULL));

    /* Metadata. */
    N(nixl_capi_get_local_md(NULL, &vp, &sz));
    N(nixl_capi_get_local_md(ag, NULL, &sz));
    N(nixl_capi_get_local_md(ag, &vp, NULL));
    N(nixl_capi_get_local_partial_md(NULL, rl, &vp, &sz, NULL));
    N(nixl_capi_get_local_partial_md(ag, NULL, &vp, &sz, NULL));
    N(nixl_capi_get_local_partial_md(ag, rl, NULL, &sz, NULL));
    N(nixl_capi_get_local_partial_md(ag, rl, &vp, NULL, NULL));
    N(nixl_capi_load_remote_md(NULL, md, md_len, &name));
    N(nixl_capi_load_remote_md(ag, NULL, md_len, &name));
    N(nixl_capi_load_remote_md(ag, md, md_len, NULL));
    N(nixl_capi_invalidate_remote_md(NULL, "null-P"));
    N(nixl_capi_invalidate_remote_md(ag, NULL));
    N(nixl_capi_invalidate_local_md(NULL, opt));
    N(nixl_capi_check_remote_md(NULL, "null-P", NULL));
    N(nixl_capi_check_remote_md(ag, NULL, NULL));
    N(nixl_capi_send_local_md(NULL, opt));
    N(nixl_capi_send_local_partial_md(NULL, rl, opt));
    N(nixl_capi_send_local_partial_md(ag, NULL, opt));
    N(nixl_capi_fetch_remote_md(NULL, "null-P", opt));
    N(nixl_capi_fetch_remote_md(ag, NULL, opt));

    /* Plugins, string lists, backends. */
    N(nixl_capi_get_available_plugins(NULL, &sl_out));
    N(nixl_capi_get_available_plugins(ag, NULL));
    N(nixl_capi_destroy_string_list(NULL));
    N(nixl_capi_string_list_size(NULL, &sz));
    N(nixl_capi_string_list_size(strs, NULL));
    N(nixl_capi_string_list_get(NULL, 0, &cname));
    N(nixl_capi_string_list_get(strs, 0, NULL));
    N(nixl_capi_get_plugin_params(NULL, "UCX", &ml_out, &p_out));
    N(nixl_capi_get_plugin_params(ag, NULL, &ml_out, &p_out));
    N(nixl_capi_get_plugin_params(ag, "UCX", NULL, &p_out));
    N(nixl_capi_get_plugin_params(ag, "UCX", &ml_out, NULL));
    N(nixl_capi_destroy_mem_list(NULL));
    N(nixl_capi_destroy_params(NULL));
    N(nixl_capi_create_backend(NULL, "UCX", params, &be_out));
    N(nixl_capi_create_backend(ag, NULL, params, &be_out));
    N(nixl_capi_create_backend(ag, "UCX", NULL, &be_out));
    N(nixl_capi_create_backend(ag, "UCX", params, NULL));
    N(nixl_capi_destroy_backend(NULL));
    N(nixl_capi_get_backend_params(NULL, be, &ml_out, &p_out));
    N(nixl_capi_get_backend_params(ag, NULL, &ml_out, &p_out));
    N(nixl_capi_get_backend_params(ag, be, NULL, &p_out));
    N(nixl_capi_get_backend_params(ag, be, &ml_out, NULL));

    /* Optional arguments. */
    N(nixl_capi_create_opt_args(NULL));
    N(nixl_capi_destroy_opt_args(NULL));
    N(nixl_capi_opt_args_add_backend(NULL, be));
    N(nixl_capi_opt_args_add_backend(opt, NULL));
    N(nixl_capi_opt_args_set_notif_msg(NULL, "x", 1));
    N(nixl_capi_opt_args_set_notif_msg(opt, NULL, 1));
    N(nixl_capi_opt_args_get_notif_msg(NULL, &vp, &sz));
    N(nixl_capi_opt_args_get_notif_msg(opt, NULL, &sz));
    N(nixl_capi_opt_args_get_notif_msg(opt, &vp, NULL));
    N(nixl_capi_opt_args_set_custom_param(NULL, "x", 1));
    N(nixl_capi_opt_args_set_custom_param(opt, NULL, 1));
    N(nixl_capi_opt_args_get_custom_param(NULL, &vp, &sz));
    N(nixl_capi_opt_args_get_custom_param(opt, NULL, &sz));
    N(nixl_capi_opt_args_get_custom_param(opt, &vp, NULL));
    N(nixl_capi_opt_args_set_has_notif(NULL, true));
    N(nixl_capi_opt_args_get_has_notif(NULL, &flag));
    N(nixl_capi_opt_args_get_has_notif(opt, NULL));
    N(nixl_capi_opt_args_set_skip_desc_merge(NULL, true));
    N(nixl_capi_opt_args_get_skip_desc_merge(NULL, &flag));
    N(nixl_capi_opt_args_get_skip_desc_merge(opt, NULL));
    N(nixl_capi_opt_args_set_ip_addr(NULL, "127.0.0.1"));
    N(nixl_capi_opt_args_set_ip_addr(opt, NULL));
    N(nixl_capi_opt_args_set_port(NULL, 1));

    /* Params and iterators. */
    N(nixl_capi_create_params(NULL));
    N(nixl_capi_params_add(NULL, "k", "v"));
    N(nixl_capi_params_add(params, NULL, "v"));
    N(nixl_capi_params_add(params, "k", NULL));
    N(nixl_capi_params_is_empty(NULL, &flag));
    N(nixl_capi_params_is_empty(params, NULL));
    N(nixl_capi_params_create_iterator(NULL, &iter));
    N(nixl_capi_params_create_iterator(params, NULL));
    {
        const char *k = NULL, *v = NULL;
        N(nixl_capi_params_iterator_next(NULL, &k, &v, &flag));
        N(nixl_capi_params_iterator_next(iter, NULL, &v, &flag));
        N(nixl_capi_params_iterator_next(iter, &k, NULL, &flag));
        N(nixl_capi_params_iterator_next(iter, &k, &v, NULL));
    }
    N(nixl_capi_params_destroy_iterator(NULL));

    /* Memory lists. */
    N(nixl_capi_mem_list_is_empty(NULL, &flag));
    N(nixl_capi_mem_list_is_empty(mems, NULL));
    N(nixl_capi_mem_list_size(NULL, &sz));
    N(nixl_capi_mem_list_size(mems, NULL));
    N(nixl_capi_mem_list_get(NULL, 0, &mt));
    N(nixl_capi_mem_list_get(mems, 0, NULL));
    N(nixl_capi_mem_type_to_string(NIXL_CAPI_MEM_DRAM, NULL));

    /* Registration and connections. */
    N(nixl_capi_register_mem(NULL, rl, NULL));
    N(nixl_capi_register_mem(ag, NULL, NULL));
    N(nixl_capi_deregister_mem(NULL, rl, NULL));
    N(nixl_capi_deregister_mem(ag, NULL, NULL));
    N(nixl_capi_agent_make_connection(NULL, "null-P", NULL));
    N(nixl_capi_agent_make_connection(ag, NULL, NULL));

    /* Prepped descriptor lists and requests. */
    N(nixl_capi_prep_xfer_dlist(NULL, "", xl, &h_out, NULL));
    N(nixl_capi_prep_xfer_dlist(ag, NULL, xl, &h_out, NULL));
    N(nixl_capi_prep_xfer_dlist(ag, "", NULL, &h_out, NULL));
    if (gixl_only("prep_xfer_dlist(dlist_hndl = NULL): NIXL writes through it"))
        N(nixl_capi_prep_xfer_dlist(ag, "", xl, NULL, NULL));
    N(nixl_capi_release_xfer_dlist_handle(NULL, hl));
    N(nixl_capi_release_xfer_dlist_handle(ag, NULL));
    N(nixl_capi_make_xfer_req(NULL, NIXL_CAPI_XFER_OP_WRITE, hl, idx, 1, hr, idx, 1, &r_out, NULL));
    N(nixl_capi_make_xfer_req(ag, NIXL_CAPI_XFER_OP_WRITE, NULL, idx, 1, hr, idx, 1, &r_out, NULL));
    N(nixl_capi_make_xfer_req(ag, NIXL_CAPI_XFER_OP_WRITE, hl, idx, 1, NULL, idx, 1, &r_out, NULL));
    N(nixl_capi_make_xfer_req(ag, NIXL_CAPI_XFER_OP_WRITE, hl, idx, 1, hr, idx, 1, NULL, NULL));
    if (gixl_only("make_xfer_req(indices = NULL, count > 0): NIXL reads through it")) {
        N(nixl_capi_make_xfer_req(ag, NIXL_CAPI_XFER_OP_WRITE, hl, NULL, 1, hr, idx, 1, &r_out,
                                  NULL));
        N(nixl_capi_make_xfer_req(ag, NIXL_CAPI_XFER_OP_WRITE, hl, idx, 1, hr, NULL, 1, &r_out,
                                  NULL));
    }
    N(nixl_capi_create_xfer_req(NULL, NIXL_CAPI_XFER_OP_WRITE, xl, xr, "null-P", &r_out, NULL));
    N(nixl_capi_create_xfer_req(ag, NIXL_CAPI_XFER_OP_WRITE, NULL, xr, "null-P", &r_out, NULL));
    N(nixl_capi_create_xfer_req(ag, NIXL_CAPI_XFER_OP_WRITE, xl, NULL, "null-P", &r_out, NULL));
    N(nixl_capi_create_xfer_req(ag, NIXL_CAPI_XFER_OP_WRITE, xl, xr, NULL, &r_out, NULL));
    N(nixl_capi_create_xfer_req(ag, NIXL_CAPI_XFER_OP_WRITE, xl, xr, "null-P", NULL, NULL));
    N(nixl_capi_estimate_xfer_cost(NULL, req, NULL, &d64, &e64, &cost));
    N(nixl_capi_estimate_xfer_cost(ag, NULL, NULL, &d64, &e64, &cost));
    N(nixl_capi_estimate_xfer_cost(ag, req, NULL, NULL, &e64, &cost));
    N(nixl_capi_estimate_xfer_cost(ag, req, NULL, &d64, NULL, &cost));
    N(nixl_capi_estimate_xfer_cost(ag, req, NULL, &d64, &e64, NULL));
    N(nixl_capi_post_xfer_req(NULL, req, NULL));
    N(nixl_capi_post_xfer_req(ag, NULL, NULL));
    N(nixl_capi_get_xfer_status(NULL, req));
    N(nixl_capi_get_xfer_status(ag, NULL));
    N(nixl_capi_query_xfer_backend(NULL, req, &be_out));
    N(nixl_capi_query_xfer_backend(ag, NULL, &be_out));
    N(nixl_capi_query_xfer_backend(ag, req, NULL));
    N(nixl_capi_get_xfer_telemetry(NULL, req, &tel));
    N(nixl_capi_get_xfer_telemetry(ag, NULL, &tel));
    N(nixl_capi_get_xfer_telemetry(ag, req, NULL));
    N(nixl_capi_release_xfer_req(NULL, req));
    N(nixl_capi_release_xfer_req(ag, NULL));
    N(nixl_capi_destroy_xfer_req(NULL));

    /* Notifications. */
    N(nixl_capi_get_notifs(NULL, nmap, NULL));
    N(nixl_capi_get_notifs(ag, NULL, NULL));
    N(nixl_capi_create_notif_map(NULL));
    N(nixl_capi_destroy_notif_map(NULL));
    N(nixl_capi_gen_notif(NULL, "null-P", "x", 1, NULL));
    N(nixl_capi_gen_notif(ag, NULL, "x", 1, NULL));
    N(nixl_capi_notif_map_size(NULL, &sz));
    N(nixl_capi_notif_map_size(nmap, NULL));
    N(nixl_capi_notif_map_get_agent_at(NULL, 0, &cname));
    N(nixl_capi_notif_map_get_agent_at(nmap, 0, NULL));
    N(nixl_capi_notif_map_get_notifs_size(NULL, "a", &sz));
    N(nixl_capi_notif_map_get_notifs_size(nmap, NULL, &sz));
    N(nixl_capi_notif_map_get_notifs_size(nmap, "a", NULL));
    N(nixl_capi_notif_map_get_notif(NULL, "a", 0, &cvp, &sz));
    N(nixl_capi_notif_map_get_notif(nmap, NULL, 0, &cvp, &sz));
    N(nixl_capi_notif_map_get_notif(nmap, "a", 0, NULL, &sz));
    N(nixl_capi_notif_map_get_notif(nmap, "a", 0, &cvp, NULL));
    N(nixl_capi_notif_map_clear(NULL));

    /* Descriptor lists. */
    N(nixl_capi_create_xfer_dlist(NIXL_CAPI_MEM_DRAM, NULL));
    N(nixl_capi_destroy_xfer_dlist(NULL));
    N(nixl_capi_xfer_dlist_get_type(NULL, &mt));
    N(nixl_capi_xfer_dlist_get_type(xl, NULL));
    N(nixl_capi_xfer_dlist_add_desc(NULL, 0x1000, 1, 0));
    N(nixl_capi_xfer_dlist_desc_count(NULL, &sz));
    N(nixl_capi_xfer_dlist_desc_count(xl, NULL));
    N(nixl_capi_xfer_dlist_len(NULL, &sz));
    N(nixl_capi_xfer_dlist_len(xl, NULL));
    N(nixl_capi_xfer_dlist_is_empty(NULL, &flag));
    N(nixl_capi_xfer_dlist_is_empty(xl, NULL));
    N(nixl_capi_xfer_dlist_trim(NULL));
    N(nixl_capi_xfer_dlist_rem_desc(NULL, 0));
    N(nixl_capi_xfer_dlist_clear(NULL));
    N(nixl_capi_xfer_dlist_resize(NULL, 1));
    N(nixl_capi_xfer_dlist_print(NULL));
    N(nixl_capi_create_reg_dlist(NIXL_CAPI_MEM_DRAM, NULL));
    N(nixl_capi_destroy_reg_dlist(NULL));
    N(nixl_capi_reg_dlist_get_type(NULL, &mt));
    N(nixl_capi_reg_dlist_get_type(rl, NULL));
    N(nixl_capi_reg_dlist_add_desc(NULL, 0x1000, 1, 0, NULL, 0));
    N(nixl_capi_reg_dlist_desc_count(NULL, &sz));
    N(nixl_capi_reg_dlist_desc_count(rl, NULL));
    N(nixl_capi_reg_dlist_is_empty(NULL, &flag));
    N(nixl_capi_reg_dlist_is_empty(rl, NULL));
    N(nixl_capi_reg_dlist_trim(NULL));
    N(nixl_capi_reg_dlist_rem_desc(NULL, 0));
    N(nixl_capi_reg_dlist_clear(NULL));
    N(nixl_capi_reg_dlist_resize(NULL, 1));
    N(nixl_capi_reg_dlist_print(NULL));
    N(nixl_capi_create_remote_dlist(NIXL_CAPI_MEM_DRAM, NULL));
    N(nixl_capi_destroy_remote_dlist(NULL));
    N(nixl_capi_remote_dlist_add_desc(NULL, 0x1000, 1, 0, "null-P"));

    /* Query responses and query_mem. */
    N(nixl_capi_create_query_resp_list(NULL));
    N(nixl_capi_destroy_query_resp_list(NULL));
    N(nixl_capi_query_resp_list_size(NULL, &sz));
    N(nixl_capi_query_resp_list_size(qrl, NULL));
    N(nixl_capi_query_resp_list_has_value(NULL, 0, &flag));
    N(nixl_capi_query_resp_list_has_value(qrl, 0, NULL));
    N(nixl_capi_query_resp_list_get_params(NULL, 0, &p_out));
    N(nixl_capi_query_resp_list_get_params(qrl, 0, NULL));
    N(nixl_capi_query_mem(NULL, rl, qrl, NULL));
    N(nixl_capi_query_mem(ag, NULL, qrl, NULL));
    N(nixl_capi_query_mem(ag, rl, NULL, NULL));

    /* Memory views. */
    N(nixl_capi_prep_mem_view_local(NULL, xl, &mv, NULL));
    N(nixl_capi_prep_mem_view_local(ag, NULL, &mv, NULL));
    N(nixl_capi_prep_mem_view_local(ag, xl, NULL, NULL));
    N(nixl_capi_prep_mem_view_remote(NULL, rdl, &mv, NULL));
    N(nixl_capi_prep_mem_view_remote(ag, NULL, &mv, NULL));
    N(nixl_capi_prep_mem_view_remote(ag, rdl, NULL, NULL));
    N(nixl_capi_release_mem_view(NULL, (nixl_capi_mem_view_t)0x1));
    N(nixl_capi_release_mem_view(ag, NULL));

    /* Nothing above changed the outputs. */
    CHECK(ag_out == NULL && be_out == NULL && ml_out == NULL && p_out == NULL && sl_out == NULL &&
              h_out == NULL && r_out == NULL && mv == NULL && name == NULL,
          "no output pointer was written by a rejected call");

    /* Cleanup. */
    CHECK_ST(0, nixl_capi_release_xfer_req(ag, req));
    CHECK_ST(0, nixl_capi_destroy_xfer_req(req));
    CHECK_ST(0, nixl_capi_release_xfer_dlist_handle(ag, hl));
    CHECK_ST(0, nixl_capi_release_xfer_dlist_handle(ag, hr));
    free(md);
    nixl_capi_destroy_remote_dlist(rdl);
    nixl_capi_destroy_query_resp_list(qrl);
    nixl_capi_destroy_notif_map(nmap);
    nixl_capi_params_destroy_iterator(iter);
    nixl_capi_destroy_opt_args(opt);
    nixl_capi_destroy_string_list(strs);
    nixl_capi_destroy_mem_list(mems);
    nixl_capi_destroy_params(params);
    nixl_capi_destroy_params(bparams);
    nixl_capi_destroy_xfer_dlist(xl);
    nixl_capi_destroy_xfer_dlist(xr);
    nixl_capi_destroy_reg_dlist(rl);
    nixl_capi_destroy_backend(be);
    nixl_capi_destroy_backend(pbe);
    CHECK_ST(0, nixl_capi_destroy_agent(ag));
    CHECK_ST(0, nixl_capi_destroy_agent(peer));
    return ft_end();
}
