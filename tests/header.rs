//! The committed C header must be exactly what cbindgen generates from src/capi now, and must declare
//! NIXL 1.5.1's 104 `nixl_capi_*` functions (no more, no fewer).
//!
//! Regenerate with `GIXL_WRITE_HEADER=1 cargo build`.

const NIXL_CAPI_FUNCTIONS: [&str; 104] = [
    "nixl_capi_agent_make_connection",
    "nixl_capi_check_remote_md",
    "nixl_capi_create_agent",
    "nixl_capi_create_backend",
    "nixl_capi_create_configured_agent",
    "nixl_capi_create_notif_map",
    "nixl_capi_create_opt_args",
    "nixl_capi_create_params",
    "nixl_capi_create_query_resp_list",
    "nixl_capi_create_reg_dlist",
    "nixl_capi_create_remote_dlist",
    "nixl_capi_create_xfer_dlist",
    "nixl_capi_create_xfer_req",
    "nixl_capi_deregister_mem",
    "nixl_capi_destroy_agent",
    "nixl_capi_destroy_backend",
    "nixl_capi_destroy_mem_list",
    "nixl_capi_destroy_notif_map",
    "nixl_capi_destroy_opt_args",
    "nixl_capi_destroy_params",
    "nixl_capi_destroy_query_resp_list",
    "nixl_capi_destroy_reg_dlist",
    "nixl_capi_destroy_remote_dlist",
    "nixl_capi_destroy_string_list",
    "nixl_capi_destroy_xfer_dlist",
    "nixl_capi_destroy_xfer_req",
    "nixl_capi_estimate_xfer_cost",
    "nixl_capi_fetch_remote_md",
    "nixl_capi_gen_notif",
    "nixl_capi_get_available_plugins",
    "nixl_capi_get_backend_params",
    "nixl_capi_get_local_md",
    "nixl_capi_get_local_partial_md",
    "nixl_capi_get_notifs",
    "nixl_capi_get_plugin_params",
    "nixl_capi_get_xfer_status",
    "nixl_capi_get_xfer_telemetry",
    "nixl_capi_invalidate_local_md",
    "nixl_capi_invalidate_remote_md",
    "nixl_capi_is_stub",
    "nixl_capi_load_remote_md",
    "nixl_capi_make_xfer_req",
    "nixl_capi_mem_list_get",
    "nixl_capi_mem_list_is_empty",
    "nixl_capi_mem_list_size",
    "nixl_capi_mem_type_to_string",
    "nixl_capi_notif_map_clear",
    "nixl_capi_notif_map_get_agent_at",
    "nixl_capi_notif_map_get_notif",
    "nixl_capi_notif_map_get_notifs_size",
    "nixl_capi_notif_map_size",
    "nixl_capi_opt_args_add_backend",
    "nixl_capi_opt_args_get_custom_param",
    "nixl_capi_opt_args_get_has_notif",
    "nixl_capi_opt_args_get_notif_msg",
    "nixl_capi_opt_args_get_skip_desc_merge",
    "nixl_capi_opt_args_set_custom_param",
    "nixl_capi_opt_args_set_has_notif",
    "nixl_capi_opt_args_set_ip_addr",
    "nixl_capi_opt_args_set_notif_msg",
    "nixl_capi_opt_args_set_port",
    "nixl_capi_opt_args_set_skip_desc_merge",
    "nixl_capi_params_add",
    "nixl_capi_params_create_iterator",
    "nixl_capi_params_destroy_iterator",
    "nixl_capi_params_is_empty",
    "nixl_capi_params_iterator_next",
    "nixl_capi_post_xfer_req",
    "nixl_capi_prep_mem_view_local",
    "nixl_capi_prep_mem_view_remote",
    "nixl_capi_prep_xfer_dlist",
    "nixl_capi_query_mem",
    "nixl_capi_query_resp_list_get_params",
    "nixl_capi_query_resp_list_has_value",
    "nixl_capi_query_resp_list_size",
    "nixl_capi_query_xfer_backend",
    "nixl_capi_reg_dlist_add_desc",
    "nixl_capi_reg_dlist_clear",
    "nixl_capi_reg_dlist_desc_count",
    "nixl_capi_reg_dlist_get_type",
    "nixl_capi_reg_dlist_is_empty",
    "nixl_capi_reg_dlist_print",
    "nixl_capi_reg_dlist_rem_desc",
    "nixl_capi_reg_dlist_resize",
    "nixl_capi_reg_dlist_trim",
    "nixl_capi_register_mem",
    "nixl_capi_release_mem_view",
    "nixl_capi_release_xfer_dlist_handle",
    "nixl_capi_release_xfer_req",
    "nixl_capi_remote_dlist_add_desc",
    "nixl_capi_send_local_md",
    "nixl_capi_send_local_partial_md",
    "nixl_capi_string_list_get",
    "nixl_capi_string_list_size",
    "nixl_capi_xfer_dlist_add_desc",
    "nixl_capi_xfer_dlist_clear",
    "nixl_capi_xfer_dlist_desc_count",
    "nixl_capi_xfer_dlist_get_type",
    "nixl_capi_xfer_dlist_is_empty",
    "nixl_capi_xfer_dlist_len",
    "nixl_capi_xfer_dlist_print",
    "nixl_capi_xfer_dlist_rem_desc",
    "nixl_capi_xfer_dlist_resize",
    "nixl_capi_xfer_dlist_trim",
];

fn read(path: &str) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {path}: {e}"))
}

#[test]
fn committed_header_matches_the_generated_one() {
    let generated = read(concat!(env!("OUT_DIR"), "/gixl.h"));
    let committed = read(concat!(env!("CARGO_MANIFEST_DIR"), "/include/gixl.h"));
    if generated != committed {
        let line = generated.lines().zip(committed.lines()).position(|(a, b)| a != b).map_or_else(
            || format!("lengths differ ({} vs {} lines)", generated.lines().count(), committed.lines().count()),
            |i| format!("first difference at line {}", i + 1),
        );
        panic!("include/gixl.h is out of date ({line}); regenerate it with `GIXL_WRITE_HEADER=1 cargo build`");
    }
}

#[test]
fn header_declares_exactly_nixls_functions() {
    let header = read(concat!(env!("CARGO_MANIFEST_DIR"), "/include/gixl.h"));
    // Every identifier starting with nixl_capi_ that is directly followed by '(' is a declared function.
    let mut declared: Vec<&str> = Vec::new();
    let mut rest = header.as_str();
    while let Some(at) = rest.find("nixl_capi_") {
        let tail = &rest[at..];
        let end = tail.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(tail.len());
        if tail[end..].starts_with('(') {
            declared.push(&tail[..end]);
        }
        rest = &tail[end..];
    }
    declared.sort_unstable();
    declared.dedup();
    let mut want = NIXL_CAPI_FUNCTIONS.to_vec();
    want.sort_unstable();
    want.dedup();
    assert_eq!(want.len(), 104);
    assert_eq!(declared, want);
}
