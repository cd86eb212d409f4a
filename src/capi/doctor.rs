//! `gixl_doctor`: the `gixl doctor` report for C users (see `crate::telemetry::doctor`).

use std::ffi::{c_char, c_void};

use libc::size_t;

use super::boundary::{bytes_arg, ffi, malloc_cstr, put, OK};
use super::CapiStatus;
use crate::telemetry::doctor::{report, PeerTarget};

/// gixl: which routes work on this host (in-process, cross-memory attach with the reason when not, TCP,
/// RDMA devices, CUDA), the route gixl picks and why, versions, and this process's agents with their loaded
/// peers and incarnations, as JSON in a `malloc`'d NUL-terminated string the caller `free()`s.
/// With `peer_md` (a peer's metadata, `peer_md_len` bytes; NULL and 0 for none) it also loads that peer
/// into a throw-away agent, reports the route it gets and why, and times a READ from its first region.
#[no_mangle]
pub extern "C" fn gixl_doctor(peer_md: *const c_void, peer_md_len: size_t, json_out: *mut *mut c_char) -> CapiStatus {
    ffi! {
        nonnull(json_out);
        let peer = if peer_md.is_null() && peer_md_len == 0 {
            None
        } else {
            Some(PeerTarget::Md(bytes_arg(peer_md, peer_md_len, "peer_md")?.to_vec()))
        };
        put(json_out, malloc_cstr(&report(peer))?);
        OK
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::capi::nixl_capi_status_t::NIXL_CAPI_SUCCESS;

    #[test]
    fn doctor_json_for_c() {
        let mut out: *mut c_char = std::ptr::null_mut();
        assert_eq!(gixl_doctor(std::ptr::null(), 0, &mut out), NIXL_CAPI_SUCCESS);
        // SAFETY: gixl_doctor returned a malloc'd C string.
        let s = unsafe { std::ffi::CStr::from_ptr(out) }.to_string_lossy().into_owned();
        // SAFETY: allocated with malloc for the caller to free.
        unsafe { libc::free(out.cast()) };
        assert!(s.starts_with('{') && s.contains("\"routes\""), "{s}");
        assert_ne!(gixl_doctor(std::ptr::null(), 0, std::ptr::null_mut()), NIXL_CAPI_SUCCESS);
        assert_ne!(gixl_doctor(std::ptr::null(), 3, &mut out), NIXL_CAPI_SUCCESS);
    }
}
