//! Staging of device memory in the TCP serving loops (see `serve`), the target's side of VRAM over TCP (the
//! initiator's is `vram`).
//!
//! The serving loops (`serve`) recognise a request on registrations made in VRAM (`Regions::lease` says
//! `Device`) and serve it chunk by chunk through a staging buffer of their loop (`SERVE_CHUNK` bytes, at most
//! `LOOP_BUFS` per loop, kept for reuse until the engine closes; a request finding none free waits in its
//! loop's queue, holding no thread). The device copy of one chunk runs on the
//! loop thread: a bounded stall (2 MiB: about 0.1 ms at PCIe rates, a memcpy with the fake device) that
//! keeps the loop a single-threaded state machine. The request holds its lease on the registrations from
//! its check to its last device copy, so deregistration waits for it exactly as for DRAM (and cuts a slow
//! peer off after the disconnect timeout); a request mixing host and device registrations is refused.

use crate::backend::engine::pool::{Pinned, PinnedBuf};
use crate::backend::XferOp;
use crate::device::{self, Copy};
use crate::status::{Error, Result};

use super::wire::WireSeg;

/// Bytes a serving loop stages per device copy.
pub(crate) const SERVE_CHUNK: usize = 2 << 20;
/// A serving loop's staging buffer: a chunk, and room for the reply in front of a READ's first chunk (so a
/// 2 MiB request, the initiator's slot, goes out in one chunk).
const SERVE_BUF: usize = SERVE_CHUNK + super::wire::REPLY_BYTES;
/// Staging buffers one serving loop holds at most.
const LOOP_BUFS: usize = 4;

/// A serving loop's staging buffers: at most `LOOP_BUFS`, made on first use and kept.
pub(crate) fn loop_pool() -> Pinned {
    Pinned::new(SERVE_BUF, LOOP_BUFS, LOOP_BUFS)
}

/// One request on registered VRAM as a serving loop moves it: its segments (addresses in this process,
/// each with its device) and the chunk in the staging buffer.
pub(crate) struct Staged {
    pub(super) op: XferOp,
    segs: Vec<(u64, u64, u32)>,
    /// Next byte not staged yet: segment index and offset in it.
    seg: usize,
    off: u64,
    /// The chunk in the buffer: (offset in the buffer, address, length, device) of each piece.
    chunk: Vec<(u64, u64, u64, u32)>,
    /// The staging buffer, while the request holds one.
    pub(super) buf: Option<PinnedBuf>,
    /// Bytes of the buffer the chunk fills, and how many of them the socket has moved.
    fill: usize,
    done: usize,
}

impl Staged {
    pub(crate) fn new(op: XferOp, segs: &[WireSeg], devs: &[u32]) -> Staged {
        let segs = segs.iter().zip(devs).map(|(s, &d)| (s.addr, s.len, d)).collect();
        Staged { op, segs, seg: 0, off: 0, chunk: Vec::new(), buf: None, fill: 0, done: 0 }
    }

    /// The device whose buffer stages the request (its first segment's).
    pub(crate) fn dev(&self) -> u32 {
        self.segs.first().map_or(0, |s| s.2)
    }

    /// Every byte of the request has been staged (and, once the chunk is moved, served).
    pub(crate) fn finished(&self) -> bool {
        self.seg >= self.segs.len()
    }

    /// Bytes of the request not staged yet.
    pub(crate) fn unstaged(&self) -> u64 {
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

    fn copy(&self, to_device: bool) -> Result<()> {
        let (device, base) = (device::get()?, self.buf.as_ref().map_or(0, |b| b.buf.ptr()));
        let copies = by_device(self.chunk.iter().map(|&(at, addr, len, dev)| {
            let (dst, src) = if to_device { (addr, base + at) } else { (base + at, addr) };
            (dev, Copy { dst, src, len })
        }));
        copies.iter().try_for_each(|(d, c)| device.copy(*d, c))
    }

    /// READ: stage the next chunk out of device memory, after `head` (the reply) if given.
    pub(crate) fn load(&mut self, head: Option<&[u8]>) -> Result<()> {
        let Some(b) = &self.buf else { return Err(Error::backend("no staging buffer")) };
        if let Some(h) = head {
            // SAFETY: the buffer is ours and larger than the 8-byte reply.
            unsafe { std::ptr::copy_nonoverlapping(h.as_ptr(), b.buf.ptr() as usize as *mut u8, h.len()) };
        }
        self.next_chunk(head.map_or(0, |h| h.len()));
        self.copy(false)
    }

    /// WRITE: the next chunk is to come into the buffer.
    pub(crate) fn expect(&mut self) {
        self.next_chunk(0);
    }

    /// WRITE: the chunk is in the buffer; copy it into device memory.
    pub(crate) fn store(&mut self) -> Result<()> {
        self.copy(true)
    }

    /// Send what is left of the chunk.
    ///
    /// # Safety
    /// `fd` is a socket; the staged range lies inside the buffer this request holds.
    pub(crate) unsafe fn send(&self, fd: i32) -> std::io::Result<usize> {
        let Some(b) = &self.buf else { return Ok(0) };
        // SAFETY: `done..fill` lies inside the buffer, which lives as long as `self`.
        let s = unsafe {
            std::slice::from_raw_parts((b.buf.ptr() as usize + self.done) as *const u8, self.fill - self.done)
        };
        crate::os::sock::send_now(fd, s)
    }

    /// Receive into what is left of the chunk.
    ///
    /// # Safety
    /// As for `send`.
    pub(crate) unsafe fn recv(&mut self, fd: i32) -> std::io::Result<usize> {
        let Some(b) = &self.buf else { return Ok(0) };
        // SAFETY: as above; nothing else refers to the buffer while the request holds it.
        let s = unsafe {
            std::slice::from_raw_parts_mut((b.buf.ptr() as usize + self.done) as *mut u8, self.fill - self.done)
        };
        crate::os::sock::recv_now(fd, s)
    }

    /// `n` more bytes went out or came in; true when the chunk is complete.
    pub(crate) fn moved(&mut self, n: usize) -> bool {
        self.done += n;
        self.done >= self.fill
    }
}

/// Device copies grouped by device, in the order the devices first appear (one `Device::copy` each).
pub(super) fn by_device(copies: impl IntoIterator<Item = (u32, Copy)>) -> Vec<(u32, Vec<Copy>)> {
    let mut out: Vec<(u32, Vec<Copy>)> = Vec::new();
    for (dev, c) in copies {
        match out.iter_mut().find(|(d, _)| *d == dev) {
            Some((_, v)) => v.push(c),
            None => out.push((dev, vec![c])),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_served_request_is_staged_chunk_by_chunk_in_order() {
        assert!(device::select_fake());
        let segs = [
            WireSeg { region: 0, region_len: 0, addr: 0x1000, len: 5 },
            WireSeg { region: 0, region_len: 0, addr: 0x8000, len: SERVE_BUF as u64 },
        ];
        let mut st = Staged::new(XferOp::Write, &segs, &[3, 4]);
        let mut pool = loop_pool();
        let d = device::get().unwrap();
        st.buf = Some(pool.take(d, st.dev()).unwrap().unwrap());
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
        rd.buf = Some(pool.take(d, 0).unwrap().unwrap());
        rd.load(Some(&[9; 8])).unwrap();
        assert!(rd.finished() && rd.fill == SERVE_BUF);
        let b = rd.buf.take().unwrap();
        // SAFETY: the staging buffer holds `SERVE_BUF` bytes.
        let got = unsafe { std::slice::from_raw_parts(b.buf.ptr() as usize as *const u8, SERVE_BUF) };
        assert!(got[..8] == [9; 8] && got[8..] == src[..]);
        pool.put(b);
        // The pool lends at most LOOP_BUFS buffers.
        let mut held: Vec<PinnedBuf> = (1..LOOP_BUFS).map(|_| pool.take(d, 0).unwrap().unwrap()).collect();
        assert!(!pool.can_take() && pool.take(d, 0).unwrap().is_none());
        pool.put(st.buf.take().unwrap());
        assert!(pool.can_take());
        held.push(pool.take(d, 5).unwrap().unwrap());
        assert!(pool.take(d, 5).unwrap().is_none());
    }
}
