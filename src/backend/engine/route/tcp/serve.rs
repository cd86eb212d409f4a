//! The TCP target's serving loops: authenticated data connections, handed over by the progress thread (see
//! `listen`), served against the region table and its leases (`regions`): host memory straight between the
//! socket and the registrations (`sendmsg`/`readv` on iovecs into them, no staging buffer on either side),
//! device memory staged through page-locked buffers (`stage`).

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::{IpAddr, Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use parking_lot::Mutex;

use super::regions::{Leased, Regions};
use super::stage::{loop_pool, Staged};
use super::wire;
use crate::backend::engine::pool::Pinned;
use crate::backend::XferOp;
use crate::os::sock::{self as net, iovec};
use crate::os::Reactor;
use crate::telemetry::log::warn;
use crate::util::monotonic_ns;

/// Data connections served at once. When all are taken, a newcomer replaces an idle one (see
/// `Serving::make_room`).
const MAX_SERVING: usize = 1024;
/// How long a data connection must have waited for a request before a newcomer may replace it: a burst of fresh
/// connections cannot push out each other, and a peer's connection is not cut while its next request is on the way.
const REPLACE_IDLE: Duration = Duration::from_secs(1);
/// A data connection that has waited this long for a request is closed (the initiator dials again when it
/// needs one: it checks a pooled connection for a hang-up before using it).
pub const IDLE_DATA: Duration = Duration::from_secs(300);

/// A data connection as the progress thread sees it once a serving loop has it.
struct Served {
    src: IpAddr,
    stream: Weak<TcpStream>,
    /// Since when (ns) it has waited for a request; 0 while a request is in progress.
    idle: Arc<AtomicU64>,
}

/// The data connections being served and the loops serving them, shared by the progress thread (which hands
/// connections over) and the loops.
#[derive(Default)]
pub struct Serving {
    pub regions: Arc<Regions>,
    /// How long a request may make no progress (`TcpOpts::stall`).
    stall: Duration,
    /// Authenticated data connections being served, by id: shut at teardown, replaced when `MAX_SERVING` is
    /// reached.
    serving: Mutex<HashMap<u64, Served>>,
    nserving: AtomicUsize,
    loops: OnceLock<Vec<Arc<ServeLoop>>>,
    next_serve: AtomicU64,
    closed: AtomicBool,
}

impl Serving {
    pub fn new(regions: Arc<Regions>, stall: Duration) -> Serving {
        Serving { regions, stall, ..Default::default() }
    }

    /// The engine is closing: nothing new is served.
    pub fn closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// The engine is going away: refuse every later request and drop the serving connections. Waits for
    /// requests being served, so nothing touches memory after this returns.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
        for s in self.serving.lock().drain().filter_map(|(_, s)| s.stream.upgrade()) {
            let _ = s.shutdown(Shutdown::Both);
        }
        for l in self.loops.get().into_iter().flatten() {
            l.reactor.wake();
        }
        self.regions.close();
    }

    /// Hand an authenticated data connection to a serving loop (started on first use).
    pub fn hand(self: &Arc<Self>, stream: TcpStream, src: IpAddr, peer: Arc<str>) {
        if self.nserving.load(Ordering::Acquire) >= MAX_SERVING && !self.make_room() {
            return;
        }
        let loops = self.loops.get_or_init(|| start_loops(self));
        if loops.is_empty() {
            return;
        }
        net::tune(&stream, self.stall);
        // A fresh socket's send buffer is empty: the answer always fits.
        if net::send_now(stream.as_raw_fd(), &[wire::ACK]).ok() != Some(1) {
            return;
        }
        let stream = Arc::new(stream);
        let id = self.next_serve.fetch_add(1, Ordering::Relaxed);
        let idle = Arc::new(AtomicU64::new(0));
        self.serving.lock().insert(id, Served { src, stream: Arc::downgrade(&stream), idle: idle.clone() });
        self.nserving.fetch_add(1, Ordering::AcqRel);
        let l = &loops[id as usize % loops.len()];
        l.inbox.lock().push((id, stream, idle, peer));
        l.reactor.wake();
    }

    /// Every serving slot is taken: cut one data connection that has waited for a request for at least
    /// `REPLACE_IDLE`, of the source address holding the most, the longest idle of those. False when none
    /// qualifies (every connection busy or freshly idle): the newcomer is refused. Authenticated strangers
    /// (the secret comes with the metadata) holding every slot can so no longer lock real peers out; a peer whose
    /// idle connection is cut sees the hang-up before it reuses it and dials again.
    fn make_room(&self) -> bool {
        let now = monotonic_ns();
        let long = REPLACE_IDLE.as_nanos() as u64;
        let mut serving = self.serving.lock();
        let mut per: HashMap<IpAddr, usize> = HashMap::new();
        for s in serving.values() {
            *per.entry(s.src).or_default() += 1;
        }
        let victim = serving
            .iter()
            .filter_map(|(&id, s)| {
                let since = s.idle.load(Ordering::Acquire);
                (since != 0 && since + long <= now).then(|| (per[&s.src], u64::MAX - since, id))
            })
            .max()
            .map(|(_, _, id)| id);
        let Some(s) = victim.and_then(|id| serving.remove(&id)) else { return false };
        // Its serving loop sees the hang-up and closes it (the count drops then).
        if let Some(stream) = s.stream.upgrade() {
            let _ = stream.shutdown(Shutdown::Both);
        }
        true
    }
}

/// Authenticated data connections are served by a few event loops (one per core, at least
/// `MIN_LOOPS` so a peer's default four connections move in parallel, at most `MAX_LOOPS`), not a thread
/// each: every socket is non-blocking and edge-triggered in the loop's epoll
/// set, and each connection is a small state machine (header → segment table → payload → reply) that runs
/// until the socket would block or it has moved its `QUANTUM` (then the loop's other connections have their
/// turn, a new request first). An idle connection costs nothing; a slow one holds no thread, only its
/// state and, while its payload moves, a lease on the registrations it names.
const MIN_LOOPS: usize = 4;
const MAX_LOOPS: usize = 8;
/// Bytes a connection moves in one turn of its loop (see `ServeLoop::run`; a staged chunk of device memory
/// may go over it by one chunk). Measured at fan-in N = 16 and 64 (alternating runs): 256 KiB cost 9–21 %
/// of the aggregate against no quantum at all, 512 KiB nothing beyond the spread, 1 MiB twice 512 KiB's 4 KiB
/// latency.
const QUANTUM: usize = 512 << 10;
/// How often a busy loop looks for connections past their deadline.
const SWEEP: u64 = 10_000_000;

/// A data connection handed to a serving loop: its id, the socket, its idle word (see `Served`) and the
/// initiator's agent name (from its authenticated hello).
type Handed = (u64, Arc<TcpStream>, Arc<AtomicU64>, Arc<str>);

struct ServeLoop {
    reactor: Reactor,
    /// Connections handed over by the progress thread (with their idle word, see `Served`), taken on the next
    /// wake-up.
    inbox: Mutex<Vec<Handed>>,
}

impl ServeLoop {
    /// Runs until the engine closes. `sh` is weak so the loop does not keep the engine alive.
    ///
    /// Fair across connections: a connection moves at most `QUANTUM` bytes before the loop looks for new events
    /// and turns to the next one (it goes to the back of `turns` if it could move more), so a request that
    /// arrives behind others' large transfers waits for one quantum of the loop's, not for their socket buffers.
    fn run(&self, sh: Weak<Serving>) {
        let mut conns: HashMap<u64, Box<DataConn>> = HashMap::new();
        let mut fired = Vec::new();
        let mut scratch = vec![0u8; 64 * 1024];
        // Staging buffers for requests on device memory, and the connections waiting for one, in order.
        let mut pool = loop_pool();
        let mut q = Queues::default();
        let (mut swept, mut served) = (0u64, 0u64);
        loop {
            let Some(shared) = sh.upgrade() else { return };
            if shared.closed.load(Ordering::Acquire) {
                for (_, mut c) in conns.drain() {
                    c.close(&shared, &self.reactor, &mut pool);
                }
                return;
            }
            let stall = shared.stall.as_nanos() as u64;
            let now = monotonic_ns();
            // Every connection waits for a request and the last one was served a moment ago: look for the next
            // without sleeping for up to `net::LOOK_NS` (a peer's next small request arrives within its round
            // trip). Never while payloads move. Each look yields the core, as `net::look_readable` does (the
            // initiator's thread may be queued on this core).
            let look = q.turns.is_empty() && now < served + net::LOOK_NS && conns.values().all(|c| c.waiting());
            if look {
                std::thread::yield_now();
            }
            let timeout = if look || !q.turns.is_empty() {
                0
            } else {
                conns
                    .values()
                    .map(|c| c.deadline(stall))
                    .map(|d| d.saturating_sub(now).div_ceil(1_000_000).min(i32::MAX as u64) as i32)
                    .min()
                    .unwrap_or(-1)
            };
            drop(shared);
            let ok = self.reactor.wait(timeout, &mut fired);
            let Some(shared) = sh.upgrade() else { return };
            if !ok {
                return;
            }
            // Drive one connection: closed when it failed, queued for a staging buffer or for its next turn.
            let mut drive = |conns: &mut HashMap<u64, Box<DataConn>>, id, pool: &mut Pinned, q: &mut Queues, front| {
                let Some(c) = conns.get_mut(&id) else { return };
                if !c.drive(&shared.regions, &mut scratch, pool) {
                    if let Some(mut c) = conns.remove(&id) {
                        c.close(&shared, &self.reactor, pool);
                    }
                } else if c.phase == Phase::StageWait && !c.queued {
                    c.queued = true;
                    if front {
                        q.waiting.push_front(id);
                    } else {
                        q.waiting.push_back(id);
                    }
                } else if c.more && !c.turn {
                    c.turn = true;
                    q.turns.push_back(id);
                }
            };
            // Connection ids are the tokens (they never reach `Reactor::WAKE`).
            let mut ready: Vec<u64> = fired.iter().map(|e| e.0).collect();
            if ready.contains(&Reactor::WAKE) {
                for (id, stream, idle, peer) in self.inbox.lock().drain(..) {
                    let edge = (libc::EPOLLIN | libc::EPOLLOUT | libc::EPOLLRDHUP | libc::EPOLLET) as u32;
                    let fd = stream.as_raw_fd();
                    if self.reactor.add(fd, id, edge).is_err() {
                        shared.serving.lock().remove(&id);
                        shared.nserving.fetch_sub(1, Ordering::AcqRel);
                        continue;
                    }
                    conns.insert(id, Box::new(DataConn::new(id, stream, idle, peer)));
                    ready.push(id);
                }
            }
            // A connection mid-transfer waits for its turn; the others (a new request, a reply) go now.
            for id in ready {
                let Some(c) = conns.get_mut(&id) else { continue };
                if !c.moving() {
                    served = monotonic_ns();
                    drive(&mut conns, id, &mut pool, &mut q, false);
                } else if !c.turn {
                    c.turn = true;
                    q.turns.push_back(id);
                }
            }
            // One turn: the longest waiting connection moves its next quantum, or all it can when no other
            // connection of the loop has a payload on the move (a 256 KiB quantum cost a lone transfer 8 % at
            // fan-in N=1 and bought it nothing: a new request waits for one send then).
            if let Some(id) = q.turns.pop_front() {
                let alone = conns.values().filter(|c| c.moving()).nth(1).is_none();
                if let Some(c) = conns.get_mut(&id) {
                    c.turn = false;
                    c.cap = if alone { usize::MAX } else { QUANTUM };
                }
                drive(&mut conns, id, &mut pool, &mut q, false);
            }
            // Buffers given back: the connections waiting for one go on, oldest first.
            while pool.can_take() {
                let Some(id) = q.waiting.pop_front() else { break };
                let Some(c) = conns.get_mut(&id) else { continue };
                c.queued = false;
                drive(&mut conns, id, &mut pool, &mut q, true);
                if conns.get(&id).is_some_and(|c| c.queued) {
                    break;
                }
            }
            // Connections stuck mid-request for longer than the stall bound are given up, and so are those that
            // have waited `IDLE_DATA` for a request (looked for before the loop blocks, and at least every
            // `SWEEP` while it is busy).
            let now = monotonic_ns();
            if q.turns.is_empty() || now >= swept + SWEEP {
                swept = now;
                let late: Vec<u64> = conns.values().filter(|c| c.deadline(stall) <= now).map(|c| c.id).collect();
                for id in late {
                    if let Some(mut c) = conns.remove(&id) {
                        c.close(&shared, &self.reactor, &mut pool);
                    }
                }
            }
        }
    }
}

/// A serving loop's queues of connections: those waiting for a staging buffer, and those that stopped at their
/// quantum with more to move, each in order.
#[derive(Default)]
struct Queues {
    waiting: VecDeque<u64>,
    turns: VecDeque<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Header,
    Table,
    /// WRITE payload into leased memory.
    Recv,
    /// A refused WRITE's payload, swallowed so the connection stays in step.
    Drain,
    /// READ: the OK reply and the payload out of leased memory.
    Send,
    /// The 8-byte reply of a WRITE or a refusal.
    Reply,
    /// A request on device memory waits for a staging buffer of the loop (see `stage::loop_pool`).
    StageWait,
    /// READ from device memory: the staged chunk (the OK reply first) goes out.
    StageSend,
    /// WRITE into device memory: the next chunk comes into the staging buffer.
    StageRecv,
}

/// One data connection's state in a serving loop.
struct DataConn {
    id: u64,
    stream: Arc<TcpStream>,
    phase: Phase,
    hdr: [u8; wire::REQ_HEADER],
    req: Option<wire::ReqHeader>,
    table: Vec<u8>,
    got: usize,
    iov: Vec<libc::iovec>,
    at: usize,
    leased: bool,
    reply: [u8; wire::REPLY_BYTES],
    left: u64,
    /// Last progress (ns): a connection mid-request that makes none for the stall bound is closed.
    last: u64,
    /// The request in progress on device memory (phases `Stage*`).
    staged: Option<Box<Staged>>,
    /// In its loop's queue of connections waiting for a staging buffer.
    queued: bool,
    /// The last `drive` stopped at `QUANTUM` with more to move; `turn`: in its loop's queue of turns.
    more: bool,
    turn: bool,
    /// What its next `drive` may move: `QUANTUM`, or no limit for a turn with no other payload on the move.
    cap: usize,
    /// Shared with the progress thread (see `Served`): since when it has waited for a request, 0 while busy.
    idle: Arc<AtomicU64>,
    /// The initiator's agent name (the overlap check tells initiators apart by it).
    peer: Arc<str>,
}

// SAFETY: the iovecs point into registered memory leased by this connection, or at `reply` (re-pointed
// before each use); the connection is only ever used by the loop thread that owns it.
unsafe impl Send for DataConn {}

impl DataConn {
    fn new(id: u64, stream: Arc<TcpStream>, idle: Arc<AtomicU64>, peer: Arc<str>) -> DataConn {
        DataConn {
            id,
            stream,
            phase: Phase::Header,
            hdr: [0; wire::REQ_HEADER],
            req: None,
            table: Vec::new(),
            got: 0,
            iov: Vec::new(),
            at: 0,
            leased: false,
            reply: [0; wire::REPLY_BYTES],
            left: 0,
            last: monotonic_ns(),
            staged: None,
            queued: false,
            more: false,
            turn: false,
            cap: QUANTUM,
            idle,
            peer,
        }
    }

    /// Waiting for a request: no part of one has arrived.
    fn waiting(&self) -> bool {
        self.phase == Phase::Header && self.got == 0
    }

    /// A request's payload is on the move: the connection takes turns with the loop's others.
    fn moving(&self) -> bool {
        matches!(self.phase, Phase::Send | Phase::Recv | Phase::Drain | Phase::StageSend | Phase::StageRecv)
    }

    /// When this connection is closed unless it makes progress: `stall` after its last progress mid-request,
    /// `IDLE_DATA` after it while waiting for a request.
    fn deadline(&self, stall: u64) -> u64 {
        self.last.saturating_add(if self.waiting() { IDLE_DATA.as_nanos() as u64 } else { stall })
    }

    fn close(&mut self, sh: &Serving, reactor: &Reactor, pool: &mut Pinned) {
        self.stage_end(&sh.regions, pool);
        let _ = self.stream.shutdown(Shutdown::Both);
        // `self.stream` still holds it open.
        reactor.remove(self.stream.as_raw_fd());
        sh.serving.lock().remove(&self.id);
        sh.nserving.fetch_sub(1, Ordering::AcqRel);
    }

    /// Move the state machine as far as the socket allows. False: close the connection (end of stream, an
    /// error, or a malformed request).
    fn drive(&mut self, regions: &Regions, scratch: &mut [u8], pool: &mut Pinned) -> bool {
        let fd = self.stream.as_raw_fd();
        let (mut moved, cap) = (0usize, std::mem::replace(&mut self.cap, QUANTUM));
        self.more = false;
        loop {
            // Its quantum moved: the loop's other connections come first (it has its turn again after them).
            if moved >= cap {
                self.more = true;
                return true;
            }
            if self.phase == Phase::StageWait && !self.stage_begin(regions, pool) {
                // No buffer free: wait for one (the loop drives this connection again), unless the peer
                // has gone or we cut it off (then the lease goes now, not when a buffer frees up).
                return !net::hung_up(fd);
            }
            let r = match self.phase {
                Phase::StageWait => continue,
                // SAFETY: the staged chunk lies inside the staging buffer `self.staged` owns.
                Phase::StageSend => unsafe { self.staged.as_ref().map_or(Ok(0), |st| st.send(fd)) },
                // SAFETY: as above.
                Phase::StageRecv => unsafe { self.staged.as_mut().map_or(Ok(0), |st| st.recv(fd)) },
                Phase::Header => net::recv_now(fd, &mut self.hdr[self.got..]),
                Phase::Table => net::recv_now(fd, &mut self.table[self.got..]),
                Phase::Drain => {
                    let n = (self.left as usize).min(scratch.len());
                    net::recv_now(fd, &mut scratch[..n])
                }
                Phase::Reply => net::send_now(fd, &self.reply[self.got..]),
                // SAFETY: the iovecs point into registrations this connection holds a lease on
                // (registered memory stays valid while registered, NIXL's contract; deregistration waits
                // for the lease), or at `self.reply`, which lives in `self`.
                Phase::Recv => net::capped(&mut self.iov, self.at, cap - moved, |v| unsafe { net::readv_now(fd, v) }),
                // SAFETY: as above; only read.
                Phase::Send => net::capped(&mut self.iov, self.at, cap - moved, |v| unsafe { net::sendmsg_now(fd, v) }),
            };
            let n = match r {
                Ok(0) => return false,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    // Waiting for a request from here: the progress thread may replace it once it has waited
                    // `REPLACE_IDLE`.
                    if self.waiting() {
                        self.idle.store(self.last.max(1), Ordering::Release);
                    }
                    return true;
                }
                Err(_) => return false,
            };
            if self.waiting() {
                self.idle.store(0, Ordering::Release);
            }
            moved += n;
            self.last = monotonic_ns();
            match self.phase {
                Phase::Header => {
                    self.got += n;
                    if self.got == wire::REQ_HEADER {
                        let Ok(h) = wire::parse_req_header(&self.hdr) else { return false };
                        self.req = Some(h);
                        self.table.resize(h.nseg * wire::SEG_BYTES, 0);
                        (self.phase, self.got) = (Phase::Table, 0);
                    }
                }
                Phase::Table => {
                    self.got += n;
                    if self.got == self.table.len() && !self.start(regions) {
                        return false;
                    }
                }
                Phase::Drain => {
                    self.left -= n as u64;
                    if self.left == 0 {
                        self.reply_with(wire::REPLY_DENIED);
                    }
                }
                Phase::Reply => {
                    self.got += n;
                    if self.got == wire::REPLY_BYTES {
                        (self.phase, self.got) = (Phase::Header, 0);
                    }
                }
                Phase::StageWait => {}
                Phase::StageSend => {
                    let Some(st) = self.staged.as_mut() else { return false };
                    let (moved, finished) = (st.moved(n), st.finished());
                    if moved && finished {
                        self.stage_end(regions, pool);
                        (self.phase, self.got) = (Phase::Header, 0);
                    } else if moved && st.load(None).is_err() {
                        // The next chunk out of device memory (a bounded device copy on this thread) failed, and
                        // the reply went out as OK: the connection cannot say so any more.
                        return false;
                    }
                }
                Phase::StageRecv => {
                    let Some(st) = self.staged.as_mut() else { return false };
                    // A complete chunk goes into device memory (a bounded device copy on this thread).
                    match st.moved(n).then(|| st.store()) {
                        Some(Ok(())) if st.finished() => {
                            self.stage_end(regions, pool);
                            self.reply_with(wire::REPLY_OK);
                        }
                        Some(Ok(())) => st.expect(),
                        Some(Err(e)) => {
                            warn(&format!("serving a WRITE into VRAM over TCP failed: {e}; the request is refused"));
                            let rest = st.unstaged();
                            self.stage_end(regions, pool);
                            self.deny(rest);
                        }
                        None => {}
                    }
                }
                Phase::Recv | Phase::Send => {
                    self.at = net::advance(&mut self.iov, self.at, n);
                    if self.at == self.iov.len() {
                        regions.release(self.id);
                        self.leased = false;
                        if self.phase == Phase::Recv {
                            self.reply_with(wire::REPLY_OK);
                        } else {
                            (self.phase, self.got) = (Phase::Header, 0);
                        }
                    }
                }
            }
        }
    }

    /// The segment table is complete: check it, lease the registrations, and pick the next phase.
    fn start(&mut self, regions: &Regions) -> bool {
        let Some(h) = self.req else { return false };
        let Ok(segs) = wire::parse_segs(&self.table, &h) else { return false };
        self.iov.clear();
        self.at = 0;
        match regions.lease(self.id, &self.stream, &segs, (h.op, &self.peer)) {
            Leased::Refused => self.deny(if h.op == XferOp::Write { h.total } else { 0 }),
            Leased::Device(devs) => {
                self.leased = true;
                self.staged = Some(Box::new(Staged::new(h.op, &segs, &devs)));
                self.phase = Phase::StageWait;
            }
            Leased::Host => {
                self.leased = true;
                if h.op == XferOp::Read {
                    self.reply = wire::encode_reply(wire::REPLY_OK);
                    self.iov.push(iovec(self.reply.as_ptr() as u64, wire::REPLY_BYTES as u64));
                }
                self.iov.extend(segs.iter().map(|s| iovec(s.addr, s.len)));
                self.phase = if h.op == XferOp::Read { Phase::Send } else { Phase::Recv };
                self.at = net::skip_empty(&self.iov, 0);
            }
        }
        true
    }

    fn reply_with(&mut self, status: u8) {
        self.reply = wire::encode_reply(status);
        (self.phase, self.got) = (Phase::Reply, 0);
    }

    /// Refuse the request, after swallowing the `drain` bytes of its payload still to come (the connection
    /// stays in step).
    fn deny(&mut self, drain: u64) {
        self.left = drain;
        if drain > 0 {
            self.phase = Phase::Drain;
        } else {
            self.reply_with(wire::REPLY_DENIED);
        }
    }

    /// A request on device memory takes a staging buffer and starts moving (true), or waits for one
    /// (false). A READ's first chunk is staged before the reply goes out, so a failing device copy can
    /// still be answered with DENIED.
    fn stage_begin(&mut self, regions: &Regions, pool: &mut Pinned) -> bool {
        let Some(st) = self.staged.as_mut() else { return false };
        st.buf = match crate::device::get().and_then(|d| pool.take(d, st.dev())) {
            Ok(None) => return false,
            Ok(b) => b,
            Err(e) => {
                warn(&format!("no staging buffer for VRAM over TCP: {e}"));
                return self.stage_refuse(regions, pool);
            }
        };
        match st.op {
            XferOp::Read => {
                if let Err(e) = st.load(Some(&wire::encode_reply(wire::REPLY_OK))) {
                    warn(&format!("serving a READ from VRAM over TCP failed: {e}; the request is refused"));
                    return self.stage_refuse(regions, pool);
                }
                self.phase = Phase::StageSend;
            }
            XferOp::Write => {
                st.expect();
                self.phase = Phase::StageRecv;
            }
        }
        true
    }

    /// Refuse the request on device memory in progress, keeping the connection in step.
    fn stage_refuse(&mut self, regions: &Regions, pool: &mut Pinned) -> bool {
        let write = self.staged.as_ref().is_some_and(|s| s.op == XferOp::Write);
        self.stage_end(regions, pool);
        self.deny(if write { self.req.map_or(0, |h| h.total) } else { 0 });
        true
    }

    /// The request on device memory is over: its lease and staging buffer go back.
    fn stage_end(&mut self, regions: &Regions, pool: &mut Pinned) {
        if self.leased {
            regions.release(self.id);
            self.leased = false;
        }
        if let Some(b) = self.staged.take().and_then(|s| s.buf) {
            pool.put(b);
        }
    }
}

/// Start the serving loops (see `MIN_LOOPS`). Empty if none could start.
fn start_loops(sh: &Arc<Serving>) -> Vec<Arc<ServeLoop>> {
    let n = std::thread::available_parallelism().map_or(MIN_LOOPS, |n| n.get()).clamp(MIN_LOOPS, MAX_LOOPS);
    let mut loops = Vec::new();
    for _ in 0..n {
        let Ok(reactor) = Reactor::new() else { break };
        let l = Arc::new(ServeLoop { reactor, inbox: Mutex::default() });
        let (l2, weak) = (l.clone(), Arc::downgrade(sh));
        if std::thread::Builder::new().name("gixl-tcp-serve".into()).spawn(move || l2.run(weak)).is_err() {
            break;
        }
        loops.push(l);
    }
    loops
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpListener;

    /// Bytes still to go out for the READ in progress (reply and payload).
    fn left(c: &DataConn) -> usize {
        c.iov[c.at..].iter().map(|v| v.iov_len).sum()
    }

    /// A READ larger than a quantum moves at most `QUANTUM` bytes per drive and says when it stopped there
    /// with more to move (its loop then turns to its other connections), or, in a turn without a limit, as much
    /// as the socket takes; the bytes arrive whole and in order. A 4 KiB READ behind it finishes in one drive.
    #[test]
    fn a_large_read_moves_a_quantum_per_drive_and_a_small_one_finishes_in_one() {
        let mem: Vec<u8> = (0..(4u32 << 20)).map(|i| (i % 251) as u8).collect();
        let (base, len) = (mem.as_ptr() as u64, mem.len() as u64);
        let regions = Regions::default();
        regions.add(base, len, None);
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let server = Arc::new(l.accept().unwrap().0);
        let mut c = DataConn::new(1, server.clone(), Arc::default(), Arc::from("t"));
        let (mut scratch, mut pool) = (vec![0u8; 64 * 1024], loop_pool());
        let read = |addr: u64, n: u64| {
            let mut head = Vec::new();
            wire::encode_req(XferOp::Read, &[wire::WireSeg { region: base, region_len: len, addr, len: n }], &mut head);
            head
        };
        // The request is there whole before the drive (it counts towards the quantum).
        const REQ: usize = wire::REQ_HEADER + wire::SEG_BYTES;
        let arrived = |s: &TcpStream| while s.peek(&mut [0u8; REQ]).unwrap() < REQ {};
        client.write_all(&read(base, len)).unwrap();
        arrived(&server);
        assert!(c.drive(&regions, &mut scratch, &mut pool));
        assert_eq!(c.phase, Phase::Send);
        let whole = wire::REPLY_BYTES + mem.len();
        // The request's header and segment table count towards the quantum.
        assert!(whole - left(&c) <= QUANTUM - REQ);
        let reader = std::thread::spawn(move || {
            let mut got = vec![0u8; whole];
            client.read_exact(&mut got).unwrap();
            (client, got)
        });
        // Every third drive is a lone connection's turn (no limit: it runs until the socket would block).
        let (mut drives, mut stops) = (1, c.more as usize);
        while c.phase == Phase::Send {
            let before = left(&c);
            let lone = drives % 3 == 0;
            if lone {
                c.cap = usize::MAX;
            }
            assert!(c.drive(&regions, &mut scratch, &mut pool));
            let moved = before - if c.phase == Phase::Send { left(&c) } else { 0 };
            if lone {
                assert!(!c.more, "a turn without a limit stops only where the socket would block");
            } else {
                assert!(moved <= QUANTUM, "one drive moved {moved} bytes");
                stops += c.more as usize;
            }
            if !c.more && c.phase == Phase::Send {
                net::wait_writable(server.as_raw_fd(), 1_000_000_000);
            }
            drives += 1;
        }
        assert!(stops >= 1, "no drive of {drives} stopped at its quantum with more to move");
        let (mut client, got) = reader.join().unwrap();
        assert!(wire::parse_reply(got[..wire::REPLY_BYTES].try_into().unwrap()).unwrap());
        assert!(got[wire::REPLY_BYTES..] == mem[..], "the bytes arrive whole and in order");

        client.write_all(&read(base + 4096, 4096)).unwrap();
        arrived(&server);
        assert!(c.drive(&regions, &mut scratch, &mut pool));
        assert!(c.waiting() && !c.more, "a 4 KiB READ is done in one drive");
        let mut got = vec![0u8; wire::REPLY_BYTES + 4096];
        client.read_exact(&mut got).unwrap();
        assert!(got[wire::REPLY_BYTES..] == mem[4096..8192]);
    }
}
