//! The real device layer: the CUDA driver API through cudarc, loaded at run time.
//!
//! cudarc resolves each driver symbol on first use and panics when the library or the symbol is missing.
//! Before the first call, `load` checks that the library is present and that every symbol used here
//! resolves; if not, every operation returns NOT_SUPPORTED saying why, and nothing panics.
//!
//! Every operation makes the device's primary context current on the calling thread first (cached per
//! thread), so the engine's internal threads never call the driver without a context. Each thread that
//! copies owns, per device, a non-blocking stream and a blocking-sync event: copies are queued on the
//! stream, the event recorded, and the thread sleeps in `cuEventSynchronize` until they are done.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_void, CStr};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::sync::OnceLock;

use cudarc::driver::sys;

use super::{Copy, DevBuf, Device, Export, FdSource, HandleKind, HostBuf, IpcHandle, Mapping, PtrInfo};
use crate::status::{Error, Result, Status};

/// The driver symbols this module calls; all must resolve before any is called.
const SYMBOLS: &[&str] = &[
    "cuInit",
    "cuGetErrorString",
    "cuDeviceGet",
    "cuDeviceGetCount",
    "cuDevicePrimaryCtxRetain",
    "cuCtxSetCurrent",
    "cuCtxGetCurrent",
    "cuPointerGetAttribute",
    "cuMemGetAddressRange_v2",
    "cuIpcGetMemHandle",
    "cuIpcOpenMemHandle_v2",
    "cuIpcCloseMemHandle",
    "cuMemRetainAllocationHandle",
    "cuMemGetAllocationPropertiesFromHandle",
    "cuDeviceGetAttribute",
    "cuMemExportToShareableHandle",
    "cuMemImportFromShareableHandle",
    "cuMemRelease",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuEventCreate",
    "cuEventDestroy_v2",
    "cuEventRecord",
    "cuEventSynchronize",
    "cuMemcpyAsync",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
];

pub struct Cuda {
    /// Primary context of each device, retained once and kept for the life of the process.
    ctxs: Vec<OnceLock<usize>>,
}

static DRIVER: OnceLock<std::result::Result<Cuda, String>> = OnceLock::new();

pub(super) fn device() -> Result<&'static dyn Device> {
    match DRIVER.get_or_init(load) {
        Ok(c) => Ok(c),
        Err(why) => Err(Error::not_supported(format!("VRAM is not available: {why}"))),
    }
}

fn load() -> std::result::Result<Cuda, String> {
    // SAFETY: dlopen of the driver library by cudarc's own list of names; no symbol is called.
    if !unsafe { sys::is_culib_present() } {
        return Err("no CUDA driver (libcuda.so.1 could not be loaded)".into());
    }
    // SAFETY: the library is present (checked above), so `culib` does not panic; `get` only looks up.
    let lib = unsafe { sys::culib() };
    for s in SYMBOLS {
        // SAFETY: a symbol lookup; the pointer is not called here.
        if unsafe { lib.get::<unsafe extern "C" fn()>(s.as_bytes()) }.is_err() {
            return Err(format!("the CUDA driver lacks {s} (driver too old)"));
        }
    }
    // SAFETY: every symbol used in this module resolves (checked above).
    check(unsafe { sys::cuInit(0) }, "cuInit").map_err(|e| e.message().to_owned())?;
    let mut n = 0;
    // SAFETY: `n` is a valid out-pointer.
    check(unsafe { sys::cuDeviceGetCount(&mut n) }, "cuDeviceGetCount").map_err(|e| e.message().to_owned())?;
    if n <= 0 {
        return Err("the CUDA driver reports no device".into());
    }
    Ok(Cuda { ctxs: (0..n).map(|_| OnceLock::new()).collect() })
}

fn check(r: sys::CUresult, what: &str) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut s: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: `s` is a valid out-pointer; the driver returns a static string or leaves it null.
    let name = if unsafe { sys::cuGetErrorString(r, &mut s) } == sys::CUresult::CUDA_SUCCESS && !s.is_null() {
        // SAFETY: a NUL-terminated static string from the driver.
        unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
    } else {
        format!("{r:?}")
    };
    Err(Error::backend(format!("{what} failed: {name}")))
}

/// Makes a context current on this thread and puts the previous one back when dropped, so a call on an
/// application thread (small requests run inline in `post`) leaves that thread's CUDA state as it was.
struct Current {
    prev: sys::CUcontext,
    set: bool,
}

impl Current {
    fn enter(ctx: usize) -> Result<Current> {
        let mut prev: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        check(unsafe { sys::cuCtxGetCurrent(&mut prev) }, "cuCtxGetCurrent")?;
        if prev as usize == ctx {
            return Ok(Current { prev, set: false });
        }
        // SAFETY: a retained primary context.
        check(unsafe { sys::cuCtxSetCurrent(ctx as sys::CUcontext) }, "cuCtxSetCurrent")?;
        Ok(Current { prev, set: true })
    }
}

impl Drop for Current {
    fn drop(&mut self) {
        if self.set {
            // SAFETY: the context that was current before (or none).
            unsafe { sys::cuCtxSetCurrent(self.prev) };
        }
    }
}

thread_local! {
    /// This thread's stream and event per device.
    static STREAMS: RefCell<HashMap<u32, Stream>> = RefCell::new(HashMap::new());
}

struct Stream {
    ctx: usize,
    stream: sys::CUstream,
    event: sys::CUevent,
}

impl Drop for Stream {
    fn drop(&mut self) {
        let _c = Current::enter(self.ctx);
        // SAFETY: handles created by this thread in `ctx`; errors (e.g. a driver already shut down at exit)
        // are ignored.
        unsafe {
            sys::cuEventDestroy_v2(self.event);
            sys::cuStreamDestroy_v2(self.stream);
        }
    }
}

impl Cuda {
    /// `dev`'s primary context (retained on first use).
    fn ctx(&self, dev: u32) -> Result<usize> {
        let slot = self.ctxs.get(dev as usize).ok_or_else(|| Error::invalid_param(format!("no CUDA device {dev}")))?;
        let ctx = match slot.get() {
            Some(&c) => c,
            None => {
                let mut d = 0;
                // SAFETY: valid out-pointers; the ordinal is below the device count.
                check(unsafe { sys::cuDeviceGet(&mut d, dev as i32) }, "cuDeviceGet")?;
                let mut c: sys::CUcontext = std::ptr::null_mut();
                // SAFETY: as above. The primary context is retained for the life of the process.
                check(unsafe { sys::cuDevicePrimaryCtxRetain(&mut c, d) }, "cuDevicePrimaryCtxRetain")?;
                *slot.get_or_init(|| c as usize)
            }
        };
        Ok(ctx)
    }

    fn attr<T: Default>(&self, a: sys::CUpointer_attribute, addr: u64) -> Result<T> {
        let mut v = T::default();
        // SAFETY: `v` is an out-pointer of the size the attribute writes (checked by the callers' types).
        check(
            unsafe { sys::cuPointerGetAttribute(&mut v as *mut T as *mut c_void, a, addr) },
            "cuPointerGetAttribute",
        )?;
        Ok(v)
    }
}

struct Legacy {
    base: u64,
    ctx: usize,
}

impl Mapping for Legacy {
    fn base(&self) -> u64 {
        self.base
    }
}

impl Drop for Legacy {
    fn drop(&mut self) {
        let _c = Current::enter(self.ctx);
        // SAFETY: a mapping opened by cuIpcOpenMemHandle in `ctx`, closed once, after its last copy.
        unsafe {
            sys::cuIpcCloseMemHandle(self.base);
        }
    }
}

struct Vmm {
    base: u64,
    size: u64,
    handle: sys::CUmemGenericAllocationHandle,
    ctx: usize,
}

impl Mapping for Vmm {
    fn base(&self) -> u64 {
        self.base
    }
}

impl Drop for Vmm {
    fn drop(&mut self) {
        let _c = Current::enter(self.ctx);
        // SAFETY: the range reserved, mapped and accessed in `open`, released once after its last copy.
        unsafe {
            sys::cuMemUnmap(self.base, self.size as usize);
            sys::cuMemAddressFree(self.base, self.size as usize);
            sys::cuMemRelease(self.handle);
        }
    }
}

struct Pinned {
    ptr: u64,
    len: usize,
    ctx: usize,
}

// SAFETY: page-locked host memory owned by this value; the pointer is only an address.
unsafe impl Send for Pinned {}

impl HostBuf for Pinned {
    fn ptr(&self) -> u64 {
        self.ptr
    }
    fn size(&self) -> usize {
        self.len
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        let _c = Current::enter(self.ctx);
        // SAFETY: allocated by cuMemHostAlloc in `ctx`, freed once.
        unsafe {
            sys::cuMemFreeHost(self.ptr as usize as *mut c_void);
        }
    }
}

/// Device memory from `cuMemAlloc`, freed when dropped.
struct DevMem {
    ptr: sys::CUdeviceptr,
    ctx: usize,
}

impl DevBuf for DevMem {
    fn ptr(&self) -> u64 {
        self.ptr
    }
}

impl Drop for DevMem {
    fn drop(&mut self) {
        let _c = Current::enter(self.ctx);
        // SAFETY: allocated by cuMemAlloc in `ctx`, freed once.
        unsafe {
            sys::cuMemFree_v2(self.ptr);
        }
    }
}

/// Import a VMM allocation from the exporter's POSIX fd.
fn import_fd(fd: OwnedFd) -> Result<sys::CUmemGenericAllocationHandle> {
    let mut h: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: for POSIX fds the driver takes the descriptor value as the pointer argument.
    let r = unsafe {
        sys::cuMemImportFromShareableHandle(
            &mut h,
            fd.as_raw_fd() as usize as *mut c_void,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        )
    };
    check(r, "cuMemImportFromShareableHandle")?;
    // The driver holds its own reference to the allocation now; `fd` is closed here.
    Ok(h)
}

impl Cuda {
    /// Whether device `dev` reports the yes/no attribute `attr` (false where the driver does not know it).
    fn reports(&self, dev: u32, attr: sys::CUdevice_attribute) -> bool {
        let mut d = 0;
        let mut v = 0;
        // SAFETY: valid out-pointers; both symbols were checked at load.
        let ok = unsafe {
            sys::cuDeviceGet(&mut d, dev as i32) == sys::CUresult::CUDA_SUCCESS
                && sys::cuDeviceGetAttribute(&mut v, attr, d) == sys::CUresult::CUDA_SUCCESS
        };
        ok && v != 0
    }

    /// Whether device `dev` reports dma-buf export (`CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`).
    fn dmabuf_supported(&self, dev: u32) -> bool {
        self.reports(dev, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)
    }

    /// Whether device `dev` reports fabric handle support (false before CUDA 12.3).
    fn fabric_supported(&self, dev: u32) -> bool {
        self.reports(dev, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED)
    }

    /// The fabric handle of VMM allocation `h` (retained by the caller), where its properties request that
    /// type and the device supports it; None otherwise, with a log line where the export itself failed
    /// (e.g. no IMEX channel), so the caller exports a POSIX fd instead. Untested on hardware.
    fn export_fabric(&self, info: &PtrInfo, h: sys::CUmemGenericAllocationHandle) -> Option<[u8; super::FABRIC_LEN]> {
        // SAFETY: zeroed is a valid value for this plain struct; the driver fills it.
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        // SAFETY: valid out-pointer; a handle retained by the caller.
        if unsafe { sys::cuMemGetAllocationPropertiesFromHandle(&mut prop, h) } != sys::CUresult::CUDA_SUCCESS {
            return None;
        }
        let fabric = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC;
        if prop.requestedHandleTypes.0 & fabric.0 == 0 || !self.fabric_supported(info.dev) {
            return None;
        }
        // SAFETY: plain bytes; the driver fills them.
        let mut f: sys::CUmemFabricHandle = unsafe { std::mem::zeroed() };
        // SAFETY: for FABRIC the driver writes a CUmemFabricHandle.
        let r = unsafe {
            sys::cuMemExportToShareableHandle(&mut f as *mut sys::CUmemFabricHandle as *mut c_void, h, fabric, 0)
        };
        match check(r, "cuMemExportToShareableHandle (fabric)") {
            Ok(()) => Some(f.data),
            Err(e) => {
                crate::telemetry::log::warn(&format!(
                    "VRAM allocation {:#x}: fabric handle export failed ({}); exported as a POSIX fd instead",
                    info.base,
                    e.message()
                ));
                None
            }
        }
    }

    /// Import a peer's fabric handle on device `dev`. Untested on hardware.
    fn import_fabric(&self, dev: u32, f: &[u8; super::FABRIC_LEN]) -> Result<sys::CUmemGenericAllocationHandle> {
        if !self.fabric_supported(dev) {
            return Err(Error::not_supported(format!("CUDA device {dev} does not support fabric handles")));
        }
        // SAFETY: plain bytes.
        let mut fh: sys::CUmemFabricHandle = unsafe { std::mem::zeroed() };
        fh.data = *f;
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: for FABRIC the driver reads a CUmemFabricHandle through the pointer.
        let r = unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut h,
                &mut fh as *mut sys::CUmemFabricHandle as *mut c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC,
            )
        };
        check(r, "cuMemImportFromShareableHandle (fabric; needs an IMEX channel)")?;
        Ok(h)
    }
}

impl Device for Cuda {
    fn kind(&self) -> &'static str {
        "cuda"
    }

    fn pointer_info(&self, addr: u64) -> Result<PtrInfo> {
        // Attribute queries need some context; any device's will do (unified addressing).
        let _any = Current::enter(self.ctx(0)?)?;
        let mt: u32 = self
            .attr(sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE, addr)
            .map_err(|e| Error::invalid_param(format!("address {addr:#x} is not device memory ({})", e.message())))?;
        if mt != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
            return Err(Error::invalid_param(format!("address {addr:#x} is not device memory (memory type {mt})")));
        }
        let dev: i32 = self.attr(sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, addr)?;
        let dev = u32::try_from(dev).map_err(|_| Error::backend("negative device ordinal"))?;
        let _c = Current::enter(self.ctx(dev)?)?;
        // UNTESTED ON HARDWARE (no GPU was lent while this was written): the VMM branch below follows the
        // driver API documentation only.
        //
        // A VMM range (cuMemAddressReserve + one cuMemMap per physical chunk, as PyTorch's expandable
        // segments build it) is not one allocation: each chunk has its own allocation handle, and only a
        // whole chunk can be exported (cuMemRetainAllocationHandle + cuMemExportToShareableHandle in
        // `export`) and mapped by the importer. So for VMM memory the "allocation" reported here is the
        // mapping the address falls in (CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR / _MAPPING_SIZE: one cuMemMap'd
        // chunk; cuMemMap's offset into a handle must be 0, so a mapping starts at its handle's start), and the
        // engine walks a region chunk by chunk (`vram::chunks`), exporting and opening one handle per chunk.
        // cuMemGetAddressRange serves cudaMalloc'd (legacy-IPC-capable) memory, for which it is documented.
        let legacy: i32 = self.attr(sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, addr)?;
        if legacy == 0 {
            let base: u64 = self.attr(sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR, addr)?;
            let size: u64 = self.attr(sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MAPPING_SIZE, addr)?;
            if base == 0 || size == 0 || addr < base || addr - base >= size {
                return Err(Error::backend(format!(
                    "the driver reports no mapping around {addr:#x} ({base:#x}+{size}) for a VMM allocation"
                )));
            }
            return Ok(PtrInfo { dev, base, size });
        }
        let (mut base, mut size) = (0u64, 0usize);
        // SAFETY: valid out-pointers.
        check(unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, addr) }, "cuMemGetAddressRange")?;
        Ok(PtrInfo { dev, base, size: size as u64 })
    }

    /// UNTESTED ON HARDWARE. `cuDeviceGetPCIBusId` (looked up here, not required at load), then the bus id's
    /// sysfs path.
    fn pci_path(&self, dev: u32) -> Option<String> {
        // SAFETY: symbol lookups only; the driver is loaded (this is `Cuda`).
        let lib = unsafe { sys::culib() };
        // SAFETY: a symbol lookup only.
        unsafe { lib.get::<unsafe extern "C" fn()>(b"cuDeviceGetPCIBusId") }.ok()?;
        let mut d = 0;
        // SAFETY: a valid out-pointer.
        check(unsafe { sys::cuDeviceGet(&mut d, dev as i32) }, "cuDeviceGet").ok()?;
        let mut id = [0 as std::ffi::c_char; 32];
        // SAFETY: a 32-byte buffer, its length passed; the driver writes a NUL-terminated bus id.
        check(unsafe { sys::cuDeviceGetPCIBusId(id.as_mut_ptr(), id.len() as i32, d) }, "cuDeviceGetPCIBusId").ok()?;
        // SAFETY: NUL-terminated within the buffer (the driver's contract; the last byte is never written past).
        let id = unsafe { CStr::from_ptr(id.as_ptr()) }.to_string_lossy().to_lowercase();
        std::fs::canonicalize(format!("/sys/bus/pci/devices/{id}")).ok().map(|p| p.to_string_lossy().into_owned())
    }

    /// UNTESTED ON HARDWARE. The page-aligned range around `[addr, addr + len)` exported by
    /// `cuMemGetHandleForAddressRange` (CUDA 11.7+, a symbol looked up here rather than required at load, so
    /// older drivers keep VRAM); the offset of `addr` in it is what `ibv_reg_dmabuf_mr` takes.
    fn dmabuf(&self, addr: u64, len: u64) -> Result<(OwnedFd, u64)> {
        let info = self.pointer_info(addr)?;
        let end = addr.checked_add(len).filter(|&e| e <= info.base.saturating_add(info.size)).ok_or_else(|| {
            Error::not_supported(format!("{addr:#x}+{len} spans more than one allocation: no single dma-buf"))
        })?;
        let _c = Current::enter(self.ctx(info.dev)?)?;
        if !self.dmabuf_supported(info.dev) {
            return Err(Error::not_supported(format!(
                "device {} does not export dma-buf (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0: driver, kernel or GPU)",
                info.dev
            )));
        }
        // SAFETY: a symbol lookup; the driver is loaded (this is `Cuda`).
        let lib = unsafe { sys::culib() };
        // SAFETY: a symbol lookup only.
        if unsafe { lib.get::<unsafe extern "C" fn()>(b"cuMemGetHandleForAddressRange") }.is_err() {
            return Err(Error::not_supported("the CUDA driver lacks cuMemGetHandleForAddressRange (older than 11.7)"));
        }
        // SAFETY: sysconf has no preconditions.
        let page = (unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).max(4096) as u64;
        let lo = addr & !(page - 1);
        let hi = end.div_ceil(page) * page;
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: `fd` is a valid out-pointer for an int descriptor; the range lies in one allocation.
        let r = unsafe {
            sys::cuMemGetHandleForAddressRange(
                &mut fd as *mut std::ffi::c_int as *mut c_void,
                lo,
                (hi - lo) as usize,
                sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        };
        check(r, "cuMemGetHandleForAddressRange").map_err(|e| Error::not_supported(e.message().to_owned()))?;
        if fd < 0 {
            return Err(Error::backend("cuMemGetHandleForAddressRange returned no descriptor"));
        }
        // SAFETY: a descriptor the driver just created for us.
        Ok((unsafe { OwnedFd::from_raw_fd(fd) }, addr - lo))
    }

    fn export(&self, info: &PtrInfo) -> Result<Export> {
        let _c = Current::enter(self.ctx(info.dev)?)?;
        let legacy: i32 =
            self.attr(sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, info.base)?;
        if legacy != 0 {
            // SAFETY: zeroed plain bytes are a valid handle value; the driver fills it.
            let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
            // SAFETY: valid out-pointer; `base` is the allocation's base.
            check(unsafe { sys::cuIpcGetMemHandle(&mut h, info.base) }, "cuIpcGetMemHandle")?;
            let bytes = h.reserved.iter().map(|&c| c as u8).collect();
            let handle = IpcHandle { kind: HandleKind::Legacy, size: info.size, bytes };
            return Ok(Export { handle, keep: None, hold: None });
        }
        // A VMM allocation: export the physical allocation mapped at `info.base` (one chunk of a VMM range, see
        // `pointer_info`) as a fabric handle where it was created with that type requested and the device
        // supports it, and as a POSIX fd (it must have been created with that handle type requested, as
        // PyTorch's expandable segments are): the fd alone, or appended to the fabric handle as the importer's
        // fallback. UNTESTED ON HARDWARE (no GPU was lent; no fabric-capable system was available at all).
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: valid out-pointer; the address is inside a mapped VMM allocation.
        check(
            unsafe { sys::cuMemRetainAllocationHandle(&mut h, info.base as usize as *mut c_void) },
            "cuMemRetainAllocationHandle",
        )?;
        let fabric = self.export_fabric(info, h);
        let mut fd: i32 = -1;
        // SAFETY: for POSIX_FILE_DESCRIPTOR the driver writes an int.
        let r = unsafe {
            sys::cuMemExportToShareableHandle(
                &mut fd as *mut i32 as *mut c_void,
                h,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        };
        // SAFETY: releases the reference taken by cuMemRetainAllocationHandle.
        unsafe { sys::cuMemRelease(h) };
        let fd_export = check(r, "cuMemExportToShareableHandle (VMM allocation without POSIX-fd export)")
            .map_err(|e| Error::not_supported(e.message()));
        let keep = match (fd_export, fabric) {
            // SAFETY: a fresh descriptor from the driver, owned from here on.
            (Ok(()), _) => Some(unsafe { OwnedFd::from_raw_fd(fd) }),
            // A fabric handle only: the allocation was not created for POSIX-fd export.
            (Err(_), Some(_)) => None,
            (Err(e), None) => return Err(e),
        };
        let fd_part = match &keep {
            Some(k) => {
                let id = super::fd_identity(k.as_fd()).map_err(|e| Error::os(Status::Backend, "fstat", e))?;
                Some((k.as_raw_fd(), id))
            }
            None => None,
        };
        let (kind, bytes) = match (fabric, fd_part) {
            (Some(f), fd_part) => (HandleKind::Fabric, super::fabric_handle_bytes(&f, fd_part)),
            (None, Some((num, id))) => (HandleKind::PosixFd, super::fd_handle_bytes(num, id)),
            (None, None) => return Err(Error::backend("VMM export produced no handle")),
        };
        Ok(Export { handle: IpcHandle { kind, size: info.size, bytes }, keep, hold: None })
    }

    fn open(&self, dev: u32, handle: &IpcHandle, fd: FdSource<'_>) -> Result<Box<dyn Mapping>> {
        let ctx = self.ctx(dev)?;
        let _c = Current::enter(ctx)?;
        match handle.kind {
            HandleKind::Legacy => {
                if handle.bytes.len() != 64 {
                    return Err(Error::mismatch("malformed CUDA IPC handle"));
                }
                // SAFETY: plain bytes.
                let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
                for (d, s) in h.reserved.iter_mut().zip(&handle.bytes) {
                    *d = *s as _;
                }
                let mut base = 0u64;
                // SAFETY: valid out-pointer; the handle came from a live peer (the engine checked).
                let r = unsafe {
                    sys::cuIpcOpenMemHandle_v2(
                        &mut base,
                        h,
                        sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as std::ffi::c_uint,
                    )
                };
                check(r, "cuIpcOpenMemHandle")?;
                Ok(Box::new(Legacy { base, ctx }))
            }
            HandleKind::PosixFd | HandleKind::Fabric => {
                let h = if handle.kind == HandleKind::Fabric {
                    let (f, fallback) = super::fabric_handle(&handle.bytes)?;
                    match self.import_fabric(dev, &f) {
                        Ok(h) => h,
                        Err(e) if fallback.is_some() => {
                            crate::telemetry::log::warn(&format!(
                                "VRAM: importing a peer's fabric handle on device {dev} failed ({}); taking its \
                                 POSIX fd instead",
                                e.message()
                            ));
                            import_fd(fd()?)?
                        }
                        Err(e) => {
                            return Err(Error::new(
                                e.status(),
                                format!("{} (the peer's fabric handle has no POSIX-fd fallback)", e.message()),
                            ))
                        }
                    }
                } else {
                    import_fd(fd()?)?
                };
                let size = handle.size as usize;
                let mut base = 0u64;
                // SAFETY: valid out-pointer.
                if let Err(e) =
                    check(unsafe { sys::cuMemAddressReserve(&mut base, size, 0, 0, 0) }, "cuMemAddressReserve")
                {
                    // SAFETY: the imported handle, released once.
                    unsafe { sys::cuMemRelease(h) };
                    return Err(e);
                }
                let undo = |mapped: bool| {
                    // SAFETY: undoing the steps done so far, once.
                    unsafe {
                        if mapped {
                            sys::cuMemUnmap(base, size);
                        }
                        sys::cuMemAddressFree(base, size);
                        sys::cuMemRelease(h);
                    }
                };
                // SAFETY: maps the whole imported allocation into the range just reserved.
                if let Err(e) = check(unsafe { sys::cuMemMap(base, size, 0, h, 0) }, "cuMemMap") {
                    undo(false);
                    return Err(e);
                }
                // SAFETY: zeroed is a valid value for this plain struct; fields set below.
                let mut access: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
                access.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
                access.location.id = dev as i32;
                access.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
                // SAFETY: one valid descriptor for the mapped range.
                if let Err(e) = check(unsafe { sys::cuMemSetAccess(base, size, &access, 1) }, "cuMemSetAccess") {
                    undo(true);
                    return Err(e);
                }
                Ok(Box::new(Vmm { base, size: handle.size, handle: h, ctx }))
            }
        }
    }

    fn copy(&self, dev: u32, copies: &[Copy]) -> Result<()> {
        let ctx = self.ctx(dev)?;
        let _c = Current::enter(ctx)?;
        STREAMS.with(|m| {
            let mut m = m.borrow_mut();
            let s = match m.entry(dev) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(v) => {
                    let mut stream: sys::CUstream = std::ptr::null_mut();
                    // SAFETY: valid out-pointer; the context is current.
                    check(unsafe { sys::cuStreamCreate(&mut stream, 1) }, "cuStreamCreate")?;
                    let mut event: sys::CUevent = std::ptr::null_mut();
                    let flags = sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC as u32
                        | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
                    // SAFETY: as above.
                    if let Err(e) = check(unsafe { sys::cuEventCreate(&mut event, flags) }, "cuEventCreate") {
                        // SAFETY: the stream just created.
                        unsafe { sys::cuStreamDestroy_v2(stream) };
                        return Err(e);
                    }
                    v.insert(Stream { ctx, stream, event })
                }
            };
            for c in copies {
                // SAFETY: both ranges were resolved against registrations or opened mappings that stay valid
                // until this call returns (it waits for the event below).
                check(unsafe { sys::cuMemcpyAsync(c.dst, c.src, c.len as usize, s.stream) }, "cuMemcpyAsync")?;
            }
            // SAFETY: handles owned by this thread.
            check(unsafe { sys::cuEventRecord(s.event, s.stream) }, "cuEventRecord")?;
            // SAFETY: as above; a blocking-sync event: the thread sleeps until the copies are done.
            check(unsafe { sys::cuEventSynchronize(s.event) }, "cuEventSynchronize")
        })
    }

    fn host_buf(&self, dev: u32, len: usize) -> Result<Box<dyn HostBuf>> {
        let ctx = self.ctx(dev)?;
        let _c = Current::enter(ctx)?;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        check(unsafe { sys::cuMemHostAlloc(&mut p, len, 0) }, "cuMemHostAlloc")?;
        Ok(Box::new(Pinned { ptr: p as u64, len, ctx }))
    }

    fn dev_buf(&self, dev: u32, len: usize) -> Result<Box<dyn DevBuf>> {
        let ctx = self.ctx(dev)?;
        let _c = Current::enter(ctx)?;
        let mut p: sys::CUdeviceptr = 0;
        // SAFETY: valid out-pointer; the context is current.
        check(unsafe { sys::cuMemAlloc_v2(&mut p, len) }, "cuMemAlloc")?;
        Ok(Box::new(DevMem { ptr: p, ctx }))
    }

    fn enter(&self, dev: u32) -> Result<Box<dyn std::any::Any>> {
        Ok(Box::new(Current::enter(self.ctx(dev)?)?))
    }
}
