//! `nixl_capi_backend_t`: a backend of one agent. The handle is a small wrapper (the agent keeps the
//! engine): destroying it leaves the backend in the agent, as in NIXL. A backend handle is only accepted
//! with the agent that created it.

use std::ffi::c_char;

use super::agent::{nixl_capi_agent_t, AgentObj, AGENTS};
use super::boundary::{ffi, put, str_arg, Fail, OK};
use super::mem_list::{nixl_capi_mem_list_t, MemListObj, MEM_LISTS};
use super::params::{nixl_capi_params_t, ParamsObj, PARAMS};
use super::registry::Registry;
use super::CapiStatus;
use crate::agent::BackendId;

/// Opaque backend (`struct nixl_capi_backend_s`).
pub struct nixl_capi_backend_s {
    _opaque: [u8; 0],
}
pub type nixl_capi_backend_t = *mut nixl_capi_backend_s;

/// A backend of the agent whose incarnation is `owner`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BackendObj {
    pub owner: u128,
    pub id: BackendId,
}

impl BackendObj {
    /// The backend's id in `a`, or INVALID_PARAM if it belongs to another agent.
    pub fn id_in(&self, a: &AgentObj) -> Result<BackendId, Fail> {
        if self.owner != a.owner() {
            return Err(Fail::invalid("backend handle belongs to another agent"));
        }
        Ok(self.id)
    }
}

pub(crate) static BACKENDS: Registry<BackendObj> = Registry::new("backend");

/// A new handle for backend `id` of `a`.
pub(crate) fn new_handle(a: &AgentObj, id: BackendId) -> nixl_capi_backend_t {
    BACKENDS.insert(BackendObj { owner: a.owner(), id })
}

/// Creates a backend from a plugin with init options `params` (not NULL). ERROR_BACKEND for any failure
/// (an unknown plugin, a second backend of the same type), as NIXL.
#[no_mangle]
pub extern "C" fn nixl_capi_create_backend(
    agent: nixl_capi_agent_t,
    plugin_name: *const c_char,
    params: nixl_capi_params_t,
    backend: *mut nixl_capi_backend_t,
) -> CapiStatus {
    ffi! {
        nonnull(backend);
        let a = AGENTS.get(agent, "agent")?;
        let plugin = str_arg(plugin_name, "plugin_name")?;
        let p = PARAMS.get(params, "params")?;
        let p = p.0.read().clone();
        let id = a.agent.create_backend(plugin, &p).map_err(|e| Fail::from(e).any_as_backend())?;
        put(backend, new_handle(&a, id));
        OK
    }
}

/// Frees the handle only; the backend stays in its agent.
#[no_mangle]
pub extern "C" fn nixl_capi_destroy_backend(backend: nixl_capi_backend_t) -> CapiStatus {
    ffi! {
        BACKENDS.remove(backend, "backend")?;
        OK
    }
}

/// A backend's memory types and the options in effect. ERROR_BACKEND for any failure, as NIXL.
#[no_mangle]
pub extern "C" fn nixl_capi_get_backend_params(
    agent: nixl_capi_agent_t,
    backend: nixl_capi_backend_t,
    mems: *mut nixl_capi_mem_list_t,
    params: *mut nixl_capi_params_t,
) -> CapiStatus {
    ffi! {
        nonnull(mems, params);
        let a = AGENTS.get(agent, "agent")?;
        let b = BACKENDS.get(backend, "backend")?;
        let id = b.id_in(&a)?;
        let (p, m) = a.agent.backend_params(id).map_err(|e| Fail::from(e).any_as_backend())?;
        put(mems, MEM_LISTS.insert(MemListObj(m)));
        put(params, PARAMS.insert(ParamsObj::new(p)));
        OK
    }
}

#[cfg(test)]
mod tests {
    use super::super::agent::nixl_capi_destroy_agent;
    use super::super::agent::tests::{agent, ucx_agent};
    use super::super::nixl_capi_status_t::*;
    use super::super::{mem_list, params};
    use super::*;

    #[test]
    fn create_query_destroy() {
        let (a, b) = ucx_agent(c"capi-be-A");
        let other = agent(c"capi-be-B");
        let (mut m, mut p) = (std::ptr::null_mut(), std::ptr::null_mut());
        assert_eq!(nixl_capi_get_backend_params(a, b, &mut m, &mut p), NIXL_CAPI_SUCCESS);
        let mut n = 0;
        assert_eq!(mem_list::nixl_capi_mem_list_size(m, &mut n), NIXL_CAPI_SUCCESS);
        assert!(n >= 1);
        assert_eq!(mem_list::nixl_capi_destroy_mem_list(m), NIXL_CAPI_SUCCESS);
        // Another agent cannot use this backend handle.
        assert_eq!(nixl_capi_get_backend_params(other, b, &mut m, &mut p), NIXL_CAPI_ERROR_INVALID_PARAM);
        // A second UCX backend, or an unknown plugin: ERROR_BACKEND whatever the reason.
        let mut b2 = std::ptr::null_mut();
        assert_eq!(nixl_capi_create_backend(a, c"UCX".as_ptr(), p, &mut b2), NIXL_CAPI_ERROR_BACKEND);
        assert_eq!(nixl_capi_create_backend(a, c"NOPE".as_ptr(), p, &mut b2), NIXL_CAPI_ERROR_BACKEND);
        assert_eq!(
            nixl_capi_create_backend(a, c"UCX".as_ptr(), std::ptr::null_mut(), &mut b2),
            NIXL_CAPI_ERROR_INVALID_PARAM
        );
        assert!(b2.is_null());
        assert_eq!(params::nixl_capi_destroy_params(p), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_destroy_backend(b), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_destroy_backend(b), NIXL_CAPI_ERROR_INVALID_PARAM);
        assert_eq!(nixl_capi_destroy_agent(a), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_destroy_agent(other), NIXL_CAPI_SUCCESS);
    }
}
