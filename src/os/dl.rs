//! Shared libraries opened at run time (`dlopen`), so that nothing links them: a hardware layer's library
//! (rdma-core's `libibverbs`, `libfabric`) is looked for when that layer is first used, and gixl loads where it
//! is absent. Opened once and never closed: their functions may be called until the process ends.

use std::ffi::{c_void, CStr, CString};

/// An opened library.
pub(crate) struct Dl {
    handle: *mut c_void,
    /// The path or name it was opened by.
    pub(crate) name: String,
}

/// The path in the environment variable `env` where set, else `default` from the system's library path; the
/// error names the package (`what`) and says why the loader refused.
pub(crate) fn open(env: &str, default: &str, what: &str) -> Result<Dl, String> {
    let name = std::env::var(env).ok().filter(|p| !p.is_empty()).unwrap_or_else(|| default.to_owned());
    let c = CString::new(name.clone()).map_err(|_| format!("{env}={name:?} holds a NUL byte"))?;
    // SAFETY: a NUL-terminated name; RTLD_LOCAL keeps its symbols out of the global namespace.
    let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns a NUL-terminated string or NULL.
        let why = unsafe { libc::dlerror() };
        // SAFETY: as above, not NULL.
        let why = if why.is_null() { String::new() } else { unsafe { CStr::from_ptr(why) }.to_string_lossy().into() };
        return Err(format!("{name} is not installed ({what}), or does not load: {why}"));
    }
    Ok(Dl { handle, name })
}

impl Dl {
    /// The address of the library's symbol `sym` (its default version), or why not.
    pub(crate) fn sym(&self, sym: &CStr) -> Result<*mut c_void, String> {
        // SAFETY: a live handle (never closed) and a NUL-terminated name.
        let p = unsafe { libc::dlsym(self.handle, sym.as_ptr()) };
        if p.is_null() {
            Err(format!("{} has no {}", self.name, sym.to_string_lossy()))
        } else {
            Ok(p)
        }
    }
}

/// A symbol's address as the function pointer type `F`.
///
/// # Safety
/// `p` is a function whose C signature `F` spells.
pub(crate) unsafe fn fn_ptr<F: Copy>(p: *mut c_void) -> F {
    const { assert!(std::mem::size_of::<F>() == std::mem::size_of::<*mut c_void>()) };
    // SAFETY: same size (checked above); the caller vouches for the signature.
    unsafe { std::mem::transmute_copy(&p) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_library_that_is_not_there_says_so_and_a_missing_symbol_is_named() {
        let e = open("GIXL_TEST_DL_UNSET_VARIABLE", "libgixl-no-such-library.so.9", "nothing").err().unwrap();
        assert!(e.starts_with("libgixl-no-such-library.so.9 is not installed (nothing), or does not load: "), "{e}");
        let libc = open("GIXL_TEST_DL_UNSET_VARIABLE", "libc.so.6", "glibc").unwrap();
        assert!(libc.sym(c"getpid").is_ok());
        assert_eq!(libc.sym(c"gixl_no_such_symbol").err().unwrap(), "libc.so.6 has no gixl_no_such_symbol");
    }
}
