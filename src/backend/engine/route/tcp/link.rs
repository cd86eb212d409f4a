//! The initiator's side of the TCP route: one `TcpLink` per peer (its control connection, read by the progress
//! thread (`listen`), and its data connections, used by the requests' pieces directly), its liveness (the peer's
//! `health::PeerHealth`, its heartbeats fed by the progress thread), and redialing after a failure.

use std::io;
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use super::listen::{CtrlConn, TcpOpts, TcpShared, Watched};
use super::wire::{self, Hello, WireSeg};
use crate::backend::engine::health::{DialPlan, PeerHealth, Signal, Tick};
use crate::backend::engine::notif;
use crate::backend::{Seg, XferOp};
use crate::os::sock::{self as net, iovec};
use crate::status::{Error, Result, Status};
use crate::util::monotonic_ns;

/// The initiator's side of one peer: its addresses and credentials, the control connection and a few data
/// connections, all opened on first use. Its health is the peer's (`health::PeerHealth`): a peer that went down
/// (silence, a broken connection, a failed dial) is redialed by a later request once its back-off has
/// passed, and is up again if the same incarnation answers; only a proven failure is final.
pub struct TcpLink {
    peer: String,
    me: String,
    incarnation: u128,
    secret: u128,
    addrs: Vec<SocketAddr>,
    opts: TcpOpts,
    shared: Weak<TcpShared>,
    /// The peer's health, shared with its route (`EnginePeer::health`): down while the link is down, fed
    /// by the link's failures, dials and heartbeats (a same-host peer's, whose process is watched otherwise,
    /// does not recover).
    pub health: Arc<PeerHealth>,
    /// Bumped each time the link goes down: failures of connections from an earlier epoch are old news.
    epoch: AtomicU64,
    good: Mutex<Option<SocketAddr>>,
    dial_ctrl: Mutex<()>,
    ctrl: Mutex<Option<Arc<CtrlConn>>>,
    data: Mutex<DataConns>,
    data_cv: Condvar,
    /// Requests in flight, and when the peer last answered (monotonic ns): read by the progress thread.
    inflight: AtomicUsize,
    last_rx: AtomicU64,
    closed: AtomicBool,
    /// Test-only: the next this many data dials fail as a dial to a busy target does (no proof of anything).
    #[cfg(test)]
    pub(crate) fail_data_dials: AtomicUsize,
}

#[derive(Default)]
struct DataConns {
    idle: Vec<Arc<TcpStream>>,
    open: usize,
    all: Vec<Weak<TcpStream>>,
    /// After a failed dial of one more connection while others were open: no further one before this
    /// (monotonic ns); requests wait for the open ones instead.
    no_dial_until: u64,
}

/// The peer a link talks to, as its connection info describes it.
pub struct LinkTarget<'a> {
    pub peer: &'a str,
    pub incarnation: u128,
    pub secret: u128,
    pub addrs: Vec<SocketAddr>,
}

/// Why a dial failed, and whether that proves the incarnation is not there.
type DialError = (String, bool);

impl TcpLink {
    pub fn new(shared: &Arc<TcpShared>, me: &str, t: LinkTarget<'_>, health: Arc<PeerHealth>) -> Arc<TcpLink> {
        Arc::new(TcpLink {
            peer: t.peer.to_owned(),
            me: me.to_owned(),
            incarnation: t.incarnation,
            secret: t.secret,
            addrs: t.addrs,
            opts: shared.opts,
            shared: Arc::downgrade(shared),
            health,
            epoch: AtomicU64::new(0),
            good: Mutex::new(None),
            dial_ctrl: Mutex::new(()),
            ctrl: Mutex::new(None),
            data: Mutex::new(DataConns::default()),
            data_cv: Condvar::new(),
            inflight: AtomicUsize::new(0),
            last_rx: AtomicU64::new(monotonic_ns()),
            closed: AtomicBool::new(false),
            #[cfg(test)]
            fail_data_dials: AtomicUsize::new(0),
        })
    }

    fn touch(&self) {
        self.last_rx.store(monotonic_ns(), Ordering::Release);
    }

    /// Why the link last went down.
    pub fn why(&self) -> Option<String> {
        self.health.why()
    }

    fn gone(&self) -> Error {
        let why = self.health.why().unwrap_or_else(|| "connection closed".into());
        Error::disconnected(format!("agent '{}' is unreachable over TCP: {why}", self.peer))
    }

    /// The peer went down (silence, a broken connection): every socket is shut down, which wakes whoever
    /// waits on one. Requests fail; a later one may redial after the back-off.
    pub fn kill(&self, why: String) {
        self.went_down(why, false);
    }

    /// Like `kill`, from a connection of `epoch`: ignored if the link has gone down (and maybe come back)
    /// since that connection was made.
    fn kill_from(&self, epoch: u64, why: String) {
        if self.epoch.load(Ordering::Acquire) == epoch {
            self.went_down(why, false);
        }
    }

    fn went_down(&self, why: String, proven: bool) {
        let s = if proven { Signal::DialFailed { proven } } else { Signal::Broken };
        // The epoch moves under the health's lock, so a concurrent revival sees either all of this or none.
        self.health.feed(monotonic_ns(), s, || why, || _ = self.epoch.fetch_add(1, Ordering::AcqRel));
        self.drop_conns();
    }

    /// Shut down and forget every connection.
    fn drop_conns(&self) {
        if let Some(c) = self.ctrl.lock().take() {
            let _ = c.stream.shutdown(Shutdown::Both);
        }
        // The control connections, and those retired by a notification that timed out (see `notif`), leave
        // the progress thread's set.
        if let Some(sh) = self.shared.upgrade() {
            sh.remove_outs_of(self as *const TcpLink);
        }
        let mut d = self.data.lock();
        for s in d.all.iter().filter_map(|w| w.upgrade()) {
            let _ = s.shutdown(Shutdown::Both);
        }
        d.idle.clear();
        drop(d);
        self.data_cv.notify_all();
    }

    /// A handshake succeeded on a connection dialed in `epoch`: the incarnation we were built for answers.
    /// A link that was down is up again (unless a proven failure or a close came first). False when the
    /// connection must not be used.
    fn handshook(&self, epoch: u64) -> bool {
        if self.closed.load(Ordering::Acquire) {
            return false;
        }
        self.health.handshake(monotonic_ns(), || self.epoch.load(Ordering::Acquire) == epoch, || self.touch())
    }

    /// The peer was invalidated or dropped: close everything, stop heartbeats. Not a death.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.health.why.lock().get_or_insert_with(|| "the peer was invalidated".into());
        self.drop_conns();
    }

    /// Closed (`close`): nothing is dialed again.
    pub fn closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Is the peer unusable now? Down and not due for a retry, proven gone, or closed.
    pub fn down(&self) -> bool {
        self.closed.load(Ordering::Acquire) || self.health.down_now()
    }

    fn usable(&self) -> Result<()> {
        if self.down() {
            return Err(self.gone());
        }
        Ok(())
    }

    /// A request starts: heartbeats run while any is in flight. Its start counts as a sign of life, stored
    /// before the count goes up so the progress thread never sees a request with an old one.
    pub fn begin(&self) {
        self.touch();
        if self.inflight.fetch_add(1, Ordering::AcqRel) == 0 {
            self.shared.upgrade().inspect(|s| s.wake());
        }
    }

    pub fn end(&self) {
        self.inflight.fetch_sub(1, Ordering::AcqRel);
    }

    /// Open the control connection if it is not open yet (blocking, bounded by the disconnect timeout).
    pub fn connect(self: &Arc<Self>) -> Result<Arc<CtrlConn>> {
        self.usable()?;
        if let Some(c) = self.ctrl.lock().clone() {
            return Ok(c);
        }
        let _g = self.dial_ctrl.lock();
        self.usable()?;
        if let Some(c) = self.ctrl.lock().clone() {
            return Ok(c);
        }
        let shared = self.shared.upgrade().ok_or_else(|| Error::backend("engine is shutting down"))?;
        let stream = self.dial_proven(wire::KIND_CTRL)?;
        let token = shared.out_token();
        // No TCP_USER_TIMEOUT here: a target whose queue is full keeps its window shut for as long as its
        // application does not take notifications, and notifications already handed to this socket must
        // not be thrown away for that (heartbeats catch a partition; a live peer acks window probes).
        net::set_user_timeout(&stream, Duration::ZERO);
        let epoch = self.epoch.load(Ordering::Acquire);
        let conn = Arc::new(CtrlConn { stream, w: Mutex::new(()), token, epoch, retired: AtomicBool::new(false) });
        *self.ctrl.lock() = Some(conn.clone());
        shared.add_out(conn.clone(), Arc::downgrade(self) as Weak<dyn Watched>)?;
        // Death or close may have raced with the dial; they shut down whatever `ctrl` held before.
        if self.health.down.load(Ordering::Acquire) || self.closed.load(Ordering::Acquire) {
            let _ = conn.stream.shutdown(Shutdown::Both);
            shared.remove_out(token);
            return Err(self.gone());
        }
        Ok(conn)
    }

    /// A connection of `kind`, dialled and proven (the target answered for the incarnation we were built
    /// for): the control connection, or another route's exchange (`wire::KIND_ROUTES`: RDMA's queue pairs). A
    /// failure counts against the peer's health.
    pub(crate) fn dial_proven(&self, kind: u8) -> Result<TcpStream> {
        self.usable()?;
        let epoch = self.epoch.load(Ordering::Acquire);
        let s = self.dial(kind).map_err(|e| self.dial_failed(e))?;
        if !self.handshook(epoch) {
            let _ = s.shutdown(Shutdown::Both);
            return Err(self.gone());
        }
        Ok(s)
    }

    fn dial_failed(&self, (why, proven): DialError) -> Error {
        if self.health.down.load(Ordering::Acquire) {
            // Already down: this was a retry. Back off further (or for good).
            self.health.feed(monotonic_ns(), Signal::DialFailed { proven }, || why, || {});
        } else {
            self.went_down(why, proven);
        }
        self.gone()
    }

    /// Connect to the first address that answers, answer its challenge, and wait for the target's ACK.
    /// Failures that prove nothing (no route, a timeout, a close before the answer) are retried with
    /// back-off for up to the disconnect timeout; a NAK or a refused connection on every address ends it.
    fn dial(&self, kind: u8) -> std::result::Result<TcpStream, DialError> {
        let mut plan = DialPlan::new(monotonic_ns(), self.opts.timeout.as_nanos() as u64);
        loop {
            let good = *self.good.lock();
            let order = good.into_iter().chain(self.addrs.iter().copied().filter(|a| Some(*a) != good));
            let mut last = (String::from("no address to connect to"), true);
            let mut proven = true;
            for a in order {
                let left = plan.left(monotonic_ns());
                if left == 0 {
                    proven = false;
                    break;
                }
                match self.dial_one(a, kind, Duration::from_nanos(left)) {
                    Ok(s) => {
                        *self.good.lock() = Some(a);
                        return Ok(s);
                    }
                    Err(e) => (proven, last) = (proven && e.1, e),
                }
            }
            if proven || self.closed.load(Ordering::Acquire) {
                return Err((last.0, proven));
            }
            match plan.next(monotonic_ns()) {
                Some(wait) => std::thread::sleep(Duration::from_nanos(wait)),
                None => return Err((format!("{} (retried for {:?})", last.0, self.opts.timeout), false)),
            }
        }
    }

    /// One handshake with one address, within `left`.
    fn dial_one(&self, a: SocketAddr, kind: u8, left: Duration) -> std::result::Result<TcpStream, DialError> {
        let s = TcpStream::connect_timeout(&a, left.max(Duration::from_millis(1))).map_err(|e| {
            // Nobody listens there: the target's listener lives as long as its agent.
            let proven = e.kind() == io::ErrorKind::ConnectionRefused;
            (format!("connecting to {a}: {e}"), proven)
        })?;
        // A data connection's unacknowledged bytes (or a closed window) may wait as long as the request may make
        // no progress while the peer answers heartbeats (`DataWatch`).
        net::tune(&s, if kind == wire::KIND_DATA { self.opts.patience() } else { self.opts.stall() });
        let wait = left.min(self.opts.handshake()).max(Duration::from_millis(1));
        let mut c = [0u8; wire::CHALLENGE_BYTES];
        s.set_read_timeout(Some(wait))
            .and_then(|_| s.set_write_timeout(Some(self.opts.stall())))
            .and_then(|_| net::recv_exact(&s, &mut c, &net::Impatient))
            .map_err(|e| (format!("{a} closed before its challenge (busy, or not a gixl engine): {e}"), false))?;
        let nonce =
            wire::parse_challenge(&c).map_err(|e| (format!("{a} is not the agent we were given: {e}"), true))?;
        let tag = crate::auth::hello_tag(self.secret, kind, self.incarnation, &nonce, &self.me);
        let hello = wire::encode_hello(&Hello { kind, incarnation: self.incarnation, tag, name: self.me.clone() });
        let mut ans = [0u8; 1];
        let r = net::send_all(&s, &hello, &net::Impatient).and_then(|_| net::recv_exact(&s, &mut ans, &net::Impatient));
        match (r, ans[0]) {
            (Ok(()), wire::ACK) => {
                s.set_read_timeout(Some(self.opts.stall())).map_err(|e| (format!("{a}: {e}"), false))?;
                Ok(s)
            }
            (Ok(()), wire::NAK) => {
                Err((format!("{a} refused our credentials (the peer restarted, the metadata is stale, or the cluster keys differ)"), true))
            }
            (Ok(()), _) => Err((format!("{a} answered the handshake with garbage"), false)),
            (Err(e), _) => Err((format!("handshake with {a}: {e}"), false)),
        }
    }

    /// Send a notification on the control connection. Ok once the whole frame is in the socket: it then
    /// reaches the target's queue unless one of the two goes away. A target whose queue is full stops
    /// reading; after half the disconnect timeout (0.1 to 5 s) this fails with BACKEND and the link stays up.
    /// If the frame was left half written, the connection is half-closed (the target drops the partial frame
    /// after queueing everything before it) and the next notification dials a new one.
    pub fn notif(self: &Arc<Self>, msg: &[u8]) -> Result<()> {
        notif::check(msg)?;
        let c = self.connect()?;
        let _g = c.w.lock();
        let head = wire::encode_ctrl_head(wire::CTRL_NOTIF, msg.len());
        let wait = (self.opts.timeout / 2).clamp(Duration::from_millis(100), Duration::from_secs(5));
        let deadline = monotonic_ns() + wait.as_nanos() as u64;
        let total = head.len() + msg.len();
        let mut sent = 0;
        while sent < total {
            let part = if sent < head.len() { &head[sent..] } else { &msg[sent - head.len()..] };
            match net::send_now(c.stream.as_raw_fd(), part) {
                Ok(n) => {
                    sent += n;
                    self.touch();
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    let left = deadline.saturating_sub(monotonic_ns());
                    if left == 0 || !net::wait_writable(c.stream.as_raw_fd(), left) {
                        if sent > 0 {
                            c.retired.store(true, Ordering::Release);
                            let _ = c.stream.shutdown(Shutdown::Write);
                            self.ctrl.lock().take_if(|x| Arc::ptr_eq(x, &c));
                        }
                        return Err(Error::backend(format!(
                            "agent '{}' did not take the notification within {wait:?}: its notification queue is \
                             full (its application is not taking notifications) or it is not reading; nothing \
                             of this notification was delivered",
                            self.peer
                        )));
                    }
                }
                Err(e) => {
                    self.kill_from(c.epoch, format!("sending a notification: {e}"));
                    return Err(self.gone());
                }
            }
        }
        Ok(())
    }

    /// Tests: put `s` in the pool of idle data connections, as if it were one of ours that the target keeps.
    #[cfg(test)]
    pub(crate) fn plant_idle(&self, s: TcpStream) {
        // Set up as `dial_one` sets up the data connections it dials.
        net::tune(&s, self.opts.patience());
        s.set_read_timeout(Some(self.opts.stall())).unwrap();
        s.set_write_timeout(Some(self.opts.stall())).unwrap();
        let mut g = self.data.lock();
        g.open += 1;
        g.idle.push(Arc::new(s));
    }

    /// A data connection, the epoch it belongs to, and whether it was idle in the pool (not freshly dialled).
    fn checkout(&self) -> Result<(Arc<TcpStream>, u64, bool)> {
        let start = monotonic_ns();
        let mut g = self.data.lock();
        loop {
            self.usable()?;
            let epoch = self.epoch.load(Ordering::Acquire);
            if let Some(s) = g.idle.pop() {
                // The target closes data connections that waited long for a request (`IDLE_DATA`), or that
                // it replaced when all its serving slots were taken: dial a fresh one instead.
                if net::hung_up(s.as_raw_fd()) {
                    g.open -= 1;
                    let _ = s.shutdown(Shutdown::Both);
                    continue;
                }
                return Ok((s, epoch, true));
            }
            let now = monotonic_ns();
            if g.open < self.opts.conns && (g.open == 0 || now >= g.no_dial_until) {
                g.open += 1;
                drop(g);
                let r = self.dial_data().and_then(|s| {
                    if self.handshook(epoch) {
                        Ok(s)
                    } else {
                        let _ = s.shutdown(Shutdown::Both);
                        Err(("the link went down during the handshake".into(), false))
                    }
                });
                return match r {
                    Ok(s) => {
                        let s = Arc::new(s);
                        let mut g = self.data.lock();
                        g.all.retain(|w| w.strong_count() > 0);
                        g.all.push(Arc::downgrade(&s));
                        let epoch = self.epoch.load(Ordering::Acquire);
                        if self.health.down.load(Ordering::Acquire) || self.closed.load(Ordering::Acquire) {
                            let _ = s.shutdown(Shutdown::Both);
                        }
                        Ok((s, epoch, false))
                    }
                    Err(e) => {
                        g = self.data.lock();
                        g.open -= 1;
                        // A connection could not be had (a target accepting slowly under load: its backlog
                        // full, a SYN waiting for its retransmission, its handshakes queued behind other
                        // peers'), but nothing proves the peer gone: with other connections open, wait for one
                        // of those; with none, dial again while its heartbeats say it lives (slow is not dead),
                        // for at most `TcpOpts::patience`.
                        if !e.1 && !self.down() {
                            if g.open > 0 {
                                g.no_dial_until = monotonic_ns() + self.opts.timeout.as_nanos() as u64;
                                continue;
                            }
                            if self.ctrl.lock().is_some() && self.heard(start) {
                                continue;
                            }
                        }
                        drop(g);
                        self.data_cv.notify_one();
                        Err(self.dial_failed(e))
                    }
                };
            }
            if g.open < self.opts.conns && g.open > 0 {
                // Waiting out `no_dial_until`, unless a connection comes back first.
                let left = g.no_dial_until.saturating_sub(now).max(1_000_000);
                self.data_cv.wait_for(&mut g, Duration::from_nanos(left));
                continue;
            }
            self.data_cv.wait(&mut g);
        }
    }

    fn dial_data(&self) -> std::result::Result<TcpStream, DialError> {
        #[cfg(test)]
        if self.fail_data_dials.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1)).is_ok() {
            return Err(("the target did not answer in time (injected)".into(), false));
        }
        self.dial(wire::KIND_DATA)
    }

    /// The peer answered within the silence bound, and `since` is less than `TcpOpts::patience` ago.
    fn heard(&self, since: u64) -> bool {
        let now = monotonic_ns();
        now.saturating_sub(self.last_rx.load(Ordering::Acquire)) < self.opts.live().silence
            && now.saturating_sub(since) < self.opts.patience().as_nanos() as u64
    }

    /// The link is up in `epoch` and not closed.
    fn current(&self, epoch: u64) -> bool {
        self.epoch.load(Ordering::Acquire) == epoch
            && !self.health.down.load(Ordering::Acquire)
            && !self.closed.load(Ordering::Acquire)
    }

    fn checkin(&self, s: Arc<TcpStream>, epoch: u64, reusable: bool) {
        let mut g = self.data.lock();
        if reusable && self.current(epoch) {
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
        let (mut conn, mut epoch, mut pooled) = self.checkout()?;
        let mut retried = false;
        loop {
            // A pooled connection the target closed (idle too long, or replaced when its serving slots were
            // full) between our check for a hang-up and the first request: once, on another connection. The
            // target closes only idle connections, and a request sent again moves the same bytes to the same
            // place, so nothing is done twice that matters.
            let mut lost = false;
            let retry = (pooled && !retried).then_some(&mut lost);
            let r = self.run_on(&conn, epoch, op, segs, region, stop, retry);
            // Denied and canceled requests leave the connection in step; anything else does not.
            // I/O errors kill the link, so only these two can leave it alive.
            let reusable =
                r.as_ref().map_or_else(|e| matches!(e.status(), Status::Backend | Status::Canceled), |_| true);
            self.checkin(conn, epoch, reusable);
            if !lost {
                return r;
            }
            retried = true;
            (conn, epoch, pooled) = self.checkout()?;
        }
    }

    /// `lost`: set instead of taking the link down when the first request fails on the socket (the caller
    /// tries once more on another connection).
    #[allow(clippy::too_many_arguments)]
    fn run_on(
        &self,
        s: &TcpStream,
        epoch: u64,
        op: XferOp,
        segs: &[Seg],
        region: &dyn Fn(&Seg) -> (u64, u64),
        stop: &dyn Fn() -> bool,
        mut lost: Option<&mut bool>,
    ) -> Result<()> {
        let fd = s.as_raw_fd();
        let watch = DataWatch { link: self, epoch, last: std::cell::Cell::new(monotonic_ns()) };
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
                XferOp::Read => {
                    net::send_all(s, &head, &watch).and_then(|_| self.reply(s, &watch, bytes)).and_then(|ok| {
                        if ok {
                            // SAFETY: the local ranges were resolved against this agent's registrations, which
                            // stay valid while registered; the agent allows one active post per request.
                            unsafe {
                                if bytes >= MARKED_BYTES {
                                    net::recv_iovecs_marked(fd, &mut iov, &watch)
                                } else {
                                    net::recv_iovecs(fd, &mut iov, &watch)
                                }
                            }
                            .map(|_| true)
                        } else {
                            Ok(false)
                        }
                    })
                }
                XferOp::Write => {
                    iov.insert(0, iovec(head.as_ptr() as u64, head.len() as u64));
                    // SAFETY: `head` lives across the call; local ranges as above (only read here).
                    unsafe { net::send_iovecs(fd, &mut iov, &watch) }.and_then(|_| self.reply(s, &watch, bytes))
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
                        self.kill_from(epoch, format!("protocol error on a data connection: {e}"));
                    } else if let Some(lost) = lost {
                        *lost = true;
                        return Err(Error::disconnected(format!("a pooled data connection was closed: {e}")));
                    } else {
                        self.kill_from(epoch, format!("data connection failed: {e}"));
                    }
                    return Err(self.gone());
                }
            }
            // Only the first request may be tried again.
            lost = None;
        }
        Ok(())
    }

    /// The target's answer to a request of `bytes`.
    fn reply(&self, s: &TcpStream, watch: &DataWatch<'_>, bytes: u64) -> io::Result<bool> {
        if bytes <= SPIN_BYTES {
            net::look_readable(s.as_raw_fd());
        }
        let mut r = [0u8; wire::REPLY_BYTES];
        net::recv_exact(s, &mut r, watch)?;
        wire::parse_reply(&r).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.0))
    }
}

/// Requests up to this size look for their reply before their thread sleeps on it (`net::look_readable`): a
/// reply due within a round trip is then read without the wake-up of a sleeping thread. A large request's reply
/// comes with its first bytes, and the request takes far longer than a wake-up: no look (its thread would take a
/// core from the transfer).
const SPIN_BYTES: u64 = 64 << 10;

/// READ payloads from this size on are read with a raised low-water mark (`net::recv_iovecs_marked`: a wake-up per
/// 256 KiB, not per packet). Measured on a veth link on 2 cores, alternating builds: a 64 MiB READ (16 MiB pieces)
/// at 89 and 91 % of the raw program's rate against 80 and 86 % without (two runs of 16 rounds). Used on every piece
/// (the fan-in's 4 MiB KV pieces too), it made the 4 KiB READ's p99 at fan-in N = 16 and 64 1.5–2× worse for
/// no gain in the fan-in aggregate: while a reader waits for its mark the kernel ACKs at once (the initiator
/// sent 1.9× the segments per 64 MiB), work that a loaded machine pays for in everyone's latency. So only pieces
/// this large, where one transfer's own wake-ups are what it loses.
const MARKED_BYTES: u64 = 8 << 20;

/// One data connection's request in flight: progress on it is a sign of life of the peer, and when its socket
/// times out the request waits on while the link is up and the peer answers heartbeats (slow is not dead), up
/// to `TcpOpts::patience` without progress on this connection.
struct DataWatch<'a> {
    link: &'a TcpLink,
    epoch: u64,
    /// Last progress on this connection (ns).
    last: std::cell::Cell<u64>,
}

impl net::Watch for DataWatch<'_> {
    fn progress(&self) {
        let now = monotonic_ns();
        self.last.set(now);
        self.link.last_rx.store(now, Ordering::Release);
    }

    fn patient(&self) -> bool {
        self.link.current(self.epoch) && self.link.heard(self.last.get())
    }
}

impl Drop for TcpLink {
    fn drop(&mut self) {
        self.close();
    }
}

impl Watched for TcpLink {
    fn inflight(&self) -> usize {
        self.inflight.load(Ordering::Acquire)
    }
    fn last_rx(&self) -> u64 {
        self.last_rx.load(Ordering::Acquire)
    }
    fn touch(&self) {
        TcpLink::touch(self)
    }
    fn tick(&self, now: u64, inflight: usize, last_rx: u64) -> Tick {
        self.health.live.lock().tick(now, inflight, last_rx)
    }
    fn kill(&self, why: String) {
        TcpLink::kill(self, why)
    }
}
