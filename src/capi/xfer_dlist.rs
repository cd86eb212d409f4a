//! `nixl_capi_xfer_dlist_t`: a list of transfer descriptors (address, length, device id) of one memory
//! type, and the list helpers shared with `reg_dlist` and `remote_dlist`.
//!
//! A list keeps the memory type exactly as the caller gave it: NIXL accepts any value there (UNKNOWN, or a
//! cast), so the list calls do too; an agent refuses such a list with NOT_FOUND.

use std::fmt::Write as _;

use libc::size_t;
use parking_lot::RwLock;

use super::boundary::{ffi, print_c_stdout, put, Fail, OK};
use super::registry::Registry;
use super::{mem_from_raw, nixl_capi_status_t, CapiStatus, MemTypeRaw};
use crate::mem::{DList, Desc, MemType, XferDList};

/// Opaque transfer descriptor list (`struct nixl_capi_xfer_dlist_s`).
pub struct nixl_capi_xfer_dlist_s {
    _opaque: [u8; 0],
}
pub type nixl_capi_xfer_dlist_t = *mut nixl_capi_xfer_dlist_s;

/// A C descriptor list: the memory type as given, and the core list (DRAM when the type is not one).
pub(crate) struct CDList<T> {
    pub raw_mem: MemTypeRaw,
    pub list: DList<T>,
}

impl<T: Default + Clone> CDList<T> {
    pub fn new(raw_mem: MemTypeRaw) -> Self {
        CDList { raw_mem, list: DList::new(mem_from_raw(raw_mem).unwrap_or(MemType::Dram)) }
    }

    /// NIXL's `remDesc`: an index out of range throws `std::out_of_range`, which its C API reports as
    /// ERROR_BACKEND.
    pub fn rem_desc(&mut self, index: std::ffi::c_int) -> Result<nixl_capi_status_t, Fail> {
        let n = self.list.len();
        let i = usize::try_from(index)
            .ok()
            .filter(|&i| i < n)
            .ok_or_else(|| Fail::backend(format!("index {index} out of range for {n} descriptors")))?;
        self.list.remove(i)?;
        OK
    }

    /// Grows with empty descriptors or shrinks. A size that cannot be allocated is ERROR_BACKEND (NIXL
    /// throws `std::length_error` / `bad_alloc`), never an abort.
    pub fn resize(&mut self, n: usize) -> Result<nixl_capi_status_t, Fail> {
        let cur = self.list.len();
        if n > cur {
            let mut probe: Vec<T> = Vec::new();
            probe
                .try_reserve_exact(n - cur)
                .map_err(|_| Fail::backend(format!("cannot resize a descriptor list to {n} entries")))?;
        }
        self.list.resize(n);
        OK
    }

    pub fn header(&self, kind: &str) -> String {
        let mem = mem_from_raw(self.raw_mem)
            .map_or_else(|| format!("memory type {}", self.raw_mem), |m| m.seg_name().to_owned());
        format!("{kind} descriptor list: {mem}, {} descriptors\n", self.list.len())
    }
}

pub(crate) static XFER_DLISTS: Registry<RwLock<CDList<Desc>>> = Registry::new("xfer descriptor list");

pub(crate) fn get(d: nixl_capi_xfer_dlist_t) -> Result<std::sync::Arc<RwLock<CDList<Desc>>>, Fail> {
    XFER_DLISTS.get(d, "dlist")
}

/// The core list a C list stands for, or NOT_FOUND for a memory type no backend has.
pub(crate) fn for_agent(d: &CDList<Desc>) -> Result<&XferDList, Fail> {
    super::mem_for_agent(d.raw_mem)?;
    Ok(&d.list)
}

#[no_mangle]
pub extern "C" fn nixl_capi_create_xfer_dlist(mem_type: MemTypeRaw, dlist: *mut nixl_capi_xfer_dlist_t) -> CapiStatus {
    ffi! {
        nonnull(dlist);
        put(dlist, XFER_DLISTS.insert(RwLock::new(CDList::new(mem_type))));
        OK
    }
}

#[no_mangle]
pub extern "C" fn nixl_capi_destroy_xfer_dlist(dlist: nixl_capi_xfer_dlist_t) -> CapiStatus {
    ffi! {
        XFER_DLISTS.remove(dlist, "dlist")?;
        OK
    }
}

#[no_mangle]
pub extern "C" fn nixl_capi_xfer_dlist_get_type(
    dlist: nixl_capi_xfer_dlist_t,
    mem_type: *mut MemTypeRaw,
) -> CapiStatus {
    ffi! {
        nonnull(mem_type);
        put(mem_type, get(dlist)?.read().raw_mem);
        OK
    }
}

/// gixl: one descriptor of a bulk call (`gixl_xfer_dlist_add_descs`, `gixl_prep_xfer_dlist_descs`,
/// `gixl_create_xfer_req_descs`). Its layout is that of NIXL's C++ `nixlBasicDesc` (24 bytes on 64-bit
/// targets), so a `nixl_xfer_dlist_t`'s storage can be passed as it is.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct gixl_desc_s {
    pub addr: usize,
    pub len: size_t,
    pub dev_id: u64,
}
pub type gixl_desc_t = gixl_desc_s;

// `gixl_desc_t` is read in place as the core's `Desc`: same size, order and alignment of its three words.
const _: () = {
    assert!(std::mem::size_of::<gixl_desc_t>() == std::mem::size_of::<Desc>());
    assert!(std::mem::align_of::<gixl_desc_t>() == std::mem::align_of::<Desc>());
    assert!(std::mem::offset_of!(gixl_desc_t, len) == std::mem::offset_of!(Desc, len));
    assert!(std::mem::offset_of!(gixl_desc_t, dev_id) == std::mem::offset_of!(Desc, dev));
};

/// `count` descriptors at `p`, read in place (NULL allowed when `count` is 0). A pointer that is not
/// aligned for `gixl_desc_t` is INVALID_PARAM.
pub(crate) fn descs_arg<'a>(p: *const gixl_desc_t, count: usize, name: &str) -> Result<&'a [Desc], Fail> {
    // `gixl_desc_t` and `Desc` have the same layout (checked above), and every bit pattern of three 64-bit
    // words is a valid `Desc`.
    super::boundary::slice_arg(p.cast::<Desc>(), count, name, "gixl_desc_t")
}

/// gixl: appends `count` descriptors in one call (`nixl_capi_xfer_dlist_add_desc` for each, without a
/// boundary crossing per descriptor). On failure the list is unchanged.
#[no_mangle]
pub extern "C" fn gixl_xfer_dlist_add_descs(
    dlist: nixl_capi_xfer_dlist_t,
    descs: *const gixl_desc_t,
    count: size_t,
) -> CapiStatus {
    ffi! {
        let d = get(dlist)?;
        let add = descs_arg(descs, count, "descs")?;
        let mut d = d.write();
        d.list.try_reserve(add.len()).map_err(|_| Fail::backend(format!("cannot grow a descriptor list by {count} entries")))?;
        d.list.extend_from_slice(add);
        OK
    }
}

/// Appends a descriptor. Zero-length and overlapping descriptors are accepted (the agent checks them).
#[no_mangle]
pub extern "C" fn nixl_capi_xfer_dlist_add_desc(
    dlist: nixl_capi_xfer_dlist_t,
    addr: usize,
    len: size_t,
    dev_id: u64,
) -> CapiStatus {
    ffi! {
        let d = get(dlist)?;
        d.write().list.push(Desc::new(addr as u64, len as u64, dev_id));
        OK
    }
}

#[no_mangle]
pub extern "C" fn nixl_capi_xfer_dlist_desc_count(dlist: nixl_capi_xfer_dlist_t, count: *mut size_t) -> CapiStatus {
    ffi! {
        nonnull(count);
        put(count, get(dlist)?.read().list.len());
        OK
    }
}

/// Deprecated alias of `nixl_capi_xfer_dlist_desc_count`.
#[no_mangle]
pub extern "C" fn nixl_capi_xfer_dlist_len(dlist: nixl_capi_xfer_dlist_t, len: *mut size_t) -> CapiStatus {
    ffi! {
        nonnull(len);
        put(len, get(dlist)?.read().list.len());
        OK
    }
}

#[no_mangle]
pub extern "C" fn nixl_capi_xfer_dlist_is_empty(dlist: nixl_capi_xfer_dlist_t, is_empty: *mut bool) -> CapiStatus {
    ffi! {
        nonnull(is_empty);
        put(is_empty, get(dlist)?.read().list.is_empty());
        OK
    }
}

/// A no-op, as in NIXL (whose trimmed copy is discarded); transfer descriptors have nothing to trim.
#[no_mangle]
pub extern "C" fn nixl_capi_xfer_dlist_trim(dlist: nixl_capi_xfer_dlist_t) -> CapiStatus {
    ffi! {
        get(dlist)?;
        OK
    }
}

/// Removes the descriptor at `index`; out of range (negative too) is ERROR_BACKEND, as NIXL.
#[no_mangle]
pub extern "C" fn nixl_capi_xfer_dlist_rem_desc(dlist: nixl_capi_xfer_dlist_t, index: std::ffi::c_int) -> CapiStatus {
    ffi! {
        get(dlist)?.write().rem_desc(index)
    }
}

/// Removes every descriptor; the memory type stays.
#[no_mangle]
pub extern "C" fn nixl_capi_xfer_dlist_clear(dlist: nixl_capi_xfer_dlist_t) -> CapiStatus {
    ffi! {
        get(dlist)?.write().list.clear();
        OK
    }
}

/// Resizes to `new_size` descriptors, adding empty ones (address 0, length 0, device 0).
#[no_mangle]
pub extern "C" fn nixl_capi_xfer_dlist_resize(dlist: nixl_capi_xfer_dlist_t, new_size: size_t) -> CapiStatus {
    ffi! {
        get(dlist)?.write().resize(new_size)
    }
}

/// Prints the list to the C library's `stdout`.
#[no_mangle]
pub extern "C" fn nixl_capi_xfer_dlist_print(dlist: nixl_capi_xfer_dlist_t) -> CapiStatus {
    ffi! {
        let d = get(dlist)?;
        let d = d.read();
        let mut s = d.header("xfer");
        for (i, x) in d.list.iter().enumerate() {
            let _ = writeln!(s, "  [{i}] addr {:#x} len {} dev {}", x.addr, x.len, x.dev);
        }
        print_c_stdout(&s);
        OK
    }
}

#[cfg(test)]
mod tests {
    use super::super::nixl_capi_status_t::*;
    use super::*;

    fn count(d: nixl_capi_xfer_dlist_t) -> usize {
        let mut n = usize::MAX;
        assert_eq!(nixl_capi_xfer_dlist_desc_count(d, &mut n), NIXL_CAPI_SUCCESS);
        n
    }

    #[test]
    fn list_operations_and_nixl_quirks() {
        let mut d = std::ptr::null_mut();
        assert_eq!(nixl_capi_create_xfer_dlist(0, &mut d), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_xfer_dlist_rem_desc(d, 0), NIXL_CAPI_ERROR_BACKEND);
        for i in 0..3 {
            assert_eq!(nixl_capi_xfer_dlist_add_desc(d, 0x1000 * (i + 1), 16, 0), NIXL_CAPI_SUCCESS);
        }
        assert_eq!(count(d), 3);
        assert_eq!(nixl_capi_xfer_dlist_rem_desc(d, -1), NIXL_CAPI_ERROR_BACKEND);
        assert_eq!(nixl_capi_xfer_dlist_rem_desc(d, 3), NIXL_CAPI_ERROR_BACKEND);
        assert_eq!(nixl_capi_xfer_dlist_rem_desc(d, 1), NIXL_CAPI_SUCCESS);
        assert_eq!(count(d), 2);
        assert_eq!(nixl_capi_xfer_dlist_trim(d), NIXL_CAPI_SUCCESS);
        assert_eq!(count(d), 2);
        assert_eq!(nixl_capi_xfer_dlist_resize(d, 5), NIXL_CAPI_SUCCESS);
        assert_eq!(count(d), 5);
        assert_eq!(nixl_capi_xfer_dlist_resize(d, usize::MAX), NIXL_CAPI_ERROR_BACKEND);
        assert_eq!(count(d), 5);
        assert_eq!(nixl_capi_xfer_dlist_clear(d), NIXL_CAPI_SUCCESS);
        let mut empty = false;
        assert_eq!(nixl_capi_xfer_dlist_is_empty(d, &mut empty), NIXL_CAPI_SUCCESS);
        assert!(empty);
        assert_eq!(nixl_capi_destroy_xfer_dlist(d), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_destroy_xfer_dlist(d), NIXL_CAPI_ERROR_INVALID_PARAM);
        assert_eq!(nixl_capi_xfer_dlist_add_desc(d, 1, 1, 0), NIXL_CAPI_ERROR_INVALID_PARAM);

        // Any memory type value is kept as given, as NIXL does.
        assert_eq!(nixl_capi_create_xfer_dlist(7, &mut d), NIXL_CAPI_SUCCESS);
        let mut t = 0;
        assert_eq!(nixl_capi_xfer_dlist_get_type(d, &mut t), NIXL_CAPI_SUCCESS);
        assert_eq!(t, 7);
        assert!(for_agent(&get(d).unwrap().read()).is_err());
        assert_eq!(nixl_capi_destroy_xfer_dlist(d), NIXL_CAPI_SUCCESS);
    }
}
