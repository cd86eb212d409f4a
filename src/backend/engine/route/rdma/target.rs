//! The RDMA route's side of this engine (`RdmaSide`): its opened ports, each with one protection domain per
//! engine incarnation (so a handle built against an earlier incarnation names keys of a domain that no longer
//! exists), the memory regions of its registrations, its connection-info section, and the target's half of
//! the queue-pair exchange. It is the route's `Side`: a registration's export (`RdmaExport`) is its memory
//! regions, chosen per region and said in the log for GPU memory, and the ports nearest its memory.
//!
//! Exactness on a one-sided route: after `deregister` returns, the NIC refuses the region's key (deregistering
//! waits for accesses under way). A NIC may hand the same key value to a later region (the lowest free index
//! comes back; mlx5 varies only 8 bits of it), and a peer holding the old handle would then reach the new
//! region wherever the ranges overlap, as when an application registers the same buffer again. So a domain never
//! hands one key value out twice (`keys::KeyLedger`, shared with the libfabric route).

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::wire::{self, Port, RdmaKeys};
use crate::backend::engine::keys::KeyLedger;
use crate::backend::engine::near::{self, Place};
use crate::backend::engine::route::{Export, Registration, Side, Transport};
use crate::mem::MemType;
use crate::status::Result;
use crate::verbs::{self, Cq, Mr, Nic, PortEvent, QpAddr, QpCaps, LOCAL_WRITE, REMOTE_READ, REMOTE_WRITE};

/// Target pairs only answer: they post nothing.
const TARGET_CAPS: QpCaps = QpCaps { send_wr: 1, recv_wr: 1, sge: 1 };

pub(crate) struct RdmaSide {
    /// Every active port, opened, each with its own protection domain (in the order the section lists them).
    pub(crate) ports: Vec<PortSide>,
    /// The fabric they are on, for their self-tests (`verbs::selftest`).
    fabric: Arc<dyn verbs::Fabric>,
    /// `GIXL_TRANSPORT=rdma`: the ports are used whatever their self-tests say.
    pub(crate) forced: bool,
    /// Exchange connections being served (each holds its pairs): shut down when the engine goes.
    conns: Mutex<Vec<TcpStream>>,
    /// Wakes the thread that reads the NICs' own events (`watch`), to end it.
    stop: OwnedFd,
}

/// One opened port of this engine.
pub(crate) struct PortSide {
    pub(crate) nic: Arc<dyn Nic>,
    /// Completion queue of the target's pairs (they post nothing: it stays empty).
    cq: Arc<dyn Cq>,
    pub(crate) port: Port,
    /// Every key value this domain handed out, and the tombstones that keep reused ones taken.
    keys: KeyLedger<(Mr, Box<[u8]>)>,
    /// A few bytes of local memory the initiator reads into to flush its WRITEs (see `Rdma::run`), kept for
    /// the engine's life.
    pub(crate) scratch: (Mr, Box<[u8]>),
    /// The NIC said the port went down (an async event) and has not said it came back: its paths are not taken.
    pub(crate) down: AtomicBool,
}

impl PortSide {
    /// A memory region made by `reg` (given the NIC and the access peers get: read and write), under a key
    /// value this domain never handed out before (`KeyLedger`).
    fn register(&self, reg: &dyn Fn(&dyn Nic, u32) -> Result<Mr>) -> Result<Mr> {
        self.keys.register(
            "the NIC",
            || reg(&*self.nic, LOCAL_WRITE | REMOTE_READ | REMOTE_WRITE),
            |mr| u64::from(mr.rkey),
            |mr| self.nic.dereg_mr(&mr),
            || {
                let dummy = vec![0u8; 64].into_boxed_slice();
                let t = self.nic.reg_mr(dummy.as_ptr() as u64, dummy.len() as u64, LOCAL_WRITE)?;
                let k = u64::from(t.rkey);
                Ok(((t, dummy), k))
            },
        )
    }
}

/// A registration's memory regions on this engine's ports (see `Side::export`).
pub(crate) struct RdmaExport {
    /// Its memory region on each port (by port index); for a region registered as several (`bounds`), port by
    /// port inside each, one after the other.
    pub(crate) mrs: Vec<Mr>,
    /// The ports nearest its memory (a mask by port index, see `RdmaSide::near`).
    pub(crate) near: u32,
    /// Where each of its memory regions starts, where it has several.
    pub(crate) bounds: Vec<u64>,
}

impl Export for RdmaExport {
    fn put_sections(&self, out: &mut Vec<u8>) {
        let rkeys = self.mrs.iter().map(|m| m.rkey).collect();
        RdmaKeys { rkeys, near: self.near, bounds: self.bounds.clone() }.put_sections(out);
    }
}

impl Side for RdmaSide {
    /// Every port, and which of them passed their self-tests (run here, once per process, the first time this
    /// engine advertises them): peers take only those.
    fn section(&self) -> (u64, Vec<u8>) {
        let ports: Vec<Port> = self.ports.iter().map(|p| p.port).collect();
        (wire::SECTION, wire::encode_ports_trusted(&ports, self.trusted()))
    }

    /// Host memory: a memory region on every port (an error fails the registration). GPU memory: reached by the
    /// NIC directly where it can be (`register_device`), else none (RDMA peers' requests on it are staged
    /// through host memory over their TCP link); the choice is one log line per region.
    fn export(&self, r: &Registration) -> Result<Option<Box<dyn Export>>> {
        let what = || format!("agent '{}': VRAM region {:#x}+{} on GPU {}", r.agent, r.addr, r.len, r.dev);
        let (mrs, bounds, place) = match r.mem {
            MemType::Vram => match self.register_device(&pieces(r.addr, r.len, r.bases)) {
                Ok((mrs, bounds, how)) => {
                    let n =
                        if bounds.is_empty() { String::new() } else { format!(", {} memory regions", bounds.len()) };
                    crate::telemetry::log::info(&format!("{}: reached by the RDMA NIC directly ({how}{n})", what()));
                    let pci = crate::device::get().ok().and_then(|dev| dev.pci_path(r.dev as u32));
                    (mrs, bounds, pci.map_or(Place::Unknown, Place::Pci))
                }
                Err(why) => {
                    crate::telemetry::log::warn(&format!(
                        "{}: staged through host memory for RDMA peers ({why})",
                        what()
                    ));
                    return Ok(None);
                }
            },
            _ => (self.register(r.addr, r.len)?, Vec::new(), Place::host(r.addr)),
        };
        // The ports nearest its memory: its GPU's PCI place, or its first page's NUMA node.
        Ok(Some(Box::new(RdmaExport { mrs, near: self.near(&place), bounds })))
    }

    fn retire(&self, e: &dyn Export) {
        // The NIC refuses the keys once this returns (accesses under way finish first).
        if let Some(e) = (e as &dyn std::any::Any).downcast_ref::<RdmaExport>() {
            self.deregister(&e.mrs);
        }
    }

    fn close(&self) {
        RdmaSide::close(self)
    }
}

/// A region's part of each allocation it spans (`bases`, in address order), back to back.
fn pieces(addr: u64, len: u64, bases: &[u64]) -> Vec<(u64, u64)> {
    let end = addr + len;
    bases
        .iter()
        .enumerate()
        .map(|(i, &b)| {
            let (lo, hi) = (b.max(addr), bases.get(i + 1).map_or(end, |&n| n.min(end)));
            (lo, hi - lo)
        })
        .collect()
}

impl RdmaSide {
    /// The side an engine of `transport` starts: none with `tcp`, or where the host has no usable port (said
    /// in the log where it was asked for). Its `serve` takes the TCP listener's connections of its kind (`wire::KIND`).
    pub(crate) fn start_for(transport: Transport, agent: &str) -> Option<Arc<RdmaSide>> {
        match (transport, RdmaSide::start(transport == Transport::Rdma)) {
            (Transport::Tcp | Transport::Fabric, _) => None,
            (_, Ok(side)) => {
                crate::telemetry::log::info(&format!("agent '{agent}': RDMA port {}", side.label()));
                Some(side)
            }
            (Transport::Rdma, Err(why)) => {
                crate::telemetry::log::warn(&format!(
                    "agent '{agent}': GIXL_TRANSPORT=rdma but no RDMA port here ({why}): peers over TCP"
                ));
                None
            }
            (Transport::Auto, Err(_)) => None,
        }
    }

    /// This engine's ports: every active one of the fabric (`verbs::fabric`). None, with the reason, where
    /// there is none (no library, no device, no active port): peers are then reached over TCP. A port is used
    /// only once its self-test passed in this process (`trusted`), unless asked for (`asked`:
    /// `GIXL_TRANSPORT=rdma`); opening the ports tests nothing yet (agent creation does not wait for it).
    pub(crate) fn start(asked: bool) -> std::result::Result<Arc<RdmaSide>, String> {
        Self::start_on(verbs::fabric().map_err(|e| e.message().to_owned())?, asked)
    }

    /// `start` on `fabric`.
    fn start_on(fabric: Arc<dyn verbs::Fabric>, asked: bool) -> std::result::Result<Arc<RdmaSide>, String> {
        let all = fabric.ports().map_err(|e| e.message().to_owned())?;
        let mut ports = Vec::new();
        for p in all.iter().filter(|p| p.active).take(wire::MAX_PORTS) {
            let open = || -> Result<PortSide> {
                let nic = fabric.open(&p.device, p.port)?;
                let cq = nic.create_cq(64)?;
                let buf = vec![0u8; 64].into_boxed_slice();
                let mr = nic.reg_mr(buf.as_ptr() as u64, buf.len() as u64, LOCAL_WRITE)?;
                let keys = KeyLedger::new([u64::from(mr.rkey)]);
                let scratch = (mr, buf);
                let down = AtomicBool::new(false);
                Ok(PortSide { port: Port::from(p), nic, cq, keys, scratch, down })
            };
            match open() {
                Ok(side) => ports.push(side),
                Err(e) => crate::telemetry::log::warn(&format!("RDMA port {}:{} not used: {e}", p.device, p.port)),
            }
        }
        if ports.is_empty() {
            return Err(format!("no usable active port among {} RDMA ports", all.len()));
        }
        let stop = crate::os::eventfd(false).map_err(|e| e.message().to_owned())?;
        let side = Arc::new(RdmaSide { ports, fabric, forced: asked, conns: Mutex::default(), stop });
        let weak = Arc::downgrade(&side);
        std::thread::Builder::new()
            .name("gixl-rdma-ev".into())
            .spawn(move || watch(weak))
            .map_err(|e| format!("cannot start the RDMA event thread: {e}"))?;
        Ok(side)
    }

    /// What doctor and the log call the ports.
    pub(crate) fn label(&self) -> String {
        let names: Vec<String> = self
            .ports
            .iter()
            .map(|p| format!("{}:{} ({:?})", p.nic.port().device, p.nic.port().port, p.port.link))
            .collect();
        names.join(", ")
    }

    /// The ports whose self-tests passed (a mask by port index; every port when forced). The first call runs
    /// the tests not run yet in this process (`verbs::selftest::cached`: one WARN line for a port that fails).
    pub(crate) fn trusted(&self) -> u32 {
        (self.ports.iter().enumerate())
            .filter(|(_, p)| self.forced || verbs::selftest::cached(&*self.fabric, p.nic.port()).passed)
            .fold(0, |m, (i, _)| m | 1 << i)
    }

    /// The paths to a peer with `remote` ports of which `theirs` passed their self-tests (a mask): each of our
    /// ports that passed paired with such a port of the peer it reaches (spread over the peer's ports), as (our
    /// index, its index); every port on both sides when forced. Empty: no common fabric.
    pub(crate) fn paths_to(&self, remote: &[Port], theirs: u32) -> Vec<(usize, usize)> {
        let (ours, theirs) = if self.forced { (u32::MAX, u32::MAX) } else { (self.trusted(), theirs) };
        self.ports
            .iter()
            .enumerate()
            .filter(|&(i, _)| ours & 1 << i != 0)
            .filter_map(|(i, p)| {
                let reach: Vec<usize> =
                    (0..remote.len()).filter(|&j| theirs & 1 << j != 0 && p.port.reaches(&remote[j])).collect();
                (!reach.is_empty()).then(|| (i, reach[i % reach.len()]))
            })
            .collect()
    }

    /// The ports nearest `place` (a mask by port index, see `near::near`).
    pub(crate) fn near(&self, place: &Place) -> u32 {
        near::near(self.ports.iter().map(|p| (p.nic.port().numa, p.nic.port().pci.as_deref())), place)
    }

    /// A memory region for host memory `[addr, addr + len)` on every port (by port index).
    pub(crate) fn register(&self, addr: u64, len: u64) -> Result<Vec<Mr>> {
        self.register_with(&|nic, access| nic.reg_mr(addr, len, access))
    }

    /// Device memory registered on every port without staging, and how: `pieces` (the region's part of each
    /// allocation it spans, back to back) each through a dma-buf of its range (`ibv_reg_dmabuf_mr`; needs the GPU
    /// driver's export and a NIC driver that takes it), their memory regions piece by piece (port by port inside
    /// a piece) and where each starts (empty for one piece); else the whole range as a plain region (which only
    /// the GPU vendor's peer-memory kernel module makes work). Err: neither works, with both reasons; the caller
    /// stages that region through host memory.
    pub(crate) fn register_device(
        &self,
        pieces: &[(u64, u64)],
    ) -> std::result::Result<(Vec<Mr>, Vec<u64>, &'static str), String> {
        let mut mrs = Vec::with_capacity(pieces.len() * self.ports.len());
        let mut by_dmabuf = || -> Result<()> {
            let dev = crate::device::get()?;
            for &(addr, len) in pieces {
                let (fd, offset) = dev.dmabuf(addr, len)?;
                mrs.extend(
                    self.register_with(&|nic, access| nic.reg_dmabuf_mr(fd.as_fd(), offset, len, addr, access))?,
                );
            }
            Ok(())
        };
        let dmabuf_err = match by_dmabuf() {
            Ok(()) => {
                let bounds = if pieces.len() > 1 { pieces.iter().map(|p| p.0).collect() } else { Vec::new() };
                return Ok((mrs, bounds, "dma-buf"));
            }
            Err(e) => {
                self.deregister(&mrs);
                e
            }
        };
        let (addr, end) = (pieces.first().map_or(0, |p| p.0), pieces.last().map_or(0, |p| p.0 + p.1));
        match self.register(addr, end - addr) {
            Ok(mrs) => Ok((mrs, Vec::new(), "peer memory")),
            Err(e) => Err(format!("dma-buf: {}; peer memory: {}", dmabuf_err.message(), e.message())),
        }
    }

    /// A memory region made by `reg` on every port (by port index); none if one fails.
    fn register_with(&self, reg: &dyn Fn(&dyn Nic, u32) -> Result<Mr>) -> Result<Vec<Mr>> {
        let mut mrs = Vec::with_capacity(self.ports.len());
        for p in &self.ports {
            match p.register(reg) {
                Ok(m) => mrs.push(m),
                Err(e) => {
                    self.deregister(&mrs);
                    return Err(e);
                }
            }
        }
        Ok(mrs)
    }

    /// After it returns, no peer's access through `mrs` (as `register` or `register_device` gave them: port by
    /// port, piece by piece) succeeds.
    pub(crate) fn deregister(&self, mrs: &[Mr]) {
        for (p, mr) in self.ports.iter().cycle().zip(mrs) {
            if let Err(e) = p.nic.dereg_mr(mr) {
                crate::telemetry::log::warn(&format!("RDMA: deregistering {:#x}+{}: {e}", mr.addr, mr.len));
            }
        }
    }

    /// Serve one exchange connection (authenticated by the TCP listener): read the initiator's pairs, make
    /// and connect ours, answer, and keep them until the connection closes.
    pub(crate) fn serve(self: &Arc<Self>, s: TcpStream, patience: Duration) {
        let me = self.clone();
        let spawned = std::thread::Builder::new().name("gixl-rdma-qp".into()).spawn(move || me.exchange(s, patience));
        if let Err(e) = spawned {
            crate::telemetry::log::warn(&format!("RDMA: cannot serve a queue-pair exchange: {e}"));
        }
    }

    fn exchange(&self, mut s: TcpStream, patience: Duration) {
        // Keepalive: an initiator partitioned away for good is reaped by the kernel, and its pair with it.
        crate::os::sock::tune(&s, patience);
        let _ = s.set_read_timeout(Some(patience));
        let _ = s.set_write_timeout(Some(patience));
        let mut head = [0u8; wire::OFFER_HEAD];
        if s.read_exact(&mut head).is_err() {
            return;
        }
        let Some(n) = wire::offer_len(&head) else { return };
        let mut offer = head.to_vec();
        offer.resize(n, 0);
        if s.read_exact(&mut offer[wire::OFFER_HEAD..]).is_err() {
            return;
        }
        let Some((port, theirs)) = wire::decode_offer(&offer) else { return };
        // A port that failed its self-test takes no pair (peers that read our section never offer one).
        let trusted = (port as usize) < self.ports.len() && (self.forced || self.trusted() & 1 << port != 0);
        let Some(side) = self.ports.get(port as usize).filter(|_| trusted) else {
            let _ = s.write_all(&[wire::ANSWER_REFUSED]);
            return;
        };
        let ours: Result<Vec<_>> = theirs
            .iter()
            .map(|t: &QpAddr| {
                let qp = side.nic.create_qp(&side.cq, &side.cq, TARGET_CAPS)?;
                qp.connect(t)?;
                Ok(qp)
            })
            .collect();
        let Ok(qps) = ours else {
            let _ = s.write_all(&[wire::ANSWER_REFUSED]);
            return;
        };
        let addrs: Vec<QpAddr> = qps.iter().map(|q| q.addr()).collect();
        if s.write_all(&wire::encode_answer(wire::ANSWER_OK, &addrs)).is_err() {
            return;
        }
        if let Ok(c) = s.try_clone() {
            self.conns.lock().push(c);
        }
        // The pairs live as long as the connection: the initiator closes it when it drops them (or dies).
        let _ = s.set_read_timeout(None);
        let mut b = [0u8; 64];
        while matches!(s.read(&mut b), Ok(n) if n > 0) {}
        let me = s.local_addr().ok().zip(s.peer_addr().ok());
        self.conns.lock().retain(|c| c.local_addr().ok().zip(c.peer_addr().ok()) != me);
        drop(qps);
    }

    /// The engine goes: every exchange connection is shut down (their pairs with them), and the event thread
    /// ends.
    pub(crate) fn close(&self) {
        crate::os::wake(&self.stop);
        for c in self.conns.lock().drain(..) {
            let _ = c.shutdown(Shutdown::Both);
        }
    }
}

impl Drop for RdmaSide {
    fn drop(&mut self) {
        // The event thread holds no reference: it finds this side gone when it wakes.
        crate::os::wake(&self.stop);
    }
}

/// The NICs' own events (a port going down or coming back), read as they come: sleeps in `poll` on the NICs'
/// event descriptors and the stop line, so an idle engine spends nothing here. A port said down is not taken by
/// new pieces, and pieces waiting on it give up within their wake-up interval (see `Rdma::wait`).
fn watch(side: std::sync::Weak<RdmaSide>) {
    let fds: Vec<i32> = match side.upgrade() {
        Some(s) => std::iter::once(s.stop.as_raw_fd()).chain(s.ports.iter().map(|p| p.nic.event_fd())).collect(),
        None => return,
    };
    let mut set: Vec<libc::pollfd> =
        fds.iter().map(|&fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 }).collect();
    loop {
        set.iter_mut().for_each(|p| p.revents = 0);
        // SAFETY: `set` is a valid array of pollfds for the duration of the call.
        let n = unsafe { libc::poll(set.as_mut_ptr(), set.len() as libc::nfds_t, -1) };
        if n < 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            return;
        }
        let Some(s) = side.upgrade() else { return };
        if set[0].revents != 0 {
            return;
        }
        for (p, fd) in s.ports.iter().zip(&set[1..]) {
            if fd.revents == 0 {
                continue;
            }
            while let Ok(Some(e)) = p.nic.port_event() {
                let down = e == PortEvent::Down;
                if p.down.swap(down, Ordering::AcqRel) != down {
                    let port = p.nic.port();
                    let what = if down { "went down: its paths are not taken" } else { "is up again" };
                    crate::telemetry::log::warn(&format!(
                        "RDMA port {}:{} {what} (the NIC says so)",
                        port.device, port.port
                    ));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verbs::fake::{fail_port, FakeFabric};

    /// A port the NIC says went down is marked down by the event thread (its paths are then not taken); the
    /// other stays up; an idle side's thread only sleeps.
    #[test]
    fn a_port_the_nic_says_is_down_is_marked_down() {
        let dir = std::env::temp_dir().join(format!("gixl-rdma-ev-{}", std::process::id()));
        let side = RdmaSide::start_on(Arc::new(FakeFabric::new(2, dir.clone(), false)), false).unwrap();
        assert_eq!(side.ports.len(), 2);
        assert!(side.ports.iter().all(|p| !p.down.load(Ordering::Acquire)));
        fail_port(side.ports[1].nic.port());
        let t = std::time::Instant::now();
        while !side.ports[1].down.load(Ordering::Acquire) && t.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(side.ports[1].down.load(Ordering::Acquire), "the event thread did not mark the port down");
        assert!(!side.ports[0].down.load(Ordering::Acquire));
        side.close();
        drop(side);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn only_ports_that_passed_their_self_tests_are_advertised_as_trusted_and_taken() {
        let dir = std::env::temp_dir().join(format!("gixl-rdma-st-{}", std::process::id()));
        let fabric = FakeFabric::new(2, dir.clone(), false).without_rma(vec![1]);
        let side = RdmaSide::start_on(Arc::new(fabric), false).unwrap();
        let (_, section) = Side::section(&*side);
        let ports = wire::decode_ports(&section).unwrap();
        assert_eq!(ports.len(), 2, "every port is listed");
        assert_eq!(wire::decode_trusted(&section), 0b01, "fake1 failed its self-test");
        // A peer with the same two ports: paths only between ports both sides trust.
        assert_eq!(side.paths_to(&ports, 0b11), vec![(0, 0)]);
        assert_eq!(side.paths_to(&ports, 0b10), vec![(0, 1)], "our fake0 to their only trusted port");
        assert_eq!(side.paths_to(&ports, 0), vec![], "they trust none");
        // Sections of releases before the self-tests say nothing: every port counts as trusted.
        assert_eq!(wire::decode_trusted(&wire::encode_ports(&ports)), u32::MAX);
        side.close();
        // Forced (GIXL_TRANSPORT=rdma): every port, whatever the tests said.
        let forced = RdmaSide::start_on(Arc::new(FakeFabric::new(2, dir.clone(), false).without_rma(vec![1])), true);
        let forced = forced.unwrap();
        assert_eq!(forced.paths_to(&ports, 0b01).len(), 2);
        forced.close();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
