//! The engine's harness (tests only): a real engine's requests over a scripted route (`FakeRoute`, a
//! `PeerKind::Net` peer) instead of a socket or a process, so the engine's own rules are driven step by step:
//! pieces, then the notification, then the status; a peer that dies while its pieces are held; a route the
//! kernel denies and the router's fallback; a failed piece; a broken peer's back-off and redial on a clock the
//! test moves. Pieces wait on the script, not on time; the waits are for events the script records, but one: that
//! a deregistration does not return while pieces are inside the gate is given 100 ms to be wrong.

use std::any::Any;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::{Condvar, Mutex};

use super::conn;
use super::gate::Attached;
use super::health::{Clock, PeerHealth, Signal};
use super::peer::{EnginePeer, PeerKind};
use super::route::{Job, Prepared, Regions, Route, TcpLink, VramWay};
use super::Engine;
use crate::backend::{Backend, BackendInit, BackendXfer, Peer, RegionKey, Seg, Target, XferOp, XferPlan};
use crate::mem::{Desc, MemType, RegDesc};
use crate::status::{Error, Result, Status};

/// What the route saw, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Event {
    /// A piece began (its bytes).
    Began(u64),
    /// A piece was copied (its bytes).
    Copied(u64),
    /// A piece saw the request stopped while held, and returned.
    Stopped,
    /// A piece was refused as the kernel refuses cross-memory attach.
    Denied,
    /// A piece passed the target's gate, and left it.
    Entered,
    Left,
    /// The target's gate refused a piece (its region deregistered).
    Refused,
    /// The test's own mark (the target's deregistration returned).
    Mark,
    /// A piece failed as scripted.
    Failed,
    Notified(Vec<u8>),
}

/// A route whose pieces do what the test says (they touch no memory).
#[derive(Default)]
pub(super) struct FakeRoute {
    log: Mutex<Vec<Event>>,
    changed: Condvar,
    /// Pieces wait while this is set (until released, or the request is stopped).
    held: AtomicBool,
    /// Every piece is refused as cross-memory attach is where the kernel denies it.
    deny: AtomicBool,
    /// This many more pieces fail (BACKEND).
    fail: AtomicUsize,
    /// Pieces running now.
    active: AtomicUsize,
    /// The peer's health, where the route feeds it (its dials and handshakes, see `unreachable`).
    health: OnceLock<Arc<PeerHealth>>,
    /// A piece of a peer that is down redials: refused while this is set (a failed dial), else a handshake.
    unreachable: AtomicBool,
    /// Pieces pass this target's gate, as a same-host route's batches do (held inside it while held).
    gate: OnceLock<Attached>,
}

impl FakeRoute {
    fn record(&self, e: Event) {
        self.log.lock().push(e);
        self.changed.notify_all();
    }

    fn events(&self) -> Vec<Event> {
        self.log.lock().clone()
    }

    fn count(&self, f: impl Fn(&Event) -> bool) -> usize {
        self.log.lock().iter().filter(|e| f(e)).count()
    }

    /// Wait until the log satisfies `f` (no time limit: the test's own timeout bounds it).
    fn wait_for(&self, f: impl Fn(&[Event]) -> bool) {
        let mut log = self.log.lock();
        while !f(&log) {
            self.changed.wait(&mut log);
        }
    }

    /// `wait_for`, for at most `limit`: whether the log satisfied `f`.
    fn wait_until(&self, f: impl Fn(&[Event]) -> bool, limit: std::time::Duration) -> bool {
        let deadline = std::time::Instant::now() + limit;
        let mut log = self.log.lock();
        while !f(&log) {
            if self.changed.wait_until(&mut log, deadline).timed_out() {
                return f(&log);
            }
        }
        true
    }

    fn release(&self) {
        self.held.store(false, Ordering::Release);
        let _g = self.log.lock();
        self.changed.notify_all();
    }
}

/// Shared between the peer and the test.
impl Route for Arc<FakeRoute> {
    fn label(&self) -> &'static str {
        "fake"
    }
    fn pid(&self) -> Option<i32> {
        None
    }
    fn cpu_copies(&self) -> bool {
        false
    }
    fn closed(&self) -> bool {
        false
    }
    fn why_down(&self) -> String {
        String::new()
    }
    fn connect(&self, _from: &str) -> Result<()> {
        Ok(())
    }
    fn close(&self) {}
    fn notify(&self, _from: &str, msg: &[u8]) -> Result<()> {
        self.record(Event::Notified(msg.to_vec()));
        Ok(())
    }
    fn link(&self) -> Option<&Arc<TcpLink>> {
        None
    }
    fn vram(&self, _plan: &XferPlan, _prepared: Option<&(dyn Any + Send + Sync)>) -> Result<VramWay> {
        Err(Error::not_supported("VRAM over the harness's scripted route"))
    }
    fn prepare(&self, _regions: &Regions<'_>) -> Option<Prepared> {
        None
    }
    fn copy(&self, job: &Job, segs: &[Seg]) -> Result<()> {
        let bytes = segs.iter().map(|s| s.len).sum();
        self.active.fetch_add(1, Ordering::AcqRel);
        self.record(Event::Began(bytes));
        let r = self.piece(job, bytes);
        self.active.fetch_sub(1, Ordering::AcqRel);
        // After `active` dropped, so a test woken by it sees the piece over.
        match &r {
            Ok(()) => self.record(Event::Copied(bytes)),
            Err(e) if e.status() == Status::Canceled => self.record(Event::Stopped),
            Err(_) if self.deny.load(Ordering::Acquire) => self.record(Event::Denied),
            Err(_) => self.record(Event::Failed),
        }
        r
    }
}

impl FakeRoute {
    fn piece(&self, job: &Job, _bytes: u64) -> Result<()> {
        if let Some(h) = self.health.get().filter(|h| h.down.load(Ordering::Acquire)) {
            if self.unreachable.load(Ordering::Acquire) {
                h.feed(h.now(), Signal::DialFailed { proven: false }, || "the redial was refused".into(), || {});
                return Err(Error::disconnected("the redial was refused"));
            }
            h.handshake(h.now(), || true, || {});
        }
        if self.deny.load(Ordering::Acquire) {
            let eperm = std::io::Error::from_raw_os_error(libc::EPERM);
            return Err(Error::os(Status::Backend, "process_vm_readv", eperm));
        }
        let inside = match self.gate.get().map(|g| g.enter(conn::gate_regions(job.keys))) {
            Some(Err(e)) => {
                self.record(Event::Refused);
                return Err(e);
            }
            Some(Ok(inside)) => {
                self.record(Event::Entered);
                Some(inside)
            }
            None => None,
        };
        let r = self.hold(job);
        if inside.is_some() {
            // Before it leaves: whoever waits for the gate to drain sees this first.
            self.record(Event::Left);
        }
        drop(inside);
        r
    }

    fn hold(&self, job: &Job) -> Result<()> {
        let mut log = self.log.lock();
        while self.held.load(Ordering::Acquire) {
            if let Some(e) = job.stopped() {
                return Err(e);
            }
            // The abort flag is an atomic nobody signals: look again every millisecond while held.
            self.changed.wait_for(&mut log, std::time::Duration::from_millis(1));
        }
        drop(log);
        if self.fail.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1)).is_ok() {
            return Err(Error::backend("a piece failed as scripted"));
        }
        Ok(())
    }
}

/// An engine with `threads` copy threads.
fn engine(threads: usize) -> Engine {
    Engine::new(BackendInit {
        agent_name: "harness".into(),
        incarnation: crate::util::random_u128(),
        params: [("num_threads".to_owned(), threads.to_string())].into_iter().collect(),
        num_workers: 0,
        overlap: None,
    })
    .unwrap()
}

/// A peer of `e` reached by `first`, and by `fallback` once the router moves it there; its health does not
/// recover (a same-host peer's).
fn peer(e: &Engine, first: &Arc<FakeRoute>, fallback: Option<&Arc<FakeRoute>>) -> (Arc<dyn Peer>, Arc<PeerHealth>) {
    let health = Arc::new(PeerHealth::new(e.shared.tcp_opts.live(), false, None, None));
    (peer_of(first, fallback, health.clone()), health)
}

fn peer_of(first: &Arc<FakeRoute>, fallback: Option<&Arc<FakeRoute>>, health: Arc<PeerHealth>) -> Arc<dyn Peer> {
    Arc::new(EnginePeer {
        name: "scripted".into(),
        incarnation: crate::util::random_u128(),
        kind: PeerKind::Net(Box::new(first.clone())),
        fallback: fallback.map(|f| Box::new(f.clone()) as Box<dyn Route>),
        on_fallback: AtomicBool::new(false),
        health,
    })
}

/// A WRITE of `bytes` from `local` to `remote` (of the peer's region `key`) in one segment.
pub(super) fn write_plan(
    local: u64,
    remote: u64,
    bytes: u64,
    peer: &Arc<dyn Peer>,
    key: Option<RegionKey>,
) -> XferPlan {
    let seg = Seg { local, remote, len: bytes, ldev: 0, rdev: 0, lreg: 0, rreg: 0 };
    XferPlan {
        op: XferOp::Write,
        local_mem: MemType::Dram,
        remote_mem: MemType::Dram,
        segs: vec![seg],
        local_keys: vec![None],
        remote_keys: vec![key],
        target: Target::Remote(peer.clone()),
        total_bytes: bytes,
    }
}

/// A request of `bytes` to `peer` (addresses the fake route never touches).
fn request(e: &Engine, peer: &Arc<dyn Peer>, bytes: u64) -> Box<dyn BackendXfer> {
    e.prep_xfer(write_plan(0x1000_0000, 0x2000_0000, bytes, peer, None)).unwrap()
}

/// The request's final status: `abort` returns once it is terminal (called when every piece has run, it
/// changes nothing).
fn settled(x: &dyn BackendXfer) -> Result<Status> {
    assert!(x.abort());
    x.status()
}

const MS: u64 = 1_000_000;

/// A peer whose route broke is refused without a try until its back-off has passed; a failed redial doubles the
/// back-off, a successful one (a handshake) brings it back with the back-off reset: on a clock the test moves.
#[test]
fn a_broken_peer_waits_out_its_back_off_then_redials() {
    let e = engine(2);
    let route = Arc::new(FakeRoute::default());
    let clock = Arc::new(AtomicU64::new(3_600_000 * MS));
    let at = |ms: u64| clock.store(3_600_000 * MS + ms * MS, Ordering::Release);
    let health =
        Arc::new(PeerHealth::new(e.shared.tcp_opts.live(), true, None, None).with_clock(Clock::Fake(clock.clone())));
    let _ = route.health.set(health.clone());
    let p = peer_of(&route, None, health.clone());
    let x = request(&e, &p, 4096);
    let began = || route.count(|e| matches!(e, Event::Began(_)));
    assert_eq!(x.post(None).unwrap(), Status::Success);
    // Its link breaks: refused at once, and until one disconnect timeout (1 s) has passed.
    health.feed(health.now(), Signal::Broken, || "reset by the harness".into(), || {});
    for ms in [0, 999] {
        at(ms);
        let err = x.post(None).unwrap_err();
        assert_eq!(err.status(), Status::RemoteDisconnect);
        assert!(err.message().contains("reset by the harness"), "{err}");
    }
    assert_eq!(began(), 1, "nothing tried during the back-off");
    // Its back-off passed: the next request redials, which is refused; the back-off doubles (2 s).
    route.unreachable.store(true, Ordering::Release);
    at(1000);
    assert_eq!(x.post(None).unwrap_err().status(), Status::RemoteDisconnect);
    assert_eq!(began(), 2);
    at(2999);
    assert_eq!(x.post(None).unwrap_err().status(), Status::RemoteDisconnect);
    assert_eq!(began(), 2, "nothing tried during the doubled back-off");
    // Reachable again: the redial's handshake brings the peer back, and the back-off is reset.
    route.unreachable.store(false, Ordering::Release);
    at(3000);
    assert_eq!(x.post(None).unwrap(), Status::Success);
    assert!(!p.disconnected());
    health.feed(health.now(), Signal::Broken, || "again".into(), || {});
    at(3999);
    assert!(p.disconnected());
    at(4000);
    assert!(!p.disconnected(), "the back-off is one timeout again");
}

/// The target deregisters a region while pieces of a request are inside its gate on it: deregistration returns
/// only after they left, a request that comes after it is refused by the gate, and the one inside completes.
#[test]
fn deregistration_waits_for_pieces_inside_the_gate_and_refuses_those_after() {
    const SIZE: usize = 8 << 20;
    let (target, e) = (engine(2), engine(2));
    let buf = vec![0u8; SIZE];
    let desc = Desc::new(buf.as_ptr() as u64, SIZE as u64, 0);
    let lr = target.register(MemType::Dram, &RegDesc { desc, meta: vec![] }).unwrap();
    let (held, probe) = (Arc::new(FakeRoute::default()), Arc::new(FakeRoute::default()));
    for r in [&held, &probe] {
        let _ = r.gate.set(Attached::new(target.shared.gate.clone()).unwrap());
    }
    held.held.store(true, Ordering::Release);
    let (p, _) = peer(&e, &held, None);
    let (q, _) = peer(&e, &probe, None);
    let key = |p: &Arc<dyn Peer>| e.load_remote_region(p, MemType::Dram, &desc, &lr.public).unwrap();
    let x = e.prep_xfer(write_plan(0x1000_0000, desc.addr, SIZE as u64, &p, key(&p))).unwrap();
    let small = e.prep_xfer(write_plan(0x1000_0000, desc.addr, 4096, &q, key(&q))).unwrap();
    assert_eq!(x.post(None).unwrap(), Status::InProg);
    held.wait_for(|log| log.iter().filter(|e| matches!(e, Event::Entered)).count() == 2);
    std::thread::scope(|s| {
        let dereg = s.spawn(|| {
            target.deregister(MemType::Dram, &desc, lr.key.as_ref());
            held.record(Event::Mark);
        });
        // The region is retired at once: the next request on it is refused by the gate (a probe that is not held
        // passes until then).
        let t = std::time::Instant::now();
        while small.post(None).is_ok() {
            assert!(t.elapsed() < std::time::Duration::from_secs(10), "the gate never refused the region");
        }
        assert_eq!(probe.count(|e| matches!(e, Event::Refused)), 1);
        // What must not happen has no event to wait for: give the deregistration 100 ms to return (it must not).
        let returned = held.wait_until(|log| log.contains(&Event::Mark), std::time::Duration::from_millis(100));
        assert!(!returned, "deregistration returned with pieces inside the gate");
        held.release();
        dereg.join().unwrap();
    });
    let log = held.events();
    let mark = log.iter().position(|e| *e == Event::Mark).unwrap();
    assert_eq!(log.iter().filter(|e| matches!(e, Event::Left)).count(), 2);
    assert!(log[..mark].iter().filter(|e| matches!(e, Event::Left)).count() == 2, "left after the return: {log:?}");
    assert_eq!(settled(&*x).unwrap(), Status::Success, "the request inside completes");
    // Posted again: its pieces are refused by the gate, and the request fails.
    assert_eq!(x.post(None).unwrap(), Status::InProg);
    held.wait_for(|log| log.iter().filter(|e| matches!(e, Event::Refused)).count() == 2);
    assert!(settled(&*x).is_err(), "after deregistration the gate refuses it");
}

/// A request split into pieces: every piece is copied, then the notification leaves (once, after the last),
/// then the status is SUCCESS.
#[test]
fn pieces_then_the_notification_then_success() {
    let e = engine(4);
    let route = Arc::new(FakeRoute::default());
    let (p, _) = peer(&e, &route, None);
    let x = request(&e, &p, 8 << 20);
    assert_eq!(x.post(Some(b"kv ready")).unwrap(), Status::InProg);
    route.wait_for(|log| log.iter().any(|e| matches!(e, Event::Notified(_))));
    assert_eq!(settled(&*x).unwrap(), Status::Success);
    let log = route.events();
    let copied: Vec<u64> = log.iter().filter_map(|e| if let Event::Copied(n) = e { Some(*n) } else { None }).collect();
    assert_eq!(copied.len(), 4, "4 pieces on 4 copy threads: {log:?}");
    assert_eq!(copied.iter().sum::<u64>(), 8 << 20);
    let notified = log.iter().position(|e| matches!(e, Event::Notified(_))).unwrap();
    assert_eq!(notified, log.len() - 1, "the notification strictly after every piece: {log:?}");
    assert_eq!(log[notified], Event::Notified(b"kv ready".to_vec()));
    // A second post of the same request runs again, notification included.
    assert_eq!(x.post(Some(b"again")).unwrap(), Status::InProg);
    route.wait_for(|log| log.iter().filter(|e| matches!(e, Event::Notified(_))).count() == 2);
    assert_eq!(settled(&*x).unwrap(), Status::Success);
    assert_eq!(route.count(|e| matches!(e, Event::Copied(_))), 8);
}

/// The peer dies while its pieces are held: the status says REMOTE_DISCONNECT, and only once no piece runs
/// any more (the caller may free its buffers then); no notification leaves; the next post is refused at once.
#[test]
fn a_peer_that_dies_during_post_fails_it_once_its_pieces_have_stopped() {
    let e = engine(4);
    let route = Arc::new(FakeRoute::default());
    route.held.store(true, Ordering::Release);
    let (p, health) = peer(&e, &route, None);
    let x = request(&e, &p, 8 << 20);
    assert_eq!(x.post(Some(b"never")).unwrap(), Status::InProg);
    route.wait_for(|log| log.iter().filter(|e| matches!(e, Event::Began(_))).count() == 4);
    assert_eq!(x.status().unwrap(), Status::InProg, "held pieces, a live peer: in progress");
    health.kill(|| "killed by the harness".into());
    let st = x.status();
    let active = route.active.load(Ordering::Acquire);
    let err = st.unwrap_err();
    assert_eq!(err.status(), Status::RemoteDisconnect, "{err}");
    assert!(err.message().contains("killed by the harness"), "{err}");
    assert_eq!(active, 0, "a terminal status while a piece still ran");
    assert_eq!(route.count(|e| matches!(e, Event::Stopped)), 4);
    assert_eq!(route.count(|e| matches!(e, Event::Notified(_) | Event::Copied(_))), 0);
    let again = x.post(None).unwrap_err();
    assert_eq!(again.status(), Status::RemoteDisconnect);
    assert_eq!(route.count(|e| matches!(e, Event::Began(_))), 4, "nothing posted to a dead peer");
}

/// The first route is denied as the kernel denies cross-memory attach: the piece goes over the fallback, the
/// peer stays there for good (the first route is not tried again), and is named for it.
#[test]
fn a_denied_route_moves_the_peer_to_its_fallback_for_good() {
    let e = engine(4);
    let (first, second) = (Arc::new(FakeRoute::default()), Arc::new(FakeRoute::default()));
    first.deny.store(true, Ordering::Release);
    let (p, _) = peer(&e, &first, Some(&second));
    assert_eq!(p.route(), "fake");
    let x = request(&e, &p, 4096);
    assert_eq!(x.post(Some(b"n")).unwrap(), Status::Success, "small: inline");
    // The notification still goes by the first route (its socket, not its memory access, is what it uses).
    assert_eq!(first.events(), vec![Event::Began(4096), Event::Denied, Event::Notified(b"n".to_vec())]);
    assert_eq!(second.events(), vec![Event::Began(4096), Event::Copied(4096)]);
    assert_eq!(p.route(), "tcp-after-cma-denied");
    let big = request(&e, &p, 8 << 20);
    assert_eq!(big.post(None).unwrap(), Status::InProg);
    second.wait_for(|log| log.iter().filter(|e| matches!(e, Event::Copied(_))).count() == 5);
    assert_eq!(settled(&*big).unwrap(), Status::Success);
    assert_eq!(first.count(|_| true), 3, "the denied route is not tried again");
}

/// One piece fails: the request fails with its error once every piece has run, and no notification leaves.
#[test]
fn a_failed_piece_fails_the_request_and_no_notification_leaves() {
    let e = engine(4);
    let route = Arc::new(FakeRoute::default());
    route.held.store(true, Ordering::Release);
    route.fail.store(1, Ordering::Release);
    let (p, _) = peer(&e, &route, None);
    let x = request(&e, &p, 8 << 20);
    assert_eq!(x.post(Some(b"never")).unwrap(), Status::InProg);
    route.wait_for(|log| log.iter().filter(|e| matches!(e, Event::Began(_))).count() == 4);
    route.release();
    route.wait_for(|log| log.iter().filter(|e| matches!(e, Event::Copied(_) | Event::Failed)).count() == 4);
    let err = settled(&*x).unwrap_err();
    assert_eq!(err.status(), Status::Backend);
    assert!(err.message().contains("failed as scripted"), "{err}");
    assert_eq!(route.count(|e| matches!(e, Event::Failed)), 1);
    assert_eq!(route.count(|e| matches!(e, Event::Copied(_))), 3);
    assert_eq!(route.count(|e| matches!(e, Event::Notified(_))), 0);
}
