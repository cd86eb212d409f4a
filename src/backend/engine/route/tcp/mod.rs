//! The TCP route: peers on other hosts, peers the kernel will not let us reach with cross-memory attach, and
//! every peer when `GIXL_TRANSPORT=tcp`. As a peer's `Route` (here): every request and notification over the
//! peer's link. Split by responsibility:
//! - `wire`: the wire format, as pure functions;
//! - `link`: the initiator's side of one peer (control and data connections, liveness, redial);
//! - `listen`: the listener and both ends of the control connections (the progress thread's TCP side);
//! - `serve`: the target's serving loops (data connections as state machines);
//! - `regions`: the target's region table and the leases its serving loops hold (what deregistration waits for);
//! - `stage` and `vram`: device memory over TCP, staged through page-locked buffers (target and initiator).

use std::any::Any;
use std::sync::atomic::Ordering;
use std::sync::Arc;

pub(crate) mod link;
pub(crate) mod listen;
pub(crate) mod regions;
pub(crate) mod serve;
pub(crate) mod stage;
pub(crate) mod vram;
pub mod wire;

use super::{Job, Prepared, Regions, Route, VramWay};
use crate::backend::engine::conn::RemoteRegion;
use crate::backend::{Seg, XferPlan};
use crate::status::Result;
use link::TcpLink;

pub(crate) struct Tcp {
    pub(crate) link: Arc<TcpLink>,
}

impl Route for Tcp {
    fn label(&self) -> &'static str {
        "tcp"
    }
    fn pid(&self) -> Option<i32> {
        None
    }
    fn cpu_copies(&self) -> bool {
        false
    }
    fn closed(&self) -> bool {
        self.link.closed()
    }
    fn why_down(&self) -> String {
        self.link.why().map(|w| format!(" ({w})")).unwrap_or_default()
    }
    fn connect(&self, _from: &str) -> Result<()> {
        self.link.connect().map(|_| ())
    }
    fn close(&self) {
        self.link.close()
    }
    fn notify(&self, _from: &str, msg: &[u8]) -> Result<()> {
        self.link.notif(msg)
    }
    fn link(&self) -> Option<&Arc<TcpLink>> {
        Some(&self.link)
    }
    /// Staged through page-locked host memory over the link (`vram`).
    fn vram(&self, _plan: &XferPlan, _prepared: Option<&(dyn Any + Send + Sync)>) -> Result<VramWay> {
        Ok(VramWay::Staged(self.link.clone()))
    }
    fn prepare(&self, _regions: &Regions<'_>) -> Option<Prepared> {
        None
    }
    fn copy(&self, job: &Job, segs: &[Seg]) -> Result<()> {
        // The target finds each segment's registration by the range its metadata names.
        let region = |s: &Seg| {
            job.keys
                .get(s.rreg as usize)
                .and_then(|k| k.as_ref())
                .and_then(|k| k.downcast_ref::<RemoteRegion>())
                .map_or((s.remote, s.len), |r| (r.addr, r.len))
        };
        let stop = || job.abort.load(Ordering::Relaxed);
        self.link.run(job.op, segs, &region, &stop)
    }
}
