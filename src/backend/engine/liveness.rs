//! Liveness of one TCP peer as a state machine: it takes what happened and the time, and says what to do
//! (ping, declare the peer down) and when to look again. It owns no socket and reads no clock, so the
//! progress thread drives it with the real time and the tests below with a fake one.
//!
//! Rules:
//! - Heartbeats only while requests are in flight: a ping every `ping_every`, and the peer is down when
//!   nothing (a pong, or data progress) has arrived for `silence`. An idle peer has no timers at all.
//! - "Down" is not "dead": a peer that went silent, reset a connection or could not be dialed is retried,
//!   with back-off between attempts (`backoff_min`, doubling up to `backoff_max`), and is up again after a
//!   successful handshake, which proves the same incarnation is there. Requests in flight when it went
//!   down fail; requests posted while a retry is not due fail at once.
//! - "Proven" failures are final: the target answered our HELLO with NAK (another incarnation, or the
//!   metadata is stale) or refused the connection (its listener, which lives as long as the agent, is
//!   gone). Only remove / re-add (a new incarnation) helps then.
//! - A dial retries inside the disconnect timeout (`DialPlan`), so a target busy for a moment, or with its
//!   handshake slots briefly taken by strangers, costs a little latency, not the peer.

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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    Up,
    /// Down since `since`; a new connection may be tried from `retry_at` unless `proven`.
    Down {
        since: u64,
        retry_at: u64,
        proven: bool,
    },
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
    health: Health,
    next_ping: Option<u64>,
    backoff: u64,
}

impl Liveness {
    pub fn new(cfg: LiveCfg) -> Liveness {
        Liveness { cfg, health: Health::Up, next_ping: None, backoff: cfg.backoff_min }
    }

    #[cfg(test)]
    pub fn health(&self) -> Health {
        self.health
    }

    /// Heartbeats: `inflight` requests are running and the last sign of life came at `last_rx`.
    pub fn tick(&mut self, now: u64, inflight: usize, last_rx: u64) -> Tick {
        if self.health != Health::Up || inflight == 0 {
            self.next_ping = None;
            return Tick::default();
        }
        let deadline = last_rx.saturating_add(self.cfg.silence);
        if now >= deadline {
            self.went_down(now, false);
            return Tick { down: true, ..Tick::default() };
        }
        let due = *self.next_ping.get_or_insert(now);
        let ping = now >= due;
        if ping {
            self.next_ping = Some(now + self.cfg.ping_every);
        }
        let soonest = deadline.min(self.next_ping.unwrap_or(deadline));
        Tick { ping, down: false, wake_in: Some(soonest - now) }
    }

    /// A connection broke (reset, end of stream, I/O error) or the peer went silent. Returns true when
    /// this is news (the peer was up).
    pub fn broken(&mut self, now: u64) -> bool {
        let was_up = self.health == Health::Up;
        if was_up {
            self.went_down(now, false);
        }
        was_up
    }

    /// A dial failed; `proven` when the target said the incarnation is not there.
    pub fn dial_failed(&mut self, now: u64, proven: bool) {
        match self.health {
            Health::Down { proven: true, .. } => {}
            Health::Up => self.went_down(now, proven),
            Health::Down { since, .. } => {
                let retry_at = now.saturating_add(self.backoff);
                self.backoff = (self.backoff.saturating_mul(2)).min(self.cfg.backoff_max);
                self.health = Health::Down { since, retry_at, proven };
            }
        }
    }

    /// A handshake succeeded: the same incarnation answers. Up again (unless a proven failure came first:
    /// that one is final).
    pub fn dial_ok(&mut self) -> bool {
        match self.health {
            Health::Down { proven: true, .. } => false,
            _ => {
                self.health = Health::Up;
                self.backoff = self.cfg.backoff_min;
                true
            }
        }
    }

    /// May a request try to (re)connect now? Up, or down for a reason that is not proven and past its
    /// back-off.
    pub fn may_dial(&self, now: u64) -> bool {
        match self.health {
            Health::Up => true,
            Health::Down { proven, retry_at, .. } => !proven && now >= retry_at,
        }
    }

    fn went_down(&mut self, now: u64, proven: bool) {
        self.next_ping = None;
        let retry_at = now.saturating_add(self.backoff);
        self.backoff = (self.backoff.saturating_mul(2)).min(self.cfg.backoff_max);
        self.health = Health::Down { since: now, retry_at, proven };
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
        Liveness::new(LiveCfg::for_timeout(1000 * MS))
    }

    #[test]
    fn idle_peer_has_no_timers() {
        let mut l = live();
        for t in [0, 10 * MS, 100_000 * MS] {
            assert_eq!(l.tick(t, 0, 0), Tick::default());
        }
        assert_eq!(l.health(), Health::Up);
    }

    #[test]
    fn heartbeats_while_busy_then_silence_is_down_within_the_timeout() {
        let mut l = live();
        // A request starts at t=0 (its start counts as a sign of life).
        let t = l.tick(0, 1, 0);
        assert!(t.ping && !t.down);
        assert_eq!(t.wake_in, Some(125 * MS));
        // Pongs keep coming: never down, a ping every 125 ms.
        let mut pings = 1;
        for step in 1..=80u64 {
            let now = step * 25 * MS;
            let t = l.tick(now, 1, now - 10 * MS);
            assert!(!t.down);
            pings += t.ping as u32;
        }
        assert_eq!(pings, 17, "2 s of 125 ms pings");
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
        assert!(matches!(l.health(), Health::Down { proven: false, .. }));
        // Down: no more timers and no second "down".
        assert_eq!(l.tick(3000 * MS, 1, last), Tick::default());
    }

    #[test]
    fn a_request_posted_right_at_the_deadline_is_not_a_false_death() {
        // Idle for an hour, then a request: its start refreshes the last sign of life, so the silence
        // deadline counts from then, not from the last pong an hour ago.
        let mut l = live();
        let hour = 3_600_000 * MS;
        let t = l.tick(hour, 1, hour);
        assert!(!t.down && t.ping);
        // The same request with a stale last_rx (the race the caller must avoid) would be down at once:
        let mut l2 = live();
        assert!(l2.tick(hour, 1, 0).down);
    }

    #[test]
    fn down_is_retried_with_back_off_and_recovers() {
        let mut l = live();
        assert!(l.broken(100 * MS));
        assert!(!l.broken(101 * MS), "news only once");
        // Retry after one timeout, not before.
        assert!(!l.may_dial(1099 * MS));
        assert!(l.may_dial(1100 * MS));
        // That dial fails (unreachable): the next one waits twice as long.
        l.dial_failed(1200 * MS, false);
        assert!(!l.may_dial(3199 * MS));
        assert!(l.may_dial(3200 * MS));
        l.dial_failed(3300 * MS, false);
        assert!(!l.may_dial(7299 * MS) && l.may_dial(7300 * MS));
        // Reachable again: up, and the back-off starts over.
        assert!(l.dial_ok());
        assert_eq!(l.health(), Health::Up);
        assert!(l.broken(8000 * MS));
        assert!(l.may_dial(9000 * MS));
    }

    #[test]
    fn back_off_is_capped() {
        let mut l = live();
        l.broken(0);
        let mut now = 0;
        for _ in 0..20 {
            now += 100_000 * MS;
            l.dial_failed(now, false);
        }
        let Health::Down { retry_at, .. } = l.health() else { panic!() };
        assert_eq!(retry_at - now, 16_000 * MS);
    }

    #[test]
    fn proven_failures_are_final() {
        let mut l = live();
        l.dial_failed(0, true);
        assert!(!l.may_dial(u64::MAX));
        assert!(!l.dial_ok(), "a late handshake cannot undo a NAK");
        let mut l = live();
        l.broken(0);
        l.dial_failed(5000 * MS, true);
        assert!(!l.may_dial(u64::MAX));
        // A transient failure reported after the proof does not reopen it.
        l.dial_failed(6000 * MS, false);
        assert!(!l.may_dial(u64::MAX));
    }

    #[test]
    fn death_during_post_race_orderings() {
        // Every interleaving of "peer goes silent" and "request starts / ends" around the deadline.
        let cfg = LiveCfg::for_timeout(1000 * MS);
        for start in (0..2000).step_by(50) {
            for end in (start..3000).step_by(50) {
                let mut l = Liveness::new(cfg);
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
