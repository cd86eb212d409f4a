//! Another agent of this process, found in the registry of live engines by its incarnation (never by what its
//! connection info claims): `memcpy` batch by batch inside its gate, notifications straight into its queue.

use std::any::Any;
use std::sync::{Arc, Weak};

use super::{Job, Prepared, Regions, Route, TcpLink, VramWay};
use crate::backend::engine::conn;
use crate::backend::engine::copy;
use crate::backend::engine::gate::Attached;
use crate::backend::engine::shared::Shared;
use crate::backend::{Seg, XferPlan};
use crate::status::{Error, Result};

pub(crate) struct InProcess {
    /// The peer's name, for errors.
    pub(crate) name: String,
    pub(crate) target: Weak<Shared>,
    /// None when no engine of that incarnation lives here (destroyed, or metadata that only claims to be from
    /// this process).
    pub(crate) gate: Option<Arc<Attached>>,
}

impl InProcess {
    fn destroyed(&self) -> Error {
        Error::disconnected(format!("agent '{}' has been destroyed", self.name))
    }
}

impl Route for InProcess {
    fn label(&self) -> &'static str {
        "in-process"
    }
    fn pid(&self) -> Option<i32> {
        None
    }
    fn cpu_copies(&self) -> bool {
        true
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
    fn notify(&self, from: &str, msg: &[u8]) -> Result<()> {
        let live = self.gate.as_ref().is_some_and(|g| g.gate.live());
        let t = self.target.upgrade().filter(|_| live).ok_or_else(|| self.destroyed())?;
        t.queue.lock().push((from.to_owned(), msg.to_vec()));
        Ok(())
    }
    fn link(&self) -> Option<&Arc<TcpLink>> {
        None
    }
    /// Through the device layer inside the peer's gate (`vram`).
    fn vram(&self, _plan: &XferPlan, _prepared: Option<&(dyn Any + Send + Sync)>) -> Result<VramWay> {
        Ok(VramWay::Local)
    }
    fn prepare(&self, _regions: &Regions<'_>) -> Option<Prepared> {
        None
    }
    fn copy(&self, job: &Job, segs: &[Seg]) -> Result<()> {
        let gate = self.gate.as_ref().ok_or_else(|| self.destroyed())?;
        copy::for_batches(segs, usize::MAX, copy::BATCH_BYTES, &mut |b| {
            if let Some(e) = job.stopped() {
                return Err(e);
            }
            let _inside = gate.enter(conn::gate_regions(job.keys))?;
            // SAFETY: local ranges were resolved against this agent's registrations; remote ones are inside
            // registrations the target still holds (the gate), which it cannot drop while we are inside.
            unsafe { copy::local_copy(job.op, b) };
            Ok(())
        })
    }
}
