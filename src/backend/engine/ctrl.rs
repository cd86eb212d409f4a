//! The engine's control plane: an abstract Unix socket that receives notifications from peers on this host,
//! pidfds that tell when a peer process exits, the TCP listener and control connections (see `route::tcp::listen`), and
//! the one progress thread that waits on all of them with epoll.
//!
//! The thread sleeps in `epoll_wait` with no timeout unless a TCP peer has requests in flight (heartbeats)
//! or a TCP connection has not authenticated yet, so an idle agent uses no CPU. It never touches registered
//! memory; it only queues notifications, answers heartbeats and sets peer processes' exit flags.

use std::collections::{HashMap, HashSet};
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::Mutex;

use super::notif::{NotifQueue, MAX_NOTIF};
use super::route::tcp::listen::{TcpProgress, TcpSetup, TcpShared};
use crate::os::sock::{epoll_add, epoll_del};
use crate::os::{self, Reactor, Tokens};
use crate::status::{Error, Result, Status};

// Frame kinds on the local socket (see `Frame`).
/// Client → server, first: `target incarnation u128 | sender incarnation u128 | nonce [16] | tag u64 | name`,
/// the tag keyed by the target's engine secret over a nonce the sender draws fresh for the connection.
/// (Not a server challenge as on TCP: a stopped or busy target must still take notifications into its
/// socket, as NIXL's do, and only a process that can already read the target's memory could observe
/// a Unix socket's traffic to replay it.)
const KIND_HELLO: u8 = 1;
/// Client → server: one notification.
const KIND_NOTIF: u8 = 2;
/// Server → client: the hello was accepted.
const KIND_ACK: u8 = 4;
/// Server → client, then the connection is closed: why it was refused (UTF-8).
const KIND_REFUSE: u8 = 5;
/// Client → server, authenticated: `fd i32`, a descriptor number this engine exports (a VMM allocation, its
/// transfer gate): the fallback for a peer that may not take it with `pidfd_getfd` (see [`request_fd`]).
const KIND_FD_REQ: u8 = 6;
/// Server → client: `fd i32 | st_dev u64 | st_ino u64` with the descriptor attached (SCM_RIGHTS), or an
/// empty body: that number is not one this engine offers.
const KIND_FD: u8 = 7;
/// The tag's `kind` for local hellos (the TCP handshake uses 1 and 2).
pub const TAG_KIND_LOCAL: u8 = 0x10;
const HELLO_FIXED: usize = 1 + 16 + 16 + 16 + 8;
/// How long a sender waits for the acceptance before it goes on without it (the target is stopped or busy;
/// its verdict then shows as a closed socket at a later send).
const ACK_WAIT: Duration = Duration::from_millis(500);
/// Longest hello accepted from a connection that has not authenticated (an agent name is at most 4 KiB).
const MAX_HELLO: usize = HELLO_FIXED + 4096;
/// Connections that have not authenticated yet; beyond this the oldest is dropped.
const MAX_PENDING: usize = 64;
/// Authenticated connections (each is a peer agent that knows our secret).
const MAX_CONNS: usize = 4096;
/// How long a sender waits for the handshake and for room in the peer's socket.
const SEND_TIMEOUT: Duration = Duration::from_secs(5);
/// Frames above this many bytes are read only with a reservation in `LOCAL_BUDGET`.
const RESERVE_ABOVE: usize = 64 * 1024;
/// Every large frame in progress on the local socket together: a frame's length is reserved when its header
/// arrives, and a connection whose frame does not fit is not read until room frees up.
const LOCAL_BUDGET: usize = 128 << 20;
/// A connection holding a reservation that sends nothing for this long is cut off.
const LOCAL_STALL: Duration = Duration::from_secs(5);

/// How long a connect to a peer's socket waits for room in its backlog (a stopped peer, or a stranger who
/// holds the name and never accepts, would otherwise block `add_remote_agent` for as long as they like).
const CONNECT_WAIT: Duration = Duration::from_secs(1);

/// Inside the local epoll set (`Local::epfd`): the listener, then connections.
const TOKEN_LISTEN: u64 = 1;
const TOKEN_CONN: u64 = 1 << 32;
/// This module's tokens in the progress thread's reactor, by their own number: the local epoll set, then
/// the pidfd watches.
const LOCAL: u64 = 0;
const PIDFD: u64 = 1;

pub struct Ctrl {
    pub sock_name: Vec<u8>,
    pub tcp: Arc<TcpShared>,
    c: Arc<Common>,
    next_watch: AtomicU64,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// Descriptors an authenticated peer may ask for (`KIND_FD_REQ`).
    offered: Arc<Mutex<HashSet<RawFd>>>,
}

/// What the application's side (`Ctrl`) and the progress thread share.
struct Common {
    reactor: Arc<Reactor>,
    tokens: Tokens,
    stop: AtomicBool,
    watches: Mutex<HashMap<u64, Arc<AtomicBool>>>,
    local: Mutex<Local>,
    local_fd: RawFd,
    /// The queue was full: the local sockets are not read until the application takes notifications.
    paused: AtomicBool,
    /// When the application last called `drain` (monotonic ns): while it polls, the progress thread leaves
    /// the local sockets to it.
    last_poll: AtomicU64,
}

impl Common {
    /// Arm the local epoll set again (one-shot) in the progress thread's reactor.
    fn rearm(&self) {
        let _ = self.reactor.modify(self.local_fd, self.tokens.token(LOCAL), LOCAL_ARM);
    }
}

impl Ctrl {
    /// Bind the notification socket `\0gixl.<pid>.<incarnation>` and start the progress thread.
    pub fn start(incarnation: u128, queue: Arc<NotifQueue>, setup: TcpSetup) -> Result<Ctrl> {
        crate::util::reserve_fd_for_shedding();
        let sock_name = format!("gixl.{}.{incarnation:032x}", std::process::id()).into_bytes();
        let addr = SocketAddr::from_abstract_name(&sock_name)
            .map_err(|e| Error::os(Status::Backend, "notification socket name", e))?;
        let listener = UnixListener::bind_addr(&addr)
            .map_err(|e| Error::os(Status::Backend, "binding the notification socket", e))?;
        listener.set_nonblocking(true).map_err(|e| Error::os(Status::Backend, "notification socket", e))?;
        let reactor = Arc::new(Reactor::new()?);
        let tokens = reactor.tokens();
        // The notification listener and its connections live in their own epoll set, itself watched by the
        // progress thread: whichever thread gets there first (the progress thread, or the application's
        // `notifs` poll through `drain`) reads them, under one lock, so a polling application does not wait
        // for the progress thread to be scheduled.
        let local_fd = os::epoll()?;
        epoll_add(local_fd.as_raw_fd(), listener.as_raw_fd(), TOKEN_LISTEN)?;
        let local_raw = local_fd.as_raw_fd();
        reactor.add(local_raw, tokens.token(LOCAL), LOCAL_ARM)?;
        let offered: Arc<Mutex<HashSet<RawFd>>> = Arc::default();
        let reserving = Arc::new(AtomicU64::new(0));
        let local = Mutex::new(Local {
            epfd: local_fd,
            listener,
            allowed: allowed_uids(),
            inbox: Inbox {
                incarnation,
                secret: setup.secret,
                queue: queue.clone(),
                queued: (0, 0),
                offered: offered.clone(),
            },
            conns: HashMap::new(),
            next_conn: 0,
            reserved: 0,
            reserving: reserving.clone(),
            parked: std::collections::VecDeque::new(),
            stall: LOCAL_STALL,
        });
        let tcp_progress = TcpProgress::new(setup, incarnation, queue.clone(), reactor.clone())?;
        let tcp = tcp_progress.shared.clone();
        let c = Arc::new(Common {
            reactor,
            tokens,
            stop: AtomicBool::new(false),
            watches: Mutex::default(),
            local,
            local_fd: local_raw,
            paused: AtomicBool::new(false),
            last_poll: AtomicU64::new(0),
        });
        let mut progress = Progress { c: c.clone(), rearm_at: None, tcp: tcp_progress, reserving, swept: 0 };
        let thread = std::thread::Builder::new()
            .name("gixl-progress".into())
            .spawn(move || progress.run())
            .map_err(|e| Error::os(Status::Backend, "spawning the progress thread", e))?;
        Ok(Ctrl { sock_name, tcp, c, next_watch: AtomicU64::new(0), thread: Mutex::new(Some(thread)), offered })
    }

    /// Let authenticated peers ask for descriptor `fd` (see [`request_fd`]). The caller keeps it open until
    /// it calls [`Ctrl::withdraw_fd`].
    pub fn offer_fd(&self, fd: RawFd) {
        self.offered.lock().insert(fd);
    }

    /// Stop offering `fd`; call before closing it (a reply in progress holds the same lock).
    pub fn withdraw_fd(&self, fd: RawFd) {
        self.offered.lock().remove(&fd);
    }

    /// Read whatever the local notification connections hold now (non-blocking) into the queue. Called by
    /// the application's `notifs` poll; costs one `epoll_wait` when nothing is pending.
    pub fn drain(&self) {
        self.c.last_poll.store(crate::util::monotonic_ns(), Ordering::Relaxed);
        if let Some(mut l) = self.c.local.try_lock() {
            l.drain();
        }
        // The application is about to take the queue: let the progress thread read again (it pauses
        // again at once if the queue is still full).
        if self.c.paused.swap(false, Ordering::AcqRel) {
            self.c.rearm();
        }
    }

    /// Watch a peer's pidfd; `dead` is set when the process exits. Returns a token for `unwatch`.
    pub fn watch(&self, pidfd: RawFd, dead: Arc<AtomicBool>) -> Result<u64> {
        let token = self.c.tokens.token(PIDFD + self.next_watch.fetch_add(1, Ordering::Relaxed));
        self.c.watches.lock().insert(token, dead);
        // One-shot: an exited process's pidfd stays readable, and the one event is all this needs.
        if let Err(e) = self.c.reactor.add(pidfd, token, (libc::EPOLLIN | libc::EPOLLONESHOT) as u32) {
            self.c.watches.lock().remove(&token);
            return Err(e);
        }
        Ok(token)
    }

    /// Stop watching; call before closing the pidfd.
    pub fn unwatch(&self, token: u64, pidfd: RawFd) {
        self.c.reactor.remove(pidfd);
        self.c.watches.lock().remove(&token);
    }

    /// Stop the progress thread and close the socket. Idempotent.
    pub fn shutdown(&self) {
        self.tcp.close();
        self.c.stop.store(true, Ordering::Release);
        self.c.reactor.wake();
        if let Some(t) = self.thread.lock().take().filter(|t| t.thread().id() != std::thread::current().id()) {
            let _ = t.join();
        }
    }
}

impl Drop for Ctrl {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// A sending connection to a peer's notification socket, authenticated as one incarnation of one agent.
pub struct Sender {
    stream: UnixStream,
}

impl Sender {
    /// Connect, send a hello tagged with the peer's `secret` (from its metadata), and wait for its
    /// acceptance. The connection then speaks only for `from` / `from_incarnation`.
    pub fn connect(
        sock_name: &[u8],
        target_incarnation: u128,
        secret: u128,
        from: &str,
        from_incarnation: u128,
    ) -> Result<Sender> {
        let stream = crate::util::connect_abstract(sock_name, CONNECT_WAIT)
            .map_err(|e| Error::os(Status::RemoteDisconnect, "connecting to the peer's notification socket", e))?;
        stream
            .set_write_timeout(Some(SEND_TIMEOUT))
            .and_then(|_| stream.set_read_timeout(Some(ACK_WAIT)))
            .map_err(|e| Error::os(Status::Backend, "socket option", e))?;
        let mut s = Sender { stream };
        let nonce = crate::util::random_u128().to_le_bytes();
        let sent = s.send(KIND_HELLO, &hello_body(secret, target_incarnation, from_incarnation, &nonce, from));
        // A failed send was refused at once (another uid): the reason is waiting to be read.
        match (s.reply(), sent) {
            (Ok((KIND_REFUSE, why)), _) => Err(refused(&why)),
            (_, Err(e)) => Err(e),
            (Ok((KIND_ACK, _)), _) => Ok(s),
            (Ok(_), _) => Err(Error::backend("the peer's notification socket answered the hello with garbage")),
            // No verdict yet: the target is stopped or busy; the hello waits in its socket.
            (Err(e), _) if e.status() == Status::Backend => Ok(s),
            (Err(e), _) => Err(e),
        }
    }

    /// One frame from the peer (handshake only).
    fn reply(&mut self) -> Result<(u8, Vec<u8>)> {
        let fail = |e: io::Error| Error::os(timed_out_or_gone(&e), "notification handshake", e);
        let mut head = [0u8; 5];
        self.stream.read_exact(&mut head).map_err(fail)?;
        let len = announced(&head).unwrap_or(0);
        if len == 0 || len > 4096 {
            return Err(Error::backend("the peer's notification socket sent a malformed frame"));
        }
        let mut body = vec![0u8; len - 1];
        self.stream.read_exact(&mut body).map_err(fail)?;
        Ok((head[4], body))
    }

    pub fn notif(&mut self, msg: &[u8]) -> Result<()> {
        super::notif::check(msg)?;
        self.send(KIND_NOTIF, msg)
    }

    #[cfg(test)]
    fn set_timeout(&self, t: Duration) {
        self.stream.set_write_timeout(Some(t)).unwrap();
    }

    fn send(&mut self, kind: u8, body: &[u8]) -> Result<()> {
        // One write (one wake-up of the reader) for the usual small message.
        let r = if body.len() <= 64 * 1024 {
            self.stream.write_all(&framed(kind, body))
        } else {
            self.stream.write_all(&frame_head(kind, body.len())).and_then(|_| self.stream.write_all(body))
        };
        r.map_err(|e| match e.kind() {
            // The receiver stopped reading: its queue is full (the application does not take notifications)
            // or it is stopped. The caller drops this connection, so a partly written frame is discarded.
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => Error::os(
                Status::Backend,
                format!("the peer did not take the notification within {SEND_TIMEOUT:?} (its notification queue is full or it is not reading)"),
                e,
            ),
            _ => Error::os(Status::RemoteDisconnect, "sending a notification", e),
        })
    }
}

fn refused(why: &[u8]) -> Error {
    Error::not_allowed(format!("the peer refused the notification connection: {}", String::from_utf8_lossy(why)))
}

/// What a local hello's tag covers besides the nonce and the target: the sender's name and incarnation.
fn tagged_name(name: &str, incarnation: u128) -> String {
    format!("{name}\0{incarnation:032x}")
}

/// The uids allowed besides our own and root: `GIXL_ALLOW_UIDS` (comma-separated numbers).
fn allowed_uids() -> Vec<u32> {
    std::env::var("GIXL_ALLOW_UIDS")
        .unwrap_or_default()
        .split(',')
        .filter_map(|u| u.trim().parse::<u32>().ok())
        .collect()
}

/// The pid of the process listening on the abstract socket `sock_name`, if one does: how a peer that
/// claims to run on this host proves it (only then does the engine open a pidfd for it).
pub fn listener_pid(sock_name: &[u8]) -> Option<i32> {
    let s = crate::util::connect_abstract(sock_name, CONNECT_WAIT).ok()?;
    crate::os::fdpass::peer_cred(s.as_raw_fd()).map(|c| c.pid)
}

struct Conn {
    stream: UnixStream,
    buf: Vec<u8>,
    /// Bytes of `Local::reserved` held for the large frame in progress (0: none).
    reserved: usize,
    /// When bytes last arrived (monotonic ns).
    since: u64,
    /// Out of the epoll set, waiting for room in the budget.
    parked: bool,
    /// Set by an accepted hello; every notification on the connection is this sender's.
    sender: Option<String>,
}

/// The local notification socket and its connections, shared by the progress thread and `Ctrl::drain`.
struct Local {
    epfd: OwnedFd,
    listener: UnixListener,
    allowed: Vec<u32>,
    inbox: Inbox,
    conns: HashMap<u64, Conn>,
    next_conn: u64,
    /// Bytes reserved by the large frames in progress (at most `LOCAL_BUDGET`), mirrored in `reserving` for
    /// the progress thread, which then sweeps for stalled senders.
    reserved: usize,
    reserving: Arc<AtomicU64>,
    /// Connections whose frame did not fit, out of the epoll set until it does, oldest first.
    parked: std::collections::VecDeque<u64>,
    stall: Duration,
}

/// What the frames of every connection are checked against and delivered into.
struct Inbox {
    incarnation: u128,
    secret: u128,
    queue: Arc<NotifQueue>,
    /// (messages, bytes) in the queue, as of the current `drain`.
    queued: (usize, usize),
    offered: Arc<Mutex<HashSet<RawFd>>>,
}

struct Progress {
    c: Arc<Common>,
    /// The local set is disarmed (one-shot) while the application polls; re-arm it at this time (ns).
    rearm_at: Option<u64>,
    tcp: TcpProgress,
    /// Bytes reserved on the local socket (see `Local::reserved`); while any are, stalled senders are swept
    /// once a second.
    reserving: Arc<AtomicU64>,
    swept: u64,
}

impl Progress {
    fn run(&mut self) {
        let mut ready = Vec::new();
        while !self.c.stop.load(Ordering::Acquire) {
            // -1 (sleep until an event) unless heartbeats or handshake deadlines are pending.
            let mut timeout = self.tcp.tick();
            if self.reserving.load(Ordering::Acquire) > 0 {
                let now = crate::util::monotonic_ns();
                if now.saturating_sub(self.swept) >= 1_000_000_000 {
                    self.swept = now;
                    self.c.local.lock().sweep(now);
                }
                timeout = if timeout < 0 { 1000 } else { timeout.min(1000) };
            }
            if let Some(at) = self.rearm_at {
                let now = crate::util::monotonic_ns();
                if at <= now {
                    self.rearm_at = None;
                    self.c.rearm();
                } else {
                    let ms = (at - now).div_ceil(1_000_000) as i32;
                    timeout = if timeout < 0 { ms } else { timeout.min(ms) };
                }
            }
            if !self.c.reactor.wait(timeout, &mut ready) {
                return;
            }
            for &(token, _) in &ready {
                if self.tcp.shared.owns(token) {
                    self.tcp.on_event(token);
                } else if token == self.c.tokens.token(LOCAL) {
                    // One-shot: disarmed now. If the application is polling, it reads the sockets itself
                    // and this thread stays out of its way (no lock contention, no wake-up per message);
                    // look again after POLL_GRACE_NS in case it stopped.
                    let now = crate::util::monotonic_ns();
                    if now.saturating_sub(self.c.last_poll.load(Ordering::Relaxed)) < POLL_GRACE_NS {
                        self.rearm_at = Some(now + POLL_GRACE_NS);
                    } else if self.c.local.lock().drain() {
                        self.c.rearm();
                    } else {
                        // Queue full: stay disarmed until the application takes notifications.
                        self.c.paused.store(true, Ordering::Release);
                    }
                } else if self.c.tokens.owns(token) {
                    // A watched process exited (its pidfd fires once: one-shot, see `Ctrl::watch`).
                    if let Some(dead) = self.c.watches.lock().get(&token) {
                        dead.store(true, Ordering::Release);
                    }
                }
            }
        }
    }
}

impl Local {
    /// Accept and read whatever is ready, without blocking. False when it stopped because the queue is full.
    fn drain(&mut self) -> bool {
        self.inbox.queued = self.inbox.queue.held();
        if self.inbox.full() {
            return false;
        }
        // Frames left unparsed when the queue filled up.
        let waiting: Vec<u64> = self.conns.iter().filter(|(_, c)| c.buf.len() >= 4).map(|(t, _)| *t).collect();
        for t in waiting {
            let Some(c) = self.conns.get_mut(&t) else { continue };
            if let Err(why) = self.inbox.parse(c) {
                self.close(t, Some(why.as_bytes()));
            }
            if self.inbox.full() {
                return false;
            }
        }
        let mut events = [libc::epoll_event { events: 0, u64: 0 }; 16];
        loop {
            // SAFETY: `events` has room for 16 entries; zero timeout.
            let n = unsafe { libc::epoll_wait(self.epfd.as_raw_fd(), events.as_mut_ptr(), events.len() as i32, 0) };
            if n <= 0 {
                if n < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return true;
            }
            for ev in &events[..n as usize] {
                match ev.u64 {
                    TOKEN_LISTEN => self.accept(),
                    t => self.read(t),
                }
                if self.inbox.full() {
                    return false;
                }
            }
            if (n as usize) < events.len() {
                return true;
            }
        }
    }

    fn accept(&mut self) {
        loop {
            let stream = match self.listener.accept() {
                Ok((s, _)) => s,
                Err(e) if crate::util::accept_again(&e, self.listener.as_raw_fd()) => continue,
                Err(_) => return,
            };
            // Another user's process is refused before it can say anything (root and GIXL_ALLOW_UIDS aside).
            // SAFETY: plain syscall.
            let me = unsafe { libc::geteuid() };
            let uid = crate::os::fdpass::peer_cred(stream.as_raw_fd()).map(|c| c.uid);
            if !uid.is_some_and(|u| u == me || u == 0 || self.allowed.contains(&u)) {
                let why = format!(
                    "uid {} may not send notifications to an agent of uid {me} (same uid or root only; see GIXL_ALLOW_UIDS)",
                    uid.map_or("?".to_string(), |u| u.to_string())
                );
                let _ = send_frame_now(&stream, KIND_REFUSE, why.as_bytes());
                continue;
            }
            if stream.set_nonblocking(true).is_err() {
                continue;
            }
            let pending = self.conns.iter().filter(|(_, c)| c.sender.is_none()).map(|(t, _)| *t);
            // The oldest connection that has not authenticated makes room.
            if let (true, Some(oldest)) = (pending.clone().count() >= MAX_PENDING, pending.min()) {
                self.close(oldest, None);
            }
            if self.conns.len() >= MAX_CONNS {
                let _ = send_frame_now(&stream, KIND_REFUSE, b"too many notification connections");
                continue;
            }
            let token = TOKEN_CONN + self.next_conn;
            self.next_conn += 1;
            if epoll_add(self.epfd.as_raw_fd(), stream.as_raw_fd(), token).is_ok() {
                let since = crate::util::monotonic_ns();
                self.conns
                    .insert(token, Conn { stream, buf: Vec::new(), sender: None, reserved: 0, since, parked: false });
            }
        }
    }

    fn read(&mut self, token: u64) {
        let Some(c) = self.conns.get_mut(&token) else { return };
        if c.parked {
            return;
        }
        let mut chunk = [0u8; 64 * 1024];
        let mut verdict = Ok(());
        let closed = loop {
            // A large frame is read only within the budget: its length is reserved once its header is in.
            if !reserve(&mut self.reserved, c) {
                break false;
            }
            match c.stream.read(&mut chunk) {
                Ok(n) if n > 0 => {
                    c.buf.extend_from_slice(&chunk[..n]);
                    c.since = crate::util::monotonic_ns();
                    verdict = self.inbox.parse(c);
                    // What was reserved is taken again at the top for the frame still in progress, if any.
                    self.reserved -= c.reserved;
                    c.reserved = 0;
                    // A short read emptied the socket; epoll (level-triggered) reports anything later.
                    if verdict.is_err() || self.inbox.full() || n < chunk.len() {
                        break false;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break false,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                // End of stream, or an error.
                _ => break true,
            }
        };
        if closed || verdict.is_err() {
            return self.close(token, verdict.err().as_deref().map(str::as_bytes));
        }
        // No room for the frame in progress (as when the loop stopped for that: a failed `reserve` changes
        // nothing): out of the set until room frees up (no spinning on a readable socket left unread).
        if !reserve(&mut self.reserved, c) {
            epoll_del(self.epfd.as_raw_fd(), c.stream.as_raw_fd());
            c.parked = true;
            self.parked.push_back(token);
        }
        self.unpark();
    }

    /// Give parked connections whose frame now fits their reservation back to the epoll set, oldest first.
    fn unpark(&mut self) {
        while let Some(&t) = self.parked.front() {
            let Some(c) = self.conns.get_mut(&t) else {
                self.parked.pop_front();
                continue;
            };
            if !reserve(&mut self.reserved, c) {
                break;
            }
            self.parked.pop_front();
            c.parked = false;
            c.since = crate::util::monotonic_ns();
            if epoll_add(self.epfd.as_raw_fd(), c.stream.as_raw_fd(), t).is_err() {
                self.close(t, None);
            }
        }
        self.reserving.store(self.reserved as u64, Ordering::Release);
    }

    /// Cut off every connection that holds a reservation and has sent nothing for `stall`. Not while the
    /// queue is full: then nothing is read, and the stall window starts again once reading resumes.
    fn sweep(&mut self, now: u64) {
        self.inbox.queued = self.inbox.queue.held();
        if self.inbox.full() {
            for c in self.conns.values_mut().filter(|c| c.reserved > 0) {
                c.since = now;
            }
            return;
        }
        let stall = self.stall.as_nanos() as u64;
        let late: Vec<u64> = self
            .conns
            .iter()
            .filter(|(_, c)| c.reserved > 0 && !c.parked && now.saturating_sub(c.since) > stall)
            .map(|(t, _)| *t)
            .collect();
        for t in late {
            self.close(t, Some(b"frame stalled: nothing arrived for too long"));
        }
    }

    /// Close connection `token`, first telling it `why` it is refused, if given.
    fn close(&mut self, token: u64, why: Option<&[u8]>) {
        if let Some(c) = self.conns.remove(&token) {
            if let Some(why) = why {
                let _ = send_frame_now(&c.stream, KIND_REFUSE, why);
            }
            self.reserved -= c.reserved;
            if c.parked {
                self.parked.retain(|&t| t != token);
            } else {
                // Before it is closed.
                epoll_del(self.epfd.as_raw_fd(), c.stream.as_raw_fd());
            }
            self.unpark();
        }
    }
}

/// Reserve (in `total`, at most `LOCAL_BUDGET`) the bytes, header included, of the large frame at the front of
/// `c`'s buffer (its header in, the rest not yet), unless `c` holds a reservation already or has no such frame;
/// false when it does not fit.
fn reserve(total: &mut usize, c: &mut Conn) -> bool {
    let need = match announced(&c.buf) {
        Some(len) if c.reserved == 0 && len > RESERVE_ABOVE && c.buf.len() < 4 + len => 4 + len,
        _ => return true,
    };
    if *total + need > LOCAL_BUDGET {
        return false;
    }
    *total += need;
    c.reserved = need;
    true
}

/// The local socket's frames: `length u32 LE | kind u8 | body`, the length counting the kind and the body.
/// The frame at the front of `buf`:
enum Frame<'a> {
    /// complete: its kind and body, and the bytes it takes in `buf`;
    Whole(&'a [u8], usize),
    /// not all in yet;
    Partial,
    /// announcing a length of 0 or above the reader's bound (the length given).
    Refused(usize),
}

/// The length the frame at the front of `buf` announces, once its header is in.
fn announced(buf: &[u8]) -> Option<usize> {
    Some(u32::from_le_bytes(buf.get(..4)?.try_into().ok()?) as usize)
}

fn frame(buf: &[u8], max: usize) -> Frame<'_> {
    match announced(buf) {
        None => Frame::Partial,
        Some(len) if len == 0 || len > max => Frame::Refused(len),
        Some(len) => buf.get(4..4 + len).map_or(Frame::Partial, |b| Frame::Whole(b, 4 + len)),
    }
}

/// The header of a frame of `kind` with a body of `body_len` bytes.
fn frame_head(kind: u8, body_len: usize) -> [u8; 5] {
    let mut h = [kind; 5];
    h[..4].copy_from_slice(&((body_len + 1) as u32).to_le_bytes());
    h
}

/// A whole frame of `kind`: its header, then `body`.
fn framed(kind: u8, body: &[u8]) -> Vec<u8> {
    [&frame_head(kind, body.len())[..], body].concat()
}

/// A hello's body: to incarnation `target` (whose secret is `secret`), from agent `name` of incarnation `from`,
/// proven by a tag over `nonce`.
fn hello_body(secret: u128, target: u128, from: u128, nonce: &[u8; 16], name: &str) -> Vec<u8> {
    let tag = crate::auth::hello_tag(secret, TAG_KIND_LOCAL, target, nonce, &tagged_name(name, from));
    [&target.to_le_bytes()[..], &from.to_le_bytes(), nonce, &tag.to_le_bytes(), name.as_bytes()].concat()
}

/// The first `N` bytes of `b`, which the caller checked holds them (zeros otherwise).
fn le<const N: usize>(b: &[u8]) -> [u8; N] {
    b.get(..N).and_then(|b| b.try_into().ok()).unwrap_or([0; N])
}

/// A socket error's status: a timeout is the peer not answering yet (BACKEND), anything else the peer gone.
fn timed_out_or_gone(e: &io::Error) -> Status {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => Status::Backend,
        _ => Status::RemoteDisconnect,
    }
}

/// One small frame, without blocking (handshake frames into a socket with room for them).
fn send_frame_now(s: &UnixStream, kind: u8, body: &[u8]) -> io::Result<usize> {
    crate::os::sock::send_now(s.as_raw_fd(), &framed(kind, body))
}

/// Ok, or why the peer broke the protocol or failed to authenticate (the connection is then closed).
type Verdict = std::result::Result<(), String>;

impl Inbox {
    fn full(&self) -> bool {
        self.queue.full(self.queued)
    }

    /// Consume every complete frame in `c.buf` while the queue has room (`queued` counts what is in it).
    fn parse(&mut self, c: &mut Conn) -> Verdict {
        let mut at = 0;
        let verdict = loop {
            let max = if c.sender.is_some() { MAX_NOTIF + 1 } else { MAX_HELLO };
            match frame(&c.buf[at..], max) {
                Frame::Whole(body, n) => {
                    at += n;
                    if let Err(why) = self.take(&mut c.sender, &c.stream, body) {
                        break Err(why);
                    }
                }
                Frame::Partial => break Ok(()),
                Frame::Refused(len) => break Err(format!("frame of {len} bytes refused")),
            }
            if self.full() {
                break Ok(());
            }
        };
        c.buf.drain(..at);
        verdict
    }

    /// One complete frame (`body`: kind, then body) on the connection `stream` that speaks for `sender`.
    fn take(&mut self, sender: &mut Option<String>, stream: &UnixStream, body: &[u8]) -> Verdict {
        match (body[0], &*sender) {
            (KIND_HELLO, None) if body.len() >= HELLO_FIXED => {
                // Fixed-size fields at fixed places: `body` holds at least `HELLO_FIXED` bytes.
                let (target, from_inc) = (u128::from_le_bytes(le(&body[1..])), u128::from_le_bytes(le(&body[17..])));
                let (nonce, tag) = (le::<16>(&body[33..]), u64::from_le_bytes(le(&body[49..])));
                let name = std::str::from_utf8(&body[HELLO_FIXED..]).map_err(|_| "sender name is not UTF-8")?;
                if target != self.incarnation {
                    return Err(format!("this is incarnation {:032x}, not {target:032x}", self.incarnation));
                }
                let named = tagged_name(name, from_inc);
                if name.is_empty() || !crate::auth::hello_ok(self.secret, TAG_KIND_LOCAL, target, &nonce, &named, tag) {
                    return Err("authentication failed (wrong secret or cluster key)".into());
                }
                *sender = Some(name.to_owned());
                send_frame_now(stream, KIND_ACK, &[]).map_err(|_| "acknowledgement not sent")?;
            }
            (KIND_FD_REQ, Some(_)) if body.len() == 5 => {
                let fd = i32::from_le_bytes([body[1], body[2], body[3], body[4]]);
                // Held across the reply: the owner withdraws a descriptor (under this lock) before closing it.
                let o = self.offered.lock();
                let sent = if o.contains(&fd) { send_fd_now(stream, fd) } else { send_frame_now(stream, KIND_FD, &[]) };
                sent.map_err(|_| "descriptor reply not sent")?;
            }
            (KIND_NOTIF, Some(name)) => {
                self.queue.lock().push((name.clone(), body[1..].to_vec()));
                self.queued.0 += 1;
                self.queued.1 += name.len() + body.len() - 1;
            }
            (_, None) => return Err("expected an authenticated hello".into()),
            _ => return Err("unexpected frame (a connection speaks for one agent only)".into()),
        }
        Ok(())
    }
}

/// The `KIND_FD` reply for descriptor `fd` of this process, the descriptor attached, without blocking.
fn send_fd_now(s: &UnixStream, fd: RawFd) -> io::Result<usize> {
    // SAFETY: `fd` is open while offered (the caller holds the lock the owner withdraws it under).
    let id = crate::device::fd_identity(unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) })?;
    let body = crate::device::fd_handle_bytes(fd, id);
    crate::os::fdpass::send_with_fd(s.as_raw_fd(), &mut framed(KIND_FD, &body), fd)
}

/// Ask the engine listening on `sock_name` as process `pid` (incarnation `target`, whose secret is `secret`) for its
/// descriptor number `fd`, over a fresh authenticated connection: how a peer takes a VMM allocation or the
/// transfer gate when the kernel refuses it `pidfd_getfd` (another uid allowed by `GIXL_ALLOW_UIDS`, Yama,
/// a container's seccomp profile). The target sends only descriptors it offers ([`Ctrl::offer_fd`]).
/// Returns the descriptor (close-on-exec) and its identity (st_dev, st_ino) as the target saw it; the
/// caller checks it against what it expects. Bounded by the send timeout.
pub fn request_fd(
    sock_name: &[u8],
    target: u128,
    secret: u128,
    from: &str,
    from_incarnation: u128,
    pid: i32,
    fd: i32,
) -> Result<(OwnedFd, (u64, u64))> {
    let mut s = Sender::connect(sock_name, target, secret, from, from_incarnation)?;
    if crate::os::fdpass::peer_cred(s.stream.as_raw_fd()).map(|c| c.pid) != Some(pid) {
        return Err(Error::disconnected(format!("the control socket of process {pid} is served by another process")));
    }
    s.stream.set_read_timeout(Some(SEND_TIMEOUT)).map_err(|e| Error::os(Status::Backend, "socket option", e))?;
    s.send(KIND_FD_REQ, &fd.to_le_bytes())?;
    let mut buf: Vec<u8> = Vec::new();
    let mut got: Option<OwnedFd> = None;
    loop {
        // Complete frames first: the acceptance (if it had not come yet), a refusal, the reply.
        loop {
            let (kind, body) = match frame(&buf, 4096) {
                Frame::Whole(b, n) => {
                    let kb = (b[0], b[1..].to_vec());
                    buf.drain(..n);
                    kb
                }
                Frame::Partial => break,
                Frame::Refused(_) => return Err(Error::backend("the peer's control socket sent a malformed frame")),
            };
            match kind {
                KIND_ACK => {}
                KIND_REFUSE => return Err(refused(&body)),
                KIND_FD if body.is_empty() => {
                    return Err(Error::not_found(format!("the peer does not offer descriptor {fd}")))
                }
                KIND_FD if body.len() == 20 => {
                    let f = got.ok_or_else(|| Error::backend("the peer's descriptor reply carried no descriptor"))?;
                    return Ok((f, (u64::from_le_bytes(le(&body[4..])), u64::from_le_bytes(le(&body[12..])))));
                }
                _ => return Err(Error::backend("the peer's control socket sent an unexpected frame")),
            }
        }
        let mut chunk = [0u8; 512];
        // Every descriptor that came is owned (extras closed), whatever else happens.
        let n = match crate::os::fdpass::recv_with_fds(s.stream.as_raw_fd(), &mut chunk, &mut got) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(Error::os(timed_out_or_gone(&e), "waiting for the peer's descriptor", e)),
        };
        if n == 0 {
            return Err(Error::disconnected("the peer closed its control connection before sending the descriptor"));
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// For `crate::fuzzing` only: run `Inbox::parse` over `data` as one read and, again, split in two reads at
/// `split`, on a connection whose secret is `incarnation`; returns the notifications queued by the first run.
pub(crate) fn fuzz_parse_frames(data: &[u8], split: usize, incarnation: u128) -> usize {
    let queue: Arc<NotifQueue> = Arc::default();
    queue.set_bounds(usize::MAX, usize::MAX);
    let mut inbox = Inbox { incarnation, secret: incarnation, queue, queued: (0, 0), offered: Arc::default() };
    // The other end stays open while the connection is parsed (the hello is answered on it).
    let conn = |buf: &[u8]| {
        let (stream, other) = UnixStream::pair().expect("socketpair");
        let _ = stream.set_nonblocking(true);
        (Conn { stream, buf: buf.to_vec(), sender: None, reserved: 0, since: 0, parked: false }, other)
    };
    let (mut c, _other) = conn(data);
    let _ = inbox.parse(&mut c);
    let n = inbox.queue.lock().len();
    let split = split.min(data.len());
    let (mut c, _other) = conn(&data[..split]);
    if inbox.parse(&mut c).is_ok() {
        c.buf.extend_from_slice(&data[split..]);
        let _ = inbox.parse(&mut c);
    }
    n
}

/// For `crate::fuzzing` only: a valid hello for `fuzz_parse_frames`'s connection.
pub(crate) fn fuzz_hello(incarnation: u128, from: &str) -> Vec<u8> {
    framed(KIND_HELLO, &hello_body(incarnation, incarnation, 1, &[0; 16], from))
}
/// How long after the application's last `notifs` poll the progress thread leaves the local sockets to it.
const POLL_GRACE_NS: u64 = 2_000_000;

/// The local epoll set in the progress thread's reactor: one-shot, re-armed by whoever drained it.
const LOCAL_ARM: u32 = (libc::EPOLLIN | libc::EPOLLONESHOT) as u32;

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::FromRawFd;

    /// A control listener on loopback TCP (one data connection, 1 s timeout) and the queue it delivers into.
    fn start_ctrl(inc: u128, secret: u128) -> (Arc<NotifQueue>, Ctrl) {
        let q: Arc<NotifQueue> = Arc::default();
        let setup = TcpSetup {
            bind: "127.0.0.1:0".parse().unwrap(),
            opts: super::super::route::tcp::listen::TcpOpts { conns: 1, timeout: Duration::from_secs(1) },
            secret,
            regions: Arc::default(),
        };
        let ctrl = Ctrl::start(inc, q.clone(), setup).unwrap();
        (q, ctrl)
    }

    /// Authenticated senders that start 60 MiB frames and stop: two fit the 128 MiB budget, the third waits
    /// out of the epoll set (not read, nothing buffered past its header), small notifications still arrive,
    /// and once the stalled two are cut off the third is read and delivered.
    #[test]
    fn large_frames_in_progress_stay_within_the_local_budget() {
        let inc = 93u128;
        let (q, ctrl) = start_ctrl(inc, 3);
        ctrl.c.local.lock().stall = Duration::from_millis(300);
        let big = 60usize << 20;
        let start = |who: &str, k: u128| {
            let mut s = Sender::connect(&ctrl.sock_name, inc, 3, who, k).unwrap();
            let mut head = ((big + 1) as u32).to_le_bytes().to_vec();
            head.push(KIND_NOTIF);
            head.extend_from_slice(&[9u8; 1000]);
            s.stream.write_all(&head).unwrap();
            s
        };
        let (_a, _b) = (start("stall-a", 1), start("stall-b", 2));
        let wait = |what: &str, f: &dyn Fn() -> bool| {
            let t = std::time::Instant::now();
            while !f() {
                assert!(t.elapsed() < Duration::from_secs(10), "timed out waiting for {what}");
                std::thread::sleep(Duration::from_millis(5));
            }
        };
        wait("two reservations", &|| ctrl.c.local.lock().reserved == 2 * (big + 5));
        let mut c = start("late-c", 3);
        wait("the third parked", &|| ctrl.c.local.lock().parked.len() == 1);
        assert_eq!(ctrl.c.local.lock().reserved, 2 * (big + 5), "nothing reserved past the budget");
        let mut d = Sender::connect(&ctrl.sock_name, inc, 3, "small-d", 4).unwrap();
        d.notif(b"small").unwrap();
        wait("a small notification meanwhile", &|| q.lock().iter().any(|(n, m)| n == "small-d" && m == b"small"));
        // The two stall past 300 ms and are cut; the third is read on.
        wait("the stalled two cut off", &|| ctrl.c.local.lock().parked.is_empty());
        c.stream.write_all(&vec![9u8; big - 1000]).unwrap();
        wait("the third's frame", &|| q.lock().iter().any(|(n, m)| n == "late-c" && m.len() == big));
        assert_eq!(ctrl.c.local.lock().reserved, 0);
    }

    #[test]
    fn notifications_arrive_in_order_and_strangers_are_dropped() {
        let inc = 77u128;
        let (q, ctrl) = start_ctrl(inc, 1);
        let mut s = Sender::connect(&ctrl.sock_name, inc, 1, "peer-a", 5).unwrap();
        s.notif(b"one").unwrap();
        s.notif(b"").unwrap();
        s.notif(&vec![7u8; 2 << 20]).unwrap();
        // A sender that names the wrong incarnation or does not know the secret is refused, and says why.
        for (target, secret, what) in [(inc + 1, 1, "incarnation"), (inc, 2, "authentication failed")] {
            let e = Sender::connect(&ctrl.sock_name, target, secret, "intruder", 6).err().expect("refused");
            assert_eq!(e.status(), Status::NotAllowed, "{e}");
            assert!(e.to_string().contains(what), "{e}");
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while q.lock().len() < 3 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(50));
        let got = q.lock().clone();
        assert_eq!(got.len(), 3);
        assert_eq!(got[0], ("peer-a".to_string(), b"one".to_vec()));
        assert_eq!(got[1].1, b"");
        assert_eq!(got[2].1.len(), 2 << 20);
        ctrl.shutdown();
    }

    #[test]
    fn polling_reads_in_order_and_the_progress_thread_takes_over_when_polling_stops() {
        let inc = 78u128;
        let (q, ctrl) = start_ctrl(inc, 1);
        let name = ctrl.sock_name.clone();
        let senders: Vec<_> = (0..2)
            .map(|k| {
                let name = name.clone();
                std::thread::spawn(move || {
                    let mut s = Sender::connect(&name, inc, 1, &format!("p{k}"), k).unwrap();
                    for i in 0..2000u32 {
                        s.notif(&i.to_le_bytes()).unwrap();
                    }
                })
            })
            .collect();
        // The application polls while the senders run: per-sender order is kept.
        let mut got: Vec<(String, Vec<u8>)> = Vec::new();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while got.len() < 4000 && std::time::Instant::now() < deadline {
            ctrl.drain();
            got.append(&mut q.lock());
        }
        for s in senders {
            s.join().unwrap();
        }
        assert_eq!(got.len(), 4000);
        for k in 0..2 {
            let seq: Vec<u32> = got
                .iter()
                .filter(|(n, _)| *n == format!("p{k}"))
                .map(|(_, m)| u32::from_le_bytes(m[..4].try_into().unwrap()))
                .collect();
            assert_eq!(seq, (0..2000).collect::<Vec<_>>());
        }
        // Polling stops: the progress thread queues what comes later on its own.
        let mut s = Sender::connect(&name, inc, 1, "late", 9).unwrap();
        s.notif(b"after").unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while q.lock().is_empty() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(q.lock().clone(), vec![("late".to_string(), b"after".to_vec())]);
        ctrl.shutdown();
    }

    fn raw_frames(s: &mut UnixStream, frames: &[(u8, &[u8])]) {
        for (kind, body) in frames {
            let mut f = ((body.len() + 1) as u32).to_le_bytes().to_vec();
            f.push(*kind);
            f.extend_from_slice(body);
            s.write_all(&f).unwrap();
        }
    }

    fn read_frame(s: &mut UnixStream) -> Option<(u8, Vec<u8>)> {
        let mut head = [0u8; 5];
        s.read_exact(&mut head).ok()?;
        let mut body = vec![0u8; u32::from_le_bytes(head[..4].try_into().unwrap()) as usize - 1];
        s.read_exact(&mut body).ok()?;
        Some((head[4], body))
    }

    #[test]
    fn offered_descriptors_pass_with_scm_rights_and_nothing_else_does() {
        let (inc, secret) = (91u128, 5u128);
        let (_q, ctrl) = start_ctrl(inc, secret);
        // SAFETY: plain syscall with a static name; checked.
        let m = unsafe { libc::memfd_create(c"gixl-test-offer".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(m >= 0);
        // SAFETY: a fresh descriptor we own.
        let m = unsafe { OwnedFd::from_raw_fd(m) };
        let want = crate::device::fd_identity(std::os::fd::AsFd::as_fd(&m)).unwrap();
        // Not offered yet: refused, though the number is open here.
        let me = std::process::id() as i32;
        let e = request_fd(&ctrl.sock_name, inc, secret, "asker", 3, me, m.as_raw_fd()).err().unwrap();
        assert_eq!(e.status(), Status::NotFound, "{e}");
        ctrl.offer_fd(m.as_raw_fd());
        // Served by another pid than the one expected: refused before asking.
        let e = request_fd(&ctrl.sock_name, inc, secret, "asker", 3, me + 1, m.as_raw_fd()).err().unwrap();
        assert_eq!(e.status(), Status::RemoteDisconnect, "{e}");
        let (got, id) = request_fd(&ctrl.sock_name, inc, secret, "asker", 3, me, m.as_raw_fd()).unwrap();
        assert_eq!(id, want);
        assert_eq!(crate::device::fd_identity(std::os::fd::AsFd::as_fd(&got)).unwrap(), want);
        assert_ne!(got.as_raw_fd(), m.as_raw_fd(), "a new descriptor, not ours");
        // SAFETY: plain syscall on a descriptor we own.
        assert!(unsafe { libc::fcntl(got.as_raw_fd(), libc::F_GETFD) } & libc::FD_CLOEXEC != 0);
        // Without the secret: no descriptor. Withdrawn: none either.
        assert!(request_fd(&ctrl.sock_name, inc, secret + 1, "intruder", 4, me, m.as_raw_fd()).is_err());
        ctrl.withdraw_fd(m.as_raw_fd());
        let e = request_fd(&ctrl.sock_name, inc, secret, "asker", 3, me, m.as_raw_fd()).err().unwrap();
        assert_eq!(e.status(), Status::NotFound, "{e}");
    }

    #[test]
    fn a_connection_speaks_for_one_authenticated_sender_only() {
        let inc = 79u128;
        let (q, ctrl) = start_ctrl(inc, 3);
        let addr = SocketAddr::from_abstract_name(&ctrl.sock_name).unwrap();
        // The old, unauthenticated hello (incarnation + name) and a notification: refused, nothing queued.
        let mut s = UnixStream::connect_addr(&addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut old = inc.to_le_bytes().to_vec();
        old.extend_from_slice(b"prefill-0");
        raw_frames(&mut s, &[(KIND_HELLO, &old), (KIND_NOTIF, b"forged")]);
        assert_eq!(read_frame(&mut s).map(|f| f.0), Some(KIND_REFUSE));
        assert_eq!(read_frame(&mut s), None, "closed");
        // A notification before any hello: refused.
        let mut s = UnixStream::connect_addr(&addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        raw_frames(&mut s, &[(KIND_NOTIF, b"forged")]);
        assert_eq!(read_frame(&mut s).map(|f| f.0), Some(KIND_REFUSE));
        // An authenticated sender cannot switch names with a second hello.
        let mut good = Sender::connect(&ctrl.sock_name, inc, 3, "decode-1", 11).unwrap();
        good.notif(b"mine").unwrap();
        let _ = good.send(KIND_HELLO, &old);
        let _ = good.notif(b"as prefill-0");
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while q.lock().is_empty() && std::time::Instant::now() < deadline {
            ctrl.drain();
        }
        // The refusal closes the connection: a later send fails instead of being attributed to anyone.
        let mut later = Err(Error::backend(""));
        for _ in 0..100 {
            later = good.notif(b"after");
            if later.is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(later.is_err());
        ctrl.drain();
        assert_eq!(q.lock().clone(), vec![("decode-1".to_string(), b"mine".to_vec())]);
        ctrl.shutdown();
    }

    #[test]
    fn a_full_queue_blocks_the_sender_which_then_fails_and_nothing_is_lost() {
        let inc = 80u128;
        let (q, ctrl) = start_ctrl(inc, 4);
        q.set_bounds(100, 1 << 20);
        let mut s = Sender::connect(&ctrl.sock_name, inc, 4, "flood", 1).unwrap();
        s.set_timeout(Duration::from_millis(300));
        let msg = vec![7u8; 4096];
        let mut sent = 0u32;
        let err = loop {
            let mut m = msg.clone();
            m[..4].copy_from_slice(&sent.to_le_bytes());
            match s.notif(&m) {
                Ok(()) => sent += 1,
                Err(e) => break e,
            }
            assert!(sent < 100_000, "the sender was never stopped");
        };
        assert_eq!(err.status(), Status::Backend);
        assert!(err.to_string().contains("queue is full"), "{err}");
        assert!(q.lock().len() <= 100, "queue bounded: {}", q.lock().len());
        drop(s);
        // Every notification the sender was told went through arrives, in order, once the application polls.
        let mut got = Vec::new();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while got.len() < sent as usize && std::time::Instant::now() < deadline {
            ctrl.drain();
            got.append(&mut q.lock());
        }
        let seq: Vec<u32> = got.iter().map(|(_, m)| u32::from_le_bytes(m[..4].try_into().unwrap())).collect();
        assert_eq!(seq, (0..sent).collect::<Vec<_>>());
        ctrl.shutdown();
    }

    /// An authenticated TCP control connection, as a raw client.
    fn tcp_ctrl_client(ctrl: &Ctrl, inc: u128, secret: u128, name: &str) -> std::net::TcpStream {
        use super::super::route::tcp::wire;
        let mut s = std::net::TcpStream::connect(("127.0.0.1", ctrl.tcp.port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut c = [0u8; wire::CHALLENGE_BYTES];
        s.read_exact(&mut c).unwrap();
        let nonce = wire::parse_challenge(&c).unwrap();
        let tag = crate::auth::hello_tag(secret, wire::KIND_CTRL, inc, &nonce, name);
        let hello = wire::Hello { kind: wire::KIND_CTRL, incarnation: inc, tag, name: name.into() };
        s.write_all(&wire::encode_hello(&hello)).unwrap();
        let mut ack = [0u8; 1];
        s.read_exact(&mut ack).unwrap();
        assert_eq!(ack[0], wire::ACK);
        s
    }

    /// The control connections' shared budget: two peers announce maximum-size notifications (a header
    /// each, no data). The first reserves its length; the second does not fit beside it and is not read,
    /// nor is a third connection behind it. Once the first goes away both are read; the second, silent
    /// with its reservation, is closed after the stall bound.
    #[test]
    fn tcp_control_connections_share_a_budget() {
        use super::super::route::tcp::wire;
        let (inc, secret) = (82u128, 6u128);
        let (q, ctrl) = start_ctrl(inc, secret);
        let ping = wire::encode_ctrl_head(wire::CTRL_PING, 0);
        let pong = wire::encode_ctrl_head(wire::CTRL_PONG, 0);
        let mut big = Vec::new();
        for name in ["big-1", "big-2"] {
            let mut s = tcp_ctrl_client(&ctrl, inc, secret, name);
            // PING, then the header of a 64 MiB notification: the PONG shows both were read.
            let mut f = ping.to_vec();
            f.extend_from_slice(&wire::encode_ctrl_head(wire::CTRL_NOTIF, MAX_NOTIF));
            s.write_all(&f).unwrap();
            let mut p = [0u8; 5];
            s.read_exact(&mut p).unwrap();
            assert_eq!(p, pong);
            big.push(s);
        }
        let mut small = tcp_ctrl_client(&ctrl, inc, secret, "small");
        let mut f = wire::encode_ctrl_head(wire::CTRL_NOTIF, 1).to_vec();
        f.push(9);
        f.extend_from_slice(&ping);
        small.write_all(&f).unwrap();
        let mut p = [0u8; 5];
        small.read_exact(&mut p).unwrap();
        assert_eq!(p, pong);
        // Had the connection been read, its notification would be queued before its PING was answered:
        // this PONG is the paused connection's keep-alive.
        assert!(q.lock().is_empty());
        drop(big.remove(0));
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while q.lock().is_empty() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(q.lock().first().map(|(n, m)| (n.as_str(), m.clone())), Some(("small", vec![9])));
        // A reservation whose sender then says nothing is closed after the stall bound (5 s here).
        let t = std::time::Instant::now();
        let mut rest = [0u8; 5];
        // Keep-alive PONGs from while it was paused come first.
        let end = loop {
            match big[0].read(&mut rest) {
                Ok(5) if rest == pong => continue,
                r => break r,
            }
        };
        assert!(
            matches!(end, Ok(0)) || end.as_ref().is_err_and(|e| e.kind() == io::ErrorKind::ConnectionReset),
            "{end:?}"
        );
        assert!(t.elapsed() < Duration::from_secs(9), "{:?}", t.elapsed());
        ctrl.shutdown();
    }

    /// Over TCP: a control connection whose notifications do not fit is paused (not read: the queue
    /// stays at its bound), still shows the sender it is alive (a PONG arrives while its PING sits
    /// unread), and resumes, in order, once the application takes notifications.
    #[test]
    fn a_paused_tcp_control_connection_answers_heartbeats_and_resumes() {
        use super::super::route::tcp::wire;
        let (inc, secret) = (81u128, 5u128);
        let (q, ctrl) = start_ctrl(inc, secret);
        q.set_bounds(2, 1 << 20);
        let mut s = tcp_ctrl_client(&ctrl, inc, secret, "pinger");
        let mut frames = Vec::new();
        for i in 0..3u8 {
            frames.extend_from_slice(&wire::encode_ctrl_head(wire::CTRL_NOTIF, 1));
            frames.push(i);
        }
        frames.extend_from_slice(&wire::encode_ctrl_head(wire::CTRL_PING, 0));
        s.write_all(&frames).unwrap();
        let mut pong = [0u8; 5];
        s.read_exact(&mut pong).unwrap();
        assert_eq!(pong, wire::encode_ctrl_head(wire::CTRL_PONG, 0));
        // The PONG came while the third notification (and the PING behind it) waits unread.
        assert_eq!(q.lock().len(), 2);
        assert!(ctrl.tcp.paused.load(Ordering::SeqCst));
        let mut got = std::mem::take(&mut *q.lock());
        ctrl.tcp.notifs_taken();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while got.len() < 3 && std::time::Instant::now() < deadline {
            got.append(&mut q.lock());
            std::thread::sleep(Duration::from_millis(1));
        }
        let seq: Vec<u8> = got.iter().map(|(_, m)| m[0]).collect();
        assert_eq!(seq, [0, 1, 2]);
        // Resumed: the connection is read as before.
        let mut more = wire::encode_ctrl_head(wire::CTRL_NOTIF, 1).to_vec();
        more.push(3);
        s.write_all(&more).unwrap();
        while q.lock().is_empty() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(q.lock().first().map(|(n, m)| (n.as_str(), m[0])), Some(("pinger", 3)));
        ctrl.shutdown();
    }

    #[test]
    fn a_stopped_target_still_takes_the_hello_and_notifications() {
        // A listener nobody accepts on: what a SIGSTOPped agent's socket looks like.
        let name = format!("gixl-test-stopped.{}", std::process::id()).into_bytes();
        let _l = UnixListener::bind_addr(&SocketAddr::from_abstract_name(&name).unwrap()).unwrap();
        let t = std::time::Instant::now();
        let mut s = Sender::connect(&name, 1, 2, "me", 3).unwrap();
        assert!(t.elapsed() < ACK_WAIT + Duration::from_secs(2), "{:?}", t.elapsed());
        s.notif(b"queued in the socket").unwrap();
    }
}
