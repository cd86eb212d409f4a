//! Transfer telemetry (`struct nixl_capi_xfer_telemetry_s`) of a request's last post.

use super::agent::{nixl_capi_agent_t, AGENTS};
use super::boundary::{ffi, put, OK};
use super::xfer_req::{self, nixl_capi_xfer_req_t};
use super::{nixl_capi_status_t, CapiStatus};

/// Telemetry of one post. `start_time_us` is a steady-clock time (not wall-clock), as NIXL's.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct nixl_capi_xfer_telemetry_s {
    pub start_time_us: u64,
    pub post_duration_us: u64,
    pub xfer_duration_us: u64,
    pub total_bytes: u64,
    /// Descriptors after merging.
    pub desc_count: u64,
}
pub type nixl_capi_xfer_telemetry_t = *mut nixl_capi_xfer_telemetry_s;

/// Fills `telemetry` when the last post completed (SUCCESS). IN_PROG while it runs, NO_TELEMETRY when
/// telemetry is off (`NIXL_TELEMETRY_ENABLE`, or `capture_telemetry` in the config), the post's error
/// otherwise; the struct is written only on SUCCESS.
#[no_mangle]
pub extern "C" fn nixl_capi_get_xfer_telemetry(
    agent: nixl_capi_agent_t,
    req_hndl: nixl_capi_xfer_req_t,
    telemetry: nixl_capi_xfer_telemetry_t,
) -> CapiStatus {
    ffi! {
        nonnull(telemetry);
        let a = AGENTS.get(agent, "agent")?;
        let req = xfer_req::live(&a, req_hndl)?;
        match a.agent.xfer_telemetry(&req)? {
            None => Ok(nixl_capi_status_t::NIXL_CAPI_IN_PROG),
            Some(t) => {
                put(
                    telemetry,
                    nixl_capi_xfer_telemetry_s {
                        start_time_us: t.start_time_us,
                        post_duration_us: t.post_duration_us,
                        xfer_duration_us: t.xfer_duration_us,
                        total_bytes: t.total_bytes,
                        desc_count: t.desc_count,
                    },
                );
                OK
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::agent::tests::{exchange, reg};
    use super::super::agent::{
        nixl_capi_create_configured_agent, nixl_capi_destroy_agent, nixl_capi_get_plugin_params,
    };
    use super::super::backend::{nixl_capi_create_backend, nixl_capi_destroy_backend};
    use super::super::nixl_capi_status_t::*;
    use super::super::xfer_dlist::nixl_capi_destroy_xfer_dlist;
    use super::super::xfer_req::tests::{wait, xlist};
    use super::super::xfer_req::*;
    use super::super::{mem_list, nixl_capi_agent_config_t, params};
    use super::*;

    #[test]
    fn telemetry_after_a_write() {
        let cfg = nixl_capi_agent_config_t {
            enable_prog_thread: true,
            enable_listen_thread: false,
            listen_port: 0,
            thread_sync: 0,
            num_workers: 0,
            pthr_delay_us: 0,
            lthr_delay_us: 100_000,
            capture_telemetry: true,
        };
        let mut agents = vec![];
        for name in [c"capi-tel-A", c"capi-tel-B"] {
            let mut a = std::ptr::null_mut();
            assert_eq!(nixl_capi_create_configured_agent(name.as_ptr(), &cfg, &mut a), NIXL_CAPI_SUCCESS);
            let (mut m, mut p, mut b) = (std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut());
            assert_eq!(nixl_capi_get_plugin_params(a, c"UCX".as_ptr(), &mut m, &mut p), NIXL_CAPI_SUCCESS);
            assert_eq!(nixl_capi_create_backend(a, c"UCX".as_ptr(), p, &mut b), NIXL_CAPI_SUCCESS);
            mem_list::nixl_capi_destroy_mem_list(m);
            params::nixl_capi_destroy_params(p);
            agents.push((a, b));
        }
        let [(a, ba), (b, bb)] = agents[..] else { unreachable!() };
        let src = vec![7u8; 256];
        let dst = vec![0u8; 256];
        assert_eq!(reg(a, &src), NIXL_CAPI_SUCCESS);
        assert_eq!(reg(b, &dst), NIXL_CAPI_SUCCESS);
        exchange(b, a);
        let (l, r) = (xlist(&src), xlist(&dst));
        let mut q = std::ptr::null_mut();
        assert_eq!(
            nixl_capi_create_xfer_req(a, 1, l, r, c"capi-tel-B".as_ptr(), &mut q, std::ptr::null_mut()),
            NIXL_CAPI_SUCCESS
        );
        let mut t = nixl_capi_xfer_telemetry_s { total_bytes: 0xab, ..Default::default() };
        assert_eq!(nixl_capi_get_xfer_telemetry(a, q, &mut t), NIXL_CAPI_ERROR_BACKEND, "never posted");
        assert_eq!(t.total_bytes, 0xab, "untouched on failure");
        let s = nixl_capi_post_xfer_req(a, q, std::ptr::null_mut());
        assert_eq!(wait(a, q, s), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_get_xfer_telemetry(a, q, &mut t), NIXL_CAPI_SUCCESS);
        assert_eq!((t.total_bytes, t.desc_count), (256, 1));
        assert!(t.start_time_us > 0 && t.xfer_duration_us >= t.post_duration_us);
        assert_eq!(nixl_capi_get_xfer_telemetry(a, q, std::ptr::null_mut()), NIXL_CAPI_ERROR_INVALID_PARAM);
        assert_eq!(nixl_capi_release_xfer_req(a, q), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_get_xfer_telemetry(a, q, &mut t), NIXL_CAPI_ERROR_INVALID_PARAM);
        assert_eq!(nixl_capi_destroy_xfer_req(q), NIXL_CAPI_SUCCESS);
        for d in [l, r] {
            nixl_capi_destroy_xfer_dlist(d);
        }
        for (x, h) in [(a, ba), (b, bb)] {
            assert_eq!(nixl_capi_destroy_backend(h), NIXL_CAPI_SUCCESS);
            assert_eq!(nixl_capi_destroy_agent(x), NIXL_CAPI_SUCCESS);
        }
    }
}
