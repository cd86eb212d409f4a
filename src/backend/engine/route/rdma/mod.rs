//! The RDMA route: peers whose connection info advertises a port on a fabric this engine's port reaches
//! (`wire::Port::reaches`), on another host, or on this one with `GIXL_TRANSPORT=rdma`. Over the verbs layer
//! (`crate::verbs`: rdma-core, or the fake fabric in tests):
//! - `target`: this engine's port and protection domain, its registrations' memory regions (key values never handed out
//!   twice), its connection-info section, and the target's half of the queue-pair exchange;
//! - here, the initiator: paths (one of our ports paired with one of the peer's on a common fabric), a request's pieces
//!   spread over the live ones nearest its memory, each piece as chains of RDMA READ/WRITE work requests on a lane of
//!   its path (one RC queue pair, its completion queue and its exchange connection), only the last of a chain
//!   signalled; the copying thread sleeps on the queue's event descriptor, no polling; a path whose port fails is
//!   dropped and the piece goes again over another, and a port the NIC says went down (an async event, see
//!   `target::watch`) is not taken;
//! - `wire`: the section and the exchange as pure functions.
//!
//! The peer's TCP link carries what is not data: the authenticated exchange that connects the pairs (a `wire::KIND`
//! connection on the TCP listener, kept open while they live), heartbeats while requests are in flight, and
//! notifications, which leave after the request's last completion, so after its data (a WRITE's last chain on each pair
//! ends with a 1-byte READ, a flush, so the data is in the target's memory by then, see `run`).
//!
//! GPU memory goes as host memory does where both sides' NICs reach the regions (registered through a dma-buf of the
//! range, else as peer memory; chosen per region at registration, see `target::RdmaSide::register_device`); a request
//! touching a region that neither reaches is staged over the TCP link (`router::vram_way`). A piece goes over a path
//! from a port nearest its local regions' memory (their NUMA node, or their GPU's PCI place: `target::RdmaSide::near`,
//! carried in region tickets for the peer's side too), then to a port nearest the remote regions; others only when
//! those fail. Not yet: notifications as SEND. Over rdma-core (`verbs::sys`) this has never run on a NIC: a real fabric
//! is taken only with `GIXL_TRANSPORT=rdma` (see `target::RdmaSide::start`); the tests run it over the fake fabric.

pub(crate) mod target;
pub(crate) mod wire;

use std::any::Any;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::{Job, Net, Prepared, Reach, Regions, Route, Setting, Side, TcpLink, TcpShared, Transport, VramWay};
use crate::backend::engine::near;
use crate::backend::{Seg, XferOp, XferPlan};
use crate::status::{Error, Result, Status};
use crate::verbs::{Completion, Cq, Op, Qp, QpCaps, Sge, WcStatus, Wr};
use target::{RdmaExport, RdmaSide};
use wire::RdmaKeys;

/// A local region's memory regions as a request uses them (found once per request, `Route::prepare`): its key on
/// each port (by port index), the ports nearest its memory (a mask by port index), and where each of its memory
/// regions starts, for a region registered as several (`RdmaKeys::bounds`).
pub(crate) struct LocalMrs {
    keys: Box<[u32]>,
    near: u32,
    bounds: Box<[u64]>,
}

/// A request's regions as `prepare` found them: each local one's memory regions (by `Seg::lreg`), and each remote
/// one's RDMA keys (by `Seg::rreg`; one per port of the peer, none where the peer's NIC cannot reach it directly)
/// and the peer's ports nearest it.
struct Keys {
    local: Vec<Option<LocalMrs>>,
    remote: Vec<Option<RdmaKeys>>,
}

impl Keys {
    fn of(prepared: Option<&(dyn Any + Send + Sync)>) -> &Keys {
        static NONE: Keys = Keys { local: Vec::new(), remote: Vec::new() };
        prepared.and_then(|p| p.downcast_ref::<Keys>()).unwrap_or(&NONE)
    }
    fn local(&self, s: &Seg) -> Option<&LocalMrs> {
        self.local.get(s.lreg as usize)?.as_ref()
    }
    fn remote(&self, s: &Seg) -> Option<&RdmaKeys> {
        self.remote.get(s.rreg as usize)?.as_ref()
    }
}

/// Work requests per chain (one post, one signalled completion).
const CHAIN: usize = 256;
/// Bytes per work request.
const MAX_WR_BYTES: u64 = 1 << 30;
/// List entries per work request (local pieces of one remote range); every RDMA NIC takes this many.
const MAX_SGE: usize = 4;
const LANE_CAPS: QpCaps = QpCaps { send_wr: CHAIN as u32, recv_wr: 1, sge: MAX_SGE as u32 };

/// The work requests of one chain, as they are built (no NIC involved): a range that continues the last request's
/// remote range joins it, as a longer last list entry where the local side continues too, else as one more entry
/// (up to `MAX_SGE`), so adjacent KV blocks cost one work request, not one each.
#[derive(Default)]
struct Chain {
    /// The requests' lists, back to back.
    sges: Vec<Sge>,
    wrs: Vec<Pending>,
}

/// The key on `port` of the memory region holding `addr` (of a region registered as one, or as several starting
/// at `bounds`, `ports` keys each), and where that memory region ends (`u64::MAX` for the last).
fn key_at(keys: &[u32], bounds: &[u64], ports: usize, addr: u64, port: usize) -> Option<(u32, u64)> {
    let i = bounds.partition_point(|&b| b <= addr).saturating_sub(1);
    let end = bounds.get(i + 1).copied().unwrap_or(u64::MAX);
    Some((*keys.get(i * ports + port)?, end))
}

/// The ports nearest the memory of every region of `segs`, here and at the peer (masks by port index; every port
/// where the regions say nothing or disagree).
fn nearest(job: &Job, segs: &[Seg]) -> (u32, u32) {
    let keys = Keys::of(job.prepared);
    let here = near::common(segs.iter().filter_map(|s| keys.local(s)).map(|l| l.near));
    let there = near::common(segs.iter().filter_map(|s| keys.remote(s)).map(|r| r.near));
    (here, there)
}

/// A work request of a chain: its list (`count` entries of `Chain::sges` from `first`) and its remote range;
/// `flush`: a READ whatever the request's op (see `Chain::flush`).
struct Pending {
    first: usize,
    count: usize,
    raddr: u64,
    rkey: u32,
    bytes: u64,
    flush: bool,
}

impl Chain {
    /// Add up to `len` bytes from `laddr` (local, under `lkey`) to or from `raddr` (remote, under `rkey`); how
    /// many it took: fewer than `len` only when the chain is full (post it, then push the rest).
    fn push(&mut self, laddr: u64, raddr: u64, len: u64, lkey: u32, rkey: u32) -> u64 {
        if let Some(w) =
            self.wrs.last_mut().filter(|w| !w.flush && w.rkey == rkey && w.raddr.checked_add(w.bytes) == Some(raddr))
        {
            let n = len.min(MAX_WR_BYTES - w.bytes);
            let tail = &mut self.sges[w.first + w.count - 1];
            if n > 0 && tail.lkey == lkey && tail.addr.checked_add(u64::from(tail.len)) == Some(laddr) {
                tail.len += n as u32;
                w.bytes += n;
                return n + self.push(laddr + n, raddr + n, len - n, lkey, rkey);
            }
            if n > 0 && w.count < MAX_SGE {
                self.sges.push(Sge { addr: laddr, len: n as u32, lkey });
                w.count += 1;
                w.bytes += n;
                return n + self.push(laddr + n, raddr + n, len - n, lkey, rkey);
            }
        }
        if len == 0 || self.wrs.len() == CHAIN {
            return 0;
        }
        let n = len.min(MAX_WR_BYTES);
        self.wrs.push(Pending { first: self.sges.len(), count: 1, raddr, rkey, bytes: n, flush: false });
        self.sges.push(Sge { addr: laddr, len: n as u32, lkey });
        n + self.push(laddr + n, raddr + n, len - n, lkey, rkey)
    }

    /// Append a READ of the byte at `raddr` (under `rkey`) into local `scratch` (under `lkey`): on one queue pair
    /// its answer comes after the WRITEs before it are placed. False when the chain is full (post it first).
    fn flush(&mut self, scratch: u64, lkey: u32, raddr: u64, rkey: u32) -> bool {
        if self.wrs.len() == CHAIN {
            return false;
        }
        self.wrs.push(Pending { first: self.sges.len(), count: 1, raddr, rkey, bytes: 1, flush: true });
        self.sges.push(Sge { addr: scratch, len: 1, lkey });
        true
    }

    /// Its work requests for `op`, all with `id`, only the last signalled.
    fn wrs(&self, op: XferOp, id: u64) -> Vec<Wr<'_>> {
        let n = self.wrs.len();
        self.wrs
            .iter()
            .enumerate()
            .map(|(i, w)| Wr {
                id,
                op: match (op, w.flush) {
                    (XferOp::Read, _) | (_, true) => Op::Read { raddr: w.raddr, rkey: w.rkey },
                    (XferOp::Write, false) => Op::Write { raddr: w.raddr, rkey: w.rkey },
                },
                sges: &self.sges[w.first..w.first + w.count],
                signaled: i + 1 == n,
            })
            .collect()
    }
}
/// How often a thread waiting for a completion looks at the peer's health and the request's abort flag.
const WAKE: Duration = Duration::from_millis(100);

/// What this process's RDMA routes posted: work requests, chains (one post and one signalled completion each),
/// and the CPU time of the threads that built, posted and completed them (their own, not the NIC's).
static POSTED_WRS: AtomicU64 = AtomicU64::new(0);
static POSTED_CHAINS: AtomicU64 = AtomicU64::new(0);
static POSTING_CPU_NS: AtomicU64 = AtomicU64::new(0);

/// `(work requests, chains, CPU ns)` posted by this process's RDMA routes so far, for benchmarks.
#[doc(hidden)]
pub fn posting_stats() -> (u64, u64, u64) {
    (POSTED_WRS.load(Ordering::Relaxed), POSTED_CHAINS.load(Ordering::Relaxed), POSTING_CPU_NS.load(Ordering::Relaxed))
}

fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The RDMA route as the engine lists it (`sides::NET`).
pub(crate) struct RdmaNet;
pub(crate) const RDMA: RdmaNet = RdmaNet;

impl Net for RdmaNet {
    fn name(&self) -> &'static str {
        "rdma"
    }
    fn section(&self) -> u64 {
        wire::SECTION
    }
    fn start(
        &self,
        transport: Transport,
        agent: &str,
        tcp: &TcpShared,
        patience: Duration,
        _setting: Setting,
    ) -> Option<Arc<dyn Side>> {
        let side = RdmaSide::start_for(transport, agent)?;
        let s = side.clone();
        tcp.set_side(wire::KIND, Box::new(move |c| s.serve(c, patience)));
        Some(side)
    }
    fn read_ticket(&self, sections: &[(u64, &[u8])]) -> Result<Option<Box<dyn Any + Send + Sync>>> {
        let keys = wire::read_ticket(sections)?;
        Ok((keys != RdmaKeys::default()).then(|| Box::new(keys) as _))
    }
    /// Where both sides have a port on one fabric: across hosts, or on this one when asked for.
    fn open(
        &self,
        side: &Arc<dyn Side>,
        to: &Reach<'_>,
    ) -> std::result::Result<(Box<dyn Route>, String), &'static str> {
        let side = (side.clone() as Arc<dyn Any + Send + Sync>).downcast::<RdmaSide>().map_err(|_| "not its side")?;
        let section = to.section.ok_or("it advertises no RDMA port")?;
        let ports = wire::decode_ports(section).ok_or("its RDMA section is malformed")?;
        if to.same_host && to.transport != Transport::Rdma {
            return Err("same host");
        }
        let paths = side.paths_to(&ports, wire::decode_trusted(section));
        if paths.is_empty() {
            // With no self-test in the way, would there be one? Then say which side's test stopped it.
            return Err(match (side.trusted(), wire::decode_trusted(section)) {
                (0, _) => "our RDMA ports failed their self-tests (see the warning)",
                (_, 0) => "its RDMA ports failed their self-tests",
                _ => "no port of the peer on our fabric",
            });
        }
        let said = format!("{} path(s) from {}", paths.len(), side.label());
        Ok((Box::new(Rdma::new((to.link)(), side, to.agent, &paths)), said))
    }
    fn fuzz(&self, b: &[u8]) {
        wire::fuzz(b);
    }
}

pub(crate) struct Rdma {
    pub(crate) link: Arc<TcpLink>,
    pub(crate) side: Arc<RdmaSide>,
    pub(crate) name: String,
    /// One per pair of ports (ours, the peer's) on a common fabric; pieces are spread over the live ones.
    paths: Vec<Path>,
    /// The next path a piece takes (round robin).
    turn: AtomicUsize,
    next: AtomicU64,
}

/// Our port `local` to the peer's port `remote` (indices in the two sections).
struct Path {
    local: usize,
    remote: usize,
    /// Lanes not in use.
    lanes: Mutex<Vec<Lane>>,
    /// The path failed (a port or its link): pieces go over the others.
    dead: AtomicBool,
}

/// One queue pair to the peer, its completion queue, and the exchange connection that keeps the peer's pair.
struct Lane {
    qp: Arc<dyn Qp>,
    cq: Arc<dyn Cq>,
    conn: TcpStream,
}

impl Drop for Lane {
    fn drop(&mut self) {
        self.qp.set_error();
        let _ = self.conn.shutdown(Shutdown::Both);
    }
}

impl Rdma {
    /// `paths`: (our port, the peer's port) pairs, from `RdmaSide::paths_to` (not empty).
    pub(crate) fn new(link: Arc<TcpLink>, side: Arc<RdmaSide>, name: &str, paths: &[(usize, usize)]) -> Rdma {
        let paths = paths
            .iter()
            .map(|&(local, remote)| Path { local, remote, lanes: Mutex::default(), dead: AtomicBool::new(false) })
            .collect();
        Rdma { link, side, name: name.to_owned(), paths, turn: AtomicUsize::new(0), next: AtomicU64::new(1) }
    }

    fn gone(&self, why: &str) -> Error {
        Error::disconnected(format!("agent '{}' is unreachable over RDMA: {why}", self.name))
    }

    /// The error for a peer whose link (heartbeats, the pair exchange) is down.
    fn link_down(&self) -> Error {
        self.gone(&self.link.why().unwrap_or_else(|| "down".into()))
    }

    /// An idle lane, else a new one: a pair made here, offered over a new exchange connection, and connected
    /// to the pair the peer answers with.
    fn lane(&self, path: &Path) -> Result<Lane> {
        if let Some(l) = path.lanes.lock().pop() {
            return Ok(l);
        }
        let nic = &self.side.ports[path.local].nic;
        let mut conn = self.link.dial_proven(wire::KIND)?;
        let cq = nic.create_cq(2 * CHAIN as u32)?;
        let qp = nic.create_qp(&cq, &cq, LANE_CAPS)?;
        let io = |e: std::io::Error| self.gone(&format!("queue-pair exchange: {e}"));
        conn.write_all(&wire::encode_offer(path.remote as u8, &[qp.addr()])).map_err(io)?;
        let mut answer = [0u8; 1 + wire::QPADDR_BYTES];
        conn.read_exact(&mut answer[..1]).map_err(io)?;
        if answer[0] != wire::ANSWER_OK {
            // Its port could not make or connect a pair: that path is unusable.
            return Err(self.gone("it refused a queue pair on that port"));
        }
        conn.read_exact(&mut answer[1..]).map_err(io)?;
        let Some(Ok(a)) = wire::decode_answer(&answer, 1) else {
            return Err(self.gone("malformed queue-pair answer"));
        };
        let theirs = a[0];
        qp.connect(&theirs)?;
        Ok(Lane { qp, cq, conn })
    }

    /// Post `segs` on `lane` (of `path`) in chains (see `Chain`) and wait for each chain's completion. WRITEs end
    /// with a 1-byte READ of the last byte written on the same queue pair (a flush): its answer leaves the target
    /// after the writes before it are placed in its memory, so the request completes, and its notification
    /// leaves, only once the target's memory holds the data, whatever the PCIe ordering on the target.
    fn run(&self, path: &Path, lane: &Lane, job: &Job, segs: &[Seg]) -> Result<()> {
        let mut chain = Chain::default();
        let mut last = None;
        let here_ports = self.side.ports.len();
        let keys = Keys::of(job.prepared);
        for s in segs {
            let local = keys.local(s).ok_or_else(|| {
                Error::invalid_param("a local region of this request is not registered with the RDMA NIC")
            })?;
            let no_rkey = || {
                Error::not_supported(format!(
                    "agent '{}' registered a region of this request without an RDMA key",
                    self.name
                ))
            };
            let remote = keys.remote(s).filter(|r| !r.rkeys.is_empty()).ok_or_else(no_rkey)?;
            let there_ports = remote.rkeys.len() / remote.bounds.len().max(1);
            let mut off = 0;
            while off < s.len {
                let (laddr, raddr) = (s.local + off, s.remote + off);
                // The memory region of each side holding this byte, and where it ends.
                let (lkey, lend) = key_at(&local.keys, &local.bounds, here_ports, laddr, path.local)
                    .ok_or_else(|| Error::invalid_param("a local region of this request has no key on this port"))?;
                let (rkey, rend) =
                    key_at(&remote.rkeys, &remote.bounds, there_ports, raddr, path.remote).ok_or_else(no_rkey)?;
                let n = (s.len - off).min(lend - laddr).min(rend - raddr);
                let took = chain.push(laddr, raddr, n, lkey, rkey);
                off += took;
                if took > 0 {
                    last = Some((raddr + took - 1, rkey));
                }
                if took < n {
                    self.post(path, lane, job, &mut chain)?;
                }
            }
        }
        if let (XferOp::Write, Some((raddr, rkey))) = (job.op, last) {
            let (mr, buf) = &self.side.ports[path.local].scratch;
            if !chain.flush(buf.as_ptr() as u64, mr.lkey, raddr, rkey) {
                self.post(path, lane, job, &mut chain)?;
                chain.flush(buf.as_ptr() as u64, mr.lkey, raddr, rkey);
            }
        }
        self.post(path, lane, job, &mut chain)
    }

    /// Post `chain` (only its last work request signalled), wait for it, and empty it.
    fn post(&self, path: &Path, lane: &Lane, job: &Job, chain: &mut Chain) -> Result<()> {
        if chain.wrs.is_empty() {
            return Ok(());
        }
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        lane.qp.post_send(&chain.wrs(job.op, id))?;
        POSTED_WRS.fetch_add(chain.wrs.len() as u64, Ordering::Relaxed);
        POSTED_CHAINS.fetch_add(1, Ordering::Relaxed);
        chain.sges.clear();
        chain.wrs.clear();
        self.wait(path, lane, job, id)
    }

    /// Wait on the lane's completion queue for the signalled request `id`, sleeping on its event descriptor.
    fn wait(&self, path: &Path, lane: &Lane, job: &Job, id: u64) -> Result<()> {
        let mut got: Vec<Completion> = Vec::with_capacity(4);
        loop {
            lane.cq.arm()?;
            got.clear();
            lane.cq.poll(&mut got, 16)?;
            for c in &got {
                if c.status != WcStatus::Success {
                    return Err(self.failed(c));
                }
                if c.id == id {
                    return Ok(());
                }
            }
            if let Some(e) = job.stopped() {
                return Err(e);
            }
            if self.link.down() {
                return Err(self.link_down());
            }
            if self.side.ports[path.local].down.load(Ordering::Acquire) {
                return Err(self.gone("our port went down"));
            }
            let mut p = libc::pollfd { fd: lane.cq.event_fd(), events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd for the duration of the call.
            unsafe { libc::poll(&mut p, 1, WAKE.as_millis() as i32) };
            lane.cq.take_event()?;
        }
    }

    /// The error a failed completion means for the request (and, for a peer that stopped answering, for the
    /// peer: its link goes down).
    fn failed(&self, c: &Completion) -> Error {
        match c.status {
            WcStatus::RemoteAccess => Error::not_found(format!(
                "agent '{}' refused the RDMA access: the remote region is no longer registered",
                self.name
            )),
            WcStatus::RetryExceeded => self.gone("it stopped answering (retry exceeded)"),
            // First of all: the pair was already in the error state (its peer pair went away while idle).
            WcStatus::Flushed => self.gone("the queue pair had failed"),
            WcStatus::LocalProtection => {
                Error::invalid_param("a local region of this request was deregistered while it ran")
            }
            s => Error::backend(format!("RDMA request to agent '{}' failed: {s:?}", self.name)),
        }
    }
}

impl Route for Rdma {
    fn label(&self) -> &'static str {
        "rdma"
    }
    fn pid(&self) -> Option<i32> {
        None
    }
    fn cpu_copies(&self) -> bool {
        false
    }
    fn closed(&self) -> bool {
        self.link.closed()
    }
    fn why_down(&self) -> String {
        self.link.why().map(|w| format!(" ({w})")).unwrap_or_default()
    }
    fn connect(&self, _from: &str) -> Result<()> {
        self.link.connect().map(|_| ())
    }
    fn close(&self) {
        self.paths.iter().for_each(|p| p.lanes.lock().clear());
        self.link.close()
    }
    fn notify(&self, _from: &str, msg: &[u8]) -> Result<()> {
        self.link.notif(msg)
    }
    fn link(&self) -> Option<&Arc<TcpLink>> {
        Some(&self.link)
    }
    /// As DRAM goes (GPU-direct) where every region of it, here (as `prepared` found them) and there, has its
    /// memory regions; a region the NIC cannot reach directly (no dma-buf, no peer memory) stages the whole
    /// request over the TCP link.
    fn vram(&self, plan: &XferPlan, prepared: Option<&(dyn Any + Send + Sync)>) -> Result<VramWay> {
        let keys = Keys::of(prepared);
        let here = keys.local.len() == plan.local_keys.len() && keys.local.iter().all(Option::is_some);
        let there = keys.remote.len() == plan.remote_keys.len()
            && keys.remote.iter().all(|r| r.as_ref().is_some_and(|r| !r.rkeys.is_empty()));
        Ok(if here && there { VramWay::Direct } else { VramWay::Staged(self.link.clone()) })
    }
    /// Each local region's memory regions and each remote one's keys, found once for the request.
    fn prepare(&self, regions: &Regions<'_>) -> Option<Prepared> {
        let local = regions.local_exports::<RdmaExport>().map(|e| {
            let e = e?;
            Some(LocalMrs {
                keys: e.mrs.iter().map(|m| m.lkey).collect(),
                near: e.near,
                bounds: e.bounds.clone().into(),
            })
        });
        let remote = regions.remote_tickets::<RdmaKeys>().map(|k| k.cloned());
        Some(Box::new(Keys { local: local.collect(), remote: remote.collect() }))
    }
    /// Over the next live path; where the path fails (its pair set up or answered by nobody: a port or its
    /// cable), it is marked dead, said in the log, and the piece goes again over another (READ and WRITE
    /// land the same bytes in the same place twice); with none left, the peer is down.
    fn copy(&self, job: &Job, segs: &[Seg]) -> Result<()> {
        let nearest = nearest(job, segs);
        loop {
            if self.link.down() {
                return Err(self.link_down());
            }
            let alive =
                |p: &Path| !p.dead.load(Ordering::Acquire) && !self.side.ports[p.local].down.load(Ordering::Acquire);
            let live = self.paths.iter().filter(|p| alive(p)).count();
            // Paths from a port near the local memory first, then those also to a port near the remote memory.
            let Some(path) = near::choose(&self.paths, |p| (p.local, p.remote), alive, nearest, &self.turn) else {
                let why = "every RDMA path to it failed";
                self.link.kill(why.into());
                return Err(self.gone(why));
            };
            let r = self.lane(path).and_then(|lane| {
                let cpu = thread_cpu_ns();
                let r = self.run(path, &lane, job, segs);
                POSTING_CPU_NS.fetch_add(thread_cpu_ns().saturating_sub(cpu), Ordering::Relaxed);
                // A lane whose request failed has its pair in the error state: it goes.
                if r.is_ok() {
                    path.lanes.lock().push(lane);
                }
                r
            });
            match r {
                Err(e) if e.status() == Status::RemoteDisconnect && !self.link.down() => {
                    if !path.dead.swap(true, Ordering::AcqRel) {
                        crate::telemetry::log::warn(&format!(
                            "agent '{}': peer '{}': RDMA path {} -> its port {} failed ({e}); {} left",
                            job.agent,
                            self.name,
                            self.side.ports[path.local].nic.port().device,
                            path.remote,
                            live - 1
                        ));
                    }
                    path.lanes.lock().clear();
                }
                r => return r,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Push `(local, remote, len)` ranges as `run` does (posting a full chain): the chains' work requests as
    /// (remote address, bytes, list entries).
    fn build(ranges: &[(u64, u64, u64)]) -> Vec<Vec<(u64, u64, usize)>> {
        let mut chain = Chain::default();
        let mut out = Vec::new();
        let mut take = |c: &mut Chain| {
            out.push(c.wrs.iter().map(|w| (w.raddr, w.bytes, w.count)).collect::<Vec<_>>());
            let posted = c.wrs(XferOp::Read, 1);
            assert!(
                posted.iter().take(posted.len() - 1).all(|w| !w.signaled) && posted.last().is_some_and(|w| w.signaled)
            );
            c.sges.clear();
            c.wrs.clear();
        };
        for &(l, r, len) in ranges {
            let mut off = 0;
            while off < len {
                off += chain.push(l + off, r + off, len - off, 7, 9);
                if off < len {
                    take(&mut chain);
                }
            }
        }
        if !chain.wrs.is_empty() {
            take(&mut chain);
        }
        out
    }

    const B: u64 = 16 << 10;

    #[test]
    fn adjacent_blocks_share_a_work_request_and_scattered_ones_do_not() {
        // 1024 blocks adjacent on both sides: one request, one list entry.
        let adjacent: Vec<_> = (0..1024).map(|i| (0x1000_0000 + i * B, 0x9000_0000 + i * B, B)).collect();
        assert_eq!(build(&adjacent), vec![vec![(0x9000_0000, 1024 * B, 1)]]);
        // Remote blocks reversed: one request each, in chains of CHAIN.
        let reversed: Vec<_> = (0..1024).map(|i| (0x1000_0000 + i * B, 0x9000_0000 + (1023 - i) * B, B)).collect();
        let chains = build(&reversed);
        assert_eq!(chains.iter().map(Vec::len).collect::<Vec<_>>(), vec![CHAIN; 4]);
        assert!(chains.iter().flatten().all(|&(_, bytes, n)| bytes == B && n == 1));
        // Remote adjacent, local scattered: MAX_SGE entries per request.
        let gathered: Vec<_> = (0..1024).map(|i| (0x1000_0000 + (1023 - i) * B, 0x9000_0000 + i * B, B)).collect();
        let chains = build(&gathered);
        assert_eq!(chains.len(), 1);
        assert_eq!(chains[0].len(), 1024 / MAX_SGE);
        assert!(chains[0].iter().all(|&(_, bytes, n)| bytes == MAX_SGE as u64 * B && n == MAX_SGE));
    }

    #[test]
    fn a_flush_is_a_one_byte_read_that_nothing_joins() {
        let mut c = Chain::default();
        assert_eq!(c.push(0x1000, 0x2000, 64, 1, 9), 64);
        assert!(c.flush(0x9000, 5, 0x203f, 9));
        // A range continuing the flushed byte starts a request of its own.
        assert_eq!(c.push(0x1040, 0x2040, 64, 1, 9), 64);
        let wrs = c.wrs(XferOp::Write, 3);
        assert_eq!(wrs.len(), 3);
        assert_eq!(wrs[0].op, Op::Write { raddr: 0x2000, rkey: 9 });
        assert_eq!(wrs[1].op, Op::Read { raddr: 0x203f, rkey: 9 });
        assert_eq!(wrs[1].sges, &[Sge { addr: 0x9000, len: 1, lkey: 5 }]);
        assert_eq!(wrs[2].op, Op::Write { raddr: 0x2040, rkey: 9 });
        // A full chain takes no flush.
        let mut full = Chain::default();
        for i in 0..CHAIN as u64 {
            full.push(0x1000 + i * 2, 0x10_0000 + i * 4, 1, 1, 9);
        }
        assert!(!full.flush(0x9000, 5, 0x10_0000, 9));
    }

    #[test]
    fn a_request_never_exceeds_its_byte_limit_and_the_chain_its_length() {
        // 3 GiB adjacent: three requests of MAX_WR_BYTES.
        let big = build(&[(0x1000, 0x10_0000_0000, 3 * MAX_WR_BYTES)]);
        assert_eq!(
            big,
            vec![vec![
                (0x10_0000_0000, MAX_WR_BYTES, 1),
                (0x10_4000_0000, MAX_WR_BYTES, 1),
                (0x10_8000_0000, MAX_WR_BYTES, 1)
            ]]
        );
        // A remote range that wraps around never joins (no overflow).
        assert_eq!(build(&[(0x1000, u64::MAX - 15, 16), (0x1010, 0, 16)]).concat().len(), 2);
        // Another key never joins.
        let mut c = Chain::default();
        assert_eq!(c.push(0x1000, 0x2000, 64, 1, 1), 64);
        assert_eq!(c.push(0x1040, 0x2040, 64, 1, 2), 64);
        assert_eq!(c.wrs.len(), 2);
    }
}
