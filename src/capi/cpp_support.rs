//! `gixl_*` additions that the C++ drop-in (`include/nixl/nixl.h`) needs and NIXL's C API lacks: the
//! options `includeConnInfo` and `metadataLabel` of `nixl_opt_args_t`, which the C options cannot carry.
//! Each function is its `nixl_capi_*` namesake with the missing argument made explicit.

use libc::size_t;
use std::ffi::{c_char, c_void};

use super::agent::{nixl_capi_agent_t, AGENTS};
use super::backend::{nixl_capi_backend_t, BACKENDS};
use super::boundary::{ffi, malloc_copy, put, str_arg, Fail, OK};
use super::opt_args::{self, nixl_capi_opt_args_t};
use super::reg_dlist::{self, nixl_capi_reg_dlist_t, REG_DLISTS};
use super::CapiStatus;

/// A NULL label is the empty one (the default label where one is used).
fn label_arg<'a>(label: *const c_char) -> Result<&'a str, Fail> {
    if label.is_null() {
        Ok("")
    } else {
        str_arg(label, "label")
    }
}

/// The body of `nixl_capi_get_local_partial_md` (`include_conn_info` false) and `gixl_get_local_partial_md`;
/// the caller has checked `data` and `len`.
pub(super) fn local_partial_md(
    agent: nixl_capi_agent_t,
    descs: nixl_capi_reg_dlist_t,
    include_conn_info: bool,
    data: *mut *mut c_void,
    len: *mut size_t,
    opt_args: nixl_capi_opt_args_t,
) -> Result<CapiStatus, Fail> {
    let a = AGENTS.get(agent, "agent")?;
    let d = REG_DLISTS.get(descs, "descs")?;
    let hints = opt_args::hints(opt_args, &a)?;
    let md = a.agent.local_partial_md(reg_dlist::for_agent(&d.read())?, include_conn_info, &hints)?;
    put(data, malloc_copy(&md)?);
    put(len, md.len());
    OK
}

/// The body of `nixl_capi_send_local_partial_md` (no connection info, NULL label) and
/// `gixl_send_local_partial_md`.
pub(super) fn send_local_partial_md(
    agent: nixl_capi_agent_t,
    descs: nixl_capi_reg_dlist_t,
    include_conn_info: bool,
    label: *const c_char,
    opt_args: nixl_capi_opt_args_t,
) -> Result<CapiStatus, Fail> {
    let a = AGENTS.get(agent, "agent")?;
    let d = REG_DLISTS.get(descs, "descs")?;
    let label = label_arg(label)?;
    let hints = opt_args::hints(opt_args, &a)?;
    let (ip, port) = opt_args::md_peer(opt_args)?;
    a.agent.send_local_partial_md(reg_dlist::for_agent(&d.read())?, include_conn_info, &hints, &ip, port, label)?;
    OK
}

/// The body of `nixl_capi_fetch_remote_md` (NULL label) and `gixl_fetch_remote_md`.
pub(super) fn fetch_remote_md(
    agent: nixl_capi_agent_t,
    remote_name: *const c_char,
    label: *const c_char,
    opt_args: nixl_capi_opt_args_t,
) -> Result<CapiStatus, Fail> {
    let a = AGENTS.get(agent, "agent")?;
    let name = str_arg(remote_name, "remote_name")?;
    let label = label_arg(label)?;
    let (ip, port) = opt_args::md_peer(opt_args)?;
    a.agent.fetch_remote_md(name, &ip, port, label)?;
    OK
}

/// gixl: `nixl_capi_get_local_partial_md` with `include_conn_info` (NIXL's `includeConnInfo`): also put
/// the connection info of the backends that serve `descs` in the blob. An empty `descs` always carries the
/// connection info of every remote-capable backend, whatever `include_conn_info` says (as NIXL).
#[no_mangle]
pub extern "C" fn gixl_get_local_partial_md(
    agent: nixl_capi_agent_t,
    descs: nixl_capi_reg_dlist_t,
    include_conn_info: bool,
    data: *mut *mut c_void,
    len: *mut size_t,
    opt_args: nixl_capi_opt_args_t,
) -> CapiStatus {
    ffi! {
        nonnull(data, len);
        local_partial_md(agent, descs, include_conn_info, data, len, opt_args)
    }
}

/// gixl: `nixl_capi_send_local_partial_md` with `include_conn_info` and `label` (NIXL's `metadataLabel`,
/// required through etcd, ignored by a peer; NULL is "").
#[no_mangle]
pub extern "C" fn gixl_send_local_partial_md(
    agent: nixl_capi_agent_t,
    descs: nixl_capi_reg_dlist_t,
    include_conn_info: bool,
    label: *const c_char,
    opt_args: nixl_capi_opt_args_t,
) -> CapiStatus {
    ffi! { send_local_partial_md(agent, descs, include_conn_info, label, opt_args) }
}

/// gixl: `nixl_capi_fetch_remote_md` with `label` (NIXL's `metadataLabel`: which etcd key to read; NULL or
/// "" is the full metadata).
#[no_mangle]
pub extern "C" fn gixl_fetch_remote_md(
    agent: nixl_capi_agent_t,
    remote_name: *const c_char,
    label: *const c_char,
    opt_args: nixl_capi_opt_args_t,
) -> CapiStatus {
    ffi! { fetch_remote_md(agent, remote_name, label, opt_args) }
}

/// gixl: whether two backend handles name the same backend of the same agent (NIXL's C++ API hands out one
/// pointer per backend; the C API a new handle per query). Either handle may be of a destroyed agent.
#[no_mangle]
pub extern "C" fn gixl_backend_same(a: nixl_capi_backend_t, b: nixl_capi_backend_t, same: *mut bool) -> CapiStatus {
    ffi! {
        nonnull(same);
        let x = BACKENDS.get(a, "a")?;
        let y = BACKENDS.get(b, "b")?;
        put(same, *x == *y);
        OK
    }
}
