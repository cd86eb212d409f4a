//! `nixl_capi_mem_view_t`: memory views for NIXL's GPU device API. No backend in this build can make
//! one, and no view handle is ever handed out. Preparing one answers what NIXL 1.5.1 answers on a
//! machine without a GPU: ERROR_BACKEND when a UCX backend is among the candidates (NIXL's UCX claims
//! the capability, tries, and fails; gixl's UCX-compatible engine reports NOT_SUPPORTED), NOT_FOUND when
//! no candidate backend claims it.

use super::agent::{nixl_capi_agent_t, AgentObj, AGENTS};
use super::boundary::{ffi, Fail, OK};
use super::opt_args::{self, nixl_capi_opt_args_t};
use super::remote_dlist::{self, nixl_capi_remote_dlist_t};
use super::xfer_dlist::{self, nixl_capi_xfer_dlist_t};
use super::{nixl_capi_status_t, CapiStatus};
use crate::agent::BackendId;
use crate::status::Status;

/// Opaque memory view (`struct nixl_capi_mem_view_s`).
pub struct nixl_capi_mem_view_s {
    _opaque: [u8; 0],
}
pub type nixl_capi_mem_view_t = *mut nixl_capi_mem_view_s;

fn unavailable(a: &AgentObj, hints: &[BackendId], what: &str) -> Fail {
    let ucx = a.agent.backends().iter().any(|(id, name)| *name == "UCX" && (hints.is_empty() || hints.contains(id)));
    if ucx {
        Fail::with_code(
            nixl_capi_status_t::NIXL_CAPI_ERROR_BACKEND,
            Status::NotSupported,
            format!("{what} memory views (GPU device API) are not supported by this build's UCX backend"),
        )
    } else {
        Fail::with_code(
            nixl_capi_status_t::NIXL_CAPI_ERROR_NOT_FOUND,
            Status::NotFound,
            format!("no backend capable of creating a {what} memory view (GPU device API)"),
        )
    }
}

#[no_mangle]
pub extern "C" fn nixl_capi_prep_mem_view_local(
    agent: nixl_capi_agent_t,
    descs: nixl_capi_xfer_dlist_t,
    mvh: *mut nixl_capi_mem_view_t,
    opt_args: nixl_capi_opt_args_t,
) -> CapiStatus {
    ffi! {
        nonnull(mvh);
        let a = AGENTS.get(agent, "agent")?;
        xfer_dlist::get(descs)?;
        let hints = opt_args::hints(opt_args, &a)?;
        Err(unavailable(&a, &hints, "local"))
    }
}

#[no_mangle]
pub extern "C" fn nixl_capi_prep_mem_view_remote(
    agent: nixl_capi_agent_t,
    descs: nixl_capi_remote_dlist_t,
    mvh: *mut nixl_capi_mem_view_t,
    opt_args: nixl_capi_opt_args_t,
) -> CapiStatus {
    ffi! {
        nonnull(mvh);
        let a = AGENTS.get(agent, "agent")?;
        remote_dlist::get(descs)?;
        let hints = opt_args::hints(opt_args, &a)?;
        Err(unavailable(&a, &hints, "remote"))
    }
}

/// SUCCESS for any non-NULL view, as NIXL (which does not report a view it does not know).
#[no_mangle]
pub extern "C" fn nixl_capi_release_mem_view(agent: nixl_capi_agent_t, mvh: nixl_capi_mem_view_t) -> CapiStatus {
    ffi! {
        nonnull(mvh);
        AGENTS.get(agent, "agent")?;
        OK
    }
}

#[cfg(test)]
mod tests {
    use super::super::agent::nixl_capi_destroy_agent;
    use super::super::agent::tests::{agent, ucx_agent};
    use super::super::backend::nixl_capi_destroy_backend;
    use super::super::nixl_capi_status_t::*;
    use super::super::xfer_dlist::{nixl_capi_create_xfer_dlist, nixl_capi_destroy_xfer_dlist};
    use super::*;

    #[test]
    fn views_are_not_available() {
        let a = agent(c"capi-mv");
        let (mut d, mut v) = (std::ptr::null_mut(), std::ptr::null_mut());
        assert_eq!(nixl_capi_create_xfer_dlist(0, &mut d), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_prep_mem_view_local(a, d, &mut v, std::ptr::null_mut()), NIXL_CAPI_ERROR_NOT_FOUND);
        assert_eq!(
            nixl_capi_prep_mem_view_local(a, d, std::ptr::null_mut(), std::ptr::null_mut()),
            NIXL_CAPI_ERROR_INVALID_PARAM
        );
        assert!(v.is_null());
        assert_eq!(nixl_capi_release_mem_view(a, std::ptr::null_mut()), NIXL_CAPI_ERROR_INVALID_PARAM);
        assert_eq!(nixl_capi_release_mem_view(a, 0x10 as nixl_capi_mem_view_t), NIXL_CAPI_SUCCESS);
        let (u, ub) = ucx_agent(c"capi-mv-ucx");
        assert_eq!(nixl_capi_prep_mem_view_local(u, d, &mut v, std::ptr::null_mut()), NIXL_CAPI_ERROR_BACKEND);
        assert!(v.is_null());
        assert_eq!(nixl_capi_destroy_xfer_dlist(d), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_destroy_backend(ub), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_destroy_agent(u), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_destroy_agent(a), NIXL_CAPI_SUCCESS);
    }
}
