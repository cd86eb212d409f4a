//! `nixl_capi_mem_list_t`: the memory types of a plugin or backend, and memory-type names.

use libc::size_t;
use std::ffi::c_char;

use super::boundary::{ffi, put, Fail, OK};
use super::registry::Registry;
use super::{CapiStatus, MemTypeRaw};
use crate::mem::MemType;

/// Opaque list of memory types (`struct nixl_capi_mem_list_s`).
pub struct nixl_capi_mem_list_s {
    _opaque: [u8; 0],
}
pub type nixl_capi_mem_list_t = *mut nixl_capi_mem_list_s;

pub(crate) struct MemListObj(pub Vec<MemType>);

pub(crate) static MEM_LISTS: Registry<MemListObj> = Registry::new("memory type list");

#[no_mangle]
pub extern "C" fn nixl_capi_destroy_mem_list(list: nixl_capi_mem_list_t) -> CapiStatus {
    ffi! {
        MEM_LISTS.remove(list, "list")?;
        OK
    }
}

#[no_mangle]
pub extern "C" fn nixl_capi_mem_list_is_empty(list: nixl_capi_mem_list_t, is_empty: *mut bool) -> CapiStatus {
    ffi! {
        nonnull(is_empty);
        let l = MEM_LISTS.get(list, "list")?;
        put(is_empty, l.0.is_empty());
        OK
    }
}

#[no_mangle]
pub extern "C" fn nixl_capi_mem_list_size(list: nixl_capi_mem_list_t, size: *mut size_t) -> CapiStatus {
    ffi! {
        nonnull(size);
        let l = MEM_LISTS.get(list, "list")?;
        put(size, l.0.len());
        OK
    }
}

/// The memory type at `index`; out of range is INVALID_PARAM.
#[no_mangle]
pub extern "C" fn nixl_capi_mem_list_get(
    list: nixl_capi_mem_list_t,
    index: size_t,
    mem_type: *mut MemTypeRaw,
) -> CapiStatus {
    ffi! {
        nonnull(mem_type);
        let l = MEM_LISTS.get(list, "list")?;
        let m = l.0.get(index).ok_or_else(|| Fail::invalid(format!("index {index} out of range for {} memory types", l.0.len())))?;
        put(mem_type, *m as MemTypeRaw);
        OK
    }
}

/// "DRAM", "VRAM", "BLOCK", "OBJECT", "FILE" or "UNKNOWN" (static strings); other values are INVALID_PARAM.
#[no_mangle]
pub extern "C" fn nixl_capi_mem_type_to_string(mem_type: MemTypeRaw, str: *mut *const c_char) -> CapiStatus {
    ffi! {
        nonnull(str);
        let s = match mem_type {
            0 => c"DRAM",
            1 => c"VRAM",
            2 => c"BLOCK",
            3 => c"OBJECT",
            4 => c"FILE",
            5 => c"UNKNOWN",
            _ => return Err(Fail::invalid(format!("unknown memory type {mem_type}"))),
        };
        put(str, s.as_ptr());
        OK
    }
}

#[cfg(test)]
mod tests {
    use std::ffi::CStr;

    use super::super::nixl_capi_status_t::*;
    use super::*;

    #[test]
    fn names_and_ranges() {
        let mut s = std::ptr::null();
        for (v, want) in [(0, "DRAM"), (3, "OBJECT"), (5, "UNKNOWN")] {
            assert_eq!(nixl_capi_mem_type_to_string(v, &mut s), NIXL_CAPI_SUCCESS);
            // SAFETY: static C string.
            assert_eq!(unsafe { CStr::from_ptr(s) }.to_str().unwrap(), want);
        }
        assert_eq!(nixl_capi_mem_type_to_string(6, &mut s), NIXL_CAPI_ERROR_INVALID_PARAM);
        assert_eq!(nixl_capi_mem_type_to_string(-1, &mut s), NIXL_CAPI_ERROR_INVALID_PARAM);
        assert_eq!(nixl_capi_mem_type_to_string(0, std::ptr::null_mut()), NIXL_CAPI_ERROR_INVALID_PARAM);

        let l: nixl_capi_mem_list_t = MEM_LISTS.insert(MemListObj(vec![MemType::Dram, MemType::File]));
        let (mut n, mut m) = (0, -1);
        assert_eq!(nixl_capi_mem_list_size(l, &mut n), NIXL_CAPI_SUCCESS);
        assert_eq!(n, 2);
        assert_eq!(nixl_capi_mem_list_get(l, 1, &mut m), NIXL_CAPI_SUCCESS);
        assert_eq!(m, 4);
        assert_eq!(nixl_capi_mem_list_get(l, 2, &mut m), NIXL_CAPI_ERROR_INVALID_PARAM);
        assert_eq!(nixl_capi_destroy_mem_list(l), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_mem_list_size(l, &mut n), NIXL_CAPI_ERROR_INVALID_PARAM);
    }
}
