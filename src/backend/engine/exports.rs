//! The target's side of every route, in one place: a registration's row (`Registered`, the key the agent keeps)
//! and what each route serves it from, written here and only here: its slot in the transfer gate (same-host
//! routes check it for every batch), its range in the TCP region table (what TCP peers may reach and what
//! deregistration waits for, see `route::tcp::regions`) and, for VRAM, its exported allocations (the CUDA IPC
//! handles of its public bytes, see `vram_regions`) and, with an RDMA port, its memory region (the key its
//! public bytes carry, see `route::rdma::target`). Deregistration retires them all together: no peer of any
//! route touches the range after it returns.

use std::sync::Arc;

use super::conn::{encode_ticket, RdmaKeys};
use super::gate::RegionTicket;
use super::route::rdma::target::{Place, RdmaSide};
use super::shared::Shared;
use super::vram_regions::with_rdma;
use crate::backend::{LocalRegion, RegionKey};
use crate::mem::{MemType, RegDesc};
use crate::status::{Error, Result};
use crate::verbs::Mr;

/// A local region's RDMA memory regions as a request uses them: its key on each port (by port index), and the
/// ports nearest its memory (a mask by port index).
pub(super) struct LocalMrs {
    pub(super) keys: Box<[u32]>,
    pub(super) near: u32,
    /// Where each of its memory regions starts, for a region registered as several (`RdmaKeys::bounds`).
    pub(super) bounds: Box<[u64]>,
}

/// One registration of this engine, as its key.
pub(super) struct Registered {
    addr: u64,
    len: u64,
    ticket: RegionTicket,
    /// VRAM: its device and the base of each exported allocation it spans; None for DRAM.
    vram: Option<(u32, Vec<u64>)>,
    /// With RDMA ports: its memory region on each (by port index); none for VRAM the NIC cannot reach.
    mrs: Vec<Mr>,
    /// The ports nearest its memory (a mask by port index, see `RdmaSide::near`).
    near: u32,
    /// Where each of its memory regions starts, where it has several (`mrs` then holds one per port for each).
    bounds: Vec<u64>,
}

impl Registered {
    /// The device of a local VRAM registration's key.
    pub(super) fn vram_dev(key: &RegionKey) -> Option<u32> {
        key.downcast_ref::<Registered>()?.vram.as_ref().map(|v| v.0)
    }

    /// The RDMA local keys (by port index) and nearest ports of a local registration's key.
    pub(super) fn rdma_lkeys(key: &RegionKey) -> Option<LocalMrs> {
        let r = key.downcast_ref::<Registered>()?;
        (!r.mrs.is_empty()).then(|| LocalMrs {
            keys: r.mrs.iter().map(|m| m.lkey).collect(),
            near: r.near,
            bounds: r.bounds.clone().into(),
        })
    }
}

impl Shared {
    /// Register `desc` with every route: a gate slot, a TCP range, and for VRAM the exports whose handles its
    /// public bytes carry (the gate ticket alone for DRAM).
    pub(super) fn register(&self, mem: MemType, desc: &RegDesc) -> Result<LocalRegion> {
        let d = &desc.desc;
        // The ports nearest its memory: its GPU's PCI place, or its first page's NUMA node.
        let near = match (&self.rdma, mem) {
            (None, _) => 0,
            (Some(r), MemType::Vram) => {
                let pci = crate::device::get().ok().and_then(|dev| dev.pci_path(d.dev as u32));
                r.near(&pci.map_or(Place::Unknown, Place::Pci))
            }
            (Some(r), _) => r.near(&crate::os::numa_node_of(d.addr).map_or(Place::Unknown, Place::Numa)),
        };
        let rdma_keys = |mrs: &[Mr], bounds: &[u64]| RdmaKeys {
            rkeys: mrs.iter().map(|m| m.rkey).collect(),
            near,
            bounds: bounds.to_vec(),
        };
        let mut bounds = Vec::new();
        let (public, ticket, vram, mrs) = match mem {
            MemType::Vram => {
                // `register` checks that the descriptor's device is the allocation's.
                let v = self.vram.register(&self.ctrl, &self.gate, desc)?;
                let mrs = match &self.rdma {
                    None => Vec::new(),
                    Some(r) => {
                        let (mrs, b) = self.device_mrs(r, d.addr, d.len, d.dev, &v.bases);
                        bounds = b;
                        mrs
                    }
                };
                (with_rdma(v.public, &rdma_keys(&mrs, &bounds)), v.ticket, Some((d.dev as u32, v.bases)), mrs)
            }
            MemType::Dram => {
                let mrs = self.rdma.as_ref().map(|r| r.register(d.addr, d.len)).transpose()?.unwrap_or_default();
                let t = match self.gate.register(d.addr, d.len) {
                    Ok(t) => t,
                    Err(e) => {
                        if let Some(r) = &self.rdma {
                            r.deregister(&mrs);
                        }
                        return Err(e);
                    }
                };
                (encode_ticket(t, &rdma_keys(&mrs, &[])), t, None, mrs)
            }
            _ => return Err(Error::not_supported(format!("{} is not supported by this engine", mem.seg_name()))),
        };
        // TCP peers reach VRAM through the serving loops, staged (see `route::tcp::stage`).
        self.regions.add(d.addr, d.len, vram.as_ref().map(|v| v.0));
        let key: RegionKey = Arc::new(Registered { addr: d.addr, len: d.len, ticket, vram, mrs, near, bounds });
        Ok(LocalRegion { public, key: Some(key) })
    }

    /// A VRAM region's memory regions for RDMA peers (and where each starts, for several), chosen per region and
    /// said in the log: reached by the NIC directly (a dma-buf of its part of each allocation in `bases`, else
    /// peer memory), else none (RDMA peers' requests on it are staged through host memory over their TCP link).
    fn device_mrs(&self, rdma: &RdmaSide, addr: u64, len: u64, dev: u64, bases: &[u64]) -> (Vec<Mr>, Vec<u64>) {
        let end = addr + len;
        let pieces: Vec<(u64, u64)> = bases
            .iter()
            .enumerate()
            .map(|(i, &b)| {
                let (lo, hi) = (b.max(addr), bases.get(i + 1).map_or(end, |&n| n.min(end)));
                (lo, hi - lo)
            })
            .collect();
        let (mrs, bounds, how) = match rdma.register_device(&pieces) {
            Ok((mrs, bounds, how)) => {
                let n = if bounds.is_empty() { String::new() } else { format!(", {} memory regions", bounds.len()) };
                (mrs, bounds, format!("reached by the RDMA NIC directly ({how}{n})"))
            }
            Err(why) => (Vec::new(), Vec::new(), format!("staged through host memory for RDMA peers ({why})")),
        };
        let line = format!("agent '{}': VRAM region {addr:#x}+{len} on GPU {dev}: {how}", self.agent);
        if mrs.is_empty() {
            crate::telemetry::log::warn(&line)
        } else {
            crate::telemetry::log::info(&line)
        }
        (mrs, bounds)
    }

    /// Deregister the regions of `keys` (this engine's, from `register`) from every route: each refuses new
    /// work on them at once, then one bounded wait for same-host peers' batches inside the gate and one for
    /// TCP requests being served, however many go; last, VRAM exports are dropped.
    pub(super) fn deregister(&self, keys: &[Option<&RegionKey>]) {
        let rows: Vec<&Registered> = keys.iter().flatten().filter_map(|k| k.downcast_ref::<Registered>()).collect();
        let tickets: Vec<RegionTicket> = rows.iter().map(|r| r.ticket).collect();
        self.gate.retire(&tickets, self.tcp_opts.timeout);
        let ranges: Vec<(u64, u64, Option<u32>)> =
            rows.iter().map(|r| (r.addr, r.len, r.vram.as_ref().map(|v| v.0))).collect();
        self.regions.remove(&ranges);
        for (_, bases) in rows.iter().filter_map(|r| r.vram.as_ref()) {
            self.vram.unexport_all(&self.ctrl, bases);
        }
        // The NIC refuses the keys once this returns (accesses under way finish first).
        if let Some(rdma) = &self.rdma {
            rows.iter().for_each(|r| rdma.deregister(&r.mrs));
        }
    }
}
