//! A device that keeps "device memory" in shared host memory, for tests without a GPU.
//!
//! An allocation is a memfd mapped into this process; its address is the "device pointer". Exporting it
//! hands out the memfd's descriptor number and identity (for either handle kind); a peer opens it by
//! getting the descriptor from the engine (as a VMM POSIX-fd handle is: `pidfd_getfd`, or SCM_RIGHTS over
//! the exporter's control socket) and mapping it. As with CUDA IPC, an opened mapping
//! keeps the memory alive after the exporter frees it or exits: writing through a stale mapping "succeeds"
//! into memory nobody reads, which is exactly what the engine's gate must prevent. Every open and every
//! copy through an opened mapping is counted per allocation, so tests can show that a stale handle never
//! reached the "driver".
//!
//! Fabric handles (`GIXL_FAKE_FABRIC`, read when an allocation is made): `1` backs VMM allocations with an
//! unnamed file in /dev/shm (`O_TMPFILE`) and exports them as `Fabric` handles: at export the file gets a
//! name (`/dev/shm/gixl-fake-fabric-<pid>-<inode>`, removed when the export is dropped; a process that dies
//! while exporting leaves it behind), and the 64 handle bytes are a tag, the inode and that name, from which
//! an importer opens the memory by path, no descriptor passing, as a real fabric handle needs none. The
//! POSIX-fd bytes follow as the importer's fallback. `refuse` makes the fabric export fail (as with no
//! IMEX channel), so the allocation is exported as a POSIX fd, with a log line. Importing a fabric handle
//! is supported unless `GIXL_FAKE_FABRIC=0` (or [`set_fabric_import`]); where it is not, or where the name
//! cannot be opened, the importer falls back to the fd part, or fails NOT_SUPPORTED without one.
//! Two agents of one process exporting the same allocation at once cannot both name it: the second export
//! goes as a POSIX fd (logged).

use std::collections::{BTreeMap, HashMap};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use parking_lot::Mutex;

use super::{Copy, DevBuf, Device, Export, FdSource, HandleKind, HostBuf, IpcHandle, Mapping, PtrInfo};
use crate::status::{Error, Result, Status};

/// Fake devices 0..DEVICES exist.
pub const DEVICES: u32 = 8;

struct Alloc {
    size: u64,
    dev: u32,
    vmm: bool,
    fd: OwnedFd,
    ino: u64,
    fabric: Fabric,
}

/// Whether a VMM allocation asks for fabric export (`GIXL_FAKE_FABRIC` when it was made).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fabric {
    No,
    /// Backed by /dev/shm: exported as a fabric handle.
    Yes,
    /// Requested, but the "driver" refuses the fabric export.
    Refused,
}

fn fabric_wanted(vmm: bool) -> Fabric {
    match std::env::var("GIXL_FAKE_FABRIC").as_deref().map(str::trim) {
        Ok("1") if vmm => Fabric::Yes,
        Ok("refuse") if vmm => Fabric::Refused,
        _ => Fabric::No,
    }
}

/// 0: from the environment; 1: fabric handles are imported; 2: they are not.
static FABRIC_IMPORT: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Whether this process's fake device imports fabric handles (tests switch it off to see the fallback).
pub fn set_fabric_import(on: bool) {
    FABRIC_IMPORT.store(if on { 1 } else { 2 }, Ordering::Relaxed);
}

fn fabric_import() -> bool {
    match FABRIC_IMPORT.load(Ordering::Relaxed) {
        1 => true,
        2 => false,
        _ => std::env::var("GIXL_FAKE_FABRIC").map_or(true, |v| v.trim() != "0"),
    }
}

/// Tag that starts a fake fabric handle.
const FABRIC_TAG: &[u8; 8] = b"gixlFAB1";

#[derive(Default)]
struct State {
    /// This process's allocations by base address.
    allocs: BTreeMap<u64, Alloc>,
    /// Opened peer allocations: base → (size, inode).
    mapped: BTreeMap<u64, (u64, u64)>,
    /// Per allocation identity (inode): opens, closes, copies through an opened mapping.
    counts: HashMap<u64, Counts>,
}

/// What the fake driver did with one allocation, as seen from this process.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    pub opens: u64,
    pub closes: u64,
    pub copies: u64,
    /// Opens that went by a fabric handle (no descriptor from the exporter).
    pub fabric_opens: u64,
}

fn state() -> &'static Mutex<State> {
    static S: OnceLock<Mutex<State>> = OnceLock::new();
    S.get_or_init(Default::default)
}

pub struct Fake;

pub(super) fn device() -> &'static dyn Device {
    static D: Fake = Fake;
    &D
}

fn map(fd: BorrowedFd<'_>, size: u64, at: Option<u64>) -> Result<u64> {
    let flags = libc::MAP_SHARED | if at.is_some() { libc::MAP_FIXED_NOREPLACE } else { 0 };
    // SAFETY: mapping a descriptor we hold; a fixed address only where nothing is mapped (NOREPLACE).
    let p = unsafe {
        libc::mmap(
            at.unwrap_or(0) as usize as *mut libc::c_void,
            size as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            flags,
            fd.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(Error::os(Status::Backend, "fake device: mmap", std::io::Error::last_os_error()));
    }
    if at.is_some_and(|a| a != p as u64) {
        // SAFETY: unmapping what we just mapped.
        unsafe { libc::munmap(p, size as usize) };
        return Err(Error::backend("fake device: the requested address is taken"));
    }
    Ok(p as u64)
}

/// Whether any byte of `[addr, addr + len)` is this process's fake device memory (the fake NIC refuses to
/// register it as host memory, as a real one does without a peer-memory module).
pub(crate) fn is_device_memory(addr: u64, len: u64) -> bool {
    let Some(end) = addr.checked_add(len) else { return false };
    let s = state().lock();
    s.allocs.range(..end).next_back().is_some_and(|(&base, a)| base + a.size > addr)
}

/// Allocate `size` bytes of fake device memory on device `dev` (at `at` if given). `vmm` chooses how it
/// is exported: a VMM allocation (POSIX fd handle) or a legacy one.
pub fn alloc(dev: u32, size: usize, vmm: bool, at: Option<u64>) -> Result<u64> {
    if dev >= DEVICES || size == 0 {
        return Err(Error::invalid_param("fake device: bad device or size"));
    }
    let fabric = fabric_wanted(vmm);
    let (fd, ino) = memfd(size, fabric == Fabric::Yes)?;
    let base = map(fd.as_fd(), size as u64, at)?;
    state().lock().allocs.insert(base, Alloc { size: size as u64, dev, vmm, fd, ino, fabric });
    Ok(base)
}

/// One virtual range backed by several allocations mapped back to back, `sizes[i]` bytes each, as a VMM
/// range is (PyTorch's expandable segments map one physical chunk after another into a reserved range):
/// each chunk is its own allocation (its own pointer range, export and handle). Returns the range's start.
pub fn alloc_chunks(dev: u32, sizes: &[usize], vmm: bool, at: Option<u64>) -> Result<u64> {
    if dev >= DEVICES || sizes.is_empty() || sizes.iter().any(|&s| s == 0 || s % 4096 != 0) {
        return Err(Error::invalid_param("fake device: bad device or chunk sizes (page multiples)"));
    }
    let total: usize = sizes.iter().sum();
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | if at.is_some() { libc::MAP_FIXED_NOREPLACE } else { 0 };
    // SAFETY: reserving address space (no access); a fixed address only where nothing is mapped.
    let r = unsafe { libc::mmap(at.unwrap_or(0) as usize as *mut libc::c_void, total, libc::PROT_NONE, flags, -1, 0) };
    if r == libc::MAP_FAILED || at.is_some_and(|a| a != r as u64) {
        if r != libc::MAP_FAILED {
            // SAFETY: unmapping what we just mapped.
            unsafe { libc::munmap(r, total) };
        }
        return Err(Error::backend("fake device: cannot reserve the chunked range"));
    }
    let mut off = 0usize;
    let mut made = Vec::with_capacity(sizes.len());
    let fabric = fabric_wanted(vmm);
    for &size in sizes {
        let (fd, ino) = memfd(size, fabric == Fabric::Yes)?;
        let at = r as usize + off;
        // SAFETY: replacing part of our own reservation (MAP_FIXED inside it) with the chunk.
        let p = unsafe {
            libc::mmap(
                at as *mut libc::c_void,
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            // SAFETY: our own reservation and the chunks mapped into it.
            unsafe { libc::munmap(r, total) };
            return Err(Error::os(Status::Backend, "fake device: mapping a chunk", std::io::Error::last_os_error()));
        }
        made.push((at as u64, Alloc { size: size as u64, dev, vmm, fd, ino, fabric }));
        off += size;
    }
    state().lock().allocs.extend(made);
    Ok(r as u64)
}

/// A fresh memfd of `size` bytes and its inode; for a fabric-exported allocation an unnamed file in
/// /dev/shm instead (it can be given a name there at export).
fn memfd(size: usize, shm: bool) -> Result<(OwnedFd, u64)> {
    let fd = if shm {
        // SAFETY: plain syscall with a static path; the result is checked.
        let fd = unsafe { libc::open(c"/dev/shm".as_ptr(), libc::O_TMPFILE | libc::O_RDWR | libc::O_CLOEXEC, 0o600) };
        if fd < 0 {
            let e = std::io::Error::last_os_error();
            return Err(Error::os(Status::Backend, "fake device: O_TMPFILE in /dev/shm (fake fabric)", e));
        }
        fd
    } else {
        // SAFETY: plain syscall with a static name; the result is checked.
        unsafe { libc::memfd_create(c"gixl-fake-vram".as_ptr(), libc::MFD_CLOEXEC) }
    };
    if fd < 0 {
        return Err(Error::os(Status::Backend, "fake device: memfd_create", std::io::Error::last_os_error()));
    }
    // SAFETY: a fresh descriptor we own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: resizing our own memfd.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), size as libc::off_t) } != 0 {
        return Err(Error::os(Status::Backend, "fake device: ftruncate", std::io::Error::last_os_error()));
    }
    let ino = super::fd_identity(fd.as_fd()).map_err(|e| Error::os(Status::Backend, "fake device: fstat", e))?.1;
    Ok((fd, ino))
}

/// Free an allocation made by [`alloc`]. Peers that opened it keep their mapping (as with CUDA IPC).
pub fn free(base: u64) -> Result<()> {
    let a = state().lock().allocs.remove(&base).ok_or_else(|| Error::not_found("fake device: not an allocation"))?;
    // SAFETY: unmapping an allocation of ours that the caller gives up.
    unsafe { libc::munmap(base as usize as *mut libc::c_void, a.size as usize) };
    Ok(())
}

/// The identity (inode) of the allocation at `base` of this process, to look up [`counts`] in a peer.
pub fn identity(base: u64) -> Option<u64> {
    state().lock().allocs.get(&base).map(|a| a.ino)
}

/// What this process's fake driver did with the allocation of identity `ino`.
pub fn counts(ino: u64) -> Counts {
    state().lock().counts.get(&ino).copied().unwrap_or_default()
}

/// Removes a fake fabric handle's name when its export is dropped.
struct Unlink(std::ffi::CString);

impl Drop for Unlink {
    fn drop(&mut self) {
        // SAFETY: a path we created; failure (already gone) is ignored.
        unsafe { libc::unlink(self.0.as_ptr()) };
    }
}

/// Give the /dev/shm-backed allocation `fd` a name under /dev/shm; the fake fabric handle naming it.
fn name_for_fabric(fd: &OwnedFd, ino: u64) -> Result<([u8; super::FABRIC_LEN], std::ffi::CString)> {
    let name = format!("gixl-fake-fabric-{}-{ino}", std::process::id());
    let path = std::ffi::CString::new(format!("/dev/shm/{name}")).map_err(|_| Error::backend("fake fabric path"))?;
    let from = std::ffi::CString::new(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .map_err(|_| Error::backend("fake fabric path"))?;
    // SAFETY: two NUL-terminated paths; links our own unnamed O_TMPFILE file under /dev/shm.
    if unsafe { libc::linkat(libc::AT_FDCWD, from.as_ptr(), libc::AT_FDCWD, path.as_ptr(), libc::AT_SYMLINK_FOLLOW) }
        != 0
    {
        let e = std::io::Error::last_os_error();
        return Err(Error::os(Status::Backend, "fake device: naming the allocation under /dev/shm", e));
    }
    let mut h = [0u8; super::FABRIC_LEN];
    h[..8].copy_from_slice(FABRIC_TAG);
    h[8..16].copy_from_slice(&ino.to_le_bytes());
    h[16..16 + name.len()].copy_from_slice(name.as_bytes());
    Ok((h, path))
}

/// Open the memory a fake fabric handle names, checking that it is the allocation the handle says.
fn open_fabric(h: &[u8; super::FABRIC_LEN]) -> Result<OwnedFd> {
    let bad = || Error::mismatch("fake device: malformed fabric handle");
    if &h[..8] != FABRIC_TAG {
        return Err(bad());
    }
    let ino = u64::from_le_bytes(h[8..16].try_into().map_err(|_| bad())?);
    let name = &h[16..];
    let name = &name[..name.iter().position(|&b| b == 0).unwrap_or(name.len())];
    if name.is_empty() || name.contains(&b'/') || !name.starts_with(b"gixl-fake-fabric-") {
        return Err(bad());
    }
    let mut path = b"/dev/shm/".to_vec();
    path.extend_from_slice(name);
    let path = std::ffi::CString::new(path).map_err(|_| bad())?;
    // SAFETY: a NUL-terminated path; the result is checked.
    let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC | libc::O_NOFOLLOW) };
    if fd < 0 {
        let e = std::io::Error::last_os_error();
        return Err(Error::os(Status::Backend, "fake device: opening the fabric handle's memory", e));
    }
    // SAFETY: a fresh descriptor we own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let id = super::fd_identity(fd.as_fd()).map_err(|e| Error::os(Status::Backend, "fake device: fstat", e))?;
    if id.1 != ino {
        return Err(Error::not_found("fake device: the fabric handle names another allocation now"));
    }
    Ok(fd)
}

/// Open a peer's allocation: by its fabric handle where there is one and `fabric` (this process imports
/// fabric handles), falling back to the exporter's descriptor (`fd`) with a log line.
fn open_with(fabric: bool, handle: &IpcHandle, fd: FdSource<'_>) -> Result<Box<dyn Mapping>> {
    let mut by_fabric = false;
    let fd = match handle.kind {
        HandleKind::Fabric => {
            let (h, fallback) = super::fabric_handle(&handle.bytes)?;
            let got = if fabric {
                open_fabric(&h)
            } else {
                Err(Error::not_supported("this fake device does not import fabric handles (GIXL_FAKE_FABRIC=0)"))
            };
            match got {
                Ok(f) => {
                    by_fabric = true;
                    f
                }
                Err(e) if fallback.is_some() => {
                    crate::telemetry::log::warn(&format!(
                        "VRAM: importing a peer's fabric handle failed ({}); taking its POSIX fd instead",
                        e.message()
                    ));
                    fd()?
                }
                Err(e) => {
                    return Err(Error::new(
                        e.status(),
                        format!("{} (the peer's fabric handle has no POSIX-fd fallback)", e.message()),
                    ))
                }
            }
        }
        HandleKind::Legacy | HandleKind::PosixFd => fd()?,
    };
    let ino = super::fd_identity(fd.as_fd()).map_err(|e| Error::os(Status::Backend, "fake device: fstat", e))?.1;
    let base = map(fd.as_fd(), handle.size, None)?;
    let mut s = state().lock();
    s.mapped.insert(base, (handle.size, ino));
    let c = s.counts.entry(ino).or_default();
    c.opens += 1;
    c.fabric_opens += by_fabric as u64;
    Ok(Box::new(FakeMapping { base, size: handle.size, ino }))
}

struct FakeMapping {
    base: u64,
    size: u64,
    ino: u64,
}

impl Mapping for FakeMapping {
    fn base(&self) -> u64 {
        self.base
    }
}

impl Drop for FakeMapping {
    fn drop(&mut self) {
        let mut s = state().lock();
        s.mapped.remove(&self.base);
        s.counts.entry(self.ino).or_default().closes += 1;
        // SAFETY: our own mapping, no longer referenced (the engine drops it after the last copy).
        unsafe { libc::munmap(self.base as usize as *mut libc::c_void, self.size as usize) };
    }
}

/// Bytes moved by `copy` in this process, and page-locked bytes held now (see [`copied_bytes`]).
static COPIED: AtomicU64 = AtomicU64::new(0);
static PINNED: AtomicU64 = AtomicU64::new(0);

/// Bytes this process's fake driver has copied (every `Device::copy`, any direction): shows that a
/// route staged through device copies rather than touching device memory another way.
pub fn copied_bytes() -> u64 {
    COPIED.load(Ordering::Relaxed)
}

/// Bytes this process's fake driver has copied on device `dev` (0 for a device that does not exist): tests that
/// watch one device's copies are not disturbed by other tests' copies on other devices.
pub fn copied_bytes_on(dev: u32) -> u64 {
    COPIED_DEV.get(dev as usize).map_or(0, |c| c.load(Ordering::Relaxed))
}

static COPIED_DEV: [AtomicU64; DEVICES as usize] = [const { AtomicU64::new(0) }; DEVICES as usize];

/// Page-locked host memory this process holds now (`Device::host_buf` buffers not yet freed).
pub fn pinned_bytes() -> u64 {
    PINNED.load(Ordering::Relaxed)
}

/// Page-aligned, as the driver's page-locked allocations are (O_DIRECT file I/O from them depends on it).
/// An allocation made through [`Device::dev_buf`], freed when dropped.
struct Owned(u64);

impl DevBuf for Owned {
    fn ptr(&self) -> u64 {
        self.0
    }
}

impl Drop for Owned {
    fn drop(&mut self) {
        let _ = free(self.0);
    }
}

struct Pinned {
    ptr: *mut u8,
    len: usize,
    layout: std::alloc::Layout,
}

// SAFETY: the buffer is plain memory owned by this value; whoever holds it decides who touches it.
unsafe impl Send for Pinned {}

impl Pinned {
    fn new(len: usize) -> Result<Pinned> {
        let layout = std::alloc::Layout::from_size_align(len.max(1), 4096)
            .map_err(|_| Error::invalid_param(format!("fake device: no host buffer of {len} bytes")))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(Error::backend(format!("fake device: out of memory for a {len}-byte host buffer")));
        }
        PINNED.fetch_add(len as u64, Ordering::Relaxed);
        Ok(Pinned { ptr, len, layout })
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        PINNED.fetch_sub(self.len as u64, Ordering::Relaxed);
        // SAFETY: allocated in `new` with this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) };
    }
}

impl HostBuf for Pinned {
    fn ptr(&self) -> u64 {
        self.ptr as u64
    }
    fn size(&self) -> usize {
        self.len
    }
}

impl Device for Fake {
    fn kind(&self) -> &'static str {
        "fake"
    }

    fn pointer_info(&self, addr: u64) -> Result<PtrInfo> {
        let s = state().lock();
        match s.allocs.range(..=addr).next_back() {
            Some((&base, a)) if addr - base < a.size => Ok(PtrInfo { dev: a.dev, base, size: a.size }),
            _ => Err(Error::invalid_param(format!("address {addr:#x} is not device memory"))),
        }
    }

    fn export(&self, info: &PtrInfo) -> Result<Export> {
        let s = state().lock();
        let a = s.allocs.get(&info.base).ok_or_else(|| Error::invalid_param("fake device: not an allocation"))?;
        let id = super::fd_identity(a.fd.as_fd()).map_err(|e| Error::os(Status::Backend, "fake device: fstat", e))?;
        // The export holds its own descriptor (as a VMM export does), so freeing the allocation while it is
        // registered cannot hand its number to another object.
        let keep = a.fd.try_clone().map_err(|e| Error::os(Status::Backend, "fake device: dup", e))?;
        let fd_part = (keep.as_raw_fd(), id);
        let refused = match a.fabric {
            Fabric::No => None,
            Fabric::Yes => match name_for_fabric(&a.fd, a.ino) {
                Ok((fabric, name)) => {
                    let bytes = super::fabric_handle_bytes(&fabric, Some(fd_part));
                    let handle = IpcHandle { kind: HandleKind::Fabric, size: a.size, bytes };
                    return Ok(Export { handle, keep: Some(keep), hold: Some(Box::new(Unlink(name))) });
                }
                Err(e) => Some(e),
            },
            Fabric::Refused => Some(Error::backend("fake device: fabric export refused (GIXL_FAKE_FABRIC=refuse)")),
        };
        if let Some(e) = refused {
            crate::telemetry::log::warn(&format!(
                "VRAM allocation {:#x}: fabric handle export failed ({}); exported as a POSIX fd instead",
                info.base,
                e.message()
            ));
        }
        let kind = if a.vmm { HandleKind::PosixFd } else { HandleKind::Legacy };
        let bytes = super::fd_handle_bytes(fd_part.0, fd_part.1);
        Ok(Export { handle: IpcHandle { kind, size: a.size, bytes }, keep: Some(keep), hold: None })
    }

    fn open(&self, dev: u32, handle: &IpcHandle, fd: FdSource<'_>) -> Result<Box<dyn Mapping>> {
        if dev >= DEVICES {
            return Err(Error::invalid_param(format!("fake device {dev} does not exist")));
        }
        open_with(fabric_import(), handle, fd)
    }

    fn copy(&self, dev: u32, copies: &[Copy]) -> Result<()> {
        if dev >= DEVICES {
            return Err(Error::invalid_param(format!("fake device {dev} does not exist")));
        }
        {
            let mut s = state().lock();
            for c in copies {
                for a in [c.dst, c.src] {
                    let ino = match s.mapped.range(..=a).next_back() {
                        Some((&b, &(size, ino))) if a - b < size => Some(ino),
                        _ => None,
                    };
                    if let Some(ino) = ino {
                        s.counts.entry(ino).or_default().copies += 1;
                    }
                }
            }
        }
        let n = copies.iter().map(|c| c.len).sum();
        COPIED.fetch_add(n, Ordering::Relaxed);
        COPIED_DEV[dev as usize].fetch_add(n, Ordering::Relaxed);
        for c in copies {
            // SAFETY: the engine resolved both ranges against registrations or opened mappings of this
            // process, which stay mapped for the duration of the call.
            unsafe { std::ptr::copy(c.src as usize as *const u8, c.dst as usize as *mut u8, c.len as usize) };
        }
        Ok(())
    }

    fn host_buf(&self, _dev: u32, len: usize) -> Result<Box<dyn HostBuf>> {
        Ok(Box::new(Pinned::new(len)?))
    }

    fn dev_buf(&self, dev: u32, len: usize) -> Result<Box<dyn DevBuf>> {
        Ok(Box::new(Owned(alloc(dev, len, false, None)?)))
    }

    fn enter(&self, dev: u32) -> Result<Box<dyn std::any::Any>> {
        if dev >= DEVICES {
            return Err(Error::invalid_param(format!("fake device {dev} does not exist")));
        }
        Ok(Box::new(()))
    }

    /// Entry `dev` of `GIXL_FAKE_DEVICE_PCI` (comma-separated sysfs paths: the tests' topology).
    fn pci_path(&self, dev: u32) -> Option<String> {
        crate::util::env_list_entry("GIXL_FAKE_DEVICE_PCI", dev)
    }

    /// The allocation's memfd, duplicated (a dma-buf of the whole allocation), unless `GIXL_FAKE_DMABUF=0`
    /// (a driver or GPU without dma-buf export).
    fn dmabuf(&self, addr: u64, len: u64) -> Result<(OwnedFd, u64)> {
        if std::env::var("GIXL_FAKE_DMABUF").is_ok_and(|v| v.trim() == "0") {
            return Err(Error::not_supported("fake device: no dma-buf export (GIXL_FAKE_DMABUF=0)"));
        }
        let s = state().lock();
        let (base, a) = match s.allocs.range(..=addr).next_back() {
            Some((&base, a)) if addr - base < a.size => (base, a),
            _ => return Err(Error::invalid_param(format!("address {addr:#x} is not device memory"))),
        };
        if addr.checked_add(len).is_none_or(|end| end > base + a.size) {
            return Err(Error::not_supported(format!(
                "fake device: {addr:#x}+{len} spans more than one allocation: no single dma-buf"
            )));
        }
        let fd = a.fd.try_clone().map_err(|e| Error::os(Status::Backend, "fake device: dup", e))?;
        Ok((fd, addr - base))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fabric_import_without_support_falls_back_to_the_fd_or_fails_clearly() {
        let base = alloc(2, 8192, true, None).unwrap();
        let (fd, ino) = {
            let s = state().lock();
            let a = &s.allocs[&base];
            (a.fd.try_clone().unwrap(), a.ino)
        };
        let id = crate::device::fd_identity(fd.as_fd()).unwrap();
        let mut fabric = [0u8; crate::device::FABRIC_LEN];
        fabric[..8].copy_from_slice(FABRIC_TAG);
        fabric[8..16].copy_from_slice(&ino.to_le_bytes());
        fabric[16..].copy_from_slice(&[b'x'; 48]);
        let take = || Ok(fd.try_clone().unwrap());
        let only = IpcHandle {
            kind: HandleKind::Fabric,
            size: 8192,
            bytes: crate::device::fabric_handle_bytes(&fabric, None),
        };
        // No fabric support here and no fallback: NOT_SUPPORTED, and the fd is never asked for.
        let never = || -> Result<OwnedFd> { panic!("the fd source must not be called") };
        let e = open_with(false, &only, &never).err().unwrap();
        assert_eq!(e.status(), Status::NotSupported);
        assert!(e.message().contains("no POSIX-fd fallback"), "{}", e.message());
        // With support, a name that is not a fake fabric name is refused as malformed.
        assert_eq!(open_with(true, &only, &never).err().unwrap().status(), Status::Mismatch);
        // With the fd part appended, the importer falls back to it.
        let both = IpcHandle {
            kind: HandleKind::Fabric,
            size: 8192,
            bytes: crate::device::fabric_handle_bytes(&fabric, Some((fd.as_raw_fd(), id))),
        };
        let before = counts(ino);
        let m = open_with(false, &both, &take).unwrap();
        let after = counts(ino);
        assert_eq!((after.opens - before.opens, after.fabric_opens - before.fabric_opens), (1, 0));
        drop(m);
        free(base).unwrap();
    }
}
