//! VRAM over the TCP route (peers on another host, or reached over TCP because cross-memory attach is
//! denied or `GIXL_TRANSPORT=tcp`): sockets never touch device memory; both sides stage through
//! page-locked host buffers from the device layer (`Device::host_buf`) and move the bytes between those
//! buffers and VRAM with device copies (`Device::copy`).
//!
//! Initiator (`TcpVramPlan`): each piece of a request whose local side is VRAM takes one staging buffer
//! (8 MiB, from the pool `vram` keeps) cut into `SLOTS` slots, and the piece is cut into chunks of one
//! slot. The slots make a pipeline, so the device copy of one chunk overlaps the socket I/O of the next
//! (READ: the socket fills slots while filled ones are copied into VRAM; WRITE: VRAM fills slots while
//! filled ones go out). A scoped helper thread runs one of the two stages; both have stopped before `copy`
//! returns, so nothing touches the caller's memory after a request ends. Page-locked memory in use: one
//! buffer per piece in flight (pieces ≤ `tcp_conns`). A request whose local side is DRAM goes over the
//! socket as DRAM does: only the target stages (so an initiator without a GPU can pull from one).
//!
//! Target (`Staged`, `StagePool`): the serving loops of `tcp` recognise a request on registrations made in
//! VRAM (`Regions::lease` says `Device`) and serve it chunk by chunk through a staging buffer of their loop
//! (`SERVE_CHUNK` bytes, at most `LOOP_BUFS` per loop, kept for reuse until the engine closes; a request
//! finding none free waits in its loop's queue, holding no thread). The device copy of one chunk runs on the
//! loop thread: a bounded stall (2 MiB: about 0.1 ms at PCIe rates, a memcpy with the fake device) that
//! keeps the loop a single-threaded state machine. The request holds its lease on the registrations from
//! its check to its last device copy, so deregistration waits for it exactly as for DRAM (and cuts a slow
//! peer off after the disconnect timeout); a request mixing host and device registrations is refused.
//!
//! Not here: routes inside one host (see `vram`), the wire format (see `wire`), the socket state machines
//! (see `tcp`).

use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};

use super::tcp::TcpLink;
use super::vram::{RemoteVram, Staging};
use super::wire::WireSeg;
use super::{Core, PeerKind, RemoteRegion, Run};
use crate::backend::{RegionKey, Seg, Target, XferOp, XferPlan};
use crate::device::{self, Copy, Device, HostBuf};
use crate::mem::MemType;
use crate::status::{Error, Result, Status};

/// Slots of the initiator's staging buffer: chunks in flight in a piece's pipeline.
const SLOTS: usize = 4;
/// Bytes a serving loop stages per device copy.
pub(super) const SERVE_CHUNK: usize = 2 << 20;
/// A serving loop's staging buffer: a chunk, and room for the reply in front of a READ's first chunk (so a
/// 2 MiB request, the initiator's slot, goes out in one chunk).
const SERVE_BUF: usize = SERVE_CHUNK + super::wire::REPLY_BYTES;
/// Staging buffers one serving loop holds at most.
const LOOP_BUFS: usize = 4;

/// The TCP link of a request touching VRAM, when its peer is reached over TCP (None: a same-host route).
pub(super) fn tcp_link(plan: &XferPlan) -> Result<Option<Arc<TcpLink>>> {
    let Target::Remote(p) = &plan.target else { return Ok(None) };
    Ok(match &super::downcast(p)?.kind {
        PeerKind::Tcp { link } => Some(link.clone()),
        // Cross-memory attach denied: over TCP, unless the peer's VRAM stays reachable by IPC handles.
        PeerKind::Cma { tcp, denied, gate, .. } if denied.load(Ordering::Acquire) => {
            (!super::vram::ipc_despite_denial(gate, plan.remote_mem == MemType::Vram)).then(|| tcp.clone())
        }
        _ => None,
    })
}

/// A request touching VRAM whose peer is reached over TCP.
pub(super) struct TcpVramPlan {
    link: Arc<TcpLink>,
    /// The device layer when the local side is VRAM (staged here); None when it is DRAM.
    device: Option<&'static dyn Device>,
}

pub(super) fn prep(plan: &XferPlan, link: Arc<TcpLink>) -> Result<TcpVramPlan> {
    for m in [plan.local_mem, plan.remote_mem] {
        if m != MemType::Dram && m != MemType::Vram {
            return Err(Error::not_supported(format!("this engine does not move {}", m.seg_name())));
        }
    }
    let device = if plan.local_mem == MemType::Vram { Some(device::get()?) } else { None };
    Ok(TcpVramPlan { link, device })
}

/// The target registration a segment lies in, as its metadata names it.
fn region(keys: &[Option<RegionKey>], s: &Seg) -> (u64, u64) {
    let k = keys.get(s.rreg as usize).and_then(|k| k.as_ref());
    if let Some(r) = k.and_then(|k| k.downcast_ref::<RemoteRegion>()) {
        return (r.addr, r.len);
    }
    if let Some(r) = k.and_then(|k| k.downcast_ref::<RemoteVram>()) {
        return r.tcp_region();
    }
    (s.remote, s.len)
}

/// Cut `segs` into chunks of at most `cap` bytes, splitting segments where needed.
fn chunks(segs: &[Seg], cap: u64) -> Vec<Vec<Seg>> {
    let mut out: Vec<Vec<Seg>> = Vec::new();
    let mut room = 0u64;
    for s in segs {
        let mut s = *s;
        while s.len > 0 {
            if room == 0 {
                out.push(Vec::new());
                room = cap;
            }
            let take = s.len.min(room);
            let mut piece = s;
            piece.len = take;
            if let Some(c) = out.last_mut() {
                c.push(piece);
            }
            s.local += take;
            s.remote += take;
            s.len -= take;
            room -= take;
        }
    }
    out
}

/// `chunk` with its local side moved into the staging buffer at `buf`, and the device copies between
/// that buffer and the chunk's VRAM (direction of `op`), grouped by device.
fn staged(op: XferOp, chunk: &[Seg], buf: u64) -> (Vec<Seg>, Vec<(u32, Vec<Copy>)>) {
    let mut segs = Vec::with_capacity(chunk.len());
    let mut copies: Vec<(u32, Vec<Copy>)> = Vec::new();
    let mut off = 0;
    for s in chunk {
        let mut t = *s;
        t.local = buf + off;
        segs.push(t);
        let c = match op {
            XferOp::Read => Copy { dst: s.local, src: t.local, len: s.len },
            XferOp::Write => Copy { dst: t.local, src: s.local, len: s.len },
        };
        let dev = s.ldev as u32;
        match copies.iter_mut().find(|(d, _)| *d == dev) {
            Some((_, v)) => v.push(c),
            None => copies.push((dev, vec![c])),
        }
        off += s.len;
    }
    (segs, copies)
}

impl TcpVramPlan {
    /// Move `segs` (one piece of a request) over the link, staging the local side when it is VRAM.
    pub(super) fn copy(&self, core: &Core, segs: &[Seg], run: &Run) -> Result<()> {
        let op = core.plan.op;
        let keys = &core.plan.remote_keys;
        let region = |s: &Seg| region(keys, s);
        let stop = || run.abort.load(Ordering::Relaxed);
        let Some(device) = self.device else {
            return self.link.run(op, segs, &region, &stop);
        };
        let dev = segs.first().map_or(0, |s| s.ldev as u32);
        let buf = Staging::take(device, dev)?;
        let slot = buf.size() / SLOTS as u64;
        if slot == 0 {
            return Err(Error::backend("empty staging buffer"));
        }
        let chunks = chunks(segs, slot);
        // The two stages of one chunk, with its staging buffer at `buf`: the socket side and the device
        // side (READ: socket then device; WRITE: device then socket).
        let net = |chunk: &[Seg], buf: u64| self.link.run(op, &staged(op, chunk, buf).0, &region, &stop);
        let dev_copy = |chunk: &[Seg], buf: u64| {
            if stop() {
                return Err(Error::new(Status::Canceled, "transfer stopped"));
            }
            staged(op, chunk, buf).1.iter().try_for_each(|(d, c)| device.copy(*d, c))
        };
        let (first, second): (&Stage<'_>, &Stage<'_>) = match op {
            XferOp::Read => (&net, &dev_copy),
            XferOp::Write => (&dev_copy, &net),
        };
        if chunks.len() <= 1 {
            return chunks.iter().try_for_each(|c| first(c, buf.ptr()).and_then(|_| second(c, buf.ptr())));
        }
        let slots: Vec<u64> = (0..SLOTS as u64).map(|i| buf.ptr() + i * slot).collect();
        pipeline(&chunks, &slots, first, second)
    }
}

/// One stage of a chunk (the socket side or the device side), given the chunk and its staging buffer.
type Stage<'a> = dyn Fn(&[Seg], u64) -> Result<()> + Sync + 'a;

/// Run `first` then `second` on every chunk, one slot of the staging buffer each, `bufs.len()` in flight:
/// `first` on a helper thread fills slots while `second` here drains them. Either failing stops both; both
/// have stopped on return.
fn pipeline(chunks: &[Vec<Seg>], bufs: &[u64], first: &Stage<'_>, second: &Stage<'_>) -> Result<()> {
    let (to_second, from_first) = mpsc::sync_channel::<(usize, usize)>(bufs.len());
    let (to_first, from_second) = mpsc::sync_channel::<usize>(bufs.len());
    for b in 0..bufs.len() {
        let _ = to_first.send(b);
    }
    std::thread::scope(|sc| {
        let helper = std::thread::Builder::new().name("gixl-vram-stage".into()).spawn_scoped(sc, move || {
            for (i, c) in chunks.iter().enumerate() {
                // The other side stopped: so do we.
                let Ok(b) = from_second.recv() else { return Ok(()) };
                first(c, bufs[b])?;
                if to_second.send((i, b)).is_err() {
                    return Ok(());
                }
            }
            Ok(())
        });
        let helper = match helper {
            Ok(h) => h,
            Err(e) => return Err(Error::os(Status::Backend, "starting a staging thread", e)),
        };
        let mut r = Ok(());
        for (i, b) in from_first.iter() {
            if let Err(e) = second(&chunks[i], bufs[b]) {
                r = Err(e);
                break;
            }
            let _ = to_first.send(b);
        }
        // Unblocks the helper if it waits for a buffer.
        drop(to_first);
        drop(from_first);
        let h = helper.join().unwrap_or_else(|_| Err(Error::backend("a staging thread panicked")));
        h.and(r)
    })
}

// ----- the target side: the serving loops of `tcp` -----

/// A staging buffer of a serving loop, and the device it was made for.
pub(super) struct PoolBuf {
    dev: u32,
    buf: Box<dyn HostBuf>,
}

/// A serving loop's staging buffers: at most `LOOP_BUFS`, made on first use and kept.
#[derive(Default)]
pub(super) struct StagePool {
    free: Vec<PoolBuf>,
    /// Buffers out with a request.
    out: usize,
}

impl StagePool {
    /// Would `take` give a buffer now?
    pub(super) fn can_take(&self) -> bool {
        !self.free.is_empty() || self.out < LOOP_BUFS
    }

    /// A buffer for device `dev`, or None when all are out.
    pub(super) fn take(&mut self, dev: u32) -> Result<Option<PoolBuf>> {
        if let Some(i) = self.free.iter().position(|b| b.dev == dev) {
            self.out += 1;
            return Ok(Some(self.free.swap_remove(i)));
        }
        if self.out + self.free.len() >= LOOP_BUFS {
            if self.free.is_empty() {
                return Ok(None);
            }
            // Another device's buffer makes room.
            self.free.pop();
        }
        let buf = device::get()?.host_buf(dev, SERVE_BUF)?;
        self.out += 1;
        Ok(Some(PoolBuf { dev, buf }))
    }

    pub(super) fn put(&mut self, b: PoolBuf) {
        self.out = self.out.saturating_sub(1);
        self.free.push(b);
    }
}

/// One request on registered VRAM as a serving loop moves it: its segments (addresses in this process,
/// each with its device) and the chunk in the staging buffer.
pub(super) struct Staged {
    op: XferOp,
    segs: Vec<(u64, u64, u32)>,
    /// Next byte not staged yet: segment index and offset in it.
    seg: usize,
    off: u64,
    /// The chunk in the buffer: (offset in the buffer, address, length, device) of each piece.
    chunk: Vec<(u64, u64, u64, u32)>,
    buf: Option<PoolBuf>,
    /// Bytes of the buffer the chunk fills, and how many of them the socket has moved.
    fill: usize,
    done: usize,
}

impl Staged {
    pub(super) fn new(op: XferOp, segs: &[WireSeg], devs: &[u32]) -> Staged {
        let segs = segs.iter().zip(devs).map(|(s, &d)| (s.addr, s.len, d)).collect();
        Staged { op, segs, seg: 0, off: 0, chunk: Vec::new(), buf: None, fill: 0, done: 0 }
    }

    pub(super) fn op(&self) -> XferOp {
        self.op
    }

    /// The device whose buffer stages the request (its first segment's).
    pub(super) fn dev(&self) -> u32 {
        self.segs.first().map_or(0, |s| s.2)
    }

    pub(super) fn attach(&mut self, b: PoolBuf) {
        self.buf = Some(b);
    }

    pub(super) fn detach(&mut self) -> Option<PoolBuf> {
        self.buf.take()
    }

    /// Every byte of the request has been staged (and, once the chunk is moved, served).
    pub(super) fn finished(&self) -> bool {
        self.seg >= self.segs.len()
    }

    /// Bytes of the request not staged yet.
    pub(super) fn unstaged(&self) -> u64 {
        self.segs.iter().skip(self.seg).map(|s| s.1).sum::<u64>() - self.off
    }

    /// Plan the next chunk from offset `start` of the buffer on.
    fn next_chunk(&mut self, start: usize) {
        let cap = self.buf.as_ref().map_or(0, |b| b.buf.size());
        self.chunk.clear();
        let mut at = start as u64;
        while self.seg < self.segs.len() && at < cap as u64 {
            let (addr, len, dev) = self.segs[self.seg];
            let take = (len - self.off).min(cap as u64 - at);
            self.chunk.push((at, addr + self.off, take, dev));
            at += take;
            self.off += take;
            if self.off == len {
                self.seg += 1;
                self.off = 0;
            }
        }
        self.fill = at as usize;
        self.done = 0;
    }

    fn copies(&self, to_device: bool) -> Vec<(u32, Vec<Copy>)> {
        let base = self.buf.as_ref().map_or(0, |b| b.buf.ptr());
        let mut out: Vec<(u32, Vec<Copy>)> = Vec::new();
        for &(at, addr, len, dev) in &self.chunk {
            let c = if to_device {
                Copy { dst: addr, src: base + at, len }
            } else {
                Copy { dst: base + at, src: addr, len }
            };
            match out.iter_mut().find(|(d, _)| *d == dev) {
                Some((_, v)) => v.push(c),
                None => out.push((dev, vec![c])),
            }
        }
        out
    }

    /// READ: stage the next chunk out of device memory, after `head` (the reply) if given.
    pub(super) fn load(&mut self, head: Option<&[u8]>) -> Result<()> {
        let Some(b) = &self.buf else { return Err(Error::backend("no staging buffer")) };
        let start = head.map_or(0, |h| h.len());
        if let Some(h) = head {
            // SAFETY: the buffer is ours and larger than the 8-byte reply.
            unsafe { std::ptr::copy_nonoverlapping(h.as_ptr(), b.buf.ptr() as usize as *mut u8, h.len()) };
        }
        self.next_chunk(start);
        let device = device::get()?;
        self.copies(false).iter().try_for_each(|(d, c)| device.copy(*d, c))
    }

    /// WRITE: the next chunk is to come into the buffer.
    pub(super) fn expect(&mut self) {
        self.next_chunk(0);
    }

    /// WRITE: the chunk is in the buffer; copy it into device memory.
    pub(super) fn store(&mut self) -> Result<()> {
        let device = device::get()?;
        self.copies(true).iter().try_for_each(|(d, c)| device.copy(*d, c))
    }

    /// Send what is left of the chunk.
    ///
    /// # Safety
    /// `fd` is a socket; the staged range lies inside the buffer this request holds.
    pub(super) unsafe fn send(&self, fd: i32) -> std::io::Result<usize> {
        let Some(b) = &self.buf else { return Ok(0) };
        // SAFETY: `done..fill` lies inside the buffer, which lives as long as `self`.
        let s = unsafe {
            std::slice::from_raw_parts((b.buf.ptr() as usize + self.done) as *const u8, self.fill - self.done)
        };
        super::net::send_now(fd, s)
    }

    /// Receive into what is left of the chunk.
    ///
    /// # Safety
    /// As for `send`.
    pub(super) unsafe fn recv(&mut self, fd: i32) -> std::io::Result<usize> {
        let Some(b) = &self.buf else { return Ok(0) };
        // SAFETY: as above; nothing else refers to the buffer while the request holds it.
        let s = unsafe {
            std::slice::from_raw_parts_mut((b.buf.ptr() as usize + self.done) as *mut u8, self.fill - self.done)
        };
        super::net::recv_now(fd, s)
    }

    /// `n` more bytes went out; true when the chunk is complete.
    pub(super) fn sent(&mut self, n: usize) -> bool {
        self.done += n;
        self.done >= self.fill
    }

    /// `n` more bytes came in; true when the chunk is complete.
    pub(super) fn received(&mut self, n: usize) -> bool {
        self.sent(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg(local: u64, remote: u64, len: u64) -> Seg {
        Seg { local, remote, len, ldev: 0, rdev: 0, lreg: 0, rreg: 0 }
    }

    #[test]
    fn chunks_cut_at_the_buffer_size_and_keep_every_byte() {
        let segs = vec![seg(0, 1000, 10), seg(100, 2000, 25), seg(500, 3000, 5)];
        let c = chunks(&segs, 16);
        assert_eq!(c.iter().map(|c| c.iter().map(|s| s.len).sum::<u64>()).collect::<Vec<_>>(), vec![16, 16, 8]);
        assert_eq!(c[0], vec![seg(0, 1000, 10), seg(100, 2000, 6)]);
        assert_eq!(c[1], vec![seg(106, 2006, 16)]);
        assert_eq!(c[2], vec![seg(122, 2022, 3), seg(500, 3000, 5)]);
        let (s, copies) = staged(XferOp::Read, &c[0], 0x9000);
        assert_eq!(s[1].local, 0x900a);
        assert_eq!(
            copies,
            vec![(0, vec![Copy { dst: 0, src: 0x9000, len: 10 }, Copy { dst: 100, src: 0x900a, len: 6 }])]
        );
    }

    #[test]
    fn a_served_request_is_staged_chunk_by_chunk_in_order() {
        assert!(device::select_fake());
        let segs = [
            WireSeg { region: 0, region_len: 0, addr: 0x1000, len: 5 },
            WireSeg { region: 0, region_len: 0, addr: 0x8000, len: SERVE_BUF as u64 },
        ];
        let mut st = Staged::new(XferOp::Write, &segs, &[3, 4]);
        let mut pool = StagePool::default();
        st.attach(pool.take(st.dev()).unwrap().unwrap());
        st.expect();
        assert_eq!(st.fill, SERVE_BUF);
        assert_eq!(st.chunk, vec![(0, 0x1000, 5, 3), (5, 0x8000, SERVE_BUF as u64 - 5, 4)]);
        assert!(!st.finished());
        assert_eq!(st.unstaged(), 5);
        st.expect();
        assert_eq!((st.fill, st.chunk.clone()), (5, vec![(0, 0x8000 + SERVE_BUF as u64 - 5, 5, 4)]));
        assert!(st.finished() && st.unstaged() == 0);
        // A READ: the reply in front, then a whole 2 MiB segment in the same chunk, copied out of "VRAM".
        let src: Vec<u8> = (0..SERVE_CHUNK).map(|i| (i % 251) as u8).collect();
        let segs = [WireSeg { region: 0, region_len: 0, addr: src.as_ptr() as u64, len: SERVE_CHUNK as u64 }];
        let mut rd = Staged::new(XferOp::Read, &segs, &[0]);
        rd.attach(pool.take(0).unwrap().unwrap());
        rd.load(Some(&[9; 8])).unwrap();
        assert!(rd.finished() && rd.fill == SERVE_BUF);
        let b = rd.detach().unwrap();
        // SAFETY: the staging buffer holds `SERVE_BUF` bytes.
        let got = unsafe { std::slice::from_raw_parts(b.buf.ptr() as usize as *const u8, SERVE_BUF) };
        assert!(got[..8] == [9; 8] && got[8..] == src[..]);
        pool.put(b);
        // The pool lends at most LOOP_BUFS buffers.
        let mut held: Vec<PoolBuf> = (1..LOOP_BUFS).map(|_| pool.take(0).unwrap().unwrap()).collect();
        assert!(!pool.can_take() && pool.take(0).unwrap().is_none());
        pool.put(st.detach().unwrap());
        assert!(pool.can_take());
        held.push(pool.take(5).unwrap().unwrap());
        assert!(pool.take(5).unwrap().is_none());
    }
}
