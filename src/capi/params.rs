//! `nixl_capi_params_t` (string options: plugin and backend parameters, query answers) and
//! `nixl_capi_param_iter_t`.
//!
//! An iterator walks a snapshot taken when it was created, so the strings it hands out stay valid until
//! the iterator is destroyed (NIXL promises only until the next `iterator_next`), whatever happens to the
//! params meanwhile.

use std::ffi::{c_char, CString};

use parking_lot::{Mutex, RwLock};

use super::boundary::{cstring_lossy, ffi, put, str_arg, OK};
use super::registry::Registry;
use super::CapiStatus;
use crate::backend::Params;

/// Opaque key/value options (`struct nixl_capi_params_s`).
pub struct nixl_capi_params_s {
    _opaque: [u8; 0],
}
pub type nixl_capi_params_t = *mut nixl_capi_params_s;

/// Opaque iterator over params (`struct nixl_capi_param_iter_s`).
pub struct nixl_capi_param_iter_s {
    _opaque: [u8; 0],
}
pub type nixl_capi_param_iter_t = *mut nixl_capi_param_iter_s;

pub(crate) struct ParamsObj(pub RwLock<Params>);

impl ParamsObj {
    pub fn new(p: Params) -> Self {
        ParamsObj(RwLock::new(p))
    }
}

pub(crate) struct IterObj(Mutex<Iter>);

struct Iter {
    entries: Vec<(CString, CString)>,
    pos: usize,
}

pub(crate) static PARAMS: Registry<ParamsObj> = Registry::new("params");
static ITERS: Registry<IterObj> = Registry::new("params iterator");

#[no_mangle]
pub extern "C" fn nixl_capi_create_params(params: *mut nixl_capi_params_t) -> CapiStatus {
    ffi! {
        nonnull(params);
        put(params, PARAMS.insert(ParamsObj::new(Params::new())));
        OK
    }
}

#[no_mangle]
pub extern "C" fn nixl_capi_destroy_params(params: nixl_capi_params_t) -> CapiStatus {
    ffi! {
        PARAMS.remove(params, "params")?;
        OK
    }
}

/// Sets `key` to `value`, replacing an existing value.
#[no_mangle]
pub extern "C" fn nixl_capi_params_add(
    params: nixl_capi_params_t,
    key: *const c_char,
    value: *const c_char,
) -> CapiStatus {
    ffi! {
        let p = PARAMS.get(params, "params")?;
        let k = str_arg(key, "key")?;
        let v = str_arg(value, "value")?;
        p.0.write().insert(k.to_owned(), v.to_owned());
        OK
    }
}

#[no_mangle]
pub extern "C" fn nixl_capi_params_is_empty(params: nixl_capi_params_t, is_empty: *mut bool) -> CapiStatus {
    ffi! {
        nonnull(is_empty);
        let p = PARAMS.get(params, "params")?;
        put(is_empty, p.0.read().is_empty());
        OK
    }
}

/// An iterator over a snapshot of `params`, in key order.
#[no_mangle]
pub extern "C" fn nixl_capi_params_create_iterator(
    params: nixl_capi_params_t,
    iter: *mut nixl_capi_param_iter_t,
) -> CapiStatus {
    ffi! {
        nonnull(iter);
        let p = PARAMS.get(params, "params")?;
        let entries = p.0.read().iter().map(|(k, v)| (cstring_lossy(k), cstring_lossy(v))).collect();
        put(iter, ITERS.insert(IterObj(Mutex::new(Iter { entries, pos: 0 }))));
        OK
    }
}

/// Yields the next entry and whether another follows. An exhausted iterator answers SUCCESS with
/// `*has_next = false` and leaves `*key` and `*value` alone.
#[no_mangle]
pub extern "C" fn nixl_capi_params_iterator_next(
    iter: nixl_capi_param_iter_t,
    key: *mut *const c_char,
    value: *mut *const c_char,
    has_next: *mut bool,
) -> CapiStatus {
    ffi! {
        nonnull(key, value, has_next);
        let it = ITERS.get(iter, "iter")?;
        let mut it = it.0.lock();
        if let Some((k, v)) = it.entries.get(it.pos) {
            put(key, k.as_ptr());
            put(value, v.as_ptr());
            it.pos += 1;
        }
        put(has_next, it.pos < it.entries.len());
        OK
    }
}

#[no_mangle]
pub extern "C" fn nixl_capi_params_destroy_iterator(iter: nixl_capi_param_iter_t) -> CapiStatus {
    ffi! {
        ITERS.remove(iter, "iter")?;
        OK
    }
}

#[cfg(test)]
mod tests {
    use std::ffi::CStr;

    use super::super::nixl_capi_status_t::*;
    use super::*;

    fn s(p: *const c_char) -> String {
        // SAFETY: the library hands out NUL-terminated strings that live as long as the iterator.
        unsafe { CStr::from_ptr(p) }.to_str().unwrap().to_owned()
    }

    #[test]
    fn add_overwrite_iterate() {
        let mut p = std::ptr::null_mut();
        assert_eq!(nixl_capi_create_params(&mut p), NIXL_CAPI_SUCCESS);
        let mut empty = false;
        assert_eq!(nixl_capi_params_is_empty(p, &mut empty), NIXL_CAPI_SUCCESS);
        assert!(empty);
        assert_eq!(nixl_capi_params_add(p, c"b".as_ptr(), c"1".as_ptr()), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_params_add(p, c"a".as_ptr(), c"2".as_ptr()), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_params_add(p, c"b".as_ptr(), c"3".as_ptr()), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_params_add(p, c"k".as_ptr(), std::ptr::null()), NIXL_CAPI_ERROR_INVALID_PARAM);
        let mut it = std::ptr::null_mut();
        assert_eq!(nixl_capi_params_create_iterator(p, &mut it), NIXL_CAPI_SUCCESS);
        // Changing or destroying the params does not disturb the iterator.
        assert_eq!(nixl_capi_destroy_params(p), NIXL_CAPI_SUCCESS);
        let (mut k, mut v, mut more) = (std::ptr::null(), std::ptr::null(), false);
        let mut got = vec![];
        loop {
            assert_eq!(nixl_capi_params_iterator_next(it, &mut k, &mut v, &mut more), NIXL_CAPI_SUCCESS);
            got.push((s(k), s(v)));
            if !more {
                break;
            }
        }
        assert_eq!(got, vec![("a".into(), "2".into()), ("b".into(), "3".into())]);
        let before = k;
        assert_eq!(nixl_capi_params_iterator_next(it, &mut k, &mut v, &mut more), NIXL_CAPI_SUCCESS);
        assert!(!more && k == before);
        assert_eq!(nixl_capi_params_destroy_iterator(it), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_params_destroy_iterator(it), NIXL_CAPI_ERROR_INVALID_PARAM);
        assert_eq!(nixl_capi_params_iterator_next(it, &mut k, &mut v, &mut more), NIXL_CAPI_ERROR_INVALID_PARAM);
    }

    #[test]
    fn racing_destroys_succeed_once() {
        for _ in 0..50 {
            let mut p = std::ptr::null_mut();
            assert_eq!(nixl_capi_create_params(&mut p), NIXL_CAPI_SUCCESS);
            let h = p as usize;
            let wins: usize = std::thread::scope(|s| {
                let ts: Vec<_> = (0..4)
                    .map(|_| {
                        s.spawn(move || {
                            let p = h as nixl_capi_params_t;
                            let _ = nixl_capi_params_add(p, c"k".as_ptr(), c"v".as_ptr());
                            (nixl_capi_destroy_params(p) == NIXL_CAPI_SUCCESS) as usize
                        })
                    })
                    .collect();
                ts.into_iter().map(|t| t.join().unwrap()).sum()
            });
            assert_eq!(wins, 1);
        }
    }
}
