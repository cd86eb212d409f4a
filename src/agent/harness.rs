//! A deterministic two-agent harness: a fake remote-capable backend whose transfers finish only when the
//! test says so and whose peers die on command. It lets the races that matter (peer dies mid-transfer,
//! invalidate during post, abort on release) run the same way every time.

use std::any::Any;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

use crate::backend::{Backend, BackendXfer, Caps, LocalRegion, Peer, Target, XferPlan};
use crate::mem::{MemType, RegDesc};
use crate::status::{Error, Result, Status};

/// What the fake backend was asked to do, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Post { notif: Option<Vec<u8>> },
    Abort,
}

#[derive(Default)]
pub struct FakeState {
    pub events: Mutex<Vec<Event>>,
    /// Transfers report InProg until this is set.
    pub complete: AtomicBool,
    /// When false, abort refuses (the transfer cannot be stopped).
    pub abortable: AtomicBool,
    pub peers: Mutex<Vec<Arc<FakePeer>>>,
    pub posts: AtomicU32,
    /// Per transfer made, in order: set to finish that one alone.
    pub done: Mutex<Vec<Arc<AtomicBool>>>,
}

pub struct Fake {
    pub st: Arc<FakeState>,
}

pub struct FakePeer {
    pub dead: AtomicBool,
}

impl Peer for FakePeer {
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn disconnected(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }
}

struct FakeXfer {
    st: Arc<FakeState>,
    posted: AtomicBool,
    aborted: AtomicBool,
    done: Arc<AtomicBool>,
}

impl FakeXfer {
    fn finished(&self) -> bool {
        self.st.complete.load(Ordering::Acquire) || self.done.load(Ordering::Acquire)
    }
}

impl BackendXfer for FakeXfer {
    fn post(&self, notif: Option<&[u8]>) -> Result<Status> {
        self.st.posts.fetch_add(1, Ordering::Relaxed);
        self.st.events.lock().push(Event::Post { notif: notif.map(<[u8]>::to_vec) });
        self.posted.store(true, Ordering::Release);
        self.aborted.store(false, Ordering::Release);
        self.done.store(false, Ordering::Release);
        Ok(if self.finished() { Status::Success } else { Status::InProg })
    }
    fn status(&self) -> Result<Status> {
        if self.aborted.load(Ordering::Acquire) {
            return Err(Error::new(Status::Canceled, "aborted"));
        }
        Ok(if self.finished() { Status::Success } else { Status::InProg })
    }
    fn abort(&self) -> bool {
        self.st.events.lock().push(Event::Abort);
        let ok = self.st.abortable.load(Ordering::Acquire);
        if ok {
            self.aborted.store(true, Ordering::Release);
        }
        ok
    }
    fn completed_at(&self) -> Option<Instant> {
        None
    }
}

impl Backend for Fake {
    fn name(&self) -> &'static str {
        "UCX"
    }
    fn caps(&self) -> Caps {
        Caps { local: true, remote: true, notif: true, mems: vec![MemType::Dram] }
    }
    fn register(&self, _mem: MemType, _desc: &RegDesc) -> Result<LocalRegion> {
        Ok(LocalRegion { public: b"k".to_vec(), key: None })
    }
    fn conn_info(&self) -> Vec<u8> {
        b"fake".to_vec()
    }
    fn load_peer(&self, _agent: &str, _inc: u128, _conn: &[u8]) -> Result<Arc<dyn Peer>> {
        let p = Arc::new(FakePeer { dead: AtomicBool::new(false) });
        self.st.peers.lock().push(p.clone());
        Ok(p)
    }
    fn prep_xfer(&self, _plan: XferPlan) -> Result<Box<dyn BackendXfer>> {
        let done = Arc::new(AtomicBool::new(false));
        self.st.done.lock().push(done.clone());
        Ok(Box::new(FakeXfer {
            st: self.st.clone(),
            posted: AtomicBool::new(false),
            aborted: AtomicBool::new(false),
            done,
        }))
    }
    fn notifs(&self, _out: &mut Vec<(String, Vec<u8>)>) -> Result<()> {
        Ok(())
    }
    fn gen_notif(&self, _t: &Target, _m: &[u8]) -> Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::{Agent, AgentConfig, BackendId, BackendSlot, NotifUpdate, XferOpts};
    use crate::backend::XferOp;
    use crate::mem::{Desc, XferDList};
    use crate::RegDList;

    /// An agent whose only backend is the fake, with one registered region at a made-up address.
    fn fake_agent(name: &str, cfg: AgentConfig) -> (Agent, Arc<FakeState>) {
        let a = Agent::new(name, cfg).unwrap();
        let st = Arc::new(FakeState::default());
        st.abortable.store(true, Ordering::Release);
        let be: Arc<dyn Backend> = Arc::new(Fake { st: st.clone() });
        let caps = be.caps();
        a.inner.backends.write().push(Arc::new(BackendSlot {
            id: BackendId(0),
            name: "UCX",
            caps,
            params: Default::default(),
            be,
        }));
        let l = RegDList::with_descs(MemType::Dram, vec![RegDesc { desc: Desc::new(0x10000, 4096, 0), meta: vec![] }]);
        a.register_mem(&l, &[]).unwrap();
        (a, st)
    }

    fn pair(cfg: AgentConfig) -> (Agent, Arc<FakeState>, Agent, crate::XferReq) {
        let (d, dst) = fake_agent("decode", cfg.clone());
        let (p, _) = fake_agent("prefill", cfg);
        d.load_remote_md(&p.local_md().unwrap()).unwrap();
        let descs = XferDList::with_descs(MemType::Dram, vec![Desc::new(0x10000, 4096, 0)]);
        let opts = XferOpts { notif: Some(b"n".to_vec()), ..Default::default() };
        let r = d.create_xfer_req(XferOp::Read, &descs, &descs, "prefill", &opts).unwrap();
        (d, dst, p, r)
    }

    #[test]
    fn peer_dies_mid_transfer_gives_remote_disconnect_on_the_next_poll() {
        let (d, st, _p, r) = pair(AgentConfig::default());
        assert_eq!(d.post_xfer_req(&r, NotifUpdate::Keep).unwrap(), Status::InProg);
        assert_eq!(d.xfer_status(&r).unwrap(), Status::InProg);
        st.peers.lock()[0].dead.store(true, Ordering::Release);
        assert_eq!(d.xfer_status(&r).unwrap_err().status(), Status::RemoteDisconnect);
        // The in-flight transfer was stopped, and the status stays put.
        assert!(st.events.lock().contains(&Event::Abort));
        assert_eq!(d.xfer_status(&r).unwrap_err().status(), Status::RemoteDisconnect);
        // NIXL 1.5: no automatic invalidation; the peer stays loaded until the caller drops it.
        assert!(d.check_remote_md("prefill", &XferDList::new(MemType::Dram)).is_ok());
        assert_eq!(d.post_xfer_req(&r, NotifUpdate::Keep).unwrap_err().status(), Status::RemoteDisconnect);
    }

    #[test]
    fn nixl_14_mode_invalidates_a_disconnected_peer() {
        let cfg = AgentConfig { invalidate_on_disconnect: true, ..Default::default() };
        let (d, st, p, r) = pair(cfg);
        d.post_xfer_req(&r, NotifUpdate::Keep).unwrap();
        st.peers.lock()[0].dead.store(true, Ordering::Release);
        assert_eq!(d.xfer_status(&r).unwrap_err().status(), Status::RemoteDisconnect);
        assert_eq!(
            d.check_remote_md("prefill", &XferDList::new(MemType::Dram)).unwrap_err().status(),
            Status::NotFound
        );
        // Now stale rather than disconnected, and a new incarnation can be loaded without invalidating.
        assert_eq!(d.post_xfer_req(&r, NotifUpdate::Keep).unwrap_err().status(), Status::NotFound);
        drop(p);
        let (p2, _) = fake_agent("prefill", AgentConfig::default());
        d.load_remote_md(&p2.local_md().unwrap()).unwrap();
    }

    #[test]
    fn invalidate_while_in_progress_aborts_and_reports_not_found() {
        let (d, st, _p, r) = pair(AgentConfig::default());
        assert_eq!(d.post_xfer_req(&r, NotifUpdate::Keep).unwrap(), Status::InProg);
        d.invalidate_remote_md("prefill").unwrap();
        assert_eq!(d.xfer_status(&r).unwrap_err().status(), Status::NotFound);
        assert_eq!(st.events.lock().last(), Some(&Event::Abort));
        assert_eq!(d.estimate_xfer_cost(&r).unwrap_err().status(), Status::NotFound);
        d.release_xfer_req(&r).unwrap();
    }

    #[test]
    fn repost_while_active_and_release_that_cannot_abort() {
        let (d, st, _p, r) = pair(AgentConfig::default());
        st.abortable.store(false, Ordering::Release);
        d.post_xfer_req(&r, NotifUpdate::Keep).unwrap();
        assert_eq!(d.post_xfer_req(&r, NotifUpdate::Keep).unwrap_err().status(), Status::RepostActive);
        assert_eq!(d.release_xfer_req(&r).unwrap_err().status(), Status::RepostActive);
        assert!(!r.is_released());
        st.complete.store(true, Ordering::Release);
        assert_eq!(d.xfer_status(&r).unwrap(), Status::Success);
        // Done: repost allowed; notification rules: Keep, Clear, Set.
        d.post_xfer_req(&r, NotifUpdate::Keep).unwrap();
        d.post_xfer_req(&r, NotifUpdate::Clear).unwrap();
        d.post_xfer_req(&r, NotifUpdate::Set(b"x".to_vec())).unwrap();
        let posts: Vec<_> = st
            .events
            .lock()
            .iter()
            .filter_map(|e| match e {
                Event::Post { notif } => Some(notif.clone()),
                _ => None,
            })
            .collect();
        assert_eq!(posts, vec![Some(b"n".to_vec()), Some(b"n".to_vec()), None, Some(b"x".to_vec())]);
        d.release_xfer_req(&r).unwrap();
        assert!(r.is_released());
    }

    #[test]
    fn invalidate_racing_posts_from_other_threads_is_safe() {
        for _ in 0..50 {
            let (d, st, _p, r) = pair(AgentConfig::default());
            st.complete.store(true, Ordering::Release);
            let d = Arc::new(d);
            let go = Arc::new(std::sync::Barrier::new(3));
            let posters: Vec<_> = (0..2)
                .map(|_| {
                    let (d, r, go) = (d.clone(), r.clone(), go.clone());
                    std::thread::spawn(move || {
                        go.wait();
                        let mut seen_stale = false;
                        for _ in 0..200 {
                            match d.post_xfer_req(&r, NotifUpdate::Keep) {
                                Ok(s) => {
                                    assert!(!seen_stale, "a post succeeded after one was refused as stale");
                                    assert_eq!(s, Status::Success);
                                }
                                Err(e) => {
                                    assert_eq!(e.status(), Status::NotFound);
                                    seen_stale = true;
                                }
                            }
                        }
                    })
                })
                .collect();
            go.wait();
            d.invalidate_remote_md("prefill").unwrap();
            for t in posters {
                t.join().unwrap();
            }
            assert_eq!(d.post_xfer_req(&r, NotifUpdate::Keep).unwrap_err().status(), Status::NotFound);
        }
    }

    #[test]
    fn identical_reload_keeps_handles_and_merges_new_regions() {
        let (d, st, p, r) = pair(AgentConfig::default());
        st.complete.store(true, Ordering::Release);
        let more =
            RegDList::with_descs(MemType::Dram, vec![RegDesc { desc: Desc::new(0x90000, 4096, 0), meta: vec![] }]);
        p.register_mem(&more, &[]).unwrap();
        d.load_remote_md(&p.local_md().unwrap()).unwrap();
        assert_eq!(d.post_xfer_req(&r, NotifUpdate::Keep).unwrap(), Status::Success);
        let both = XferDList::with_descs(MemType::Dram, vec![Desc::new(0x10000, 8, 0), Desc::new(0x90000, 8, 0)]);
        d.check_remote_md("prefill", &both).unwrap();
        // A partial reload without connection info merges too.
        let third =
            RegDList::with_descs(MemType::Dram, vec![RegDesc { desc: Desc::new(0xa0000, 64, 0), meta: vec![] }]);
        p.register_mem(&third, &[]).unwrap();
        d.load_remote_md(&p.local_partial_md(&third, false, &[]).unwrap()).unwrap();
        d.check_remote_md("prefill", &third.trim()).unwrap();
    }

    // ----- the overlap check (`GIXL_CHECK_OVERLAP`, `crate::overlap`) -----

    const BUF: u64 = 0x10000;

    /// Two fake agents with the check in `mode`, and 64 KiB registered on each at `BUF`.
    fn checked(mode: crate::overlap::Mode) -> (Agent, Arc<FakeState>, Agent) {
        let cfg = AgentConfig { check_overlap: mode, ..Default::default() };
        let (d, st) = fake_agent("decode", cfg.clone());
        let (p, _) = fake_agent("prefill", cfg);
        let more = RegDList::with_descs(
            MemType::Dram,
            vec![RegDesc { desc: Desc::new(BUF + 4096, 60 << 10, 0), meta: vec![] }],
        );
        d.register_mem(&more, &[]).unwrap();
        p.register_mem(&more, &[]).unwrap();
        d.load_remote_md(&p.local_md().unwrap()).unwrap();
        (d, st, p)
    }

    /// A request of `op` moving `(local offset, remote offset, len)` pieces, with notification `notif`.
    fn req(d: &Agent, op: XferOp, pieces: &[(u64, u64, u64)], notif: &str) -> crate::XferReq {
        let l = XferDList::with_descs(MemType::Dram, pieces.iter().map(|p| Desc::new(BUF + p.0, p.2, 0)).collect());
        let r = XferDList::with_descs(MemType::Dram, pieces.iter().map(|p| Desc::new(BUF + p.1, p.2, 0)).collect());
        let opts = XferOpts { notif: Some(notif.as_bytes().to_vec()), ..Default::default() };
        d.create_xfer_req(op, &l, &r, "prefill", &opts).unwrap()
    }

    fn post(d: &Agent, r: &crate::XferReq) -> Result<Status> {
        d.post_xfer_req(r, NotifUpdate::Keep)
    }

    /// The same local range twice (two READs into one block): `warn` lets the second go and counts it.
    #[test]
    fn overlap_warn_counts_the_same_local_range_twice() {
        let (d, _st, _p) = checked(crate::overlap::Mode::Warn);
        let a = req(&d, XferOp::Read, &[(0, 0, 4096)], "a");
        let b = req(&d, XferOp::Read, &[(2048, 8192, 2048)], "b");
        assert_eq!(post(&d, &a).unwrap(), Status::InProg);
        assert_eq!(post(&d, &b).unwrap(), Status::InProg);
        assert_eq!(d.overlap_counts(), (1, 0));
    }

    /// `refuse`: the second post fails with NOT_ALLOWED naming the first, moves nothing (the backend never sees
    /// it), and the first goes on; once the first has finished, the second is allowed.
    #[test]
    fn overlap_refuse_fails_the_second_post_and_leaves_the_first() {
        let (d, st, _p) = checked(crate::overlap::Mode::Refuse);
        let a = req(&d, XferOp::Read, &[(0, 0, 4096)], "first");
        let b = req(&d, XferOp::Read, &[(4000, 8192, 96)], "second");
        assert_eq!(post(&d, &a).unwrap(), Status::InProg);
        let posts = st.posts.load(Ordering::Relaxed);
        let e = post(&d, &b).unwrap_err();
        assert_eq!(e.status(), Status::NotAllowed);
        let m = e.to_string();
        for want in ["\"first\"", "\"second\"", "READ from 'prefill'", "[0x10fa0, 0x11000)", "refused"] {
            assert!(m.contains(want), "{want} missing from: {m}");
        }
        assert_eq!(st.posts.load(Ordering::Relaxed), posts, "the refused post reached the backend");
        assert_eq!(d.xfer_status(&b).unwrap_err().status(), Status::NotPosted);
        assert_eq!(d.xfer_status(&a).unwrap(), Status::InProg);
        st.done.lock()[0].store(true, Ordering::Release);
        assert_eq!(d.xfer_status(&a).unwrap(), Status::Success);
        assert_eq!(post(&d, &b).unwrap(), Status::InProg, "after completion: no conflict");
        assert_eq!(d.overlap_counts(), (1, 0));
    }

    /// Adjacent ranges never conflict; nor do two WRITEs from one local buffer (both read it); a READ into the
    /// buffer a WRITE sends from does, where they meet only.
    #[test]
    fn overlap_adjacent_and_read_write_from_one_buffer() {
        let (d, _st, _p) = checked(crate::overlap::Mode::Refuse);
        let w = req(&d, XferOp::Write, &[(0, 0, 4096)], "w");
        assert_eq!(post(&d, &w).unwrap(), Status::InProg);
        let w2 = req(&d, XferOp::Write, &[(0, 4096, 4096)], "w2");
        assert_eq!(post(&d, &w2).unwrap(), Status::InProg, "a second WRITE of the same local block");
        let next = req(&d, XferOp::Read, &[(4096, 16384, 4096)], "next");
        assert_eq!(post(&d, &next).unwrap(), Status::InProg, "a READ into the adjacent block");
        let into = req(&d, XferOp::Read, &[(4095, 32768, 1)], "into");
        assert_eq!(post(&d, &into).unwrap_err().status(), Status::NotAllowed, "a READ into the block sent");
        // Remote side: a READ of what a WRITE writes there.
        let back = req(&d, XferOp::Read, &[(40960, 4096 + 100, 10)], "back");
        assert_eq!(post(&d, &back).unwrap_err().status(), Status::NotAllowed);
        assert_eq!(d.overlap_counts(), (2, 0));
    }

    /// A request the engine has finished leaves the table even if nobody polled it; one released or dropped
    /// leaves at once; a re-post of a finished handle is checked again.
    #[test]
    fn overlap_table_follows_completion_release_drop_and_repost() {
        let (d, st, _p) = checked(crate::overlap::Mode::Refuse);
        let a = req(&d, XferOp::Read, &[(0, 0, 4096)], "a");
        let b = req(&d, XferOp::Read, &[(0, 4096, 4096)], "b");
        assert_eq!(post(&d, &a).unwrap(), Status::InProg);
        st.done.lock()[0].store(true, Ordering::Release);
        assert_eq!(post(&d, &b).unwrap(), Status::InProg, "a finished (unpolled): no conflict");
        // Re-posting a finished handle is checked again: now b holds the block.
        assert_eq!(post(&d, &a).unwrap_err().status(), Status::NotAllowed);
        st.abortable.store(true, Ordering::Release);
        d.release_xfer_req(&b).unwrap();
        assert_eq!(post(&d, &a).unwrap(), Status::InProg, "b released");
        let c = req(&d, XferOp::Write, &[(0, 8192, 4096)], "c");
        assert_eq!(post(&d, &c).unwrap_err().status(), Status::NotAllowed);
        drop(a);
        assert_eq!(post(&d, &c).unwrap(), Status::InProg, "a dropped");
    }

    /// Across threads: of two conflicting posts racing, exactly one goes through under `refuse`.
    #[test]
    fn overlap_check_holds_across_threads() {
        let (d, st, _p) = checked(crate::overlap::Mode::Refuse);
        let d = Arc::new(d);
        for round in 0..200u64 {
            let reqs: Vec<_> = (0..2).map(|i| req(&d, XferOp::Read, &[(i * 8, 0, 4000)], "t")).collect();
            let go = Arc::new(std::sync::Barrier::new(2));
            let threads: Vec<_> = reqs
                .iter()
                .map(|r| {
                    let (d, r, go) = (d.clone(), r.clone(), go.clone());
                    std::thread::spawn(move || {
                        go.wait();
                        d.post_xfer_req(&r, NotifUpdate::Keep).map_err(|e| e.status())
                    })
                })
                .collect();
            let got: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
            let ok = got.iter().filter(|g| **g == Ok(Status::InProg)).count();
            let refused = got.iter().filter(|g| **g == Err(Status::NotAllowed)).count();
            assert_eq!((ok, refused), (1, 1), "round {round}: {got:?}");
            for done in st.done.lock().iter() {
                done.store(true, Ordering::Release);
            }
        }
        assert_eq!(d.overlap_counts(), (200, 0));
    }

    /// Off (the default): nothing is tracked, nothing refused.
    #[test]
    fn overlap_check_off_tracks_nothing() {
        let (d, _st, _p) = checked(crate::overlap::Mode::Off);
        let a = req(&d, XferOp::Read, &[(0, 0, 4096)], "a");
        let b = req(&d, XferOp::Read, &[(0, 0, 4096)], "b");
        assert_eq!(post(&d, &a).unwrap(), Status::InProg);
        assert_eq!(post(&d, &b).unwrap(), Status::InProg);
        assert_eq!(d.overlap_counts(), (0, 0));
        assert!(d.inner.overlap.is_none());
    }
}
