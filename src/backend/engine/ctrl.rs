//! The engine's control plane: an abstract Unix socket that receives notifications from peers on this host,
//! pidfds that tell when a peer process exits, the TCP listener and control connections (see `tcp`), and
//! the one progress thread that waits on all of them with epoll.
//!
//! The thread sleeps in `epoll_wait` with no timeout unless a TCP peer has requests in flight (heartbeats)
//! or a TCP connection has not authenticated yet, so an idle agent uses no CPU. It never touches registered
//! memory; it only queues notifications, answers heartbeats and flips peers' `dead` flags.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::Mutex;

use super::tcp::{self, TcpProgress, TcpSetup, TcpShared};
use crate::status::{Error, Result, Status};

/// Largest notification accepted (a frame's body); NIXL users send msgpack'd block lists of a few MiB.
pub const MAX_NOTIF: usize = 64 << 20;

const KIND_HELLO: u8 = 1;
const KIND_NOTIF: u8 = 2;

const TOKEN_WAKE: u64 = 0;
/// In the progress thread's epoll set: the local epoll set (`Local::epfd`); inside that set: the listener.
const TOKEN_LISTEN: u64 = 1;
const TOKEN_CONN: u64 = 1 << 32;
const TOKEN_PIDFD: u64 = 2 << 32;

/// Notifications received and not yet handed out, in arrival order.
pub type NotifQueue = Mutex<Vec<(String, Vec<u8>)>>;

pub struct Ctrl {
    pub sock_name: Vec<u8>,
    pub tcp: Arc<TcpShared>,
    epfd: Arc<OwnedFd>,
    wake: Arc<OwnedFd>,
    stop: Arc<AtomicBool>,
    watches: Arc<Mutex<HashMap<u64, Arc<AtomicBool>>>>,
    next_watch: AtomicU64,
    thread: Mutex<Option<JoinHandle<()>>>,
    local: Arc<Mutex<Local>>,
    /// When the application last called `drain` (monotonic ns): while it polls, the progress thread leaves
    /// the local sockets to it.
    last_poll: Arc<AtomicU64>,
}

impl Ctrl {
    /// Bind the notification socket `\0gixl.<pid>.<incarnation>` and start the progress thread.
    pub fn start(incarnation: u128, queue: Arc<NotifQueue>, setup: TcpSetup) -> Result<Ctrl> {
        let sock_name = format!("gixl.{}.{incarnation:032x}", std::process::id()).into_bytes();
        let addr = SocketAddr::from_abstract_name(&sock_name)
            .map_err(|e| Error::os(Status::Backend, "notification socket name", e))?;
        let listener = UnixListener::bind_addr(&addr)
            .map_err(|e| Error::os(Status::Backend, "binding the notification socket", e))?;
        listener.set_nonblocking(true).map_err(|e| Error::os(Status::Backend, "notification socket", e))?;
        // SAFETY: plain syscalls; results checked before use.
        let epfd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if epfd < 0 {
            return Err(Error::os(Status::Backend, "epoll_create1", io::Error::last_os_error()));
        }
        // SAFETY: `epfd` is a fresh descriptor we own.
        let epfd = Arc::new(unsafe { OwnedFd::from_raw_fd(epfd) });
        // SAFETY: as above.
        let wake = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if wake < 0 {
            return Err(Error::os(Status::Backend, "eventfd", io::Error::last_os_error()));
        }
        // SAFETY: `wake` is a fresh descriptor we own.
        let wake = Arc::new(unsafe { OwnedFd::from_raw_fd(wake) });
        epoll_add(epfd.as_raw_fd(), wake.as_raw_fd(), TOKEN_WAKE)?;
        // The notification listener and its connections live in their own epoll set, itself watched by the
        // progress thread: whichever thread gets there first (the progress thread, or the application's
        // `notifs` poll through `drain`) reads them, under one lock, so a polling application does not wait
        // for the progress thread to be scheduled.
        // SAFETY: plain syscall; result checked before use.
        let local_fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if local_fd < 0 {
            return Err(Error::os(Status::Backend, "epoll_create1", io::Error::last_os_error()));
        }
        // SAFETY: `local_fd` is a fresh descriptor we own.
        let local_fd = unsafe { OwnedFd::from_raw_fd(local_fd) };
        epoll_add(local_fd.as_raw_fd(), listener.as_raw_fd(), TOKEN_LISTEN)?;
        let local_raw = local_fd.as_raw_fd();
        local_arm(epfd.as_raw_fd(), local_raw, libc::EPOLL_CTL_ADD)?;
        let last_poll = Arc::new(AtomicU64::new(0));
        let local = Arc::new(Mutex::new(Local {
            epfd: local_fd,
            listener,
            incarnation,
            queue: queue.clone(),
            conns: HashMap::new(),
            next_conn: 0,
        }));
        let tcp = TcpProgress::new(setup, incarnation, queue.clone(), epfd.clone(), wake.clone())?;
        let tcp_shared = tcp.shared.clone();

        let stop = Arc::new(AtomicBool::new(false));
        let watches: Arc<Mutex<HashMap<u64, Arc<AtomicBool>>>> = Arc::default();
        let mut progress = Progress {
            epfd: epfd.clone(),
            wake: wake.clone(),
            stop: stop.clone(),
            local: local.clone(),
            local_fd: local_raw,
            last_poll: last_poll.clone(),
            rearm_at: None,
            watches: watches.clone(),
            tcp,
        };
        let thread = std::thread::Builder::new()
            .name("gixl-progress".into())
            .spawn(move || progress.run())
            .map_err(|e| Error::os(Status::Backend, "spawning the progress thread", e))?;
        Ok(Ctrl {
            sock_name,
            tcp: tcp_shared,
            epfd,
            wake,
            stop,
            watches,
            next_watch: AtomicU64::new(0),
            thread: Mutex::new(Some(thread)),
            local,
            last_poll,
        })
    }

    /// Read whatever the local notification connections hold now (non-blocking) into the queue. Called by
    /// the application's `notifs` poll; costs one `epoll_wait` when nothing is pending.
    pub fn drain(&self) {
        self.last_poll.store(crate::util::monotonic_ns(), Ordering::Relaxed);
        if let Some(mut l) = self.local.try_lock() {
            l.drain();
        }
    }

    /// Watch a peer's pidfd; `dead` is set when the process exits. Returns a token for `unwatch`.
    pub fn watch(&self, pidfd: RawFd, dead: Arc<AtomicBool>) -> Result<u64> {
        let token = TOKEN_PIDFD + self.next_watch.fetch_add(1, Ordering::Relaxed);
        self.watches.lock().insert(token, dead);
        if let Err(e) = epoll_add(self.epfd.as_raw_fd(), pidfd, token) {
            self.watches.lock().remove(&token);
            return Err(e);
        }
        Ok(token)
    }

    /// Stop watching; call before closing the pidfd.
    pub fn unwatch(&self, token: u64, pidfd: RawFd) {
        // SAFETY: removing a descriptor from our epoll set; errors (already gone) are harmless.
        unsafe { libc::epoll_ctl(self.epfd.as_raw_fd(), libc::EPOLL_CTL_DEL, pidfd, std::ptr::null_mut()) };
        self.watches.lock().remove(&token);
    }

    /// Stop the progress thread and close the socket. Idempotent.
    pub fn shutdown(&self) {
        self.tcp.close();
        self.stop.store(true, Ordering::Release);
        let one: u64 = 1;
        // SAFETY: writing 8 bytes to our eventfd.
        unsafe { libc::write(self.wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
        if let Some(t) = self.thread.lock().take() {
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

impl Drop for Ctrl {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// A sending connection to a peer's notification socket.
pub struct Sender {
    stream: UnixStream,
}

impl Sender {
    /// Connect and introduce ourselves; the peer drops us unless `target_incarnation` is its own.
    pub fn connect(sock_name: &[u8], target_incarnation: u128, from: &str) -> Result<Sender> {
        let addr =
            SocketAddr::from_abstract_name(sock_name).map_err(|e| Error::os(Status::Backend, "peer socket name", e))?;
        let stream = UnixStream::connect_addr(&addr)
            .map_err(|e| Error::os(Status::RemoteDisconnect, "connecting to the peer's notification socket", e))?;
        stream
            .set_write_timeout(Some(Duration::from_secs(5)))
            .map_err(|e| Error::os(Status::Backend, "socket option", e))?;
        let mut s = Sender { stream };
        let mut hello = target_incarnation.to_le_bytes().to_vec();
        hello.extend_from_slice(from.as_bytes());
        s.send(KIND_HELLO, &hello)?;
        Ok(s)
    }

    pub fn notif(&mut self, msg: &[u8]) -> Result<()> {
        if msg.len() > MAX_NOTIF {
            return Err(Error::invalid_param(format!(
                "notification of {} bytes exceeds the {MAX_NOTIF}-byte limit",
                msg.len()
            )));
        }
        self.send(KIND_NOTIF, msg)
    }

    fn send(&mut self, kind: u8, body: &[u8]) -> Result<()> {
        let mut head = [0u8; 5];
        head[..4].copy_from_slice(&((body.len() + 1) as u32).to_le_bytes());
        head[4] = kind;
        // One write (one wake-up of the reader) for the usual small message.
        let r = if body.len() <= 64 * 1024 {
            let mut frame = Vec::with_capacity(5 + body.len());
            frame.extend_from_slice(&head);
            frame.extend_from_slice(body);
            self.stream.write_all(&frame)
        } else {
            self.stream.write_all(&head).and_then(|_| self.stream.write_all(body))
        };
        r.map_err(|e| {
            let st = match e.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => Status::Backend,
                _ => Status::RemoteDisconnect,
            };
            Error::os(st, "sending a notification", e)
        })
    }
}

struct Conn {
    stream: UnixStream,
    buf: Vec<u8>,
    sender: Option<String>,
}

/// The local notification socket and its connections, shared by the progress thread and `Ctrl::drain`.
struct Local {
    epfd: OwnedFd,
    listener: UnixListener,
    incarnation: u128,
    queue: Arc<NotifQueue>,
    conns: HashMap<u64, Conn>,
    next_conn: u64,
}

struct Progress {
    epfd: Arc<OwnedFd>,
    wake: Arc<OwnedFd>,
    stop: Arc<AtomicBool>,
    local: Arc<Mutex<Local>>,
    local_fd: RawFd,
    last_poll: Arc<AtomicU64>,
    /// The local set is disarmed (one-shot) while the application polls; re-arm it at this time (ns).
    rearm_at: Option<u64>,
    watches: Arc<Mutex<HashMap<u64, Arc<AtomicBool>>>>,
    tcp: TcpProgress,
}

impl Progress {
    fn run(&mut self) {
        let mut events = vec![libc::epoll_event { events: 0, u64: 0 }; 64];
        while !self.stop.load(Ordering::Acquire) {
            // -1 (sleep until an event) unless heartbeats or handshake deadlines are pending.
            let mut timeout = self.tcp.tick();
            if let Some(at) = self.rearm_at {
                let now = crate::util::monotonic_ns();
                if at <= now {
                    self.rearm_at = None;
                    let _ = local_arm(self.epfd.as_raw_fd(), self.local_fd, libc::EPOLL_CTL_MOD);
                } else {
                    let ms = (at - now).div_ceil(1_000_000) as i32;
                    timeout = if timeout < 0 { ms } else { timeout.min(ms) };
                }
            }
            // SAFETY: `events` has room for 64 entries.
            let n =
                unsafe { libc::epoll_wait(self.epfd.as_raw_fd(), events.as_mut_ptr(), events.len() as i32, timeout) };
            if n < 0 {
                if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return;
            }
            for ev in &events[..n as usize] {
                let token = ev.u64;
                match token {
                    TOKEN_WAKE => {
                        let mut v = 0u64;
                        // SAFETY: reading 8 bytes from our eventfd into `v`.
                        unsafe { libc::read(self.wake.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
                    }
                    TOKEN_LISTEN => {
                        // One-shot: disarmed now. If the application is polling, it reads the sockets itself
                        // and this thread stays out of its way (no lock contention, no wake-up per message);
                        // look again after POLL_GRACE_NS in case it stopped.
                        let now = crate::util::monotonic_ns();
                        if now.saturating_sub(self.last_poll.load(Ordering::Relaxed)) < POLL_GRACE_NS {
                            self.rearm_at = Some(now + POLL_GRACE_NS);
                        } else {
                            self.local.lock().drain();
                            let _ = local_arm(self.epfd.as_raw_fd(), self.local_fd, libc::EPOLL_CTL_MOD);
                        }
                    }
                    tcp::TOKEN_LISTEN => self.tcp.on_event(token),
                    t if t >= tcp::TOKEN_IN => self.tcp.on_event(t),
                    t if t >= TOKEN_PIDFD => {
                        if let Some(dead) = self.watches.lock().get(&t) {
                            dead.store(true, Ordering::Release);
                        }
                    }
                    _ => {}
                }
            }
        }
    }
}

impl Local {
    /// Accept and read whatever is ready, without blocking.
    fn drain(&mut self) {
        let mut events = [libc::epoll_event { events: 0, u64: 0 }; 16];
        loop {
            // SAFETY: `events` has room for 16 entries; zero timeout.
            let n = unsafe { libc::epoll_wait(self.epfd.as_raw_fd(), events.as_mut_ptr(), events.len() as i32, 0) };
            if n <= 0 {
                if n < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return;
            }
            for ev in &events[..n as usize] {
                match ev.u64 {
                    TOKEN_LISTEN => self.accept(),
                    t => self.read(t),
                }
            }
            if (n as usize) < events.len() {
                return;
            }
        }
    }

    fn accept(&mut self) {
        while let Ok((stream, _)) = self.listener.accept() {
            if stream.set_nonblocking(true).is_err() {
                continue;
            }
            let token = TOKEN_CONN + self.next_conn;
            self.next_conn += 1;
            if epoll_add(self.epfd.as_raw_fd(), stream.as_raw_fd(), token).is_ok() {
                self.conns.insert(token, Conn { stream, buf: Vec::new(), sender: None });
            }
        }
    }

    fn read(&mut self, token: u64) {
        let Some(c) = self.conns.get_mut(&token) else { return };
        let mut chunk = [0u8; 64 * 1024];
        let mut closed = false;
        loop {
            match c.stream.read(&mut chunk) {
                Ok(0) => {
                    closed = true;
                    break;
                }
                Ok(n) => {
                    c.buf.extend_from_slice(&chunk[..n]);
                    // A short read emptied the socket; epoll (level-triggered) reports anything later.
                    if n < chunk.len() {
                        break;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => {
                    closed = true;
                    break;
                }
            }
        }
        let ok = parse_frames(c, self.incarnation, &self.queue);
        if closed || !ok {
            if let Some(c) = self.conns.remove(&token) {
                // SAFETY: removing the connection from our epoll set before it is closed.
                unsafe {
                    libc::epoll_ctl(
                        self.epfd.as_raw_fd(),
                        libc::EPOLL_CTL_DEL,
                        c.stream.as_raw_fd(),
                        std::ptr::null_mut(),
                    )
                };
            }
        }
    }
}

/// Consume every complete frame in `c.buf`. Returns false when the peer broke the protocol.
fn parse_frames(c: &mut Conn, incarnation: u128, queue: &NotifQueue) -> bool {
    let mut at = 0;
    let mut ok = true;
    while c.buf.len() - at >= 4 {
        let len = u32::from_le_bytes([c.buf[at], c.buf[at + 1], c.buf[at + 2], c.buf[at + 3]]) as usize;
        if len == 0 || len > MAX_NOTIF + 1 {
            ok = false;
            break;
        }
        if c.buf.len() - at - 4 < len {
            break;
        }
        let body = &c.buf[at + 4..at + 4 + len];
        at += 4 + len;
        match (body[0], &c.sender) {
            (KIND_HELLO, None) if body.len() >= 17 => {
                let mut inc = [0u8; 16];
                inc.copy_from_slice(&body[1..17]);
                match std::str::from_utf8(&body[17..]) {
                    Ok(name) if u128::from_le_bytes(inc) == incarnation && !name.is_empty() => {
                        c.sender = Some(name.to_owned())
                    }
                    _ => {
                        ok = false;
                        break;
                    }
                }
            }
            (KIND_NOTIF, Some(name)) => queue.lock().push((name.clone(), body[1..].to_vec())),
            _ => {
                ok = false;
                break;
            }
        }
    }
    c.buf.drain(..at);
    ok
}

/// For `crate::fuzzing` only: run `parse_frames` over `data` as one read and, again, split in two reads at
/// `split`; returns the notifications queued by the first run.
pub(crate) fn fuzz_parse_frames(data: &[u8], split: usize, incarnation: u128) -> usize {
    let queue = NotifQueue::default();
    let (stream, _other) = UnixStream::pair().expect("socketpair");
    let mut c = Conn { stream, buf: data.to_vec(), sender: None };
    parse_frames(&mut c, incarnation, &queue);
    let n = queue.lock().len();
    let (stream, _other) = UnixStream::pair().expect("socketpair");
    let mut c = Conn { stream, buf: data[..split.min(data.len())].to_vec(), sender: None };
    if parse_frames(&mut c, incarnation, &queue) {
        c.buf.extend_from_slice(&data[split.min(data.len())..]);
        parse_frames(&mut c, incarnation, &queue);
    }
    n
}

/// How long after the application's last `notifs` poll the progress thread leaves the local sockets to it.
const POLL_GRACE_NS: u64 = 2_000_000;

/// Arm (add or re-arm) the local epoll set in the progress thread's set, one-shot.
fn local_arm(epfd: RawFd, local: RawFd, op: i32) -> Result<()> {
    let mut ev = libc::epoll_event { events: (libc::EPOLLIN | libc::EPOLLONESHOT) as u32, u64: TOKEN_LISTEN };
    // SAFETY: `ev` is a valid event; both descriptors are open.
    if unsafe { libc::epoll_ctl(epfd, op, local, &mut ev) } < 0 {
        return Err(Error::os(Status::Backend, "epoll_ctl", io::Error::last_os_error()));
    }
    Ok(())
}

fn epoll_add(epfd: RawFd, fd: RawFd, token: u64) -> Result<()> {
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
    fn notifications_arrive_in_order_and_strangers_are_dropped() {
        let q: Arc<NotifQueue> = Arc::default();
        let inc = 77u128;
        let setup = TcpSetup {
            bind: "127.0.0.1:0".parse().unwrap(),
            opts: tcp::TcpOpts { conns: 1, timeout: Duration::from_secs(1) },
            secret: 1,
            regions: Arc::default(),
        };
        let ctrl = Ctrl::start(inc, q.clone(), setup).unwrap();
        let mut s = Sender::connect(&ctrl.sock_name, inc, "peer-a").unwrap();
        s.notif(b"one").unwrap();
        s.notif(b"").unwrap();
        s.notif(&vec![7u8; 2 << 20]).unwrap();
        // A sender that names the wrong incarnation is disconnected and delivers nothing.
        let mut bad = Sender::connect(&ctrl.sock_name, inc + 1, "intruder").unwrap();
        let _ = bad.notif(b"evil");
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
        let q: Arc<NotifQueue> = Arc::default();
        let inc = 78u128;
        let setup = TcpSetup {
            bind: "127.0.0.1:0".parse().unwrap(),
            opts: tcp::TcpOpts { conns: 1, timeout: Duration::from_secs(1) },
            secret: 1,
            regions: Arc::default(),
        };
        let ctrl = Ctrl::start(inc, q.clone(), setup).unwrap();
        let name = ctrl.sock_name.clone();
        let senders: Vec<_> = (0..2)
            .map(|k| {
                let name = name.clone();
                std::thread::spawn(move || {
                    let mut s = Sender::connect(&name, inc, &format!("p{k}")).unwrap();
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
        let mut s = Sender::connect(&name, inc, "late").unwrap();
        s.notif(b"after").unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while q.lock().is_empty() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(q.lock().clone(), vec![("late".to_string(), b"after".to_vec())]);
        ctrl.shutdown();
    }
}
