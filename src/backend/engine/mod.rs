//! gixl's default transfer engine, registered under the name "UCX" because that is the name NIXL users ask
//! for. It is gixl's own code, not the UCX library; UCX-specific init options (`engine_config`,
//! `device_list`, `ucx_devices`, `ucx_error_handling_mode`, ...) are accepted and ignored.
//!
//! Routes, chosen per peer from its connection info:
//! - loopback and peers in this process (found in the process's registry of live engines by incarnation id,
//!   never by connection info): `memcpy`;
//! - peers in another process on this host: cross-memory attach (`process_vm_readv/writev`), the peer
//!   identified by pid + start time and watched through a pidfd, notifications over an abstract Unix socket;
//!   if the kernel denies cross-memory attach (EPERM/ENOSYS: containers, seccomp, Yama), that peer's data
//!   moves over TCP from then on;
//! - peers on another host (another boot, pid or network namespace): TCP (see `tcp`), with notifications
//!   and heartbeats on a control connection.
//!
//! Same-host routes copy batch by batch, each batch inside the target incarnation's gate (see `gate`): the
//! target's live flag and registrations decide, and deregistration and destruction wait for batches inside.
//!
//! VRAM (requests with either side in GPU memory) goes through `vram`, over the device layer
//! (`crate::device`): device copies in this process, CUDA IPC handles carried in metadata to another
//! process, every batch of device copies behind the same gate as cross-memory attach, with the same
//! per-call identity probe of the target's gate page.
//!
//! VRAM to a peer reached over TCP goes through `vram_tcp` instead: page-locked staging on both sides, the
//! target serving its VRAM registrations under the same leases as DRAM ones.
//!
//! Small requests complete inline in `post`; large ones are split across a few copy threads (or, over TCP,
//! across the peer's data connections).
//!
//! Configuration (backend parameter, else environment variable, else default):
//! - `transport` / `GIXL_TRANSPORT`: `auto` (above) or `tcp` (every peer, even in this process, over TCP;
//!   loopback requests still use `memcpy`).
//! - `tcp_addr` / `GIXL_TCP_ADDR`: the listener's address, `IP` or `IP:PORT` (default all IPv4 interfaces,
//!   an ephemeral port). A specific IP is the only address advertised; otherwise every interface's is.
//! - `tcp_conns` / `GIXL_TCP_CONNS`: data connections per TCP peer (default 4).
//! - `disconnect_timeout_ms` / `GIXL_DISCONNECT_TIMEOUT_MS`: how long a TCP peer with requests in flight may
//!   stay silent before they fail with REMOTE_DISCONNECT (default 1000).
//! - `notif_queue_msgs` / `GIXL_NOTIF_QUEUE_MSGS`, `notif_queue_bytes` / `GIXL_NOTIF_QUEUE_BYTES`: how many
//!   notifications (and bytes) may wait for the application (default 65536, 256 MiB). Beyond, the local
//!   sockets and TCP control connections are not read, so senders wait and then fail with BACKEND.
//!
//! The engine keeps its own table of registered regions: a TCP peer can reach only those, whatever its
//! metadata claims, and only over connections that proved they know the per-engine secret from its metadata
//! (the secret itself never crosses the network). It does not encrypt: data crosses in the clear.

mod copy;
mod ctrl;
mod gate;
mod liveness;
mod net;
mod notif;
mod pool;
mod sentinel;
mod serve_stage;
mod tcp;
mod vram;
mod vram_tcp;
pub mod wire;

use std::any::Any;
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::{Backend, BackendInit, BackendXfer, Caps, LocalRegion, Params, Peer, RegionKey, Seg, Target, XferPlan};
use crate::md::{put_bytes, put_uvar, Reader};
use crate::mem::{Desc, MemType, RegDesc};
use crate::status::{Error, Result, Status};
use ctrl::{Ctrl, Sender};
use gate::{Attached, Gate, RegionTicket};
use notif::{NotifQueue, QUEUE_BYTES, QUEUE_MSGS};
use pool::Pool;
use tcp::{LinkTarget, Regions, TcpLink, TcpOpts, TcpSetup};

/// Requests up to this size run inline in `post`: splitting them costs more than it saves.
const INLINE_BYTES: u64 = 2 << 20;
/// Pieces of a split request are at least this large.
const MIN_PIECE: u64 = 1 << 20;
/// Over TCP, requests up to this size run inline in `post` (one round trip); larger ones go to workers.
const TCP_INLINE_BYTES: u64 = 256 << 10;
const DEFAULT_TCP_CONNS: usize = 4;
const DEFAULT_DISCONNECT_MS: u64 = 1000;

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
    transport: Transport,
    tcp_opts: TcpOpts,
    /// Shown only inside this engine's metadata; a TCP connection must present it.
    secret: u128,
    regions: Arc<Regions>,
    /// What same-host peers must pass for every batch (see `gate`).
    gate: Arc<Gate>,
    queue: Arc<NotifQueue>,
    closed: Arc<AtomicBool>,
    /// Test-only fault injection (`GIXL_TEST_FAULT=copy_panic`): copy workers panic.
    panic_copies: bool,
    /// Test-only fault injection (`GIXL_TEST_FAULT=no_pidfd_getfd`, or backend parameter `test_fault`): act
    /// as if the kernel refused every `pidfd_getfd`, so peers' descriptors come over their control socket.
    no_pidfd_getfd: bool,
    ctrl: Ctrl,
    pool: Pool,
    /// Workers for TCP pieces: they block on sockets, so they are not the copy threads.
    tcp_pool: Pool,
    /// Registered VRAM's exported allocations (see `vram`; its regions hold slots in `gate`).
    vram: vram::Vram,
    /// Same-host peer processes proven so far, by process incarnation (see [`Proof`]).
    proofs: Mutex<HashMap<gate::Owner, Weak<Proof>>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Transport {
    Auto,
    Tcp,
}

/// A backend parameter, else an environment variable.
fn setting(init: &BackendInit, param: &str, env: &str) -> Option<String> {
    init.params
        .get(param)
        .filter(|v| !v.trim().is_empty())
        .cloned()
        .or_else(|| std::env::var(env).ok().filter(|v| !v.trim().is_empty()))
}

fn number<T: std::str::FromStr>(v: Option<String>, what: &str, default: T) -> Result<T> {
    match v {
        None => Ok(default),
        Some(v) => v.trim().parse().map_err(|_| Error::invalid_param(format!("{what}: '{v}' is not a valid number"))),
    }
}

impl Engine {
    fn new(init: BackendInit) -> Result<Engine> {
        // NIXL's UCX plugin reads this yes/no option (scatter-gather lists, which this engine does not need) and
        // fails the backend on anything else; so does this one.
        crate::config::flag("NIXL_UCX_SGL_ENABLE").map_err(|e| Error::backend(e.message().to_owned()))?;
        let pid = std::process::id() as i32;
        let start_time = crate::util::process_start_time(pid)
            .map_err(|e| Error::os(Status::Backend, "reading own process start time", e))?;
        let threads = copy_threads(&init);
        let transport = match setting(&init, "transport", "GIXL_TRANSPORT").as_deref().map(str::trim) {
            None | Some("auto") => Transport::Auto,
            Some("tcp") => Transport::Tcp,
            Some(other) => {
                return Err(Error::invalid_param(format!(
                    "transport '{other}' is not one of auto, tcp (GIXL_TRANSPORT)"
                )))
            }
        };
        let conns = number(setting(&init, "tcp_conns", "GIXL_TCP_CONNS"), "tcp_conns", DEFAULT_TCP_CONNS)?.clamp(1, 64);
        let ms = number(
            setting(&init, "disconnect_timeout_ms", "GIXL_DISCONNECT_TIMEOUT_MS"),
            "disconnect_timeout_ms",
            DEFAULT_DISCONNECT_MS,
        )?
        .clamp(10, 3_600_000);
        let tcp_opts = TcpOpts { conns, timeout: Duration::from_millis(ms) };
        let bind = tcp::parse_bind(&setting(&init, "tcp_addr", "GIXL_TCP_ADDR").unwrap_or_default())?;
        let secret = crate::util::random_u128();
        let regions: Arc<Regions> = Arc::default();
        let queue: Arc<NotifQueue> = Arc::default();
        let ctrl = Ctrl::start(
            init.incarnation,
            queue.clone(),
            TcpSetup { bind, opts: tcp_opts, secret, regions: regions.clone() },
        )?;
        let msgs = number(setting(&init, "notif_queue_msgs", "GIXL_NOTIF_QUEUE_MSGS"), "notif_queue_msgs", QUEUE_MSGS)?;
        let bytes =
            number(setting(&init, "notif_queue_bytes", "GIXL_NOTIF_QUEUE_BYTES"), "notif_queue_bytes", QUEUE_BYTES)?;
        ctrl.set_queue_limits(msgs.max(1), bytes.max(1));
        let gate = Arc::new(Gate::create(init.incarnation)?);
        let no_pidfd_getfd = setting(&init, "test_fault", "GIXL_TEST_FAULT")
            .is_some_and(|v| v.split(',').any(|f| f.trim() == "no_pidfd_getfd"));
        // Peers that may not take it with `pidfd_getfd` ask for it over the control socket.
        ctrl.offer_fd(gate.raw_fd());
        let shared = Arc::new(Shared {
            agent: init.agent_name,
            incarnation: init.incarnation,
            host: crate::util::host_id(),
            pid,
            start_time,
            threads,
            transport,
            tcp_opts,
            secret,
            regions,
            gate,
            queue,
            closed: Arc::new(AtomicBool::new(false)),
            panic_copies: std::env::var("GIXL_TEST_FAULT").is_ok_and(|v| v.split(',').any(|f| f == "copy_panic")),
            no_pidfd_getfd,
            ctrl,
            pool: Pool::new(threads),
            tcp_pool: Pool::new((2 * conns).clamp(4, 64)),
            vram: Default::default(),
            proofs: Mutex::default(),
        });
        registry().lock().insert(init.incarnation, Arc::downgrade(&shared));
        Ok(Engine { shared })
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shared.shutdown();
    }
}

impl Shared {
    /// The proof that `ci`'s process runs here as `incarnation` (see [`Proof`]): the one this engine holds
    /// already, else a new one. None when the process does not prove it (nothing listens on its socket as its
    /// pid, it has exited, or the kernel gave neither its gate nor a reason).
    /// Errors only when this side runs out (no initiator slot in the peer's gate, no epoll entry).
    fn prove(self: &Arc<Shared>, ci: &ConnInfo, incarnation: u128) -> Result<Option<Arc<Proof>>> {
        let key: gate::Owner = (ci.pid, ci.start_time, incarnation);
        let known = |p: &Arc<Proof>| !p.exited.load(Ordering::Acquire);
        if let Some(p) = self.proofs.lock().get(&key).and_then(Weak::upgrade).filter(known) {
            return Ok(Some(p));
        }
        // A pidfd only for a peer that proves it runs here: its pid listens on its socket, named for this
        // incarnation (forged metadata costs no descriptor). Opened first, checked second: if the start time
        // still matches, the pidfd is that process.
        let named = ci.sock == format!("gixl.{}.{incarnation:032x}", ci.pid).into_bytes();
        let Some(pidfd) =
            (named && ctrl::listener_pid(&ci.sock) == Some(ci.pid)).then(|| pidfd_open(ci.pid).ok()).flatten()
        else {
            return Ok(None);
        };
        if crate::util::process_start_time(ci.pid).ok() != Some(ci.start_time) {
            return Ok(None);
        }
        // The peer's gate, taken from that very process through the pidfd: if the kernel refuses, it would refuse
        // cross-memory attach too, and TCP carries the data. Received over the peer's control socket instead (the
        // kernel refused `pidfd_getfd` alone, or the peer is another uid it allows), one probe of the gate tells at
        // once whether cross-memory attach is allowed.
        let peer_sock = (ci.sock.as_slice(), ci.secret, incarnation, ci.pid);
        let probe = copy::Probe { addr: ci.gate_addr, incarnation };
        let taken =
            take_peer_fd(self, pidfd.as_fd(), peer_sock, ci.gate_fd).and_then(|g| Gate::from_fd(g, incarnation));
        let (gate, denied) = match taken {
            Ok(g) => match copy::probe(ci.pid, &probe, &mut false) {
                Ok(()) => (Some(g), None),
                // The gate is kept (VRAM through IPC handles needs no cross-memory attach, see `vram`); DRAM
                // goes over TCP.
                Err(e) if cma_denied(&e) => (Some(g), Some(e.to_string())),
                Err(_) => return Ok(None),
            },
            Err(e) if cma_denied(&e) => (None, Some(e.to_string())),
            Err(_) => return Ok(None),
        };
        let gate = match gate {
            Some(g) => Some(gate::attach_shared(key, || Ok(Arc::new(g)))?),
            None => None,
        };
        let exited = Arc::new(AtomicBool::new(false));
        let watch = self.ctrl.watch(pidfd.as_raw_fd(), exited.clone())?;
        let p = Arc::new(Proof { pidfd, watch, exited, gate, denied, owner: Arc::downgrade(self) });
        let mut proofs = self.proofs.lock();
        proofs.retain(|_, w| w.strong_count() > 0);
        // Two loads that proved the same process at once keep the first proof.
        match proofs.get(&key).and_then(Weak::upgrade).filter(known) {
            Some(first) => Ok(Some(first)),
            None => {
                proofs.insert(key, Arc::downgrade(&p));
                Ok(Some(p))
            }
        }
    }

    /// Stop serving peers (same-host ones find the gate closed, TCP ones lose their connections and the region
    /// table) and stop the threads. Requests that outlive this fail with BACKEND. Idempotent.
    fn shutdown(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        registry().lock().remove(&self.incarnation);
        // From here no peer's batch passes the gate; those inside finish before this returns.
        self.gate.close(self.tcp_opts.timeout);
        self.ctrl.shutdown();
        self.pool.shutdown();
        self.tcp_pool.shutdown();
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
    /// Another agent in this process, found in `registry()` by its incarnation; `gate` is None when no engine
    /// of that incarnation lives here (destroyed, or metadata that only claims to be from this process).
    InProcess { target: Weak<Shared>, gate: Option<Arc<Attached>> },
    /// Another process on this host. `tcp` carries the data instead once the kernel has denied
    /// cross-memory attach (`denied`).
    Cma {
        pid: i32,
        /// None when the peer did not prove it runs here (nothing listens on its socket as its pid).
        proof: Option<Arc<Proof>>,
        /// The peer's gate (None when the kernel denied taking it: then `denied` is set and TCP carries data).
        gate: Option<Arc<Attached>>,
        probe: copy::Probe,
        sock: Vec<u8>,
        /// The peer's engine secret and our incarnation: the notification handshake's inputs.
        secret: u128,
        from_inc: u128,
        /// The peer's notification socket refused our uid: notifications go over TCP (which proves the
        /// same secret).
        local_refused: AtomicBool,
        sender: Mutex<Option<Sender>>,
        tcp: Arc<TcpLink>,
        denied: AtomicBool,
    },
    /// Another host, or `GIXL_TRANSPORT=tcp`.
    Tcp { link: Arc<TcpLink> },
}

struct EnginePeer {
    name: String,
    incarnation: u128,
    kind: PeerKind,
    /// This name's route has failed for good (its metadata's gate address faulted, its link gave up): per
    /// name, so a forged copy of a peer's metadata can only break itself. The process's exit is `Proof::exited`.
    dead: Arc<AtomicBool>,
}

/// What a same-host peer process proved once, shared by every name whose metadata claims that process
/// incarnation (`Owner`): its pid listens on the socket named for the incarnation, the pidfd watched for its
/// exit, and this process's claim on its gate. Renamed copies of a peer's metadata cost neither descriptors
/// nor gate slots (each name used to hold a pidfd, a gate descriptor and an initiator slot).
struct Proof {
    pidfd: OwnedFd,
    watch: u64,
    /// Set by the progress thread when the process exits.
    exited: Arc<AtomicBool>,
    gate: Option<Arc<Attached>>,
    /// Why the kernel refused cross-memory attach to it, if it did when proven.
    denied: Option<String>,
    owner: Weak<Shared>,
}

impl Drop for Proof {
    fn drop(&mut self) {
        if let Some(owner) = self.owner.upgrade() {
            owner.ctrl.unwatch(self.watch, self.pidfd.as_raw_fd());
        }
    }
}

impl Peer for EnginePeer {
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn disconnected(&self) -> bool {
        match &self.kind {
            PeerKind::InProcess { gate, .. } => gate.as_ref().is_none_or(|g| !g.gate.live()),
            PeerKind::Cma { gate, .. } => self.gone() || gate.as_ref().is_some_and(|g| !g.gate.live()),
            PeerKind::Tcp { link } => link.down(),
        }
    }
    fn why_down(&self) -> String {
        let link = match &self.kind {
            PeerKind::Tcp { link } => link,
            PeerKind::Cma { tcp, denied, .. } if denied.load(Ordering::Acquire) => tcp,
            PeerKind::Cma { .. } | PeerKind::InProcess { .. } => return String::new(),
        };
        link.why().map(|w| format!(" ({w})")).unwrap_or_default()
    }
    fn route(&self) -> &'static str {
        match &self.kind {
            PeerKind::InProcess { .. } => "in-process",
            PeerKind::Cma { denied, .. } if denied.load(Ordering::Acquire) => "tcp-after-cma-denied",
            PeerKind::Cma { .. } => "cma",
            PeerKind::Tcp { .. } => "tcp",
        }
    }
    fn pid(&self) -> Option<i32> {
        match &self.kind {
            PeerKind::Cma { pid, .. } => Some(*pid),
            PeerKind::InProcess { .. } | PeerKind::Tcp { .. } => None,
        }
    }
}

impl EnginePeer {
    /// This name's route is dead, or the process behind it has exited.
    fn gone(&self) -> bool {
        self.dead.load(Ordering::Acquire)
            || match &self.kind {
                PeerKind::Cma { proof, .. } => proof.as_ref().is_some_and(|p| p.exited.load(Ordering::Acquire)),
                PeerKind::InProcess { .. } | PeerKind::Tcp { .. } => false,
            }
    }

    fn send_notif(&self, from: &str, msg: &[u8]) -> Result<()> {
        match &self.kind {
            PeerKind::InProcess { target, .. } => {
                let t = target.upgrade().filter(|_| !self.disconnected());
                let t = t.ok_or_else(|| Error::disconnected(format!("agent '{}' has been destroyed", self.name)))?;
                t.queue.lock().push((from.to_owned(), msg.to_vec()));
                Ok(())
            }
            PeerKind::Cma { sock, sender, secret, from_inc, local_refused, tcp, .. } => {
                if self.gone() {
                    return Err(Error::disconnected(format!("agent '{}' has exited", self.name)));
                }
                if local_refused.load(Ordering::Acquire) {
                    return tcp.notif(msg);
                }
                let mut s = sender.lock();
                if s.is_none() {
                    match Sender::connect(sock, self.incarnation, *secret, from, *from_inc) {
                        Ok(c) => *s = Some(c),
                        Err(e) if e.status() == Status::NotAllowed => {
                            local_refused.store(true, Ordering::Release);
                            drop(s);
                            return tcp.notif(msg);
                        }
                        Err(e) => return Err(e),
                    }
                }
                let r = s.as_mut().map(|s| s.notif(msg)).unwrap_or(Ok(()));
                if r.is_err() {
                    *s = None;
                }
                r
            }
            PeerKind::Tcp { link } => link.notif(msg),
        }
    }
}

/// Connection-info layouts. 3: the parts below in a fixed order, nothing after. 4: the same parts as tagged
/// sections (`id | length | bytes`), in any order: a reader skips sections it does not know, and bytes after the
/// fields it knows inside a section it does know, so a later release can add a route (a section) or a field
/// without breaking this one. This release reads both and writes 3, which the releases before it read: a
/// rolling update with both on the cluster keeps working. The next release may write 4.
const CONN_V3: u8 = 3;
const CONN_V4: u8 = 4;
/// Layout 4's sections: the process (host id, pid, start time), the same-host route (gate descriptor and
/// address, control socket name), the engine secret, the TCP route (port, addresses).
const SEC_PROCESS: u64 = 1;
const SEC_LOCAL: u64 = 2;
const SEC_SECRET: u64 = 3;
const SEC_TCP: u64 = 4;
const MAX_CONN_SECTIONS: usize = 64;
const MAX_SECTION: usize = 64 * 1024;
const MAX_ADDRS: usize = 64;

/// This engine's connection info, as it advertises it (layout 3).
fn conn_info(s: &Shared) -> Vec<u8> {
    let mut out = vec![CONN_V3];
    for (_, part) in conn_parts(s) {
        out.extend_from_slice(&part);
    }
    out
}

/// Layout 3 connection info rewritten as layout 4: its parts as sections, those in `drop` left out, `extra`
/// added first (sections a later release might write). For tests and the fuzz target.
pub(crate) fn conn_v3_to_v4(v3: &[u8], drop: &[u64], extra: &[(u64, &[u8])]) -> Result<Vec<u8>> {
    let mut r = Reader { buf: v3, pos: 0 };
    if r.byte()? != CONN_V3 {
        return Err(Error::mismatch("not layout 3 connection info"));
    }
    let mut c = ConnInfo::default();
    let mut sections: Vec<(u64, &[u8])> = extra.to_vec();
    for id in V3_PARTS {
        let at = r.pos;
        read_part(id, &mut r, &mut c)?;
        if !drop.contains(&id) {
            sections.push((id, &v3[at..r.pos]));
        }
    }
    if r.left() != 0 {
        return Err(Error::mismatch("malformed engine connection info"));
    }
    let mut out = vec![CONN_V4];
    put_uvar(&mut out, sections.len() as u64);
    for (id, b) in sections {
        put_uvar(&mut out, id);
        put_bytes(&mut out, b);
    }
    Ok(out)
}

/// The parts of the connection info, in layout 3's order: `host id | pid | start time`, `gate fd | gate address
/// u64 | Unix socket name`, `secret u128`, `TCP port u16 | addresses` (an address `4 | 4 bytes` or `6 | 16 bytes`).
fn conn_parts(s: &Shared) -> [(u64, Vec<u8>); 4] {
    let mut process = Vec::new();
    put_bytes(&mut process, s.host.as_bytes());
    put_uvar(&mut process, s.pid as u64);
    put_uvar(&mut process, s.start_time);
    let mut local = Vec::new();
    put_uvar(&mut local, s.gate.raw_fd() as u64);
    local.extend_from_slice(&s.gate.addr().to_le_bytes());
    put_bytes(&mut local, &s.ctrl.sock_name);
    let mut tcp = s.ctrl.tcp.port.to_le_bytes().to_vec();
    let ips: Vec<IpAddr> = s.ctrl.tcp.addrs.iter().map(|a| a.ip()).take(MAX_ADDRS).collect();
    put_uvar(&mut tcp, ips.len() as u64);
    for ip in ips {
        match ip {
            IpAddr::V4(v4) => {
                tcp.push(4);
                tcp.extend_from_slice(&v4.octets());
            }
            IpAddr::V6(v6) => {
                tcp.push(6);
                tcp.extend_from_slice(&v6.octets());
            }
        }
    }
    [(SEC_PROCESS, process), (SEC_LOCAL, local), (SEC_SECRET, s.secret.to_le_bytes().to_vec()), (SEC_TCP, tcp)]
}

#[derive(Debug, Default)]
struct ConnInfo {
    host: String,
    pid: i32,
    start_time: u64,
    /// The same-host route's part was there (layout 4 may leave it out: then only TCP reaches the peer).
    has_local: bool,
    gate_fd: i32,
    gate_addr: u64,
    sock: Vec<u8>,
    secret: u128,
    /// Empty when the TCP part was left out.
    addrs: Vec<SocketAddr>,
}

fn parse_conn(b: &[u8]) -> Result<ConnInfo> {
    let mut r = Reader { buf: b, pos: 0 };
    let mut c = ConnInfo::default();
    match r.byte()? {
        CONN_V3 => {
            for id in V3_PARTS {
                read_part(id, &mut r, &mut c)?;
            }
            if r.left() != 0 {
                return Err(Error::mismatch("malformed engine connection info"));
            }
        }
        CONN_V4 => {
            let mut seen = Vec::new();
            for _ in 0..r.count(MAX_CONN_SECTIONS)? {
                let id = r.uvar()?;
                let mut sec = Reader { buf: r.bytes(MAX_SECTION)?, pos: 0 };
                if seen.contains(&id) {
                    return Err(Error::mismatch(format!("connection-info section {id} appears twice")));
                }
                seen.push(id);
                // A section it does not know is a route or a part of a later release: skipped.
                read_part(id, &mut sec, &mut c)?;
            }
            if r.left() != 0 || !seen.contains(&SEC_PROCESS) || !seen.contains(&SEC_SECRET) {
                return Err(Error::mismatch("malformed engine connection info"));
            }
        }
        _ => return Err(Error::mismatch("unknown engine connection-info version")),
    }
    Ok(c)
}

/// Layout 3's parts, in its order.
const V3_PARTS: [u64; 4] = [SEC_PROCESS, SEC_LOCAL, SEC_SECRET, SEC_TCP];

/// Read part `id` into `c`; one this release does not know is left unread.
fn read_part(id: u64, r: &mut Reader, c: &mut ConnInfo) -> Result<()> {
    match id {
        SEC_PROCESS => read_process(r, c),
        SEC_LOCAL => read_local(r, c),
        SEC_SECRET => {
            c.secret = u128::from_le_bytes(r.array()?);
            Ok(())
        }
        SEC_TCP => read_tcp(r, c),
        _ => Ok(()),
    }
}

fn read_process(r: &mut Reader, c: &mut ConnInfo) -> Result<()> {
    c.host = r.string(4096)?;
    c.pid = i32::try_from(r.uvar()?)
        .ok()
        .filter(|&p| p > 0)
        .ok_or_else(|| Error::mismatch("bad pid in connection info"))?;
    c.start_time = r.uvar()?;
    Ok(())
}

fn read_local(r: &mut Reader, c: &mut ConnInfo) -> Result<()> {
    c.gate_fd = i32::try_from(r.uvar()?).map_err(|_| Error::mismatch("bad gate in connection info"))?;
    c.gate_addr = u64::from_le_bytes(r.array()?);
    c.sock = r.bytes(108)?.to_vec();
    c.has_local = true;
    Ok(())
}

fn read_tcp(r: &mut Reader, c: &mut ConnInfo) -> Result<()> {
    let port = u16::from_le_bytes(r.array()?);
    if port == 0 {
        return Err(Error::mismatch("TCP port 0 in connection info"));
    }
    let n = r.count(MAX_ADDRS)?;
    c.addrs = Vec::with_capacity(n);
    for _ in 0..n {
        let ip = match r.byte()? {
            4 => IpAddr::from(r.array::<4>()?),
            6 => IpAddr::from(r.array::<16>()?),
            _ => return Err(Error::mismatch("bad address family in connection info")),
        };
        c.addrs.push(SocketAddr::new(ip, port));
    }
    Ok(())
}

/// For `crate::fuzzing` only: the connection-info parser and the notification-frame parser.
/// Whatever parses as layout 3 parses to the same as its layout 4 rewriting.
pub(crate) fn fuzz_parse_conn(b: &[u8]) -> bool {
    let Ok(c) = parse_conn(b) else { return false };
    if let Ok(v4) = conn_v3_to_v4(b, &[], &[(99, b"later")]) {
        let again = parse_conn(&v4).expect("layout 4 rewriting of connection info does not parse");
        assert_eq!(format!("{again:?}"), format!("{c:?}"), "connection info changed across layouts");
    }
    true
}

/// For the fuzz seed corpus: layout 3 connection info as layout 4.
pub(crate) fn fuzz_conn_as_v4(v3: &[u8]) -> Option<Vec<u8>> {
    conn_v3_to_v4(v3, &[], &[(9, b"a section of a later release")]).ok()
}

pub(crate) use ctrl::{fuzz_hello, fuzz_parse_frames};

/// The TCP endpoint a peer's connection info advertises: its addresses and the secret a connection must
/// present. For tools and tests that speak the wire protocol themselves (see `wire`).
#[doc(hidden)]
pub fn tcp_endpoint(conn: &[u8]) -> Result<(Vec<SocketAddr>, u128)> {
    parse_conn(conn).map(|c| (c.addrs, c.secret))
}

/// A peer's registration as its metadata names it; sent with each TCP request so the target can find it, and
/// checked against the target's gate (slot and state from the region's public bytes) on same-host routes.
struct RemoteRegion {
    addr: u64,
    len: u64,
    ticket: RegionTicket,
}

/// What a local registration keeps: its place in the gate.
struct LocalGateRegion(RegionTicket);

fn encode_ticket(t: RegionTicket) -> Vec<u8> {
    let mut out = Vec::with_capacity(8);
    put_uvar(&mut out, t.slot as u64);
    put_uvar(&mut out, t.state);
    out
}

/// `slot | state`, then sections (`id | length | bytes`) a later release may add, each skipped here (this release
/// writes none), as in connection info (see `CONN_V4`).
fn decode_ticket(b: &[u8]) -> Result<RegionTicket> {
    let mut r = Reader { buf: b, pos: 0 };
    let slot = u32::try_from(r.uvar()?).map_err(|_| Error::mismatch("bad region slot in metadata"))?;
    let state = r.uvar()?;
    while r.left() != 0 {
        r.uvar()?;
        r.bytes(MAX_SECTION)?;
    }
    Ok(RegionTicket { slot, state })
}

/// Descriptor `num` of a same-host peer: taken with `pidfd_getfd`, or, where the kernel refuses that (or
/// under `GIXL_TEST_FAULT=no_pidfd_getfd`), asked for over the peer's control socket `sock`
/// (`(socket name, secret, incarnation, pid)`), which sends only what it offers, with SCM_RIGHTS. If both fail
/// the error keeps the EPERM/ENOSYS source (see `cma_denied`). The caller checks what it got (identity,
/// or the gate's own checks).
fn take_peer_fd(
    s: &Shared,
    pidfd: std::os::fd::BorrowedFd<'_>,
    sock: (&[u8], u128, u128, i32),
    num: i32,
) -> Result<OwnedFd> {
    let refused = if s.no_pidfd_getfd {
        std::io::Error::from_raw_os_error(libc::EPERM)
    } else {
        match crate::device::pidfd_getfd(pidfd, num) {
            Ok(f) => return Ok(f),
            Err(e) if matches!(e.raw_os_error(), Some(libc::EPERM) | Some(libc::ENOSYS)) => e,
            Err(e) => {
                let st = if e.raw_os_error() == Some(libc::ESRCH) { Status::RemoteDisconnect } else { Status::Backend };
                return Err(Error::os(st, "taking a descriptor of the peer (pidfd_getfd)", e));
            }
        }
    };
    let (name, secret, inc, pid) = sock;
    match ctrl::request_fd(name, inc, secret, &s.agent, s.incarnation, pid, num) {
        // The listener's pid was the peer's when it bound; if that process still runs (its pidfd), the
        // descriptor came from it and not from a process that took the name over after it exited.
        Ok((f, _)) if pidfd_alive(pidfd) => Ok(f),
        Ok(_) => Err(Error::disconnected("the peer exited while sending a descriptor")),
        Err(e) => Err(Error::os(
            Status::Backend,
            format!("the kernel refused pidfd_getfd, and the peer's control socket did not send the descriptor: {e}"),
            refused,
        )),
    }
}

/// Is the process behind `pidfd` still running? (A pidfd polls readable once it has exited.)
fn pidfd_alive(pidfd: std::os::fd::BorrowedFd<'_>) -> bool {
    let mut p = libc::pollfd { fd: pidfd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd, no wait.
    unsafe { libc::poll(&mut p, 1, 0) == 0 }
}

/// Has the process behind `pidfd` exited? (A pidfd polls readable once it has.) Only measured now.
#[cfg(test)]
fn pidfd_exited(pidfd: &OwnedFd) -> bool {
    let mut p = libc::pollfd { fd: pidfd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd, no wait.
    unsafe { libc::poll(&mut p, 1, 0) > 0 && p.revents != 0 }
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
        // VRAM is advertised as NIXL's UCX plugin does; registering it needs a device layer (`crate::device`).
        Caps { local: true, remote: true, notif: true, mems: vec![MemType::Dram, MemType::Vram] }
    }

    fn params(&self) -> Params {
        [("num_threads".to_owned(), self.shared.threads.to_string())].into_iter().collect()
    }

    fn register(&self, mem: MemType, desc: &RegDesc) -> Result<LocalRegion> {
        if mem == MemType::Vram {
            let r = self.shared.vram.register(&self.shared, desc)?;
            // TCP peers reach it through the serving loops, staged (see `vram_tcp`); `register` checked
            // that the descriptor's device is the allocation's.
            self.shared.regions.add_vram(desc.desc.addr, desc.desc.len, desc.desc.dev as u32);
            return Ok(r);
        }
        if mem != MemType::Dram {
            return Err(Error::not_supported(format!("{} is not supported by this engine", mem.seg_name())));
        }
        let ticket = self.shared.gate.register(desc.desc.addr, desc.desc.len)?;
        self.shared.regions.add(desc.desc.addr, desc.desc.len);
        Ok(LocalRegion { public: encode_ticket(ticket), key: Some(Arc::new(LocalGateRegion(ticket))) })
    }

    fn deregister(&self, mem: MemType, desc: &Desc, key: Option<&RegionKey>) {
        if mem == MemType::Vram {
            // Waits for peers' copies inside the region (see `vram`), then for TCP requests being served
            // from it (see `vram_tcp`).
            self.shared.vram.deregister(&self.shared, key);
            self.shared.regions.remove_vram(desc.addr, desc.len);
            return;
        }
        if mem != MemType::Dram {
            return;
        }
        // Same-host peers first: refuse new batches, wait (bounded) for those inside.
        if let Some(t) = key.and_then(|k| k.downcast_ref::<LocalGateRegion>()) {
            self.shared.gate.retire(t.0, self.shared.tcp_opts.timeout);
        }
        // Waits (bounded) for TCP requests being served from the range, so none touches it after this.
        self.shared.regions.remove(desc.addr, desc.len);
    }

    fn deregister_many(&self, mem: MemType, regions: &[(Desc, Option<RegionKey>)]) {
        if mem != MemType::Dram {
            for (d, k) in regions {
                self.deregister(mem, d, k.as_ref());
            }
            return;
        }
        // Every region refuses new batches first; then one bounded wait for same-host peers inside the gate
        // and one for TCP requests being served, however many regions go.
        let tickets: Vec<_> =
            regions.iter().filter_map(|(_, k)| k.as_ref()?.downcast_ref::<LocalGateRegion>().map(|t| t.0)).collect();
        self.shared.gate.retire_many(&tickets, self.shared.tcp_opts.timeout);
        let ranges: Vec<(u64, u64)> = regions.iter().map(|(d, _)| (d.addr, d.len)).collect();
        self.shared.regions.remove_many(&ranges);
    }

    fn load_remote_region(
        &self,
        peer: &Arc<dyn Peer>,
        mem: MemType,
        desc: &Desc,
        public: &[u8],
    ) -> Result<Option<RegionKey>> {
        if mem == MemType::Vram {
            return vram::load_remote(downcast(peer)?.incarnation, desc, public).map(Some);
        }
        let ticket = decode_ticket(public)?;
        Ok(Some(Arc::new(RemoteRegion { addr: desc.addr, len: desc.len, ticket })))
    }

    fn conn_info(&self) -> Vec<u8> {
        conn_info(&self.shared)
    }

    fn load_peer(&self, agent: &str, incarnation: u128, conn: &[u8]) -> Result<Arc<dyn Peer>> {
        let s = &self.shared;
        let ci = parse_conn(conn)?;
        let same_host = ci.host == s.host;
        let mut addrs = ci.addrs.clone();
        if same_host {
            addrs.sort_by_key(|a| !a.ip().is_loopback());
        } else {
            // Another host's loopback is our own: connecting there would hand the secret to a local stranger.
            addrs.retain(|a| !a.ip().is_loopback());
        }
        let dead = Arc::new(AtomicBool::new(false));
        let link = |dead: &Arc<AtomicBool>| {
            // A TCP-only peer recovers from transient failures; a CMA peer's liveness is its pidfd's.
            let recover = !same_host || s.transport == Transport::Tcp || !ci.has_local;
            let t = LinkTarget { peer: agent, incarnation, secret: ci.secret, addrs: addrs.clone(), recover };
            TcpLink::new(&s.ctrl.tcp, &s.agent, t, dead.clone())
        };
        if !same_host || s.transport == Transport::Tcp || !ci.has_local {
            if addrs.is_empty() {
                return Err(Error::backend(format!(
                    "agent '{agent}' runs on another host but advertises no address reachable from here"
                )));
            }
            let kind = PeerKind::Tcp { link: link(&dead) };
            let why = match (same_host, ci.has_local) {
                (false, _) => "another host, or another pid or network namespace",
                (true, false) => "its connection info offers no same-host route",
                (true, true) => "GIXL_TRANSPORT=tcp",
            };
            crate::telemetry::log::info(&format!(
                "agent '{}': peer '{agent}' (incarnation {incarnation:032x}) route tcp ({why})",
                s.agent
            ));
            return Ok(Arc::new(EnginePeer { name: agent.to_owned(), incarnation, kind, dead }));
        }
        // In process only to an engine that lives here under that incarnation, whatever the connection info
        // says; an incarnation of this process that is not in the registry was destroyed (or never existed).
        let local = registry().lock().get(&incarnation).and_then(Weak::upgrade);
        // Why the kernel refused the peer's gate (so cross-memory attach): its data goes over TCP.
        let mut fallback = None;
        let kind = if let Some(t) = local {
            let gate = Some(gate::attach_shared((s.pid, s.start_time, incarnation), || Ok(t.gate.clone()))?);
            PeerKind::InProcess { target: Arc::downgrade(&t), gate }
        } else if ci.pid == s.pid && ci.start_time == s.start_time {
            PeerKind::InProcess { target: Weak::new(), gate: None }
        } else {
            let proof = s.prove(&ci, incarnation)?;
            if proof.is_none() {
                dead.store(true, Ordering::Release);
            }
            let denied = proof.as_ref().and_then(|p| p.denied.clone());
            let tcp = link(&dead);
            fallback.clone_from(&denied);
            PeerKind::Cma {
                pid: ci.pid,
                gate: proof.as_ref().and_then(|p| p.gate.clone()),
                proof,
                probe: copy::Probe { addr: ci.gate_addr, incarnation },
                sock: ci.sock.clone(),
                secret: ci.secret,
                from_inc: s.incarnation,
                local_refused: AtomicBool::new(false),
                sender: Mutex::new(None),
                tcp,
                denied: AtomicBool::new(denied.is_some()),
            }
        };
        let route = match &kind {
            PeerKind::Cma { .. } if fallback.is_some() => None,
            PeerKind::Cma { .. } => Some("cma"),
            PeerKind::InProcess { .. } => Some("in-process"),
            PeerKind::Tcp { .. } => Some("tcp"),
        };
        match (route, &fallback) {
            (Some(route), _) => crate::telemetry::log::info(&format!(
                "agent '{}': peer '{agent}' (incarnation {incarnation:032x}) route {route} (same host)",
                s.agent
            )),
            (None, why) => crate::telemetry::log::warn(&format!(
                "agent '{}': peer '{agent}' (incarnation {incarnation:032x}) route tcp (fall-back: the kernel \
                 denied cross-memory attach: {}; `python -m gixl doctor` says why)",
                s.agent,
                why.as_deref().unwrap_or("")
            )),
        }
        Ok(Arc::new(EnginePeer { name: agent.to_owned(), incarnation, kind, dead }))
    }

    fn connect(&self, peer: &Arc<dyn Peer>) -> Result<()> {
        let p = downcast(peer)?;
        if p.disconnected() {
            return Err(crate::backend::disconnected(&p.name, p));
        }
        match &p.kind {
            PeerKind::Cma { sock, sender, secret, from_inc, local_refused, .. } => {
                let mut s = sender.lock();
                if s.is_none() && !local_refused.load(Ordering::Acquire) {
                    match Sender::connect(sock, p.incarnation, *secret, &self.shared.agent, *from_inc) {
                        Ok(c) => *s = Some(c),
                        // Another uid: notifications will go over TCP.
                        Err(e) if e.status() == Status::NotAllowed => local_refused.store(true, Ordering::Release),
                        Err(e) => return Err(e),
                    }
                }
            }
            PeerKind::Tcp { link } => {
                link.connect()?;
            }
            PeerKind::InProcess { .. } => {}
        }
        Ok(())
    }

    fn disconnect(&self, peer: &Arc<dyn Peer>) {
        if let Ok(p) = downcast(peer) {
            match &p.kind {
                PeerKind::Cma { sender, tcp, .. } => {
                    sender.lock().take();
                    tcp.close();
                }
                PeerKind::Tcp { link } => link.close(),
                PeerKind::InProcess { .. } => {}
            }
        }
    }

    fn prep_xfer(&self, plan: XferPlan) -> Result<Box<dyn BackendXfer>> {
        let wants = vram::wants(&plan);
        // VRAM to a peer reached over TCP is staged (see `vram_tcp`); other VRAM routes are `vram`'s.
        let link = if wants { vram_tcp::tcp_link(&plan)? } else { None };
        let vram_tcp = match link {
            Some(link) => Some(vram_tcp::prep(&plan, link)?),
            None => None,
        };
        let vram = if wants && vram_tcp.is_none() { Some(vram::prep(&self.shared, &plan)?) } else { None };
        if !wants && (plan.local_mem != MemType::Dram || plan.remote_mem != MemType::Dram) {
            return Err(Error::not_supported("this engine moves DRAM and VRAM only"));
        }
        let route = match &plan.target {
            Target::Local => Route::Loopback,
            Target::Remote(p) => {
                downcast(p)?;
                Route::Peer(p.clone())
            }
        };
        let core = Arc::new(Core { shared: self.shared.clone(), plan, route, vram, vram_tcp });
        Ok(Box::new(EngineXfer { core, run: Mutex::new(None) }))
    }

    fn notifs(&self, out: &mut Vec<(String, Vec<u8>)>) -> Result<()> {
        // Read ready local sockets in this thread rather than wait for the progress thread to run.
        self.shared.ctrl.drain();
        out.append(&mut self.shared.queue.lock());
        // Control connections paused for a full queue may be read again.
        self.shared.ctrl.tcp.notifs_taken();
        Ok(())
    }

    fn shutdown(&self) {
        self.shared.shutdown();
    }

    fn gen_notif(&self, target: &Target, msg: &[u8]) -> Result<()> {
        if msg.len() > notif::MAX_NOTIF {
            return Err(Error::invalid_param(format!(
                "notification of {} bytes exceeds the {}-byte limit",
                msg.len(),
                notif::MAX_NOTIF
            )));
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
    /// Set when the request touches VRAM: its copies go through `vram` (inside the same gate).
    vram: Option<vram::VramPlan>,
    /// Set instead when it touches VRAM and its peer is reached over TCP.
    vram_tcp: Option<vram_tcp::TcpVramPlan>,
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

    /// The remote regions this request may touch, as (gate slot, state, address, length).
    fn gate_regions(&self) -> impl Iterator<Item = (u32, u64, u64, u64)> + Clone + '_ {
        self.plan.remote_keys.iter().map(|k| {
            match k.as_ref().and_then(|k| k.downcast_ref::<RemoteRegion>()) {
                Some(r) => (r.ticket.slot, r.ticket.state, r.addr, r.len),
                // Never for this engine's plans; refused by the gate if it happens.
                None => (u32::MAX, 0, 0, 0),
            }
        })
    }

    /// Copy `segs` by whichever route this request takes. Same-host routes go batch by batch, each inside
    /// the target's gate.
    fn copy(&self, segs: &[Seg], run: &Run) -> Result<()> {
        if self.shared.panic_copies {
            panic!("injected copy-worker panic (GIXL_TEST_FAULT=copy_panic)");
        }
        if let Some(v) = &self.vram {
            return v.copy(self, segs, run);
        }
        if let Some(v) = &self.vram_tcp {
            return v.copy(self, segs, run);
        }
        let op = self.plan.op;
        let stopped = || Error::new(Status::Canceled, "transfer stopped");
        let Some(p) = self.peer() else {
            // SAFETY: loopback: the agent resolved both sides against this agent's own registrations.
            unsafe { copy::local_copy(op, segs) };
            return Ok(());
        };
        match &p.kind {
            PeerKind::InProcess { gate, .. } => {
                let gate = gate
                    .as_ref()
                    .ok_or_else(|| Error::disconnected(format!("agent '{}' has been destroyed", p.name)))?;
                copy::for_batches(segs, usize::MAX, copy::BATCH_BYTES, &mut |b| {
                    if run.abort.load(Ordering::Relaxed) {
                        return Err(stopped());
                    }
                    let _inside = gate.enter(self.gate_regions())?;
                    // SAFETY: local ranges were resolved against this agent's registrations; remote ones are
                    // inside registrations the target still holds (the gate), which it cannot drop while we
                    // are inside.
                    unsafe { copy::local_copy(op, b) };
                    Ok(())
                })
            }
            PeerKind::Tcp { link } => self.tcp_copy(link, segs, run),
            PeerKind::Cma { tcp, denied, .. } if denied.load(Ordering::Acquire) => self.tcp_copy(tcp, segs, run),
            PeerKind::Cma { pid, gate, probe, tcp, denied, .. } => {
                let gate =
                    gate.as_ref().ok_or_else(|| Error::disconnected(format!("agent '{}' is not reachable", p.name)))?;
                let mut gone = false;
                let r = copy::for_batches(segs, copy::BATCH_SEGS, copy::BATCH_BYTES, &mut |b| {
                    if run.abort.load(Ordering::Relaxed) || p.gone() {
                        return Err(stopped());
                    }
                    // Identity is checked inside the call itself: its first iovec is the incarnation's gate
                    // (see `copy::cma_batch`), which an exec'd image or a process that took over the pid does
                    // not map. (A pidfd poll here would cost a syscall per batch and still miss exec.)
                    let inside = gate.enter(self.gate_regions());
                    if let Err(e) = &inside {
                        gone = e.status() == Status::RemoteDisconnect;
                    }
                    let _inside = inside?;
                    // SAFETY: local ranges were resolved against this agent's registrations.
                    unsafe { copy::cma_batch(*pid, op, b, probe, gate.gate.sentinel(), &mut gone) }
                });
                if r.as_ref().err().is_some_and(cma_denied) {
                    // The kernel checks permission before moving a byte, so nothing was copied: go by TCP.
                    if !denied.swap(true, Ordering::AcqRel) {
                        let why = r.as_ref().err().map(|e| e.to_string()).unwrap_or_default();
                        crate::telemetry::log::warn(&format!(
                            "agent '{}': peer '{}' route tcp (fall-back: the kernel denied cross-memory attach: {why}; \
                             `python -m gixl doctor` says why)",
                            self.shared.agent,
                            self.peer().map(|p| p.name.as_str()).unwrap_or("")
                        ));
                    }
                    return self.tcp_copy(tcp, segs, run);
                }
                if gone {
                    p.dead.store(true, Ordering::Release);
                }
                if r.is_err() && p.gone() {
                    return Err(Error::disconnected(format!("agent '{}' exited during the transfer", p.name)));
                }
                r
            }
        }
    }

    /// `copy`, with any failure, a panic included, recorded on the request (never unwinding further).
    fn guarded_copy(&self, segs: &[Seg], run: &Run) {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.copy(segs, run))) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => run.fail(e),
            Err(_) => run.fail(Error::backend("a copy worker panicked; this request failed (the agent stays usable)")),
        }
    }

    fn tcp_copy(&self, link: &TcpLink, segs: &[Seg], run: &Run) -> Result<()> {
        let keys = &self.plan.remote_keys;
        let region = |s: &Seg| {
            keys.get(s.rreg as usize)
                .and_then(|k| k.as_ref())
                .and_then(|k| k.downcast_ref::<RemoteRegion>())
                .map_or((s.remote, s.len), |r| (r.addr, r.len))
        };
        let stop = || run.abort.load(Ordering::Relaxed);
        link.run(self.plan.op, segs, &region, &stop)
    }

    /// The link of a request that goes over TCP from the start (heartbeats run while it is in flight).
    fn tcp_link(&self) -> Option<&Arc<TcpLink>> {
        match self.peer().map(|p| &p.kind) {
            Some(PeerKind::Tcp { link }) => Some(link),
            Some(PeerKind::InProcess { .. } | PeerKind::Cma { .. }) | None => None,
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
        if let Some(link) = self.tcp_link() {
            link.end();
        }
        run.state.store(state as i32, Ordering::Release);
        let _g = run.idle_lock.lock();
        run.idle.notify_all();
    }
}

/// Did cross-memory attach fail because the kernel forbids it here (not because the peer is gone)?
fn cma_denied(e: &Error) -> bool {
    std::error::Error::source(e)
        .and_then(|s| s.downcast_ref::<std::io::Error>())
        .and_then(|io| io.raw_os_error())
        .is_some_and(|c| c == libc::EPERM || c == libc::ENOSYS)
}

impl BackendXfer for EngineXfer {
    fn post(&self, notif: Option<&[u8]>) -> Result<Status> {
        let core = &self.core;
        if core.shared.closed.load(Ordering::Acquire) {
            return Err(Error::backend("the agent that made this request has been destroyed"));
        }
        if let Some(p) = core.peer() {
            if p.disconnected() {
                return Err(crate::backend::disconnected(&p.name, p));
            }
        }
        let plan = &core.plan;
        let tcp = core.tcp_link();
        if let Some(link) = tcp {
            // The control connection carries the heartbeats that bound this request.
            link.connect()?;
        }
        let (pieces, inline) = match tcp {
            Some(_) if plan.total_bytes <= TCP_INLINE_BYTES => (1, true),
            Some(_) => ((plan.total_bytes / MIN_PIECE).clamp(1, core.shared.tcp_opts.conns as u64) as usize, false),
            None if plan.total_bytes <= INLINE_BYTES || core.shared.threads <= 1 => (1, true),
            None => ((plan.total_bytes / MIN_PIECE).clamp(1, core.shared.threads as u64) as usize, false),
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
        if let Some(link) = tcp {
            link.begin();
        }
        if inline {
            core.guarded_copy(&plan.segs, &run);
            core.finish(&run);
            return self.status();
        }
        let parts = split(&plan.segs, plan.total_bytes, pieces);
        run.pending.store(parts.len(), Ordering::Release);
        let pool = if tcp.is_some() { &core.shared.tcp_pool } else { &core.shared.pool };
        for part in parts {
            let (core, run) = (core.clone(), run.clone());
            pool.submit(Box::new(move || {
                if !run.abort.load(Ordering::Relaxed) {
                    core.guarded_copy(&part, &run);
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
                // A dead peer is reported without waiting for the copy threads to notice it by themselves,
                // but only once they have stopped: a terminal status means nothing touches the buffers.
                if let Some(p) = self.core.peer() {
                    if p.disconnected() {
                        self.abort();
                        return Err(crate::backend::disconnected(&p.name, p));
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

impl Drop for EngineXfer {
    /// Whoever drops the request may free its buffers next: no copy of it may still run.
    fn drop(&mut self) {
        self.abort();
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

    fn conn_bytes(addrs: &[(u8, &[u8])]) -> Vec<u8> {
        let mut b = vec![CONN_V3];
        put_bytes(&mut b, b"h");
        put_uvar(&mut b, 42);
        put_uvar(&mut b, 7);
        put_uvar(&mut b, 3);
        b.extend_from_slice(&(1u64 << 41).to_le_bytes());
        put_bytes(&mut b, b"sock");
        b.extend_from_slice(&99u128.to_le_bytes());
        b.extend_from_slice(&4242u16.to_le_bytes());
        put_uvar(&mut b, addrs.len() as u64);
        for (fam, ip) in addrs {
            b.push(*fam);
            b.extend_from_slice(ip);
        }
        b
    }

    /// What the gate adds per batch of a same-host transfer, measured in this process (run by hand:
    /// `cargo test --release --lib measure_gate_cost -- --ignored --nocapture`).
    #[test]
    #[ignore = "a measurement, not a check"]
    fn measure_gate_cost() {
        let g = Arc::new(Gate::create(3).unwrap());
        let t = g.register(0x10000, 0x10000).unwrap();
        let a = Attached::new(g.clone()).unwrap();
        let pidfd = pidfd_open(std::process::id() as i32).unwrap();
        let n = 200_000;
        let per = |t0: Instant| t0.elapsed().as_nanos() as f64 / n as f64;
        let t0 = Instant::now();
        for _ in 0..n {
            let _i = std::hint::black_box(a.enter([(t.slot, t.state, 0x10000, 0x1000)]).unwrap());
        }
        let enter = per(t0);
        let t0 = Instant::now();
        for _ in 0..n {
            assert!(!pidfd_exited(std::hint::black_box(&pidfd)));
        }
        let poll = per(t0);
        let src = vec![1u8; 4096];
        let mut dst = vec![0u8; 4096];
        let s = Seg {
            local: dst.as_mut_ptr() as u64,
            remote: src.as_ptr() as u64,
            len: 4096,
            ldev: 0,
            rdev: 0,
            lreg: 0,
            rreg: 0,
        };
        let me = std::process::id() as i32;
        let probe = copy::Probe { addr: g.addr(), incarnation: 3 };
        let absent = std::sync::atomic::AtomicU32::new(0);
        let t0 = Instant::now();
        for _ in 0..n {
            let mut gone = false;
            unsafe { copy::cma_batch(me, XferOp::Read, &[s], &probe, &absent, &mut gone) }.unwrap();
        }
        let with_probe = per(t0);
        let t0 = Instant::now();
        for _ in 0..n {
            let mut gone = false;
            unsafe { copy::cma_batch(me, XferOp::Read, &[s], &probe, g.sentinel(), &mut gone) }.unwrap();
        }
        let with_sentinel = per(t0);
        let (l, r) = (
            libc::iovec { iov_base: s.local as *mut _, iov_len: 4096 },
            libc::iovec { iov_base: s.remote as *mut _, iov_len: 4096 },
        );
        let t0 = Instant::now();
        for _ in 0..n {
            assert_eq!(unsafe { libc::process_vm_readv(me, &l, 1, &r, 1, 0) }, 4096);
        }
        let bare = per(t0);
        // The VRAM route's bracket: its copies are not cross-memory attach, so the probe is a call of its own.
        let t0 = Instant::now();
        for _ in 0..n {
            copy::probe(me, std::hint::black_box(&probe), &mut false).unwrap();
        }
        let alone = per(t0);
        eprintln!(
            "gate per batch: enter+leave {enter:.0} ns; 4 KiB process_vm_readv {bare:.0} ns bare vs {with_probe:.0} ns \
             with the probe iovec (+{:.0} ns), {with_sentinel:.0} ns watched by the sentinel (reads); added per \
             write batch ≈ {:.2} µs (a pidfd poll, not done, would add {poll:.0} ns more); the probe as a call \
             of its own {alone:.0} ns",
            with_probe - bare,
            (enter + with_probe - bare) / 1000.0
        );
    }

    /// A disconnect reported by `status` is terminal only once no copy thread works on the request any more,
    /// and a request whose target is destroyed mid-copy leaves nothing running.
    #[test]
    fn terminal_status_only_after_workers_stop() {
        const SIZE: usize = 256 << 20;
        let init = |name: &str| BackendInit {
            agent_name: name.into(),
            incarnation: crate::util::random_u128(),
            params: [("num_threads".to_owned(), "2".to_owned())].into_iter().collect(),
            num_workers: 0,
        };
        let a = Engine::new(init("ct-A")).unwrap();
        let bi = init("ct-B");
        let binc = bi.incarnation;
        let b = Engine::new(bi).unwrap();
        let src = vec![1u8; SIZE];
        let dst = vec![0u8; SIZE];
        let rd = RegDesc { desc: Desc::new(dst.as_ptr() as u64, SIZE as u64, 0), meta: vec![] };
        let lr = b.register(MemType::Dram, &rd).unwrap();
        let peer = a.load_peer("ct-B", binc, &b.conn_info()).unwrap();
        let key = a.load_remote_region(&peer, MemType::Dram, &rd.desc, &lr.public).unwrap();
        let seg = Seg {
            local: src.as_ptr() as u64,
            remote: dst.as_ptr() as u64,
            len: SIZE as u64,
            ldev: 0,
            rdev: 0,
            lreg: 0,
            rreg: 0,
        };
        let plan = XferPlan {
            op: XferOp::Write,
            local_mem: MemType::Dram,
            remote_mem: MemType::Dram,
            segs: vec![seg],
            local_keys: vec![None],
            remote_keys: vec![key],
            target: Target::Remote(peer.clone()),
            total_bytes: SIZE as u64,
        };
        let route = Route::Peer(peer.clone());
        let x = EngineXfer {
            core: Arc::new(Core { shared: a.shared.clone(), plan, route, vram: None, vram_tcp: None }),
            run: Mutex::new(None),
        };
        assert_eq!(x.post(None).unwrap(), Status::InProg);
        let probe = (dst.as_ptr() as usize + SIZE / 2 + (8 << 20)) as *const u8;
        // SAFETY: `dst` lives to the end of the test; volatile because a copy thread writes it.
        while unsafe { std::ptr::read_volatile(probe) } == 0 {
            std::hint::spin_loop();
        }
        drop(b);
        let t = Instant::now();
        let st = loop {
            match x.status() {
                Ok(Status::InProg) if t.elapsed() < Duration::from_secs(20) => std::thread::yield_now(),
                other => break other,
            }
        };
        let run = x.run.lock().clone().unwrap();
        assert_eq!(st.as_ref().err().map(|e| e.status()), Some(Status::RemoteDisconnect), "{st:?}");
        assert_eq!(run.pending.load(Ordering::Acquire), 0, "a copy thread still works on a terminal request");
        assert_ne!(run.state.load(Ordering::Acquire), Status::InProg as i32);
    }

    #[test]
    fn conn_info_round_trip_and_garbage() {
        assert!(parse_conn(b"").is_err());
        assert!(parse_conn(&[2, 0]).is_err());
        assert!(parse_conn(&[3, 0]).is_err());
        let b = conn_bytes(&[(4, &[192, 0, 2, 1]), (6, &[0; 16])]);
        let c = parse_conn(&b).unwrap();
        assert_eq!((c.host.as_str(), c.pid, c.start_time, c.sock.as_slice(), c.secret), ("h", 42, 7, &b"sock"[..], 99));
        assert_eq!((c.gate_fd, c.gate_addr), (3, 1 << 41));
        assert_eq!(c.addrs, vec!["192.0.2.1:4242".parse().unwrap(), "[::]:4242".parse().unwrap()]);
        for n in 0..b.len() {
            assert!(parse_conn(&b[..n]).is_err(), "prefix {n}");
        }
        let mut t = b.clone();
        t.push(0);
        assert!(parse_conn(&t).is_err());
        assert!(parse_conn(&conn_bytes(&[(5, &[1, 2, 3, 4])])).is_err());
    }

    /// Layout 4: the same fields as layout 3 in sections; unknown sections (and bytes after the known fields of a
    /// known one) skipped; a section twice, or without the process or the secret, refused; every prefix refused.
    #[test]
    fn conn_info_v4_skips_what_it_does_not_know() {
        let v3 = conn_bytes(&[(4, &[192, 0, 2, 1])]);
        let want = parse_conn(&v3).unwrap();
        let v4 = conn_v3_to_v4(&v3, &[], &[(77, b"a route of a later release"), (5, b"")]).unwrap();
        let c = parse_conn(&v4).unwrap();
        assert_eq!(format!("{c:?}"), format!("{want:?}"));
        for n in 0..v4.len() {
            assert!(parse_conn(&v4[..n]).is_err(), "prefix {n}");
        }
        let mut t = v4.clone();
        t.push(0);
        assert!(parse_conn(&t).is_err(), "trailing byte after the sections");
        // A field added at the end of a known section.
        let mut longer = vec![CONN_V4, 2];
        put_uvar(&mut longer, SEC_PROCESS);
        put_bytes(&mut longer, &[1, b'h', 42, 7, 0xEE, 0xEE]);
        put_uvar(&mut longer, SEC_SECRET);
        put_bytes(&mut longer, &99u128.to_le_bytes());
        let c = parse_conn(&longer).unwrap();
        assert_eq!((c.host.as_str(), c.pid, c.start_time, c.secret, c.has_local), ("h", 42, 7, 99, false));
        assert!(c.addrs.is_empty());
        assert!(parse_conn(&conn_v3_to_v4(&v3, &[SEC_PROCESS], &[]).unwrap()).is_err(), "no process section");
        assert!(parse_conn(&conn_v3_to_v4(&v3, &[SEC_SECRET], &[]).unwrap()).is_err(), "no secret");
        assert!(parse_conn(&conn_v3_to_v4(&v3, &[], &[(SEC_TCP, &[1, 1, 0])]).unwrap()).is_err(), "a section twice");
        // Region tickets: sections after slot and state are skipped.
        let mut ticket = encode_ticket(RegionTicket { slot: 5, state: 9 });
        assert_eq!(decode_ticket(&ticket).unwrap(), RegionTicket { slot: 5, state: 9 });
        put_uvar(&mut ticket, 31);
        put_bytes(&mut ticket, b"later");
        assert_eq!(decode_ticket(&ticket).unwrap(), RegionTicket { slot: 5, state: 9 });
        ticket.push(3);
        assert!(decode_ticket(&ticket).is_err());
    }

    /// An agent loads a peer's metadata whose connection info is layout 4 with a section for a route it does not
    /// know, and transfers over the routes both share; without the same-host section it goes by TCP.
    #[test]
    fn metadata_of_a_later_release_loads_and_transfers() {
        let b = Agent::new("v4-target", AgentConfig::default()).unwrap();
        b.create_backend("UCX", &Params::new()).unwrap();
        let a = Agent::new("v4-initiator", AgentConfig::default()).unwrap();
        a.create_backend("UCX", &Params::new()).unwrap();
        let src: Vec<u8> = (0..1 << 16).map(|i| (i % 253) as u8).collect();
        let dst = vec![0u8; 1 << 16];
        reg(&b, &src);
        reg(&a, &dst);
        for (drop, route) in [(&[][..], "in-process"), (&[SEC_LOCAL][..], "tcp")] {
            let mut md = AgentMd::decode(&b.local_md().unwrap()).unwrap();
            md.conns[0].1 = conn_v3_to_v4(&md.conns[0].1, drop, &[(42, &[7; 40])]).unwrap();
            a.load_remote_md(&md.encode()).unwrap();
            let got = a.inner.remotes.read().get("v4-target").unwrap().telemetry_row().route;
            assert_eq!(got, route);
            let r = a.create_xfer_req(
                XferOp::Read,
                &xl(&dst, 0, 1 << 16),
                &xl(&src, 0, 1 << 16),
                "v4-target",
                &XferOpts::default(),
            );
            let r = r.unwrap();
            a.post_xfer_req(&r, NotifUpdate::Keep).unwrap();
            assert_eq!(wait(&a, &r, Duration::from_secs(10)).unwrap(), Status::Success, "{route}");
            assert!(dst == src);
            a.invalidate_remote_md("v4-target").unwrap();
        }
    }

    // ----- the TCP route between two agents of this process (`transport=tcp`) -----

    use crate::agent::{Agent, AgentConfig, NotifUpdate, XferOpts};
    use crate::backend::XferOp;
    use crate::md::AgentMd;
    use crate::mem::{RegDList, XferDList};
    use std::io::{Read, Write};
    use std::net::TcpStream;

    /// The TCP link `a` holds to the loaded peer `name`.
    fn tcp_link_of(a: &Agent, name: &str) -> Arc<tcp::TcpLink> {
        let remotes = a.inner.remotes.read();
        let (_, p) = remotes.get(name).unwrap().peers[0].clone();
        match &downcast(&p).unwrap().kind {
            PeerKind::Tcp { link } => link.clone(),
            PeerKind::InProcess { .. } | PeerKind::Cma { .. } => panic!("not a TCP peer"),
        }
    }

    /// Put a data connection to a stand-in target, which `serve` answers on a thread, in `link`'s pool of idle
    /// connections: the next request takes it.
    fn plant(link: &tcp::TcpLink, serve: impl FnOnce(TcpStream) + Send + 'static) -> std::thread::JoinHandle<()> {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let planted = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let h = std::thread::spawn(move || serve(l.accept().unwrap().0));
        link.plant_idle(planted);
        h
    }

    fn tcp_agent(name: &str, extra: &[(&str, &str)]) -> Agent {
        let a = Agent::new(name, AgentConfig::default()).unwrap();
        let mut p: Params = [("transport", "tcp"), ("tcp_addr", "127.0.0.1")]
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        for (k, v) in extra {
            p.insert(k.to_string(), v.to_string());
        }
        a.create_backend("UCX", &p).unwrap();
        a
    }

    fn reg(a: &Agent, buf: &[u8]) -> RegDList {
        let l = RegDList::with_descs(
            MemType::Dram,
            vec![RegDesc { desc: Desc::new(buf.as_ptr() as u64, buf.len() as u64, 0), meta: vec![] }],
        );
        a.register_mem(&l, &[]).unwrap();
        l
    }

    fn xl(buf: &[u8], off: usize, len: usize) -> XferDList {
        XferDList::with_descs(MemType::Dram, vec![Desc::new(buf.as_ptr() as u64 + off as u64, len as u64, 0)])
    }

    fn wait(a: &Agent, r: &crate::agent::XferReq, limit: Duration) -> Result<Status> {
        let t = Instant::now();
        loop {
            match a.xfer_status(r)? {
                Status::InProg if t.elapsed() < limit => std::thread::sleep(Duration::from_micros(200)),
                s => return Ok(s),
            }
        }
    }

    fn notifs_until(a: &Agent, n: usize) -> Vec<(String, Vec<u8>)> {
        let t = Instant::now();
        let mut got = Vec::new();
        while got.len() < n && t.elapsed() < Duration::from_secs(10) {
            got.extend(a.notifs(&[]).unwrap());
            std::thread::sleep(Duration::from_millis(2));
        }
        got
    }

    /// A pooled data connection that the target closes after the initiator checked it for a hang-up (the target
    /// replaced it, its serving slots being full, or it had idled past `IDLE_DATA`): the request goes once more
    /// over another connection and succeeds. The link went down, and the READ failed with REMOTE_DISCONNECT.
    #[test]
    fn a_pooled_connection_closed_under_the_first_request_is_tried_once_more() {
        let a = tcp_agent("pool-A", &[]);
        let b = tcp_agent("pool-B", &[]);
        let src: Vec<u8> = (0..65536).map(|i| (i % 239) as u8).collect();
        let dst = vec![0u8; 65536];
        reg(&a, &dst);
        reg(&b, &src);
        a.load_remote_md(&b.local_md().unwrap()).unwrap();
        let read = || {
            let r = a.create_xfer_req(
                XferOp::Read,
                &xl(&dst, 0, 65536),
                &xl(&src, 0, 65536),
                "pool-B",
                &XferOpts::default(),
            );
            let r = r.unwrap();
            a.post_xfer_req(&r, NotifUpdate::Keep).and_then(|_| wait(&a, &r, Duration::from_secs(10)))
        };
        assert_eq!(read().unwrap(), Status::Success);
        // A connection that looks healthy until a request arrives, then is closed unanswered.
        let closer = plant(&tcp_link_of(&a, "pool-B"), |mut s| {
            let mut b = [0u8; 1];
            let _ = s.read(&mut b);
        });
        assert_eq!(read().map_err(|e| e.status()), Ok(Status::Success));
        assert!(dst == src);
        closer.join().unwrap();
        assert_eq!(read().unwrap(), Status::Success, "the link stayed up");
    }

    /// A target that answers heartbeats but takes longer than the data connections' socket timeout (the stall
    /// bound, 5 s) to serve a request, as one serving many peers on few cores does: the request is waited for
    /// and succeeds, and the link stays up. Before, the socket timeout took the link down and the READ failed
    /// with REMOTE_DISCONNECT although the peer was alive.
    #[test]
    fn a_slow_target_that_answers_heartbeats_is_waited_for() {
        let a = tcp_agent("slow-A", &[("disconnect_timeout_ms", "1000")]);
        let b = tcp_agent("slow-B", &[]);
        let len = 65536;
        let src = vec![7u8; len];
        let dst = vec![0u8; len];
        reg(&a, &dst);
        reg(&b, &src);
        a.load_remote_md(&b.local_md().unwrap()).unwrap();
        let read = || {
            let r =
                a.create_xfer_req(XferOp::Read, &xl(&dst, 0, len), &xl(&src, 0, len), "slow-B", &XferOpts::default());
            let r = r.unwrap();
            a.post_xfer_req(&r, NotifUpdate::Keep).and_then(|_| wait(&a, &r, Duration::from_secs(30)))
        };
        assert_eq!(read().unwrap(), Status::Success);
        // A data connection whose far end takes the request and answers 6 s later with other bytes (B itself
        // keeps answering the heartbeats on the control connection meanwhile).
        let server = plant(&tcp_link_of(&a, "slow-B"), move |mut s| {
            let mut req = [0u8; 256];
            let _ = s.read(&mut req).unwrap();
            std::thread::sleep(Duration::from_secs(6));
            s.write_all(&wire::encode_reply(wire::REPLY_OK)).unwrap();
            s.write_all(&vec![9u8; len]).unwrap();
        });
        let t0 = Instant::now();
        assert_eq!(read().map_err(|e| e.status()), Ok(Status::Success), "a slow peer is not a dead one");
        assert!(t0.elapsed() >= Duration::from_secs(6));
        assert!(dst.iter().all(|&x| x == 9), "the slow connection's bytes landed");
        server.join().unwrap();
        assert_eq!(read().unwrap(), Status::Success, "the link stayed up");
        assert!(dst == src);
    }

    #[test]
    fn tcp_read_write_many_blocks_and_notifications() {
        let a = tcp_agent("tcp-A", &[]);
        let b = tcp_agent("tcp-B", &[("tcp_conns", "3")]);
        let size = 12 << 20;
        let src: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
        let dst = vec![0u8; size];
        reg(&a, &dst);
        reg(&b, &src);
        a.load_remote_md(&b.local_md().unwrap()).unwrap();

        // One large READ, split across data connections, with a notification after the data.
        let opts = XferOpts { notif: Some(b"big\0done".to_vec()), ..Default::default() };
        let r = a.create_xfer_req(XferOp::Read, &xl(&dst, 0, size), &xl(&src, 0, size), "tcp-B", &opts).unwrap();
        a.post_xfer_req(&r, NotifUpdate::Keep).unwrap();
        assert_eq!(wait(&a, &r, Duration::from_secs(20)).unwrap(), Status::Success);
        assert!(dst == src);
        assert_eq!(notifs_until(&b, 1), vec![("tcp-A".to_string(), b"big\0done".to_vec())]);

        // 1000 separate small WRITEs in reversed order (nothing merges), then a small inline one.
        let bs = 4096;
        let n = 1000;
        let wsrc: Vec<u8> = (0..n * bs).map(|i| (i / bs) as u8 ^ 0x5a).collect();
        reg(&a, &wsrc);
        let wdst = vec![0u8; n * bs];
        reg(&b, &wdst);
        a.load_remote_md(&b.local_md().unwrap()).unwrap();
        let l = XferDList::with_descs(
            MemType::Dram,
            (0..n).map(|i| Desc::new(wsrc.as_ptr() as u64 + (i * bs) as u64, bs as u64, 0)).collect(),
        );
        let rl = XferDList::with_descs(
            MemType::Dram,
            (0..n).rev().map(|i| Desc::new(wdst.as_ptr() as u64 + (i * bs) as u64, bs as u64, 0)).collect(),
        );
        let w = a.create_xfer_req(XferOp::Write, &l, &rl, "tcp-B", &XferOpts::default()).unwrap();
        assert_eq!(w.desc_count(), n as u64);
        a.post_xfer_req(&w, NotifUpdate::Set(b"blocks".to_vec())).unwrap();
        assert_eq!(wait(&a, &w, Duration::from_secs(20)).unwrap(), Status::Success);
        for i in 0..n {
            assert_eq!(wdst[(n - 1 - i) * bs], (i as u8) ^ 0x5a, "block {i}");
        }
        let small = a
            .create_xfer_req(XferOp::Write, &xl(&wsrc, 0, 100), &xl(&wdst, 5, 100), "tcp-B", &XferOpts::default())
            .unwrap();
        assert_eq!(
            a.post_xfer_req(&small, NotifUpdate::Keep).unwrap(),
            Status::Success,
            "small requests finish inline"
        );
        assert_eq!(&wdst[5..105], &wsrc[..100]);
        a.gen_notif("tcp-B", b"", &[]).unwrap();
        assert_eq!(notifs_until(&b, 2), vec![("tcp-A".to_string(), b"blocks".to_vec()), ("tcp-A".to_string(), vec![])]);
    }

    fn rss_mib() -> u64 {
        let s = std::fs::read_to_string("/proc/self/status").unwrap();
        let l = s.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
        l.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() / 1024
    }

    /// A peer floods notifications over TCP at an agent that does not poll: the target's queue stops
    /// at its bound (the control connection is not read), the sender gets BACKEND after a bound, every
    /// notification that returned Ok is delivered, in order, once the target polls, and the peer stays
    /// usable throughout (a transfer while the queue is full, notifications after).
    #[test]
    fn tcp_notification_flood_is_bounded_and_lossless() {
        let a = tcp_agent("tcp-flood-A", &[("disconnect_timeout_ms", "1000")]);
        let b = tcp_agent(
            "tcp-flood-B",
            &[("disconnect_timeout_ms", "1000"), ("notif_queue_msgs", "64"), ("notif_queue_bytes", "4194304")],
        );
        let buf = vec![7u8; 1 << 20];
        let dst = vec![0u8; 1 << 20];
        reg(&a, &buf);
        reg(&b, &dst);
        a.load_remote_md(&b.local_md().unwrap()).unwrap();
        let size = 128 << 10;
        let (max, rss0) = (4000usize, rss_mib());
        let mut ok = 0;
        let mut refused = None;
        while ok < max {
            let mut m = vec![0u8; size];
            m[..8].copy_from_slice(&(ok as u64).to_le_bytes());
            match a.gen_notif("tcp-flood-B", &m, &[]) {
                Ok(()) => ok += 1,
                Err(e) => {
                    refused = Some(e);
                    break;
                }
            }
        }
        let grew = rss_mib().saturating_sub(rss0);
        eprintln!("flood: {ok} notifications of {size} B taken before the sender was refused; RSS +{grew} MiB");
        let e = refused.expect("the sender must be refused once the target's queue is full");
        assert_eq!(e.status(), Status::Backend, "{e}");
        assert!(e.to_string().contains("queue is full"), "{e}");
        assert!(grew < 128, "RSS grew by {grew} MiB");
        // Still usable while the queue is full: a transfer, and another refused notification (not a death).
        let w = a
            .create_xfer_req(
                XferOp::Write,
                &xl(&buf, 0, 1 << 20),
                &xl(&dst, 0, 1 << 20),
                "tcp-flood-B",
                &XferOpts::default(),
            )
            .unwrap();
        a.post_xfer_req(&w, NotifUpdate::Keep).unwrap();
        assert_eq!(wait(&a, &w, Duration::from_secs(10)).unwrap(), Status::Success);
        assert!(dst == buf);
        // A later notification goes on a new control connection (the old one was left with a partial
        // frame) or waits on the old one: it is taken into a socket (and queued after the others) or
        // refused the same way; never a disconnect.
        let x = match a.gen_notif("tcp-flood-B", &[0xff; 8], &[]) {
            Ok(()) => 1,
            Err(e) => {
                assert_eq!(e.status(), Status::Backend, "{e}");
                0
            }
        };
        // The target polls: everything that was accepted arrives, once, in order; nothing else.
        let t = Instant::now();
        let mut got = Vec::new();
        while got.len() < ok + x && t.elapsed() < Duration::from_secs(30) {
            let n = b.notifs(&[]).unwrap();
            if n.is_empty() {
                std::thread::sleep(Duration::from_millis(2));
            }
            got.extend(n);
        }
        let ids: Vec<u64> = got.iter().map(|(_, m)| u64::from_le_bytes(m[..8].try_into().unwrap())).collect();
        let want: Vec<u64> = (0..ok as u64).chain((x == 1).then_some(u64::MAX)).collect();
        assert_eq!(ids, want);
        assert!(got.iter().all(|(n, m)| n == "tcp-flood-A" && (m.len() == size || m.len() == 8)));
        a.gen_notif("tcp-flood-B", b"after", &[]).unwrap();
        assert_eq!(notifs_until(&b, 1), vec![("tcp-flood-A".to_string(), b"after".to_vec())]);
    }

    #[test]
    fn tcp_target_refuses_deregistered_memory() {
        let a = tcp_agent("tcp-dereg-A", &[]);
        let b = tcp_agent("tcp-dereg-B", &[]);
        let dst = vec![0u8; 1 << 20];
        let src = vec![3u8; 1 << 20];
        reg(&a, &dst);
        let bl = reg(&b, &src);
        a.load_remote_md(&b.local_md().unwrap()).unwrap();
        let r = a
            .create_xfer_req(XferOp::Read, &xl(&dst, 0, 4096), &xl(&src, 0, 4096), "tcp-dereg-B", &XferOpts::default())
            .unwrap();
        assert_eq!(a.post_xfer_req(&r, NotifUpdate::Keep).unwrap(), Status::Success);
        // The target drops the registration; the initiator's metadata still lists it, the target does not.
        b.deregister_mem(&bl, &[]).unwrap();
        let e = a.post_xfer_req(&r, NotifUpdate::Keep).unwrap_err();
        assert_eq!(e.status(), Status::Backend, "{e}");
        // The connection is still usable once the memory is back.
        reg(&b, &src);
        assert_eq!(a.post_xfer_req(&r, NotifUpdate::Keep).unwrap(), Status::Success);
    }

    #[test]
    fn tcp_peer_destroyed_is_a_prompt_disconnect() {
        let a = tcp_agent("tcp-kill-A", &[]);
        let b = tcp_agent("tcp-kill-B", &[]);
        let dst = vec![0u8; 4096];
        let src = vec![3u8; 4096];
        reg(&a, &dst);
        reg(&b, &src);
        a.load_remote_md(&b.local_md().unwrap()).unwrap();
        let r = a
            .create_xfer_req(XferOp::Read, &xl(&dst, 0, 4096), &xl(&src, 0, 4096), "tcp-kill-B", &XferOpts::default())
            .unwrap();
        assert_eq!(a.post_xfer_req(&r, NotifUpdate::Keep).unwrap(), Status::Success);
        drop(b);
        let t = Instant::now();
        let e = loop {
            match a.post_xfer_req(&r, NotifUpdate::Keep) {
                Err(e) => break e,
                Ok(_) => {
                    assert!(t.elapsed() < Duration::from_secs(2), "still succeeding");
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
        };
        assert_eq!(e.status(), Status::RemoteDisconnect, "{e}");
        let n = a.gen_notif("tcp-kill-B", b"x", &[]).unwrap_err();
        assert_eq!(n.status(), Status::RemoteDisconnect);
        // Later errors say why the peer went down, not only that it did.
        let again = a.post_xfer_req(&r, NotifUpdate::Keep).unwrap_err();
        for e in [&n, &again] {
            assert!(e.message().contains("has disconnected (") || e.message().contains("over TCP:"), "{e}");
        }
    }

    /// The target's TCP endpoint and credentials, read from its metadata as an attacker with a copy would.
    fn endpoint(b: &Agent) -> (SocketAddr, u128, u128) {
        let md = AgentMd::decode(&b.local_md().unwrap()).unwrap();
        let ci = parse_conn(&md.conns[0].1).unwrap();
        let a = *ci.addrs.iter().find(|a| a.ip().is_loopback()).unwrap();
        (a, md.incarnation, ci.secret)
    }

    /// Connect and read the target's challenge.
    fn challenged(addr: SocketAddr) -> (TcpStream, [u8; 16]) {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut c = [0u8; wire::CHALLENGE_BYTES];
        s.read_exact(&mut c).unwrap();
        (s, wire::parse_challenge(&c).unwrap())
    }

    /// Send `hello` and read the answer: Some(ACK) or None (closed).
    fn answer(s: &mut TcpStream, hello: &[u8]) -> Option<u8> {
        s.write_all(hello).unwrap();
        let mut b = [0u8; 1];
        match s.read(&mut b) {
            Ok(1) => Some(b[0]),
            _ => None,
        }
    }

    fn hello(addr: SocketAddr, kind: u8, inc: u128, secret: u128) -> (TcpStream, Option<u8>) {
        let (mut s, nonce) = challenged(addr);
        let tag = wire::hello_tag(secret, kind, inc, &nonce, "mallory");
        let got =
            answer(&mut s, &wire::encode_hello(&wire::Hello { kind, incarnation: inc, tag, name: "mallory".into() }));
        (s, got)
    }

    fn request(s: &mut TcpStream, op: XferOp, segs: &[wire::WireSeg], payload: &[u8]) -> Option<(u8, Vec<u8>)> {
        let mut b = Vec::new();
        wire::encode_req(op, segs, &mut b);
        b.extend_from_slice(payload);
        s.write_all(&b).ok()?;
        let mut r = [0u8; wire::REPLY_BYTES];
        s.read_exact(&mut r).ok()?;
        let mut data = Vec::new();
        if op == XferOp::Read && r[0] == wire::REPLY_OK {
            data.resize(segs.iter().map(|s| s.len as usize).sum(), 0);
            s.read_exact(&mut data).ok()?;
        }
        Some((r[0], data))
    }

    #[test]
    fn tcp_strangers_and_out_of_bounds_requests_are_refused() {
        let b = tcp_agent("tcp-victim", &[]);
        let secret_buf = vec![0x77u8; 8192];
        let region = secret_buf.as_ptr() as u64;
        reg(&b, &secret_buf[1024..5120]);
        let (addr, inc, secret) = endpoint(&b);
        let inside = region + 1024;

        // Wrong secret, wrong incarnation: NAK and closed; garbage: closed without an answer.
        assert_eq!(hello(addr, wire::KIND_DATA, inc, secret ^ 1).1, Some(wire::NAK));
        assert_eq!(hello(addr, wire::KIND_CTRL, inc, secret ^ (1 << 127)).1, Some(wire::NAK));
        assert_eq!(hello(addr, wire::KIND_DATA, inc + 1, secret).1, Some(wire::NAK));
        {
            let mut s = TcpStream::connect(addr).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
            let mut r = Vec::new();
            let _ = s.read_to_end(&mut r);
            assert_eq!(r.len(), wire::CHALLENGE_BYTES, "nothing but the challenge");
        }
        // A request without a HELLO is garbage too.
        {
            let (mut s, _) = challenged(addr);
            let seg = wire::WireSeg { region: inside, region_len: 4096, addr: inside, len: 16 };
            assert_eq!(request(&mut s, XferOp::Read, &[seg], &[]), None);
        }
        // A HELLO recorded on one connection is worthless on another (fresh nonce).
        {
            let (mut s1, n1) = challenged(addr);
            let tag = wire::hello_tag(secret, wire::KIND_DATA, inc, &n1, "mallory");
            let recorded = wire::encode_hello(&wire::Hello {
                kind: wire::KIND_DATA,
                incarnation: inc,
                tag,
                name: "mallory".into(),
            });
            let (mut s2, n2) = challenged(addr);
            assert_ne!(n1, n2);
            assert_eq!(answer(&mut s2, &recorded), Some(wire::NAK), "replayed");
            assert_eq!(answer(&mut s1, &recorded), Some(wire::ACK), "the original is fine");
        }

        // With the right credentials, only registered memory is served.
        let (mut s, ack) = hello(addr, wire::KIND_DATA, inc, secret);
        assert_eq!(ack, Some(wire::ACK));
        let ok = wire::WireSeg { region: inside, region_len: 4096, addr: inside + 4000, len: 96 };
        assert_eq!(request(&mut s, XferOp::Read, &[ok], &[]), Some((wire::REPLY_OK, vec![0x77; 96])));
        let denied = |seg: wire::WireSeg| (seg, Some((wire::REPLY_DENIED, Vec::new())));
        for (seg, want) in [
            // One byte past the registration, claiming the right region.
            denied(wire::WireSeg { region: inside, region_len: 4096, addr: inside + 4000, len: 97 }),
            // Before it.
            denied(wire::WireSeg { region: inside, region_len: 4096, addr: inside - 1, len: 2 }),
            // Claiming a bigger region than was registered.
            denied(wire::WireSeg { region, region_len: 8192, addr: region, len: 16 }),
            // Wrapping around the address space.
            denied(wire::WireSeg { region: inside, region_len: 4096, addr: u64::MAX - 3, len: 16 }),
        ] {
            assert_eq!(request(&mut s, XferOp::Read, &[seg], &[]), want, "{seg:?}");
            assert_eq!(request(&mut s, XferOp::Write, &[seg], &vec![0xEE; seg.len as usize]), want, "{seg:?}");
        }
        // A mixed request is refused whole.
        let bad = wire::WireSeg { region: inside, region_len: 4096, addr: inside + 4095, len: 2 };
        let ok2 = wire::WireSeg { region: inside, region_len: 4096, addr: inside, len: 8 };
        assert_eq!(request(&mut s, XferOp::Write, &[ok2, bad], &[0xEE; 10]), Some((wire::REPLY_DENIED, vec![])));
        assert!(secret_buf.iter().all(|&x| x == 0x77), "target memory changed");
        // A request larger than the limit or with lengths that do not add up closes the connection.
        let mut h = Vec::new();
        wire::encode_req(XferOp::Read, &[ok], &mut h);
        h[8..16].copy_from_slice(&95u64.to_le_bytes());
        s.write_all(&h).unwrap();
        let mut r = [0u8; 8];
        assert!(s.read_exact(&mut r).is_err());
        // A legitimate write still works on a fresh connection.
        let (mut s, _) = hello(addr, wire::KIND_DATA, inc, secret);
        assert_eq!(request(&mut s, XferOp::Write, &[ok2], &[1; 8]), Some((wire::REPLY_OK, vec![])));
        assert_eq!(&secret_buf[1024..1032], &[1; 8]);
    }
}
