//! The engine's TCP route: peers on other hosts, peers the kernel will not let us reach with cross-memory
//! attach, and every peer when `GIXL_TRANSPORT=tcp`.
//!
//! Per peer the initiator opens one control connection (heartbeats, notifications) and up to `conns` data
//! connections (default 4). Each is authenticated: the target sends a fresh nonce, the initiator answers
//! with the target's incarnation and a MAC of the nonce under the target's 128-bit secret, which only ever
//! travels inside the target's metadata (never on the wire). The target answers a good HELLO with one byte
//! and closes anything else without a word.
//!
//! Data connections move bytes straight between the socket and registered memory (`sendmsg`/`readv` on
//! iovecs that point into it); there is no staging buffer on either side. The target checks every segment
//! of every request against its own table of registrations before touching memory, and holds that table's
//! read lock while it does, so a deregistration waits for requests already running and later ones are
//! refused. Each accepted data connection is served by its own thread, asleep in `poll` while idle.
//!
//! Liveness: the progress thread (see `ctrl`) reads the control connections. While a peer has requests in
//! flight it pings it every `timeout / 8` and declares it dead when nothing (a pong or data progress) has
//! arrived for `3/4 × timeout`, so requests fail within `timeout` of a partition; a closed connection (the
//! peer process died) is seen at once. Declaring a peer dead shuts down all its sockets, which wakes every
//! thread blocked on them. An idle peer gets no timers at all.
//!
//! Not here: wire encoding (see `wire`), socket syscalls (see `net`), splitting a request into pieces
//! (see the engine).

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::{Condvar, Mutex, RwLock};

use super::ctrl::NotifQueue;
use super::net::{self, iovec};
use super::wire::{self, CtrlMsg, Hello, RegionTable, WireSeg};
use crate::backend::{Seg, XferOp};
use crate::status::{Error, Result, Status};
use crate::util::monotonic_ns;

/// The registrations a target serves, shared with its serving threads.
pub type Regions = RwLock<RegionTable>;

/// Pending (not yet authenticated) inbound connections kept at once; more are closed on arrival.
const MAX_PENDING: usize = 256;
/// Data connections served at once.
const MAX_SERVING: usize = 1024;

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
    /// Pings go out this often while requests are in flight.
    fn ping_every_ns(&self) -> u64 {
        (self.timeout.as_nanos() as u64 / 8).max(1_000_000)
    }
    /// Silence for this long declares the peer dead. A quarter of the timeout is left for the partition to
    /// start after the last answer and for the progress thread to be scheduled, so a request in flight
    /// fails within `timeout` of the fault.
    fn silence_ns(&self) -> u64 {
        (self.timeout.as_nanos() as u64 / 4 * 3).max(1_000_000)
    }
}

/// Where to listen: `GIXL_TCP_ADDR` (or the `tcp_addr` parameter) as `IP`, `IP:PORT` or `[IPv6]:PORT`.
pub fn parse_bind(s: &str) -> Result<SocketAddr> {
    let s = s.trim();
    if s.is_empty() {
        return Ok(SocketAddr::from(([0, 0, 0, 0], 0)));
    }
    if let Ok(a) = s.parse::<SocketAddr>() {
        return Ok(a);
    }
    if let Ok(ip) = s.trim_start_matches('[').trim_end_matches(']').parse::<IpAddr>() {
        return Ok(SocketAddr::new(ip, 0));
    }
    Err(Error::invalid_param(format!("'{s}' is not an IP address or IP:port for the TCP listener")))
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

/// The engine's TCP side, shared by the progress thread, the links to peers and the serving threads.
pub struct TcpShared {
    pub incarnation: u128,
    pub secret: u128,
    pub opts: TcpOpts,
    pub regions: Arc<Regions>,
    pub port: u16,
    pub addrs: Vec<SocketAddr>,
    epfd: Arc<OwnedFd>,
    wake: Arc<OwnedFd>,
    out: Mutex<HashMap<u64, Out>>,
    next_out: AtomicU64,
    serving: Mutex<Vec<Weak<TcpStream>>>,
    nserving: AtomicUsize,
    closed: AtomicBool,
}

/// An outbound control connection as the progress thread sees it.
struct Out {
    conn: Arc<CtrlConn>,
    link: Weak<TcpLink>,
    buf: Vec<u8>,
    next_ping: Option<u64>,
}

/// A control connection to a peer. Frames are written whole under `w`.
pub struct CtrlConn {
    stream: TcpStream,
    w: Mutex<()>,
    token: u64,
}

impl TcpShared {
    fn wake(&self) {
        let one: u64 = 1;
        // SAFETY: writing 8 bytes to our eventfd.
        unsafe { libc::write(self.wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    fn add_out(&self, conn: Arc<CtrlConn>, link: Weak<TcpLink>) -> Result<()> {
        self.out.lock().insert(conn.token, Out { conn: conn.clone(), link, buf: Vec::new(), next_ping: None });
        if let Err(e) = epoll_add(self.epfd.as_raw_fd(), conn.stream.as_raw_fd(), conn.token) {
            self.out.lock().remove(&conn.token);
            return Err(e);
        }
        Ok(())
    }

    fn remove_out(&self, token: u64) {
        if let Some(o) = self.out.lock().remove(&token) {
            // SAFETY: removing a descriptor we added; it is still open (`o` holds it).
            unsafe {
                libc::epoll_ctl(
                    self.epfd.as_raw_fd(),
                    libc::EPOLL_CTL_DEL,
                    o.conn.stream.as_raw_fd(),
                    std::ptr::null_mut(),
                )
            };
        }
    }

    /// The engine is going away: refuse every later request and drop the serving connections. Waits for
    /// requests being served, so nothing touches memory after this returns.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.regions.write().clear();
        for s in self.serving.lock().drain(..).filter_map(|w| w.upgrade()) {
            let _ = s.shutdown(Shutdown::Both);
        }
        let outs: Vec<_> = self.out.lock().drain().map(|(_, o)| o).collect();
        for o in outs {
            let _ = o.conn.stream.shutdown(Shutdown::Both);
        }
    }

    /// Called by the progress thread on each wake-up: heartbeats and timeouts of outbound control
    /// connections. Returns how long it may sleep (None: until something happens).
    fn tick(&self, now: u64) -> Option<u64> {
        let silence = self.opts.silence_ns();
        let every = self.opts.ping_every_ns();
        let mut next: Option<u64> = None;
        let mut dead = Vec::new();
        // Links upgraded under the lock are dropped after it: dropping the last one unregisters it.
        let mut seen = Vec::new();
        {
            let mut out = self.out.lock();
            for (&token, o) in out.iter_mut() {
                let Some(link) = o.link.upgrade() else { continue };
                seen.push(link.clone());
                if link.inflight.load(Ordering::Acquire) == 0 {
                    o.next_ping = None;
                    continue;
                }
                let deadline = link.last_rx.load(Ordering::Acquire).saturating_add(silence);
                if now >= deadline {
                    dead.push((token, link));
                    continue;
                }
                let due = *o.next_ping.get_or_insert(now);
                if now >= due {
                    ping(&o.conn);
                    o.next_ping = Some(now + every);
                }
                let soonest = deadline.min(o.next_ping.unwrap_or(deadline));
                next = Some(next.map_or(soonest, |n| n.min(soonest)));
            }
        }
        for (token, link) in dead {
            self.remove_out(token);
            link.kill(format!("no answer to heartbeats for {:?}", Duration::from_nanos(silence)));
        }
        next.map(|n| n.saturating_sub(now))
    }

    /// Bytes arrived on an outbound control connection.
    fn on_out(&self, token: u64) {
        let mut closed = None;
        let link;
        {
            let mut out = self.out.lock();
            let Some(o) = out.get_mut(&token) else { return };
            link = o.link.upgrade();
            let mut chunk = [0u8; 512];
            loop {
                match net::recv_now(o.conn.stream.as_raw_fd(), &mut chunk) {
                    Ok(0) => {
                        closed = Some("the peer closed the connection (process exited or agent destroyed)".to_owned());
                        break;
                    }
                    Ok(n) => o.buf.extend_from_slice(&chunk[..n]),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) => {
                        closed = Some(format!("control connection failed: {e}"));
                        break;
                    }
                }
                if o.buf.len() > 4096 {
                    closed = Some("peer sent unexpected data on the control connection".to_owned());
                    break;
                }
            }
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
            self.remove_out(token);
            if let Some(l) = link {
                l.kill(why);
            }
        }
    }
}

/// Send a PING unless a notification is being written (that write is progress too).
fn ping(c: &CtrlConn) {
    let Some(_g) = c.w.try_lock() else { return };
    let head = wire::encode_ctrl_head(wire::CTRL_PING, 0);
    match net::send_now(c.stream.as_raw_fd(), &head) {
        // A frame must never be left half written: finish a partial one (a five-byte send is only ever
        // split when the send buffer is full, and then the socket's send timeout bounds this).
        Ok(n) if n > 0 && n < head.len() => {
            let _ = net::send_all(&c.stream, &head[n..], &|| {});
        }
        _ => {}
    }
}

/// The progress thread's own TCP state: the listener and inbound connections.
pub struct TcpProgress {
    pub shared: Arc<TcpShared>,
    listener: TcpListener,
    queue: Arc<NotifQueue>,
    inbound: HashMap<u64, In>,
    next_in: u64,
}

struct In {
    stream: TcpStream,
    /// The challenge this connection must answer.
    nonce: [u8; 16],
    buf: Vec<u8>,
    /// None until authenticated: then the sender's agent name.
    name: Option<String>,
    deadline: u64,
}

pub const TOKEN_LISTEN: u64 = 2;
pub const TOKEN_IN: u64 = 3 << 32;
pub const TOKEN_OUT: u64 = 4 << 32;

impl TcpProgress {
    /// Bind the listener and register it with the progress thread's epoll set.
    pub fn new(
        setup: TcpSetup,
        incarnation: u128,
        queue: Arc<NotifQueue>,
        epfd: Arc<OwnedFd>,
        wake: Arc<OwnedFd>,
    ) -> Result<TcpProgress> {
        let TcpSetup { bind, opts, secret, regions } = setup;
        let listener = TcpListener::bind(bind)
            .map_err(|e| Error::os(Status::Backend, format!("binding the TCP listener on {bind}"), e))?;
        listener.set_nonblocking(true).map_err(|e| Error::os(Status::Backend, "TCP listener", e))?;
        let local = listener.local_addr().map_err(|e| Error::os(Status::Backend, "TCP listener address", e))?;
        epoll_add(epfd.as_raw_fd(), listener.as_raw_fd(), TOKEN_LISTEN)?;
        let shared = Arc::new(TcpShared {
            incarnation,
            secret,
            opts,
            regions,
            port: local.port(),
            addrs: advertised(local),
            epfd,
            wake,
            out: Mutex::new(HashMap::new()),
            next_out: AtomicU64::new(0),
            serving: Mutex::new(Vec::new()),
            nserving: AtomicUsize::new(0),
            closed: AtomicBool::new(false),
        });
        Ok(TcpProgress { shared, listener, queue, inbound: HashMap::new(), next_in: 0 })
    }

    pub fn on_event(&mut self, token: u64) {
        if token == TOKEN_LISTEN {
            self.accept();
        } else if token >= TOKEN_OUT {
            self.shared.on_out(token);
        } else if token >= TOKEN_IN {
            self.on_in(token);
        }
    }

    /// Heartbeats, and closing connections that did not authenticate in time. Returns the epoll timeout.
    pub fn tick(&mut self) -> i32 {
        let now = monotonic_ns();
        let mut next = self.shared.tick(now);
        let expired: Vec<u64> =
            self.inbound.iter().filter(|(_, c)| c.name.is_none() && c.deadline <= now).map(|(t, _)| *t).collect();
        for t in expired {
            self.drop_in(t);
        }
        for c in self.inbound.values().filter(|c| c.name.is_none()) {
            let d = c.deadline.saturating_sub(now);
            next = Some(next.map_or(d, |n| n.min(d)));
        }
        match next {
            None => -1,
            Some(ns) => ns.div_ceil(1_000_000).min(i32::MAX as u64) as i32,
        }
    }

    fn accept(&mut self) {
        loop {
            let stream = match self.listener.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => return,
            };
            let pending = self.inbound.values().filter(|c| c.name.is_none()).count();
            if pending >= MAX_PENDING
                || self.shared.closed.load(Ordering::Acquire)
                || stream.set_nonblocking(true).is_err()
            {
                continue;
            }
            // A fresh socket's send buffer is empty: the challenge always fits.
            let nonce = crate::util::random_u128().to_le_bytes();
            let challenge = wire::encode_challenge(&nonce);
            if net::send_now(stream.as_raw_fd(), &challenge).ok() != Some(challenge.len()) {
                continue;
            }
            let token = TOKEN_IN + self.next_in;
            self.next_in = (self.next_in + 1) % (1 << 32);
            if epoll_add(self.shared.epfd.as_raw_fd(), stream.as_raw_fd(), token).is_ok() {
                let deadline = monotonic_ns() + self.shared.opts.stall().as_nanos() as u64;
                self.inbound.insert(token, In { stream, nonce, buf: Vec::new(), name: None, deadline });
            }
        }
    }

    fn drop_in(&mut self, token: u64) -> Option<In> {
        let c = self.inbound.remove(&token)?;
        // SAFETY: removing a descriptor we added; `c` still owns it.
        unsafe {
            libc::epoll_ctl(
                self.shared.epfd.as_raw_fd(),
                libc::EPOLL_CTL_DEL,
                c.stream.as_raw_fd(),
                std::ptr::null_mut(),
            )
        };
        Some(c)
    }

    fn on_in(&mut self, token: u64) {
        let Some(c) = self.inbound.get_mut(&token) else { return };
        let mut chunk = [0u8; 64 * 1024];
        let limit = if c.name.is_some() { super::ctrl::MAX_NOTIF + 16 } else { 64 + wire::MAX_NAME };
        let mut closed = false;
        loop {
            match net::recv_now(c.stream.as_raw_fd(), &mut chunk) {
                Ok(0) => {
                    closed = true;
                    break;
                }
                Ok(n) => c.buf.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(_) => {
                    closed = true;
                    break;
                }
            }
            if c.buf.len() > limit {
                break;
            }
        }
        let keep = match c.name.clone() {
            None => self.authenticate(token),
            Some(name) => self.ctrl_frames(token, &name),
        };
        if closed || !keep {
            self.drop_in(token);
        }
    }

    /// Read the HELLO. Returns false to close the connection (silently: a stranger learns nothing).
    fn authenticate(&mut self, token: u64) -> bool {
        let Some(c) = self.inbound.get_mut(&token) else { return false };
        let (h, used) = match wire::parse_hello(&c.buf) {
            Ok(Some(x)) => x,
            Ok(None) => return true,
            Err(_) => return false,
        };
        // The initiator sends nothing more until it has our answer.
        if used != c.buf.len() {
            return false;
        }
        // Keyed by the cluster key too when one is set (see `crate::auth`).
        let ok = h.incarnation == self.shared.incarnation
            && crate::auth::hello_ok(self.shared.secret, h.kind, self.shared.incarnation, &c.nonce, &h.name, h.tag);
        if !ok || self.shared.closed.load(Ordering::Acquire) {
            return false;
        }
        if h.kind == wire::KIND_CTRL {
            if net::send_now(c.stream.as_raw_fd(), &[wire::ACK]).ok() != Some(1) {
                return false;
            }
            net::tune(&c.stream, self.shared.opts.stall());
            c.buf.clear();
            c.name = Some(h.name);
            return true;
        }
        // A data connection leaves the epoll set for its own thread.
        let Some(c) = self.drop_in(token) else { return false };
        self.serve_data(c.stream);
        true
    }

    fn serve_data(&mut self, stream: TcpStream) {
        let sh = &self.shared;
        if sh.nserving.load(Ordering::Acquire) >= MAX_SERVING || stream.set_nonblocking(false).is_err() {
            return;
        }
        net::tune(&stream, sh.opts.stall());
        let stall = sh.opts.stall();
        if stream.set_read_timeout(Some(stall)).is_err() || stream.set_write_timeout(Some(stall)).is_err() {
            return;
        }
        if net::send_all(&stream, &[wire::ACK], &|| {}).is_err() {
            return;
        }
        let stream = Arc::new(stream);
        {
            let mut serving = sh.serving.lock();
            serving.retain(|w| w.strong_count() > 0);
            serving.push(Arc::downgrade(&stream));
        }
        sh.nserving.fetch_add(1, Ordering::AcqRel);
        let shared = sh.clone();
        let spawned = std::thread::Builder::new().name("gixl-tcp-serve".into()).spawn(move || {
            serve(&stream, &shared.regions);
            shared.nserving.fetch_sub(1, Ordering::AcqRel);
        });
        if spawned.is_err() {
            sh.nserving.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// Frames on an authenticated inbound control connection.
    fn ctrl_frames(&mut self, token: u64, name: &str) -> bool {
        let Some(c) = self.inbound.get_mut(&token) else { return false };
        let mut at = 0;
        let mut ok = true;
        loop {
            match wire::parse_ctrl(&c.buf[at..], super::ctrl::MAX_NOTIF) {
                Ok(Some((msg, n))) => {
                    match msg {
                        CtrlMsg::Ping => {
                            let pong = wire::encode_ctrl_head(wire::CTRL_PONG, 0);
                            // The initiator reads its control connection all the time, so this fits;
                            // if it does not, the initiator is not reading and will time out anyway.
                            if net::send_now(c.stream.as_raw_fd(), &pong).ok() != Some(pong.len()) {
                                ok = false;
                            }
                        }
                        CtrlMsg::Notif(m) => self.queue.lock().push((name.to_owned(), m.to_vec())),
                        CtrlMsg::Pong => ok = false,
                    }
                    at += n;
                    if !ok {
                        break;
                    }
                }
                Ok(None) => break,
                Err(_) => {
                    ok = false;
                    break;
                }
            }
        }
        c.buf.drain(..at);
        ok
    }
}

/// Serve one authenticated data connection until it closes. Every request is checked against `regions`
/// under its read lock, which is held while memory is touched.
fn serve(stream: &TcpStream, regions: &Regions) {
    let fd = stream.as_raw_fd();
    let mut table = Vec::new();
    let mut iov: Vec<libc::iovec> = Vec::with_capacity(wire::MAX_SEGS + 1);
    let mut scratch = Vec::new();
    let none = || {};
    loop {
        if !net::wait_readable(fd) {
            return;
        }
        let mut h = [0u8; wire::REQ_HEADER];
        if net::recv_exact(stream, &mut h, &none).is_err() {
            return;
        }
        let Ok(hdr) = wire::parse_req_header(&h) else { return };
        table.resize(hdr.nseg * wire::SEG_BYTES, 0);
        if net::recv_exact(stream, &mut table, &none).is_err() {
            return;
        }
        let Ok(segs) = wire::parse_segs(&table, &hdr) else { return };
        let regs = regions.read();
        let allowed = wire::segs_allowed(&regs, &segs);
        let reply_ok = wire::encode_reply(wire::REPLY_OK);
        iov.clear();
        let r = match (hdr.op, allowed) {
            (XferOp::Read, true) => {
                iov.push(iovec(reply_ok.as_ptr() as u64, reply_ok.len() as u64));
                iov.extend(segs.iter().map(|s| iovec(s.addr, s.len)));
                // SAFETY: every segment lies inside a registration present in the table, whose read lock
                // we hold: registered memory stays valid while registered (NIXL's contract), and
                // deregistration waits for this lock. We only read it.
                unsafe { net::send_iovecs(fd, &mut iov, &none) }
            }
            (XferOp::Write, true) => {
                iov.extend(segs.iter().map(|s| iovec(s.addr, s.len)));
                // SAFETY: as above; the owner granted writes to registered memory by registering it.
                let r = unsafe { net::recv_iovecs(fd, &mut iov, &none) };
                drop(regs);
                r.and_then(|_| net::send_all(stream, &reply_ok, &none))
            }
            (op, false) => {
                drop(regs);
                let mut r = Ok(());
                if op == XferOp::Write {
                    // Swallow the payload so the connection stays in step; it is bounded by MAX_REQ_BYTES.
                    scratch.resize(64 * 1024, 0);
                    let mut left = hdr.total as usize;
                    while left > 0 && r.is_ok() {
                        let n = left.min(scratch.len());
                        r = net::recv_exact(stream, &mut scratch[..n], &none);
                        left -= n;
                    }
                }
                r.and_then(|_| net::send_all(stream, &wire::encode_reply(wire::REPLY_DENIED), &none))
            }
        };
        if r.is_err() {
            return;
        }
    }
}

/// The initiator's side of one peer: its addresses and credentials, the control connection and a few data
/// connections, all opened on first use.
pub struct TcpLink {
    peer: String,
    me: String,
    incarnation: u128,
    secret: u128,
    addrs: Vec<SocketAddr>,
    opts: TcpOpts,
    shared: Weak<TcpShared>,
    pub dead: Arc<AtomicBool>,
    why: Mutex<Option<String>>,
    good: Mutex<Option<SocketAddr>>,
    dial_ctrl: Mutex<()>,
    ctrl: Mutex<Option<Arc<CtrlConn>>>,
    data: Mutex<DataConns>,
    data_cv: Condvar,
    inflight: AtomicUsize,
    last_rx: AtomicU64,
    closed: AtomicBool,
}

#[derive(Default)]
struct DataConns {
    idle: Vec<Arc<TcpStream>>,
    open: usize,
    all: Vec<Weak<TcpStream>>,
}

/// The peer a link talks to, as its connection info describes it.
pub struct LinkTarget<'a> {
    pub peer: &'a str,
    pub incarnation: u128,
    pub secret: u128,
    pub addrs: Vec<SocketAddr>,
}

impl TcpLink {
    pub fn new(shared: &Arc<TcpShared>, me: &str, t: LinkTarget<'_>, dead: Arc<AtomicBool>) -> Arc<TcpLink> {
        Arc::new(TcpLink {
            peer: t.peer.to_owned(),
            me: me.to_owned(),
            incarnation: t.incarnation,
            secret: t.secret,
            addrs: t.addrs,
            opts: shared.opts,
            shared: Arc::downgrade(shared),
            dead,
            why: Mutex::new(None),
            good: Mutex::new(None),
            dial_ctrl: Mutex::new(()),
            ctrl: Mutex::new(None),
            data: Mutex::new(DataConns::default()),
            data_cv: Condvar::new(),
            inflight: AtomicUsize::new(0),
            last_rx: AtomicU64::new(monotonic_ns()),
            closed: AtomicBool::new(false),
        })
    }

    fn touch(&self) {
        self.last_rx.store(monotonic_ns(), Ordering::Release);
    }

    fn gone(&self) -> Error {
        let why = self.why.lock().clone().unwrap_or_else(|| "connection closed".into());
        Error::disconnected(format!("agent '{}' is unreachable over TCP: {why}", self.peer))
    }

    /// Declare the peer dead: every socket is shut down, which wakes whoever waits on one.
    pub fn kill(&self, why: String) {
        if self.dead.swap(true, Ordering::AcqRel) {
            return;
        }
        self.why.lock().get_or_insert(why);
        self.shut_all();
    }

    fn shut_all(&self) {
        if let Some(c) = self.ctrl.lock().as_ref() {
            let _ = c.stream.shutdown(Shutdown::Both);
        }
        let mut d = self.data.lock();
        for s in d.all.iter().filter_map(|w| w.upgrade()) {
            let _ = s.shutdown(Shutdown::Both);
        }
        d.idle.clear();
        drop(d);
        self.data_cv.notify_all();
    }

    /// The peer was invalidated or dropped: close everything, stop heartbeats. Not a death.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
        let token = self.ctrl.lock().as_ref().map(|c| c.token);
        if let (Some(t), Some(sh)) = (token, self.shared.upgrade()) {
            sh.remove_out(t);
        }
        self.why.lock().get_or_insert_with(|| "the peer was invalidated".into());
        self.shut_all();
    }

    fn usable(&self) -> Result<()> {
        if self.dead.load(Ordering::Acquire) || self.closed.load(Ordering::Acquire) {
            return Err(self.gone());
        }
        Ok(())
    }

    /// A request starts: heartbeats run while any is in flight.
    pub fn begin(&self) {
        if self.inflight.fetch_add(1, Ordering::AcqRel) == 0 {
            self.touch();
            if let Some(s) = self.shared.upgrade() {
                s.wake();
            }
        }
    }

    pub fn end(&self) {
        self.inflight.fetch_sub(1, Ordering::AcqRel);
    }

    /// Open the control connection if it is not open yet (blocking, bounded by the timeout per address).
    pub fn connect(self: &Arc<Self>) -> Result<Arc<CtrlConn>> {
        self.usable()?;
        if let Some(c) = self.ctrl.lock().clone() {
            return Ok(c);
        }
        let _g = self.dial_ctrl.lock();
        if let Some(c) = self.ctrl.lock().clone() {
            return Ok(c);
        }
        let shared = self.shared.upgrade().ok_or_else(|| Error::backend("engine is shutting down"))?;
        let stream = self.dial(wire::KIND_CTRL).map_err(|why| {
            self.kill(why);
            self.gone()
        })?;
        let token = TOKEN_OUT + (shared.next_out.fetch_add(1, Ordering::Relaxed) % (1 << 32));
        let conn = Arc::new(CtrlConn { stream, w: Mutex::new(()), token });
        *self.ctrl.lock() = Some(conn.clone());
        shared.add_out(conn.clone(), Arc::downgrade(self))?;
        // Death or close may have raced with the dial; they shut down whatever `ctrl` held before.
        if self.dead.load(Ordering::Acquire) || self.closed.load(Ordering::Acquire) {
            let _ = conn.stream.shutdown(Shutdown::Both);
            shared.remove_out(token);
            return Err(self.gone());
        }
        Ok(conn)
    }

    /// Connect to the first address that answers, answer its challenge, and wait for the target's ACK.
    fn dial(&self, kind: u8) -> std::result::Result<TcpStream, String> {
        let good = *self.good.lock();
        let order = good.into_iter().chain(self.addrs.iter().copied().filter(|a| Some(*a) != good));
        let hello = |nonce: &[u8; 16]| {
            let tag = crate::auth::hello_tag(self.secret, kind, self.incarnation, nonce, &self.me);
            wire::encode_hello(&Hello { kind, incarnation: self.incarnation, tag, name: self.me.clone() })
        };
        let mut last = String::from("no address to connect to");
        for a in order {
            let s = match TcpStream::connect_timeout(&a, self.opts.timeout) {
                Ok(s) => s,
                Err(e) => {
                    last = format!("connecting to {a}: {e}");
                    continue;
                }
            };
            net::tune(&s, self.opts.stall());
            let r = s
                .set_read_timeout(Some(self.opts.timeout))
                .and_then(|_| s.set_write_timeout(Some(self.opts.stall())))
                .and_then(|_| {
                    let mut c = [0u8; wire::CHALLENGE_BYTES];
                    net::recv_exact(&s, &mut c, &|| {})?;
                    let nonce =
                        wire::parse_challenge(&c).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.0))?;
                    net::send_all(&s, &hello(&nonce), &|| {})
                })
                .and_then(|_| {
                    let mut ack = [0u8; 1];
                    net::recv_exact(&s, &mut ack, &|| {})?;
                    if ack[0] == wire::ACK {
                        Ok(())
                    } else {
                        Err(io::Error::new(io::ErrorKind::InvalidData, "bad answer"))
                    }
                })
                .and_then(|_| s.set_read_timeout(Some(self.opts.stall())));
            match r {
                Ok(()) => {
                    *self.good.lock() = Some(a);
                    return Ok(s);
                }
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                    last = format!("{a} refused our credentials (the peer restarted, or the metadata is stale)");
                }
                Err(e) => last = format!("handshake with {a}: {e}"),
            }
        }
        Err(last)
    }

    /// Send a notification on the control connection.
    pub fn notif(self: &Arc<Self>, msg: &[u8]) -> Result<()> {
        if msg.len() > super::ctrl::MAX_NOTIF {
            return Err(Error::invalid_param(format!(
                "notification of {} bytes exceeds the {}-byte limit",
                msg.len(),
                super::ctrl::MAX_NOTIF
            )));
        }
        let c = self.connect()?;
        let _g = c.w.lock();
        let head = wire::encode_ctrl_head(wire::CTRL_NOTIF, msg.len());
        let progress = || self.touch();
        let r = net::send_all(&c.stream, &head, &progress).and_then(|_| net::send_all(&c.stream, msg, &progress));
        if let Err(e) = r {
            self.kill(format!("sending a notification: {e}"));
            return Err(self.gone());
        }
        Ok(())
    }

    fn checkout(&self) -> Result<Arc<TcpStream>> {
        let mut g = self.data.lock();
        loop {
            self.usable()?;
            if let Some(s) = g.idle.pop() {
                return Ok(s);
            }
            if g.open < self.opts.conns {
                g.open += 1;
                drop(g);
                return match self.dial(wire::KIND_DATA) {
                    Ok(s) => {
                        let s = Arc::new(s);
                        let mut g = self.data.lock();
                        g.all.retain(|w| w.strong_count() > 0);
                        g.all.push(Arc::downgrade(&s));
                        if self.dead.load(Ordering::Acquire) || self.closed.load(Ordering::Acquire) {
                            let _ = s.shutdown(Shutdown::Both);
                        }
                        Ok(s)
                    }
                    Err(why) => {
                        self.data.lock().open -= 1;
                        self.data_cv.notify_one();
                        self.kill(why);
                        Err(self.gone())
                    }
                };
            }
            self.data_cv.wait(&mut g);
        }
    }

    fn checkin(&self, s: Arc<TcpStream>, reusable: bool) {
        let mut g = self.data.lock();
        if reusable && !self.dead.load(Ordering::Acquire) && !self.closed.load(Ordering::Acquire) {
            g.idle.push(s);
        } else {
            g.open -= 1;
            let _ = s.shutdown(Shutdown::Both);
        }
        drop(g);
        self.data_cv.notify_one();
    }

    /// Move `segs` over one data connection, in requests of at most `MAX_SEGS` segments and
    /// `MAX_REQ_BYTES` bytes. `region(seg)` names the target registration the segment lies in. `stop` is
    /// checked between requests.
    pub fn run(
        &self,
        op: XferOp,
        segs: &[Seg],
        region: &dyn Fn(&Seg) -> (u64, u64),
        stop: &dyn Fn() -> bool,
    ) -> Result<()> {
        let conn = self.checkout()?;
        let r = self.run_on(&conn, op, segs, region, stop);
        // Denied and canceled requests leave the connection in step; anything else does not.
        let reusable = match &r {
            Ok(()) => true,
            // I/O errors kill the link, so only these two can leave it alive.
            Err(e) => matches!(e.status(), Status::Backend | Status::Canceled),
        };
        self.checkin(conn, reusable);
        r
    }

    fn run_on(
        &self,
        s: &TcpStream,
        op: XferOp,
        segs: &[Seg],
        region: &dyn Fn(&Seg) -> (u64, u64),
        stop: &dyn Fn() -> bool,
    ) -> Result<()> {
        let fd = s.as_raw_fd();
        let progress = || self.touch();
        let mut wsegs: Vec<WireSeg> = Vec::with_capacity(wire::MAX_SEGS.min(segs.len()));
        let mut iov: Vec<libc::iovec> = Vec::with_capacity(wire::MAX_SEGS.min(segs.len()) + 1);
        let mut head = Vec::new();
        let (mut i, mut off) = (0usize, 0u64);
        while i < segs.len() {
            if stop() {
                return Err(Error::new(Status::Canceled, "transfer stopped"));
            }
            wsegs.clear();
            iov.clear();
            let mut bytes = 0u64;
            while i < segs.len() && wsegs.len() < wire::MAX_SEGS && bytes < wire::MAX_REQ_BYTES {
                let sg = &segs[i];
                let take = (sg.len - off).min(wire::MAX_REQ_BYTES - bytes);
                if take > 0 {
                    let (rb, rl) = region(sg);
                    wsegs.push(WireSeg { region: rb, region_len: rl, addr: sg.remote + off, len: take });
                    iov.push(iovec(sg.local + off, take));
                    bytes += take;
                    off += take;
                }
                if off == sg.len {
                    i += 1;
                    off = 0;
                }
            }
            if wsegs.is_empty() {
                continue;
            }
            wire::encode_req(op, &wsegs, &mut head);
            let r = match op {
                XferOp::Read => net::send_all(s, &head, &progress).and_then(|_| self.reply(s)).and_then(|ok| {
                    if ok {
                        // SAFETY: the local ranges were resolved against this agent's registrations, which
                        // stay valid while registered; the agent allows one active post per request.
                        unsafe { net::recv_iovecs(fd, &mut iov, &progress) }.map(|_| true)
                    } else {
                        Ok(false)
                    }
                }),
                XferOp::Write => {
                    iov.insert(0, iovec(head.as_ptr() as u64, head.len() as u64));
                    // SAFETY: `head` lives across the call; local ranges as above (only read here).
                    unsafe { net::send_iovecs(fd, &mut iov, &progress) }.and_then(|_| self.reply(s))
                }
            };
            match r {
                Ok(true) => {}
                Ok(false) => {
                    return Err(Error::backend(format!(
                        "agent '{}' refused the request: it is outside the memory it has registered (deregistered?)",
                        self.peer
                    )))
                }
                Err(e) => {
                    if e.kind() == io::ErrorKind::InvalidData {
                        self.kill(format!("protocol error on a data connection: {e}"));
                    } else {
                        self.kill(format!("data connection failed: {e}"));
                    }
                    return Err(self.gone());
                }
            }
        }
        Ok(())
    }

    fn reply(&self, s: &TcpStream) -> io::Result<bool> {
        let mut r = [0u8; wire::REPLY_BYTES];
        net::recv_exact(s, &mut r, &|| self.touch())?;
        wire::parse_reply(&r).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.0))
    }
}

impl Drop for TcpLink {
    fn drop(&mut self) {
        self.close();
    }
}

pub fn epoll_add(epfd: RawFd, fd: RawFd, token: u64) -> Result<()> {
    let mut ev = libc::epoll_event { events: (libc::EPOLLIN | libc::EPOLLRDHUP) as u32, u64: token };
    // SAFETY: `ev` is a valid event; both descriptors are open.
    if unsafe { libc::epoll_ctl(epfd, libc::EPOLL_CTL_ADD, fd, &mut ev) } < 0 {
        return Err(Error::os(Status::Backend, "epoll_ctl", io::Error::last_os_error()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
