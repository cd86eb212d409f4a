//! GPU memory (VRAM) in the engine, over the device layer (`crate::device`), for peers on this host; a peer
//! reached over the network moves VRAM by its route (`route::Route::vram`: staged over TCP, or GPU-direct).
//!
//! - Loopback and agents in this process: device copies between addresses valid here.
//! - Another process, its region in VRAM: the peer exports each allocation under the region (a legacy IPC
//!   handle, a VMM allocation's POSIX fd, taken with `pidfd_getfd` or over its authenticated control socket
//!   and checked by st_dev/st_ino, or a fabric handle; see `crate::device`), carried in the region's
//!   metadata; this engine opens each remote allocation once, on first use, shared by every region inside it,
//!   and closes it with the last region key holding it. Copies are cut where a region's allocations meet (a
//!   VMM range such as PyTorch's expandable segments). The copy runs here, either way, whatever our memory.
//! - Another process, its region in DRAM and ours in VRAM: cross-memory attach into a page-locked staging
//!   buffer and a device copy between the buffer and VRAM.
//!
//! Every batch of device copies into or out of another process's VRAM, and every opening of a peer's
//! allocation, is bracketed as a cross-memory-attach batch is (`in_peer_gate`: the peer's gate entered, its
//! identity checked before and after), so a handle of another incarnation, a deregistered region (NOT_FOUND) or
//! a dead, exec'd or restarted peer (REMOTE_DISCONNECT) is refused before the driver is called, and
//! deregistration returns only once no batch that passed the gate is still copying. The identity check needs no
//! ptrace permission: where the kernel denies cross-memory attach, see `router::ipc_despite_denial`.

use std::os::fd::AsFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use parking_lot::Mutex;

use super::conn;
use super::copy::{self, cma_denied};
use super::exports::Registered;
use super::peer::{downcast, EnginePeer, PeerKind};
use super::pool::{Pinned, PinnedBuf};
use super::route::cma::Cma;
use super::route::in_process::InProcess;
use super::route::Job;
use super::router::ipc_despite_denial;
use super::shared::{take_peer_fd, Shared};
use super::vram_regions::{open_alloc, Opened, RemoteVram};
use super::xfer::{Core, Mover, Run};
use crate::backend::{Seg, Target, XferOp, XferPlan};
use crate::device::{self, Copy, Device};
use crate::mem::MemType;
use crate::os::sentinel;
use crate::status::{Error, Result, Status};

/// Staging buffer for DRAM (remote, over CMA) ↔ VRAM (local) copies.
const STAGE: u64 = 8 << 20;

/// What `prep` resolved, kept with the request.
pub(super) struct VramPlan {
    /// Per remote region index: where it is here, and the opened allocation it lies in.
    regions: Vec<Option<RegionUse>>,
    /// The peer's VRAM regions this request touches, as its gate checks them.
    gated: Vec<(u32, u64, u64, u64)>,
    /// Device whose context and streams the copies use.
    dev: u32,
    device: &'static dyn Device,
    remote_is_vram: bool,
}

/// Where a remote region is in this process: at the same addresses (this process), or per chunk opened
/// here (another process), each `(peer base, peer end, here - peer, opened allocation)`.
struct RegionUse {
    chunks: Vec<(u64, u64, u64, Arc<Opened>)>,
}

impl RegionUse {
    const SAME: RegionUse = RegionUse { chunks: Vec::new() };

    /// The pieces of the peer range `[at, at + len)` as (offset into the range, length, address here),
    /// cut at chunk boundaries.
    fn pieces(&self, at: u64, len: u64, out: &mut impl FnMut(u64, u64, u64)) {
        if self.chunks.is_empty() {
            return out(0, len, at);
        }
        let mut i = self.chunks.partition_point(|c| c.1 <= at);
        let mut off = 0;
        while off < len {
            // Outside every chunk cannot happen (the agent checked the range against the region, which the
            // chunks cover); map it to address 0 so the driver refuses it rather than a wrong address.
            let Some(&(_, end, shift, _)) = self.chunks.get(i) else { return out(off, len - off, 0) };
            let here = at + off;
            let n = (end - here).min(len - off);
            out(off, n, here.wrapping_add(shift));
            off += n;
            i += 1;
        }
    }
}

/// A refusal of the peer's gate as VRAM reports it: a region the peer no longer has registered is NOT_FOUND
/// (the gate itself says BACKEND, as cross-memory attach reports it); a closed incarnation stays
/// REMOTE_DISCONNECT.
fn refused(e: Error) -> Error {
    if e.status() == Status::Backend {
        Error::not_found(format!("the peer has deregistered this VRAM region ({})", e.message()))
    } else {
        e
    }
}

/// Run `f` inside another process's gate for `regions`, checked to be the same process image before and
/// after: the bracket every driver call on a peer's allocation goes through.
///
/// The identity check is the peer's sentinel word (`sentinel`, in our mapping of its gate), which the kernel
/// flips when that process exits or execs, before a new image or a process that takes over the pid can run:
/// one atomic load before `f` (ended: REMOTE_DISCONNECT, the driver is not called) and one after (changed:
/// REMOTE_DISCONNECT, a READ's bytes may come from an image already gone; a WRITE's landed in the old
/// allocation, which the opened handle keeps alive, never in the new image). A peer without a sentinel is
/// probed instead (`copy::probe`, one 16-byte `process_vm_readv` of its gate). A check that finds the peer
/// gone marks it dead.
fn in_peer_gate<T>(p: &EnginePeer, regions: &[(u32, u64, u64, u64)], f: impl FnOnce() -> Result<T>) -> Result<T> {
    let PeerKind::Cma(Cma { pid, gate, probe, .. }) = &p.kind else {
        return Err(Error::backend("unreachable route"));
    };
    let gone = || {
        p.health.kill(|| "it exited or exec'd".into());
        Error::disconnected(format!("agent '{}' exited or exec'd (it no longer runs that incarnation)", p.name))
    };
    if p.health.gone() {
        return Err(gone());
    }
    let gate = gate.as_ref().ok_or_else(|| Error::disconnected(format!("agent '{}' is not reachable", p.name)))?;
    let _inside = gate.enter(regions.iter().copied()).map_err(refused)?;
    let word = gate.gate.sentinel();
    let seen = match sentinel::read(word) {
        sentinel::Word::Ended => return Err(gone()),
        sentinel::Word::Alive(v) => Some(v),
        sentinel::Word::Absent => {
            let mut lost = false;
            if let Err(e) = copy::probe(*pid, probe, &mut lost) {
                if lost {
                    p.health.kill(|| "its incarnation is gone (identity probe)".into());
                }
                if cma_denied(&e) {
                    // No sentinel, and the kernel refuses the probe: nothing can check this peer's identity.
                    p.fall_back();
                    return Err(Error::not_supported(format!("VRAM transfers to agent '{}': {e}", p.name)));
                }
                return Err(e);
            }
            None
        }
    };
    let r = f()?;
    if seen.is_some_and(|v| word.load(Ordering::SeqCst) != v) {
        return Err(gone());
    }
    Ok(r)
}

/// Resolve a request that touches VRAM: its route, the device, and (for another process) the peer's
/// allocations, each opened inside the peer's gate (after the probe), so a stale handle never reaches the
/// driver.
pub(super) fn prep(shared: &Arc<Shared>, plan: &XferPlan) -> Result<VramPlan> {
    let device = device::get()?;
    for m in [plan.local_mem, plan.remote_mem] {
        if m != MemType::Dram && m != MemType::Vram {
            return Err(Error::not_supported(format!("this engine does not move {}", m.seg_name())));
        }
    }
    let remote_is_vram = plan.remote_mem == MemType::Vram;
    let local_dev = plan.local_keys.iter().flatten().find_map(Registered::vram_dev);
    let peer = match &plan.target {
        Target::Local => None,
        Target::Remote(p) => Some(downcast(p)?),
    };
    // Another process (else addresses are valid here: loopback, or an agent of this process).
    let process = match peer.map(|p| (p, &p.kind)) {
        None => false,
        Some((ep, PeerKind::InProcess(InProcess { target, .. }))) => {
            target.upgrade().ok_or_else(|| Error::disconnected(format!("agent '{}' has been destroyed", ep.name)))?;
            false
        }
        Some((ep, PeerKind::Cma(Cma { proof, gate, .. }))) => {
            // The engine sends a denied peer's requests over TCP unless this says they can stay here (see
            // `ipc_despite_denial`); refused if one comes anyway.
            if ep.fallen_back().is_some() && !ipc_despite_denial(gate, remote_is_vram) {
                return Err(Error::not_supported(format!(
                    "VRAM transfers to agent '{}' need cross-memory attach here (remote DRAM staged), or its \
                     transfer gate with an exit/exec sentinel, and the kernel denies cross-memory attach to it \
                     (ptrace permission; `python -m gixl doctor` says why)",
                    ep.name
                )));
            }
            // No pidfd or no gate: the peer did not prove it runs here, or has exited (see `load_peer`).
            if proof.is_none() || gate.is_none() {
                return Err(Error::disconnected(format!("agent '{}' is not reachable as a local process", ep.name)));
            }
            true
        }
        // The engine hands these to `route::tcp::vram` before this.
        Some((ep, PeerKind::Net(_))) => {
            return Err(Error::backend(format!("VRAM to agent '{}' over the network goes by its route", ep.name)))
        }
    };
    let remote_dev = plan
        .remote_keys
        .iter()
        .flatten()
        .find_map(|k| k.downcast_ref::<RemoteVram>().map(|r| r.dev).or(Registered::vram_dev(k)));
    // The device whose context runs the copies: the local region's, else (this process) the remote one's,
    // else device 0 (a peer's allocation opened here from DRAM).
    let dev = local_dev.or(remote_dev.filter(|_| !process)).unwrap_or(0);
    let used: std::collections::BTreeSet<u32> = plan.segs.iter().map(|s| s.rreg).collect();
    let mut regions = Vec::with_capacity(plan.remote_keys.len());
    let mut gated = Vec::new();
    for (i, k) in plan.remote_keys.iter().enumerate() {
        let k = k.as_ref().filter(|_| used.contains(&(i as u32)));
        let u = if k.and_then(Registered::vram_dev).is_some() {
            // Loopback: this agent's own key.
            Some(RegionUse::SAME)
        } else if let Some(r) = k.and_then(|k| k.downcast_ref::<RemoteVram>()) {
            gated.push(r.gated());
            match peer.filter(|_| process) {
                Some(ep) => {
                    let PeerKind::Cma(Cma { proof: Some(proof), sock, secret, pid, .. }) = &ep.kind else {
                        return Err(Error::backend("peer without a pidfd"));
                    };
                    // The gate and the probe first: a stale handle never reaches the driver.
                    let chunks = in_peer_gate(ep, &[r.gated()], || {
                        r.chunks
                            .iter()
                            .map(|c| {
                                // The exporter's descriptor (fd handles): `pidfd_getfd`, else its control socket.
                                let take = || {
                                    let (num, want) = device::fd_of(&c.handle)?;
                                    let peer = (sock.as_slice(), *secret, ep.incarnation, *pid);
                                    let f = take_peer_fd(shared, proof.pidfd.as_fd(), peer, num)?;
                                    device::same_object(f, want)
                                };
                                let op = open_alloc(device, r, c, dev, &take)?;
                                let shift = op.map.base().wrapping_sub(c.base);
                                Ok((c.base, c.base + c.handle.size, shift, op))
                            })
                            .collect::<Result<Vec<_>>>()
                    })?;
                    Some(RegionUse { chunks })
                }
                None => Some(RegionUse::SAME),
            }
        } else {
            // A DRAM region on the far side: nothing to open (another process: staged through CMA).
            None
        };
        regions.push(u);
    }
    Ok(VramPlan { regions, gated, dev, device, remote_is_vram })
}

impl Mover for VramPlan {
    /// Copy `segs` (one piece of a request), batch by batch, each inside the target's gate.
    fn copy(&self, core: &Core, segs: &[Seg], run: &Run) -> Result<()> {
        if run.abort.load(Ordering::Relaxed) {
            return Err(Error::new(Status::Canceled, "transfer stopped"));
        }
        if matches!(core.peer().map(|p| &p.kind), Some(PeerKind::Cma(_))) && !self.remote_is_vram {
            return self.staged(core, segs, run);
        }
        let op = core.plan.op;
        // Each segment as copies between addresses valid here, cut where the peer's chunks meet.
        let copies = |b: &[Seg]| -> Vec<Copy> {
            let mut v = Vec::with_capacity(b.len());
            let same = RegionUse::SAME;
            for s in b {
                let u = self.regions.get(s.rreg as usize).and_then(|u| u.as_ref()).unwrap_or(&same);
                u.pieces(s.remote, s.len, &mut |off, len, remote| {
                    let local = s.local + off;
                    v.push(match op {
                        XferOp::Read => Copy { dst: local, src: remote, len },
                        XferOp::Write => Copy { dst: remote, src: local, len },
                    })
                });
            }
            v
        };
        let Some(p) = core.peer() else {
            // Loopback: both sides are this agent's registrations, as for DRAM.
            return self.device.copy(self.dev, &copies(segs));
        };
        copy::for_batches(segs, copy::BATCH_SEGS, copy::BATCH_BYTES, &mut |b| {
            if run.abort.load(Ordering::Relaxed) {
                return Err(Error::new(Status::Canceled, "transfer stopped"));
            }
            match &p.kind {
                PeerKind::InProcess(InProcess { gate, .. }) => {
                    let gate = gate.as_ref().ok_or_else(|| Error::disconnected("the peer agent has been destroyed"))?;
                    let _inside = if self.remote_is_vram {
                        gate.enter(self.gated.iter().copied()).map_err(refused)?
                    } else {
                        gate.enter(conn::gate_regions(&core.plan.remote_keys))?
                    };
                    self.device.copy(self.dev, &copies(b))
                }
                PeerKind::Cma(_) => in_peer_gate(p, &self.gated, || self.device.copy(self.dev, &copies(b))),
                // `prep` refuses network peers.
                PeerKind::Net(_) => Err(Error::backend("unreachable route")),
            }
        })
    }
}

impl VramPlan {
    /// Local VRAM, remote DRAM in another process: stage through a page-locked buffer.
    fn staged(&self, core: &Core, segs: &[Seg], run: &Run) -> Result<()> {
        let op = core.plan.op;
        let peer = core.peer().ok_or_else(|| Error::backend("unreachable route"))?;
        let PeerKind::Cma(cma @ Cma { gate: Some(_), .. }) = &peer.kind else {
            return Err(Error::not_supported(format!(
                "agent '{}' cannot be reached by cross-memory attach, which VRAM <-> remote DRAM needs",
                peer.name
            )));
        };
        // The remote DRAM side goes through the peer's CMA gate (see `gate`), batch by batch, as DRAM does.
        let job =
            Job { op, keys: &core.plan.remote_keys, prepared: None, abort: &run.abort, agent: &core.shared.agent };
        // SAFETY: the staged local ranges lie inside the staging buffer, alive for the call.
        let cma = |staged: &[Seg]| unsafe { cma.batches(&job, staged) };
        let buf = Staging::take(self.device, self.dev)?;
        let flush = |chunk: &[Seg]| -> Result<()> {
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
            let device = || self.device.copy(self.dev, &dev_copies);
            match op {
                XferOp::Read => cma(&staged).and_then(|()| device()),
                XferOp::Write => device().and_then(|()| cma(&staged)),
            }
        };
        copy::chunks(segs, STAGE).iter().try_for_each(|c| flush(c))
    }
}

/// A buffer of the engine's staging pool (`pool::Pinned`, shared by every VRAM request that stages), given
/// back when dropped.
pub(crate) struct Staging(Option<PinnedBuf>);

/// At most this many are kept; as many as requests need are lent (a request stages through one at a time).
static STAGING: Mutex<Pinned> = Mutex::new(Pinned::new(STAGE as usize, 8, usize::MAX));

impl Staging {
    pub(crate) fn take(device: &dyn Device, dev: u32) -> Result<Staging> {
        // Never None: every request gets one (`lend` is unbounded).
        let b = STAGING.lock().take(device, dev)?.ok_or_else(|| Error::backend("no staging buffer"))?;
        Ok(Staging(Some(b)))
    }

    pub(crate) fn ptr(&self) -> u64 {
        self.0.as_ref().map_or(0, |b| b.buf.ptr())
    }

    /// Its size in bytes.
    pub(crate) fn size(&self) -> u64 {
        self.0.as_ref().map_or(0, |b| b.buf.size() as u64)
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if let Some(b) = self.0.take() {
            STAGING.lock().put(b);
        }
    }
}

/// Whether a plan goes through this module.
pub(super) fn wants(plan: &XferPlan) -> bool {
    plan.local_mem == MemType::Vram || plan.remote_mem == MemType::Vram
}

#[cfg(test)]
mod tests {
    use super::super::vram_regions::{load_remote, PUBLIC_VERSION};
    use super::*;
    use crate::agent::{Agent, AgentConfig, NotifUpdate, XferOpts};
    use crate::backend::Params;
    use crate::device::{fake, HandleKind, IpcHandle, Mapping};
    use crate::md::{put_bytes, put_uvar};
    use crate::mem::{Desc, RegDList, RegDesc, XferDList};
    use std::time::{Duration, Instant};

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

    /// Public bytes of a region over `chunks` (base, size).
    fn public(chunks: &[(u64, u64)]) -> Vec<u8> {
        let mut b = vec![PUBLIC_VERSION];
        for v in [1, 7, 3, chunks.len() as u64] {
            put_uvar(&mut b, v);
        }
        for &(base, size) in chunks {
            put_uvar(&mut b, base);
            put_uvar(&mut b, size);
            b.push(HandleKind::PosixFd as u8);
            put_bytes(&mut b, &[0; 20]);
        }
        b
    }

    #[test]
    fn remote_chunks_must_cover_the_region_back_to_back_and_copies_are_cut_there() {
        let d = |a, l| Desc::new(a, l, 1);
        let ok = load_remote(5, &d(0x1800, 0x2000), &public(&[(0x1000, 0x1000), (0x2000, 0x4000)])).unwrap();
        let r = ok.downcast_ref::<RemoteVram>().unwrap();
        assert_eq!((r.chunks.len(), r.gated()), (2, (7, 3, 0x1800, 0x2000)));
        for (desc, chunks) in [
            (d(0x1800, 0x2000), vec![]),                                   // no chunk
            (d(0x1800, 0x2000), vec![(0x1000, 0x1000), (0x2800, 0x4000)]), // a gap
            (d(0x0800, 0x1000), vec![(0x1000, 0x4000)]),                   // starts before
            (d(0x1000, 0x4001), vec![(0x1000, 0x4000)]),                   // ends after
            (d(0x1000, 0x10), vec![(0x1000, 0)]),                          // an empty chunk
        ] {
            assert_eq!(load_remote(5, &desc, &public(&chunks)).err().unwrap().status(), Status::Mismatch);
        }
        // Pieces: chunk A [0x1000, 0x2000) here at +0x10000, chunk B [0x2000, 0x6000) here at +0x50000.
        let fake_open = || Arc::new(Opened { map: Box::new(NoMap) });
        let u =
            RegionUse { chunks: vec![(0x1000, 0x2000, 0x10000, fake_open()), (0x2000, 0x6000, 0x50000, fake_open())] };
        let mut got = Vec::new();
        u.pieces(0x1ff0, 0x30, &mut |off, len, here| got.push((off, len, here)));
        assert_eq!(got, vec![(0, 0x10, 0x11ff0), (0x10, 0x20, 0x52000)]);
        got.clear();
        RegionUse::SAME.pieces(0x1ff0, 0x30, &mut |off, len, here| got.push((off, len, here)));
        assert_eq!(got, vec![(0, 0x30, 0x1ff0)]);
    }

    /// Public bytes of a one-chunk region at 0x1000+0x1000 whose handle is `kind` with `bytes`.
    fn public_kind(kind: u8, bytes: &[u8]) -> Vec<u8> {
        let mut b = vec![PUBLIC_VERSION];
        for v in [1, 7, 3, 1, 0x1000, 0x1000] {
            put_uvar(&mut b, v);
        }
        b.push(kind);
        put_bytes(&mut b, bytes);
        b
    }

    #[test]
    fn fabric_handles_travel_in_metadata_and_unknown_kinds_are_refused() {
        let d = Desc::new(0x1000, 0x1000, 1);
        let fabric: [u8; device::FABRIC_LEN] = std::array::from_fn(|i| i as u8 ^ 0xa5);
        let fd_part = (17, (0x1234, 0x5678));
        for fallback in [Some(fd_part), None] {
            let bytes = device::fabric_handle_bytes(&fabric, fallback);
            assert_eq!(bytes.len(), 64 + if fallback.is_some() { 20 } else { 0 });
            let k = load_remote(5, &d, &public_kind(HandleKind::Fabric as u8, &bytes)).unwrap();
            let r = k.downcast_ref::<RemoteVram>().unwrap();
            let h = &r.chunks[0].handle;
            assert_eq!((h.kind, h.size, &h.bytes), (HandleKind::Fabric, 0x1000, &bytes));
            assert_eq!(device::fabric_handle(&h.bytes).unwrap(), (fabric, fallback));
            match fallback {
                Some(f) => assert_eq!(device::fd_of(h).unwrap(), f),
                // A fabric-only handle gives the importer nothing to fall back to: NOT_SUPPORTED, said plainly.
                None => {
                    let e = device::fd_of(h).unwrap_err();
                    assert_eq!(e.status(), Status::NotSupported);
                    assert!(e.message().contains("fabric handle only"), "{}", e.message());
                }
            }
        }
        // A fabric handle of the wrong length is malformed, not a panic.
        let h = IpcHandle { kind: HandleKind::Fabric, size: 1, bytes: vec![0; 70] };
        assert_eq!(device::fd_of(&h).unwrap_err().status(), Status::Mismatch);
        assert!(device::fabric_handle(&[0; 63]).is_err());
        // Kinds this build does not know (0, a future 4, anything) are refused with a clear message.
        for k in [0u8, 4, 9, 255] {
            let e = load_remote(5, &d, &public_kind(k, &[0; 64])).err().unwrap();
            assert_eq!(e.status(), Status::Mismatch);
            assert!(e.message().contains(&format!("handle kind {k}, unknown")), "{}", e.message());
        }
        assert_eq!(HandleKind::from_u8(3), Some(HandleKind::Fabric));
    }

    struct NoMap;
    impl Mapping for NoMap {
        fn base(&self) -> u64 {
            0
        }
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
        // Chunks mapped back to back make one region; a hole where one was freed ends it.
        let c = fake::alloc_chunks(5, &[4096, 8192, 4096], true, None).unwrap();
        reg(&a, MemType::Vram, c + 100, 16384 - 200, 5);
        fake::free(c + 4096).unwrap();
        assert!(bad(c, 16384, 5).message().contains("crosses the end"));
        assert!(bad(c + 12288, 8192, 5).message().contains("crosses the end"));
        assert!(bad(p + 4096, 8192, 4).message().contains("crosses the end"));
        assert!(bad(p, 4096, 5).message().contains("device 4"));
    }
}
