//! `nixl_capi_remote_dlist_t`: descriptors that each name the agent owning them. Only memory views use
//! them, and this build has no memory-view backend, so the list can be built but not consumed.

use std::ffi::c_char;

use libc::size_t;
use parking_lot::RwLock;

use super::boundary::{ffi, put, str_arg, Fail, OK};
use super::registry::Registry;
use super::xfer_dlist::CDList;
use super::{CapiStatus, MemTypeRaw};
use crate::mem::{Desc, RemoteDesc};

/// Opaque remote descriptor list (`struct nixl_capi_remote_dlist_s`).
pub struct nixl_capi_remote_dlist_s {
    _opaque: [u8; 0],
}
pub type nixl_capi_remote_dlist_t = *mut nixl_capi_remote_dlist_s;

/// NIXL's placeholder agent name (`nixl_null_agent`).
pub const NULL_AGENT: &str = "NULL_AGENT";

pub(crate) static REMOTE_DLISTS: Registry<RwLock<CDList<RemoteDesc>>> = Registry::new("remote descriptor list");

pub(crate) fn get(d: nixl_capi_remote_dlist_t) -> Result<std::sync::Arc<RwLock<CDList<RemoteDesc>>>, Fail> {
    REMOTE_DLISTS.get(d, "descs")
}

#[no_mangle]
pub extern "C" fn nixl_capi_create_remote_dlist(
    mem_type: MemTypeRaw,
    dlist: *mut nixl_capi_remote_dlist_t,
) -> CapiStatus {
    ffi! {
        nonnull(dlist);
        put(dlist, REMOTE_DLISTS.insert(RwLock::new(CDList::new(mem_type))));
        OK
    }
}

#[no_mangle]
pub extern "C" fn nixl_capi_destroy_remote_dlist(dlist: nixl_capi_remote_dlist_t) -> CapiStatus {
    ffi! {
        REMOTE_DLISTS.remove(dlist, "dlist")?;
        OK
    }
}

/// Appends a descriptor owned by `remote_agent`; NULL means "NULL_AGENT", NIXL's placeholder that keeps
/// indices aligned when only some peers are addressed.
#[no_mangle]
pub extern "C" fn nixl_capi_remote_dlist_add_desc(
    dlist: nixl_capi_remote_dlist_t,
    addr: usize,
    len: size_t,
    dev_id: u64,
    remote_agent: *const c_char,
) -> CapiStatus {
    ffi! {
        let d = REMOTE_DLISTS.get(dlist, "dlist")?;
        let agent = if remote_agent.is_null() { NULL_AGENT } else { str_arg(remote_agent, "remote_agent")? };
        d.write().list.push(RemoteDesc { desc: Desc::new(addr as u64, len as u64, dev_id), agent: agent.to_owned() });
        OK
    }
}

#[cfg(test)]
mod tests {
    use super::super::nixl_capi_status_t::*;
    use super::*;

    #[test]
    fn null_agent_placeholder() {
        let mut d = std::ptr::null_mut();
        assert_eq!(nixl_capi_create_remote_dlist(0, &mut d), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_remote_dlist_add_desc(d, 0x1000, 64, 0, c"peer".as_ptr()), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_remote_dlist_add_desc(d, 0x2000, 64, 0, std::ptr::null()), NIXL_CAPI_SUCCESS);
        {
            let l = get(d).unwrap();
            let l = l.read();
            assert_eq!(l.list.get(0).unwrap().agent, "peer");
            assert_eq!(l.list.get(1).unwrap().agent, NULL_AGENT);
        }
        assert_eq!(nixl_capi_destroy_remote_dlist(d), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_destroy_remote_dlist(d), NIXL_CAPI_ERROR_INVALID_PARAM);
    }
}
