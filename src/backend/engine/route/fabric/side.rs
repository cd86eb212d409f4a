//! The libfabric route's side of this engine (`FabricSide`): the provider it was given, and, opened on first
//! need (a registration, the connection info, a peer), its rails: every domain of the provider that libfabric
//! offers (a NIC; an interface for tcp; not the loopback interface nor one with only link-local addresses, unless
//! nothing else is offered or it is the domain asked for), each with one RDM endpoint, its completion queue and
//! address vector (`Rail`); its registrations' memory regions, one per rail (`FabricExport`: keys never handed
//! out twice per domain, see `keys`; the rails nearest the region's memory, see `near`); its connection-info
//! section (every rail's fabric and address); the target's half of the greeting (a `wire::KIND` connection per
//! initiator path, naming the rail it reaches, kept open while that path lives); and the progress of each rail.
//!
//! Progress: the providers run here (tcp through `ofi_rxm`, shm) move data only when the endpoint's queue is
//! read (`FI_PROGRESS_MANUAL`), on the target's side too: an initiator's READ or WRITE completes only while the
//! target reads its queue. So a thread per rail (`progress`) reads it, sleeping on its wait descriptor at most
//! `fabric::SLICE` between reads, but only while a greeting connection on that rail is open (an initiator
//! greeted here, or one of this engine's paths greeted at a peer: so that the peer's fence READs are answered,
//! see `retire`); with none it sleeps on a condition variable, so an engine without peers on this route wakes
//! for nothing. Initiators read the same queue while they wait; every operation's completion is found by its
//! number (`Ops`), whoever read it.
//!
//! A rail is used for data only after its device's self-test passed in this process (`selftest::run_on`, on
//! the rail's own endpoint, started in the background as soon as the endpoint opens (`test_soon`), waited for
//! by a first peer that comes sooner (`ready`); run once per device and process, the verdict kept and shown by
//! `gixl doctor`); a failed one is one WARN line naming the device, the step and the fallback (the other rails,
//! else TCP), and greetings on it are refused.
//!
//! GPU memory: a rail whose device offers `FI_HMEM` registers it (interface: `hmem_of`) as a dma-buf where the
//! library takes one (≥ 1.20) and that way passed a GPU-memory self-test for that GPU, else by its interface
//! where that way passed (`vram_way`; `selftest::run_vram_on`, run at the first registration of one of its
//! regions: `vram_verdict`); a rail where neither passed registers none (one WARN line), and the region's
//! ticket names the rails that carry it (`FabricKeys::rails`).

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::wire::{self, Advert, FabricKey, FabricKeys, RailAdvert};
use crate::backend::engine::keys::KeyLedger;
use crate::backend::engine::near::{self, Place};
use crate::backend::engine::route::{Export, Registration, Side};
pub(crate) use crate::fabric::is_sockets;
use crate::fabric::selftest;
use crate::fabric::{self as fi, Av, Cq, CqRead, Device, Domain, Endpoint, Hmem, Mr, RemoteKey, Vram};
use crate::mem::MemType;
use crate::os::sock as net;
use crate::status::{Error, Result};

/// The first provider offered that is not itself sockets or shared memory (efa, verbs, psm…), looked up once
/// per process (libfabric absent: none). The first call opens libfabric: with Debian's build that costs about
/// 300 ms here (its psm and psm2 libraries calibrate the clock when loaded, then every provider initialises), so
/// engines look it up in the background (`look_up_soon`), never on agent creation's path.
pub(crate) fn fabric_provider() -> Option<String> {
    static FOUND: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    FOUND
        .get_or_init(|| {
            let all = crate::fabric::devices(None, None).ok()?;
            all.iter().map(|d| d.provider()).find(|p| !is_sockets(p))
        })
        .clone()
}

/// The longest the target's progress thread sleeps on its queue's wait descriptor between reads.
const TARGET_SLEEP: Duration = Duration::from_millis(100);

/// How long the progress thread sleeps while the engine's own threads read the queue.
const STAND_ASIDE: Duration = Duration::from_millis(5);

/// The longest a deregistration waits for its fence (see `FabricSide::retire`).
const FENCE_LIMIT: Duration = Duration::from_secs(2);

/// The self-test's time limit.
const SELFTEST_LIMIT: Duration = Duration::from_secs(5);

/// Whether a device of provider `have` is what `want` names: its full name, or, unless `exact`, its core
/// provider (as libfabric reads `FI_PROVIDER`: `tcp` names `tcp;ofi_rxm`).
pub(crate) fn provider_is(have: &str, want: &str, exact: bool) -> bool {
    have == want || (!exact && have.split(';').next() == Some(want))
}

/// One operation's state, found by its number when its completion is read.
#[derive(Default)]
pub(crate) struct OpState {
    pub(crate) done: AtomicBool,
    /// Its error, libfabric's error number and the provider's, where it failed.
    pub(crate) err: Mutex<Option<(Error, i32, i32)>>,
}

/// Operations posted on the endpoint and not completed, by number (their context).
#[derive(Default)]
pub(crate) struct Ops {
    next: AtomicU64,
    pending: Mutex<HashMap<u64, Arc<OpState>>>,
}

impl Ops {
    /// A new operation: its number (the context posted with it) and its state.
    pub(crate) fn start(&self) -> (u64, Arc<OpState>) {
        let id = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        let s = Arc::new(OpState::default());
        self.pending.lock().insert(id, s.clone());
        (id, s)
    }

    /// An operation that was never posted, or given up on: its completion, if one comes, is dropped.
    pub(crate) fn forget(&self, id: u64) {
        self.pending.lock().remove(&id);
    }

    fn complete(&self, id: u64, err: Option<(Error, i32, i32)>) {
        if let Some(s) = self.pending.lock().remove(&id) {
            if err.is_some() {
                *s.err.lock() = err;
            }
            s.done.store(true, Ordering::Release);
        }
    }
}

/// One rail of a side: a domain of the provider (a NIC, or an interface for tcp), opened, with its endpoint and
/// queues.
pub(crate) struct Rail {
    /// Its index among the side's rails (in the order the section lists them).
    pub(crate) index: usize,
    pub(crate) dev: Device,
    pub(crate) fabric: fi::Fabric,
    pub(crate) domain: Domain,
    pub(crate) cq: Arc<Cq>,
    pub(crate) av: Arc<Av>,
    pub(crate) ep: Arc<Endpoint>,
    /// The endpoint's address, as peers insert it.
    pub(crate) addr: Vec<u8>,
    keys: KeyLedger<(Mr, Box<[u8]>)>,
    pub(crate) ops: Ops,
    /// A few bytes the initiator reads into to flush its WRITEs (see `Fabric::run`), and that a target reads
    /// from to fence a region it retires (see `FabricSide::retire`): registered for remote reading too.
    pub(crate) scratch: (Mr, Box<[u8]>),
    /// The rail's progress switch: initiators hold it on while greeted (see `Rail::hold`).
    progress: Arc<Progress>,
    /// Address-vector entries by peer address (inserted once each).
    peers: Mutex<HashMap<Vec<u8>, u64>>,
    /// Its NIC's NUMA node and PCI path (sysfs), where known: for the rails nearest a region's memory.
    place: (Option<i32>, Option<String>),
    /// Why its endpoint can no longer be trusted to complete operations (see `Rail::stall`); None while it can.
    stalled: Mutex<Option<String>>,
    /// Its provider drops an operation on a closed key without answering it (shm, see
    /// `silent_on_closed_keys`).
    pub(crate) drops_closed: bool,
}

impl Rail {
    fn new(index: usize, dev: Device) -> Result<Rail> {
        let fabric = fi::Fabric::open(&dev)?;
        let domain = Domain::open(&fabric, &dev)?;
        let cq = Cq::open(&domain, 1024)?;
        let av = Av::open(&domain, 64)?;
        let ep = Arc::new(Endpoint::open(&domain, &dev, &cq, &av)?);
        let addr = ep.name()?;
        let mut buf = vec![0u8; 64].into_boxed_slice();
        // SAFETY: the buffer lives with its region (both in `scratch`, the region dropped first).
        let mr = unsafe { Mr::register(&domain, buf.as_mut_ptr(), buf.len(), &ep)? };
        let (keys, ops, peers) = (KeyLedger::new([mr.key()]), Ops::default(), Mutex::default());
        let place = nic_place(&dev.domain());
        let progress = Arc::default();
        let (stalled, drops_closed) = (Mutex::default(), silent_on_closed_keys(&dev.provider()));
        Ok(Rail {
            index,
            dev,
            fabric,
            domain,
            cq,
            av,
            ep,
            addr,
            keys,
            ops,
            peers,
            scratch: (mr, buf),
            progress,
            place,
            stalled,
            drops_closed,
        })
    }

    /// The rail's endpoint will not complete operations any more (`why`): no new route or greeting takes it,
    /// and routes over it drop their paths on it. True the first time (the caller says so, once).
    pub(crate) fn stall(&self, why: &str) -> bool {
        let mut s = self.stalled.lock();
        let first = s.is_none();
        s.get_or_insert_with(|| why.to_owned());
        first
    }

    /// Why the rail stalled, where it did.
    pub(crate) fn stalled(&self) -> Option<String> {
        self.stalled.lock().clone()
    }

    /// What the log and the doctor call it.
    pub(crate) fn name(&self) -> String {
        format!("{}/{}", self.dev.provider(), self.dev.domain())
    }

    /// Whether libfabric reads `addr` within its bytes as an address of this endpoint's format: one of our
    /// address's length, or, where the format is a string (`FI_ADDR_STR`, shm's `fi_shm://<pid>`, whose length
    /// varies with the pid), one that ends in its only NUL.
    pub(crate) fn takes(&self, addr: &[u8]) -> bool {
        let string = |a: &[u8]| a.split_last().is_some_and(|(&end, s)| end == 0 && !s.contains(&0));
        addr.len() == self.addr.len() || (self.dev.string_addresses() && string(addr))
    }

    /// The address-vector entry of the endpoint at `addr`: an address this endpoint `takes` (libfabric reads
    /// as many bytes as its address format takes, whatever was received: another is refused, never read past).
    pub(crate) fn peer(&self, addr: &[u8]) -> Result<u64> {
        if !self.takes(addr) {
            return Err(Error::mismatch(format!(
                "a libfabric address of {} bytes where {} has {}-byte addresses",
                addr.len(),
                self.dev.provider(),
                self.addr.len()
            )));
        }
        let mut p = self.peers.lock();
        if let Some(&a) = p.get(addr) {
            return Ok(a);
        }
        let a = self.av.insert(addr)?;
        p.insert(addr.to_vec(), a);
        Ok(a)
    }

    /// Read the queue once, marking each completed or failed operation (drives the provider's progress).
    pub(crate) fn pump(&self) -> Result<()> {
        loop {
            match self.cq.read()? {
                CqRead::Done(v) if v.is_empty() => return Ok(()),
                CqRead::Done(v) => v.into_iter().for_each(|c| self.ops.complete(c as u64, None)),
                CqRead::Failed(c, e, errno, prov) => self.ops.complete(c as u64, Some((e, errno, prov))),
            }
        }
    }

    /// Sleep until the queue may have something (at most `fabric::SLICE`).
    pub(crate) fn sleep(&self) -> Result<()> {
        fi::wait(&self.fabric, &[&self.cq], fi::SLICE)
    }

    /// One operation posted with `post` (its context given; `Ok(false)`: the provider's queue is full, post
    /// again) and waited for until `deadline`: numbered as the route's, found by number whoever reads the
    /// queue (the progress thread may), the queue read and slept on until done.
    pub(crate) fn complete(
        &self,
        deadline: Instant,
        post: &mut dyn FnMut(*mut std::ffi::c_void) -> Result<bool>,
    ) -> Result<()> {
        let (id, state) = self.ops.start();
        let mut posted = false;
        let r = loop {
            if !posted {
                match post(id as *mut std::ffi::c_void) {
                    Ok(p) => posted = p,
                    Err(e) => break Err(e),
                }
            }
            if let Err(e) = self.pump() {
                break Err(e);
            }
            if state.done.load(Ordering::Acquire) {
                break state.err.lock().take().map_or(Ok(()), |(e, _, _)| Err(e));
            }
            let t = fi::left(deadline);
            if t.is_zero() {
                break Err(Error::backend(format!(
                    "no completion before the time limit ({})",
                    if posted { "posted" } else { "the provider's queue stayed full" }
                )));
            }
            if let Err(e) = fi::wait(&self.fabric, &[&self.cq], t) {
                break Err(e);
            }
        };
        if r.is_err() {
            self.ops.forget(id);
        }
        r
    }

    /// The rail's progress kept on while the returned value lives: an initiator holds it while greeted, so
    /// that its target's fence READs (see `FabricSide::retire`) are answered while it is idle too (the
    /// providers here serve a peer's READ only while the queue is read).
    pub(crate) fn hold(&self) -> Busy {
        *self.progress.active.lock() += 1;
        self.progress.cv.notify_all();
        Busy(self.progress.clone())
    }

    /// Held by a thread while it waits for its own operations, reading the queue itself: the progress thread
    /// stands aside meanwhile (two threads reading one queue took each other's wake-ups: a 4 KiB READ's median
    /// went from about 35 to 60 µs here).
    pub(crate) fn waiting(&self) -> Waiting {
        self.progress.waiters.fetch_add(1, Ordering::AcqRel);
        Waiting(self.progress.clone())
    }

    /// A fence for a region just closed: a 1-byte READ of each greeted initiator's scratch, waited for (until
    /// `deadline`). Over tcp through ofi_rxm, an initiator's answer follows, on the same connection, the
    /// WRITEs it was sending: the answer arrives after their bytes were placed, so once every READ completed,
    /// no WRITE accepted before the region closed is still landing in it. A READ that fails (the provider
    /// dropped that connection: it does so after refusing a key) fences too: nothing more arrives on a closed
    /// connection, and a new one carries only operations checked against the closed key. Err: the initiators
    /// that did not answer in time.
    fn fence(&self, initiators: &[(u64, RemoteKey)], deadline: Instant) -> std::result::Result<(), usize> {
        let (mr, buf) = &self.scratch;
        let dst = buf.as_ptr() as *mut u8;
        let failed = initiators
            .iter()
            .filter(|&&(peer, rk)| {
                // SAFETY: one byte of the scratch buffer, registered as `mr`, kept for the engine's life (other
                // flushes may read into it at the same time: its bytes mean nothing).
                let mut post = |ctx| unsafe { self.ep.post(false, mr, (dst, 1), peer, rk, ctx) };
                self.complete(deadline, &mut post).is_err() && Instant::now() >= deadline
            })
            .count();
        if failed == 0 {
            Ok(())
        } else {
            Err(failed)
        }
    }

    /// A memory region for `[addr, addr + len)` under a key this domain never handed out before: host memory,
    /// or GPU memory of the device layer `device`, handed over as `vram` says (`FI_HMEM`).
    fn register(&self, addr: u64, len: u64, vram: Option<(Vram, &dyn crate::device::Device)>) -> Result<Mr> {
        let what = format!("libfabric device {}/{}", self.dev.provider(), self.dev.domain());
        let (p, n) = (addr as *mut u8, len as usize);
        self.keys.register(
            &what,
            // SAFETY: a registered region's memory is the application's and stays allocated while registered
            // (NIXL's contract); the region is closed when the registration is retired.
            || unsafe {
                match vram {
                    None => Mr::register(&self.domain, p, n, &self.ep),
                    Some((v, device)) => Mr::register_vram(&self.domain, p, n, &self.ep, v, device),
                }
            },
            Mr::key,
            |mr| {
                drop(mr);
                Ok(())
            },
            || {
                let mut dummy = vec![0u8; 64].into_boxed_slice();
                // SAFETY: the buffer is kept with its region for the engine's life (in the ledger).
                let t = unsafe { Mr::register_for(&self.domain, dummy.as_mut_ptr(), dummy.len(), &self.ep, false)? };
                let k = t.key();
                Ok(((t, dummy), k))
            },
        )
    }
}

impl selftest::Rig for Rail {
    fn domain(&self) -> &Domain {
        &self.domain
    }
    fn endpoint(&self) -> &Arc<Endpoint> {
        &self.ep
    }
    fn me(&self) -> Result<u64> {
        self.peer(&self.addr)
    }
    fn complete(&self, deadline: Instant, post: &mut dyn FnMut(*mut std::ffi::c_void) -> Result<bool>) -> Result<()> {
        Rail::complete(self, deadline, post)
    }
}

/// A rail's greeting connections being served and its progress thread's switch.
#[derive(Default)]
pub(crate) struct Progress {
    /// Greeting connections open: initiators greeted here, and this engine's own routes greeted elsewhere.
    active: Mutex<usize>,
    cv: Condvar,
    stop: AtomicBool,
    /// This engine's threads waiting for their own operations (they read the queue themselves: the progress
    /// thread stands aside meanwhile, see `progress`).
    waiters: AtomicUsize,
}

impl Progress {
    /// The progress thread told to end.
    fn halt(&self) {
        self.stop.store(true, Ordering::Release);
        self.cv.notify_all();
    }
}

/// A thread of this engine reading the queue for its own operations (see `Rail::waiting`).
pub(crate) struct Waiting(Arc<Progress>);

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.waiters.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The endpoint's progress held on (see `Rail::hold`); released when dropped.
pub(crate) struct Busy(Arc<Progress>);

impl Drop for Busy {
    fn drop(&mut self) {
        let mut n = self.0.active.lock();
        *n = n.saturating_sub(1);
    }
}

pub(crate) struct FabricSide {
    agent: String,
    /// The provider asked for (libfabric's full name, or its core provider's, see `provider_is`), and whether
    /// by its full name; None: the first offered that is not sockets (`fabric_provider`, looked up in
    /// the background), else `fallback`.
    asked: Option<(String, bool)>,
    fallback: Option<String>,
    /// The domain asked for; None: every one.
    domain: Option<String>,
    /// The rails, opened on first need; the error where none could be.
    open: Mutex<Option<std::result::Result<Rails, String>>>,
    /// Greeting connections being served: shut down when the engine goes.
    conns: Mutex<Vec<TcpStream>>,
    /// The initiators greeted here that said where their scratch is (for `fence`).
    initiators: Mutex<Vec<Greeted>>,
}

/// A side's rails, by index.
pub(crate) type Rails = Arc<[Arc<Rail>]>;

/// An initiator greeted on one of our rails: the greeting's number, the rail, the initiator's address-vector
/// entry on it and its scratch; the greeting connection, whether the initiator reads closed-key notices on it,
/// and what of them the socket did not take yet.
struct Greeted {
    id: u64,
    rail: usize,
    peer: u64,
    scratch: RemoteKey,
    conn: Arc<TcpStream>,
    notices: bool,
    unsent: Vec<u8>,
}

/// The most notice bytes kept for an initiator that does not read them (it is idle, or stuck): beyond it, its
/// notices stop (its provider's own answer to a closed key is then all it gets, as with an older initiator).
const UNSENT_MAX: usize = 64 << 10;

impl Greeted {
    /// Queue `notice` and send what the socket takes now, never waiting (a full socket keeps the rest for
    /// the next notice); an initiator whose backlog passed `UNSENT_MAX` gets no more.
    fn tell(&mut self, notice: &[u8]) {
        if !self.notices {
            return;
        }
        self.unsent.extend_from_slice(notice);
        while !self.unsent.is_empty() {
            // SAFETY: a connected socket; the buffer is valid for its length; MSG_DONTWAIT never blocks and
            // MSG_NOSIGNAL turns a closed peer into EPIPE instead of a signal.
            let n = unsafe {
                libc::send(
                    self.conn.as_raw_fd(),
                    self.unsent.as_ptr().cast(),
                    self.unsent.len(),
                    libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
                )
            };
            if n <= 0 {
                break;
            }
            self.unsent.drain(..n as usize);
        }
        if self.unsent.len() > UNSENT_MAX {
            self.notices = false;
            self.unsent = Vec::new();
        }
    }
}

/// Whether provider `name` drops an operation on a closed key without answering it: shm (1.17 and 2.1: its
/// target checks the key when it takes the command and, where that fails, drops it, `smr_progress_cmd_rma`). Its
/// in-flight operations on a key the peer said is closed are then given up (the peer's provider, which does
/// the copying for shm, will not touch them: it takes commands in order and checks each one's key then).
fn silent_on_closed_keys(name: &str) -> bool {
    name == "shm"
}

/// A self-test's result as the route keeps it: passed (with its cost in ms) or why not.
type Verdict = std::result::Result<f64, String>;

/// One device's self-test in this process (by provider and domain): run once, by the first engine that opens
/// an endpoint on the device (in the background, see `FabricSide::opened`) or by the first peer that needs it,
/// whichever comes first; the others wait for its verdict.
#[derive(Default)]
struct Trial {
    verdict: Mutex<Option<Verdict>>,
    cv: Condvar,
}

impl Trial {
    /// Its verdict, waited for (bounded by the test's own limit).
    fn wait(&self) -> Verdict {
        let mut v = self.verdict.lock();
        let until = Instant::now() + SELFTEST_LIMIT + Duration::from_secs(1);
        while v.is_none() && !self.cv.wait_until(&mut v, until).timed_out() {}
        v.clone().unwrap_or_else(|| Err("self-test failed at its time limit".into()))
    }
}

/// Greeting connections served by this process, numbered.
static NEXT_GREETING: AtomicU64 = AtomicU64::new(0);

/// A device: its provider and domain (for a provider that could not be opened: as asked).
type Asked = (String, Option<String>);

/// Self-tests this process started.
static TESTED: Mutex<Vec<(Asked, Arc<Trial>)>> = Mutex::new(Vec::new());

/// The trial of device `key`, and whether the caller is the first to ask (and so runs it).
fn trial(key: Asked) -> (Arc<Trial>, bool) {
    let mut all = TESTED.lock();
    if let Some((_, t)) = all.iter().find(|(k, _)| *k == key) {
        return (t.clone(), false);
    }
    let t = Arc::new(Trial::default());
    all.push((key, t.clone()));
    (t, true)
}

fn rail_key(rail: &Rail) -> Asked {
    (rail.dev.provider(), Some(rail.dev.domain()))
}

/// The NUMA node and PCI path of the NIC behind domain `domain` (sysfs: an RDMA device, `efa`'s and `verbs`'
/// domains, with or without the `-rdm`/`-dgrm` suffix libfabric adds; else a network interface, tcp's domains);
/// neither where sysfs has no device for it (veths, shm).
fn nic_place(domain: &str) -> (Option<i32>, Option<String>) {
    let base = domain.rsplit_once('-').map_or(domain, |(b, _)| b);
    [
        format!("/sys/class/infiniband/{domain}"),
        format!("/sys/class/infiniband/{base}"),
        format!("/sys/class/net/{domain}"),
    ]
    .iter()
    .map(|d| std::path::Path::new(d).join("device"))
    .find(|d| d.exists())
    .map_or((None, None), |d| crate::os::nic_place(&d))
}

impl FabricSide {
    pub(crate) fn new(
        agent: &str,
        asked: Option<(String, bool)>,
        fallback: Option<String>,
        domain: Option<String>,
    ) -> Arc<FabricSide> {
        Arc::new(FabricSide {
            agent: agent.to_owned(),
            asked,
            fallback,
            domain,
            open: Mutex::default(),
            conns: Mutex::default(),
            initiators: Mutex::default(),
        })
    }

    /// Whether its provider was asked for (else it is looked up).
    pub(crate) fn named(&self) -> bool {
        self.asked.is_some()
    }

    /// Its provider and whether by its full name: as asked, else the first libfabric offers that is not sockets
    /// (waiting for the background lookup where it has not ended), else the fallback; empty: none.
    pub(crate) fn provider(&self) -> (String, bool) {
        match &self.asked {
            Some(p) => p.clone(),
            None => (fabric_provider().or_else(|| self.fallback.clone()).unwrap_or_default(), true),
        }
    }

    /// The rails' devices: every domain of the provider (the one asked for alone, where asked), but the
    /// loopback interface and those whose fabric is link-local only (`fe80::`: not reachable from another link)
    /// where others are offered; at most `wire::MAX_RAILS`.
    fn devices(&self) -> Result<Vec<Device>> {
        let (provider, exact) = self.provider();
        if provider.is_empty() {
            return Err(Error::not_supported(
                "libfabric offers no provider here that is not itself sockets or shared memory (efa, verbs, psm…)",
            ));
        }
        let all = fi::devices(None, self.domain.as_deref())?;
        let mine: Vec<Device> = all.into_iter().filter(|d| provider_is(&d.provider(), &provider, exact)).collect();
        let rails: Vec<Device> = (mine.iter())
            .filter(|d| d.domain() != "lo" && !d.fabric().starts_with("fe80:"))
            .take(wire::MAX_RAILS)
            .cloned()
            .collect();
        if !rails.is_empty() {
            return Ok(rails);
        }
        mine.into_iter().next().map(|d| vec![d]).ok_or_else(|| {
            Error::not_supported(format!(
                "libfabric offers no {provider} device with an RDM endpoint and one-sided RMA{}",
                self.domain.as_deref().map(|d| format!(" on {d}")).unwrap_or_default()
            ))
        })
    }

    /// The opened rails (opened now, the first time: each with its progress thread and its self-test started
    /// in the background); the reason where none can be.
    pub(crate) fn opened(&self) -> std::result::Result<Rails, String> {
        let mut o = self.open.lock();
        if let Some(r) = &*o {
            return r.clone();
        }
        let r = self.open_rails();
        if let Err(why) = &r {
            // Said as a WARN by `ready` at the first peer that would have used it.
            crate::telemetry::log::info(&format!(
                "agent '{}': libfabric provider {} not opened ({why})",
                self.agent,
                self.provider().0
            ));
        }
        *o = Some(r.clone());
        r
    }

    fn open_rails(&self) -> std::result::Result<Rails, String> {
        let devs = self.devices().map_err(|e| e.message().to_owned())?;
        let (mut rails, mut why) = (Vec::new(), Vec::new());
        for d in devs {
            let name = format!("{}/{}", d.provider(), d.domain());
            match Rail::new(rails.len(), d) {
                Ok(r) => rails.push(Arc::new(r)),
                Err(e) => {
                    crate::telemetry::log::info(&format!(
                        "agent '{}': libfabric rail {name} not opened ({e})",
                        self.agent
                    ));
                    why.push(format!("{name}: {}", e.message()));
                }
            }
        }
        if rails.is_empty() {
            return Err(why.join("; "));
        }
        for rail in &rails {
            let r2 = rail.clone();
            let spawned = std::thread::Builder::new().name("gixl-fabric-pr".into()).spawn(move || progress(r2));
            if let Err(e) = spawned {
                rails.iter().for_each(|r| r.progress.halt());
                return Err(format!("cannot start the libfabric progress thread: {e}"));
            }
        }
        let names: Vec<String> = rails.iter().map(|r| r.name()).collect();
        crate::telemetry::log::info(&format!(
            "agent '{}': libfabric endpoint on {} rail(s): {}",
            self.agent,
            rails.len(),
            names.join(", ")
        ));
        rails.iter().for_each(|r| self.test_soon(r));
        Ok(rails.into())
    }

    /// The rail's self-test started now in the background on its endpoint just opened, unless this process has
    /// one already: by the time a first peer needs the route it has usually passed.
    fn test_soon(&self, rail: &Arc<Rail>) {
        let (trial, first) = trial(rail_key(rail));
        if !first {
            return;
        }
        let (agent, r2, t2) = (self.agent.clone(), rail.clone(), trial.clone());
        let spawned = std::thread::Builder::new()
            .name("gixl-fabric-st".into())
            .spawn(move || settle(&t2, test(&agent, &r2.dev.provider(), None, Some(r2.clone()))));
        if spawned.is_err() {
            // Run by the first peer that needs it instead.
            TESTED.lock().retain(|(_, t)| !Arc::ptr_eq(t, &trial));
        }
    }

    /// The verdict of `rail`'s self-test: run now where its opening did not start it, else waited for.
    fn verdict(&self, rail: &Arc<Rail>) -> Verdict {
        let (trial, first) = trial(rail_key(rail));
        if first {
            return settle(&trial, test(&self.agent, &rail.dev.provider(), None, Some(rail.clone())));
        }
        trial.wait()
    }

    /// How `rail` carries GPU memory of GPU `dev` (interface `hmem`): as a dma-buf where the library takes one
    /// (API ≥ 1.20) and that way's self-test passed, else by its interface where that way's passed. None where
    /// the rail's device does not offer `FI_HMEM` (nothing to test: GPU memory is staged on it); Err: why
    /// neither way passed.
    fn vram_way(
        &self,
        rail: &Arc<Rail>,
        device: &'static dyn crate::device::Device,
        dev: u32,
        hmem: Hmem,
    ) -> Option<std::result::Result<Vram, String>> {
        if !rail.dev.hmem() {
            return None;
        }
        let mut why = Vec::new();
        for dmabuf in [true, false] {
            if dmabuf && rail.domain.lib().api < fi::sys::API_1_20 {
                continue;
            }
            let vram = Vram { hmem, dmabuf };
            match self.vram_verdict(rail, device, dev, vram) {
                Ok(_) => return Some(Ok(vram)),
                Err(e) => why.push(format!("{}: {e}", vram.name())),
            }
        }
        Some(Err(why.join("; ")))
    }

    /// The verdict of `rail`'s GPU-memory self-test for GPU `dev` handed over as `vram` says (run now, once per
    /// process, the first time a region of that GPU is registered: off agent creation's path).
    fn vram_verdict(
        &self,
        rail: &Arc<Rail>,
        device: &'static dyn crate::device::Device,
        dev: u32,
        vram: Vram,
    ) -> Verdict {
        let key = (format!("{} {vram:?}", rail.dev.provider()), Some(format!("{} gpu {dev}", rail.dev.domain())));
        let (trial, first) = trial(key);
        if first {
            settle(&trial, test_vram(&self.agent, rail, device, dev, vram))
        } else {
            trial.wait()
        }
    }

    /// The rails, for data, and each one's self-test cost where it passed in this process (None: it failed, and
    /// is not used). Err: why no rail is usable (said in the router's line for the peer); a failed self-test is
    /// one WARN line.
    pub(crate) fn ready(&self) -> std::result::Result<(Rails, Vec<Option<f64>>), String> {
        let rails = match self.opened() {
            Ok(r) => r,
            Err(why) => {
                // The provider tested alone: it fails at the step that says why (once per process).
                let provider = self.provider().0;
                let (trial, first) = trial((provider.clone(), self.domain.clone()));
                let v = if first {
                    settle(&trial, test(&self.agent, &provider, self.domain.as_deref(), None))
                } else {
                    trial.wait()
                };
                v?;
                crate::telemetry::log::warn(&format!(
                    "agent '{}': libfabric provider {} passed its self-test but this engine's endpoint could not be \
                     opened ({why}): its peers go over TCP",
                    self.agent, provider
                ));
                return Err(why);
            }
        };
        let verdicts: Vec<Verdict> = rails
            .iter()
            .map(|r| r.stalled().map_or_else(|| self.verdict(r), |why| Err(format!("stalled: {why}"))))
            .collect();
        if verdicts.iter().all(Result::is_err) {
            return Err(verdicts.into_iter().find_map(Result::err).unwrap_or_default());
        }
        Ok((rails, verdicts.into_iter().map(Result::ok).collect()))
    }

    /// Serve one greeting connection (authenticated by the TCP listener): insert the initiator's address,
    /// answer, and drive the endpoint's progress until the connection closes.
    pub(crate) fn serve(self: &Arc<Self>, s: TcpStream, patience: Duration) {
        let me = self.clone();
        let spawned = std::thread::Builder::new().name("gixl-fabric-gr".into()).spawn(move || me.greet(s, patience));
        if let Err(e) = spawned {
            crate::telemetry::log::warn(&format!("libfabric: cannot serve a greeting: {e}"));
        }
    }

    fn greet(&self, mut s: TcpStream, patience: Duration) {
        crate::os::sock::tune(&s, patience);
        let _ = s.set_read_timeout(Some(patience));
        let _ = s.set_write_timeout(Some(patience));
        let mut head = [0u8; wire::GREETING_HEAD + 1];
        if s.read_exact(&mut head[..wire::GREETING_HEAD]).is_err() {
            return;
        }
        let (rail, n) = match wire::greeting_len(&head[..wire::GREETING_HEAD]) {
            Some(Ok(g)) => g,
            Some(Err(())) => {
                if s.read_exact(&mut head[wire::GREETING_HEAD..]).is_err() {
                    return;
                }
                match wire::greeting_len(&head) {
                    Some(Ok(g)) => g,
                    _ => return,
                }
            }
            None => return,
        };
        let mut addr = vec![0u8; n];
        if s.read_exact(&mut addr).is_err() {
            return;
        }
        // Refused: no such rail, or one whose self-test failed (the initiator takes another path).
        let rail = self.opened().ok().and_then(|r| r.get(rail as usize).cloned());
        let Some(rail) = rail.filter(|r| self.verdict(r).is_ok() && r.stalled().is_none()) else {
            let _ = s.write_all(&[wire::ANSWER_REFUSED]);
            return;
        };
        let Ok(peer) = rail.peer(&addr) else {
            let _ = s.write_all(&[wire::ANSWER_REFUSED]);
            return;
        };
        if s.write_all(&[wire::ANSWER_OK]).is_err() {
            return;
        }
        if let Ok(c) = s.try_clone() {
            self.conns.lock().push(c);
        }
        let Ok(conn) = s.try_clone().map(Arc::new) else { return };
        let busy = rail.hold();
        // The initiator's path lives as long as the connection. Its first bytes, where it sends them, say
        // where its scratch is (`wire::decode_scratch`), for the fence of regions retired here, and the next
        // whether it reads closed-key notices (`retire`).
        let _ = s.set_read_timeout(None);
        let id = NEXT_GREETING.fetch_add(1, Ordering::Relaxed);
        let (mut b, mut head) = ([0u8; 64], Vec::new());
        while let Ok(n @ 1..) = s.read(&mut b) {
            let had = head.len();
            if had <= wire::SCRATCH {
                head.extend_from_slice(&b[..n.min(wire::SCRATCH + 1 - had)]);
            }
            if had < wire::SCRATCH {
                if let Some(scratch) = wire::decode_scratch(&head) {
                    let g = Greeted {
                        id,
                        rail: rail.index,
                        peer,
                        scratch,
                        conn: conn.clone(),
                        notices: false,
                        unsent: Vec::new(),
                    };
                    self.initiators.lock().push(g);
                }
            }
            if had <= wire::SCRATCH && head.get(wire::SCRATCH) == Some(&wire::READS_CLOSED) {
                self.initiators.lock().iter_mut().filter(|g| g.id == id).for_each(|g| g.notices = true);
            }
        }
        self.initiators.lock().retain(|g| g.id != id);
        drop(busy);
        let me = s.local_addr().ok().zip(s.peer_addr().ok());
        self.conns.lock().retain(|c| c.local_addr().ok().zip(c.peer_addr().ok()) != me);
    }

    /// Every rail's progress thread told to end.
    fn halt(&self) {
        if let Some(Ok(rails)) = &*self.open.lock() {
            rails.iter().for_each(|r| r.progress.halt());
        }
    }
}

/// The interface GPU memory of this process's device layer is registered with (`fi_mr_regattr`): CUDA memory
/// as `FI_HMEM_CUDA` with its ordinal. The fake device (`GIXL_FAKE_DEVICE=1`, host memory standing for a GPU)
/// declares itself as a real GPU would (`FI_HMEM_CUDA`), unless `GIXL_TEST_FABRIC_HMEM=system`: a test knob
/// that registers its memory as what it is, host memory (`FI_HMEM_SYSTEM`), so that the provider's `FI_HMEM`
/// path and the route's direct GPU-memory path run where no GPU is (they then move host memory, not a GPU's).
pub(crate) fn hmem_of(kind: &str, dev: u32) -> Hmem {
    let system = kind == "fake" && std::env::var("GIXL_TEST_FABRIC_HMEM").is_ok_and(|v| v.trim() == "system");
    if system {
        Hmem::System
    } else {
        Hmem::Cuda(dev as i32)
    }
}

/// Records a trial's verdict and wakes those waiting for it; the verdict.
fn settle(trial: &Trial, v: Verdict) -> Verdict {
    *trial.verdict.lock() = Some(v.clone());
    trial.cv.notify_all();
    v
}

/// The self-test of `rail`'s device (on its endpoint: it adds none of its own), or, where no rail could be
/// opened, of `provider` alone (it then fails at the step that says why); its INFO or WARN line.
fn test(agent: &str, provider: &str, domain: Option<&str>, rail: Option<Arc<Rail>>) -> Verdict {
    let t = match rail {
        Some(r) => {
            let (p, d) = (r.dev.provider(), r.dev.domain());
            selftest::run_on(r, &p, &d, SELFTEST_LIMIT)
        }
        None => selftest::run_provider(provider, domain, SELFTEST_LIMIT),
    };
    match &t.outcome {
        selftest::Outcome::Passed { cost } => {
            crate::telemetry::log::info(&format!("agent '{agent}': libfabric self-test {t}"));
            Ok(cost.as_secs_f64() * 1e3)
        }
        selftest::Outcome::Failed { step, error, .. } => {
            crate::telemetry::log::warn(&format!(
                "agent '{agent}': libfabric device {}/{} failed its self-test at step '{}' ({error}): its peers go \
                 over its other rails, else over TCP; `python -m gixl doctor` shows the result",
                if t.provider.is_empty() { provider } else { &t.provider },
                if t.domain.is_empty() { "-" } else { &t.domain },
                step.name()
            ));
            Err(format!("self-test failed at {}", step.name()))
        }
    }
}

/// The GPU-memory self-test of `rail` for GPU `dev` handed over as `vram` says (see `selftest::run_vram_on`);
/// its INFO line, or, where GPU memory then goes by neither way on the rail, its WARN line (a failed dma-buf
/// way is followed by the interface way's own test, so it is said at INFO).
fn test_vram(
    agent: &str,
    rail: &Arc<Rail>,
    device: &'static dyn crate::device::Device,
    dev: u32,
    vram: Vram,
) -> Verdict {
    let (p, d) = (rail.dev.provider(), rail.dev.domain());
    let t = selftest::run_vram_on(rail.clone(), &p, &d, device, dev, vram, SELFTEST_LIMIT);
    match &t.outcome {
        selftest::Outcome::Passed { cost } => {
            crate::telemetry::log::info(&format!("agent '{agent}': libfabric GPU-memory self-test ({vram:?}) {t}"));
            Ok(cost.as_secs_f64() * 1e3)
        }
        selftest::Outcome::Failed { step, error, .. } if vram.dmabuf => {
            crate::telemetry::log::info(&format!(
                "agent '{agent}': libfabric rail {p}/{d} failed its GPU-memory self-test as dma-buf ({:?}, GPU \
                 {dev}) at step '{}' ({error}): GPU memory is registered by its interface instead where that \
                 way's own self-test passes",
                vram.hmem,
                step.name()
            ));
            Err(format!("self-test failed at {}", step.name()))
        }
        selftest::Outcome::Failed { step, error, .. } => {
            crate::telemetry::log::warn(&format!(
                "agent '{agent}': libfabric rail {p}/{d} failed its GPU-memory self-test (FI_HMEM, {:?}, GPU \
                 {dev}) at step '{}' ({error}): GPU memory on this rail is not registered, its libfabric peers' \
                 requests on it are staged through host memory over TCP; `python -m gixl doctor` shows the result",
                vram.hmem,
                step.name()
            ));
            Err(format!("GPU-memory self-test failed at {}", step.name()))
        }
    }
}

/// A rail's progress while any greeting connection on it is open (see the module's comment); ends when the
/// engine goes.
fn progress(rail: Arc<Rail>) {
    let p = rail.progress.clone();
    loop {
        {
            let mut n = p.active.lock();
            while *n == 0 && !p.stop.load(Ordering::Acquire) {
                p.cv.wait(&mut n);
            }
        }
        if p.stop.load(Ordering::Acquire) {
            return;
        }
        if p.waiters.load(Ordering::Acquire) > 0 {
            // The engine's own waiting threads read the queue (and so serve peers' operations too).
            std::thread::sleep(STAND_ASIDE);
            continue;
        }
        let t = Instant::now();
        if rail.pump().and_then(|_| fi::wait_up_to(&rail.fabric, &[&rail.cq], TARGET_SLEEP)).is_err() {
            std::thread::sleep(fi::SLICE);
            continue;
        }
        // Woken before its time: a peer's operation came, and its next one may follow within a round trip. Read
        // the queue without sleeping for up to `net::LOOK_NS`, yielding the core between reads (a sleeping
        // thread's wake-up costs most of a round trip on a VM), as the TCP route's serving loops do.
        if t.elapsed() < TARGET_SLEEP {
            let looked = Instant::now();
            while (looked.elapsed().as_nanos() as u64) < net::LOOK_NS && p.waiters.load(Ordering::Acquire) == 0 {
                if rail.pump().is_err() {
                    break;
                }
                std::thread::yield_now();
            }
        }
    }
}

/// A registration's memory regions, one per rail (by rail index), shared with requests while they run a piece
/// on it; and its keys and nearest rails as its ticket carries them.
pub(crate) struct Slot {
    /// By rail index; None on a rail that does not carry it (GPU memory, see `FabricSide::export`).
    pub(crate) mrs: Mutex<Option<Arc<Vec<Option<Mr>>>>>,
    pub(crate) keys: FabricKeys,
}

/// What the side exports for one registration (see `Side::export`).
pub(crate) struct FabricExport {
    pub(crate) slot: Arc<Slot>,
}

impl Export for FabricExport {
    fn put_sections(&self, out: &mut Vec<u8>) {
        self.slot.keys.put_sections(out);
    }
}

impl Side for FabricSide {
    fn section(&self) -> (u64, Vec<u8>) {
        let b = match self.opened() {
            Ok(rails) => wire::encode_section(&Advert {
                provider: rails[0].dev.provider(),
                rails: rails.iter().map(|r| RailAdvert { fabric: r.dev.fabric(), addr: r.addr.clone() }).collect(),
            }),
            Err(_) => Vec::new(),
        };
        (wire::SECTION, b)
    }

    /// Host memory: a memory region on every rail (an error fails the registration), and the rails nearest its
    /// first page's NUMA node. GPU memory: a memory region (`fi_mr_regattr` with its interface, see `hmem_of`)
    /// on each rail whose device offers `FI_HMEM` and passed its GPU-memory self-test (`vram_verdict`); its
    /// ticket names those rails, and libfabric peers' requests on it go directly over a path between rails
    /// that carry every region of the request, else are staged over their TCP link (`Fabric::vram`). One log
    /// line per GPU region says which.
    fn export(&self, r: &Registration) -> Result<Option<Box<dyn Export>>> {
        if (r.mem != MemType::Dram && r.mem != MemType::Vram) || r.len == 0 {
            return Ok(None);
        }
        let Ok(rails) = self.opened() else { return Ok(None) };
        let vram = r.mem == MemType::Vram;
        // GPU memory: the interface, and which rails carry it.
        let mut carried = u32::MAX;
        // Each carrying rail's way, and the device layer the memory is of.
        let mut ways: Vec<(usize, Vram)> = Vec::new();
        let mut gpu: Option<&'static dyn crate::device::Device> = None;
        let mut gpu_why: Vec<String> = Vec::new();
        if vram {
            let what = || format!("agent '{}': VRAM region {:#x}+{} on GPU {}", r.agent, r.addr, r.len, r.dev);
            let device = match crate::device::get() {
                Ok(d) => d,
                Err(e) => {
                    crate::telemetry::log::info(&format!("{}: staged for libfabric peers ({e})", what()));
                    return Ok(None);
                }
            };
            let h = hmem_of(device.kind(), r.dev as u32);
            let mut why = Vec::new();
            gpu = Some(device);
            carried = 0;
            for rail in rails.iter() {
                match self.vram_way(rail, device, r.dev as u32, h) {
                    Some(Ok(v)) => {
                        carried |= 1 << rail.index;
                        ways.push((rail.index, v));
                    }
                    Some(Err(e)) => why.push(format!("{}: {e}", rail.name())),
                    None => why.push(format!("{}: no FI_HMEM", rail.name())),
                }
            }
            if carried == 0 {
                crate::telemetry::log::info(&format!(
                    "{}: staged through host memory over TCP for libfabric peers (no rail carries GPU memory: {})",
                    what(),
                    why.join("; ")
                ));
                return Ok(None);
            }
            gpu_why = why;
        }
        let (mut mrs, mut keys) = (Vec::with_capacity(rails.len()), Vec::with_capacity(rails.len()));
        for rail in rails.iter() {
            if carried & (1 << rail.index) == 0 {
                // Not on this rail: a placeholder key the ticket's rail mask says not to use.
                keys.push(FabricKey { key: 0, base: 0 });
                mrs.push(None);
                continue;
            }
            let way = ways.iter().find(|(i, _)| *i == rail.index).map(|(_, v)| *v);
            let mr = match rail.register(r.addr, r.len, way.zip(gpu)) {
                Ok(mr) => mr,
                // GPU memory this rail's self-test passed for but this region does not register (one spanning
                // several allocations, say): staged on this rail rather than failing the registration.
                Err(e) if vram => {
                    crate::telemetry::log::info(&format!(
                        "agent '{}': VRAM region {:#x}+{}: not registered on libfabric rail {} ({e}): staged there",
                        r.agent,
                        r.addr,
                        r.len,
                        rail.name()
                    ));
                    carried &= !(1 << rail.index);
                    keys.push(FabricKey { key: 0, base: 0 });
                    mrs.push(None);
                    continue;
                }
                Err(e) => return Err(e),
            };
            let remote = mr.remote(r.addr as *const u8).ok_or_else(|| Error::backend("libfabric region's key"))?;
            keys.push(FabricKey { key: remote.key, base: r.addr - remote.addr });
            mrs.push(Some(mr));
        }
        if vram && carried == 0 {
            return Ok(None);
        }
        if vram {
            let on: Vec<String> = ways
                .iter()
                .filter(|(i, _)| carried & (1 << i) != 0)
                .filter_map(|(i, v)| {
                    rails.iter().find(|x| x.index == *i).map(|x| format!("{} ({:?}, {})", x.name(), v.hmem, v.name()))
                })
                .collect();
            crate::telemetry::log::info(&format!(
                "agent '{}': VRAM region {:#x}+{} on GPU {}: reached by libfabric directly (FI_HMEM) on rail(s) {}{}",
                r.agent,
                r.addr,
                r.len,
                r.dev,
                on.join(", "),
                if gpu_why.is_empty() { String::new() } else { format!(" (not on: {})", gpu_why.join("; ")) }
            ));
        }
        let place = if vram {
            let pci = crate::device::get().ok().and_then(|d| d.pci_path(r.dev as u32));
            pci.map_or(Place::Unknown, Place::Pci)
        } else {
            Place::host(r.addr)
        };
        let near = near::near(rails.iter().map(|r| (r.place.0, r.place.1.as_deref())), &place);
        let rails_mask = if vram { carried } else { 0 };
        let slot = Slot { mrs: Mutex::new(Some(Arc::new(mrs))), keys: FabricKeys { keys, near, rails: rails_mask } };
        Ok(Some(Box::new(FabricExport { slot: Arc::new(slot) })))
    }

    /// No new piece takes the region; pieces running on it finish first (bounded wait), then it is closed on
    /// every rail, so the providers refuse its keys; then every rail's greeted initiators are fenced, and those
    /// that read them are told its keys on that rail are closed (a closed-key notice on the greeting connection:
    /// they refuse their own pieces on those keys from then on, which a provider that drops an operation on a
    /// closed key without answering, shm, needs).
    fn retire(&self, e: &dyn Export) {
        let Some(e) = (e as &dyn std::any::Any).downcast_ref::<FabricExport>() else { return };
        let Some(mrs) = e.slot.mrs.lock().take() else { return };
        let t = Instant::now();
        while Arc::strong_count(&mrs) > 1 && t.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(1));
        }
        if Arc::strong_count(&mrs) > 1 {
            crate::telemetry::log::warn("libfabric: a region was deregistered while a piece still ran on it");
        }
        drop(mrs);
        // Peers' WRITEs the provider accepted before the region closed may still be placing bytes: fenced, on
        // every rail they may come over.
        let Some(Ok(rails)) = self.open.lock().clone() else { return };
        let deadline = Instant::now() + FENCE_LIMIT;
        let (mut late, mut all) = (0, 0);
        for rail in rails.iter() {
            let initiators: Vec<(u64, RemoteKey)> =
                self.initiators.lock().iter().filter(|g| g.rail == rail.index).map(|g| (g.peer, g.scratch)).collect();
            all += initiators.len();
            if !initiators.is_empty() {
                late += rail.fence(&initiators, deadline).err().unwrap_or(0);
            }
        }
        if late > 0 {
            crate::telemetry::log::warn(&format!(
                "libfabric: a deregistered region's fence was not answered by {late} of {all} initiator paths within \
                 {} ms (not progressing): a WRITE of theirs accepted before it closed may still land",
                FENCE_LIMIT.as_millis()
            ));
        }
        let keys = &e.slot.keys;
        for rail in rails.iter() {
            let carried = keys.rails == 0 || keys.rails & (1 << rail.index) != 0;
            let Some(k) = keys.keys.get(rail.index).filter(|_| carried) else { continue };
            let notice = wire::encode_closed(&[k.key]);
            self.initiators.lock().iter_mut().filter(|g| g.rail == rail.index).for_each(|g| g.tell(&notice));
        }
    }

    fn close(&self) {
        self.halt();
        for c in self.conns.lock().drain(..) {
            let _ = c.shutdown(Shutdown::Both);
        }
    }
}

impl Drop for FabricSide {
    fn drop(&mut self) {
        self.halt();
    }
}
