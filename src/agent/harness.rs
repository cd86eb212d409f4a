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
}

impl BackendXfer for FakeXfer {
    fn post(&self, notif: Option<&[u8]>) -> Result<Status> {
        self.st.posts.fetch_add(1, Ordering::Relaxed);
        self.st.events.lock().push(Event::Post { notif: notif.map(<[u8]>::to_vec) });
        self.posted.store(true, Ordering::Release);
        self.aborted.store(false, Ordering::Release);
        Ok(if self.st.complete.load(Ordering::Acquire) { Status::Success } else { Status::InProg })
    }
    fn status(&self) -> Result<Status> {
        if self.aborted.load(Ordering::Acquire) {
            return Err(Error::new(Status::Canceled, "aborted"));
        }
        Ok(if self.st.complete.load(Ordering::Acquire) { Status::Success } else { Status::InProg })
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
        Ok(Box::new(FakeXfer { st: self.st.clone(), posted: AtomicBool::new(false), aborted: AtomicBool::new(false) }))
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
}
