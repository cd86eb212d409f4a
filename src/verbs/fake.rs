//! A fake RDMA fabric that moves real bytes between processes, for tests without a NIC
//! (`GIXL_FAKE_VERBS=N`: devices `fake0`..`fake{N-1}`, one port each, N ≤ 8).
//!
//! Each process has one endpoint per device (its "NIC"): a Unix socket under `GIXL_FAKE_VERBS_DIR` (default
//! `$TMPDIR/gixl-fake-verbs-<uid>`, a path rather than an abstract name so that processes in different network
//! namespaces, the tests' "hosts", reach each other) named after the endpoint's GID, which is random per
//! process. Connecting a queue pair dials the peer endpoint's socket: that stream carries this pair's requests
//! and their answers, in order (an RC connection). The peer's endpoint serves it on a thread of its own, as
//! the NIC would: a READ or WRITE is checked against the memory regions of the peer pair's protection domain
//! (key, range, rights) at the moment it is served, under the domain's lock, so `dereg_mr` waits for accesses
//! under way and none succeeds after it returns; a SEND or WRITE with immediate waits for a posted receive
//! (receiver-not-ready retries forever, as `rnr_retry = 7`). On this side a pair has a sending thread (work
//! requests leave in order; a local list outside its key's regions fails with a local protection error) and a
//! reading thread (answers matched in order; READ data scattered into the local list). Threads block on their
//! sockets and queues: an idle fabric uses no CPU.
//!
//! Failures behave as on RC hardware: a refused remote access fails that request with `RemoteAccess` and
//! moves both pairs to the error state; a peer whose endpoint goes away (its process exits, or
//! [`fail_port`]) fails the oldest outstanding request with `RetryExceeded`; every other outstanding or later
//! request completes `Flushed`; a completion queue that overflows fails its next poll.
//!
//! `GIXL_FAKE_VERBS_NO_RMA=fake1,…` makes the listed devices answer every READ and WRITE served with
//! `RemoteOp`, as a NIC that cannot do one-sided operations would: the device self-test's failing case.
//!
//! Keys: a region's key is `index << 8 | variant` from a per-endpoint table that hands the lowest free index
//! out again, the variant byte advancing on each reuse as mlx5's does; `GIXL_FAKE_VERBS_REUSE_KEYS=1` keeps
//! the variant at 0, so a new region gets exactly the key value of the one deregistered before it: the case
//! the RDMA route's exactness must survive.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, RwLock};

use super::{
    Completion, Cq, Fabric, LinkLayer, Mr, Nic, Op, PortEvent, PortInfo, Qp, QpAddr, QpCaps, Sge, WcKind, WcStatus, Wr,
};
use super::{LOCAL_WRITE, REMOTE_READ, REMOTE_WRITE};
use crate::os::{eventfd, wake, woken};
use crate::status::{Error, Result, Status};

/// At most this many fake devices.
pub const MAX_DEVICES: u32 = 8;
/// How long a peer's endpoint waits for the pair a stream names to be connected to it.
const BIND_WAIT: Duration = Duration::from_secs(5);
/// Largest message one work request may move.
const MAX_MSG: u64 = 1 << 30;
const HELLO: &[u8; 4] = b"GXFV";

/// The fake fabric where `GIXL_FAKE_VERBS` asks for it (a device count, 1..=8); `None` where it is unset,
/// empty or 0.
pub fn from_env() -> Result<Option<Arc<dyn Fabric>>> {
    let n = match std::env::var("GIXL_FAKE_VERBS") {
        Err(_) => return Ok(None),
        Ok(v) if v.trim().is_empty() || v.trim() == "0" => return Ok(None),
        Ok(v) => v.trim().parse::<u32>().ok().filter(|n| (1..=MAX_DEVICES).contains(n)).ok_or_else(|| {
            Error::invalid_param(format!("GIXL_FAKE_VERBS={v:?}: a number of fake devices, 1 to {MAX_DEVICES}"))
        })?,
    };
    let dir = match std::env::var_os("GIXL_FAKE_VERBS_DIR") {
        Some(d) if !d.is_empty() => PathBuf::from(d),
        // SAFETY: getuid cannot fail.
        _ => std::env::temp_dir().join(format!("gixl-fake-verbs-{}", unsafe { libc::getuid() })),
    };
    let reuse = std::env::var("GIXL_FAKE_VERBS_REUSE_KEYS").is_ok_and(|v| v.trim() == "1");
    let no_rma = std::env::var("GIXL_FAKE_VERBS_NO_RMA").unwrap_or_default();
    let no_rma = no_rma.split(',').filter_map(|d| d.trim().strip_prefix("fake")?.parse().ok()).collect();
    Ok(Some(Arc::new(FakeFabric::new(n, dir, reuse).without_rma(no_rma))))
}

/// `devices` fake devices whose endpoints live under `dir`.
pub struct FakeFabric {
    devices: u32,
    dir: PathBuf,
    reuse_keys: bool,
    /// Devices whose endpoints fail every READ and WRITE they serve.
    no_rma: Vec<u32>,
}

impl FakeFabric {
    pub fn new(devices: u32, dir: PathBuf, reuse_keys: bool) -> FakeFabric {
        FakeFabric { devices: devices.min(MAX_DEVICES), dir, reuse_keys, no_rma: Vec::new() }
    }

    /// The devices `devs` (by number) answer every READ and WRITE they serve with `RemoteOp`.
    pub fn without_rma(mut self, devs: Vec<u32>) -> FakeFabric {
        self.no_rma = devs;
        self
    }

    fn endpoint(&self, dev: u32) -> Result<Arc<Endpoint>> {
        let mut all = endpoints().lock();
        let key = (self.dir.clone(), dev);
        if let Some(ep) = all.get(&key).and_then(Weak::upgrade) {
            return Ok(ep);
        }
        let ep = Endpoint::start(&self.dir, dev, self.reuse_keys, self.no_rma.contains(&dev))?;
        all.insert(key, Arc::downgrade(&ep));
        Ok(ep)
    }
}

/// This process's endpoints by directory and device.
type Endpoints = Mutex<HashMap<(PathBuf, u32), Weak<Endpoint>>>;

fn endpoints() -> &'static Endpoints {
    static E: OnceLock<Endpoints> = OnceLock::new();
    E.get_or_init(Default::default)
}

/// Endpoints (by GID) whose port this process took down (`fail_port`).
fn failed_ports() -> &'static Mutex<BTreeSet<[u8; 16]>> {
    static F: OnceLock<Mutex<BTreeSet<[u8; 16]>>> = OnceLock::new();
    F.get_or_init(Default::default)
}

/// Take a port of this process down, as a cable pulled: the requests outstanding on its pairs fail
/// `RetryExceeded` (later ones are flushed), new connections to or from it fail, and `ports` reports it
/// inactive.
pub fn fail_port(port: &PortInfo) {
    failed_ports().lock().insert(port.gid);
    let eps: Vec<Arc<Endpoint>> = endpoints().lock().values().filter_map(Weak::upgrade).collect();
    for ep in eps.iter().filter(|e| e.gid == port.gid) {
        // Every NIC opened on it says so (an async event), as a real one does when its link goes.
        ep.nics.lock().retain(|n| n.upgrade().map(|n| n.push(PortEvent::Down)).is_some());
        let qps: Vec<Arc<QpInner>> = ep.qps.lock().values().filter_map(Weak::upgrade).collect();
        for q in qps {
            q.fail(WcStatus::RetryExceeded);
        }
    }
}

fn port_failed(gid: &[u8; 16]) -> bool {
    failed_ports().lock().contains(gid)
}

fn gid_hex(gid: &[u8; 16]) -> String {
    gid.iter().map(|b| format!("{b:02x}")).collect()
}

impl Fabric for FakeFabric {
    fn name(&self) -> &'static str {
        "fake"
    }

    fn ports(&self) -> Result<Vec<PortInfo>> {
        (0..self.devices)
            .map(|d| {
                let ep = self.endpoint(d)?;
                Ok(ep.port_info())
            })
            .collect()
    }

    fn open(&self, device: &str, port: u8) -> Result<Arc<dyn Nic>> {
        let dev = device
            .strip_prefix("fake")
            .and_then(|n| n.parse::<u32>().ok())
            .filter(|&d| d < self.devices && port == 1)
            .ok_or_else(|| Error::not_found(format!("no RDMA port {device}:{port} on the fake fabric")))?;
        let ep = self.endpoint(dev)?;
        let port = ep.port_info();
        let events = Arc::new(NicEvents { fd: eventfd(false)?, q: Mutex::default() });
        ep.nics.lock().push(Arc::downgrade(&events));
        Ok(Arc::new(FakeNic { ep, port, pd: Arc::new(Pd::default()), events }))
    }
}

/// This process's live endpoints for `device`.
fn endpoints_of(device: &str) -> Vec<Arc<Endpoint>> {
    endpoints().lock().values().filter_map(Weak::upgrade).filter(|e| e.name == device).collect()
}

/// READ and WRITE requests this process's endpoint for `device` served (its NIC's work as a target), for tests.
pub fn served(device: &str) -> u64 {
    endpoints_of(device).iter().map(|e| e.served.load(Ordering::Relaxed)).sum()
}

/// Queue pairs alive on this process's endpoint for `device`, for tests.
pub fn live_qps(device: &str) -> usize {
    endpoints_of(device).iter().map(|e| e.qps.lock().values().filter(|q| q.strong_count() > 0).count()).sum()
}

/// One process's fake NIC for one device: its socket, its key table and its queue pairs.
struct Endpoint {
    name: String,
    dev: u32,
    /// READ and WRITE requests served (see [`served`]).
    served: AtomicU64,
    /// The event queues of the NICs opened on it.
    nics: Mutex<Vec<Weak<NicEvents>>>,
    gid: [u8; 16],
    path: PathBuf,
    reuse_keys: bool,
    /// Every READ and WRITE served fails (`GIXL_FAKE_VERBS_NO_RMA`).
    no_rma: bool,
    keys: Mutex<Keys>,
    qps: Mutex<HashMap<u32, Weak<QpInner>>>,
    next_qpn: AtomicU32,
    closed: AtomicBool,
}

impl Endpoint {
    fn start(dir: &Path, dev: u32, reuse_keys: bool, no_rma: bool) -> Result<Arc<Endpoint>> {
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::backend(format!("fake verbs: cannot create {}: {e}", dir.display())))?;
        let r = crate::util::random_u128().to_le_bytes();
        let mut gid = [0u8; 16];
        gid[..4].copy_from_slice(b"gxfv");
        gid[4..8].copy_from_slice(&dev.to_le_bytes());
        gid[8..].copy_from_slice(&r[..8]);
        let path = dir.join(format!("{}.sock", gid_hex(&gid)));
        let listener = UnixListener::bind(&path)
            .map_err(|e| Error::backend(format!("fake verbs: cannot listen on {}: {e}", path.display())))?;
        let ep = Arc::new(Endpoint {
            name: format!("fake{dev}"),
            dev,
            served: AtomicU64::new(0),
            nics: Mutex::default(),
            gid,
            path,
            reuse_keys,
            no_rma,
            keys: Mutex::new(Keys::default()),
            qps: Mutex::new(HashMap::new()),
            next_qpn: AtomicU32::new(0x100),
            closed: AtomicBool::new(false),
        });
        let weak = Arc::downgrade(&ep);
        std::thread::Builder::new()
            .name("gixl-fakeverbs".into())
            .spawn(move || accept_loop(listener, weak))
            .map_err(|e| Error::backend(format!("fake verbs: cannot start a thread: {e}")))?;
        Ok(ep)
    }

    fn port_info(&self) -> PortInfo {
        PortInfo {
            device: self.name.clone(),
            port: 1,
            link: LinkLayer::Ethernet,
            active: !port_failed(&self.gid),
            lid: 0,
            gid: self.gid,
            numa: crate::util::env_list_entry("GIXL_FAKE_VERBS_NUMA", self.dev).and_then(|n| n.parse().ok()),
            pci: crate::util::env_list_entry("GIXL_FAKE_VERBS_PCI", self.dev),
        }
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.closed.store(true, Ordering::Release);
        // Wake the accept loop so that it sees the endpoint gone, then take the name away.
        let _ = UnixStream::connect(&self.path);
        let _ = std::fs::remove_file(&self.path);
    }
}

fn accept_loop(listener: UnixListener, ep: Weak<Endpoint>) {
    for s in listener.incoming() {
        let Some(e) = ep.upgrade() else { return };
        if e.closed.load(Ordering::Acquire) {
            return;
        }
        let Ok(s) = s else { continue };
        if port_failed(&e.gid) {
            continue;
        }
        drop(e);
        let ep = ep.clone();
        let _ = std::thread::Builder::new().name("gixl-fakeverbs".into()).spawn(move || respond(s, ep));
    }
}

/// Key indices: the lowest free one is handed out again.
#[derive(Default)]
struct Keys {
    variants: Vec<u8>,
    free: BTreeSet<u32>,
}

impl Keys {
    fn take(&mut self, reuse: bool) -> u32 {
        let i = match self.free.pop_first() {
            Some(i) => i,
            None => {
                self.variants.push(0);
                self.variants.len() as u32 - 1
            }
        };
        if !reuse {
            self.variants[i as usize] = self.variants[i as usize].wrapping_add(1);
        }
        ((i + 1) << 8) | u32::from(self.variants[i as usize])
    }

    fn give(&mut self, key: u32) {
        self.free.insert((key >> 8) - 1);
    }
}

struct Region {
    addr: u64,
    len: u64,
    access: u32,
    /// Where `addr` is in this process: `addr` itself, or inside a dma-buf's mapping (`map`).
    host: u64,
    _map: Option<Mapped>,
}

/// A dma-buf mapped by the fake NIC (as a NIC maps the device pages it was given); unmapped with its region.
struct Mapped {
    ptr: u64,
    len: usize,
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: our own mapping, unmapped once, after its region left the domain (under its write lock).
        unsafe { libc::munmap(self.ptr as usize as *mut libc::c_void, self.len) };
    }
}

/// A protection domain: its regions by key (local and remote keys are the same value here).
#[derive(Default)]
struct Pd {
    regions: RwLock<HashMap<u32, Region>>,
}

impl Pd {
    /// Run `f` on `[addr, addr + len)` if `key` covers it with `rights`, holding the domain's lock; `f` gets
    /// where `addr` is in this process.
    fn with<T>(&self, key: u32, addr: u64, len: u64, rights: u32, f: impl FnOnce(u64) -> T) -> Option<T> {
        let regions = self.regions.read();
        let r = regions.get(&key)?;
        let end = addr.checked_add(len)?;
        (addr >= r.addr && end <= r.addr + r.len && r.access & rights == rights).then(|| f(r.host + (addr - r.addr)))
    }

    /// Gather a local list into one buffer.
    fn gather(&self, sges: &[Sge]) -> Option<Vec<u8>> {
        let mut out = Vec::with_capacity(sges.iter().map(|s| s.len as usize).sum());
        for s in sges {
            self.with(s.lkey, s.addr, u64::from(s.len), 0, |h| {
                // SAFETY: the range lies inside a region registered in this domain, which its owner keeps mapped
                // while it is registered, and deregistration waits for this lock.
                out.extend_from_slice(unsafe { std::slice::from_raw_parts(h as *const u8, s.len as usize) })
            })?;
        }
        Some(out)
    }

    /// Scatter `data` into a local list (which must hold all of it).
    fn scatter(&self, sges: &[Sge], mut data: &[u8]) -> Option<()> {
        for s in sges {
            let n = data.len().min(s.len as usize);
            self.with(s.lkey, s.addr, n as u64, LOCAL_WRITE, |h| {
                // SAFETY: as in `gather`; the region was registered writable.
                unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), h as *mut u8, n) }
            })?;
            data = &data[n..];
        }
        data.is_empty().then_some(())
    }
}

struct FakeNic {
    ep: Arc<Endpoint>,
    port: PortInfo,
    pd: Arc<Pd>,
    events: Arc<NicEvents>,
}

/// What a fake NIC reports on its own (`Nic::port_event`): its port's changes, readable on an eventfd.
struct NicEvents {
    fd: OwnedFd,
    q: Mutex<VecDeque<PortEvent>>,
}

impl NicEvents {
    fn push(&self, e: PortEvent) {
        self.q.lock().push_back(e);
        wake(&self.fd);
    }
}

impl FakeNic {
    /// Enter `r` in the domain under a fresh key.
    fn insert(&self, r: Region) -> Mr {
        let key = self.ep.keys.lock().take(self.ep.reuse_keys);
        let (addr, len) = (r.addr, r.len);
        self.pd.regions.write().insert(key, r);
        Mr { addr, len, lkey: key, rkey: key, id: u64::from(key) }
    }
}

impl Nic for FakeNic {
    fn port(&self) -> &PortInfo {
        &self.port
    }

    fn event_fd(&self) -> RawFd {
        self.events.fd.as_raw_fd()
    }

    fn port_event(&self) -> Result<Option<PortEvent>> {
        let mut q = self.events.q.lock();
        if q.len() <= 1 {
            woken(&self.events.fd);
        }
        Ok(q.pop_front())
    }

    fn reg_mr(&self, addr: u64, len: u64, access: u32) -> Result<Mr> {
        if addr == 0 || len == 0 || addr.checked_add(len).is_none() {
            return Err(Error::invalid_param(format!("cannot register {len} bytes at {addr:#x}")));
        }
        // Device memory needs the GPU vendor's peer-memory module, which `GIXL_FAKE_VERBS_PEERMEM=1` says is
        // loaded (as `ibv_reg_mr` on a device pointer fails with EFAULT without it).
        if crate::device::fake::is_device_memory(addr, len)
            && !std::env::var("GIXL_FAKE_VERBS_PEERMEM").is_ok_and(|v| v.trim() == "1")
        {
            return Err(Error::os(
                Status::Backend,
                format!("fake NIC: ibv_reg_mr of {len} bytes of device memory at {addr:#x} (no peer-memory module)"),
                std::io::Error::from_raw_os_error(libc::EFAULT),
            ));
        }
        Ok(self.insert(Region { addr, len, access, host: addr, _map: None }))
    }

    fn reg_dmabuf_mr(&self, fd: BorrowedFd<'_>, offset: u64, len: u64, iova: u64, access: u32) -> Result<Mr> {
        if iova == 0 || len == 0 || iova.checked_add(len).is_none() || offset.checked_add(len).is_none() {
            return Err(Error::invalid_param(format!("cannot register {len} bytes at iova {iova:#x}")));
        }
        // Map the buffer's pages as the NIC's driver would pin them: from the page holding `offset`.
        let lo = offset & !4095;
        let span = (offset - lo + len) as usize;
        // SAFETY: mapping a descriptor the caller holds for the call; the mapping keeps the memory alive.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                span,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                lo as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Error::os(Status::Backend, "fake NIC: mapping a dma-buf", std::io::Error::last_os_error()));
        }
        let map = Mapped { ptr: p as u64, len: span };
        Ok(self.insert(Region { addr: iova, len, access, host: p as u64 + (offset - lo), _map: Some(map) }))
    }

    fn dereg_mr(&self, mr: &Mr) -> Result<()> {
        if self.pd.regions.write().remove(&mr.rkey).is_none() {
            return Err(Error::not_found(format!("no memory region with key {:#x}", mr.rkey)));
        }
        self.ep.keys.lock().give(mr.rkey);
        Ok(())
    }

    fn create_cq(&self, depth: u32) -> Result<Arc<dyn Cq>> {
        Ok(Arc::new(FakeCq {
            q: Mutex::new(VecDeque::new()),
            depth: depth.max(1) as usize,
            armed: AtomicBool::new(false),
            overrun: AtomicBool::new(false),
            efd: eventfd(false)?,
        }))
    }

    fn create_qp(&self, send_cq: &Arc<dyn Cq>, recv_cq: &Arc<dyn Cq>, caps: QpCaps) -> Result<Arc<dyn Qp>> {
        let cq = |c: &Arc<dyn Cq>| c.clone().as_any().downcast::<FakeCq>().ok();
        // The fabric's own queues only: a pair cannot complete into another implementation's.
        let (Some(scq), Some(rcq)) = (cq(send_cq), cq(recv_cq)) else {
            return Err(Error::invalid_param("a completion queue of another fabric"));
        };
        let qpn = self.ep.next_qpn.fetch_add(1, Ordering::Relaxed);
        let inner = Arc::new(QpInner {
            ep: self.ep.clone(),
            pd: self.pd.clone(),
            qpn,
            psn: (crate::util::random_u128() as u32) & 0xff_ffff,
            caps,
            scq,
            rcq,
            st: Mutex::new(QpState::default()),
            cv: Condvar::new(),
        });
        self.ep.qps.lock().insert(qpn, Arc::downgrade(&inner));
        Ok(Arc::new(FakeQp(inner)))
    }
}

struct FakeCq {
    q: Mutex<VecDeque<Completion>>,
    depth: usize,
    armed: AtomicBool,
    overrun: AtomicBool,
    efd: OwnedFd,
}

impl FakeCq {
    fn push(&self, c: Completion) {
        {
            let mut q = self.q.lock();
            if q.len() >= self.depth {
                self.overrun.store(true, Ordering::Release);
            } else {
                q.push_back(c);
            }
        }
        if self.armed.swap(false, Ordering::AcqRel) {
            wake(&self.efd);
        }
    }
}

impl Cq for FakeCq {
    fn as_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync> {
        self
    }

    fn event_fd(&self) -> RawFd {
        self.efd.as_raw_fd()
    }

    fn arm(&self) -> Result<()> {
        self.armed.store(true, Ordering::Release);
        Ok(())
    }

    fn take_event(&self) -> Result<bool> {
        let mut v = 0u64;
        // SAFETY: reading 8 bytes into a u64 from a non-blocking eventfd.
        let n = unsafe { libc::read(self.efd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
        Ok(n == 8)
    }

    fn poll(&self, out: &mut Vec<Completion>, max: usize) -> Result<usize> {
        if self.overrun.load(Ordering::Acquire) {
            return Err(Error::backend("completion queue overrun"));
        }
        let mut q = self.q.lock();
        let n = q.len().min(max);
        out.extend(q.drain(..n));
        Ok(n)
    }
}

/// A work request as queued (its list owned).
struct Queued {
    id: u64,
    op: Op,
    sges: Vec<Sge>,
    signaled: bool,
}

impl Queued {
    fn kind(&self) -> WcKind {
        match self.op {
            Op::Read { .. } => WcKind::Read,
            Op::Write { .. } | Op::WriteImm { .. } => WcKind::Write,
            Op::Send { .. } => WcKind::Send,
        }
    }

    fn len(&self) -> u64 {
        self.sges.iter().map(|s| u64::from(s.len)).sum()
    }
}

#[derive(Default)]
enum Phase {
    #[default]
    Reset,
    Connected(QpAddr),
    Error,
    Destroyed,
}

#[derive(Default)]
struct QpState {
    phase: Phase,
    /// Posted, not yet sent.
    sq: VecDeque<Queued>,
    /// Sent, answer not yet read (in order).
    sent: VecDeque<Queued>,
    /// The reading thread holds an answered request whose completion it has not yet queued.
    answering: bool,
    recvs: VecDeque<(u64, Sge)>,
    /// This pair's outgoing stream (its requests).
    out: Option<UnixStream>,
    /// Streams peers opened to this pair (their requests).
    incoming: Vec<UnixStream>,
}

struct QpInner {
    ep: Arc<Endpoint>,
    pd: Arc<Pd>,
    qpn: u32,
    psn: u32,
    caps: QpCaps,
    scq: Arc<FakeCq>,
    rcq: Arc<FakeCq>,
    st: Mutex<QpState>,
    cv: Condvar,
}

impl QpInner {
    /// Move to the error state: the oldest sent request completes with `first`, everything else posted
    /// (sent or not) and every posted receive as flushed. Streams are cut.
    fn fail(&self, first: WcStatus) {
        let (sent, recvs) = {
            let mut guard = self.st.lock();
            let st = &mut *guard;
            if matches!(st.phase, Phase::Error | Phase::Destroyed) {
                return;
            }
            st.phase = Phase::Error;
            for s in st.out.iter().chain(&st.incoming) {
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
            let sent: Vec<Queued> = st.sent.drain(..).chain(st.sq.drain(..)).collect();
            (sent, st.recvs.drain(..).collect::<Vec<_>>())
        };
        self.cv.notify_all();
        let mut status = first;
        for q in sent {
            self.scq.push(Completion { id: q.id, status, kind: q.kind(), len: 0, imm: None });
            status = WcStatus::Flushed;
        }
        for (id, _) in recvs {
            self.rcq.push(Completion { id, status: WcStatus::Flushed, kind: WcKind::Recv, len: 0, imm: None });
        }
    }

    /// `q` failed here before leaving: the requests sent before it complete first (as on hardware, in order),
    /// then it fails with `status` and the pair goes to the error state.
    fn fail_after_sent(&self, q: Queued, status: WcStatus) {
        let mut st = self.st.lock();
        while (!st.sent.is_empty() || st.answering) && matches!(st.phase, Phase::Connected(_)) {
            self.cv.wait(&mut st);
        }
        st.sent.push_front(q);
        drop(st);
        self.fail(status);
    }

    fn send_loop(self: Arc<Self>, mut out: UnixStream) {
        loop {
            let q = {
                let mut st = self.st.lock();
                loop {
                    if !matches!(st.phase, Phase::Connected(_)) {
                        return;
                    }
                    if let Some(q) = st.sq.pop_front() {
                        break q;
                    }
                    self.cv.wait(&mut st);
                }
            };
            let mut frame = Vec::with_capacity(32);
            let data = match q.op {
                Op::Read { .. } => None,
                _ => match self.pd.gather(&q.sges) {
                    Some(d) => Some(d),
                    None => return self.fail_after_sent(q, WcStatus::LocalProtection),
                },
            };
            // Reads scatter into the local list later: check now that it is writable memory of this domain.
            if matches!(q.op, Op::Read { .. })
                && !q.sges.iter().all(|s| self.pd.with(s.lkey, s.addr, u64::from(s.len), LOCAL_WRITE, |_| ()).is_some())
            {
                return self.fail_after_sent(q, WcStatus::LocalProtection);
            }
            match q.op {
                Op::Read { raddr, rkey } => encode(&mut frame, 1, raddr, rkey, q.len(), None),
                Op::Write { raddr, rkey } => encode(&mut frame, 2, raddr, rkey, q.len(), None),
                Op::WriteImm { raddr, rkey, imm } => encode(&mut frame, 2, raddr, rkey, q.len(), Some(imm)),
                Op::Send { imm } => encode(&mut frame, 3, 0, 0, q.len(), imm),
            }
            {
                let mut st = self.st.lock();
                if !matches!(st.phase, Phase::Connected(_)) {
                    drop(st);
                    // The pair failed while this request was between its queue and the wire, where `fail` does
                    // not see it: it is flushed as every other one (a request never goes without a completion).
                    let wc = Completion { id: q.id, status: WcStatus::Flushed, kind: q.kind(), len: 0, imm: None };
                    return self.scq.push(wc);
                }
                st.sent.push_back(q);
            }
            let ok = out.write_all(&frame).is_ok() && data.is_none_or(|d| out.write_all(&d).is_ok());
            if !ok {
                return self.fail(WcStatus::RetryExceeded);
            }
        }
    }

    fn read_loop(self: Arc<Self>, mut inp: UnixStream) {
        loop {
            let mut h = [0u8; 5];
            if inp.read_exact(&mut h).is_err() {
                return self.fail(WcStatus::RetryExceeded);
            }
            let status = h[0];
            let n = u32::from_le_bytes([h[1], h[2], h[3], h[4]]) as usize;
            if n as u64 > MAX_MSG {
                return self.fail(WcStatus::RemoteOp);
            }
            let mut data = vec![0u8; n];
            if inp.read_exact(&mut data).is_err() {
                return self.fail(WcStatus::RetryExceeded);
            }
            let popped = {
                let mut st = self.st.lock();
                st.answering = true;
                st.sent.pop_front()
            };
            let Some(q) = popped else {
                return self.fail(WcStatus::RemoteOp);
            };
            let mut wc = Completion { id: q.id, status: WcStatus::Success, kind: q.kind(), len: 0, imm: None };
            wc.status = match status {
                0 if matches!(q.op, Op::Read { .. }) && self.pd.scatter(&q.sges, &data).is_none() => {
                    WcStatus::LocalProtection
                }
                0 => WcStatus::Success,
                s => WcStatus::from_ibv(u32::from(s)),
            };
            if wc.status != WcStatus::Success {
                let mut st = self.st.lock();
                st.answering = false;
                st.sent.push_front(q);
                drop(st);
                return self.fail(wc.status);
            }
            if q.signaled {
                self.scq.push(wc);
            }
            // `fail_after_sent` may be waiting for the answers to drain.
            self.st.lock().answering = false;
            self.cv.notify_all();
        }
    }
}

/// Request frame: `kind u8 | addr u64 | key u32 | len u64 | has_imm u8 | imm u32` (then `len` bytes for WRITE
/// and SEND). Answer: `status u8 | len u32 | bytes` (READ data).
fn encode(out: &mut Vec<u8>, kind: u8, addr: u64, key: u32, len: u64, imm: Option<u32>) {
    out.push(kind);
    out.extend_from_slice(&addr.to_le_bytes());
    out.extend_from_slice(&key.to_le_bytes());
    out.extend_from_slice(&len.to_le_bytes());
    out.push(u8::from(imm.is_some()));
    out.extend_from_slice(&imm.unwrap_or(0).to_le_bytes());
}

const REQ_LEN: usize = 1 + 8 + 4 + 8 + 1 + 4;

fn answer(s: &mut UnixStream, status: u8, data: &[u8]) -> bool {
    let mut h = [0u8; 5];
    h[0] = status;
    h[1..].copy_from_slice(&(data.len() as u32).to_le_bytes());
    s.write_all(&h).is_ok() && s.write_all(data).is_ok()
}

/// rdma-core's numbers for what the responder answers.
const ST_REM_INV_REQ: u8 = 9;
const ST_REM_ACCESS: u8 = 10;
const ST_REM_OP: u8 = 11;

/// One more request served by `ep`.
fn count(ep: &Weak<Endpoint>) {
    if let Some(e) = ep.upgrade() {
        e.served.fetch_add(1, Ordering::Relaxed);
    }
}

/// Serve one peer pair's stream to one of our pairs, as the NIC would.
fn respond(mut s: UnixStream, ep: Weak<Endpoint>) {
    let _ = s.set_read_timeout(Some(BIND_WAIT));
    let mut hello = [0u8; 4 + 16 + 4 + 4];
    if s.read_exact(&mut hello).is_err() || &hello[..4] != HELLO {
        return;
    }
    let _ = s.set_read_timeout(None);
    let from_gid: [u8; 16] = hello[4..20].try_into().unwrap_or_default();
    let from_qpn = u32::from_le_bytes(hello[20..24].try_into().unwrap_or_default());
    let to_qpn = u32::from_le_bytes(hello[24..28].try_into().unwrap_or_default());
    let Some(qp) = ep.upgrade().and_then(|e| e.qps.lock().get(&to_qpn).and_then(Weak::upgrade)) else { return };
    let no_rma = ep.upgrade().is_some_and(|e| e.no_rma);
    // Wait until our pair is connected to that one (both sides connect at about the same time).
    {
        let deadline = Instant::now() + BIND_WAIT;
        let mut st = qp.st.lock();
        loop {
            match st.phase {
                Phase::Connected(r) if r.gid == from_gid && r.qpn == from_qpn => break,
                Phase::Reset if Instant::now() < deadline => {
                    qp.cv.wait_until(&mut st, deadline);
                }
                _ => return,
            }
        }
        if let Ok(c) = s.try_clone() {
            st.incoming.push(c);
        }
    }
    let mut req = [0u8; REQ_LEN];
    while s.read_exact(&mut req).is_ok() {
        let kind = req[0];
        let addr = u64::from_le_bytes(req[1..9].try_into().unwrap_or_default());
        let key = u32::from_le_bytes(req[9..13].try_into().unwrap_or_default());
        let len = u64::from_le_bytes(req[13..21].try_into().unwrap_or_default());
        let imm = (req[21] == 1).then(|| u32::from_le_bytes(req[22..26].try_into().unwrap_or_default()));
        if len > MAX_MSG {
            answer(&mut s, ST_REM_INV_REQ, &[]);
            return qp.fail(WcStatus::Flushed);
        }
        let mut data = Vec::new();
        if kind != 1 {
            data = vec![0u8; len as usize];
            if s.read_exact(&mut data).is_err() {
                return;
            }
        }
        let status = match kind {
            1 | 2 if no_rma => ST_REM_OP,
            1 => {
                let mut out = vec![0u8; len as usize];
                let ok = qp.pd.with(key, addr, len, REMOTE_READ, |h| {
                    // SAFETY: inside a region of this domain registered for remote reads, held by the lock.
                    unsafe { std::ptr::copy_nonoverlapping(h as *const u8, out.as_mut_ptr(), len as usize) }
                });
                if ok.is_some() {
                    count(&ep);
                    if !answer(&mut s, 0, &out) {
                        return;
                    }
                    continue;
                }
                ST_REM_ACCESS
            }
            2 => {
                let ok = qp.pd.with(key, addr, len, REMOTE_WRITE, |h| {
                    // SAFETY: inside a region of this domain registered for remote writes, held by the lock.
                    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), h as *mut u8, len as usize) }
                });
                if ok.is_some() {
                    count(&ep);
                }
                match (ok, imm) {
                    (None, _) => ST_REM_ACCESS,
                    (Some(()), None) => 0,
                    (Some(()), Some(imm)) => receive(&qp, WcKind::RecvImm, &[], Some(imm), len),
                }
            }
            3 => receive(&qp, WcKind::Recv, &data, imm, len),
            _ => ST_REM_INV_REQ,
        };
        if !answer(&mut s, status, &[]) || status != 0 {
            if status != 0 {
                qp.fail(WcStatus::Flushed);
            }
            return;
        }
    }
}

/// Take one posted receive for a SEND (`data`) or a WRITE with immediate (`data` empty, `len` written);
/// waits while none is posted. The rdma-core status to answer.
fn receive(qp: &QpInner, kind: WcKind, data: &[u8], imm: Option<u32>, len: u64) -> u8 {
    let (id, sge) = {
        let mut st = qp.st.lock();
        loop {
            if !matches!(st.phase, Phase::Connected(_)) {
                return ST_REM_OP;
            }
            if let Some(r) = st.recvs.pop_front() {
                break r;
            }
            qp.cv.wait(&mut st);
        }
    };
    if !data.is_empty() && (data.len() > sge.len as usize || qp.pd.scatter(&[sge], data).is_none()) {
        qp.rcq.push(Completion { id, status: WcStatus::LocalProtection, kind, len: 0, imm });
        return ST_REM_INV_REQ;
    }
    qp.rcq.push(Completion { id, status: WcStatus::Success, kind, len: len as u32, imm });
    0
}

struct FakeQp(Arc<QpInner>);

impl Drop for FakeQp {
    fn drop(&mut self) {
        let q = &self.0;
        q.ep.qps.lock().remove(&q.qpn);
        let mut st = q.st.lock();
        st.phase = Phase::Destroyed;
        for s in st.out.iter().chain(&st.incoming) {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        q.cv.notify_all();
    }
}

impl Qp for FakeQp {
    fn addr(&self) -> QpAddr {
        QpAddr { gid: self.0.ep.gid, lid: 0, qpn: self.0.qpn, psn: self.0.psn }
    }

    fn connect(&self, remote: &QpAddr) -> Result<()> {
        let q = &self.0;
        if !matches!(q.st.lock().phase, Phase::Reset) {
            return Err(Error::invalid_param("queue pair already connected"));
        }
        if port_failed(&q.ep.gid) {
            return Err(Error::disconnected(format!("port {}:1 is down", q.ep.name)));
        }
        let dir = q.ep.path.parent().unwrap_or(Path::new("/"));
        let path = dir.join(format!("{}.sock", gid_hex(&remote.gid)));
        let mut out = UnixStream::connect(&path).map_err(|e| {
            Error::disconnected(format!("fake verbs: no endpoint with GID {}: {e}", gid_hex(&remote.gid)))
        })?;
        let mut hello = Vec::with_capacity(28);
        hello.extend_from_slice(HELLO);
        hello.extend_from_slice(&q.ep.gid);
        hello.extend_from_slice(&q.qpn.to_le_bytes());
        hello.extend_from_slice(&remote.qpn.to_le_bytes());
        out.write_all(&hello).map_err(|e| Error::disconnected(format!("fake verbs: {e}")))?;
        let inp = out.try_clone().map_err(|e| Error::backend(format!("fake verbs: {e}")))?;
        {
            let mut st = q.st.lock();
            if !matches!(st.phase, Phase::Reset) {
                return Err(Error::invalid_param("queue pair already connected"));
            }
            st.phase = Phase::Connected(*remote);
            st.out = out.try_clone().ok();
            q.cv.notify_all();
        }
        let (a, b) = (q.clone(), q.clone());
        let spawn = |name: &str, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name.into())
                .spawn(f)
                .map_err(|e| Error::backend(format!("fake verbs: cannot start a thread: {e}")))
        };
        spawn("gixl-fakeverbs", Box::new(move || a.send_loop(out)))?;
        spawn("gixl-fakeverbs", Box::new(move || b.read_loop(inp)))?;
        Ok(())
    }

    fn post_send(&self, wrs: &[Wr]) -> Result<()> {
        let q = &self.0;
        let mut st = q.st.lock();
        if matches!(st.phase, Phase::Reset | Phase::Destroyed) {
            return Err(Error::invalid_param("queue pair not connected"));
        }
        if st.sq.len() + st.sent.len() + wrs.len() > q.caps.send_wr as usize {
            return Err(Error::backend("send queue full"));
        }
        for w in wrs {
            if w.sges.len() > q.caps.sge as usize {
                return Err(Error::invalid_param(format!(
                    "{} scatter/gather entries, at most {}",
                    w.sges.len(),
                    q.caps.sge
                )));
            }
        }
        let flushed = matches!(st.phase, Phase::Error);
        for w in wrs {
            let queued = Queued { id: w.id, op: w.op, sges: w.sges.to_vec(), signaled: w.signaled };
            if flushed {
                q.scq.push(Completion { id: w.id, status: WcStatus::Flushed, kind: queued.kind(), len: 0, imm: None });
            } else {
                st.sq.push_back(queued);
            }
        }
        q.cv.notify_all();
        Ok(())
    }

    fn post_recv(&self, id: u64, sge: Sge) -> Result<()> {
        let q = &self.0;
        let mut st = q.st.lock();
        if st.recvs.len() >= q.caps.recv_wr as usize {
            return Err(Error::backend("receive queue full"));
        }
        if matches!(st.phase, Phase::Error) {
            q.rcq.push(Completion { id, status: WcStatus::Flushed, kind: WcKind::Recv, len: 0, imm: None });
            return Ok(());
        }
        st.recvs.push_back((id, sge));
        q.cv.notify_all();
        Ok(())
    }

    fn set_error(&self) {
        self.0.fail(WcStatus::Flushed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CAPS: QpCaps = QpCaps { send_wr: 64, recv_wr: 16, sge: 4 };
    const ALL: u32 = LOCAL_WRITE | REMOTE_READ | REMOTE_WRITE;

    fn fabric(reuse: bool) -> (FakeFabric, tempdir::Dir) {
        let d = tempdir::Dir::new();
        (FakeFabric::new(2, d.0.clone(), reuse), d)
    }

    mod tempdir {
        pub struct Dir(pub std::path::PathBuf);
        impl Dir {
            pub fn new() -> Dir {
                let p = std::env::temp_dir().join(format!("gixl-fv-test-{:032x}", crate::util::random_u128()));
                std::fs::create_dir_all(&p).unwrap();
                Dir(p)
            }
        }
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }

    struct Side {
        nic: Arc<dyn Nic>,
        cq: Arc<dyn Cq>,
        qp: Arc<dyn Qp>,
    }

    fn side(f: &FakeFabric, dev: &str) -> Side {
        let nic = f.open(dev, 1).unwrap();
        let cq = nic.create_cq(256).unwrap();
        let qp = nic.create_qp(&cq, &cq, CAPS).unwrap();
        Side { nic, cq, qp }
    }

    fn pair(f: &FakeFabric) -> (Side, Side) {
        let (a, b) = (side(f, "fake0"), side(f, "fake1"));
        a.qp.connect(&b.qp.addr()).unwrap();
        b.qp.connect(&a.qp.addr()).unwrap();
        (a, b)
    }

    /// Wait (on the event descriptor, as the engine's reactor does) for `n` completions.
    fn wait(cq: &Arc<dyn Cq>, n: usize) -> Vec<Completion> {
        let mut out = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(10);
        while out.len() < n {
            cq.arm().unwrap();
            let want = n - out.len();
            cq.poll(&mut out, want).unwrap();
            if out.len() >= n {
                break;
            }
            let mut p = libc::pollfd { fd: cq.event_fd(), events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd.
            unsafe { libc::poll(&mut p, 1, 100) };
            cq.take_event().unwrap();
            assert!(Instant::now() < deadline, "{} of {n} completions: {out:?}", out.len());
        }
        out
    }

    fn sge(buf: &[u8], mr: &Mr) -> Sge {
        Sge { addr: buf.as_ptr() as u64, len: buf.len() as u32, lkey: mr.lkey }
    }

    #[test]
    fn read_write_send_and_write_with_immediate_move_the_bytes_in_order() {
        let (f, _d) = fabric(false);
        let (a, b) = pair(&f);
        let remote: Vec<u8> = (0..1 << 20).map(|i| (i % 251) as u8).collect();
        let local = vec![0u8; 1 << 20];
        let rmr = b.nic.reg_mr(remote.as_ptr() as u64, remote.len() as u64, ALL).unwrap();
        let lmr = a.nic.reg_mr(local.as_ptr() as u64, local.len() as u64, ALL).unwrap();
        // Two READs into the two halves, the first unsignalled: one completion, for the second.
        let half = 1 << 19;
        let (l0, l1) = local.split_at(half);
        let r0 = Op::Read { raddr: rmr.addr + half as u64, rkey: rmr.rkey };
        let r1 = Op::Read { raddr: rmr.addr, rkey: rmr.rkey };
        let s0 = [sge(l0, &lmr)];
        let s1 = [sge(l1, &lmr)];
        a.qp.post_send(&[
            Wr { id: 1, op: r0, sges: &s0, signaled: false },
            Wr { id: 2, op: r1, sges: &s1, signaled: true },
        ])
        .unwrap();
        let c = wait(&a.cq, 1);
        assert_eq!(c, vec![Completion { id: 2, status: WcStatus::Success, kind: WcKind::Read, len: 0, imm: None }]);
        assert_eq!(&local[..half], &remote[half..]);
        assert_eq!(&local[half..], &remote[..half]);
        // WRITE back a pattern, then WRITE with immediate: the receiver's completion comes after the data.
        let pattern = vec![0xA5u8; 4096];
        let pmr = a.nic.reg_mr(pattern.as_ptr() as u64, 4096, ALL).unwrap();
        let rbuf = vec![0u8; 64];
        let rbmr = b.nic.reg_mr(rbuf.as_ptr() as u64, 64, ALL).unwrap();
        b.qp.post_recv(7, sge(&rbuf, &rbmr)).unwrap();
        b.qp.post_recv(8, sge(&rbuf, &rbmr)).unwrap();
        let ps = [sge(&pattern, &pmr)];
        a.qp.post_send(&[
            Wr { id: 3, op: Op::Write { raddr: rmr.addr, rkey: rmr.rkey }, sges: &ps, signaled: false },
            Wr {
                id: 4,
                op: Op::WriteImm { raddr: rmr.addr + 4096, rkey: rmr.rkey, imm: 99 },
                sges: &ps,
                signaled: true,
            },
        ])
        .unwrap();
        let got = wait(&b.cq, 1);
        assert_eq!(
            got,
            vec![Completion { id: 7, status: WcStatus::Success, kind: WcKind::RecvImm, len: 4096, imm: Some(99) }]
        );
        assert!(remote[..8192].iter().all(|&x| x == 0xA5));
        assert_eq!(wait(&a.cq, 1)[0].id, 4);
        // SEND lands in the next posted receive.
        let msg = b"notification".to_vec();
        let mmr = a.nic.reg_mr(msg.as_ptr() as u64, msg.len() as u64, ALL).unwrap();
        let ms = [sge(&msg, &mmr)];
        a.qp.post_send(&[Wr { id: 5, op: Op::Send { imm: None }, sges: &ms, signaled: true }]).unwrap();
        let got = wait(&b.cq, 1);
        assert_eq!((got[0].id, got[0].kind, got[0].len), (8, WcKind::Recv, 12));
        assert_eq!(&rbuf[..12], b"notification");
        assert_eq!(wait(&a.cq, 1)[0].id, 5);
    }

    #[test]
    fn after_dereg_the_key_fails_and_the_pair_goes_to_error_even_where_the_key_value_comes_back() {
        let (f, _d) = fabric(true);
        let (a, b) = pair(&f);
        let remote = vec![1u8; 4096];
        let other = vec![2u8; 4096];
        let local = vec![0u8; 4096];
        let lmr = a.nic.reg_mr(local.as_ptr() as u64, 4096, ALL).unwrap();
        let rmr = b.nic.reg_mr(remote.as_ptr() as u64, 4096, ALL).unwrap();
        b.nic.dereg_mr(&rmr).unwrap();
        assert!(b.nic.dereg_mr(&rmr).is_err(), "twice");
        // With keys reused, the next region gets the same value: an old handle's key names the new region,
        // and only its address range stands between them.
        let again = b.nic.reg_mr(other.as_ptr() as u64, 4096, ALL).unwrap();
        assert_eq!(again.rkey, rmr.rkey);
        let s = [sge(&local, &lmr)];
        let rd = |id, raddr| Wr { id, op: Op::Read { raddr, rkey: rmr.rkey }, sges: &s, signaled: true };
        a.qp.post_send(&[rd(1, rmr.addr), rd(2, again.addr)]).unwrap();
        let c = wait(&a.cq, 2);
        assert_eq!((c[0].id, c[0].status), (1, WcStatus::RemoteAccess));
        assert_eq!((c[1].id, c[1].status), (2, WcStatus::Flushed));
        assert!(local.iter().all(|&x| x == 0));
        // In the error state every later request is flushed, signalled or not.
        a.qp.post_send(&[Wr {
            id: 3,
            op: Op::Read { raddr: again.addr, rkey: again.rkey },
            sges: &s,
            signaled: false,
        }])
        .unwrap();
        assert_eq!(wait(&a.cq, 1)[0].status, WcStatus::Flushed);
    }

    #[test]
    fn keys_advance_their_variant_unless_asked_to_reuse_and_another_domain_cannot_use_them() {
        let (f, _d) = fabric(false);
        let buf = [0u8; 64];
        let nic = f.open("fake0", 1).unwrap();
        let m1 = nic.reg_mr(buf.as_ptr() as u64, 64, ALL).unwrap();
        nic.dereg_mr(&m1).unwrap();
        let m2 = nic.reg_mr(buf.as_ptr() as u64, 64, ALL).unwrap();
        assert_eq!(m1.rkey >> 8, m2.rkey >> 8, "the index comes back");
        assert_ne!(m1.rkey, m2.rkey, "with another variant");
        // A pair of domain B reading a key of domain A (same device) is refused.
        let (a, b) = pair(&f);
        let local = vec![0u8; 64];
        let lmr = a.nic.reg_mr(local.as_ptr() as u64, 64, ALL).unwrap();
        let s = [sge(&local, &lmr)];
        a.qp.post_send(&[Wr { id: 1, op: Op::Read { raddr: m2.addr, rkey: m2.rkey }, sges: &s, signaled: true }])
            .unwrap();
        assert_eq!(wait(&a.cq, 1)[0].status, WcStatus::RemoteAccess);
        drop(b);
    }

    #[test]
    fn rights_ranges_and_local_keys_are_checked() {
        let (f, _d) = fabric(false);
        let (a, b) = pair(&f);
        let remote = vec![3u8; 8192];
        let local = vec![0u8; 8192];
        let ro = b.nic.reg_mr(remote.as_ptr() as u64, 4096, REMOTE_READ).unwrap();
        let lmr = a.nic.reg_mr(local.as_ptr() as u64, 8192, ALL).unwrap();
        let s = [sge(&local[..4096], &lmr)];
        a.qp.post_send(&[Wr { id: 1, op: Op::Write { raddr: ro.addr, rkey: ro.rkey }, sges: &s, signaled: true }])
            .unwrap();
        assert_eq!(wait(&a.cq, 1)[0].status, WcStatus::RemoteAccess, "no remote write right");
        let (a, b) = pair(&f);
        let lmr = a.nic.reg_mr(local.as_ptr() as u64, 8192, ALL).unwrap();
        let ro = b.nic.reg_mr(remote.as_ptr() as u64, 4096, REMOTE_READ).unwrap();
        let s = [Sge { addr: local.as_ptr() as u64 + 1, len: 4096, lkey: lmr.lkey }];
        a.qp.post_send(&[Wr { id: 2, op: Op::Read { raddr: ro.addr + 1, rkey: ro.rkey }, sges: &s, signaled: true }])
            .unwrap();
        assert_eq!(wait(&a.cq, 1)[0].status, WcStatus::RemoteAccess, "one byte past the region");
        let (a, b) = pair(&f);
        let ro = b.nic.reg_mr(remote.as_ptr() as u64, 4096, REMOTE_READ).unwrap();
        let lmr = a.nic.reg_mr(local.as_ptr() as u64, 8192, ALL).unwrap();
        let good = [Sge { addr: local.as_ptr() as u64 + 4096, len: 64, lkey: lmr.lkey }];
        let bad = [Sge { addr: local.as_ptr() as u64, len: 64, lkey: 0xdead00 }];
        let rd = Op::Read { raddr: ro.addr, rkey: ro.rkey };
        a.qp.post_send(&[
            Wr { id: 3, op: rd, sges: &good, signaled: true },
            Wr { id: 4, op: rd, sges: &bad, signaled: true },
            Wr { id: 5, op: rd, sges: &good, signaled: false },
        ])
        .unwrap();
        // In order: the one before it completes, it fails, the one after is flushed.
        let c: Vec<(u64, WcStatus)> = wait(&a.cq, 3).iter().map(|c| (c.id, c.status)).collect();
        assert_eq!(c, [(3, WcStatus::Success), (4, WcStatus::LocalProtection), (5, WcStatus::Flushed)]);
        assert!(local[..4096].iter().all(|&x| x == 0));
        assert!(local[4096..4160].iter().all(|&x| x == 3));
    }

    #[test]
    fn a_peer_that_goes_away_fails_the_oldest_request_retry_exceeded_and_flushes_the_rest() {
        let (f, _d) = fabric(false);
        let (a, b) = pair(&f);
        let local = vec![0u8; 64];
        let lmr = a.nic.reg_mr(local.as_ptr() as u64, 64, ALL).unwrap();
        let s = [sge(&local, &lmr)];
        // Receives the peer never posts: the SENDs wait (receiver not ready) until the peer goes.
        a.qp.post_send(&[
            Wr { id: 1, op: Op::Send { imm: None }, sges: &s, signaled: true },
            Wr { id: 2, op: Op::Send { imm: None }, sges: &s, signaled: false },
        ])
        .unwrap();
        std::thread::sleep(Duration::from_millis(50));
        drop(b);
        let c = wait(&a.cq, 2);
        assert_eq!((c[0].id, c[0].status), (1, WcStatus::RetryExceeded));
        assert_eq!((c[1].id, c[1].status), (2, WcStatus::Flushed));
    }

    #[test]
    fn a_failed_port_cuts_its_pairs_and_refuses_new_ones() {
        let (f, _d) = fabric(false);
        let (a, b) = pair(&f);
        let local = vec![0u8; 64];
        let lmr = a.nic.reg_mr(local.as_ptr() as u64, 64, ALL).unwrap();
        let s = [sge(&local, &lmr)];
        a.qp.post_send(&[Wr { id: 1, op: Op::Send { imm: None }, sges: &s, signaled: true }]).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        fail_port(b.nic.port());
        assert_eq!(wait(&a.cq, 1)[0].status, WcStatus::RetryExceeded);
        let ports = f.ports().unwrap();
        assert!(ports.iter().any(|p| p.device == "fake1" && !p.active), "{ports:?}");
        let c = side(&f, "fake1");
        assert!(c.qp.connect(&a.qp.addr()).is_err());
    }

    #[test]
    fn an_overrun_completion_queue_fails_its_poll_and_a_full_send_queue_refuses_the_chain() {
        let (f, _d) = fabric(false);
        let nic = f.open("fake0", 1).unwrap();
        let cq = nic.create_cq(1).unwrap();
        let peer = side(&f, "fake1");
        let qp = nic.create_qp(&cq, &cq, QpCaps { send_wr: 2, recv_wr: 1, sge: 1 }).unwrap();
        let buf = vec![0u8; 64];
        let mr = nic.reg_mr(buf.as_ptr() as u64, 64, ALL).unwrap();
        let s = [sge(&buf, &mr)];
        let w = |id| Wr { id, op: Op::Send { imm: None }, sges: &s, signaled: true };
        assert!(qp.post_send(&[w(1)]).is_err(), "not connected");
        qp.connect(&peer.qp.addr()).unwrap();
        peer.qp.connect(&qp.addr()).unwrap();
        assert!(qp.post_send(&[w(1), w(2), w(3)]).is_err(), "three into a queue of two");
        qp.post_send(&[w(1), w(2)]).unwrap();
        // Two flushed completions into a queue of one. The fake NIC's thread may still hold a send it took off
        // the queue and push its completion a moment later: wait for the second push, without polling (a poll
        // would make room for it).
        qp.set_error();
        let fake = cq.clone().as_any().downcast::<FakeCq>().unwrap();
        let t = std::time::Instant::now();
        while !fake.overrun.load(Ordering::Acquire) && t.elapsed() < std::time::Duration::from_secs(5) {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let mut out = Vec::new();
        let e = cq.poll(&mut out, 8).unwrap_err();
        assert!(e.message().contains("overrun"), "{e}");
    }
}
