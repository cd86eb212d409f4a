//! Whether the direct path (GPUDirect Storage through NVIDIA's cuFile) can be taken on this machine, and why
//! not when it cannot. Asked once per process; the answer is logged once and shown by `gixl doctor`.
//!
//! The rule is the project's for all hardware code: a library opened at run time (`libcufile.so.0`, or the
//! path in `GIXL_CUFILE_LIB`), its driver opened (`cuFileDriverOpen`), and a self-test write and read of a
//! small region through it, data checked, before anything is trusted to it. Not done here: the self-test and
//! the direct transfers themselves are not written yet (they were never run on a machine with cuFile and a
//! GPU), so even where the library loads and its driver opens, the answer is "staged", saying so.

use std::ffi::c_int;
use std::sync::OnceLock;

/// `CUfileError_t`: cuFile's status and, for CUDA driver failures, the driver's.
#[repr(C)]
#[derive(Clone, Copy)]
struct CuFileError {
    err: c_int,
    cu_err: c_int,
}

/// `CU_FILE_SUCCESS`.
const CU_FILE_SUCCESS: c_int = 0;

type DriverOpen = unsafe extern "C" fn() -> CuFileError;

/// `Ok(())` when transfers may go through cuFile directly; otherwise why they are staged.
pub fn direct_path() -> &'static Result<(), String> {
    static ANSWER: OnceLock<Result<(), String>> = OnceLock::new();
    ANSWER.get_or_init(probe)
}

/// The reason the GDS backends stage through host memory, or None when they take the direct path.
pub fn staged_reason() -> Option<&'static str> {
    direct_path().as_ref().err().map(String::as_str)
}

fn probe() -> Result<(), String> {
    let dl = crate::os::dl::open("GIXL_CUFILE_LIB", "libcufile.so.0", "NVIDIA GPUDirect Storage, package libcufile")?;
    let open = dl.sym(c"cuFileDriverOpen")?;
    // SAFETY: cuFileDriverOpen takes no arguments and returns a CUfileError_t by value (cufile.h).
    let open: DriverOpen = unsafe { crate::os::dl::fn_ptr(open) };
    // SAFETY: a call with no arguments; cuFile initialises itself (or reports why it cannot).
    let r = unsafe { open() };
    if r.err != CU_FILE_SUCCESS {
        return Err(format!(
            "{} loaded, but cuFileDriverOpen failed (cuFile error {}, CUDA error {})",
            dl.name, r.err, r.cu_err
        ));
    }
    Err(format!(
        "{} loaded and its driver opened, but gixl's direct path through cuFile (self-test, then direct \
         transfers) is not written yet",
        dl.name
    ))
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_absent_library_means_staged_with_the_reason() {
        // This machine has no cuFile (CI has none either); where it has, the answer is still "staged" today.
        let why = super::staged_reason().expect("the direct path is never taken yet");
        assert!(why.contains("libcufile") || why.contains("cuFile"), "{why}");
    }
}
