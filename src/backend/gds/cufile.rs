//! GPUDirect Storage through NVIDIA's cuFile: whether the direct path may be taken in this process, why not
//! when it may not, and the calls the direct transfers make.
//!
//! The rule is the project's for all hardware code: the library is opened at run time (`libcufile.so.0`, or
//! the path in `GIXL_CUFILE_LIB`; never linked), every entry point used is resolved, its driver is opened
//! (`cuFileDriverOpen`), and a self-test moves a small pattern from device memory to a temporary file and back
//! into other device memory through it, data checked and time bounded, before anything is trusted to it.
//! The answer is asked once per process, at the first use (a GDS backend registering VRAM, or `gixl doctor`),
//! logged once when it is "staged", and shown by `gixl doctor`. `GIXL_CUFILE=off` forces "staged".
//!
//! What this module does not do: batch or stream (asynchronous) cuFile calls; each transfer piece is one
//! synchronous `cuFileRead`/`cuFileWrite` on a driver thread. The ABI below is transcribed from cufile.h
//! (CUDA 12) and checked by the layout test at the bottom; it has run against a fake libcufile (the tests'),
//! never yet against NVIDIA's.

use std::ffi::{c_int, c_void};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use parking_lot::Mutex;

use crate::device;

/// `CUfileError_t`: cuFile's status (`CUfileOpError`) and, for `CU_FILE_CUDA_DRIVER_ERROR`, the driver's
/// `CUresult`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct CuFileError {
    pub err: c_int,
    pub cu_err: c_int,
}

/// `CU_FILE_SUCCESS`.
const CU_FILE_SUCCESS: c_int = 0;
/// `CUFILEOP_BASE_ERR`: cuFile's own status codes are this plus a small number; I/O calls return them negated.
const CUFILEOP_BASE_ERR: i64 = 5000;
/// `CU_FILE_HANDLE_TYPE_OPAQUE_FD` of `enum CUfileFileHandleType`.
const CU_FILE_HANDLE_TYPE_OPAQUE_FD: c_int = 1;

/// The `handle` union of `CUfileDescr_t`: `int fd` (Linux) or `void *handle` (Windows).
#[repr(C)]
#[derive(Clone, Copy)]
union DescrHandle {
    fd: c_int,
    handle: *mut c_void,
}

/// `CUfileDescr_t`: `enum CUfileFileHandleType type; union { int fd; void *handle; } handle;
/// const CUfileFSOps_t *fs_ops;` (`fs_ops` NULL: a kernel file system).
#[repr(C)]
struct CuFileDescr {
    kind: c_int,
    handle: DescrHandle,
    fs_ops: *const c_void,
}

/// `CUfileHandle_t`: `void *`.
type CuFileHandle = *mut c_void;

type DriverOpen = unsafe extern "C" fn() -> CuFileError;
type DriverClose = unsafe extern "C" fn() -> CuFileError;
type HandleRegister = unsafe extern "C" fn(*mut CuFileHandle, *mut CuFileDescr) -> CuFileError;
type HandleDeregister = unsafe extern "C" fn(CuFileHandle);
type BufRegister = unsafe extern "C" fn(*const c_void, usize, c_int) -> CuFileError;
type BufDeregister = unsafe extern "C" fn(*const c_void) -> CuFileError;
/// `ssize_t cuFileRead(CUfileHandle_t fh, void *bufPtr_base, size_t size, off_t file_offset,
/// off_t bufPtr_offset)`.
type Read = unsafe extern "C" fn(CuFileHandle, *mut c_void, usize, libc::off_t, libc::off_t) -> isize;
/// `ssize_t cuFileWrite(CUfileHandle_t fh, const void *bufPtr_base, size_t size, off_t file_offset,
/// off_t bufPtr_offset)`.
type Write = unsafe extern "C" fn(CuFileHandle, *const c_void, usize, libc::off_t, libc::off_t) -> isize;

/// The opened library: its name and the entry points gixl calls. Its driver is open.
pub(crate) struct CuFile {
    name: String,
    close: Option<DriverClose>,
    handle_register: HandleRegister,
    handle_deregister: HandleDeregister,
    buf_register: BufRegister,
    buf_deregister: BufDeregister,
    read: Read,
    write: Write,
}

/// How long the self-test may take before cuFile is declared unusable here.
pub const SELF_TEST_LIMIT: Duration = Duration::from_secs(10);

/// Bytes the self-test moves each way.
const SELF_TEST_BYTES: usize = 1 << 20;

/// `Ok(())` when VRAM ↔ FILE transfers may go through cuFile directly; otherwise why they are staged.
pub fn direct_path() -> &'static Result<(), String> {
    static ANSWER: OnceLock<Result<(), String>> = OnceLock::new();
    ANSWER.get_or_init(|| {
        let answer = decide();
        if let Err(why) = &answer {
            crate::telemetry::log::warn(&format!(
                "GDS/GDS_MT: VRAM <-> FILE goes through page-locked host buffers (staged), not GPUDirect Storage: \
                 {why}"
            ));
        }
        answer
    })
}

/// The reason the GDS backends stage through host memory, or None when they take the direct path.
pub fn staged_reason() -> Option<&'static str> {
    direct_path().as_ref().err().map(String::as_str)
}

/// cuFile, where the direct path proved itself in this process.
pub(crate) fn api() -> Option<&'static CuFile> {
    match direct_path() {
        Ok(()) => LIB.get().and_then(|l| l.as_ref().ok()),
        Err(_) => None,
    }
}

static LIB: OnceLock<Result<CuFile, String>> = OnceLock::new();

fn decide() -> Result<(), String> {
    if std::env::var("GIXL_CUFILE").is_ok_and(|v| matches!(v.trim(), "off" | "0" | "no" | "false")) {
        return Err("GIXL_CUFILE=off in the environment".into());
    }
    let lib = LIB.get_or_init(load).as_ref().map_err(Clone::clone)?;
    if let Err(why) = self_test(lib) {
        // Nothing will use the driver: close it again (a hung self-test thread keeps its own calls).
        if !why.contains("did not finish") {
            lib.close_driver();
        }
        return Err(format!("{} loaded and its driver opened, but the self-test failed: {why}", lib.name));
    }
    // The driver stays open for the life of the process: cuFile closes it at exit, and closing it from an
    // exit handler could pull it from under a driver thread still in a call.
    Ok(())
}

fn load() -> Result<CuFile, String> {
    let dl = crate::os::dl::open("GIXL_CUFILE_LIB", "libcufile.so.0", "NVIDIA GPUDirect Storage, package libcufile")?;
    // SAFETY (each `fn_ptr` below): the symbol is cuFile's function of that name, whose C signature
    // (cufile.h) the type spells.
    let open: DriverOpen = unsafe { crate::os::dl::fn_ptr(dl.sym(c"cuFileDriverOpen")?) };
    // cufile.h maps cuFileDriverClose to cuFileDriverClose_v2 since CUDA 12; older libraries have only the
    // first. Optional: a library without either is still used, its driver left to close at exit.
    let close = dl.sym(c"cuFileDriverClose_v2").or_else(|_| dl.sym(c"cuFileDriverClose")).ok();
    let lib = CuFile {
        close: close.map(|p| unsafe { crate::os::dl::fn_ptr::<DriverClose>(p) }),
        handle_register: unsafe { crate::os::dl::fn_ptr(dl.sym(c"cuFileHandleRegister")?) },
        handle_deregister: unsafe { crate::os::dl::fn_ptr(dl.sym(c"cuFileHandleDeregister")?) },
        buf_register: unsafe { crate::os::dl::fn_ptr(dl.sym(c"cuFileBufRegister")?) },
        buf_deregister: unsafe { crate::os::dl::fn_ptr(dl.sym(c"cuFileBufDeregister")?) },
        read: unsafe { crate::os::dl::fn_ptr(dl.sym(c"cuFileRead")?) },
        write: unsafe { crate::os::dl::fn_ptr(dl.sym(c"cuFileWrite")?) },
        name: dl.name,
    };
    // SAFETY: no arguments; cuFile initialises itself or reports why it cannot.
    let r = unsafe { open() };
    if r.err != CU_FILE_SUCCESS {
        return Err(format!("{} loaded, but cuFileDriverOpen failed ({})", lib.name, error_text(r)));
    }
    Ok(lib)
}

/// A `CUfileError_t` in words.
fn error_text(e: CuFileError) -> String {
    if e.err == CUFILEOP_BASE_ERR as c_int + 11 {
        format!("cuFile error {} (CUDA driver error {})", e.err, e.cu_err)
    } else {
        format!("cuFile error {}{}", e.err, op_error_name(e.err as i64))
    }
}

/// The name of the commonest `CUfileOpError` codes, for messages.
fn op_error_name(code: i64) -> &'static str {
    match code - CUFILEOP_BASE_ERR {
        1 => " CU_FILE_DRIVER_NOT_INITIALIZED",
        7 => " CU_FILE_PLATFORM_NOT_SUPPORTED",
        8 => " CU_FILE_IO_NOT_SUPPORTED",
        9 => " CU_FILE_DEVICE_NOT_SUPPORTED",
        12 => " CU_FILE_CUDA_POINTER_INVALID",
        14 => " CU_FILE_CUDA_POINTER_RANGE_ERROR",
        15 => " CU_FILE_CUDA_CONTEXT_MISMATCH",
        19 => " CU_FILE_INVALID_FILE_OPEN_FLAG",
        20 => " CU_FILE_DIO_NOT_SET",
        23 => " CU_FILE_MEMORY_ALREADY_REGISTERED",
        27 => " CU_FILE_HANDLE_NOT_REGISTERED",
        44 => " CU_FILE_IO_ERROR",
        _ => "",
    }
}

/// How a failed `cuFileRead`/`cuFileWrite` reads: an errno (`Ok`) or cuFile's own status (`Err`, in words).
pub(crate) fn io_failure(ret: isize) -> Result<i32, String> {
    let code = -(ret as i64);
    if code > CUFILEOP_BASE_ERR {
        Err(format!("cuFile error {code}{}", op_error_name(code)))
    } else if ret == -1 {
        Ok(std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO))
    } else {
        Ok(code as i32)
    }
}

impl CuFile {
    fn close_driver(&self) {
        if let Some(close) = self.close {
            // SAFETY: no arguments; a failure (already closed) changes nothing here.
            unsafe { close() };
        }
    }

    /// Register file descriptor `fd` with cuFile.
    pub(crate) fn file(&'static self, fd: i32) -> Result<FileHandle, String> {
        let mut descr =
            CuFileDescr { kind: CU_FILE_HANDLE_TYPE_OPAQUE_FD, handle: DescrHandle { fd }, fs_ops: std::ptr::null() };
        let mut fh: CuFileHandle = std::ptr::null_mut();
        // SAFETY: valid out-pointer and descriptor; cuFile keeps neither past the call.
        let r = unsafe { (self.handle_register)(&mut fh, &mut descr) };
        if r.err != CU_FILE_SUCCESS {
            return Err(format!("cuFileHandleRegister of fd {fd} failed ({})", error_text(r)));
        }
        Ok(FileHandle { lib: self, fd, fh: Mutex::new(Some(fh as usize)) })
    }

    /// Register the device memory `[base, base + len)` with cuFile (the context of its device current).
    pub(crate) fn buf(&'static self, dev: u32, base: u64, len: u64) -> Result<BufReg, String> {
        // SAFETY: device memory the caller registered; cuFile maps it for DMA until deregistered.
        let r = unsafe { (self.buf_register)(base as usize as *const c_void, len as usize, 0) };
        if r.err != CU_FILE_SUCCESS {
            return Err(format!("cuFileBufRegister of {base:#x}+{len} failed ({})", error_text(r)));
        }
        Ok(BufReg { lib: self, dev, base, registered: Mutex::new(true) })
    }

    /// One synchronous cuFile call: `len` bytes between the device memory at `base + buf_off` and the file
    /// of `fh` at `file_off`. The byte count moved, or a negative value (see [`io_failure`]).
    ///
    /// # Safety
    /// `fh` is registered; `base + buf_off .. + len` is device memory nobody else uses during the call, in a
    /// context current on this thread.
    pub(crate) unsafe fn io(&self, read: bool, fh: usize, base: u64, buf_off: u64, file_off: u64, len: u64) -> isize {
        let (fh, p) = (fh as CuFileHandle, base as usize as *mut c_void);
        let (n, o, b) = (len as usize, file_off as libc::off_t, buf_off as libc::off_t);
        // SAFETY: the caller vouches for the handle and the memory.
        unsafe {
            if read {
                (self.read)(fh, p, n, o, b)
            } else {
                (self.write)(fh, p, n, o, b)
            }
        }
    }
}

/// A file descriptor registered with cuFile; deregistered by [`FileHandle::deregister`] or when dropped.
pub(crate) struct FileHandle {
    lib: &'static CuFile,
    pub fd: i32,
    fh: Mutex<Option<usize>>,
}

impl FileHandle {
    /// The `CUfileHandle_t`, while registered.
    pub(crate) fn raw(&self) -> Option<usize> {
        *self.fh.lock()
    }

    /// Deregister now (once); the caller makes sure no I/O uses the handle any more.
    pub(crate) fn deregister(&self) {
        if let Some(fh) = self.fh.lock().take() {
            // SAFETY: a handle from cuFileHandleRegister, deregistered once.
            unsafe { (self.lib.handle_deregister)(fh as CuFileHandle) };
        }
    }
}

impl Drop for FileHandle {
    fn drop(&mut self) {
        self.deregister();
    }
}

/// Device memory registered with cuFile; deregistered by [`BufReg::deregister`] or when dropped.
pub(crate) struct BufReg {
    lib: &'static CuFile,
    dev: u32,
    pub base: u64,
    registered: Mutex<bool>,
}

impl BufReg {
    pub(crate) fn deregister(&self) {
        let mut r = self.registered.lock();
        if std::mem::take(&mut *r) {
            // In the context of its device (a no-op where it is current already, or on the fake).
            let _ctx = device::get().ok().and_then(|d| d.enter(self.dev).ok());
            // SAFETY: a base registered by cuFileBufRegister, deregistered once.
            unsafe { (self.lib.buf_deregister)(self.base as usize as *const c_void) };
        }
    }
}

impl Drop for BufReg {
    fn drop(&mut self) {
        self.deregister();
    }
}

/// The self-test, on a thread of its own so that a cuFile that hangs cannot hang the caller: after
/// [`SELF_TEST_LIMIT`] the answer is "failed", naming the step it was in.
fn self_test(lib: &'static CuFile) -> Result<(), String> {
    static STEP: AtomicUsize = AtomicUsize::new(0);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("gixl-cufile-test".into())
        .spawn(move || {
            let _ = tx.send(self_test_steps(lib, &|s| STEP.store(s, Ordering::Relaxed)));
        })
        .map_err(|e| format!("cannot start the self-test thread: {e}"))?;
    match rx.recv_timeout(SELF_TEST_LIMIT) {
        Ok(r) => r,
        Err(_) => Err(format!(
            "{} did not finish within {SELF_TEST_LIMIT:?}",
            STEPS.get(STEP.load(Ordering::Relaxed)).copied().unwrap_or("a step")
        )),
    }
}

const STEPS: &[&str] = &[
    "allocating device memory",
    "cuFileBufRegister",
    "creating the test file",
    "cuFileHandleRegister",
    "cuFileWrite",
    "cuFileRead",
    "checking the data read back",
];

fn self_test_steps(lib: &'static CuFile, at: &dyn Fn(usize)) -> Result<(), String> {
    let fail = |step: usize, why: String| format!("{}: {why}", STEPS[step]);
    at(0);
    let device = device::get().map_err(|e| fail(0, e.message().to_owned()))?;
    let dev = 0;
    let _ctx = device.enter(dev).map_err(|e| fail(0, e.message().to_owned()))?;
    let src = device.dev_buf(dev, SELF_TEST_BYTES).map_err(|e| fail(0, e.message().to_owned()))?;
    let dst = device.dev_buf(dev, SELF_TEST_BYTES).map_err(|e| fail(0, e.message().to_owned()))?;
    let pattern: Vec<u8> = (0..SELF_TEST_BYTES as u64).map(|i| (i.wrapping_mul(0x9E37_79B1) >> 11) as u8).collect();
    let zero = vec![0u8; SELF_TEST_BYTES];
    let put = |to: u64, from: &[u8]| {
        device.copy(dev, &[device::Copy { dst: to, src: from.as_ptr() as u64, len: from.len() as u64 }])
    };
    put(src.ptr(), &pattern).map_err(|e| fail(0, e.message().to_owned()))?;
    put(dst.ptr(), &zero).map_err(|e| fail(0, e.message().to_owned()))?;
    at(1);
    let bsrc = lib.buf(dev, src.ptr(), SELF_TEST_BYTES as u64).map_err(|e| fail(1, e))?;
    let bdst = lib.buf(dev, dst.ptr(), SELF_TEST_BYTES as u64).map_err(|e| fail(1, e))?;
    at(2);
    let file = test_file().map_err(|e| fail(2, e))?;
    at(3);
    let fh = lib.file(file.as_raw_fd()).map_err(|e| fail(3, e))?;
    let raw = fh.raw().ok_or_else(|| fail(3, "no handle".into()))?;
    for (step, read, buf) in [(4, false, src.ptr()), (5, true, dst.ptr())] {
        at(step);
        // SAFETY: a registered handle and our own registered device buffers, the context current.
        let n = unsafe { lib.io(read, raw, buf, 0, 0, SELF_TEST_BYTES as u64) };
        if n != SELF_TEST_BYTES as isize {
            let why = match n {
                n if n < 0 => match io_failure(n) {
                    Ok(e) => std::io::Error::from_raw_os_error(e).to_string(),
                    Err(s) => s,
                },
                n => format!("moved {n} of {SELF_TEST_BYTES} bytes"),
            };
            return Err(fail(step, why));
        }
    }
    at(6);
    let mut back = vec![0u8; SELF_TEST_BYTES];
    device
        .copy(dev, &[device::Copy { dst: back.as_mut_ptr() as u64, src: dst.ptr(), len: SELF_TEST_BYTES as u64 }])
        .map_err(|e| fail(6, e.message().to_owned()))?;
    if back != pattern {
        let at = back.iter().zip(&pattern).position(|(a, b)| a != b).unwrap_or(0);
        return Err(fail(6, format!("the data read back differs from what was written (first at byte {at})")));
    }
    fh.deregister();
    bsrc.deregister();
    bdst.deregister();
    Ok(())
}

/// An unnamed file for the self-test, in `GIXL_CUFILE_TEST_DIR` (default the temporary directory), opened with
/// `O_DIRECT` where the file system allows it (as cuFile's direct mode wants).
fn test_file() -> Result<OwnedFd, String> {
    let dir = std::env::var("GIXL_CUFILE_TEST_DIR")
        .ok()
        .filter(|d| !d.is_empty())
        .map(std::path::PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).map_err(|_| "a NUL in the path".to_string())?;
    // Where the file system has no O_TMPFILE, a named file, removed again at once.
    let named = dir.join(format!(".gixl-cufile-test-{}", std::process::id()));
    let named = std::ffi::CString::new(named.as_os_str().as_encoded_bytes()).map_err(|_| "a NUL in the path")?;
    let mut last = String::new();
    for (path, how) in [(&c, libc::O_TMPFILE), (&named, libc::O_CREAT | libc::O_EXCL)] {
        for direct in [libc::O_DIRECT, 0] {
            let flags = how | libc::O_RDWR | libc::O_CLOEXEC | direct;
            // SAFETY: a NUL-terminated path; the result is checked.
            let fd = unsafe { libc::open(path.as_ptr(), flags, 0o600) };
            if fd >= 0 {
                if how != libc::O_TMPFILE {
                    // SAFETY: the name we just created.
                    unsafe { libc::unlink(path.as_ptr()) };
                }
                // SAFETY: a fresh descriptor we own.
                return Ok(unsafe { OwnedFd::from_raw_fd(fd) });
            }
            last = format!("{}: {}", dir.display(), std::io::Error::last_os_error());
        }
    }
    Err(last)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descr_layout_matches_cufile_h() {
        // x86_64 and aarch64 (LP64): enum (4), padding (4), union of int and pointer (8), pointer (8).
        assert_eq!(std::mem::size_of::<CuFileDescr>(), 24);
        assert_eq!(std::mem::align_of::<CuFileDescr>(), 8);
        assert_eq!(std::mem::offset_of!(CuFileDescr, kind), 0);
        assert_eq!(std::mem::offset_of!(CuFileDescr, handle), 8);
        assert_eq!(std::mem::offset_of!(CuFileDescr, fs_ops), 16);
        assert_eq!(std::mem::size_of::<DescrHandle>(), 8);
        assert_eq!(std::mem::size_of::<CuFileError>(), 8);
        assert_eq!(std::mem::offset_of!(CuFileError, cu_err), 4);
        assert_eq!(CU_FILE_HANDLE_TYPE_OPAQUE_FD, 1);
    }

    #[test]
    fn io_failures_read_as_errno_or_cufile_status() {
        assert_eq!(io_failure(-(libc::EIO as isize)), Ok(libc::EIO));
        let e = io_failure(-5044).unwrap_err();
        assert!(e.contains("5044") && e.contains("CU_FILE_IO_ERROR"), "{e}");
        assert_eq!(error_text(CuFileError { err: 5011, cu_err: 700 }), "cuFile error 5011 (CUDA driver error 700)");
    }

    #[test]
    fn an_absent_library_means_staged_with_the_reason() {
        // The unit tests run without cuFile (this machine and CI have none; nothing sets GIXL_CUFILE_LIB).
        if std::env::var_os("GIXL_CUFILE_LIB").is_some() {
            return;
        }
        let why = super::staged_reason().expect("no cuFile here");
        assert!(why.contains("libcufile") || why.contains("cuFile") || why.contains("GIXL_CUFILE"), "{why}");
    }
}
