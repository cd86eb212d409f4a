//! The target's gate: what every same-host transfer (cross-memory attach or in-process copy) must pass,
//! kept by the target, not by the initiator's cache of the target's metadata.
//!
//! Each engine incarnation creates one shared memory object (a sealed-size `memfd`, close-on-exec) and maps
//! it at an address chosen at random (not by ASLR, so a re-executed image with ASLR off does not get the same
//! one). It holds:
//! - a header: magic, layout version, the incarnation id, a live flag, and the words a drain waits on;
//! - one slot per registration: a state word (`generation << 1 | live`), the registered address and length.
//!   The slot and state travel in the region's public metadata bytes;
//! - one slot per initiator (another engine of this host that reaches this one): its owner (pid and start
//!   time, so a dead owner's slot is reclaimed), its count of batches in flight, and a second word holding the
//!   same count beside a mask of the region slots those batches touch (`OFF_MASKED`), so that retiring a
//!   region waits only for initiators whose batches may touch it.
//!
//! An initiator maps the same object (taken from the target with `pidfd_getfd(2)`, which needs the very ptrace
//! permission cross-memory attach needs, or, where the kernel refuses that call alone — a container's seccomp profile —
//! received from the target's control socket with SCM_RIGHTS; in-process peers share the mapping) and brackets every
//! batch of copies with [`Attached::enter`]: increment its in-flight count, then check the live flag and the state of
//! every region the request touches. The target retires a region (or the whole incarnation) by changing the state first
//! and then waiting, bounded, until every in-flight count is zero. Both sides use sequentially consistent operations on
//! the two words, so either the initiator sees the retirement or the target sees the batch and waits for it: once
//! `deregister` or the agent's destruction returns, no batch that passed the gate is still copying.
//!
//! Cross-memory attach names the target by pid. To tie each call to this incarnation's address space the
//! engine makes the first remote iovec of every `process_vm_readv/writev` call a 16-byte access to the gate's
//! mapping at its advertised address (see `copy::cma_copy`): the kernel resolves the pid to one address space
//! per call and stops at the first element that faults, so in an exec'd image or another process (where that
//! random address is not mapped) the call fails before any data moves; a read also returns the incarnation id
//! from that address, proving which object the data came from.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::status::{Error, Result, Status};

const MAGIC: u64 = u64::from_le_bytes(*b"GIXLGATE");
const VERSION: u64 = 1;

const PAGE: usize = 4096;
/// Initiator slots: one per engine of this host that reaches this one (64 bytes each).
pub const INIT_SLOTS: usize = 256;
const INIT_BYTES: usize = 64;
/// In an initiator slot: its batches in flight (every gixl writes it; a drain by an older gixl reads only this).
const OFF_COUNT: usize = 24;
/// In an initiator slot: `count << MASK_BITS | mask`, changed in one atomic step on entering and leaving, the
/// mask cleared when the count drops to zero. Bit `slot % MASK_BITS` is set for every region slot a batch
/// inside may touch (collisions only make a drain wait for more, never less). An initiator of an older gixl
/// leaves it zero, and `OFF_COUNT` above it says so.
const OFF_MASKED: usize = 32;
const MASK_BITS: u32 = 40;
const MASK: u64 = (1 << MASK_BITS) - 1;
/// Registrations one incarnation can hold at once (32 bytes each; untouched pages cost nothing).
pub const REGION_SLOTS: usize = 1 << 16;
const REGION_BYTES: usize = 32;
const INIT_BASE: usize = PAGE;
const REGION_BASE: usize = INIT_BASE + INIT_SLOTS * INIT_BYTES;
pub const SIZE: usize = REGION_BASE + REGION_SLOTS * REGION_BYTES;

// Header words.
const OFF_MAGIC: usize = 0;
const OFF_VERSION: usize = 8;
/// The incarnation id, 16 bytes little-endian: what a probing read returns.
pub const OFF_INCARNATION: usize = 16;
const OFF_LIVE: usize = 32;
/// Futex word bumped by an initiator leaving while a drain waits.
const OFF_DRAIN_SEQ: usize = 40;
/// Drains in progress.
const OFF_DRAINING: usize = 48;
/// One past the highest initiator slot ever claimed (bounds the drain's scan).
const OFF_CLAIMED: usize = 56;
/// The sentinel word (`os::sentinel`): the owner's thread id until the kernel flips it at exit or exec; 0 if the
/// owner has none (an older gixl). Reads check it after each call instead of probing.
const OFF_SENTINEL: usize = 64;
/// Scratch bytes a probing write lands on.
pub const OFF_PROBE: usize = 128;
pub const PROBE_BYTES: usize = 16;

/// Where gates are placed: [2^40, 2^45), far below where mmap and the heap start on x86-64 and arm64 (with or
/// without ASLR), so another process is very unlikely to map anything at a gate's address.
const PLACE_LO: u64 = 1 << 40;
const PLACE_HI: u64 = 1 << 45;

/// A gate mapping: the target's own (`owner`) or an initiator's view of a peer's.
pub struct Gate {
    base: *mut u8,
    incarnation: u128,
    /// The memfd, kept open by the owner so that peers can take it with `pidfd_getfd`.
    fd: OwnedFd,
    /// Owner only: free region slots.
    regions: Mutex<RegionAlloc>,
    /// Owner only: the thread behind the sentinel word (None if it could not start: peers then probe).
    sentinel: Option<crate::os::sentinel::Sentinel>,
}

// SAFETY: the mapping is only accessed through atomics (and immutable-while-live region fields).
unsafe impl Send for Gate {}
// SAFETY: as above.
unsafe impl Sync for Gate {}

#[derive(Default)]
struct RegionAlloc {
    free: Vec<u32>,
    next: u32,
}

impl Drop for Gate {
    fn drop(&mut self) {
        // The sentinel's robust list names a word of the mapping: end it before unmapping.
        drop(self.sentinel.take());
        // SAFETY: `base` is our own mapping of SIZE bytes; nothing references it once the last owner is gone.
        unsafe { libc::munmap(self.base.cast(), SIZE) };
    }
}

fn os(what: &str, e: io::Error) -> Error {
    Error::os(Status::Backend, what.to_owned(), e)
}

/// A syscall's result `r`, or (negative) the OS error as `what` failing.
fn check(r: libc::c_int, what: &str) -> Result<libc::c_int> {
    (r >= 0).then_some(r).ok_or_else(|| os(what, io::Error::last_os_error()))
}

/// A target-side registration's place in the gate: the slot and the state word that is live while it lasts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionTicket {
    pub slot: u32,
    pub state: u64,
}

impl Gate {
    /// A fresh gate for a new engine incarnation, mapped at a random address.
    pub fn create(incarnation: u128) -> Result<Gate> {
        // SAFETY: a valid NUL-terminated name; flags are constants.
        let fd = unsafe { libc::memfd_create(c"gixl-gate".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        // SAFETY: a fresh descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(check(fd, "memfd_create for the transfer gate")?) };
        // SAFETY: plain syscalls on our descriptor.
        check(unsafe { libc::ftruncate(fd.as_raw_fd(), SIZE as libc::off_t) }, "sizing the transfer gate")?;
        // The size can never change, so a peer's mapping never faults (SIGBUS) on a truncated object.
        // SAFETY: as above.
        let seal = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK | libc::F_SEAL_GROW) };
        check(seal, "sealing the transfer gate")?;
        let base = map_random(fd.as_raw_fd())?;
        let mut g = Gate { base, incarnation, fd, regions: Mutex::default(), sentinel: None };
        g.word(OFF_INCARNATION).store(incarnation as u64, Ordering::Relaxed);
        g.word(OFF_INCARNATION + 8).store((incarnation >> 64) as u64, Ordering::Relaxed);
        g.word(OFF_VERSION).store(VERSION, Ordering::Relaxed);
        g.word(OFF_LIVE).store(1, Ordering::Relaxed);
        // SAFETY: the word is inside the mapping, which `Drop` keeps until the sentinel has ended.
        match unsafe { crate::os::sentinel::Sentinel::start(g.word32(OFF_SENTINEL)) } {
            Ok(s) => g.sentinel = Some(s),
            Err(e) => crate::telemetry::log::warn(&format!(
                "no exit/exec sentinel for this agent ({e}); same-host peers probe the gate on reads as well"
            )),
        }
        g.word(OFF_MAGIC).store(MAGIC, Ordering::Release);
        Ok(g)
    }

    /// Map a peer's gate, taken from its process through `pidfd` (the descriptor number it advertises), and
    /// check that it is the gate of `incarnation`. Errors: EPERM/ENOSYS as `io::Error` sources (the kernel
    /// forbids reaching that process: the caller falls back to TCP); anything else is REMOTE_DISCONNECT.
    #[cfg(test)]
    pub fn attach(pidfd: RawFd, remote_fd: i32, incarnation: u128) -> Result<Gate> {
        // SAFETY: plain syscall; the result is checked.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd, remote_fd, 0) };
        if fd < 0 {
            let e = io::Error::last_os_error();
            return Err(match e.raw_os_error() {
                Some(libc::EPERM) | Some(libc::ENOSYS) => os("pidfd_getfd (taking the peer's transfer gate)", e),
                _ => {
                    Error::os(Status::RemoteDisconnect, "the peer's transfer gate is gone (pidfd_getfd)".to_owned(), e)
                }
            });
        }
        // SAFETY: a fresh descriptor we own.
        Gate::from_fd(unsafe { OwnedFd::from_raw_fd(fd as i32) }, incarnation)
    }

    /// Map a peer's gate from its descriptor (however it was obtained: `pidfd_getfd`, or SCM_RIGHTS over
    /// the peer's control socket) and check that it is the gate of `incarnation`: REMOTE_DISCONNECT if not.
    pub fn from_fd(fd: OwnedFd, incarnation: u128) -> Result<Gate> {
        let gone =
            || Error::disconnected("the peer's transfer gate does not belong to the incarnation its metadata names");
        let sealed = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
        // SAFETY: `st` is a valid out-pointer.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // A plain file of exactly SIZE bytes, size-sealed, or its owner could shrink it under our mapping.
        // SAFETY: plain syscalls on a descriptor we own.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0
            || (st.st_mode & libc::S_IFMT) != libc::S_IFREG
            || st.st_size != SIZE as libc::off_t
            || unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) }.max(0) & sealed != sealed
        {
            return Err(gone());
        }
        let base = crate::util::map_shared(fd.as_raw_fd(), SIZE, true)
            .map_err(|e| os("mapping the peer's transfer gate", e))?;
        let g = Gate { base, incarnation, fd, regions: Mutex::default(), sentinel: None };
        if g.word(OFF_MAGIC).load(Ordering::Acquire) != MAGIC
            || g.word(OFF_VERSION).load(Ordering::Relaxed) != VERSION
            || g.read_incarnation() != incarnation
        {
            return Err(gone());
        }
        Ok(g)
    }

    /// The address this gate is mapped at in the process that created it (what peers probe).
    pub fn addr(&self) -> u64 {
        self.base as u64
    }

    pub fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    fn word(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off.is_multiple_of(8) && off + 8 <= SIZE);
        // SAFETY: in bounds and 8-aligned inside our live mapping; shared memory is only used atomically.
        unsafe { &*(self.base.add(off) as *const AtomicU64) }
    }

    fn word32(&self, off: usize) -> &AtomicU32 {
        // SAFETY: as `word`.
        unsafe { &*(self.base.add(off) as *const AtomicU32) }
    }

    fn read_incarnation(&self) -> u128 {
        let lo = self.word(OFF_INCARNATION).load(Ordering::Relaxed) as u128;
        let hi = self.word(OFF_INCARNATION + 8).load(Ordering::Relaxed) as u128;
        lo | hi << 64
    }

    /// The owner's sentinel word (see `os::sentinel`).
    pub fn sentinel(&self) -> &AtomicU32 {
        self.word32(OFF_SENTINEL)
    }

    pub fn live(&self) -> bool {
        self.word(OFF_LIVE).load(Ordering::SeqCst) == 1
    }

    // ----- target side -----

    /// Give a new registration a slot. Fails when every slot is taken.
    pub fn register(&self, addr: u64, len: u64) -> Result<RegionTicket> {
        let mut a = self.regions.lock();
        if a.free.is_empty() && a.next as usize >= REGION_SLOTS {
            return Err(Error::backend(format!(
                "this agent already holds {REGION_SLOTS} registrations with the UCX engine (the most it can gate)"
            )));
        }
        let slot = a.free.pop().unwrap_or_else(|| {
            a.next += 1;
            a.next - 1
        });
        let off = REGION_BASE + slot as usize * REGION_BYTES;
        let state = ((self.word(off).load(Ordering::Relaxed) >> 1) + 1) << 1 | 1;
        self.word(off + 8).store(addr, Ordering::Relaxed);
        self.word(off + 16).store(len, Ordering::Relaxed);
        self.word(off).store(state, Ordering::Release);
        Ok(RegionTicket { slot, state })
    }

    /// Retire registrations: from now on no batch passes the gate for any of them; returns once none that
    /// passed is still copying (one drain, bounded by `limit` in all, not per region; logged past it).
    pub fn retire(&self, tickets: &[RegionTicket], limit: Duration) {
        let flipped: Vec<u32> = tickets
            .iter()
            .filter(|t| {
                let off = REGION_BASE + t.slot as usize * REGION_BYTES;
                self.word(off).compare_exchange(t.state, t.state & !1, Ordering::SeqCst, Ordering::SeqCst).is_ok()
            })
            .map(|t| t.slot)
            .collect();
        if flipped.is_empty() {
            return;
        }
        self.drain(limit, flipped.iter().fold(0, |m, &slot| m | region_bit(slot)));
        self.regions.lock().free.extend(flipped);
    }

    /// The incarnation ends: refuse every later batch and wait for those inside.
    pub fn close(&self, limit: Duration) {
        if self.word(OFF_LIVE).swap(0, Ordering::SeqCst) == 1 {
            self.drain(limit, MASK);
        }
    }

    /// Wait until no initiator has a batch in flight that may touch a region slot in `want` (a mask of
    /// `region_bit`s; `MASK` for all). Dead initiators' counts are reclaimed. Sleeps on a futex that leaving
    /// initiators wake; rechecks every 2 ms for dead owners.
    fn drain(&self, limit: Duration, want: u64) {
        let deadline = Instant::now() + limit;
        self.word(OFF_DRAINING).fetch_add(1, Ordering::SeqCst);
        let seq = self.word32(OFF_DRAIN_SEQ);
        loop {
            let seen = seq.load(Ordering::SeqCst);
            if self.busy_slots(want) == 0 {
                break;
            }
            let now = Instant::now();
            if now >= deadline {
                eprintln!(
                    "gixl: a peer's copy is still inside the transfer gate after {} ms; proceeding (is that \
                     process stopped?)",
                    limit.as_millis()
                );
                break;
            }
            let wait = (deadline - now).min(Duration::from_millis(2));
            let ts = libc::timespec { tv_sec: 0, tv_nsec: wait.as_nanos() as libc::c_long };
            // SAFETY: a futex wait on a word of our shared mapping, with a timeout.
            unsafe { libc::syscall(libc::SYS_futex, seq.as_ptr(), libc::FUTEX_WAIT, seen, &ts as *const _, 0, 0) };
            self.reclaim_dead();
        }
        self.word(OFF_DRAINING).fetch_sub(1, Ordering::SeqCst);
    }

    fn claimed(&self) -> usize {
        (self.word(OFF_CLAIMED).load(Ordering::SeqCst) as usize).min(INIT_SLOTS)
    }

    /// Initiator slots with a batch in flight that may touch `want`. The masked word is raised before the count
    /// and lowered after (see `Attached::enter`), so it names the regions of every batch the count holds; a count
    /// above it is an older gixl's (no mask, or the other order, stopped between the steps): waited for anyway.
    fn busy_slots(&self, want: u64) -> usize {
        (0..self.claimed())
            .filter(|&i| {
                let count = self.word(init_off(i) + OFF_COUNT).load(Ordering::SeqCst);
                let masked = self.word(init_off(i) + OFF_MASKED).load(Ordering::SeqCst);
                count > masked >> MASK_BITS || (masked >> MASK_BITS != 0 && masked & want != 0)
            })
            .count()
    }

    /// Zero the counts of initiators whose process has exited (they can never leave).
    fn reclaim_dead(&self) {
        for i in 0..self.claimed() {
            let o = init_off(i);
            if self.word(o + OFF_COUNT).load(Ordering::SeqCst) == 0 || self.word(o).load(Ordering::SeqCst) == 0 {
                continue;
            }
            if self.owner_dead(o) {
                self.word(o + OFF_COUNT).store(0, Ordering::SeqCst);
                self.word(o + OFF_MASKED).store(0, Ordering::SeqCst);
                self.word(o).store(0, Ordering::SeqCst);
            }
        }
    }

    /// Whether the process owning the initiator slot at `o` has exited.
    fn owner_dead(&self, o: usize) -> bool {
        let pid = self.word(o + 8).load(Ordering::Relaxed) as i32;
        !crate::util::process_alive_as(pid, self.word(o + 16).load(Ordering::Relaxed))
    }

    // ----- initiator side -----

    /// Claim an initiator slot for this process: a free one, else one whose owner process has exited (an
    /// initiator killed without letting go). None when every slot belongs to a live process.
    fn claim(&self, pid: i32, start: u64) -> Option<(u32, u64)> {
        let token = (crate::util::random_u128() as u64) | 1;
        let take = |i: usize, from: u64| {
            let o = init_off(i);
            if self.word(o).compare_exchange(from, token, Ordering::SeqCst, Ordering::Relaxed).is_err() {
                return false;
            }
            self.word(o + 8).store(pid as u64, Ordering::Relaxed);
            self.word(o + 16).store(start, Ordering::Relaxed);
            self.word(o + OFF_MASKED).store(0, Ordering::SeqCst);
            self.word(o + OFF_COUNT).store(0, Ordering::SeqCst);
            self.word(OFF_CLAIMED).fetch_max(i as u64 + 1, Ordering::SeqCst);
            true
        };
        (0..INIT_SLOTS)
            .find(|&i| take(i, 0))
            .or_else(|| {
                (0..INIT_SLOTS).find(|&i| {
                    let owner = self.word(init_off(i)).load(Ordering::SeqCst);
                    owner != 0 && self.owner_dead(init_off(i)) && take(i, owner)
                })
            })
            .map(|i| (i as u32, token))
    }

    fn region_ok(&self, slot: u32, state: u64, addr: u64, len: u64) -> bool {
        if slot as usize >= REGION_SLOTS {
            return false;
        }
        let off = REGION_BASE + slot as usize * REGION_BYTES;
        if self.word(off).load(Ordering::SeqCst) != state || state & 1 == 0 {
            return false;
        }
        let (ra, rl) = (self.word(off + 8).load(Ordering::Relaxed), self.word(off + 16).load(Ordering::Relaxed));
        addr >= ra && addr.checked_add(len).is_some_and(|end| ra.checked_add(rl).is_some_and(|rend| end <= rend))
    }
}

/// This process's start time, read once.
fn own_start() -> Result<u64> {
    static START: OnceLock<u64> = OnceLock::new();
    if let Some(s) = START.get() {
        return Ok(*s);
    }
    let s = crate::util::process_start_time(std::process::id() as i32)
        .map_err(|e| os("reading own process start time", e))?;
    Ok(*START.get_or_init(|| s))
}

/// A region slot's bit in an initiator's mask (see `OFF_MASKED`).
fn region_bit(slot: u32) -> u64 {
    1 << (slot % MASK_BITS)
}

fn init_off(i: usize) -> usize {
    INIT_BASE + i * INIT_BYTES
}

/// Map `fd` at a random page-aligned address in [PLACE_LO, PLACE_HI), never replacing a mapping; after a few
/// collisions, wherever the kernel likes.
fn map_random(fd: RawFd) -> Result<*mut u8> {
    let prot = libc::PROT_READ | libc::PROT_WRITE;
    for _ in 0..8 {
        let r = crate::util::random_u128() as u64;
        let hint = (PLACE_LO + r % (PLACE_HI - PLACE_LO - SIZE as u64)) & !(PAGE as u64 - 1);
        // SAFETY: MAP_FIXED_NOREPLACE never replaces an existing mapping; the result is checked.
        let p = unsafe {
            libc::mmap(hint as *mut libc::c_void, SIZE, prot, libc::MAP_SHARED | libc::MAP_FIXED_NOREPLACE, fd, 0)
        };
        if p != libc::MAP_FAILED {
            if p as u64 == hint {
                return Ok(p.cast());
            }
            // Old kernels treat the flag as a hint only.
            // SAFETY: our own fresh mapping.
            unsafe { libc::munmap(p, SIZE) };
        }
    }
    crate::util::map_shared(fd, SIZE, true).map_err(|e| os("mapping the transfer gate", e))
}

/// An initiator's claim on a peer's gate: the mapping and its own in-flight slot.
pub struct Attached {
    pub gate: Arc<Gate>,
    slot: u32,
    /// Our owner word in the slot: the slot is ours only while it holds this.
    token: u64,
}

/// Who a gate belongs to: the owner's pid, its start time and the engine incarnation. One process takes one
/// initiator slot per key, however many names or agents of its own reach that incarnation.
pub type Owner = (i32, u64, u128);

/// This process's claims, by the gate they are on (weak: a claim ends with the last peer holding it).
fn claims() -> &'static Mutex<HashMap<Owner, Weak<Attached>>> {
    static CLAIMS: OnceLock<Mutex<HashMap<Owner, Weak<Attached>>>> = OnceLock::new();
    CLAIMS.get_or_init(Default::default)
}

/// This process's claim on the gate of `owner`: the live one if this process has it already (`gate` is then
/// not used), else a new claim on `gate`. A renamed copy of a peer's metadata, or a second agent of this
/// process loading the same peer, costs no slot in that peer's gate.
pub fn attach_shared(owner: Owner, gate: impl FnOnce() -> Result<Arc<Gate>>) -> Result<Arc<Attached>> {
    let mut map = claims().lock();
    if let Some(a) = map.get(&owner).and_then(Weak::upgrade) {
        return Ok(a);
    }
    let a = Arc::new(Attached::new(gate()?)?);
    map.retain(|_, w| w.strong_count() > 0);
    map.insert(owner, Arc::downgrade(&a));
    Ok(a)
}

impl Attached {
    pub fn new(gate: Arc<Gate>) -> Result<Attached> {
        let (slot, token) = gate.claim(std::process::id() as i32, own_start()?).ok_or_else(|| {
            Error::backend(format!("the peer's transfer gate has no free initiator slot ({INIT_SLOTS} in use)"))
        })?;
        Ok(Attached { gate, slot, token })
    }

    /// Enter the gate for one batch touching `regions` (slot, state, address, length as the metadata says):
    /// Ok(guard) if the incarnation is live and every region still registered there, covering the range.
    pub fn enter<'a, I>(&'a self, regions: I) -> Result<Inside<'a>>
    where
        I: IntoIterator<Item = (u32, u64, u64, u64)>,
        I::IntoIter: Clone,
    {
        let regions = regions.into_iter();
        let mask = regions.clone().fold(0, |m, (slot, ..)| m | region_bit(slot));
        let o = init_off(self.slot as usize);
        // The masked word first, the plain count second (and the reverse on leaving): a batch is never counted
        // without its regions, so an initiator stopped between the two steps holds up only its own regions.
        let masked = self.gate.word(o + OFF_MASKED);
        let _ = masked.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |w| Some((w + (1 << MASK_BITS)) | mask));
        self.gate.word(o + OFF_COUNT).fetch_add(1, Ordering::SeqCst);
        let inside = Inside { a: self };
        if !self.gate.live() {
            return Err(Error::disconnected(format!(
                "agent incarnation {:032x} has been destroyed",
                self.gate.incarnation
            )));
        }
        for (slot, state, addr, len) in regions {
            if !self.gate.region_ok(slot, state, addr, len) {
                return Err(Error::backend(format!(
                    "the target no longer has {len} bytes at {addr:#x} registered (deregistered, or metadata that \
                     does not match its registrations)"
                )));
            }
        }
        Ok(inside)
    }
}

impl Drop for Attached {
    fn drop(&mut self) {
        // Only if it is still ours (slots are reclaimed only from exited processes, so this is a safeguard).
        let o = init_off(self.slot as usize);
        let _ = self.gate.word(o).compare_exchange(self.token, 0, Ordering::SeqCst, Ordering::Relaxed);
    }
}

/// A batch inside the gate; leaving wakes a waiting drain.
pub struct Inside<'a> {
    a: &'a Attached,
}

impl Drop for Inside<'_> {
    fn drop(&mut self) {
        let g = &self.a.gate;
        let o = init_off(self.a.slot as usize);
        g.word(o + OFF_COUNT).fetch_sub(1, Ordering::SeqCst);
        let _ = g.word(o + OFF_MASKED).fetch_update(Ordering::SeqCst, Ordering::SeqCst, |w| {
            let left = (w >> MASK_BITS).saturating_sub(1);
            Some(if left == 0 { 0 } else { left << MASK_BITS | (w & MASK) })
        });
        if g.word(OFF_DRAINING).load(Ordering::SeqCst) != 0 {
            let seq = g.word32(OFF_DRAIN_SEQ);
            seq.fetch_add(1, Ordering::SeqCst);
            // SAFETY: a futex wake on a word of a shared mapping (not FUTEX_PRIVATE: the waiter is another process).
            unsafe { libc::syscall(libc::SYS_futex, seq.as_ptr(), libc::FUTEX_WAKE, i32::MAX, 0, 0, 0) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placed_at_random_in_the_reserved_range() {
        let a = Gate::create(1).unwrap();
        let b = Gate::create(1).unwrap();
        assert_ne!(a.addr(), b.addr());
        for g in [&a, &b] {
            assert!((PLACE_LO..PLACE_HI).contains(&g.addr()), "{:#x}", g.addr());
        }
    }

    #[test]
    fn regions_retire_and_drain_waits_for_batches_inside() {
        let g = Arc::new(Gate::create(7).unwrap());
        let t = g.register(0x1000, 0x1000).unwrap();
        let a = Attached::new(g.clone()).unwrap();
        // Inside the region only, and only while registered.
        assert!(a.enter([(t.slot, t.state, 0x1000, 0x1000)]).is_ok());
        assert!(a.enter([(t.slot, t.state, 0x1000, 0x1001)]).is_err());
        assert!(a.enter([(t.slot, t.state, 0xfff, 2)]).is_err());
        assert!(a.enter([(t.slot, t.state ^ 2, 0x1000, 1)]).is_err());
        let inside = a.enter([(t.slot, t.state, 0x1800, 8)]).unwrap();
        let left = Arc::new(AtomicU64::new(0));
        let (g2, l2) = (g.clone(), left.clone());
        let retire = std::thread::spawn(move || {
            g2.retire(&[t], Duration::from_secs(10));
            l2.load(Ordering::SeqCst)
        });
        // The retirement is visible at once, even while the drain waits.
        while a.enter([(t.slot, t.state, 0x1000, 8)]).is_ok() {
            std::thread::yield_now();
        }
        left.store(1, Ordering::SeqCst);
        drop(inside);
        assert_eq!(retire.join().unwrap(), 1, "retire returned before the batch inside left");
        // The slot is reused with a new state; the old ticket stays refused.
        let t2 = g.register(0x1000, 0x1000).unwrap();
        assert_eq!(t2.slot, t.slot);
        assert_ne!(t2.state, t.state);
        assert!(a.enter([(t.slot, t.state, 0x1000, 8)]).is_err());
        assert!(a.enter([(t2.slot, t2.state, 0x1000, 8)]).is_ok());
        g.close(Duration::from_secs(1));
        let e = a.enter([]).err().unwrap();
        assert_eq!(e.status(), Status::RemoteDisconnect);
    }

    /// Retiring regions waits only for batches that may touch them: a batch inside on region A does not hold up
    /// the retirement of region B (it held every retirement for the full limit: one stopped initiator made
    /// every `deregister_memory` of its target take the disconnect timeout), but does hold up A's until it
    /// leaves; a batch that published no regions (an older gixl: only the count) holds up everything.
    #[test]
    fn a_retirement_waits_only_for_batches_that_touch_its_regions() {
        let g = Arc::new(Gate::create(0x5a).unwrap());
        let a = g.register(0x1000, 0x1000).unwrap();
        let b = g.register(0x2000, 0x1000).unwrap();
        let c = g.register(0x3000, 0x1000).unwrap();
        let at = Attached::new(g.clone()).unwrap();
        let inside = at.enter([(a.slot, a.state, 0x1000, 16)]).unwrap();
        let limit = Duration::from_millis(400);
        let t0 = Instant::now();
        g.retire(&[b], limit);
        assert!(t0.elapsed() < limit / 2, "waited {:?} for a batch on another region", t0.elapsed());
        let t0 = Instant::now();
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(100));
                drop(inside);
            });
            g.retire(&[a], Duration::from_secs(10));
        });
        let waited = t0.elapsed();
        assert!(waited >= Duration::from_millis(90) && waited < Duration::from_secs(5), "{waited:?}");
        // An older initiator: its count only.
        let o = init_off(at.slot as usize);
        g.word(o + OFF_COUNT).fetch_add(1, Ordering::SeqCst);
        let t0 = Instant::now();
        g.retire(&[c], limit);
        assert!(t0.elapsed() >= limit, "an unpublished batch was not waited for");
        g.word(o + OFF_COUNT).fetch_sub(1, Ordering::SeqCst);
    }

    #[test]
    fn slots_of_exited_initiators_are_reclaimed() {
        let g = Arc::new(Gate::create(8).unwrap());
        let held: Vec<Attached> = (0..INIT_SLOTS).map(|_| Attached::new(g.clone()).unwrap()).collect();
        assert!(Attached::new(g.clone()).is_err(), "every slot is taken by a live process");
        // Pretend slot 7's owner was a process that has exited (pid max is at most 2^22).
        let o = init_off(7);
        g.word(o + 8).store((1 << 23) as u64, Ordering::Relaxed);
        g.word(o + OFF_COUNT).store(3, Ordering::SeqCst);
        let t = g.register(0, 1).unwrap();
        g.retire(&[t], Duration::from_secs(10)); // the drain reclaims the dead owner's count instead of waiting
        let again = Attached::new(g.clone()).unwrap();
        assert_eq!(again.slot, 7);
        // Full again; an owner that exited without letting go (count zero) is taken over by the next claim.
        assert!(Attached::new(g.clone()).is_err());
        g.word(init_off(9) + 8).store((1 << 23) as u64, Ordering::Relaxed);
        assert_eq!(Attached::new(g.clone()).unwrap().slot, 9);
        // Dropping the stale holders of slots 7 and 9 does not free what others own now.
        drop(held);
        assert_ne!(g.word(init_off(7)).load(Ordering::SeqCst), 0);
        drop(again);
        assert_eq!(g.word(init_off(7)).load(Ordering::SeqCst), 0);
    }

    #[test]
    fn attach_through_pidfd_checks_the_incarnation() {
        let g = Gate::create(0xabc).unwrap();
        let pidfd = crate::os::pidfd_open(std::process::id() as i32).unwrap();
        let v = Gate::attach(pidfd.as_raw_fd(), g.raw_fd(), 0xabc).unwrap();
        assert_eq!(v.read_incarnation(), 0xabc);
        assert_eq!(
            Gate::attach(pidfd.as_raw_fd(), g.raw_fd(), 0xabd).err().unwrap().status(),
            Status::RemoteDisconnect
        );
        // Some other descriptor (stdin, a pipe...) is not a gate.
        let e = Gate::attach(pidfd.as_raw_fd(), pidfd.as_raw_fd(), 0xabc).err().unwrap();
        assert_eq!(e.status(), Status::RemoteDisconnect);
    }
}
