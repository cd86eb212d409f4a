//! The TCP route's listener and both ends of its control connections: the progress thread's TCP side (the
//! route's other parts are listed in `tcp`).
//!
//! Per peer the initiator opens one control connection (heartbeats, notifications) and up to `conns` data
//! connections (default 4). Each is authenticated: the target sends a fresh nonce, the initiator answers
//! with the target's incarnation and a MAC of the nonce under the target's 128-bit secret, which only ever
//! travels inside the target's metadata (never on the wire). The target answers a good HELLO with ACK, a
//! wrong incarnation or tag with NAK, and closes anything else without a word. Strangers cannot starve a
//! real peer of handshakes: pending connections are capped per source address (the oldest of a source
//! makes room for its newest) and in total (the source holding the most gives way), and each must finish
//! its handshake within `TcpOpts::handshake`.
//!
//! Liveness (see `health`): the progress thread (see `ctrl`) reads the control connections and feeds each
//! peer's state machine the time. While a peer has requests in flight it is pinged every `timeout / 8` and
//! goes down when nothing (a pong or data progress) has arrived for `3/4 × timeout`, so requests fail
//! within `timeout` of a partition; a closed connection is seen at once. Going down shuts all the peer's
//! sockets, which wakes every thread blocked on them. Down is not dead: a later request redials once the
//! back-off has passed (dials retry inside the disconnect timeout), and the peer is up again if the same
//! incarnation answers; a NAK or a refused connection proves it gone for good. An idle peer gets no timers.
//!
//! Notifications are back-pressured, never dropped: while the notification queue is over its limits (or
//! the control connections' shared buffer budget is spent), the progress thread stops reading a control
//! connection (out of the epoll set, so nothing spins) and sends its peer an unsolicited PONG every
//! heartbeat interval instead of answering the PINGs it no longer reads; the application taking
//! notifications resumes the paused connections, oldest first. The sender writes each frame without
//! blocking, within a bound: when the target does not take it, the sender gets BACKEND and the link stays
//! up (a frame left half written retires that control connection: it is half-closed, and the target
//! queues everything before the partial frame).

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;

use super::regions::Regions;
use super::serve::Serving;
use super::wire::{self, CtrlMsg};
use crate::backend::engine::health::{LiveCfg, Tick};
use crate::backend::engine::notif::{NotifQueue, MAX_NOTIF};
use crate::os::sock as net;
use crate::os::{Reactor, Tokens};
use crate::status::{Error, Result, Status};
use crate::util::monotonic_ns;

/// Pending (not yet authenticated) inbound connections kept at once. When full, a newcomer takes the slot
/// of the oldest pending connection of the source address that holds the most: strangers flooding from a
/// few addresses only ever push out each other, and a real peer's handshake (one round trip) gets through.
const MAX_PENDING: usize = 256;
/// Pending connections one source address may hold; its oldest is closed to make room for its newest.
const PER_SOURCE: usize = 16;
/// Connections taken from the listener before the progress thread serves other ready connections.
const ACCEPT_BURST: usize = 64;
/// Authenticated inbound control connections kept at once.
const MAX_CTRL_IN: usize = 1024;
/// Bytes the authenticated inbound control connections may hold at once, together (a frame being received
/// reserves its whole length when its header arrives; frames waiting for room in the notification queue
/// count too), plus at most one read chunk each. A connection that would exceed it is not read until
/// others have made room; one frame in progress always may finish, so the budget cannot deadlock.
const CTRL_BUDGET: usize = 128 << 20;
/// One read from a control connection.
const CTRL_CHUNK: usize = 64 * 1024;

/// Options of the TCP route (engine parameters `tcp_conns`, `disconnect_timeout_ms`, or the environment).
#[derive(Debug, Clone, Copy)]
pub struct TcpOpts {
    /// Data connections per peer.
    pub conns: usize,
    /// A peer that answers nothing for this long while requests are in flight is declared dead.
    pub timeout: Duration,
}

impl TcpOpts {
    /// How long one blocking socket call may make no progress before the connection is given up. A safety
    /// net under the heartbeat, and the bound on how long a stalled initiator can keep a target thread.
    pub fn stall(&self) -> Duration {
        (self.timeout * 5).max(Duration::from_secs(5))
    }
    /// The heartbeat timing of a link (see `health`).
    pub fn live(&self) -> LiveCfg {
        LiveCfg::for_timeout(self.timeout.as_nanos() as u64)
    }
    /// How long a data connection of a peer that still answers heartbeats may make no progress before the
    /// request is given up: a target that is alive but slow (serving many peers on few cores) is waited for,
    /// since the disconnect timeout measures silence, not slowness; this bounds only a peer that answers but
    /// never serves.
    pub fn patience(&self) -> Duration {
        self.stall() * 12
    }
    /// A connection must complete its handshake within this long (one round trip in practice).
    pub fn handshake(&self) -> Duration {
        (self.timeout * 2).clamp(Duration::from_millis(500), Duration::from_secs(10))
    }
}

/// Where to listen: `GIXL_TCP_ADDR` (or the `tcp_addr` parameter) as `IP`, `IP:PORT` or `[IPv6]:PORT`.
pub fn parse_bind(s: &str) -> Result<SocketAddr> {
    let s = s.trim();
    if s.is_empty() {
        return Ok(SocketAddr::from(([0, 0, 0, 0], 0)));
    }
    s.parse::<SocketAddr>()
        .or_else(|_| s.trim_start_matches('[').trim_end_matches(']').parse::<IpAddr>().map(|ip| SocketAddr::new(ip, 0)))
        .map_err(|_| Error::invalid_param(format!("'{s}' is not an IP address or IP:port for the TCP listener")))
}

/// The addresses to advertise for a listener bound to `bound`: that address if it is specific, else the
/// host's interface addresses of the same family (non-loopback first).
pub fn advertised(bound: SocketAddr) -> Vec<SocketAddr> {
    let port = bound.port();
    if !bound.ip().is_unspecified() {
        return vec![bound];
    }
    let v6 = bound.is_ipv6();
    let mut ips: Vec<IpAddr> = net::interface_addrs().into_iter().filter(|ip| v6 || ip.is_ipv4()).collect();
    ips.sort_by_key(|ip| ip.is_loopback());
    if ips.is_empty() {
        ips.push(if v6 { IpAddr::from([0u16, 0, 0, 0, 0, 0, 0, 1]) } else { IpAddr::from([127, 0, 0, 1]) });
    }
    ips.into_iter().map(|ip| SocketAddr::new(ip, port)).collect()
}

/// What the TCP side of the progress thread needs.
pub struct TcpSetup {
    pub bind: SocketAddr,
    pub opts: TcpOpts,
    pub secret: u128,
    pub regions: Arc<Regions>,
}

/// What the progress thread asks of the link behind an outbound control connection (`link::TcpLink`; a trait,
/// so that the listener does not import the link, which imports it).
pub trait Watched: Send + Sync {
    /// Requests in flight on the link.
    fn inflight(&self) -> usize;
    /// When the peer last answered (monotonic ns).
    fn last_rx(&self) -> u64;
    /// The peer answered now.
    fn touch(&self);
    /// The link's liveness at `now` (see `Liveness::tick`).
    fn tick(&self, now: u64, inflight: usize, last_rx: u64) -> Tick;
    /// Take the link down, saying `why`.
    fn kill(&self, why: String);
}

/// The engine's TCP side, shared by the progress thread, the links to peers and the serving threads.
pub struct TcpShared {
    pub incarnation: u128,
    pub secret: u128,
    pub opts: TcpOpts,
    pub port: u16,
    pub addrs: Vec<SocketAddr>,
    /// The progress thread's reactor, and this side's tokens in it (see `LISTEN`).
    reactor: Arc<Reactor>,
    tokens: Tokens,
    out: Mutex<HashMap<u64, Out>>,
    next_out: AtomicU64,
    /// The serving loops and the data connections they serve.
    serve: Arc<Serving>,
    /// Some inbound control connection is paused (queue full or budget spent).
    pub(crate) paused: AtomicBool,
    /// The application took notifications: the progress thread should resume paused connections.
    resume: AtomicBool,
    /// Who takes authenticated connections of other routes' kinds (`wire::KIND_ROUTES`), by kind.
    sides: Mutex<Vec<(u8, Arc<SideHandler>)>>,
}

/// Takes an authenticated connection of another route's kind, its ACK sent, blocking.
pub(crate) type SideHandler = Box<dyn Fn(TcpStream) + Send + Sync>;

/// An outbound control connection as the progress thread sees it.
struct Out {
    conn: Arc<CtrlConn>,
    link: Weak<dyn Watched>,
    buf: Vec<u8>,
}

/// A control connection to a peer. Frames are written whole under `w`.
pub struct CtrlConn {
    pub(crate) stream: TcpStream,
    pub(crate) w: Mutex<()>,
    pub(crate) token: u64,
    /// The link's epoch when it was made.
    pub(crate) epoch: u64,
    /// A notification was left half written (the target did not take it in time): the connection was
    /// half-closed and replaced, and its end is not a death.
    pub(crate) retired: AtomicBool,
}

impl TcpShared {
    /// Hand authenticated connections of `kind` (one of `wire::KIND_ROUTES`) to `h` from now on (once a kind;
    /// later calls for it are ignored).
    pub(crate) fn set_side(&self, kind: u8, h: SideHandler) {
        let mut sides = self.sides.lock();
        if wire::KIND_ROUTES.contains(&kind) && sides.iter().all(|(k, _)| *k != kind) {
            sides.push((kind, Arc::new(h)));
        }
    }

    /// The application took notifications: if a control connection waits for room, look again.
    pub fn notifs_taken(&self) {
        if self.paused.load(Ordering::SeqCst) {
            self.resume.store(true, Ordering::SeqCst);
            self.wake();
        }
    }

    pub(crate) fn wake(&self) {
        self.reactor.wake();
    }

    /// A token for a new outbound control connection (`add_out`).
    pub(crate) fn out_token(&self) -> u64 {
        self.tokens.token(OUT + self.next_out.fetch_add(1, Ordering::Relaxed) % (1 << 32))
    }

    /// `token` is one of this side's (see `TcpProgress::on_event`).
    pub fn owns(&self, token: u64) -> bool {
        self.tokens.owns(token)
    }

    pub(crate) fn add_out(&self, conn: Arc<CtrlConn>, link: Weak<dyn Watched>) -> Result<()> {
        self.out.lock().insert(conn.token, Out { conn: conn.clone(), link, buf: Vec::new() });
        self.reactor.add_input(conn.stream.as_raw_fd(), conn.token).inspect_err(|_| {
            self.out.lock().remove(&conn.token);
        })
    }

    /// Shut down and forget every control connection registered for `link` (see `add_out`).
    pub(crate) fn remove_outs_of<T>(&self, link: *const T) {
        let mine: Vec<u64> =
            self.out.lock().iter().filter(|(_, o)| std::ptr::addr_eq(o.link.as_ptr(), link)).map(|(t, _)| *t).collect();
        for t in mine {
            if let Some(o) = self.out.lock().get(&t) {
                let _ = o.conn.stream.shutdown(Shutdown::Both);
            }
            self.remove_out(t);
        }
    }

    pub(crate) fn remove_out(&self, token: u64) {
        if let Some(o) = self.out.lock().remove(&token) {
            // It is still open (`o` holds it).
            self.reactor.remove(o.conn.stream.as_raw_fd());
        }
    }

    /// The engine is going away: `Serving::close`, and the outbound control connections are shut down.
    pub fn close(&self) {
        self.serve.close();
        let outs: Vec<_> = self.out.lock().drain().map(|(_, o)| o).collect();
        for o in outs {
            let _ = o.conn.stream.shutdown(Shutdown::Both);
        }
    }

    /// Called by the progress thread on each wake-up: feeds each peer's `Liveness` the time and what it
    /// needs, and does what it says (ping, declare down). Returns how long it may sleep (None: until
    /// something happens).
    fn tick(&self, now: u64) -> Option<u64> {
        let mut next: Option<u64> = None;
        let mut down = Vec::new();
        // Links upgraded under the lock are dropped after it: dropping the last one unregisters it.
        let mut seen = Vec::new();
        let silence = self.opts.live().silence;
        {
            let out = self.out.lock();
            for o in out.values().filter(|o| !o.conn.retired.load(Ordering::Acquire)) {
                let Some(link) = o.link.upgrade() else { continue };
                let inflight = link.inflight();
                let mut last_rx = link.last_rx();
                // An answer this thread has not read yet (it was not scheduled in time, which is our slowness,
                // not the peer's silence) is a sign of life: the event loop reads it next.
                if inflight > 0 && now >= last_rx.saturating_add(silence) && net::readable(o.conn.stream.as_raw_fd()) {
                    link.touch();
                    last_rx = link.last_rx();
                }
                let t = link.tick(now, inflight, last_rx);
                if t.ping {
                    ping(&o.conn);
                }
                if t.down {
                    down.push(link.clone());
                }
                next = next.into_iter().chain(t.wake_in).min();
                seen.push(link);
            }
        }
        for link in down {
            link.kill(format!("no answer to heartbeats for {:?}", Duration::from_nanos(silence)));
        }
        next
    }

    /// Bytes arrived on an outbound control connection.
    fn on_out(&self, token: u64) {
        let (mut closed, link);
        {
            let mut out = self.out.lock();
            let Some(o) = out.get_mut(&token) else { return };
            link = o.link.upgrade();
            closed = match read_some(o.conn.stream.as_raw_fd(), &mut [0u8; 512], &mut o.buf, 4096) {
                Ok(true) => Some("the peer closed the connection (process exited or agent destroyed)".to_owned()),
                Ok(false) if o.buf.len() > 4096 => {
                    Some("peer sent unexpected data on the control connection".to_owned())
                }
                Ok(false) => None,
                Err(e) => Some(format!("control connection failed: {e}")),
            };
            if let Some(l) = &link {
                l.touch();
            }
            let mut at = 0;
            while closed.is_none() {
                match wire::parse_ctrl(&o.buf[at..], 0) {
                    Ok(Some((CtrlMsg::Pong, n))) => at += n,
                    Ok(None) => break,
                    _ => closed = Some("peer broke the control protocol".to_owned()),
                }
            }
            o.buf.drain(..at.min(o.buf.len()));
        }
        if let Some(why) = closed {
            let retired = self.out.lock().get(&token).is_some_and(|o| o.conn.retired.load(Ordering::Acquire));
            self.remove_out(token);
            // Retired: the target read what we left and closed: nothing is wrong with the peer.
            if let Some(l) = link.filter(|_| !retired) {
                l.kill(why);
            }
        }
    }
}

/// Read what the non-blocking socket `fd` has onto `buf`, through `chunk`, until it would block or `buf` holds
/// more than `limit` bytes. Ok(true): the peer closed.
fn read_some(fd: i32, chunk: &mut [u8], buf: &mut Vec<u8>, limit: usize) -> io::Result<bool> {
    loop {
        match net::recv_now(fd, chunk) {
            Ok(0) => return Ok(true),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
            Err(e) => return Err(e),
        }
        if buf.len() > limit {
            return Ok(false);
        }
    }
}

/// Send a PING unless a notification is being written (that write is progress too).
fn ping(c: &CtrlConn) {
    let Some(_g) = c.w.try_lock() else { return };
    let head = wire::encode_ctrl_head(wire::CTRL_PING, 0);
    // A frame must never be left half written: finish a partial one (a five-byte send is only ever split
    // when the send buffer is full, and then the socket's send timeout bounds this).
    if let Some(n) = net::send_now(c.stream.as_raw_fd(), &head).ok().filter(|&n| n > 0 && n < head.len()) {
        let _ = net::send_all(&c.stream, &head[n..], &net::Impatient);
    }
}

/// The progress thread's own TCP state: the listener and inbound connections.
pub struct TcpProgress {
    pub shared: Arc<TcpShared>,
    listener: TcpListener,
    queue: Arc<NotifQueue>,
    inbound: HashMap<u64, In>,
    next_in: u64,
    /// Authenticated control connections not being read (queue full or budget spent), oldest first: they
    /// resume in this order, and a newer one waits while an older one does, so a sender's notifications
    /// stay in order across its connections.
    paused: std::collections::BTreeSet<u64>,
    /// A connection closed or a frame completed while some were paused for the budget: try them again.
    freed: bool,
}

struct In {
    stream: TcpStream,
    /// Where it came from (handshake slots are shared out per source address).
    src: IpAddr,
    /// Accept order, for eviction of the oldest.
    seq: u64,
    /// The challenge this connection must answer.
    nonce: [u8; 16],
    buf: Vec<u8>,
    /// None until authenticated: then the sender's agent name.
    name: Option<String>,
    deadline: u64,
    /// Bytes reserved against `CTRL_BUDGET` for the frame being received (0: none reserved).
    admitted: usize,
    /// While paused: when to send the next unsolicited PONG, so the sender's heartbeats see us alive.
    keep_at: u64,
    /// When bytes last arrived: a connection holding a reservation (`admitted`) that sends nothing for
    /// `TcpOpts::stall` is closed, so a stalled sender cannot keep the budget from everyone else.
    last_rx: u64,
}

impl In {
    /// What this connection holds against `CTRL_BUDGET`.
    fn held(&self) -> usize {
        self.buf.len().max(self.admitted)
    }
}

/// This side's tokens in the progress thread's reactor, by their own number: the listener, then inbound and
/// outbound connections, 2^32 each.
const LISTEN: u64 = 0;
const IN: u64 = 1 << 32;
const OUT: u64 = 2 << 32;

impl TcpProgress {
    /// Bind the listener and register it with the progress thread's reactor, under tokens of its own.
    pub fn new(
        setup: TcpSetup,
        incarnation: u128,
        queue: Arc<NotifQueue>,
        reactor: Arc<Reactor>,
    ) -> Result<TcpProgress> {
        let TcpSetup { bind, opts, secret, regions } = setup;
        regions.set_bound(opts.timeout);
        let listener = TcpListener::bind(bind)
            .map_err(|e| Error::os(Status::Backend, format!("binding the TCP listener on {bind}"), e))?;
        listener.set_nonblocking(true).map_err(|e| Error::os(Status::Backend, "TCP listener", e))?;
        // std listens with a backlog of 128; a target that many initiators dial at once (64 peers × their data
        // connections) would drop SYNs, each costing its sender a one-second retransmission. The kernel caps
        // this at net.core.somaxconn.
        // SAFETY: listen(2) on a socket we own, already listening (this only changes its backlog).
        unsafe { libc::listen(listener.as_raw_fd(), 4096) };
        let local = listener.local_addr().map_err(|e| Error::os(Status::Backend, "TCP listener address", e))?;
        let tokens = reactor.tokens();
        reactor.add_input(listener.as_raw_fd(), tokens.token(LISTEN))?;
        let shared = Arc::new(TcpShared {
            incarnation,
            secret,
            opts,
            serve: Arc::new(Serving::new(regions, opts.stall())),
            port: local.port(),
            addrs: advertised(local),
            reactor,
            tokens,
            out: Mutex::new(HashMap::new()),
            next_out: AtomicU64::new(0),
            paused: AtomicBool::new(false),
            resume: AtomicBool::new(false),
            sides: Mutex::default(),
        });
        Ok(TcpProgress {
            shared,
            listener,
            queue,
            inbound: HashMap::new(),
            next_in: 0,
            paused: Default::default(),
            freed: false,
        })
    }

    /// One of this side's tokens fired (`TcpShared::owns`).
    pub fn on_event(&mut self, token: u64) {
        match Tokens::index(token) {
            LISTEN => self.accept(),
            n if n >= OUT => self.shared.on_out(token),
            n if n >= IN => self.on_in(token),
            _ => {}
        }
    }

    /// Heartbeats, and closing connections that did not authenticate in time. Returns the epoll timeout.
    pub fn tick(&mut self) -> i32 {
        // First, so the timers below cover what it resumes.
        if !self.paused.is_empty() {
            let app = self.shared.resume.swap(false, Ordering::AcqRel);
            if app || std::mem::take(&mut self.freed) {
                self.resume();
            }
        }
        let now = monotonic_ns();
        let mut next = self.shared.tick(now);
        let expired: Vec<u64> =
            self.inbound.iter().filter(|(_, c)| c.name.is_none() && c.deadline <= now).map(|(t, _)| *t).collect();
        // Connections that reserved budget for a frame and then went silent (paused ones wait for us).
        let stall = self.shared.opts.stall().as_nanos() as u64;
        let reserving = |(t, c): (&u64, &In)| (c.admitted > 0 && !self.paused.contains(t)).then_some((*t, c.last_rx));
        let stalled: Vec<u64> =
            self.inbound.iter().filter_map(reserving).filter(|(_, rx)| rx + stall <= now).map(|(t, _)| t).collect();
        for t in expired.into_iter().chain(stalled) {
            self.drop_in(t);
        }
        // The next of those deadlines, and of the pending handshakes'.
        let reserving = |(t, c): (&u64, &In)| (c.admitted > 0 && !self.paused.contains(t)).then_some(c.last_rx + stall);
        let pending = self.inbound.values().filter(|c| c.name.is_none()).map(|c| c.deadline);
        let soonest = self.inbound.iter().filter_map(reserving).chain(pending).min();
        next = next.into_iter().chain(soonest.map(|at| at.saturating_sub(now))).min();
        // A paused connection's PINGs go unread: answer them ahead, so its sender's heartbeats see us
        // alive (one small write per heartbeat interval while paused; nothing while the queue has room).
        // At least every 100 ms: the sender's disconnect timeout may be shorter than ours.
        let every = self.shared.opts.live().ping_every.min(100_000_000);
        let mut broken = Vec::new();
        for &t in &self.paused {
            let Some(c) = self.inbound.get_mut(&t) else { continue };
            if c.keep_at <= now {
                let pong = wire::encode_ctrl_head(wire::CTRL_PONG, 0);
                // As for answered PINGs: the initiator always reads its control connection.
                if net::send_now(c.stream.as_raw_fd(), &pong).ok() != Some(pong.len()) {
                    broken.push(t);
                }
                c.keep_at = now + every;
            }
            next = next.into_iter().chain(Some(c.keep_at.saturating_sub(now))).min();
        }
        for t in broken {
            self.paused.remove(&t);
            self.drop_in(t);
        }
        self.shared.paused.store(!self.paused.is_empty(), Ordering::Release);
        next.map_or(-1, |ns| ns.div_ceil(1_000_000).min(i32::MAX as u64) as i32)
    }

    fn accept(&mut self) {
        // A bounded burst: connections arriving as fast as they are taken must not keep this thread from the
        // HELLOs already waiting (the listener is level-triggered, so the rest come on the next round).
        for _ in 0..ACCEPT_BURST {
            let (stream, from) = match self.listener.accept() {
                Ok(x) => x,
                Err(e) if crate::util::accept_again(&e, self.listener.as_raw_fd()) => continue,
                Err(_) => return,
            };
            if self.shared.serve.closed() || stream.set_nonblocking(true).is_err() {
                continue;
            }
            self.make_room(from.ip());
            // A fresh socket's send buffer is empty: the challenge always fits.
            let nonce = crate::util::random_u128().to_le_bytes();
            let challenge = wire::encode_challenge(&nonce);
            if net::send_now(stream.as_raw_fd(), &challenge).ok() != Some(challenge.len()) {
                continue;
            }
            let token = self.shared.tokens.token(IN + self.next_in);
            self.next_in = (self.next_in + 1) % (1 << 32);
            if self.shared.reactor.add_input(stream.as_raw_fd(), token).is_ok() {
                let c = In {
                    stream,
                    src: from.ip(),
                    seq: self.next_in,
                    nonce,
                    buf: Vec::new(),
                    name: None,
                    deadline: monotonic_ns() + self.shared.opts.handshake().as_nanos() as u64,
                    admitted: 0,
                    keep_at: 0,
                    last_rx: 0,
                };
                self.inbound.insert(token, c);
            }
        }
    }

    /// Before taking a pending connection from `src`: close the oldest pending one of `src` if it holds
    /// `PER_SOURCE`, else, when every slot is taken, the oldest of the source holding the most. The one chosen
    /// is read first: a real peer's HELLO that arrived while this thread was busy accepting authenticates it
    /// (no longer pending, so room is made all the same) instead of losing it to a stranger's churn.
    fn make_room(&mut self, src: IpAddr) {
        let mut per: HashMap<IpAddr, (usize, u64, u64)> = HashMap::new();
        let mut pending = 0;
        for (&t, c) in self.inbound.iter().filter(|(_, c)| c.name.is_none()) {
            pending += 1;
            let e = per.entry(c.src).or_insert((0, u64::MAX, t));
            e.0 += 1;
            if c.seq < e.1 {
                (e.1, e.2) = (c.seq, t);
            }
        }
        let victim = match per.get(&src) {
            Some(&(n, _, t)) if n >= PER_SOURCE => Some(t),
            _ if pending >= MAX_PENDING => per.values().max_by_key(|(n, seq, _)| (*n, u64::MAX - seq)).map(|e| e.2),
            _ => None,
        };
        if let Some(t) = victim {
            self.on_in(t);
            if self.inbound.get(&t).is_some_and(|c| c.name.is_none()) {
                self.drop_in(t);
            }
        }
    }

    fn drop_in(&mut self, token: u64) -> Option<In> {
        let c = self.inbound.remove(&token)?;
        self.paused.remove(&token);
        self.freed |= c.held() > 0;
        // `c` still owns it.
        self.shared.reactor.remove(c.stream.as_raw_fd());
        Some(c)
    }

    fn on_in(&mut self, token: u64) {
        let Some(c) = self.inbound.get_mut(&token) else { return };
        if let Some(name) = c.name.clone() {
            return self.on_ctrl(token, &name);
        }
        let closed =
            read_some(c.stream.as_raw_fd(), &mut [0u8; 64 * 1024], &mut c.buf, 64 + wire::MAX_NAME).unwrap_or(true);
        if !self.authenticate(token) || closed {
            self.drop_in(token);
        }
    }

    /// Read the HELLO. Returns false to close the connection (silently: a stranger learns nothing).
    fn authenticate(&mut self, token: u64) -> bool {
        let Some(c) = self.inbound.get_mut(&token) else { return false };
        let Ok(hello) = wire::parse_hello(&c.buf) else { return false };
        let Some((h, used)) = hello else { return true };
        // The initiator sends nothing more until it has our answer.
        if used != c.buf.len() {
            return false;
        }
        // Keyed by the cluster key too when one is set (see `crate::auth`).
        let ok = h.incarnation == self.shared.incarnation
            && crate::auth::hello_ok(self.shared.secret, h.kind, self.shared.incarnation, &c.nonce, &h.name, h.tag);
        if !ok {
            // Say so, so that a peer holding stale metadata knows at once that the incarnation it was
            // built for is not here (a stranger learns nothing it did not know).
            let _ = net::send_now(c.stream.as_raw_fd(), &[wire::NAK]);
            return false;
        }
        if self.shared.serve.closed() {
            return false;
        }
        if h.kind == wire::KIND_CTRL {
            let ctrl_in = self.inbound.values().filter(|c| c.name.is_some()).count();
            let Some(c) = self.inbound.get_mut(&token) else { return false };
            if ctrl_in >= MAX_CTRL_IN || net::send_now(c.stream.as_raw_fd(), &[wire::ACK]).ok() != Some(1) {
                return false;
            }
            net::tune(&c.stream, self.shared.opts.stall());
            c.buf.clear();
            c.name = Some(h.name);
            return true;
        }
        if wire::KIND_ROUTES.contains(&h.kind) {
            // Another route's exchange: refused without a taker (that route is off here).
            let side = self.shared.sides.lock().iter().find(|(k, _)| *k == h.kind).map(|(_, s)| s.clone());
            let Some(side) = side else { return false };
            let acked = |c: &In| net::send_now(c.stream.as_raw_fd(), &[wire::ACK]).ok() == Some(1);
            let Some(c) = self.drop_in(token).filter(acked) else { return false };
            let _ = c.stream.set_nonblocking(false);
            side(c.stream);
            return true;
        }
        // A data connection leaves the epoll set for its own thread.
        let Some(c) = self.drop_in(token) else { return false };
        self.shared.serve.hand(c.stream, c.src, Arc::from(h.name.as_str()));
        true
    }

    /// An authenticated inbound control connection is readable (or is being resumed): queue its
    /// notifications while the queue has room, read while the budget allows, else pause it (take it out of
    /// the epoll set: its sender's writes then block, and fail after a bound with a defined error).
    fn on_ctrl(&mut self, token: u64, name: &str) {
        // An older connection waits for room: this one waits behind it (see `paused`).
        if self.paused.first().is_some_and(|&t| t < token) {
            return self.pause(token, false);
        }
        let mut queued = self.queue.held();
        let others: usize = self.inbound.iter().filter(|(t, _)| **t != token).map(|(_, c)| c.held()).sum();
        let Some(c) = self.inbound.get_mut(&token) else { return };
        let mut chunk = [0u8; CTRL_CHUNK];
        loop {
            let had = c.admitted;
            if !ctrl_frames(c, name, &self.queue, &mut queued) {
                break;
            }
            self.freed |= had > 0 && c.admitted == 0;
            if self.queue.full(queued) {
                return self.pause(token, true);
            }
            // What reading on needs: the rest of an admitted frame, else a new frame's length (known once
            // its header is in) or one chunk.
            if c.admitted == 0 {
                let need = match c.buf.get(..4) {
                    Some(h) => 4 + u32::from_le_bytes([h[0], h[1], h[2], h[3]]) as usize,
                    None => CTRL_CHUNK,
                };
                if others + need.max(c.buf.len()) > CTRL_BUDGET {
                    return self.pause(token, false);
                }
                if c.buf.len() >= 4 {
                    c.admitted = need;
                    c.last_rx = monotonic_ns();
                }
            }
            match net::recv_now(c.stream.as_raw_fd(), &mut chunk) {
                Ok(n) if n > 0 => {
                    c.buf.extend_from_slice(&chunk[..n]);
                    c.last_rx = monotonic_ns();
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                _ => break,
            }
        }
        // Closed or broken: complete frames were queued above; a partial one (a sender that gave up) is dropped.
        self.drop_in(token);
    }

    /// Stop reading an authenticated control connection until `resume`. `queue_full`: it waits for the
    /// application to take notifications.
    fn pause(&mut self, token: u64, queue_full: bool) {
        let Some(c) = self.inbound.get_mut(&token) else { return };
        if self.paused.insert(token) {
            // `c` still owns it.
            self.shared.reactor.remove(c.stream.as_raw_fd());
            c.keep_at = 0;
        }
        self.shared.paused.store(true, Ordering::SeqCst);
        // The application may have taken the queue between our look at it and the flag (it then saw no
        // pause to end): look again now that the flag is up.
        if queue_full && !self.queue.full(self.queue.held()) {
            self.freed = true;
        }
    }

    /// Read paused connections again, oldest first, until one still finds no room.
    fn resume(&mut self) {
        while let Some(&t) = self.paused.first() {
            self.paused.remove(&t);
            let Some(c) = self.inbound.get_mut(&t) else { continue };
            let Some(name) = c.name.clone() else { continue };
            // Its sender was held back by us, not silent.
            c.last_rx = monotonic_ns();
            if self.shared.reactor.add_input(c.stream.as_raw_fd(), t).is_err() {
                self.drop_in(t);
                continue;
            }
            self.on_ctrl(t, &name);
            if self.paused.contains(&t) {
                break;
            }
        }
        self.shared.paused.store(!self.paused.is_empty(), Ordering::Release);
    }
}

/// Consume the complete frames at the front of `c.buf`: answer PINGs, queue notifications while the
/// queue has room (`queued` counts what is in it). False when the peer broke the protocol.
fn ctrl_frames(c: &mut In, name: &str, queue: &NotifQueue, queued: &mut (usize, usize)) -> bool {
    let mut at = 0;
    let ok = loop {
        let Ok(frame) = wire::parse_ctrl(&c.buf[at..], MAX_NOTIF) else { break false };
        let Some((msg, n)) = frame else { break true };
        let ok = match msg {
            CtrlMsg::Ping => {
                let pong = wire::encode_ctrl_head(wire::CTRL_PONG, 0);
                // The initiator reads its control connection all the time, so this fits; if it does not, the
                // initiator is not reading and will time out anyway.
                net::send_now(c.stream.as_raw_fd(), &pong).ok() == Some(pong.len())
            }
            CtrlMsg::Notif(_) if queue.full(*queued) => break true,
            CtrlMsg::Notif(m) => {
                queue.lock().push((name.to_owned(), m.to_vec()));
                queued.0 += 1;
                queued.1 += name.len() + m.len();
                true
            }
            CtrlMsg::Pong => false,
        };
        at += n;
        c.admitted = 0;
        if !ok {
            break false;
        }
    };
    c.buf.drain(..at);
    ok
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::FromRawFd;

    /// The progress thread's TCP side, driven by hand (no thread): `accept` and `on_in` run when the test says.
    fn progress(inc: u128, secret: u128) -> TcpProgress {
        let setup = TcpSetup {
            bind: "127.0.0.1:0".parse().unwrap(),
            opts: TcpOpts { conns: 1, timeout: Duration::from_secs(1) },
            secret,
            regions: Arc::default(),
        };
        TcpProgress::new(setup, inc, Arc::default(), Arc::new(Reactor::new().unwrap())).unwrap()
    }

    /// A connection to `to` from the loopback source address `src`.
    fn connect_from(src: std::net::Ipv4Addr, to: SocketAddr) -> TcpStream {
        let SocketAddr::V4(to) = to else { panic!("IPv4 only") };
        let sin = |ip: std::net::Ipv4Addr, port: u16| libc::sockaddr_in {
            sin_family: libc::AF_INET as u16,
            sin_port: port.to_be(),
            sin_addr: libc::in_addr { s_addr: u32::from(ip).to_be() },
            sin_zero: [0; 8],
        };
        let len = std::mem::size_of::<libc::sockaddr_in>() as u32;
        let (a, b) = (sin(src, 0), sin(*to.ip(), to.port()));
        // SAFETY: plain socket calls on a descriptor we own; the address structs are fully initialised.
        unsafe {
            let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
            assert!(fd >= 0);
            let s = TcpStream::from_raw_fd(fd);
            assert_eq!(libc::bind(fd, (&a as *const libc::sockaddr_in).cast(), len), 0);
            assert_eq!(libc::connect(fd, (&b as *const libc::sockaddr_in).cast(), len), 0);
            s
        }
    }

    /// A connection to `p`'s listener that has sent its HELLO of `kind` as `name`, proving `secret`.
    fn say_hello(p: &mut TcpProgress, secret: u128, kind: u8, name: &str) -> TcpStream {
        use std::io::{Read, Write};
        let inc = p.shared.incarnation;
        let mut s = TcpStream::connect(p.listener.local_addr().unwrap()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        p.accept();
        let mut c = [0u8; wire::CHALLENGE_BYTES];
        s.read_exact(&mut c).unwrap();
        let nonce = wire::parse_challenge(&c).unwrap();
        let tag = wire::hello_tag(secret, kind, inc, &nonce, name);
        s.write_all(&wire::encode_hello(&wire::Hello { kind, incarnation: inc, tag, name: name.into() })).unwrap();
        s
    }

    /// A real peer's HELLO arrives while the progress thread is busy accepting a stranger's churn from many
    /// source addresses (one pending connection each, every slot full): the eviction that would take the peer's
    /// connection, the oldest, reads it first and authenticates it. It was closed unread.
    #[test]
    fn a_waiting_hello_is_read_before_its_connection_is_evicted() {
        use std::io::Read;
        let (inc, secret) = (0x77u128, 0x1234u128);
        let mut p = progress(inc, secret);
        let to = p.listener.local_addr().unwrap();
        let mut real = say_hello(&mut p, secret, wire::KIND_CTRL, "real");
        // Strangers, one connection per source address, taken in bursts as the listener's backlog allows.
        let mut strangers = Vec::new();
        for i in 0..MAX_PENDING as u32 + 8 {
            strangers.push(connect_from(std::net::Ipv4Addr::new(127, 1, (i / 250) as u8, (i % 250) as u8 + 1), to));
            if strangers.len() % 32 == 0 {
                p.accept();
            }
        }
        p.accept();
        let mut ack = [0u8; 1];
        real.read_exact(&mut ack).expect("the real peer's connection was closed unread");
        assert_eq!(ack[0], wire::ACK);
        let pending = p.inbound.values().filter(|c| c.name.is_none()).count();
        assert!(pending <= MAX_PENDING, "{pending} pending");
    }

    /// Another route's connection kind (`wire::KIND_ROUTES`) goes, once its HELLO proves the secret, to the route
    /// that took that kind, after the ACK; a kind of that range that no route took is closed without an answer.
    #[test]
    fn a_route_kind_goes_to_its_taker_and_one_nobody_took_is_closed() {
        use std::io::Read;
        let secret = 0x4321u128;
        let mut p = progress(0x78, secret);
        let (tx, rx) = std::sync::mpsc::channel();
        p.shared.set_side(4, Box::new(move |s| tx.send(s).unwrap()));
        for (kind, taken) in [(4u8, true), (5, false)] {
            let mut s = say_hello(&mut p, secret, kind, "peer");
            // Read by the listener once it is in (loopback: at once, or within a few tries).
            for _ in 0..5000 {
                let Some(&t) = p.inbound.keys().next() else { break };
                p.on_in(t);
                std::thread::sleep(Duration::from_micros(200));
            }
            assert!(p.inbound.is_empty(), "kind {kind}: the connection is still the listener's");
            let mut ack = [0u8; 1];
            let n = s.read(&mut ack).unwrap_or(0);
            if taken {
                assert_eq!((n, ack[0]), (1, wire::ACK), "kind {kind}: acknowledged");
                assert!(rx.try_recv().is_ok(), "kind {kind}: handed to its route");
            } else {
                assert_eq!(n, 0, "kind {kind}: closed without an answer");
                assert!(rx.try_recv().is_err(), "kind {kind}: handed to nobody");
            }
        }
        // Outside the range, a kind is not a route's to take.
        p.shared.set_side(wire::KIND_DATA, Box::new(|_| panic!("taken")));
        assert!(p.shared.sides.lock().iter().all(|(k, _)| *k == 4));
    }

    #[test]
    fn bind_addresses() {
        assert_eq!(parse_bind("").unwrap(), "0.0.0.0:0".parse().unwrap());
        assert_eq!(parse_bind("127.0.0.1").unwrap(), "127.0.0.1:0".parse().unwrap());
        assert_eq!(parse_bind("192.0.2.1:5000").unwrap(), "192.0.2.1:5000".parse().unwrap());
        assert_eq!(parse_bind("[::1]:7").unwrap(), "[::1]:7".parse().unwrap());
        assert_eq!(parse_bind("::1").unwrap(), "[::1]:0".parse().unwrap());
        assert!(parse_bind("eth0").is_err());
    }

    #[test]
    fn advertised_addresses() {
        let a: SocketAddr = "192.0.2.7:99".parse().unwrap();
        assert_eq!(advertised(a), vec![a]);
        let any = advertised("0.0.0.0:1234".parse().unwrap());
        assert!(!any.is_empty());
        assert!(any.iter().all(|a| a.port() == 1234 && a.is_ipv4()));
        // Loopback comes last.
        let first_lo = any.iter().position(|a| a.ip().is_loopback()).unwrap_or(any.len());
        assert!(any[first_lo..].iter().all(|a| a.ip().is_loopback()));
    }
}
