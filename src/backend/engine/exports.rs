//! The target's side of every route, in one place: a registration's row (`Registered`, the key the agent keeps)
//! and what each route serves it from, written here and only here: its slot in the transfer gate (same-host
//! routes check it for every batch), its range in the TCP region table (what TCP peers may reach and what
//! deregistration waits for, see `route::tcp::regions`), for VRAM its exported allocations (the CUDA IPC handles
//! of its public bytes, see `vram_regions`), and each route side's export of it (`route::Side`: an RDMA port's
//! memory regions, whose keys its public bytes carry). Deregistration retires them all together: no peer of any
//! route touches the range after it returns.

use std::sync::Arc;

use super::conn::encode_ticket;
use super::gate::RegionTicket;
use super::route::{Export, Exports, Registration};
use super::shared::Shared;
use super::vram_regions::with_sections;
use crate::backend::{LocalRegion, RegionKey};
use crate::mem::{MemType, RegDesc};
use crate::status::{Error, Result};

/// One registration of this engine, as its key.
pub(super) struct Registered {
    addr: u64,
    len: u64,
    ticket: RegionTicket,
    /// VRAM: its device and the base of each exported allocation it spans; None for DRAM.
    vram: Option<(u32, Vec<u64>)>,
    /// Each route side's export of it, in `Sides::all`'s order (None where that route does not reach it).
    exports: Vec<Option<Box<dyn Export>>>,
}

impl Registered {
    /// The device of a local VRAM registration's key.
    pub(super) fn vram_dev(key: &RegionKey) -> Option<u32> {
        key.downcast_ref::<Registered>()?.vram.as_ref().map(|v| v.0)
    }

    /// The routes' exports of a local registration's key (`route::Regions::exports`).
    pub(super) fn exports(key: &RegionKey) -> Option<&Exports> {
        key.downcast_ref::<Registered>().map(|r| &r.exports[..])
    }
}

impl Shared {
    /// Register `desc` with every route: a gate slot, a TCP range, for VRAM the exports whose handles its public
    /// bytes carry, and each route side's export, whose sections its public bytes carry too.
    pub(super) fn register(&self, mem: MemType, desc: &RegDesc) -> Result<LocalRegion> {
        let d = &desc.desc;
        let (ticket, vram, public) = match mem {
            MemType::Vram => {
                // `register` checks that the descriptor's device is the allocation's.
                let v = self.vram.register(&self.ctrl, &self.gate, desc)?;
                (v.ticket, Some((d.dev as u32, v.bases)), Some(v.public))
            }
            MemType::Dram => (self.gate.register(d.addr, d.len)?, None, None),
            _ => return Err(Error::not_supported(format!("{} is not supported by this engine", mem.seg_name()))),
        };
        // TCP peers reach VRAM through the serving loops, staged (see `route::tcp::stage`).
        self.regions.add(d.addr, d.len, vram.as_ref().map(|v| v.0));
        let mut row = Registered { addr: d.addr, len: d.len, ticket, vram, exports: Vec::new() };
        let bases = row.vram.as_ref().map_or(&[][..], |v| &v.1[..]);
        let r = Registration { mem, addr: d.addr, len: d.len, dev: d.dev, bases, agent: &self.agent };
        for side in self.sides.all() {
            match side.export(&r) {
                Ok(e) => row.exports.push(e),
                Err(e) => {
                    self.retire(&[&row]);
                    return Err(e);
                }
            }
        }
        let mut sections = Vec::new();
        row.exports.iter().flatten().for_each(|e| e.put_sections(&mut sections));
        let public = public.map_or_else(|| encode_ticket(ticket, &sections), |p| with_sections(p, &sections));
        Ok(LocalRegion { public, key: Some(Arc::new(row)) })
    }

    /// Deregister the regions of `keys` (this engine's, from `register`) from every route.
    pub(super) fn deregister(&self, keys: &[Option<&RegionKey>]) {
        self.retire(&keys.iter().flatten().filter_map(|k| k.downcast_ref::<Registered>()).collect::<Vec<_>>());
    }

    /// Each route refuses new work on `rows` at once, then one bounded wait for same-host peers' batches inside
    /// the gate and one for TCP requests being served, however many go; last, VRAM exports are dropped and the
    /// route sides retire theirs.
    fn retire(&self, rows: &[&Registered]) {
        self.gate.retire(&rows.iter().map(|r| r.ticket).collect::<Vec<_>>(), self.tcp_opts.timeout);
        self.regions.remove(&rows.iter().map(|r| (r.addr, r.len, r.vram.as_ref().map(|v| v.0))).collect::<Vec<_>>());
        rows.iter().filter_map(|r| r.vram.as_ref()).for_each(|(_, b)| self.vram.unexport_all(&self.ctrl, b));
        let exports = rows.iter().flat_map(|r| self.sides.all().zip(&r.exports));
        exports.for_each(|(side, e)| e.iter().for_each(|e| side.retire(&**e)));
    }
}
