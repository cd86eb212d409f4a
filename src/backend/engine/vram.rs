//! GPU memory (VRAM) in the engine, over the device layer (`crate::device`).
//!
//! Routes, by where the peer is:
//! - loopback and agents in this process: device copies (D2D, H2D, D2H) between addresses valid here;
//! - another process on this host, its region in VRAM: the peer exports the allocation (legacy IPC handle,
//!   or a VMM allocation's POSIX fd that the importer takes with `pidfd_getfd`); the handle travels in the
//!   region's metadata; this engine opens it once per remote allocation (shared by every region inside it),
//!   on first use, and closes it when the last region key holding it goes (remove / invalidate of the peer,
//!   and the last request built on it released). The copy then runs here, in either direction, whatever the
//!   local memory type (DRAM↔VRAM directly, the driver staging pageable memory itself);
//! - another process, its region in DRAM and ours in VRAM: cross-memory attach into a page-locked staging
//!   buffer, and a device copy between the buffer and VRAM (both directions);
//! - another host (TCP): not supported yet (NOT_SUPPORTED at request creation).
//!
//! The gate. A target engine that registers VRAM owns a gate page: a memfd holding its incarnation, a
//! "closed" word and one slot per registered VRAM region (a generation, odd while registered, and an
//! in-flight count). A region's metadata names its slot and generation and the page's descriptor; the
//! initiator takes the page with `pidfd_getfd` (checking its identity) and, around every batch of copies
//! into or out of a peer's region, increments the slot's in-flight count, checks the generation and the
//! closed word, checks synchronously through the peer's pidfd that the process is alive, copies, and
//! decrements. `deregister_memory` bumps the generation and then waits (futex, bounded by the disconnect
//! timeout) for the in-flight count to drain; engine shutdown sets "closed" and does the same for every
//! slot. So: a handle from another incarnation, a deregistered region or a dead peer is refused before it
//! reaches the driver (NOT_FOUND / REMOTE_DISCONNECT), and once `deregister_memory` returns no peer copy is
//! still running on that region (a peer that dies inside a copy is waited for only up to the bound).

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::{copy, downcast, PeerKind, Run, Shared};
use crate::backend::{LocalRegion, Peer, RegionKey, Seg, Target, XferOp, XferPlan};
use crate::device::{self, Copy, Device, Export, HandleKind, HostBuf, IpcHandle, Mapping};
use crate::md::{put_bytes, put_uvar, Reader};
use crate::mem::{MemType, RegDesc};
use crate::status::{Error, Result, Status};

const PUBLIC_VERSION: u8 = 1;
/// Slots in a gate page (16 bytes each after a 64-byte header; the page is sparse until used).
const SLOTS: usize = 1 << 16;
const HEADER: usize = 64;
const GATE_BYTES: usize = HEADER + 16 * SLOTS;
/// Staging buffer for DRAM (remote, over CMA) ↔ VRAM (local) copies.
const STAGE: u64 = 8 << 20;

/// The gate page, mapped in the target (which owns it) or in an initiator (which took it).
struct GatePage {
    ptr: usize,
    fd: OwnedFd,
}

// SAFETY: the mapping is shared memory accessed only through atomics.
unsafe impl Send for GatePage {}
// SAFETY: as above.
unsafe impl Sync for GatePage {}

impl Drop for GatePage {
    fn drop(&mut self) {
        // SAFETY: our own mapping, unused once the last reference goes.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, GATE_BYTES) };
    }
}

fn map_gate(fd: BorrowedFd<'_>) -> Result<usize> {
    // SAFETY: mapping a memfd we hold, shared.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            GATE_BYTES,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(Error::os(Status::Backend, "mapping the VRAM gate page", std::io::Error::last_os_error()));
    }
    Ok(p as usize)
}

impl GatePage {
    fn create(incarnation: u128) -> Result<GatePage> {
        // SAFETY: plain syscall with a static name; the result is checked.
        let fd = unsafe { libc::memfd_create(c"gixl-vram-gate".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(Error::os(Status::Backend, "memfd_create (VRAM gate)", std::io::Error::last_os_error()));
        }
        // SAFETY: a fresh descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: sizing our own memfd.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), GATE_BYTES as libc::off_t) } != 0 {
            return Err(Error::os(Status::Backend, "ftruncate (VRAM gate)", std::io::Error::last_os_error()));
        }
        let ptr = map_gate(fd.as_fd())?;
        let g = GatePage { ptr, fd };
        g.word64(0).store(incarnation as u64, Ordering::SeqCst);
        g.word64(8).store((incarnation >> 64) as u64, Ordering::SeqCst);
        Ok(g)
    }

    fn word64(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off + 8 <= GATE_BYTES && off & 7 == 0);
        // SAFETY: inside the mapping, aligned; the mapping lives as long as `self`.
        unsafe { &*((self.ptr + off) as *const AtomicU64) }
    }
    fn word32(&self, off: usize) -> &AtomicU32 {
        debug_assert!(off + 4 <= GATE_BYTES && off & 3 == 0);
        // SAFETY: as above.
        unsafe { &*((self.ptr + off) as *const AtomicU32) }
    }
    fn incarnation(&self) -> u128 {
        self.word64(0).load(Ordering::SeqCst) as u128 | (self.word64(8).load(Ordering::SeqCst) as u128) << 64
    }
    fn closed(&self) -> &AtomicU32 {
        self.word32(16)
    }
    fn gen(&self, slot: u32) -> &AtomicU64 {
        self.word64(HEADER + 16 * slot as usize)
    }
    fn inflight(&self, slot: u32) -> &AtomicU32 {
        self.word32(HEADER + 16 * slot as usize + 8)
    }
    fn waiters(&self, slot: u32) -> &AtomicU32 {
        self.word32(HEADER + 16 * slot as usize + 12)
    }

    /// Enter slot `slot` if it still holds generation `gen` of incarnation `inc`.
    fn enter(&self, slot: u32, gen: u64, inc: u128) -> Result<()> {
        self.inflight(slot).fetch_add(1, Ordering::SeqCst);
        let why = if self.closed().load(Ordering::SeqCst) != 0 || self.incarnation() != inc {
            Some(Error::disconnected("the peer's agent has been destroyed"))
        } else if self.gen(slot).load(Ordering::SeqCst) != gen {
            Some(Error::not_found("the peer has deregistered this VRAM region"))
        } else {
            None
        };
        match why {
            None => Ok(()),
            Some(e) => {
                self.leave(slot);
                Err(e)
            }
        }
    }

    fn leave(&self, slot: u32) {
        if self.inflight(slot).fetch_sub(1, Ordering::SeqCst) == 1 && self.waiters(slot).load(Ordering::SeqCst) != 0 {
            futex_wake(self.inflight(slot));
        }
    }

    /// Make `slot`'s current generation stale, then wait (up to `limit`) until no copy is inside it.
    fn close_slot(&self, slot: u32, limit: Duration) -> bool {
        self.gen(slot).fetch_add(1, Ordering::SeqCst);
        let end = Instant::now() + limit;
        loop {
            let n = self.inflight(slot).load(Ordering::SeqCst);
            if n == 0 {
                return true;
            }
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            self.waiters(slot).fetch_add(1, Ordering::SeqCst);
            futex_wait(self.inflight(slot), n, left);
            self.waiters(slot).fetch_sub(1, Ordering::SeqCst);
        }
    }
}

fn futex_wait(w: &AtomicU32, val: u32, limit: Duration) {
    let ts = libc::timespec { tv_sec: limit.as_secs() as libc::time_t, tv_nsec: limit.subsec_nanos() as libc::c_long };
    // SAFETY: a shared (non-private) futex on a word of a shared mapping; returns on wake, change or timeout.
    unsafe { libc::syscall(libc::SYS_futex, w.as_ptr(), libc::FUTEX_WAIT, val, &ts as *const libc::timespec, 0, 0) };
}

fn futex_wake(w: &AtomicU32) {
    // SAFETY: as above.
    unsafe { libc::syscall(libc::SYS_futex, w.as_ptr(), libc::FUTEX_WAKE, i32::MAX, 0, 0, 0) };
}

/// An exported allocation and how many registered regions use it.
struct Exported {
    export: Export,
    regions: usize,
}

/// The engine's VRAM state (a field of `Shared`).
#[derive(Default)]
pub(super) struct Vram {
    gate: OnceLock<Arc<GatePage>>,
    exports: Mutex<HashMap<u64, Exported>>,
    free_slots: Mutex<(Vec<u32>, u32)>,
}

/// A registered local VRAM region.
struct LocalVram {
    base: u64,
    slot: u32,
    gen: u64,
    dev: u32,
}

impl Vram {
    fn gate(&self, incarnation: u128) -> Result<&Arc<GatePage>> {
        if let Some(g) = self.gate.get() {
            return Ok(g);
        }
        let g = Arc::new(GatePage::create(incarnation)?);
        Ok(self.gate.get_or_init(|| g))
    }

    pub(super) fn register(&self, s: &Shared, desc: &RegDesc) -> Result<LocalRegion> {
        let dev = device::get()?;
        let d = &desc.desc;
        let info = dev.pointer_info(d.addr)?;
        let end = (d.addr - info.base).checked_add(d.len);
        if !matches!(end, Some(e) if e <= info.size) {
            return Err(Error::invalid_param(format!(
                "VRAM region {:#x}+{} crosses the end of its allocation ({:#x}+{})",
                d.addr, d.len, info.base, info.size
            )));
        }
        if d.dev != info.dev as u64 {
            return Err(Error::invalid_param(format!(
                "VRAM region {:#x} is on device {}, not device {}",
                d.addr, info.dev, d.dev
            )));
        }
        let gate = self.gate(s.incarnation)?.clone();
        let mut exports = self.exports.lock();
        let e = match exports.get_mut(&info.base) {
            Some(e) => e,
            None => {
                let export = dev.export(&info)?;
                exports.entry(info.base).or_insert(Exported { export, regions: 0 })
            }
        };
        let slot = {
            let mut f = self.free_slots.lock();
            match f.0.pop() {
                Some(s) => s,
                None if (f.1 as usize) < SLOTS => {
                    f.1 += 1;
                    f.1 - 1
                }
                None => return Err(Error::backend(format!("more than {SLOTS} VRAM regions registered"))),
            }
        };
        let gen = gate.gen(slot).fetch_add(1, Ordering::SeqCst) + 1;
        e.regions += 1;
        let h = &e.export.handle;
        let mut public = vec![PUBLIC_VERSION];
        put_uvar(&mut public, info.dev as u64);
        put_uvar(&mut public, info.size);
        put_uvar(&mut public, d.addr - info.base);
        public.push(h.kind as u8);
        put_bytes(&mut public, &h.bytes);
        put_uvar(&mut public, slot as u64);
        put_uvar(&mut public, gen);
        let gid =
            device::fd_identity(gate.fd.as_fd()).map_err(|e| Error::os(Status::Backend, "fstat (VRAM gate)", e))?;
        put_bytes(&mut public, &device::fd_handle_bytes(gate.fd.as_raw_fd(), gid));
        let key: RegionKey = Arc::new(LocalVram { base: info.base, slot, gen, dev: info.dev });
        Ok(LocalRegion { public, key: Some(key) })
    }

    pub(super) fn deregister(&self, s: &Shared, key: Option<&RegionKey>) {
        let Some(l) = key.and_then(|k| k.downcast_ref::<LocalVram>()) else { return };
        if let Some(g) = self.gate.get() {
            if !g.close_slot(l.slot, s.tcp_opts.timeout) {
                eprintln!("gixl: a peer's copy into a deregistered VRAM region did not finish in time; going on");
            }
        }
        self.free_slots.lock().0.push(l.slot);
        let mut ex = self.exports.lock();
        if let Some(e) = ex.get_mut(&l.base) {
            e.regions -= 1;
            if e.regions == 0 {
                ex.remove(&l.base);
            }
        }
    }

    /// The engine is going away: every copy from a peer is refused from now on; wait for those inside.
    pub(super) fn shutdown(&self, limit: Duration) {
        let Some(g) = self.gate.get() else { return };
        g.closed().store(1, Ordering::SeqCst);
        let end = Instant::now() + limit;
        let used = self.free_slots.lock().1;
        for slot in 0..used {
            while g.inflight(slot).load(Ordering::SeqCst) != 0 {
                let left = end.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return;
                }
                let n = g.inflight(slot).load(Ordering::SeqCst);
                g.waiters(slot).fetch_add(1, Ordering::SeqCst);
                futex_wait(g.inflight(slot), n, left);
                g.waiters(slot).fetch_sub(1, Ordering::SeqCst);
            }
        }
    }
}

/// A peer's VRAM region, from its metadata.
pub(super) struct RemoteVram {
    addr: u64,
    dev: u32,
    offset: u64,
    handle: IpcHandle,
    slot: u32,
    gen: u64,
    gate: IpcHandle,
    incarnation: u128,
    /// The peer's allocation, opened here on first use.
    opened: Mutex<Option<Arc<Opened>>>,
}

/// A peer's allocation opened in this process (shared by its regions); closed when the last one goes.
struct Opened {
    map: Box<dyn Mapping>,
}

/// Opened allocations and gate pages, per peer incarnation, so each is opened once.
#[allow(clippy::type_complexity)]
fn opened() -> &'static Mutex<(HashMap<(u128, Vec<u8>), Weak<Opened>>, HashMap<u128, Weak<GatePage>>)> {
    static O: OnceLock<Mutex<(HashMap<(u128, Vec<u8>), Weak<Opened>>, HashMap<u128, Weak<GatePage>>)>> =
        OnceLock::new();
    O.get_or_init(Default::default)
}

pub(super) fn load_remote(incarnation: u128, addr: u64, public: &[u8]) -> Result<RegionKey> {
    let bad = || Error::mismatch("malformed VRAM region in metadata");
    let mut r = Reader { buf: public, pos: 0 };
    if r.byte()? != PUBLIC_VERSION {
        return Err(Error::mismatch("unknown VRAM region format in metadata"));
    }
    let dev = u32::try_from(r.uvar()?).map_err(|_| bad())?;
    let size = r.uvar()?;
    let offset = r.uvar()?;
    let kind = HandleKind::from_u8(r.byte()?).ok_or_else(bad)?;
    let bytes = r.bytes(256)?.to_vec();
    let slot = u32::try_from(r.uvar()?).ok().filter(|&s| (s as usize) < SLOTS).ok_or_else(bad)?;
    let gen = r.uvar()?;
    let gate = r.bytes(64)?.to_vec();
    if r.left() != 0 || offset > size {
        return Err(bad());
    }
    Ok(Arc::new(RemoteVram {
        addr,
        dev,
        offset,
        handle: IpcHandle { kind, size, bytes },
        slot,
        gen,
        gate: IpcHandle { kind: HandleKind::PosixFd, size: GATE_BYTES as u64, bytes: gate },
        incarnation,
        opened: Mutex::new(None),
    }))
}

/// How a request reaches the remote side.
enum Far {
    /// Addresses valid in this process (loopback, another agent here); `gate` is the target's.
    Here { gate: Option<Arc<GatePage>> },
    /// Another process: its pid and pidfd (borrowed from the peer), its gate page.
    Process { pid: i32, gate: Option<Arc<GatePage>> },
}

/// What `prep` resolved, kept with the request.
pub(super) struct VramPlan {
    far: Far,
    /// Per remote region index: (slot, generation, incarnation, address of the region here, region address
    /// in the peer, opened allocation).
    regions: Vec<Option<RegionUse>>,
    /// Device whose context and streams the copies use.
    dev: u32,
    device: &'static dyn Device,
    remote_is_vram: bool,
    local_is_vram: bool,
}

struct RegionUse {
    slot: u32,
    gen: u64,
    incarnation: u128,
    /// `here - peer`: add to a peer address to get its address in this process.
    shift: u64,
    _open: Option<Arc<Opened>>,
}

fn peer_pidfd(p: &super::EnginePeer) -> Option<BorrowedFd<'_>> {
    match &p.kind {
        PeerKind::Cma { pidfd, .. } => pidfd.as_ref().map(|f| f.as_fd()),
        _ => None,
    }
}

/// Is the process behind `pidfd` still running? (Synchronous: a pidfd polls readable once it exits.)
fn alive(pidfd: BorrowedFd<'_>) -> bool {
    let mut p = libc::pollfd { fd: pidfd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd, no wait.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n == 0
}

fn open_gate(inc: u128, h: &IpcHandle, pidfd: BorrowedFd<'_>) -> Result<Arc<GatePage>> {
    let mut o = opened().lock();
    if let Some(g) = o.1.get(&inc).and_then(Weak::upgrade) {
        return Ok(g);
    }
    let fd = device::take_fd(h, pidfd)?;
    let ptr = map_gate(fd.as_fd())?;
    let g = Arc::new(GatePage { ptr, fd });
    if g.incarnation() != inc {
        return Err(Error::not_found("the peer's VRAM gate belongs to another incarnation"));
    }
    o.1.retain(|_, w| w.strong_count() > 0);
    o.1.insert(inc, Arc::downgrade(&g));
    Ok(g)
}

fn open_alloc(dev: &dyn Device, r: &RemoteVram, on: u32, pidfd: BorrowedFd<'_>) -> Result<Arc<Opened>> {
    let mut cur = r.opened.lock();
    if let Some(o) = cur.as_ref() {
        return Ok(o.clone());
    }
    // One mapping per peer allocation in this process, whichever device first opened it: the address is
    // valid for every device (unified addressing), and CUDA maps a legacy handle once per process.
    let k = (r.incarnation, r.handle.bytes.clone());
    let mut o = opened().lock();
    let op = match o.0.get(&k).and_then(Weak::upgrade) {
        Some(op) => op,
        None => {
            let op = Arc::new(Opened { map: dev.open(on, &r.handle, pidfd)? });
            o.0.retain(|_, w| w.strong_count() > 0);
            o.0.insert(k, Arc::downgrade(&op));
            op
        }
    };
    *cur = Some(op.clone());
    Ok(op)
}

/// Resolve a request that touches VRAM: its route, the device, and (for another process) the peer's gate
/// and allocations, checked against the gate before anything is opened.
pub(super) fn prep(shared: &Arc<Shared>, plan: &XferPlan) -> Result<VramPlan> {
    let device = device::get()?;
    for m in [plan.local_mem, plan.remote_mem] {
        if m != MemType::Dram && m != MemType::Vram {
            return Err(Error::not_supported(format!("this engine does not move {}", m.seg_name())));
        }
    }
    let local_is_vram = plan.local_mem == MemType::Vram;
    let remote_is_vram = plan.remote_mem == MemType::Vram;
    let local_dev = plan.local_keys.iter().flatten().find_map(|k| k.downcast_ref::<LocalVram>()).map(|l| l.dev);
    let (far, peer) = match &plan.target {
        Target::Local => (Far::Here { gate: shared.vram.gate.get().cloned() }, None),
        Target::Remote(p) => {
            let ep = downcast(p)?;
            match &ep.kind {
                PeerKind::InProcess { target, .. } => {
                    let t = target
                        .upgrade()
                        .ok_or_else(|| Error::disconnected(format!("agent '{}' has been destroyed", ep.name)))?;
                    (Far::Here { gate: t.vram.gate.get().cloned() }, Some(ep))
                }
                PeerKind::Cma { pid, pidfd, .. } => {
                    // No pidfd: the peer did not prove it runs here (see `load_peer`); nothing to open.
                    let pidfd = pidfd.as_ref().ok_or_else(|| {
                        Error::disconnected(format!("agent '{}' is not reachable as a local process", ep.name))
                    })?;
                    if !alive(pidfd.as_fd()) {
                        return Err(Error::disconnected(format!("agent '{}' has exited", ep.name)));
                    }
                    (Far::Process { pid: *pid, gate: None }, Some(ep))
                }
                PeerKind::Tcp { .. } => {
                    return Err(Error::not_supported(format!(
                        "VRAM transfers to agent '{}' on another host (TCP) are not implemented",
                        ep.name
                    )))
                }
            }
        }
    };
    let mut far = far;
    let mut regions = Vec::with_capacity(plan.remote_keys.len());
    let remote_dev =
        plan.remote_keys.iter().flatten().find_map(|k| {
            k.downcast_ref::<RemoteVram>().map(|r| r.dev).or(k.downcast_ref::<LocalVram>().map(|l| l.dev))
        });
    // The device whose context runs the copies: the local region's, else (this process) the remote one's,
    // else device 0 (a peer's allocation opened here from DRAM).
    let dev = match (&far, local_dev) {
        (_, Some(d)) => d,
        (Far::Here { .. }, None) => remote_dev.unwrap_or(0),
        (Far::Process { .. }, None) => 0,
    };
    let used: std::collections::BTreeSet<u32> = plan.segs.iter().map(|s| s.rreg).collect();
    for (i, k) in plan.remote_keys.iter().enumerate() {
        if !used.contains(&(i as u32)) {
            regions.push(None);
            continue;
        }
        let k = k.as_ref();
        let u = if let Some(l) = k.and_then(|k| k.downcast_ref::<LocalVram>()) {
            // Loopback or an agent of this process: its own key.
            let inc = match &plan.target {
                Target::Local => shared.incarnation,
                Target::Remote(_) => peer.map(|p| p.incarnation).unwrap_or(0),
            };
            Some(RegionUse { slot: l.slot, gen: l.gen, incarnation: inc, shift: 0, _open: None })
        } else if let Some(r) = k.and_then(|k| k.downcast_ref::<RemoteVram>()) {
            match (&mut far, peer) {
                (Far::Here { .. }, _) => {
                    Some(RegionUse { slot: r.slot, gen: r.gen, incarnation: r.incarnation, shift: 0, _open: None })
                }
                (Far::Process { gate, .. }, Some(ep)) => {
                    let pidfd = peer_pidfd(ep).ok_or_else(|| Error::backend("peer without a pidfd"))?;
                    let g = match gate {
                        Some(g) => g.clone(),
                        None => {
                            let g = open_gate(r.incarnation, &r.gate, pidfd)?;
                            *gate = Some(g.clone());
                            g
                        }
                    };
                    // The gate first: a stale handle never reaches the driver.
                    g.enter(r.slot, r.gen, r.incarnation)?;
                    let op = if alive(pidfd) {
                        open_alloc(device, r, dev, pidfd)
                    } else {
                        Err(Error::disconnected(format!("agent '{}' has exited", ep.name)))
                    };
                    g.leave(r.slot);
                    let op = op?;
                    let here = op.map.base() + r.offset;
                    Some(RegionUse {
                        slot: r.slot,
                        gen: r.gen,
                        incarnation: r.incarnation,
                        shift: here.wrapping_sub(r.addr),
                        _open: Some(op),
                    })
                }
                (Far::Process { .. }, None) => None,
            }
        } else {
            // A DRAM region on the far side: nothing to open (another process: staged through CMA).
            None
        };
        regions.push(u);
    }
    Ok(VramPlan { far, regions, dev, device, remote_is_vram, local_is_vram })
}

impl VramPlan {
    fn gate(&self) -> Option<&Arc<GatePage>> {
        match &self.far {
            Far::Here { gate } | Far::Process { gate, .. } => gate.as_ref(),
        }
    }

    /// Copy `segs` (one piece of a request): enter the gate for every peer region they touch, check the
    /// peer is alive, run the copies, leave.
    pub(super) fn copy(&self, core: &super::Core, segs: &[Seg], run: &Run) -> Result<()> {
        if run.abort.load(Ordering::Relaxed) {
            return Err(Error::new(Status::Canceled, "transfer stopped"));
        }
        let mut entered: Vec<u32> = Vec::new();
        let gate = self.gate();
        let mut r = Ok(());
        if let Some(g) = gate {
            let mut touched: Vec<u32> = segs.iter().map(|s| s.rreg).collect();
            touched.sort_unstable();
            touched.dedup();
            for i in touched {
                if let Some(Some(u)) = self.regions.get(i as usize) {
                    if let Err(e) = g.enter(u.slot, u.gen, u.incarnation) {
                        r = Err(e);
                        break;
                    }
                    entered.push(u.slot);
                }
            }
        }
        if r.is_ok() {
            r = self.check_alive(core).and_then(|_| self.run_copies(core, segs, run));
        }
        if let Some(g) = gate {
            for s in entered {
                g.leave(s);
            }
        }
        r
    }

    fn check_alive(&self, core: &super::Core) -> Result<()> {
        let Some(p) = core.peer() else { return Ok(()) };
        let dead = match (&self.far, peer_pidfd(p)) {
            (Far::Process { .. }, Some(fd)) => !alive(fd),
            _ => p.disconnected(),
        };
        if dead {
            p.dead.store(true, Ordering::Release);
            return Err(Error::disconnected(format!("agent '{}' has exited", p.name)));
        }
        Ok(())
    }

    fn run_copies(&self, core: &super::Core, segs: &[Seg], run: &Run) -> Result<()> {
        let op = core.plan.op;
        let direct = matches!(self.far, Far::Here { .. }) || self.remote_is_vram;
        if direct {
            let copies: Vec<Copy> = segs
                .iter()
                .map(|s| {
                    let shift = self.regions.get(s.rreg as usize).and_then(|u| u.as_ref()).map_or(0, |u| u.shift);
                    let remote = s.remote.wrapping_add(shift);
                    match op {
                        XferOp::Read => Copy { dst: s.local, src: remote, len: s.len },
                        XferOp::Write => Copy { dst: remote, src: s.local, len: s.len },
                    }
                })
                .collect();
            // Remote DRAM of another agent in this process: inside that agent's gate (see `gate`), as DRAM is.
            if !self.remote_is_vram {
                if let Some(PeerKind::InProcess { gate, .. }) = core.peer().map(|p| &p.kind) {
                    let gate = gate.as_ref().ok_or_else(|| Error::disconnected("the peer agent has been destroyed"))?;
                    let _inside = gate.enter(core.gate_regions())?;
                    return self.device.copy(self.dev, &copies);
                }
            }
            return self.device.copy(self.dev, &copies);
        }
        // Local VRAM, remote DRAM in another process: stage through a page-locked buffer.
        debug_assert!(self.local_is_vram);
        let Far::Process { pid, .. } = self.far else { return Err(Error::backend("unreachable route")) };
        let peer = core.peer().ok_or_else(|| Error::backend("unreachable route"))?;
        let PeerKind::Cma { gate: Some(cma_gate), probe, .. } = &peer.kind else {
            return Err(Error::not_supported(format!(
                "agent '{}' cannot be reached by cross-memory attach, which VRAM <-> remote DRAM needs",
                peer.name
            )));
        };
        // The remote DRAM side goes through the peer's CMA gate (see `gate`), batch by batch, as DRAM does.
        let cma = |staged: &[Seg]| -> Result<()> {
            let mut gone = false;
            let r = copy::for_batches(staged, copy::BATCH_SEGS, copy::BATCH_BYTES, &mut |b| {
                if run.abort.load(Ordering::Relaxed) || peer.dead.load(Ordering::Relaxed) {
                    return Err(Error::new(Status::Canceled, "transfer stopped"));
                }
                let inside = cma_gate.enter(core.gate_regions());
                if let Err(e) = &inside {
                    gone = e.status() == Status::RemoteDisconnect;
                }
                let _inside = inside?;
                // SAFETY: the staged local ranges lie inside the staging buffer, alive for the call.
                unsafe { copy::cma_batch(pid, op, b, probe, cma_gate.gate.sentinel(), &mut gone) }
            });
            if gone {
                peer.dead.store(true, Ordering::Release);
            }
            r
        };
        let buf = Staging::take(self.device, self.dev)?;
        let mut chunk: Vec<Seg> = Vec::new();
        let mut used = 0u64;
        let flush = |chunk: &mut Vec<Seg>| -> Result<()> {
            if chunk.is_empty() {
                return Ok(());
            }
            // `local` of each staged segment is its place in the buffer; `orig` the VRAM address.
            let mut staged = Vec::with_capacity(chunk.len());
            let mut dev_copies = Vec::with_capacity(chunk.len());
            let mut off = 0u64;
            for s in chunk.iter() {
                let mut t = *s;
                t.local = buf.ptr() + off;
                staged.push(t);
                dev_copies.push(match op {
                    XferOp::Read => Copy { dst: s.local, src: t.local, len: s.len },
                    XferOp::Write => Copy { dst: t.local, src: s.local, len: s.len },
                });
                off += s.len;
            }
            match op {
                XferOp::Read => {
                    cma(&staged)?;
                    self.device.copy(self.dev, &dev_copies)?;
                }
                XferOp::Write => {
                    self.device.copy(self.dev, &dev_copies)?;
                    cma(&staged)?;
                }
            }
            chunk.clear();
            Ok(())
        };
        for s in segs {
            let mut s = *s;
            while s.len > 0 {
                if used == STAGE {
                    flush(&mut chunk)?;
                    used = 0;
                }
                let take = s.len.min(STAGE - used);
                let mut piece = s;
                piece.len = take;
                chunk.push(piece);
                used += take;
                s.local += take;
                s.remote += take;
                s.len -= take;
            }
        }
        flush(&mut chunk)
    }
}

/// Page-locked staging buffers, kept for reuse (allocating pinned memory costs milliseconds).
struct Staging {
    dev: u32,
    buf: Option<Box<dyn HostBuf>>,
}

type Kept = Vec<(u32, Box<dyn HostBuf>)>;

fn staging_pool() -> &'static Mutex<Kept> {
    static P: OnceLock<Mutex<Kept>> = OnceLock::new();
    P.get_or_init(Default::default)
}

/// Buffers kept in the pool at most.
const STAGING_KEPT: usize = 8;

impl Staging {
    fn take(device: &dyn Device, dev: u32) -> Result<Staging> {
        let kept = {
            let mut p = staging_pool().lock();
            p.iter().position(|(d, _)| *d == dev).map(|i| p.swap_remove(i).1)
        };
        let buf = match kept {
            Some(b) => b,
            None => device.host_buf(dev, STAGE as usize)?,
        };
        Ok(Staging { dev, buf: Some(buf) })
    }

    fn ptr(&self) -> u64 {
        self.buf.as_ref().map_or(0, |b| b.ptr())
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        let mut p = staging_pool().lock();
        if let Some(b) = self.buf.take() {
            if p.len() < STAGING_KEPT {
                p.push((self.dev, b));
            }
        }
    }
}

/// Whether a plan goes through this module.
pub(super) fn wants(plan: &XferPlan) -> bool {
    plan.local_mem == MemType::Vram || plan.remote_mem == MemType::Vram
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::{Agent, AgentConfig, NotifUpdate, XferOpts};
    use crate::backend::Params;
    use crate::device::fake;
    use crate::mem::{Desc, RegDList, XferDList};

    fn agent(name: &str) -> Agent {
        assert!(device::select_fake(), "this test process must use the fake device");
        let a = Agent::new(name, AgentConfig::default()).unwrap();
        a.create_backend("UCX", &Params::new()).unwrap();
        a
    }

    fn vram(dev: u32, len: usize, fill: impl Fn(usize) -> u8) -> u64 {
        let p = fake::alloc(dev, len, false, None).unwrap();
        // SAFETY: a fresh fake allocation of `len` bytes in this process.
        let s = unsafe { std::slice::from_raw_parts_mut(p as usize as *mut u8, len) };
        for (i, b) in s.iter_mut().enumerate() {
            *b = fill(i);
        }
        p
    }

    fn bytes(p: u64, len: usize) -> Vec<u8> {
        // SAFETY: test allocations of at least `len` bytes.
        unsafe { std::slice::from_raw_parts(p as usize as *const u8, len) }.to_vec()
    }

    fn reg(a: &Agent, mem: MemType, addr: u64, len: usize, dev: u64) -> RegDList {
        let l = RegDList::with_descs(mem, vec![RegDesc { desc: Desc::new(addr, len as u64, dev), meta: vec![] }]);
        a.register_mem(&l, &[]).unwrap();
        l
    }

    fn xl(mem: MemType, addr: u64, len: usize, dev: u64) -> XferDList {
        XferDList::with_descs(mem, vec![Desc::new(addr, len as u64, dev)])
    }

    /// A request with default options from `local` to `remote` of `peer`.
    fn req(a: &Agent, op: XferOp, local: XferDList, remote: XferDList, peer: &str) -> crate::agent::XferReq {
        a.create_xfer_req(op, &local, &remote, peer, &XferOpts::default()).unwrap()
    }

    fn run(a: &Agent, r: &crate::agent::XferReq) -> Result<Status> {
        let mut s = a.post_xfer_req(r, NotifUpdate::Keep)?;
        let t = Instant::now();
        while s == Status::InProg && t.elapsed() < Duration::from_secs(20) {
            std::thread::sleep(Duration::from_micros(200));
            s = a.xfer_status(r)?;
        }
        Ok(s)
    }

    #[test]
    fn vram_in_process_read_write_and_dram_both_ways() {
        let a = agent("vram-ip-A");
        let b = agent("vram-ip-B");
        let n = 3 << 20; // above the inline limit: split across copy threads
        let src = vram(1, n, |i| (i % 253) as u8);
        let dst = vram(0, n, |_| 0);
        reg(&b, MemType::Vram, src, n, 1);
        reg(&a, MemType::Vram, dst, n, 0);
        let host = vec![0u8; n];
        reg(&a, MemType::Dram, host.as_ptr() as u64, n, 0);
        a.load_remote_md(&b.local_md().unwrap()).unwrap();
        let r = req(&a, XferOp::Read, xl(MemType::Vram, dst, n, 0), xl(MemType::Vram, src, n, 1), "vram-ip-B");
        assert_eq!(run(&a, &r).unwrap(), Status::Success);
        assert!(bytes(dst, n) == bytes(src, n));
        // Remote VRAM → local DRAM, then local DRAM → remote VRAM at an offset.
        let r = req(
            &a,
            XferOp::Read,
            xl(MemType::Dram, host.as_ptr() as u64, n, 0),
            xl(MemType::Vram, src, n, 1),
            "vram-ip-B",
        );
        assert_eq!(run(&a, &r).unwrap(), Status::Success);
        assert!(host == bytes(src, n));
        let w = req(
            &a,
            XferOp::Write,
            xl(MemType::Dram, host.as_ptr() as u64 + 7, 1000, 0),
            xl(MemType::Vram, src + 4096, 1000, 1),
            "vram-ip-B",
        );
        assert_eq!(run(&a, &w).unwrap(), Status::Success);
        assert_eq!(bytes(src + 4096, 1000), host[7..1007]);
        // Loopback VRAM → VRAM within one agent.
        let l = req(
            &a,
            XferOp::Write,
            xl(MemType::Vram, dst, 4096, 0),
            xl(MemType::Vram, dst + 8192, 4096, 0),
            "vram-ip-A",
        );
        assert_eq!(run(&a, &l).unwrap(), Status::Success);
        assert_eq!(bytes(dst + 8192, 4096), bytes(dst, 4096));
    }

    #[test]
    fn vram_target_deregistration_is_exact() {
        let a = agent("vram-dereg-A");
        let b = agent("vram-dereg-B");
        let n = 1 << 20;
        let src = vram(2, n, |_| 9);
        let dst = vram(3, n, |_| 0);
        let bl = reg(&b, MemType::Vram, src, n, 2);
        reg(&a, MemType::Vram, dst, n, 3);
        a.load_remote_md(&b.local_md().unwrap()).unwrap();
        let r = req(&a, XferOp::Write, xl(MemType::Vram, dst, n, 3), xl(MemType::Vram, src, n, 2), "vram-dereg-B");
        assert_eq!(run(&a, &r).unwrap(), Status::Success);
        assert!(bytes(src, n).iter().all(|&x| x == 0));
        // The target deregisters; the initiator's metadata still lists the region, the target's gate does not.
        b.deregister_mem(&bl, &[]).unwrap();
        let before = bytes(src, n);
        // SAFETY: the test's own allocation of `n` bytes.
        let dst_s = unsafe { std::slice::from_raw_parts_mut(dst as usize as *mut u8, n) };
        dst_s.fill(0x55);
        let e = run(&a, &r).unwrap_err();
        assert_eq!(e.status(), Status::NotFound, "{e}");
        assert!(bytes(src, n) == before, "a deregistered region was written");
        // Registered again: a new generation; the old handle stays refused, fresh metadata works.
        reg(&b, MemType::Vram, src, n, 2);
        assert_eq!(run(&a, &r).unwrap_err().status(), Status::NotFound);
        a.invalidate_remote_md("vram-dereg-B").unwrap();
        a.load_remote_md(&b.local_md().unwrap()).unwrap();
        let r2 = req(&a, XferOp::Write, xl(MemType::Vram, dst, n, 3), xl(MemType::Vram, src, n, 2), "vram-dereg-B");
        assert_eq!(run(&a, &r2).unwrap(), Status::Success);
        assert!(bytes(src, n).iter().all(|&x| x == 0x55));
    }

    #[test]
    fn vram_registration_is_checked_against_the_device() {
        let a = agent("vram-check");
        let p = vram(4, 8192, |_| 0);
        let bad = |addr: u64, len: u64, dev: u64| {
            let l =
                RegDList::with_descs(MemType::Vram, vec![RegDesc { desc: Desc::new(addr, len, dev), meta: vec![] }]);
            a.register_mem(&l, &[]).unwrap_err()
        };
        let host = [0u8; 64];
        assert!(bad(host.as_ptr() as u64, 64, 0).message().contains("not device memory"));
        assert!(bad(p + 4096, 8192, 4).message().contains("crosses the end"));
        assert!(bad(p, 4096, 5).message().contains("device 4"));
    }

    #[test]
    fn gate_deregistration_waits_for_a_copy_inside() {
        let g = Arc::new(GatePage::create(7).unwrap());
        let gen = g.gen(3).fetch_add(1, Ordering::SeqCst) + 1;
        g.enter(3, gen, 7).unwrap();
        assert_eq!(g.enter(3, gen, 8).unwrap_err().status(), Status::RemoteDisconnect);
        let g2 = g.clone();
        let closer = std::thread::spawn(move || {
            let ok = g2.close_slot(3, Duration::from_secs(20));
            (ok, Instant::now())
        });
        // Leave only once the closer is seen waiting: it must return after this, not before.
        while g.waiters(3).load(Ordering::SeqCst) == 0 {
            std::thread::yield_now();
        }
        let left_at = Instant::now();
        g.leave(3);
        let (ok, returned_at) = closer.join().unwrap();
        assert!(ok && returned_at >= left_at);
        assert_eq!(g.enter(3, gen, 7).unwrap_err().status(), Status::NotFound);
        // A copy that never leaves holds deregistration only up to the bound.
        let gen = g.gen(4).fetch_add(1, Ordering::SeqCst) + 1;
        g.enter(4, gen, 7).unwrap();
        let t = Instant::now();
        assert!(!g.close_slot(4, Duration::from_millis(50)));
        assert!(t.elapsed() >= Duration::from_millis(50));
    }
}
