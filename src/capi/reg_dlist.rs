//! `nixl_capi_reg_dlist_t`: a list of registration descriptors (address, length, device id, and opaque
//! per-descriptor metadata such as a file path).

use std::ffi::{c_int, c_void};
use std::fmt::Write as _;

use libc::size_t;
use parking_lot::RwLock;

use super::boundary::{ffi, print_c_stdout, put, Fail, OK};
use super::registry::Registry;
use super::xfer_dlist::CDList;
use super::CapiStatus;
use super::MemTypeRaw;
use crate::mem::{Desc, RegDList, RegDesc};

/// Opaque registration descriptor list (`struct nixl_capi_reg_dlist_s`).
pub struct nixl_capi_reg_dlist_s {
    _opaque: [u8; 0],
}
pub type nixl_capi_reg_dlist_t = *mut nixl_capi_reg_dlist_s;

pub(crate) static REG_DLISTS: Registry<RwLock<CDList<RegDesc>>> = Registry::new("registration descriptor list");

fn get(d: nixl_capi_reg_dlist_t) -> Result<std::sync::Arc<RwLock<CDList<RegDesc>>>, Fail> {
    REG_DLISTS.get(d, "dlist")
}

/// The core list a C list stands for, or NOT_FOUND for a memory type no backend has.
pub(crate) fn for_agent(d: &CDList<RegDesc>) -> Result<&RegDList, Fail> {
    super::mem_for_agent(d.raw_mem)?;
    Ok(&d.list)
}

#[no_mangle]
pub extern "C" fn nixl_capi_create_reg_dlist(mem_type: MemTypeRaw, dlist: *mut nixl_capi_reg_dlist_t) -> CapiStatus {
    ffi! {
        nonnull(dlist);
        put(dlist, REG_DLISTS.insert(RwLock::new(CDList::new(mem_type))));
        OK
    }
}

#[no_mangle]
pub extern "C" fn nixl_capi_destroy_reg_dlist(dlist: nixl_capi_reg_dlist_t) -> CapiStatus {
    ffi! {
        REG_DLISTS.remove(dlist, "dlist")?;
        OK
    }
}

#[no_mangle]
pub extern "C" fn nixl_capi_reg_dlist_get_type(dlist: nixl_capi_reg_dlist_t, mem_type: *mut MemTypeRaw) -> CapiStatus {
    ffi! {
        nonnull(mem_type);
        put(mem_type, get(dlist)?.read().raw_mem);
        OK
    }
}

/// gixl: one descriptor of `gixl_reg_dlist_add_descs`: a `gixl_desc_t`'s fields and `metadata_len` bytes
/// of metadata at `metadata` (copied; NULL means none, as in `nixl_capi_reg_dlist_add_desc`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct gixl_reg_desc_s {
    pub addr: usize,
    pub len: size_t,
    pub dev_id: u64,
    pub metadata: *const c_void,
    pub metadata_len: size_t,
}
pub type gixl_reg_desc_t = gixl_reg_desc_s;

/// gixl: appends `count` registration descriptors in one call. On failure the list is unchanged.
#[no_mangle]
pub extern "C" fn gixl_reg_dlist_add_descs(
    dlist: nixl_capi_reg_dlist_t,
    descs: *const gixl_reg_desc_t,
    count: size_t,
) -> CapiStatus {
    ffi! {
        let d = get(dlist)?;
        let raw = super::boundary::slice_arg(descs, count, "descs", "gixl_reg_desc_t")?;
        let mut add = Vec::new();
        add.try_reserve_exact(raw.len()).map_err(|_| Fail::backend(format!("cannot grow a descriptor list by {count} entries")))?;
        for r in raw {
            let meta = if r.metadata.is_null() {
                Vec::new()
            } else {
                super::boundary::bytes_arg(r.metadata, r.metadata_len, "metadata")?.to_vec()
            };
            add.push(RegDesc { desc: Desc::new(r.addr as u64, r.len as u64, r.dev_id), meta });
        }
        let mut d = d.write();
        d.list.try_reserve(add.len()).map_err(|_| Fail::backend(format!("cannot grow a descriptor list by {count} entries")))?;
        for r in add {
            d.list.push(r);
        }
        OK
    }
}

/// Appends a descriptor with `metadata_len` bytes of metadata (copied). A NULL `metadata` means none,
/// whatever `metadata_len` says (as NIXL).
#[no_mangle]
pub extern "C" fn nixl_capi_reg_dlist_add_desc(
    dlist: nixl_capi_reg_dlist_t,
    addr: usize,
    len: size_t,
    dev_id: u64,
    metadata: *const c_void,
    metadata_len: size_t,
) -> CapiStatus {
    ffi! {
        let d = get(dlist)?;
        let meta = if metadata.is_null() { Vec::new() } else { super::boundary::bytes_arg(metadata, metadata_len, "metadata")?.to_vec() };
        d.write().list.push(RegDesc { desc: Desc::new(addr as u64, len as u64, dev_id), meta });
        OK
    }
}

#[no_mangle]
pub extern "C" fn nixl_capi_reg_dlist_desc_count(dlist: nixl_capi_reg_dlist_t, count: *mut size_t) -> CapiStatus {
    ffi! {
        nonnull(count);
        put(count, get(dlist)?.read().list.len());
        OK
    }
}

#[no_mangle]
pub extern "C" fn nixl_capi_reg_dlist_is_empty(dlist: nixl_capi_reg_dlist_t, is_empty: *mut bool) -> CapiStatus {
    ffi! {
        nonnull(is_empty);
        put(is_empty, get(dlist)?.read().list.is_empty());
        OK
    }
}

/// A no-op, as in NIXL (whose trimmed copy, without metadata, is discarded).
#[no_mangle]
pub extern "C" fn nixl_capi_reg_dlist_trim(dlist: nixl_capi_reg_dlist_t) -> CapiStatus {
    ffi! {
        get(dlist)?;
        OK
    }
}

/// Removes the descriptor at `index`; out of range (negative too) is ERROR_BACKEND, as NIXL.
#[no_mangle]
pub extern "C" fn nixl_capi_reg_dlist_rem_desc(dlist: nixl_capi_reg_dlist_t, index: c_int) -> CapiStatus {
    ffi! {
        get(dlist)?.write().rem_desc(index)
    }
}

#[no_mangle]
pub extern "C" fn nixl_capi_reg_dlist_clear(dlist: nixl_capi_reg_dlist_t) -> CapiStatus {
    ffi! {
        get(dlist)?.write().list.clear();
        OK
    }
}

/// Resizes to `new_size` descriptors, adding empty ones.
#[no_mangle]
pub extern "C" fn nixl_capi_reg_dlist_resize(dlist: nixl_capi_reg_dlist_t, new_size: size_t) -> CapiStatus {
    ffi! {
        get(dlist)?.write().resize(new_size)
    }
}

/// Prints the list to the C library's `stdout`.
#[no_mangle]
pub extern "C" fn nixl_capi_reg_dlist_print(dlist: nixl_capi_reg_dlist_t) -> CapiStatus {
    ffi! {
        let d = get(dlist)?;
        let d = d.read();
        let mut s = d.header("registration");
        for (i, x) in d.list.iter().enumerate() {
            let _ = writeln!(s, "  [{i}] addr {:#x} len {} dev {} metadata {} bytes", x.desc.addr, x.desc.len, x.desc.dev, x.meta.len());
        }
        print_c_stdout(&s);
        OK
    }
}

#[cfg(test)]
mod tests {
    use super::super::nixl_capi_status_t::*;
    use super::*;

    #[test]
    fn metadata_is_copied_and_null_means_none() {
        let mut d = std::ptr::null_mut();
        assert_eq!(nixl_capi_create_reg_dlist(4, &mut d), NIXL_CAPI_SUCCESS);
        let path = b"/tmp/x";
        assert_eq!(nixl_capi_reg_dlist_add_desc(d, 0, 4096, 3, path.as_ptr().cast(), path.len()), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_reg_dlist_add_desc(d, 4096, 4096, 3, std::ptr::null(), 16), NIXL_CAPI_SUCCESS);
        {
            let l = get(d).unwrap();
            let l = l.read();
            assert_eq!(l.list.get(0).unwrap().meta, path);
            assert!(l.list.get(1).unwrap().meta.is_empty());
        }
        assert_eq!(nixl_capi_reg_dlist_rem_desc(d, 2), NIXL_CAPI_ERROR_BACKEND);
        assert_eq!(nixl_capi_reg_dlist_resize(d, 4), NIXL_CAPI_SUCCESS);
        let mut n = 0;
        assert_eq!(nixl_capi_reg_dlist_desc_count(d, &mut n), NIXL_CAPI_SUCCESS);
        assert_eq!(n, 4);
        let mut t = -1;
        assert_eq!(nixl_capi_reg_dlist_clear(d), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_reg_dlist_get_type(d, &mut t), NIXL_CAPI_SUCCESS);
        assert_eq!(t, 4);
        assert_eq!(nixl_capi_destroy_reg_dlist(d), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_reg_dlist_trim(d), NIXL_CAPI_ERROR_INVALID_PARAM);
    }
}
