//! The engine's state, shared by its handle, its peers, its requests and its threads (`Shared`): settings,
//! the transfer gate and region table it serves, its notification queue, its control threads and copy pools.
//! Also the process's registry of live engines (in-process peers are found there by incarnation, never by
//! connection info), the proof that a same-host peer process is the one its metadata names (`Proof`), and
//! taking a descriptor from such a process (`take_peer_fd`).

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use parking_lot::Mutex;

use super::conn::{conn_v3_to_v4, ConnInfo};
use super::copy::{self, cma_denied};
use super::ctrl::{self, Ctrl};
use super::gate::{self, Attached, Gate};
use super::notif::{NotifQueue, QUEUE_BYTES, QUEUE_MSGS};
use super::pool::Pool;
use super::route::tcp::listen::{self, TcpOpts, TcpSetup};
use super::route::tcp::regions::Regions;
pub(super) use super::route::Transport;
use super::sides::Sides;
use super::vram_regions::Vram;
use crate::backend::BackendInit;
use crate::os;
use crate::status::{Error, Result, Status};

const DEFAULT_TCP_CONNS: usize = 4;
const DEFAULT_DISCONNECT_MS: u64 = 1000;

/// Engines alive in this process, by incarnation, so in-process peers are reached directly.
pub(super) fn registry() -> &'static Mutex<HashMap<u128, Weak<Shared>>> {
    static R: OnceLock<Mutex<HashMap<u128, Weak<Shared>>>> = OnceLock::new();
    R.get_or_init(Default::default)
}

pub(super) struct Shared {
    pub(super) agent: String,
    pub(super) incarnation: u128,
    pub(super) host: String,
    pub(super) pid: i32,
    pub(super) start_time: u64,
    pub(super) threads: usize,
    pub(super) transport: Transport,
    pub(super) tcp_opts: TcpOpts,
    /// Shown only inside this engine's metadata; a TCP connection must present it.
    pub(super) secret: u128,
    pub(super) regions: Arc<Regions>,
    /// What same-host peers must pass for every batch (see `gate`).
    pub(super) gate: Arc<Gate>,
    pub(super) queue: Arc<NotifQueue>,
    pub(super) closed: Arc<AtomicBool>,
    /// Test-only fault injection (`GIXL_TEST_FAULT=copy_panic`): copy workers panic.
    pub(super) panic_copies: bool,
    /// Test-only fault injection (`GIXL_TEST_FAULT=no_pidfd_getfd`, or backend parameter `test_fault`): act
    /// as if the kernel refused every `pidfd_getfd`, so peers' descriptors come over their control socket.
    pub(super) no_pidfd_getfd: bool,
    pub(super) ctrl: Ctrl,
    pub(super) pool: Pool,
    /// Workers for TCP pieces: they block on sockets, so they are not the copy threads.
    pub(super) tcp_pool: Pool,
    /// Registered VRAM's exported allocations (see `vram`; its regions hold slots in `gate`).
    pub(super) vram: Vram,
    /// Same-host peer processes proven so far, by process incarnation (see [`Proof`]).
    pub(super) proofs: Mutex<HashMap<gate::Owner, Weak<Proof>>>,
    /// Its routes' target sides (an RDMA port's domains and regions, ...), each where it runs here.
    pub(super) sides: Sides,
    /// The route line said for each peer incarnation loaded so far (see `router::Said`).
    pub(super) said: Said,
}

/// The route lines said so far, by peer incarnation. A peer loaded again under the same incarnation (Ray adds its
/// peer on every fetch and removes it after) is said at DEBUG unless its route or its reason changed; bounded:
/// past `SAID_MAX` peers it forgets them all at once, and each says its line once more.
#[derive(Default)]
pub(super) struct Said(Mutex<HashMap<(String, u128), String>>);

const SAID_MAX: usize = 4096;

impl Said {
    pub(super) fn say(&self, agent: &str, incarnation: u128, level: crate::telemetry::log::Level, line: &str) {
        crate::telemetry::log::log(self.level(agent, incarnation, level, line), line);
    }

    /// `level` the first time `line` is said of this peer incarnation, DEBUG when it says the same again.
    fn level(
        &self,
        agent: &str,
        incarnation: u128,
        level: crate::telemetry::log::Level,
        line: &str,
    ) -> crate::telemetry::log::Level {
        let mut said = self.0.lock();
        let key = (agent.to_owned(), incarnation);
        if said.get(&key).is_some_and(|l| l == line) {
            return crate::telemetry::log::Level::Debug;
        }
        if said.len() >= SAID_MAX {
            said.clear();
        }
        said.insert(key, line.to_owned());
        level
    }
}

/// A backend parameter, else an environment variable.
fn setting(init: &BackendInit, param: &str, env: &str) -> Option<String> {
    init.params
        .get(param)
        .filter(|v| !v.trim().is_empty())
        .cloned()
        .or_else(|| std::env::var(env).ok().filter(|v| !v.trim().is_empty()))
}

/// The number set as backend parameter `param` or in `env`, else `default`.
fn number<T: std::str::FromStr>(init: &BackendInit, param: &str, env: &str, default: T) -> Result<T> {
    match setting(init, param, env) {
        None => Ok(default),
        Some(v) => v.trim().parse().map_err(|_| Error::invalid_param(format!("{param}: '{v}' is not a valid number"))),
    }
}

impl Shared {
    /// A new engine's state, its threads started and the engine entered in `registry()`.
    pub(super) fn start(init: BackendInit) -> Result<Arc<Shared>> {
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
            Some("rdma") => Transport::Rdma,
            Some("fabric" | "libfabric") => Transport::Fabric,
            Some(other) => {
                return Err(Error::invalid_param(format!(
                    "transport '{other}' is not one of auto, tcp, rdma, fabric (GIXL_TRANSPORT)"
                )))
            }
        };
        let conns = number(&init, "tcp_conns", "GIXL_TCP_CONNS", DEFAULT_TCP_CONNS)?.clamp(1, 64);
        let ms = number(&init, "disconnect_timeout_ms", "GIXL_DISCONNECT_TIMEOUT_MS", DEFAULT_DISCONNECT_MS)?;
        let ms = ms.clamp(10, 3_600_000);
        let tcp_opts = TcpOpts { conns, timeout: Duration::from_millis(ms) };
        let bind = listen::parse_bind(&setting(&init, "tcp_addr", "GIXL_TCP_ADDR").unwrap_or_default())?;
        let secret = crate::util::random_u128();
        let regions: Arc<Regions> = Arc::default();
        if let Some(counts) = &init.overlap {
            regions.set_overlap(counts.clone());
        }
        let queue: Arc<NotifQueue> = Arc::default();
        let ctrl = Ctrl::start(
            init.incarnation,
            queue.clone(),
            TcpSetup { bind, opts: tcp_opts, secret, regions: regions.clone() },
        )?;
        let msgs = number(&init, "notif_queue_msgs", "GIXL_NOTIF_QUEUE_MSGS", QUEUE_MSGS)?;
        let bytes = number(&init, "notif_queue_bytes", "GIXL_NOTIF_QUEUE_BYTES", QUEUE_BYTES)?;
        queue.set_bounds(msgs.max(1), bytes.max(1));
        let gate = Arc::new(Gate::create(init.incarnation)?);
        let no_pidfd_getfd = setting(&init, "test_fault", "GIXL_TEST_FAULT")
            .is_some_and(|v| v.split(',').any(|f| f.trim() == "no_pidfd_getfd"));
        // Peers that may not take it with `pidfd_getfd` ask for it over the control socket.
        ctrl.offer_fd(gate.raw_fd());
        let sides =
            Sides::start(transport, &init.agent_name, &ctrl.tcp, tcp_opts.patience(), &|p, e| setting(&init, p, e));
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
            sides,
            said: Said::default(),
        });
        registry().lock().insert(init.incarnation, Arc::downgrade(&shared));
        Ok(shared)
    }

    /// This engine's connection info, as it advertises it (see `conn`): layout 3, or, where a route side runs
    /// (an RDMA port), layout 4 with their sections (releases that read only layout 3 cannot load it).
    pub(super) fn conn_info(&self) -> Vec<u8> {
        let v3 = ConnInfo {
            host: self.host.clone(),
            pid: self.pid,
            start_time: self.start_time,
            has_local: true,
            gate_fd: self.gate.raw_fd(),
            gate_addr: self.gate.addr(),
            sock: self.ctrl.sock_name.clone(),
            secret: self.secret,
            addrs: self.ctrl.tcp.addrs.clone(),
            port: self.ctrl.tcp.port,
            routes: Vec::new(),
        }
        .encode();
        let sections: Vec<(u64, Vec<u8>)> = self.sides.all().map(|s| s.section()).collect();
        if sections.is_empty() {
            return v3;
        }
        let sections: Vec<(u64, &[u8])> = sections.iter().map(|(id, b)| (*id, b.as_slice())).collect();
        // Our own layout 3 always converts.
        conn_v3_to_v4(&v3, &[], &sections).unwrap_or(v3)
    }

    /// The proof that `ci`'s process runs here as `incarnation` (see [`Proof`]): the one this engine holds
    /// already, else a new one. None when the process does not prove it (nothing listens on its socket as its
    /// pid, it has exited, or the kernel gave neither its gate nor a reason).
    /// Errors only when this side runs out (no initiator slot in the peer's gate, no epoll entry).
    pub(super) fn prove(self: &Arc<Shared>, ci: &ConnInfo, incarnation: u128) -> Result<Option<Arc<Proof>>> {
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
            (named && ctrl::listener_pid(&ci.sock) == Some(ci.pid)).then(|| os::pidfd_open(ci.pid).ok()).flatten()
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
        let gate = gate.map(|g| gate::attach_shared(key, || Ok(Arc::new(g)))).transpose()?;
        let exited = Arc::new(AtomicBool::new(false));
        let watch = self.ctrl.watch(pidfd.as_raw_fd(), exited.clone())?;
        let p = Arc::new(Proof { pidfd, watch, exited, gate, denied, owner: Arc::downgrade(self) });
        let mut proofs = self.proofs.lock();
        proofs.retain(|_, w| w.strong_count() > 0);
        // Two loads that proved the same process at once keep the first proof.
        if let Some(first) = proofs.get(&key).and_then(Weak::upgrade).filter(known) {
            return Ok(Some(first));
        }
        proofs.insert(key, Arc::downgrade(&p));
        Ok(Some(p))
    }

    /// Stop serving peers (same-host ones find the gate closed, TCP ones lose their connections and the region
    /// table) and stop the threads. Requests that outlive this fail with BACKEND. Idempotent.
    pub(super) fn shutdown(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        registry().lock().remove(&self.incarnation);
        // From here no peer's batch passes the gate; those inside finish before this returns.
        self.gate.close(self.tcp_opts.timeout);
        self.ctrl.shutdown();
        self.sides.all().for_each(|s| s.close());
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

/// What a same-host peer process proved once, shared by every name whose metadata claims that process
/// incarnation (`Owner`): its pid listens on the socket named for the incarnation, the pidfd watched for its
/// exit, and this process's claim on its gate. Renamed copies of a peer's metadata cost neither descriptors
/// nor gate slots (each name used to hold a pidfd, a gate descriptor and an initiator slot).
pub(super) struct Proof {
    pub(super) pidfd: OwnedFd,
    watch: u64,
    /// Set by the progress thread when the process exits.
    pub(super) exited: Arc<AtomicBool>,
    pub(super) gate: Option<Arc<Attached>>,
    /// Why the kernel refused cross-memory attach to it, if it did when proven.
    pub(super) denied: Option<String>,
    owner: Weak<Shared>,
}

impl Drop for Proof {
    fn drop(&mut self) {
        if let Some(owner) = self.owner.upgrade() {
            owner.ctrl.unwatch(self.watch, self.pidfd.as_raw_fd());
        }
    }
}

/// Descriptor `num` of a same-host peer: taken with `pidfd_getfd`, or, where the kernel refuses that (or
/// under `GIXL_TEST_FAULT=no_pidfd_getfd`), asked for over the peer's control socket `sock`
/// (`(socket name, secret, incarnation, pid)`), which sends only what it offers, with SCM_RIGHTS. If both fail
/// the error keeps the EPERM/ENOSYS source (see `cma_denied`). The caller checks what it got (identity,
/// or the gate's own checks).
pub(super) fn take_peer_fd(
    s: &Shared,
    pidfd: std::os::fd::BorrowedFd<'_>,
    sock: (&[u8], u128, u128, i32),
    num: i32,
) -> Result<OwnedFd> {
    let refused = if s.no_pidfd_getfd {
        std::io::Error::from_raw_os_error(libc::EPERM)
    } else {
        match os::pidfd_getfd(pidfd, num) {
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
        Ok((f, _)) if os::pidfd_alive(pidfd) => Ok(f),
        Ok(_) => Err(Error::disconnected("the peer exited while sending a descriptor")),
        Err(e) => Err(Error::os(
            Status::Backend,
            format!("the kernel refused pidfd_getfd, and the peer's control socket did not send the descriptor: {e}"),
            refused,
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::log::Level;

    #[test]
    fn a_route_line_is_said_once_per_peer_incarnation_unless_it_changes() {
        let said = Said::default();
        let line = "agent 'a': peer 'p' (incarnation 1) route tcp (another host)";
        assert_eq!(said.level("p", 1, Level::Info, line), Level::Info);
        for _ in 0..3 {
            assert_eq!(said.level("p", 1, Level::Info, line), Level::Debug, "loaded again: nothing new");
        }
        assert_eq!(said.level("p", 2, Level::Info, line), Level::Info, "a new incarnation is said");
        let changed = "agent 'a': peer 'p' (incarnation 1) route tcp (fall-back: denied)";
        assert_eq!(said.level("p", 1, Level::Warn, changed), Level::Warn, "a changed route is said");
        assert_eq!(said.level("p", 1, Level::Warn, changed), Level::Debug);
    }

    #[test]
    fn the_memory_of_route_lines_is_bounded() {
        let said = Said::default();
        for i in 0..(SAID_MAX as u128 + 10) {
            said.level("p", i, Level::Info, "line");
            assert!(said.0.lock().len() <= SAID_MAX);
        }
        // Forgotten all at once past the bound: a peer says its line once more, then is quiet again.
        assert_eq!(said.level("p", 0, Level::Info, "line"), Level::Info);
        assert_eq!(said.level("p", 0, Level::Info, "line"), Level::Debug);
    }
}
