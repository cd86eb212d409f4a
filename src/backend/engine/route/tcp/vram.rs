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
//! The target's side (staging in the serving loops of `serve`) is `stage`.
//!
//! Not here: routes inside one host (the engine's `vram`), the wire format (see `wire`), the socket state machines
//! (see `serve`).

use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};

use super::link::TcpLink;
use super::stage::by_device;
use crate::backend::engine::conn::RemoteRegion;
use crate::backend::engine::copy::chunks;
use crate::backend::engine::vram::Staging;
use crate::backend::engine::vram_regions::RemoteVram;
use crate::backend::engine::xfer::{Core, Mover, Run};
use crate::backend::{Seg, XferOp, XferPlan};
use crate::device::{self, Copy, Device};
use crate::mem::MemType;
use crate::status::{Error, Result, Status};

/// Slots of the initiator's staging buffer: chunks in flight in a piece's pipeline.
const SLOTS: usize = 4;

/// A request touching VRAM whose peer is reached over TCP.
pub(crate) struct TcpVramPlan {
    link: Arc<TcpLink>,
    /// The device layer when the local side is VRAM (staged here); None when it is DRAM.
    device: Option<&'static dyn Device>,
}

pub(crate) fn prep(plan: &XferPlan, link: Arc<TcpLink>) -> Result<TcpVramPlan> {
    for m in [plan.local_mem, plan.remote_mem] {
        if m != MemType::Dram && m != MemType::Vram {
            return Err(Error::not_supported(format!("this engine does not move {}", m.seg_name())));
        }
    }
    let device = if plan.local_mem == MemType::Vram { Some(device::get()?) } else { None };
    Ok(TcpVramPlan { link, device })
}

/// `chunk` with its local side moved into the staging buffer at `buf`, and the device copies between
/// that buffer and the chunk's VRAM (direction of `op`), grouped by device.
fn staged(op: XferOp, chunk: &[Seg], buf: u64) -> (Vec<Seg>, Vec<(u32, Vec<Copy>)>) {
    let mut segs = Vec::with_capacity(chunk.len());
    let mut off = 0;
    for s in chunk {
        segs.push(Seg { local: buf + off, ..*s });
        off += s.len;
    }
    let copies = by_device(chunk.iter().zip(&segs).map(|(s, t)| {
        let (dst, src) = if op == XferOp::Read { (s.local, t.local) } else { (t.local, s.local) };
        (s.ldev as u32, Copy { dst, src, len: s.len })
    }));
    (segs, copies)
}

impl Mover for TcpVramPlan {
    /// Move `segs` (one piece of a request) over the link, staging the local side when it is VRAM.
    fn copy(&self, core: &Core, segs: &[Seg], run: &Run) -> Result<()> {
        let op = core.plan.op;
        // The target registration a segment lies in, as its metadata names it.
        let region = |s: &Seg| {
            let k = core.plan.remote_keys.get(s.rreg as usize).and_then(|k| k.as_ref());
            k.and_then(|k| k.downcast_ref::<RemoteRegion>().map(|r| (r.addr, r.len)))
                .or_else(|| k.and_then(|k| k.downcast_ref::<RemoteVram>()).map(|r| r.tcp_region()))
                .unwrap_or((s.remote, s.len))
        };
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
        let helper = helper.map_err(|e| Error::os(Status::Backend, "starting a staging thread", e))?;
        let r = from_first.iter().try_for_each(|(i, b)| {
            second(&chunks[i], bufs[b])?;
            let _ = to_first.send(b);
            Ok(())
        });
        // Unblocks the helper if it waits for a buffer.
        drop(to_first);
        drop(from_first);
        helper.join().unwrap_or_else(|_| Err(Error::backend("a staging thread panicked"))).and(r)
    })
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
}
