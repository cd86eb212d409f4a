//! The one FFI boundary: every `extern "C"` body runs inside [`ffi!`], which catches panics, turns a
//! [`Fail`] into its C status, and records a per-thread message for `gixl_last_error()`.
//!
//! Also the small pointer helpers the bodies use (NULL checks, C strings in, byte slices in, outputs out).
//! They are the only places in the C layer that dereference caller memory. Handles are never dereferenced:
//! see `registry`.

use std::cell::RefCell;
use std::ffi::{c_char, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use super::{map_status, nixl_capi_status_t};
use crate::status::{Error, Status};

/// Wraps the body of an `extern "C"` function. The body evaluates to `Result<nixl_capi_status_t, Fail>`
/// (it may `return` early and use `?`). Optional leading `nonnull(a, b, ...);` checks raw pointers first
/// and answers `NIXL_CAPI_ERROR_INVALID_PARAM` naming the first NULL one.
///
/// Only the body is wrapped, so cbindgen sees each function's signature as written.
macro_rules! ffi {
    (nonnull($($p:ident),+ $(,)?); $($body:tt)*) => {
        $crate::capi::boundary::enter(
            {
                fn here() {}
                here
            },
            || -> ::core::result::Result<$crate::capi::nixl_capi_status_t, $crate::capi::boundary::Fail> {
                $( $crate::capi::boundary::nonnull($p, stringify!($p))?; )+
                $($body)*
            },
        )
    };
    ($($body:tt)*) => {
        $crate::capi::boundary::enter(
            {
                fn here() {}
                here
            },
            || -> ::core::result::Result<$crate::capi::nixl_capi_status_t, $crate::capi::boundary::Fail> { $($body)* },
        )
    };
}
pub(crate) use ffi;

/// A failed C call: the C status it returns, NIXL's `nixl_status_t` behind it, and a message.
#[derive(Debug)]
pub(crate) struct Fail {
    pub code: nixl_capi_status_t,
    /// NIXL's own status number (`nixl_status_t`), kept for `gixl_last_nixl_status()`.
    pub nixl: i32,
    pub msg: String,
}

impl Fail {
    pub fn invalid(msg: impl Into<String>) -> Fail {
        Fail {
            code: nixl_capi_status_t::NIXL_CAPI_ERROR_INVALID_PARAM,
            nixl: Status::InvalidParam as i32,
            msg: msg.into(),
        }
    }

    /// What NIXL reports as a caught C++ exception (or an unmapped failure): `NIXL_CAPI_ERROR_BACKEND`.
    pub fn backend(msg: impl Into<String>) -> Fail {
        Fail { code: nixl_capi_status_t::NIXL_CAPI_ERROR_BACKEND, nixl: Status::Backend as i32, msg: msg.into() }
    }

    pub fn with_code(code: nixl_capi_status_t, nixl: Status, msg: impl Into<String>) -> Fail {
        Fail { code, nixl: nixl as i32, msg: msg.into() }
    }

    /// For the functions NIXL answers with `ERROR_BACKEND` whatever went wrong (create_backend,
    /// create_xfer_req, ...): keep the real status in the message and in `gixl_last_nixl_status()`.
    pub fn any_as_backend(self) -> Fail {
        Fail { code: nixl_capi_status_t::NIXL_CAPI_ERROR_BACKEND, ..self }
    }
}

impl From<Error> for Fail {
    fn from(e: Error) -> Fail {
        Fail { code: map_status(e.status()), nixl: e.status() as i32, msg: e.to_string() }
    }
}

/// A core result that is `Success` or `InProg` as a C status; errors become a `Fail`.
pub(crate) fn status_of(r: crate::Result<Status>) -> Result<nixl_capi_status_t, Fail> {
    match r {
        Ok(s) => Ok(map_status(s)),
        Err(e) => Err(e.into()),
    }
}

pub(crate) const OK: Result<nixl_capi_status_t, Fail> = Ok(nixl_capi_status_t::NIXL_CAPI_SUCCESS);

thread_local! {
    static LAST: RefCell<Last> = const { RefCell::new(Last { msg: None, nixl: 0 }) };
}

struct Last {
    msg: Option<CString>,
    nixl: i32,
}

/// Runs one C call's body: panics become `NIXL_CAPI_ERROR_BACKEND` (as NIXL reports a C++ exception),
/// failures record their message for this thread. `here` only names the function in messages.
pub(crate) fn enter<F, H>(_here: H, body: F) -> nixl_capi_status_t
where
    F: FnOnce() -> Result<nixl_capi_status_t, Fail>,
{
    let fail = match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(code)) => return code,
        Ok(Err(f)) => f,
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_owned());
            Fail::backend(format!("internal error (panic): {what}"))
        }
    };
    record(fn_name::<H>(), &fail);
    fail.code
}

/// "gixl::capi::xfer_req::nixl_capi_post_xfer_req::here" → "nixl_capi_post_xfer_req".
fn fn_name<H>() -> &'static str {
    let full = std::any::type_name::<H>();
    let trimmed = full.strip_suffix("::here").unwrap_or(full);
    trimmed.rsplit("::").next().unwrap_or(trimmed)
}

fn record(func: &str, f: &Fail) {
    let text = format!("{func}: {}", f.msg);
    // A message with an interior NUL is cut there rather than lost.
    let c = CString::new(text).unwrap_or_else(|e| {
        let n = e.nul_position();
        let mut v = e.into_vec();
        v.truncate(n);
        CString::new(v).unwrap_or_default()
    });
    // `try_with`: during thread teardown the slot may be gone; the status is still returned.
    let _ = LAST.try_with(|l| {
        let mut l = l.borrow_mut();
        l.msg = Some(c);
        l.nixl = f.nixl;
    });
}

/// The message of the last failed call on this thread, or "" (a static string) if none.
pub(crate) fn last_error_ptr() -> *const c_char {
    LAST.try_with(|l| l.borrow().msg.as_ref().map(|m| m.as_ptr())).ok().flatten().unwrap_or(c"".as_ptr())
}

pub(crate) fn last_nixl_status() -> i32 {
    LAST.try_with(|l| l.borrow().nixl).unwrap_or(0)
}

/// Forget this thread's last error (tests).
#[cfg(test)]
pub(crate) fn clear_last_error() {
    let _ = LAST.try_with(|l| *l.borrow_mut() = Last { msg: None, nixl: 0 });
}

// ----- pointer helpers -----

/// Anything a NULL check applies to.
pub(crate) trait RawPtr {
    fn is_null_ptr(&self) -> bool;
}
impl<T: ?Sized> RawPtr for *const T {
    fn is_null_ptr(&self) -> bool {
        self.is_null()
    }
}
impl<T: ?Sized> RawPtr for *mut T {
    fn is_null_ptr(&self) -> bool {
        self.is_null()
    }
}

pub(crate) fn nonnull<P: RawPtr>(p: P, name: &str) -> Result<(), Fail> {
    if p.is_null_ptr() {
        Err(Fail::invalid(format!("{name} is NULL")))
    } else {
        Ok(())
    }
}

/// A NUL-terminated, UTF-8 string argument.
pub(crate) fn str_arg<'a>(p: *const c_char, name: &str) -> Result<&'a str, Fail> {
    nonnull(p, name)?;
    // SAFETY: not NULL; the C caller passes a NUL-terminated string that outlives this call.
    let c = unsafe { CStr::from_ptr(p) };
    c.to_str().map_err(|_| Fail::invalid(format!("{name} is not valid UTF-8")))
}

/// `(data, len)` as bytes. `data` may be NULL only when `len` is 0.
pub(crate) fn bytes_arg<'a>(data: *const c_void, len: usize, name: &str) -> Result<&'a [u8], Fail> {
    if len == 0 {
        return Ok(&[]);
    }
    nonnull(data, name)?;
    if len > isize::MAX as usize {
        return Err(Fail::invalid(format!("{name}: length {len} is too large")));
    }
    // SAFETY: not NULL, and the caller promises `len` readable bytes at `data` for the duration of the call.
    Ok(unsafe { std::slice::from_raw_parts(data.cast::<u8>(), len) })
}

/// `count` values of `T` (called `ty` in errors) at `p`, read in place (NULL allowed when `count` is 0); a
/// pointer not aligned for `T` is INVALID_PARAM. `T` must be valid for any bit pattern (plain integers, C
/// structs of them and of pointers that are only read).
pub(crate) fn slice_arg<'a, T>(p: *const T, count: usize, name: &str, ty: &str) -> Result<&'a [T], Fail> {
    if count == 0 {
        return Ok(&[]);
    }
    nonnull(p, name)?;
    if count > isize::MAX as usize / std::mem::size_of::<T>().max(1) {
        return Err(Fail::invalid(format!("{name}: count {count} is too large")));
    }
    if !p.is_aligned() {
        return Err(Fail::invalid(format!("{name}: {p:p} is not aligned for {ty}")));
    }
    // SAFETY: not NULL, aligned, and the caller promises `count` readable values at `p` for the duration of
    // the call; every bit pattern is a valid `T` (see above).
    Ok(unsafe { std::slice::from_raw_parts(p, count) })
}

/// `count` C ints at `p` (NULL allowed when `count` is 0).
pub(crate) fn ints_arg<'a>(p: *const std::ffi::c_int, count: usize, name: &str) -> Result<&'a [std::ffi::c_int], Fail> {
    slice_arg(p, count, name, "int")
}

/// Write an output the caller asked for. Callers check `p` with `nonnull` before doing any work, so
/// outputs are written only once the call has succeeded.
pub(crate) fn put<T>(p: *mut T, v: T) {
    debug_assert!(!p.is_null());
    // SAFETY: `p` was checked non-NULL by the caller of this helper and points to writable storage for a
    // `T` (the C signature says so); unaligned writes are allowed so a packed caller struct is no UB here.
    unsafe { p.write_unaligned(v) }
}

/// A `malloc`'d copy of `bytes` that the C caller releases with `free()`. Empty input gives NULL.
pub(crate) fn malloc_copy(bytes: &[u8]) -> Result<*mut c_void, Fail> {
    if bytes.is_empty() {
        return Ok(std::ptr::null_mut());
    }
    // SAFETY: plain allocation of a non-zero size; the result is checked for NULL below.
    let p = unsafe { libc::malloc(bytes.len()) };
    if p.is_null() {
        return Err(Fail::backend(format!("out of memory copying {} bytes", bytes.len())));
    }
    // SAFETY: `p` has room for `bytes.len()` bytes and cannot overlap `bytes`.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), p.cast::<u8>(), bytes.len()) };
    Ok(p)
}

/// A `malloc`'d NUL-terminated copy of `s` (what `strdup` gives), cut at an interior NUL if any.
pub(crate) fn malloc_cstr(s: &str) -> Result<*mut c_char, Fail> {
    let b = s.as_bytes();
    let b = &b[..b.iter().position(|&c| c == 0).unwrap_or(b.len())];
    // SAFETY: allocation of len + 1 bytes, checked for NULL below.
    let p = unsafe { libc::malloc(b.len() + 1) }.cast::<u8>();
    if p.is_null() {
        return Err(Fail::backend("out of memory copying a string"));
    }
    // SAFETY: `p` has room for b.len() + 1 bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(b.as_ptr(), p, b.len());
        *p.add(b.len()) = 0;
    }
    Ok(p.cast())
}

/// A C string for output that we keep alive, cut at an interior NUL rather than refused.
pub(crate) fn cstring_lossy(s: &str) -> CString {
    let b = s.as_bytes();
    let b = &b[..b.iter().position(|&c| c == 0).unwrap_or(b.len())];
    CString::new(b).unwrap_or_default()
}

/// Prints to C's `stdout`, so the text interleaves correctly with the caller's own `printf` output.
pub(crate) fn print_c_stdout(text: &str) {
    extern "C" {
        static mut stdout: *mut libc::FILE;
    }
    // SAFETY: `stdout` is the C library's standard output stream, always initialised; fwrite is given a
    // valid buffer and length. Reading the static pointer by value does not create a reference.
    unsafe {
        let out = std::ptr::addr_of!(stdout).read();
        if !out.is_null() {
            libc::fwrite(text.as_ptr().cast(), 1, text.len(), out);
        }
    }
}
