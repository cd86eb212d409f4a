//! `nixl_capi_string_list_t`: a list of strings the library made (the available plugins).

use libc::size_t;
use std::ffi::{c_char, CString};

use super::boundary::{cstring_lossy, ffi, put, Fail, OK};
use super::registry::Registry;
use super::CapiStatus;

/// Opaque list of strings (`struct nixl_capi_string_list_s`).
pub struct nixl_capi_string_list_s {
    _opaque: [u8; 0],
}
pub type nixl_capi_string_list_t = *mut nixl_capi_string_list_s;

pub(crate) struct StringListObj(Vec<CString>);

impl StringListObj {
    pub fn new(v: Vec<String>) -> Self {
        StringListObj(v.iter().map(|s| cstring_lossy(s)).collect())
    }
}

pub(crate) static STRING_LISTS: Registry<StringListObj> = Registry::new("string list");

#[no_mangle]
pub extern "C" fn nixl_capi_destroy_string_list(list: nixl_capi_string_list_t) -> CapiStatus {
    ffi! {
        STRING_LISTS.remove(list, "list")?;
        OK
    }
}

#[no_mangle]
pub extern "C" fn nixl_capi_string_list_size(list: nixl_capi_string_list_t, size: *mut size_t) -> CapiStatus {
    ffi! {
        nonnull(size);
        let l = STRING_LISTS.get(list, "list")?;
        put(size, l.0.len());
        OK
    }
}

/// The string at `index`, valid until the list is destroyed. Out of range: INVALID_PARAM, `*str` untouched.
#[no_mangle]
pub extern "C" fn nixl_capi_string_list_get(
    list: nixl_capi_string_list_t,
    index: size_t,
    str: *mut *const c_char,
) -> CapiStatus {
    ffi! {
        nonnull(str);
        let l = STRING_LISTS.get(list, "list")?;
        let s = l.0.get(index).ok_or_else(|| Fail::invalid(format!("index {index} out of range for {} strings", l.0.len())))?;
        put(str, s.as_ptr());
        OK
    }
}
