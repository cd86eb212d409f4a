//! One peer's health, the one answer to "is this peer dead": a state machine fed every signal about it (a
//! broken or silent connection, a failed or successful dial, the process's exit, its incarnation proven gone)
//! and the time, returning a verdict: Up, Down until a retry is due, or Gone (`Liveness`, sans-IO: it owns no
//! socket and reads no clock, so the progress thread drives it with the real time and the tests below with a
//! fake one); and the shared face of that machine a peer's routes feed and read (`PeerHealth`).
//!
//! Rules:
//! - Heartbeats only while requests are in flight and the peer is silent: a ping every `ping_every` once
//!   nothing (a pong, or data progress) has arrived for `ping_every`, and the peer is down when nothing has
//!   arrived for `silence`. An idle peer has no timers at all, and a peer whose bytes are flowing is not
//!   pinged (a target serving many peers is not made to answer each of them eight times a second).
//! - "Down" is not "dead": a peer that went silent, reset a connection or could not be dialed is retried,
//!   with back-off between attempts (`backoff_min`, doubling up to `backoff_max`), and is up again after a
//!   successful handshake, which proves the same incarnation is there. Requests in flight when it went
//!   down fail; requests posted while a retry is not due fail at once. A machine that may not recover (a
//!   same-host peer's TCP fall-back, whose process is watched otherwise) is gone at its first failure.
//! - "Proven" failures are final (Gone): the target answered our HELLO with NAK (another incarnation, or the
//!   metadata is stale) or refused the connection (its listener, which lives as long as the agent, is
//!   gone); the process exited (its pidfd); its gate faulted, closed, or its sentinel flipped. Only
//!   remove / re-add (a new incarnation) helps then.
//! - A dial retries inside the disconnect timeout (`DialPlan`), so a target busy for a moment, or with its
//!   handshake slots briefly taken by strangers, costs a little latency, not the peer.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::gate::Attached;

/// Timing of the state machine, in ns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LiveCfg {
    pub ping_every: u64,
    pub silence: u64,
    pub backoff_min: u64,
    pub backoff_max: u64,
}

impl LiveCfg {
    /// The engine's figures for a disconnect timeout of `timeout_ns`: pings every 1/8, down after 3/4 of
    /// silence (the last quarter is left for the fault to start after the last answer and for the
    /// progress thread to be scheduled), retries after one timeout, backing off to 16.
    pub fn for_timeout(timeout_ns: u64) -> LiveCfg {
        let t = timeout_ns.max(1_000_000);
        LiveCfg { ping_every: (t / 8).max(1_000_000), silence: t / 4 * 3, backoff_min: t, backoff_max: t * 16 }
    }
}

/// What happened to the peer, as a route saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    /// A connection broke (reset, end of stream, I/O error) or the peer went silent.
    Broken,
    /// A dial failed; `proven` when the target said the incarnation is not there.
    DialFailed { proven: bool },
    /// A handshake succeeded: the incarnation we were built for answers.
    Handshake,
    /// The peer's process exited, or its incarnation is proven gone (gate, sentinel, identity probe).
    Gone,
}

/// The machine's answer: usable, down until a retry is due at that time (ns), or gone for good.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Up,
    DownUntil(u64),
    Gone,
}

/// What the caller must do after a `tick`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Tick {
    /// Send a PING on the control connection.
    pub ping: bool,
    /// The peer went down now (silence): fail its requests, shut its sockets.
    pub down: bool,
    /// Look again after this many ns (None: only when something happens).
    pub wake_in: Option<u64>,
}

#[derive(Debug, Clone)]
pub struct Liveness {
    cfg: LiveCfg,
    /// May it come back after a failure (else the first one is final)?
    recover: bool,
    health: Verdict,
    next_ping: Option<u64>,
    /// When the first ping since the last sign of life left (see `tick`).
    asked: Option<u64>,
    backoff: u64,
}

impl Liveness {
    pub fn new(cfg: LiveCfg, recover: bool) -> Liveness {
        Liveness { cfg, recover, health: Verdict::Up, next_ping: None, asked: None, backoff: cfg.backoff_min }
    }

    pub fn verdict(&self) -> Verdict {
        self.health
    }

    /// Heartbeats: `inflight` requests are running and the last sign of life came at `last_rx`. Down after
    /// `silence` without one, and never before the peer had half of it to answer a ping that actually left: a
    /// caller starved of CPU (its pings late) does not take its own delay for the peer's silence.
    pub fn tick(&mut self, now: u64, inflight: usize, last_rx: u64) -> Tick {
        if self.health != Verdict::Up || inflight == 0 {
            (self.next_ping, self.asked) = (None, None);
            return Tick::default();
        }
        self.asked = self.asked.filter(|&a| last_rx < a);
        // Not before `ping_every` of silence: while the peer's bytes arrive, it needs no question.
        let heard = last_rx.saturating_add(self.cfg.ping_every);
        let ping = now >= (*self.next_ping.get_or_insert(now)).max(heard);
        if ping {
            self.next_ping = Some(now + self.cfg.ping_every);
            self.asked.get_or_insert(now);
        }
        let answer_by = self.asked.map_or(0, |a| a.saturating_add(self.cfg.silence / 2));
        let deadline = last_rx.saturating_add(self.cfg.silence).max(answer_by);
        if now >= deadline {
            self.went_down(now);
            return Tick { down: true, ..Tick::default() };
        }
        let soonest = deadline.min(self.next_ping.map_or(deadline, |n| n.max(heard)));
        Tick { ping, down: false, wake_in: Some(soonest - now) }
    }

    /// Take in what happened at `now`. Returns true when the peer is up afterwards for a `Handshake` (false:
    /// too late, it is gone), and for the other signals when this is news (the peer was up).
    pub fn feed(&mut self, now: u64, s: Signal) -> bool {
        let was_up = self.health == Verdict::Up;
        match (s, self.health) {
            (_, Verdict::Gone) => return false,
            (Signal::Handshake, _) => {
                self.health = Verdict::Up;
                self.backoff = self.cfg.backoff_min;
                return true;
            }
            (Signal::Gone | Signal::DialFailed { proven: true }, _) => self.give_up(),
            (Signal::Broken | Signal::DialFailed { .. }, Verdict::Up) => self.went_down(now),
            (Signal::Broken, Verdict::DownUntil(_)) => {}
            (Signal::DialFailed { .. }, Verdict::DownUntil(_)) => self.back_off(now),
        }
        was_up
    }

    /// May a request try to (re)connect now? Up, or down and past its back-off.
    #[cfg(test)]
    pub fn may_dial(&self, now: u64) -> bool {
        match self.verdict() {
            Verdict::Up => true,
            Verdict::DownUntil(t) => now >= t,
            Verdict::Gone => false,
        }
    }

    fn went_down(&mut self, now: u64) {
        (self.next_ping, self.asked) = (None, None);
        if self.recover {
            self.back_off(now)
        } else {
            self.give_up()
        }
    }

    /// Down until the back-off from `now` is over; the next one twice as long.
    fn back_off(&mut self, now: u64) {
        self.health = Verdict::DownUntil(now.saturating_add(self.backoff));
        self.backoff = (self.backoff.saturating_mul(2)).min(self.cfg.backoff_max);
    }

    fn give_up(&mut self) {
        (self.next_ping, self.asked) = (None, None);
        self.health = Verdict::Gone;
    }
}

/// Where a peer's health reads the time: the monotonic clock, or in tests one the test moves (the engine's
/// harness drives back-offs without waiting for them).
#[derive(Clone, Default)]
pub(crate) enum Clock {
    #[default]
    Real,
    #[cfg(test)]
    Fake(Arc<std::sync::atomic::AtomicU64>),
}

impl Clock {
    pub(crate) fn now(&self) -> u64 {
        match self {
            Clock::Real => crate::util::monotonic_ns(),
            #[cfg(test)]
            Clock::Fake(t) => t.load(Ordering::Acquire),
        }
    }
}

/// One peer's health as its routes share it: the machine, and what the copy path reads without its lock.
pub(crate) struct PeerHealth {
    /// The machine. A route that acts on a change (a TCP link bumping its epoch) does so under this lock.
    pub(crate) live: Mutex<Liveness>,
    /// Not up: down (a retry may come) or gone. Set and cleared under `live` by whoever fed the change.
    pub(crate) down: AtomicBool,
    /// Gone for good. Set under `live`.
    gone: AtomicBool,
    /// Why it last went down.
    pub(crate) why: Mutex<Option<String>>,
    /// Signals read when asked, from those who watch the peer's process for every name it goes by: its exit
    /// (the progress thread's pidfd watch, see `shared::Proof`) and its gate's live flag (its incarnation
    /// ended, see `gate`).
    exited: Option<Arc<AtomicBool>>,
    gate: Option<Arc<Attached>>,
    clock: Clock,
}

impl PeerHealth {
    pub(crate) fn new(
        cfg: LiveCfg,
        recover: bool,
        exited: Option<Arc<AtomicBool>>,
        gate: Option<Arc<Attached>>,
    ) -> PeerHealth {
        PeerHealth {
            live: Mutex::new(Liveness::new(cfg, recover)),
            down: AtomicBool::new(false),
            gone: AtomicBool::new(false),
            why: Mutex::new(None),
            exited,
            gate,
            clock: Clock::Real,
        }
    }

    /// The same on `clock` (tests).
    #[cfg(test)]
    pub(crate) fn with_clock(self, clock: Clock) -> PeerHealth {
        PeerHealth { clock, ..self }
    }

    /// The time on its clock.
    pub(crate) fn now(&self) -> u64 {
        self.clock.now()
    }

    /// Feed `s` at `now` under the lock, with `also` run there too; the reason is kept when the peer was up
    /// or it is gone now. Returns `Liveness::feed`'s answer.
    pub(crate) fn feed(&self, now: u64, s: Signal, why: impl FnOnce() -> String, also: impl FnOnce()) -> bool {
        let mut l = self.live.lock();
        let r = l.feed(now, s);
        self.publish(&l, s, why);
        also();
        r
    }

    /// Make the machine's verdict after `s` what the lock-free readers see (called under `live`).
    fn publish(&self, l: &Liveness, s: Signal, why: impl FnOnce() -> String) {
        let verdict = l.verdict();
        if verdict == Verdict::Up {
            self.down.store(false, Ordering::Release);
            self.why.lock().take();
            return;
        }
        let news = !self.down.swap(true, Ordering::AcqRel);
        let gone = verdict == Verdict::Gone && !self.gone.swap(true, Ordering::AcqRel);
        if news || gone || matches!(s, Signal::DialFailed { .. }) {
            *self.why.lock() = Some(why());
        }
    }

    /// A handshake succeeded at `now`. Up: `current` says whether the connection may be used (made since the
    /// last failure). Down: the machine decides (a peer that is gone stays gone), and `also` runs on revival. Under
    /// the lock, so a failure fed at the same time is seen wholly before or after.
    pub(crate) fn handshake(&self, now: u64, current: impl FnOnce() -> bool, also: impl FnOnce()) -> bool {
        let mut l = self.live.lock();
        if !self.down.load(Ordering::Acquire) {
            return current();
        }
        if !l.feed(now, Signal::Handshake) {
            return false;
        }
        self.publish(&l, Signal::Handshake, String::new);
        also();
        true
    }

    /// The peer is gone for good (its incarnation proven gone by a route), saying `why`.
    pub(crate) fn kill(&self, why: impl FnOnce() -> String) {
        self.feed(self.now(), Signal::Gone, why, || {});
    }

    /// The verdict at `now`, every signal counted.
    pub(crate) fn verdict(&self, now: u64) -> Verdict {
        if self.ended() {
            return Verdict::Gone;
        }
        if !self.down.load(Ordering::Acquire) {
            return Verdict::Up;
        }
        match self.live.lock().verdict() {
            // A handshake revived the machine before `down` was cleared: a retry is due now.
            Verdict::Up => Verdict::DownUntil(now),
            v => v,
        }
    }

    /// This name is gone for good, or its process exited (without the lock: the copy path asks per batch).
    /// The gate's live flag, which the copy path checks itself on entering it, counts only in `verdict`.
    pub(crate) fn gone(&self) -> bool {
        self.gone.load(Ordering::Acquire) || self.exited.as_ref().is_some_and(|e| e.load(Ordering::Acquire))
    }

    /// Gone, or its incarnation's gate closed.
    fn ended(&self) -> bool {
        self.gone() || self.gate.as_ref().is_some_and(|g| !g.gate.live())
    }

    /// Not usable at `now`: gone, or down with no retry due.
    #[cfg(test)]
    pub(crate) fn down_at(&self, now: u64) -> bool {
        self.down_when(|| now)
    }

    /// `down_at` now, the clock read only when the peer is not plainly up (the post path asks).
    pub(crate) fn down_now(&self) -> bool {
        self.down_when(|| self.clock.now())
    }

    fn down_when(&self, now: impl Fn() -> u64) -> bool {
        if !self.down.load(Ordering::Acquire) && !self.ended() {
            return false;
        }
        let now = now();
        match self.verdict(now) {
            Verdict::Up => false,
            Verdict::DownUntil(t) => now < t,
            Verdict::Gone => true,
        }
    }

    /// Why it is down: what was fed, else what the signals read when asked say (a same-host peer whose exit only
    /// its pidfd saw, or whose gate closed, was fed nothing).
    pub(crate) fn why(&self) -> Option<String> {
        let fed = self.why.lock().clone();
        fed.or_else(|| match (self.exited.as_ref(), self.gate.as_ref()) {
            (Some(e), _) if e.load(Ordering::Acquire) => Some("its process exited (its pidfd said so)".into()),
            (_, Some(g)) if !g.gate.live() => Some("its incarnation ended (its gate closed)".into()),
            _ => None,
        })
    }
}

/// When the attempts of one dial happen: at once, then after 10 ms, 20 ms, ... (at most a quarter of the
/// budget apart), until `budget` ns after the start.
#[derive(Debug, Clone, Copy)]
pub struct DialPlan {
    start: u64,
    budget: u64,
    wait: u64,
}

impl DialPlan {
    pub fn new(start: u64, budget: u64) -> DialPlan {
        DialPlan { start, budget, wait: 10_000_000 }
    }

    /// After a failed attempt at `now`: how long to wait before the next one, or None when the budget is
    /// spent.
    pub fn next(&mut self, now: u64) -> Option<u64> {
        let end = self.start.saturating_add(self.budget);
        if now >= end {
            return None;
        }
        let w = self.wait.min(end - now).min((self.budget / 4).max(1_000_000));
        self.wait = self.wait.saturating_mul(2);
        Some(w)
    }

    /// Time left for an attempt that starts at `now`.
    pub fn left(&self, now: u64) -> u64 {
        self.start.saturating_add(self.budget).saturating_sub(now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn live() -> Liveness {
        Liveness::new(LiveCfg::for_timeout(1000 * MS), true)
    }

    #[test]
    fn idle_peer_has_no_timers() {
        let mut l = live();
        for t in [0, 10 * MS, 100_000 * MS] {
            assert_eq!(l.tick(t, 0, 0), Tick::default());
        }
        assert_eq!(l.verdict(), Verdict::Up);
    }

    #[test]
    fn heartbeats_while_busy_then_silence_is_down_within_the_timeout() {
        let mut l = live();
        // A request starts at t=0 (its start counts as a sign of life): the first ping is due 125 ms later.
        let t = l.tick(0, 1, 0);
        assert!(!t.ping && !t.down);
        assert_eq!(t.wake_in, Some(125 * MS));
        // Its bytes keep coming: never down, and never asked.
        for step in 1..=40u64 {
            let now = step * 25 * MS;
            let t = l.tick(now, 1, now - 10 * MS);
            assert!(!t.down && !t.ping, "pinged at {now} while its bytes arrive");
        }
        // Only pongs come (a slow request, nothing else heard): a ping every 125 ms, each answered in 10 ms.
        let (mut pings, mut rx) = (0, 1000 * MS - 10 * MS);
        for step in 41..=80u64 {
            let now = step * 25 * MS;
            let t = l.tick(now, 1, rx);
            assert!(!t.down);
            if t.ping {
                pings += 1;
                rx = now + 10 * MS;
            }
        }
        assert_eq!(pings, 6, "1 s of pings, each due 125 ms after the last answer (150 ms apart on 25 ms ticks)");
        // Then silence from t=2000 ms: down at 2750 ms, not before.
        let last = 2000 * MS;
        let mut at = None;
        for step in 0..100u64 {
            let now = last + step * 10 * MS;
            let t = l.tick(now, 1, last);
            if t.down {
                at = Some(now);
                break;
            }
            assert!(t.wake_in.unwrap() <= 750 * MS);
        }
        assert_eq!(at, Some(2750 * MS));
        assert!(matches!(l.verdict(), Verdict::DownUntil(_)));
        // Down: no more timers and no second "down".
        assert_eq!(l.tick(3000 * MS, 1, last), Tick::default());
    }

    /// The caller starved of CPU: its progress thread wakes 900 ms late, past the silence bound, its last ping
    /// answered long ago. It pings first and judges after the peer had half the bound to answer that ping; a
    /// peer that answers stays up, one that does not is down then (and a caller on time is judged as before).
    #[test]
    fn a_caller_starved_past_the_bound_pings_before_it_judges() {
        for answers in [true, false] {
            let mut l = live();
            assert!(!l.tick(0, 1, 0).ping);
            // Heard at 10 ms; the next tick is due at 135 ms but runs at 910 ms.
            let t = l.tick(910 * MS, 1, 10 * MS);
            assert!(t.ping && !t.down, "judged its own delay as the peer's silence");
            assert_eq!(t.wake_in, Some(125 * MS));
            let rx = if answers { 920 * MS } else { 10 * MS };
            assert!(!l.tick(1284 * MS, 1, rx).down);
            assert_eq!(l.tick(1285 * MS, 1, rx).down, !answers, "answers: {answers}");
        }
    }

    #[test]
    fn a_request_posted_right_at_the_deadline_is_not_a_false_death() {
        // Idle for an hour, then a request: its start refreshes the last sign of life, so the silence
        // deadline counts from then, not from the last pong an hour ago.
        let mut l = live();
        let hour = 3_600_000 * MS;
        let t = l.tick(hour, 1, hour);
        assert!(!t.down && !t.ping);
        // The same request with a stale last_rx (the race the caller must avoid) is not down at once either:
        // the ping it sends now gets half the silence bound to be answered, and no more.
        let mut l2 = live();
        let t = l2.tick(hour, 1, 0);
        assert!(t.ping && !t.down);
        assert_eq!(t.wake_in, Some(125 * MS));
        assert!(!l2.tick(hour + 374 * MS, 1, 0).down);
        assert!(l2.tick(hour + 375 * MS, 1, 0).down);
    }

    #[test]
    fn down_is_retried_with_back_off_and_recovers() {
        let mut l = live();
        assert!(l.feed(100 * MS, Signal::Broken));
        assert!(!l.feed(101 * MS, Signal::Broken), "news only once");
        // Retry after one timeout, not before.
        assert!(!l.may_dial(1099 * MS));
        assert!(l.may_dial(1100 * MS));
        // That dial fails (unreachable): the next one waits twice as long.
        l.feed(1200 * MS, Signal::DialFailed { proven: false });
        assert!(!l.may_dial(3199 * MS));
        assert!(l.may_dial(3200 * MS));
        l.feed(3300 * MS, Signal::DialFailed { proven: false });
        assert!(!l.may_dial(7299 * MS) && l.may_dial(7300 * MS));
        // Reachable again: up, and the back-off starts over.
        assert!(l.feed(0, Signal::Handshake));
        assert_eq!(l.verdict(), Verdict::Up);
        assert!(l.feed(8000 * MS, Signal::Broken));
        assert!(l.may_dial(9000 * MS));
    }

    #[test]
    fn back_off_is_capped() {
        let mut l = live();
        l.feed(0, Signal::Broken);
        let mut now = 0;
        for _ in 0..20 {
            now += 100_000 * MS;
            l.feed(now, Signal::DialFailed { proven: false });
        }
        let Verdict::DownUntil(retry_at) = l.verdict() else { panic!() };
        assert_eq!(retry_at - now, 16_000 * MS);
    }

    #[test]
    fn proven_failures_are_final() {
        let mut l = live();
        l.feed(0, Signal::DialFailed { proven: true });
        assert!(!l.may_dial(u64::MAX));
        assert!(!l.feed(0, Signal::Handshake), "a late handshake cannot undo a NAK");
        let mut l = live();
        l.feed(0, Signal::Broken);
        l.feed(5000 * MS, Signal::DialFailed { proven: true });
        assert!(!l.may_dial(u64::MAX));
        // A transient failure reported after the proof does not reopen it.
        l.feed(6000 * MS, Signal::DialFailed { proven: false });
        assert!(!l.may_dial(u64::MAX));
    }

    #[test]
    fn a_peer_that_may_not_recover_is_gone_at_its_first_failure_and_gone_is_final() {
        let cfg = LiveCfg::for_timeout(1000 * MS);
        let mut l = Liveness::new(cfg, false);
        assert!(l.feed(5 * MS, Signal::Broken));
        assert_eq!(l.verdict(), Verdict::Gone);
        assert!(!l.feed(u64::MAX, Signal::Handshake), "no way back");
        // Silence while busy (a ping unanswered for half the bound, the last sign of life long before): the same.
        let mut l = Liveness::new(cfg, false);
        assert!(!l.tick(2000 * MS, 1, 0).down);
        assert!(l.tick(2375 * MS, 1, 0).down);
        assert_eq!(l.verdict(), Verdict::Gone);
        // Any machine: a process that exited, or an incarnation proven gone, is gone, whatever came before
        // or comes after.
        let mut l = live();
        l.feed(0, Signal::Broken);
        assert!(matches!(l.verdict(), Verdict::DownUntil(_)));
        assert!(!l.feed(10 * MS, Signal::Gone), "not news: it was down already");
        assert_eq!(l.verdict(), Verdict::Gone);
        for s in [Signal::Handshake, Signal::Broken, Signal::DialFailed { proven: false }] {
            l.feed(20 * MS, s);
            assert_eq!(l.verdict(), Verdict::Gone);
        }
        assert_eq!(l.tick(30 * MS, 1, 0), Tick::default(), "no heartbeats to the gone");
    }

    #[test]
    fn the_shared_health_counts_every_signal_and_keeps_the_first_reason() {
        let cfg = LiveCfg::for_timeout(1000 * MS);
        let exited = Arc::new(AtomicBool::new(false));
        let h = PeerHealth::new(cfg, true, Some(exited.clone()), None);
        assert_eq!(h.verdict(0), Verdict::Up);
        assert!(!h.down_at(0) && h.why().is_none());
        // A broken connection: down until the back-off passes, the first reason kept.
        let mut bumped = 0;
        assert!(h.feed(100 * MS, Signal::Broken, || "reset".into(), || bumped += 1));
        assert!(!h.feed(150 * MS, Signal::Broken, || "again".into(), || bumped += 1));
        assert_eq!(bumped, 2, "`also` runs under the lock every time");
        assert_eq!(h.verdict(200 * MS), Verdict::DownUntil(1100 * MS));
        assert!(h.down_at(1099 * MS) && !h.down_at(1100 * MS) && !h.gone());
        assert_eq!(h.why().as_deref(), Some("reset"));
        // A retry that fails says why; one that succeeds revives it and forgets the reason.
        h.feed(1100 * MS, Signal::DialFailed { proven: false }, || "refused once".into(), || {});
        assert_eq!(h.why().as_deref(), Some("refused once"));
        assert!(h.feed(3200 * MS, Signal::Handshake, String::new, || {}));
        assert_eq!(h.verdict(3200 * MS), Verdict::Up);
        assert!(h.why().is_none());
        // Up: a handshake's connection is usable only if it is of the current epoch (the caller says).
        assert!(h.handshake(3300 * MS, || true, || panic!("not a revival")));
        assert!(!h.handshake(3300 * MS, || false, || {}));
        // Down, then a handshake: revived, `also` run.
        h.feed(3400 * MS, Signal::Broken, || "reset".into(), || {});
        let mut revived = false;
        assert!(h.handshake(4400 * MS, || false, || revived = true) && revived);
        assert_eq!(h.verdict(4400 * MS), Verdict::Up);
        // The process exits: gone, though nothing was fed (the pidfd watch sets the flag it reads), and says so.
        assert_eq!(h.why(), None);
        exited.store(true, Ordering::Release);
        assert_eq!(h.verdict(4500 * MS), Verdict::Gone);
        assert_eq!(h.why().as_deref(), Some("its process exited (its pidfd said so)"));
        assert!(h.gone() && h.down_at(u64::MAX));
        // `kill` is final for a name whose process still runs.
        let h = PeerHealth::new(cfg, true, None, None);
        h.kill(|| "gate faulted".into());
        assert!(h.gone() && !h.feed(0, Signal::Handshake, String::new, || {}));
        assert_eq!(h.why().as_deref(), Some("gate faulted"));
    }

    #[test]
    fn death_during_post_race_orderings() {
        // Every interleaving of "peer goes silent" and "request starts / ends" around the deadline.
        let cfg = LiveCfg::for_timeout(1000 * MS);
        for start in (0..2000).step_by(50) {
            for end in (start..3000).step_by(50) {
                let mut l = Liveness::new(cfg, true);
                let last_pong = 0;
                let mut down_at = None;
                for now in (0..3000).step_by(10) {
                    let inflight = usize::from(now >= start && now < end);
                    // The start of a request is a sign of life.
                    let last_rx = if now >= start { last_pong.max(start) } else { last_pong } * MS;
                    if l.tick(now * MS, inflight, last_rx).down {
                        down_at = Some(now);
                    }
                }
                match down_at {
                    // Down only while a request was in flight, and exactly 750 ms after the later of the
                    // last pong and the request's start.
                    Some(d) => {
                        assert!(d >= start && d < end, "start {start} end {end} down {d}");
                        assert_eq!(d, start.max(last_pong) + 750);
                    }
                    None => assert!(end - start <= 750, "start {start} end {end}: missed"),
                }
            }
        }
    }

    #[test]
    fn dial_plan_retries_inside_the_budget() {
        let mut p = DialPlan::new(0, 1000 * MS);
        let mut now = 0;
        let mut waits = Vec::new();
        while let Some(w) = p.next(now) {
            waits.push(w / MS);
            now += w + MS; // each attempt costs 1 ms
        }
        assert_eq!(&waits[..5], &[10, 20, 40, 80, 160]);
        assert!(waits.iter().all(|&w| w <= 250));
        assert!((1000 * MS..1300 * MS).contains(&now), "{now}");
        assert_eq!(p.left(2000 * MS), 0);
    }
}
