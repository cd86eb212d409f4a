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

use std::collections::{BTreeMap, HashMap};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use parking_lot::Mutex;

use super::{Copy, Device, Export, FdSource, HandleKind, HostBuf, IpcHandle, Mapping, PtrInfo};
use crate::status::{Error, Result, Status};

/// Fake devices 0..DEVICES exist.
pub const DEVICES: u32 = 8;

struct Alloc {
    size: u64,
    dev: u32,
    vmm: bool,
    fd: OwnedFd,
    ino: u64,
}

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

/// Allocate `size` bytes of fake device memory on device `dev` (at `at` if given). `vmm` chooses how it
/// is exported: a VMM allocation (POSIX fd handle) or a legacy one.
pub fn alloc(dev: u32, size: usize, vmm: bool, at: Option<u64>) -> Result<u64> {
    if dev >= DEVICES || size == 0 {
        return Err(Error::invalid_param("fake device: bad device or size"));
    }
    let (fd, ino) = memfd(size)?;
    let base = map(fd.as_fd(), size as u64, at)?;
    state().lock().allocs.insert(base, Alloc { size: size as u64, dev, vmm, fd, ino });
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
    for &size in sizes {
        let (fd, ino) = memfd(size)?;
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
        made.push((at as u64, Alloc { size: size as u64, dev, vmm, fd, ino }));
        off += size;
    }
    state().lock().allocs.extend(made);
    Ok(r as u64)
}

/// A fresh memfd of `size` bytes and its inode.
fn memfd(size: usize) -> Result<(OwnedFd, u64)> {
    // SAFETY: plain syscall with a static name; the result is checked.
    let fd = unsafe { libc::memfd_create(c"gixl-fake-vram".as_ptr(), libc::MFD_CLOEXEC) };
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

/// Page-locked host memory this process holds now (`Device::host_buf` buffers not yet freed).
pub fn pinned_bytes() -> u64 {
    PINNED.load(Ordering::Relaxed)
}

struct Pinned(Vec<u8>);

impl Drop for Pinned {
    fn drop(&mut self) {
        PINNED.fetch_sub(self.0.len() as u64, Ordering::Relaxed);
    }
}

impl HostBuf for Pinned {
    fn ptr(&self) -> u64 {
        self.0.as_ptr() as u64
    }
    fn size(&self) -> usize {
        self.0.len()
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
        let kind = if a.vmm { HandleKind::PosixFd } else { HandleKind::Legacy };
        let bytes = super::fd_handle_bytes(keep.as_raw_fd(), id);
        Ok(Export { handle: IpcHandle { kind, size: a.size, bytes }, keep: Some(keep) })
    }

    fn open(&self, dev: u32, handle: &IpcHandle, fd: FdSource<'_>) -> Result<Box<dyn Mapping>> {
        if dev >= DEVICES {
            return Err(Error::invalid_param(format!("fake device {dev} does not exist")));
        }
        let fd = fd()?;
        let ino = super::fd_identity(fd.as_fd()).map_err(|e| Error::os(Status::Backend, "fake device: fstat", e))?.1;
        let base = map(fd.as_fd(), handle.size, None)?;
        let mut s = state().lock();
        s.mapped.insert(base, (handle.size, ino));
        s.counts.entry(ino).or_default().opens += 1;
        Ok(Box::new(FakeMapping { base, size: handle.size, ino }))
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
        COPIED.fetch_add(copies.iter().map(|c| c.len).sum(), Ordering::Relaxed);
        for c in copies {
            // SAFETY: the engine resolved both ranges against registrations or opened mappings of this
            // process, which stay mapped for the duration of the call.
            unsafe { std::ptr::copy(c.src as usize as *const u8, c.dst as usize as *mut u8, c.len as usize) };
        }
        Ok(())
    }

    fn host_buf(&self, _dev: u32, len: usize) -> Result<Box<dyn HostBuf>> {
        PINNED.fetch_add(len as u64, Ordering::Relaxed);
        Ok(Box::new(Pinned(vec![0u8; len])))
    }
}
