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
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::Mutex;

use super::wire::{self, Msg};
use super::{log, Host};
use crate::backend::engine::net::{recv_now, send_now};
use crate::status::{Error, Result, Status};
use crate::util::monotonic_ns;

/// NIXL's connect timeout for metadata peers.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// How long a closing agent keeps trying to deliver frames it has already accepted.
const DRAIN: Duration = Duration::from_secs(1);
const MAX_INBOUND: usize = 256;

const TOKEN_WAKE: u64 = 0;
const TOKEN_LISTEN: u64 = 1;

struct Queue {
    cmds: Mutex<VecDeque<(SocketAddr, Vec<u8>)>>,
    wake: OwnedFd,
    stop: AtomicBool,
}

impl Queue {
    fn wake(&self) {
        let one: u64 = 1;
        // SAFETY: writing 8 bytes to our eventfd.
        unsafe { libc::write(self.wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
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
        // SAFETY: plain syscalls; results checked before use.
        let epfd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if epfd < 0 {
            return Err(Error::os(Status::Backend, "epoll_create1", io::Error::last_os_error()));
        }
        // SAFETY: a fresh descriptor we own.
        let epfd = unsafe { OwnedFd::from_raw_fd(epfd) };
        // SAFETY: as above.
        let wake = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if wake < 0 {
            return Err(Error::os(Status::Backend, "eventfd", io::Error::last_os_error()));
        }
        // SAFETY: a fresh descriptor we own.
        let wake = unsafe { OwnedFd::from_raw_fd(wake) };
        ctl(epfd.as_raw_fd(), libc::EPOLL_CTL_ADD, wake.as_raw_fd(), libc::EPOLLIN as u32, TOKEN_WAKE)?;
        if let Some(l) = &listener {
            ctl(epfd.as_raw_fd(), libc::EPOLL_CTL_ADD, l.as_raw_fd(), libc::EPOLLIN as u32, TOKEN_LISTEN)?;
        }
        let q = Arc::new(Queue { cmds: Mutex::new(VecDeque::new()), wake, stop: AtomicBool::new(false) });
        let mut lp = Loop { host, q: q.clone(), epfd, listener, conns: HashMap::new(), cache: HashMap::new(), next: 2 };
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
    /// Some(deadline) while the connect is in progress.
    connecting: Option<u64>,
    rbuf: Vec<u8>,
    wbuf: Vec<u8>,
    wpos: usize,
    watching_out: bool,
}

impl Conn {
    fn pending(&self) -> bool {
        self.wpos < self.wbuf.len()
    }
}

struct Loop {
    host: Arc<dyn Host>,
    q: Arc<Queue>,
    epfd: OwnedFd,
    listener: Option<TcpListener>,
    conns: HashMap<u64, Conn>,
    cache: HashMap<SocketAddr, u64>,
    next: u64,
}

impl Loop {
    fn run(&mut self) {
        let mut events = vec![libc::epoll_event { events: 0, u64: 0 }; 64];
        let mut drain_until: Option<u64> = None;
        loop {
            let now = monotonic_ns();
            if self.q.stop.load(Ordering::Acquire) {
                let until = *drain_until.get_or_insert(now + DRAIN.as_nanos() as u64);
                self.take_cmds();
                if now >= until || !self.conns.values().any(Conn::pending) {
                    return;
                }
            }
            self.expire(now);
            let mut next = self.conns.values().filter_map(|c| c.connecting).min();
            if let Some(d) = drain_until {
                next = Some(next.map_or(d, |n| n.min(d)));
            }
            let timeout = next.map_or(-1, |d| d.saturating_sub(now).div_ceil(1_000_000).min(i32::MAX as u64) as i32);
            // SAFETY: `events` has room for its length.
            let n =
                unsafe { libc::epoll_wait(self.epfd.as_raw_fd(), events.as_mut_ptr(), events.len() as i32, timeout) };
            if n < 0 {
                if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return;
            }
            for ev in &events[..n as usize] {
                let (token, flags) = (ev.u64, ev.events);
                match token {
                    TOKEN_WAKE => {
                        let mut v = 0u64;
                        // SAFETY: reading 8 bytes from our eventfd into `v`.
                        unsafe { libc::read(self.q.wake.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
                        self.take_cmds();
                    }
                    TOKEN_LISTEN => self.accept(),
                    t => self.on_conn(t, flags),
                }
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
            self.conns.iter().filter(|(_, c)| c.connecting.is_some_and(|d| d <= now)).map(|(t, _)| *t).collect();
        for t in late {
            if let Some(c) = self.conns.get(&t) {
                log!("could not connect to metadata peer {} within {CONNECT_TIMEOUT:?}", c.peer);
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
                    let deadline = monotonic_ns() + CONNECT_TIMEOUT.as_nanos() as u64;
                    let c = Conn {
                        stream,
                        peer: to,
                        outbound: true,
                        connecting: Some(deadline),
                        rbuf: Vec::new(),
                        wbuf: Vec::new(),
                        wpos: 0,
                        watching_out: true,
                    };
                    let flags = (libc::EPOLLIN | libc::EPOLLOUT | libc::EPOLLRDHUP) as u32;
                    if let Err(e) = ctl(self.epfd.as_raw_fd(), libc::EPOLL_CTL_ADD, c.stream.as_raw_fd(), flags, t) {
                        log!("metadata peer {to}: {e}");
                        return;
                    }
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
            if c.wpos == c.wbuf.len() {
                c.wbuf.clear();
                c.wpos = 0;
            }
            c.wbuf.extend_from_slice(&frame);
        }
        self.flush(token);
    }

    fn accept(&mut self) {
        let Some(l) = &self.listener else { return };
        loop {
            let (stream, peer) = match l.accept() {
                Ok(x) => x,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => return,
            };
            let inbound = self.conns.values().filter(|c| !c.outbound).count();
            if inbound >= MAX_INBOUND || self.q.stop.load(Ordering::Acquire) || stream.set_nonblocking(true).is_err() {
                continue;
            }
            let t = self.next;
            self.next += 1;
            let flags = (libc::EPOLLIN | libc::EPOLLRDHUP) as u32;
            if ctl(self.epfd.as_raw_fd(), libc::EPOLL_CTL_ADD, stream.as_raw_fd(), flags, t).is_ok() {
                let c = Conn {
                    stream,
                    peer,
                    outbound: false,
                    connecting: None,
                    rbuf: Vec::new(),
                    wbuf: Vec::new(),
                    wpos: 0,
                    watching_out: false,
                };
                self.conns.insert(t, c);
            }
        }
    }

    fn on_conn(&mut self, token: u64, flags: u32) {
        let Some(c) = self.conns.get_mut(&token) else { return };
        if c.connecting.is_some() {
            if flags & (libc::EPOLLOUT | libc::EPOLLERR | libc::EPOLLHUP) as u32 == 0 {
                return;
            }
            match c.stream.take_error() {
                Ok(None) => c.connecting = None,
                Ok(Some(e)) | Err(e) => {
                    log!("could not connect to metadata peer {}: {e}", c.peer);
                    self.close(token);
                    return;
                }
            }
        }
        let mut closed = false;
        if flags & (libc::EPOLLIN | libc::EPOLLRDHUP | libc::EPOLLHUP | libc::EPOLLERR) as u32 != 0 {
            let mut chunk = vec![0u8; 64 * 1024];
            loop {
                match recv_now(c.stream.as_raw_fd(), &mut chunk) {
                    Ok(0) => {
                        closed = true;
                        break;
                    }
                    Ok(n) => c.rbuf.extend_from_slice(&chunk[..n]),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(_) => {
                        closed = true;
                        break;
                    }
                }
                if c.rbuf.len() > wire::MAX_PAYLOAD + wire::HEADER {
                    break;
                }
            }
            if !self.frames(token) {
                closed = true;
            }
        }
        if closed {
            // Deliver nothing more on a connection the peer closed or broke.
            self.close(token);
            return;
        }
        self.flush(token);
    }

    /// Act on every complete frame received on `token`. False when the peer broke the protocol.
    fn frames(&mut self, token: u64) -> bool {
        let mut replies = Vec::new();
        let ok = {
            let Some(c) = self.conns.get_mut(&token) else { return false };
            let mut at = 0;
            let ok = loop {
                match wire::parse(&c.rbuf[at..]) {
                    Ok(Some((m, n))) => {
                        at += n;
                        if let Some(r) = handle(&*self.host, c.peer, m) {
                            replies.push(r);
                        }
                    }
                    Ok(None) => break true,
                    Err(e) => {
                        log!("metadata peer {} sent garbage ({e}); closing the connection", c.peer);
                        break false;
                    }
                }
            };
            c.rbuf.drain(..at);
            ok
        };
        if let Some(c) = self.conns.get_mut(&token) {
            for r in replies {
                c.wbuf.extend_from_slice(&r);
            }
        }
        ok
    }

    fn flush(&mut self, token: u64) {
        let Some(c) = self.conns.get_mut(&token) else { return };
        if c.connecting.is_some() {
            return;
        }
        while c.pending() {
            match send_now(c.stream.as_raw_fd(), &c.wbuf[c.wpos..]) {
                Ok(n) => c.wpos += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    log!("sending to metadata peer {}: {e}", c.peer);
                    self.close(token);
                    return;
                }
            }
        }
        if !c.pending() {
            c.wbuf.clear();
            c.wpos = 0;
        }
        let want = c.pending();
        if want != c.watching_out {
            let mut flags = (libc::EPOLLIN | libc::EPOLLRDHUP) as u32;
            if want {
                flags |= libc::EPOLLOUT as u32;
            }
            if ctl(self.epfd.as_raw_fd(), libc::EPOLL_CTL_MOD, c.stream.as_raw_fd(), flags, token).is_ok() {
                c.watching_out = want;
            }
        }
    }

    fn close(&mut self, token: u64) {
        if let Some(c) = self.conns.remove(&token) {
            // SAFETY: removing a descriptor we added; `c` still owns it.
            unsafe {
                libc::epoll_ctl(self.epfd.as_raw_fd(), libc::EPOLL_CTL_DEL, c.stream.as_raw_fd(), std::ptr::null_mut())
            };
            if c.outbound && self.cache.get(&c.peer) == Some(&token) {
                self.cache.remove(&c.peer);
            }
        }
    }
}

/// Act on one frame; returns the reply to send back, if any.
fn handle(host: &dyn Host, peer: SocketAddr, m: Msg<'_>) -> Option<Vec<u8>> {
    match m {
        Msg::Load(blob) => {
            if let Err(e) = host.load(blob) {
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
    }
}

fn ctl(epfd: RawFd, op: i32, fd: RawFd, events: u32, token: u64) -> Result<()> {
    let mut ev = libc::epoll_event { events, u64: token };
    // SAFETY: `ev` is a valid event; both descriptors are open.
    if unsafe { libc::epoll_ctl(epfd, op, fd, &mut ev) } < 0 {
        return Err(Error::os(Status::Backend, "epoll_ctl", io::Error::last_os_error()));
    }
    Ok(())
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
