//! Peer-to-peer metadata exchange: the listener (when the agent is configured with one) and outbound
//! connections to other agents' listeners, all served by one thread per agent that sleeps in `epoll_wait`.
//!
//! The caller's thread only queues a frame and wakes the thread; connecting, writing, reading replies and
//! acting on received frames happen here, and failures are logged, as NIXL does. Outbound connections are
//! cached per address and reused; a reply to a fetch comes back on the fetch's own connection, so fetching
//! needs no listener on the fetching side. Nothing runs on a timer except the connect timeout of a
//! connection being opened.
//!
//! Not here: the frame format (see `wire`), what LOAD/INVL do to the agent (see `Host`).

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::Mutex;

use super::wire::{self, Msg};
use super::{log, Host};
use crate::auth::ClusterKey;
use crate::os::Reactor;
use crate::status::{Error, Result, Status};
use crate::util::monotonic_ns;
use crate::util::{recv_now, send_now};

/// NIXL's connect timeout for metadata peers.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// How long a closing agent keeps trying to deliver frames it has already accepted.
const DRAIN: Duration = Duration::from_secs(1);
/// Inbound connections in all, and from one IP address; when full, the least recently active one goes.
const MAX_INBOUND: usize = 256;
const MAX_PER_SOURCE: usize = 64;
/// Unsent replies beyond which a connection's requests are not read (back-pressure).
const WBUF_CAP: usize = 256 << 10;
/// Every connection may buffer this much; more (a large LOAD) only while all inbound buffers together
/// hold less than `READ_BUDGET`.
const SMALL: usize = 64 << 10;
const READ_BUDGET: usize = 64 << 20;
/// An inbound connection is closed after this long without a byte, or when a frame takes longer than
/// `FRAME_DEADLINE` to arrive.
const IDLE: Duration = Duration::from_secs(60);
const FRAME_DEADLINE: Duration = Duration::from_secs(10);

/// The listener's token in the loop's reactor; connections count from 2.
const TOKEN_LISTEN: u64 = 1;

/// What other threads hand the loop, and the loop's reactor (which they wake).
struct Queue {
    cmds: Mutex<VecDeque<(SocketAddr, Vec<u8>)>>,
    reactor: Reactor,
    stop: AtomicBool,
}

impl Queue {
    fn wake(&self) {
        self.reactor.wake();
    }
}

pub(crate) struct P2p {
    port: Option<u16>,
    q: Arc<Queue>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl P2p {
    /// Start the thread; with `listen`, bind `0.0.0.0:port` first (0: any free port), failing if it cannot.
    pub fn start(host: Arc<dyn Host>, listen: Option<u16>) -> Result<P2p> {
        crate::util::reserve_fd_for_shedding();
        let listener = match listen {
            None => None,
            Some(port) => {
                let l = TcpListener::bind(("0.0.0.0", port))
                    .map_err(|e| Error::os(Status::Backend, format!("metadata listener cannot bind port {port}"), e))?;
                l.set_nonblocking(true).map_err(|e| Error::os(Status::Backend, "metadata listener", e))?;
                Some(l)
            }
        };
        let port = match &listener {
            Some(l) => {
                Some(l.local_addr().map_err(|e| Error::os(Status::Backend, "metadata listener address", e))?.port())
            }
            None => None,
        };
        let reactor = Reactor::new()?;
        if let Some(l) = &listener {
            reactor.add(l.as_raw_fd(), TOKEN_LISTEN, libc::EPOLLIN as u32)?;
        }
        let q = Arc::new(Queue { cmds: Mutex::new(VecDeque::new()), reactor, stop: AtomicBool::new(false) });
        let mut lp = Loop {
            host,
            q: q.clone(),
            listener,
            conns: HashMap::new(),
            cache: HashMap::new(),
            next: 2,
            key: crate::auth::cluster(),
        };
        let thread = std::thread::Builder::new()
            .name("gixl-md-p2p".into())
            .spawn(move || lp.run())
            .map_err(|e| Error::os(Status::Backend, "spawning the metadata thread", e))?;
        Ok(P2p { port, q, thread: Mutex::new(Some(thread)) })
    }

    pub fn port(&self) -> Option<u16> {
        self.port
    }

    /// Queue `frame` for `to`; returns at once.
    pub fn send(&self, to: SocketAddr, frame: Vec<u8>) {
        self.q.cmds.lock().push_back((to, frame));
        self.q.wake();
    }

    /// Deliver what is queued (for up to a second), then stop the thread.
    pub fn shutdown(&self) {
        self.q.stop.store(true, Ordering::Release);
        self.q.wake();
        if let Some(t) = self.thread.lock().take() {
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

impl Drop for P2p {
    fn drop(&mut self) {
        self.shutdown();
    }
}

struct Conn {
    stream: TcpStream,
    peer: SocketAddr,
    outbound: bool,
    /// Some(deadline) while the connect (and, with a cluster key, the listener's challenge) is awaited.
    connecting: Option<u64>,
    rbuf: Vec<u8>,
    wbuf: Vec<u8>,
    wpos: usize,
    /// Outbound: frames not yet signed (with a key, they wait for the listener's challenge).
    outq: VecDeque<Vec<u8>>,
    /// Inbound: the nonce we challenged with. Outbound: the listener's nonce, once received.
    nonce: Option<[u8; wire::NONCE]>,
    /// Next request sequence number (sent, or expected).
    seq: u64,
    /// Last time bytes arrived or a request was accepted (monotonic ns).
    last: u64,
    /// When the partial frame at the front of `rbuf` started arriving.
    frame_since: Option<u64>,
    /// Refused: send what is queued (the ERR), then close; read nothing more.
    closing: bool,
    /// Outbound: the agents asked for (SEND) and not answered yet; a LOAD that answers none of them is
    /// refused (a listener answers what it was asked, once).
    asked: VecDeque<String>,
    /// The epoll events registered now.
    interest: u32,
}

impl Conn {
    fn pending(&self) -> bool {
        self.wpos < self.wbuf.len()
    }
    fn unsent(&self) -> usize {
        self.wbuf.len() - self.wpos
    }
}

struct Loop {
    host: Arc<dyn Host>,
    q: Arc<Queue>,
    listener: Option<TcpListener>,
    conns: HashMap<u64, Conn>,
    cache: HashMap<SocketAddr, u64>,
    next: u64,
    key: Option<&'static ClusterKey>,
}

impl Loop {
    fn run(&mut self) {
        let mut ready = Vec::new();
        let mut drain_until: Option<u64> = None;
        loop {
            let now = monotonic_ns();
            if self.q.stop.load(Ordering::Acquire) {
                let until = *drain_until.get_or_insert(now + DRAIN.as_nanos() as u64);
                self.take_cmds();
                if now >= until || !self.conns.values().any(|c| c.pending() || !c.outq.is_empty()) {
                    return;
                }
            }
            self.expire(now);
            let mut next = self.conns.values().filter_map(deadline).min();
            if let Some(d) = drain_until {
                next = Some(next.map_or(d, |n| n.min(d)));
            }
            let timeout = next.map_or(-1, |d| d.saturating_sub(now).div_ceil(1_000_000).min(i32::MAX as u64) as i32);
            if !self.q.reactor.wait(timeout, &mut ready) {
                return;
            }
            for &(token, flags) in &ready {
                match token {
                    Reactor::WAKE => self.take_cmds(),
                    TOKEN_LISTEN => self.accept(),
                    t => self.on_conn(t, flags),
                }
            }
            // Buffer space freed by this round may let paused connections read again.
            let tokens: Vec<u64> = self.conns.keys().copied().collect();
            for t in tokens {
                self.interest(t);
            }
        }
    }

    fn take_cmds(&mut self) {
        let cmds: Vec<_> = self.q.cmds.lock().drain(..).collect();
        for (to, frame) in cmds {
            self.enqueue(to, frame);
        }
    }

    fn expire(&mut self, now: u64) {
        let late: Vec<u64> =
            self.conns.iter().filter(|(_, c)| deadline(c).is_some_and(|d| d <= now)).map(|(t, _)| *t).collect();
        for t in late {
            if let Some(c) = self.conns.get(&t) {
                if c.outbound && c.connecting.is_some() && self.key.is_some() && c.nonce.is_none() {
                    log!(
                        "metadata peer {} sent no cluster-key challenge within {CONNECT_TIMEOUT:?}: it runs without \
                         GIXL_CLUSTER_KEY (or is not a gixl listener); nothing sent",
                        c.peer
                    );
                } else if c.connecting.is_some() {
                    log!("could not connect to metadata peer {} within {CONNECT_TIMEOUT:?}", c.peer);
                } else if c.outbound && !c.asked.is_empty() {
                    log!(
                        "metadata peer {} did not answer the request for agent '{}' within {FRAME_DEADLINE:?}",
                        c.peer,
                        c.asked[0]
                    );
                }
            }
            self.close(t);
        }
    }

    fn enqueue(&mut self, to: SocketAddr, frame: Vec<u8>) {
        let token = match self.cache.get(&to) {
            Some(t) if self.conns.contains_key(t) => *t,
            _ => match connect_nonblocking(to) {
                Ok(stream) => {
                    let t = self.next;
                    self.next += 1;
                    let now = monotonic_ns();
                    let mut c = conn(stream, to, true, now);
                    c.connecting = Some(now + CONNECT_TIMEOUT.as_nanos() as u64);
                    let flags = (libc::EPOLLIN | libc::EPOLLOUT | libc::EPOLLRDHUP) as u32;
                    if let Err(e) = self.q.reactor.add(c.stream.as_raw_fd(), t, flags) {
                        log!("metadata peer {to}: {e}");
                        return;
                    }
                    c.interest = flags;
                    self.conns.insert(t, c);
                    self.cache.insert(to, t);
                    t
                }
                Err(e) => {
                    log!("could not connect to metadata peer {to}: {e}");
                    return;
                }
            },
        };
        if let Some(c) = self.conns.get_mut(&token) {
            if let Ok(Some((Msg::Send(name), _))) = wire::parse(&frame) {
                if c.asked.is_empty() {
                    // The reply's deadline runs from the oldest request unanswered.
                    c.last = monotonic_ns();
                }
                c.asked.push_back(name.to_owned());
            }
            c.outq.push_back(frame);
        }
        self.pump(token);
        self.flush(token);
    }

    /// Move queued requests of an outbound connection into its write buffer, signed when there is a key
    /// (only once the listener's challenge is in).
    fn pump(&mut self, token: u64) {
        let key = self.key;
        let Some(c) = self.conns.get_mut(&token) else { return };
        while let Some(f) = c.outq.front() {
            let f = match (key, c.nonce) {
                (None, _) => f.clone(),
                (Some(k), Some(n)) => wire::sign(f, k, &n, c.seq),
                (Some(_), None) => return,
            };
            c.outq.pop_front();
            c.seq += 1;
            c.wbuf.extend_from_slice(&f);
        }
        if key.is_some() && c.connecting.is_some() && c.stream.take_error().ok().flatten().is_none() {
            // Connected and challenged: the connect deadline is over.
            if c.nonce.is_some() {
                c.connecting = None;
            }
        }
    }

    fn accept(&mut self) {
        let Some(l) = &self.listener else { return };
        let mut fresh = Vec::new();
        loop {
            match l.accept() {
                Ok(x) => fresh.push(x),
                Err(e) if crate::util::accept_again(&e, l.as_raw_fd()) => continue,
                Err(_) => break,
            }
            if fresh.len() >= 64 {
                break;
            }
        }
        for (stream, peer) in fresh {
            if self.q.stop.load(Ordering::Acquire) || stream.set_nonblocking(true).is_err() {
                continue;
            }
            // Full (in all, or from this address): the least recently active connection with no reply
            // pending makes room, so connections left idle cannot lock real peers out.
            let inbound: Vec<(u64, u64, bool)> = self
                .conns
                .iter()
                .filter(|(_, c)| !c.outbound)
                .map(|(t, c)| (*t, c.last, c.peer.ip() == peer.ip()))
                .collect();
            let same = inbound.iter().filter(|x| x.2).count();
            if inbound.len() >= MAX_INBOUND || same >= MAX_PER_SOURCE {
                let only_same = same >= MAX_PER_SOURCE;
                let victim = inbound
                    .iter()
                    .filter(|x| !only_same || x.2)
                    .filter(|x| self.conns.get(&x.0).is_some_and(|c| !c.pending()))
                    .min_by_key(|x| x.1)
                    .map(|x| x.0);
                match victim {
                    Some(v) => self.close(v),
                    None => continue,
                }
            }
            let t = self.next;
            self.next += 1;
            let mut c = conn(stream, peer, false, monotonic_ns());
            if self.key.is_some() {
                let n = crate::util::random_u128().to_le_bytes();
                c.wbuf = wire::encode(&Msg::Chal(&n));
                c.nonce = Some(n);
            }
            let flags = (libc::EPOLLIN | libc::EPOLLRDHUP) as u32;
            if self.q.reactor.add(c.stream.as_raw_fd(), t, flags).is_ok() {
                c.interest = flags;
                self.conns.insert(t, c);
                self.flush(t);
            }
        }
    }

    fn on_conn(&mut self, token: u64, flags: u32) {
        let Some(c) = self.conns.get_mut(&token) else { return };
        if c.connecting.is_some()
            && c.nonce.is_none()
            && flags & (libc::EPOLLOUT | libc::EPOLLERR | libc::EPOLLHUP) as u32 != 0
        {
            match c.stream.take_error() {
                Ok(None) if self.key.is_none() => c.connecting = None,
                // With a key, the deadline runs on until the challenge arrives.
                Ok(None) => {}
                Ok(Some(e)) | Err(e) => {
                    log!("could not connect to metadata peer {}: {e}", c.peer);
                    self.close(token);
                    return;
                }
            }
        }
        if flags & (libc::EPOLLERR | libc::EPOLLHUP) as u32 != 0 && c.closing {
            self.close(token);
            return;
        }
        let mut closed = false;
        if flags & (libc::EPOLLIN | libc::EPOLLRDHUP | libc::EPOLLHUP | libc::EPOLLERR) as u32 != 0 && !c.closing {
            let mut chunk = [0u8; 64 * 1024];
            loop {
                let room = room(c, self.key.is_some());
                if room == 0 {
                    break;
                }
                let want = room.min(chunk.len());
                match recv_now(c.stream.as_raw_fd(), &mut chunk[..want]) {
                    Ok(0) => {
                        closed = true;
                        break;
                    }
                    Ok(n) => {
                        c.rbuf.extend_from_slice(&chunk[..n]);
                        c.last = monotonic_ns();
                        if n < want {
                            break;
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(_) => {
                        closed = true;
                        break;
                    }
                }
            }
        }
        if !self.frames(token) || closed {
            // Deliver nothing more on a connection the peer closed; one that broke the protocol gets its ERR.
            match self.conns.get(&token) {
                Some(c) if c.closing && !closed => {}
                _ => {
                    self.close(token);
                    return;
                }
            }
        }
        self.pump(token);
        self.flush(token);
    }

    /// Act on every complete frame received on `token` while its unsent replies stay under `WBUF_CAP`
    /// (back-pressure: a peer that does not read its replies stops being read). False when the peer broke
    /// the protocol (the connection then closes, after an ERR where one explains it).
    fn frames(&mut self, token: u64) -> bool {
        let key = self.key;
        let Some(c) = self.conns.get_mut(&token) else { return false };
        let mut at = 0;
        let mut refuse: Option<String> = None;
        let ok = loop {
            if c.closing || c.unsent() > WBUF_CAP {
                break true;
            }
            let m = match wire::parse(&c.rbuf[at..]) {
                Ok(Some((m, n))) => {
                    at += n;
                    m
                }
                Ok(None) => break true,
                Err(e) => {
                    log!("metadata peer {} sent garbage ({e}); closing the connection", c.peer);
                    refuse = Some(format!("refused: {e}"));
                    break false;
                }
            };
            // What each side may send: a listener takes requests, a requester takes replies.
            let m = match (c.outbound, m, key, c.nonce) {
                (true, Msg::Chal(n), Some(_), None) => {
                    c.nonce = Some(*n);
                    continue;
                }
                (true, Msg::Chal(_), None, _) => {
                    log!(
                        "metadata peer {} requires a cluster key, and this agent has none (set GIXL_CLUSTER_KEY)",
                        c.peer
                    );
                    break false;
                }
                // A reply: metadata of an agent asked for on this connection (once each), or an error.
                (true, Msg::Load(blob), _, _) => {
                    let name = match crate::md::AgentMd::open(blob, crate::auth::cluster()) {
                        Ok(md) => md.name,
                        Err(e) => {
                            log!("metadata peer {} answered with metadata that does not open ({e})", c.peer);
                            break false;
                        }
                    };
                    let Some(i) = c.asked.iter().position(|n| n.is_empty() || *n == name) else {
                        log!(
                            "metadata peer {} answered with agent '{name}', which this connection did not ask for; \
                             nothing loaded, connection closed",
                            c.peer
                        );
                        break false;
                    };
                    c.asked.remove(i);
                    Msg::Load(blob)
                }
                (true, m @ Msg::Err(_), _, _) => {
                    c.asked.pop_front();
                    m
                }
                (false, Msg::Signed(kind, body, t), Some(k), Some(n)) => {
                    match wire::verify(kind, body, t, k, &n, c.seq) {
                        Ok(m) => {
                            c.seq += 1;
                            m
                        }
                        Err(e) => {
                            log!("metadata peer {}: {e}; closing the connection", c.peer);
                            refuse = Some(format!("refused: {e}"));
                            break false;
                        }
                    }
                }
                (false, Msg::Signed(..), None, _) => {
                    refuse = Some("refused: this agent has no cluster key, the request is signed with one".into());
                    break false;
                }
                (false, Msg::Load(_) | Msg::Send(_) | Msg::Invl(_), Some(_), _) => {
                    refuse = Some(
                        "refused: this agent requires the cluster key (GIXL_CLUSTER_KEY); the request is not signed"
                            .into(),
                    );
                    break false;
                }
                (false, m @ (Msg::Load(_) | Msg::Send(_) | Msg::Invl(_) | Msg::Err(_)), _, _) => m,
                (_, m, _, _) => {
                    log!("metadata peer {} sent an unexpected {m:?}; closing the connection", short(&m));
                    break false;
                }
            };
            c.last = monotonic_ns();
            if let Some(r) = handle(&*self.host, c.peer, m, !c.outbound) {
                c.wbuf.extend_from_slice(&r);
            }
        };
        c.rbuf.drain(..at);
        if !c.rbuf.is_empty() {
            c.frame_since.get_or_insert(monotonic_ns());
        } else {
            c.frame_since = None;
        }
        if c.rbuf.capacity() > 2 * c.rbuf.len() + 64 * 1024 {
            c.rbuf.shrink_to(c.rbuf.len() + 64 * 1024);
        }
        if let Some(why) = refuse {
            if !c.outbound {
                c.wbuf.extend_from_slice(&wire::encode(&Msg::Err(&why)));
                c.closing = true;
                c.rbuf.clear();
            }
        }
        ok
    }

    fn flush(&mut self, token: u64) {
        loop {
            let Some(c) = self.conns.get_mut(&token) else { return };
            if c.connecting.is_some() && c.nonce.is_none() {
                return;
            }
            while c.pending() {
                match send_now(c.stream.as_raw_fd(), &c.wbuf[c.wpos..]) {
                    Ok(n) => c.wpos += n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) => {
                        if !c.closing {
                            log!("sending to metadata peer {}: {e}", c.peer);
                        }
                        self.close(token);
                        return;
                    }
                }
            }
            if c.pending() {
                break;
            }
            c.wbuf.clear();
            c.wpos = 0;
            if c.closing {
                self.close(token);
                return;
            }
            if c.rbuf.is_empty() {
                break;
            }
            // Requests held back while replies were unread: act on them now, and send what they produce.
            let ok = self.frames(token);
            let Some(c) = self.conns.get(&token) else { return };
            if !ok && !c.closing {
                self.close(token);
                return;
            }
            if !c.pending() {
                break;
            }
        }
        self.interest(token);
    }

    /// Register the events `token` should wake for now: input only while it may read, output only while
    /// replies wait.
    fn interest(&mut self, token: u64) {
        let budget_used: usize = self.conns.values().filter(|c| !c.outbound).map(|c| c.rbuf.len()).sum();
        let key = self.key.is_some();
        let Some(c) = self.conns.get_mut(&token) else { return };
        let mut want = 0u32;
        let reading = !c.closing
            && c.unsent() <= WBUF_CAP
            && (c.outbound || c.rbuf.len() < SMALL || budget_used < READ_BUDGET)
            && room(c, key) > 0;
        if reading {
            want |= (libc::EPOLLIN | libc::EPOLLRDHUP) as u32;
        }
        if c.pending() || (c.connecting.is_some() && c.nonce.is_none() && c.outbound && !key) {
            want |= libc::EPOLLOUT as u32;
        }
        if want != c.interest && self.q.reactor.modify(c.stream.as_raw_fd(), token, want).is_ok() {
            c.interest = want;
        }
    }

    fn close(&mut self, token: u64) {
        if let Some(c) = self.conns.remove(&token) {
            self.q.reactor.remove(c.stream.as_raw_fd());
            if c.outbound && self.cache.get(&c.peer) == Some(&token) {
                self.cache.remove(&c.peer);
            }
            if c.outbound && !c.outq.is_empty() {
                log!("{} request(s) to metadata peer {} not sent (connection closed)", c.outq.len(), c.peer);
            }
        }
    }
}

fn conn(stream: TcpStream, peer: SocketAddr, outbound: bool, now: u64) -> Conn {
    Conn {
        stream,
        peer,
        outbound,
        connecting: None,
        rbuf: Vec::new(),
        wbuf: Vec::new(),
        wpos: 0,
        outq: VecDeque::new(),
        nonce: None,
        seq: 0,
        last: now,
        frame_since: None,
        closing: false,
        interest: 0,
        asked: VecDeque::new(),
    }
}

/// When `c` must be closed unless something happens first.
fn deadline(c: &Conn) -> Option<u64> {
    if let Some(d) = c.connecting {
        return Some(d);
    }
    let frame = c.frame_since.map(|t| t + FRAME_DEADLINE.as_nanos() as u64);
    // Outbound: a listener that was asked for metadata answers within `FRAME_DEADLINE`; one that keeps the
    // connection open without a word is left after `IDLE`, as an idle inbound one is.
    let quiet = if c.outbound && !c.asked.is_empty() { FRAME_DEADLINE } else { IDLE };
    let idle = c.last + quiet.as_nanos() as u64;
    Some(frame.map_or(idle, |f| f.min(idle)))
}

/// How many more bytes `c` may read now: up to the end of the frame being received (its size checked from
/// the header), never more than one frame ahead.
fn room(c: &Conn, _keyed: bool) -> usize {
    if c.closing {
        return 0;
    }
    let need = match wire::announced(&c.rbuf) {
        Some(len) => wire::HEADER + len,
        None => wire::HEADER,
    };
    need.saturating_sub(c.rbuf.len()).max(if c.rbuf.len() < SMALL { SMALL - c.rbuf.len() } else { 0 })
}

fn short(m: &Msg<'_>) -> &'static str {
    match m {
        Msg::Load(_) => "LOAD",
        Msg::Send(_) => "SEND",
        Msg::Invl(_) => "INVL",
        Msg::Err(_) => "ERR",
        Msg::Chal(_) => "CHAL",
        Msg::Signed(..) => "signed request",
    }
}

/// Act on one frame; returns the reply to send back, if any.
/// `pushed`: the frame came to the listener unasked (a LOAD there is a peer's `send_local_md`), not as
/// the reply to our own request.
fn handle(host: &dyn Host, peer: SocketAddr, m: Msg<'_>, pushed: bool) -> Option<Vec<u8>> {
    match m {
        Msg::Load(blob) => {
            let r = if pushed { host.load_pushed(blob) } else { host.load(blob) };
            if let Err(e) = r {
                log!("loading metadata received from {peer}: {e}");
            }
            None
        }
        Msg::Send(name) => {
            let me = host.name();
            if !name.is_empty() && name != me {
                return Some(wire::encode(&Msg::Err(&format!("asked for agent '{name}', but this is agent '{me}'"))));
            }
            Some(match host.full_md() {
                Ok(md) => wire::encode(&Msg::Load(&md)),
                Err(e) => wire::encode(&Msg::Err(&format!("agent '{me}' has no metadata to send: {e}"))),
            })
        }
        Msg::Invl(name) => {
            match host.invalidate(name) {
                Ok(()) => {}
                Err(e) if e.status() == Status::NotFound => {}
                Err(e) => log!("invalidating agent '{name}' as asked by {peer}: {e}"),
            }
            None
        }
        Msg::Err(text) => {
            log!("metadata peer {peer}: {text}");
            None
        }
        Msg::Chal(_) | Msg::Signed(..) => None,
    }
}

/// Start a TCP connect without waiting for it; completion shows as EPOLLOUT.
fn connect_nonblocking(to: SocketAddr) -> io::Result<TcpStream> {
    let family = if to.is_ipv4() { libc::AF_INET } else { libc::AF_INET6 };
    // SAFETY: plain syscall; the result is checked.
    let fd = unsafe { libc::socket(family, libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh socket we own from here on.
    let stream = unsafe { TcpStream::from_raw_fd(fd) };
    // SAFETY: all-zero sockaddr_storage is valid; it is filled below according to the family.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match to {
        SocketAddr::V4(a) => {
            // SAFETY: sockaddr_storage is large and aligned enough for sockaddr_in.
            let sin = unsafe { &mut *(&mut ss as *mut libc::sockaddr_storage as *mut libc::sockaddr_in) };
            sin.sin_family = libc::AF_INET as libc::sa_family_t;
            sin.sin_port = a.port().to_be();
            sin.sin_addr = libc::in_addr { s_addr: u32::from(*a.ip()).to_be() };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            // SAFETY: sockaddr_storage is large and aligned enough for sockaddr_in6.
            let sin6 = unsafe { &mut *(&mut ss as *mut libc::sockaddr_storage as *mut libc::sockaddr_in6) };
            sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            sin6.sin6_port = a.port().to_be();
            sin6.sin6_addr = libc::in6_addr { s6_addr: a.ip().octets() };
            sin6.sin6_scope_id = a.scope_id();
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    // SAFETY: `ss` holds a valid address of `len` bytes.
    let r = unsafe { libc::connect(fd, (&ss as *const libc::sockaddr_storage).cast(), len as libc::socklen_t) };
    if r < 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINPROGRESS) {
            return Err(e);
        }
    }
    let _ = stream.set_nodelay(true);
    Ok(stream)
}
