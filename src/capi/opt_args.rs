//! `nixl_capi_opt_args_t`: NIXL's optional arguments (backend hints, notification, descriptor merging,
//! the P2P metadata peer address, a backend-defined custom parameter), and how calls read them.
//!
//! Notification rule (as NIXL): only `has_notif` asks for a notification; the message alone does not.
//! A NULL `opt_args` on `post_xfer_req` keeps the request's notification; non-NULL options without
//! `has_notif` clear it.

use libc::size_t;
use std::ffi::{c_char, c_void};

use parking_lot::RwLock;

use super::agent::AgentObj;
use super::backend::{nixl_capi_backend_t, BackendObj, BACKENDS};
use super::boundary::{bytes_arg, ffi, malloc_copy, put, str_arg, Fail, OK};
use super::registry::Registry;
use super::{nixl_capi_status_t, CapiStatus};
use crate::agent::{BackendId, NotifUpdate, XferOpts};

/// Opaque optional arguments (`struct nixl_capi_opt_args_s`).
pub struct nixl_capi_opt_args_s {
    _opaque: [u8; 0],
}
pub type nixl_capi_opt_args_t = *mut nixl_capi_opt_args_s;

#[derive(Debug, Clone)]
pub(crate) struct OptArgs {
    /// In the order added; duplicates kept, as NIXL (query_mem counts them).
    pub backends: Vec<BackendObj>,
    pub notif_msg: Vec<u8>,
    pub has_notif: bool,
    pub skip_desc_merge: bool,
    pub ip_addr: String,
    pub port: u16,
    pub custom_param: Vec<u8>,
}

impl Default for OptArgs {
    fn default() -> Self {
        OptArgs {
            backends: Vec::new(),
            notif_msg: Vec::new(),
            has_notif: false,
            skip_desc_merge: false,
            ip_addr: String::new(),
            // NIXL's `nixl_opt_args_t::port` defaults to the listener's default port.
            port: crate::DEFAULT_COMM_PORT,
            custom_param: Vec::new(),
        }
    }
}

pub(crate) struct OptArgsObj(RwLock<OptArgs>);

static OPT_ARGS: Registry<OptArgsObj> = Registry::new("opt args");

impl OptArgs {
    fn hints(&self, a: &AgentObj) -> Result<Vec<BackendId>, Fail> {
        self.backends.iter().map(|b| b.id_in(a)).collect()
    }

    fn notif(&self) -> Option<Vec<u8>> {
        self.has_notif.then(|| self.notif_msg.clone())
    }
}

/// Run `f` on the options behind `opt`, or on `None` for a NULL `opt`.
fn with<R>(opt: nixl_capi_opt_args_t, f: impl FnOnce(Option<&OptArgs>) -> Result<R, Fail>) -> Result<R, Fail> {
    if opt.is_null() {
        return f(None);
    }
    let o = OPT_ARGS.get(opt, "opt_args")?;
    let g = o.0.read();
    f(Some(&g))
}

/// The backend hints for `a` (empty for NULL options). A backend of another agent is INVALID_PARAM.
pub(crate) fn hints(opt: nixl_capi_opt_args_t, a: &AgentObj) -> Result<Vec<BackendId>, Fail> {
    with(opt, |o| o.map_or(Ok(Vec::new()), |o| o.hints(a)))
}

/// The metadata peer: (`ip_addr`, `port`); ("", 8888) for NULL options, where "" means the metadata store.
pub(crate) fn md_peer(opt: nixl_capi_opt_args_t) -> Result<(String, u16), Fail> {
    with(opt, |o| Ok(o.map_or((String::new(), crate::DEFAULT_COMM_PORT), |o| (o.ip_addr.clone(), o.port))))
}

/// Options for making a request.
pub(crate) fn xfer_opts(opt: nixl_capi_opt_args_t, a: &AgentObj) -> Result<XferOpts, Fail> {
    with(opt, |o| match o {
        None => Ok(XferOpts::default()),
        Some(o) => Ok(XferOpts { backends: o.hints(a)?, notif: o.notif(), skip_desc_merge: o.skip_desc_merge }),
    })
}

/// What a post does to the request's notification.
pub(crate) fn notif_update(opt: nixl_capi_opt_args_t) -> Result<NotifUpdate, Fail> {
    with(opt, |o| {
        Ok(match o.map(|o| o.notif()) {
            None => NotifUpdate::Keep,
            Some(None) => NotifUpdate::Clear,
            Some(Some(m)) => NotifUpdate::Set(m),
        })
    })
}

fn update(opt: nixl_capi_opt_args_t, f: impl FnOnce(&mut OptArgs)) -> Result<nixl_capi_status_t, Fail> {
    let o = OPT_ARGS.get(opt, "args")?;
    f(&mut o.0.write());
    OK
}

fn read<R>(opt: nixl_capi_opt_args_t, f: impl FnOnce(&OptArgs) -> R) -> Result<R, Fail> {
    let o = OPT_ARGS.get(opt, "args")?;
    let g = o.0.read();
    Ok(f(&g))
}

#[no_mangle]
pub extern "C" fn nixl_capi_create_opt_args(args: *mut nixl_capi_opt_args_t) -> CapiStatus {
    ffi! {
        nonnull(args);
        put(args, OPT_ARGS.insert(OptArgsObj(RwLock::new(OptArgs::default()))));
        OK
    }
}

#[no_mangle]
pub extern "C" fn nixl_capi_destroy_opt_args(args: nixl_capi_opt_args_t) -> CapiStatus {
    ffi! {
        OPT_ARGS.remove(args, "args")?;
        OK
    }
}

/// Adds a backend hint. The hint outlives the backend handle (it may be destroyed afterwards); it is
/// accepted only by the agent that owns the backend.
#[no_mangle]
pub extern "C" fn nixl_capi_opt_args_add_backend(
    args: nixl_capi_opt_args_t,
    backend: nixl_capi_backend_t,
) -> CapiStatus {
    ffi! {
        let b = *BACKENDS.get(backend, "backend")?;
        update(args, |o| o.backends.push(b))
    }
}

/// Sets the notification message (copied). `(NULL, 0)` clears it; NULL with `len > 0` is INVALID_PARAM.
/// The message is sent only if `has_notif` is set.
#[no_mangle]
pub extern "C" fn nixl_capi_opt_args_set_notif_msg(
    args: nixl_capi_opt_args_t,
    data: *const c_void,
    len: size_t,
) -> CapiStatus {
    ffi! {
        let msg = bytes_arg(data, len, "data")?.to_vec();
        update(args, |o| o.notif_msg = msg)
    }
}

/// A `malloc`'d copy of the message (caller `free()`s); an empty message gives NULL and 0.
#[no_mangle]
pub extern "C" fn nixl_capi_opt_args_get_notif_msg(
    args: nixl_capi_opt_args_t,
    data: *mut *mut c_void,
    len: *mut size_t,
) -> CapiStatus {
    ffi! {
        nonnull(data, len);
        let msg = read(args, |o| o.notif_msg.clone())?;
        put(data, malloc_copy(&msg)?);
        put(len, msg.len());
        OK
    }
}

/// Sets the backend-defined custom parameter (copied); `data` may be NULL only when `len` is 0.
#[no_mangle]
pub extern "C" fn nixl_capi_opt_args_set_custom_param(
    args: nixl_capi_opt_args_t,
    data: *const c_void,
    len: size_t,
) -> CapiStatus {
    ffi! {
        let p = bytes_arg(data, len, "data")?.to_vec();
        update(args, |o| o.custom_param = p)
    }
}

/// A `malloc`'d copy of the custom parameter (caller `free()`s); unset gives NULL and 0.
#[no_mangle]
pub extern "C" fn nixl_capi_opt_args_get_custom_param(
    args: nixl_capi_opt_args_t,
    data: *mut *mut c_void,
    len: *mut size_t,
) -> CapiStatus {
    ffi! {
        nonnull(data, len);
        let p = read(args, |o| o.custom_param.clone())?;
        put(data, malloc_copy(&p)?);
        put(len, p.len());
        OK
    }
}

/// Asks for a notification (with the message set, possibly empty).
#[no_mangle]
pub extern "C" fn nixl_capi_opt_args_set_has_notif(args: nixl_capi_opt_args_t, has_notif: bool) -> CapiStatus {
    ffi! {
        update(args, |o| o.has_notif = has_notif)
    }
}

#[no_mangle]
pub extern "C" fn nixl_capi_opt_args_get_has_notif(args: nixl_capi_opt_args_t, has_notif: *mut bool) -> CapiStatus {
    ffi! {
        nonnull(has_notif);
        put(has_notif, read(args, |o| o.has_notif)?);
        OK
    }
}

#[no_mangle]
pub extern "C" fn nixl_capi_opt_args_set_skip_desc_merge(args: nixl_capi_opt_args_t, skip_merge: bool) -> CapiStatus {
    ffi! {
        update(args, |o| o.skip_desc_merge = skip_merge)
    }
}

#[no_mangle]
pub extern "C" fn nixl_capi_opt_args_get_skip_desc_merge(
    args: nixl_capi_opt_args_t,
    skip_merge: *mut bool,
) -> CapiStatus {
    ffi! {
        nonnull(skip_merge);
        put(skip_merge, read(args, |o| o.skip_desc_merge)?);
        OK
    }
}

/// Address of the P2P metadata peer ("" clears it).
#[no_mangle]
pub extern "C" fn nixl_capi_opt_args_set_ip_addr(args: nixl_capi_opt_args_t, ip_addr: *const c_char) -> CapiStatus {
    ffi! {
        let ip = str_arg(ip_addr, "ip_addr")?.to_owned();
        update(args, |o| o.ip_addr = ip)
    }
}

#[no_mangle]
pub extern "C" fn nixl_capi_opt_args_set_port(args: nixl_capi_opt_args_t, port: u16) -> CapiStatus {
    ffi! {
        update(args, |o| o.port = port)
    }
}

#[cfg(test)]
mod tests {
    use super::super::nixl_capi_status_t::*;
    use super::*;

    fn take(data: *mut c_void, len: usize) -> Vec<u8> {
        if data.is_null() {
            return vec![];
        }
        // SAFETY: the library malloc'd `len` bytes at `data` for us to free.
        let v = unsafe { std::slice::from_raw_parts(data.cast::<u8>(), len) }.to_vec();
        // SAFETY: allocated with malloc.
        unsafe { libc::free(data) };
        v
    }

    #[test]
    fn notif_rules() {
        let mut o = std::ptr::null_mut();
        assert_eq!(nixl_capi_create_opt_args(&mut o), NIXL_CAPI_SUCCESS);
        assert_eq!(notif_update(std::ptr::null_mut()).unwrap(), NotifUpdate::Keep);
        assert_eq!(notif_update(o).unwrap(), NotifUpdate::Clear);
        assert_eq!(nixl_capi_opt_args_set_notif_msg(o, b"n\0tif".as_ptr().cast(), 5), NIXL_CAPI_SUCCESS);
        // The message alone does not ask for a notification.
        assert_eq!(notif_update(o).unwrap(), NotifUpdate::Clear);
        assert_eq!(nixl_capi_opt_args_set_has_notif(o, true), NIXL_CAPI_SUCCESS);
        assert_eq!(notif_update(o).unwrap(), NotifUpdate::Set(b"n\0tif".to_vec()));
        assert_eq!(nixl_capi_opt_args_set_notif_msg(o, std::ptr::null(), 3), NIXL_CAPI_ERROR_INVALID_PARAM);
        let (mut d, mut n) = (std::ptr::null_mut(), 0);
        assert_eq!(nixl_capi_opt_args_get_notif_msg(o, &mut d, &mut n), NIXL_CAPI_SUCCESS);
        assert_eq!(take(d, n), b"n\0tif");
        assert_eq!(nixl_capi_opt_args_set_notif_msg(o, std::ptr::null(), 0), NIXL_CAPI_SUCCESS);
        assert_eq!(notif_update(o).unwrap(), NotifUpdate::Set(vec![]));
        assert_eq!(nixl_capi_opt_args_get_notif_msg(o, &mut d, &mut n), NIXL_CAPI_SUCCESS);
        assert!(d.is_null() && n == 0);

        assert_eq!(nixl_capi_opt_args_set_custom_param(o, [0u8, 1, 255].as_ptr().cast(), 3), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_opt_args_get_custom_param(o, &mut d, &mut n), NIXL_CAPI_SUCCESS);
        assert_eq!(take(d, n), [0, 1, 255]);
        assert_eq!(nixl_capi_opt_args_set_ip_addr(o, std::ptr::null()), NIXL_CAPI_ERROR_INVALID_PARAM);
        assert_eq!(nixl_capi_opt_args_set_ip_addr(o, c"10.0.0.1".as_ptr()), NIXL_CAPI_SUCCESS);
        assert_eq!(md_peer(o).unwrap(), ("10.0.0.1".to_string(), crate::DEFAULT_COMM_PORT));
        assert_eq!(nixl_capi_opt_args_set_port(o, 1234), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_opt_args_set_ip_addr(o, c"".as_ptr()), NIXL_CAPI_SUCCESS);
        assert_eq!(md_peer(o).unwrap(), (String::new(), 1234));
        assert_eq!(md_peer(std::ptr::null_mut()).unwrap(), (String::new(), crate::DEFAULT_COMM_PORT));
        let mut flag = true;
        assert_eq!(nixl_capi_opt_args_get_skip_desc_merge(o, &mut flag), NIXL_CAPI_SUCCESS);
        assert!(!flag);
        assert_eq!(nixl_capi_destroy_opt_args(o), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_destroy_opt_args(o), NIXL_CAPI_ERROR_INVALID_PARAM);
        assert_eq!(nixl_capi_opt_args_set_has_notif(o, true), NIXL_CAPI_ERROR_INVALID_PARAM);
        assert!(notif_update(o).is_err());
    }
}
