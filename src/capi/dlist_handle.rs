//! `nixl_capi_xfer_dlist_handle_t`: a prepped descriptor list (NIXL's `nixlDlistH`), resolved once
//! against registrations for use as one side of later requests. It belongs to the agent that prepped it:
//! another agent gets INVALID_PARAM. After its peer is invalidated, requests made from it are refused
//! (NOT_FOUND); the handle itself can always be released.

use std::ffi::c_char;

use libc::size_t;

use super::agent::{nixl_capi_agent_t, AgentObj, AGENTS};
use super::boundary::{ffi, put, str_arg, Fail, OK};
use super::opt_args::{self, nixl_capi_opt_args_t};
use super::registry::Registry;
use super::xfer_dlist::{self, gixl_desc_t, nixl_capi_xfer_dlist_t};
use super::{mem_for_agent, CapiStatus, MemTypeRaw};
use crate::agent::PreppedDList;

/// Opaque prepped descriptor list (`struct nixl_capi_xfer_dlist_handle_s`).
pub struct nixl_capi_xfer_dlist_handle_s {
    _opaque: [u8; 0],
}
pub type nixl_capi_xfer_dlist_handle_t = *mut nixl_capi_xfer_dlist_handle_s;

pub(crate) struct DlistHandleObj {
    pub owner: u128,
    pub h: PreppedDList,
}

impl DlistHandleObj {
    pub fn check_owner(&self, a: &AgentObj) -> Result<(), Fail> {
        if self.owner != a.owner() {
            return Err(Fail::invalid("prepped descriptor list belongs to another agent"));
        }
        Ok(())
    }
}

pub(crate) static DLIST_HANDLES: Registry<DlistHandleObj> = Registry::new("prepped descriptor list");

/// Resolves `descs` against registrations: `agent_name` "" for this agent's buffers as initiator, this
/// agent's own name for loopback, or a loaded peer. Empty or uncovered lists are NOT_FOUND.
#[no_mangle]
pub extern "C" fn nixl_capi_prep_xfer_dlist(
    agent: nixl_capi_agent_t,
    agent_name: *const c_char,
    descs: nixl_capi_xfer_dlist_t,
    dlist_hndl: *mut nixl_capi_xfer_dlist_handle_t,
    opt_args: nixl_capi_opt_args_t,
) -> CapiStatus {
    ffi! {
        nonnull(dlist_hndl);
        let a = AGENTS.get(agent, "agent")?;
        let name = str_arg(agent_name, "agent_name")?;
        let d = xfer_dlist::get(descs)?;
        let hints = opt_args::hints(opt_args, &a)?;
        let h = {
            let d = d.read();
            a.agent.prep_xfer_dlist(name, xfer_dlist::for_agent(&d)?, &hints)?
        };
        put(dlist_hndl, DLIST_HANDLES.insert(DlistHandleObj { owner: a.owner(), h }));
        OK
    }
}

/// gixl: `nixl_capi_prep_xfer_dlist` of `count` descriptors of memory type `mem_type` read in place from
/// `descs` (no list handle is made; the array may be freed once the call returns). Same statuses. On
/// failure `*dlist_hndl` is left as it was, except when registrations were searched and none covered the
/// descriptors: then it is set to NULL, as NIXL's C++ `prepXferDlist` does.
#[no_mangle]
pub extern "C" fn gixl_prep_xfer_dlist_descs(
    agent: nixl_capi_agent_t,
    agent_name: *const c_char,
    mem_type: MemTypeRaw,
    descs: *const gixl_desc_t,
    count: size_t,
    dlist_hndl: *mut nixl_capi_xfer_dlist_handle_t,
    opt_args: nixl_capi_opt_args_t,
) -> CapiStatus {
    ffi! {
        nonnull(dlist_hndl);
        let a = AGENTS.get(agent, "agent")?;
        let name = str_arg(agent_name, "agent_name")?;
        let d = xfer_dlist::descs_arg(descs, count, "descs")?;
        let hints = opt_args::hints(opt_args, &a)?;
        let mem = mem_for_agent(mem_type)?;
        let h = a.agent.prep_searched(name, mem, d, &hints).map_err(|f| {
            if f.searched {
                put(dlist_hndl, std::ptr::null_mut());
            }
            f.err
        })?;
        put(dlist_hndl, DLIST_HANDLES.insert(DlistHandleObj { owner: a.owner(), h }));
        OK
    }
}

/// Frees a prepped list. Requests made from it keep working. A second release, or a release through
/// another agent, is INVALID_PARAM (and in the latter case the handle stays live).
#[no_mangle]
pub extern "C" fn nixl_capi_release_xfer_dlist_handle(
    agent: nixl_capi_agent_t,
    dlist_handle: nixl_capi_xfer_dlist_handle_t,
) -> CapiStatus {
    ffi! {
        let a = AGENTS.get(agent, "agent")?;
        DLIST_HANDLES.remove_if(dlist_handle, "dlist_handle", |h| h.check_owner(&a))?;
        OK
    }
}
