//! VRAM registrations as the engine keeps them (the target's side of the VRAM routes, see `vram`): each
//! region's allocations exported once (an export shared by the regions inside it, offered on the control socket
//! for peers that may not take its descriptor), its slot in the transfer gate, and the public bytes that carry
//! the handles to peers; and a peer's VRAM region as loaded from its metadata (`RemoteVram`), with its
//! allocations opened in this process once, on first use (`open_alloc`), and closed when the last key holding
//! them goes.

use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::sync::{Arc, OnceLock, Weak};

use parking_lot::Mutex;

use super::ctrl::Ctrl;
use super::gate::{Gate, RegionTicket};
use super::route::Tickets;
use super::sides;
use crate::backend::RegionKey;
use crate::device::{self, Device, Export, HandleKind, IpcHandle, Mapping};
use crate::md::{put_bytes, put_uvar, Reader};
use crate::mem::{Desc, RegDesc};
use crate::status::{Error, Result};

/// Version 2: the region's place in the engine's transfer gate (slot and state) replaced a VRAM-only gate.
pub(super) const PUBLIC_VERSION: u8 = 2;
/// Version 3: version 2, then the routes' sections of the region's ticket (its RDMA keys, see
/// `route::Tickets`); written only for a region a route exported (an RDMA NIC reaches it directly), so nothing
/// changes for the others.
const PUBLIC_WITH_SECTIONS: u8 = 3;

/// A region's public bytes (from `Vram::register`) with its routes' ticket `sections` (from their exports).
pub(super) fn with_sections(mut public: Vec<u8>, sections: &[u8]) -> Vec<u8> {
    if !sections.is_empty() {
        public[0] = PUBLIC_WITH_SECTIONS;
        public.extend_from_slice(sections);
    }
    public
}

/// An exported allocation and how many registered regions use it.
struct Exported {
    export: Export,
    regions: usize,
}

/// The engine's VRAM state (a field of `Shared`): its exported allocations.
#[derive(Default)]
pub(super) struct Vram {
    exports: Mutex<HashMap<u64, Exported>>,
}

/// A VRAM region as `Vram::register` exported it.
pub(super) struct VramExport {
    /// Its public bytes: the gate ticket and the allocations' handles.
    pub(super) public: Vec<u8>,
    pub(super) ticket: RegionTicket,
    /// Base of each allocation (chunk) it spans.
    pub(super) bases: Vec<u64>,
}

/// Most allocations one region may span.
const MAX_CHUNKS: usize = 4096;

impl Vram {
    /// Export the allocations `desc` spans (or count one more region on their exports) and take its gate slot.
    pub(super) fn register(&self, ctrl: &Ctrl, gate: &Gate, desc: &RegDesc) -> Result<VramExport> {
        let dev = device::get()?;
        let d = &desc.desc;
        let chunks = chunks(dev, d.addr, d.len)?;
        if d.dev != chunks[0].dev as u64 {
            return Err(Error::invalid_param(format!(
                "VRAM region {:#x} is on device {}, not device {}",
                d.addr, chunks[0].dev, d.dev
            )));
        }
        let mut exports = self.exports.lock();
        // Export every chunk (or count one more region on an existing export); undone on failure.
        let mut done: Vec<u64> = Vec::with_capacity(chunks.len());
        for c in &chunks {
            if !exports.contains_key(&c.base) {
                let export = dev.export(c).inspect_err(|_| Self::release(ctrl, &mut exports, &done))?;
                // Peers that may not take it with `pidfd_getfd` ask for it over the control socket.
                if let Some(k) = &export.keep {
                    ctrl.offer_fd(k.as_raw_fd());
                }
                exports.insert(c.base, Exported { export, regions: 0 });
            }
            exports.entry(c.base).and_modify(|e| e.regions += 1);
            done.push(c.base);
        }
        let ticket = gate.register(d.addr, d.len).inspect_err(|_| Self::release(ctrl, &mut exports, &done))?;
        let mut public = vec![PUBLIC_VERSION];
        put_uvar(&mut public, chunks[0].dev as u64);
        put_uvar(&mut public, ticket.slot as u64);
        put_uvar(&mut public, ticket.state);
        put_uvar(&mut public, chunks.len() as u64);
        for c in &chunks {
            let h = &exports[&c.base].export.handle;
            put_uvar(&mut public, c.base);
            put_uvar(&mut public, h.size);
            public.push(h.kind as u8);
            put_bytes(&mut public, &h.bytes);
        }
        Ok(VramExport { public, ticket, bases: done })
    }

    /// One region fewer on the exports of `bases` (from `register`; its gate slot retired first): the last
    /// one drops an export.
    pub(super) fn unexport_all(&self, ctrl: &Ctrl, bases: &[u64]) {
        Self::release(ctrl, &mut self.exports.lock(), bases);
    }

    /// One region fewer on each export of `bases`; an export none uses any more is dropped, withdrawn from the
    /// control socket first.
    fn release(ctrl: &Ctrl, exports: &mut HashMap<u64, Exported>, bases: &[u64]) {
        for b in bases {
            let Some(e) = exports.get_mut(b) else { continue };
            e.regions -= 1;
            // The export (and the descriptor it offers) lives until it is withdrawn.
            let last = (e.regions == 0).then(|| exports.remove(b)).flatten();
            if let Some(k) = last.as_ref().and_then(|e| e.export.keep.as_ref()) {
                ctrl.withdraw_fd(k.as_raw_fd());
            }
        }
    }
}

/// The allocations `[addr, addr + len)` spans: one, or several mapped back to back on one device (a VMM
/// range such as PyTorch's expandable segments, where each physical chunk is its own allocation with its
/// own handle). An error if the range leaves device memory or changes device.
fn chunks(dev: &dyn Device, addr: u64, len: u64) -> Result<Vec<device::PtrInfo>> {
    let first = dev.pointer_info(addr)?;
    let end = addr.checked_add(len).ok_or_else(|| Error::invalid_param("VRAM region wraps around"))?;
    let mut out = vec![first];
    let mut at = first.base.saturating_add(first.size);
    while at < end {
        let crosses = || {
            Error::invalid_param(format!(
                "VRAM region {addr:#x}+{len} crosses the end of its allocation ({:#x}+{}) into memory that is not \
                 another allocation of device {} mapped right after it",
                first.base, first.size, first.dev
            ))
        };
        let next = dev.pointer_info(at).map_err(|_| crosses())?;
        if next.base != at || next.dev != first.dev || next.size == 0 || out.len() == MAX_CHUNKS {
            return Err(crosses());
        }
        out.push(next);
        at = next.base.saturating_add(next.size);
    }
    Ok(out)
}

/// A peer's VRAM region, from its metadata.
pub(super) struct RemoteVram {
    addr: u64,
    len: u64,
    pub(super) dev: u32,
    /// The allocations it spans, in address order, back to back.
    pub(super) chunks: Vec<RemoteChunk>,
    ticket: RegionTicket,
    incarnation: u128,
    /// What its routes' sections say (its RDMA keys where the peer's NIC reaches it directly, ...).
    pub(super) tickets: Tickets,
}

/// One of the peer's allocations under a region.
pub(super) struct RemoteChunk {
    /// Its base in the peer.
    pub(super) base: u64,
    pub(super) handle: IpcHandle,
    /// Opened here on first use.
    opened: Mutex<Option<Arc<Opened>>>,
}

impl RemoteVram {
    /// What the peer's gate checks for it: (slot, state, address, length).
    pub(super) fn gated(&self) -> (u32, u64, u64, u64) {
        (self.ticket.slot, self.ticket.state, self.addr, self.len)
    }

    /// The registration as the peer's TCP target knows it: (address, length).
    pub(super) fn tcp_region(&self) -> (u64, u64) {
        (self.addr, self.len)
    }
}

/// A peer's allocation opened in this process (shared by its regions); closed when the last one goes.
pub(super) struct Opened {
    pub(super) map: Box<dyn Mapping>,
}

type OpenedMap = HashMap<(u128, Vec<u8>), Weak<Opened>>;

/// Opened allocations, per peer incarnation and handle, so each is opened once.
fn opened() -> &'static Mutex<OpenedMap> {
    static O: OnceLock<Mutex<OpenedMap>> = OnceLock::new();
    O.get_or_init(Default::default)
}

pub(super) fn load_remote(incarnation: u128, desc: &Desc, public: &[u8]) -> Result<RegionKey> {
    let bad = || Error::mismatch("malformed VRAM region in metadata");
    let mut r = Reader { buf: public, pos: 0 };
    let version = r.byte()?;
    if version != PUBLIC_VERSION && version != PUBLIC_WITH_SECTIONS {
        return Err(Error::mismatch("unknown VRAM region format in metadata"));
    }
    let dev = u32::try_from(r.uvar()?).map_err(|_| bad())?;
    let ticket = RegionTicket { slot: u32::try_from(r.uvar()?).map_err(|_| bad())?, state: r.uvar()? };
    let n = usize::try_from(r.uvar()?).ok().filter(|&n| (1..=MAX_CHUNKS).contains(&n)).ok_or_else(bad)?;
    let mut chunks: Vec<RemoteChunk> = Vec::with_capacity(n.min(64));
    for _ in 0..n {
        let base = r.uvar()?;
        let size = r.uvar()?;
        let k = r.byte()?;
        let kind = HandleKind::from_u8(k).ok_or_else(|| {
            Error::mismatch(format!(
                "the peer's VRAM region uses allocation handle kind {k}, unknown to this gixl (a newer peer?)"
            ))
        })?;
        let bytes = r.bytes(256)?.to_vec();
        // Back to back, each non-empty.
        if size == 0 || chunks.last().is_some_and(|c| c.base.checked_add(c.handle.size) != Some(base)) {
            return Err(bad());
        }
        chunks.push(RemoteChunk { base, handle: IpcHandle { kind, size, bytes }, opened: Mutex::new(None) });
    }
    let tickets = if version == PUBLIC_WITH_SECTIONS { sides::read_tickets(&mut r)? } else { Tickets::default() };
    // The region lies inside the chunks.
    let (lo, hi) = (chunks[0].base, chunks[n - 1].base.checked_add(chunks[n - 1].handle.size));
    let end = desc.addr.checked_add(desc.len);
    if r.left() != 0 || desc.addr < lo || !matches!((end, hi), (Some(e), Some(h)) if e <= h) {
        return Err(bad());
    }
    Ok(Arc::new(RemoteVram { addr: desc.addr, len: desc.len, dev, chunks, ticket, incarnation, tickets }))
}

pub(super) fn open_alloc(
    dev: &dyn Device,
    r: &RemoteVram,
    c: &RemoteChunk,
    on: u32,
    fd: device::FdSource<'_>,
) -> Result<Arc<Opened>> {
    let mut cur = c.opened.lock();
    if let Some(o) = cur.as_ref() {
        return Ok(o.clone());
    }
    // One mapping per peer allocation in this process, whichever device first opened it: the address is
    // valid for every device (unified addressing), and CUDA maps a legacy handle once per process.
    let k = (r.incarnation, c.handle.bytes.clone());
    let mut o = opened().lock();
    let op = match o.get(&k).and_then(Weak::upgrade) {
        Some(op) => op,
        None => {
            let op = Arc::new(Opened { map: dev.open(on, &c.handle, fd)? });
            o.retain(|_, w| w.strong_count() > 0);
            o.insert(k, Arc::downgrade(&op));
            op
        }
    };
    *cur = Some(op.clone());
    Ok(op)
}
