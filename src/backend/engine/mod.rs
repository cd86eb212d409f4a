//! gixl's default transfer engine, registered under the name "UCX" because that is the name NIXL users ask
//! for. It is gixl's own code, not the UCX library; UCX-specific init options (`engine_config`,
//! `device_list`, `ucx_devices`, `ucx_error_handling_mode`, ...) are accepted and ignored.
//!
//! Routes, chosen per peer from its connection info:
//! - loopback and peers in this process: `memcpy`;
//! - peers in another process on this host: cross-memory attach (`process_vm_readv/writev`), the peer
//!   identified by pid + start time and watched through a pidfd, notifications over an abstract Unix socket.
//!
//! Peers on other hosts are refused at load time with a clear error until the TCP route lands. Small
//! requests complete inline in `post`; large ones are split across a few copy threads.

mod copy;
mod ctrl;
mod pool;

use std::any::Any;
use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Instant;

use parking_lot::{Condvar, Mutex};

use super::{Backend, BackendInit, BackendXfer, Caps, LocalRegion, Params, Peer, Seg, Target, XferPlan};
use crate::md::{put_bytes, put_uvar, Reader};
use crate::mem::{MemType, RegDesc};
use crate::status::{Error, Result, Status};
use ctrl::{Ctrl, NotifQueue, Sender};
use pool::Pool;

/// Requests up to this size run inline in `post`: splitting them costs more than it saves.
const INLINE_BYTES: u64 = 2 << 20;
/// Pieces of a split request are at least this large.
const MIN_PIECE: u64 = 1 << 20;

pub fn default_params() -> Params {
    [("num_threads", "0"), ("num_workers", "1"), ("ucx_devices", ""), ("ucx_error_handling_mode", "peer")]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

pub fn create(init: BackendInit) -> Result<Arc<dyn Backend>> {
    Ok(Arc::new(Engine::new(init)?))
}

/// Engines alive in this process, by incarnation, so in-process peers are reached directly.
fn registry() -> &'static Mutex<HashMap<u128, Weak<Shared>>> {
    static R: OnceLock<Mutex<HashMap<u128, Weak<Shared>>>> = OnceLock::new();
    R.get_or_init(Default::default)
}

pub struct Engine {
    shared: Arc<Shared>,
}

struct Shared {
    agent: String,
    incarnation: u128,
    host: String,
    pid: i32,
    start_time: u64,
    threads: usize,
    queue: Arc<NotifQueue>,
    closed: Arc<AtomicBool>,
    ctrl: Ctrl,
    pool: Pool,
}

impl Engine {
    fn new(init: BackendInit) -> Result<Engine> {
        let pid = std::process::id() as i32;
        let start_time = crate::util::process_start_time(pid).map_err(|e| Error::os(Status::Backend, "reading own process start time", e))?;
        let threads = copy_threads(&init);
        let queue: Arc<NotifQueue> = Arc::default();
        let ctrl = Ctrl::start(init.incarnation, queue.clone())?;
        let shared = Arc::new(Shared {
            agent: init.agent_name,
            incarnation: init.incarnation,
            host: crate::util::host_id(),
            pid,
            start_time,
            threads,
            queue,
            closed: Arc::new(AtomicBool::new(false)),
            ctrl,
            pool: Pool::new(threads),
        });
        registry().lock().insert(init.incarnation, Arc::downgrade(&shared));
        Ok(Engine { shared })
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let s = &self.shared;
        s.closed.store(true, Ordering::Release);
        registry().lock().remove(&s.incarnation);
        s.ctrl.shutdown();
        s.pool.shutdown();
    }
}

/// Copy threads: `num_threads`, else `num_workers` above 1, else the agent's `num_workers`, else up to 4.
fn copy_threads(init: &BackendInit) -> usize {
    let param = |k: &str| init.params.get(k).and_then(|v| v.trim().parse::<usize>().ok()).filter(|&n| n > 0);
    param("num_threads")
        .or_else(|| param("num_workers").filter(|&n| n > 1))
        .or(Some(init.num_workers as usize).filter(|&n| n > 0))
        .unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2).min(4))
        .min(64)
}

enum PeerKind {
    /// Another agent in this process.
    InProcess { target: Weak<Shared>, closed: Arc<AtomicBool> },
    /// Another process on this host.
    Cma { pid: i32, pidfd: OwnedFd, watch: Option<u64>, sock: Vec<u8>, sender: Mutex<Option<Sender>> },
}

struct EnginePeer {
    name: String,
    incarnation: u128,
    kind: PeerKind,
    dead: Arc<AtomicBool>,
    owner: Weak<Shared>,
}

impl Peer for EnginePeer {
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn disconnected(&self) -> bool {
        match &self.kind {
            PeerKind::InProcess { closed, .. } => closed.load(Ordering::Acquire),
            PeerKind::Cma { .. } => self.dead.load(Ordering::Acquire),
        }
    }
}

impl Drop for EnginePeer {
    fn drop(&mut self) {
        if let PeerKind::Cma { pidfd, watch: Some(token), .. } = &self.kind {
            if let Some(owner) = self.owner.upgrade() {
                owner.ctrl.unwatch(*token, pidfd.as_raw_fd());
            }
        }
    }
}

impl EnginePeer {
    fn send_notif(&self, from: &str, msg: &[u8]) -> Result<()> {
        match &self.kind {
            PeerKind::InProcess { target, closed } => {
                let t = target.upgrade().filter(|_| !closed.load(Ordering::Acquire));
                let t = t.ok_or_else(|| Error::disconnected(format!("agent '{}' has been destroyed", self.name)))?;
                t.queue.lock().push((from.to_owned(), msg.to_vec()));
                Ok(())
            }
            PeerKind::Cma { sock, sender, .. } => {
                if self.dead.load(Ordering::Acquire) {
                    return Err(Error::disconnected(format!("agent '{}' has exited", self.name)));
                }
                let mut s = sender.lock();
                if s.is_none() {
                    *s = Some(Sender::connect(sock, self.incarnation, from)?);
                }
                let r = s.as_mut().map(|s| s.notif(msg)).unwrap_or(Ok(()));
                if r.is_err() {
                    *s = None;
                }
                r
            }
        }
    }
}

fn conn_info(s: &Shared) -> Vec<u8> {
    let mut out = vec![1u8];
    put_bytes(&mut out, s.host.as_bytes());
    put_uvar(&mut out, s.pid as u64);
    put_uvar(&mut out, s.start_time);
    put_bytes(&mut out, &s.ctrl.sock_name);
    out
}

struct ConnInfo {
    host: String,
    pid: i32,
    start_time: u64,
    sock: Vec<u8>,
}

fn parse_conn(b: &[u8]) -> Result<ConnInfo> {
    let mut r = Reader { buf: b, pos: 0 };
    if r.byte()? != 1 {
        return Err(Error::mismatch("unknown engine connection-info version"));
    }
    let host = r.string(4096)?;
    let pid = i32::try_from(r.uvar()?).map_err(|_| Error::mismatch("bad pid in connection info"))?;
    let start_time = r.uvar()?;
    let sock = r.bytes(108)?.to_vec();
    if r.left() != 0 || pid <= 0 {
        return Err(Error::mismatch("malformed engine connection info"));
    }
    Ok(ConnInfo { host, pid, start_time, sock })
}

fn pidfd_open(pid: i32) -> std::io::Result<OwnedFd> {
    // SAFETY: plain syscall; the result is checked.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

impl Backend for Engine {
    fn name(&self) -> &'static str {
        "UCX"
    }

    fn caps(&self) -> Caps {
        Caps { local: true, remote: true, notif: true, mems: vec![MemType::Dram] }
    }

    fn params(&self) -> Params {
        [("num_threads".to_owned(), self.shared.threads.to_string())].into_iter().collect()
    }

    fn register(&self, mem: MemType, _desc: &RegDesc) -> Result<LocalRegion> {
        if mem != MemType::Dram {
            return Err(Error::not_supported(format!("{} is not supported by this engine", mem.seg_name())));
        }
        Ok(LocalRegion { public: Vec::new(), key: None })
    }

    fn conn_info(&self) -> Vec<u8> {
        conn_info(&self.shared)
    }

    fn load_peer(&self, agent: &str, incarnation: u128, conn: &[u8]) -> Result<Arc<dyn Peer>> {
        let s = &self.shared;
        let ci = parse_conn(conn)?;
        if ci.host != s.host {
            return Err(Error::not_supported(format!(
                "agent '{agent}' runs on another host (or in another pid/network namespace); this gixl build moves \
                 data within one host only"
            )));
        }
        let dead = Arc::new(AtomicBool::new(false));
        let kind = if ci.pid == s.pid && ci.start_time == s.start_time {
            let target = registry().lock().get(&incarnation).cloned().unwrap_or_default();
            let closed = target.upgrade().map(|t| t.closed.clone()).unwrap_or_else(|| Arc::new(AtomicBool::new(true)));
            PeerKind::InProcess { target, closed }
        } else {
            let pidfd = pidfd_open(ci.pid);
            // Opened first, checked second: if the start time still matches, the pidfd is that process.
            let alive = pidfd.is_ok() && crate::util::process_start_time(ci.pid).ok() == Some(ci.start_time);
            let pidfd = match pidfd {
                Ok(fd) => fd,
                // The process is gone; keep a placeholder descriptor so the peer reports disconnected.
                Err(_) => pidfd_open(s.pid).map_err(|e| Error::os(Status::Backend, "pidfd_open", e))?,
            };
            let watch = if alive {
                Some(s.ctrl.watch(pidfd.as_raw_fd(), dead.clone())?)
            } else {
                dead.store(true, Ordering::Release);
                None
            };
            PeerKind::Cma { pid: ci.pid, pidfd, watch, sock: ci.sock, sender: Mutex::new(None) }
        };
        Ok(Arc::new(EnginePeer { name: agent.to_owned(), incarnation, kind, dead, owner: Arc::downgrade(s) }))
    }

    fn connect(&self, peer: &Arc<dyn Peer>) -> Result<()> {
        let p = downcast(peer)?;
        if p.disconnected() {
            return Err(Error::disconnected(format!("agent '{}' has disconnected", p.name)));
        }
        if let PeerKind::Cma { sock, sender, .. } = &p.kind {
            let mut s = sender.lock();
            if s.is_none() {
                *s = Some(Sender::connect(sock, p.incarnation, &self.shared.agent)?);
            }
        }
        Ok(())
    }

    fn disconnect(&self, peer: &Arc<dyn Peer>) {
        if let Ok(p) = downcast(peer) {
            if let PeerKind::Cma { sender, .. } = &p.kind {
                sender.lock().take();
            }
        }
    }

    fn prep_xfer(&self, plan: XferPlan) -> Result<Box<dyn BackendXfer>> {
        if plan.local_mem != MemType::Dram || plan.remote_mem != MemType::Dram {
            return Err(Error::not_supported("this engine moves DRAM only"));
        }
        let route = match &plan.target {
            Target::Local => Route::Loopback,
            Target::Remote(p) => {
                downcast(p)?;
                Route::Peer(p.clone())
            }
        };
        let core = Arc::new(Core { shared: self.shared.clone(), plan, route });
        Ok(Box::new(EngineXfer { core, run: Mutex::new(None) }))
    }

    fn notifs(&self, out: &mut Vec<(String, Vec<u8>)>) -> Result<()> {
        out.append(&mut self.shared.queue.lock());
        Ok(())
    }

    fn gen_notif(&self, target: &Target, msg: &[u8]) -> Result<()> {
        if msg.len() > ctrl::MAX_NOTIF {
            return Err(Error::invalid_param(format!("notification of {} bytes exceeds the {}-byte limit", msg.len(), ctrl::MAX_NOTIF)));
        }
        match target {
            Target::Local => {
                self.shared.queue.lock().push((self.shared.agent.clone(), msg.to_vec()));
                Ok(())
            }
            Target::Remote(p) => downcast(p)?.send_notif(&self.shared.agent, msg),
        }
    }
}

fn downcast(p: &Arc<dyn Peer>) -> Result<&EnginePeer> {
    p.as_any().downcast_ref::<EnginePeer>().ok_or_else(|| Error::invalid_param("peer belongs to another backend"))
}

enum Route {
    Loopback,
    Peer(Arc<dyn Peer>),
}

/// A prepared request: the plan and its route, shared with the copy threads.
struct Core {
    shared: Arc<Shared>,
    plan: XferPlan,
    route: Route,
}

struct EngineXfer {
    core: Arc<Core>,
    run: Mutex<Option<Arc<Run>>>,
}

/// One post of a request, shared with the copy threads working on it.
struct Run {
    state: AtomicI32,
    pending: AtomicUsize,
    abort: AtomicBool,
    err: Mutex<Option<(Status, String)>>,
    done_at: Mutex<Option<Instant>>,
    idle: Condvar,
    idle_lock: Mutex<()>,
    notif: Option<Vec<u8>>,
}

impl Run {
    fn fail(&self, e: Error) {
        let mut err = self.err.lock();
        if err.is_none() {
            *err = Some((e.status(), e.message().to_owned()));
        }
    }
}

impl Core {
    fn peer(&self) -> Option<&EnginePeer> {
        match &self.route {
            Route::Loopback => None,
            Route::Peer(p) => p.as_any().downcast_ref::<EnginePeer>(),
        }
    }

    /// Copy `segs` by whichever route this request takes.
    fn copy(&self, segs: &[Seg], run: &Run) -> Result<()> {
        let op = self.plan.op;
        match self.peer().map(|p| &p.kind) {
            None | Some(PeerKind::InProcess { .. }) => {
                if let Some(p) = self.peer() {
                    if p.disconnected() {
                        return Err(Error::disconnected(format!("agent '{}' has been destroyed", p.name)));
                    }
                }
                // SAFETY: the agent resolved every segment against registrations of live agents in this
                // process; registered memory must stay valid while registered (NIXL's contract).
                unsafe { copy::local_copy(op, segs) };
                Ok(())
            }
            Some(PeerKind::Cma { pid, .. }) => {
                let dead = &self.peer().map(|p| p.dead.clone()).unwrap_or_default();
                let stop = || run.abort.load(Ordering::Relaxed) || dead.load(Ordering::Relaxed);
                // SAFETY: local ranges were resolved against this agent's registrations.
                let r = unsafe { copy::cma_copy(*pid, op, segs, &stop) };
                if r.is_err() && dead.load(Ordering::Acquire) {
                    return Err(Error::disconnected(format!("agent '{}' exited during the transfer", self.peer().map(|p| p.name.as_str()).unwrap_or(""))));
                }
                if let Err(e) = &r {
                    if e.status() == Status::RemoteDisconnect {
                        dead.store(true, Ordering::Release);
                    }
                }
                r
            }
        }
    }

    /// Data is complete: send the notification, then publish the outcome.
    fn finish(&self, run: &Run) {
        if run.err.lock().is_none() {
            if let Some(msg) = &run.notif {
                let r = match self.peer() {
                    None => {
                        self.shared.queue.lock().push((self.shared.agent.clone(), msg.clone()));
                        Ok(())
                    }
                    Some(p) => p.send_notif(&self.shared.agent, msg),
                };
                if let Err(e) = r {
                    run.fail(e);
                }
            }
        }
        *run.done_at.lock() = Some(Instant::now());
        let state = match &*run.err.lock() {
            None => Status::Success,
            Some((s, _)) => *s,
        };
        run.state.store(state as i32, Ordering::Release);
        let _g = run.idle_lock.lock();
        run.idle.notify_all();
    }
}

impl BackendXfer for EngineXfer {
    fn post(&self, notif: Option<&[u8]>) -> Result<Status> {
        let core = &self.core;
        if let Some(p) = core.peer() {
            if p.disconnected() {
                return Err(Error::disconnected(format!("agent '{}' has disconnected", p.name)));
            }
        }
        let plan = &core.plan;
        let pieces = if plan.total_bytes <= INLINE_BYTES || core.shared.threads <= 1 {
            1
        } else {
            (plan.total_bytes / MIN_PIECE).clamp(1, core.shared.threads as u64) as usize
        };
        let run = Arc::new(Run {
            state: AtomicI32::new(Status::InProg as i32),
            pending: AtomicUsize::new(pieces),
            abort: AtomicBool::new(false),
            err: Mutex::new(None),
            done_at: Mutex::new(None),
            idle: Condvar::new(),
            idle_lock: Mutex::new(()),
            notif: notif.map(<[u8]>::to_vec),
        });
        *self.run.lock() = Some(run.clone());
        if pieces == 1 {
            if let Err(e) = core.copy(&plan.segs, &run) {
                run.fail(e);
            }
            core.finish(&run);
            return self.status();
        }
        for part in split(&plan.segs, plan.total_bytes, pieces) {
            let (core, run) = (core.clone(), run.clone());
            self.core.shared.pool.submit(Box::new(move || {
                if !run.abort.load(Ordering::Relaxed) {
                    if let Err(e) = core.copy(&part, &run) {
                        run.fail(e);
                    }
                }
                if run.pending.fetch_sub(1, Ordering::AcqRel) == 1 {
                    core.finish(&run);
                }
            }));
        }
        Ok(Status::InProg)
    }

    fn status(&self) -> Result<Status> {
        let Some(run) = self.run.lock().clone() else { return Err(Error::new(Status::NotPosted, "not posted")) };
        let st = Status::from_i32(run.state.load(Ordering::Acquire)).unwrap_or(Status::Unknown);
        match st {
            Status::Success => Ok(Status::Success),
            Status::InProg => {
                // A dead peer is reported at once, not when the copy threads notice.
                if let Some(p) = self.core.peer() {
                    if p.disconnected() {
                        run.abort.store(true, Ordering::Release);
                        return Err(Error::disconnected(format!("agent '{}' has disconnected", p.name)));
                    }
                }
                Ok(Status::InProg)
            }
            s => {
                let msg = run.err.lock().as_ref().map(|(_, m)| m.clone()).unwrap_or_default();
                Err(Error::new(s, msg))
            }
        }
    }

    fn abort(&self) -> bool {
        let Some(run) = self.run.lock().clone() else { return true };
        run.abort.store(true, Ordering::Release);
        // Wait for pieces already copying: the caller may free its buffers as soon as we return.
        let mut g = run.idle_lock.lock();
        while run.state.load(Ordering::Acquire) == Status::InProg as i32 {
            run.idle.wait(&mut g);
        }
        true
    }

    fn completed_at(&self) -> Option<Instant> {
        self.run.lock().as_ref().and_then(|r| *r.done_at.lock())
    }
}

/// Cut `segs` into `n` pieces of about equal bytes, splitting segments where needed.
fn split(segs: &[Seg], total: u64, n: usize) -> Vec<Vec<Seg>> {
    let per = total.div_ceil(n as u64).max(1);
    let mut parts: Vec<Vec<Seg>> = vec![Vec::new()];
    let mut room = per;
    for s in segs {
        let mut s = *s;
        while s.len > 0 {
            if room == 0 {
                parts.push(Vec::new());
                room = per;
            }
            let take = s.len.min(room);
            let mut piece = s;
            piece.len = take;
            parts.last_mut().expect("never empty").push(piece);
            s.local += take;
            s.remote += take;
            s.len -= take;
            room -= take;
        }
    }
    parts.retain(|p| !p.is_empty());
    parts
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg(local: u64, remote: u64, len: u64) -> Seg {
        Seg { local, remote, len, ldev: 0, rdev: 0, lreg: 0, rreg: 0 }
    }

    #[test]
    fn split_balances_and_preserves_bytes() {
        let segs = vec![seg(0, 1000, 10), seg(100, 2000, 25), seg(500, 3000, 5)];
        let parts = split(&segs, 40, 3);
        assert_eq!(parts.len(), 3);
        let lens: Vec<u64> = parts.iter().map(|p| p.iter().map(|s| s.len).sum()).collect();
        assert_eq!(lens, vec![14, 14, 12]);
        assert_eq!(parts[0][1], seg(100, 2000, 4));
        assert_eq!(parts[1][0], seg(104, 2004, 14));
    }

    #[test]
    fn conn_info_round_trip_and_garbage() {
        assert!(parse_conn(b"").is_err());
        assert!(parse_conn(&[2, 0]).is_err());
        let mut b = vec![1u8];
        put_bytes(&mut b, b"h");
        put_uvar(&mut b, 42);
        put_uvar(&mut b, 7);
        put_bytes(&mut b, b"sock");
        let c = parse_conn(&b).unwrap();
        assert_eq!((c.host.as_str(), c.pid, c.start_time, c.sock.as_slice()), ("h", 42, 7, &b"sock"[..]));
        b.push(0);
        assert!(parse_conn(&b).is_err());
    }
}
