//! The libfabric route: peers whose connection info advertises an endpoint of the provider this engine uses
//! (`side::FabricSide`), over one-sided `fi_read`/`fi_write` on RDM endpoints (`crate::fabric`, libfabric opened
//! at run time). Taken for providers that are not themselves sockets or shared memory (efa, verbs, psm…) for
//! peers on another host; with `GIXL_TRANSPORT=fabric` for every peer the provider reaches, even on this host
//! (how the tests run it over the tcp and shm providers):
//! - `side`: this engine's rails (every domain of the provider, each with its endpoint, opened on first need),
//!   its registrations' memory regions (one per rail, keys never handed out twice), its connection-info section,
//!   the target's half of the greeting, and each rail's progress while initiators are greeted on it;
//! - here, the initiator: paths (one of our rails whose self-test passed, paired with a rail of the peer's on
//!   the same fabric, spread over the peer's rails); a request's pieces, each over a live path from a rail
//!   nearest its local memory, then to one nearest the remote memory, in turn among the equally near
//!   (`near::choose`, the RDMA route's choice; with no NUMA or PCI to set rails apart, pieces spread over all of
//!   them), as READ/WRITE operations on that rail's endpoint to the peer's (its address inserted in the address
//!   vector), a few in flight, their completions waited for by sleeping on the queue's wait descriptor
//!   (`crate::fabric::wait`); a WRITE completes delivery-complete, so the data is at the target when the request
//!   completes and its notification leaves; a path whose rail fails while the peer lives is dropped and the
//!   piece goes again over another;
//! - `wire`: the section, the ticket and the greeting as pure functions.
//!
//! The peer's TCP link carries what is not data: the authenticated greetings (a `wire::KIND` connection on the
//! TCP listener per path, kept open while the route lives: the target drives that rail while it is, and its
//! closing says the peer is gone), heartbeats while requests are in flight, and notifications. GPU memory goes
//! as host memory does (one-sided operations on GPU memory registered with its interface, `FI_HMEM`) over paths
//! whose two rails carry every region of the request (`side`: rails whose device offers `FI_HMEM` and passed
//! its GPU-memory self-test); where no live path does, the request is staged over the TCP link (`vram`).

pub(crate) mod side;
pub(crate) mod wire;

use std::any::Any;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::{Job, Net, Prepared, Reach, Regions, Route, Setting, Side, TcpLink, TcpShared, Transport, VramWay};
use crate::backend::engine::near;
use crate::backend::{Seg, XferOp, XferPlan};
use crate::fabric::{Mr, RemoteKey};
use crate::os::sock as net;
use crate::status::{Error, Result, Status};
use side::{Busy, FabricExport, FabricSide, OpState, Rail, Rails, Slot};
use wire::FabricKeys;

/// Bytes per operation.
const MAX_OP_BYTES: u64 = 8 << 20;
/// Operations in flight per piece.
const MAX_IN_FLIGHT: usize = 64;
/// How often a waiting thread looks at the peer's health and the request's abort flag, at most (it sleeps
/// `fabric::SLICE` at a time).
const WAKE: Duration = Duration::from_millis(100);
/// A piece of at most this many bytes reads the queue again without sleeping, yielding the core between reads,
/// for up to `net::LOOK_NS` before it sleeps on the queue's descriptor: its completion is due within a round
/// trip, and a sleeping thread's wake-up costs most of one on a VM (as the TCP route's looks).
const LOOK_BYTES: u64 = 64 << 10;

/// The provider the engine is asked for: backend parameter `fabric_provider`, else `GIXL_FABRIC_PROVIDER` (its
/// full name, exactly: `tcp;ofi_rxm`, `shm`, `efa`, as `gixl doctor` lists them), else libfabric's own
/// `FI_PROVIDER` (as libfabric reads it: `tcp` names `tcp;ofi_rxm` too); and the domain: `fabric_domain` /
/// `GIXL_FABRIC_DOMAIN`.
fn asked(setting: Setting) -> (Option<(String, bool)>, Option<String>) {
    let trim = |v: String| v.trim().to_owned();
    let fi = || std::env::var("FI_PROVIDER").ok().filter(|v| !v.trim().is_empty()).map(|v| (trim(v), false));
    let p = setting("fabric_provider", "GIXL_FABRIC_PROVIDER").map(|v| (trim(v), true)).or_else(fi);
    (p, setting("fabric_domain", "GIXL_FABRIC_DOMAIN").map(trim))
}

/// `fabric_provider` started on a thread of its own, once per process; a caller that needs its answer sooner
/// waits for it (`OnceLock`), or, where the thread could not start, looks it up itself.
fn look_up_soon() {
    static STARTED: std::sync::Once = std::sync::Once::new();
    STARTED.call_once(|| {
        let _ = std::thread::Builder::new().name("gixl-fabric-lu".into()).spawn(|| {
            side::fabric_provider();
        });
    });
}

/// Whether this host has a device that a libfabric provider other than sockets and shared memory drives: an
/// RDMA device (`/sys/class/infiniband`: efa, verbs, usnic, and psm3 and ucx over them), an Omni-Path or
/// TrueScale adapter (`/dev/hfi1*`, `/dev/ipath*`: psm2, opx, psm), a Slingshot NIC (`/sys/class/cxi`) or a
/// Gemini/Aries one (`/dev/kgni*`). A few directory reads: where there is none, libfabric is not opened at all
/// for a provider that could only find nothing (a provider named, `GIXL_TRANSPORT=fabric` or `gixl doctor`
/// open it anyway).
pub(crate) fn fabric_hardware() -> bool {
    let any = |dir: &str, prefixes: &[&str]| {
        std::fs::read_dir(dir)
            .is_ok_and(|d| d.flatten().any(|e| prefixes.iter().any(|p| e.file_name().to_string_lossy().starts_with(p))))
    };
    any("/sys/class/infiniband", &[""]) || any("/sys/class/cxi", &[""]) || any("/dev", &["hfi1", "ipath", "kgni"])
}

/// What a `LIBFABRIC` backend says when created, once it is known (never silent, never on agent creation's
/// path): where this engine looks its provider up in the background, a thread says it when the lookup ends.
pub(crate) fn say(agent: &str, side: Option<&Arc<dyn Side>>) {
    let side = side.and_then(|s| (s.clone() as Arc<dyn Any + Send + Sync>).downcast::<FabricSide>().ok());
    let pending = side.as_ref().is_some_and(|s| !s.named());
    let tell = move |agent: &str, found: bool| {
        if found {
            crate::telemetry::log::info(&format!(
                "agent '{agent}': backend LIBFABRIC: its peers go over the libfabric route once this host's device \
                 passes its self-test (run in the background once the endpoint opens, waited for by a first peer \
                 that comes sooner), else over TCP with a WARN line"
            ));
        } else {
            // Never a silent fallback: whoever asked for a fabric is told that no libfabric route carries its data.
            crate::telemetry::log::warn(&format!(
                "agent '{agent}': backend LIBFABRIC has no libfabric provider to use here (none of efa, verbs, psm… \
                 was found; tcp and shm are used only with GIXL_TRANSPORT=fabric), so peers on other hosts go over \
                 TCP (RDMA where its port reaches them); `python -m gixl doctor` says what this host has \
                 (docs/libfabric.md)"
            ));
        }
    };
    let found = side.is_some();
    let Some(side) = side.filter(|_| pending) else {
        return tell(agent, found);
    };
    let agent2 = agent.to_owned();
    let spawned = std::thread::Builder::new()
        .name("gixl-fabric-say".into())
        .spawn(move || tell(&agent2, !side.provider().0.is_empty()));
    if spawned.is_err() {
        crate::telemetry::log::warn(&format!(
            "agent '{agent}': backend LIBFABRIC: whether this host has a libfabric provider is not known yet \
             (`python -m gixl doctor` says)"
        ));
    }
}

/// The libfabric route as the engine lists it (`sides::NET`).
pub(crate) struct FabricNet;
pub(crate) const FABRIC: FabricNet = FabricNet;

impl Net for FabricNet {
    fn name(&self) -> &'static str {
        "libfabric"
    }
    fn section(&self) -> u64 {
        wire::SECTION
    }
    /// With `GIXL_TRANSPORT=fabric`, the provider asked for (else the first that is not sockets, else
    /// `tcp;ofi_rxm`); otherwise only a provider that is not sockets or shared memory. Nothing is opened here
    /// (see `FabricSide::opened`).
    fn start(
        &self,
        transport: Transport,
        agent: &str,
        tcp: &TcpShared,
        patience: Duration,
        setting: Setting,
    ) -> Option<Arc<dyn Side>> {
        let (provider, domain) = asked(setting);
        let provider = match (transport, provider) {
            (Transport::Tcp | Transport::Rdma, _) => return None,
            (Transport::Fabric, Some(p)) => Some(p),
            // The first that is not sockets (looked up when the endpoint opens), else `tcp;ofi_rxm`.
            (Transport::Fabric, None) => {
                look_up_soon();
                None
            }
            // Sockets and shared memory only when forced: gixl's own routes are faster.
            (Transport::Auto, Some(p)) if side::is_sockets(&p.0) => return None,
            (Transport::Auto, Some(p)) => Some(p),
            // Looked up in the background where some device could have one (and where none turns out to be
            // there, the side advertises nothing and opens nothing).
            (Transport::Auto, None) if fabric_hardware() => {
                look_up_soon();
                None
            }
            (Transport::Auto, None) => return None,
        };
        let which = provider.as_ref().map_or("looked up in the background", |p| &p.0);
        crate::telemetry::log::info(&format!("agent '{agent}': libfabric provider {which} (opened on first use)"));
        let fallback = (transport == Transport::Fabric).then(|| "tcp;ofi_rxm".to_owned());
        let side = FabricSide::new(agent, provider, fallback, domain);
        let s = side.clone();
        tcp.set_side(wire::KIND, Box::new(move |c| s.serve(c, patience)));
        Some(side)
    }
    fn read_ticket(&self, sections: &[(u64, &[u8])]) -> Result<Option<Box<dyn Any + Send + Sync>>> {
        Ok(wire::read_ticket(sections)?.map(|k| Box::new(k) as _))
    }
    /// Where the peer advertises an endpoint of our provider and our device passed its self-test: across
    /// hosts, or on this one with `GIXL_TRANSPORT=fabric`.
    fn open(
        &self,
        side: &Arc<dyn Side>,
        to: &Reach<'_>,
    ) -> std::result::Result<(Box<dyn Route>, String), &'static str> {
        let side = (side.clone() as Arc<dyn Any + Send + Sync>).downcast::<FabricSide>().map_err(|_| "not its side")?;
        if to.same_host && to.transport != Transport::Fabric {
            return Err("same host");
        }
        // Our rails' self-tests (started when their endpoints opened) are waited for at the first peer that
        // advertises an endpoint at all (so a failure is said even where the peer's own device failed too).
        let section = to.section.ok_or("it advertises no libfabric endpoint")?;
        if side.provider().0.is_empty() {
            return Err("this host has no libfabric provider that is not sockets or shared memory");
        }
        let (rails, passed) = side.ready().map_err(|why| {
            if why.starts_with("self-test") {
                "our libfabric device failed its self-test (said above)"
            } else if why.starts_with("stalled") {
                "our libfabric rails stalled (said above)"
            } else {
                "our libfabric endpoint could not be opened (said above)"
            }
        })?;
        let advert = wire::decode_section(section).ok_or("it advertises no usable libfabric endpoint")?;
        if advert.provider != rails[0].dev.provider() {
            return Err("its libfabric provider is not ours");
        }
        // Each of our rails that passed, to a rail of the peer's on its fabric (one of the first release, which
        // names none: its one rail) with addresses of its format, spread over them.
        let paths: Vec<Path> = (rails.iter().zip(&passed))
            .filter(|(_, ms)| ms.is_some())
            .filter_map(|(r, _)| {
                let fabric = r.dev.fabric();
                let theirs = |j: &usize| {
                    let t = &advert.rails[*j];
                    (t.fabric.is_empty() || t.fabric == fabric) && r.takes(&t.addr)
                };
                let reach: Vec<usize> = (0..advert.rails.len()).filter(theirs).collect();
                let j = *reach.get(r.index % reach.len().max(1))?;
                Some(Path::new(r.index, j, advert.rails[j].addr.clone()))
            })
            .collect();
        if paths.is_empty() {
            return Err("no rail of the peer on a fabric of our rails that passed their self-tests");
        }
        let said = paths
            .iter()
            .map(|p| {
                let ms = passed[p.local].unwrap_or_default();
                format!("{} -> its rail {} (self-test passed in {ms:.1} ms)", rails[p.local].name(), p.remote)
            })
            .collect::<Vec<_>>()
            .join(", ");
        Ok((Box::new(Fabric::new((to.link)(), rails, to.agent, paths)), said))
    }
    fn fuzz(&self, b: &[u8]) {
        wire::fuzz(b);
    }
}

/// A request's regions as `prepare` found them: each local one's memory regions (by `Seg::lreg`) and each
/// remote one's keys (by `Seg::rreg`).
struct Keys {
    local: Vec<Option<Arc<Slot>>>,
    remote: Vec<Option<FabricKeys>>,
}

impl Keys {
    fn of(prepared: Option<&(dyn Any + Send + Sync)>) -> &Keys {
        static NONE: Keys = Keys { local: Vec::new(), remote: Vec::new() };
        prepared.and_then(|p| p.downcast_ref::<Keys>()).unwrap_or(&NONE)
    }

    /// The rails that carry every one of the local regions `lregs` here and of the remote regions `rregs` at the
    /// peer (masks by rail index: GPU memory only on those with `FI_HMEM` that passed its GPU-memory self-test;
    /// host memory on every one). Regions without libfabric keys are left out.
    fn carried(&self, lregs: impl Iterator<Item = usize>, rregs: impl Iterator<Item = usize>) -> (u32, u32) {
        let here = lregs.filter_map(|i| self.local.get(i)?.as_ref()).fold(u32::MAX, |m, l| m & l.keys.carried());
        let there = rregs.filter_map(|i| self.remote.get(i)?.as_ref()).fold(u32::MAX, |m, r| m & r.carried());
        (here, there)
    }
}

/// Whether rail `i` is in `mask`.
fn has(mask: u32, i: usize) -> bool {
    i < 32 && mask & (1 << i) != 0
}

/// The rails nearest the memory of every region of `segs`, here and at the peer (masks by rail index).
fn nearest(job: &Job, segs: &[Seg]) -> (u32, u32) {
    let keys = Keys::of(job.prepared);
    let here = near::common(segs.iter().filter_map(|s| keys.local.get(s.lreg as usize)?.as_ref()).map(|l| l.keys.near));
    let there = near::common(segs.iter().filter_map(|s| keys.remote.get(s.rreg as usize)?.as_ref()).map(|r| r.near));
    (here, there)
}

/// Our rail `local` to the peer's rail `remote` (indices in the two sections).
struct Path {
    local: usize,
    remote: usize,
    /// The peer's endpoint address on its rail.
    addr: Vec<u8>,
    /// Once greeted: its address-vector entry, the greeting connection (open while the route lives) and our
    /// rail's progress held on meanwhile.
    greeted: Mutex<Option<(u64, Arc<TcpStream>, Busy)>>,
    /// The path failed (its rail, or the peer's refused it) while the peer lives: pieces go over the others.
    dead: AtomicBool,
    /// The peer's keys on its rail that it said are closed (closed-key notices on the greeting connection).
    closed: Mutex<Closed>,
}

/// What the greeting connection said of closed keys: the notices' bytes not yet whole, and the keys.
#[derive(Default)]
struct Closed {
    partial: Vec<u8>,
    keys: std::collections::HashSet<u64>,
    /// The bytes were no notice: the rest of the stream is not read for them.
    garbled: bool,
}

impl Path {
    fn new(local: usize, remote: usize, addr: Vec<u8>) -> Path {
        Path { local, remote, addr, greeted: Mutex::default(), dead: AtomicBool::new(false), closed: Mutex::default() }
    }

    /// Takes in the closed-key notices the peer sent on `conn`, never waiting (the stream's end is left for
    /// `hung_up` to see).
    fn absorb(&self, conn: &TcpStream) {
        let mut c = self.closed.lock();
        let mut b = [0u8; 4096];
        loop {
            // SAFETY: a connected socket and a buffer valid for its length; MSG_DONTWAIT never blocks.
            let n = unsafe { libc::recv(conn.as_raw_fd(), b.as_mut_ptr().cast(), b.len(), libc::MSG_DONTWAIT) };
            if n <= 0 {
                break;
            }
            if c.garbled {
                continue;
            }
            c.partial.extend_from_slice(&b[..n as usize]);
            loop {
                match wire::decode_closed(&c.partial) {
                    Ok(Some((keys, len))) => {
                        c.keys.extend(keys);
                        c.partial.drain(..len);
                    }
                    Ok(None) => break,
                    Err(()) => {
                        c.garbled = true;
                        c.partial = Vec::new();
                        break;
                    }
                }
            }
        }
    }

    /// Whether the peer said `key` (of its rail) is closed.
    fn is_closed(&self, key: u64) -> bool {
        self.closed.lock().keys.contains(&key)
    }
}

pub(crate) struct Fabric {
    link: Arc<TcpLink>,
    rails: Rails,
    name: String,
    /// Pieces are spread over the live ones (see `near::choose`).
    paths: Vec<Path>,
    turn: AtomicUsize,
}

impl Fabric {
    fn new(link: Arc<TcpLink>, rails: Rails, name: &str, paths: Vec<Path>) -> Fabric {
        Fabric { link, rails, name: name.to_owned(), paths, turn: AtomicUsize::new(0) }
    }

    fn gone(&self, why: &str) -> Error {
        Error::disconnected(format!("agent '{}' is unreachable over libfabric: {why}", self.name))
    }

    /// A piece on a key the peer said is closed: refused here, nothing posted (or, with a provider that never
    /// answers such an operation, what was posted given up).
    fn closed(&self) -> Error {
        Error::not_found(format!(
            "agent '{}' deregistered the remote region of this request (it said its libfabric key is closed)",
            self.name
        ))
    }

    fn link_down(&self) -> Error {
        self.gone(&self.link.why().unwrap_or_else(|| "down".into()))
    }

    /// The path's address-vector entry and greeting connection: greeted now the first time (over a proven
    /// connection of the TCP link, so a restarted peer is refused there). Err: why, and whether the peer lives
    /// (it refused that rail: the path is unusable, not the peer).
    fn greet(&self, path: &Path) -> std::result::Result<(u64, Arc<TcpStream>), (Error, bool)> {
        let rail = &self.rails[path.local];
        let mut g = path.greeted.lock();
        if let Some((a, c, _)) = &*g {
            // The peer's health, and its closed-key notices taken in (each piece starts here).
            if up(path, c) {
                return Ok((*a, c.clone()));
            }
            let _ = c.shutdown(Shutdown::Both);
            *g = None;
            return Err((self.gone("its greeting connection closed"), false));
        }
        let mut conn = self.link.dial_proven(wire::KIND).map_err(|e| (e, false))?;
        let io = |e: std::io::Error| (self.gone(&format!("greeting: {e}")), false);
        conn.write_all(&wire::encode_greeting(path.remote as u8, &rail.addr)).map_err(io)?;
        let mut answer = [0u8; 1];
        conn.read_exact(&mut answer).map_err(io)?;
        if answer[0] != wire::ANSWER_OK {
            let why = format!("it refused our endpoint on its rail {} (its self-test failed there)", path.remote);
            return Err((self.gone(&why), true));
        }
        // Where the target READs a byte to fence a region it retires; our rail's progress held on meanwhile, so
        // that READ is answered while we are idle (a target of an older release discards it).
        let (mr, buf) = &rail.scratch;
        let scratch = mr.remote(buf.as_ptr()).ok_or_else(|| (Error::backend("libfabric scratch's key"), false))?;
        let mut said = wire::encode_scratch(scratch).to_vec();
        // And that we read closed-key notices (an older target reads and drops that byte).
        said.push(wire::READS_CLOSED);
        conn.write_all(&said).map_err(io)?;
        let a = rail.peer(&path.addr).map_err(|e| (e, true))?;
        let conn = Arc::new(conn);
        *g = Some((a, conn.clone(), rail.hold()));
        Ok((a, conn))
    }

    /// The piece over `path`, greeted first; again (up to three times) where the provider dropped its
    /// connection while the peer lives: tcp through ofi_rxm does so after a refused key, and makes a new one for
    /// the next operation (READ and WRITE land the same bytes in the same place twice). Also whether the peer
    /// lives (its link up, its greeting connection open).
    fn on(&self, path: &Path, job: &Job, segs: &[Seg]) -> (Result<()>, bool) {
        let (peer, conn) = match self.greet(path) {
            Ok(g) => g,
            Err((e, lives)) => return (Err(e), lives),
        };
        let rail = &self.rails[path.local];
        let mut r = self.run(rail, path, peer, &conn, job, segs);
        for _ in 0..3 {
            match &r {
                Err(e) if e.status() == Status::RemoteDisconnect && !self.link.down() && up(path, &conn) => {
                    crate::telemetry::log::info(&format!(
                        "agent '{}': peer '{}': libfabric piece again on {} ({e})",
                        job.agent,
                        self.name,
                        rail.name()
                    ));
                    std::thread::sleep(Duration::from_millis(10));
                    r = self.run(rail, path, peer, &conn, job, segs);
                }
                _ => break,
            }
        }
        (r, !self.link.down() && up(path, &conn))
    }

    /// Post `segs` as operations on `rail` (the path's) to the peer's endpoint `peer`, up to `MAX_IN_FLIGHT`
    /// at a time, and wait for them all.
    fn run(&self, rail: &Rail, path: &Path, peer: u64, conn: &TcpStream, job: &Job, segs: &[Seg]) -> Result<()> {
        let _waiting = rail.waiting();
        let look = segs.iter().map(|s| s.len).sum::<u64>() <= LOOK_BYTES;
        let keys = Keys::of(job.prepared);
        // The local regions' memory regions (one per rail), held while the piece runs (deregistration waits for
        // them).
        let mut held: Vec<(u32, Arc<Vec<Option<Mr>>>)> = Vec::new();
        // Each operation in flight: its number, its state and the peer's key it names.
        let mut flight: Vec<(u64, Arc<OpState>, u64)> = Vec::with_capacity(MAX_IN_FLIGHT);
        // The last remote byte written (its address as the provider names it, and its key).
        let mut last = None;
        let r = (|| {
            for s in segs {
                let mrs = match held.iter().find(|(r, _)| *r == s.lreg) {
                    Some((_, m)) => m.clone(),
                    None => {
                        let slot = keys.local.get(s.lreg as usize).and_then(Option::as_ref).ok_or_else(|| {
                            Error::invalid_param("a local region of this request is not registered with libfabric")
                        })?;
                        let m = slot.mrs.lock().clone().ok_or_else(|| {
                            Error::invalid_param("a local region of this request was deregistered while it ran")
                        })?;
                        held.push((s.lreg, m.clone()));
                        m
                    }
                };
                let mr = mrs
                    .get(rail.index)
                    .and_then(Option::as_ref)
                    .ok_or_else(|| Error::backend("a local region without its rail's key"))?;
                let remote = keys
                    .remote
                    .get(s.rreg as usize)
                    .and_then(Option::as_ref)
                    .filter(|k| k.on(path.remote))
                    .and_then(|k| k.keys.get(path.remote).copied())
                    .ok_or_else(|| {
                        Error::not_supported(format!(
                            "agent '{}' registered a region of this request without a libfabric key on its rail {}",
                            self.name, path.remote
                        ))
                    })?;
                if path.is_closed(remote.key) {
                    return Err(self.closed());
                }
                let mut off = 0;
                while off < s.len {
                    let n = (s.len - off).min(MAX_OP_BYTES);
                    let rk = RemoteKey { addr: (s.remote + off).wrapping_sub(remote.base), key: remote.key };
                    let (id, st) = rail.ops.start();
                    loop {
                        // SAFETY: the local range lies in `mr`'s region (the engine checked the request against
                        // its registrations) and `mr` is held until the operation completes or the piece fails;
                        // the remote range is the peer's registered region (its provider checks the key).
                        let posted = unsafe {
                            rail.ep.post(
                                job.op == XferOp::Write,
                                mr,
                                ((s.local + off) as *mut u8, n as usize),
                                peer,
                                rk,
                                id as *mut std::ffi::c_void,
                            )
                        };
                        match posted {
                            Ok(true) => break,
                            // The provider's queue is full (or its connection still being made): read the
                            // queue, sleeping where nothing of ours is in flight to wake us.
                            Ok(false) if flight.is_empty() => {
                                rail.pump()?;
                                self.check(path, conn, job)?;
                                if path.is_closed(rk.key) {
                                    return Err(self.closed());
                                }
                                rail.sleep()?;
                            }
                            Ok(false) => {
                                let fewer = flight.len() - 1;
                                self.wait(rail, (path, conn), job, &mut flight, fewer, look)?
                            }
                            Err(e) => {
                                rail.ops.forget(id);
                                return Err(e);
                            }
                        }
                    }
                    flight.push((id, st, rk.key));
                    last = Some(RemoteKey { addr: rk.addr + n - 1, key: rk.key });
                    off += n;
                    if flight.len() >= MAX_IN_FLIGHT {
                        self.wait(rail, (path, conn), job, &mut flight, MAX_IN_FLIGHT / 2, look)?;
                    }
                }
            }
            // WRITEs end with a 1-byte READ of the last byte written (a flush): the provider's completion of a
            // WRITE may come once the data left (tcp through ofi_rxm did so here, though delivery-complete was
            // asked for), but the target answers the READ only after it has placed the WRITEs before it on the
            // same connection; so the request completes, and its notification leaves, once the data is there.
            if let (XferOp::Write, Some(rk)) = (job.op, last) {
                self.wait(rail, (path, conn), job, &mut flight, 0, look)?;
                let (mr, buf) = &rail.scratch;
                let (id, st) = rail.ops.start();
                loop {
                    // SAFETY: one byte of the scratch buffer, registered as `mr`, kept for the engine's life.
                    match unsafe { rail.ep.post(false, mr, (buf.as_ptr() as *mut u8, 1), peer, rk, id as _) } {
                        Ok(true) => break,
                        Ok(false) => {
                            rail.pump()?;
                            self.check(path, conn, job)?;
                            rail.sleep()?;
                        }
                        Err(e) => {
                            rail.ops.forget(id);
                            return Err(e);
                        }
                    }
                }
                flight.push((id, st, rk.key));
            }
            self.wait(rail, (path, conn), job, &mut flight, 0, look)
        })();
        if r.is_err() {
            flight.iter().for_each(|(id, _, _)| rail.ops.forget(*id));
        }
        drop(held);
        r
    }

    /// Read the queue until at most `left` operations of `flight` are pending, sleeping on its wait descriptor
    /// between reads (after `LOOK_BYTES`' look where `look`); an operation that failed fails the piece.
    fn wait(
        &self,
        rail: &Rail,
        (path, conn): (&Path, &TcpStream),
        job: &Job,
        flight: &mut Vec<(u64, Arc<OpState>, u64)>,
        left: usize,
        look: bool,
    ) -> Result<()> {
        let mut since = std::time::Instant::now();
        let looked = since;
        // An operation canceled because the provider dropped its connection: the others in flight end too, and
        // the one whose refusal made the provider drop it (a closed key: NOT_FOUND) says what happened.
        let canceled = |errno: i32, prov: i32| {
            errno == libc::ECANCELED && matches!(prov, libc::ENOTCONN | libc::ECONNRESET | libc::EPIPE)
        };
        let mut failed: Option<(Error, i32, i32)> = None;
        let mut until = None;
        loop {
            rail.pump()?;
            flight.retain(|(_, st, _)| {
                if !st.done.load(std::sync::atomic::Ordering::Acquire) {
                    return true;
                }
                if let Some(e) = st.err.lock().take() {
                    if failed.as_ref().is_none_or(|f| canceled(f.1, f.2) && !canceled(e.1, e.2)) {
                        failed = Some(e);
                    }
                }
                false
            });
            if let Some((e, errno, prov)) = failed.take() {
                // Bounded: the rest end at once once the connection is gone.
                let until = *until.get_or_insert_with(|| std::time::Instant::now() + Duration::from_secs(1));
                if !canceled(errno, prov) || flight.is_empty() || std::time::Instant::now() >= until {
                    return Err(self.failed(path, conn, e, errno, prov));
                }
                failed = Some((e, errno, prov));
                rail.sleep()?;
                continue;
            }
            if flight.len() <= left {
                return Ok(());
            }
            if since.elapsed() >= WAKE {
                since = std::time::Instant::now();
                self.check(path, conn, job)?;
                // A provider that never answers an operation on a closed key: given up once the peer said so. shm
                // answers in order, so the one it dropped holds back every later answer on the rail's endpoint:
                // the rail is given up too (its paths dropped; new routes and greetings take the others, else TCP).
                if rail.drops_closed && flight.iter().any(|f| path.is_closed(f.2)) {
                    let why = "the provider dropped an operation on a key the peer had closed, and answers none \
                               after it";
                    if rail.stall(why) {
                        crate::telemetry::log::warn(&format!(
                            "agent '{}': libfabric rail {}: {why}: its paths are dropped, new peers go over the other \
                             rails, else TCP",
                            job.agent,
                            rail.name()
                        ));
                    }
                    path.dead.store(true, Ordering::Release);
                    return Err(self.closed());
                }
            }
            if look && (looked.elapsed().as_nanos() as u64) < net::LOOK_NS {
                std::thread::yield_now();
            } else {
                rail.sleep()?;
            }
        }
    }

    /// The request was aborted, or the peer is gone (its link down, its greeting connection closed); the
    /// peer's closed-key notices taken in on the way.
    fn check(&self, path: &Path, conn: &TcpStream, job: &Job) -> Result<()> {
        if let Some(e) = job.stopped() {
            return Err(e);
        }
        if self.link.down() {
            return Err(self.link_down());
        }
        if !up(path, conn) {
            return Err(self.gone("its greeting connection closed"));
        }
        Ok(())
    }

    /// The error a failed operation means: the peer went away (its greeting connection closed, or its link is
    /// down), or, with the peer alive, its provider refused the key (the region is no longer registered: tcp
    /// here answers `FI_ECANCELED` with the provider's `ENOENT`, the key not found).
    fn failed(&self, path: &Path, conn: &TcpStream, e: Error, errno: i32, prov: i32) -> Error {
        if self.link.down() {
            return self.link_down();
        }
        // A peer that died closes the greeting connection; give the kernel a moment to say so.
        std::thread::sleep(Duration::from_millis(20));
        if !up(path, conn) {
            return self.gone(&format!("its greeting connection closed ({})", e.message()));
        }
        match errno {
            libc::ECANCELED if prov == libc::ENOENT => Error::not_found(format!(
                "agent '{}' refused the libfabric access: the remote region is no longer registered ({})",
                self.name,
                e.message()
            )),
            libc::EACCES | libc::EINVAL | libc::ENOKEY | libc::EKEYREJECTED | libc::EPERM | libc::EFAULT => {
                Error::not_found(format!(
                    "agent '{}' refused the libfabric access: the remote region is no longer registered ({})",
                    self.name,
                    e.message()
                ))
            }
            libc::ECONNRESET
            | libc::ECONNREFUSED
            | libc::ECONNABORTED
            | libc::EPIPE
            | libc::ENOTCONN
            | libc::EHOSTUNREACH
            | libc::ETIMEDOUT
            | libc::EIO => self.gone(e.message()),
            _ => Error::backend(format!("libfabric request to agent '{}' failed: {}", self.name, e.message())),
        }
    }
}

/// Whether the path's greeting connection is still open, its closed-key notices taken in where any arrived
/// (unread, they would hide the stream's end from `hung_up`). One `poll` where nothing arrived. Never blocks.
fn up(path: &Path, conn: &TcpStream) -> bool {
    let mut p = libc::pollfd { fd: conn.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd, no wait.
    if unsafe { libc::poll(&mut p, 1, 0) } <= 0 {
        return true;
    }
    if p.revents & (libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0 {
        return false;
    }
    path.absorb(conn);
    !hung_up(conn)
}

/// Whether the peer closed `conn` (or it failed): readable at EOF, or hung up. Never blocks.
fn hung_up(conn: &TcpStream) -> bool {
    let mut p = libc::pollfd { fd: conn.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd, no wait.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    if n <= 0 {
        return false;
    }
    if p.revents & (libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0 {
        return true;
    }
    let mut b = [0u8; 1];
    // SAFETY: a valid buffer of one byte; MSG_PEEK | MSG_DONTWAIT never blocks nor consumes.
    let r = unsafe { libc::recv(conn.as_raw_fd(), b.as_mut_ptr().cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT) };
    r == 0
}

impl Route for Fabric {
    fn label(&self) -> &'static str {
        "libfabric"
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
        for p in &self.paths {
            if let Some((_, c, _)) = p.greeted.lock().take() {
                let _ = c.shutdown(Shutdown::Both);
            }
        }
        self.link.close()
    }
    fn notify(&self, _from: &str, msg: &[u8]) -> Result<()> {
        self.link.notif(msg)
    }
    fn link(&self) -> Option<&Arc<TcpLink>> {
        Some(&self.link)
    }
    /// As host memory goes (one-sided operations on GPU memory registered with `FI_HMEM`) where every region of
    /// the request, here (as `prepared` found them) and there, is registered with libfabric and a live path's
    /// two rails carry them all; else the whole request is staged over the TCP link.
    fn vram(&self, plan: &XferPlan, prepared: Option<&(dyn Any + Send + Sync)>) -> Result<VramWay> {
        let keys = Keys::of(prepared);
        let here = keys.local.len() == plan.local_keys.len() && keys.local.iter().all(Option::is_some);
        let there = keys.remote.len() == plan.remote_keys.len() && keys.remote.iter().all(Option::is_some);
        if !(here && there) {
            return Ok(VramWay::Staged(self.link.clone()));
        }
        let (mine, theirs) = keys.carried(0..keys.local.len(), 0..keys.remote.len());
        let direct =
            self.paths.iter().any(|p| !p.dead.load(Ordering::Acquire) && has(mine, p.local) && has(theirs, p.remote));
        Ok(if direct { VramWay::Direct } else { VramWay::Staged(self.link.clone()) })
    }
    fn prepare(&self, regions: &Regions<'_>) -> Option<Prepared> {
        let local = regions.local_exports::<FabricExport>().map(|e| e.map(|e| e.slot.clone()));
        let remote = regions.remote_tickets::<FabricKeys>().map(|k| k.cloned());
        Some(Box::new(Keys { local: local.collect(), remote: remote.collect() }))
    }
    /// Over a live path from a rail nearest the local memory (then to one nearest the remote memory), in turn
    /// among the equally near; a path whose rail fails while the peer lives (its link up, its greeting
    /// connection open) is dropped, said in the log, and the piece goes again over another. With none left, or
    /// the peer gone, the peer is down.
    fn copy(&self, job: &Job, segs: &[Seg]) -> Result<()> {
        // A region the peer said it deregistered (on any path): refused whatever the paths' state.
        let keys = Keys::of(job.prepared);
        let closed = |p: &Path| {
            !p.closed.lock().keys.is_empty()
                && segs.iter().any(|s| {
                    let k = keys.remote.get(s.rreg as usize).and_then(Option::as_ref);
                    k.and_then(|k| k.keys.get(p.remote)).is_some_and(|k| p.is_closed(k.key))
                })
        };
        if self.paths.iter().any(closed) {
            return Err(self.closed());
        }
        let nearest = nearest(job, segs);
        // GPU memory: only paths whose two rails carry every region of the piece.
        let (mine, theirs) =
            Keys::of(job.prepared).carried(segs.iter().map(|s| s.lreg as usize), segs.iter().map(|s| s.rreg as usize));
        let carries = |p: &Path| has(mine, p.local) && has(theirs, p.remote);
        loop {
            if self.link.down() {
                return Err(self.link_down());
            }
            let alive = |p: &Path| !p.dead.load(Ordering::Acquire) && self.rails[p.local].stalled().is_none();
            let live = self.paths.iter().filter(|p| alive(p)).count();
            let usable = |p: &Path| alive(p) && carries(p);
            let Some(path) = near::choose(&self.paths, |p| (p.local, p.remote), usable, nearest, &self.turn) else {
                if live > 0 {
                    // Live paths, none of which carries these regions (their GPU memory's rails failed).
                    return Err(Error::backend(format!(
                        "no live libfabric path to agent '{}' carries every region of this request (GPU memory \
                         is registered only on rails that passed their GPU-memory self-test)",
                        self.name
                    )));
                }
                let why = "every libfabric rail to it failed";
                self.link.kill(why.into());
                return Err(self.gone(why));
            };
            match self.on(path, job, segs) {
                (Err(e), true) if e.status() == Status::RemoteDisconnect => {
                    if !path.dead.swap(true, Ordering::AcqRel) {
                        crate::telemetry::log::warn(&format!(
                            "agent '{}': peer '{}': libfabric path {} -> its rail {} failed ({e}); {} left",
                            job.agent,
                            self.name,
                            self.rails[path.local].name(),
                            path.remote,
                            live - 1
                        ));
                    }
                    if let Some((_, c, _)) = path.greeted.lock().take() {
                        let _ = c.shutdown(Shutdown::Both);
                    }
                }
                (Err(e), _) => {
                    if e.status() == Status::RemoteDisconnect && !self.link.down() {
                        self.link.kill(e.message().to_owned());
                    }
                    return Err(e);
                }
                (Ok(()), _) => return Ok(()),
            }
        }
    }
}
