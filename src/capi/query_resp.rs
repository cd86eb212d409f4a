//! `nixl_capi_query_resp_list_t`: answers of `nixl_capi_query_mem`, one per descriptor, each either
//! options (e.g. a file's size) or nothing.

use libc::size_t;
use parking_lot::RwLock;

use super::boundary::{ffi, put, Fail, OK};
use super::params::{nixl_capi_params_t, ParamsObj, PARAMS};
use super::registry::Registry;
use super::CapiStatus;
use crate::backend::Params;

/// Opaque list of query answers (`struct nixl_capi_query_resp_list_s`).
pub struct nixl_capi_query_resp_list_s {
    _opaque: [u8; 0],
}
pub type nixl_capi_query_resp_list_t = *mut nixl_capi_query_resp_list_s;

pub(crate) struct QueryRespObj(pub RwLock<Vec<Option<Params>>>);

pub(crate) static QUERY_RESPS: Registry<QueryRespObj> = Registry::new("query response list");

fn get(l: nixl_capi_query_resp_list_t) -> Result<std::sync::Arc<QueryRespObj>, Fail> {
    QUERY_RESPS.get(l, "list")
}

fn out_of_range(index: usize, n: usize) -> Fail {
    Fail::invalid(format!("index {index} out of range for {n} responses"))
}

#[no_mangle]
pub extern "C" fn nixl_capi_create_query_resp_list(list: *mut nixl_capi_query_resp_list_t) -> CapiStatus {
    ffi! {
        nonnull(list);
        put(list, QUERY_RESPS.insert(QueryRespObj(RwLock::new(Vec::new()))));
        OK
    }
}

#[no_mangle]
pub extern "C" fn nixl_capi_destroy_query_resp_list(list: nixl_capi_query_resp_list_t) -> CapiStatus {
    ffi! {
        QUERY_RESPS.remove(list, "list")?;
        OK
    }
}

#[no_mangle]
pub extern "C" fn nixl_capi_query_resp_list_size(list: nixl_capi_query_resp_list_t, size: *mut size_t) -> CapiStatus {
    ffi! {
        nonnull(size);
        put(size, get(list)?.0.read().len());
        OK
    }
}

#[no_mangle]
pub extern "C" fn nixl_capi_query_resp_list_has_value(
    list: nixl_capi_query_resp_list_t,
    index: size_t,
    has_value: *mut bool,
) -> CapiStatus {
    ffi! {
        nonnull(has_value);
        let l = get(list)?;
        let l = l.0.read();
        let r = l.get(index).ok_or_else(|| out_of_range(index, l.len()))?;
        put(has_value, r.is_some());
        OK
    }
}

/// A new params handle (caller destroys it) with answer `index`; an empty answer is INVALID_PARAM.
#[no_mangle]
pub extern "C" fn nixl_capi_query_resp_list_get_params(
    list: nixl_capi_query_resp_list_t,
    index: size_t,
    params: *mut nixl_capi_params_t,
) -> CapiStatus {
    ffi! {
        nonnull(params);
        let l = get(list)?;
        let l = l.0.read();
        let r = l.get(index).ok_or_else(|| out_of_range(index, l.len()))?;
        let p = r.as_ref().ok_or_else(|| Fail::invalid(format!("response {index} has no value")))?;
        put(params, PARAMS.insert(ParamsObj::new(p.clone())));
        OK
    }
}

#[cfg(test)]
mod tests {
    use super::super::nixl_capi_status_t::*;
    use super::super::params::nixl_capi_destroy_params;
    use super::*;

    #[test]
    fn values_and_ranges() {
        let mut l = std::ptr::null_mut();
        assert_eq!(nixl_capi_create_query_resp_list(&mut l), NIXL_CAPI_SUCCESS);
        let (mut hv, mut p) = (false, std::ptr::null_mut());
        assert_eq!(nixl_capi_query_resp_list_has_value(l, 0, &mut hv), NIXL_CAPI_ERROR_INVALID_PARAM);
        *get(l).unwrap().0.write() = vec![None, Some([("size".to_owned(), "4".to_owned())].into_iter().collect())];
        assert_eq!(nixl_capi_query_resp_list_has_value(l, 0, &mut hv), NIXL_CAPI_SUCCESS);
        assert!(!hv);
        assert_eq!(nixl_capi_query_resp_list_get_params(l, 0, &mut p), NIXL_CAPI_ERROR_INVALID_PARAM);
        assert_eq!(nixl_capi_query_resp_list_get_params(l, 1, &mut p), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_destroy_params(p), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_destroy_query_resp_list(l), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_destroy_query_resp_list(l), NIXL_CAPI_ERROR_INVALID_PARAM);
    }
}
