//! The GPU driver as the engine sees it: a handful of operations behind a trait, so the VRAM route
//! (`backend::engine::vram`) runs the same code over the real driver (`cuda`, behind the `cuda` feature,
//! loaded at run time through cudarc) and over a fake that emulates device memory in shared host memory
//! (`fake`, always compiled, chosen with `GIXL_FAKE_DEVICE=1` or [`select_fake`]). The fake lets the
//! multi-process protocol, handle lifetime, the gate and the failure paths run in CI without a GPU.
//!
//! Operations:
//! - pointer attributes: which device and which allocation (base, size) an address belongs to;
//! - export / open / close of an allocation for another process: a legacy IPC handle (64 opaque bytes,
//!   regions addressed by their offset inside the allocation) or, for VMM allocations (PyTorch's expandable
//!   segments), a shareable POSIX fd that the exporter keeps open; the importer gets it from the engine
//!   (`pidfd_getfd`, or the exporter's control socket with SCM_RIGHTS where the kernel refuses that) and
//!   checks that it is the object the handle names ([`same_object`]); or, for a VMM allocation created with
//!   the fabric handle type requested on a device that supports it, a fabric handle (64 opaque bytes: no
//!   descriptor passing, valid across the nodes of one NVLink domain; importing needs an IMEX channel),
//!   preferred over the fd, with the POSIX-fd part appended where the allocation allows that too, so an
//!   importer whose fabric import fails (no IMEX channel, no fabric support) falls back to the fd, saying so
//!   in the log ([`fabric_handle_bytes`]). The fake emulates a fabric handle by a name under /dev/shm
//!   (see `fake`);
//! - copies (device↔device, host↔device) on streams the engine owns, completion by an event that the
//!   calling thread waits on (a blocking-sync event: the thread sleeps, no busy polling);
//! - page-locked host buffers for staged copies;
//! - a dma-buf descriptor of a range, for an RDMA NIC to reach device memory directly (GPU-direct RDMA).
//!
//! The real implementation makes the device's primary context current on the calling thread before every
//! driver call, so any internal thread may call it.

use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::OnceLock;

use crate::status::{Error, Result};

#[cfg(feature = "cuda")]
mod cuda;
#[doc(hidden)]
pub mod fake;

/// Where an address lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PtrInfo {
    /// Device ordinal.
    pub dev: u32,
    /// The allocation containing the address: what one handle exports. In a VMM range (several physical
    /// chunks mapped back to back) that is the chunk, not the range.
    pub base: u64,
    pub size: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum HandleKind {
    /// `cuIpcGetMemHandle`: 64 opaque bytes.
    Legacy = 1,
    /// A VMM allocation exported as a POSIX fd: the bytes are the exporter's fd number and the identity the
    /// importer checks after taking it.
    PosixFd = 2,
    /// A VMM allocation exported as a fabric handle (`CU_MEM_HANDLE_TYPE_FABRIC`): 64 opaque bytes, then
    /// optionally the `PosixFd` bytes of the same allocation as a fallback ([`fabric_handle`]).
    Fabric = 3,
}

impl HandleKind {
    pub fn from_u8(v: u8) -> Option<HandleKind> {
        match v {
            1 => Some(HandleKind::Legacy),
            2 => Some(HandleKind::PosixFd),
            3 => Some(HandleKind::Fabric),
            _ => None,
        }
    }
}

/// How another process opens an allocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IpcHandle {
    pub kind: HandleKind,
    /// Allocation size.
    pub size: u64,
    pub bytes: Vec<u8>,
}

/// An exported allocation. Dropping it releases what the export holds (the fd of a VMM export).
pub struct Export {
    pub handle: IpcHandle,
    pub keep: Option<OwnedFd>,
    /// Anything else the export holds until dropped (the fake's fabric name).
    pub hold: Option<Box<dyn std::any::Any + Send + Sync>>,
}

/// A peer's allocation opened in this process; dropping it closes it.
pub trait Mapping: Send + Sync {
    /// The allocation's address in this process.
    fn base(&self) -> u64;
}

/// One copy: `len` bytes from `src` to `dst`, either of which may be device or host memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Copy {
    pub dst: u64,
    pub src: u64,
    pub len: u64,
}

/// A page-locked host buffer; dropping it frees it.
pub trait HostBuf: Send {
    fn ptr(&self) -> u64;
    fn size(&self) -> usize;
}

/// Device memory this process allocated itself (the GDS self-test's buffers); dropping it frees it.
pub trait DevBuf: Send {
    fn ptr(&self) -> u64;
}

/// Where `Device::open` gets the exporter's descriptor for an fd-based handle (called at most once).
pub type FdSource<'a> = &'a dyn Fn() -> Result<OwnedFd>;

pub trait Device: Send + Sync + 'static {
    /// "cuda" or "fake".
    fn kind(&self) -> &'static str;
    /// The device and allocation of `addr`; an error if it is not device memory.
    fn pointer_info(&self, addr: u64) -> Result<PtrInfo>;
    /// Make the allocation openable by other processes.
    fn export(&self, info: &PtrInfo) -> Result<Export>;
    /// Open a peer's allocation on device `dev`. For an fd-based handle, `fd` gives the exporter's
    /// descriptor, already checked to be the object the handle names.
    fn open(&self, dev: u32, handle: &IpcHandle, fd: FdSource<'_>) -> Result<Box<dyn Mapping>>;
    /// Run `copies` on an engine-owned stream of device `dev` and return once they are complete.
    fn copy(&self, dev: u32, copies: &[Copy]) -> Result<()>;
    /// A page-locked host buffer of `len` bytes, for staging.
    fn host_buf(&self, dev: u32, len: usize) -> Result<Box<dyn HostBuf>>;
    /// `len` bytes of device memory on device `dev`, owned by the caller.
    fn dev_buf(&self, dev: u32, len: usize) -> Result<Box<dyn DevBuf>>;
    /// Make device `dev`'s context current on the calling thread until the returned guard is dropped (the
    /// previous one is put back then), for libraries that act on device pointers in the calling thread's
    /// context (cuFile). The fake has no contexts.
    fn enter(&self, dev: u32) -> Result<Box<dyn std::any::Any>>;
    /// A dma-buf descriptor of the device memory under `[addr, addr + len)` (inside one allocation) and the
    /// offset of `addr` in it, for a NIC to register that memory without staging (`ibv_reg_dmabuf_mr`).
    /// NOT_SUPPORTED where the driver or the device cannot export one.
    fn dmabuf(&self, addr: u64, len: u64) -> Result<(OwnedFd, u64)>;
    /// Device `dev`'s place in the PCI tree (its sysfs path, as `verbs::PortInfo::pci`), where known: the RDMA
    /// route prefers the NIC that shares most of it.
    fn pci_path(&self, dev: u32) -> Option<String>;
}

enum Choice {
    Fake,
    #[cfg(feature = "cuda")]
    Cuda,
    #[cfg(not(feature = "cuda"))]
    Off,
}

static CHOICE: OnceLock<Choice> = OnceLock::new();

fn choice() -> &'static Choice {
    CHOICE.get_or_init(|| {
        if std::env::var("GIXL_FAKE_DEVICE").is_ok_and(|v| v.trim() == "1") {
            return Choice::Fake;
        }
        #[cfg(feature = "cuda")]
        return Choice::Cuda;
        #[cfg(not(feature = "cuda"))]
        Choice::Off
    })
}

/// Use the fake device in this process (tests). Returns false if the real one was already chosen.
#[doc(hidden)]
pub fn select_fake() -> bool {
    matches!(CHOICE.get_or_init(|| Choice::Fake), Choice::Fake)
}

/// Whether this process uses the fake device.
#[doc(hidden)]
pub fn is_fake() -> bool {
    matches!(choice(), Choice::Fake)
}

/// The device layer of this process, or NOT_SUPPORTED saying why there is none.
pub fn get() -> Result<&'static dyn Device> {
    match choice() {
        Choice::Fake => Ok(fake::device()),
        #[cfg(feature = "cuda")]
        Choice::Cuda => cuda::device(),
        #[cfg(not(feature = "cuda"))]
        Choice::Off => {
            Err(Error::not_supported("VRAM needs GPU support (the `cuda` feature), which this build of gixl lacks"))
        }
    }
}

/// (st_dev, st_ino) of a descriptor: the identity an importer checks after `pidfd_getfd`.
pub(crate) fn fd_identity(fd: BorrowedFd<'_>) -> std::io::Result<(u64, u64)> {
    use std::os::fd::AsRawFd;
    // SAFETY: `st` is a valid out-pointer; the fd is borrowed for the call.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((st.st_dev, st.st_ino))
}

/// The fd part of a `PosixFd` handle: `fd i32 | st_dev u64 | st_ino u64`.
pub(crate) fn fd_handle_bytes(fd: i32, id: (u64, u64)) -> Vec<u8> {
    let mut b = Vec::with_capacity(20);
    b.extend_from_slice(&fd.to_le_bytes());
    b.extend_from_slice(&id.0.to_le_bytes());
    b.extend_from_slice(&id.1.to_le_bytes());
    b
}

/// Length of a fabric handle (`CUmemFabricHandle`).
pub const FABRIC_LEN: usize = 64;

/// An fd handle's content: the exporter's descriptor number and its identity (st_dev, st_ino).
pub(crate) type FdPart = (i32, (u64, u64));

/// The bytes of a `Fabric` handle: the 64-byte fabric handle, then the `PosixFd` bytes of the same
/// allocation where it can also be exported that way (the importer's fallback).
pub(crate) fn fabric_handle_bytes(fabric: &[u8; FABRIC_LEN], fd: Option<FdPart>) -> Vec<u8> {
    let mut b = fabric.to_vec();
    if let Some((num, id)) = fd {
        b.extend_from_slice(&fd_handle_bytes(num, id));
    }
    b
}

/// The fabric handle and the optional fd fallback in a `Fabric` handle's bytes.
pub(crate) fn fabric_handle(b: &[u8]) -> Result<([u8; FABRIC_LEN], Option<FdPart>)> {
    let (f, rest) = b.split_at_checked(FABRIC_LEN).ok_or_else(|| Error::mismatch("malformed fabric handle"))?;
    let mut fabric = [0u8; FABRIC_LEN];
    fabric.copy_from_slice(f);
    let fd = if rest.is_empty() { None } else { Some(fd_handle(rest)?) };
    Ok((fabric, fd))
}

/// The exporter's descriptor number and identity for an fd-based handle: a `PosixFd` handle (or a
/// `Legacy` one of the fake device, which is a descriptor too; CUDA never asks for one), or the
/// fallback part of a `Fabric` one (NOT_SUPPORTED where it has none: the importer cannot take the fabric
/// route and the exporter offered nothing else).
pub(crate) fn fd_of(h: &IpcHandle) -> Result<FdPart> {
    match h.kind {
        HandleKind::PosixFd | HandleKind::Legacy => fd_handle(&h.bytes),
        HandleKind::Fabric => fabric_handle(&h.bytes)?.1.ok_or_else(|| {
            Error::not_supported(
                "the peer exported this VRAM allocation as a fabric handle only, and it could not be imported \
                 here (see the previous error or the log); the allocation offers no POSIX-fd fallback",
            )
        }),
    }
}

/// The exporter's descriptor number and identity in an fd handle's bytes.
pub(crate) fn fd_handle(b: &[u8]) -> Result<(i32, (u64, u64))> {
    if b.len() != 20 {
        return Err(Error::mismatch("malformed fd handle"));
    }
    let num = |r: std::ops::Range<usize>| {
        let mut a = [0u8; 8];
        a[..r.len()].copy_from_slice(&b[r]);
        u64::from_le_bytes(a)
    };
    Ok((num(0..4) as u32 as i32, (num(4..12), num(12..20))))
}

/// `fd` if it is the object of identity `want` (st_dev, st_ino): a descriptor taken from a peer by number
/// names whatever the peer has open under that number now.
pub(crate) fn same_object(fd: OwnedFd, want: (u64, u64)) -> Result<OwnedFd> {
    let id = fd_identity(std::os::fd::AsFd::as_fd(&fd))
        .map_err(|e| Error::os(crate::Status::Backend, "fstat of the peer's allocation handle", e))?;
    if id != want {
        return Err(Error::not_found("the peer no longer exports this allocation (its handle names another object)"));
    }
    Ok(fd)
}
